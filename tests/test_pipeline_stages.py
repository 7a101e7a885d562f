"""Pipeline stages (``torch.distributed.pipelining``): each stage loads its part of the whole model's checkpoint.

A stage holds part of the model, so the checkpoint's other tensors are
unexpected to it; ``ignore_unexpected=True`` (CLI ``--ignore-unexpected``)
leaves them unread while a strict load still requires every tensor of the
stage. The oracle is torch's: the stage built eagerly, then
``load_state_dict(strict=False)`` of the same file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import materialize as mz

from conftest import run_ranks
from pipeline_worker import LAYERS, Decoder, layers_of, split
from test_cli import assert_one_error_line, run_cli
from test_differential import BUILD_SEED, build_way, compare_models, read, seeded, trained_state, write

PIPELINE_WORKER = Path(__file__).with_name("pipeline_worker.py")
STAGE_SPEC = f"{PIPELINE_WORKER}:make_stage"


def whole_file(folder: Path, fmt: str = "safetensors", drop: tuple = ()) -> Path:
    """The whole model's checkpoint, values moved from a fresh build's."""
    state = {name: value for name, value in trained_state(Decoder).items() if name not in drop}
    return write(state, folder / f"whole.{fmt}", fmt)


def stage_builder(stage: int, stages: int):
    return lambda: split(Decoder(), stage, stages)


def ignored_line(table: str) -> str:
    """The report's row counting what was left unread, its spacing made single."""
    return next(" ".join(line.split()) for line in table.splitlines() if line.startswith("ignored"))


def stage_names(stage: int, stages: int) -> set[str]:
    return set(split(Decoder(), stage, stages).state_dict())


def torch_stage(stage: int, stages: int, path: Path, fmt: str):
    """The oracle: the stage built eagerly, then load_state_dict(strict=False) of the whole file."""
    model = seeded(stage_builder(stage, stages), BUILD_SEED)
    result = model.load_state_dict(read(path, fmt), strict=False)
    return model, result


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
@pytest.mark.parametrize("way", ["meta_init", "meta_device", "cpu", "deferred"])
def test_each_stage_loads_its_tensors_from_the_whole_models_file_as_torch_does(tmp_path, fmt, way):
    path = whole_file(tmp_path, fmt)
    stages = 4  # the first (embeddings), two in the middle (layers only), the last (norm and head)
    for stage in range(stages):
        got = build_way(stage_builder(stage, stages), way)
        report = mz.load(got, path, ignore_unexpected=True)

        ref, torch_says = torch_stage(stage, stages, path, fmt)
        assert compare_models(got, ref) == [], stage
        assert torch_says.missing_keys == [] and report.missing == []
        assert report.unexpected == []
        # Left unread: what torch calls unexpected, and what lies in modules set to None (which torch drops unsaid).
        assert sorted(report.ignored) == sorted(set(read(path, fmt)) - stage_names(stage, stages))
        assert set(torch_says.unexpected_keys) <= set(report.ignored)
        assert sorted(report.loaded) == sorted(stage_names(stage, stages))
        assert report.bytes_read == sum(t.numel() * t.element_size() for t in ref.state_dict().values())
        assert ignored_line(str(report)) == f"ignored (left unread) {len(report.ignored)}"


def test_a_stage_whose_tensor_the_file_lacks_is_refused_naming_it_and_left_as_it_was(tmp_path):
    path = whole_file(tmp_path, drop=("layers.2.up.bias",))
    with torch.device("meta"):
        holder = split(Decoder(), 1, 2)  # layers 2 and 3
        other = split(Decoder(), 0, 2)  # layers 0 and 1

    with pytest.raises(mz.KeyMismatchError, match=r"1 missing from the checkpoint: layers\.2\.up\.bias") as raised:
        mz.load(holder, path, ignore_unexpected=True)

    assert raised.value.missing == ["layers.2.up.bias"] and raised.value.unexpected == []
    assert "unexpected" not in str(raised.value).split("; pass")[0]
    assert all(tensor.is_meta for tensor in holder.parameters())
    assert mz.load(other, path, ignore_unexpected=True).missing == []  # the stage that does not hold it loads


def test_a_strict_load_of_a_stage_offers_ignore_unexpected_and_following_it_loads_the_stage(tmp_path):
    path = whole_file(tmp_path)
    with mz.meta_init():
        got = split(Decoder(), 1, 2)

    with pytest.raises(mz.KeyMismatchError, match=r"unexpected in the checkpoint") as raised:
        mz.load(got, path)
    assert "pass ignore_unexpected=True (CLI: --ignore-unexpected)" in str(raised.value)

    mz.load(got, path, ignore_unexpected=True)

    assert compare_models(got, torch_stage(1, 2, path, "safetensors")[0]) == []


