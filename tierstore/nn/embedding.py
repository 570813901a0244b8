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

from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from ..optim import SparseOptimizer
from ..tiers.config import TierConfig
from ..validation import check_bag_input, check_lookup_ids
from . import native_step, pooled_lookup
from .tiered_table import _TieredTable, from_float_bits
from .tracing import opaque_to_tracers


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
        """The native step passes (``native_step``) where a training forward can take them: a host
        top tier with the tuned host build, CPU outputs of the rows' dtype, mode "sum" or "mean", no
        gradient for ``per_sample_weights``, not sharded; else None."""
        training = self.training and torch.is_grad_enabled() and not self.frozen
        output_like = self._buffers["_output_like"]  # (not through Module.__getattr__: each step)
        if (
            not training
            or self.scale_grad_by_freq
            or self.sharding is not None
            or self.mode not in ("sum", "mean")
            or output_like.dtype != self.store.dtype
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

    looks_up_integers = True
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
            return from_float_bits(F.embedding(local.rows, weight), self.integers)
        kernels = self._gradient_kernels(weight)
        return pooled_lookup.embedding(local, weight, kernels, self.scale_grad_by_freq).to(self.output_dtype)


def _refuse_unsupported(max_norm: float | None, scale_grad_by_freq: bool, mode: str = "sum") -> None:
    if max_norm is not None:
        raise NotImplementedError(
            "max_norm is not supported by tiered tables (it rewrites rows during forward)"
        )
    if scale_grad_by_freq and mode == "max":
        raise ValueError("max mode does not support scaling the gradient by the frequency (as torch)")
