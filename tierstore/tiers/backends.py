"""Backends of a cache tier: the bulk row operations a ``RowCache`` runs, as values.

``TorchRows`` runs them in torch ops on any device (the reference); ``KernelRows`` on the
``tierstore/kernels`` sources, compiled for the GPU (``"cuda"``) or for the CPU with OpenMP
(``"openmp"``). ``resolve`` is the one place that turns a tier's requested backend ("auto", a
name, or a backend value) into one. A new backend is a class with these methods.
"""

from __future__ import annotations

import torch

from ..kernels import device_kernels, host_kernels
from ..kernels.cache_passes import cache_passes_of
from ..kernels.launch import HALF_FORMATS, KERNEL_DTYPES
from ..rounding import rounding_stream
from .hash_index import HashIndex, index_nbytes
from .kernel_hash_table import MAX_LOAD, SPARSE_LOAD, KernelHashTable, positions_for

DEVICE_BACKENDS = ("auto", "cuda", "torch")
HOST_BACKENDS = ("auto", "openmp", "torch")


class TorchRows:
    """Row operations in torch ops on any device; the index is a ``HashIndex``."""

    name = "torch"

    def __init__(self) -> None:
        self._update_buffers: dict[torch.device, torch.Tensor] = {}

    def make_index(self, capacity: int, device: torch.device, grows_to: int | None = None) -> HashIndex:
        """The index of a tier of ``capacity`` slots that may grow to ``grows_to``."""
        return HashIndex(capacity, device, value_dtype=torch.int32)

    def index_nbytes(self, capacity: int) -> int:
        return index_nbytes(capacity, torch.int32)

    def gather(
        self, rows: torch.Tensor, slots: torch.Tensor, columns: int, out: torch.Tensor | None
    ) -> torch.Tensor:
        """``[N, columns]``: the first ``columns`` of ``rows [R, width]`` at ``slots`` (into ``out``)."""
        if out is None:
            return rows[:, :columns].index_select(0, slots)
        return torch.index_select(rows[:, :columns], 0, slots, out=out)

    def scatter(self, rows: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, columns: int) -> None:
        """The first ``columns`` of ``rows`` at ``slots`` (distinct) = ``values [N, columns]``."""
        rows[:, :columns].index_copy_(0, slots, values.to(rows.device, rows.dtype))

    def add_scores(self, scores: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> None:
        scores.index_add_(0, slots, weights)

    def add_pins(self, pins: torch.Tensor, slots: torch.Tensor, delta: int) -> None:
        """``pins`` (uint8 [capacity]) at ``slots`` (distinct) += ``delta`` (1 or -1)."""
        step = torch.full((slots.numel(),), delta % 256, dtype=torch.uint8, device=pins.device)
        pins.index_put_((slots,), step, accumulate=True)

    def victim_scores(
        self, scores: torch.Tensor, slot_keys: torch.Tensor, blocked: torch.Tensor
    ) -> torch.Tensor:
        """``scores``, +inf at free slots (key -1) and ``blocked`` ones (uint8 [capacity])."""
        return scores.masked_fill((slot_keys < 0) | blocked.bool(), float("inf"))

    def optimizer_step(
        self,
        optimizer,
        rows: torch.Tensor,
        slots: torch.Tensor,
        grad: torch.Tensor,
        step: int,
        keys: torch.Tensor | None = None,
    ) -> None:
        """``optimizer``'s update of ``rows`` at ``slots`` (distinct) with ``grad [N, dim]``, in place
        (``keys``: the rows' ids, for ``stochastic_rounding``)."""
        buffer = self._update_buffers.get(rows.device)
        if buffer is None or buffer.shape[0] < slots.numel() or buffer.shape[1] != rows.shape[1]:
            buffer = self._update_buffers[rows.device] = rows.new_empty(slots.numel(), rows.shape[1])
        grad = grad.to(rows.device, torch.promote_types(rows.dtype, torch.float32))  # 16-bit rows: float32
        optimizer.update(rows, slots, grad, step, buffer, keys)


class KernelRows:
    """Row operations as ``kernels.launch`` calls (a ``CudaKernels`` or ``HostKernels`` build);
    float32 or 16-bit rows (``KERNEL_DTYPES``); the index is a ``KernelHashTable``. ``name`` is the
    backend's name in stats."""

    def __init__(self, kernels, name: str) -> None:
        self.kernels = kernels
        self.name = name
        self._passes = cache_passes_of(kernels)  # the tuned host build: per-slot updates on one thread

    def make_index(self, capacity: int, device: torch.device, grows_to: int | None = None) -> KernelHashTable:
        load = self.index_load(max(capacity, grows_to or capacity))
        return KernelHashTable(capacity, self.kernels, device, max_load=load)

    def index_nbytes(self, capacity: int) -> int:
        return positions_for(capacity, self.index_load(capacity)) * (8 + 4)

    def index_load(self, capacity: int) -> float:
        """The load limit of the index of a tier of (at most) ``capacity`` slots: ``SPARSE_LOAD`` on
        the tuned host build where that table's keys still fit in a core's own cache (its probes
        compare four keys at once there: ``CachePasses.window_positions``), else ``MAX_LOAD``. A
        small tier turns over much of its index each step (every miss an erase and an insert), and
        in a sparser table the erase's backward shifts and the probes are shorter; a larger table's
        work waits on memory instead, where twice the positions would cost bytes and gain nothing.
        Either way a table at the boundary has the same size."""
        if self._passes is None or positions_for(capacity, SPARSE_LOAD) > self._passes.window_positions:
            return MAX_LOAD
        return SPARSE_LOAD

    def gather(
        self, rows: torch.Tensor, slots: torch.Tensor, columns: int, out: torch.Tensor | None
    ) -> torch.Tensor:
        if out is None:
            out = torch.empty(slots.numel(), columns, dtype=rows.dtype, device=rows.device)
        source, target, width, copied = _as_float32(rows, out, columns)
        if source is None:  # 16-bit rows of odd widths
            name, items = "cache_gather_16", columns
            source, target, width, copied = rows, out, rows.shape[1], columns
        elif width % 4 == 0 and copied % 4 == 0 and (target.data_ptr() | source.data_ptr()) % 16 == 0:
            name, items = "cache_gather_vec4", copied // 4
        else:
            name, items = "cache_gather", copied
        self.kernels.launch(
            name, slots.numel() * items, source, width, _int32(slots), slots.numel(), copied, target
        )
        return out

    def scatter(self, rows: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, columns: int) -> None:
        values = values.to(rows.device, rows.dtype).contiguous()
        target, source, width, copied = _as_float32(rows, values, columns)
        name = "cache_scatter"
        if target is None:  # 16-bit rows of odd widths
            name, target, source, width, copied = "cache_scatter_16", rows, values, rows.shape[1], columns
        self.kernels.launch(
            name, slots.numel() * copied, target, width, _int32(slots), source, slots.numel(), copied
        )

    def add_scores(self, scores: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> None:
        self.kernels.launch(
            "cache_touch", slots.numel(), scores, _int32(slots), weights.contiguous(), slots.numel()
        )

    def add_pins(self, pins: torch.Tensor, slots: torch.Tensor, delta: int) -> None:
        if self._passes is not None:
            self._passes.add_pins(pins, slots, delta)
            return
        self.kernels.launch("cache_pin_add", slots.numel(), pins, _int32(slots), slots.numel(), delta)

    def victim_scores(
        self, scores: torch.Tensor, slot_keys: torch.Tensor, blocked: torch.Tensor
    ) -> torch.Tensor:
        candidates = torch.empty_like(scores)
        self.kernels.launch(
            "cache_victim_scores",
            scores.numel(),
            scores,
            slot_keys,
            blocked,
            float("inf"),
            scores.numel(),
            candidates,
        )
        return candidates

    def optimizer_step(
        self,
        optimizer,
        rows: torch.Tensor,
        slots: torch.Tensor,
        grad: torch.Tensor,
        step: int,
        keys: torch.Tensor | None = None,
    ) -> None:
        """As ``TorchRows.optimizer_step``. 16-bit rows are updated in float32 and rounded once by
        the ``_16`` kernels, which take the rows' ``format`` and the rounding's draws (``keys``)."""
        name, arguments, per_row = optimizer.kernel(step)
        dim = grad.shape[1]
        grad = grad.to(rows.device, torch.float32).contiguous()
        if rows.dtype in HALF_FORMATS:
            stochastic = optimizer.stochastic_rounding
            if stochastic and keys is None:
                raise ValueError("stochastic_rounding draws by the rows' ids: pass keys")
            draws_by = keys if stochastic else slots.new_empty(0)
            name = f"{name}_16"
            arguments = (
                HALF_FORMATS[rows.dtype],
                draws_by.to(rows.device, torch.int64).contiguous(),
                rounding_stream(step) if stochastic else 0,
                int(stochastic),
                *arguments,
            )
        self.kernels.launch(
            name,
            slots.numel() if per_row else slots.numel() * dim,
            rows,
            rows.shape[1],
            _int32(slots),
            grad,
            slots.numel(),
            dim,
            *arguments,
        )


def check_setting(tier: str, requested) -> None:
    """Raise unless ``requested`` is one of the ``tier``'s backend names or a backend value."""
    names = DEVICE_BACKENDS if tier == "device" else HOST_BACKENDS
    if isinstance(requested, str) and requested not in names:
        auto, kernel, torch_ops = names
        raise ValueError(
            f"{tier}_cache_backend must be {auto!r}, {kernel!r} or {torch_ops!r} (or a backend value), "
            f"got {requested!r}"
        )
    if not isinstance(requested, str) and not hasattr(requested, "gather"):
        raise TypeError(
            f"{tier}_cache_backend must be a name or a backend value (tierstore.tiers.backends), "
            f"got {requested!r}"
        )


def resolve(tier: str, requested, device: torch.device, dtype: torch.dtype, state_in_row_dtype: bool = False):
    """The backend of the ``tier`` ("device" or "host") for rows of ``dtype`` on ``device``
    (``state_in_row_dtype``: 16-bit rows whose optimizer state is in their own dtype, which only the
    torch backend updates; ``StoreMetadata.state_in_row_dtype``).

    ``requested``: a backend value (used as given), "torch", the tier's kernels ("cuda" for the
    device tier, "openmp" for the host tier: raises ``ValueError`` saying why when they cannot run
    here) or "auto" (the kernels where they run, else torch)."""
    if not isinstance(requested, str):
        if state_in_row_dtype and isinstance(requested, KernelRows):
            raise ValueError(f"{tier}_cache_backend: {_STATE_IN_ROW_DTYPE}; use 'auto' or 'torch'")
        return requested
    check_setting(tier, requested)
    names = DEVICE_BACKENDS if tier == "device" else HOST_BACKENDS
    if requested == "torch":
        return TorchRows()
    kernel_name = names[1]
    if state_in_row_dtype:
        kernels, why_not = None, _STATE_IN_ROW_DTYPE
    elif tier == "device":
        kernels, why_not = device_kernels(device, dtype)
    elif dtype not in KERNEL_DTYPES:
        kernels, why_not = None, f"the kernels store float32, float16 or bfloat16 rows, not {dtype}"
    else:
        kernels, why_not = host_kernels()
    if kernels is None:
        if requested == kernel_name:
            raise ValueError(
                f"{tier}_cache_backend={kernel_name!r} cannot run here ({why_not}); use 'auto' or 'torch'"
            )
        return TorchRows()
    return KernelRows(kernels, kernel_name)


_STATE_IN_ROW_DTYPE = (
    "this 16-bit store keeps its optimizer state in its rows' dtype (it was made before the state was "
    "kept in float32), and the kernels update float32 state"
)


def _as_float32(rows: torch.Tensor, other: torch.Tensor, columns: int) -> tuple:
    """``(rows, other, rows' width, columns)`` as float32 views: 16-bit rows of even widths move as
    pairs of values by the float32 kernels; ``(None, ...)`` for 16-bit rows of odd widths."""
    if rows.dtype == torch.float32:
        return rows, other, rows.shape[1], columns
    if rows.shape[1] % 2 or columns % 2:
        return None, None, 0, 0
    return rows.view(torch.float32), other.view(torch.float32), rows.shape[1] // 2, columns // 2


def _int32(slots: torch.Tensor) -> torch.Tensor:
    return slots.to(torch.int32).contiguous()
