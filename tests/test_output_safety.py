"""Nothing ``materialize`` prints can drive a terminal or break a strict parser: hostile names in real files,
the CLI run as a real subprocess."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
import preforked

# Each sequence a name can carry to act on a terminal or on the output's lines, with how it must show.
HOSTILE = {
    "osc52\x1b]52;c;aGVsbG8=\x07": "osc52\\x1b]52;c;aGVsbG8=\\x07",  # writes the clipboard
    "title\x1b]0;pwned\x07": "title\\x1b]0;pwned\\x07",  # sets the window title
    "clear\x1b[2J": "clear\\x1b[2J",
    "over\rwritten": "over\\rwritten",
    "forged\nrow  float32  1  4 B": "forged\\nrow  float32  1  4 B",
    "bidi\u202eevil": "bidi\\u202eevil",
    "c1\x9bcsi": "c1\\x9bcsi",
    "del\x7f": "del\\x7f",
    "tab\tname": "tab\\tname",
    "é中.weight": "é中.weight",  # letters of any script stay as they are
}


def materialize_command() -> str:
    found = shutil.which("materialize")
    return found if found is not None else str(Path(sys.executable).parent / "materialize")


def run_cli(*args: object, env: dict | None = None, **keywords) -> subprocess.CompletedProcess:
    """The command's output as bytes: what reaches the terminal, before any decoding."""
    return preforked.run([materialize_command(), *map(str, args)], capture_output=True, timeout=300,
                          env={**os.environ, **(env or {})}, **keywords)


def shown(stream: bytes) -> str:
    """``stream`` decoded, after checking it is UTF-8 with no character but the line end that is not printable
    (a control byte, C1, a bidi override, a surrogate)."""
    text = stream.decode("utf-8")  # strict: a lone surrogate written raw would fail here
    bad = sorted({char for char in text if char != "\n" and not char.isprintable()})
    assert not bad, f"non-printable characters written: {bad!r} in {text[:2000]!r}"
    return text


def assert_clean(result: subprocess.CompletedProcess) -> tuple[str, str]:
    out, err = shown(result.stdout), shown(result.stderr)
    assert "Traceback" not in err
    return out, err


def one_error_line(result: subprocess.CompletedProcess) -> str:
    out, err = assert_clean(result)
    assert result.returncode == 1, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    return lines[0]


def strict_json(text: str):
    def refuse(constant: str):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def write_safetensors_header(path: Path, header_json: str, data: bytes) -> Path:
    """A safetensors file from its header's JSON text as given (escapes such as ``\\ud800`` kept as written)."""
    raw = header_json.encode("ascii")
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def hostile_tensors() -> dict[str, torch.Tensor]:
    return {name: torch.full((1,), float(i)) for i, name in enumerate(HOSTILE)}


# ---------------------------------------------------------------- text output


@pytest.mark.parametrize("kind", ["safetensors", "pt"])
def test_inspect_escapes_every_name_and_keeps_one_row_a_tensor(tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"hostile.{kind}"
    tensors = hostile_tensors()
    save_file(tensors, str(path)) if kind == "safetensors" else torch.save(tensors, path)

    result = run_cli("inspect", path)
    out, _ = assert_clean(result)
    assert result.returncode == 0
    rows = out.splitlines()[1:]
    assert len(rows) == len(tensors)
    for escaped in HOSTILE.values():
        assert sum(row.startswith(escaped + " ") for row in rows) == 1, escaped


def test_inspect_escapes_the_folder_shard_file_names_and_entry_it_shows(tmp_path: Path) -> None:
    """Beside tensor names, ``inspect`` shows the checkpoint's path (its first line), each shard's file name (a
    column of every row) and a training checkpoint's entry: each escaped, as the rows are printed as made."""
    folder = tmp_path / "run\x1b]0;pwned\x07\nforged"
    folder.mkdir()
    shards = {"a\x1b[2J-00001-of-00002.safetensors": {"first": torch.zeros(2)},
              "b\u202e-00002-of-00002.safetensors": {"second": torch.ones(3)}}
    for file_name, tensors in shards.items():
        save_file(tensors, str(folder / file_name))
    index = {"metadata": {}, "weight_map": {name: file_name for file_name, tensors in shards.items() for name in tensors}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))

    result = run_cli("inspect", folder)
    out, _ = assert_clean(result)
    assert result.returncode == 0, result.stderr
    first, *rows = out.splitlines()
    assert first.startswith(str(tmp_path / "run\\x1b]0;pwned\\x07\\nforged")), first
    assert len(rows) == 2
    assert rows[0].startswith("first ") and rows[0].endswith("a\\x1b[2J-00001-of-00002.safetensors"), rows[0]
    assert rows[1].startswith("second ") and rows[1].endswith("b\\u202e-00002-of-00002.safetensors"), rows[1]

    entry = "ema\x1b[2J\u202e"
    path = tmp_path / "training.pt"
    torch.save({entry: {"w": torch.zeros(2)}, "step": 3}, path)
    result = run_cli("inspect", path, "--state-dict-key", entry)
    out, _ = assert_clean(result)
    assert result.returncode == 0, result.stderr
    assert "state dict: entry 'ema\\x1b[2J\\u202e' of the saved dict" in out.splitlines(), out


