"""The remote-loading benches' servers and harnesses run end to end on small inputs and verify what they measure."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from test_bench import TINY_CONFIG

from bench import nginx, s3_server

ROOT = Path(__file__).resolve().parent.parent

needs_nginx = pytest.mark.skipif(shutil.which("nginx") is None and not os.access(nginx.DEBIAN_PATH, os.X_OK),
                                 reason="nginx is not installed (apt-get install nginx-light)")


@needs_nginx
def test_nginx_serves_a_folder_with_ranges_on_loopback_and_is_gone_after_the_block(tmp_path):
    (tmp_path / "data.bin").write_bytes(bytes(range(256)) * 64)

    with nginx.serve(tmp_path) as server:
        request = urllib.request.Request(server.url + "/data.bin", headers={"Range": "bytes=10-19"})
        with urllib.request.urlopen(request) as answer:
            status, body = answer.status, answer.read()
        pid = server.pid

    assert server.url.startswith("http://127.0.0.1:")
    assert (status, body) == (206, bytes(range(10, 20)))
    assert not Path(f"/proc/{pid}").exists()


def test_the_s3_server_answers_a_ranged_get_with_the_range_read_alone_and_a_plain_get_whole(tmp_path):
    pytest.importorskip("moto")
    import boto3

    data = os.urandom(3 * 2**20)
    (tmp_path / "object.bin").write_bytes(data)

    with s3_server.serve({"object.bin": tmp_path / "object.bin"}) as endpoint:
        client = boto3.client("s3", endpoint_url=endpoint.url, region_name=endpoint.env["AWS_DEFAULT_REGION"],
                              aws_access_key_id=endpoint.env["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=endpoint.env["AWS_SECRET_ACCESS_KEY"])
        ranged = client.get_object(Bucket=endpoint.bucket, Key="object.bin", Range="bytes=1000-1999999")
        whole = client.get_object(Bucket=endpoint.bucket, Key="object.bin")["Body"].read()

    assert ranged["ContentRange"] == f"bytes 1000-1999999/{len(data)}"
    assert ranged["Body"].read() == data[1000:2000000]
    assert whole == data


@needs_nginx
def test_the_http_clients_bench_reads_the_file_by_each_candidate_and_verifies_every_part(tmp_path):
    out = tmp_path / "results"

    subprocess.run([sys.executable, "-m", "bench.http_clients", "--size-mb", "4", "--part-mb", "1", "--runs", "1",
                    "--only", "stdlib-readinto,stdlib-waitall,urllib3-readinto", "--out", str(out)],
                   cwd=ROOT, check=True, capture_output=True, text=True,
                   env={**os.environ, "MATERIALIZE_BENCH_DIR": str(tmp_path / "data")})

    report = json.loads((out / "http_clients.json").read_text())
    assert set(report["results"]) == {"stdlib-readinto", "stdlib-waitall", "urllib3-readinto"}
    for name, row in report["results"].items():
        assert "error" not in row, (name, row)
        assert row["threads_1"]["verified"] and row["threads_4"]["verified"], name
        assert row["threads_1"]["gbps"] > 0 and row["threads_4"]["cpu_s_per_gb"] > 0
    assert "| http.client `HTTPResponse.readinto(view)` |" in (out / "http_clients.md").read_text()


@needs_nginx
def test_the_remote_bench_loads_from_http_and_s3_and_verifies_every_method(tmp_path):
    pytest.importorskip("moto")
    config = tmp_path / "bench-tiny.toml"
    config.write_text(TINY_CONFIG)
    out = tmp_path / "results"
    # Run:ai's streamer is a bench requirement (requirements-bench.txt), not a test one.
    methods = ["local", "http", "http-limit", "s3"]
    if importlib.util.find_spec("runai_model_streamer"):
        methods.append("runai-s3")

    subprocess.run([sys.executable, "-m", "bench.remote", "--config", str(config), "--data", str(tmp_path / "data"),
                    "--runs", "1", "--only", ",".join(methods), "--out", str(out)],
                   cwd=ROOT, check=True, capture_output=True, text=True)

    report = json.loads((out / "remote.json").read_text())
    assert set(report["results"]) == set(methods)
    for name, row in report["results"].items():
        assert "error" not in row, (name, row)
        assert row["verified"], name
    assert [goal["met"] is not None for goal in report["goals"]].count(True) >= 5  # all but Run:ai's, when it is absent
    assert "| ours, http (nginx) |" in (out / "remote.md").read_text()
