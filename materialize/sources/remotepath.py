"""A remote object or folder that the checkpoint readers use as they use a local ``Path``.

The readers ask a path few things: its name and suffix, its parent and a
child by name, whether it is a file or a folder, what a folder holds, its
size, some bytes at an offset, and a file object for the zip and pickle
readers. :class:`RemotePath` answers each from a :class:`Store` (HTTP, S3,
the hub), so every format a local load reads is read from a URL by the same
code, and a new kind of storage is one more ``Store``. Tensor bytes do not
come through here: :class:`~materialize.sources.fileio.FileSet` hands a remote
path's reads to its store, which writes them straight into the destination.
"""

from __future__ import annotations

import fnmatch
import io
import posixpath
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional, Protocol, Union

from ..errors import CheckpointError, CheckpointNotFoundError
from ..text import shown_url


@dataclass(frozen=True)
class ObjectInfo:
    """What a store says of one object before its bytes are read.

    Fields:
        size: its length in bytes.
        etag: the version tag every later read must match (``None`` where the server gives none).
        last_modified: where there is no strong ETag, the ``Last-Modified`` date every later read must match
            (asked with ``If-Unmodified-Since``); ``None`` where the server gives none, or an ETag serves.
    """

    size: int
    etag: Optional[str]
    last_modified: Optional[str] = None


class Store(Protocol):
    """One bucket, server folder or hub repo revision: the operations a :class:`RemotePath` needs."""

    def url(self, key: str) -> str:
        """How messages name the object ``key`` (``s3://bucket/key``, ``https://host/path``)."""

    def stat(self, key: str) -> Optional[ObjectInfo]:
        """The object's size and tag, ``None`` where there is no such object."""

    def listing(self, key: str) -> Optional[tuple[list[str], list[str]]]:
        """The names of the files and of the folders directly inside folder ``key`` (``""``: the top), ``None``
        where there is no such folder."""

    def read_into(self, key: str, offset: int, views: list[memoryview], *, tensor: Optional[str]) -> None:
        """Fill ``views`` in turn with the object's bytes from ``offset`` on."""


HEAD_BYTES = 256 * 1024  # one GET serves a file's sniffing and, for most safetensors files, its whole header


