"""Memory-mapped cold store: rows in a flat file, found through a hash index in a mapped file.

Files in the store directory:

- ``rows.bin``: stored row ``i`` (its bytes and check, ``codec.RowCodec``) at byte
  ``i * stored_bytes``; ``keys.bin``: int64 id of row ``i``.
- ``index.bin``: id -> row number (``disk_index.DiskIndex``), memory-mapped: derived from
  ``keys.bin``, kept in step with each commit, and rebuilt from it where it does not match the
  committed state (a store written without it, a damaged one). Opening reads neither.
- ``state.json``: ``{"rows": n, "row_bytes": b, "keys_crc32": c, "flushes": f}``, the committed
  row count (rows past it are ignored), the row size the files hold, the CRC32 of the committed
  ids (``index.bin`` records the count and CRC32 it matches, so a count edited by hand is refused
  at open; ``keys.bin`` is checked against its CRC32 whenever the index is rebuilt from it, and
  by ``structure_problems``), and the flushes completed. Each row read is checked against its id.
- ``wal.keys.bin`` / ``wal.rows.bin``: an append-only write-ahead log of rows written since
  ``rows.bin`` was last brought up to date (a key's last record wins; records past the count are
  stale).
- ``wal.commit.json``: ``{"records": n, "keys_crc32": a, "rows_crc32": b, "flushes": f}``, written
  atomically when a flush's log is durable: its first ``n`` records are committed, and never
  change again (while it exists, its flush count is the store's).
- ``readers.lock``: each reader holds a shared ``flock`` on it; the writer changes ``rows.bin``
  only while it holds it exclusively (no reader open).

Guarantee (the same as LMDB's): after a crash or kill at any moment, reopening yields exactly the
state of the last completed ``flush``. ``put`` only writes the log; ``flush`` syncs the log, then
commits it by renaming ``wal.commit.json`` into place (with CRC32s of the log), then, when no
reader is open, applies it to ``rows.bin``/``keys.bin``, updates ``state.json`` and empties the
log. Opening replays a committed log (replay is idempotent) and discards an uncommitted one. One
writer at a time: a writable open takes an exclusive ``flock`` on ``lock`` (``base.WriterLock``).

Readers (``read_only=True``, any process) see one flush, a snapshot: ``rows.bin`` and the log's
committed records as they were at open (or at ``refresh()``), since neither changes while a reader
is open: the writer keeps appending its flushes to the log until no reader is left, and then
applies it. A reader open for long therefore lets the log grow (as a long read transaction does
in LMDB): refresh or reopen readers now and then. Readers never crash: no file a reader may have
mapped ever shrinks (files grow sparse, and the blocks of rows about to be written are allocated
first with ``posix_fallocate``; an applied log's blocks are punched out, its files keeping their
size).

A host tier alone over this store makes a batch resident through ``make_resident_in``: one native
call (``step_make_resident``) finds the batch in the tier, picks the misses' victims, reads the
misses into their slots and stages the victims' dirty rows in the log as ``put`` stages them, with
room in the log reserved first (a full disk changes nothing).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import mmap
import os
import resource
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ...errors import StoreFormatError
from ...kernels.cache_passes import cache_passes_of
from ...kernels.native_types import ColdFiles, Residency
from ...kernels.step_passes import host_passes
from ...metadata import fsync_directory, write_json_atomic
from ...validation import cpu_int64
from ..contract import too_many_distinct
from ..hash_index import HashIndex
from ..kernel_hash_table import KernelHashTable
from .base import ColdStore
from .codec import rows_from_bytes
from .disk_index import INDEX_FILE, DiskIndex

ROWS_FILE, KEYS_FILE, STATE_FILE = "rows.bin", "keys.bin", "state.json"
WAL_ROWS_FILE, WAL_KEYS_FILE, WAL_COMMIT_FILE = "wal.rows.bin", "wal.keys.bin", "wal.commit.json"
READERS_FILE = "readers.lock"
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
    cluster of its neighbours the default read-ahead fetches (and that page cache holds for nothing)."""

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
                self._allocated = target
                return
            if error.errno != errno.ENOSPC:
                break
        full = "; the disk is full: free space and retry (the store keeps its last flush)"
        raise OSError(
            error.errno,
            f"cannot allocate {(count - self._allocated) * item:,} bytes in {self.path}: "
            f"{os.strerror(error.errno)}" + (full if error.errno == errno.ENOSPC else ""),
        )

    def _allocate_to(self, count: int) -> OSError | None:
        """Allocate the blocks of items ``_allocated..count``; the error if the file system refuses."""
        item = self.width * self.dtype.itemsize
        try:
            with open(self.path, "r+b", buffering=0) as file:
                os.posix_fallocate(file.fileno(), self._allocated * item, (count - self._allocated) * item)
        except OSError as error:
            return error
        return None

    def release(self) -> None:
        """Free the blocks of every item (the file keeps its size: a reader may have it mapped;
        its pages then read as zeros). Where the file system cannot punch holes, they stay."""
        with open(self.path, "r+b", buffering=0) as file:
            result = _LIBC.fallocate(
                file.fileno(),
                _PUNCH_HOLE | _KEEP_SIZE,
                ctypes.c_int64(0),
                ctypes.c_int64(self.path.stat().st_size),
            )
        if result == 0:
            self._allocated = 0

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
        if items.size == 0:
            return
        data = memoryview(np.ascontiguousarray(items, dtype=self.dtype)).cast("B")
        offset = start * self.width * self.dtype.itemsize
        while len(data):
            written = os.pwrite(self.fileno(), data, offset)
            data, offset = data[written:], offset + written

    def fileno(self) -> int:
        """A descriptor of the file open for writing (``pwrite`` at reserved items), kept until ``close``."""
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        return self._fd

    def close(self) -> None:
        """Drop the map and the descriptor."""
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


