"""``TieredEmbeddingBagCollection``: many tables looked up by ``KeyedJaggedTensor`` features, with
tables fused into one store per embedding dim (TorchRec's ``EmbeddingBagCollection`` in shape).

Fusion: the tables of one dim live in one ``TieredEmbeddingBag`` (one store, one key space, one
host and one device budget, so hot rows of any table compete for the same cache). A row's key
is ``table_number << 47 | id``: ids must be below 2**47, and a group holds up to 2**16 tables.
Each forward checks the whole batch and lays out each group's keys (``JaggedBatch``), then makes
one pass through the tiers per group: one dedupe over the keys of all its features, one pooled
lookup of all their bags, one fused optimizer step in backward. The
numbering is recorded in ``collection.json`` under ``path`` and checked when the collection is
reopened. Several groups split the cache budgets evenly.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..budget import parse_bytes
from ..checkpoint import CheckpointWriting
from ..errors import StoreFormatError
from ..kernels.step_passes import distinct_ids
from ..metadata import DTYPES, METADATA_FILE, write_json_atomic
from ..optim import SGD, SparseOptimizer
from ..store import TieredStore
from ..tiers.config import TierConfig
from ..validation import as_path
from ..warm_start import hot_ids
from .collection_table import CollectionTable
from .embedding import TieredEmbeddingBag
from .flush_record import flush_mismatch, read_flush_record, write_flush_record
from .fused_optimizer import FusedOptimizer, fused_optimizer_of, without_fused_optimizer
from .jagged_batch import ID_BITS, JaggedBatch, checked_table_keys
from .keyed import KeyedTensor, table_settings
from .sharding import refuse_prefetch
from .table_checkpoints import restore_checkpoint, write_checkpoint
from .tracing import opaque_to_tracers

ID_MASK = (1 << ID_BITS) - 1
MAX_TABLES_PER_GROUP = 1 << 16
LAYOUT_FILE = "collection.json"


class TieredEmbeddingBagCollection(nn.Module):
    """Tables (``EmbeddingBagConfig``s, TorchRec's accepted) looked up by feature name.

    Args: ``tables``; ``path`` (a directory holding one store per group of tables, ``dimN`` (and
    ``dimN-float16``/``-bfloat16`` for tables whose config sets ``data_type``), and
    ``collection.json``; ``None``: temporary stores); ``backend``, ``seed``, ``optimizer`` (one
    fused optimizer for every table, default ``optim.SGD(lr=0.01)``), ``dtype`` (of the tables whose
    ``data_type`` is FP32, the default), ``device`` and the
    cache tiers' settings (``tiers=`` or keywords) as ``TieredEmbeddingBag`` takes them; ``warm``:
    table name -> hot ids (or a ``.npy`` of them), most wanted first, or an ``.npz`` of them (as
    ``tierstore profile --out`` writes), preloaded into the caches at open as ``TieredStore(warm=)``
    does, merged rank by rank where tables share a store. ``process_group`` and ``replicate`` (as
    ``warm`` takes ids, or an int N: the N first keys of each group's ``warm`` ranking) shard every
    group over the group's ranks as ``TieredEmbeddingBag`` does; ``replicate="auto"`` plans each
    group's replicated rows from ``access_sample``, this rank's first ``KeyedJaggedTensor`` batches.

    ``is_weighted``: the features' weights weigh their ids (sum pooling); else they are ignored,
    as TorchRec's ``EmbeddingBagCollection(is_weighted=False)`` ignores them.

    ``forward(features: KeyedJaggedTensor) -> KeyedTensor`` with the pooled ``[batch, dim]`` of
    every feature in ``features.keys()`` order; a feature several tables read gives one output per
    table, named ``feature@table`` (TorchRec's names), in the tables' order. Adam's and Adagrad's
    step counts are per group (every fused update of the group counts), as in FBGEMM's fused tables.
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
        warm: dict[str, Any] | str | Path | None = None,
        process_group: Any = None,
        replicate: dict[str, Any] | str | Path | int | None = None,
        access_sample: list[Any] | None = None,
        is_weighted: bool = False,
        **tier_settings,
    ) -> None:
        super().__init__()
        self._tables = _check_tables(tables)
        self._configs = list(tables)  # as given (TorchRec's or ours), for embedding_bag_configs()
        # A feature read by several tables is looked up in each, named feature@table (TorchRec's names).
        self._shared = _shared_features(self._tables)
        self._table_of_feature = {
            f"{feature}@{table['name']}" if feature in self._shared else feature: table
            for table in self._tables.values()
            for feature in table["feature_names"]
        }
        self._weighted = bool(is_weighted)
        self._layouts: dict = {}  # JaggedBatch's per-feature-order tensors
        warm_keys = self._warm_keys(warm)  # checked before any store is opened
        auto = isinstance(replicate, str) and replicate == "auto"
        replicated = None if auto else self._replicated_keys(replicate, warm_keys)
        samples = self._group_samples(access_sample) if auto else None
        members: dict[str, list[dict]] = {}  # group name -> its tables, in the tables' order
        for table in self._tables.values():
            members.setdefault(_group_name(table), []).append(table)
        config = TierConfig.from_settings(tiers, tier_settings)
        if len(members) > 1:
            config = TierConfig.from_settings(
                config,
                {
                    name: _share(getattr(config, name), len(members))
                    for name in ("host_cache", "device_cache")
                },
            )
        root = as_path(path)
        if root is not None:
            _check_layout(root, self._tables, sharded=process_group is not None)
        groups: dict[str, TieredEmbeddingBag] = {}
        try:
            for group_name, group_tables in members.items():
                data_type = group_tables[0].get("data_type")
                groups[group_name] = TieredEmbeddingBag(
                    None,
                    group_tables[0]["embedding_dim"],
                    mode="sum",
                    path=None if root is None else root / group_name,
                    backend=backend,
                    seed=seed,
                    optimizer=copy.deepcopy(optimizer if optimizer is not None else SGD()),
                    dtype=dtype if data_type is None else DTYPES[data_type],
                    device=device,
                    tiers=config,
                    process_group=process_group,
                    replicate="auto"
                    if auto
                    else _group_keys(replicated, group_name, torch.zeros(0, dtype=torch.int64)),
                    access_sample=_group_keys(samples, group_name, []),
                    most_rows=_most_rows(group_tables),
                )
        except BaseException:
            _release(groups.values())  # a group that cannot open leaves none open
            raise
        self.groups = nn.ModuleDict(groups)
        self.sharded = process_group is not None
        if self.sharded:
            self._sharding.agree("tables", list(self._tables.values()))
        # The flush record of an unsharded collection (a sharded one records its flushes per rank).
        self._record_root = root if root is not None and not self.sharded else None
        record = None if self._record_root is None else read_flush_record(root)
        if record is not None:
            problem = flush_mismatch(root, record, self._flush_counts())
            if problem is not None:
                _release(self.groups.values())
                raise StoreFormatError(problem)
        if root is not None and not (root / LAYOUT_FILE).exists():  # the stores first: they check the root
            write_json_atomic(root / LAYOUT_FILE, {"tables": list(self._tables.values())})
        if self._record_root is not None and (
            record is None or not record[0]
        ):  # none yet, or begun and sound
            write_flush_record(root, self._flush_counts(), complete=True)
        for group_name, keys in warm_keys.items():
            self.groups[group_name].store.preload(keys)
        self._lookups = {name: 0 for name in self._tables}  # ids looked up, per table (see lookups)
        self._plans: dict[tuple, _FeaturePlan] = {}  # per order of features: what forward does with it

    def warm_keys(self, warm: dict[str, Any]) -> list[tuple[TieredStore, torch.Tensor]]:
        """``[(a group's store, its keys of the warm rankings)]`` (table name -> ids, most wanted
        first), for ``prefetch(warm=)``."""
        return [(self.groups[name].store, keys) for name, keys in self._warm_keys(warm).items()]

    @property
    def _sharding(self):
        """The first group's ``RowSharding`` (None unsharded): every group runs the same collectives,
        so the first one's tell the other ranks what the whole collection does."""
        return next(iter(self.groups.values())).sharding

    def _group_samples(self, access_sample: list[Any] | None) -> dict[str, list[torch.Tensor]]:
        """Each group's keys of every ``KeyedJaggedTensor`` of ``access_sample``, for
        ``replicate="auto"``."""
        if access_sample is None:
            raise ValueError(
                'replicate="auto" chooses the replicated rows from access_sample=, the first '
                "KeyedJaggedTensor batches this rank will look up: give it, or replicate= the ids"
            )
        samples: dict[str, list[torch.Tensor]] = {}
        for features in access_sample:
            batch = self._batch(features)
            for group_name in {_group_name(table) for table in self._tables.values()}:
                positions = _in_group(group_name, batch.tables)
                if positions:
                    samples.setdefault(group_name, []).append(batch.group_bags(positions)[0])
        return samples

    def _replicated_keys(
        self, replicate: Any, warm_keys: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor] | None:
        """Each group's replicated keys (None: none asked for): the tables' ids as ``warm`` takes
        them, or an int N, the N first keys of each group's ``warm`` ranking."""
        if replicate is None:
            return None
        if isinstance(replicate, int) and not isinstance(replicate, bool):
            if replicate < 0 or (replicate and not warm_keys):
                raise ValueError(
                    f"replicate={replicate} takes the {replicate} hottest keys of each group's warm= "
                    f"ranking: give warm= rankings, or replicate= the tables' ids as warm= takes them"
                )
            return {group: keys[:replicate] for group, keys in warm_keys.items()}
        return self._warm_keys(replicate, "replicate")

    def _warm_keys(self, warm: dict[str, Any] | None, argument: str = "warm") -> dict[str, torch.Tensor]:
        """Each group's store keys of the ``warm`` rankings (table name -> ids, most wanted first),
        merged rank by rank across its tables."""
        if warm is None:
            return {}
        if isinstance(warm, (str, Path)):
            warm = _rankings_file(Path(warm), argument)
        if not isinstance(warm, dict):
            raise TypeError(
                f"{argument} must be a dict of table name -> hot ids (or a .npy path), or the path of an "
                f".npz of them ('tierstore profile --out PREFIX' writes PREFIX-tables.npz), got {warm!r}"
            )
        unknown = sorted(set(warm) - set(self._tables))
        if unknown:
            raise KeyError(
                f"{argument} names unknown table(s) {unknown}; the tables are {sorted(self._tables)}"
            )
        ranked: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for name, ids in warm.items():
            table = self._tables[name]
            ids = hot_ids(ids)
            keys = checked_table_keys(table, ids)
            ranked.setdefault(_group_name(table), []).append((keys, torch.arange(ids.numel())))
        merged = {}
        for group_name, parts in ranked.items():
            keys, ranks = (torch.cat(column) for column in zip(*parts))
            merged[group_name] = keys[torch.sort(ranks, stable=True).indices]
        return merged

    @opaque_to_tracers
    def forward(self, features: Any) -> KeyedTensor:
        try:
            batch = self._batch(features)  # all checked first
        except Exception as error:
            if not self.sharded:
                raise
            self._sharding.refuse(error)  # the others raise too
        lengths = batch.lengths
        plan = self._plan(batch)
        plan.starts_seen += batch.feature_starts  # folded into lookups when read
        blocks = []  # each group's [batch, features x dim]
        for group_name, group in self.groups.items():
            positions, group_tables, means = plan.groups[group_name]
            if not positions:
                if self.sharded:  # every rank's group takes part in every exchange
                    blocks.append(_idle_forward(group, lengths.shape[1]))
                continue
            keys, starts, weights = batch.group_bags(positions)
            group_lengths = lengths if len(positions) == len(plan.dims) else lengths[positions]
            blocks.append(_group_forward(group, group_tables, means, keys, starts, weights, group_lengths))
        if not blocks:
            device = next(iter(self.groups.values()))._output_like.device
            return KeyedTensor(batch.keys, plan.dims, torch.zeros(lengths.shape[1], 0, device=device))
        values_out = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
        if plan.columns is not None:  # groups interleave in keys' order: one column gather
            values_out = values_out.index_select(1, plan.columns.to(values_out.device))
        return KeyedTensor(batch.keys, plan.dims, values_out)

    @property
    def lookups(self) -> dict[str, int]:
        """Ids looked up, per table."""
        for plan in self._plans.values():
            for name, count in zip(plan.names, plan.starts_seen.diff().tolist()):
                self._lookups[name] += count
            plan.starts_seen.zero_()
        return self._lookups

    def store_keys(self, features: Any) -> list[tuple[TieredStore, torch.Tensor]]:
        """``[(a group's store, the distinct keys forward(features) looks up there)]``, for a
        lookahead pipeline (``tierstore.prefetch``); bad input raises as ``forward`` would."""
        refuse_prefetch(self._sharding)
        batch = self._batch(features)
        return [
            (self.groups[group_name].store, distinct_ids(batch.group_bags(positions)[0]))
            for group_name, (positions, _, _) in self._plan(batch).groups.items()
            if positions
        ]

    def _plan(self, batch: JaggedBatch) -> _FeaturePlan:
        """The plan of ``batch``'s order of features, made at its first batch."""
        plan = self._plans.get(batch.layout_key)
        if plan is None:
            plan = self._plans[batch.layout_key] = _FeaturePlan(batch.tables, list(self.groups))
        return plan

    def flush(self) -> None:
        """Make every table's updates durable: each group's store commits atomically, and the
        flush record (``flush_record``) lets a reopening tell a flush killed between two groups."""
        with self._changing_every_group():
            for group in self.groups.values():
                group.flush()

    def close(self) -> None:
        """Flush and close every group."""
        if all(group.store.closed for group in self.groups.values()):
            return
        with self._changing_every_group():
            for group in self.groups.values():
                group.close()

    def checkpoint(self, path: str | Path, background: bool = False) -> CheckpointWriting:
        """Every table's rows, optimizer state and step count as of now, in the new directory
        ``path`` (a part per group); see ``TieredEmbeddingBag.checkpoint``."""
        return write_checkpoint(path, dict(self.groups.items()), self._sharding, background)

    def restore(self, path: str | Path) -> None:
        """Every table exactly as the checkpoint at ``path`` holds it (``TieredEmbeddingBag.restore``
        per group; a restore cut short between groups is found at the next open, as a flush is)."""
        with self._changing_every_group():
            restore_checkpoint(path, dict(self.groups.items()), self._sharding)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        with self._changing_every_group():  # each group loads (and commits) its rows
            return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        self.flush()  # the groups' own flushes that follow commit nothing new
        super()._save_to_state_dict(destination, prefix, keep_vars)

    @contextlib.contextmanager
    def _changing_every_group(self):
        """Record that an operation changing every group begins, then (unless it raises) completes."""
        if self._record_root is None:
            yield
            return
        write_flush_record(self._record_root, self._flush_counts(), complete=False)
        yield
        write_flush_record(self._record_root, self._flush_counts(), complete=True)

    def _flush_counts(self) -> dict[str, int]:
        return {name: group.store.flushes for name, group in self.groups.items()}

    def stats(self) -> dict:
        """``{"tables": {name: {"lookups": ids looked up}}, "groups": {"dim16": the store's stats
        per tier}}``: the tiers are shared by the tables of a group."""
        return {
            "tables": {name: {"lookups": count} for name, count in self.lookups.items()},
            "groups": {name: group.store.stats() for name, group in self.groups.items()},
        }

    def _batch(self, features: Any) -> JaggedBatch:
        """``features`` checked and laid out (``JaggedBatch``): shared features split per table, weights
        taken where the collection ``is_weighted``."""
        return JaggedBatch(features, self._table_of_feature, self._layouts, self._shared, self._weighted)

    @property
    def embedding_bags(self) -> dict[str, CollectionTable]:
        """The tables by name (TorchRec's ``embedding_bags``): their settings, and their rows read and
        written by their own ids."""
        return {
            name: CollectionTable(self.groups[_group_name(table)], table)
            for name, table in self._tables.items()
        }

    def is_weighted(self) -> bool:
        """Whether the features' weights weigh the ids (TorchRec's ``is_weighted``)."""
        return self._weighted

    @property
    def device(self) -> torch.device:
        """Where the outputs go (TorchRec's ``EmbeddingBagCollection.device``)."""
        return next(iter(self.groups.values()))._output_like.device

    def table_names(self) -> list[str]:
        return list(self._tables)

    def fused_optimizer(self) -> FusedOptimizer:
        """The tables' fused optimizer as a ``torch.optim.Optimizer`` (one param group per group of
        tables): a learning rate set in it, or by a ``torch.optim.lr_scheduler``, is the one the
        next updates use (``FusedOptimizer``). The same object at every call."""
        return fused_optimizer_of(self, list(self.groups.values()))

    def __getstate__(self) -> dict:
        return without_fused_optimizer(super().__getstate__())

    def embedding_bag_configs(self) -> list[Any]:
        """The tables' configs, as given (TorchRec's ``EmbeddingBagCollection`` API)."""
        return list(self._configs)


def read_layout(root: Path) -> list[dict]:
    """The tables of the collection at ``root`` as ``collection.json`` records them: name,
    embedding_dim, num_embeddings, feature_names, pooling and number (in its group).
    ``FileNotFoundError`` where there is none, ``StoreFormatError`` where it is damaged."""
    layout_file = Path(root) / LAYOUT_FILE
    if not layout_file.exists():
        raise FileNotFoundError(f"{root} is not a tierstore collection: {LAYOUT_FILE} is missing")
    try:
        tables = json.loads(layout_file.read_text())["tables"]
        fields = {"name", "embedding_dim", "num_embeddings", "feature_names", "pooling", "number"}
        if not isinstance(tables, list) or not all(fields <= set(table) for table in tables):
            raise ValueError(f"its tables lack some of {sorted(fields)}")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as error:
        raise StoreFormatError(
            f"{layout_file} is damaged ({error}); restore it from a backup (it names the collection's "
            f"tables, and the stores cannot be read without it)"
        ) from None
    return tables


def group_path(root: Path, table: dict) -> Path:
    """The store holding ``table``'s rows (one per embedding dim)."""
    return Path(root) / _group_name(table)


def table_keys(table: dict, ids: torch.Tensor) -> torch.Tensor:
    """Keys in the group's store of ``table``'s ``ids`` (int64, below 2**47)."""
    return (table["number"] << ID_BITS) | ids


def _check_tables(tables: list[Any]) -> dict[str, dict]:
    """``{name: its settings and its number in its group}``, refusing a name used twice."""
    if not isinstance(tables, (list, tuple)):
        raise TypeError(
            f"tables must be a list of EmbeddingBagConfig, got {type(tables).__name__}"
            + ("; wrap the one table in a list: [config]" if hasattr(tables, "embedding_dim") else "")
        )
    if not tables:
        raise ValueError("a collection needs at least one table")
    checked: dict[str, dict] = {}
    per_group: dict[str, int] = {}
    for config in tables:
        name, num_embeddings, dim, features, pooling, data_type = table_settings(config)
        if num_embeddings is not None and num_embeddings > 1 << ID_BITS:
            raise ValueError(
                f"table {name!r}: num_embeddings={num_embeddings} is past the collection's key space: "
                f"ids must be below 2**{ID_BITS} (the table's number is kept in the bits above); use "
                f"num_embeddings <= 2**{ID_BITS}, or None (any id below 2**{ID_BITS})"
            )
        if name in checked:
            raise ValueError(f"table name {name!r} is used twice; every table needs its own name")
        settings = {
            "name": name,
            "num_embeddings": num_embeddings,
            "embedding_dim": dim,
            "feature_names": list(features),
            "pooling": pooling,
        }
        if data_type is not None:  # recorded only where set: older collections' layouts still match
            settings["data_type"] = data_type
        group = _group_name(settings)
        number = per_group.get(group, 0)
        if number >= MAX_TABLES_PER_GROUP:
            raise ValueError(f"more than {MAX_TABLES_PER_GROUP} tables in group {group}")
        per_group[group] = number + 1
        checked[name] = {**settings, "number": number}
    return checked


def _check_layout(root: Path, tables: dict[str, dict], sharded: bool = False) -> None:
    """An existing collection at ``root`` must have been made with the same tables in the same order.
    ``sharded``: other ranks may be creating their groups' directories (and the layout file) at
    the same time."""
    layout_file = root / LAYOUT_FILE
    if not layout_file.exists():
        ours = re.compile(r"dim\d+(-\w+)?|" + re.escape(LAYOUT_FILE) + r"(\.\d+\.tmp)?")
        if root.exists() and any(not (sharded and ours.fullmatch(entry.name)) for entry in root.iterdir()):
            raise ValueError(f"{root} is not empty and holds no {LAYOUT_FILE}: not a tierstore collection")
        return
    stored = {table["name"]: table for table in read_layout(root)}
    if stored != tables:
        raise ValueError(
            f"{root} holds a collection of other tables ({sorted(stored)}, as {LAYOUT_FILE} records); "
            "open it with the same table configs in the same order"
        )
    for group in sorted({_group_name(table) for table in tables.values()}):
        if not (root / group / ("" if sharded else METADATA_FILE)).exists():  # sharded: one store per rank
            names = sorted(name for name, table in tables.items() if _group_name(table) == group)
            raise StoreFormatError(
                f"{root / group} is missing: the store of tables {names} is gone, and opening the collection "
                f"would start them empty; restore it from a backup"
            )


def _in_group(group_name: str, tables: list[dict]) -> list[int]:
    """Positions of the features whose table is in the group."""
    return [index for index, table in enumerate(tables) if _group_name(table) == group_name]


class _FeaturePlan:
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
            positions = _in_group(group_name, tables)
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


def _group_forward(group, tables, means, keys, starts, weights, lengths) -> torch.Tensor:
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


def _group_keys(per_group: dict[str, Any] | None, group_name: str, default: Any) -> Any:
    """``per_group``'s entry for a group, ``default`` if it has none (None if ``per_group`` is)."""
    return None if per_group is None else per_group.get(group_name, default)


def _idle_forward(group, batch: int) -> torch.Tensor:
    """``[batch, 0]``: a sharded group's part in a step none of its features are in (it serves the
    other ranks' lookups, and its gradients flow back through this empty block)."""
    keys = torch.zeros(0, dtype=torch.int64)
    return group(keys, torch.zeros(batch, dtype=torch.int64), None)[:, :0]


def _release(groups) -> None:
    """Close the stores of ``groups`` opened only to be refused, writing nothing."""
    for group in groups:
        group.store.release_unflushed()


def _most_rows(tables) -> int | None:
    """The most distinct keys a group of ``tables`` looks up: their rows, None if one grows on demand."""
    rows = [table["num_embeddings"] for table in tables]
    return None if None in rows else sum(rows)


def _shared_features(tables: dict[str, dict]) -> dict[str, list[str]]:
    """``{feature: the tables reading it}`` for the features more than one table reads."""
    readers: dict[str, list[str]] = {}
    for name, table in tables.items():
        for feature in table["feature_names"]:
            readers.setdefault(feature, []).append(name)
    return {feature: names for feature, names in readers.items() if len(names) > 1}


def _group_name(table: dict) -> str:
    """The group (one store) holding a table's rows: its dim, and its ``data_type`` where set."""
    data_type = table.get("data_type")
    return f"dim{table['embedding_dim']}" + ("" if data_type is None else f"-{data_type}")


def _share(budget: Any, parts: int) -> Any:
    """A cache budget split evenly between ``parts`` groups."""
    if budget is None or budget == 0:
        return budget
    if isinstance(budget, int):
        return max(1, budget // parts)
    if budget.strip().endswith("%"):
        return f"{float(budget.strip()[:-1]) / parts}%"
    return f"{parse_bytes(budget) // parts}B"


def _rankings_file(path: Path, argument: str) -> dict[str, np.ndarray]:
    """The rankings of an ``.npz`` (table name -> ids, most wanted first), read whole."""
    try:
        arrays = np.load(path, allow_pickle=False)
        if not isinstance(arrays, np.lib.npyio.NpzFile):
            raise ValueError("an .npy, not an .npz of rankings")
        with arrays:
            return {name: arrays[name] for name in arrays.files}
    except (OSError, ValueError) as error:
        raise ValueError(
            f"{argument}: {path} is not a readable .npz of table name -> hot ids ({error}); write one with "
            f"'tierstore profile TRACE --columns ... --out PREFIX' (PREFIX-tables.npz)"
        ) from None
