"""Reading file bytes straight into tensor memory, and nothing else.

All reads are positional (``preadv``) on descriptors opened once, so threads
share descriptors freely and a file that shrinks while being read gives a
short read we turn into an error, never a SIGBUS from a faulting mapping.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import CheckpointAccessError, CheckpointError, CheckpointNotFoundError

if TYPE_CHECKING:
    import torch


def byte_view(tensor: "torch.Tensor") -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (any dtype)."""
    assert tensor.device.type == "cpu" and tensor.is_contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    buffer = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    return memoryview(buffer).cast("B")


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


class FileSet:
    """Descriptors for the files of one checkpoint, opened once, shared by threads."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def fd(self, path: Path) -> int:
        with self._lock:
            if path not in self._fds:
                self._fds[path] = open_for_reading(path)
            return self._fds[path]

    def read_into(self, path: Path, offset: int, dest: memoryview, *, tensor: str) -> None:
        """Fill ``dest`` with the bytes at ``offset``; a short file is an error."""
        fd = self.fd(path)
        done = 0
        total = len(dest)
        while done < total:
            try:
                got = os.preadv(fd, [dest[done:]], offset + done)
            except OSError as exc:
                raise CheckpointAccessError(
                    f"read failed at byte {offset + done}: {os.strerror(exc.errno or errno.EIO)}",
                    path=path, tensor=tensor,
                ) from None
            if got == 0:
                raise CheckpointError(
                    f"file ends at byte {offset + done}, before the tensor's last byte "
                    f"{offset + total} (truncated or rewritten while loading?)",
                    path=path, tensor=tensor,
                )
            done += got

    def advise_sequential(self, path: Path) -> None:
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(self.fd(path), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except OSError:
                pass  # advice only; some file systems refuse it

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)
