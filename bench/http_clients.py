"""``python -m bench.http_clients``: which HTTP client the streaming loader reads tensor bytes with.

A file of random bytes (1 GiB by default) is served by nginx on loopback; each
candidate client reads it whole as ranged GETs of 16 MiB parts into one
preallocated ``torch.uint8`` buffer, as the loader fills a tensor: once on one
connection, once with 4 threads on 4 kept-alive connections. Each candidate
runs in a fresh interpreter, the candidates taking turns over interleaved
rounds (median kept). Per candidate: GB/s (wall), CPU seconds per GB (the
child's ``getrusage``, user + sys, over the download alone), the peak memory
it needs beyond the buffer, and what it leaves the rest of the process: the
rate of a pure-Python counting thread running beside the download against its
rate alone, and the download's own rate beside that busy thread. Every part
of the buffer is checked against the file's CRC32, so a broken read cannot
count. The buffer's pages are faulted in before the clock starts (the loader
faults each chunk in with ``MADV_POPULATE_WRITE`` before reading into it), so
the numbers are the client's alone.

Results: ``bench/results/http_clients.json`` and ``.md``. The file is written
to ``MATERIALIZE_BENCH_DIR`` (and kept there) or to a temporary folder.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import resource
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Protocol
from urllib.parse import urlsplit

from . import nginx

RESULTS = Path(__file__).parent / "results"
MiB = 2**20
FILE_NAME = "random.bin"
COUNTER_ALONE_SECONDS = 0.5
# Beside a busy thread some clients slow a hundredfold (a GIL hand-off per small read): that run stops taking
# new parts after this long and reports the rate of what it read.
BUSY_SECONDS = 2.0
CHILD_TIMEOUT_SECONDS = 240


class Client(Protocol):
    """One connection of one candidate: fills a view with a byte range of a file."""

    def fetch(self, path: str, start: int, view: memoryview) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Candidate:
    name: str
    label: str
    writes: str  # how the bytes reach the buffer, read from the library's source


CANDIDATES = [
    Candidate("stdlib-readinto", "http.client `HTTPResponse.readinto(view)`",
              "straight in: `BufferedReader.readinto` of a request larger than its buffer calls `recv_into` on the "
              "destination; no Python bytes"),
    Candidate("stdlib-waitall", "http.client headers, then `recv_into(view, MSG_WAITALL)`",
              "straight in, one system call a part: the body bytes that came with the headers out of http.client's "
              "buffer, the rest by `socket.recv_into(..., MSG_WAITALL)` on the connection's socket (blocking, "
              "`SO_RCVTIMEO` for the timeout), the GIL released once a part"),
    Candidate("urllib3-readinto", "urllib3 `HTTPResponse.readinto(view)`",
              "through bytes: `readinto` is `read(len(b))` (http.client `read(amt)`: a new 16 MiB bytes object a "
              "part) then `b[:n] = data`"),
    Candidate("urllib3-read", "urllib3 `read(amt)` + copy",
              "through bytes: the same 16 MiB bytes object a part (`read(amt)` returns it whole from its "
              "decoded-content queue), copied into the view by us"),
    Candidate("requests", "requests `iter_content(1 MiB)` + copy",
              "through bytes: urllib3 `stream` reads 1 MiB bytes objects (http.client `read(amt)`), each copied "
              "into the view"),
    Candidate("httpx", "httpx `iter_raw()` + copy",
              "through bytes, 4 copies: httpcore `recv(64 KiB)`, h11 appends to its bytearray, slices it out, "
              "`bytes()` of the slice, then our copy; Python per 64 KiB"),
]


# The candidates. Each thread makes its own client, so N threads hold N kept-alive connections.

class StdlibReadinto:
    def __init__(self, base: str) -> None:
        split = urlsplit(base)
        self.connection = http.client.HTTPConnection(split.hostname, split.port, timeout=60)

    def fetch(self, path: str, start: int, view: memoryview) -> None:
        self.connection.request("GET", path, headers=_range(start, len(view)))
        response = self.connection.getresponse()
        _expect_partial(response.status)
        filled = 0
        while filled < len(view):
            got = response.readinto(view[filled:])
            if not got:
                raise EOFError(f"{path}: {filled} of {len(view)} bytes at {start}")
            filled += got

    def close(self) -> None:
        self.connection.close()


class StdlibWaitall(StdlibReadinto):
    """http.client for the request and headers; the body by one blocking ``recv_into`` that waits for all of it.

    ``BufferedReader.readinto`` returns to Python for every ``recv`` (what the
    socket holds at that moment: tens to hundreds of KB on loopback), taking
    the GIL back each time; ``MSG_WAITALL`` lets the kernel fill the whole part
    before the thread wants the GIL again. The socket must be blocking for
    that (a Python timeout makes it non-blocking), so the timeout moves to
    ``SO_RCVTIMEO``.
    """

    TIMEOUT = struct.pack("ll", 60, 0)

    def fetch(self, path: str, start: int, view: memoryview) -> None:
        self.connection.request("GET", path, headers=_range(start, len(view)))
        response = self.connection.getresponse()
        _expect_partial(response.status)
        filled = response.readinto(view[:min(len(response.fp.peek(1)), len(view))])
        sock = self.connection.sock
        if sock.gettimeout() is not None:
            sock.settimeout(None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, self.TIMEOUT)
        while filled < len(view):
            got = sock.recv_into(view[filled:], len(view) - filled, socket.MSG_WAITALL)
            if not got:
                raise EOFError(f"{path}: {filled} of {len(view)} bytes at {start}")
            filled += got
        response.length = 0  # its bytes were read past it: let it close, so the connection takes the next request
        response.read()


class Urllib3:
    def __init__(self, base: str, readinto: bool) -> None:
        import urllib3

        split = urlsplit(base)
        self.pool = urllib3.HTTPConnectionPool(split.hostname, split.port, maxsize=1, retries=False, timeout=60.0)
        self.readinto = readinto

    def fetch(self, path: str, start: int, view: memoryview) -> None:
        response = self.pool.request("GET", path, headers=_range(start, len(view)), preload_content=False)
        try:
            _expect_partial(response.status)
            filled = 0
            while filled < len(view):
                if self.readinto:
                    got = response.readinto(view[filled:])
                else:
                    data = response.read(len(view) - filled)
                    got = len(data)
                    view[filled:filled + got] = data
                if not got:
                    raise EOFError(f"{path}: {filled} of {len(view)} bytes at {start}")
                filled += got
        finally:
            response.release_conn()

    def close(self) -> None:
        self.pool.close()


class Requests:
    CHUNK = 1 * MiB

    def __init__(self, base: str) -> None:
        import requests

        self.base = base
        self.session = requests.Session()

    def fetch(self, path: str, start: int, view: memoryview) -> None:
        with self.session.get(self.base + path, headers=_range(start, len(view)), stream=True, timeout=60) as response:
            _expect_partial(response.status_code)
            filled = 0
            for chunk in response.iter_content(chunk_size=self.CHUNK):
                view[filled:filled + len(chunk)] = chunk
                filled += len(chunk)
            _expect_filled(filled, view, path, start)

    def close(self) -> None:
        self.session.close()


class Httpx:
    def __init__(self, base: str) -> None:
        self.base = base
        self.client = _httpx().Client(timeout=60.0)

    def fetch(self, path: str, start: int, view: memoryview) -> None:
        with self.client.stream("GET", self.base + path, headers=_range(start, len(view))) as response:
            _expect_partial(response.status_code)
            filled = 0
            for chunk in response.iter_raw():
                view[filled:filled + len(chunk)] = chunk
                filled += len(chunk)
            _expect_filled(filled, view, path, start)

    def close(self) -> None:
        self.client.close()


def _httpx():
    """httpx, under the name it is installed as here (httpx2 is its renamed successor)."""
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx
    return httpx


MAKERS: dict[str, Callable[[str], Client]] = {
    "stdlib-readinto": StdlibReadinto,
    "stdlib-waitall": StdlibWaitall,
    "urllib3-readinto": lambda base: Urllib3(base, readinto=True),
    "urllib3-read": lambda base: Urllib3(base, readinto=False),
    "requests": Requests,
    "httpx": Httpx,
}


def _range(start: int, length: int) -> dict[str, str]:
    return {"Range": f"bytes={start}-{start + length - 1}"}


def _expect_partial(status: int) -> None:
    if status != 206:
        raise RuntimeError(f"expected 206 Partial Content, got {status}")


def _expect_filled(filled: int, view: memoryview, path: str, start: int) -> None:
    if filled != len(view):
        raise EOFError(f"{path}: {filled} of {len(view)} bytes at {start}")


# The child: one candidate, one fresh interpreter.

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


# The parent: the file, the server, the rounds, the report.

@contextmanager
def random_file(size: int, part: int) -> Iterator[tuple[Path, list[int]]]:
    """The served file and its parts' CRC32s: kept in MATERIALIZE_BENCH_DIR, else in a folder removed after."""
    kept = os.environ.get("MATERIALIZE_BENCH_DIR")
    with (tempfile.TemporaryDirectory(prefix="bench-http-") if kept is None else _folder(Path(kept))) as folder:
        path = Path(folder) / "http-clients" / FILE_NAME
        sums = path.with_suffix(".crc32.json")
        if path.exists() and path.stat().st_size == size and sums.exists() and json.loads(sums.read_text())["part"] == part:
            crcs = json.loads(sums.read_text())["crcs"]
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            crcs = []
            with open(path, "wb") as out:
                for start in range(0, size, part):
                    block = os.urandom(min(part, size - start))
                    crcs.append(zlib.crc32(block))
                    out.write(block)
            sums.write_text(json.dumps({"part": part, "crcs": crcs}))
        yield path, crcs


