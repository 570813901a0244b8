"""TieredEmbeddingBag / TieredEmbedding against torch's nn.EmbeddingBag / nn.Embedding and optimizers."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from tierstore import (
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    TieredEmbedding,
    TieredEmbeddingBag,
    TieredEmbeddingBagCollection,
    TieredStore,
    initial_weights,
    optim,
)

NUM, DIM = 64, 8


def oracle_bag(mode, padding_idx=None, include_last_offset=False, dtype=torch.float32):
    """torch's table with our initial rows (torch has no sparse gradients for mode "max":
    ``sparse_grad_of_batch`` makes one)."""
    bag = nn.EmbeddingBag(
        NUM,
        DIM,
        mode=mode,
        sparse=mode != "max",
        padding_idx=padding_idx,
        include_last_offset=include_last_offset,
        dtype=dtype,
    )
    with torch.no_grad():
        bag.weight.copy_(initial_weights(torch.arange(NUM), DIM, 0, dtype))
    return bag


def sparse_grad_of_batch(bag, ids):
    """Replace a dense gradient by the sparse one torch's sparse backward would give: the rows
    looked up in the batch (so lazy optimizers update exactly those)."""
    if bag.weight.grad is not None and not bag.weight.grad.is_sparse:
        rows = torch.unique(ids)
        bag.weight.grad = torch.sparse_coo_tensor(rows[None], bag.weight.grad[rows], bag.weight.shape)


def random_bags(rng, bags=6, max_length=4, include_last_offset=False):
    """A 1-D input with offsets; some bags empty."""
    lengths = rng.integers(0, max_length + 1, bags)
    ids = torch.from_numpy(rng.integers(0, NUM, int(lengths.sum())))
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]]))
    if include_last_offset:
        offsets = torch.cat([offsets, torch.tensor([ids.numel()])])
    return ids, offsets


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 3])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_bag_forward_equals_torch(mode, padding_idx, include_last_offset):
    rng = np.random.default_rng(0)
    ours = TieredEmbeddingBag(
        NUM,
        DIM,
        mode=mode,
        padding_idx=padding_idx,
        include_last_offset=include_last_offset,
        host_cache=16,
        device_cache=40,
    )
    torch_bag = oracle_bag(mode, padding_idx, include_last_offset)
    for _ in range(5):
        ids, offsets = random_bags(rng, include_last_offset=include_last_offset)
        ids[::3] = 3  # padding entries, when padding_idx is 3
        weights = torch.rand(ids.numel()) if mode == "sum" else None
        torch.testing.assert_close(
            ours(ids, offsets, weights), torch_bag(ids, offsets, weights), rtol=0, atol=0
        )
    two_d = torch.from_numpy(rng.integers(0, NUM, (5, 3)))
    two_d_weights = torch.rand(5, 3) if mode == "sum" else None
    torch.testing.assert_close(
        ours(two_d, None, two_d_weights), torch_bag(two_d, None, two_d_weights), rtol=0, atol=0
    )
    ours.close()


def test_empty_input_and_all_empty_bags():
    ours, torch_bag = TieredEmbeddingBag(NUM, DIM, mode="mean", host_cache=16), oracle_bag("mean")
    ids, offsets = torch.empty(0, dtype=torch.int64), torch.tensor([0, 0, 0])
    torch.testing.assert_close(ours(ids, offsets), torch_bag(ids, offsets))
    ours.close()


@pytest.mark.parametrize("padding_idx", [None, 5])
def test_embedding_forward_equals_torch(padding_idx):
    ours = TieredEmbedding(NUM, DIM, padding_idx=padding_idx, host_cache=16, device_cache=40)
    torch_table = nn.Embedding(NUM, DIM, padding_idx=padding_idx)
    with torch.no_grad():
        torch_table.weight.copy_(initial_weights(torch.arange(NUM), DIM, 0, torch.float32))
        if padding_idx is not None:
            torch_table.weight[padding_idx] = 0
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, NUM, (3, 4, 2)))
    ids[0, 0] = 5
    torch.testing.assert_close(ours(ids), torch_table(ids), rtol=0, atol=0)
    ours.close()


OPTIMIZERS = {
    "sgd": (lambda: optim.SGD(lr=0.1), lambda params: torch.optim.SGD(params, lr=0.1)),
    "adagrad": (lambda: optim.Adagrad(lr=0.1), lambda params: torch.optim.Adagrad(params, lr=0.1)),
    "adam": (lambda: optim.Adam(lr=0.05), lambda params: torch.optim.SparseAdam(params, lr=0.05)),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("host_backend", ["openmp", "torch"])
def test_training_matches_torch_with_rows_moving_between_all_tiers(
    name, mode, backend, device_tier, host_backend, store_path
):
    ours_optimizer, torch_optimizer = OPTIMIZERS[name]
    ours = TieredEmbeddingBag(
        NUM,
        DIM,
        mode=mode,
        path=store_path,
        backend=backend,
        host_cache=12,
        device_cache=24,
        optimizer=ours_optimizer(),
        host_cache_backend=host_backend,
        **device_tier,
    )
    device, device_backend = device_tier["device"], device_tier["device_cache_backend"]
    stats = ours.store.stats()
    assert (stats["device"]["backend"], stats["host"]["backend"]) == (
        getattr(device_backend, "name", device_backend),
        host_backend,
    )
    torch_bag = oracle_bag(mode)
    reference_optimizer = torch_optimizer(torch_bag.parameters())
    rng = np.random.default_rng(7)
    # Its own generator: inputs that do not depend on the tests before it (the global one's state
    # does). About one weight draw in a thousand puts Adam's float32 rounding, ours against torch's
    # SparseAdam, past the tolerance (2.4-2.6e-6, an all-held table the same bit for bit).
    generator = torch.Generator().manual_seed(7)
    moved = []
    for _ in range(50):
        ids, offsets = random_bags(rng)
        weights = torch.rand(ids.numel(), generator=generator) if mode == "sum" else None
        target = torch.from_numpy(rng.standard_normal((offsets.numel(), DIM)).astype(np.float32))
        before = ours.store.stats()
        on_device = [None if t is None else t.to(device) for t in (ids, offsets, weights, target)]
        (ours(*on_device[:3]) * on_device[3]).sum().backward()
        after = ours.store.stats()
        moved.append(
            (
                after["host"]["rows_in"] > before["host"]["rows_in"],
                after["cold"]["rows_read"] > before["cold"]["rows_read"],
            )
        )
        reference_optimizer.zero_grad()
        (torch_bag(ids, offsets, weights) * target).sum().backward()
        sparse_grad_of_batch(torch_bag, ids)
        reference_optimizer.step()
    assert (
        sum(host and cold for host, cold in moved) >= 40
    )  # rows moved through all three tiers nearly every step
    ours.close()
    with TieredStore(store_path, read_only=True, host_cache=NUM) as reopened:
        torch.testing.assert_close(
            reopened.get(torch.arange(NUM)), torch_bag.weight.detach(), rtol=1e-5, atol=1e-6
        )


def test_two_forwards_before_one_backward_update_the_rows_they_looked_up(store_path):
    """The second forward evicts rows of the first from the tiny top tier before backward: the
    first's update must find its rows again, not write into slots that now hold other ids.
    (Each forward's backward is one fused optimizer step, as in FBGEMM; with SGD that equals
    torch's single step on the summed gradient.) Lookups are counted once, not again by updates."""
    ours = TieredEmbeddingBag(
        NUM, DIM, mode="sum", path=store_path, host_cache=12, device_cache=24, optimizer=optim.SGD(lr=0.1)
    )
    torch_bag = oracle_bag("sum")
    reference_optimizer = torch.optim.SGD(torch_bag.parameters(), lr=0.1)
    rng = np.random.default_rng(11)
    evicted_before_backward, looked_up = 0, 0
    for _ in range(30):
        batches = [random_bags(rng) for _ in range(2)]
        targets = [torch.from_numpy(rng.standard_normal((6, DIM)).astype(np.float32)) for _ in range(2)]
        first = ours(*batches[0])
        second = ours(*batches[1])
        evicted_before_backward += int((ours.store.stack.top.find(torch.unique(batches[0][0])) < 0).sum())
        looked_up += sum(ids.numel() for ids, _ in batches)
        (first * targets[0]).sum().add((second * targets[1]).sum()).backward()
        reference_optimizer.zero_grad()
        sum((torch_bag(*batch) * target).sum() for batch, target in zip(batches, targets)).backward()
        reference_optimizer.step()
    assert evicted_before_backward > 30
    top = ours.store.stats()["device"]
    assert top["hits"] + top["misses"] == looked_up
    ours.close()
    with TieredStore(store_path, read_only=True, host_cache=NUM) as reopened:
        torch.testing.assert_close(
            reopened.get(torch.arange(NUM)), torch_bag.weight.detach(), rtol=1e-5, atol=1e-6
        )


def test_get_distinct_refuses_ids_that_are_not_sorted_and_distinct():
    with TieredStore(dim=4, host_cache=8) as store:
        with pytest.raises(ValueError, match="sorted distinct"):
            store.get_distinct(torch.tensor([3, 1]))
        with pytest.raises(ValueError, match="sorted distinct"):
            store.get_distinct(torch.tensor([1, 1]))
        weights, slots = store.get_distinct(torch.tensor([1, 3]))
        assert torch.equal(weights, store.get(torch.tensor([1, 3])))


def test_embedding_training_matches_torch(store_path):
    ours = TieredEmbedding(
        NUM,
        DIM,
        padding_idx=2,
        path=store_path,
        host_cache=12,
        device_cache=24,
        optimizer=optim.Adagrad(lr=0.1),
    )
    torch_table = nn.Embedding(NUM, DIM, padding_idx=2, sparse=True)
    with torch.no_grad():
        torch_table.weight.copy_(initial_weights(torch.arange(NUM), DIM, 0, torch.float32))
        torch_table.weight[2] = 0
    reference_optimizer = torch.optim.Adagrad(torch_table.parameters(), lr=0.1)
    rng = np.random.default_rng(3)
    for _ in range(50):
        ids = torch.from_numpy(rng.integers(0, NUM, (4, 5)))
        target = torch.from_numpy(rng.standard_normal((4, 5, DIM)).astype(np.float32))
        (ours(ids) * target).sum().backward()
        reference_optimizer.zero_grad()
        (torch_table(ids) * target).sum().backward()
        reference_optimizer.step()
    ours.close()
    expected = torch_table.weight.detach().clone()
    with TieredStore(store_path, read_only=True, host_cache=NUM) as reopened:
        got = reopened.get(torch.arange(NUM))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)  # the padding row: zero in both


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_embedding_reads_its_padding_row_as_stored_and_never_updates_it(optimizer):
    """``nn.Embedding``'s padding_idx only stops that row's gradient: after ``from_pretrained`` or a
    write, the output for it is the stored row, in training and in eval."""
    weight = torch.randn(NUM, DIM, generator=torch.Generator().manual_seed(4))
    ours = TieredEmbedding.from_pretrained(
        weight.clone(), freeze=False, padding_idx=2, host_cache=8, optimizer=OPTIMIZERS[optimizer][0]()
    )
    torch_table = nn.Embedding.from_pretrained(weight.clone(), freeze=False, padding_idx=2, sparse=True)
    reference_optimizer = OPTIMIZERS[optimizer][1](torch_table.parameters())
    rng = np.random.default_rng(5)
    for _ in range(6):
        ids = torch.from_numpy(rng.integers(0, NUM, (2, 3)))  # rows move through a cache of 8
        ids[0, :2] = 2
        target = torch.from_numpy(rng.standard_normal((2, 3, DIM)).astype(np.float32))
        output = ours(ids)
        torch.testing.assert_close(output, torch_table(ids), rtol=1e-5, atol=1e-6)
        (output * target).sum().backward()
        reference_optimizer.zero_grad()
        (torch_table(ids) * target).sum().backward()
        reference_optimizer.step()
    torch.testing.assert_close(
        ours.store.get(torch.arange(NUM)), torch_table.weight.detach(), rtol=1e-5, atol=1e-6
    )
    assert torch.equal(ours.store.get(torch.tensor([2]))[0], weight[2])
    ours.load_weights(torch.tensor([2]), torch.full((1, DIM), 7.0))
    with torch.no_grad():
        assert torch.equal(ours(torch.tensor([[2]])), torch.full((1, 1, DIM), 7.0))
    ours.close()


