"""A loopback S3 server for the remote-loading bench: moto's, reading only the bytes a ranged GET asks for.

Stock moto answers every GET by reading the whole object into one bytes
object and slicing the range out of it: for the bench's 1.9 GB checkpoint,
1.9 GB read and held per 16 MiB request, and 16 parallel requests would need
30 GB. :func:`slice_ranged_reads` makes a ranged GET read its range alone
from the object's stored file; everything else (signatures, headers, errors,
the XML of the other calls) is moto's own. Run as ``python -m bench.s3_server
[moto.server's options]``; :func:`serve` starts it on a free port, makes a
bucket, uploads files to it and stops it on exit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .nginx import free_port

# moto's own test credentials: the server accepts any, the clients must sign with some.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
START_SECONDS = 30.0
STOP_SECONDS = 10.0


@dataclass
class S3Endpoint:
    """Where the server listens, and the environment a client process needs to reach it."""

    url: str
    bucket: str
    pid: int
    env: dict[str, str] = field(default_factory=dict)


def client_env(url: str, config_dir: Path) -> dict[str, str]:
    """The variables that point botocore and Run:ai's streamer (the AWS C++ SDK) at ``url`` and nowhere else.

    The shared config and credentials files are pointed at an empty folder so
    a profile on the machine cannot change what is measured; the instance
    metadata service is off, so no client waits on it for credentials.
    """
    return {
        **CREDENTIALS,
        "AWS_ENDPOINT_URL": url,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": str(config_dir / "config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(config_dir / "credentials"),
        "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",  # http://127.0.0.1:PORT/bucket/key, not bucket.127.0.0.1
    }


@contextmanager
def serve(files: dict[str, Path], bucket: str = "bench") -> Iterator[S3Endpoint]:
    """A moto server on 127.0.0.1 holding ``files`` (key -> local path) in ``bucket``, until the block ends."""
    import tempfile

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as scratch:
        env = client_env(url, Path(scratch))
        log = open(Path(scratch) / "server.log", "wb")
        # The stored objects spill to temporary files: in the scratch folder, removed with it.
        server_env = {**os.environ, **env, "TMPDIR": scratch}
        process = subprocess.Popen(
            [sys.executable, "-m", "bench.s3_server", "-H", "127.0.0.1", "-p", str(port)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=server_env,
            cwd=Path(__file__).parent.parent,
        )
        try:
            _wait_until_answering(process, url, Path(scratch) / "server.log")
            _upload(url, bucket, files, env)
            yield S3Endpoint(url=url, bucket=bucket, pid=process.pid, env=env)
        finally:
            _stop(process)
            log.close()


def _wait_until_answering(process: subprocess.Popen, url: str, log: Path) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the S3 server exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1.0).read()
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    raise RuntimeError(f"the S3 server did not answer at {url} within {START_SECONDS:.0f} s")


def _upload(url: str, bucket: str, files: dict[str, Path], env: dict[str, str]) -> None:
    import boto3
    from boto3.s3.transfer import TransferConfig

    client = boto3.client("s3", endpoint_url=url, region_name=env["AWS_DEFAULT_REGION"],
                          aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    client.create_bucket(Bucket=bucket)
    # Large parts, two at a time: moto joins the parts in memory when the upload completes.
    config = TransferConfig(multipart_chunksize=256 * 2**20, max_concurrency=2)
    for key, path in files.items():
        client.upload_file(str(path), bucket, key, Config=config)


def _stop(process: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if process.poll() is not None:
            return
        process.send_signal(sig)
        try:
            process.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            continue


class _ObjectSlices:
    """A stored object's bytes, read a slice at a time from its file (what moto's range handling asks of it)."""

    def __init__(self, key: Any) -> None:
        self.key = key

    def __len__(self) -> int:
        return self.key.contentsize

    def __getitem__(self, item: slice) -> bytes:
        start, stop, _ = item.indices(len(self))
        with self.key.lock:
            self.key._value_buffer.seek(start)
            return self.key._value_buffer.read(max(0, stop - start))

    def __bytes__(self) -> bytes:
        return self[:]


def slice_ranged_reads() -> None:
    """Patch moto (in this process) so a GET object reads no more of the object than it sends.

    ``get_object`` hands ``_ObjectSlices`` in place of the object's bytes; moto's
    range handling then slices it, reading just the range; a GET without a
    range gets the whole object, read at the end as before.
    """
    from moto.s3.models import FakeKey
    from moto.s3.responses import S3Response

    getting = threading.local()
    whole = FakeKey.value

    def value(self: Any) -> Any:
        return _ObjectSlices(self) if getattr(getting, "object", False) else whole.fget(self)

    FakeKey.value = property(value, whole.fset)

    get_object = S3Response.get_object

    def sliced_get_object(self: Any) -> Any:
        getting.object = True
        try:
            return get_object(self)
        finally:
            getting.object = False

    S3Response.get_object = sliced_get_object

    key_response = S3Response.key_response

    def whole_unless_ranged(self: Any, *args: Any, **kwargs: Any) -> Any:
        status, headers, body = key_response(self, *args, **kwargs)
        return status, headers, bytes(body) if isinstance(body, _ObjectSlices) else body

    S3Response.key_response = whole_unless_ranged


def main() -> None:
    slice_ranged_reads()
    from moto.server import main as moto_main

    moto_main(sys.argv[1:])


if __name__ == "__main__":
    main()
