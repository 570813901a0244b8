"""Shared test helpers: the dict oracle's view of a row nobody has written, and random hash-table
operation sequences."""

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
