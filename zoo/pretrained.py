"""The hf oracle: ``mz.load_model(folder)`` is ``Class.from_pretrained(folder)`` for what ``save_pretrained`` wrote.

Each case saves one variant of the eight (sharded or one file, safetensors or torch ``.bin``, fp32 or bf16),
chosen by a stable hash of the class name, so one case stays short and the zoo covers every variant. The
``.bin`` variant is the safetensors save rewritten as torch files with their index, as older transformers
wrote them (``save_pretrained`` of transformers 5 writes safetensors only).
"""

from __future__ import annotations

import inspect
import json
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors.torch import load_file
from torch import nn

import materialize as mz
from zoo.differential import compare_models, compare_outputs, flat_outputs, perturb
from zoo.outcomes import Different, Skipped, one_line

VARIANTS = [(sharded, kind, dtype) for sharded in (False, True) for kind in ("safetensors", "bin")
            for dtype in ("fp32", "bf16")]
SHARD_SIZE = "40KB"
SOURCE_SEED = 1234


def variant_of(name: str) -> tuple[bool, str, str]:
    return VARIANTS[zlib.crc32(name.encode()) % len(VARIANTS)]


def describe_variant(variant: tuple[bool, str, str]) -> str:
    sharded, kind, dtype = variant
    return f"{'sharded' if sharded else 'one file'}, {kind}, {dtype}"


def save(model: nn.Module, folder: Path, variant: tuple[bool, str, str]) -> Path:
    sharded, kind, dtype = variant
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(folder, max_shard_size=SHARD_SIZE if sharded else "50GB")
    if kind == "bin":
        _as_torch_files(folder)
    return folder


def _as_torch_files(folder: Path) -> None:
    index_file = folder / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index_file.read_text())["weight_map"].values())) if index_file.exists() \
        else ["model.safetensors"]
    weight_map = {}
    for shard in shards:
        tensors = load_file(folder / shard)  # the names as saved, which may differ from the module's
        bin_name = shard.replace("model", "pytorch_model", 1).replace(".safetensors", ".bin")
        torch.save(tensors, folder / bin_name)
        weight_map.update({n: bin_name for n in tensors})
        (folder / shard).unlink()
    if index_file.exists():
        index_file.unlink()
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _config_value(config: Any, *names: str) -> Optional[Any]:
    for holder in (config, getattr(config, "vision_config", None), getattr(config, "text_config", None)):
        for name in names:
            value = getattr(holder, name, None) if holder is not None else None
            if value is not None:
                return value
    return None


