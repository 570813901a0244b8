"""Building a store's tiers from its settings: the one place that turns budgets into row counts,
resolves each tier's backend and opens the cold store."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import psutil
import torch

from ..budget import horizon_nbytes, rows_for_budget
from ..kernels import host_kernels
from ..kernels.cache_passes import cache_passes_of
from ..metadata import StoreMetadata
from ..validation import integral
from . import backends
from .cold import open_cold_store
from .config import TierConfig
from .direct_layout import DirectLayout
from .policies import LfuWithAgeing
from .row_cache import RowCache
from .stack import TierStack

INITIAL_ROWS = 4096  # slots a host tier that grows on demand starts with


def check_backends(config: TierConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ``ValueError`` (before anything is created) when a requested backend cannot run."""
    backends.resolve("device", config.device_cache_backend, device, dtype)
    backends.resolve("host", config.host_cache_backend, device, dtype)


def rows_by_table(most_rows: Any) -> list[int | None] | None:
    """``TieredStore``'s ``most_rows`` checked, as each table's rows by number (None: unbounded),
    or None where the store's ids are unbounded."""
    if most_rows is None:
        return None
    many = isinstance(most_rows, (list, tuple))
    table_rows = [integral(rows) for rows in most_rows] if many else [integral(most_rows)]
    for rows in table_rows:
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int)):
            raise TypeError(
                "most_rows must be an int (ids), None (any) or a list of them (each table's), "
                f"got {most_rows!r}"
            )
        if rows is not None and rows < 0:
            raise ValueError(f"most_rows must be a non-negative number of ids or None (any), got {most_rows}")
    if many and not table_rows:
        raise ValueError("most_rows is an empty list: give each table's rows, or None (any)")
    return table_rows


def build_caches(
    metadata: StoreMetadata,
    config: TierConfig,
    device: torch.device,
    table_rows: list[int | None] | None = None,
) -> list[RowCache]:
    """The device tier (on ``device``, if budgeted) and the host tier (if budgeted), top first, each
    with no more slots than the tables' ``table_rows`` (``rows_by_table``: the most distinct ids
    they look up; None: no bound), a host tier on the tuned host build addressing the rows of
    bounded tables directly (``DirectLayout``); raises ``ValueError`` when no cache tier has a
    budget. Touches no file."""
    on_cuda = device.type == "cuda"
    device_memory = torch.cuda.get_device_properties(device).total_memory if on_cuda else None
    ram = psutil.virtual_memory().total
    tiers = [
        ("device", config.device_cache, device, config.device_cache_backend, device_memory),
        ("host", config.host_cache, torch.device("cpu"), config.host_cache_backend, ram),
    ]
    caches = []
    for name, budget, tier_device, requested, memory in tiers:
        backend = backends.resolve(name, requested, device, metadata.torch_dtype, metadata.state_in_row_dtype)
        horizon = config.horizon if not caches else None  # the top tier holds a horizon's pins
        cache = _cache_tier(
            name, budget, memory, tier_device, backend, metadata, config, on_cuda, horizon, table_rows
        )
        if cache is not None:
            caches.append(cache)
    if not caches:
        raise ValueError(
            "at least one cache tier is needed: give host_cache or device_cache a budget above 0"
        )
    return caches


def open_tiers(
    path: Path,
    metadata: StoreMetadata,
    config: TierConfig,
    caches: list[RowCache],
    read_only: bool,
    new: bool,
) -> TierStack:
    """``caches`` over the cold store at ``path`` (``new``: create its files)."""
    return TierStack(caches, open_cold(path, metadata, config, read_only, new), metadata)


def index_kernels(config: TierConfig):
    """The kernels the cold stores' key indexes run on: the host tier's build, None (torch
    indexes) where the host tier runs on torch."""
    return None if config.host_cache_backend == "torch" else host_kernels()[0]


def open_cold(path: Path, metadata: StoreMetadata, config: TierConfig, read_only: bool, new: bool):
    """The cold store at ``path`` (``new``: create its files), whose key indexes follow the host
    tier's backend."""
    return open_cold_store(
        metadata.backend,
        path,
        metadata.row_width,
        metadata.torch_dtype,
        read_only,
        index_kernels(config),
        new,
        checksums=metadata.row_checksums,
    )


def _cache_tier(
    name: str,
    budget,
    memory: int | None,
    device: torch.device,
    backend,
    metadata: StoreMetadata,
    config: TierConfig,
    on_cuda: bool,
    horizon: int | str | None,
    table_rows: list[int | None] | None,
) -> RowCache | None:
    """The ``name`` cache tier on ``device`` with as many rows as ``budget`` pays for (None: none),
    beside the memory of a lookahead ``horizon`` where the budget is bytes (see ``TierConfig``),
    and no more than ``table_rows`` hold (at least one: a budget a table cannot use is not
    allocated), with a direct layout where it can have one."""
    row_width, dtype = metadata.row_width, metadata.torch_dtype
    reserve = horizon is not None and isinstance(budget, str)
    most_rows = None if table_rows is None or None in table_rows else sum(table_rows)
    # A host tier on the tuned host build gives its bounded tables' rows homes (their 4 bytes a
    # slot are budgeted where a table has rows to give them).
    direct = (
        table_rows is not None
        and any(table_rows)
        and device.type == "cpu"
        and cache_passes_of(getattr(backend, "kernels", None)) is not None
    )

    def nbytes(count: int) -> int:
        held = horizon_nbytes(horizon, count) if reserve else 0
        cost = RowCache.nbytes_for(count, row_width, dtype, backend, config.policy, config.half_life, direct)
        return cost + held

    rows = rows_for_budget(budget, nbytes, memory)
    if not rows:
        return None
    half_life = config.half_life
    if most_rows is not None:
        rows = max(1, min(rows, most_rows))
        if rows == most_rows and half_life is None:  # held whole: nothing is evicted, no ageing to choose
            half_life = math.inf
    # A table that grows on demand starts its host tier small and grows it to the budget as rows
    # come (where its policy can grow): nothing is allocated for a budget it does not use.
    grows = most_rows is None and device.type == "cpu" and (config.policy or LfuWithAgeing).grows
    pin_memory = on_cuda and name == "host"  # page-locked rows copy to the GPU asynchronously
    cache = RowCache(
        name,
        min(rows, INITIAL_ROWS) if grows else rows,
        row_width,
        dtype,
        device,
        half_life,
        pin_memory,
        backend,
        config.policy,
        grows_to=rows,
        direct=DirectLayout.choose(table_rows, rows) if direct else None,
    )
    cache.horizon_budget = horizon_nbytes(horizon, rows) if reserve else None
    return cache
