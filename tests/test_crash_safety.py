"""Invariant 3 under SIGKILL: a writer is killed at random moments; every reopen must hold exactly the
state of one completed flush, no older than the last flush the writer reported (the ids it removed
gone). With "small" caches a round is mostly puts that evict and stage rows; with "large" caches
30-60% of a round is inside flush, so kills land there too. Both backends guarantee this (LMDB by
its transactions, mmap by its write-ahead log; see tierstore/tiers/cold/mmap_store.py)."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import crash_expiring
import crash_trainer
import crash_writer
import pytest
import torch

from tierstore import TieredStore

TRIALS = int(os.environ.get("TIERSTORE_CRASH_TRIALS", "10"))


def expected_state(last_round: int) -> dict:
    """id -> value after rounds 0..last_round."""
    state = {}
    for round_ in range(last_round + 1):
        state.update(dict.fromkeys(crash_writer.round_ids(round_).tolist(), float(round_)))
        for removed in crash_writer.removed_ids(round_).tolist():
            state.pop(removed, None)
    return state


def run_writer_and_kill(
    path: Path, backend: str, config: str, rng: random.Random, script=crash_writer
) -> int:
    """Start the writer (``script``: ``crash_writer``, or ``crash_trainer``, which takes the path and
    its dtype as ``config``)
    and SIGKILL it at a random point of a random round: after it reports 1 to 3
    completed rounds, a random share (0 to 1.2) of the last round's own duration later. The schedule
    follows the writer's progress, not the clock, so a slow or busy machine kills in as many
    different rounds as a fast one. Returns the last round it reported."""
    arguments = [backend, config] if script is crash_writer else [config]
    writer = subprocess.Popen(
        [sys.executable, script.__file__, str(path), *arguments],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert writer.stdout.readline().strip() == "ready"
    started, reported = time.monotonic(), []
    for _ in range(rng.randint(1, 3)):
        line = writer.stdout.readline().strip()
        assert line, "the writer stopped before it was killed"
        reported.append(int(line))
        finished = time.monotonic()
        round_seconds, started = finished - started, finished
    time.sleep(rng.uniform(0.0, 1.2) * round_seconds)
    writer.send_signal(signal.SIGKILL)
    reported += [int(line) for line in writer.stdout.read().split()]
    writer.wait()
    return reported[-1]


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(crash_writer.CONFIGS))
def test_invariant3_reopen_after_sigkill_holds_exactly_the_last_completed_flush(backend, config, tmp_path):
    rng = random.Random(1234)
    path = tmp_path / "store"
    last_reported, rounds_seen = -1, set()
    for _ in range(TRIALS):
        reported = run_writer_and_kill(path, backend, config, rng)
        last_reported = max(last_reported, reported)
        with TieredStore(path, host_cache=4096) as store:
            durable = (
                int(store.get([crash_writer.MARKER])[0, 0].item()) if crash_writer.MARKER in store else -1
            )
            assert durable >= last_reported, "a reported flush was lost"
            rounds_seen.add(durable)
            state = expected_state(durable)
            stored = {}
            for ids, rows in store.iter_rows():
                assert bool((rows == rows[:, :1]).all()), "a torn row"
                stored.update(zip(ids.tolist(), rows[:, 0].tolist()))
            stored.pop(crash_writer.MARKER, None)
            assert stored == state
            last_reported = durable
    assert len(rounds_seen) == TRIALS, "every trial completes a round, so each reopens at a newer one"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_training_process_killed_reopens_at_the_rows_of_a_completed_flush(tmp_path, dtype):
    """Training evicts dirty rows into the mmap store's log through the native admission at every
    step; killed at random moments, the store reopens with exactly the rows of one completed flush
    (replayed in-process round by round): the last reported one, or the next if the kill came
    between its flush and its report. float16 rows: the native step's 16-bit update and rounding."""
    rng = random.Random(99)
    replay = crash_trainer.open_table(tmp_path / "replay", dtype)
    replayed = [replay.store.get(torch.arange(crash_trainer.IDS), with_state=True, grow=False)]
    ids = torch.arange(crash_trainer.IDS)
    for trial in range(max(TRIALS // 3, 2)):
        path = tmp_path / f"trial{trial}"
        reported = run_writer_and_kill(path, "mmap", dtype, rng, script=crash_trainer)
        while len(replayed) < reported + 3:  # rows after 0, 1, 2, ... completed rounds
            crash_trainer.train_round(replay, len(replayed) - 1)
            replayed.append(replay.store.get(ids, with_state=True, grow=False))
        with TieredStore(path, read_only=True, host_cache=4096) as store:
            rows = store.get(ids, with_state=True, grow=False)
        same = [
            torch.equal(rows.view(torch.uint8), replayed[r].view(torch.uint8))
            for r in (reported + 1, reported + 2)
        ]
        assert any(same), (
            f"trial {trial}: the reopened rows are those of no completed flush at or after round {reported}"
        )
    replay.close()


@pytest.mark.slow
def test_an_expiring_table_killed_keeps_every_id_within_its_ttl(backend, tmp_path):
    """A table with ``ttl`` killed at random moments (among them between the commit of its ids'
    records and the flush of their rows, and inside the removals' commit) reopens sound, holding
    every id updated within ``ttl`` steps of the flush it holds: a kill never makes an id go early."""
    rng = random.Random(5)
    path = tmp_path / "store"
    for trial in range(max(TRIALS // 2, 2)):
        reported = run_writer_and_kill(path, backend, backend, rng, script=crash_expiring)
        with TieredStore(path, host_cache=4096, ttl=crash_expiring.TTL) as store:
            assert store.structure_problems() == []
            durable = int(store.get([crash_expiring.MARKER])[0, 0].item())
            assert durable >= reported
            recent = torch.cat(
                [
                    crash_expiring.round_ids(r)
                    for r in range(durable - crash_expiring.TTL + 1, durable + 1)
                    if r >= 0
                ]
            )
            assert bool(store.contains(recent).all()), f"trial {trial}: an id went before its ttl"
            oldest = durable - crash_expiring.TTL - 1 - trial  # a kill may delay an expiry by a round
            if oldest >= 0:
                assert not bool(store.contains(crash_expiring.round_ids(oldest)).any())
            store.release_unflushed()


INTERRUPTED_FLUSH = """
import os, signal, sys, torch
sys.path.insert(0, sys.argv[2])
from test_crash_safety import interrupted_table, train_steps
from tierstore.tiers.cold import mmap_files
table = interrupted_table(sys.argv[1])
train_steps(table, 20)
libc = mmap_files._LIBC


class InterruptedOnce:  # Ctrl-C once the flush has freed the applied log's rows
    def __getattr__(self, name):
        return getattr(libc, name)

    def fallocate(self, *arguments):
        mmap_files._LIBC = libc
        result = libc.fallocate(*arguments)
        os.kill(os.getpid(), signal.SIGINT)
        return result


mmap_files._LIBC = InterruptedOnce()
try:
    table.flush()
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted")
table.flush()  # what a program's handler does: flush and close
table.close()
"""


def interrupted_table(path):
    from tierstore import TieredEmbeddingBag, optim

    return TieredEmbeddingBag(
        5000, 8, mode="sum", path=path, host_cache=1500, optimizer=optim.Adagrad(lr=0.1), backend="mmap"
    )


def train_steps(table, steps: int) -> None:
    """``steps`` steps of 64 bags of 4 ids, a flush every 7."""
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        table(torch.randint(0, 5000, (64, 4), generator=generator)).pow(2).sum().backward()
        if step % 7 == 6:
            table.flush()


def test_ctrl_c_during_a_flush_comes_once_the_flush_is_done_and_the_store_stays_whole(tmp_path):
    """A KeyboardInterrupt raised between two steps of a flush (the log applied and its rows'
    blocks freed, its records not yet forgotten) left the log half reset; the handler's flush
    applied it again, its rows now zeros, and the store reopened damaged. The store holds Ctrl-C
    off until the flush returns."""
    script = [sys.executable, "-c", INTERRUPTED_FLUSH, str(tmp_path / "store"), str(Path(__file__).parent)]
    result = subprocess.run(script, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "interrupted"  # held off, not lost
    expected = interrupted_table(tmp_path / "expected")
    train_steps(expected, 20)
    reopened = interrupted_table(tmp_path / "store")
    ids = torch.arange(5000)
    rows = reopened.store.get(ids, with_state=True, grow=False)  # a damaged row raises here
    assert torch.equal(rows, expected.store.get(ids, with_state=True, grow=False))
    for table in (expected, reopened):
        table.close()


OWN_HANDLER = """
import signal, tierstore
def mine(signum, frame):
    pass
signal.signal(signal.SIGINT, mine)
store = tierstore.TieredStore(None, dim=2, host_cache=8)
print(signal.getsignal(signal.SIGINT) is mine)
"""


def test_a_programs_own_ctrl_c_handler_is_left_alone():
    result = subprocess.run([sys.executable, "-c", OWN_HANDLER], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "True"


TWICE_DURING_A_CALL = """
import os, signal, sys, tierstore
store = tierstore.TieredStore(None, dim=2, host_cache=8)
stats = type(store).stats.__wrapped__


def long_call(self):  # a store method that takes a while; Ctrl-C comes twice meanwhile
    for _ in range(int(sys.argv[1])):
        os.kill(os.getpid(), signal.SIGINT)
    print("finished", flush=True)
    return stats(self)


type(store).stats = tierstore.locking.serialized(long_call)
try:
    store.stats()
except KeyboardInterrupt:
    print("interrupted")
"""


@pytest.mark.parametrize("presses, printed", [(1, "finished\ninterrupted"), (2, "interrupted")])
def test_one_ctrl_c_waits_for_the_store_method_and_a_second_one_does_not(presses, printed):
    arguments = [sys.executable, "-c", TWICE_DURING_A_CALL, str(presses)]
    result = subprocess.run(arguments, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == printed
