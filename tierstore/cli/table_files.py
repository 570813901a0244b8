"""Embedding tables in files: ``.npy``, PyTorch checkpoints (``.pt``/``.pth``), ``.safetensors``,
and an ids file beside a rows file, read and written in chunks with bounded memory.

A table in a file is ``rows [N, width]`` (float) and, for a sparse id set, ``ids [N]`` (int64);
without ids, row ``i`` is id ``i``. Checkpoints and safetensors files hold named tensors: the rows
are the tensor ``key`` (default: the only 2-D float tensor, or the one named ``weight`` or ending
in ``.weight``), the ids the 1-D integer tensor named ``ids`` if there is one. Sources are
memory-mapped (``np.load(mmap_mode="r")``, ``torch.load(mmap=True)``, ``safe_open``), so a table
larger than RAM streams through page by page.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..checkpoint import numpy_bits

CHECKPOINT_SUFFIXES = (".pt", ".pth")
SUFFIXES = (".npy", ".safetensors") + CHECKPOINT_SUFFIXES
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class TableFileError(ValueError):
    """A table file that is missing, unreadable or not a table; the message says which and why."""


@dataclass
class TableSource:
    """A table to read: ``rows`` (a tensor or array, memory-mapped) and ``ids`` (or None: 0..N-1)."""

    rows: torch.Tensor  # or a safetensors tensor read by slices
    ids: torch.Tensor | None
    path: Path

    def __len__(self) -> int:
        return self.rows.shape[0]

    def chunks(self, size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(ids int64 [n], rows [n, width])`` of at most ``size`` rows, in file order."""
        for start in range(0, len(self), size):
            stop = min(start + size, len(self))
            ids = torch.arange(start, stop) if self.ids is None else self.ids[start:stop].to(torch.int64)
            yield ids, self.rows[start:stop].clone()  # one chunk in RAM at a time


def open_table(path: Path, key: str | None = None, ids_path: Path | None = None) -> TableSource:
    """The table in ``path`` (format from the suffix); ``ids_path``: an ``.npy`` of int64 ids, one per row."""
    path = Path(path)
    if not path.is_file():
        raise TableFileError(f"{path}: no such file")
    if path.suffix == ".npy":
        rows, ids = _load_npy(path), None
    elif path.suffix in CHECKPOINT_SUFFIXES:
        rows, ids = _named_table(path, _load_checkpoint(path), key)
    elif path.suffix == ".safetensors":
        rows, ids = _named_table(path, _load_safetensors(path), key)
    else:
        raise TableFileError(f"{path}: unknown format {path.suffix!r}; use one of {', '.join(SUFFIXES)}")
    rows = _as_tensor(rows) if isinstance(rows, np.ndarray) else rows
    if rows.dim() != 2 or not rows.is_floating_point() or rows.shape[1] == 0:
        raise TableFileError(
            f"{path}: rows must be a 2-D float array [rows, dim], got {rows.dtype} {tuple(rows.shape)}"
        )
    if ids_path is not None:
        if ids is not None:
            raise TableFileError(f"{path} holds ids already; leave out the ids file")
        ids = _as_tensor(_load_npy(Path(ids_path)))
    if ids is not None:
        ids = _check_ids(ids, rows.shape[0], ids_path or path)
    return TableSource(rows, ids, path)


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``array``'s (read-only, memory-mapped) memory; it is only read."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def _load_npy(path: Path) -> np.ndarray:
    if not path.is_file():
        raise TableFileError(f"{path}: no such file")
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as error:
        raise TableFileError(f"{path}: not a readable .npy file ({error})") from None


def _load_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    try:
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:  # torch raises many kinds for a bad file
        raise TableFileError(
            f"{path}: not a readable PyTorch checkpoint ({type(error).__name__}: {error})"
        ) from None
    if isinstance(loaded, torch.Tensor):
        return {"weight": loaded}
    if not isinstance(loaded, dict):
        raise TableFileError(f"{path}: holds a {type(loaded).__name__}, not a tensor or a state dict")
    return {name: value for name, value in loaded.items() if isinstance(value, torch.Tensor)}


