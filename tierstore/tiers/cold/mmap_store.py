"""Memory-mapped cold store: rows in a flat file, found through an in-memory hash index.

Files in the store directory:

- ``rows.bin``: row ``i`` at byte ``i * row_bytes``; ``keys.bin``: int64 id of row ``i``.
- ``state.json``: ``{"rows": n, "row_bytes": b}``, the committed row count (rows past it are
  ignored) and the row size the files hold.
- ``wal.keys.bin`` / ``wal.rows.bin``: rows staged since the last flush (a write-ahead log; its
  records past the count are stale).
- ``wal.commit.json``: written atomically when a flush's log is durable, removed once applied.

Guarantee (the same as LMDB's): after a crash or kill at any moment, reopening yields exactly the
state of the last completed ``flush``. ``put`` only writes the log; ``flush`` syncs the log, then
commits it by renaming ``wal.commit.json`` into place (with a CRC32 of the log), then applies it to
``rows.bin``/``keys.bin`` and updates ``state.json``. Opening replays a committed log (replay is
idempotent) and discards an uncommitted one. One writer at a time: a writable open takes an
exclusive ``flock`` on ``lock`` (``base.WriterLock``).

Readers (``read_only=True``, other processes) never crash: no file a reader may have mapped ever
shrinks (files grow sparse, and the blocks of rows about to be written are allocated first with
``posix_fallocate``; after a flush the log's blocks are punched out, its files keeping their
size). A
reader sees the flush that was current when it opened, except that a later flush's log, applied
in place, may show through in rows it had not read yet: it is not a snapshot. Reopen for the
newest flush.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ...errors import StoreFormatError
from ...metadata import fsync_directory, write_json_atomic
from ..hash_index import HashIndex
from ..kernel_hash_table import KernelHashTable
from .base import ColdStore
from .codec import rows_as_bytes, rows_from_bytes

ROWS_FILE, KEYS_FILE, STATE_FILE = "rows.bin", "keys.bin", "state.json"
WAL_ROWS_FILE, WAL_KEYS_FILE, WAL_COMMIT_FILE = "wal.rows.bin", "wal.keys.bin", "wal.commit.json"


_LIBC = ctypes.CDLL(None, use_errno=True)  # the process's own symbols, libc's among them
_LIBC.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_KEEP_SIZE, _PUNCH_HOLE = 0x01, 0x02  # FALLOC_FL_* from linux/falloc.h


class GrowableArray:
    """A file-backed ``np.memmap`` of ``[capacity, width]`` items that doubles when it must grow."""

    def __init__(self, path: Path, width: int, dtype: np.dtype, read_only: bool, create: bool = True) -> None:
        self.path, self.width, self.dtype, self.read_only = path, width, np.dtype(dtype), read_only
        if not path.exists():
            if read_only or not create:
                raise StoreFormatError(
                    f"{path} is missing: the store's rows are gone; restore the directory from a backup "
                    f"(opening it would start an empty table)"
                )
            path.touch()
        self._allocated = 0  # items known to have their blocks on disk (checked again when reserved)
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

    def reserve(self, count: int) -> None:
        """Make room for items ``0..count``: the file's size doubles as needed (sparse, never
        shrinking: a reader may have it mapped), and the blocks of the items up to ``count`` are
        allocated on disk, so a write through the map never needs a block the disk cannot give
        (which would be SIGBUS). A full disk raises ``OSError(ENOSPC)`` here, before any write."""
        item = self.width * self.dtype.itemsize
        if count > self.capacity:
            self.array = None  # no msync: written pages stay in the page cache; flush() makes them durable
            os.truncate(self.path, (1 << max(10, (count - 1).bit_length())) * item)
            self._map()
        if count <= self._allocated:
            return
        try:
            with open(self.path, "r+b", buffering=0) as file:
                os.posix_fallocate(file.fileno(), self._allocated * item, (count - self._allocated) * item)
        except OSError as error:
            full = "; the disk is full: free space and retry (the store keeps its last flush)"
            raise OSError(
                error.errno,
                f"cannot allocate {(count - self._allocated) * item:,} bytes in {self.path}: "
                f"{os.strerror(error.errno)}" + (full if error.errno == errno.ENOSPC else ""),
            ) from None
        self._allocated = count

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

    def write(self, start: int, items: np.ndarray) -> None:
        """Store ``items [n, width]`` at items ``start..start+n`` (reserved) with ``pwrite``: faster
        than storing through the map into pages never touched, and a full disk raises ``OSError``
        here instead of killing the process with SIGBUS on a mapped write."""
        if items.size == 0:
            return
        data = memoryview(np.ascontiguousarray(items, dtype=self.dtype)).cast("B")
        offset = start * self.width * self.dtype.itemsize
        with open(self.path, "r+b", buffering=0) as file:
            while len(data):
                written = os.pwrite(file.fileno(), data, offset)
                data, offset = data[written:], offset + written

    def bytes_of(self, count: int) -> memoryview:
        return memoryview(np.ascontiguousarray(self.array[:count])).cast("B")


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
    ) -> None:
        super().__init__(directory, row_width, dtype, read_only, create)
        self._index_kernels = index_kernels
        self._open_locked(self._open_files)

    def _open_files(self) -> None:
        read_only = self.read_only
        create = self._create
        self._rows = GrowableArray(self.directory / ROWS_FILE, self.row_bytes, np.uint8, read_only, create)
        self._keys = GrowableArray(self.directory / KEYS_FILE, 1, np.int64, read_only, create)
        self._wal_rows = GrowableArray(self.directory / WAL_ROWS_FILE, self.row_bytes, np.uint8, read_only)
        self._wal_keys = GrowableArray(self.directory / WAL_KEYS_FILE, 1, np.int64, read_only)
        self._count = self._read_state()
        self._appended = False  # rows written by bulk_load since the last flush
        self._index = self._make_index(self._count)
        self._load_index()
        self._wal_index = self._make_index(1024)
        self._wal_count = 0
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
            self._write_state(0)
        try:
            state = json.loads(path.read_text())
            count = state["rows"]
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
        for array, name in ((self._rows, ROWS_FILE), (self._keys, KEYS_FILE)):
            if array.capacity < count:
                raise StoreFormatError(
                    f"{self.directory / name} is truncated: it holds {array.capacity} rows but the "
                    f"store has {count}; restore it from a backup"
                )
        return count

    def _load_index(self) -> None:
        keys = torch.from_numpy(np.array(self._keys.array[: self._count, 0]))
        if keys.numel() and (bool((keys < 0).any()) or torch.unique(keys).numel() != keys.numel()):
            raise StoreFormatError(f"{self.directory / KEYS_FILE} is damaged: negative or repeated ids")
        self._index.insert(keys, torch.arange(self._count))

    def _recover(self) -> None:
        commit_path = self.directory / WAL_COMMIT_FILE
        if commit_path.exists():
            try:
                commit = json.loads(commit_path.read_text())
                records, checksum = int(commit["records"]), int(commit["crc32"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, UnicodeDecodeError) as error:
                raise StoreFormatError(f"{commit_path} is damaged ({error!r})") from None
            if (
                self._wal_keys.capacity < records
                or self._wal_rows.capacity < records
                or self._wal_checksum(records) != checksum
            ):
                raise StoreFormatError(
                    f"the write-ahead log of the last flush in {self.directory} is damaged "
                    f"(checksum mismatch); the store cannot be recovered to its last flush"
                )
            self._wal_count = records
            keys = torch.from_numpy(np.array(self._wal_keys.array[:records, 0]))
            self._wal_index.insert(keys, torch.arange(records))
            if not self.read_only:
                self._apply_wal()
        elif not self.read_only:
            self._reset_wal()  # never committed: discard

    # -- reads -------------------------------------------------------------------------------

    def _main_rows(self) -> torch.Tensor:
        return rows_from_bytes(self._rows.array, self.dtype)

    def _wal_rows_tensor(self) -> torch.Tensor:
        return rows_from_bytes(self._wal_rows.array, self.dtype)

    def _get(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.empty(keys.numel(), self.row_width, dtype=self.dtype)
        position = self._index.find(keys)
        found = position >= 0
        if self._count:  # one gather for all keys; absent keys read row 0, overwritten or unspecified
            torch.index_select(self._main_rows(), 0, position.clamp(min=0), out=rows)
        if self._wal_count:
            staged = self._wal_index.find(keys)
            in_wal = (staged >= 0).nonzero().squeeze(1)
            rows.index_copy_(0, in_wal, self._wal_rows_tensor().index_select(0, staged[in_wal]))
            found[in_wal] = True
        return rows, found

    def iter_rows(self, batch_size: int = 65536) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, self._count, batch_size):
            stop = min(start + batch_size, self._count)
            keys = torch.from_numpy(np.array(self._keys.array[start:stop, 0]))
            rows = self._main_rows()[start:stop].clone()
            if self._wal_count:
                staged = self._wal_index.find(keys)
                in_wal = staged >= 0
                rows[in_wal] = self._wal_rows_tensor().index_select(0, staged[in_wal])
            yield keys, rows
        new_keys, new_records = self._wal_only()
        for start in range(0, new_keys.numel(), batch_size):
            part = new_records[start : start + batch_size]
            yield new_keys[start : start + batch_size], self._wal_rows_tensor().index_select(0, part)

    def _wal_only(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Staged keys not in the committed rows, and their log record numbers."""
        keys = torch.from_numpy(np.array(self._wal_keys.array[: self._wal_count, 0]))
        new = self._index.find(keys) < 0
        return keys[new], torch.arange(self._wal_count)[new]

    def __len__(self) -> int:
        return self._count + self._wal_only()[0].numel()

    # -- writes ------------------------------------------------------------------------------

    def _put(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        record = self._wal_index.find(keys)
        staged = record >= 0  # staged since the last flush: rewritten in place
        new = (~staged).nonzero().squeeze(1)  # appended to the log, in this order
        start = self._wal_count
        self._wal_rows.reserve(start + new.numel())
        self._wal_keys.reserve(start + new.numel())
        if bool(staged.any()):
            self._wal_rows.array[record[staged].numpy()] = rows_as_bytes(rows[staged])
        new_rows = rows if new.numel() == keys.numel() else rows[new]
        self._wal_rows.write(start, rows_as_bytes(new_rows))
        self._wal_keys.write(start, keys[new].numpy()[:, None])
        self._wal_index.insert(keys[new], torch.arange(start, start + new.numel()))
        self._wal_count += new.numel()

    def bulk_load(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Write rows of ``keys`` (distinct) the store does not hold straight into ``rows.bin`` and
        ``keys.bin`` past the committed rows, skipping the log (half the bytes written: the bulk
        path of ``tierstore import``). ``flush`` commits them by recording the new row count; a
        crash before that leaves them past the committed count, where reopening ignores them."""
        self._check_writable()
        if self._wal_count:
            raise RuntimeError("bulk_load needs an empty write-ahead log; flush first")
        if keys.numel() and bool((self._index.find(keys) >= 0).any()):
            raise ValueError("bulk_load: some keys are in the store already; use put to overwrite rows")
        start, count = self._count, keys.numel()
        self._rows.reserve(start + count)
        self._keys.reserve(start + count)
        self._rows.write(start, rows_as_bytes(rows))
        self._keys.write(start, keys.numpy()[:, None])
        self._index.insert(keys, torch.arange(start, start + count))
        self._count += count
        self._appended = True

    def _wal_checksum(self, records: int) -> int:
        checksum = zlib.crc32(self._wal_keys.bytes_of(records))
        return zlib.crc32(self._wal_rows.bytes_of(records), checksum)

    def flush(self) -> None:
        self._check_writable()
        if self._appended:
            self._rows.sync()
            self._keys.sync()
            self._write_state(self._count)
            self._appended = False
        if not self._wal_count:
            return
        self._wal_keys.sync()
        self._wal_rows.sync()
        self._reserve_for_log()  # before the commit point: a full disk fails the flush, changing nothing
        commit = {"records": self._wal_count, "crc32": self._wal_checksum(self._wal_count)}
        write_json_atomic(self.directory / WAL_COMMIT_FILE, commit)  # the flush is durable here
        self._apply_wal()

    def _log_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The log's keys, and where each lives in ``rows.bin`` (-1: new, not there yet)."""
        keys = torch.from_numpy(np.array(self._wal_keys.array[: self._wal_count, 0]))
        return keys, self._index.find(keys)

    def _reserve_for_log(self) -> None:
        """Allocate the room in ``rows.bin``/``keys.bin`` that applying the log will take."""
        new_count = int((self._log_keys()[1] < 0).sum())
        self._rows.reserve(self._count + new_count)
        self._keys.reserve(self._count + new_count)

    def _apply_wal(self) -> None:
        """Copy the committed log into ``rows.bin``/``keys.bin`` (idempotent), then drop it."""
        keys, position = self._log_keys()
        new = position < 0
        new_count = int(new.sum())
        position[new] = torch.arange(self._count, self._count + new_count)
        self._rows.reserve(self._count + new_count)
        self._keys.reserve(self._count + new_count)
        self._rows.array[position.numpy()] = self._wal_rows.array[: self._wal_count]
        self._keys.array[position[new].numpy(), 0] = keys[new].numpy()
        self._rows.sync()
        self._keys.sync()
        self._index.insert(keys[new], position[new])
        self._count += new_count
        self._write_state(self._count)
        self._reset_wal()

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
        self._wal_count = 0

    def _write_state(self, count: int) -> None:
        """The committed row count, and the row size the files were written with (checked at open)."""
        write_json_atomic(self.directory / STATE_FILE, {"rows": count, "row_bytes": self.row_bytes})

    def last_flush_time(self) -> float | None:
        state = self.directory / STATE_FILE
        return state.stat().st_mtime if state.exists() else None

    def close(self) -> None:
        for array in (self._rows, self._keys, self._wal_rows, self._wal_keys):
            array.array = None
        self._release_lock()
