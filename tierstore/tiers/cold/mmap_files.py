"""The mmap cold store's files (names below) and what reads and writes them: the readers' lock,
file-backed arrays that grow (``GrowableArray``), and the read advice for missed rows (``ReadAdvice``)."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import resource
from pathlib import Path

import numpy as np

from ...errors import StoreFormatError
from .pages_ahead import PagesAhead, page_ceil, page_floor

ROWS_FILE, KEYS_FILE, STATE_FILE = "rows.bin", "keys.bin", "state.json"
WAL_ROWS_FILE, WAL_KEYS_FILE, WAL_COMMIT_FILE = "wal.rows.bin", "wal.keys.bin", "wal.commit.json"
READERS_FILE = "readers.lock"
REMOVED_FILE = "removed.bin"  # int64 numbers of the committed rows whose ids were removed
KEYS_CHUNK_ROWS = 1 << 20  # committed ids read at once
ADVISED_CHUNK_ROWS = 8192  # rows whose pages are asked for, copied and written out at once


_LIBC = ctypes.CDLL(None, use_errno=True)  # the process's own symbols, libc's among them
_LIBC.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_KEEP_SIZE, _PUNCH_HOLE = 0x01, 0x02  # FALLOC_FL_* from linux/falloc.h


class ReadersLock:
    """``directory/readers.lock``: readers hold it shared while open; the writer changes the files
    readers read only while it holds it exclusively."""

    def __init__(self, directory: Path, reader: bool) -> None:
        self._file = open(Path(directory) / READERS_FILE, "a")
        if reader:
            fcntl.flock(self._file, fcntl.LOCK_SH)  # waits out a writer applying its log

    def try_exclusive(self) -> bool:
        """Take it exclusively if no reader holds it (without waiting)."""
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def release(self) -> None:
        if not self._file.closed:
            fcntl.flock(self._file, fcntl.LOCK_UN)

    def close(self) -> None:
        self.release()
        self._file.close()


class GrowableArray:
    """A file-backed ``np.memmap`` of ``[capacity, width]`` items that doubles when it must grow.

    ``random``: items are read in no order (rows found through an index), so the map asks the kernel
    for no read-ahead (``MADV_RANDOM``): a missed row then costs one page from the disk, not the
    cluster of its neighbours the default read-ahead fetches (and that page cache holds for nothing).
    ``pages_ahead`` (a ``PagesAhead``, set by its owner, or None): the file's pages made past its
    writes on a thread (``make_pages_ahead``), which every write waits out where it would meet them."""

    def __init__(
        self,
        path: Path,
        width: int,
        dtype: np.dtype,
        read_only: bool,
        create: bool = True,
        random: bool = False,
    ) -> None:
        self.path, self.width, self.dtype, self.read_only = path, width, np.dtype(dtype), read_only
        self.random = random
        if not path.exists():
            if read_only or not create:
                raise StoreFormatError(
                    f"{path} is missing: the store's rows are gone; restore the directory from a backup "
                    f"(opening it would start an empty table)"
                )
            path.touch()
        self._allocated = 0  # items known to have their blocks on disk (checked again when reserved)
        self.prepared = 0  # bytes whose pages were made ahead of the appends (0: blocks freed)
        self.pages_ahead: PagesAhead | None = None
        self._fd = -1  # a descriptor kept open for writes, opened by the first
        self._map()

    def _map(self) -> None:
        size = self.path.stat().st_size
        item = self.width * self.dtype.itemsize
        self.capacity = size // item
        self.array = (
            np.memmap(
                self.path,
                dtype=self.dtype,
                mode="r" if self.read_only else "r+",
                shape=(self.capacity, self.width),
            )
            if self.capacity
            else np.empty((0, self.width), dtype=self.dtype)
        )
        self.address = self.array.ctypes.data if self.capacity else None  # for native calls, per map
        if self.random:
            self.advise(mmap.MADV_RANDOM)

    def advise(self, advice: int) -> None:
        """``madvise`` the whole map (``mmap.MADV_*``); nothing where the platform has no such call."""
        if isinstance(self.array, np.memmap) and hasattr(self.array._mmap, "madvise"):
            self.array._mmap.madvise(advice)

    def reserve(self, count: int) -> None:
        """Make room for items ``0..count``: the file's size doubles as needed (sparse, never
        shrinking: a reader may have it mapped), and the blocks of the items up to ``count`` (and
        a few past) are allocated on disk, so a write through the map never needs a block the disk
        cannot give (which would be SIGBUS). A full disk raises ``OSError(ENOSPC)`` here, before any write."""
        item = self.width * self.dtype.itemsize
        self._pages_made_below(count * item)
        if count > self.capacity:
            self.array = None  # no msync: written pages stay in the page cache; flush() makes them durable
            os.truncate(self.path, (1 << max(10, (count - 1).bit_length())) * item)
            self._map()
        if count <= self._allocated:
            return
        ahead = min(self.capacity, count + self._allocated // 8)  # a little ahead: few calls, little waste
        for target in dict.fromkeys((ahead, count)):  # ahead while the disk has room, else exactly
            error = self._allocate_to(target)
            if error is None:
                return
            if error.errno != errno.ENOSPC:
                break
        full = "; the disk is full: free space and retry (the store keeps its last flush)"
        raise OSError(
            error.errno,
            f"cannot allocate {(count - self._allocated) * item:,} bytes in {self.path}: "
            f"{os.strerror(error.errno)}" + (full if error.errno == errno.ENOSPC else ""),
        )

    def _pages_made_below(self, end: int) -> None:
        """Before writes below byte ``end``: the pages being made ahead there made first."""
        if self.pages_ahead is not None:
            self.pages_ahead.clear_below(end)
            if not self.pages_ahead.running:
                self.prepared = max(self.prepared, self.pages_ahead.end)

    @property
    def made_through(self) -> int:
        """Bytes from the start whose pages are made or being made (a native admission makes more
        only past them)."""
        if self.pages_ahead is not None and self.pages_ahead.running:
            return max(self.prepared, self.pages_ahead.end)
        return self.prepared

    def make_pages_ahead(self, written: int, ahead: int) -> None:
        """Have ``pages_ahead`` make the pages of bytes past ``written`` (the end of every write so
        far) up to ``written + ahead`` (within the file, their blocks allocated first: where the disk
        has no room, only up to the blocks allocated), unless half of them are made or being made."""
        if self.pages_ahead is None or self.pages_ahead.running:
            return
        self._pages_made_below(written)
        if self.prepared >= written + ahead // 2:
            return
        item = self.width * self.dtype.itemsize
        first = max(self.prepared, page_ceil(written))
        end = min(self.capacity * item, written + ahead)
        if end > self.allocated_bytes:
            self._allocate_to(end // item)  # refused: the range stops at the blocks allocated
        end = page_floor(min(end, self.allocated_bytes))
        if end > first:
            self.pages_ahead.start(self.fileno(), first, end)

    @property
    def allocated_bytes(self) -> int:
        """Bytes from the file's start whose blocks are allocated (``reserve``)."""
        return self._allocated * self.width * self.dtype.itemsize

    def _allocate_to(self, count: int) -> OSError | None:
        """Allocate the blocks of items ``_allocated..count`` (then counted as allocated); the error
        if the file system refuses."""
        item = self.width * self.dtype.itemsize
        try:
            os.posix_fallocate(self.fileno(), self._allocated * item, (count - self._allocated) * item)
        except OSError as error:
            return error
        self._allocated = count
        return None

    def release(self) -> None:
        """Free the blocks of every item (the file keeps its size: a reader may have it mapped;
        its pages then read as zeros). Where the file system cannot punch holes, they stay."""
        if self.pages_ahead is not None:
            self.pages_ahead.forget()
        with open(self.path, "r+b", buffering=0) as file:
            result = _LIBC.fallocate(
                file.fileno(),
                _PUNCH_HOLE | _KEEP_SIZE,
                ctypes.c_int64(0),
                ctypes.c_int64(self.path.stat().st_size),
            )
        if result == 0:
            self._allocated = self.prepared = 0

    def sync(self) -> None:
        if isinstance(self.array, np.memmap):
            self.array.flush()

    def sync_items(self, first: int, end: int) -> None:
        """Write items ``first..end`` to disk now (``msync`` of their pages): a long copy through
        the map then holds few dirty pages, which a memory limit could not reclaim."""
        if isinstance(self.array, np.memmap) and end > first:
            item = self.width * self.dtype.itemsize
            start = first * item // mmap.PAGESIZE * mmap.PAGESIZE
            self.array._mmap.flush(start, end * item - start)

    def write(self, start: int, items: np.ndarray) -> None:
        """Store ``items [n, width]`` at items ``start..start+n`` (reserved) with ``pwrite``: faster
        than storing through the map into pages never touched, and a full disk raises ``OSError``
        here instead of killing the process with SIGBUS on a mapped write."""
        if items.size:
            offset = start * self.width * self.dtype.itemsize
            write_at(self.fileno(), items.astype(self.dtype, copy=False), offset)

    def fileno(self) -> int:
        """A descriptor of the file open for writing (``pwrite`` at reserved items), kept until ``close``."""
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        return self._fd

    def close(self) -> None:
        """Drop the map and the descriptor."""
        if self.pages_ahead is not None:
            self.pages_ahead.wait()
        self.array = self.address = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def bytes_of(self, start: int, stop: int) -> memoryview:
        """The bytes of items ``start..stop``."""
        return memoryview(np.ascontiguousarray(self.array[start:stop])).cast("B")


