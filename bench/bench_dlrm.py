"""A DLRM-shaped sparse arch: 26 tables with the Criteo Kaggle cardinalities (or a real trace's
columns), timed against the same tables in RAM, all in the same run and in turns.

    python bench/bench_dlrm.py --help
    python bench/bench_dlrm.py --trace ../shared/data/taobao_user_behavior_110k.csv --columns 0,1,2

Synthetic (default): each sample has one id per table, drawn Zipf(``--alpha``) over that table's
rows (hot ids scattered), every row first written to the tiered tables' mmap cold stores (a
trained table); every timed step sees a fresh batch. ``--trace``: each record of the file is a
sample, its ``--columns`` the features (one table each, ids as the file has them), read in order
and again from the start when it ends (epochs); the tiered tables start empty and grow on demand.
One step is what a DLRM's sparse arch does: the pooled lookup of all features, side by side as the
interaction layer takes them (``[batch, features x dim]``: ``torch.cat`` of the per-table outputs
where the tables are separate modules), a backward of the gradient the interaction layer hands
down (a fixed dense tensor), and the optimizer (SGD or Adagrad):

- ``collection``: one ``TieredEmbeddingBagCollection`` (the tables fused in one store), host cache
  ``--host-share`` of the rows the tables hold (at least one batch's ids); before timing, batches
  fill its host cache until it evicts (steady state: misses evict rows, as in a long run);
- ``collection_lookahead``: a second collection like it (its own tables: rows the first one just
  looked up would be resident) trained through ``tierstore.prefetch`` with ``--lookahead``
  batches (0: left out), as this machine's default runs it (a worker thread moving the next
  batches' rows up, or inline where cores are few);
- ``collection_lookahead_worker``: the same with the pipeline's worker thread forced on, where
  this machine's default runs the pipeline inline (few cores; ``tierstore.lookahead``);
- ``collection_horizon``: with ``--horizon H``, a collection like the lookahead one trained through
  ``tierstore.prefetch(..., horizon=H)`` as well (evicting by next use within H row lookups), one
  loop over the warm-up's and every round's batches and H lookups' worth beyond them, so its
  horizon reads ahead across rounds and past the last, as in a long run;
- ``separate``: one ``TieredEmbeddingBag`` per table, each with that share of its own rows (what
  fusion saves; warmed by ``--warm-up`` batches only, so its caches are not full: a conservative
  figure);
- ``nn_embedding_bag``: one ``nn.EmbeddingBag(sparse=True)`` per table in RAM + ``torch.optim``;
- ``fbgemm``: FBGEMM's CPU table-batched embedding with its fused optimizer, when ``fbgemm_gpu`` is
  installed (``pip install fbgemm-gpu-cpu==1.8.0``).

``--device cuda``: the collection with a device tier (``--device-share`` of the rows) above its
host tier and its outputs on the GPU, against ``nn.EmbeddingBag(sparse=True)`` tables on the GPU
(the batch's ids copied there each step); the CPU-only methods (``separate``, FBGEMM's CPU TBE, the
lookahead pipeline) are left out, and each timed run waits for the GPU to finish.
Reports samples/s and ratios, the collection's host hit rate (with the pipeline: of the steps'
own lookups, the ones that did not wait for a row) and where its step's time goes, on the training
thread, with and without the pipeline, and what a new page of the page cache costs the machine (the
log's appends make them; the tables in RAM never grow); JSON to ``--json``. ``--scale`` multiplies
every synthetic cardinality.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import mmap
import resource
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import torch
from bench_train import each, interleaved_seconds, median_rates, paired_ratios, ratio_text
from torch import nn
from tqdm import tqdm

from tierstore import (
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    TieredEmbeddingBag,
    TieredEmbeddingBagCollection,
    TieredStore,
    initial_rows,
    optim,
    prefetch,
)
from tierstore.analysis.traces import load_trace
from tierstore.budget import horizon_accesses
from tierstore.kernels.native_types import Residency
from tierstore.kernels.step_passes import StepPasses
from tierstore.nn.collection_layout import table_keys
from tierstore.nn.jagged_batch import JaggedBatch
from tierstore.tiers.stack import TierStack
from tierstore.workloads import ZipfIds

CRITEO_KAGGLE = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
    5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]  # fmt: skip


@dataclasses.dataclass
class Workload:
    """The tables (``cardinalities``: each one's id bound; ``rows``: the rows each will hold, which
    the host share counts from), whether those rows are written to the cold stores first
    (``preloaded``) or grow on demand, and ``next_ids(samples) -> [tables, samples]`` ids."""

    description: str
    features: list[str]
    cardinalities: list[int]
    rows: list[int]
    preloaded: bool
    next_ids: Callable[[int], torch.Tensor]


def zipf_workload(args) -> Workload:
    cardinalities = [max(1, int(rows * args.scale)) for rows in CRITEO_KAGGLE]
    samplers = [ZipfIds(rows, args.alpha, seed=index) for index, rows in enumerate(cardinalities)]
    return Workload(
        f"26 Criteo Kaggle tables x{args.scale} ({sum(cardinalities):,} rows), Zipf({args.alpha})",
        [f"f{index:02d}" for index in range(len(cardinalities))],
        cardinalities,
        cardinalities,
        True,
        lambda samples: torch.stack([torch.from_numpy(sample(samples)) for sample in samplers]),
    )


def trace_workload(args) -> Workload:
    trace = load_trace(str(args.trace), args.columns.split(","))
    tables = len(trace.columns)
    if trace.keys.size % tables:
        raise SystemExit(f"{args.trace}: some records lack a value in a column; choose complete columns")
    keys = trace.keys.reshape(-1, tables)  # [records, columns]
    firsts = np.array([first for _, first, _ in trace.columns])
    ids = torch.from_numpy((keys - firsts).T.copy())  # [columns, records], each column's own ids
    position = 0

    def next_ids(samples: int) -> torch.Tensor:
        nonlocal position
        picked = (torch.arange(position, position + samples) % ids.shape[1]).to(torch.int64)
        position = (position + samples) % ids.shape[1]
        return ids[:, picked]

    return Workload(
        f"{trace.name}, columns {[name for name, _, _ in trace.columns]} ({ids.shape[1]:,} records)",
        [f"f{index:02d}" for index in range(tables)],
        [end - first for _, first, end in trace.columns],
        [int(column.unique().numel()) for column in ids],
        False,
        next_ids,
    )


def tiered_optimizer(name: str):
    return optim.SGD(lr=0.01) if name == "sgd" else optim.Adagrad(lr=0.01)


@functools.cache
def upstream_gradient(batch: int, width: int, device: str = "cpu") -> torch.Tensor:
    """``[batch, width]`` (width: features x dim) on ``device``: the gradient of the pooled features,
    the same every step."""
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(batch, width, generator=generator) * 1e-3).to(device)


def preload(store, keys: torch.Tensor, dim: int) -> None:
    """Write the initial rows of ``keys`` straight to ``store``'s cold tier (as a trained table holds:
    initial weights, zero optimizer state in the store's row layout)."""
    for part in keys.split(1 << 20):
        store.load(part, initial_rows(part, dim, store.row_width - dim, 0, store.dtype))


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}  # --dtype's names


