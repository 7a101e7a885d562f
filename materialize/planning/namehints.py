"""Why a model's names and a checkpoint's disagree, said in a mismatch error as the key_map that fixes it.

Two causes cover most checkpoints from another codebase: a prefix one side
carries (a Lightning module's ``model.``), and a few segments spelled
otherwise (torchvision's classic DenseNet ``norm.1`` for ``norm1``, an old
LayerNorm's ``gamma`` for ``weight``, ``backbone`` for ``encoder``). A hint
is given only when applying it to the unexpected names finds nearly all of
the missing ones: a suggestion that was tried, not a guess. Renames are
looked for until every missing name is found (or none more helps), so the
hint holds all that are needed, and says which names it leaves missing.
Where the load was given rename rules already (``--strip-prefix``, ``--rename``,
``--add-prefix``, a :class:`~materialize.planning.keymap.KeyMap`), the hint is
looked for among the names those rules make and said as rules to add to
them: appended to the same command, it works.
"""

from __future__ import annotations

import bisect
import difflib
import random
import re
from collections import Counter
import shlex
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Optional, Union

from ..errors import summarize_names
from .keymap import KeyMap, KeyMapLike

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


def mismatch_hint(missing: Sequence[str], unexpected: Sequence[str], given: KeyMapLike = None) -> str:
    """A key_map (library and CLI spelling) that lines the names up, or ``""`` where none is clear.

    ``given``: the key map the load was given (``unexpected`` are the checkpoint's own names). Where it
    is a :class:`KeyMap` or a mapping (the CLI's ``--strip-prefix``, ``--rename``, ``--add-prefix``
    make one), the hint is looked for among the names its rules make, and said as those rules and the
    ones to add: the CLI spelling is options to append to the same command, each acting where the CLI
    applies it (``--strip-prefix`` first, then the ``--rename`` rules in order, ``--add-prefix`` last).
    A hint for the names as the file spells them would name what the given rules renamed already.
    A callable ``given`` (a model's own renames) is not looked into: the hint replaces it.
    """
    if not missing or not unexpected:
        return ""
    rules = _rules_of(given)
    if not rules:
        return _spelled(_prefix_found(missing, unexpected) or _renames_found(missing, unexpected), None)
    return _after_given(missing, unexpected, rules)


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


def _prefix_found(missing: Sequence[str], unexpected: Sequence[str]) -> Optional[tuple[str, str]]:
    """``("strip", prefix)`` where the checkpoint's names carry a prefix the model's lack, ``("add", prefix)``
    where the model's carry one the checkpoint's lack, else ``None``."""
    for extra, short in ((unexpected, missing), (missing, unexpected)):
        extras = set(extra)
        sample = short[:50]
        for name in sample[:5]:
            prefix = next((n[: -len(name)] for n in extra if n.endswith("." + name)), None)
            if prefix is None or sum(prefix + n in extras for n in sample) < _ENOUGH * len(sample):
                continue
            return ("strip" if extra is unexpected else "add"), prefix
    return None


class _Renames(NamedTuple):
    """Segments renamed the same way in most names, and how many of the missing names they find."""

    rules: list[tuple[str, str]]  # (the checkpoint's spelling, the model's), in order
    found: int
    wanted: int
    left: list[str]  # the missing names they do not find


def _renames_found(missing: Sequence[str], unexpected: Sequence[str]) -> Optional[_Renames]:
    """Segments renamed the same way in most names: ``norm.1`` -> ``norm1`` wherever it stands."""
    search = _RenameSearch(missing, unexpected)
    while len(search.rules) < _MAX_RULES and len(search.found) < len(search.wanted) and search.round():
        pass
    rules, found, wanted = search.rules, search.found, search.wanted
    if not rules or len(found) < _ENOUGH * len(wanted):
        return None
    return _Renames(rules, len(found), len(wanted), [name for name in missing if name not in found])


_Found = Union[tuple[str, str], _Renames, None]


def _spelled(found: _Found, given: Optional[_Given]) -> str:
    """What was found, in words, as the key_map to pass (``given``'s rules and these) and the CLI's options."""
    if found is None:
        return ""
    after = f"after the given key_map ({given.described}), " if given is not None else ""
    if not isinstance(found, _Renames):  # a prefix
        kind, prefix = found
        whose = "checkpoint" if kind == "strip" else "model"
        rule = KeyMap.strip_prefix(prefix) if kind == "strip" else KeyMap.add_prefix(prefix)
        return (f"{after}the {whose} names carry the prefix '{prefix}': pass key_map="
                f"{_library(rule, given)}{_cli(rule, given)}")
    patterns = {_pattern(old): new for old, new in found.rules}
    rule = KeyMap.regex(patterns)
    said = ", ".join(f"'{new}' as '{old}'" for old, new in found.rules)
    if found.found == found.wanted:
        counted = f"all {found.wanted} missing names found so"
    else:
        counted = (f"{found.found} of the {found.wanted} missing names found so; {len(found.left)} "
                   f"stay{'s' if len(found.left) == 1 else ''} missing under these renames: "
                   f"{summarize_names(found.left, limit=3)}")
    return f"{after}the checkpoint spells the model's {said} ({counted}): pass key_map={_library(rule, given)}{_cli(rule, given)}"


