"""The HTTP clients ``bench.http_clients`` compares, each reading byte ranges of a file into a caller's buffer.

One class per candidate, the way its library is meant to be used for a
streamed body; each instance is one kept-alive connection, so N threads with
an instance each hold N connections. ``CANDIDATES`` says, per candidate, how
its bytes reach the buffer, as read from the library's installed source.
"""

from __future__ import annotations

import http.client
import socket
import struct
from dataclasses import dataclass
from typing import Callable, Protocol
from urllib.parse import urlsplit

MiB = 2**20


class Client(Protocol):
    """One connection of one candidate: fills a view with a byte range of a file."""

    def fetch(self, path: str, start: int, view: memoryview) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Candidate:
    name: str
    label: str
    writes: str  # how the bytes reach the buffer, read from the library's source


CANDIDATES = [
    Candidate("stdlib-readinto", "http.client `HTTPResponse.readinto(view)`",
              "straight in: `BufferedReader.readinto` of a request larger than its buffer calls `recv_into` on the "
              "destination; no Python bytes"),
    Candidate("stdlib-waitall", "http.client headers, then `recv_into(view, MSG_WAITALL)`",
              "straight in, one system call a part: the body bytes that came with the headers out of http.client's "
              "buffer, the rest by `socket.recv_into(..., MSG_WAITALL)` on the connection's socket (blocking, "
              "`SO_RCVTIMEO` for the timeout), the GIL released once a part"),
    Candidate("urllib3-readinto", "urllib3 `HTTPResponse.readinto(view)`",
              "through bytes: `readinto` is `read(len(b))` (http.client `read(amt)`: a new 16 MiB bytes object a "
              "part) then `b[:n] = data`"),
    Candidate("urllib3-read", "urllib3 `read(amt)` + copy",
              "through bytes: the same 16 MiB bytes object a part (`read(amt)` returns it whole from its "
              "decoded-content queue), copied into the view by us"),
    Candidate("requests", "requests `iter_content(1 MiB)` + copy",
              "through bytes: urllib3 `stream` reads 1 MiB bytes objects (http.client `read(amt)`), each copied "
              "into the view"),
    Candidate("httpx", "httpx `iter_raw()` + copy",
              "through bytes, 4 copies: httpcore `recv(64 KiB)`, h11 appends to its bytearray, slices it out, "
              "`bytes()` of the slice, then our copy; Python per 64 KiB"),
]


# The candidates. Each thread makes its own client, so N threads hold N kept-alive connections.

class StdlibReadinto:
    def __init__(self, base: str) -> None:
        split = urlsplit(base)
        self.connection = http.client.HTTPConnection(split.hostname, split.port, timeout=60)

    def fetch(self, path: str, start: int, view: memoryview) -> None:
        self.connection.request("GET", path, headers=_range(start, len(view)))
        response = self.connection.getresponse()
        _expect_partial(response.status)
        filled = 0
        while filled < len(view):
            got = response.readinto(view[filled:])
            if not got:
                raise EOFError(f"{path}: {filled} of {len(view)} bytes at {start}")
            filled += got

    def close(self) -> None:
        self.connection.close()


class StdlibWaitall(StdlibReadinto):
    """http.client for the request and headers; the body by one blocking ``recv_into`` that waits for all of it.

    ``BufferedReader.readinto`` returns to Python for every ``recv`` (what the
    socket holds at that moment: tens to hundreds of KB on loopback), taking
    the GIL back each time; ``MSG_WAITALL`` lets the kernel fill the whole part
    before the thread wants the GIL again. The socket must be blocking for
    that (a Python timeout makes it non-blocking), so the timeout moves to
    ``SO_RCVTIMEO``.
    """

    TIMEOUT = struct.pack("ll", 60, 0)

    def fetch(self, path: str, start: int, view: memoryview) -> None:
        self.connection.request("GET", path, headers=_range(start, len(view)))
        response = self.connection.getresponse()
        _expect_partial(response.status)
        filled = response.readinto(view[:min(len(response.fp.peek(1)), len(view))])
        sock = self.connection.sock
        if sock.gettimeout() is not None:
            sock.settimeout(None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, self.TIMEOUT)
        while filled < len(view):
            got = sock.recv_into(view[filled:], len(view) - filled, socket.MSG_WAITALL)
            if not got:
                raise EOFError(f"{path}: {filled} of {len(view)} bytes at {start}")
            filled += got
        response.length = 0  # its bytes were read past it: let it close, so the connection takes the next request
        response.read()


class Urllib3:
    def __init__(self, base: str, readinto: bool) -> None:
        import urllib3

        split = urlsplit(base)
        self.pool = urllib3.HTTPConnectionPool(split.hostname, split.port, maxsize=1, retries=False, timeout=60.0)
        self.readinto = readinto

    def fetch(self, path: str, start: int, view: memoryview) -> None:
        response = self.pool.request("GET", path, headers=_range(start, len(view)), preload_content=False)
        try:
            _expect_partial(response.status)
            filled = 0
            while filled < len(view):
                if self.readinto:
                    got = response.readinto(view[filled:])
                else:
                    data = response.read(len(view) - filled)
                    got = len(data)
                    view[filled:filled + got] = data
                if not got:
                    raise EOFError(f"{path}: {filled} of {len(view)} bytes at {start}")
                filled += got
        finally:
            response.release_conn()

    def close(self) -> None:
        self.pool.close()


class Requests:
    CHUNK = 1 * MiB

    def __init__(self, base: str) -> None:
        import requests

        self.base = base
        self.session = requests.Session()

    def fetch(self, path: str, start: int, view: memoryview) -> None:
        with self.session.get(self.base + path, headers=_range(start, len(view)), stream=True, timeout=60) as response:
            _expect_partial(response.status_code)
            filled = 0
            for chunk in response.iter_content(chunk_size=self.CHUNK):
                view[filled:filled + len(chunk)] = chunk
                filled += len(chunk)
            _expect_filled(filled, view, path, start)

    def close(self) -> None:
        self.session.close()


class Httpx:
    def __init__(self, base: str) -> None:
        self.base = base
        self.client = _httpx().Client(timeout=60.0)

    def fetch(self, path: str, start: int, view: memoryview) -> None:
        with self.client.stream("GET", self.base + path, headers=_range(start, len(view))) as response:
            _expect_partial(response.status_code)
            filled = 0
            for chunk in response.iter_raw():
                view[filled:filled + len(chunk)] = chunk
                filled += len(chunk)
            _expect_filled(filled, view, path, start)

    def close(self) -> None:
        self.client.close()


def _httpx():
    """httpx, under the name it is installed as here (httpx2 is its renamed successor)."""
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx
    return httpx


MAKERS: dict[str, Callable[[str], Client]] = {
    "stdlib-readinto": StdlibReadinto,
    "stdlib-waitall": StdlibWaitall,
    "urllib3-readinto": lambda base: Urllib3(base, readinto=True),
    "urllib3-read": lambda base: Urllib3(base, readinto=False),
    "requests": Requests,
    "httpx": Httpx,
}


def _range(start: int, length: int) -> dict[str, str]:
    return {"Range": f"bytes={start}-{start + length - 1}"}


def _expect_partial(status: int) -> None:
    if status != 206:
        raise RuntimeError(f"expected 206 Partial Content, got {status}")


def _expect_filled(filled: int, view: memoryview, path: str, start: int) -> None:
    if filled != len(view):
        raise EOFError(f"{path}: {filled} of {len(view)} bytes at {start}")