def collection_step(
    work: Workload,
    args,
    directory: Path,
    memory: dict | None = None,
    dtype: torch.dtype = torch.float32,
    host_bytes: int | None = None,
):
    """``(step, the collection, its top cache tier's rows, its store)``, that tier (``top_tier``)
    filled until it evicts; ``memory["collection"]``: what it holds as built (``tables_memory``).
    ``dtype``: the rows'; ``host_bytes``: the host cache's budget in bytes (else ``--host-share``
    of the rows)."""
    configs = [
        EmbeddingBagConfig(rows, args.dim, name=f"t{index:02d}", feature_names=[feature])
        for index, (rows, feature) in enumerate(zip(work.cardinalities, work.features))
    ]
    kind = tiered_optimizer(args.optimizer)
    host_rows = max(int(sum(work.rows) * args.host_share), len(configs) * args.batch_size)
    top_rows, on_device = host_rows, {}
    if args.device_share:  # a device tier above the host tier, the outputs on its device
        top_rows = max(int(sum(work.rows) * args.device_share), len(configs) * args.batch_size)
        on_device = {"device": args.device, "device_cache": top_rows}
    resident = psutil.Process().memory_info().rss
    host_cache = host_rows if host_bytes is None else f"{host_bytes}B"
    collection = TieredEmbeddingBagCollection(
        configs, directory, host_cache=host_cache, optimizer=kind, dtype=dtype, **on_device
    )
    store = collection.groups[f"dim{args.dim}"].store
    if host_bytes is not None:
        top_rows = store.stats()["host"]["budget_rows"]
    if memory is not None:
        memory["collection"] = tables_memory([store], resident)
    if work.preloaded:
        for rows, config in zip(
            tqdm(work.cardinalities, desc="preloading the collection", leave=False, disable=None), configs
        ):
            table = collection._tables[config.name]
            preload(store, table_keys(table, torch.arange(rows)), args.dim)

    def step(ids, lengths):  # the batch's ids on the CPU, where the store looks them up
        kjt = KeyedJaggedTensor(work.features, ids.reshape(-1), lengths=lengths)
        gradient = upstream_gradient(ids.shape[1], len(configs) * args.dim, args.device)
        collection(kjt).values().backward(gradient)

    tier = top_tier(args)
    fill = min(args.fill_batch, top_rows // len(configs))  # a fill batch's ids fit the top cache
    fill_lengths = torch.ones(len(configs) * fill, dtype=torch.int64)
    with tqdm(desc=f"filling the collection's {tier} cache", unit="row", disable=None, leave=False) as bar:
        top = store.stats()[tier]
        while top["evictions"] == 0 and top["resident_rows"] < sum(work.rows):
            step(work.next_ids(fill), fill_lengths)
            top = store.stats()[tier]
            bar.update(top["resident_rows"] - bar.n)
    return step, collection, top_rows, store


def top_tier(args) -> str:
    """The collection's top cache tier: "device" with ``--device-share``, else "host"."""
    return "device" if args.device_share else "host"


def lookahead_run(
    step,
    collection,
    work: Workload,
    lookahead: int,
    background: bool | None = None,
    horizon: str | None = None,
):
    """A run of ``step`` over a list of batches through ``tierstore.prefetch`` (``background`` and
    ``horizon`` as it takes them: None, the default (inline); no horizon)."""

    def run(batches: list) -> None:
        loop = prefetch(
            batches, collection, lookahead, ids=_features(work), background=background, horizon=horizon
        )
        for batch in loop:
            step(*batch)

    return run


def streamed_run(step, collection, work: Workload, lookahead: int, horizon: str, stream: list):
    """A run of ``step`` over a list of batches, all runs' batches taken from one
    ``tierstore.prefetch(stream, ..., horizon=horizon)``: ``stream`` holds every batch the runs will
    be given, in order (filled before the first run), so the horizon reads ahead across runs as a
    training loop's does across its epoch, instead of filling anew at each run's first batch."""
    loop = None

    def run(batches: list) -> None:
        nonlocal loop
        if loop is None:
            loop = iter(prefetch(stream, collection, lookahead, ids=_features(work), horizon=horizon))
        for expected in batches:
            batch = next(loop)
            if batch is not expected:
                raise RuntimeError("the horizon's stream is out of step with the batches its runs are given")
            step(*batch)

    return run


def batches_beyond(batch, accesses: int) -> list:
    """Batches (``batch()`` each) whose distinct ids add up to ``accesses`` row lookups: after the
    last timed one, so that a horizon of that many lookups still reads ahead at every timed step
    (its steady state), instead of reaching the stream's end."""
    beyond, distinct = [], 0
    while distinct < accesses:
        beyond.append(batch())
        distinct += sum(int(torch.unique(ids).numel()) for ids in beyond[-1][0])
    return beyond


def _features(work: Workload):
    """A batch ``(ids [tables, samples], lengths)`` as the collection's ``KeyedJaggedTensor``."""

    def features(batch):
        ids, lengths = batch
        return KeyedJaggedTensor(work.features, ids.reshape(-1), lengths=lengths)

    return features


def waited(run, wait):
    """``run``, then ``wait()`` (``torch.cuda.synchronize`` on a GPU): timed runs end when the work does."""

    def run_and_wait(*arguments) -> None:
        run(*arguments)
        wait()

    return run_and_wait


def counted(run, store, totals: dict, tier: str = "host"):
    """``run``, adding the top tier's (``tier``'s) lookups, hits and rows moved in during it to
    ``totals``, and the process's major page faults (pages read from disk: one method runs at a time)."""

    def counting(batches: list) -> None:
        before, faults = store.stats()[tier], major_faults()
        run(batches)
        after = store.stats()[tier]
        for name in ("hits", "misses", "rows_in"):
            totals[name] = totals.get(name, 0) + after[name] - before[name]
        totals["major_faults"] = totals.get("major_faults", 0) + major_faults() - faults
        totals["steps"] = totals.get("steps", 0) + len(batches)

    return counting


def major_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def new_page_microseconds(directory: Path, pages: int = 2048) -> float:
    """What one new page of the page cache costs this machine (us): ``pages`` written in 64 KiB
    runs to a new file under ``directory`` (as the collection's log appends make them), then removed.
    Where memory is handed back to a virtual machine's host it costs several times a copy's time, and
    the tiered tables pay it for their log's appends while the tables in RAM never grow."""
    run = bytes(range(256)) * 256
    runs = max(1, pages * mmap.PAGESIZE // len(run))
    path = directory / "new_pages.probe"
    with open(path, "wb", buffering=0) as file:
        start = time.perf_counter()
        for _ in range(runs):
            file.write(run)
        seconds = time.perf_counter() - start
    path.unlink()
    return seconds * 1e6 / (runs * len(run) / mmap.PAGESIZE)


def store_bytes(directory: Path) -> int:
    """Bytes the files under ``directory`` take on disk (what the page cache would hold of them)."""
    return sum(path.stat().st_blocks * 512 for path in directory.rglob("*") if path.is_file())


def host_figures(totals: dict, host_rows: int) -> dict:
    lookups = totals["hits"] + totals["misses"]
    return {
        "rows": host_rows,
        "hit_rate": totals["hits"] / lookups,
        "rows_in_per_step": totals["rows_in"] / totals["steps"],
        "major_faults_per_step": totals["major_faults"] / totals["steps"],
    }


def separate_step(work: Workload, args, directory: Path, memory: dict):
    """The step of one ``TieredEmbeddingBag`` per table; ``memory["separate"]``: what they hold."""
    resident = psutil.Process().memory_info().rss
    tables = [
        TieredEmbeddingBag(
            bound,
            args.dim,
            mode="sum",
            path=directory / f"separate{index:02d}",
            host_cache=max(1, int(rows * args.host_share), args.batch_size),
            optimizer=tiered_optimizer(args.optimizer),
        )
        for index, (bound, rows) in enumerate(zip(work.cardinalities, work.rows))
    ]
    memory["separate"] = tables_memory([table.store for table in tables], resident)
    if work.preloaded:
        for rows, table in zip(
            tqdm(work.cardinalities, desc="preloading the tables", leave=False, disable=None), tables
        ):
            preload(table.store, torch.arange(rows), args.dim)
    offsets = torch.arange(args.batch_size)

    def step(ids, lengths):
        pooled = [table(feature_ids, offsets) for table, feature_ids in zip(tables, ids)]
        torch.cat(pooled, dim=1).backward(upstream_gradient(ids.shape[1], len(tables) * args.dim))

    return step


def tables_memory(stores: list, resident_before: int) -> dict:
    """Memory of tiered tables just built: their caches' bytes (every tier) and the process's
    resident growth since ``resident_before`` (bytes)."""
    caches = sum(
        tier["memory_bytes"] for store in stores for tier in store.stats().values() if "memory_bytes" in tier
    )
    return {"caches_bytes": caches, "rss_growth_bytes": psutil.Process().memory_info().rss - resident_before}


def torch_step(work: Workload, args):
    """The step of one ``nn.EmbeddingBag(sparse=True)`` per table on ``--device`` (every row there),
    the batch's ids copied there first."""
    tables = nn.ModuleList(
        nn.EmbeddingBag(rows, args.dim, mode="sum", sparse=True, device=args.device)
        for rows in work.cardinalities
    )
    make = torch.optim.SGD if args.optimizer == "sgd" else torch.optim.Adagrad
    dense_optimizer = make(tables.parameters(), lr=0.01)
    offsets = torch.arange(args.batch_size, device=args.device)

    def step(ids, lengths):
        dense_optimizer.zero_grad()
        ids = ids.to(args.device)
        pooled = [table(feature_ids, offsets) for table, feature_ids in zip(tables, ids)]
        gradient = upstream_gradient(ids.shape[1], len(tables) * args.dim, args.device)
        torch.cat(pooled, dim=1).backward(gradient)
        dense_optimizer.step()

    return step


def fbgemm_step(work: Workload, args):
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except ImportError:
        return None
    kind = EmbOptimType.EXACT_SGD if args.optimizer == "sgd" else EmbOptimType.EXACT_ADAGRAD
    tables = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, args.dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows in work.cardinalities],
        optimizer=kind,
        learning_rate=0.01,
    )
    offsets = torch.arange(len(work.cardinalities) * args.batch_size + 1)

    def step(ids, lengths):
        tables(ids.reshape(-1), offsets).backward(
            upstream_gradient(ids.shape[1], len(work.cardinalities) * args.dim)
        )

    return step


