"""A training lookup of bags whose top tier is the host cache, as native passes
(``tierstore/kernels/host_step.cpp``) and a fixed amount of Python per step:

1. ``distinct``: the batch's distinct ids by hashing (no sort), each entry's row among them, and
   the entries grouped by row (a counting sort);
2. the store makes those rows resident (hits counted, misses fetched and admitted) and, still
   holding its lock (a lookahead worker cannot move them meanwhile), ``step_pooled_forward``
   pools every bag straight from the host tier's rows (no gathered copy). Where one host tier over
   the mmap cold store serves the batch at its size (``TieredStore.lookup_bags``), 1 and 2 are one
   native call (``step_lookup_bags``, LFU's shadow caches replaying the batch in it too; where the
   dedupe runs on one thread, the other finds every entry's slot in the tier meanwhile); else
   three (``distinct``, ``TieredStore.read_resident``, ``pooled``), the same rows either way;
3. in backward, ``step_backward`` sums each row's gradient from its entries and applies the fused
   optimizer to the row in its slot, in one pass, under the store's lock. If a row moved between
   forward and backward (another lookup evicted it), the sums are handed to
   ``TieredStore.apply_gradients`` instead, which finds the rows again.

Each bag and each row is summed by one thread in entry order, so results do not depend on the
thread count. The gradient sums are ``bag_weight_gradient``'s and the updates the optimizer
kernels', in the same order: the same rows as the gather-then-``embedding_bag`` path
(``pooled_lookup``), which serves every other case and is the reference the tests hold this to.
"""

from __future__ import annotations

import torch

from ..kernels.native_types import Bags
from ..kernels.step_passes import StepPasses
from ..rounding import rounding_stream
from .pooled_lookup import rows_in_place


def step_passes(store) -> StepPasses | None:
    """The native passes for ``store``'s top tier when it is a host tier running the tuned host
    build (float32 or 16-bit rows), else None."""
    return store.stack.top.step_passes


def embedding_bag(
    table, passes: StepPasses, ids: torch.Tensor, offsets, per_sample_weights, shape: tuple | None = None
) -> torch.Tensor:
    """A training forward of ``table`` (a ``TieredEmbeddingBag``; arguments checked, ids int64 CPU,
    1-D with offsets or 2-D), its backward updating the rows in place. The output is ``[bags, dim]``,
    or laid out as ``shape`` (``[bags / k, k x dim]``: the same memory), pooled in float32 and
    rounded once to a 16-bit table's dtype."""
    store, dim = table.store, table.embedding_dim
    entries = ids.numel()
    if ids.dim() == 2:
        count, length, last_end = ids.shape[0], ids.shape[1], entries
    elif table.include_last_offset:  # offsets [bags + 1]: the last one ends the last bag
        count, length, last_end = offsets.numel() - 1, 0, int(offsets[-1])
    else:
        count, length, last_end = offsets.numel(), 0, entries
    weights = None if per_sample_weights is None else per_sample_weights.to(torch.float32).contiguous()
    offsets = None if offsets is None else offsets.contiguous()
    bags = Bags(offsets, length, count, last_end, table.mode == "mean", weights, dim, shape)
    looked_up = store.lookup_bags(ids, table.padding_idx, bags)  # one native call where it can
    if looked_up is not None:
        vacated, distinct, slots, (pooled, entry_bag, scale) = looked_up
    else:
        distinct = passes.distinct(ids, table.padding_idx)

        def pool(top, slots: torch.Tensor) -> tuple:  # under the store's lock: the rows stay put
            slots = slots.to(torch.int64).contiguous()  # itself: the passes take int64 slots as made
            return top.vacated, slots, *passes.pooled(top.rows, slots, distinct, bags)

        vacated, slots, pooled, entry_bag, scale = store.read_resident(distinct.unique, distinct.counts, pool)

    def backward(grad_output: torch.Tensor) -> None:
        if distinct.count == 0:
            return
        if shape is not None:  # the bags' rows again (a copy only where shape's rows are spaced out)
            grad_output = grad_output.reshape(count, dim)
        grad, grad_stride = rows_in_place(grad_output.to(torch.float32))
        step = table.next_step()
        name, arguments, _ = table.optimizer.kernel(step)
        stochastic = table.optimizer.stochastic_rounding and store.dtype != torch.float32

        def in_place(top) -> bool:
            if top.vacated != vacated and passes.rows_moved(top.slot_keys, slots, distinct.unique):
                return False
            rounding = (top.slot_keys, rounding_stream(step)) if stochastic else None
            update = (top.rows, slots, top.dirty, name, arguments, rounding)
            passes.backward(grad, grad_stride, distinct, entry_bag, scale, dim, update)
            return True

        if not store.update_top_tier(in_place):
            summed = passes.backward(grad, grad_stride, distinct, entry_bag, scale, dim, None)
            store.apply_gradients(distinct.unique, summed, table.optimizer, step, slots)

    if store.dtype != torch.float32:
        pooled = pooled.to(store.dtype)
    anchor = table.trainable if distributed() else _ANCHOR
    return _UpdateInBackward.apply(anchor, [pooled], backward)  # the output's backward


# What a lookup's output hangs from outside a process group: a leaf that needs a gradient and never
# gets one (``_UpdateInBackward`` returns None for it), shared by every lookup.
_ANCHOR = torch.empty(0, requires_grad=True)


def distributed() -> bool:
    """Whether a process group runs, so a data-parallel wrapper may expect every parameter that
    requires a gradient to be used by the forward (a table's ``trainable`` is then given a
    zero-element gradient: accumulating it costs about 10 us a step, paid only there)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def tied_to(parameter: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight``, with ``parameter`` (a table's ``trainable``, zero elements) given a zero-element
    gradient where a process group runs (``distributed``), its gradient passed through."""
    return _Tied.apply(parameter, weight) if distributed() else weight


class _UpdateInBackward(torch.autograd.Function):
    """``outputs[0]`` as an output whose backward runs ``backward(grad)``; ``anchor`` (a table's
    ``trainable`` under a process group, else a fresh leaf) gets a zero-element gradient if it is
    a parameter, else none."""

    @staticmethod
    def forward(ctx, anchor, outputs, backward):
        ctx.run_backward = backward
        ctx.anchor = anchor.detach() if isinstance(anchor, torch.nn.Parameter) else None
        return outputs[0]

    @staticmethod
    def backward(ctx, grad):
        ctx.run_backward(grad)
        return None if ctx.anchor is None else torch.zeros_like(ctx.anchor), None, None


class _Tied(torch.autograd.Function):
    @staticmethod
    def forward(ctx, parameter, weight):
        ctx.parameter = parameter.detach()
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros_like(ctx.parameter), grad
