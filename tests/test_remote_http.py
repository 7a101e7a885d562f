"""Checkpoints read from http:// URLs, against a Range server and a fault-injecting proxy the tests start on
127.0.0.1: every load equal to the local load of the same files, byte for byte, and every fault retried or
refused in one line naming the URL and the byte range."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

import materialize as mz
from tests.conftest import (DECODER_SPEC, TINY, reference_model, run_ranks, saved_state, write_safetensors, write_sharded,
                            write_torch)
from tests.forward_proxy import ForwardProxy
from tests.remote_servers import FaultProxy, RangeServer
import preforked

CLI = str(Path(sys.executable).parent / "materialize")
FAST = mz.RemoteOptions(timeout=2.0, retries=3)  # a stalled request is given up on quickly in these tests


def _same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, ordered: bool = True) -> None:
    """The same names (in the same order), dtypes, shapes, strides and bytes."""
    assert (list(got) == list(want)) if ordered else (set(got) == set(want))
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert got[name].stride() == tensor.stride(), name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "embed.weight": torch.randn(300, 64),
        "block.0.weight": torch.randn(64, 64).to(torch.bfloat16),
        "block.0.bias": torch.randn(64).to(torch.float16),
        "counts": torch.arange(17, dtype=torch.int64),
        "flag": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5),
    }


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    with RangeServer(root) as server:
        yield root, server


@pytest.mark.parametrize("layout", ["safetensors", "torch", "sharded-folder", "sharded-index", "torch-sharded"])
def test_every_layout_loads_from_a_url_as_from_the_local_files(served, layout):
    root, server = served
    state = _state()
    if layout == "safetensors":
        local, name = write_safetensors(state, root / "model.safetensors"), "model.safetensors"
    elif layout == "torch":
        local, name = write_torch(state, root / "model.pt"), "model.pt"
    elif layout == "sharded-folder":
        local, name = write_sharded(state, root / "m").parent, "m/"
    elif layout == "sharded-index":
        local = write_sharded(state, root / "m")
        name = "m/model.safetensors.index.json"
    else:
        local, name = write_sharded(state, root / "m", kind="torch").parent, "m/"
    want, _ = mz.load_tensors(local)
    got, report = mz.load_tensors(f"{server.url}/{name}")
    _same_tensors(got, want)
    _same_tensors(got, state, ordered=False)
    assert report.checkpoint.startswith(server.url)
    # bytes came by ranged GETs only: no GET asked for a whole file
    assert all(r.range is not None for r in server.requests if r.method == "GET")


def test_a_dcp_save_loads_from_its_folder_url(served):
    import torch.distributed.checkpoint as dcp

    root, server = served
    state = _state()
    dcp.save({k: v for k, v in state.items() if v.numel()}, checkpoint_id=str(root / "dcp"), no_dist=True)
    want, _ = mz.load_tensors(root / "dcp")
    got, _ = mz.load_tensors(f"{server.url}/dcp/")
    _same_tensors(got, want)


def test_a_model_loads_from_a_url_as_eager_construction_plus_load_state_dict(served):
    root, server = served
    model = reference_model(tie=True)
    write_safetensors(saved_state(model), root / "model.safetensors")
    loaded, _ = mz.load_model(f"{server.url}/model.safetensors", model=DECODER_SPEC, model_args={**TINY, "tie_embeddings": True})
    eager = reference_model(tie=True, seed=1)
    eager.load_state_dict(load_file(root / "model.safetensors"), strict=False)
    mine, theirs = loaded.state_dict(keep_vars=True), eager.state_dict(keep_vars=True)
    assert list(mine) == list(theirs)
    for name in theirs:
        assert type(mine[name]) is type(theirs[name]) and mine[name].requires_grad == theirs[name].requires_grad, name
        assert mine[name].dtype == theirs[name].dtype and mine[name].stride() == theirs[name].stride(), name
        assert torch.equal(mine[name], theirs[name]), name
    def ties(state):
        return sorted(sorted(n for n in state if state[n] is state[m]) for m in state)
    assert ties(mine) == ties(theirs)


def test_a_hugging_face_folder_url_builds_its_model_from_the_fetched_config(served):
    root, server = served
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    source = transformers.LlamaForCausalLM(config).eval()
    source.save_pretrained(root / "llama", max_shard_size="100KB")
    local, _ = mz.load_model(root / "llama")
    remote, report = mz.load_model(f"{server.url}/llama/")
    assert type(remote) is type(local) is transformers.LlamaForCausalLM
    _same_tensors(dict(remote.state_dict()), dict(local.state_dict()))
    assert report.checkpoint.startswith(server.url)


def test_the_cli_loads_and_inspects_a_url_in_a_subprocess(served):
    root, server = served
    write_safetensors(_state(), root / "model.safetensors")
    url = f"{server.url}/model.safetensors"
    loaded = preforked.run([CLI, url, "--json", "--connections", "2"], capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr
    assert set(json.loads(loaded.stdout)["loaded"]) == set(_state())
    shown = preforked.run([CLI, "inspect", url, "--json"], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert {t["name"] for t in json.loads(shown.stdout)["tensors"]} == set(_state())


def test_large_tensors_are_read_as_parallel_parts_on_at_most_the_stated_connections(served):
    root, server = served
    torch.manual_seed(1)
    state = {"big": torch.randn(1024, 1024), "other": torch.randn(512, 512)}
    write_safetensors(state, root / "model.safetensors")
    options = mz.RemoteOptions(connections=3, part_bytes=256 * 1024)
    got, _ = mz.load_tensors(f"{server.url}/model.safetensors", remote=options)
    _same_tensors(got, state, ordered=False)
    gets = [r for r in server.requests if r.method == "GET"]
    assert len(gets) >= 4 * 1024 * 1024 // (256 * 1024)  # the 4 MiB tensor alone is 16 parts
    assert server.connections <= 3


@pytest.mark.parametrize("fault", [
    {"reset_after": (3, 100_000)},   # connections reset mid-body
    {"slowdown": 3},                 # S3's 503 SlowDown
    {"server_errors": 3},            # 500s
    {"stall_after": (2, 50_000)},    # the server stops sending: the request times out and is retried
])
def test_faults_are_retried_and_the_load_is_the_files(served, fault):
    root, server = served
    torch.manual_seed(2)
    state = {"w": torch.randn(512, 512), "v": torch.randn(100)}
    write_safetensors(state, root / "model.safetensors")
    with FaultProxy(server.url, **fault) as proxy:
        got, _ = mz.load_tensors(f"{proxy.url}/model.safetensors", remote=FAST)
        assert sum(proxy.injected.values()) > 0
    _same_tensors(got, state, ordered=False)


def test_a_reset_answer_is_resumed_where_it_stopped_not_read_again(served):
    root, server = served
    torch.manual_seed(3)
    state = {"w": torch.randn(2048, 1024)}  # 8 MiB: one part
    write_safetensors(state, root / "model.safetensors")
    with FaultProxy(server.url, reset_after=(1, 5 * 1024 * 1024)) as proxy:
        got, _ = mz.load_tensors(f"{proxy.url}/model.safetensors", remote=FAST)
        assert proxy.injected["reset_after"] == 1
    _same_tensors(got, state)
    ranges = [tuple(map(int, r.range.split("=")[1].split("-"))) for r in server.requests if r.method == "GET"]
    # the retry asks for the rest of the tensor's range: from where whole megabytes had arrived, at most 5 MiB in
    resumed = [(start, later) for start, end in ranges for later, later_end in ranges
               if later_end == end and 0 < later - start <= 5 * 1024 * 1024]
    assert resumed and all(later - start >= 1024 * 1024 for start, later in resumed)


def test_faults_beyond_the_retries_fail_in_one_line_naming_the_url_and_the_range(served):
    root, server = served
    write_safetensors({"w": torch.randn(256, 256)}, root / "model.safetensors")
    with FaultProxy(server.url, server_errors=100) as proxy:
        url = f"{proxy.url}/model.safetensors"
        with pytest.raises(mz.CheckpointAccessError) as failure:
            mz.load_tensors(url, remote=mz.RemoteOptions(retries=1))
    message = str(failure.value)
    assert url in message and "bytes " in message and "HTTP 500" in message and "\n" not in message


def test_an_object_rewritten_during_the_load_is_an_error_not_a_mixed_model(served):
    root, server = served
    path = write_safetensors({"w": torch.zeros(64, 64)}, root / "model.safetensors")
    with mz.open_checkpoint(f"{server.url}/model.safetensors") as ckpt:  # its size and tag are taken here
        write_safetensors({"w": torch.ones(64, 64)}, path)  # same size, new bytes
        os.utime(path, ns=(1, 1))
        with pytest.raises(mz.CheckpointError, match="changed during the load"):
            mz.load_tensors(ckpt)


def test_redirects_are_followed_and_credentials_stay_with_their_host(tmp_path):
    (tmp_path / "cdn").mkdir()
    state = {"w": torch.randn(128, 128)}
    write_safetensors(state, tmp_path / "cdn" / "model.safetensors")
    with RangeServer(tmp_path / "cdn") as cdn, \
            RangeServer(tmp_path, redirects={"/resolve/": f"{cdn.url}/"}) as origin:
        from materialize.sources.httpstore import open_http

        source = open_http(f"{origin.url}/resolve/model.safetensors", FAST, headers={"Authorization": "Bearer t"})
        got, _ = mz.load_tensors(source)
        _same_tensors(got, state, ordered=False)
        assert all("Authorization" not in r.headers and "authorization" not in r.headers for r in cdn.requests)
        assert any(r.path.startswith("/resolve/") for r in origin.requests)
        # the redirect is asked once per object, not once per range
        assert sum(1 for r in origin.requests if r.method == "GET") <= 2


def test_mmap_of_a_url_is_refused_before_anything_is_read(served):
    root, server = served
    write_safetensors({"w": torch.zeros(4)}, root / "model.safetensors")
    url = f"{server.url}/model.safetensors"
    with pytest.raises(mz.CheckpointError, match="maps local files"):
        mz.load_tensors(url, mmap=True)
    run = preforked.run([CLI, url, "--mmap"], capture_output=True, text=True)
    assert run.returncode == 2 and "leave --mmap out" in run.stderr


def _read_as_folder(url: str, folder: str, want: dict[str, torch.Tensor]) -> None:
    """``url`` loaded by the library and listed by the CLI as the checkpoint of the folder URL ``folder``."""
    got, report = mz.load_tensors(url)
    _same_tensors(got, want)
    assert report.checkpoint.startswith(folder)
    shown = preforked.run([CLI, "inspect", url, "--json"], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert sorted(t["name"] for t in json.loads(shown.stdout)["tensors"]) == sorted(want)


@pytest.mark.parametrize("server_says", ["redirect", "404"])
def test_a_folder_url_written_without_its_slash_is_that_folder(tmp_path, server_says):
    """nginx redirects a folder's path to the path and a "/", and then refuses to list it (403); a server that
    redirects nothing answers 404 for it, and the folder is found by its files."""
    root = tmp_path / "www"
    state = _state()
    local = write_sharded(state, root / "m").parent
    want, _ = mz.load_tensors(local)
    with RangeServer(root, folder_redirects=server_says == "redirect") as server:
        _read_as_folder(f"{server.url}/m", f"{server.url}/m/", want)
        if server_says == "redirect":
            assert any(r.path == "/m" and r.method == "HEAD" for r in server.requests)
        with pytest.raises(mz.CheckpointNotFoundError, match="no such object"):  # no folder there either
            mz.load_tensors(f"{server.url}/absent")


@pytest.mark.parametrize("written", ["m/", "m"], ids=["with its slash", "without"])
@pytest.mark.parametrize("layout", ["sharded", "one file"])
def test_a_folder_on_a_store_that_refuses_missing_keys_is_read_by_its_files(tmp_path, written, layout):
    """S3 answers 403, not 404, for a key that is not there to a reader that may not list the bucket (anyone,
    on a public one): the folder's files that are there are read, the names refused beside them are absent,
    and a folder with nothing below it is the refusal it was."""
    root = tmp_path / "www"
    (root / "m").mkdir(parents=True)
    state = _state()
    local = (write_sharded(state, root / "m").parent if layout == "sharded"
             else write_safetensors(state, root / "m" / "model.safetensors").parent)
    want, _ = mz.load_tensors(local)
    with RangeServer(root, missing_status=403) as server:
        _read_as_folder(f"{server.url}/{written}", f"{server.url}/m/", want)
        refused = preforked.run([CLI, "inspect", f"{server.url}/absent"], capture_output=True, text=True)
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
        assert refused.stderr.startswith(f"Error: {server.url}/absent: access refused (HTTP 403)"), refused.stderr
        assert "S3 answers so for a name that is not there too" in refused.stderr
        with pytest.raises(mz.CheckpointAccessError, match="access refused"):  # a file's name: not probed as a folder
            mz.load_tensors(f"{server.url}/m/absent.safetensors")
        assert not any(r.path.startswith("/m/absent.safetensors/") for r in server.requests)


def test_a_missing_object_and_an_unknown_scheme_are_one_line_errors(served):
    root, server = served
    with pytest.raises(mz.CheckpointNotFoundError, match="no such object"):
        mz.load_tensors(f"{server.url}/absent.safetensors")
    with pytest.raises(mz.CheckpointError, match="wasbs:// sources are not read.*write az://CONTAINER@ACCOUNT"):
        mz.load_tensors("wasbs://container@account.blob.core.windows.net/model.safetensors")
    with pytest.raises(mz.CheckpointError, match=r"ftp:// sources are not read by this build \(it reads .*gs://"):
        mz.load_tensors("ftp://host/model.safetensors")


def test_convert_from_a_folder_url_writes_what_converting_the_local_folder_writes(served, tmp_path):
    root, server = served
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "llama", max_shard_size="100KB")
    remote = mz.convert(f"{server.url}/llama/", tmp_path / "from-url")
    local = mz.convert(root / "llama", tmp_path / "from-disk")
    assert sorted(remote.copied) == sorted(local.copied) and "config.json" in remote.copied
    for name in [*remote.files, *remote.copied]:
        assert (tmp_path / "from-url" / name).read_bytes() == (tmp_path / "from-disk" / name).read_bytes(), name


def test_fsdp2_ranks_each_read_only_their_own_rows_from_a_url(served, tmp_path):
    root, server = served
    source = reference_model(tie=True)
    state = saved_state(source)
    write_safetensors(state, root / "model.safetensors")

    ranks = run_ranks("fsdp", f"{server.url}/model.safetensors", tmp_path / "ranks")

    for rank in ranks:
        assert all(rank["equal"].values()) and rank["forward_equal"] and rank["tied"]
    # every byte of the tensors came to exactly one rank, by ranged GETs
    assert sum(rank["bytes_read"] for rank in ranks) == sum(t.numel() * t.element_size() for t in state.values())
    assert all(r.range is not None for r in server.requests if r.method == "GET")


def _self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by itself, and its key: a private CA's server."""
    x509 = pytest.importorskip("cryptography.x509")
    import datetime
    import ipaddress

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "materialize test CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                  critical=False)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .sign(key, hashes.SHA256()))
    cert, key_file = folder / "ca.pem", folder / "key.pem"
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert, key_file


