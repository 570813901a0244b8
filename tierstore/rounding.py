"""Stochastic rounding of float32 values to float16/bfloat16, as FBGEMM offers for 16-bit weights.

A value between two neighbouring 16-bit numbers rounds up with probability equal to its distance
from the lower one over their gap, so the rounding is unbiased: many small updates add up where
rounding to nearest would drop every one smaller than half a gap. The draws are a pure function of
(id, column, step) (``initializer.unit_draws``), so training stays bit-identical from run to run and
whatever the cache sizes or batch order.
"""

from __future__ import annotations

import torch

from .initializer import splitmix64, unit_draws

_ROUNDING_STREAM = 0x524F554E44  # keeps these draws apart from the initial rows' (seeded) ones


def rounding_stream(step: int) -> int:
    """The draws' stream of update ``step`` (an int64, as the kernels' ``stochastically`` takes it)."""
    return int(splitmix64(torch.tensor(step, dtype=torch.int64) + _ROUNDING_STREAM))


def stochastically_rounded(
    values: torch.Tensor, dtype: torch.dtype, keys: torch.Tensor, step: int
) -> torch.Tensor:
    """``values [N, D]`` (float32) rounded to ``dtype`` stochastically, row i drawing by ``keys[i]``
    and the update ``step``. Values ``dtype`` holds exactly, and non-finite ones, round to nearest."""
    nearest = values.to(dtype)
    toward = torch.where(nearest.float() > values, float("-inf"), float("inf")).to(dtype)
    neighbour = torch.nextafter(nearest, toward)  # the 16-bit number on values' other side
    low, high = torch.minimum(nearest, neighbour), torch.maximum(nearest, neighbour)
    gap = high.double() - low.double()
    up = (values.double() - low.double()) / gap  # the chance of rounding up
    stream = torch.tensor(rounding_stream(step), dtype=torch.int64)
    draws = unit_draws(keys, values.shape[1], stream).to(values.device)
    rounded = torch.where(draws < up, high, low)
    exact = (nearest.float() == values) | ~torch.isfinite(values) | ~torch.isfinite(gap)
    return torch.where(exact, nearest, rounded)
