"""The cold-store contract, run against both backends (mmap with both kinds of key index)."""

import errno
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from host_kernels import parallel_host_kernels

from tierstore import TieredStore
from tierstore.tiers import huge_pages
from tierstore.tiers.cold import LmdbColdStore, lmdb_staging, lmdb_store, open_cold_store
from tierstore.tiers.kernel_hash_table import KernelHashTable


@pytest.fixture(params=["lmdb", "mmap", "mmap-kernel-index"])
def backend(request):
    """The cold store to test; "mmap" indexes its keys with torch ``HashIndex``es,
    "mmap-kernel-index" with ``KernelHashTable``s on the kernels' OpenMP host build."""
    return request.param


def open_store(backend, path, read_only=False):
    path.mkdir(exist_ok=True)
    if backend == "mmap-kernel-index":
        return open_cold_store(
            "mmap", path, 3, torch.float32, read_only, index_kernels=parallel_host_kernels()
        )
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


def test_lmdb_parallel_read_returns_the_rows_in_the_callers_order(tmp_path):
    """A disk-bound read splits the sorted keys over threads, one transaction each; committed
    and staged rows (staged win) must come back exactly as one thread reads them."""
    generator = torch.Generator().manual_seed(0)
    keys = torch.randperm(100_000, generator=generator)[:6000]
    rows = torch.randn(6000, 3, generator=generator)
    newest = {}
    store = LmdbColdStore(tmp_path, 3, torch.float32)
    store.put(keys[:4000], rows[:4000])
    store.flush()
    store.put(keys[3000:], rows[3000:] + 1)  # staged, newer for 1000 committed keys
    newest.update(zip(keys[:4000].tolist(), rows[:4000]))
    newest.update(zip(keys[3000:].tolist(), rows[3000:] + 1))
    request = torch.cat([keys[torch.randperm(6000, generator=generator)], torch.tensor([100_001])])
    expected = torch.stack([newest[key] for key in request[:-1].tolist()])

    got, found = store.get(request)
    assert store.parallel_reads >= 1  # the first large read assumes the disk
    assert found.tolist() == [True] * 6000 + [False]
    assert torch.equal(got[:-1], expected)
    for _ in range(3):  # reads that prove fast (page cache) go back to one thread
        assert torch.equal(store.get(request)[0][:-1], expected)
    store.close()
    serial = LmdbColdStore(tmp_path, 3, torch.float32, read_threads=1)
    got, found = serial.get(request)
    assert serial.parallel_reads == 0 and int(found.sum()) == 4000  # staged rows were never flushed
    serial.close()


def test_full_disk_fails_a_put_with_oserror_and_the_store_keeps_its_last_flush(tiny_filesystem):
    """Staged rows are written with pwrite, so a full disk is an ENOSPC error, not a SIGBUS."""
    store = open_cold_store(
        "mmap", tiny_filesystem, 64, torch.float32, False, index_kernels=parallel_host_kernels()
    )
    store.put(torch.arange(100), torch.ones(100, 64))
    store.flush()
    with pytest.raises(OSError, match="No space left"):
        for part in range(1, 100):  # 256 KiB a put: the disk fills within a few
            store.put(torch.arange(part * 1000, (part + 1) * 1000), torch.full((1000, 64), float(part)))
    store.close()
    store = open_cold_store("mmap", tiny_filesystem, 64, torch.float32, False)
    rows, found = store.get(torch.arange(100))
    assert len(store) == 100 and bool(found.all()) and bool((rows == 1).all())
    store.close()


@pytest.mark.parametrize("backend", ["mmap", "mmap-kernel-index"])
def test_a_failed_log_write_loses_nothing_flushed(backend, tmp_path, monkeypatch):
    """Any failing write (a full disk, an I/O error) in ``put``: the error reaches the caller, and
    the reopened store holds the last flush."""
    store = open_store(backend, tmp_path)
    store.put(torch.tensor([1, 2]), torch.ones(2, 3))
    store.flush()

    def full_disk(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full_disk)
    with pytest.raises(OSError, match="No space left"):
        store.put(torch.tensor([2, 3]), torch.full((2, 3), 7.0))
    monkeypatch.undo()
    store.close()
    store = open_store(backend, tmp_path)
    rows, found = store.get(torch.tensor([1, 2, 3]))
    assert found.tolist() == [True, True, False] and bool((rows[:2] == 1).all())
    store.close()


