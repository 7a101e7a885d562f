"""One candidate of ``bench.http_clients`` measured in a fresh interpreter: ``python -m bench.http_download``.

Reads a JSON job on stdin (the server's URL, the file's size, the part size,
the parts' CRC32s, the candidate) and prints one JSON object: per thread
count, wall and CPU seconds of a whole read, whether every part matched, the
rate of a counting thread beside the read against its rate alone, and the
read's rate beside it; and the peak memory beyond the buffer.
"""

from __future__ import annotations

import itertools
import json
import resource
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from .http_candidates import MAKERS, Client

COUNTER_ALONE_SECONDS = 0.5
# Beside a busy thread some clients slow a hundredfold (a GIL hand-off per small read): that run stops taking
# new parts after this long and reports the rate of what it read.
BUSY_SECONDS = 2.0


def download(make: Callable[[], Client], path: str, view: memoryview, part: int, threads: int,
             deadline: Optional[float] = None) -> list[int]:
    """Fill ``view`` from ``path`` part by part on ``threads`` connections; the indices of the parts read.

    Parts are handed out in order as threads come free, as the loader's reader
    threads take their jobs. Past ``deadline`` no new part is started.
    """
    count = (len(view) + part - 1) // part
    handed = itertools.count()  # next() on it is atomic under the GIL
    done: list[int] = []

    def work() -> None:
        client = make()
        try:
            while (index := next(handed)) < count:
                if deadline is not None and time.perf_counter() > deadline:
                    return
                start = index * part
                client.fetch(path, start, view[start:start + part])
                done.append(index)
        finally:
            client.close()

    if threads == 1:
        work()
    else:
        with ThreadPoolExecutor(threads) as pool:
            for future in [pool.submit(work) for _ in range(threads)]:
                future.result()
    return sorted(done)


class Counter:
    """A pure-Python thread counting as fast as it can: what the interpreter has left for other Python work."""

    def __init__(self) -> None:
        self.running = True
        self.count = 0
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        count = 0
        started = time.perf_counter()
        while self.running:
            count += 1
        self.seconds = time.perf_counter() - started
        self.count = count

    @property
    def rate(self) -> float:
        return self.count / self.seconds

    def __enter__(self) -> "Counter":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.running = False
        self._thread.join()


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _verified(view: memoryview, part: int, crcs: list[int], parts: list[int]) -> bool:
    return bool(parts) and all(zlib.crc32(view[i * part:(i + 1) * part]) == crcs[i] for i in parts)


def child(job: dict) -> dict:
    """One candidate's measurements; ``job`` holds the URL, sizes and the parts' CRC32s."""
    import torch

    make_client = MAKERS[job["candidate"]]
    base, path = job["base"], job["path"]
    make = lambda: make_client(base)  # noqa: E731
    buffer = torch.empty(job["size"], dtype=torch.uint8)
    buffer.fill_(0)  # fault every page in now, off the clock
    view = memoryview(buffer.numpy())
    part, crcs = job["part"], job["crcs"]
    make().close()  # the library's lazy imports and set-up, off the clock
    baseline_rss = _status_bytes("VmRSS")

    with Counter() as alone:
        time.sleep(COUNTER_ALONE_SECONDS)
    result: dict = {"counter_alone_per_s": alone.rate}
    for threads in (1, job["threads"]):
        buffer.fill_(0)
        before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        parts = download(make, path, view, part, threads)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        verified = len(parts) == len(crcs) and _verified(view, part, crcs, parts)

        buffer.fill_(0)
        with Counter() as beside:
            started = time.perf_counter()
            busy_parts = download(make, path, view, part, threads, deadline=started + BUSY_SECONDS)
            busy_wall = time.perf_counter() - started
        result[f"threads_{threads}"] = {
            "wall_s": wall, "cpu_s": cpu, "gbps": job["size"] / wall / 1e9, "cpu_s_per_gb": cpu / (job["size"] / 1e9),
            "verified": verified and _verified(view, part, crcs, busy_parts),
            "counter_ratio": beside.rate / alone.rate,
            "busy_gbps": len(busy_parts) * part / busy_wall / 1e9,
        }
    result["extra_peak_bytes"] = max(0, _status_bytes("VmHWM") - baseline_rss)
    return result



if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.stdin.read()))))
