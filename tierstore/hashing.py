"""Well-mixed hashes of int64 keys: ``id_hash``, shared by what splits keys by hash (the profiler's
spatial sample, ``analysis.sampling``, and the ranks' ownership of rows, ``nn.sharding``), and
``key_mix`` / ``key_unmix``, the kernels' ``mix`` and its inverse (the log index's sealed runs are
ordered by it, ``tiers.cold.log_index``)."""

from __future__ import annotations

import numpy as np

HASH_SPACE = 2**32


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
_SHIFTS = (30, 27, 31)


def id_hash(keys: np.ndarray) -> np.ndarray:
    """A well-mixed hash of int64 ``keys`` (splitmix64's finaliser): uint64 in ``[0, HASH_SPACE)``."""
    return key_mix(keys.astype(np.uint64) + _GOLDEN) >> np.uint64(32)


def key_mix(keys: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of ``keys`` (int64 or uint64) as uint64, bit for bit the kernels' ``mix``
    (``cuda/embedding_cache.cu``): a bijection of 64-bit values, so equal mixes mean equal keys."""
    z = keys.astype(np.uint64)
    for shift, multiplier in zip(_SHIFTS, _MULTIPLIERS):
        z = (z ^ (z >> np.uint64(shift))) * np.uint64(multiplier)
    return z ^ (z >> np.uint64(_SHIFTS[2]))


def key_unmix(hashes: np.ndarray) -> np.ndarray:
    """The int64 keys whose ``key_mix`` are ``hashes`` (uint64): each step of the mix undone, last first."""
    z = _unshift(hashes.astype(np.uint64), _SHIFTS[2])
    for shift, multiplier in zip(reversed(_SHIFTS[:2]), reversed(_MULTIPLIERS)):
        z = _unshift(z * np.uint64(pow(multiplier, -1, 2**64)), shift)
    return z.view(np.int64)


def _unshift(z: np.ndarray, shift: int) -> np.ndarray:
    """x where ``z = x ^ (x >> shift)`` (uint64)."""
    x, part = z.copy(), z >> np.uint64(shift)
    for _ in range(0, 64, shift):
        x ^= part
        part >>= np.uint64(shift)
    return x
