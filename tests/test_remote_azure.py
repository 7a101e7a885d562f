"""az:// sources against a stand-in Blob service (tests/azure_server.py) started on 127.0.0.1 for this module, reached
through AZURE_STORAGE_CONNECTION_STRING's BlobEndpoint, with azure-identity's real DefaultAzureCredential finding
App Service's managed identity (IDENTITY_ENDPOINT, IDENTITY_HEADER) at the stand-in's token endpoint: blobs,
prefixes and Hugging Face folders load as their local files do; SAS tokens and public containers need no
identity; missing and refused credentials are one line with a next step that, followed, works; a replaced blob is
an error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import parse_qs, urlsplit

import pytest
import torch
import transformers

import materialize as mz
from materialize.sources import open_url
from tests.azure_server import ACCOUNT, AzureServer
from tests.conftest import write_safetensors, write_sharded, write_torch
from tests.remote_checks import same_tensors as _same, small_state as _state, upload as _upload
import preforked

pytest.importorskip("azure.identity")

CLI = str(Path(sys.executable).parent / "materialize")
# What could lead azure-identity or this source elsewhere: this machine's own service principal, managed
# identity, token settings and storage account are no part of a test's environment.
OWN = ("AZURE_", "IDENTITY_", "MSI_", "AZD_", "IMDS_")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("azure")
    with AzureServer(root, page_size=3, denied={"reader-less-token"}) as started:  # listings come 3 entries a page
        started.make_container("models")
        started.make_container("public", public=True)
        started.make_container("lake", hierarchical=True)
        yield started


@pytest.fixture
def environment(server, tmp_path) -> dict[str, str]:
    """The variables a process reading az:// from the stand-in needs: its endpoint, its managed identity, and a
    home and az CLI folder of its own, empty (no login of this machine's is found)."""
    (tmp_path / "home").mkdir()
    return {**server.identity_env(), **server.no_identity_env(),
            "AZURE_STORAGE_CONNECTION_STRING": server.connection_string(), "HOME": str(tmp_path / "home"),
            "AZURE_CONFIG_DIR": str(tmp_path / "home" / ".azure")}


def _process_env(environment: dict[str, str], *, without: tuple[str, ...] = (), **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(OWN)}
    env.update(environment)
    env.update(more)
    return {k: v for k, v in env.items() if k not in without}


@pytest.fixture
def azure(server, environment, monkeypatch):
    for name in [n for n in os.environ if n.startswith(OWN)]:
        monkeypatch.delenv(name)
    for name, value in environment.items():
        if name != "HOME":  # this process's own caches stay where they are
            monkeypatch.setenv(name, value)
    return server


def _query(seen) -> dict[str, str]:
    return {k: v[-1] for k, v in parse_qs(urlsplit(seen.path).query).items()}


def _one_line(run: subprocess.CompletedProcess, url: str) -> str:
    assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
    assert url in run.stderr
    return run.stderr


def test_a_blob_a_prefix_and_an_index_load_as_their_local_files(azure, tmp_path):
    state = _state()
    write_safetensors(state, tmp_path / "one.safetensors")
    write_torch(state, tmp_path / "one.pt")
    write_sharded(state, tmp_path / "sharded")
    _upload(azure, "models", tmp_path, "t1/")
    for url, local in [("az://models/t1/one.safetensors", tmp_path / "one.safetensors"),
                       ("az://models/t1/one.pt", tmp_path / "one.pt"),
                       ("az://models/t1/sharded/", tmp_path / "sharded"),
                       ("az://models/t1/sharded", tmp_path / "sharded"),  # a prefix written without its slash
                       ("az://models/t1/sharded/model.safetensors.index.json", tmp_path / "sharded"),
                       # the account named as Spark and adlfs write it: the connection string's, so its endpoint
                       (f"abfss://models@{ACCOUNT}.dfs.core.windows.net/t1/one.pt", tmp_path / "one.pt")]:
        tokens, before = azure.tokens_issued, len(azure.seen())
        got, report = mz.load_tensors(url)
        want, _ = mz.load_tensors(local)
        _same(got, want)
        assert report.checkpoint.startswith(url.split("/t1/")[0] + "/t1/"), url
        assert azure.tokens_issued == tokens + 1, url  # one token per load, however many requests ran in parallel
        storage = [r for r in azure.seen()[before:] if not r.path.startswith("/msi/")]
        assert storage and all(r.headers.get("authorization") == f"Bearer {azure.issued}"
                               and r.headers.get("x-ms-version") >= "2017-11-09" for r in storage), url
        data = [r for r in storage if r.method == "GET" and "comp" not in _query(r)]
        assert data and all(r.headers.get("if-match", "").startswith('"0x') and r.headers["range"].startswith("bytes=")
                            for r in data), url


def test_a_listing_comes_in_pages_each_asked_from_the_marker_the_last_gave(azure, tmp_path):
    names = [f"file{i}.bin" for i in range(6)] + ["odd name+1%.bin"]  # sent percent-encoded, read as named
    for name in names:
        (tmp_path / name).write_bytes(name.encode())
    (tmp_path / "sub1").mkdir()
    (tmp_path / "sub1" / "x.bin").write_bytes(b"x")
    (tmp_path / "sub2").mkdir()
    (tmp_path / "sub2" / "y.bin").write_bytes(b"y")
    _upload(azure, "models", tmp_path, "paged/")
    before = len(azure.seen())
    found = sorted(path.name for path in open_url("az://models/paged/").iterdir())
    assert found == sorted(names + ["sub1", "sub2"])
    lists = [_query(r) for r in azure.seen()[before:] if _query(r).get("comp") == "list"]
    assert len(lists) == 3 and "marker" not in lists[0]
    assert all(q["prefix"] == "paged/" and q["delimiter"] == "/" for q in lists)
    assert [q["marker"] for q in lists[1:]] == ["2!00000003!a+b/c=", "2!00000006!a+b/c="]  # sent escaped, read whole
    assert open_url("az://models/paged/file3.bin").read_bytes() == b"file3.bin"
    assert open_url("az://models/paged/odd name+1%.bin").read_bytes() == b"odd name+1%.bin"


def test_a_hugging_face_prefix_builds_the_model_from_pretrained_builds(azure, tmp_path):
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=99, n_positions=64)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(tmp_path / "gpt2", max_shard_size="60KB")
    _upload(azure, "models", tmp_path / "gpt2", "gpt2/")
    remote, _ = mz.load_model("az://models/gpt2/")
    eager = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")
    assert type(remote) is type(eager) is transformers.GPT2LMHeadModel
    _same(dict(remote.state_dict()), dict(eager.state_dict()))
    assert remote.lm_head.weight is remote.transformer.wte.weight  # the tie, as from_pretrained makes it


