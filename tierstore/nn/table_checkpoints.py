"""Checkpoints of tiered modules (``tierstore.checkpoint``): a table, or a collection's groups, each
one part; a sharded table's rank writes and restores its own part, ``rankR-of-W``, under the path."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..checkpoint import CheckpointWriting, TableCheckpoint, TablePart, check_new_path


def rank_path(path: str | os.PathLike, sharding: Any) -> Path:
    """Where a table's (or collection's) checkpoint at ``path`` lives on this rank."""
    path = Path(path)
    return path if sharding is None else path / f"rank{sharding.rank}-of-{sharding.world_size}"


def write_checkpoint(
    path: str | os.PathLike, tables: dict[str | None, Any], sharding: Any, background: bool
) -> CheckpointWriting:
    """Flush ``tables`` (``{part name or None: TieredEmbeddingBag/TieredEmbedding}``), take their
    snapshots and write them to ``path`` (on a thread of its own if ``background``)."""
    target = rank_path(path, sharding)
    check_new_path(target)  # before the flushes
    parts = []
    try:
        for name, table in tables.items():
            table.flush()  # sharded: every rank, together
            parts.append(TablePart(name, table.store.snapshot(), table.step))
    except BaseException:
        for part in parts:
            part.snapshot.close()
        raise
    target.parent.mkdir(parents=True, exist_ok=True)
    return CheckpointWriting(target, parts, background)


def restore_checkpoint(path: str | os.PathLike, tables: dict[str | None, Any], sharding: Any) -> None:
    """Give ``tables`` exactly the rows, optimizer state and step counts of the checkpoint at
    ``path``; every part is checked before any table changes."""
    target = rank_path(path, sharding)
    checkpoints = {name: TableCheckpoint(target if name is None else target / name) for name in tables}
    for name, table in tables.items():
        checkpoints[name].check_layout(table.store.metadata)
    for name, table in tables.items():
        table.store.replace_rows(checkpoints[name].iter_rows())
        table.step = checkpoints[name].step
        table.flush()  # sharded: the step recorded with the rank's flush, on every rank