def test_https_with_a_private_ca_is_refused_until_the_bundle_is_given(tmp_path):
    import ssl

    cert, key = _self_signed(tmp_path)
    (tmp_path / "www").mkdir()
    state = {"w": torch.randn(64, 64)}
    write_safetensors(state, tmp_path / "www" / "model.safetensors")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    with RangeServer(tmp_path / "www", tls=context) as server:
        url = f"{server.url}/model.safetensors"
        assert url.startswith("https://")
        with pytest.raises(mz.CheckpointAccessError, match="TLS certificate is not trusted.*ca_bundle"):
            mz.load_tensors(url)  # refused at once, not retried
        got, _ = mz.load_tensors(url, remote=mz.RemoteOptions(ca_bundle=str(cert)))
    _same_tensors(got, state)


def test_nothing_listening_is_refused_at_once_not_retried(tmp_path):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # free once closed
    with pytest.raises(mz.CheckpointAccessError, match="connection refused"):
        mz.load_tensors(f"http://127.0.0.1:{port}/model.safetensors")


def test_a_server_wanting_a_token_says_how_to_send_one_and_sending_it_works(tmp_path):
    state = {"w": torch.randn(32, 32)}
    write_safetensors(state, tmp_path / "model.safetensors")
    with RangeServer(tmp_path, token="sekret") as server:
        url = f"{server.url}/model.safetensors"
        refused = preforked.run([CLI, url], capture_output=True, text=True)
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1
        assert "--header 'Authorization: Bearer TOKEN'" in refused.stderr
        followed = preforked.run([CLI, url, "--header", "Authorization: Bearer sekret", "--json"],
                                  capture_output=True, text=True)
        assert followed.returncode == 0, followed.stderr
        wrong = preforked.run([CLI, url, "--header", "Authorization: Bearer nope"], capture_output=True, text=True)
        assert wrong.returncode == 1 and "credentials sent were refused" in wrong.stderr
        got, _ = mz.load_tensors(url, remote=mz.RemoteOptions(headers={"Authorization": "Bearer sekret"}))
    _same_tensors(got, state)


_PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


@pytest.fixture
def no_proxy_set(monkeypatch):
    """The environment's proxy variables, both cases, unset: each test sets its own."""
    for name in _PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    return monkeypatch


def _tls_server(tmp_path: Path, state: dict[str, torch.Tensor]):
    import ssl

    cert, key = _self_signed(tmp_path)
    (tmp_path / "www").mkdir()
    write_safetensors(state, tmp_path / "www" / "model.safetensors")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return RangeServer(tmp_path / "www", tls=context), cert


def test_https_goes_through_the_proxy_https_proxy_names_in_a_tunnel(tmp_path, no_proxy_set):
    state = {"w": torch.randn(64, 64), "b": torch.randn(64).to(torch.bfloat16)}
    server, cert = _tls_server(tmp_path, state)
    with server, ForwardProxy() as proxy:
        no_proxy_set.setenv("HTTPS_PROXY", proxy.url)
        got, _ = mz.load_tensors(f"{server.url}/model.safetensors", remote=mz.RemoteOptions(ca_bundle=str(cert)))
        _same_tensors(got, state, ordered=False)
        port = server.url.rpartition(":")[2]
        assert proxy.requests and set(proxy.requests) == {("CONNECT", f"127.0.0.1:{port}")}
        assert server.requests  # the server answered them, through the tunnel
        # every connection the server took was a tunnel: the tensors' ranged GETs too, not only the header's
        assert server.connections == len(proxy.requests)
        assert sum(1 for r in server.requests if r.method == "GET" and r.range) >= 2


