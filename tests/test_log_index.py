"""The cold stores' log index (``tiers.cold.log_index``): bounded in RAM however long the log grows
(sealed runs on disk), answering as a dict across seals and merges, through the mmap store's native
and torch paths and the LMDB store's staging log, under a full disk and a memory limit."""

import errno
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from helpers import cgroup_problem, peak_in_cgroup
from host_kernels import shared_host_kernels
from hypothesis import settings
from test_store_oracle import StoreAgainstDict

from tierstore import TieredStore
from tierstore.hashing import key_mix, key_unmix
from tierstore.kernels.step_passes import host_passes
from tierstore.tiers.cold import lmdb_staging, log_index, sealed_runs
from tierstore.tiers.cold.lmdb_staging import StageLog
from tierstore.tiers.cold.log_index import LogIndex


@pytest.mark.parametrize("background", [True, False], ids=["in-background", "in-make-room"])
@pytest.mark.parametrize("kernels", ["host", None])
def test_the_index_answers_as_a_dict_across_seals_and_merges(tmp_path, monkeypatch, kernels, background):
    """Random batches of keys given new values (a key in the table dropped first, as the store does),
    some removals (negative values): ``find`` equals a dict after every batch, while the table never
    holds more than ``seal_at`` keys and the runs stay logarithmic in number (merges in the background
    at most ``MERGES_BEHIND`` runs more, as many once settled)."""
    monkeypatch.setattr(sealed_runs, "MERGE_CHUNK", 5)  # merges run chunk by chunk
    kernels = None if kernels is None else shared_host_kernels()
    index = LogIndex(tmp_path, kernels, seal_at=16, in_background=background)
    behind = log_index.MERGES_BEHIND + 1 if background else 0
    oracle, generator, record = {}, np.random.default_rng(0), 0
    for _ in range(120):
        keys = torch.from_numpy(generator.choice(400, size=int(generator.integers(1, 24)), replace=False))
        values = torch.arange(record, record + keys.numel())
        removal = torch.from_numpy(generator.random(keys.numel()) < 0.2)
        values = torch.where(removal, -2 - values, values)
        record += keys.numel()
        index.remove(keys)
        index.insert(keys, values)
        oracle.update(zip(keys.tolist(), values.tolist()))
        probe = torch.arange(420)
        expected = torch.tensor([oracle.get(key, -1) for key in probe.tolist()])
        assert torch.equal(index.find(probe), expected)
        assert index.table.live <= index.seal_at
        assert len(index.runs) <= 1 + int(np.log2(max(1, record) / index.seal_at) + 1) + behind
    index.settle()
    assert len(index.runs) <= 1 + int(np.log2(record / index.seal_at) + 1)
    assert torch.equal(index.find(probe), expected)
    assert index.runs and (kernels is None) == (index.native_runs is None)
    assert not list(tmp_path.iterdir())  # the runs' files are unlinked: a kill leaves nothing
    index.close()


@pytest.mark.parametrize("sizes", [(0, 0), (0, 7), (9, 0), (1, 1), (300, 200), (2000, 3000)])
def test_the_native_merge_of_two_runs_is_the_sorted_merge(sizes):
    """``ColdPasses.merge_runs`` (one linear pass) against the stable sort it replaces: the mixes
    ascending and distinct, a mix in both runs taking the newer run's value."""
    passes = host_passes()
    if passes is None:
        pytest.skip("the tuned host build cannot be built here")
    generator = np.random.default_rng(sum(sizes))
    parts = []
    for size in sizes:  # keys from a small range: many in both runs
        hashes = np.unique(key_mix(generator.integers(0, 4 * max(sizes) + 1, size)))
        parts.append((hashes, generator.integers(-(1 << 40), 1 << 40, hashes.size)))
    native, sorted_merge = passes.merge_runs(*parts), sealed_runs._sorted_merge(*parts)
    assert np.array_equal(native[0], sorted_merge[0]) and np.array_equal(native[1], sorted_merge[1])
    assert np.all(native[0][1:] > native[0][:-1])
    both = np.intersect1d(parts[0][0], parts[1][0])
    newer = dict(zip(parts[1][0].tolist(), parts[1][1].tolist()))
    kept = dict(zip(native[0].tolist(), native[1].tolist()))
    assert all(kept[mix] == newer[mix] for mix in both.tolist())
    assert native[0].size == parts[0][0].size + parts[1][0].size - both.size


