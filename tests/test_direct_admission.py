"""A batch made resident in a host tier straight from the mmap cold store in one native call
(``ColdStore.make_resident_in``, ``step_make_resident``) against the path it replaces (the tier's
``resolve`` and ``admit``, the cold store's ``get`` and ``put``): the same rows, slots, scores, pins,
counters and files, bit for bit, a lookahead window's pins and a refused batch included; and the
failure modes of the call (a damaged row, a full disk) change nothing."""

import ctypes
import json
import mmap
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import same_bytes

from tierstore import TieredEmbeddingBag, TieredStore, optim
from tierstore.errors import CacheCapacityError, StoreFormatError
from tierstore.kernels.native_types import Residency
from tierstore.kernels.step_passes import StepPasses
from tierstore.tiers.cold import mmap_store

DIM = 6


def _train(path, direct: bool, optimizer, steps: int = 40, flush_every: int = 7, one_call: bool = True):
    """A small host tier over the mmap store trained on skewed batches with a flush every few steps,
    a reader open for some of them: rows are evicted dirty and clean, staged anew, staged again
    since the flush (rewritten in place) and superseding committed records of the log. ``direct``:
    the admission straight from the cold store, in the lookup's one native call (``one_call``) or in
    its own (the dedupe and the pooled read beside it). Returns the outputs and the table."""
    table = TieredEmbeddingBag(None, DIM, path=path, backend="mmap", optimizer=optimizer, host_cache=64)
    cold = table.store.stack.cold
    admitted = []
    if direct and one_call:
        lookup_bags_in = cold.lookup_bags_in
        cold.lookup_bags_in = lambda *a: admitted.append(a[1].numel()) or lookup_bags_in(*a)
    elif direct:
        table.store.stack.lookup_bags = lambda *a: None
        make_resident_in = cold.make_resident_in
        cold.make_resident_in = lambda *a: admitted.append(a[1].numel()) or make_resident_in(*a)
    else:
        cold.admits_into = lambda tier: False
    generator = torch.Generator().manual_seed(5)
    outputs, reader = [], None
    for step in range(steps):
        if step == 10:  # an open reader keeps flushes from applying the log: staged rows then
            reader = TieredStore(path, read_only=True)  # supersede committed records
        if step == 30:
            reader.close()
        ids = (torch.rand(60, generator=generator) ** 3 * 150).to(torch.int64)  # a skewed 150 ids
        offsets = torch.arange(0, 60, 4)
        out = table(ids, offsets)
        (out * torch.randn(out.shape, generator=generator)).sum().backward()
        outputs.append(out.detach())
        if step % flush_every == flush_every - 1:
            table.store.flush()
    assert cold.deferred_applies >= 2
    if direct:
        assert sum(admitted) > 200, "the direct admission was not the path taken"
    return outputs, table


def _counters(table) -> dict:
    report = table.store.stats()
    return {tier: {k: v for k, v in report[tier].items() if isinstance(v, int)} for tier in ("host", "cold")}


@pytest.mark.parametrize("one_call", [True, False], ids=["in the lookup's call", "in its own call"])
@pytest.mark.parametrize("optimizer", [optim.SGD(lr=0.1), optim.Adagrad(lr=0.1)], ids=["sgd", "adagrad"])
def test_the_direct_admission_leaves_what_the_tiers_own_path_leaves(tmp_path, optimizer, one_call):
    direct_outputs, direct = _train(tmp_path / "direct", True, optimizer, one_call=one_call)
    reference_outputs, reference = _train(tmp_path / "reference", False, optimizer)
    for got, expected in zip(direct_outputs, reference_outputs):
        assert torch.equal(got, expected)
    top, reference_top = direct.store.stack.top, reference.store.stack.top
    for name in ("slot_keys", "rows", "dirty", "fresh", "pins"):
        assert torch.equal(getattr(top, name), getattr(reference_top, name)), name
    assert torch.equal(top.policy.score, reference_top.policy.score)
    assert torch.equal(top.index.keys, reference_top.index.keys)
    assert _counters(direct) == _counters(reference)
    cold, reference_cold = direct.store.stack.cold, reference.store.stack.cold
    assert cold._wal_count == reference_cold._wal_count > 0
    for name in ("_wal_rows", "_wal_keys"):
        count = cold._wal_count
        assert (getattr(cold, name).array[:count] == getattr(reference_cold, name).array[:count]).all(), name
    ids = torch.arange(160)
    rows = direct.store.get(ids, with_state=True)
    assert torch.equal(rows, reference.store.get(ids, with_state=True))
    direct.close()
    reference.close()
    with TieredStore(tmp_path / "direct", read_only=True) as reopened:
        assert torch.equal(reopened.get(ids, with_state=True), rows)


