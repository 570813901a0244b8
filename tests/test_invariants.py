"""DESIGN.md's invariants 1, 2, 3, 5 and 6, one named test each (4 belongs to training, issue 3;
3's crash half lives in test_crash_safety.py)."""

import pytest
import torch
from helpers import initial

from tierstore import CacheCapacityError, TieredStore, initial_weights


def tier_of(store, id_):
    for cache in store.stack.caches:
        if cache.find(torch.tensor([id_])).item() >= 0:
            return cache.name
    return "cold"


def test_invariant1_lookup_returns_newest_value_whatever_tier_holds_it(backend, store_path):
    store = TieredStore(store_path, dim=4, backend=backend, host_cache=2, device_cache=2)
    newest = torch.full((1, 4), 7.0)
    store.put([0], newest)
    tiers_seen = []
    for filler in ([1, 2], [3, 4], [5, 6]):  # push id 0 down one tier at a time
        tiers_seen.append(tier_of(store, 0))
        assert torch.equal(store.get([0]), newest) if tiers_seen[-1] == "device" else True
        store.get(filler)
    tiers_seen.append(tier_of(store, 0))
    assert tiers_seen[:1] == ["device"] and "host" in tiers_seen and tiers_seen[-1] == "cold"
    assert torch.equal(store.get([0]), newest)  # from the cold store's staged rows
    store.flush()
    store.get([11, 12])
    store.get([13, 14])  # 0 is cold again, now committed
    assert tier_of(store, 0) == "cold"
    assert torch.equal(store.get([0]), newest)
    store.close()


def test_invariant2_evicted_dirty_row_reaches_cold_store(backend, store_path):
    store = TieredStore(store_path, dim=4, backend=backend, host_cache=2, device_cache=2)
    store.put([0, 1], torch.ones(2, 4))
    store.get([2, 3])
    store.get([4, 5])  # 0 and 1 leave both caches
    rows, found = store.stack.cold.get(torch.tensor([0, 1]))
    assert bool(found.all()) and torch.equal(rows[:, :4], torch.ones(2, 4))
    assert store.stats()["host"]["writebacks"] >= 2


def test_invariant2_flush_writes_every_dirty_cached_row(backend, store_path):
    store = TieredStore(store_path, dim=4, backend=backend, host_cache=8, device_cache=10)
    store.put(list(range(10)), torch.arange(40.0).reshape(10, 4))  # all still cached
    store.flush()
    rows, found = store.stack.cold.get(torch.arange(10))
    assert bool(found.all()) and torch.equal(rows, torch.arange(40.0).reshape(10, 4))


def test_invariant3_flush_makes_updates_durable_and_close_flushes(backend, store_path):
    with TieredStore(store_path, dim=4, backend=backend, host_cache=3, device_cache=4) as store:
        store.put([1, 2, 3], torch.ones(3, 4))
        store.get([4, 5, 6, 7])
    with TieredStore(store_path, host_cache=3) as reopened:
        assert torch.equal(reopened.get([1, 2, 3]), torch.ones(3, 4))
        assert torch.equal(reopened.get([5]), initial(5, 4).unsqueeze(0))
        assert len(reopened) == 7


def test_invariant5_rows_of_the_batch_are_not_evicted_while_in_flight(backend, store_path):
    store = TieredStore(store_path, dim=4, backend=backend, host_cache=3, device_cache=4)
    store.put([0, 1], torch.full((2, 4), 3.0))
    store.get([0, 1] * 50)  # 0 and 1 are hot; the next batch needs them and two new rows
    got = store.get([8, 0, 9, 1])  # fills the top tier exactly
    assert torch.equal(got[[1, 3]], torch.full((2, 4), 3.0))
    assert torch.equal(got[0], initial(8, 4)) and torch.equal(got[2], initial(9, 4))


def test_invariant5_a_training_batch_larger_than_top_tier_is_a_clear_error_and_changes_nothing(
    backend, store_path
):
    store = TieredStore(store_path, dim=4, backend=backend, host_cache=8, device_cache=4)
    store.put([0], torch.ones(1, 4))
    before = store.stats()
    with pytest.raises(CacheCapacityError, match="5 distinct ids.*holds 4 rows"):
        store.get_distinct(torch.arange(5))
    assert store.stats() == before
    assert len(store) == 1 and torch.equal(store.get([0]), torch.ones(1, 4))


def test_get_and_put_take_more_ids_than_the_top_tier_holds(backend, store_path):
    """Outside training a batch of any size works: it goes through the top tier in parts."""
    store = TieredStore(store_path, dim=4, backend=backend, host_cache=8, device_cache=4)
    ids = torch.tensor([5, 0, 9, 3, 5, 12, 7, 1, 0, 11])  # 8 distinct, repeats
    rows = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    store.put(ids, rows)
    expected = {int(id_): row for id_, row in zip(ids, rows)}  # the last repeat wins
    got = store.get(ids)
    assert torch.equal(got, torch.stack([expected[int(id_)] for id_ in ids]))
    unseen = torch.arange(100, 110)
    assert torch.equal(store.get(unseen, grow=False), initial_weights(unseen, 4, 0, torch.float32))
    assert len(store) == 8
    store.close()


@pytest.mark.parametrize("budget", ["64KiB", "1MiB", "3MiB"])
def test_invariant6_caches_stay_within_their_byte_budgets(budget, store_path):
    from tierstore.budget import parse_bytes

    store = TieredStore(store_path, dim=64, host_cache=budget, device_cache=budget)
    for batch in torch.arange(20000).split(100):  # more rows than fit: both caches fill up
        store.get(batch)
    for cache in store.stack.caches:
        assert cache.nbytes == cache.nbytes_for(cache.capacity, 64, torch.float32, cache.backend)
        assert cache.nbytes <= parse_bytes(budget)
        assert cache.nbytes > 0.9 * parse_bytes(budget)  # and the budget is used, not wasted
    store.close()


def test_invariant6_store_files_grow_only_with_distinct_keys(backend, store_path):
    def size_on_disk():
        return sum(f.stat().st_blocks * 512 for f in store_path.rglob("*") if f.is_file())

    store = TieredStore(store_path, dim=32, backend=backend, host_cache=64, device_cache=100)
    keys = torch.arange(2000)
    for batch in keys.split(100):
        store.put(batch, torch.zeros(100, 32))
    store.flush()
    first = size_on_disk()
    for round_ in range(20):  # rewrite the same keys many times
        for batch in keys.split(100):
            store.put(batch, torch.full((100, 32), float(round_)))
        store.flush()
    assert size_on_disk() <= 2 * first + 2**20
    store.close()


def test_invariant6_an_mmap_store_takes_about_its_raw_bytes_on_disk(store_path):
    """Files grow sparse and only the rows written are allocated; the log's blocks are freed after
    each flush (its files keep their size for readers), so disk use stays near the raw row bytes,
    plus the key index (``index.bin``: 16 bytes a position, at most 4 positions a key)."""
    with TieredStore(store_path, dim=16, backend="mmap", host_cache=2000) as store:
        for part in torch.arange(40_000).split(1000):
            store.put(part * 7, torch.ones(part.numel(), 16))
            if int(part[0]) % 8000 == 0:
                store.flush()
    allocated = sum(file.stat().st_blocks * 512 for file in store_path.rglob("*") if file.is_file())
    raw = 40_000 * (16 * 4 + 8)  # rows and their keys
    index = (store_path / "index.bin").stat().st_blocks * 512
    assert index <= 64 * 40_000 + 4096, index
    assert allocated - index <= 1.2 * raw + 64 * 1024, (allocated, index, raw)
