import cachetools
import numpy as np
import pytest
import torch
from host_kernels import parallel_host_kernels, shared_host_kernels
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.errors import CacheCapacityError
from tierstore.kernels.cache_passes import cache_passes_of
from tierstore.kernels.host import openmp_runtime
from tierstore.tiers import RowCache, Rows, policies
from tierstore.tiers.backends import KernelRows, TorchRows
from tierstore.tiers.kernel_hash_table import MAX_LOAD, SPARSE_LOAD
from tierstore.tiers.policies import LfuWithAgeing


def rows_for(keys, width=2):
    keys = torch.as_tensor(keys, dtype=torch.int64)
    return Rows(
        keys,
        keys[:, None].float().repeat(1, width),
        torch.zeros(keys.numel(), dtype=torch.bool),
        torch.zeros(keys.numel(), dtype=torch.bool),
    )


def access(cache, key):
    """One access to ``key``: hit or admit (single-key LFU reference semantics). Returns hit."""
    slots = cache.find(torch.tensor([key]))
    hit = bool(slots[0] >= 0)
    if not hit:
        slots, _ = cache.admit(rows_for([key]))
    cache.touch(slots)
    return hit


def test_lfu_evicts_the_least_frequently_used_row():
    cache = RowCache("host", 3, 2, torch.float32, half_life=float("inf"))
    for key, times in ((1, 5), (2, 1), (3, 3)):
        for _ in range(times):
            access(cache, key)
    _, evicted = cache.admit(rows_for([4]))
    assert evicted.keys.tolist() == [2]
    assert torch.equal(evicted.rows, torch.tensor([[2.0, 2.0]]))


class ExactLfuWithNegligibleAgeing(LfuWithAgeing):
    """Half-life 1e6 accesses; a scan of every slot at each eviction (no pool)."""

    def __init__(self, capacity, device, backend):
        super().__init__(capacity, device, backend, half_life=1e6, pool_share=0)


def test_lfu_matches_cachetools_reference_hit_for_hit_on_a_zipf_trace():
    # A negligible ageing (half-life 1e6 accesses) breaks ties between equal counts towards the
    # most recently used row, as cachetools.LFUCache does; otherwise this is plain LFU.
    rng = np.random.default_rng(0)
    trace = (rng.zipf(1.2, 20000) % 2000).tolist()
    ours = RowCache("host", 100, 2, torch.float32, policy=ExactLfuWithNegligibleAgeing)
    reference = cachetools.LFUCache(maxsize=100)
    our_hits = [access(ours, key) for key in trace]
    reference_hits = []
    for key in trace:
        reference_hits.append(key in reference)
        if key in reference:
            reference[key]  # an access
        else:
            reference[key] = key
    assert sum(reference_hits) > 0.5 * len(trace)
    assert our_hits == reference_hits


def test_ageing_follows_a_shifted_distribution():
    def hot_set_after_shift(half_life):
        cache = RowCache("host", 10, 2, torch.float32, half_life=half_life)
        for _ in range(200):
            for key in range(10):
                access(cache, key)  # old hot set: 2000 accesses
        for _ in range(100):
            for key in range(100, 110):
                access(cache, key)  # new hot set: 1000 accesses
        return set(cache.slot_keys.tolist())

    assert hot_set_after_shift(half_life=200) == set(range(100, 110))
    assert hot_set_after_shift(half_life=float("inf")) != set(range(100, 110))


def test_protected_slots_are_never_victims():
    cache = RowCache("host", 4, 2, torch.float32)
    slots, _ = cache.admit(rows_for([1, 2, 3, 4]))
    cache.touch(slots[2:], torch.tensor([9.0, 9.0]))  # 3 and 4 are hot; 1 and 2 cold but protected
    _, evicted = cache.admit(rows_for([5, 6]), protected=slots[:2])
    assert sorted(evicted.keys.tolist()) == [3, 4]
    with pytest.raises(CacheCapacityError, match="holds 4 rows"):
        cache.admit(rows_for([7, 8, 9]), protected=cache.find(torch.tensor([1, 2])))