def test_inspect_json_gives_the_names_exactly(tmp_path: Path) -> None:
    path = tmp_path / "hostile.safetensors"
    save_file(hostile_tensors(), str(path))
    result = run_cli("inspect", path, "--json")
    out, _ = assert_clean(result)
    assert result.returncode == 0
    assert sorted(t["name"] for t in strict_json(out)["tensors"]) == sorted(HOSTILE)


def test_load_report_and_error_line_escape_names(tmp_path: Path) -> None:
    """--check-finite lists the tensors holding NaN in the report and in the Error line."""
    path = tmp_path / "nan.safetensors"
    save_file({name: torch.tensor([float("nan")]) for name in HOSTILE}, str(path))
    result = run_cli(path, "--check-finite")
    out, err = assert_clean(result)
    assert result.returncode == 1
    assert "NaN/Inf in" in out and "\\x1b]" in out
    assert len(err.splitlines()) == 1 and err.startswith("Error: ") and "\\x1b]" in err


def write_model_script(tmp_path: Path) -> str:
    script = tmp_path / "tiny_model.py"
    script.write_text(textwrap.dedent("""
        import torch

        def create():
            return torch.nn.Linear(2, 2)
    """))
    return f"{script}:create"


def test_plan_text_and_mismatch_error_escape_names(tmp_path: Path) -> None:
    path = tmp_path / "extra.safetensors"
    save_file({"weight": torch.zeros(2, 2), "bias": torch.zeros(2), **hostile_tensors()}, str(path))
    spec = write_model_script(tmp_path)

    planned = run_cli("plan", path, "--model", spec, "--no-strict")
    out, _ = assert_clean(planned)
    assert planned.returncode == 0, planned.stderr
    unexpected = next(line for line in out.splitlines() if line.startswith("unexpected"))
    assert "osc52\\x1b]52;c;aGVsbG8=\\x07" in unexpected and "forged\\nrow" in unexpected

    refused = run_cli("plan", path, "--model", spec)
    assert "\\x1b" in one_error_line(refused)


def test_convert_report_and_warning_escape_file_and_entry_names(tmp_path: Path) -> None:
    source = tmp_path / "folder"
    source.mkdir()
    save_file({"w": torch.zeros(2)}, str(source / "model.safetensors"))
    (source / "tok\x1b]0;pwned\x07.json").write_text("{}")
    result = run_cli("convert", source, tmp_path / "out")
    out, _ = assert_clean(result)
    assert result.returncode == 0, result.stderr
    assert "tok\\x1b]0;pwned\\x07.json" in out

    extra = tmp_path / "extra.pt"
    torch.save({"w": torch.zeros(2), "m\x1b[2J._extra_state": {"a": 1}}, extra)
    warned = run_cli("convert", extra, tmp_path / "extra.safetensors")
    _, err = assert_clean(warned)
    assert warned.returncode == 0
    assert err.startswith("Warning: ") and "m\\x1b[2J._extra_state" in err and len(err.splitlines()) == 1


