"""The tier contract and what plugs into it: eviction policies and backends as values, the cache
settings as a ``TierConfig``, and every tier counting its own lookups."""

import cachetools
import numpy as np
import pytest
import torch
from helpers import puts_and_gets_against_a_dict

from tierstore import CacheCapacityError, TierConfig, TieredStore, optim
from tierstore.cli.inspection import optimizer_name
from tierstore.tiers import CacheTier, EvictionPolicy, KernelRows, RowCache, Rows, TorchRows


def rows_for(keys, width=2):
    keys = torch.as_tensor(keys, dtype=torch.int64)
    no = torch.zeros(keys.numel(), dtype=torch.bool)
    return Rows(keys, keys[:, None].float().repeat(1, width), no, no.clone())


class FirstInFirstOut(EvictionPolicy):
    """A policy written against the contract alone: evict the slot filled longest ago."""

    bytes_per_slot = 8

    def __init__(self, capacity, device, backend):
        super().__init__(capacity, device, backend)
        self.filled_at = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.clock = 0

    @property
    def nbytes(self):
        return self.filled_at.nbytes

    def touch(self, slots, counts):
        pass  # FIFO ignores accesses

    def reset(self, slots):
        self.clock += 1
        self.filled_at[slots] = self.clock

    def victims(self, count, slot_keys, pins):
        never = torch.iinfo(torch.int64).max
        order = self.filled_at.masked_fill((slot_keys < 0) | (pins > 0), never)
        victims = torch.argsort(order)[:count]
        if bool((order[victims] == never).any()):
            raise CacheCapacityError(f"the current batch needs {count} more than it can evict")
        return victims


@pytest.fixture(params=["torch", "kernels"])
def cache_backend(request, host):
    return TorchRows() if request.param == "torch" else KernelRows(host, "openmp")


def test_every_backend_gives_a_cache_tier_that_keeps_the_contract(cache_backend):
    cache = RowCache("host", 8, 4, torch.float32, backend=cache_backend)
    assert isinstance(cache, CacheTier)
    assert cache.report()["backend"] == cache_backend.name
    assert (cache.kernels is None) == isinstance(cache_backend, TorchRows)


def test_a_new_eviction_policy_is_a_small_class_that_plugs_into_the_cache(cache_backend):
    """The FIFO policy above, in a RowCache on either backend, hit for hit with cachetools' FIFOCache."""
    rng = np.random.default_rng(3)
    trace = (rng.zipf(1.3, 5000) % 300).tolist()
    ours = RowCache("host", 40, 2, torch.float32, backend=cache_backend, policy=FirstInFirstOut)
    reference = cachetools.FIFOCache(maxsize=40)
    our_hits, reference_hits = [], []
    for key in trace:
        slots = ours.find(torch.tensor([key]))
        hit = bool(slots[0] >= 0)
        if not hit:
            slots, evicted = ours.admit(rows_for([key]))
            assert len(evicted) <= 1
        ours.touch(slots, missed=torch.tensor([not hit]))
        our_hits.append(hit)
        reference_hits.append(key in reference)
        if key not in reference:
            reference[key] = key
    assert our_hits == reference_hits
    assert ours.stats.hits == sum(our_hits) and ours.stats.misses == len(trace) - sum(our_hits)
    assert ours.nbytes == RowCache.nbytes_for(40, 2, torch.float32, cache_backend, FirstInFirstOut)


def test_a_policy_never_evicts_protected_slots_and_the_cache_names_itself_when_it_cannot_fit(cache_backend):
    cache = RowCache("device", 3, 2, torch.float32, backend=cache_backend, policy=FirstInFirstOut)
    oldest, _ = cache.admit(rows_for([1]))
    cache.admit(rows_for([2]))
    cache.admit(rows_for([3]))
    _, evicted = cache.admit(rows_for([4]), protected=oldest)
    assert evicted.keys.tolist() == [2]  # 1 is older but protected
    with pytest.raises(
        CacheCapacityError, match="the device cache holds 3 rows and the current batch needs 3"
    ):
        cache.admit(rows_for([5, 6, 7]), protected=cache.find(torch.tensor([1])))


def test_a_store_takes_a_backend_value_for_either_tier(tmp_path, host):
    with TieredStore(
        tmp_path / "s",
        dim=4,
        host_cache=8,
        device_cache=4,
        host_cache_backend=TorchRows(),
        device_cache_backend=KernelRows(host, "openmp"),
    ) as store:
        for part in torch.arange(20).split(4):  # rows move through both tiers and the cold store
            store.put(part, part[:, None].float().repeat(1, 4))
        for part in torch.arange(20).split(3):
            assert torch.equal(store.get(part), part[:, None].float().repeat(1, 4))
        stats = store.stats()
        assert (stats["device"]["backend"], stats["host"]["backend"]) == ("openmp", "torch")


def test_a_kernel_backend_refuses_rows_of_a_dtype_the_kernels_do_not_hold(host):
    with pytest.raises(
        ValueError, match="stores float32, float16 or bfloat16 rows, not torch.float64; use the torch backend"
    ):
        RowCache("host", 8, 4, torch.float64, backend=KernelRows(host, "openmp"))
    for dtype in (torch.float16, torch.bfloat16):  # 16-bit rows: the kernels update them in float32
        assert RowCache("host", 8, 4, dtype, backend=KernelRows(host, "openmp")).rows.dtype == dtype


