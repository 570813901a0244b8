"""Warm start: fill the cache tiers at open with the rows a hot-set ranking names (``tierstore
profile --out`` writes one), so the first steps do not pay the cold-start ramp.

The ranked ids the table holds fill the top tier first, then each tier below, up to their
capacities, read from the cold store without counting lookups; ids the table does not hold are
skipped (a warm start never grows a table). The preloaded rows enter as any admitted row does, so
rows the workload does not use are the first to go.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from .tiers.contract import Rows
from .tiers.stack import TierStack
from .validation import as_ids


def hot_ids(warm: Any) -> torch.Tensor:
    """``warm`` as int64 ids, most wanted first, each once: a ``.npy`` path, or ids (a tensor, an
    array, a sequence)."""
    if isinstance(warm, (str, Path)):
        path = Path(warm)
        try:
            warm = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as error:
            raise ValueError(
                f"warm: {path} is not a readable .npy of ids ({error}); write one with "
                f"'tierstore profile TRACE --out PREFIX' (PREFIX.npy)"
            ) from None
        try:
            ids = as_ids(warm, "warm")
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"warm: {path} does not hold ids ({error}); a hot-set file is a 1-D .npy of int64 ids, "
                f"most wanted first, as 'tierstore profile TRACE --out PREFIX' writes (PREFIX.npy)"
            ) from None
    else:
        ids = as_ids(warm, "warm")
    unique, inverse = torch.unique(ids, return_inverse=True)
    first = torch.full((unique.numel(),), ids.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(ids.numel()), reduce="amin")
    return ids[torch.sort(first).values]  # each id at its first rank


def warm_caches(stack: TierStack, ids: torch.Tensor) -> int:
    """Fill ``stack``'s cache tiers, top first, with the rows of ranked ``ids`` the table holds and
    no tier caches yet, up to each tier's free slots; returns how many rows were loaded."""
    cached = torch.zeros(ids.numel(), dtype=torch.bool)
    for cache in stack.caches:
        cached |= (cache.find(ids) >= 0).cpu()
    wanted = ids[~cached]
    wanted = wanted[stack.cold.contains(wanted)]
    loaded = 0
    for cache in stack.caches:
        room = cache.max_capacity - len(cache)
        keys, wanted = wanted[:room], wanted[room:]
        if keys.numel() == 0:
            continue
        rows, _ = stack.cold.get(keys, torch.zeros_like(keys))  # counts no lookup
        clean = torch.zeros(keys.numel(), dtype=torch.bool)
        cache.admit(Rows(keys, rows, clean, clean.clone()).to(cache.device))
        loaded += keys.numel()
    return loaded
