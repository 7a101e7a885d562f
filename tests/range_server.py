"""A static file server with what object stores and CDNs offer: byte ranges, strong ETags, keep-alive, a bearer
token and redirects to another host. Test code: the streaming tests read checkpoints from it over real sockets."""

from __future__ import annotations

import email.utils
import mimetypes
import os
import re
import ssl
import stat
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import BinaryIO, Mapping, NamedTuple, Optional
from urllib.parse import unquote, urlsplit

from tests.local_server import TrackedHTTPServer, serve_in_thread, stop_serving


class RequestRecord(NamedTuple):
    """One request a ``RangeServer`` saw (a tuple: ``method, path, range_header, headers``)."""

    method: str
    path: str
    range: Optional[str]
    headers: dict[str, str]


class _Unsatisfiable(Exception):
    """A range that starts past the end of the file: 416, not the whole file."""


_RANGE = re.compile(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*")


def byte_range(header: Optional[str], size: int) -> Optional[tuple[int, int]]:
    """The first and last byte (inclusive) a ``Range`` header asks of a file of ``size`` bytes; ``None`` for the
    whole file: no header, or one a server may ignore (several ranges, bad syntax), as RFC 9110 lets it.
    Raises ``_Unsatisfiable`` for a range that starts at or past the end, or an empty suffix."""
    match = _RANGE.fullmatch(header) if header else None
    if match is None:
        return None
    first, last = match.groups()
    if not first and not last:
        return None
    if not first:  # a suffix: the last n bytes
        suffix = int(last)
        if suffix == 0 or size == 0:
            raise _Unsatisfiable
        return max(0, size - suffix), size - 1
    start = int(first)
    end = int(last) if last else size - 1
    if last and end < start:
        return None
    if start >= size:
        raise _Unsatisfiable
    return start, min(end, size - 1)


def strong_etag(info: os.stat_result) -> str:
    """A strong entity tag that changes when the file is rewritten or replaced: size, mtime and inode."""
    return f'"{info.st_size:x}-{info.st_mtime_ns:x}-{info.st_ino:x}"'


def _if_match_fails(header: Optional[str], etag: str) -> bool:
    """Strong comparison, as If-Match requires: a weak tag never matches."""
    if header is None:
        return False
    tags = [tag.strip() for tag in header.split(",")]
    return "*" not in tags and etag not in tags


class _RangeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: every answer below carries a Content-Length
    disable_nagle_algorithm = True  # headers and a small body go out at once, not after the peer's delayed ACK
    server: TrackedHTTPServer

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def _answer(self, *, send_body: bool) -> None:
        owner = self.server.owner
        owner._record(RequestRecord(self.command, self.path, self.headers.get("Range"), dict(self.headers)))
        if owner.token is not None and self.headers.get("Authorization") != f"Bearer {owner.token}":
            self._plain(401, "a bearer token is required\n", send_body, {"WWW-Authenticate": "Bearer"})
            return
        raw_path, _, query = self.path.partition("?")
        location = owner._redirect_for(raw_path, query)
        if location is None and owner.folder_redirects and owner._is_folder(raw_path):
            if raw_path.endswith("/"):
                self._plain(403, "no listing of a folder\n", send_body)
            else:
                self._plain(301, "", send_body, {"Location": raw_path + "/" + (f"?{query}" if query else "")})
            return
        if location is not None:
            self._redirect(location, raw_path, send_body)
            return
        opened = owner._open(raw_path)
        if opened is None:
            self._plain(owner.missing_status, "no such file\n", send_body)
            return
        with opened as file:
            self._file(file, send_body)

    def _file(self, file: BinaryIO, send_body: bool) -> None:
        info = os.fstat(file.fileno())  # of the open file: the tag names the bytes sent, even if the path is replaced
        etag = strong_etag(info)
        if _if_match_fails(self.headers.get("If-Match"), etag):
            self._plain(412, "the file's ETag does not match If-Match\n", send_body, {"ETag": etag})
            return
        size = info.st_size
        try:
            wanted = byte_range(self.headers.get("Range"), size)
        except _Unsatisfiable:
            self._plain(416, "range not satisfiable\n", send_body, {"Content-Range": f"bytes */{size}", "ETag": etag})
            return
        start, end = wanted if wanted is not None else (0, size - 1)
        self.send_response(206 if wanted is not None else 200)
        if wanted is not None:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Content-Type", mimetypes.guess_type(self.path.partition("?")[0])[0] or "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", etag)
        self.send_header("Last-Modified", email.utils.formatdate(info.st_mtime, usegmt=True))
        self.end_headers()
        if send_body and end >= start:
            try:
                self.connection.sendfile(file, start, end - start + 1)
            except OSError:  # the client went away mid-body: this connection is done, nothing to report
                self.close_connection = True

    def _redirect(self, location: str, raw_path: str, send_body: bool) -> None:
        # The hub names the target's size and tag on the redirect itself; harmless where the target is elsewhere.
        linked: dict[str, str] = {}
        opened = self.server.owner._open_redirect_target(location, raw_path)
        if opened is not None:
            with opened as file:
                info = os.fstat(file.fileno())
            linked = {"X-Linked-Size": str(info.st_size), "X-Linked-ETag": strong_etag(info)}
        self._plain(302, "", send_body, {"Location": location, **linked})

    def _plain(self, status: int, text: str, send_body: bool, headers: Optional[Mapping[str, str]] = None) -> None:
        body = text.encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body and body:
            try:
                self.wfile.write(body)
            except OSError:
                self.close_connection = True


class RangeServer:
    """A static file server over ``root`` with what object stores and CDNs offer: single byte ranges, a strong
    ETag and ``If-Match``, keep-alive, an optional bearer token, and redirects to another host.

    ``redirects`` maps a path prefix to a URL prefix: a request whose path starts with a key is answered
    ``302`` to the value plus the rest of the path (the hub sends ``resolve/`` URLs to a CDN that way).
    ``requests`` lists every request seen, in order; ``connections`` counts the TCP connections accepted.
    """

    def __init__(self, root: Path, *, token: Optional[str] = None, redirects: Optional[Mapping[str, str]] = None,
                 tls: Optional["ssl.SSLContext"] = None, folder_redirects: bool = False,
                 missing_status: int = 404) -> None:
        self.root = Path(root).resolve()
        # 403 for what is not there, file or folder alike: S3 (and stores like it) answer so a reader that may
        # not list the bucket, so that a missing key and a refused one look the same.
        self.missing_status = missing_status
        # As nginx answers a folder without a listing: its path without the "/" redirected to the path with it,
        # and that refused (403). Otherwise both are 404, as a server that has no folders to speak of answers.
        self.folder_redirects = folder_redirects
        self.tls = tls  # a server context: answers over HTTPS (the handshake on accept)
        self.token = token
        # Longest prefix first, so that a specific rule wins over a general one whatever the map's order.
        self.redirects = dict(sorted((redirects or {}).items(), key=lambda item: -len(item[0])))
        self.requests: list[RequestRecord] = []
        self._requests_lock = threading.Lock()
        self._server: Optional[TrackedHTTPServer] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``, no trailing slash."""
        if self._server is None:
            raise RuntimeError("the server runs only inside its with block")
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self._server.server_port}"

    @property
    def connections(self) -> int:
        """TCP connections accepted so far: 1 after many requests means keep-alive worked."""
        return self._server.accepted if self._server is not None else 0

    def __enter__(self) -> "RangeServer":
        self._server = TrackedHTTPServer(_RangeHandler, self, "RangeServer")
        if self.tls is not None:
            self._server.socket = self.tls.wrap_socket(self._server.socket, server_side=True)
        self._thread = serve_in_thread(self._server)
        return self

    def __exit__(self, *exc_info: object) -> None:
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        # The server is kept, unlike the cloud stand-ins', so that ``connections`` still answers after the block.
        left = stop_serving(server, thread)
        if left and exc_info[0] is None:
            raise RuntimeError(f"RangeServer threads still alive after closing: {left}")

    def _record(self, record: RequestRecord) -> None:
        with self._requests_lock:
            self.requests.append(record)

    def _redirect_for(self, raw_path: str, query: str) -> Optional[str]:
        for prefix, target in self.redirects.items():
            if raw_path.startswith(prefix):
                return target + raw_path[len(prefix):] + (f"?{query}" if query else "")
        return None

    def _is_folder(self, raw_path: str) -> bool:
        candidate = (self.root / unquote(raw_path).lstrip("/")).resolve()
        return (candidate == self.root or self.root in candidate.parents) and candidate.is_dir()

    def _open(self, raw_path: str) -> Optional[BinaryIO]:
        """The regular file at a URL path under ``root``, opened; ``None`` for a folder, a missing file, or a
        path that leaves ``root``."""
        candidate = (self.root / unquote(raw_path).lstrip("/")).resolve()
        if candidate != self.root and self.root not in candidate.parents:
            return None
        try:
            file = open(candidate, "rb")
        except OSError:  # missing, a folder (IsADirectoryError), unreadable
            return None
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            file.close()
            return None
        return file

    def _open_redirect_target(self, location: str, raw_path: str) -> Optional[BinaryIO]:
        """The file a redirect leads to, where this server holds it too: at the Location's path (two servers
        over one root), else at the request's own path."""
        for path in (urlsplit(location).path, raw_path):
            opened = self._open(path)
            if opened is not None:
                return opened
        return None
