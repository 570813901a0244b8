"""The mmap cold store's log pages made ahead of its appends on a thread (``PagesAhead``): training
with them is bit for bit training without them (their zeros never meet a record), they are in the
page cache and read as zeros once made, a write reaching the range being made waits for it, a flush
starts them again from the log's start, and a process ending while they are made exits cleanly."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
from test_direct_admission import _resident_pages

from tierstore import TieredEmbeddingBag, TieredStore, optim
from tierstore.kernels.step_passes import host_passes
from tierstore.tiers.cold import pages_ahead
from tierstore.tiers.cold.mmap_files import GrowableArray
from tierstore.tiers.cold.pages_ahead import PagesAhead

pytestmark = pytest.mark.skipif(host_passes() is None, reason="the tuned host build cannot be built here")

DIM = 64  # rows of 256 bytes and more: a step's dirty victims fill many pages


def _train(path, made_ahead: bool, jobs: dict) -> tuple[list, torch.Tensor]:
    """30 steps over 60,000 ids with a host cache of 1,024 rows (hundreds of dirty victims a step),
    a flush after the 10th and the 20th; ``jobs``: for each of the log's files (rows, keys), each
    range made ahead with the end of the log's records when it started. Returns the outputs and
    every row with its state, read back after a reopen."""
    table = TieredEmbeddingBag(
        None, DIM, path=path, backend="mmap", optimizer=optim.Adagrad(lr=0.1), host_cache=1024
    )
    cold = table.store.stack.cold
    logs = {"rows": cold._wal_rows, "keys": cold._wal_keys}
    for name, log in logs.items():
        if not made_ahead:
            log.pages_ahead = None
            continue
        item, ahead, made = log.width * log.dtype.itemsize, log.pages_ahead, jobs.setdefault(name, [])
        start, make = ahead.start, ahead._make
        ahead.start = lambda fd, first, end, item=item, made=made, start=start: (
            made.append((first, end, cold._wal_count * item)) or start(fd, first, end)
        )
        # slow enough that the next steps' appends reach the range while it is made (they wait)
        ahead._make = lambda *range_, make=make: (time.sleep(0.02), make(*range_))
    generator = torch.Generator().manual_seed(4)
    outputs = []
    for step in range(30):
        ids = torch.randint(0, 60_000, (1024,), generator=generator)
        out = table(ids, torch.arange(0, 1024, 4))
        (out * torch.randn(out.shape, generator=generator)).sum().backward()
        outputs.append(out.detach())
        if step in (9, 19):
            table.store.flush()
            for log in logs.values():  # the log's blocks freed: made again from its start
                assert log.prepared == 0 and log.made_through == 0
    for name, log in logs.items() if made_ahead else ():  # the last range: in the page cache, zeros
        log.pages_ahead.wait()
        item = log.width * log.dtype.itemsize
        first, end, written = jobs[name][-1]
        assert written <= first and all(_resident_pages(log.address, first, end))
        assert not log.array[first // item : end // item].any()
    table.close()
    store = TieredStore(path)
    rows = store.get(torch.arange(60_000), with_state=True)
    store.close()
    return outputs, rows


def test_training_with_the_logs_pages_made_ahead_is_training_without(tmp_path, monkeypatch):
    monkeypatch.setattr(pages_ahead, "MIN_AHEAD", 1 << 14)  # ranges within a small log's blocks
    jobs: dict = {}
    with_pages, without = _train(tmp_path / "ahead", True, jobs), _train(tmp_path / "plain", False, {})
    for made in jobs.values():
        assert len(made) >= 3 and all(written <= first < end for first, end, written in made)
    assert all(torch.equal(a, b) for a, b in zip(with_pages[0], without[0]))
    assert torch.equal(with_pages[1], without[1])


def test_a_write_reaching_the_pages_being_made_waits_for_them(tmp_path):
    array = GrowableArray(tmp_path / "log.bin", 64, np.uint8, read_only=False)
    array.reserve(1024)  # 64 KiB of blocks
    go, made = threading.Event(), []

    def make(descriptor, first, end):
        go.wait()
        os.pwrite(descriptor, bytes(end - first), first)
        made.append((first, end))

    array.pages_ahead = PagesAhead(make)
    array.make_pages_ahead(8192, 32768)  # bytes 8,192 to 40,960
    assert array.pages_ahead.running and array.made_through == 40960 and array.prepared == 0
    array.make_pages_ahead(8192, 32768)  # one range at a time
    array.reserve(100)  # items below byte 8,192: no wait
    assert not made
    writer = threading.Thread(target=array.reserve, args=(200,))  # up to byte 12,800: waits
    writer.start()
    try:
        writer.join(0.2)
        assert writer.is_alive() and not made
    finally:
        go.set()
        writer.join()
    assert made == [(8192, 40960)] and array.prepared == 40960
    array.make_pages_ahead(12800, 32768)  # half of it made past byte 12,800: nothing more
    assert not array.pages_ahead.running
    array.release()
    assert array.prepared == 0 and array.made_through == 0
    array.close()


def test_a_process_ending_while_pages_are_made_exits_cleanly(tmp_path):
    script = textwrap.dedent(
        f"""
        import time, torch
        from tierstore import TieredEmbeddingBag, optim
        from tierstore.tiers.cold import pages_ahead
        pages_ahead.MIN_AHEAD = 1 << 16
        table = TieredEmbeddingBag(None, {DIM}, path={str(tmp_path / "t")!r}, backend="mmap",
                                   optimizer=optim.SGD(lr=0.1), host_cache=1024)
        log = table.store.stack.cold._wal_rows
        make = log.pages_ahead._make
        log.pages_ahead._make = lambda *a: (time.sleep(0.5), make(*a), print("made", flush=True))
        for _ in range(20):
            table(torch.randint(0, 60_000, (1024,)), torch.arange(0, 1024, 4)).sum().backward()
        assert log.pages_ahead.running
        print("ending", flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == ["ending", "made"]  # the exit waited for the range


def test_every_range_is_made_on_one_kept_thread_and_a_forked_child_gets_its_own(tmp_path):
    threads, go = [], threading.Event()

    def make(descriptor, first, end):
        go.wait()
        os.pwrite(descriptor, bytes(end - first), first)
        threads.append(threading.current_thread())

    arrays = [GrowableArray(tmp_path / f"log{i}.bin", 64, np.uint8, read_only=False) for i in range(2)]
    for array in arrays:
        array.reserve(4096)
        array.pages_ahead = PagesAhead(make)
    go.set()
    for written in (0, 65536, 131072):
        for array in arrays:
            array.make_pages_ahead(written, 32768)
            array.pages_ahead.wait()
    assert len(threads) == 6 and all(thread is threads[0] for thread in threads)
    assert threads[0] is not threading.current_thread()
    go.clear()
    arrays[0].make_pages_ahead(196608, 32768)  # held: still being made when the process forks
    child = os.fork()
    if child == 0:  # the parent's range has no thread here: not waited for; a new range is made
        code = 1
        try:
            if arrays[0].pages_ahead.running or arrays[0].made_through != arrays[0].prepared:
                code = 3  # the parent's range counted as being made here
                raise RuntimeError
            arrays[0].reserve(4096)
            go.set()
            arrays[1].make_pages_ahead(196608, 32768)
            arrays[1].pages_ahead.wait()
            own_worker = threads[-1] not in (threads[0], threading.current_thread())
            code = 0 if len(threads) == 7 and own_worker else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while (ended := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if ended[0] == 0:
        os.kill(child, 9)
        os.waitpid(child, 0)
    go.set()
    arrays[0].pages_ahead.wait()
    assert ended[0] == child and os.waitstatus_to_exitcode(ended[1]) == 0
    assert len(threads) == 7  # the parent's held range, made here
    for array in arrays:
        array.close()
