"""Building a store's tiers from its settings: the one place that turns budgets into row counts,
resolves each tier's backend and opens the cold store."""

from __future__ import annotations

from pathlib import Path

import psutil
import torch

from ..budget import rows_for_budget
from ..config import TierConfig
from ..kernels import host_kernels
from ..metadata import StoreMetadata
from . import backends
from .cold import open_cold_store
from .row_cache import RowCache
from .stack import TierStack


def check_backends(config: TierConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ``ValueError`` (before anything is created) when a requested backend cannot run."""
    backends.resolve("device", config.device_cache_backend, device, dtype)
    backends.resolve("host", config.host_cache_backend, device, dtype)


def build_tiers(
    path: Path, metadata: StoreMetadata, config: TierConfig, device: torch.device, read_only: bool
) -> TierStack:
    """The device tier (on ``device``, if budgeted), the host tier (if budgeted) and the cold store
    at ``path``; raises ``ValueError`` when no cache tier has a budget."""
    dtype, row_width = metadata.torch_dtype, metadata.row_width
    on_cuda = device.type == "cuda"
    tiers = [
        (
            "device",
            config.device_cache,
            device,
            config.device_cache_backend,
            torch.cuda.get_device_properties(device).total_memory if on_cuda else None,
        ),
        (
            "host",
            config.host_cache,
            torch.device("cpu"),
            config.host_cache_backend,
            psutil.virtual_memory().total,
        ),
    ]
    caches = []
    for name, budget, tier_device, requested, memory in tiers:
        backend = backends.resolve(name, requested, device, dtype)

        def nbytes(count: int, backend=backend) -> int:
            return RowCache.nbytes_for(count, row_width, dtype, backend)

        rows = rows_for_budget(budget, nbytes, memory)
        if rows:
            caches.append(
                RowCache(
                    name,
                    rows,
                    row_width,
                    dtype,
                    tier_device,
                    config.half_life,
                    pin_memory=on_cuda and name == "host",
                    backend=backend,
                )
            )
    if not caches:
        raise ValueError(
            "at least one cache tier is needed: give host_cache or device_cache a budget above 0"
        )
    index_kernels = None if config.host_cache_backend == "torch" else host_kernels()[0]
    cold = open_cold_store(metadata.backend, path, row_width, dtype, read_only, index_kernels)
    return TierStack(caches, cold, metadata)
