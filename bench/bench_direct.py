"""Rows addressed directly: a table held whole in its host tier, every row resident, trained on
batches of random ids, with its rows at their home slots (``DirectLayout``) and without (the same
table, its tier's homes given to a table number it does not use, ``most_rows=[0, rows]``: every
key is found through the index, as a tier without a layout finds it). Prints the step and the
native lookup's own phases (distinct ids, find them, pooled) per step, medians of interleaved
rounds in one process, the time each took to fill (every row's first admission: one turn, so
noisier), and the ratios.

    python bench/bench_direct.py --help
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tierstore import TieredEmbeddingBag, optim
from tierstore.kernels.native_types import Residency
from tierstore.kernels.step_passes import StepPasses

PHASES = ("distinct_ns", "find_ns", "pooled_ns")


class PhaseTimes:
    """Sums the phases ``StepPasses.lookup_bags`` times itself, while installed."""

    def __init__(self) -> None:
        self.spent = dict.fromkeys(PHASES, 0)
        self._original = StepPasses.lookup_bags

    def __enter__(self) -> PhaseTimes:
        def timed(*arguments, **keywords):
            result = self._original(*arguments, **keywords)
            done = next(part for part in result if isinstance(part, Residency))
            for phase in PHASES:
                self.spent[phase] += getattr(done, phase)
            return result

        StepPasses.lookup_bags = timed
        return self

    def __exit__(self, *exception) -> None:
        StepPasses.lookup_bags = self._original


def fill(table: TieredEmbeddingBag, rows: int) -> float:
    """Milliseconds to make every row of ``table`` resident (each looked up once, in a random order,
    65,536 a step: its first admission)."""
    start = time.perf_counter()
    for chunk in torch.randperm(rows, generator=torch.Generator().manual_seed(1)).split(1 << 16):
        table(chunk, torch.arange(chunk.numel())).backward(torch.zeros(chunk.numel(), table.embedding_dim))
    return 1e3 * (time.perf_counter() - start)


def time_round(table, batches: list, offsets, gradient) -> dict:
    """Microseconds per step: the whole step and each native phase."""
    with PhaseTimes() as phases:
        start = time.perf_counter()
        for ids in batches:
            table(ids, offsets).backward(gradient)
        elapsed = time.perf_counter() - start
    steps = len(batches)
    return {"step": 1e6 * elapsed / steps, **{phase: phases.spent[phase] / 1e3 / steps for phase in PHASES}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 2_000_000])
    parser.add_argument("--batch-size", type=int, default=16_384, help="ids per step, one per bag")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path("bench/results/direct.json"))
    args = parser.parse_args()
    results = {}
    offsets = torch.arange(args.batch_size)
    gradient = torch.randn(args.batch_size, args.dim)
    with tempfile.TemporaryDirectory() as directory:
        for rows in args.rows:

            def make(most_rows, name):
                return TieredEmbeddingBag(
                    rows,
                    args.dim,
                    mode="sum",
                    path=f"{directory}/{name}{rows}",
                    optimizer=optim.SGD(lr=0.01),
                    host_cache=rows,
                    most_rows=most_rows,
                )

            tables = {"at home": make(rows, "direct"), "through the index": make([0, rows], "indexed")}
            fills = {name: fill(table, rows) for name, table in tables.items()}
            for name, table in tables.items():
                top = table.store.stack.top
                assert top.capacity == rows and top.direct.sizes[0] == (rows if name == "at home" else 0)
            generator = torch.Generator().manual_seed(0)
            batches = [
                torch.randint(0, rows, (args.batch_size,), generator=generator) for _ in range(args.steps)
            ]
            turns = {name: [] for name in tables}
            for table in tables.values():  # warm-up
                time_round(table, batches[:5], offsets, gradient)
            for _ in range(args.rounds):
                for name, table in tables.items():
                    turns[name].append(time_round(table, batches, offsets, gradient))
            medians = {
                name: {key: statistics.median(turn[key] for turn in runs) for key in runs[0]}
                for name, runs in turns.items()
            }
            results[rows] = {name: {**medians[name], "fill_ms": fills[name]} for name in tables}
            print(
                f"{rows:,} rows held whole, dim {args.dim}, {args.batch_size:,} random ids a step "
                "(us per step)"
            )
            print(f"  {'':20}{'step':>10}{'distinct':>10}{'find':>10}{'pooled':>10}   first fill (ms)")
            for name, median in medians.items():
                figures = [median["step"], *(median[phase] for phase in PHASES)]
                print(
                    f"  {name:20}" + "".join(f"{figure:10.0f}" for figure in figures) + f"{fills[name]:18.0f}"
                )
            home, index = medians["at home"], medians["through the index"]
            print(
                f"  at home / through the index: step {home['step'] / index['step']:.2f}, "
                f"find {home['find_ns'] / index['find_ns']:.2f}, "
                f"first fill {fills['at home'] / fills['through the index']:.2f}"
            )
            for table in tables.values():
                table.close()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=1)
    )


if __name__ == "__main__":
    main()
