"""The native training step (``host_step.cpp`` through ``kernels.step_passes`` and ``nn.native_step``)
against the reference paths it replaces: torch's unique, the gather-then-``embedding_bag`` lookup
with the gradient kernel and the optimizer kernels, the torch layout of a collection's batch, and
the torch initializer. Rows must match bit for bit: the passes sum in the same order."""

import numpy as np
import pytest
import torch
from helpers import same_bytes
from host_kernels import parallel_host_kernels
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore import EmbeddingBagConfig, KeyedJaggedTensor, TieredEmbeddingBag, optim
from tierstore.errors import CacheCapacityError, StoreFormatError
from tierstore.initializer import initial_rows, reference_initial_rows
from tierstore.kernels import step_passes
from tierstore.kernels.host import openmp_runtime
from tierstore.kernels.native_types import Bags
from tierstore.nn import jagged_batch, native_step
from tierstore.nn.collection import TieredEmbeddingBagCollection
from tierstore.tiers.cold import codec, mmap_store, open_cold_store

OPTIMIZERS = [
    optim.SGD(lr=0.1),
    optim.Adagrad(lr=0.1),
    optim.RowWiseAdagrad(lr=0.1),
    optim.Adam(lr=0.01),
]


@pytest.fixture(scope="module")
def passes():
    return step_passes.passes_of(parallel_host_kernels().step_library)


def _part(key: int) -> int:
    """host_step.cpp's distinct_part: the top 3 bits of the key's hash (SplitMix64's finaliser,
    the kernels' ``mix``), one of 8 parts."""
    bits = (1 << 64) - 1
    x = key & bits
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & bits
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & bits
    return (x ^ (x >> 31)) >> 61


IN_PARTS_FROM = 16384  # host_step.cpp's DISTINCT_IN_PARTS_FROM: larger batches are split by hash


def _check_distinct(ids: torch.Tensor, padding: int | None, distinct) -> None:
    """``distinct`` against torch.unique: rows in first-appearance order (split into parts by hash
    from ``IN_PARTS_FROM`` entries), each entry's row, the entries grouped by row."""
    kept = ids if padding is None else ids[ids != padding]
    expected, counts = torch.unique(kept, return_counts=True)
    order = torch.argsort(distinct.unique)
    assert torch.equal(distinct.unique[order], expected)
    assert torch.equal(distinct.counts[order], counts)
    first_seen = [int(i) for i in dict.fromkeys(kept.tolist())]
    if ids.numel() >= IN_PARTS_FROM:  # part by part, first seen in each
        first_seen.sort(key=_part)
    assert distinct.unique.tolist() == first_seen
    rows = distinct.entry_rows
    padded = ids == padding if padding is not None else torch.zeros_like(ids, dtype=torch.bool)
    assert bool((rows[padded] == distinct.unique.numel()).all())
    assert torch.equal(distinct.unique[rows[~padded]], ids[~padded])
    grouped = torch.argsort(rows.masked_fill(padded, rows.numel() + 1), stable=True)[: kept.numel()]
    assert torch.equal(distinct.order, grouped)  # row by row, ascending within a row
    row_lengths = distinct.starts[1 : order.numel() + 1].diff(prepend=distinct.starts[:1])
    assert torch.equal(row_lengths, distinct.counts)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=200), st.sampled_from([None, 0, 7]))
def test_distinct_by_hashing_matches_torch_unique(passes, ids, padding):
    ids = torch.tensor(ids, dtype=torch.int64)
    _check_distinct(ids, padding, passes.distinct(ids, padding))


@pytest.mark.parametrize("entries", [IN_PARTS_FROM - 1, IN_PARTS_FROM, 53_248])
@pytest.mark.parametrize("spread", [3, 5_000, 2**62])
@pytest.mark.parametrize("padding", [None, 2])
def test_a_large_batch_is_deduplicated_in_parts_by_hash(passes, entries, spread, padding):
    ids = torch.randint(0, spread, (entries,), generator=torch.Generator().manual_seed(entries + spread))
    _check_distinct(ids, padding, passes.distinct(ids, padding))


