"""float16 and bfloat16 tables train: updates computed in float32, the optimizer state kept in float32
inside the row, the weights rounded to nearest once per update. The oracle is a float32 table whose
weights are rounded to the 16-bit dtype after every update (its state left in float32)."""

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tierstore
from tierstore import (
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    TieredEmbeddingBag,
    TieredEmbeddingBagCollection,
    TieredStore,
    optim,
)
from tierstore.cli.inspection import verify_store
from tierstore.initializer import initial_weights
from tierstore.metadata import METADATA_FILE, StoreMetadata, state_of
from tierstore.rounding import stochastically_rounded
from tierstore.tiers.cold import open_cold_store

NUM, DIM = 200, 5  # an odd dim: the float32 state starts after one padding value
OPTIMIZERS = {
    "sgd": optim.SGD(lr=0.05),
    "adagrad": optim.Adagrad(lr=0.05),
    "rowwise-adagrad": optim.RowWiseAdagrad(lr=0.05),
    "adam": optim.Adam(lr=0.01),
}
ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}  # relative spacing at 1


def random_batch(rng, dtype, scale):
    """Bags of distinct-enough ids, and a loss weight per output value representable in ``dtype``
    (so the 16-bit output's gradient is exactly the float32 reference's)."""
    lengths = rng.integers(1, 5, 6)
    ids = torch.from_numpy(rng.integers(0, NUM, int(lengths.sum())))
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]]))
    target = torch.from_numpy(rng.standard_normal((6, DIM)).astype(np.float32)).to(dtype).float() * scale
    return ids, offsets, target


class RoundedFloat32Table:
    """The oracle: float32 weights and state, updated by ``optimizer.update_rows`` in float32, the
    weights rounded to ``dtype`` after every update."""

    def __init__(self, optimizer, dtype):
        self.optimizer, self.dtype, self.step = optimizer, dtype, 0
        self.weights = initial_weights(torch.arange(NUM), DIM, 0, dtype).float()
        self.state = torch.zeros(NUM, optimizer.state_width(DIM))

    def train(self, ids, offsets, target):
        weights = self.weights.clone().requires_grad_(True)
        (F.embedding_bag(ids, weights, offsets, mode="sum") * target).sum().backward()
        unique = ids.unique()
        rows = torch.cat([self.weights[unique], self.state[unique]], dim=1)
        self.step += 1
        self.optimizer.update_rows(rows, weights.grad[unique], self.step)
        self.weights[unique] = rows[:, :DIM].to(self.dtype).float()
        self.state[unique] = rows[:, DIM:]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("host_backend", ["openmp", "torch"])
def test_16_bit_rows_train_as_float32_rows_rounded_after_every_update(
    name, dtype, host_backend, backend, store_path
):
    tiers = {"host_cache": 24, "host_cache_backend": host_backend}
    check_16_bit_training(OPTIMIZERS[name], dtype, tiers, backend, store_path)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_rows_train_through_a_device_tier(name, dtype, device_tier, store_path):
    """Rows through all three tiers, the device tier's kernels on 16-bit rows (their host build,
    or a GPU's)."""
    tiers = {"host_cache": 32, "device_cache": 24, **device_tier}
    check_16_bit_training(OPTIMIZERS[name], dtype, tiers, "mmap", store_path)


