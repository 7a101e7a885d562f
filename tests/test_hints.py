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

from conftest import DECODER_SPEC

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


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=300)


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
               "--allow-overflow", "--mmap", "--device", "--model", "--overwrite",
               "--rename",  # written as (CLI: {cli}), built from --rename flags
               "--allow-expansion",  # tests/test_convert.py follows it (it writes 19 MB)
               "--device-map"}  # needs GPUs to follow: tests/test_device_map.py, on a GPU host
    assert written <= covered, f"hints without a case that follows them: {sorted(written - covered)}"
