"""GPU device-cache benchmark: the cuda kernels against HBM baselines timed in the same run.

    python bench/bench_device.py --help      (needs a CUDA GPU; exits 2 without one)

1. Warm-cache lookups: find + gather of batches of ``--batch-size`` ids Zipf(alpha) over ``--ids``
   ids, every row already in the device cache, vs ``torch.index_select`` on an all-in-HBM table of
   the same rows; keys/s, GB/s of rows delivered, and that bandwidth as a share of a measured
   device-to-device copy.
2. Training steps (4,096 samples x 26 ids, SGD) with the device cache holding ``--device-share`` of
   the rows (host cache ``--host-share``, the rest in the mmap cold store), for the cuda and the
   torch device backends, vs ``nn.EmbeddingBag(sparse=True)`` + SGD with the whole table in HBM.
   The cold tier first holds every row and warm-up runs until the device tier is full, so timed
   steps move and evict rows as a long run does; ``--fresh`` times a table that starts empty
   instead (every miss a new id). ``--profile`` says where the cuda backend's step spends its time.
JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from tierstore import TieredEmbeddingBag, TieredStore, initial_rows, optim
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
            slots = [cache.find(b) for b in batches]
            find_seconds = gpu_seconds(lambda: [cache.find(b) for b in batches], args.repeats)
            gather_seconds = gpu_seconds(
                lambda: [cache.read(s, args.dim, out=out) for s in slots], args.repeats
            )
        results[backend] = {
            "keys_per_s": rows / seconds,
            "gb_per_s": rows * args.dim * 4 / seconds / 1e9,
            "ratio_index_select": baseline / seconds,
            "find_share": find_seconds / (find_seconds + gather_seconds),
            "gather_ratio_index_select": baseline / gather_seconds,
        }
    results["index_select_keys_per_s"] = rows / baseline
    results["copy_gb_per_s"] = copy_bandwidth(args.repeats) / 1e9
    for backend in ("cuda", "torch"):
        results[backend]["share_of_copy_bandwidth"] = results[backend]["gb_per_s"] / results["copy_gb_per_s"]
    return results


def preload(path: Path, args) -> None:
    """A store whose cold tier (mmap) holds all ``args.ids`` rows, as a table trained for a while
    does: misses read rows instead of making new ones."""
    with TieredStore(path, dim=args.dim, backend="mmap", host_cache=1) as store:
        for ids in torch.arange(args.ids).split(1 << 20):
            store.stack.cold.bulk_load(ids, initial_rows(ids, args.dim, 0, 0, torch.float32))


def steady_table(args, path: Path, backend: str, sample: ZipfIds, offsets: torch.Tensor):
    """The preloaded table at ``path`` with the device tier on ``backend``, trained (SGD) until its
    device tier is full, so timed steps evict as a long run does. -> (table, warm-up steps)."""
    table = TieredEmbeddingBag(
        None,
        args.dim,
        mode="sum",
        path=path,
        backend="mmap",
        host_cache=int(args.ids * args.host_share),
        device="cuda",
        device_cache=int(args.ids * args.device_share),
        device_cache_backend=backend,
        optimizer=optim.SGD(lr=0.01),
    )
    steps = 0
    while steps < args.warm_up or (
        not args.fresh
        and table.store.stats()["device"]["resident_rows"] < table.store.stats()["device"]["capacity_rows"]
        and steps < 20 * args.warm_up
    ):
        table(torch.from_numpy(sample(offsets.numel() * FEATURES)).cuda(), offsets).sum().backward()
        steps += 1
    torch.cuda.synchronize()
    return table, steps


def bench_training(args, directory: Path) -> dict:
    sample = ZipfIds(args.ids, args.alpha, seed=1)
    offsets = torch.arange(0, 4096 * FEATURES, FEATURES, device="cuda")
    timed = [torch.from_numpy(sample(4096 * FEATURES)).cuda() for _ in range(args.repeats + 1)]
    if not args.fresh:
        preload(directory / "train", args)
    results = {}
    for backend in ("cuda", "torch"):
        path = directory / ("train" if not args.fresh else f"train-{backend}")
        table, warm_up_steps = steady_table(args, path, backend, sample, offsets)
        before = table.store.stats()
        batches = iter(timed)
        results[backend] = gpu_seconds(lambda: table(next(batches), offsets).sum().backward(), args.repeats)
        after = table.store.stats()
        steps = args.repeats + 1
        results[f"{backend}_per_step"] = {
            "warm_up_steps": warm_up_steps,
            "device_miss_share": (after["device"]["misses"] - before["device"]["misses"])
            / max(
                1,
                after["device"]["hits"]
                + after["device"]["misses"]
                - before["device"]["hits"]
                - before["device"]["misses"],
            ),
            "rows_into_device": (after["device"]["rows_in"] - before["device"]["rows_in"]) / steps,
            "rows_from_cold": (after["cold"]["rows_read"] - before["cold"]["rows_read"]) / steps,
        }
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


def profile_training(args, directory: Path) -> None:
    """Where a training step's time goes (cuda backend): the host side by function (cProfile, the
    step synchronised so waits for the GPU are counted where they happen) and the GPU by kernel
    (torch.profiler)."""
    sample = ZipfIds(args.ids, args.alpha, seed=1)
    offsets = torch.arange(0, 4096 * FEATURES, FEATURES, device="cuda")
    if not args.fresh:
        preload(directory / "profile", args)
    table, _ = steady_table(args, directory / "profile", "cuda", sample, offsets)
    stream = [torch.from_numpy(sample(4096 * FEATURES)).cuda() for _ in range(2 * args.repeats)]

    def step(ids):
        table(ids, offsets).sum().backward()
        torch.cuda.synchronize()

    profiler = cProfile.Profile()
    profiler.enable()
    for ids in stream[: args.repeats]:
        step(ids)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    print(f"host side of {args.repeats} steps, by own time:\n{text.getvalue()}")
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as gpu_profile:
        for ids in stream[args.repeats :]:
            step(ids)
    print(gpu_profile.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    print(table.store.stats())
    table.close()


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
    parser.add_argument("--profile", action="store_true", help="only profile the cuda backend's step")
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="train a table that starts empty (every miss a new id, made on the GPU) instead of one "
        "whose cold tier holds every row",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_device.py needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    if args.profile:
        with tempfile.TemporaryDirectory() as directory:
            profile_training(args, Path(directory))
        return
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
    for backend in ("cuda", "torch"):
        print(f"{backend} backend, per timed step: {training[f'{backend}_per_step']}")
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
