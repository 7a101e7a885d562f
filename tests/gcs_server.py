"""A stand-in for Google Cloud Storage's JSON API and Google's OAuth token endpoint, for the gs:// tests.

Each folder under ``root`` is a bucket and each file below it an object (its name the file's path in the
bucket, ``/`` included). The server answers what the ``gs://`` source asks, as GCS answers it:

- ``GET /storage/v1/b/BUCKET/o?prefix=P&delimiter=/&pageToken=T``: a listing page (``items`` with ``name``,
  ``size`` and ``generation`` as decimal strings, ``prefixes``, ``nextPageToken`` while more remain);
- ``GET /storage/v1/b/BUCKET/o/OBJECT`` (the name percent-encoded, ``/`` as ``%2F``): the object's metadata;
- ``GET /download/storage/v1/b/BUCKET/o/OBJECT?alt=media``: its bytes, a single ``Range`` answered 206 with
  ``Content-Range``, ``ifGenerationMatch`` (and ``generation``) checked: 412 (404) for another generation;
- ``POST /token``: Google's token endpoint for a service account's signed JWT (``grant_type`` jwt-bearer and an
  ``assertion``, whose signature is not checked), answering ``{"access_token", "expires_in", "token_type"}``.

Two switches make listings misbehave, as a broken or hostile store would: ``listing_fault`` ``"same-token"`` (each
page says more remain, naming the token it named before) or ``"new-tokens"`` (a new token each time), either
answering the first page whatever token is asked; ``listed_names``, names each page adds as objects whatever the
prefix and delimiter asked.

A file's generation is derived from its size, modification time and inode, so replacing a file makes a new one.
Every storage request must carry ``Authorization: Bearer`` one of ``accepted`` (401 ``authError`` otherwise,
and 401 ``required`` with no header at all), except reads of a bucket named in ``public``. Errors are Google's
JSON error bodies. Like the other servers of these tests it leaves no thread or socket behind its ``with`` block.
"""

from __future__ import annotations

import hashlib
import json
import os
from http.server import BaseHTTPRequestHandler
from itertools import count
from pathlib import Path
from typing import Any, BinaryIO, Iterable, NamedTuple, Optional
from urllib.parse import parse_qs, unquote

from tests.local_server import CloudStandIn, TrackedHTTPServer, single_range

CHUNK = 1024 * 1024


class Seen(NamedTuple):
    """One request the server answered: method, raw path with its query, headers (names lower-cased), status."""

    method: str
    path: str
    headers: dict[str, str]
    status: int


def private_key_pem() -> str:
    """A new 2048-bit RSA key (PKCS #8 PEM) for a service account key file: google-auth signs its JWT with it."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def generation_of(info: os.stat_result) -> str:
    """A file's generation: a positive 53-bit number that changes when the file is rewritten or replaced."""
    digest = hashlib.blake2b(f"{info.st_size}:{info.st_mtime_ns}:{info.st_ino}".encode(), digest_size=8).digest()
    return str(int.from_bytes(digest, "big") >> 11 or 1)


