"""A raw HTTP/1.1 server on 127.0.0.1 that answers each request as a script says, byte for byte: the answers no
well-behaved server library would send (a Content-Length longer than the body, headers a byte at a time, a
redirect to itself, an endless stall). Test code: the remote-safety tests point the loader at it."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

from tests.local_server import JOIN_SECONDS


@dataclass
class Seen:
    """One request as the server read it: its request line and headers (names lower-cased)."""

    line: str
    headers: dict[str, str]

    @property
    def path(self) -> str:
        return self.line.split(" ")[1] if " " in self.line else ""


@dataclass
class Reply:
    """What to send: ``pieces`` one after another, ``pause`` seconds before each; ``close``: hang up after."""

    pieces: list[bytes]
    pause: float = 0.0
    close: bool = False


def answer(status: int, body: bytes = b"", headers: Optional[dict[str, str]] = None, *, length: Optional[int] = None,
           close: bool = False) -> Reply:
    """An ordinary answer, sent at once; ``length``: the Content-Length to claim instead of the body's."""
    lines = [f"HTTP/1.1 {status} X"] + [f"{k}: {v}" for k, v in (headers or {}).items()]
    lines.append(f"Content-Length: {len(body) if length is None else length}")
    return Reply([("\r\n".join(lines) + "\r\n\r\n").encode() + body], close=close)


Script = Callable[[Seen], Optional[Reply]]  # None: stay silent (until the client or the server's end hangs up)


@dataclass
class MisbehavingServer:
    """Serves ``script`` on a free port of 127.0.0.1 inside a ``with`` block; ``seen`` lists every request."""

    script: Script
    seen: list[Seen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._clients: list[socket.socket] = []
        self._lock = threading.Lock()

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    def __enter__(self) -> "MisbehavingServer":
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        self._accepting.join(JOIN_SECONDS)
        with self._lock:
            for client in self._clients:
                try:
                    client.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            threads = list(self._threads)
        for thread in threads:
            thread.join(JOIN_SECONDS)
            assert not thread.is_alive(), "a connection thread outlived the server"
        self._listener.close()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(client,), daemon=True)
            with self._lock:
                self._clients.append(client)
                self._threads.append(thread)
            thread.start()

    def _serve(self, client: socket.socket) -> None:
        with client:
            try:
                first = client.recv(1, socket.MSG_PEEK)
            except OSError:
                return
            if first == b"\x16":  # a TLS hello: answered as a plain HTTP server answers one
                with self._lock:
                    self.seen.append(Seen("TLS hello", {}))
                client.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                return
            reader = client.makefile("rb")
            while not self._stopping.is_set():
                try:
                    line = reader.readline(65536).decode("latin-1").strip()
                except OSError:
                    return
                if not line:
                    return
                headers = {}
                while True:
                    raw = reader.readline(65536).decode("latin-1").strip()
                    if not raw:
                        break
                    name, _, value = raw.partition(":")
                    headers[name.strip().lower()] = value.strip()
                seen = Seen(line, headers)
                with self._lock:
                    self.seen.append(seen)
                reply = self.script(seen)
                if reply is None:
                    self._stopping.wait()  # silent until the test ends
                    return
                for piece in reply.pieces:
                    if reply.pause and self._stopping.wait(reply.pause):
                        return
                    try:
                        client.sendall(piece)
                    except OSError:
                        return
                if reply.close:
                    return


def drip(reply: Reply, pause: float) -> Reply:
    """``reply`` sent one byte at a time, ``pause`` seconds apart."""
    data = b"".join(reply.pieces)
    return Reply([data[i:i + 1] for i in range(len(data))], pause=pause, close=reply.close)