class ReadAdvice:
    """Whether a batched read should ask for its pages first (``MADV_WILLNEED``: many disk reads at
    once rather than one page fault after another), judged from the major page faults of the
    reads: asked for while plain reads fault on one row in ``FAULTS_PER_ROW`` or more (the faults of
    one plain read in ``MEASURE_EVERY`` are counted); an advised read (whose pages then fault only
    minor) is followed by a plain one every ``RECHECK_EVERY``."""

    FAULTS_PER_ROW = 1 / 16
    RECHECK_EVERY = 32
    MEASURE_EVERY = 8  # plain reads: the faults of one in this many are counted (two system calls)

    def __init__(self) -> None:
        self.advising = False
        self._advised = 0
        self._plain = 0
        self._faults_before = None  # the count before a measured read

    def advise(self, rows: int) -> bool:
        """Whether the read of ``rows`` rows about to run should ask for its pages first."""
        advise = self.advising and self._advised % self.RECHECK_EVERY != self.RECHECK_EVERY - 1
        measured = not advise and (self.advising or self._plain % self.MEASURE_EVERY == 0)
        self._faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_majflt if measured else None
        return advise

    def done(self, rows: int, advised: bool) -> None:
        if advised:
            self._advised += 1
            return
        self._plain += 1
        if self._faults_before is None:
            return
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - self._faults_before
        self.advising = rows > 0 and faults >= rows * self.FAULTS_PER_ROW
        self._advised = 0


def write_at(descriptor: int, array: np.ndarray, offset: int) -> None:
    """Write ``array``'s bytes to ``descriptor`` at byte ``offset``, all of them (``pwrite``)."""
    if not array.size:
        return
    view = memoryview(np.ascontiguousarray(array)).cast("B")
    while view.nbytes:
        written = os.pwrite(descriptor, view, offset)
        view, offset = view[written:], offset + written
