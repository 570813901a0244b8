"""Hit counts of reference cache policies replayed over a key trace, one access at a time (every
miss is admitted, evicting one key when full): LRU, FIFO, and Belady's MIN (evict the key whose
next use is farthest), the most hits any such cache can get: the headroom a policy leaves. These
are offline analysis tools, not part of the store's hot path. They run as native loops
(``tierstore.kernels.replay``) where g++ builds them, over the trace's keys made dense once for
every size; elsewhere (or with ``native=False``) as Python loops, LRU and FIFO through
``cachetools``, which the tests hold the native loops to.
"""

from __future__ import annotations

import heapq

import cachetools
import numpy as np

from ..kernels.replay import native_hits, replay_library

NEVER = np.iinfo(np.int64).max
POLICIES = ("lru", "fifo", "belady")


def policy_hits(keys: np.ndarray, capacity: int, policy: str, native: bool = True) -> int:
    """Hits of a ``capacity``-key cache under ``policy`` ("lru", "fifo" or "belady") over ``keys``."""
    return policy_hit_counts(keys, [capacity], [policy], native)[policy][0]


def policy_hit_counts(
    keys: np.ndarray, capacities: list[int], policies: list[str], native: bool = True
) -> dict[str, list[int]]:
    """``{policy: [hits at each of capacities]}`` over ``keys`` (int64 [N]), the trace prepared
    once (dense keys, next uses) for every replay."""
    for capacity in capacities:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
    for policy in policies:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    library = replay_library() if native else None
    if library is None:
        return {
            policy: [_python_hits(keys, capacity, policy) for capacity in capacities] for policy in policies
        }
    distinct, dense = np.unique(keys, return_inverse=True)
    dense = np.ascontiguousarray(dense.reshape(-1), dtype=np.int64)
    following = next_uses(keys) if "belady" in policies else None
    return {
        policy: [
            native_hits(library, policy, dense, distinct.size, capacity, following) for capacity in capacities
        ]
        for policy in policies
    }


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
    order = np.lexsort((np.arange(keys.size), keys))  # by key, then position
    following = np.full(keys.size, NEVER, dtype=np.int64)
    same = keys[order[1:]] == keys[order[:-1]]
    following[order[:-1][same]] = order[1:][same]
    return following


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