def held_merges(monkeypatch) -> threading.Event:
    """Background merges wait for the returned event before their first chunk."""
    release = threading.Event()
    merged = sealed_runs.merged

    def held(older, newer, merge, passes=None):
        assert release.wait(60)
        yield from merged(older, newer, merge, passes)

    monkeypatch.setattr(sealed_runs, "merged", held)
    return release


def staged(index: LogIndex, keys: torch.Tensor, values: torch.Tensor) -> None:
    index.remove(keys)
    index.insert(keys, values)


def sealed(index: LogIndex, room: int) -> None:
    """``make_room(room)``, and the seal it starts finished and its run taken (merges it leads to
    started)."""
    index.make_room(room)
    if index.sealing is not None:
        index.sealing.result()
    index.make_room(0)


def test_runs_answer_while_their_merge_runs_and_its_run_takes_their_place(tmp_path, monkeypatch):
    """A merge under way leaves its two runs serving lookups (Python's and the native filters');
    the next ``make_room`` after it ends puts its run in their place, the newer value of each key
    kept. Seals ``MERGES_BEHIND`` runs past it wait for it."""
    release = held_merges(monkeypatch)
    index = LogIndex(tmp_path, shared_host_kernels(), seal_at=64)
    keys = torch.arange(64) * 5
    staged(index, keys, keys)
    sealed(index, 64)  # the first run
    staged(index, keys[:32], keys[:32] + 1)  # the second run's values win over the first's
    sealed(index, 64)  # the second run: a merge of the two starts, and waits
    merge = index.merge
    assert merge is not None and not merge.done and len(index.runs) == 2
    expected = torch.cat([keys[:32] + 1, keys[32:]])
    assert torch.equal(index.find(keys), expected)
    assert index.native_runs is not None and index.native_runs.count == 2
    release.set()
    merge.result()
    index.make_room(1)
    assert index.merge is None and len(index.runs) == 1 and index.runs[0].length == 64
    assert torch.equal(index.find(keys), expected)
    assert index.native_runs.count == 1
    # a merge held while seals run ahead of it: the seal past the runs allowed waits for it
    oracle = dict(zip(keys.tolist(), expected.tolist()))
    release.clear()
    for value in range(8):
        part = keys[value::7]
        staged(index, part, torch.full_like(part, 1000 + value))
        oracle.update(dict.fromkeys(part.tolist(), 1000 + value))
        if len(index.runs) + 1 > index._runs_allowed():  # this seal waits: the merge may go on
            release.set()
        sealed(index, 64)
        assert len(index.runs) <= index._runs_allowed()
        assert index.find(keys).tolist() == [oracle[key] for key in keys.tolist()]
    assert release.is_set()
    index.settle()
    assert index.merge is None and len(index.runs) <= 3
    assert index.find(keys).tolist() == [oracle[key] for key in keys.tolist()]
    index.close()


