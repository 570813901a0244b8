"""Training a table several times larger than a memory limit, under that limit.

    python bench/bench_larger_than_ram.py --help

Builds one table of ``--rows`` x ``--dim`` float32 rows (default: ``--times`` 4 the memory limit's
bytes; every row written to disk first, each the deterministic initial row of its id), then
trains it with SGD on the same ``--steps`` batches (bags of ``--bag`` ids drawn Zipf(``--alpha``),
a fixed random upstream gradient per step) by:

- ``tiered``: ``TieredEmbeddingBag`` on an mmap store, host cache ``--host-cache`` (default a quarter
  of the limit), in a memory cgroup of ``--limit``;
- ``tiered_lmdb``: the same on an LMDB store;
- ``tiered_worker``: ``tiered`` trained through ``tierstore.prefetch(..., 8, background=True)``: a
  worker thread makes the next 8 batches' rows resident while a batch trains (cold reads off the
  training thread);
- ``tiered_horizon``: ``tiered`` trained through ``tierstore.prefetch(..., horizon="10x")`` (evicting
  by next use ten caches ahead, fed the batches' ids from their file), its store budgeting the
  horizon's memory (``horizon="10x"``): the same bytes, fewer rows cached;
- ``memmap``: the hand-written baseline, the table a ``numpy.memmap``: gather the batch's distinct
  rows, ``F.embedding_bag``, SGD on the gathered rows, write them back; in the same cgroup;
- ``in_ram``: ``nn.EmbeddingBag(sparse=True)`` + ``torch.optim.SGD`` with the whole table in RAM and
  no limit: the ceiling.

``--flush-every N`` makes the tiered tables flush (and the memmap sync its map) every N steps,
inside the timed loop: training as it runs when it checkpoints.

Each method runs in a child process (placed in the cgroup before it imports anything, after the
page cache is dropped, so the rows come from disk). The limit is a cgroup v1 memory limit
(``memory.limit_in_bytes``, page cache included); without one (no cgroup v1 memory controller, or
not root) the bench says so and stops, unless ``--allow-no-limit`` runs it unlimited (a smoke run).
Reported per method: steps/s (timed after ``--warm-up`` steps), its ratio to ``memmap`` and to
``in_ram``, the host cache's hit rate, peak cgroup memory (``memory.max_usage_in_bytes``), major
page faults, bytes read and written (``/proc/self/io``), whether the kernel killed it, and whether
its rows at the end equal ``in_ram``'s (up to float32 summation order: ``allclose`` at 1e-4, on up to
50,000 of the batches' distinct ids, evenly spaced; the largest difference is reported). JSON to
``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
METHODS = ("tiered", "tiered_lmdb", "tiered_worker", "tiered_horizon", "memmap", "in_ram")
LIMITED = {"tiered", "tiered_lmdb", "tiered_worker", "tiered_horizon", "memmap"}
WORKER_LOOKAHEAD = 8  # tiered_worker's window, in batches
HORIZON = "10x"  # tiered_horizon's, in host caches
LEARNING_RATE = 0.05
BUILD_CHUNK = 1 << 18  # rows generated and written at once
CHECKED_ROWS = 50_000  # rows compared with in_ram's at the end, evenly spaced over the batches' ids
SEED = 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=None, help="rows (default: --times the limit)")
    parser.add_argument("--times", type=float, default=4.0, help="the table's bytes over the limit")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--limit", default="384MiB", help="the cgroup's memory limit, page cache included")
    parser.add_argument(
        "--host-cache", default=None, help="the tiered tables' host cache (default: limit / 4)"
    )
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--bag", type=int, default=20, help="ids per bag")
    parser.add_argument("--alpha", type=float, default=1.05)
    parser.add_argument("--steps", type=int, default=100, help="timed steps per method")
    parser.add_argument("--warm-up", type=int, default=5)
    parser.add_argument(
        "--flush-every",
        type=int,
        default=0,
        help="steps between flushes (tiered tables flush, the memmap syncs its map; 0: none)",
    )
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument(
        "--dir", type=Path, default=None, help="where the tables go (default: a temporary directory)"
    )
    parser.add_argument(
        "--allow-no-limit", action="store_true", help="run unlimited where no cgroup can be made"
    )
    parser.add_argument(
        "--json", type=Path, default=Path(__file__).parent / "results" / "larger_than_ram.json"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    methods = [name.strip() for name in args.methods.split(",") if name.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    from tierstore.budget import parse_bytes

    limit = parse_bytes(args.limit)
    if args.rows is None:
        args.rows = -(-int(args.times * limit) // (args.dim * 4))
    problem = _cgroup_problem()
    if problem is not None and not args.allow_no_limit:
        print(f"skipped: no memory limit can be set here ({problem}); --allow-no-limit runs unlimited")
        return
    host_cache = args.host_cache or f"{limit // 4}B"
    work = Path(tempfile.mkdtemp(prefix="larger-than-ram-", dir=args.dir))
    try:
        _run(args, methods, limit if problem is None else None, host_cache, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(args, methods: list[str], limit: int | None, host_cache: str, work: Path) -> None:
    table_bytes = args.rows * args.dim * 4
    print(
        f"table: {args.rows:,} rows x dim {args.dim} float32 = {table_bytes / 2**20:,.0f} MiB"
        + (f", {table_bytes / limit:.1f}x the limit of {limit / 2**20:,.0f} MiB" if limit else ", no limit")
        + f"; host cache {host_cache}; batches of {args.batch_size} x {args.bag} ids, Zipf {args.alpha}"
    )
    started = time.perf_counter()
    _build(args, methods, work)
    print(f"built in {time.perf_counter() - started:.0f} s")
    results = {}
    for method in methods:
        results[method] = _measure(args, method, limit if method in LIMITED else None, host_cache, work)
        _print_row(method, results[method])
    _compare(results, work)
    _report(args, results, limit, host_cache)


def _build(args, methods: list[str], work: Path) -> None:
    """The batches, and the table as each method reads it, every row its initial row."""
    import torch

    from tierstore import TieredStore, initial_weights
    from tierstore.workloads import ZipfIds

    sample = ZipfIds(args.rows, args.alpha, SEED)
    count = args.warm_up + args.steps
    batches = sample(count * args.batch_size * args.bag).reshape(count, -1)
    np.save(work / "batches.npy", batches)
    distinct = np.unique(batches)  # here, outside the limit: the batches' ids are tens of MiB
    np.save(work / "checked.npy", distinct[:: max(1, distinct.size // CHECKED_ROWS)])
    del batches, distinct
    table = np.lib.format.open_memmap(work / "table.npy", "w+", np.float32, (args.rows, args.dim))
    stores = [
        TieredStore(work / name, dim=args.dim, backend=backend, host_cache=1024)
        for name, backend in (
            ("tiered", "mmap"),
            ("tiered_lmdb", "lmdb"),
            ("tiered_worker", "mmap"),
            ("tiered_horizon", "mmap"),
        )
        if name in methods
    ]
    for start in range(0, args.rows, BUILD_CHUNK):
        ids = torch.arange(start, min(start + BUILD_CHUNK, args.rows))
        rows = initial_weights(ids, args.dim, SEED, torch.float32)
        table[start : start + ids.numel()] = rows.numpy()
        for store in stores:
            store.load(ids, rows)
    table.flush()
    del table
    for store in stores:
        store.close()


def _measure(args, method: str, limit: int | None, host_cache: str, work: Path) -> dict:
    """Run ``method`` in a child process (in a fresh cgroup of ``limit`` bytes where given)."""
    _drop_page_cache()
    group = _make_cgroup(limit) if limit is not None else None
    command = [sys.executable, __file__, "--child", method, "--host-cache", host_cache, "--dir", str(work)]
    command += [
        f"--{name.replace('_', '-')}={getattr(args, name)}"
        for name in ("rows", "dim", "steps", "warm_up", "flush_every")
    ]
    command += [f"--batch-size={args.batch_size}", f"--bag={args.bag}"]

    def enter_cgroup() -> None:  # in the child, before it runs (or imports) anything
        if group is not None:
            (group / "cgroup.procs").write_text(str(os.getpid()))

    try:
        child = subprocess.run(command, preexec_fn=enter_cgroup, capture_output=True, text=True)
        result = {"exit": child.returncode}
        out = work / f"{method}.json"
        if child.returncode == 0 and out.exists():
            result.update(json.loads(out.read_text()))
        else:
            killed = child.returncode == -signal.SIGKILL
            result["killed"] = killed
            result["error"] = (
                "killed (SIGKILL: the memory limit's OOM killer)" if killed else child.stderr.strip()[-600:]
            )
        if group is not None:
            result["peak_memory_bytes"] = int((group / "memory.max_usage_in_bytes").read_text())
            result["limit_hits"] = int((group / "memory.failcnt").read_text())
        return result
    finally:
        if group is not None:
            group.rmdir()


def _child(args) -> None:
    """One method's training, its figures written to ``--dir/METHOD.json`` and its final rows of
    the batches' distinct ids to ``--dir/METHOD-rows.npy``."""
    import torch

    method, work = args.child, args.dir
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    batches = np.load(work / "batches.npy", mmap_mode="r")
    offsets = torch.arange(0, args.batch_size * args.bag, args.bag)
    gradients = torch.Generator().manual_seed(SEED)
    step, finish, flush, order = _method(method, args, work)
    timed = None
    for number in order(range(len(batches)), lambda number: torch.from_numpy(np.array(batches[number]))):
        if number == args.warm_up:
            timed = _counters()
        ids = torch.from_numpy(np.array(batches[number]))
        grad = torch.randn(args.batch_size, args.dim, generator=gradients)
        step(ids, offsets, grad)
        if args.flush_every and (number + 1) % args.flush_every == 0:
            flush()
    result = {key: after - timed[key] for key, after in _counters().items()}
    result["steps_per_second"] = args.steps / result.pop("seconds")
    rows, extra = finish(torch.from_numpy(np.load(work / "checked.npy")))
    np.save(work / f"{method}-rows.npy", rows.numpy())
    result.update(extra)
    (work / f"{method}.json").write_text(json.dumps(result))


