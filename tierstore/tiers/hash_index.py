"""A vectorised bucketed hash map from int64 keys to integer values, in torch ops.

The table is ``[buckets, BUCKET_SLOTS]`` keys (one 64-byte cache line per bucket) beside a
same-shaped value array, as in HierarchicalKV. A key lives in its home bucket or, when that is
full, in the following ones (linear probing over buckets). Every operation takes a batch of keys
and runs a few rounds of whole-batch tensor ops — one bucket row gathered per pending key per
round — so there is no per-key Python work, and it runs on any torch device. Removed keys leave
tombstones where a chain may pass; the table rebuilds itself when live keys and tombstones
together pass ``MAX_LOAD_WITH_TOMBSTONES``, and grows when live keys alone pass ``MAX_LOAD``.
"""

from __future__ import annotations

import math

import torch

EMPTY = -1
TOMBSTONE = -2
BUCKET_SLOTS = 8
MAX_LOAD = 0.5
MAX_LOAD_WITH_TOMBSTONES = 0.75  # tombstones lengthen chains; past this the table rebuilds
_CHAIN_WINDOW = 4  # buckets probed per round once a key's home bucket is full
_HASH_MULTIPLIER = -7046029254386353131  # 0x9E3779B97F4A7C15 (Fibonacci hashing) as int64
_LOW32 = (1 << 32) - 1
# Byte k of this constant (little-endian) holds 7 - k, so multiplying the one-hot word 1 << 8s by it
# puts s in the top byte: the slot number of a bucket's single marked byte, in two integer ops.
_SLOT_OF_BYTE = 0x0001020304050607


def buckets_for(capacity: int) -> int:
    """Buckets that keep ``capacity`` keys at or under ``MAX_LOAD``."""
    return max(1, math.ceil(capacity / (MAX_LOAD * BUCKET_SLOTS)))


def index_nbytes(capacity: int, value_dtype: torch.dtype) -> int:
    """Bytes a ``HashIndex(capacity, value_dtype=...)`` allocates."""
    value_size = torch.empty((), dtype=value_dtype).element_size()
    return buckets_for(capacity) * BUCKET_SLOTS * (8 + value_size)


