"""What the stand-in HTTP servers of these tests share (``RangeServer``, ``GcsServer``, ``AzureServer``,
``FakeHub``): a threading server on 127.0.0.1 that knows each connection it accepted and each thread it started,
the start and stop that leave no thread or socket behind, and what the cloud stand-ins (``GcsServer``,
``AzureServer``) share: :class:`CloudStandIn` (the request log, the token count, the ``with`` block, the folders
that are buckets or containers) and the single-range parser. Each server's own answers stay in its module."""

from __future__ import annotations

import os
import socket
import socketserver
import stat
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, BinaryIO, Optional

# Long enough for any thread of ours to notice a closed socket; a thread still alive after it is a leak.
JOIN_SECONDS = 10.0


class TrackedHTTPServer(ThreadingHTTPServer):
    """A server on a free port of 127.0.0.1 that knows each connection it accepted and each thread it started,
    so that closing ends them all: a kept-alive connection would otherwise hold its thread in a read until the
    client hangs up. ``owner`` is the stand-in its handlers ask (``handler.server.owner``); ``name`` starts the
    names of its threads."""

    daemon_threads = True
    block_on_close = False  # joined by stop_serving instead, after the open connections are shut down
    request_queue_size = 128  # parallel ranged GETs connect at once; a full backlog costs a 1 s SYN retry

    def __init__(self, handler: type[BaseHTTPRequestHandler], owner: Any, name: str) -> None:
        self.owner = owner
        self.name = name
        self.accepted = 0
        self._lock = threading.Lock()
        self._open_sockets: set[socket.socket] = set()
        self._handler_threads: list[threading.Thread] = []
        super().__init__(("127.0.0.1", 0), handler)

    def server_bind(self) -> None:
        # HTTPServer's own asks the resolver for a fully qualified name: a lookup a test has no use for.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                  name=f"{self.name}:{self.server_port} connection", daemon=True)
        with self._lock:
            self.accepted += 1
            self._open_sockets.add(request)
            self._handler_threads = [t for t in self._handler_threads if t.is_alive()] + [thread]
        thread.start()

    def shutdown_request(self, request: socket.socket) -> None:
        with self._lock:  # forgotten before it is closed, so close_connections never touches a closed socket
            self._open_sockets.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client hanging up, or close_connections: expected
            super().handle_error(request, client_address)

    def close_connections(self) -> list[threading.Thread]:
        """Shut down every open connection (each handler's read then sees the end); the threads to join."""
        with self._lock:
            for request in self._open_sockets:
                try:
                    request.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            return list(self._handler_threads)


def serve_in_thread(server: TrackedHTTPServer) -> threading.Thread:
    """Start ``server``'s accept loop on a daemon thread; ``stop_serving`` ends it."""
    # A short poll: shutdown() waits for it, and tests start and stop many servers.
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              name=f"{server.name}:{server.server_port}", daemon=True)
    thread.start()
    return thread


def stop_serving(server: TrackedHTTPServer, thread: threading.Thread) -> list[str]:
    """Stop accepting, close the listening socket and every open connection, and join the accept loop's thread
    and the handlers' (``JOIN_SECONDS`` each); the names of the threads still alive: a leak."""
    server.shutdown()  # no accept after this returns, so the thread list below is complete
    server.server_close()
    handlers = server.close_connections()
    thread.join(JOIN_SECONDS)
    for handler in handlers:
        handler.join(JOIN_SECONDS)
    return [t.name for t in [thread, *handlers] if t.is_alive()]


def single_range(header: Optional[str], size: int) -> Optional[tuple[int, int]]:
    """The first and last byte a single ``bytes=a-b`` (or ``a-``) asks of ``size`` bytes; ``None``: the whole
    object (no header, several ranges, a suffix range or bad syntax); raises ``ValueError`` for a range that starts
    past the end (416). Stricter than ``range_server.byte_range``, which takes suffixes and spaces."""
    if not header or not header.startswith("bytes=") or "," in header:
        return None
    first, _, last = header[len("bytes="):].strip().partition("-")
    if not first.isdigit() or (last and not last.isdigit()):
        return None
    start, end = int(first), int(last) if last else size - 1
    if end < start:
        return None
    if start >= size:
        raise ValueError("unsatisfiable")
    return start, min(end, size - 1)


class StandIn:
    """A stand-in server on 127.0.0.1 inside a ``with`` block, its ``handler`` class answering (a handler finds
    the stand-in as ``self.server.owner``); ``requests``, what it was asked (:meth:`_record`). A subclass names its
    handler class."""

    handler: type[BaseHTTPRequestHandler]  # set by the subclass (or its module, once the handler class exists)

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self._lock = threading.Lock()
        self._server: Optional[TrackedHTTPServer] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError(f"{type(self).__name__} runs only inside its with block")
        return self._server.server_port

    def __enter__(self):
        self._server = TrackedHTTPServer(self.handler, self, type(self).__name__)
        self._thread = serve_in_thread(self._server)
        return self

    def __exit__(self, *exc_info: object) -> None:
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        left = stop_serving(server, thread)
        self._server = self._thread = None
        if left and exc_info[0] is None:
            raise RuntimeError(f"{type(self).__name__} threads still alive after closing: {left}")

    def _record(self, seen: Any) -> None:
        with self._lock:
            self.requests.append(seen)


class CloudStandIn(StandIn):
    """A cloud store's stand-in over the folders under ``root`` (each a bucket or a container, each file below an
    object): the requests it answered (``requests``, :meth:`seen`), the tokens its token endpoint handed out
    (``issued``, ``tokens_issued``). A subclass names its handler class and sets ``root``, ``issued`` and
    ``requests`` in its ``__init__`` (after calling this one's)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens_issued = 0

    def seen(self, method: Optional[str] = None) -> list[Any]:
        with self._lock:
            return [r for r in self.requests if method is None or r.method == method]

    # --- what the handlers ask ----------------------------------------------------------------------------

    def _issue(self) -> Optional[str]:
        with self._lock:
            if self.issued is not None:
                self.tokens_issued += 1
        return self.issued

    def _folder(self, name: str) -> Optional[Path]:
        """The bucket (container) ``name``: a folder directly under ``root``; ``None`` where there is none."""
        folder = (self.root / name).resolve()
        return folder if folder.parent == self.root and folder.is_dir() else None

    def _open(self, folder: Path, name: str) -> Optional[BinaryIO]:
        """The object ``name`` of a bucket, opened; ``None`` for no such regular file inside it."""
        candidate = (folder / name).resolve()
        if folder not in candidate.parents or name.endswith("/"):
            return None
        try:
            file = open(candidate, "rb")
        except OSError:
            return None
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            file.close()
            return None
        return file
