"""The contract every cold-store backend keeps.

Writes are staged: ``put`` makes rows visible to this process's ``get`` at once, and ``flush``
makes every staged row durable in one atomic step. After a crash or kill at any moment, reopening
yields exactly the state of the last completed ``flush`` (staged rows are discarded).
Keys in one call must be distinct non-negative int64 ids (the tiers above guarantee this).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterator

import torch

from ..errors import ReadOnlyStoreError


class ColdStore(ABC):
    """Durable map ``int64 id -> row [row_width]`` of ``dtype``, read and written in batches."""

    def __init__(self, row_width: int, dtype: torch.dtype, read_only: bool) -> None:
        self.row_width = row_width
        self.dtype = dtype
        self.row_bytes = row_width * dtype.itemsize
        self.read_only = read_only

    @abstractmethod
    def get(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``keys`` (int64 [N], distinct) -> ``(rows [N, row_width], found bool [N])``.

        Rows of keys not found are unspecified (the caller initialises them).
        """

    @abstractmethod
    def put(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Stage ``rows [N, row_width]`` for ``keys`` (distinct); durable after ``flush``."""

    def contains(self, keys: torch.Tensor) -> torch.Tensor:
        """bool [N]: which ``keys`` (distinct) the store holds."""
        return self.get(keys)[1]

    @abstractmethod
    def iter_rows(self, batch_size: int = 65536) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every ``(keys [n], rows [n, row_width])`` the store holds (staged rows included)."""

    @abstractmethod
    def __len__(self) -> int:
        """Distinct keys held, staged ones included."""

    @abstractmethod
    def flush(self) -> None:
        """Make every staged row durable, atomically."""

    @abstractmethod
    def close(self) -> None:
        """Release files; staged rows not flushed are discarded."""

    def _check_writable(self) -> None:
        if self.read_only:
            raise ReadOnlyStoreError("this store was opened with read_only=True; reopen it writable to change it")
