"""``HashIndex``'s contract (find / insert / remove / items) run by the ``tierstore/kernels``.

One thread per key, linear probing over a power-of-two table of int64 keys beside int32 values
(cache slots: the ``cache_*`` kernels) or int64 values (row numbers: ``index_*``), in
``embedding_cache.cu``. Inserts claim empty positions only, with a compare-and-swap;
removed keys leave tombstones (except on the tuned host build, whose erase shifts entries back:
``kernels.cache_passes``), which the table clears by rebuilding itself when live keys and
tombstones together pass ``MAX_LOAD_WITH_TOMBSTONES`` (a full cache tier then removes at least a
quarter of the table's size in keys between rebuilds, not a few), growing when live keys alone
pass its load limit (``MAX_LOAD``, or ``SPARSE_LOAD`` for a small host tier's index: see
``KernelRows.index_load``).
``kernels`` is a ``CudaKernels`` (GPU) or ``HostKernels`` (CPU) build of the same source; both
expose ``launch(name, n, *args)``.
"""

from __future__ import annotations

import torch

from ..kernels.cache_passes import cache_passes_of
from . import huge_pages
from .hash_index import MAX_LOAD_WITH_TOMBSTONES, BatchedHashTable

EMPTY = -1
MAX_LOAD = 0.5
SPARSE_LOAD = 0.25  # a sparser table: shorter probes and shorter runs for an erase to shift back
_STATUS = {1: "already present (or repeated in the batch)", 2: "in a full table"}


_KERNEL_PREFIX = {torch.int32: "cache", torch.int64: "index"}


def positions_for(capacity: int, max_load: float = MAX_LOAD) -> int:
    """Table size (a power of two) that keeps ``capacity`` keys at or under ``max_load``."""
    return 1 << max(4, (int(capacity / max_load) - 1).bit_length())


class KernelHashTable(BatchedHashTable):
    """Batched map ``int64 key >= 0 -> value`` (``value_dtype`` int32 or int64) in ``device`` memory;
    keys passed to ``insert`` and ``remove`` must be distinct within the batch (``insert``: and absent).
    ``capacity``: keys the initial table holds; ``insert`` grows the table past it when needed.
    ``huge_pages``: host arrays asked for on 2 MiB pages (``tiers.huge_pages``: fewer TLB misses);
    False for a table that grows while training runs, each rebuild first touching a new table,
    where a VM backing 2 MiB pages makes that touch cost more than the TLB misses save.
    ``max_load``: the share of positions live keys may fill (the table grows past it)."""

    def __init__(
        self,
        capacity: int,
        kernels,
        device: torch.device | str = "cpu",
        value_dtype: torch.dtype = torch.int32,
        huge_pages: bool = True,
        max_load: float = MAX_LOAD,
    ) -> None:
        self._setup(kernels, device, value_dtype, huge_pages, max_load)
        self._allocate(positions_for(capacity, max_load))

    def _setup(
        self,
        kernels,
        device: torch.device | str,
        value_dtype: torch.dtype,
        huge_pages: bool = True,
        max_load: float = MAX_LOAD,
    ) -> None:
        """Everything but the arrays."""
        self._huge_pages = huge_pages
        self.max_load = max_load
        if value_dtype not in _KERNEL_PREFIX:
            raise ValueError(f"value_dtype must be torch.int32 or torch.int64, got {value_dtype}")
        self.kernels = kernels
        self._shifting = cache_passes_of(kernels)  # the tuned host build: erase without tombstones
        self.device = torch.device(device)
        self.value_dtype = value_dtype
        self._kernel = {
            operation: f"{_KERNEL_PREFIX[value_dtype]}_{operation}"
            for operation in ("find", "insert", "erase")
        }

    def _allocate(self, size: int) -> None:
        full = huge_pages.full if self._huge_pages else _full
        self.keys = full((size,), EMPTY, torch.int64, self.device)
        self.values = full((size,), -1, self.value_dtype, self.device)
        self.live = 0
        self.tombstones = 0

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Value of each key (int64 [N]), -1 where absent; repeated keys are fine."""
        return self._per_key("find", keys).to(torch.int64)

    def _per_key(self, operation: str, keys: torch.Tensor) -> torch.Tensor:
        """Run the ``find`` or ``erase`` kernel over ``keys``: each key's value (before an erase),
        -1 where absent, in the table's value dtype."""
        keys = keys.to(self.device, torch.int64).contiguous()
        values = torch.empty(keys.numel(), dtype=self.value_dtype, device=self.device)
        self.kernels.launch(
            self._kernel[operation],
            keys.numel(),
            self.keys,
            self.values,
            self.keys.numel() - 1,
            keys,
            keys.numel(),
            values,
        )
        return values

    def insert(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``keys`` (distinct, absent) with ``values``; rebuilds or grows the table first when needed."""
        if keys.numel() == 0:
            return
        self.make_room(keys.numel())
        self._place(
            keys.to(self.device, torch.int64).contiguous(),
            values.to(self.device, self.value_dtype).contiguous(),
        )

    def reserve(self, capacity: int) -> None:
        """As large as a table made for ``capacity`` keys (rebuilt to that size if smaller)."""
        if self.keys.numel() < positions_for(capacity, self.max_load):
            self._rebuild(positions_for(capacity, self.max_load))

    def make_room(self, count: int) -> None:
        """Rebuild or grow the table now if ``count`` more keys would pass its load limits."""
        if self.live + count > self.max_load * self.keys.numel():  # doubled: as full as that at most
            self._rebuild(positions_for(self.live + count, self.max_load))
        elif self.live + self.tombstones + count > MAX_LOAD_WITH_TOMBSTONES * self.keys.numel():
            self._rebuild(self.keys.numel())

    def _place(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self._shifting is not None:  # the tuned host build: on one thread
            failed, code = self._shifting.insert(self.keys, self.values, keys, values)
            if failed >= 0:
                self.live += failed
                raise _refused(int(keys[failed]), code)
            self.live += keys.numel()
            return
        status = torch.empty(keys.numel(), dtype=torch.int32, device=self.device)
        self.kernels.launch(
            self._kernel["insert"],
            keys.numel(),
            self.keys,
            self.values,
            self.keys.numel() - 1,
            keys,
            values,
            keys.numel(),
            status,
        )
        failed = status != 0
        if bool(failed.any()):
            first = int(failed.nonzero()[0, 0])
            raise _refused(int(keys[first]), int(status[first]))
        self.live += keys.numel()

    def remove(self, keys: torch.Tensor) -> torch.Tensor:
        """Remove ``keys`` (distinct); returns their former values (int64, -1 for absent keys). On the
        tuned host build a table without tombstones stays so (entries shift back, on one thread)."""
        if self._shifting is not None and self.tombstones == 0:
            former, present = self._shifting.erase(self.keys, self.values, keys)
            self.live -= present
            return former.to(torch.int64)
        former = self._per_key("erase", keys)
        removed = int((former != -1).sum())  # a value may be negative (the mmap log's removals)
        self.live -= removed
        self.tombstones += removed
        return former.to(torch.int64)


def _full(shape: tuple[int, ...], fill, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.full`` on the pages the allocator gives (``huge_pages.full``'s arguments)."""
    return torch.full(shape, fill, dtype=dtype, device=device)


def _refused(key: int, status: int) -> ValueError:
    """The error of an insert whose ``key`` got ``status`` (the insert kernels' codes)."""
    return ValueError(f"insert: key {key} was {_STATUS[status]}; keys must be distinct and absent")
