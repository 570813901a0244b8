"""``tierstore profile``: the samplers against exact counts, the predicted hit rates against the
ones ``bench`` measures on the whole trace, the cost model's choice, and the command."""

import json

import numpy as np
import pytest

from tierstore.analysis.cost_model import Bandwidths, hit_rate_at, movement_seconds, plan
from tierstore.analysis.hit_rates import run_store
from tierstore.analysis.profile import (
    MIN_SAMPLED_IDS,
    MIN_SCALED_ROWS,
    coverage_rows,
    exact_counts,
    profile_trace,
)
from tierstore.analysis.reference_policies import belady_hits
from tierstore.analysis.sampling import ranked_ids, spatial_sample
from tierstore.analysis.traces import load_trace
from tierstore.cli import main
from tierstore.hashing import HASH_SPACE, id_hash


def test_a_spatial_sample_keeps_every_access_of_the_ids_it_samples():
    keys = load_trace("zipf:alpha=1.05,n=20000,length=100000,seed=2").keys
    sample = spatial_sample(keys, 0.1, max_ids=10**6)
    chosen = id_hash(keys) < round(0.1 * HASH_SPACE)
    np.testing.assert_array_equal(sample.keys, keys[chosen])  # in trace order, nothing else
    assert sample.distinct / np.unique(keys).size == pytest.approx(0.1, abs=0.02)


def test_a_spatial_sample_never_holds_more_ids_than_max_ids():
    keys = load_trace("uniform:n=50000,length=300000,seed=1").keys  # more than one chunk's worth
    sample = spatial_sample(keys, 0.5, max_ids=1000)
    assert sample.distinct <= 1000
    threshold = round(sample.rate * HASH_SPACE)  # the lowered rate keeps exactly its ids' accesses
    np.testing.assert_array_equal(sample.keys, keys[id_hash(keys) < threshold])
    assert sample.rate < 0.05
    assert sample.nbytes < 64 * 1000 * 8  # bounded by the ids kept, not by the trace


def test_ranked_ids_find_the_hot_ids_from_a_sample_of_the_accesses():
    keys = load_trace("zipf:alpha=1.1,n=100000,length=400000,seed=4").keys
    ids, counts, held = ranked_ids(keys, 0.2, limit=200)
    exact = np.argsort(-np.bincount(keys))[:200]
    assert ids.size == 200 and np.all(np.diff(counts) <= 0)
    assert np.intersect1d(ids[:100], exact).size >= 90
    assert held < 400000 * 8  # the candidates, not the trace


def test_coverage_rows_estimate_the_hot_set_sizes():
    keys = load_trace("zipf:alpha=1.05,n=100000,length=400000,seed=5").keys
    ids, counts, _ = ranked_ids(keys, 0.05, limit=5000)
    head = ids[counts >= 10]
    estimated = coverage_rows(spatial_sample(keys, 0.05, 10**6), head, exact_counts(keys, head))
    covered = np.cumsum(np.sort(np.bincount(keys))[::-1]) / keys.size
    for share, rows in estimated.items():
        exact = int(np.searchsorted(covered, float(share[:-1]) / 100)) + 1
        assert rows == pytest.approx(exact, rel=0.25), share


