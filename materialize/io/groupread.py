"""Loads shared by the ranks of a process group: every byte any rank needs is read from storage by one rank.

Without a group each rank reads what it needs, and bytes several ranks need
(a replicated model, HSDP's replicas, tensors replicated under tensor
parallelism, the rows a row-wise parallel tensor's columns span) are read
once per rank. With ``group=`` the ranks agree on who reads what, and the
bytes travel over the group's collectives instead:

1. Each rank cuts its reads into pieces whose bytes span at most
   ``staging_bytes / 4`` of their file (a large tensor into runs of
   elements, a tensor-parallel box into blocks of rows) and the ranks gather
   every rank's byte ranges and file sizes (one ``all_gather_object``); files
   of another size on some rank are an error, never a model of two files.
2. Every rank computes the same schedule from them: the union of the ranges,
   cut where the set of ranks needing the bytes changes and every
   ``staging_bytes / (4 * ranks)`` bytes. Each chunk is read by one rank that
   needs it: the rank alone needing it, else the one of its ranks with the
   fewest bytes to read so far, so the reads spread evenly over the ranks
   and the job reads at the sum of their bandwidth (a rank-0 read and a
   broadcast reads at one rank's). Chunks in file order make rounds, a rank
   reading at most one chunk a round.
3. A round, on a thread of its own: the readers read their chunks from
   storage; an ``all_reduce`` says whether every rank succeeded (else every
   rank raises the same error, naming the file and tensor); each chunk goes
   by point-to-point sends to the other ranks that need it. Meanwhile the
   caller's thread fills the pieces whose bytes have all arrived in the
   round before (the engine, reading from the chunks in memory) and lets go
   of the chunks no piece still waiting needs; an error there is carried to
   every rank by the next agreement.

Host memory in flight per rank, within ``staging_bytes``: two rounds'
chunks, the one being filled and the one arriving (at most
``staging_bytes / 2``), the chunks held for a piece not yet complete (at
most ``staging_bytes / 4``), and the rank's next chunks read from storage
ahead of their rounds (:data:`READ_AHEAD`, at most one a rank: at most
``staging_bytes / 4``). The bytes land in a chunk first and are copied into
place: one copy more than a load without a group makes. The group must carry
CPU tensors (gloo, or a ``cpu:gloo,cuda:nccl`` group); a rank that stops
answering fails the others after the group's own timeout.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..checkpoint import TensorInfo
from ..checkpoint.base import view_of
from ..checkpoint.pieces import Job
from ..errors import CheckpointAccessError, CheckpointError, MaterializeError
from ..options import ProgressFn
from .engine import flattened_if_same_dense_layout, pieces_of_stacks, strided_layout
from ..sources.fileio import CountingFiles, FileSet, Part, byte_view, file_size_of

DEFAULT_BUDGET_BYTES = 64 * 1024 * 1024  # staging_bytes' own default
Fill = Callable[[list[Job], FileSet, Optional[ProgressFn]], object]  # the engine's stream, as the executor runs it
MIN_CHUNK_BYTES = 4096  # a floor for a tiny budget: a page
READ_AHEAD = 4  # chunks of this rank's read from storage before their round: requests in flight on a remote store
_EXCHANGED, _AGREED = object(), object()  # what the exchange thread says besides rounds: all sent, all agreed


@dataclass
class GroupCounts:
    """What one rank's part of a group load moved: bytes read from storage, received from and sent to others."""

    from_storage: int = 0
    received: int = 0
    sent: int = 0


@dataclass(frozen=True)
class _Chunk:
    key: int  # index of the file in the sorted list of every rank's files
    start: int
    end: int
    owner: int  # group rank that reads it
    audience: tuple[int, ...]  # group ranks that need its bytes (the owner among them)


@dataclass
class _Piece:
    job: Job
    key: int
    start: int
    end: int


