"""Pooled lookups over a batch's distinct rows whose weight gradient a kernel sums per row.

torch's dense ``embedding_bag`` backward scatters every entry's gradient into the weight
gradient, which dominated a training step's backward on the CPU. Here the entries are sorted by
the row they read (``LocalIds``: the sort that finds a batch's distinct ids gives that order too),
and the ``bag_weight_gradient`` kernel (``tierstore/kernels``)
sums each row's entries in one thread, without atomics: on the GPU, or on the CPU through the
kernels' OpenMP build. Forward is
torch's own. Modes "sum" and "mean" (with ``padding_idx`` and ``per_sample_weights`` that need no
gradient); for the others ``embedding_bag`` below uses torch's autograd, the reference this one
is tested against.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class LocalIds:
    """A batch's ids as rows of a local weight: ``rows`` (int64, any shape: each entry's row),
    ``padding_row`` (the row padding entries read, or None) and the entries sorted by row:
    ``order [M]`` (flat positions of the non-padding entries, by row, then position) and
    ``starts [row count + 1]`` (row r's entries are ``order[starts[r]:starts[r + 1]]``)."""

    rows: torch.Tensor
    padding_row: int | None
    order: torch.Tensor
    starts: torch.Tensor

    @classmethod
    def of(cls, rows: torch.Tensor, padding_row: int | None, row_count: int) -> LocalIds:
        """Sorts the entries of ``rows`` (int64, each below ``row_count``) by row."""
        flat = rows.reshape(-1)
        kept = torch.arange(flat.numel(), device=flat.device)
        if padding_row is not None:
            kept = kept[flat != padding_row]
        order = kept[torch.argsort(flat[kept], stable=True)]
        starts = torch.zeros(row_count + 1, dtype=torch.int64, device=flat.device)
        torch.cumsum(torch.bincount(flat[kept], minlength=row_count), 0, out=starts[1:])
        return cls(rows, padding_row, order, starts)

    def to(self, device: torch.device) -> LocalIds:
        return LocalIds(self.rows.to(device), self.padding_row, self.order.to(device), self.starts.to(device))


def distinct(ids: torch.Tensor, padding: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, LocalIds]:
    """``(unique [U] ascending, counts [U], LocalIds)`` of ``ids`` (int64, any shape) leaving out
    the entries where ``padding`` (bool, ``ids.numel()``, or None) holds; those read row U. One
    stable sort gives all three (``torch.unique`` and an ``argsort`` would sort twice)."""
    flat = ids.reshape(-1)
    kept = None if padding is None else (~padding).nonzero().squeeze(1)
    looked_up = flat if kept is None else flat[kept]
    sorted_ids, order = torch.sort(looked_up, stable=True)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)  # each distinct id's first entry
    torch.ne(sorted_ids[1:], sorted_ids[:-1], out=first[1:])
    unique = sorted_ids[first]
    starts = torch.cat([first.nonzero().squeeze(1), first.new_full((1,), first.numel(), dtype=torch.int64)])
    counts = starts.diff()
    inverse = torch.empty_like(order).index_copy_(0, order, torch.cumsum(first, 0) - 1)
    if kept is None:
        return unique, counts, LocalIds(inverse.view(ids.shape), None, order, starts)
    rows = torch.full_like(flat, unique.numel()).index_copy_(0, kept, inverse)
    starts = torch.cat([starts, starts[-1:]])  # the padding row: no entries (its gradient is unused)
    return unique, counts, LocalIds(rows.view(ids.shape), unique.numel(), kept[order], starts)


def embedding_bag(
    local: LocalIds,
    weight: torch.Tensor,
    offsets: torch.Tensor | None,
    mode: str,
    per_sample_weights: torch.Tensor | None,
    include_last_offset: bool,
    kernels,
    scale_grad_by_freq: bool = False,
) -> torch.Tensor:
    """``F.embedding_bag`` on ``local.rows`` (``padding_idx`` being ``local.padding_row``, other
    arguments and output the same); ``kernels`` (a ``CudaKernels`` or ``HostKernels`` on
    ``weight``'s device, or None) computes ``weight``'s gradient where it can (not where it is
    scaled by frequency: ``local.rows`` number the distinct ids, so torch's counts are the batch's)."""
    fused = (
        kernels is not None
        and not scale_grad_by_freq
        and mode in ("sum", "mean")
        and weight.dtype == torch.float32
        and (per_sample_weights is None or not per_sample_weights.requires_grad)
    )
    if not fused:
        return F.embedding_bag(
            local.rows,
            weight,
            offsets,
            mode=mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=include_last_offset,
            padding_idx=local.padding_row,
            scale_grad_by_freq=scale_grad_by_freq,
        )
    return _KernelGradientBag.apply(
        weight, local, offsets, mode, per_sample_weights, include_last_offset, kernels
    )


