"""``StoreSnapshot``: a table's rows as of one flush, read while training goes on.

``TieredStore.snapshot()`` flushes and opens one (LMDB: a read transaction; mmap: a reader, while
which the writer's flushes stay in its log). Nothing is copied when it is taken: the rows are read
when asked for, from another thread if wanted, and are those of that flush whatever is written
meanwhile. An open snapshot keeps the store from reclaiming what later flushes replace (LMDB's rule
for long read transactions), so close it when read.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import torch

from .metadata import StoreMetadata
from .tiers.cold.base import ColdSnapshot

READ_BATCH_ROWS = 1 << 16  # rows decoded at once by a positional read


class StoreSnapshot:
    """``len(snapshot)`` rows ``(ids [n], whole rows [n, row_width])`` of a store laid out as
    ``metadata``, as of its ``flushes``-th flush."""

    def __init__(self, metadata: StoreMetadata, cold: ColdSnapshot) -> None:
        self.metadata = metadata
        self.flushes = cold.flushes
        self._cold = cold
        self._rows = len(cold)
        self._lock = threading.Lock()
        self._closed = False
        self._restart()

    def __len__(self) -> int:
        return self._rows

    def iter_rows(self, batch_size: int = READ_BATCH_ROWS) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every row once, in the snapshot's order (the same on every pass)."""
        self._check_open()
        return self._cold.iter_rows(batch_size)

    def read(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``start:stop`` in ``iter_rows``'s order: reads in increasing order continue one pass
        over the snapshot; a read behind the last one starts a new pass."""
        if not 0 <= start <= stop <= self._rows:
            raise IndexError(f"rows {start}:{stop} of a snapshot of {self._rows} rows")
        with self._lock:
            self._check_open()
            if start < self._held_start:
                self._restart()
            ids, rows = [], []
            position = start
            while position < stop:
                held_stop = self._held_start + self._held[0].numel()
                if position >= held_stop:
                    self._held = next(self._pass)
                    self._held_start = held_stop
                    continue
                part = slice(position - self._held_start, min(stop, held_stop) - self._held_start)
                ids.append(self._held[0][part])
                rows.append(self._held[1][part])
                position = self._held_start + part.stop
        if not ids:
            return torch.empty(0, dtype=torch.int64), torch.empty(
                0, self.metadata.row_width, dtype=self.metadata.torch_dtype
            )
        return torch.cat(ids), torch.cat(rows)

    def _restart(self) -> None:
        self._pass = self._cold.iter_rows(READ_BATCH_ROWS)
        self._held = (torch.empty(0, dtype=torch.int64), None)
        self._held_start = 0

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._pass.close()
                self._cold.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this snapshot is closed; take another with store.snapshot()")

    def __enter__(self) -> StoreSnapshot:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
