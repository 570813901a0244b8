"""``CollectionTable``: one table of a ``TieredEmbeddingBagCollection``, as TorchRec's
``embedding_bags[name]`` names it. Its rows live in its group's store (the tables of one dim share
one), under keys that carry the table's number (``jagged_batch.ID_BITS``); it reads and writes them
by the table's own ids."""

from __future__ import annotations

from typing import Any

import torch

from ..validation import as_ids
from .jagged_batch import checked_table_keys


class CollectionTable:
    """A table's settings (``name``, ``num_embeddings``, ``embedding_dim``, ``feature_names``,
    ``pooling``) and its rows, through ``group`` (the ``TieredEmbeddingBag`` holding them)."""

    def __init__(self, group: Any, settings: dict) -> None:
        self._group = group
        self._settings = settings
        self.name = settings["name"]
        self.num_embeddings = settings["num_embeddings"]
        self.embedding_dim = settings["embedding_dim"]
        self.feature_names = list(settings["feature_names"])
        self.pooling = settings["pooling"]

    @property
    def weight(self):
        raise AttributeError(
            f"table {self.name!r} has no weight tensor: its rows live in a store that may be larger "
            "than memory; read them with rows(ids) and write them with load_weights(ids, weights)"
        )

    def rows(self, ids: Any) -> torch.Tensor:
        """Weights ``[N, embedding_dim]`` of ``ids`` (this table's); ids it does not hold read their
        initial rows without joining it."""
        return self._group.store.get(self._keys(ids), grow=False)

    def load_weights(self, ids: Any, weights: Any) -> None:
        """Set the rows of ``ids`` to ``weights [N, embedding_dim]`` (optimizer state kept; zero for
        new ids), durable on return (``TieredStore.load``)."""
        self._group.store.load(self._keys(ids), weights)

    def _keys(self, ids: Any) -> torch.Tensor:
        return checked_table_keys(self._settings, as_ids(ids, "ids"))

    def __repr__(self) -> str:
        return f"CollectionTable({self.name!r}, {self.num_embeddings}, {self.embedding_dim})"