def test_the_dedupe_does_not_depend_on_the_thread_count():
    runtime = openmp_runtime()
    if runtime is None:
        pytest.skip("the OpenMP runtime (libgomp) is not loaded: one thread count only")
    passes = step_passes.passes_of(parallel_host_kernels().step_library)
    ids = torch.randint(0, 20_000, (50_000,), generator=torch.Generator().manual_seed(0))  # in parts
    threads = runtime.omp_get_max_threads()
    results = []
    try:
        for count in (1, 2, 3, 5):
            runtime.omp_set_num_threads(count)
            distinct = passes.distinct(ids, 11)
            results.append(torch.cat([distinct.unique, distinct.counts, distinct.entry_rows, distinct.order]))
    finally:
        runtime.omp_set_num_threads(threads)
    assert all(torch.equal(results[0], other) for other in results[1:])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(-(2**62), 2**62) | st.integers(0, 30), max_size=300))
def test_the_lean_dedupe_gives_the_ids_in_first_appearance_order(passes, ids):
    assert passes.unique(torch.tensor(ids, dtype=torch.int64)).tolist() == list(dict.fromkeys(ids))


def _train(monkeypatch, native: bool, optimizer, steps, dtype=torch.float32, **settings):
    """Rows of a ``dtype`` table trained on ``steps`` ((forward args), upstream gradient), native or not."""
    monkeypatch.setattr(native_step, "step_passes", native_step.step_passes if native else lambda store: None)
    table = TieredEmbeddingBag(None, 6, optimizer=optimizer, host_cache=48, dtype=dtype, **settings)
    outputs = []
    for arguments, gradient in steps:
        arguments = [a if a is None or not a.is_floating_point() else a.to(dtype) for a in arguments]
        out = table(*arguments)
        (out * gradient).sum().backward()
        outputs.append(out.detach())
    ids = torch.arange(60)
    rows = table.store.get(ids, with_state=True)
    table.close()
    monkeypatch.undo()
    return outputs, rows


