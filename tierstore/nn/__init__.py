"""The user-facing modules: drop-in ``nn.EmbeddingBag`` / ``nn.Embedding`` replacements on a
``TieredStore`` (``embedding``), their pooled lookups (``pooled_lookup``), and the multi-table
collection (``collection``) with its TorchRec-shaped inputs and outputs (``keyed``)."""

from .collection import TieredEmbeddingBagCollection
from .embedding import TieredEmbedding, TieredEmbeddingBag
from .keyed import EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor

__all__ = [
    "TieredEmbedding",
    "TieredEmbeddingBag",
    "TieredEmbeddingBagCollection",
    "EmbeddingBagConfig",
    "KeyedJaggedTensor",
    "KeyedTensor",
]
