"""The ids-only horizon (``prefetch(horizon=)``): the same training, bit for bit; eviction by next
use close to Belady's MIN (the oracle: ``belady_hits``, one access at a time); its pins within
the tier's room and gone when the loop ends; its arguments checked."""

import subprocess
import sys
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import tiers_growing_from
from hypothesis import given, settings
from hypothesis import strategies as st
from test_prefetch import ROWS, bag_batches, preloaded_table, train, train_collection, two_feature_batches

import tierstore
from tierstore import TieredStore, optim
from tierstore.analysis.reference_policies import belady_hits
from tierstore.budget import horizon_accesses
from tierstore.horizon import Foresight
from tierstore.kernels.host import openmp_runtime


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    host_rows=st.integers(12, 40),
    horizon=st.one_of(st.integers(1, 300), st.sampled_from(["1x", "4x", "10x"])),
    lookahead=st.integers(1, 6),
    background=st.booleans(),
    optimizer=st.sampled_from(["sgd", "adagrad"]),
    batch=st.integers(1, 6),
    backend=st.sampled_from(["openmp", "torch"]),
    grows_from=st.sampled_from([None, 2]),
)
def test_training_with_a_horizon_gives_the_same_rows_and_outputs_bit_for_bit(
    tmp_path_factory, seed, host_rows, horizon, lookahead, background, optimizer, batch, backend, grows_from
):
    """``grows_from``: the host tier starts at that many slots and grows under the horizon's pins."""
    batches = bag_batches(seed, 20, batch)
    runs = []
    for foreseeing in (False, True):
        directory = tmp_path_factory.mktemp("run")
        make = optim.SGD if optimizer == "sgd" else optim.Adagrad
        with tiers_growing_from(grows_from):
            table = tierstore.TieredEmbeddingBag(
                None,
                4,
                mode="sum",
                path=directory / "t",
                host_cache=host_rows,
                optimizer=make(lr=0.1),
                host_cache_backend=backend,
            )
        with closing(table):
            if foreseeing:
                outputs = train(table, batches, lookahead, background, horizon)
            else:
                outputs = train(table, batches)
            rows = table.store.get(torch.arange(ROWS), with_state=True, grow=False)
            runs.append((outputs, rows, len(table.store), table.store.stats()))
            assert table.store.stack.top.pinned_count() == 0  # the loop's end unpinned everything
    (outputs, rows, size, _), (foreseen_outputs, foreseen_rows, foreseen_size, stats) = runs
    assert all(torch.equal(a, b) for a, b in zip(outputs, foreseen_outputs))
    assert torch.equal(rows, foreseen_rows) and size == foreseen_size
    assert stats["prefetch"]["horizon"] == horizon_accesses(horizon, host_rows)


@pytest.mark.parametrize("host_backend", ["openmp", "torch"])
def test_a_horizon_over_a_device_tier_trains_the_same(tmp_path, device_tier, host_backend):
    """The horizon pins in the top tier, here a device tier (on a GPU where there is one) over a
    host tier: its ids move to the tier's device, its pins and next uses live there."""
    batches = bag_batches(6, 30, 4)
    runs = []
    for horizon in (None, "6x"):
        table = tierstore.TieredEmbeddingBag(
            None,
            4,
            mode="sum",
            path=tmp_path / f"t{horizon}",
            host_cache=24,
            device_cache=16,
            optimizer=optim.Adagrad(lr=0.1),
            host_cache_backend=host_backend,
            **device_tier,
        )
        if horizon is None:
            outputs = [out.cpu() for out in train(table, batches)]
        else:
            outputs = [out.cpu() for out in train(table, batches, 1, False, horizon)]
        rows = table.store.get(torch.arange(ROWS), with_state=True, grow=False).cpu()
        runs.append((outputs, rows, table.store.stats()))
        assert table.store.stack.top.pinned_count() == 0
        table.close()
    (outputs, rows, _), (foreseen_outputs, foreseen_rows, stats) = runs
    assert all(torch.equal(a, b) for a, b in zip(outputs, foreseen_outputs))
    assert torch.equal(rows, foreseen_rows)
    assert stats["prefetch"]["horizon"] == 6 * 16


