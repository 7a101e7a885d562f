"""The modules of a model with their names, walked without torch's generator chain.

``nn.Module.named_modules`` yields through one generator per level, so a
module ``d`` levels deep costs ``d`` resumptions: on a model of 2,000
layers (and any MoE of thousands of expert modules) that walk was a tenth
of a load. This walk is plain recursion into a list: the same modules, the
same names, the same order (pre-order, children as registered).
"""

from __future__ import annotations

from typing import Optional

from torch import nn


def named_modules(model: nn.Module, *, remove_duplicate: bool = True,
                  vacant: Optional[list[str]] = None) -> list[tuple[str, nn.Module]]:
    """``model.named_modules(remove_duplicate=...)`` as a list.

    With ``remove_duplicate=False`` a module registered in several places is
    listed under each of its names (as a tied tensor is reached from each).
    ``vacant``, if given, is added the name of each submodule slot registered
    as ``None`` on the way (the walk passes them over anyway).
    """
    found: list[tuple[str, nn.Module]] = []
    _walk(model, "", found, set() if remove_duplicate else None, vacant)
    return found


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
