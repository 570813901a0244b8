"""A DLRM-shaped sparse arch: 26 tables with the Criteo Kaggle cardinalities, timed against the
same tables in RAM, all in the same run and in turns.

    python bench/bench_dlrm.py --help

Each sample has one id per table, drawn Zipf(``--alpha``) over that table's rows (hot ids
scattered), in batches of ``--batch-size``; every timed step sees a fresh batch. One step is the
pooled lookup of all 26 features, a backward from their sum, and the optimizer (SGD or Adagrad):

- ``collection``: one ``TieredEmbeddingBagCollection`` (the 26 tables fused in one store), host
  cache ``--host-share`` of all rows, every row first written to the mmap cold store;
- ``separate``: 26 ``TieredEmbeddingBag``s, each with that share of its own rows (what fusion saves);
- ``nn_embedding_bag``: 26 ``nn.EmbeddingBag(sparse=True)`` in RAM + ``torch.optim``;
- ``fbgemm``: FBGEMM's CPU table-batched embedding with its fused optimizer, when ``fbgemm_gpu`` is
  installed (``pip install fbgemm-gpu-cpu==1.8.0``).

Reports samples/s and ratios; JSON to ``--json``. ``--scale`` multiplies every cardinality.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from bench_train import interleaved_samples_per_second
from torch import nn
from tqdm import tqdm

from tierstore import (
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    TieredEmbeddingBag,
    TieredEmbeddingBagCollection,
    initial_rows,
    optim,
)
from tierstore.nn.collection import table_keys
from tierstore.workloads import ZipfIds

CRITEO_KAGGLE = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
    5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]  # fmt: skip
FEATURES = [f"f{index:02d}" for index in range(len(CRITEO_KAGGLE))]


def tiered_optimizer(name: str):
    return optim.SGD(lr=0.01) if name == "sgd" else optim.Adagrad(lr=0.01)


def preload(store, keys: torch.Tensor, dim: int, state_width: int) -> None:
    """Write the initial rows of ``keys`` straight to ``store``'s cold tier (as a trained table holds)."""
    for part in keys.split(1 << 20):
        store.load(part, initial_rows(part, dim, state_width, 0, torch.float32))


def collection_step(cardinalities, args, directory: Path):
    configs = [
        EmbeddingBagConfig(rows, args.dim, name=f"t{index:02d}", feature_names=[feature])
        for index, (rows, feature) in enumerate(zip(cardinalities, FEATURES))
    ]
    kind = tiered_optimizer(args.optimizer)
    collection = TieredEmbeddingBagCollection(
        configs,
        directory / "collection",
        host_cache=int(sum(cardinalities) * args.host_share),
        optimizer=kind,
    )
    group = collection.groups[f"dim{args.dim}"]
    for rows, config in zip(
        tqdm(cardinalities, desc="preloading the collection", leave=False, disable=None), configs
    ):
        table = collection._tables[config.name]
        preload(group.store, table_keys(table, torch.arange(rows)), args.dim, kind.state_width(args.dim))

    def step(ids, lengths):
        collection(KeyedJaggedTensor(FEATURES, ids.reshape(-1), lengths=lengths)).values().sum().backward()

    return step


def separate_step(cardinalities, args, directory: Path):
    kind = tiered_optimizer(args.optimizer)
    tables = [
        TieredEmbeddingBag(
            rows,
            args.dim,
            mode="sum",
            path=directory / f"separate{index:02d}",
            host_cache=max(1, int(rows * args.host_share), args.batch_size),
            optimizer=tiered_optimizer(args.optimizer),
        )
        for index, rows in enumerate(cardinalities)
    ]
    for rows, table in zip(
        tqdm(cardinalities, desc="preloading the tables", leave=False, disable=None), tables
    ):
        preload(table.store, torch.arange(rows), args.dim, kind.state_width(args.dim))
    offsets = torch.arange(args.batch_size)

    def step(ids, lengths):
        sum(table(feature_ids, offsets).sum() for table, feature_ids in zip(tables, ids)).backward()

    return step


def torch_step(cardinalities, args):
    tables = nn.ModuleList(nn.EmbeddingBag(rows, args.dim, mode="sum", sparse=True) for rows in cardinalities)
    make = torch.optim.SGD if args.optimizer == "sgd" else torch.optim.Adagrad
    dense_optimizer = make(tables.parameters(), lr=0.01)
    offsets = torch.arange(args.batch_size)

    def step(ids, lengths):
        dense_optimizer.zero_grad()
        sum(table(feature_ids, offsets).sum() for table, feature_ids in zip(tables, ids)).backward()
        dense_optimizer.step()

    return step


def fbgemm_step(cardinalities, args):
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
        [(rows, args.dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows in cardinalities],
        optimizer=kind,
        learning_rate=0.01,
    )
    offsets = torch.arange(len(cardinalities) * args.batch_size + 1)

    def step(ids, lengths):
        tables(ids.reshape(-1), offsets).sum().backward()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every table's cardinality")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--alpha", type=float, default=1.05)
    parser.add_argument("--host-share", type=float, default=0.10, help="host cache, share of all rows")
    parser.add_argument("--optimizer", choices=["sgd", "adagrad"], default="sgd")
    parser.add_argument("--warm-up", type=int, default=20, help="steps before timing (fills the caches)")
    parser.add_argument("--rounds", type=int, default=3, help="turns of timing, each method once")
    parser.add_argument("--steps", type=int, default=10, help="batches per method per round")
    parser.add_argument("--json", type=Path, default=Path("bench/results/dlrm.json"))
    args = parser.parse_args()

    cardinalities = [max(1, int(rows * args.scale)) for rows in CRITEO_KAGGLE]
    samplers = [ZipfIds(rows, args.alpha, seed=index) for index, rows in enumerate(cardinalities)]
    lengths = torch.ones(len(cardinalities) * args.batch_size, dtype=torch.int64)

    def batch():
        return torch.stack([torch.from_numpy(sample(args.batch_size)) for sample in samplers]), lengths

    with tempfile.TemporaryDirectory() as directory:
        steps = {
            "collection": collection_step(cardinalities, args, Path(directory)),
            "separate": separate_step(cardinalities, args, Path(directory)),
            "nn_embedding_bag": torch_step(cardinalities, args),
        }
        fbgemm = fbgemm_step(cardinalities, args)
        if fbgemm is not None:
            steps["fbgemm"] = fbgemm
        for _ in tqdm(range(args.warm_up), desc="warming up", leave=False, disable=None):
            work = batch()
            for step in steps.values():
                step(*work)
        timed = [[batch() for _ in range(args.steps)] for _ in range(args.rounds)]
        rates = interleaved_samples_per_second(steps, timed, samples_per_batch=args.batch_size)
    print(
        f"26 Criteo Kaggle tables x{args.scale} ({sum(cardinalities):,} rows), dim {args.dim}, "
        f"batch {args.batch_size}, Zipf({args.alpha}), {args.optimizer}, host cache {args.host_share:.0%}"
    )
    baseline = rates["nn_embedding_bag"]
    print(f"{'method':<20}{'samples/s':>12}{'vs nn.EmbeddingBag':>20}{'vs FBGEMM':>11}")
    for name, rate in rates.items():
        versus_fbgemm = f"{rate / rates['fbgemm']:>11.2f}" if "fbgemm" in rates else f"{'':>11}"
        print(f"{name:<20}{rate:>12,.0f}{rate / baseline:>20.2f}{versus_fbgemm}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "samples_per_s": rates})
    )
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
