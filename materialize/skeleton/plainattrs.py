"""Plain tensor attributes of a model built on meta: views of its parameters remade over the real ones.

A constructor may keep a view of a parameter or buffer as a plain attribute
(``self.w_t = self.lin.weight.t()``, a weight's slice per head). Eager
construction's view shares the parameter's memory, so it sees what
``load_state_dict`` copies in. Built on meta, the attribute is a view of the
meta tensor; a load or ``materialize`` replaces the parameter with a new
tensor, and the attribute would stay on meta, where ``x @ attribute`` on the
CPU returns memory nobody wrote. So once the model's tensors are real, each
such attribute is made again as the same view (size, strides, offset) of the
tensor that replaced its base, with a gradient path to it where eager's view
had one (its ``grad_fn`` is ``AsStridedBackward0`` where eager's is, say,
``TBackward0``: the same gradients reach the parameter).

A plain tensor attribute on meta that views no tensor of the model (computed
from a weight on meta: ``self.scale = self.weight.norm()``) has no values to
take: eager construction computed it from the values before the load. It
stays on meta, with a :class:`~materialize.errors.MaterializeWarning` naming
it; a model recorded by :func:`~materialize.deferred_init` replays it
instead (see :func:`plain_meta_tensors` and :mod:`materialize.api`).
Only attributes held directly by a module are looked at, not tensors inside
lists or dicts held by one.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..errors import MaterializeWarning
from .program import Program


@dataclass(frozen=True)
class PlainTensor:
    """A tensor a module holds as a plain attribute (in its ``__dict__``), found on meta."""

    prefix: str  # the module's qualified name
    module: nn.Module
    attr: str
    tensor: torch.Tensor

    @property
    def name(self) -> str:
        return f"{self.prefix}.{self.attr}" if self.prefix else self.attr


def plain_meta_tensors(modules: Iterable[tuple[str, nn.Module]]) -> list[PlainTensor]:
    """The plain tensor attributes on meta of ``modules`` (``(qualified name, module)`` pairs; a module
    reached under two names is looked at once)."""
    found: list[PlainTensor] = []
    seen: set[int] = set()
    for prefix, module in modules:
        if id(module) in seen:
            continue
        seen.add(id(module))
        attributes = module.__dict__
        for attr in sorted(attributes.keys() - _MODULE_OWN):  # a set difference in C: the loop sees the rest only
            value = attributes[attr]
            if isinstance(value, torch.Tensor) and value.is_meta:
                found.append(PlainTensor(prefix, module, attr, value))
    return found


_MODULE_OWN = frozenset(nn.Module().__dict__)  # what every module holds (its registries, hooks, ``training``)


def storage_key(tensor: torch.Tensor) -> int:
    """What a meta tensor and its views have in common (the storage they share; a meta view also keeps its
    ``_base``, but a view of a view of a parameter keeps the root, and the storage says the same)."""
    return tensor.untyped_storage()._cdata


def replaced_storages(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`remake_views`' map from ``(tensor the model held, tensor it holds now)`` pairs: the meta ones."""
    return {storage_key(before): (before, after) for before, after in pairs if before.is_meta and after is not before}


def remake_views(found: Iterable[PlainTensor], replaced: dict[int, tuple[torch.Tensor, torch.Tensor]], *,
                 program: Optional[Program] = None, device: Optional[torch.device] = None) -> list[str]:
    """Remake each of ``found`` that views a tensor the model replaced, over its replacement; replay the
    others where ``program`` (a :func:`~materialize.deferred_init` recording) made them, on ``device``; warn
    of, and return the names of, those that stay on meta.

    ``replaced`` maps :func:`storage_key` of each replaced meta tensor to ``(meta tensor, its replacement)``.
    """
    rest: list[PlainTensor] = []
    for plain in found:
        if plain.module.__dict__.get(plain.attr) is not plain.tensor:  # the load's own code rebound it
            continue
        pair = replaced.get(storage_key(plain.tensor))
        view = _view_over(plain.tensor, *pair) if pair is not None else None
        if view is None:
            rest.append(plain)
        else:
            plain.module.__dict__[plain.attr] = view
    rest = _replayed(rest, program, device) if program is not None else _recomputed_by_their_hooks(rest)
    left = [plain.name for plain in rest]
    if left:
        warnings.warn(
            f"{_listed(left)} stay{'s' if len(left) == 1 else ''} on meta: a plain tensor attribute computed in "
            "construction from a tensor on meta, not a view of the model's parameters or buffers, has no values "
            "a load can give it (eager construction computed it from the values before any load); compute it "
            "after the load, or build that module outside meta_init", MaterializeWarning, stacklevel=3)
    return left


