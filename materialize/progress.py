"""Feedback while a load or a conversion runs: what it does before the first byte is read, then the bytes.

``progress=`` of :func:`~materialize.load`, :func:`~materialize.load_model`,
:func:`~materialize.load_tensors` and :func:`~materialize.convert` takes:

* ``True``: a :class:`Progress` bar on stderr for the length of the call;
* a callable ``fn(done_bytes, total_bytes)``: called as bytes are read
  (from reader threads, one call at a time), from ``(0, total)`` as reading
  starts up to ``(total, total)``; never for a load that reads nothing (every
  tensor mapped). One that also has a method ``phase(text)`` (the
  :class:`Phased` protocol, which :class:`Progress` follows) is told each step
  before the reads start: ``opening model.safetensors``, ``building
  timm:resnet18``, ``planning 291 tensors``, ``loading 291 tensors``;
* ``None`` or ``False``: nothing.

No torch here: the CLI draws its bar from its first moment, before torch is imported.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional, Protocol, TextIO, TypeVar, Union, runtime_checkable

from .text import printable

ProgressFn = Callable[[int, int], None]
ProgressLike = Union[bool, ProgressFn, None]

# tqdm's rate is a moving average over redraws (one each 0.1 s at most, TQDM_MININTERVAL): weighing each
# 0.05, it follows the last 2 s or so, so a read that leaves the page cache shows its new rate within seconds
# (an average since the start sank from 1.5 to 0.45 GB/s long after the reads had slowed).
SMOOTHING = 0.05
PHASE_FORMAT = "{desc}"
BYTES_FORMAT = "{l_bar}{bar}| {n_fmt}B/{total_fmt}B [{elapsed}<{remaining}, {rate_fmt}]"


@runtime_checkable
class Phased(Protocol):
    """A progress callable that is also told what the call does before it reads (see the module docstring)."""

    def __call__(self, done: int, total: int) -> None: ...

    def phase(self, text: str) -> None: ...


_bar_class: Optional[type] = None  # tqdm's bar, as drawn here: made at the first bar (tqdm's import costs every
# command of the CLI a hundredth of a second, most of which draw none)
_bar_class_made = threading.Lock()


def _bar_type() -> type:
    global _bar_class
    with _bar_class_made:
        if _bar_class is None:
            from tqdm import tqdm

            class _Bar(tqdm):
                monitor_interval = 0  # tqdm's monitor thread would outlive the call; the load's calls drive redraws

            # tqdm's default lock holds a multiprocessing lock too: a semaphore (and, where processes are spawned, a
            # resource tracker process) for a bar that threads of one process draw.
            _Bar.set_lock(threading.RLock())
            _bar_class = _Bar
        return _bar_class


class Progress:
    """A bar on ``stream`` (stderr by default), drawn by tqdm: the step under way (:meth:`phase`) as its text,
    then, once bytes are read, bytes done and total, a percentage, the rate over the last seconds and the time
    left.

    Nothing is drawn before the first phase or bytes. ``leave``: a bar that read bytes stays, finished, on
    its own line when closed (as tqdm leaves it); otherwise, and always for one that only showed steps (a
    load that mapped every tensor), the line is cleared, so what is written next starts on a clean line.
    Drawn whether or not ``stream`` is a terminal, as tqdm draws; tqdm's ``TQDM_*`` environment variables
    set its defaults (``TQDM_MININTERVAL``: the least time between redraws). Usable as a context manager,
    which closes it.
    """

    def __init__(self, stream: Optional[TextIO] = None, *, leave: bool = True) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.leave = leave
        self._bar: Optional[Any] = None  # a tqdm bar
        self._total = 0  # bytes of the read under way; 0 while steps are shown
        self._lock = threading.Lock()

    def phase(self, text: str) -> None:
        """Show ``text`` (escaped: it names files) as the step under way."""
        with self._lock:
            shown = printable(text)
            if self._bar is None:
                self._bar = self._new(shown)
                return
            self._total = 0
            self._bar.bar_format = PHASE_FORMAT
            self._bar.set_description_str(shown)

    def __call__(self, done: int, total: int) -> None:
        with self._lock:
            if total <= 0:
                return  # nothing to read: no rate to show, the step's text stays
            if self._bar is None:
                self._bar = self._new("")
            bar = self._bar
            if total != self._total or done < bar.n:
                self._total = total
                bar.bar_format = BYTES_FORMAT
                bar.reset(total=total)  # the rate and the time left count from the start of this read
            if done > bar.n:
                bar.update(done - bar.n)
            if done >= total:
                bar.refresh()  # finished: shown so, whatever the time since the last redraw

    def close(self) -> None:
        """End the bar: left finished on its own line where ``leave`` and bytes were read, else cleared."""
        with self._lock:
            if self._bar is None:
                return
            self._bar.leave = self.leave and self._total > 0
            self._bar.close()
            self._bar = None
            self._total = 0

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _new(self, text: str) -> Any:
        """A bar showing ``text``, drawn now (tqdm draws at construction)."""
        bar = _bar_type()
        return bar(desc=text, file=self.stream, leave=self.leave, unit="B", unit_scale=True, dynamic_ncols=True,
                   smoothing=SMOOTHING, bar_format=PHASE_FORMAT)


def counted(count: int, noun: str) -> str:
    """``"291 tensors"``, ``"1 tensor"``: a count as a step names it."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def report_phase(progress: object, text: str) -> None:
    """Tell ``progress`` the step under way, where it listens (:class:`Phased`); a plain callable is told nothing."""
    phase = getattr(progress, "phase", None)
    if callable(phase):
        phase(text)


@contextmanager
def above_the_bar(stream: Optional[TextIO] = None) -> Iterator[None]:
    """Write on ``stream`` (stderr) while a bar may be drawn there: the bar is cleared first and drawn again
    after, so the text starts on a line of its own and the bar stays whole."""
    bar = _bar_class
    if bar is None:  # no bar was ever drawn: none to clear
        yield
        return
    with bar.external_write_mode(file=stream if stream is not None else sys.stderr):
        yield


F = TypeVar("F", bound=Callable[..., Any])


def takes_progress(function: F) -> F:
    """``progress=`` as the module docstring says: ``True`` becomes a :class:`Progress` on stderr, closed when
    the call returns or fails; ``False`` becomes ``None``; a callable passes as it is."""

    @functools.wraps(function)
    def with_progress(*args: Any, **kwargs: Any) -> Any:
        asked = kwargs.get("progress")
        if asked is None or asked is False:
            kwargs["progress"] = None
            return function(*args, **kwargs)
        if asked is not True:
            if not callable(asked):
                raise TypeError(f"progress: expected True, False, None or fn(done_bytes, total_bytes), got {asked!r}")
            return function(*args, **kwargs)
        with Progress() as bar:
            kwargs["progress"] = bar
            return function(*args, **kwargs)

    return with_progress  # type: ignore[return-value]
