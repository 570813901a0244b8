"""Benchmarks of the tiered store's CPU paths, each as a ratio to a baseline timed in the same run.

    python bench/bench_store.py --help

1. Host-cache hit path: hash-index probe + gather into a preallocated output, rows/s over
   ``torch.index_select(out=)`` on a plain in-RAM tensor of the same rows (target >= 0.5).
   Also shown: ``TieredStore.get(ids, out=)`` on its hit path (validation, probe, LFU touch, gather).
2. Cold-store batched ``get`` of a batch's distinct uncached rows, over a plain Python loop of
   LMDB ``txn.get`` over the same keys in arrival order, pre-encoded (targets: LMDB >= 2, mmap >= 10).
   Both read from the page cache (the store fits in RAM here); then one batch again with the LMDB
   file dropped from the page cache before each run (the SSD regime).
3. Host-cache memory: RSS growth of a filled cache over its raw row bytes (target <= 1.25 at dim 64).

Batches are 65,536 ids drawn Zipf(alpha) from ``--ids`` ids, hot ids scattered over the id space.
Results go to stdout as a table and to ``--json``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import torch

from tierstore import TieredStore
from tierstore.kernels import host_kernels
from tierstore.tiers import KernelRows, RowCache, Rows
from tierstore.tiers.cold import LmdbColdStore, MmapColdStore
from tierstore.tiers.cold.codec import encode_keys
from tierstore.workloads import ZipfIds


def zipf_batches(count: int, size: int, ids: int, alpha: float, seed: int = 0) -> list[torch.Tensor]:
    sample = ZipfIds(ids, alpha, seed)
    return [torch.from_numpy(sample(size)) for _ in range(count)]


def clean_random_rows(keys: torch.Tensor, dim: int) -> Rows:
    """Random rows for ``keys``, neither dirty nor fresh, to fill a cache."""
    no = torch.zeros(keys.numel(), dtype=torch.bool)
    return Rows(keys, torch.randn(keys.numel(), dim), no, no.clone())


def median_seconds(work, repeats: int) -> float:
    work()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def host_caches(capacity: int, dim: int) -> dict:
    """Makers of the host tier's backends that run here: "torch", and "openmp" when the kernels build."""
    makers = {"torch": lambda: RowCache("host", capacity, dim, torch.float32)}
    kernels, why_not = host_kernels()
    if kernels is None:
        print(f"host_cache_backend='openmp' is not measured: {why_not}")
    else:
        makers["openmp"] = lambda: RowCache(
            "host", capacity, dim, torch.float32, backend=KernelRows(kernels, "openmp")
        )
    return makers


def bench_host_hit_path(batches, dim: int, repeats: int) -> dict:
    distinct = torch.unique(torch.cat(batches))
    out = torch.empty(batches[0].numel(), dim)
    rows = sum(batch.numel() for batch in batches)
    results = {"cached_rows": distinct.numel()}
    for backend, make_cache in host_caches(distinct.numel(), dim).items():
        cache = make_cache()
        for part in distinct.split(1 << 18):
            cache.admit(clean_random_rows(part, dim))
        table = cache.rows.clone()  # the baseline: a plain tensor holding the same rows
        slot_batches = [cache.find(batch) for batch in batches]

        def baseline():
            for slots in slot_batches:
                torch.index_select(table, 0, slots, out=out)

        def ours():
            for batch in batches:
                cache.read(cache.find(batch), out=out)

        with tempfile.TemporaryDirectory() as directory:
            store = TieredStore(directory, dim=dim, host_cache=distinct.numel(), host_cache_backend=backend)
            for part in distinct.split(1 << 16):
                store.get(part)

            def store_get():
                for batch in batches:
                    store.get(batch, out=out)

            base, probe, whole = (median_seconds(f, repeats) for f in (baseline, ours, store_get))
            store.close()
        results[backend] = {
            "rows_per_s_index_select": rows / base,
            "rows_per_s_probe_gather": rows / probe,
            "rows_per_s_store_get": rows / whole,
            "ratio_probe_gather": base / probe,
            "ratio_store_get": base / whole,
        }
    return results


def bench_cold_get(batches, dim: int, cold_rows: int, ids: int, repeats: int) -> dict:
    needed = torch.unique(torch.cat(batches))
    extra = torch.from_numpy(np.random.default_rng(1).choice(ids, size=cold_rows, replace=False))
    keys = torch.unique(torch.cat([needed, extra]))
    # A batch's distinct (uncached) rows, in the order they first appear, as a plain loop meets them.
    requests = [batch[np.sort(np.unique(batch.numpy(), return_index=True)[1])] for batch in batches]
    results = {"cold_rows": keys.numel(), "rows_per_request": statistics.mean(r.numel() for r in requests)}
    with tempfile.TemporaryDirectory() as directory:
        stores = {
            "lmdb": LmdbColdStore(Path(directory), dim, torch.float32),
            "mmap": MmapColdStore(Path(directory), dim, torch.float32),
        }
        for store in stores.values():
            for part in keys.split(1 << 18):
                store.put(part, torch.randn(part.numel(), dim))
            store.flush()
        environment, database = stores["lmdb"]._env, stores["lmdb"]._rows
        encoded = [encode_keys(request.numpy()) for request in requests]

        def plain_loop():
            with environment.begin(db=database) as txn:
                for request in encoded:
                    values = [txn.get(key) for key in request]
                    assert len(values) == len(request)

        baseline = median_seconds(plain_loop, repeats)
        rows = sum(request.numel() for request in requests)
        results["rows_per_s_lmdb_txn_get_loop"] = rows / baseline
        for name, store in stores.items():
            seconds = median_seconds(lambda: [store.get(request) for request in requests], repeats)
            results[f"rows_per_s_{name}"] = rows / seconds
            results[f"ratio_{name}"] = baseline / seconds
        for store in stores.values():
            store.close()
        results["lmdb_from_disk"] = bench_lmdb_from_disk(Path(directory), dim, requests[0], encoded[0])
    return results


