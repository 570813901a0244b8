"""The mmap cold store's key index lives in ``index.bin``, memory-mapped: opening reads neither it
nor ``keys.bin``, its memory is page cache rather than anonymous memory (checked under a cgroup
memory limit), and a process killed while adding rows leaves an index that is repaired (the
store holding its last completed flush, every row where it was)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import cgroup_problem, peak_in_cgroup

from tierstore import TieredStore
from tierstore.tiers.cold import mmap_files, mmap_store
from tierstore.tiers.cold.disk_index import INDEX_FILE

DIM = 4


def rows_of(ids):
    return ids.to(torch.float32)[:, None] * torch.arange(1, DIM + 1, dtype=torch.float32)


def make_store(path, count, backend="mmap"):
    ids = torch.arange(count) * 7 + 3
    with TieredStore(path, dim=DIM, backend=backend, host_cache=1024) as store:
        store.load(ids, rows_of(ids))
    return ids


def test_reopening_uses_the_index_file_without_reading_the_key_file(tmp_path, monkeypatch):
    ids = make_store(tmp_path / "s", 5000)
    assert (tmp_path / "s" / INDEX_FILE).exists()

    def refuse(self, index):
        raise AssertionError("opening read keys.bin to build an index")

    monkeypatch.setattr(mmap_store.MmapColdStore, "_index_from_keys", refuse)
    for read_only in (True, False):
        with TieredStore(tmp_path / "s", read_only=read_only, host_cache=1024) as store:
            assert torch.equal(store.get(ids), rows_of(ids))
            assert len(store) == 5000 and store.structure_problems() == []
            cold = store.stats()["cold"]
            assert cold["index_bytes"] < 1 << 16 and cold["index_file_bytes"] >= 16 * 5000


def test_a_missing_or_damaged_index_file_is_rebuilt_from_the_key_file(tmp_path):
    ids = make_store(tmp_path / "s", 3000)
    index = tmp_path / "s" / INDEX_FILE
    for damage in ("missing", "truncated", "garbage header"):
        if damage == "missing":
            index.unlink()
        elif damage == "truncated":
            os.truncate(index, 4096 + 100)
        else:
            with open(index, "r+b") as file:
                file.write(os.urandom(64))
        with TieredStore(tmp_path / "s", read_only=True, host_cache=1024) as store:  # in RAM for a reader
            assert torch.equal(store.get(ids), rows_of(ids))
        with TieredStore(tmp_path / "s", host_cache=1024) as store:  # the writer rebuilds the file
            assert torch.equal(store.get(ids), rows_of(ids)) and store.structure_problems() == []
        assert index.exists()


KILLED_WHILE_ADDING = """
import os, sys, torch
from tierstore import TieredStore
from tierstore.tiers.cold import mmap_store
path, how = sys.argv[1], sys.argv[2]
ids = torch.arange(3000, 3600) * 7 + 3
rows = ids.to(torch.float32)[:, None] * torch.arange(1, 5, dtype=torch.float32)
store = TieredStore(path, host_cache=1024)
written = mmap_store.MmapColdStore._write_state
def die_when_rows_are_added(self, count, flushes=None):
    if count > 3000:  # the index has their keys already: killed before the count is committed
        os._exit(9)
    written(self, count, flushes)
mmap_store.MmapColdStore._write_state = die_when_rows_are_added
if how == "bulk":  # bulk load: the rows were never flushed
    store.stack.cold.bulk_load(ids, rows)
    store.stack.cold.flush()
else:  # through the log: its flush commits (the log), then applying it dies
    store.put(ids, rows)
    store.flush()
"""


@pytest.mark.parametrize("how", ["bulk", "log"])
def test_a_process_killed_while_adding_rows_leaves_an_index_that_is_repaired(tmp_path, how):
    ids = make_store(tmp_path / "s", 3000)
    run = subprocess.run([sys.executable, "-c", KILLED_WHILE_ADDING, str(tmp_path / "s"), how], timeout=300)
    assert run.returncode == 9
    added = torch.arange(3000, 3600) * 7 + 3
    with TieredStore(tmp_path / "s", read_only=True, host_cache=1024) as reader:  # before any repair
        assert len(reader) == (3000 if how == "bulk" else 3600)
        assert torch.equal(reader.get(ids), rows_of(ids))
    with TieredStore(tmp_path / "s", host_cache=1024) as store:
        assert store.structure_problems() == []
        assert torch.equal(store.get(ids), rows_of(ids))
        if how == "bulk":  # the last flush did not hold them: they are new rows, and may be loaded again
            assert len(store) == 3000 and not bool(store.contains(added).any())
            store.load(added, rows_of(added))
        assert torch.equal(store.get(added), rows_of(added)) and len(store) == 3600
    with TieredStore(tmp_path / "s", read_only=True, host_cache=1024) as store:
        assert store.structure_problems() == [] and len(store) == 3600


OPEN_UNDER_A_LIMIT = """
import sys, torch
from tierstore import TieredStore
with TieredStore(sys.argv[1], read_only=True, host_cache=1024) as store:
    ids = torch.arange(0, int(sys.argv[2]), 9973) * 7 + 3
    assert torch.equal(store.get(ids)[:, 0], ids.to(torch.float32))
