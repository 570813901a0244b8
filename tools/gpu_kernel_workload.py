"""Every device-tier kernel, a few hundred launches, on a real GPU: the workload that
``tools/gpu_checks.sh sanitize`` runs under compute-sanitizer (the test suite would take hours
there, since every torch kernel is instrumented too). Exits 0 when it ran to the end.

    python tools/gpu_kernel_workload.py [DTYPE...]   (float32 float16 bfloat16: the rows' dtypes run)
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import numpy as np
import torch

from tierstore import TieredEmbeddingBag, TieredStore, optim

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
OPTIMIZERS = {
    "sgd": lambda: optim.SGD(lr=0.1),
    "adagrad": lambda: optim.Adagrad(lr=0.1),
    "rowwise_adagrad": lambda: optim.RowWiseAdagrad(lr=0.1),
    "adam": lambda: optim.Adam(lr=0.05),
}


def store_traffic(directory: Path, rng: np.random.Generator) -> None:
    """Gets, puts and flushes through tiny tiers: find, insert, erase, gather, scatter, touch and
    victim scores, with evictions every step."""
    with TieredStore(
        directory / "store",
        dim=12,
        host_cache=40,
        device_cache=24,
        device="cuda",
        device_cache_backend="cuda",
    ) as store:
        for step in range(60):
            ids = torch.from_numpy(rng.integers(0, 200, int(rng.integers(1, 24)))).cuda()
            if step % 3 == 0:
                store.put(ids, torch.randn(ids.numel(), 12, device="cuda"))
            store.get(ids)
            if step % 20 == 19:
                store.flush()


def training(
    directory: Path, rng: np.random.Generator, name: str, dim: int, dtype: torch.dtype = torch.float32
) -> None:
    """Training steps with weighted bags (the bag-weight gradient kernel) and optimizer ``name``'s
    update kernel on ``dtype`` rows (16-bit: the ``_16`` kernels, stochastic rounding for one
    dtype); ``dim`` 8 takes the 16-byte gather, 6 the scalar one (odd 16-bit widths the 16-bit one)."""
    table = TieredEmbeddingBag(
        64,
        dim,
        mode="sum",
        dtype=dtype,
        path=directory / f"{name}-{dim}-{str(dtype)[6:]}",
        host_cache=12,
        device_cache=24,
        optimizer=dataclasses.replace(OPTIMIZERS[name](), stochastic_rounding=dtype == torch.bfloat16),
        device="cuda",
        device_cache_backend="cuda",
    )
    for _ in range(10):
        lengths = rng.integers(0, 5, 6)
        ids = torch.from_numpy(rng.integers(0, 64, int(lengths.sum()))).cuda()
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]])).cuda()
        weights = torch.rand(ids.numel(), device="cuda", dtype=dtype, requires_grad=True)
        (table(ids, offsets, weights).float() * torch.randn(6, dim, device="cuda")).sum().backward()
    table.close()


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("dtypes", nargs="*", choices=list(DTYPES), default=list(DTYPES))
    dtypes = [DTYPES[name] for name in parser.parse_args().dtypes]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as directory:
        if torch.float32 in dtypes:
            store_traffic(Path(directory), rng)
        for name in OPTIMIZERS:
            for dtype in dtypes:
                for dim in (8, 6) if dtype == torch.float32 else (8, 5):
                    training(Path(directory), rng, name, dim, dtype)
    torch.cuda.synchronize()
    print("every kernel ran")


if __name__ == "__main__":
    main()
