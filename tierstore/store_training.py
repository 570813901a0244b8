"""What a training step asks of a store: its batch's distinct rows resident in the top tier, pooled
there, and the fused optimizer applied to them (``TieredStore``'s part)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .locking import serialized
from .optim import SparseOptimizer
from .validation import as_ids


class StoreTraining:
    """``TieredStore``'s training path (``nn``'s modules call it each step)."""

    @serialized
    def get_distinct(
        self, ids: torch.Tensor, counts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [U, dim] on device, top-tier slots int64 [U])`` of sorted distinct ``ids``
        (as ``torch.unique`` returns them); ``counts [U]``: how often the batch holds each id (LFU).

        The training path: the ids join the table, and ``slots`` can be handed to ``apply_gradients``
        with the gradients, which then skips finding the ids again.
        """
        self._check_open()
        ids = as_ids(ids)
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError(
                "get_distinct needs sorted distinct ids (as torch.unique returns); use get() for any ids"
            )
        counts = torch.ones_like(ids) if counts is None else counts
        slots = self.stack.make_resident(ids, counts)
        self._in_flight = ids
        weights = self.stack.top.read(slots, self.dim).to(self.device)
        return weights, slots

    @serialized
    def read_resident(
        self, ids: torch.Tensor, counts: torch.Tensor, read: Callable[[Any, torch.Tensor], Any]
    ) -> Any:
        """``read(top tier, slots)``, holding the store's lock, right after distinct ``ids`` (int64
        [U], any order), each looked up ``counts [U]`` times, were made resident at ``slots``
        (int64 [U]; fetched, admitted, new ids joining the table): the training lookup of a pass
        that reads the rows where they lie (``nn.native_step``), while no other thread (a lookahead
        pipeline's worker) can move them."""
        self._check_open()
        self._in_flight = ids
        return read(self.stack.top, self.stack.make_resident(ids, counts))

    @serialized
    def lookup_bags(self, ids: torch.Tensor, padding: int | None, bags: Any) -> tuple | None:
        """A training lookup of bags (``nn.native_step``) in one native call where the tiers allow
        (``TierStack.lookup_bags``), holding the store's lock: ``(the top tier's vacated count, Distinct
        of ids, their slots, (pooled, entry bags, scales))``, the rows made resident as
        ``read_resident`` makes them; None where the batch takes ``read_resident``'s path."""
        self._check_open()
        self._in_flight = ids
        looked_up = self.stack.lookup_bags(ids, padding, bags)
        return None if looked_up is None else (self.stack.top.vacated, *looked_up)

    @serialized
    def update_top_tier(self, update: Callable[[Any], bool]) -> bool:
        """``update(top tier)`` holding the store's lock, the store being writable: an in-place
        change of rows ``read_resident`` placed (``nn.native_step``'s fused backward). Returns
        what ``update`` returns (False: it changed nothing)."""
        self._check_writable("update")
        self._updated()
        return update(self.stack.top)

    @serialized
    def apply_gradients(
        self,
        ids: torch.Tensor,
        grad: torch.Tensor,
        optimizer: SparseOptimizer,
        step: int,
        slots: torch.Tensor | None = None,
    ) -> None:
        """Fused ``optimizer`` step (its ``step``-th) on the rows of distinct ``ids`` (int64 [U]) with
        ``grad [U, dim]``: weights and optimizer state are updated in place in the top tier.

        ``slots`` from ``get_distinct`` are reused while the tier still holds the ids there (no
        lookup, no LFU count); if any moved since, the ids are found (and fetched) again.
        """
        self._check_writable("update")
        ids = as_ids(ids)
        self._updated()
        top = self.stack.top
        if slots is None:
            slots = self.stack.make_resident(ids, torch.ones_like(ids))
        elif not top.holds(slots, ids):
            slots = self.stack.make_resident(ids, torch.zeros_like(ids))  # moved since: not a new access
        top.apply_optimizer(optimizer, slots, grad, step)

    def _updated(self) -> None:
        """An update: the last training lookup's ids are no longer in flight, and expiry counts a
        step (once per lookup: a step that updates in parts counts once)."""
        if self._in_flight is not None and self._expiry is not None:
            self._expiry.updates += 1
        self._in_flight = None

    def gradient_kernels(self, device: torch.device):
        """The top tier's kernels where they run on ``device`` (for ``nn.pooled_lookup``), else None."""
        top = self.stack.top
        return top.kernels if top.device == device else None
