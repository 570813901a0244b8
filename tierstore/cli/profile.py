"""``tierstore profile``'s text and plot of a profile (``analysis.profile``)."""

from __future__ import annotations

from pathlib import Path

from ..analysis.profile import MIN_SAMPLED_IDS, MIN_SCALED_ROWS
from .plotting import plot_hit_rates


def format_profile(report: dict) -> str:
    """The report as readable text: the sample, the predicted hit rates, the hot set, the budgets."""
    sample = report["sample"]
    lines = [
        f"{report['trace']}: {report['accesses']:,} accesses, about {report['estimated_distinct_ids']:,} "
        f"distinct ids; sampled {sample['rate']:.2%} of the ids ({sample['ids']:,} ids, "
        f"{sample['accesses']:,} accesses), profiler memory {report['profiler_bytes'] / 2**20:,.1f} MiB",
        *(
            [
                f"(the sample was raised from {sample['requested_rate']:.2%}: it would have held fewer "
                f"than {MIN_SAMPLED_IDS:,} ids, or simulated the smallest cache with fewer than "
                f"{MIN_SCALED_ROWS} rows)"
            ]
            if sample["raised"]
            else []
        ),
        f"predicted hit rate (1 - rows brought in / lookups), batches of {report['batch_size']:,} lookups:",
        f"{'cache':>10} {'rows':>12} {'LFU (ours)':>11} {'Belady MIN':>11}",
    ]
    predicted = report["predicted_hit_rate"]
    for size, rows, lfu, best in zip(
        report["sizes"], report["sizes_rows"], predicted["lfu"], predicted["min"]
    ):
        lines.append(f"{size:>10} {rows:>12,} {lfu:>11.1%} {best:>11.1%}")
    lines.append(
        "rows taking a share of the accesses: "
        + ", ".join(f"{share}: {rows:,}" for share, rows in report["hot_set_rows"].items())
    )
    advice = report.get("recommendation")
    if advice:
        bandwidths = advice["bandwidths_bytes_per_s"]
        measured = (
            f"cold read {bandwidths['cold_read'] / 1e6:,.0f} MB/s, "
            f"cold write {bandwidths['cold_write'] / 1e6:,.0f} MB/s, "
            f"DRAM gather {bandwidths['dram_gather'] / 1e6:,.0f} MB/s"
        )
        if bandwidths["host_to_device"]:
            measured += f", host to device {bandwidths['host_to_device'] / 1e6:,.0f} MB/s"
        device = (
            f", device_cache={advice['device_cache_bytes'] / 2**20:,.1f}MiB "
            f"({advice['device_cache_rows']:,} rows)"
            if advice["device_memory_bytes"]
            else ""
        )
        lines += [
            f"bandwidths measured here: {measured}",
            f"recommended: host_cache={advice['host_cache_bytes'] / 2**20:,.1f}MiB "
            f"({advice['host_cache_rows']:,} rows){device}; predicted "
            f"{advice['predicted_rows_moved_per_step']:,.0f} rows moved and "
            f"{advice['predicted_movement_ms_per_step']:.2f} ms of movement per step "
            f"(best the memory allows: {advice['best_movement_ms_per_step']:.2f} ms)",
        ]
    return "\n".join(lines)


def plot_profile(report: dict, path: Path) -> bool:
    """The predicted hit-rate curves against cache size, as a PNG; False without matplotlib."""
    curve = report["curve"]
    curves = [
        ("tierstore LFU (predicted)", curve["lfu"], False),
        ("Belady MIN (predicted)", curve["min"], True),
    ]
    title = f"{report['trace']}, {report['sample']['rate']:.1%} id sample"
    return plot_hit_rates(path, curve["rows"], curves, "cache size (rows)", title, log_x=True)
