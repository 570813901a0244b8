"""A store's rows copied, snapshot and replaced, and the store pickled (``TieredStore``'s part)."""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from .directories import exchange
from .locking import serialized
from .metadata import create_store
from .snapshot import StoreSnapshot
from .tiers.build import open_cold
from .validation import as_ids

if TYPE_CHECKING:
    from .store import TieredStore


class StoreCopies:
    """``TieredStore``'s copies: ``copy`` and ``deepcopy``, ``snapshot``, ``replace_rows``, pickling."""

    def copy(self) -> TieredStore:
        """A new temporary store with this one's layout, settings and rows as of now (flushed
        first), written straight to its cold tier; the two are independent afterwards."""
        self._check_open()
        if not self.read_only:
            self.flush()
        layout = self.metadata
        twin = type(self)(
            None,
            layout.dim,
            layout.torch_dtype,
            layout.backend,
            device=self.device,
            optimizer_state_width=layout.optimizer_state_width,
            optimizer=layout.optimizer,
            seed=layout.seed,
            tiers=self.config,
        )
        twin.copy_rows_from(self)
        return twin

    def copy_rows_from(self, source: TieredStore) -> None:
        """Load every row of ``source`` (same layout), newest values, as they are (``load``)."""
        for ids, rows in source.iter_rows(batch_size=1 << 18, with_state=True):  # a commit per batch
            self.load(ids, rows, allow_nonfinite=True)

    @serialized
    def snapshot(self) -> StoreSnapshot:
        """The table's rows as of now (a flush first), read later or from another thread while the
        store goes on being trained; close it when read (see ``tierstore.snapshot``)."""
        self._check_writable("take a snapshot")
        self.flush()
        snapshot = StoreSnapshot(self.metadata, self.stack.cold.snapshot())
        self._snapshots.add(snapshot)
        return snapshot

    @serialized
    def replace_rows(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Make the table hold exactly the rows of ``batches`` (``(ids [n], whole rows [n,
        row_width])``, each id once) and nothing else, updates since the last flush dropped: a
        checkpoint restored. The rows are written to a new store beside this one, which then takes
        its place in one step (``directories.exchange``): a crash at any moment leaves the old rows
        or the new ones, whole. Cached rows are dropped; open snapshots are closed."""
        self._check_writable("replace its rows")
        pinned = sum(cache.pinned_count() for cache in self.stack.caches)
        if pinned:
            raise RuntimeError(
                f"{pinned} rows are pinned for batches in flight (a lookahead pipeline): finish or close "
                f"it before replacing the table's rows"
            )
        staging = self.path.with_name(f".{self.path.name}.replacing-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)  # left by a replacement this process did not finish
        create_store(staging, self.metadata)
        closed = False
        try:
            cold = open_cold(staging, self.metadata, self.config, read_only=False, new=True)
            try:
                for ids, rows in batches:
                    ids = as_ids(ids)
                    rows = self._checked_rows(ids, rows, allow_nonfinite=True)
                    if cold.can_bulk_load():  # written once, straight to their place (mmap)
                        cold.bulk_load(ids, rows)
                    else:  # a commit per batch: the staging log (and LMDB's index of it) stays small
                        cold.put(ids, rows)
                        cold.flush()
                cold.flush()
            finally:
                cold.close()
            for snapshot in list(self._snapshots):
                snapshot.close()
            self.stack.cold.close()
            closed = True
            exchange(staging, self.path)
        except BaseException:
            if closed:
                self.stack.cold = open_cold(self.path, self.metadata, self.config, False, False)
            shutil.rmtree(staging, ignore_errors=True)
            raise
        shutil.rmtree(staging, ignore_errors=True)  # the old rows
        for cache in self.stack.caches:
            cache.clear()
        self.stack.cold = open_cold(self.path, self.metadata, self.config, read_only=False, new=False)
        if self._expiry is not None:  # its records went with the old rows: the next flush records anew
            self._expiry.close()
            self._expiry = self._open_expiry()

    def compact(self) -> None:
        """Rewrite the table's files holding only its rows (flushed first): the space of removed ids
        (``remove``, expiry) is given back, which the mmap backend otherwise keeps. As
        ``replace_rows``: one step, a crash leaves the old files or the new."""
        self._check_writable("compact it")
        self.flush()
        self.replace_rows(self.iter_rows(batch_size=1 << 16, with_state=True))

    def __deepcopy__(self, memo: dict) -> TieredStore:
        return self.copy()

    def __getstate__(self) -> dict:
        """Pickling records where the store is and how it is opened, not its rows (flushed first);
        unpickling reopens it. A temporary store has no lasting place, so it is refused."""
        if self._temporary:
            raise pickle.PicklingError(
                f"a temporary store ({self.path}) cannot be pickled by reference: it is deleted when "
                "closed or collected. Give the table a path= to keep it, or copy.deepcopy it for a copy "
                "in this process"
            )
        self._check_open()
        if not self.read_only:
            self.flush()
        backend_names = {
            name: getattr(value, "name", value)
            for name, value in (
                ("host_cache_backend", self.config.host_cache_backend),
                ("device_cache_backend", self.config.device_cache_backend),
            )
        }
        expiry = self.expiry
        return {
            "path": str(self.path.resolve()),
            "device": str(self.device),
            "read_only": self.read_only,
            "tiers": dataclasses.replace(self.config, **backend_names),
            "ttl": None if expiry is None else expiry.ttl,
            "max_rows": None if expiry is None else expiry.max_rows,
        }

    def __setstate__(self, state: dict) -> None:
        self.__init__(
            state["path"],
            device=state["device"],
            read_only=state["read_only"],
            tiers=state["tiers"],
            ttl=state.get("ttl"),
            max_rows=state.get("max_rows"),
        )
