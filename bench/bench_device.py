"""GPU device-cache benchmark: the cuda kernels against HBM baselines timed in the same run.

    python bench/bench_device.py --help      (needs a CUDA GPU; exits 2 without one)

1. Warm-cache lookups: find + gather of batches of ``--batch-size`` ids Zipf(alpha) over ``--ids``
   ids, every row already in the device cache, vs ``torch.index_select`` on an all-in-HBM table of
   the same rows; keys/s, GB/s of rows delivered, and that bandwidth as a share of a measured
   device-to-device copy.
2. Training steps (4,096 samples x 26 ids, SGD) with the device cache holding ``--device-share`` of
   the rows (host cache ``--host-share``, the rest in the mmap cold store), for the cuda and the
   torch device backends, vs ``nn.EmbeddingBag(sparse=True)`` + SGD with the whole table in HBM.
JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from tierstore import TieredEmbeddingBag, TieredStore, optim
from tierstore.workloads import ZipfIds

FEATURES = 26


def gpu_seconds(work, repeats: int) -> float:
    """Median seconds of ``work()`` on the GPU (CUDA events), after one warm-up call."""
    work()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(repeats: int) -> float:
    """Device-to-device copy bandwidth, bytes/s (read + write counted once, as rows delivered)."""
    source = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    target = torch.empty_like(source)
    return source.nbytes / gpu_seconds(lambda: target.copy_(source), repeats)


def index_select_seconds(args, batches: list[torch.Tensor], out: torch.Tensor) -> float:
    """The baseline: ``index_select`` of the batches from an all-in-HBM table (freed after)."""
    table = torch.randn(args.ids, args.dim, device="cuda")
    return gpu_seconds(lambda: [torch.index_select(table, 0, b, out=out) for b in batches], args.repeats)


def bench_lookups(args, directory: Path) -> dict:
    sample = ZipfIds(args.ids, args.alpha)
    batches = [torch.from_numpy(sample(args.batch_size)).cuda() for _ in range(args.batches)]
    distinct = torch.unique(torch.cat(batches))
    results = {"distinct_rows": distinct.numel()}
    out = torch.empty(args.batch_size, args.dim, device="cuda")
    rows = args.batch_size * len(batches)
    baseline = index_select_seconds(args, batches, out)
    for backend in ("cuda", "torch"):
        with TieredStore(
            directory / f"lookups-{backend}",
            dim=args.dim,
            host_cache=1,
            device=torch.device("cuda"),
            device_cache=distinct.numel(),
            device_cache_backend=backend,
        ) as store:
            for part in distinct.split(1 << 16):
                store.get(part)  # every row resident
            cache = store.stack.top
            seconds = gpu_seconds(
                lambda: [cache.read(cache.find(b), args.dim, out=out) for b in batches], args.repeats
            )
        results[backend] = {
            "keys_per_s": rows / seconds,
            "gb_per_s": rows * args.dim * 4 / seconds / 1e9,
            "ratio_index_select": baseline / seconds,
        }
    results["index_select_keys_per_s"] = rows / baseline
    results["copy_gb_per_s"] = copy_bandwidth(args.repeats) / 1e9
    for backend in ("cuda", "torch"):
        results[backend]["share_of_copy_bandwidth"] = results[backend]["gb_per_s"] / results["copy_gb_per_s"]
    return results


def bench_training(args, directory: Path) -> dict:
    sample = ZipfIds(args.ids, args.alpha, seed=1)
    offsets = torch.arange(0, 4096 * FEATURES, FEATURES, device="cuda")
    stream = [
        torch.from_numpy(sample(4096 * FEATURES)).cuda() for _ in range(args.warm_up + args.repeats + 1)
    ]
    warm_up, timed = stream[: args.warm_up], stream[args.warm_up :]  # every timed step sees a fresh batch
    results = {}
    for backend in ("cuda", "torch"):
        table = TieredEmbeddingBag(
            None,
            args.dim,
            mode="sum",
            path=directory / f"train-{backend}",
            backend="mmap",
            host_cache=int(args.ids * args.host_share),
            device="cuda",
            device_cache=int(args.ids * args.device_share),
            device_cache_backend=backend,
            optimizer=optim.SGD(lr=0.01),
        )
        for ids in warm_up:
            table(ids, offsets).sum().backward()
        torch.cuda.synchronize()
        batches = iter(timed)
        results[backend] = gpu_seconds(lambda: table(next(batches), offsets).sum().backward(), args.repeats)
        table.close()
    reference = nn.EmbeddingBag(args.ids, args.dim, mode="sum", sparse=True, device="cuda")
    sgd = torch.optim.SGD(reference.parameters(), lr=0.01)
    batches = iter(timed)

    def reference_step():
        sgd.zero_grad()
        reference(next(batches), offsets).sum().backward()
        sgd.step()

    results["nn_embedding_bag"] = gpu_seconds(reference_step, args.repeats)
    for backend in ("cuda", "torch"):
        results[f"step_time_ratio_{backend}_vs_nn_embedding_bag"] = (
            results[backend] / results["nn_embedding_bag"]
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=10_000_000)
    parser.add_argument("--alpha", type=float, default=1.05)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=65536)
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument(
        "--device-share", type=float, default=0.10, help="share of the rows the device cache holds"
    )
    parser.add_argument(
        "--host-share", type=float, default=0.20, help="share of the rows the host cache holds"
    )
    parser.add_argument("--warm-up", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, default=Path("bench/results/device.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_device.py needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    with tempfile.TemporaryDirectory() as directory:
        results = {
            "config": vars(args) | {"json": str(args.json)},
            "gpu": torch.cuda.get_device_name(),
            "lookups": bench_lookups(args, Path(directory)),
            "training": bench_training(args, Path(directory)),
        }
    lookups, training = results["lookups"], results["training"]
    print(
        f"{results['gpu']}: dim {args.dim}, batches of {args.batch_size:,} ids "
        f"Zipf({args.alpha}) over {args.ids:,} ids"
    )
    print(f"{'warm find + gather':<28}{'keys/s':>16}{'GB/s':>10}{'vs index_select':>17}{'of copy BW':>12}")
    for backend in ("cuda", "torch"):
        row = lookups[backend]
        print(
            f"{backend + ' backend':<28}{row['keys_per_s']:>16,.0f}{row['gb_per_s']:>10.1f}"
            f"{row['ratio_index_select']:>17.2f}{row['share_of_copy_bandwidth']:>12.2f}"
        )
    print(
        f"{'index_select (all in HBM)':<28}{lookups['index_select_keys_per_s']:>16,.0f}"
        f"{'':>10}{'':>17}{'':>12}   copy {lookups['copy_gb_per_s']:.0f} GB/s"
    )
    print(
        f"training step (SGD): cuda {training['cuda'] * 1e3:.2f} ms, "
        f"torch backend {training['torch'] * 1e3:.2f} ms, "
        f"nn.EmbeddingBag in HBM {training['nn_embedding_bag'] * 1e3:.2f} ms; "
        f"cuda / nn.EmbeddingBag {training['step_time_ratio_cuda_vs_nn_embedding_bag']:.2f} (target <= 1.3)"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
