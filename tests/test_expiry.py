"""Expiring ids (``ttl``, ``max_rows``; ``tierstore.expiry``): training through expiry against an
oracle that forgets the same ids, the batch in flight and pinned rows spared, the oldest ids going
first past ``max_rows``, ttl as time, and the settings refused where they make no sense."""

import types
from datetime import timedelta

import numpy as np
import pytest
import torch
from helpers import initial

from tierstore import (
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    TieredEmbeddingBag,
    TieredEmbeddingBagCollection,
    TieredStore,
    expiry,
)
from tierstore.optim import SGD

DIM, LR = 4, 0.5


def table_of(store: TieredStore) -> dict:
    """id -> row tensor of every row the store holds."""
    return {id_: row for ids, rows in store.iter_rows() for id_, row in zip(ids.tolist(), rows)}


@pytest.fixture
def clock(monkeypatch):
    """The time expiry reads (seconds), set by the test."""
    now = [1_000_000.0]
    monkeypatch.setattr(expiry, "time", types.SimpleNamespace(time=lambda: now[0]))
    return now


def test_training_with_a_ttl_in_steps_matches_an_oracle_that_forgets_the_same_ids(backend, tmp_path):
    """SGD through a 6-row host cache, a flush every step (a reopen halfway): ids not updated for
    ``ttl`` steps go, and one that returns starts from its initial row, as the oracle's do."""
    ttl, rng = 3, np.random.default_rng(3)
    settings = dict(mode="sum", path=tmp_path / "table", backend=backend, optimizer=SGD(lr=LR))
    table = TieredEmbeddingBag(None, DIM, ttl=ttl, host_cache=6 * 16 * 4, **settings)
    rows, recorded = {}, {}  # the oracle: id -> row, id -> the step of its last flushed update
    for step in range(1, 25):
        ids = torch.from_numpy(rng.choice(12, size=5))
        offsets = torch.tensor([0, 2])
        for id_ in ids.tolist():
            rows.setdefault(id_, initial(id_, DIM).clone())
        expected = torch.stack([sum(rows[i] for i in bag.tolist()) for bag in (ids[:2], ids[2:])])
        output = table(ids, offsets)
        assert torch.allclose(output, expected, atol=1e-6), f"step {step}"
        output.sum().backward()
        for id_, count in zip(*np.unique(ids.numpy(), return_counts=True)):
            rows[int(id_)] = rows[int(id_)] - LR * float(count)
            recorded[int(id_)] = step
        table.flush()
        for id_ in [id_ for id_, last in recorded.items() if last <= step - ttl]:
            del rows[id_], recorded[id_]
        held = table_of(table.store)
        assert sorted(held) == sorted(rows), f"step {step}"
        assert all(torch.allclose(held[id_], rows[id_], atol=1e-6) for id_ in rows)
        if step == 12:  # the store's step count and records survive a reopen
            table.close()
            table = TieredEmbeddingBag(None, DIM, ttl=ttl, host_cache=6 * 16 * 4, **settings)
    assert table.store.stats()["cold"]["rows_removed"] > 0
    table.close()


def test_the_batch_in_flight_is_never_expired(store_path):
    """A flush between a forward and its backward spares the forward's ids, however old."""
    table = TieredEmbeddingBag(None, DIM, mode="sum", path=store_path, optimizer=SGD(lr=LR), ttl=1)
    first, other = torch.tensor([5, 6]), torch.tensor([7])
    table(first, torch.tensor([0])).sum().backward()  # step 1
    table.flush()
    table(other, torch.tensor([0])).sum().backward()  # step 2: 5 and 6 are now one step old
    output = table(first, torch.tensor([0]))  # in flight
    table.flush()  # would expire 5 and 6
    assert 5 in table.store and 6 in table.store
    output.sum().backward()
    table.flush()
    for id_ in (5, 6):  # trained twice from their initial rows, never reset
        assert torch.allclose(table.store.get([id_])[0], initial(id_, DIM) - 2 * LR, atol=1e-6)
    assert 7 not in table.store  # last updated at step 2, two steps ago
    table.close()


