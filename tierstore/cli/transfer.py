"""Offline import of a table file into a new store, and export of a store to a table file.

Both stream in chunks (memory bounded by the chunk size, whatever the table's size) with a tqdm
progress bar. An import is atomic: it builds the store in a hidden directory beside the target,
writes the store's metadata last and renames the directory into place; an import killed at any
moment leaves no directory at the target, and the hidden one has no metadata, so it never opens as
a store. Rows go in through the cold store's ``bulk_load`` (the mmap backend writes them once,
straight into their file; LMDB commits a transaction per chunk). A table of a collection
(``--table``) is loaded into, and exported from, the store of its group.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from .. import optim
from ..kernels import host_kernels
from ..metadata import StoreMetadata, dtype_name, fsync_directory, new_state_dtype, write_metadata
from ..nn.collection_layout import ID_BITS, ID_MASK, group_path, read_layout, table_keys
from ..progress import bar as progress_bar
from ..store import TieredStore
from ..tiers.cold import open_cold_store
from .table_files import TableFileError, TableSource, TableWriter

CHUNK_ROWS = 1 << 16
OPTIMIZER_CHOICES = ("none", *optim.OPTIMIZERS)


def optimizer_choice(text: str) -> str:
    """The ``--optimizer`` value: "none" or an optimizer's registry name, spelt with '-' or '_'."""
    return "none" if text == "none" else optim.optimizer_class(text).name


def state_width(optimizer: str, dim: int) -> int:
    """Optimizer-state values per row for ``optimizer`` (one of ``OPTIMIZER_CHOICES``)."""
    return 0 if optimizer == "none" else optim.OPTIMIZERS[optimizer]().state_width(dim)