def test_http_goes_through_the_proxy_http_proxy_names_and_no_proxy_leaves_a_host_out(tmp_path, no_proxy_set):
    state = {"w": torch.randn(64, 64)}
    write_safetensors(state, tmp_path / "model.safetensors")
    with RangeServer(tmp_path) as server, ForwardProxy() as proxy:
        no_proxy_set.setenv("HTTP_PROXY", proxy.url)
        url = f"{server.url}/model.safetensors"
        got, _ = mz.load_tensors(url)
        _same_tensors(got, state)
        assert {target for _, target in proxy.requests} == {url}  # the whole URL asked of the proxy
        assert {method for method, _ in proxy.requests} >= {"GET"}
        asked = len(proxy.requests)
        assert len(server.requests) == asked  # every request the server saw came through the proxy, tensors' too
        no_proxy_set.setenv("NO_PROXY", "localhost,127.0.0.1")
        got, _ = mz.load_tensors(url)
        _same_tensors(got, state)
        assert len(proxy.requests) == asked


@pytest.mark.parametrize("scheme", ["https", "http"])
def test_a_proxy_wanting_credentials_says_where_to_put_them_and_putting_them_there_works(tmp_path, no_proxy_set,
                                                                                         scheme):
    state = {"w": torch.randn(32, 32)}
    if scheme == "https":
        server, cert = _tls_server(tmp_path, state)
        options = mz.RemoteOptions(ca_bundle=str(cert))
    else:
        write_safetensors(state, tmp_path / "model.safetensors")
        server, cert, options = RangeServer(tmp_path), None, None
    variable = f"{scheme.upper()}_PROXY"
    with server, ForwardProxy(user="me", password="p@ss word") as proxy:
        url = f"{server.url}/model.safetensors"
        no_proxy_set.setenv(variable, proxy.url)
        with pytest.raises(mz.CheckpointAccessError, match=f"proxy {proxy.url} wants credentials.*407.*{variable}=http://USER:PASSWORD@"):
            mz.load_tensors(url, remote=options)
        env = {**os.environ, variable: proxy.url, **({"SSL_CERT_FILE": str(cert)} if cert else {})}
        command = [CLI, "inspect", url]
        refused = preforked.run(command, capture_output=True, text=True, env=env)
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1 and "407" in refused.stderr, refused.stderr
        with_credentials = proxy.url.replace("http://", "http://me:p%40ss%20word@")
        followed = preforked.run(command, capture_output=True, text=True, env={**env, variable: with_credentials})
        assert followed.returncode == 0, followed.stderr
        assert "me:" not in followed.stdout + followed.stderr  # the credentials are the proxy's alone
        no_proxy_set.setenv(variable, with_credentials)
        got, _ = mz.load_tensors(url, remote=options)
        _same_tensors(got, state)


def test_a_proxy_of_another_kind_is_refused_in_one_line(tmp_path, no_proxy_set):
    write_safetensors({"w": torch.randn(4)}, tmp_path / "model.safetensors")
    with RangeServer(tmp_path) as server:
        no_proxy_set.setenv("HTTP_PROXY", "socks5://127.0.0.1:1080")
        with pytest.raises(mz.CheckpointAccessError, match="socks5://127.0.0.1:1080 is not an http:// proxy"):
            mz.load_tensors(f"{server.url}/model.safetensors")
        assert not server.requests


def test_a_proxy_nothing_listens_at_is_named_not_the_server(tmp_path, no_proxy_set):
    import socket

    write_safetensors({"w": torch.randn(4)}, tmp_path / "model.safetensors")
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # free once closed
    with RangeServer(tmp_path) as server:
        no_proxy_set.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
        with pytest.raises(mz.CheckpointAccessError, match=f"nothing listens at the proxy http://127.0.0.1:{port}"):
            mz.load_tensors(f"{server.url}/model.safetensors")
        assert not server.requests
