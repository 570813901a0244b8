"""Train a small DLRM whose 26 embedding tables are tiered, on a synthetic Criteo-like stream.

    python tools/train_dlrm.py --help

Each sample has 13 dense features and 26 categorical ids, each id drawn Zipf(alpha) from its own
id space (hot ids scattered over it), as in Criteo's click logs. Labels come from a hidden
logistic model of the dense features and of a fixed per-id effect, so the loss can fall.
Model: bottom MLP (13 -> dim), the 26 tables in one ``TieredEmbeddingBagCollection`` (fused in
one store; ``--tables separate``: one ``TieredEmbeddingBag`` per feature), pairwise dot
interaction, top MLP -> click logit. The tables train through their fused sparse optimizer
during ``backward``; ``torch.optim.Adam`` trains the MLPs. The end prints, per tier and summed
over tables: share of lookups served, rows moved in, evictions.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

import tierstore
from tierstore import optim
from tierstore.initializer import splitmix64
from tierstore.workloads import ZipfIds

DENSE_FEATURES, SPARSE_FEATURES = 13, 26
FEATURES = [f"f{index:02d}" for index in range(SPARSE_FEATURES)]


class CriteoLikeStream:
    """Batches ``(dense [B, 13], ids [26, B], labels [B])`` from a fixed hidden model."""

    def __init__(self, ids_per_feature: int, alpha: float, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.features = [
            ZipfIds(ids_per_feature, alpha, seed + 1 + feature) for feature in range(SPARSE_FEATURES)
        ]
        self.dense_weights = self.rng.standard_normal(DENSE_FEATURES) / np.sqrt(DENSE_FEATURES)

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dense = np.log1p(self.rng.lognormal(0.0, 1.0, (size, DENSE_FEATURES))).astype(np.float32)
        ids = torch.from_numpy(np.stack([sample(size) for sample in self.features]))
        id_effect = (splitmix64(ids) & 1).to(torch.float32).mul(2).sub(1).mean(dim=0)  # ±1 per id
        logit = torch.from_numpy(dense @ self.dense_weights - 1.0).float() + 2.0 * id_effect
        labels = torch.bernoulli(torch.sigmoid(logit), generator=None)
        return torch.from_numpy(dense), ids, labels


def mlp(sizes: list[int]) -> nn.Sequential:
    layers = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class DLRM(nn.Module):
    """Bottom MLP, tiered tables, dot interaction, top MLP (Naumov et al., 2019). ``tables``: a
    ``TieredEmbeddingBagCollection`` of features ``f00``..``f25``, or one ``TieredEmbeddingBag``
    per feature (to compare)."""

    def __init__(self, tables: nn.Module, dim: int) -> None:
        super().__init__()
        self.tables = tables
        self.bottom = mlp([DENSE_FEATURES, 64, dim])
        pairs = (SPARSE_FEATURES + 1) * SPARSE_FEATURES // 2
        self.top = mlp([dim + pairs, 128, 64, 1])
        self.pair_rows, self.pair_cols = torch.triu_indices(
            SPARSE_FEATURES + 1, SPARSE_FEATURES + 1, offset=1
        )

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``dense [B, 13]``, ``ids [26, B]`` (one id per feature per sample) -> logits ``[B]``."""
        bottom = self.bottom(dense)
        batch = ids.shape[1]
        if isinstance(self.tables, tierstore.TieredEmbeddingBagCollection):
            features = tierstore.KeyedJaggedTensor(
                FEATURES, ids.reshape(-1), lengths=torch.ones(ids.numel(), dtype=torch.int64)
            )
            embedded = self.tables(features).values().view(batch, SPARSE_FEATURES, -1).unbind(1)
        else:
            one_per_bag = torch.arange(batch, device=ids.device)
            embedded = [table(feature_ids, one_per_bag) for table, feature_ids in zip(self.tables, ids)]
        vectors = torch.stack([bottom, *embedded], dim=1)  # [B, 27, dim]
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pair_rows, self.pair_cols]
        return self.top(torch.cat([bottom, dots], dim=1)).squeeze(1)


def tier_summary(stats: list[dict]) -> list[tuple[str, float, int, int]]:
    """``(tier, share of lookups served, rows moved in, evictions)`` summed over stores' ``stats``."""
    totals: dict[str, list[int]] = {}
    for store_stats in stats:
        for tier, counters in store_stats.items():
            served = counters["hits"] + counters.get("initialized", 0)
            moved = counters.get("rows_in", counters.get("rows_read", 0))
            row = totals.setdefault(tier, [0, 0, 0])
            row[0] += served
            row[1] += moved
            row[2] += counters.get("evictions", 0)
    lookups = sum(row[0] for row in totals.values()) or 1
    return [(tier, served / lookups, moved, evicted) for tier, (served, moved, evicted) in totals.items()]


