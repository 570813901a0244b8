"""What a trace asks of the cache tiers, predicted from a sample of it (``tierstore profile``).

From a spatial sample of the ids (``sampling.spatial_sample``): the hit-rate curve against cache
size of our store's LFU and of Belady's MIN, by miniature simulation (the sample replayed
through a cache whose size, and batch, are scaled by the sample rate; FAE and SHARDS find hot
sets the same way, without parsing every access), and the hot-set sizes that cover a share of
the accesses. From a uniform sample of the accesses: the hot ids, ranked (a warm-start file).
The cost model (``cost_model``) turns the curve into recommended budgets.
"""

from __future__ import annotations

import math

import numpy as np

from ..progress import bar as progress_bar
from .hit_rates import cache_rows, run_store
from .reference_policies import belady_hits
from .sampling import CHUNK, SpatialSample, ranked_ids, spatial_sample
from .traces import Trace

COVERAGE = (0.5, 0.8, 0.9, 0.99)
CURVE_POINTS = 12  # cache sizes of the curve, geometric up to every id
MIN_SCALED_ROWS = 256  # fewer simulated rows hold too few sampled ids: the prediction is noise
MIN_SAMPLED_IDS = 32768  # fewer make the prediction swing by points with the ids drawn
WELL_COUNTED = 10  # an id counted this often in a sample of the accesses: its frequency is known


def coverage_rows(sample: SpatialSample, head: np.ndarray, head_accesses: np.ndarray) -> dict[str, int]:
    """Estimated rows of the most accessed ids that take each share of ``COVERAGE`` of the accesses.

    Few ids take most accesses, so an id sample holds few of them, by chance: the ``head`` ids
    (the busiest in a sample of the accesses) count with their exact ``head_accesses``; the
    other ids come from the id sample, each standing for ``1 / rate`` ids of its (exact) count."""
    _, tail = np.unique(sample.keys[~np.isin(sample.keys, head)], return_counts=True)
    frequency = np.concatenate([head_accesses, tail]).astype(np.float64)
    weight = np.concatenate([np.ones(head.size), np.full(tail.size, 1 / sample.rate)])
    order = np.argsort(-frequency, kind="stable")
    frequency, weight = frequency[order], weight[order]
    covered = np.cumsum(frequency * weight) / np.sum(frequency * weight)
    rows = np.cumsum(weight)
    return {
        f"{share:.0%}": round(float(rows[min(int(np.searchsorted(covered, share - 1e-12)), rows.size - 1)]))
        for share in COVERAGE
    }


