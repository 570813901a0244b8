"""TieredEmbeddingBagCollection against one nn.EmbeddingBag per table (outputs and training)."""

import numpy as np
import pytest
import torch
from torch import nn

from tierstore import (
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    TieredEmbeddingBagCollection,
    initial_weights,
    optim,
)
from tierstore.nn import collection_forward
from tierstore.nn.collection_layout import ID_BITS

TABLES = [  # two dims (two fused groups); "shared" serves two features
    EmbeddingBagConfig(50, 8, name="user", feature_names=["user_id"], pooling="sum"),
    EmbeddingBagConfig(40, 8, name="shared", feature_names=["item_a", "item_b"], pooling="mean"),
    EmbeddingBagConfig(None, 4, name="wide", feature_names=["query"], pooling="sum"),
    EmbeddingBagConfig(30, 8, name="ad", feature_names=["ad_id"], pooling="sum"),
]
ROWS = {"user": 50, "shared": 40, "wide": 60, "ad": 30}  # ids drawn below these


def torch_tables(tables=TABLES, dtype=torch.float32):
    """One nn.EmbeddingBag per table holding the collection's initial rows (key = number << 47 | id)."""
    numbers, bags = {}, {}
    for config in tables:
        number = sum(1 for other in numbers.values() if other[1] == config.embedding_dim)
        numbers[config.name] = (number, config.embedding_dim)
        rows = ROWS[config.name]
        bag = nn.EmbeddingBag(rows, config.embedding_dim, mode=config.pooling, sparse=True, dtype=dtype)
        keys = (number << ID_BITS) | torch.arange(rows)
        with torch.no_grad():
            bag.weight.copy_(initial_weights(keys, config.embedding_dim, 0, dtype))
        bags[config.name] = bag
    return bags


def random_batch(rng, batch=5, weighted=False, keys=("user_id", "item_a", "item_b", "query", "ad_id")):
    owner = {feature: config.name for config in TABLES for feature in config.feature_names}
    lengths = rng.integers(0, 4, (len(keys), batch))  # some bags empty
    values = np.concatenate(
        [rng.integers(0, ROWS[owner[key]], int(lengths[k].sum())) for k, key in enumerate(keys)]
    )
    weights = torch.rand(values.size) if weighted else None
    return KeyedJaggedTensor(
        list(keys), torch.from_numpy(values), weights, torch.from_numpy(lengths.reshape(-1))
    )


def reference_outputs(bags, kjt):
    owner = {feature: config.name for config in TABLES for feature in config.feature_names}
    lengths = kjt.lengths().view(len(kjt.keys()), -1)
    out, start = {}, 0
    for k, key in enumerate(kjt.keys()):
        count = int(lengths[k].sum())
        ids = kjt.values()[start : start + count]
        offsets = torch.cumsum(lengths[k], 0) - lengths[k]
        weights = None if kjt.weights_or_none() is None else kjt.weights_or_none()[start : start + count]
        out[key] = bags[owner[key]](ids, offsets, weights)
        start += count
    return out


def test_each_tables_lookups_are_counted_over_batches_and_feature_orders(monkeypatch):
    monkeypatch.setattr(collection_forward, "SUM_EVERY", 3)  # batches summed as they come, and when read
    collection = TieredEmbeddingBagCollection(TABLES, host_cache=200)
    owner = {feature: config.name for config in TABLES for feature in config.feature_names}
    expected = dict.fromkeys(ROWS, 0)
    orders = [("user_id", "item_a", "item_b", "query", "ad_id"), ("ad_id", "item_b", "user_id")]
    rng = np.random.default_rng(5)
    for step in range(11):
        keys = orders[step % 2]
        kjt = random_batch(rng, keys=keys)
        collection(kjt)
        for key, count in zip(keys, kjt.lengths().view(len(keys), -1).sum(dim=1).tolist()):
            expected[owner[key]] += count
        # what is kept between reads stays bounded
        assert all(len(plan._starts_pending) < 3 for plan in collection._plans.values())
        if step in (1, 4, 10):
            counted = collection.stats()["tables"]
            assert {name: table["lookups"] for name, table in counted.items()} == expected
    assert expected["shared"] > 0 and expected["wide"] > 0


