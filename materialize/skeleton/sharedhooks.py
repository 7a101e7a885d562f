"""Process-wide hooks that the first user, in any thread, puts in place and the last one takes away.

torch's module registration hooks and torch's own functions are one per
process; the contexts that need them (``meta_init``, a Hugging Face build)
may run in several threads at once and nest. Each context acquires on entry
and releases on exit, so none lingers once the last one has left.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class SharedHooks:
    """``install()`` run by the first :meth:`acquire`, ``remove()`` by the :meth:`release` that balances the last."""

    def __init__(self, install: Callable[[], None], remove: Callable[[], None]) -> None:
        self._install = install
        self._remove = remove
        self._lock = threading.Lock()
        self._users = 0

    def acquire(self) -> None:
        with self._lock:
            if self._users == 0:
                self._install()
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self._remove()