def test_patterns_ignore_the_names_they_find_and_no_others(tmp_path):
    path = whole_file(tmp_path)
    later = [rf"^layers\.{i}\." for i in layers_of(1, 2)]
    with mz.meta_init():
        first = split(Decoder(), 0, 2)  # its norm and output are None: their tensors are left unread, as torch does

    with pytest.raises(mz.KeyMismatchError) as raised:
        mz.load(first, path, ignore_unexpected=later[:1])
    assert raised.value.unexpected and all(name.startswith("layers.3.") for name in raised.value.unexpected)

    report = mz.load(first, path, ignore_unexpected=later)

    assert report.unexpected == [] and sorted(report.ignored) == sorted(set(read(path, "safetensors")) - stage_names(0, 2))
    assert compare_models(first, torch_stage(0, 2, path, "safetensors")[0]) == []


def test_a_plan_lists_what_a_stage_leaves_unread(tmp_path):
    path = whole_file(tmp_path)
    with mz.meta_init():
        last = split(Decoder(), 1, 2)

    plan = mz.plan(last, path, ignore_unexpected=True)

    expected = sorted(set(read(path, "safetensors")) - stage_names(1, 2))
    assert sorted(plan.ignored) == expected == sorted(plan.to_dict()["ignored"])
    assert plan.unexpected == [] and plan.missing == []
    assert plan.load_nbytes == sum(t.numel() * t.element_size() for name, t in read(path, "safetensors").items()
                                   if name in stage_names(1, 2))


def test_ignore_unexpected_refuses_what_is_no_regular_expression():
    with mz.meta_init():
        model = split(Decoder(), 0, 2)
    with pytest.raises(ValueError, match=r"ignore_unexpected: '\(' is not a regular expression"):
        mz.load(model, "unused.safetensors", ignore_unexpected=["("])


def test_the_cli_loads_a_stage_with_ignore_unexpected_and_its_error_offers_it(tmp_path):
    path = whole_file(tmp_path)
    stage = ["--model", STAGE_SPEC, "--model-arg", "stage=1", "--model-arg", "stages=2"]

    line = assert_one_error_line(run_cli(path, *stage), must_name="layers.0.up.weight")
    assert "CLI: --ignore-unexpected" in line and str(path) in line

    loaded = run_cli(path, *stage, "--ignore-unexpected", "--json")
    assert loaded.returncode == 0, loaded.stderr
    report = json.loads(loaded.stdout)
    expected = sorted(set(read(path, "safetensors")) - stage_names(1, 2))
    assert sorted(report["ignored"]) == expected and report["unexpected"] == [] and report["missing"] == []
    assert sorted(report["loaded"]) == sorted(stage_names(1, 2))

    patterns = [option for i in layers_of(0, 2) for option in ("--ignore-unexpected-matching", rf"^layers\.{i}\.")]
    by_pattern = run_cli(path, *stage, *patterns, "--ignore-unexpected-matching", r"^tok_embeddings\.")
    assert by_pattern.returncode == 0, by_pattern.stderr
    assert ignored_line(by_pattern.stdout) == f"ignored (left unread) {len(expected)}"

    planned = run_cli("plan", path, *stage, "--ignore-unexpected", "--json")
    assert planned.returncode == 0, planned.stderr
    assert sorted(json.loads(planned.stdout)["ignored"]) == expected

    bad = run_cli(path, *stage, "--ignore-unexpected-matching", "(")
    assert bad.returncode == 2 and "not a valid regular expression" in bad.stderr


def test_load_model_with_the_clis_options_gives_the_stage_torch_gives(tmp_path):
    path = whole_file(tmp_path)
    torch.manual_seed(BUILD_SEED)

    model, report = mz.load_model(path, model=STAGE_SPEC, model_args={"stage": 1, "stages": 2},
                                  ignore_unexpected=True)

    assert report.unexpected == [] and report.missing == []
    assert compare_models(model, torch_stage(1, 2, path, "safetensors")[0]) == []


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed")
def test_stages_loaded_on_meta_run_a_gpipe_schedule_on_gloo_ranks_as_the_whole_model(tmp_path):
    path = whole_file(tmp_path)
    world = 2

    ranks = run_ranks("gpipe", path, tmp_path / "ranks", world=world, worker=PIPELINE_WORKER)

    everything = set(read(path, "safetensors"))
    for rank, found in enumerate(ranks):
        own = stage_names(rank, world)
        assert found["loaded"] == sorted(own) and found["ignored"] == sorted(everything - own)
        assert found["unexpected"] == [] and found["equal"] and all(found["equal"].values())
    assert ranks[-1]["output_equal"]
    assert LAYERS == sum(len(layers_of(rank, world)) for rank in range(world))