def _bag_steps(
    seed: int, include_last_offset: bool, weighted: bool, two_d: bool, padding: bool, one_hot: bool = False
):
    """Six steps' arguments and output gradients: bags of 3 ids (``two_d``) or cut at random; or, with
    ``one_hot``, an id a bag (with ``include_last_offset``, the last 6 ids in no bag)."""
    generator = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(6):
        if two_d:
            ids = torch.randint(0, 60, (30, 1) if one_hot else (5, 3), generator=generator)
            arguments, bags = [ids, None], ids.shape[0]
        else:
            ids = torch.randint(0, 60, (30,), generator=generator)
            cuts = torch.sort(torch.randint(0, 31, (6,), generator=generator)).values
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), cuts])
            if one_hot:  # with include_last_offset, the last offset (24) ends bag 23
                offsets = torch.arange(25 if include_last_offset else 30)
            elif include_last_offset:
                offsets = torch.cat([offsets, torch.tensor([30])])
            arguments, bags = [ids, offsets], offsets.numel() - include_last_offset
        if padding:
            ids[::4] = 3
        weights = torch.rand(ids.shape, generator=generator) if weighted else None
        steps.append(((*arguments, weights), torch.randn(bags, 6, generator=generator)))
    return steps


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: type(o).__name__)
@pytest.mark.parametrize(
    "mode, include_last_offset, weighted, two_d, padding, one_hot",
    [
        ("sum", False, False, False, False, False),
        ("mean", False, False, False, True, False),
        ("sum", True, True, False, True, False),
        ("mean", True, False, True, False, False),
        ("sum", False, True, True, False, False),
        ("sum", False, True, False, True, True),
        ("mean", True, False, False, True, True),
        ("sum", False, False, True, False, True),
    ],
)
def test_native_step_trains_the_rows_of_the_reference_path(
    monkeypatch, optimizer, mode, include_last_offset, weighted, two_d, padding, one_hot
):
    steps = _bag_steps(3, include_last_offset, weighted, two_d, padding, one_hot)
    settings = dict(mode=mode, include_last_offset=include_last_offset, padding_idx=3 if padding else None)
    native_outputs, native_rows = _train(monkeypatch, True, optimizer, steps, **settings)
    reference_outputs, reference_rows = _train(monkeypatch, False, optimizer, steps, **settings)
    assert torch.equal(native_rows, reference_rows)
    for native, reference in zip(native_outputs, reference_outputs):
        torch.testing.assert_close(native, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "shape, offsets, weighted, own_bags",
    [
        ((40,), torch.arange(40), False, True),
        ((40, 1), None, False, True),
        ((40,), torch.arange(40), True, False),  # scaled by the weights
        ((40,), torch.arange(33), False, False),  # include_last_offset: entries 32.. in no bag
        ((40,), torch.arange(0, 40, 2), False, False),  # two entries a bag
        ((40,), torch.arange(20), False, False),  # the last bag holds entries 19..39
    ],
)
def test_entries_are_taken_as_their_own_bags_only_where_each_is_one_of_scale_one(
    passes, shape, offsets, weighted, own_bags
):
    """The pooled pass leaves out each entry's bag and scale (None: the backward takes entry e as
    bag e, of scale 1) exactly where that holds; elsewhere they are written, and the output is
    torch's embedding_bag either way."""
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 25, shape, generator=generator)
    ids[::7] = 4  # the padding row
    flat = ids.reshape(-1)
    distinct = passes.distinct(flat, 4)
    rows = torch.randn(distinct.count, 3, generator=generator)
    slots = torch.randperm(distinct.count, generator=generator)
    table = torch.zeros(25, 3)
    table[distinct.unique] = rows[slots]
    weights = torch.rand(flat.numel(), generator=generator) if weighted else None
    past_last = offsets is not None and offsets.numel() == 33
    if offsets is None:
        count, length, last_end = shape[0], 1, flat.numel()
    elif past_last:
        count, length, last_end = offsets.numel() - 1, 0, int(offsets[-1])
    else:
        count, length, last_end = offsets.numel(), 0, flat.numel()
    bags = Bags(offsets, length, count, last_end, False, weights, 3, None)
    out, entry_bag, scale = passes.pooled(rows, slots, distinct, bags)
    kept = flat[:last_end] if past_last else ids  # entries past the last offset are in no bag
    expected = torch.nn.functional.embedding_bag(
        kept,
        table,
        offsets,
        mode="sum",
        per_sample_weights=None if weights is None else weights[: kept.numel()],
        padding_idx=4,
        include_last_offset=past_last,
    )
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert (entry_bag is None, scale is None) == (own_bags, own_bags)
    if not own_bags:
        bag_of = torch.bucketize(torch.arange(flat.numel()), offsets[:count], right=True) - 1
        bag_of[last_end:] = -1
        assert torch.equal(entry_bag, bag_of)
        expected_scale = (weights if weighted else torch.ones(flat.numel())).masked_fill(flat == 4, 0)
        assert torch.equal(scale, expected_scale.masked_fill(bag_of < 0, 0))


@pytest.mark.parametrize(
    "optimizer", [*OPTIMIZERS, optim.Adagrad(lr=0.1, stochastic_rounding=True)], ids=repr
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "mode, weighted, padding, one_hot",
    [("sum", True, False, False), ("mean", False, True, False), ("sum", True, True, True)],
)
def test_native_step_on_16_bit_rows_trains_the_rows_of_the_reference_path(
    monkeypatch, optimizer, dtype, mode, weighted, padding, one_hot
):
    """16-bit rows: pooled in float32 and rounded once to the output, updated by the _16 kernels'
    step (stochastic rounding by the slots' keys); new rows initialised natively. The rows equal
    the reference path's bit for bit (the state too), and the outputs within one rounding."""
    steps = _bag_steps(4, False, weighted, False, padding, one_hot)
    settings = dict(mode=mode, padding_idx=3 if padding else None, dtype=dtype)
    native_outputs, native_rows = _train(monkeypatch, True, optimizer, steps, **settings)
    reference_outputs, reference_rows = _train(monkeypatch, False, optimizer, steps, **settings)
    assert native_rows.dtype == dtype
    assert torch.equal(native_rows.view(torch.int16), reference_rows.view(torch.int16))
    for native, reference in zip(native_outputs, reference_outputs):
        assert native.dtype == dtype
        torch.testing.assert_close(native.float(), reference.float(), rtol=2**-7, atol=2**-14)