def test_take_removes_rows_and_frees_slots():
    cache = RowCache("host", 2, 2, torch.float32)
    cache.admit(rows_for([7, 8]))
    found, taken = cache.take(torch.tensor([8, 9]))
    assert found.tolist() == [True, False] and taken.keys.tolist() == [8]
    assert len(cache) == 1 and cache.find(torch.tensor([8])).item() == -1
    _, evicted = cache.admit(rows_for([10]))
    assert len(evicted) == 0  # the freed slot is reused, nothing evicted


def test_byte_accounting_is_exact():
    cache = RowCache("host", 1000, 64, torch.float32)
    assert cache.nbytes == RowCache.nbytes_for(1000, 64, torch.float32)


def test_a_small_host_tiers_index_is_kept_a_quarter_full_and_a_larger_ones_half():
    """On the tuned host build a tier whose index fits in a core's cache at a quarter load gets that
    load (its erases and probes are shorter there); a larger tier's index stays at most half full,
    and a tier that grows takes its full size's load from the start. Its bytes are counted as made,
    and the two sizings meet at the boundary."""
    rows = KernelRows(parallel_host_kernels(), "openmp")
    window = cache_passes_of(rows.kernels).window_positions
    small, large = window // 4, window // 4 + 1  # the last sparse tier and the first that is not
    for capacity, load in ((1000, SPARSE_LOAD), (small, SPARSE_LOAD), (large, MAX_LOAD)):
        cache = RowCache("host", capacity, 4, torch.float32, backend=rows)
        assert cache.index.max_load == load
        assert capacity <= load * cache.index.keys.numel() < 2 * capacity
        assert cache.nbytes == RowCache.nbytes_for(capacity, 4, torch.float32, rows)
    assert rows.index_nbytes(small) == rows.index_nbytes(large)
    growing = RowCache("host", 1000, 4, torch.float32, backend=rows, grows_to=large)
    assert growing.index.max_load == MAX_LOAD
    growing.grow(large)
    assert growing.nbytes == RowCache.nbytes_for(large, 4, torch.float32, rows)
    gpu_loops = KernelRows(shared_host_kernels(), "the GPU's loops")  # the GPU build's sizing
    assert RowCache("host", 1000, 4, torch.float32, backend=gpu_loops).index.max_load == MAX_LOAD


@pytest.mark.parametrize("backend", ["torch", "openmp"])
@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([1e9, 50.0]))
def test_lfu_victims_from_its_pool_score_no_more_than_any_row_untouched_since_the_scan(
    backend, seed, half_life
):
    """Victims come from a pool ranked by the last scan of every slot; whatever was touched,
    filled or emptied in between, a victim must score at most every row (not protected, not a
    victim) left as it was at that scan, and never be a protected or an empty slot. As in a
    RowCache, a batch's protected rows are touched after its victims are chosen."""
    rng = np.random.default_rng(seed)
    capacity = 320  # a pool of 10
    rows = TorchRows() if backend == "torch" else KernelRows(parallel_host_kernels(), "openmp")
    policy = LfuWithAgeing(capacity, torch.device("cpu"), rows, half_life)
    slot_keys = torch.arange(capacity)
    changed = torch.zeros(capacity, dtype=torch.bool)  # touched, filled or emptied since the last scan
    for _ in range(60):
        occupied = (slot_keys >= 0).nonzero().squeeze(1)
        touched = occupied[torch.from_numpy(rng.integers(0, occupied.numel(), 30))]
        policy.touch(touched, torch.from_numpy(rng.integers(1, 4, 30)))
        changed[touched] = True
        if rng.random() < 0.2:  # rows taken up a tier: their slots empty, then refilled later
            emptied = occupied[torch.from_numpy(rng.choice(occupied.numel(), 3, replace=False))]
            slot_keys[emptied] = -1
            policy.reset(emptied)
            changed[emptied] = True
        protected = occupied[torch.from_numpy(rng.choice(occupied.numel(), 20, replace=False))]
        count = int(rng.integers(1, 9))
        scans = policy.scans
        pins = torch.zeros(capacity, dtype=torch.uint8)
        pins[protected] = 1
        victims = policy.victims(count, slot_keys, pins)
        if policy.scans > scans:
            changed[:] = False
        unchanged = ~changed & (slot_keys >= 0)
        unchanged[victims] = False
        unchanged[protected] = False
        assert victims.numel() == count and bool((slot_keys[victims] >= 0).all())
        assert not bool(torch.isin(victims, protected).any())
        assert float(policy.score[victims].max()) <= float(policy.score[unchanged].min())
        refill = (slot_keys < 0).nonzero().squeeze(1)
        slot_keys[victims] = 1000 + victims  # new rows in the victims' slots and the emptied ones
        slot_keys[refill] = 2000 + refill
        policy.reset(torch.cat([victims, refill]))
        policy.touch(torch.cat([victims, protected]), None)  # the batch's rows: as RowCache does
        changed[victims] = changed[refill] = changed[protected] = True
    assert policy.scans < 40  # the pool served many batches without a scan


