import torch
from helpers import hash_table_operations
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.tiers.hash_index import HashIndex


@settings(max_examples=150, deadline=None)
@given(hash_table_operations, st.integers(1, 8))
def test_hash_index_matches_a_dict(ops, capacity):
    index, oracle = HashIndex(capacity), {}
    for step, (op, keys) in enumerate(ops):
        if op == "insert":
            keys = [k for k in keys if k not in oracle]
            index.insert(torch.tensor(keys, dtype=torch.int64), torch.tensor([k * 10 + step for k in keys]))
            oracle.update({k: k * 10 + step for k in keys})
        elif op == "remove":
            removed = index.remove(torch.tensor(keys, dtype=torch.int64))
            assert removed.tolist() == [oracle.pop(k, -1) for k in keys]
        found = index.find(torch.tensor(keys, dtype=torch.int64))
        assert found.tolist() == [oracle.get(k, -1) for k in keys]
        assert len(index) == len(oracle)
    all_keys, all_values = index.items()
    assert dict(zip(all_keys.tolist(), all_values.tolist())) == oracle


def test_large_batches_with_collisions_and_growth():
    keys = torch.randperm(1 << 20)[:50000] * 4096  # share low bits
    index = HashIndex(16, value_dtype=torch.int32)
    for chunk in keys.split(7000):
        index.insert(chunk, chunk // 4096)
    assert torch.equal(index.find(keys), keys // 4096)
    assert bool((index.find(keys + 1) == -1).all())


def test_long_probe_chains_through_full_buckets_and_tombstones():
    index = HashIndex(4000)  # 1000 buckets
    candidates = torch.arange(2_000_000)
    same_home = candidates[index._home(candidates) == 17][:100]  # 100 keys, one home: a 13-bucket chain
    assert same_home.numel() == 100
    others = torch.unique(torch.randint(1 << 31, 1 << 40, (1500,)))
    index.insert(same_home, same_home + 1)
    index.insert(others, others + 1)
    removed = same_home[::3]
    index.remove(removed)  # tombstones inside the chain must not end it
    kept = same_home[torch.arange(100) % 3 != 0]
    assert torch.equal(index.find(kept), kept + 1)
    assert torch.equal(index.find(others), others + 1)
    assert bool((index.find(removed) == -1).all())
    index.insert(removed[:10], removed[:10] + 7)  # re-inserted into freed slots of the chain
    assert torch.equal(index.find(removed[:10]), removed[:10] + 7)


def test_steady_eviction_rebuilds_the_table_rarely():
    """A full cache removes and inserts a quarter of its keys each step: slots freed in buckets
    that were never full are emptied, not tombstoned, so tombstones build up slowly and the
    table is rebuilt every few dozen steps, not at every step."""
    generator = torch.Generator().manual_seed(0)
    index = HashIndex(40_000, value_dtype=torch.int32)
    resident = torch.randint(1 << 40, (41_000,), generator=generator).unique()[:40_000]  # MAX_LOAD
    index.insert(resident, torch.arange(40_000))
    rebuilds, rebuild = [], index._rebuild
    index._rebuild = lambda buckets: (rebuilds.append(buckets), rebuild(buckets))
    for step in range(30):
        order = torch.randperm(resident.numel(), generator=generator)
        out, kept = resident[order[:10_000]], resident[order[10_000:]]
        assert torch.equal(index.remove(out) >= 0, torch.ones(10_000, dtype=torch.bool))
        incoming = torch.randint((step + 1) << 40, (step + 2) << 40, (10_000,), generator=generator).unique()
        index.insert(incoming, torch.arange(incoming.numel()))
        resident = torch.cat([kept, incoming])
        assert bool((index.find(resident) >= 0).all()) and bool((index.find(out) == -1).all())
    assert len(rebuilds) <= 2, rebuilds
    assert len(index) == resident.numel()
