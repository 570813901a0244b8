"""Issue 13: bad settings and bad rows are refused before anything changes, and one writer at a
time holds a store, on every backend."""

import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from tierstore import StoreBusyError, TieredEmbeddingBag, TieredStore

# -- one writer at a time ---------------------------------------------------------------------------

HOLD_OPEN = textwrap.dedent(
    """
    import sys, time, torch
    from tierstore import TieredStore
    store = TieredStore(sys.argv[1], host_cache=64)
    print("open", flush=True)
    time.sleep(600)
    """
)


def test_a_second_writer_is_refused_and_the_first_keeps_its_unflushed_rows(store_path, backend):
    first = TieredStore(store_path, dim=4, backend=backend, host_cache=1000)
    first.put(torch.arange(500), torch.ones(500, 4))  # not flushed
    with pytest.raises(StoreBusyError, match="already open for writing.*read_only=True"):
        TieredStore(store_path, host_cache=64)
    second = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from tierstore import TieredStore; TieredStore(sys.argv[1])",
            store_path,
        ],
        capture_output=True,
        text=True,
    )
    assert second.returncode == 1 and "StoreBusyError" in second.stderr  # an exception, not a signal
    read = (
        "import sys; from tierstore import TieredStore; print(len(TieredStore(sys.argv[1], read_only=True)))"
    )
    reader = subprocess.run([sys.executable, "-c", read, store_path], capture_output=True, text=True)
    assert reader.stdout.strip() == "0", reader.stderr  # readers stay allowed, and see the last flush
    first.close()  # flushes
    with TieredStore(store_path, host_cache=1000) as reopened:
        assert len(reopened) == 500 and torch.equal(reopened.get(torch.arange(500)), torch.ones(500, 4))


def test_the_writer_lock_dies_with_its_process(store_path, backend):
    TieredStore(store_path, dim=4, backend=backend, host_cache=8).close()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_OPEN, str(store_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(StoreBusyError):
            TieredStore(store_path, host_cache=8)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with TieredStore(store_path, host_cache=8) as store:  # the kill released it
        store.put([1], torch.ones(1, 4))


# -- nothing is created by a constructor that fails -------------------------------------------------


@pytest.mark.parametrize(
    "settings, error, message",
    [
        ({"host_cache": "12 parsecs"}, ValueError, "host_cache: budget '12 parsecs'"),
        ({"device_cache": -3}, ValueError, "device_cache must be a non-negative row count"),
        ({"host_cache": 0}, ValueError, "at least one cache tier is needed"),
        ({"host_cache": "0MiB", "device_cache": None}, ValueError, "at least one cache tier is needed"),
        ({"device": "banana"}, ValueError, "device must be a torch.device or a string"),
        ({"device": "meta"}, ValueError, "the CPU or a CUDA device"),
        ({"half_life": -1.0}, ValueError, "half_life must be a positive number"),
        ({"half_life": float("nan")}, ValueError, "half_life"),
        ({"seed": 2**70}, ValueError, r"seed must be in \[0, 2\*\*63\)"),
        ({"seed": -1}, ValueError, "seed must be in"),
        ({"host_cache_backend": "gpu"}, ValueError, "host_cache_backend must be"),
        ({"policy": "lru"}, TypeError, "policy must be a subclass"),
    ],
)
def test_a_constructor_that_refuses_an_argument_creates_nothing(tmp_path, backend, settings, error, message):
    path = tmp_path / "store"
    with pytest.raises(error, match=message):
        TieredStore(path, dim=4, backend=backend, **{"host_cache": 16, **settings})
    assert not path.exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(error, match=message):
        TieredStore(tmp_path / "empty", dim=4, backend=backend, **{"host_cache": 16, **settings})
    assert list((tmp_path / "empty").iterdir()) == []
    with TieredStore(path, dim=4, backend=backend, host_cache=16, seed=7) as store:  # corrected: opens
        store.put([1], torch.ones(1, 4))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_cuda_device_without_a_gpu_is_refused_before_anything_is_created(tmp_path):
    for make in (
        lambda: TieredStore(tmp_path / "s", dim=4, device="cuda", host_cache=8),
        lambda: TieredEmbeddingBag(None, 4, path=tmp_path / "s", device="cuda", host_cache=8),
    ):
        with pytest.raises(ValueError, match="device='cuda' cannot run here .torch sees no CUDA device"):
            make()
        assert not (tmp_path / "s").exists()


def test_a_temporary_store_that_fails_to_open_leaves_no_directory(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ValueError):
        TieredStore(dim=4, host_cache="lots")
    assert list(tmp_path.iterdir()) == []


# -- rows: checked before anything changes ----------------------------------------------------------


@pytest.mark.parametrize(
    "rows, message",
    [
        (torch.full((2, 4), float("nan")), "NaN or Inf .first in row 0.*allow_nonfinite=True"),
        (torch.tensor([[1.0, 2, 3, 4], [0, float("inf"), 0, 0]]), "NaN or Inf .first in row 1"),
        (torch.ones(2, 4, device="meta"), "on the CPU or a CUDA device"),
    ],
)
def test_bad_rows_are_refused_and_no_id_is_added(store_path, backend, rows, message):
    with TieredStore(store_path, dim=4, backend=backend, host_cache=8) as store:
        store.put([1], torch.ones(1, 4))
        with pytest.raises(ValueError, match=message):
            store.put([5, 6], rows)
        assert len(store) == 1 and not bool(store.contains([5, 6]).any())


def test_non_finite_rows_are_stored_when_asked_for(store_path):
    with TieredStore(store_path, dim=2, host_cache=8) as store:
        store.put([3], torch.tensor([[float("nan"), float("inf")]]), allow_nonfinite=True)
        row = store.get([3])[0]
        assert row[0].isnan() and row[1] == float("inf")


@pytest.mark.parametrize(
    "ids, error, message",
    [
        (2**63, ValueError, r"int64 ids in \[0, 2\*\*63\); got 9223372036854775808"),
        ([2**63 + 5], ValueError, r"int64 ids in \[0, 2\*\*63\)"),
        (np.array([2**63 + 5], dtype=np.uint64), ValueError, "got 9223372036854775813"),
        (torch.tensor([2**63 + 5], dtype=torch.uint64), ValueError, "got 9223372036854775813"),
        (np.array([1, "a"], dtype=object), TypeError, "integer dtype .* numpy object array"),
    ],
)
def test_ids_out_of_range_or_of_the_wrong_kind_are_named(store_path, ids, error, message):
    with TieredStore(store_path, dim=2, host_cache=8) as store:
        with pytest.raises(error, match=message):
            store.get(ids)
        assert len(store) == 0


def test_numpy_integer_ids_are_accepted(store_path):
    with TieredStore(store_path, dim=2, host_cache=8) as store:
        assert store.get(np.int64(5)).shape == (1, 2) and 5 in store


# -- readers beside a writer ------------------------------------------------------------------------

WRITER = textwrap.dedent(
    """
    import sys, torch
    from tierstore import TieredStore
    store = TieredStore(sys.argv[1], dim=16, backend=sys.argv[2], host_cache=500)
    for round_ in range(1, 41):  # each flush applies a log of 2,000 rows to the row file
        for part in torch.arange(2000).split(400):
            store.put(part, torch.full((part.numel(), 16), float(round_)))
        store.flush()
    store.close()
    """
)

READER = textwrap.dedent(
    """
    import sys, torch
    from tierstore import TieredStore
    opened = 0
    while opened < 40:
        with TieredStore(sys.argv[1], read_only=True, host_cache=2000) as store:
            rows = store.get(torch.arange(2000))
            assert bool((rows == rows[:, :1]).all()), "a torn row"
            opened += 1
    print("read", opened)
    """
)


@pytest.mark.parametrize("backend", ["mmap", "lmdb"])
def test_readers_opening_while_a_writer_flushes_never_crash(store_path, backend):
    with TieredStore(store_path, dim=16, backend=backend, host_cache=2000) as store:
        store.put(torch.arange(2000), torch.zeros(2000, 16))
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(store_path), backend], stderr=subprocess.PIPE
    )
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", READER, str(store_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    assert writer.wait() == 0, writer.stderr.read()
    for reader in readers:
        out, err = reader.communicate()
        assert reader.returncode == 0, err  # SIGBUS would be -7
        assert out.strip() == b"read 40"


