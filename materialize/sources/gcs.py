"""``gs://bucket/key`` and ``gs://bucket/prefix/`` sources: Google Cloud Storage, or an emulator of its JSON API.

Credentials are google-auth's (the ``remote`` extra), found as Google's own
client libraries and ``gcloud`` find them (Application Default Credentials):
the file ``GOOGLE_APPLICATION_CREDENTIALS`` names (a service account key, an
authorized user, workload identity federation), then the file ``gcloud auth
application-default login`` writes, then the metadata server of a Google
Cloud machine. The token is asked for the read-only storage scope, and
google-auth refreshes it, through its own HTTP transport, when it expires.

Everything else is the JSON API over :class:`~.http.Transport`, each request
with a fresh ``Authorization: Bearer`` header: a folder is a listing of its
prefix (``delimiter=/``), an object's size and generation its metadata, and
its bytes ranged GETs of its media download, received straight into the
tensor's memory. Every data GET is conditional on the generation the object
had when first asked of (``ifGenerationMatch``), so an object replaced during
a load is an error, never a model of two versions.

``STORAGE_EMULATOR_HOST`` (``http://127.0.0.1:9023``; a bare ``host:port``
is taken as ``http://``) sends every request to an emulator instead of
``https://storage.googleapis.com``, as Google's client libraries do; unlike
google-cloud-storage, which then sends no credentials, the credentials are
still found and sent. ``anonymous`` (the CLI's ``--no-sign-request``) sends
none: a public bucket, or an emulator with no credentials at hand.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Optional
from urllib.parse import quote, urlencode

from ..errors import CheckpointAccessError, CheckpointError, CheckpointNotFoundError
from .http import Answer, Transport, server_words
from .listing import ListingPages
from .remotepath import ObjectInfo, RemotePath
from .settings import RemoteOptions

ENDPOINT = "https://storage.googleapis.com"
EMULATOR_VARIABLE = "STORAGE_EMULATOR_HOST"  # the variable google-cloud-storage (and the Go and Java clients) read
SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"
LIST_FIELDS = "items(name,size,generation),prefixes,nextPageToken"  # a listing page carries nothing else
OBJECT_FIELDS = "name,size,generation"
ANONYMOUS_HINT = "for a public bucket, read it without credentials: --no-sign-request (RemoteOptions(anonymous=True))"
ADC_HINT = ("set Application Default Credentials (GOOGLE_APPLICATION_CREDENTIALS naming a service account key file, "
            "or `gcloud auth application-default login`)")
CREDENTIALS_HINT = f"{ADC_HINT}; {ANONYMOUS_HINT}"


def gcs_endpoint() -> str:
    """Where requests go: ``STORAGE_EMULATOR_HOST`` where it is set (``http://`` added to a bare ``host:port``),
    else ``https://storage.googleapis.com``; no trailing slash."""
    host = os.environ.get(EMULATOR_VARIABLE, "").strip()
    if not host:
        return ENDPOINT
    return (host if "://" in host else "http://" + host).rstrip("/")


def _google_auth(name: str):
    try:
        import google.auth
        import google.auth.exceptions
    except ImportError:
        raise CheckpointError("gs:// sources need google-auth for credentials: pip install 'torch-materialize[remote]' "
                              "(a public bucket reads without it: --no-sign-request)", path=name) from None
    return google.auth


def _refresh_transport() -> Any:
    """google-auth's own HTTP transport for its token requests: requests where it is installed, else urllib3."""
    try:
        import google.auth.transport.requests as with_requests
    except ImportError:
        import urllib3
        import google.auth.transport.urllib3 as with_urllib3

        return with_urllib3.Request(urllib3.PoolManager())
    return with_requests.Request()


def _words(exc: BaseException, *, first_sentence: bool = False) -> str:
    """google-auth's message on one line (a RefreshError carries the token endpoint's answer beside it)."""
    text = " ".join((exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)).split())
    if first_sentence:
        text = "".join(text.partition(". ")[:2]).strip()
    return text[:300] or type(exc).__name__


