"""Ids leaving a table: ``remove``, and expiry at each ``flush`` (``TieredStore``'s part; the policy
and its records are ``tierstore.expiry``)."""

from __future__ import annotations

from typing import Any

import torch

from .expiry import ExpiryPolicy, IdExpiry
from .locking import serialized
from .tiers.build import index_kernels
from .validation import as_ids


class StoreRemovals:
    """``TieredStore``'s removals: ``remove``, ``flush`` with its expiry, and the expiry's settings."""

    @serialized
    def remove(self, ids: Any) -> int:
        """Remove ``ids`` (int64 [N], any order, repeats and ids the table does not hold allowed) from
        the table: from every cache tier at once and from the cold store's files at the next flush
        (durable then, as updates are). An id removed and looked up again starts from its initial
        row, as a new id does. Ids whose rows are pinned for batches in flight (a lookahead
        pipeline) are refused, changing nothing. Returns how many of the ids the table held."""
        self._check_writable("remove ids")
        unique = torch.unique(as_ids(ids))
        return self.stack.remove(unique) if unique.numel() else 0

    @serialized
    def flush(self) -> None:
        """Make every update so far durable (atomically: a crash keeps the previous flush). With
        ``ttl`` or ``max_rows``, the ids they expire are then removed, durably (a second commit)."""
        self._check_writable("flush")
        if self._expiry is None:
            self.stack.flush()
            return
        self._expiry.record(self.stack.unflushed_keys(), commit=True)  # first: a kill keeps ids longer
        self.stack.flush()
        in_flight = torch.zeros(0, dtype=torch.int64) if self._in_flight is None else self._in_flight
        self._expiry.expire(self, in_flight.cpu())

    def _open_expiry(self) -> IdExpiry | None:
        """The expiry of a writable store with a policy (its side store opened); without one, a side
        store left by an earlier open is dropped (it would go stale)."""
        if self._expiry_policy is None:
            IdExpiry.drop(self.path)
            return None
        return IdExpiry(self.path, self._expiry_policy, index_kernels(self.config))

    @property
    def expiry(self) -> ExpiryPolicy | None:
        """When ids expire (``ttl``, ``max_rows``), None if they never do."""
        return self._expiry_policy
