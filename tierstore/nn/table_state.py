"""``TableState``: a tiered table's store life cycle and state (flush, close, checkpoints, its
``state_dict`` entries and pickling), for ``tiered_table._TieredTable``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import CheckpointWriting
from ..store import TieredStore
from .fused_optimizer import without_fused_optimizer
from .table_checkpoints import restore_checkpoint, write_checkpoint
from .table_rows import TableRows

_STATE_FORMAT = "tierstore-table/1"


class TableState:
    """The store and state methods of ``_TieredTable`` (an ``nn.Module``: ``super()`` is torch's)."""

    def flush(self) -> None:
        """Make every update so far durable in the store (atomic; see ``TieredStore.flush``).
        Sharded, every rank must call it: each commits its store, then learns whether all did."""
        if self.sharding is None:
            self.store.flush()
        else:
            self.sharding.flush(self.store, self.step)

    def checkpoint(self, path: str | Path, background: bool = False) -> CheckpointWriting:
        """Write every row, its optimizer state and the step count as of now (a flush) to the new
        directory ``path``: training may go on while a ``background`` one is written (``wait()`` on
        the returned handle gives its path; a program that ends meanwhile exits once it is
        complete). Sharded, every rank calls it (each writes its own part).
        ``restore(path)`` brings the table back to that moment; see ``tierstore.checkpoint``."""
        return write_checkpoint(path, {None: self}, self.sharding, background)

    def restore(self, path: str | Path) -> None:
        """Give the table exactly the rows, optimizer state and step count of the checkpoint at
        ``path``: rows added since are removed, updates since are undone (the store's rows are
        replaced in one step: a crash leaves the old ones or the restored ones)."""
        restore_checkpoint(path, {None: self}, self.sharding)

    def close(self) -> None:
        """Flush and close the store (a temporary store is deleted); sharded, on every rank."""
        if self.sharding is None:
            self.store.close()
        elif not self.store.closed:
            self.flush()
            self.sharding.together("close", self.store.close)

    def _checked(self, check, *args):
        """``check(*args)``; sharded, a refusal is first told to the other ranks (they raise too)."""
        try:
            return check(*args)
        except Exception as error:
            if self.sharding is None:
                raise
            self.sharding.refuse(error)

    def __getstate__(self) -> dict:
        return without_fused_optimizer(super().__getstate__())

    def __setstate__(self, state: dict) -> None:
        frozen = state.pop("frozen", False)  # pickled before ``trainable``, frozen was a flag
        super().__setstate__(state)
        if "trainable" not in self._parameters:
            self.trainable = nn.Parameter(torch.empty(0, device=self._output_like.device), not frozen)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)  # its extra state flushes
        del destination[prefix + "trainable"]  # a switch, not a weight: state_dicts hold no tensor of it
        if not self.store.read_only:
            destination[prefix + self._rows_key()] = TableRows(self.store, self.store.snapshot())

    def _rows_key(self) -> str:
        """The state dict's key of the table's rows (``TableRows``); a sharded table's rank has its own."""
        if self.sharding is None:
            return "rows"
        return f"rows.rank{self.sharding.rank}-of-{self.sharding.world_size}"

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        extra = state_dict.get(prefix + "_extra_state")
        rows = state_dict.get(prefix + self._rows_key())
        try:
            if extra is not None:
                self._check_extra_state(extra)  # before the rows change
            batches = rows.rows_for(self.store) if isinstance(rows, TableRows) else None
        except BaseException:
            if isinstance(rows, TableRows):
                rows.discard_received()
            raise
        if batches is not None:
            self.store.replace_rows(batches)
        self._rows_given = batches is not None  # (read by set_extra_state)
        try:
            super()._load_from_state_dict(
                state_dict, prefix, local_metadata, strict, missing, unexpected, errors
            )
        finally:
            self._rows_given = False
        for key in (prefix + "trainable", prefix + self._rows_key()):
            for keys in (missing, unexpected):
                if key in keys:
                    keys.remove(key)

    def get_extra_state(self) -> dict:
        """The table's ``_extra_state`` in ``state_dict()``: the store's location and layout, the
        optimizer and its step count. Its rows as of the call are the ``rows`` entry (``TableRows``:
        a snapshot, read by ``torch.distributed.checkpoint`` or ``load_state_dict``). A state dict
        without it (pickled: ``torch.save(model.state_dict())``) names the store: reloaded into a
        module on the same store it resumes it; on another store it copies the rows over as they
        are now, streaming. A temporary store is deleted on ``close()``: give ``path=`` to keep one."""
        if not self.store.read_only:
            self.flush()
        return {
            "format": _STATE_FORMAT,
            "path": str(self.store.path.resolve()),
            "dim": self.embedding_dim,
            "dtype": str(self.store.dtype),
            "optimizer": self.optimizer.name,
            "optimizer_state_width": self.store.metadata.optimizer_state_width,
            "step": self.step,
        }

    def _check_extra_state(self, state: Any) -> dict:
        """This table's own extra state, once ``state`` is found to describe a table like it."""
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise ValueError(f"not a tierstore table state (expected format {_STATE_FORMAT!r}): {state!r}")
        mine = self.get_extra_state()
        for key in ("dim", "dtype", "optimizer", "optimizer_state_width"):
            if state[key] != mine[key]:
                raise ValueError(f"state_dict {key} is {state[key]!r} but this module's is {mine[key]!r}")
        return mine

    def set_extra_state(self, state: Any) -> None:
        mine = self._check_extra_state(state)
        if self.__dict__.get("_rows_given"):  # the state dict's rows replaced the table's
            pass
        elif Path(state["path"]) != Path(mine["path"]):  # a copy of the rows, as they are
            source = TieredStore.open_here(state["path"])
            if source is not None:
                self.store.copy_rows_from(source)
            else:
                with TieredStore(state["path"], read_only=True, host_cache=1) as source:
                    self.store.copy_rows_from(source)
        self.step = int(state["step"])
