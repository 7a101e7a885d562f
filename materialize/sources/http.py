"""Ranged GETs written straight into the caller's memory, over kept-alive connections.

The data path is the standard library's ``http.client``: its
``HTTPResponse.readinto`` receives a body into the buffer it is given (the
socket's ``recv_into``, the GIL released), so a tensor's bytes go from the
socket to the tensor's memory with no Python object between; the
candidates that hand out ``bytes`` (urllib3's ``read``, requests, httpx)
cost a copy and a GIL-held allocation per chunk (numbers in docs/speed.md).
What the stores need beyond bytes (credentials, signing, listings) comes
from their own libraries; this module moves bytes, and the small answers
(a listing page, an object's metadata) of a store whose API is plain HTTP.

Requests go through the proxy the environment names, as curl, requests and
huggingface_hub send them: ``HTTPS_PROXY`` for ``https://`` (a ``CONNECT``
tunnel, TLS end to end with the server), ``HTTP_PROXY`` for ``http://`` (the
whole URL asked of the proxy), none for a host ``NO_PROXY`` lists; credentials
in the proxy's URL (``http://user:password@proxy:3128``) are sent to it alone.
An ``https://`` or SOCKS proxy is refused in one line.

Every request has a deadline: its status line and headers must arrive
within ``RemoteOptions.timeout`` seconds, and its body must then average
``RemoteOptions.min_rate`` bytes a second once it has run that long; a
watchdog thread cuts off a request that falls behind (a server sending one
byte a second holds no load), and it is retried as a timeout is. Headers the
caller gives (credentials, cookies, a token of the user's) go to the
origin (scheme, host, port) they were given for, never to another a
redirect leads to.

Every GET names the byte range it wants and, where the object's tag is
known, ``If-Match`` it, and its answer must say the same range of an
object of the same size and tag: an object rewritten during a load is an
error, never a model of two versions. A reset connection, a timeout, a 5xx
or a SlowDown answer is retried with exponential backoff, and the retry asks
only for the bytes not yet received. Each error names the URL and the range.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import random
import re
import socket
import ssl
import struct
import threading
import time
import urllib.request
from collections.abc import Mapping
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Optional
from urllib.parse import SplitResult, unquote, urljoin, urlsplit

from ..errors import CheckpointAccessError, CheckpointError, CheckpointNotFoundError
from ..text import shown_url
from .settings import RemoteOptions

logger = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
REDIRECT_STATUS = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS = 10
BACKOFF_FIRST = 0.25  # seconds before the first retry; doubled each time, with full jitter
BACKOFF_MOST = 20.0
RETRY_AFTER_MOST = 60.0
ERROR_BODY_BYTES = 4096  # of an error answer, read for its message
# A body is received at most this much per call: a call cut short by a reset reports no count (the bytes it
# received are in place, but unknown), so a retry resumes after the last whole call; larger calls only save
# calls, at a microsecond or two each.
RECEIVE_BYTES = 1024 * 1024
SMALL_BODY_BYTES = 64 * 1024 * 1024  # of a whole answer :meth:`Transport.get` reads (a listing page, metadata)

Target = Callable[[], tuple[str, dict[str, str]]]  # the URL and headers of a request, made anew for each (signatures expire)


@dataclass
class Answer:
    """An answer's status and headers (names lower-cased), and the URL that gave it after redirects."""

    status: int
    headers: dict[str, str]
    url: str
    body: bytes = b""


class _Watch:
    """One request as the :class:`_Watchdog` follows it: when it began, when its body began, bytes received."""

    __slots__ = ("connection", "started", "body_started", "received", "cut")

    def __init__(self) -> None:
        self.connection: Optional[http.client.HTTPConnection] = None
        self.started = time.monotonic()
        self.body_started: Optional[float] = None
        self.received = 0
        self.cut: Optional[str] = None  # why the watchdog cut the request off

    def begin(self, connection: http.client.HTTPConnection) -> None:
        """A request (or a redirect's next one) is about to be sent on ``connection``: its clock starts."""
        self.connection, self.started, self.body_started, self.received = connection, time.monotonic(), None, 0

    def why(self, exc: BaseException) -> str:
        """The failure in words: the watchdog's reason where it cut the request off, else ``exc`` described."""
        return self.cut or _describe(exc)


