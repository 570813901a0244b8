"""``tierstore bench``: traces, the reference policies (Belady's MIN, alone and over batches, against
brute force) and the command."""

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.analysis.reference_policies import (
    batched_belady_hits,
    belady_hits,
    next_uses,
    policy_hit_counts,
    policy_hits,
)
from tierstore.analysis.traces import load_trace, split_columns
from tierstore.cli import main
from tierstore.kernels.replay import replay_library


def most_hits_by_brute_force(keys, capacity):
    """The most hits of any demand-paging cache: try every victim at every miss."""

    def best(position, resident):
        if position == len(keys):
            return 0
        key = keys[position]
        if key in resident:
            return 1 + best(position + 1, resident)
        if len(resident) < capacity:
            return best(position + 1, resident | {key})
        return max(best(position + 1, (resident - {victim}) | {key}) for victim in resident)

    return best(0, frozenset())


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=11), st.integers(1, 4), st.booleans())
def test_belady_min_gets_the_most_hits_any_cache_can(keys, capacity, native):
    assert belady_hits(np.array(keys, dtype=np.int64), capacity, native) == most_hits_by_brute_force(
        keys, capacity
    )


def most_hits_in_batches_by_brute_force(keys, capacity, batch):
    """The most hits of any cache making each run of ``batch`` accesses resident whole (every miss
    admitted when its batch runs): try every set of victims outside the batch at every batch."""

    def best(start, resident):
        if start >= len(keys):
            return 0
        looked_up = set(keys[start : start + batch])
        missed = looked_up - resident
        hits = len(keys[start : start + batch]) - len(missed)
        excess = len(resident) + len(missed) - capacity
        if excess <= 0:
            return hits + best(start + batch, resident | missed)
        return hits + max(
            best(start + batch, (resident - set(victims)) | missed)
            for victims in itertools.combinations(sorted(resident - looked_up), excess)
        )

    return best(0, frozenset())


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=12), st.integers(1, 4), st.integers(1, 4), st.booleans())
def test_min_over_batches_gets_the_most_hits_any_batched_cache_can(keys, capacity, batch, native):
    if any(len(set(keys[start : start + batch])) > capacity for start in range(0, len(keys), batch)):
        with pytest.raises(ValueError, match="more distinct keys than the capacity"):
            batched_belady_hits(np.array(keys, dtype=np.int64), capacity, batch, native)
        return
    hits = batched_belady_hits(np.array(keys, dtype=np.int64), capacity, batch, native)
    assert hits == most_hits_in_batches_by_brute_force(keys, capacity, batch)
    assert hits <= belady_hits(np.array(keys, dtype=np.int64), capacity)  # batching only constrains


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(-3, 40), max_size=300),
    st.lists(st.integers(1, 45), min_size=1, max_size=3),
)
def test_the_native_replays_count_the_hits_of_the_python_ones(keys, capacities):
    assert replay_library() is not None  # g++ is here: the native loops must build
    keys = np.array(keys, dtype=np.int64) * 1_000_003  # sparse ids: made dense first
    policies = ["lru", "fifo", "belady"]
    batches = [max(1, capacity // 3) for capacity in capacities]
    native = policy_hit_counts(keys, capacities, policies, batches=batches)
    assert native == policy_hit_counts(keys, capacities, policies, native=False, batches=batches)
    assert native["belady_batched"] == [batched_belady_hits(keys, c, b) for c, b in zip(capacities, batches)]
    ones = policy_hit_counts(keys, capacities, [], batches=[1] * len(capacities))["belady_batched"]
    assert ones == native["belady"]  # batches of one access: MIN itself


def test_min_over_batches_refuses_what_it_cannot_replay():
    keys = np.array([1, 2, 3, 1, 2, 3])
    too_many = "batch of 3 accesses holds more distinct keys than the capacity of 2"
    with pytest.raises(ValueError, match=too_many):
        batched_belady_hits(keys, 2, 3)
    with pytest.raises(ValueError, match="batch must be at least 1"):
        batched_belady_hits(keys, 2, 0)
    with pytest.raises(ValueError, match="capacity must be at least 1"):
        batched_belady_hits(keys, 0, 1)
    with pytest.raises(ValueError, match="2 batch sizes for 1 capacities"):
        policy_hit_counts(keys, [2], ["belady"], batches=[1, 1])


def test_min_over_batches_pays_for_holding_a_batch_whole():
    # capacity 2, batches (0 0) (1 2) (0): the second batch needs 1 and 2 resident together, so 0
    # goes; one access at a time, MIN evicts 1 (never used again) when 2 comes and keeps 0
    keys = np.array([0, 0, 1, 2, 0])
    assert batched_belady_hits(keys, 2, 2) == 1
    assert belady_hits(keys, 2) == 2


@given(st.lists(st.integers(0, 6), max_size=30))
def test_next_uses_point_at_the_next_access_of_the_same_key(keys):
    following = next_uses(np.array(keys, dtype=np.int64))
    for position, key in enumerate(keys):
        later = [p for p in range(position + 1, len(keys)) if keys[p] == key]
        assert following[position] == (later[0] if later else np.iinfo(np.int64).max)


def test_lru_and_fifo_differ_as_they_should():
    keys = np.array([1, 2, 1, 3, 1, 4, 1])  # 1 stays hot: LRU keeps it, FIFO evicts it
    assert policy_hits(keys, 2, "lru") == 3
    assert policy_hits(keys, 2, "fifo") == 2
    assert policy_hits(keys, 2, "belady") == 3


def test_synthetic_traces_follow_their_specs():
    zipf = load_trace("zipf:alpha=1.2,n=1000,length=20000,seed=3")
    assert zipf.keys.size == 20000 and zipf.keys.max() < 1000
    counts = np.sort(np.bincount(zipf.keys, minlength=1000))[::-1]
    weights = np.arange(1, 1001) ** -1.2  # rank r has probability ~ r^-alpha
    assert counts[:10].sum() / 20000 == pytest.approx(weights[:10].sum() / weights.sum(), abs=0.02)
    uniform = load_trace("uniform:n=50,length=5000")
    assert set(np.unique(uniform.keys)) == set(range(50))
    drift = load_trace("drift:n=100000,hot=100,period=1000,length=5000")
    windows = [set(drift.keys[i : i + 1000]) for i in range(0, 5000, 1000)]
    assert all(not (a & b) for a, b in zip(windows, windows[1:]))  # each period, fresh hot ids


@pytest.mark.parametrize("kind", ["zipf:alpha=1.2,n=1000", "drift:n=100000,hot=100,period=1000"])
def test_a_share_of_one_off_ids_is_looked_up_exactly_once(kind):
    plain = load_trace(f"{kind},length=20000,seed=3").keys
    keys = load_trace(f"{kind},length=20000,seed=3,once=0.6").keys
    once = keys >= (1000 if kind.startswith("zipf") else 100000)
    assert once.mean() == pytest.approx(0.6, abs=0.02)
    assert np.unique(keys[once]).size == once.sum()  # each looked up once
    assert (keys[~once] == plain[~once]).all()  # the rest is the trace without them


def test_csv_columns_fuse_with_offsets_and_categorical_values(tmp_path):
    (tmp_path / "t.csv").write_text("user,item,kind\n5,10,pv\n7,10,buy\n5,,pv\n")
    trace = load_trace(str(tmp_path / "t.csv"), columns=["user", "item", "kind"])
    # users 0..7 -> keys 0..7, items 0..10 -> 8..18, kinds pv=0, buy=1 -> 19, 20; the empty item is skipped
    assert trace.keys.tolist() == [5, 18, 19, 7, 18, 20, 5, 19]
    assert trace.columns == [("user", 0, 8), ("item", 8, 19), ("kind", 19, 21)]
    assert load_trace(str(tmp_path / "t.csv"), columns=["1"]).keys.tolist() == [10, 10]


def test_criteo_layout_uses_the_hex_categorical_columns(tmp_path):
    line = ["1"] + [str(i) for i in range(13)] + ["a"] + [""] * 24 + ["ff"]
    (tmp_path / "day.txt").write_text("\t".join(line) + "\n")
    trace = load_trace(str(tmp_path / "day.txt"), criteo=True)
    assert trace.keys.tolist() == [10, 11 + 255]  # C1 = 0xa; C26 = 0xff after C1's span 0..10


@pytest.mark.parametrize(
    "args, message",
    [
        (["nothere.csv", "--columns", "a"], "no such trace file"),
        (["{csv}", "--columns", "rating"], "unknown column 'rating'"),
        (["{csv}"], "choose the id columns with --columns"),
        (["{empty}", "--columns", "0"], "the trace is empty"),
        (["{csv}", "--criteo"], "the Criteo layout has 40 tab-separated fields"),
        (["zipf:alpha=1.05"], "n required"),
        (["zipf:n=abc"], "must be name=number"),
        (["zipf:n=10,once=1"], "once must be a share of the accesses in [0, 1)"),
        (["uniform:n=10,once=0.5"], "options are length, n, seed"),
        (["{csv}", "--columns", "user", "--sizes", "lots"], "cache size 'lots' does not parse"),
        (["{csv}", "--columns", "user", "--policy", "lru,arc"], "unknown --policy arc"),
        (["{csv}", "--columns", "user", "--lookahead", "65"], "--lookahead must be in [0, 64]"),
        (["{csv}", "--columns", "user", "--horizon", "tenx"], "--horizon must be a multiple of each cache"),
        (["{csv}", "--columns", "user", "--horizon", "0"], "--horizon must be a multiple of each cache"),
    ],
)
def test_bad_bench_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    (tmp_path / "t.csv").write_text("user,item\n1,2\n3,4\n")
    (tmp_path / "e.csv").write_text("")
    args = [a.format(csv=tmp_path / "t.csv", empty=tmp_path / "e.csv") for a in args]
    assert main(["bench", *args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bench_reports_every_figure_and_draws_the_curve(tmp_path, capsys):
    keys = load_trace("zipf:alpha=1.05,n=20000,length=60000,seed=1").keys
    np.save(tmp_path / "trace.npy", keys)
    assert (
        main(
            [
                "bench",
                str(tmp_path / "trace.npy"),
                "--sizes",
                "2%,10%,3000",
                "--batch-size",
                "1024",
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "Belady MIN" in table and "MIN, batched" in table and "p99 ms" in table
    report = json.loads((tmp_path / "out.json").read_text())
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [entry["rows"] for entry in report["sizes"]][2] == 3000
    for entry in report["sizes"]:
        ours = entry["tierstore_lfu"]
        host = ours["tiers"]["host"]
        assert ours["hit_rate"] == pytest.approx(1 - host["rows_in"] / report["accesses"])
        assert ours["lookup_hit_rate"] <= ours["hit_rate"]
        assert (
            entry["lru"]["hit_rate"] <= entry["belady"]["hit_rate"]
            and entry["fifo"]["hit_rate"] <= entry["belady"]["hit_rate"]
        )
        assert ours["hit_rate"] <= entry["belady_batched"]["hit_rate"] <= entry["belady"]["hit_rate"]
        assert ours["hit_rate"] > entry["fifo"]["hit_rate"]  # LFU beats FIFO on a static Zipf
        assert host["evictions"] > 0 and ours["batch_latency_ms_p99"] >= ours["batch_latency_ms_p50"] > 0
    rates = [entry["belady"]["hit_rate"] for entry in report["sizes"]]
    assert rates[0] < rates[1]  # a bigger cache hits more


def test_bench_replays_through_a_lookahead_pipeline_beside_lfu(tmp_path, capsys):
    keys = load_trace("zipf:alpha=1.05,n=5000,length=20000,seed=2").keys
    np.save(tmp_path / "trace.npy", keys)
    arguments = ["bench", str(tmp_path / "trace.npy"), "--sizes", "20%", "--batch-size", "64"]
    assert main([*arguments, "--lookahead", "4", "--out", str(tmp_path / "out")]) == 0
    assert "lookahead 4" in capsys.readouterr().out
    entry = json.loads((tmp_path / "out.json").read_text())["sizes"][0]
    ahead, plain = entry["tierstore_lookahead"], entry["tierstore_lfu"]
    host = ahead["tiers"]["host"]
    assert ahead["hit_rate"] == pytest.approx(1 - host["rows_in"] / keys.size)  # rows moved ahead count
    assert ahead["hit_rate"] <= entry["belady"]["hit_rate"]  # nothing moves fewer rows than MIN
    assert ahead["tiers"]["prefetch"]["pinned_batches"] > 0
    assert plain["waited"] > 0.05 and ahead["waited"] == 0  # every batch found the rows it held resident


def test_bench_replays_evicting_by_next_use_and_with_each_fixed_ageing(tmp_path, capsys):
    keys = load_trace("zipf:alpha=0.9,n=20000,length=40000,seed=4").keys
    np.save(tmp_path / "trace.npy", keys)
    arguments = ["bench", str(tmp_path / "trace.npy"), "--sizes", "1600,3200", "--policy", "belady"]
    assert main([*arguments, "--horizon", "10x", "--ageing", "--out", str(tmp_path / "out")]) == 0
    table = capsys.readouterr().out
    assert "horizon 10x" in table and "no ageing" in table and "aged 4x" in table
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["horizon"] == "10x" and report["ageing"]
    for entry in report["sizes"]:
        foreseen, optimal = entry["tierstore_horizon"], entry["belady"]["hit_rate"]
        assert foreseen["tiers"]["prefetch"]["horizon"] == 10 * entry["rows"]
        assert 0.97 * optimal <= foreseen["hit_rate"] <= entry["belady_batched"]["hit_rate"] <= optimal
        assert foreseen["hit_rate"] > entry["tierstore_lfu"]["hit_rate"]
        assert foreseen["hit_rate"] == pytest.approx(1 - foreseen["tiers"]["host"]["rows_in"] / keys.size)
        fixed = max(entry["lfu_no_ageing"]["hit_rate"], entry["lfu_aged_4x"]["hit_rate"])
        assert entry["tierstore_lfu"]["hit_rate"] >= fixed - 0.005


def test_separate_tables_give_each_column_back_its_own_ids(tmp_path, capsys):
    rng = np.random.default_rng(2)
    lines = [f"{u},{i}" for u, i in zip(rng.zipf(1.5, 3000) % 500, rng.zipf(1.3, 3000) % 900)]
    (tmp_path / "t.csv").write_text("user,item\n" + "\n".join(lines) + "\n")
    fused = load_trace(str(tmp_path / "t.csv"), columns=["user", "item"])
    users, items = split_columns(fused)
    assert np.array_equal(items.keys, load_trace(str(tmp_path / "t.csv"), columns=["item"]).keys)
    assert np.array_equal(users.keys, load_trace(str(tmp_path / "t.csv"), columns=["user"]).keys)
    assert (
        main(
            [
                "bench",
                str(tmp_path / "t.csv"),
                "--columns",
                "user,item",
                "--separate",
                "--sizes",
                "10%",
                "--batch-size",
                "256",
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "out.json").read_text())
    assert [table["distinct_ids"] for table in report["tables"]] == [
        np.unique(users.keys).size,
        np.unique(items.keys).size,
    ]
    assert (tmp_path / "out-0.png").exists() and (tmp_path / "out-1.png").exists()
