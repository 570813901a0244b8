"""Fused sparse optimizers whose per-row state lives in the stored row, after the weights.

A tiered table's row is ``[weights (dim) | optimizer state (state_width(dim))]``, so the state
travels with the row through every tier and is never lost or mixed up on eviction. float16 and
bfloat16 rows are updated in float32 (the state kept in float32 inside the row, as
``metadata.row_width`` lays it out) and their weights rounded once per update: to nearest, or
stochastically (``stochastic_rounding=True``, as FBGEMM offers: ``rounding``). The
embedding modules reduce a batch's gradients to one row per distinct id and call ``update`` on
those rows where they live (the top cache tier) during ``backward``: there is no
``optimizer.step()`` for the embeddings, as with FBGEMM's and TorchRec's fused optimizers.

Each class is a small frozen dataclass of hyper-parameters, e.g. ``Adagrad(lr=0.01)``.
``update(table [R, dim + state], slots [U], grad [U, dim], step)`` updates the rows ``slots``
(distinct) of ``table`` in place: it gathers the rows, updates weights and state in place and
copies them back (on the CPU this beats ``index_add_``, which runs serially). ``step`` counts the
table's update steps from 1 (Adam's bias correction, Adagrad's ``lr_decay``). ``OPTIMIZERS`` maps
each optimizer's ``name`` (as the CLI and a module's ``state_dict`` spell it) to its class.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import torch

from .metadata import state_of
from .rounding import stochastically_rounded


@dataclasses.dataclass(frozen=True)
class SparseOptimizer(abc.ABC):
    """Base class: hyper-parameters, the state width a row needs and the row update."""

    name: ClassVar[str]
    lr: float
    # 16-bit rows' weights rounded stochastically (``rounding``) instead of to nearest; by keyword.
    stochastic_rounding: bool = dataclasses.field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.stochastic_rounding, bool):
            raise TypeError(f"stochastic_rounding must be True or False, got {self.stochastic_rounding!r}")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            values = value if isinstance(value, tuple) else (value,)
            if any(not isinstance(v, (int, float)) or v < 0 for v in values):
                raise ValueError(
                    f"{type(self).__name__}.{field.name} must be a non-negative number, got {value!r}"
                )

    @abc.abstractmethod
    def state_width(self, dim: int) -> int:
        """Optimizer-state values stored per row for weights of ``dim`` values."""

    def update(
        self,
        table: torch.Tensor,
        slots: torch.Tensor,
        grad: torch.Tensor,
        step: int,
        buffer: torch.Tensor | None = None,
        keys: torch.Tensor | None = None,
    ) -> None:
        """Apply ``grad [U, dim]`` (one row per id) to rows ``slots`` (int64 [U], distinct) of
        ``table [R, dim + state_width]``, weights and state, in place. ``buffer``: a reusable
        ``[>= U, R's width]`` tensor to gather the rows into (a fresh tensor per step costs
        more in page faults than the update itself). ``keys [U]``: the rows' ids, which
        ``stochastic_rounding`` of 16-bit rows draws by."""
        rows = (
            table.index_select(0, slots)
            if buffer is None
            else torch.index_select(table, 0, slots, out=buffer[: slots.numel()])
        )
        if rows.dtype in (torch.float16, torch.bfloat16):
            self._update_16_bit_rows(rows, grad, step, keys)
        else:
            self.update_rows(rows, grad, step)
        table.index_copy_(0, slots, rows)

    def _update_16_bit_rows(
        self, rows: torch.Tensor, grad: torch.Tensor, step: int, keys: torch.Tensor | None
    ) -> None:
        """``update_rows`` of 16-bit ``rows`` computed in float32: the weights widened, updated with
        the float32 ``grad`` and rounded once; the state read and written as stored (``state_of``:
        float32, or the rows' dtype in stores made before state was kept in float32)."""
        dim = grad.shape[1]
        state = state_of(rows, dim, self.state_width(dim))
        work = torch.cat([rows[:, :dim].float(), state.float()], dim=1)
        self.update_rows(work, grad.float(), step)
        if self.stochastic_rounding:
            if keys is None:
                raise ValueError("stochastic_rounding draws by the rows' ids: pass keys")
            rows[:, :dim] = stochastically_rounded(work[:, :dim], rows.dtype, keys, step)
        else:
            rows[:, :dim] = work[:, :dim]
        state.copy_(work[:, dim:])

    @abc.abstractmethod
    def update_rows(self, rows: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        """Apply ``grad [U, dim]`` to ``rows [U, dim + state_width]`` in place."""

    @abc.abstractmethod
    def kernel(self, step: int) -> tuple[str, tuple[float, ...], bool]:
        """The kernel (``tierstore/kernels``) doing ``update_rows``: ``(name, float arguments after
        dim, one thread per row rather than per element)``."""


@dataclasses.dataclass(frozen=True)
class SGD(SparseOptimizer):
    """``w -= lr * g`` (``torch.optim.SGD`` without momentum on a sparse gradient)."""

    name: ClassVar[str] = "sgd"

    lr: float = 0.01

    def state_width(self, dim: int) -> int:
        return 0

    def update_rows(self, rows: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        rows[:, : grad.shape[1]].sub_(grad, alpha=self.lr)

    def kernel(self, step: int) -> tuple[str, tuple[float, ...], bool]:
        return "update_sgd", (float(self.lr),), False


@dataclasses.dataclass(frozen=True)
class Adagrad(SparseOptimizer):
    """``torch.optim.Adagrad`` on a sparse gradient: ``s += g²; w -= lr_t * g / (sqrt(s) + eps)``
    with ``lr_t = lr / (1 + (step - 1) * lr_decay)``. State: ``s`` (dim values)."""

    name: ClassVar[str] = "adagrad"

    lr: float = 0.01
    eps: float = 1e-10
    lr_decay: float = 0.0

    def state_width(self, dim: int) -> int:
        return dim

    def update_rows(self, rows: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        dim = grad.shape[1]
        sum_squares = rows[:, dim:].addcmul_(grad, grad)
        lr = self.lr / (1 + (step - 1) * self.lr_decay)
        rows[:, :dim].addcdiv_(grad, sum_squares.sqrt().add_(self.eps), value=-lr)

    def kernel(self, step: int) -> tuple[str, tuple[float, ...], bool]:
        return "update_adagrad", (self.lr / (1 + (step - 1) * self.lr_decay), float(self.eps)), False


@dataclasses.dataclass(frozen=True)
class RowWiseAdagrad(SparseOptimizer):
    """FBGEMM's row-wise Adagrad (``EXACT_ROWWISE_ADAGRAD``): one accumulator per row,
    ``m += mean(g²); w -= lr * g / (sqrt(m) + eps)``. State: ``m`` (1 value)."""

    name: ClassVar[str] = "rowwise-adagrad"

    lr: float = 0.01
    eps: float = 1e-8

    def state_width(self, dim: int) -> int:
        return 1

    def update_rows(self, rows: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        dim = grad.shape[1]
        momentum = rows[:, dim:].add_((grad * grad).mean(dim=1, keepdim=True))
        rows[:, :dim].sub_(grad * (self.lr / (momentum.sqrt() + self.eps)))

    def kernel(self, step: int) -> tuple[str, tuple[float, ...], bool]:
        return "update_rowwise_adagrad", (float(self.lr), float(self.eps)), True


@dataclasses.dataclass(frozen=True)
class Adam(SparseOptimizer):
    """Lazy Adam with ``torch.optim.SparseAdam``'s semantics: only rows in the batch update their
    moments; bias correction uses the table's step count. State: ``m``, ``v`` (2 x dim values)."""

    name: ClassVar[str] = "adam"

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.betas) != 2 or not all(0 <= beta < 1 for beta in self.betas):
            raise ValueError(f"Adam.betas must be two numbers in [0, 1), got {self.betas!r}")

    def state_width(self, dim: int) -> int:
        return 2 * dim

    def update_rows(self, rows: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        dim = grad.shape[1]
        beta1, beta2 = self.betas
        exp_avg = rows[:, dim : 2 * dim].mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq = rows[:, 2 * dim :].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        rows[:, :dim].addcdiv_(exp_avg, exp_avg_sq.sqrt().add_(self.eps), value=-self._step_size(step))

    def _step_size(self, step: int) -> float:
        beta1, beta2 = self.betas
        return self.lr * (1 - beta2**step) ** 0.5 / (1 - beta1**step)

    def kernel(self, step: int) -> tuple[str, tuple[float, ...], bool]:
        beta1, beta2 = self.betas
        return (
            "update_adam",
            (float(beta1), 1.0 - beta1, float(beta2), 1.0 - beta2, float(self.eps), self._step_size(step)),
            False,
        )


OPTIMIZERS: dict[str, type[SparseOptimizer]] = {
    kind.name: kind for kind in (SGD, Adagrad, RowWiseAdagrad, Adam)
}


def optimizer_class(name: str) -> type[SparseOptimizer]:
    """The optimizer registered as ``name``, spelt with '-' or '_', in any case ("rowwise-adagrad",
    "rowwise_adagrad", "RowWiseAdagrad"); ``ValueError`` naming the known ones otherwise."""
    wanted = str(name).lower().replace("_", "-")
    for kind in OPTIMIZERS.values():
        if wanted in (kind.name, kind.__name__.lower()):
            return kind
    raise ValueError(f"unknown optimizer {name!r}; the optimizers are {', '.join(OPTIMIZERS)}")


def with_state_width(state_width: int, dim: int) -> list[str]:
    """Class names of the optimizers whose state is ``state_width`` values per row of ``dim`` weights."""
    return [kind.__name__ for kind in OPTIMIZERS.values() if kind().state_width(dim) == state_width]
