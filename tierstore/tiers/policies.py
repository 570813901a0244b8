"""Eviction policies of a cache tier: which slots to evict, from what the tier tells them.

A policy is a value given to ``RowCache`` as a factory ``policy(capacity, device, backend)``;
it keeps its own per-slot state and is told of every access (``touch``), every admitted and
released slot, and asked for victims. The backend (``tiers.backends``) runs its bulk operations,
so the same policy runs on torch ops or on the kernels. A new policy (next use within a lookahead
window, an admission filter) is a new subclass of ``EvictionPolicy``.
"""

from __future__ import annotations

import abc

import numpy as np
import torch

from ..errors import CacheCapacityError

_RENORMALISE_AT = 2.0**20
POOL_SHARE = 1 / 32  # of the capacity: victims ranked ahead by one scan of every slot


class EvictionPolicy(abc.ABC):
    """Per-slot state of one tier's policy; slots are int64 ``[N]`` positions in its row buffer."""

    bytes_per_slot = 0  # what the policy allocates per slot (the tier's byte budget counts it)

    def __init__(self, capacity: int, device: torch.device, backend) -> None:
        self.capacity = capacity
        self.device = device
        self.backend = backend

    @property
    @abc.abstractmethod
    def nbytes(self) -> int: ...

    @abc.abstractmethod
    def touch(self, slots: torch.Tensor, counts: torch.Tensor | None) -> None:
        """``counts [N]`` accesses (default one each) of the rows at ``slots``."""

    @abc.abstractmethod
    def reset(self, slots: torch.Tensor) -> None:
        """``slots`` were just filled or emptied: forget their history."""

    @abc.abstractmethod
    def victims(self, count: int, slot_keys: torch.Tensor, protected: torch.Tensor | None) -> torch.Tensor:
        """``count`` occupied slots (int64) to evict, none of ``protected``; ``slot_keys [capacity]``
        is -1 at slots being filled. Raises ``CacheCapacityError`` when fewer can be evicted."""


class LfuWithAgeing(EvictionPolicy):
    """LFU with ageing: an access adds ``increment`` to its slot's score, and ``increment`` grows by
    ``2 ** (1 / half_life)`` per access, which is the same as halving every older score each
    ``half_life`` accesses (so a shifted distribution is followed) at O(batch) cost.
    ``half_life``: accesses (default 4x the capacity); ``inf`` is plain LFU.

    Victims are exactly the lowest-scored slots, but not found by a scan of every slot per batch:
    a scan ranks ``POOL_SHARE`` of the capacity beyond the victims it needs into a pool (with the
    slots the batch protects that rank as low), ``threshold`` being the highest score ranked.
    Scores only grow (ageing rescales them all alike), so every slot outside the pool and the
    slots filled since scores at least ``threshold``; the next batches take their victims from
    the pool and those new slots while enough of them score at most ``threshold``, and scan
    again when too few do."""

    bytes_per_slot = 4 + 1 + 1  # the score, the victim mask, and at most 1 for the pool and new slots

    def __init__(self, capacity: int, device: torch.device, backend, half_life: float | None = None) -> None:
        super().__init__(capacity, device, backend)
        self.score = torch.zeros(capacity, dtype=torch.float32, device=device)
        self._blocked = torch.zeros(capacity, dtype=torch.uint8, device=device)
        self._increment = 1.0
        self._growth = 2.0 ** (1.0 / (half_life or 4.0 * capacity))
        self._pool_size = int(capacity * POOL_SHARE)
        self._pool: torch.Tensor | None = None  # slots ranked low by the last scan, not yet taken
        self._threshold = 0.0  # the highest score that scan ranked
        self._filled: list[torch.Tensor] = []  # slots filled or emptied since then

    @property
    def nbytes(self) -> int:
        return self.score.nbytes + self._blocked.nbytes + self.capacity  # the pool's bound

    def touch(self, slots: torch.Tensor, counts: torch.Tensor | None) -> None:
        if counts is None:
            weights, accesses = torch.full_like(slots, self._increment, dtype=torch.float32), slots.numel()
        else:
            weights, accesses = counts.to(self.device, torch.float32) * self._increment, int(counts.sum())
        self.backend.add_scores(self.score, slots, weights)
        self._increment *= self._growth**accesses
        if self._increment > _RENORMALISE_AT:
            self.score /= self._increment
            self._threshold /= self._increment
            self._increment = 1.0

    def reset(self, slots: torch.Tensor) -> None:
        self.score[slots] = 0
        if self._pool is not None:
            self._filled.append(slots.clone())
            if sum(part.numel() for part in self._filled) > self._pool_size:  # bounded: scan anew
                self._pool, self._filled = None, []

    def victims(self, count: int, slot_keys: torch.Tensor, protected: torch.Tensor | None) -> torch.Tensor:
        self._blocked.zero_()
        if protected is not None and protected.numel():
            self._blocked[protected] = 1
        if self._pool is not None:
            candidates = torch.unique(torch.cat([self._pool, *self._filled]))
            candidates = candidates[
                (self.score[candidates] <= self._threshold) & (slot_keys[candidates] >= 0)
            ]
            if int((self._blocked[candidates] == 0).sum()) >= count:
                return self._take(candidates, count)
        scores = self.backend.victim_scores(self.score, slot_keys, self._blocked)
        ranked = _lowest(scores, min(count + self._pool_size, self.capacity))
        ranked = ranked[torch.isfinite(scores[ranked])]
        if ranked.numel() < count:
            available = int(torch.isfinite(scores).sum())
            raise CacheCapacityError(
                f"the current batch needs {count} more than it can evict ({available} evictable); "
                f"raise its budget or split the batch"
            )
        self._threshold = float(scores[ranked].max())
        if protected is not None and protected.numel():  # needed now, but ranked low: pooled for later
            ranked = torch.cat([ranked, protected[self.score[protected] <= self._threshold]])
        return self._take(ranked, count)

    def _take(self, candidates: torch.Tensor, count: int) -> torch.Tensor:
        """The ``count`` lowest-scored of ``candidates`` (distinct slots) not blocked now; the
        others become the pool."""
        choosable = (self._blocked[candidates] == 0).nonzero().squeeze(1)
        chosen = choosable[_lowest(self.score[candidates[choosable]], count)]
        rest = torch.ones(candidates.numel(), dtype=torch.bool, device=candidates.device)
        rest[chosen] = False
        self._pool, self._filled = candidates[rest], []
        return candidates[chosen]


def _lowest(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Positions of the ``count`` lowest of ``scores``, in no order."""
    if count >= scores.numel():
        return torch.arange(scores.numel(), device=scores.device)
    if scores.device.type == "cpu":  # numpy's introselect beats torch.topk on the CPU
        return torch.from_numpy(np.argpartition(scores.numpy(), count - 1)[:count])
    return torch.topk(scores, count, largest=False, sorted=False).indices
