"""What a remote source must never do, whatever its server answers: show a URL's secrets, send a header to an
origin it was not given for, hang, reuse a connection whose framing went wrong, or retry what cannot mend.

The secrets test is generated: every failure mode :data:`MODES` names (one script of a raw server on 127.0.0.1
each) x every channel a user sees (the exception's str, repr, path and reason and its traceback; the log
records; the progress steps; the CLI's Error line for a load and for ``inspect --json``)."""

from __future__ import annotations

import logging
import re
import socket
import traceback
from typing import Optional

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save

import materialize as mz
from materialize.text import printable, shown_url
from materialize_cli.main import main
from tests.misbehaving_server import MisbehavingServer, Reply, Seen, answer, drip
from tests.remote_servers import RangeServer

SECRETS = ("alice", "PASSW0RD", "SIGSECRET", "TOKSECRET", "CREDSECRET", "SASSECRET")
SIGNED_QUERY = ("X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=CREDSECRET%2F20261207&"
                "X-Amz-Security-Token=TOKSECRET&X-Amz-Signature=SIGSECRET&sig=SASSECRET")
TIMEOUT = 0.5  # seconds: a stalled request is cut off quickly here
DATA = save({"weight": torch.arange(64, dtype=torch.float32).reshape(8, 8), "bias": torch.ones(8)})


def _file(seen: Seen) -> Reply:
    """The checkpoint served as a file server serves it: HEAD, whole GET, single byte range."""
    wanted = seen.headers.get("range")
    if seen.line.startswith("HEAD"):
        return answer(200, b"", {"ETag": '"v1"', "Accept-Ranges": "bytes"}, length=len(DATA))
    if wanted is None:
        return answer(200, DATA, {"ETag": '"v1"'})
    first, _, last = wanted.removeprefix("bytes=").partition("-")
    start, end = int(first), min(int(last), len(DATA) - 1)
    return answer(206, DATA[start:end + 1], {"ETag": '"v1"', "Content-Range": f"bytes {start}-{end}/{len(DATA)}"})


def _get_fails(failure):
    """HEAD answered as a file server does, every GET as ``failure`` says."""
    return lambda seen: _file(seen) if seen.line.startswith("HEAD") else failure(seen)


def _range_of(seen: Seen) -> tuple[int, int]:
    first, _, last = seen.headers["range"].removeprefix("bytes=").partition("-")
    return int(first), min(int(last), len(DATA) - 1)


def _wrong_range(seen: Seen) -> Reply:
    start, end = _range_of(seen)
    return answer(206, DATA[start:end + 1], {"Content-Range": f"bytes {start + 1}-{end + 1}/{len(DATA)}"})


