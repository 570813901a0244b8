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
  stale). Its index (id -> last record, ``log_index.LogIndex``) keeps the newest entries in RAM
  and seals the rest into unlinked, mapped files, so its RAM stays bounded however long the log.
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
import mmap
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ...kernels.native_types import ColdFiles, Residency
from ...kernels.step_passes import host_passes
from ...validation import cpu_int64
from ..contract import too_many_distinct
from ..kernel_hash_table import KernelHashTable
from .base import ColdStore
from .codec import rows_from_bytes
from .disk_index import INDEX_FILE, DiskIndex
from .mmap_files import KEYS_FILE, ROWS_FILE, STATE_FILE, WAL_ROWS_FILE
from .mmap_log import MmapLog
from .mmap_opening import MmapOpening, live_rows, log_entries
from .pages_ahead import ahead_bytes


class MmapColdStore(MmapOpening, MmapLog, ColdStore):
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

    # -- opening ----------------------------------------------------------------------------

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
                index = self._wal_index
                log = (index.keys, index.values, index.native_runs, self._wal_rows.array)
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
            found[staged < -1] = False  # removed
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
            staged = self._wal_index.find(keys)
            found = (found | (staged >= 0)) & (staged >= -1)  # below -1: removed
        return found

    def iter_rows(self, batch_size: int = 65536) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self._rows.advise(mmap.MADV_SEQUENTIAL)  # a scan in file order: read ahead while it lasts
        try:
            yield from self._iter_rows(batch_size)
        finally:
            self._rows.advise(mmap.MADV_RANDOM)

    def _iter_rows(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        removed = np.sort(self._removed_rows())  # rows of removed ids, left out
        for start in range(0, self._count, batch_size):
            stop = min(start + batch_size, self._count)
            keys = torch.from_numpy(np.array(self._keys.array[start:stop, 0]))
            stored = self._main_rows()[start:stop].clone()
            held = live_rows(removed, start, stop)
            if self._wal_count:
                staged = self._wal_index.find(keys)
                in_wal = staged >= 0
                stored[in_wal] = self._wal_rows_tensor().index_select(0, staged[in_wal])
                held = (staged >= -1) if held is None else held & (staged >= -1)  # below -1: removed
            if held is not None and not bool(held.all()):
                keys, stored = keys[held], stored[held]
            if keys.numel():
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
        """Keys in the log but not in ``rows.bin`` (nor removed since), and their last record numbers."""
        keys, records = self._log_latest()
        new = (self._rows_of(keys) < 0) & (records >= 0)
        return keys[new], records[new]

    def _log_latest(self, start: int = 0, stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each key whose last record in the log is one of records ``start..stop`` (default: all), with
        that record's value in the log's index: its number where it holds the key's row, ``-2 -
        number`` where it removes the key."""
        stop = self._wal_count if stop is None else stop
        keys, records = log_entries(self._wal_keys.array[start:stop, 0], np.arange(start, stop))
        keys, records = torch.from_numpy(keys), torch.from_numpy(records)
        latest = self._wal_index.find(keys) == records
        return keys[latest], records[latest]

    def __len__(self) -> int:
        keys, records = self._log_latest()
        in_main = self._rows_of(keys) >= 0
        added, removed = int((~in_main & (records >= 0)).sum()), int((in_main & (records < 0)).sum())
        return self._count - self._removed_count + added - removed

    # -- writes ------------------------------------------------------------------------------

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
        if tier.rows.dtype != self.dtype or tier_arrays.row_width != self.row_width:
            raise ValueError(
                f"the tier's rows hold {tier_arrays.row_width} values of {tier.rows.dtype}, this store's "
                f"{self.row_width} of {self.dtype}"
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
            self._wal_rows.made_through,
            self._wal_rows.allocated_bytes,
            ctypes.addressof(log.native_runs) if log.native_runs is not None else None,
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
        self._wal_rows.prepared = done.log_prepared
        for log, item in ((self._wal_rows, self.codec.stored_bytes), (self._wal_keys, 8)):
            log.make_pages_ahead(self._wal_count * item, ahead_bytes(done.appended * item))
        self._wal_index.table.live += done.new_to_log

    def structure_problems(self) -> list[str]:
        """``keys.bin`` against the CRC32 ``state.json`` records, and every committed id found at its
        row through the index (``index.bin``, which opening trusts without reading it)."""
        crc, misplaced = 0, 0
        removed = np.sort(self._removed_rows())
        for start, keys in self._committed_keys():
            crc = zlib.crc32(keys.numpy(), crc)
            rows = torch.arange(start, start + keys.numel())
            live = live_rows(removed, start, start + keys.numel())
            if live is not None:
                keys, rows = keys[live], rows[live]
            misplaced += int((self._rows_of(keys) != rows).sum())
        problems = [problem for problem in [self._keys_crc_problem(crc)] if problem is not None]
        extra = 0 if self._repair_pending else max(len(self._index) - self._count + self._removed_count, 0)
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
        unapplied because a reader was open; ``removed_rows_on_disk``: rows of removed ids the files
        still hold (``compact`` frees them)."""
        return {
            **super().report(),
            "removed_rows_on_disk": self._removed_count,
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
        if getattr(self, "_wal_index", None) is not None:
            self._wal_index.close()
        self._holding_readers_out = False
        self._readers.close()

    def close(self) -> None:
        self._close_files()
        self._release_lock()
