"""The lookahead pipeline: the same training, bit for bit, with its rows moved ahead; its window
within the budget; its errors raised in the loop; a clean stop."""

import os
import subprocess
import sys
import textwrap
import threading
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import tiers_growing_from
from hypothesis import given, settings
from hypothesis import strategies as st

import tierstore
from tierstore import (
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    StoreFormatError,
    TieredEmbeddingBag,
    TieredEmbeddingBagCollection,
    optim,
)
from tierstore import lookahead as lookahead_module
from tierstore.lookahead import MAX_LOOKAHEAD

ROWS = 60


def bag_batches(seed, count, batch, rows=ROWS):
    """``count`` batches ``(ids [batch * 2], offsets [batch])``: two ids a bag, Zipf-like skew."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        ids = (rng.zipf(1.3, batch * 2) - 1) % rows
        batches.append((torch.from_numpy(ids).long(), torch.arange(0, batch * 2, 2)))
    return batches


def train(table, batches, lookahead=None, background=True, horizon=None):
    """Outputs of each step of ``table`` trained on ``batches`` (with the pipeline if ``lookahead``,
    run as ``background`` and ``horizon`` say)."""
    torch.manual_seed(0)
    targets = [torch.randn(offsets.numel(), table.embedding_dim) for _, offsets in batches]
    loop = (
        batches
        if lookahead is None
        else tierstore.prefetch(
            batches, table, lookahead, ids=lambda b: b[0], background=background, horizon=horizon
        )
    )
    outputs = []
    for step, (ids, offsets) in enumerate(loop):
        out = table(ids, offsets)
        (out * targets[step].to(out.device)).sum().backward()
        outputs.append(out.detach())
    return outputs


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    host_rows=st.integers(12, 40),
    lookahead=st.integers(1, 8),
    optimizer=st.sampled_from(["sgd", "adagrad"]),
    batch=st.integers(1, 6),
    grows_from=st.sampled_from([None, 2]),
)
def test_training_with_the_pipeline_gives_the_same_rows_and_outputs_bit_for_bit(
    tmp_path_factory, seed, host_rows, lookahead, optimizer, batch, grows_from
):
    """``grows_from``: the host tier starts at that many slots and grows while the pipeline pins."""
    batches = bag_batches(seed, 20, batch)
    runs = []
    for prefetching in (None, lookahead):
        directory = tmp_path_factory.mktemp("run")
        make = optim.SGD if optimizer == "sgd" else optim.Adagrad
        with tiers_growing_from(grows_from):
            table = TieredEmbeddingBag(
                None, 4, mode="sum", path=directory / "t", host_cache=host_rows, optimizer=make(lr=0.1)
            )
        with closing(table):
            outputs = train(table, batches, prefetching)
            rows = table.store.get(torch.arange(ROWS), with_state=True, grow=False)
            runs.append((outputs, rows, len(table.store), table.store.stats()))
    (outputs, rows, size, _), (prefetched_outputs, prefetched_rows, prefetched_size, stats) = runs
    assert all(torch.equal(a, b) for a, b in zip(outputs, prefetched_outputs))
    assert torch.equal(rows, prefetched_rows) and size == prefetched_size
    assert stats["prefetch"]["batches"] == len(batches)
    assert stats["prefetch"]["window_batches"] == 0 and stats["prefetch"]["pinned_rows"] == 0


@pytest.mark.parametrize("host_backend", ["openmp", "torch"])
def test_rows_pinned_in_a_device_tier_over_a_host_tier_train_the_same(tmp_path, device_tier, host_backend):
    batches = bag_batches(6, 25, 4)
    runs = []
    for lookahead in (None, 3):
        table = TieredEmbeddingBag(
            None,
            4,
            mode="sum",
            path=tmp_path / f"t{lookahead}",
            host_cache=20,
            device_cache=16,
            optimizer=optim.Adagrad(lr=0.1),
            host_cache_backend=host_backend,
            **device_tier,
        )
        outputs = [out.cpu() for out in train(table, batches, lookahead)]
        stats = table.store.stats()
        runs.append((outputs, table.store.get(torch.arange(ROWS), with_state=True, grow=False).cpu(), stats))
        table.close()
    (outputs, rows, plain), (prefetched_outputs, prefetched_rows, stats) = runs
    assert all(torch.equal(a, b) for a, b in zip(outputs, prefetched_outputs))
    assert torch.equal(rows, prefetched_rows)
    assert plain["host"]["rows_in"] > 20 and stats["prefetch"]["pinned_batches"] > 0  # rows moved all along


TWO_TABLES = [
    EmbeddingBagConfig(50, 8, name="user", feature_names=["user_id"]),
    EmbeddingBagConfig(40, 4, name="item", feature_names=["item_id"], pooling="mean"),
]


def two_feature_batches(count, draw):
    """``count`` KeyedJaggedTensors of ``TWO_TABLES``' features, 0-2 ids a bag, 6 samples, the ids
    ``draw(rows, n)``."""
    rng = np.random.default_rng(5)
    batches = []
    for _ in range(count):
        lengths = rng.integers(0, 3, (2, 6))
        values = np.concatenate([draw(rng, 50, int(lengths[0].sum())), draw(rng, 40, int(lengths[1].sum()))])
        batches.append(
            KeyedJaggedTensor(
                ["user_id", "item_id"],
                torch.from_numpy(values),
                lengths=torch.from_numpy(lengths.reshape(-1)),
            )
        )
    return batches


def train_collection(path, batches, host_cache, loop_of=None):
    """``(outputs, {group: {key: row}}, stats)`` of a collection of ``TWO_TABLES`` trained on
    ``batches``, through ``loop_of(batches, collection)`` if given."""
    collection = TieredEmbeddingBagCollection(
        TWO_TABLES, path, host_cache=host_cache, optimizer=optim.Adagrad(lr=0.1)
    )
    outputs = []
    for kjt in batches if loop_of is None else loop_of(batches, collection):
        out = collection(kjt).values()
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        outputs.append(out.detach())
    stored = {
        group: dict(zip(*(t.tolist() for t in _all_rows(collection.groups[group].store))))
        for group in collection.groups
    }
    stats = collection.stats()
    collection.close()
    return outputs, stored, stats


def test_the_collection_trains_the_same_with_the_pipeline(tmp_path):
    batches = two_feature_batches(15, lambda rng, rows, n: rng.integers(0, rows, n))
    outputs, stored, _ = train_collection(tmp_path / "plain", batches, 30)
    prefetched_outputs, prefetched_stored, stats = train_collection(
        tmp_path / "prefetched", batches, 30, lambda b, c: tierstore.prefetch(b, c, 4, background=True)
    )
    assert all(torch.equal(a, b) for a, b in zip(outputs, prefetched_outputs))
    assert stored == prefetched_stored
    assert all(stats["groups"][group]["prefetch"]["pinned_batches"] > 0 for group in ("dim8", "dim4"))


def _all_rows(store):
    keys, rows = zip(*store.iter_rows(with_state=True))
    keys, rows = torch.cat(keys), torch.cat(rows)
    order = torch.argsort(keys)
    return keys[order], rows[order]


def preloaded_table(path, host_rows, rows=ROWS):
    """A table holding ``rows`` trained rows in its cold store, its host cache ``host_rows``."""
    table = TieredEmbeddingBag(None, 4, mode="sum", path=path, host_cache=host_rows)
    table.load_weights(torch.arange(rows), torch.randn(rows, 4, generator=torch.Generator().manual_seed(7)))
    return table


def test_the_steps_find_their_rows_resident(tmp_path):
    batches = bag_batches(1, 30, 4)
    demand = {}
    for lookahead in (None, 3):
        with closing(preloaded_table(tmp_path / f"t{lookahead}", host_rows=30)) as table:
            before = table.store.stats()["host"]["misses"]
            train(table, batches, lookahead)
            demand[lookahead] = table.store.stats()["host"]["misses"] - before
    assert demand[None] > 20  # rows move all along
    assert demand[3] == 0  # every lookup of a step hit: its rows were moved ahead


def test_the_window_shrinks_to_its_room_and_skips_batches_larger_than_it(tmp_path):
    # 20 rows: room for the window is 20 less the largest batch's distinct ids (up to 8 here)
    batches = bag_batches(2, 25, 4)
    big = (torch.arange(ROWS)[:15], torch.tensor([0]))  # 15 distinct: more than the room it leaves
    batches = batches[:10] + [big] + batches[10:]
    with closing(preloaded_table(tmp_path / "t", host_rows=20)) as table:
        plain = TieredEmbeddingBag(None, 4, mode="sum", host_cache=20)
        plain.load_weights(torch.arange(ROWS), table.store.get(torch.arange(ROWS), grow=False))
        for ids, offsets in tierstore.prefetch(
            batches, table, lookahead=8, ids=lambda b: b[0], background=True
        ):
            assert table.store.stack.top.pinned_count() <= 20 - 4  # the room never overflows
            table(ids, offsets).sum().backward()
            plain(ids, offsets).sum().backward()
        stats = table.store.stats()["prefetch"]
        assert stats["waits"] > 0 and stats["skipped_batches"] >= 1
        assert stats["pinned_batches"] + stats["skipped_batches"] == len(batches)
        assert torch.equal(table.store.get(torch.arange(ROWS)), plain.store.get(torch.arange(ROWS)))
        plain.close()


def test_batches_come_out_unchanged_in_order_whatever_they_are(tmp_path):
    with closing(preloaded_table(tmp_path / "t", host_rows=30)) as table:
        batches = [{"ids": torch.tensor([index, index + 1]), "label": index} for index in range(12)]
        batches.insert(5, {"ids": torch.tensor([-1]), "label": "bad"})  # the module refuses it: not pinned
        seen = list(tierstore.prefetch(batches, table, lookahead=2, ids=lambda b: b["ids"], background=True))
        assert all(a is b for a, b in zip(seen, batches)) and len(seen) == len(batches)
        assert table.store.stack.top.pinned_count() == 0


@pytest.mark.parametrize("ending", ["all batches run", "the loop left early", "the loader failed"])
def test_a_loop_ending_stops_its_worker_without_waiting_out_a_timeout(tmp_path, monkeypatch, ending):
    """Each loop's end stops its worker and drains what it read ahead; the worker's last item says
    it is gone, so the drain never waits for a timeout on a queue no one will fill (which cost a
    short loop, such as an evaluation's, 50 ms at every end)."""
    waited_on_nothing = []
    get = lookahead_module.queue.Queue.get

    def get_noting_a_wait_past_the_worker(queue, *arguments, **keywords):
        try:
            return get(queue, *arguments, **keywords)
        except lookahead_module.queue.Empty:
            workers = [t for t in threading.enumerate() if t.name == "tierstore-prefetch"]
            waited_on_nothing.append(not any(worker.is_alive() for worker in workers))
            raise

    monkeypatch.setattr(lookahead_module.queue.Queue, "get", get_noting_a_wait_past_the_worker)

    def loader():
        for index in range(6):
            yield torch.tensor([index, index + 1])
        if ending == "the loader failed":
            raise RuntimeError("the loader broke")

    with closing(preloaded_table(tmp_path / "t", host_rows=30)) as table:
        for _ in range(3):
            loop = tierstore.prefetch(loader(), table, lookahead=4, background=True)
            try:
                for index, ids in enumerate(loop):
                    table(ids.reshape(1, -1)).sum().backward()
                    if ending == "the loop left early" and index == 2:
                        break
            except RuntimeError as error:
                assert ending == "the loader failed" and "the loader broke" in str(error)
            finally:
                loop.close()
            assert not any(t.name == "tierstore-prefetch" for t in threading.enumerate())
            assert table.store.stack.top.pinned_count() == 0
    assert not any(waited_on_nothing)


def test_a_loader_error_is_raised_in_the_loop_at_its_batch(tmp_path):
    def loader():
        for index in range(3):
            yield torch.tensor([index])
        raise RuntimeError("the loader broke")

    with closing(preloaded_table(tmp_path / "t", host_rows=30)) as table:
        seen = []
        with pytest.raises(RuntimeError, match="the loader broke"):
            for ids in tierstore.prefetch(loader(), table, lookahead=4, background=True):
                seen.append(int(ids))
        assert seen == [0, 1, 2]
        assert table.store.stack.top.pinned_count() == 0


def test_a_damaged_store_is_raised_in_the_loop_and_never_served(tmp_path):
    with closing(preloaded_table(tmp_path / "t", host_rows=10)) as table:
        table.flush()
    rows_file = tmp_path / "t" / "rows.bin"
    data = bytearray(rows_file.read_bytes())
    data[40 * 20 + 3] ^= 0xFF  # a byte of the row stored 41st (4 floats + a 4-byte check each)
    rows_file.write_bytes(bytes(data))
    with closing(TieredEmbeddingBag(None, 4, mode="sum", path=tmp_path / "t", host_cache=10)) as table:
        batches = [torch.tensor([index]) for index in range(ROWS)]
        with pytest.raises(StoreFormatError, match="fail their checksum"):
            for ids in tierstore.prefetch(batches, table, lookahead=4, background=True):
                table(ids, torch.tensor([0]))


def test_leaving_the_loop_stops_the_worker_and_unpins_its_rows(tmp_path):
    with closing(preloaded_table(tmp_path / "t", host_rows=30)) as table:
        batches = bag_batches(3, 40, 3)
        loop = tierstore.prefetch(batches, table, lookahead=6, ids=lambda b: b[0], background=True)
        for step, (ids, offsets) in enumerate(loop):
            table(ids, offsets).sum().backward()
            if step == 4:
                break
        loop.close()  # what the loop's end does to a generator nobody holds
        assert table.store.stack.top.pinned_count() == 0
        assert table.store.stats()["prefetch"]["window_batches"] == 0
        assert not any(thread.name == "tierstore-prefetch" for thread in threading.enumerate())
        table(*batches[5]).sum().backward()  # the table goes on as before


@pytest.mark.parametrize(
    "arguments, error, message",
    [
        ({"lookahead": 0}, ValueError, "lookahead must be an int in"),
        ({"lookahead": MAX_LOOKAHEAD + 1}, ValueError, "lookahead must be an int in"),
        ({"lookahead": 2.0}, ValueError, "lookahead must be an int in"),
        ({"ids": "sparse"}, TypeError, "ids must be a function"),
        ({"module": torch.nn.EmbeddingBag(4, 2)}, TypeError, "module must be a TieredEmbeddingBag"),
        ({"background": "yes"}, TypeError, "background must be True, False or None"),
    ],
)
def test_bad_arguments_are_named_before_anything_starts(tmp_path, arguments, error, message):
    with closing(preloaded_table(tmp_path / "t", host_rows=30)) as table:
        settings = {"module": table, **arguments}
        module = settings.pop("module")
        with pytest.raises(error, match=message):
            tierstore.prefetch(iter([]), module, **settings)


KILLED_RUN = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    import tierstore
    sys.path.insert(0, sys.argv[2])
    from test_prefetch import bag_batches, preloaded_table
    table = preloaded_table(sys.argv[1], host_rows=20)
    batches = bag_batches(4, 30, 4)
    loop = tierstore.prefetch(batches, table, 5, ids=lambda b: b[0], background=True)
    for step, (ids, offsets) in enumerate(loop):
        table(ids, offsets).sum().backward()
        if step == 9:
            table.flush()
        if step == 14:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-epoch, the worker pinning batches ahead
    """
)


def test_a_loop_killed_mid_epoch_leaves_the_store_at_its_last_flush(tmp_path):
    tests = str(Path(__file__).parent)
    run = subprocess.run([sys.executable, "-c", KILLED_RUN, str(tmp_path / "t"), tests], capture_output=True)
    assert run.returncode == -9, run.stderr.decode()
    with closing(preloaded_table(tmp_path / "reference", host_rows=20)) as reference:
        for step, (ids, offsets) in enumerate(bag_batches(4, 30, 4)):
            reference(ids, offsets).sum().backward()
            if step == 9:
                break
        expected = reference.store.get(torch.arange(ROWS), with_state=True, grow=False)
    with closing(TieredEmbeddingBag(None, 4, mode="sum", path=tmp_path / "t", host_cache=20)) as reopened:
        assert torch.equal(reopened.store.get(torch.arange(ROWS), with_state=True, grow=False), expected)


def test_pinning_more_rows_than_the_tier_holds_is_refused_and_pins_nothing(tmp_path):
    with closing(preloaded_table(tmp_path / "t", host_rows=10)) as table:
        with pytest.raises(
            tierstore.CacheCapacityError, match="pinning 20 rows needs more than the host cache's 10"
        ):
            table.store.pin_rows(torch.arange(20))
        assert table.store.stack.top.pinned_count() == 0
        keys, slots, moved = table.store.pin_rows(torch.arange(8))
        assert moved == 8 and table.store.stack.top.pinned_count() == 8
        table.store.unpin_rows(keys, slots)
        assert table.store.stack.top.pinned_count() == 0


def test_a_warm_start_in_the_background_fills_the_caches_and_changes_no_row(tmp_path):
    """``prefetch(warm=)``: the worker loads the ranking's rows while its window is full; the
    training is the same, bit for bit, as without it (and without the pipeline)."""
    batches = bag_batches(5, 40, 4)
    results = []
    for name, lookahead, warm in (("plain", None, None), ("warm", 1, torch.arange(ROWS - 1, -1, -1))):
        path = tmp_path / name
        seed = TieredEmbeddingBag(None, 4, path=path, optimizer=optim.Adagrad(lr=0.1), host_cache=4 * ROWS)
        seed(torch.arange(ROWS), torch.arange(ROWS))  # every row joins the table
        seed.store.close()  # flushes
        table = TieredEmbeddingBag(None, 4, path=path, optimizer=optim.Adagrad(lr=0.1), host_cache=40)
        if warm is None:
            outputs = train(table, batches)
        else:
            torch.manual_seed(0)
            targets = [torch.randn(offsets.numel(), 4) for _, offsets in batches]
            outputs = []
            loop = tierstore.prefetch(
                batches, table, lookahead, ids=lambda b: b[0], warm=warm, background=True
            )
            for step, (ids, offsets) in enumerate(loop):
                out = table(ids, offsets)
                (out * targets[step]).sum().backward()
                outputs.append(out.detach())
            stats = table.store.stats()["prefetch"]
            assert stats["warmed_rows"] > 0 and table.store.warmed_rows == stats["warmed_rows"]
        results.append((outputs, table.store.get(torch.arange(ROWS), with_state=True)))
        table.store.close()
    (plain_out, plain_rows), (warm_out, warm_rows) = results
    assert all(torch.equal(a, b) for a, b in zip(plain_out, warm_out))
    assert torch.equal(plain_rows, warm_rows)


def test_a_bad_warm_ranking_is_refused_before_the_loop_starts():
    table = TieredEmbeddingBag(None, 4, host_cache=16)
    with pytest.raises(ValueError, match="warm"):
        tierstore.prefetch(bag_batches(0, 2, 2), table, 2, warm=[-3])
    with pytest.raises(KeyError, match="unknown table"):
        collection = TieredEmbeddingBagCollection([EmbeddingBagConfig(10, 4, name="t", feature_names=["f"])])
        tierstore.prefetch([], collection, 2, warm={"u": [1]})


def test_the_inline_pipeline_passes_batches_through_and_trains_the_same(tmp_path):
    """``background=False``: no worker, nothing pinned; the rows and outputs are the plain loop's."""
    batches = bag_batches(3, 12, 6)
    results = []
    for name, loop_of in (
        ("plain", lambda b, t: b),
        ("inline", lambda b, t: tierstore.prefetch(b, t, 4, ids=lambda x: x[0], background=False)),
    ):
        with closing(preloaded_table(tmp_path / name, host_rows=30)) as table:
            threads = threading.active_count()
            outputs = []
            for ids, offsets in loop_of(batches, table):
                assert threading.active_count() == threads  # no worker
                assert table.store.stack.top.pinned_count() == 0
                out = table(ids, offsets)
                (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
                outputs.append(out.detach())
            results.append((outputs, table.store.get(torch.arange(40), with_state=True)))
    (outputs, rows), (inline_outputs, inline_rows) = results
    assert all(torch.equal(a, b) for a, b in zip(outputs, inline_outputs))
    assert torch.equal(rows, inline_rows)


def test_the_inline_pipeline_loads_a_warm_ranking_between_batches(tmp_path):
    with closing(preloaded_table(tmp_path / "t", host_rows=30)) as table:
        table.store.stack.top.clear()
        loop = tierstore.prefetch(
            bag_batches(0, 3, 2), table, 2, ids=lambda b: b[0], warm=list(range(10, 20)), background=False
        )
        for _ in loop:
            pass
        assert table.store.stats()["prefetch"]["warmed_rows"] == 10
        assert bool((table.store.stack.top.find(torch.arange(10, 20)) >= 0).all())


@pytest.mark.parametrize("background", [None, False])
def test_the_pipeline_runs_inline_by_default_whatever_the_cores(tmp_path, monkeypatch, background):
    """The worker is measured slower than inline everywhere it was tried (README, "Worker or
    inline"), many cores included: the default starts no thread, on any machine."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    with closing(preloaded_table(tmp_path / "t", host_rows=30)) as table:
        for ids, offsets in tierstore.prefetch(
            bag_batches(0, 4, 2), table, 2, ids=lambda b: b[0], background=background
        ):
            assert not any(t.name == "tierstore-prefetch" for t in threading.enumerate())
            table(ids, offsets).sum().backward()