def exact_counts(keys: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """int64 [len(ids)]: how often each of ``ids`` (distinct) occurs in ``keys``, counted in chunks."""
    order = np.argsort(ids)
    ordered = ids[order]
    counts = np.zeros(ids.size, dtype=np.int64)
    if ids.size == 0:
        return counts
    for start in range(0, keys.size, CHUNK):
        chunk = keys[start : start + CHUNK]
        where = np.minimum(np.searchsorted(ordered, chunk), ids.size - 1)
        counts[order] += np.bincount(where[ordered[where] == chunk], minlength=ids.size)
    return counts


def predicted_hit_rates(
    sample: SpatialSample, rows: int, batch_size: int, dim: int, backend: str
) -> dict[str, float]:
    """Hit rates of our LFU and of MIN with a ``rows``-row cache, replayed over ``sample`` with the
    cache and the batch scaled by its rate (a miniature simulation; a batch is at most the
    cache, as in ``bench``).

    SHARDS' adjustment: the sample holds more (or fewer) accesses than the rate's share of the
    trace when it drew busier (or quieter) ids, mostly hot ones; the difference is taken from (or
    added to) its hits, and its hit rate is over the expected count."""
    scaled = max(1, round(rows * sample.rate))
    batch = max(1, min(round(batch_size * sample.rate), scaled))
    store = run_store(Trace(sample.keys, "sample", []), scaled, batch, dim, backend, progress=False)
    hits = {
        "lfu": sample.keys.size - round(sample.keys.size * (1 - store["hit_rate"])),
        "min": belady_hits(sample.keys, scaled),
    }
    expected = sample.rate * sample.accesses
    surplus = sample.keys.size - expected
    return {policy: min(1.0, max(0.0, (count - surplus) / expected)) for policy, count in hits.items()}


def profile_trace(
    trace: Trace,
    sizes: list[str],
    sample_rate: float,
    max_ids: int,
    batch_size: int = 4096,
    dim: int = 16,
    backend: str = "mmap",
    hot_rows: int | None = None,
    progress: bool | None = None,
) -> tuple[dict, np.ndarray]:
    """``(every figure, JSON-ready; the hot ids ranked)``. ``sizes`` are as ``bench --sizes``,
    shares taken of the estimated distinct ids. The id sample takes ``sample_rate`` of the ids, or
    more where it would hold fewer than ``MIN_SAMPLED_IDS`` ids or simulate the smallest size with
    fewer than ``MIN_SCALED_ROWS`` rows.
    ``hot_rows``: length of the ranking (default: the largest size)."""
    sample = spatial_sample(trace.keys, sample_rate, max_ids)
    if sample.keys.size == 0:
        raise ValueError(
            f"a {sample_rate:.2%} sample of {trace.name} holds no ids ({trace.keys.size:,} accesses); "
            f"raise --sample"
        )
    distinct = max(1, round(sample.distinct / sample.rate))
    row_bytes = dim * 4
    sizes_rows = [cache_rows(size, distinct, row_bytes) for size in sizes]
    needed = min(1.0, max(MIN_SCALED_ROWS / min(sizes_rows), MIN_SAMPLED_IDS / distinct))
    raised = needed > sample.rate and sample.distinct < max_ids
    if raised:  # too few ids to predict from, or too few simulated rows for the smallest cache
        sample = spatial_sample(trace.keys, needed, max_ids)
        distinct = max(1, round(sample.distinct / sample.rate))
        sizes_rows = [cache_rows(size, distinct, row_bytes) for size in sizes]
    smallest = max(1, math.ceil(MIN_SCALED_ROWS / sample.rate))
    grid = sorted(
        {round(x) for x in np.geomspace(smallest, max(smallest, distinct), CURVE_POINTS)} | set(sizes_rows)
    )
    curve = {}
    for rows in progress_bar(grid, desc="miniature simulations", unit="size", leave=False, progress=progress):
        curve[rows] = predicted_hit_rates(sample, rows, batch_size, dim, backend)
    hot_ids, hot_counts, ranking_bytes = ranked_ids(trace.keys, sample_rate, hot_rows or max(sizes_rows))
    head = hot_ids[hot_counts >= WELL_COUNTED]
    report = {
        "trace": trace.name,
        "accesses": int(trace.keys.size),
        "estimated_distinct_ids": distinct,
        "sample": {
            "rate": sample.rate,
            "requested_rate": sample_rate,
            "raised": raised,
            "max_ids": max_ids,
            "accesses": int(sample.keys.size),
            "ids": sample.distinct,
        },
        "profiler_bytes": sample.nbytes + ranking_bytes,
        "batch_size": batch_size,
        "dim": dim,
        "sizes": sizes,
        "sizes_rows": sizes_rows,
        "predicted_hit_rate": {
            policy: [curve[rows][policy] for rows in sizes_rows] for policy in ("lfu", "min")
        },
        "curve": {
            "rows": grid,
            "lfu": [curve[rows]["lfu"] for rows in grid],
            "min": [curve[rows]["min"] for rows in grid],
        },
        "hot_set_rows": coverage_rows(sample, head, exact_counts(trace.keys, head)),
        "hot_ids": int(hot_ids.size),
        "hot_ids_sampled_accesses": int(hot_counts.sum()),
    }
    return report, hot_ids


def hot_ids_by_column(trace: Trace, ranked: np.ndarray) -> dict[str, np.ndarray]:
    """Each source column's own ids (its key offset taken off) among the fused ``ranked`` ids, in
    their order: a warm start per table, as a collection's ``warm=`` takes it."""
    return {name: ranked[(ranked >= first) & (ranked < end)] - first for name, first, end in trace.columns}
