"""Which rows to replicate on every rank of a sharded table: the P²RES performance model.

``count_communication`` counts, without running anything, the bytes each rank of a sharded table
would send per step for a stream of global batches, exactly as ``sharding.RowSharding`` sends
them: keys to their owners, rows back, gradients to the owners, and for the replicated keys an
all-reduce of the gradients of the rows any rank touched (after gathering which). A replicated
row costs no all-to-all but is all-reduced whenever any rank touches it, and it takes memory on
every rank. ``plan_replication`` ranks the ids of an access sample by how many (step, rank) pairs
look them up (an id one rank looks up often, a user's id say, ranks low: replicated, it would
save one exchange a step), tries replicating the 0..``max_rows`` first and keeps the count with
the least predicted communication time per step: the busiest rank's all-to-all bytes, then the
all-reduce's, over bandwidths measured on the process group (``measure_bandwidths``) or given.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch
import torch.distributed as dist

from ..hashing import id_hash

ID_BYTES = 16  # a key and its count, to the owner
CANDIDATES = 16  # replicated-row counts tried, geometric up to the limit


@dataclasses.dataclass(frozen=True)
class GroupBandwidths:
    """Bytes per second a rank sends in an all-to-all and through a ring all-reduce, and the
    seconds a collective of a few bytes takes (replication adds three a step)."""

    all_to_all: float
    all_reduce: float
    latency: float = 0.0


def count_communication(
    steps: list[list[np.ndarray]], dim: int, replicated: np.ndarray, element_bytes: int = 4
) -> dict[str, np.ndarray]:
    """Bytes each rank sends per step, ``{"all_to_all": int64 [steps, world], "replicas": [steps, world]}``,
    for ``steps`` of each rank's keys (int64) with the sorted keys ``replicated`` on every rank;
    rows are ``dim`` values of ``element_bytes``."""
    world_size = len(steps[0]) if steps else 1
    all_to_all = np.zeros((len(steps), world_size), dtype=np.int64)
    replicas = np.zeros_like(all_to_all)
    per_key = ID_BYTES + dim * element_bytes  # the key out, its gradient out
    row_back = (dim + 1) * element_bytes  # the row and whether the table held it
    for step, parts in enumerate(steps):
        touched = []
        for rank, part in enumerate(parts):
            unique = np.unique(part)
            is_replicated = np.isin(unique, replicated, assume_unique=True)
            touched.append(unique[is_replicated])
            shard = unique[~is_replicated]
            owners = (id_hash(shard) % np.uint64(world_size)).astype(np.int64)
            remote = owners != rank
            all_to_all[step, rank] += int(remote.sum()) * per_key
            np.add.at(all_to_all[step], owners[remote], row_back)  # each owner answers
        if replicated.size:
            union = np.unique(np.concatenate(touched)).size
            most = max(t.size for t in touched)
            reduce_bytes = 2 * (world_size - 1) * union * dim * element_bytes // world_size
            replicas[step] = reduce_bytes + (world_size - 1) * most * 8
    return {"all_to_all": all_to_all, "replicas": replicas}


def predicted_seconds(counted: dict[str, np.ndarray], bandwidths: GroupBandwidths) -> float:
    """Mean communication time per step: the busiest rank's all-to-all, then the replicas' three
    collectives (two gathers and the all-reduce)."""
    per_step = counted["all_to_all"].max(axis=1) / bandwidths.all_to_all
    replicas = counted["replicas"].max(axis=1)
    per_step = (
        per_step + replicas / bandwidths.all_reduce + np.where(replicas > 0, 3 * bandwidths.latency, 0.0)
    )
    return float(per_step.mean())


def busiest_rank_bytes(counted: dict[str, np.ndarray]) -> float:
    """Mean over the steps of the most bytes one rank sends in a step."""
    return float((counted["all_to_all"] + counted["replicas"]).max(axis=1).mean())


def rank_batches(sample: np.ndarray, world_size: int, batch_size: int, steps: int) -> list[list[np.ndarray]]:
    """The first ``steps`` global batches of an access sample, each as ``world_size`` ranks'
    batches of ``batch_size`` keys (a data-parallel split of the stream)."""
    size = world_size * batch_size
    return [
        np.array_split(sample[start : start + size], world_size)
        for start in range(0, min(sample.size, steps * size), size)
    ]


def plan_replication(
    sample: np.ndarray,
    world_size: int,
    batch_size: int,
    dim: int,
    max_rows: int,
    bandwidths: GroupBandwidths,
    steps: int = 64,
) -> tuple[np.ndarray, list[dict]]:
    """``(the ids to replicate, every candidate tried)``: of the ids looked up by the most ranks and
    steps (see the module docstring), the count up to ``max_rows`` with the least predicted
    communication per step, over the first ``steps`` global batches of ``sample`` (int64 keys in
    access order), ``batch_size`` keys a rank.
    A candidate: ``{"rows", "bytes_per_step" (all ranks), "busiest_rank_bytes_per_step",
    "seconds_per_step"}``."""
    batches = rank_batches(sample, world_size, batch_size, steps)
    if not batches:
        return np.zeros(0, dtype=np.int64), []
    ranked = ranked_by_spread(batches)
    limit = min(max_rows, ranked.size)
    sizes = {0, limit, *np.geomspace(1, max(limit, 1), CANDIDATES).round().astype(int).tolist()}
    tried = []
    for size in sorted(size for size in sizes if size <= limit):
        counted = count_communication(batches, dim, np.sort(ranked[:size]))
        total = (counted["all_to_all"].sum() + counted["replicas"].sum()) / max(len(batches), 1)
        tried.append(
            {
                "rows": int(size),
                "bytes_per_step": float(total),
                "busiest_rank_bytes_per_step": busiest_rank_bytes(counted),
                "seconds_per_step": predicted_seconds(counted, bandwidths),
            }
        )
    best = min(tried, key=lambda candidate: (candidate["seconds_per_step"], candidate["rows"]))
    return ranked[: best["rows"]], tried


def ranked_by_spread(steps: list[list[np.ndarray]]) -> np.ndarray:
    """The ids of ``steps`` (each rank's keys per step), those looked up by the most (step, rank)
    pairs first: a replicated id saves an exchange per rank and step that looks it up, however
    often that rank's batch holds it."""
    if not steps:
        return np.zeros(0, dtype=np.int64)
    ids, spread = np.unique(
        np.concatenate([np.unique(part) for parts in steps for part in parts]), return_counts=True
    )
    return ids[np.argsort(-spread, kind="stable")]


def measure_bandwidths(group, nbytes: int = 1 << 20, repeats: int = 3) -> GroupBandwidths:
    """The bandwidths of ``group`` (collective: every rank calls it): the best of ``repeats``
    all-to-alls of ``nbytes`` from each rank and all-reduces of ``nbytes``."""
    world_size = dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    floats = max(world_size, nbytes // 4 // world_size * world_size)
    send = torch.ones(floats, device=device)
    best_all_to_all = best_all_reduce = best_latency = float("inf")
    tiny = torch.ones(1, device=device)
    for _ in range(repeats):
        dist.barrier(group)
        start = time.perf_counter()
        dist.all_reduce(tiny, group=group)
        best_latency = min(best_latency, time.perf_counter() - start)
        dist.barrier(group)
        start = time.perf_counter()
        dist.all_to_all_single(torch.empty_like(send), send, group=group)
        best_all_to_all = min(best_all_to_all, time.perf_counter() - start)
        dist.barrier(group)
        start = time.perf_counter()
        dist.all_reduce(send, group=group)
        best_all_reduce = min(best_all_reduce, time.perf_counter() - start)
    sent = send.numel() * 4 * (world_size - 1) / world_size  # what each rank sends in either
    timings = torch.tensor(
        [best_all_to_all, best_all_reduce, best_latency], dtype=torch.float64, device=device
    )
    dist.all_reduce(timings, op=dist.ReduceOp.MAX, group=group)  # the same figures on every rank
    return GroupBandwidths(
        sent / max(float(timings[0]), 1e-9), 2 * sent / max(float(timings[1]), 1e-9), float(timings[2])
    )
