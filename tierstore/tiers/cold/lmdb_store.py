"""LMDB cold store: key = 8-byte big-endian id, value = the stored row (its bytes and check).

Every row read is checked (``codec.RowCodec``), and a key not found is confirmed absent by checking
the entries on either side of it (a page damaged where the key should be gives a neighbour that
fails its check), so damage found by a read is ``StoreFormatError`` naming the file, as are LMDB's
own errors from damaged pages; ``tierstore verify`` reads and checks every entry. A data file not as
the store's writer last left it has every page walked at open before LMDB reads one
(``_check_pages``).

Staged writes go to a staging sub-database kept as an append-only log (``lmdb_staging``: entries
keyed by sequence number, an index in RAM finds an id's newest one), one transaction per batch that
appends to the B-tree's last leaves. There are two (``pending`` and ``pending.b``), and ``meta``
names which one stages. ``flush`` commits in one small transaction (its commit point): the flush
count, and the staging log's role turned to *being applied* while the other one stages from then on;
after a sync its entries are copied into ``rows`` in the log's order, a few thousand per transaction
(each sorted by id, an id's entries kept in order), and a last one empties it and clears the role. A
flush's own rows are staged without being indexed (``lmdb_staging``). LMDB keeps a write
transaction's dirty pages in memory until it commits (and their buffers for good after), so a
transaction writing a host cache's worth of rows at random ids (each in its own B-tree leaf) would
need about a page of RAM per row: a table several times larger than a memory limit could not train
or flush under it. Reads see ``rows`` overlaid by the log being applied (and, for the writer, by the
staging one), so a reader, a reopen or a crash anywhere in the apply all see exactly the committed
flush; the next flush (of a writer reopened after a crash, or after a failed apply) first applies it
again (copying the log again writes the same rows). A store that opens on a log being applied
rebuilds its index by scanning it (one flush's rows). Staged writes never committed by a flush are
dropped on the next writable open. LMDB maps an environment once per process, so a store open in
this process (for writing or reading) cannot be opened again here: a reader beside the writer runs
in another process. Reads sort the keys so the B-tree is walked in order (a log's entries by their
sequence numbers). A read that waits on the disk (the store is larger than the page cache) is split
into contiguous key ranges read by a thread pool, each range in its own read transaction: py-lmdb
releases the GIL inside ``get``, so the page faults overlap and the SSD's queue stays busy. A read
served from the page cache stays on one thread, where the GIL would make threads slower. Which
regime holds is measured, not guessed: a moving average of the seconds per key of recent reads
decides. The transactions of one parallel read can differ only if another process commits meanwhile;
this process never writes during a read. A read-only store reads one snapshot (one read transaction,
on one thread) from its open until ``refresh()``; a snapshot held long keeps the writer from reusing
the pages it holds, so the file grows (LMDB's rule for long read transactions). The memory map
doubles whenever a write transaction finds it full, and the write is retried.
"""

from __future__ import annotations

import errno
import itertools
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import lmdb
import numpy as np
import torch

from ...errors import StoreFormatError
from .base import ColdStore
from .codec import decode_keys, encode_keys
from .lmdb_layout import (
    _APPLYING_KEY,
    _FLUSHES_KEY,
    _OPEN_IN_THIS_PROCESS,
    _STAGING_KEY,
    INITIAL_MAP_SIZE,
    LOW_DISK_BYTES,
    READ_THREADS,
)
from .lmdb_opening import LmdbOpening
from .lmdb_reads import LmdbReads
from .lmdb_staging import StageLog

APPLY_ROWS = 4096  # rows a transaction of a flush's apply moves: its dirty pages stay a few MiB


