"""Random get/put/remove/flush/compact/reopen sequences against a plain dict, with caches of a few
rows so every eviction, promotion and write-back path runs."""

import shutil
import tempfile

import pytest
import torch
from helpers import initial, tiers_growing_from
from host_kernels import shared_host_kernels
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tierstore import TieredStore
from tierstore.tiers import KernelRows

DIM = 3
ids = st.lists(st.integers(0, 40), min_size=1, max_size=6)


class StoreAgainstDict(RuleBasedStateMachine):
    backend = "lmdb"
    device_cache_backend = "torch"
    host_cache_backend = "openmp"
    device = "cpu"
    host_cache, device_cache = 4, 6
    initial_rows = None  # slots a tier that grows on demand starts with (None: the default)
    most_rows = None  # TieredStore's: its tables' rows, whose host tier then has a direct layout

    def __init__(self):
        super().__init__()
        self.directory = tempfile.mkdtemp()
        self.open()
        self.oracle = {}
        self.durable = {}

    def open(self):
        device_backend = self.device_cache_backend
        if device_backend == "cuda" and self.device == "cpu":  # the kernels' host build stands in
            device_backend = KernelRows(shared_host_kernels(), "cuda")
        with tiers_growing_from(self.initial_rows):
            self.store = TieredStore(
                self.directory + "/s",
                dim=DIM,
                device=self.device,
                backend=self.backend,
                host_cache=self.host_cache,
                device_cache=self.device_cache,
                device_cache_backend=device_backend,
                host_cache_backend=self.host_cache_backend,
                most_rows=self.most_rows,
            )
        stats = self.store.stats()
        assert stats["host"]["backend"] == self.host_cache_backend
        assert not self.device_cache or stats["device"]["backend"] == self.device_cache_backend

    @rule(keys=ids, into_out=st.booleans())
    def get(self, keys, into_out):
        out = torch.full((len(keys), DIM), float("nan"), device=self.device) if into_out else None
        got = self.store.get(keys, out=out)
        assert out is None or got is out
        for key, row in zip(keys, got.cpu()):
            expected = self.oracle.setdefault(key, initial(key, DIM))
            assert torch.equal(row, expected), key

    @rule(keys=ids, data=st.data())
    def put(self, keys, data):
        rows = torch.tensor(
            data.draw(
                st.lists(
                    st.lists(st.floats(-10, 10, width=32), min_size=DIM, max_size=DIM),
                    min_size=len(keys),
                    max_size=len(keys),
                )
            ),
            dtype=torch.float32,
        )
        self.store.put(keys, rows.to(self.device))
        for key, row in zip(keys, rows):
            self.oracle[key] = row  # the last occurrence wins

    @rule(keys=ids)
    def remove(self, keys):
        held = len({key for key in keys if key in self.oracle})
        assert self.store.remove(keys) == held
        for key in keys:
            self.oracle.pop(key, None)  # back from its initial row if looked up again

    @rule()
    def flush(self):
        self.store.flush()
        self.durable = dict(self.oracle)

    @rule()
    def compact(self):
        self.store.compact()  # flushes, then rewrites the files without removed rows
        self.durable = dict(self.oracle)

    @rule()
    def reopen(self):
        self.store.close()  # close flushes
        self.durable = dict(self.oracle)
        self.open()

    @rule()
    def crash_and_reopen(self):
        # Drop the process's view without flushing: the caches' dirty rows and staged rows vanish.
        self.store.stack.cold.close()
        self.store._closed = True
        self.oracle = dict(self.durable)
        self.open()

    @invariant()
    def length_matches(self):
        assert len(self.store) == len(self.oracle)

    def teardown(self):
        if not self.store._closed:
            self.store.close()
        shutil.rmtree(self.directory, ignore_errors=True)


class GrowingHostTierAgainstDict(StoreAgainstDict):
    """One host tier on the native path (mmap, kernels) that starts at 2 slots and grows to 24 as
    rows come, evicting once full."""

    backend = "mmap"
    host_cache, device_cache = 24, 0
    initial_rows = 2

    def open(self):
        super().open()
        tiers = [tier for tier in self.store.stats().values() if "capacity_rows" in tier]
        assert all(tier["capacity_rows"] == 2 for tier in tiers)  # every tier starts small

    @invariant()
    def grows_before_it_evicts(self):
        host = self.store.stats()["host"]
        assert host["evictions"] == 0 or host["capacity_rows"] == 24


