"""Every next step an error offers is a promise: each hint the CLI prints is triggered here, followed as
printed, and the command then succeeds (or fails with another, more specific error).

A hint is what an error line offers in ``(CLI: ...)``, ``try --...`` or ``run 'materialize inspect'``;
:func:`hints_in` reads them off the line, and each case checks that its line offers the hint it
expects and that following it works. ``test_every_hint_the_code_can_print_has_a_case`` keeps the list
of cases in step with the hints written in the code.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import materialize as mz
from conftest import DECODER_SPEC
import preforked

ROOT = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).parent / "materialize")
TINY = DECODER_SPEC
TINY_ARGS = {"vocab_size": 16, "hidden_size": 8, "num_layers": 1, "num_heads": 2, "intermediate_size": 8}


def model_flags(**overrides: int) -> list[str]:
    return ["--model", TINY, *[f"--model-arg={k}={v}" for k, v in {**TINY_ARGS, **overrides}.items()]]


def tiny_state(**overrides: int) -> dict[str, torch.Tensor]:
    from bench.models.transformer import DecoderLM

    torch.manual_seed(0)
    return {k: v.contiguous() for k, v in DecoderLM(**{**TINY_ARGS, **overrides}).state_dict().items()}


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return preforked.run([CLI, *args], capture_output=True, text=True, timeout=300, env=env)


def hints_in(line: str) -> list[str]:
    """The commands an error line offers: ``(CLI: --x y)``, ``try --x y``, ``run 'materialize inspect'``."""
    found = re.findall(r"CLI: (--[^)]*)\)", line)
    found += re.findall(r"try (--[\w-]+(?: [\w:-]+)?)", line)
    found += ["inspect"] if "run 'materialize inspect'" in line else []
    return found


@dataclass
class Case:
    hint: str  # a regular expression the offered hint matches
    setup: Callable[[Path], list[str]]  # writes the files, returns the failing command's arguments
    then_loads: bool = True  # else: the command then fails on what is left, with another error


def _shape_mismatch(tmp: Path) -> list[str]:  # resnet18's head into resnet50's, in small
    save_file(tiny_state(vocab_size=16), str(tmp / "m.safetensors"))
    return [str(tmp / "m.safetensors"), *model_flags(vocab_size=20)]


def _missing_and_stray(tmp: Path) -> list[str]:
    state = tiny_state()
    state.pop("lm_head.weight")
    state["extra.scale"] = torch.ones(3)
    save_file(state, str(tmp / "m.safetensors"))
    return [str(tmp / "m.safetensors"), *model_flags()]


def _stray_only(tmp: Path) -> list[str]:  # the whole model's file into a model of part of it
    save_file({**tiny_state(), "extra.scale": torch.ones(3)}, str(tmp / "m.safetensors"))
    return [str(tmp / "m.safetensors"), *model_flags()]


def _prefixed(tmp: Path) -> list[str]:  # a wrapper's save, with a step counter beside (no prefix on every name)
    state = {f"backbone.{k}": v for k, v in tiny_state().items()}
    save_file({**state, "step": torch.tensor(3)}, str(tmp / "m.safetensors"))
    return [str(tmp / "m.safetensors"), *model_flags()]


def _prefix_missing(tmp: Path) -> list[str]:  # the base model's save: no "model." prefix, no head
    base = {k.removeprefix("model."): v for k, v in tiny_state().items() if k.startswith("model.")}
    save_file(base, str(tmp / "m.safetensors"))
    return [str(tmp / "m.safetensors"), *model_flags()]


def _renamed(tmp: Path) -> list[str]:
    save_file({k.replace("self_attn", "attention"): v for k, v in tiny_state().items()}, str(tmp / "m.safetensors"))
    return [str(tmp / "m.safetensors"), *model_flags()]


def _pickled_call(tmp: Path) -> list[str]:  # a call of a function (datetime.date), refused unless trusted
    import datetime

    torch.save({"w": torch.ones(2), "saved_on": datetime.date(2024, 1, 1)}, tmp / "m.pt")
    return [str(tmp / "m.pt")]


def _two_copies_of_the_model(tmp: Path) -> list[str]:  # a training save: an EMA beside the trained weights
    trained = tiny_state()
    torch.save({"epoch": 3, "state_dict": trained, "state_dict_ema": {k: v * 0.5 for k, v in trained.items()},
                "optimizer": {"state": {}, "param_groups": []}}, tmp / "last.pth.tar")
    return [str(tmp / "last.pth.tar"), *model_flags()]


def _overflowing_cast(tmp: Path) -> list[str]:
    save_file({"big": torch.tensor([1e9, 1.0])}, str(tmp / "m.safetensors"))
    return [str(tmp / "m.safetensors"), "--dtype", "fp16"]


def _larger_than_memory(tmp: Path) -> list[str]:
    from materialize.io.hostmem import ram_and_swap_bytes

    nbytes = (ram_and_swap_bytes() or 2**35) + 2**30
    header = json.dumps({"huge": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(tmp / "huge.safetensors", "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
    os.truncate(tmp / "huge.safetensors", 8 + len(header) + nbytes)  # a hole: nothing written
    return [str(tmp / "huge.safetensors")]


def _no_gpu(tmp: Path) -> list[str]:
    if torch.cuda.is_available():
        pytest.skip("the hint is for machines without a GPU")
    save_file({"w": torch.ones(2)}, str(tmp / "m.safetensors"))
    return [str(tmp / "m.safetensors"), "--device", "cuda"]


def _bad_values(tmp: Path) -> list[str]:  # its headers are sound: inspect shows what it holds
    save_file({"mask": torch.tensor([True, False])}, str(tmp / "m.safetensors"))
    data = bytearray((tmp / "m.safetensors").read_bytes())
    data[-1] = 7
    (tmp / "m.safetensors").write_bytes(bytes(data))
    return [str(tmp / "m.safetensors")]


def _device_map_without_model(tmp: Path) -> list[str]:
    save_file(tiny_state(), str(tmp / "m.safetensors"))
    return ["plan", str(tmp / "m.safetensors"), "--device-map", "sequential"]  # a plain dict has no modules to place


def _existing_destination(tmp: Path) -> list[str]:
    save_file({"w": torch.ones(2)}, str(tmp / "m.safetensors"))
    (tmp / "out.safetensors").write_bytes(b"old")
    return ["convert", str(tmp / "m.safetensors"), str(tmp / "out.safetensors")]


def _existing_destination_folder(tmp: Path) -> list[str]:  # the hint replaces what a conversion writes, keeps the rest
    save_file({"w": torch.ones(2)}, str(tmp / "m.safetensors"))
    (tmp / "out").mkdir()
    (tmp / "out" / "notes.txt").write_text("kept")
    return ["convert", str(tmp / "m.safetensors"), str(tmp / "out")]


def _class_that_does_not_fit(tmp: Path) -> list[str]:  # --model hf:LlamaForCausalLM on a Qwen2 folder
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp / "qwen2")
    return [str(tmp / "qwen2"), "--model", "hf:LlamaForCausalLM"]


# A model defined in a script, as a user's would be: its classifier sized by num_classes, its body by width.
CLASSIFIER_SCRIPT = """\
import torch
from torch import nn


