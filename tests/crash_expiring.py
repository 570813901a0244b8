"""Trainer process for test_crash_safety's expiry test: a table with ``ttl=TTL`` trained in numbered
rounds, round ``r`` one step on its own ids (``round_ids``), then the marker row set to ``r`` and a
flush (which expires the ids of rounds ``TTL`` steps old), printing ``r`` once the flush returns."""

import sys

import torch

from tierstore import TieredEmbeddingBag, optim

MARKER, TTL, ROUND_IDS = 10**9, 3, 50


def round_ids(round_: int) -> torch.Tensor:
    return torch.arange(round_ * ROUND_IDS, (round_ + 1) * ROUND_IDS)


def main(path: str, backend: str) -> None:
    table = TieredEmbeddingBag(
        None,
        4,
        mode="sum",
        path=path,
        backend=backend,
        optimizer=optim.SGD(lr=0.1),
        ttl=TTL,
        host_cache=64 * 80,
    )
    store = table.store
    first = int(store.get([MARKER])[0, 0].item()) + 1 if MARKER in store else 0
    print("ready", flush=True)
    for round_ in range(first, first + 10**6):
        table(round_ids(round_), torch.tensor([0])).sum().backward()
        store.put([MARKER], torch.full((1, 4), float(round_)))
        table.flush()
        print(round_, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
