"""Host arrays asked for on 2 MiB pages (transparent huge pages).

A tier's rows, its index and its per-slot arrays are read and written at random, a row or an entry
at a time, so on 4 KiB pages nearly every access also misses the TLB (a page walk). With
transparent huge pages in "madvise" mode, the usual default, only memory marked
``MADV_HUGEPAGE`` gets 2 MiB pages; it is marked here before anything touches it, so its first
touch faults in huge pages. Each array is a mapping of its own, fresh from the kernel: memory the
allocator hands out again (arrays under its mapping threshold, which grows up to 32 MiB as large
blocks are freed) was touched before, on 4 KiB pages, and a mark would come too late for it. Where
the kernel has no such pages (or mode "never"), or the memory is not the CPU's, the arrays are
plain ones.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
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


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` on huge pages where it is the CPU's and at least one huge page: a private
    anonymous mapping of its own (freed with the tensor), a huge page longer than the array so that
    the array starts on a huge page's boundary (the slack is never touched: address space only),
    its whole 2 MiB pages marked before anything touches them."""
    madvise = _madvise()
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if madvise is None or torch.device(device).type != "cpu" or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype, device=device)
    try:
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    except OSError:  # no mapping to be had (a strict overcommit policy): the allocator's, as torch's
        return torch.empty(shape, dtype=dtype, device=device)
    start = -torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    tensor = torch.frombuffer(mapping, dtype=dtype, count=numel, offset=start).view(shape)
    madvise(tensor.data_ptr(), nbytes // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE)  # refused: plain pages
    return tensor


def full(shape: tuple[int, ...], fill, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.full`` on huge pages where it is the CPU's and at least one huge page."""
    return empty(shape, dtype, device).fill_(fill)
