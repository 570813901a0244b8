"""Row-wise sharding over gloo processes (``process_group=``), with and without the hot rows
replicated: outputs and final rows equal one process training ``nn.EmbeddingBag`` on the
concatenation of every rank's batch, with caches so small that rows move through every tier."""

import pickle
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from sharded_worker import (
    DIM,
    NUM,
    OPTIMIZERS,
    as_bags,
    dcp_round_trip,
    dead_peer,
    disagree,
    diverged,
    global_batches,
    rank_bags,
    refusals,
    reopen,
    targets,
    train,
)

from tierstore import TieredStore, initial_weights
from tierstore.nn.replication import count_communication

STEPS = 24


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _tensors(value):
    """A rank's saved result with its numpy arrays as tensors again."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, dict):
        return {key: _tensors(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_tensors(item) for item in value)
    return value


def run_ranks(function, world: int, *args, exit_codes=None) -> list[dict | None]:
    """``function(rank, world, port, *args)`` in ``world`` spawned processes (``args[0]``: the folder
    they save in); each rank's saved result (None if it saved none). Every process must end by
    itself within the timeout, with ``exit_codes`` (default all 0), never by a signal."""
    out, port = args[0], free_port()
    context = mp.get_context("spawn")
    processes = [context.Process(target=function, args=(rank, world, port, *args)) for rank in range(world)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=240)
    codes = [process.exitcode for process in processes]
    for process in processes:
        if process.is_alive():
            process.kill()
    assert codes == (exit_codes or [0] * world), f"exit codes {codes} (None: hung)"
    results = []
    for rank in range(world):
        try:
            results.append(_tensors(pickle.loads(Path(f"{out}/rank{rank}.pickle").read_bytes())))
        except FileNotFoundError:
            results.append(None)
    for rank, result in enumerate(results):
        assert result is None or "error" not in result, f"rank {rank} failed:\n{result['error']}"
    return results


def one_process(
    world: int, optimizer: str, empty_step: int = -1, steps: int = STEPS
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``(outputs per step, final rows)`` of ``nn.EmbeddingBag`` trained on the whole batches (at
    ``empty_step``, without the last rank's bags)."""
    bag = torch.nn.EmbeddingBag(NUM, DIM, mode="sum")
    with torch.no_grad():
        bag.weight.copy_(initial_weights(torch.arange(NUM), DIM, 0, torch.float32))
    dense = OPTIMIZERS[optimizer][1](bag.parameters())
    outputs = []
    for step, bags in enumerate(global_batches(world, steps)):
        dense.zero_grad()
        used = [part for rank in range(world) for part in rank_bags(bags, rank, world, step, empty_step)]
        pooled = bag(*as_bags(used))
        (pooled * targets(step, len(bags))[: len(used)]).sum().backward()
        dense.step()
        outputs.append(pooled.detach())
    return outputs, bag.weight.detach()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("replicate", [0, 16])