def test_the_native_path_is_the_one_taken(monkeypatch):
    looked_up = []
    lookup_bags = step_passes.StepPasses.lookup_bags
    monkeypatch.setattr(
        step_passes.StepPasses, "lookup_bags", lambda *a: looked_up.append(lookup_bags(*a)) or looked_up[-1]
    )
    table = TieredEmbeddingBag(10, 4, mode="sum", host_cache=16)
    table(torch.tensor([1, 2, 3]), torch.tensor([0, 2])).sum().backward()
    # deduplicated, found, read in and pooled by one native call
    assert len(looked_up) == 1 and looked_up[0][3].misses == 3
    with torch.no_grad():  # evaluation reads through the store (ids not seen stay out of it)
        table(torch.tensor([1, 2, 3]), torch.tensor([0, 2]))
    assert len(looked_up) == 1


def test_a_tier_that_must_grow_for_a_batch_takes_the_passes_one_by_one(monkeypatch):
    """A growing tier without the room for a batch grows first (``make_room``), so the batch takes
    the dedupe, the admission and the pooled read as three calls; once the tier is full size, one."""
    calls = []
    for name in ("lookup_bags", "make_resident", "pooled"):
        original = getattr(step_passes.StepPasses, name)
        monkeypatch.setattr(
            step_passes.StepPasses, name, lambda *a, _o=original, _n=name: calls.append(_n) or _o(*a)
        )
    table = TieredEmbeddingBag(None, 4, mode="sum", host_cache="4MiB")
    top = table.store.stack.top
    assert top.capacity < 5000 < top.max_capacity
    table(torch.arange(5000), torch.arange(0, 5000, 50)).sum().backward()
    assert calls == ["make_resident", "pooled"] and top.capacity >= 5000
    calls.clear()
    table(torch.arange(4900, 5100), torch.arange(0, 200, 50)).sum().backward()
    assert calls == ["lookup_bags"]