@pytest.mark.parametrize("background", [False, True], ids=["inline", "worker"])
def test_the_collection_trains_the_same_with_a_horizon(tmp_path, background):
    batches = two_feature_batches(30, lambda rng, rows, n: rng.zipf(1.3, n) % rows)
    outputs, stored, plain = train_collection(tmp_path / "plain", batches, 40)
    foreseen_outputs, foreseen_stored, stats = train_collection(
        tmp_path / "foreseen",
        batches,
        40,
        lambda b, c: tierstore.prefetch(b, c, 2, background=background, horizon="8x"),
    )
    assert all(torch.equal(a, b) for a, b in zip(outputs, foreseen_outputs))
    assert stored == foreseen_stored
    for group in ("dim8", "dim4"):
        assert stats["groups"][group]["prefetch"]["horizon"] == 8 * 20  # host_cache split over 2 groups
        assert stats["groups"][group]["host"]["rows_in"] < plain["groups"][group]["host"]["rows_in"]


def zipf_trace(seed: int, accesses: int, ids: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.zipf(1.2, accesses) - 1) % ids


def rows_brought_in(
    keys: np.ndarray, capacity: int, batch: int, horizon=None, ids=None, backend="openmp", window=(1, False)
) -> int:
    """Rows a store of ``capacity`` rows brings into its host tier replaying ``keys`` in batches
    (the horizon's native calls on the "openmp" tier, its torch ops on the "torch" one), the
    pipeline's ``window``: ``(lookahead, background)``."""
    batches = torch.from_numpy(keys).split(batch)
    with closing(TieredStore(None, dim=2, host_cache=capacity, host_cache_backend=backend)) as store:
        loop = (
            batches
            if horizon is None
            else tierstore.prefetch(
                batches, store, window[0], background=window[1], horizon=horizon, horizon_ids=ids
            )
        )
        for ids_ in loop:
            store.get(ids_)
        return store.stats()["host"]["rows_in"]


@pytest.mark.parametrize("window", [(1, False), (4, True)], ids=["inline", "worker-4"])
@pytest.mark.parametrize("backend", ["openmp", "torch"])
@pytest.mark.parametrize("capacity", [40, 200])
def test_eviction_by_next_use_comes_within_a_few_percent_of_belady(capacity, backend, window):
    """Inline, and with a worker pinning 4 batches ahead: the window's rows take slots beside the
    horizon's pins, counted once (a row both pin holds one slot)."""
    keys = zipf_trace(3, 20000, 2000)
    batch = capacity // 8
    optimal = belady_hits(keys, capacity) / keys.size  # one access at a time: the ceiling
    lfu = 1 - rows_brought_in(keys, capacity, batch, backend=backend) / keys.size
    foreseen = 1 - rows_brought_in(keys, capacity, batch, "10x", backend=backend, window=window) / keys.size
    assert foreseen > lfu + 0.05  # measured: +0.10 at both sizes
    # measured: 0.99x inline; 0.968-0.975x (40) and 0.981-0.986x (200) with the worker, which
    # reached 0.93-0.94x and 0.95-0.957x while every row the window pinned counted against the horizon
    assert foreseen >= (0.97 if window == (1, False) else 0.96) * optimal


@pytest.mark.parametrize("backend", ["openmp", "torch"])
def test_a_cyclic_scan_one_row_too_large_keeps_all_but_one_row(backend):
    # a cycle over capacity + 1 ids: MIN misses about once a cycle, LFU several times
    capacity, batch = 32, 4
    keys = np.tile(np.arange(capacity + 1), 40)
    foreseen = rows_brought_in(keys, capacity, batch, horizon=4 * capacity, backend=backend)
    lfu = rows_brought_in(keys, capacity, batch, backend=backend)
    optimal_misses = keys.size - belady_hits(keys, capacity)
    assert lfu > 3 * optimal_misses  # measured: 345 against 73
    assert foreseen <= 1.1 * optimal_misses  # measured: 73


