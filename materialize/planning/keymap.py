"""Renaming checkpoint keys to model names.

A checkpoint saved from a wrapper (``DistributedDataParallel``'s ``module.``,
``torch.compile``'s ``_orig_mod.``, a base model inside a head model's
``model.``) names tensors differently from the bare model. A :class:`KeyMap`
is an ordered list of rules applied to every checkpoint name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Union

# Prefixes that wrappers add; stripped automatically when every checkpoint key carries one and no model name
# does (see KeyMap.auto).
from ..checkpoint.modelstate import WRAPPER_PREFIXES


@dataclass(frozen=True)
class KeyMap:
    """Ordered rename rules from checkpoint names to model names.

    Build one with the class methods, or pass a plain mapping of
    ``{regex: replacement}`` (applied with :func:`re.sub`, in order) or a
    callable ``name -> name`` wherever a ``key_map`` is accepted. Key maps
    add up in order (``KeyMap.strip_prefix("model.") + KeyMap.add_prefix("net.")``),
    and calling one renames a name.

    Fields:
        rules: ``(compiled pattern, replacement)`` pairs, applied in order with ``re.sub``.
    """

    rules: tuple[tuple[re.Pattern, str], ...] = field(default_factory=tuple)

    @classmethod
    def strip_prefix(cls, prefix: str) -> "KeyMap":
        """Remove ``prefix`` from the start of names that have it (CLI ``--strip-prefix``)."""
        return cls(((re.compile("^" + re.escape(prefix)), ""),))

    @classmethod
    def add_prefix(cls, prefix: str) -> "KeyMap":
        """Put ``prefix`` before every name (CLI ``--add-prefix``)."""
        return cls(((re.compile("^"), prefix),))

    @classmethod
    def regex(cls, renames: Mapping[str, str]) -> "KeyMap":
        """``{pattern: replacement}`` applied with ``re.sub``, in order (CLI ``--rename REGEX=REPL``)."""
        return cls(tuple((re.compile(pattern), replacement) for pattern, replacement in renames.items()))

    def __add__(self, other: "KeyMap") -> "KeyMap":
        return KeyMap(self.rules + other.rules)

    def __call__(self, name: str) -> str:
        for pattern, replacement in self.rules:
            name = pattern.sub(replacement, name)
        return name

    def describe(self) -> str:
        """The rules in words: ``strip 'module.'``, ``add 'model.'``, ``'norm\\.1' -> 'norm1'``."""
        parts = []
        for pattern, replacement in self.rules:
            text = pattern.pattern
            if text == "^":
                parts.append(f"add {replacement!r}")
            elif text.startswith("^") and not replacement and re.escape(_unescaped(text[1:])) == text[1:]:
                parts.append(f"strip {_unescaped(text[1:])!r}")
            else:
                parts.append(f"{text!r} -> {replacement!r}")
        return ", ".join(parts)

    def unmatched(self, names: Iterable[str]) -> list[str]:
        """The rules (described) that match none of ``names``, each taken at its turn, after the rules before it."""
        hit = [False] * len(self.rules)
        for name in names:
            for index, (pattern, replacement) in enumerate(self.rules):
                hit[index] = hit[index] or pattern.search(name) is not None
                name = pattern.sub(replacement, name)
        return [KeyMap((rule,)).describe() for rule, found in zip(self.rules, hit) if not found]


def _unescaped(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


KeyMapLike = Union[KeyMap, Mapping[str, str], Callable[[str], str], None]


def unchanged(name: str) -> str:
    """The rename that renames nothing (planning maps a checkpoint's names at once where it is the rename)."""
    return name


def as_key_map(key_map: KeyMapLike) -> Callable[[str], str]:
    if key_map is None:
        return unchanged
    if isinstance(key_map, Mapping):
        return KeyMap.regex(key_map)
    if callable(key_map):
        return key_map
    raise TypeError(f"key_map must be a KeyMap, a mapping of regex to replacement or a callable, got {type(key_map).__name__}")


def auto_strip_wrapper_prefix(checkpoint_names: Iterable[str], model_names: set[str]) -> Callable[[str], str]:
    """The rename that lines the checkpoint's names up with the model's, where one prefix is all they differ by.

    ``module.`` / ``_orig_mod.`` are stripped when every checkpoint name has
    it and no model name does, stacked ones too (``_orig_mod.module.``). Any other prefix (a Lightning module's
    ``model.`` or ``net.``, an EMA copy's ``ema.``, a wrapper's attribute) is
    stripped from, or added to, the checkpoint's names only when that makes
    one side's names a subset of the other's: a rename that explains every
    name, never a guess. Anything less is left to the caller's key_map (the
    mismatch error suggests one).
    """
    names = list(checkpoint_names)
    wrappers = _wrapper_chain(names, model_names)
    if wrappers:
        return KeyMap.strip_prefix(wrappers)
    if not names or not model_names or not set(names).isdisjoint(model_names):
        return unchanged
    for prefix in _shared_prefixes(names):
        if not any(m.startswith(prefix) for m in model_names) and _nested({n[len(prefix):] for n in names}, model_names):
            return KeyMap.strip_prefix(prefix)
    for prefix in _shared_prefixes(list(model_names)):
        if not any(n.startswith(prefix) for n in names) and _nested({prefix + n for n in names}, model_names):
            return KeyMap.add_prefix(prefix)
    return unchanged


def _wrapper_chain(names: list[str], model_names: set[str]) -> str:
    """The wrapper prefixes every checkpoint name starts with and no model name does, however stacked:
    ``torch.compile(DDP(model))`` saves ``_orig_mod.module.``, ``DDP(torch.compile(model))`` ``module._orig_mod.``."""
    chain = ""
    while names:
        step = next((prefix for prefix in WRAPPER_PREFIXES if all(n.startswith(chain + prefix) for n in names)
                     and not any(m.startswith(chain + prefix) for m in model_names)), None)
        if step is None:
            return chain
        chain += step
    return chain


def _shared_prefixes(names: list[str]) -> list[str]:
    """The dotted prefixes every name starts with, shortest first (``["model.", "model.backbone."]``)."""
    first = names[0].split(".")[:-1]
    depth = len(first)
    for name in names[1:]:
        parts = name.split(".", depth)
        depth = next((i for i in range(min(depth, len(parts) - 1)) if parts[i] != first[i]), min(depth, len(parts) - 1))
        if depth == 0:
            return []
    return [".".join(first[:i]) + "." for i in range(1, depth + 1)]


def _nested(renamed: set[str], model_names: set[str]) -> bool:
    return renamed <= model_names or renamed >= model_names