def test_sharded_training_equals_one_process_on_the_global_batch(tmp_path, world, optimizer, replicate):
    results = run_ranks(train, world, str(tmp_path), optimizer, replicate, STEPS, False)
    outputs, rows = one_process(world, optimizer)
    for rank, result in enumerate(results):
        for step, pooled in enumerate(result["outputs"]):
            expected = outputs[step][rank * len(pooled) : (rank + 1) * len(pooled)]
            torch.testing.assert_close(pooled, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(result["rows"], rows, rtol=0, atol=1e-5)
        assert result["stats"][0]["host"]["evictions"] > 0  # rows went down to the cold store and back
    sent = [result["comm"][0] for result in results]
    assert all(comm["id_bytes"] > 0 and comm["row_bytes"] > 0 and comm["gradient_bytes"] > 0 for comm in sent)
    assert all((comm["replica_bytes"] > 0) == bool(replicate) for comm in sent)
    # the performance model counts, without running, the bytes each rank sent
    steps = [
        [as_bags(rank_bags(bags, rank, world, step, -1))[0].numpy() for rank in range(world)]
        for step, bags in enumerate(global_batches(world, STEPS))
    ]
    counted = count_communication(steps, DIM, np.arange(replicate))
    for rank, comm in enumerate(sent):
        assert (
            counted["all_to_all"][:, rank].sum()
            == comm["id_bytes"] + comm["row_bytes"] + comm["gradient_bytes"]
        )
        assert counted["replicas"][:, rank].sum() == comm["replica_bytes"]


def test_a_sharded_collection_replicating_its_hottest_rows_equals_one_process(tmp_path):
    results = run_ranks(train, 2, str(tmp_path), "adagrad", 16, STEPS, True)
    outputs, rows = one_process(2, "adagrad")
    for rank, result in enumerate(results):
        for step, pooled in enumerate(result["outputs"]):
            expected = outputs[step][rank * len(pooled) : (rank + 1) * len(pooled)]
            torch.testing.assert_close(pooled, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(result["rows"], rows, rtol=0, atol=1e-5)
        assert result["comm"][0]["replica_bytes"] > 0


def test_a_rank_with_an_empty_batch_still_serves_the_others(tmp_path):
    results = run_ranks(train, 2, str(tmp_path), "sgd", 16, 6, False, True)
    outputs, rows = one_process(2, "sgd", empty_step=3, steps=6)
    assert results[1]["outputs"][3].shape == (0, DIM)
    for result in results:
        torch.testing.assert_close(result["rows"], rows, rtol=0, atol=1e-5)
    torch.testing.assert_close(results[0]["outputs"][3], outputs[3], rtol=0, atol=1e-5)


def test_ranks_that_build_different_tables_all_raise(tmp_path):
    results = run_ranks(disagree, 2, str(tmp_path))
    for rank, result in enumerate(results):
        assert result["raised"].startswith("ShardingError")
        assert f"ranks [{1 - rank}] have other table settings" in result["raised"]


def test_a_refused_input_or_a_mode_mismatch_raises_on_every_rank_and_training_goes_on(tmp_path):
    results = run_ranks(refusals, 3, str(tmp_path))
    for rank, result in enumerate(results):
        assert result["step0"] is None and result["after"] is None  # before and after: steps run
        if rank == 2:
            assert result["refused"].startswith("NegativeIdError: input must be non-negative")
        else:
            assert (
                result["refused"]
                == f"ShardingError: rank {rank}: rank(s) [2] refused their input, so no rank ran this step"
            )
        assert (
            result["modes"].startswith("ShardingError") and "call train() or eval() alike" in result["modes"]
        )
        if rank == 2:
            assert result["store_failed"] == "OSError: the disk is gone"
        else:
            assert result["store_failed"] == (
                f"ShardingError: rank {rank}: the lookup of the rows a rank serves failed on rank(s) [2], "
                "so it is not complete"
            )
        assert result["after_failure"] is None
        assert "does not pickle" in result["pickled"]
        assert result["prefetch"].startswith("NotImplementedError: tierstore.prefetch does not run a sharded")
    reopened = run_ranks(reopen, 2, str(tmp_path))
    for result in reopened:
        assert "sharded over 3 ranks, and this process group has 2: open it with 3 ranks" in result["raised"]


def test_a_dead_rank_makes_the_others_raise_and_their_stores_hold_the_last_flush(tmp_path):
    results = run_ranks(dead_peer, 2, str(tmp_path), exit_codes=[0, 3])
    assert results[0]["raised"].startswith("ShardingError: rank 0: the process group failed")
    with TieredStore(tmp_path / "table" / "rank0-of-2", read_only=True) as store:
        ids, rows = next(store.iter_rows(batch_size=1 << 20))
    assert {int(i): row for i, row in zip(ids, rows)}.keys() == results[0]["flushed"].keys()
    for i, row in zip(ids.tolist(), rows):
        torch.testing.assert_close(row, results[0]["flushed"][i], rtol=0, atol=0)


def test_a_rank_dying_in_a_collective_flush_is_named_when_the_table_reopens(tmp_path):
    results = run_ranks(dead_peer, 2, str(tmp_path), True, exit_codes=[0, 3])
    assert results[0]["raised"].startswith("ShardingError: rank 0: the process group failed")
    for result in run_ranks(reopen, 2, str(tmp_path)):
        assert "the collective flush of step 3 did not complete on every rank" in result["raised"]


@pytest.mark.parametrize("collection", [False, True])
def test_auto_replication_plans_from_rank_zeros_batches_and_training_stays_exact(tmp_path, collection):
    results = run_ranks(train, 2, str(tmp_path), "adagrad", "auto", 8, collection)
    outputs, rows = one_process(2, "adagrad", steps=8)
    for result in results:
        torch.testing.assert_close(result["rows"], rows, rtol=0, atol=1e-5)
    (replicated, plan), (other, _) = results[0]["plan"][0], results[1]["plan"][0]
    assert torch.equal(replicated, other)  # every rank took rank 0's choice
    best = min(plan, key=lambda candidate: candidate["seconds_per_step"])
    assert replicated.numel() == best["rows"] and plan[0]["rows"] == 0
    assert max(candidate["rows"] for candidate in plan) <= 32 // 2  # half the top tier at most
    # rank 0's hottest ids come first: a replicated id is looked up there at least as often as any other
    keys = np.concatenate(
        [
            as_bags(rank_bags(bags, 0, 2, step, -1))[0].numpy()
            for step, bags in enumerate(global_batches(2, 8))
        ]
    )
    counts = np.bincount(keys, minlength=NUM)
    if replicated.numel():
        assert counts[replicated.numpy()].min() >= np.delete(counts, replicated.numpy()).max()


def test_the_replica_checksum_names_a_rank_whose_replica_differs(tmp_path):
    for result in run_ranks(diverged, 2, str(tmp_path)):
        assert result["before"] is None
        assert result["after"] == "ShardingError: the replicated rows of ranks [1] differ from rank 0's"


def test_each_rank_saves_and_loads_its_shard_through_torch_distributed_checkpoint(tmp_path):
    """``dcp.save``/``dcp.load`` of a sharded table over 2 ranks: each rank's shard (its own
    ``rows.rankR-of-W`` entry) comes back exactly into tables on new stores, which then train
    exactly as the tables that went on."""
    for rank, result in enumerate(run_ranks(dcp_round_trip, 2, str(tmp_path))):
        assert result["rows"] > 0 and result["step"] == 4, rank
        assert result["loaded"] and result["trained"], rank
