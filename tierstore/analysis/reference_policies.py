"""Hit counts of reference cache policies replayed over a key trace, one access at a time (every
miss is admitted, evicting one key when full): LRU, FIFO, and Belady's MIN (evict the key whose
next use is farthest), the most hits any such cache can get: the headroom a policy leaves. And MIN
over batches (``batched_belady_hits``): a store makes each batch's keys resident together, so no
store replaying a trace in batches beats it; it sits between the store's policies and MIN. These
are offline analysis tools, not part of the store's hot path. They run as native loops
(``tierstore.kernels.replay``) where g++ builds them, over the trace's keys made dense once for
every size; elsewhere (or with ``native=False``) as Python loops, LRU and FIFO through
``cachetools``, which the tests hold the native loops to.
"""

from __future__ import annotations

import heapq

import cachetools
import numpy as np

from ..kernels.replay import native_batched_belady_hits, native_hits, replay_library

NEVER = np.iinfo(np.int64).max
POLICIES = ("lru", "fifo", "belady")
BATCHED = "belady_batched"  # MIN over batches: policy_hit_counts' key for it


def policy_hits(keys: np.ndarray, capacity: int, policy: str, native: bool = True) -> int:
    """Hits of a ``capacity``-key cache under ``policy`` ("lru", "fifo" or "belady") over ``keys``."""
    return policy_hit_counts(keys, [capacity], [policy], native)[policy][0]


def policy_hit_counts(
    keys: np.ndarray,
    capacities: list[int],
    policies: list[str],
    native: bool = True,
    batches: list[int] | None = None,
) -> dict[str, list[int]]:
    """``{policy: [hits at each of capacities]}`` over ``keys`` (int64 [N]), the trace prepared
    once (dense keys, next uses) for every replay. ``batches`` (one a capacity): also
    ``"belady_batched"``, MIN over batches of that many accesses (``batched_belady_hits``)."""
    for capacity in capacities:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
    for policy in policies:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    if batches is not None:
        if len(batches) != len(capacities):
            raise ValueError(f"batches gives {len(batches)} batch sizes for {len(capacities)} capacities")
        for batch in batches:
            if batch < 1:
                raise ValueError(f"batch must be at least 1, got {batch}")
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    library = replay_library() if native else None
    if library is None:
        counts = {
            policy: [_python_hits(keys, capacity, policy) for capacity in capacities] for policy in policies
        }
        if batches is not None:
            counts[BATCHED] = [_batched_belady_in_python(keys, c, b) for c, b in zip(capacities, batches)]
    else:
        dense, distinct, following = _prepared(keys)
        counts = {
            policy: [
                native_hits(library, policy, dense, distinct, capacity, following) for capacity in capacities
            ]
            for policy in policies
        }
        if batches is not None:
            counts[BATCHED] = [
                native_batched_belady_hits(library, dense, distinct, c, b, following)
                for c, b in zip(capacities, batches)
            ]
    for hits, capacity, batch in zip(counts.get(BATCHED, []), capacities, batches or []):
        if hits < 0:
            raise ValueError(
                f"a batch of {batch} accesses holds more distinct keys than the capacity of {capacity}: "
                "give a smaller batch or a larger capacity"
            )
    return counts


def _prepared(keys: np.ndarray) -> tuple[np.ndarray, int, np.ndarray]:
    """``(dense keys int64 [N] in [0, distinct), distinct, next uses int64 [N])`` from one stable sort
    of ``keys`` (by key, then position)."""
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    first = np.ones(keys.size, dtype=bool)  # the first access of its key, in key order
    first[1:] = ordered[1:] != ordered[:-1]
    dense = np.empty(keys.size, dtype=np.int64)
    dense[order] = np.cumsum(first) - 1
    following = np.full(keys.size, NEVER, dtype=np.int64)
    same = ~first[1:]
    following[order[:-1][same]] = order[1:][same]
    return dense, int(first.sum()), following


def _python_hits(keys: np.ndarray, capacity: int, policy: str) -> int:
    if policy == "belady":
        return _belady_in_python(keys, capacity)
    caches = {"lru": cachetools.LRUCache, "fifo": cachetools.FIFOCache}
    cache, hits = caches[policy](maxsize=capacity), 0
    for key in keys.tolist():
        if key in cache:
            hits += 1
            cache[key]  # a read: LRU refreshes the key, FIFO does not
        else:
            cache[key] = True
    return hits


def next_uses(keys: np.ndarray) -> np.ndarray:
    """For each access, the position of the next access to the same key (``NEVER`` if none)."""
    return _prepared(np.ascontiguousarray(keys, dtype=np.int64))[2]


def belady_hits(keys: np.ndarray, capacity: int, native: bool = True) -> int:
    """Hits of Belady's MIN: on a miss with a full cache, evict the cached key used farthest ahead."""
    return policy_hits(keys, capacity, "belady", native)


def _belady_in_python(keys: np.ndarray, capacity: int) -> int:
    following = next_uses(keys)
    resident: dict[int, int] = {}  # key -> its next use
    farthest: list[tuple[int, int]] = []  # max-heap of (-next use, key), stale entries skipped
    hits = 0
    for position, key in enumerate(keys.tolist()):
        upcoming = int(following[position])
        if key in resident:
            hits += 1
        elif len(resident) >= capacity:
            while True:
                negative_use, victim = heapq.heappop(farthest)
                if resident.get(victim) == -negative_use:
                    del resident[victim]
                    break
        resident[key] = upcoming
        heapq.heappush(farthest, (-upcoming, key))
    return hits


def batched_belady_hits(keys: np.ndarray, capacity: int, batch: int, native: bool = True) -> int:
    """Hits of MIN over batches: ``keys`` split in runs of ``batch`` accesses, each run's distinct
    keys made resident together (every miss admitted when its batch runs, a full cache evicting the
    keys outside the batch whose next uses are farthest), a hit being a lookup less each key brought
    in. No batched demand-paging cache gets more; with ``batch=1`` it is ``belady_hits``. A batch
    holding more distinct keys than ``capacity`` is refused (``ValueError``)."""
    return policy_hit_counts(keys, [capacity], [], native, batches=[batch])[BATCHED][0]


def _batched_belady_in_python(keys: np.ndarray, capacity: int, batch: int) -> int:
    following = next_uses(keys)
    resident: dict[int, int] = {}  # key -> its next use
    hits = 0
    for start in range(0, keys.size, batch):
        looked_up: dict[int, int] = {}  # the batch's keys -> the next use after the batch
        for position in range(start, min(keys.size, start + batch)):
            looked_up[int(keys[position])] = int(following[position])
        if len(looked_up) > capacity:
            return -1
        missed = [key for key in looked_up if key not in resident]
        hits += min(keys.size, start + batch) - start - len(missed)
        excess = len(resident) + len(missed) - capacity
        if excess > 0:
            others = sorted((key for key in resident if key not in looked_up), key=lambda key: -resident[key])
            for victim in others[:excess]:
                del resident[victim]
        resident.update(looked_up)
    return hits