def embedding(
    local: LocalIds, weight: torch.Tensor, kernels, scale_grad_by_freq: bool = False
) -> torch.Tensor:
    """``F.embedding`` on ``local.rows`` (any shape): bags of one entry each, so the same backward."""
    if kernels is None or weight.dtype != torch.float32 or scale_grad_by_freq:
        return F.embedding(
            local.rows, weight, padding_idx=local.padding_row, scale_grad_by_freq=scale_grad_by_freq
        )
    shape = local.rows.shape
    flat = dataclasses.replace(local, rows=local.rows.reshape(-1))
    offsets = torch.arange(flat.rows.numel(), device=flat.rows.device)
    rows = embedding_bag(flat, weight, offsets, "sum", None, False, kernels)
    return rows.reshape(*shape, weight.shape[1])


class _KernelGradientBag(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, local, offsets, mode, per_sample_weights, include_last_offset, kernels):
        output = F.embedding_bag(
            local.rows,
            weight,
            offsets,
            mode=mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=include_last_offset,
            padding_idx=local.padding_row,
        )
        ctx.save_for_backward(local.rows, local.order, local.starts, offsets, per_sample_weights)
        ctx.settings = (weight.shape, mode, include_last_offset, local.padding_row, kernels)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        local, order, starts, offsets, per_sample_weights = ctx.saved_tensors
        (rows, dim), mode, include_last_offset, padding_idx, kernels = ctx.settings
        bag, scale = _entry_bags_and_scales(
            local, offsets, mode, per_sample_weights, include_last_offset, padding_idx, grad_output.shape[0]
        )
        # each entry's bag and scale in row order, so the kernel reads them in sequence
        bag, scale = bag.index_select(0, order), scale.index_select(0, order)
        order = torch.arange(order.numel(), device=order.device)
        grad_weight = torch.empty(rows, dim, dtype=torch.float32, device=grad_output.device)
        grad_rows, grad_stride = rows_in_place(grad_output)
        kernels.launch(
            "bag_weight_gradient",
            rows * dim,
            grad_rows,
            order,
            starts,
            bag,
            scale,
            rows,
            dim,
            grad_stride,
            grad_weight,
        )
        return grad_weight, None, None, None, None, None, None


def rows_in_place(grad: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(a contiguous 1-D view over the rows of grad [bags, dim], elements from one row to the
    next)``: a gradient whose rows are packed but spaced out (a slice of a wider output, as a
    model's ``torch.cat`` of features gives) is read in place; any other layout is copied."""
    bags, dim = grad.shape
    if bags == 0 or grad.stride(1) != 1 or grad.stride(0) < dim:
        grad = grad.contiguous()
    span = (bags - 1) * grad.stride(0) + dim if bags else 0
    return grad.as_strided((span,), (1,)), grad.stride(0) if bags else dim


def _entry_bags_and_scales(
    local: torch.Tensor,
    offsets: torch.Tensor | None,
    mode: str,
    per_sample_weights: torch.Tensor | None,
    include_last_offset: bool,
    padding_idx: int | None,
    bags: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bag of each entry int64 [N], its gradient scale float32 [N])``: 0 for padding entries and
    entries in no bag, else the per-sample weight, 1 / (the bag's non-padding entries) for "mean", or 1."""
    device = local.device
    entries = local.numel()
    if local.dim() == 2:
        bag = torch.arange(bags, device=device).repeat_interleave(local.shape[1])
        in_bag = torch.ones(entries, dtype=torch.bool, device=device)
    else:
        starts = offsets[:bags]
        ends = (
            torch.cat([offsets[1 : bags + 1], offsets.new_full((1,), entries)])[:bags]
            if bags
            else offsets[:0]
        )
        lengths = ends - starts
        bag = torch.repeat_interleave(torch.arange(bags, device=device), lengths)  # offsets[0] is 0
        covered = bag.numel()
        bag = torch.cat([bag, bag.new_zeros(entries - covered)])  # past the last offset: in no bag
        in_bag = torch.arange(entries, device=device) < covered
    flat = local.reshape(-1)
    if padding_idx is not None:
        in_bag &= flat != padding_idx
    if per_sample_weights is not None:
        scale = per_sample_weights.reshape(-1).to(torch.float32)
    elif mode == "mean":
        counted = torch.bincount(bag[in_bag], minlength=bags).clamp(min=1)
        scale = 1.0 / counted.to(torch.float32)[bag]
    else:
        scale = torch.ones(entries, dtype=torch.float32, device=device)
    return bag, torch.where(in_bag, scale, 0.0).contiguous()