def test_the_horizons_native_passes_do_not_depend_on_the_thread_count():
    """Batches of thousands of ids run the horizon's passes on the OpenMP team (the map's changes on
    one thread, the tier's side on another): the same rows brought in, the same tier and pins, at
    any thread count."""
    runtime = openmp_runtime()
    if runtime is None:
        pytest.skip("the OpenMP runtime (libgomp) is not loaded: one thread count only")
    rng = np.random.default_rng(4)
    batches = torch.from_numpy((rng.zipf(1.1, 60_000) - 1) % 40_000).split(5_000)  # ~2,700 ids each
    threads, results = runtime.omp_get_max_threads(), []
    try:
        for count in (1, 2, 3):
            runtime.omp_set_num_threads(count)
            with closing(TieredStore(None, dim=2, host_cache=8_000)) as store:
                top, pinned = store.stack.top, []
                for ids in tierstore.prefetch(batches, store, 1, background=False, horizon="4x"):
                    store.get(ids)
                    pinned.append(top.pinned_count())
                assert max(pinned) > 1_000  # the horizon held rows
                results.append((store.stats()["host"]["rows_in"], top.slot_keys.clone(), pinned))
    finally:
        runtime.omp_set_num_threads(threads)
    for rows_in, slot_keys, pinned in results[1:]:
        assert rows_in == results[0][0] and pinned == results[0][2]
        assert torch.equal(slot_keys, results[0][1])


@pytest.mark.parametrize("backend", ["openmp", "torch"])
def test_the_horizon_pins_the_resident_rows_of_its_batches_at_their_next_use(backend):
    """Against an oracle, after each batch has run: the horizon pins exactly the resident rows its
    live batches (entered, not yet run) look up, each recorded with its first such batch, and
    counts the next batch's rows it does not pin. Rows taken out of the tier meanwhile (the next
    batch's, whose slots the last count found, by ``load``) are found anew where they come back."""
    rng = np.random.default_rng(7)
    batches = [torch.from_numpy(np.unique(rng.integers(0, 600, 60))) for _ in range(70)]
    ahead, taken_out = 3, 0
    with closing(TieredStore(None, dim=2, host_cache=200, host_cache_backend=backend)) as store:
        top = store.stack.top
        sight = Foresight(store, horizon=10_000)
        for keys in batches[:ahead]:
            sight.enter(keys)
        for number, keys in enumerate(batches):
            store.get(keys)
            sight.consume()
            if number + ahead < len(batches):
                sight.enter(batches[number + ahead])
            first_use = {}
            for later, live in enumerate(batches[number + 1 : number + 1 + ahead], start=number + 1):
                for key in live.tolist():
                    first_use.setdefault(key, later)
            held = sight._mine(top).nonzero().squeeze(1)
            pinned = dict(zip(top.slot_keys[held].tolist(), sight._pinned_next[held].tolist()))
            resident = (top.find(torch.tensor(list(first_use), dtype=torch.int64)) >= 0).tolist()
            assert pinned == {key: first_use[key] for key, there in zip(first_use, resident) if there}
            assert sight.unpinned_far == 0
            if number + 1 < len(batches):
                following = batches[number + 1]
                assert sight._need == int((top.find(following) < 0).sum())
                if number % 5 == 3:  # out of the tier (their slots then taken by others) until they run
                    some = following[::3]
                    taken_out += int((top.find(some) >= 0).sum())
                    store.load(some, torch.zeros(some.numel(), 2))
        assert top.stats.evictions > 500 and taken_out > 50