class _Watchdog:
    """Cuts off the requests that run out of time (see the module docstring): one thread, while any is watched.

    Cutting shuts the socket down, which wakes a receive blocked in it; the
    request then fails as a dropped connection does, and names the watch's
    reason instead.
    """

    def __init__(self, timeout: float, min_rate: float) -> None:
        self.timeout, self.min_rate = timeout, min_rate
        self._tick = min(0.25, timeout / 4)
        self._watched: set[_Watch] = set()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    @contextmanager
    def watching(self) -> Iterator[_Watch]:
        watch = _Watch()
        with self._lock:
            self._watched.add(watch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="materialize-watchdog", daemon=True)
                self._thread.start()
        try:
            yield watch
        finally:
            with self._lock:
                self._watched.discard(watch)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._watched:
                    self._thread = None  # the next request starts another
                    return
                now = time.monotonic()
                late = [watch for watch in self._watched if watch.cut is None and self._late(watch, now)]
            for watch in late:
                _shut(watch.connection)
            time.sleep(self._tick)

    def _late(self, watch: _Watch, now: float) -> bool:
        if watch.body_started is None:
            if now - watch.started > self.timeout:
                watch.cut = (f"too slow: no answer's headers within {self.timeout:g} s (the request timeout, "
                             "--request-timeout)")
            return watch.cut is not None
        ran = now - watch.body_started
        if ran > self.timeout and watch.received < (ran - self.timeout) * self.min_rate:
            watch.cut = (f"too slow: {watch.received:,} bytes in {ran:.0f} s, under the least rate of "
                         f"{self.min_rate:,.0f} bytes a second (--min-rate, RemoteOptions.min_rate)")
        return watch.cut is not None


def _shut(connection: Optional[http.client.HTTPConnection]) -> None:
    sock = getattr(connection, "sock", None)
    if sock is None:
        return  # still connecting: the connect timeout bounds it
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the plain socket's: a TLS socket's own drops its state
    except OSError:
        pass


class _Retryable(Exception):
    """A failure worth another attempt; ``received`` bytes of the range had arrived before it."""

    def __init__(self, reason: str, received: int = 0, wait: Optional[float] = None) -> None:
        super().__init__(reason)
        self.reason, self.received, self.wait = reason, received, wait


@dataclass
class _Pool:
    idle: list[http.client.HTTPConnection] = field(default_factory=list)