def _method(method: str, args, work: Path):
    """``(step(ids, offsets, upstream grad), finish(ids) -> (their rows, extra figures), flush(),
    order(batch numbers, ids of a number) -> the numbers as the loop takes them)``."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    def in_turn(numbers, ids_of):
        return numbers

    if method in ("tiered", "tiered_lmdb", "tiered_worker", "tiered_horizon"):
        import tierstore
        from tierstore import TieredEmbeddingBag, optim

        foreseeing = method == "tiered_horizon"
        table = TieredEmbeddingBag(
            args.rows,
            args.dim,
            mode="sum",
            path=work / method,
            host_cache=args.host_cache,
            optimizer=optim.SGD(lr=LEARNING_RATE),
            horizon=HORIZON if foreseeing else None,
        )

        def foreseen(numbers, ids_of):
            return tierstore.prefetch(numbers, table, 1, ids=ids_of, background=False, horizon=HORIZON)

        def ahead(numbers, ids_of):
            return tierstore.prefetch(numbers, table, WORKER_LOOKAHEAD, ids=ids_of, background=True)

        def step(ids, offsets, grad):
            table(ids, offsets).backward(grad)

        def finish(ids):
            table.flush()
            host = table.store.stats()["host"]
            extra = {
                "hit_rate": host["hits"] / max(1, host["hits"] + host["misses"]),
                "host_rows": host["capacity_rows"],
                "rows_in": host["rows_in"],
            }
            return table.store.get(ids), extra

        orders = {"tiered_horizon": foreseen, "tiered_worker": ahead}
        return step, finish, table.flush, orders.get(method, in_turn)
    if method == "memmap":
        weights = np.load(work / "table.npy", mmap_mode="r+")

        def step(ids, offsets, grad):
            unique, inverse = torch.unique(ids, return_inverse=True)
            rows = torch.from_numpy(weights[unique.numpy()]).requires_grad_()
            F.embedding_bag(inverse, rows, offsets, mode="sum").backward(grad)
            with torch.no_grad():
                weights[unique.numpy()] = (rows - LEARNING_RATE * rows.grad).numpy()

        def finish(ids):
            weights.flush()
            return torch.from_numpy(weights[ids.numpy()]), {}

        return step, finish, weights.flush, in_turn
    from tierstore import initial_weights

    table = nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True)
    with torch.no_grad():  # the initial rows (table.npy holds the memmap run's trained ones)
        for start in range(0, args.rows, BUILD_CHUNK):
            ids = torch.arange(start, min(start + BUILD_CHUNK, args.rows))
            table.weight[start : start + ids.numel()] = initial_weights(ids, args.dim, SEED, torch.float32)
    sgd = torch.optim.SGD(table.parameters(), lr=LEARNING_RATE)

    def step(ids, offsets, grad):
        table(ids, offsets).backward(grad)
        sgd.step()
        sgd.zero_grad()

    def finish(ids):
        return table.weight.detach()[ids].clone(), {}

    return step, finish, lambda: None, in_turn


def _counters() -> dict:
    """This process's clock, major faults and bytes read and written from storage, now."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {
        "seconds": time.perf_counter(),
        "major_faults": usage.ru_majflt,
        "read_bytes": int(io["read_bytes"]),
        "write_bytes": int(io["write_bytes"]),
    }


