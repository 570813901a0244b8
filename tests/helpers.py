"""Shared test helpers: the dict oracle's view of a row nobody has written, a store's random puts
and gets against a dict, random hash-table operation sequences, a script's peak memory under
a cgroup's limit, and tensors compared byte for byte."""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from hypothesis import strategies as st

from tierstore import initial_weights, optim
from tierstore.tiers import build

CGROUP = Path("/sys/fs/cgroup/memory")  # the cgroup v1 memory controller
# One of each update kernel (Adagrad with lr_decay: its host-computed rate), for the kernel tests.
KERNEL_OPTIMIZERS = [
    optim.SGD(lr=0.1),
    optim.Adagrad(lr=0.1, lr_decay=0.01),
    optim.RowWiseAdagrad(lr=0.1),
    optim.Adam(lr=0.05),
]


def same_bytes(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether two tensors of one shape and dtype hold the same bytes: a tier's rows compared whole,
    whose free slots were never written and may hold NaN patterns (never ``torch.equal`` to
    themselves)."""
    return (
        first.shape == second.shape
        and first.dtype == second.dtype
        and torch.equal(first.contiguous().view(torch.uint8), second.contiguous().view(torch.uint8))
    )


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


def cgroup_problem():
    if not (CGROUP / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller at {CGROUP}"
    if not os.access(CGROUP, os.W_OK):
        return f"{CGROUP} is not writable (not root)"
    return None


def peak_in_cgroup(tmp_path, script, limit, *arguments) -> int:
    """Peak memory (page cache included) of ``python -c script`` run in a new cgroup of ``limit``
    bytes; fails if it does not finish."""
    group = CGROUP / f"tierstore-test-{os.getpid()}-{len(list(tmp_path.iterdir()))}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        if (group / "memory.memsw.limit_in_bytes").exists():
            (group / "memory.memsw.limit_in_bytes").write_text(str(limit))

        def enter():
            (group / "cgroup.procs").write_text(str(os.getpid()))

        run = subprocess.run(
            [sys.executable, "-c", script, *arguments],
            preexec_fn=enter,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
        return int((group / "memory.max_usage_in_bytes").read_text())
    finally:
        group.rmdir()


@contextlib.contextmanager
def tiers_growing_from(rows: int | None):
    """Tiers built meanwhile that grow on demand start at ``rows`` slots (None: the default), so
    small tests see them grow."""
    default = build.INITIAL_ROWS
    build.INITIAL_ROWS = rows or default
    try:
        yield
    finally:
        build.INITIAL_ROWS = default
