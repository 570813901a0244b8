"""What each gloo process of ``test_sharding.py`` runs (spawned, so it lives in an importable module).

``train``: each rank trains a sharded table on its slice of every global batch (``global_batches``)
and saves its outputs, the rows every id has afterwards (looked up through the sharded table) and
its store's counters, for the test to compare with one process training on the whole batches.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tierstore import TieredEmbeddingBag, TieredEmbeddingBagCollection, optim
from tierstore.nn.keyed import EmbeddingBagConfig, KeyedJaggedTensor

NUM, DIM = 300, 4
OPTIMIZERS = {
    "sgd": (lambda: optim.SGD(lr=0.1), lambda params: torch.optim.SGD(params, lr=0.1)),
    "adagrad": (lambda: optim.Adagrad(lr=0.1), lambda params: torch.optim.Adagrad(params, lr=0.1)),
}


def global_batches(world: int, steps: int, bags_per_rank: int = 8, seed: int = 0) -> list[list[list[int]]]:
    """``steps`` global batches of ``world * bags_per_rank`` bags of 1-3 Zipf-skewed ids; rank r's
    bags are the r-th slice of each."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, NUM + 1) ** 1.1
    weights /= weights.sum()
    return [
        [rng.choice(NUM, size=rng.integers(1, 4), p=weights).tolist() for _ in range(world * bags_per_rank)]
        for _ in range(steps)
    ]


def as_bags(bags: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, offsets)`` of ``bags``, as ``nn.EmbeddingBag`` takes them."""
    lengths = torch.tensor([len(bag) for bag in bags])
    ids = torch.tensor([i for bag in bags for i in bag], dtype=torch.int64)
    return ids, torch.cumsum(lengths, 0) - lengths


def targets(step: int, count: int) -> torch.Tensor:
    """A fixed ``[count, DIM]`` target per step (the loss is the outputs' dot product with it)."""
    return torch.sin(torch.arange(count * DIM, dtype=torch.float32).reshape(count, DIM) + step)


def _join(rank: int, world: int, port: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def train(
    rank: int, world: int, port: int, out: str, optimizer: str, replicate: int, steps: int, collection: bool
) -> None:
    result = Path(out) / f"rank{rank}.pt"
    try:
        _join(rank, world, port)
        hot = torch.arange(NUM)  # ids ranked by Zipf weight: the lowest ids are the hottest
        settings = dict(
            optimizer=OPTIMIZERS[optimizer][0](),
            host_cache=32,
            process_group=dist.group.WORLD,
            warm=hot if replicate else None,
            replicate=replicate if replicate else None,
        )
        if collection:
            tables = [EmbeddingBagConfig(NUM, DIM, name="t", feature_names=["f"])]
            settings["warm"] = {"t": hot} if replicate else None
            table = TieredEmbeddingBagCollection(tables, Path(out) / "table", **settings)
        else:
            table = TieredEmbeddingBag(None, DIM, mode="sum", path=Path(out) / "table", **settings)
        outputs = []
        for step, bags in enumerate(global_batches(world, steps)):
            mine = bags[rank * len(bags) // world : (rank + 1) * len(bags) // world]
            ids, offsets = as_bags(mine)
            if collection:
                lengths = torch.tensor([len(bag) for bag in mine])
                pooled = table(KeyedJaggedTensor(["f"], ids, lengths=lengths)).values()
            else:
                pooled = table(ids, offsets)
            (pooled * targets(step, len(bags))[rank * len(mine) : (rank + 1) * len(mine)]).sum().backward()
            outputs.append(pooled.detach())
        table.flush()
        table.eval()
        with torch.no_grad():  # every id's row, through the sharded lookup
            if collection:
                everything = KeyedJaggedTensor(
                    ["f"], torch.arange(NUM), lengths=torch.ones(NUM, dtype=torch.int64)
                )
                rows = table(everything).values()
            else:
                rows = table(torch.arange(NUM), torch.arange(NUM))
        groups = table.groups.values() if collection else [table]
        stats = [group.store.stats() for group in groups]
        comm = [vars(group.sharding.stats) for group in groups]
        for group in groups:
            group.sharding.replica_checksum(group.store)
        table.close()
        torch.save({"outputs": outputs, "rows": rows, "stats": stats, "comm": comm}, result)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, result)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