class GrowingTiersAgainstDict(GrowingHostTierAgainstDict):
    """Both tiers (a torch device tier on the CPU above the kernels' host tier) grow."""

    backend = "lmdb"
    host_cache, device_cache = 24, 10


class DirectLayoutAgainstDict(StoreAgainstDict):
    """A host tier held whole for a table of 10 rows (every slot a home) on the native path, fed ids
    up to 40: most keys have no home, and homes are taken by others while their keys are out."""

    backend = "mmap"
    host_cache, device_cache = 12, 0
    most_rows = 10

    def open(self):
        super().open()
        assert self.host_tier().direct.rows == min(self.host_cache, sum(self.tables()))

    def host_tier(self):
        return self.store.stack.caches[-1]

    def tables(self) -> list[int]:
        return self.most_rows if isinstance(self.most_rows, list) else [self.most_rows]

    @invariant()
    def free_slots_know_their_places(self):
        check_free_places(self.host_tier())


def check_free_places(tier):
    """Every free slot of a tier with a direct layout is empty and knows its place in the stack."""
    free = tier._free[: tier.capacity - len(tier)]
    assert torch.equal(tier._free_positions[free].long(), torch.arange(free.numel()))
    assert bool((tier.slot_keys[free] == -1).all())


class PartialDirectLayoutAgainstDict(DirectLayoutAgainstDict):
    """Two tables of which only the smaller gets homes (ids 0-3), through the Python admission
    (LMDB) below a torch device tier."""

    backend = "lmdb"
    host_cache, device_cache = 12, 3
    most_rows = [4, 30]

    def tables(self) -> list[int]:
        return [4]


class NativePartialDirectLayoutAgainstDict(PartialDirectLayoutAgainstDict):
    """The same layout on the native path (mmap, host tier alone), evicting once full."""

    backend = "mmap"
    host_cache, device_cache = 12, 0


class GrowingDirectLayoutAgainstDict(GrowingHostTierAgainstDict):
    """A growing host tier (2 slots to 24) holding a bounded table (ids 0-5 have homes) and an
    unbounded one (a collection's group): homes past the tier's slots come as it grows."""

    most_rows = [6, None]

    def open(self):
        super().open()
        assert self.store.stack.top.direct.sizes.tolist() == [6, 0]

    @invariant()
    def free_slots_know_their_places(self):
        check_free_places(self.store.stack.top)


class MmapStoreAgainstDict(StoreAgainstDict):
    backend = "mmap"
    host_cache_backend = "torch"


class KernelDeviceTierAgainstDict(StoreAgainstDict):
    """The device tier on the kernels' one-thread host build (see conftest.device_tier)."""

    device_cache_backend = "cuda"


class GpuDeviceTierAgainstDict(StoreAgainstDict):
    """The device tier's kernels on a real GPU (skipped without one)."""

    device_cache_backend = "cuda"
    device = "cuda"


class MmapGpuDeviceTierAgainstDict(GpuDeviceTierAgainstDict):
    backend = "mmap"
    host_cache_backend = "torch"


TestLmdbStoreAgainstDict = StoreAgainstDict.TestCase
TestGrowingHostTierAgainstDict = GrowingHostTierAgainstDict.TestCase
TestGrowingTiersAgainstDict = GrowingTiersAgainstDict.TestCase
TestMmapStoreAgainstDict = MmapStoreAgainstDict.TestCase
TestDirectLayoutAgainstDict = DirectLayoutAgainstDict.TestCase
TestPartialDirectLayoutAgainstDict = PartialDirectLayoutAgainstDict.TestCase
TestNativePartialDirectLayoutAgainstDict = NativePartialDirectLayoutAgainstDict.TestCase
TestGrowingDirectLayoutAgainstDict = GrowingDirectLayoutAgainstDict.TestCase
TestKernelDeviceTierAgainstDict = KernelDeviceTierAgainstDict.TestCase
TestGpuDeviceTierAgainstDict = pytest.mark.gpu(GpuDeviceTierAgainstDict.TestCase)
TestMmapGpuDeviceTierAgainstDict = pytest.mark.gpu(MmapGpuDeviceTierAgainstDict.TestCase)
for case in (
    TestLmdbStoreAgainstDict,
    TestGrowingHostTierAgainstDict,
    TestGrowingTiersAgainstDict,
    TestMmapStoreAgainstDict,
    TestKernelDeviceTierAgainstDict,
    TestGpuDeviceTierAgainstDict,
    TestMmapGpuDeviceTierAgainstDict,
):
    case.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
