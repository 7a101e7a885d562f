"""The peft cases of the zoo: every tuner type peft registers, on a tiny transformers model, loaded as users load it.

The tuner types are peft's own list (``PEFT_TYPE_TO_CONFIG_MAPPING``: one config class per ``PeftType``),
each on a tiny ``LlamaForCausalLM`` (:mod:`zoo.tiny`'s rules) with the config class's defaults but for
what rules over field names make tiny or give where the tuner asks for it (:func:`tuner_values`): ranks,
block and group sizes, frequencies and virtual tokens small enough for widths of 32, a step count where
one is asked, token indices where there are none. The target modules are the ones peft chooses for a
Llama by default. Each tuner type is one deferred case and three load cases:

- ``deferred``: ``mz.deferred_init(lambda: get_peft_model(base(), config))`` + ``mz.materialize`` is eager
  construction under the same seed (:mod:`zoo.deferred`'s check).
- ``load/TYPE/adapter``: the base saved with ``save_pretrained``, the adapter with peft's; ``mz.load_model``
  of the base then ``PeftModel.from_pretrained`` is ``from_pretrained`` of the base then the same.
- ``load/TYPE/whole``: the adapted model built under ``mz.meta_init`` and given the whole adapted model's
  state with ``mz.load`` is the eager adapted model given it by ``load_state_dict``.
- ``load/TYPE/merged``: ``merge_and_unload()`` saved, then ``mz.load_model`` is ``from_pretrained``.

Each compares every tensor (values, dtypes, classes, attributes, ties) and a forward on a tiny input.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

import materialize as mz
from zoo.differential import BUILD_SEED, FILE_SEED, compare_models, compare_outputs, flat_outputs, \
    reference_load, seeded, write
from zoo.differential import perturb as moved
from zoo.hf import _quiet
from zoo.outcomes import Different, Skipped, one_line

LOAD_WAYS = ("adapter", "whole", "merged")

RANK = 4  # ranks (r, init_r, target_r...) at most this: widths are 32
BLOCK = 8  # block, group and vector sizes at most this, so that they divide 32
FREQUENCIES = 64  # n_frequency: at most the weight's 32 x 32 entries
VIRTUAL_TOKENS = 4
STEPS = 10  # total_step, where a schedule asks for one
TOKEN_INDICES = [1, 2, 3]

_RANK = re.compile(r"(r|.*_r|rank|.*_rank)")
_SIZE = re.compile(r"(.*block_size|group_size|vector_length|theta_d_length|u|.*_size)")
_FREQUENCY = re.compile(r"n_frequency")
_STEPS = re.compile(r"total_step")
_VIRTUAL_TOKENS = re.compile(r"(num_virtual_tokens|adapter_len)")
_LAYERS = re.compile(r"adapter_layers")
_TOKEN_INDICES = re.compile(r"token_indices")
_WIDTH = re.compile(r"hidden_size")
_ADAPTERS = re.compile(r"adapters")


@functools.lru_cache(maxsize=None)
def tuner_types() -> dict[str, type]:
    """Every tuner type peft registers (its ``PeftType`` value), with its config class."""
    from peft import PeftType
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    return {t.value: PEFT_TYPE_TO_CONFIG_MAPPING[t] for t in PeftType if t in PEFT_TYPE_TO_CONFIG_MAPPING}


def case_models() -> list[tuple[str, str]]:
    """(oracle, model) of every peft case."""
    return [(oracle, model) for name in sorted(tuner_types())
            for oracle, model in [("deferred", name), *(("load", f"{name}/{way}") for way in LOAD_WAYS)]]


def _value(name: str, value: Any, adapters: Callable[[], Any]) -> Any:
    """The rule for one field of a config class: its default made tiny, or given where the tuner needs one
    (``adapters``: the LoRA adapters a mixture of them, X-LoRA, is made of)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        if _RANK.fullmatch(name):
            return min(value, RANK)
        if _SIZE.fullmatch(name):
            return min(value, BLOCK)
        if _FREQUENCY.fullmatch(name):
            return min(value, FREQUENCIES)
        return value
    if value is None:
        if _VIRTUAL_TOKENS.fullmatch(name):
            return VIRTUAL_TOKENS
        if _LAYERS.fullmatch(name):
            return 1
        if _STEPS.fullmatch(name):
            return STEPS
        if _WIDTH.fullmatch(name):
            return base_config().hidden_size
        if _ADAPTERS.fullmatch(name):
            return adapters()
    if _TOKEN_INDICES.fullmatch(name) and not value:
        return list(TOKEN_INDICES)
    return value