def test_tier_config_or_its_keywords_set_the_caches(tmp_path):
    config = TierConfig(host_cache=16, device_cache=8, host_cache_backend="torch")
    with TieredStore(tmp_path / "a", dim=4, tiers=config) as store:
        stats = store.stats()
        assert (stats["host"]["capacity_rows"], stats["device"]["capacity_rows"]) == (16, 8)
        assert stats["host"]["backend"] == "torch"
    with TieredStore(
        tmp_path / "b", dim=4, tiers=config, host_cache=32
    ) as store:  # a keyword replaces a field
        assert store.stats()["host"]["capacity_rows"] == 32 and store.stats()["device"]["capacity_rows"] == 8


def test_an_unknown_tier_setting_is_refused_by_name_before_anything_is_created(tmp_path):
    with pytest.raises(TypeError, match="'hots_cache'.*host_cache, device_cache"):
        TieredStore(tmp_path / "a", dim=4, hots_cache="1MiB")
    assert not (tmp_path / "a").exists()
    with pytest.raises(TypeError, match="'hots_cache'"):
        from tierstore import TieredEmbeddingBag

        TieredEmbeddingBag(None, 4, hots_cache="1MiB")


def test_every_lookup_is_counted_once_by_the_tier_that_served_it(tmp_path, backend):
    """Each tier counts its own hits; summed over tiers (with new ids) they are the lookups made."""
    rng = np.random.default_rng(0)
    with TieredStore(tmp_path / "s", dim=4, backend=backend, host_cache=12, device_cache=6) as store:
        lookups = 0
        for step in range(60):
            ids = torch.from_numpy(rng.integers(0, 50, rng.integers(1, 6)))
            if step % 5 == 4:
                store.get(ids, grow=False)
            else:
                store.get(ids)
            lookups += ids.numel()
            if step == 30:
                store.flush()
        stats = store.stats()
    served = (
        stats["device"]["hits"] + stats["host"]["hits"] + stats["cold"]["hits"] + stats["cold"]["initialized"]
    )
    assert served == lookups
    assert stats["host"]["hits"] > 0 and stats["cold"]["hits"] > 0  # every tier served some


def test_optimizer_names_live_in_one_registry():
    assert list(optim.OPTIMIZERS) == ["sgd", "adagrad", "rowwise-adagrad", "adam"]
    assert all(kind.name == name for name, kind in optim.OPTIMIZERS.items())
    for spelling in ("rowwise-adagrad", "rowwise_adagrad", "RowWiseAdagrad"):
        assert optim.optimizer_class(spelling) is optim.RowWiseAdagrad
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'; the optimizers are sgd, adagrad"):
        optim.optimizer_class("lamb")


def test_a_store_records_its_optimizer_and_inspect_says_what_it_knows(tmp_path):
    """The name is recorded in tierstore.json; a store that recorded none (imported without an
    optimizer, or written before the field existed) is not guessed to be SGD."""
    import json

    from tierstore.metadata import read_metadata

    with TieredStore(tmp_path / "a", dim=16, optimizer_state_width=1, optimizer="rowwise-adagrad") as store:
        assert store.metadata.optimizer == "rowwise-adagrad"
    assert optimizer_name(read_metadata(tmp_path / "a")) == "rowwise-adagrad"
    with pytest.raises(Exception, match="optimizer='adam'"):
        TieredStore(tmp_path / "a", optimizer="adam")
    TieredStore(tmp_path / "none", dim=16).close()
    assert optimizer_name(read_metadata(tmp_path / "none")) == "none recorded (no state)"
    TieredStore(tmp_path / "old", dim=16, optimizer_state_width=32).close()
    document = json.loads((tmp_path / "old" / "tierstore.json").read_text())
    del document["optimizer"]  # as a store written before the field existed
    (tmp_path / "old" / "tierstore.json").write_text(json.dumps(document))
    assert optimizer_name(read_metadata(tmp_path / "old")) == "not recorded (32 state values per row: Adam)"
    with TieredStore(tmp_path / "old", optimizer="adam") as store:  # unrecorded: any name opens it
        assert store.metadata.optimizer is None


def test_a_store_runs_its_cache_tiers_on_the_policy_it_is_given(tmp_path, backend):
    """FIFO in both cache tiers (TierConfig.policy): rows move through every tier, values stay a dict's."""
    config = TierConfig(host_cache=10, device_cache=5, policy=FirstInFirstOut)
    with TieredStore(tmp_path / "s", dim=3, backend=backend, tiers=config) as store:
        assert all(isinstance(cache.policy, FirstInFirstOut) for cache in store.stack.caches)
        puts_and_gets_against_a_dict(store, np.random.default_rng(5), 80, 40, 3)
        stats = store.stats()
        assert stats["device"]["evictions"] > 0 and stats["host"]["evictions"] > 0
        for cache in store.stack.caches:
            assert cache.nbytes == cache.nbytes_for(
                cache.capacity, 3, torch.float32, cache.backend, FirstInFirstOut
            )


def test_rows_merged_from_the_host_and_an_accelerator_end_on_the_accelerator():
    """Rows a host tier holds merge with rows made on the device tier's accelerator ("meta" stands
    in for a GPU): the merged rows go up to the accelerator, never back down to the host."""
    on_host = Rows(torch.tensor([1]), torch.ones(1, 2), torch.tensor([True]), torch.tensor([False]))
    made = Rows(
        *(
            tensor.to("meta")
            for tensor in (torch.tensor([2, 3]), torch.ones(2, 2), *[torch.ones(2, dtype=torch.bool)] * 2)
        )
    )
    for merged in (
        Rows.merge(torch.tensor([True, False, False]), on_host, made),
        Rows.merge(torch.tensor([False, True, True]), made, on_host),
    ):
        assert {tensor.device.type for tensor in (merged.keys, merged.rows, merged.dirty, merged.fresh)} == {
            "meta"
        }
        assert merged.rows.shape == (3, 2)
