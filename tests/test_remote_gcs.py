"""gs:// sources against a stand-in GCS (tests/gcs_server.py) started on 127.0.0.1 for this module, reached through
STORAGE_EMULATOR_HOST, with google-auth's real service-account flow (a JWT signed with a key made here, posted to
the stand-in's token endpoint): objects, prefixes and Hugging Face folders load as their local files do; missing
and refused credentials are one line with a next step that, followed, works; a replaced object is an error."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import torch
import transformers

import materialize as mz
from tests.conftest import write_safetensors, write_sharded, write_torch
from tests.gcs_server import GcsServer
from tests.remote_checks import same_tensors as _same, small_state as _state, upload as _upload
import preforked

pytest.importorskip("google.auth")
pytest.importorskip("cryptography")  # makes the key that signs the JWT (recent google-auth needs it; 2.23.2 does not)

CLI = str(Path(sys.executable).parent / "materialize")
# No credentials of this machine's, and no metadata server asked for any: gcloud's ADC file looked for in an empty
# folder, the metadata server's check skipped (NO_GCE_CHECK, newer google-auth) or sent where nothing listens.
NOWHERE = {"NO_GCE_CHECK": "true", "GCE_METADATA_HOST": "127.0.0.1:1", "GCE_METADATA_IP": "127.0.0.1:1"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("gcs")
    with GcsServer(root, page_size=3) as started:  # listings of more than 3 entries come in pages
        started.make_bucket("models")
        started.make_bucket("public", public=True)
        started.key_file = started.service_account_file(tmp_path_factory.mktemp("keys") / "key.json")
        yield started


@pytest.fixture
def environment(server, tmp_path) -> dict[str, str]:
    """The variables a process reading gs:// from the stand-in needs: its host, the key file, nothing else's."""
    (tmp_path / "gcloud").mkdir()
    return {**NOWHERE, **server.env(), "CLOUDSDK_CONFIG": str(tmp_path / "gcloud"),
            "GOOGLE_APPLICATION_CREDENTIALS": str(server.key_file)}


@pytest.fixture
def gcs(server, environment, monkeypatch):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    return server


def _media(server: GcsServer, since: int) -> list[dict[str, str]]:
    """The query of each media GET the server answered after its first ``since`` requests."""
    seen = server.seen()[since:]
    return [{k: v[-1] for k, v in parse_qs(urlsplit(r.path).query).items()} | {"range": r.headers.get("range", "")}
            for r in seen if r.path.startswith("/download/")]


def test_an_object_a_prefix_and_an_index_load_as_their_local_files(gcs, tmp_path):
    state = _state()
    write_safetensors(state, tmp_path / "one.safetensors")
    write_torch(state, tmp_path / "one.pt")
    write_sharded(state, tmp_path / "sharded")
    _upload(gcs, "models", tmp_path, "t1/")
    for url, local in [("gs://models/t1/one.safetensors", tmp_path / "one.safetensors"),
                       ("gs://models/t1/one.pt", tmp_path / "one.pt"),
                       ("gs://models/t1/sharded/", tmp_path / "sharded"),
                       ("gs://models/t1/sharded", tmp_path / "sharded"),  # a prefix written without its slash
                       ("gs://models/t1/sharded/model.safetensors.index.json", tmp_path / "sharded")]:
        tokens, before = gcs.tokens_issued, len(gcs.seen())
        got, report = mz.load_tensors(url)
        want, _ = mz.load_tensors(local)
        _same(got, want)
        assert report.checkpoint.startswith("gs://models/t1/"), url
        assert gcs.tokens_issued == tokens + 1, url  # one token per load, however many requests ran in parallel
        media = _media(gcs, before)
        assert media and all(m["alt"] == "media" and m["ifGenerationMatch"] and m["range"].startswith("bytes=")
                             for m in media), url
        gets = [r for r in gcs.seen()[before:] if r.method == "GET"]
        assert all(r.headers.get("authorization") == f"Bearer {gcs.issued}" for r in gets), url


def test_a_hugging_face_prefix_builds_and_loads_its_model(gcs, tmp_path):
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=99, n_positions=64)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(tmp_path / "gpt2", max_shard_size="60KB")
    _upload(gcs, "models", tmp_path / "gpt2", "gpt2/")
    remote, _ = mz.load_model("gs://models/gpt2/")
    local, _ = mz.load_model(tmp_path / "gpt2")
    assert type(remote) is type(local) is transformers.GPT2LMHeadModel
    _same(dict(remote.state_dict()), dict(local.state_dict()))
    assert remote.lm_head.weight is remote.transformer.wte.weight  # the tie, as from_pretrained makes it


def test_the_cli_reads_gs_in_a_subprocess_with_the_standard_google_environment(gcs, environment, tmp_path):
    write_safetensors(_state(), tmp_path / "model.safetensors")
    gcs.put("models", "cli/model.safetensors", tmp_path / "model.safetensors")
    tokens = gcs.tokens_issued
    run = preforked.run([CLI, "gs://models/cli/model.safetensors", "--json"], capture_output=True, text=True,
                         env={**os.environ, **environment})
    assert run.returncode == 0, run.stderr
    assert set(json.loads(run.stdout)["loaded"]) == set(_state())
    assert gcs.tokens_issued == tokens + 1


