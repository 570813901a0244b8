"""LFU's ageing chosen online: shadow caches over a sample of the lookups, one per half-life.

One half-life cannot serve every workload: on a steady click log, forgetting old counts loses hot
rows to bursts (plain LFU, no ageing, is best there); on a drifting one (time-ordered ratings,
trends), counts that never fade keep yesterday's hot rows (ageing wins). So, as ARC and W-TinyLFU
adapt from ghost entries, ``AgeingTuner`` replays a spatial sample of the tier's lookups (ids whose
hash falls under a rate, SHARDS-style, about ``SHADOW_ROWS`` rows' worth of the tier) through small
LFU caches, one per candidate half-life (``RUNGS``, multiples of the capacity; the last is plain
LFU), in native code (``host_ageing.cpp``), and counts their hits with a fading memory. The tier
follows the shadow that hits most, once it leads the current choice by ``MARGIN``. A lookup moves
no row, so the choice changes only which rows stay cached, never a row's value.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import torch

from ..kernels.native_types import typed
from ..validation import cpu_int64

RUNGS = (1.0, 4.0, 16.0, 64.0, math.inf)  # candidate half-lives, in multiples of the capacity
START = 1  # today's default: 4x the capacity
SHADOW_ROWS = 512  # most rows of a shadow
SHADOW_SHARE = 64  # of the tier's rows: a shadow's rows at most (its memory counts in the budget)
MIN_SHADOW_ROWS = 16  # fewer and the shadows are noise: the ageing stays at START
MEMORY = 16  # shadow capacities of sampled lookups over which their hits fade by half
MARGIN = 0.01  # a shadow leads when it hits this much (relatively) more than the current choice
_POINTER, _I64 = ctypes.c_void_p, ctypes.c_int64


def shadow_rows_for(capacity: int) -> int:
    """Rows of each shadow of a tier of ``capacity`` rows; 0: too few to tune it."""
    rows = min(SHADOW_ROWS, capacity // SHADOW_SHARE)
    return rows if rows >= MIN_SHADOW_ROWS else 0


def tuner_nbytes(capacity: int) -> int:
    """Bytes an ``AgeingTuner`` of a tier of ``capacity`` rows allocates (0: none is made)."""
    rows = shadow_rows_for(capacity)
    if rows == 0:
        return 0
    positions = 1 << (2 * rows - 1).bit_length()
    return len(RUNGS) * (rows * (8 + 8 + 16) + positions * (8 + 8))


class _Shadow(ctypes.Structure):
    """host_ageing.cpp's ``AgeingShadow``."""

    _fields_ = [
        ("slot_keys", _POINTER),
        ("scores", _POINTER),
        ("map_keys", _POINTER),
        ("map_slots", _POINTER),
        ("map_mask", _I64),
        ("heap", _POINTER),
        ("heap_size", _I64),
        ("capacity", _I64),
        ("used", _I64),
        ("increment", ctypes.c_double),
        ("growth", ctypes.c_double),
        ("hits", _I64),
    ]


class AgeingTuner:
    """The half-life a tier of ``capacity`` rows should age its LFU scores at, from its lookups
    (``observe``), on the tuned host build's ``library``."""

    def __init__(self, capacity: int, library: ctypes.CDLL) -> None:
        shadow_rows = shadow_rows_for(capacity)
        if not shadow_rows:
            raise ValueError(f"a tier of {capacity} rows is too small for shadow caches (shadow_rows_for)")
        self.capacity = capacity
        self.rate = shadow_rows / capacity
        self._threshold = min(1 << 53, math.ceil(self.rate * (1 << 53)))
        self._replay = typed(
            library.ageing_replay,
            _I64,
            [_POINTER, _POINTER, _I64, ctypes.c_uint64, _POINTER, _I64, ctypes.c_double, _POINTER],
        )
        positions = 1 << (2 * shadow_rows - 1).bit_length()
        self._arrays = []  # the shadows' memory, kept alive
        self._shadows = (_Shadow * len(RUNGS))()
        for shadow, rung in zip(self._shadows, RUNGS):
            arrays = (
                torch.full((shadow_rows,), -1, dtype=torch.int64),  # slot keys
                torch.zeros(shadow_rows, dtype=torch.float64),  # scores
                torch.full((positions,), -1, dtype=torch.int64),  # map keys
                torch.zeros(positions, dtype=torch.int64),  # map slots
                torch.zeros(2 * shadow_rows, dtype=torch.float64),  # heap: (score, slot), one a slot
            )
            self._arrays.append(arrays)
            slot_keys, scores, map_keys, map_slots, heap = arrays
            shadow.slot_keys, shadow.scores = slot_keys.data_ptr(), scores.data_ptr()
            shadow.map_keys, shadow.map_slots, shadow.map_mask = (
                map_keys.data_ptr(),
                map_slots.data_ptr(),
                positions - 1,
            )
            shadow.heap = heap.data_ptr()
            shadow.capacity, shadow.increment = shadow_rows, 1.0
            shadow.growth = 1.0 if math.isinf(rung) else 2.0 ** (1.0 / (rung * shadow_rows))
        self._memory = MEMORY * shadow_rows
        self.hits = np.zeros(len(RUNGS))  # each shadow's hits, fading (the native replay adds them)
        self._hits_address = self.hits.ctypes.data
        self.sampled = 0  # lookups sampled so far
        self.choice = START

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for arrays in self._arrays for array in arrays)

    @property
    def half_life(self) -> float:
        """The chosen half-life, in the tier's lookups (``inf``: plain LFU)."""
        return RUNGS[self.choice] * self.capacity

    def observe(self, keys: torch.Tensor, counts: torch.Tensor) -> bool:
        """Distinct ``keys`` (int64 CPU) were looked up ``counts`` times each; True if the choice
        changed."""
        keys, counts = keys.contiguous(), cpu_int64(counts)
        sampled = self._replay(keys.data_ptr(), counts.data_ptr(), keys.numel(), *self.replay_arguments())
        return self.replayed(sampled)

    def replay_arguments(self) -> tuple:
        """``ageing_replay``'s arguments after the keys, their counts and their number: for a native
        call that replays a batch as it looks it up (then given to ``replayed``)."""
        return self._threshold, ctypes.addressof(self._shadows), len(RUNGS), self._memory, self._hits_address

    def replayed(self, sampled: int) -> bool:
        """After a replay that sampled ``sampled`` lookups: True if the choice changed."""
        if sampled == 0:
            return False
        self.sampled += sampled
        best = int(self.hits.argmax())
        if self.sampled < self._memory or self.hits[best] <= self.hits[self.choice] * (1 + MARGIN):
            return False
        self.choice = best
        return True
