"""Cold (durable) stores: every row ever evicted or flushed, on persistent storage."""

from .base import ColdStore
from .lmdb_store import LmdbColdStore
from .mmap_store import MmapColdStore


def open_cold_store(
    backend: str,
    directory,
    row_width: int,
    dtype,
    read_only: bool,
    index_kernels=None,
    create: bool = True,
    checksums: bool = True,
) -> ColdStore:
    """Open the cold store of ``backend`` ("lmdb" or "mmap") in ``directory``, creating its files if
    ``create`` (a new store); for an existing store a missing data file is ``StoreFormatError``.
    ``index_kernels``: see ``MmapColdStore`` (LMDB keeps its own index). ``checksums``: rows carry
    checks (format version 2 on)."""
    if backend == "mmap":
        return MmapColdStore(directory, row_width, dtype, read_only, index_kernels, create, checksums)
    if backend == "lmdb":
        return LmdbColdStore(
            directory, row_width, dtype, read_only=read_only, create=create, checksums=checksums
        )
    raise ValueError(f"unknown cold store backend {backend!r}; use 'lmdb' or 'mmap'")


__all__ = ["ColdStore", "LmdbColdStore", "MmapColdStore", "open_cold_store"]
