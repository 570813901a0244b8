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
        tensor = (
            torch.from_numpy(np.ascontiguousarray(ids).astype(np.int64, copy=False))
            if ids.dtype.kind in "iu"
            else torch.from_numpy(ids)
        )
    elif isinstance(ids, (bool, float)):
        raise TypeError(f"{name} must be integers, got {type(ids).__name__} {ids!r}")
    elif isinstance(ids, int):
        tensor = torch.tensor([ids], dtype=torch.int64)
    else:
        try:
            tensor = torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError, OverflowError) as error:
            raise TypeError(
                f"{name} must be a 1-D integer tensor, array or sequence; got {type(ids).__name__}: {error}"
            ) from None
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


def as_rows(
    rows: Any, count: int, widths: tuple[int, ...], dtype: torch.dtype, name: str = "rows"
) -> torch.Tensor:
    """``rows`` as a ``[count, w]`` tensor of ``dtype`` with ``w`` in ``widths``.

    Raises ``TypeError`` for a wrong dtype (no silent casts) and ``ValueError`` for a wrong shape.
    """
    if isinstance(rows, np.ndarray):
        rows = torch.from_numpy(rows)
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(rows).__name__}")
    if rows.dtype != dtype:
        raise TypeError(
            f"{name} must have dtype {dtype} (the store's dtype), got {rows.dtype}; convert with .to({dtype})"
        )
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
        raise ValueError(
            f"out must be a {list(shape)} {dtype} tensor on {device}; "
            f"got {list(out.shape)} {out.dtype} on {out.device}"
        )
    if not out.is_contiguous():
        raise ValueError(
            "out must be contiguous (rows are written packed); pass out.contiguous() or a fresh tensor"
        )


def check_lookup_ids(input: Any, num_embeddings: int | None, name: str = "input") -> torch.Tensor:
    """An embedding module's ids: an integer tensor of any shape, each in ``[0, num_embeddings)``
    (``num_embeddings=None``: any non-negative int64). Returns them as int64 on CPU.

    Raises ``TypeError`` (not an integer tensor), ``ValueError`` (negative), ``IndexError`` (too big).
    """
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int64 or int32 ids, got {type(input).__name__}")
    ids = as_ids(input.reshape(-1), name).reshape(input.shape)
    if num_embeddings is not None and ids.numel() and int(ids.max()) >= num_embeddings:
        raise IndexError(
            f"{name} holds id {int(ids.max())}, out of range for num_embeddings={num_embeddings}"
        )
    return ids


def check_bag_input(
    input: Any,
    offsets: Any,
    per_sample_weights: Any,
    mode: str,
    num_embeddings: int | None,
    dtype: torch.dtype,
    include_last_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``nn.EmbeddingBag.forward``'s arguments, checked as torch does and more clearly.

    Returns ``(input as int64 CPU ids, offsets as int64 CPU or None)``. Errors name the argument.
    """
    if isinstance(input, torch.Tensor) and input.dim() not in (1, 2):
        raise ValueError(
            f"input must be 1-D (with offsets) or 2-D (fixed-length bags), got shape {tuple(input.shape)}"
        )
    ids = check_lookup_ids(input, num_embeddings)
    if ids.dim() == 2:
        if offsets is not None:
            raise ValueError("offsets must be None when input is 2-D (each row of input is one bag)")
    else:
        if offsets is None:
            raise ValueError(
                "offsets is required when input is 1-D: offsets[i] is where bag i starts in input"
            )
        if (
            not isinstance(offsets, torch.Tensor)
            or offsets.dim() != 1
            or offsets.is_floating_point()
            or offsets.dtype == torch.bool
        ):
            raise TypeError(f"offsets must be a 1-D integer tensor, got {offsets!r:.80}")
        offsets = offsets.to(device="cpu", dtype=torch.int64)
        if offsets.numel():
            if int(offsets[0]) != 0:
                raise ValueError(
                    "offsets[0] must be 0 (the first bag starts at the start of input), "
                    f"got {int(offsets[0])}"
                )
            if bool((offsets[1:] < offsets[:-1]).any()):
                raise ValueError(
                    "offsets must be non-decreasing (bag i spans input[offsets[i]:offsets[i + 1]])"
                )
            if int(offsets[-1]) > ids.numel():
                raise ValueError(
                    f"offsets point past the end of input: last offset {int(offsets[-1])} > "
                    f"input length {ids.numel()}"
                )
        if include_last_offset and (offsets.numel() == 0 or int(offsets[-1]) != ids.numel()):
            last = int(offsets[-1]) if offsets.numel() else None
            raise ValueError(
                f"with include_last_offset=True the last offset ends the last bag and must equal the "
                f"input length {ids.numel()} (as torch documents), got {last}"
            )
    if per_sample_weights is not None:
        if mode != "sum":
            raise ValueError(
                f"per_sample_weights is only supported with mode='sum' (as in torch), not mode={mode!r}"
            )
        if not isinstance(per_sample_weights, torch.Tensor) or not per_sample_weights.is_floating_point():
            raise TypeError("per_sample_weights must be a floating-point tensor")
        if tuple(per_sample_weights.shape) != tuple(ids.shape):
            raise ValueError(
                f"per_sample_weights must have input's shape {tuple(ids.shape)}, "
                f"got {tuple(per_sample_weights.shape)}"
            )
        if per_sample_weights.dtype != dtype:
            raise TypeError(
                f"per_sample_weights must have the table's dtype {dtype}, got {per_sample_weights.dtype}"
            )
    return ids, offsets
