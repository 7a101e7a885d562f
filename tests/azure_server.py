"""A stand-in for Azure Blob Storage's REST API and App Service's managed identity endpoint, for the az:// tests.

Each folder under ``root`` is a container and each file below it a blob (its name the file's path in the
container, ``/`` included). Requests are path-style, as Azurite takes them: ``/ACCOUNT/CONTAINER/BLOB``, so the
service endpoint is ``http://127.0.0.1:PORT/ACCOUNT`` (what a connection string's ``BlobEndpoint`` names). The
server answers what the ``az://`` source asks, as the Blob service answers it:

- ``HEAD``/``GET /ACCOUNT/CONTAINER/BLOB``: ``Content-Length``, ``ETag`` (quoted), ``x-ms-blob-type``; a single
  ``Range`` answered 206 with ``Content-Range``; ``If-Match`` another tag: 412 ``ConditionNotMet``;
- ``GET /ACCOUNT/CONTAINER?restype=container&comp=list&prefix=P&delimiter=/&marker=M&maxresults=N``: a listing
  page, XML ``EnumerationResults`` with ``Blobs/Blob`` (``Name``, ``Properties/Content-Length``,
  ``Properties/Etag`` unquoted, as the service gives it) and ``Blobs/BlobPrefix``, ``NextMarker`` (opaque, with
  characters a URL must encode) while more remain;
- ``GET /msi/token?api-version=2019-08-01&resource=R`` with ``X-IDENTITY-HEADER``: App Service's managed identity
  endpoint (what ``IDENTITY_ENDPOINT`` names), answering ``{"access_token", "expires_on", "resource",
  "token_type"}`` for the storage resource;
- ``GET /metadata/identity/oauth2/token``: the instance metadata service of a virtual machine that has no managed
  identity (400 ``Identity not found``), where ``AZURE_POD_IDENTITY_AUTHORITY_HOST`` sends azure-identity.

A blob's ETag is derived from its size, modification time and inode, so replacing a file makes a new one. A
request is authorized by ``Authorization: Bearer`` one of ``accepted`` (with an ``x-ms-version`` of 2017-11-09 or
later, as the service asks of bearer tokens; 401 ``InvalidAuthenticationInfo`` for another token, 403
``AuthorizationPermissionMismatch`` for one of ``denied``), or by a SAS query whose ``sig`` is ``sas_signature``
(403 ``AuthenticationFailed`` for another), or by nothing in a container named in ``public`` (anonymous reads of
a private container: 404 ``ResourceNotFound``, as the service hides it). Containers named in ``hierarchical``
also hold each folder as an empty blob with ``hdi_isfolder`` metadata, as a Data Lake (HNS) account lists them.
Errors are the service's XML error bodies, and for HEAD its ``x-ms-error-code`` header. Like the other servers
of these tests it leaves no thread or socket behind its ``with`` block.

A blob name holding a character XML 1.0 cannot carry (NUL, most control characters) is listed percent-encoded in
``<Name Encoded="true">``, as the service lists it. Three switches make listings misbehave, as a broken or hostile
service would: ``listing_fault`` ``"same-token"`` (each page says more remain, naming the marker it named before) or
``"new-tokens"`` (a new marker each time), either answering the first page whatever marker is asked;
``listed_names``, names each page adds as blobs whatever the prefix and delimiter asked; ``listing_document``,
bytes answered (200, ``application/xml``) to every list request instead of the listing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from http.server import BaseHTTPRequestHandler
from itertools import count
from pathlib import Path
from typing import Any, BinaryIO, Iterable, NamedTuple, Optional
from urllib.parse import parse_qs, quote, unquote
from xml.sax.saxutils import escape

from tests.local_server import CloudStandIn, TrackedHTTPServer, single_range

ACCOUNT = "standin"
STORAGE_RESOURCE = "https://storage.azure.com"
BEARER_VERSION = "2017-11-09"  # the first REST version that takes OAuth bearer tokens
TOKEN_PATH = "/msi/token"
IMDS_TOKEN_PATH = "/metadata/identity/oauth2/token"


class Seen(NamedTuple):
    """One request the server answered: method, raw path with its query, headers (names lower-cased), status."""

    method: str
    path: str
    headers: dict[str, str]
    status: int


def etag_of(info: os.stat_result) -> str:
    """A blob's ETag, unquoted, in the service's form (``0x`` and 15 hex digits); changes when the file does."""
    digest = hashlib.blake2b(f"{info.st_size}:{info.st_mtime_ns}:{info.st_ino}".encode(), digest_size=8).digest()
    return "0x8D" + digest.hex().upper()[:13]


MARKER_TAIL = "!a+b/c="  # what an opaque marker may hold, and a client must escape ('+' would become a space)


def _marker(index: int) -> str:
    return f"2!{index:08d}{MARKER_TAIL}"


# What XML 1.0 cannot carry, even escaped: a name holding one is listed percent-encoded, as the service lists it
_NOT_XML = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _name_element(name: str) -> str:
    if _NOT_XML.search(name):
        return f'<Name Encoded="true">{quote(name, safe="")}</Name>'
    return f"<Name>{escape(name)}</Name>"


def _marker_index(marker: str) -> Optional[int]:
    """The listing position a marker this server gave names; ``None`` for one it did not give (mangled)."""
    if not marker.startswith("2!") or not marker.endswith(MARKER_TAIL) or not marker[2:10].isdigit():
        return None
    return int(marker[2:10])


class AzureServer(CloudStandIn):
    """The Blob service over the folders under ``root`` and a managed identity endpoint, on 127.0.0.1 inside a
    ``with`` block.

    ``issued`` is the token the managed identity endpoint hands out (``None``: it refuses, 400, as for an
    identity not assigned); ``accepted`` the tokens storage requests may carry (by default the issued one);
    ``identity_header`` the secret the endpoint asks for (``IDENTITY_HEADER``). ``page_size`` entries (blobs and
    prefixes together) make a listing page, fewer where the request's ``maxresults`` asks.
    """

    def __init__(self, root: Path, *, public: Iterable[str] = (), issued: Optional[str] = "stand-in-token",
                 accepted: Optional[Iterable[str]] = None, denied: Iterable[str] = (),
                 sas_signature: str = "stand-in+sig/==", identity_header: str = "stand-in-identity-header",
                 hierarchical: Iterable[str] = (), page_size: int = 5000, token_seconds: int = 3600) -> None:
        super().__init__()
        self.root = Path(root).resolve()
        self.public = set(public)
        self.hierarchical = set(hierarchical)
        self.issued = issued
        self.accepted = set(accepted) if accepted is not None else {issued} - {None}
        self.denied = set(denied)
        self.sas_signature = sas_signature
        self.identity_header = identity_header
        self.page_size = page_size
        self.token_seconds = token_seconds
        self.listing_fault: Optional[str] = None  # "same-token", "new-tokens": see the module
        self.listed_names: tuple[str, ...] = ()
        self.listing_document: Optional[bytes] = None
        self._tokens = count(1)
        self.requests: list[Seen] = []

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        if self._server is None:
            raise RuntimeError("the server runs only inside its with block")
        return f"http://127.0.0.1:{self._server.server_port}"

    @property
    def endpoint(self) -> str:
        """The Blob service endpoint of the stand-in's account (path-style, as Azurite's)."""
        return f"{self.url}/{ACCOUNT}"

    @property
    def sas_token(self) -> str:
        """A SAS token (a query, no ``?``) the server accepts, its signature percent-encoded as the service gives it."""
        return ("sv=2023-11-03&ss=b&srt=co&sp=rl&se=2099-01-01T00%3A00%3A00Z&spr=https%2Chttp"
                f"&sig={quote(self.sas_signature, safe='')}")

    def connection_string(self, **settings: str) -> str:
        """``AZURE_STORAGE_CONNECTION_STRING`` naming this server's endpoint, with ``settings`` added."""
        fields = {"BlobEndpoint": self.endpoint, "AccountName": ACCOUNT, **settings}
        return ";".join(f"{name}={value}" for name, value in fields.items())

    def identity_env(self) -> dict[str, str]:
        """App Service's managed identity variables naming this server's token endpoint."""
        return {"IDENTITY_ENDPOINT": f"{self.url}{TOKEN_PATH}", "IDENTITY_HEADER": self.identity_header}

    def no_identity_env(self) -> dict[str, str]:
        """Sends azure-identity's instance metadata requests here, where no identity is assigned: what a machine
        off Azure has, answered at once (169.254.169.254 itself may be a real one, or hang up to the probe's
        timeout), and no retries, as for a refused connection."""
        return {"AZURE_POD_IDENTITY_AUTHORITY_HOST": self.url}

    def put(self, container: str, name: str, source: Path) -> None:
        """Upload ``source`` as the blob ``name``, replacing (a new file, a new ETag) what was there."""
        target = self.root / container / name
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = target.with_name(target.name + ".uploading")
        staged.write_bytes(Path(source).read_bytes())
        os.replace(staged, target)

    def make_container(self, container: str, *, public: bool = False, hierarchical: bool = False) -> None:
        (self.root / container).mkdir(parents=True, exist_ok=True)
        if public:
            self.public.add(container)
        if hierarchical:
            self.hierarchical.add(container)

    # --- what the handler asks ------------------------------------------------------------------------------

    _container = CloudStandIn._folder

    def _entries(self, container: Path) -> dict[str, Optional[os.stat_result]]:
        """Every blob: a file's name and its stat; in a hierarchical container each folder too (``None``)."""
        found: dict[str, Optional[os.stat_result]] = {}
        for path in container.rglob("*"):
            name = path.relative_to(container).as_posix()
            if path.is_file() and not path.name.endswith(".uploading"):
                found[name] = path.stat()
            elif path.is_dir() and container.name in self.hierarchical:
                found[name] = None
        return found


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    timeout = 60
    server: TrackedHTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    @property
    def owner(self) -> AzureServer:
        return self.server.owner

    def do_HEAD(self) -> None:
        self._storage(head=True)

    def do_GET(self) -> None:
        if self.path.partition("?")[0] == TOKEN_PATH:
            return self._token()
        if self.path.partition("?")[0] == IMDS_TOKEN_PATH:
            return self._json(400, {"error": "invalid_request", "error_description": "Identity not found"})
        self._storage(head=False)

    def _token(self) -> None:
        query = {k: v[-1] for k, v in parse_qs(self.path.partition("?")[2]).items()}
        if self.headers.get("X-IDENTITY-HEADER") != self.owner.identity_header:
            return self._json(401, {"statusCode": 401, "message": "The identity header is missing or wrong."})
        if query.get("api-version") != "2019-08-01" or query.get("resource") != STORAGE_RESOURCE:
            return self._json(400, {"statusCode": 400, "message": f"Unexpected request {query}."})
        token = self.owner._issue()
        if token is None:
            return self._json(400, {"statusCode": 400, "message": "No managed identity is assigned to this app."})
        self._json(200, {"access_token": token, "expires_on": str(int(time.time()) + self.owner.token_seconds),
                         "resource": STORAGE_RESOURCE, "token_type": "Bearer", "client_id": "stand-in-client"})

    def _storage(self, *, head: bool) -> None:
        raw, _, query_text = self.path.partition("?")
        query = {k: v[-1] for k, v in parse_qs(query_text, keep_blank_values=True).items()}
        account, _, rest = raw.lstrip("/").partition("/")
        container_name, _, name = rest.partition("/")
        container_name, name = unquote(container_name), unquote(name)
        if unquote(account) != ACCOUNT or not container_name:
            return self._error(400, "InvalidUri", "The requested URI does not represent any resource on the server.")
        if not self._authorized(container_name, query):
            return
        container = self.owner._container(container_name)
        if container is None:
            return self._error(404, "ContainerNotFound", "The specified container does not exist.")
        if not name:
            if query.get("restype") == "container" and query.get("comp") == "list" and not head:
                return self._list(container, query)
            return self._error(400, "InvalidQueryParameterValue", "Value for one of the query parameters is not valid.")
        if container_name in self.owner.hierarchical and (container / name).is_dir():
            return self._blob(None, 0, etag_of((container / name).stat()), folder=True)
        opened = self.owner._open(container, name)
        if opened is None:
            return self._error(404, "BlobNotFound", "The specified blob does not exist.")
        with opened as file:
            info = os.fstat(file.fileno())
            self._blob(file, info.st_size, etag_of(info))

    def _authorized(self, container: str, query: dict[str, str]) -> bool:
        given = self.headers.get("Authorization")
        if "sig" in query:
            if query["sig"] != self.owner.sas_signature:
                self._error(403, "AuthenticationFailed", "Server failed to authenticate the request. Make sure the "
                            "value of Authorization header is formed correctly including the signature.\n"
                            "AuthenticationErrorDetail:Signature did not match.")
                return False
            return True
        if given is None:
            if container in self.owner.public:
                return True
            self._error(404, "ResourceNotFound", "The specified resource does not exist.")
            return False
        if not given.startswith("Bearer ") or (self.headers.get("x-ms-version") or "") < BEARER_VERSION:
            self._error(400, "InvalidHeaderValue", "Authentication scheme Bearer is not supported in this version.")
            return False
        token = given[len("Bearer "):]
        if token in self.owner.denied:
            self._error(403, "AuthorizationPermissionMismatch",
                        "This request is not authorized to perform this operation using this permission.")
            return False
        if token not in self.owner.accepted:
            self._error(401, "InvalidAuthenticationInfo", "Server failed to authenticate the request. Please refer "
                        "to the information in the www-authenticate header.",
                        {"WWW-Authenticate": "Bearer authorization_uri=https://login.microsoftonline.com/tenant/"
                                             "oauth2/authorize resource_id=https://storage.azure.com"})
            return False
        return True

    def _blob(self, file: Optional[BinaryIO], size: int, etag: str, *, folder: bool = False) -> None:
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes", "ETag": f'"{etag}"',
                   "x-ms-blob-type": "BlockBlob", "x-ms-version": "2023-11-03"}
        if folder:
            headers["x-ms-meta-hdi_isfolder"] = "true"
        wanted_tag = self.headers.get("If-Match")
        if wanted_tag is not None and wanted_tag.strip() not in (f'"{etag}"', "*"):
            return self._error(412, "ConditionNotMet", "The condition specified using HTTP conditional header(s) "
                               "is not met.")
        try:
            wanted = single_range(self.headers.get("Range"), size)
        except ValueError:
            return self._error(416, "InvalidRange", "The range specified is invalid for the current size of the "
                               "resource.", {"Content-Range": f"bytes */{size}"})
        start, end = wanted if wanted is not None else (0, size - 1)
        self.send_response(206 if wanted is not None else 200)
        for name, value in headers.items():
            self.send_header(name, value)
        if wanted is not None:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        self._record(206 if wanted is not None else 200)
        if end >= start and file is not None and self.command == "GET":
            try:
                self.connection.sendfile(file, start, end - start + 1)
            except OSError:
                self.close_connection = True

    def _list(self, container: Path, query: dict[str, str]) -> None:
        prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
        with_metadata = "metadata" in query.get("include", "").split(",")
        blobs = self.owner._entries(container)
        entries: dict[str, bool] = {}  # blob name or prefix -> whether it is a prefix
        for name in blobs:
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            if delimiter and delimiter in rest:
                entries.setdefault(prefix + rest.split(delimiter)[0] + delimiter, True)
            else:
                entries[name] = False
        if self.owner.listing_document is not None:
            return self._send(200, self.owner.listing_document, {"Content-Type": "application/xml"})
        ordered = sorted(entries)
        fault = self.owner.listing_fault
        # a faulty listing knows no marker of its own
        start = _marker_index(query["marker"]) if query.get("marker") and not fault else 0
        if start is None:
            return self._error(400, "OutOfRangeInput", "One of the request inputs is out of range.")
        size = min(self.owner.page_size, int(query.get("maxresults") or 5000))
        page = ordered[start:start + size]
        parts = [f'<?xml version="1.0" encoding="utf-8"?><EnumerationResults ServiceEndpoint="{self.owner.url}/'
                 f'{ACCOUNT}/" ContainerName="{escape(container.name)}"><Prefix>{escape(prefix)}</Prefix>'
                 f'<Delimiter>{escape(delimiter)}</Delimiter><Blobs>']
        for entry in page:
            if entries[entry]:
                parts.append(f"<BlobPrefix>{_name_element(entry)}</BlobPrefix>")
                continue
            info = blobs[entry]
            folder = info is None
            info = info or (container / entry).stat()
            metadata = "<Metadata><hdi_isfolder>true</hdi_isfolder></Metadata>" if folder else "<Metadata />"
            parts.append(f"<Blob>{_name_element(entry)}<Properties><Content-Length>"
                         f"{0 if folder else info.st_size}</Content-Length><Etag>{etag_of(info)}</Etag>"
                         f"<BlobType>BlockBlob</BlobType></Properties>{metadata if with_metadata else ''}</Blob>")
        parts += [f"<Blob>{_name_element(name)}<Properties><Content-Length>1</Content-Length><Etag>0x8D0</Etag>"
                  "<BlobType>BlockBlob</BlobType></Properties></Blob>" for name in self.owner.listed_names]
        if fault:
            marker = _marker(0) if fault == "same-token" else _marker(next(self.owner._tokens))
        else:
            marker = _marker(start + len(page)) if start + len(page) < len(ordered) else ""
        parts.append(f"</Blobs><NextMarker>{escape(marker)}</NextMarker></EnumerationResults>")
        self._send(200, "".join(parts).encode(), {"Content-Type": "application/xml"})

    def _record(self, status: int) -> None:
        self.owner._record(Seen(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, status))

    def _json(self, status: int, value: Any) -> None:
        self._send(status, json.dumps(value).encode(), {"Content-Type": "application/json"})

    def _error(self, status: int, code: str, message: str, headers: Optional[dict[str, str]] = None) -> None:
        request_id = hashlib.blake2b(os.urandom(8), digest_size=16).hexdigest()
        body = (f'<?xml version="1.0" encoding="utf-8"?><Error><Code>{code}</Code><Message>{escape(message)}\n'
                f"RequestId:{request_id}\nTime:{time.strftime('%Y-%m-%dT%H:%M:%S.0000000Z', time.gmtime())}"
                "</Message></Error>").encode()
        self._send(status, body, {"Content-Type": "application/xml", "x-ms-error-code": code, **(headers or {})})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self._record(status)
        if self.command == "HEAD":
            return  # a HEAD's answer has no body: its error code is in x-ms-error-code
        try:
            self.wfile.write(body)
        except OSError:
            self.close_connection = True


AzureServer.handler = _Handler
