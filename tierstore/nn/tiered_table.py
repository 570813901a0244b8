"""``_TieredTable``: what ``TieredEmbeddingBag`` and ``TieredEmbedding`` share: the store, the
optimizer, the local weights of a lookup and the update hook."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import PaddingIdxError
from ..kernels.step_passes import distinct_ids
from ..optim import SGD, SparseOptimizer
from ..store import TieredStore
from ..tiers.config import TierConfig
from ..validation import (
    as_ids,
    as_path,
    as_rows,
    check_lookup_ids,
    check_table_shape,
    integral,
)
from . import native_step, pooled_lookup
from .fused_optimizer import FusedOptimizer, fused_optimizer_of
from .shard_placement import replicated_keys
from .sharding import RowSharding, refuse_prefetch
from .table_state import TableState

_MISSING = ("init", "zero", "error")


class _TieredTable(TableState, nn.Module):
    """What both modules share: the store, the optimizer, local weights and the update hook."""

    padding_left_out = True  # padding entries are left out of the lookup (bags), or read their row
    looks_up_integers = False  # from_pretrained takes integer weights: a frozen id -> integer lookup
    scale_grad_by_freq = False  # each row's gradient divided by its count in the batch (as torch's)

    def __init__(
        self,
        num_embeddings: int | None,
        embedding_dim: int,
        padding_idx: int | None,
        path: str | Path | None,
        backend: str | None,
        seed: int,
        optimizer: SparseOptimizer | None,
        missing: str,
        dtype: torch.dtype | None,
        device: torch.device | str | None,
        tiers: TierConfig | None,
        tier_settings: dict,
        process_group: Any = None,
        replicate: Any = None,
        access_sample: Any = None,
    ) -> None:
        super().__init__()
        num_embeddings, embedding_dim, padding_idx = (
            integral(value) for value in (num_embeddings, embedding_dim, padding_idx)
        )
        check_table_shape(num_embeddings, embedding_dim)
        path = as_path(path)
        if missing not in _MISSING:
            raise ValueError(f"missing must be one of {_MISSING}, got {missing!r}")
        self.optimizer = optimizer if optimizer is not None else SGD()
        if not isinstance(self.optimizer, SparseOptimizer):
            raise TypeError(
                f"optimizer must be a tierstore.optim optimizer such as tierstore.optim.SGD(lr=0.01), "
                f"got {type(optimizer).__name__}"
            )
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = normalise_padding_idx(padding_idx, num_embeddings)
        self.missing = missing
        device = torch.device(device if device is not None else "cpu")
        self.sharding = None
        auto = isinstance(replicate, str) and replicate == "auto"
        if process_group is not None:
            if auto and access_sample is None:
                raise ValueError(
                    'replicate="auto" chooses the replicated rows from access_sample=, the first '
                    "batches of ids this rank will look up: give it, or replicate= the ids"
                )
            requested = None if auto else replicated_keys(replicate, tier_settings.get("warm"))
            self.sharding = RowSharding(process_group)
            path = self.sharding.together(
                "store's placement", lambda: self.sharding.store_path(path, requested)
            )
            settings = [num_embeddings, embedding_dim, padding_idx, repr(self.optimizer), seed, str(dtype)]
            self.sharding.agree("table settings", [*settings, backend])
        elif replicate is not None:
            raise ValueError("replicate needs a process_group: replication is across its ranks")

        def open_store() -> TieredStore:
            return TieredStore(
                path,
                dim=embedding_dim,
                dtype=dtype if dtype is not None else torch.get_default_dtype(),  # as torch's modules
                backend=backend,
                device=device,
                optimizer_state_width=self.optimizer.state_width(embedding_dim),
                optimizer=self.optimizer.name,
                seed=seed,
                tiers=tiers,
                **{"most_rows": num_embeddings, **tier_settings},  # a collection's group passes its own
            )

        if self.sharding is None:
            self.store = open_store()
        else:
            self.store = self.sharding.together("store's opening", open_store, undo=TieredStore.close)
            if auto and not self.sharding.recorded:  # at most half the top tier replicated
                self.sharding.choose_replicated(
                    access_sample, embedding_dim, self.store.stack.top.max_capacity // 2
                )
        self.step = 0
        if self.sharding is not None:
            self.step = self.sharding.last_flushed_step()
            digest = hashlib.sha256(self.sharding.replicated.numpy().tobytes()).hexdigest()
            self.sharding.agree("replicated keys or last flushed steps", [digest, self.step])
        self.integers = None  # from_pretrained of integers: their dtype (the rows hold their bits)
        # Zero elements: its requires_grad says whether the table trains, so that torch's ways of
        # freezing (requires_grad_, on the table or the model; from_pretrained(freeze=True)) work.
        self.trainable = nn.Parameter(torch.empty(0, device=device))
        # An empty buffer that follows .to(device) and .to(dtype) / .double() / .half(): where
        # outputs go and their dtype. The rows keep the store's dtype.
        self.register_buffer(
            "_output_like", torch.empty(0, dtype=self.store.dtype, device=device), persistent=False
        )
        if self.padding_idx is not None and self.sharding is None:
            self._start_padding_row_at_zero()

    def _start_padding_row_at_zero(self) -> None:
        """As torch's modules start: the padding row zero, where the store does not hold it yet."""
        key = torch.tensor([self.padding_idx])
        if not bool(self.store.contains(key)[0]):
            self.store.put(key, torch.zeros(1, self.embedding_dim, dtype=self.store.dtype))

    def __prepare_scriptable__(self):
        raise RuntimeError(
            f"torch.jit.script cannot compile a {type(self).__name__}: its rows live in a store outside "
            "TorchScript. Use torch.compile (the store lookup stays outside the compiled graph), or "
            "export the rows (tierstore export, or iter_rows) into an nn.EmbeddingBag to script"
        )

    @property
    def output_dtype(self) -> torch.dtype:
        """The dtype of the outputs: the rows' dtype until the module is cast (``.double()``...)."""
        return self._output_like.dtype

    # -- lookups -------------------------------------------------------------------------------

    def _refuse_tracing(self) -> None:
        if torch.jit.is_tracing():
            raise RuntimeError(
                f"torch.jit.trace cannot record a {type(self).__name__}: its rows come from a store outside "
                "the graph, so a trace would freeze this batch's rows into it. Use torch.compile (the "
                "store lookup stays outside the compiled graph), or export the rows into an "
                "nn.EmbeddingBag to trace"
            )

    def _local_weight(self, ids: torch.Tensor) -> tuple[torch.Tensor, pooled_lookup.LocalIds]:
        """``(weight [U (+1), dim], the ids as rows of weight)``.

        ``ids``: int64, any shape, validated. Each id maps to its distinct row; the padding row
        gets no update. Where ``padding_left_out`` (bags), padding entries map to an extra zero row
        instead; else (``nn.Embedding``) they read the stored row.
        """
        padding = None
        if self.padding_idx is not None and self.padding_left_out:
            padding = ids.reshape(-1) == self.padding_idx
        unique, counts, local = pooled_lookup.distinct(ids, padding)
        training = self.training and torch.is_grad_enabled() and not self.frozen
        slots = None
        if self.sharding is not None:  # slots: how the rows were exchanged, for the backward
            weight, known, slots = self.sharding.lookup(self.store, unique, counts, training)
            if not training:
                weight = self._missing_rows(unique, weight, known)
        elif training:
            weight, slots = self.store.get_distinct(unique, counts)
        else:
            weight = self._rows_without_growing(unique)
        if padding is not None:
            weight = torch.cat([weight, weight.new_zeros(1, self.embedding_dim)])
        # Computed in float32, or the rows' or the outputs' dtype where wider: a half-precision
        # output's gradient, and 16-bit rows', are still summed per row in float32 (a table of
        # integers, whose rows hold their bits, is read as stored).
        wide = torch.promote_types(weight.dtype, self.output_dtype)
        if self.integers is None:
            wide = torch.promote_types(wide, torch.float32)
        weight = weight.to(self._output_like.device, wide)
        if training:
            update_dtype = torch.promote_types(self.store.dtype, torch.float32)  # optim computes in it
            weight.requires_grad_(True)
            weight.register_hook(
                lambda grad: self._apply_gradient(unique, slots, grad[: unique.numel()].to(update_dtype))
            )
            weight = native_step.tied_to(self.trainable, weight)
        return weight, local.to(weight.device)

    def store_keys(self, input: Any) -> list[tuple[TieredStore, torch.Tensor]]:
        """``[(store, the distinct keys forward(input) looks up there)]``, for a lookahead pipeline
        (``tierstore.prefetch``); bad input raises as ``forward`` would."""
        refuse_prefetch(self.sharding)
        ids = check_lookup_ids(input, self.num_embeddings).reshape(-1)
        if self.padding_idx is not None and self.padding_left_out:
            ids = ids[ids != self.padding_idx]
        return [(self.store, distinct_ids(ids))]

    def warm_keys(self, warm: Any) -> list[tuple[TieredStore, torch.Tensor]]:
        """``[(store, the ranked ids of warm)]`` (a ``.npy`` path or ids), for ``prefetch(warm=)``."""
        return self.store.warm_keys(warm)

    def _gradient_kernels(self, weight: torch.Tensor):
        """The top tier's kernels, where they run on ``weight``'s device, to sum ``weight``'s gradient
        (``pooled_lookup``: float32, as 16-bit rows are widened); None (torch's own backward) for a
        torch tier, when not training, for wider rows, or when the gradient is scaled by frequency
        (torch's backward does that)."""
        if not weight.requires_grad or weight.dtype != torch.float32 or self.scale_grad_by_freq:
            return None
        return self.store.gradient_kernels(weight.device)

    def _rows_without_growing(self, unique: torch.Tensor) -> torch.Tensor:
        """Eval / ``no_grad`` rows of ``unique``: ids the table has never seen do not join it and
        get what ``missing`` says."""
        rows = self.store.get(unique, grow=False)
        if self.missing == "init" or unique.numel() == 0:
            return rows
        return self._missing_rows(unique, rows, self.store.contains(unique))

    def _missing_rows(self, unique: torch.Tensor, rows: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
        """``rows [U, dim]`` of ``unique`` with the ones the table does not hold (``known`` false)
        as ``missing`` says: initial rows kept, zeroed, or a ``KeyError``."""
        if self.missing == "init" or unique.numel() == 0:
            return rows
        known = known.to(rows.device)
        if self.missing == "error" and not bool(known.all()):
            absent = unique[~known.cpu()]
            raise KeyError(
                f"input holds {absent.numel()} id(s) the table has never seen (first: {int(absent[0])}) "
                f"and missing='error'; use missing='init' or 'zero' to look them up anyway"
            )
        rows[~known] = 0
        return rows

    def _apply_gradient(self, unique: torch.Tensor, slots: torch.Tensor, grad: torch.Tensor) -> None:
        """Fused optimizer step on the rows of ``unique`` (int64 [U]), found at ``slots`` of the top
        tier by the forward (sharded: the forward's exchange), with ``grad [U, dim]``; the padding
        row is left as it is (sharded: its gradient is zero, as torch's)."""
        if self.padding_idx is not None and not self.padding_left_out:  # bags never look it up
            padding = unique == self.padding_idx
            if bool(padding.any()):
                if self.sharding is None:
                    kept = ~padding
                    unique, slots, grad = (
                        unique[kept],
                        slots[kept.to(slots.device)],
                        grad[kept.to(grad.device)],
                    )
                else:
                    grad = grad.masked_fill(padding.to(grad.device).unsqueeze(1), 0)
        if self.sharding is not None:  # every rank takes part, whatever its batch held
            self.sharding.apply_gradients(self.store, slots, grad, self.optimizer, self.next_step())
            return
        if unique.numel() == 0:
            return
        self.store.apply_gradients(unique, grad, self.optimizer, self.next_step(), slots)

    def next_step(self) -> int:
        """The update count, raised by one for an update and returned (a plain int, set past
        ``nn.Module.__setattr__``'s checks for parameters, buffers and modules)."""
        step = self.__dict__["step"] = self.step + 1
        return step

    def fused_optimizer(self) -> FusedOptimizer:
        """The table's fused optimizer as a ``torch.optim.Optimizer`` (``FusedOptimizer``): a learning
        rate set in it, or by a ``torch.optim.lr_scheduler``, is the one the next update uses. The
        same object at every call."""
        return fused_optimizer_of(self, [self])

    # -- loading weights -----------------------------------------------------------------------

    def load_weights(self, ids: Any, weights: Any) -> None:
        """Set the rows of ``ids`` (int64 [N], any number) to ``weights [N, embedding_dim]`` (their
        optimizer state is kept; zero for new ids), written straight to the cold store and durable
        on return (``TieredStore.load``): the tiered form of ``emb.weight.data[ids] = weights``."""
        if self.num_embeddings is not None:
            check_lookup_ids(as_ids(ids, "ids"), self.num_embeddings, "ids")
        self.store.load(ids, weights)

    @classmethod
    def _pretrained(cls, embeddings: Any, freeze: bool, **settings) -> _TieredTable:
        """A table of ``embeddings [num_embeddings, embedding_dim]`` (ids 0..num_embeddings-1)."""
        if not isinstance(embeddings, torch.Tensor) or embeddings.dim() != 2:
            raise ValueError(
                "embeddings must be a 2-D tensor [num_embeddings, embedding_dim], got "
                f"{getattr(embeddings, 'shape', type(embeddings).__name__)}"
            )
        integers = None
        if not (embeddings.is_floating_point() or embeddings.is_complex()):
            integers, embeddings = embeddings.dtype, as_float_bits(embeddings.detach(), cls, freeze)
        settings.setdefault("dtype", embeddings.dtype)
        rows = as_rows(  # checked before the table is created: bad weights leave nothing behind
            embeddings.detach(),
            embeddings.shape[0],
            (embeddings.shape[1],),
            settings["dtype"],
            "embeddings",
            allow_nonfinite=integers is not None,
        )
        table = cls(embeddings.shape[0], embeddings.shape[1], **settings)
        try:
            table.store.load(torch.arange(embeddings.shape[0]), rows, allow_nonfinite=integers is not None)
        except BaseException:
            table.close()
            raise
        table.integers = integers
        table.requires_grad_(not freeze)
        return table

    # -- store life cycle and state ------------------------------------------------------------------

    @property
    def frozen(self) -> bool:
        """Lookups only, the rows never change: ``requires_grad_(False)`` on the table or its model."""
        return not self._parameters["trainable"].requires_grad  # (not through Module.__getattr__: each step)

    def extra_repr(self) -> str:
        bound = "unbounded" if self.num_embeddings is None else self.num_embeddings
        return (
            f"{bound}, {self.embedding_dim}, optimizer={self.optimizer}, store={str(self.store.path)!r}, "
            f"backend={self.store.metadata.backend!r}"
        )


def normalise_padding_idx(padding_idx: int | None, num_embeddings: int | None) -> int | None:
    if padding_idx is None:
        return None
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
        raise TypeError(f"padding_idx must be an int or None, got {padding_idx!r}")
    if num_embeddings is None:
        if padding_idx < 0:
            raise PaddingIdxError(
                f"padding_idx must be non-negative for an unbounded table, got {padding_idx}"
            )
        return padding_idx
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise PaddingIdxError(
            f"padding_idx must be within num_embeddings ({num_embeddings}), got {padding_idx}"
        )
    return padding_idx % num_embeddings


_BITS_OF = {2: torch.float16, 4: torch.float32, 8: torch.float64}  # integer width -> float of that width


def as_float_bits(embeddings: torch.Tensor, cls: type, freeze: bool) -> torch.Tensor:
    """Integer ``embeddings`` (``TieredEmbedding.from_pretrained``: a frozen lookup of integers) as
    floats of the same width holding their bits (8-bit integers widened to 16 first)."""
    if not cls.looks_up_integers or not freeze:
        raise TypeError(
            f"embeddings of {embeddings.dtype} cannot train (only floating-point weights can require "
            "gradients, as torch says): an integer table is a frozen lookup, "
            "TieredEmbedding.from_pretrained(weights, freeze=True)"
        )
    if embeddings.dtype == torch.bool:
        raise TypeError("embeddings must be numbers, not bool")
    if embeddings.element_size() == 1:
        embeddings = embeddings.to(torch.int16)
    return embeddings.contiguous().view(_BITS_OF[embeddings.element_size()])


def from_float_bits(rows: torch.Tensor, integers: torch.dtype) -> torch.Tensor:
    """``rows`` read from a table of integers (``as_float_bits``) as those integers."""
    wide = torch.int16 if integers.itemsize == 1 else integers
    return rows.view(wide).to(integers)