class _Buffers:
    """Chunk-sized buffers, each used again once its chunk is let go of.

    A new tensor per chunk, freed on one thread after being filled on
    another, left glibc's per-thread arenas holding the freed ones: 0.35 GB
    above the model per rank on 4 ranks (``make bench-sharded``, replicas);
    reused, the buffers are as many as are ever held at once.
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            buffer = self._free.pop() if self._free else None
        if buffer is None:
            buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        return buffer[:nbytes]

    def give(self, data: torch.Tensor) -> None:
        with self._lock:
            self._free.append(data._base if data._base is not None else data)


@dataclass
class _Held:
    """The chunks this rank holds, per file, sorted by start; those let go of go back to ``buffers``."""

    buffers: _Buffers
    starts: dict[int, list[int]] = field(default_factory=dict)
    chunks: dict[int, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)

    def add(self, key: int, start: int, data: torch.Tensor) -> None:
        starts = self.starts.setdefault(key, [])
        at = bisect.bisect(starts, start)
        starts.insert(at, start)
        self.chunks.setdefault(key, []).insert(at, (start, data))

    def drop_before(self, key: int, position: int) -> None:
        """Let go of every chunk of files before ``key``, and of ``key``'s ending at or before ``position``."""
        for other in [k for k in self.starts if k < key]:
            for _, data in self.chunks.pop(other):
                self.buffers.give(data)
            del self.starts[other]
        chunks = self.chunks.get(key, [])
        keep = [(start, data) for start, data in chunks if start + data.numel() > position]
        for start, data in chunks:
            if start + data.numel() <= position:
                self.buffers.give(data)
        self.chunks[key] = keep
        self.starts[key] = [start for start, _ in keep]

    def copy(self, key: int, offset: int, dest: memoryview, name: str, path: Any) -> None:
        """Fill ``dest`` with the bytes at ``offset``, from however many chunks hold them."""
        starts, chunks = self.starts.get(key, []), self.chunks.get(key, [])
        address = ctypes.addressof(ctypes.c_char.from_buffer(dest)) if len(dest) else 0
        done = 0
        while done < len(dest):
            at = bisect.bisect(starts, offset + done) - 1
            if at < 0 or chunks[at][0] + chunks[at][1].numel() <= offset + done:
                raise CheckpointError(f"bytes {offset + done}-{offset + len(dest) - 1} were not received from the "
                                      "group (a schedule no rank kept)", path=path, tensor=name)
            start, data = chunks[at]
            count = min(len(dest) - done, start + data.numel() - (offset + done))
            ctypes.memmove(address + done, data.data_ptr() + offset + done - start, count)  # the GIL let go
            done += count


