"""Drop-in ``nn.EmbeddingBag`` / ``nn.Embedding`` replacements backed by a ``TieredStore``.

A training forward of bags on a float32 host top tier runs as native passes (``native_step``):
distinct ids by hashing, the rows made resident, the bags pooled straight from the host tier,
and in backward each row's gradient summed and the fused optimizer applied in place. Every other
forward gathers the batch's distinct ids from the store into a small local weight
``[U (+1 padding row), dim]`` and runs torch's own ``F.embedding_bag`` / ``F.embedding`` on it, so
outputs (and gradients w.r.t. ``per_sample_weights``) are torch's. In training, a hook on that
local weight receives its gradient — already reduced to one row per distinct id — during
``backward`` and applies the fused optimizer to those rows and their state in the top cache
tier. The modules hold no weight among their parameters: their one parameter, ``trainable``
(zero elements), is the switch torch's freezing idioms set; ``optimizer.step()`` of a dense
optimizer does not touch the embeddings.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..checkpoint import CheckpointWriting
from ..errors import PaddingIdxError
from ..kernels.step_passes import distinct_ids
from ..optim import SGD, SparseOptimizer
from ..store import TieredStore
from ..tiers.config import TierConfig
from ..validation import (
    as_ids,
    as_path,
    as_rows,
    check_bag_input,
    check_lookup_ids,
    check_table_shape,
    integral,
)
from . import native_step, pooled_lookup
from .fused_optimizer import FusedOptimizer, fused_optimizer_of, without_fused_optimizer
from .sharding import RowSharding, refuse_prefetch, replicated_keys
from .table_checkpoints import restore_checkpoint, write_checkpoint
from .table_rows import TableRows

_MISSING = ("init", "zero", "error")


def opaque_to_tracers(method):
    """``forward`` of a tiered module, opaque to graph capture, as the store boundary must be:
    under torch.compile it runs eagerly (a graph break: the dense layers around it compile, and the
    update hook runs in backward as in eager mode); under torch.fx tracing (``symbolic_trace``,
    TorchRec's tracer) its call is one leaf of the graph, so the rest of the model traces."""
    compiled = _opaque_to_compiler(method)

    proxy = torch.fx.Proxy

    @functools.wraps(method)
    def call(module, *args, **kwargs):
        for value in args if not kwargs else (*args, *kwargs.values()):  # a plain loop: each step
            if isinstance(value, proxy):  # an fx tracer's: the call is one node of its graph
                tracer = value.tracer
                return tracer.create_proxy("call_module", tracer.path_of_module(module), args, kwargs)
        return compiled(module, *args, **kwargs)

    return call


def _opaque_to_compiler(method):
    """``method`` run eagerly under torch.compile (``torch.compiler.disable``). That imports
    torch._dynamo (about 70 MiB of memory): it is applied once a compiler is loaded, so a process
    that never compiles never loads it."""
    reason = "a tiered table reads its rows from a store outside the graph"
    if "torch._dynamo" in sys.modules:
        return torch.compiler.disable(method, recursive=True, reason=reason)
    disabled = None

    @functools.wraps(method)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:  # no compiler loaded: nothing is tracing this call
                return method(*args, **kwargs)
            disabled = torch.compiler.disable(method, recursive=True, reason=reason)
        return disabled(*args, **kwargs)

    return call


_STATE_FORMAT = "tierstore-table/1"


class _TieredTable(nn.Module):
    """What both modules share: the store, the optimizer, local weights and the update hook."""

    padding_left_out = True  # padding entries are left out of the lookup (bags), or read their row
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
        self.padding_idx = _normalise_padding_idx(padding_idx, num_embeddings)
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
        (``pooled_lookup``); None (torch's own backward) for a torch tier, when not training, or
        when the gradient is scaled by frequency (torch's backward does that)."""
        if not weight.requires_grad or weight.dtype != self.store.dtype or self.scale_grad_by_freq:
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

    def __getstate__(self) -> dict:
        return without_fused_optimizer(super().__getstate__())

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
            integers, embeddings = embeddings.dtype, _as_float_bits(embeddings.detach(), cls, freeze)
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

    def flush(self) -> None:
        """Make every update so far durable in the store (atomic; see ``TieredStore.flush``).
        Sharded, every rank must call it: each commits its store, then learns whether all did."""
        if self.sharding is None:
            self.store.flush()
        else:
            self.sharding.flush(self.store, self.step)

    def checkpoint(self, path: str | Path, background: bool = False) -> CheckpointWriting:
        """Write every row, its optimizer state and the step count as of now (a flush) to the new
        directory ``path``: training may go on while a ``background`` one is written (``wait()`` on
        the returned handle gives its path). Sharded, every rank calls it (each writes its own part).
        ``restore(path)`` brings the table back to that moment; see ``tierstore.checkpoint``."""
        return write_checkpoint(path, {None: self}, self.sharding, background)

    def restore(self, path: str | Path) -> None:
        """Give the table exactly the rows, optimizer state and step count of the checkpoint at
        ``path``: rows added since are removed, updates since are undone (the store's rows are
        replaced in one step: a crash leaves the old ones or the restored ones)."""
        restore_checkpoint(path, {None: self}, self.sharding)

    def close(self) -> None:
        """Flush and close the store (a temporary store is deleted); sharded, on every rank."""
        if self.sharding is None:
            self.store.close()
        elif not self.store.closed:
            self.flush()
            self.sharding.together("close", self.store.close)

    def _checked(self, check, *args):
        """``check(*args)``; sharded, a refusal is first told to the other ranks (they raise too)."""
        try:
            return check(*args)
        except Exception as error:
            if self.sharding is None:
                raise
            self.sharding.refuse(error)

    def __setstate__(self, state: dict) -> None:
        frozen = state.pop("frozen", False)  # pickled before ``trainable``, frozen was a flag
        super().__setstate__(state)
        if "trainable" not in self._parameters:
            self.trainable = nn.Parameter(torch.empty(0, device=self._output_like.device), not frozen)

    @property
    def frozen(self) -> bool:
        """Lookups only, the rows never change: ``requires_grad_(False)`` on the table or its model."""
        return not self._parameters["trainable"].requires_grad  # (not through Module.__getattr__: each step)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)  # its extra state flushes
        del destination[prefix + "trainable"]  # a switch, not a weight: state_dicts hold no tensor of it
        if not self.store.read_only:
            destination[prefix + self._rows_key()] = TableRows(self.store, self.store.snapshot())

    def _rows_key(self) -> str:
        """The state dict's key of the table's rows (``TableRows``); a sharded table's rank has its own."""
        if self.sharding is None:
            return "rows"
        return f"rows.rank{self.sharding.rank}-of-{self.sharding.world_size}"

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        extra = state_dict.get(prefix + "_extra_state")
        rows = state_dict.get(prefix + self._rows_key())
        try:
            if extra is not None:
                self._check_extra_state(extra)  # before the rows change
            batches = rows.rows_for(self.store) if isinstance(rows, TableRows) else None
        except BaseException:
            if isinstance(rows, TableRows):
                rows.discard_received()
            raise
        if batches is not None:
            self.store.replace_rows(batches)
        self._rows_given = batches is not None  # (read by set_extra_state)
        try:
            super()._load_from_state_dict(
                state_dict, prefix, local_metadata, strict, missing, unexpected, errors
            )
        finally:
            self._rows_given = False
        for key in (prefix + "trainable", prefix + self._rows_key()):
            for keys in (missing, unexpected):
                if key in keys:
                    keys.remove(key)

    def get_extra_state(self) -> dict:
        """The table's ``_extra_state`` in ``state_dict()``: the store's location and layout, the
        optimizer and its step count. Its rows as of the call are the ``rows`` entry (``TableRows``:
        a snapshot, read by ``torch.distributed.checkpoint`` or ``load_state_dict``). A state dict
        without it (pickled: ``torch.save(model.state_dict())``) names the store: reloaded into a
        module on the same store it resumes it; on another store it copies the rows over as they
        are now, streaming. A temporary store is deleted on ``close()``: give ``path=`` to keep one."""
        if not self.store.read_only:
            self.flush()
        return {
            "format": _STATE_FORMAT,
            "path": str(self.store.path.resolve()),
            "dim": self.embedding_dim,
            "dtype": str(self.store.dtype),
            "optimizer": self.optimizer.name,
            "optimizer_state_width": self.store.metadata.optimizer_state_width,
            "step": self.step,
        }

    def _check_extra_state(self, state: Any) -> dict:
        """This table's own extra state, once ``state`` is found to describe a table like it."""
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise ValueError(f"not a tierstore table state (expected format {_STATE_FORMAT!r}): {state!r}")
        mine = self.get_extra_state()
        for key in ("dim", "dtype", "optimizer", "optimizer_state_width"):
            if state[key] != mine[key]:
                raise ValueError(f"state_dict {key} is {state[key]!r} but this module's is {mine[key]!r}")
        return mine

    def set_extra_state(self, state: Any) -> None:
        mine = self._check_extra_state(state)
        if self.__dict__.get("_rows_given"):  # the state dict's rows replaced the table's
            pass
        elif Path(state["path"]) != Path(mine["path"]):  # a copy of the rows, as they are
            source = TieredStore.open_here(state["path"])
            if source is not None:
                self.store.copy_rows_from(source)
            else:
                with TieredStore(state["path"], read_only=True, host_cache=1) as source:
                    self.store.copy_rows_from(source)
        self.step = int(state["step"])

    def extra_repr(self) -> str:
        bound = "unbounded" if self.num_embeddings is None else self.num_embeddings
        return (
            f"{bound}, {self.embedding_dim}, optimizer={self.optimizer}, store={str(self.store.path)!r}, "
            f"backend={self.store.metadata.backend!r}"
        )


class TieredEmbeddingBag(_TieredTable):
    """``nn.EmbeddingBag`` whose table lives in a ``TieredStore`` and grows on demand.

    Args (as ``nn.EmbeddingBag``): ``num_embeddings`` (``None``: any non-negative int64 id; an
    int bounds ids), ``embedding_dim``, ``mode`` ("sum", "mean", "max"), ``padding_idx``,
    ``include_last_offset``, ``dtype``, ``device`` (the device cache's and the outputs' device);
    sizes may be numpy integers or 0-d tensors; ``scale_grad_by_freq`` (torch's dense form, on
    the torch path rather than the native step). ``max_norm`` is not supported; ``sparse`` is
    accepted and ignored (updates are always sparse). Store args:
    ``path`` (``None``: a temporary store, deleted when closed or collected), ``backend`` (the
    cold store: "mmap", the default, or "lmdb"; see ``TieredStore``), ``seed``; the cache tiers'
    settings as ``tiers=TierConfig(...)`` or its fields as keywords (``host_cache``,
    ``device_cache``, ``host_cache_backend``, ``device_cache_backend``, ``half_life``, ``policy``);
    ``warm`` (hot ids preloaded into the caches at open, as ``TieredStore`` takes them);
    ``process_group`` (a ``torch.distributed`` group: the rows are sharded over its ranks, each in
    its own store under ``path``, and every rank feeds its own batch; see ``nn.sharding``);
    ``replicate`` (with a group: keys held by every rank, their gradients all-reduced: ids or a
    ``.npy`` of them, an int N for the N first of ``warm``, or "auto" to let
    ``nn.replication.plan_replication`` choose from ``access_sample``, this rank's first batches);
    ``optimizer`` (default ``optim.SGD(lr=0.01)``), applied during ``backward``; ``missing``:
    what eval / ``no_grad`` lookups of ids the table has never seen give — "init" (their
    initial row), "zero" or "error" (``KeyError``); they never join the table then.

    As a module: pickling and ``torch.save`` flush the store and record where it is (a temporary
    store is refused); loading reopens it. ``copy.deepcopy`` is an independent table in a new
    temporary store holding the rows as of now. ``torch.compile`` compiles around it (its
    forward is a graph break); ``torch.jit.trace``/``script`` refuse. ``.double()``/``.half()``
    cast the outputs; the rows keep the store's dtype.

    ``forward(input, offsets=None, per_sample_weights=None)`` -> ``[B, embedding_dim]`` as torch.
    """

    def __init__(
        self,
        num_embeddings: int | None,
        embedding_dim: int,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = False,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        *,
        path: str | Path | None = None,
        backend: str | None = None,
        seed: int = 0,
        optimizer: SparseOptimizer | None = None,
        missing: str = "init",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        tiers: TierConfig | None = None,
        process_group: Any = None,
        replicate: Any = None,
        access_sample: Any = None,
        **tier_settings,
    ) -> None:
        _refuse_unsupported(max_norm, scale_grad_by_freq, mode)
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
        super().__init__(
            num_embeddings,
            embedding_dim,
            padding_idx,
            path,
            backend,
            seed,
            optimizer,
            missing,
            dtype,
            device,
            tiers,
            tier_settings,
            process_group,
            replicate,
            access_sample,
        )
        self.mode = mode
        self.include_last_offset = include_last_offset
        self.scale_grad_by_freq = bool(scale_grad_by_freq)

    @classmethod
    def from_pretrained(
        cls,
        embeddings: torch.Tensor,
        freeze: bool = True,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = False,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        **settings,
    ) -> TieredEmbeddingBag:
        """As ``nn.EmbeddingBag.from_pretrained``: a table holding ``embeddings [N, dim]`` as the
        rows of ids ``0..N-1``, written straight to its cold store (any size; see
        ``load_weights``). ``freeze=True``: the rows are looked up, never trained. ``settings``:
        the constructor's keywords (``path``, ``backend``, ``host_cache``, ``optimizer``...)."""
        return cls._pretrained(
            embeddings,
            freeze,
            max_norm=max_norm,
            norm_type=norm_type,
            scale_grad_by_freq=scale_grad_by_freq,
            mode=mode,
            sparse=sparse,
            include_last_offset=include_last_offset,
            padding_idx=padding_idx,
            **settings,
        )

    def _native_passes(self, per_sample_weights: torch.Tensor | None):
        """The native step passes (``native_step``) where a training forward can take them: a float32
        host top tier with the tuned host build, float32 CPU outputs, mode "sum" or "mean", no
        gradient for ``per_sample_weights``, not sharded; else None."""
        training = self.training and torch.is_grad_enabled() and not self.frozen
        output_like = self._buffers["_output_like"]  # (not through Module.__getattr__: each step)
        if (
            not training
            or self.scale_grad_by_freq
            or self.sharding is not None
            or self.mode not in ("sum", "mean")
            or output_like.dtype != torch.float32
            or not output_like.is_cpu
            or (per_sample_weights is not None and per_sample_weights.requires_grad)
        ):
            return None
        return native_step.step_passes(self.store)

    @opaque_to_tracers
    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self._refuse_tracing()
        input, offsets, per_sample_weights = self._checked(
            check_bag_input,
            input,
            offsets,
            per_sample_weights,
            self.mode,
            self.num_embeddings,
            self.output_dtype,
            self.include_last_offset,
        )
        return self.lookup_bags(input, offsets, per_sample_weights)

    def lookup_bags(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None,
        per_sample_weights: torch.Tensor | None,
        shape: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """``forward`` on arguments already checked (ids int64 CPU, offsets int64 CPU or None): the
        entry of a collection, which checks its whole batch first. ``shape``: the ``[bags, dim]``
        output as ``[bags / k, k x dim]`` (k bags side by side a row; made so by the native passes,
        which saves the autograd graph a view)."""
        passes = self._native_passes(per_sample_weights)
        if passes is not None:
            return native_step.embedding_bag(self, passes, input, offsets, per_sample_weights, shape)
        weight, local = self._local_weight(input)
        if offsets is not None:
            offsets = offsets.to(weight.device)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.to(weight.device, weight.dtype)
        pooled = pooled_lookup.embedding_bag(
            local,
            weight,
            offsets,
            self.mode,
            per_sample_weights,
            self.include_last_offset,
            self._gradient_kernels(weight),
            self.scale_grad_by_freq,
        )
        pooled = pooled.to(self.output_dtype)
        return pooled if shape is None else pooled.view(shape)


class TieredEmbedding(_TieredTable):
    """``nn.Embedding`` whose table lives in a ``TieredStore`` and grows on demand.

    Arguments as ``TieredEmbeddingBag`` (no ``mode``, ``include_last_offset``).
    ``forward(input)``: int ids of any shape -> ``[*input.shape, embedding_dim]``; ``padding_idx``
    reads its row as stored (zero as the table starts) and never updates it, as ``nn.Embedding``.
    """

    padding_left_out = False

    def __init__(
        self,
        num_embeddings: int | None,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        *,
        path: str | Path | None = None,
        backend: str | None = None,
        seed: int = 0,
        optimizer: SparseOptimizer | None = None,
        missing: str = "init",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        tiers: TierConfig | None = None,
        process_group: Any = None,
        replicate: Any = None,
        access_sample: Any = None,
        **tier_settings,
    ) -> None:
        _refuse_unsupported(max_norm, scale_grad_by_freq)
        super().__init__(
            num_embeddings,
            embedding_dim,
            padding_idx,
            path,
            backend,
            seed,
            optimizer,
            missing,
            dtype,
            device,
            tiers,
            tier_settings,
            process_group,
            replicate,
            access_sample,
        )
        self.scale_grad_by_freq = bool(scale_grad_by_freq)

    @classmethod
    def from_pretrained(
        cls,
        embeddings: torch.Tensor,
        freeze: bool = True,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        **settings,
    ) -> TieredEmbedding:
        """As ``nn.Embedding.from_pretrained``; see ``TieredEmbeddingBag.from_pretrained``."""
        return cls._pretrained(
            embeddings,
            freeze,
            padding_idx=padding_idx,
            max_norm=max_norm,
            norm_type=norm_type,
            scale_grad_by_freq=scale_grad_by_freq,
            sparse=sparse,
            **settings,
        )

    @opaque_to_tracers
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._refuse_tracing()
        input = self._checked(check_lookup_ids, input, self.num_embeddings, "input")
        weight, local = self._local_weight(input)
        if self.integers is not None:  # a frozen lookup of integers, stored as their bits
            return _from_float_bits(F.embedding(local.rows, weight), self.integers)
        kernels = self._gradient_kernels(weight)
        return pooled_lookup.embedding(local, weight, kernels, self.scale_grad_by_freq).to(self.output_dtype)


def _refuse_unsupported(max_norm: float | None, scale_grad_by_freq: bool, mode: str = "sum") -> None:
    if max_norm is not None:
        raise NotImplementedError(
            "max_norm is not supported by tiered tables (it rewrites rows during forward)"
        )
    if scale_grad_by_freq and mode == "max":
        raise ValueError("max mode does not support scaling the gradient by the frequency (as torch)")


def _normalise_padding_idx(padding_idx: int | None, num_embeddings: int | None) -> int | None:
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


def _as_float_bits(embeddings: torch.Tensor, cls: type, freeze: bool) -> torch.Tensor:
    """Integer ``embeddings`` (``TieredEmbedding.from_pretrained``: a frozen lookup of integers) as
    floats of the same width holding their bits (8-bit integers widened to 16 first)."""
    if cls is not TieredEmbedding or not freeze:
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


def _from_float_bits(rows: torch.Tensor, integers: torch.dtype) -> torch.Tensor:
    """``rows`` read from a table of integers (``_as_float_bits``) as those integers."""
    wide = torch.int16 if integers.itemsize == 1 else integers
    return rows.view(wide).to(integers)