def bench_lmdb_from_disk(directory: Path, dim: int, request: torch.Tensor, encoded: list) -> dict:
    """One batch's LMDB get with the data file dropped from the page cache before each run (the
    SSD regime): sorted batched ``get`` vs the ``txn.get`` loop in arrival order."""
    data_files = list(directory.rglob("*.mdb"))

    def drop_page_cache():
        for path in data_files:
            descriptor = os.open(path, os.O_RDONLY)
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(descriptor)

    def timed(read) -> float:
        times = []
        for _ in range(3):
            drop_page_cache()
            store = LmdbColdStore(directory, dim, torch.float32, read_only=True)
            start = time.perf_counter()
            read(store)
            times.append(time.perf_counter() - start)
            store.close()
        return statistics.median(times)

    def plain_loop(store):
        with store._env.begin(db=store._rows) as txn:
            assert len([txn.get(key) for key in encoded]) == len(encoded)

    baseline, ours = timed(plain_loop), timed(lambda store: store.get(request))
    return {
        "rows": request.numel(),
        "rows_per_s_txn_get_loop": request.numel() / baseline,
        "rows_per_s_lmdb": request.numel() / ours,
        "ratio_lmdb": baseline / ours,
    }


def live_rss() -> int:
    """RSS after returning freed heap pages to the OS (glibc keeps them otherwise)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss


def bench_host_memory(rows: int, dim: int) -> dict:
    keys = torch.randperm(rows * 8)[:rows] * 3
    raw = rows * dim * 4
    results = {"rows": rows, "dim": dim, "raw_row_bytes": raw}
    for backend, make_cache in host_caches(rows, dim).items():
        before = live_rss()
        cache = make_cache()
        for part in keys.split(1 << 18):  # fill it, so every page is touched
            cache.admit(clean_random_rows(part, dim))
        grown = live_rss() - before
        results[backend] = {
            "rss_growth_bytes": grown,
            "accounted_bytes": cache.nbytes,
            "rss_over_raw": grown / raw,
        }
        del cache
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=4_000_000, help="id space the batches draw from")
    parser.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent")
    parser.add_argument("--batch-size", type=int, default=65536)
    parser.add_argument("--batches", type=int, default=8, help="batches per timed repeat")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument(
        "--cold-rows", type=int, default=1_000_000, help="rows in the cold stores besides the batches'"
    )
    parser.add_argument(
        "--memory-rows", type=int, default=2_000_000, help="rows of the cache whose RSS is measured"
    )
    parser.add_argument("--memory-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path("bench/results/store.json"))
    args = parser.parse_args()

    results = {"config": vars(args) | {"json": str(args.json), "torch_threads": torch.get_num_threads()}}
    results["host_memory"] = bench_host_memory(args.memory_rows, args.memory_dim)  # first: clean RSS
    batches = zipf_batches(args.batches, args.batch_size, args.ids, args.alpha)
    results["host_hit_path"] = bench_host_hit_path(batches, args.dim, args.repeats)
    results["cold_get"] = bench_cold_get(batches, args.dim, args.cold_rows, args.ids, args.repeats)

    hit, cold, memory = results["host_hit_path"], results["cold_get"], results["host_memory"]
    print(f"dim {args.dim}, batches of {args.batch_size:,} ids Zipf({args.alpha}) over {args.ids:,} ids")
    print(f"{'measure':<44}{'baseline':>16}{'ours':>16}{'ratio':>8}{'target':>8}")
    for backend in ("openmp", "torch"):
        if backend not in hit:
            continue
        row = hit[backend]
        print(
            f"{'host hit path, ' + backend + ': probe + gather':<44}{row['rows_per_s_index_select']:>16,.0f}"
            f"{row['rows_per_s_probe_gather']:>16,.0f}{row['ratio_probe_gather']:>8.2f}{'>=0.5':>8}"
        )
        print(
            f"{'host hit path, ' + backend + ': TieredStore.get':<44}{row['rows_per_s_index_select']:>16,.0f}"
            f"{row['rows_per_s_store_get']:>16,.0f}{row['ratio_store_get']:>8.2f}{'':>8}"
        )
    for name, target in (("lmdb", ""), ("mmap", ">=10")):
        print(
            f"{'cold get, ' + name + ' (rows/s vs txn.get loop)':<44}"
            f"{cold['rows_per_s_lmdb_txn_get_loop']:>16,.0f}"
            f"{cold[f'rows_per_s_{name}']:>16,.0f}{cold[f'ratio_{name}']:>8.2f}{target:>8}"
        )
    disk = cold["lmdb_from_disk"]
    print(
        f"{'cold get, lmdb, page cache dropped (rows/s)':<44}{disk['rows_per_s_txn_get_loop']:>16,.0f}"
        f"{disk['rows_per_s_lmdb']:>16,.0f}{disk['ratio_lmdb']:>8.2f}{'>=2':>8}"
    )
    for backend in ("openmp", "torch"):
        if backend in memory:
            print(
                f"{'host cache, ' + backend + ': RSS / raw rows (dim ' + str(args.memory_dim) + ')':<44}"
                f"{memory['raw_row_bytes']:>16,}{memory[backend]['rss_growth_bytes']:>16,}"
                f"{memory[backend]['rss_over_raw']:>8.3f}{'<=1.25':>8}"
            )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
