"""The cold tier's contract: what every cold-store backend keeps.

Writes are staged: ``put`` makes rows visible to this process's ``get`` at once, and ``flush``
makes every staged row durable in one atomic step. After a crash or kill at any moment, reopening
yields exactly the state of the last completed ``flush`` (staged rows are discarded).
Keys in one call must be distinct non-negative int64 ids (the tiers above guarantee this).
A backend implements ``_get``/``_put`` and the abstract methods; the base counts the tier's stats.
"""

from __future__ import annotations

import fcntl
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch

from ...errors import ReadOnlyStoreError, StoreBusyError
from ..contract import ColdStats
from .codec import RowCodec

LOCK_FILE = "lock"


class WriterLock:
    """An exclusive ``flock`` on ``directory/lock``, held while a store is open for writing: one
    writer at a time on every backend (readers stay allowed). The OS drops it when the process dies."""

    def __init__(self, directory: Path) -> None:
        self._file = open(Path(directory) / LOCK_FILE, "a")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise StoreBusyError(
                f"store {directory} is already open for writing (in another process, or by another "
                f"TieredStore in this one); close that one first, or open this one with read_only=True"
            ) from None

    def release(self) -> None:
        if not self._file.closed:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()


class ColdSnapshot(Protocol):
    """One flush of a cold store, read while its writer goes on (``ColdStore.snapshot``)."""

    flushes: int

    def iter_rows(self, batch_size: int = 65536) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...

    def __len__(self) -> int: ...

    def close(self) -> None: ...


