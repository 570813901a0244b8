"""What each gloo process of ``test_sharding.py`` runs (spawned, so it lives in an importable module).

``train``: each rank trains a sharded table on its slice of every global batch (``global_batches``)
and saves its outputs, the rows every id has afterwards (looked up through the sharded table) and
its store's counters, for the test to compare with one process training on the whole batches.
The other functions play one failure each and save what every rank raised.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from datetime import timedelta
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
    lengths = torch.tensor([len(bag) for bag in bags], dtype=torch.int64)
    ids = torch.tensor([i for bag in bags for i in bag], dtype=torch.int64)
    return ids, torch.cumsum(lengths, 0) - lengths


def targets(step: int, count: int) -> torch.Tensor:
    """A fixed ``[count, DIM]`` target per step (the loss is the outputs' dot product with it)."""
    return torch.sin(torch.arange(count * DIM, dtype=torch.float32).reshape(count, DIM) + step)


def rank_bags(bags: list[list[int]], rank: int, world: int, step: int, empty_step: int) -> list[list[int]]:
    """Rank ``rank``'s bags of a global batch; at ``empty_step``, the last rank has none."""
    if step == empty_step and rank == world - 1:
        return []
    share = len(bags) // world
    return bags[rank * share : (rank + 1) * share]


def _join(rank: int, world: int, port: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),  # a rank left waiting fails, not hangs
    )


def _plain(value):
    """``value`` with its tensors as numpy arrays (a plain pickle: no torch serialization)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(item) for item in value)
    return value


def _save(out: str, rank: int, result: dict) -> None:
    partial = Path(out) / f".rank{rank}.pickle"
    partial.write_bytes(pickle.dumps(_plain(result)))
    partial.rename(Path(out) / f"rank{rank}.pickle")


def _raised(action) -> str | None:
    """``"TypeName: message"`` of what ``action()`` raised, None if nothing."""
    try:
        action()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def _table(out: str, world_dim: int = DIM, **settings) -> TieredEmbeddingBag:
    return TieredEmbeddingBag(
        None,
        world_dim,
        mode="sum",
        path=Path(out) / "table",
        host_cache=32,
        process_group=dist.group.WORLD,
        **settings,
    )


def disagree(rank: int, world: int, port: int, out: str) -> None:
    """The last rank builds its table with another dim."""
    _join(rank, world, port)
    _save(out, rank, {"raised": _raised(lambda: _table(out, DIM + (rank == world - 1)))})
    dist.destroy_process_group()


def refusals(rank: int, world: int, port: int, out: str) -> None:
    """The last rank's input is refused at step 1, every rank evaluates at step 2 but the last trains;
    step 3 runs everywhere. Then pickling, and reopening with another number of ranks (``world``
    minus one ranks: the test runs this with 3, and then ``reopen`` with 2)."""
    _join(rank, world, port)
    table = _table(out)
    last = rank == world - 1
    result = {}
    ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 2])
    result["step0"] = _raised(lambda: table(ids, offsets).sum().backward())
    result["refused"] = _raised(
        lambda: table(torch.tensor([1, -5]) if last else ids, offsets).sum().backward()
    )
    table.train(last)
    result["modes"] = _raised(lambda: table(ids, offsets).sum().backward())
    table.train()
    result["after"] = _raised(lambda: table(ids, offsets).sum().backward())
    if last:  # its store fails while serving the others' rows

        def failing(*_):
            raise OSError("the disk is gone")

        table.store.get_distinct = failing
    result["store_failed"] = _raised(lambda: table(ids, offsets).sum().backward())
    if last:
        del table.store.get_distinct  # back to the store's own
    result["after_failure"] = _raised(lambda: table(ids, offsets).sum().backward())
    result["pickled"] = _raised(lambda: pickle.dumps(table))
    result["prefetch"] = _raised(lambda: table.store_keys(ids))
    table.close()
    _save(out, rank, result)
    _leave()


def _leave() -> None:
    """Destroy the process group and end the process without the interpreter's teardown. After a
    rank's store failed while serving (``refusals``), torch's gloo teardown at interpreter exit
    aborted that rank about once in 25 runs ("terminate called without an active exception", no
    Python frame left: faulthandler), after every result was saved; what the test checks (every
    rank raises, none hangs or dies, training goes on) happens before."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def reopen(rank: int, world: int, port: int, out: str) -> None:
    _join(rank, world, port)
    _save(out, rank, {"raised": _raised(lambda: _table(out))})
    dist.destroy_process_group()


def dead_peer(rank: int, world: int, port: int, out: str, during_flush: bool = False) -> None:
    """Every rank trains 3 steps and flushes; rank 0 records its store's rows. At step 4 the last
    rank dies before its lookup (``during_flush``: inside its store's flush of step 3): the others
    must raise, not hang or die."""
    _join(rank, world, port)
    table, flushed = _table(out), None
    for step in range(5):
        if step == 4 and rank == world - 1:
            os._exit(3)
        if during_flush and step == 3:
            if rank == world - 1:
                table.store.flush = lambda: os._exit(3)
            _save(out, rank, {"raised": _raised(table.flush), "flushed": flushed})
            os._exit(0)
        ids = torch.arange(step * 7, step * 7 + 20) % 50
        raised = _raised(lambda: table(ids, torch.arange(0, 20, 5)).sum().backward())
        if raised:
            _save(out, rank, {"raised": raised, "flushed": flushed})
            os._exit(0)  # as a training script that stops on the error does (no collective teardown)
        if step == 2:
            table.flush()
            flushed = {int(i): row for i, row in zip(*table.store.iter_rows(batch_size=1 << 20).__next__())}
    _save(out, rank, {"raised": None})


