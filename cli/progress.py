"""A one-line progress display on a terminal: bytes done and GB/s."""

from __future__ import annotations

import sys
import threading
import time
from typing import Optional, TextIO

from materialize.sizes import format_bytes
from materialize.text import printable

REFRESH_SECONDS = 0.1


class ProgressLine:
    """Bytes done and the read's rate: its clock starts at the first call (the load calls with 0 bytes done
    as reading starts), not when the line is made, before the model was built and the checkpoint opened."""

    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self.stream = stream
        self.started: Optional[float] = None
        self._last = 0.0
        self._lock = threading.Lock()
        self._shown = False

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        with self._lock:
            if self.started is None:
                self.started = now
            if now - self._last < REFRESH_SECONDS and done < total:
                return
            self._last = now
            rate = done / max(now - self.started, 1e-9) / 1e9
            percent = 100.0 * done / total if total else 100.0
            # the carriage return is the line's own; what follows it passes the same escaping as all output
            status = printable(f"loading {format_bytes(done)} / {format_bytes(total)}  {percent:5.1f}%  {rate:.2f} GB/s ")
            self.stream.write(f"\r{status}")
            self.stream.flush()
            self._shown = True

    def close(self) -> None:
        if self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()


def progress_for(enabled: bool, stream: TextIO = sys.stderr) -> Optional[ProgressLine]:
    return ProgressLine(stream) if enabled and stream.isatty() else None
