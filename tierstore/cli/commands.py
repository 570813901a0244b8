"""The ``tierstore`` command line: its parser (import, export, apply-delta, inspect, verify, compact,
bench, profile) and ``main``, which runs a command (``store_commands``, ``trace_commands``).

Exit codes: 0 success; 1 ``verify`` found problems; 2 bad usage or input (a one-line error, no
traceback); 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..analysis.traces import TraceError
from ..errors import StoreFormatError, StoreMismatchError
from ..metadata import DTYPES
from .arguments import EXIT_INTERRUPTED, EXIT_PROBLEMS, EXIT_USAGE, CommandError, dtype_choice, positive_int
from .lmdb_probe import READING_COMMANDS, lmdb_damage
from .store_commands import run_apply_delta, run_compact, run_export, run_import, run_inspect, run_verify
from .table_files import SUFFIXES, TableFileError
from .trace_commands import run_bench, run_profile
from .transfer import (
    OPTIMIZER_CHOICES,
    optimizer_choice,
)


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
    command.set_defaults(run=run_import)

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
    command.set_defaults(run=run_export)

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
    command.set_defaults(run=run_apply_delta)

    command = commands.add_parser(
        "inspect",
        parents=[quiet],
        help="a store's layout, size and last flush",
        description="Show a store's rows, dim, dtype, optimizer, format version, "
        "size on disk, bytes per row and last flush time.",
    )
    command.add_argument("store", metavar="STORE", type=Path)
    command.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    command.set_defaults(run=run_inspect)

    command = commands.add_parser(
        "verify",
        parents=[quiet],
        help="check a store; exit 1 on any problem",
        description="Check a store's metadata and structure and that every row "
        "decodes to finite values. Exit 0 if sound, 1 if not.",
    )
    command.add_argument("store", metavar="STORE", type=Path)
    command.set_defaults(run=run_verify)

    command = commands.add_parser(
        "compact",
        parents=[quiet],
        help="give back the disk space of removed ids",
        description="Rewrite a store (or each store of a collection) holding only its rows: the space "
        "of ids removed (TieredStore.remove, or expired by ttl/max_rows) is freed. The store is "
        "replaced in one step: a crash leaves the old files or the new. Needs the store closed elsewhere.",
    )
    command.add_argument("store", metavar="STORE", type=Path)
    command.set_defaults(run=run_compact)

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
        help="reference policies to compare with ours (LFU): any of lru, fifo, belady (belady also "
        "brings MIN over the same batches, each batch resident whole)",
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
    command.set_defaults(run=run_bench)

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
    command.set_defaults(run=run_profile)
    return parser


if __name__ == "__main__":
    sys.exit(main())
