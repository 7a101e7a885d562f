"""The test servers themselves, seen by plain ``http.client``: the streaming tests trust what they serve and
the faults they inject, so each behaviour is checked here once, on the wire."""

from __future__ import annotations

import http.client
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.remote_servers import FaultProxy, RangeServer, byte_range

SIZE = 1 << 20


@pytest.fixture
def root(tmp_path: Path) -> Path:
    served = tmp_path / "served"
    (served / "sub").mkdir(parents=True)
    (served / "model.safetensors").write_bytes(os.urandom(SIZE))
    (served / "sub" / "config.json").write_bytes(b'{"hidden_size": 32}')
    (tmp_path / "outside.bin").write_bytes(b"not served")
    return served


@pytest.fixture(autouse=True)
def no_server_threads_left():
    yield
    left = [t.name for t in threading.enumerate() if t.name.startswith(("RangeServer", "FaultProxy"))]
    assert left == []


@pytest.fixture
def connect():
    """Open client connections, each closed when the test ends."""
    opened: list[http.client.HTTPConnection] = []

    def connect(url: str, timeout: float = 5.0) -> http.client.HTTPConnection:
        parts = urlsplit(url)
        opened.append(http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout))
        return opened[-1]

    yield connect
    for connection in opened:
        connection.close()


def get(connection: http.client.HTTPConnection, path: str, method: str = "GET",
        **headers: str) -> tuple[http.client.HTTPResponse, bytes]:
    connection.request(method, path, headers={name.replace("_", "-"): value for name, value in headers.items()})
    response = connection.getresponse()
    return response, response.read()


# ---------------------------------------------------------------------------------------------------- RangeServer


def test_ranges_of_each_form_give_the_exact_bytes_over_one_kept_alive_connection(root, connect):
    data = (root / "model.safetensors").read_bytes()
    with RangeServer(root) as server:
        connection = connect(server.url)
        response, body = get(connection, "/model.safetensors")
        assert (response.status, body) == (200, data)
        assert response.headers["Content-Length"] == str(SIZE)
        assert response.headers["Accept-Ranges"] == "bytes"
        etag = response.headers["ETag"]
        assert etag.startswith('"') and etag.endswith('"')
        for header, start, end in [("bytes=0-7", 0, 7), ("bytes=100-", 100, SIZE - 1), ("bytes=-16", SIZE - 16, SIZE - 1),
                                   ("bytes=1000-99999999", 1000, SIZE - 1), ("bytes=-99999999", 0, SIZE - 1)]:
            response, body = get(connection, "/model.safetensors", Range=header)
            assert response.status == 206, header
            assert response.headers["Content-Range"] == f"bytes {start}-{end}/{SIZE}"
            assert response.headers["Content-Length"] == str(end - start + 1)
            assert response.headers["ETag"] == etag
            assert body == data[start:end + 1]
        response, body = get(connection, "/model.safetensors", "HEAD", Range="bytes=8-15")
        assert (response.status, body, response.headers["Content-Length"]) == (206, b"", "8")
        response, body = get(connection, "/sub/config.json")
        assert (body, response.headers["Content-Type"]) == (b'{"hidden_size": 32}', "application/json")
        assert server.connections == 1
        assert [record.range for record in server.requests][:3] == [None, "bytes=0-7", "bytes=100-"]
        method, path, range_header, headers = server.requests[-2]
        assert (method, path, range_header, headers["Range"]) == ("HEAD", "/model.safetensors", "bytes=8-15", "bytes=8-15")


@pytest.mark.parametrize("header, expected", [
    (None, None), ("bytes=0-0", (0, 0)), ("bytes=5-", (5, 9)), ("bytes=-3", (7, 9)), ("bytes=3-2", None),
    ("bytes=0-1,4-5", None), ("items=0-1", None), ("bytes=-", None),
])
def test_byte_range_reads_single_ranges_and_ignores_the_rest(header, expected):
    assert byte_range(header, 10) == expected


