"""Reads of an LMDB cold store: keys sorted and read in one transaction or, when the disk is the
bound, in contiguous ranges on a thread pool; every row checked, an absent key confirmed by its
neighbours (``LmdbColdStore``'s part)."""

from __future__ import annotations

import contextlib
import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import lmdb
import numpy as np
import torch

from ...errors import StoreFormatError
from .codec import decode_keys, encode_keys
from .lmdb_layout import DISK_BOUND_SECONDS_PER_KEY, MIN_KEYS_PER_THREAD
from .lmdb_staging import StageLog


class LmdbReads:
    """``LmdbColdStore``'s reads."""

    def _values(
        self, encoded: list[bytes], database, txn: lmdb.Transaction | None, value_bytes: int
    ) -> tuple[np.ndarray, bytes]:
        """``(sizes, values)``: the stored value's size of each key in ``encoded`` (sorted), 0 where
        absent, and the values of the keys found, joined in order. Read in ``txn``, or in parallel
        transactions when ``txn`` is None and the reads wait on the disk. Values are checked to be
        ``value_bytes`` long before they are copied out of the map (a damaged length could
        reach past the end of the file)."""

        def read_range(txn: lmdb.Transaction, part: list[bytes]) -> tuple[np.ndarray, bytes]:
            values = list(map(txn.get, part, itertools.repeat(b""), itertools.repeat(database)))
            sizes = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
            if bool(((sizes != 0) & (sizes != value_bytes)).any()):
                raise StoreFormatError(
                    f"{self._data_file} is damaged: it holds rows that are not {self.codec.stored_bytes} "
                    f"bytes (or the store's metadata, dim and dtype, does not describe it)"
                )
            return sizes, b"".join(values)

        if txn is not None:
            return read_range(txn, encoded)
        threads = min(self._read_threads, len(encoded) // MIN_KEYS_PER_THREAD)
        if threads < 2:  # too small to split, or to time fairly
            with self._begin() as txn:
                return read_range(txn, encoded)
        start = time.perf_counter()
        if self._seconds_per_key < DISK_BOUND_SECONDS_PER_KEY:
            with self._begin() as txn:
                sizes, values = read_range(txn, encoded)
        else:

            def read_own_transaction(bounds: tuple[int, int]) -> tuple[np.ndarray, bytes]:
                with self._begin() as txn:
                    return read_range(txn, encoded[bounds[0] : bounds[1]])

            edges = np.linspace(0, len(encoded), threads + 1).astype(int).tolist()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._read_threads, thread_name_prefix="lmdb-read")
            parts = list(self._pool.map(read_own_transaction, zip(edges[:-1], edges[1:])))
            sizes = np.concatenate([part[0] for part in parts])
            values = b"".join(part[1] for part in parts)
            self.parallel_reads += 1
        per_key = (time.perf_counter() - start) / len(encoded)
        self._seconds_per_key = (
            per_key if self._seconds_per_key == float("inf") else 0.5 * (self._seconds_per_key + per_key)
        )
        return sizes, values

    def _begin(self):
        """A read transaction: a reader's snapshot, or a new one (as a context manager). Its values
        are copied out as bytes: py-lmdb's views into the map (``buffers=True``) cost 4-20x more
        per value than the copy they save."""
        if self._snapshot is not None:
            return contextlib.nullcontext(self._snapshot)
        return self._env.begin()

    def _refresh(self) -> None:
        self._snapshot.abort()
        self._snapshot = self._env.begin()
        for log in self._logs:
            log.close()
        self._read_state()

    def _read(
        self, txn: lmdb.Transaction | None, keys: torch.Tensor, databases: list
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, found)`` for ``keys`` from ``databases`` in order (``rows``, then ``StageLog``s:
        a later one wins, its removals too); read in ``txn``, or in fresh transactions (in parallel
        when disk-bound) when it is None. Every row is checked; a key absent from ``rows`` is
        confirmed absent by checking the entries beside it (``_check_neighbours``), so a damaged page
        is an error, not a silently new row."""
        rows = torch.empty(keys.numel(), self.row_width, dtype=self.dtype)
        found = torch.zeros(keys.numel(), dtype=torch.bool)
        if keys.numel() == 0:
            return rows, found
        txn = self._snapshot if txn is None else txn  # a reader reads its snapshot, on one thread
        try:
            for database in databases:
                if database is self._rows:
                    where, ids, stored = self._read_rows(txn, keys)
                else:
                    numbers = database.find(keys)
                    found[numbers < -1] = False  # removed by this log
                    where, ids, stored = self._read_log(txn, keys, database, numbers)
                if where.numel():
                    rows[where] = self.codec.decode(ids, stored, self._data_file)
                    found[where] = True
        except lmdb.Error as error:
            raise self._damaged(error) from None
        return rows, found

    def _read_rows(self, txn, keys: torch.Tensor) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """``(positions in keys, their ids, their stored rows [n, stored_bytes])`` of the keys
        ``rows`` holds, read in id order."""
        key_array = keys.numpy()
        order = np.argsort(key_array, kind="stable")
        sorted_keys = key_array[order]
        encoded = encode_keys(sorted_keys)
        sizes, values = self._values(encoded, self._rows, txn, self.codec.stored_bytes)
        hit = sizes > 0
        if not hit.all():
            self._check_neighbours(txn, [key for key, held in zip(encoded, hit.tolist()) if not held])
        stored = np.frombuffer(values, dtype=np.uint8).reshape(int(hit.sum()), self.codec.stored_bytes)
        return torch.from_numpy(order[hit]), sorted_keys[hit], stored

    def _read_log(
        self, txn, keys: torch.Tensor, log: StageLog, numbers: torch.Tensor
    ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """``_read_rows`` of the keys ``log`` stages (``numbers``: its ``find`` of them; their newest
        entries, read in log order); an entry missing or holding another id is damage."""
        where = torch.nonzero(numbers >= 0).squeeze(1)
        if where.numel() == 0:
            return where, np.empty(0, dtype=np.int64), np.empty((0, self.codec.stored_bytes), np.uint8)
        where = where[torch.argsort(numbers[where])]
        return where, *self._staged_rows(txn, log, keys[where], numbers[where])

    def _staged_rows(
        self, txn, log: StageLog, keys: torch.Tensor, numbers: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, stored rows [n, stored_bytes])`` of ``log``'s entries ``numbers``, which its index
        gives for ``keys``: an entry missing or holding another id is damage."""
        _, values = self._values(encode_keys(numbers.numpy()), log.database, txn, log.entry_bytes)
        ids, stored = log.split(values)
        if ids.size != keys.numel() or not np.array_equal(ids, keys.numpy()):
            raise StoreFormatError(f"{self._data_file} is damaged: its staged rows do not match their index")
        return ids, stored

    def _check_neighbours(self, txn: lmdb.Transaction | None, absent: list[bytes]) -> None:
        """Check the committed entries on either side of each of the ``absent`` keys (sorted): a
        page damaged where a key should be yields a neighbour that fails its check, or is on the
        wrong side of it."""
        if not absent:
            return
        with contextlib.ExitStack() as stack:
            if txn is None:
                txn = stack.enter_context(self._begin())
            cursor = txn.cursor(self._rows)

            def item() -> tuple[bytes, bytes]:
                key, value = cursor.key(), cursor.value()  # views into the map: lengths checked
                if len(key) != 8 or len(value) != self.codec.stored_bytes:  # before a copy reads them
                    raise StoreFormatError(f"{self._data_file} is damaged: it holds malformed entries")
                return bytes(key), bytes(value)

            def neighbours(key: bytes) -> tuple[bytes, tuple | None, tuple | None]:
                after = item() if cursor.set_range(key) else None
                before = item() if (cursor.prev() if after else cursor.last()) else None
                return key, before, after

            found = list(map(neighbours, absent))
        if any(before and before[0] > key for key, before, _ in found) or any(
            after and after[0] < key for key, _, after in found
        ):
            raise StoreFormatError(f"{self._data_file} is damaged: its entries are out of order")
        entries = dict(entry for _, *pair in found for entry in pair if entry)  # each neighbour once
        if entries:
            self._checked_rows(decode_keys(list(entries)), list(entries.values()))

    def _checked_rows(self, ids: np.ndarray, values: list) -> torch.Tensor:
        """Rows ``[n, row_width]`` of ``ids`` from their stored ``values`` (bytes or map views),
        each checked; a value of the wrong length is ``StoreFormatError``."""
        if any(len(value) != self.codec.stored_bytes for value in values):
            raise StoreFormatError(f"{self._data_file} is damaged: it holds malformed entries")
        stored = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), self.codec.stored_bytes)
        return self.codec.decode(ids, stored, self._data_file)

    def _damaged(self, error: lmdb.Error) -> StoreFormatError:
        return StoreFormatError(
            f"{self._data_file} is damaged (LMDB: {error}); restore the store from a backup, or export "
            f"what still reads and re-import it"
        )

    def _databases(self) -> list:
        """What a read reads, a later one's rows overriding an earlier one's: ``rows``, the log of
        the flush being applied, the staging log."""
        databases = [self._rows]
        if self._applying_count:
            databases.append(self._logs[self._applying])
        if self._pending_count:
            databases.append(self._logs[self._staging])
        for log in databases[1:]:
            self._indexed(log)
        return databases

    def _indexed(self, log):
        """``log`` with every entry in its index: a flush's own rows are staged without it, and read
        (or staged over) only when that flush failed to commit."""
        if not log.indexed:
            with self._begin() as txn:
                self._load(txn, log)
        return log

    def _get(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._read(None, keys, self._databases())
