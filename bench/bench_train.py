"""Training-step throughput of a tiered table vs in-memory baselines timed in the same run.

    python bench/bench_train.py --help

One step = forward + backward + optimizer on a batch of ``--batch-size`` samples x 26 ids drawn
Zipf(alpha) from ``--ids`` ids (one table, bags of 26, mode "sum"), dim ``--dim``:
- ours: ``TieredEmbeddingBag`` with the host cache holding ``--host-share`` of the rows and every
  row first written to the cold store (mmap backend), fused optimizer;
- ``nn.EmbeddingBag(sparse=True)`` + ``torch.optim`` with the whole table in RAM;
- FBGEMM's CPU table-batched embedding with the fused optimizer, when ``fbgemm_gpu`` is
  installed (``pip install fbgemm-gpu-cpu==1.8.0`` works with torch 2.13); the column says
  "not installed" otherwise.
Every timed step sees a fresh batch (``--warm-up`` batches first fill the cache, then each of
``--repeats`` times ``--steps`` new ones), so the cache is never timed on batches it has seen; the
methods take turns on each set of batches, so the machine's drift hits them alike.
Reported: samples/s, the ratio ours / baseline, and the share of our id lookups the host cache
served, for SGD and Adagrad. JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from tierstore import TieredEmbeddingBag, initial_weights, optim
from tierstore.workloads import ZipfIds

FEATURES = 26


def batches(
    count: int, size: int, ids: int, alpha: float, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    sample = ZipfIds(ids, alpha, seed)
    offsets = torch.arange(0, size * FEATURES, FEATURES)
    return [(torch.from_numpy(sample(size * FEATURES)), offsets) for _ in range(count)]


def each(step):
    """A per-batch ``step(*batch)`` as a run over a list of batches."""

    def run(batches: list) -> None:
        for batch in batches:
            step(*batch)

    return run


def interleaved_seconds(runs: dict, timed: list[list]) -> dict[str, list[float]]:
    """Seconds each warmed-up ``runs[name](batches)`` (``each(step)`` for a per-batch step) took on
    each list of ``timed`` batches, the methods timed in turns (so the machine's drift hits every
    method alike; each list is fresh to the tiered table): ``{name: [seconds of round r]}``."""
    times = {name: [] for name in runs}
    for batches in timed:
        for name, run in runs.items():
            start = time.perf_counter()
            run(batches)
            times[name].append(time.perf_counter() - start)
    return times


def interleaved_samples_per_second(
    runs: dict, timed: list[list], samples_per_batch: int | None = None
) -> dict[str, float]:
    """Median samples/s of each of ``runs`` over ``interleaved_seconds``' rounds. A batch holds
    ``samples_per_batch`` samples (default: its offsets' length)."""
    samples = len(timed[0]) * (samples_per_batch or timed[0][0][1].numel())
    return median_rates(interleaved_seconds(runs, timed), samples)


def median_rates(seconds: dict[str, list[float]], samples: int) -> dict[str, float]:
    """Samples/s of each method's median round of ``interleaved_seconds``, ``samples`` a round."""
    return {name: samples / statistics.median(taken) for name, taken in seconds.items()}


def paired_ratios(seconds: list[float], baseline: list[float]) -> tuple[float, float, float]:
    """Speed against a baseline timed in the same rounds (``interleaved_seconds``), each round's
    ratio of times taken on its own: ``(median, lowest, highest)``. A round's ratio sees the
    machine as both methods saw it, so a slow spell between rounds does not move it."""
    ratios = [theirs / ours for ours, theirs in zip(seconds, baseline)]
    return statistics.median(ratios), min(ratios), max(ratios)


def ratio_text(ratio: tuple[float, float, float]) -> str:
    """A ``paired_ratios`` result as "median (lowest-highest)"."""
    middle, lowest, highest = ratio
    return f"{middle:.2f} ({lowest:.2f}-{highest:.2f})"


def torch_baseline(ids: int, dim: int, optimizer: str):
    table = nn.EmbeddingBag(ids, dim, mode="sum", sparse=True)
    dense_optimizer = (
        torch.optim.SGD(table.parameters(), lr=0.01)
        if optimizer == "sgd"
        else torch.optim.Adagrad(table.parameters(), lr=0.01)
    )

    def step(input, offsets):
        dense_optimizer.zero_grad()
        table(input, offsets).sum().backward()
        dense_optimizer.step()

    return step


def fbgemm_baseline(ids: int, dim: int, optimizer: str):
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except ImportError:
        return None
    kind = EmbOptimType.EXACT_SGD if optimizer == "sgd" else EmbOptimType.EXACT_ADAGRAD
    table = SplitTableBatchedEmbeddingBagsCodegen(
        [(ids, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=kind, learning_rate=0.01
    )

    def step(input, offsets):
        table(input, torch.cat([offsets, torch.tensor([input.numel()])])).sum().backward()

    return step


def tiered(ids: int, dim: int, optimizer: str, host_share: float, directory: Path):
    kind = optim.SGD(lr=0.01) if optimizer == "sgd" else optim.Adagrad(lr=0.01)
    table = TieredEmbeddingBag(
        None,
        dim,
        mode="sum",
        path=directory / optimizer,
        backend="mmap",
        host_cache=int(ids * host_share),
        optimizer=kind,
    )
    width = dim + kind.state_width(dim)
    for part in tqdm(
        torch.arange(ids).split(1 << 18), desc=f"writing {ids:,} rows to the cold store", leave=False
    ):
        rows = torch.zeros(part.numel(), width)
        rows[:, :dim] = initial_weights(part, dim, 0, torch.float32)
        table.store.stack.cold.put(part, rows)
    table.store.stack.cold.flush()

    def step(input, offsets):
        table(input, offsets).sum().backward()

    return table, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=4_000_000)
    parser.add_argument("--alpha", type=float, default=1.05)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4096, help="samples per step (26 ids each)")
    parser.add_argument(
        "--host-share", type=float, default=0.10, help="share of the rows the host cache holds"
    )
    parser.add_argument(
        "--steps", type=int, default=10, help="steps per timed repeat (each repeat on fresh batches)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--warm-up", type=int, default=30, help="steps that fill the cache before timing (not timed)"
    )
    parser.add_argument("--optimizers", nargs="+", default=["sgd", "adagrad"], choices=["sgd", "adagrad"])
    parser.add_argument("--json", type=Path, default=Path("bench/results/train.json"))
    args = parser.parse_args()

    stream = batches(args.warm_up + args.steps * args.repeats, args.batch_size, args.ids, args.alpha)
    warm_up, rest = stream[: args.warm_up], stream[args.warm_up :]
    timed = [rest[args.steps * r : args.steps * (r + 1)] for r in range(args.repeats)]
    results = {"config": vars(args) | {"json": str(args.json), "torch_threads": torch.get_num_threads()}}
    print(
        f"{args.batch_size:,} samples x {FEATURES} ids Zipf({args.alpha}) over {args.ids:,} ids, "
        f"dim {args.dim}, "
        f"host cache {args.host_share:.0%} of the rows"
    )
    print(
        f"{'optimizer':<10}{'ours':>14}{'nn.EmbeddingBag':>17}{'ratio':>8}{'FBGEMM':>14}{'ratio':>8}"
        f"{'host hits':>10}  (samples/s; hits: share of our id lookups the host cache served)"
    )
    with tempfile.TemporaryDirectory() as directory:
        for name in args.optimizers:
            table, ours_step = tiered(args.ids, args.dim, name, args.host_share, Path(directory))
            for batch in warm_up:  # fill the host cache with hot rows, as a long run would
                ours_step(*batch)
            steps = {"ours": ours_step, "nn_embedding_bag": torch_baseline(args.ids, args.dim, name)}
            fbgemm_step = fbgemm_baseline(args.ids, args.dim, name)
            if fbgemm_step:
                steps["fbgemm"] = fbgemm_step
            for step in list(steps.values())[1:]:
                for batch in warm_up[:2]:
                    step(*batch)
            before = table.store.stats()["host"]
            rates = interleaved_samples_per_second({name: each(step) for name, step in steps.items()}, timed)
            after = table.store.stats()["host"]
            lookups = after["hits"] + after["misses"] - before["hits"] - before["misses"]
            hit_rate = (after["hits"] - before["hits"]) / lookups
            table.close()
            ours, baseline, fbgemm = rates["ours"], rates["nn_embedding_bag"], rates.get("fbgemm")
            results[name] = {
                "samples_per_s_ours": ours,
                "samples_per_s_nn_embedding_bag": baseline,
                "ratio_nn_embedding_bag": ours / baseline,
                "samples_per_s_fbgemm": fbgemm,
                "ratio_fbgemm": ours / fbgemm if fbgemm else None,
                "host_hit_rate": hit_rate,
                "host_backend": after["backend"],
            }
            fbgemm_text = (
                f"{fbgemm:>14,.0f}{ours / fbgemm:>8.2f}" if fbgemm else f"{'not installed':>14}{'':>8}"
            )
            print(
                f"{name:<10}{ours:>14,.0f}{baseline:>17,.0f}{ours / baseline:>8.2f}"
                f"{fbgemm_text}{hit_rate:>10.1%}"
            )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
