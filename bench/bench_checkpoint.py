"""What a point-in-time checkpoint costs a training loop: a table of ``--rows`` trained rows (dim
``--dim``, Adagrad, mmap or LMDB), its host cache ``--host-share`` of them, trained on Zipf batches.

    python bench/bench_checkpoint.py --rows 2000000 --dim 16

Reports, in the same process:

- the time ``checkpoint(background=True)`` holds the training loop (the flush and the snapshot's
  opening) against a plain ``flush()`` after as many steps;
- the training step while the checkpoint is written on its thread, against the step without one
  (steps before and after, in turns), and how long the writing took (MB/s);
- ``restore`` of the checkpoint, and ``dcp.save`` / ``dcp.load`` of the table (into a new store).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from tierstore import TieredEmbeddingBag
from tierstore.optim import Adagrad


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=2_000_000, help="trained rows in the table")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--backend", choices=["mmap", "lmdb"], default="mmap")
    parser.add_argument("--host-share", type=float, default=0.1, help="host cache, a share of the rows")
    parser.add_argument("--batch", type=int, default=4096, help="ids a step")
    parser.add_argument("--steps", type=int, default=20, help="steps between measurements")
    parser.add_argument("--dir", default=None, help="where the stores go (default: a temporary folder)")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-checkpoint-"))
    rng = np.random.default_rng(0)
    host_bytes = int(args.rows * args.host_share) * (2 * args.dim * 4 + 64)

    def new_table(name: str) -> TieredEmbeddingBag:
        return TieredEmbeddingBag(
            None,
            args.dim,
            path=root / name,
            backend=args.backend,
            optimizer=Adagrad(lr=0.05),
            host_cache=host_bytes,
        )

    table = new_table("table")
    print(f"loading {args.rows:,} rows ...", flush=True)
    for start in range(0, args.rows, 1 << 20):
        ids = torch.arange(start, min(start + (1 << 20), args.rows))
        table.store.load(ids, torch.randn(ids.numel(), table.store.row_width) * 0.1)

    def batch() -> torch.Tensor:
        ids = (rng.zipf(1.05, args.batch).astype(np.int64) * 2654435761) % args.rows  # hot ids scattered
        return torch.from_numpy(ids).view(-1, 8)

    def step() -> float:
        ids = batch()
        began = time.perf_counter()
        table(ids).sum().backward()
        return time.perf_counter() - began

    for _ in range(args.steps):  # warm the cache
        step()
    [step() for _ in range(args.steps)]
    began = time.perf_counter()
    table.flush()
    flush_seconds = time.perf_counter() - began
    [step() for _ in range(args.steps)]
    began = time.perf_counter()
    writing = table.checkpoint(root / "checkpoint", background=True)
    held_seconds = time.perf_counter() - began
    during = []
    while not writing.done():
        during.append(step())
    write_seconds = time.perf_counter() - began
    writing.wait()
    without = [step() for _ in range(max(len(during), args.steps))]
    checkpoint_bytes = sum(path.stat().st_size for path in (root / "checkpoint").iterdir())
    began = time.perf_counter()
    table.restore(root / "checkpoint")
    restore_seconds = time.perf_counter() - began

    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message=".*single process")
    began = time.perf_counter()
    dcp.save({"table": table}, checkpoint_id=root / "dcp")
    dcp_save_seconds = time.perf_counter() - began
    other = new_table("other")
    began = time.perf_counter()
    dcp.load({"table": other}, checkpoint_id=root / "dcp")
    dcp_load_seconds = time.perf_counter() - began

    def ms(values) -> str:
        return f"{statistics.median(values) * 1e3:.2f} ms"

    print(
        f"table: {args.rows:,} rows x {table.store.row_width} floats ({args.backend}), "
        f"host cache {args.host_share:.0%}"
    )
    print(
        f"checkpoint(background=True) held the loop {held_seconds * 1e3:.1f} ms; "
        f"a flush: {flush_seconds * 1e3:.1f} ms"
    )
    print(
        f"written in {write_seconds:.2f} s ({checkpoint_bytes / write_seconds / 1e6:.0f} MB/s, "
        f"{checkpoint_bytes / 1e6:.0f} MB) while {len(during)} steps trained"
    )
    if during:
        ratio = statistics.median(without) / statistics.median(during)
        print(f"step while writing {ms(during)}, without {ms(without)}: {ratio:.2f}x the speed")
    print(
        f"restore {restore_seconds:.2f} s; dcp.save {dcp_save_seconds:.2f} s; "
        f"dcp.load {dcp_load_seconds:.2f} s"
    )
    table.close()
    other.close()


if __name__ == "__main__":
    main()
