"""``az://container/key`` and ``az://container/prefix/`` sources: Azure Blob Storage, or an emulator of it (Azurite).

URLs are written as adlfs (fsspec) and Run:ai Model Streamer write them: the
container first, the account from ``AZURE_STORAGE_ACCOUNT_NAME`` (adlfs,
Run:ai) or ``AZURE_STORAGE_ACCOUNT`` (the az CLI), the service at
``https://ACCOUNT.blob.core.windows.net``; ``AZURE_STORAGE_CONNECTION_STRING``,
where set, names them instead (its ``BlobEndpoint``: Azurite, a private
endpoint) and may carry a ``SharedAccessSignature``. ``abfs://`` and
``abfss://`` read as ``az://`` (adlfs takes all three), and any of them may
name the account as Spark writes it, ``abfss://CONTAINER@ACCOUNT.dfs.core.windows.net/key``:
that account's blob endpoint is asked (a Data Lake account answers the Blob
API, its folders empty blobs marked ``hdi_isfolder``, skipped).
``az://ACCOUNT.blob.core.windows.net/...`` is refused with these forms; an
``https://`` URL of a blob is the http source's.

What authorizes the requests, first found first: nothing with ``anonymous``
(the CLI's ``--no-sign-request``: a public container); a SAS token
(``AZURE_STORAGE_SAS_TOKEN``, else the connection string's), appended to every
URL, no library needed; else a token azure-identity's DefaultAzureCredential
finds (the ``remote`` extra: a service principal in the environment,
workload identity, managed identity, the Azure CLI's login...), asked for
the storage scope and sent as ``Authorization: Bearer``, renewed before it
expires. An account key (a connection string's ``AccountKey``) would need
shared-key signing written here, and is refused with the ways that need none.

Everything else is the Blob REST API over :class:`~.http.Transport`: a folder
is a listing of its prefix (``delimiter=/``), a blob's size and ETag a HEAD,
its bytes ranged GETs received straight into the tensor's memory, each
``If-Match`` the ETag first seen, so a blob replaced during a load is an
error, never a model of two versions.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Optional
from urllib.parse import quote, unquote, urlencode, urlsplit
from xml.etree.ElementTree import Element

import defusedxml
import defusedxml.ElementTree as defused

from ..errors import CheckpointAccessError, CheckpointError, CheckpointNotFoundError
from .http import Transport, server_words
from .listing import ListingPages
from .remotepath import ObjectInfo, RemotePath
from .settings import RemoteOptions

API_VERSION = "2023-11-03"  # bearer tokens need 2017-11-09 or later
SCOPE = "https://storage.azure.com/.default"
ACCOUNT_VARIABLES = ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT")  # adlfs and Run:ai's, the az CLI's
CONNECTION_VARIABLE = "AZURE_STORAGE_CONNECTION_STRING"
SAS_VARIABLE = "AZURE_STORAGE_SAS_TOKEN"
AZURITE = {"blobendpoint": "http://127.0.0.1:10000/devstoreaccount1", "accountname": "devstoreaccount1",
           "accountkey": "the emulator's well-known key"}  # what UseDevelopmentStorage=true stands for
REFRESH_SECONDS = 300.0  # a token is renewed this long before it expires: no part in flight carries a stale one
ANONYMOUS_HINT = ("for a public container, read it without credentials: --no-sign-request "
                  "(RemoteOptions(anonymous=True))")
# What an anonymous reader is told of a container it may not read: its blobs hidden (404), or no anonymous reads
ANONYMOUS_REFUSALS = ("ResourceNotFound", "NoAuthenticationInformation", "PublicAccessNotPermitted")
IDENTITY_HINT = ("sign in where azure-identity's DefaultAzureCredential looks (`az login`, AZURE_CLIENT_ID/"
                 "AZURE_TENANT_ID/AZURE_CLIENT_SECRET, a workload or managed identity) or set AZURE_STORAGE_SAS_TOKEN")
CREDENTIALS_HINT = f"{IDENTITY_HINT}; {ANONYMOUS_HINT}"
FORMS = "az://CONTAINER/key with AZURE_STORAGE_ACCOUNT_NAME set, or az://CONTAINER@ACCOUNT.blob.core.windows.net/key"
_NAMED_ACCOUNT = re.compile(r"^([a-z0-9]{3,24})\.(?:blob|dfs)\.([a-z0-9.-]+)$")


@dataclass(frozen=True)
class Account:
    """Where one account's requests go, and the SAS token or account key its configuration gives."""

    endpoint: str
    sas: Optional[str]
    key_given: bool


