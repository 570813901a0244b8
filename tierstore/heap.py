"""The C heap's free memory handed back to the system.

Tensors and native buffers come from glibc's ``malloc``. Once a large block has been freed, glibc
serves blocks up to that size from its heap instead of fresh maps, so the heap's free space ends
up scattered between live blocks, and stays in the process as resident memory. ``malloc_trim``
gives every free page of it back. It takes a few milliseconds, so it runs where the work around it
takes seconds: a flush, which needs page cache for its reads and writes under a memory limit.
"""

from __future__ import annotations

import ctypes
import functools
import sys


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, None where the C library has none (not Linux, or not glibc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = [ctypes.c_size_t], ctypes.c_int
    return function


def release_free_heap() -> bool:
    """Give the heap's free pages back to the system; False where that cannot be done here."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
