"""The ``tierstore`` command line: import, export, inspect, verify, bench and profile.

Exit codes: 0 success; 1 ``verify`` found problems; 2 bad usage or input (a one-line error, no
traceback); 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import psutil
import torch

from ..analysis.cost_model import measure_bandwidths, plan
from ..analysis.hit_rates import REFERENCE_POLICIES, cache_rows, hit_rate_curve, horizon_lookups
from ..analysis.profile import hot_ids_by_column, profile_trace
from ..analysis.traces import TraceError, load_trace, split_columns
from ..budget import horizon_accesses, parse_bytes
from ..errors import StoreFormatError, StoreMismatchError
from ..lookahead import MAX_LOOKAHEAD
from ..metadata import DTYPES
from ..nn.collection import LAYOUT_FILE, read_layout
from ..tiers.admission import MAX_COUNT
from ..warm_start import hot_ids
from .bench import format_table, plot_curve
from .deltas import apply_delta, export_delta
from .inspection import inspect_collection, inspect_store, verify_collection, verify_store
from .lmdb_probe import READING_COMMANDS, lmdb_damage
from .profile import format_profile, plot_profile
from .table_files import SUFFIXES, TableFileError, open_table
from .transfer import (
    OPTIMIZER_CHOICES,
    export_table,
    import_into_table,
    import_table,
    optimizer_choice,
    state_width,
)

EXIT_PROBLEMS, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class CommandError(Exception):
    """Bad input found by a command: printed as one line, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    damage = lmdb_damage(args.store) if args.command in READING_COMMANDS else None
    if damage is not None:
        if args.command == "verify":
            print(f"problem: {damage}\n{args.store}: 1 problem(s)")
            return EXIT_PROBLEMS
        print(f"tierstore {args.command}: error: {damage}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("tierstore: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (
        CommandError,
        TableFileError,
        TraceError,
        StoreFormatError,
        StoreMismatchError,
        FileExistsError,
        FileNotFoundError,
        ValueError,
        OSError,
    ) as error:
        print(f"tierstore {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE


def positive_int(text: str) -> int:
    """An argparse type: a whole number above 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def dtype_choice(text: str) -> torch.dtype:
    """An argparse type: a store's dtype by name ("float16", as ``metadata.DTYPES`` names them)."""
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[text]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierstore", description="Tiered embedding store tools.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    quiet = argparse.ArgumentParser(add_help=False)
    quiet.add_argument(
        "--quiet", action="store_true", help="no progress bars (they are shown only on a terminal anyway)"
    )

    trace_input = argparse.ArgumentParser(add_help=False)
    trace_input.add_argument(
        "trace",
        metavar="TRACE",
        help="zipf:alpha=1.05,n=10000000[,length=N,seed=S] | "
        "uniform:n=N | drift:n=N,hot=H,period=P | a .npy of ids | a CSV/TSV file (with --columns) "
        "| a Criteo Kaggle TSV (with --criteo)",
    )
    trace_input.add_argument(
        "--columns",
        help="comma-separated id columns of a CSV/TSV (names from its header, or "
        "0-based indices); several fuse into one key space with per-column offsets. Empty fields "
        "are skipped; a column of non-negative integers keeps them as ids, any other (strings, or "
        "negative categories such as -1) maps each distinct value to an id",
    )
    trace_input.add_argument(
        "--criteo",
        action="store_true",
        help="the trace is Criteo Kaggle TSV: use its 26 categorical columns, skip empty fields",
    )
    trace_input.add_argument(
        "--delimiter", help="field delimiter (default: tab for .tsv and Criteo, else comma)"
    )

    formats = ", ".join(SUFFIXES)
    command = commands.add_parser(
        "import",
        parents=[quiet],
        help="build a new store from a table file",
        description=f"Build a new store at STORE from the table in SRC ({formats}; "
        "format from the suffix), streaming, atomically (an interrupted import "
        "leaves no store at STORE).",
    )
    command.add_argument("source", metavar="SRC", type=Path)
    command.add_argument("store", metavar="STORE", type=Path)
    command.add_argument(
        "--ids",
        type=Path,
        help="an .npy of int64 ids, one per row of SRC (a sparse id set); "
        "without it row i is id i (or SRC's tensor 'ids', if it has one)",
    )
    command.add_argument(
        "--key",
        help="the tensor holding the rows in a .pt/.safetensors file "
        "(default: its only 2-D float tensor, or the one named 'weight' or '*.weight')",
    )
    command.add_argument("--backend", choices=["mmap", "lmdb"], default="mmap")
    command.add_argument(
        "--optimizer",
        type=optimizer_choice,
        choices=list(OPTIMIZER_CHOICES),
        default="none",
        help="room for this optimizer's per-row state, zeroed (as each starts)",
    )
    command.add_argument("--seed", type=int, default=0, help="initial rows of ids added later")
    command.add_argument(
        "--dtype",
        type=dtype_choice,
        metavar="{" + ",".join(DTYPES) + "}",
        help="the store's rows (default: SRC's), converted; a row it cannot hold is refused",
    )
    command.add_argument(
        "--chunk-rows", type=positive_int, default=1 << 16, help="rows per chunk (memory bound)"
    )
    command.add_argument(
        "--table",
        metavar="NAME",
        help="STORE is a collection (TieredEmbeddingBagCollection's path): load SRC's rows into its "
        "table NAME (rows it holds are replaced, their optimizer state kept)",
    )
    command.set_defaults(run=_import)

    command = commands.add_parser(
        "export",
        parents=[quiet],
        help="write a store's rows to a table file",
        description=f"Write every row of STORE to DST ({formats}), streaming. A store whose "
        "ids are 0..N-1 is written dense (row i = id i); any other with its ids.",
    )
    command.add_argument("store", metavar="STORE", type=Path)
    command.add_argument("destination", metavar="DST", type=Path)
    command.add_argument(
        "--ids", type=Path, help="for .npy: where to write the ids (needed for a sparse store)"
    )
    command.add_argument(
        "--with-state", action="store_true", help="whole rows: weights, then optimizer state"
    )
    command.add_argument(
        "--dtype",
        type=dtype_choice,
        metavar="{" + ",".join(DTYPES) + "}",
        help="the file's rows (default: the store's), converted; a row it cannot hold is refused",
    )
    command.add_argument(
        "--chunk-rows", type=positive_int, default=1 << 16, help="rows per chunk (memory bound)"
    )
    command.add_argument(
        "--table", metavar="NAME", help="STORE is a collection: write the rows of its table NAME"
    )
    command.add_argument(
        "--since",
        metavar="CHECKPOINT",
        type=Path,
        help="a delta: only the rows changed or added since CHECKPOINT (a table.checkpoint() "
        "directory), with the ids removed since (DST's tensor removed_ids, or --removed)",
    )
    command.add_argument(
        "--removed", type=Path, help="for a .npy delta: where to write the removed ids (.npy)"
    )
    command.set_defaults(run=_export)

    command = commands.add_parser(
        "apply-delta",
        parents=[quiet],
        help="bring a replica store one delta on",
        description="Write the rows of DELTA (an 'export --since' file) into STORE and remove its "
        "removed ids: applied in order to a store imported from an older export, deltas give it "
        "exactly the newer rows. Without removals the rows are loaded in place; with them the "
        "store's rows are replaced in one step (a crash leaves the old rows or the new).",
    )
    command.add_argument("store", metavar="STORE", type=Path)
    command.add_argument("delta", metavar="DELTA", type=Path)
    command.add_argument("--ids", type=Path, help="for a .npy delta: its ids (.npy)")
    command.add_argument("--removed", type=Path, help="for a .npy delta: its removed ids (.npy)")
    command.add_argument("--table", metavar="NAME", help="STORE is a collection: apply to its table NAME")
    command.set_defaults(run=_apply_delta)

    command = commands.add_parser(
        "inspect",
        parents=[quiet],
        help="a store's layout, size and last flush",
        description="Show a store's rows, dim, dtype, optimizer, format version, "
        "size on disk, bytes per row and last flush time.",
    )
    command.add_argument("store", metavar="STORE", type=Path)
    command.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    command.set_defaults(run=_inspect)

    command = commands.add_parser(
        "verify",
        parents=[quiet],
        help="check a store; exit 1 on any problem",
        description="Check a store's metadata and structure and that every row "
        "decodes to finite values. Exit 0 if sound, 1 if not.",
    )
    command.add_argument("store", metavar="STORE", type=Path)
    command.set_defaults(run=_verify)

    command = commands.add_parser(
        "bench",
        parents=[quiet, trace_input],
        help="replay an id trace through a store at several cache sizes",
        description="Replay an id trace through a store whose host cache takes each of --sizes, and "
        "report per size: hit rate, rows and bytes moved, evictions, lookups/s and per-batch latency "
        "p50/p99, beside the hit rates of LRU, FIFO and Belady's MIN (optimal) caches of the same size "
        "on the same trace. "
        "Writes a JSON of every figure and a PNG of the hit-rate curve (needs matplotlib: pip install "
        "'tierstore[plot]').",
    )
    command.add_argument(
        "--separate",
        action="store_true",
        help="each column its own table, with its own "
        "cache of each size (default: one table, columns fused with per-column key offsets)",
    )
    command.add_argument(
        "--sizes",
        default="1%,5%,10%",
        help="host cache sizes: shares of the trace's distinct "
        "ids (5%%: unlike a store's host_cache budget, where 5%% is a share of RAM), row counts "
        "(20000) or bytes (64MiB); default 1%%,5%%,10%%",
    )
    command.add_argument(
        "--policy",
        default="lru,fifo,belady",
        help="reference policies to compare with ours (LFU): any of lru, fifo, belady",
    )
    command.add_argument("--batch-size", type=positive_int, default=4096, help="ids per lookup batch")
    command.add_argument(
        "--dim", type=positive_int, default=16, help="row width of the store (sets bytes moved)"
    )
    command.add_argument("--backend", choices=["mmap", "lmdb"], default="mmap")
    command.add_argument(
        "--lookahead",
        type=int,
        default=0,
        metavar="N",
        help="also replay through a lookahead pipeline (tierstore.prefetch) of N batches (1-64)",
    )
    command.add_argument(
        "--ageing",
        action="store_true",
        help="also replay with plain LFU and with LFU aged at 4x the cache: the fixed ageings the "
        "default (chosen online) is measured against",
    )
    command.add_argument(
        "--horizon",
        metavar="H",
        help="also replay evicting by next use within H row lookups ahead (tierstore.prefetch's "
        "horizon): a multiple of each cache size (10x) or a number of lookups (50000)",
    )
    command.add_argument(
        "--admission",
        type=int,
        default=0,
        metavar="N",
        help="also replay behind an admission filter (tierstore.admission_filter): a row stays "
        "cached once its id was looked up N times (1-255)",
    )
    command.add_argument(
        "--warm",
        type=Path,
        metavar="HOTSET",
        help="also replay a table holding every id from a cold cache and warm-started with HOTSET "
        "(a .npy of ids, most wanted first, as 'tierstore profile --out' writes): hit rates over "
        "the first tenth of the lookups and over the rest",
    )
    command.add_argument(
        "--out",
        type=Path,
        default=Path("tierstore-bench"),
        help="prefix of the outputs: OUT.json and OUT.png",
    )
    command.set_defaults(run=_bench)

    command = commands.add_parser(
        "profile",
        parents=[quiet, trace_input],
        help="predict hit rates and hot-set sizes of an id trace from a sample, and recommend budgets",
        description="From a sample of the trace's ids (SHARDS-style spatial sampling, bounded memory): "
        "the hit rate our LFU and Belady's MIN would reach at each cache size, by miniature "
        "simulation; how many rows take 50/80/90/99% of the accesses; and, from a cost model of "
        "bandwidths measured on this machine, the host and device budgets that come within 5% of "
        "the least row movement per training step the memory allows. Writes OUT.json (sizes_rows "
        "and predicted_hit_rate, comparable with bench's JSON), OUT.npy (hot ids, most accessed "
        "first: a warm-start file), for several --columns OUT-tables.npz (each column's own hot "
        "ids: a collection's warm start) and OUT.png (the curve; needs matplotlib).",
    )
    command.add_argument(
        "--sample",
        default="5%",
        help="share of the ids sampled: a percentage (5%%) or a fraction (0.05); default 5%%",
    )
    command.add_argument(
        "--max-ids",
        type=positive_int,
        default=1 << 20,
        help="most distinct ids the sample keeps (bounds its memory; the rate drops past it)",
    )
    command.add_argument(
        "--sizes",
        default="1%,5%,10%",
        help="cache sizes to predict: shares of the trace's estimated distinct ids (5%%), row counts "
        "(20000) or bytes (64MiB); default 1%%,5%%,10%%",
    )
    command.add_argument("--batch-size", type=positive_int, default=4096, help="lookups per training step")
    command.add_argument("--dim", type=positive_int, default=16, help="embedding dim (sets bytes moved)")
    command.add_argument(
        "--optimizer",
        type=optimizer_choice,
        default="sgd",
        metavar="{" + ",".join(OPTIMIZER_CHOICES) + "}",
        help="the sparse optimizer whose state travels with each row (sets bytes moved); default sgd",
    )
    command.add_argument("--backend", choices=["mmap", "lmdb"], default="mmap")
    command.add_argument(
        "--host-memory",
        default="50%",
        help="DRAM the host tier may take: bytes (8GiB) or a share of RAM (50%%); default 50%%",
    )
    command.add_argument(
        "--device-memory",
        default="50%",
        help="GPU memory the device tier may take: bytes or a share (ignored without a GPU); default 50%%",
    )
    command.add_argument(
        "--hot-rows", type=positive_int, help="ids in the hot-set file (default: the largest of --sizes)"
    )
    command.add_argument(
        "--out",
        type=Path,
        default=Path("tierstore-profile"),
        help="prefix of the outputs: OUT.json, OUT.npy, OUT-tables.npz and OUT.png",
    )
    command.set_defaults(run=_profile)
    return parser


def _import(args) -> int:
    if args.table is None:
        _refuse_whole_collection(args.store, "load SRC's rows into one of them")
    source = open_table(args.source, key=args.key, ids_path=args.ids)
    if args.table is not None:
        _check_store(args.store)
        if args.dtype is not None:
            raise TableFileError("--dtype: a collection's table keeps the collection's dtype; leave it out")
        table = import_into_table(source, args.store, args.table, args.chunk_rows, _progress(args))
        print(f"loaded {len(source):,} rows into table {table['name']!r} of {args.store}")
        return 0
    metadata = import_table(
        source,
        args.store,
        backend=args.backend,
        optimizer=args.optimizer,
        seed=args.seed,
        chunk_rows=args.chunk_rows,
        progress=_progress(args),
        dtype=args.dtype,
    )
    print(
        f"imported {len(source):,} rows of dim {metadata.dim} ({metadata.dtype}) into {args.store} "
        f"({metadata.backend})"
    )
    return 0


def _export(args) -> int:
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
            progress=_progress(args),
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
        progress=_progress(args),
        table_name=args.table,
        dtype=args.dtype,
    )
    print(f"exported {count:,} rows to {args.destination}")
    return 0


def _inspect(args) -> int:
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


def _verify(args) -> int:
    _check_store(args.store)
    verify = verify_collection if (args.store / LAYOUT_FILE).exists() else verify_store
    problems = verify(args.store, progress=_progress(args))
    for problem in problems:
        print(f"problem: {problem}")
    print(f"{args.store}: {'sound' if not problems else f'{len(problems)} problem(s)'}")
    return EXIT_PROBLEMS if problems else 0


def _bench(args) -> int:
    policies = [p.strip().lower() for p in args.policy.split(",") if p.strip()]
    unknown = set(policies) - set(REFERENCE_POLICIES)
    if unknown:
        raise CommandError(
            f"unknown --policy {', '.join(sorted(unknown))}; choose from {', '.join(REFERENCE_POLICIES)}"
        )
    if not 0 <= args.lookahead <= MAX_LOOKAHEAD:
        raise CommandError(
            f"--lookahead must be in [0, {MAX_LOOKAHEAD}] batches (0: off), got {args.lookahead}"
        )
    if not 0 <= args.admission <= MAX_COUNT:
        raise CommandError(f"--admission must be in [0, {MAX_COUNT}] lookups (0: off), got {args.admission}")
    if args.horizon is not None:
        try:
            horizon_accesses(horizon_lookups(args.horizon), 1)
        except ValueError:
            raise CommandError(
                f"--horizon must be a multiple of each cache size (10x) or a number of lookups "
                f"(50000), got {args.horizon!r}"
            ) from None
    sizes = _sizes(args)
    json_path = args.out.with_name(args.out.name + ".json")
    _check_writable(json_path)  # before the run, not after it
    warm = None if args.warm is None else hot_ids(args.warm)
    trace = _trace(args)
    tables = split_columns(trace) if args.separate else [trace]
    for table in tables:  # every size fits every table before the first is run
        for size in sizes:
            try:
                cache_rows(size, table.distinct_ids, args.dim * 4)
            except ValueError as error:
                raise CommandError(
                    f"{table.name}: {error}"
                    + (
                        "; with --separate a share is of each column's own distinct ids"
                        if args.separate
                        else ""
                    )
                    + ": give larger --sizes or row counts"
                ) from None
    reports = []
    for number, table in enumerate(tables):
        report = hit_rate_curve(
            table,
            sizes,
            policies,
            args.batch_size,
            args.dim,
            args.backend,
            _progress(args),
            args.lookahead,
            args.admission,
            warm,
            args.horizon,
            args.ageing,
        )
        print(format_table(report, policies))
        png = args.out.with_name(args.out.name + (f"-{number}" if args.separate else "") + ".png")
        plotted = plot_curve(report, policies, png)
        print(
            f"curve: {png}"
            if plotted
            else "(no curve: matplotlib is not installed; pip install 'tierstore[plot]')"
        )
        reports.append(report)
    json_path.write_text(json.dumps({"tables": reports} if args.separate else reports[0], indent=2))
    print(f"figures: {json_path}")
    return 0


def _profile(args) -> int:
    rate = _sample_rate(args.sample)
    sizes = _sizes(args)
    host_memory = _memory("--host-memory", args.host_memory, psutil.virtual_memory().total)
    device_total = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0
    device_memory = _memory("--device-memory", args.device_memory, device_total)
    json_path, ids_path, tables_path, png_path = (
        args.out.with_name(args.out.name + suffix) for suffix in (".json", ".npy", "-tables.npz", ".png")
    )
    for path in (json_path, ids_path):
        _check_writable(path)  # before the run, not after it
    row_width = args.dim + state_width(args.optimizer, args.dim)
    trace = _trace(args)
    report, ranked = profile_trace(
        trace,
        sizes,
        rate,
        args.max_ids,
        args.batch_size,
        args.dim,
        args.backend,
        args.hot_rows,
        _progress(args),
    )
    bandwidths = measure_bandwidths(row_width, args.backend)
    curve = report["curve"]
    report["recommendation"] = plan(
        curve["rows"],
        curve["lfu"],
        args.batch_size,
        row_width,
        bandwidths,
        host_memory,
        device_memory,
    )
    print(format_profile(report))
    np.save(ids_path, ranked)
    if len(trace.columns) > 1:
        np.savez(tables_path, **hot_ids_by_column(trace, ranked))
        print(f"hot ids per column: {tables_path}")
    json_path.write_text(json.dumps(report, indent=2))
    plotted = plot_profile(report, png_path)
    print(f"hot ids: {ids_path}")
    print(
        f"curve: {png_path}"
        if plotted
        else "(no curve: matplotlib is not installed; pip install 'tierstore[plot]')"
    )
    print(f"figures: {json_path}")
    return 0


def _trace(args):
    columns = [c.strip() for c in args.columns.split(",")] if args.columns else None
    return load_trace(args.trace, columns=columns, criteo=args.criteo, delimiter=args.delimiter)


def _sizes(args) -> list[str]:
    """``--sizes``, each spelled as ``cache_rows`` reads it: checked before the trace is read (a
    share is checked against the trace's distinct ids once they are known)."""
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if not sizes:
        raise CommandError(f"--sizes {args.sizes!r} names no size; give e.g. 1%,5%,10% or 20000 or 64MiB")
    for size in sizes:
        cache_rows(size, 2**62, args.dim * 4)  # raises ValueError naming a size that does not parse
    return sizes


def _sample_rate(text: str) -> float:
    """``--sample``: "5%" or "0.05" as a fraction in (0, 1]."""
    try:
        rate = float(text[:-1]) / 100 if text.strip().endswith("%") else float(text)
    except ValueError:
        rate = float("nan")
    if not 0 < rate <= 1:
        raise CommandError(f"--sample must be a share in (0, 100%], e.g. 5% or 0.05; got {text!r}")
    return rate


def _memory(option: str, text: str, total: int) -> int:
    try:
        return parse_bytes(text, total)
    except ValueError as error:
        raise CommandError(f"{option}: {error}") from None


def _progress(args) -> bool | None:
    return False if args.quiet else None


def _check_writable(path: Path) -> None:
    """Raise ``CommandError`` unless ``path`` can be written (its folder is made if missing)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as error:
        raise CommandError(f"cannot write {path}: {error.strerror or error}") from None


def _apply_delta(args) -> int:
    _check_store(args.store)
    if args.table is None:
        _refuse_whole_collection(args.store, "apply a delta to one table")
    count, removed = apply_delta(
        args.store, args.delta, ids_path=args.ids, removed_path=args.removed, table_name=args.table
    )
    print(f"applied {count:,} rows and {removed:,} removed ids to {args.store}")
    return 0


def _refuse_whole_collection(path: Path, action: str) -> None:
    """A ``CommandError`` naming the tables where ``path`` is a collection and ``--table`` is due."""
    if (path / LAYOUT_FILE).exists():
        names = [table["name"] for table in read_layout(path)]
        raise CommandError(f"{path} is a collection of the tables {names}: pass --table NAME to {action}")


def _check_store(path: Path) -> None:
    if not path.exists():
        raise CommandError(f"{path}: no such store directory")


if __name__ == "__main__":
    sys.exit(main())
