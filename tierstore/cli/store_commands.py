"""The commands on stores: ``import``, ``export`` (and its delta), ``apply-delta``, ``inspect``,
``verify`` and ``compact``."""

from __future__ import annotations

import json
from pathlib import Path

from ..nn.collection_layout import LAYOUT_FILE, group_path, read_layout
from ..store import TieredStore
from .arguments import EXIT_PROBLEMS, CommandError, progress_of
from .deltas import apply_delta, export_delta
from .inspection import disk_bytes, inspect_collection, inspect_store, verify_collection, verify_store
from .table_files import TableFileError, open_table
from .transfer import (
    export_table,
    import_into_table,
    import_table,
)


def run_import(args) -> int:
    if args.table is None:
        _refuse_whole_collection(args.store, "load SRC's rows into one of them")
    source = open_table(args.source, key=args.key, ids_path=args.ids)
    if args.table is not None:
        _check_store(args.store)
        if args.dtype is not None:
            raise TableFileError("--dtype: a collection's table keeps the collection's dtype; leave it out")
        table = import_into_table(source, args.store, args.table, args.chunk_rows, progress_of(args))
        print(f"loaded {len(source):,} rows into table {table['name']!r} of {args.store}")
        return 0
    metadata = import_table(
        source,
        args.store,
        backend=args.backend,
        optimizer=args.optimizer,
        seed=args.seed,
        chunk_rows=args.chunk_rows,
        progress=progress_of(args),
        dtype=args.dtype,
    )
    print(
        f"imported {len(source):,} rows of dim {metadata.dim} ({metadata.dtype}) into {args.store} "
        f"({metadata.backend})"
    )
    return 0


def run_export(args) -> int:
    _check_store(args.store)
    if args.table is None:
        _refuse_whole_collection(args.store, "export the rows of one table")
    if args.since is not None:
        if args.dtype is not None:
            raise CommandError(
                "a delta keeps the store's dtype (its rows are compared bit for bit): leave out --dtype"
            )
        count, removed = export_delta(
            args.store,
            args.since,
            args.destination,
            ids_path=args.ids,
            removed_path=args.removed,
            with_state=args.with_state,
            chunk_rows=args.chunk_rows,
            progress=progress_of(args),
            table_name=args.table,
        )
        print(
            f"exported {count:,} rows changed since {args.since} and {removed:,} removed ids "
            f"to {args.destination}"
        )
        return 0
    count = export_table(
        args.store,
        args.destination,
        ids_path=args.ids,
        with_state=args.with_state,
        chunk_rows=args.chunk_rows,
        progress=progress_of(args),
        table_name=args.table,
        dtype=args.dtype,
    )
    print(f"exported {count:,} rows to {args.destination}")
    return 0


def run_apply_delta(args) -> int:
    _check_store(args.store)
    if args.table is None:
        _refuse_whole_collection(args.store, "apply a delta to one table")
    count, removed = apply_delta(
        args.store, args.delta, ids_path=args.ids, removed_path=args.removed, table_name=args.table
    )
    print(f"applied {count:,} rows and {removed:,} removed ids to {args.store}")
    return 0


def run_inspect(args) -> int:
    _check_store(args.store)
    if (args.store / LAYOUT_FILE).exists():
        return _inspect_collection(args)
    facts = inspect_store(args.store)
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    width = max(map(len, facts))
    for name, value in facts.items():
        shown = (
            f"{value:,}" if isinstance(value, int) else f"{value:,.1f}" if isinstance(value, float) else value
        )
        print(f"{name.replace('_', ' '):<{width}}  {shown}")
    return 0


def _inspect_collection(args) -> int:
    facts = inspect_collection(args.store)
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    print(f"collection {args.store}: {len(facts['tables'])} tables in {len(facts['stores'])} store(s)")
    columns = ["name", "rows", "embedding_dim", "pooling", "store", "features"]
    widths = [
        max(
            len(column),
            *(
                len(f"{table[column]:,}" if column == "rows" else str(table[column]))
                for table in facts["tables"]
            ),
        )
        for column in columns
    ]
    print("  ".join(column.replace("_", " ").ljust(width) for column, width in zip(columns, widths)))
    for table in facts["tables"]:
        cells = [f"{table[c]:,}" if c == "rows" else str(table[c]) for c in columns]
        print("  ".join(cell.ljust(width) for cell, width in zip(cells, widths)))
    return 0


def run_verify(args) -> int:
    _check_store(args.store)
    verify = verify_collection if (args.store / LAYOUT_FILE).exists() else verify_store
    problems = verify(args.store, progress=progress_of(args))
    for problem in problems:
        print(f"problem: {problem}")
    print(f"{args.store}: {'sound' if not problems else f'{len(problems)} problem(s)'}")
    return EXIT_PROBLEMS if problems else 0


def run_compact(args) -> int:
    """Compact a store, or each store of a collection: the disk its removed ids took is freed."""
    _check_store(args.store)
    paths = [args.store]
    if (args.store / LAYOUT_FILE).exists():
        paths = sorted({group_path(args.store, table) for table in read_layout(args.store)})
    for path in paths:
        before = disk_bytes(path)
        with TieredStore(path, host_cache=1) as store:
            store.compact()
            rows = len(store)
        print(f"{path}: {rows:,} rows, {before:,} -> {disk_bytes(path):,} bytes on disk")
    return 0


def _refuse_whole_collection(path: Path, action: str) -> None:
    """A ``CommandError`` naming the tables where ``path`` is a collection and ``--table`` is due."""
    if (path / LAYOUT_FILE).exists():
        names = [table["name"] for table in read_layout(path)]
        raise CommandError(f"{path} is a collection of the tables {names}: pass --table NAME to {action}")


def _check_store(path: Path) -> None:
    if not path.exists():
        raise CommandError(f"{path}: no such store directory")
