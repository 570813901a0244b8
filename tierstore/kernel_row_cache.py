"""A cache tier on the ``cuda/`` kernels: ``RowCache``'s contract, bookkeeping and eviction
policy, with the hash table, LFU scores, victim scores, row gather/scatter and the fused
optimizers run as kernels: on the GPU (``device_cache_backend="cuda"``) or compiled for the CPU
with OpenMP (``host_cache_backend="openmp"``). The torch ``RowCache`` is the reference it is
tested against (through the kernels' host builds when there is no GPU).
"""

from __future__ import annotations

import torch

from .kernel_hash_table import KernelHashTable, positions_for
from .row_cache import RowCache


class KernelRowCache(RowCache):
    """A ``RowCache`` whose index and row operations are ``kernels.launch`` calls; float32 rows.
    ``kernels``: a ``KernelModule`` (GPU) or ``HostKernels`` (CPU); ``backend`` names it in stats."""

    def __init__(self, name: str, capacity: int, row_width: int, dtype: torch.dtype, device: torch.device | str,
                 kernels, backend: str, half_life: float | None = None, pin_memory: bool = False) -> None:
        if dtype != torch.float32:
            raise ValueError(f"the {backend} cache backend stores float32 rows, not {dtype}; use the torch backend")
        self.kernels = kernels
        self.backend = backend
        super().__init__(name, capacity, row_width, dtype, device, half_life, pin_memory)
        self._blocked = torch.zeros(capacity, dtype=torch.uint8, device=self.device)

    def _make_index(self, capacity: int) -> KernelHashTable:
        return KernelHashTable(capacity, self.kernels, self.device)

    @staticmethod
    def _index_nbytes(capacity: int) -> int:
        return positions_for(capacity) * (8 + 4) + capacity  # the table, and the victim mask

    @property
    def nbytes(self) -> int:
        return super().nbytes + self._blocked.nbytes

    def _add_scores(self, slots: torch.Tensor, weights: torch.Tensor) -> None:
        self.kernels.launch("cache_touch", slots.numel(), self.score, _int32(slots), weights.contiguous(), slots.numel())

    def read(self, slots: torch.Tensor, columns: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        width = self.rows.shape[1]
        columns = width if columns is None else columns
        if out is None:
            out = torch.empty(slots.numel(), columns, dtype=self.rows.dtype, device=self.device)
        vectorised = width % 4 == 0 and columns % 4 == 0 and out.data_ptr() % 16 == 0 and self.rows.data_ptr() % 16 == 0
        if vectorised:
            self.kernels.launch("cache_gather_vec4", slots.numel() * columns // 4, self.rows, width, _int32(slots),
                                slots.numel(), columns, out)
        else:
            self.kernels.launch("cache_gather", slots.numel() * columns, self.rows, width, _int32(slots),
                                slots.numel(), columns, out)
        return out

    def _copy_rows(self, slots: torch.Tensor, values: torch.Tensor, columns: int | None = None) -> None:
        columns = self.rows.shape[1] if columns is None else columns
        self.kernels.launch("cache_scatter", slots.numel() * columns, self.rows, self.rows.shape[1], _int32(slots),
                            values.to(self.device, self.rows.dtype).contiguous(), slots.numel(), columns)

    def apply_optimizer(self, optimizer, slots: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        name, arguments, per_row = optimizer.kernel(step)
        dim = grad.shape[1]
        grad = grad.to(self.device, self.rows.dtype).contiguous()
        self.kernels.launch(name, slots.numel() if per_row else slots.numel() * dim, self.rows, self.rows.shape[1],
                            _int32(slots), grad, slots.numel(), dim, *arguments)
        self.dirty[slots] = True

    def _victim_scores(self, protected: torch.Tensor | None) -> torch.Tensor:
        self._blocked.zero_()
        if protected is not None and protected.numel():
            self._blocked[protected] = 1
        candidates = torch.empty_like(self.score)
        self.kernels.launch("cache_victim_scores", self.capacity, self.score, self.slot_keys, self._blocked,
                            float("inf"), self.capacity, candidates)
        return candidates


def _int32(slots: torch.Tensor) -> torch.Tensor:
    return slots.to(torch.int32).contiguous()
