"""Fused sparse optimizers whose per-row state lives in the stored row, after the weights.

A tiered table's row is ``[weights (dim) | optimizer state (state_width(dim))]``, so the state
travels with the row through every tier and is never lost or mixed up on eviction. The
embedding modules reduce a batch's gradients to one row per distinct id and call ``update`` on
those rows where they live (the top cache tier) during ``backward``: there is no
``optimizer.step()`` for the embeddings, as with FBGEMM's and TorchRec's fused optimizers.

Each class is a small frozen dataclass of hyper-parameters, e.g. ``Adagrad(lr=0.01)``.
``update(rows [U, dim + state], grad [U, dim], step) -> rows`` (a new tensor); ``step`` counts the
table's update steps from 1 (Adam's bias correction, Adagrad's ``lr_decay``).
"""

from __future__ import annotations

import abc
import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class SparseOptimizer(abc.ABC):
    """Base class: hyper-parameters, the state width a row needs and the row update."""

    lr: float

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            values = value if isinstance(value, tuple) else (value,)
            if any(not isinstance(v, (int, float)) or v < 0 for v in values):
                raise ValueError(f"{type(self).__name__}.{field.name} must be a non-negative number, got {value!r}")

    @abc.abstractmethod
    def state_width(self, dim: int) -> int:
        """Optimizer-state values stored per row for weights of ``dim`` values."""

    @abc.abstractmethod
    def update(self, rows: torch.Tensor, grad: torch.Tensor, step: int) -> torch.Tensor:
        """New ``[U, dim + state_width]`` rows after applying ``grad [U, dim]`` (one row per id)."""


@dataclasses.dataclass(frozen=True)
class SGD(SparseOptimizer):
    """``w -= lr * g`` (``torch.optim.SGD`` without momentum on a sparse gradient)."""

    lr: float = 0.01

    def state_width(self, dim: int) -> int:
        return 0

    def update(self, rows: torch.Tensor, grad: torch.Tensor, step: int) -> torch.Tensor:
        return rows - self.lr * grad


@dataclasses.dataclass(frozen=True)
class Adagrad(SparseOptimizer):
    """``torch.optim.Adagrad`` on a sparse gradient: ``s += g²; w -= lr_t * g / (sqrt(s) + eps)``
    with ``lr_t = lr / (1 + (step - 1) * lr_decay)``. State: ``s`` (dim values)."""

    lr: float = 0.01
    eps: float = 1e-10
    lr_decay: float = 0.0

    def state_width(self, dim: int) -> int:
        return dim

    def update(self, rows: torch.Tensor, grad: torch.Tensor, step: int) -> torch.Tensor:
        dim = grad.shape[1]
        weights, sum_squares = rows[:, :dim], rows[:, dim:] + grad * grad
        lr = self.lr / (1 + (step - 1) * self.lr_decay)
        return torch.cat([weights - lr * grad / (sum_squares.sqrt() + self.eps), sum_squares], dim=1)


@dataclasses.dataclass(frozen=True)
class RowWiseAdagrad(SparseOptimizer):
    """FBGEMM's row-wise Adagrad (``EXACT_ROWWISE_ADAGRAD``): one accumulator per row,
    ``m += mean(g²); w -= lr * g / (sqrt(m) + eps)``. State: ``m`` (1 value)."""

    lr: float = 0.01
    eps: float = 1e-8

    def state_width(self, dim: int) -> int:
        return 1

    def update(self, rows: torch.Tensor, grad: torch.Tensor, step: int) -> torch.Tensor:
        dim = grad.shape[1]
        momentum = rows[:, dim:] + (grad * grad).mean(dim=1, keepdim=True)
        return torch.cat([rows[:, :dim] - self.lr / (momentum.sqrt() + self.eps) * grad, momentum], dim=1)


@dataclasses.dataclass(frozen=True)
class Adam(SparseOptimizer):
    """Lazy Adam with ``torch.optim.SparseAdam``'s semantics: only rows in the batch update their
    moments; bias correction uses the table's step count. State: ``m``, ``v`` (2 x dim values)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.betas) != 2 or not all(0 <= beta < 1 for beta in self.betas):
            raise ValueError(f"Adam.betas must be two numbers in [0, 1), got {self.betas!r}")

    def state_width(self, dim: int) -> int:
        return 2 * dim

    def update(self, rows: torch.Tensor, grad: torch.Tensor, step: int) -> torch.Tensor:
        dim = grad.shape[1]
        beta1, beta2 = self.betas
        exp_avg = rows[:, dim:2 * dim] * beta1 + (1 - beta1) * grad
        exp_avg_sq = rows[:, 2 * dim:] * beta2 + (1 - beta2) * grad * grad
        step_size = self.lr * (1 - beta2**step) ** 0.5 / (1 - beta1**step)
        weights = rows[:, :dim] - step_size * exp_avg / (exp_avg_sq.sqrt() + self.eps)
        return torch.cat([weights, exp_avg, exp_avg_sq], dim=1)
