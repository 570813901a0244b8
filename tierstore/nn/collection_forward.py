"""A collection's forward, planned once per order of features (``FeaturePlan``) and run group by
group: each group's features pooled in one lookup (``group_forward``), or, sharded, its part in a
step none of its features are in (``idle_forward``)."""

from __future__ import annotations

import torch

from .collection_layout import in_group

SUM_EVERY = 256  # batches' feature starts a plan keeps before summing them


class FeaturePlan:
    """What a collection's forward does with one order of features (``tables``: each one's table),
    made once: each group's ``(positions of its features, their tables, bool [features] of those
    pooled by mean or None)``, the features' ``dims``, the output's column order where groups
    interleave (``columns``, else None); and the ids each feature looked up (``count``,
    ``take_lookups``)."""

    def __init__(self, tables: list[dict], group_names: list[str]) -> None:
        self.names = [table["name"] for table in tables]
        self.dims = [table["embedding_dim"] for table in tables]
        self._starts_summed = torch.zeros(len(tables) + 1, dtype=torch.int64)
        self._starts_pending: list[torch.Tensor] = []  # batches' feature starts not yet summed
        self.groups, order = {}, []
        for group_name in group_names:
            positions = in_group(group_name, tables)
            means = [tables[index]["pooling"] == "mean" for index in positions]
            self.groups[group_name] = (
                positions,
                [tables[i] for i in positions],
                torch.tensor(means) if any(means) else None,
            )
            order.extend(positions)
        self.columns = None
        if order != sorted(order):
            starts = [sum(self.dims[:index]) for index in range(len(self.dims))]
            columns = torch.cat(
                [torch.arange(starts[index], starts[index] + self.dims[index]) for index in order]
            )
            self.columns = torch.argsort(columns)

    def count(self, feature_starts: torch.Tensor) -> None:
        """Count a batch's ids per feature (its ``JaggedBatch.feature_starts``, int64 [F + 1], not
        changed after): kept as it is, summed with the others every ``SUM_EVERY`` batches or when
        read (an add a step would cost the step a torch call)."""
        self._starts_pending.append(feature_starts)
        if len(self._starts_pending) >= SUM_EVERY:
            self._sum_pending()

    def take_lookups(self) -> list[int]:
        """The ids each feature looked up since the last call."""
        self._sum_pending()
        counts = self._starts_summed.diff().tolist()
        self._starts_summed.zero_()
        return counts

    def _sum_pending(self) -> None:
        pending, self._starts_pending = self._starts_pending, []
        if pending:
            self._starts_summed += torch.stack(pending).sum(dim=0)


def group_forward(group, tables, means, keys, starts, weights, lengths) -> torch.Tensor:
    """``[batch, len(tables) x dim]``: the pooled rows of features looked up in ``tables`` (one per
    feature) side by side, all in one lookup of ``group``: ``keys``, ``starts`` and ``weights`` as
    ``JaggedBatch.group_bags`` lays them out, ``lengths [features, batch]`` (for mean pooling of the
    features ``means`` marks; None: none)."""
    features, batch = lengths.shape
    if group.sharding is None and means is None:  # checked by JaggedBatch: the output straight from it
        return group.lookup_bags(keys, starts, weights, (batch, features * group.embedding_dim))
    if group.sharding is None:  # checked by JaggedBatch: straight to the lookup
        pooled = group.lookup_bags(keys, starts, weights)
    else:  # every rank takes part in the exchanges forward makes
        pooled = group(keys, starts, weights)
    pooled = pooled.view(batch, features, group.embedding_dim)
    if means is not None:
        divisors = torch.where(means, lengths.t().clamp(min=1), 1).to(pooled)
        pooled = pooled / divisors[:, :, None]
    return pooled.view(batch, features * group.embedding_dim)


def idle_forward(group, batch: int) -> torch.Tensor:
    """``[batch, 0]``: a sharded group's part in a step none of its features are in (it serves the
    other ranks' lookups, and its gradients flow back through this empty block)."""
    keys = torch.zeros(0, dtype=torch.int64)
    return group(keys, torch.zeros(batch, dtype=torch.int64), None)[:, :0]
