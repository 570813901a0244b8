"""``TieredEmbeddingBagCollection``: many tables looked up by ``KeyedJaggedTensor`` features, with
tables fused into one store per embedding dim (TorchRec's ``EmbeddingBagCollection`` in shape).

Fusion: the tables of one dim live in one ``TieredEmbeddingBag`` (one store, one key space, one
host and one device budget, so hot rows of any table compete for the same cache). A row's key
is ``table_number << 47 | id``: ids must be below 2**47, and a group holds up to 2**16 tables.
Each forward makes one pass through the tiers per group: one unique over the keys of all its
features, one pooled lookup of all their bags, one fused optimizer step in backward. The
numbering is recorded in ``collection.json`` under ``path`` and checked when the collection is
reopened. Several groups split the cache budgets evenly.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..budget import parse_bytes
from ..config import TierConfig
from ..metadata import write_json_atomic
from ..optim import SGD, SparseOptimizer
from .embedding import TieredEmbeddingBag
from .keyed import KeyedTensor, jagged_parts, table_settings

ID_BITS = 47  # ids below 2**47; the table's number in the bits above
ID_MASK = (1 << ID_BITS) - 1
MAX_TABLES_PER_GROUP = 1 << 16
LAYOUT_FILE = "collection.json"


class TieredEmbeddingBagCollection(nn.Module):
    """Tables (``EmbeddingBagConfig``s, TorchRec's accepted) looked up by feature name.

    Args: ``tables``; ``path`` (a directory holding one store per embedding dim and
    ``collection.json``; ``None``: temporary stores); ``backend``, ``seed``, ``optimizer`` (one
    fused optimizer for every table, default ``optim.SGD(lr=0.01)``), ``dtype``, ``device`` and the
    cache tiers' settings (``tiers=`` or keywords) as ``TieredEmbeddingBag`` takes them.

    ``forward(features: KeyedJaggedTensor) -> KeyedTensor`` with the pooled ``[batch, dim]`` of
    every feature in ``features.keys()`` order. Adam's and Adagrad's step counts are per group
    (every fused update of the group counts), as in FBGEMM's fused tables.
    """

    def __init__(
        self,
        tables: list[Any],
        path: str | Path | None = None,
        *,
        backend: str | None = None,
        seed: int = 0,
        optimizer: SparseOptimizer | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        tiers: TierConfig | None = None,
        **tier_settings,
    ) -> None:
        super().__init__()
        self._tables = _check_tables(tables)
        self._table_of_feature = {
            feature: table for table in self._tables.values() for feature in table["feature_names"]
        }
        dims = list(dict.fromkeys(table["embedding_dim"] for table in self._tables.values()))
        config = TierConfig.from_settings(tiers, tier_settings)
        if len(dims) > 1:
            config = TierConfig.from_settings(
                config,
                {name: _share(getattr(config, name), len(dims)) for name in ("host_cache", "device_cache")},
            )
        root = None if path is None else Path(path)
        if root is not None:
            _check_layout(root, self._tables)
        self.groups = nn.ModuleDict(
            {
                f"dim{dim}": TieredEmbeddingBag(
                    None,
                    dim,
                    mode="sum",
                    path=None if root is None else root / f"dim{dim}",
                    backend=backend,
                    seed=seed,
                    optimizer=copy.deepcopy(optimizer if optimizer is not None else SGD()),
                    dtype=dtype,
                    device=device,
                    tiers=config,
                )
                for dim in dims
            }
        )
        if root is not None and not (root / LAYOUT_FILE).exists():  # the stores first: they check the root
            write_json_atomic(root / LAYOUT_FILE, {"tables": list(self._tables.values())})
        self.lookups = {name: 0 for name in self._tables}  # ids looked up, per table

    def forward(self, features: Any) -> KeyedTensor:
        keys, values, lengths, weights = jagged_parts(features)
        unknown = [key for key in keys if key not in self._table_of_feature]
        if unknown:
            raise KeyError(
                f"feature(s) {unknown} have no table; the tables' features are "
                f"{sorted(self._table_of_feature)}"
            )
        for key in keys if weights is not None else ():
            if self._table_of_feature[key]["pooling"] == "mean":
                raise ValueError(
                    f"feature {key!r}: weights need sum pooling (as torch's), its table pools by mean"
                )
        counts = lengths.sum(dim=1).tolist()  # ids per feature
        feature_ids = torch.split(values, counts)
        feature_weights = torch.split(weights, counts) if weights is not None else None
        for key, ids in zip(keys, feature_ids):  # every feature checked before any table is touched
            _check_ids(ids, self._table_of_feature[key])
        blocks, order = [], []  # each group's [batch, features x dim] and the features it holds
        for group_name, group in self.groups.items():
            positions = [
                index
                for index, key in enumerate(keys)
                if f"dim{self._table_of_feature[key]['embedding_dim']}" == group_name
            ]
            if positions:
                blocks.append(
                    self._group_forward(group, keys, positions, feature_ids, lengths, feature_weights)
                )
                order.extend(positions)
        dims = [self._table_of_feature[key]["embedding_dim"] for key in keys]
        if not blocks:
            device = next(iter(self.groups.values()))._output_like.device
            return KeyedTensor(keys, dims, torch.zeros(lengths.shape[1], 0, device=device))
        values_out = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
        if order != sorted(order):  # groups interleave in keys' order: one column gather
            starts = [sum(dims[:index]) for index in range(len(dims))]
            columns = torch.cat([torch.arange(starts[index], starts[index] + dims[index]) for index in order])
            values_out = values_out.index_select(1, torch.argsort(columns).to(values_out.device))
        return KeyedTensor(keys, dims, values_out)

    def _group_forward(self, group, keys, positions, feature_ids, lengths, feature_weights) -> torch.Tensor:
        """``[batch, len(positions) x dim]``: the pooled rows of the features at ``positions`` side by
        side, all in one lookup of ``group``. ``feature_ids``/``feature_weights``: each feature's ids
        and weights (or None)."""
        tables = [self._table_of_feature[keys[index]] for index in positions]
        for table, index in zip(tables, positions):
            self.lookups[table["name"]] += feature_ids[index].numel()
        ids = torch.cat(
            [table_keys(table, feature_ids[index].cpu()) for table, index in zip(tables, positions)]
        )
        group_lengths = lengths[positions]
        flat_lengths = group_lengths.reshape(-1)
        offsets = torch.cumsum(flat_lengths, 0) - flat_lengths
        weights = (
            None if feature_weights is None else torch.cat([feature_weights[index] for index in positions])
        )
        pooled = group(ids, offsets, weights).view(len(positions), lengths.shape[1], -1)
        means = torch.tensor([table["pooling"] == "mean" for table in tables])
        if bool(means.any()):
            divisors = torch.where(means[:, None], group_lengths.clamp(min=1), 1).to(pooled)
            pooled = pooled / divisors[:, :, None]
        return pooled.transpose(0, 1).reshape(lengths.shape[1], -1)

    def flush(self) -> None:
        """Make every table's updates durable (each group's store commits atomically)."""
        for group in self.groups.values():
            group.flush()

    def close(self) -> None:
        for group in self.groups.values():
            group.close()

    def stats(self) -> dict:
        """``{"tables": {name: {"lookups": ids looked up}}, "groups": {"dim16": the store's stats
        per tier}}``: the tiers are shared by the tables of a group."""
        return {
            "tables": {name: {"lookups": count} for name, count in self.lookups.items()},
            "groups": {name: group.store.stats() for name, group in self.groups.items()},
        }

    def table_names(self) -> list[str]:
        return list(self._tables)


def read_layout(root: Path) -> list[dict]:
    """The tables of the collection at ``root`` as ``collection.json`` records them: name,
    embedding_dim, num_embeddings, feature_names, pooling and number (in its group)."""
    layout_file = Path(root) / LAYOUT_FILE
    if not layout_file.exists():
        raise FileNotFoundError(f"{root} is not a tierstore collection: {LAYOUT_FILE} is missing")
    return json.loads(layout_file.read_text())["tables"]


def group_path(root: Path, table: dict) -> Path:
    """The store holding ``table``'s rows (one per embedding dim)."""
    return Path(root) / f"dim{table['embedding_dim']}"


