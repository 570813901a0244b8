"""One cache tier: a fixed number of row slots on a torch device, found through a ``HashIndex``.

The same class serves the host (DRAM) tier and the reference device tier; only the device and
budget differ. Eviction is LFU with ageing: an access adds ``increment`` to a slot's score, and
``increment`` grows by ``2 ** (1 / half_life)`` per access, which is the same as halving every
older score each ``half_life`` accesses (so a shifted distribution is followed) at O(batch) cost.
Rows carry two flags: ``dirty`` (newer than the tier below) and ``fresh`` (never written below;
its key is counted by nobody else). Slots the current batch needs are passed as ``protected`` and
are never chosen as victims.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .errors import CacheCapacityError
from .hash_index import HashIndex, index_nbytes

_RENORMALISE_AT = 2.0**20


@dataclasses.dataclass
class Rows:
    """A batch of rows in flight between tiers, with the flags that travel with them."""

    keys: torch.Tensor  # int64 [N]
    rows: torch.Tensor  # [N, row_width]
    dirty: torch.Tensor  # bool [N]
    fresh: torch.Tensor  # bool [N]

    def __len__(self) -> int:
        return self.keys.numel()

    def select(self, mask: torch.Tensor) -> "Rows":
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and bool(mask.all()):
            return self
        return Rows(self.keys[mask], self.rows[mask], self.dirty[mask], self.fresh[mask])

    @staticmethod
    def concat(parts: list["Rows"]) -> "Rows":
        return Rows(*(torch.cat([getattr(part, field.name) for part in parts])
                      for field in dataclasses.fields(Rows)))

    @staticmethod
    def merge(mask: torch.Tensor, where_true: "Rows", where_false: "Rows") -> "Rows":
        """Rows in one order: ``where_true`` at the positions where ``mask`` is set, else ``where_false``."""
        merged = []
        for field in dataclasses.fields(Rows):
            first, second = getattr(where_true, field.name), getattr(where_false, field.name)
            out = torch.empty((mask.numel(), *first.shape[1:]), dtype=first.dtype, device=first.device)
            out[mask.to(out.device)] = first
            out[(~mask).to(out.device)] = second.to(out.device)
            merged.append(out)
        return Rows(*merged)


@dataclasses.dataclass
class TierStats:
    """Counters of one tier. Hits and misses count id lookups; moves count rows."""

    hits: int = 0
    misses: int = 0
    rows_in: int = 0
    evictions: int = 0
    writebacks: int = 0


class RowCache:
    """``capacity`` rows of ``row_width`` values on ``device``; see the module docstring."""

    def __init__(self, name: str, capacity: int, row_width: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", half_life: float | None = None,
                 pin_memory: bool = False) -> None:
        if capacity <= 0:
            raise ValueError(f"{name} cache capacity must be positive, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.device = torch.device(device)
        self.index = self._make_index(capacity)
        self.rows = torch.empty(capacity, row_width, dtype=dtype, device=self.device, pin_memory=pin_memory)
        self.slot_keys = torch.full((capacity,), -1, dtype=torch.int64, device=self.device)
        self.score = torch.zeros(capacity, dtype=torch.float32, device=self.device)
        self.dirty = torch.zeros(capacity, dtype=torch.bool, device=self.device)
        self.fresh = torch.zeros(capacity, dtype=torch.bool, device=self.device)
        self._free = torch.arange(capacity - 1, -1, -1, device=self.device)  # a stack of free slots
        self._free_count = capacity
        self._increment = 1.0
        self._growth = 2.0 ** (1.0 / (half_life or 4.0 * capacity))
        self._update_buffer = self.rows[:0]  # reused by apply_optimizer
        self.stats = TierStats()

    backend = "torch"

    def _make_index(self, capacity: int):
        return HashIndex(capacity, self.device, value_dtype=torch.int32)

    @staticmethod
    def _index_nbytes(capacity: int) -> int:
        return index_nbytes(capacity, torch.int32)

    @classmethod
    def nbytes_for(cls, capacity: int, row_width: int, dtype: torch.dtype) -> int:
        """Bytes a cache of ``capacity`` rows allocates (rows, index and per-slot bookkeeping)."""
        per_slot = row_width * dtype.itemsize + 8 + 4 + 1 + 1 + 8  # row, key, score, flags, free stack
        return capacity * per_slot + cls._index_nbytes(capacity)

    @property
    def nbytes(self) -> int:
        tensors = (self.rows, self.slot_keys, self.score, self.dirty, self.fresh, self._free)
        return self.index.nbytes + sum(tensor.nbytes for tensor in tensors)

    def __len__(self) -> int:
        return self.capacity - self._free_count

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Slot of each key (int64 [N] on this device), -1 where absent."""
        return self.index.find(keys.to(self.device))

    def touch(self, slots: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """Record ``counts`` accesses (default one each) of ``slots`` for LFU."""
        if counts is None:
            weights, accesses = torch.full_like(slots, self._increment, dtype=torch.float32), slots.numel()
        else:
            weights, accesses = counts.to(self.device, torch.float32) * self._increment, int(counts.sum())
        self._add_scores(slots, weights)
        self._increment *= self._growth ** accesses
        if self._increment > _RENORMALISE_AT:
            self.score /= self._increment
            self._increment = 1.0

    def _add_scores(self, slots: torch.Tensor, weights: torch.Tensor) -> None:
        self.score.index_add_(0, slots, weights)

    def read(self, slots: torch.Tensor, columns: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[N, columns]`` copy of the first ``columns`` (default all) of rows at ``slots``
        (into ``out`` when given: contiguous, on this device)."""
        if out is None:
            return self.rows[:, :columns].index_select(0, slots)
        return torch.index_select(self.rows[:, :columns], 0, slots, out=out)

    def _copy_rows(self, slots: torch.Tensor, values: torch.Tensor, columns: int | None = None) -> None:
        """The first ``columns`` (default all) of rows at ``slots`` (distinct) = ``values``; no flags change."""
        self.rows[:, :columns].index_copy_(0, slots, values.to(self.device, self.rows.dtype))

    def write(self, slots: torch.Tensor, values: torch.Tensor, columns: int | None = None) -> None:
        """Overwrite the first ``columns`` (default all) of rows at ``slots`` (distinct); mark them dirty."""
        self._copy_rows(slots, values, columns)
        self.dirty[slots] = True

    def apply_optimizer(self, optimizer, slots: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        """Fused ``optimizer`` step on rows at ``slots`` (distinct) with ``grad [N, dim]``; marks them dirty."""
        if self._update_buffer.shape[0] < slots.numel():
            self._update_buffer = self.rows.new_empty(slots.numel(), self.rows.shape[1])
        optimizer.update(self.rows, slots, grad.to(self.device, self.rows.dtype), step, self._update_buffer)
        self.dirty[slots] = True

    def take(self, keys: torch.Tensor) -> tuple[torch.Tensor, Rows]:
        """Remove ``keys`` (distinct) that are cached; returns ``(found [N] bool, their Rows)``."""
        slots = self.find(keys)
        found = slots >= 0
        slots = slots[found]
        taken = Rows(self.slot_keys[slots], self.rows[slots], self.dirty[slots], self.fresh[slots])
        self.index.remove(taken.keys)
        self._release(slots)
        return found.cpu(), taken

    def _release(self, slots: torch.Tensor) -> None:
        self.slot_keys[slots] = -1
        self.score[slots] = 0
        self.dirty[slots] = False
        self.fresh[slots] = False
        self._free[self._free_count:self._free_count + slots.numel()] = slots
        self._free_count += slots.numel()

    def admit(self, incoming: Rows, protected: torch.Tensor | None = None) -> tuple[torch.Tensor, Rows]:
        """Cache ``incoming`` (keys distinct and absent); returns ``(their slots, evicted Rows)``.

        Victims are the lowest-score occupied slots outside ``protected``; every evicted row is
        returned (dirty or not) so the caller can hand it to the tier below.
        """
        count = len(incoming)
        from_free = min(count, self._free_count)
        slots = self._free[self._free_count - from_free:self._free_count].clone()
        self._free_count -= from_free
        evicted = Rows(*(tensor[:0] for tensor in (self.slot_keys, self.rows, self.dirty, self.fresh)))
        if count > from_free:
            victims = self._choose_victims(count - from_free, protected)
            evicted = Rows(self.slot_keys[victims], self.read(victims), self.dirty[victims], self.fresh[victims])
            self.index.remove(evicted.keys)
            slots = torch.cat([slots, victims])
            self.stats.evictions += victims.numel()
            self.stats.writebacks += int(evicted.dirty.sum())
        keys = incoming.keys.to(self.device)
        self.index.insert(keys, slots)
        self.slot_keys[slots] = keys
        self._copy_rows(slots, incoming.rows)
        self.dirty[slots] = incoming.dirty.to(self.device)
        self.fresh[slots] = incoming.fresh.to(self.device)
        self.score[slots] = 0
        self.stats.rows_in += count
        return slots, evicted

    def _victim_scores(self, protected: torch.Tensor | None) -> torch.Tensor:
        """Each slot's score, +inf where it cannot be a victim (free, or needed by the batch)."""
        candidates = self.score.clone()
        candidates[self.slot_keys < 0] = float("inf")  # slots being filled by this batch
        if protected is not None and protected.numel():
            candidates[protected] = float("inf")
        return candidates

    def _choose_victims(self, count: int, protected: torch.Tensor | None) -> torch.Tensor:
        """Slots (int64 [count]) of the ``count`` lowest scores that may be evicted."""
        candidates = self._victim_scores(protected)
        if candidates.device.type == "cpu":  # numpy's introselect: about 2x torch.topk's time saved
            victims = torch.from_numpy(np.argpartition(candidates.numpy(), count - 1)[:count])
        else:
            victims = torch.topk(candidates, count, largest=False, sorted=False).indices
        if not bool(torch.isfinite(candidates[victims]).all()):  # fewer than count evictable slots
            available = int(torch.isfinite(candidates).sum())
            raise CacheCapacityError(
                f"the {self.name} cache holds {self.capacity} rows and the current batch needs "
                f"{count} more than it can evict ({available} evictable); raise its budget or "
                f"split the batch"
            )
        return victims

    def dirty_rows(self) -> tuple[torch.Tensor, Rows]:
        """Slots and Rows of every dirty row (for flush)."""
        slots = self.dirty.nonzero().squeeze(1)
        return slots, Rows(self.slot_keys[slots], self.rows[slots], self.dirty[slots], self.fresh[slots])

    def mark_clean(self, slots: torch.Tensor) -> None:
        self.dirty[slots] = False
        self.fresh[slots] = False
