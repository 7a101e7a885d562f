"""s3:// sources against moto's S3 server (signatures checked) started on 127.0.0.1 for this module: objects,
prefixes and Hugging Face folders load as their local files do; refused credentials are one line with a next
step that, followed, works; faults in front of the store are retried."""

from __future__ import annotations

import json
import os
from functools import partial
import sys
from pathlib import Path

import pytest
import torch
import transformers

import materialize as mz
from tests.conftest import write_safetensors, write_sharded, write_torch
from tests.remote_servers import FaultProxy
from tests.s3_server import S3Server
from tests.remote_checks import same_tensors, small_state as _state, upload as _upload
import preforked

pytest.importorskip("botocore")
pytest.importorskip("moto")  # the dev lock's; make test-oldest has botocore's floor but no server to test against

_same = partial(same_tensors, ordered=False)  # a safetensors file lists its names in its own order, not the state's

CLI = str(Path(sys.executable).parent / "materialize")


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        server.make_bucket("models")
        server.make_bucket("public", public=True)
        yield server


@pytest.fixture
def aws(s3, monkeypatch):
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    return s3


def test_an_object_a_prefix_and_an_index_load_as_their_local_files(aws, tmp_path):
    state = _state()
    write_safetensors(state, tmp_path / "one.safetensors")
    write_torch(state, tmp_path / "one.pt")
    write_sharded(state, tmp_path / "sharded")
    _upload(aws, "models", tmp_path, "t1/")
    for url, local in [("s3://models/t1/one.safetensors", tmp_path / "one.safetensors"),
                       ("s3://models/t1/one.pt", tmp_path / "one.pt"),
                       ("s3://models/t1/sharded/", tmp_path / "sharded"),
                       ("s3://models/t1/sharded", tmp_path / "sharded"),  # a prefix written without its slash
                       ("s3://models/t1/sharded/model.safetensors.index.json", tmp_path / "sharded")]:
        got, report = mz.load_tensors(url)
        want, _ = mz.load_tensors(local)
        assert list(got) == list(want), url
        _same(got, want)
        assert report.checkpoint.startswith("s3://models/t1/"), url


def test_a_hugging_face_prefix_builds_and_loads_its_model(aws, tmp_path):
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=99, n_positions=64)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(tmp_path / "gpt2", max_shard_size="60KB")
    _upload(aws, "models", tmp_path / "gpt2", "gpt2/")
    remote, _ = mz.load_model("s3://models/gpt2/")
    local, _ = mz.load_model(tmp_path / "gpt2")
    assert type(remote) is type(local) is transformers.GPT2LMHeadModel
    _same(dict(remote.state_dict()), dict(local.state_dict()))
    assert remote.lm_head.weight is remote.transformer.wte.weight  # the tie, as from_pretrained makes it


def test_the_cli_streams_from_s3_in_a_subprocess_with_the_standard_aws_environment(aws, tmp_path):
    write_safetensors(_state(), tmp_path / "model.safetensors")
    aws.put("models", "cli/model.safetensors", tmp_path / "model.safetensors")
    env = {**os.environ, **aws.env()}
    run = preforked.run([CLI, "s3://models/cli/model.safetensors", "--json"], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    assert set(json.loads(run.stdout)["loaded"]) == set(_state())


def test_wrong_credentials_are_one_line_naming_the_object(aws, tmp_path, monkeypatch):
    write_safetensors(_state(), tmp_path / "model.safetensors")
    aws.put("models", "creds/model.safetensors", tmp_path / "model.safetensors")
    env = {**os.environ, **aws.env(), "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    run = preforked.run([CLI, "s3://models/creds/model.safetensors"], capture_output=True, text=True, env=env)
    assert run.returncode == 1
    assert run.stderr.count("\n") == 1
    assert "s3://models/creds/model.safetensors" in run.stderr and "SignatureDoesNotMatch" in run.stderr


def test_no_credentials_suggest_unsigned_reads_and_following_the_hint_reads_a_public_bucket(aws, tmp_path, monkeypatch):
    state = _state(3)
    write_safetensors(state, tmp_path / "model.safetensors")
    aws.put("public", "open/model.safetensors", tmp_path / "model.safetensors")
    env = {k: v for k, v in {**os.environ, **aws.env()}.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    url = "s3://public/open/model.safetensors"
    refused = preforked.run([CLI, url], capture_output=True, text=True, env=env)
    assert refused.returncode == 1 and "--no-sign-request" in refused.stderr and url in refused.stderr
    followed = preforked.run([CLI, url, "--no-sign-request", "--json"], capture_output=True, text=True, env=env)
    assert followed.returncode == 0, followed.stderr
    assert set(json.loads(followed.stdout)["loaded"]) == set(state)


def test_unsigned_reads_of_a_private_bucket_are_refused_in_one_line(aws, tmp_path):
    write_safetensors(_state(), tmp_path / "model.safetensors")
    aws.put("models", "private/model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(mz.CheckpointAccessError, match="does not allow unsigned reads"):
        mz.load_tensors("s3://models/private/model.safetensors", remote=mz.RemoteOptions(anonymous=True))


def test_slow_down_and_resets_in_front_of_the_store_are_retried(aws, tmp_path, monkeypatch):
    state = {"w": torch.randn(256, 1024)}
    write_safetensors(state, tmp_path / "model.safetensors")
    aws.put("models", "faults/model.safetensors", tmp_path / "model.safetensors")
    with FaultProxy(aws.endpoint, slowdown=2, reset_after=(2, 200_000)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)  # presigned for the proxy's host, relayed as signed
        got, _ = mz.load_tensors("s3://models/faults/model.safetensors", remote=mz.RemoteOptions(retries=4))
        assert proxy.injected["slowdown"] == 2 and proxy.injected["reset_after"] >= 1
    _same(got, state)


def test_an_object_replaced_during_the_load_is_an_error(aws, tmp_path):
    write_safetensors({"w": torch.zeros(32, 32)}, tmp_path / "a.safetensors")
    write_safetensors({"w": torch.ones(32, 32)}, tmp_path / "b.safetensors")
    aws.put("models", "moving/model.safetensors", tmp_path / "a.safetensors")
    with mz.open_checkpoint("s3://models/moving/model.safetensors") as ckpt:
        aws.put("models", "moving/model.safetensors", tmp_path / "b.safetensors")
        with pytest.raises(mz.CheckpointError, match="changed during the load"):
            mz.load_tensors(ckpt)


def test_a_missing_key_and_a_missing_bucket_are_not_found(aws):
    with pytest.raises(mz.CheckpointNotFoundError, match="no such object"):
        mz.load_tensors("s3://models/absent/model.safetensors")
    with pytest.raises(mz.CheckpointNotFoundError, match="no such bucket"):
        mz.load_tensors("s3://no-such-bucket/model.safetensors")


def test_a_presigned_https_url_of_one_object_loads_though_it_is_signed_for_get_alone(aws, tmp_path):
    # S3 signs the method: the link refuses a HEAD, so the size comes from the answer to the first byte's GET
    state = _state(5)
    write_safetensors(state, tmp_path / "model.safetensors")
    aws.put("models", "presigned/model.safetensors", tmp_path / "model.safetensors")
    url = aws.client().generate_presigned_url("get_object", ExpiresIn=600,
                                              Params={"Bucket": "models", "Key": "presigned/model.safetensors"})
    assert "?" in url
    got, _ = mz.load_tensors(url)
    _same(got, state)
