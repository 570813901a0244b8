"""``PrefetchStats``: a lookahead pipeline's counters for one store (``store.stats()["prefetch"]``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class PrefetchStats:
    """A pipeline's counters for one store (``store.stats()["prefetch"]``)."""

    lookahead: int  # batches it may read ahead
    batches: int = 0  # batches read ahead
    pinned_batches: int = 0  # batches whose rows it pinned
    skipped_batches: int = 0  # batches larger than the window's room: looked up on demand
    waits: int = 0  # batches that waited for room (the window shrank)
    rows_moved_up: int = 0  # rows it moved into the top tier
    horizon: int = 0  # row lookups its ids-only horizon spans (0: none)
    horizon_pinned_rows: int = 0  # rows the horizon pins now (their next use is within it)
    horizon_unpinned_far: int = 0  # pins the horizon dropped to make room (farthest next use first)
    horizon_bytes: int = 0  # memory the horizon holds (ids, next uses, map, per-slot arrays)
    warmed_rows: int = 0  # rows of the warm ranking it loaded into the caches
    window_batches: int = 0  # batches whose rows are pinned now
    # slots the window holds now: its batches' distinct ids, new ones included (they take a slot
    # when their batch runs); a row in two batches counts twice
    pinned_rows: int = 0
