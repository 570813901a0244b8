"""A host tier's direct layout: bounded tables' rows placed at their home slots and found there
without the index, and nothing found differently from a tier without one (the store against a
dict and training against ``nn.EmbeddingBag``; the dict-oracle state machines in
``test_store_oracle`` run layouts too)."""

import pytest
import torch
from helpers import initial, tiers_growing_from

import tierstore
from tierstore import EmbeddingBagConfig, KeyedJaggedTensor, TieredStore
from tierstore.nn import TieredEmbeddingBag, TieredEmbeddingBagCollection
from tierstore.tiers.direct_layout import BYTES_PER_SLOT, DirectLayout
from tierstore.tiers.row_cache import RowCache

DIM = 4


def at_home(tier) -> tuple[int, int]:
    """(rows the tier holds whose key has a home, how many of them are at it)."""
    held = (tier.slot_keys >= 0).nonzero().squeeze(1)
    homes = tier.direct.homes(tier.slot_keys[held])
    return int((homes >= 0).sum()), int((homes == held).sum())


def test_every_table_gets_homes_where_all_are_bounded_and_fit():
    layout = DirectLayout.choose([5, 3, 4], capacity=12)
    assert layout.bases.tolist() == [0, 5, 8] and layout.sizes.tolist() == [5, 3, 4]
    assert layout.rows == 12
    beside_unbounded = DirectLayout.choose([5, 3, None, 4], capacity=12)  # the half rule: room for it
    assert beside_unbounded.sizes.tolist() == [0, 3, 0, 0]


def test_past_the_capacity_the_smallest_tables_get_homes_in_half_of_it():
    layout = DirectLayout.choose([1000, 3, 20, 40, 5_000], capacity=100)
    assert layout.sizes.tolist() == [0, 3, 20, 0, 0]  # 3 + 20 <= 50, + 40 is past it
    assert layout.bases.tolist() == [0, 0, 3, 0, 0]
    assert DirectLayout.choose([None, 80], capacity=100) is None
    assert DirectLayout.choose([200], capacity=100) is None


def test_homes_of_keys_by_table_number_and_id():
    layout = DirectLayout.choose([5, 3], capacity=8)
    keys = torch.tensor([0, 4, 5, 1 << 47, (1 << 47) + 2, (1 << 47) + 3, 2 << 47, -1])
    assert layout.homes(keys).tolist() == [0, 4, -1, 5, 7, -1, -1, -1]


@pytest.mark.parametrize("backend", ["mmap", "lmdb"])
def test_a_held_whole_table_places_rows_at_home_and_reads_them_back(tmp_path, backend):
    rows = torch.randn(50, DIM)
    with TieredStore(tmp_path / "s", dim=DIM, backend=backend, most_rows=50) as store:
        top = store.stack.top
        assert top.capacity == 50 and top.direct.rows == 50
        store.put(torch.arange(49, -1, -1), rows.flip(0))
        assert at_home(top) == (50, 50)
        assert torch.equal(store.get(torch.arange(50)), rows)
        assert len(top) == 50 and top.stats.evictions == 0


def test_keys_without_a_home_and_homes_taken_by_others_are_still_found(tmp_path):
    """most_rows is the most ids, not a bound on their values: keys past it go through the index,
    taking homes meanwhile free, and the keys of those homes then live elsewhere."""
    oracle = {}
    with TieredStore(tmp_path / "s", dim=DIM, most_rows=20, host_cache=20) as store:
        top = store.stack.top
        strangers = torch.arange(1000, 1012)
        store.put(strangers, torch.randn(12, DIM))
        oracle.update(zip(strangers.tolist(), store.get(strangers)))
        assert len(top) == 12
        natives = torch.arange(0, 8)  # 8 free slots are left; some homes are taken
        got = store.get(natives)
        oracle.update(zip(natives.tolist(), got))
        held, home = at_home(top)
        assert held == 8 and home < 8  # some live away from their homes
        assert torch.equal(got, torch.stack([initial(key, DIM) for key in natives.tolist()]))
        more = torch.arange(8, 20)  # past the capacity: evictions, then homes where free
        oracle.update(zip(more.tolist(), store.get(more)))
        keys = torch.tensor(sorted(oracle))
        assert torch.equal(store.get(keys), torch.stack([oracle[key] for key in keys.tolist()]))
        store.flush()
    with TieredStore(tmp_path / "s", dim=DIM, most_rows=20, host_cache=20) as store:
        assert torch.equal(store.get(keys), torch.stack([oracle[key] for key in keys.tolist()]))


def test_a_removed_row_frees_its_home_for_its_key(tmp_path):
    with TieredStore(tmp_path / "s", dim=DIM, most_rows=30) as store:
        top = store.stack.top
        store.get(torch.arange(30))
        assert store.remove(torch.arange(0, 30, 3)) == 10
        assert len(top) == 20
        store.put(torch.tensor([1000, 1001]), torch.ones(2, DIM))  # keys without homes take free slots
        got = store.get(torch.arange(0, 30, 3))  # back from their initial rows, at home where free
        assert torch.equal(got, torch.stack([initial(key, DIM) for key in range(0, 30, 3)]))
        held, home = at_home(top)
        assert held == 30 - 2 and home >= 30 - 2 - 2  # only the two others' slots are elsewhere


