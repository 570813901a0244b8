"""A collection's hot-id rankings (``warm=``, ``replicate=``) as each group's store keys, merged
rank by rank across the group's tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..warm_start import hot_ids
from .collection_layout import group_of
from .jagged_batch import checked_table_keys


def warm_keys_by_group(
    tables: dict[str, dict], warm: dict[str, Any] | str | Path | None, argument: str = "warm"
) -> dict[str, torch.Tensor]:
    """Each group's store keys of the ``warm`` rankings (table name -> ids, most wanted first),
    merged rank by rank across its tables."""
    if warm is None:
        return {}
    if isinstance(warm, (str, Path)):
        warm = rankings_file(Path(warm), argument)
    if not isinstance(warm, dict):
        raise TypeError(
            f"{argument} must be a dict of table name -> hot ids (or a .npy path), or the path of an "
            f".npz of them ('tierstore profile --out PREFIX' writes PREFIX-tables.npz), got {warm!r}"
        )
    unknown = sorted(set(warm) - set(tables))
    if unknown:
        raise KeyError(f"{argument} names unknown table(s) {unknown}; the tables are {sorted(tables)}")
    ranked: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, ids in warm.items():
        table = tables[name]
        ids = hot_ids(ids)
        keys = checked_table_keys(table, ids)
        ranked.setdefault(group_of(table), []).append((keys, torch.arange(ids.numel())))
    merged = {}
    for group_name, parts in ranked.items():
        keys, ranks = (torch.cat(column) for column in zip(*parts))
        merged[group_name] = keys[torch.sort(ranks, stable=True).indices]
    return merged


def replicated_keys_by_group(
    tables: dict[str, dict], replicate: Any, warm_keys: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor] | None:
    """Each group's replicated keys (None: none asked for): the tables' ids as ``warm`` takes
    them, or an int N, the N first keys of each group's ``warm`` ranking."""
    if replicate is None:
        return None
    if isinstance(replicate, int) and not isinstance(replicate, bool):
        if replicate < 0 or (replicate and not warm_keys):
            raise ValueError(
                f"replicate={replicate} takes the {replicate} hottest keys of each group's warm= "
                f"ranking: give warm= rankings, or replicate= the tables' ids as warm= takes them"
            )
        return {group: keys[:replicate] for group, keys in warm_keys.items()}
    return warm_keys_by_group(tables, replicate, "replicate")


def rankings_file(path: Path, argument: str) -> dict[str, np.ndarray]:
    """The rankings of an ``.npz`` (table name -> ids, most wanted first), read whole."""
    try:
        arrays = np.load(path, allow_pickle=False)
        if not isinstance(arrays, np.lib.npyio.NpzFile):
            raise ValueError("an .npy, not an .npz of rankings")
        with arrays:
            return {name: arrays[name] for name in arrays.files}
    except (OSError, ValueError) as error:
        raise ValueError(
            f"{argument}: {path} is not a readable .npz of table name -> hot ids ({error}); write one with "
            f"'tierstore profile TRACE --columns ... --out PREFIX' (PREFIX-tables.npz)"
        ) from None