def test_refusals_416_412_401_404(root, connect):
    with RangeServer(root, token="secret") as server:
        connection = connect(server.url)
        response, _ = get(connection, "/model.safetensors")
        assert response.status == 401
        response, _ = get(connection, "/model.safetensors", Authorization="Bearer wrong")
        assert response.status == 401
        authorized = {"Authorization": "Bearer secret"}
        response, _ = get(connection, "/model.safetensors", **authorized)
        etag = response.headers["ETag"]
        assert response.status == 200
        response, _ = get(connection, "/model.safetensors", Range=f"bytes={SIZE}-", **authorized)
        assert (response.status, response.headers["Content-Range"]) == (416, f"bytes */{SIZE}")
        response, _ = get(connection, "/model.safetensors", Range="bytes=-0", **authorized)
        assert response.status == 416
        response, _ = get(connection, "/model.safetensors", If_Match='"another"', **authorized)
        assert response.status == 412
        response, _ = get(connection, "/model.safetensors", If_Match=f'W/{etag}', **authorized)
        assert response.status == 412  # If-Match compares strongly
        response, body = get(connection, "/model.safetensors", If_Match=etag, Range="bytes=0-3", **authorized)
        assert (response.status, len(body)) == (206, 4)
        for missing in ["/nothing.bin", "/sub", "/sub/", "/", "/../outside.bin", "/%2e%2e/outside.bin"]:
            response, _ = get(connection, missing, **authorized)
            assert response.status == 404, missing
        assert server.connections == 1  # every refusal kept the connection alive


def test_etag_changes_when_the_file_is_rewritten(root, connect):
    with RangeServer(root) as server:
        connection = connect(server.url)
        before = get(connection, "/model.safetensors", "HEAD")[0].headers["ETag"]
        (root / "model.safetensors").write_bytes(os.urandom(SIZE))
        response, _ = get(connection, "/model.safetensors", "HEAD", If_Match=before)
        assert response.status == 412


def test_redirect_to_another_server_names_the_target_as_the_hub_does(root, connect):
    with RangeServer(root) as cdn, RangeServer(root, redirects={"/org/model/resolve/main/": cdn.url + "/"}) as hub:
        response, _ = get(connect(hub.url), "/org/model/resolve/main/model.safetensors?download=1", "HEAD")
        assert response.status == 302
        location = response.headers["Location"]
        assert location == f"{cdn.url}/model.safetensors?download=1"
        assert response.headers["X-Linked-Size"] == str(SIZE)
        target, body = get(connect(cdn.url), urlsplit(location).path + "?" + urlsplit(location).query, Range="bytes=0-9")
        assert response.headers["X-Linked-ETag"] == target.headers["ETag"]
        assert body == (root / "model.safetensors").read_bytes()[:10]
        elsewhere, _ = get(connect(hub.url), "/org/model/resolve/main/absent.bin")
        assert elsewhere.status == 302 and "X-Linked-Size" not in elsewhere.headers
        assert [record.path for record in cdn.requests] == ["/model.safetensors?download=1"]


def test_closing_leaves_no_thread_and_the_port_refuses(root, connect):
    before = set(threading.enumerate())
    with RangeServer(root) as server, FaultProxy(server.url) as proxy:
        idle = connect(proxy.url)
        get(idle, "/model.safetensors", Range="bytes=0-0")  # both kept alive, idle, when the with block ends
        urls = [server.url, proxy.url]
    assert set(threading.enumerate()) - before == set()
    for url in urls:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((urlsplit(url).hostname, urlsplit(url).port), timeout=2).close()


# ---------------------------------------------------------------------------------------------------- FaultProxy


def test_proxy_relays_verbatim_over_kept_alive_connections(root, connect):
    data = (root / "model.safetensors").read_bytes()
    with RangeServer(root) as server, FaultProxy(server.url) as proxy:
        connection = connect(proxy.url)
        response, body = get(connection, "/model.safetensors", Range="bytes=10-19", X_Amz_Date="20250101T000000Z")
        assert (response.status, body, response.headers["Content-Range"]) == (206, data[10:20], f"bytes 10-19/{SIZE}")
        assert get(connection, "/model.safetensors")[1] == data
        assert get(connection, "/model.safetensors", "HEAD")[0].headers["Content-Length"] == str(SIZE)
        assert get(connection, "/absent")[0].status == 404
        headers = server.requests[0].headers
        assert headers["Host"] == urlsplit(proxy.url).netloc  # the client's Host, not rewritten
        assert headers["X-Amz-Date"] == "20250101T000000Z"
        assert (proxy.requests, server.connections, proxy.injected) == (4, 1, {})


