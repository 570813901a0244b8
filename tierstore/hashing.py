"""A well-mixed hash of int64 keys, shared by what splits keys by hash: the profiler's spatial
sample (``analysis.sampling``) and the ranks' ownership of rows (``nn.sharding``)."""

from __future__ import annotations

import numpy as np

HASH_SPACE = 2**32


def id_hash(keys: np.ndarray) -> np.ndarray:
    """A well-mixed hash of int64 ``keys`` (splitmix64's finaliser): uint64 in ``[0, HASH_SPACE)``."""
    z = keys.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) >> np.uint64(32)