class _HeldFiles(FileSet):
    """The held chunks, read as the engine reads files."""

    reads_between = False  # no rank received the bytes between two tensors

    def __init__(self, held: _Held, keys: dict[str, int]) -> None:
        super().__init__()
        self._held = held
        self._keys = keys

    def read_into(self, path, offset: int, dest: memoryview, *, tensor: str) -> None:
        self._held.copy(self._keys[os.fspath(path)], offset, dest, tensor, path)

    def read_run(self, path, offset: int, parts: list[Part]) -> None:
        position = offset
        for dest, tensor in parts:
            if isinstance(dest, int):  # bytes between two tensors: nobody needs them
                position += dest
                continue
            self.read_into(path, position, dest, tensor=tensor)
            position += len(dest)

    @property
    def scatters(self) -> bool:
        return False  # rows come out of the chunks by copies, not by preadv

    def read_scattered(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("scatters is False: the engine reads blocks instead")


def cut(job: Job, most: int) -> list[Job]:
    """``job`` as jobs whose source bytes each span at most ``most`` bytes of the file (one element, or one
    index of a strided source's outermost dimension, at least)."""
    info, dest = job.info, job.dest
    if info.contiguous and dest.is_contiguous():
        if info.nbytes <= most:
            return [job]
        step = max(1, most // info.itemsize)
        flat = dest.view(-1)
        return [Job(flat[first:min(first + step, info.numel)],
                    view_of(info, (min(first + step, info.numel) - first,), info.offset + first * info.itemsize,
                            storage=info.storage))
                for first in range(0, info.numel, step)]
    layout = strided_layout(info)
    count = layout.shape[layout.outer] if layout.shape else 1
    if _span(layout, count) * info.itemsize <= most or layout.step == 0:
        return [job]
    per = max(1, (most // info.itemsize - layout.inner_span) // layout.step + 1)
    whole = dest.view(layout.shape)
    jobs = []
    for first in range(0, count, per):
        rows = min(per, count - first)
        shape = list(layout.shape)
        shape[layout.outer] = rows
        jobs.append(Job(whole.narrow(layout.outer, first, rows),
                        view_of(info, tuple(shape), info.offset + first * layout.step * info.itemsize,
                                layout.strides, _span(layout, rows) * info.itemsize, info.storage)))
    return jobs


def _span(layout, rows: int) -> int:
    """Elements of the file that ``rows`` indexes of the outermost dimension span."""
    return (rows - 1) * layout.step + layout.inner_span if rows else 0


def _source_bytes(info: TensorInfo) -> int:
    if info.contiguous:
        return info.nbytes
    layout = strided_layout(info)
    return _span(layout, layout.shape[layout.outer] if layout.shape else 1) * info.itemsize


class _Accumulated:
    """One progress over the engine's several calls: each call's bytes added to those of the calls before."""

    def __init__(self, callback: Optional[ProgressFn], total: int) -> None:
        self.callback, self.total, self.base = callback, total, 0
        if callback is not None and total:
            callback(0, total)

    def call(self) -> Optional[ProgressFn]:
        if self.callback is None:
            return None
        base = self.base
        return lambda done, _: self.callback(base + done, self.total) if done else None


class GroupReads:
    """One rank's side of loads shared by ``group``; :meth:`stream` stands in for the engine's ``stream``."""

    def __init__(self, group: Any, budget_bytes: Optional[int] = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise CheckpointError("group= needs torch.distributed initialized (init_process_group) on every rank")
        self.dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise CheckpointError("group= names a process group this rank is not in")
        _refuse_without_cpu(dist, group)
        budget = budget_bytes or DEFAULT_BUDGET_BYTES
        self.piece_bytes = max(MIN_CHUNK_BYTES, budget // 4)
        self.chunk_bytes = max(MIN_CHUNK_BYTES, budget // (4 * self.size))  # two rounds held: one filled, one arriving
        self.counts = GroupCounts()

    # --- the schedule ------------------------------------------------------------------------------------------

    def stream(self, jobs: Iterable[Job], files: FileSet, fill: Fill, progress: Optional[ProgressFn]) -> int:
        """Fill every job's destination with this group's bytes, ``fill`` (the engine) copying them into place
        from the chunks held; the bytes this rank read from storage."""
        pieces, paths = self._pieces(jobs)
        names = sorted({name for name in paths})
        sizes = {name: file_size_of(paths[name]) for name in names}
        gathered: list[Any] = [None] * self.size
        ranges = {name: _merged([(p.start, p.end) for p in pieces if p.key == name]) for name in names}
        try:
            self.dist.all_gather_object(gathered, (sizes, ranges), group=self.group)
        except RuntimeError as exc:  # a rank that never came, after the group's timeout
            raise CheckpointAccessError(f"the group's ranks did not all start the load: {_one_line(exc)}") from None
        keys = sorted({name for theirs, _ in gathered for name in theirs})
        index = {name: number for number, name in enumerate(keys)}
        _refuse_other_files(gathered, keys)
        for piece in pieces:
            piece.key = index[piece.key]
        pieces.sort(key=lambda p: (p.key, p.start))
        chunks = _schedule([{index[n]: r for n, r in theirs.items()} for _, theirs in gathered], self.chunk_bytes)
        storage = files._inner if isinstance(files, CountingFiles) else files
        buffers = _Buffers(self.chunk_bytes)
        held = _Held(buffers)
        engine_files: FileSet = _HeldFiles(held, index)
        if isinstance(files, CountingFiles):  # the sanitizer's counts: of bytes put into destinations, as ever
            counted = CountingFiles(engine_files)
            counted.bytes_by_tensor, counted._count_lock = files.bytes_by_tensor, files._count_lock
            engine_files = counted
        before = self.counts.from_storage
        progress_all = _Accumulated(progress, sum(p.job.info.read_nbytes for p in pieces))
        starts = [(piece.key, piece.start) for piece in pieces]
        fill_failed: list[BaseException] = []  # the filling thread's error, carried by the next agreement
        delivered: queue.Queue = queue.Queue()
        room = threading.Semaphore(2)  # the round being filled and the one arriving, no more

        turns = list(_rounds(chunks))
        reads = _ReadAhead([c for turn in turns for c in turn if c.owner == self.rank], min(READ_AHEAD, self.size),
                           lambda chunk: self._read(storage, chunk, buffers, pieces, starts, keys, paths))

        def exchange() -> None:
            """The rounds, on their own thread: reading and sending round t+1 while round t is copied into place."""
            try:
                for turn in turns:
                    room.acquire()
                    data: dict[_Chunk, torch.Tensor] = {}
                    failure = fill_failed[0] if fill_failed else None
                    for chunk in (c for c in turn if c.owner == self.rank):
                        try:
                            data[chunk] = reads.next()
                            self.counts.from_storage += chunk.end - chunk.start
                        except Exception as exc:  # carried to every rank by the agreement
                            failure = failure or exc
                    self._agree(failure)
                    self._exchange(turn, data, buffers)
                    delivered.put((turn, data))
                delivered.put(_EXCHANGED)
                all_filled.wait()
                self._agree(fill_failed[0] if fill_failed else None)
                delivered.put(_AGREED)
            except BaseException as exc:
                delivered.put(exc)
            finally:
                reads.close()

        all_filled = threading.Event()
        exchanging = threading.Thread(target=exchange, name="materialize-group", daemon=True)
        exchanging.start()
        waiting = 0  # pieces[:waiting] are filled
        while True:
            item = delivered.get()
            if isinstance(item, BaseException):
                exchanging.join()
                raise item
            if item is _EXCHANGED:
                all_filled.set()
                continue
            if item is _AGREED:
                break
            turn, data = item
            for chunk, received in data.items():
                held.add(chunk.key, chunk.start, received)
            last = turn[-1]
            ready = waiting
            while ready < len(pieces) and (pieces[ready].key, pieces[ready].end) <= (last.key, last.end):
                ready += 1
            if ready > waiting and not fill_failed:
                try:
                    self._fill(pieces[waiting:ready], engine_files, fill, progress_all)
                except Exception as exc:
                    fill_failed.append(exc)
            waiting = ready
            if waiting < len(pieces):
                held.drop_before(pieces[waiting].key, pieces[waiting].start)
            else:
                held.drop_before(len(keys), 0)
            room.release()
        exchanging.join()
        if waiting < len(pieces):  # a schedule that left a piece of this rank's out: never a partial load
            raise CheckpointError(f"{len(pieces) - waiting} piece(s) were not received from the group",
                                  path=os.fspath(pieces[waiting].job.info.path), tensor=pieces[waiting].job.info.name)
        return self.counts.from_storage - before

    def _pieces(self, jobs: Iterable[Job]) -> tuple[list[_Piece], dict[str, Any]]:
        pieces: list[_Piece] = []
        paths: dict[str, Any] = {}
        for job in pieces_of_stacks(jobs):
            if job.info.numel == 0:
                continue
            for part in cut(flattened_if_same_dense_layout(job), self.piece_bytes):
                name = os.fspath(part.info.path)
                paths.setdefault(name, part.info.path)
                pieces.append(_Piece(part, name, part.info.offset, part.info.offset + _source_bytes(part.info)))  # type: ignore[arg-type]
        return pieces, paths

    def _read(self, storage: FileSet, chunk: _Chunk, buffers: _Buffers, pieces: list[_Piece],
              starts: list[tuple[int, int]], keys: list[str], paths: dict[str, Any]) -> torch.Tensor:
        data = buffers.take(chunk.end - chunk.start)
        storage.read_into(paths[keys[chunk.key]], chunk.start, byte_view(data),
                          tensor=_holder(pieces, starts, chunk).job.info.name)
        return data

    def _exchange(self, turn: list[_Chunk], data: dict[_Chunk, torch.Tensor], buffers: _Buffers) -> None:
        """Each chunk of the round from its reader to the other ranks needing it; received ones into ``data``."""
        dist = self.dist
        works = []
        for chunk in turn:
            if chunk.owner == self.rank:
                for other in chunk.audience:
                    if other != self.rank:
                        works.append(dist.isend(data[chunk], dist.get_global_rank(self.group, other), self.group))
                        self.counts.sent += data[chunk].numel()
            elif self.rank in chunk.audience:
                data[chunk] = buffers.take(chunk.end - chunk.start)
                works.append(dist.irecv(data[chunk], dist.get_global_rank(self.group, chunk.owner), self.group))
                self.counts.received += chunk.end - chunk.start
        try:
            for work in works:
                work.wait()
        except RuntimeError as exc:  # a rank gone, or the group's timeout
            raise CheckpointAccessError(f"the group's exchange failed: {_one_line(exc)}") from None

    def _agree(self, failure: Optional[BaseException]) -> None:
        """Whether every rank got on; where one did not, every rank raises its error (the lowest rank's)."""
        dist = self.dist
        flag = torch.tensor([1 if failure is not None else 0], dtype=torch.int32)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            if not flag.item():
                return
            said: list[Any] = [None] * self.size
            dist.all_gather_object(said, _described(failure) if failure is not None else None, group=self.group)
        except RuntimeError as exc:
            raise CheckpointAccessError(f"the group's exchange failed: {_one_line(exc)}") from None
        rank, described = next((r, d) for r, d in enumerate(said) if d is not None)
        raise _rebuilt(described, rank) from failure

    def _fill(self, pieces: list[_Piece], files: FileSet, fill: Fill, progress: _Accumulated) -> None:
        fill([piece.job for piece in pieces], files, progress.call())
        progress.base += sum(piece.job.info.read_nbytes for piece in pieces)


class _ReadAhead:
    """This rank's chunks read from storage in order, ``depth`` at a time on threads of their own: a store
    answering each request after a round trip (object storage, a network file system) is kept busy while
    the rounds before are sent."""

    def __init__(self, chunks: list[_Chunk], depth: int, read: Callable[[_Chunk], torch.Tensor]) -> None:
        self._chunks = iter(chunks)
        self._read = read
        self._depth = depth
        self._pool = ThreadPoolExecutor(depth, thread_name_prefix="materialize-group-read")
        self._pending: deque[Future] = deque()
        self._top_up()

    def _top_up(self) -> None:
        while len(self._pending) < self._depth:
            chunk = next(self._chunks, None)
            if chunk is None:
                return
            self._pending.append(self._pool.submit(self._read, chunk))

    def next(self) -> torch.Tensor:
        """The next chunk's bytes (its read's error, raised)."""
        future = self._pending.popleft()
        self._top_up()
        return future.result()

    def close(self) -> None:
        for future in self._pending:
            future.cancel()
        self._pool.shutdown(wait=True)


def _holder(pieces: list[_Piece], starts: list[tuple[int, int]], chunk: _Chunk) -> _Piece:
    """A piece of this rank's holding the chunk's first byte (the reader needs them all): the tensor an error of
    the chunk's read names."""
    at = max(0, bisect.bisect(starts, (chunk.key, chunk.start)) - 1)
    for back in range(at, max(-1, at - 64), -1):  # pieces sorted by start: the one holding it starts at or before
        if pieces[back].key == chunk.key and pieces[back].end > chunk.start:
            return pieces[back]
    return pieces[at]


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _schedule(needs: list[dict[int, list[tuple[int, int]]]], chunk_bytes: int) -> list[_Chunk]:
    """Every byte some rank needs, in chunks of one audience each, each chunk given a reader (see the module)."""
    chunks: list[_Chunk] = []
    load = [0] * len(needs)
    for key in sorted({key for theirs in needs for key in theirs}):
        edges = sorted({edge for theirs in needs for start, end in theirs.get(key, []) for edge in (start, end)})
        # Which ranks need each elementary segment: a sweep over every rank's sorted, merged ranges.
        cursors = [0] * len(needs)
        segments: list[tuple[int, int, tuple[int, ...]]] = []
        for low, high in zip(edges, edges[1:]):
            audience = []
            for rank, theirs in enumerate(needs):
                ranges = theirs.get(key, [])
                while cursors[rank] < len(ranges) and ranges[cursors[rank]][1] <= low:
                    cursors[rank] += 1
                if cursors[rank] < len(ranges) and ranges[cursors[rank]][0] <= low:
                    audience.append(rank)
            if not audience:
                continue
            if segments and segments[-1][1] == low and segments[-1][2] == tuple(audience):
                segments[-1] = (segments[-1][0], high, segments[-1][2])
            else:
                segments.append((low, high, tuple(audience)))
        for low, high, audience in segments:
            for start in range(low, high, chunk_bytes):
                end = min(high, start + chunk_bytes)
                owner = min(audience, key=lambda rank: (load[rank], rank))
                load[owner] += end - start
                chunks.append(_Chunk(key, start, end, owner, audience))
    return chunks


def _rounds(chunks: list[_Chunk]) -> Iterable[list[_Chunk]]:
    """Consecutive chunks, each round with at most one chunk a reader."""
    turn: list[_Chunk] = []
    owners: set[int] = set()
    for chunk in chunks:
        if chunk.owner in owners:
            yield turn
            turn, owners = [], set()
        turn.append(chunk)
        owners.add(chunk.owner)
    if turn:
        yield turn


def _refuse_other_files(gathered: list[Any], keys: list[str]) -> None:
    for name in keys:
        seen = {rank: sizes[name] for rank, (sizes, _) in enumerate(gathered) if name in sizes}
        if len(set(seen.values())) > 1:
            shown = ", ".join(f"rank {rank}: {size} bytes" for rank, size in seen.items())
            raise CheckpointError(f"the ranks of the group see different files here ({shown}): a group load needs "
                                  "the same checkpoint on every rank", path=name)


def _refuse_without_cpu(dist: Any, group: Any) -> None:
    backend = str(dist.get_backend(group)).lower()
    if "gloo" not in backend and "cpu" not in backend and "mpi" not in backend:
        raise CheckpointError(
            f"group= needs a group that carries CPU tensors; this one is {backend!r}: pass "
            "torch.distributed.new_group(backend='gloo') (or init_process_group(backend='cpu:gloo,cuda:nccl'))")


def _described(failure: BaseException) -> tuple[str, str, Optional[str], Optional[str]]:
    if isinstance(failure, MaterializeError):
        return type(failure).__name__, failure.reason, failure.path, failure.tensor
    return type(failure).__name__, _one_line(failure), None, None


def _rebuilt(described: tuple[str, str, Optional[str], Optional[str]], rank: int) -> MaterializeError:
    kind, reason, path, tensor = described
    cls = _error_classes().get(kind)
    if cls is None or cls.__init__ is not MaterializeError.__init__:
        cls, reason = CheckpointError, f"{kind}: {reason}"
    return cls(f"{reason} (on rank {rank} of the group)", path=path, tensor=tensor)


def _error_classes() -> dict[str, type[MaterializeError]]:
    found: dict[str, type[MaterializeError]] = {}
    waiting = [MaterializeError]
    while waiting:
        cls = waiting.pop()
        found[cls.__name__] = cls
        waiting += cls.__subclasses__()
    return found


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] or type(exc).__name__
