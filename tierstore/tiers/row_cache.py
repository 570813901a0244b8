"""``RowCache``: one cache tier (host or device), the only implementation of ``CacheTier``.

``capacity`` row slots on a torch device, found through the backend's hash index. Rows carry two
flags: ``dirty`` (newer than the tier below) and ``fresh`` (never written to the cold store; its
key is counted by nobody else). What differs between tiers is a value, not a subclass: the
``backend`` (``tiers.backends``: torch ops, or the kernels on the GPU or the CPU) runs the bulk
operations, and the ``policy`` (``tiers.policies``, LFU with ageing by default) picks victims.
A host tier on the tuned host build may be given a ``DirectLayout``: its bounded tables' rows are
placed at their home slots and found there without the index (``tiers.direct_layout``).
Pinned slots are never chosen as victims: the current batch's (passed as ``protected``) while
it is admitted, and those a lookahead pipeline pins until its batch has run (``pin``/``unpin``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from ..errors import CacheCapacityError
from ..kernels.cache_passes import cache_passes_of
from ..kernels.launch import KERNEL_DTYPES
from ..kernels.step_passes import step_passes_of
from . import huge_pages
from .backends import TorchRows
from .contract import Rows, TierStats
from .direct_layout import BYTES_PER_SLOT, DirectLayout
from .policies import EvictionPolicy, LfuWithAgeing
from .row_cache_native import NativeSide

_SLOT_BYTES = 8 + 1 + 1 + 1 + 8  # key, dirty and fresh flags, pin count, free-slot stack


class RowCache(NativeSide):
    """``capacity`` rows of ``row_width`` values of ``dtype`` on ``device``; see the module docstring.

    ``backend``: a ``tiers.backends`` value (default ``TorchRows()``). ``policy``: an
    ``EvictionPolicy`` subclass, built as ``policy(capacity, device, backend)`` (default: LFU with
    ageing at ``half_life``). ``pin_memory``: page-locked rows (a host tier feeding a GPU).
    ``direct``: the homes of some tables' rows (``DirectLayout``, within the most slots it grows to),
    for a tier on the tuned host build."""

    def __init__(
        self,
        name: str,
        capacity: int,
        row_width: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        half_life: float | None = None,
        pin_memory: bool = False,
        backend=None,
        policy: type[EvictionPolicy] | None = None,
        grows_to: int | None = None,
        direct: DirectLayout | None = None,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"{name} cache capacity must be positive, got {capacity}")
        self.backend = backend if backend is not None else TorchRows()
        if dtype not in KERNEL_DTYPES and not isinstance(self.backend, TorchRows):
            raise ValueError(
                f"the {self.backend.name} cache backend stores float32, float16 or bfloat16 rows, not "
                f"{dtype}; use the torch backend"
            )
        self.name = name
        self.capacity = capacity
        self.max_capacity = max(capacity, grows_to or capacity)  # grow() takes it this far
        self._pin_memory = pin_memory
        self.device = torch.device(device)
        self.index = self.backend.make_index(capacity, self.device, self.max_capacity)
        self.rows = self._new_rows(capacity, row_width, dtype)
        self.slot_keys = huge_pages.full((capacity,), -1, torch.int64, self.device)
        self.dirty = huge_pages.full((capacity,), 0, torch.bool, self.device)
        self.fresh = huge_pages.full((capacity,), 0, torch.bool, self.device)
        self.pins = huge_pages.full((capacity,), 0, torch.uint8, self.device)  # 0: evictable
        self._free_count = capacity
        if policy is None:
            self.policy = LfuWithAgeing(capacity, self.device, self.backend, half_life)
        else:
            self.policy = policy(capacity, self.device, self.backend)
        self.stats = TierStats()
        self.vacated = 0  # rows that have left their slot (evicted or taken): none did if it is unchanged
        self.horizon_budget = None  # bytes its budget holds for a lookahead horizon (None: none)
        self._passes = cache_passes_of(self.kernels)  # the tuned host build: rows moved in one call
        # The training step's native passes (nn.native_step) where they serve this tier: rows the
        # kernels hold, in host memory, under the tuned host build; else None.
        self.step_passes = (
            step_passes_of(self.kernels) if self.device.type == "cpu" and dtype in KERNEL_DTYPES else None
        )
        self._native_arrays = None  # (the tensors, native_arrays' struct of their addresses)
        self.direct = None
        self._free_positions = None  # each free slot's place in the stack, where there are homes
        if direct is None:
            self._free = torch.arange(capacity - 1, -1, -1, device=self.device)  # a stack of free slots
        else:
            self._address_directly(direct)

    def _address_directly(self, layout: DirectLayout) -> None:
        """Give the tier ``layout``'s homes: the free stack holds the homes at its bottom (other rows
        take the slots past them first) and each free slot's place in it."""
        if self._passes is None or layout.rows > self.max_capacity:
            raise ValueError(
                f"{self.name} cache: a direct layout of {layout.rows} homes needs a tier of at most "
                f"as many slots ({self.max_capacity}) on the tuned host build"
            )
        homes = min(layout.rows, self.capacity)  # a growing tier's later slots come with its growth
        self._free = torch.empty(self.capacity, dtype=torch.int64)
        torch.arange(homes - 1, -1, -1, out=self._free[:homes])
        torch.arange(self.capacity - 1, homes - 1, -1, out=self._free[homes:])
        self._free_positions = self._free.to(torch.int32)  # this order is its own inverse
        self.direct = layout

    def make_room(self, keys: torch.Tensor) -> None:
        """Grow (``grow``, up to ``max_capacity``) where the rows of distinct ``keys`` not resident
        would not fit in the free slots: a tier that can grow evicts only once it is full."""
        if self.fits_as_sized(keys.numel()):
            return
        missing = int((self.find(keys) < 0).sum())
        if missing > self._free_count:
            self._grow_for(missing)

    def fits_as_sized(self, count: int) -> bool:
        """Whether ``count`` rows more need no growth: the tier is at its full size or has as many
        free slots."""
        return self.capacity >= self.max_capacity or count <= self._free_count

    def _grow_for(self, count: int) -> None:
        """At least ``count`` free slots, up to ``max_capacity``: doubling (growth costs O(1) a row)
        until past a quarter of it, then all of it, so that a growth's copy (old and new arrays at
        once) never holds more than 1.25 times the budget."""
        wanted = max(2 * self.capacity, len(self) + count)
        self.grow(self.max_capacity if 4 * wanted > self.max_capacity else wanted)

    def _new_rows(self, capacity: int, row_width: int, dtype: torch.dtype) -> torch.Tensor:
        """``[capacity, row_width]`` uninitialised: pinned where asked, else on huge pages."""
        if self._pin_memory:
            return torch.empty(capacity, row_width, dtype=dtype, device=self.device, pin_memory=True)
        return huge_pages.empty((capacity, row_width), dtype, self.device)

    def grow(self, capacity: int) -> None:
        """``capacity`` slots (more than now, at most ``max_capacity``): rows stay in their slots,
        the new ones are free, and the index has room for a key in each (native passes insert
        without growing it)."""
        old = self.capacity
        if not old < capacity <= self.max_capacity:
            raise ValueError(
                f"{self.name} cache: grow to {capacity} rows, from {old} (at most {self.max_capacity})"
            )

        def extended(tensor: torch.Tensor, fill) -> torch.Tensor:
            grown = huge_pages.full((capacity, *tensor.shape[1:]), fill, tensor.dtype, self.device)
            grown[:old] = tensor
            return grown

        rows = self._new_rows(capacity, self.rows.shape[1], self.rows.dtype)
        rows[:old] = self.rows
        self.rows = rows
        self.slot_keys = extended(self.slot_keys, -1)
        self.dirty, self.fresh, self.pins = (extended(t, 0) for t in (self.dirty, self.fresh, self.pins))
        new_slots = torch.arange(capacity - 1, old - 1, -1, device=self.device)  # under the free ones
        self._free = torch.cat(
            [new_slots, self._free[: self._free_count], self._free.new_empty(old - self._free_count)]
        )
        self._free_count += capacity - old
        if self.direct is not None:  # each free slot's place in the grown stack
            self._free_positions = torch.full((capacity,), -1, dtype=torch.int32)
            places = torch.arange(self._free_count, dtype=torch.int32)
            self._free_positions[self._free[: self._free_count]] = places
        self.policy.grow(capacity)
        self.index.reserve(capacity)  # as a tier made with this capacity has (its byte budget)
        self.capacity = capacity

    @property
    def kernels(self):
        """The kernel build the backend runs on (``CudaKernels``/``HostKernels``), None for torch ops."""
        return getattr(self.backend, "kernels", None)

    @staticmethod
    def nbytes_for(
        capacity: int,
        row_width: int,
        dtype: torch.dtype,
        backend=None,
        policy: type[EvictionPolicy] | None = None,
        half_life: float | None = None,
        direct: bool = False,
    ) -> int:
        """Bytes a cache of ``capacity`` rows allocates (rows, index, per-slot bookkeeping, policy;
        ``direct``: with a direct layout)."""
        backend = backend if backend is not None else TorchRows()
        policy = policy or LfuWithAgeing
        per_slot = row_width * dtype.itemsize + _SLOT_BYTES + policy.bytes_per_slot
        per_slot += BYTES_PER_SLOT if direct else 0
        fixed = policy.fixed_nbytes(capacity, half_life)
        return capacity * per_slot + backend.index_nbytes(capacity) + fixed

    @property
    def nbytes(self) -> int:
        tensors = (self.rows, self.slot_keys, self.dirty, self.fresh, self.pins, self._free)
        if self.direct is not None:
            tensors += (self._free_positions,)
        return self.index.nbytes + self.policy.nbytes + sum(tensor.nbytes for tensor in tensors)

    def __len__(self) -> int:
        return self.capacity - self._free_count

    # -- lookups and row access ----------------------------------------------------------------

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        return self.index.find(keys.to(self.device))

    def touch(
        self, slots: torch.Tensor, counts: torch.Tensor | None = None, missed: torch.Tensor | None = None
    ) -> None:
        if self.policy.needs_keys:
            self.policy.touch(slots, counts, self.slot_keys[slots], missed)
        else:
            self.policy.touch(slots, counts)
        if missed is None:
            self.stats.hits += slots.numel() if counts is None else int(counts.sum())
        else:
            self.stats.count_lookups(~missed, counts)

    def read(
        self, slots: torch.Tensor, columns: int | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.backend.gather(self.rows, slots, self.rows.shape[1] if columns is None else columns, out)

    def write(self, slots: torch.Tensor, values: torch.Tensor, columns: int | None = None) -> None:
        self.backend.scatter(self.rows, slots, values, self.rows.shape[1] if columns is None else columns)
        self.dirty[slots] = True

    def apply_optimizer(self, optimizer, slots: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        keys = self.slot_keys[slots] if optimizer.stochastic_rounding else None  # its draws' ids
        self.backend.optimizer_step(optimizer, self.rows, slots, grad, step, keys)
        self.dirty[slots] = True

    def holds(self, slots: torch.Tensor, keys: torch.Tensor) -> bool:
        return slots.shape == keys.shape and bool((self.slot_keys[slots] == keys.to(self.device)).all())

    def pin(self, slots: torch.Tensor) -> None:
        """Keep the rows at ``slots`` (distinct) from eviction until as many ``unpin``s."""
        self.backend.add_pins(self.pins, slots, 1)

    def unpin(self, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Undo a ``pin`` of ``slots`` (distinct) where they still hold ``keys`` (a pinned row taken
        out of the tier since, by ``load`` or ``clear``, left its pins behind)."""
        slots = slots[(self.slot_keys[slots] == keys.to(self.device)) & (self.pins[slots] > 0)]
        self.backend.add_pins(self.pins, slots, -1)

    def pinned_count(self) -> int:
        return int((self.pins > 0).sum())

    def pinned_keys(self, keys: torch.Tensor) -> torch.Tensor:
        slots = self.find(keys)
        held = slots >= 0
        return keys[held.cpu()][(self.pins[slots[held]] > 0).cpu()]

    # -- movement ------------------------------------------------------------------------------

    def clear(self) -> None:
        slots = (self.slot_keys >= 0).nonzero().squeeze(1)
        self.index.remove(self.slot_keys[slots])
        self._release(slots)

    def _rows_at(self, slots: torch.Tensor) -> Rows:
        if self._passes is not None:
            return Rows(*self._passes.slot_rows(self.slot_keys, self.rows, self.dirty, self.fresh, slots))
        return Rows(self.slot_keys[slots], self.read(slots), self.dirty[slots], self.fresh[slots])

    def take(self, keys: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, Rows]:
        slots = self.find(keys)
        found = (slots >= 0).cpu()
        self.stats.count_lookups(found, counts)
        slots = slots[slots >= 0]
        taken = self._rows_at(slots)
        self.index.remove(taken.keys)
        self._release(slots)
        return found, taken

    def _release(self, slots: torch.Tensor) -> None:
        self.vacated += slots.numel()
        self.slot_keys[slots] = -1
        self.policy.reset(slots)
        self.dirty[slots] = False
        self.fresh[slots] = False
        self.pins[slots] = 0
        self._free[self._free_count : self._free_count + slots.numel()] = slots
        if self.direct is not None:
            places = torch.arange(self._free_count, self._free_count + slots.numel(), dtype=torch.int32)
            self._free_positions[slots] = places
        self._free_count += slots.numel()

    def admit(
        self,
        incoming: Rows,
        protected: torch.Tensor | None = None,
        before_evicting: Callable[[Rows], None] | None = None,
    ) -> tuple[torch.Tensor, Rows]:
        count = len(incoming)
        slots, victims = self.claim_slots(count, protected, incoming.keys)
        evicted = Rows(*(tensor[:0] for tensor in (self.slot_keys, self.rows, self.dirty, self.fresh)))
        if victims:
            evicted = self._rows_at(slots[count - victims :])
            if before_evicting is not None:
                before_evicting(evicted)  # may raise: nothing here has changed yet
            self.index.remove(evicted.keys)
            self.vacated += victims
            self.stats.evictions += victims
            self.stats.writebacks += int(evicted.dirty.sum())
        self._free_count -= count - victims
        keys = incoming.keys.to(self.device)
        self.index.insert(keys, slots)
        if self._passes is not None:
            self._passes.fill_slots(self.slot_keys, self.rows, self.dirty, self.fresh, slots, incoming)
        else:
            self.slot_keys[slots] = keys
            self.backend.scatter(self.rows, slots, incoming.rows, self.rows.shape[1])
            self.dirty[slots] = incoming.dirty.to(self.device)
            self.fresh[slots] = incoming.fresh.to(self.device)
        self.policy.reset(slots)
        self.stats.rows_in += count
        return slots, evicted

    def _victims(self, count: int, protected: torch.Tensor | None) -> torch.Tensor:
        protect = protected is not None and protected.numel() > 0
        if protect:
            self.backend.add_pins(self.pins, protected, 1)
        try:
            return self.policy.victims(count, self.slot_keys, self.pins)
        except CacheCapacityError as error:
            reason = str(error)
        finally:
            if protect:
                self.backend.add_pins(self.pins, protected, -1)  # undone where done: no pass over every slot
        self._no_room(reason)

    def _no_room(self, reason: str) -> None:
        """Raise ``CacheCapacityError``: too few slots evictable, for ``reason``."""
        pinned = self.pinned_count()
        window = f" ({pinned} pinned by a lookahead window)" if pinned else ""
        raise CacheCapacityError(f"the {self.name} cache holds {self.capacity} rows{window} and {reason}")

    # -- flush and enumeration -----------------------------------------------------------------

    def dirty_rows(self, batch_size: int) -> Iterator[tuple[torch.Tensor, Rows]]:
        for slots in self.dirty.nonzero().squeeze(1).split(batch_size):
            yield slots, self._rows_at(slots)

    def dirty_keys(self) -> torch.Tensor:
        return self.slot_keys[self.dirty].cpu()

    def mark_clean(self, slots: torch.Tensor) -> None:
        self.dirty[slots] = False
        self.fresh[slots] = False

    def fresh_keys(self, keys: torch.Tensor) -> torch.Tensor:
        slots = self.find(keys)
        cached = slots >= 0
        fresh = torch.zeros_like(cached)
        fresh[cached] = self.fresh[slots[cached]]
        return fresh.cpu()

    def fresh_count(self) -> int:
        return int(self.fresh.sum())

    def iter_fresh(
        self, batch_size: int, columns: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        fresh = self.fresh.nonzero().squeeze(1)
        for start in range(0, fresh.numel(), batch_size):
            part = fresh[start : start + batch_size]
            yield self.slot_keys[part].cpu(), self.read(part, columns).cpu()

    def report(self) -> dict:
        counters = dict(vars(self.stats))
        counters.update(
            capacity_rows=self.capacity,
            budget_rows=self.max_capacity,
            resident_rows=len(self),
            memory_bytes=self.nbytes,
            bytes_in=self.stats.rows_in * self.rows.shape[1] * self.rows.element_size(),
            device=str(self.device),
            backend=self.backend.name,
        )
        return counters
