"""Opening an mmap cold store: its files mapped, the committed state read and checked, the key index
opened or rebuilt, a committed log replayed (``MmapColdStore``'s part; the guarantee is in
``mmap_store``)."""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ...errors import StoreFormatError
from ...kernels.cache_passes import cache_passes_of
from ...kernels.launch import KERNEL_DTYPES
from ...kernels.step_passes import host_passes
from ...metadata import fsync_directory
from ..hash_index import HashIndex
from ..kernel_hash_table import KernelHashTable
from .disk_index import INDEX_FILE, DiskIndex
from .log_index import LogIndex
from .mmap_files import (
    KEYS_CHUNK_ROWS,
    KEYS_FILE,
    REMOVED_FILE,
    ROWS_FILE,
    STATE_FILE,
    WAL_COMMIT_FILE,
    WAL_KEYS_FILE,
    WAL_ROWS_FILE,
    GrowableArray,
    ReadAdvice,
    ReadersLock,
)
from .pages_ahead import PagesAhead


class MmapOpening:
    """``MmapColdStore``'s opening and recovery."""

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
        self._wal_index = LogIndex(self.directory, self._index_kernels)
        self._admits_natively = (  # make_resident_in's native call serves a tier with native arrays
            not self.read_only
            and self.dtype in KERNEL_DTYPES
            and isinstance(self._index, KernelHashTable)
            and isinstance(self._wal_index.table, KernelHashTable)
            and host_passes() is not None
        )
        if self._admits_natively:  # the log's pages made ahead of the native admissions' appends
            self._wal_rows.pages_ahead = PagesAhead(host_passes().prepare_pages)
            self._wal_keys.pages_ahead = PagesAhead(host_passes().prepare_pages)
        self._wal_count = self._wal_committed = 0
        self._log_crcs = (0, 0)  # CRC32s of the committed log's keys and rows
        self.deferred_applies = 0  # flushes whose log stayed unapplied because a reader was open
        self._recover()

    def _make_index(self, capacity: int) -> HashIndex | KernelHashTable:
        """A map ``key -> row number`` (int64) holding ``capacity`` keys before it grows as rows are
        staged or added; on 4 KiB pages, since each rebuild first touches a whole new table."""
        if self._index_kernels is None:
            return HashIndex(capacity)
        return KernelHashTable(capacity, self._index_kernels, value_dtype=torch.int64, huge_pages=False)

    def _read_state(self) -> int:
        path = self.directory / STATE_FILE
        self._removed_count = self._removed_crc = 0  # stores that never removed an id record neither
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
            self._removed_count = state.get("removed_rows", 0)
            self._removed_crc = state.get("removed_crc32", 0)
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as error:
            raise StoreFormatError(f"{path} is damaged ({error!r}); restore it from a backup") from None
        if not isinstance(count, int) or count < 0:
            raise StoreFormatError(f"{path} is damaged: rows is {count!r}")
        removed, removed_crc = self._removed_count, self._removed_crc
        if not isinstance(removed, int) or not 0 <= removed <= count or not isinstance(removed_crc, int):
            raise StoreFormatError(f"{path} is damaged: removed_rows is {removed!r} ({removed_crc!r})")
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
        if (
            index is not None
            and (index.matches(count, crc) or index.matches_before_pending(count, crc))
            and index.header("removed") == self._removed_count
        ):
            return index
        if self.read_only:
            return self._index_from_keys(self._make_index(count))
        partial = path.with_name(INDEX_FILE + ".new")
        self._index_from_keys(DiskIndex.create(partial, kernels, count, count, crc))
        os.replace(partial, path)
        fsync_directory(self.directory)
        index = DiskIndex(path, kernels, read_only=False)
        index.set_removed(self._removed_count, sync=False)  # the commit syncs it
        index.commit(count, crc)
        return index

    def _index_from_keys(self, index):
        """``index`` with every committed id of ``keys.bin`` (whose CRC32 is checked) at its row, but
        for the removed rows'."""
        crc = 0
        removed = np.sort(self._removed_rows())
        for start, keys in self._committed_keys():
            crc = zlib.crc32(keys.numpy(), crc)
            if bool((keys < 0).any()):
                raise StoreFormatError(f"{self.directory / KEYS_FILE} is damaged: negative ids")
            rows = torch.arange(start, start + keys.numel())
            kept = live_rows(removed, start, start + keys.numel())
            if kept is not None:  # rows of removed ids: left out (an id that came back has a later row)
                keys, rows = keys[kept], rows[kept]
            try:
                index.insert(keys, rows)
            except ValueError:
                raise StoreFormatError(f"{self.directory / KEYS_FILE} is damaged: repeated ids") from None
        problem = self._keys_crc_problem(crc)
        if problem is not None:
            raise StoreFormatError(problem)
        return index

    def _removed_rows(self) -> np.ndarray:
        """int64 [removed_rows]: the committed rows whose ids were removed (``removed.bin``, its CRC32
        checked), in the order of their removal."""
        if not self._removed_count:
            return np.zeros(0, dtype=np.int64)
        path = self.directory / REMOVED_FILE
        try:
            rows = np.fromfile(path, dtype=np.int64, count=self._removed_count)
        except (OSError, ValueError):
            rows = np.zeros(0, dtype=np.int64)
        if rows.size != self._removed_count or zlib.crc32(rows) != self._removed_crc:
            raise StoreFormatError(
                f"{path} is missing, truncated or damaged (the rows of {self._removed_count} removed ids); "
                f"restore the store from a backup"
            )
        if rows.size and not (0 <= rows.min() and rows.max() < self._count):
            raise StoreFormatError(f"{path} is damaged: a removed row past the committed {self._count}")
        return rows

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
            keys, values = log_entries(self._wal_keys.array[:records, 0], np.arange(records))
            last = records - 1 - np.unique(keys[::-1], return_index=True)[1]  # a key's last record wins
            self._wal_index.insert(torch.from_numpy(keys[last]), torch.from_numpy(values[last]))
            if not self.read_only:
                self._try_apply()
        elif not self.read_only:
            self._reset_wal()  # never committed: discard (no reader reads an uncommitted log)


def live_rows(removed: np.ndarray, start: int, stop: int) -> torch.Tensor | None:
    """bool [stop - start]: which committed rows ``start..stop`` hold a live id, given the rows of
    removed ids (``removed``, sorted); None where all do."""
    first, end = np.searchsorted(removed, [start, stop])
    if end == first:
        return None
    live = torch.ones(stop - start, dtype=torch.bool)
    live[torch.from_numpy(removed[first:end] - start)] = False
    return live


def removal_records(keys: np.ndarray) -> np.ndarray:
    """The log's record keys of removals of ``keys`` (int64, non-negative): ``-2 - key``, below -1."""
    return -2 - keys


def log_entries(record_keys: np.ndarray, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, values in the log's index)`` of the log's ``records`` whose keys are ``record_keys``:
    a row's record is indexed by its number, a removal's by ``-2 - number`` (below -1, where ``find``
    says -1 for a key the log does not hold)."""
    removal = record_keys < 0
    return np.where(removal, -2 - record_keys, record_keys), np.where(removal, -2 - records, records)


def _flush_count(record: dict, path: Path, default: int = 0) -> int:
    """The flush count ``record`` (a state or commit file at ``path``) holds; ``default`` where it
    holds none (written before flushes were counted)."""
    flushes = record.get("flushes", default)
    if isinstance(flushes, bool) or not isinstance(flushes, int) or flushes < 0:
        raise StoreFormatError(f"{path} is damaged: flushes is {flushes!r}")
    return flushes
