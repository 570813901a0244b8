"""Hit counts of reference cache policies replayed over a key trace, one access at a time (every
miss is admitted, evicting one key when full): LRU and FIFO through ``cachetools``, and Belady's
MIN (evict the key whose next use is farthest), the most hits any such cache can get: the
headroom a policy leaves. These are offline analysis tools with a Python step per access
(about 1-3 s per million accesses), not part of the store's hot path.
"""

from __future__ import annotations

import heapq

import cachetools
import numpy as np

NEVER = np.iinfo(np.int64).max


def policy_hits(keys: np.ndarray, capacity: int, policy: str) -> int:
    """Hits of a ``capacity``-key cache under ``policy`` ("lru", "fifo" or "belady") over ``keys``."""
    if capacity < 1:
        raise ValueError(f"capacity must be at least 1, got {capacity}")
    if policy == "belady":
        return belady_hits(keys, capacity)
    caches = {"lru": cachetools.LRUCache, "fifo": cachetools.FIFOCache}
    if policy not in caches:
        raise ValueError(f"policy must be one of lru, fifo, belady; got {policy!r}")
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


def belady_hits(keys: np.ndarray, capacity: int) -> int:
    """Hits of Belady's MIN: on a miss with a full cache, evict the cached key used farthest ahead."""
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