def _recomputed_by_their_hooks(found: list[PlainTensor]) -> list[PlainTensor]:
    """Compute each of ``found`` that torch's older ``weight_norm`` or ``spectral_norm`` keeps (the weight, a
    plain attribute its forward pre-hook computes from ``weight_g``/``weight_v`` or ``weight_orig``) from the
    loaded tensors, as the next forward would (spectral norm without a power iteration, so its ``_u`` and
    ``_v`` stay the file's); return the others. Eager construction's attribute holds the values computed from
    its initial weights until that forward (a deliberate difference: docs/limits.md)."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    left = []
    for plain in found:
        hooks = [hook for hook in plain.module._forward_pre_hooks.values()
                 if isinstance(hook, (WeightNorm, SpectralNorm)) and hook.name == plain.attr]
        if len(hooks) != 1 or any(tensor.is_meta for tensor in plain.module._parameters.values() if tensor is not None):
            left.append(plain)
            continue
        hook = hooks[0]
        weight = hook.compute_weight(plain.module) if isinstance(hook, WeightNorm) else \
            hook.compute_weight(plain.module, do_power_iteration=False)
        plain.module.__dict__[plain.attr] = weight
    return left


def _replayed(found: list[PlainTensor], program: Program, device: Optional[torch.device]) -> list[PlainTensor]:
    """Make each of ``found`` the recording knows (by its qualified name) as eager construction made it, a
    tensor of its own (its ``requires_grad`` as recorded, with no graph behind it); return the others."""
    from .replaying import replay

    known = [plain for plain in found if plain.name in program.bindings]
    made = {plain.name: torch.empty_strided(tuple(plain.tensor.shape), tuple(plain.tensor.stride()),
                                            dtype=plain.tensor.dtype, device=device or "cpu") for plain in known}
    replay(program, dict(made), device or torch.device("cpu"))
    for plain in known:
        plain.module.__dict__[plain.attr] = made[plain.name].requires_grad_(plain.tensor.requires_grad)
    return [plain for plain in found if plain.name not in made]


def _view_over(view: torch.Tensor, base: torch.Tensor, replacement: torch.Tensor):
    """``view`` (a meta view of ``base``) made over ``replacement``, or None where the layouts do not match."""
    from ..integrations.sharded import is_dtensor

    if is_dtensor(replacement) or replacement.is_meta:
        return None
    if view.dtype != base.dtype:  # a view as another dtype (``w.view(torch.int32)``): over the new tensor alike
        if replacement.dtype != base.dtype or view.dtype.itemsize != base.dtype.itemsize:
            return None
        replacement = replacement.view(view.dtype)
    # else the view follows its base, in the dtype the load gave it (``dtype=`` casts the model's tensors)
    if tuple(replacement.stride()) != tuple(base.stride()) or tuple(replacement.shape) != tuple(base.shape):
        return None  # another memory order than the meta tensor's: the view's strides would mean other elements
    offset = view.storage_offset() - base.storage_offset()
    if offset < 0 or not _within(view, offset, base):
        return None  # reaches outside the base's own elements (a view of a larger storage)
    with torch.set_grad_enabled(view.grad_fn is not None):  # made with gradients on, as eager's view was
        return replacement.as_strided(tuple(view.shape), tuple(view.stride()), replacement.storage_offset() + offset)


def _within(view: torch.Tensor, offset: int, base: torch.Tensor) -> bool:
    """Whether every element ``view`` reaches (from ``offset`` past the base's first) is one of the base's."""
    if view.numel() == 0:
        return True
    last = offset + sum((size - 1) * stride for size, stride in zip(view.shape, view.stride()))
    extent = sum((size - 1) * stride for size, stride in zip(base.shape, base.stride())) if base.numel() else -1
    return last <= extent


def _listed(names: list[str], shown: int = 3) -> str:
    quoted = ", ".join(repr(name) for name in names[:shown])
    return quoted + (f" and {len(names) - shown} more" if len(names) > shown else "")
