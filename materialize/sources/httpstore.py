"""``http://`` and ``https://`` sources: a file, an index, or a folder, on any server that answers Range requests.

An HTTP server has no listing to ask, so a folder URL (one ending in ``/``)
is read through the names a checkpoint folder uses: its files are found by
asking for each of :data:`FOLDER_NAMES` (a HEAD each, in parallel), and an
index or a DCP ``.metadata`` names the rest. A folder of other names is
opened by naming its file. A folder's URL written without its ``/`` is that
folder where the server redirects it there (nginx and Python's
``http.server`` do), or where it names no file but files of
:data:`FOLDER_NAMES` lie below it. S3, to a reader that may not list its
bucket (anyone, on a public one), answers 403 for a key that is not there as
for one refused: a refused name beside files that are found is taken as
absent, and a folder's name refused is that folder where its files answer.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping, Optional
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from ..errors import CheckpointAccessError, CheckpointError, MaterializeWarning
from ..text import shown_url
from .http import Transport
from .listing import ListingPages
from .remotepath import ObjectInfo, RemotePath
from .settings import RemoteOptions

# What a checkpoint folder is recognised by (see materialize.checkpoint.pick_from_folder), config.json, which makes
# it a Hugging Face model folder, and the small files a conversion copies beside its output.
FOLDER_NAMES = (
    "model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json", "pytorch_model.bin",
    "consolidated.safetensors", ".metadata", "config.json", "generation_config.json", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
)


# A name ending so is a file's: a refusal of it is not probed as a folder's
FILE_SUFFIXES = (".safetensors", ".json", ".bin", ".pt", ".pth", ".ckpt", ".metadata", ".distcp")
HEAD_REFUSED = frozenset({403, 405, 501})  # a HEAD answered so is asked again as a GET of the first byte


class HttpStore:
    """The files below one URL folder, read with ranged GETs; ``headers`` go with every request (a token)."""

    def __init__(self, base: str, transport: Transport, headers: Optional[Mapping[str, str]] = None,
                 *, check_tags: bool = True, files: Optional[Mapping[str, ObjectInfo]] = None,
                 companions: Optional[Path] = None) -> None:
        self.base = base if base.endswith("/") else base + "/"
        self.transport = transport
        self.headers = dict(headers or {})
        self.check_tags = check_tags  # False where the URL itself pins the content (a hub commit)
        self._stats: dict[str, Optional[ObjectInfo]] = {}
        self._lock = threading.Lock()
        self.exact: dict[str, str] = {}  # keys whose URL is given whole (a signed URL's query stays as it is)
        # Where the server has a listing of its own (the hub's file list): every file and its size, so nothing
        # is probed and no HEAD is sent; companions: a local folder holding the small files (the hub's snapshot).
        self.files = dict(files) if files is not None else None
        if self.files is not None:
            ListingPages(self.base, transport.options).page(list(self.files))  # the server's listing: names checked
            self._stats.update(self.files)
        self.companions = companions
        self.folders: set[str] = set()  # keys the server redirected to their folder (the key and a "/")

    def url(self, key: str) -> str:
        return self.exact.get(key) or self.base + quote(key, safe="/~")

    def stat(self, key: str) -> Optional[ObjectInfo]:
        with self._lock:
            if key in self._stats:
                return self._stats[key]
            if self.files is not None:
                return None
        found = self._head(key) if key else None
        with self._lock:
            return self._stats.setdefault(key, found)

    def _head(self, key: str) -> Optional[ObjectInfo]:
        url = self.url(key)
        answer = self.transport.head(url, self.headers)
        if answer.url == url + "/":  # the server's word for a folder, whatever that folder's own answer is
            self.folders.add(key)
            return None
        if answer.status in HEAD_REFUSED:
            # a URL signed for GET only (S3's presigned links sign the method), or a server without HEAD:
            # the first byte's answer says the size as well (Content-Range: bytes 0-0/SIZE)
            answer = self.transport.get(lambda: (url, {**self.headers, "Range": "bytes=0-0"}), name=url)
        if answer.status in (404, 410):
            return None
        if answer.status in (401, 403):
            missing = "; S3 answers so for a name that is not there too" if answer.status == 403 else ""
            raise CheckpointAccessError(f"access refused (HTTP {answer.status}){_token_words(self.headers)}{missing}",
                                        path=url)
        if answer.status == 206:
            total = answer.headers.get("content-range", "").rpartition("/")[2]
            length = total if total.isdigit() else None
        elif answer.status == 200:
            length = answer.headers.get("content-length")
        else:
            raise CheckpointAccessError(f"asked for its size, the server answered HTTP {answer.status}", path=url)
        if length is None or not length.isdigit():
            raise CheckpointError("the server gives no Content-Length: its size cannot be known before reading",
                                  path=url)
        if answer.headers.get("accept-ranges", "").lower() == "none":
            raise CheckpointError("the server does not answer Range requests (Accept-Ranges: none)", path=url)
        if answer.url != url:
            self.transport.remember_redirect(url, answer.url)
        if not self.check_tags:
            return ObjectInfo(int(length), None)
        # A weak ETag cannot be asked with If-Match (RFC 9110: strong comparison); a date can, to the second
        etag = answer.headers.get("etag")
        strong = etag if etag and not etag.startswith("W/") else None
        last_modified = None if strong else answer.headers.get("last-modified")
        if strong is None and last_modified is None:
            warnings.warn(MaterializeWarning(f"{shown_url(url)}: the server gives no strong ETag and no Last-Modified: "
                                             "a change to it during the load cannot be detected"), stacklevel=2)
        return ObjectInfo(int(length), strong, last_modified)

    def listing(self, key: str) -> Optional[tuple[list[str], list[str]]]:
        prefix = key + "/" if key else ""
        if self.files is not None:
            below = [name[len(prefix):] for name in self.files if name.startswith(prefix)]
            if not below:
                return None
            return sorted(n for n in below if "/" not in n), sorted({n.split("/")[0] for n in below if "/" in n})
        with ThreadPoolExecutor(len(FOLDER_NAMES)) as probes:
            found = list(probes.map(self._probe, [prefix + name for name in FOLDER_NAMES]))
        names = [name for name, (info, _) in zip(FOLDER_NAMES, found) if info is not None]
        refused = [error for _, error in found if error is not None]
        if refused and not names:
            raise refused[0]  # nothing answered: the folder is refused (or not there), as its first file says
        # Beside files that are there, a refusal is a name that is not: S3 answers 403 for a missing key to a
        # reader that may not list the bucket (an anonymous one of a public bucket)
        return names, []

    def _probe(self, key: str) -> tuple[Optional[ObjectInfo], Optional[CheckpointAccessError]]:
        try:
            return self.stat(key), None
        except CheckpointAccessError as refused:
            return None, refused

    def read_into(self, key: str, offset: int, views: list[memoryview], *, tensor: Optional[str]) -> None:
        info = self.stat(key)
        url = self.url(key)
        if info is None:
            raise CheckpointError("no such object", path=url, tensor=tensor)
        self.transport.read_into(lambda: (url, self.headers), offset, views, size=info.size, etag=info.etag,
                                 last_modified=info.last_modified, name=url, tensor=tensor)

    def close(self) -> None:
        self.transport.close()


def _token_words(headers: Mapping[str, str]) -> str:
    if any(k.lower() == "authorization" for k in headers):
        return ": the credentials sent were refused"
    return "; for a server that wants a token, send it: --header 'Authorization: Bearer TOKEN'"


def open_http(url: str, options: RemoteOptions, headers: Optional[Mapping[str, str]] = None) -> RemotePath:
    """The file or folder (a URL ending in ``/``) ``url`` names."""
    parts = urlsplit(url)
    if not parts.hostname:
        raise CheckpointError("is not a URL of a host", path=url)
    path = parts.path or "/"
    folder_path, _, name = path.rpartition("/")
    base = urlunsplit((parts.scheme.lower(), parts.netloc, folder_path + "/", "", ""))
    store = HttpStore(base, Transport(options), {**options.headers, **(headers or {})})
    if not name:
        return RemotePath(store, "", folder=True)
    key = unquote(name)
    if parts.query:  # a signed URL (S3 presigned, Azure SAS): this one file, its query kept; it names no others
        store.exact[key] = url.split("#", 1)[0]
        return RemotePath(store, key, folder=False)
    # Asked now, and kept for the reads: a folder's URL written without its "/" is that folder
    try:
        found = store.stat(key)
    except CheckpointAccessError:
        # S3 refuses (403) a key that is not there, a folder's name among them, to a reader that may not list
        if key.endswith(FILE_SUFFIXES) or not _files_below(store, key):
            raise
        return RemotePath(store, key, folder=True)
    if found is None and (key in store.folders or store.listing(key)[0]):  # (no file list: never None)
        return RemotePath(store, key, folder=True)
    return RemotePath(store, key, folder=False)


def _files_below(store: HttpStore, key: str) -> bool:
    """Whether files of :data:`FOLDER_NAMES` answer below ``key`` (a listing refused whole: none)."""
    try:
        return bool(store.listing(key)[0])
    except CheckpointAccessError:
        return False
