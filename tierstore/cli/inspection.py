"""What a store directory holds (``inspect``) and whether it is sound (``verify``), read-only,
through the store's public API."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path

import torch

from .. import optim
from ..errors import StoreFormatError
from ..metadata import METADATA_FILE, StoreMetadata, finite_rows, read_metadata
from ..nn.collection_layout import ID_BITS, ID_MASK, group_path, read_layout
from ..nn.flush_record import flush_mismatch, read_flush_record
from ..nn.jagged_batch import id_bound
from ..progress import bar as progress_bar
from ..store import TieredStore


def optimizer_name(metadata: StoreMetadata) -> str:
    """The optimizer the store recorded, or what its state width says when it recorded none."""
    if metadata.optimizer is not None:
        return metadata.optimizer
    if metadata.optimizer_state_width == 0:
        return "none recorded (no state)"
    names = optim.with_state_width(metadata.optimizer_state_width, metadata.dim)
    fits = " or ".join(names) if names else "no known optimizer"
    return f"not recorded ({metadata.optimizer_state_width} state values per row: {fits})"


def disk_bytes(path: Path) -> int:
    """The bytes the files under ``path`` take on disk (allocated blocks: holes not counted)."""
    return sum(file.stat().st_blocks * 512 for file in Path(path).rglob("*") if file.is_file())


def inspect_store(path: Path) -> dict:
    """The store's layout, size and last flush: a dict of plain values (for tables and JSON)."""
    path = Path(path)
    metadata = read_metadata(path)
    with TieredStore(path, read_only=True, host_cache=1) as store:
        rows = len(store)
        flushed = store.last_flush_time()
        removed_on_disk = store.stats()["cold"].get("removed_rows_on_disk", 0)
    size = disk_bytes(path)
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
        "removed_rows_on_disk": removed_on_disk,  # of removed ids, until tierstore compact
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


def verify_store(
    path: Path,
    chunk_rows: int = 1 << 16,
    progress: bool | None = None,
    check_keys: Callable[[torch.Tensor], str | None] | None = None,
) -> list[str]:
    """Problems found in the store at ``path`` (empty: sound). Checks the metadata, the cold store's
    structure (``structure_problems``; the mmap backend checks its row count, key file and
    write-ahead log as it opens), then reads every row, checking it against its checksum (format
    version 2 on), that its values are finite and, with ``check_keys`` (keys -> a problem or None),
    its key."""
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
                    bad = ~finite_rows(rows, store.dim, store.metadata.optimizer_state_width)
                    if bool(bad.any()):
                        problems.append(
                            f"{int(bad.sum())} row(s) hold non-finite values (first id: {int(ids[bad][0])})"
                        )
                    key_problem = None if check_keys is None else check_keys(ids)
                    if key_problem is not None:
                        problems.append(key_problem)
                    seen += ids.numel()
                    bar.update(ids.numel())
            except StoreFormatError as error:  # a row that fails its checksum, a damaged page
                return problems + [str(error)]
        if seen != expected:
            problems.append(f"the store counts {expected} rows but {seen} were read")
    return problems


def verify_collection(root: Path, chunk_rows: int = 1 << 16, progress: bool | None = None) -> list[str]:
    """Problems found in the collection at ``root`` (empty: sound): its layout file, every group's
    store as ``verify_store`` checks it (and that each key belongs to one of the group's tables,
    within its ``num_embeddings``), and that the groups hold one flush (``flush_record``)."""
    root = Path(root)
    try:
        tables = read_layout(root)
    except StoreFormatError as error:
        return [str(error)]
    problems, counts = [], {}
    groups = sorted({group_path(root, table).name for table in tables})
    for name in groups:
        members = [table for table in tables if group_path(root, table).name == name]
        if not (root / name / METADATA_FILE).exists():
            problems.append(f"{name}: the store of tables {[t['name'] for t in members]} is missing")
            continue
        found = verify_store(root / name, chunk_rows, progress, _keys_of(members))
        problems.extend(f"{name}: {problem}" for problem in found)
        if not found:
            with TieredStore(root / name, read_only=True, host_cache=1) as store:
                counts[name] = store.flushes
    if len(counts) == len(groups):
        try:
            record = read_flush_record(root)
            mismatch = None if record is None else flush_mismatch(root, record, counts)
        except StoreFormatError as error:
            mismatch = str(error)
        if mismatch is not None:
            problems.append(mismatch)
    return problems


def _keys_of(tables: list[dict]) -> Callable[[torch.Tensor], str | None]:
    """A check of a group's keys: each of one of ``tables`` (by its number in the key's high bits)
    and below that table's ``num_embeddings``."""
    numbers = max(table["number"] for table in tables) + 1
    bounds = torch.full((numbers,), -1, dtype=torch.int64)  # -1: no table of this number
    for table in tables:
        bounds[table["number"]] = id_bound(table)
    names = {table["number"]: table["name"] for table in tables}

    def check(keys: torch.Tensor) -> str | None:
        number, ids = keys >> ID_BITS, keys & ID_MASK
        known = number < numbers
        bad = ~known
        bad[known] = ids[known] >= bounds[number[known]]
        if not bool(bad.any()):
            return None
        first = int(bad.nonzero()[0, 0])
        key, table = int(keys[first]), int(number[first])
        if table not in names or int(bounds[table]) < 0:
            return f"key {key} belongs to no table of this group (table number {table})"
        return f"key {key} is id {int(ids[first])} of table {names[table]!r}, past its num_embeddings"

    return check