class RemotePath:
    """A key in a :class:`Store`, with the part of ``pathlib.Path``'s interface the checkpoint readers use.

    ``str()`` and ``os.fspath()`` give the URL as every output shows it
    (:func:`~materialize.text.shown_url`: no userinfo, a signed query's
    parameter names only), so messages and reports name it; the store's
    requests use the whole URL. The URL is no local file, and anything that
    opens it as one fails to find it. Equal keys of one store are equal paths.
    """

    def __init__(self, store: Store, key: str, *, folder: Optional[bool] = None) -> None:
        self.store = store
        self.key = key.strip("/")
        self._folder = folder  # known from how the path was named or listed; None: ask the store

    def __fspath__(self) -> str:
        url = shown_url(self.store.url(self.key))
        return url + "/" if self._folder and not url.endswith("/") else url

    __str__ = __fspath__

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.store is self.store and other.key == self.key

    def __hash__(self) -> int:
        return hash((id(self.store), self.key))

    def __lt__(self, other: "RemotePath") -> bool:
        return self.key < other.key

    def __truediv__(self, name: str) -> "RemotePath":
        joined = posixpath.normpath(posixpath.join(self.key, name)) if name else self.key
        return RemotePath(self.store, "" if joined == "." else joined)

    @property
    def name(self) -> str:
        return posixpath.basename(self.key)

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.name)[1]

    @property
    def stem(self) -> str:
        return posixpath.splitext(self.name)[0]

    @property
    def parent(self) -> "RemotePath":
        return RemotePath(self.store, posixpath.dirname(self.key), folder=True)

    @property
    def parents(self) -> tuple["RemotePath", ...]:
        found, current = [], self
        while current.key:
            current = current.parent
            found.append(current)
        return tuple(found)

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(self.key.split("/")) if self.key else ()

    def resolve(self) -> "RemotePath":
        return self  # no symlinks in object storage

    def is_symlink(self) -> bool:
        return False

    def is_relative_to(self, other: Union["RemotePath", object]) -> bool:
        return (isinstance(other, RemotePath) and other.store is self.store
                and (not other.key or self.key == other.key or self.key.startswith(other.key + "/")))

    @property
    def connections(self) -> int:
        """Requests its store keeps in flight at once (``RemoteOptions.connections``)."""
        return self.store.transport.options.connections

    def info(self) -> ObjectInfo:
        """The object's size and tag; a missing object is a :class:`CheckpointNotFoundError` naming its URL."""
        found = self.store.stat(self.key)
        if found is None:
            raise CheckpointNotFoundError("no such object", path=self)
        return found

    def is_file(self) -> bool:
        return self._folder is not True and self.key != "" and self.store.stat(self.key) is not None

    def is_dir(self) -> bool:
        if self._folder is not None:
            return self._folder
        return self.store.listing(self.key) is not None

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def iterdir(self) -> Iterator["RemotePath"]:
        found = self.store.listing(self.key)
        if found is None:
            raise CheckpointNotFoundError("no such folder", path=self)
        files, folders = found
        for name in folders:
            yield RemotePath(self.store, posixpath.join(self.key, name), folder=True)
        for name in files:
            yield RemotePath(self.store, posixpath.join(self.key, name), folder=False)

    def glob(self, pattern: str) -> Iterator["RemotePath"]:
        return (path for path in self.iterdir() if fnmatch.fnmatchcase(path.name, pattern))

    def stat(self) -> "_Stat":
        return _Stat(self.info().size)

    def read_at(self, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes from ``offset`` (fewer at the end of the object), as ``os.pread`` gives them."""
        size = self.info().size
        length = max(0, min(length, size - offset))
        if length == 0:
            return b""
        head = self._head(size)
        if offset + length <= len(head):
            return head[offset:offset + length]
        buffer = bytearray(length)
        self.store.read_into(self.key, offset, [memoryview(buffer)], tensor=None)
        return bytes(buffer)

    def _head(self, size: int) -> bytes:
        cached = _HEADS.get(self)
        if cached is None:
            buffer = bytearray(min(size, HEAD_BYTES))
            if buffer:
                self.store.read_into(self.key, 0, [memoryview(buffer)], tensor=None)
            cached = _HEADS.setdefault(self, bytes(buffer))
        return cached

    def read_bytes(self) -> bytes:
        return self.read_at(0, self.info().size)

    def read_text(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self.read_bytes().decode(encoding, errors)

    def open(self, mode: str = "rb", buffering: int = -1) -> io.BufferedReader:
        """A seekable binary file over ranged reads (the zip and pickle readers' way in)."""
        if mode != "rb":
            raise CheckpointError(f"a remote object opens for reading only, not {mode!r}", path=self)
        return io.BufferedReader(_RangedFile(self), buffer_size=1024 * 1024)


@dataclass(frozen=True)
class _Stat:
    st_size: int


class _HeadCache:
    """First bytes of remote objects already fetched, shared by the readers that sniff, then parse, a file."""

    def __init__(self) -> None:
        self._heads: dict[RemotePath, bytes] = {}
        self._lock = threading.Lock()

    def get(self, path: RemotePath) -> Optional[bytes]:
        with self._lock:
            return self._heads.get(path)

    def setdefault(self, path: RemotePath, head: bytes) -> bytes:
        with self._lock:
            if len(self._heads) > 64:  # a load reads a few files' heads; nothing needs them kept long
                self._heads.clear()
            return self._heads.setdefault(path, head)


_HEADS = _HeadCache()


class _RangedFile(io.RawIOBase):
    """A raw, seekable file over a remote object's ranged reads."""

    def __init__(self, path: RemotePath) -> None:
        super().__init__()
        self._path = path
        self._size = path.info().size
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise OSError(22, "negative seek position")
        self._position = base + offset
        return self._position

    def tell(self) -> int:
        return self._position

    def readinto(self, buffer) -> int:  # noqa: ANN001 (any writable buffer)
        view = memoryview(buffer).cast("B")
        length = max(0, min(len(view), self._size - self._position))
        if length:
            head = self._path._head(self._size)
            if self._position + length <= len(head):
                view[:length] = head[self._position:self._position + length]
            else:
                self._path.store.read_into(self._path.key, self._position, [view[:length]], tensor=None)
        self._position += length
        return length


def is_remote(path: object) -> bool:
    """Whether ``path`` is a :class:`RemotePath` (its bytes come from a store, not a local file)."""
    return isinstance(path, RemotePath)
