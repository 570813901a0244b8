"""Checks at the public boundary: ids and rows are validated here, with messages that say what
was wrong and how to fix it, before any tier is touched."""

from __future__ import annotations

import numbers
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import BadOffsetsError, IdOutOfRangeError, NegativeIdError, WeightsNeedSumError, WrongDtypeError
from .metadata import finite_rows

_INT64_MAX = np.iinfo(np.int64).max


def integral(value: Any) -> Any:
    """``value`` as a Python int where it is an integer of another kind (a numpy integer, a 0-d
    integer tensor), as torch takes them for sizes; anything else unchanged, for the caller's
    own check to refuse by name (bools are not integers here)."""
    if isinstance(value, (bool, np.bool_)):
        return value
    if isinstance(value, torch.Tensor):
        integer = not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
        return int(value) if value.dim() == 0 and integer else value
    return int(value) if isinstance(value, numbers.Integral) else value


def cpu_int64(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (already checked) as a contiguous int64 CPU tensor: itself where it is one, the
    usual case on a hot path, checked cheaply."""
    if tensor.is_cpu and tensor.dtype == torch.int64 and tensor.is_contiguous():
        return tensor
    return tensor.to(device="cpu", dtype=torch.int64).contiguous()


def as_path(path: Any, name: str = "path") -> Path | None:
    """``path`` (a ``str``, ``bytes`` or ``os.PathLike``, as ``open`` takes) as a ``Path``; None stays
    None. ``TypeError`` naming ``name`` for anything else."""
    if path is None:
        return None
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(
            f"{name} must be a directory path (str, bytes or os.PathLike) or None, "
            f"got {type(path).__name__} {path!r:.60}"
        )
    return Path(os.fsdecode(os.fspath(path)))


def check_table_shape(num_embeddings: Any, embedding_dim: Any, table: str = "") -> None:
    """``ValueError`` unless ``num_embeddings`` is a non-negative int or None (unbounded) and
    ``embedding_dim`` a positive int; ``table`` (a name) prefixes the message."""
    prefix = f"table {table!r}: " if table else ""
    if num_embeddings is not None and (
        isinstance(num_embeddings, bool) or not isinstance(num_embeddings, int) or num_embeddings < 0
    ):
        raise ValueError(
            f"{prefix}num_embeddings must be a non-negative int or None (unbounded), got {num_embeddings!r}"
        )
    if isinstance(embedding_dim, bool) or not isinstance(embedding_dim, int) or embedding_dim <= 0:
        raise ValueError(
            f"{prefix}embedding_dim must be a positive int, got {embedding_dim!r} (a table of zero-width "
            "rows stores nothing, and torch's own EmbeddingBag cannot look one up on the CPU)"
        )


def as_ids(ids: Any, name: str = "ids") -> torch.Tensor:
    """``ids`` (tensor, numpy array, sequence or int) as a 1-D int64 CPU tensor of non-negative ids.

    Raises ``TypeError`` for non-integer input and ``ValueError`` for negative ids or a bad shape.
    """
    too_big = f"{name} must be int64 ids in [0, 2**63)"
    if isinstance(ids, torch.Tensor):
        tensor = ids
        if tensor.dtype == torch.uint64 and bool((tensor.view(torch.int64) < 0).any()):
            big = int(tensor.view(torch.int64)[tensor.view(torch.int64) < 0][0]) + 2**64
            raise ValueError(f"{too_big}; got {big}")
    elif isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iubf":  # bool and float reach the dtype check below
            raise TypeError(
                f"{name} must have an integer dtype (int64 or int32), got a numpy {ids.dtype} array"
            )
        if ids.dtype == np.uint64 and ids.size and ids.max() > _INT64_MAX:
            raise ValueError(f"{too_big}; got {int(ids.max())}")
        tensor = (
            torch.from_numpy(np.ascontiguousarray(ids).astype(np.int64, copy=False))
            if ids.dtype.kind in "iu"
            else torch.from_numpy(ids)
        )
    elif isinstance(ids, (bool, float)):
        raise TypeError(f"{name} must be integers, got {type(ids).__name__} {ids!r}")
    elif isinstance(ids, (int, np.integer)):
        if not -_INT64_MAX - 1 <= int(ids) <= _INT64_MAX:
            raise ValueError(f"{too_big}; got {int(ids)}")
        tensor = torch.tensor([int(ids)], dtype=torch.int64)
    else:
        try:
            tensor = torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError, OverflowError) as error:
            if "overflow" in str(error).lower():
                raise ValueError(f"{too_big}; got a value out of that range") from None
            raise TypeError(
                f"{name} must be a 1-D integer tensor, array or sequence; got {type(ids).__name__}: {error}"
            ) from None
    if tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex():
        raise WrongDtypeError(
            f"{name} must have an integer dtype (torch.int64 or torch.int32), got {tensor.dtype}"
        )
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    if tensor.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}; flatten it first")
    tensor = tensor.to(device="cpu", dtype=torch.int64)
    if tensor.numel() and bool((tensor < 0).any()):
        bad = int(tensor[tensor < 0][0])
        raise NegativeIdError(f"{name} must be non-negative (as in nn.EmbeddingBag), got {bad}")
    return tensor


def as_device(device: Any, name: str = "device") -> torch.device:
    """``device`` as a ``torch.device`` the store can use: the CPU, or a CUDA device torch sees."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(
            f"{name} must be a torch.device or a string such as 'cpu', 'cuda' or 'cuda:0', "
            f"got {device!r} ({error})"
        ) from None
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} must be the CPU or a CUDA device, got {resolved}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{name}={str(resolved)!r} cannot run here (torch sees no CUDA device); use device='cpu'"
        )
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ValueError(
            f"{name}={str(resolved)!r} but torch sees {torch.cuda.device_count()} CUDA device(s)"
        )
    return resolved


