"""Warm start (``warm=``): the ranked rows the table holds fill the caches at open, top tier first,
counting no lookup and changing no row; bad rankings are named; ``bench --warm``."""

import json

import numpy as np
import pytest
import torch

from tierstore import (
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    TieredEmbeddingBag,
    TieredEmbeddingBagCollection,
    TieredStore,
)
from tierstore.cli import main
from tierstore.nn.collection_layout import ID_BITS
from tierstore.warm_start import hot_ids


def trained_store(path, ids, dim=4):
    """A store holding ``ids`` with distinct rows, flushed."""
    with TieredStore(path, dim=dim, host_cache=8) as store:
        store.load(ids, torch.arange(ids.numel() * dim, dtype=torch.float32).reshape(-1, dim))
    return {int(i): torch.arange(n * dim, (n + 1) * dim, dtype=torch.float32) for n, i in enumerate(ids)}


def test_the_ranked_rows_the_table_holds_fill_the_top_tier_then_the_next(tmp_path):
    rows = trained_store(tmp_path / "s", torch.arange(100))
    ranking = torch.tensor([500, 7, 3, 7, 90, 12, 600, 44, 45, 46, 47, 48, 49, 50])  # 500, 600 unheld
    with TieredStore(tmp_path / "s", host_cache=6, device_cache=3, warm=ranking) as store:
        device, host = store.stack.caches
        assert store.warmed_rows == 9
        assert sorted(device.slot_keys[device.slot_keys >= 0].tolist()) == [3, 7, 90]
        assert sorted(host.slot_keys[host.slot_keys >= 0].tolist()) == [12, 44, 45, 46, 47, 48]
        stats = store.stats()
        assert stats["device"]["hits"] == stats["device"]["misses"] == 0  # no lookup counted
        assert stats["cold"]["initialized"] == 0 and len(store) == 100  # the table did not grow
        got = store.get(torch.tensor([7, 90, 3]))
        assert store.stats()["device"]["hits"] == 3  # resident from the start
        assert torch.equal(got, torch.stack([rows[7], rows[90], rows[3]]))
        for key in range(100):  # every row as it was, wherever it lives
            assert torch.equal(store.get(torch.tensor([key]))[0], rows[key])


def test_a_warm_start_file_from_profile_is_read_and_a_bad_one_is_named(tmp_path):
    trained_store(tmp_path / "s", torch.arange(20))
    np.save(tmp_path / "hot.npy", np.array([5, 6, 7], dtype=np.int64))
    with TieredStore(tmp_path / "s", host_cache=4, warm=tmp_path / "hot.npy") as store:
        assert store.warmed_rows == 3
    (tmp_path / "bad.npy").write_text("not numpy")
    with pytest.raises(ValueError, match="warm: .*bad.npy is not a readable .npy.*tierstore profile"):
        TieredStore(tmp_path / "s", host_cache=4, warm=tmp_path / "bad.npy")
    with pytest.raises(ValueError, match="warm"):
        TieredStore(tmp_path / "s", host_cache=4, warm=[-1, 2])
    with pytest.raises(TypeError, match="warm"):
        TieredStore(tmp_path / "s", host_cache=4, warm=[0.5])
    with TieredStore(tmp_path / "s", host_cache=4) as store:  # the refusals left it closed and sound
        assert len(store) == 20


def test_hot_ids_keep_each_id_at_its_first_rank():
    assert hot_ids([9, 3, 9, 1, 3, 0]).tolist() == [9, 3, 1, 0]
    assert hot_ids(np.array([], dtype=np.int64)).numel() == 0


