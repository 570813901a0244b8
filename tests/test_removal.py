"""Removing ids (``TieredStore.remove``) from every tier and the cold store's files, against a dict;
``tierstore compact``; removals under readers, a rebuilt index and pins. Removals under SIGKILL are
in ``test_crash_safety`` (its writer removes ids every round)."""

import errno
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import initial

from tierstore import TieredStore
from tierstore.errors import ReadOnlyStoreError, StoreFormatError

DIM = 4

TIER_SETTINGS = {
    "openmp host tier": {"host_cache": 6 * 16 * 4},
    "torch host tier": {"host_cache": 6 * 16 * 4, "host_cache_backend": "torch"},
    "device and host tiers": {
        "device_cache": 3 * 16 * 4,
        "device_cache_backend": "torch",
        "host_cache": 5 * 16 * 4,
    },
}


def table_of(store: TieredStore) -> dict:
    """id -> row (a tuple) of every row ``store.iter_rows`` gives; each id once."""
    rows = {}
    for ids, values in store.iter_rows(batch_size=7):
        for id_, row in zip(ids.tolist(), values.tolist()):
            assert id_ not in rows, f"id {id_} iterated twice"
            rows[id_] = tuple(row)
    return rows


@pytest.mark.parametrize("tiers", sorted(TIER_SETTINGS))
def test_puts_gets_removals_flushes_and_reopens_against_a_dict(backend, tiers, store_path):
    rng = np.random.default_rng(7)
    store = TieredStore(store_path, dim=DIM, backend=backend, **TIER_SETTINGS[tiers])
    oracle, durable = {}, {}
    for step in range(120):
        ids = torch.from_numpy(rng.choice(40, size=int(rng.integers(1, 6)), replace=False))
        action = rng.choice(["put", "get", "remove", "flush", "reopen"], p=[0.35, 0.25, 0.25, 0.1, 0.05])
        if action == "put":
            rows = torch.from_numpy(rng.standard_normal((ids.numel(), DIM)).astype(np.float32))
            store.put(ids, rows)
            oracle.update(zip(ids.tolist(), map(tuple, rows.tolist())))
        elif action == "get":
            for id_, row in zip(ids.tolist(), store.get(ids).tolist()):
                # an id never held, or removed, starts from its initial row
                expected = oracle.setdefault(id_, tuple(initial(id_, DIM).tolist()))
                assert tuple(row) == expected, f"step {step}: id {id_}"
        elif action == "remove":
            held = sum(id_ in oracle for id_ in ids.tolist())
            assert store.remove(torch.cat([ids, ids])) == held  # repeats count once
            for id_ in ids.tolist():
                oracle.pop(id_, None)
        elif action == "flush":
            store.flush()
            durable = dict(oracle)
        else:
            store.close()  # flushes
            store = TieredStore(store_path, **TIER_SETTINGS[tiers])
            durable = dict(oracle)
        assert len(store) == len(oracle)
        assert store.contains(torch.arange(40)).tolist() == [id_ in oracle for id_ in range(40)]
    assert table_of(store) == oracle
    store.release_unflushed()
    with TieredStore(store_path, **TIER_SETTINGS[tiers]) as reopened:  # the last flush, removals included
        assert table_of(reopened) == durable
        assert reopened.structure_problems() == []


def test_a_removed_id_that_returns_starts_from_its_initial_row_and_trains_again(backend, store_path):
    with TieredStore(store_path, dim=DIM, backend=backend, host_cache=4 * 16 * 4) as store:
        store.put([3], torch.full((1, DIM), 9.0))
        store.flush()
        store.remove([3])
        assert 3 not in store
        assert torch.equal(store.get([3])[0], initial(3, DIM))
        assert 3 in store
        store.put([3], torch.full((1, DIM), 5.0))
    with TieredStore(store_path) as store:
        assert store.get([3]).tolist() == [[5.0] * DIM]


def test_a_reader_keeps_its_flush_while_the_writer_removes_ids(backend, store_path):
    """A snapshot (LMDB: a read transaction; mmap: a reader, which defers applying the log, removals
    included, until it closes) reads the rows of its flush while the writer removes ids."""
    with TieredStore(store_path, dim=DIM, backend=backend, host_cache=4 * 16 * 4) as store:
        store.load(torch.arange(20), torch.arange(80.0).view(20, DIM))
        snapshot = store.snapshot()
        store.remove(torch.arange(0, 20, 2))
        store.flush()  # mmap: committed, not applied (the snapshot reads rows.bin)
        store.put([4], torch.full((1, DIM), -1.0))
        store.flush()
        assert sorted(torch.cat([ids for ids, _ in snapshot.iter_rows()]).tolist()) == list(range(20))
        snapshot.close()
        store.remove([5])
        store.flush()  # mmap: applies the three flushes' log
        expected = {id_: (id_ * 4.0, id_ * 4.0 + 1, id_ * 4.0 + 2, id_ * 4.0 + 3) for id_ in range(1, 20, 2)}
        expected.pop(5)
        expected[4] = (-1.0,) * DIM
        assert table_of(store) == expected
    with TieredStore(store_path) as store:
        assert table_of(store) == expected
        assert store.structure_problems() == []