def _connection_settings(url: str) -> dict[str, str]:
    """``AZURE_STORAGE_CONNECTION_STRING`` as a dict, names lower-cased as the Azure SDKs read them; ``{}`` unset."""
    text = os.environ.get(CONNECTION_VARIABLE, "").strip()
    settings = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, equals, value = part.partition("=")
        if not equals:
            raise CheckpointError(f"{CONNECTION_VARIABLE} is no connection string (NAME=VALUE;...)", path=url)
        settings[name.strip().lower()] = value.strip()
    if settings.get("usedevelopmentstorage", "").lower() == "true":
        settings = {**AZURITE, **settings}
    return settings


def account_for(url: str, named: Optional[str]) -> Account:
    """The account a URL reads: the one it names (``ACCOUNT.blob.SUFFIX``, or ``.dfs.``), else the connection
    string's, else the one the environment names; no account is a one-line error saying what to set."""
    settings = _connection_settings(url)
    sas = os.environ.get(SAS_VARIABLE, "").strip() or None
    if named is not None:
        found = _NAMED_ACCOUNT.match(named.lower())
        if found is None:
            raise CheckpointError(f"{named!r} names no storage account: write {FORMS}", path=url)
        if settings.get("accountname", "").lower() != found[1]:
            settings = {}  # the connection string is another account's
        endpoint = settings.get("blobendpoint") or f"https://{found[1]}.blob.{found[2]}"
    elif settings:
        endpoint = settings.get("blobendpoint", "")
        if not endpoint and settings.get("accountname"):
            endpoint = (f"{settings.get('defaultendpointsprotocol', 'https')}://{settings['accountname']}.blob."
                        f"{settings.get('endpointsuffix', 'core.windows.net')}")
        if not endpoint:
            raise CheckpointError(f"{CONNECTION_VARIABLE} names neither a BlobEndpoint nor an AccountName", path=url)
    else:
        name = next((os.environ[v].strip() for v in ACCOUNT_VARIABLES if os.environ.get(v, "").strip()), None)
        if name is None:
            raise CheckpointError(f"no storage account named: set AZURE_STORAGE_ACCOUNT_NAME (or "
                                  f"{CONNECTION_VARIABLE}), or write az://CONTAINER@ACCOUNT.blob.core.windows.net/key",
                                  path=url)
        endpoint = f"https://{name}.blob.core.windows.net"
    sas = sas or settings.get("sharedaccesssignature") or None
    return Account(endpoint.rstrip("/"), sas.lstrip("?") if sas else None, bool(settings.get("accountkey")))


def _azure_identity(name: str):
    try:
        import azure.identity
    except ImportError:
        raise CheckpointError("az:// sources need azure-identity for credentials: pip install 'torch-materialize"
                              "[remote]' (a SAS token needs none: AZURE_STORAGE_SAS_TOKEN; a public container: "
                              "--no-sign-request)", path=name) from None
    # Its warnings (a failed chain, at length) would reach stderr through logging's last resort, beside the
    # one-line error; where logging is configured they still propagate to its handlers.
    quiet = logging.getLogger("azure.identity")
    if not any(isinstance(handler, logging.NullHandler) for handler in quiet.handlers):
        quiet.addHandler(logging.NullHandler())
    return azure.identity


def _attempts(exc: BaseException) -> str:
    """DefaultAzureCredential's account of each credential it tried, on one line: of each, its first sentence and
    those that report an error (a token endpoint's answer, an AADSTS code), not its links to guides."""
    text = getattr(exc, "message", None) or str(exc)
    tried = []
    for attempt in text.split("\n\t")[1:] or [text]:
        label, _, said = attempt.splitlines()[0].partition(": ")
        sentences = [s for s in re.split(r"(?<=\.)\s+", said or label) if "://" not in s]
        kept = sentences[:1] + [s for s in sentences[1:] if re.search(r"error|AADSTS", s, flags=re.IGNORECASE)]
        words = " ".join(" ".join(kept).split()).rstrip(".")[:200]
        tried.append(words if not said or words.startswith(label) else f"{label}: {words}")
    return "; ".join(tried)


class _Credentials:
    """DefaultAzureCredential, made on first use; its token kept until shortly before it expires, then renewed by
    one thread while the others wait for it, not by every request in flight."""

    def __init__(self, name: str) -> None:
        self._identity = _azure_identity(name)
        self._credential = None
        self._token: Optional[tuple[str, float]] = None
        self._lock = threading.Lock()

    def token(self, *, name: str) -> str:
        with self._lock:
            if self._token is None or self._token[1] - time.time() < REFRESH_SECONDS:
                self._token = self._fetch(name)
            return self._token[0]

    def _fetch(self, name: str) -> tuple[str, float]:
        from azure.core.exceptions import AzureError, ClientAuthenticationError

        try:
            if self._credential is None:
                self._credential = self._identity.DefaultAzureCredential()
            found = self._credential.get_token(SCOPE)
        except ClientAuthenticationError as exc:
            raise CheckpointAccessError(f"no Azure credentials gave a token (DefaultAzureCredential: "
                                        f"{_attempts(exc)}); {CREDENTIALS_HINT}", path=name) from None
        except (AzureError, ValueError) as exc:  # ValueError: a setting it refuses (AZURE_TOKEN_CREDENTIALS)
            raise CheckpointAccessError(f"Azure credentials failed: {_attempts(exc)}", path=name) from None
        return found.token, float(found.expires_on)