# Where the collection's step spends its time: (label, depth, owner, attribute) of the functions
# timed, each inside the one above it of lower depth.
STAGES = [
    ("forward", 0, TieredEmbeddingBagCollection, "forward"),
    ("check the batch, lay out its keys (native)", 1, JaggedBatch, "__init__"),
    ("the lookup in one native call", 1, TieredStore, "lookup_bags"),
    ("its native call", 2, StepPasses, "lookup_bags"),
    # the passes one by one, where one call does not serve (a tier growing for the batch, other tiers)
    ("distinct ids (native hashing)", 1, StepPasses, "distinct"),
    ("make the rows resident in the top tier", 1, TierStack, "make_resident"),
    ("one native call", 2, StepPasses, "make_resident"),
    ("pooled lookup (native, rows read in place)", 1, StepPasses, "pooled"),
    ("gradient sum + fused optimizer (native)", 0, StepPasses, "backward"),
]
NATIVE_CALLS = ("its native call", "one native call")
# The phases of those native calls, as they time them themselves (their Residency's fields), below
# them: (label, field, depth below the call); the admission's parts below it, the log's and the
# index's side by side on two threads.
NATIVE_PHASES = [
    ("distinct ids/slots (replay unless below)", "distinct_ns", 1),
    ("find them, count the hits", "find_ns", 1),
    ("pick victims (LFU; shadow replay beside)", "choose_ns", 1),
    ("misses read in, victims staged", "admit_ns", 1),
    ("stored rows located and checked", "read_ns", 2),
    ("dirty victims to the log (a thread)", "log_ns", 2),
    ("the tier's index (beside it)", "reindex_ns", 2),
    ("slots filled", "fill_ns", 2),
    ("pooled lookup, rows read in place", "pooled_ns", 1),
]
ADMISSION_FIELDS = ("choose_ns", "admit_ns")  # a row moved in: its victim's choice and its admission


