"""A file's page cache pages made ahead of its appends, on a worker thread (``PagesAhead``).

An append into a page the page cache does not hold yet waits while the kernel makes that page (and,
in a virtual machine, while the host finds the memory behind it): microseconds a page, paid inside
the training step's write of its dirty victims to the log. A ``PagesAhead`` writes zeros over the
pages past the log's last record while the steps run, so the appends find their pages made. Its
writes never meet a record: the range it works on starts past every write made so far, and a writer
whose items reach that range waits for it first (``GrowableArray.reserve``).
"""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

AHEAD_APPENDS = 8  # the pages made ahead cover this many of the last admission's appends...
MIN_AHEAD, MAX_AHEAD = 1 << 20, 16 << 20  # ...and this many bytes at least and at most


class PagesAhead:
    """Zeros over ranges of one file, past its writes, one range at a time, on the process's pages
    worker (``_worker``); ``make(descriptor, first, end)`` writes them (releasing the GIL: the native
    pass ``prepare_pages``), a failed write left as it is (the appends then make their own pages)."""

    def __init__(self, make) -> None:
        self._make = make
        self._pending: Future | None = None
        self._pending_pid = 0
        self.first = self.end = 0  # bytes [first, end): the range being made, or made last

    @property
    def running(self) -> bool:
        """Whether a range is being made for this process (a forked child's copy of its parent's
        range never finishes there: not running)."""
        pending = self._pending
        return pending is not None and self._pending_pid == os.getpid() and not pending.done()

    def start(self, descriptor: int, first: int, end: int) -> None:
        """Make the pages of bytes ``[first, end)`` (page-aligned, past every write) on the worker;
        nothing where the interpreter is shutting down (the appends make their own pages)."""
        self.wait()
        try:
            self._pending = _worker().submit(self._make, descriptor, first, end)
        except RuntimeError:  # no new work after the interpreter's shutdown began
            return
        self._pending_pid = os.getpid()
        self.first, self.end = first, end

    def wait(self) -> None:
        """Until the range being made is made (in a forked child: the parent's range is not waited for,
        and counts as made: pages made or not, the appends are right either way)."""
        if self._pending is not None:
            if self._pending_pid == os.getpid():
                self._pending.result()
            self._pending = None

    def forget(self) -> None:
        """Wait, then forget what was made (the file's blocks are about to be freed)."""
        self.wait()
        self.first = self.end = 0

    def clear_below(self, end: int) -> None:
        """Before a write of bytes below ``end``: waits for the range being made if it starts below."""
        if self._pending is not None and self.first < end:
            self.wait()


_worker_lock = threading.Lock()
_worker_of_process: tuple[int, ThreadPoolExecutor] | None = None


def _worker() -> ThreadPoolExecutor:
    """The one thread of this process that makes pages ahead, for every file: kept between ranges (a
    thread started for each would cost the step its start), joined when the interpreter exits (a
    process ending waits for the range being made), made anew in a forked child (whose copy of the
    parent's has no thread)."""
    global _worker_of_process
    with _worker_lock:
        if _worker_of_process is None or _worker_of_process[0] != os.getpid():
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierstore-pages-ahead")
            _worker_of_process = (os.getpid(), executor)
        return _worker_of_process[1]


def ahead_bytes(appended_bytes: int) -> int:
    """Bytes to keep made past the last record, after an admission appended ``appended_bytes``."""
    return min(MAX_AHEAD, max(MIN_AHEAD, AHEAD_APPENDS * appended_bytes))


def page_floor(offset: int) -> int:
    return offset // mmap.PAGESIZE * mmap.PAGESIZE


def page_ceil(offset: int) -> int:
    return -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
