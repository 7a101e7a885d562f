"""Reading file bytes straight into tensor memory, and nothing else.

All reads are positional (``preadv``) on descriptors opened once, so threads
share descriptors freely and a file that shrinks while being read gives a
short read we turn into an error, never a SIGBUS from a faulting mapping.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Union

from ..errors import CheckpointAccessError, CheckpointError, CheckpointNotFoundError
from .remotepath import RemotePath, is_remote

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def _memory_view_maker():
    try:  # one C call, where a ctypes array type made per size is slow enough for many small tensors to feel
        make = ctypes.pythonapi.PyMemoryView_FromMemory
    except AttributeError:  # not CPython
        return None
    make.restype = ctypes.py_object
    make.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
    return make


_PyBUF_WRITE = 0x200
_memory_view = _memory_view_maker()


def byte_view(tensor: "torch.Tensor") -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (any dtype); it does not keep the tensor alive."""
    assert tensor.is_cpu and tensor.is_contiguous()
    nbytes = tensor.nbytes
    if nbytes == 0:
        return memoryview(bytearray())
    return memory_at(tensor.data_ptr(), nbytes)


def memory_at(address: int, nbytes: int) -> memoryview:
    """A writable view of ``nbytes`` (at least one) of this process's memory at ``address``, which must stay
    allocated while the view is used."""
    if _memory_view is not None:
        return _memory_view(address, nbytes, _PyBUF_WRITE)
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