@pytest.mark.parametrize("between", ["a second forward", "a load of new rows"])
@pytest.mark.parametrize("bag_length", [5, 1], ids=["bags of 5", "an id a bag"])
def test_rows_moved_between_forward_and_backward_are_found_again(monkeypatch, between, bag_length):
    """A second forward evicts the first one's rows (a cache of one batch's rows), or a load takes
    them out of the cache: the first backward's update goes through the store, which finds them
    again, as the reference path does (one-hot bags too: their gradients summed with no entry bags)."""
    generator = torch.Generator().manual_seed(1)
    first, second = torch.arange(0, 20), torch.arange(20, 40)
    gradients = [torch.randn(20 // bag_length, 6, generator=generator) for _ in range(2)]
    loaded = torch.randn(5, 6, generator=generator)
    offsets = torch.arange(0, 20, bag_length)
    results = []
    for native in (True, False):
        monkeypatch.setattr(native_step, "step_passes", native_step.step_passes if native else lambda s: None)
        table = TieredEmbeddingBag(None, 6, mode="sum", optimizer=optim.Adagrad(lr=0.1), host_cache=24)
        one = table(first, offsets)
        if between == "a second forward":
            two = table(second, offsets)
        else:
            table.load_weights(first[::4], loaded)
        (one * gradients[0]).sum().backward()
        if between == "a second forward":
            (two * gradients[1]).sum().backward()
        results.append(table.store.get(torch.arange(40), with_state=True))
        table.close()
        monkeypatch.undo()
    assert torch.equal(results[0], results[1])
    if between == "a load of new rows":  # the update landed on the loaded rows, not the old ones
        assert not torch.equal(results[0][first[::4], :6], loaded)


def test_rows_do_not_depend_on_the_thread_count(monkeypatch):
    runtime = openmp_runtime()
    if runtime is None:
        pytest.skip("the OpenMP runtime (libgomp) is not loaded: one thread count only")
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 5000, (8192,), generator=generator)
    offsets = torch.arange(0, 8192, 4)
    gradient = torch.randn(offsets.numel(), 8, generator=generator)
    threads = runtime.omp_get_max_threads()
    rows = []
    try:
        for count in (1, 2, 3):
            runtime.omp_set_num_threads(count)
            table = TieredEmbeddingBag(None, 8, mode="sum", optimizer=optim.Adam(lr=0.01), host_cache=8192)
            for _ in range(3):
                (table(ids, offsets) * gradient).sum().backward()
            rows.append(table.store.get(torch.arange(5000), with_state=True))
            table.close()
    finally:
        runtime.omp_set_num_threads(threads)
    assert all(torch.equal(rows[0], other) for other in rows[1:])


def _kjt(seed: int, weighted: bool, one_id_features: tuple[int, ...] = (), batch: int = 5):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 4, (3, batch))
    lengths[list(one_id_features)] = 1  # bags of one id (the native layout's transpose)
    values = np.concatenate([rng.integers(0, 40, int(count)) for count in lengths.sum(axis=1)])
    weights = torch.from_numpy(rng.random(values.size).astype(np.float32)) if weighted else None
    return KeyedJaggedTensor(
        ["a", "b", "c"],
        torch.from_numpy(values),
        lengths=torch.from_numpy(lengths.reshape(-1)),
        weights=weights,
    )


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize(("one_id_features", "batch"), [((), 5), ((0, 2), 70), ((0, 1, 2), 130)])
def test_a_collection_batch_is_laid_out_as_the_torch_reference(monkeypatch, weighted, one_id_features, batch):
    tables = [
        EmbeddingBagConfig(40, 4, name="ta", feature_names=["a"]),
        EmbeddingBagConfig(40, 8, name="tb", feature_names=["b"]),
        EmbeddingBagConfig(40, 4, name="tc", feature_names=["c"]),
    ]
    collection = TieredEmbeddingBagCollection(tables, host_cache=64)
    for seed in range(5):
        kjt = _kjt(seed, weighted, one_id_features, batch)
        native = jagged_batch.JaggedBatch(kjt, collection._table_of_feature)
        monkeypatch.setattr(jagged_batch, "host_passes", lambda: None)
        reference = jagged_batch.JaggedBatch(kjt, collection._table_of_feature)
        monkeypatch.undo()
        assert torch.equal(native.feature_starts, reference.feature_starts)
        for features in ([0, 2], [1], [0, 1, 2]):
            for ours, theirs in zip(native.group_bags(features), reference.group_bags(features)):
                assert (ours is None) == (theirs is None)
                if ours is not None:
                    assert torch.equal(ours, theirs.to(ours.dtype))
    collection.close()


def _two_tables(monkeypatch, native: bool, bounds: dict[str, int]) -> TieredEmbeddingBagCollection:
    """A collection of two dim-4 tables (``{name: num_embeddings}``) reading features "a" and "b",
    its batches checked natively or (``native`` False) by the torch reference."""
    if not native:
        monkeypatch.setattr(jagged_batch, "host_passes", lambda: None)
    tables = [
        EmbeddingBagConfig(rows, 4, name=name, feature_names=[feature])
        for (name, rows), feature in zip(bounds.items(), "ab")
    ]
    return TieredEmbeddingBagCollection(tables, host_cache=64)