def test_a_data_lake_folder_blob_is_no_file_and_its_prefix_loads(azure, tmp_path):
    state = _state(1)
    write_sharded(state, tmp_path / "sharded")
    _upload(azure, "lake", tmp_path / "sharded", "runs/step1/")
    assert not open_url("az://lake/runs/step1").is_file()  # its HEAD says hdi_isfolder
    assert sorted(p.name for p in open_url("az://lake/runs/").iterdir()) == ["step1"]
    got, _ = mz.load_tensors("az://lake/runs/step1")
    _same(got, mz.load_tensors(tmp_path / "sharded")[0])


def test_the_cli_loads_inspects_and_plans_az_in_a_subprocess(azure, environment, tmp_path):
    state = _state(2)
    write_safetensors(state, tmp_path / "model.safetensors")
    azure.put("models", "cli/model.safetensors", tmp_path / "model.safetensors")
    env = _process_env(environment)
    url = "az://models/cli/model.safetensors"
    loaded = preforked.run([CLI, url, "--json"], capture_output=True, text=True, env=env)
    assert loaded.returncode == 0, loaded.stderr
    assert set(json.loads(loaded.stdout)["loaded"]) == set(state)
    inspected = preforked.run([CLI, "inspect", url, "--json"], capture_output=True, text=True, env=env)
    assert inspected.returncode == 0, inspected.stderr
    local = str(tmp_path / "model.safetensors")
    assert json.loads(inspected.stdout.replace(url, local)) == mz.inspect(local)
    planned = preforked.run([CLI, "plan", url, "--json"], capture_output=True, text=True, env=env)
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    assert plan["checkpoint"] == url and plan["read_bytes"] == sum(t.nbytes for t in state.values())


