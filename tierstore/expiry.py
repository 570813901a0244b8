"""Expiring ids: a table that caps its rows (``max_rows``) or forgets ids not trained for a while (``ttl``).

Each id's last update is recorded at flush granularity in a side store (``expiry/`` in the store's
directory: an mmap cold store of ``[update count, unix seconds]`` per id). The ids a flush commits
(trained, or evicted dirty, since the previous flush; loaded with ``load``) get the store's update
count and the time of that flush, committed just before it (a kill between the two leaves records
newer than the rows), so an id's record is never older than its last update. After the
flush commits, the ids whose record is ``ttl`` old (an int: the store's optimizer updates; a
``timedelta``: time) are removed; then, past ``max_rows``, the oldest (the lowest update count
recorded, then the earliest time, then the smallest id) until ``max_rows`` remain. The removals
commit in flushes of their own, ``COMMIT_IDS`` ids each (the logs' indexes hold a commit's ids in
RAM, so a store far larger than memory expires its ids in bounded memory). Never removed: ids
whose rows are pinned for batches in flight (a lookahead pipeline) and the ids of the last training
lookup whose update has not come yet. An id removed and looked up again starts from its initial
row.

The record is advisory: a store opened without expiry drops it (its ids' updates would go unrecorded),
and a store whose ids and records differ (a first open with expiry, a restored checkpoint) records
its unrecorded ids as of the flush that finds them.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .metadata import write_json_atomic
from .tiers.cold.mmap_store import MmapColdStore

EXPIRY_DIRECTORY = "expiry"
CLOCK_FILE = "clock.json"  # the store's update count as of its last flush with expiry
SCAN_ROWS = 1 << 16  # records read at once by an expiry scan
COMMIT_IDS = 1 << 18  # ids recorded or removed in one commit (the logs' indexes hold them in RAM)


@dataclass(frozen=True)
class ExpiryPolicy:
    """When ids go: ``ttl`` (int: optimizer updates of the table; ``timedelta``: time) since an id's
    last update, and ``max_rows`` (the most ids the table keeps after a flush). None: no limit."""

    ttl: int | timedelta | None = None
    max_rows: int | None = None

    @staticmethod
    def of(ttl: Any, max_rows: Any) -> ExpiryPolicy | None:
        """The policy of ``ttl`` and ``max_rows`` (None when both are), checked."""
        if isinstance(ttl, (np.integer,)):
            ttl = int(ttl)
        if isinstance(max_rows, np.integer):
            max_rows = int(max_rows)
        if ttl is not None and not (
            (isinstance(ttl, int) and not isinstance(ttl, bool) and ttl > 0)
            or (isinstance(ttl, timedelta) and ttl > timedelta(0))
        ):
            raise ValueError(
                f"ttl must be a positive int (optimizer updates of the table) or a positive "
                f"datetime.timedelta (time), or None (ids never expire), got {ttl!r}"
            )
        if max_rows is not None and (
            isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1
        ):
            raise ValueError(f"max_rows must be a positive int (ids kept) or None (no cap), got {max_rows!r}")
        return None if ttl is None and max_rows is None else ExpiryPolicy(ttl, max_rows)

    def expired(self, records: torch.Tensor, updates: int, now: float) -> torch.Tensor:
        """bool [N]: which ``[N, 2]`` records (update count, seconds) are ``ttl`` old."""
        if isinstance(self.ttl, int):
            return records[:, 0] <= updates - self.ttl
        if isinstance(self.ttl, timedelta):
            return records[:, 1] <= now - self.ttl.total_seconds()
        return torch.zeros(records.shape[0], dtype=torch.bool)


class IdExpiry:
    """A writable store's expiry: the side store of its ids' last updates and the removals."""

    def __init__(self, directory: Path, policy: ExpiryPolicy, index_kernels) -> None:
        self.policy = policy
        self.directory = Path(directory) / EXPIRY_DIRECTORY
        self.directory.mkdir(exist_ok=True)
        self.records = MmapColdStore(self.directory, 2, torch.float64, index_kernels=index_kernels)
        clock = self.directory / CLOCK_FILE
        self.updates = json.loads(clock.read_text())["updates"] if clock.exists() else 0

    @staticmethod
    def drop(directory: Path) -> None:
        """Delete the side store of a store opened without expiry (its records would go stale)."""
        shutil.rmtree(Path(directory) / EXPIRY_DIRECTORY, ignore_errors=True)

    def record(self, keys: torch.Tensor, now: float | None = None, commit: bool = False) -> None:
        """Record ``keys`` (int64 CPU, distinct) as updated now; ``commit``: durably (before the
        store's flush that writes their rows: a kill between the two leaves records newer than the
        rows, never older). The update count is committed after that flush (``expire``), so steps a
        kill undid, run again, are not counted twice."""
        if keys.numel():
            now = time.time() if now is None else now
            stamp = torch.tensor([float(self.updates), now], dtype=torch.float64)
            self.records.put(keys, stamp.expand(keys.numel(), 2).contiguous())
        if commit:
            self.records.flush()

    def _commit(self) -> None:
        """The records and the update count, durably (after the store's flush)."""
        self.records.flush()
        write_json_atomic(self.directory / CLOCK_FILE, {"updates": self.updates})

    def expire(self, store, protected: torch.Tensor) -> int:
        """After ``store``'s flush: remove the expired ids but ``protected`` ones (int64 CPU), and
        commit the removals; returns how many went."""
        now = time.time()
        cold = store.stack.cold
        if len(self.records) != len(cold):
            self._reconcile(cold, now)
        going = self._expired(len(cold), now)
        going = going[~torch.isin(going, torch.cat([protected, store.stack.pinned_keys(going)]))]
        for part in going.split(COMMIT_IDS):
            store.stack.remove(part)
            self.records.remove(part)
            cold.flush()
            self.records.flush()
        self._commit()
        return going.numel()

    def _reconcile(self, cold, now: float) -> None:
        """Record the cold store's unrecorded ids as of now and forget records of ids it no longer holds."""
        recorded = 0
        for keys, _ in cold.iter_rows(SCAN_ROWS):
            unrecorded = keys[~self.records.contains(keys)]
            recorded += unrecorded.numel()
            self.record(unrecorded, now, commit=recorded >= COMMIT_IDS)  # committed now and then
            recorded = 0 if recorded >= COMMIT_IDS else recorded
        # the records' own scan first, then their removal: they do not change under it
        gone = [keys[~cold.contains(keys)] for keys, _ in self.records.iter_rows(SCAN_ROWS)]
        for part in torch.cat([*gone, torch.zeros(0, dtype=torch.int64)]).split(COMMIT_IDS):
            self.records.remove(part)
            self.records.flush()

    def _expired(self, held: int, now: float) -> torch.Tensor:
        """The ids to remove (int64, distinct) of a table holding ``held`` ids: ``ttl`` old, then the
        oldest past ``max_rows`` (two scans: the count of each record, then the ids)."""
        policy = self.policy
        counts: Counter = Counter()
        expired_count = 0
        for _, records in self.records.iter_rows(SCAN_ROWS) if policy.max_rows is not None else ():
            old = policy.expired(records, self.updates, now)
            expired_count += int(old.sum())
            counts.update(_stamp_counts(records[~old].numpy()))
        excess = 0 if policy.max_rows is None else held - expired_count - policy.max_rows
        cutoff, at_cutoff = None, 0  # past max_rows: every record older than cutoff, and at_cutoff at it
        for stamp in sorted(counts):
            if excess <= 0:
                break
            cutoff, at_cutoff = stamp, min(excess, counts[stamp])
            excess -= counts[stamp]
        if policy.ttl is None and cutoff is None:  # nothing past max_rows, and no ttl: no second scan
            return torch.zeros(0, dtype=torch.int64)
        going, tied = [], []
        cutoff_row = None if cutoff is None else torch.tensor(cutoff, dtype=torch.float64)
        for keys, records in self.records.iter_rows(SCAN_ROWS):
            old = policy.expired(records, self.updates, now)
            if cutoff_row is not None:
                older = (records[:, 0] < cutoff_row[0]) | (
                    (records[:, 0] == cutoff_row[0]) & (records[:, 1] < cutoff_row[1])
                )
                old |= older
                tied.append(keys[~old & (records == cutoff_row).all(dim=1)])
            going.append(keys[old])
        if tied:
            going.append(_smallest(torch.cat(tied), at_cutoff))
        return torch.cat([*going, torch.zeros(0, dtype=torch.int64)])

    def close(self) -> None:
        self.records.close()


def _smallest(ids: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` smallest of ``ids`` (int64, distinct), in no order, partitioned in place (a
    sort would take as much memory again, for its indices)."""
    if count >= ids.numel():
        return ids
    values = ids.numpy()
    values.partition(count - 1)
    return ids[:count]


def _stamp_counts(records: np.ndarray) -> dict:
    """``{(update count, seconds): how many of records [N, 2] hold it}``."""
    if not len(records):
        return {}
    ordered = records[np.lexsort((records[:, 1], records[:, 0]))]
    starts = np.flatnonzero(np.append(True, (ordered[1:] != ordered[:-1]).any(axis=1)))
    counts = np.diff(np.append(starts, len(ordered)))
    return dict(zip(map(tuple, ordered[starts].tolist()), counts.tolist()))
