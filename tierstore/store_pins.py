"""What a lookahead pipeline asks of a store: the ids a batch looks up, rows preloaded and pinned
in the top tier (``TieredStore``'s part)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .locking import serialized
from .validation import as_ids
from .warm_start import hot_ids, warm_caches

if TYPE_CHECKING:
    from .store import TieredStore


class StorePins:
    """``TieredStore``'s side of ``tierstore.prefetch`` and of warm starts."""

    def store_keys(self, ids: Any) -> list[tuple[TieredStore, torch.Tensor]]:
        """``[(self, the distinct ids get(ids) looks up)]``, for a lookahead pipeline
        (``tierstore.prefetch``)."""
        return [(self, torch.unique(as_ids(ids)))]

    def warm_keys(self, warm: Any) -> list[tuple[TieredStore, torch.Tensor]]:
        """``[(self, the ranked ids of warm)]`` (a ``.npy`` path or ids), for ``prefetch(warm=)``."""
        return [(self, hot_ids(warm))]

    @serialized
    def preload(self, ids: torch.Tensor) -> int:
        """Load the rows of ranked ``ids`` (int64, distinct) the table holds into the cache tiers'
        free slots, top tier first, counting no lookup (a warm start); returns how many."""
        self._check_open()
        loaded = warm_caches(self.stack, as_ids(ids))
        self.warmed_rows += loaded
        return loaded

    @serialized
    def pin_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Move the rows of distinct ``ids`` (int64) that the table holds into the top tier and pin
        them there until ``unpin_rows``, counting no lookup: ``(their keys, their slots, rows moved
        up)``. Ids the table does not hold are left out: a lookup adds them."""
        self._check_open()
        return self.stack.pin_held(as_ids(ids))

    @serialized
    def with_top_tier(self, action: Callable[[Any], Any]) -> Any:
        """``action(top tier)`` holding the store's lock: a lookahead horizon's pins
        (``tierstore.horizon``); nothing when the store is closed."""
        if not self._closed:
            return action(self.stack.top)
        return None

    @serialized
    def unpin_rows(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Undo a ``pin_rows`` (its keys and slots); rows taken out of the tier since are skipped."""
        if not self._closed:
            self.stack.unpin(keys, slots)
