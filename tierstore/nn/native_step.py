"""A training lookup of bags whose top tier is the host cache, as three native passes
(``tierstore/kernels/host_step.cpp``) and a fixed amount of Python per step:

1. ``distinct``: the batch's distinct ids by hashing (no sort), each entry's row among them, and
   the entries grouped by row (a counting sort);
2. the store makes those rows resident (``TieredStore.resident_slots``: hits counted, misses
   fetched and admitted), then ``step_pooled_forward`` pools every bag straight from the host
   tier's rows (no gathered copy of the rows);
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

import ctypes
import dataclasses
import threading

import torch

from .pooled_lookup import rows_in_place

# The optimizer kernels by number in host_step.cpp's update_row, with their float arguments.
_OPTIMIZER_CODES = {"update_sgd": 0, "update_adagrad": 1, "update_adam": 2, "update_rowwise_adagrad": 3}
_MAX_OPTIMIZER_ARGUMENTS = 6
_POINTER, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "step_distinct": (_I64, [_POINTER, _I64, _I64, _INT, _POINTER, _POINTER, _I64] + [_POINTER] * 5),
    "step_pooled_forward": (
        None,
        [_POINTER, _I64, _I64, _POINTER, _POINTER, _I64, _POINTER, _I64, _I64, _I64, _I64, _INT]
        + [_POINTER, _POINTER, _I64, _POINTER, _POINTER],
    ),
    "step_backward": (
        None,
        [_POINTER, _I64, _POINTER, _POINTER, _POINTER, _POINTER, _I64, _I64, _POINTER, _I64]
        + [_POINTER, _POINTER, _INT, _POINTER, _POINTER],
    ),
    "step_rows_moved": (_I64, [_POINTER, _POINTER, _POINTER, _I64]),
}


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


@dataclasses.dataclass(frozen=True)
class Distinct:
    """A batch's distinct ids: ``unique [U]`` in first-appearance order, ``counts [U]``,
    ``entry_rows [N]`` (each entry's row in ``unique``; U for padding entries), ``starts [U + 1]``
    and ``order [M]`` (row r's entries are ``order[starts[r]:starts[r + 1]]``, ascending); all int64."""

    unique: torch.Tensor
    counts: torch.Tensor
    entry_rows: torch.Tensor
    starts: torch.Tensor
    order: torch.Tensor
    padding_row: int  # -1: no padding


class StepPasses:
    """The native passes of one host build (``HostKernels.step_library``)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = {}
        for name, (result, arguments) in _SIGNATURES.items():
            function = getattr(library, name)
            function.restype, function.argtypes = result, arguments
            self._functions[name] = function
        self._scratch = threading.local()  # the dedupe's hash table, per thread, reused

    def _hash_table(self, entries: int) -> tuple[torch.Tensor, int]:
        """``(scratch [2, positions] int64, mask)`` with positions a power of two >= 2 x entries."""
        positions = 1 << max(4, (2 * entries - 1).bit_length())
        table = getattr(self._scratch, "table", None)
        if table is None or table.shape[1] < positions:
            table = self._scratch.table = torch.empty(2, positions, dtype=torch.int64)
        return table, positions - 1

    def distinct(self, ids: torch.Tensor, padding: int | None) -> Distinct:
        """``Distinct`` of ``ids`` (int64 CPU, any shape, validated), leaving out entries equal to
        ``padding`` (None: none)."""
        flat = ids.reshape(-1).contiguous()
        entries = flat.numel()
        table, mask = self._hash_table(entries)
        out = torch.empty(3, entries, dtype=torch.int64)  # unique, counts, entry rows
        starts = torch.empty(entries + 2, dtype=torch.int64)
        order = torch.empty(entries, dtype=torch.int64)
        count = self._functions["step_distinct"](
            flat.data_ptr(),
            entries,
            -1 if padding is None else padding,
            padding is not None,
            table[0].data_ptr(),
            table[1].data_ptr(),
            mask,
            out[0].data_ptr(),
            out[1].data_ptr(),
            out[2].data_ptr(),
            starts.data_ptr(),
            order.data_ptr(),
        )
        rows = count + (padding is not None)
        kept = int(starts[count])
        padding_row = count if padding is not None else -1
        return Distinct(out[0, :count], out[1, :count], out[2], starts[: rows + 1], order[:kept], padding_row)

    def pooled(
        self,
        rows: torch.Tensor,
        dim: int,
        slots: torch.Tensor,
        distinct: Distinct,
        offsets: torch.Tensor | None,
        bag_length: int,
        bags: int,
        last_end: int,
        mean: bool,
        weights: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(pooled [bags, dim], each entry's bag int64 [N] (-1: none), its gradient scale float32 [N])``
        of the bags over ``rows`` (the host tier's buffer) at ``slots`` (int32 [U]); bags as
        ``step_pooled_forward`` takes them."""
        entries = distinct.entry_rows.numel()
        out = torch.empty(bags, dim, dtype=torch.float32)
        entry_bag = torch.empty(entries, dtype=torch.int64)
        scale = torch.empty(entries, dtype=torch.float32)
        self._functions["step_pooled_forward"](
            rows.data_ptr(),
            rows.shape[1],
            dim,
            slots.data_ptr(),
            distinct.entry_rows.data_ptr(),
            distinct.padding_row,
            _pointer(offsets),
            bag_length,
            last_end,
            bags,
            entries,
            mean,
            _pointer(weights),
            out.data_ptr(),
            dim,
            entry_bag.data_ptr(),
            scale.data_ptr(),
        )
        return out, entry_bag, scale

    def backward(
        self,
        grad: torch.Tensor,
        grad_stride: int,
        distinct: Distinct,
        entry_bag: torch.Tensor,
        scale: torch.Tensor,
        dim: int,
        update: tuple | None,
    ) -> torch.Tensor | None:
        """Each distinct row's gradient summed from ``grad`` (bag b's at ``b * grad_stride``).
        ``update``: ``(rows, slots int32 [U], dirty, optimizer kernel name, its float arguments)``:
        applied to the rows in place (returns None); None: the sums ``[U, dim]`` are returned."""
        count = distinct.unique.numel()
        if update is None:
            summed = torch.empty(count, dim, dtype=torch.float32)
            rows = slots = dirty = None
            code, arguments = 0, ()
        else:
            summed = None
            rows, slots, dirty, name, arguments = update
            code = _OPTIMIZER_CODES[name]
        parameters = (ctypes.c_float * _MAX_OPTIMIZER_ARGUMENTS)(*arguments)
        self._functions["step_backward"](
            grad.data_ptr(),
            grad_stride,
            distinct.order.data_ptr(),
            distinct.starts.data_ptr(),
            entry_bag.data_ptr(),
            scale.data_ptr(),
            count,
            dim,
            _pointer(rows),
            0 if rows is None else rows.shape[1],
            _pointer(slots),
            _pointer(dirty),
            code,
            parameters,
            _pointer(summed),
        )
        return summed

    def rows_moved(self, slot_keys: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor) -> int:
        """How many ``keys`` are no longer at their ``slots`` (int32) of a tier's ``slot_keys``."""
        return self._functions["step_rows_moved"](
            slot_keys.data_ptr(), slots.data_ptr(), keys.data_ptr(), keys.numel()
        )


_PASSES: dict[int, StepPasses] = {}


def step_passes(store) -> StepPasses | None:
    """The native passes for ``store``'s top tier when it is a float32 host tier running the tuned
    host build, else None."""
    top = store.stack.top
    library = getattr(top.kernels, "step_library", None)
    if library is None or top.device.type != "cpu" or top.rows.dtype != torch.float32:
        return None
    passes = _PASSES.get(id(library))
    if passes is None:
        passes = _PASSES[id(library)] = StepPasses(library)
    return passes


def embedding_bag(table, passes: StepPasses, ids: torch.Tensor, offsets, per_sample_weights) -> torch.Tensor:
    """A training forward of ``table`` (a ``TieredEmbeddingBag``; arguments checked, ids int64 CPU,
    1-D with offsets or 2-D), its backward updating the rows in place."""
    store, dim = table.store, table.embedding_dim
    distinct = passes.distinct(ids, table.padding_idx)
    slots = store.resident_slots(distinct.unique, distinct.counts).to(torch.int32)
    entries = ids.numel()
    if ids.dim() == 2:
        bags, bag_length, last_end = ids.shape[0], ids.shape[1], entries
    elif table.include_last_offset:  # offsets [bags + 1]: the last one ends the last bag
        bags, bag_length, last_end = offsets.numel() - 1, 0, int(offsets[-1])
    else:
        bags, bag_length, last_end = offsets.numel(), 0, entries
    weights = None if per_sample_weights is None else per_sample_weights.to(torch.float32).contiguous()
    pooled, entry_bag, scale = passes.pooled(
        store.stack.top.rows,
        dim,
        slots,
        distinct,
        None if offsets is None else offsets.contiguous(),
        bag_length,
        bags,
        last_end,
        table.mode == "mean",
        weights,
    )

    def backward(grad_output: torch.Tensor) -> None:
        if distinct.unique.numel() == 0:
            return
        grad, grad_stride = rows_in_place(grad_output.to(torch.float32))
        table.step += 1
        name, arguments, _ = table.optimizer.kernel(table.step)

        def in_place(top) -> bool:
            if passes.rows_moved(top.slot_keys, slots, distinct.unique):
                return False
            update = (top.rows, slots, top.dirty, name, arguments)
            passes.backward(grad, grad_stride, distinct, entry_bag, scale, dim, update)
            return True

        if not store.update_top_tier(in_place):
            summed = passes.backward(grad, grad_stride, distinct, entry_bag, scale, dim, None)
            store.apply_gradients(distinct.unique, summed, table.optimizer, table.step, slots.to(torch.int64))

    anchor = torch.empty(0, requires_grad=True)  # what ties the output to the backward
    return _UpdateInBackward.apply(anchor, [pooled], backward)


class _UpdateInBackward(torch.autograd.Function):
    """``outputs[0]`` as an output whose backward runs ``backward(grad)`` (the anchor gets no gradient)."""

    @staticmethod
    def forward(ctx, anchor, outputs, backward):
        ctx.run_backward = backward
        return outputs[0]

    @staticmethod
    def backward(ctx, grad):
        ctx.run_backward(grad)
        return None, None, None