@pytest.mark.parametrize(
    "spec, shares",
    [
        ("zipf:alpha=1.05,n=1000000,length=400000,seed=1", (0.05, 0.10)),
        ("drift:n=2000000,hot=20000,period=40000,length=400000,seed=2", (0.05, 0.10)),
        ("zipf:alpha=1.05,n=100000,length=200000,seed=3", (0.01, 0.05, 0.10)),
    ],
)
def test_a_sample_predicts_the_measured_hit_rates_within_two_points(spec, shares):
    trace = load_trace(spec)
    distinct = np.unique(trace.keys).size
    sizes = [round(share * distinct) for share in shares]
    report, _ = profile_trace(trace, [str(rows) for rows in sizes], 0.05, 10**6, progress=False)
    # these traces are small: 5% would hold too few ids, or simulate the smallest size in too few rows
    wanted = max(0.05, MIN_SAMPLED_IDS / distinct, MIN_SCALED_ROWS / sizes[0])
    assert report["sample"]["raised"]
    assert report["sample"]["rate"] == pytest.approx(min(wanted, 1.0), rel=0.05)
    for number, rows in enumerate(sizes):
        measured_lfu = run_store(trace, rows, min(4096, rows), 16, "mmap", progress=False)["hit_rate"]
        measured_min = belady_hits(trace.keys, rows) / trace.keys.size
        predicted = report["predicted_hit_rate"]
        assert predicted["lfu"][number] == pytest.approx(measured_lfu, abs=0.02), rows
        assert predicted["min"][number] == pytest.approx(measured_min, abs=0.02), rows


def test_the_curve_is_read_between_its_points_in_log_size():
    rows, rates = [10, 1000], [0.2, 0.6]
    assert hit_rate_at(rows, rates, 100) == pytest.approx(0.4)  # halfway in log
    assert hit_rate_at(rows, rates, 5) == pytest.approx(0.1)  # below: towards nothing at 0 rows
    assert hit_rate_at(rows, rates, 10**6) == pytest.approx(0.6)
    assert hit_rate_at(rows, rates, 0) == 0


def test_movement_counts_a_cold_read_and_write_per_host_miss_and_two_copies_per_device_miss():
    on_cpu = Bandwidths(cold_read=100.0, cold_write=50.0, dram_gather=1000.0, host_to_device=None)
    rows, rates = [10, 100, 1000], [0.5, 0.5, 0.9]
    seconds, moved = movement_seconds(rows, rates, 0, 1000, lookups=10, row_bytes=4, bandwidths=on_cpu)
    assert moved == pytest.approx(2 * 10 * 0.1)
    assert seconds == pytest.approx(10 * 0.1 * 4 * (1 / 100 + 1 / 50) + 10 * 4 / 1000)  # all gathered
    bandwidths = Bandwidths(cold_read=100.0, cold_write=50.0, dram_gather=1000.0, host_to_device=400.0)
    seconds, moved = movement_seconds(rows, rates, 0, 1000, lookups=10, row_bytes=4, bandwidths=bandwidths)
    assert moved == pytest.approx(2 * 10 * 0.1 + 2 * 10)  # no device tier: every row crosses, twice
    seconds, moved = movement_seconds(rows, rates, 100, 900, lookups=10, row_bytes=4, bandwidths=bandwidths)
    assert moved == pytest.approx(2 * 10 * 0.1 + 2 * 10 * 0.5)  # the device tier misses half
    # the device tier misses half: those cross twice and are gathered from the host tier
    assert seconds == pytest.approx(10 * 0.1 * 4 * (1 / 100 + 1 / 50) + 10 * 0.5 * 4 * (2 / 400 + 1 / 1000))


def test_the_recommendation_is_the_smallest_budget_near_the_best():
    bandwidths = Bandwidths(cold_read=1e6, cold_write=1e6, dram_gather=1e8, host_to_device=None)
    rows = [100, 1000, 10000, 100000]
    flat_after_1000 = [0.5, 0.95, 0.951, 0.952]  # more than 1000 rows buys almost nothing
    advice = plan(rows, flat_after_1000, 100, 16, bandwidths, host_memory=2**30, device_memory=0)
    assert advice["host_cache_rows"] == 1000 and advice["device_cache_rows"] == 0
    assert advice["predicted_movement_ms_per_step"] <= 1.05 * advice["best_movement_ms_per_step"]
    rising = [0.1, 0.3, 0.6, 0.99]
    assert plan(rows, rising, 100, 16, bandwidths, 2**30, 0)["host_cache_rows"] == 100000
    small = plan(rows, rising, 100, 16, bandwidths, host_memory=200_000, device_memory=0)
    assert small["host_cache_rows"] == 1000  # the most that fits in the memory given
    with pytest.raises(ValueError, match="--host-memory"):
        plan(rows, rising, 100, 16, bandwidths, host_memory=1000, device_memory=0)
    with_gpu = Bandwidths(cold_read=1e6, cold_write=1e6, dram_gather=1e8, host_to_device=1e7)
    split = plan(rows, rising, 100, 16, with_gpu, host_memory=2**30, device_memory=2**30)
    assert split["device_cache_rows"] == 100000  # every device miss is a copy: it takes what it can
    assert split["host_cache_rows"] == 100  # the device tier holds the rest: the host needs a batch
    assert split["device_memory_bytes"] == 2**30
    assert plan(rows, rising, 100, 16, with_gpu, 2**30, 0)["device_cache_rows"] == 0