def test_a_new_tables_padding_row_starts_at_zero_as_torchs():
    for table in (TieredEmbedding(NUM, DIM, padding_idx=3), TieredEmbeddingBag(NUM, DIM, padding_idx=3)):
        assert torch.equal(table.store.get(torch.tensor([3])), torch.zeros(1, DIM))
        table.close()


def rowwise_adagrad_reference(weights, momentum, grad, lr, eps):
    """FBGEMM's EXACT_ROWWISE_ADAGRAD update, in numpy float64."""
    momentum = momentum + (grad**2).mean(axis=1)
    return weights - (lr / (np.sqrt(momentum) + eps))[:, None] * grad, momentum


def test_rowwise_adagrad_matches_published_update(store_path, device_tier):
    ours = TieredEmbeddingBag(
        NUM,
        DIM,
        mode="sum",
        path=store_path,
        host_cache=12,
        device_cache=24,
        optimizer=optim.RowWiseAdagrad(lr=0.1, eps=1e-8),
        **device_tier,
    )
    device = device_tier["device"]
    weights = initial_weights(torch.arange(NUM), DIM, 0, torch.float32).double().numpy()
    momentum = np.zeros(NUM)
    rng = np.random.default_rng(5)
    for _ in range(50):
        ids, offsets = random_bags(rng)
        target = rng.standard_normal((offsets.numel(), DIM)).astype(np.float32)
        (ours(ids.to(device), offsets.to(device)) * torch.from_numpy(target).to(device)).sum().backward()
        bag_of = np.searchsorted(offsets.numpy(), np.arange(ids.numel()), side="right") - 1
        grad = np.zeros((NUM, DIM))
        np.add.at(grad, ids.numpy(), target[bag_of])
        touched = np.unique(ids.numpy())
        weights[touched], momentum[touched] = rowwise_adagrad_reference(
            weights[touched], momentum[touched], grad[touched], 0.1, 1e-8
        )
    ours.close()
    with TieredStore(store_path, read_only=True, host_cache=NUM) as reopened:
        rows = reopened.get(torch.arange(NUM), with_state=True).double()
    np.testing.assert_allclose(rows[:, :DIM].numpy(), weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rows[:, DIM].numpy(), momentum, rtol=1e-5, atol=1e-7)