@pytest.mark.parametrize("backend", ["torch", "openmp"])
def test_a_scan_for_more_victims_than_lfus_pool_holds_ranks_no_pool(backend):
    """A scan ranks a pool past its victims, for the next batches' victims; where one batch's victims
    outnumber the pool, such a pool would serve no batch like it, and none is ranked: the victims are
    the lowest-scored slots all the same, and a smaller batch after it scans anew and leaves a pool."""
    capacity = 320  # a pool of 10
    rows = TorchRows() if backend == "torch" else KernelRows(parallel_host_kernels(), "openmp")
    policy = LfuWithAgeing(capacity, torch.device("cpu"), rows, 1e9)
    slot_keys, pins = torch.arange(capacity), torch.zeros(capacity, dtype=torch.uint8)
    counts = torch.randperm(capacity, generator=torch.Generator().manual_seed(0)) + 1  # distinct scores
    policy.touch(torch.arange(capacity), counts)
    ranked = torch.argsort(policy.score).tolist()
    victims = policy.victims(12, slot_keys, pins)
    assert sorted(victims.tolist()) == sorted(ranked[:12]) and policy._pool.numel() == 0
    scans = policy.scans
    victims = policy.victims(4, slot_keys, pins)
    assert sorted(victims.tolist()) == sorted(ranked[:4]) and policy.scans == scans + 1
    assert policy._pool.tolist() == ranked[4:14]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=300), st.floats(1e-3, 1e30))
def test_victims_are_ranked_as_a_stable_sort_ranks_them(levels, scale):
    """The LFU pool's ranking (one sort of bits and positions) is torch's stable argsort, ties included."""
    scores = torch.tensor(levels, dtype=torch.float32) * scale
    assert torch.equal(policies._ascending(scores), torch.argsort(scores, stable=True))