def test_profile_writes_the_figures_bench_can_be_compared_with(tmp_path, capsys):
    out = tmp_path / "profile"
    code = main(
        [
            "profile",
            "zipf:alpha=1.05,n=20000,length=60000,seed=3",
            "--sample",
            "20%",
            "--sizes",
            "1%,500,64KiB",
            "--batch-size",
            "256",
            "--quiet",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert len(report["sizes_rows"]) == 3 and report["sizes_rows"][1] == 500
    assert report["sizes_rows"][2] == 64 * 1024 // 64  # bytes of dim-16 rows
    for policy in ("lfu", "min"):
        rates = report["predicted_hit_rate"][policy]
        assert len(rates) == 3 and all(0 <= rate <= 1 for rate in rates)
    assert all(lfu <= best + 1e-9 for lfu, best in zip(report["curve"]["lfu"], report["curve"]["min"]))
    assert set(report["hot_set_rows"]) == {"50%", "80%", "90%", "99%"}
    hot = np.load(out.with_suffix(".npy"))
    assert hot.dtype == np.int64 and hot.size == max(report["sizes_rows"])
    assert report["recommendation"]["host_cache_bytes"] > 0
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "predicted hit rate" in printed and "recommended: host_cache=" in printed


def test_profile_of_several_columns_ranks_each_columns_own_ids(tmp_path, capsys):
    rng = np.random.default_rng(5)
    users, items = rng.zipf(1.3, 6000) % 300, rng.zipf(1.6, 6000) % 50
    lines = ["user,item"] + [f"{u},{i}" for u, i in zip(users, items)]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "profile"
    arguments = ["profile", str(tmp_path / "t.csv"), "--columns", "user,item", "--sizes", "40"]
    assert main([*arguments, "--quiet", "--out", str(out)]) == 0
    fused = np.load(out.with_suffix(".npy"))
    offset = users.max() + 1  # items' keys follow the users' in the fused key space
    with np.load(tmp_path / "profile-tables.npz") as tables:
        assert sorted(tables.files) == ["item", "user"]
        assert tables["user"].tolist() == fused[fused < offset].tolist()
        assert tables["item"].tolist() == (fused[fused >= offset] - offset).tolist()
        assert set(tables["item"][:5].tolist()) == set(np.argsort(-np.bincount(items))[:5].tolist())
    assert "profile-tables.npz" in capsys.readouterr().out


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--sample", "0%"], "--sample must be a share"),
        (["--sample", "half"], "--sample must be a share"),
        (["--host-memory", "lots"], "--host-memory"),
        (["--sizes", ","], "names no size"),
        (["--sizes", "1%,lots"], "cache size 'lots' does not parse"),
        (["--sizes", "0"], "holds no rows"),
    ],
)
def test_profile_names_a_bad_option(tmp_path, capsys, arguments, message):
    out = tmp_path / "profile"
    trace = "no-such-trace.csv"  # the options are checked before the trace is read
    assert main(["profile", trace, "--quiet", "--out", str(out), *arguments]) == 2
    assert message in capsys.readouterr().err
    assert not out.with_suffix(".json").exists()