def generic_inputs(model: nn.Module) -> Optional[dict[str, torch.Tensor]]:
    """A tiny input for a forward whose arguments are the usual ones, or None where there is no such input."""
    params = inspect.signature(model.forward).parameters
    config = model.config
    g = torch.Generator().manual_seed(3)
    required = [n for n, p in params.items() if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    inputs: dict[str, torch.Tensor] = {}
    vocab = _config_value(config, "vocab_size")
    if "input_ids" in params and isinstance(vocab, int):
        high = min(vocab, 60)  # below the token ids tiny configs move to the top of the vocabulary
        inputs["input_ids"] = torch.randint(4, max(high, 5), (1, 7), generator=g)
        if "decoder_input_ids" in params:
            inputs["decoder_input_ids"] = inputs["input_ids"][:, :4]
    elif "pixel_values" in params:
        side = _config_value(config, "image_size")
        side = side[0] if isinstance(side, (list, tuple)) else side
        channels = _config_value(config, "num_channels") or 3
        if not isinstance(side, int):
            return None
        inputs["pixel_values"] = torch.randn(1, channels, side, side, generator=g)
    elif "input_values" in params:
        inputs["input_values"] = torch.randn(1, 4000, generator=g)
    else:
        return None
    return inputs if set(required) <= set(inputs) else None


def _run(model: nn.Module, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    model.eval()
    with torch.no_grad():
        torch.manual_seed(5)
        output = model(**inputs)
    return flat_outputs(output.to_tuple() if hasattr(output, "to_tuple") else output)


def compare_forwards(model: nn.Module, reference: nn.Module, inputs: Optional[dict[str, Any]],
                     run: Callable[[nn.Module, dict[str, Any]], list[torch.Tensor]], notes: list[str]) -> list[str]:
    """The differences of ``run(model, inputs)`` from ``run(reference, inputs)`` (none where the reference's own
    forward fails, or no input is known: said in ``notes``), forgiven where copying the reference's tensors to
    aligned memory, as ours are, makes them equal."""
    if inputs is None:
        notes.append("forward not compared: no generic input for its arguments")
        return []
    try:
        expected = run(reference, inputs)
    except Exception as error:
        notes.append(f"forward not compared: the reference's raises {one_line(error, 150)}")
        return []
    ours = run(model, inputs)
    differences = compare_outputs(ours, expected, "forward")
    if differences and not compare_outputs(ours, run(_aligned(reference), inputs), "forward"):
        notes.append("forward equal once from_pretrained's tensors are copied to aligned memory as ours are "
                     "(its maps leave them 16-byte aligned; some kernels round otherwise)")
        differences = []
    return [f"[forward] {d}" for d in differences]


def _aligned(model: nn.Module) -> nn.Module:
    """``model`` with every tensor's values copied into memory of its own (allocator-aligned), in place."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()
    return model


def _attributes(model: nn.Module) -> dict[str, tuple[bool, dict]]:
    """Each tensor's requires_grad and Python attributes as eager construction made them."""
    return {name: (tensor.requires_grad, dict(tensor.__dict__))
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]}


def as_promised(reference: nn.Module, eager_attributes: dict[str, tuple[bool, dict]]) -> None:
    """``from_pretrained``'s model with the differences docs/huggingface.md lists on purpose put back as the
    load promises them: a parameter its constructor froze stays frozen and a buffer keeps the marks
    construction gave it (from_pretrained remakes both), and a tensor cut from a fused one in the file is its
    own storage (from_pretrained leaves a view holding the whole fused tensor)."""
    for name, tensor in [*reference.named_parameters(), *reference.named_buffers()]:
        if name not in eager_attributes:
            continue
        requires_grad, attributes = eager_attributes[name]
        owner, _, attr = name.rpartition(".")
        module = reference.get_submodule(owner)
        if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
            with torch.no_grad():
                alone = tensor.detach().clone()
            alone = nn.Parameter(alone, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else alone
            alone.__dict__.update(tensor.__dict__)
            (module._parameters if attr in module._parameters else module._buffers)[attr] = tensor = alone
        if isinstance(tensor, nn.Parameter):
            tensor.requires_grad_(requires_grad)
        else:
            flagged = tensor.__dict__.get("_is_hf_initialized")
            tensor.__dict__.clear()
            tensor.__dict__.update(attributes)
            if flagged:
                tensor._is_hf_initialized = flagged


def check(build: Callable[[], nn.Module], folder: Path, name: str) -> list[str]:
    """Raises :class:`Different` with every difference; returns notes (the variant, a forward not run)."""
    variant = variant_of(name)
    notes = [f"variant: {describe_variant(variant)}"]
    try:
        torch.manual_seed(SOURCE_SEED)
        source = build()
    except Exception as error:
        raise Skipped(f"eager construction fails: {one_line(error)}") from None
    perturb(source)  # the file differs from any fresh init: a tensor not loaded shows
    eager_attributes = _attributes(source)
    eager_module_tensors = {(name, key): value for name, module in source.named_modules()
                            for key, value in vars(module).items() if isinstance(value, torch.Tensor)}
    try:
        save(source, folder, variant)
    except Exception as error:
        raise Skipped(f"save_pretrained fails: {one_line(error)}") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            reference = type(source).from_pretrained(folder)
    except Exception as error:
        raise Skipped(f"from_pretrained fails on its own save: {one_line(error)}") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model, report = mz.load_model(folder)
    found = []
    if type(model) is not type(reference):
        found.append(f"class mz={type(model).__name__} ref={type(reference).__name__}")
    else:
        as_promised(reference, eager_attributes)
        for (owner, key), value in eager_module_tensors.items():  # from_pretrained leaves some on meta
            module = reference.get_submodule(owner)
            if getattr(module, key, None) is not None and getattr(module, key).is_meta:
                setattr(module, key, value)
                notes.append(f"from_pretrained leaves module {owner!r}'s tensor attribute {key!r} on meta")
        saved = source.state_dict()
        for name, tensor in reference.state_dict().items():
            ours = model.state_dict().get(name)
            if (ours is not None and name in saved and not torch.equal(ours, tensor)
                    and torch.equal(ours, saved[name].to(ours.dtype))):  # the file's value, in the load's dtype
                tensor.copy_(ours)
                notes.append(f"{name}: from_pretrained's values are not the file's (its init writes over a loaded "
                             "tensor); ours are the file's")
        found += compare_models(model, reference)
    if report.missing or report.unexpected:
        found.append(f"report: missing {list(report.missing)[:5]}, unexpected {list(report.unexpected)[:5]}")
    if type(model) is type(reference):  # outputs too, even where attributes differ: they say whether it matters
        found += compare_forwards(model, reference, generic_inputs(reference), _run, notes)
    if found:
        raise Different(found)
    return notes
