"""A stand-in Hugging Face hub on 127.0.0.1 that huggingface_hub's own client accepts, and a CDN host beside it.

Model repos are folders ``root/<org>/<name>/``; each has one revision, ``main``, whose commit is the sha1 of the repo
id, and files are read from disk at each request (so a test can change one between two requests, and its ETag
changes with it). The hub host answers what ``model_info``, ``repo_info``, ``list_repo_tree``, ``snapshot_download``
and ``hf_hub_download`` ask, with the hub's own headers (``X-Repo-Commit``, ``ETag``, ``X-Error-Code``); a large
(LFS) file's resolve URL is a 302 to a signed, content-addressed blob URL on a second server, the CDN host, with
``X-Linked-Size`` and ``X-Linked-Etag``, as the hub does. Both hosts serve byte ranges (206, ``Content-Range``),
honour ``If-Match`` (412), and keep connections alive (HTTP/1.1, ``Content-Length`` on every answer).

With ``token`` set, the repos are private: the hub host answers 401 to a request without
``Authorization: Bearer <token>``. The CDN host needs no token (its URLs are signed) and every request either host
receives is recorded, headers included, so a test can check that the token never reaches the CDN.

huggingface_hub reads ``HF_ENDPOINT`` once, at import: a subprocess takes :meth:`FakeHub.env`, and a test in this
process calls :meth:`FakeHub.redirect_huggingface_hub`, which names what must be patched.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import parse_qs, quote, unquote, urlsplit

from tests.local_server import TrackedHTTPServer, serve_in_thread, stop_serving

# Files the hub stores in LFS (resolve redirects them to the CDN); every other file is served by the hub itself.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
REVISION = "main"
_LAST_MODIFIED = "2024-01-01T00:00:00.000Z"
_CHUNK = 1 << 20


class SeenRequest(NamedTuple):
    """One request as a host received it: ``host_kind`` is ``"hub"`` or ``"cdn"``; ``path`` keeps its query.

    Header names are lower-cased (clients differ: httpx sends ``authorization``, http.client ``Authorization``).
    """

    host_kind: str
    method: str
    path: str
    headers: dict[str, str]


class FileFacts(NamedTuple):
    size: int
    git_oid: str  # what the hub calls the blob id: git's sha1 of the file, or of its LFS pointer
    sha256: str | None  # LFS files only
    pointer_size: int | None


class FakeHub:
    """The hub (``endpoint``) and its CDN (``cdn_url``), serving the repos under ``root`` until exit."""

    def __init__(self, root: Path, *, token: str | None = None) -> None:
        self.root = Path(root)
        self.token = token
        self.endpoint = ""
        self.cdn_url = ""
        self.requests: list[SeenRequest] = []
        self._record_lock = threading.Lock()
        self._facts: dict[tuple[Path, int, int], FileFacts] = {}
        self._facts_lock = threading.Lock()
        self._url_key = secrets.token_bytes(16)  # signs CDN URLs: only a URL the hub handed out is served
        self._running: list[tuple[TrackedHTTPServer, threading.Thread]] = []

    def __enter__(self) -> FakeHub:
        try:
            hub = self._start(_HubHandler)
            cdn = self._start(_CdnHandler)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        self.endpoint = f"http://127.0.0.1:{hub.server_address[1]}"
        self.cdn_url = f"http://127.0.0.1:{cdn.server_address[1]}"
        return self

    def __exit__(self, *exc_info: object) -> None:
        left = [name for server, thread in self._running for name in stop_serving(server, thread)]
        self._running.clear()
        if left and exc_info[0] is None:
            raise RuntimeError(f"FakeHub threads still alive after closing: {left}")

    # ------------------------------------------------------------------ for tests

    def sha(self, repo: str) -> str:
        """The commit of ``repo``'s only revision: fixed, the sha1 of its id."""
        return hashlib.sha1(repo.encode()).hexdigest()

    def resolve_url(self, repo: str, filename: str, revision: str = REVISION) -> str:
        return f"{self.endpoint}/{repo}/resolve/{quote(revision, safe='')}/{quote(filename)}"

    def seen(self, host_kind: str) -> list[SeenRequest]:
        """The requests one host (``"hub"`` or ``"cdn"``) received, in order."""
        with self._record_lock:
            return [request for request in self.requests if request.host_kind == host_kind]

    def env(self) -> dict[str, str]:
        """What a subprocess needs to use this hub: its endpoint, and its token or none at all.

        Merged over ``os.environ``, it still wins: an empty ``HF_TOKEN`` reads as no token, and the token file is
        one that does not exist, so no token of the machine's reaches the fake.
        """
        return {"HF_ENDPOINT": self.endpoint, "HF_TOKEN": self.token or "", "HUGGING_FACE_HUB_TOKEN": "",
                "HF_TOKEN_PATH": str(_nowhere() / "token"), "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "0"}

    def redirect_huggingface_hub(self, monkeypatch: Any, *, cache_dir: Path | None = None) -> None:
        """Point huggingface_hub, already imported in this process, at this hub, with no token from the machine.

        ``HF_ENDPOINT`` is read at import into ``constants.ENDPOINT`` and ``constants.HUGGINGFACE_CO_URL_TEMPLATE``
        (hf_hub_url builds resolve URLs from the template; before 1.0, from its own copy,
        ``file_download.HUGGINGFACE_CO_URL_TEMPLATE``), and the module-level ``HfApi`` behind
        ``huggingface_hub.model_info``/``repo_info``/``list_repo_tree`` copied the endpoint when it was made: those
        are patched. ``snapshot_download`` builds its own ``HfApi`` from ``constants.ENDPOINT``. The token is looked
        up at each call (``HF_TOKEN``, then the file at ``constants.HF_TOKEN_PATH``): both are cleared, so a test
        passes ``token=`` or sets ``HF_TOKEN`` itself. ``cache_dir`` replaces ``constants.HF_HUB_CACHE``, the
        default cache of every download.
        """
        from huggingface_hub import constants, file_download, hf_api

        template = self.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        monkeypatch.setattr(constants, "ENDPOINT", self.endpoint)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
        if hasattr(file_download, "HUGGINGFACE_CO_URL_TEMPLATE"):
            monkeypatch.setattr(file_download, "HUGGINGFACE_CO_URL_TEMPLATE", template)
        monkeypatch.setattr(hf_api.api, "endpoint", self.endpoint)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(_nowhere() / "token"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
            monkeypatch.delenv(name, raising=False)
        if cache_dir is not None:
            monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache_dir))

    # ------------------------------------------------------------------ what the handlers use

    def record(self, host_kind: str, handler: BaseHTTPRequestHandler) -> None:
        with self._record_lock:
            headers = {name.lower(): value for name, value in handler.headers.items()}
            self.requests.append(SeenRequest(host_kind, handler.command, handler.path, headers))

    def repo_folder(self, repo: str) -> Path | None:
        org, _, name = repo.partition("/")
        if not org or not name or "/" in name or any(part in ("", ".", "..") for part in (org, name)):
            return None
        folder = self.root / org / name
        return folder if folder.is_dir() else None

    def files(self, folder: Path) -> dict[str, Path]:
        """Each file of a repo by its path in the repo (posix), sorted."""
        found = {path.relative_to(folder).as_posix(): path for path in folder.rglob("*") if path.is_file()}
        return dict(sorted(found.items()))

    def facts(self, path: Path) -> FileFacts:
        """Size and hashes of a file, computed once for each (size, mtime) it has had."""
        stat = path.stat()
        key = (path, stat.st_size, stat.st_mtime_ns)
        with self._facts_lock:
            if key in self._facts:
                return self._facts[key]
        data = path.read_bytes()
        if path.name.endswith(LFS_SUFFIXES):
            sha256 = hashlib.sha256(data).hexdigest()
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(data)}\n".encode()
            facts = FileFacts(len(data), _git_oid(pointer), sha256, len(pointer))
        else:
            facts = FileFacts(len(data), _git_oid(data), None, None)
        with self._facts_lock:
            self._facts[key] = facts
        return facts

    def blob_url(self, repo: str, sha256: str, filename: str) -> str:
        path = f"/repos/{repo}/{sha256}"
        expires = str(int(time.time()) + 3600)
        return f"{self.cdn_url}{path}?Expires={expires}&Signature={self.signature(path, expires)}" \
               f"&response-content-disposition={quote(_attachment(filename), safe='')}"

    def signature(self, path: str, expires: str) -> str:
        return hmac.new(self._url_key, f"{path}?{expires}".encode(), hashlib.sha256).hexdigest()

    def _start(self, handler: type[_Handler]) -> TrackedHTTPServer:
        server = TrackedHTTPServer(handler, self, f"fake-hub-{handler.host_kind}")
        self._running.append((server, serve_in_thread(server)))
        return server


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _attachment(filename: str) -> str:
    name = filename.rsplit("/", 1)[-1]
    return f"attachment; filename*=UTF-8''{quote(name)}; filename=\"{name}\""


