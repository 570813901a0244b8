"""Small tables cost what they hold: a bounded table's cache tiers take no more slots than its rows
(a collection's group: the rows of its tables), whatever the budget, and a table that grows on
demand starts its host tier small and grows it as rows come, so tens of small tables do not each
allocate a whole default budget; a table that fits its budget is held whole."""

import textwrap

import pytest
import torch
from helpers import cgroup_problem, peak_in_cgroup
from torch import nn

from tierstore import (
    EmbeddingBagConfig,
    TieredEmbeddingBag,
    TieredEmbeddingBagCollection,
    TieredStore,
    initial_weights,
    optim,
)
from tierstore.tiers.build import INITIAL_ROWS
from tierstore.tiers.row_cache import RowCache


def test_a_bounded_tables_host_tier_holds_its_rows_and_no_more(tmp_path):
    table = TieredEmbeddingBag(100, 16, path=tmp_path / "t", mode="sum")
    host = table.store.stats()["host"]
    top = table.store.stack.top
    assert host["capacity_rows"] == 100
    direct = top.direct is not None
    expected = RowCache.nbytes_for(100, top.rows.shape[1], torch.float32, top.backend, direct=direct)
    assert host["memory_bytes"] == top.nbytes == expected
    assert host["memory_bytes"] < 64 << 10  # the default budget is 256 MiB
    table.close()
    small = TieredEmbeddingBag(100, 16, path=tmp_path / "u", host_cache=10)  # a smaller budget stands
    assert small.store.stats()["host"]["capacity_rows"] == 10
    small.close()


def test_a_table_held_whole_runs_no_shadow_caches_and_one_that_is_not_does():
    """Held whole, nothing is evicted, so no ageing is chosen (no shadow caches, one native call a
    batch fewer); a table larger than its budget keeps the adaptive ageing."""
    whole, cached = TieredEmbeddingBag(20_000, 8), TieredEmbeddingBag(20_000, 8, host_cache=10_000)
    assert whole.store.stack.top.policy.tuner is None and cached.store.stack.top.policy.tuner is not None
    for table in (whole, cached):
        table.close()


def test_a_small_table_held_whole_trains_like_nn_embedding_bag_and_never_evicts(tmp_path):
    torch.manual_seed(0)
    weight = torch.randn(30, 4)
    reference = nn.EmbeddingBag.from_pretrained(weight.clone(), freeze=False, mode="sum")
    table = TieredEmbeddingBag.from_pretrained(weight.clone(), freeze=False, mode="sum", path=tmp_path / "t")
    optimizer = torch.optim.SGD(reference.parameters(), lr=table.optimizer.lr)
    for step in range(5):
        ids = torch.randint(0, 30, (8, 3), generator=torch.Generator().manual_seed(step))
        grad = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 + step))
        optimizer.zero_grad()
        reference(ids).backward(grad)
        optimizer.step()
        table(ids).backward(grad)
    assert table.store.stats()["host"]["capacity_rows"] == 30
    assert table.store.stats()["host"]["evictions"] == 0
    torch.testing.assert_close(table.store.get(torch.arange(30)), reference.weight.detach())
    table.close()


def test_a_collections_group_holds_its_tables_rows_and_a_growable_table_its_budget(tmp_path):
    bounded = [
        EmbeddingBagConfig(3, 8, name="tiny", feature_names=["a"]),
        EmbeddingBagConfig(24, 8, name="small", feature_names=["b"]),
        EmbeddingBagConfig(1000, 4, name="other_dim", feature_names=["c"]),
    ]
    collection = TieredEmbeddingBagCollection(bounded, path=tmp_path / "c")
    capacities = {
        name: group.store.stats()["host"]["capacity_rows"] for name, group in collection.groups.items()
    }
    assert capacities == {"dim8": 27, "dim4": 1000}
    collection.close()
    growable = [*bounded[:2], EmbeddingBagConfig(None, 8, name="grows", feature_names=["d"])]
    collection = TieredEmbeddingBagCollection(growable, path=tmp_path / "g", host_cache=5000)
    host = collection.groups["dim8"].store.stats()["host"]
    assert (host["capacity_rows"], host["budget_rows"]) == (INITIAL_ROWS, 5000)  # grows as rows come
    collection.close()