def tuner_values(config_class: type, folder: Optional[Path] = None) -> dict[str, Any]:
    """The keyword arguments of the tuner's tiny config: every field the rules change, and the task. Adapters
    it is made of are saved in ``folder`` (None: only named, for the notes)."""
    from peft import PeftConfig

    inherited = {f.name for f in dataclasses.fields(PeftConfig)}
    values: dict[str, Any] = {"task_type": "CAUSAL_LM"}
    for field in dataclasses.fields(config_class):
        if field.name in inherited or not field.init:
            continue
        default = field.default if field.default is not dataclasses.MISSING else (
            field.default_factory() if field.default_factory is not dataclasses.MISSING else None)
        new = _value(field.name, default, lambda: {"0": str(lora_adapter(folder)) if folder else "<a LoRA adapter>"})
        if new is not default and new != default:
            values[field.name] = new
    return values


def describe(name: str) -> str:
    values = {k: v for k, v in tuner_values(tuner_types()[name]).items() if k != "task_type"}
    arguments = ", ".join(f"{k}={v!r}" for k, v in values.items())
    return f"{tuner_types()[name].__name__}({arguments}) on a tiny LlamaForCausalLM"


def base_config() -> Any:
    """zoo/tiny.py's rules over LlamaConfig, without a KV cache (X-LoRA asks for none; outputs are the logits)."""
    from transformers import LlamaConfig

    from zoo.tiny import tiny_config

    config = _quiet(lambda: tiny_config(LlamaConfig))
    config.use_cache = False
    return config


def base() -> nn.Module:
    """The tiny transformers model every tuner adapts."""
    from transformers import LlamaForCausalLM

    return _quiet(lambda: LlamaForCausalLM(base_config()))


def lora_adapter(folder: Path) -> Path:
    """A LoRA adapter of the base saved in ``folder`` (once), its tensors moved from a fresh init."""
    from peft import LoraConfig, get_peft_model

    saved = folder / "lora-adapter"
    if not saved.exists():
        adapted = _quiet(lambda: get_peft_model(seeded(base, FILE_SEED), LoraConfig(task_type="CAUSAL_LM")))
        perturb(adapted)
        adapted.save_pretrained(saved)
    return saved


def peft_config(name: str, folder: Path) -> Any:
    config_class = tuner_types()[name]
    try:
        return config_class(**tuner_values(config_class, folder))
    except ImportError as error:
        raise Skipped(f"{config_class.__name__} needs what is not installed here: {one_line(error)}") from None


def builder(name: str, folder: Path) -> Callable[[], nn.Module]:
    """Eager construction of the adapted model: the base, then ``get_peft_model`` with a fresh config."""
    from peft import get_peft_model

    folder.mkdir(parents=True, exist_ok=True)
    _eager(lambda: peft_config(name, folder), "its config")  # a config that cannot be made is a skip, said once here

    def build() -> nn.Module:
        return _quiet(lambda: get_peft_model(base(), peft_config(name, folder)))

    return build


def _eager(build: Callable[[], Any], what: str) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return build()
    except Skipped:
        raise
    except Exception as error:
        raise Skipped(f"{what} fails: {one_line(error)}") from None


def perturb(model: nn.Module) -> None:
    """:func:`zoo.differential.perturb` of the floating-point tensors only: a tuner's integer buffers are indices
    (OFT's and PSOFT's rows and columns, UniLoRA's, FRoD's), which moved would point out of their tensors."""
    floats = {id(t) for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()}
    kept = [(t, t.detach().clone()) for t in [*model.parameters(), *model.buffers()] if id(t) not in floats]
    moved(model)
    with torch.no_grad():
        for tensor, before in kept:
            tensor.copy_(before)


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"input_ids": torch.randint(4, 60, (1, 7), generator=g)}


def _outputs(model: nn.Module) -> list[torch.Tensor]:
    model.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(5)
        output = model(**inputs())
    return flat_outputs(output.to_tuple() if hasattr(output, "to_tuple") else output)


def compare(ours: nn.Module, reference: nn.Module, notes: list[str]) -> list[str]:
    """Every tensor, then a forward where the reference runs one."""
    found = compare_models(ours, reference)
    try:
        expected = _outputs(reference)
    except Exception as error:
        notes.append(f"forward not compared: the reference's raises {one_line(error, 150)}")
    else:
        found += [f"[forward] {d}" for d in compare_outputs(_outputs(ours), expected, "forward")]
    return found


def _as_promised(reference: nn.Module) -> None:
    """``from_pretrained``'s base model with the buffers' marks eager construction gives them, as a load keeps
    them (docs/huggingface.md; :func:`zoo.pretrained.as_promised`). Buffers only: peft freezes the parameters."""
    from zoo.pretrained import as_promised

    eager = seeded(base, BUILD_SEED)
    as_promised(reference, {name: (False, dict(buffer.__dict__)) for name, buffer in eager.named_buffers()})