@pytest.mark.parametrize("native", [True, False])
def test_a_bad_id_is_refused_naming_its_table_either_way(monkeypatch, native):
    collection = _two_tables(monkeypatch, native, {"small": 10, "large": 20})
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([3, 9, 15, 20]), lengths=torch.tensor([1, 1, 1, 1]))
    with pytest.raises(IndexError, match=r"table 'large': ids must be in \[0, 20\), got 20"):
        collection(kjt)
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([3, -1, 15, 2]), lengths=torch.tensor([1, 1, 1, 1]))
    with pytest.raises(IndexError, match=r"table 'small': ids must be in \[0, 10\), got -1"):
        collection(kjt)
    assert len(collection.groups["dim4"].store) == 0  # refused before any lookup
    collection.close()


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(
    "values, lengths, message",
    [
        ([1, 2, 3], [1, -1, -5, 1], "lengths must be non-negative, got -1"),  # the first
        ([1, 2, 3], [1, 1, 0, 0], "lengths sum to 2 but values holds 3 ids"),
        ([1, 2], [1, 1, 1, 0], "lengths sum to 3 but values holds 2 ids"),
        ([1, 2], [2**62, 2**62, 2**62, 1], f"lengths sum to {2**63 - 1} but"),  # past int64: no read
        ([1, 2], [2**63 - 1, 1, -(2**63) + 2, 0], "non-negative, got -9223372036854775806"),
    ],
)
def test_bad_lengths_are_refused_before_an_id_is_read(monkeypatch, native, values, lengths, message):
    collection = _two_tables(monkeypatch, native, {"ta": 10, "tb": 10})
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor(values), lengths=torch.tensor(lengths))
    with pytest.raises(ValueError, match=message):
        collection(kjt)
    assert len(collection.groups["dim4"].store) == 0
    collection.close()


