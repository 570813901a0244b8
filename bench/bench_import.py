"""Import throughput of ``tierstore import`` against the disk's sequential write bandwidth, both
measured in the same run on the same filesystem.

    python bench/bench_import.py --help

The source is an ``.npy`` of ``--rows`` x ``--dim`` float32 rows (written first and read back
once, so it sits in the page cache as a freshly written table would). The baseline writes the same
number of bytes to a new file with ``os.write`` in 64 MiB blocks and ``fsync``s it: the disk's
sequential write bandwidth. Each import (through ``tierstore.cli.transfer.import_table``, as the CLI
runs it) counts until its store is durable and renamed into place. Reported: MB/s of row bytes and
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
        times = {"disk": [], **{backend: [] for backend in args.backends}}
        for _ in range(args.repeats):
            times["disk"].append(sequential_write_seconds(directory / "sequential.bin", size))
            for backend in args.backends:
                times[backend].append(import_seconds(source, directory / f"store-{backend}", backend))
    rates = {name: size / statistics.median(seconds) / 1e6 for name, seconds in times.items()}
    print(
        f"{args.rows:,} rows x dim {args.dim} float32 ({size / 1e9:.2f} GB), median of {args.repeats} turns"
    )
    print(f"{'':<22}{'MB/s':>10}{'ratio to disk':>15}")
    print(f"{'disk sequential write':<22}{rates['disk']:>10,.0f}{1.0:>15.2f}")
    for backend in args.backends:
        print(f"{'import, ' + backend:<22}{rates[backend]:>10,.0f}{rates[backend] / rates['disk']:>15.2f}")
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