def make_tables(args, root: Path) -> nn.Module:
    """The 26 tables: fused in one collection, or (``--tables separate``) one module each with an
    equal share of the budgets."""
    budget = lambda text: int(text) if text.isdigit() else text  # noqa: E731 (rows or a byte string)
    host, device = args.host_cache, args.device_cache or ("520000" if args.device != "cpu" else "0")
    settings = {"backend": args.backend, "device": args.device}
    if args.tables == "fused":
        configs = [
            tierstore.EmbeddingBagConfig(None, args.dim, name=f"t{index:02d}", feature_names=[feature])
            for index, feature in enumerate(FEATURES)
        ]
        return tierstore.TieredEmbeddingBagCollection(
            configs,
            root,
            host_cache=budget(host),
            device_cache=budget(device),
            optimizer=optim.OPTIMIZERS[args.optimizer](lr=args.lr),
            **settings,
        )
    share = lambda text: str(int(text) // SPARSE_FEATURES) if text.isdigit() else text  # noqa: E731
    return nn.ModuleList(
        tierstore.TieredEmbeddingBag(
            None,
            args.dim,
            mode="sum",
            path=root / f"feature{index:02d}",
            host_cache=budget(share(host)),
            device_cache=budget(share(device)),
            seed=index,
            optimizer=optim.OPTIMIZERS[args.optimizer](lr=args.lr),
            **settings,
        )
        for index in range(SPARSE_FEATURES)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument(
        "--ids-per-feature", type=int, default=1_000_000, help="id space of each categorical feature"
    )
    parser.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the ids")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument(
        "--device-cache",
        default=None,
        help="rows (or bytes, e.g. 8MiB) of the tables' GPU tier, shared (default: 520000 rows on a GPU, "
        "none on the CPU, where a second tier in the same RAM would only add work)",
    )
    parser.add_argument(
        "--host-cache", default="1560000", help="rows (or bytes) of the tables' host tier, shared"
    )
    parser.add_argument(
        "--tables",
        choices=["fused", "separate"],
        default="fused",
        help="one TieredEmbeddingBagCollection (fused), or one TieredEmbeddingBag per feature",
    )
    parser.add_argument("--backend", choices=["lmdb", "mmap"], default="mmap")
    parser.add_argument(
        "--optimizer",
        type=lambda name: optim.optimizer_class(name).name,
        choices=list(optim.OPTIMIZERS),
        default="adagrad",
        help="the tables' optimizer ('-' or '_' both work: rowwise-adagrad, rowwise_adagrad)",
    )
    parser.add_argument("--lr", type=float, default=0.05, help="the tables' learning rate")
    parser.add_argument(
        "--path", type=Path, help="directory for the tables' stores (default: a temporary one)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the model and the top tier live (cpu, cuda)")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    root = args.path or Path(tempfile.mkdtemp(prefix="tierstore-dlrm-"))
    tables = make_tables(args, root)
    model = DLRM(tables, args.dim).to(args.device)
    dense_optimizer = torch.optim.Adam(
        model.parameters(), lr=1e-3
    )  # the MLPs only: tables have no Parameters
    loss_function = nn.BCEWithLogitsLoss()
    stream = CriteoLikeStream(args.ids_per_feature, args.alpha, args.seed)

    start, recent = time.perf_counter(), []
    progress = tqdm(range(args.steps), desc="training", unit="step", disable=None)  # quiet in logs
    for _ in progress:
        dense, ids, labels = (part.to(args.device) for part in stream.batch(args.batch_size))
        loss = loss_function(model(dense, ids), labels)
        dense_optimizer.zero_grad()
        loss.backward()  # also updates the tables' rows
        dense_optimizer.step()
        recent = (recent + [loss.item()])[-50:]
        progress.set_postfix(loss=f"{np.mean(recent):.4f}")
    seconds = time.perf_counter() - start
    stats = (
        [group.store.stats() for group in tables.groups.values()]
        if args.tables == "fused"
        else [table.store.stats() for table in tables]
    )

    samples = args.steps * args.batch_size
    print(
        f"{samples:,} samples in {seconds:.1f} s ({samples / seconds:,.0f} samples/s); "
        f"loss over the last 50 steps {np.mean(recent):.4f}; "
        + (f"tables in {root}" if args.path else "tables deleted (--path DIR keeps them)")
        + f"; --steps N runs longer (this run: {args.steps})"
    )
    print(f"{'tier':<8}{'lookups served':>16}{'rows moved in':>16}{'evictions':>12}")
    for tier, share, moved, evicted in tier_summary(stats):
        print(f"{tier:<8}{share:>16.1%}{moved:>16,}{evicted:>12,}")
    for table in tables.groups.values() if args.tables == "fused" else tables:
        table.close()  # flushes
    if args.path is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