def test_other_libraries_warnings_are_escaped_too(tmp_path: Path) -> None:
    """A warning not of this library's (raised by the model's code here) keeps Python's form, escaped."""
    path = tmp_path / "linear.safetensors"
    save_file({"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}, str(path))
    script = tmp_path / "warning_model.py"
    script.write_text(textwrap.dedent("""
        import warnings
        import torch

        def create():
            warnings.warn("layer title\x1b]0;pwned\x07 is odd")
            return torch.nn.Linear(2, 2)
    """))
    result = run_cli(path, "--model", f"{script}:create")
    _, err = assert_clean(result)
    assert result.returncode == 0, err
    assert "UserWarning: layer title\\x1b]0;pwned\\x07 is odd" in err


def test_error_line_escapes_a_hostile_file_name(tmp_path: Path) -> None:
    path = tmp_path / "bad\x1b]0;pwned\x07\n.safetensors"
    path.write_bytes(b"not a checkpoint at all")
    assert "bad\\x1b]0;pwned\\x07\\n.safetensors" in one_error_line(run_cli("inspect", path))
    assert "\\x1b" in one_error_line(run_cli("inspect", tmp_path / "missing\x1b[2J.pt"))


def test_a_terminal_encoding_without_the_characters_does_not_fail(tmp_path: Path) -> None:
    path = tmp_path / "names.safetensors"
    save_file({"中文": torch.zeros(1), "é": torch.zeros(1)}, str(path))
    result = run_cli("inspect", path, env={"PYTHONIOENCODING": "latin-1"})
    assert result.returncode == 0, result.stderr
    assert b"Traceback" not in result.stderr
    assert "\\u4e2d\\u6587" in result.stdout.decode("latin-1")


# ---------------------------------------------------------------- a lone surrogate


def test_lone_surrogate_name_is_shown_escaped_and_as_strict_json(tmp_path: Path) -> None:
    path = write_safetensors_header(
        tmp_path / "surrogate.safetensors",
        '{"\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4)
    text = run_cli("inspect", path)
    out, _ = assert_clean(text)
    assert text.returncode == 0
    assert out.splitlines()[1].startswith("\\ud800 ")

    as_json = run_cli("inspect", path, "--json")
    out, _ = assert_clean(as_json)
    assert as_json.returncode == 0
    assert out.isascii()
    assert strict_json(out)["tensors"][0]["name"] == "\\ud800"  # the escape's text: a strict parser's only choice


# ---------------------------------------------------------------- size of the output


def measured(args: list[str], stdout: Path, limit: int) -> tuple[int, int]:
    """Run the CLI in a child limited to ``limit`` bytes of address space; its exit code and peak RSS in bytes
    (a fresh parent, so that the peak is this run's alone)."""
    probe = textwrap.dedent(f"""
        import resource, subprocess, sys
        def limited():
            resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
        with open({str(stdout)!r}, "wb") as out:
            code = subprocess.run({args!r}, stdout=out, stderr=subprocess.DEVNULL, preexec_fn=limited,
                                  timeout=120).returncode
        print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=200)
    code, peak = done.stdout.split()
    return int(code), int(peak)


@pytest.mark.parametrize("as_json", [False, True])
def test_one_long_name_does_not_pad_every_row(tmp_path: Path, as_json: bool) -> None:
    """A 4 MB name beside 4,000 empty tensors: padding every row to it would print 16 GB."""
    long_name = "n" * (4 << 20)
    names = [f"t{i}" for i in range(4000)]
    header = {name: {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for name in names}
    header[long_name] = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
    path = write_safetensors_header(tmp_path / "long.safetensors", json.dumps(header), b"\0" * 4)
    size = path.stat().st_size
    json_flag = ["--json"] if as_json else []

    tiny = write_safetensors_header(tmp_path / "tiny.safetensors",
                                    '{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4)
    limit = 2 << 30
    code, baseline = measured([materialize_command(), "inspect", str(tiny), *json_flag], tmp_path / "tiny.out", limit)
    assert code == 0
    code, peak = measured([materialize_command(), "inspect", str(path), *json_flag], tmp_path / "long.out", limit)
    assert code == 0
    printed = (tmp_path / "long.out").stat().st_size
    assert printed < 3 * size
    assert peak - baseline < 20 * size, (peak, baseline, size)
    print(f"file {size} B, printed {printed} B, peak RSS {peak} B ({peak - baseline} B over a 1-tensor file's)")
    if not as_json:
        rows = (tmp_path / "long.out").read_text().splitlines()[1:]
        assert len(rows) == 4001
        assert max(len(row) for row in rows if row.startswith("t")) < 200


# ---------------------------------------------------------------- strict JSON


def test_non_finite_index_metadata_is_strict_json(tmp_path: Path) -> None:
    folder = tmp_path / "sharded"
    folder.mkdir()
    save_file({"w": torch.zeros(2)}, str(folder / "model-00001-of-00001.safetensors"))
    metadata = {"total_size": 8, "nan": float("nan"), "big": float("inf"), "small": [float("-inf")],
                "fine": 0.5}
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": metadata, "weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    result = run_cli("inspect", folder, "--json")
    out, _ = assert_clean(result)
    assert result.returncode == 0, result.stderr
    assert strict_json(out)["metadata"] == {"total_size": 8, "nan": "NaN", "big": "Infinity",
                                            "small": ["-Infinity"], "fine": 0.5}
    assert '"NaN"' in run_cli("inspect", "--help").stdout.decode()


def test_deeply_nested_index_metadata_is_one_error_line_in_json(tmp_path: Path) -> None:
    folder = tmp_path / "deep"
    folder.mkdir()
    save_file({"w": torch.zeros(2)}, str(folder / "model-00001-of-00001.safetensors"))
    (folder / "model.safetensors.index.json").write_text(
        '{"metadata": {"m": ' + "[" * 900 + "]" * 900 + '}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}')
    assert "model.safetensors.index.json" in one_error_line(run_cli("inspect", folder, "--json"))
    assert run_cli("inspect", folder).returncode == 0


# ---------------------------------------------------------------- names safetensors cannot hold


def test_convert_refuses_a_tensor_named_metadata_and_its_hint_works(tmp_path: Path) -> None:
    source = tmp_path / "meta.pt"
    torch.save({"__metadata__": torch.arange(3.0), "w": torch.ones(2)}, source)
    destination = tmp_path / "out.safetensors"
    line = one_error_line(run_cli("convert", source, destination))
    assert "meta.pt" in line and "__metadata__" in line and "rename it in the source" in line
    assert not destination.exists() and list(tmp_path.iterdir()) == [source]

    # the hint: torch.load it, move the tensor to another key, torch.save it, convert that
    state = torch.load(source)
    state["metadata_tensor"] = state.pop("__metadata__")
    renamed = tmp_path / "renamed.pt"
    torch.save(state, renamed)
    converted = run_cli("convert", renamed, destination)
    assert converted.returncode == 0, converted.stderr
    with safe_open(str(destination), "pt") as written:
        assert sorted(written.keys()) == ["metadata_tensor", "w"]
        assert torch.equal(written.get_tensor("metadata_tensor"), torch.arange(3.0))
    assert run_cli("inspect", destination).returncode == 0


def test_convert_refuses_a_lone_surrogate_name(tmp_path: Path) -> None:
    source = tmp_path / "surrogate.pt"
    torch.save({"w\ud800": torch.zeros(2)}, source)
    destination = tmp_path / "out.safetensors"
    line = one_error_line(run_cli("convert", source, destination))
    assert "surrogate.pt" in line and "w\\ud800" in line
    assert not destination.exists()


def test_printable_rule() -> None:
    from materialize.text import printable

    assert printable("a\x00\x1b\x7f\x85\x9f\u00a0\u200b\u202e\u2028\ud800\U000e0001\n\r\t b") == (
        "a\\x00\\x1b\\x7f\\x85\\x9f\\xa0\\u200b\\u202e\\u2028\\ud800\\U000e0001\\n\\r\\t b")
    assert printable("é中 \\x1b ok") == "é中 \\x1b ok"
