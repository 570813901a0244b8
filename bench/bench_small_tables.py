"""What small tiered tables cost: ``--tables`` tables of ``--rows`` rows (bounded, and growing on
demand), default budgets, each looked up and trained once: milliseconds to build one (its store's
files included) and the process's resident growth, against as many ``nn.EmbeddingBag``s.

    python bench/bench_small_tables.py --help
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import psutil
import torch
from torch import nn

from tierstore import TieredEmbeddingBag


def measure(make, count: int) -> dict:
    """Build ``count`` tables with ``make(i)``, train each once; ms per build, MiB of growth."""
    process = psutil.Process()
    before = process.memory_info().rss
    start = time.perf_counter()
    tables = [make(index) for index in range(count)]
    built = time.perf_counter() - start
    ids = torch.arange(100).reshape(10, 10)
    for table in tables:
        table(ids % table.num_embeddings if table.num_embeddings else ids).sum().backward()
    grown = process.memory_info().rss - before
    for table in tables:
        if hasattr(table, "close"):
            table.close()
    return {"ms_per_build": 1e3 * built / count, "rss_growth_mib": grown / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", type=int, default=32)
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--json", type=Path, default=Path("bench/results/small_tables.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        TieredEmbeddingBag(args.rows, args.dim, path=f"{directory}/warm").close()  # kernels built, loaded
        results = {
            "nn.EmbeddingBag": measure(
                lambda i: nn.EmbeddingBag(args.rows, args.dim, mode="sum"), args.tables
            ),
            "tiered, bounded": measure(
                lambda i: TieredEmbeddingBag(args.rows, args.dim, path=f"{directory}/b{i}"), args.tables
            ),
            "tiered, growing": measure(
                lambda i: TieredEmbeddingBag(None, args.dim, path=f"{directory}/g{i}"), args.tables
            ),
        }
    print(f"{args.tables} tables of {args.rows} rows, dim {args.dim}, default budgets")
    print(f"{'':<18}{'ms per build':>14}{'RSS growth (MiB)':>18}")
    for name, figures in results.items():
        print(f"{name:<18}{figures['ms_per_build']:>14.2f}{figures['rss_growth_mib']:>18.1f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "results": results})
    )


if __name__ == "__main__":
    main()