def test_the_index_is_rebuilt_without_removed_rows_and_a_damaged_record_of_them_is_refused(store_path):
    with TieredStore(store_path, dim=DIM, backend="mmap", host_cache=4 * 16 * 4) as store:
        store.load(torch.arange(50), torch.ones(50, DIM))
        store.remove(torch.arange(10, 30))
        store.put([12], torch.zeros(1, DIM))  # back, at a new row
    expected = {id_: (1.0,) * DIM for id_ in [*range(10), *range(30, 50)]}
    expected[12] = (0.0,) * DIM
    (store_path / "index.bin").unlink()
    with TieredStore(store_path) as store:
        assert table_of(store) == expected
        assert len(store) == len(expected)
    assert subprocess.run([sys.executable, "-m", "tierstore", "verify", str(store_path)]).returncode == 0
    removed = store_path / "removed.bin"
    removed.write_bytes(b"\x01" + removed.read_bytes()[1:])
    (store_path / "index.bin").unlink()
    with pytest.raises(StoreFormatError, match="removed.bin"):
        TieredStore(store_path)


def test_pinned_rows_are_refused_and_bad_ids_change_nothing(backend, store_path):
    with TieredStore(store_path, dim=DIM, backend=backend, host_cache=8 * 16 * 4) as store:
        store.put(torch.arange(6), torch.ones(6, DIM))
        keys, slots, _ = store.pin_rows(torch.tensor([2, 3]))
        with pytest.raises(RuntimeError, match="pinned for batches in flight"):
            store.remove([1, 2])
        with pytest.raises(ValueError):
            store.remove([1, -4])
        assert len(store) == 6 and 1 in store and 2 in store
        store.unpin_rows(keys, slots)
        assert store.remove([1, 2]) == 2
    with TieredStore(store_path, read_only=True) as reader:
        with pytest.raises(ReadOnlyStoreError, match="writable"):
            reader.remove([3])


def test_compact_gives_the_space_of_removed_ids_back(backend, tmp_path):
    path = tmp_path / "store"
    with TieredStore(path, dim=16, backend=backend, host_cache="1MiB") as store:
        store.load(torch.arange(60_000), torch.randn(60_000, 16))
        store.remove(torch.arange(0, 60_000, 2))
        kept = table_of(store)
    inspect = [sys.executable, "-m", "tierstore", "inspect", "--json", str(path)]
    on_disk = json.loads(subprocess.run(inspect, capture_output=True, text=True, check=True).stdout)
    assert on_disk["removed_rows_on_disk"] == (30_000 if backend == "mmap" else 0)  # LMDB reuses pages
    before = subprocess.run(
        [sys.executable, "-m", "tierstore", "compact", str(path)], capture_output=True, text=True, check=True
    ).stdout
    sizes = before.split("rows, ")[1].split(" bytes")[0].split(" -> ")
    sizes = [int(size.replace(",", "")) for size in sizes]
    assert sizes[1] < 0.7 * sizes[0], before
    with TieredStore(path) as store:
        assert table_of(store) == kept
        assert store.structure_problems() == []
    on_disk = json.loads(subprocess.run(inspect, capture_output=True, text=True, check=True).stdout)
    assert on_disk["removed_rows_on_disk"] == 0
    assert (
        "TieredStore.remove"
        in subprocess.run(
            [sys.executable, "-m", "tierstore", "compact", "--help"], capture_output=True, text=True
        ).stdout
    )


def test_a_removal_the_disk_refuses_changes_nothing(backend, store_path, monkeypatch):
    """A full disk while staging a removal: OSError, every tier as it was (the cached rows too)."""
    store = TieredStore(store_path, dim=DIM, backend=backend, host_cache=8 * 16 * 4)
    store.put(torch.arange(4), torch.ones(4, DIM))
    store.flush()
    store.put([1], torch.full((1, DIM), 3.0))  # dirty in the cache

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if backend == "mmap":
        monkeypatch.setattr(os, "pwrite", full_disk)
    else:
        monkeypatch.setattr(store.stack.cold, "_write", full_disk)
    with pytest.raises(OSError, match="No space left"):
        store.remove([1, 2])
    monkeypatch.undo()
    assert len(store) == 4 and store.get([1, 2]).tolist() == [[3.0] * DIM, [1.0] * DIM]
    store.close()
    with TieredStore(store_path) as reopened:
        assert reopened.get([1, 2]).tolist() == [[3.0] * DIM, [1.0] * DIM]
