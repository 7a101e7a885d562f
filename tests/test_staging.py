"""The staged pipeline (the CUDA path's logic) driven by the CPU staging double."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import materialize as mz
from materialize.io.engine import Job, run_staged
from materialize.sources.fileio import FileSet
from materialize.io.transfer import ThreadStaging

from conftest import write_safetensors


class RecordingStaging(ThreadStaging):
    """ThreadStaging that records copies and checks no slot is refilled while in flight."""

    def __init__(self, slot_bytes: int, num_slots: int, fail_on_copy: int = -1) -> None:
        super().__init__(slot_bytes=slot_bytes, num_slots=num_slots)
        self.copies = 0
        self.fail_on_copy = fail_on_copy
        self.in_flight: dict[int, object] = {}
        self.finished = False

    def copy(self, dest, src):
        if self.copies == self.fail_on_copy:
            self.copies += 1

            def broken():
                raise RuntimeError("copy engine fault")

            return _Done(self._worker.submit(broken))
        self.copies += 1
        return super().copy(dest, src)

    def finish(self):
        self.finished = True


class _Done:
    def __init__(self, future):
        self.future = future

    def wait(self):
        self.future.result()


def _jobs(ckpt, dtype=None):
    dests = {name: torch.empty(info.shape, dtype=dtype or info.dtype) for name, info in ckpt.items()}
    return dests, [Job(dests[name], info) for name, info in ckpt.items()]


@pytest.mark.parametrize("readers", [1, 3])
def test_ring_wraps_around_and_splits_tensors_larger_than_a_slot(tmp_path, readers):
    state = {f"t{i}": torch.randn(37 + i * 11) for i in range(6)}  # each larger than one 64-byte slot
    path = write_safetensors(state, tmp_path / "m.safetensors")
    staging = RecordingStaging(slot_bytes=64, num_slots=3)

    with mz.open_checkpoint(path) as ckpt:
        dests, jobs = _jobs(ckpt)
        run_staged(jobs, ckpt.files, staging, lambda n: None, reader_threads=readers)
    staging.close()

    expected_chunks = sum(-(-v.numel() * 4 // 64) for v in state.values())
    assert staging.copies == expected_chunks > 3 * 2
    assert staging.finished
    for name, value in state.items():
        assert torch.equal(dests[name], value), name


@pytest.mark.parametrize("readers", [1, 2])
def test_staged_cast_converts_chunk_by_chunk(tmp_path, readers):
    state = {"a": torch.randn(1000).bfloat16(), "b": torch.randn(3, 333).bfloat16()}
    path = write_safetensors(state, tmp_path / "m.safetensors")
    staging = RecordingStaging(slot_bytes=256, num_slots=2)

    with mz.open_checkpoint(path) as ckpt:
        dests, jobs = _jobs(ckpt, dtype=torch.float32)
        run_staged(jobs, ckpt.files, staging, lambda n: None, reader_threads=readers)
    staging.close()

    for name, value in state.items():
        assert torch.equal(dests[name], value.float()), name


@pytest.mark.parametrize("readers", [1, 2])
def test_read_error_mid_stream_raises_after_draining_copies(tmp_path, readers):
    state = {f"t{i}": torch.randn(100) for i in range(4)}
    path = write_safetensors(state, tmp_path / "m.safetensors")
    staging = RecordingStaging(slot_bytes=128, num_slots=2)

    with mz.open_checkpoint(path) as ckpt:
        dests, jobs = _jobs(ckpt)
        os.truncate(path, ckpt["t2"].offset + 10)
        with pytest.raises(mz.CheckpointError, match="t2"):
            run_staged(jobs, ckpt.files, staging, lambda n: None, reader_threads=readers)

    assert not staging.finished
    assert torch.equal(dests["t0"], state["t0"])  # copies already started completed
    staging.close()


@pytest.mark.parametrize("readers", [1, 2])
def test_copy_failure_surfaces_and_stops_the_stream(tmp_path, readers):
    state = {f"t{i}": torch.randn(64) for i in range(4)}
    path = write_safetensors(state, tmp_path / "m.safetensors")
    staging = RecordingStaging(slot_bytes=256, num_slots=2, fail_on_copy=1)

    with mz.open_checkpoint(path) as ckpt:
        _, jobs = _jobs(ckpt)
        with pytest.raises(RuntimeError, match="copy engine fault"):
            run_staged(jobs, ckpt.files, staging, lambda n: None, reader_threads=readers)

    assert not staging.finished
    staging.close()


def test_progress_counts_every_byte(tmp_path):
    state = {f"t{i}": torch.randn(50 + i) for i in range(5)}
    path = write_safetensors(state, tmp_path / "m.safetensors")
    seen = []

    tensors, report = mz.load_tensors(path, dtype="fp16", progress=lambda done, total: seen.append((done, total)))

    total = sum(v.numel() * 4 for v in state.values())
    assert seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert report.bytes_read == total


class SlotGuardStaging(ThreadStaging):
    """Fails the test if a slot is refilled while a copy out of it is still running."""

    def __init__(self) -> None:
        super().__init__(slot_bytes=96, num_slots=3)
        self.busy: set[int] = set()
        self.violations = 0

    def copy(self, dest, src):
        index = next(i for i, slot in enumerate(self.slots) if slot.data_ptr() == src.data_ptr())
        if index in self.busy:
            self.violations += 1
        self.busy.add(index)

        def slow_copy():
            import time

            time.sleep(0.002)  # copies slower than reads: the ring must wait for them
            dest.copy_(src)
            self.busy.discard(index)

        return _Done(self._worker.submit(slow_copy))


def test_no_slot_is_reused_while_its_copy_is_in_flight(tmp_path):
    state = {f"t{i}": torch.randn(200 + i) for i in range(5)}
    path = write_safetensors(state, tmp_path / "m.safetensors")
    staging = SlotGuardStaging()

    with mz.open_checkpoint(path) as ckpt:
        dests, jobs = _jobs(ckpt)
        run_staged(jobs, ckpt.files, staging, lambda n: None, reader_threads=3)
    staging.close()

    assert staging.violations == 0
    for name, value in state.items():
        assert torch.equal(dests[name], value), name


class PackedGuardStaging(ThreadStaging):
    """Counts copies in flight per slot (a slot may hold many small tensors), slowly."""

    def __init__(self, slot_bytes: int, num_slots: int) -> None:
        super().__init__(slot_bytes=slot_bytes, num_slots=num_slots)
        self.in_flight = [0] * num_slots
        self.copies = 0

    def slot_of(self, address: int) -> int:
        return next(i for i, s in enumerate(self.slots) if s.data_ptr() <= address < s.data_ptr() + s.numel())

    def copy(self, dest, src):
        index = self.slot_of(src.data_ptr())
        self.in_flight[index] += 1
        self.copies += 1

        def slow_copy():
            import time

            time.sleep(0.001)
            dest.copy_(src)
            self.in_flight[index] -= 1

        return _Done(self._worker.submit(slow_copy))


class GuardedFiles(FileSet):
    """Reads through the checkpoint's files, failing if a slot is refilled while copies out of it run."""

    def __init__(self, inner: FileSet, staging: PackedGuardStaging) -> None:
        super().__init__()
        self.inner, self.staging = inner, staging
        self.violations = self.reads = 0

    def fd(self, path):
        return self.inner.fd(path)

    def read_run(self, path, offset, parts):
        self.reads += 1
        for view, _ in parts:
            if isinstance(view, int):  # bytes passed over between tensors: they go to no slot
                continue
            address = ctypes.addressof(ctypes.c_char.from_buffer(view))
            if self.staging.in_flight[self.staging.slot_of(address)]:
                self.violations += 1
        self.inner.read_run(path, offset, parts)


