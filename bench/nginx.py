"""A throwaway nginx serving one folder on loopback, for the remote-loading benches.

nginx rather than a Python server: the benches measure the client, and a
server written in Python would be the bottleneck (and burn the CPU the client
is measured on) long before any client is. Its config is generated into a
temporary prefix, so nothing of the system's nginx setup (``/etc/nginx``,
``/var/log/nginx``, its pid file) is read or written.
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

DEBIAN_PATH = "/usr/sbin/nginx"  # not on a plain user's PATH on Debian
START_SECONDS = 10.0
STOP_SECONDS = 10.0

CONFIG = """\
daemon off;
{user}worker_processes {workers};
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;

events {{
    worker_connections 1024;
}}

http {{
    access_log off;
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    keepalive_timeout 300s;
    keepalive_requests 1000000;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;

    server {{
        listen 127.0.0.1:{port};
        root {root};
        location / {{
        }}
    }}
}}
"""


@dataclass(frozen=True)
class Served:
    """A running nginx: its address (no trailing slash) and its master's process id (the workers are its children)."""

    url: str
    pid: int


class NginxMissing(RuntimeError):
    """No nginx binary: the benches that serve files over HTTP need one."""


def nginx_binary() -> str:
    """The nginx executable: on PATH, else where Debian puts it."""
    found = shutil.which("nginx") or (DEBIAN_PATH if os.access(DEBIAN_PATH, os.X_OK) else None)
    if found is None:
        raise NginxMissing(f"nginx not found (on PATH or at {DEBIAN_PATH}); install it with "
                           "`apt-get install nginx-light` (or your system's nginx package)")
    return found


def nginx_version(binary: Optional[str] = None) -> str:
    """``nginx/1.22.1``: nginx prints its version on stderr."""
    done = subprocess.run([binary or nginx_binary(), "-v"], capture_output=True, text=True, check=True)
    return (done.stderr or done.stdout).strip().rsplit(" ", 1)[-1]


def free_port() -> int:
    """A port nothing listens on now; nginx binds it a moment later (a race retried by :func:`serve`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def serve(folder: Path, workers: int = 2, attempts: int = 3) -> Iterator[Served]:
    """Serve ``folder`` at ``http://127.0.0.1:PORT`` until the block ends.

    Two workers by default: one per core of the machines the benches were
    written on, so the server can keep up with two client connections at once.
    """
    binary = nginx_binary()
    root = Path(folder).resolve()
    for attempt in range(attempts):
        with tempfile.TemporaryDirectory(prefix="bench-nginx-") as prefix:
            port = free_port()
            config = Path(prefix) / "nginx.conf"
            # Workers of a root master run as `nobody` unless told otherwise, and could not read root's files.
            user = "user root;\n" if os.geteuid() == 0 else ""
            config.write_text(CONFIG.format(user=user, workers=workers, prefix=prefix, port=port, root=root))
            with open(Path(prefix) / "stderr.log", "wb") as stderr:  # before -e takes effect, nginx writes here
                process = subprocess.Popen(
                    [binary, "-p", prefix, "-c", str(config), "-e", f"{prefix}/error.log"],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
                )
            try:
                if _wait_until_answering(process, port):
                    yield Served(url=f"http://127.0.0.1:{port}", pid=process.pid)
                    return
                log = _error_log(Path(prefix))
                if "Address already in use" not in log or attempt == attempts - 1:
                    raise RuntimeError(f"nginx did not start on 127.0.0.1:{port}: {log.strip()[-2000:]}")
            finally:
                _stop(process)


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its live children so far (nginx's master and workers).

    Read from ``/proc``: the servers' share of a load, which the client's own
    ``getrusage`` cannot see.
    """
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        # After the command's closing parenthesis: state, ppid, ... utime and stime are the 12th and 13th.
        if int(entry.name) == pid or int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _wait_until_answering(process: subprocess.Popen, port: int) -> bool:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
            try:
                connection.request("HEAD", "/")
                connection.getresponse().read()
                return True
            finally:
                connection.close()
        except OSError:
            time.sleep(0.02)
    return False


def _error_log(prefix: Path) -> str:
    logs = (prefix / "stderr.log", prefix / "error.log")
    return "".join(log.read_text(errors="replace") for log in logs if log.exists())


def _stop(process: subprocess.Popen) -> None:
    """SIGQUIT first (workers finish what they serve), then SIGTERM, then SIGKILL: never left running."""
    for sig in (signal.SIGQUIT, signal.SIGTERM, signal.SIGKILL):
        if process.poll() is not None:
            break
        process.send_signal(sig)
        try:
            process.wait(timeout=STOP_SECONDS / 2)
        except subprocess.TimeoutExpired:
            continue
