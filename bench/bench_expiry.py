"""What expiring ids costs a training loop: two tables of ``--rows`` loaded rows (dim ``--dim``, SGD,
mmap or LMDB), one with ``ttl`` (and ``--max-rows``), one without, trained on the same Zipf batches of
new and old ids, flushed every ``--steps`` steps, in turns.

    python bench/bench_expiry.py --rows 1000000 --dim 16

Reports, per table: the median step (between flushes), the median flush (for the expiring table: the
records written, the scan, the removals and their commit) and the rows held at the end; and the ratios
of the expiring table's to the other's, from the same process.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tierstore import TieredEmbeddingBag
from tierstore.optim import SGD


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows loaded before training")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--backend", choices=["mmap", "lmdb"], default="mmap")
    parser.add_argument("--batch", type=int, default=4096, help="ids a step")
    parser.add_argument("--steps", type=int, default=50, help="steps between flushes")
    parser.add_argument("--rounds", type=int, default=6, help="flushes of each table, in turns")
    parser.add_argument("--ttl", type=int, default=100, help="steps without an update before an id goes")
    parser.add_argument("--max-rows", type=int, default=None)
    parser.add_argument("--dir", default=None, help="where the stores go (default: a temporary folder)")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-expiry-"))
    host_bytes = max(args.rows // 10, 4 * args.batch) * (args.dim * 4 + 64)
    tables = {}
    for name, expiry in (("plain", {}), ("expiring", {"ttl": args.ttl, "max_rows": args.max_rows})):
        table = TieredEmbeddingBag(
            None,
            args.dim,
            mode="sum",
            path=root / name,
            backend=args.backend,
            optimizer=SGD(lr=0.01),
            host_cache=host_bytes,
            **expiry,
        )
        for start in range(0, args.rows, 1 << 20):
            ids = torch.arange(start, min(start + (1 << 20), args.rows))
            table.load_weights(ids, torch.zeros(ids.numel(), args.dim))
        table.flush()
        tables[name] = table
    steps = {name: [] for name in tables}
    flushes = {name: [] for name in tables}
    for round_ in range(args.rounds):
        rng = np.random.default_rng(round_)  # both tables see the same batches
        batches = [
            torch.from_numpy((rng.zipf(1.1, args.batch) + round_ * args.rows // 8) % (4 * args.rows))
            for _ in range(args.steps)
        ]
        for name, table in tables.items():
            offsets = torch.arange(0, args.batch, 8)
            for ids in batches:
                start = time.perf_counter()
                table(ids, offsets).sum().backward()
                steps[name].append(time.perf_counter() - start)
            start = time.perf_counter()
            table.flush()
            flushes[name].append(time.perf_counter() - start)
    for name, table in tables.items():
        print(
            f"{name:>9}: step {statistics.median(steps[name]) * 1e3:.2f} ms, flush "
            f"{statistics.median(flushes[name]) * 1e3:.1f} ms, {len(table.store):,} rows held, "
            f"{table.store.stats()['cold']['rows_removed']:,} removed"
        )
    step_ratio = statistics.median(steps["expiring"]) / statistics.median(steps["plain"])
    flush_ratio = statistics.median(flushes["expiring"]) / statistics.median(flushes["plain"])
    print(f"expiring / plain: step {step_ratio:.2f}x, flush {flush_ratio:.2f}x")
    for table in tables.values():
        table.close()


if __name__ == "__main__":
    main()
