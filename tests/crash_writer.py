"""Writer process for test_crash_safety: runs numbered rounds of puts, each ending in a flush,
and prints the round number after each flush returns. It is killed with SIGKILL at random.

Round ``r`` writes value ``r`` into rows of ids drawn from a generator seeded with ``r``, removes
ids drawn from another (``removed_ids``), and writes ``r`` into the marker row ``MARKER``, so the
store says which flush it holds.
"""

import sys

import numpy as np
import torch

from tierstore import TieredStore

MARKER, IDS, DIM = 10**9, 3000, 8


def round_ids(round_: int) -> np.ndarray:
    return np.random.default_rng(round_).choice(IDS, size=1500, replace=False)


def removed_ids(round_: int) -> np.ndarray:
    """Ids round ``round_`` removes after its puts (some it has just written, some older, some never held)."""
    return np.random.default_rng(10**6 + round_).choice(IDS + 100, size=300, replace=False)


# (cache budgets, put batches per round)
CONFIGS = {
    "small": ({"host_cache": 200, "device_cache": 100}, 20),  # puts evict and stage rows; short flush
    "large": ({"host_cache": 4000, "device_cache": 2000}, 1),  # puts stay cached; flush does the I/O
}


def main(path: str, backend: str, caches: str) -> None:
    budgets, batches = CONFIGS[caches]
    store = TieredStore(path, dim=DIM, backend=backend, **budgets)
    first = int(store.get([MARKER])[0, 0].item()) + 1 if MARKER in store else 0
    print("ready", flush=True)
    for round_ in range(first, first + 10**6):
        for batch in np.array_split(round_ids(round_), batches):  # evictions stage rows mid-round
            store.put(torch.from_numpy(batch), torch.full((len(batch), DIM), float(round_)))
        store.remove(torch.from_numpy(removed_ids(round_)))
        store.put([MARKER], torch.full((1, DIM), float(round_)))
        store.flush()
        print(round_, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
