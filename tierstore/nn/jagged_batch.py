"""``JaggedBatch``: a collection's ``KeyedJaggedTensor`` batch, checked against its tables, and each
group's entries laid out for one lookup of the group's store.

A row's key in a group's store is ``table_number << ID_BITS | id``. A group looks up its features
bag by bag in the output's layout (bag ``b * features + j``: sample b's entries of the group's j-th
feature), so the pooled rows come out as ``[batch, features x dim]`` with no transpose forward or
backward. The layout is made by one native pass (``host_step.cpp``'s ``step_group_keys``) where the
host build is available and the weights need no gradient, else by torch ops (the reference).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import IdOutOfRangeError
from ..kernels.step_passes import host_passes
from .keyed import check_lengths, jagged_parts, lengths_problem

ID_BITS = 47  # ids below 2**47; the table's number in the bits above


def id_bound(table: dict) -> int:
    """Ids of ``table`` are below this: its ``num_embeddings``, within the key space's 2**47."""
    return min(table["num_embeddings"] or 1 << ID_BITS, 1 << ID_BITS)


def checked_table_keys(table: dict, ids: torch.Tensor) -> torch.Tensor:
    """Keys (int64 [N]) of ``table``'s ``ids`` (int64 CPU) in its group's store; ``IndexError`` naming
    the table if an id is negative or past its ``num_embeddings``."""
    bound = id_bound(table)
    bad = ((ids < 0) | (ids >= bound)).nonzero()
    if bad.numel():
        raise _bad_id(table, int(ids[bad[0, 0]]))
    return (table["number"] << ID_BITS) | ids


def _bad_id(table: dict, value: int) -> IdOutOfRangeError:
    return IdOutOfRangeError(f"table {table['name']!r}: ids must be in [0, {id_bound(table)}), got {value}")


