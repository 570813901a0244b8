"""Pooled lookups over a batch's distinct rows whose weight gradient a kernel sums per row.

torch's dense ``embedding_bag`` backward scatters every entry's gradient into the weight
gradient, which dominated a training step's backward on the CPU. Here the entries are sorted by
the row they read (``argsort``), and the ``bag_weight_gradient`` kernel (``tierstore/kernels``)
sums each row's entries in one thread, without atomics: on the GPU, or on the CPU through the
kernels' OpenMP build. Forward is
torch's own. Modes "sum" and "mean" (with ``padding_idx`` and ``per_sample_weights`` that need no
gradient); for the others ``embedding_bag`` below uses torch's autograd, the reference this one
is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def embedding_bag(
    local: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor | None,
    mode: str,
    per_sample_weights: torch.Tensor | None,
    include_last_offset: bool,
    padding_idx: int | None,
    kernels,
) -> torch.Tensor:
    """``F.embedding_bag`` (same arguments and output); ``kernels`` (a ``CudaKernels`` or
    ``HostKernels`` on ``weight``'s device, or None) computes ``weight``'s gradient where it can."""
    fused = (
        kernels is not None
        and mode in ("sum", "mean")
        and weight.dtype == torch.float32
        and (per_sample_weights is None or not per_sample_weights.requires_grad)
    )
    if not fused:
        return F.embedding_bag(
            local,
            weight,
            offsets,
            mode=mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=include_last_offset,
            padding_idx=padding_idx,
        )
    return _KernelGradientBag.apply(
        weight, local, offsets, mode, per_sample_weights, include_last_offset, padding_idx, kernels
    )


def embedding(local: torch.Tensor, weight: torch.Tensor, padding_idx: int | None, kernels) -> torch.Tensor:
    """``F.embedding`` (any shape of ``local``): bags of one entry each, so the same backward."""
    if kernels is None or weight.dtype != torch.float32:
        return F.embedding(local, weight, padding_idx=padding_idx)
    flat = local.reshape(-1)
    offsets = torch.arange(flat.numel(), device=flat.device)
    rows = embedding_bag(flat, weight, offsets, "sum", None, False, padding_idx, kernels)
    return rows.reshape(*local.shape, weight.shape[1])


class _KernelGradientBag(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, weight, local, offsets, mode, per_sample_weights, include_last_offset, padding_idx, kernels
    ):
        output = F.embedding_bag(
            local,
            weight,
            offsets,
            mode=mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=include_last_offset,
            padding_idx=padding_idx,
        )
        ctx.save_for_backward(local, offsets, per_sample_weights)
        ctx.settings = (weight.shape, mode, include_last_offset, padding_idx, kernels)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        local, offsets, per_sample_weights = ctx.saved_tensors
        (rows, dim), mode, include_last_offset, padding_idx, kernels = ctx.settings
        bag, scale = _entry_bags_and_scales(
            local, offsets, mode, per_sample_weights, include_last_offset, padding_idx, grad_output.shape[0]
        )
        flat = local.reshape(-1)
        order = torch.argsort(flat, stable=True)
        starts = torch.zeros(rows + 1, dtype=torch.int64, device=flat.device)
        torch.cumsum(torch.bincount(flat, minlength=rows), 0, out=starts[1:])
        grad_weight = torch.empty(rows, dim, dtype=torch.float32, device=grad_output.device)
        kernels.launch(
            "bag_weight_gradient",
            rows * dim,
            grad_output.contiguous(),
            order,
            starts,
            bag,
            scale,
            rows,
            dim,
            grad_weight,
        )
        return grad_weight, None, None, None, None, None, None, None


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
