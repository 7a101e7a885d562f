"""Which zoo cases ``make test`` runs: a sample drawn with a printed seed, plus every case that ever failed.

The seed is ``ZOO_SEED`` where set, else today's date (``20250131``), so the suite covers the zoo over
days while one day's runs agree; ``ZOO_SAMPLE`` sets the sample's size, which the libraries share equally.
"""

from __future__ import annotations

import datetime
import os
import random

DEFAULT_SIZE = 24


def seed() -> int:
    value = os.environ.get("ZOO_SEED")
    return int(value) if value else int(datetime.date.today().strftime("%Y%m%d"))


def size() -> int:
    return int(os.environ.get("ZOO_SAMPLE", DEFAULT_SIZE))


def sample(cases: list[str], failed: list[str]) -> list[str]:
    """The drawn cases, then the listed failures that are still cases (a class the library dropped goes).

    Each library gets an equal share of the draw (at least one case), whatever its size: a family of thirty
    cases is drawn as often as one of three thousand; what the shares leave is drawn from all the cases.
    """
    known = set(cases)
    rng = random.Random(seed())
    by_library: dict[str, list[str]] = {}
    for case in sorted(cases):
        by_library.setdefault(case.split("/", 1)[0], []).append(case)
    share = max(1, size() // max(1, len(by_library)))
    drawn = [case for library in sorted(by_library)
             for case in rng.sample(by_library[library], min(share, len(by_library[library])))][:size()]
    rest = sorted(known - set(drawn))
    drawn += rng.sample(rest, min(size() - len(drawn), len(rest)))
    return drawn + [case for case in dict.fromkeys(failed) if case in known and case not in drawn]
