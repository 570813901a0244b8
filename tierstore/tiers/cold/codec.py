"""Row and key encoding shared by the cold backends: raw little-endian bytes, no per-key Python."""

from __future__ import annotations

import warnings

import numpy as np
import torch


def rows_as_bytes(rows: torch.Tensor) -> np.ndarray:
    """``[N, W]`` rows of any dtype -> ``uint8 [N, W * itemsize]`` (a view when contiguous)."""
    return rows.contiguous().view(torch.uint8).numpy()


def rows_from_bytes(raw: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """``uint8 [N, row_bytes]`` -> ``[N, W]`` of ``dtype`` (shares memory with ``raw``).

    ``raw`` may be read-only (LMDB buffers, a read-only map): callers only read such views.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(raw).view(dtype)


def encode_keys(keys: np.ndarray) -> list:
    """int64 ids -> 8-byte big-endian keys (LMDB sorts them in numeric order)."""
    return keys.astype(">u8").view("V8").tolist()


def decode_keys(encoded: list | tuple) -> np.ndarray:
    """8-byte big-endian keys -> int64 ids."""
    if not encoded:
        return np.empty(0, dtype=np.int64)
    return np.frombuffer(b"".join(encoded), dtype=">u8").astype(np.int64)


def encode_rows(rows: torch.Tensor) -> list:
    """``[N, W]`` rows -> N ``bytes`` values."""
    raw = rows_as_bytes(rows)
    return np.ascontiguousarray(raw).view(f"V{raw.shape[1]}").ravel().tolist()
