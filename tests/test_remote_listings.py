"""Folder listings of every store that lists page by page (s3://, gs://, az://), against its test server started in
this process and switched to misbehave: a store that never ends a listing (its continuation token repeated, or a
new one each time), one listing more names than a load may hold, one listing names no store should (NUL, a control
character, a ``..`` component, a leading ``/``), and, for Azure, a listing document declaring entities in UTF-16.
Each is refused in one line naming the listing, after a bounded number of requests, never a loop or a raw error."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import materialize as mz
from materialize.sources import SCHEMES, open_url
from tests.azure_server import AzureServer
from tests.conftest import write_safetensors
from tests.gcs_server import GcsServer
from tests.remote_checks import small_state
from tests.s3_server import InProcessS3Server

pytest.importorskip("botocore")
pytest.importorskip("moto")  # the dev lock's; make test-oldest has botocore's floor but no server to test against

BUCKET = "listings"  # a public bucket (container): the listings are under test here, not credentials
# This machine's own AWS, Google and Azure settings are no part of a test's environment.
OWN = ("AWS_", "AZURE_", "IDENTITY_", "MSI_", "STORAGE_EMULATOR_HOST", "GOOGLE_", "CLOUDSDK_")


@dataclass
class ListingStore:
    """One store's test server, reached as the source reaches it: ``env`` set, anonymous reads of ``BUCKET``."""

    scheme: str
    server: Any  # InProcessS3Server, GcsServer, AzureServer: each with listing_fault, listed_names, page_size
    env: dict[str, str]
    list_requests: Callable[[], int]

    def url(self, folder: str) -> str:
        return f"{self.scheme}://{BUCKET}/{folder}/"

    def put(self, key: str, source: Path) -> None:
        self.server.put(BUCKET, key, source)


@contextlib.contextmanager
def _s3(root: Path) -> Iterator[ListingStore]:
    with InProcessS3Server() as server:
        server.make_bucket(BUCKET, public=True)
        yield ListingStore("s3", server, server.env(), lambda: server.list_requests)


@contextlib.contextmanager
def _gcs(root: Path) -> Iterator[ListingStore]:
    with GcsServer(root, public=[BUCKET]) as server:
        server.make_bucket(BUCKET, public=True)
        lists = f"/storage/v1/b/{BUCKET}/o?"
        yield ListingStore("gs", server, server.env(), lambda: sum(r.path.startswith(lists) for r in server.seen()))


@contextlib.contextmanager
def _azure(root: Path) -> Iterator[ListingStore]:
    with AzureServer(root) as server:
        server.make_container(BUCKET, public=True)
        yield ListingStore("az", server, {"AZURE_STORAGE_CONNECTION_STRING": server.connection_string()},
                           lambda: sum("comp=list" in r.path for r in server.seen()))


SERVERS = {"s3": _s3, "gs": _gcs, "az": _azure}


def _listing_schemes() -> list[str]:
    """Each store that lists a folder page by page, by the first scheme that opens it (``az``, not its aliases
    ``abfs`` and ``abfss``): every source but the http(s) one, which probes for known names instead. A store
    added to SCHEMES with no server in SERVERS is an error of every test here, never silently untested."""
    first: dict[Callable, str] = {}
    for scheme, opener in SCHEMES.items():
        if scheme not in ("http", "https"):
            first.setdefault(opener, scheme)
    return list(first.values())


@pytest.fixture(scope="module", params=_listing_schemes())
def started(request, tmp_path_factory) -> Iterator[ListingStore]:
    with SERVERS[request.param](tmp_path_factory.mktemp(request.param)) as store:
        yield store


SWITCHES = ("listing_fault", "listed_names", "page_size", "listing_document")


