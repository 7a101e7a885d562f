"""A forward HTTP proxy on 127.0.0.1, as a company network puts one between its machines and the internet:
``CONNECT host:port`` tunnels (what ``https://`` goes through, bytes relayed both ways, TLS end to end) and
requests whose target is a whole ``http://`` URL (answered by asking the origin). With ``credentials`` it
answers 407 to any request without that ``Proxy-Authorization``. Test code: the streaming tests point
``HTTPS_PROXY`` and ``HTTP_PROXY`` at it."""

from __future__ import annotations

import base64
import http.client
import selectors
import socket
from http.server import BaseHTTPRequestHandler
from typing import Optional
from urllib.parse import urlsplit

from tests.local_server import StandIn, TrackedHTTPServer

_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authorization", "proxy-connection", "te", "trailer",
                         "transfer-encoding", "upgrade"})


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: TrackedHTTPServer

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _admitted(self) -> bool:
        owner: ForwardProxy = self.server.owner
        owner._record((self.command, self.path))
        if owner.credentials is None or self.headers.get("Proxy-Authorization") == owner.credentials:
            return True
        self.send_response(407)
        self.send_header("Proxy-Authenticate", 'Basic realm="proxy"')
        self.send_header("Content-Length", "0")
        self.end_headers()
        self.close_connection = True
        return False

    def do_CONNECT(self) -> None:
        if not self._admitted():
            return
        host, _, port = self.path.rpartition(":")
        try:
            upstream = socket.create_connection((host, int(port)), timeout=10)
        except OSError:
            self.send_response(502)
            self.send_header("Content-Length", "0")
            self.end_headers()
            self.close_connection = True
            return
        self.send_response(200, "Connection established")
        self.end_headers()
        self.close_connection = True  # the tunnel is the connection's last use
        try:
            _relay(self.connection, upstream)
        finally:
            upstream.close()

    def do_GET(self) -> None:
        self._forward()

    def do_HEAD(self) -> None:
        self._forward()

    def _forward(self) -> None:
        if not self._admitted():
            return
        target = urlsplit(self.path)
        if target.scheme != "http" or not target.hostname:
            self.send_response(400)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        origin = http.client.HTTPConnection(target.hostname, target.port or 80, timeout=10)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            origin.request(self.command, (target.path or "/") + (f"?{target.query}" if target.query else ""),
                           headers=headers)
            answer = origin.getresponse()
            body = answer.read()
        finally:
            origin.close()
        self.send_response(answer.status, answer.reason)
        for name, value in answer.getheaders():
            if name.lower() not in _HOP_BY_HOP and name.lower() not in ("server", "date", "content-length"):
                self.send_header(name, value)
        self.send_header("Content-Length", answer.getheader("Content-Length") or str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def _relay(client: socket.socket, upstream: socket.socket) -> None:
    """Bytes both ways until either side closes (a closed proxy shuts the client's socket down)."""
    peer = {client: upstream, upstream: client}
    with selectors.DefaultSelector() as selector:
        selector.register(client, selectors.EVENT_READ)
        selector.register(upstream, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                try:
                    data = key.fileobj.recv(1 << 16)
                    if not data:
                        return
                    peer[key.fileobj].sendall(data)
                except OSError:
                    return


class ForwardProxy(StandIn):
    """The proxy, inside a ``with`` block: ``url`` (``http://127.0.0.1:PORT``), ``requests`` (``(method,
    target)`` of each request it was asked, tunnels as ``("CONNECT", "host:port")``)."""

    handler = _ProxyHandler

    def __init__(self, *, user: Optional[str] = None, password: str = "") -> None:
        super().__init__()
        self.credentials = None if user is None else \
            "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
