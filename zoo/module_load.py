"""The load oracle of a module built by a function: ``mz.meta_init()`` + ``mz.load`` is eager + ``load_state_dict``.

The file is a "trained" state (:func:`zoo.differential.trained_state`: another seed, every tensor moved, with the
modules' versions ``state_dict()`` gives), saved as a torch file or as safetensors by a stable hash of the case's name (a torch file where the state holds more than
tensors: packed quantized weights, extra state). The model built under ``mz.meta_init()`` given the file by
``mz.load`` is compared with the eager model given the file by ``load_state_dict``: every tensor (values, dtype,
shape, strides, class, ``requires_grad``, attributes), ties, modules' attributes (:func:`compare_models`), every
other ``state_dict()`` entry, the tensors modules keep in their ``__dict__`` (a parametrization's cached weight, an
RNN's flat weights), then a forward on a tiny input where there is one.
"""

from __future__ import annotations

import pickle
import warnings
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

import materialize as mz
from zoo import differential
from zoo.differential import BUILD_SEED, FILE_SEED, compare_models, compare_outputs, flat_outputs, read, \
    reference_load, seeded, write
from zoo.outcomes import Different, Skipped, one_line

FORMATS = ("pt", "safetensors")


def trained_state(build: Callable[[], nn.Module]) -> dict[str, Any]:
    """:func:`zoo.differential.trained_state`, keeping the ``_metadata`` (the modules' versions) ``torch.save``
    keeps: a quantized module's load code reads its layout from it."""
    state = differential.trained_state(build)
    source = seeded(build, FILE_SEED)
    metadata = getattr(source.state_dict(), "_metadata", None)
    if metadata is not None:
        state = OrderedDict(state)
        state._metadata = metadata
    return state


def file_format(case: str, state: dict[str, Any]) -> str:
    if not all(isinstance(v, torch.Tensor) and not v.is_quantized for v in state.values()):
        return "pt"  # what safetensors cannot hold
    return FORMATS[zlib.crc32(case.encode()) % len(FORMATS)]


def check(case: str, build: Callable[[], nn.Module], folder: Path, *,
          make_inputs: Callable[[], Optional[tuple]] = lambda: None) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            state = trained_state(build)
            reference = seeded(build, BUILD_SEED)
        except Skipped:
            raise
        except Exception as error:
            raise Skipped(f"eager construction fails: {one_line(error)}") from None
        fmt = file_format(case, state)
        folder.mkdir(parents=True, exist_ok=True)
        path = write(state, folder / f"state.{fmt}", fmt)
        notes = [f"file: {fmt}"]
        try:
            saved = read(path, fmt)
        except pickle.UnpicklingError:  # objects beside tensors (packed quantized weights): trusted, as torch is told
            saved = torch.load(path, weights_only=False)
            notes.append("the file holds objects torch's weights-only load refuses: both loads trust it")
        outcome = reference_load(reference, saved, strict=True)
        if outcome.error is not None:
            raise Skipped(f"load_state_dict of its own state ({fmt}) fails: {one_line(outcome.error)}")
        as_the_next_forward_computes(reference)
        with mz.meta_init():
            model = seeded(build, BUILD_SEED)
        mz.load(model, path, trust_pickle=len(notes) > 1)
    found = compare_models(model, reference) + compare_state(model, reference) + compare_attributes(model, reference)
    found += compare_forward(model, reference, make_inputs(), notes)
    if found:
        raise Different(found)
    return notes


