"""Host arrays asked for on 2 MiB pages (transparent huge pages).

A tier's rows, its index and its per-slot arrays are read and written at random, a row or an entry
at a time, so on 4 KiB pages nearly every access also misses the TLB (a page walk). With
transparent huge pages in "madvise" mode, the usual default, only memory marked
``MADV_HUGEPAGE`` gets 2 MiB pages; it is marked here before anything touches it, so its first
touch faults in huge pages. Where the kernel has no such pages (or mode "never"), or the memory is
not the CPU's, the arrays are plain ones.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

HUGE_PAGE = 2 << 20  # bytes
_MADV_HUGEPAGE = 14  # Linux's advice number


@functools.cache
def _madvise():
    """libc's ``madvise``, None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return function


def _mark(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (untouched), its whole 2 MiB pages marked for huge pages."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu" or tensor.nbytes < HUGE_PAGE:
        return tensor
    address = tensor.data_ptr()
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + tensor.nbytes) // HUGE_PAGE * HUGE_PAGE
    if end > start:
        madvise(start, end - start, _MADV_HUGEPAGE)  # refused (EINVAL: no huge pages here): plain pages
    return tensor


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` on huge pages where it is the CPU's and at least one huge page."""
    return _mark(torch.empty(shape, dtype=dtype, device=device))


def full(shape: tuple[int, ...], fill, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.full`` on huge pages where it is the CPU's and at least one huge page."""
    return empty(shape, dtype, device).fill_(fill)