class AzureStore:
    """One container: its listings and blobs' sizes from the Blob REST API, its bytes through ranged GETs, all
    over one :class:`~.http.Transport`, authorized as the module says."""

    def __init__(self, container: str, account: Account, options: RemoteOptions, *, prefix: str) -> None:
        self.container = container
        self.endpoint = account.endpoint
        self.transport = Transport(options)
        self.anonymous = options.anonymous
        self.prefix = prefix  # how messages name the container: the URL's own scheme and form
        self.sas = None if options.anonymous else account.sas
        self._credentials = None if options.anonymous or self.sas else _Credentials(self.url(""))
        self._blobs: dict[str, Optional[ObjectInfo]] = {}
        self._lock = threading.Lock()

    def url(self, key: str) -> str:
        return self.prefix + key

    def _request_url(self, key: Optional[str], query: Optional[dict[str, str]] = None) -> str:
        """A blob's URL (``key``), or the container's with ``query``; the SAS token last, as it was given."""
        url = f"{self.endpoint}/{quote(self.container, safe='')}"
        if key is not None:
            url += "/" + quote(key, safe="/~")
        queries = ([urlencode(query)] if query else []) + ([self.sas] if self.sas else [])
        return url + ("?" + "&".join(queries) if queries else "")

    def _headers(self, key: str) -> dict[str, str]:
        headers = {"x-ms-version": API_VERSION}
        if self._credentials is not None:
            headers["Authorization"] = "Bearer " + self._credentials.token(name=self.url(key))
        return headers

    def _refuse(self, status: int, code: str, words: str, what: str, key: str) -> None:
        """Raise the one-line error an answer other than 200 is, or return where it is a missing blob."""
        if status == 404 and code == "ContainerNotFound":
            raise CheckpointNotFoundError(f"no such container {self.container!r} at {self.endpoint}",
                                          path=self.url(key))
        hidden = self.anonymous and code in ANONYMOUS_REFUSALS
        if status == 404 and not hidden:
            return
        if status not in (401, 403) and not hidden:
            raise CheckpointAccessError(f"Azure {what} answered HTTP {status}{words}", path=self.url(key))
        if self.anonymous:
            hint = "the container does not allow reads without credentials: leave --no-sign-request out"
        elif status == 401 or code in ("AuthenticationFailed", "InvalidAuthenticationInfo"):
            hint = ("the SAS token was refused (expired, or signed for another account): make a new one"
                    if self.sas else f"the token was refused: {IDENTITY_HINT}")
        else:
            hint = ("the SAS token does not allow reading and listing this container (sp=rl)" if self.sas else
                    "the identity found may not read this container (the Storage Blob Data Reader role)")
        raise CheckpointAccessError(f"access refused (HTTP {status}{words}); {hint}", path=self.url(key))

    def stat(self, key: str) -> Optional[ObjectInfo]:
        with self._lock:
            if key in self._blobs:
                return self._blobs[key]
        found = None
        if key:
            url = self._request_url(key)
            answer = self.transport.head(url, self._headers(key), what="Azure HEAD", name=self.url(key))
            code = answer.headers.get("x-ms-error-code", "")
            if answer.status != 200:
                self._refuse(answer.status, code, f" {code}" if code else "", "HEAD", key)
            elif answer.headers.get("x-ms-meta-hdi_isfolder", "").lower() != "true":  # a Data Lake folder
                found = _info(answer.headers.get("content-length"), answer.headers.get("etag"), self.url(key))
        with self._lock:
            return self._blobs.setdefault(key, found)

    def listing(self, key: str) -> Optional[tuple[list[str], list[str]]]:
        prefix = key + "/" if key else ""
        files: list[str] = []
        folders: list[str] = []
        pages = ListingPages(self.url(prefix), self.transport.options)
        marker: Optional[str] = None
        while True:
            query = {"restype": "container", "comp": "list", "prefix": prefix, "delimiter": "/",
                     "include": "metadata"}
            if marker:
                query["marker"] = marker
            url = self._request_url(None, query)
            answer = self.transport.get(lambda: (url, self._headers(key)), name=self.url(key), what="Azure list")
            if answer.status != 200:
                code = answer.headers.get("x-ms-error-code", "")
                self._refuse(answer.status, code, server_words(answer.body) or (f" {code}" if code else ""), "list",
                             key)
                return None
            page = _xml(answer.body, pages.url)
            # a Data Lake account lists its folders as empty blobs too: they are its BlobPrefixes, not files
            found = [(_name(blob)[len(prefix):], blob) for blob in page.iterfind("Blobs/Blob")
                     if (blob.findtext("Metadata/hdi_isfolder") or "").lower() != "true"]
            found = [(name, blob) for name, blob in found if name]
            page_folders = [_name(named)[len(prefix):].rstrip("/") for named in page.iterfind("Blobs/BlobPrefix")]
            pages.page([name for name, _ in found] + page_folders)
            for name, blob in found:
                files.append(name)
                info = _info(blob.findtext("Properties/Content-Length"), blob.findtext("Properties/Etag"),
                             self.url(prefix + name))
                with self._lock:
                    self._blobs[prefix + name] = info
            folders += page_folders
            marker = pages.next_token(page.findtext("NextMarker"))
            if marker is None:
                break
        if not files and not folders:
            return None
        return files, folders

    def read_into(self, key: str, offset: int, views: list[memoryview], *, tensor: Optional[str]) -> None:
        info = self.stat(key)
        if info is None:
            raise CheckpointNotFoundError("no such blob", path=self.url(key), tensor=tensor)
        url = self._request_url(key)
        self.transport.read_into(lambda: (url, self._headers(key)), offset, views, size=info.size, etag=info.etag,
                                 name=self.url(key), tensor=tensor)

    def close(self) -> None:
        self.transport.close()