def as_the_next_forward_computes(reference: nn.Module) -> None:
    """The weight torch's older ``weight_norm`` (and ``spectral_norm``, once a forward computed it) keeps as an
    attribute, in the eager reference, computed from the loaded tensors as its next forward computes it: eagerly
    it holds construction's until then, a load the loaded weight's (a deliberate difference, docs/limits.md)."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    for module in reference.modules():
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, WeightNorm):
                setattr(module, hook.name, hook.compute_weight(module))
            elif isinstance(hook, SpectralNorm) and not _views(getattr(module, hook.name), module):
                setattr(module, hook.name, hook.compute_weight(module, do_power_iteration=False))


def _views(tensor: Any, module: nn.Module) -> bool:
    """Whether ``tensor`` shares memory with one of ``module``'s parameters (older spectral_norm's weight, until a
    forward computes it: a view of ``weight_orig``, as eagerly, and so after a load)."""
    return isinstance(tensor, torch.Tensor) and any(
        tensor.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for p in module.parameters(recurse=False))


def compare_forward(model: nn.Module, reference: nn.Module, inputs: Optional[tuple], notes: list[str]) -> list[str]:
    if inputs is None:
        notes.append("forward not compared: no input rule fits its forward")
        return []
    try:
        expected = run_forward(reference, inputs)
    except Exception as error:
        notes.append(f"forward not compared: the reference's raises {one_line(error, 150)}")
        return []
    try:
        got = run_forward(model, inputs)
    except Exception as error:  # the loaded model's forward fails where the reference's runs: a difference
        return [f"forward: raises {one_line(error, 200)}, the reference's runs"]
    return compare_outputs(got, expected, "forward")


def run_forward(model: nn.Module, inputs: tuple) -> list[torch.Tensor]:
    """Outputs in eval mode, torch seeded (a fractional pool draws), quantized ones dequantized."""
    model.eval()
    torch.manual_seed(BUILD_SEED)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outputs = flat_outputs(model(*inputs))
    return [t.dequantize() if t.is_quantized else t for t in outputs]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.is_meta or b.is_meta or a.dtype != b.dtype or a.shape != b.shape or a.is_quantized != b.is_quantized:
            return False
        if a.is_quantized:
            return (a.qscheme() == b.qscheme() and torch.equal(a.int_repr(), b.int_repr())
                    and torch.equal(_scales(a), _scales(b)))
        if a.stride() != b.stride():
            return False
        if a.is_floating_point() or a.is_complex():
            return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.ScriptObject) and isinstance(b, torch.ScriptObject):
        return _same(a.__getstate__(), b.__getstate__())
    try:
        return bool(a == b)
    except Exception:
        return repr(a) == repr(b)


def _scales(t: torch.Tensor) -> torch.Tensor:
    if t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return torch.tensor([t.q_scale(), float(t.q_zero_point())])
    return torch.cat([t.q_per_channel_scales().double(), t.q_per_channel_zero_points().double()])


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            return f"<meta {tuple(value.shape)} {value.dtype}>"
        plain = value.dequantize() if value.is_quantized else value
        return f"<{tuple(value.shape)} {value.dtype} stride {value.stride()} {plain.detach().flatten()[:4].tolist()}…>"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}[{', '.join(_show(v) for v in value[:4])}{', …' if len(value) > 4 else ''}]"
    text = repr(value)
    return text if len(text) < 120 else text[:117] + "..."


def compare_state(model: nn.Module, reference: nn.Module) -> list[str]:
    """Every ``state_dict()`` entry :func:`compare_models` does not compare as a parameter or buffer already:
    extra state, packed quantized weights, what a module's own ``_save_to_state_dict`` adds."""
    got, ref = model.state_dict(), reference.state_dict()
    compared = {name for name, _ in reference.named_parameters(remove_duplicate=False)}
    compared |= {name for name, _ in reference.named_buffers(remove_duplicate=False)}
    found = [f"{name}: state_dict entry absent (reference {_show(ref[name])})" for name in ref if name not in got]
    found += [f"{name}: state_dict entry absent from the reference" for name in got if name not in ref]
    for name in (n for n in ref if n in got and n not in compared):
        if not _same(got[name], ref[name]):
            found.append(f"{name}: state_dict entry differs mz={_show(got[name])} ref={_show(ref[name])}")
    return found


def _tensor_attributes(module: nn.Module) -> dict[str, Any]:
    """The tensors, and lists of tensors, a module keeps in its ``__dict__`` under a private name, or in a list."""
    found = {}
    for key, value in vars(module).items():
        if key in ("_parameters", "_buffers", "_modules", "_flat_weight_refs") or not (
                key.startswith("_") or isinstance(value, list)):
            continue  # the registries, and what compare_models compares already
        if isinstance(value, torch.Tensor) or (isinstance(value, (list, tuple)) and value
                                               and all(isinstance(v, torch.Tensor) or v is None for v in value)):
            found[key] = value
    return found


def compare_attributes(model: nn.Module, reference: nn.Module) -> list[str]:
    found = []
    ref_modules = dict(reference.named_modules(remove_duplicate=False))
    for name, module in model.named_modules(remove_duplicate=False):
        if name not in ref_modules:
            continue
        got, ref = _tensor_attributes(module), _tensor_attributes(ref_modules[name])
        for key in sorted(got.keys() | ref.keys()):
            if key not in got or key not in ref or not _same(got[key], ref[key]):
                label = f"module '{name}' ({type(module).__name__}) attribute {key}"
                found.append(f"{label}: tensor attribute mz={_show(got.get(key, '<absent>'))} "
                             f"ref={_show(ref.get(key, '<absent>'))}")
    return found
