"""``tierstore bench``'s tables and plots of a hit-rate curve (``analysis.hit_rates``)."""

from __future__ import annotations

from pathlib import Path

from ..analysis.reference_policies import BATCHED
from .plotting import plot_hit_rates


def format_table(report: dict, policies: list[str]) -> str:
    """The report as a readable text table, one line per cache size."""
    lookahead, admission = report.get("lookahead", 0), report.get("admission", 0)
    horizon = report.get("horizon")
    ageing = report.get("ageing", False)
    names = ["tierstore LFU"] + (["no ageing", "aged 4x"] if ageing else [])
    names += [f"lookahead {lookahead}"] if lookahead else []
    names += [f"horizon {horizon}"] if horizon else []
    names += [f"admission {admission}"] if admission else []
    references = _references(policies)
    names += [
        {"lru": "LRU", "fifo": "FIFO", "belady": "Belady MIN", BATCHED: "MIN, batched"}[p] for p in references
    ]
    header = (
        f"{'cache':>10} {'rows':>10} "
        + " ".join(f"{name:>13}" for name in names)
        + f" {'lookups/s':>11} {'p50 ms':>8} {'p99 ms':>8} {'rows in':>10} {'MB in':>8} {'evictions':>10}"
    )
    lines = [
        f"{report['trace']}: {report['accesses']:,} accesses, {report['distinct_ids']:,} distinct ids, "
        f"batches of up to {report['batch_size']:,} ids and an eighth of the cache; "
        "hit rate = 1 - rows brought in / lookups"
        + (
            "; 'MIN, batched': Belady's MIN with each batch resident whole, as the store holds it"
            if "belady" in policies
            else ""
        )
        + (
            f"; lookahead {lookahead}: rows moved ahead count as brought in, and 'waited' is the share "
            "of lookups whose row the table held but the cache did not when its batch ran"
            if lookahead
            else ""
        ),
        header + (f" {'waited':>8}" if lookahead else ""),
    ]
    for entry in report["sizes"]:
        ours = entry["tierstore_lfu"]
        host = ours["tiers"]["host"]
        ahead = entry.get("tierstore_lookahead")
        foreseen = entry.get("tierstore_horizon")
        admitted = entry.get("tierstore_admission")
        rates = (
            [ours["hit_rate"]]
            + ([entry["lfu_no_ageing"]["hit_rate"], entry["lfu_aged_4x"]["hit_rate"]] if ageing else [])
            + ([ahead["hit_rate"]] if ahead else [])
            + ([foreseen["hit_rate"]] if foreseen else [])
            + ([admitted["hit_rate"]] if admitted else [])
            + [entry[p]["hit_rate"] for p in references]
        )
        lines.append(
            f"{entry['size']:>10} {entry['rows']:>10,} "
            + " ".join(f"{rate:>13.1%}" for rate in rates)
            + f" {ours['lookups_per_s']:>11,.0f} {ours['batch_latency_ms_p50']:>8.2f}"
            f" {ours['batch_latency_ms_p99']:>8.2f} {host['rows_in']:>10,} {host['bytes_in'] / 1e6:>8.1f}"
            f" {host['evictions']:>10,}" + (f" {ahead['waited']:>8.1%}" if ahead else "")
        )
    if report.get("warm"):
        lines.append(
            "warm start (the table holds every id; hit rate over the first tenth of the lookups, "
            "then over the rest; rows preloaded at open are not counted as brought in):"
        )
        lines.append(
            f"{'cache':>10} {'cold 1st 10%':>13} {'warm 1st 10%':>13} {'cold rest':>10} "
            f"{'warm rest':>10} {'preloaded':>10}"
        )
        for entry in report["sizes"]:
            cold, warm = entry["tierstore_held"], entry["tierstore_warm"]
            lines.append(
                f"{entry['size']:>10} {cold['first_tenth_hit_rate']:>13.1%} "
                f"{warm['first_tenth_hit_rate']:>13.1%} {cold['rest_hit_rate']:>10.1%} "
                f"{warm['rest_hit_rate']:>10.1%} {warm['warmed_rows']:>10,}"
            )
    return "\n".join(lines)


def plot_curve(report: dict, policies: list[str], path: Path) -> bool:
    """Hit rate against cache size per policy, as a PNG; False when matplotlib is not installed."""
    entries = report["sizes"]
    ours = [("tierstore_lfu", "tierstore LFU (ageing chosen online)")]
    if report.get("ageing"):
        ours += [("lfu_no_ageing", "LFU, no ageing"), ("lfu_aged_4x", "LFU aged at 4x the cache")]
    if report.get("lookahead"):
        ours.append(("tierstore_lookahead", f"tierstore LFU, lookahead {report['lookahead']}"))
    if report.get("horizon"):
        ours.append(("tierstore_horizon", f"tierstore, evicting by next use within {report['horizon']}"))
    if report.get("admission"):
        ours.append(("tierstore_admission", f"tierstore LFU, admission after {report['admission']} lookups"))
    names = {
        "lru": "LRU",
        "fifo": "FIFO",
        "belady": "Belady MIN (optimal)",
        BATCHED: "Belady MIN, batches resident whole",
    }
    curves = [(label, [e[key]["hit_rate"] for e in entries], False) for key, label in ours]
    curves += [
        (names[p], [e[p]["hit_rate"] for e in entries], p in ("belady", BATCHED))
        for p in _references(policies)
    ]
    shares = [100 * entry["share_of_distinct"] for entry in entries]
    return plot_hit_rates(path, shares, curves, "host cache size (% of distinct ids)", report["trace"])


def _references(policies: list[str]) -> list[str]:
    """The reference policies a report holds: ``policies``, MIN over batches beside MIN."""
    return [name for p in policies for name in ((p, BATCHED) if p == "belady" else (p,))]
