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
from ..kernels.cache_passes import cache_passes_of
from ..kernels.host import host_step_library
from . import huge_pages
from .ageing import AgeingTuner, tuner_nbytes

_RENORMALISE_AT = 2.0**20
POOL_SHARE = 1 / 32  # of the capacity: victims ranked ahead by one scan of every slot


def too_few_evictable(wanted: int, evictable: int) -> CacheCapacityError:
    """The error of a policy asked for ``wanted`` victims where only ``evictable`` slots may go."""
    return CacheCapacityError(
        f"the current batch needs {wanted} more than it can evict ({evictable} evictable); "
        "raise its budget or split the batch"
    )


class EvictionPolicy(abc.ABC):
    """Per-slot state of one tier's policy; slots are int64 ``[N]`` positions in its row buffer."""

    bytes_per_slot = 0  # what the policy allocates per slot (the tier's byte budget counts it)

    @staticmethod
    def fixed_nbytes(capacity: int, half_life: float | None = None) -> int:
        """What the policy allocates beyond ``bytes_per_slot`` (the byte budget counts it too)."""
        return 0

    needs_keys = False  # touch is also given the rows' keys and which rows were just admitted

    def __init__(self, capacity: int, device: torch.device, backend) -> None:
        self.capacity = capacity
        self.device = device
        self.backend = backend

    @property
    @abc.abstractmethod
    def nbytes(self) -> int: ...

    @abc.abstractmethod
    def touch(self, slots: torch.Tensor, counts: torch.Tensor | None) -> None:
        """``counts [N]`` accesses (default one each) of the rows at ``slots``. A policy that
        ``needs_keys`` is called as ``touch(slots, counts, keys, missed)``: the rows' keys [N], and
        bool [N] set for rows admitted for these accesses (None: none)."""

    def observe(self, keys: torch.Tensor, counts: torch.Tensor) -> None:
        """Distinct ``keys`` were looked up in the tier ``counts`` times each (before any touch):
        what a policy that learns from the lookups themselves sees. Default: nothing."""
        return None

    @abc.abstractmethod
    def reset(self, slots: torch.Tensor) -> None:
        """``slots`` were just filled or emptied: forget their history."""

    grows = False  # grow() is supported: a tier with this policy may start small and grow

    def grow(self, capacity: int) -> None:
        """The tier now has ``capacity`` slots (more than before; the new ones empty)."""
        raise NotImplementedError(f"{type(self).__name__} does not grow: give the tier its whole capacity")

    @abc.abstractmethod
    def victims(self, count: int, slot_keys: torch.Tensor, pins: torch.Tensor) -> torch.Tensor:
        """``count`` occupied slots (int64) to evict, none pinned (``pins [capacity]``, uint8, is
        nonzero at slots the tier must keep: the current batch's, a lookahead window's);
        ``slot_keys [capacity]`` is -1 at slots being filled. Raises ``CacheCapacityError`` when
        fewer can be evicted."""