def test_pinned_rows_are_spared_until_unpinned(backend, store_path, clock):
    with TieredStore(store_path, dim=DIM, backend=backend, ttl=timedelta(seconds=10)) as store:
        store.put(torch.arange(6), torch.ones(6, DIM))
        store.flush()
        keys, slots, _ = store.pin_rows(torch.tensor([1, 2]))
        clock[0] += 60
        store.flush()
        assert sorted(table_of(store)) == [1, 2]
        store.unpin_rows(keys, slots)
        store.flush()
        assert len(store) == 0


def test_past_max_rows_the_oldest_go_and_ties_take_the_smallest_ids(backend, store_path, clock):
    with TieredStore(store_path, dim=DIM, backend=backend, max_rows=5) as store:
        store.put(torch.arange(4), torch.ones(4, DIM))
        store.flush()
        clock[0] += 1
        store.put(torch.arange(10, 14), torch.ones(4, DIM))
        store.flush()
        assert sorted(table_of(store)) == [3, 10, 11, 12, 13]
        clock[0] += 1
        store.put([3], torch.zeros(1, DIM))  # newest now
        store.put(torch.arange(20, 24), torch.ones(4, DIM))
        store.flush()
        assert sorted(table_of(store)) == [3, 20, 21, 22, 23]
    with TieredStore(store_path) as store:  # durable; opened without expiry, its records dropped
        assert sorted(table_of(store)) == [3, 20, 21, 22, 23]
    assert not (store_path / expiry.EXPIRY_DIRECTORY).exists()


def test_a_ttl_in_time_and_ids_not_yet_recorded(backend, store_path, clock):
    with TieredStore(store_path, dim=DIM, backend=backend) as store:  # no expiry: nothing recorded
        store.put(torch.arange(3), torch.ones(3, DIM))
    with TieredStore(store_path, ttl=timedelta(hours=1)) as store:
        store.flush()  # records 0..2 as of now: none goes
        assert len(store) == 3
        clock[0] += 1800
        store.put(torch.arange(10, 12), torch.ones(2, DIM))
        store.flush()
        clock[0] += 1800
        store.flush()  # 0..2 an hour old
        assert sorted(table_of(store)) == [10, 11]
        clock[0] += 1800
        store.flush()
        assert len(store) == 0


def test_the_collection_expires_ids_in_each_store():
    tables = [
        EmbeddingBagConfig(name="a", embedding_dim=DIM, num_embeddings=None, feature_names=["f"]),
        EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=None, feature_names=["g"]),
    ]
    collection = TieredEmbeddingBagCollection(tables, optimizer=SGD(lr=LR), ttl=1)
    assert {group.store.expiry.ttl for group in collection.groups.values()} == {1}

    def batch(f_ids, g_ids):
        values = torch.tensor(f_ids + g_ids)
        lengths = torch.tensor([len(f_ids), len(g_ids)])
        return KeyedJaggedTensor(keys=["f", "g"], values=values, lengths=lengths)

    collection(batch([1], [2])).values().sum().backward()
    collection.flush()
    collection(batch([3], [4])).values().sum().backward()
    collection.flush()
    assert [len(group.store) for group in collection.groups.values()] == [1, 1]
    collection.close()


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"ttl": 0}, "ttl must be"),
        ({"ttl": -3}, "ttl must be"),
        ({"ttl": "7d"}, "ttl must be"),
        ({"ttl": True}, "ttl must be"),
        ({"ttl": timedelta(0)}, "ttl must be"),
        ({"max_rows": 0}, "max_rows must be"),
        ({"max_rows": 2.5}, "max_rows must be"),
    ],
)
def test_bad_expiry_settings_are_refused_before_anything_is_made(store_path, settings, message):
    with pytest.raises(ValueError, match=message):
        TieredStore(store_path, dim=DIM, **settings)
    assert not store_path.exists()


def test_a_reader_cannot_expire(store_path):
    TieredStore(store_path, dim=DIM).close()
    with pytest.raises(ValueError, match="writable"):
        TieredStore(store_path, read_only=True, ttl=5)


def test_ids_removed_by_hand_are_not_counted_against_max_rows(backend, store_path, clock):
    with TieredStore(store_path, dim=DIM, backend=backend, max_rows=4) as store:
        store.put(torch.arange(4), torch.ones(4, DIM))
        store.flush()
        clock[0] += 1
        store.remove([0])
        store.put([10, 11], torch.ones(2, DIM))
        store.flush()  # five ids: the oldest held one goes (0's record went with it)
        assert sorted(table_of(store)) == [2, 3, 10, 11]