BASELINES = ("nn_embedding_bag", "fbgemm")  # what every method's speed is given against
DETAIL_STEPS = 60  # fresh batches at least, after the rounds, that the breakdown and the cost model time
# The collection's variants, each against the run it adds to (paired as the baselines are).
VARIANTS = {
    "collection_lookahead": "collection",
    "collection_lookahead_worker": "collection_lookahead",
    "collection_horizon": "collection_lookahead",
}


def versus_baselines(seconds: dict[str, list[float]]) -> dict[str, dict[str, tuple]]:
    """``{method: {baseline: paired_ratios}}``: each method against each of ``BASELINES`` timed
    beside it, and each of ``VARIANTS`` against the run it adds to."""
    ratios: dict[str, dict[str, tuple]] = {name: {} for name in seconds}
    for name, taken in seconds.items():
        for baseline in (*BASELINES, VARIANTS.get(name)):
            if baseline in seconds:
                ratios[name][baseline] = paired_ratios(taken, seconds[baseline])
    return ratios


def time_breakdown(run, batches: list) -> list[tuple[str, int, float]]:
    """``(label, depth, ms per step)`` of ``STAGES`` on the training thread (not a lookahead
    pipeline's worker) and of the whole step, over ``run(batches)``; each native call's phases
    (``NATIVE_PHASES``) below it."""
    spent = {label: 0.0 for label, *_ in STAGES}
    spent.update({(call, phase): 0.0 for call in NATIVE_CALLS for phase, *_ in NATIVE_PHASES})
    originals = []
    training = threading.current_thread()
    for label, _, named, attribute in STAGES:
        owner = next(cls for cls in named.__mro__ if attribute in cls.__dict__)  # a part may define it
        raw = owner.__dict__[attribute]
        function = raw.__func__ if isinstance(raw, staticmethod) else raw

        def timed(*arguments, _function=function, _label=label, **keywords):
            if threading.current_thread() is not training:
                return _function(*arguments, **keywords)
            start = time.perf_counter()
            try:
                result = _function(*arguments, **keywords)
            finally:
                spent[_label] += time.perf_counter() - start
            if _label in NATIVE_CALLS:  # its own timing of its phases
                done = next(part for part in result if isinstance(part, Residency))
                for phase, field, _ in NATIVE_PHASES:
                    spent[_label, phase] += getattr(done, field) * 1e-9
            return result

        originals.append((owner, attribute, raw))
        setattr(owner, attribute, staticmethod(timed) if isinstance(raw, staticmethod) else timed)
    try:
        start = time.perf_counter()
        run(batches)
        total = time.perf_counter() - start
    finally:
        for owner, attribute, raw in originals:
            setattr(owner, attribute, raw)
    per_step = 1e3 / len(batches)
    rows = [("step", -1, total * per_step)]
    for label, depth, *_ in STAGES:
        rows.append((label, depth, spent[label] * per_step))
        if label in NATIVE_CALLS:
            rows.extend(
                (phase, depth + below, spent[label, phase] * per_step) for phase, _, below in NATIVE_PHASES
            )
    return rows