def test_no_credentials_suggest_anonymous_reads_and_following_the_hint_reads_a_public_bucket(gcs, environment,
                                                                                             tmp_path):
    state = _state(3)
    write_safetensors(state, tmp_path / "model.safetensors")
    gcs.put("public", "open/model.safetensors", tmp_path / "model.safetensors")
    env = {k: v for k, v in {**os.environ, **environment}.items() if k != "GOOGLE_APPLICATION_CREDENTIALS"}
    url = "gs://public/open/model.safetensors"
    refused = preforked.run([CLI, url], capture_output=True, text=True, env=env)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert url in refused.stderr and "no Google credentials" in refused.stderr
    assert "GOOGLE_APPLICATION_CREDENTIALS" in refused.stderr and "--no-sign-request" in refused.stderr
    before = len(gcs.seen())
    followed = preforked.run([CLI, url, "--no-sign-request", "--json"], capture_output=True, text=True, env=env)
    assert followed.returncode == 0, followed.stderr
    assert set(json.loads(followed.stdout)["loaded"]) == set(state)
    assert gcs.seen()[before:] and not any("authorization" in r.headers for r in gcs.seen()[before:])


def test_anonymous_reads_of_a_private_bucket_are_refused_in_one_line(gcs, tmp_path):
    write_safetensors(_state(), tmp_path / "model.safetensors")
    gcs.put("models", "private/model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(mz.CheckpointAccessError, match=r"gs://models/private/model.safetensors: access refused "
                       r"\(HTTP 401 required: Anonymous caller .*leave --no-sign-request out"):
        mz.load_tensors("gs://models/private/model.safetensors", remote=mz.RemoteOptions(anonymous=True))


def test_a_token_the_store_refuses_is_one_line_naming_the_object(server, environment, tmp_path):
    write_safetensors(_state(), tmp_path / "model.safetensors")
    server.put("models", "creds/model.safetensors", tmp_path / "model.safetensors")
    with GcsServer(server.root, issued="revoked-token", accepted={"another-token"}) as refusing:
        key = json.loads(server.key_file.read_text())["private_key"]
        key_file = refusing.service_account_file(tmp_path / "key.json", key)
        env = {**os.environ, **environment, **refusing.env(), "GOOGLE_APPLICATION_CREDENTIALS": str(key_file)}
        run = preforked.run([CLI, "gs://models/creds/model.safetensors"], capture_output=True, text=True, env=env)
    assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
    assert "gs://models/creds/model.safetensors" in run.stderr
    assert "HTTP 401 authError: Invalid Credentials" in run.stderr and "credentials were refused" in run.stderr


def test_a_key_the_token_endpoint_refuses_is_one_line_naming_the_object(server, environment, tmp_path, monkeypatch):
    with GcsServer(server.root, issued=None) as refusing:  # as for a deleted key
        key_file = refusing.service_account_file(tmp_path / "key.json")
        for name, value in {**environment, **refusing.env(), "GOOGLE_APPLICATION_CREDENTIALS": str(key_file)}.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(mz.CheckpointAccessError, match=r"gs://models/any.safetensors: the Google credentials "
                           r"were refused when refreshed \(invalid_grant: Invalid JWT Signature.*"
                           r"GOOGLE_APPLICATION_CREDENTIALS"):
            mz.load_tensors("gs://models/any.safetensors")


def test_an_object_replaced_during_the_load_is_an_error(gcs, tmp_path):
    write_safetensors({"w": torch.zeros(32, 32)}, tmp_path / "a.safetensors")
    write_safetensors({"w": torch.ones(32, 32)}, tmp_path / "b.safetensors")
    gcs.put("models", "moving/model.safetensors", tmp_path / "a.safetensors")
    with mz.open_checkpoint("gs://models/moving/model.safetensors") as ckpt:
        gcs.put("models", "moving/model.safetensors", tmp_path / "b.safetensors")
        with pytest.raises(mz.CheckpointError, match="gs://models/moving/model.safetensors.*changed during the load"):
            mz.load_tensors(ckpt)


def test_a_missing_object_and_a_missing_bucket_are_not_found(gcs):
    with pytest.raises(mz.CheckpointNotFoundError, match="no such object"):
        mz.load_tensors("gs://models/absent/model.safetensors")
    with pytest.raises(mz.CheckpointNotFoundError, match="no such bucket 'no-such-bucket'"):
        mz.load_tensors("gs://no-such-bucket/model.safetensors")


def test_tokens_are_refreshed_through_urllib3_where_requests_is_not_installed(gcs, tmp_path, monkeypatch):
    state = _state(5)
    write_safetensors(state, tmp_path / "model.safetensors")
    gcs.put("models", "urllib3/model.safetensors", tmp_path / "model.safetensors")
    monkeypatch.setitem(sys.modules, "google.auth.transport.requests", None)  # its import now fails
    tokens = gcs.tokens_issued
    got, _ = mz.load_tensors("gs://models/urllib3/model.safetensors")
    _same(got, mz.load_tensors(tmp_path / "model.safetensors")[0])
    assert gcs.tokens_issued == tokens + 1


def test_without_google_auth_a_public_bucket_still_reads_and_a_private_one_says_what_to_install(gcs, tmp_path,
                                                                                                  monkeypatch):
    write_safetensors(_state(6), tmp_path / "model.safetensors")
    gcs.put("public", "no-auth/model.safetensors", tmp_path / "model.safetensors")
    for name in [n for n in sys.modules if n == "google.auth" or n.startswith("google.auth.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "google.auth", None)  # google-auth not installed
    with pytest.raises(mz.CheckpointError, match=r"gs://public/no-auth/model.safetensors: gs:// sources need "
                                                 r"google-auth.*--no-sign-request"):
        mz.load_tensors("gs://public/no-auth/model.safetensors")
    got, _ = mz.load_tensors("gs://public/no-auth/model.safetensors", remote=mz.RemoteOptions(anonymous=True))
    _same(got, mz.load_tensors(tmp_path / "model.safetensors")[0])
