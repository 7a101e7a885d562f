"""Why a model's names and a checkpoint's disagree, said in a mismatch error as the key_map that fixes it.

Two causes cover most checkpoints from another codebase: a prefix one side
carries (a Lightning module's ``model.``), and a few segments spelled
otherwise (torchvision's classic DenseNet ``norm.1`` for ``norm1``, an old
LayerNorm's ``gamma`` for ``weight``, ``backbone`` for ``encoder``). A hint
is given only when applying it to the unexpected names finds nearly all of
the missing ones: a suggestion that was tried, not a guess. Renames are
looked for until every missing name is found (or none more helps), so the
hint holds all that are needed, and says which names it leaves missing.
"""

from __future__ import annotations

import bisect
import difflib
import random
import re
from collections import Counter
from collections.abc import Sequence
from typing import Optional

from ..errors import summarize_names

_SAMPLED = 200  # missing names paired up, each round, to find the renames; the rules found are then tried on all
_NEIGHBOURS = 8  # candidates looked at on each side of a name, sorted by prefix and by suffix
_MAX_RULES = 16  # past this many, the names are not "a few segments spelled otherwise"
_TRIED_PER_ROUND = 8  # renames tried on all names per round, the most frequent in the sample first
_ENOUGH = 0.9  # of the missing names a hint must find
# Older spellings of a norm's tensors (TensorFlow ports, early BERT saves): paired first where names tie.
_OLD_SPELLINGS = {"gamma": "weight", "beta": "bias"}
_NEAREST_SHOWN = 3  # model names shown beside their nearest checkpoint names
_NEAREST_POOL = 20_000  # checkpoint names searched for them: an error on a huge checkpoint stays quick
_NEAREST_CUTOFF = 0.5  # difflib's similarity under which a name is "none near"


def mismatch_hint(missing: Sequence[str], unexpected: Sequence[str]) -> str:
    """A key_map (library and CLI spelling) that lines the names up, or ``""`` where none is clear."""
    if not missing or not unexpected:
        return ""
    return _prefix_hint(missing, unexpected) or _rename_hint(missing, unexpected)


def nearest_names(model_names: Sequence[str], checkpoint_names: Sequence[str]) -> str:
    """The first few model names, one from each module, each beside the checkpoint name most like it
    (difflib's ratio), in words; ``""`` where either side has none. Where no rename lines the names up, this
    is what a user compares to see how the two sides name things."""
    if not model_names or not checkpoint_names:
        return ""
    picked: dict[str, str] = {}  # module -> its first name
    for name in model_names:
        picked.setdefault(name.rpartition(".")[0], name)
        if len(picked) == _NEAREST_SHOWN:
            break
    pool = list(checkpoint_names)
    if len(pool) > _NEAREST_POOL:
        pool = random.Random(0).sample(pool, _NEAREST_POOL)
    pairs = []
    for name in picked.values():
        near = difflib.get_close_matches(name, pool, n=1, cutoff=_NEAREST_CUTOFF)
        pairs.append(f"model {name!r} ~ checkpoint {near[0]!r}" if near else f"model {name!r} ~ none near in the checkpoint")
    return "the nearest names: " + ", ".join(pairs)


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
    search = _RenameSearch(missing, unexpected)
    while len(search.rules) < _MAX_RULES and len(search.found) < len(search.wanted) and search.round():
        pass
    rules, found, wanted = search.rules, search.found, search.wanted
    if not rules or len(found) < _ENOUGH * len(wanted):
        return ""
    patterns = {_pattern(old): new for old, new in rules}
    library = ", ".join(f"{_raw(pattern)}: {new!r}" for pattern, new in patterns.items())
    cli = " ".join(f"--rename '{pattern}={new}'" for pattern, new in patterns.items())
    said = ", ".join(f"'{new}' as '{old}'" for old, new in rules)
    if len(found) == len(wanted):
        counted = f"all {len(wanted)} missing names found so"
    else:
        left = [name for name in missing if name not in found]
        counted = (f"{len(found)} of the {len(wanted)} missing names found so; {len(left)} "
                   f"stay{'s' if len(left) == 1 else ''} missing under these renames: {summarize_names(left, limit=3)}")
    return f"the checkpoint spells the model's {said} ({counted}): pass key_map={{{library}}} (CLI: {cli})"


class _RenameSearch:
    """Renames found in rounds, until they find every missing name or no further one helps.

    Each round pairs the missing names not found yet with their closest
    unexpected names not renamed onto one yet, and tries the edits most of
    them share on every unexpected name; an edit is kept where it finds more
    missing names and reads no two checkpoint names into one. A rename only a
    few names need (a layer's one weight, where its norms have five tensors
    each) shows in a later round, once the frequent ones no longer hide it.
    """

    def __init__(self, missing: Sequence[str], unexpected: Sequence[str]) -> None:
        self.missing = list(missing)
        self.wanted = set(missing)
        self.renamed = {name: name for name in unexpected}  # each unexpected name as the rules so far make it
        self.found: set[str] = set()  # missing names one unexpected name is renamed to (never two)
        self.rules: list[tuple[str, str]] = []  # (the checkpoint's spelling, the model's), in order

    def round(self) -> bool:
        """Add the renames this round finds; whether it found any."""
        left = [name for name in self.missing if name not in self.found]
        sample = random.Random(0).sample(left, _SAMPLED) if len(left) > _SAMPLED else left  # a stride would alias
        pool = sorted(name for name, now in self.renamed.items() if now not in self.wanted)
        by_suffix = sorted(name[::-1] for name in pool)
        edits: Counter[tuple[str, str]] = Counter()
        for name in sample:
            edit = _edit(name, _closest(name, pool, by_suffix))
            if edit is not None and all(edit[0] != taken for taken, _ in self.rules):  # one spelling, one rename
                edits[edit] += 1
        before = len(self.rules)
        for edit, _ in edits.most_common(_TRIED_PER_ROUND):
            if len(self.rules) < _MAX_RULES:
                self._keep_if_it_finds_more(*edit)
        return len(self.rules) > before

    def _keep_if_it_finds_more(self, old: str, new: str) -> None:
        rule = re.compile(_pattern(old))
        changed = {name: rule.sub(new, now) for name, now in self.renamed.items() if old in now}
        changed = {name: now for name, now in changed.items() if now != self.renamed[name]}
        kept = self.found - {self.renamed[name] for name in changed}
        gained = [now for now in changed.values() if now in self.wanted]
        if len(set(gained)) != len(gained) or any(now in kept for now in gained):
            return  # two checkpoint tensors would be read into one
        if len(kept) + len(gained) <= len(self.found):
            return
        self.rules.append((old, new))
        self.renamed.update(changed)
        self.found = kept | set(gained)


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