def test_per_sample_weights_gradients_match_torch():
    ours = TieredEmbeddingBag(NUM, DIM, mode="sum", host_cache=40, dtype=torch.float64)
    ours.eval()  # rows stay put, so the function of per_sample_weights is fixed
    ids, offsets = random_bags(np.random.default_rng(2), bags=5)
    weights = torch.rand(ids.numel(), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda w: ours(ids, offsets, w), (weights,))
    torch_bag = oracle_bag("sum", dtype=torch.float64)
    (ours(ids, offsets, weights) ** 2).sum().backward()
    ours_grad, weights.grad = weights.grad.clone(), None
    (torch_bag(ids, offsets, weights) ** 2).sum().backward()
    torch.testing.assert_close(ours_grad, weights.grad)
    ours.close()


def test_unbounded_table_grows_with_any_int64_id():
    ours = TieredEmbeddingBag(None, DIM, mode="sum", host_cache=16)
    huge = torch.tensor([2**62, 7, 2**40 + 1])
    out = ours(huge, torch.tensor([0]))
    torch.testing.assert_close(out[0], initial_weights(huge, DIM, 0, torch.float32).sum(0))
    assert len(ours.store) == 3
    ours.close()


@pytest.mark.parametrize("missing", ["init", "zero", "error"])
def test_eval_and_no_grad_lookups_do_not_grow_the_table(missing):
    ours = TieredEmbeddingBag(None, DIM, mode="sum", host_cache=16, missing=missing)
    ours(torch.tensor([1, 2]), torch.tensor([0]))  # training: 1 and 2 join
    ours.eval()
    unseen = torch.tensor([1, 99])
    if missing == "error":
        with pytest.raises(KeyError, match="99"):
            ours(unseen, torch.tensor([0]))
    else:
        out = ours(unseen, torch.tensor([0, 1]))
        expected_99 = (
            initial_weights(torch.tensor([99]), DIM, 0, torch.float32)[0]
            if missing == "init"
            else torch.zeros(DIM)
        )
        torch.testing.assert_close(out[1], expected_99)
    ours.train()
    with torch.no_grad():
        ours(torch.tensor([123]), torch.tensor([0])) if missing != "error" else None
    assert len(ours.store) == 2 and 99 not in ours.store and 123 not in ours.store
    ours.close()


