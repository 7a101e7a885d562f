"""The stand-in hub serves huggingface_hub's own client as the hub does: listings, CDN redirects, ranges, tokens."""

from __future__ import annotations

import hashlib
import http.client
import json
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import huggingface_hub
import pytest
from huggingface_hub.errors import EntryNotFoundError, RevisionNotFoundError

from fake_hub import FakeHub

REPO = "some-org/some-model"
WEIGHTS = bytes(range(256)) * 40  # stands in for a safetensors file: only its bytes matter here
TOKEN = "hf_test_token"


@pytest.fixture
def root(tmp_path) -> Path:
    repo = tmp_path / "repos" / REPO
    (repo / "tokenizer").mkdir(parents=True)
    (repo / "config.json").write_text('{"hidden_size": 8}')
    (repo / "tokenizer" / "tokenizer.json").write_text('{"version": "1.0"}')
    (repo / "model.safetensors").write_bytes(WEIGHTS)
    return tmp_path / "repos"


@pytest.fixture(params=[None, TOKEN], ids=["public", "private"])
def hub(request, root, monkeypatch):
    """The fake, with huggingface_hub pointed at it; for a private repo the token comes from HF_TOKEN."""
    with FakeHub(root, token=request.param) as fake:
        fake.redirect_huggingface_hub(monkeypatch)
        if fake.token:
            monkeypatch.setenv("HF_TOKEN", fake.token)
        yield fake


def _http_status(error: BaseException) -> int | None:
    """The HTTP status behind an error: huggingface_hub before 1.0 wraps some (a 401 on a download) in another."""
    while error is not None:
        response = getattr(error, "response", None)
        if response is not None:
            return response.status_code
        error = error.__cause__ or error.__context__
    return None


def _connection(url: str) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=30), parts.path + (
        f"?{parts.query}" if parts.query else "")


def test_snapshot_download_of_json_patterns_gets_the_configs_and_no_weights(hub, tmp_path):
    folder = Path(huggingface_hub.snapshot_download(REPO, allow_patterns=["*.json"], cache_dir=tmp_path / "cache"))

    assert folder.name == hub.sha(REPO) and folder.parent.name == "snapshots"
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == [
        "config.json", "tokenizer/tokenizer.json"]
    assert json.loads((folder / "config.json").read_text()) == {"hidden_size": 8}
    assert hub.seen("cdn") == []


def test_hf_hub_download_follows_the_redirect_to_the_cdn_and_the_token_never_reaches_it(hub, tmp_path):
    path = huggingface_hub.hf_hub_download(REPO, "model.safetensors", cache_dir=tmp_path / "cache")

    assert Path(path).read_bytes() == WEIGHTS
    head = [r for r in hub.seen("hub") if r.method == "HEAD"]
    assert [r.path for r in head] == [f"/{REPO}/resolve/main/model.safetensors"]
    assert [(r.method, r.path.split("?")[0]) for r in hub.seen("cdn")] == [
        ("GET", f"/repos/{REPO}/{hashlib.sha256(WEIGHTS).hexdigest()}")]
    assert all("authorization" not in r.headers for r in hub.seen("cdn"))
    if hub.token:
        assert head[0].headers["authorization"] == f"Bearer {TOKEN}"


def test_model_info_lists_every_file_with_its_size_and_hashes(hub):
    for revision in ("main", hub.sha(REPO)):
        info = huggingface_hub.model_info(REPO, revision=revision, files_metadata=True)

        assert info.id == REPO and info.sha == hub.sha(REPO) and info.private == bool(hub.token)
        files = {s.rfilename: s for s in info.siblings}
        assert sorted(files) == ["config.json", "model.safetensors", "tokenizer/tokenizer.json"]
        assert files["model.safetensors"].size == len(WEIGHTS)
        assert files["model.safetensors"].lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest()
        config = b'{"hidden_size": 8}'
        assert files["config.json"].lfs is None and files["config.json"].size == len(config)
        assert files["config.json"].blob_id == hashlib.sha1(b"blob %d\0" % len(config) + config).hexdigest()
    assert [s.size for s in huggingface_hub.model_info(REPO).siblings] == [None, None, None]  # sizes only on request


def test_a_private_repo_is_401_without_the_token_or_with_a_wrong_one(root, tmp_path, monkeypatch):
    with FakeHub(root, token=TOKEN) as hub:
        hub.redirect_huggingface_hub(monkeypatch)
        calls = {
            "model_info": lambda token: huggingface_hub.model_info(REPO, token=token),
            "snapshot_download": lambda token: huggingface_hub.snapshot_download(
                REPO, allow_patterns=["*.json"], cache_dir=tmp_path / "cache", token=token),
            "hf_hub_download": lambda token: huggingface_hub.hf_hub_download(
                REPO, "config.json", cache_dir=tmp_path / "cache", token=token),
        }
        for name, call in calls.items():
            for token in (None, "hf_wrong"):
                with pytest.raises(Exception) as caught:
                    call(token)
                assert _http_status(caught.value) == 401, (name, token, caught.value)

        assert huggingface_hub.model_info(REPO, token=TOKEN).sha == hub.sha(REPO)
        assert all(r.headers.get("authorization") != f"Bearer {TOKEN}" for r in hub.requests[:-1])