class Transport:
    """Kept-alive connections to any number of hosts, at most ``options.connections`` requests in flight.

    Parts of a large read run on the transport's own threads; a read of one
    part runs on the caller's. Either way a request takes a slot first, so
    the stated number of connections is never exceeded.
    """

    def __init__(self, options: RemoteOptions, *, ca_bundle: Optional[str] = None) -> None:
        self.options = options
        self._slots = threading.BoundedSemaphore(options.connections)
        self._pools: dict[tuple[str, str, int], _Pool] = {}
        self._lock = threading.Lock()
        self._redirects: dict[str, str] = {}
        self._ca_bundle = options.ca_bundle or ca_bundle
        self._ssl: Optional[ssl.SSLContext] = None
        self._executor: Optional[ThreadPoolExecutor] = None
        self._watchdog = _Watchdog(options.timeout, options.min_rate)
        self.requests = 0  # GETs and HEADs sent, retries included (what a test or a bench may count)
        self.retried = 0

    # --- connections -------------------------------------------------------------------------------------------

    def _context(self) -> ssl.SSLContext:
        with self._lock:
            if self._ssl is None:
                self._ssl = ssl.create_default_context(cafile=self._ca_bundle)
            return self._ssl

    def _connection(self, scheme: str, host: str, port: int) -> http.client.HTTPConnection:
        with self._lock:
            pool = self._pools.setdefault((scheme, host, port), _Pool())
            if pool.idle:
                return pool.idle.pop()
        proxy = proxy_for(scheme, host)
        if proxy is None:
            if scheme == "https":
                return http.client.HTTPSConnection(host, port, timeout=self.options.timeout, context=self._context())
            return http.client.HTTPConnection(host, port, timeout=self.options.timeout)
        credentials = _proxy_credentials(proxy)
        proxy_port = proxy.port or 80
        if scheme == "https":  # a tunnel: the proxy sees where, never what
            connection = http.client.HTTPSConnection(proxy.hostname, proxy_port, timeout=self.options.timeout,
                                                     context=self._context())
            connection.set_tunnel(host, port, headers=credentials)
            return connection
        connection = http.client.HTTPConnection(proxy.hostname, proxy_port, timeout=self.options.timeout)
        connection.absolute_form = credentials  # type: ignore[attr-defined]  # each request asks the whole URL
        return connection

    def _release(self, scheme: str, host: str, port: int, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            pool = self._pools.setdefault((scheme, host, port), _Pool())
            if len(pool.idle) < self.options.connections:
                pool.idle.append(connection)
                return
        connection.close()

    def close(self) -> None:
        """Close every idle connection and stop the part threads."""
        with self._lock:
            pools, self._pools = self._pools, {}
            executor, self._executor = self._executor, None
        for pool in pools.values():
            for connection in pool.idle:
                connection.close()
        if executor is not None:
            executor.shutdown(wait=False)

    # --- one request -------------------------------------------------------------------------------------------

    def _send(self, method: str, url: str, headers: Mapping[str, str], watch: _Watch):
        """One request sent and its answer's headers received, under ``watch``; -> (response, connection,
        where)."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise CheckpointError(f"cannot fetch a {scheme}:// URL over HTTP", path=url)
        port = parts.port or (443 if scheme == "https" else 80)
        host = parts.hostname or ""
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        connection = self._connection(scheme, host, port)
        sent = dict(headers)
        through_proxy = getattr(connection, "absolute_form", None)
        if through_proxy is not None:
            target = f"{scheme}://{parts.netloc.rpartition('@')[2]}{target}"
            sent.update(through_proxy)
        with self._lock:
            self.requests += 1
        watch.begin(connection)
        try:
            connection.request(method, target, headers=sent)
            response = connection.getresponse()
        except Exception:
            connection.close()
            raise
        watch.body_started = time.monotonic()
        if response.status == 407:  # the proxy's, whatever was asked: no retry mends it (_refuse_if_lasting)
            connection.close()
            raise _ProxyWantsCredentials()
        return response, connection, (scheme, host, port)

    def head(self, url: str, headers: Mapping[str, str], *, what: str = "HEAD", name: Optional[str] = None) -> Answer:
        """The answer to a HEAD of ``url``, redirects followed (an ``Authorization`` header is not sent to
        another host, as browsers and requests do), retried like a GET. ``name`` is what messages call it (else
        ``url``: a URL carrying a signature in its query is named otherwise)."""
        name = name or url
        return self._retrying(lambda: self._whole("HEAD", lambda: (url, dict(headers)), name), what=what, name=name)

    def get(self, target: Target, *, name: str, what: str = "GET") -> Answer:
        """The whole answer to a GET of the small resource ``target`` names (a listing page, an object's
        metadata; at most :data:`SMALL_BODY_BYTES`), redirects followed as :meth:`head` follows them, retried
        as a ranged GET is (a reset, a timeout, a 5xx or a 429), ``target`` asked anew for each attempt; any
        other status is returned for the caller to read. ``name`` is what messages call it."""
        return self._retrying(lambda: self._whole("GET", target, name), what=what, name=name)

    def _retrying(self, once: Callable[[], Answer], *, what: str, name: str) -> Answer:
        """``once()`` in a request slot, again after a backoff for each failure worth another attempt."""
        attempt = 0
        while True:
            try:
                with self._slots:
                    return once()
            except _Retryable as failure:
                attempt += 1
                if attempt > self.options.retries:
                    raise CheckpointAccessError(f"{what} failed after {self.options.retries} retries: {failure.reason}",
                                                path=name) from None
                with self._lock:
                    self.retried += 1
                logger.info("%s: %s failed (%s); retry %d of %d", shown_url(name), what, failure.reason, attempt,
                          self.options.retries)
                self._pause(attempt, failure.wait)

    def _whole(self, method: str, target: Target, name: str) -> Answer:
        """One attempt at a HEAD or a small GET, redirects followed; a status worth retrying is _Retryable."""
        current, sent = target()
        for _ in range(MAX_REDIRECTS + 1):
            with self._watchdog.watching() as watch:
                try:
                    response, connection, where = self._send(method, current, sent, watch)
                except (OSError, http.client.HTTPException) as exc:
                    if not watch.cut:
                        _refuse_if_lasting(exc, current, name=name)
                    raise _Retryable(watch.why(exc)) from None
                try:
                    body = _read_small(response, watch)
                except (OSError, http.client.HTTPException) as exc:
                    connection.close()
                    raise _Retryable(watch.why(exc)) from None
            if len(body) > SMALL_BODY_BYTES:
                connection.close()
                raise CheckpointError(f"the answer to a {method} of {current} is over {SMALL_BODY_BYTES:,} bytes",
                                      path=name)
            if watch.cut:  # the body came whole just as the watchdog shut the socket: the connection is gone
                connection.close()
            answer = Answer(response.status, _lower(response.getheaders()), current, body)
            self._finish(response, connection, where)
            if answer.status in REDIRECT_STATUS and "location" in answer.headers:
                nxt = urljoin(current, answer.headers["location"])
                sent = _headers_for(nxt, current, sent)
                current = nxt
                continue
            if answer.status in RETRYABLE_STATUS:
                raise _Retryable(f"HTTP {answer.status}{server_words(body)}", wait=_retry_after(answer.headers))
            return answer
        raise CheckpointError(f"more than {MAX_REDIRECTS} redirects", path=name)

    def remember_redirect(self, url: str, target: str) -> None:
        """Send the GETs of ``url`` to ``target`` (where a HEAD was redirected): the conditions of a GET (its
        ``If-Match``) then meet the server holding the bytes, not the one that names them."""
        with self._lock:
            self._redirects[url] = target

    def _finish(self, response: http.client.HTTPResponse, connection: http.client.HTTPConnection,
                where: tuple[str, str, int]) -> None:
        if response.isclosed() and not response.will_close:
            self._release(*where, connection)
        else:
            connection.close()

    # --- ranged reads ------------------------------------------------------------------------------------------

    def read_into(self, target: Target, offset: int, views: list[memoryview], *, size: int, etag: Optional[str],
                  name: str, tensor: Optional[str], last_modified: Optional[str] = None) -> None:
        """Fill ``views`` in turn with bytes ``offset`` on of the object ``target`` names (``size`` bytes long,
        tagged ``etag``, or where it has no tag last modified at ``last_modified``), in parallel parts of
        ``options.part_bytes``. ``name`` is its URL for messages."""
        parts = _split(offset, views, self.options.part_bytes)
        version = _Version(etag, last_modified)
        if len(parts) == 1:
            self._read_part(target, *parts[0], size=size, etag=version, name=name, tensor=tensor)
            return
        executor = self._part_threads()
        futures: list[Future] = [executor.submit(self._read_part, target, start, part_views, size=size, etag=version,
                                                 name=name, tensor=tensor) for start, part_views in parts]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for future in pending:
            future.cancel()
        wait(pending)
        for future in futures:
            if not future.cancelled() and future.exception() is not None:
                raise future.exception()

    def _part_threads(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.options.connections, thread_name_prefix="materialize-get")
            return self._executor

    def _read_part(self, target: Target, start: int, views: list[memoryview], *, size: int, etag: "_Version",
                   name: str, tensor: Optional[str]) -> None:
        total = sum(len(view) for view in views)
        received, attempt = 0, 0
        while received < total:
            try:
                with self._slots:
                    self._get(target, start + received, _after(views, received), size=size, etag=etag, name=name,
                              tensor=tensor)
                return
            except _Retryable as failure:
                received += failure.received
                attempt = 1 if failure.received else attempt + 1  # progress starts the count again
                if attempt > self.options.retries:
                    raise CheckpointAccessError(
                        f"GET bytes {start + received}-{start + total - 1} failed after {self.options.retries} "
                        f"retries: {failure.reason}", path=name, tensor=tensor) from None
                with self._lock:
                    self.retried += 1
                logger.info("%s: GET bytes %d-%d failed (%s); retry %d of %d", shown_url(name), start + received,
                          start + total - 1, failure.reason, attempt, self.options.retries)
                self._pause(attempt, failure.wait)

    def _get(self, target: Target, start: int, views: list[memoryview], *, size: int, etag: "_Version",
             name: str, tensor: Optional[str]) -> None:
        want = sum(len(view) for view in views)
        end = start + want - 1
        origin, headers = target()
        url = self._redirects.get(origin, origin)
        headers = _headers_for(url, origin, {**headers, "Range": f"bytes={start}-{end}"})
        if etag.tag:
            headers["If-Match"] = etag.tag
        elif etag.last_modified:
            headers["If-Unmodified-Since"] = etag.last_modified
        first = origin
        with self._watchdog.watching() as watch:
            response, connection, where, url = self._send_following_redirects(url, headers, watch, name=name,
                                                                              tensor=tensor)
            if url != first:
                with self._lock:
                    self._redirects[first] = url  # a hub resolve URL's CDN target: asked once, reused
            try:
                self._check_answer(response, start, end, size=size, etag=etag, name=name, tensor=tensor, first=first)
                _Body(response, connection, self.options.timeout, watch).receive(views, want)
            except BaseException:
                connection.close()
                raise
            if response.status == 200 or watch.cut:
                connection.close()  # the rest of a whole-object answer is not wanted (or the watchdog shut it)
            else:
                self._finish(response, connection, where)

    def _send_following_redirects(
        self, url: str, headers: dict[str, str], watch: _Watch, *, name: str, tensor: Optional[str],
    ) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection, tuple[str, str, int], str]:
        """A GET of ``url`` sent, redirects followed, and the answer's headers received under ``watch``;
        -> (response, connection, where, the URL that answered)."""
        for _ in range(MAX_REDIRECTS + 1):
            try:
                response, connection, where = self._send("GET", url, headers, watch)
            except (OSError, http.client.HTTPException) as exc:
                if not watch.cut:
                    _refuse_if_lasting(exc, url, name=name)
                raise _Retryable(watch.why(exc)) from None
            if response.status in REDIRECT_STATUS and response.getheader("Location"):
                nxt = urljoin(url, response.getheader("Location"))
                _drain(response)
                self._finish(response, connection, where)
                headers = _headers_for(nxt, url, headers)
                url = nxt
                continue
            return response, connection, where, url
        raise CheckpointError(f"more than {MAX_REDIRECTS} redirects", path=name, tensor=tensor)

    def _check_answer(self, response: http.client.HTTPResponse, start: int, end: int, *, size: int,
                      etag: "_Version", name: str, tensor: Optional[str], first: str) -> None:
        status = response.status
        if status in (200, 206):
            got_tag = response.getheader("ETag")
            if etag.tag and got_tag and _tag(got_tag) != _tag(etag.tag):
                raise CheckpointError(f"changed during the load: its ETag is now {got_tag}, was {etag.tag} "
                                      f"(bytes {start}-{end})", path=name, tensor=tensor)
            got_date = response.getheader("Last-Modified")
            if not etag.tag and etag.last_modified and got_date and got_date != etag.last_modified:
                raise CheckpointError(f"changed during the load: it was last modified {got_date}, was "
                                      f"{etag.last_modified} (bytes {start}-{end})", path=name, tensor=tensor)
            if status == 206:
                found = _CONTENT_RANGE.match(response.getheader("Content-Range") or "")
                if not found or int(found[1]) != start or int(found[2]) != end:
                    raise CheckpointError(f"asked for bytes {start}-{end}, the server answered "
                                          f"{response.getheader('Content-Range')!r}", path=name, tensor=tensor)
                if found[3] != "*" and int(found[3]) != size:
                    raise CheckpointError(f"changed during the load: it is now {int(found[3]):,} bytes, was "
                                          f"{size:,} (bytes {start}-{end})", path=name, tensor=tensor)
                if response.length is not None and response.length != end - start + 1:
                    # the framing disagrees with the range: whatever follows on the connection cannot be trusted
                    raise CheckpointError(f"the server's answer for bytes {start}-{end} says Content-Length "
                                          f"{response.length}, not the range's {end - start + 1}", path=name,
                                          tensor=tensor)
                return
            length = response.getheader("Content-Length")
            if start != 0 or (length is not None and int(length) != size):
                raise CheckpointError(f"the server ignored the byte range {start}-{end} (HTTP 200 for "
                                      f"{length} bytes): it must answer Range requests", path=name, tensor=tensor)
            return
        body = _error_body(response)
        if first in self._redirects and status in (401, 403, 404, 410):
            with self._lock:
                self._redirects.pop(first, None)  # a signed redirect target expired: ask the origin again
            raise _Retryable(f"HTTP {status} from the redirect target")
        if status == 412:  # If-Match or If-Unmodified-Since failed, or a store's own condition (a GCS generation)
            held = f"it no longer has ETag {etag.tag}" if etag.tag else "it is no longer the version first read"
            raise CheckpointError(f"changed during the load: {held} (HTTP 412 for bytes {start}-{end})", path=name,
                                  tensor=tensor)
        if status == 416:
            raise CheckpointError(f"changed during the load: bytes {start}-{end} are no longer there (HTTP 416)",
                                  path=name, tensor=tensor)
        if status in RETRYABLE_STATUS or _says_slow_down(body):
            raise _Retryable(f"HTTP {status}{server_words(body)}", wait=_retry_after(_lower(response.getheaders())))
        if status == 404:
            raise CheckpointNotFoundError(f"no such object (HTTP 404 for bytes {start}-{end})", path=name, tensor=tensor)
        if status in (401, 403):
            raise CheckpointAccessError(f"access refused (HTTP {status}{server_words(body)}) for bytes {start}-{end}",
                                        path=name, tensor=tensor)
        raise CheckpointAccessError(f"HTTP {status}{server_words(body)} for bytes {start}-{end}", path=name,
                                    tensor=tensor)

    def _pause(self, attempt: int, asked: Optional[float]) -> None:
        if asked is not None:
            time.sleep(min(asked, RETRY_AFTER_MOST))
            return
        time.sleep(random.uniform(0, min(BACKOFF_MOST, BACKOFF_FIRST * 2 ** (attempt - 1))))


@dataclass(frozen=True)
class _Version:
    """What a GET asks the object to still be: its strong ETag, else (a weak or no tag) its Last-Modified date."""

    tag: Optional[str]
    last_modified: Optional[str] = None


_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$")


class _Body:
    """Receives an answer's body into views, at most :data:`RECEIVE_BYTES` a call.

    On a plain TCP socket the bytes past what http.client buffered with the
    headers are received by ``recv_into(..., MSG_WAITALL)``: one system call
    and one GIL hand-off per call, where ``HTTPResponse.readinto`` returns to
    Python for every ``recv`` (what the socket holds at that moment: tens of
    KB on loopback). That needs a blocking socket (a Python timeout makes it
    non-blocking), so the request timeout moves to ``SO_RCVTIMEO`` for the
    body and back afterwards. TLS sockets and chunked answers are received
    by ``readinto``. Measured in docs/speed.md ("HTTP clients for streaming").
    """

    def __init__(self, response: http.client.HTTPResponse, connection: http.client.HTTPConnection,
                 timeout: float, watch: _Watch) -> None:
        self.response = response
        self.timeout = timeout
        self.watch = watch
        sock = connection.sock
        plain = type(sock) is socket.socket and not response.chunked and response.length is not None
        self.sock: Optional[socket.socket] = sock if plain and hasattr(socket, "MSG_WAITALL") else None
        self.buffered: Optional[int] = None  # body bytes that came with the headers, in http.client's buffer

    def receive(self, views: list[memoryview], want: int) -> None:
        received = 0
        if self.sock is not None:
            seconds = int(self.timeout)
            self.sock.settimeout(None)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                                 struct.pack("ll", seconds, int((self.timeout - seconds) * 1_000_000)))
        try:
            for view in views:
                filled = 0
                while filled < len(view):
                    try:
                        got = self._once(view[filled:filled + RECEIVE_BYTES])
                    except (OSError, http.client.HTTPException) as exc:
                        raise _Retryable(f"{self.watch.why(exc)} after {received + filled} of {want} bytes",
                                         received + filled) from None
                    if not got:
                        ended = self.watch.cut or "the answer ended"
                        raise _Retryable(f"{ended} after {received + filled} of {want} bytes", received + filled)
                    filled += got
                    self.watch.received += got
                received += filled
        finally:
            if self.sock is not None and self.sock.fileno() >= 0:
                self.sock.settimeout(self.timeout)
        if self.sock is not None and self.response.length == 0:
            self.response.read()  # read to its end: closed, so its connection takes the next request
        # else bytes the framing promised are still due: the answer stays open and its connection is closed

    def _once(self, view: memoryview) -> int:
        if self.buffered is None:
            self.buffered = len(self.response.fp.peek(0)) if self.sock is not None else 0
        if self.sock is None or self.buffered:
            got = self.response.readinto(view[:self.buffered or len(view)])
            self.buffered = max(0, self.buffered - got)
            return got
        got = self.sock.recv_into(view, len(view), socket.MSG_WAITALL)
        self.response.length -= got
        return got


def _split(offset: int, views: list[memoryview], part_bytes: int) -> list[tuple[int, list[memoryview]]]:
    """The read as parts of at most ``part_bytes`` (a view cut where a part ends), each with its start."""
    parts: list[tuple[int, list[memoryview]]] = []
    current: list[memoryview] = []
    room, start, position = part_bytes, offset, offset
    for view in views:
        while len(view):
            take = view[:room]
            current.append(take)
            view = view[len(take):]
            room -= len(take)
            position += len(take)
            if room == 0:
                parts.append((start, current))
                current, room, start = [], part_bytes, position
    if current or not parts:
        parts.append((start, current))
    return parts


def _after(views: list[memoryview], skip: int) -> list[memoryview]:
    """``views`` less their first ``skip`` bytes."""
    rest = []
    for view in views:
        if skip >= len(view):
            skip -= len(view)
            continue
        rest.append(view[skip:])
        skip = 0
    return rest


# What a request asks, not who asks it: the only headers a redirect to another origin is sent
PROTOCOL_HEADERS = frozenset({"range", "if-match", "if-none-match", "if-unmodified-since", "if-modified-since",
                              "accept", "accept-encoding", "user-agent"})


def origin(url: str) -> tuple[str, str, int]:
    """A URL's origin, as browsers and RFC 6454 define it: scheme, host and port (the scheme's own where none
    is written)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or (443 if scheme == "https" else 80)


