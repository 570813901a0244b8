"""``TieredStore``: the public batched API over cold store -> host cache -> device cache.

The cache tiers are exclusive (a row lives in at most one cache) and write-back: a batch's
distinct ids are made resident in the top tier, misses are taken from the tier below (host cache,
then cold store, then the deterministic initialiser), and rows the top tier evicts move down one
tier; the host tier's dirty victims are staged in the cold store. ``flush`` stages every dirty
cached row and commits the cold store atomically.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import psutil
import torch

from .budget import Budget, rows_for_budget
from .cold import ColdStore, open_cold_store
from .errors import CacheCapacityError, ReadOnlyStoreError, StoreClosedError, StoreFormatError
from .initializer import initial_rows
from .host_kernels import host_kernels
from .kernel_row_cache import KernelRowCache
from .kernels import device_kernels
from .metadata import METADATA_FILE, StoreMetadata, check_matches, dtype_name, read_metadata, write_metadata
from .optim import SparseOptimizer
from .row_cache import RowCache, Rows
from .validation import as_ids, as_rows, check_out


@dataclasses.dataclass
class ColdStats:
    """Counters of the cold tier: lookups it served (hits), ids it had never seen (initialised)."""

    hits: int = 0
    initialized: int = 0
    rows_read: int = 0
    rows_written: int = 0


class TieredStore:
    """A table of rows ``[weights (dim) | optimizer state]`` keyed by any non-negative int64 id.

    Args:
        path: store directory; created if missing or empty. ``None``: a temporary store, deleted
            on ``close()``.
        dim, dtype, backend, optimizer_state_width, seed: the table's layout. Required (``dim``)
            or defaulted (float32, "lmdb", 0, 0) for a new store; for an existing store ``None``
            means "as stored" and any other value must match it.
        host_cache, device_cache: budgets: bytes (``"64MiB"``), a share of memory (``"10%"``: of
            RAM for the host, of the device's memory for the device) or a row count. ``0``/``None``
            leaves the tier out; at least one cache tier is needed.
        device: where the device cache lives and where ``get`` returns rows.
        read_only: open without writing; ``put``/``flush`` raise, unseen ids are not added.
        half_life: LFU ageing, in accesses per tier (default: 4x the tier's capacity).
        device_cache_backend: "cuda" runs the device tier on the ``cuda/`` kernels (needs a CUDA
            device, cuda-python and NVRTC; float32), "torch" on torch ops (any device), "auto" the
            kernels where they can run, else torch. ``stats()`` names the one in use.
        host_cache_backend: "openmp" runs the host tier on the same kernels compiled for the CPU
            (g++, OpenMP; float32), "torch" on torch ops, "auto" the kernels where they build.
            The mmap cold store's key indexes follow it (kernel hash tables unless "torch").

    ``get(ids)`` returns ``[N, dim]`` weights (``with_state=True``: whole rows). Ids never seen get
    their initial row (a function of id and seed) and join the table. Duplicate ids are fetched
    once. A batch needs at most the top tier's capacity of distinct ids.
    """

    def __init__(self, path: str | Path | None = None, dim: int | None = None, dtype: torch.dtype | None = None,
                 backend: str | None = None, host_cache: Budget = "256MiB", device_cache: Budget = None,
                 device: torch.device | str = "cpu", optimizer_state_width: int | None = None,
                 seed: int | None = None, read_only: bool = False, half_life: float | None = None,
                 device_cache_backend: str = "auto", host_cache_backend: str = "auto") -> None:
        # Refuse a backend that cannot run before creating anything (a new store's dtype is known here).
        _device_tier_kernels(device_cache_backend, torch.device(device), dtype or torch.float32)
        _host_tier_kernels(host_cache_backend, dtype or torch.float32)
        self._temporary = path is None
        self.path = Path(tempfile.mkdtemp(prefix="tierstore-")) if path is None else Path(path)
        self.read_only = read_only
        self.metadata = self._open_metadata(dim, dtype, backend, optimizer_state_width, seed)
        self.device = torch.device(device)
        self.dim = self.metadata.dim
        self.dtype = self.metadata.torch_dtype
        self.row_width = self.metadata.row_width
        self.caches = self._make_caches(host_cache, device_cache, half_life, device_cache_backend, host_cache_backend)
        index_kernels = None if host_cache_backend == "torch" else host_kernels()[0]
        self.cold: ColdStore = open_cold_store(self.metadata.backend, self.path, self.row_width, self.dtype, read_only,
                                               index_kernels)
        self.cold_stats = ColdStats()
        self._closed = False

    # -- opening -----------------------------------------------------------------------------

    def _open_metadata(self, dim, dtype, backend, state_width, seed) -> StoreMetadata:
        requested = {"dim": dim, "dtype": None if dtype is None else dtype_name(dtype), "backend": backend,
                     "optimizer_state_width": state_width, "seed": seed}
        if self.path.exists() and not self.path.is_dir():
            raise StoreFormatError(f"{self.path} is a file; a store is a directory")
        if (self.path / METADATA_FILE).exists():
            metadata = read_metadata(self.path)
            check_matches(metadata, requested, self.path)
            return metadata
        if self.path.is_dir() and any(self.path.iterdir()):
            raise StoreFormatError(f"{self.path} is not empty and has no {METADATA_FILE}: not a tierstore store")
        if self.read_only:
            raise StoreFormatError(f"{self.path} holds no store to open read-only")
        if dim is None:
            raise ValueError("dim is required to create a new store")
        metadata = StoreMetadata(backend=backend or "lmdb", dim=dim, dtype=requested["dtype"] or "float32",
                                 optimizer_state_width=state_width or 0, seed=seed or 0)
        self.path.mkdir(parents=True, exist_ok=True)
        write_metadata(self.path, metadata)
        return metadata

    def _make_caches(self, host_budget: Budget, device_budget: Budget, half_life, device_backend: str,
                     host_backend: str) -> list[RowCache]:
        on_cuda = self.device.type == "cuda"
        device_memory = torch.cuda.get_device_properties(self.device).total_memory if on_cuda else None
        tiers = [("device", device_budget, self.device, device_memory,
                  _device_tier_kernels(device_backend, self.device, self.dtype), "cuda"),
                 ("host", host_budget, torch.device("cpu"), psutil.virtual_memory().total,
                  _host_tier_kernels(host_backend, self.dtype), "openmp")]
        caches = []
        for name, budget, device, memory, kernels, kernel_backend in tiers:
            kind = RowCache if kernels is None else KernelRowCache
            rows = rows_for_budget(budget, lambda count: kind.nbytes_for(count, self.row_width, self.dtype), memory)
            if not rows:
                continue
            pin_memory = on_cuda and name == "host"
            if kernels is None:
                caches.append(RowCache(name, rows, self.row_width, self.dtype, device, half_life, pin_memory))
            else:
                caches.append(KernelRowCache(name, rows, self.row_width, self.dtype, device, kernels, kernel_backend,
                                             half_life, pin_memory))
        if not caches:
            raise ValueError("at least one cache tier is needed: give host_cache or device_cache a budget above 0")
        return caches

    # -- public API --------------------------------------------------------------------------

    def get(self, ids: Any, with_state: bool = False, out: torch.Tensor | None = None,
            grow: bool = True) -> torch.Tensor:
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
        top = self.caches[0]
        slots = top.find(ids)
        if bool((slots >= 0).all()):  # hit path: no unique, no movement
            top.touch(slots)
            top.stats.hits += ids.numel()
        else:
            unique, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
            if not grow or self.read_only:
                rows = self._get_without_growing(unique, counts, width)[inverse.to(self.device)]
                return rows if out is None else out.copy_(rows)
            slots = self._make_resident(unique, counts)[inverse.to(top.device)]
        if out is None or top.device != self.device:
            rows = top.read(slots, width).to(self.device)
            return rows if out is None else out.copy_(rows)
        return top.read(slots, width, out=out)

    def put(self, ids: Any, rows: Any) -> None:
        """Overwrite the weights (``rows [N, dim]``) or whole rows (``[N, row_width]``) of ``ids``.

        For a repeated id the last row wins. Optimizer state is kept when only weights are given.
        """
        self._check_open()
        if self.read_only:
            raise ReadOnlyStoreError(f"store {self.path} was opened with read_only=True; reopen it writable to put")
        ids = as_ids(ids)
        rows = as_rows(rows, ids.numel(), (self.dim, self.row_width), self.dtype)
        unique, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        last = torch.zeros(unique.numel(), dtype=torch.int64).scatter_reduce_(
            0, inverse, torch.arange(ids.numel()), reduce="amax")
        slots = self._make_resident(unique, counts)
        self.caches[0].write(slots, rows[last], rows.shape[1])

    def get_distinct(self, ids: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [U, dim] on device, top-tier slots int64 [U])`` of sorted distinct ``ids``
        (as ``torch.unique`` returns them); ``counts [U]``: how often the batch holds each id (LFU).

        The training path: the ids join the table, and ``slots`` can be handed to ``apply_gradients``
        with the gradients, which then skips finding the ids again.
        """
        self._check_open()
        ids = as_ids(ids)
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("get_distinct needs sorted distinct ids (as torch.unique returns); use get() for any ids")
        counts = torch.ones_like(ids) if counts is None else counts
        slots = self._make_resident(ids, counts)
        weights = self.caches[0].read(slots, self.dim).to(self.device)
        return weights, slots

    def apply_gradients(self, ids: torch.Tensor, grad: torch.Tensor, optimizer: SparseOptimizer, step: int,
                        slots: torch.Tensor | None = None) -> None:
        """Fused ``optimizer`` step (its ``step``-th) on the rows of distinct ``ids`` (int64 [U]) with
        ``grad [U, dim]``: weights and optimizer state are updated in place in the top tier.

        ``slots`` from ``get_distinct`` are reused while the tier still holds the ids there (no
        lookup, no LFU count); if any moved since, the ids are found (and fetched) again.
        """
        self._check_open()
        if self.read_only:
            raise ReadOnlyStoreError(f"store {self.path} was opened with read_only=True; reopen it writable to update")
        ids = as_ids(ids)
        top = self.caches[0]
        if slots is None:
            slots = self._make_resident(ids, torch.ones_like(ids))
        elif slots.shape != ids.shape or not bool((top.slot_keys[slots] == ids.to(top.device)).all()):
            slots = self._make_resident(ids, torch.zeros_like(ids))  # moved since: not a new access
        top.apply_optimizer(optimizer, slots, grad, step)

    def flush(self) -> None:
        """Make every update so far durable (atomically: a crash keeps the previous flush)."""
        self._check_open()
        if self.read_only:
            raise ReadOnlyStoreError(f"store {self.path} was opened with read_only=True; it cannot flush")
        dirty = [cache.dirty_rows() for cache in self.caches]
        for _, rows in dirty:
            self._stage_in_cold(rows)
        self.cold.flush()
        for cache, (slots, _) in zip(self.caches, dirty):
            cache.mark_clean(slots)

    def close(self) -> None:
        """Flush (unless read-only) and release the store; a temporary store is deleted."""
        if self._closed:
            return
        try:
            if not self.read_only and not self._temporary:
                self.flush()
        finally:
            self.cold.close()
            self._closed = True
            if self._temporary:
                shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __len__(self) -> int:
        """Distinct ids in the table (every id ever read or written, unless read-only)."""
        self._check_open()
        return len(self.cold) + sum(int(cache.fresh.sum()) for cache in self.caches)

    def __contains__(self, id_: int) -> bool:
        return bool(self.contains(id_)[0])

    def contains(self, ids: Any) -> torch.Tensor:
        """bool [N]: which ``ids`` the table holds (without adding them)."""
        self._check_open()
        ids = as_ids(ids)
        unique, inverse = torch.unique(ids, return_inverse=True)
        present = self.cold.contains(unique)
        for cache in self.caches:  # a cached row that is not fresh is in the cold store too
            slots = cache.find(unique)
            cached = slots >= 0
            fresh = torch.zeros_like(cached)
            fresh[cached] = cache.fresh[slots[cached]]
            present |= fresh.cpu()
        return present[inverse]

    def iter_rows(self, batch_size: int = 65536, with_state: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every ``(ids [n], rows [n, dim or row_width])`` in the table, newest values, on CPU."""
        self._check_open()
        width = self.row_width if with_state else self.dim
        for keys, rows in self.cold.iter_rows(batch_size):
            for cache in self.caches:
                slots = cache.find(keys)
                cached = (slots >= 0).cpu()
                rows[cached] = cache.read(slots[slots >= 0]).cpu()
            yield keys, rows[:, :width]
        for cache in self.caches:
            fresh = cache.fresh.nonzero().squeeze(1)
            for start in range(0, fresh.numel(), batch_size):
                part = fresh[start:start + batch_size]
                yield cache.slot_keys[part].cpu(), cache.read(part, width).cpu()

    def stats(self) -> dict:
        """Counters per tier: lookups served (hits), misses, rows moved and bytes moved.

        ``hits`` and ``misses`` count id lookups (a repeated id counts each time); every lookup is
        a hit in exactly one tier, so hit counts add up to the ids looked up. The cold tier's
        ``initialized`` counts lookups of ids never seen before.
        """
        row_bytes = self.metadata.row_bytes
        tiers = {}
        for cache in self.caches:
            counters = dataclasses.asdict(cache.stats)
            counters.update(capacity_rows=cache.capacity, resident_rows=len(cache), memory_bytes=cache.nbytes,
                            bytes_in=cache.stats.rows_in * row_bytes, device=str(cache.device), backend=cache.backend)
            tiers[cache.name] = counters
        cold = dataclasses.asdict(self.cold_stats)
        cold.update(backend=self.metadata.backend, bytes_read=self.cold_stats.rows_read * row_bytes,
                    bytes_written=self.cold_stats.rows_written * row_bytes)
        tiers["cold"] = cold
        return tiers

    # -- movement between tiers --------------------------------------------------------------

    def _make_resident(self, unique: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Slots in the top tier of ``unique`` ids, fetching and evicting as needed."""
        top = self.caches[0]
        if unique.numel() > top.capacity:
            raise CacheCapacityError(
                f"this batch has {unique.numel()} distinct ids but the top cache tier ({top.name}) holds "
                f"{top.capacity} rows; raise {top.name}_cache or split the batch"
            )
        slots = top.find(unique)
        hit = (slots >= 0).cpu()
        top.stats.hits += int(counts[hit].sum())
        top.stats.misses += int(counts[~hit].sum())
        if not bool(hit.all()):
            fetched = self._fetch(unique[~hit], counts[~hit], level=1)
            new_slots, evicted = top.admit(fetched, protected=slots[hit.to(top.device)])
            slots[(~hit).to(top.device)] = new_slots
            self._move_down(evicted, level=1)
        top.touch(slots, counts)
        return slots

    def _get_without_growing(self, unique: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
        """``[U, width]`` rows of ``unique`` ids on ``device``: held ids through the tiers, the others
        their initial rows, which are not cached (a cached row is always one the table holds).
        Every lookup of a read-only store, and of ``get(grow=False)``, that misses the top tier."""
        known = self.contains(unique)
        rows = torch.empty(unique.numel(), width, dtype=self.dtype, device=self.device)
        if bool(known.any()):
            slots = self._make_resident(unique[known], counts[known])
            rows[known.to(self.device)] = self.caches[0].read(slots, width).to(self.device)
        unknown = ~known
        if bool(unknown.any()):
            self.cold_stats.initialized += int(counts[unknown].sum())
            rows[unknown.to(self.device)] = initial_rows(unique[unknown], self.dim, self.metadata.optimizer_state_width,
                                                         self.metadata.seed, self.dtype)[:, :width].to(self.device)
        return rows

    def _fetch(self, keys: torch.Tensor, counts: torch.Tensor, level: int) -> Rows:
        """Rows of ``keys`` (none in tiers above ``level``, same order), taken out of the tiers below."""
        if level < len(self.caches):
            cache = self.caches[level]
            found, taken = cache.take(keys)
            cache.stats.hits += int(counts[found].sum())
            cache.stats.misses += int(counts[~found].sum())
            if bool(found.all()):
                return taken
            return Rows.merge(found, taken, self._fetch(keys[~found], counts[~found], level + 1))
        rows, found = self.cold.get(keys)
        self.cold_stats.rows_read += keys.numel()
        self.cold_stats.hits += int(counts[found].sum())
        self.cold_stats.initialized += int(counts[~found].sum())
        new = ~found
        if bool(new.any()):
            rows[new] = initial_rows(keys[new], self.dim, self.metadata.optimizer_state_width,
                                     self.metadata.seed, self.dtype)
        return Rows(keys, rows, new, new.clone())

    def _move_down(self, evicted: Rows, level: int) -> None:
        """Hand rows evicted from tier ``level - 1`` to tier ``level`` (or the cold store)."""
        if len(evicted) == 0:
            return
        if level < len(self.caches):
            cache = self.caches[level]
            evicted = Rows(*(tensor.to(cache.device) for tensor in dataclasses.astuple(evicted)))
            fits = min(len(evicted), cache.capacity)
            _, pushed_out = cache.admit(evicted.select(slice(0, fits)))
            overflow = evicted.select(slice(fits, None))
            self._move_down(Rows.concat([pushed_out, overflow]), level + 1)
        else:
            self._stage_in_cold(evicted.select(evicted.dirty.cpu()))

    def _stage_in_cold(self, rows: Rows) -> None:
        if len(rows):
            self.cold.put(rows.keys.cpu(), rows.rows.cpu())
            self.cold_stats.rows_written += len(rows)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.path} is closed")


def _device_tier_kernels(requested: str, device: torch.device, dtype: torch.dtype):
    """The ``cuda/`` kernels for the device tier, or None for its torch backend; raises when
    ``requested`` is not a backend, or is "cuda" and the kernels cannot run."""
    if requested not in ("auto", "cuda", "torch"):
        raise ValueError(f"device_cache_backend must be 'auto', 'cuda' or 'torch', got {requested!r}")
    if requested == "torch":
        return None
    kernels, why_not = device_kernels(device, dtype)
    if kernels is None and requested == "cuda":
        raise ValueError(f"device_cache_backend='cuda' cannot run here ({why_not}); use 'auto' or 'torch'")
    return kernels


def _host_tier_kernels(requested: str, dtype: torch.dtype):
    """The ``cuda/`` kernels built for the CPU (OpenMP) for the host tier, or None for torch ops;
    raises when ``requested`` is not a backend, or is "openmp" and the kernels cannot run."""
    if requested not in ("auto", "openmp", "torch"):
        raise ValueError(f"host_cache_backend must be 'auto', 'openmp' or 'torch', got {requested!r}")
    if requested == "torch":
        return None
    kernels, why_not = host_kernels() if dtype == torch.float32 else (None, f"rows are {dtype}, not float32")
    if kernels is None and requested == "openmp":
        raise ValueError(f"host_cache_backend='openmp' cannot run here ({why_not}); use 'auto' or 'torch'")
    return kernels
