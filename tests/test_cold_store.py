"""The cold-store contract, run against both backends."""

import pytest
import torch

from tierstore.cold import LmdbColdStore, open_cold_store


def open_store(backend, path, read_only=False):
    path.mkdir(exist_ok=True)
    return open_cold_store(backend, path, 3, torch.float32, read_only)


def test_put_is_visible_at_once_and_durable_after_flush(backend, tmp_path):
    store = open_store(backend, tmp_path)
    keys, rows = torch.tensor([10, 2, 7]), torch.randn(3, 3)
    store.put(keys, rows)
    got, found = store.get(torch.tensor([7, 3, 10]))
    assert found.tolist() == [True, False, True]
    assert torch.equal(got[[0, 2]], rows[[2, 0]])
    store.flush()
    store.close()
    store = open_store(backend, tmp_path)
    got, found = store.get(keys)
    assert bool(found.all()) and torch.equal(got, rows)
    store.close()


def test_unflushed_puts_are_discarded_on_reopen(backend, tmp_path):
    store = open_store(backend, tmp_path)
    store.put(torch.tensor([1]), torch.ones(1, 3))
    store.flush()
    store.put(torch.tensor([1, 2]), torch.full((2, 3), 5.0))
    store.close()  # no flush
    store = open_store(backend, tmp_path)
    got, found = store.get(torch.tensor([1, 2]))
    assert found.tolist() == [True, False] and torch.equal(got[0], torch.ones(3))
    assert len(store) == 1
    store.close()


def test_len_contains_and_iteration_see_staged_rows(backend, tmp_path):
    store = open_store(backend, tmp_path)
    store.put(torch.arange(0, 300, 3), torch.zeros(100, 3))
    store.flush()
    store.put(torch.tensor([3, 1000]), torch.ones(2, 3))  # one update, one new key
    assert len(store) == 101
    assert store.contains(torch.tensor([1000, 4, 3])).tolist() == [True, False, True]
    seen = {}
    for keys, rows in store.iter_rows(batch_size=16):
        seen.update(zip(keys.tolist(), rows[:, 0].tolist()))
    assert len(seen) == 101 and seen[3] == 1.0 and seen[1000] == 1.0 and seen[6] == 0.0
    store.close()


def test_read_only_store_sees_last_flush_and_refuses_writes(backend, tmp_path):
    store = open_store(backend, tmp_path)
    store.put(torch.tensor([4]), torch.ones(1, 3))
    store.flush()
    store.close()
    reader = open_store(backend, tmp_path, read_only=True)
    assert reader.get(torch.tensor([4]))[1].item()
    with pytest.raises(PermissionError, match="read_only"):
        reader.put(torch.tensor([5]), torch.ones(1, 3))
    reader.close()


def test_lmdb_map_grows_instead_of_failing(tmp_path):
    store = LmdbColdStore(tmp_path, 256, torch.float32, map_size=64 * 1024)
    keys, rows = torch.arange(5000), torch.randn(5000, 256)  # ~5 MiB into a 64 KiB map
    store.put(keys, rows)
    store.flush()
    got, found = store.get(keys)
    assert bool(found.all()) and torch.equal(got, rows)
    store.close()
