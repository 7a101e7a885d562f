"""What a case can end as, besides passing: raised by the oracles, caught by the runner and the tests."""

from __future__ import annotations


class Skipped(Exception):
    """The case cannot be built eagerly (or by the library's own reference path): nothing to compare."""


class Different(AssertionError):
    """The oracle found differences; the first line of the message is the first difference."""

    def __init__(self, differences: list[str]) -> None:
        self.differences = list(differences)
        super().__init__("\n".join(self.differences))


def one_line(error: BaseException, limit: int = 300) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:limit]}"