class BatchedHashTable:
    """What both batched hash tables (``HashIndex`` in torch ops, ``KernelHashTable`` on the kernels)
    share: keys (int64, ``EMPTY`` or ``TOMBSTONE`` where free) beside values, counts, enumeration
    and rebuilding. A subclass allocates its arrays (``_allocate``) and places keys (``_place``)."""

    keys: torch.Tensor
    values: torch.Tensor
    live: int
    tombstones: int

    def _allocate(self, size: int) -> None:
        raise NotImplementedError

    def _place(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def __len__(self) -> int:
        return self.live

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All live ``(keys, values)`` (values as int64), in table order."""
        live = self.keys >= 0
        return self.keys[live], self.values[live].to(torch.int64)

    def _rebuild(self, size: int) -> None:
        """Re-place every live key in a fresh table of ``size`` (clears tombstones)."""
        keys, values = self.items()
        self._allocate(size)
        self._place(keys, values.to(self.value_dtype))


class HashIndex(BatchedHashTable):
    """Batched map ``int64 key >= 0 -> value`` on ``device``.

    ``capacity``: keys the initial table holds; ``insert`` grows the table past it when needed.
    ``value_dtype``: int32 for cache slots (smaller), int64 for row numbers of huge files.
    Memory: ``index_nbytes(capacity, value_dtype)`` bytes. Keys passed to ``insert``/``remove``
    must be distinct within the batch.
    """

    def __init__(
        self, capacity: int, device: torch.device | str = "cpu", value_dtype: torch.dtype = torch.int64
    ) -> None:
        self.device = torch.device(device)
        self.value_dtype = value_dtype
        self._allocate(buckets_for(capacity))

    def _allocate(self, buckets: int) -> None:
        self.keys = torch.full((buckets, BUCKET_SLOTS), EMPTY, dtype=torch.int64, device=self.device)
        self.values = torch.full((buckets, BUCKET_SLOTS), -1, dtype=self.value_dtype, device=self.device)
        self.live = 0
        self.tombstones = 0
        self._scratch_rows = self.keys[:0]
        self._scratch_marks = self.keys[:0] == 0

    @property
    def buckets(self) -> int:
        return self.keys.shape[0]

    @property
    def slots(self) -> int:
        return self.keys.numel()

    def _home(self, keys: torch.Tensor) -> torch.Tensor:
        """Home bucket of each key: the top 32 bits of a Fibonacci hash scaled to ``[0, buckets)``
        by a multiply and shift (no division). In-place steps: one allocation per call."""
        mixed = keys * _HASH_MULTIPLIER
        mixed >>= 32
        mixed &= _LOW32
        mixed *= self.buckets
        return mixed.__irshift__(32)

    def _probe_scratch(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reused ``[count, BUCKET_SLOTS]`` buffers for a probe round's bucket rows and matches
        (allocating them afresh per batch costs page faults on the CPU)."""
        if self._scratch_rows.shape[0] < count:
            self._scratch_rows = torch.empty(count, BUCKET_SLOTS, dtype=torch.int64, device=self.device)
            self._scratch_marks = torch.empty(count, BUCKET_SLOTS, dtype=torch.bool, device=self.device)
        return self._scratch_rows[:count], self._scratch_marks[:count]

    def positions(self, keys: torch.Tensor) -> torch.Tensor:
        """Flat table position of each key (int64 [N]), -1 where the key is absent."""
        return self._probe(keys)[0]

    def _probe(self, keys: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """``(positions [N], whether every key was found)``.

        Round one probes every key's home bucket with whole-batch, mostly in-place ops and
        usually settles the batch; later rounds follow only the keys whose home bucket was full
        without holding them.
        """
        position = self._home(keys)
        row, marks = self._probe_scratch(keys.numel())
        torch.index_select(self.keys, 0, position, out=row)
        word = _marked_bytes(torch.eq(row, keys[:, None], out=marks))  # one marked byte at most
        hit = word != 0
        position *= BUCKET_SLOTS
        word *= _SLOT_OF_BYTE  # in place: the scratch buffer is not needed again
        position += word.__irshift__(56)  # bucket * slots + slot
        if bool(hit.all()):
            return position, True
        pending = (~hit).nonzero().squeeze(1)
        position.masked_fill_(~hit, -1)
        pending = pending[~_any_marked(row[pending] == EMPTY)]  # a bucket with an empty slot ends the chain
        self._follow_chains(keys, pending, self._home(keys[pending]), position)
        return position, False

    def _follow_chains(
        self, keys: torch.Tensor, pending: torch.Tensor, bucket: torch.Tensor, result: torch.Tensor
    ) -> None:
        """Probe the ``_CHAIN_WINDOW`` buckets after ``bucket`` for ``keys[pending]`` (their home
        buckets were full without them), window after window, and fill ``result`` in place."""
        window_offsets = torch.arange(1, _CHAIN_WINDOW + 1, device=self.device)
        for _ in range(0, self.buckets, _CHAIN_WINDOW):
            if pending.numel() == 0:
                break
            window = (bucket[:, None] + window_offsets) % self.buckets  # [P, W]
            rows = self.keys.index_select(0, window.view(-1)).view(pending.numel(), -1)  # [P, W * slots]
            marks = rows == keys[pending][:, None]
            hit = marks.any(dim=1)
            at = marks.to(torch.uint8).argmax(dim=1)
            found_bucket = window.gather(1, (at // BUCKET_SLOTS)[:, None]).squeeze(1)
            result[pending[hit]] = (found_bucket * BUCKET_SLOTS + at % BUCKET_SLOTS)[hit]
            going_on = ~hit & ~(rows == EMPTY).any(dim=1)
            pending, bucket = pending[going_on], window[going_on, -1]

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Value of each key (int64 [N]), -1 where the key is absent."""
        position, all_found = self._probe(keys)
        if all_found:
            return self.values.view(-1).index_select(0, position).to(torch.int64)
        missing = position < 0
        values = self.values.view(-1).index_select(0, position.masked_fill(missing, 0)).to(torch.int64)
        return values.masked_fill_(missing, -1)

    def insert(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``keys`` (distinct, none present yet) with ``values``; grows the table as needed."""
        if keys.numel() == 0:
            return
        self.make_room(keys.numel())
        self._place(keys, values.to(self.value_dtype))

    def reserve(self, capacity: int) -> None:
        """As large as a table made for ``capacity`` keys (rebuilt to that size if smaller)."""
        if self.buckets < buckets_for(capacity):
            self._rebuild(buckets_for(capacity))

    def make_room(self, count: int) -> None:
        """Rebuild or grow the table now if ``count`` more keys would pass its load limits."""
        if self.live + count > MAX_LOAD * self.slots:
            self._rebuild(buckets_for(2 * (self.live + count)))
        elif self.live + self.tombstones + count > MAX_LOAD_WITH_TOMBSTONES * self.slots:
            self._rebuild(self.buckets)  # clears tombstones

    def _place(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write absent, distinct ``keys`` into free slots (empty or tombstone), linear probing
        over buckets. Keys sharing a bucket are ranked, and the key of rank r takes the bucket's
        r-th free slot, so one round places every key whose bucket has room; the rest (their
        bucket is now full) try the next bucket in the next round."""
        flat_keys, flat_values = self.keys.view(-1), self.values.view(-1)
        pending = torch.arange(keys.numel(), device=self.device)
        bucket = self._home(keys)
        while pending.numel():
            rank = _rank_within_groups(bucket)
            free = self.keys.index_select(0, bucket) < 0  # [P, slots]
            free_before = free.cumsum(dim=1)
            placed = rank < free_before[:, -1]
            slot = (free_before <= rank[:, None]).sum(dim=1)  # the rank-th free slot (from 0)
            spots = (bucket * BUCKET_SLOTS + slot)[placed]
            self.tombstones -= int((flat_keys[spots] == TOMBSTONE).sum())
            flat_keys[spots] = keys[pending[placed]]
            flat_values[spots] = values[pending[placed]]
            self.live += spots.numel()
            going_on = ~placed
            pending, bucket = pending[going_on], (bucket[going_on] + 1) % self.buckets

    def remove(self, keys: torch.Tensor) -> torch.Tensor:
        """Remove ``keys`` (distinct); returns their former values (int64, -1 for absent keys).

        A removed key leaves a tombstone only where a chain may pass: in a bucket with no empty
        slot. A bucket that still has one has never been full (slots never return to empty
        between rebuilds), so no key was ever placed past it, and its slot can simply be emptied.
        That keeps tombstones, and the rebuilds they force, rare under steady eviction.
        """
        position = self.positions(keys)
        present = position >= 0
        flat_keys, flat_values = self.keys.view(-1), self.values.view(-1)
        old = torch.full_like(keys, -1)
        position = position[present]
        old[present] = flat_values[position].to(torch.int64)
        never_full = _any_marked(self.keys.index_select(0, position // BUCKET_SLOTS) == EMPTY)
        flat_keys[position] = torch.where(never_full, EMPTY, TOMBSTONE)
        removed = position.numel()
        self.live -= removed
        self.tombstones += removed - int(never_full.sum())
        return old


def _rank_within_groups(groups: torch.Tensor) -> torch.Tensor:
    """For each element of ``groups`` (int64 [N]), how many earlier elements share its value."""
    order = torch.argsort(groups, stable=True)
    ordered = groups[order]
    index = torch.arange(groups.numel(), device=groups.device)
    starts_group = torch.ones_like(ordered, dtype=torch.bool)
    starts_group[1:] = ordered[1:] != ordered[:-1]
    group_start = torch.where(starts_group, index, 0).cummax(dim=0).values
    rank = torch.empty_like(index)
    rank[order] = index - group_start
    return rank


def _marked_bytes(marks: torch.Tensor) -> torch.Tensor:
    """A ``[N, BUCKET_SLOTS]`` bool tensor read as one int64 word per row (byte s = slot s)."""
    return marks.contiguous().view(torch.int64).squeeze(1)


def _any_marked(marks: torch.Tensor) -> torch.Tensor:
    """bool [N]: whether each row of ``marks [N, BUCKET_SLOTS]`` has a marked slot."""
    return _marked_bytes(marks) != 0
