"""What the stand-in HTTP servers of these tests share (``RangeServer``, ``GcsServer``, ``AzureServer``,
``FakeHub``): a threading server on 127.0.0.1 that knows each connection it accepted and each thread it started,
the start and stop that leave no thread or socket behind, and the single-range parser of the cloud stand-ins.
Each server's own answers stay in its module."""

from __future__ import annotations

import socket
import socketserver
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

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