def test_a_sas_token_is_sent_on_every_request_and_needs_no_identity(azure, tmp_path, monkeypatch):
    state = _state(3)
    write_safetensors(state, tmp_path / "model.safetensors")
    write_sharded(state, tmp_path / "sharded")
    _upload(azure, "models", tmp_path, "sas/")
    for name in ("IDENTITY_ENDPOINT", "IDENTITY_HEADER"):
        monkeypatch.delenv(name)
    monkeypatch.setitem(sys.modules, "azure.identity", None)  # not installed: a SAS token needs none
    in_connection_string = azure.connection_string(SharedAccessSignature=azure.sas_token)
    for settings in [{"AZURE_STORAGE_SAS_TOKEN": "?" + azure.sas_token},  # as the portal copies it
                     {"AZURE_STORAGE_CONNECTION_STRING": in_connection_string}]:
        with monkeypatch.context() as patched:
            for name, value in settings.items():
                patched.setenv(name, value)
            tokens, before = azure.tokens_issued, len(azure.seen())
            got, _ = mz.load_tensors("az://models/sas/sharded/")
            _same(got, mz.load_tensors(tmp_path / "sharded")[0])
            seen = azure.seen()[before:]
            assert seen and azure.tokens_issued == tokens
            assert all("authorization" not in r.headers and _query(r)["sig"] == azure.sas_signature for r in seen)


