"""Shared test helpers: the dict oracle's view of a row nobody has written, a store's random puts
and gets against a dict, and random hash-table operation sequences."""

import numpy as np
import torch
from hypothesis import strategies as st

from tierstore import initial_weights


def initial(id_, dim, seed=0):
    return initial_weights(torch.tensor([id_]), dim, seed, torch.float32)[0]


# Sequences of (operation, distinct keys) for hash tables checked against a dict.
hash_table_operations = st.lists(
    st.tuples(
        st.sampled_from(["insert", "remove", "find"]),
        st.lists(st.integers(0, 60), min_size=1, max_size=12, unique=True),
    ),
    max_size=40,
)


def puts_and_gets_against_a_dict(store, rng, steps, ids_below, dim):
    """``steps`` random batches of ``store.get`` (every other one after a ``store.put``) of skewed
    ids below ``ids_below``; each row read must be the dict's. Returns the dict."""
    oracle = {}
    for step in range(steps):
        ids = torch.from_numpy(np.unique(rng.zipf(1.3, rng.integers(1, 6)) % ids_below))
        if step % 2:
            rows = torch.from_numpy(rng.standard_normal((ids.numel(), dim)).astype(np.float32))
            store.put(ids, rows)
            oracle.update(zip(ids.tolist(), rows))
        for id_, row in zip(ids.tolist(), store.get(ids)):
            if id_ in oracle:
                assert torch.equal(row, oracle[id_])
    return oracle