def _load_safetensors(path: Path) -> dict:
    """Tensors of a safetensors file: 1-D ones (ids) read whole, the others as ``_SafetensorsRows``."""
    from safetensors import SafetensorError, safe_open

    try:
        file = safe_open(str(path), framework="pt")
        tensors = {}
        for name in file.keys():
            lazy = _SafetensorsRows(file, name)
            tensors[name] = lazy[:] if lazy.dim() == 1 else lazy
        return tensors
    except (SafetensorError, OSError, KeyError) as error:
        raise TableFileError(f"{path}: not a readable safetensors file ({error})") from None


class _SafetensorsRows:
    """A tensor of a safetensors file read a slice at a time (the file is memory-mapped), so a table
    larger than RAM streams; offers what ``open_table`` and ``TableSource.chunks`` use."""

    _DTYPES = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}

    def __init__(self, file, name: str) -> None:
        self._file = file  # keeps the mapping open
        self._slice = file.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())
        self.dtype = self._DTYPES[self._slice.get_dtype()]

    def dim(self) -> int:
        return len(self.shape)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def __getitem__(self, index) -> torch.Tensor:
        return self._slice[index]


def _named_table(
    path: Path, tensors: dict[str, torch.Tensor], key: str | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    tables = {name: t for name, t in tensors.items() if t.dim() == 2 and t.is_floating_point()}
    if key is None:
        named = [name for name in tables if name == "weight" or name.endswith(".weight")]
        candidates = list(tables) if len(tables) == 1 else named
        if len(candidates) != 1:
            raise TableFileError(
                f"{path}: choose the table with --key, one of: "
                f"{', '.join(tables) or '(no 2-D float tensors)'}"
            )
        key = candidates[0]
    if key not in tensors:
        raise TableFileError(
            f"{path}: no tensor named {key!r}; 2-D float tensors: {', '.join(tables) or 'none'}"
        )
    ids = tensors.get("ids")
    return tensors[key], ids if ids is not None and ids.dim() == 1 and not ids.is_floating_point() else None


def _check_ids(ids: torch.Tensor, rows: int, path: Path) -> torch.Tensor:
    """``ids`` as signed integers, or ``TableFileError`` saying what is wrong with them."""
    if ids.dim() != 1 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise TableFileError(f"{path}: ids must be a 1-D integer array, got {ids.dtype} {tuple(ids.shape)}")
    if ids.dtype == torch.uint64:
        past = ids.view(torch.int64) < 0  # at or past 2**63
        if bool(past.any()):
            first = int(ids.view(torch.int64)[past][0]) + 2**64
            raise TableFileError(f"{path}: ids must be below 2**63 (int64), found {first}")
        ids = ids.view(torch.int64)
    if ids.numel() != rows:
        raise TableFileError(f"{path}: {ids.numel()} ids for {rows} rows; there must be one id per row")
    if ids.numel() and int(ids.min()) < 0:
        raise TableFileError(f"{path}: ids must be non-negative, found {int(ids.min())}")
    if torch.unique(ids).numel() != ids.numel():
        raise TableFileError(f"{path}: ids repeat; each id may have one row")
    return ids


# -- writing ------------------------------------------------------------------------------------


def _allocated_memmap(path: Path, dtype: np.dtype, shape: tuple, made: list) -> np.memmap:
    """A new ``.npy`` file at ``path`` mapped for writing (appended to ``made``), its blocks allocated
    first: a full disk raises ``OSError`` here, where a write through the map would die of SIGBUS."""
    array = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    made.append(path)
    with open(path, "r+b", buffering=0) as file:
        os.posix_fallocate(file.fileno(), 0, os.fstat(file.fileno()).st_size)
    return array


class TableWriter:
    """Writes ``[N, width]`` rows of ``dtype`` (and ``ids`` when ``sparse``) to ``path`` in any order
    of chunks: ``write(position, ids, rows)`` places them at rows ``position..``; ``close()``
    finishes the file. Data goes through a memory-mapped ``.npy`` (never all in RAM)."""

    def __init__(
        self,
        path: Path,
        rows: int,
        width: int,
        dtype: torch.dtype,
        sparse: bool,
        ids_path: Path | None = None,
        removed: np.ndarray | None = None,
        removed_path: Path | None = None,
    ) -> None:
        self.path, self.sparse, self.ids_path = Path(path), sparse, ids_path
        self.removed, self.removed_path = removed, removed_path  # a delta's removed ids
        if self.path.suffix not in SUFFIXES:
            raise TableFileError(
                f"{path}: unknown format {self.path.suffix!r}; use one of {', '.join(SUFFIXES)}"
            )
        if self.path.suffix == ".npy" and sparse and ids_path is None:
            raise TableFileError(
                "the store's ids are not 0..N-1: give --ids FILE.npy to write them beside the rows"
            )
        if self.path.suffix == ".npy" and removed is not None and removed_path is None:
            raise TableFileError("a delta's removed ids go beside its rows: give --removed FILE.npy")
        if dtype == torch.bfloat16 and self.path.suffix == ".npy":
            raise TableFileError("numpy has no bfloat16: export a bfloat16 store to .pt or .safetensors")
        self.dtype = dtype
        numpy_dtype = numpy_bits(torch.empty(0, dtype=dtype)).dtype
        self._rows_file = (
            self.path if self.path.suffix == ".npy" else self.path.with_name(self.path.name + ".rows.tmp.npy")
        )
        self._ids = None
        made = []
        try:
            self._rows = _allocated_memmap(self._rows_file, numpy_dtype, (rows, width), made)
            if sparse:
                self._ids_file = (
                    ids_path if ids_path is not None else self.path.with_name(self.path.name + ".ids.tmp.npy")
                )
                self._ids = _allocated_memmap(self._ids_file, np.dtype(np.int64), (rows,), made)
        except OSError:
            for path in made:
                path.unlink(missing_ok=True)
            raise

    def write(self, position: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        stop = position + rows.shape[0]
        self._rows[position:stop] = numpy_bits(rows)
        if self._ids is not None:
            self._ids[position:stop] = ids.numpy()

    def close(self) -> None:
        self._rows.flush()
        if self._ids is not None:
            self._ids.flush()
        if self.path.suffix == ".npy":
            if self.removed is not None:
                np.save(self.removed_path, self.removed.astype(np.int64))
            return
        tensors = {"weight": torch.from_numpy(np.load(self._rows_file, mmap_mode="r+"))}
        if self.dtype == torch.bfloat16:
            tensors["weight"] = tensors["weight"].view(torch.bfloat16)
        if self._ids is not None:
            tensors["ids"] = torch.from_numpy(np.load(self._ids_file, mmap_mode="r+"))
        if self.removed is not None:
            tensors["removed_ids"] = torch.from_numpy(self.removed.astype(np.int64))
        if self.path.suffix == ".safetensors":
            write_safetensors(self.path, tensors)
        else:
            torch.save(tensors, self.path)
        self._rows_file.unlink()
        if self._ids is not None and self.ids_path is None:
            self._ids_file.unlink()


def read_removed_ids(path: Path, removed_path: Path | None) -> np.ndarray:
    """The ids a delta at ``path`` removes (int64): its tensor ``removed_ids``, or the ``.npy`` at
    ``removed_path`` (a ``.npy`` delta); none where a file holds none."""
    if removed_path is not None:
        removed = _load_npy(Path(removed_path))
    elif path.suffix == ".npy":
        raise TableFileError(
            f"{path}: a .npy delta's removed ids are in their own file: give --removed FILE.npy"
        )
    else:
        tensors = _load_checkpoint(path) if path.suffix in CHECKPOINT_SUFFIXES else _load_safetensors(path)
        removed = tensors.get("removed_ids", torch.empty(0, dtype=torch.int64)).numpy()
    if removed.ndim != 1 or removed.dtype != np.int64:
        raise TableFileError(f"{removed_path or path}: removed ids must be a 1-D int64 array")
    return np.asarray(removed)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], chunk_bytes: int = 64 << 20) -> None:
    """Write ``tensors`` (contiguous, possibly memory-mapped) in the safetensors format, streaming
    the data in chunks (``safetensors.torch.save_file`` needs every tensor in memory)."""
    header, offset = {}, 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        for tensor in tensors.values():
            if not tensor.numel():  # no data (and a view of it may have any strides)
                continue
            raw = tensor.reshape(-1).view(torch.uint8)
            for start in range(0, raw.numel(), chunk_bytes):
                file.write(raw[start : start + chunk_bytes].numpy().tobytes())