def test_a_refused_sas_token_is_one_line_saying_to_make_a_new_one(azure, monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", azure.sas_token.replace("sig=", "sig=expired"))
    with pytest.raises(mz.CheckpointAccessError, match=r"az://models/any: access refused \(HTTP 403 "
                       r"AuthenticationFailed: Server failed to authenticate .*\); the SAS token was refused"):
        mz.load_tensors("az://models/any/")


def test_no_credentials_suggest_a_public_read_and_a_sas_token_and_either_followed_reads(azure, environment, tmp_path):
    state = _state(4)
    write_safetensors(state, tmp_path / "model.safetensors")
    azure.put("public", "open/model.safetensors", tmp_path / "model.safetensors")
    env = _process_env(environment, without=("IDENTITY_ENDPOINT", "IDENTITY_HEADER"))  # no managed identity
    url = "az://public/open/model.safetensors"
    refused = _one_line(preforked.run([CLI, url], capture_output=True, text=True, env=env), url)
    assert "no Azure credentials gave a token (DefaultAzureCredential: " in refused
    assert "ManagedIdentityCredential" in refused and "Identity not found" in refused  # the stand-in's IMDS, asked
    assert "az login" in refused and "AZURE_STORAGE_SAS_TOKEN" in refused and "--no-sign-request" in refused
    before = len(azure.seen())
    followed = preforked.run([CLI, url, "--no-sign-request", "--json"], capture_output=True, text=True, env=env)
    assert followed.returncode == 0, followed.stderr
    assert set(json.loads(followed.stdout)["loaded"]) == set(state)
    storage = [r for r in azure.seen()[before:] if not r.path.startswith("/metadata/")]
    assert storage and not any("authorization" in r.headers or "sig" in _query(r) for r in storage)
    azure.put("models", "closed/model.safetensors", tmp_path / "model.safetensors")
    signed = preforked.run([CLI, "az://models/closed/model.safetensors", "--json"], capture_output=True, text=True,
                            env={**env, "AZURE_STORAGE_SAS_TOKEN": azure.sas_token})
    assert signed.returncode == 0, signed.stderr


def test_anonymous_reads_of_a_private_container_are_refused_in_one_line(azure, tmp_path):
    write_safetensors(_state(), tmp_path / "model.safetensors")
    azure.put("models", "private/model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(mz.CheckpointAccessError, match=r"az://models/private/model.safetensors: access refused "
                       r"\(HTTP 404 ResourceNotFound\); .*leave --no-sign-request out"):
        mz.load_tensors("az://models/private/model.safetensors", remote=mz.RemoteOptions(anonymous=True))


def test_a_token_the_store_refuses_is_one_line_naming_the_blob(server, environment, tmp_path):
    write_safetensors(_state(), tmp_path / "model.safetensors")
    server.put("models", "creds/model.safetensors", tmp_path / "model.safetensors")
    url = "az://models/creds/model.safetensors"
    with AzureServer(server.root, issued="revoked-token", accepted={"another-token"}) as refusing:
        env = _process_env(environment, **refusing.identity_env(),
                           AZURE_STORAGE_CONNECTION_STRING=refusing.connection_string())
        run = preforked.run([CLI, url], capture_output=True, text=True, env=env)
    refused = _one_line(run, url)
    assert "HTTP 401 InvalidAuthenticationInfo: Server failed to authenticate the request." in refused
    assert "RequestId" not in refused and "the token was refused" in refused and "az login" in refused


def test_an_identity_without_the_reader_role_is_one_line_naming_the_role(server, environment, tmp_path, monkeypatch):
    write_safetensors(_state(), tmp_path / "model.safetensors")
    server.put("models", "role/model.safetensors", tmp_path / "model.safetensors")
    with AzureServer(server.root, issued="reader-less-token", denied={"reader-less-token"}) as denying:
        for name, value in {**environment, **denying.identity_env(),
                            "AZURE_STORAGE_CONNECTION_STRING": denying.connection_string()}.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(mz.CheckpointAccessError, match=r"az://models/role/model.safetensors: access refused "
                           r"\(HTTP 403 AuthorizationPermissionMismatch\); .*Storage Blob Data Reader"):
            mz.load_tensors("az://models/role/model.safetensors")


def test_a_managed_identity_the_token_endpoint_refuses_is_one_line(server, environment, monkeypatch):
    with AzureServer(server.root, issued=None) as refusing:  # as for an app with no identity assigned
        for name, value in {**environment, **refusing.identity_env(),
                            "AZURE_STORAGE_CONNECTION_STRING": refusing.connection_string()}.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(mz.CheckpointAccessError) as refused:
            mz.load_tensors("az://models/any.safetensors")
    message = str(refused.value)
    assert message.startswith("az://models/any.safetensors: no Azure credentials gave a token") and "\n" not in message
    assert "ManagedIdentityCredential" in message and "No managed identity is assigned to this app" in message
    assert "https://aka.ms" not in message  # its guides' links, left out of the line


def test_a_blob_replaced_during_the_load_is_an_error(azure, tmp_path):
    write_safetensors({"w": torch.zeros(32, 32)}, tmp_path / "a.safetensors")
    write_safetensors({"w": torch.ones(32, 32)}, tmp_path / "b.safetensors")
    azure.put("models", "moving/model.safetensors", tmp_path / "a.safetensors")
    with mz.open_checkpoint("az://models/moving/model.safetensors") as ckpt:
        azure.put("models", "moving/model.safetensors", tmp_path / "b.safetensors")
        with pytest.raises(mz.CheckpointError, match=r"az://models/moving/model.safetensors.*changed during the "
                                                     r"load.*HTTP 412"):
            mz.load_tensors(ckpt)


def test_a_missing_blob_and_a_missing_container_are_not_found(azure):
    with pytest.raises(mz.CheckpointNotFoundError, match="no such object"):
        mz.load_tensors("az://models/absent/model.safetensors")
    with pytest.raises(mz.CheckpointNotFoundError, match="no such container 'no-such-container'"):
        mz.load_tensors("az://no-such-container/model.safetensors")


def test_an_account_key_is_refused_in_one_line_and_its_hints_followed_read(azure, environment, tmp_path):
    write_safetensors(_state(5), tmp_path / "model.safetensors")
    azure.put("models", "keyed/model.safetensors", tmp_path / "model.safetensors")
    url = "az://models/keyed/model.safetensors"
    keyed = azure.connection_string(AccountKey="a2V5")
    env = _process_env(environment, AZURE_STORAGE_CONNECTION_STRING=keyed)
    refused = _one_line(preforked.run([CLI, url], capture_output=True, text=True, env=env), url)
    assert "the AccountKey of AZURE_STORAGE_CONNECTION_STRING is not used" in refused
    assert "SharedAccessSignature=" in refused and "AZURE_STORAGE_SAS_TOKEN" in refused
    for followed in [{"AZURE_STORAGE_CONNECTION_STRING": keyed + f";SharedAccessSignature={azure.sas_token}"},
                     {"AZURE_STORAGE_SAS_TOKEN": azure.sas_token}]:
        run = preforked.run([CLI, url, "--json"], capture_output=True, text=True, env={**env, **followed})
        assert run.returncode == 0, (followed, run.stderr)


def test_the_account_comes_from_the_url_the_connection_string_or_the_variables(monkeypatch):
    for name in [n for n in os.environ if n.startswith(OWN)]:
        monkeypatch.delenv(name)
    monkeypatch.setitem(sys.modules, "azure.identity", None)  # nothing is asked: no credentials needed to open
    anonymous = mz.RemoteOptions(anonymous=True)
    with pytest.raises(mz.CheckpointError, match=r"az://c/model.safetensors: no storage account named: set "
                                                 r"AZURE_STORAGE_ACCOUNT_NAME"):
        open_url("az://c/model.safetensors", anonymous)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", "fromcli")
    assert open_url("az://c/k", anonymous).store.endpoint == "https://fromcli.blob.core.windows.net"
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "fromadlfs")
    assert open_url("az://c/k", anonymous).store.endpoint == "https://fromadlfs.blob.core.windows.net"
    named = open_url("abfss://c@lake1.dfs.core.chinacloudapi.cn/a/b/", anonymous)
    assert named.store.endpoint == "https://lake1.blob.core.chinacloudapi.cn" and named.key == "a/b"
    assert str(named) == "abfss://c@lake1.dfs.core.chinacloudapi.cn/a/b/"
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                       "DefaultEndpointsProtocol=https;AccountName=fromstring;EndpointSuffix=core.usgovcloudapi.net")
    assert open_url("az://c/k", anonymous).store.endpoint == "https://fromstring.blob.core.usgovcloudapi.net"
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "UseDevelopmentStorage=true")
    assert open_url("az://c/k", anonymous).store.endpoint == "http://127.0.0.1:10000/devstoreaccount1"
    with pytest.raises(mz.CheckpointError, match=r"'acct.blob.core.windows.net' is no container name.*"
                                                 r"az://CONTAINER@ACCOUNT.blob.core.windows.net/key"):
        open_url("az://acct.blob.core.windows.net/c/k", anonymous)
    with pytest.raises(mz.CheckpointError, match="wasbs:// sources are not read.*az://CONTAINER@ACCOUNT"):
        open_url("wasbs://c@acct.blob.core.windows.net/k", anonymous)


