"""Why a model's names and a checkpoint's disagree, said in a mismatch error as the key_map that fixes it.

Two causes cover most checkpoints from another codebase: a prefix one side
carries (a Lightning module's ``model.``), and a few segments spelled
otherwise (torchvision's classic DenseNet ``norm.1`` for ``norm1``, an old
LayerNorm's ``gamma`` for ``weight``, ``backbone`` for ``encoder``). A hint
is given only when applying it to the unexpected names finds nearly all of
the missing ones: a suggestion that was tried, not a guess.
"""

from __future__ import annotations

import bisect
import re
from collections import Counter
from collections.abc import Sequence
from typing import Optional

from .keymap import KeyMap

_SAMPLED = 200  # missing names paired up to find the renames; the rules found are then tried on all
_NEIGHBOURS = 8  # candidates looked at on each side of a name, sorted by prefix and by suffix
_MAX_RULES = 4
_ENOUGH = 0.9  # of the missing names a hint must find
# Older spellings of a norm's tensors (TensorFlow ports, early BERT saves): paired first where names tie.
_OLD_SPELLINGS = {"gamma": "weight", "beta": "bias"}


def mismatch_hint(missing: Sequence[str], unexpected: Sequence[str]) -> str:
    """A key_map (library and CLI spelling) that lines the names up, or ``""`` where none is clear."""
    if not missing or not unexpected:
        return ""
    return _prefix_hint(missing, unexpected) or _rename_hint(missing, unexpected)


def _prefix_hint(missing: Sequence[str], unexpected: Sequence[str]) -> str:
    for extra, short in ((unexpected, missing), (missing, unexpected)):
        extras = set(extra)
        sample = short[:50]
        for name in sample[:5]:
            prefix = next((n[: -len(name)] for n in extra if n.endswith("." + name)), None)
            if prefix is None or sum(prefix + n in extras for n in sample) < _ENOUGH * len(sample):
                continue
            if extra is unexpected:
                return (f"the checkpoint names carry the prefix '{prefix}': pass "
                        f"key_map=KeyMap.strip_prefix('{prefix}') (CLI: --strip-prefix {prefix})")
            return (f"the model names carry the prefix '{prefix}': pass "
                    f"key_map=KeyMap.add_prefix('{prefix}') (CLI: --add-prefix {prefix})")
    return ""


def _rename_hint(missing: Sequence[str], unexpected: Sequence[str]) -> str:
    """Segments renamed the same way in most names: ``norm.1`` -> ``norm1`` wherever it stands."""
    by_prefix = sorted(unexpected)
    by_suffix = sorted(name[::-1] for name in unexpected)
    step = max(1, len(missing) // _SAMPLED)
    edits: Counter[tuple[str, str]] = Counter()
    for name in list(missing)[::step]:
        edit = _edit(name, _closest(name, by_prefix, by_suffix))
        if edit is not None:
            edits[edit] += 1
    rules: list[tuple[str, str]] = []
    for old, new in (edit for edit, _ in edits.most_common()):
        if len(rules) < _MAX_RULES and all(old != taken for taken, _ in rules):  # one spelling, one rename
            rules.append((old, new))
    if not rules:
        return ""
    patterns = {_pattern(old): new for old, new in rules}
    rename = KeyMap.regex(patterns)
    wanted = set(missing)
    found = {rename(name) for name in unexpected} & wanted
    if len(found) < _ENOUGH * len(wanted):
        return ""
    library = ", ".join(f"{_raw(pattern)}: {new!r}" for pattern, new in patterns.items())
    cli = " ".join(f"--rename '{pattern}={new}'" for pattern, new in patterns.items())
    said = ", ".join(f"'{old}' as '{new}'" for old, new in rules)
    return (f"the checkpoint spells {said} ({len(found)} of the {len(wanted)} missing names found so): "
            f"pass key_map={{{library}}} (CLI: {cli})")


def _closest(name: str, by_prefix: list[str], by_suffix: list[str]) -> Optional[str]:
    """The unexpected name sharing the most leading and trailing segments with ``name``, then characters."""
    candidates = []
    for ordered, key, flip in ((by_prefix, name, False), (by_suffix, name[::-1], True)):
        at = bisect.bisect_left(ordered, key)
        for other in ordered[max(0, at - _NEIGHBOURS):at + _NEIGHBOURS]:
            candidates.append(other[::-1] if flip else other)
    if not candidates:
        return None
    return max(candidates, key=lambda other: (sum(_shared(name.split("."), other.split("."))),
                                              _spelled_of_old(other) == name, sum(_shared(name, other))))


def _spelled_of_old(name: str) -> str:
    module, _, attr = name.rpartition(".")
    return f"{module}.{_OLD_SPELLINGS[attr]}" if attr in _OLD_SPELLINGS else name


def _shared(ours: Sequence[str], theirs: Sequence[str]) -> tuple[int, int]:
    """Items (segments, or characters) two names share at their start and (not overlapping it) at their end."""
    start = 0
    while start < min(len(ours), len(theirs)) and ours[start] == theirs[start]:
        start += 1
    end = 0
    while end < min(len(ours), len(theirs)) - start and ours[-1 - end] == theirs[-1 - end]:
        end += 1
    return start, end


def _edit(model_name: str, checkpoint_name: Optional[str]) -> Optional[tuple[str, str]]:
    """The run of segments ``checkpoint_name`` spells otherwise than ``model_name`` (old, new), where they share most."""
    if checkpoint_name is None:
        return None
    ours, theirs = model_name.split("."), checkpoint_name.split(".")
    start, end = _shared(ours, theirs)
    if start + end < max(1, min(len(ours), len(theirs)) // 2):
        return None  # too little in common to be one name renamed
    new, old = ours[start:len(ours) - end], theirs[start:len(theirs) - end]
    # A segment dropped or added, or an index renamed (a Sequential's `0` for `fc1`): said with the segment
    # before it, so the rule has both sides and does not rename every other `0` of the names.
    if not new or not old or ".".join(old).isdigit():
        if start > 0:
            start -= 1
        elif end > 0:
            end -= 1
        new, old = ours[start:len(ours) - end], theirs[start:len(theirs) - end]
    if not new or not old:
        return None
    return ".".join(old), ".".join(new)


def _raw(pattern: str) -> str:
    return f"r'{pattern}'" if "'" not in pattern and not pattern.endswith("\\") else repr(pattern)


def _pattern(old: str) -> str:
    """``old`` as whole segments of a name, readable where word boundaries are segment boundaries."""
    if re.fullmatch(r"\w(?:.*\w)?", old):
        return rf"\b{re.escape(old)}\b"
    return rf"(?<![^.]){re.escape(old)}(?![^.])"
