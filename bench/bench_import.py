"""Import throughput of ``tierstore import`` and of in-process loading (``from_pretrained``, and
``load_weights`` over rows a table holds) against the disk's sequential write bandwidth, all
measured in the same run on the same filesystem.

    python bench/bench_import.py --help

The source is an ``.npy`` of ``--rows`` x ``--dim`` float32 rows (written first and read back
once, so it sits in the page cache as a freshly written table would). The baseline writes the same
number of bytes to a new file with ``os.write`` in 64 MiB blocks and ``fsync``s it: the disk's
sequential write bandwidth. Each import (through ``tierstore.cli.transfer.import_table``, as the CLI
runs it) counts until its store is durable and renamed into place; ``from_pretrained`` until the
new table is closed (durable); ``reload`` times ``load_weights`` of the same rows into the table
``from_pretrained`` made (every id held: the overwrite path). Reported: MB/s of row bytes and
the ratio import / disk, median over ``--repeats`` turns taken in alternation, per backend. JSON to
``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tierstore import TieredEmbeddingBag
from tierstore.cli.table_files import open_table
from tierstore.cli.transfer import import_table

BLOCK = 64 << 20


def sequential_write_seconds(path: Path, size: int) -> float:
    block = memoryview(
        np.random.default_rng(0).integers(0, 255, BLOCK, dtype=np.uint8)
    )  # slices copy nothing
    start = time.perf_counter()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        written = 0
        while written < size:
            written += os.write(descriptor, block[: min(BLOCK, size - written)])
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def import_seconds(source: Path, store: Path, backend: str) -> float:
    start = time.perf_counter()
    import_table(open_table(source), store, backend=backend, progress=False)
    seconds = time.perf_counter() - start
    shutil.rmtree(store)
    return seconds


def load_seconds(source: Path, store: Path, backend: str) -> tuple[float, float]:
    """Seconds of ``from_pretrained`` (to a closed, durable table) and of reloading every row."""
    weights = torch.from_numpy(np.load(source, mmap_mode="r"))
    start = time.perf_counter()
    TieredEmbeddingBag.from_pretrained(weights, path=store, backend=backend, host_cache=1024).close()
    pretrained = time.perf_counter() - start
    table = TieredEmbeddingBag(weights.shape[0], weights.shape[1], path=store, host_cache=1024)
    start = time.perf_counter()
    table.load_weights(torch.arange(weights.shape[0]), weights)
    table.close()
    reload = time.perf_counter() - start
    shutil.rmtree(store)
    return pretrained, reload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", nargs="+", default=["mmap", "lmdb"], choices=["mmap", "lmdb"])
    parser.add_argument(
        "--directory", type=Path, default=None, help="where to write (default: a temporary directory)"
    )
    parser.add_argument("--json", type=Path, default=Path("bench/results/import.json"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.directory) as directory:
        directory = Path(directory)
        source = directory / "table.npy"
        rows = np.lib.format.open_memmap(source, mode="w+", dtype=np.float32, shape=(args.rows, args.dim))
        for start in range(0, args.rows, 1 << 18):
            part = rows[start : start + (1 << 18)]
            part[:] = np.random.default_rng(start).standard_normal(part.shape, dtype=np.float32)
        rows.flush()
        del rows
        size = args.rows * args.dim * 4
        methods = [
            f"{how}, {backend}"
            for backend in args.backends
            for how in ("import", "from_pretrained", "reload")
        ]
        times = {"disk": [], **{method: [] for method in methods}}
        for _ in range(args.repeats):
            times["disk"].append(sequential_write_seconds(directory / "sequential.bin", size))
            for backend in args.backends:
                times[f"import, {backend}"].append(
                    import_seconds(source, directory / f"store-{backend}", backend)
                )
                pretrained, reload = load_seconds(source, directory / f"table-{backend}", backend)
                times[f"from_pretrained, {backend}"].append(pretrained)
                times[f"reload, {backend}"].append(reload)
    rates = {name: size / statistics.median(seconds) / 1e6 for name, seconds in times.items()}
    print(
        f"{args.rows:,} rows x dim {args.dim} float32 ({size / 1e9:.2f} GB), median of {args.repeats} turns"
    )
    print(f"{'':<24}{'MB/s':>10}{'ratio to disk':>15}")
    print(f"{'disk sequential write':<24}{rates['disk']:>10,.0f}{1.0:>15.2f}")
    for method in methods:
        print(f"{method:<24}{rates[method]:>10,.0f}{rates[method] / rates['disk']:>15.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {"config": {k: str(v) for k, v in vars(args).items()}, "seconds": times, "mb_per_s": rates},
            indent=2,
        )
    )
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
