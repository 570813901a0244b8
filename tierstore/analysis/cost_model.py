"""A cost model of row movement: from a predicted hit-rate curve and bandwidths measured on this
machine, the time a training step spends moving rows between the tiers for given cache sizes,
and the smallest budgets that come near the best the memory allows.

Training writes every row it looks up, so each row brought into the host tier from the cold
store is written back when evicted: a host miss costs a cold read and a cold write. On a GPU,
each row the device tier misses is copied host to device and written back when evicted (without
a device tier, every row looked up crosses, and its update back). Every row the device tier does
not hold (every row, without a GPU) is gathered from DRAM.
Tiers are exclusive, so the device tier of ``D`` rows over a host tier of ``H`` hits as one
cache of ``D + H`` rows for the cold store.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ..store import TieredStore
from ..tiers.row_cache import RowCache

NEAR_BEST = 1.05  # a recommended budget's predicted time is within this factor of the best one


@dataclasses.dataclass
class Bandwidths:
    """Bytes per second of row movement on this machine (``host_to_device`` None without a GPU)."""

    cold_read: float
    cold_write: float
    dram_gather: float  # rows gathered from a host tier larger than the CPU's caches
    host_to_device: float | None


def measure_bandwidths(row_width: int, backend: str, rows: int = 200_000, batch: int = 4096) -> Bandwidths:
    """Time batches of random rows read from and written to a cold store of ``rows`` rows of
    ``row_width`` values (in the page cache: the figures are an upper bound for a store larger than DRAM), and
    copied host to device when a GPU is present. Best of a few rounds, as the machine is shared."""
    random = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="tierstore-profile-") as directory:
        with TieredStore(
            Path(directory) / "store", dim=row_width, backend=backend, host_cache=batch
        ) as store:
            cold = store.stack.cold
            row_bytes = store.metadata.row_width * store.metadata.torch_dtype.itemsize
            keys = torch.arange(rows)
            initial = torch.randn(rows, store.metadata.row_width)
            if cold.can_bulk_load():
                cold.bulk_load(keys, initial)
            else:
                cold.put(keys, initial)
            cold.flush()
            batches = [torch.from_numpy(np.unique(random.integers(0, rows, batch))) for _ in range(8)]
            moved = sum(ids.numel() for ids in batches) * row_bytes
            values = torch.randn(batch, store.metadata.row_width)

            def read() -> None:
                for ids in batches:
                    cold.get(ids, torch.zeros_like(ids))

            def write() -> None:  # evicted rows are staged, and committed by the next flush
                for ids in batches:
                    cold.put(ids, values[: ids.numel()])
                cold.flush()

            cold_read, cold_write = _best(read, moved), _best(write, moved)
    table = torch.randn(max(rows, (256 << 20) // (row_width * 4)), row_width)  # past the CPU's caches
    picks = [torch.from_numpy(random.integers(0, table.shape[0], 8 * batch))]
    gathered = picks[0].numel() * row_width * 4
    dram = _best(lambda: table.index_select(0, picks[0]), gathered)
    to_device = None
    if torch.cuda.is_available():
        pinned = torch.randn(8 * batch, row_width).pin_memory()

        def copy() -> None:
            pinned.to("cuda", non_blocking=True)
            torch.cuda.synchronize()

        to_device = _best(copy, pinned.nbytes)
    return Bandwidths(cold_read, cold_write, dram, to_device)


def _best(run, moved_bytes: int) -> float:
    """Bytes per second of ``run()`` moving ``moved_bytes``, the fastest of three runs."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return moved_bytes / max(best, 1e-9)


def hit_rate_at(curve_rows: list[int], curve_rates: list[float], rows: float) -> float:
    """The curve's hit rate at ``rows`` (linear in log rows between its points; 0 rows hit nothing)."""
    if rows <= 0:
        return 0.0
    log_rows = np.log(np.asarray(curve_rows, dtype=np.float64))
    first = curve_rates[0] * rows / curve_rows[0]  # below the curve: towards 0 hits at 0 rows
    return float(first if rows < curve_rows[0] else np.interp(np.log(rows), log_rows, curve_rates))


def movement_seconds(
    curve_rows: list[int],
    curve_rates: list[float],
    device_rows: int,
    host_rows: int,
    lookups: int,
    row_bytes: int,
    bandwidths: Bandwidths,
) -> tuple[float, float]:
    """``(seconds, rows moved)`` per step of ``lookups`` for a device tier of ``device_rows`` over a
    host tier of ``host_rows``."""
    both = hit_rate_at(curve_rows, curve_rates, device_rows + host_rows)
    cold_misses = lookups * (1 - both)
    seconds = cold_misses * row_bytes * (1 / bandwidths.cold_read + 1 / bandwidths.cold_write)
    moved = 2 * cold_misses
    from_host = lookups  # every row not resident on the device is gathered from the host tier
    if bandwidths.host_to_device:  # without a device tier every row looked up crosses, twice
        from_host = lookups * (1 - hit_rate_at(curve_rows, curve_rates, device_rows))
        seconds += 2 * from_host * row_bytes / bandwidths.host_to_device
        moved += 2 * from_host
    seconds += from_host * row_bytes / bandwidths.dram_gather
    return seconds, moved


def plan(
    curve_rows: list[int],
    curve_rates: list[float],
    lookups: int,
    row_width: int,
    bandwidths: Bandwidths,
    host_memory: int,
    device_memory: int,
) -> dict:
    """The smallest host and device budgets (bytes, on the curve's sizes) whose predicted movement
    time per step is within ``NEAR_BEST`` of the best under ``host_memory`` and ``device_memory``
    bytes, with what the model predicts for them."""
    row_bytes = row_width * 4

    def cost(rows: int) -> int:
        return RowCache.nbytes_for(rows, row_width, torch.float32) if rows else 0

    sizes = [0] + [rows for rows in curve_rows if rows >= min(lookups, curve_rows[-1])]
    hosts = [rows for rows in sizes if rows and cost(rows) <= host_memory]
    devices = [rows for rows in sizes if cost(rows) <= device_memory] if bandwidths.host_to_device else [0]
    if not hosts:
        raise ValueError(
            f"a host budget of {host_memory:,} bytes holds fewer rows than a batch of {lookups:,} "
            f"lookups needs; raise --host-memory"
        )
    options = []
    for device_rows in devices:
        for host_rows in hosts:
            seconds, moved = movement_seconds(
                curve_rows, curve_rates, device_rows, host_rows, lookups, row_bytes, bandwidths
            )
            options.append((seconds, cost(host_rows) + cost(device_rows), host_rows, device_rows, moved))
    best = min(option[0] for option in options)
    seconds, _, host_rows, device_rows, moved = min(
        (option for option in options if option[0] <= best * NEAR_BEST + 1e-12), key=lambda o: (o[1], o[0])
    )
    return {
        "host_cache_bytes": cost(host_rows),
        "host_cache_rows": host_rows,
        "device_cache_bytes": cost(device_rows),
        "device_cache_rows": device_rows,
        "predicted_rows_moved_per_step": moved,
        "predicted_movement_ms_per_step": 1e3 * seconds,
        "best_movement_ms_per_step": 1e3 * best,
        "host_memory_bytes": host_memory,
        "device_memory_bytes": device_memory if bandwidths.host_to_device else 0,
        "bandwidths_bytes_per_s": dataclasses.asdict(bandwidths),
    }
