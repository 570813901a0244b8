"""The native step's side of a cache tier: a batch resolved in one native pass, and the tier's
arrays and slots handed to ``step_make_resident`` (``RowCache``'s part)."""

from __future__ import annotations

import operator

import torch

from ..kernels.cache_passes import layout_arguments
from ..kernels.launch import ROW_FORMATS
from ..kernels.native_types import HostTierArrays, Residency, TierChoice
from .policies import LfuWithAgeing, too_few_evictable


class NativeSide:
    """``RowCache``'s calls for the native passes (``kernels.cache_passes``, ``kernels.step_passes``)."""

    def resolve(
        self, keys: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
        """A lookup of distinct ``keys`` (each ``counts`` times) in one native pass, where the tier
        runs the tuned host build with LFU: ``(slots, hit_slots, missed, lookups)``, each key's slot
        (-1: absent), the hits' slots (touched and counted, as ``touch`` would), the misses'
        positions in ``keys`` and all the lookups counted; ``touch_admitted`` then counts the
        misses once they are resident. None where the tier has no such pass (``find`` and
        ``touch`` serve it)."""
        if self._passes is None or type(self.policy) is not LfuWithAgeing:
            return None
        policy = self.policy
        slots, hit_slots, missed, hits, misses = self._passes.resolve(
            self, keys, counts, policy.score, policy.increment
        )
        self.stats.hits += hits
        self.stats.misses += misses
        return slots, hit_slots, missed, hits + misses

    def touch_admitted(self, slots: torch.Tensor, counts: torch.Tensor, lookups: int) -> None:
        """After ``resolve``: the accesses of the missed keys, now at ``slots`` (their ``counts``)
        counted, at the weight the hits had; later accesses weigh more (``lookups``: the resolve's)."""
        policy = self.policy
        self._passes.add_counts(policy.score, slots, counts, policy.increment)
        policy.advance(lookups)

    def native_arrays(self) -> HostTierArrays | None:
        if self._passes is None or type(self.policy) is not LfuWithAgeing or self.index.tombstones:
            return None
        index, made = self.index, self._native_arrays
        tensors = (
            index.keys,
            index.values,
            self.slot_keys,
            self.rows,
            self.dirty,
            self.fresh,
            self.policy.score,
        )
        if made is not None and all(map(operator.is_, tensors, made[0])):
            return made[1]  # the same tensors: the same addresses
        arrays = HostTierArrays(
            index.keys.data_ptr(),
            index.values.data_ptr(),
            index.keys.numel() - 1,
            self.slot_keys.data_ptr(),
            self.rows.data_ptr(),
            self.rows.shape[1],
            self.dirty.data_ptr(),
            self.fresh.data_ptr(),
            self.policy.score.data_ptr(),
            ROW_FORMATS[self.rows.dtype],
            *layout_arguments(self),
        )
        self._native_arrays = (tensors, arrays)
        return arrays

    def claim_slots(
        self, count: int, protected: torch.Tensor, keys: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """Slots for ``count`` rows about to be admitted (int64 [count]: free slots, then the policy's
        victims outside ``protected``) and how many are victims (the last ones); nothing is taken
        yet. Where the rows' ``keys`` are given and all fit in free slots, those with a free home
        in the tier's direct layout get it. Raises ``CacheCapacityError`` where too few slots are
        evictable."""
        if count > self._free_count and self.capacity < self.max_capacity:
            self._grow_for(count)
        if self.direct is not None and keys is not None and count <= self._free_count:
            return self._passes.direct_claims(
                self, self._free, self._free_positions, self._free_count, keys
            ), 0
        from_free = min(count, self._free_count)
        free = self._free[self._free_count - from_free : self._free_count]
        if count == from_free:
            return free.clone(), 0
        victims = self._victims(count - from_free, protected)
        return torch.cat([free, victims]), victims.numel()

    def native_choice(self, room: int) -> tuple[TierChoice, tuple[torch.Tensor, ...]]:
        """For a native call that makes up to ``room`` rows resident (``step_make_resident``): the
        free slots and LFU's pool as it takes them, and the tensors behind them (kept alive until
        ``settle_native``, which is given them back)."""
        policy = self.policy
        held = (self._free, *policy.native_pool(room))
        free, pool, pool_scores, pool_keys, ranked, ranked_scores, ranked_keys = held
        choice = TierChoice(
            self.pins.data_ptr(),
            self.capacity,
            free.data_ptr(),
            0 if self.direct is None else self._free_positions.data_ptr(),
            self._free_count,
            pool.data_ptr(),
            pool_scores.data_ptr(),
            pool_keys.data_ptr(),
            pool.numel(),
            ranked_scores.numel(),
            ranked.data_ptr(),
            ranked_scores.data_ptr(),
            ranked_keys.data_ptr(),
            policy.increment,
        )
        return choice, held

    def settle_native(self, done: Residency, held: tuple[torch.Tensor, ...]) -> None:
        """After ``step_make_resident`` (given ``native_choice``'s tensors back): the lookups counted,
        the pool's change kept and, where the rows came in, the slots taken and the counters moved.
        Raises ``CacheCapacityError`` where too few slots were evictable."""
        self.stats.hits += done.hit_lookups
        self.stats.misses += done.missed_lookups
        if done.victims:
            self.policy.took_natively(done.pool_taken, held[4:], done.ranked_count, done.victims)
        if done.status == Residency.NO_ROOM:
            self._no_room(str(too_few_evictable(done.victims, done.detail)))
        if done.status != Residency.RESIDENT:
            return
        count, victims = done.misses, done.victims
        self._free_count -= count - victims
        self.index.live += count - victims
        self.vacated += victims
        self.stats.evictions += victims
        self.stats.writebacks += done.written_back
        self.stats.rows_in += count
        self.policy.advance(done.hit_lookups + done.missed_lookups)