class JaggedBatch:
    """``keys`` (feature names), ``values`` (int64 CPU ids, feature by feature), ``lengths [F, B]``,
    ``weights`` (``[N]`` or None), ``tables`` (each feature's table settings) and ``feature_starts``
    (int64 [F + 1]: feature f's values from ``feature_starts[f]``), checked."""

    def __init__(
        self,
        features: Any,
        table_of_feature: dict[str, dict],
        layouts: dict | None = None,
        shared: dict[str, list[str]] | None = None,
        weighted: bool = True,
    ) -> None:
        """``layouts``: a dict the owner keeps across batches, where each feature order's tables,
        table numbers and id bounds are kept once made (``_layout``). ``shared``: ``{feature: the
        tables reading it}``, each of which looks it up as ``feature@table``. ``weighted``: the
        weights are used (else ignored)."""
        keys, values, lengths, weights = jagged_parts(features)  # the lengths' values checked below
        weights = weights if weighted else None
        if shared and not shared.keys().isdisjoint(keys):
            check_lengths(lengths, values.numel())  # before they are used to split the values
            keys, values, lengths, weights = _split_shared(keys, values, lengths, weights, shared)
        self.keys, self.lengths, self.weights, self.values = keys, lengths, weights, values
        self.layout_key = tuple(keys)
        layout = None if layouts is None else layouts.get(self.layout_key)
        if layout is None:  # a feature order not seen yet: its features checked, its tables found
            layout = _layout(keys, table_of_feature)
            if layouts is not None:
                layouts[self.layout_key] = layout
        self.tables, self._numbers, self._bounds = layout
        for key, table in zip(keys, self.tables) if weights is not None else ():
            if table["pooling"] == "mean":
                raise ValueError(
                    f"feature {key!r}: weights need sum pooling (as torch's), its table pools by mean"
                )
        native = weights is None or (weights.device.type == "cpu" and not weights.requires_grad)
        self._passes = host_passes() if native else None
        if self._passes is not None:  # one pass: lengths and ids checked, the features' starts
            self.feature_starts, kind, detail = self._passes.check_batch(values, lengths, self._bounds)
        else:
            check_lengths(lengths, values.numel())
            self.feature_starts = torch.zeros(len(keys) + 1, dtype=torch.int64)
            torch.cumsum(lengths.sum(dim=1), 0, out=self.feature_starts[1:])
            kind, detail = self._first_bad_id()
        if kind in (1, 2):
            raise lengths_problem(lengths, kind, detail, values.numel())
        if kind == 3:
            feature = int(torch.searchsorted(self.feature_starts, detail, right=True)) - 1
            raise _bad_id(self.tables[feature], int(values[detail]))

    def _first_bad_id(self) -> tuple[int, int]:
        """``(3, the first entry whose id is negative or past its table's num_embeddings)``, or
        ``(0, 0)`` (``StepPasses.check_batch``'s kinds)."""
        bound = self._bounds[self._feature_of_entry()]
        bad = ((self.values < 0) | (self.values >= bound)).nonzero()
        return (3, int(bad[0, 0])) if bad.numel() else (0, 0)

    def _feature_of_entry(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(len(self.keys)), self.lengths.sum(dim=1))

    def group_bags(self, features: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(keys [M], bag starts [batch x len(features)], weights [M] or None)``: the entries of
        ``features`` (positions in ``keys``, one group's) as keys of the group's store, bag by bag
        in the output's layout."""
        weights = self.weights
        if self._passes is not None:
            weights = None if weights is None else weights.to(torch.float32).contiguous()
            return self._passes.group_keys(
                self.values, self.lengths, self.feature_starts, features, self._numbers, weights
            )
        feature_of_entry = self._feature_of_entry()
        keys = self._numbers[feature_of_entry] | self.values
        lengths = self.lengths[features]
        if len(features) < len(self.keys):
            in_group = torch.zeros(len(self.keys), dtype=torch.bool)
            in_group[features] = True
            entries = in_group[feature_of_entry]
            keys = keys[entries]
            weights = None if weights is None else weights[entries.to(weights.device)]
        count, batch = lengths.shape
        by_sample = lengths.t().reshape(-1)  # bag b * features + f
        starts = torch.cumsum(by_sample, 0) - by_sample
        by_feature = lengths.reshape(-1)
        shift = starts.view(batch, count).t().reshape(-1) - (torch.cumsum(by_feature, 0) - by_feature)
        positions = torch.arange(keys.numel()) + torch.repeat_interleave(shift, by_feature)
        keys = torch.empty_like(keys).index_copy_(0, positions, keys)
        if weights is not None:
            weights = torch.empty_like(weights).index_copy_(0, positions.to(weights.device), weights)
        return keys, starts, weights


def _layout(
    keys: list[str], table_of_feature: dict[str, dict]
) -> tuple[list[dict], torch.Tensor, torch.Tensor]:
    """``(each feature's table, their numbers shifted past the id bits, their id bounds)`` for a
    feature order; ``KeyError`` naming the features no table reads."""
    if not table_of_feature.keys() >= set(keys):  # one C-level check; the names only if it fails
        unknown = [key for key in keys if key not in table_of_feature]
        raise KeyError(
            f"feature(s) {unknown} have no table; the tables' features are {sorted(table_of_feature)}"
        )
    tables = list(map(table_of_feature.__getitem__, keys))
    numbers = torch.tensor([table["number"] << ID_BITS for table in tables], dtype=torch.int64)
    return tables, numbers, torch.tensor([id_bound(table) for table in tables], dtype=torch.int64)


def _split_shared(
    keys: list[str],
    values: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    shared: dict[str, list[str]],
) -> tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The batch with each feature in ``shared`` repeated as ``feature@table`` for every table that
    reads it (its ids, lengths and weights copied), in place of the feature."""
    ends = np.cumsum(lengths.numpy().sum(axis=1))
    parts: list[tuple[str, slice, int]] = []  # (key, its entries, its row of lengths)
    for row, key in enumerate(keys):
        entries = slice(int(ends[row - 1]) if row else 0, int(ends[row]))
        names = [f"{key}@{table}" for table in shared[key]] if key in shared else [key]
        parts.extend((name, entries, row) for name in names)
    values = torch.cat([values[entries] for _, entries, _ in parts])
    lengths = lengths[[row for _, _, row in parts]]
    if weights is not None:
        weights = torch.cat([weights[entries] for _, entries, _ in parts])
    return [key for key, _, _ in parts], values, lengths, weights
