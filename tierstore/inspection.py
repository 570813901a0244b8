"""What a store directory holds (``inspect``) and whether it is sound (``verify``), read-only."""

from __future__ import annotations

import datetime
import itertools
from pathlib import Path

import lmdb
import torch
from tqdm import tqdm

from .cold.lmdb_store import DIRECTORY as LMDB_DIRECTORY
from .cold.mmap_store import STATE_FILE
from .errors import StoreFormatError
from .metadata import read_metadata
from .store import TieredStore

_OPTIMIZER_OF_STATE = {0: "SGD (no state)", 1: "RowWiseAdagrad"}


def optimizer_name(state_width: int, dim: int) -> str:
    """The optimizers whose state is ``state_width`` values per row of ``dim`` weights."""
    names = {dim: "Adagrad", 2 * dim: "Adam"}
    names.update(_OPTIMIZER_OF_STATE)  # width 0 or 1 first when dim is 1 or 2
    return names.get(state_width, f"unknown ({state_width} state values per row)")


def inspect_store(path: Path) -> dict:
    """The store's layout, size and last flush: a dict of plain values (for tables and JSON)."""
    path = Path(path)
    metadata = read_metadata(path)
    with TieredStore(path, read_only=True, host_cache=1) as store:
        rows = len(store)
    size = sum(file.stat().st_blocks * 512 for file in path.rglob("*") if file.is_file())  # allocated, not holes
    committed = path / (STATE_FILE if metadata.backend == "mmap" else f"{LMDB_DIRECTORY}/data.mdb")
    last_flush = (datetime.datetime.fromtimestamp(committed.stat().st_mtime, datetime.timezone.utc).isoformat(timespec="seconds")
                  if committed.exists() else None)
    return {"path": str(path), "format_version": metadata.format_version, "backend": metadata.backend,
            "rows": rows, "dim": metadata.dim, "dtype": metadata.dtype,
            "optimizer": optimizer_name(metadata.optimizer_state_width, metadata.dim),
            "optimizer_state_width": metadata.optimizer_state_width, "seed": metadata.seed,
            "row_bytes": metadata.row_bytes, "size_on_disk_bytes": size,
            "disk_bytes_per_row": size / rows if rows else None, "last_flush_utc": last_flush}


def verify_store(path: Path, chunk_rows: int = 1 << 16, progress: bool = True) -> list[str]:
    """Problems found in the store at ``path`` (empty: sound). Checks the metadata, the backend's
    structure (LMDB: every key and value has the right length; mmap: the row count, the key file
    and the write-ahead log, as opening checks them), then decodes every row and checks that its
    values are finite."""
    path = Path(path)
    try:
        metadata = read_metadata(path)
    except StoreFormatError as error:
        return [str(error)]
    if metadata.backend == "lmdb":
        problems = _lmdb_structure(path / LMDB_DIRECTORY, metadata.row_bytes)
        if problems:
            return problems
    try:
        store = TieredStore(path, read_only=True, host_cache=1)
    except (StoreFormatError, OSError) as error:
        return [f"cannot open the store: {error}"]
    problems = []
    with store:
        expected = len(store)
        seen = 0
        with tqdm(total=expected, unit="rows", unit_scale=True, desc="verifying", disable=not progress) as bar:
            for ids, rows in store.iter_rows(chunk_rows, with_state=True):
                bad = ~torch.isfinite(rows).all(dim=1)
                if bool(bad.any()):
                    problems.append(f"{int(bad.sum())} row(s) hold non-finite values (first id: {int(ids[bad][0])})")
                seen += ids.numel()
                bar.update(ids.numel())
        if seen != expected:
            problems.append(f"the store counts {expected} rows but {seen} were read")
    return problems


def _lmdb_structure(directory: Path, row_bytes: int) -> list[str]:
    """Keys of 8 bytes and values of ``row_bytes`` in the committed ``rows`` database."""
    if not (directory / "data.mdb").exists():
        return [f"{directory} is missing its LMDB data file (data.mdb)"]
    try:
        env = lmdb.open(str(directory), readonly=True, lock=False, max_dbs=2)
    except lmdb.Error as error:
        return [f"cannot open the LMDB data in {directory}: {error}"]
    problems = []
    try:
        with env.begin() as txn:
            rows = env.open_db(b"rows", txn=txn, create=False)
            wrong = [(len(key), len(value)) for key, value in txn.cursor(rows)
                     if len(key) != 8 or len(value) != row_bytes]
    except lmdb.Error as error:
        return [f"the LMDB data in {directory} is damaged: {error}"]
    finally:
        env.close()
    for key_length, value_length in itertools.islice(wrong, 3):
        problems.append(f"an LMDB entry has a {key_length}-byte key and a {value_length}-byte value "
                        f"(expected 8 and {row_bytes})")
    if len(wrong) > 3:
        problems.append(f"... {len(wrong)} malformed LMDB entries in all")
    return problems
