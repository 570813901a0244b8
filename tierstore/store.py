"""``TieredStore``: the public batched API over the tiers (device cache -> host cache -> cold store).

It validates every argument before anything changes, then hands the work to its ``TierStack``
(``tiers.stack``), which moves rows between tiers through the tier contract.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from .directories import exchange
from .errors import ReadOnlyStoreError, StoreClosedError
from .metadata import create_store, dtype_name, resolve_metadata
from .optim import SparseOptimizer
from .snapshot import StoreSnapshot
from .tiers.build import build_caches, check_backends, open_cold, open_tiers
from .tiers.config import TierConfig
from .validation import as_device, as_ids, as_path, as_rows, check_out, integral
from .warm_start import hot_ids, warm_caches

_OPEN_HERE: weakref.WeakValueDictionary[Path, TieredStore] = weakref.WeakValueDictionary()


def _serialized(method):
    """``method`` run holding the store's lock: a lookahead pipeline's worker moves rows between
    the tiers while the training loop reads and updates them."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class TieredStore:
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
            caches cost what it can hold, and a table that fits its budget is held whole.

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
        **tier_settings,
    ) -> None:
        self._lock = threading.RLock()
        self.prefetch_stats = None  # a lookahead pipeline's counters (``tierstore.prefetch``)
        # Everything is checked, and the caches allocated, before anything is created on disk.
        config = TierConfig.from_settings(tiers, tier_settings)
        warm_ids = None if warm is None else hot_ids(warm)
        self.device = as_device(device)
        check_backends(config, self.device, dtype or torch.float32)
        dim, optimizer_state_width, seed = (integral(value) for value in (dim, optimizer_state_width, seed))
        most_rows = integral(most_rows)
        if most_rows is not None and (isinstance(most_rows, bool) or not isinstance(most_rows, int)):
            raise TypeError(f"most_rows must be an int (ids) or None (any), got {most_rows!r}")
        if most_rows is not None and most_rows < 0:
            raise ValueError(f"most_rows must be a non-negative number of ids or None (any), got {most_rows}")
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
        caches = build_caches(self.metadata, config, self.device, most_rows)
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

    @_serialized
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

    @_serialized
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

    @_serialized
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
        self.stack.cold.flush()

    @_serialized
    def get_distinct(
        self, ids: torch.Tensor, counts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [U, dim] on device, top-tier slots int64 [U])`` of sorted distinct ``ids``
        (as ``torch.unique`` returns them); ``counts [U]``: how often the batch holds each id (LFU).

        The training path: the ids join the table, and ``slots`` can be handed to ``apply_gradients``
        with the gradients, which then skips finding the ids again.
        """
        self._check_open()
        ids = as_ids(ids)
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError(
                "get_distinct needs sorted distinct ids (as torch.unique returns); use get() for any ids"
            )
        counts = torch.ones_like(ids) if counts is None else counts
        slots = self.stack.make_resident(ids, counts)
        weights = self.stack.top.read(slots, self.dim).to(self.device)
        return weights, slots

    @_serialized
    def read_resident(
        self, ids: torch.Tensor, counts: torch.Tensor, read: Callable[[Any, torch.Tensor], Any]
    ) -> Any:
        """``read(top tier, slots)``, holding the store's lock, right after distinct ``ids`` (int64
        [U], any order), each looked up ``counts [U]`` times, were made resident at ``slots``
        (int64 [U]; fetched, admitted, new ids joining the table): the training lookup of a pass
        that reads the rows where they lie (``nn.native_step``), while no other thread (a lookahead
        pipeline's worker) can move them."""
        self._check_open()
        return read(self.stack.top, self.stack.make_resident(ids, counts))

    @_serialized
    def lookup_bags(self, ids: torch.Tensor, padding: int | None, bags: Any) -> tuple | None:
        """A training lookup of bags (``nn.native_step``) in one native call where the tiers allow
        (``TierStack.lookup_bags``), holding the store's lock: ``(the top tier's vacated count, Distinct
        of ids, their slots, (pooled, entry bags, scales))``, the rows made resident as
        ``read_resident`` makes them; None where the batch takes ``read_resident``'s path."""
        self._check_open()
        looked_up = self.stack.lookup_bags(ids, padding, bags)
        return None if looked_up is None else (self.stack.top.vacated, *looked_up)

    @_serialized
    def update_top_tier(self, update: Callable[[Any], bool]) -> bool:
        """``update(top tier)`` holding the store's lock, the store being writable: an in-place
        change of rows ``read_resident`` placed (``nn.native_step``'s fused backward). Returns
        what ``update`` returns (False: it changed nothing)."""
        self._check_writable("update")
        return update(self.stack.top)

    @_serialized
    def apply_gradients(
        self,
        ids: torch.Tensor,
        grad: torch.Tensor,
        optimizer: SparseOptimizer,
        step: int,
        slots: torch.Tensor | None = None,
    ) -> None:
        """Fused ``optimizer`` step (its ``step``-th) on the rows of distinct ``ids`` (int64 [U]) with
        ``grad [U, dim]``: weights and optimizer state are updated in place in the top tier.

        ``slots`` from ``get_distinct`` are reused while the tier still holds the ids there (no
        lookup, no LFU count); if any moved since, the ids are found (and fetched) again.
        """
        self._check_writable("update")
        ids = as_ids(ids)
        top = self.stack.top
        if slots is None:
            slots = self.stack.make_resident(ids, torch.ones_like(ids))
        elif not top.holds(slots, ids):
            slots = self.stack.make_resident(ids, torch.zeros_like(ids))  # moved since: not a new access
        top.apply_optimizer(optimizer, slots, grad, step)

    def gradient_kernels(self, device: torch.device):
        """The top tier's kernels where they run on ``device`` (for ``nn.pooled_lookup``), else None."""
        top = self.stack.top
        return top.kernels if top.device == device else None

    @_serialized
    def flush(self) -> None:
        """Make every update so far durable (atomically: a crash keeps the previous flush)."""
        self._check_writable("flush")
        self.stack.flush()

    @_serialized
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
            self._closed = True
            if self._remove_temporary is not None:
                self._remove_temporary()

    @_serialized
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

    def copy(self) -> TieredStore:
        """A new temporary store with this one's layout, settings and rows as of now (flushed
        first), written straight to its cold tier; the two are independent afterwards."""
        self._check_open()
        if not self.read_only:
            self.flush()
        layout = self.metadata
        twin = TieredStore(
            None,
            layout.dim,
            layout.torch_dtype,
            layout.backend,
            device=self.device,
            optimizer_state_width=layout.optimizer_state_width,
            optimizer=layout.optimizer,
            seed=layout.seed,
            tiers=self.config,
        )
        twin.copy_rows_from(self)
        return twin

    def copy_rows_from(self, source: TieredStore) -> None:
        """Load every row of ``source`` (same layout), newest values, as they are (``load``)."""
        for ids, rows in source.iter_rows(batch_size=1 << 18, with_state=True):  # a commit per batch
            self.load(ids, rows, allow_nonfinite=True)

    @_serialized
    def snapshot(self) -> StoreSnapshot:
        """The table's rows as of now (a flush first), read later or from another thread while the
        store goes on being trained; close it when read (see ``tierstore.snapshot``)."""
        self._check_writable("take a snapshot")
        self.flush()
        snapshot = StoreSnapshot(self.metadata, self.stack.cold.snapshot())
        self._snapshots.add(snapshot)
        return snapshot

    @_serialized
    def replace_rows(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Make the table hold exactly the rows of ``batches`` (``(ids [n], whole rows [n,
        row_width])``, each id once) and nothing else, updates since the last flush dropped: a
        checkpoint restored. The rows are written to a new store beside this one, which then takes
        its place in one step (``directories.exchange``): a crash at any moment leaves the old rows
        or the new ones, whole. Cached rows are dropped; open snapshots are closed."""
        self._check_writable("replace its rows")
        pinned = sum(cache.pinned_count() for cache in self.stack.caches)
        if pinned:
            raise RuntimeError(
                f"{pinned} rows are pinned for batches in flight (a lookahead pipeline): finish or close "
                f"it before replacing the table's rows"
            )
        staging = self.path.with_name(f".{self.path.name}.replacing-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)  # left by a replacement this process did not finish
        create_store(staging, self.metadata)
        closed = False
        try:
            cold = open_cold(staging, self.metadata, self.config, read_only=False, new=True)
            try:
                for ids, rows in batches:
                    ids = as_ids(ids)
                    rows = self._checked_rows(ids, rows, allow_nonfinite=True)
                    if cold.can_bulk_load():  # written once, straight to their place (mmap)
                        cold.bulk_load(ids, rows)
                    else:
                        cold.put(ids, rows)
                cold.flush()
            finally:
                cold.close()
            for snapshot in list(self._snapshots):
                snapshot.close()
            self.stack.cold.close()
            closed = True
            exchange(staging, self.path)
        except BaseException:
            if closed:
                self.stack.cold = open_cold(self.path, self.metadata, self.config, False, False)
            shutil.rmtree(staging, ignore_errors=True)
            raise
        shutil.rmtree(staging, ignore_errors=True)  # the old rows
        for cache in self.stack.caches:
            cache.clear()
        self.stack.cold = open_cold(self.path, self.metadata, self.config, read_only=False, new=False)

    def __deepcopy__(self, memo: dict) -> TieredStore:
        return self.copy()

    def __getstate__(self) -> dict:
        """Pickling records where the store is and how it is opened, not its rows (flushed first);
        unpickling reopens it. A temporary store has no lasting place, so it is refused."""
        if self._temporary:
            raise pickle.PicklingError(
                f"a temporary store ({self.path}) cannot be pickled by reference: it is deleted when "
                "closed or collected. Give the table a path= to keep it, or copy.deepcopy it for a copy "
                "in this process"
            )
        self._check_open()
        if not self.read_only:
            self.flush()
        backend_names = {
            name: getattr(value, "name", value)
            for name, value in (
                ("host_cache_backend", self.config.host_cache_backend),
                ("device_cache_backend", self.config.device_cache_backend),
            )
        }
        return {
            "path": str(self.path.resolve()),
            "device": str(self.device),
            "read_only": self.read_only,
            "tiers": dataclasses.replace(self.config, **backend_names),
        }

    def __setstate__(self, state: dict) -> None:
        self.__init__(
            state["path"], device=state["device"], read_only=state["read_only"], tiers=state["tiers"]
        )

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @_serialized
    def __len__(self) -> int:
        """Distinct ids in the table (every id ever read or written, unless read-only)."""
        self._check_open()
        return len(self.stack)

    def __contains__(self, id_: int) -> bool:
        return bool(self.contains(id_)[0])

    @_serialized
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

    @_serialized
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

    def store_keys(self, ids: Any) -> list[tuple[TieredStore, torch.Tensor]]:
        """``[(self, the distinct ids get(ids) looks up)]``, for a lookahead pipeline
        (``tierstore.prefetch``)."""
        return [(self, torch.unique(as_ids(ids)))]

    def warm_keys(self, warm: Any) -> list[tuple[TieredStore, torch.Tensor]]:
        """``[(self, the ranked ids of warm)]`` (a ``.npy`` path or ids), for ``prefetch(warm=)``."""
        return [(self, hot_ids(warm))]

    @_serialized
    def preload(self, ids: torch.Tensor) -> int:
        """Load the rows of ranked ``ids`` (int64, distinct) the table holds into the cache tiers'
        free slots, top tier first, counting no lookup (a warm start); returns how many."""
        self._check_open()
        loaded = warm_caches(self.stack, as_ids(ids))
        self.warmed_rows += loaded
        return loaded

    @_serialized
    def pin_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Move the rows of distinct ``ids`` (int64) that the table holds into the top tier and pin
        them there until ``unpin_rows``, counting no lookup: ``(their keys, their slots, rows moved
        up)``. Ids the table does not hold are left out: a lookup adds them."""
        self._check_open()
        return self.stack.pin_held(as_ids(ids))

    @_serialized
    def with_top_tier(self, action: Callable[[Any], Any]) -> Any:
        """``action(top tier)`` holding the store's lock: a lookahead horizon's pins
        (``tierstore.horizon``); nothing when the store is closed."""
        if not self._closed:
            return action(self.stack.top)
        return None

    @_serialized
    def unpin_rows(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Undo a ``pin_rows`` (its keys and slots); rows taken out of the tier since are skipped."""
        if not self._closed:
            self.stack.unpin(keys, slots)

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