def check_16_bit_training(optimizer, dtype, tiers, backend, store_path):
    """40 steps of ``optimizer`` on a ``dtype`` table with ``tiers`` (rows move to the cold store and
    back) equal the oracle's within a 16-bit rounding; the state kept in float32."""
    ours = TieredEmbeddingBag(
        NUM, DIM, mode="sum", optimizer=optimizer, dtype=dtype, path=store_path, backend=backend, **tiers
    )
    device = tiers.get("device", torch.device("cpu"))
    stats = ours.store.stats()
    for tier in ("host", "device"):
        requested = tiers.get(f"{tier}_cache_backend")
        if requested is not None:  # the backend asked for runs the 16-bit rows
            assert stats[tier]["backend"] == getattr(requested, "name", requested)
    oracle = RoundedFloat32Table(optimizer, dtype)
    rng = np.random.default_rng(3)
    for step in range(40):
        # Gradients of ~1e3 later on: a float16 sum of their squares overflows (Adagrad's state).
        ids, offsets, target = random_batch(rng, dtype, 1.0 if step < 20 else 1024.0)
        output = ours(ids.to(device), offsets.to(device))
        assert output.dtype == dtype
        (output.float() * target.to(device)).sum().backward()
        oracle.train(ids, offsets, target)
    assert ours.store.stats()["cold"]["rows_read"] > 0  # rows went to the cold store and came back
    name = optimizer.name
    ours.close()
    with TieredStore(store_path, read_only=True, host_cache=NUM) as reopened:
        rows = reopened.get(torch.arange(NUM), with_state=True)
        assert reopened.metadata.state_dtype == "float32"
        weights, state = rows[:, :DIM], state_of(rows, DIM, optimizer.state_width(DIM))
    assert weights.dtype == dtype
    torch.testing.assert_close(weights.float(), oracle.weights, rtol=ULP[dtype], atol=1e-4)
    if name != "sgd":  # SGD keeps no state
        assert state.dtype == torch.float32
        torch.testing.assert_close(state, oracle.state, rtol=1e-4, atol=1e-6)
    if "adagrad" in name:  # sums of squares past float16's range: float32 state, or nothing would train
        assert float(state.max()) > 65504


def test_a_16_bit_store_made_before_float32_state_keeps_its_state_in_the_rows_dtype(backend, store_path):
    """Such a store (no ``state_dtype`` in its metadata) keeps its layout; its updates are still
    computed in float32 and rounded once, weights and state."""
    older = StoreMetadata(backend=backend, dim=4, dtype="float16", optimizer_state_width=4, seed=0)
    store_path.mkdir()
    open_cold_store(backend, store_path, older.row_width, torch.float16, read_only=False).close()
    document = {"format": "tierstore", **dataclasses.asdict(older)}
    del document["state_dtype"]  # as written before the field was
    (store_path / METADATA_FILE).write_text(json.dumps(document))
    optimizer = optim.Adagrad(lr=0.1)
    ids, grad = torch.arange(6), torch.linspace(-2, 3, 24).view(6, 4)
    with pytest.raises(ValueError, match="keeps its optimizer state in its rows' dtype"):
        TieredStore(store_path, backend=backend, host_cache=8, host_cache_backend="openmp")
    with TieredStore(store_path, backend=backend, host_cache=8) as store:
        assert store.row_width == 8 and store.metadata.state_dtype is None
        assert store.stats()["host"]["backend"] == "torch"  # the kernels update float32 state only
        start = store.get(ids, with_state=True)
        store.apply_gradients(ids, grad, optimizer, step=1)
        after = store.get(ids, with_state=True)
    expected = start.float()
    optimizer.update_rows(expected, grad, 1)
    torch.testing.assert_close(after, expected.to(torch.float16), rtol=0, atol=0)