def _headers_for(new_url: str, old_url: str, headers: Mapping[str, str]) -> dict[str, str]:
    """Headers for a redirect's target: on another origin, only those that say what is asked
    (:data:`PROTOCOL_HEADERS`); credentials, cookies and every header of the user's stay with the origin they
    were given for (an https:// one is not sent on to http:// on the same host either)."""
    if origin(new_url) == origin(old_url):
        return dict(headers)
    return {key: value for key, value in headers.items() if key.lower() in PROTOCOL_HEADERS}


def _lower(pairs: list[tuple[str, str]]) -> dict[str, str]:
    return {key.lower(): value for key, value in pairs}


def _tag(etag: str) -> str:
    return etag.strip().removeprefix("W/")


def _retry_after(headers: Mapping[str, str]) -> Optional[float]:
    try:
        return max(0.0, float(headers.get("retry-after", "")))
    except ValueError:
        return None


def _read_small(response: http.client.HTTPResponse, watch: _Watch) -> bytes:
    """A whole small answer (at most :data:`SMALL_BODY_BYTES` and one byte more, for the caller to refuse), read
    a piece at a time so that the watchdog sees it progress."""
    pieces: list[bytes] = []
    while watch.received <= SMALL_BODY_BYTES:
        piece = response.read(min(RECEIVE_BYTES, SMALL_BODY_BYTES + 1 - watch.received))
        if not piece:
            break
        pieces.append(piece)
        watch.received += len(piece)
    return b"".join(pieces)


