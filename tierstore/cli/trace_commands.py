"""The commands on id traces: ``bench`` and ``profile``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import psutil
import torch

from ..analysis.cost_model import measure_bandwidths, plan
from ..analysis.hit_rates import REFERENCE_POLICIES, cache_rows, hit_rate_curve, horizon_lookups
from ..analysis.profile import hot_ids_by_column, profile_trace
from ..analysis.traces import load_trace, split_columns
from ..budget import horizon_accesses, parse_bytes
from ..lookahead import MAX_LOOKAHEAD
from ..tiers.admission import MAX_COUNT
from ..warm_start import hot_ids
from .arguments import CommandError, progress_of
from .bench import format_table, plot_curve
from .profile import format_profile, plot_profile
from .transfer import (
    state_width,
)


def run_bench(args) -> int:
    policies = [p.strip().lower() for p in args.policy.split(",") if p.strip()]
    unknown = set(policies) - set(REFERENCE_POLICIES)
    if unknown:
        raise CommandError(
            f"unknown --policy {', '.join(sorted(unknown))}; choose from {', '.join(REFERENCE_POLICIES)}"
        )
    if not 0 <= args.lookahead <= MAX_LOOKAHEAD:
        raise CommandError(
            f"--lookahead must be in [0, {MAX_LOOKAHEAD}] batches (0: off), got {args.lookahead}"
        )
    if not 0 <= args.admission <= MAX_COUNT:
        raise CommandError(f"--admission must be in [0, {MAX_COUNT}] lookups (0: off), got {args.admission}")
    if args.horizon is not None:
        try:
            horizon_accesses(horizon_lookups(args.horizon), 1)
        except ValueError:
            raise CommandError(
                f"--horizon must be a multiple of each cache size (10x) or a number of lookups "
                f"(50000), got {args.horizon!r}"
            ) from None
    sizes = _sizes(args)
    json_path = args.out.with_name(args.out.name + ".json")
    _check_writable(json_path)  # before the run, not after it
    warm = None if args.warm is None else hot_ids(args.warm)
    trace = _trace(args)
    tables = split_columns(trace) if args.separate else [trace]
    for table in tables:  # every size fits every table before the first is run
        for size in sizes:
            try:
                cache_rows(size, table.distinct_ids, args.dim * 4)
            except ValueError as error:
                raise CommandError(
                    f"{table.name}: {error}"
                    + (
                        "; with --separate a share is of each column's own distinct ids"
                        if args.separate
                        else ""
                    )
                    + ": give larger --sizes or row counts"
                ) from None
    reports = []
    for number, table in enumerate(tables):
        report = hit_rate_curve(
            table,
            sizes,
            policies,
            args.batch_size,
            args.dim,
            args.backend,
            progress_of(args),
            args.lookahead,
            args.admission,
            warm,
            args.horizon,
            args.ageing,
        )
        print(format_table(report, policies))
        png = args.out.with_name(args.out.name + (f"-{number}" if args.separate else "") + ".png")
        plotted = plot_curve(report, policies, png)
        print(
            f"curve: {png}"
            if plotted
            else "(no curve: matplotlib is not installed; pip install 'tierstore[plot]')"
        )
        reports.append(report)
    json_path.write_text(json.dumps({"tables": reports} if args.separate else reports[0], indent=2))
    print(f"figures: {json_path}")
    return 0


def run_profile(args) -> int:
    rate = _sample_rate(args.sample)
    sizes = _sizes(args)
    host_memory = _memory("--host-memory", args.host_memory, psutil.virtual_memory().total)
    device_total = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0
    device_memory = _memory("--device-memory", args.device_memory, device_total)
    json_path, ids_path, tables_path, png_path = (
        args.out.with_name(args.out.name + suffix) for suffix in (".json", ".npy", "-tables.npz", ".png")
    )
    for path in (json_path, ids_path):
        _check_writable(path)  # before the run, not after it
    row_width = args.dim + state_width(args.optimizer, args.dim)
    trace = _trace(args)
    report, ranked = profile_trace(
        trace,
        sizes,
        rate,
        args.max_ids,
        args.batch_size,
        args.dim,
        args.backend,
        args.hot_rows,
        progress_of(args),
    )
    bandwidths = measure_bandwidths(row_width, args.backend)
    curve = report["curve"]
    report["recommendation"] = plan(
        curve["rows"],
        curve["lfu"],
        args.batch_size,
        row_width,
        bandwidths,
        host_memory,
        device_memory,
    )
    print(format_profile(report))
    np.save(ids_path, ranked)
    if len(trace.columns) > 1:
        np.savez(tables_path, **hot_ids_by_column(trace, ranked))
        print(f"hot ids per column: {tables_path}")
    json_path.write_text(json.dumps(report, indent=2))
    plotted = plot_profile(report, png_path)
    print(f"hot ids: {ids_path}")
    print(
        f"curve: {png_path}"
        if plotted
        else "(no curve: matplotlib is not installed; pip install 'tierstore[plot]')"
    )
    print(f"figures: {json_path}")
    return 0


def _trace(args):
    columns = [c.strip() for c in args.columns.split(",")] if args.columns else None
    return load_trace(args.trace, columns=columns, criteo=args.criteo, delimiter=args.delimiter)


def _sizes(args) -> list[str]:
    """``--sizes``, each spelled as ``cache_rows`` reads it: checked before the trace is read (a
    share is checked against the trace's distinct ids once they are known)."""
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if not sizes:
        raise CommandError(f"--sizes {args.sizes!r} names no size; give e.g. 1%,5%,10% or 20000 or 64MiB")
    for size in sizes:
        cache_rows(size, None, args.dim * 4)  # raises ValueError naming a size that does not parse
    return sizes


def _sample_rate(text: str) -> float:
    """``--sample``: "5%" or "0.05" as a fraction in (0, 1]."""
    try:
        rate = float(text[:-1]) / 100 if text.strip().endswith("%") else float(text)
    except ValueError:
        rate = float("nan")
    if not 0 < rate <= 1:
        raise CommandError(f"--sample must be a share in (0, 100%], e.g. 5% or 0.05; got {text!r}")
    return rate


def _memory(option: str, text: str, total: int) -> int:
    try:
        return parse_bytes(text, total)
    except ValueError as error:
        raise CommandError(f"{option}: {error}") from None


def _check_writable(path: Path) -> None:
    """Raise ``CommandError`` unless ``path`` can be written (its folder is made if missing)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as error:
        raise CommandError(f"cannot write {path}: {error.strerror or error}") from None
