"""Deterministic initial rows: a pure function of (id, seed, column).

Every value comes from a counter-based hash (SplitMix64's finaliser) of the id, the seed and the
column, so a row is the same whatever the cache sizes, batch order, batch composition or device.
Weights default to ``uniform(-1/sqrt(dim), 1/sqrt(dim))``: the scale FBGEMM's table-batched
embeddings and TorchRec use for their default initialisation (uniform in ±sqrt(1/num_embeddings)
is torch's ``reset_parameters`` for ``nn.Linear``; for a table that grows without bound
``num_embeddings`` is unknown, so ``dim`` sets the scale). Optimizer state starts at zero.
"""

from __future__ import annotations

import functools
import math

import torch

from .kernels.native_types import InitialRows
from .kernels.step_passes import host_passes

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def _logical_shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x >>> bits`` for int64 tensors viewed as uint64."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser on int64 tensors (wrapping arithmetic, same bits on every device)."""
    x = x + _GOLDEN
    x = (x ^ _logical_shift_right(x, 30)) * _MIX1
    x = (x ^ _logical_shift_right(x, 27)) * _MIX2
    return x ^ _logical_shift_right(x, 31)


@functools.lru_cache(maxsize=64)
def _seed_hash(seed: int) -> int:
    """``splitmix64(seed)`` as a uint64 (the stream every id's values start from)."""
    return int(splitmix64(torch.tensor(seed))) & ((1 << 64) - 1)


def native_initial_rows(dim: int, seed: int) -> InitialRows:
    """``initial_rows``' arguments as the host build's native admission takes them."""
    return InitialRows(dim, _seed_hash(seed), 1.0 / math.sqrt(dim) if dim else 0.0)


def initial_weights(ids: torch.Tensor, dim: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Initial weights for ``ids`` (int64 [N]) -> ``[N, dim]`` of ``dtype`` on ``ids.device``.

    Uniform in ``[-1/sqrt(dim), 1/sqrt(dim))``, drawn from 53 hashed bits per value.
    """
    unit = unit_draws(ids, dim, splitmix64(torch.tensor(seed)))
    bound = 1.0 / math.sqrt(dim)
    return ((2.0 * unit - 1.0) * bound).to(dtype)


def unit_draws(ids: torch.Tensor, columns: int, stream: torch.Tensor) -> torch.Tensor:
    """``[N, columns]`` float64 draws in [0, 1) for ``ids`` (int64 [N]), from 53 hashed bits of
    (id, ``stream``: an int64 0-d tensor naming the draws' purpose, column), on ``ids.device``."""
    column = torch.arange(columns, dtype=torch.int64, device=ids.device)
    start = splitmix64(ids.to(torch.int64) * 0x5851F42D4C957F2D + stream.to(ids.device))
    bits = splitmix64(start[:, None] + column[None, :] * _GOLDEN)
    return _logical_shift_right(bits, 11).to(torch.float64) * 2.0**-53


def initial_rows(
    ids: torch.Tensor, dim: int, state_width: int, seed: int, dtype: torch.dtype
) -> torch.Tensor:
    """Initial stored rows ``[N, dim + state_width]``: initial weights, then zero optimizer state.
    float32 rows on the CPU come from the host build's native pass (the same bits), where it is
    built; ``reference_initial_rows`` is the torch form everywhere."""
    if ids.device.type == "cpu" and dtype == torch.float32 and ids.numel() and dim:
        passes = host_passes()
        if passes is not None:
            return passes.initial_rows(ids.to(torch.int64), dim, state_width, _seed_hash(seed))
    return reference_initial_rows(ids, dim, state_width, seed, dtype)


def reference_initial_rows(
    ids: torch.Tensor, dim: int, state_width: int, seed: int, dtype: torch.dtype
) -> torch.Tensor:
    """``initial_rows`` in torch ops, on any device and dtype."""
    rows = torch.zeros(ids.numel(), dim + state_width, dtype=dtype, device=ids.device)
    rows[:, :dim] = initial_weights(ids, dim, seed, dtype)
    return rows
