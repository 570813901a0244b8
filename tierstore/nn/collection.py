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
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import CheckpointWriting
from ..errors import StoreFormatError
from ..kernels.step_passes import distinct_ids
from ..metadata import DTYPES, write_json_atomic
from ..optim import SGD, SparseOptimizer
from ..store import TieredStore
from ..tiers.config import TierConfig
from ..validation import as_path
from .collection_forward import FeaturePlan, group_forward, idle_forward
from .collection_layout import (
    LAYOUT_FILE,
    check_layout,
    check_tables,
    group_of,
    in_group,
    most_rows,
    share_budget,
    shared_features,
)
from .collection_rankings import replicated_keys_by_group, warm_keys_by_group
from .collection_table import CollectionTable
from .embedding import TieredEmbeddingBag
from .flush_record import flush_mismatch, read_flush_record, write_flush_record
from .fused_optimizer import FusedOptimizer, fused_optimizer_of, without_fused_optimizer
from .jagged_batch import JaggedBatch
from .keyed import KeyedTensor
from .sharding import refuse_prefetch
from .table_checkpoints import restore_checkpoint, write_checkpoint
from .tracing import opaque_to_tracers


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
    as TorchRec's ``EmbeddingBagCollection(is_weighted=False)`` ignores them. ``ttl`` and
    ``max_rows`` expire ids as ``TieredStore`` does, in each store (its tables' ids together).

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
        ttl: Any = None,
        max_rows: int | None = None,
        **tier_settings,
    ) -> None:
        super().__init__()
        self._tables = check_tables(tables)
        self._configs = list(tables)  # as given (TorchRec's or ours), for embedding_bag_configs()
        # A feature read by several tables is looked up in each, named feature@table (TorchRec's names).
        self._shared = shared_features(self._tables)
        self._table_of_feature = {
            f"{feature}@{table['name']}" if feature in self._shared else feature: table
            for table in self._tables.values()
            for feature in table["feature_names"]
        }
        self._weighted = bool(is_weighted)
        self._layouts: dict = {}  # JaggedBatch's per-feature-order tensors
        warm_keys = warm_keys_by_group(self._tables, warm)  # checked before any store is opened
        auto = isinstance(replicate, str) and replicate == "auto"
        replicated = None if auto else replicated_keys_by_group(self._tables, replicate, warm_keys)
        samples = self._group_samples(access_sample) if auto else None
        members: dict[str, list[dict]] = {}  # group name -> its tables, in the tables' order
        for table in self._tables.values():
            members.setdefault(group_of(table), []).append(table)
        config = TierConfig.from_settings(tiers, tier_settings)
        if len(members) > 1:
            config = TierConfig.from_settings(
                config,
                {
                    name: share_budget(getattr(config, name), len(members))
                    for name in ("host_cache", "device_cache")
                },
            )
        root = as_path(path)
        if root is not None:
            check_layout(root, self._tables, sharded=process_group is not None)
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
                    most_rows=most_rows(group_tables),
                    ttl=ttl,
                    max_rows=max_rows,
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
        self._plans: dict[tuple, FeaturePlan] = {}  # per order of features: what forward does with it

    def warm_keys(self, warm: dict[str, Any]) -> list[tuple[TieredStore, torch.Tensor]]:
        """``[(a group's store, its keys of the warm rankings)]`` (table name -> ids, most wanted
        first), for ``prefetch(warm=)``."""
        return [
            (self.groups[name].store, keys) for name, keys in warm_keys_by_group(self._tables, warm).items()
        ]

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
            for group_name in {group_of(table) for table in self._tables.values()}:
                positions = in_group(group_name, batch.tables)
                if positions:
                    samples.setdefault(group_name, []).append(batch.group_bags(positions)[0])
        return samples

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
        plan.count(batch.feature_starts)
        blocks = []  # each group's [batch, features x dim]
        for group_name, group in self.groups.items():
            positions, group_tables, means = plan.groups[group_name]
            if not positions:
                if self.sharded:  # every rank's group takes part in every exchange
                    blocks.append(idle_forward(group, lengths.shape[1]))
                continue
            keys, starts, weights = batch.group_bags(positions)
            group_lengths = lengths if len(positions) == len(plan.dims) else lengths[positions]
            blocks.append(group_forward(group, group_tables, means, keys, starts, weights, group_lengths))
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
            for name, count in zip(plan.names, plan.take_lookups()):
                self._lookups[name] += count
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

    def _plan(self, batch: JaggedBatch) -> FeaturePlan:
        """The plan of ``batch``'s order of features, made at its first batch."""
        plan = self._plans.get(batch.layout_key)
        if plan is None:
            plan = self._plans[batch.layout_key] = FeaturePlan(batch.tables, list(self.groups))
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
            name: CollectionTable(self.groups[group_of(table)], table) for name, table in self._tables.items()
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


def _group_keys(per_group: dict[str, Any] | None, group_name: str, default: Any) -> Any:
    """``per_group``'s entry for a group, ``default`` if it has none (None if ``per_group`` is)."""
    return None if per_group is None else per_group.get(group_name, default)


def _release(groups) -> None:
    """Close the stores of ``groups`` opened only to be refused, writing nothing."""
    for group in groups:
        group.store.release_unflushed()