def test_reset_after_cuts_the_body_then_answers_normally(root, connect):
    data = (root / "model.safetensors").read_bytes()
    with RangeServer(root) as server, FaultProxy(server.url, reset_after=(1, 1000)) as proxy:
        connection = connect(proxy.url)
        short, _ = get(connection, "/model.safetensors", Range="bytes=0-99")
        assert short.status == 206  # a body no longer than 1000 bytes is not the one reset
        connection.request("GET", "/model.safetensors")
        response = connection.getresponse()
        assert response.status == 200
        received = bytearray()
        with pytest.raises((ConnectionResetError, http.client.IncompleteRead)):
            while chunk := response.read(100):
                received += chunk
        assert bytes(received) == data[:len(received)] and len(received) <= 1000
        assert get(connect(proxy.url), "/model.safetensors")[1] == data
        assert proxy.injected == {"reset_after": 1}


def test_slowdown_and_server_errors_answer_in_place_of_the_upstream(root, connect):
    with RangeServer(root) as server, FaultProxy(server.url, slowdown=2, server_errors=1) as proxy:
        connection = connect(proxy.url)
        assert get(connection, "/model.safetensors", "HEAD")[0].status == 200  # HEADs are not faulted
        for _ in range(2):
            response, body = get(connection, "/model.safetensors", Range="bytes=0-7")
            assert (response.status, response.headers["Retry-After"]) == (503, "0")
            assert body == b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
        response, _ = get(connect(proxy.url), "/model.safetensors", Range="bytes=0-7")  # counted over connections
        assert response.status == 500
        response, body = get(connection, "/model.safetensors", Range="bytes=0-7")
        assert (response.status, len(body)) == (206, 8)
        assert [record.method for record in server.requests] == ["HEAD", "GET"]  # faulted GETs never forwarded
        assert proxy.injected == {"slowdown": 2, "server_errors": 1}


def test_faults_are_counted_once_over_parallel_connections(root, connect):
    data = (root / "model.safetensors").read_bytes()
    with RangeServer(root) as server, FaultProxy(server.url, slowdown=5) as proxy:
        def four_gets(worker: int) -> list[int]:
            connection = connect(proxy.url)
            statuses = []
            for index in range(4):
                start = (worker * 4 + index) * 1000
                response, body = get(connection, "/model.safetensors", Range=f"bytes={start}-{start + 999}")
                assert body == data[start:start + 1000] or response.status == 503
                statuses.append(response.status)
            return statuses

        with ThreadPoolExecutor(8) as pool:
            statuses = [status for answers in pool.map(four_gets, range(8)) for status in answers]
        assert sorted(statuses) == [206] * 27 + [503] * 5
        assert (proxy.injected, proxy.requests, len(server.requests)) == ({"slowdown": 5}, 32, 27)


def test_latency_delays_each_answer(root, connect):
    with RangeServer(root) as server, FaultProxy(server.url, latency=0.2) as proxy:
        connection = connect(proxy.url)
        for method in ("HEAD", "GET"):
            started = time.monotonic()
            get(connection, "/sub/config.json", method)
            assert time.monotonic() - started >= 0.2


def test_rate_paces_bodies(root, connect):
    rate = 4 * SIZE  # a 1 MiB body in at least 0.25 s
    with RangeServer(root) as server, FaultProxy(server.url, rate=rate) as proxy:
        started = time.monotonic()
        _, body = get(connect(proxy.url), "/model.safetensors")
        assert len(body) == SIZE
        assert time.monotonic() - started >= SIZE / rate - 0.05


def test_stall_keeps_the_connection_silent_until_the_proxy_stops(root, connect):
    data = (root / "model.safetensors").read_bytes()
    with RangeServer(root) as server:
        proxy = FaultProxy(server.url, stall_after=(1, 500))
        with proxy:
            connection = connect(proxy.url, timeout=0.5)
            connection.request("GET", "/model.safetensors")
            response = connection.getresponse()
            assert response.read(500) == data[:500]
            with pytest.raises(socket.timeout):
                response.read(1)
            assert get(connect(proxy.url), "/model.safetensors")[1] == data
            stopping = time.monotonic()
        assert time.monotonic() - stopping < 2  # the stalled thread ended with the proxy
        assert proxy.injected == {"stall_after": 1}


def test_unreachable_upstream_is_a_502(root, connect):
    with RangeServer(root) as server:
        gone = server.url
    with FaultProxy(gone) as proxy:
        assert get(connect(proxy.url), "/model.safetensors")[0].status == 502
