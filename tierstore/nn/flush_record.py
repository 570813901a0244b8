"""A collection's flush record, ``flushes.json``: whether the last operation that changes every
group (``flush()``, ``close()``, ``load_state_dict()``) completed, and each group store's flush
count when it began or completed.

Each group's store commits its flush atomically and counts it (``TieredStore.flushes``), but the
groups commit one after another, so a kill or a failure between two commits leaves them at
different flushes: the tables of one collection no longer from one moment. The record is marked
begun before the groups flush and complete after. Reopening a collection whose record says begun
compares the groups' counts with the ones recorded: all must have moved on by the same number of
flushes (none: killed before any commit; one: after the last). Otherwise the collection is
refused, naming the counts; removing the record accepts the groups as they are.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import StoreFormatError
from ..metadata import write_json_atomic

FLUSH_RECORD = "flushes.json"


def read_flush_record(root: Path) -> tuple[bool, dict[str, int]] | None:
    """``(complete, {group name: flush count})`` as recorded under ``root``; None without a record."""
    path = Path(root) / FLUSH_RECORD
    try:
        record = json.loads(path.read_text())
        complete, counts = record["complete"], record["groups"]
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
        raise StoreFormatError(
            f"{path} is damaged ({error!r}); if the groups are known to agree, remove it (the next "
            f"flush writes it anew)"
        ) from None
    if not isinstance(complete, bool) or not (
        isinstance(counts, dict)
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts.values())
    ):
        raise StoreFormatError(f"{path} is damaged: {record!r}")
    return complete, counts


def write_flush_record(root: Path, counts: dict[str, int], complete: bool) -> None:
    """Record the groups' flush ``counts`` (group name -> count) as an operation that changes every
    group begins (``complete=False``) or completes."""
    write_json_atomic(Path(root) / FLUSH_RECORD, {"complete": complete, "groups": counts})


def flush_mismatch(root: Path, record: tuple[bool, dict[str, int]], counts: dict[str, int]) -> str | None:
    """What is wrong when the groups' flush ``counts`` show that an operation ``record`` (the one
    under ``root``) says begun committed some groups and not others (None: nothing is wrong)."""
    complete, recorded = record
    if complete:
        return None
    if set(recorded) != set(counts):
        return (
            f"{Path(root) / FLUSH_RECORD} records the groups {sorted(recorded)}, and the collection has "
            f"{sorted(counts)}: it belongs to another collection; remove it if the groups are known to agree"
        )
    if len({counts[name] - recorded[name] for name in counts}) <= 1:
        return None
    listing = ", ".join(f"{name} at flush {counts[name]} (was {recorded[name]})" for name in sorted(counts))
    return (
        f"{root}: the collection's groups hold different flushes ({listing}): a kill or a failure "
        f"inside flush() committed some groups and not the others, so its tables are not from one "
        f"moment. Restore the collection from a backup, or, to train on from the groups as they are, "
        f"remove {Path(root) / FLUSH_RECORD}"
    )
