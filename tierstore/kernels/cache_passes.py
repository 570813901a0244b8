"""The host cache tier's own calls (``host_cache.cpp``, in the tuned host build) behind typed
Python calls: a batch's keys resolved (found, the hits touched, the misses listed) in one pass,
erase by backward shifting (no tombstones), LFU's ranked scan, the rows of an eviction and an
admission moved in one call each, and per-slot pins and scores set on one thread.
``tiers.row_cache``, ``tiers.policies`` and ``tiers.kernel_hash_table`` use them where a tier runs
on that build."""

from __future__ import annotations

import ctypes
import functools

import torch

from .native_types import typed

_POINTER, _I64 = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "cache_erase_shifting": (_I64, [_POINTER, _POINTER, _I64, _POINTER, _I64, _POINTER]),
    "index_erase_shifting": (_I64, [_POINTER, _POINTER, _I64, _POINTER, _I64, _POINTER]),
    "cache_insert_serial": (_I64, [_POINTER, _POINTER, _I64, _POINTER, _POINTER, _I64, _POINTER]),
    "index_insert_serial": (_I64, [_POINTER, _POINTER, _I64, _POINTER, _POINTER, _I64, _POINTER]),
    "cache_resolve": (
        _I64,
        [_POINTER, _POINTER, _I64, _POINTER, _POINTER, _POINTER, _I64, _I64, _POINTER, _POINTER, _I64]
        + [_POINTER, ctypes.c_float]
        + [_POINTER] * 4,
    ),
    "cache_direct_claims": (
        None,
        [_POINTER, _POINTER, _I64, _POINTER, _POINTER, _I64, _I64, _POINTER, _I64, _POINTER],
    ),
    "cache_pins_add": (None, [_POINTER, _POINTER, _I64, _I64]),
    "cache_zero_at": (None, [_POINTER, _POINTER, _I64]),
    "cache_add_counts": (None, [_POINTER, _POINTER, _POINTER, _I64, ctypes.c_float]),
    "cache_lowest_slots": (_I64, [_POINTER, _POINTER, _POINTER, _I64, _I64, _I64, _POINTER]),
    "cache_pool_take": (_I64, [_POINTER] * 3 + [_I64] + [_POINTER] * 3 + [_I64, _POINTER]),
    "cache_slot_rows": (
        None,
        [_POINTER, _POINTER, _I64, _POINTER, _POINTER, _POINTER, _I64] + [_POINTER] * 4,
    ),
    "cache_fill_slots": (
        None,
        [_POINTER, _POINTER, _I64, _POINTER, _POINTER, _POINTER, _I64] + [_POINTER] * 4,
    ),
    "cache_window_positions": (_I64, []),
}
_ERASE = {torch.int32: "cache_erase_shifting", torch.int64: "index_erase_shifting"}
_INSERT = {torch.int32: "cache_insert_serial", torch.int64: "index_insert_serial"}


