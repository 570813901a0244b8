"""Row and key encoding shared by the cold backends: raw little-endian bytes, no per-key Python.

A stored row is the row's bytes followed by a check (format version 2 on): the low bytes of a
64-bit hash of the row's bytes and its id. Reading a row checks it, so bytes damaged on disk,
or a row served for the wrong id, raise ``StoreFormatError`` instead of reaching the model.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from ...errors import StoreFormatError
from ...kernels.step_passes import host_passes

_CHUNK_ROWS = 4096  # rows hashed at once: bounds the hash's temporary memory
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


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


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping)."""
    values = values ^ (values >> np.uint64(30))
    values = values * np.uint64(0xBF58476D1CE4E5B9)
    values = values ^ (values >> np.uint64(27))
    values = values * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))


def row_hashes(keys: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """uint64 [N]: a hash of each row's bytes ``raw`` (uint8 [N, B]) and its id ``keys`` (int64 [N]).
    The bytes, as 32-bit words, are summed modulo 2**32 with odd per-position multipliers (any
    change to one word changes the sum), then mixed with the id. Computed by the host build's
    native pass where it is built, else by ``reference_row_hashes`` (the same bits)."""
    passes = host_passes()
    if passes is not None and raw.shape[0]:
        return passes.row_hashes(keys, raw)
    return reference_row_hashes(keys, raw)


def reference_row_hashes(keys: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """``row_hashes`` in numpy."""
    count, width = raw.shape
    padding = (-width) % 4
    words = (width + padding) // 4
    multipliers = (_mix(np.arange(1, words + 1, dtype=np.uint64) * _GOLDEN) | np.uint64(1)).astype(np.uint32)
    sums = np.empty(count, dtype=np.uint32)
    for start in range(0, count, _CHUNK_ROWS):
        part = raw[start : start + _CHUNK_ROWS]
        if padding:
            part = np.concatenate([part, np.zeros((part.shape[0], padding), np.uint8)], axis=1)
        if part.strides[1] != 1 or part.strides[0] % 4:
            part = np.ascontiguousarray(part)
        part = part.view("<u4")  # a row prefix of stored rows is viewed in place, not copied
        sums[start : start + _CHUNK_ROWS] = (part * multipliers).sum(axis=1, dtype=np.uint32)
    return _mix(sums.astype(np.uint64) ^ (keys.astype(np.uint64) * _GOLDEN))


class RowCodec:
    """Rows ``[N, row_width]`` of ``dtype`` <-> stored rows ``uint8 [N, stored_bytes]``.

    ``checksums``: each stored row ends with a check of ``check_bytes`` (4, or the dtype's size if
    larger, so a stored row stays aligned to its values); without, a stored row is its bytes.
    """

    def __init__(self, row_width: int, dtype: torch.dtype, checksums: bool) -> None:
        self.dtype = dtype
        self.row_bytes = row_width * dtype.itemsize
        self.check_bytes = max(4, dtype.itemsize) if checksums else 0
        self.stored_bytes = self.row_bytes + self.check_bytes

    def encode(self, keys: np.ndarray, rows: torch.Tensor) -> np.ndarray:
        """Stored rows for ``rows [N, row_width]`` of ids ``keys`` (int64 [N])."""
        raw = rows_as_bytes(rows)
        if not self.check_bytes:
            return raw
        stored = np.empty((raw.shape[0], self.stored_bytes), dtype=np.uint8)
        stored[:, : self.row_bytes] = raw
        stored[:, self.row_bytes :] = self._checks(keys, raw)
        return stored

    def decode(self, keys: np.ndarray, stored: np.ndarray, source: object) -> torch.Tensor:
        """Rows ``[N, row_width]`` (a view of ``stored``) of ids ``keys``, after checking each;
        a mismatch is ``StoreFormatError`` naming ``source`` (the file) and the first bad id."""
        raw = stored[:, : self.row_bytes]
        if raw.shape[0] == 0:
            return torch.empty(0, self.row_bytes // self.dtype.itemsize, dtype=self.dtype)
        if self.check_bytes:
            wrong = (self._checks(keys, raw) != stored[:, self.row_bytes :]).any(axis=1)
            if wrong.any():
                raise self.damaged(source, int(wrong.sum()), int(keys[wrong][0]))
        return rows_from_bytes(raw, self.dtype)

    @staticmethod
    def damaged(source: object, count: int, first_id: int) -> StoreFormatError:
        """The error for ``count`` stored rows of ``source`` failing their check (the first: ``first_id``)."""
        return StoreFormatError(
            f"{source} is damaged: {count} stored row(s) fail their checksum (first id: {first_id}); "
            f"restore the store from a backup, or export what still reads and re-import it"
        )

    def _checks(self, keys: np.ndarray, raw: np.ndarray) -> np.ndarray:
        hashes = row_hashes(keys, raw).astype("<u8")
        return hashes.view(np.uint8).reshape(-1, 8)[:, : self.check_bytes]