def test_state_dict_resumes_the_same_store_and_copies_into_another(tmp_path):
    first = TieredEmbeddingBag(
        None, DIM, mode="sum", path=tmp_path / "a", host_cache=8, optimizer=optim.Adam()
    )
    for step in range(3):
        first(torch.tensor([step, 10 + step, 30]), torch.tensor([0])).sum().backward()
    state = first.state_dict()
    assert state["_extra_state"]["step"] == 3
    ids = torch.tensor([0, 1, 2, 10, 11, 12, 30])
    expected = first.store.get(ids, with_state=True)
    first.close()  # as when a checkpoint is loaded in a new process (LMDB opens a store once per process)
    second = TieredEmbeddingBag(
        None, DIM, mode="sum", path=tmp_path / "b", host_cache=8, optimizer=optim.Adam()
    )
    second.load_state_dict(state)
    assert second.step == 3
    torch.testing.assert_close(second.store.get(ids, with_state=True), expected)
    assert len(second.store) == 7
    resumed = TieredEmbeddingBag(
        None, DIM, mode="sum", path=tmp_path / "a", host_cache=8, optimizer=optim.Adam()
    )
    resumed.load_state_dict(state)  # the same store: only the step count is restored
    assert resumed.step == 3 and len(resumed.store) == 7
    wrong = TieredEmbeddingBag(
        None, DIM, mode="sum", path=tmp_path / "c", host_cache=8, optimizer=optim.SGD()
    )
    with pytest.raises(ValueError, match="optimizer"):
        wrong.load_state_dict(state)
    for module in (second, resumed, wrong):
        module.close()


