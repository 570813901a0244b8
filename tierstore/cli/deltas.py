"""Delta exports for serving replicas: the rows of a store that changed since a checkpoint
(``table.checkpoint``), and the ids it held then and holds no more (tombstones). Applied in order to
a replica built from an older export, deltas give it exactly the newer rows, without copying the
table.

A delta has ``export``'s formats: a ``.pt``/``.safetensors`` holds ``ids``, ``weight`` (the changed
and added rows: weights, or whole rows with ``with_state``) and ``removed_ids``; a ``.npy`` holds the
rows, with the ids and the removed ids in the ``.npy`` files ``ids_path`` and ``removed_path``.

What changed is found by one pass over the store that compares each row, bit for bit, with the
checkpoint's (found by id in the checkpoint's ids, sorted once: 16 bytes of RAM per checkpoint row);
a second pass writes the changed rows. The store is read as one flush (a reader's snapshot).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..checkpoint import TableCheckpoint, numpy_bits
from ..nn.collection_layout import ID_BITS, ID_MASK, group_path, table_keys
from ..progress import bar as progress_bar
from ..store import TieredStore
from .table_files import TableFileError, TableWriter, open_table, read_removed_ids
from .transfer import CHUNK_ROWS, store_rows, table_of


class _Baseline:
    """A checkpoint's rows of one table, found by id: which rows of the store differ from them, and
    which of its ids the store no longer holds."""

    def __init__(self, checkpoint: TableCheckpoint, table: dict | None, width: int) -> None:
        ids = np.asarray(checkpoint.ids)
        self._positions = np.arange(ids.size)
        if table is not None:  # a collection's group: this table's keys only, as the table's ids
            mine = (ids >> ID_BITS) == table["number"]
            ids, self._positions = ids[mine] & ID_MASK, self._positions[mine]
        order = np.argsort(ids, kind="stable")
        self._sorted, self._positions = ids[order], self._positions[order]
        self._rows, self._width = checkpoint.rows, width
        self._seen = np.zeros(self._sorted.size, dtype=bool)

    def changed(self, ids: torch.Tensor, rows: torch.Tensor, mark: bool) -> torch.Tensor:
        """bool [n]: which of ``ids`` (their rows ``rows [n, width]``) the checkpoint lacks or holds
        other bits for; ``mark``: note them as still held."""
        keys = ids.numpy()
        place = np.minimum(np.searchsorted(self._sorted, keys), max(self._sorted.size - 1, 0))
        found = self._sorted[place] == keys if self._sorted.size else np.zeros(keys.size, dtype=bool)
        changed = ~found
        if found.any():
            saved = np.ascontiguousarray(self._rows[self._positions[place[found]], : self._width])
            now = numpy_bits(rows[torch.from_numpy(found)].contiguous())
            changed[found] = (saved.view(np.uint8) != now.view(np.uint8)).any(axis=1)
            if mark:
                self._seen[place[found]] = True
        return torch.from_numpy(changed)

    def removed(self) -> np.ndarray:
        """The checkpoint's ids no ``changed(..., mark=True)`` pass met, ascending."""
        return self._sorted[~self._seen]