@pytest.mark.parametrize("backend", ["mmap", "lmdb"])
def test_a_table_being_sealed_answers_lookups_until_its_run_takes_its_place(tmp_path, monkeypatch, backend):
    """While a seal runs in the background, the frozen table serves the store's lookups (the mmap
    store's native ones included) and a new table takes the puts after it; the run then takes its
    place with the same answers."""
    monkeypatch.setattr(log_index, "SEAL_AT", 4096)
    release = threading.Event()
    sorted_entries = sealed_runs.sorted_entries

    def held(table, seal):
        assert release.wait(60)
        yield from sorted_entries(table, seal)

    monkeypatch.setattr(sealed_runs, "sorted_entries", held)
    store = TieredStore(tmp_path / "s", dim=2, backend=backend, host_cache=64)
    keys = torch.arange(6000) * 7
    store.put(keys[:4000], torch.ones(4000, 2))
    store.put(keys[3000:], torch.ones(3000, 2) * 2)  # the table seals: 1,000 keys superseded after it
    index = staging_index(store)
    assert index.sealing is not None and not index.sealing.done and not index.runs
    expected = torch.cat([torch.ones(3000), torch.full((3000,), 2.0)])
    staged_keys = 6000 - 64  # the last puts are still in the host cache
    probe = torch.cat([keys[:staged_keys], keys + 3])  # staged, and never staged

    def answers_from_the_cold_store() -> None:
        rows, found = store.stack.cold.get(probe)
        assert found.tolist() == [True] * staged_keys + [False] * 6000
        assert torch.equal(rows[:staged_keys, 0], expected[:staged_keys])
        assert torch.equal(store.get(keys)[:, 0], expected)

    answers_from_the_cold_store()
    assert (index.native_runs is not None) == (backend == "mmap")
    release.set()
    index.settle()
    assert index.sealing is None and len(index.runs) == 1
    answers_from_the_cold_store()
    store.close()


EXIT_WHILE_SEALING = """
import sys, torch
from tierstore import TieredStore
from tierstore.tiers.cold import log_index, sealed_runs
log_index.SEAL_AT = 4096
sorted_entries = sealed_runs.sorted_entries

def slow(table, seal):  # the seal's thread inside torch's kernels when the main thread ends
    torch.sort(torch.randn(40_000_000))
    yield from sorted_entries(table, seal)

sealed_runs.sorted_entries = slow
store = TieredStore(sys.argv[1], dim=2, host_cache=64)
store.put(torch.arange(5000), torch.ones(5000, 2))
assert store.stack.cold._wal_index.sealing is not None
print("staged", flush=True)
"""


