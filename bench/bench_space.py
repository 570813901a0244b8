"""Disk use and flush memory of the cold stores at scale (issue 13, item 14).

    python bench/bench_space.py --ids 10000000 --dim 16

A table of ``--ids`` distinct ids is written through ``TieredStore`` (a ``--host-cache`` budget,
the rows evicted down to the cold store), in random id order and in batches, with a flush every
``--flush-every`` rows; then ``--updates`` random ids are rewritten (training's pattern) and
flushed. For each backend it reports:

- disk: the blocks the store's files take (``st_blocks``), over the raw row bytes
  (ids x dim x 4), after the load and after the updates;
- flush memory: the process's peak anonymous (private) memory during each flush, above the
  memory it held just before, beside the caches' budget. File pages mapped by the stores are page
  cache, which the kernel reclaims; they are reported apart (peak ``RssFile``).

Results go to stdout as a table and to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from tierstore import TieredStore
from tierstore.budget import parse_bytes


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class PeakSampler:
    """Samples ``RssAnon`` and ``RssFile`` every millisecond while active; peaks in bytes."""

    def __enter__(self) -> PeakSampler:
        self.anon = self.file = 0
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            self.anon = max(self.anon, status_kib("RssAnon") * 1024)
            self.file = max(self.file, status_kib("RssFile") * 1024)
            time.sleep(0.001)

    def __exit__(self, *exc_info) -> None:
        self._running = False
        self._thread.join()


def disk_bytes(directory: Path) -> int:
    return sum(path.stat().st_blocks * 512 for path in directory.rglob("*") if path.is_file())


def run_backend(backend: str, args: argparse.Namespace, directory: Path) -> dict:
    rng = np.random.default_rng(0)
    raw = args.ids * args.dim * 4
    flushes = []

    def flush(store: TieredStore) -> None:
        before = status_kib("RssAnon") * 1024
        index_before = store.stats()["cold"].get("index_bytes", 0)
        with PeakSampler() as peak:
            store.flush()
        index_growth = store.stats()["cold"].get("index_bytes", 0) - index_before
        flushes.append(
            {
                "anon_peak_above_before": peak.anon - before,
                "file_peak": peak.file,
                "index_growth": index_growth,
            }
        )

    store = TieredStore(directory, dim=args.dim, backend=backend, host_cache=args.host_cache)
    order = rng.permutation(args.ids)
    written = 0
    for batch in np.array_split(order, max(1, args.ids // args.batch)):
        ids = torch.from_numpy(batch)
        store.put(ids, torch.randn(ids.numel(), args.dim))
        written += ids.numel()
        if written >= args.flush_every:
            flush(store)
            written = 0
    flush(store)
    after_load = disk_bytes(directory)
    for _ in range(max(1, args.updates // args.batch)):
        ids = torch.from_numpy(np.unique(rng.integers(0, args.ids, args.batch)))
        store.put(ids, torch.randn(ids.numel(), args.dim))
    flush(store)
    index_bytes = store.stats()["cold"].get("index_bytes", 0)
    store.close()
    after_updates = disk_bytes(directory)
    worst = max(flushes, key=lambda item: item["anon_peak_above_before"])
    return {
        "backend": backend,
        "raw_bytes": raw,
        "disk_after_load": after_load / raw,
        "disk_after_updates": after_updates / raw,
        "flush_anon_peak_MiB": worst["anon_peak_above_before"] / 2**20,
        "flush_file_peak_MiB": max(item["file_peak"] for item in flushes) / 2**20,
        "cache_budget_MiB": parse_bytes(args.host_cache) / 2**20,
        "flushes": len(flushes),
        "flush_anon_peaks_MiB": [round(item["anon_peak_above_before"] / 2**20) for item in flushes],
        "flush_index_growth_MiB": [round(item["index_growth"] / 2**20) for item in flushes],
        "index_MiB_at_end": index_bytes / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ids", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=65536)
    parser.add_argument("--host-cache", default="64MiB")
    parser.add_argument("--flush-every", type=int, default=2_000_000, help="rows written between flushes")
    parser.add_argument("--updates", type=int, default=1_000_000, help="random rows rewritten after the load")
    parser.add_argument("--backends", default="lmdb,mmap")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = []
    for backend in args.backends.split(","):
        with tempfile.TemporaryDirectory(dir=".") as directory:
            results.append(run_backend(backend, args, Path(directory) / "store"))
    columns = [name for name in results[0] if not name.startswith("flush_") or name.endswith("MiB")]
    print(" | ".join(columns))
    for result in results:
        cells = [result[name] for name in columns]
        print(" | ".join(f"{cell:.3g}" if isinstance(cell, float) else str(cell) for cell in cells))
    for result in results:
        print(f"{result['backend']}: each flush's anonymous peak (MiB):", result["flush_anon_peaks_MiB"])
        print(
            f"{result['backend']}: each flush's growth of the key index (MiB):",
            result["flush_index_growth_MiB"],
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
