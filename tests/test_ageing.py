"""LFU's ageing chosen online (``tiers.ageing``): the native shadow caches count the hits of a
Python LFU replayed access by access (the oracle); the default follows the better of plain LFU
and aged LFU on a steady and on a drifting trace; small tiers get no shadows; the budget counts
them."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore import TieredEmbeddingBag, TieredStore
from tierstore.analysis.hit_rates import run_store
from tierstore.analysis.traces import load_trace
from tierstore.kernels.host import host_step_library
from tierstore.tiers.ageing import (
    MEMORY,
    MIN_SHADOW_ROWS,
    RUNGS,
    SHADOW_ROWS,
    SHADOW_SHARE,
    AgeingTuner,
    shadow_rows_for,
    tuner_nbytes,
)


class LfuInPython:
    """An LFU cache with ageing (an access adds ``increment``, which grows by ``growth`` per
    access); a batch's distinct ids each looked up ``count`` times, the first lookup of a miss
    bringing the row in; the victim is the lowest (score, slot)."""

    def __init__(self, capacity, growth):
        self.capacity, self.growth = capacity, growth
        self.slot_of, self.slot_keys, self.scores, self.increment = {}, [], [], 1.0

    def hits(self, keys, counts):
        hits = 0
        for key, count in zip(keys, counts):
            if key in self.slot_of:
                slot = self.slot_of[key]
                hits += count
            else:
                hits += count - 1
                if len(self.slot_keys) < self.capacity:
                    slot = len(self.slot_keys)
                    self.slot_keys.append(key)
                    self.scores.append(0.0)
                else:
                    slot = min(range(self.capacity), key=lambda s: (self.scores[s], s))
                    del self.slot_of[self.slot_keys[slot]]
                    self.slot_keys[slot], self.scores[slot] = key, 0.0
                self.slot_of[key] = slot
            self.scores[slot] += count * self.increment
            self.increment *= self.growth**count
        return hits


@pytest.fixture(scope="module")
def library():
    built = host_step_library()
    assert built is not None  # g++ is here: the tuned host build must build
    return built


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 80), st.integers(1, 3)), max_size=30, unique_by=lambda p: p[0]),
        min_size=1,
        max_size=20,
    )
)
def test_the_shadow_caches_count_the_hits_of_lfu_at_each_ageing(library, batches):
    shadow_rows = 20
    tuner = AgeingTuner(SHADOW_SHARE * shadow_rows, library)
    assert tuner.rate == 1 / SHADOW_SHARE
    tuner._threshold = 1 << 53  # every id sampled
    oracles = [
        LfuInPython(shadow_rows, 1.0 if math.isinf(rung) else 2.0 ** (1.0 / (rung * shadow_rows)))
        for rung in RUNGS
    ]
    expected, sampled = np.zeros(len(RUNGS)), 0
    for batch in batches:
        keys, counts = [key for key, _ in batch], [count for _, count in batch]
        tuner.observe(torch.tensor(keys, dtype=torch.int64), torch.tensor(counts, dtype=torch.int64))
        if sum(counts):
            fresh = [oracle.hits(keys, counts) for oracle in oracles]
            expected = expected * 0.5 ** (sum(counts) / (MEMORY * shadow_rows)) + fresh
            sampled += sum(counts)
    assert tuner.sampled == sampled
    assert np.allclose(tuner.hits, expected, rtol=1e-12, atol=0)


def hit_rate(trace, rows, half_life=None):
    """The hit rate of a store replaying ``trace`` (LFU aged at ``half_life``; None: the default)."""
    return run_store(trace, rows, rows // 8, 4, "mmap", progress=False, half_life=half_life)["hit_rate"]


@pytest.mark.parametrize(
    "spec",
    [
        "zipf:alpha=0.9,n=200000,length=300000,seed=2",  # steady: plain LFU beats aged
        "drift:n=100000,hot=1000,period=20000,length=200000",  # drifting: aged beats plain
    ],
)
def test_the_default_follows_the_better_ageing(spec):
    trace = load_trace(spec)
    rows = 2000
    plain = hit_rate(trace, rows, math.inf)
    aged = hit_rate(trace, rows, 4.0 * rows)
    adaptive = hit_rate(trace, rows)
    assert abs(plain - aged) > 0.01  # the traces tell the two apart
    assert adaptive >= max(plain, aged) - 0.005  # measured: 0.445 vs 0.429 / 0.414; 0.952 vs 0.830 / 0.952


def test_small_tiers_get_no_shadows_and_the_budget_counts_them():
    smallest = MIN_SHADOW_ROWS * SHADOW_SHARE  # the smallest tier with shadows
    assert shadow_rows_for(smallest - 1) == 0 and tuner_nbytes(smallest - 1) == 0
    assert shadow_rows_for(SHADOW_SHARE * 100) == 100 and shadow_rows_for(10**8) == SHADOW_ROWS
    with TieredStore(None, dim=8, host_cache=smallest - 1) as store:
        assert store.stack.top.policy.tuner is None
    with TieredStore(None, dim=8, host_cache="2MiB") as store:
        top = store.stack.top
        assert top.policy.tuner is not None and top.policy.tuner.nbytes == tuner_nbytes(top.capacity)
        assert top.nbytes == top.nbytes_for(top.capacity, 8, torch.float32, top.backend)
    with TieredStore(None, dim=8, host_cache="2MiB", half_life=1000.0) as store:
        assert store.stack.top.policy.tuner is None  # a half-life given is kept


def first_appearances(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct ids of ``ids`` in order of first appearance, and how often each appears."""
    unique, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    first = torch.full((unique.numel(),), ids.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(ids.numel()), "amin")
    order = torch.argsort(first)
    return unique[order], counts[order]


def test_a_training_lookup_replays_its_batch_as_observe_does_beside_the_scan_or_after(library, tmp_path):
    """The native training lookup replays its batch through the shadow caches within its call:
    beside the victims' scan where one runs on one thread (a batch whose victims outnumber LFU's
    pool), else once the victims are taken from the pool. Either way the shadows count what
    ``AgeingTuner.observe`` counts for the batch's distinct ids in their order."""
    table = TieredEmbeddingBag(20_000, 8, path=tmp_path / "t", mode="sum", host_cache=4096)
    policy = table.store.stack.top.policy
    twin = AgeingTuner(table.store.stack.top.capacity, library)
    policy.tuner._threshold = twin._threshold = 1 << 53  # every id sampled
    generator = torch.Generator().manual_seed(0)
    scanned = pooled = 0
    for step in range(16):
        size = 3000 if step % 4 < 2 else 40  # victims past the pool (128 slots), or few: a scan leaves
        # a pool after a batch of few victims, and the next takes its victims from it
        ids = torch.randint(12_000, (size,), generator=generator)
        scans = policy.scans
        table(ids, torch.arange(0, size, 4)).sum().backward()
        if table.store.stack.top.stats.evictions:
            scanned += policy.scans > scans
            pooled += policy.scans == scans
        twin.observe(*first_appearances(ids))
        assert np.array_equal(policy.tuner.hits, twin.hits) and policy.tuner.sampled == twin.sampled
    assert scanned >= 4 and pooled >= 2  # both placements ran
    table.close()
