"""Row-wise sharding over gloo processes (``process_group=``), with and without the hot rows
replicated: outputs and final rows equal one process training ``nn.EmbeddingBag`` on the
concatenation of every rank's batch, with caches so small that rows move through every tier."""

import socket

import pytest
import torch
import torch.multiprocessing as mp
from sharded_worker import DIM, NUM, OPTIMIZERS, as_bags, global_batches, targets, train

from tierstore import initial_weights

STEPS = 24


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ranks(function, world: int, *args) -> list[dict]:
    """``function(rank, world, port, *args)`` in ``world`` spawned processes; each rank's saved result."""
    out = args[0]
    mp.spawn(function, args=(world, free_port(), *args), nprocs=world, join=True)
    results = [torch.load(f"{out}/rank{rank}.pt") for rank in range(world)]
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank} failed:\n{result.get('error')}"
    return results


def one_process(world: int, optimizer: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``(outputs per step, final rows)`` of ``nn.EmbeddingBag`` trained on the whole batches."""
    bag = torch.nn.EmbeddingBag(NUM, DIM, mode="sum")
    with torch.no_grad():
        bag.weight.copy_(initial_weights(torch.arange(NUM), DIM, 0, torch.float32))
    dense = OPTIMIZERS[optimizer][1](bag.parameters())
    outputs = []
    for step, bags in enumerate(global_batches(world, STEPS)):
        dense.zero_grad()
        pooled = bag(*as_bags(bags))
        (pooled * targets(step, len(bags))).sum().backward()
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
            per_rank = len(pooled)
            expected = outputs[step][rank * per_rank : (rank + 1) * per_rank]
            torch.testing.assert_close(pooled, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(result["rows"], rows, rtol=0, atol=1e-5)
        assert result["stats"][0]["host"]["evictions"] > 0  # rows went down to the cold store and back
    sent = [result["comm"][0] for result in results]
    assert all(comm["id_bytes"] > 0 and comm["row_bytes"] > 0 and comm["gradient_bytes"] > 0 for comm in sent)
    if replicate:
        assert all(comm["replica_bytes"] > 0 for comm in sent)
