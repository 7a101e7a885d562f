"""A sample of the model zoo (``zoo/``; ``make zoo`` runs all of it, docs/zoo.md has its table).

The cases are generated from the libraries: every transformers class of the auto mappings at a tiny
config, timm's families, torchvision's builders, each under the deferred oracle (``mz.deferred_init`` +
``mz.materialize`` is eager construction bit for bit) and the load oracle (``mz.load_model`` is
``from_pretrained``; ``mz.build`` + ``mz.load`` is eager + ``load_state_dict``). The suite runs a sample
drawn with a seed shown in pytest's header (``ZOO_SEED``, else the date; ``ZOO_SAMPLE`` cases) and every
case of ``tests/zoo_failed.txt``, each as its own parameter named by the case. A case whose eager
construction fails is skipped with the reason; a refusal, a difference or an error fails it.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers", reason="the zoo's transformers cases need it")

from vision import import_torchvision  # noqa: E402
from zoo import sample  # noqa: E402
from zoo.cases import LIBRARIES, case_names, run_case  # noqa: E402
from zoo.outcomes import Skipped  # noqa: E402
from zoo.report import read_failed  # noqa: E402

LIBRARIES_HERE = LIBRARIES if import_torchvision() is not None else ("hf",)  # make test-oldest: no timm, torchvision
CASES = sample.sample(case_names(LIBRARIES_HERE), read_failed())


@pytest.mark.parametrize("case", CASES, ids=CASES)
def test_zoo_case(case, tmp_path):
    try:
        notes = run_case(case, tmp_path)
    except Skipped as skip:
        pytest.skip(str(skip))
    print("\n".join(notes))


def test_the_sample_is_drawn_from_every_library_and_both_oracles_over_the_zoo():
    cases = case_names(LIBRARIES_HERE)
    libraries = {c.split("/")[0] for c in cases}
    assert libraries == set(LIBRARIES_HERE)
    assert {c.split("/")[1] for c in cases} == {"deferred", "load"}
    assert len({c.split("/")[2] for c in cases if c.startswith("hf/")}) > 400  # every class of the auto mappings
