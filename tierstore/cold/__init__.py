"""Cold (durable) stores: every row ever evicted or flushed, on persistent storage."""

from .base import ColdStore
from .lmdb_store import LmdbColdStore
from .mmap_store import MmapColdStore


def open_cold_store(backend: str, directory, row_width: int, dtype, read_only: bool) -> ColdStore:
    """Open (or create) the cold store of ``backend`` ("lmdb" or "mmap") in ``directory``."""
    backends = {"lmdb": LmdbColdStore, "mmap": MmapColdStore}
    return backends[backend](directory, row_width, dtype, read_only=read_only)


__all__ = ["ColdStore", "LmdbColdStore", "MmapColdStore", "open_cold_store"]
