"""``TieredStore``: the public batched API over the tiers (device cache -> host cache -> cold store).

It validates every argument before anything changes, then hands the work to its ``TierStack``
(``tiers.stack``), which moves rows between tiers through the tier contract.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .errors import ReadOnlyStoreError, StoreClosedError
from .expiry import ExpiryPolicy
from .locking import hold_interrupts, serialized
from .metadata import create_store, dtype_name, resolve_metadata
from .snapshot import StoreSnapshot
from .store_copies import StoreCopies
from .store_pins import StorePins
from .store_removals import StoreRemovals
from .store_training import StoreTraining
from .tiers.build import build_caches, check_backends, open_tiers, rows_by_table
from .tiers.config import TierConfig
from .validation import as_device, as_ids, as_path, as_rows, check_out, integral
from .warm_start import hot_ids

_OPEN_HERE: weakref.WeakValueDictionary[Path, TieredStore] = weakref.WeakValueDictionary()


class TieredStore(StoreTraining, StoreCopies, StorePins, StoreRemovals):
    """A table of rows ``[weights (dim) | optimizer state]`` keyed by any non-negative int64 id.

    Args:
        path: store directory; created if missing or empty. ``None``: a temporary store, deleted
            on ``close()``.
        dim, dtype, backend, optimizer_state_width, seed: the table's layout. Required (``dim``)
            or defaulted (float32, "mmap", 0, 0) for a new store; for an existing store ``None``
            means "as stored" and any other value must match it. Backends: "mmap" (the default:
            the faster, and as safe: checked rows, atomic flushes) keeps an index of its ids in RAM
            (about 54 bytes per id); "lmdb" keeps it on disk: pick LMDB when the ids of a table
            would not fit in RAM that way.
        optimizer: the name of the optimizer whose state the rows hold (``optim.OPTIMIZERS``),
            recorded in a new store and checked against an existing one that recorded one.
        device: where the device cache lives and where ``get`` returns rows.
        read_only: open without writing; ``put``/``flush`` raise, unseen ids are not added. It sees
            one flush, a snapshot, until ``refresh()``, whatever a writer does meanwhile.
        tiers: the cache tiers' budgets and backends (``TierConfig``); its fields may also be
            given as keywords (``host_cache="2GiB"``, ``device_cache=...``, ``host_cache_backend=``,
            ``device_cache_backend=``, ``half_life=``), which replace the ones in ``tiers``.
        warm: a hot-set ranking (a ``.npy`` path as ``tierstore profile --out`` writes, or ids, most
            wanted first) whose rows the table holds are loaded into the cache tiers at open, top
            tier first (``warm_start``); ``warmed_rows`` says how many.
        most_rows: the most distinct ids the table will look up (a bounded table's rows), or None
            (any). No cache tier takes more slots than that, whatever its budget: a small table's
            caches cost what it can hold, and a table that fits its budget is held whole. A list
            gives each table's rows (None: unbounded) for a store of several tables' keys
            (``number << 47 | id``: a collection's group). A host tier addresses the rows of
            bounded tables directly (``tiers.direct_layout``).
        ttl, max_rows: expiring ids (``tierstore.expiry``): at each flush, ids not updated for
            ``ttl`` (an int: optimizer updates of the table; a ``datetime.timedelta``: time) are
            removed, then the oldest past ``max_rows``; an expired id that returns starts from its
            initial row. None (the default): ids stay for good.

    ``get(ids)`` returns ``[N, dim]`` weights (``with_state=True``: whole rows). Ids never seen get
    their initial row (a function of id and seed) and join the table. Duplicate ids are fetched
    once. ``get`` and ``put`` take any number of ids (more distinct ids than the top tier holds go
    through it in parts); a training lookup (``get_distinct``) needs its batch's distinct ids to fit
    the top tier.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        dim: int | None = None,
        dtype: torch.dtype | None = None,
        backend: str | None = None,
        *,
        device: torch.device | str = "cpu",
        optimizer_state_width: int | None = None,
        optimizer: str | None = None,
        seed: int | None = None,
        read_only: bool = False,
        tiers: TierConfig | None = None,
        warm: Any = None,
        most_rows: int | None = None,
        ttl: Any = None,
        max_rows: int | None = None,
        **tier_settings,
    ) -> None:
        self._lock = threading.RLock()
        hold_interrupts()
        self.prefetch_stats = None  # a lookahead pipeline's counters (``tierstore.prefetch``)
        # Everything is checked, and the caches allocated, before anything is created on disk.
        config = TierConfig.from_settings(tiers, tier_settings)
        warm_ids = None if warm is None else hot_ids(warm)
        self.device = as_device(device)
        check_backends(config, self.device, dtype or torch.float32)
        dim, optimizer_state_width, seed = (integral(value) for value in (dim, optimizer_state_width, seed))
        table_rows = rows_by_table(most_rows)
        expiry = ExpiryPolicy.of(ttl, max_rows)
        if expiry is not None and read_only:
            raise ValueError("ttl and max_rows remove ids: open the store writable to expire them")
        requested = {
            "dim": dim,
            "dtype": None if dtype is None else dtype_name(dtype),
            "backend": backend,
            "optimizer_state_width": optimizer_state_width,
            "optimizer": optimizer,
            "seed": seed,
        }
        path = as_path(path)
        self.metadata, new = resolve_metadata(path, requested, read_only)
        caches = build_caches(self.metadata, config, self.device, table_rows)
        self._temporary = path is None
        self.path = Path(tempfile.mkdtemp(prefix="tierstore-")) if path is None else path
        # A temporary store goes when it is closed, collected, or at interpreter exit.
        self._remove_temporary = (
            weakref.finalize(self, shutil.rmtree, self.path, True) if path is None else None
        )
        self.read_only = read_only
        self.config = config
        self.dim = self.metadata.dim
        self.dtype = self.metadata.torch_dtype
        self.row_width = self.metadata.row_width
        existed = self.path.exists()
        if new:
            create_store(self.path, self.metadata)
        try:
            self.stack = open_tiers(self.path, self.metadata, config, caches, read_only, new)  # public
        except BaseException:
            if new:  # leave the directory as it was: absent, or empty
                _remove_contents(self.path, remove_directory=not existed or self._temporary)
            raise
        self._closed = False
        self._expiry_policy = expiry
        try:
            self._expiry = None if read_only else self._open_expiry()
        except BaseException:
            self.stack.cold.close()
            raise
        self._in_flight = None  # the last training lookup's ids (int64), until their update
        self._snapshots: weakref.WeakSet[StoreSnapshot] = weakref.WeakSet()
        _OPEN_HERE[self.path.resolve()] = self
        self.warmed_rows = 0  # rows a warm start preloaded
        if warm_ids is not None:
            try:
                self.preload(warm_ids)
            except BaseException:  # a damaged row, say: the store is not left open
                self.close()
                raise

    @staticmethod
    def open_here(path: str | Path) -> TieredStore | None:
        """The store open at ``path`` in this process, if any: read it through that one, since
        LMDB lets a process open a store's environment only once."""
        store = _OPEN_HERE.get(Path(path).resolve())
        return None if store is None or store._closed else store

    # -- public API --------------------------------------------------------------------------

    @serialized
    def get(
        self, ids: Any, with_state: bool = False, out: torch.Tensor | None = None, grow: bool = True
    ) -> torch.Tensor:
        """Rows of ``ids`` (int64 [N]) -> ``[N, dim]`` (``with_state``: ``[N, row_width]``) on ``device``.

        ``out``: a preallocated tensor of that shape, dtype and device to gather into (saves
        allocating and page-faulting a fresh output per batch); it is returned.
        ``grow=False``: ids the table does not hold get their initial row but do not join it
        (for evaluation); a read-only store never grows.
        """
        self._check_open()
        ids = as_ids(ids)
        width = self.row_width if with_state else self.dim
        if out is not None:
            check_out(out, (ids.numel(), width), self.dtype, self.device)
        top = self.stack.top
        slots = top.find(ids)
        if bool((slots >= 0).all()):  # hit path: no unique, no movement
            top.touch(slots)
        else:
            unique, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
            growing = grow and not self.read_only
            if not growing or unique.numel() > top.max_capacity:  # more ids than the top tier holds: in parts
                parts = zip(unique.split(top.max_capacity), counts.split(top.max_capacity))
                rows = torch.cat(
                    [self._rows_of_distinct(part, count, width, growing) for part, count in parts]
                )
                rows = rows[inverse.to(rows.device)]
                return rows if out is None else out.copy_(rows)
            slots = self.stack.make_resident(unique, counts)[inverse.to(top.device)]
        if out is None or top.device != self.device:
            rows = top.read(slots, width).to(self.device)
            return rows if out is None else out.copy_(rows)
        return top.read(slots, width, out=out)

    def _rows_of_distinct(
        self, unique: torch.Tensor, counts: torch.Tensor, width: int, grow: bool
    ) -> torch.Tensor:
        """``[U, width]`` rows on ``device`` of at most a top tier's worth of distinct ids."""
        if not grow:
            return self.stack.rows_without_growing(unique, counts, width, self.device)
        return self.stack.top.read(self.stack.make_resident(unique, counts), width).to(self.device)

    @serialized
    def put(self, ids: Any, rows: Any, allow_nonfinite: bool = False) -> None:
        """Overwrite the weights (``rows [N, dim]``) or whole rows (``[N, row_width]``) of ``ids``.

        For a repeated id the last row wins. Optimizer state is kept when only weights are given.
        Rows holding NaN or Inf are refused unless ``allow_nonfinite``. Everything is checked before
        anything changes.
        """
        self._check_writable("put")
        ids = as_ids(ids)
        rows = self._checked_rows(ids, rows, allow_nonfinite)
        unique, counts, last = _distinct_with_last(ids)
        top = self.stack.top
        for start in range(0, unique.numel(), top.max_capacity):  # more ids than the top tier holds: in parts
            part = slice(start, start + top.max_capacity)
            slots = self.stack.make_resident(unique[part], counts[part])
            top.write(slots, rows[last[part]], rows.shape[1])

    def _checked_rows(self, ids: torch.Tensor, rows: Any, allow_nonfinite: bool) -> torch.Tensor:
        """``rows`` for ``ids`` checked (``as_rows``): weights ``[N, dim]`` or whole rows ``[N, row_width]``
        of the store's dtype, finite (whole rows' state read as stored) unless ``allow_nonfinite``."""
        return as_rows(
            rows,
            ids.numel(),
            (self.dim, self.row_width),
            self.dtype,
            allow_nonfinite=allow_nonfinite,
            state=self.metadata.optimizer_state_width,
        )

    @serialized
    def load(self, ids: Any, rows: Any, allow_nonfinite: bool = False, chunk_rows: int = 1 << 18) -> None:
        """Write the weights (``rows [N, dim]``: optimizer state kept, zero for new ids) or whole rows
        (``[N, row_width]``) of any number of ``ids`` straight into the cold store, bypassing the
        caches (cached copies are dropped): the bulk form of ``put``, for loading trained weights.

        For a repeated id the last row wins. Everything is checked before anything changes. The
        store is flushed first, then the rows go in ``chunk_rows`` at a time and are durable when
        ``load`` returns; a crash during it leaves the store at a committed state (its last flush,
        plus chunks of rows it already held that were committed).
        """
        self._check_writable("load")
        ids = as_ids(ids)
        rows = self._checked_rows(ids, rows, allow_nonfinite)
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows <= 0:
            raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
        in_order = bool((ids[1:] > ids[:-1]).all())  # distinct and ascending (an arange): no gather
        unique, _, last = (ids, None, None) if in_order else _distinct_with_last(ids)
        self.flush()
        for start in range(0, unique.numel(), chunk_rows):
            part = slice(start, start + chunk_rows)
            self.stack.load(unique[part], rows[part] if last is None else rows[last[part]])
            if self._expiry is not None:
                self._expiry.record(unique[part])
        self.stack.cold.flush()

    @serialized
    def refresh(self) -> None:
        """Move a read-only store to the newest completed flush. A read-only store sees one flush
        (a snapshot, whatever a writer does meanwhile) from its open until ``refresh``; a writable
        store always sees its own newest rows, so this does nothing there."""
        self._check_open()
        self.stack.refresh()

    def release_unflushed(self) -> None:
        """Close without flushing, discarding updates since the last flush: for a store opened only
        to be refused (its owner found it inconsistent with others), so that refusing writes nothing."""
        if not self._closed:
            self.stack.cold.close()
            if self._expiry is not None:
                self._expiry.close()
            self._closed = True
            if self._remove_temporary is not None:
                self._remove_temporary()

    @serialized
    def close(self) -> None:
        """Flush (unless read-only) and release the store; a temporary store is deleted."""
        if self._closed:
            return
        try:
            if not self.read_only and not self._temporary:
                self.flush()
        finally:
            for snapshot in list(self._snapshots):
                snapshot.close()
            self.stack.cold.close()
            if self._expiry is not None:
                self._expiry.close()
            self._closed = True
            if self._remove_temporary is not None:
                self._remove_temporary()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    @property
    def temporary(self) -> bool:
        """Whether the store was made without ``path`` (and is deleted when closed or collected)."""
        return self._temporary

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @serialized
    def __len__(self) -> int:
        """Distinct ids in the table (every id ever read or written, unless read-only)."""
        self._check_open()
        return len(self.stack)

    def __contains__(self, id_: int) -> bool:
        return bool(self.contains(id_)[0])

    @serialized
    def contains(self, ids: Any) -> torch.Tensor:
        """bool [N]: which ``ids`` the table holds (without adding them)."""
        self._check_open()
        ids = as_ids(ids)
        unique, inverse = torch.unique(ids, return_inverse=True)
        return self.stack.contains(unique)[inverse]

    def iter_rows(
        self, batch_size: int = 65536, with_state: bool = False
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every ``(ids [n], rows [n, dim or row_width])`` in the table, newest values, on CPU."""
        self._check_open()
        return self.stack.iter_rows(batch_size, self.row_width if with_state else self.dim)

    @serialized
    def stats(self) -> dict:
        """Counters per tier ("device", "host", "cold"): lookups served (hits), misses, rows and bytes
        moved, evictions; each cache tier's capacity, residency, memory and backend.

        ``hits`` and ``misses`` count id lookups (a repeated id counts each time); every lookup is
        a hit in exactly one tier, so hit counts add up to the ids looked up. The cold tier's
        ``initialized`` counts lookups of ids never seen before. Once a lookahead pipeline
        (``tierstore.prefetch``) has run on the store, ``"prefetch"`` holds the last one's counters.
        """
        report = self.stack.report()
        if self.prefetch_stats is not None:
            report["prefetch"] = dict(vars(self.prefetch_stats))
        return report

    def structure_problems(self) -> list[str]:
        """What is malformed in the cold store's committed data, found without decoding rows."""
        return self.stack.cold.structure_problems()

    def last_flush_time(self) -> float | None:
        """When the last flush committed (seconds since the epoch), None if never."""
        return self.stack.cold.last_flush_time()

    @property
    def flushes(self) -> int:
        """Flushes completed since the store was made (a reader: as of its snapshot); committed
        atomically with each flush's rows, so stores flushed together can be checked to agree."""
        return self.stack.cold.flushes

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.path} is closed")

    def _check_writable(self, action: str) -> None:
        self._check_open()
        if self.read_only:
            raise ReadOnlyStoreError(
                f"store {self.path} was opened with read_only=True; reopen it writable to {action}"
            )


def _distinct_with_last(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(distinct ids [U], how often each occurs [U], the position of its last occurrence [U])``."""
    unique, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    last = torch.zeros(unique.numel(), dtype=torch.int64).scatter_reduce_(
        0, inverse, torch.arange(ids.numel()), reduce="amax"
    )
    return unique, counts, last


def _remove_contents(path: Path, remove_directory: bool) -> None:
    if remove_directory:
        shutil.rmtree(path, ignore_errors=True)
        return
    for child in path.iterdir():
        shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