def _compare(results: dict, work: Path) -> None:
    """Each method's final rows against ``in_ram``'s (where both finished)."""
    reference = work / "in_ram-rows.npy"
    for method, result in results.items():
        rows = work / f"{method}-rows.npy"
        if method != "in_ram" and reference.exists() and rows.exists():
            ours, reference_rows = np.load(rows), np.load(reference)
            result["rows_max_difference"] = float(np.abs(ours - reference_rows).max(initial=0.0))
            result["rows_equal_in_ram"] = bool(np.allclose(ours, reference_rows, rtol=1e-4, atol=1e-4))


def _report(args, results: dict, limit: int | None, host_cache: str) -> None:
    memmap = results.get("memmap", {}).get("steps_per_second")
    in_ram = results.get("in_ram", {}).get("steps_per_second")
    for result in results.values():
        speed = result.get("steps_per_second")
        if speed is not None:
            result["vs_memmap"] = speed / memmap if memmap else None
            result["vs_in_ram"] = speed / in_ram if in_ram else None
    print(
        f"\n{'method':12s} {'steps/s':>8s} {'vs memmap':>9s} {'vs in RAM':>9s} {'hits':>6s} "
        f"{'peak MiB':>8s} {'maj faults':>10s} {'read MiB':>9s} {'written MiB':>11s}  rows"
    )
    for method, result in results.items():
        _print_row(method, result, header=False)
    configuration = {
        key: getattr(args, key)
        for key in ("rows", "dim", "batch_size", "bag", "alpha", "steps", "warm_up", "flush_every")
    }
    configuration.update(limit_bytes=limit, host_cache=host_cache)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"configuration": configuration, "results": results}, indent=2))
    print(f"results: {args.json}")