print("ok")
"""


@pytest.mark.skipif(cgroup_problem() is not None, reason=str(cgroup_problem()))
def test_a_store_whose_index_is_larger_than_the_memory_limit_opens_and_reads_under_it(tmp_path):
    """4M ids: an index in RAM would take about 180 MiB of anonymous memory; the process runs in a
    cgroup whose limit (page cache included) leaves it well under that beside torch's own memory."""
    count = 4_000_000
    ids = torch.arange(count) * 7 + 3
    with TieredStore(tmp_path / "s", dim=DIM, host_cache=1024) as store:
        for part in ids.split(1 << 20):
            store.load(part, rows_of(part))
    baseline = peak_in_cgroup(tmp_path, "import torch, tierstore", 1 << 40)
    limit = baseline + (64 << 20)
    script = textwrap.dedent(OPEN_UNDER_A_LIMIT)
    peak = peak_in_cgroup(tmp_path, script, limit, str(tmp_path / "s"), str(count))
    assert peak <= limit


def test_a_read_that_asks_for_its_pages_first_reads_the_same_rows(tmp_path):
    ids = make_store(tmp_path / "s", 20_000)
    with TieredStore(tmp_path / "s", read_only=True, host_cache=1024) as store:
        cold = store.stack.cold
        wanted = torch.cat([ids[::7], torch.tensor([5, 10**9])])  # two absent ids
        cold._reads.advising = True
        advised = cold.get(wanted, torch.zeros_like(wanted))
        cold._reads.advising = False
        plain = cold.get(wanted, torch.zeros_like(wanted))
    assert torch.equal(advised[1], plain[1]) and int(plain[1].sum()) == ids[::7].numel()
    assert torch.equal(advised[0][plain[1]], plain[0][plain[1]])
    assert torch.equal(plain[0][plain[1]], rows_of(ids[::7]))


@pytest.mark.parametrize("advising", [False, True])
def test_a_flush_that_asks_for_its_pages_first_writes_the_same_rows(tmp_path, advising):
    """Where reads find their pages on disk, a flush asks for the index pages of the log's ids and
    applies the log chunk by chunk in the rows' order, asking for both files' pages first: the
    store then holds what the plain flush leaves (checked against a dict, and reopened)."""
    ids = make_store(tmp_path / "s", 30_000)
    oracle = dict(zip(ids.tolist(), rows_of(ids)))
    generator = torch.Generator().manual_seed(1)
    with TieredStore(tmp_path / "s", host_cache=1024) as store:
        cold = store.stack.cold
        for _ in range(3):  # overwritten and new ids, staged in the log, applied by each flush
            changed = torch.cat(
                [
                    ids[torch.randint(0, ids.numel(), (20_000,), generator=generator)].unique(),
                    torch.randint(10**6, 10**7, (500,), generator=generator).unique(),
                ]
            )
            rows = torch.randn(changed.numel(), DIM, generator=generator)
            cold.put(changed, rows)
            oracle.update(zip(changed.tolist(), rows))
            cold._reads.advising = advising
            assert (cold._advising_passes() is not None) == advising
            cold.flush()
            assert cold._wal_count == 0  # applied
    with TieredStore(tmp_path / "s", read_only=True, host_cache=1024) as store:
        keys = torch.tensor(sorted(oracle))
        got, found = store.stack.cold.get(keys, torch.zeros_like(keys))
        assert bool(found.all())
        assert torch.equal(got, torch.stack([oracle[key] for key in keys.tolist()]))


def test_reads_ask_for_their_pages_while_plain_reads_fault_and_recheck_now_and_then(monkeypatch):
    faults = iter([0, 500, 500, 500, 500, 510])  # majflt before and after each plain read

    class Usage:
        def __init__(self, value):
            self.ru_majflt = value

    advice = mmap_files.ReadAdvice()
    monkeypatch.setattr(mmap_files.resource, "getrusage", lambda who: Usage(next(faults)))
    assert not advice.advise(1000)
    advice.done(1000, False)  # 500 faults for 1,000 rows: the rows are on disk
    assert advice.advising
    for _ in range(advice.RECHECK_EVERY - 1):
        assert advice.advise(1000)
        advice.done(1000, True)
    assert not advice.advise(1000)  # a plain read now and then, to see whether they still are
    advice.done(1000, False)  # 0 more faults (500 -> 500): in memory now
    assert not advice.advising
    for _ in range(advice.MEASURE_EVERY):  # plain reads: one in 8 is measured (500 -> 510)
        assert not advice.advise(1000)
        advice.done(1000, False)
    assert not advice.advising  # 10 faults for 1,000 rows: under one in 16
    assert next(faults, None) is None  # every count above was taken, and no other
