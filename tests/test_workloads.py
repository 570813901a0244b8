"""The synthetic Zipf workload against the distribution's own probabilities."""

import numpy as np
import pytest

from tierstore.workloads import ZipfIds


def test_zipf_ids_follow_the_truncated_distribution():
    sampler = ZipfIds(1000, 1.05, seed=3)
    ranks = sampler.ranks(400_000)
    assert ranks.min() >= 0 and ranks.max() < 1000
    weights = np.arange(1, 1001, dtype=np.float64) ** -1.05
    expected = weights / weights.sum()
    observed = np.bincount(ranks, minlength=1000) / ranks.size
    np.testing.assert_allclose(observed[:10], expected[:10], rtol=0.03)  # the head, rank by rank
    assert abs(observed[:100].sum() - expected[:100].sum()) < 0.005  # the top 10% of ids


def test_zipf_ids_are_a_fixed_permutation_of_ranks_and_reproducible():
    first, second = ZipfIds(500, 1.2, seed=1), ZipfIds(500, 1.2, seed=1)
    assert np.array_equal(first(1000), second(1000))
    hottest = np.bincount(ZipfIds(500, 1.2, seed=1)(50_000), minlength=500).argmax()
    assert hottest == first._id_of_rank[0]


@pytest.mark.parametrize("ids, alpha", [(0, 1.0), (10, 0.0)])
def test_zipf_ids_refuse_bad_parameters(ids, alpha):
    with pytest.raises(ValueError):
        ZipfIds(ids, alpha)