class LfuWithAgeing(EvictionPolicy):
    """LFU with ageing: an access adds ``increment`` to its slot's score, and ``increment`` grows by
    ``2 ** (1 / half_life)`` per access, which is the same as halving every older score each
    ``half_life`` accesses (so a shifted distribution is followed) at O(batch) cost.
    ``half_life``: accesses; ``inf`` is plain LFU; None (the default): chosen online from the
    tier's lookups (``observe``) by shadow caches (``tiers.ageing``), starting at 4x the capacity
    (where the tuned host build cannot be built, it stays there).

    Victims are not found by a scan of every slot per batch: a scan (counted in ``scans``) ranks
    ``pool_share`` of the capacity beyond the victims it needs, in ascending score, and the next
    batches take their victims from the front of that pool, skipping slots accessed, emptied or
    refilled since; when it runs out, a scan again (a scan for more victims than the pool holds
    ranks none: it would serve no batch like that one). Scores only grow, so a victim scores at most
    any slot not accessed or refilled since the scan: exact LFU but for rows that entered the
    tier or were accessed since (with ageing, their new accesses count most, so they usually
    score above the pool). ``pool_share=0`` scans at every batch (exact LFU)."""

    bytes_per_slot = 4 + 1  # the score, and at most 1 for the pool

    @staticmethod
    def fixed_nbytes(capacity: int, half_life: float | None = None) -> int:
        """Bytes beyond ``bytes_per_slot`` a tier of ``capacity`` rows allocates: the shadow caches
        that choose its ageing when ``half_life`` is None (where the tuned host build runs)."""
        if half_life is not None or host_step_library() is None:
            return 0
        return tuner_nbytes(capacity)

    def __init__(
        self,
        capacity: int,
        device: torch.device,
        backend,
        half_life: float | None = None,
        pool_share: float = POOL_SHARE,
    ) -> None:
        super().__init__(capacity, device, backend)
        self.score = huge_pages.full((capacity,), 0, torch.float32, torch.device(device))
        self._increment = 1.0
        self._half_life, self._pool_share = half_life, pool_share
        self._sized(capacity)
        self.scans = 0
        self._passes = cache_passes_of(getattr(backend, "kernels", None))  # the tuned host build's scan

    grows = True

    def _sized(self, capacity: int) -> None:
        """What depends on the capacity: the shadow caches choosing the ageing (started anew), the
        ageing until they choose, the pool's size (the pool emptied)."""
        half_life = self._half_life
        library = host_step_library() if half_life is None and tuner_nbytes(capacity) else None
        self.tuner = None if library is None else AgeingTuner(capacity, library)
        self._growth = 2.0 ** (1.0 / (half_life or 4.0 * capacity))
        self._pool_size = int(capacity * self._pool_share)
        self._rooms = [None, None]  # native_pool's two sets of room: a scan's pool lies in at most one
        self._spare = 0  # the set no pool lies in
        self._pool = torch.zeros(0, dtype=torch.int64, device=self.device)  # ranked slots, lowest first
        self._pool_scores = self.score[:0]  # their scores and keys when ranked
        self._pool_keys = self._pool

    def grow(self, capacity: int) -> None:
        score = huge_pages.full((capacity,), 0, torch.float32, self.device)
        score[: self.capacity] = self.score
        self.score, self.capacity = score, capacity
        self._sized(capacity)

    @property
    def nbytes(self) -> int:
        tuner = 0 if self.tuner is None else self.tuner.nbytes
        return self.score.nbytes + self.capacity + tuner  # the pool's bound

    def observe(self, keys: torch.Tensor, counts: torch.Tensor) -> None:
        """Distinct ``keys`` were looked up in the tier ``counts`` times each: the shadow caches
        replay the sampled ones, and the ageing follows their choice."""
        if self.tuner is not None and keys.device.type == "cpu" and self.tuner.observe(keys, counts):
            self._follow_tuner()

    def native_replay(self) -> tuple | None:
        """For a native call that replays a batch through the shadow caches as it looks it up:
        ``AgeingTuner.replay_arguments`` (None: no shadow caches), then ``replayed``."""
        return None if self.tuner is None else self.tuner.replay_arguments()

    def replayed(self, sampled: int) -> None:
        """A native call replayed ``sampled`` lookups (``native_replay``): the ageing follows the
        shadows' choice, as ``observe`` leaves it."""
        if self.tuner is not None and self.tuner.replayed(sampled):
            self._follow_tuner()

    def _follow_tuner(self) -> None:
        self._growth = 2.0 ** (1.0 / self.tuner.half_life)  # inf: 1, plain LFU

    def touch(self, slots: torch.Tensor, counts: torch.Tensor | None) -> None:
        if counts is None:
            weights, accesses = torch.full_like(slots, self._increment, dtype=torch.float32), slots.numel()
        else:
            weights, accesses = counts.to(self.device, torch.float32) * self._increment, int(counts.sum())
        self.backend.add_scores(self.score, slots, weights)
        self.advance(accesses)

    @property
    def increment(self) -> float:
        """What one access adds to its slot's score now."""
        return self._increment

    def advance(self, accesses: int) -> None:
        """``accesses`` were just added to the scores at ``increment`` (by ``touch``, or by a native
        pass that touches as it finds): later accesses weigh more."""
        self._increment *= self._growth**accesses
        if self._increment > _RENORMALISE_AT:
            self.score /= self._increment
            self._pool = self._pool[:0]  # ranked scores no longer compare: scan anew
            self._pool_scores, self._pool_keys = self._pool_scores[:0], self._pool_keys[:0]
            self._increment = 1.0

    def reset(self, slots: torch.Tensor) -> None:
        if self._passes is not None:
            self._passes.zero_at(self.score, slots)
        else:
            self.score[slots] = 0

    def victims(self, count: int, slot_keys: torch.Tensor, pins: torch.Tensor) -> torch.Tensor:
        taken = self._from_pool(count, slot_keys, pins)
        if taken is not None:
            return taken
        self.scans += 1
        ranked = self._ranked(count + self._pool_after(count), slot_keys, pins, count)
        if ranked.numel() < count:  # then it holds every evictable slot
            raise too_few_evictable(count, ranked.numel())
        pool = ranked[count:]
        self._pool, self._pool_scores, self._pool_keys = pool, self.score[pool], slot_keys[pool]
        return ranked[:count]

    def _pool_after(self, victims: int) -> int:
        """Slots a scan for ``victims`` ranks past them, to serve the next steps' victims: the pool's
        size, or none where the victims outnumber it (such a pool would serve no step like this one,
        and ranking it costs the scan a selection and a sort)."""
        return self._pool_size if victims <= self._pool_size else 0

    def native_pool(self, room: int) -> tuple[torch.Tensor, ...]:
        """For a native call that takes victims as ``victims`` does (``step_make_resident``), up to
        ``room`` of them: ``(pool, its scores, its keys)`` and room for a scan's ranking (``ranked``
        int64 [room + pool size, or more], its pool's scores float32 and keys int64 [pool size])."""
        size = self._pool_size
        spare = self._rooms[self._spare]
        if spare is None or spare[0].numel() < room + size or spare[1].numel() != size:
            room += room // 4  # then batches of a few more distinct ids take it as it is
            spare = self._rooms[self._spare] = (
                torch.empty(room + size, dtype=torch.int64),
                torch.empty(size, dtype=torch.float32),
                torch.empty(size, dtype=torch.int64),
            )
        return self._pool, self._pool_scores, self._pool_keys, *spare

    def took_natively(
        self, taken: int, ranked: tuple[torch.Tensor, ...], ranked_count: int, victims: int
    ) -> None:
        """After a native call chose ``victims`` slots: ``taken`` pool entries consumed, or (-1) a
        scan ranked ``ranked_count`` slots into ``ranked`` (``native_pool``'s last three), the pool
        being those past the victims (none if too few were evictable)."""
        if taken >= 0:
            self._drop_from_pool(taken)
            return
        self.scans += 1
        if ranked_count >= victims:
            slots, scores, keys = ranked
            self._spare ^= 1  # the new pool is in it; the other set's pool, if any, is gone
            length = ranked_count - victims
            self._pool = slots[victims:ranked_count]
            self._pool_scores, self._pool_keys = scores[:length], keys[:length]

    def _drop_from_pool(self, consumed: int) -> None:
        """The pool past its first ``consumed`` entries (taken or found stale)."""
        self._pool, self._pool_scores = self._pool[consumed:], self._pool_scores[consumed:]
        self._pool_keys = self._pool_keys[consumed:]

    def _ranked(self, wanted: int, slot_keys: torch.Tensor, pins: torch.Tensor, victims: int) -> torch.Tensor:
        """Up to ``wanted`` evictable slots of the lowest scores, ascending (a stable sort's order);
        the host build leaves the first ``victims`` (the lowest) in no particular order."""
        if self._passes is not None:
            return self._passes.lowest_slots(self.score, slot_keys, pins, wanted, victims)
        scores = self.backend.victim_scores(self.score, slot_keys, pins)
        ranked = _lowest(scores, min(wanted, self.capacity))
        ranked = ranked[torch.isfinite(scores[ranked])]
        return ranked[_ascending(scores[ranked])]

    def _from_pool(self, count: int, slot_keys: torch.Tensor, pins: torch.Tensor) -> torch.Tensor | None:
        """The first ``count`` slots of the pool that hold the row and the score they were ranked
        with and are not pinned now (those skipped leave the pool), or None if it has too few."""
        if self._passes is not None:
            pool = (self._pool, self._pool_scores, self._pool_keys)
            chosen, consumed = self._passes.pool_take(pool, self.score, slot_keys, pins, count)
            if consumed < 0:
                return None
            self._drop_from_pool(consumed)
            return chosen
        size = 2 * count + 256
        while True:
            window = self._pool[:size]
            valid = (
                (self.score[window] == self._pool_scores[:size])
                & (slot_keys[window] == self._pool_keys[:size])
                & (pins[window] == 0)
            )
            found = valid.nonzero().squeeze(1)
            if found.numel() >= count:
                chosen = window[found[:count]]
                self._drop_from_pool(int(found[count - 1]) + 1 if count else 0)
                return chosen
            if size >= self._pool.numel():
                return None
            size *= 2


def _ascending(scores: torch.Tensor) -> torch.Tensor:
    """``torch.argsort(scores, stable=True)`` of finite non-negative scores. On the CPU one
    unstable sort of (the score's bits, the position) gives the same order several times faster:
    such floats order as their bits do, and the position breaks ties as a stable sort does."""
    if scores.device.type != "cpu" or scores.numel() >= 1 << 32:
        return torch.argsort(scores, stable=True)
    bits = scores.contiguous().view(torch.int32).numpy().astype(np.int64)
    keys = (bits << 32) | np.arange(scores.numel(), dtype=np.int64)
    keys.sort()
    return torch.from_numpy(keys & 0xFFFFFFFF)


def _lowest(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Positions of the ``count`` lowest of ``scores``, in no order."""
    if count >= scores.numel():
        return torch.arange(scores.numel(), device=scores.device)
    if scores.device.type == "cpu":  # numpy's introselect beats torch.topk on the CPU
        return torch.from_numpy(np.argpartition(scores.numpy(), count - 1)[:count])
    return torch.topk(scores, count, largest=False, sorted=False).indices