@contextmanager
def _folder(path: Path) -> Iterator[str]:
    path.mkdir(parents=True, exist_ok=True)
    yield str(path)


def run_child(job: dict) -> dict:
    done = subprocess.run([sys.executable, "-m", "bench.http_clients", "--child"], input=json.dumps(job),
                          capture_output=True, text=True, cwd=Path(__file__).parent.parent,
                          timeout=CHILD_TIMEOUT_SECONDS)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


MODE_FIELDS = ("wall_s", "cpu_s", "gbps", "cpu_s_per_gb", "counter_ratio", "busy_gbps")


def summarize(runs: list[dict], threads: int) -> dict:
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        return {"error": errors[0]}
    summary: dict = {"extra_peak_bytes": statistics.median(r["extra_peak_bytes"] for r in runs),
                     "counter_alone_per_s": statistics.median(r["counter_alone_per_s"] for r in runs)}
    for mode in ("threads_1", f"threads_{threads}"):
        rows = [r[mode] for r in runs]
        summary[mode] = {field: statistics.median(row[field] for row in rows) for field in MODE_FIELDS}
        summary[mode]["gbps_runs"] = [row["gbps"] for row in rows]
        summary[mode]["verified"] = all(row["verified"] for row in rows)
    return summary


def markdown(report: dict) -> str:
    threads, m = report["threads"], report["machine"]
    lines = [
        f"{report['size'] / 2**30:.0f} GiB of random bytes as {report['part'] // MiB} MiB ranged GETs into one "
        f"preallocated torch.uint8 buffer, from {report['server']} on loopback ({m['cpu']}, {m['cores']} cores, "
        f"Linux {m['kernel']}, Python {m['python']}); median of {report['rounds']} interleaved rounds, each "
        f"candidate a fresh process (slowest-fastest round in brackets). 1 thread: one connection; {threads} threads: {threads} kept-alive "
        f"connections. CPU: the client process's user + sys over the download. Counter: a pure-Python counting "
        f"thread's rate beside the download against its rate alone; beside it, the download's own rate.",
        "",
        f"| client | GB/s 1 thread | GB/s {threads} threads | CPU s/GB 1 / {threads} | counter beside 1 / {threads} | "
        f"GB/s beside the counter 1 / {threads} | extra peak MB | verified | how bytes reach the buffer |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for candidate in CANDIDATES:
        result = report["results"].get(candidate.name)
        if result is None:
            continue
        if "error" in result:
            lines.append(f"| {candidate.label} | error: {result['error'][:80]} | | | | | | | |")
            continue
        one, many = result["threads_1"], result[f"threads_{threads}"]
        lines.append(
            f"| {candidate.label} | {_spread(one)} | {_spread(many)} | {one['cpu_s_per_gb']:.2f} / "
            f"{many['cpu_s_per_gb']:.2f} | {one['counter_ratio']:.2f} / {many['counter_ratio']:.2f} | "
            f"{one['busy_gbps']:.3f} / {many['busy_gbps']:.3f} | {result['extra_peak_bytes'] / 1e6:.0f} | "
            f"{'yes' if one['verified'] and many['verified'] else 'NO'} | {candidate.writes} |"
        )
    return "\n".join(lines) + "\n"


def _spread(mode: dict) -> str:
    """The median GB/s, the slowest and fastest round beside it."""
    return f"{mode['gbps']:.2f} ({min(mode['gbps_runs']):.2f}-{max(mode['gbps_runs']):.2f})"


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size-mb", type=int, default=1024, help="the file's size in MiB")
    parser.add_argument("--part-mb", type=int, default=16, help="each ranged GET's size in MiB")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", help="comma-separated candidates: " + ",".join(c.name for c in CANDIDATES))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(sys.stdin.read()))))
        return

    from .run import machine

    wanted = args.only.split(",") if args.only else [c.name for c in CANDIDATES]
    unknown = set(wanted) - set(MAKERS)
    if unknown:
        parser.error(f"unknown candidates: {', '.join(sorted(unknown))}")
    size, part = args.size_mb * MiB, args.part_mb * MiB
    report: dict = {"machine": machine(), "server": nginx.nginx_version(), "size": size, "part": part,
                    "threads": args.threads, "rounds": args.rounds, "results": {}}
    runs: dict[str, list[dict]] = {name: [] for name in wanted}
    with random_file(size, part) as (path, crcs), nginx.serve(path.parent) as server:
        job = {"base": server.url, "path": "/" + path.name, "size": size, "part": part, "crcs": crcs, "threads": args.threads}
        for round_ in range(args.rounds):
            for name in wanted:
                started = time.perf_counter()
                runs[name].append(run_child({**job, "candidate": name}))
                print(f"round {round_ + 1} {name:<18} {time.perf_counter() - started:5.1f} s  "
                      f"{_short(runs[name][-1], args.threads)}", flush=True)
    report["results"] = {name: summarize(runs[name], args.threads) for name in wanted}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "http_clients.json").write_text(json.dumps(report, indent=2))
    (out / "http_clients.md").write_text(markdown(report))
    print()
    print(markdown(report))


def _short(result: dict, threads: int) -> str:
    if "error" in result:
        return f"error: {result['error']}"
    one, many = result["threads_1"], result[f"threads_{threads}"]
    return (f"{one['gbps']:.2f} / {many['gbps']:.2f} GB/s  {one['cpu_s_per_gb']:.2f} / {many['cpu_s_per_gb']:.2f} "
            f"CPU s/GB  counter {one['counter_ratio']:.2f} / {many['counter_ratio']:.2f}  "
            f"verified {one['verified'] and many['verified']}")


if __name__ == "__main__":
    main()