def test_module_holds_no_weights_and_follows_to_and_train_eval():
    ours = TieredEmbeddingBag(None, DIM, host_cache=8)
    assert [name for name, _ in ours.named_parameters()] == ["trainable"]  # the freezing switch
    assert sum(parameter.numel() for parameter in ours.parameters()) == 0
    assert "trainable" not in ours.state_dict()
    assert ours.to("cpu") is ours and ours.eval().training is False
    ours.close()


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda m: m(torch.tensor([1, -2]), torch.tensor([0])), ValueError, "input.*negative"),
        (lambda m: m(torch.tensor([1, NUM]), torch.tensor([0])), IndexError, "input.*num_embeddings"),
        (lambda m: m(torch.tensor([1.0, 2.0]), torch.tensor([0])), TypeError, "input.*integer"),
        (
            lambda m: m(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1])),
            ValueError,
            "offsets.*non-decreasing",
        ),
        (lambda m: m(torch.tensor([1, 2, 3]), torch.tensor([1, 2])), ValueError, r"offsets\[0\]"),
        (lambda m: m(torch.tensor([1, 2, 3]), torch.tensor([0, 4])), ValueError, "offsets point past"),
        (lambda m: m(torch.tensor([1, 2, 3]), None), ValueError, "offsets is required"),
        (lambda m: m(torch.tensor([[1, 2]]), torch.tensor([0])), ValueError, "offsets must be None"),
        (
            lambda m: m(torch.tensor([1, 2, 3]), torch.tensor([0]), torch.ones(2)),
            ValueError,
            "per_sample_weights.*shape",
        ),
        (
            lambda m: m(torch.tensor([1, 2, 3]), torch.tensor([0]), torch.ones(3, dtype=torch.float64)),
            TypeError,
            "per_sample_weights.*dtype",
        ),
    ],
)
def test_bad_bag_input_names_the_argument(call, error, message):
    ours = TieredEmbeddingBag(NUM, DIM, mode="sum", host_cache=16)
    with pytest.raises(error, match=message):
        call(ours)
    assert len(ours.store) == 0  # nothing was looked up
    ours.close()


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_include_last_offset_leaves_the_entries_past_the_last_offset_out(mode):
    """As torch's forward (pytorch issue 89677), in forward and backward: the rows after one SGD step
    of lr 1 are torch's on the input cut at the last offset (for "sum", torch's on the whole input
    too; its "mean" and "max" give the left-out entries gradient, and "max" reads them)."""
    weight = torch.randn(NUM, DIM, generator=torch.Generator().manual_seed(9))
    ids, offsets = torch.tensor([1, 2, 3, 4, 99]), torch.tensor([0, 2, 3, 3])  # 4, 99: past the last offset
    weights = torch.tensor([0.5, 2.0, 3.0, 4.0, 5.0]) if mode == "sum" else None
    ours = TieredEmbeddingBag.from_pretrained(
        weight.clone(), freeze=False, mode=mode, include_last_offset=True, optimizer=optim.SGD(lr=1.0)
    )
    theirs = nn.EmbeddingBag.from_pretrained(
        weight.clone(), freeze=False, mode=mode, include_last_offset=True
    )
    cut = (ids[:3], offsets, None if weights is None else weights[:3])
    output = ours(ids, offsets, weights)
    expected = theirs(*cut)
    torch.testing.assert_close(output, expected)
    if mode == "sum":
        torch.testing.assert_close(output, theirs(ids, offsets, weights))  # 99: out of range, unread
    grad = torch.randn(output.shape, generator=torch.Generator().manual_seed(10))
    output.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(ours.store.get(torch.arange(NUM)), weight - theirs.weight.grad)
    with pytest.raises(ValueError, match="at least one offset"):
        ours(ids, torch.tensor([], dtype=torch.int64))
    ours.close()


def test_per_sample_weights_need_sum_mode():
    ours = TieredEmbeddingBag(NUM, DIM, mode="mean", host_cache=16)
    with pytest.raises(ValueError, match="per_sample_weights.*mode='sum'"):
        ours(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(2))
    ours.close()


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"num_embeddings": -1}, ValueError),
        ({"embedding_dim": 0}, ValueError),
        ({"embedding_dim": -1}, ValueError),
        ({"mode": "median"}, ValueError),
        ({"padding_idx": NUM}, ValueError),
        ({"missing": "drop"}, ValueError),
        ({"optimizer": "sgd"}, TypeError),
        ({"max_norm": 1.0}, NotImplementedError),
    ],
)
def test_bad_constructor_arguments(kwargs, error):
    arguments = {"num_embeddings": NUM, "embedding_dim": DIM} | kwargs
    with pytest.raises(error, match=next(iter(kwargs))):
        TieredEmbeddingBag(**arguments, host_cache=8)


def test_dtype_none_follows_torchs_default_dtype():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        tables = [(TieredEmbeddingBag(NUM, DIM, mode="sum"), nn.EmbeddingBag(NUM, DIM, mode="sum"))]
        tables.append((TieredEmbedding(NUM, DIM), nn.Embedding(NUM, DIM)))
        ids = torch.tensor([[1, 5], [7, 7]])
        for ours, theirs in tables:
            assert theirs.weight.dtype == torch.float64
            ours.load_weights(torch.arange(NUM), theirs.weight.detach())
            output = ours(ids)
            assert output.dtype == torch.float64 and ours.store.dtype == torch.float64
            assert torch.equal(output, theirs(ids))
            output.sum().backward()  # trains in float64 (the torch backend)
            ours.close()
    finally:
        torch.set_default_dtype(previous)