def test_whole_rows_of_a_16_bit_store_go_back_in_by_their_float32_state(store_path):
    """``get(with_state=True)`` returns the stored form; its state halves are no numbers of their own
    (one may look like a float16 NaN), so ``put`` and ``verify`` read the state as float32."""
    optimizer = optim.Adagrad(lr=0.1)
    table = TieredEmbeddingBag(NUM, DIM, optimizer=optimizer, dtype=torch.float16, path=store_path)
    (table(torch.arange(4), torch.tensor([0, 2])).float() * 100).sum().backward()
    rows = table.store.get(torch.arange(4), with_state=True)
    state = state_of(rows, DIM, DIM)
    state[0, 0] = torch.tensor([0x3F807E00], dtype=torch.int32).view(torch.float32)  # a half reads 0x7E00
    assert bool(torch.isnan(rows).any()) and bool(torch.isfinite(state).all())
    table.store.put(torch.arange(10, 14), rows)
    stored = table.store.get(torch.arange(10, 14), with_state=True)
    assert torch.equal(stored.view(torch.int16), rows.view(torch.int16))  # bit for bit
    table.store.flush()
    assert verify_store(store_path) == []
    state[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        table.store.put(torch.arange(20, 24), rows)
    table.store.put(torch.arange(20, 24), rows, allow_nonfinite=True)
    table.close()
    assert any("non-finite" in problem for problem in verify_store(store_path))


def test_new_stores_record_where_their_state_lives(tmp_path):
    for dtype, recorded in [(torch.float16, "float32"), (torch.bfloat16, "float32"), (torch.float32, None)]:
        with TieredStore(tmp_path / str(dtype), dim=3, dtype=dtype, optimizer_state_width=3) as store:
            assert store.metadata.state_dtype == recorded
            assert store.row_width == (3 + 1 + 2 * 3 if recorded else 6)
    with pytest.raises(ValueError, match="state_dtype"):
        StoreMetadata(
            backend="mmap", dim=3, dtype="float32", optimizer_state_width=3, seed=0, state_dtype="float32"
        )


def test_a_float16_collection_trains_with_gradients_whose_squares_overflow_float16(tmp_path):
    """The issue's case through the collection: float16 rows, Adagrad, gradients of ~1e3."""
    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=100, feature_names=["f"])]
    collection = TieredEmbeddingBagCollection(
        tables, tmp_path / "c", dtype=torch.float16, optimizer=optim.Adagrad(lr=0.01), host_cache=50
    )
    ids = torch.arange(8)
    before = collection.embedding_bags["t"].rows(ids).float()
    for _ in range(3):
        batch = KeyedJaggedTensor(["f"], ids, lengths=torch.ones(8, dtype=torch.int64))
        (collection(batch).values().float() * 1000).sum().backward()
    after = collection.embedding_bags["t"].rows(ids).float()
    # Adagrad's k-th step of a steady gradient g is lr * g / sqrt(k g^2) = lr / sqrt(k), whatever g
    expected = -0.01 * (1 + 2**-0.5 + 3**-0.5)
    torch.testing.assert_close(after - before, torch.full_like(before, expected), rtol=0, atol=1e-3)
    collection.close()


def sgd_updates(store_path, stochastic, host_cache, steps=100, dtype=torch.float16):
    """Rows of 8 ids (dim 64) starting at 1.0 after ``steps`` SGD updates of -1e-4 each: below half
    a float16 gap at 1.0 (2.4e-4), so rounding to nearest drops every one."""
    ids = torch.arange(8)
    optimizer = optim.SGD(lr=1.0, stochastic_rounding=stochastic)
    with TieredStore(store_path, dim=64, dtype=dtype, host_cache=host_cache) as store:
        store.put(ids, torch.ones(8, 64, dtype=dtype))
        for step in range(1, steps + 1):
            for part in ids.split(host_cache):  # a small cache: rows go out and come back between steps
                store.apply_gradients(part, torch.full((part.numel(), 64), 1e-4), optimizer, step)
        return store.get(ids)


def test_stochastic_rounding_adds_up_updates_that_rounding_to_nearest_drops(tmp_path):
    nearest = sgd_updates(tmp_path / "nearest", stochastic=False, host_cache=8)
    assert bool((nearest == 1).all())  # every update lost
    rounded = sgd_updates(tmp_path / "stochastic", stochastic=True, host_cache=8)
    assert abs(float(rounded.float().mean()) - 0.99) < 1e-3  # float32's 1 - 100 x 1e-4, unbiased
    values = set(rounded.float().unique().tolist())
    assert len(values) > 3  # each value drew its own way


def test_stochastic_rounding_is_the_same_from_run_to_run_and_whatever_the_cache(tmp_path):
    first = sgd_updates(tmp_path / "a", stochastic=True, host_cache=8, steps=20)
    again = sgd_updates(tmp_path / "b", stochastic=True, host_cache=8, steps=20)
    moving = sgd_updates(tmp_path / "c", stochastic=True, host_cache=2, steps=20)
    assert torch.equal(first, again) and torch.equal(first, moving)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_picks_a_neighbour_as_often_as_it_is_near(dtype):
    values = torch.tensor([[1.0 + 0.3 * ULP[dtype], -2.0 - 0.75 * 2 * ULP[dtype], 0.5, float("inf")]])
    keys = torch.arange(20_000)
    rounded = stochastically_rounded(values.expand(keys.numel(), 4), dtype, keys, step=3).float()
    low, high = 1.0, 1.0 + ULP[dtype]
    assert set(rounded[:, 0].unique().tolist()) == {low, high}
    assert abs(float((rounded[:, 0] == high).double().mean()) - 0.3) < 0.02
    assert abs(float((rounded[:, 1] == -2.0 - 2 * ULP[dtype]).double().mean()) - 0.75) < 0.02
    assert bool((rounded[:, 2] == 0.5).all()) and bool(torch.isinf(rounded[:, 3]).all())  # exact, inf kept


