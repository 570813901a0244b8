"""A collection's forward, planned once per order of features (``FeaturePlan``) and run group by
group: each group's features pooled in one lookup (``group_forward``), or, sharded, its part in a
step none of its features are in (``idle_forward``)."""

from __future__ import annotations

import torch

from .collection_layout import in_group


class FeaturePlan:
    """What a collection's forward does with one order of features (``tables``: each one's table),
    made once: each group's ``(positions of its features, their tables, bool [features] of those
    pooled by mean or None)``, the features' ``dims``, the output's column order where groups
    interleave (``columns``, else None), and the features' starts (``JaggedBatch.feature_starts``) of
    the batches since last counted, summed (``starts_seen``: its differences are the ids looked up
    per feature)."""

    def __init__(self, tables: list[dict], group_names: list[str]) -> None:
        self.names = [table["name"] for table in tables]
        self.dims = [table["embedding_dim"] for table in tables]
        self.starts_seen = torch.zeros(len(tables) + 1, dtype=torch.int64)
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