def _cut_short(seen: Seen) -> Reply:
    start, end = _range_of(seen)
    whole = answer(206, DATA[start:end + 1], {"Content-Range": f"bytes {start}-{end}/{len(DATA)}"})
    return Reply([whole.pieces[0][:-((end - start + 1) // 2)]], close=True)


def _longer_framing(seen: Seen) -> Reply:
    start, end = _range_of(seen)
    return answer(206, DATA[start:end + 1], {"Content-Range": f"bytes {start}-{end}/{len(DATA)}"},
                  length=end - start + 1 + 100)


def _dripped_body(seen: Seen) -> Reply:
    start, end = _range_of(seen)
    whole = answer(206, DATA[start:end + 1], {"Content-Range": f"bytes {start}-{end}/{len(DATA)}"}).pieces[0]
    head_end = whole.index(b"\r\n\r\n") + 4
    body = whole[head_end:]
    return Reply([whole[:head_end]] + [body[i:i + 1] for i in range(len(body))], pause=0.05)


# mode: (the server's script, or None for a port where nothing listens; the scheme asked; words the error has)
MODES = {
    "not-found": (lambda seen: answer(404, b"no such file"), "http", "no such object"),
    "refused": (lambda seen: answer(403, b"<Error><Code>AccessDenied</Code><Message>no</Message></Error>"), "http",
                "access refused"),
    "server-error": (lambda seen: answer(500, b"oops"), "http", "after 0 retries: HTTP 500"),
    "redirect-loop": (lambda seen: answer(302, b"", {"Location": seen.path}), "http", "redirects"),
    "wrong-range": (_get_fails(_wrong_range), "http", "asked for bytes"),
    "cut-short": (_get_fails(_cut_short), "http", "ended|connection reset|closed the connection"),
    "longer-framing": (_get_fails(_longer_framing), "http", "Content-Length"),
    "silent": (lambda seen: None, "http", "timed out|too slow"),
    "dripped-headers": (lambda seen: drip(_file(seen), 0.05), "http", "too slow"),
    "dripped-body": (_get_fails(_dripped_body), "http", "too slow"),
    "nothing-listens": (None, "http", "connection refused"),
    "tls-to-plain": (_file, "https", "write http://"),
}
OPTIONS = mz.RemoteOptions(timeout=TIMEOUT, retries=0)


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]


def _url(scheme: str, port: int) -> str:
    return f"{scheme}://alice:PASSW0RD@127.0.0.1:{port}/models/model.safetensors?{SIGNED_QUERY}"


def _served(mode: str):
    script, scheme, words = MODES[mode]
    return (MisbehavingServer(script) if script is not None else None), scheme, words


class _Steps:
    """A progress object that keeps every step it is told and every count."""

    def __init__(self) -> None:
        self.steps: list[str] = []

    def phase(self, text: str) -> None:
        self.steps.append(text)

    def __call__(self, done: int, total: int) -> None:
        pass


def _assert_no_secret(where: str, text: str) -> None:
    found = [secret for secret in SECRETS if secret in text]
    assert not found, f"{where} shows {found}: {text}"


def _run(mode: str, call):
    server, scheme, words = _served(mode)
    if server is None:
        return call(_url(scheme, _free_port())), words
    with server:
        return call(_url(scheme, server.port)), words


@pytest.mark.parametrize("mode", list(MODES))
def test_no_failure_shows_a_secret_of_the_url_through_the_library(mode, caplog):
    steps = _Steps()

    def load(url: str) -> BaseException:
        with pytest.raises(mz.MaterializeError) as raised:
            mz.load_tensors(url, remote=OPTIONS, progress=steps)
        return raised.value

    with caplog.at_level(logging.DEBUG, logger="materialize"):
        error, words = _run(mode, load)
    assert re.search(words, str(error)), str(error)
    assert "127.0.0.1" in str(error)  # the URL is still named, without its secrets
    for where, text in [("str", str(error)), ("repr", repr(error)), ("path", str(error.path)),
                        ("reason", error.reason), ("traceback", "".join(traceback.format_exception(error))),
                        ("logs", "\n".join(record.getMessage() for record in caplog.records)),
                        ("progress", "\n".join(steps.steps))]:
        _assert_no_secret(where, text)
    assert steps.steps, "the progress channel was told nothing: it checks nothing"


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("command", [[], ["inspect", "--json"]], ids=["load", "inspect-json"])
def test_no_failure_shows_a_secret_of_the_url_in_the_cli(mode, command):
    def run(url: str):
        return CliRunner().invoke(main, [*command, url, "--request-timeout", str(TIMEOUT), "--retries", "0"],
                                  prog_name="materialize")

    result, words = _run(mode, run)
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("Error: ") and re.search(words, result.stderr), result.stderr
    assert "after 0 retries" in result.stderr or "retries" not in result.stderr  # --retries 0 is taken
    _assert_no_secret("stderr", result.stderr)
    _assert_no_secret("stdout", result.stdout)


def test_a_signed_url_that_loads_shows_no_secret_in_the_report_the_json_or_the_cli():
    with MisbehavingServer(_file) as server:
        url = _url("http", server.port)
        tensors, report = mz.load_tensors(url, remote=OPTIONS)
        loaded = CliRunner().invoke(main, [url, "--json"], prog_name="materialize")
        inspected = CliRunner().invoke(main, ["inspect", url], prog_name="materialize")
    assert torch.equal(tensors["weight"], torch.arange(64, dtype=torch.float32).reshape(8, 8))
    assert loaded.exit_code == 0 and inspected.exit_code == 0, loaded.output + inspected.output
    for where, text in [("report", str(report)), ("report dict", repr(report.to_dict())),
                        ("load --json", loaded.output), ("inspect", inspected.output)]:
        _assert_no_secret(where, text)
        assert "X-Amz-Signature=" in text or where == "report dict" and "X-Amz-Signature=" in repr(text), text


@pytest.mark.parametrize("url, shown", [
    ("https://u:p@h:8/a/m.safetensors?X-Amz-Signature=s&sig=t#frag", "https://h:8/a/m.safetensors?X-Amz-Signature=\u2026&sig=\u2026"),
    ("https://TOKEN@h/m.bin", "https://h/m.bin"),
    ("https://h/m.bin?bare-token", "https://h/m.bin?\u2026"),
    ("s3://bucket/key.safetensors", "s3://bucket/key.safetensors"),
    ("az://container@account.blob.core.windows.net/k", "az://container@account.blob.core.windows.net/k"),
    ("HTTPS_PROXY=http://USER:PASSWORD@HOST:PORT", "HTTPS_PROXY=http://USER:PASSWORD@HOST:PORT"),  # a hint's form
])
def test_shown_url_keeps_what_names_the_object_and_drops_what_authorizes_it(url, shown):
    if "://" in url.partition("=")[0]:
        assert shown_url(url) == shown
        assert shown_url(shown) == shown  # showing twice changes nothing
    assert printable(f"Error: {url}: it failed") == f"Error: {shown}: it failed"


# --- headers stay with their origin ------------------------------------------------------------------------------

USER_HEADERS = {"Authorization": "Bearer user-token", "Cookie": "session=user-cookie", "X-Api-Key": "user-key",
                "X-Custom-Anything": "user-value"}


@pytest.mark.parametrize("target", ["other-port", "other-scheme"])
def test_no_header_the_user_gives_reaches_another_origin_a_redirect_leads_to(tmp_path, target):
    root = tmp_path / "www"
    root.mkdir()
    (root / "model.safetensors").write_bytes(DATA)
    with RangeServer(root) as elsewhere:
        # A redirect to another port of the same host is another origin; one to the same host and port but
        # another scheme is too (there: http:// to http:// on 127.0.0.2, the nearest a test server offers).
        host = "127.0.0.1" if target == "other-port" else "localhost"
        with RangeServer(root, redirects={"/model.safetensors": f"http://{host}:{elsewhere.url.rsplit(':', 1)[1]}"
                                          "/model.safetensors"}) as origin:
            url = f"{origin.url}/model.safetensors"
            tensors, _ = mz.load_tensors(url, remote=mz.RemoteOptions(headers=USER_HEADERS, retries=0))
    assert torch.equal(tensors["bias"], torch.ones(8))
    assert origin.requests and elsewhere.requests, "the redirect was not followed: this checks nothing"
    for request in origin.requests:
        assert {k: request.headers.get(k) for k in USER_HEADERS} == USER_HEADERS
    for request in elsewhere.requests:
        sent = {k.lower() for k in request.headers}
        assert not sent & {k.lower() for k in USER_HEADERS}, request.headers


def test_a_redirect_to_the_same_origin_keeps_the_users_headers():
    from materialize.sources.http import _headers_for, origin

    headers = {**USER_HEADERS, "Range": "bytes=0-9"}
    assert _headers_for("http://h:80/b", "http://H/a", headers) == headers  # the scheme's port written or not
    assert origin("https://h/a") != origin("http://h:443/a")
    assert _headers_for("http://h/b", "https://h/a", headers) == {"Range": "bytes=0-9"}  # no downgrade carries them


# --- deadlines -----------------------------------------------------------------------------------------------------

def _steady(seen: Seen) -> Reply:
    """Every answer's body in eight pieces a tenth of a second apart: slow, and above the least rate."""
    reply = _file(seen)
    whole = reply.pieces[0]
    head_end = whole.index(b"\r\n\r\n") + 4
    body = whole[head_end:]
    step = max(1, len(body) // 8)
    return Reply([whole[:head_end]] + [body[i:i + step] for i in range(0, len(body), step)], pause=0.1)


def test_a_slow_server_above_the_least_rate_is_not_cut_off():
    with MisbehavingServer(_steady) as server:
        tensors, _ = mz.load_tensors(f"http://127.0.0.1:{server.port}/model.safetensors",
                                     remote=mz.RemoteOptions(timeout=0.3, min_rate=64, retries=0))
    assert torch.equal(tensors["weight"], torch.arange(64, dtype=torch.float32).reshape(8, 8))


def test_a_request_cut_off_for_its_rate_is_retried_logged_and_the_retry_can_succeed(caplog):
    answered: list[int] = []

    def first_drips(seen: Seen) -> Optional[Reply]:
        answered.append(1)
        return drip(_file(seen), 0.05) if len(answered) == 1 else _file(seen)

    with MisbehavingServer(first_drips) as server, caplog.at_level(logging.INFO, logger="materialize"):
        tensors, _ = mz.load_tensors(_url("http", server.port), remote=mz.RemoteOptions(timeout=TIMEOUT, retries=2))
    assert torch.equal(tensors["bias"], torch.ones(8))
    assert len(answered) >= 3  # the dripping HEAD, its retry, and the GETs
    retries = [record.getMessage() for record in caplog.records if "retry 1 of 2" in record.getMessage()]
    assert retries and "too slow" in retries[0] and "127.0.0.1" in retries[0], caplog.text
    _assert_no_secret("logs", caplog.text)


# --- what no retry mends is refused at once ------------------------------------------------------------------------

def test_https_to_a_plain_http_server_is_refused_at_once_naming_http():
    with MisbehavingServer(_file) as server:
        with pytest.raises(mz.CheckpointAccessError, match=r"plain HTTP.*write http://") as raised:
            mz.load_tensors(f"https://127.0.0.1:{server.port}/model.safetensors",
                            remote=mz.RemoteOptions(retries=5, timeout=5))
    assert len(server.seen) == 1, server.seen  # one handshake, no retry
    fixed = raised.value.reason  # the hint is a promise: the URL it names loads
    assert "http://" in fixed
    with MisbehavingServer(_file) as server:
        tensors, _ = mz.load_tensors(f"http://127.0.0.1:{server.port}/model.safetensors")
    assert torch.equal(tensors["bias"], torch.ones(8))


# --- framing -------------------------------------------------------------------------------------------------------

def test_a_connection_whose_answer_left_bytes_behind_is_not_asked_again():
    """An error answer longer than what is read of it (its body past the error excerpt) and an answer whose
    Content-Length promised more than came: the next request goes on a new connection, never reading the
    left-over bytes as its answer."""
    connections: list[int] = []
    error_body = b"x" * 10_000  # past ERROR_BODY_BYTES: the rest stays on the connection

    def script(seen: Seen) -> Reply:
        if seen.line.startswith("HEAD"):
            return _file(seen)
        start, end = _range_of(seen)
        if start == 0 and not connections:
            connections.append(1)
            return answer(503, error_body, {"Retry-After": "0"})
        return _file(seen)

    with MisbehavingServer(script) as server:
        tensors, _ = mz.load_tensors(f"http://127.0.0.1:{server.port}/model.safetensors",
                                     remote=mz.RemoteOptions(timeout=TIMEOUT, retries=2))
    assert torch.equal(tensors["weight"], torch.arange(64, dtype=torch.float32).reshape(8, 8))


# --- an object replaced during a load --------------------------------------------------------------------------------

VERSIONS = {  # how a server tells one version of an object from another, and what a GET must ask of it
    "strong-etag": ({"ETag": '"v1"'}, "if-match", '"v1"'),
    "weak-etag-and-date": ({"ETag": 'W/"v1"', "Last-Modified": "Mon, 07 Dec 2026 10:00:00 GMT"},
                           "if-unmodified-since", "Mon, 07 Dec 2026 10:00:00 GMT"),
    "date-only": ({"Last-Modified": "Mon, 07 Dec 2026 10:00:00 GMT"}, "if-unmodified-since",
                  "Mon, 07 Dec 2026 10:00:00 GMT"),
}


def _versioned(validators: dict[str, str], replaced: list[bool]):
    """A file server whose object is replaced (new bytes, new validators) once ``replaced`` holds True: a GET that
    still names the first version's validator is answered 412, as RFC 9110 says."""
    def script(seen: Seen) -> Reply:
        now = validators if not replaced[0] else {k: v.replace("v1", "v2").replace("10:00", "11:00")
                                                    for k, v in validators.items()}
        asked_tag, asked_date = seen.headers.get("if-match"), seen.headers.get("if-unmodified-since")
        if replaced[0] and (asked_tag or asked_date):
            return answer(412, b"precondition failed", now)
        reply = _file(seen)
        head, _, body = reply.pieces[0].partition(b"\r\n\r\n")
        head = b"\r\n".join(line for line in head.split(b"\r\n") if not line.startswith(b"ETag"))
        extra = "".join(f"\r\n{k}: {v}" for k, v in now.items()).encode()
        if seen.line.startswith("GET") and seen.headers.get("range", "").startswith("bytes=0-"):
            replaced[0] = True  # replaced right after the header's read: the tensors' GETs meet the new version
        return Reply([head + extra + b"\r\n\r\n" + body])
    return script


@pytest.mark.parametrize("version", list(VERSIONS))
def test_an_object_replaced_during_a_load_is_refused_whatever_validator_its_server_gives(version):
    validators, header, value = VERSIONS[version]
    replaced = [False]
    with MisbehavingServer(_versioned(validators, replaced)) as server:
        with pytest.raises(mz.CheckpointError, match="changed during the load"):
            mz.load_tensors(f"http://127.0.0.1:{server.port}/model.safetensors", remote=OPTIONS)
    gets = [seen for seen in server.seen if seen.line.startswith("GET")]
    assert gets and all(seen.headers.get(header) == value for seen in gets), [s.headers for s in gets]


def test_a_server_that_gives_no_validator_is_named_in_a_warning(recwarn):
    def bare(seen: Seen) -> Reply:
        reply = _file(seen)
        head, _, body = reply.pieces[0].partition(b"\r\n\r\n")
        head = b"\r\n".join(line for line in head.split(b"\r\n") if not line.startswith(b"ETag"))
        return Reply([head + b"\r\n\r\n" + body])

    with MisbehavingServer(bare) as server:
        with pytest.warns(mz.MaterializeWarning, match="no strong ETag and no Last-Modified.*cannot be detected"):
            tensors, _ = mz.load_tensors(_url("http", server.port).replace("/models/", "/"), remote=OPTIONS)
        result = CliRunner().invoke(main, [_url("http", server.port)], prog_name="materialize")
    assert torch.equal(tensors["bias"], torch.ones(8))
    assert result.exit_code == 0 and "Warning: " in result.stderr and "cannot be detected" in result.stderr
    _assert_no_secret("warning", result.stderr)
    _assert_no_secret("warnings", " ".join(str(w.message) for w in recwarn))


def test_the_cli_shows_a_retry_with_dash_v_and_no_secret_of_the_url():
    failed: list[int] = []

    def fails_once(seen: Seen) -> Reply:
        if not failed:
            failed.append(1)
            return answer(503, b"busy", {"Retry-After": "0"})
        return _file(seen)

    with MisbehavingServer(fails_once) as server:
        result = CliRunner().invoke(main, ["-v", _url("http", server.port)], prog_name="materialize")
    assert result.exit_code == 0, result.output
    retried = [line for line in result.stderr.splitlines() if "retry 1 of" in line]
    assert retried and "HTTP 503" in retried[0] and "127.0.0.1" in retried[0], result.stderr
    _assert_no_secret("stderr", result.stderr)