def _print_row(method: str, result: dict, header: bool = True) -> None:
    if header:
        print(f"{method}: " + (result.get("error") or f"{result['steps_per_second']:.2f} steps/s"))
        return
    if "steps_per_second" not in result:
        print(f"{method:12s} {result.get('error', 'failed')}")
        return

    def figure(key, scale=1.0, form="{:.2f}"):
        value = result.get(key)
        return "-" if value is None else form.format(value / scale)

    equal = {True: "equal", False: "DIFFER", None: "-"}[result.get("rows_equal_in_ram")]
    print(
        f"{method:12s} {figure('steps_per_second'):>8s} {figure('vs_memmap'):>9s} {figure('vs_in_ram'):>9s} "
        f"{figure('hit_rate'):>6s} {figure('peak_memory_bytes', 2**20, '{:.0f}'):>8s} "
        f"{figure('major_faults', 1, '{:.0f}'):>10s} {figure('read_bytes', 2**20, '{:.0f}'):>9s} "
        f"{figure('write_bytes', 2**20, '{:.0f}'):>11s}  {equal}"
    )


def _cgroup_problem() -> str | None:
    """Why no memory cgroup can be made here (None: it can)."""
    if not (CGROUP_ROOT / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller at {CGROUP_ROOT}"
    if not os.access(CGROUP_ROOT, os.W_OK):
        return f"{CGROUP_ROOT} is not writable (run as root)"
    return None


def _make_cgroup(limit: int) -> Path:
    group = CGROUP_ROOT / f"tierstore-bench-{os.getpid()}"
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(limit))
    swap_limit = group / "memory.memsw.limit_in_bytes"
    if swap_limit.exists():  # no swapping out of the limit either
        swap_limit.write_text(str(limit))
    return group


def _drop_page_cache() -> None:
    """Drop clean cached pages, so that each method reads its rows from disk (root only)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1")
    except OSError as error:
        print(f"(the page cache stays: {error}; rows may come from memory)")


if __name__ == "__main__":
    main()
