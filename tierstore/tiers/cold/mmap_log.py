"""The mmap cold store's writes: rows staged in its write-ahead log, loaded in bulk, and a flush
that commits the log and applies it to ``rows.bin`` (``MmapColdStore``'s part; the guarantee is
in ``mmap_store``)."""

from __future__ import annotations

import zlib

import numpy as np
import torch

from ...kernels.step_passes import host_passes
from ...metadata import fsync_directory, write_json_atomic
from ..kernel_hash_table import KernelHashTable
from .disk_index import DiskIndex
from .log_index import StagedLog
from .mmap_files import ADVISED_CHUNK_ROWS, REMOVED_FILE, STATE_FILE, WAL_COMMIT_FILE, GrowableArray
from .mmap_opening import removal_records


class MmapLog:
    """``MmapColdStore``'s writes, its log and its flush."""

    def _put(self, keys: torch.Tensor, rows: torch.Tensor, before_flush: bool = False) -> None:
        """Rows staged since the last flush are rewritten in place; the others are appended (in this
        order: committed records never change). The log's index is kept either way; its room is made
        before each part's writes (``LogIndex.parts_with_room``)."""
        for start, stop in self._wal_index.parts_with_room(keys.numel()):
            self._put_part(keys[start:stop], rows[start:stop])

    def _put_part(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        start = self._wal_count
        self._wal_rows.reserve(start + keys.numel())  # before any write: a full disk changes nothing
        self._wal_keys.reserve(start + keys.numel())
        passes = host_passes() if isinstance(self._wal_index.table, KernelHashTable) else None
        if passes is not None:  # one native pass: the log's index, the checks, the rewrites
            index = self._wal_index
            log = (index.keys, index.values, index.native_runs, self._wal_rows.array)
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
            superseded = record != -1  # a committed record or a removal: the key moves to a new one
        count = keys.numel()
        self._wal_rows.write(start, stored)
        self._wal_keys.write(start, keys.numpy()[:, None])
        self._wal_index.remove(keys[superseded])
        self._wal_index.insert(keys, torch.arange(start, start + count))
        self._wal_count += count

    def staged_keys(self) -> torch.Tensor:
        keys = np.array(self._wal_keys.array[self._wal_committed : self._wal_count, 0])
        return torch.from_numpy(np.unique(keys[keys >= 0]))

    def _remove(self, keys: torch.Tensor) -> None:
        """Append a removal record of each of ``keys`` (distinct, held) to the log: its key ``-2 - id``
        and a row of zeros; the log's index then gives the id ``-2 - record`` (held no more)."""
        for start, stop in self._wal_index.parts_with_room(keys.numel()):
            self._remove_part(keys[start:stop])

    def _remove_part(self, keys: torch.Tensor) -> None:
        start, count = self._wal_count, keys.numel()
        self._wal_rows.reserve(start + count)  # before any write: a full disk changes nothing
        self._wal_keys.reserve(start + count)
        self._wal_rows.write(start, np.zeros((count, self.codec.stored_bytes), dtype=np.uint8))
        self._wal_keys.write(start, removal_records(keys.numpy())[:, None])
        records = torch.arange(start, start + count)
        self._wal_index.remove(keys)
        self._wal_index.insert(keys, -2 - records)
        self._wal_count += count

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
        try:
            if self._wal_count > self._wal_committed:
                self._wal_keys.sync()
                self._wal_rows.sync()
                log = self._log_keys()  # a full disk fails the flush here or below, changing nothing
                self._reserve_for_log(log)  # before the commit
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
        finally:
            if log is not None:
                log.close()

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

    def _log_keys(self) -> StagedLog:
        """Each key in the log once, its last record, and where it lives in ``rows.bin`` (-1: new),
        found a chunk of the log at a time and kept in a file. Where the reads find their pages on
        disk (``ReadAdvice``), the index pages of each part of a chunk are asked for first, all at once."""
        passes = self._advising_passes()
        log = StagedLog(self.directory)
        try:
            for start, stop in log.record_chunks(self._wal_count):
                keys, records = self._log_latest(start, stop)
                parts = zip(keys.split(ADVISED_CHUNK_ROWS), records.split(ADVISED_CHUNK_ROWS))
                for part, part_records in parts:
                    if passes is not None:
                        passes.will_need_homes(part, self._index.keys, self._index.values)
                    log.append(part, part_records, self._rows_of(part))
            log.written()
        except BaseException:
            log.close()
            raise
        return log

    def _advising_passes(self):
        """The native passes where batched reads ask for their pages first (mapped index, pages on
        disk), else None."""
        if not (self._reads.advising and isinstance(self._index, DiskIndex)):
            return None
        return host_passes()

    def _reserve_for_log(self, log: StagedLog) -> None:
        """Allocate the room in ``rows.bin``/``keys.bin`` that applying ``log`` (``_log_keys``) will take."""
        self._rows.reserve(self._count + log.new_rows)
        self._keys.reserve(self._count + log.new_rows)

    def _apply_wal(self, log: StagedLog | None = None) -> None:
        """Copy the committed log (``log``: its ``_log_keys``, None: looked up) into
        ``rows.bin``/``keys.bin`` and record the rows of removed ids (idempotent), then drop it; a
        chunk of its keys at a time."""
        own = log is None
        log = self._log_keys() if own else log
        try:
            self._reserve_for_log(log)
            for keys, records, position in log.chunks():
                self._apply_chunk(keys, records, position)
            self._rows.sync()
            self._keys.sync()
            self._sync_index()
            self._write_state(self._count)
            self._commit_index()
            self._reset_wal()
        finally:
            if own:
                log.close()

    def _apply_chunk(self, keys: torch.Tensor, records: torch.Tensor, position: torch.Tensor) -> None:
        """Apply one chunk of a ``StagedLog``: rows copied, new ids given rows and indexed, removed ids'
        rows recorded."""
        removal = records < 0
        gone = removal & (position >= 0)
        keys, records, position, gone_keys, gone_rows = (
            keys[~removal],
            records[~removal],
            position[~removal],
            keys[gone],
            position[gone],
        )
        new = position < 0
        new_count = int(new.sum())
        position[new] = torch.arange(self._count, self._count + new_count)
        passes = self._advising_passes()
        # in the rows' order, a part at a time (where reads are advised, each part's pages of both
        # files asked for first), each part's pages written out before the next: the copy's dirty
        # pages stay a part's, not the whole log's (a memory limit counts them and cannot reclaim them)
        for part in torch.argsort(position).split(ADVISED_CHUNK_ROWS) if position.numel() else ():
            if passes is not None:
                passes.will_need_rows(self._rows.array, position[part])
                passes.will_need_rows(self._wal_rows.array, torch.sort(records[part]).values)
            self._rows.array[position[part].numpy()] = self._wal_rows.array[records[part].numpy()]
            self._rows.sync_items(int(position[part[0]]), int(position[part[-1]]) + 1)
        self._keys.array[position[new].numpy(), 0] = keys[new].numpy()
        self._keys_crc = self._extend_keys_crc(keys[new].numpy())
        if isinstance(self._index, DiskIndex):
            self._index.begin(self._count + new_count, self._keys_crc)
        self._index.insert(keys[new], position[new])
        self._count += new_count
        if gone_rows.numel():
            self._remove_rows(gone_keys, gone_rows)

    def _remove_rows(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Record the committed ``rows`` of removed ``keys`` in ``removed.bin`` (past the committed
        ones, synced) and erase the keys from the index; the caller's state commits the new count.
        ``index.bin`` is marked as matching no state while it changes: a kill rebuilds it."""
        removed = GrowableArray(self.directory / REMOVED_FILE, 1, np.int64, read_only=False)
        try:
            removed.reserve(self._removed_count + rows.numel())
            removed.write(self._removed_count, rows.numpy()[:, None])
            removed.sync()
        finally:
            removed.close()
        if isinstance(self._index, DiskIndex):
            self._index.set_removed(-1)
        self._index.remove(keys)
        self._removed_crc = zlib.crc32(np.ascontiguousarray(rows.numpy()), self._removed_crc)
        self._removed_count += rows.numel()

    def _sync_index(self) -> None:
        if isinstance(self._index, DiskIndex):
            self._index.sync()

    def _commit_index(self) -> None:
        """``index.bin`` matches the state just committed."""
        if isinstance(self._index, DiskIndex):
            self._index.set_removed(self._removed_count, sync=False)  # the commit syncs it
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
        self._wal_index.clear()
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
        if self._removed_count:
            state.update(removed_rows=self._removed_count, removed_crc32=self._removed_crc)
        write_json_atomic(self.directory / STATE_FILE, state)