def converted(ids: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``rows`` (of ``ids``) as ``dtype`` (None: as they are); ``TableFileError`` naming the first id
    whose finite values ``dtype`` cannot hold (they would round to inf)."""
    if dtype is None or rows.dtype == dtype:
        return rows
    out = rows.to(dtype)
    lost = torch.isfinite(rows).all(dim=1) & ~torch.isfinite(out).all(dim=1)
    if bool(lost.any()):
        first = int(lost.nonzero()[0, 0])
        raise TableFileError(
            f"id {int(ids[first])}'s row holds {float(rows[first].abs().max()):g}, past what {dtype} holds "
            f"(at most {torch.finfo(dtype).max:g}); keep the rows' dtype, or scale them first"
        )
    return out


def check_convertible(rows: Iterator, dtype: torch.dtype | None) -> None:
    """``converted``'s check over every ``(ids, rows)`` of ``rows`` (a pass before anything is written)."""
    if dtype is None:
        return
    for ids, chunk in rows:
        converted(ids, chunk, dtype)


def import_table(
    source: TableSource,
    store_path: Path,
    backend: str = "mmap",
    optimizer: str = "none",
    seed: int = 0,
    chunk_rows: int = CHUNK_ROWS,
    progress: bool | None = None,
    dtype: torch.dtype | None = None,
) -> StoreMetadata:
    """Build a new store at ``store_path`` (which must not exist) holding ``source``'s rows, with
    zeroed optimizer state (the state every optimizer here starts from) of ``optimizer``'s width;
    ``dtype``: the store's (None: the rows'), the rows converted to it."""
    store_path = Path(store_path)
    if store_path.exists():
        raise FileExistsError(f"{store_path} exists; import into a new path (or remove it first)")
    dim, dtype = source.rows.shape[1], dtype or source.rows.dtype
    metadata = StoreMetadata(
        backend=backend,
        dim=dim,
        dtype=dtype_name(dtype),
        optimizer_state_width=state_width(optimizer, dim),
        seed=seed,
        optimizer=None if optimizer == "none" else optimizer,
        state_dtype=new_state_dtype(dtype_name(dtype)),
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
        with _import_bar(source, progress) as bar:
            for ids, rows in source.chunks(chunk_rows):
                stored = rows = converted(ids, rows, dtype)
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


def import_into_table(
    source: TableSource,
    root: Path,
    table_name: str,
    chunk_rows: int = CHUNK_ROWS,
    progress: bool | None = None,
) -> dict:
    """Load ``source``'s rows into table ``table_name`` of the collection at ``root`` (rows of ids it
    holds are replaced, their optimizer state kept); durable on return. Returns the table's layout."""
    table = table_of(root, table_name)
    with TieredStore(group_path(root, table), host_cache=1) as store:
        if source.rows.shape[1] != store.dim:
            raise TableFileError(
                f"{source.path} holds rows of dim {source.rows.shape[1]}; "
                f"table {table_name!r} has dim {store.dim}"
            )
        with _import_bar(source, progress) as bar:
            for ids, rows in source.chunks(chunk_rows):
                if ids.numel() and int(ids.max()) > ID_MASK:
                    raise TableFileError(f"{source.path}: ids must be below 2**{ID_BITS} in a collection")
                store.load(table_keys(table, ids), converted(ids, rows, store.dtype))
                bar.update(rows.shape[0])
    return table


def _import_bar(source: TableSource, progress: bool | None):
    """The progress bar of an import of ``source`` (rows)."""
    return progress_bar(
        total=len(source),
        unit="rows",
        unit_scale=True,
        desc=f"importing {source.path.name}",
        progress=progress,
    )


def table_of(root: Path, table_name: str) -> dict:
    tables = {table["name"]: table for table in read_layout(root)}
    if table_name not in tables:
        raise TableFileError(f"{root} has no table {table_name!r}; its tables are {sorted(tables)}")
    return tables[table_name]


def export_table(
    store_path: Path,
    destination: Path,
    ids_path: Path | None = None,
    with_state: bool = False,
    chunk_rows: int = CHUNK_ROWS,
    progress: bool | None = None,
    table_name: str | None = None,
    dtype: torch.dtype | None = None,
) -> int:
    """Write every row of the store at ``store_path`` (or of table ``table_name`` of the collection
    there) to ``destination`` (format from its suffix); returns the row count. Rows whose ids are
    exactly 0..N-1 are written dense (row i = id i); any others sparse: ids beside the rows
    (``ids_path`` for ``.npy``, a tensor ``ids`` in ``.pt``/``.safetensors``). ``with_state``:
    whole rows ``[weights | optimizer state]``. ``dtype``: the file's (None: the store's), every row
    checked to fit it before anything is written; whole rows are written in the store's dtype only
    (their state is laid out for it: ``metadata.row_width``)."""
    table = None if table_name is None else table_of(store_path, table_name)
    if table is not None:
        store_path = group_path(store_path, table)
    with TieredStore(store_path, read_only=True, host_cache=1) as store:
        rows_of = lambda: store_rows(store, chunk_rows, with_state, table)  # noqa: E731 (one pass each)
        dtype = None if dtype == store.dtype else dtype
        if dtype is not None and with_state and store.row_width > store.dim:
            raise TableFileError(
                f"whole rows hold their optimizer state laid out for {store.dtype}: export them in it, "
                f"or convert the weights alone to {dtype} (no --with-state)"
            )
        count = len(store) if table is None else sum(ids.numel() for ids, _ in rows_of())
        check_convertible(rows_of(), dtype)
        width = store.row_width if with_state else store.dim
        dense = count == 0 or _ids_are_a_range(rows_of(), count)
        if dense and ids_path is not None:
            dense = False  # the caller asked for ids: write them
        writer = TableWriter(
            destination, count, width, dtype or store.dtype, sparse=not dense, ids_path=ids_path
        )
        position = 0
        with progress_bar(
            total=count,
            unit="rows",
            unit_scale=True,
            desc=f"exporting to {Path(destination).name}",
            progress=progress,
        ) as bar:
            for ids, rows in rows_of():
                rows = converted(ids, rows, dtype)
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


def store_rows(store: TieredStore, chunk_rows: int, with_state: bool, table: dict | None):
    """``(ids, rows)`` of every row of ``store``, or of ``table`` in it (its ids, key bits stripped)."""
    for keys, rows in store.iter_rows(chunk_rows, with_state=with_state):
        if table is None:
            yield keys, rows
        else:
            mine = (keys >> ID_BITS) == table["number"]
            yield keys[mine] & ID_MASK, rows[mine]


def _ids_are_a_range(rows: Iterator, count: int) -> bool:
    """Whether the ids of ``rows`` (``(ids, rows)`` pairs) are exactly 0..count-1 (one pass)."""
    low, high = None, None
    for ids, _ in rows:
        if ids.numel():
            low = int(ids.min()) if low is None else min(low, int(ids.min()))
            high = int(ids.max()) if high is None else max(high, int(ids.max()))
    return low == 0 and high == count - 1  # ids are distinct, so count of them in [0, count) is all


def _runs(sorted_ids: torch.Tensor) -> list[tuple[int, int]]:
    """``[start, stop)`` index ranges of consecutive ids in ``sorted_ids``."""
    breaks = ((sorted_ids[1:] - sorted_ids[:-1]) != 1).nonzero().squeeze(1) + 1
    bounds = [0, *breaks.tolist(), sorted_ids.numel()]
    return list(zip(bounds[:-1], bounds[1:]))


__all__ = [
    "import_table",
    "import_into_table",
    "export_table",
    "TableFileError",
    "OPTIMIZER_CHOICES",
    "state_width",
]