class _Given(NamedTuple):
    """A given key map's rules, parted where the hint's rules go: before a last ``add_prefix`` (the CLI
    applies ``--add-prefix`` last, after every ``--rename``)."""

    before: tuple  # the rules the hint's act after
    added: str  # the prefix the last rule adds ("" where it adds none)
    described: str


def _rules_of(given: KeyMapLike) -> tuple:
    if isinstance(given, KeyMap):
        return given.rules
    if isinstance(given, Mapping):
        return KeyMap.regex(given).rules
    return ()


def _after_given(missing: Sequence[str], unexpected: Sequence[str], rules: tuple) -> str:
    """The hint for the names ``rules`` make of the checkpoint's, said so that it adds to them."""
    adds = rules[-1][0].pattern == "^"
    before, added = (rules[:-1], rules[-1][1]) if adds else (rules, "")
    given = _Given(before, added, KeyMap(rules).describe())
    renamed = [KeyMap(before)(name) for name in unexpected]
    # Before the last prefix added, a model name is without it: one without it is no name these rules can make.
    wanted = [name[len(added):] for name in missing if name.startswith(added)]
    if not wanted or not renamed:
        return ""
    return _spelled(_prefix_found(wanted, renamed) or _renames_found(wanted, renamed), given)


def _library(rule: KeyMap, given: Optional[_Given]) -> str:
    """The key_map to pass, in Python: the hint's rule, between ``given``'s where it acts."""
    if given is None:
        if rule.rules[0][0].pattern == "^" or _stripped(rule.rules[0]) is not None:
            return _python(rule.rules)
        return "{" + ", ".join(f"{_raw(p.pattern)}: {new!r}" for p, new in rule.rules) + "}"
    after = KeyMap.add_prefix(given.added).rules if given.added else ()
    return " + ".join(_python(rules) for rules in (given.before, rule.rules, after) if rules)


def _cli(rule: KeyMap, given: Optional[_Given]) -> str:
    """`` (CLI: ...)``: the options that, appended to the command, add ``rule`` where it acts; ``""`` where
    ``given`` is no key map the CLI's options make (a library caller's rules in another order)."""
    before = given.before if given is not None else ()
    # The CLI's order: one --strip-prefix first, then --rename rules, then one --add-prefix (given.added).
    strips = before[:1] if before and _stripped(before[0]) is not None else ()
    if any(pattern.pattern == "^" for pattern, _ in before):
        return ""  # a prefix added before other rules: no order of the CLI's options
    renames = before[len(strips):]
    pattern, new = rule.rules[0]
    if pattern.pattern == "^":  # add_prefix: the CLI's last step, unless the given rules add one there already
        options = [f"--add-prefix {new}"] if given is None or not given.added else [f"--rename {_quoted('^=' + new)}"]
    elif _stripped(rule.rules[0]) is not None and not strips and not renames:  # the CLI's first step is free
        options = [f"--strip-prefix {_stripped(rule.rules[0])}"]
    else:  # a --rename, after those given and before --add-prefix, wherever the rule acts
        options = [f"--rename {_quoted(f'{p.pattern}={r}')}" for p, r in rule.rules]
    return f" (CLI: {' '.join(options)})"


def _quoted(text: str) -> str:
    return f"'{text}'" if "'" not in text else shlex.quote(text)


def _stripped(rule: tuple) -> Optional[str]:
    """The prefix a rule strips (``KeyMap.strip_prefix``'s), else ``None``."""
    pattern, replacement = rule
    text = pattern.pattern
    if replacement or not text.startswith("^") or len(text) == 1:
        return None
    prefix = re.sub(r"\\(.)", r"\1", text[1:])
    return prefix if re.escape(prefix) == text[1:] else None


def _python(rules: tuple) -> str:
    """Rules as the KeyMap expression that makes them: ``KeyMap.strip_prefix('model.') + KeyMap.regex({...})``."""
    parts: list[str] = []
    run: dict[str, str] = {}

    def end_run() -> None:
        if run:
            parts.append("KeyMap.regex({" + ", ".join(f"{_raw(p)}: {new!r}" for p, new in run.items()) + "})")
            run.clear()

    for rule in rules:
        pattern, replacement = rule
        stripped = _stripped(rule)
        if pattern.pattern == "^" or stripped is not None:
            end_run()
            parts.append(f"KeyMap.add_prefix({replacement!r})" if stripped is None else f"KeyMap.strip_prefix({stripped!r})")
            continue
        if pattern.pattern in run:  # a pattern twice: a mapping holds it once
            end_run()
        run[pattern.pattern] = replacement
    end_run()
    return " + ".join(parts) or "KeyMap()"


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
