"""torch's CPU kernel threads for one thread alone, leaving the process-wide count as the caller set it.

``torch.set_num_threads(n)`` sets the calling thread's OpenMP team size and
also stores ``n`` process-wide, where every thread that has not yet run a
parallel kernel (the caller's own thread, in a fresh process) picks it up on
its first: a load calling it from its reader threads left the user's
computations after the load on one core. OpenMP's own
``omp_set_num_threads`` changes the calling thread's setting and nothing
else, so the reader threads call that, from the OpenMP runtime torch
already loaded.
"""

from __future__ import annotations

import ctypes
from typing import Callable, Optional


def _omp_set_num_threads() -> Optional[Callable[[int], None]]:
    try:
        function = ctypes.CDLL(None).omp_set_num_threads  # libgomp or libiomp, loaded globally with torch
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int]
    function.restype = None
    return function


_SET = _omp_set_num_threads()


def set_this_threads_kernel_threads(count: int) -> None:
    """Run the calling thread's CPU kernels on ``count`` threads; without an OpenMP runtime in sight, leave them.

    Call ``torch.get_num_threads()`` in the thread first: torch's first look
    at its setting in a thread sets the thread's OpenMP count from the
    process-wide one, overwriting this.
    """
    if _SET is not None:
        _SET(count)
