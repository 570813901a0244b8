"""A file's page cache pages made ahead of its appends, on a thread of their own (``PagesAhead``).

An append into a page the page cache does not hold yet waits while the kernel makes that page (and,
in a virtual machine, while the host finds the memory behind it): microseconds a page, paid inside
the training step's write of its dirty victims to the log. A ``PagesAhead`` writes zeros over the
pages past the log's last record while the steps run, so the appends find their pages made. Its
writes never meet a record: the range it works on starts past every write made so far, and a writer
whose items reach that range waits for it first (``GrowableArray.reserve``).
"""

from __future__ import annotations

import mmap
import threading

AHEAD_APPENDS = 8  # the pages made ahead cover this many of the last admission's appends...
MIN_AHEAD, MAX_AHEAD = 1 << 20, 16 << 20  # ...and this many bytes at least and at most


class PagesAhead:
    """Zeros over ranges of one file, past its writes, each on a thread of its own, one at a time;
    ``make(descriptor, first, end)`` writes them (releasing the GIL: the native pass
    ``prepare_pages``), a failed write left as it is (the appends then make their own pages)."""

    def __init__(self, make) -> None:
        self._make = make
        self._thread: threading.Thread | None = None
        self.first = self.end = 0  # bytes [first, end): the range being made, or made last

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, descriptor: int, first: int, end: int) -> None:
        """Make the pages of bytes ``[first, end)`` (page-aligned, past every write) on a thread."""
        self.wait()
        self.first, self.end = first, end
        # not a daemon: a process ending waits for its few milliseconds
        self._thread = threading.Thread(
            target=self._make, args=(descriptor, first, end), name="tierstore-pages-ahead"
        )
        self._thread.start()

    def wait(self) -> None:
        """Until the range being made is made."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def forget(self) -> None:
        """Wait, then forget what was made (the file's blocks are about to be freed)."""
        self.wait()
        self.first = self.end = 0

    def clear_below(self, end: int) -> None:
        """Before a write of bytes below ``end``: waits for the range being made if it starts below."""
        if self._thread is not None and self.first < end:
            self.wait()


def ahead_bytes(appended_bytes: int) -> int:
    """Bytes to keep made past the last record, after an admission appended ``appended_bytes``."""
    return min(MAX_AHEAD, max(MIN_AHEAD, AHEAD_APPENDS * appended_bytes))


def page_floor(offset: int) -> int:
    return offset // mmap.PAGESIZE * mmap.PAGESIZE


def page_ceil(offset: int) -> int:
    return -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
