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
    ``half_life``: accesses (default 4x the capacity); ``inf`` is plain LFU."""

    bytes_per_slot = 4 + 1  # the score and the victim mask

    def __init__(self, capacity: int, device: torch.device, backend, half_life: float | None = None) -> None:
        super().__init__(capacity, device, backend)
        self.score = torch.zeros(capacity, dtype=torch.float32, device=device)
        self._blocked = torch.zeros(capacity, dtype=torch.uint8, device=device)
        self._increment = 1.0
        self._growth = 2.0 ** (1.0 / (half_life or 4.0 * capacity))

    @property
    def nbytes(self) -> int:
        return self.score.nbytes + self._blocked.nbytes

    def touch(self, slots: torch.Tensor, counts: torch.Tensor | None) -> None:
        if counts is None:
            weights, accesses = torch.full_like(slots, self._increment, dtype=torch.float32), slots.numel()
        else:
            weights, accesses = counts.to(self.device, torch.float32) * self._increment, int(counts.sum())
        self.backend.add_scores(self.score, slots, weights)
        self._increment *= self._growth**accesses
        if self._increment > _RENORMALISE_AT:
            self.score /= self._increment
            self._increment = 1.0

    def reset(self, slots: torch.Tensor) -> None:
        self.score[slots] = 0

    def victims(self, count: int, slot_keys: torch.Tensor, protected: torch.Tensor | None) -> torch.Tensor:
        self._blocked.zero_()
        if protected is not None and protected.numel():
            self._blocked[protected] = 1
        candidates = self.backend.victim_scores(self.score, slot_keys, self._blocked)
        if candidates.device.type == "cpu":  # numpy's introselect beats torch.topk on the CPU
            victims = torch.from_numpy(np.argpartition(candidates.numpy(), count - 1)[:count])
        else:
            victims = torch.topk(candidates, count, largest=False, sorted=False).indices
        if not bool(torch.isfinite(candidates[victims]).all()):
            available = int(torch.isfinite(candidates).sum())
            raise CacheCapacityError(
                f"the current batch needs {count} more than it can evict ({available} evictable); "
                f"raise its budget or split the batch"
            )
        return victims
