"""Every hostile input of the corpus, through the library and through the CLI.

Each must end in the named MaterializeError subclass whose message names the
file; from the CLI, exit 1 with exactly one ``Error:`` line, no traceback,
nothing on stdout; and never the side effect of code carried in the file.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest


import materialize as mz

from corpus import Case, build
import preforked

CLI = str(Path(sys.executable).parent / "materialize")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[Case]]:
    root = tmp_path_factory.mktemp("corpus")
    return root, build(root)


def test_the_corpus_is_broad(corpus):
    _, cases = corpus

    assert len(cases) >= 40
    assert len({c.name for c in cases}) == len(cases)


def test_every_case_fails_cleanly_in_the_library(corpus):
    root, cases = corpus
    failures = []
    for case in cases:
        target = root / case.name / case.target
        try:
            mz.load_model(target, **case.load)
            failures.append(f"{case.name}: no error")
        except mz.MaterializeError as error:
            message = str(error)
            if type(error).__name__ != case.error and not isinstance(error, getattr(mz, case.error)):
                failures.append(f"{case.name}: {type(error).__name__}, expected {case.error}: {message}")
            missing = [w for w in [str(target.parent if case.target == "." else target), *case.words] if w not in message]
            if missing:
                failures.append(f"{case.name}: message lacks {missing}: {message}")
        except Exception as error:  # anything else is a bug of ours
            failures.append(f"{case.name}: raised {type(error).__name__}: {error}")
        if case.marker and (root / case.name / case.marker).exists():
            failures.append(f"{case.name}: the file ran code")

    assert failures == []


def test_every_kind_of_refusal_fails_cleanly_in_the_cli(corpus):
    """The quick tier's CLI run of the corpus: one case of each error class, each in a process of its own."""
    root, cases = corpus
    first_of_each = list({case.error: case for case in reversed(cases)}.values())
    assert len(first_of_each) >= 5  # the classes the corpus refuses with: a sample of one would check little
    assert _cli_failures(root, first_of_each) == []


@pytest.mark.long  # every case of the corpus through the CLI, a process each; the library test above runs them all
def test_every_case_fails_cleanly_in_the_cli(corpus):
    root, cases = corpus
    assert _cli_failures(root, cases) == []


def _cli_failures(root: Path, cases: list[Case]) -> list[str]:
    """How each case's CLI run failed to fail cleanly: exit 1, one Error line naming the file, nothing on stdout,
    no code run."""

    def run(case: Case) -> str:
        target = root / case.name / case.target
        done = preforked.run([CLI, str(target), *case.cli], capture_output=True, text=True)
        lines = done.stderr.strip().splitlines()
        problems = []
        if done.returncode != 1:
            problems.append(f"exit {done.returncode}")
        if done.stdout:
            problems.append("wrote to stdout")
        if len(lines) != 1 or not lines[0].startswith("Error: ") or "Traceback" in done.stderr:
            problems.append(f"stderr is not one Error line: {done.stderr[:300]!r}")
        elif str(target.parent if case.target == "." else target) not in lines[0]:
            problems.append(f"the line does not name the file: {lines[0]}")
        if case.marker and (root / case.name / case.marker).exists():
            problems.append("the file ran code")
        return f"{case.name}: {', '.join(problems)}" if problems else ""

    with ThreadPoolExecutor(max_workers=4) as pool:
        return [line for line in pool.map(run, cases) if line]
