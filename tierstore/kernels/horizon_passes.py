"""A lookahead horizon's calls (``host_horizon.cpp``, in the tuned host build) behind typed Python
calls: a batch entering the horizon and a batch consumed, one call each. ``tierstore.horizon``
uses them where the store's top tier runs on that build."""

from __future__ import annotations

import ctypes
import functools

import torch

from .cache_passes import layout_arguments
from .native_types import typed

_POINTER, _I64 = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "horizon_enter": (
        None,
        [_POINTER, _I64, _I64, _I64, _POINTER, _POINTER, _I64, _POINTER, _POINTER, _I64] + [_POINTER] * 2,
    ),
    "horizon_drop_farthest": (None, [_POINTER, _POINTER, _I64, _I64, _POINTER, _POINTER]),
    "horizon_consume": (
        None,
        [_POINTER, _I64, _I64, _POINTER, _POINTER, _I64, _POINTER, _POINTER, _I64, _POINTER, _POINTER, _I64]
        + [_I64, _POINTER],
    ),
}


class HorizonTier(ctypes.Structure):
    """host_horizon.cpp's ``HorizonTier``: the top tier's index, homes and pins, the horizon's per-slot
    record."""

    _fields_ = [
        ("index_keys", _POINTER),
        ("index_values", _POINTER),
        ("index_mask", _I64),
        ("pins", _POINTER),
        ("pinned_key", _POINTER),
        ("pinned_next", _POINTER),
        ("slot_keys", _POINTER),
        ("direct_bases", _POINTER),  # the tier's DirectLayout (direct_tables 0: none)
        ("direct_sizes", _POINTER),
        ("direct_tables", _I64),
        ("direct_slots", _I64),
        ("slots", _I64),  # the tier's slots now
    ]


def horizon_tier(top, pinned_key: torch.Tensor, pinned_next: torch.Tensor) -> HorizonTier:
    """The ``HorizonTier`` of host tier ``top`` (its arrays as they are now: an index may grow)."""
    index = top.index
    return HorizonTier(
        index.keys.data_ptr(),
        index.values.data_ptr(),
        index.keys.numel() - 1,
        top.pins.data_ptr(),
        pinned_key.data_ptr(),
        pinned_next.data_ptr(),
        top.slot_keys.data_ptr(),
        *layout_arguments(top),
        top.capacity,
    )


class HorizonPasses:
    """The horizon calls of one host build. Keys int64 CPU, contiguous; ``links`` is the horizon's
    map and rings: ``(map keys, map values (int64), next uses, slot hints (int32, one ring))``,
    power-of-two sizes."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = {name: typed(getattr(library, name), *c) for name, c in _SIGNATURES.items()}

    def enter(
        self, keys: torch.Tensor, first_code: int, sequence: int, links: tuple, tier: HorizonTier
    ) -> tuple[int, int]:
        """``horizon_enter``: ``(pins added, ids new to the map)``."""
        map_keys, map_values, ring, entry_slot = links
        out = (ctypes.c_int64 * 2)()
        self._functions["horizon_enter"](
            keys.data_ptr(),
            keys.numel(),
            first_code,
            sequence,
            map_keys.data_ptr(),
            map_values.data_ptr(),
            map_keys.numel() - 1,
            ring.data_ptr(),
            entry_slot.data_ptr(),
            ring.numel() - 1,
            ctypes.byref(tier),
            out,
        )
        return out[0], out[1]

    def consume(
        self,
        keys: torch.Tensor,
        first_code: int,
        links: tuple,
        tier: HorizonTier,
        next_keys: torch.Tensor,
        next_code: int,
    ) -> tuple[int, int, int]:
        """``horizon_consume``: ``(pins added less dropped, ids that left the map, slots the next
        batch may claim beyond the horizon's pins)``; ``next_code``: the next batch's first entry."""
        map_keys, map_values, ring, entry_slot = links
        out = (ctypes.c_int64 * 3)()
        self._functions["horizon_consume"](
            keys.data_ptr(),
            keys.numel(),
            first_code,
            map_keys.data_ptr(),
            map_values.data_ptr(),
            map_keys.numel() - 1,
            ring.data_ptr(),
            entry_slot.data_ptr(),
            ring.numel() - 1,
            ctypes.byref(tier),
            next_keys.data_ptr(),
            next_keys.numel(),
            next_code,
            out,
        )
        return out[0], out[1], out[2]

    def drop_farthest(
        self, tier: HorizonTier, slot_keys: torch.Tensor, keep: int, scratch: torch.Tensor
    ) -> tuple[int, int]:
        """``horizon_drop_farthest``: ``(pins held now, pins dropped)``; ``scratch``: int32 [capacity]."""
        out = (ctypes.c_int64 * 2)()
        self._functions["horizon_drop_farthest"](
            ctypes.byref(tier),
            slot_keys.data_ptr(),
            slot_keys.numel(),
            keep,
            scratch.data_ptr(),
            out,
        )
        return out[0], out[1]


def horizon_passes_of(kernels) -> HorizonPasses | None:
    """The horizon calls of ``kernels`` (a tier's ``HostKernels``/``CudaKernels`` or None): None
    unless it is a tuned host build."""
    library = getattr(kernels, "step_library", None)
    return None if library is None else _horizon_passes(library)


@functools.cache
def _horizon_passes(library: ctypes.CDLL) -> HorizonPasses:
    return HorizonPasses(library)