class LmdbColdStore(LmdbOpening, LmdbReads, ColdStore):
    """Cold store in an LMDB environment at ``directory/lmdb``."""

    def __init__(
        self,
        directory: Path,
        row_width: int,
        dtype: torch.dtype,
        read_only: bool = False,
        map_size: int = INITIAL_MAP_SIZE,
        read_threads: int = READ_THREADS,
        create: bool = True,
        checksums: bool = True,
    ) -> None:
        super().__init__(directory, row_width, dtype, read_only, create, checksums)
        self._open_locked(lambda: self._open(map_size, read_threads))

    # -- reads -------------------------------------------------------------------------------

    @property
    def _pending_count(self) -> int:
        """Entries the staging log holds (a reader's: none)."""
        return 0 if self.read_only else self._logs[self._staging].entries

    @property
    def _applying_count(self) -> int:
        """Entries the log being applied holds (0: none is)."""
        return 0 if self._applying is None else self._logs[self._applying].entries

    def iter_rows(self, batch_size: int = 65536) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        try:
            yield from self._iter_rows(batch_size)
        except lmdb.Error as error:
            raise self._damaged(error) from None

    def _iter_rows(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        databases = self._databases()
        logs = databases[1:]
        with self._begin() as txn:
            items = txn.cursor(self._rows).iternext()
            while chunk := list(itertools.islice(items, batch_size)):
                keys, rows = self._decode(chunk)
                staged, staged_found = self._read(txn, keys, logs)  # newer values win
                rows[staged_found] = staged[staged_found]
                kept = _newest_entries(keys, logs) >= -1  # below -1: removed since
                if bool(kept.any()):
                    yield keys[kept], rows[kept]
            if not logs:
                return
            staged_keys = torch.cat([log.items()[0] for log in logs]).unique()
            for keys in staged_keys.split(batch_size):  # each staged key not in rows once
                keys = keys[(_newest_entries(keys, logs) >= 0) & ~self._read(txn, keys, databases[:1])[1]]
                if keys.numel():
                    yield keys, self._read(txn, keys, logs)[0]

    def snapshot(self) -> LmdbSnapshot:
        if self.read_only or self._pending_count or self._applying is not None:
            raise RuntimeError("a snapshot is taken of a flushed, writable store: flush first")
        return LmdbSnapshot(self)

    def _decode(self, chunk: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Checked ``(keys, rows)`` of a chunk of ``(key, value)`` entries (map views)."""
        keys, values = zip(*chunk)
        if any(len(key) != 8 for key in keys):
            raise StoreFormatError(f"{self._data_file} is damaged: it holds malformed entries")
        ids = decode_keys([bytes(key) for key in keys])
        return torch.from_numpy(ids), self._checked_rows(ids, list(values))

    def __len__(self) -> int:
        databases = self._databases()
        logs = databases[1:]
        with self._begin() as txn:
            count = txn.stat(self._rows)["entries"]
            if logs:  # staged keys: added where rows holds none, gone where removed
                keys = torch.cat([log.items()[0] for log in logs]).unique()
                in_rows = self._read(txn, keys, databases[:1])[1]
                newest = _newest_entries(keys, logs)
                count += int((~in_rows & (newest >= 0)).sum()) - int((in_rows & (newest < -1)).sum())
            return count

    # -- writes ------------------------------------------------------------------------------

    def _write(self, work):
        """Run ``work(txn)`` in one write transaction, doubling the map while it is full; returns
        what it returns. A transaction that fails leaves the data as it was; a full disk is
        ``OSError(ENOSPC)``."""
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    return work(txn)
            except lmdb.MapFullError:
                self._env.set_mapsize(self._env.info()["map_size"] * 2)
            except lmdb.Error as error:
                raise self._as_os_error(error) from None

    def _as_os_error(self, error: lmdb.Error) -> OSError:
        """LMDB reports a full disk as an I/O error of its commit: say which it was."""
        space = os.statvfs(self._path)
        free = space.f_bavail * space.f_frsize
        if free < LOW_DISK_BYTES:
            return OSError(
                errno.ENOSPC,
                f"the disk holding {self._path} is full ({free:,} bytes free; LMDB: {error}); free space "
                f"and retry: the store keeps its last flush, and rows not yet written stay cached",
            )
        return OSError(errno.EIO, f"LMDB could not write to {self._path}: {error}")

    def _put(self, keys: torch.Tensor, rows: torch.Tensor, before_flush: bool) -> None:
        log = self._logs[self._staging]
        stored = np.ascontiguousarray(self.codec.encode(keys.numpy(), rows))
        if before_flush:  # not indexed: the flush copies the log by scanning it
            self._append(log, log.entries_of(keys.numpy(), stored)[0])
            log.appended(keys.numel())
            return
        for start, stop in log.index.parts_with_room(keys.numel()):  # its room made before each commit
            items, numbers = log.entries_of(keys[start:stop].numpy(), stored[start:stop])
            self._append(log, items)
            log.record(keys[start:stop], numbers)

    def _append(self, log: StageLog, items: list) -> None:
        """Commit ``items`` (``(key, value)``, keys after the log's last) to the end of ``log``."""

        def stage(txn: lmdb.Transaction) -> None:
            txn.cursor(log.database).putmulti(items, append=True)

        self._write(stage)

    def staged_keys(self) -> torch.Tensor:
        keys, numbers = self._indexed(self._logs[self._staging]).items()
        return keys[numbers >= 0]

    def _remove(self, keys: torch.Tensor) -> None:
        log = self._indexed(self._logs[self._staging])
        for start, stop in log.index.parts_with_room(keys.numel()):
            part = keys[start:stop]
            items, numbers = log.removals_of(part.numpy())
            self._append(log, items)
            log.record(part, numbers, removal=True)

    def flush(self) -> None:
        self._check_writable()
        if self._applying is not None:  # the last flush's apply was cut short: apply it again
            self._apply()
        flushes, staging = self.flushes + 1, self._staging

        def commit(txn: lmdb.Transaction) -> None:  # the commit point: the count, and the roles
            txn.put(_FLUSHES_KEY, struct.pack("<Q", flushes), db=self._meta)
            if self._pending_count:
                txn.put(_APPLYING_KEY, bytes([staging]), db=self._meta)
                txn.put(_STAGING_KEY, bytes([1 - staging]), db=self._meta)

        self._write(commit)
        self.flushes = flushes
        if self._pending_count:
            self._applying, self._staging = staging, 1 - staging
        self._sync()
        if self._applying is not None:
            self._apply()
        self._record_as_left()

    def _apply(self) -> None:
        """Copy the log being applied into ``rows`` in its order (an id's newest entry last),
        ``APPLY_ROWS`` entries a transaction, each sorted by id; then empty the log and clear its
        role; then sync."""
        log = self._logs[self._applying]
        start = 0
        while True:

            def move(txn: lmdb.Transaction, start=start) -> int:
                cursor = txn.cursor(log.database)
                if not cursor.set_range(encode_keys(np.array([start], dtype=np.int64))[0]):
                    return 0
                values = [value for _, value in itertools.islice(cursor.iternext(), APPLY_ROWS)]
                try:
                    ids, stored, removal = log.split_entries(values)
                except ValueError:
                    damage = f"{self._data_file} is damaged: it holds malformed staged rows"
                    raise StoreFormatError(damage) from None
                # each id's newest entry of these (later transactions apply later ones), by id
                order = np.argsort(ids, kind="stable")
                newest = order[np.append(ids[order][1:] != ids[order][:-1], True)] if ids.size else order
                kept, gone = newest[~removal[newest]], newest[removal[newest]]
                rows = np.ascontiguousarray(stored[kept]).view(f"V{self.codec.stored_bytes}")
                txn.cursor(self._rows).putmulti(list(zip(encode_keys(ids[kept]), rows.ravel().tolist())))
                for key in encode_keys(ids[gone]):
                    txn.delete(key, db=self._rows)
                return ids.size

            moved = self._write(move)
            if not moved:
                break
            start += moved

        def clear(txn: lmdb.Transaction) -> None:
            txn.drop(log.database, delete=False)
            txn.delete(_APPLYING_KEY, db=self._meta)

        self._write(clear)
        log.clear()
        self._applying = None
        self._sync()

    def _sync(self) -> None:
        try:
            self._env.sync(True)
        except lmdb.Error as error:
            raise self._as_os_error(error) from None

    def last_flush_time(self) -> float | None:
        return (self._path / "data.mdb").stat().st_mtime

    def report(self) -> dict:
        """The base counters; ``index_bytes``: the RAM of the staged rows' indexes (bounded: the
        newest ids in a table, older ones in sealed runs on disk)."""
        return {**super().report(), "index_bytes": sum(log.nbytes for log in self._logs)}

    def structure_problems(self) -> list[str]:
        """Entries of ``rows`` whose key is not 8 bytes or whose value is not ``stored_bytes`` (a
        short value would otherwise fail, or worse, in the row decoder); a log being applied was
        checked when the store opened."""
        try:
            with self._begin() as txn:
                wrong = [
                    (len(key), len(value))
                    for key, value in txn.cursor(self._rows)
                    if len(key) != 8 or len(value) != self.codec.stored_bytes
                ]
        except lmdb.Error as error:
            return [f"the LMDB data in {self._path} is damaged: {error}"]
        problems = [
            f"an LMDB entry has a {key_length}-byte key and a {value_length}-byte value "
            f"(expected 8 and {self.codec.stored_bytes})"
            for key_length, value_length in wrong[:3]
        ]
        if len(wrong) > 3:
            problems.append(f"... {len(wrong)} malformed LMDB entries in all")
        return problems

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        if self._snapshot is not None:
            self._snapshot.abort()
        self._env.close()
        for log in self._logs:
            log.close()
        if not self.read_only:
            self._record_as_left()
        _OPEN_IN_THIS_PROCESS.discard(self._path.resolve())
        self._release_lock()


def _newest_entries(keys: torch.Tensor, logs: list) -> torch.Tensor:
    """Each key's newest entry in ``logs`` (``StageLog``s, oldest first), as ``StageLog.find`` gives
    it (-1: none, below -1: a removal)."""
    newest = torch.full_like(keys, -1)
    for log in logs:
        found = log.find(keys)
        newest = torch.where(found != -1, found, newest)
    return newest


class LmdbSnapshot:
    """The rows of a flushed LMDB store in one read transaction (LMDB's own snapshot): its writer
    goes on committing beside it, and reuses none of the pages it holds until it is closed."""

    def __init__(self, store: LmdbColdStore) -> None:
        self._store = store
        self._txn = store._env.begin()
        self.flushes = store.flushes

    def __len__(self) -> int:
        return self._txn.stat(self._store._rows)["entries"]

    def iter_rows(self, batch_size: int = 65536) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        items = self._txn.cursor(self._store._rows).iternext()
        try:
            while chunk := list(itertools.islice(items, batch_size)):
                yield self._store._decode(chunk)
        except lmdb.Error as error:
            raise self._store._damaged(error) from None

    def close(self) -> None:
        self._txn.abort()