def table_keys(table: dict, ids: torch.Tensor) -> torch.Tensor:
    """Keys in the group's store of ``table``'s ``ids`` (int64, below 2**47)."""
    return (table["number"] << ID_BITS) | ids


def _check_tables(tables: list[Any]) -> dict[str, dict]:
    """``{name: its settings and its number in its group}``, refusing a name used twice or a feature
    claimed by two tables."""
    if not tables:
        raise ValueError("a collection needs at least one table")
    checked: dict[str, dict] = {}
    owner: dict[str, str] = {}
    per_dim: dict[int, int] = {}
    for config in tables:
        name, num_embeddings, dim, features, pooling = table_settings(config)
        if name in checked:
            raise ValueError(f"table name {name!r} is used twice; every table needs its own name")
        for feature in features:
            if feature in owner:
                raise ValueError(f"feature {feature!r} is claimed by tables {owner[feature]!r} and {name!r}")
            owner[feature] = name
        number = per_dim.get(dim, 0)
        if number >= MAX_TABLES_PER_GROUP:
            raise ValueError(f"more than {MAX_TABLES_PER_GROUP} tables of dim {dim}")
        per_dim[dim] = number + 1
        checked[name] = {
            "name": name,
            "num_embeddings": num_embeddings,
            "embedding_dim": dim,
            "feature_names": list(features),
            "pooling": pooling,
            "number": number,
        }
    return checked


def _check_layout(root: Path, tables: dict[str, dict]) -> None:
    """An existing collection at ``root`` must have been made with the same tables in the same order."""
    layout_file = root / LAYOUT_FILE
    if not layout_file.exists():
        if root.exists() and any(root.iterdir()):
            raise ValueError(f"{root} is not empty and holds no {LAYOUT_FILE}: not a tierstore collection")
        return
    stored = {table["name"]: table for table in json.loads(layout_file.read_text())["tables"]}
    if stored != tables:
        raise ValueError(
            f"{root} holds a collection of other tables ({sorted(stored)}, as {LAYOUT_FILE} records); "
            "open it with the same table configs in the same order"
        )


def _check_ids(ids: torch.Tensor, table: dict) -> None:
    if not ids.numel():
        return
    low, high = int(ids.min()), int(ids.max())
    bound = table["num_embeddings"] if table["num_embeddings"] is not None else 1 << ID_BITS
    if low < 0 or high >= bound:
        raise IndexError(
            f"table {table['name']!r}: ids must be in [0, {bound}), got {low if low < 0 else high}"
        )


def _share(budget: Any, parts: int) -> Any:
    """A cache budget split evenly between ``parts`` groups."""
    if budget is None or budget == 0:
        return budget
    if isinstance(budget, int):
        return max(1, budget // parts)
    if budget.strip().endswith("%"):
        return f"{float(budget.strip()[:-1]) / parts}%"
    return f"{parse_bytes(budget) // parts}B"