def step_costs(step, store, batches: list, lengths: torch.Tensor, tier: str = "host") -> dict[str, float]:
    """The collection's step as a cost model, from medians over ``batches`` (fresh ones):
    ``fixed_ms`` (a one-sample step whose rows are resident, right after a full one: the caches
    as that step left them), ``warm_fixed_ms`` (the same one-sample step run back to back),
    ``hit_ns_per_id`` (a whole batch run again at once, every row resident: its time past the fixed
    cost, per looked-up id) and
    ``miss_us_per_row`` (a fresh batch's time past the same batch's all-hit rerun, per row moved
    into the top cache tier, ``tier``)."""
    small = lengths[: len(lengths) // batches[0].shape[1]]
    fixed, hits, fresh, moved = [], [], [], []
    for ids in batches:
        before = store.stats()[tier]["rows_in"]
        start = time.perf_counter()
        step(ids, lengths)
        fresh.append(time.perf_counter() - start)
        moved.append(store.stats()[tier]["rows_in"] - before)
        start = time.perf_counter()
        step(ids, lengths)  # every row resident now
        hits.append(time.perf_counter() - start)
        start = time.perf_counter()
        step(ids[:, :1], small)
        fixed.append(time.perf_counter() - start)
    warm = []
    for _ in range(len(batches)):  # the last batch's first sample, its rows resident, again and again
        start = time.perf_counter()
        step(batches[-1][:, :1], small)
        warm.append(time.perf_counter() - start)
    median = statistics.median
    entries = batches[0].numel()
    misses = [max(f - h, 0.0) / max(m, 1) for f, h, m in zip(fresh, hits, moved)]
    return {
        "fixed_ms": median(fixed) * 1e3,
        "warm_fixed_ms": median(warm) * 1e3,
        "hit_ns_per_id": max(median(hits) - median(fixed), 0.0) / entries * 1e9,
        "miss_us_per_row": median(misses) * 1e6,
        "rows_moved_in_per_step": median(moved),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, help="a CSV/TSV trace whose --columns are the features")
    parser.add_argument("--columns", default="0,1", help="the trace's id columns (names or 0-based indices)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every synthetic cardinality")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--alpha", type=float, default=1.05)
    parser.add_argument("--host-share", type=float, default=0.10, help="host cache, share of all rows")
    parser.add_argument("--optimizer", choices=["sgd", "adagrad"], default="sgd")
    parser.add_argument(
        "--lookahead", type=int, default=8, help="batches tierstore.prefetch reads ahead (0: off)"
    )
    parser.add_argument(
        "--horizon", help="also time prefetch's horizon: row lookups, or a multiple of the host cache (10x)"
    )
    parser.add_argument("--warm-up", type=int, default=20, help="steps of every method before timing")
    parser.add_argument(
        "--fill-batch", type=int, default=32768, help="samples per batch filling the collection's host cache"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=20,
        help="turns of timing, each method once (many short turns: the methods' ratios in a turn see "
        "the same moment of a shared machine)",
    )
    parser.add_argument("--steps", type=int, default=15, help="batches per method per round")
    parser.add_argument(
        "--device", default="cpu", help="where the outputs and nn.EmbeddingBag's tables live (cpu, cuda)"
    )
    parser.add_argument(
        "--device-share",
        type=float,
        help="device cache, share of all rows (default: 0.10 on a GPU, none on the CPU)",
    )
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        help="also time the collection with 16-bit rows, its host cache the float32 one's bytes",
    )
    parser.add_argument("--json", type=Path, default=Path("bench/results/dlrm.json"))
    args = parser.parse_args()
    if args.device_share is None:
        args.device_share = 0.10 if args.device != "cpu" else 0.0
    if args.device_share and (args.lookahead or args.horizon):
        print("with a device tier the lookahead and horizon runs are left out (the CPU pipeline's figures)")
        args.lookahead, args.horizon = 0, None

    work = trace_workload(args) if args.trace else zipf_workload(args)
    lengths = torch.ones(len(work.features) * args.batch_size, dtype=torch.int64)

    def batch():
        return work.next_ids(args.batch_size), lengths

    with tempfile.TemporaryDirectory() as directory:
        memory: dict = {}  # what the collection and the separate tables hold as built
        step_of_collection, _, top_rows, store = collection_step(
            work, args, Path(directory) / "plain", memory
        )
        tier = top_tier(args)
        runs = {"collection": counted(each(step_of_collection), store, host := {}, tier)}
        if args.lookahead:  # its own tables: batches the other collection ran would be resident
            step, collection, _, own_store = collection_step(work, args, Path(directory) / "lookahead")
            with_lookahead = lookahead_run(step, collection, work, args.lookahead)
            runs["collection_lookahead"] = counted(with_lookahead, own_store, host_lookahead := {})
            # The worker (background=True), what the default (inline) was chosen against, where the page
            # cache holds a third store beside the others (and the baselines' tables): else misses
            # would read the disk.
            footprint = store_bytes(Path(directory) / "plain")
            needed = 4 * footprint + 2 * sum(work.rows) * args.dim * 4  # stores incl. separate; 2 baselines
            if psutil.virtual_memory().available > needed:
                step, collection, _, _ = collection_step(work, args, Path(directory) / "worker")
                runs["collection_lookahead_worker"] = lookahead_run(
                    step, collection, work, args.lookahead, background=True
                )
            else:
                print(
                    f"collection_lookahead_worker left out: its store ({footprint / 2**30:.1f} GiB) would "
                    "push the other stores' files out of this machine's page cache"
                )
        if args.dtype:  # the same bytes of host cache hold more 16-bit rows
            float32_bytes = store.stats()["host"]["memory_bytes"]
            step, _, rows_16, store_16 = collection_step(
                work, args, Path(directory) / args.dtype, dtype=DTYPES[args.dtype], host_bytes=float32_bytes
            )
            runs[f"collection_{args.dtype}"] = counted(each(step), store_16, host_16 := {}, tier)
        if args.horizon:
            step, collection, _, horizon_store = collection_step(work, args, Path(directory) / "horizon")
            horizon_stream: list = []  # the warm-up's and the timed rounds' batches, once made
            foreseeing = streamed_run(
                step, collection, work, max(args.lookahead, 1), args.horizon, horizon_stream
            )
            runs["collection_horizon"] = counted(foreseeing, horizon_store, host_horizon := {})
        if not args.device_share:  # these run on the CPU alone
            runs["separate"] = each(separate_step(work, args, Path(directory), memory))
        runs["nn_embedding_bag"] = each(torch_step(work, args))
        fbgemm = None if args.device_share else fbgemm_step(work, args)
        if fbgemm is not None:
            runs["fbgemm"] = each(fbgemm)
        wait = torch.cuda.synchronize if args.device.startswith("cuda") else lambda: None
        runs = {name: waited(run, wait) for name, run in runs.items()}
        warm_up = [batch() for _ in range(args.warm_up)]
        timed = [[batch() for _ in range(args.steps)] for _ in range(args.rounds)]
        if args.horizon:
            horizon_stream.extend(warm_up + [one for batches in timed for one in batches])
            horizon_stream.extend(batches_beyond(batch, horizon_accesses(args.horizon, top_rows)))
        for run in tqdm(runs.values(), desc="warming up", leave=False, disable=None):
            run(warm_up)
        host.clear()
        if args.lookahead:
            host_lookahead.clear()
        if args.horizon:
            host_horizon.clear()
        if args.dtype:
            host_16.clear()
        page_us = new_page_microseconds(Path(directory))  # in the memory the timed rounds start from
        seconds = interleaved_seconds(runs, timed)
        rates = median_rates(seconds, args.steps * args.batch_size)
        detail_steps = max(args.steps, DETAIL_STEPS)
        breakdowns = {
            "collection": time_breakdown(runs["collection"], [batch() for _ in range(detail_steps)])
        }
        costs = step_costs(
            waited(step_of_collection, wait), store, [batch()[0] for _ in range(detail_steps)], lengths, tier
        )
        if args.lookahead:
            breakdowns["collection_lookahead"] = time_breakdown(
                runs["collection_lookahead"], [batch() for _ in range(detail_steps)]
            )
    caches = {"collection": host_figures(host, top_rows)}
    if args.lookahead:
        caches["collection_lookahead"] = host_figures(host_lookahead, top_rows)
    if args.horizon:
        caches["collection_horizon"] = host_figures(host_horizon, top_rows)
    if args.dtype:
        caches[f"collection_{args.dtype}"] = host_figures(host_16, rows_16)
    moved_per_step = caches["collection"]["rows_in_per_step"]
    if moved_per_step and not args.device_share:  # the native calls' own timers, per row moved in
        spent = collections.Counter()  # by label: each native call's phases (one call runs)
        for label, _, milliseconds in breakdowns["collection"]:
            spent[label] += milliseconds
        admission = sum(spent[label] for label, field, _ in NATIVE_PHASES if field in ADMISSION_FIELDS)
        costs["native_us_per_row_moved_in"] = admission * 1e3 / moved_per_step
        costs["native_us_per_row_parts"] = {
            label: spent[label] * 1e3 / moved_per_step for label, _, below in NATIVE_PHASES if below == 2
        }
    print(
        f"{work.description}, dim {args.dim}, batch {args.batch_size}, {args.optimizer}, on {args.device}, "
        f"{tier} cache {top_rows:,} rows ({top_rows / sum(work.rows):.0%} of the {sum(work.rows):,} the "
        "tables hold)"
    )
    ratios = versus_baselines(seconds)
    print(
        "samples/s: the median round; against a baseline: the median of each round's ratio "
        "(its lowest-highest), the methods timed in turns"
    )
    print(f"{'method':<28}{'samples/s':>12}{'vs nn.EmbeddingBag':>22}{'vs FBGEMM':>22}")
    for name, rate in rates.items():
        columns = "".join(
            f"{ratio_text(ratios[name][base]) if base in ratios[name] else '':>22}" for base in BASELINES
        )
        print(f"{name:<28}{rate:>12,.0f}{columns}")
    for name, against in VARIANTS.items():
        if against in ratios.get(name, {}):
            print(f"{name} against {against}: {ratio_text(ratios[name][against])}")
    for name, figures in caches.items():
        print(
            f"{name}'s {tier} cache ({figures['rows']:,} rows) while timed: its steps' lookups hit "
            f"{figures['hit_rate']:.3f}, "
            f"{figures['rows_in_per_step']:,.0f} rows moved in per step, "
            f"{figures['major_faults_per_step']:,.1f} major page faults per step (pages read from disk)"
        )
    for name, held in memory.items():
        print(
            f"{name} as built: caches {held['caches_bytes'] / 2**20:,.1f} MiB, process resident memory "
            f"+{held['rss_growth_bytes'] / 2**20:,.1f} MiB"
        )
    names = list(breakdowns)
    print(
        "where the collection's step goes on the training thread "
        "(ms per step, each stage inside the one above it):"
    )
    print(f"  {'':<48}" + "".join(f"{name:>22}" for name in names))
    for row, (label, depth, _) in enumerate(breakdowns["collection"]):
        if not any(breakdowns[name][row][2] for name in names):  # a path not taken (a host-tier one
            continue  # under a device tier)
        figures = "".join(f"{breakdowns[name][row][2]:>22.2f}" for name in names)
        print(f"  {'  ' * (depth + 1)}{label:<{46 - 2 * depth}}{figures}")
    print(
        f"the collection's step as a cost model: fixed {costs['fixed_ms']:.3f} ms (back to back: "
        f"{costs['warm_fixed_ms']:.3f} ms), hit path "
        f"{costs['hit_ns_per_id']:.0f} ns per id, {costs['miss_us_per_row']:.2f} us per row moved in "
        f"({costs['rows_moved_in_per_step']:,.0f} a step)"
    )
    if "native_us_per_row_moved_in" in costs:
        print(
            f"a row moved in, as the native call times its victims' choice and the misses' admission: "
            f"{costs['native_us_per_row_moved_in']:.2f} us (the cost model's figure also counts the CPU "
            "caches the all-hit rerun finds warm); of it, per row: "
            + ", ".join(f"{label} {us:.2f}" for label, us in costs["native_us_per_row_parts"].items())
            + " us"
        )
    print(
        f"a new page of this machine's page cache (which the log's appends make) costs {page_us:.2f} us "
        "(pages written to a new file beside the stores just before timing)"
    )
    step_ms = breakdowns["collection"][0][2]
    shares = ", ".join(
        f"{label} {ms / step_ms:.0%}"
        for label, depth, ms in breakdowns["collection"][1:]
        if depth <= 1 and ms
    )
    print(f"shares of the collection's step: {shares}")
    if args.lookahead:
        print("collection_lookahead ran inline (prefetch's default), so nothing moved off the thread")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "config": {k: str(v) for k, v in vars(args).items()},
                "workload": work.description,
                "samples_per_s": rates,
                "paired_ratios": ratios,
                "host_cache": caches,
                "memory_as_built": memory,
                "step_costs": costs,
                "new_page_us": page_us,
                "breakdown_ms_per_step": {
                    name: {label: milliseconds for label, _, milliseconds in rows}
                    for name, rows in breakdowns.items()
                },
            }
        )
    )
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
