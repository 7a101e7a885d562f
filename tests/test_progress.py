"""``progress=`` in the library: ``True`` draws the bar on stderr, a callable is given the bytes (and the steps,
where it has a ``phase`` method), ``False`` and ``None`` nothing."""

from __future__ import annotations

import io

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import materialize as mz
from materialize.progress import Progress

from terminal import screen


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(512, 256))
        self.b = nn.Parameter(torch.empty(256))


class Told:
    """A progress callable with a ``phase`` method: everything it is told, in order."""

    def __init__(self) -> None:
        self.events: list[object] = []

    def __call__(self, done: int, total: int) -> None:
        self.events.append((done, total))

    def phase(self, text: str) -> None:
        self.events.append(text)


def write_pair(path) -> int:
    tensors = {"w": torch.randn(512, 256), "b": torch.randn(256)}
    save_file(tensors, str(path))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def assert_rises_to_the_total(calls: list[tuple[int, int]], total: int) -> None:
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert all(seen_total == total for _, seen_total in calls)
    assert all(a <= b for (a, _), (b, _) in zip(calls, calls[1:]))


def test_a_callable_is_given_the_bytes_from_zero_to_the_total_by_every_verb(tmp_path):
    path = tmp_path / "pair.safetensors"
    total = write_pair(path)
    by_verb: dict[str, list[tuple[int, int]]] = {"load": [], "load_tensors": [], "load_model": [], "convert": []}
    with mz.meta_init():
        model = Pair()

    mz.load(model, path, progress=lambda done, all_: by_verb["load"].append((done, all_)))
    mz.load_tensors(path, progress=lambda done, all_: by_verb["load_tensors"].append((done, all_)))
    mz.load_model(path, model=Pair, progress=lambda done, all_: by_verb["load_model"].append((done, all_)))
    mz.convert(path, tmp_path / "out.safetensors", progress=lambda done, all_: by_verb["convert"].append((done, all_)))

    for calls in by_verb.values():
        assert_rises_to_the_total(calls, total)


def test_a_callable_with_a_phase_method_is_told_each_step_before_the_bytes(tmp_path):
    path = tmp_path / "pair.safetensors"
    total = write_pair(path)
    loading, reading, converting = Told(), Told(), Told()

    mz.load_model(path, model=Pair, progress=loading)
    mz.load_tensors(path, progress=reading)
    mz.convert(path, tmp_path / "out.safetensors", progress=converting)

    assert loading.events[:4] == ["opening pair.safetensors", "building Pair", "planning 2 tensors", "loading 2 tensors"]
    assert reading.events[:2] == ["opening pair.safetensors", "loading 2 tensors"]
    assert converting.events[:2] == ["opening pair.safetensors", "writing 2 tensors"]
    for told in (loading, reading, converting):
        bytes_told = [event for event in told.events if isinstance(event, tuple)]
        assert told.events[-len(bytes_told):] == bytes_told  # every step before the first byte
        assert_rises_to_the_total(bytes_told, total)


def test_a_mapped_load_tells_its_steps_and_no_bytes(tmp_path):
    path = tmp_path / "pair.safetensors"
    write_pair(path)
    told = Told()

    _, report = mz.load_model(path, model=Pair, mmap=True, progress=told)

    assert report.bytes_read == 0
    assert told.events == ["opening pair.safetensors", "building Pair", "planning 2 tensors", "loading 2 tensors"]


def test_progress_true_draws_the_bar_on_stderr_and_leaves_it_finished(tmp_path, capsys):
    path = tmp_path / "pair.safetensors"
    write_pair(path)

    mz.load_tensors(path, progress=True)

    drawn = capsys.readouterr()
    assert drawn.out == ""
    assert "opening pair.safetensors" in drawn.err
    shown = screen(drawn.err)
    assert len(shown) == 1 and shown[0].startswith("loading 2 tensors: 100%|")
    assert "525kB/525kB" in shown[0] and "B/s]" in shown[0]  # bytes, time and rate
    assert drawn.err.endswith("\n")  # what is printed next starts on a line of its own


def test_progress_true_clears_a_bar_that_only_showed_steps(tmp_path, capsys):
    path = tmp_path / "pair.safetensors"
    write_pair(path)

    mz.load_model(path, model=Pair, mmap=True, progress=True)

    drawn = capsys.readouterr().err
    assert "planning 2 tensors" in drawn and "%|" not in drawn
    assert screen(drawn) == []


def test_a_failed_load_leaves_the_bar_closed_on_a_line_of_its_own(tmp_path, capsys):
    path = tmp_path / "pair.safetensors"
    save_file({"other": torch.ones(3)}, str(path))
    with mz.meta_init():
        model = Pair()

    with pytest.raises(mz.KeyMismatchError):
        mz.load(model, path, progress=True)

    drawn = capsys.readouterr().err
    assert "planning 1 tensor" in drawn
    assert screen(drawn) == []


@pytest.mark.parametrize("off", [False, None])
def test_progress_false_or_none_draws_nothing(tmp_path, capsys, off):
    path = tmp_path / "pair.safetensors"
    write_pair(path)

    mz.load_tensors(path, progress=off)

    assert capsys.readouterr().err == ""


def test_a_progress_that_is_neither_a_flag_nor_a_callable_is_refused(tmp_path):
    path = tmp_path / "pair.safetensors"
    write_pair(path)

    with pytest.raises(TypeError, match="progress: expected True, False, None or fn"):
        mz.load_tensors(path, progress="yes")


def test_a_new_read_starts_the_bar_again_and_a_shorter_line_leaves_nothing_of_a_longer_one():
    stream = io.StringIO()
    with Progress(stream, leave=False) as bar:
        bar.phase("opening a-checkpoint-with-a-long-name.safetensors")
        bar.phase("loading 3 tensors")
        assert screen(stream.getvalue()) == ["loading 3 tensors"]
        bar(0, 3_000_000_000)
        bar(1_510_000_000, 3_000_000_000)
        bar(3_000_000_000, 3_000_000_000)
        assert screen(stream.getvalue())[0].startswith("loading 3 tensors: 100%|")
        assert "3.00GB/3.00GB" in screen(stream.getvalue())[0]
        bar(0, 1000)  # another read: counted from its own start
        bar(1000, 1000)
        assert "1.00kB/1.00kB" in screen(stream.getvalue())[0]
        bar.phase("writing")  # back to a step: the bytes' text is gone
        assert screen(stream.getvalue()) == ["writing"]
    assert screen(stream.getvalue()) == []


def test_names_in_steps_are_escaped():
    stream = io.StringIO()
    with Progress(stream) as bar:
        bar.phase("opening \x1b]52;c;bad\x07.safetensors")

    assert "\x1b" not in stream.getvalue() and "\\x1b]52" in stream.getvalue()