def as_rows(
    rows: Any,
    count: int,
    widths: tuple[int, ...],
    dtype: torch.dtype,
    name: str = "rows",
    allow_nonfinite: bool = False,
    state: int | None = None,
) -> torch.Tensor:
    """``rows`` as a ``[count, w]`` CPU tensor of ``dtype`` with ``w`` in ``widths``, finite unless
    ``allow_nonfinite``. ``state``: with ``widths`` ``(dim, row_width)``, the optimizer-state values
    of a whole row (read as stored: ``metadata.finite_rows``).

    Raises ``TypeError`` for a wrong dtype (no silent casts) and ``ValueError`` for a wrong shape,
    a device that holds no data (``meta``) or NaN/Inf values.
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
    if rows.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} must be on the CPU or a CUDA device, got a tensor on {rows.device}")
    rows = rows.cpu()
    if allow_nonfinite:
        return rows
    if state is not None and rows.shape[1] == widths[-1]:  # whole rows, their state read as stored
        finite = finite_rows(rows, widths[0], state)
        first = None if bool(finite.all()) else int((~finite).nonzero()[0, 0])
    # A NaN or Inf makes the sum non-finite; a finite sum proves every value finite in one cheap
    # pass (an overflowing sum of finite values falls back to the exact check).
    elif bool(torch.isfinite(rows.sum())) or bool(torch.isfinite(rows).all()):
        first = None
    else:
        first = int((~torch.isfinite(rows)).any(dim=1).nonzero()[0, 0])
    if first is not None:
        raise ValueError(
            f"{name} hold NaN or Inf (first in row {first}); a table of trained rows should not, so they are "
            f"refused: pass allow_nonfinite=True to store them anyway"
        )
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
        raise IdOutOfRangeError(
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
) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """``nn.EmbeddingBag.forward``'s arguments, checked as torch does and more clearly.

    Returns ``(input as int64 CPU ids, offsets as int64 CPU or None, per_sample_weights)``. With
    ``include_last_offset``, entries past the last offset are left out of both, unchecked, as
    torch leaves them. Errors name the argument.
    """
    if isinstance(input, torch.Tensor) and input.dim() not in (1, 2):
        raise ValueError(
            f"input must be 1-D (with offsets) or 2-D (fixed-length bags), got shape {tuple(input.shape)}"
        )
    if isinstance(input, torch.Tensor) and input.dim() == 1 and offsets is not None:
        offsets = _checked_offsets(offsets, input.numel())
        if include_last_offset:
            if offsets.numel() == 0:
                raise ValueError(
                    "with include_last_offset=True offsets must hold at least one offset: the last one "
                    "ends the last bag"
                )
            kept = int(offsets[-1])
            whole = isinstance(per_sample_weights, torch.Tensor) and per_sample_weights.shape == input.shape
            input = input[:kept]
            per_sample_weights = per_sample_weights[:kept] if whole else per_sample_weights
    ids = check_lookup_ids(input, num_embeddings)
    if ids.dim() == 2 and offsets is not None:
        raise ValueError("offsets must be None when input is 2-D (each row of input is one bag)")
    if ids.dim() == 1 and offsets is None:
        raise ValueError("offsets is required when input is 1-D: offsets[i] is where bag i starts in input")
    if per_sample_weights is not None:
        if mode != "sum":
            raise WeightsNeedSumError(
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
            raise WrongDtypeError(
                f"per_sample_weights must have the table's dtype {dtype}, got {per_sample_weights.dtype}"
            )
    return ids, offsets, per_sample_weights


def _checked_offsets(offsets: Any, entries: int) -> torch.Tensor:
    """Bag offsets into ``entries`` ids, as int64 CPU: a 1-D integer tensor from 0, non-decreasing,
    none past the end."""
    if (
        not isinstance(offsets, torch.Tensor)
        or offsets.dim() != 1
        or offsets.is_floating_point()
        or offsets.dtype == torch.bool
    ):
        raise WrongDtypeError(f"offsets must be a 1-D integer tensor, got {offsets!r:.80}")
    offsets = offsets.to(device="cpu", dtype=torch.int64)
    if offsets.numel():
        if int(offsets[0]) != 0:
            raise BadOffsetsError(
                f"offsets[0] must be 0 (the first bag starts at the start of input), got {int(offsets[0])}"
            )
        if bool((offsets[1:] < offsets[:-1]).any()):
            raise BadOffsetsError(
                "offsets must be non-decreasing (bag i spans input[offsets[i]:offsets[i + 1]])"
            )
        if int(offsets[-1]) > entries:
            raise BadOffsetsError(
                f"offsets point past the end of input: last offset {int(offsets[-1])} > "
                f"input length {entries}"
            )
    return offsets