def test_a_token_goes_over_plain_http_to_this_machine_only(monkeypatch):
    for name in [n for n in os.environ if n.startswith(OWN)]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "BlobEndpoint=http://storage.example.invalid/acct")
    with pytest.raises(mz.CheckpointAccessError, match=r"az://c/k: an Azure token is sent over https only"):
        open_url("az://c/k")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "BlobEndpoint=http://[::1]:10000/acct")
    assert open_url("az://c/k").store.endpoint == "http://[::1]:10000/acct"


def test_without_azure_identity_a_public_container_still_reads_and_a_private_one_says_what_to_install(
        azure, tmp_path, monkeypatch):
    write_safetensors(_state(6), tmp_path / "model.safetensors")
    azure.put("public", "no-identity/model.safetensors", tmp_path / "model.safetensors")
    monkeypatch.setitem(sys.modules, "azure.identity", None)  # azure-identity not installed
    url = "az://public/no-identity/model.safetensors"
    with pytest.raises(mz.CheckpointError, match=rf"{url}: az:// sources need azure-identity.*pip install "
                                                 r"'torch-materialize\[remote\]'.*AZURE_STORAGE_SAS_TOKEN.*--no-sign"):
        mz.load_tensors(url)
    got, _ = mz.load_tensors(url, remote=mz.RemoteOptions(anonymous=True))
    _same(got, mz.load_tensors(tmp_path / "model.safetensors")[0])


def test_an_expiring_token_is_renewed_once_by_one_thread_while_the_others_wait(monkeypatch):
    from azure.core.credentials import AccessToken

    from materialize.sources import azure as source

    now = [1_000_000.0]
    asked: list[str] = []

    class Credential:
        def get_token(self, *scopes: str) -> AccessToken:
            asked.extend(scopes)
            time.sleep(0.05)  # long enough for the other threads to arrive while it is asked
            return AccessToken(f"token-{len(asked)}", int(now[0]) + 3600)

    monkeypatch.setattr(source, "time", SimpleNamespace(time=lambda: now[0]))  # the source's clock only
    credentials = source._Credentials("az://c/")
    credentials._credential = Credential()

    def every_thread_asks() -> set[str]:
        got: list[str] = []
        threads = [threading.Thread(target=lambda: got.append(credentials.token(name="az://c/k"))) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return set(got)

    assert every_thread_asks() == {"token-1"} and asked == [source.SCOPE]
    now[0] += 3600 - source.REFRESH_SECONDS - 1  # still valid, not yet near its end
    assert every_thread_asks() == {"token-1"}
    now[0] += 2  # within REFRESH_SECONDS of expiring: renewed before it is
    assert every_thread_asks() == {"token-2"} and len(asked) == 2


def test_a_listing_that_declares_a_document_type_is_refused_unexpanded():
    from materialize.sources.azure import _xml

    laughs = (b'<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;">]>'
              b"<EnumerationResults><Blobs><Blob><Name>&lol2;</Name></Blob></Blobs></EnumerationResults>")
    with pytest.raises(mz.CheckpointAccessError, match="az://c/: the Azure listing declares a document type"):
        _xml(laughs, "az://c/")
    assert _xml(b"<EnumerationResults><NextMarker /></EnumerationResults>", "az://c/").findtext("NextMarker") == ""