def _tier_state(table) -> dict:
    top = table.store.stack.top
    state = {name: getattr(top, name).clone() for name in ("slot_keys", "rows", "dirty", "fresh", "pins")}
    state["score"] = top.policy.score.clone()
    state["pool"] = top.policy._pool.clone()
    state["host"] = _counters(table)["host"]
    return state


def _assert_same_tiers(direct, reference) -> None:
    got, expected = _tier_state(direct), _tier_state(reference)
    for name, value in expected.items():
        same = value == got[name] if isinstance(value, dict) else torch.equal(got[name], value)
        assert same, name


def test_pinned_rows_and_a_refused_batch_leave_what_the_tiers_own_path_leaves(tmp_path):
    """Rows a lookahead window pins (moved up through the same native call, the resident ones kept)
    are never victims, and a batch needing more slots than are evictable is refused with the tier's
    error: the tier (slots, rows, flags, pins, scores, LFU's pool, counters) as the tiers' own path
    leaves it, before and after the refusal."""
    tables, calls = [], []
    for name, direct in (("direct", True), ("reference", False)):
        table = TieredEmbeddingBag(None, DIM, path=tmp_path / name, backend="mmap", host_cache=16)
        cold = table.store.stack.cold
        if direct:
            make_resident_in = cold.make_resident_in
            cold.make_resident_in = lambda *a, call=make_resident_in: calls.append(a[3]) or call(*a)
        else:
            cold.admits_into = lambda tier: False
        tables.append(table)
    generator = torch.Generator().manual_seed(2)
    batches = [(torch.rand(12, generator=generator) ** 2 * 40).to(torch.int64) for _ in range(12)]
    for table in tables:
        for ids in batches:
            table(ids, torch.arange(0, 12, 4)).sum().backward()
        table.store.flush()
    _assert_same_tiers(*tables)
    top = tables[0].store.stack.top
    held = top.slot_keys >= 0
    coldest = top.slot_keys[held][top.policy.score[held].argsort()[:4]]  # the next victims, if unpinned
    absent = torch.tensor(
        [key for key in torch.cat(batches).unique().tolist() if key not in top.slot_keys][:6]
    )
    pinned = torch.cat([coldest, absent])
    pins = [table.store.pin_rows(pinned) for table in tables]
    assert pins[0][2] == pins[1][2] == 6  # moved up, the resident ones kept
    assert calls[-1] is not None and calls[-1].numel() == 4  # through the native call, protecting them
    _assert_same_tiers(*tables)
    assert set(pinned.tolist()) <= set(top.slot_keys.tolist())
    errors = []
    for table in tables:  # 10 pinned in 16 slots: 8 new ids do not fit
        with pytest.raises(CacheCapacityError, match=r"10 pinned by a lookahead window") as raised:
            table(torch.arange(100, 108), torch.tensor([0]))
        errors.append(str(raised.value))
    assert errors[0] == errors[1]
    _assert_same_tiers(*tables)
    outputs = [table(torch.arange(200, 205), torch.tensor([0, 2])) for table in tables]
    assert torch.equal(outputs[0], outputs[1])
    _assert_same_tiers(*tables)
    resident = top.slot_keys.tolist()
    assert set(pinned.tolist()) <= set(resident) and set(range(200, 205)) <= set(resident)
    for table, (keys, slots, _) in zip(tables, pins):
        table.store.unpin_rows(keys, slots)
        table(torch.arange(300, 312), torch.tensor([0, 6])).sum().backward()
    _assert_same_tiers(*tables)
    for table in tables:
        table.close()