@pytest.mark.parametrize("backend", ["openmp", "torch"])
def test_a_worker_beside_the_horizon_always_leaves_a_batch_its_slots(backend):
    """Tiny tiers, batches near their size, a worker pinning up to 7 batches ahead beside the
    horizon's pins (each counted once where both pin a row): no step and no window's pin finds
    too few evictable slots (``CacheCapacityError``), whatever the threads' timing."""
    shapes = [  # capacity, lookahead, batch, ids, Zipf exponent, horizon
        (7, 3, 4, 23, 1.3, "30x"),
        (10, 6, 8, 98, 1.5, "10x"),
        (21, 4, 13, 158, 1.2, "30x"),
        (30, 7, 29, 129, 1.46, 377),
        (37, 7, 35, 238, 1.38, "30x"),
    ]
    for seed, (capacity, lookahead, batch, ids, exponent, horizon) in enumerate(shapes):
        keys = torch.from_numpy((np.random.default_rng(seed).zipf(exponent, batch * 100) - 1) % ids)
        for _ in range(3):
            with closing(TieredStore(None, dim=2, host_cache=capacity, host_cache_backend=backend)) as store:
                batches = keys.split(batch)
                for ids in tierstore.prefetch(batches, store, lookahead, background=True, horizon=horizon):
                    store.get(ids)
                assert store.stack.top.pinned_count() == 0


def test_horizon_ids_feed_the_same_horizon_as_the_batches():
    keys = zipf_trace(5, 6000, 800)
    batches = torch.from_numpy(keys).split(10)
    from_batches = rows_brought_in(keys, 80, 10, horizon="10x")
    from_ids = rows_brought_in(keys, 80, 10, horizon="10x", ids=iter(batches))
    assert from_ids == from_batches


def test_horizon_ids_that_end_early_are_named():
    keys = torch.arange(100)
    with closing(TieredStore(None, dim=2, host_cache=20)) as store:
        loop = tierstore.prefetch(
            keys.split(10), store, 1, background=False, horizon=50, horizon_ids=keys[:30].split(10)
        )
        with pytest.raises(ValueError, match="horizon_ids ended at batch 3"):
            for ids in loop:
                store.get(ids)
        assert store.stack.top.pinned_count() == 0


@pytest.mark.parametrize("backend", ["openmp", "torch"])
def test_the_horizon_pins_within_the_room_a_batch_needs_and_reports_its_memory(tmp_path, backend):
    table = tierstore.TieredEmbeddingBag(
        None, 4, mode="sum", path=tmp_path / "t", host_cache=24, host_cache_backend=backend
    )
    table.load_weights(torch.arange(ROWS), torch.randn(ROWS, 4))
    with closing(table):
        batches = bag_batches(8, 60, 4)
        top = table.store.stack.top
        loop = tierstore.prefetch(batches, table, 1, ids=lambda b: b[0], background=False, horizon=400)
        for ids, offsets in loop:
            missing = int((top.find(torch.unique(ids)) < 0).sum())
            assert top.pinned_count() <= top.capacity - missing  # the batch's misses find room
            table(ids, offsets).sum().backward()
        stats = table.store.stats()["prefetch"]
        assert stats["horizon"] == 400 and stats["horizon_bytes"] > 0
        assert stats["horizon_unpinned_far"] > 0  # the cap was reached and the farthest let go
        assert top.pinned_count() == 0


def test_leaving_the_loop_early_unpins_the_horizon(tmp_path):
    with closing(preloaded_table(tmp_path / "t", host_rows=30)) as table:
        batches = bag_batches(3, 40, 3)
        for background in (False, True):
            loop = tierstore.prefetch(
                batches, table, 3, ids=lambda b: b[0], background=background, horizon="5x"
            )
            for step, (ids, offsets) in enumerate(loop):
                table(ids, offsets).sum().backward()
                if step == 4:
                    assert table.store.stack.top.pinned_count() > 0
                    break
            loop.close()
            assert table.store.stack.top.pinned_count() == 0


