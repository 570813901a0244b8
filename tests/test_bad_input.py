"""Bad input at the boundary: a clear exception, and the store is unchanged afterwards."""

import json

import numpy as np
import pytest
import torch

from tierstore import ReadOnlyStoreError, StoreFormatError, StoreMismatchError, TieredStore, optim
from tierstore.metadata import METADATA_FILE


@pytest.fixture
def store(store_path, backend):
    store = TieredStore(store_path, dim=4, backend=backend, host_cache=4, device_cache=2)
    store.put([1, 2], torch.ones(2, 4))
    store.flush()
    yield store
    if not store._closed:
        store.close()


def unchanged(store):
    assert len(store) == 2
    assert torch.equal(store.get([1, 2]), torch.ones(2, 4))


@pytest.mark.parametrize(
    "ids, error, message",
    [
        ([1, -3], ValueError, "non-negative.*-3"),
        (torch.tensor([1.0, 2.0]), TypeError, "integer dtype"),
        (np.array([0.5]), TypeError, "integer dtype"),
        (torch.tensor([True]), TypeError, "integer dtype"),
        (torch.tensor([[1, 2]]), ValueError, "1-D"),
        ("12", TypeError, "integer"),
        (np.array([2**63], dtype=np.uint64), ValueError, "int64"),
    ],
)
def test_bad_ids(store, ids, error, message):
    with pytest.raises(error, match=message):
        store.get(ids)
    with pytest.raises(error, match=message):
        store.put(ids, torch.zeros(len(ids) if hasattr(ids, "__len__") else 1, 4))
    unchanged(store)


@pytest.mark.parametrize(
    "out, error, message",
    [
        (torch.zeros(3, 4), ValueError, r"\[2, 4\] torch.float32 tensor on cpu"),
        (torch.zeros(2, 4, dtype=torch.float64), ValueError, "torch.float32"),
        (np.zeros((2, 4), dtype=np.float32), TypeError, "torch.Tensor"),
        (torch.zeros(4, 2).t(), ValueError, "contiguous"),
    ],
)
def test_bad_out_on_get(store, out, error, message):
    with pytest.raises(error, match=message):
        store.get([1, 2], out=out)
    unchanged(store)


@pytest.mark.parametrize(
    "rows, error, message",
    [
        (torch.zeros(2, 5), ValueError, r"shape \[2, 4\]"),
        (torch.zeros(3, 4), ValueError, r"shape \[2, 4\]"),
        (torch.zeros(2, 4, dtype=torch.float64), TypeError, "dtype torch.float32"),
        ([[0.0] * 4] * 2, TypeError, "torch.Tensor"),
    ],
)
def test_bad_rows_on_put(store, rows, error, message):
    with pytest.raises(error, match=message):
        store.put([1, 2], rows)
    unchanged(store)


def test_reopen_with_wrong_settings(store, store_path):
    store.close()
    with pytest.raises(StoreMismatchError, match="dim=8 .*has 4"):
        TieredStore(store_path, dim=8)
    with pytest.raises(StoreMismatchError, match="dtype='float16'"):
        TieredStore(store_path, dtype=torch.float16)
    with TieredStore(store_path) as reopened:
        unchanged(reopened)


def test_unknown_format_version(store, store_path):
    store.close()
    metadata_path = store_path / METADATA_FILE
    document = json.loads(metadata_path.read_text())
    metadata_path.write_text(json.dumps({**document, "format_version": 99}))
    with pytest.raises(StoreFormatError, match="version 99.*upgrade"):
        TieredStore(store_path)
    metadata_path.write_text(json.dumps(document))
    with TieredStore(store_path) as reopened:
        unchanged(reopened)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "missing_field"])
def test_damaged_metadata(store, store_path, damage):
    store.close()
    metadata_path = store_path / METADATA_FILE
    original = metadata_path.read_bytes()
    if damage == "truncate":
        metadata_path.write_bytes(original[: len(original) // 2])
    elif damage == "garbage":
        metadata_path.write_bytes(b"\x00\xff" * 10)
    else:
        metadata_path.write_text(json.dumps({k: v for k, v in json.loads(original).items() if k != "dim"}))
    with pytest.raises(StoreFormatError, match="damaged"):
        TieredStore(store_path)
    metadata_path.write_bytes(original)
    with TieredStore(store_path) as reopened:
        unchanged(reopened)


def test_truncated_mmap_row_file(store_path):
    with TieredStore(store_path, dim=4, backend="mmap") as store:
        store.put(list(range(2000)), torch.ones(2000, 4))
    rows_file = store_path / "rows.bin"
    original = rows_file.read_bytes()
    rows_file.write_bytes(original[:1000])
    with pytest.raises(StoreFormatError, match="truncated"):
        TieredStore(store_path)
    rows_file.write_bytes(original)
    with TieredStore(store_path) as store:
        assert len(store) == 2000


def test_damaged_lmdb_data_file(store_path):
    with TieredStore(store_path, dim=4, backend="lmdb") as store:
        store.put([1], torch.ones(1, 4))
    data_file = store_path / "lmdb" / "data.mdb"
    data_file.write_bytes(b"this is not an lmdb file" * 500)
    with pytest.raises(StoreFormatError, match="LMDB"):
        TieredStore(store_path)


def test_read_only_store_refuses_writes_and_stays_unchanged(store, store_path):
    store.close()
    reader = TieredStore(store_path, read_only=True)
    with pytest.raises(ReadOnlyStoreError, match="read_only=True"):
        reader.put([1], torch.zeros(1, 4))
    with pytest.raises(ReadOnlyStoreError):
        reader.flush()
    with pytest.raises(ReadOnlyStoreError, match="read_only=True"):
        reader.apply_gradients(torch.tensor([1]), torch.ones(1, 4), optim.SGD(), 1)
    reader.get([50])  # an unseen id is readable but does not join the table
    assert 50 not in reader
    unchanged(reader)
    reader.close()
    with TieredStore(store_path) as reopened:
        unchanged(reopened)


def test_not_a_store_directory(tmp_path):
    (tmp_path / "something.txt").write_text("hello")
    with pytest.raises(StoreFormatError, match="not a tierstore store"):
        TieredStore(tmp_path, dim=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["something.txt"]


def test_new_store_needs_dim(store_path):
    with pytest.raises(ValueError, match="dim is required"):
        TieredStore(store_path)
    assert not store_path.exists()
