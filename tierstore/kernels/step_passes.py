"""The host build's training-step passes (``host_step.cpp``) behind typed Python calls: a batch's
distinct ids by hashing, the pooled forward read straight from a tier's rows, the gradient sum per
row fused with the optimizer, a collection's key layout and id check, the initial rows, the mmap
cold store's reads and log writes, and a host tier's misses admitted from that store in one call.
``nn.native_step`` builds a training lookup from them; ``initializer`` uses ``initial_rows``, the
mmap store the rest.
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading

import torch

from .cold_passes import ColdPasses
from .host import host_kernels
from .launch import ROW_FORMATS
from .native_types import (
    Bags,
    Distinct,
    pointer,
    typed,
)

# The optimizer kernels by number in host_step.cpp's update_row, with their float arguments.
_OPTIMIZER_CODES = {"update_sgd": 0, "update_adagrad": 1, "update_adam": 2, "update_rowwise_adagrad": 3}
_MAX_OPTIMIZER_ARGUMENTS = 6
_POINTER, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "step_distinct_scratch": (_I64, [_I64]),
    "step_distinct": (_I64, [_POINTER, _I64, _I64, _INT] + [_POINTER] * 6),
    "step_unique": (_I64, [_POINTER, _I64, _POINTER, _I64, _POINTER]),
    "step_pooled_forward": (
        _I64,
        [_POINTER, _I64, _I64, _I64, _POINTER, _POINTER, _I64, _POINTER, _I64, _I64, _I64, _I64, _INT]
        + [_POINTER, _POINTER, _I64, _POINTER, _POINTER],
    ),
    "step_backward": (
        None,
        [_POINTER, _I64, _POINTER, _POINTER, _POINTER, _POINTER, _I64, _I64, _POINTER, _I64, _I64]
        + [_POINTER, _POINTER, _INT, _POINTER, _POINTER, _I64, _I64, _POINTER],
    ),
    "step_rows_moved": (_I64, [_POINTER, _POINTER, _POINTER, _I64]),
    "step_check_batch": (_I64, [_POINTER, _I64, _POINTER, _I64, _I64] + [_POINTER] * 3),
    "step_initial_rows": (None, [_POINTER, _I64, _I64, _I64, ctypes.c_uint64, ctypes.c_double, _POINTER]),
    "step_row_hashes": (None, [_POINTER, _POINTER, _I64, _I64, _I64, _POINTER]),
    "step_cold_rows": (
        _I64,
        [_POINTER, _I64, _POINTER, _POINTER, _I64, _I64, _INT, _POINTER, _POINTER, _POINTER, _I64, _POINTER]
        + [_POINTER, _I64, _I64, _I64, _POINTER, _POINTER, _POINTER],
    ),
    "step_cold_stage": (
        _I64,
        [_POINTER, _I64, _POINTER, _I64, _I64, _POINTER, _POINTER, _I64, _POINTER, _I64] + [_POINTER] * 4,
    ),
    "step_log_filter": (None, [_POINTER, _I64, _POINTER, _I64]),
    "step_prepare_pages": (None, [_INT, _I64, _I64]),
    "step_merge_runs": (_I64, [_POINTER, _POINTER, _I64, _POINTER, _POINTER, _I64, _POINTER, _POINTER]),
    "step_group_keys": (None, [_POINTER, _POINTER, _I64, _POINTER, _POINTER, _I64] + [_POINTER] * 6),
    "step_will_need_homes": (None, [_POINTER, _I64, _POINTER, _POINTER, _I64]),
    "step_will_need_rows": (None, [_POINTER, _I64, _POINTER, _I64]),
    "step_make_resident": (
        None,
        [_POINTER, _POINTER, _I64, _POINTER, _I64, _POINTER, _POINTER, _POINTER, _INT, _INT, _INT]
        + [_POINTER, _POINTER, _POINTER],
    ),
    "step_lookup_bags": (None, [_POINTER] * 4 + [_INT, _INT, _INT] + [_POINTER] * 3),
}


class StepPasses(ColdPasses):
    """The native passes of one host build (``HostKernels.step_library``)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = {name: typed(getattr(library, name), *c) for name, c in _SIGNATURES.items()}
        self._scratch = threading.local()  # the dedupe's hash table, per thread, reused

    def _hash_table(self, entries: int) -> tuple[torch.Tensor, int]:
        """``(scratch [positions] int32, mask)`` with positions a power of two >= 2 x entries."""
        if entries >= 1 << 31:
            raise ValueError(f"a batch holds {entries} ids; split it into batches of fewer than 2^31")
        positions = 1 << max(4, (2 * entries - 1).bit_length())
        table = getattr(self._scratch, "table", None)
        if table is None or table.shape[0] < positions:
            table = self._scratch.table = torch.empty(positions, dtype=torch.int32)
        return table, positions - 1

    def _distinct_scratch(self, entries: int) -> torch.Tensor:
        """int32 scratch for ``step_distinct`` of ``entries`` ids."""
        if entries >= 1 << 31:
            raise ValueError(f"a batch holds {entries} ids; split it into batches of fewer than 2^31")
        scratch, serves = getattr(self._scratch, "distinct", (None, -1))  # and the most entries it serves
        if entries > serves:
            scratch = torch.empty(self._functions["step_distinct_scratch"](entries), dtype=torch.int32)
            self._scratch.distinct = scratch, entries
        return scratch

    def _distinct_room(self, ids: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
        """``(ids flat, their number N, step_distinct's scratch, room for a Distinct [5N + 2])``: the
        room holds unique, counts, entry rows, order and starts, in that order."""
        flat = ids.reshape(-1).contiguous()
        entries = flat.numel()
        return flat, entries, self._distinct_scratch(entries), torch.empty(5 * entries + 2, dtype=torch.int64)

    def distinct(self, ids: torch.Tensor, padding: int | None) -> Distinct:
        """``Distinct`` of ``ids`` (int64 CPU, any shape, validated), leaving out entries equal to
        ``padding`` (None: none)."""
        flat, entries, scratch, out = self._distinct_room(ids)
        address = out.data_ptr()
        count = self._functions["step_distinct"](
            flat.data_ptr(),
            entries,
            -1 if padding is None else padding,
            padding is not None,
            scratch.data_ptr(),
            address,
            address + 8 * entries,
            address + 16 * entries,
            address + 32 * entries,
            address + 24 * entries,
        )
        return Distinct(out, entries, count, count if padding is not None else -1)

    def unique(self, ids: torch.Tensor) -> torch.Tensor:
        """The distinct values of ``ids`` (int64 CPU), in first-appearance order (``step_unique``)."""
        flat = ids.reshape(-1).contiguous()
        table, mask = self._hash_table(flat.numel())
        unique = torch.empty(flat.numel(), dtype=torch.int64)
        count = self._functions["step_unique"](
            flat.data_ptr(), flat.numel(), table.data_ptr(), mask, unique.data_ptr()
        )
        return unique[:count]

    def pooled(
        self, rows: torch.Tensor, slots: torch.Tensor, distinct: Distinct, bags: Bags
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(pooled [bags, dim] (or as ``bags.shape``), each entry's bag int64 [N] (-1: none), its
        gradient scale float32 [N])`` of ``bags`` over ``rows`` (the host tier's buffer, float32 or
        16-bit: summed in float32) at ``slots`` (int64 [U]); the last two None where each entry is
        a bag of its own, of scale 1 (``backward`` takes them so)."""
        entries = distinct.entries
        out, entry_bag, scale = bags.outputs(entries)
        own_bags = self._functions["step_pooled_forward"](
            rows.data_ptr(),
            ROW_FORMATS[rows.dtype],
            rows.shape[1],
            bags.dim,
            slots.data_ptr(),
            distinct.entry_rows_address,
            distinct.padding_row,
            pointer(bags.offsets),
            bags.length,
            bags.last_end,
            bags.count,
            entries,
            bags.mean,
            pointer(bags.weights),
            out.data_ptr(),
            bags.dim,
            entry_bag.data_ptr(),
            scale.data_ptr(),
        )
        return (out, None, None) if own_bags else (out, entry_bag, scale)

    def backward(
        self,
        grad: torch.Tensor,
        grad_stride: int,
        distinct: Distinct,
        entry_bag: torch.Tensor | None,
        scale: torch.Tensor | None,
        dim: int,
        update: tuple | None,
    ) -> torch.Tensor | None:
        """Each distinct row's gradient summed from ``grad`` (bag b's at ``b * grad_stride``), its
        entries' bags and scales as ``pooled`` gave them (None: each entry its own bag, scale 1).
        ``update``: ``(rows, slots int64 [U], dirty, optimizer kernel name, its float arguments,
        rounding)``: applied to the rows in place (returns None), 16-bit rows rounded as ``rounding``
        says (``(slot keys, stream)`` for stochastic rounding by the rows' ids, else None); None: the
        sums ``[U, dim]`` are returned."""
        count = distinct.count
        rounding = None
        if update is None:
            summed = torch.empty(count, dim, dtype=torch.float32)
            rows = slots = dirty = None
            code, arguments = 0, ()
        else:
            summed = None
            rows, slots, dirty, name, arguments, rounding = update
            code = _OPTIMIZER_CODES[name]
        slot_keys, stream = rounding if rounding is not None else (None, 0)
        parameters = (ctypes.c_float * _MAX_OPTIMIZER_ARGUMENTS)(*arguments)
        self._functions["step_backward"](
            grad.data_ptr(),
            grad_stride,
            distinct.order_address,
            distinct.starts_address,
            pointer(entry_bag),
            pointer(scale),
            count,
            dim,
            pointer(rows),
            -1 if rows is None else ROW_FORMATS[rows.dtype],
            0 if rows is None else rows.shape[1],
            pointer(slots),
            pointer(dirty),
            code,
            parameters,
            pointer(slot_keys),
            stream,
            rounding is not None,
            pointer(summed),
        )
        return summed

    def rows_moved(self, slot_keys: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor) -> int:
        """How many ``keys`` are no longer at their ``slots`` (int64) of a tier's ``slot_keys``."""
        return self._functions["step_rows_moved"](
            slot_keys.data_ptr(), slots.data_ptr(), keys.data_ptr(), keys.numel()
        )

    def _cursors(self, features: int) -> torch.Tensor:
        """int64 scratch of at least ``features`` entries, this thread's."""
        cursors = getattr(self._scratch, "cursors", None)
        if cursors is None or cursors.numel() < features:
            cursors = self._scratch.cursors = torch.empty(max(features, 64), dtype=torch.int64)
        return cursors

    def check_batch(
        self, values: torch.Tensor, lengths: torch.Tensor, bounds: torch.Tensor
    ) -> tuple[torch.Tensor, int, int]:
        """``(feature starts int64 [F + 1], what is wrong, its detail)`` of a batch's ``values`` (int64,
        feature by feature) and ``lengths [F, batch]`` (int64) whose feature f's ids must be below
        ``bounds[f]``, as ``step_check_batch``: 0 nothing; 1 a negative length (detail: its flat
        position); 2 the lengths sum to detail, not to the values' count; 3 entry detail's id is
        negative or out of bounds."""
        features, batch = lengths.shape
        starts = torch.empty(features + 1, dtype=torch.int64)
        detail = getattr(self._scratch, "detail", None)
        if detail is None:
            detail = self._scratch.detail = torch.zeros(1, dtype=torch.int64)
        kind = self._functions["step_check_batch"](
            values.data_ptr(),
            values.numel(),
            lengths.data_ptr(),
            features,
            batch,
            bounds.data_ptr(),
            starts.data_ptr(),
            detail.data_ptr(),
        )
        return starts, kind, int(detail) if kind else 0

    def group_keys(
        self,
        values: torch.Tensor,
        lengths: torch.Tensor,
        feature_starts: torch.Tensor,
        features: list[int],
        numbers: torch.Tensor,
        weights: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(keys [M], bag starts [batch x len(features)], weights [M] or None)`` of the entries of
        ``features`` (positions in a KeyedJaggedTensor: ``values`` int64, ``lengths [F, batch]``,
        ``weights`` float32 or None) in the output's layout, sample by sample, as ``step_group_keys``."""
        batch = lengths.shape[1]
        group = _positions(tuple(features))
        count = int(lengths[group].sum()) if len(features) < lengths.shape[0] else values.numel()
        keys = torch.empty(count, dtype=torch.int64)
        starts = torch.empty(batch * len(features), dtype=torch.int64)
        group_weights = None if weights is None else torch.empty(count, dtype=torch.float32)
        cursors = self._cursors(len(features))  # scratch: each feature's next entry
        lengths = lengths.contiguous()
        self._functions["step_group_keys"](
            values.data_ptr(),
            lengths.data_ptr(),
            batch,
            feature_starts.data_ptr(),
            group.data_ptr(),
            len(features),
            numbers.data_ptr(),
            pointer(weights),
            keys.data_ptr(),
            starts.data_ptr(),
            pointer(group_weights),
            cursors.data_ptr(),
        )
        return keys, starts, group_weights

    def initial_rows(self, ids: torch.Tensor, dim: int, state_width: int, seed_hash: int) -> torch.Tensor:
        """float32 ``[N, dim + state_width]`` initial rows of ``ids`` (int64 CPU): ``initializer``'s,
        bit for bit. ``seed_hash``: the seed's SplitMix64 hash, as a uint64."""
        ids = ids.contiguous()
        rows = torch.empty(ids.numel(), dim + state_width, dtype=torch.float32)
        bound = 1.0 / math.sqrt(dim)
        width = dim + state_width
        self._functions["step_initial_rows"](
            ids.data_ptr(), ids.numel(), dim, width, seed_hash, bound, rows.data_ptr()
        )
        return rows


@functools.lru_cache(maxsize=256)
def _positions(features: tuple[int, ...]) -> torch.Tensor:
    """int64 ``features``, made once per group layout (read only)."""
    return torch.tensor(features, dtype=torch.int64)


@functools.cache
def passes_of(library: ctypes.CDLL) -> StepPasses:
    """The passes of ``library``, made once per library."""
    return StepPasses(library)


def step_passes_of(kernels) -> StepPasses | None:
    """The passes of ``kernels`` (a ``HostKernels``/``CudaKernels`` or None): None unless it is a
    tuned host build."""
    library = getattr(kernels, "step_library", None)
    return None if library is None else passes_of(library)


@functools.cache
def host_passes() -> StepPasses | None:
    """The passes of this machine's tuned host build, None where it cannot be built (decided once)."""
    return step_passes_of(host_kernels(parallel=True)[0])


def distinct_ids(ids: torch.Tensor) -> torch.Tensor:
    """The distinct values of ``ids`` (int64 CPU): by hashing, in first-appearance order, where the
    tuned host build runs here (no sort); else ``torch.unique``'s, ascending."""
    passes = host_passes()
    if passes is None or ids.device.type != "cpu":
        return torch.unique(ids)
    return passes.unique(ids)