def _xml(body: bytes, name: str) -> Element:
    """A listing page's XML. A document type (where entities would be declared, to expand a few bytes into
    gigabytes or read a local file) is refused by the parser itself, in whatever encoding the document declares:
    a search of the bytes misses one written in UTF-16."""
    try:
        return defused.fromstring(body, forbid_dtd=True)
    except defusedxml.DefusedXmlException as exc:
        raise CheckpointAccessError(f"the Azure listing declares a document type or entities ({type(exc).__name__}):"
                                    " refused", path=name) from None
    except defused.ParseError as exc:
        raise CheckpointAccessError(f"the Azure listing is not XML ({exc})", path=name) from None


def _name(element: Element) -> str:
    found = element.find("Name")
    if found is None:
        return ""
    return unquote(found.text or "") if found.get("Encoded") == "true" else found.text or ""


def _info(length: Optional[str], etag: Optional[str], name: str) -> ObjectInfo:
    """A blob's size and its ETag, quoted as a header gives it (a listing gives it bare)."""
    if length is None or not length.strip().isdigit() or not etag:
        raise CheckpointAccessError("Azure gave no size and ETag for the blob", path=name)
    etag = etag.strip()
    return ObjectInfo(int(length), etag if etag.startswith(('"', "W/")) else f'"{etag}"')


def _this_machine(endpoint: str) -> bool:
    host = urlsplit(endpoint).hostname or ""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def open_azure(url: str, options: RemoteOptions) -> RemotePath:
    """The blob, or the folder (a prefix), ``az://container/key`` names (``abfs://``, ``abfss://`` alike)."""
    scheme, rest = url.split("://", 1)
    where, _, key = rest.partition("/")
    container, at, named = where.partition("@")
    if not container:
        raise CheckpointError(f"names no container: write {FORMS}", path=url)
    if "." in container:
        raise CheckpointError(f"{container!r} is no container name (they have no dots): write {FORMS}", path=url)
    account = account_for(url, named if at else None)
    if not options.anonymous and not account.sas:
        if account.key_given:
            raise CheckpointAccessError(f"the AccountKey of {CONNECTION_VARIABLE} is not used (shared-key signing is "
                                        f"not done here): put a SAS token in it (SharedAccessSignature=...) or in "
                                        f"{SAS_VARIABLE}, or unset it, set AZURE_STORAGE_ACCOUNT_NAME and sign in as "
                                        "DefaultAzureCredential finds (`az login`, a service principal, a managed "
                                        f"identity); {ANONYMOUS_HINT}", path=url)
        if urlsplit(account.endpoint).scheme != "https" and not _this_machine(account.endpoint):
            raise CheckpointAccessError(f"an Azure token is sent over https only, and {account.endpoint} is not: "
                                        f"use its https endpoint, or a SAS token ({SAS_VARIABLE})", path=url)
        _azure_identity(url)  # its absence named with the whole URL, before anything is asked
    store = AzureStore(container, account, options, prefix=f"{scheme.lower()}://{where}/")
    if not key or key.endswith("/"):
        return RemotePath(store, key, folder=True)
    return RemotePath(store, key)  # a blob, or a prefix written without its slash: the store is asked which
