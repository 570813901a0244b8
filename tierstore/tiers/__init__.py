"""The tiers: the contract (``contract``), the one cache tier (``row_cache``) with its backends
(``backends``), eviction policies (``policies``) and admission filter (``admission``), the hash
tables that index them, the cold stores (``cold``), the stack that moves rows between tiers
(``stack``) and its construction (``build``)."""

from .admission import AdmissionFilter, admission_filter
from .backends import KernelRows, TorchRows
from .contract import CacheTier, ColdStats, Rows, TierStats
from .policies import EvictionPolicy, LfuWithAgeing
from .row_cache import RowCache

__all__ = [
    "AdmissionFilter",
    "admission_filter",
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
