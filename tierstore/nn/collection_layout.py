"""A collection's layout: its tables checked and numbered in groups (one store per group: a dim,
and a 16-bit ``data_type`` where set), their keys (``table_number << 47 | id``), and
``collection.json``, which records them and is checked when the collection is reopened."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from ..budget import parse_bytes
from ..errors import StoreFormatError
from ..metadata import METADATA_FILE
from .jagged_batch import ID_BITS
from .keyed import table_settings

ID_MASK = (1 << ID_BITS) - 1
MAX_TABLES_PER_GROUP = 1 << 16
LAYOUT_FILE = "collection.json"


def read_layout(root: Path) -> list[dict]:
    """The tables of the collection at ``root`` as ``collection.json`` records them: name,
    embedding_dim, num_embeddings, feature_names, pooling and number (in its group).
    ``FileNotFoundError`` where there is none, ``StoreFormatError`` where it is damaged."""
    layout_file = Path(root) / LAYOUT_FILE
    if not layout_file.exists():
        raise FileNotFoundError(f"{root} is not a tierstore collection: {LAYOUT_FILE} is missing")
    try:
        tables = json.loads(layout_file.read_text())["tables"]
        fields = {"name", "embedding_dim", "num_embeddings", "feature_names", "pooling", "number"}
        if not isinstance(tables, list) or not all(fields <= set(table) for table in tables):
            raise ValueError(f"its tables lack some of {sorted(fields)}")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as error:
        raise StoreFormatError(
            f"{layout_file} is damaged ({error}); restore it from a backup (it names the collection's "
            f"tables, and the stores cannot be read without it)"
        ) from None
    return tables


def group_path(root: Path, table: dict) -> Path:
    """The store holding ``table``'s rows (one per embedding dim)."""
    return Path(root) / group_of(table)


def table_keys(table: dict, ids: torch.Tensor) -> torch.Tensor:
    """Keys in the group's store of ``table``'s ``ids`` (int64, below 2**47)."""
    return (table["number"] << ID_BITS) | ids


def check_tables(tables: list[Any]) -> dict[str, dict]:
    """``{name: its settings and its number in its group}``, refusing a name used twice."""
    if not isinstance(tables, (list, tuple)):
        raise TypeError(
            f"tables must be a list of EmbeddingBagConfig, got {type(tables).__name__}"
            + ("; wrap the one table in a list: [config]" if hasattr(tables, "embedding_dim") else "")
        )
    if not tables:
        raise ValueError("a collection needs at least one table")
    checked: dict[str, dict] = {}
    per_group: dict[str, int] = {}
    for config in tables:
        name, num_embeddings, dim, features, pooling, data_type = table_settings(config)
        if num_embeddings is not None and num_embeddings > 1 << ID_BITS:
            raise ValueError(
                f"table {name!r}: num_embeddings={num_embeddings} is past the collection's key space: "
                f"ids must be below 2**{ID_BITS} (the table's number is kept in the bits above); use "
                f"num_embeddings <= 2**{ID_BITS}, or None (any id below 2**{ID_BITS})"
            )
        if name in checked:
            raise ValueError(f"table name {name!r} is used twice; every table needs its own name")
        settings = {
            "name": name,
            "num_embeddings": num_embeddings,
            "embedding_dim": dim,
            "feature_names": list(features),
            "pooling": pooling,
        }
        if data_type is not None:  # recorded only where set: older collections' layouts still match
            settings["data_type"] = data_type
        group = group_of(settings)
        number = per_group.get(group, 0)
        if number >= MAX_TABLES_PER_GROUP:
            raise ValueError(f"more than {MAX_TABLES_PER_GROUP} tables in group {group}")
        per_group[group] = number + 1
        checked[name] = {**settings, "number": number}
    return checked


def check_layout(root: Path, tables: dict[str, dict], sharded: bool = False) -> None:
    """An existing collection at ``root`` must have been made with the same tables in the same order.
    ``sharded``: other ranks may be creating their groups' directories (and the layout file) at
    the same time."""
    layout_file = root / LAYOUT_FILE
    if not layout_file.exists():
        ours = re.compile(r"dim\d+(-\w+)?|" + re.escape(LAYOUT_FILE) + r"(\.\d+\.tmp)?")
        if root.exists() and any(not (sharded and ours.fullmatch(entry.name)) for entry in root.iterdir()):
            raise ValueError(f"{root} is not empty and holds no {LAYOUT_FILE}: not a tierstore collection")
        return
    stored = {table["name"]: table for table in read_layout(root)}
    if stored != tables:
        raise ValueError(
            f"{root} holds a collection of other tables ({sorted(stored)}, as {LAYOUT_FILE} records); "
            "open it with the same table configs in the same order"
        )
    for group in sorted({group_of(table) for table in tables.values()}):
        if not (root / group / ("" if sharded else METADATA_FILE)).exists():  # sharded: one store per rank
            names = sorted(name for name, table in tables.items() if group_of(table) == group)
            raise StoreFormatError(
                f"{root / group} is missing: the store of tables {names} is gone, and opening the collection "
                f"would start them empty; restore it from a backup"
            )


def in_group(group_name: str, tables: list[dict]) -> list[int]:
    """Positions of the features whose table is in the group."""
    return [index for index, table in enumerate(tables) if group_of(table) == group_name]


def group_of(table: dict) -> str:
    """The group (one store) holding a table's rows: its dim, and its ``data_type`` where set."""
    data_type = table.get("data_type")
    return f"dim{table['embedding_dim']}" + ("" if data_type is None else f"-{data_type}")


def shared_features(tables: dict[str, dict]) -> dict[str, list[str]]:
    """``{feature: the tables reading it}`` for the features more than one table reads."""
    readers: dict[str, list[str]] = {}
    for name, table in tables.items():
        for feature in table["feature_names"]:
            readers.setdefault(feature, []).append(name)
    return {feature: names for feature, names in readers.items() if len(names) > 1}


def most_rows(tables) -> list[int | None]:
    """The most distinct ids each of a group's ``tables`` (in number order) looks up: its rows, None
    where it grows on demand (``TieredStore``'s ``most_rows``)."""
    return [table["num_embeddings"] for table in tables]


def share_budget(budget: Any, parts: int) -> Any:
    """A cache budget split evenly between ``parts`` groups."""
    if budget is None or budget == 0:
        return budget
    if isinstance(budget, int):
        return max(1, budget // parts)
    if budget.strip().endswith("%"):
        return f"{float(budget.strip()[:-1]) / parts}%"
    return f"{parse_bytes(budget) // parts}B"
