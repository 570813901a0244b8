"""What a store directory holds (``inspect``) and whether it is sound (``verify``), read-only,
through the store's public API."""

from __future__ import annotations

import datetime
from pathlib import Path

import torch

from .. import optim
from ..errors import StoreFormatError
from ..metadata import StoreMetadata, read_metadata
from ..nn.collection import ID_BITS, group_path, read_layout
from ..store import TieredStore
from .progress import bar as progress_bar


def optimizer_name(metadata: StoreMetadata) -> str:
    """The optimizer the store recorded, or what its state width says when it recorded none."""
    if metadata.optimizer is not None:
        return metadata.optimizer
    if metadata.optimizer_state_width == 0:
        return "none recorded (no state)"
    names = optim.with_state_width(metadata.optimizer_state_width, metadata.dim)
    fits = " or ".join(names) if names else "no known optimizer"
    return f"not recorded ({metadata.optimizer_state_width} state values per row: {fits})"


def inspect_store(path: Path) -> dict:
    """The store's layout, size and last flush: a dict of plain values (for tables and JSON)."""
    path = Path(path)
    metadata = read_metadata(path)
    with TieredStore(path, read_only=True, host_cache=1) as store:
        rows = len(store)
        flushed = store.last_flush_time()
    size = sum(
        file.stat().st_blocks * 512 for file in path.rglob("*") if file.is_file()
    )  # allocated, not holes
    last_flush = (
        datetime.datetime.fromtimestamp(flushed, datetime.timezone.utc).isoformat(timespec="seconds")
        if flushed is not None
        else None
    )
    return {
        "path": str(path),
        "format_version": metadata.format_version,
        "backend": metadata.backend,
        "rows": rows,
        "dim": metadata.dim,
        "dtype": metadata.dtype,
        "optimizer": optimizer_name(metadata),
        "optimizer_state_width": metadata.optimizer_state_width,
        "seed": metadata.seed,
        "row_bytes": metadata.row_bytes,
        "size_on_disk_bytes": size,
        "disk_bytes_per_row": size / rows if rows else None,
        "last_flush_utc": last_flush,
    }


def inspect_collection(root: Path) -> dict:
    """A collection's tables (layout and row count each) and its group stores' facts."""
    tables = read_layout(root)
    rows = {table["name"]: 0 for table in tables}
    groups = {}
    for table in tables:
        path = group_path(root, table)
        if path.name not in groups:
            groups[path.name] = inspect_store(path)
            with TieredStore(path, read_only=True, host_cache=1) as store:
                numbers = {
                    other["number"]: other["name"] for other in tables if group_path(root, other) == path
                }
                for keys, _ in store.iter_rows(1 << 16):
                    for number, count in zip(*torch.unique(keys >> ID_BITS, return_counts=True)):
                        rows[numbers[int(number)]] += int(count)
    listed = [
        {
            "name": table["name"],
            "rows": rows[table["name"]],
            "embedding_dim": table["embedding_dim"],
            "num_embeddings": table["num_embeddings"],
            "pooling": table["pooling"],
            "features": ", ".join(table["feature_names"]),
            "store": group_path(root, table).name,
        }
        for table in tables
    ]
    return {"path": str(root), "tables": listed, "stores": groups}


def verify_store(path: Path, chunk_rows: int = 1 << 16, progress: bool | None = None) -> list[str]:
    """Problems found in the store at ``path`` (empty: sound). Checks the metadata, the cold store's
    structure (``structure_problems``; the mmap backend checks its row count, key file and
    write-ahead log as it opens), then reads every row, checking it against its checksum (format
    version 2 on) and that its values are finite."""
    path = Path(path)
    try:
        store = TieredStore(path, read_only=True, host_cache=1)  # reads and checks the metadata
    except (StoreFormatError, OSError) as error:
        return [f"cannot open the store: {error}"]
    with store:
        problems = store.structure_problems()
        if problems:
            return problems
        expected = len(store)
        seen = 0
        with progress_bar(
            total=expected, unit="rows", unit_scale=True, desc="verifying", progress=progress
        ) as bar:
            try:
                for ids, rows in store.iter_rows(chunk_rows, with_state=True):
                    bad = ~torch.isfinite(rows).all(dim=1)
                    if bool(bad.any()):
                        problems.append(
                            f"{int(bad.sum())} row(s) hold non-finite values (first id: {int(ids[bad][0])})"
                        )
                    seen += ids.numel()
                    bar.update(ids.numel())
            except StoreFormatError as error:  # a row that fails its checksum, a damaged page
                return problems + [str(error)]
        if seen != expected:
            problems.append(f"the store counts {expected} rows but {seen} were read")
    return problems
