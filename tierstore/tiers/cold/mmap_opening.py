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
from .mmap_files import (
    KEYS_CHUNK_ROWS,
    KEYS_FILE,
    ROWS_FILE,
    STATE_FILE,
    WAL_COMMIT_FILE,
    WAL_KEYS_FILE,
    WAL_ROWS_FILE,
    GrowableArray,
    ReadAdvice,
    ReadersLock,
)


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
        self._wal_index = self._make_index(1024)
        self._admits_natively = (  # make_resident_in's native call serves a tier with native arrays
            not self.read_only
            and self.dtype in KERNEL_DTYPES
            and isinstance(self._index, KernelHashTable)
            and isinstance(self._wal_index, KernelHashTable)
            and host_passes() is not None
        )
        self._wal_count = self._wal_committed = 0
        self._log_crcs = (0, 0)  # CRC32s of the committed log's keys and rows
        self.deferred_applies = 0  # flushes whose log stayed unapplied because a reader was open
        self._recover()

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


def _flush_count(record: dict, path: Path, default: int = 0) -> int:
    """The flush count ``record`` (a state or commit file at ``path``) holds; ``default`` where it
    holds none (written before flushes were counted)."""
    flushes = record.get("flushes", default)
    if isinstance(flushes, bool) or not isinstance(flushes, int) or flushes < 0:
        raise StoreFormatError(f"{path} is damaged: flushes is {flushes!r}")
    return flushes