def make(num_classes: int = 1000, width: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, num_classes))
"""


def classifier_script(tmp: Path) -> str:
    (tmp / "net.py").write_text(CLASSIFIER_SCRIPT)
    return f"{tmp / 'net.py'}:make"


def classifier_state(tmp: Path, **args: int) -> dict[str, torch.Tensor]:
    """The state of the script's model, built with ``args``: what training it so would have saved."""
    import runpy

    classifier_script(tmp)
    torch.manual_seed(1)
    make = runpy.run_path(str(tmp / "net.py"))["make"]
    return {k: v.contiguous() for k, v in make(**args).state_dict().items()}


def _classifier_for_other_classes(tmp: Path) -> list[str]:  # a 10-class fine-tune, the model built for 1000
    torch.save(classifier_state(tmp, num_classes=10), tmp / "finetuned.pth")
    return [str(tmp / "finetuned.pth"), "--model", classifier_script(tmp)]


def _nothing_loaded_under_a_prefix(tmp: Path) -> list[str]:  # --no-strict, every name under a wrapper's prefix
    return [*_prefixed(tmp), "--no-strict"]


MODEL_SCRIPT_BEYOND_MEMORY = """\
import torch
from torch import nn


class Table(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dtype=torch.uint8, device="meta"), requires_grad=False)


class Net(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.table = Table(rows)
"""