@pytest.mark.parametrize("weighted", [False, True])
def test_outputs_equal_one_embedding_bag_per_table(weighted):
    collection = TieredEmbeddingBagCollection(TABLES, host_cache=200, is_weighted=weighted)
    bags = torch_tables()
    rng = np.random.default_rng(0)
    keys = ("user_id", "query", "ad_id") if weighted else ("user_id", "item_a", "item_b", "query", "ad_id")
    for _ in range(5):
        kjt = random_batch(rng, weighted=weighted, keys=keys)
        out = collection(kjt)
        expected = reference_outputs(bags, kjt)
        assert out.keys() == list(keys) and out.length_per_key() == [expected[key].shape[1] for key in keys]
        for key in keys:
            torch.testing.assert_close(out.to_dict()[key], expected[key], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(out.values(), torch.cat([expected[key] for key in keys], dim=1))
    assert set(collection.stats()["groups"]) == {"dim8", "dim4"}
    collection.close()


def rowwise_adagrad_step(weight, state, grad, lr, eps):
    """FBGEMM's EXACT_ROWWISE_ADAGRAD on the rows with a gradient (float64)."""
    rows = grad.abs().sum(dim=1) > 0
    state[rows] += (grad[rows] ** 2).mean(dim=1)
    weight[rows] -= (lr / (state[rows].sqrt() + eps))[:, None] * grad[rows]


OPTIMIZERS = {
    "sgd": (lambda: optim.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    "adagrad": (lambda: optim.Adagrad(lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1)),
    "adam": (lambda: optim.Adam(lr=0.05), lambda p: torch.optim.SparseAdam(p, lr=0.05)),
    "rowwise-adagrad": (lambda: optim.RowWiseAdagrad(lr=0.1, eps=1e-8), None),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("backend", ["lmdb", "mmap"])
def test_training_through_tiny_tiers_equals_per_table_torch_training(name, backend, tmp_path):
    ours_optimizer, torch_optimizer = OPTIMIZERS[name]
    collection = TieredEmbeddingBagCollection(
        TABLES, tmp_path / "c", backend=backend, host_cache=100, optimizer=ours_optimizer()
    )
    bags = torch_tables()
    optimizers = (
        {table: torch_optimizer(bag.parameters()) for table, bag in bags.items()} if torch_optimizer else {}
    )
    rowwise_state = {table: torch.zeros(ROWS[table], dtype=torch.float64) for table in bags}
    rowwise_weight = {table: bag.weight.detach().double().clone() for table, bag in bags.items()}
    rng = np.random.default_rng(3)
    for _ in range(25):
        kjt = random_batch(rng)
        if name == "adam":  # Adam's step count is per group: every table needs ids every step to compare
            lengths = kjt.lengths().view(5, -1).clone()
            lengths[:, 0] = lengths[:, 0].clamp(min=1)
            values = np.concatenate(
                [
                    rng.integers(0, ROWS[o], int(lengths[k].sum()))
                    for k, o in enumerate(["user", "shared", "shared", "wide", "ad"])
                ]
            )
            kjt = KeyedJaggedTensor(kjt.keys(), torch.from_numpy(values), None, lengths.reshape(-1))
        targets = {key: torch.randn(5, 8 if key != "query" else 4) for key in kjt.keys()}
        out = collection(kjt).to_dict()
        sum((out[key] * targets[key]).sum() for key in kjt.keys()).backward()
        for bag in bags.values():
            bag.zero_grad()
        expected = reference_outputs(bags, kjt)
        sum((expected[key] * targets[key]).sum() for key in kjt.keys()).backward()
        if name == "rowwise-adagrad":
            for table, bag in bags.items():
                grad = bag.weight.grad.to_dense().double()
                rowwise_adagrad_step(rowwise_weight[table], rowwise_state[table], grad, 0.1, 1e-8)
                with torch.no_grad():
                    bag.weight.copy_(rowwise_weight[table])
        else:
            for optimizer in optimizers.values():
                optimizer.step()
    assert collection.stats()["groups"]["dim8"]["cold"]["rows_read"] > 100  # rows moved all along
    for table, bag in bags.items():
        number = collection._tables[table]["number"]
        keys = (number << ID_BITS) | torch.arange(ROWS[table])
        group = collection.groups[f"dim{bag.embedding_dim}"]
        got = group.store.get(keys, grow=False)
        torch.testing.assert_close(got, bag.weight.detach(), rtol=1e-5, atol=1e-6)
    collection.close()


def test_reopening_keeps_the_rows_and_refuses_other_tables(tmp_path):
    collection = TieredEmbeddingBagCollection(
        TABLES, tmp_path / "c", host_cache=200, optimizer=optim.SGD(lr=1.0)
    )
    kjt = random_batch(np.random.default_rng(1))
    before = collection(kjt)
    sum(before.values().sum() for _ in [0]).backward()
    collection.eval()
    trained = collection(kjt).values()
    collection.close()
    reopened = TieredEmbeddingBagCollection(TABLES, tmp_path / "c", host_cache=200)
    reopened.eval()
    torch.testing.assert_close(reopened(kjt).values(), trained, rtol=0, atol=0)
    reopened.close()
    with pytest.raises(ValueError, match="other tables"):
        TieredEmbeddingBagCollection(list(reversed(TABLES)), tmp_path / "c", host_cache=200)


def test_a_torchrec_style_kjt_with_offsets_is_taken():
    class ForeignKjt:  # only what TorchRec's KeyedJaggedTensor offers
        def keys(self):
            return ["user_id", "ad_id"]

        def values(self):
            return torch.tensor([1, 2, 3, 4])

        def offsets(self):
            return torch.tensor([0, 1, 2, 4, 4])

        def weights_or_none(self):
            return None

    collection = TieredEmbeddingBagCollection(TABLES, host_cache=200)
    out = collection(ForeignKjt()).to_dict()
    bags = torch_tables()
    torch.testing.assert_close(out["user_id"], bags["user"](torch.tensor([1, 2]), torch.tensor([0, 1])))
    torch.testing.assert_close(out["ad_id"], bags["ad"](torch.tensor([3, 4]), torch.tensor([0, 2])))
    collection.close()


@pytest.mark.parametrize(
    "make, error, message",
    [
        (
            lambda: KeyedJaggedTensor(["nope"], torch.tensor([1]), lengths=torch.tensor([1])),
            KeyError,
            "have no table",
        ),
        (
            lambda: KeyedJaggedTensor(["user_id"], torch.tensor([1, 2]), lengths=torch.tensor([1])),
            ValueError,
            "sum to 1",
        ),
        (
            lambda: KeyedJaggedTensor(["user_id"], torch.tensor([1]), lengths=torch.tensor([2, -1])),
            ValueError,
            "non-negative",
        ),
        (
            lambda: KeyedJaggedTensor(["user_id"], torch.tensor([1, 2]), torch.ones(3), torch.tensor([2])),
            ValueError,
            "weights must be",
        ),
        (
            lambda: KeyedJaggedTensor(["item_a"], torch.tensor([1]), torch.ones(1), torch.tensor([1])),
            ValueError,
            "weights need sum pooling",
        ),
        (
            lambda: KeyedJaggedTensor(["user_id"], torch.tensor([50]), lengths=torch.tensor([1])),
            IndexError,
            "user",
        ),
        (  # the bad id is in the second group: the first must not have grown either
            lambda: KeyedJaggedTensor(
                ["user_id", "query"], torch.tensor([1, -1]), lengths=torch.tensor([1, 1])
            ),
            IndexError,
            "wide",
        ),
    ],
)
def test_bad_features_are_named_and_change_nothing(make, error, message):
    collection = TieredEmbeddingBagCollection(TABLES, host_cache=200, is_weighted=True)
    with pytest.raises(error, match=message):
        collection(make())
    assert all(len(group.store) == 0 for group in collection.groups.values())
    collection.close()


@pytest.mark.parametrize(
    "tables, message",
    [
        ([TABLES[0], EmbeddingBagConfig(5, 8, name="user", feature_names=["x"])], "used twice"),
        ([EmbeddingBagConfig(5, 8, name="t", feature_names=["x"], weight_init_max=0.1)], "weight_init_max"),
        ([EmbeddingBagConfig(5, 8, name="t", feature_names=["x"], data_type="INT8")], "data_type"),
        ([EmbeddingBagConfig(5, 8, name="t", feature_names=["x"], pooling="max")], "pooling"),
        ([EmbeddingBagConfig(5, 0, name="t", feature_names=["x"])], "embedding_dim"),
        ([EmbeddingBagConfig(5, 8, name="", feature_names=["x"])], "name"),
    ],
)
def test_bad_table_configs_are_named(tables, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        TieredEmbeddingBagCollection(tables, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_pickling_deepcopy_and_state_dict_work_as_for_the_single_table_modules(tmp_path):
    import copy
    import pickle

    collection = TieredEmbeddingBagCollection(
        TABLES, tmp_path / "c", host_cache=200, optimizer=optim.SGD(lr=1.0)
    )
    kjt = random_batch(np.random.default_rng(2))
    collection(kjt).values().sum().backward()
    collection.eval()
    trained = collection(kjt).values()
    twin = copy.deepcopy(collection)  # independent temporary stores holding the rows as of now
    torch.testing.assert_close(twin(kjt).values(), trained, rtol=0, atol=0)
    state = collection.state_dict()
    other = TieredEmbeddingBagCollection(TABLES, tmp_path / "d", host_cache=200)
    other.load_state_dict(state)  # rows copied over, while the source is open
    other.eval()
    torch.testing.assert_close(other(kjt).values(), trained, rtol=0, atol=0)
    blob = pickle.dumps(collection)
    collection.close()
    reopened = pickle.loads(blob)
    torch.testing.assert_close(reopened(kjt).values(), trained, rtol=0, atol=0)
    for module in (reopened, twin, other):
        module.close()


def test_the_cli_inspects_a_collection_and_imports_and_exports_one_table(tmp_path, capsys):
    import json

    from tierstore.cli import main

    collection = TieredEmbeddingBagCollection(TABLES, tmp_path / "c", host_cache=200)
    kjt = KeyedJaggedTensor(
        ["user_id", "query"], torch.tensor([3, 7, 3, 11]), lengths=torch.tensor([2, 1, 1, 0])
    )
    collection(kjt)  # user holds 3 and 7, wide holds 11
    collection.close()
    assert main(["inspect", str(tmp_path / "c"), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    rows = {table["name"]: table["rows"] for table in facts["tables"]}
    assert rows == {"user": 2, "shared": 0, "wide": 1, "ad": 0}
    assert main(["inspect", str(tmp_path / "c")]) == 0
    listing = capsys.readouterr().out
    assert "user" in listing and "dim8" in listing and "item_a, item_b" in listing

    new_rows = np.arange(3 * 8, dtype=np.float32).reshape(3, 8)
    np.save(tmp_path / "rows.npy", new_rows)
    np.save(tmp_path / "ids.npy", np.array([7, 20, 29]))
    collection_dir, ids = str(tmp_path / "c"), str(tmp_path / "ids.npy")
    assert (
        main(["import", str(tmp_path / "rows.npy"), collection_dir, "--ids", ids, "--table", "ad", "--quiet"])
        == 0
    )
    exported_ids = str(tmp_path / "ad-ids.npy")
    assert (
        main(["export", collection_dir, str(tmp_path / "ad.npy"), "--ids", exported_ids, "--table", "ad"])
        == 0
    )
    assert np.load(tmp_path / "ad-ids.npy").tolist() == [7, 20, 29]
    np.testing.assert_array_equal(np.load(tmp_path / "ad.npy"), new_rows)
    reopened = TieredEmbeddingBagCollection(TABLES, tmp_path / "c", host_cache=200)
    reopened.eval()
    out = reopened(KeyedJaggedTensor(["ad_id"], torch.tensor([20]), lengths=torch.tensor([1]))).values()
    torch.testing.assert_close(out, torch.from_numpy(new_rows[1:2]))
    reopened.close()
    assert main(["export", str(tmp_path / "c"), str(tmp_path / "x.npy"), "--table", "nope"]) != 0
    assert "has no table 'nope'" in capsys.readouterr().err
    source = str(tmp_path / "rows.npy")
    assert main(["import", source, collection_dir, "--ids", ids, "--table", "ad", "--dtype", "float16"]) == 2
    assert "keeps the collection's dtype" in capsys.readouterr().err