def test_training_after_a_warm_start_matches_training_without_one(tmp_path):
    """Rows are the same whatever tier serves them: a warm-started module trains bit-identically."""
    rng = np.random.default_rng(3)
    batches = [torch.from_numpy(rng.zipf(1.2, (8, 3)) % 60) for _ in range(30)]
    results = []
    for name, warm in (("cold", None), ("warm", torch.arange(59, -1, -1))):
        with TieredStore(tmp_path / name, dim=4, optimizer="adagrad", optimizer_state_width=4) as store:
            store.load(torch.arange(60), torch.randn(60, 4, generator=torch.Generator().manual_seed(1)))
        from tierstore import optim

        bag = TieredEmbeddingBag(
            None, 4, path=tmp_path / name, optimizer=optim.Adagrad(lr=0.1), host_cache=24, warm=warm
        )
        assert bag.store.warmed_rows == (0 if warm is None else 24)
        for batch in batches:
            bag(batch).pow(2).sum().backward()
        results.append(bag.store.get(torch.arange(60), with_state=True))
        bag.store.close()
    assert torch.equal(results[0], results[1])


def test_a_collection_warms_each_tables_rows_rank_by_rank(tmp_path):
    tables = [
        EmbeddingBagConfig(100, 4, name="user", feature_names=["user_id"]),
        EmbeddingBagConfig(100, 4, name="item", feature_names=["item_id"]),
        EmbeddingBagConfig(100, 8, name="ad", feature_names=["ad_id"]),
    ]
    first = TieredEmbeddingBagCollection(tables, tmp_path / "c", host_cache=1000)
    ids = torch.arange(100)
    features = KeyedJaggedTensor(
        ["user_id", "item_id", "ad_id"], ids.repeat(3), lengths=torch.ones(300, dtype=torch.int64)
    )
    first(features)  # every id joins its table
    for group in first.groups.values():
        group.store.flush()
        group.store.close()
    warm = {"user": [1, 2, 3, 4], "item": np.array([9, 8]), "ad": torch.tensor([5])}
    second = TieredEmbeddingBagCollection(tables, tmp_path / "c", host_cache=10, warm=warm)
    shared = second.groups["dim4"].store
    assert shared.warmed_rows == 5  # half of 10 rows per group (two dims): ranks 1, 1, 2, 2, 3
    cached = set(shared.stack.top.slot_keys[shared.stack.top.slot_keys >= 0].tolist())
    user, item = 0, 1  # the tables' numbers: the high bits of their keys in a shared store
    assert cached == {
        (user << ID_BITS) | 1,
        (item << ID_BITS) | 9,
        (user << ID_BITS) | 2,
        (item << ID_BITS) | 8,
        3,
    }
    assert second.groups["dim8"].store.warmed_rows == 1
    with pytest.raises(KeyError, match="unknown table"):
        TieredEmbeddingBagCollection(tables, tmp_path / "c", host_cache=10, warm={"nope": [1]})
    second.close()
    np.savez(tmp_path / "hot-tables.npz", **{name: np.asarray(ids) for name, ids in warm.items()})
    from_file = TieredEmbeddingBagCollection(
        tables, tmp_path / "c", host_cache=10, warm=tmp_path / "hot-tables.npz"
    )
    keys = from_file.groups["dim4"].store.stack.top.slot_keys
    assert set(keys[keys >= 0].tolist()) == cached  # as the same rankings given as a dict
    from_file.close()
    np.save(tmp_path / "one.npy", np.arange(3))
    with pytest.raises(ValueError, match="not a readable .npz.*PREFIX-tables.npz"):
        TieredEmbeddingBagCollection(tables, tmp_path / "c", host_cache=10, warm=tmp_path / "one.npy")


def test_bench_reports_the_first_tenth_with_and_without_a_warm_start(tmp_path, capsys):
    spec = "zipf:alpha=1.1,n=5000,length=40000,seed=2"
    assert main(["profile", spec, "--quiet", "--out", str(tmp_path / "p")]) == 0
    out = tmp_path / "b"
    assert (
        main(
            [
                "bench",
                spec,
                "--warm",
                str(tmp_path / "p.npy"),
                "--policy",
                "lru",
                "--quiet",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.with_suffix(".json").read_text())
    for entry in report["sizes"]:
        cold, warm = entry["tierstore_held"], entry["tierstore_warm"]
        assert warm["warmed_rows"] == entry["rows"] and cold["warmed_rows"] == 0
        assert warm["first_tenth_hit_rate"] > cold["first_tenth_hit_rate"]
    assert "warm start" in capsys.readouterr().out