@pytest.mark.parametrize(
    "batch", ["all hits", "misses into free slots", "misses evicting"], ids=lambda batch: batch
)
def test_a_native_lookup_leaves_no_pin_behind(tmp_path, batch):
    """The one native call pins a batch's hits while it chooses victims (as it finds them, where the
    batch has more keys than the tier has free slots) and unpins them whatever it then does."""
    table = TieredEmbeddingBag(None, DIM, path=tmp_path / "s", backend="mmap", host_cache=8)
    top = table.store.stack.top
    calls = []
    lookup_bags_in = table.store.stack.cold.lookup_bags_in
    table.store.stack.cold.lookup_bags_in = lambda *a: calls.append(1) or lookup_bags_in(*a)
    first = torch.arange(6) if batch == "misses into free slots" else torch.arange(8)
    table(first, torch.arange(0, first.numel(), 2)).sum().backward()  # resident, the tier full or not
    ids = {"all hits": torch.tensor([1, 2, 5, 7]), "misses into free slots": torch.tensor([0, 1, 6, 7])}
    ids = ids.get(batch, torch.tensor([1, 2, 8, 9]))  # two hits, two victims
    table(ids, torch.tensor([0, 2])).sum().backward()
    assert len(calls) == 2, "the native call was not the path taken"
    assert top.stats.evictions == (2 if batch == "misses evicting" else 0)
    assert int(top.pins.sum()) == 0
    table.close()


def test_a_damaged_row_refuses_the_admission_and_changes_nothing(tmp_path):
    table = TieredEmbeddingBag(None, DIM, path=tmp_path / "s", backend="mmap", host_cache=8)
    table(torch.arange(8), torch.arange(0, 8, 2)).sum().backward()  # rows 0..7: dirty, cached
    table.store.flush()
    table(torch.arange(8, 16), torch.arange(0, 8, 2)).sum().backward()  # 0..7 written back, evicted
    table.store.flush()
    cold = table.store.stack.cold
    stored = cold._rows.array[int(cold._index.find(torch.tensor([3]))[0])]
    stored[0] ^= 0xFF  # row 3's first byte: its check no longer holds
    top = table.store.stack.top
    before = {name: getattr(top, name).clone() for name in ("slot_keys", "rows", "dirty", "pins")}
    log_count, counters = cold._wal_count, _counters(table)
    with pytest.raises(StoreFormatError, match=r"1 stored row\(s\) fail their checksum \(first id: 3\)"):
        table(torch.tensor([1, 3, 5, 9]), torch.tensor([0]))
    for name, value in before.items():
        assert same_bytes(getattr(top, name), value), name
    assert cold._wal_count == log_count
    assert _counters(table)["cold"] == counters["cold"]
    out = table(torch.tensor([1, 5, 9]), torch.tensor([0]))  # the sound rows still come in
    assert out.shape == (1, DIM)
    table.close()


FILL_UNTIL_FULL = textwrap.dedent(
    """
    import json, os, sys, torch
    from tierstore import TieredEmbeddingBag
    ballast = os.path.join(os.path.dirname(sys.argv[1]), "ballast")
    with open(ballast, "wb") as file:  # freed after the error: reading the rows back stages victims
        file.write(b"x" * 256 * 1024)
    table = TieredEmbeddingBag(None, 64, path=sys.argv[1], backend="mmap", host_cache=300)
    cold = table.store.stack.cold
    admitted = []
    make_resident_in, lookup_bags_in = cold.make_resident_in, cold.lookup_bags_in
    cold.make_resident_in = lambda *a: admitted.append(1) or make_resident_in(*a)
    cold.lookup_bags_in = lambda *a: admitted.append(1) or lookup_bags_in(*a)
    error, done = None, 0
    for step in range(100000):  # new ids every step: every victim is dirty and staged in the log
        ids = torch.arange(step * 200, (step + 1) * 200)
        try:
            table(ids, torch.arange(0, 200, 10)).sum().backward()
        except OSError as raised:
            error = raised
            break
        done += 1
    os.unlink(ballast)
    rows = table.store.get(torch.arange(done * 200), with_state=True)
    torch.save(rows, sys.argv[2])
    print(json.dumps({"errno": getattr(error, "errno", None), "steps": done, "direct": len(admitted)}))
    """
)