def _drain(response: http.client.HTTPResponse) -> None:
    try:
        response.read(ERROR_BODY_BYTES)
    except (OSError, http.client.HTTPException):
        pass


def _error_body(response: http.client.HTTPResponse) -> bytes:
    try:
        return response.read(ERROR_BODY_BYTES)
    except (OSError, http.client.HTTPException):
        return b""


def _says_slow_down(body: bytes) -> bool:
    return b"<Code>SlowDown</Code>" in body


def server_words(body: bytes) -> str:
    """An error answer's code and message, for the one-line error: an S3- or Azure-style XML error's ``Code`` and
    ``Message``, or a Google JSON error's reason and message; ``""`` for any other body. Begins with a space."""
    code = re.search(rb"<Code>([^<]{1,100})</Code>", body)
    message = re.search(rb"<Message>([^<]{1,600})</Message>", body)
    if not code:
        return _json_words(body)
    words = " ".join(code[1].decode("utf-8", "replace").split())
    if message:
        # Azure's message goes on over lines: RequestId and Time, for its support, not for this line
        text = re.split(r"\s*\bRequestId:", message[1].decode("utf-8", "replace"))[0]
        words += ": " + " ".join(text.split())[:300]
    return f" {words}"


def _json_words(body: bytes) -> str:
    """``{"error": {"message": ..., "errors": [{"reason": ...}]}}``, as Google's JSON APIs answer a failure."""
    if not body.lstrip().startswith(b"{"):
        return ""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return ""
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return ""
    message = " ".join(error["message"].split())[:300]
    details = error.get("errors")
    first = details[0] if isinstance(details, list) and details else None
    reason = first.get("reason") if isinstance(first, dict) else None
    return f" {reason}: {message}" if isinstance(reason, str) and reason else f" {message}"