def test_freezing_the_torch_ways_stops_and_resumes_training_as_torchs():
    """``requires_grad_`` on a table, a collection or a model holding them freezes the tables (their
    rows unchanged by a backward, as a frozen ``nn.EmbeddingBag``'s) and unfreezes them; unfrozen,
    a table trains as torch's."""
    weight = torch.randn(NUM, DIM, generator=torch.Generator().manual_seed(6))
    ours = TieredEmbeddingBag.from_pretrained(weight.clone(), freeze=False, mode="sum", host_cache=8)
    collection = TieredEmbeddingBagCollection([EmbeddingBagConfig(NUM, DIM, name="t", feature_names=["f"])])
    group = collection.groups[f"dim{DIM}"]
    model = nn.ModuleDict({"table": ours, "other": collection})
    head = nn.Linear(DIM, 1)  # trains on: the loss needs a gradient
    features = KeyedJaggedTensor(["f"], torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]))
    ids = torch.tensor([[1, 4], [4, 6]])

    def rows():
        return torch.cat([ours.store.get(torch.arange(NUM)), group.store.get(torch.arange(NUM))])

    freezings = [lambda: ours.requires_grad_(False) and collection.requires_grad_(False)]
    freezings.append(lambda: model.requires_grad_(False))
    for freeze in freezings:
        freeze()
        assert ours.frozen and group.frozen
        before = rows()
        (head(ours(ids)).sum() + head(collection(features).values()).sum()).backward()
        assert torch.equal(rows(), before)
        model.requires_grad_(True)
    assert not ours.frozen and not group.frozen
    theirs = nn.EmbeddingBag.from_pretrained(weight.clone(), freeze=False, mode="sum")
    reference_optimizer = torch.optim.SGD(theirs.parameters(), lr=ours.optimizer.lr)
    for _ in range(3):
        reference_optimizer.zero_grad()
        (theirs(ids) * 2).sum().backward()
        reference_optimizer.step()
        (ours(ids) * 2).sum().backward()
    torch.testing.assert_close(ours.store.get(torch.arange(NUM)), theirs.weight.detach())
    assert ours.trainable.grad is None  # no process group: nothing to accumulate (DDP: the DMP test)
    frozen = TieredEmbedding.from_pretrained(weight.clone(), host_cache=8)  # freeze=True, torch's default
    assert frozen.frozen and not frozen(torch.tensor([1])).requires_grad
    for table in (ours, collection, frozen):
        table.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("module", ["bag", "embedding"])
def test_a_low_precision_outputs_gradient_is_summed_per_row_in_float32(dtype, module):
    """A module cast to half precision keeps float32 rows: each row's gradient is summed in float32
    (torch's ``sparse=True`` gradient of float32 weights, given the same half-precision gradient),
    not in the output's dtype, which loses whole units over a thousand entries."""
    weight = torch.randn(NUM, DIM, generator=torch.Generator().manual_seed(7))
    ids = torch.tensor([1] * 1000 + [2, 3]).reshape(-1, 2)
    grad = torch.rand(
        ids.shape[0], *([2] if module == "embedding" else []), DIM, generator=torch.Generator().manual_seed(8)
    )
    grad = (grad * 4).to(dtype)
    if module == "bag":
        ours = TieredEmbeddingBag.from_pretrained(
            weight.clone(), freeze=False, mode="sum", optimizer=optim.SGD(lr=1.0)
        )
        theirs = nn.EmbeddingBag.from_pretrained(weight.clone(), freeze=False, mode="sum", sparse=True)
    else:
        ours = TieredEmbedding.from_pretrained(weight.clone(), freeze=False, optimizer=optim.SGD(lr=1.0))
        theirs = nn.Embedding.from_pretrained(weight.clone(), freeze=False, sparse=True)
    ours.to(dtype)
    output = ours(ids)
    assert output.dtype == dtype
    torch.testing.assert_close(output, theirs(ids).to(dtype))
    output.backward(grad)
    theirs(ids).backward(grad.float())
    expected = weight - theirs.weight.grad.to_dense()
    torch.testing.assert_close(ours.store.get(torch.arange(NUM)), expected, rtol=1e-5, atol=1e-4)
    ours.close()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8])
