"""Stream a Zipf-skewed id workload through a store larger than its caches; print hits per tier.

python tools/demo.py --help
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import torch

from tierstore import TieredStore
from tierstore.workloads import ZipfIds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=1_000_000, help="distinct ids the workload draws from")
    parser.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the id distribution")
    parser.add_argument("--batches", type=int, default=200, help="batches to stream")
    parser.add_argument("--batch-size", type=int, default=16384, help="ids per batch")
    parser.add_argument("--dim", type=int, default=64, help="row width")
    parser.add_argument("--backend", choices=["lmdb", "mmap"], default="mmap")
    parser.add_argument("--host-cache", default="16MiB", help="host (DRAM) cache budget")
    parser.add_argument("--device-cache", default="4MiB", help="device cache budget (on --device)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    ids = ZipfIds(args.ids, args.alpha)(args.batches * args.batch_size)  # hot ids scattered over the id space
    with (
        tempfile.TemporaryDirectory() as directory,
        TieredStore(
            directory,
            dim=args.dim,
            backend=args.backend,
            host_cache=args.host_cache,
            device_cache=args.device_cache,
            device=args.device,
        ) as store,
    ):
        start = time.perf_counter()
        for batch in np.array_split(ids, args.batches):
            rows = store.get(torch.from_numpy(batch))
            store.put(torch.from_numpy(batch), rows * 0.99)  # a stand-in for a training update
        seconds = time.perf_counter() - start
        stats = store.stats()
        lookups = 2 * ids.size  # every id is read once and written once
        print(
            f"{ids.size:,} ids ({len(store):,} distinct rows, dim {args.dim}) in {seconds:.1f} s "
            f"= {lookups / seconds:,.0f} lookups/s"
        )
        print(
            f"{'tier':<8}{'capacity rows':>15}{'hits':>14}{'hit share':>11}{'rows in':>12}{'evictions':>12}"
        )
        for name in ("device", "host"):
            if name in stats:
                tier = stats[name]
                print(
                    f"{name:<8}{tier['capacity_rows']:>15,}{tier['hits']:>14,}{tier['hits'] / lookups:>11.1%}"
                    f"{tier['rows_in']:>12,}{tier['evictions']:>12,}"
                )
        cold = stats["cold"]
        print(
            f"{'cold':<8}{'(' + args.backend + ')':>15}{cold['hits']:>14,}{cold['hits'] / lookups:>11.1%}"
            f"{cold['rows_read']:>12,}{'':>12}"
        )
        print(
            f"new ids initialised: {cold['initialized']:,} ({cold['initialized'] / lookups:.1%} of lookups)"
        )


if __name__ == "__main__":
    main()
