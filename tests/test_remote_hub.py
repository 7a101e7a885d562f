"""Hub repos with stream=True / --stream, against a stand-in hub and CDN on 127.0.0.1: the model is the one a
download makes, its weights never land in the cache, and the token goes to the hub, never to the CDN."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import transformers

import materialize as mz
from tests.fake_hub import FakeHub
import preforked

REPO = "tiny-org/tiny-gpt2"
TOKEN = "hf_stream_token"
CLI = str(Path(sys.executable).parent / "materialize")


@pytest.fixture
def repo(tmp_path) -> Path:
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=99, n_positions=64)
    torch.manual_seed(0)
    folder = tmp_path / "repos" / REPO
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(folder, max_shard_size="60KB")
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    return folder


@pytest.fixture(params=[None, TOKEN], ids=["public", "private"])
def hub(request, repo, tmp_path, monkeypatch):
    with FakeHub(repo.parent.parent, token=request.param) as fake:
        fake.redirect_huggingface_hub(monkeypatch, cache_dir=tmp_path / "cache")
        if fake.token:
            monkeypatch.setenv("HF_TOKEN", fake.token)
        yield fake


def test_a_streamed_repo_is_the_model_a_local_load_makes_and_no_weights_are_cached(hub, repo, tmp_path):
    streamed, report = mz.load_model(REPO, stream=True)
    local, _ = mz.load_model(repo)
    assert type(streamed) is type(local) is transformers.GPT2LMHeadModel
    mine, theirs = streamed.state_dict(), local.state_dict()
    assert list(mine) == list(theirs)
    for name in theirs:
        assert mine[name].dtype == theirs[name].dtype and torch.equal(mine[name], theirs[name]), name
    assert streamed.lm_head.weight is streamed.transformer.wte.weight
    cached = [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert "config.json" in cached and not any(name.endswith(".safetensors") for name in cached)
    weights = [r for r in hub.seen("cdn") if r.method == "GET"]
    assert weights and all("range" in r.headers for r in weights)
    assert all("authorization" not in r.headers for r in hub.seen("cdn"))
    if hub.token:
        assert any(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in hub.seen("hub"))
    assert report.checkpoint.startswith(hub.endpoint)


def test_inspect_and_plan_stream_only_headers(hub, repo):
    described = mz.inspect(REPO, stream=True)
    assert described["tensor_count"] == len(mz.inspect(repo)["tensors"])
    the_plan = mz.plan(None, REPO, stream=True)
    assert the_plan.to_dict()["checkpoint"].startswith(hub.endpoint)


def test_the_cli_streams_a_repo_in_a_subprocess_and_a_missing_token_is_one_line(hub, tmp_path):
    env = {**os.environ, **hub.env(), "HF_HUB_CACHE": str(tmp_path / "cli-cache"), "HOME": str(tmp_path)}
    run = preforked.run([CLI, REPO, "--stream", "--json"], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["checkpoint"].startswith(hub.endpoint)
    if hub.token:
        refused = preforked.run([CLI, REPO, "--stream"], capture_output=True, text=True,
                                 env={**env, "HF_TOKEN": "", "HF_HUB_CACHE": str(tmp_path / "other-cache")})
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
        assert REPO in refused.stderr


def test_stream_is_for_repo_ids_only(tmp_path):
    run = preforked.run([CLI, str(tmp_path), "--stream"], capture_output=True, text=True)
    assert run.returncode == 2 and "--stream reads a hub repo id" in run.stderr


def test_a_hub_resolve_url_loads_as_an_https_source_through_its_redirect(hub, repo):
    if hub.token:
        pytest.skip("a plain URL carries no token; a private repo is read with --stream")
    index = json.loads((repo / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    got, _ = mz.load_tensors(hub.resolve_url(REPO, first))
    want, _ = mz.load_tensors(repo / first)
    assert list(got) == list(want) and all(torch.equal(got[n], want[n]) for n in want)
    # the bytes came from the CDN; the hub was asked for the redirect, not for the bytes
    assert any(r.method == "GET" for r in hub.seen("cdn"))
    assert not any(r.method == "GET" and "range" in r.headers for r in hub.seen("hub"))
