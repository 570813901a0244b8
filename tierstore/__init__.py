"""tierstore: a tiered embedding store (SSD/NVM -> DRAM -> GPU) for tables larger than memory."""

from .errors import CacheCapacityError, ReadOnlyStoreError, StoreClosedError, StoreFormatError, StoreMismatchError
from .initializer import initial_rows, initial_weights
from .store import TieredStore

__all__ = [
    "TieredStore",
    "initial_rows",
    "initial_weights",
    "CacheCapacityError",
    "ReadOnlyStoreError",
    "StoreClosedError",
    "StoreFormatError",
    "StoreMismatchError",
]
__version__ = "0.1.0"
