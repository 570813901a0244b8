"""tierstore: a tiered embedding store (SSD/NVM -> DRAM -> GPU) for tables larger than memory."""

from . import optim
from .errors import (
    CacheCapacityError,
    ReadOnlyStoreError,
    StoreBusyError,
    StoreClosedError,
    StoreFormatError,
    StoreMismatchError,
)
from .initializer import initial_rows, initial_weights
from .lookahead import prefetch
from .nn import (
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    KeyedTensor,
    TieredEmbedding,
    TieredEmbeddingBag,
    TieredEmbeddingBagCollection,
)
from .store import TieredStore
from .tiers.admission import admission_filter
from .tiers.config import TierConfig

__all__ = [
    "admission_filter",
    "TieredEmbedding",
    "TieredEmbeddingBag",
    "TieredEmbeddingBagCollection",
    "EmbeddingBagConfig",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "TieredStore",
    "TierConfig",
    "prefetch",
    "optim",
    "initial_rows",
    "initial_weights",
    "CacheCapacityError",
    "ReadOnlyStoreError",
    "StoreClosedError",
    "StoreFormatError",
    "StoreBusyError",
    "StoreMismatchError",
]
__version__ = "0.1.0"
