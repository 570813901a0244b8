"""Hit-rate curves: a key trace replayed through a store at several host-cache sizes (what
``tierstore bench`` shows).

For each size: our store (LFU, its ageing chosen online, batched: a batch's distinct ids are made
resident together) with throughput and per-batch latency; per tier hits, rows and bytes moved, evictions;
optionally the store evicting by next use within a horizon; and the hit rates of LRU, FIFO and
Belady's MIN caches of the same size on the same trace, replayed one access at a time
(``reference_policies``, native loops). MIN is the ceiling for any cache of that size, so the
gap to it is the headroom; with MIN comes MIN over the store's batches (``belady_batched``), the
ceiling for a cache that makes each batch resident whole, as the store does: the gap between the
two is what batching costs, the gap below it what the policy leaves.

A hit rate is 1 - misses / lookups, a miss being a row brought into the cache: one access at a
time, the first access to an absent id brings it in and the next ones hit. For our store that is
1 - (rows brought into the host cache) / lookups, so the figures compare like with like. The
store's own counters (in the JSON, ``lookup_hit_rate``) count every lookup of an id absent when
its batch started as a miss, which is lower where an id repeats within a batch.
"""

from __future__ import annotations

import math
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ..budget import parse_bytes
from ..lookahead import prefetch
from ..progress import bar as progress_bar
from ..store import TieredStore
from ..tiers.admission import admission_filter
from .reference_policies import policy_hit_counts
from .traces import Trace

REFERENCE_POLICIES = ("lru", "fifo", "belady")
BATCH_SHARE = 1 / 8  # of a cache's rows: the most a replayed batch holds
_UNITLESS_FRACTION = re.compile(r"^[0-9]*\.[0-9]+$")  # "0.05": a size missing its unit


def horizon_lookups(horizon: str) -> int | str:
    """``--horizon`` as ``prefetch`` takes it: ``"10x"`` as is, a count of lookups as an int."""
    text = horizon.strip()
    return int(text) if text.isdigit() else text


def cache_rows(size: str, distinct: int | None, row_bytes: int) -> int:
    """Rows a cache ``size`` holds: a share of the trace's distinct ids ("5%"), a row count
    ("20000") or bytes of rows ("64MiB"). ``distinct`` None: not known yet (the size is only
    checked; a share then counts as one row)."""
    text = size.strip()
    if _UNITLESS_FRACTION.match(text):  # "0.05" is neither a share (5%) nor bytes nor rows
        raise ValueError(
            f"cache size {size!r} has no unit: give a share of distinct ids with a % "
            f"({float(text) * 100:g}%), a whole number of rows (20000) or bytes with a unit (64MiB)"
        )
    try:
        if text.endswith("%"):
            share = float(text[:-1]) / 100
            rows = round(share * distinct) if distinct is not None else int(share > 0)
        elif text.isdigit():
            rows = int(text)
        else:
            rows = parse_bytes(text) // row_bytes
    except ValueError as error:
        raise ValueError(
            f"cache size {size!r} does not parse ({error}); use a share of distinct ids (5%), "
            f"a row count (20000) or bytes (64MiB)"
        ) from None
    if rows < 1:
        of_distinct = "" if distinct is None else f"{distinct:,} distinct ids, "
        raise ValueError(f"cache size {size!r} holds no rows ({of_distinct}{row_bytes} bytes a row)")
    return rows


def run_store(
    trace: Trace,
    rows: int,
    batch_size: int,
    dim: int,
    backend: str,
    progress: bool | None,
    lookahead: int = 0,
    admission: int = 0,
    held: bool = False,
    warm: torch.Tensor | None = None,
    horizon: int | str | None = None,
    half_life: float | None = None,
) -> dict:
    """Replay ``trace`` through a temporary store whose host cache holds ``rows`` rows (LFU aged
    at ``half_life`` lookups; None: the default, its ageing chosen online), through a
    lookahead pipeline (``tierstore.prefetch``) of ``lookahead`` batches if that is not 0, behind
    an admission filter of ``admission`` lookups if that is not 0, evicting by next use within
    ``horizon`` (``prefetch(horizon=)``; inline, or with the window's worker where ``lookahead``
    is set) if that is not None. ``held``: the table holds every
    id of the trace before the replay (as a trained one does), and ``warm`` ids (a hot-set
    ranking) are preloaded into its cache at open. Hit rates are also given over the first tenth
    of the lookups and over the rest."""
    keys = torch.from_numpy(trace.keys)
    latencies = []
    with tempfile.TemporaryDirectory(prefix="tierstore-bench-") as directory:
        path = Path(directory) / "store"
        settings = {"dim": dim, "backend": backend, "host_cache": rows, "half_life": half_life}
        if admission:
            settings["policy"] = admission_filter(admission)
        if held:
            with TieredStore(path, **settings) as store:
                distinct = torch.unique(keys)
                store.load(distinct, torch.zeros(distinct.numel(), dim))
        with TieredStore(path, warm=warm, **settings) as store:
            out = torch.empty(batch_size, dim)
            batches = keys.split(batch_size)
            first_tenth = max(1, round(len(batches) / 10))
            # the worker, whatever the cores: what its pins do to the hit rate is the measure here
            if horizon is not None:
                loop = prefetch(
                    batches, store, max(lookahead, 1), background=bool(lookahead), horizon=horizon
                )
            elif lookahead:
                loop = prefetch(batches, store, lookahead, background=True)
            else:
                loop = batches
            start = time.perf_counter()
            for number, batch in enumerate(
                progress_bar(
                    loop,
                    total=len(batches),
                    desc=f"store, {rows:,} rows"
                    + (f", lookahead {lookahead}" if lookahead else "")
                    + (f", horizon {horizon}" if horizon is not None else "")
                    + (f", admission {admission}" if admission else ""),
                    unit="batch",
                    leave=False,
                    progress=progress,
                )
            ):
                if number == first_tenth:
                    at_tenth = store.stats()["host"]["rows_in"]
                began = time.perf_counter()
                store.get(batch, out=out[: batch.numel()])
                latencies.append(time.perf_counter() - began)
            seconds = time.perf_counter() - start
            tiers = store.stats()
            warmed = store.warmed_rows
    host = tiers["host"]
    early = sum(batch.numel() for batch in batches[:first_tenth])
    moved_early = at_tenth - warmed if len(batches) > first_tenth else host["rows_in"] - warmed
    return {
        "hit_rate": 1 - (host["rows_in"] - warmed) / keys.numel(),
        "first_tenth_hit_rate": 1 - moved_early / early,
        "rest_hit_rate": 1 - (host["rows_in"] - moved_early - warmed) / max(keys.numel() - early, 1),
        "warmed_rows": warmed,
        "lookup_hit_rate": host["hits"] / keys.numel(),
        # lookups of rows the table held but the cache did not when their batch ran (new ids are
        # made, not read)
        "waited": (host["misses"] - tiers["cold"]["initialized"]) / keys.numel(),
        "lookups_per_s": keys.numel() / seconds,
        "batch_latency_ms_p50": 1e3 * float(np.percentile(latencies, 50)),
        "batch_latency_ms_p99": 1e3 * float(np.percentile(latencies, 99)),
        "tiers": tiers,
    }