def test_a_full_disk_fails_the_admission_with_enospc_and_no_row_is_lost(tiny_filesystem, tmp_path):
    """Staging a step's victims fills the disk: the step raises OSError(ENOSPC) before changing any
    row (no SIGBUS), and the table holds exactly the rows of the steps that completed: those of a
    table trained on a roomy disk for as many steps."""
    result = subprocess.run(
        [sys.executable, "-c", FILL_UNTIL_FULL, str(tiny_filesystem / "s"), str(tmp_path / "rows.pt")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr  # no signal
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["errno"] == 28 and report["steps"] >= 3 and report["direct"] > report["steps"], report
    reference = TieredEmbeddingBag(None, 64, path=tmp_path / "reference", backend="mmap", host_cache=300)
    for step in range(report["steps"]):
        reference(torch.arange(step * 200, (step + 1) * 200), torch.arange(0, 200, 10)).sum().backward()
    expected = reference.store.get(torch.arange(report["steps"] * 200), with_state=True)
    assert torch.equal(torch.load(tmp_path / "rows.pt"), expected)
    reference.close()


def test_the_mmap_store_admits_only_into_a_tier_it_can_serve(tmp_path):
    table = TieredEmbeddingBag(None, DIM, path=tmp_path / "s", backend="mmap", host_cache=8)
    cold, top = table.store.stack.cold, table.store.stack.top
    assert cold.admits_into(top)
    assert not cold.admits_into(type("NoArrays", (), {"native_arrays": lambda self: None})())
    table.close()
    with TieredStore(tmp_path / "s", read_only=True, host_cache=8) as reader:
        assert not reader.stack.cold.admits_into(reader.stack.top)
    assert mmap_store.MmapColdStore.admits_into is not None


def test_a_failed_log_write_puts_the_tiers_index_back(tmp_path, monkeypatch):
    """A batch evicting hundreds of dirty rows, whose log writes run beside the tier index's changes
    (two threads), fails to write: OSError, the index as it was, and every row as a table that never
    tried holds it; the next batch goes on."""
    offsets = torch.arange(0, 1024, 4)

    def trained(path):
        table = TieredEmbeddingBag(
            None, DIM, path=path, backend="mmap", optimizer=optim.SGD(lr=0.1), host_cache=1024
        )
        for step in range(3):  # the tier full of dirty rows
            table(torch.arange(step * 400, step * 400 + 1024), offsets).sum().backward()
        return table

    table, reference = trained(tmp_path / "s"), trained(tmp_path / "reference")
    top, cold = table.store.stack.top, table.store.stack.cold
    before = [
        tensor.clone() for tensor in (top.index.keys, top.index.values, top.slot_keys, top.rows, top.dirty)
    ]
    read_only = os.open(cold._wal_rows.path, os.O_RDONLY)
    monkeypatch.setattr(cold._wal_rows, "fileno", lambda: read_only)
    with pytest.raises(OSError):
        table(torch.arange(5000, 6024), offsets)
    os.close(read_only)
    monkeypatch.undo()
    after = (top.index.keys, top.index.values, top.slot_keys, top.rows, top.dirty)
    assert [torch.equal(then, now) for then, now in zip(before[2:], after[2:])] == [True] * 3
    assert _key_to_slot(*after[:2]) == _key_to_slot(*before[:2])  # positions in the table may differ
    for model in (table, reference):
        model(torch.arange(5000, 6024), offsets).sum().backward()
    ids = torch.arange(6100)
    assert torch.equal(table.store.get(ids, with_state=True), reference.store.get(ids, with_state=True))
    table.close()
    reference.close()


def _key_to_slot(keys: torch.Tensor, values: torch.Tensor) -> dict:
    held = keys >= 0
    return dict(zip(keys[held].tolist(), values[held].tolist()))


def _residencies(monkeypatch) -> list:
    """The ``Residency`` of every one-call lookup from now on (in the list returned), as it comes."""
    calls = []
    lookup_bags = StepPasses.lookup_bags

    def kept(*arguments, **keywords):
        result = lookup_bags(*arguments, **keywords)
        calls.append(next(part for part in result if isinstance(part, Residency)))
        return result

    monkeypatch.setattr(StepPasses, "lookup_bags", kept)
    return calls


def test_the_admission_times_its_parts_within_its_own_time(tmp_path, monkeypatch):
    """``step_make_resident``'s own timers: the admission's parts (the stored rows read, the log's
    side and the tier's index on their two threads, the slots filled) run one after another inside
    it, so they add up to no more than its time, whatever the clock's resolution."""
    calls = _residencies(monkeypatch)
    _train(tmp_path / "t", True, optim.SGD(lr=0.1))
    admitted = [done for done in calls if done.status == done.RESIDENT and done.misses]
    assert len(admitted) > 20 and any(done.written_back for done in admitted)
    for done in admitted:
        assert min(done.read_ns, done.log_ns, done.reindex_ns, done.fill_ns) >= 0
        assert done.read_ns + max(done.log_ns, done.reindex_ns) + done.fill_ns <= done.admit_ns


def test_large_admissions_share_their_rewrites_and_leave_what_the_tiers_own_path_leaves(
    tmp_path, monkeypatch
):
    """Batches evicting hundreds of dirty rows (the log's writes beside the tier index's changes, on
    two threads, then the rewrites in place shared by both), many of them staged since the last
    flush: the same outputs and rows, bit for bit, as the tiers' own path."""
    calls = _residencies(monkeypatch)
    results = []
    for direct in (True, False):
        table = TieredEmbeddingBag(
            None,
            DIM,
            path=tmp_path / str(direct),
            backend="mmap",
            optimizer=optim.SGD(lr=0.1),
            host_cache=1024,
        )
        if not direct:
            table.store.stack.cold.admits_into = lambda tier: False
        generator = torch.Generator().manual_seed(9)
        outputs = []
        for step in range(24):
            ids = (torch.rand(1024, generator=generator) ** 2 * 3000).to(torch.int64)
            out = table(ids, torch.arange(0, 1024, 4))
            (out * torch.randn(out.shape, generator=generator)).sum().backward()
            outputs.append(out.detach())
            if step % 8 == 7:
                table.store.flush()
        results.append((outputs, table.store.get(torch.arange(3000), with_state=True)))
        table.close()
    shared = [done for done in calls if done.status == done.RESIDENT and done.victims >= 256]
    assert shared and any(done.written_back > done.appended > 0 for done in shared)  # rewrites and appends
    (direct_outputs, direct_rows), (own_outputs, own_rows) = results
    assert all(torch.equal(a, b) for a, b in zip(direct_outputs, own_outputs))
    assert torch.equal(direct_rows, own_rows)


def _resident_pages(address: int, first: int, end: int) -> list[bool]:
    """Whether each page of bytes [first, end) (whole pages) of the map at ``address`` is in the page
    cache (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = (end - first) // mmap.PAGESIZE
    status = ctypes.create_string_buffer(max(pages, 1))
    assert libc.mincore(address + first, end - first, status) == 0, os.strerror(ctypes.get_errno())
    return [bool(byte & 1) for byte in status.raw[:pages]]


def test_an_admission_makes_the_logs_pages_ahead_of_the_next_appends(tmp_path, monkeypatch):
    """Each native admission writes zeros over the log's whole pages past its own appends, for twice
    their bytes (within the allocated blocks), so the next admission's appends find their pages made:
    those pages are in the page cache and read as zeros, and a flush, which frees the log's blocks,
    starts again from the log's start. (That no record is overwritten: the test above.)"""
    calls = _residencies(monkeypatch)
    table = TieredEmbeddingBag(
        None, DIM, path=tmp_path / "t", backend="mmap", optimizer=optim.SGD(lr=0.1), host_cache=1024
    )
    log = table.store.stack.cold._wal_rows
    log.pages_ahead = None  # the admissions' own pages ahead only (the thread's: test_pages_ahead.py)
    item = log.width * log.dtype.itemsize
    generator = torch.Generator().manual_seed(3)
    checked = 0
    for _ in range(12):
        before = log.prepared
        ids = torch.randint(0, 60_000, (1024,), generator=generator)  # hundreds of dirty victims a batch
        out = table(ids, torch.arange(0, 1024, 4))
        out.sum().backward()
        done = calls[-1]
        appends_end = table.store.stack.cold._wal_count * item
        page = mmap.PAGESIZE
        first = max(before, -(-appends_end // page) * page)  # whole pages past the appends
        wanted = min(log.allocated_bytes, appends_end + 2 * done.appended * item) // page * page
        assert log.prepared == max(first, wanted)
        if done.appended and log.prepared > first:
            assert all(_resident_pages(log.address, first, log.prepared))
            assert not log.array[first // item + 1 : log.prepared // item].any()
            checked += 1
    assert checked >= 5
    table.store.flush()
    assert log.prepared == 0
    table.close()