def open_for_reading(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointNotFoundError("no such file", path=path) from None
    except ValueError:  # a NUL byte in the name
        raise CheckpointError("is not a usable file name (it contains a NUL byte)", path=repr(str(path))) from None
    except IsADirectoryError:
        raise CheckpointError("is a directory where a file was expected", path=path) from None
    except OSError as exc:
        raise CheckpointAccessError(f"cannot open: {os.strerror(exc.errno or errno.EIO)}", path=path) from None


def file_size_of(path: Union[Path, RemotePath]) -> int:
    """A file's length in bytes, local or remote (a remote object's as its store reports it)."""
    if is_remote(path):
        return path.info().size
    return os.path.getsize(path)


def remote_pread(path: RemotePath) -> "Callable[[int, int], bytes]":
    """``pread(length, offset)`` over a remote object, as ``functools.partial(os.pread, fd)`` is over a file."""
    return lambda length, offset: path.read_at(offset, length)


def read_head(path: Union[Path, RemotePath], length: int) -> bytes:
    """A file's first ``length`` bytes (fewer where it is shorter), local or remote."""
    if is_remote(path):
        return path.read_at(0, length)
    fd = open_for_reading(path)
    try:
        return os.pread(fd, length, 0)
    finally:
        os.close(fd)


class Positional:
    """A file opened for reads at offsets, local (a descriptor) or remote (ranged GETs): ``size``, ``pread``."""

    def __init__(self, path: Union[Path, RemotePath]) -> None:
        self._path = path
        self._fd = None if is_remote(path) else open_for_reading(path)
        self.size = os.fstat(self._fd).st_size if self._fd is not None else path.info().size

    def pread(self, length: int, offset: int) -> bytes:
        if self._fd is None:
            return self._path.read_at(offset, length)
        return os.pread(self._fd, length, offset)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "Positional":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _read_failed(exc: OSError, path: Path, position: int, tensor: str) -> CheckpointAccessError:
    return CheckpointAccessError(f"read failed at byte {position}: {os.strerror(exc.errno or errno.EIO)}", path=path, tensor=tensor)


def _file_ends(path: Path, position: int, end: int, tensor: str) -> CheckpointError:
    return CheckpointError(
        f"file ends at byte {position}, before the tensor's last byte {end} (truncated or rewritten while loading?)",
        path=path, tensor=tensor,
    )


class FileSet:
    """Descriptors for the files of one checkpoint, opened once, shared by threads."""

    counts_by_tensor = False  # whether reads are counted per tensor name (a part of read_run must be one tensor)
    # Whether read_run's views may take the bytes between two tensors (a torch zip's local header, read into
    # the slack a load's arena leaves: see materialize.io.arena); a group's held chunks have only the tensors'
    reads_between = True

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self._stores: dict[int, object] = {}  # remote stores read through, closed with the files

    def _remote(self, path: RemotePath) -> RemotePath:
        with self._lock:
            self._stores.setdefault(id(path.store), path.store)
        return path

    def fd(self, path: Path) -> int:
        if is_remote(path):
            raise CheckpointError("is a remote object: it has no file descriptor (read it through read_into)", path=path)
        with self._lock:
            if path not in self._fds:
                self._fds[path] = open_for_reading(path)
            return self._fds[path]

    def read_into(self, path: Path, offset: int, dest: memoryview, *, tensor: str) -> None:
        """Fill ``dest`` with the bytes at ``offset``; a short file is an error."""
        if is_remote(path):
            self._remote(path).store.read_into(path.key, offset, [dest], tensor=tensor)
            return
        fd = self.fd(path)
        done = 0
        total = len(dest)
        while done < total:
            try:
                got = os.preadv(fd, [dest[done:]], offset + done)
            except OSError as exc:
                raise _read_failed(exc, path, offset + done, tensor) from None
            if got == 0:
                raise _file_ends(path, offset + done, offset + total, tensor)
            done += got

    def read_run(self, path: Path, offset: int, parts: list[Part]) -> None:
        """Fill each ``(dest, tensor)`` in turn with the bytes from ``offset`` on, in as few reads as it takes.

        For tensors that follow each other in the file: one ``preadv`` fills
        hundreds of small ones, where a read each would cost more in calls
        than in copying. A part whose ``dest`` is a number of bytes passes
        over them (read, kept nowhere): tensors a few bytes of headers apart,
        as in a torch zip, still share one read.
        """
        if len(parts) == 1 and not isinstance(parts[0][0], int):
            self.read_into(path, offset, parts[0][0], tensor=parts[0][1])
            return
        if is_remote(path):  # one ranged GET for the run, the bytes between tensors received into the sink
            views = [view for dest, _ in parts for view in (_sink_views(dest) if isinstance(dest, int) else (dest,))]
            self._remote(path).store.read_into(path.key, offset, views, tensor=parts[0][1])
            return
        fd = self.fd(path)
        views, names = [], []
        for dest, tensor in parts:
            for view in _sink_views(dest) if isinstance(dest, int) else (dest,):
                views.append(view)
                names.append(tensor)
        index, position = 0, offset
        while index < len(views):
            try:
                got = os.preadv(fd, views[index:index + MAX_IOVECS], position)
            except OSError as exc:
                raise _read_failed(exc, path, position, names[index]) from None
            if got == 0:
                raise _file_ends(path, position, position + len(views[index]), names[index])
            position += got
            while got and index < len(views):
                if got >= len(views[index]):
                    got -= len(views[index])
                    index += 1
                else:
                    views[index] = views[index][got:]
                    got = 0

    @property
    def scatters(self) -> bool:
        """Whether :meth:`read_scattered` can be used here (it needs libc's ``preadv`` through ctypes)."""
        return _preadv is not None

    def read_scattered(self, path: Path, offset: int, rows: "torch.Tensor", row_bytes: int, *, tensor: str) -> None:
        """Fill rows spread in memory with the bytes from ``offset`` on, in turn, ``row_bytes`` each.

        ``rows`` is an ``(n, 2)`` contiguous int64 CPU tensor of
        ``(address, row_bytes)`` pairs, laid out as the ``struct iovec`` array
        ``preadv`` takes, so a tensor read rearranged (whole rows in another
        order) is read straight into place, a thousand rows a call, with no
        temporary and no copy. Only where :attr:`scatters`.
        """
        assert rows.is_contiguous() and tuple(rows.shape[1:]) == (2,)
        if is_remote(path):  # the rows follow each other in the object: one ranged read fills them in turn
            views = [_memory_view(int(address), row_bytes, _PyBUF_WRITE) for address, _ in rows.tolist()]
            self._remote(path).store.read_into(path.key, offset, views, tensor=tensor)
            return
        assert _preadv is not None
        fd = self.fd(path)
        base, count, index, position = rows.data_ptr(), rows.shape[0], 0, offset
        while index < count:
            got = _preadv(fd, base + index * _IOVEC_BYTES, min(_IOV_MAX, count - index), position)
            if got < 0:
                raise _read_failed(OSError(ctypes.get_errno(), ""), path, position, tensor)
            if got == 0:
                raise _file_ends(path, position, offset + count * row_bytes, tensor)
            position += got
            whole, part = divmod(got, row_bytes)
            index += whole
            if part:  # a read cut short inside a row: the rest of that row, then on
                address = int(rows[index, 0]) + part
                FileSet.read_into(self, path, position, _memory_view(address, row_bytes - part, _PyBUF_WRITE),
                                  tensor=tensor)
                position += row_bytes - part
                index += 1

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
            stores, self._stores = self._stores, {}
        for fd in fds.values():
            os.close(fd)
        for store in stores.values():
            store.close()  # its idle connections; a later read opens new ones


def _preadv_function():
    if _memory_view is None or ctypes.sizeof(ctypes.c_void_p) != 8 or ctypes.sizeof(ctypes.c_size_t) != 8:
        return None  # the iovec layout read_scattered writes: two 8-byte fields
    try:
        function = ctypes.CDLL(None, use_errno=True).preadv  # the process's own libc; the call releases the GIL
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_ssize_t
    function.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64)
    return function