class CachePasses:
    """The host cache calls of one host build (``HostKernels.step_library``). Tensors are CPU,
    contiguous: keys and slots int64, flags bool, rows of any dtype (moved as bytes)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = {name: typed(getattr(library, name), *c) for name, c in _SIGNATURES.items()}
        # Positions of a table whose keys fit in a core's own (L2) cache: the erase, insert and find
        # here compare four keys at once in such a table.
        self.window_positions = int(self._functions["cache_window_positions"]())

    def erase(
        self, table_keys: torch.Tensor, table_values: torch.Tensor, keys: torch.Tensor
    ) -> tuple[torch.Tensor, int]:
        """Remove ``keys`` (distinct) from a table without tombstones (``table_values`` int32 or
        int64), leaving none; returns the values they held (-1: absent), in the values' dtype, and
        how many were present."""
        keys = keys.to(torch.int64).contiguous()
        former = torch.empty(keys.numel(), dtype=table_values.dtype)
        present = self._functions[_ERASE[table_values.dtype]](
            table_keys.data_ptr(),
            table_values.data_ptr(),
            table_keys.numel() - 1,
            keys.data_ptr(),
            keys.numel(),
            former.data_ptr(),
        )
        return former, present

    def insert(
        self, table_keys: torch.Tensor, table_values: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[int, int]:
        """Insert ``keys`` (int64, distinct, absent) with ``values`` (the table's value dtype), on one
        thread. Returns ``(-1, 0)``, or the first key's position that could not go in and its
        status (the insert kernel's codes); the keys before it are in."""
        status = ctypes.c_int(0)
        failed = self._functions[_INSERT[table_values.dtype]](
            table_keys.data_ptr(),
            table_values.data_ptr(),
            table_keys.numel() - 1,
            keys.data_ptr(),
            values.data_ptr(),
            keys.numel(),
            ctypes.byref(status),
        )
        return failed, status.value

    def resolve(
        self, tier, keys: torch.Tensor, counts: torch.Tensor, scores, increment: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
        """``(slots, hit_slots, missed, hit lookups, missed lookups)`` of distinct ``keys`` (int64,
        each looked up ``counts`` times) in ``tier`` (a ``RowCache``: its index, int32 values, and
        its direct layout's homes): each key's slot or -1, the hits' slots, the misses' positions
        in ``keys``; the hits' ``scores`` (float32) gain ``counts x increment`` as LFU's touch adds."""
        keys, counts = keys.to(torch.int64).contiguous(), counts.to(torch.int64).contiguous()
        count = keys.numel()
        out = torch.empty(3, count, dtype=torch.int64)
        lookups = torch.zeros(2, dtype=torch.int64)
        index = tier.index
        misses = self._functions["cache_resolve"](
            index.keys.data_ptr(),
            index.values.data_ptr(),
            index.keys.numel() - 1,
            tier.slot_keys.data_ptr(),
            *layout_arguments(tier),
            keys.data_ptr(),
            counts.data_ptr(),
            count,
            scores.data_ptr(),
            increment,
            out[0].data_ptr(),
            out[1].data_ptr(),
            out[2].data_ptr(),
            lookups.data_ptr(),
        )
        hits, missed = lookups.tolist()
        return out[0], out[1, : count - misses], out[2, :misses], hits, missed

    def direct_claims(
        self, tier, free: torch.Tensor, positions: torch.Tensor, free_count: int, keys: torch.Tensor
    ) -> torch.Tensor:
        """Slots (int64) for distinct ``keys`` not in ``tier`` (at most ``free_count``): its free-slot
        stack ``free[:free_count]`` (int64; ``positions`` int32, each free slot's place in it) gets
        the keys' free homes (its ``DirectLayout``'s) at its top, and the keys take its top slots,
        each its home where it got one (``cache_direct_claims``). Nothing is taken: the stack is
        only reordered."""
        keys = keys.to(torch.int64).contiguous()
        out = torch.empty(keys.numel(), dtype=torch.int64)
        self._functions["cache_direct_claims"](
            free.data_ptr(),
            positions.data_ptr(),
            free_count,
            *layout_arguments(tier),
            keys.data_ptr(),
            keys.numel(),
            out.data_ptr(),
        )
        return out

    def add_pins(self, pins: torch.Tensor, slots: torch.Tensor, delta: int) -> None:
        """``pins`` (uint8) at ``slots`` (distinct) += ``delta`` (1 or -1), on one thread."""
        slots = slots.to(torch.int64).contiguous()
        self._functions["cache_pins_add"](pins.data_ptr(), slots.data_ptr(), slots.numel(), delta)

    def add_counts(
        self, scores: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, increment: float
    ) -> None:
        """``scores`` (float32) at ``slots`` (distinct) += ``counts x increment``, as ``resolve`` adds."""
        slots, counts = slots.to(torch.int64).contiguous(), counts.to(torch.int64).contiguous()
        self._functions["cache_add_counts"](
            scores.data_ptr(), slots.data_ptr(), counts.data_ptr(), slots.numel(), increment
        )

    def zero_at(self, values: torch.Tensor, slots: torch.Tensor) -> None:
        """``values`` (float32) at ``slots`` = 0, on one thread."""
        slots = slots.to(torch.int64).contiguous()
        self._functions["cache_zero_at"](values.data_ptr(), slots.data_ptr(), slots.numel())

    def lowest_slots(
        self, scores: torch.Tensor, slot_keys: torch.Tensor, pins: torch.Tensor, count: int, head: int = 0
    ) -> torch.Tensor:
        """int64: up to ``count`` slots holding a row and unpinned, of the lowest ``scores``
        (float32, finite, non-negative), ascending by (score, slot) but for the first ``head``:
        the ``head`` lowest, in no particular order (not sorting LFU's victims saves most of a scan
        that takes many)."""
        out = torch.empty(min(count, scores.numel()), dtype=torch.int64)
        kept = self._functions["cache_lowest_slots"](
            scores.data_ptr(),
            slot_keys.data_ptr(),
            pins.data_ptr(),
            scores.numel(),
            out.numel(),
            head,
            out.data_ptr(),
        )
        return out[:kept]

    def pool_take(self, pool: tuple, scores, slot_keys, pins, count: int) -> tuple[torch.Tensor, int]:
        """``(slots, entries consumed)``: the first ``count`` slots of LFU's ``pool`` (``(slots int64,
        their scores, their keys)`` when ranked) that still hold that key and score and are not
        pinned; consumed is -1 (and slots empty) if fewer qualify."""
        slots, ranked_scores, ranked_keys = pool
        out = torch.empty(count, dtype=torch.int64)
        consumed = self._functions["cache_pool_take"](
            slots.data_ptr(),
            ranked_scores.data_ptr(),
            ranked_keys.data_ptr(),
            slots.numel(),
            scores.data_ptr(),
            slot_keys.data_ptr(),
            pins.data_ptr(),
            count,
            out.data_ptr(),
        )
        return (out if consumed >= 0 else out[:0]), consumed

    def slot_rows(
        self, slot_keys: torch.Tensor, rows: torch.Tensor, dirty: torch.Tensor, fresh: torch.Tensor, slots
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, rows, dirty, fresh)`` at ``slots`` (int64)."""
        slots = slots.to(torch.int64).contiguous()
        count = slots.numel()
        keys = torch.empty(count, dtype=torch.int64)
        out = torch.empty(count, rows.shape[1], dtype=rows.dtype)
        flags = torch.empty(2, count, dtype=torch.bool)
        self._functions["cache_slot_rows"](
            *_tier_arguments(slot_keys, rows, dirty, fresh, slots),
            keys.data_ptr(),
            out.data_ptr(),
            flags[0].data_ptr(),
            flags[1].data_ptr(),
        )
        return keys, out, flags[0], flags[1]

    def fill_slots(self, slot_keys, rows, dirty, fresh, slots: torch.Tensor, incoming) -> None:
        """Slot ``slots[i]`` (int64) takes ``incoming`` (a ``Rows``) ``i``'s key, row and flags."""
        if incoming.rows.shape[1:] != rows.shape[1:]:
            raise ValueError(
                f"incoming rows are {tuple(incoming.rows.shape)}; the tier's are {tuple(rows.shape)}"
            )
        slots = slots.to(torch.int64).contiguous()
        keys = incoming.keys.to(torch.int64).contiguous()
        values = incoming.rows.to(rows.dtype).contiguous()
        in_dirty = incoming.dirty.to(torch.bool).contiguous()
        in_fresh = incoming.fresh.to(torch.bool).contiguous()
        self._functions["cache_fill_slots"](
            *_tier_arguments(slot_keys, rows, dirty, fresh, slots),
            keys.data_ptr(),
            values.data_ptr(),
            in_dirty.data_ptr(),
            in_fresh.data_ptr(),
        )


def layout_arguments(tier) -> tuple[int, int, int, int]:
    """A tier's ``DirectLayout`` (``tier.direct``, or None) as the calls take it: its bases, sizes and
    number of tables, and the tier's slots now (homes past them come with its growth)."""
    layout = tier.direct
    if layout is None:
        return 0, 0, 0, 0
    return layout.bases.data_ptr(), layout.sizes.data_ptr(), layout.sizes.numel(), tier.capacity


def _tier_arguments(slot_keys, rows, dirty, fresh, slots: torch.Tensor) -> tuple:
    """A tier's arrays and ``slots`` (int64, contiguous), as the row calls take them first (a row
    as its bytes: rows of any dtype)."""
    return (
        slot_keys.data_ptr(),
        rows.data_ptr(),
        rows.shape[1] * rows.element_size(),
        dirty.data_ptr(),
        fresh.data_ptr(),
        slots.data_ptr(),
        slots.numel(),
    )


def cache_passes_of(kernels) -> CachePasses | None:
    """The host cache calls of ``kernels`` (a ``HostKernels``/``CudaKernels`` or None): None unless it
    is a tuned host build."""
    library = getattr(kernels, "step_library", None)
    return None if library is None else _cache_passes(library)


@functools.cache
def _cache_passes(library: ctypes.CDLL) -> CachePasses:
    return CachePasses(library)
