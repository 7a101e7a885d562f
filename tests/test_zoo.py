"""A sample of the model zoo (``zoo/``; ``make zoo`` runs all of it, docs/zoo.md has its table).

The cases are generated from the libraries: every transformers class of the auto mappings at a tiny
config, timm's families, torchvision's builders, each under the deferred oracle (``mz.deferred_init`` +
``mz.materialize`` is eager construction bit for bit) and the load oracle (``mz.load_model`` is
``from_pretrained``; ``mz.build`` + ``mz.load`` is eager + ``load_state_dict``). The suite runs a sample
drawn with a seed shown in pytest's header (``ZOO_SEED``, else the date; ``ZOO_SAMPLE`` cases) and every
case of ``tests/zoo_failed.txt``, each as its own parameter named by the case, in one worker process (as
``make zoo`` runs them: timm importable to transformers whatever the suite imported first). A case whose eager
construction fails is skipped with the reason; a refusal, a difference or an error fails it, but for a case
listed with its cause, which must still differ.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers", reason="the zoo's transformers cases need it")

from vision import import_torchvision  # noqa: E402
from zoo import sample  # noqa: E402
from zoo.cases import LIBRARIES, case_names  # noqa: E402
from zoo.report import known_differences  # noqa: E402
from zoo.run import OneCase  # noqa: E402

CASE_SECONDS = 300
LIBRARIES_HERE = LIBRARIES if import_torchvision() is not None else ("hf",)  # make test-oldest: no timm, torchvision
KNOWN = known_differences()
CASES = sample.sample(case_names(LIBRARIES_HERE), list(KNOWN))


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    one = OneCase(tmp_path_factory.mktemp("zoo"), CASE_SECONDS)
    yield one
    one.close()


@pytest.mark.parametrize("case", CASES)
def test_zoo_case(case, worker):
    result = worker.run(case)
    status, detail = result["status"], result.get("detail", "")
    if status == "skipped":
        pytest.skip(detail)
    if KNOWN.get(case):  # a difference left open, its cause named in tests/zoo_failed.txt
        assert status in ("different", "refused"), f"{case} is {status} now: take its cause out of tests/zoo_failed.txt"
        return
    assert status == "equal", f"{case}: {status}: {detail}" + (f" ({result['where']})" if result.get("where") else "")
    print("\n".join(result.get("notes", [])))


def test_the_sample_is_drawn_from_every_library_and_both_oracles_over_the_zoo():
    cases = case_names(LIBRARIES_HERE)
    libraries = {c.split("/")[0] for c in cases}
    assert libraries == set(LIBRARIES_HERE)
    assert {c.split("/")[1] for c in cases} == {"deferred", "load"}
    assert len({c.split("/")[2] for c in cases if c.startswith("hf/")}) > 400  # every class of the auto mappings


def test_each_library_has_an_equal_share_of_the_draw_however_few_its_cases(monkeypatch):
    monkeypatch.setenv("ZOO_SAMPLE", "6")
    cases = [f"large/deferred/{number}" for number in range(1000)] + ["small/load/a", "small/load/b", "small/load/c"]

    drawn = sample.sample(cases, ["small/load/a", "gone/load/x"])

    assert len(drawn) == 6 and len(set(drawn)) == 6
    assert sorted(c for c in drawn if c.startswith("small/")) == ["small/load/a", "small/load/b", "small/load/c"]