@pytest.mark.parametrize("capacity", [100, 5000, 70_000])
@pytest.mark.parametrize(
    "scores_are", ["zipf counts", "ties", "a tie group in a long tail", "low where sampled"]
)
def test_the_native_scan_ranks_the_lowest_evictable_slots_as_a_stable_sort(capacity, scores_are):
    """The host build's scan (a sample bounds the scores worth ranking in a large tier) returns
    what a stable sort of every evictable slot's score returns, whatever misleads the sample."""
    rng = np.random.default_rng(capacity)
    if scores_are == "zipf counts":
        scores = torch.from_numpy(rng.zipf(1.2, capacity).astype(np.float32))
    elif scores_are == "ties":
        scores = torch.from_numpy(rng.integers(0, 3, capacity).astype(np.float32))
    elif scores_are == "a tie group in a long tail":  # the rows one batch admitted, as LFU scores them
        scores = torch.from_numpy((rng.pareto(1.1, capacity) * 100 + 1).astype(np.float32))
        scores[torch.from_numpy(rng.random(capacity) < 0.3)] = 7.0
    else:  # "sampled low": the sampled slots (every 64th) score lowest, their bound covering too few
        scores = torch.full((capacity,), 5.0)
        scores[::64] = 1.0
    slot_keys = torch.from_numpy(np.where(rng.random(capacity) < 0.1, -1, np.arange(capacity)))
    pins = torch.from_numpy((rng.random(capacity) < 0.1).astype(np.uint8))
    evictable = ((slot_keys >= 0) & (pins == 0)).nonzero().squeeze(1)
    expected = evictable[torch.argsort(scores[evictable], stable=True)]
    passes = cache_passes_of(parallel_host_kernels())
    for count in (1, 7, capacity // 50, capacity // 3, capacity):
        assert torch.equal(passes.lowest_slots(scores, slot_keys, pins, count), expected[:count])
        for head in (1, count // 2, count):  # LFU's victims first, in no order; the pool sorted
            ranked = passes.lowest_slots(scores, slot_keys, pins, count, head)
            assert torch.equal(ranked[:head].sort().values, expected[:head].sort().values)
            assert torch.equal(ranked[head:], expected[head:count])


@pytest.mark.parametrize("capacity, draws, ids, exponent", [(64, 40, 300, 1.3), (4096, 3000, 20000, 1.05)])
def test_the_native_resolve_finds_touches_and_counts_as_find_and_touch(capacity, draws, ids, exponent):
    """``resolve`` + ``touch_admitted`` (the tuned host build's one pass) leave the same slots, LFU
    scores (bit for bit, ageing renormalised on the way) and counters as ``find`` + ``touch``: on
    one thread (a few keys) and on the team (each thread listing its share's hits and misses)."""
    rng = np.random.default_rng(3)
    rows = KernelRows(parallel_host_kernels(), "openmp")
    fast, reference = (
        RowCache("host", capacity, 2, torch.float32, backend=rows, half_life=40.0) for _ in range(2)
    )
    for _ in range(60):
        keys = torch.from_numpy(np.unique(rng.zipf(exponent, draws) % ids)).to(torch.int64)
        counts = torch.from_numpy(rng.integers(1, 4, keys.numel()))
        slots = reference.find(keys)
        hit = slots >= 0
        slots[~hit] = reference.admit(rows_for(keys[~hit]), slots[hit])[0]
        reference.touch(slots, counts, ~hit)
        resolved, hit_slots, missed, lookups = fast.resolve(keys, counts)
        assert lookups == int(counts.sum())
        assert torch.equal(hit_slots, resolved[resolved >= 0]) and torch.equal(missed, (~hit).nonzero()[:, 0])
        admitted, _ = fast.admit(rows_for(keys[missed]), hit_slots)
        resolved[missed] = admitted
        fast.touch_admitted(admitted, counts[missed], lookups)
        assert torch.equal(resolved, slots)
        assert torch.equal(fast.policy.score, reference.policy.score)
        assert fast.stats == reference.stats
    assert fast.stats.evictions > 100 and fast.policy.increment < 2.0**20


def test_pins_on_the_tuned_host_build_count_as_the_torch_backends():
    """``add_pins`` (one thread on the tuned build) raises and lowers counts as torch ops do,
    wrapping as uint8 where the undo expects it."""
    slots = torch.tensor([5, 0, 63, 17])
    ours, expected = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    ours[17] = expected[17] = 255
    rows = KernelRows(parallel_host_kernels(), "openmp")
    for delta in (1, 1, -1):
        rows.add_pins(ours, slots, delta)
        TorchRows().add_pins(expected, slots, delta)
        assert torch.equal(ours, expected)
    assert ours[5] == 1 and ours[17] == 0


def test_resolve_is_left_to_find_and_touch_without_the_tuned_host_build():
    cache = RowCache("host", 8, 2, torch.float32, backend=KernelRows(shared_host_kernels(), "openmp"))
    assert cache.resolve(torch.arange(3), torch.ones(3, dtype=torch.int64)) is None
    assert RowCache("host", 8, 2, torch.float32).resolve(torch.arange(3), torch.ones(3)) is None


def test_the_native_scan_does_not_depend_on_the_thread_count():
    """A large tier's scan runs on the OpenMP team (its slots in runs, one a thread): the victims
    come in the same order, the pool the same, at any thread count."""
    runtime = openmp_runtime()
    if runtime is None:
        pytest.skip("the OpenMP runtime (libgomp) is not loaded: one thread count only")
    rng = np.random.default_rng(9)
    capacity = 200_000
    scores = torch.from_numpy(rng.zipf(1.2, capacity).astype(np.float32))
    slot_keys = torch.from_numpy(np.where(rng.random(capacity) < 0.1, -1, np.arange(capacity)))
    pins = torch.from_numpy((rng.random(capacity) < 0.1).astype(np.uint8))
    passes = cache_passes_of(parallel_host_kernels())
    threads, ranked = runtime.omp_get_max_threads(), []
    try:
        for count in (1, 2, 3):
            runtime.omp_set_num_threads(count)
            ranked.append(passes.lowest_slots(scores, slot_keys, pins, 6_000, 2_000))
    finally:
        runtime.omp_set_num_threads(threads)
    assert all(torch.equal(ranked[0], other) for other in ranked[1:])
