"""The deferred oracle: ``mz.deferred_init`` + ``mz.materialize`` (or a load of half the tensors) is eager construction."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file
from torch import nn

import materialize as mz
from zoo.differential import compare_models, tie_groups
from zoo.outcomes import Different, Skipped, one_line

SEED = 0


def _seeded(build: Callable[[], nn.Module], *, record: bool = False) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(SEED)
        return mz.deferred_init(build) if record else build()


def eager(build: Callable[[], nn.Module]) -> tuple[nn.Module, frozenset]:
    """Eager construction, and the names whose values two eager constructions do not agree on.

    Those (``torch.empty`` memory nobody initialized) are compared for everything but their values.
    """
    try:
        first, second = _seeded(build), _seeded(build)
    except Exception as error:
        raise Skipped(f"eager construction fails: {one_line(error)}") from None
    second_tensors = {**dict(second.named_parameters(remove_duplicate=False)),
                      **dict(second.named_buffers(remove_duplicate=False))}
    unstable = frozenset(name for name, t in [*first.named_parameters(remove_duplicate=False),
                                             *first.named_buffers(remove_duplicate=False)]
                         if not _same_bits(t, second_tensors[name]))
    return first, unstable


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_bytes = lambda t: t.detach().reshape(-1).contiguous().view(torch.uint8)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b))


def is_transformers_model(model: nn.Module) -> bool:
    return any(cls.__module__.startswith("transformers.") and cls.__name__ == "PreTrainedModel"
               for cls in type(model).__mro__)


def half_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every other tensor of the state dict, each tie once, as a save tool writes them."""
    tied_later = {name for group in tie_groups(model) for name in sorted(group)[1:]}
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
             if k not in tied_later and isinstance(v, torch.Tensor) and not v.is_quantized}  # what safetensors holds
    return {k: state[k] for k in sorted(state)[::2]}


def check(build: Callable[[], nn.Module], folder: Path) -> list[str]:
    """Raises :class:`Different` with every difference; returns notes (what was not compared, and why)."""
    reference, unstable = eager(build)
    notes = [f"values not compared (two eager constructions differ): {sorted(unstable)[:5]}"] if unstable else []

    recorded = _seeded(build, record=True)
    mz.materialize(recorded)
    found = [f"[materialize] {d}" for d in compare_models(recorded, reference, skip_bits=unstable)]

    folder.mkdir(parents=True, exist_ok=True)
    half = half_of(reference)
    save_file(half, str(folder / "half.safetensors"))
    loaded = _seeded(build, record=True)
    mz.load(loaded, folder / "half.safetensors", strict=False)
    if is_transformers_model(reference):  # a load flags what it filled as from_pretrained does (docs/huggingface.md)
        for name in half:
            owner, _, attr = name.rpartition(".")
            getattr(reference.get_submodule(owner), attr)._is_hf_initialized = True
    found += [f"[half loaded] {d}" for d in compare_models(loaded, reference, skip_bits=unstable)]
    if found:
        raise Different(found)
    return notes