def test_a_process_ending_while_a_seal_runs_exits_cleanly(tmp_path):
    """A script that ends (without closing its store) while a seal runs in the background exits with
    status 0: it waits for the seal's thread, which would otherwise be stopped inside torch's
    kernels as the interpreter shuts down (an abort)."""
    run = subprocess.run(
        [sys.executable, "-c", EXIT_WHILE_SEALING, str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and "staged" in run.stdout, (run.returncode, run.stderr[-2000:])
    assert "terminate" not in run.stderr


def test_closing_during_a_merge_stops_it_and_leaves_no_file(tmp_path, monkeypatch):
    """``close`` (the log emptied by a flush, or the store closed) cancels a merge under way: its
    thread ends, its half-written run is closed, and nothing is left beside the store."""
    release = held_merges(monkeypatch)
    index = LogIndex(tmp_path, shared_host_kernels(), seal_at=32)
    for value in range(2):
        staged(index, torch.arange(32), torch.full((32,), value))
        sealed(index, 32)
    merge = index.merge
    assert merge is not None and not merge.done
    closing = threading.Thread(target=index.close)
    closing.start()
    release.set()
    closing.join(60)
    assert not closing.is_alive() and merge.done and isinstance(merge.error, sealed_runs.BuildCancelled)
    assert index.merge is None and not index.runs
    assert not list(tmp_path.iterdir())


def test_a_merge_that_fails_in_the_background_leaves_its_runs(tmp_path, monkeypatch):
    """A merge whose run cannot be written (a full disk) changes nothing: its runs keep answering,
    and the next seal merges them."""
    index = LogIndex(tmp_path, shared_host_kernels(), seal_at=32)
    run_file = index._run_file
    failing = [True]

    def full_disk_for_merges(capacity):
        if failing[0] and capacity > 32:
            raise OSError(errno.ENOSPC, "no space left on device")
        return run_file(capacity)

    monkeypatch.setattr(index, "_run_file", full_disk_for_merges)
    for value in range(2):
        staged(index, torch.arange(value, 64, 2), torch.full((32,), value))
        sealed(index, 32)
    index.settle()
    assert len(index.runs) == 2 and isinstance(index.merge, type(None))
    assert torch.equal(index.find(torch.arange(64)), torch.arange(64) % 2)
    failing[0] = False
    staged(index, torch.arange(100, 132), torch.full((32,), 7))
    index.make_room(32)  # seals a third run: the first two merge now, then that run with it
    index.settle()
    assert [run.length for run in index.runs] == [96]
    assert torch.equal(index.find(torch.arange(64)), torch.arange(64) % 2)
    assert torch.equal(index.find(torch.arange(100, 132)), torch.full((32,), 7))
    index.close()


def test_a_seal_that_fails_in_the_background_is_sealed_again_by_the_next(tmp_path, monkeypatch):
    """A seal whose run cannot be written after its file was allocated (an I/O error) leaves its
    frozen table answering; the next seal (or ``settle``) seals it again here, raising the error
    while it persists (the index unchanged), and sealing once it is gone."""
    index = LogIndex(tmp_path, shared_host_kernels(), seal_at=32)
    write_run = index._write_run
    failing = [True]

    def failed_write(file, capacity, parts):
        if failing[0]:
            file.close()
            raise OSError(errno.EIO, "input/output error")
        return write_run(file, capacity, parts)

    monkeypatch.setattr(index, "_write_run", failed_write)
    keys = torch.arange(32) * 3
    staged(index, keys, keys + 1)
    index.make_room(32)  # a seal starts, and fails
    index.sealing.result()
    assert index.sealing.error is not None and not index.runs
    assert torch.equal(index.find(keys), keys + 1)
    with pytest.raises(OSError) as raised:
        index.settle()
    assert raised.value.errno == errno.EIO
    assert index.sealing is not None and not index.runs and torch.equal(index.find(keys), keys + 1)
    failing[0] = False
    index.settle()
    assert index.sealing is None and len(index.runs) == 1 and torch.equal(index.find(keys), keys + 1)
    index.close()


def test_a_keys_mix_is_undone_exactly():
    """The runs hold their keys' mixes (splitmix64's finaliser, a bijection): unmixed, every key comes
    back, the extremes included, and known mixes are splitmix64's."""
    keys = np.concatenate([np.random.default_rng(0).integers(0, 2**63 - 1, 100_000), [0, 1, 2**63 - 1]])
    assert np.array_equal(key_unmix(key_mix(keys)), keys)
    assert np.unique(key_mix(keys)).size == keys.size
    # splitmix64's outputs from seed 0 and 1: the finaliser of 0x9E3779B97F4A7C15 and twice it
    golden = np.array([0x9E3779B97F4A7C15, 0x3C6EF372FE94F82A], dtype=np.uint64)
    assert key_mix(golden).tolist() == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]


def test_items_lists_every_key_by_key_across_runs(tmp_path):
    """``items`` unmixes the runs' entries and orders them by key, the newest value of each."""
    index = LogIndex(tmp_path, shared_host_kernels(), seal_at=8)
    keys = torch.arange(40) * 3
    for value in range(3):
        for start in range(0, 40, 7):
            part = keys[start : start + 7]
            index.remove(part)
            index.insert(part, torch.full_like(part, value))
    assert index.runs
    listed, values = index.items()
    assert torch.equal(listed, keys) and torch.equal(values, torch.full_like(keys, 2))
    index.close()


def staging_index(store: TieredStore) -> LogIndex:
    """The index of what ``store``'s cold store staged since its last flush."""
    cold = store.stack.cold
    return cold._wal_index if hasattr(cold, "_wal_index") else cold._logs[cold._staging].index


@pytest.mark.parametrize("backend", ["mmap", "lmdb"])
def test_ram_stays_bounded_as_the_log_grows(tmp_path, backend):
    """600K rows staged through a store's log: the index's RAM is its table (a sealed table's worth)
    and a few bytes a sealed key (none without the kernels' filters: LMDB's); the sealed keys live in
    files."""
    store = TieredStore(tmp_path / "s", dim=2, backend=backend, host_cache=64)
    for start in range(0, 600_000, 50_000):
        keys = torch.arange(start, start + 50_000) * 7
        store.put(keys, torch.ones(keys.numel(), 2) * start)
    index = staging_index(store)
    index.settle()
    sealed = sum(run.length for run in index.runs)
    assert sealed >= 600_000 - index.seal_at and index.file_bytes >= 16 * sealed
    assert index.nbytes <= index.table.nbytes + 6 * sealed + 1024 * len(index.runs)  # filters, directories
    assert index.table.nbytes <= 48 * 2 * index.seal_at
    assert store.stats()["cold"]["index_bytes"] >= index.nbytes  # with the main index, the other log
    keys = torch.tensor([0, 7 * 49_999, 7 * 50_000, 7 * 599_999, 5])
    found = store.stack.cold.get(keys[[0, 1, 2, 4]])[1]  # the last puts are still in the cache
    assert found.tolist() == [True, True, True, False]
    # staged keys across every run and the table, and keys never staged (the mmap store's native
    # lookups through the runs' filters and directories: runs of 262,144 keys and more)
    sample = torch.from_numpy(np.random.default_rng(0).choice(550_000, 4_000, replace=False))
    rows, found = store.stack.cold.get(torch.cat([sample * 7, sample * 7 + 3]))
    assert found.tolist() == [True] * 4_000 + [False] * 4_000
    assert torch.equal(rows[:4_000, 0], (sample // 50_000 * 50_000).float())
    assert (index.native_runs is not None) == (backend == "mmap")
    assert torch.equal(store.get(keys)[:4, 0], torch.tensor([0.0, 0.0, 50_000.0, 550_000.0]))
    store.close()
    store = TieredStore(tmp_path / "s")
    assert torch.equal(store.get(keys)[:4, 0], torch.tensor([0.0, 0.0, 50_000.0, 550_000.0]))
    store.close()


def test_lmdb_rebuilds_its_staging_index_a_chunk_at_a_time(tmp_path, monkeypatch):
    """The LMDB staging log's index rebuilt by scanning the log (as a store opening on a flush being
    applied does), a few entries decoded at a time and sealing as it goes, equals the index built as
    the rows were staged: ids staged again, removed, and staged after a removal."""
    monkeypatch.setattr(log_index, "SEAL_AT", 5)
    monkeypatch.setattr(lmdb_staging, "LOAD_ENTRIES", 3)
    store = TieredStore(tmp_path / "s", dim=2, backend="lmdb", host_cache=4)
    generator = np.random.default_rng(1)
    for round in range(12):
        keys = torch.from_numpy(generator.choice(40, size=int(generator.integers(1, 9)), replace=False))
        store.put(keys, torch.full((keys.numel(), 2), float(round)))
        store.remove(torch.from_numpy(generator.choice(40, size=2, replace=False)))
    cold = store.stack.cold
    log = cold._logs[cold._staging]
    rebuilt = StageLog(log.database, cold.codec.stored_bytes, tmp_path)
    with cold._begin() as txn:
        rebuilt.load(txn)
    assert rebuilt.index.runs and rebuilt.indexed
    assert (rebuilt.entries, rebuilt.next_entry) == (log.entries, log.next_entry)
    for built, loaded in zip(log.items(), rebuilt.items()):
        assert torch.equal(built, loaded)
    probe = torch.arange(45)
    assert torch.equal(rebuilt.find(probe), log.find(probe))
    rebuilt.close()
    store.close()


@pytest.mark.parametrize("backend", ["mmap", "lmdb"])
def test_the_index_makes_its_room_before_the_log_is_written(tmp_path, monkeypatch, backend):
    """A seal that fails (a full disk allocating the run's file) fails the cold store's put or removal
    before its records are written or committed: the log, its index and the rows read are as before;
    a put of more keys than the table holds is staged a table's worth at a time."""
    monkeypatch.setattr(log_index, "SEAL_AT", 4)
    store = TieredStore(tmp_path / "s", dim=2, backend=backend, host_cache=2)
    cold = store.stack.cold
    keys = torch.arange(4)
    cold.put(keys, torch.ones(4, 2))

    def writes():  # what the store staged, and its counts of writes and of the index's memory
        report = cold.report()
        counts = {name: value for name, value in report.items() if "written" in name or "index" in name}
        return cold.staged_keys().tolist(), len(cold), counts

    before = writes()

    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(LogIndex, "_run_file", full_disk)
    for change in (lambda: cold.put(torch.tensor([1, 9]), torch.zeros(2, 2)), lambda: cold.remove(keys[:2])):
        with pytest.raises(OSError) as raised:
            change()
        assert raised.value.errno == errno.ENOSPC
        assert writes() == before and not staging_index(store).runs
        rows, found = cold.get(torch.tensor([0, 1, 9]))
        assert found.tolist() == [True, True, False] and torch.equal(rows[:2], torch.ones(2, 2))
    monkeypatch.undo()
    monkeypatch.setattr(log_index, "SEAL_AT", 4)
    cold.put(torch.tensor([1, 9]), torch.zeros(2, 2))
    cold.put(torch.arange(10, 21), torch.full((11, 2), 3.0))  # three parts, sealing between them
    cold.remove(torch.tensor([0, 10, 11, 12, 13, 14]))  # two parts
    assert staging_index(store).runs
    rows, found = cold.get(torch.tensor([0, 1, 9, 10, 15, 20]))
    assert found.tolist() == [False, True, True, False, True, True]
    assert torch.equal(rows[[1, 2, 4, 5]], torch.tensor([[0.0, 0], [0, 0], [3, 3], [3, 3]]))
    store.close()
    with TieredStore(tmp_path / "s", read_only=True) as reader:
        held = reader.contains(torch.tensor([0, 1, 10, 20]))
        assert held.tolist() == [False, True, False, True]


def test_a_full_disk_while_sealing_changes_nothing(tiny_filesystem):
    """A seal whose run cannot be written (no space) raises ENOSPC and leaves the index as it was; it
    seals once space is freed."""
    index = LogIndex(tiny_filesystem, shared_host_kernels(), seal_at=4096)
    keys = torch.arange(4000)
    index.insert(keys, keys * 2)
    filler = tiny_filesystem / "filler"
    with open(filler, "wb", buffering=0) as file:
        try:
            while True:
                file.write(b"\0" * 4096)
        except OSError as error:
            assert error.errno == errno.ENOSPC
    with pytest.raises(OSError) as raised:
        index.make_room(200)
    assert raised.value.errno == errno.ENOSPC
    assert not index.runs and index.table.live == 4000
    assert torch.equal(index.find(keys), keys * 2)
    filler.unlink()
    index.make_room(200)
    index.settle()
    assert len(index.runs) == 1 and index.table.live == 0
    assert torch.equal(index.find(keys), keys * 2)
    index.close()


def test_a_staged_log_reads_back_what_it_was_given_a_chunk_at_a_time(tmp_path, monkeypatch):
    """``StagedLog``: parts appended (empty ones too: a chunk of the log whose keys all have later
    records) come back in order, ``LOG_CHUNK`` keys at a time, with the count of new rows."""
    monkeypatch.setattr(log_index, "LOG_CHUNK", 3)
    log = log_index.StagedLog(tmp_path)
    empty = torch.empty(0, dtype=torch.int64)
    log.append(empty, empty, empty)
    log.append(torch.tensor([5, 9]), torch.tensor([0, -3]), torch.tensor([-1, -1]))  # new; removal
    log.append(empty, empty, empty)
    log.append(torch.tensor([2, 7, 4]), torch.tensor([2, 3, 4]), torch.tensor([10, -1, 11]))
    log.written()
    chunks = list(log.chunks())
    assert [len(keys) for keys, _, _ in chunks] == [3, 2] and log.new_rows == 2
    assert torch.cat([keys for keys, _, _ in chunks]).tolist() == [5, 9, 2, 7, 4]
    assert torch.cat([values for _, values, _ in chunks]).tolist() == [0, -3, 2, 3, 4]
    assert torch.cat([rows for _, _, rows in chunks]).tolist() == [-1, -1, 10, -1, 11]
    assert list(log.record_chunks(7)) == [(0, 3), (3, 6), (6, 7)]
    log.close()


class SealingLogAgainstDict(StoreAgainstDict):
    """The mmap store on the native path, its log index sealing every few keys (runs merged a few
    entries at a time) and its flushes applying the log two keys at a time: reads, staging,
    write-back, removal, flush, crash and reopening see the runs and the chunks."""

    backend = "mmap"
    host_cache, device_cache = 4, 0

    def __init__(self):
        self._saved = log_index.SEAL_AT, sealed_runs.MERGE_CHUNK, log_index.LOG_CHUNK
        log_index.SEAL_AT, sealed_runs.MERGE_CHUNK, log_index.LOG_CHUNK = 3, 2, 2
        super().__init__()

    def teardown(self):
        try:
            super().teardown()
        finally:
            log_index.SEAL_AT, sealed_runs.MERGE_CHUNK, log_index.LOG_CHUNK = self._saved


class SealingLogTorchTierAgainstDict(SealingLogAgainstDict):
    """The same under a torch host tier and device tier (the store's own reads and staging)."""

    host_cache_backend = "torch"
    host_cache, device_cache = 4, 6


class SealingLmdbLogAgainstDict(SealingLogAgainstDict):
    """The LMDB store, its staging log's index sealing every few keys (and a put or removal of more
    committed a few keys at a time)."""

    backend = "lmdb"
    host_cache, device_cache = 4, 6


TestSealingLogAgainstDict = SealingLogAgainstDict.TestCase
TestSealingLogTorchTierAgainstDict = SealingLogTorchTierAgainstDict.TestCase
TestSealingLmdbLogAgainstDict = SealingLmdbLogAgainstDict.TestCase
for case in (TestSealingLogAgainstDict, TestSealingLogTorchTierAgainstDict, TestSealingLmdbLogAgainstDict):
    case.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)  # no clock
del case  # else pytest collects it again under this name


STAGE_SCRIPT = """
import sys, torch
from tierstore import TieredStore
path, count, backend = sys.argv[1], int(sys.argv[2]), sys.argv[3]
store = TieredStore(path, dim=4, backend=backend, host_cache=1024)
for start in range(0, count, 100_000):
    keys = torch.arange(start, start + 100_000) * 3
    store.put(keys, keys[:, None].float().expand(-1, 4))
probe = torch.tensor([0, 3 * (count // 2), 3 * (count - 1)])
assert torch.equal(store.get(probe)[:, 0], probe.float())
"""


@pytest.mark.skipif(cgroup_problem() is not None, reason=str(cgroup_problem()))
@pytest.mark.parametrize("backend", ["mmap", "lmdb"])
def test_staging_millions_of_rows_runs_under_a_memory_limit(tmp_path, backend):
    """4M rows staged without a flush, in a cgroup 128 MiB above what importing takes: the log index
    alone, kept whole in RAM, would take 256 MiB or more (the process was killed before runs were
    sealed). While a seal runs beside the puts, its frozen table and its sort's buffers are held
    too (about 24 MiB: with seals in the staging thread, 96 MiB sufficed)."""
    baseline = peak_in_cgroup(tmp_path, "import torch, tierstore", 1 << 40)
    limit = baseline + (128 << 20)
    assert peak_in_cgroup(tmp_path, STAGE_SCRIPT, limit, str(tmp_path / "s"), "4000000", backend) <= limit