def test_a_shared_features_lengths_are_checked_before_it_is_split():
    """Lengths summing below the values would split a shared feature's ids short: refused first."""
    tables = [
        EmbeddingBagConfig(10, 4, name="ta", feature_names=["a"]),
        EmbeddingBagConfig(10, 4, name="tb", feature_names=["a"]),
    ]
    collection = TieredEmbeddingBagCollection(tables, host_cache=64)
    kjt = KeyedJaggedTensor(["a"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="lengths sum to 2 but values holds 3 ids"):
        collection(kjt)
    collection.close()


@pytest.mark.parametrize(
    "dim, state_width, seed", [(1, 0, 0), (5, 1, 123456789), (16, 16, -3), (64, 128, 2**62)]
)
def test_native_initial_rows_are_the_reference_bit_for_bit(dim, state_width, seed):
    ids = torch.cat([torch.randint(0, 2**62, (3000,)), torch.arange(50), torch.tensor([2**63 - 1])])
    native = initial_rows(ids, dim, state_width, seed, torch.float32)
    assert torch.equal(native, reference_initial_rows(ids, dim, state_width, seed, torch.float32))


def test_a_pass_called_with_the_wrong_number_of_arguments_is_refused(passes):
    with pytest.raises(TypeError, match="step_rows_moved takes 4 arguments, got 3"):
        passes._functions["step_rows_moved"](0, 0, 0)


@pytest.mark.parametrize(
    "rows, width, spare", [(1, 1, 0), (7, 3, 0), (3000, 64, 4), (100, 67, 5), (4, 256, 8)]
)
def test_native_row_checks_are_the_reference_bit_for_bit(rows, width, spare):
    """The cold stores' row checks are a file format: the native pass must give numpy's bits,
    for rows read in place as a prefix of wider stored rows too."""
    rng = np.random.default_rng(width)
    stored = rng.integers(0, 256, (rows, width + spare), dtype=np.uint8)
    keys = rng.integers(-(2**63), 2**63 - 1, rows, dtype=np.int64)
    native = codec.row_hashes(keys, stored[:, :width])
    assert np.array_equal(native, codec.reference_row_hashes(keys, stored[:, :width]))


def _mmap_store(path):
    path.mkdir(exist_ok=True)
    return open_cold_store("mmap", path, 5, torch.float32, False, index_kernels=parallel_host_kernels())


@pytest.mark.parametrize("native", [True, False])
def test_the_mmap_stores_read_finds_rows_in_the_log_and_the_main_file(tmp_path, monkeypatch, native):
    """Rows flushed to the main file, and newer rows of half of them staged in the log: the read
    (native, or the reference) gives the newest."""
    if not native:
        monkeypatch.setattr(mmap_store, "host_passes", lambda: None)
    store = _mmap_store(tmp_path / "s")
    keys = torch.arange(0, 300, 3)
    store.put(keys, torch.arange(keys.numel() * 5, dtype=torch.float32).view(-1, 5))
    store.flush()
    store.put(keys[::2], -torch.ones(keys[::2].numel(), 5))  # in the log, over the main rows
    asked = torch.cat([keys, torch.tensor([1, 2, 10**12])])
    rows, found = store.get(asked)
    expected = torch.arange(keys.numel() * 5, dtype=torch.float32).view(-1, 5)
    expected[::2] = -1
    assert found.tolist() == [True] * keys.numel() + [False] * 3
    assert torch.equal(rows[: keys.numel()], expected)
    store.close()


def test_a_damaged_row_is_refused_by_the_native_read(tmp_path):
    store = _mmap_store(tmp_path / "s")
    store.put(torch.arange(10), torch.ones(10, 5))
    store.flush()
    store.close()
    with open(tmp_path / "s" / "rows.bin", "r+b") as file:  # row 3's first value
        file.seek(3 * (5 * 4 + 4))
        file.write(b"\xff")
    store = _mmap_store(tmp_path / "s")
    with pytest.raises(
        StoreFormatError, match=r"rows.bin is damaged: 1 stored row\(s\) fail their checksum \(first id: 3\)"
    ):
        store.get(torch.tensor([1, 3, 5]))
    rows, found = store.get(torch.tensor([1, 5]))
    assert bool(found.all()) and torch.equal(rows, torch.ones(2, 5))
    store.close()


def test_the_pooled_pass_reads_the_rows_holding_the_stores_lock(monkeypatch):
    """A lookahead worker moves rows under the store's lock: the pass reading rows in place must
    hold it from making them resident to reading them."""
    table = TieredEmbeddingBag(10, 4, mode="sum", host_cache=16)
    held = []
    for name in ("pooled", "lookup_bags"):  # the pass alone, or within the one-call lookup
        original = getattr(step_passes.StepPasses, name)

        def checked(*arguments, _original=original):
            held.append(table.store._lock._is_owned())
            return _original(*arguments)

        monkeypatch.setattr(step_passes.StepPasses, name, checked)
    table(torch.tensor([1, 2, 3]), torch.tensor([0, 2])).sum().backward()
    monkeypatch.setattr(table.store.stack, "lookup_bags", lambda *arguments: None)  # the general path
    table(torch.tensor([1, 2, 3]), torch.tensor([0, 2])).sum().backward()
    assert held == [True, True]
    table.close()


@pytest.mark.parametrize("one_call", [True, False], ids=["in the lookup's call", "the passes one by one"])
def test_more_distinct_ids_than_the_tier_holds_are_refused_and_change_nothing(monkeypatch, one_call):
    table = TieredEmbeddingBag(None, 4, mode="sum", host_cache=4)
    table(torch.tensor([0, 1]), torch.tensor([0])).sum().backward()
    if not one_call:
        monkeypatch.setattr(table.store.stack, "lookup_bags", lambda *arguments: None)
    top = table.store.stack.top
    before = {name: getattr(top, name).clone() for name in ("slot_keys", "rows", "dirty", "pins")}
    stats = table.store.stats()
    with pytest.raises(CacheCapacityError, match=r"this batch has 5 distinct ids but the top cache tier"):
        table(torch.tensor([0, 1, 2, 3, 4, 4]), torch.tensor([0, 3]))
    for name, value in before.items():
        assert same_bytes(getattr(top, name), value), name
    assert table.store.stats() == stats
    table(torch.tensor([0, 1, 2, 3]), torch.tensor([0])).sum().backward()  # a batch that fits still runs
    table.close()