_preadv = _preadv_function()
_IOVEC_BYTES = 16  # struct iovec: a pointer and a size_t
_IOV_MAX = 1024


MAX_IOVECS = 512  # buffers per preadv; Linux takes up to 1024
Part = tuple[Union[memoryview, int], str]  # a destination and its tensor's name, or a number of bytes to pass over
_SINK = memoryview(bytearray(64 * 1024))  # where passed-over bytes go; threads may share it, nothing reads it


def _sink_views(nbytes: int) -> list[memoryview]:
    return [_SINK[: min(len(_SINK), nbytes - at)] for at in range(0, nbytes, len(_SINK))]


DIRECT_ALIGNMENT = 4096  # covers 512-byte and 4 KiB logical blocks
DIRECT_BOUNCE_BYTES = 8 * 1024 * 1024


@contextmanager
def reading(files: FileSet, direct_io: bool) -> Iterator[FileSet]:
    """The files as a load reads them: as they are, or around the page cache where ``direct_io`` asks
    (:class:`DirectReads`). The one place that option takes effect."""
    if not direct_io:
        yield files
        return
    bypass = DirectReads(files)
    try:
        yield bypass
    finally:
        bypass.close()


class DirectReads(FileSet):
    """Reads that bypass the page cache (``O_DIRECT``), for cold checkpoints on fast storage.

    O_DIRECT wants the file offset, the length and the memory address aligned
    to the device's block size, and tensors in a checkpoint sit at any
    offset, so every read goes through an aligned bounce buffer per thread
    (8 MiB) and is copied into the destination: one memcpy, far cheaper than
    the storage. The gain is on storage faster than the page cache's
    read-ahead path, and in not filling the page cache with a checkpoint that
    is read once; a checkpoint already cached is read from storage again, so
    this is opt-in. Where a file system refuses O_DIRECT (tmpfs, some network
    file systems), that file is read the ordinary way.
    """

    def __init__(self, files: FileSet) -> None:
        super().__init__()
        self._inner = files
        self._direct_fds: dict[Path, int] = {}
        self._buffered: set[Path] = set()  # the files whose reads fell back to the page cache, said once each
        self._bounce = threading.local()

    def fd(self, path: Path) -> int:
        return self._inner.fd(path)

    def _direct_fd(self, path: Path) -> int:
        """A second descriptor opened with O_DIRECT, or -1 where the file system refuses it."""
        with self._lock:
            if path not in self._direct_fds:
                self._inner.fd(path)  # the ordinary open: its errors name the file as usual
                try:
                    self._direct_fds[path] = os.open(path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
                except OSError as exc:
                    self._direct_fds[path] = -1
                    self._buffered.add(path)
                    logger.info("%s: direct_io falls back to ordinary reads (through the page cache): its file "
                                "system refuses O_DIRECT (%s)", path, os.strerror(exc.errno) if exc.errno else exc)
            return self._direct_fds[path]

    def _bounce_buffer(self) -> memoryview:
        if not hasattr(self._bounce, "view"):
            import mmap

            self._bounce.map = mmap.mmap(-1, DIRECT_BOUNCE_BYTES)  # anonymous maps are page-aligned
            self._bounce.view = memoryview(self._bounce.map)
        return self._bounce.view

    scatters = False  # each read goes through the bounce buffer: rows are read in blocks and copied

    def read_run(self, path: Path, offset: int, parts: list[Part]) -> None:
        for dest, tensor in parts:  # each goes through the bounce buffer anyway
            if not isinstance(dest, int):
                self.read_into(path, offset, dest, tensor=tensor)
            offset += dest if isinstance(dest, int) else len(dest)

    def read_into(self, path: Path, offset: int, dest: memoryview, *, tensor: str) -> None:
        if is_remote(path) or not hasattr(os, "O_DIRECT"):
            self._said_buffered(path, "it is read over the network" if is_remote(path)
                                else "this system has no O_DIRECT")
            fd = -1
        else:
            fd = self._direct_fd(path)
        if fd < 0:
            self._inner.read_into(path, offset, dest, tensor=tensor)
            return
        bounce = self._bounce_buffer()
        total = len(dest)
        done = 0
        while done < total:
            position = offset + done
            aligned = position - position % DIRECT_ALIGNMENT
            skip = position - aligned
            want = min(DIRECT_BOUNCE_BYTES, -(-(skip + total - done) // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT)
            try:
                got = os.preadv(fd, [bounce[:want]], aligned)
            except OSError as exc:
                if exc.errno == errno.EINVAL:  # an alignment this device will not take: read it buffered
                    self._said_buffered(path, f"its device refuses the O_DIRECT alignment ({DIRECT_ALIGNMENT} bytes)")
                    self._inner.read_into(path, position, dest[done:], tensor=tensor)
                    return
                raise _read_failed(exc, path, position, tensor) from None
            useful = min(got - skip, total - done)
            if useful <= 0:
                raise _file_ends(path, position, offset + total, tensor)
            dest[done:done + useful] = bounce[skip:skip + useful]
            done += useful

    def _said_buffered(self, path: Path, why: str) -> None:
        """Say (INFO), once a file, that direct_io falls back to ordinary reads for it, and why."""
        if path in self._buffered:  # said already (each read of a URL asks): no lock taken
            return
        with self._lock:
            if path in self._buffered:
                return
            self._buffered.add(path)
        logger.info("%s: direct_io falls back to ordinary reads (through the page cache): %s", path, why)

    def close(self) -> None:
        with self._lock:
            fds, self._direct_fds = self._direct_fds, {}
        for fd in fds.values():
            if fd >= 0:
                os.close(fd)


class CountingFiles(FileSet):
    """A FileSet that counts, per tensor name, the bytes read into destinations (the sanitizer's evidence)."""

    counts_by_tensor = True

    def __init__(self, files: FileSet) -> None:
        super().__init__()
        self._inner = files
        self.bytes_by_tensor: Counter[str] = Counter()
        self._count_lock = threading.Lock()

    def fd(self, path: Path) -> int:
        return self._inner.fd(path)

    def read_into(self, path: Path, offset: int, dest: memoryview, *, tensor: str) -> None:
        self._inner.read_into(path, offset, dest, tensor=tensor)
        with self._count_lock:
            self.bytes_by_tensor[tensor] += len(dest)

    def read_run(self, path: Path, offset: int, parts: list[Part]) -> None:
        self._inner.read_run(path, offset, parts)
        with self._count_lock:
            for dest, tensor in parts:
                if not isinstance(dest, int):  # bytes passed over between tensors are written nowhere
                    self.bytes_by_tensor[tensor] += len(dest)

    @property
    def scatters(self) -> bool:
        return self._inner.scatters

    def read_scattered(self, path: Path, offset: int, rows: torch.Tensor, row_bytes: int, *, tensor: str) -> None:
        self._inner.read_scattered(path, offset, rows, row_bytes, tensor=tensor)
        with self._count_lock:
            self.bytes_by_tensor[tensor] += rows.shape[0] * row_bytes

    def close(self) -> None:
        pass  # the checkpoint owns the descriptors