@pytest.fixture
def store(started, monkeypatch) -> Iterator[ListingStore]:
    """The store's server, behaving again after the test, whatever it switched."""
    for name in [n for n in os.environ if n.startswith(OWN)]:
        monkeypatch.delenv(name)
    for name, value in started.env.items():
        monkeypatch.setenv(name, value)
    behaving = {switch: vars(started.server)[switch] for switch in SWITCHES if switch in vars(started.server)}
    yield started
    for switch, value in behaving.items():
        setattr(started.server, switch, value)


def _options(**bounds: int) -> mz.RemoteOptions:
    return mz.RemoteOptions(anonymous=True, retries=0, **bounds)


def _files(store: ListingStore, folder: str, count: int, tmp_path: Path) -> None:
    source = write_safetensors(small_state(), tmp_path / "model.safetensors")
    for number in range(count):
        store.put(f"{folder}/file-{number}.safetensors", source)


def _listed(store: ListingStore, folder: str, options: mz.RemoteOptions) -> list[str]:
    return sorted(path.name for path in open_url(store.url(folder), options).iterdir())


def _refused(store: ListingStore, folder: str, options: mz.RemoteOptions) -> str:
    """The one-line refusal listing ``folder`` ends in, checked to name the listing."""
    with pytest.raises(mz.CheckpointError) as refused:
        _listed(store, folder, options)
    message = str(refused.value)
    assert store.url(folder) in message and message.isprintable(), message
    return message


def test_a_listing_is_read_to_max_listing_pages_and_refused_past_it(store, tmp_path):
    _files(store, "paged", 6, tmp_path)
    store.server.page_size = 2  # 3 pages
    before = store.list_requests()
    listed = _listed(store, "paged", _options(max_listing_pages=3))
    assert listed == [f"file-{n}.safetensors" for n in range(6)]
    assert store.list_requests() - before == 3
    message = _refused(store, "paged", _options(max_listing_pages=2))
    assert "past 2 pages" in message and "RemoteOptions(max_listing_pages=...)" in message
    assert store.list_requests() - before == 3 + 2


def test_a_repeated_continuation_token_is_refused_at_once(store, tmp_path):
    _files(store, "repeated", 2, tmp_path)
    store.server.listing_fault = "same-token"
    before = store.list_requests()
    message = _refused(store, "repeated", _options())
    assert "repeated its continuation token" in message
    assert store.list_requests() - before == 2  # the page that gave the token, and the one that gave it again


def test_endless_new_tokens_stop_at_max_listing_pages(store, tmp_path):
    _files(store, "endless", 2, tmp_path)
    store.server.listing_fault = "new-tokens"
    before = store.list_requests()
    message = _refused(store, "endless", _options(max_listing_pages=5))
    assert "past 5 pages" in message and "RemoteOptions(max_listing_pages=...)" in message
    assert store.list_requests() - before == 5


# How the names come, and how many pages the listing takes until the one that passes max_listing_names
NAMES_BY_PAGE = {"one page": 1, "pages of 2": 3, "the same 3 on endless pages": 3}


@pytest.mark.parametrize("pages", NAMES_BY_PAGE)
def test_a_listing_is_read_to_max_listing_names_and_refused_past_it(store, tmp_path, pages):
    folder = "names-by-" + pages.replace(" ", "-")
    count = 3 if pages == "the same 3 on endless pages" else 6
    _files(store, folder, count, tmp_path)
    if pages == "pages of 2":
        store.server.page_size = 2
    if pages != "the same 3 on endless pages":  # at the bound, every name is read
        assert len(_listed(store, folder, _options(max_listing_names=count))) == count
    else:
        store.server.listing_fault = "new-tokens"
    bound = 5 if pages != "the same 3 on endless pages" else 7
    before = store.list_requests()
    message = _refused(store, folder, _options(max_listing_names=bound))
    assert f"more than {bound} names" in message and "RemoteOptions(max_listing_names=...)" in message
    assert store.list_requests() - before == NAMES_BY_PAGE[pages]