def train(
    rank: int,
    world: int,
    port: int,
    out: str,
    optimizer: str,
    replicate: int | str,
    steps: int,
    collection: bool,
    empty: bool = False,
) -> None:
    empty_step = 3 if empty else -1
    try:
        _join(rank, world, port)
        os.environ["TIERSTORE_CHECK_REPLICAS"] = "5"  # debug mode: replicas compared every 5 updates
        hot = torch.arange(NUM)  # ids ranked by Zipf weight: the lowest ids are the hottest
        settings = dict(
            optimizer=OPTIMIZERS[optimizer][0](),
            host_cache=32,
            process_group=dist.group.WORLD,
            warm=hot if replicate else None,
            replicate=replicate if replicate else None,
        )
        if replicate == "auto":  # the rows to replicate are chosen from this rank's first batches
            batches = global_batches(world, steps)
            mine = [rank_bags(bags, rank, world, step, -1) for step, bags in enumerate(batches)]
            settings["access_sample"] = [
                KeyedJaggedTensor(["f"], as_bags(part)[0], lengths=torch.tensor([len(bag) for bag in part]))
                if collection
                else as_bags(part)[0]
                for part in mine
            ]
        if collection:
            tables = [EmbeddingBagConfig(NUM, DIM, name="t", feature_names=["f"])]
            settings["warm"] = {"t": hot} if replicate else None
            table = TieredEmbeddingBagCollection(tables, Path(out) / "table", **settings)
        else:
            table = TieredEmbeddingBag(None, DIM, mode="sum", path=Path(out) / "table", **settings)
        outputs = []
        for step, bags in enumerate(global_batches(world, steps)):
            mine = rank_bags(bags, rank, world, step, empty_step)
            ids, offsets = as_bags(mine)
            if collection:
                lengths = torch.tensor([len(bag) for bag in mine])
                pooled = table(KeyedJaggedTensor(["f"], ids, lengths=lengths)).values()
            else:
                pooled = table(ids, offsets)
            share = len(bags) // world
            (pooled * targets(step, len(bags))[rank * share : rank * share + len(mine)]).sum().backward()
            outputs.append(pooled.detach())
        groups = table.groups.values() if collection else [table]
        comm = [dict(vars(group.sharding.stats)) for group in groups]  # the training steps'
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
        stats = [group.store.stats() for group in groups]
        for group in groups:
            group.sharding.replica_checksum(group.store)
        table.close()
        plan = [(group.sharding.replicated, group.sharding.plan) for group in groups]
        _save(out, rank, {"outputs": outputs, "rows": rows, "stats": stats, "comm": comm, "plan": plan})
    except BaseException:
        _save(out, rank, {"error": traceback.format_exc()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def diverged(rank: int, world: int, port: int, out: str) -> None:
    """Ids 1-3 replicated; after a step, the last rank's replica of id 1 is overwritten: the
    replicas' checksum must name it on every rank (before, it passes)."""
    _join(rank, world, port)
    table = _table(out, replicate=[1, 2, 3])
    table(torch.tensor([1, 2, 7]), torch.tensor([0, 2])).sum().backward()
    before = _raised(lambda: table.sharding.replica_checksum(table.store))
    if rank == world - 1:
        table.store.put(torch.tensor([1]), torch.zeros(1, DIM))
    after = _raised(lambda: table.sharding.replica_checksum(table.store))
    table.close()
    _save(out, rank, {"before": before, "after": after})
    dist.destroy_process_group()


def dcp_round_trip(rank: int, world: int, port: int, out: str) -> None:
    """Each rank trains its shard 4 steps, ``dcp.save``s the table, trains 3 more, then ``dcp.load``s
    the checkpoint into a table on new stores and trains it the same 3 steps: saves whether its
    shard's rows equal the saved ones after the load and the trained-on ones after the 3 steps."""
    import torch.distributed.checkpoint as dcp

    def shard_rows(table) -> dict[int, torch.Tensor]:
        return {
            int(key): row
            for ids, rows in table.store.iter_rows(with_state=True)
            for key, row in zip(ids, rows)
        }

    def same(first, second) -> bool:
        return first.keys() == second.keys() and all(torch.equal(first[key], second[key]) for key in first)

    def steps(table, batches, first: int) -> None:
        for step, bags in enumerate(batches, first):
            share = len(bags) // world
            pooled = table(*as_bags(rank_bags(bags, rank, world, step, -1)))
            (pooled * targets(step, len(bags))[rank * share : (rank + 1) * share]).sum().backward()

    try:
        _join(rank, world, port)
        batches = global_batches(world, 7)
        table = _table(out, optimizer=optim.Adagrad(lr=0.1))
        steps(table, batches[:4], 0)
        dcp.save({"model": table}, checkpoint_id=Path(out) / "dcp")
        saved = shard_rows(table)
        steps(table, batches[4:], 4)
        loaded = TieredEmbeddingBag(
            None, DIM, mode="sum", path=Path(out) / "other", host_cache=32, process_group=dist.group.WORLD,
            optimizer=optim.Adagrad(lr=0.1),
        )  # fmt: skip
        dcp.load({"model": loaded}, checkpoint_id=Path(out) / "dcp")
        result = {"loaded": same(saved, shard_rows(loaded)), "step": loaded.step, "rows": len(saved)}
        steps(loaded, batches[4:], 4)
        result["trained"] = same(shard_rows(table), shard_rows(loaded))
        for closing in (table, loaded):
            closing.close()
        _save(out, rank, result)
    except BaseException:
        _save(out, rank, {"error": traceback.format_exc()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
