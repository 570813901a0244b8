"""Synthetic id workloads with the skew of real click logs, for examples, benchmarks and tests.

``ZipfIds(ids, alpha)`` draws ids from a Zipf distribution truncated to ``ids`` ids: the id of
popularity rank r (1-based) has probability proportional to ``r ** -alpha``, r = 1..ids. Ranks map
to ids through a fixed random permutation, so hot ids are spread over the id space as hashed ids
are. (``numpy``'s ``zipf`` is unbounded: folding its tail into ``ids`` with a modulo, as is common,
turns about half the draws at alpha 1.05 into uniform noise and hides the skew.)
"""

from __future__ import annotations

import numpy as np


class ZipfIds:
    """Sampler of int64 ids in ``[0, ids)``, Zipf(``alpha``) over popularity ranks; ``seed`` fixes
    both the rank -> id permutation and the draws. Memory: 16 bytes per id."""

    def __init__(self, ids: int, alpha: float, seed: int = 0) -> None:
        if ids <= 0:
            raise ValueError(f"ids must be positive, got {ids}")
        if alpha <= 0:
            raise ValueError(f"alpha must be positive, got {alpha}")
        self.ids, self.alpha = ids, alpha
        self._rng = np.random.default_rng(seed)
        cdf = np.cumsum(np.arange(1, ids + 1, dtype=np.float64) ** -alpha)
        self._cdf = cdf / cdf[-1]
        self._id_of_rank = self._rng.permutation(ids)

    def ranks(self, size) -> np.ndarray:
        """0-based popularity ranks (int64, shape ``size``)."""
        draws = self._rng.random(size)
        return np.minimum(np.searchsorted(self._cdf, draws, side="right"), self.ids - 1).astype(np.int64)

    def __call__(self, size) -> np.ndarray:
        """Ids (int64, shape ``size``)."""
        return self._id_of_rank[self.ranks(size)]
