"""``HorizonReader``: a lookahead pipeline's batches read up to its ids-only horizon ahead of the
loop, their ids entered in each store's ``Foresight`` (``prefetch(horizon=)``)."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .horizon import Foresight
from .prefetch_stats import PrefetchStats


class HorizonReader:
    """The batches, read up to a horizon ahead of the loop (``prefetch(horizon=)``): an iterator
    of them, in order, whose ids each store's ``Foresight`` has entered."""

    def __init__(
        self,
        batches: Iterator,
        module: Any,
        ids: Callable | None,
        horizon: int | str,
        horizon_ids: Iterable | None,
        lookahead: int,
    ) -> None:
        self._batches = batches
        self._module = module
        self._ids = ids
        self._horizon = horizon
        self._lookahead = lookahead
        self._source = None if horizon_ids is None else iter(horizon_ids)
        self._held: collections.deque = collections.deque()  # batches read ahead (no horizon_ids)
        self._entered: collections.deque = collections.deque()  # per batch entered: its Foresights
        self.window_rows: Callable[[Any], int] = lambda store: 0  # slots a window holds beside the pins
        self._handed = 0  # batches handed on
        self._consumed = 0  # batches run (consumed from every Foresight they entered)
        self._ended = False  # the horizon's source is exhausted
        self.sights: dict[int, Foresight] = {}  # id(store) -> its horizon

    def __iter__(self) -> HorizonReader:
        return self

    def __next__(self) -> Any:
        if self._source is None:
            self._fill()
            if not self._held:
                raise StopIteration
            batch = self._held.popleft()
        else:
            batch = next(self._batches)
            self._fill()
            if len(self._entered) + self._consumed <= self._handed:
                raise ValueError(
                    f"prefetch: horizon_ids ended at batch {self._handed}, before the batches did; "
                    "it must give the ids of every batch, in order"
                )
        self._handed += 1
        return batch

    def _fill(self) -> None:
        """Read ahead until every store's horizon spans its lookups (one batch at least)."""
        while not self._ended and (
            len(self._entered) + self._consumed <= self._handed
            or any(sight.wants_more() for sight in self.sights.values())
        ):
            if self._source is None:
                try:
                    batch = next(self._batches)
                except StopIteration:
                    self._ended = True
                    return
                self._held.append(batch)
                looked_up = batch if self._ids is None else self._ids(batch)
            else:
                try:
                    looked_up = next(self._source)
                except StopIteration:
                    self._ended = True
                    return
            self._enter(looked_up)

    def _enter(self, looked_up: Any) -> None:
        try:
            wanted = self._module.store_keys(looked_up)
        except (TypeError, ValueError, IndexError, KeyError):
            wanted = []  # the step (or the window's pins) refuses this batch with its own message
        sights = []
        for store, keys in wanted:
            sight = self.sights.get(id(store))
            if sight is None:
                sight = self.sights[id(store)] = Foresight(store, self._horizon)
                sight.window_slots = lambda: self.window_rows(store)
            sight.enter(keys)
            sights.append(sight)
        self._entered.append(sights)

    def ran(self) -> None:
        """The oldest batch handed on has run."""
        for sight in self._entered.popleft():
            sight.consume()
            stats = sight.store.prefetch_stats
            if stats is None or stats.horizon != sight.accesses:
                stats = sight.store.prefetch_stats = stats or PrefetchStats(self._lookahead)
                stats.horizon = sight.accesses
            stats.horizon_pinned_rows = sight.protected
            stats.horizon_unpinned_far = sight.unpinned_far
            stats.horizon_bytes = sight.nbytes
        self._consumed += 1

    def pin_window(self, store: Any, keys: Any) -> tuple[Any, Any, int, int]:
        """A window's ``store.pin_rows(keys)``, the horizon's pins making room first: its
        ``(keys, slots, rows moved up)`` and how many of those rows the horizon does not pin."""
        sight = self.sights.get(id(store))
        if sight is None:
            return (*store.pin_rows(keys), keys.numel())
        return sight.pin_window(keys)

    def release(self) -> None:
        """Unpin the horizon's rows in every store (the pipeline stops)."""
        for sight in self.sights.values():
            sight.release()