class _ProxyWantsCredentials(OSError):
    """An ``http://`` request's proxy answered 407 (a tunnel's refusal is http.client's own OSError)."""


def proxy_for(scheme: str, host: str) -> Optional[SplitResult]:
    """The proxy the environment names for ``scheme`` (``HTTPS_PROXY``, ``HTTP_PROXY``; lower case first, as
    urllib reads them), ``None`` where it names none or ``NO_PROXY`` exempts ``host``; an ``https://`` or
    SOCKS proxy is refused (a CheckpointAccessError naming it)."""
    found = urllib.request.getproxies().get(scheme)
    if not found or urllib.request.proxy_bypass(host):
        return None
    proxy = urlsplit(found if "://" in found else f"http://{found}")
    if proxy.scheme.lower() != "http" or not proxy.hostname:
        raise CheckpointAccessError(f"the {scheme} proxy {_shown(proxy)} is not an http:// proxy, the one kind "
                                    "this reader goes through: name an http:// one, or leave the host out by NO_PROXY",
                                    path=f"{scheme}://{host}")
    return proxy


def _shown(proxy: Optional[SplitResult]) -> str:
    """A proxy's URL without its credentials."""
    if proxy is None:
        return "(none)"
    return f"{proxy.scheme}://{proxy.netloc.rpartition('@')[2]}"