def _model_larger_than_memory(tmp: Path) -> list[str]:
    """A model whose table is larger than RAM and swap, and its checkpoint: the table a hole in the file."""
    from materialize.io.hostmem import ram_and_swap_bytes

    rows = (ram_and_swap_bytes() or 2**35) + 2**30
    stem = {"stem.weight": torch.randn(4, 4), "stem.bias": torch.randn(4)}
    header = json.dumps({"stem.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]},
                         "stem.bias": {"dtype": "F32", "shape": [4], "data_offsets": [64, 80]},
                         "table.weight": {"dtype": "U8", "shape": [rows], "data_offsets": [80, 80 + rows]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(tmp / "huge.safetensors", "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        handle.write(stem["stem.weight"].numpy().tobytes() + stem["stem.bias"].numpy().tobytes())
    os.truncate(tmp / "huge.safetensors", 8 + len(header) + 80 + rows)  # a hole: nothing written
    (tmp / "huge.py").write_text(MODEL_SCRIPT_BEYOND_MEMORY)
    return [str(tmp / "huge.safetensors"), "--model", f"{tmp / 'huge.py'}:Net", "--model-arg", f"rows={rows}"]


CASES = {
    "shape mismatch": Case(r"^--ignore-mismatched-sizes$", _shape_mismatch),
    "missing and unexpected": Case(r"^--no-strict$", _missing_and_stray),
    "unexpected only": Case(r"^--ignore-unexpected$", _stray_only),
    "a prefix the checkpoint adds": Case(r"^--strip-prefix backbone\.$", _prefixed, then_loads=False),
    "a prefix the checkpoint lacks": Case(r"^--add-prefix model\.$", _prefix_missing, then_loads=False),
    "renamed segments": Case(r"^--rename ", _renamed),
    "a call of a class": Case(r"^--trust-pickle$", _pickled_call),
    "two copies of the model": Case(r"^--state-dict-key state_dict_ema$", _two_copies_of_the_model),
    "an overflowing cast": Case(r"^--allow-overflow$", _overflowing_cast),
    "larger than memory": Case(r"^--mmap$", _larger_than_memory),
    "a model larger than memory": Case(r"^--device-map auto --max-memory cpu=[\d.]+[GMK]iB$", _model_larger_than_memory),
    "a classifier for other classes": Case(r"^--model-arg num_classes=10$", _classifier_for_other_classes),
    "nothing loaded, every name under a prefix": Case(r"^--strip-prefix backbone\.$", _nothing_loaded_under_a_prefix),
    "no GPU": Case(r"^--device cpu$", _no_gpu),
    "values refused, headers sound": Case(r"^inspect$", _bad_values),
    "a device map without a model": Case(r"^--model SPEC$", _device_map_without_model),
    "an existing destination": Case(r"^--overwrite$", _existing_destination),
    "an existing destination folder": Case(r"^--overwrite$", _existing_destination_folder),
    "a model class that does not fit the folder": Case(r"^--model hf:Qwen2ForCausalLM$", _class_that_does_not_fit),
}


def _followed(args: list[str], hint: str) -> list[str]:
    if hint == "inspect":
        return ["inspect", next(a for a in args if Path(a).exists())]
    if hint == "--model SPEC":
        return [*args, *model_flags()]
    flag, *value = shlex.split(hint)
    if flag in args and value:  # a value offered for an option already given replaces it
        at = args.index(flag)
        return [*args[:at], flag, *value, *args[at + 2:]]
    return [*args, *shlex.split(hint)]


@pytest.mark.parametrize("name", list(CASES))
def test_a_hint_followed_as_printed_gets_past_the_error(tmp_path, name):
    case = CASES[name]
    args = case.setup(tmp_path)

    failed = run(*args)
    assert failed.returncode in (1, 2), failed.stdout + failed.stderr  # 2: a usage error
    line = failed.stderr.strip().splitlines()[-1]
    offered = [hint for hint in hints_in(line) if re.search(case.hint, hint)]
    assert offered, f"no hint matching {case.hint!r} in: {line}"

    followed = run(*_followed(args, offered[0]))

    if case.then_loads:
        assert followed.returncode == 0, f"following {offered[0]!r} led to: {followed.stderr}"
    else:  # past this error, to a more specific one that does not offer the same step again
        next_line = followed.stderr.strip().splitlines()[-1]
        assert followed.returncode == 1 and next_line != line and offered[0] not in hints_in(next_line), next_line


def test_no_strict_is_not_offered_where_it_would_not_get_past_the_error(tmp_path):
    args = _shape_mismatch(tmp_path)

    line = run(*args).stderr.strip().splitlines()[-1]

    assert "--ignore-mismatched-sizes" in line and "--no-strict" not in line


def test_inspect_is_not_offered_for_a_file_it_cannot_open_either(tmp_path):
    save_file({"a": torch.ones(1000)}, str(tmp_path / "m.safetensors"))
    os.truncate(tmp_path / "m.safetensors", (tmp_path / "m.safetensors").stat().st_size - 100)

    failed = run(str(tmp_path / "m.safetensors"))
    inspected = run("inspect", str(tmp_path / "m.safetensors"))

    assert failed.returncode == inspected.returncode == 1
    assert "materialize inspect" not in failed.stderr


def test_every_hint_the_code_can_print_has_a_case():
    written = set()
    for path in [*(ROOT / "materialize").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]:
        text = path.read_text()
        written.update(re.findall(r"\(CLI: (--[\w-]+)", text))
        written.update(re.findall(r"try (--[\w-]+)", text))
    covered = {"--ignore-mismatched-sizes", "--no-strict", "--ignore-unexpected", "--strip-prefix", "--add-prefix",
               "--trust-pickle", "--state-dict-key",
               "--allow-overflow", "--mmap", "--device", "--model", "--overwrite", "--model-arg",
               "--rename",  # written as (CLI: {cli}), built from --rename flags
               "--allow-expansion",  # tests/test_convert.py follows it (it writes 19 MB)
               "--device-map"}  # with --max-memory: "a model larger than memory"; on GPUs: tests/test_device_map.py
    assert written <= covered, f"hints without a case that follows them: {sorted(written - covered)}"


# What the shapes and names of a mismatch say, and loads that would give a model that is not the checkpoint's.

ARCHITECTURE_QUESTION = "(is --model the architecture this checkpoint was saved from?)"


def vision_env(tmp: Path):
    """timm, and the environment a CLI subprocess imports it in (tests/vision.py)."""
    from vision import import_torchvision, pythonpath_with_shim

    if import_torchvision() is None:
        pytest.skip("timm and torchvision are not installed (make test-oldest's venvs)")
    return pytest.importorskip("timm"), pythonpath_with_shim(tmp)


def last_line(done: subprocess.CompletedProcess) -> str:
    return done.stderr.strip().splitlines()[-1]


def test_a_timm_model_fine_tuned_for_10_classes_loads_whole_with_the_model_argument_the_cli_offers(tmp_path):
    timm, env = vision_env(tmp_path)
    torch.manual_seed(0)
    state = {k: v.contiguous() for k, v in timm.create_model("resnet18", pretrained=False, num_classes=10).state_dict().items()}
    save_file(state, str(tmp_path / "finetuned.safetensors"))
    args = [str(tmp_path / "finetuned.safetensors"), "--model", "timm:resnet18"]

    refused = run(*args, env=env)
    followed = run(*args, "--model-arg", "num_classes=10", "--json", env=env)

    line = last_line(refused)
    assert refused.returncode == 1 and "--model-arg num_classes=10" in hints_in(line)
    assert "the checkpoint's classifier (fc) has 10 outputs where the model's has 1000" in line
    assert line.index("--model-arg num_classes=10") < line.index("--ignore-mismatched-sizes")  # a new head: second
    assert "another architecture" not in line and ARCHITECTURE_QUESTION not in line
    assert followed.returncode == 0, followed.stderr
    report = json.loads(followed.stdout)
    assert sorted(report["loaded"]) == sorted(state) and report["initialized"] == report["not_from_checkpoint"] == []
    model, _ = mz.load_model(tmp_path / "finetuned.safetensors", model="timm:resnet18", model_args={"num_classes": 10})
    assert all(torch.equal(model.state_dict()[name], value) for name, value in state.items())


def test_a_smaller_resnet_into_a_larger_one_is_another_architecture_not_a_new_head(tmp_path):
    timm, env = vision_env(tmp_path)
    torch.save(timm.create_model("resnet18", pretrained=False).state_dict(), tmp_path / "resnet18.pth")

    deeper = run(str(tmp_path / "resnet18.pth"), "--model", "timm:resnet34", env=env)  # more blocks, same shapes
    with pytest.raises(mz.KeyMismatchError) as wider:  # bottleneck blocks: other shapes
        mz.load(mz.build("timm:resnet50"), tmp_path / "resnet18.pth")

    line = last_line(deeper)
    assert deeper.returncode == 1 and line.endswith(ARCHITECTURE_QUESTION)
    assert "the model has 80 tensors in its body that the checkpoint lacks, e.g. 'layer1.2.conv1.weight': it may " \
        "have been saved from another architecture, or another size of it" in line
    message = str(wider.value)
    assert wider.value.architecture_differs and "new head" not in message and "num_classes" not in message
    assert "the checkpoint was saved from another architecture, or another size of it: 23 tensors in the body " \
        "differ, e.g. 'layer1.0.conv1.weight'" in message


def test_a_torchvision_model_for_other_classes_is_told_num_classes_too(tmp_path):
    vision_env(tmp_path)
    models = pytest.importorskip("torchvision.models")
    torch.manual_seed(0)
    state = models.get_model("resnet18", weights=None, num_classes=10).state_dict()
    torch.save(state, tmp_path / "finetuned.pth")

    with pytest.raises(mz.ShapeMismatchError) as refused:
        mz.load_model(tmp_path / "finetuned.pth", model="torchvision:resnet18")
    model, report = mz.load_model(tmp_path / "finetuned.pth", model="torchvision:resnet18", model_args={"num_classes": 10})

    assert "the checkpoint's classifier (fc) has 10 outputs where the model's has 1000: build the model with " \
        "num_classes=10: model_args={'num_classes': 10}, or mz.build('torchvision:resnet18', num_classes=10) " \
        "(CLI: --model-arg num_classes=10)" in str(refused.value)
    assert sorted(report.loaded) == sorted(state)
    assert all(torch.equal(model.state_dict()[name], value) for name, value in state.items())


def test_a_factorys_own_argument_is_named_and_following_it_gives_the_files_values(tmp_path):
    state = classifier_state(tmp_path, num_classes=10)
    torch.save(state, tmp_path / "finetuned.pth")
    spec = classifier_script(tmp_path)

    with pytest.raises(mz.ShapeMismatchError) as refused:
        mz.load_model(tmp_path / "finetuned.pth", model=spec)
    model, report = mz.load_model(tmp_path / "finetuned.pth", model=spec, model_args={"num_classes": 10})

    assert f"build the model with num_classes=10: model_args={{'num_classes': 10}}, or mz.build({spec!r}, " \
        "num_classes=10) (CLI: --model-arg num_classes=10); or pass ignore_mismatched_sizes=True" in str(refused.value)
    assert not refused.value.architecture_differs
    assert sorted(report.loaded) == sorted(state) and report.initialized == []
    assert all(torch.equal(model.state_dict()[name], value) for name, value in state.items())


class Classifier(nn.Module):
    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, num_classes)


def test_a_model_built_by_hand_is_told_its_constructors_argument(tmp_path):
    torch.manual_seed(0)
    state = Classifier(num_classes=10).state_dict()
    save_file(state, str(tmp_path / "finetuned.safetensors"))
    with mz.meta_init():
        built_for_1000, built_for_10 = Classifier(), Classifier(num_classes=10)

    with pytest.raises(mz.ShapeMismatchError, match=re.escape(
            "the checkpoint's classifier (head) has 10 outputs where the model's has 1000: build the model as "
            "Classifier(..., num_classes=10); or pass ignore_mismatched_sizes=True")):
        mz.load(built_for_1000, tmp_path / "finetuned.safetensors")
    report = mz.load(built_for_10, tmp_path / "finetuned.safetensors")

    assert sorted(report.loaded) == sorted(state)


def test_a_load_that_would_read_nothing_is_an_error_naming_the_nearest_names(tmp_path):
    with mz.meta_init():
        model = nn.ModuleDict({"encoder": nn.ModuleDict({"layer1": nn.Linear(4, 4)}), "head": nn.Linear(4, 2)})
    # An exporter's names: the model's, their dots made underscores.
    flattened = {"encoder_layer1_weight": torch.ones(4, 4), "encoder_layer1_bias": torch.ones(4),
                 "head_weight": torch.ones(2, 4), "head_bias": torch.ones(2)}
    save_file(flattened, str(tmp_path / "flat.safetensors"))

    with pytest.raises(mz.NothingLoadedError) as loaded_nothing:
        mz.load(model, tmp_path / "flat.safetensors", strict=False)
    with pytest.raises(mz.NothingLoadedError):
        mz.plan(model, tmp_path / "flat.safetensors", strict=False)
    with pytest.raises(mz.KeyMismatchError) as strict:
        mz.load(model, tmp_path / "flat.safetensors")

    nearest = ("the nearest names: model 'encoder.layer1.weight' ~ checkpoint 'encoder_layer1_weight', "
               "model 'head.weight' ~ checkpoint 'head_weight'")
    assert str(loaded_nothing.value).startswith(
        f"{tmp_path / 'flat.safetensors'}: nothing would be loaded: none of the model's 4 tensors is in the checkpoint "
        f"under its name; {nearest}; a load that reads nothing")
    assert nearest in str(strict.value) and "strict=False (CLI" not in str(strict.value)  # it would read nothing
    assert all(p.is_meta for p in model.parameters())


def test_shapes_that_all_differ_are_another_architecture_and_no_flag_that_would_load_nothing_is_offered(tmp_path):
    torch.save(classifier_state(tmp_path, width=16, num_classes=10), tmp_path / "wider.pth")
    args = [str(tmp_path / "wider.pth"), "--model", classifier_script(tmp_path)]

    refused = run(*args)
    forced = run(*args, "--ignore-mismatched-sizes")

    assert refused.returncode == 1 and hints_in(last_line(refused)) == []
    assert last_line(refused).endswith(ARCHITECTURE_QUESTION)
    assert forced.returncode == 1 and forced.stdout == ""
    assert "nothing would be loaded: each of the model's 6 tensors the checkpoint holds has another shape there, e.g. " \
        "0.weight (model [8, 4], checkpoint [16, 4])" in last_line(forced)
    assert last_line(forced).endswith(ARCHITECTURE_QUESTION)


def test_a_load_mostly_initialized_warns_and_its_report_says_so(tmp_path):
    spec = classifier_script(tmp_path)
    first_layer = {name: value for name, value in classifier_state(tmp_path).items() if name.startswith("0.")}
    save_file(first_layer, str(tmp_path / "first.safetensors"))

    with pytest.warns(mz.MostlyInitializedWarning, match=re.escape(
            "4 of the model's tensors get no value from the checkpoint (4 missing from it), more than the 2 loaded "
            "from it, e.g. 2.weight, 2.bias, 4.weight (and 1 more): the model is mostly initialized")):
        _, report = mz.load_model(tmp_path / "first.safetensors", model=spec, strict=False)
    done = run(str(tmp_path / "first.safetensors"), "--model", spec, "--no-strict")

    assert report.mostly_not_loaded and sorted(report.not_from_checkpoint) == ["2.bias", "2.weight", "4.bias", "4.weight"]
    assert report.to_dict()["mostly_not_loaded"] is True and report.to_dict()["not_from_checkpoint"] == report.not_from_checkpoint
    assert re.search(r"^not from the checkpoint +4: more than loaded, the model is mostly initialized$", str(report), re.M)
    assert done.returncode == 0, done.stderr
    warned = [line for line in done.stderr.splitlines() if line.startswith("Warning: ")]
    assert len(warned) == 1 and "the model is mostly initialized" in warned[0]


def test_a_new_head_a_partial_checkpoint_and_a_pipeline_stage_load_quietly(tmp_path):
    import runpy
    import warnings

    spec = classifier_script(tmp_path)
    state = classifier_state(tmp_path)
    torch.save(state, tmp_path / "pretrained.pth")
    save_file({k: v for k, v in state.items() if not k.startswith("4.")}, str(tmp_path / "headless.safetensors"))
    make = runpy.run_path(str(tmp_path / "net.py"))["make"]

    with warnings.catch_warnings():
        warnings.simplefilter("error", mz.MaterializeWarning)
        _, new_head = mz.load_model(tmp_path / "pretrained.pth", model=spec, model_args={"num_classes": 10},
                                    ignore_mismatched_sizes=True)
        partial = mz.load(mz.deferred_init(make), tmp_path / "headless.safetensors", strict=False)
        with mz.meta_init():
            stage = nn.Sequential(nn.Linear(4, 8))  # the first of the model's layers
        staged = mz.load(stage, tmp_path / "pretrained.pth", ignore_unexpected=True)

    assert new_head.reinitialized == ["4.weight", "4.bias"] and len(new_head.loaded) == 4
    assert partial.not_from_checkpoint == ["4.weight", "4.bias"] and not partial.mostly_not_loaded
    assert staged.not_from_checkpoint == [] and len(staged.ignored) == 4


def test_the_refusal_beyond_host_memory_offers_a_budget_that_then_loads(tmp_path, monkeypatch):
    from materialize.io import hostmem

    torch.manual_seed(0)
    state = {f"{index}.weight": torch.randn(64, 64) for index in range(4)}  # 16 KiB each
    save_file(state, str(tmp_path / "m.safetensors"))
    monkeypatch.setattr(hostmem, "ram_and_swap_bytes", lambda: 48 * 2**10)  # this process "can never have" 64 KiB
    with mz.meta_init():
        model = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(4)))

    with pytest.raises(mz.AllocationError) as refused:
        mz.load(model, tmp_path / "m.safetensors")
    message = str(refused.value)
    budget = re.search(r"device_map='auto', max_memory=\{'cpu': '(\d+KiB)'\} "
                       r"\(CLI: --device-map auto --max-memory cpu=\1\)", message)
    assert budget, message
    assert ("cuda" in message) == torch.cuda.is_available()  # a GPU is offered only where there is one
    report = mz.load(model, tmp_path / "m.safetensors", device_map="auto", max_memory={"cpu": budget.group(1)})

    assert report.bytes_by_device.get("disk", 0) > 0 and sorted(report.loaded) == sorted(state)
    assert all(torch.equal(model.state_dict()[name], value) for name, value in state.items())


def test_the_cli_refusal_beyond_host_memory_offers_no_gpu_where_there_is_none(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a machine without a GPU")
    refused = run(*_model_larger_than_memory(tmp_path))

    line = last_line(refused)
    assert refused.returncode == 1 and "cuda" not in line and "--device" not in hints_in(line)
    assert re.search(r"\(CLI: --device-map auto --max-memory cpu=[\d.]+GiB\)", line)


def test_on_a_machine_with_gpus_the_refusal_offers_them_with_their_budgets(monkeypatch):
    from materialize.io import hostmem

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (40 * 2**30, 80 * 2**30))

    ways = hostmem.ways_out_of_host_memory(placeable=True)

    assert "device_map='auto', max_memory={0: '36.0GiB', 1: '36.0GiB', 'cpu': '" in ways
    assert "(CLI: --device-map auto --max-memory 0=36.0GiB,1=36.0GiB,cpu=" in ways
    assert ways.endswith("; or put the tensors on a GPU: device='cuda' (CLI: --device cuda)")
    assert "device_map" not in hostmem.ways_out_of_host_memory(placeable=False)  # no model to place
