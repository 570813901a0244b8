"""``FusedOptimizer``: the tables' fused sparse optimizers as a ``torch.optim.Optimizer``
(TorchRec's ``fused_optimizer()``), so a learning-rate schedule drives them as it drives a dense
optimizer.

A tiered table updates its rows during ``backward`` with its ``optimizer`` (a frozen dataclass of
hyper-parameters, ``tierstore.optim``). Here each table (a collection: each of its groups) is one
param group, holding its zero-element ``trainable`` parameter and those hyper-parameters; setting
one in a group (``group["lr"] = 0.1``, by hand or by a ``torch.optim.lr_scheduler``) replaces the
table's optimizer with one of that value, which its next update uses. ``step()`` does nothing:
the rows were updated in backward. ``state_dict()``/``load_state_dict()`` carry the values.
A module has one (``fused_optimizer_of``), so a schedule and a checkpoint see the same values;
it is not pickled or copied with the module (a copy makes its own).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

_ATTRIBUTE = "_fused_optimizer"  # where a module keeps its one FusedOptimizer


def fused_optimizer_of(module: Any, tables: list[Any]) -> FusedOptimizer:
    """``module``'s ``FusedOptimizer`` over ``tables``, made at the first call."""
    fused = module.__dict__.get(_ATTRIBUTE)
    if fused is None:
        fused = module.__dict__[_ATTRIBUTE] = FusedOptimizer(tables)
    return fused


def without_fused_optimizer(state: dict) -> dict:
    """A module's pickled ``state`` less its ``FusedOptimizer`` (a copy makes its own)."""
    return {name: value for name, value in state.items() if name != _ATTRIBUTE}


class FusedOptimizer(torch.optim.Optimizer):
    """Param groups over ``tables`` (tiered tables, each with ``trainable`` and ``optimizer``)."""

    def __init__(self, tables: list[Any]) -> None:
        self._tables = list(tables)
        groups = [
            {"params": [table.trainable], **dataclasses.asdict(table.optimizer)} for table in self._tables
        ]
        super().__init__(groups, defaults={})
        self._link()

    def step(self, closure=None):
        """Nothing to do: each table applied its update in backward. Returns ``closure()`` if given."""
        return None if closure is None else closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for table in self._tables:
            table.trainable.grad = None

    def state_dict(self) -> dict:
        for table, group in zip(self._tables, self.param_groups):  # an optimizer set on a table by hand
            dict.update(group, dataclasses.asdict(table.optimizer))
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if "_tables" in self.__dict__:
            self._link()

    def _link(self) -> None:
        """Each group as a ``_TableGroup`` of its table, whose values the table's optimizer takes."""
        self.param_groups = [
            _TableGroup(table, group) for table, group in zip(self._tables, self.param_groups)
        ]
        for group in self.param_groups:
            group.apply()


class _TableGroup(dict):
    """A param group whose hyper-parameters, when set, replace its table's optimizer."""

    def __init__(self, table: Any, group: dict) -> None:
        super().__init__(group)
        self.table = table

    def __setitem__(self, key: str, value: Any) -> None:
        if key in dataclasses.asdict(self.table.optimizer):  # checked first: a bad value changes nothing
            self.table.optimizer = dataclasses.replace(self.table.optimizer, **{key: _plain(value)})
        super().__setitem__(key, value)

    def apply(self) -> None:
        """The table's optimizer with this group's values (raises, naming the field, on a bad one)."""
        optimizer = self.table.optimizer
        values = {name: _plain(self[name]) for name in dataclasses.asdict(optimizer) if name in self}
        if values != dataclasses.asdict(optimizer):
            self.table.optimizer = dataclasses.replace(optimizer, **values)

    def __reduce__(self):
        return dict, (dict(self),)  # pickled and copied as the plain group it is


def _plain(value: Any) -> Any:
    """A hyper-parameter as the optimizer dataclasses take it: tensors (a scheduler's) as floats,
    lists (a state_dict's betas) as tuples."""
    if isinstance(value, torch.Tensor):
        return float(value)
    return tuple(value) if isinstance(value, list) else value