class MmapColdStore(ColdStore):
    """Cold store in flat memory-mapped files; see the module docstring for the crash guarantee.

    ``index_kernels``: the kernels' host build (``tierstore.kernels.host_kernels``) for the in-memory key
    indexes of the rows and the log (``KernelHashTable``); ``None``: torch ``HashIndex``es.
    """

    def __init__(
        self,
        directory: Path,
        row_width: int,
        dtype: torch.dtype,
        read_only: bool = False,
        index_kernels=None,
        create: bool = True,
        checksums: bool = True,
    ) -> None:
        super().__init__(directory, row_width, dtype, read_only, create, checksums)
        self._index_kernels = index_kernels
        self._open_locked(self._open_files)

    def _open_files(self) -> None:
        read_only = self.read_only
        create = self._create
        self._readers = ReadersLock(self.directory, reader=read_only)
        stored_bytes = self.codec.stored_bytes
        self._rows = GrowableArray(
            self.directory / ROWS_FILE, stored_bytes, np.uint8, read_only, create, random=True
        )
        self._keys = GrowableArray(self.directory / KEYS_FILE, 1, np.int64, read_only, create)
        self._wal_rows = GrowableArray(
            self.directory / WAL_ROWS_FILE, stored_bytes, np.uint8, read_only, random=True
        )
        self._wal_keys = GrowableArray(self.directory / WAL_KEYS_FILE, 1, np.int64, read_only)
        self._count = self._read_state()
        self._appended = False  # rows written by bulk_load since the last flush
        self._holding_readers_out = False  # readers wait while a bulk load changes the index in place
        # index.bin holds keys of uncommitted rows, erased once no reader is open:
        self._repair_pending = False
        self._index = self._open_index()
        self._reads = ReadAdvice()
        self._wal_index = self._make_index(1024)
        self._admits_natively = (  # make_resident_in's native call serves a tier with native arrays
            not self.read_only
            and self.dtype == torch.float32
            and isinstance(self._index, KernelHashTable)
            and isinstance(self._wal_index, KernelHashTable)
            and host_passes() is not None
        )
        self._wal_count = self._wal_committed = 0
        self._log_crcs = (0, 0)  # CRC32s of the committed log's keys and rows
        self.deferred_applies = 0  # flushes whose log stayed unapplied because a reader was open
        self._recover()

    # -- opening ----------------------------------------------------------------------------

    def _make_index(self, capacity: int) -> HashIndex | KernelHashTable:
        """A map ``key -> row number`` (int64) holding ``capacity`` keys before it grows."""
        if self._index_kernels is None:
            return HashIndex(capacity)
        return KernelHashTable(capacity, self._index_kernels, value_dtype=torch.int64)

    def _read_state(self) -> int:
        path = self.directory / STATE_FILE
        if not path.exists():
            if self.read_only or not self._create:
                raise StoreFormatError(
                    f"{path} is missing: the store's row count is gone; restore it from a backup"
                )
            self._keys_crc = 0
            self.flushes = 0
            self._write_state(0)
        try:
            state = json.loads(path.read_text())
            count = state["rows"]
            self._keys_crc = state.get("keys_crc32")
            self.flushes = _flush_count(state, path)
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as error:
            raise StoreFormatError(f"{path} is damaged ({error!r}); restore it from a backup") from None
        if not isinstance(count, int) or count < 0:
            raise StoreFormatError(f"{path} is damaged: rows is {count!r}")
        if state.get("row_bytes", self.row_bytes) != self.row_bytes:
            raise StoreFormatError(
                f"{path} says its rows are {state['row_bytes']} bytes but the store's metadata says "
                f"{self.row_bytes} (dim, dtype and optimizer state): tierstore.json was edited or belongs to "
                f"another store"
            )
        if self.codec.check_bytes and not isinstance(self._keys_crc, int):
            raise StoreFormatError(f"{path} is damaged: keys_crc32 is {self._keys_crc!r}")
        for array, name in ((self._rows, ROWS_FILE), (self._keys, KEYS_FILE)):
            if array.capacity < count:
                raise StoreFormatError(
                    f"{self.directory / name} is truncated: it holds {array.capacity} rows but the "
                    f"store has {count}; restore it from a backup"
                )
        return count

    def _open_index(self) -> HashIndex | KernelHashTable:
        """``index.bin`` where it matches the committed state (or only lacks the erasure of keys
        of rows a killed process was adding); else rebuilt from ``keys.bin``. In RAM where the
        kernels' tuned host build is missing, or for a reader whose ``index.bin`` does not match."""
        kernels = self._index_kernels
        if kernels is None or cache_passes_of(kernels) is None:
            return self._index_from_keys(self._make_index(self._count))
        path = self.directory / INDEX_FILE
        try:
            index = DiskIndex(path, kernels, self.read_only) if path.exists() else None
        except (ValueError, OSError):
            index = None  # damaged: rebuilt below
        count, crc = self._count, self._keys_crc
        if index is not None and index.header("pending") is not None and not self.read_only:
            if index.completed(count, crc):
                index.commit(count, crc)
            elif index.matches_before_pending(count, crc):
                self._repair_pending = True
                self._repair_index(index)
        if index is not None and (index.matches(count, crc) or index.matches_before_pending(count, crc)):
            return index
        if self.read_only:
            return self._index_from_keys(self._make_index(count))
        partial = path.with_name(INDEX_FILE + ".new")
        self._index_from_keys(DiskIndex.create(partial, kernels, count, count, crc))
        os.replace(partial, path)
        fsync_directory(self.directory)
        index = DiskIndex(path, kernels, read_only=False)
        index.commit(count, crc)
        return index

    def _index_from_keys(self, index):
        """``index`` with every committed id of ``keys.bin`` (whose CRC32 is checked) at its row."""
        crc = 0
        for start, keys in self._committed_keys():
            crc = zlib.crc32(keys.numpy(), crc)
            if bool((keys < 0).any()):
                raise StoreFormatError(f"{self.directory / KEYS_FILE} is damaged: negative ids")
            try:
                index.insert(keys, torch.arange(start, start + keys.numel()))
            except ValueError:
                raise StoreFormatError(f"{self.directory / KEYS_FILE} is damaged: repeated ids") from None
        problem = self._keys_crc_problem(crc)
        if problem is not None:
            raise StoreFormatError(problem)
        return index

    def _committed_keys(self) -> Iterator[tuple[int, torch.Tensor]]:
        """``(first row, its ids int64 [n])`` over ``keys.bin``'s committed ids, a chunk at a time."""
        chunk = KEYS_CHUNK_ROWS
        for start in range(0, self._count, chunk):
            yield (
                start,
                torch.from_numpy(np.array(self._keys.array[start : min(start + chunk, self._count), 0])),
            )

    def _keys_crc_problem(self, crc: int) -> str | None:
        """What is wrong if ``crc``, the CRC32 of ``keys.bin``'s committed ids, is not the recorded one."""
        if self._keys_crc is None or crc == self._keys_crc:
            return None
        return (
            f"{self.directory / KEYS_FILE} does not match {self.directory / STATE_FILE} (CRC32 of its "
            f"{self._count} committed ids): one of them is damaged or was edited; restore the store "
            f"from a backup"
        )

    def _repair_index(self, index: DiskIndex) -> None:
        """Erase from ``index.bin`` the keys of rows a killed process was adding, once no reader is
        open (a reader ignores them meanwhile: they are past its committed count)."""
        if not self._repair_pending or not self._readers.try_exclusive():
            return
        try:
            pending = index.header("pending")
            index.repair(torch.from_numpy(np.array(self._keys.array[self._count : pending, 0])))
            self._repair_pending = False
        finally:
            if not self._holding_readers_out:
                self._readers.release()

    def _hold_readers_out(self) -> bool:
        """Take the readers' lock until the next flush (a bulk load inserts into ``index.bin`` in
        place); False where a reader is open."""
        if self._holding_readers_out or not isinstance(self._index, DiskIndex):
            return True
        if not self._readers.try_exclusive():
            return False
        self._holding_readers_out = True
        self._repair_index(self._index)
        return True

    def _let_readers_in(self) -> None:
        if self._holding_readers_out:
            self._holding_readers_out = False
            self._readers.release()

    def _rows_of(self, keys: torch.Tensor) -> torch.Tensor:
        """Row of each key (int64), -1 where it is in no committed (or, for the writer, bulk-loaded) row."""
        found = self._index.find(keys)
        return torch.where(found < self._count, found, -1)

    def _recover(self) -> None:
        commit_path = self.directory / WAL_COMMIT_FILE
        if commit_path.exists():
            try:
                commit = json.loads(commit_path.read_text())
                records = int(commit["records"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, UnicodeDecodeError) as error:
                raise StoreFormatError(f"{commit_path} is damaged ({error!r})") from None
            if self._wal_keys.capacity < records or self._wal_rows.capacity < records:
                raise StoreFormatError(f"the write-ahead log in {self.directory} is truncated")
            self._log_crcs = self._wal_checksums(0, records, (0, 0))
            if [commit.get("keys_crc32"), commit.get("rows_crc32")] != list(self._log_crcs) and commit.get(
                "crc32"  # the one CRC32 of keys then rows that stores of format version 1 wrote
            ) != zlib.crc32(self._wal_rows.bytes_of(0, records), self._log_crcs[0]):
                raise StoreFormatError(
                    f"the write-ahead log of the last flush in {self.directory} is damaged "
                    f"(checksum mismatch); the store cannot be recovered to its last flush"
                )
            self.flushes = _flush_count(commit, commit_path, self.flushes)
            self._wal_count = self._wal_committed = records
            keys = self._wal_keys.array[:records, 0]
            last = records - 1 - np.unique(keys[::-1], return_index=True)[1]  # a key's last record wins
            self._wal_index.insert(torch.from_numpy(keys[last]), torch.from_numpy(last))
            if not self.read_only:
                self._try_apply()
        elif not self.read_only:
            self._reset_wal()  # never committed: discard (no reader reads an uncommitted log)

    # -- reads -------------------------------------------------------------------------------

    def _main_rows(self) -> torch.Tensor:
        """uint8 [capacity, stored_bytes]: ``rows.bin`` through its map."""
        return rows_from_bytes(self._rows.array, torch.uint8)

    def _wal_rows_tensor(self) -> torch.Tensor:
        return rows_from_bytes(self._wal_rows.array, torch.uint8)

    def _get(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        passes = host_passes() if isinstance(self._index, KernelHashTable) else None
        if passes is not None:  # one native pass: both indexes, the copies and the checks
            main = (self._index.keys, self._index.values, self._rows.array, self._count)
            log = None
            if self._wal_count:
                log = (self._wal_index.keys, self._wal_index.values, self._wal_rows.array)
            codec = self.codec
            advise = self._reads.advise(keys.numel())
            raw, found, bad, first = passes.cold_rows(
                keys, main, log, codec.row_bytes, codec.check_bytes, advise
            )
            self._reads.done(keys.numel(), advise)
            if bad:
                raise codec.damaged(self.directory / ROWS_FILE, bad, int(keys[first]))
            return raw.view(self.dtype), found
        stored = torch.empty(keys.numel(), self.codec.stored_bytes, dtype=torch.uint8)
        position = self._rows_of(keys)
        found = position >= 0
        if self._count:  # one gather for all keys; absent keys read row 0, then left out
            torch.index_select(self._main_rows(), 0, position.clamp(min=0), out=stored)
        if self._wal_count:
            staged = self._wal_index.find(keys)
            in_wal = (staged >= 0).nonzero().squeeze(1)
            stored.index_copy_(0, in_wal, self._wal_rows_tensor().index_select(0, staged[in_wal]))
            found[in_wal] = True
        if bool(found.all()):
            return self.codec.decode(
                keys.numpy(), stored.numpy(), self.directory / ROWS_FILE
            ).contiguous(), found
        rows = torch.empty(keys.numel(), self.row_width, dtype=self.dtype)
        hit = found.nonzero().squeeze(1)
        rows[hit] = self.codec.decode(keys[hit].numpy(), stored[hit].numpy(), self.directory / ROWS_FILE)
        return rows, found

    def contains(self, keys: torch.Tensor) -> torch.Tensor:
        found = self._rows_of(keys) >= 0  # the indexes alone: no row is read
        if self._wal_count:
            found |= self._wal_index.find(keys) >= 0
        return found

    def iter_rows(self, batch_size: int = 65536) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self._rows.advise(mmap.MADV_SEQUENTIAL)  # a scan in file order: read ahead while it lasts
        try:
            yield from self._iter_rows(batch_size)
        finally:
            self._rows.advise(mmap.MADV_RANDOM)

    def _iter_rows(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, self._count, batch_size):
            stop = min(start + batch_size, self._count)
            keys = torch.from_numpy(np.array(self._keys.array[start:stop, 0]))
            stored = self._main_rows()[start:stop].clone()
            if self._wal_count:
                staged = self._wal_index.find(keys)
                in_wal = staged >= 0
                stored[in_wal] = self._wal_rows_tensor().index_select(0, staged[in_wal])
            yield keys, self.codec.decode(keys.numpy(), stored.numpy(), self.directory / ROWS_FILE)
        new_keys, new_records = self._wal_only()
        for start in range(0, new_keys.numel(), batch_size):
            keys = new_keys[start : start + batch_size]
            stored = self._wal_rows_tensor().index_select(0, new_records[start : start + batch_size])
            yield keys, self.codec.decode(keys.numpy(), stored.numpy(), self.directory / WAL_ROWS_FILE)

    def snapshot(self) -> MmapColdStore:
        """A reader of this directory (see the module docstring): while it is open, flushes append to
        the log and leave ``rows.bin`` as it is."""
        if self._wal_count > self._wal_committed or self._appended:
            raise RuntimeError("a snapshot is taken of a flushed store: flush first")
        self._let_readers_in()  # held out for a bulk load that did not come (a reader would wait)
        return MmapColdStore(
            self.directory,
            self.row_width,
            self.dtype,
            read_only=True,
            index_kernels=self._index_kernels,
            create=False,
            checksums=bool(self.codec.check_bytes),
        )

    def _wal_only(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys in the log but not in ``rows.bin``, and their last record numbers."""
        keys, records = self._log_latest()
        new = self._rows_of(keys) < 0
        return keys[new], records[new]

    def _log_latest(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each key in the log once, with its last record number (the one that holds its row)."""
        keys = torch.from_numpy(np.array(self._wal_keys.array[: self._wal_count, 0]))
        records = torch.arange(self._wal_count)
        latest = self._wal_index.find(keys) == records
        return keys[latest], records[latest]

    def __len__(self) -> int:
        return self._count + self._wal_only()[0].numel()

    # -- writes ------------------------------------------------------------------------------

    def _put(self, keys: torch.Tensor, rows: torch.Tensor, before_flush: bool = False) -> None:
        """Rows staged since the last flush are rewritten in place; the others are appended (in this
        order: committed records never change). The log's index is kept either way."""
        start = self._wal_count
        self._wal_rows.reserve(start + keys.numel())  # before any write: a full disk changes nothing
        self._wal_keys.reserve(start + keys.numel())
        passes = host_passes() if isinstance(self._wal_index, KernelHashTable) else None
        if passes is not None:  # one native pass: the log's index, the checks, the rewrites
            log = (self._wal_index.keys, self._wal_index.values, self._wal_rows.array)
            stored, keys, superseded = passes.cold_stage(
                keys, rows, log, self._wal_committed, self.codec.check_bytes
            )
        else:
            record = self._wal_index.find(keys)
            staged = record >= self._wal_committed
            stored = self.codec.encode(keys.numpy(), rows)
            if bool(staged.any()):
                self._wal_rows.array[record[staged].numpy()] = stored[staged.numpy()]
                stored, keys, record = stored[(~staged).numpy()], keys[~staged], record[~staged]
            superseded = record >= 0  # keys whose last record is committed: they move to a new one
        count = keys.numel()
        self._wal_rows.write(start, stored)
        self._wal_keys.write(start, keys.numpy()[:, None])
        self._wal_index.remove(keys[superseded])
        self._wal_index.insert(keys, torch.arange(start, start + count))
        self._wal_count += count

    def admits_into(self, tier) -> bool:
        return self._admits_natively and tier.native_arrays() is not None

    def make_resident_in(
        self, tier, keys: torch.Tensor, counts: torch.Tensor, protected: torch.Tensor | None, initial
    ) -> torch.Tensor:
        keys, counts = cpu_int64(keys), cpu_int64(counts)
        protected = None if protected is None else cpu_int64(protected)
        admission, held = self._admission(tier, keys.numel(), initial)
        slots, done = host_passes().make_resident(keys, counts, protected, *admission)
        self._admitted(tier, done, held, admission[3])
        return slots

    def lookup_bags_in(self, tier, ids: torch.Tensor, padding: int | None, bags, initial) -> tuple:
        admission, held = self._admission(tier, ids.numel(), initial)  # at most: every id new
        policy = tier.policy
        distinct, slots, outputs, done, sampled = host_passes().lookup_bags(
            ids, padding, bags, tier.max_capacity, policy.native_replay(), admission
        )
        if done.status == Residency.TOO_MANY:  # refused before any change
            raise too_many_distinct(tier.name, tier.max_capacity, done.detail)
        policy.replayed(sampled)
        self._admitted(tier, done, held, admission[3])
        return distinct, slots, outputs

    def _admission(self, tier, rows: int, initial) -> tuple[tuple, tuple]:
        """``StepPasses.make_resident``'s arguments from ``tier`` on for up to ``rows`` rows coming in
        (the log's room made first: a full disk raises here, before any change), and the tensors
        behind the tier's choice (``RowCache.native_choice``), for ``_admitted``."""
        tier_arrays = tier.native_arrays()
        if tier_arrays.row_width * 4 != self.row_bytes:
            raise ValueError(
                f"the tier's rows hold {tier_arrays.row_width} values, this store's {self.row_width}"
            )
        choice, held = tier.native_choice(rows)
        start = self._wal_count
        victims = max(0, rows - choice.free_count)  # at most: every key a miss
        self._wal_rows.reserve(start + victims)  # before any write: a full disk changes nothing
        self._wal_keys.reserve(start + victims)
        self._wal_index.make_room(victims)
        codec, index, log = self.codec, self._index, self._wal_index
        files = ColdFiles(
            index.keys.data_ptr(),
            index.values.data_ptr(),
            index.keys.numel() - 1,
            self._count,
            self._rows.address,
            log.keys.data_ptr(),
            log.values.data_ptr(),
            log.keys.numel() - 1,
            self._wal_rows.address,
            start,
            self._wal_committed,
            codec.stored_bytes,
            codec.row_bytes,
            codec.check_bytes,
        )
        advise = self._reads.advise(rows)
        log_files = (self._wal_rows.fileno(), self._wal_keys.fileno())
        return (tier_arrays, choice, files, advise, log_files, initial), held

    def _admitted(self, tier, done: Residency, held: tuple, advised: bool) -> None:
        """After a native admission (``_admission``'s arguments): the tier and this store's counters
        moved, or the error of a damaged row or a failed write raised (nothing having changed)."""
        self._reads.done(done.misses, advised)
        tier.settle_native(done, held)  # raises where too few slots were evictable
        if done.status == Residency.DAMAGED:
            raise self.codec.damaged(self.directory / ROWS_FILE, done.bad, done.detail)
        if done.status == Residency.WRITE_FAILED:
            raise OSError(done.detail, os.strerror(done.detail))
        self.stats.rows_read += done.misses
        self.stats.hits += done.held_lookups
        self.stats.initialized += done.missed_lookups - done.held_lookups
        self.stats.rows_written += done.written_back
        self._wal_count += done.appended
        self._wal_index.live += done.new_to_log

    def can_bulk_load(self) -> bool:
        """Not read-only, an empty log, and (``index.bin`` being changed in place) no reader open:
        readers then wait until the flush that commits the load."""
        return not self.read_only and not self._wal_count and self._hold_readers_out()

    def bulk_load(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Write rows of ``keys`` (distinct) the store does not hold straight into ``rows.bin`` and
        ``keys.bin`` past the committed rows, skipping the log (half the bytes written: the bulk
        path of ``tierstore import``). ``flush`` commits them by recording the new row count; a
        crash before that leaves them past the committed count, where reopening ignores them."""
        self._check_writable()
        if self._wal_count:
            raise RuntimeError("bulk_load needs an empty write-ahead log; flush first")
        if keys.numel() and bool((self._rows_of(keys) >= 0).any()):
            raise ValueError("bulk_load: some keys are in the store already; use put to overwrite rows")
        if not self._hold_readers_out():
            raise RuntimeError("bulk_load needs no reader open (can_bulk_load says so); use put")
        start, count = self._count, keys.numel()
        self._rows.reserve(start + count)
        self._keys.reserve(start + count)
        self._rows.write(start, self.codec.encode(keys.numpy(), rows))
        self._keys.write(start, keys.numpy()[:, None])
        self._keys_crc = self._extend_keys_crc(keys.numpy())
        if isinstance(self._index, DiskIndex):
            self._index.begin(start + count, self._keys_crc)
        self._index.insert(keys, torch.arange(start, start + count))
        self._count += count
        self._appended = True

    def _wal_checksums(self, start: int, stop: int, crcs: tuple[int, int]) -> tuple[int, int]:
        """``crcs`` (CRC32s of the log's keys and rows before ``start``) extended to ``stop``."""
        keys, rows = self._wal_keys.bytes_of(start, stop), self._wal_rows.bytes_of(start, stop)
        return zlib.crc32(keys, crcs[0]), zlib.crc32(rows, crcs[1])

    def flush(self) -> None:
        self._check_writable()
        flushes = self.flushes + 1  # recorded with what this flush commits, even if that is nothing
        appended = self._appended
        if appended:
            self._rows.sync()
            self._keys.sync()
            self._sync_index()
            self._write_state(self._count, flushes)
            self._commit_index()
            self._appended = False
            self._let_readers_in()
        log = None  # the log's keys, looked up once for the reservation and the apply
        if self._wal_count > self._wal_committed:
            self._wal_keys.sync()
            self._wal_rows.sync()
            log = self._log_keys()
            self._reserve_for_log(log)  # before the commit: a full disk fails the flush, changing nothing
            crcs = self._wal_checksums(self._wal_committed, self._wal_count, self._log_crcs)
            self._commit_log(self._wal_count, crcs, flushes)  # the flush is durable here
            self._wal_committed, self._log_crcs = self._wal_count, crcs
        elif self._wal_committed:  # a log a reader kept from being applied: it records the count
            self._commit_log(self._wal_committed, self._log_crcs, flushes)
        elif not appended:  # nothing committed: the count alone
            self._write_state(self._count, flushes)
        self.flushes = flushes
        if self._wal_committed:
            self._try_apply(log)

    def _commit_log(self, records: int, crcs: tuple[int, int], flushes: int) -> None:
        """Commit the log's first ``records`` (with their CRC32s) and the flush count, atomically."""
        commit = {"records": records, "keys_crc32": crcs[0], "rows_crc32": crcs[1], "flushes": flushes}
        write_json_atomic(self.directory / WAL_COMMIT_FILE, commit)

    def _try_apply(self, log: tuple | None = None) -> None:
        """Apply the committed log (``log``: its ``_log_keys``, None: looked up) unless a reader is
        open (then it waits for a later flush)."""
        if not self._readers.try_exclusive():
            self.deferred_applies += 1
            return
        try:
            if self._repair_pending:
                self._repair_index(self._index)
            self._apply_wal(log)
        finally:
            if not self._holding_readers_out:
                self._readers.release()

    def _log_keys(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each key in the log once, its last record, and where it lives in ``rows.bin`` (-1: new).
        Where the reads find their pages on disk (``ReadAdvice``), the index pages of each chunk of
        keys are asked for first, all at once."""
        keys, records = self._log_latest()
        passes = self._advising_passes()
        if passes is None:
            return keys, records, self._rows_of(keys)
        rows = []
        for part in keys.split(ADVISED_CHUNK_ROWS):
            passes.will_need_homes(part, self._index.keys, self._index.values)
            rows.append(self._rows_of(part))
        return keys, records, torch.cat(rows) if rows else keys

    def _advising_passes(self):
        """The native passes where batched reads ask for their pages first (mapped index, pages on
        disk), else None."""
        if not (self._reads.advising and isinstance(self._index, DiskIndex)):
            return None
        return host_passes()

    def _reserve_for_log(self, log: tuple) -> None:
        """Allocate the room in ``rows.bin``/``keys.bin`` that applying ``log`` (``_log_keys``) will take."""
        new_count = int((log[2] < 0).sum())
        self._rows.reserve(self._count + new_count)
        self._keys.reserve(self._count + new_count)

    def _apply_wal(self, log: tuple | None = None) -> None:
        """Copy the committed log (``log``: its ``_log_keys``, None: looked up) into
        ``rows.bin``/``keys.bin`` (idempotent), then drop it."""
        keys, records, position = self._log_keys() if log is None else log
        new = position < 0
        new_count = int(new.sum())
        position[new] = torch.arange(self._count, self._count + new_count)
        self._rows.reserve(self._count + new_count)
        self._keys.reserve(self._count + new_count)
        passes = self._advising_passes()
        # in the rows' order, a chunk at a time (where reads are advised, each chunk's pages of both
        # files asked for first), each chunk's pages written out before the next: the copy's dirty
        # pages stay a chunk's, not the whole log's (a memory limit counts them and cannot reclaim them)
        for part in torch.argsort(position).split(ADVISED_CHUNK_ROWS):
            if passes is not None:
                passes.will_need_rows(self._rows.array, position[part])
                passes.will_need_rows(self._wal_rows.array, torch.sort(records[part]).values)
            self._rows.array[position[part].numpy()] = self._wal_rows.array[records[part].numpy()]
            self._rows.sync_items(int(position[part[0]]), int(position[part[-1]]) + 1)
        self._keys.array[position[new].numpy(), 0] = keys[new].numpy()
        self._rows.sync()
        self._keys.sync()
        self._keys_crc = self._extend_keys_crc(keys[new].numpy())
        if isinstance(self._index, DiskIndex):
            self._index.begin(self._count + new_count, self._keys_crc)
        self._index.insert(keys[new], position[new])
        self._count += new_count
        self._sync_index()
        self._write_state(self._count)
        self._commit_index()
        self._reset_wal()

    def _sync_index(self) -> None:
        if isinstance(self._index, DiskIndex):
            self._index.sync()

    def _commit_index(self) -> None:
        """``index.bin`` matches the state just committed."""
        if isinstance(self._index, DiskIndex):
            self._index.commit(self._count, self._keys_crc)

    def _reset_wal(self) -> None:
        commit_path = self.directory / WAL_COMMIT_FILE
        if commit_path.exists():
            commit_path.unlink()
            fsync_directory(self.directory)
        # The log's files keep their size (a reader may have them mapped, and touching a mapped page
        # past a file's end is SIGBUS); their blocks are freed.
        self._wal_rows.release()
        self._wal_keys.release()
        self._wal_index = self._make_index(1024)
        self._wal_count = self._wal_committed = 0
        self._log_crcs = (0, 0)

    def _extend_keys_crc(self, appended: np.ndarray) -> int | None:
        """The CRC32 of the committed ids once ``appended`` (int64 [n]) follow them."""
        return None if self._keys_crc is None else zlib.crc32(np.ascontiguousarray(appended), self._keys_crc)

    def _write_state(self, count: int, flushes: int | None = None) -> None:
        """The committed row count, the row size the files were written with, the CRC32 of the
        committed ids and the flush count (default ``self.flushes``)."""
        state = {
            "rows": count,
            "row_bytes": self.row_bytes,
            "flushes": self.flushes if flushes is None else flushes,
        }
        if self._keys_crc is not None:
            state["keys_crc32"] = self._keys_crc
        write_json_atomic(self.directory / STATE_FILE, state)

    def structure_problems(self) -> list[str]:
        """``keys.bin`` against the CRC32 ``state.json`` records, and every committed id found at its
        row through the index (``index.bin``, which opening trusts without reading it)."""
        crc, misplaced = 0, 0
        for start, keys in self._committed_keys():
            crc = zlib.crc32(keys.numpy(), crc)
            misplaced += int((self._rows_of(keys) != torch.arange(start, start + keys.numel())).sum())
        problems = [problem for problem in [self._keys_crc_problem(crc)] if problem is not None]
        extra = 0 if self._repair_pending else max(len(self._index) - self._count, 0)
        if misplaced or extra:
            problems.append(
                f"the key index ({self.directory / INDEX_FILE}) does not match {KEYS_FILE}: {misplaced} "
                f"of its {self._count} ids are not found at their row and {extra} are extra; "
                f"delete {INDEX_FILE} (the next writable open rebuilds it from {KEYS_FILE})"
            )
        return problems

    def last_flush_time(self) -> float | None:
        state = self.directory / STATE_FILE
        return state.stat().st_mtime if state.exists() else None

    def report(self) -> dict:
        """The base counters; ``index_bytes``: the RAM of the key indexes (the log's, and the rows'
        where it is not ``index.bin``); ``index_file_bytes``: the size of ``index.bin`` (page cache
        when read, which the kernel reclaims); ``deferred_applies``: flushes whose log stayed
        unapplied because a reader was open."""
        return {
            **super().report(),
            "index_bytes": self._index.nbytes + self._wal_index.nbytes,
            "index_file_bytes": self._index.file_bytes if isinstance(self._index, DiskIndex) else 0,
            "deferred_applies": self.deferred_applies,
        }

    def _refresh(self) -> None:
        self._close_files()
        self._open_files()

    def _close_files(self) -> None:
        for array in (self._rows, self._keys, self._wal_rows, self._wal_keys):
            array.close()
        self._index = None
        self._holding_readers_out = False
        self._readers.close()

    def close(self) -> None:
        self._close_files()
        self._release_lock()


def _flush_count(record: dict, path: Path, default: int = 0) -> int:
    """The flush count ``record`` (a state or commit file at ``path``) holds; ``default`` where it
    holds none (written before flushes were counted)."""
    flushes = record.get("flushes", default)
    if isinstance(flushes, bool) or not isinstance(flushes, int) or flushes < 0:
        raise StoreFormatError(f"{path} is damaged: flushes is {flushes!r}")
    return flushes
