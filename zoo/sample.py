"""Which zoo cases ``make test`` runs: a sample drawn with a printed seed, plus every case that ever failed.

The seed is ``ZOO_SEED`` where set, else today's date (``20250131``), so the suite covers the zoo over
days while one day's runs agree; ``ZOO_SAMPLE`` sets the sample's size.
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
    """The drawn cases, then the listed failures that are still cases (a class the library dropped goes)."""
    known = set(cases)
    drawn = random.Random(seed()).sample(sorted(cases), min(size(), len(cases)))
    return drawn + [case for case in dict.fromkeys(failed) if case in known and case not in drawn]