class ColdStore(ABC):
    """Durable map ``int64 id -> row [row_width]`` of ``dtype``, read and written in batches."""

    def __init__(
        self,
        directory: Path,
        row_width: int,
        dtype: torch.dtype,
        read_only: bool,
        create: bool,
        checksums: bool = True,
    ) -> None:
        """Takes the writer lock (unless ``read_only``); a backend then opens its files through
        ``_open_locked``. ``create``: the files may be created (a new store). ``checksums``: stored
        rows carry a check (``codec.RowCodec``; stores of format version 1 have none)."""
        self.directory = Path(directory)
        self.row_width = row_width
        self.dtype = dtype
        self.row_bytes = row_width * dtype.itemsize
        self.codec = RowCodec(row_width, dtype, checksums)
        self.read_only = read_only
        self._create = create
        self.stats = ColdStats()
        self.flushes = 0  # flushes completed, as durable as the rows (a backend reads it at open)
        self._lock = None if read_only else WriterLock(self.directory)

    def _open_locked(self, open_files) -> None:
        """Run ``open_files()``; if it raises, release the writer lock before passing the error on."""
        try:
            open_files()
        except BaseException:
            self._release_lock()
            raise

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def get(
        self, keys: torch.Tensor, counts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``keys`` (int64 [N], distinct) -> ``(rows [N, row_width], found bool [N])``,
        counting ``counts [N]`` lookups of each (default one). Rows of keys not found are
        unspecified (the caller initialises them)."""
        rows, found = self._get(keys)
        self.stats.rows_read += keys.numel()
        held = found.numpy()  # counted on one thread: a batch's misses are too few for a team
        if counts is None:
            hits, lookups = int(held.sum()), keys.numel()
        else:
            looked_up = counts.cpu().numpy()
            hits, lookups = int(looked_up[held].sum()), int(looked_up.sum())
        self.stats.hits += hits
        self.stats.initialized += lookups - hits
        return rows, found

    def put(self, keys: torch.Tensor, rows: torch.Tensor, before_flush: bool = False) -> None:
        """Stage ``rows [N, row_width]`` for ``keys`` (distinct); durable after ``flush``.
        ``before_flush``: a flush's own staging (the caller flushes next and keeps these rows' newest
        values until then), so the store may leave out what only a read before that flush needs."""
        self._check_writable()
        if keys.numel() == 0:
            return
        self._put(keys, rows, before_flush)
        self.stats.rows_written += keys.numel()

    def remove(self, keys: torch.Tensor) -> int:
        """Remove ``keys`` (distinct; those not held are left alone): reads find them no more at
        once, and the removal is durable after ``flush``, as a ``put`` is. Returns how many were held."""
        self._check_writable()
        held = keys[self.contains(keys)] if keys.numel() else keys
        if held.numel():
            self._remove(held)
            self.stats.rows_removed += held.numel()
        return held.numel()

    @abstractmethod
    def staged_keys(self) -> torch.Tensor:
        """The ids (int64, distinct) whose rows were staged since the last flush (removals left out)."""

    def admits_into(self, tier) -> bool:
        """Whether ``make_resident_in`` serves ``tier`` (a cache tier whose ``native_arrays`` and
        ``native_choice`` it takes)."""
        return False

    def make_resident_in(
        self, tier, keys: torch.Tensor, counts: torch.Tensor, protected: torch.Tensor | None, initial
    ) -> torch.Tensor:
        """One native call (where ``admits_into(tier)``): ``keys`` (int64 [N], distinct, each looked up
        ``counts`` times) made resident in ``tier``, the top and only cache tier, as ``resolve``,
        ``admit`` and this store's ``get`` and ``put`` would (the same slots, rows, scores and
        counters): the misses' rows read (or initialised as ``initial``, a
        ``kernels.native_types.InitialRows``: then dirty and fresh) straight into the slots of the
        policy's victims outside the hits and ``protected`` (int64 slots, or None), the dirty
        victims staged here. Returns the keys' slots (int64 [N]). Too few evictable slots, a damaged
        row or a failed write raise, the rows staying where they were."""
        raise NotImplementedError(f"{type(self).__name__} does not admit rows into a cache tier")

    def lookup_bags_in(self, tier, ids: torch.Tensor, padding: int | None, bags, initial) -> tuple:
        """A training lookup in one native call (where ``admits_into(tier)``): the distinct ``ids``
        (int64 CPU, validated; entries equal to ``padding`` left out) made resident as
        ``make_resident_in`` makes them, the tier's shadow caches replaying them, and ``bags`` (a
        ``kernels.native_types.Bags``) pooled from the rows where they lie. Returns ``(Distinct of
        ids, their slots int64 [U], (pooled, each entry's bag, its gradient scale))``, the last two
        None where each entry is a bag of its own (as ``StepPasses.pooled``); more distinct ids
        than the tier holds raise ``CacheCapacityError`` before any change."""
        raise NotImplementedError(f"{type(self).__name__} does not admit rows into a cache tier")

    def contains(self, keys: torch.Tensor) -> torch.Tensor:
        """bool [N]: which ``keys`` (distinct) the store holds. Counts nothing."""
        return self._get(keys)[1]

    def can_bulk_load(self) -> bool:
        """Whether ``bulk_load`` may be called now (with keys the store does not hold) and is
        faster than ``put``: a backend with its own bulk path says so."""
        return False

    def bulk_load(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Add rows of ``keys`` (distinct, none held yet) in bulk, as an import does: at least as
        durable as ``put`` (a backend may write them straight to their place; ``flush`` commits)."""
        self.put(keys, rows)
        self.flush()  # bounded staging memory

    def refresh(self) -> None:
        """Move a read-only store to the newest completed flush. A reader sees one flush (a
        snapshot) from its open until ``refresh``; a writer always sees its own newest rows."""
        if self.read_only:
            self._refresh()

    def structure_problems(self) -> list[str]:
        """What is malformed in the committed data (empty: sound), found without decoding rows.
        Backends whose opening already checks their structure find nothing more here."""
        return []

    def report(self) -> dict:
        """``stats`` with bytes read and written, as plain values."""
        counters = dict(vars(self.stats))
        counters.update(
            bytes_read=self.stats.rows_read * self.row_bytes,
            bytes_written=self.stats.rows_written * self.row_bytes,
        )
        return counters

    @abstractmethod
    def _get(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``get`` without counting."""

    @abstractmethod
    def _put(self, keys: torch.Tensor, rows: torch.Tensor, before_flush: bool) -> None:
        """``put`` of a non-empty batch on a writable store, without counting."""

    @abstractmethod
    def _remove(self, keys: torch.Tensor) -> None:
        """``remove`` of a non-empty batch of held keys on a writable store, without counting."""

    @abstractmethod
    def _refresh(self) -> None:
        """``refresh`` of a read-only store."""

    @abstractmethod
    def iter_rows(self, batch_size: int = 65536) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every ``(keys [n], rows [n, row_width])`` the store holds (staged rows included)."""

    @abstractmethod
    def snapshot(self) -> ColdSnapshot:
        """The committed rows as of the last completed flush, as a reader opened now sees them, on a
        writable store with nothing staged: readable from another thread (``iter_rows``, ``len``)
        while this store goes on being written, until the snapshot is closed."""

    @abstractmethod
    def __len__(self) -> int:
        """Distinct keys held, staged ones included."""

    @abstractmethod
    def flush(self) -> None:
        """Make every staged row durable, atomically."""

    @abstractmethod
    def last_flush_time(self) -> float | None:
        """When the last flush committed (seconds since the epoch), None if never."""

    @abstractmethod
    def close(self) -> None:
        """Release files; staged rows not flushed are discarded."""

    def _check_writable(self) -> None:
        if self.read_only:
            raise ReadOnlyStoreError(
                "this store was opened with read_only=True; reopen it writable to change it"
            )
