"""Cold (durable) stores: every row ever evicted or flushed, on persistent storage."""

from .base import ColdStore
from .lmdb_store import LmdbColdStore
from .mmap_store import MmapColdStore


def open_cold_store(
    backend: str, directory, row_width: int, dtype, read_only: bool, index_kernels=None
) -> ColdStore:
    """Open (or create) the cold store of ``backend`` ("lmdb" or "mmap") in ``directory``.
    ``index_kernels``: see ``MmapColdStore`` (LMDB keeps its own index)."""
    if backend == "mmap":
        return MmapColdStore(directory, row_width, dtype, read_only=read_only, index_kernels=index_kernels)
    if backend == "lmdb":
        return LmdbColdStore(directory, row_width, dtype, read_only=read_only)
    raise ValueError(f"unknown cold store backend {backend!r}; use 'lmdb' or 'mmap'")


__all__ = ["ColdStore", "LmdbColdStore", "MmapColdStore", "open_cold_store"]