def _proxy_credentials(proxy: SplitResult) -> dict[str, str]:
    if proxy.username is None:
        return {}
    pair = f"{unquote(proxy.username)}:{unquote(proxy.password or '')}".encode()
    return {"Proxy-Authorization": "Basic " + base64.b64encode(pair).decode("ascii")}


def _refuse_if_lasting(exc: BaseException, url: str, *, name: Optional[str] = None) -> None:
    """Failures no retry mends, refused at once: a host name that does not resolve, nothing listening, a
    certificate this machine does not trust (a private CA: name its bundle), a proxy that refuses the tunnel.
    The error names ``name`` (what messages call the object) where given, else ``url``."""
    path = name or url
    parts = urlsplit(url)
    server = parts.netloc.rpartition("@")[2]  # host and port: the userinfo is a credential, never shown
    proxy = proxy_for(parts.scheme.lower(), parts.hostname or "")
    if isinstance(exc, _ProxyWantsCredentials):
        raise CheckpointAccessError(f"the proxy {_shown(proxy)} wants credentials (HTTP 407): give them in its URL, "
                                    "HTTP_PROXY=http://USER:PASSWORD@HOST:PORT", path=path) from None
    if proxy is not None:
        tunnel = re.match(r"Tunnel connection failed: (\d+)(.*)", str(exc)) if isinstance(exc, OSError) else None
        if tunnel is not None and 400 <= int(tunnel.group(1)) < 500:
            status = f"HTTP {tunnel.group(1)}{tunnel.group(2).rstrip()}"
            if tunnel.group(1) == "407":
                raise CheckpointAccessError(f"the proxy {_shown(proxy)} wants credentials for a tunnel to "
                                            f"{server} ({status}): give them in its URL, "
                                            "HTTPS_PROXY=http://USER:PASSWORD@HOST:PORT", path=path) from None
            raise CheckpointAccessError(f"the proxy {_shown(proxy)} refused a tunnel to {server} ({status})",
                                        path=path) from None
    if isinstance(exc, ssl.SSLCertVerificationError):
        raise CheckpointAccessError(f"its TLS certificate is not trusted ({exc.verify_message}): for a private CA "
                                    "give its bundle (RemoteOptions(ca_bundle=...); AWS_CA_BUNDLE for s3://)",
                                    path=path) from None
    if isinstance(exc, ssl.SSLError) and not isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
        # A handshake that fails so fails again: retrying it only delays the line that says why
        reason = exc.reason or str(exc).splitlines()[0][:200]
        plain = reason in PLAIN_HTTP_REASONS and proxy is None and parts.scheme.lower() == "https"
        hint = (f": the server at {server} seems to speak plain HTTP; if so, write "
                f"http:// for https://") if plain else ""
        raise CheckpointAccessError(f"TLS handshake failed ({reason}){hint}", path=path) from None
    # Through a proxy, the host connected to is the proxy's
    if isinstance(exc, socket.gaierror):
        host = f"the proxy's host {proxy.hostname!r}" if proxy is not None else f"host {parts.hostname!r}"
        raise CheckpointAccessError(f"cannot resolve {host}", path=path) from None
    if isinstance(exc, ConnectionRefusedError):
        where = f"the proxy {_shown(proxy)}" if proxy is not None else server
        raise CheckpointAccessError(f"connection refused: nothing listens at {where}", path=path) from None


# What OpenSSL says when the other side answers a TLS hello in plain text (1.1's words, then 3.x's)
PLAIN_HTTP_REASONS = frozenset({"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "UNKNOWN_PROTOCOL", "record layer failure",
                                "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE"})


def _describe(exc: BaseException) -> str:
    if isinstance(exc, (socket.timeout, TimeoutError, BlockingIOError)):  # BlockingIOError: SO_RCVTIMEO ran out
        return "timed out (no bytes for the request timeout)"
    if isinstance(exc, ConnectionResetError):
        return "connection reset"
    if isinstance(exc, http.client.IncompleteRead):
        return "the answer ended early"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "the server closed the connection"
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]