BAD_NAMES = {
    "NUL": ("x\x00config.json", r"\x00"),
    "escape sequence": ("\x1b]52;c;cGF5bG9hZA==\x07config.json", r"\x1b"),
    "newline": ("config.json\nforged line", r"\n"),
    "C1 control": ("a\x9bconfig.json", r"\x9b"),
    "parent": ("../config.json", "'../config.json'"),
    "parent inside": ("sub/../../model.safetensors", "'sub/../../model.safetensors'"),
    "absolute": ("/etc/passwd", "'/etc/passwd'"),
}


@pytest.mark.parametrize("kind", BAD_NAMES)
def test_a_listed_name_no_store_should_list_refuses_the_load_naming_the_listing(store, tmp_path, kind):
    name, shown = BAD_NAMES[kind]
    folder = "names-" + kind.replace(" ", "-")
    _files(store, folder, 1, tmp_path)
    store.server.listed_names = (f"{folder}/{name}",)
    with pytest.raises(mz.CheckpointError) as refused:
        mz.load_tensors(store.url(folder), remote=_options())
    message = str(refused.value)
    assert message.startswith(store.url(folder) + ": ") and "the store listed the name" in message, message
    assert shown in message and message.isprintable(), message
    assert refused.value.path == store.url(folder)


def _billion_laughs() -> str:
    entities = '<!ENTITY lol0 "lol">' + "".join(f'<!ENTITY lol{n} "{f"&lol{n - 1};" * 10}">' for n in range(1, 10))
    return (f'<!DOCTYPE EnumerationResults [{entities}]><EnumerationResults><Blobs><Blob><Name>&lol9;</Name>'
            "</Blob></Blobs><NextMarker /></EnumerationResults>")


def _one_entity() -> str:
    return ('<!DOCTYPE EnumerationResults [<!ENTITY name "folder/model.safetensors">]><EnumerationResults><Blobs>'
            "<Blob><Name>&name;</Name><Properties><Content-Length>1</Content-Length><Etag>0x8D0</Etag></Properties>"
            "</Blob></Blobs><NextMarker /></EnumerationResults>")


def _external_entity() -> str:
    return ('<!DOCTYPE EnumerationResults [<!ENTITY file SYSTEM "file:///etc/hostname">]><EnumerationResults>'
            "<Blobs><BlobPrefix><Name>&file;</Name></BlobPrefix></Blobs><NextMarker /></EnumerationResults>")


@pytest.mark.parametrize("started", ["az"], indirect=True)  # the one XML listing: S3's is botocore's, GCS's JSON
@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be"])
@pytest.mark.parametrize("document", [_billion_laughs, _one_entity, _external_entity])
def test_an_azure_listing_declaring_entities_in_utf16_is_refused(store, encoding, document):
    # A byte order mark, then the document in UTF-16: no byte sequence "<!DOCTYPE" anywhere in it
    body = b"\xff\xfe" if encoding == "utf-16-le" else b"\xfe\xff"
    body += f'<?xml version="1.0" encoding="UTF-16"?>{document()}'.encode(encoding)
    assert b"<!DOCTYPE" not in body and b"<!ENTITY" not in body
    store.server.listing_document = body
    message = _refused(store, "doctype", _options())
    assert "declares a document type" in message


@pytest.mark.parametrize("name", ["../config.json", "sub/../../x.safetensors", "/etc/passwd", "a\x00b.json",
                                  "m\x1b[2J.safetensors"])
def test_a_hub_file_list_naming_a_file_outside_the_repo_is_refused_naming_the_repo(name):
    from materialize.sources.http import Transport
    from materialize.sources.httpstore import HttpStore
    from materialize.sources.remotepath import ObjectInfo

    base = "https://hub.example/org/model/resolve/0123abcd/"
    files = {"config.json": ObjectInfo(2, None), name: ObjectInfo(1, None)}
    with pytest.raises(mz.CheckpointError, match="the store listed the name") as raised:
        HttpStore(base, Transport(mz.RemoteOptions()), files=files)
    assert raised.value.path == base
