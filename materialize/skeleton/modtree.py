"""The modules of a model with their names, walked without torch's generator chain.

``nn.Module.named_modules`` yields through one generator per level, so a
module ``d`` levels deep costs ``d`` resumptions: on a model of 2,000
layers (and any MoE of thousands of expert modules) that walk was a tenth
of a load. This walk is plain recursion into a list: the same modules, the
same names, the same order (pre-order, children as registered).
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Optional

from torch import nn


@dataclass
class _Walk:
    """One walk of a model with duplicates (as ``remove_duplicate=False`` lists them), and the vacant slots met."""

    model: nn.Module
    found: Optional[list[tuple[str, nn.Module]]] = None
    vacant: list[str] = field(default_factory=list)
    has_duplicates: bool = False


_SHARED: ContextVar[Optional[_Walk]] = ContextVar("materialize_shared_walk", default=None)


class one_walk:  # noqa: N801 (used as a context, like contextlib's)
    """Within (it may be entered again): every walk of ``model`` asked here is made from one walk of it.

    A load asks for the model's modules several times before it runs any of
    the model's own code (its device, its names, its modules to initialize),
    and on a model of experts each walk costs microseconds a tensor. Only for
    spans in which nothing changes which modules the model holds.
    """

    def __init__(self, model: nn.Module) -> None:
        self._walk = _Walk(model)
        self._tokens: list = []

    def __enter__(self) -> "one_walk":
        self._tokens.append(_SHARED.set(self._walk))
        return self

    def __exit__(self, *exc_info: object) -> None:
        _SHARED.reset(self._tokens.pop())


def _shared_walk(model: nn.Module) -> Optional[_Walk]:
    walk = _SHARED.get()
    if walk is None or walk.model is not model:
        return None
    if walk.found is None:
        found: list[tuple[str, nn.Module]] = []
        _walk(model, "", found, None, walk.vacant)
        walk.found = found
        walk.has_duplicates = len({id(module) for _, module in found}) != len(found)
    return walk


def named_modules(model: nn.Module, *, remove_duplicate: bool = True,
                  vacant: Optional[list[str]] = None) -> list[tuple[str, nn.Module]]:
    """``model.named_modules(remove_duplicate=...)`` as a list.

    With ``remove_duplicate=False`` a module registered in several places is
    listed under each of its names (as a tied tensor is reached from each).
    ``vacant``, if given, is added the name of each submodule slot registered
    as ``None`` on the way (the walk passes them over anyway).
    """
    walk = _shared_walk(model) if not (remove_duplicate and vacant is not None) else None
    if walk is not None:
        if vacant is not None:
            vacant.extend(walk.vacant)
        if not remove_duplicate or not walk.has_duplicates:
            return list(walk.found)
        return _first_of_each(walk.found)
    found: list[tuple[str, nn.Module]] = []
    _walk(model, "", found, set() if remove_duplicate else None, vacant)
    return found


def _first_of_each(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """A walk with duplicates made one without: each module under the first name it was met by. A walk that
    skips a module met before skips its subtree too, whose modules were all met under it the first time, so
    the order is the same."""
    seen: set[int] = set()
    unique = []
    for name, module in found:
        if id(module) not in seen:
            seen.add(id(module))
            unique.append((name, module))
    return unique


def _walk(module: nn.Module, prefix: str, found: list[tuple[str, nn.Module]], seen: Optional[set[int]],
          vacant: Optional[list[str]]) -> None:
    if seen is not None:
        if id(module) in seen:
            return
        seen.add(id(module))
    found.append((prefix, module))
    dot = prefix + "." if prefix else ""
    for name, child in module._modules.items():
        if child is not None:
            _walk(child, dot + name, found, seen, vacant)
        elif vacant is not None:
            vacant.append(dot + name)


def modules_of(model: nn.Module) -> list[nn.Module]:
    """``list(model.modules())``: each module once, in the same order, without names (where a walk asks none,
    making a name per module is most of its cost)."""
    walk = _shared_walk(model)
    if walk is not None:
        pairs = _first_of_each(walk.found) if walk.has_duplicates else walk.found
        return [module for _, module in pairs]
    found: list[nn.Module] = []
    _walk_modules(model, found, set())
    return found


def _walk_modules(module: nn.Module, found: list[nn.Module], seen: set[int]) -> None:
    if id(module) in seen:
        return
    seen.add(id(module))
    found.append(module)
    for child in module._modules.values():
        if child is not None:
            _walk_modules(child, found, seen)
