"""The loadcode cases of the zoo: each kind of code torch runs in a load, against torch's own load of the same file.

A model ``Sequential(block, Linear)`` whose block (prefix ``0.``) carries the code; the file is a "trained" state
(another seed, every tensor moved) edited as the code expects it. Kinds, named ``site:action``:

- load pre-hooks, by every registration API ``nn.Module`` has (``register_load_state_dict_pre_hook``,
  ``_register_load_state_dict_pre_hook`` with and without ``with_module``), and ``_load_from_state_dict``
  overridden (before ``super()``): ``rename`` (an older name), ``replace`` (``sd[k] = sd[k] * 2``), ``inplace``
  (``sd[k].mul_(3)``, the checkpoint's tensor changed), ``drop`` (a legacy entry popped), ``consume`` (an entry
  popped into a Python attribute); ``_load_from_state_dict`` also ``rescale`` (its own parameter scaled after
  ``super()``);
- load post-hooks (``register_load_state_dict_post_hook``): ``rescale``, ``forgive_missing`` (an absent buffer
  taken out of the missing keys), ``set_attribute``;
- extra state: ``plain`` (ints and strings), ``tensors`` (a dict holding a tensor), ``tensor``;
- ``_metadata`` versions: ``older`` (version 1, an older name holding the weight transposed, which the block's
  load code converts), ``current``, ``absent`` (no versions in the file: converted as version 1);
- ``__setstate__`` of a module pickled whole (``torch.save(model)``, read with ``trust_pickle=True``):
  ``attribute``, ``rescale`` (a parameter scaled), ``upgrade`` (an older pickle without a buffer it adds).

The reference is eager construction given the file by ``load_state_dict`` (``torch.load(weights_only=False)`` for
the pickled modules); the oracle expects the same model, or a ``MaterializeError`` (status ``refused``).
"""

from __future__ import annotations

import functools
import inspect
import re
import warnings
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import materialize as mz
from zoo.differential import BUILD_SEED, FILE_SEED, compare_models, perturb, read, seeded, write
from zoo.module_load import compare_attributes, compare_forward, compare_state
from zoo.outcomes import Different

PRE_ACTIONS = ("rename", "replace", "inplace", "drop", "consume")
KINDS = {
    "_load_from_state_dict": (*PRE_ACTIONS, "rescale"),
    "register_load_state_dict_post_hook": ("rescale", "forgive_missing", "set_attribute"),
    "extra_state": ("plain", "tensors", "tensor"),
    "_metadata": ("older", "current", "absent"),
    "__setstate__": ("attribute", "rescale", "upgrade"),
}


def pre_hook_sites() -> list[str]:
    """Every registration API of load pre-hooks ``nn.Module`` has, ``[with_module]`` where it takes that."""
    sites = []
    for name in sorted(n for n in dir(nn.Module) if re.fullmatch(r"_?register_load_state_dict_pre_hook", n)):
        sites.append(name)
        if "with_module" in inspect.signature(getattr(nn.Module, name)).parameters:
            sites.append(f"{name}[with_module]")
    return sites


def case_models() -> list[tuple[str, str]]:
    kinds = {**{site: PRE_ACTIONS for site in pre_hook_sites()}, **KINDS}
    return [("load", f"{site}:{action}") for site, actions in kinds.items() for action in actions]


class Block(nn.Module):
    """A parameter of its own, a child, two buffers, a plain tensor attribute; ``site`` and ``action`` say which
    load code it carries (the hooks here, the overrides in its subclasses)."""

    def __init__(self, site: str, action: str) -> None:
        super().__init__()
        self.site, self.action = site, action
        self.weight = nn.Parameter(torch.randn(4, 4) * 0.5)
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("cache", torch.zeros(4))
        self.ema = torch.zeros(4)
        self.step = 0
        if site.startswith("register_load_state_dict_pre_hook"):
            self.register_load_state_dict_pre_hook(_pre_hook)
        elif site == "_register_load_state_dict_pre_hook[with_module]":
            self._register_load_state_dict_pre_hook(_pre_hook, with_module=True)
        elif site == "_register_load_state_dict_pre_hook":
            self._register_load_state_dict_pre_hook(self._own_pre_hook)
        elif site == "register_load_state_dict_post_hook":
            self.register_load_state_dict_post_hook(_post_hook)

    def _own_pre_hook(self, state_dict, prefix, *rest) -> None:
        _act(self, state_dict, prefix, self.action)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x @ self.weight.T) * self.scale + self.cache + self.ema


class OverridingBlock(Block):
    """``_load_from_state_dict`` overridden: the action before ``super()``, or a rescale after it."""

    def _load_from_state_dict(self, state_dict, prefix, *rest) -> None:
        if self.action != "rescale":
            _act(self, state_dict, prefix, self.action)
        super()._load_from_state_dict(state_dict, prefix, *rest)
        if self.action == "rescale":
            with torch.no_grad():
                self.weight.mul_(0.5)


class VersionedBlock(Block):
    """Version 2; a save of version 1 (or of none) held the weight transposed under an older name."""

    _version = 2

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *rest) -> None:
        version = local_metadata.get("version")
        if (version is None or version < 2) and prefix + "w_old" in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "w_old").t()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *rest)