def check(name: str, way: str, folder: Path) -> list[str]:
    """One load case; raises :class:`Different` with every difference, returns notes."""
    folder.mkdir(parents=True, exist_ok=True)
    notes: list[str] = [f"config: {describe(name)}"]
    found = {"adapter": _adapter, "whole": _whole, "merged": _merged}[way](name, folder, notes)
    if found:
        raise Different(found)
    return notes


def _adapter(name: str, folder: Path, notes: list[str]) -> list[str]:
    """The base by ``mz.load_model``, then the adapter by ``PeftModel.from_pretrained``; against ``from_pretrained``
    of the base, then the same."""
    from peft import PeftModel, get_peft_model

    config = peft_config(name, folder)
    source_base = _eager(lambda: seeded(base, FILE_SEED), "eager construction of the base")
    perturb(source_base)
    source_base.save_pretrained(folder / "base")
    source = _eager(lambda: get_peft_model(source_base, config), "get_peft_model")
    perturb(source)  # the adapter's tensors differ from a fresh init; the base in the file stays as saved
    _eager(lambda: source.save_pretrained(folder / "adapter"), "peft's save_pretrained")
    base_class = type(source.get_base_model())

    def reference_build() -> nn.Module:
        torch.manual_seed(0)
        loaded = _quiet(lambda: base_class.from_pretrained(folder / "base"))
        return _quiet(lambda: PeftModel.from_pretrained(loaded, folder / "adapter"))

    reference = _eager(reference_build, "from_pretrained then PeftModel.from_pretrained")
    torch.manual_seed(0)
    ours_base, report = _quiet(lambda: mz.load_model(folder / "base"))
    found = [f"[base] report: missing {list(report.missing)[:5]}, unexpected {list(report.unexpected)[:5]}"] \
        if report.missing or report.unexpected else []
    ours = _quiet(lambda: PeftModel.from_pretrained(ours_base, folder / "adapter"))
    _as_promised(reference.get_base_model())
    return found + compare(ours, reference, notes)


def _whole(name: str, folder: Path, notes: list[str]) -> list[str]:
    """The adapted model built under ``mz.meta_init``, ``mz.load`` of its whole state; against ``load_state_dict``."""
    build = builder(name, folder)
    source = _eager(lambda: seeded(build, FILE_SEED), "eager construction")
    perturb(source)
    state = {k: v.detach() for k, v in source.state_dict().items()}
    path = write(state, folder / "whole.safetensors", "safetensors")
    reference = _eager(lambda: seeded(build, BUILD_SEED), "eager construction")
    outcome = reference_load(reference, state, strict=True)
    if outcome.error is not None:
        raise Skipped(f"load_state_dict of its own state fails: {one_line(outcome.error)}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with mz.meta_init():
            model = seeded(build, BUILD_SEED)
        mz.load(model, path)
    return compare(model, reference, notes)


def _merged(name: str, folder: Path, notes: list[str]) -> list[str]:
    """``merge_and_unload()`` saved with ``save_pretrained``; ``mz.load_model`` against ``from_pretrained``."""
    build = builder(name, folder)
    source = _eager(lambda: seeded(build, FILE_SEED), "eager construction")
    perturb(source)
    if not callable(getattr(source.base_model, "merge_and_unload", None)):
        raise Skipped(f"{type(source.base_model).__name__} has no merge_and_unload (a {name} adapter does not merge)")
    merged = _eager(lambda: _quiet(source.merge_and_unload), "merge_and_unload")
    _eager(lambda: merged.save_pretrained(folder / "merged"), "save_pretrained of the merged model")

    def reference_build() -> nn.Module:
        torch.manual_seed(0)
        return _quiet(lambda: type(merged).from_pretrained(folder / "merged"))

    reference = _eager(reference_build, "from_pretrained of the merged save")
    torch.manual_seed(0)
    model, report = _quiet(lambda: mz.load_model(folder / "merged"))
    _as_promised(reference)
    found = [f"report: missing {list(report.missing)[:5]}, unexpected {list(report.unexpected)[:5]}"] \
        if report.missing or report.unexpected else []
    return found + compare(model, reference, notes)


def run_case(oracle: str, model: str, folder: Path) -> list[str]:
    if oracle == "deferred":
        from zoo import deferred

        return [f"config: {describe(model)}", *deferred.check(builder(model, folder / "adapters"), folder)]
    name, _, way = model.partition("/")
    return check(name, way, folder)