class _Credentials:
    """Application Default Credentials, found on first use and refreshed by google-auth when they expire; one
    thread at a time asks, so an expired token is refreshed once, not by every request in flight."""

    def __init__(self, name: str) -> None:
        self._auth = _google_auth(name)
        self._credentials: Any = None
        self._request: Any = None
        self._lock = threading.Lock()

    def headers(self, url: str, *, name: str) -> dict[str, str]:
        """The headers that authorize a GET of ``url`` (``Authorization``, and a quota project's header where the
        credentials name one); failures are one line naming ``name``."""
        from google.auth.exceptions import DefaultCredentialsError, GoogleAuthError, RefreshError, TransportError

        headers: dict[str, str] = {}
        with self._lock:
            try:
                if self._credentials is None:
                    self._request = _refresh_transport()
                    self._credentials, _ = self._auth.default(scopes=[SCOPE], request=self._request)
                self._credentials.before_request(self._request, "GET", url, headers)
            except DefaultCredentialsError as exc:
                raise CheckpointAccessError(f"no Google credentials found ({_words(exc, first_sentence=True)}); "
                                            f"{CREDENTIALS_HINT}", path=name) from None
            except RefreshError as exc:
                raise CheckpointAccessError(f"the Google credentials were refused when refreshed ({_words(exc)}); "
                                            f"{CREDENTIALS_HINT}", path=name) from None
            except TransportError as exc:
                raise CheckpointAccessError(f"the Google credentials could not be refreshed: {_words(exc)}",
                                            path=name) from None
            except GoogleAuthError as exc:
                raise CheckpointAccessError(f"Google credentials failed: {_words(exc)}", path=name) from None
        return headers