def hit_rate_curve(
    trace: Trace,
    sizes: list[str],
    policies: list[str],
    batch_size: int = 4096,
    dim: int = 16,
    backend: str = "mmap",
    progress: bool | None = None,
    lookahead: int = 0,
    admission: int = 0,
    warm: torch.Tensor | None = None,
    horizon: str | None = None,
    ageing: bool = False,
) -> dict:
    """Every figure of the benchmark, as a JSON-ready dict. Batches hold at most an eighth of the
    cache's rows (``BATCH_SHARE``; as in training, a batch is a small part of what the cache
    holds, so a policy has rows to choose among). ``lookahead``: also replay through a lookahead
    pipeline of that many batches (``tierstore_lookahead``); ``horizon`` (``"10x"``: a multiple of
    each cache size, or a number of lookups): also evicting by next use within it
    (``tierstore_horizon``, with the lookahead's window if one is given); ``ageing``: also with
    LFU's two fixed ageings the default chooses among at its ends, plain LFU (``lfu_no_ageing``)
    and LFU aged at 4x the cache (``lfu_aged_4x``, the default before it adapted); ``admission``: also
    behind an admission filter of that many lookups (``tierstore_admission``); ``warm`` (hot
    ids): also replay a table that holds every id, from a cold cache (``tierstore_held``) and
    warm-started with them (``tierstore_warm``)."""
    distinct = trace.distinct_ids
    row_bytes = dim * 4
    report = {
        "trace": trace.name,
        "accesses": int(trace.keys.size),
        "distinct_ids": distinct,
        "columns": [{"name": n, "first_key": a, "end_key": b} for n, a, b in trace.columns],
        "batch_size": batch_size,
        "dim": dim,
        "backend": backend,
        "lookahead": lookahead,
        "horizon": horizon,
        "ageing": ageing,
        "admission": admission,
        "warm": warm is not None,
        "sizes": [],
    }
    all_rows = [cache_rows(size, distinct, row_bytes) for size in sizes]  # every size checked first
    all_batches = [max(1, min(batch_size, int(rows * BATCH_SHARE))) for rows in all_rows]
    reference = policy_hit_counts(
        trace.keys, all_rows, policies, batches=all_batches if "belady" in policies else None
    )
    for number, (size, rows, batch) in enumerate(zip(sizes, all_rows, all_batches)):
        entry = {
            "size": size,
            "rows": rows,
            "share_of_distinct": rows / distinct,
            "batch_size": batch,
            "tierstore_lfu": run_store(trace, rows, batch, dim, backend, progress),
        }
        if lookahead:
            entry["tierstore_lookahead"] = run_store(trace, rows, batch, dim, backend, progress, lookahead)
        if ageing:
            entry["lfu_no_ageing"] = run_store(trace, rows, batch, dim, backend, progress, half_life=math.inf)
            entry["lfu_aged_4x"] = run_store(trace, rows, batch, dim, backend, progress, half_life=4.0 * rows)
        if horizon is not None:
            entry["tierstore_horizon"] = run_store(
                trace, rows, batch, dim, backend, progress, lookahead, horizon=horizon_lookups(horizon)
            )
        if admission:
            entry["tierstore_admission"] = run_store(
                trace, rows, batch, dim, backend, progress, admission=admission
            )
        if warm is not None:
            entry["tierstore_held"] = run_store(trace, rows, batch, dim, backend, progress, held=True)
            entry["tierstore_warm"] = run_store(
                trace, rows, batch, dim, backend, progress, held=True, warm=warm
            )
        for policy in reference:
            entry[policy] = {"hit_rate": reference[policy][number] / trace.keys.size}
        report["sizes"].append(entry)
    return report
