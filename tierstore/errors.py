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


# Bad input to a module, raised as the builtin tierstore names and as the type torch raises for it,
# so code written for torch's modules catches them too; the messages say what to fix.


class NegativeIdError(ValueError, IndexError, RuntimeError):
    """Ids below 0 (torch: ``RuntimeError`` from ``EmbeddingBag``, ``IndexError`` from ``Embedding``)."""


class IdOutOfRangeError(IndexError, RuntimeError):
    """Ids at or past ``num_embeddings`` (torch: ``RuntimeError`` from ``EmbeddingBag``)."""


class WrongDtypeError(TypeError, RuntimeError):
    """Ids or offsets that are not integers, ``per_sample_weights`` of another dtype than the
    outputs' (torch: ``RuntimeError``)."""


class BadOffsetsError(ValueError, RuntimeError):
    """Offsets that do not start at 0, decrease or point past the input (torch: ``RuntimeError``)."""


class WeightsNeedSumError(ValueError, NotImplementedError):
    """``per_sample_weights`` with mode "mean" or "max" (torch: ``NotImplementedError``)."""


class PaddingIdxError(ValueError, AssertionError):
    """``padding_idx`` outside the table (torch: ``AssertionError``)."""