def test_a_growable_tables_host_tier_grows_as_rows_come_and_evicts_only_once_full(tmp_path):
    """Its slots double as new ids arrive, then take the whole budget once past a quarter of it
    (a growth's copy holds at most 1.25 budgets); rows keep their values through every growth (a
    dict is the oracle), and nothing is evicted before the budget is full."""
    budget = 16 * INITIAL_ROWS + 100
    store = TieredStore(tmp_path / "s", dim=4, host_cache=budget)
    oracle = {}
    capacities = []
    for start in range(0, budget + 3000, 3000):
        ids = torch.arange(start, start + 3000)
        rows = ids.to(torch.float32)[:, None].repeat(1, 4) + 0.5
        store.put(ids, rows)
        oracle.update(zip(ids.tolist(), rows))
        host = store.stats()["host"]
        capacities.append(host["capacity_rows"])
        assert host["evictions"] == 0 or host["capacity_rows"] == budget  # evicts only when full
        if start + 3000 <= budget:
            assert host["evictions"] == 0 and host["resident_rows"] == start + 3000
    assert sorted(set(capacities)) == [INITIAL_ROWS, 2 * INITIAL_ROWS, 4 * INITIAL_ROWS, budget]
    keys = torch.tensor(sorted(oracle))
    assert torch.equal(store.get(keys), torch.stack([oracle[key] for key in keys.tolist()]))
    store.close()


@pytest.mark.parametrize("optimizer", [optim.SGD(lr=0.5), optim.Adagrad(lr=0.5)])
def test_a_growable_table_trains_through_its_growth_as_nn_embedding_bag(optimizer):
    """Batches of new ids make the host tier grow under training; the rows match torch's."""
    rows = 3 * INITIAL_ROWS
    table = TieredEmbeddingBag(None, 4, mode="sum", optimizer=optimizer)
    reference = nn.EmbeddingBag.from_pretrained(
        initial_weights(torch.arange(rows), 4, 0, torch.float32), freeze=False, mode="sum"
    )
    make = torch.optim.SGD if isinstance(optimizer, optim.SGD) else torch.optim.Adagrad
    reference_optimizer = make(reference.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(3)
    for step in range(6):
        ids = torch.randint(0, (step + 1) * rows // 6, (512, 3), generator=generator)
        grad = torch.randn(512, 4, generator=generator)
        reference_optimizer.zero_grad()
        reference(ids).backward(grad)
        reference_optimizer.step()
        table(ids).backward(grad)
    assert table.store.stats()["host"]["capacity_rows"] > INITIAL_ROWS
    seen = torch.tensor(
        sorted(set(table.store.stack.top.slot_keys[table.store.stack.top.slot_keys >= 0].tolist()))
    )
    torch.testing.assert_close(table.store.get(seen), reference.weight.detach()[seen], rtol=1e-5, atol=1e-6)
    table.close()


@pytest.mark.parametrize(
    "most_rows, error, message",
    [
        (1.5, TypeError, "most_rows must be an int"),
        (-1, ValueError, "non-negative"),
        ("9", TypeError, "most_rows"),
    ],
)
def test_a_bad_most_rows_is_named_and_creates_nothing(tmp_path, most_rows, error, message):
    with pytest.raises(error, match=message):
        TieredStore(tmp_path / "s", dim=4, most_rows=most_rows)
    assert not (tmp_path / "s").exists()


def test_a_stores_caches_follow_most_rows_and_it_still_holds_more_ids_in_parts(tmp_path):
    with TieredStore(tmp_path / "s", dim=4, most_rows=50) as store:
        assert store.stack.top.capacity == 50
        ids = torch.arange(500)
        rows = torch.arange(2000, dtype=torch.float32).reshape(500, 4)
        store.put(ids, rows)  # more ids than its slots: through the tier in parts
        assert torch.equal(store.get(ids), rows)


MANY_SMALL_TABLES = """
import sys, tempfile, torch
from tierstore import TieredEmbeddingBag
count, rows = int(sys.argv[1]), None if sys.argv[3] == "None" else int(sys.argv[3])
with tempfile.TemporaryDirectory(dir=sys.argv[2]) as directory:
    tables = [TieredEmbeddingBag(rows, 16, path=f"{directory}/t{i}") for i in range(count)]
    for table in tables:
        table(torch.arange(100).reshape(10, 10)).sum().backward()
    for table in tables:
        table.close()
print("ok")
"""


@pytest.mark.skipif(cgroup_problem() is not None, reason=str(cgroup_problem()))
@pytest.mark.parametrize("rows", ["100", "None"])
def test_thirty_two_small_tables_fit_in_64_MiB_beside_one(tmp_path, rows):
    """32 tables of 100 rows used (bounded at 100, or growing on demand; default budgets) run in a
    cgroup whose limit, page cache included, is what one such table takes plus 64 MiB (each
    allocating its whole default budget took 3 GiB)."""
    script = textwrap.dedent(MANY_SMALL_TABLES)
    baseline = peak_in_cgroup(tmp_path, script, 1 << 40, "1", str(tmp_path), rows)
    limit = baseline + (64 << 20)
    assert peak_in_cgroup(tmp_path, script, limit, "32", str(tmp_path), rows) <= limit
