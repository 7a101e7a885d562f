"""An HTTP/1.1 proxy that relays byte for byte and misbehaves on request: resets, stalls, S3 throttling, server
errors, latency and a bandwidth cap. Test code: the streaming tests put it between the loader and a server."""

from __future__ import annotations

import collections
import selectors
import socket
import struct
import threading
import time
from typing import BinaryIO, Optional
from urllib.parse import urlsplit

from tests.http_messages import Head, answer_framing, body_pieces, read_head, request_framing, status_code
from tests.local_server import JOIN_SECONDS

_SLOWDOWN_BODY = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
_SERVER_ERROR_BODY = b"Internal Server Error\n"


class _Pacer:
    """A byte budget shared by every connection: no more than ``rate`` bytes in any ``t`` seconds, ``rate * t``."""

    def __init__(self, rate: float, stopping: threading.Event) -> None:
        self.rate = rate
        self._stopping = stopping
        self._lock = threading.Lock()
        self._free_at = time.monotonic()

    def take(self, count: int) -> bool:
        """Wait until ``count`` more bytes may go; ``False`` when the proxy stops first."""
        with self._lock:
            now = time.monotonic()
            self._free_at = max(now, self._free_at) + count / self.rate
            due = self._free_at
        return not self._stopping.wait(max(0.0, due - time.monotonic()))