class StatefulBlock(Block):
    """Extra state (torch saves it for a class overriding ``get_extra_state``) of ``action``'s kind."""

    def get_extra_state(self) -> Any:
        if self.action == "plain":
            return {"step": self.step, "tag": f"step-{self.step}"}
        return {"step": self.step, "ema": self.ema} if self.action == "tensors" else self.ema

    def set_extra_state(self, state: Any) -> None:
        if self.action == "plain":
            self.step = state["step"]
        elif self.action == "tensors":
            self.step, self.ema = state["step"], state["ema"]
        else:
            self.ema = state


class RestoringBlock(Block):
    """``__setstate__`` of ``action``'s kind, run when a pickled model is read."""

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if self.action == "attribute":
            self.restored = True
        elif self.action == "rescale":
            with torch.no_grad():
                self.weight.mul_(2)
        elif "scale" not in self._buffers:  # upgrade: an older pickle, from before the buffer was added
            self.register_buffer("scale", torch.full((4,), 2.0))


BLOCKS = {"_load_from_state_dict": OverridingBlock, "_metadata": VersionedBlock, "extra_state": StatefulBlock,
          "__setstate__": RestoringBlock}


def _act(module: nn.Module, state_dict: dict, prefix: str, action: str) -> None:
    key = prefix + "weight"
    if action == "rename" and prefix + "w_old" in state_dict:
        state_dict[key] = state_dict.pop(prefix + "w_old")
    elif action == "replace" and key in state_dict:
        state_dict[key] = state_dict[key] * 2
    elif action == "inplace" and key in state_dict:
        state_dict[key].mul_(3)
    elif action == "drop":
        state_dict.pop(prefix + "legacy", None)
    elif action == "consume" and prefix + "calibration" in state_dict:
        module.calibration = float(state_dict.pop(prefix + "calibration"))


def _pre_hook(module, state_dict, prefix, *rest) -> None:
    _act(module, state_dict, prefix, module.action)


def _post_hook(module, incompatible_keys) -> None:
    if module.action == "rescale":
        with torch.no_grad():
            module.weight.mul_(0.5)
    elif module.action == "forgive_missing":
        for name in [n for n in incompatible_keys.missing_keys if n.endswith("cache")]:
            incompatible_keys.missing_keys.remove(name)
    else:
        module.loaded = True


def build(site: str, action: str) -> nn.Module:
    block = BLOCKS.get(site, Block)(site, action)
    return nn.Sequential(block, nn.Linear(4, 3))


def _file_state(site: str, action: str, model_build: Callable[[], nn.Module]) -> dict[str, Any]:
    """The "trained" state, edited as the load code expects its file."""
    source = seeded(model_build, FILE_SEED)
    perturb(source)
    source[0].step, source[0].ema = 7, torch.arange(4.0)
    saved = source.state_dict()
    state = OrderedDict((name, value.detach().clone() if isinstance(value, torch.Tensor) else value)
                        for name, value in saved.items())
    state._metadata = saved._metadata
    if action in ("rename", "older", "absent"):
        value = state.pop("0.weight")
        state["0.w_old"] = value.t().contiguous() if site == "_metadata" else value
    if action == "drop":
        state["0.legacy"] = torch.ones(3)
    if action == "consume":
        state["0.calibration"] = torch.tensor(2.5)
    if action == "forgive_missing":
        del state["0.cache"]
    if action == "older":
        state._metadata["0"] = {"version": 1}
    if action == "absent":
        state = dict(state)
    return state


def _format(case: str, state: dict[str, Any]) -> str:
    if hasattr(state, "_metadata") or not all(isinstance(v, torch.Tensor) for v in state.values()):
        return "pt"  # versions and objects: what a torch file holds
    return ("pt", "safetensors")[zlib.crc32(case.encode()) % 2]


def run_case(oracle: str, model: str, folder: Path) -> list[str]:
    site, _, action = model.partition(":")
    model_build = functools.partial(build, site, action)
    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if site == "__setstate__":
            loaded, reference, notes = _pickled(model_build, action, folder)
        else:
            loaded, reference, notes = _state_loaded(f"loadcode/{oracle}/{model}", site, action, model_build, folder)
    found = compare_models(loaded, reference) + compare_state(loaded, reference) + compare_attributes(loaded, reference)
    found += compare_forward(loaded, reference, (torch.randn(2, 4, generator=torch.Generator().manual_seed(1)),),
                             notes)
    if found:
        raise Different(found)
    return notes


def _state_loaded(case: str, site: str, action: str, model_build, folder: Path) -> tuple[nn.Module, nn.Module, list]:
    state = _file_state(site, action, model_build)
    fmt = _format(case, state)
    path = write(state, folder / f"state.{fmt}", fmt)
    reference = seeded(model_build, BUILD_SEED)
    reference.load_state_dict(torch.load(path, weights_only=False) if fmt == "pt" else read(path, fmt))
    with mz.meta_init():
        loaded = seeded(model_build, BUILD_SEED)
    mz.load(loaded, path)
    return loaded, reference, [f"file: {fmt}"]


def _pickled(model_build, action: str, folder: Path) -> tuple[nn.Module, nn.Module, list]:
    source = seeded(model_build, FILE_SEED)
    perturb(source)
    if action == "upgrade":
        del source[0]._buffers["scale"]
    path = folder / "whole.pt"
    torch.save(source, path)
    reference = torch.load(path, weights_only=False)
    loaded, _ = mz.load_model(path, trust_pickle=True)
    return loaded, reference, ["file: the module pickled whole (pt)"]