def _nowhere() -> Path:
    return Path(tempfile.gettempdir()) / "materialize-tests-no-hf-home" / "absent"


class _Unsatisfiable(Exception):
    pass


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The inclusive range a ``Range`` header asks for, or None to send the whole body (no header, or one ignored).

    Several ranges, or a malformed header, are ignored, as RFC 9110 lets a server do; a range starting past the
    end raises _Unsatisfiable (416).
    """
    if not header or not header.startswith("bytes=") or "," in header:
        return None
    first, dash, last = header[len("bytes="):].strip().partition("-")
    if not dash or not (first + last).isdigit() or not all(part.isdigit() for part in (first, last) if part):
        return None
    if not first:  # bytes=-N: the last N bytes
        if int(last) == 0:
            raise _Unsatisfiable
        return max(size - int(last), 0), size - 1
    start, end = int(first), int(last) if last else size - 1
    if last and end < start:
        return None
    if start >= size:
        raise _Unsatisfiable
    return start, min(end, size - 1)


class _Handler(BaseHTTPRequestHandler):
    """What both hosts share: HTTP/1.1 keep-alive, Content-Length always, ranges, If-Match, no log lines."""

    protocol_version = "HTTP/1.1"
    timeout = 60  # an idle kept-alive connection ends its thread
    host_kind = ""
    server: TrackedHTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    @property
    def hub(self) -> FakeHub:
        return self.server.owner

    def do_GET(self) -> None:
        self._handle()

    def do_HEAD(self) -> None:
        self._handle()

    def _handle(self) -> None:
        self.hub.record(self.host_kind, self)
        try:
            self.route(urlsplit(self.path))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def route(self, url: Any) -> None:
        raise NotImplementedError

    def answer(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def answer_json(self, value: Any, headers: dict[str, str] | None = None) -> None:
        self.answer(200, json.dumps(value).encode(), {"Content-Type": "application/json; charset=utf-8",
                                                      **(headers or {})})

    def answer_error(self, status: int, code: str | None, message: str, headers: dict[str, str] | None = None) -> None:
        headers = {**(headers or {}), "Content-Type": "application/json; charset=utf-8", "X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code  # huggingface_hub picks its exception by this header
        self.answer(status, json.dumps({"error": message}).encode(), headers)

    def send_file(self, path: Path, etag: str, headers: dict[str, str]) -> None:
        """The file, or the range asked for; 412 when If-Match names another version, 416 past its end."""
        size = path.stat().st_size
        headers = {"ETag": f'"{etag}"', "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream",
                   **headers}
        wanted = self.headers.get("If-Match")
        if wanted is not None and wanted.strip() != "*" and etag not in _etags(wanted):
            return self.answer_error(412, None, "Precondition Failed", headers)
        try:
            span = _byte_range(self.headers.get("Range"), size)
        except _Unsatisfiable:
            unsatisfiable = {**headers, "Content-Range": f"bytes */{size}"}
            return self.answer_error(416, None, "Range Not Satisfiable", unsatisfiable)
        start, end = span if span is not None else (0, size - 1)
        self.send_response(206 if span is not None else 200)
        for name, value in headers.items():
            self.send_header(name, value)
        if span is not None:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        if self.command == "HEAD":
            return
        with open(path, "rb") as source:
            source.seek(start)
            left = end - start + 1
            while left > 0:
                chunk = source.read(min(_CHUNK, left))
                if not chunk:  # the file shrank under us: the promised length cannot be kept
                    self.close_connection = True
                    return
                self.wfile.write(chunk)
                left -= len(chunk)


def _etags(header: str) -> set[str]:
    """The entity tags an If-Match header lists, unquoted (weak or not)."""
    return {tag.strip().removeprefix("W/").strip('"') for tag in header.split(",")}


class _HubHandler(_Handler):
    host_kind = "hub"

    def route(self, url: Any) -> None:
        if self.hub.token is not None and not self._authorized():
            return
        parts = [unquote(part) for part in url.path.split("/")[1:]]
        query = {name: values[-1] for name, values in parse_qs(url.query).items()}
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo, rest = "/".join(parts[2:4]), parts[4:]
            if not rest:
                return self._model_info(repo, REVISION, query)
            if rest[0] == "revision" and len(rest) == 2:
                return self._model_info(repo, rest[1], query)
            if rest[0] == "tree" and len(rest) >= 2:
                return self._tree(repo, rest[1], "/".join(rest[2:]), query)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]))
        self.answer_error(404, None, "Not Found")

    def _authorized(self) -> bool:
        given = self.headers.get("Authorization")
        if given == f"Bearer {self.hub.token}":
            return True
        if given is None:  # as the hub answers for a private repo: 401, and RepoNotFound, never saying it exists
            self.answer_error(401, "RepoNotFound", "Invalid username or password.")
        else:
            self.answer_error(401, None, "Invalid credentials in Authorization header")
        return False

    def _repo(self, repo: str, revision: str) -> Path | None:
        """The repo's folder, or None once a 404 naming what is missing has been sent."""
        folder = self.hub.repo_folder(repo)
        if folder is None:
            self.answer_error(404, "RepoNotFound", "Repository not found")
            return None
        if revision not in (REVISION, self.hub.sha(repo)):
            self.answer_error(404, "RevisionNotFound", "Invalid rev id: " + revision)
            return None
        return folder

    def _model_info(self, repo: str, revision: str, query: dict[str, str]) -> None:
        folder = self._repo(repo, revision)
        if folder is None:
            return
        with_blobs = query.get("blobs", "").lower() in ("1", "true")
        siblings = []
        for name, path in self.hub.files(folder).items():
            sibling: dict[str, Any] = {"rfilename": name}
            if with_blobs:
                facts = self.hub.facts(path)
                sibling.update(blobId=facts.git_oid, size=facts.size)
                if facts.sha256 is not None:
                    sibling["lfs"] = {"sha256": facts.sha256, "size": facts.size, "pointerSize": facts.pointer_size}
            siblings.append(sibling)
        self.answer_json({
            "_id": self.hub.sha(repo)[:24], "id": repo, "modelId": repo, "author": repo.split("/")[0],
            "sha": self.hub.sha(repo), "private": self.hub.token is not None, "gated": False, "disabled": False,
            "lastModified": _LAST_MODIFIED, "createdAt": _LAST_MODIFIED, "tags": [], "downloads": 0, "likes": 0,
            "siblings": siblings,
        })

    def _tree(self, repo: str, revision: str, under: str, query: dict[str, str]) -> None:
        """One page holding every entry: the hub paginates with a Link header, which the client follows if sent."""
        folder = self._repo(repo, revision)
        if folder is None:
            return
        recursive = query.get("recursive", "").lower() in ("1", "true")
        prefix = f"{under.strip('/')}/" if under.strip("/") else ""
        if prefix and not (folder / prefix).is_dir():
            return self.answer_error(404, "EntryNotFound", f"{under} does not exist on \"{revision}\"")
        entries: dict[str, dict[str, Any]] = {}
        for name, path in self.hub.files(folder).items():
            if not name.startswith(prefix):
                continue
            inner = name[len(prefix):].split("/")
            for depth in range(1, len(inner)):  # the folders on the way
                if depth > 1 and not recursive:
                    break
                folder_name = prefix + "/".join(inner[:depth])
                entries.setdefault(folder_name, {"type": "directory", "oid": _git_oid(folder_name.encode()),
                                                 "size": 0, "path": folder_name})
            if len(inner) == 1 or recursive:
                facts = self.hub.facts(path)
                entry: dict[str, Any] = {"type": "file", "oid": facts.git_oid, "size": facts.size, "path": name}
                if facts.sha256 is not None:
                    entry["lfs"] = {"oid": facts.sha256, "size": facts.size, "pointerSize": facts.pointer_size}
                entries[name] = entry
        self.answer_json([entries[name] for name in sorted(entries)])

    def _resolve(self, repo: str, revision: str, filename: str) -> None:
        folder = self._repo(repo, revision)
        if folder is None:
            return
        commit = {"X-Repo-Commit": self.hub.sha(repo)}
        path = self.hub.files(folder).get(filename)
        if path is None:
            return self.answer_error(404, "EntryNotFound", "Entry not found", commit)
        facts = self.hub.facts(path)
        if facts.sha256 is None:
            return self.send_file(path, facts.git_oid, commit)
        location = self.hub.blob_url(repo, facts.sha256, filename)
        self.answer(302, f"Found. Redirecting to {location}".encode(), {
            **commit, "Location": location, "ETag": f'"{facts.git_oid}"', "Content-Type": "text/plain; charset=utf-8",
            "X-Linked-Size": str(facts.size), "X-Linked-Etag": f'"{facts.sha256}"',
        })


class _CdnHandler(_Handler):
    host_kind = "cdn"

    def route(self, url: Any) -> None:
        parts = url.path.split("/")[1:]
        query = {name: values[-1] for name, values in parse_qs(url.query).items()}
        expires = query.get("Expires", "")
        signed = hmac.compare_digest(query.get("Signature", ""), self.hub.signature(url.path, expires))
        if not signed or not expires.isdigit() or int(expires) < time.time():
            return self.answer_error(403, None, "Access Denied")
        if len(parts) != 4 or parts[0] != "repos":
            return self.answer_error(404, None, "Not Found")
        repo, sha256 = f"{parts[1]}/{parts[2]}", parts[3]
        folder = self.hub.repo_folder(repo)
        # Content-addressed: a file changed since the URL was made is no longer there under that name.
        for path in self.hub.files(folder).values() if folder is not None else ():
            if path.name.endswith(LFS_SUFFIXES) and self.hub.facts(path).sha256 == sha256:
                disposition = query.get("response-content-disposition")
                return self.send_file(path, sha256, {"Content-Disposition": disposition} if disposition else {})
        self.answer_error(404, None, "Not Found")