def export_delta(
    store_path: Path,
    checkpoint_path: Path,
    destination: Path,
    ids_path: Path | None = None,
    removed_path: Path | None = None,
    with_state: bool = False,
    chunk_rows: int = CHUNK_ROWS,
    progress: bool | None = None,
    table_name: str | None = None,
) -> tuple[int, int]:
    """Write the rows of the store at ``store_path`` (or of its collection's table ``table_name``)
    that differ from the checkpoint at ``checkpoint_path`` or are new since, and the ids removed
    since, to ``destination``; returns ``(rows written, ids removed)``."""
    table = None if table_name is None else table_of(store_path, table_name)
    part = Path(checkpoint_path)
    if table is not None:
        store_path = group_path(store_path, table)
        part = part / store_path.name
    checkpoint = TableCheckpoint(part)
    with TieredStore(store_path, read_only=True, host_cache=1) as store:
        checkpoint.check_layout(store.metadata)
        width = store.row_width if with_state else store.dim
        baseline = _Baseline(checkpoint, table, width)

        def rows_of() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            return store_rows(store, chunk_rows, with_state, table)

        count = sum(int(baseline.changed(ids, rows, mark=True).sum()) for ids, rows in rows_of())
        removed = baseline.removed()
        writer = TableWriter(
            destination, count, width, store.dtype, sparse=True, ids_path=ids_path, removed=removed,
            removed_path=removed_path,
        )  # fmt: skip
        position = 0
        with progress_bar(
            total=count,
            unit="rows",
            unit_scale=True,
            desc=f"delta to {Path(destination).name}",
            progress=progress,
        ) as bar:
            for ids, rows in rows_of():
                changed = baseline.changed(ids, rows, mark=False)
                writer.write(position, ids[changed], rows[changed])
                position += int(changed.sum())
                bar.update(int(changed.sum()))
        writer.close()
    return count, removed.size


def apply_delta(
    store_path: Path,
    delta_path: Path,
    ids_path: Path | None = None,
    removed_path: Path | None = None,
    chunk_rows: int = CHUNK_ROWS,
    table_name: str | None = None,
) -> tuple[int, int]:
    """Bring the store at ``store_path`` (a replica; or its collection's table ``table_name``) one
    delta on: its rows written (weights: the optimizer state kept; whole rows: as they are), its
    removed ids removed. Without removals the rows are loaded in place (``TieredStore.load``); with
    them the store's rows are replaced in one step (``replace_rows``: a pass over the store).
    Returns ``(rows written, ids removed)``."""
    source = open_table(Path(delta_path), ids_path=ids_path)
    if source.ids is None:
        raise TableFileError(f"{delta_path}: a delta holds the ids of its rows; this file has none")
    removed = torch.from_numpy(read_removed_ids(Path(delta_path), removed_path))
    table = None if table_name is None else table_of(store_path, table_name)
    if table is not None:
        store_path = group_path(store_path, table)
    with TieredStore(store_path, host_cache=1) as store:
        if source.rows.shape[1] not in (store.dim, store.row_width) or source.rows.dtype != store.dtype:
            raise TableFileError(
                f"{delta_path} holds {source.rows.dtype} rows of width {source.rows.shape[1]}; the store's "
                f"are {store.dtype}, {store.dim} weights or {store.row_width} whole"
            )
        keys = (lambda ids: ids) if table is None else (lambda ids: table_keys(table, ids))
        if not removed.numel():
            for ids, rows in source.chunks(chunk_rows):
                store.load(keys(ids), rows, allow_nonfinite=True)
            return len(source), 0
        store.replace_rows(_delta_applied(store, source, keys(removed), keys, chunk_rows))
    return len(source), removed.numel()


def _delta_applied(store: TieredStore, source, removed: torch.Tensor, keys, chunk_rows: int):
    """The store's whole rows with ``source``'s over them and ``removed`` left out."""
    delta_keys = torch.cat(
        [keys(ids) for ids, _ in source.chunks(chunk_rows)] or [torch.empty(0, dtype=torch.int64)]
    )
    gone = torch.cat([removed, delta_keys]).unique()
    for ids, rows in store.iter_rows(chunk_rows, with_state=True):
        kept = ~torch.isin(ids, gone)
        yield ids[kept], rows[kept]
    for ids, rows in source.chunks(chunk_rows):
        ids = keys(ids)
        if rows.shape[1] < store.row_width:  # weights: the state kept where the store held the id
            whole = store.get(ids, with_state=True, grow=False)
            held = store.contains(ids)
            whole[~held, store.dim :] = 0
            whole[:, : store.dim] = rows
            rows = whole
        yield ids, rows
