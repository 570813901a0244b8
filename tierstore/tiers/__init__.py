"""The tiers: the contract (``contract``), the one cache tier (``row_cache``) with its backends
(``backends``) and eviction policies (``policies``), the hash tables that index them, the cold
stores (``cold``), the stack that moves rows between tiers (``stack``) and its construction
(``build``)."""

from .backends import KernelRows, TorchRows
from .contract import CacheTier, ColdStats, Rows, TierStats
from .policies import EvictionPolicy, LfuWithAgeing
from .row_cache import RowCache

__all__ = [
    "CacheTier",
    "ColdStats",
    "EvictionPolicy",
    "KernelRows",
    "LfuWithAgeing",
    "RowCache",
    "Rows",
    "TierStats",
    "TorchRows",
]
