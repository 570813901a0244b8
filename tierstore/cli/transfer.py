"""Offline import of a table file into a new store, and export of a store to a table file.

Both stream in chunks (memory bounded by the chunk size, whatever the table's size) with a tqdm
progress bar. An import is atomic: it builds the store in a hidden directory beside the target,
writes the store's metadata last and renames the directory into place; an import killed at any
moment leaves no directory at the target, and the hidden one has no metadata, so it never opens as
a store. Rows go in through the cold store's ``bulk_load`` (the mmap backend writes them once,
straight into their file; LMDB commits a transaction per chunk).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from .. import optim
from ..kernels import host_kernels
from ..metadata import StoreMetadata, dtype_name, fsync_directory, write_metadata
from ..store import TieredStore
from ..tiers.cold import open_cold_store
from .progress import bar as progress_bar
from .table_files import TableFileError, TableSource, TableWriter

CHUNK_ROWS = 1 << 16
OPTIMIZER_CHOICES = ("none", *optim.OPTIMIZERS)


def optimizer_choice(text: str) -> str:
    """The ``--optimizer`` value: "none" or an optimizer's registry name, spelt with '-' or '_'."""
    return "none" if text == "none" else optim.optimizer_class(text).name


def state_width(optimizer: str, dim: int) -> int:
    """Optimizer-state values per row for ``optimizer`` (one of ``OPTIMIZER_CHOICES``)."""
    return 0 if optimizer == "none" else optim.OPTIMIZERS[optimizer]().state_width(dim)


def import_table(
    source: TableSource,
    store_path: Path,
    backend: str = "mmap",
    optimizer: str = "none",
    seed: int = 0,
    chunk_rows: int = CHUNK_ROWS,
    progress: bool | None = None,
) -> StoreMetadata:
    """Build a new store at ``store_path`` (which must not exist) holding ``source``'s rows, with
    zeroed optimizer state (the state every optimizer here starts from) of ``optimizer``'s width."""
    store_path = Path(store_path)
    if store_path.exists():
        raise FileExistsError(f"{store_path} exists; import into a new path (or remove it first)")
    dim, dtype = source.rows.shape[1], source.rows.dtype
    metadata = StoreMetadata(
        backend=backend,
        dim=dim,
        dtype=dtype_name(dtype),
        optimizer_state_width=state_width(optimizer, dim),
        seed=seed,
        optimizer=None if optimizer == "none" else optimizer,
    )
    building = store_path.parent / f".{store_path.name}.importing-{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    try:
        cold = open_cold_store(
            backend,
            building,
            metadata.row_width,
            dtype,
            read_only=False,
            index_kernels=host_kernels()[0],
            checksums=metadata.row_checksums,
        )
        with progress_bar(
            total=len(source),
            unit="rows",
            unit_scale=True,
            desc=f"importing {source.path.name}",
            progress=progress,
        ) as bar:
            for ids, rows in source.chunks(chunk_rows):
                stored = rows
                if metadata.optimizer_state_width:
                    stored = torch.zeros(rows.shape[0], metadata.row_width, dtype=dtype)
                    stored[:, :dim] = rows
                cold.bulk_load(ids, stored)  # the store is not visible until the rename
                bar.update(rows.shape[0])
        cold.flush()
        cold.close()
        write_metadata(building, metadata)  # last: without it the directory is not a store
        os.rename(building, store_path)
        fsync_directory(store_path.parent)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return metadata


def export_table(
    store_path: Path,
    destination: Path,
    ids_path: Path | None = None,
    with_state: bool = False,
    chunk_rows: int = CHUNK_ROWS,
    progress: bool | None = None,
) -> int:
    """Write every row of the store at ``store_path`` to ``destination`` (format from its suffix);
    returns the row count. A store whose ids are exactly 0..N-1 is written dense (row i = id i);
    any other is written sparse: ids beside the rows (``ids_path`` for ``.npy``, a tensor ``ids``
    in ``.pt``/``.safetensors``). ``with_state``: whole rows ``[weights | optimizer state]``."""
    with TieredStore(store_path, read_only=True, host_cache=1) as store:
        count = len(store)
        width = store.row_width if with_state else store.dim
        dense = count == 0 or _ids_are_a_range(store, count)
        if dense and ids_path is not None:
            dense = False  # the caller asked for ids: write them
        writer = TableWriter(destination, count, width, store.dtype, sparse=not dense, ids_path=ids_path)
        position = 0
        with progress_bar(
            total=count,
            unit="rows",
            unit_scale=True,
            desc=f"exporting to {Path(destination).name}",
            progress=progress,
        ) as bar:
            for ids, rows in store.iter_rows(chunk_rows, with_state=with_state):
                if dense:
                    order = torch.argsort(ids)  # dense: rows land at their ids, in runs
                    ids, rows = ids[order], rows[order]
                    for start, stop in _runs(ids):
                        writer.write(int(ids[start]), ids[start:stop], rows[start:stop])
                else:
                    writer.write(position, ids, rows)
                position += ids.numel()
                bar.update(ids.numel())
        writer.close()
    return count


def _ids_are_a_range(store: TieredStore, count: int) -> bool:
    """Whether the store's ids are exactly 0..count-1 (one pass over the ids)."""
    low, high = None, None
    for ids, _ in store.iter_rows(CHUNK_ROWS):
        if ids.numel():
            low = int(ids.min()) if low is None else min(low, int(ids.min()))
            high = int(ids.max()) if high is None else max(high, int(ids.max()))
    return low == 0 and high == count - 1  # ids are distinct, so count of them in [0, count) is all


def _runs(sorted_ids: torch.Tensor) -> list[tuple[int, int]]:
    """``[start, stop)`` index ranges of consecutive ids in ``sorted_ids``."""
    breaks = ((sorted_ids[1:] - sorted_ids[:-1]) != 1).nonzero().squeeze(1) + 1
    bounds = [0, *breaks.tolist(), sorted_ids.numel()]
    return list(zip(bounds[:-1], bounds[1:]))


__all__ = ["import_table", "export_table", "TableFileError", "OPTIMIZER_CHOICES", "state_width"]