FLUSH_TWICE = textwrap.dedent(
    """
    import sys, torch
    from tierstore import TieredStore
    with TieredStore(sys.argv[1], host_cache=64) as store:
        for value in (1.0, 2.0):  # two flushes, each rewriting every row
            for part in torch.arange(2000).split(50):
                store.put(part, torch.full((part.numel(), 16), value))
            store.flush()
        print(store.stats()["cold"].get("deferred_applies", 0))
    """
)


@pytest.mark.parametrize("backend", ["mmap", "lmdb"])
def test_a_reader_sees_one_flush_until_it_refreshes(store_path, backend):
    with TieredStore(store_path, dim=16, backend=backend, host_cache=2000) as store:
        store.put(torch.arange(2000), torch.zeros(2000, 16))
    ids = torch.arange(2000)

    def read_all(reader):  # in parts through a 64-row cache: most rows come from the cold store
        return torch.cat([reader.get(part) for part in ids.split(50)])

    reader = TieredStore(store_path, read_only=True, host_cache=64)
    assert bool((read_all(reader) == 0).all())
    writer = subprocess.run(
        [sys.executable, "-c", FLUSH_TWICE, str(store_path)], capture_output=True, text=True
    )
    assert writer.returncode == 0, writer.stderr
    if backend == "mmap":
        assert int(writer.stdout) == 2  # the log stayed unapplied while the reader was open
    assert bool((read_all(reader) == 0).all()) and len(reader) == 2000  # still the snapshot
    reader.refresh()
    assert bool((read_all(reader) == 2).all())
    reader.close()
    with TieredStore(store_path, host_cache=64) as writer:  # no reader now: the log is applied
        assert bool((read_all(writer) == 2).all())
    assert not (store_path / "wal.commit.json").exists()
    with TieredStore(store_path, read_only=True, host_cache=64) as reader:
        assert bool((read_all(reader) == 2).all())
