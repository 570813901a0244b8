import cachetools
import numpy as np
import pytest
import torch

from tierstore.errors import CacheCapacityError
from tierstore.tiers import RowCache, Rows


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


def test_lfu_matches_cachetools_reference_hit_for_hit_on_a_zipf_trace():
    # A negligible ageing (half-life 1e6 accesses) breaks ties between equal counts towards the
    # most recently used row, as cachetools.LFUCache does; otherwise this is plain LFU.
    rng = np.random.default_rng(0)
    trace = (rng.zipf(1.2, 20000) % 2000).tolist()
    ours = RowCache("host", 100, 2, torch.float32, half_life=1e6, spare_share=0)  # one victim per miss
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


def test_a_full_cache_evicts_a_spare_share_at_once_and_fills_the_spare_slots_without_evicting():
    cache = RowCache("host", 64, 2, torch.float32, half_life=float("inf"), spare_share=1 / 8)
    slots, _ = cache.admit(rows_for(range(64)))
    cache.touch(slots, torch.arange(1, 65))  # key k was looked up k + 1 times
    protected = cache.find(torch.tensor([0, 1]))  # the two coldest rows, needed by this batch
    _, evicted = cache.admit(rows_for([100]), protected=protected)
    assert sorted(evicted.keys.tolist()) == list(range(2, 11))  # the one needed + 8 spare, lowest first
    assert torch.equal(evicted.rows[:, 0], evicted.keys.float())  # handed down with their rows
    assert len(cache) == 64 - 8 and cache.stats.evictions == 9
    for key in range(101, 109):  # the spare slots take the next rows: nothing more is evicted
        _, evicted = cache.admit(rows_for([key]))
        assert len(evicted) == 0
    assert len(cache) == 64
    found = cache.find(torch.tensor([0, 1, *range(11, 64), *range(100, 109)]))
    assert bool((found >= 0).all()) and bool((cache.find(torch.arange(2, 11)) < 0).all())


def test_spare_victims_never_exceed_what_can_be_evicted():
    cache = RowCache("host", 16, 2, torch.float32, spare_share=1 / 2)
    cache.admit(rows_for(range(16)))
    protected = cache.find(torch.arange(12))  # 4 evictable rows, 1 needed, 8 spare wanted
    _, evicted = cache.admit(rows_for([99]), protected=protected)
    assert sorted(evicted.keys.tolist()) == [12, 13, 14, 15]
    assert len(cache) == 13 and bool((cache.find(torch.arange(12)) >= 0).all())