class GcsStore:
    """One bucket: its listings and objects' metadata from the JSON API, its bytes through ranged media GETs,
    all over one :class:`~.http.Transport`; ``anonymous`` sends no credentials."""

    def __init__(self, bucket: str, options: RemoteOptions) -> None:
        self.bucket = bucket
        self.endpoint = gcs_endpoint()
        self.transport = Transport(options)
        self.anonymous = options.anonymous
        self._credentials = None if options.anonymous else _Credentials(self.url(""))
        self._objects: dict[str, Optional[tuple[ObjectInfo, str]]] = {}  # key -> (size, generation), None: absent
        self._lock = threading.Lock()

    def url(self, key: str) -> str:
        return f"gs://{self.bucket}/{key}"

    def _api(self, kind: str, key: Optional[str], query: dict[str, str]) -> str:
        """A JSON API URL: ``kind`` ``"storage"`` (metadata, listings) or ``"download/storage"`` (bytes);
        ``key`` ``None`` for the bucket's object list."""
        path = f"{self.endpoint}/{kind}/v1/b/{quote(self.bucket, safe='')}/o"
        if key is not None:
            path += "/" + quote(key, safe="")
        return f"{path}?{urlencode(query)}"

    def _headers(self, url: str, key: str) -> dict[str, str]:
        return {} if self._credentials is None else self._credentials.headers(url, name=self.url(key))

    def _call(self, what: str, key: str, url: str) -> Optional[dict[str, Any]]:
        """A JSON API GET's answer, its failures one line naming the object; ``None`` where there is no such
        object (a missing bucket is an error)."""
        answer = self.transport.get(lambda: (url, self._headers(url, key)), name=self.url(key), what=f"GCS {what}")
        if answer.status == 200:
            try:
                found = json.loads(answer.body)
            except ValueError:
                found = None
            if not isinstance(found, dict):
                raise CheckpointAccessError(f"GCS {what} answered something other than a JSON object",
                                            path=self.url(key))
            return found
        self._refuse(answer, what, key)
        return None

    def _refuse(self, answer: Answer, what: str, key: str) -> None:
        """Raise the one-line error an answer other than 200 is, or return where it is a missing object."""
        words = server_words(answer.body)
        if answer.status == 404:
            if b"bucket does not exist" in answer.body.lower():
                raise CheckpointNotFoundError(f"no such bucket {self.bucket!r}", path=self.url(key))
            return
        if answer.status in (401, 403):
            if self.anonymous:
                hint = "the bucket does not allow reads without credentials: leave --no-sign-request out"
            elif answer.status == 401:
                hint = f"the credentials were refused: {ADC_HINT}"
            else:
                hint = "the credentials found may not read this bucket (storage.objects.get and .list)"
            raise CheckpointAccessError(f"access refused (HTTP {answer.status}{words}); {hint}", path=self.url(key))
        raise CheckpointAccessError(f"GCS {what} answered HTTP {answer.status}{words}", path=self.url(key))

    def _object(self, key: str) -> Optional[tuple[ObjectInfo, str]]:
        with self._lock:
            if key in self._objects:
                return self._objects[key]
        found = None
        if key:
            meta = self._call("metadata GET", key, self._api("storage", key, {"fields": OBJECT_FIELDS}))
            if meta is not None:
                found = _entry(meta, self.url(key))
        with self._lock:
            return self._objects.setdefault(key, found)

    def stat(self, key: str) -> Optional[ObjectInfo]:
        found = self._object(key)
        return found[0] if found is not None else None

    def listing(self, key: str) -> Optional[tuple[list[str], list[str]]]:
        prefix = key + "/" if key else ""
        files: list[str] = []
        folders: list[str] = []
        pages = ListingPages(self.url(prefix), self.transport.options)
        token: Optional[str] = None
        while True:
            query = {"prefix": prefix, "delimiter": "/", "fields": LIST_FIELDS}
            if token:
                query["pageToken"] = token
            page = self._call("list", key, self._api("storage", None, query))
            if page is None:
                return None
            # the prefix's own placeholder object ("folder/") is no file of it
            found = [(str(item.get("name", ""))[len(prefix):], item) for item in page.get("items", [])]
            found = [(name, item) for name, item in found if name]
            page_folders = [str(named)[len(prefix):].rstrip("/") for named in page.get("prefixes", [])]
            pages.page([name for name, _ in found] + page_folders)
            for name, item in found:
                files.append(name)
                entry = _entry(item, self.url(prefix + name))
                with self._lock:
                    self._objects[prefix + name] = entry
            folders += page_folders
            token = pages.next_token(str(page.get("nextPageToken") or ""))
            if token is None:
                break
        if not files and not folders:
            return None
        return files, folders

    def read_into(self, key: str, offset: int, views: list[memoryview], *, tensor: Optional[str]) -> None:
        found = self._object(key)
        if found is None:
            raise CheckpointNotFoundError("no such object", path=self.url(key), tensor=tensor)
        info, generation = found
        url = self._api("download/storage", key, {"alt": "media", "ifGenerationMatch": generation})
        # The generation is the version check (412 once the object is replaced): no If-Match, whose ETag the
        # media download need not give as the metadata does.
        self.transport.read_into(lambda: (url, self._headers(url, key)), offset, views, size=info.size, etag=None,
                                 name=self.url(key), tensor=tensor)

    def close(self) -> None:
        self.transport.close()


def _entry(meta: dict[str, Any], name: str) -> tuple[ObjectInfo, str]:
    """An object resource's size and generation (the JSON API gives both as decimal strings)."""
    try:
        return ObjectInfo(int(meta["size"]), None), str(int(meta["generation"]))
    except (KeyError, TypeError, ValueError):
        raise CheckpointAccessError("GCS gave no size and generation for the object", path=name) from None


def open_gcs(url: str, options: RemoteOptions) -> RemotePath:
    """The object, or the folder (a prefix), ``gs://bucket/key`` names."""
    rest = url.split("://", 1)[1]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise CheckpointError("names no bucket (gs://BUCKET/key)", path=url)
    if not options.anonymous:
        _google_auth(url)  # its absence named with the whole URL, before anything is asked
    store = GcsStore(bucket, options)
    if not key or key.endswith("/"):
        return RemotePath(store, key, folder=True)
    return RemotePath(store, key)  # an object, or a prefix written without its slash: the store is asked which