def test_a_direct_layout_is_counted_in_the_tiers_bytes(tmp_path):
    with TieredStore(tmp_path / "s", dim=DIM, most_rows=64) as store:
        top = store.stack.top
        assert top.direct is not None
        expected = RowCache.nbytes_for(64, top.rows.shape[1], top.rows.dtype, top.backend, direct=True)
        assert top.nbytes == expected
        plain = RowCache.nbytes_for(64, top.rows.shape[1], top.rows.dtype, top.backend)
        assert expected - plain == 64 * BYTES_PER_SLOT


def test_no_layout_for_a_lone_unbounded_table_or_on_torch(tmp_path):
    with TieredStore(tmp_path / "a", dim=DIM) as store:  # unbounded: no homes to give
        assert store.stack.top.direct is None
    with TieredStore(tmp_path / "c", dim=DIM, most_rows=10, host_cache_backend="torch") as store:
        assert store.stack.top.direct is None


def test_a_growing_tier_gives_homes_as_it_grows_and_keeps_every_row(tmp_path):
    """A bounded table beside an unbounded one (a collection's group): the tier grows on demand, the
    bounded table's homes past its slots come with each growth, and nothing found changes."""
    small, large = 12, 1 << 47  # table 0's ids, and table 1's keys (number 1)
    oracle = {}
    with (
        tiers_growing_from(2),
        TieredStore(tmp_path / "s", dim=DIM, most_rows=[small, None], host_cache=64) as store,
    ):
        top = store.stack.top
        assert top.direct.sizes.tolist() == [small, 0] and top.capacity == 2
        for round_ in range(6):
            keys = torch.cat(
                [torch.arange(round_ * 2, round_ * 2 + 2), large + torch.arange(round_ * 5, round_ * 5 + 5)]
            )
            rows = torch.randn(keys.numel(), DIM)
            store.put(keys, rows)
            oracle.update(zip(keys.tolist(), rows))
            free = top._free[: top.capacity - len(top)]
            assert torch.equal(top._free_positions[free].long(), torch.arange(free.numel()))
        assert top.capacity > 2  # it grew
        keys = torch.tensor(sorted(oracle))
        assert torch.equal(store.get(keys), torch.stack([oracle[key] for key in keys.tolist()]))
        held, home = at_home(top)
        assert held == small and home > 0
        store.flush()
    with TieredStore(tmp_path / "s", dim=DIM, most_rows=[small, None], host_cache=64) as store:
        assert torch.equal(store.get(keys), torch.stack([oracle[key] for key in keys.tolist()]))


@pytest.mark.parametrize(
    "most_rows, message", [([], "empty list"), ([3, -1], "non-negative"), ([2.5], "int")]
)
def test_a_bad_list_of_table_rows_is_named_and_creates_nothing(tmp_path, most_rows, message):
    with pytest.raises((TypeError, ValueError), match=message):
        TieredStore(tmp_path / "s", dim=DIM, most_rows=most_rows)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_a_held_whole_table_trains_as_nn_embedding_bag(tmp_path, optimizer):
    torch.manual_seed(0)
    rows, batches = 300, [torch.randint(0, 300, (64,)) for _ in range(12)]
    table = TieredEmbeddingBag(
        rows,
        DIM,
        mode="sum",
        path=tmp_path / "t",
        optimizer=tierstore.optim.SGD(lr=0.1) if optimizer == "sgd" else tierstore.optim.Adagrad(lr=0.1),
    )
    assert table.store.stack.top.direct.rows == rows
    reference = torch.nn.EmbeddingBag(rows, DIM, mode="sum", sparse=True)
    with torch.no_grad():
        reference.weight.copy_(table.store.get(torch.arange(rows)))
    torch_optimizer = (
        torch.optim.SGD(reference.parameters(), lr=0.1)
        if optimizer == "sgd"
        else torch.optim.Adagrad(reference.parameters(), lr=0.1)
    )
    offsets = torch.arange(0, 64, 4)
    for ids in batches:
        gradient = torch.randn(16, DIM)
        table(ids, offsets).backward(gradient)
        torch_optimizer.zero_grad()
        reference(ids, offsets).backward(gradient)
        torch_optimizer.step()
    torch.testing.assert_close(table.store.get(torch.arange(rows)), reference.weight.detach())
    held, home = at_home(table.store.stack.top)
    assert held == home > 0


def test_a_collections_small_tables_get_homes_beside_a_cached_large_one(tmp_path):
    configs = [
        EmbeddingBagConfig(name="large", embedding_dim=DIM, num_embeddings=10_000, feature_names=["a"]),
        EmbeddingBagConfig(name="small", embedding_dim=DIM, num_embeddings=40, feature_names=["b"]),
        EmbeddingBagConfig(name="tiny", embedding_dim=DIM, num_embeddings=7, feature_names=["c"]),
    ]
    collection = TieredEmbeddingBagCollection(configs, path=tmp_path / "c", host_cache=500)
    top = collection.groups[f"dim{DIM}"].store.stack.top
    assert top.direct.sizes.tolist() == [0, 40, 7]
    torch.manual_seed(1)
    for _ in range(20):
        lengths = torch.ones(3, 32, dtype=torch.int64)
        values = torch.cat([torch.randint(0, rows, (32,)) for rows in (10_000, 40, 7)])
        batch = KeyedJaggedTensor.from_lengths_sync(["a", "b", "c"], values, lengths.reshape(-1))
        collection(batch).values().sum().backward()
    held, home = at_home(top)
    assert held == home and held > 40  # every small table's row at home, while the large one evicts
    assert top.stats.evictions > 0