def test_from_pretrained_integers_is_a_frozen_lookup_of_exactly_those_integers(dtype):
    """``nn.Embedding.from_pretrained`` of integers (an id -> id table): every bit pattern comes back,
    those that are NaN or Inf as floats of that width too, in eval and in training mode."""
    info = torch.iinfo(dtype)
    special = [info.min, info.max, -1 if info.min < 0 else 1, 0]
    if dtype == torch.int64:
        special += [0x7FF0000000000001, 0x7FF0000000000000, -(2**52)]  # a signalling NaN, +Inf
    elif dtype == torch.int32:
        special += [0x7F800001, 0x7F800000]
    values = torch.tensor(special * 3, dtype=torch.int64)[:12].to(dtype).reshape(6, 2)
    ours = TieredEmbedding.from_pretrained(values, host_cache=4)
    theirs = nn.Embedding.from_pretrained(values)
    ids = torch.tensor([[5, 0, 1], [2, 3, 4]])
    for training in (True, False):
        ours.train(training)
        output = ours(ids)
        assert output.dtype == dtype and torch.equal(output, theirs(ids))
    ours.close()


def test_integer_weights_refuse_to_train_or_to_pool_as_torchs_do():
    values = torch.tensor([[1, 2], [3, 4]])
    with pytest.raises(TypeError, match="frozen lookup"):
        TieredEmbedding.from_pretrained(values, freeze=False)
    with pytest.raises(TypeError, match="frozen lookup"):
        TieredEmbeddingBag.from_pretrained(values)


def test_a_table_of_no_rows_looks_up_nothing_as_torchs():
    for ours, theirs in (
        (TieredEmbeddingBag(0, DIM, mode="sum"), nn.EmbeddingBag(0, DIM, mode="sum")),
        (
            TieredEmbeddingBag.from_pretrained(torch.zeros(0, DIM)),
            nn.EmbeddingBag.from_pretrained(torch.zeros(0, DIM)),
        ),
    ):
        empty = torch.zeros(0, dtype=torch.int64)
        assert torch.equal(ours(empty, torch.tensor([0, 0])), theirs(empty, torch.tensor([0, 0])))
        with pytest.raises(IndexError, match="num_embeddings=0"):
            ours(torch.tensor([0]), torch.tensor([0]))
        ours.close()
    embedding = TieredEmbedding(0, DIM)
    assert embedding(torch.zeros(2, 0, dtype=torch.int64)).shape == (2, 0, DIM)
    embedding.close()
    with pytest.raises(ValueError, match="embedding_dim must be a positive int.*zero-width"):
        TieredEmbeddingBag(4, 0)


def _bag(module, mode="sum", **settings):
    return module(NUM, DIM, mode=mode, **settings)


