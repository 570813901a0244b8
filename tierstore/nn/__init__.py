"""The user-facing modules: drop-in ``nn.EmbeddingBag`` / ``nn.Embedding`` replacements on a
``TieredStore`` (``embedding``) and their pooled lookups (``pooled_lookup``)."""

from .embedding import TieredEmbedding, TieredEmbeddingBag

__all__ = ["TieredEmbedding", "TieredEmbeddingBag"]
