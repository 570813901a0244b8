"""Checks at the public boundary: ids and rows are validated here, with messages that say what
was wrong and how to fix it, before any tier is touched."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def as_ids(ids: Any, name: str = "ids") -> torch.Tensor:
    """``ids`` (tensor, numpy array, sequence or int) as a 1-D int64 CPU tensor of non-negative ids.

    Raises ``TypeError`` for non-integer input and ``ValueError`` for negative ids or a bad shape.
    """
    if isinstance(ids, torch.Tensor):
        tensor = ids
    elif isinstance(ids, np.ndarray):
        if ids.dtype == np.uint64 and ids.size and ids.max() > np.iinfo(np.int64).max:
            raise ValueError(f"{name} must fit in int64; got {int(ids.max())}")
        tensor = torch.from_numpy(np.ascontiguousarray(ids).astype(np.int64, copy=False)) if ids.dtype.kind in "iu" else torch.from_numpy(ids)
    elif isinstance(ids, (bool, float)):
        raise TypeError(f"{name} must be integers, got {type(ids).__name__} {ids!r}")
    elif isinstance(ids, int):
        tensor = torch.tensor([ids], dtype=torch.int64)
    else:
        try:
            tensor = torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError, OverflowError) as error:
            raise TypeError(f"{name} must be a 1-D integer tensor, array or sequence; got {type(ids).__name__}: {error}") from None
    if tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex():
        raise TypeError(f"{name} must have an integer dtype (torch.int64 or torch.int32), got {tensor.dtype}")
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    if tensor.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}; flatten it first")
    tensor = tensor.to(device="cpu", dtype=torch.int64)
    if tensor.numel() and bool((tensor < 0).any()):
        bad = int(tensor[tensor < 0][0])
        raise ValueError(f"{name} must be non-negative (as in nn.EmbeddingBag), got {bad}")
    return tensor


def as_rows(rows: Any, count: int, widths: tuple[int, ...], dtype: torch.dtype, name: str = "rows") -> torch.Tensor:
    """``rows`` as a ``[count, w]`` tensor of ``dtype`` with ``w`` in ``widths``.

    Raises ``TypeError`` for a wrong dtype (no silent casts) and ``ValueError`` for a wrong shape.
    """
    if isinstance(rows, np.ndarray):
        rows = torch.from_numpy(rows)
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(rows).__name__}")
    if rows.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype} (the store's dtype), got {rows.dtype}; convert with .to({dtype})")
    if rows.dim() != 2 or rows.shape[0] != count or rows.shape[1] not in widths:
        expected = " or ".join(f"[{count}, {w}]" for w in widths)
        raise ValueError(f"{name} must have shape {expected} (one row per id), got {tuple(rows.shape)}")
    return rows


def check_out(out: Any, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> None:
    """Raise unless ``out`` is a tensor of ``shape``, ``dtype`` and ``device`` to write results into."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    same_device = out.device.type == device.type and device.index in (None, out.device.index)
    if tuple(out.shape) != shape or out.dtype != dtype or not same_device:
        raise ValueError(f"out must be a {list(shape)} {dtype} tensor on {device}; "
                         f"got {list(out.shape)} {out.dtype} on {out.device}")