BAD_INPUTS = {
    "id past num_embeddings": (_bag, lambda m: m(torch.tensor([1, NUM]), torch.tensor([0])), "input"),
    "negative id": (_bag, lambda m: m(torch.tensor([1, -1]), torch.tensor([0])), "input"),
    "float ids": (_bag, lambda m: m(torch.tensor([1.0, 2.0]), torch.tensor([0])), "input"),
    "offsets not from 0": (_bag, lambda m: m(torch.tensor([1, 2]), torch.tensor([1])), "offsets"),
    "decreasing offsets": (_bag, lambda m: m(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1])), "offsets"),
    "offsets past input": (_bag, lambda m: m(torch.tensor([1, 2, 3]), torch.tensor([0, 4])), "offsets"),
    "float offsets": (_bag, lambda m: m(torch.tensor([1, 2]), torch.tensor([0.0])), "offsets"),
    "weights of another dtype": (
        _bag,
        lambda m: m(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(2, dtype=torch.float64)),
        "per_sample_weights",
    ),
    "weights with mean": (
        lambda module: _bag(module, "mean"),
        lambda m: m(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(2)),
        "per_sample_weights",
    ),
    "weights with max": (
        lambda module: _bag(module, "max"),
        lambda m: m(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(2)),
        "per_sample_weights",
    ),
    "padding_idx past the table": (lambda module: _bag(module, padding_idx=NUM), None, "padding_idx"),
    "embedding id past the table": (
        lambda module: module(NUM, DIM),
        lambda m: m(torch.tensor([NUM])),
        "input",
    ),
    "embedding negative id": (lambda module: module(NUM, DIM), lambda m: m(torch.tensor([-1])), "input"),
    "embedding float ids": (lambda module: module(NUM, DIM), lambda m: m(torch.tensor([1.0])), "input"),
    "embedding padding_idx": (lambda module: module(NUM, DIM, padding_idx=-NUM - 1), None, "padding_idx"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_the_type_torch_raises_with_our_message(case):
    """For each bad input, torch's own module is the oracle of the type: ours is an instance of it
    (and of the builtin the message's kind names), its message naming the argument."""
    make, call, argument = BAD_INPUTS[case]
    theirs_module = nn.EmbeddingBag if "embedding " not in case else nn.Embedding
    ours_module = TieredEmbeddingBag if "embedding " not in case else TieredEmbedding
    with pytest.raises(Exception) as theirs:
        call(make(theirs_module)) if call is not None else make(theirs_module)
    with pytest.raises(type(theirs.value), match=argument) as ours:
        table = make(ours_module)
        try:
            call(table)
        finally:
            table.close()
    assert type(ours.value).__module__ == "tierstore.errors"


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_a_learning_rate_schedule_drives_the_fused_optimizer_as_torchs(name):
    """``fused_optimizer()`` is a ``torch.optim.Optimizer``: a ``StepLR`` on it changes the rate
    the table's updates use, as the same schedule on torch's optimizer of an ``nn.EmbeddingBag``;
    its state_dict carries the rates, and a bad one is refused, changing nothing."""
    weight = torch.randn(NUM, DIM, generator=torch.Generator().manual_seed(11))
    make_ours, make_theirs = OPTIMIZERS[name]
    ours = TieredEmbeddingBag.from_pretrained(weight.clone(), freeze=False, mode="sum", optimizer=make_ours())
    theirs = nn.EmbeddingBag.from_pretrained(weight.clone(), freeze=False, mode="sum", sparse=True)
    fused, reference = ours.fused_optimizer(), make_theirs(theirs.parameters())
    schedules = [
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.3) for optimizer in (fused, reference)
    ]
    rng = np.random.default_rng(12)
    for _ in range(5):
        ids = torch.from_numpy(rng.integers(0, NUM, (3, 4)))
        reference.zero_grad()
        theirs(ids).sum().backward()
        reference.step()
        ours(ids).sum().backward()
        fused.step()
        for schedule in schedules:
            schedule.step()
    assert ours.optimizer.lr == pytest.approx(reference.param_groups[0]["lr"])
    torch.testing.assert_close(ours.store.get(torch.arange(NUM)), theirs.weight.detach())
    saved = fused.state_dict()
    with pytest.raises(ValueError, match="lr must be a non-negative number"):
        fused.param_groups[0]["lr"] = -1.0
    assert fused.param_groups[0]["lr"] == ours.optimizer.lr >= 0
    saved["param_groups"][0]["lr"] = 0.5
    again = ours.fused_optimizer()
    assert again is fused  # one per module: a schedule and a checkpoint see the same rates
    again.load_state_dict(saved)
    assert ours.optimizer.lr == 0.5
    ours.optimizer = optim.SGD(lr=0.25) if name == "sgd" else optim.Adagrad(lr=0.25)  # set by hand
    assert fused.state_dict()["param_groups"][0]["lr"] == 0.25
    copied = copy.deepcopy(ours)  # makes its own, over the copy
    assert copied.fused_optimizer() is not fused and copied.fused_optimizer()._tables == [copied]
    for table in (ours, copied):
        table.close()


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
@pytest.mark.parametrize("module", ["bag-sum", "bag-mean", "embedding"])
def test_scale_grad_by_freq_trains_as_torchs(name, module):
    """Each row's gradient divided by its count in the batch: torch's dense ``scale_grad_by_freq``
    (torch has no sparse one), applied to the rows by the fused optimizer."""
    weight = torch.randn(NUM, DIM, generator=torch.Generator().manual_seed(13))
    make_ours, make_theirs = OPTIMIZERS[name]
    if module == "embedding":
        ours = TieredEmbedding.from_pretrained(
            weight.clone(), freeze=False, scale_grad_by_freq=True, optimizer=make_ours(), padding_idx=0
        )
        theirs = nn.Embedding.from_pretrained(
            weight.clone(), freeze=False, scale_grad_by_freq=True, padding_idx=0
        )
    else:
        mode = module.split("-")[1]
        ours = TieredEmbeddingBag.from_pretrained(
            weight.clone(), freeze=False, mode=mode, scale_grad_by_freq=True, optimizer=make_ours()
        )
        theirs = nn.EmbeddingBag.from_pretrained(
            weight.clone(), freeze=False, mode=mode, scale_grad_by_freq=True
        )
    reference = make_theirs(theirs.parameters())
    rng = np.random.default_rng(14)
    for _ in range(4):
        ids = torch.from_numpy(rng.integers(0, 6, (5, 4)))  # many repeats
        grad = torch.from_numpy(
            rng.standard_normal((5, 4, DIM) if module == "embedding" else (5, DIM)).astype(np.float32)
        )
        reference.zero_grad()
        theirs(ids).backward(grad)
        reference.step()
        ours(ids).backward(grad)
    torch.testing.assert_close(
        ours.store.get(torch.arange(NUM)), theirs.weight.detach(), rtol=1e-5, atol=1e-6
    )
    ours.close()
    with pytest.raises(ValueError, match="max mode does not support scaling"):
        TieredEmbeddingBag(NUM, DIM, mode="max", scale_grad_by_freq=True)