UNFINISHED_AT_EXIT = """
import sys, torch, tierstore
sys.path.insert(0, sys.argv[2])
from test_prefetch import TWO_TABLES, two_feature_batches
collection = tierstore.TieredEmbeddingBagCollection(
    TWO_TABLES, sys.argv[1], host_cache=40, optimizer=tierstore.optim.SGD(lr=0.1)
)
batches = two_feature_batches(400, lambda rng, rows, n: rng.integers(0, rows, n))
background, horizon = sys.argv[3] == "1", None if sys.argv[4] == "none" else sys.argv[4]
loop = iter(tierstore.prefetch(batches, collection, 60, background=background, horizon=horizon))
for _ in range(3):  # the worker, if any, still reading and pinning batches ahead at the exit
    collection(next(loop)).values().sum().backward()
print("left the loop unfinished")
"""


@pytest.mark.parametrize("background, horizon", [(False, "4x"), (True, "4x"), (True, "none")])
def test_a_loop_left_unfinished_at_exit_ends_the_process_cleanly(tmp_path, background, horizon):
    """A loop's generator is finalized with the interpreter. It must not unpin through torch then
    (a garbage collection there aborted the process), and its worker must have stopped before
    (a thread still in a native call is ended inside it: the process aborted). With a worker, a
    few processes: where it is at the exit varies."""
    tests = str(Path(__file__).parent)
    for run_number in range(4 if background else 1):
        directory = str(tmp_path / f"c{run_number}")
        arguments = [sys.executable, "-c", UNFINISHED_AT_EXIT, directory, tests, str(int(background))]
        run = subprocess.run([*arguments, horizon], capture_output=True, timeout=300)
        assert run.returncode == 0, run.stderr.decode()[-2000:]
        assert run.stdout.decode().strip() == "left the loop unfinished"


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"horizon": 0}, "horizon must be a positive int"),
        ({"horizon": -5}, "horizon must be a positive int"),
        ({"horizon": 2.5}, "horizon must be a positive int"),
        ({"horizon": True}, "horizon must be a positive int"),
        ({"horizon": "ten"}, "horizon must be a positive int"),
        ({"horizon": "0x"}, "horizon must be a positive int"),
        ({"horizon_ids": [torch.tensor([1])]}, "horizon_ids feeds a horizon: pass horizon="),
    ],
)
def test_bad_horizons_are_named_before_anything_starts(tmp_path, arguments, message):
    with closing(preloaded_table(tmp_path / "t", host_rows=30)) as table:
        with pytest.raises(ValueError, match=message):
            tierstore.prefetch(iter([]), table, 2, **arguments)
        assert table.store.stack.top.pinned_count() == 0


def test_a_store_budgets_for_its_horizon_and_the_horizon_stays_within_it():
    from tierstore.budget import horizon_nbytes, parse_bytes

    budget = "1MiB"
    with closing(TieredStore(None, dim=16, host_cache=budget)) as plain:
        rows_without = plain.stack.top.capacity
        assert plain.stack.top.horizon_budget is None
    with closing(TieredStore(None, dim=16, host_cache=budget, horizon="10x")) as store:
        top = store.stack.top
        assert top.capacity < rows_without / 2  # the horizon's memory is taken from the rows
        assert top.horizon_budget == horizon_nbytes("10x", top.capacity)
        assert 0.9 * parse_bytes(budget) < top.nbytes + top.horizon_budget <= parse_bytes(budget)
        keys = torch.from_numpy(zipf_trace(6, 60000, 40000))
        loop = tierstore.prefetch(keys.split(top.capacity // 8), store, 1, background=False, horizon="10x")
        for ids in loop:
            store.get(ids)
            stats = store.stats().get("prefetch")
            assert stats is None or stats["horizon_bytes"] <= top.horizon_budget
        assert stats["horizon"] == 10 * top.capacity
    with closing(TieredStore(None, dim=16, host_cache=4000, horizon="10x")) as counted:
        assert counted.stack.top.capacity == 4000 and counted.stack.top.horizon_budget is None  # rows


def test_a_bad_budgeted_horizon_is_named():
    with pytest.raises(ValueError, match="horizon must be a positive int"):
        TieredStore(None, dim=4, host_cache="1MiB", horizon="many")