def test_a_missing_file_or_revision_is_the_hub_s_own_error(hub, tmp_path):
    with pytest.raises(EntryNotFoundError):
        huggingface_hub.hf_hub_download(REPO, "absent.json", cache_dir=tmp_path / "cache")
    with pytest.raises(RevisionNotFoundError):
        huggingface_hub.hf_hub_download(REPO, "config.json", revision="v9", cache_dir=tmp_path / "cache")


def test_ranged_gets_on_the_resolve_url_and_the_blob_url_over_one_kept_alive_connection(root):
    with FakeHub(root, token=TOKEN) as hub:
        resolve, path = _connection(hub.resolve_url(REPO, "model.safetensors"))
        auth = {"Authorization": f"Bearer {TOKEN}"}
        resolve.request("HEAD", path, headers=auth)
        head = resolve.getresponse()
        head.read()
        resolve.request("GET", path, headers={**auth, "Range": "bytes=10-99"})  # the same connection, kept alive
        redirect = resolve.getresponse()
        redirect.read()

        sha256 = hashlib.sha256(WEIGHTS).hexdigest()
        assert head.status == 302 and head.headers["X-Repo-Commit"] == hub.sha(REPO)
        assert head.headers["X-Linked-Size"] == str(len(WEIGHTS)) and head.headers["X-Linked-Etag"] == f'"{sha256}"'
        assert redirect.status == 302
        assert redirect.headers["Location"].startswith(f"{hub.cdn_url}/repos/{REPO}/{sha256}?")

        cdn, blob_path = _connection(redirect.headers["Location"])
        answers = []
        for headers in ({"Range": "bytes=10-99"}, {"Range": "bytes=-5"}, {"Range": "bytes=0-9", "If-Match": '"0bad"'},
                        {"Range": "bytes=0-9", "If-Match": f'"{sha256}"'}, {"Range": f"bytes={len(WEIGHTS)}-"}, {}):
            cdn.request("GET", blob_path, headers=headers)
            answer = cdn.getresponse()
            answers.append((answer.status, answer.headers.get("Content-Range"), answer.read()))
        resolve.close()
        cdn.close()

    assert answers == [
        (206, f"bytes 10-99/{len(WEIGHTS)}", WEIGHTS[10:100]),
        (206, f"bytes {len(WEIGHTS) - 5}-{len(WEIGHTS) - 1}/{len(WEIGHTS)}", WEIGHTS[-5:]),
        (412, None, answers[2][2]),
        (206, f"bytes 0-9/{len(WEIGHTS)}", WEIGHTS[:10]),
        (416, f"bytes */{len(WEIGHTS)}", answers[4][2]),
        (200, None, WEIGHTS),
    ]
    assert all("authorization" not in r.headers for r in hub.seen("cdn")) and len(hub.seen("cdn")) == 6


def test_a_small_file_is_served_by_the_hub_itself_with_ranges_and_its_git_etag(root):
    config = (root / REPO / "config.json").read_bytes()
    with FakeHub(root) as hub:
        connection, path = _connection(hub.resolve_url(REPO, "config.json"))
        connection.request("GET", path, headers={"Range": "bytes=1-4"})
        answer = connection.getresponse()
        body = answer.read()
        connection.close()

    assert answer.status == 206 and body == config[1:5]
    assert answer.headers["Content-Range"] == f"bytes 1-4/{len(config)}"
    assert answer.headers["ETag"] == '"%s"' % hashlib.sha1(b"blob %d\0" % len(config) + config).hexdigest()


def test_blob_urls_are_signed_and_content_addressed(root):
    with FakeHub(root) as hub:
        connection, path = _connection(hub.resolve_url(REPO, "model.safetensors"))
        connection.request("HEAD", path)
        location = connection.getresponse()
        location.read()
        blob_url = location.headers["Location"]
        (root / REPO / "model.safetensors").write_bytes(WEIGHTS[::-1])  # a new version: a new blob
        connection.request("HEAD", path)
        changed = connection.getresponse()
        changed.read()
        connection.close()

        statuses = []
        for url in (blob_url.replace("Signature=", "Signature=0"), blob_url, changed.headers["Location"]):
            cdn, blob_path = _connection(url)
            cdn.request("GET", blob_path)
            answer = cdn.getresponse()
            statuses.append((answer.status, answer.read()[:4]))
            cdn.close()

    assert changed.headers["X-Linked-Etag"] == f'"{hashlib.sha256(WEIGHTS[::-1]).hexdigest()}"'
    assert [status for status, _ in statuses] == [403, 404, 200] and statuses[2][1] == WEIGHTS[::-1][:4]


def test_a_subprocess_reaches_the_fake_through_env_alone(root, tmp_path):
    program = ("import sys, huggingface_hub; "
               "print(huggingface_hub.hf_hub_download(sys.argv[1], 'model.safetensors', cache_dir=sys.argv[2]))")
    with FakeHub(root, token=TOKEN) as hub:
        done = subprocess.run([sys.executable, "-c", program, REPO, str(tmp_path / "cache")],
                              capture_output=True, text=True, timeout=120, env={
                                  "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **hub.env()})

    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).read_bytes() == WEIGHTS
    assert hub.seen("hub")[-1].headers["authorization"] == f"Bearer {TOKEN}"
