"""Communication of a sharded table with and without its hot rows replicated (P²RES), on real
traces and Criteo-like Zipf tables.

    python bench/bench_sharding.py [--ranks 2,4] [--counted 2,4,8,32] [--steps 40]

1. Counted (``replication.count_communication``, nothing run): bytes every rank sends per training
   step for 2..32 ranks, each rank feeding ``--batch`` keys of the trace a step (a data-parallel
   split of the stream), without replication and replicating the rows ``plan_replication``
   chooses (at most ``--max-share`` of the distinct ids) with the bandwidths measured here.
2. Run: ``--ranks`` gloo processes train a sharded ``TieredEmbeddingBag`` (dim ``--dim``, Adagrad,
   bags of 8 ids) on the same stream, with and without that replication: mean step time and the
   bytes the ranks counted sending (equal to the counted ones: tests/test_sharding.py checks it).

Step times here are of processes sharing this machine's cores over loopback TCP: a ratio between
the two configurations, not a figure for a cluster. Results go to stdout and ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tierstore import TieredEmbeddingBag, optim
from tierstore.analysis.traces import load_trace
from tierstore.nn.replication import (
    GroupBandwidths,
    busiest_rank_bytes,
    count_communication,
    measure_bandwidths,
    plan_replication,
    predicted_seconds,
    rank_batches,
    ranked_by_spread,
)

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
TRACES = {
    "taobao": (str(DATA / "taobao_user_behavior_110k.csv"), ["0", "1", "2"]),
    "movielens": (str(DATA / "movielens_latest_small_ratings.csv"), ["userId", "movieId"]),
    "zipf-1M": ("zipf:alpha=1.05,n=1000000,length=2000000,seed=1", None),
    "zipf-10M-once": ("zipf:alpha=1.05,n=10000000,length=2000000,once=0.3,seed=2", None),
}
BAG = 8  # ids per bag


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _join(rank: int, world: int, port: int) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=5),
    )


def _bandwidths(rank: int, world: int, port: int, out: str) -> None:
    _join(rank, world, port)
    measured = measure_bandwidths(dist.group.WORLD, nbytes=4 << 20)
    if rank == 0:
        Path(out).write_text(json.dumps(vars(measured)))
    dist.destroy_process_group()


def _train(
    rank: int, world: int, port: int, out: str, keys: np.ndarray, replicated: np.ndarray, args
) -> None:
    _join(rank, world, port)
    steps = rank_batches(keys, world, args.batch, args.steps + 1)
    with tempfile.TemporaryDirectory() as root:
        table = TieredEmbeddingBag(
            None,
            args.dim,
            mode="sum",
            path=Path(root) / "table",
            optimizer=optim.Adagrad(lr=0.05),
            host_cache=4 * args.batch + replicated.size,
            process_group=dist.group.WORLD,
            replicate=torch.from_numpy(replicated),
        )
        times = []
        for number, parts in enumerate(steps):
            ids = torch.from_numpy(parts[rank])
            offsets = torch.arange(0, ids.numel(), BAG)
            dist.barrier()
            start = time.perf_counter()
            table(ids, offsets).sum().backward()
            times.append(time.perf_counter() - start)
            if number == 0:  # the first step opens files and warms the allocator: not counted
                table.sharding.stats = type(table.sharding.stats)()
        sent = table.sharding.stats.total_bytes
        table.close()
    result = {"seconds": times[1:], "sent": sent}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def spawn(function, world: int, *args):
    out = tempfile.mktemp(suffix=".json")
    mp.spawn(function, args=(world, _port(), out, *args), nprocs=world, join=True)
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    return result


def counted(keys: np.ndarray, world: int, args, bandwidths: GroupBandwidths) -> tuple[dict, np.ndarray]:
    """Bytes per step of every rank without replication, with the planned one and with the
    ``--max-share`` most spread ids replicated, counted; and those ids."""
    max_rows = max(1, int(args.max_share * np.unique(keys).size))
    planned, _ = plan_replication(keys, world, args.batch, args.dim, max_rows, bandwidths, args.plan_steps)
    steps = rank_batches(keys, world, args.batch, args.plan_steps)
    forced = ranked_by_spread(steps)[:max_rows]
    result = {"ranks": world, "planned_rows": int(planned.size), "replicated_rows": int(forced.size)}
    configurations = [("sharded", np.zeros(0, dtype=np.int64)), ("planned", planned), ("replicated", forced)]
    for name, rows in configurations:
        rows = np.sort(rows)
        count = count_communication(steps, args.dim, rows)
        per_step = (count["all_to_all"] + count["replicas"]).sum(axis=1)
        result[name] = {
            "bytes_per_step": float(per_step.mean()),
            "busiest_rank_bytes_per_step": busiest_rank_bytes(count),
            "predicted_seconds_per_step": predicted_seconds(count, bandwidths),
            "all_to_all_bytes_per_step": float(count["all_to_all"].sum(axis=1).mean()),
            "all_reduce_bytes_per_step": float(count["replicas"].sum(axis=1).mean()),
        }
    result["reduction"] = result["sharded"]["bytes_per_step"] / max(
        result["replicated"]["bytes_per_step"], 1.0
    )
    return result, forced


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--traces", default=",".join(TRACES), help="of: " + ", ".join(TRACES))
    parser.add_argument("--ranks", default="2,4", help="process counts to run here")
    parser.add_argument("--counted", default="2,4,8,32", help="rank counts to count")
    parser.add_argument("--batch", type=int, default=1024, help="keys per rank per step")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--plan-steps", type=int, default=64, help="steps the model counts")
    parser.add_argument(
        "--max-share", type=float, default=0.01, help="most rows replicated, of the distinct ids"
    )
    parser.add_argument("--json", type=Path, default=Path("bench/results/sharding.json"))
    args = parser.parse_args()
    bandwidths = GroupBandwidths(**spawn(_bandwidths, 2))
    print(
        f"gloo over loopback, 2 processes: all-to-all {bandwidths.all_to_all / 1e6:,.0f} MB/s, "
        f"all-reduce {bandwidths.all_reduce / 1e6:,.0f} MB/s a rank, "
        f"{bandwidths.latency * 1e6:,.0f} us a collective"
    )
    report = {"bandwidths": vars(bandwidths), "batch_per_rank": args.batch, "dim": args.dim, "traces": {}}
    for name in args.traces.split(","):
        spec, columns = TRACES[name]
        keys = load_trace(spec, columns=columns).keys
        entry = {"accesses": int(keys.size), "distinct": int(np.unique(keys).size), "counted": [], "run": []}
        print(
            f"\n{name}: {keys.size:,} accesses, {entry['distinct']:,} distinct ids, "
            f"{args.batch:,} keys a rank a step"
        )
        print("counted: MB sent per step by all ranks / by the busiest rank; predicted ms of communication")
        print(f"{'ranks':>6} {'sharded':>26} {'planned (rows)':>34} {'max-share replicated':>26} {'cut':>6}")
        plans = {}
        for world in map(int, args.counted.split(",")):
            result, plans[world] = counted(keys, world, args, bandwidths)
            entry["counted"].append(result)
            cells = [
                f"{r['bytes_per_step'] / 1e6:.3f} / {r['busiest_rank_bytes_per_step'] / 1e6:.3f} MB, "
                f"{r['predicted_seconds_per_step'] * 1e3:.2f} ms"
                for r in (result["sharded"], result["planned"], result["replicated"])
            ]
            cells[1] += f" ({result['planned_rows']:,})"
            print(f"{world:>6} {cells[0]:>26} {cells[1]:>34} {cells[2]:>26} {result['reduction']:>9.2f}x")
        print(f"{'ranks':>6} {'replicated':>11} {'ms/step':>9} {'MB/step':>9}  (run here)")
        for world in map(int, args.ranks.split(",")):
            replicated = plans.get(world)
            if replicated is None:
                replicated = counted(keys, world, args, bandwidths)[1]
            for rows in (np.zeros(0, dtype=np.int64), replicated):
                ranks = spawn(_train, world, keys, rows, args)
                step = statistics.median(max(times) for times in zip(*(rank["seconds"] for rank in ranks)))
                sent = sum(rank["sent"] for rank in ranks)
                run = {"ranks": world, "replicated_rows": int(rows.size), "step_seconds": step}
                run["bytes_per_step"] = sent / args.steps
                entry["run"].append(run)
                print(f"{world:>6} {rows.size:>11,} {step * 1e3:>9.2f} {run['bytes_per_step'] / 1e6:>9.3f}")
        report["traces"][name] = entry
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"\nfigures: {args.json}")


if __name__ == "__main__":
    main()
