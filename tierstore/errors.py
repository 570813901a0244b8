"""Exceptions raised at tierstore's boundaries.

Each subclasses the builtin a user would catch anyway (``ValueError``, ``PermissionError``), so
code written for ``nn.EmbeddingBag`` keeps working, while callers that care can be specific.
"""


class StoreFormatError(ValueError):
    """A store's files are missing, damaged, or written by an unknown (newer) format version."""


class StoreMismatchError(ValueError):
    """A store was opened with settings (dim, dtype, ...) that differ from the ones it was made with."""


class ReadOnlyStoreError(PermissionError):
    """A write was attempted on a store opened with ``read_only=True``."""


class CacheCapacityError(ValueError):
    """A batch needs more distinct rows at once than the top cache tier can hold."""


class StoreClosedError(RuntimeError):
    """An operation was attempted on a store after ``close()``."""


class StoreBusyError(RuntimeError):
    """A store is already open for writing (one writer at a time, on every backend)."""


class ShardingError(RuntimeError):
    """The ranks of a sharded table disagree (settings, mode, one refused its input) or their
    process group failed; the message names the ranks, and each store keeps its last flush."""