def test_stochastic_rounding_is_a_flag():
    with pytest.raises(TypeError, match="stochastic_rounding must be True or False"):
        optim.Adagrad(lr=0.1, stochastic_rounding="yes")


def test_a_collections_tables_each_take_their_data_type(tmp_path):
    """``data_type=FP16``/``BF16`` on a table's config: its rows are of that dtype, in a group (a
    store) of their own beside the float32 tables of the same dim, and train exactly as a single
    table of that dtype trained on the same bags; reopening finds each group again."""
    configs = [
        EmbeddingBagConfig(
            name="half", embedding_dim=4, num_embeddings=60, feature_names=["a"], data_type="FP16"
        ),
        EmbeddingBagConfig(name="full", embedding_dim=4, num_embeddings=60, feature_names=["b"]),
        EmbeddingBagConfig(
            name="brain", embedding_dim=4, num_embeddings=60, feature_names=["c"], data_type="BF16"
        ),
    ]
    dtypes = {"half": torch.float16, "full": torch.float32, "brain": torch.bfloat16}
    settings = dict(optimizer=optim.Adagrad(lr=0.05), host_cache=12)  # each group: 12 of 60 rows
    collection = TieredEmbeddingBagCollection(configs, tmp_path / "c", **{**settings, "host_cache": 36})
    assert sorted(collection.groups) == ["dim4", "dim4-bfloat16", "dim4-float16"]
    singles = {
        name: TieredEmbeddingBag(None, 4, mode="sum", dtype=dtype, **settings)
        for name, dtype in dtypes.items()
    }
    rng = np.random.default_rng(0)
    for _ in range(6):
        ids = {name: torch.from_numpy(rng.integers(0, 60, 8)) for name in dtypes}
        lengths = torch.tensor([2, 2, 2, 2] * 3)
        features = KeyedJaggedTensor(["a", "b", "c"], torch.cat(list(ids.values())), lengths=lengths)
        target = torch.from_numpy(rng.standard_normal((4, 12)).astype(np.float32)).half().float()
        pooled = collection(features)
        assert pooled.values().dtype == torch.float32  # the groups' outputs side by side, promoted
        for position, (name, table) in enumerate(singles.items()):
            out = table(ids[name], torch.arange(0, 8, 2))
            (out.float() * target[:, 4 * position : 4 * position + 4]).sum().backward()
        (pooled.values() * target).sum().backward()
    for name, table in singles.items():
        rows = collection.embedding_bags[name].rows(torch.arange(60))
        assert rows.dtype == dtypes[name] and torch.equal(rows, table.store.get(torch.arange(60)))
    collection.close()
    reopened = TieredEmbeddingBagCollection(configs, tmp_path / "c", **{**settings, "host_cache": 36})
    assert torch.equal(
        reopened.embedding_bags["half"].rows(torch.arange(60)), singles["half"].store.get(torch.arange(60))
    )
    reopened.close()


@pytest.mark.parametrize("background", [True, False])
def test_16_bit_training_through_the_lookahead_pipeline_is_training_without_it(tmp_path, background):
    """The native step's 16-bit rows (stochastic Adam: draws by id, column and step), with the
    worker moving rows ahead (and a horizon) or inline: the same rows and state, bit for bit."""

    def trained(path, pipeline: bool):
        table = TieredEmbeddingBag(
            None,
            DIM,
            path=path,
            dtype=torch.float16,
            optimizer=optim.Adam(lr=0.01, stochastic_rounding=True),
            host_cache=64,
        )
        generator = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, 300, (10, 3), generator=generator) for _ in range(30)]
        if pipeline:
            horizon = "4x" if background else None
            batches = tierstore.prefetch(batches, table, lookahead=4, background=background, horizon=horizon)
        for ids in batches:
            table(ids).float().pow(2).sum().backward()
        rows = table.store.get(torch.arange(300), with_state=True)
        table.close()
        return rows.view(torch.int16)

    assert torch.equal(trained(tmp_path / "plain", False), trained(tmp_path / "pipelined", True))
