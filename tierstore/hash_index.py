"""A vectorised bucketed hash map from int64 keys to integer values, in torch ops.

The table is ``[buckets, BUCKET_SLOTS]`` keys (one 64-byte cache line per bucket) beside a
same-shaped value array, as in HierarchicalKV. A key lives in its home bucket or, when that is
full, in the following ones (linear probing over buckets). Every operation takes a batch of keys
and runs a few rounds of whole-batch tensor ops — one bucket row gathered per pending key per
round — so there is no per-key Python work, and it runs on any torch device. Removed keys leave
tombstones; the table rebuilds itself when live keys and tombstones together pass ``MAX_LOAD``,
and grows when live keys alone would.
"""

from __future__ import annotations

import math

import torch

EMPTY = -1
TOMBSTONE = -2
BUCKET_SLOTS = 8
MAX_LOAD = 0.5
_HASH_MULTIPLIER = -7046029254386353131  # 0x9E3779B97F4A7C15 (Fibonacci hashing) as int64
_INT63_MASK = (1 << 63) - 1


def buckets_for(capacity: int) -> int:
    """Buckets that keep ``capacity`` keys at or under ``MAX_LOAD``."""
    return max(1, math.ceil(capacity / (MAX_LOAD * BUCKET_SLOTS)))


def index_nbytes(capacity: int, value_dtype: torch.dtype) -> int:
    """Bytes a ``HashIndex(capacity, value_dtype=...)`` allocates."""
    value_size = torch.empty((), dtype=value_dtype).element_size()
    return buckets_for(capacity) * BUCKET_SLOTS * (8 + value_size)


class HashIndex:
    """Batched map ``int64 key >= 0 -> value`` on ``device``.

    ``capacity``: keys the initial table holds; ``insert`` grows the table past it when needed.
    ``value_dtype``: int32 for cache slots (smaller), int64 for row numbers of huge files.
    Memory: ``index_nbytes(capacity, value_dtype)`` bytes. Keys passed to ``insert``/``remove``
    must be distinct within the batch.
    """

    def __init__(self, capacity: int, device: torch.device | str = "cpu", value_dtype: torch.dtype = torch.int64) -> None:
        self.device = torch.device(device)
        self.value_dtype = value_dtype
        self._allocate(buckets_for(capacity))

    def _allocate(self, buckets: int) -> None:
        self.keys = torch.full((buckets, BUCKET_SLOTS), EMPTY, dtype=torch.int64, device=self.device)
        self.values = torch.full((buckets, BUCKET_SLOTS), -1, dtype=self.value_dtype, device=self.device)
        self.live = 0
        self.tombstones = 0

    @property
    def buckets(self) -> int:
        return self.keys.shape[0]

    @property
    def slots(self) -> int:
        return self.keys.numel()

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def __len__(self) -> int:
        return self.live

    def _home(self, keys: torch.Tensor) -> torch.Tensor:
        mixed = keys * _HASH_MULTIPLIER
        mixed = mixed ^ ((mixed >> 29) & ((1 << 35) - 1))
        return (mixed & _INT63_MASK) % self.buckets

    def positions(self, keys: torch.Tensor) -> torch.Tensor:
        """Flat table position of each key (int64 [N]), -1 where the key is absent."""
        result = torch.full_like(keys, -1)
        pending = torch.arange(keys.numel(), device=self.device)
        bucket = self._home(keys)
        wanted = keys
        for _ in range(self.buckets):
            if pending.numel() == 0:
                break
            row = self.keys.index_select(0, bucket)  # [P, BUCKET_SLOTS]
            hit_row, hit_slot = (row == wanted[:, None]).nonzero(as_tuple=True)
            result[pending[hit_row]] = bucket[hit_row] * BUCKET_SLOTS + hit_slot
            going_on = ~(row == EMPTY).any(dim=1)  # a bucket with an empty slot ends the chain
            going_on[hit_row] = False
            pending, wanted = pending[going_on], wanted[going_on]
            bucket = (bucket[going_on] + 1) % self.buckets
        return result

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Value of each key (int64 [N]), -1 where the key is absent."""
        position = self.positions(keys)
        values = self.values.view(-1)[position.clamp(min=0)].to(torch.int64)
        return values.masked_fill_(position < 0, -1)

    def insert(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``keys`` (distinct, none present yet) with ``values``; grows the table as needed."""
        if keys.numel() == 0:
            return
        if self.live + keys.numel() > MAX_LOAD * self.slots:
            self._rebuild(buckets_for(2 * (self.live + keys.numel())))
        elif self.live + self.tombstones + keys.numel() > MAX_LOAD * self.slots:
            self._rebuild(self.buckets)  # clears tombstones
        self._place(keys, values.to(self.value_dtype))

    def _place(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        flat_keys, flat_values = self.keys.view(-1), self.values.view(-1)
        pending = torch.arange(keys.numel(), device=self.device)
        bucket = self._home(keys)
        while pending.numel():
            row = self.keys.index_select(0, bucket)
            free = row < 0  # empty or tombstone
            has_free = free.any(dim=1)
            # Each claimant takes its bucket's first free slot; claimants of one slot race and
            # exactly one write survives, the rest retry next round.
            claimants = pending[has_free]
            spots = bucket[has_free] * BUCKET_SLOTS + free[has_free].to(torch.uint8).argmax(dim=1)
            was_tombstone = flat_keys[spots] == TOMBSTONE
            flat_keys[spots] = keys[claimants]
            won = flat_keys[spots] == keys[claimants]
            flat_values[spots[won]] = values[claimants[won]]
            self.live += int(won.sum())
            self.tombstones -= int(was_tombstone[won].sum())
            retry = ~has_free
            retry[has_free] = ~won
            bucket = torch.where(has_free, bucket, (bucket + 1) % self.buckets)[retry]
            pending = pending[retry]

    def remove(self, keys: torch.Tensor) -> torch.Tensor:
        """Remove ``keys`` (distinct); returns their former values (int64, -1 for absent keys)."""
        position = self.positions(keys)
        present = position >= 0
        flat_keys, flat_values = self.keys.view(-1), self.values.view(-1)
        old = torch.full_like(keys, -1)
        old[present] = flat_values[position[present]].to(torch.int64)
        flat_keys[position[present]] = TOMBSTONE
        removed = int(present.sum())
        self.live -= removed
        self.tombstones += removed
        return old

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All live ``(keys, values)`` (values as int64), in table order."""
        live = self.keys >= 0
        return self.keys[live], self.values[live].to(torch.int64)

    def _rebuild(self, buckets: int) -> None:
        keys, values = self.items()
        self._allocate(buckets)
        self._place(keys, values.to(self.value_dtype))
