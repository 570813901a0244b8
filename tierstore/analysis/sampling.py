"""Samples of a key trace whose memory stays bounded however many ids it has.

- ``spatial_sample``: the accesses of the ids whose hash falls below a threshold, in the style of
  SHARDS (Waldspurger et al., FAST '15): every access of a sampled id is kept, so a cache policy
  replayed over the sample with its capacity scaled by the rate ("miniature simulation") predicts
  its hit rate on the whole trace. At most ``max_ids`` distinct ids are kept: past that, the
  threshold is lowered to the ``max_ids`` smallest hashes (fixed-size SHARDS) and the rate with it.
- ``ranked_ids``: ids ranked by their count in a uniform sample of the accesses (hot ids are the
  ones a sample sees most), keeping at most a bounded number of candidates.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..hashing import HASH_SPACE, id_hash

CHUNK = 1 << 20  # accesses handled at a time


@dataclasses.dataclass
class SpatialSample:
    """The accesses of the sampled ids (in trace order) and the share of ids sampled."""

    keys: np.ndarray  # int64 [sampled accesses]
    rate: float  # share of the id space whose hash is below the threshold
    accesses: int  # accesses of the whole trace
    nbytes: int  # the most memory the sampler held at once

    @property
    def distinct(self) -> int:
        return int(np.unique(self.keys).size)


def spatial_sample(keys: np.ndarray, rate: float, max_ids: int) -> SpatialSample:
    """Accesses of the ids of ``keys`` whose hash is below ``rate`` of the hash space, at most
    ``max_ids`` distinct ids (the rate drops to keep to it)."""
    if not 0 < rate <= 1:
        raise ValueError(f"the sample rate must be in (0, 1], got {rate}")
    if max_ids < 1:
        raise ValueError(f"max_ids must be at least 1, got {max_ids}")
    threshold = max(1, round(rate * HASH_SPACE))
    parts: list[np.ndarray] = []
    kept_ids = np.zeros(0, dtype=np.int64)  # distinct sampled ids so far
    held = 0
    for start in range(0, keys.size, CHUNK):
        chunk = keys[start : start + CHUNK]
        chunk = chunk[id_hash(chunk) < threshold]
        kept_ids = np.union1d(kept_ids, chunk)
        if kept_ids.size > max_ids:  # keep the max_ids smallest hashes: lower the threshold
            hashes = np.sort(id_hash(kept_ids))
            threshold = int(hashes[max_ids])
            kept_ids = kept_ids[id_hash(kept_ids) < threshold]
            parts = [part[id_hash(part) < threshold] for part in parts]
            chunk = chunk[id_hash(chunk) < threshold]
        parts.append(chunk)
        held = max(held, kept_ids.nbytes + sum(part.nbytes for part in parts))
    sampled = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return SpatialSample(sampled, threshold / HASH_SPACE, int(keys.size), held)


def ranked_ids(
    keys: np.ndarray, rate: float, limit: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, int]:
    """``(ids, their counts in the sample, bytes held at most)``: up to ``limit`` ids of ``keys``
    ranked by how often a uniform sample of ``rate`` of the accesses holds them, most first.
    At most ``4 * limit`` candidates are kept between chunks (the lowest counts are dropped)."""
    if not 0 < rate <= 1:
        raise ValueError(f"the sample rate must be in (0, 1], got {rate}")
    random = np.random.default_rng(seed)
    ids, counts = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    keep, held = 4 * max(limit, 1), 0
    for start in range(0, keys.size, CHUNK):
        chunk = keys[start : start + CHUNK]
        drawn = chunk[random.random(chunk.size) < rate]
        merged, inverse = np.unique(np.concatenate([ids, drawn]), return_inverse=True)
        totals = np.bincount(inverse, weights=np.concatenate([counts, np.ones(drawn.size)]))
        held = max(held, merged.nbytes + totals.nbytes + drawn.nbytes)
        if merged.size > keep:
            top = np.argpartition(-totals, keep - 1)[:keep]
            merged, totals = merged[top], totals[top]
        ids, counts = merged, totals.astype(np.int64)
    order = np.lexsort((ids, -counts))[:limit]  # most counted first, ties by id
    return ids[order], counts[order], held