@pytest.mark.parametrize("dtype", [None, torch.float64])
def test_small_tensors_share_slots_and_no_slot_is_refilled_while_copied_out(tmp_path, dtype):
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(3 + i % 8) for i in range(60)}  # 12 to 40 bytes each
    state["big"] = torch.randn(200)  # larger than a slot: cut, and packed after the small ones
    path = write_safetensors(state, tmp_path / "m.safetensors")
    staging = PackedGuardStaging(slot_bytes=256, num_slots=2)

    with mz.open_checkpoint(path) as ckpt:
        dests, jobs = _jobs(ckpt, dtype=dtype)
        files = GuardedFiles(ckpt.files, staging)
        run_staged(jobs, files, staging, lambda n: None, reader_threads=2)
    staging.close()

    for name, value in state.items():
        assert torch.equal(dests[name], value.to(dests[name].dtype)), name
    assert staging.copies == 60 + 4  # one copy per tensor, the big one in four slot-sized pieces
    assert files.reads < 25 and files.violations == 0  # 61 tensors in far fewer slot fills


class SlowStaging(ThreadStaging):
    """Copies that take a while to land; starting the ``fail_at``-th copy fails as a cast's temporary would
    on a full GPU (torch.OutOfMemoryError), after the copies before it in the same fill have started."""

    def __init__(self, slot_bytes: int, num_slots: int, fail_at: int, delay: float = 0.02) -> None:
        super().__init__(slot_bytes=slot_bytes, num_slots=num_slots)
        self._worker = ThreadPoolExecutor(max_workers=4, thread_name_prefix="slow-copy")  # several in flight
        self.fail_at, self.delay = fail_at, delay
        self.started = self.landed = 0
        self._lock = threading.Lock()

    def copy(self, dest, src):
        if self.started == self.fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        self.started += 1

        def land():
            time.sleep(self.delay)
            dest.copy_(src)
            with self._lock:
                self.landed += 1

        return _Done(self._worker.submit(land))


def test_an_error_starting_a_fills_copies_returns_only_once_the_copies_started_have_landed(tmp_path):
    state = {f"t{i:02d}": torch.randn(16) for i in range(12)}  # 64 bytes each: several tensors to a slot
    path = write_safetensors(state, tmp_path / "m.safetensors")
    staging = SlowStaging(slot_bytes=512, num_slots=2, fail_at=9)  # the second fill, after two of its copies

    with mz.open_checkpoint(path) as ckpt:
        dests, jobs = _jobs(ckpt)
        for dest in dests.values():
            dest.zero_()
        with pytest.raises(mz.AllocationError, match=r"out of memory on cpu for the temporary of a cast") as raised:
            run_staged(jobs, ckpt.files, staging, lambda n: None, reader_threads=2)
        landed_at_return = staging.landed
        values_at_return = {name: dest.clone() for name, dest in dests.items()}
        time.sleep(10 * staging.delay)

    assert landed_at_return == staging.started == 9  # nothing was still writing when the error came back
    assert staging.landed == landed_at_return
    assert all(torch.equal(dests[name], value) for name, value in values_at_return.items())
    assert raised.value.tensor == "t09"  # the copy that could not start, named
    assert isinstance(raised.value, MemoryError)
    staging.close()