FULL_DISK_FLUSH = textwrap.dedent(
    """
    import errno, os, sys, torch
    from tierstore import TieredStore
    directory = sys.argv[1]
    store = TieredStore(directory + "/store", dim=64, backend="mmap", host_cache=4096)
    store.put(torch.arange(100), torch.ones(100, 64))
    store.flush()
    with open(directory + "/filler", "wb") as filler:  # fill the disk, all but 500 KiB
        try:
            while True:
                filler.write(b"x" * 65536)
                filler.flush()
        except OSError:
            pass
    os.truncate(directory + "/filler", os.path.getsize(directory + "/filler") - 500 * 1024)
    store.put(torch.arange(100, 2100), torch.full((2000, 64), 2.0))  # 512 KiB of log: fits
    try:
        store.flush()  # applying it needs room in rows.bin: none left
        print("flushed")
    except OSError as error:
        print("flush failed", errno.errorcode[error.errno], "disk is full" in str(error))
    os.unlink(directory + "/filler")
    store.flush()  # space freed: the same flush now completes
    store.close()
    print("closed")
    """
)


def test_a_full_disk_fails_an_mmap_flush_with_enospc_and_a_retry_completes_it(tiny_filesystem):
    """Before its commit point the flush allocates the room applying the log will take, so a full
    disk is OSError(ENOSPC) that changes nothing, not a SIGBUS while writing through the map."""
    result = subprocess.run(
        [sys.executable, "-c", FULL_DISK_FLUSH, str(tiny_filesystem)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr  # a signal would make it negative
    assert result.stdout.split("\n")[:2] == ["flush failed ENOSPC True", "closed"], result.stdout
    with TieredStore(tiny_filesystem / "store", read_only=True, host_cache=4096) as store:
        assert len(store) == 2100
        assert bool((store.get(torch.arange(100)) == 1).all())
        assert bool((store.get(torch.arange(100, 2100)) == 2).all())


FILL_UNTIL_FULL = textwrap.dedent(
    """
    import json, os, sys, torch
    from tierstore import TieredStore
    directory, backend, flush_every = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(directory + "/ballast", "wb") as ballast:  # freed after the error, to make room again
        ballast.write(b"x" * 1024 * 1024)
    store = TieredStore(directory + "/store", dim=64, backend=backend, host_cache=600, device_cache=200)
    put = {}
    error = None
    for part in range(2000):  # 100 rows a put, each row its put's number: the disk fills on the way
        ids = torch.arange(part * 100, (part + 1) * 100) % 60_000
        try:
            store.put(ids, torch.full((100, 64), float(part)))
        except OSError as raised:
            error = raised
            break
        put.update(dict.fromkeys(ids.tolist(), float(part)))
        if part % flush_every == flush_every - 1:
            try:
                store.flush()
            except OSError as raised:
                error = raised
                break
    failed_ids = torch.arange(part * 100, (part + 1) * 100) % 60_000
    failed_new = [i for i in failed_ids.tolist() if i not in put]
    print(json.dumps({"error": str(error), "errno": getattr(error, "errno", None), "rows": len(put),
                      "failed_put_new_ids_held": int(store.contains(failed_new).sum()) if failed_new else 0}))
    os.unlink(directory + "/ballast")  # reading rows back moves rows between tiers: it needs room
    ids = torch.tensor(sorted(put))
    for chunk in ids.split(100):  # every row put before the error, from whatever tier holds it
        got = store.get(chunk)
        expected = torch.tensor([put[i] for i in chunk.tolist()])
        assert torch.equal(got[:, 0], expected), "a row put before the error was lost or changed"
    if flush_every < 100:  # a store never flushed holds its log and the rows it applies to: 2x the disk
        store.close()  # flushes
        with TieredStore(directory + "/store", read_only=True, host_cache=len(put)) as reopened:
            got = reopened.get(ids)[:, 0]
            expected = torch.tensor([put[i] for i in ids.tolist()])
            assert torch.equal(got, expected), "a row did not reach the disk"
    print("all rows intact", flush=True)
    """
)


@pytest.mark.parametrize("flush_every", [10, 10**6], ids=["flushing", "never-flushing"])
@pytest.mark.parametrize("backend", ["mmap", "lmdb"])
def test_after_a_full_disk_no_row_put_before_it_is_lost(tiny_filesystem, backend, flush_every):
    """Rows evicted towards a full disk stay where they were (the failing put changes nothing), so
    every row put before the error is still served, and the failed put's new ids are not added;
    whether the disk fills in a flush or in a put that stages evicted rows."""
    result = subprocess.run(
        [sys.executable, "-c", FILL_UNTIL_FULL, str(tiny_filesystem), backend, str(flush_every)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr  # no signal, no lost row
    report = json.loads(result.stdout.splitlines()[0])
    assert report["errno"] == errno.ENOSPC and "full" in report["error"] or "No space" in report["error"], (
        report
    )
    assert report["rows"] >= 1000 and report["failed_put_new_ids_held"] == 0, report
    assert result.stdout.splitlines()[1] == "all rows intact"


def test_puts_and_flushes_below_past_and_among_held_keys_match_a_dict(backend, tmp_path):
    store = open_store(backend, tmp_path)
    oracle = {}
    generator = torch.Generator().manual_seed(0)
    for keys in ([50, 10, 90], [30, 95, 120, 60, 10], [200, 201], [5, 6, 300], [1000, 7, 95]):
        for half in torch.tensor(keys).split(2):  # two puts per flush: staged keys interleave too
            rows = torch.randn(half.numel(), 3, generator=generator)
            store.put(half, rows)
            oracle.update(zip(half.tolist(), rows))
        store.flush()
    store.close()
    store = open_store(backend, tmp_path, read_only=True)
    keys = torch.tensor(sorted(oracle))
    rows, found = store.get(keys)
    assert bool(found.all()) and len(store) == len(oracle)
    assert torch.equal(rows, torch.stack([oracle[key] for key in keys.tolist()]))
    store.close()


KILLED_MID_APPLY = textwrap.dedent(
    """
    import json, os, signal, sys, torch
    from tierstore.tiers.cold import lmdb_store, open_cold_store
    lmdb_store.APPLY_ROWS = 4  # a flush of 30 rows applies in 8 transactions
    store = open_cold_store("lmdb", sys.argv[1], 3, torch.float32, False)
    store.put(torch.arange(0, 40, 2), torch.full((20, 3), 1.0))  # flush 1: 20 rows
    store.flush()
    store.put(torch.arange(0, 60, 2), torch.full((30, 3), 2.0))  # flush 2: 10 over, 10 new rows
    moves = 0
    write = store._write

    def killed_on_the_third_move(work):
        global moves
        if work.__name__ == "move":
            moves += 1
            if moves == 3:  # two transactions of the apply committed, the commit point before them
                os.kill(os.getpid(), signal.SIGKILL)
        return write(work)

    store._write = killed_on_the_third_move
    store.flush()
    """
)


def test_a_flush_applied_in_small_transactions_survives_a_kill_mid_apply(tmp_path):
    """LMDB's flush commits (the count and the staged rows' role) in one small transaction, then
    moves the rows a few at a time: killed between those moves, the store reopens, read-only and
    writable, holding exactly that flush, and the next flush finishes the move."""
    result = subprocess.run(
        [sys.executable, "-c", KILLED_MID_APPLY, str(tmp_path)], capture_output=True, text=True
    )
    assert result.returncode == -9, result.stderr
    expected = {key: 1.0 for key in range(0, 40, 2)} | {key: 2.0 for key in range(0, 60, 2)}
    keys = torch.tensor(sorted(expected))
    values = torch.tensor([expected[key] for key in keys.tolist()])
    for read_only in (True, False):
        store = open_cold_store("lmdb", tmp_path, 3, torch.float32, read_only)
        assert store.flushes == 2 and store._applying is not None and store._applying_count == 30
        rows, found = store.get(torch.arange(64))
        assert found.tolist() == [key in expected for key in range(64)]
        assert torch.equal(rows[keys, 0], values) and len(store) == len(expected)
        iterated = {int(key): float(row[0]) for part in store.iter_rows(7) for key, row in zip(*part)}
        assert iterated == expected
        if not read_only:
            store.put(torch.tensor([0, 100]), torch.full((2, 3), 3.0))  # staged over the applying rows
            assert store.get(torch.tensor([0, 2]))[0][:, 0].tolist() == [3.0, 2.0]
            store.flush()  # finishes flush 2's move first, then commits and moves flush 3
            assert store._applying is None and store.flushes == 3
        store.close()
    expected |= {0: 3.0, 100: 3.0}
    store = open_cold_store("lmdb", tmp_path, 3, torch.float32, True)
    keys = torch.tensor(sorted(expected))
    rows, found = store.get(keys)
    assert bool(found.all()) and rows[:, 0].tolist() == [expected[key] for key in keys.tolist()]
    assert store._applying_count == 0 and store._pending_count == 0 and len(store) == len(expected)
    store.close()


def test_lmdb_flush_moves_its_rows_in_bounded_transactions(tmp_path, monkeypatch):
    """No write transaction of a flush holds more than ``APPLY_ROWS`` of its rows (LMDB keeps a
    transaction's dirty pages in memory until it commits), and the rows match a dict."""
    monkeypatch.setattr(lmdb_store, "APPLY_ROWS", 16)
    store = open_cold_store("lmdb", tmp_path, 3, torch.float32, False)
    moved, clears = [], 0
    write = store._write

    def counting(work):
        nonlocal clears
        result = write(work)
        if work.__name__ == "move":
            moved.append(result)
        clears += work.__name__ == "clear"
        return result

    store._write = counting
    oracle = {}
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        keys = torch.randperm(500, generator=generator)[:100]
        rows = torch.randn(100, 3, generator=generator)
        store.put(keys, rows)
        oracle.update(zip(keys.tolist(), rows))
        store.flush()
    assert max(moved) == 16 and clears == 4  # each flush: full transactions, then the clear
    keys = torch.tensor(sorted(oracle))
    rows, found = store.get(keys)
    assert bool(found.all()) and torch.equal(rows, torch.stack([oracle[key] for key in keys.tolist()]))
    store.close()


def test_lmdb_stages_rows_in_an_append_only_log(tmp_path):
    """Staged rows are appended (keyed by sequence number, each value its id and row), so a put of
    random ids writes only the log's last leaves: they fill whole pages (ids as keys would split
    leaves all over the tree, and LMDB holds every page a transaction dirties in RAM). An id staged
    again reads its newest row, before and after the flush, and ``index_bytes`` counts the index."""
    store = open_cold_store("lmdb", tmp_path, 3, torch.float32, False)
    generator = torch.Generator().manual_seed(2)
    oracle, staged = {}, 0
    for _ in range(6):
        keys = torch.randint(0, 1 << 40, (500,), generator=generator).unique()
        rows = torch.randn(keys.numel(), 3, generator=generator)
        store.put(keys, rows)
        oracle.update(zip(keys.tolist(), rows))
        staged += keys.numel()
    again = torch.tensor(list(oracle)[:50])
    store.put(again, torch.full((50, 3), 7.0))
    oracle.update({key: torch.full((3,), 7.0) for key in again.tolist()})
    log = store._logs[store._staging]
    entry_bytes = lmdb_staging.ID_BYTES + store.codec.stored_bytes
    with store._env.begin() as txn:
        entries = txn.cursor(log.database).iternext(values=False)
        numbers = lmdb_staging.decode_keys([bytes(key) for key in entries])
        shape = txn.stat(log.database)
    assert numbers.tolist() == list(range(log.entries)) and log.entries == staged + 50
    node_bytes = 8 + 8 + entry_bytes + 2  # LMDB's node header, key, value, and its pointer in the page
    full_pages = -(-log.entries * node_bytes // (shape["psize"] - 16))
    assert shape["leaf_pages"] <= full_pages + 1
    assert store.report()["index_bytes"] == sum(each.nbytes for each in store._logs) >= log.nbytes > 0
    keys = torch.tensor(sorted(oracle))
    expected = torch.stack([oracle[key] for key in keys.tolist()])
    for _ in ("staged", "flushed"):
        rows, found = store.get(keys)
        assert bool(found.all()) and torch.equal(rows, expected) and len(store) == len(oracle)
        store.flush()
    store.close()


def test_lmdb_stages_a_flushs_own_rows_without_indexing_them(tmp_path, monkeypatch):
    """A flush's own rows (``before_flush``) are appended without growing the index; read before
    the flush commits (it failed), they are found all the same (the index rebuilt by scanning the
    log). The apply copies the log in order, so an id staged twice, in different transactions of
    the apply, ends with its newest row; checked against a dict."""
    monkeypatch.setattr(lmdb_store, "APPLY_ROWS", 7)
    store = open_cold_store("lmdb", tmp_path, 3, torch.float32, False)
    oracle = {}

    def put(keys, value, before_flush):
        keys = torch.tensor(keys)
        store.put(keys, torch.full((keys.numel(), 3), float(value)), before_flush)
        oracle.update({key: float(value) for key in keys.tolist()})

    put(range(0, 20), 1.0, False)  # evicted rows: indexed
    index_bytes = store.report()["index_bytes"]
    put(range(10, 40), 2.0, True)  # a flush's rows, 10 of them staged before
    log = store._logs[store._staging]
    assert not log.indexed and store.report()["index_bytes"] == index_bytes
    keys = torch.tensor(sorted(oracle))
    expected = torch.tensor([oracle[key] for key in keys.tolist()])
    rows, found = store.get(keys)  # before the flush: the index rebuilt from the log
    assert log.indexed and bool(found.all()) and torch.equal(rows[:, 0], expected)
    put(range(35, 45), 3.0, True)
    assert len(store) == len(oracle)
    store.flush()
    put(range(0, 5), 4.0, False)
    put(range(3, 8), 5.0, True)
    store.flush()
    store.close()
    store = open_cold_store("lmdb", tmp_path, 3, torch.float32, True)
    keys = torch.tensor(sorted(oracle))
    rows, found = store.get(keys)
    assert bool(found.all()) and rows[:, 0].tolist() == [oracle[key] for key in keys.tolist()]
    assert len(store) == len(oracle)
    store.close()


def test_the_logs_growing_index_stays_off_huge_pages_where_a_tiers_index_asks_for_them(tmp_path, monkeypatch):
    """The mmap log's index grows as rows are staged, each rebuild touching a new table first: it
    is never marked for 2 MiB pages (``MADV_HUGEPAGE``), where a table of the same size made as a
    tier's index is."""
    marked = []
    monkeypatch.setattr(
        huge_pages, "_madvise", lambda: lambda start, length, advice: marked.append((start, length))
    )

    def touched(tensor):
        start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
        return any(start < at + length and at < end for at, length in marked)

    store = open_store("mmap-kernel-index", tmp_path)
    keys = torch.arange(200_000)  # fewer than the table holds before it is sealed into a run
    store.put(keys, torch.zeros(keys.numel(), 3))
    log_index = store._wal_index
    assert log_index.keys.nbytes >= 2 * huge_pages.HUGE_PAGE and torch.equal(
        store.get(keys)[1], torch.ones(200_000, dtype=torch.bool)
    )
    assert not touched(log_index.keys) and not touched(log_index.values)
    tiers_index = KernelHashTable(300_000, parallel_host_kernels(), value_dtype=torch.int64)
    assert touched(tiers_index.keys) and touched(tiers_index.values)
    store.close()