class GcsServer(CloudStandIn):
    """GCS's JSON API over the folders under ``root`` and a token endpoint, on 127.0.0.1 inside a ``with`` block.

    ``issued`` is the token the token endpoint hands out (``None``: it refuses every grant, 400
    ``invalid_grant``, as for a deleted key); ``accepted`` the tokens storage requests may carry (by default the
    issued one). ``page_size`` entries (objects and prefixes together) make a listing page.
    """

    def __init__(self, root: Path, *, public: Iterable[str] = (), issued: Optional[str] = "stand-in-token",
                 accepted: Optional[Iterable[str]] = None, page_size: int = 1000) -> None:
        super().__init__()
        self.root = Path(root).resolve()
        self.public = set(public)
        self.issued = issued
        self.accepted = set(accepted) if accepted is not None else {issued} - {None}
        self.page_size = page_size
        self.listing_fault: Optional[str] = None  # "same-token", "new-tokens": see the module
        self.listed_names: tuple[str, ...] = ()
        self._tokens = count(1)
        self.requests: list[Seen] = []

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``: what ``STORAGE_EMULATOR_HOST`` is set to."""
        if self._server is None:
            raise RuntimeError("the server runs only inside its with block")
        return f"http://127.0.0.1:{self._server.server_port}"

    def env(self) -> dict[str, str]:
        """``STORAGE_EMULATOR_HOST`` for this server, to merge over ``os.environ``."""
        return {"STORAGE_EMULATOR_HOST": self.url}

    def put(self, bucket: str, name: str, source: Path) -> None:
        """Upload ``source`` as ``gs://bucket/name``, replacing (a new file, a new generation) what was there."""
        target = self.root / bucket / name
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = target.with_name(target.name + ".uploading")
        staged.write_bytes(Path(source).read_bytes())
        os.replace(staged, target)

    def make_bucket(self, bucket: str, *, public: bool = False) -> None:
        (self.root / bucket).mkdir(parents=True, exist_ok=True)
        if public:
            self.public.add(bucket)

    def service_account_file(self, path: Path, key_pem: Optional[str] = None) -> Path:
        """Write a service account key file (its key ``key_pem``, else a new one) whose ``token_uri`` is this
        server's token endpoint."""
        path.write_text(json.dumps({
            "type": "service_account", "project_id": "stand-in-project", "private_key_id": "stand-in-key",
            "private_key": key_pem or private_key_pem(), "client_id": "1", "token_uri": f"{self.url}/token",
            "client_email": "loader@stand-in-project.iam.gserviceaccount.com",
        }))
        return path

    # --- what the handler asks ------------------------------------------------------------------------------

    _bucket = CloudStandIn._folder

    def _names(self, bucket: Path) -> list[str]:
        return sorted(p.relative_to(bucket).as_posix() for p in bucket.rglob("*")
                      if p.is_file() and not p.name.endswith(".uploading"))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    timeout = 60
    server: TrackedHTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    @property
    def owner(self) -> GcsServer:
        return self.server.owner

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        form = parse_qs(self.rfile.read(length).decode("utf-8", "replace"))
        if self.path.partition("?")[0] != "/token":
            return self._error(404, "notFound", "Not Found")
        if form.get("grant_type") != ["urn:ietf:params:oauth:grant-type:jwt-bearer"] or not form.get("assertion"):
            refusal = {"error": "invalid_grant", "error_description": "no signed JWT"}
            return self._send(400, json.dumps(refusal).encode(), {"Content-Type": "application/json"})
        token = self.owner._issue()
        if token is None:
            refusal = {"error": "invalid_grant", "error_description": "Invalid JWT Signature."}
            return self._send(400, json.dumps(refusal).encode(), {"Content-Type": "application/json"})
        body = {"access_token": token, "expires_in": 3600, "token_type": "Bearer"}
        self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

    def do_GET(self) -> None:
        raw, _, query_text = self.path.partition("?")
        query = {k: v[-1] for k, v in parse_qs(query_text, keep_blank_values=True).items()}
        for prefix, media in (("/download/storage/v1/b/", True), ("/storage/v1/b/", False)):
            if raw.startswith(prefix):
                bucket_name, _, rest = raw[len(prefix):].partition("/")
                break
        else:
            return self._error(404, "notFound", "Not Found")
        bucket_name = unquote(bucket_name)
        if not self._authorized(bucket_name, "storage.objects.list" if rest == "o" else "storage.objects.get"):
            return
        bucket = self.owner._bucket(bucket_name)
        if bucket is None:
            return self._error(404, "notFound", "The specified bucket does not exist.")
        if rest == "o":
            return self._list(bucket, query)
        if not rest.startswith("o/"):
            return self._error(404, "notFound", "Not Found")
        name = unquote(rest[2:])  # the raw path is split first: an encoded %2F stays inside the name
        opened = self.owner._open(bucket, name)
        if opened is None:
            return self._error(404, "notFound", f"No such object: {bucket_name}/{name}")
        with opened as file:
            info = os.fstat(file.fileno())
            generation = generation_of(info)
            if "generation" in query and query["generation"] != generation:
                return self._error(404, "notFound", f"No such object: {bucket_name}/{name}#{query['generation']}")
            if "ifGenerationMatch" in query and query["ifGenerationMatch"] != generation:
                return self._error(412, "conditionNotMet",
                                   "At least one of the pre-conditions you specified did not hold.")
            if media or query.get("alt") == "media":
                return self._media(file, info.st_size, generation)
            self._json(self._resource(bucket_name, name, info.st_size, generation))

    def _authorized(self, bucket: str, permission: str) -> bool:
        given = self.headers.get("Authorization")
        if given is None:
            if bucket in self.owner.public:
                return True
            self._error(401, "required", f"Anonymous caller does not have {permission} access to the Google Cloud "
                                         "Storage bucket.")
            return False
        if not given.startswith("Bearer ") or given[len("Bearer "):] not in self.owner.accepted:
            self._error(401, "authError", "Invalid Credentials")
            return False
        return True

    def _resource(self, bucket: str, name: str, size: int, generation: str) -> dict[str, Any]:
        return {"kind": "storage#object", "bucket": bucket, "name": name, "size": str(size),
                "generation": generation, "metageneration": "1", "etag": f"E{generation}",
                "contentType": "application/octet-stream"}

    def _list(self, bucket: Path, query: dict[str, str]) -> None:
        prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
        entries: dict[str, Optional[str]] = {}  # name or prefix -> the object's name (None for a prefix)
        for name in self.owner._names(bucket):
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            if delimiter and delimiter in rest:
                entries.setdefault(prefix + rest.split(delimiter)[0] + delimiter, None)
            else:
                entries[name] = name
        ordered = sorted(entries)
        fault = self.owner.listing_fault
        start = 0 if fault else int(query.get("pageToken") or 0)  # a faulty listing knows no token of its own
        page = ordered[start:start + self.owner.page_size]
        items, prefixes = [], []
        for entry in page:
            if entries[entry] is None:
                prefixes.append(entry)
                continue
            info = (bucket / entry).stat()
            items.append(self._resource(bucket.name, entry, info.st_size, generation_of(info)))
        items += [self._resource(bucket.name, name, 1, "1") for name in self.owner.listed_names]
        answer: dict[str, Any] = {"kind": "storage#objects"}
        if items:
            answer["items"] = items
        if prefixes:
            answer["prefixes"] = prefixes
        if fault:
            answer["nextPageToken"] = "the-same-token" if fault == "same-token" else f"token-{next(self.owner._tokens)}"
        elif start + len(page) < len(ordered):
            answer["nextPageToken"] = str(start + len(page))
        self._json(answer)

    def _media(self, file: BinaryIO, size: int, generation: str) -> None:
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes", "ETag": f'"E{generation}"',
                   "x-goog-generation": generation, "x-goog-stored-content-length": str(size)}
        try:
            wanted = single_range(self.headers.get("Range"), size)
        except ValueError:
            return self._error(416, "requestedRangeNotSatisfiable", "The requested range cannot be satisfied.",
                               {**headers, "Content-Range": f"bytes */{size}"})
        start, end = wanted if wanted is not None else (0, size - 1)
        self.send_response(206 if wanted is not None else 200)
        for name, value in headers.items():
            self.send_header(name, value)
        if wanted is not None:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        self._record(206 if wanted is not None else 200)
        if end >= start:
            try:
                self.connection.sendfile(file, start, end - start + 1)
            except OSError:
                self.close_connection = True

    def _record(self, status: int) -> None:
        self.owner._record(Seen(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, status))

    def _json(self, value: Any) -> None:
        self._send(200, json.dumps(value).encode(), {"Content-Type": "application/json; charset=UTF-8"})

    def _error(self, status: int, reason: str, message: str, headers: Optional[dict[str, str]] = None) -> None:
        body = {"error": {"code": status, "message": message,
                          "errors": [{"message": message, "domain": "global", "reason": reason}]}}
        self._send(status, json.dumps(body).encode(), {"Content-Type": "application/json; charset=UTF-8",
                                                       **(headers or {})})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self._record(status)
        try:
            self.wfile.write(body)
        except OSError:
            self.close_connection = True


GcsServer.handler = _Handler
