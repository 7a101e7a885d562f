"""One load of ``bench.remote`` in a fresh interpreter: ``python -m bench.remote_methods LOADER SOURCE EXPECTED``.

LOADER: ``ours`` (``materialize.load_tensors``), ``runai`` (Run:ai's
``SafetensorsStreamer``) or ``limit`` (:func:`http_limit`, the bar for
``http://``). Prints one JSON object: the load's wall and CPU seconds, peak
RSS growth over the RSS after imports, and whether the sampled tensors match
the checksums in EXPECTED (the fixture's ``expected.json``).
"""

from __future__ import annotations

import itertools
import json
import resource
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import torch

from materialize.io.hostmem import prefault

from .fixtures import crc
from .http_candidates import StdlibReadinto


def _status_bytes(field_name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> bool:
    """Start VmHWM afresh from the current RSS (Linux: ``5`` to ``clear_refs``), so the peak is the load's."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


LIMIT_THREADS = 4
LIMIT_PART = 16 * 2**20


def http_limit(url: str) -> dict:
    """The bar for ``http``: the file as 16 MiB ranged GETs on 4 kept-alive connections into one fresh buffer.

    The data path ``bench.http_clients`` chose (http.client's ``readinto``)
    with nothing else: no plan, no tensors, no retries or checks; each part's
    pages faulted in just before its GET, as the loader does. The tensors
    returned are views of the buffer, sliced by the file's header, so they
    are verified as every method's are.
    """
    split = urlsplit(url)
    base, path = f"{split.scheme}://{split.netloc}", split.path
    probe = StdlibReadinto(base)
    probe.connection.request("HEAD", path)
    answer = probe.connection.getresponse()
    answer.read()
    size = int(answer.getheader("Content-Length"))
    probe.close()
    buffer = torch.empty(size, dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    handed = itertools.count()
    count = (size + LIMIT_PART - 1) // LIMIT_PART

    def work() -> None:
        client = StdlibReadinto(base)
        try:
            while (index := next(handed)) < count:
                start = index * LIMIT_PART
                stop = min(size, start + LIMIT_PART)
                prefault(buffer.data_ptr() + start, stop - start)
                client.fetch(path, start, view[start:stop])
        finally:
            client.close()

    with ThreadPoolExecutor(LIMIT_THREADS) as pool:
        for future in [pool.submit(work) for _ in range(LIMIT_THREADS)]:
            future.result()
    header_bytes = struct.unpack("<Q", view[:8])[0]
    header = json.loads(bytes(view[8:8 + header_bytes]))
    data = 8 + header_bytes
    return {name: buffer[data + entry["data_offsets"][0]:data + entry["data_offsets"][1]]
            for name, entry in header.items() if name != "__metadata__"}


def _prepare(loader: str, source: str) -> Callable[[], dict]:
    """Import what the load needs, off the clock (as ``bench.methods`` does); return the timed load.

    The modules a URL load imports on first use (the source's store, botocore
    for ``s3://``) are imported here too: their import is a once-a-process
    cost, not a load's (and under PYTHONDONTWRITEBYTECODE, a compile of their sources).
    """
    if loader == "limit":
        return lambda: http_limit(source)
    if loader == "ours":
        from materialize import load_tensors

        if source.startswith(("http://", "https://")):
            import materialize.sources.httpstore  # noqa: F401
        if source.startswith("s3://"):
            import botocore.session  # noqa: F401
            import materialize.sources.s3  # noqa: F401
        return lambda: load_tensors(source)[0]
    from runai_model_streamer import SafetensorsStreamer

    def stream() -> dict:
        tensors = {}
        with SafetensorsStreamer() as streamer:
            # owned=True (the default): every tensor is the caller's, no buffer is reused under it.
            streamer.stream_file(source)
            for name, tensor in streamer.get_tensors():
                tensors[name] = tensor
        return tensors

    return stream


def child(loader: str, source: str, expected_path: Path) -> dict:
    """One load; what it cost and whether the tensors hold the file's bytes."""
    load = _prepare(loader, source)
    expected = json.loads(expected_path.read_text())
    peak_reset = _reset_peak_rss()
    baseline = _status_bytes("VmRSS")
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    tensors = load()
    load_s = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    peak = _status_bytes("VmHWM") if peak_reset else after.ru_maxrss * 1024
    held = _status_bytes("VmRSS")
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    verified = nbytes == expected["nbytes"] and all(
        name in tensors and crc(tensors[name]) == value for name, value in expected["same"].items())
    return {
        "load_s": load_s,
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "rss_growth": peak - baseline,
        "held_growth": held - baseline,
        "tensors": len(tensors),
        "nbytes": nbytes,
        "verified": verified,
    }


if __name__ == "__main__":
    loader, source, expected = sys.argv[1:4]
    print(json.dumps(child(loader, source, Path(expected))))
