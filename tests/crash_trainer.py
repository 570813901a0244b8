"""Trainer process for test_crash_safety: a small host tier over the mmap store trained in numbered
rounds, each ending in a flush, printing the round number after each flush returns. Every step
evicts dirty rows into the store's log by the native admission, so a SIGKILL lands among them.
A float32 table trains with SGD; a float16 one with Adagrad (float32 state in the row) and
stochastic rounding.

``train_round(table, r)`` is deterministic: the test replays rounds in-process to know the rows of
every completed flush.
"""

import sys

import torch

from tierstore import TieredEmbeddingBag, optim

IDS, DIM, STEPS = 400, 8, 12


def open_table(path: str, dtype: str = "float32") -> TieredEmbeddingBag:
    if dtype == "float32":
        optimizer = optim.SGD(lr=0.05)
    else:
        optimizer = optim.Adagrad(lr=0.05, stochastic_rounding=True)
    return TieredEmbeddingBag(
        None,
        DIM,
        path=path,
        backend="mmap",
        host_cache=96,
        optimizer=optimizer,
        dtype=getattr(torch, dtype),
    )


def train_round(table: TieredEmbeddingBag, round_: int) -> None:
    generator = torch.Generator().manual_seed(round_)
    for _ in range(STEPS):
        ids = (torch.rand(80, generator=generator) ** 2 * IDS).to(torch.int64)
        out = table(ids, torch.arange(0, 80, 8))
        (out.float() * torch.randn(out.shape, generator=generator)).sum().backward()
    table.store.flush()


def main(path: str, dtype: str) -> None:
    table = open_table(path, dtype)
    print("ready", flush=True)
    for round_ in range(10**6):
        train_round(table, round_)
        print(round_, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