class _Connection:
    """One client connection and the kept-alive upstream connection that serves it."""

    def __init__(self, proxy: "FaultProxy", client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.client_reader = client.makefile("rb")
        self.upstream: Optional[socket.socket] = None
        self.upstream_reader: Optional[BinaryIO] = None

    def serve(self) -> None:
        try:
            while not self.proxy._stopping.is_set():
                request = read_head(self.client_reader, skip_blank_lines=True)
                if request is None or not self._answer(request) or request.has("connection", "close"):
                    break
        except (OSError, ValueError):  # either side hung up, or the proxy stopped: the connection ends
            pass
        finally:
            self._drop_upstream()
            self.proxy._close(self.client, self.client_reader)

    def _answer(self, request: Head) -> bool:
        """Answer one request; ``False`` when the client connection must end after it."""
        proxy = self.proxy
        method = request.start.split(" ", 1)[0].upper()
        replaced = proxy._arrived(method)
        framing, length = request_framing(request)
        has_body = framing == "chunked" or length > 0
        if has_body and request.has("expect", "100-continue"):
            # Answered here, so the client sends its body now; the upstream's own 100 is dropped below.
            self.client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        if proxy.latency and not proxy._delay():
            return False
        if replaced is not None:
            for _ in body_pieces(self.client_reader, framing, length, 1 << 16):
                pass
            status, kind, body, extra = replaced
            self.client.sendall(
                f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode()
                + body)
            return True
        answer = self._forward(request, framing, length, has_body)
        if answer is None:
            body = b"the upstream server could not be reached\n"
            self.client.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                                + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            return False
        return self._relay(method, answer)

    def _forward(self, request: Head, framing: str, length: int, has_body: bool) -> Optional[Head]:
        """Send the request upstream verbatim; the upstream's answer head (interim 1xx answers skipped). A
        kept-alive upstream connection the server closed meanwhile is replaced once, where nothing is lost
        by sending again (no body)."""
        for _ in range(2):
            reused = self.upstream is not None
            if not reused and not self._connect_upstream():
                return None
            assert self.upstream is not None and self.upstream_reader is not None
            try:
                self.upstream.sendall(request.raw)
                if has_body:
                    for data in body_pieces(self.client_reader, framing, length, 1 << 16):
                        self.upstream.sendall(data)
                answer = read_head(self.upstream_reader)
                while answer is not None and 100 <= status_code(answer) < 200:
                    answer = read_head(self.upstream_reader)
            except (ConnectionResetError, BrokenPipeError):
                answer = None
            if answer is not None:
                return answer
            self._drop_upstream()
            if not reused or has_body or self.proxy._stopping.is_set():
                return None
        return None

    def _relay(self, method: str, answer: Head) -> bool:
        proxy = self.proxy
        framing, length = answer_framing(answer, no_body=method == "HEAD" or status_code(answer) in (204, 304))
        upstream_closes = (framing == "close" or answer.has("connection", "close")
                           or (answer.start.startswith("HTTP/1.0") and not answer.has("connection", "keep-alive")))
        fault = proxy._body_fault(method, framing, length)
        piece = proxy._piece
        self.client.sendall(answer.raw)
        sent = 0
        assert self.upstream_reader is not None
        for data in body_pieces(self.upstream_reader, framing, length, piece):
            if fault is not None and sent + len(data) >= fault[1]:
                data = data[:fault[1] - sent]
            if data and proxy._pacer is not None and not proxy._pacer.take(len(data)):
                return False
            self.client.sendall(data)
            sent += len(data)
            if fault is not None and sent >= fault[1]:
                self._drop_upstream()  # the rest of its body is never read
                if fault[0] == "stall_after":
                    proxy._stopping.wait()  # the client waits for bytes that never come, until the proxy stops
                else:
                    self.client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.proxy._close(self.client, self.client_reader)  # linger 0: a reset, not an orderly end
                return False
        if upstream_closes:
            self._drop_upstream()
        return framing != "close"  # a body that ends with the connection ends the client's too

    def _connect_upstream(self) -> bool:
        try:
            upstream = socket.create_connection(self.proxy._upstream, timeout=10)
        except OSError:
            return False
        upstream.settimeout(None)  # blocking from here on; stopping shuts it down to end a read
        upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self.proxy._adopt(upstream):
            upstream.close()
            return False
        self.upstream, self.upstream_reader = upstream, upstream.makefile("rb")
        return True

    def _drop_upstream(self) -> None:
        if self.upstream is not None:
            self.proxy._close(self.upstream, self.upstream_reader)
        self.upstream = self.upstream_reader = None


class FaultProxy:
    """An HTTP/1.1 proxy in front of ``upstream`` (``http://host:port``) that relays requests and answers
    byte for byte (Host included: S3 signatures cover it), except where told to misbehave.

    Faults apply to GETs, counted in arrival order over all connections:

    - ``slowdown=n``: the first n GETs get S3's ``503 SlowDown`` (``Retry-After: 0``), not forwarded;
      ``server_errors=n``: the next n GETs a plain ``500``, not forwarded.
    - ``reset_after=(n, b)``: the first n forwarded GETs whose answer body is longer than b bytes get the
      head and b bytes of the body, then a TCP reset; ``stall_after=(n, b)``: the next n such answers stop
      after b bytes and the connection stays open, silent, until the proxy stops.
    - ``latency=s``: every answer waits s seconds before its first byte; ``rate=bytes_per_second``: answer
      bodies share one budget over all connections.

    ``injected`` counts each fault by its keyword; ``requests`` counts the requests seen, of any method.
    """

    def __init__(self, upstream: str, *, reset_after: Optional[tuple[int, int]] = None, slowdown: int = 0,
                 server_errors: int = 0, latency: float = 0.0, rate: Optional[float] = None,
                 stall_after: Optional[tuple[int, int]] = None) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"FaultProxy relays plain http://host:port, not {upstream!r}")
        self._upstream = (parts.hostname, parts.port or 80)
        self._left = collections.Counter({"slowdown": slowdown, "server_errors": server_errors,
                                          "reset_after": reset_after[0] if reset_after else 0,
                                          "stall_after": stall_after[0] if stall_after else 0})
        self._body_bytes = {"reset_after": reset_after[1] if reset_after else 0,
                            "stall_after": stall_after[1] if stall_after else 0}
        self.latency = latency
        self.injected: collections.Counter[str] = collections.Counter()
        self.requests = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._pacer = _Pacer(rate, self._stopping) if rate else None
        # Pieces of ~50 ms at the given rate, so that pacing is smooth rather than in bursts.
        self._piece = max(1024, min(1 << 16, int(rate / 20))) if rate else 1 << 18
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._listener: Optional[socket.socket] = None
        self._wake: Optional[tuple[socket.socket, socket.socket]] = None
        self._accepter: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``, no trailing slash."""
        if self._listener is None:
            raise RuntimeError("the proxy runs only inside its with block")
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def __enter__(self) -> "FaultProxy":
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self._wake = socket.socketpair()
        port = self._listener.getsockname()[1]
        self._accepter = threading.Thread(target=self._accept_loop, name=f"FaultProxy:{port}", daemon=True)
        self._accepter.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._listener is None or self._wake is None or self._accepter is None:
            return
        self._stopping.set()
        self._wake[1].send(b"\0")
        self._accepter.join(JOIN_SECONDS)
        self._listener.close()
        with self._lock:  # after this no connection adopts a socket (see _adopt), so the lists are complete
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            threads = [self._accepter, *self._threads]
        for thread in threads:
            thread.join(JOIN_SECONDS)
        for end in self._wake:
            end.close()
        left = [t.name for t in threads if t.is_alive()]
        if left and exc_info[0] is None:
            raise RuntimeError(f"FaultProxy threads still alive after closing: {left}")

    def _accept_loop(self) -> None:
        assert self._listener is not None and self._wake is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(self._wake[0], selectors.EVENT_READ)
            while not self._stopping.is_set():
                selector.select()
                if self._stopping.is_set():
                    break
                try:
                    client, _ = self._listener.accept()
                except OSError:
                    continue
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                thread = threading.Thread(target=self._serve, args=(client,), daemon=True,
                                          name=f"FaultProxy:{self._listener.getsockname()[1]} connection")
                with self._lock:
                    if self._stopping.is_set():
                        client.close()
                        break
                    self._sockets.add(client)
                    self._threads = [t for t in self._threads if t.is_alive()] + [thread]
                    thread.start()

    def _serve(self, client: socket.socket) -> None:
        _Connection(self, client).serve()

    def _adopt(self, sock: socket.socket) -> bool:
        """Track a socket, so that stopping shuts it down; ``False`` once the proxy is stopping."""
        with self._lock:
            if self._stopping.is_set():
                return False
            self._sockets.add(sock)
            return True

    def _close(self, sock: socket.socket, reader: Optional[BinaryIO]) -> None:
        with self._lock:  # forgotten before it is closed, so stopping never shuts down a closed socket
            self._sockets.discard(sock)
        if reader is not None:
            reader.close()  # the socket's file descriptor stays open while a makefile() reader holds it
        sock.close()

    def _arrived(self, method: str) -> Optional[tuple[str, str, bytes, str]]:
        """Count a request; for a GET that a fault answers in the upstream's place: status, content type,
        body and extra header lines."""
        with self._lock:
            self.requests += 1
            if method != "GET":
                return None
            for kind in ("slowdown", "server_errors"):
                if self._left[kind] > 0:
                    self._left[kind] -= 1
                    self.injected[kind] += 1
                    if kind == "slowdown":
                        return "503 Slow Down", "application/xml", _SLOWDOWN_BODY, "Retry-After: 0\r\n"
                    return "500 Internal Server Error", "text/plain", _SERVER_ERROR_BODY, ""
        return None

    def _body_fault(self, method: str, framing: str, length: int) -> Optional[tuple[str, int]]:
        """The fault this answer's body gets, if any: its kind and after how many body bytes."""
        if method != "GET":
            return None
        with self._lock:
            for kind in ("reset_after", "stall_after"):
                after = self._body_bytes[kind]
                # Only a body longer than that, so that the fault lands mid-body, never after a complete answer.
                if self._left[kind] > 0 and (framing != "length" or length > after):
                    self._left[kind] -= 1
                    self.injected[kind] += 1
                    return kind, after
        return None

    def _delay(self) -> bool:
        """Wait ``latency`` seconds; ``False`` when the proxy stops first."""
        with self._lock:
            self.injected["latency"] += 1
        return not self._stopping.wait(self.latency)
