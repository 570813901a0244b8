"""The tier contract: what a cache tier and the cold tier promise the store, which moves rows
between tiers through these methods only.

Every method works on a batch of keys (int64 ``[N]``) or slots (int64 ``[N]``, positions in a
cache tier's row buffer); no method takes one key at a time. A row is ``[weights (dim) | optimizer
state]`` of ``row_width`` values. Tiers are exclusive: a key lives in at most one cache tier, and a
cached row is newer than (``dirty``) or equal to the cold store's copy, if that has one.
Each tier counts its own lookups and moves (``stats``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

import torch

from ..errors import CacheCapacityError


def too_many_distinct(tier_name: str, capacity: int, count: int) -> CacheCapacityError:
    """The error of a batch of ``count`` distinct ids for a top tier of ``capacity`` rows."""
    return CacheCapacityError(
        f"this batch has {count} distinct ids but the top cache tier ({tier_name}) holds "
        f"{capacity} rows; raise {tier_name}_cache or split the batch"
    )


@dataclasses.dataclass
class Rows:
    """A batch of rows in flight between tiers, with the flags that travel with them."""

    keys: torch.Tensor  # int64 [N]
    rows: torch.Tensor  # [N, row_width]
    dirty: torch.Tensor  # bool [N]: newer than the tier below
    fresh: torch.Tensor  # bool [N]: never written to the cold store (a key nobody else counts)

    def __len__(self) -> int:
        return self.keys.numel()

    def select(self, mask: torch.Tensor | slice) -> Rows:
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and bool(mask.all()):
            return self
        return Rows(self.keys[mask], self.rows[mask], self.dirty[mask], self.fresh[mask])

    def to(self, device: torch.device) -> Rows:
        return Rows(*(tensor.to(device) for tensor in dataclasses.astuple(self)))

    @staticmethod
    def concat(parts: list[Rows]) -> Rows:
        return Rows(
            *(torch.cat([getattr(part, field.name) for part in parts]) for field in dataclasses.fields(Rows))
        )

    @staticmethod
    def merge(mask: torch.Tensor, where_true: Rows, where_false: Rows) -> Rows:
        """Rows in one order: ``where_true`` where ``mask [N]`` is set, else ``where_false``. Each
        field goes to the accelerator where either part has it there (rows travel up the tiers)."""
        merged = []
        for field in dataclasses.fields(Rows):
            first, second = getattr(where_true, field.name), getattr(where_false, field.name)
            device = first.device if first.device.type != "cpu" else second.device
            out = torch.empty((mask.numel(), *first.shape[1:]), dtype=first.dtype, device=device)
            out[mask.to(out.device)] = first.to(out.device)
            out[(~mask).to(out.device)] = second.to(out.device)
            merged.append(out)
        return Rows(*merged)


@dataclasses.dataclass
class TierStats:
    """Counters of one cache tier. ``hits``/``misses`` count id lookups (a repeated id counts each
    time); ``rows_in``, ``evictions`` and ``writebacks`` (dirty evictions) count rows."""

    hits: int = 0
    misses: int = 0
    rows_in: int = 0
    evictions: int = 0
    writebacks: int = 0

    def count_lookups(self, found: torch.Tensor, counts: torch.Tensor | None) -> None:
        """Add the lookups of keys ``found`` (bool [N]) or not, each looked up ``counts [N]`` times
        (default once)."""
        found = found.cpu()
        if counts is None:
            hits = int(found.sum())
            self.hits, self.misses = self.hits + hits, self.misses + found.numel() - hits
        else:
            counts = counts.cpu()
            self.hits += int(counts[found].sum())
            self.misses += int(counts[~found].sum())


@dataclasses.dataclass
class ColdStats:
    """Counters of the cold tier: lookups it served (``hits``), lookups of ids it has never held
    (``initialized``: the store gives them their initial row), rows read and written, and ids
    removed (``TieredStore.remove``, expiry)."""

    hits: int = 0
    initialized: int = 0
    rows_read: int = 0
    rows_written: int = 0
    rows_removed: int = 0


@runtime_checkable
class CacheTier(Protocol):
    """Row slots on one device (``capacity`` rows now, growing up to ``max_capacity`` as rows come
    in, ``make_room``), write-back, with an eviction policy. ``RowCache`` is the one
    implementation; its backend and policy are values."""

    name: str  # "device" or "host"
    capacity: int  # rows
    max_capacity: int  # rows it may grow to (its budget's)
    device: torch.device
    stats: TierStats

    backend: object  # the backend value (``tiers.backends``); ``backend.name``: "cuda", "openmp", "torch"

    @property
    def kernels(self): ...  # the kernel build its backend runs on, None for torch ops

    @property
    def nbytes(self) -> int: ...  # every byte the tier allocates

    def __len__(self) -> int: ...  # rows held

    def make_room(self, keys: torch.Tensor) -> None:
        """Grow, up to ``max_capacity``, where the rows of distinct ``keys`` not resident would not
        fit in the free slots (a tier evicts only once it is full)."""

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Slot of each key (int64 [N]), -1 where absent. Counts nothing."""

    def touch(
        self, slots: torch.Tensor, counts: torch.Tensor | None = None, missed: torch.Tensor | None = None
    ) -> None:
        """Record ``counts [N]`` (default one each) lookups of the rows at ``slots [N]`` (distinct when
        ``counts`` is given): the policy's access record and the tier's hit/miss counters;
        ``missed`` (bool [N]) marks rows admitted for these lookups (misses)."""

    def resolve(
        self, keys: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
        """``find`` and ``touch`` of distinct ``keys`` in one pass where the tier has one: ``(slots,
        hit_slots, missed, lookups)`` (the misses' positions; every lookup counted), the hits
        touched; then ``touch_admitted`` counts the misses once resident. None: use ``find`` and
        ``touch``."""

    def touch_admitted(self, slots: torch.Tensor, counts: torch.Tensor, lookups: int) -> None:
        """After ``resolve``: the missed keys' lookups (``counts``), now at ``slots``, recorded;
        ``lookups``: the resolve's."""

    def native_arrays(self):
        """The tier's arrays as the host build's native admission takes them
        (``kernels.native_types.HostTierArrays``), None where the tier has no such admission."""

    def native_choice(self, room: int):
        """``(a kernels.native_types.TierChoice, the tensors behind it)``: how the tier's free slots and
        its policy's victims are taken by a native call making up to ``room`` rows resident."""

    def settle_native(self, done, held) -> None:
        """After that native call (``done``: its ``kernels.native_types.Residency``; ``held``:
        ``native_choice``'s tensors): its lookups and the policy's change recorded and, where the
        rows came in, the slots taken and the counters moved. Raises ``CacheCapacityError`` as
        ``admit`` does."""

    def read(
        self, slots: torch.Tensor, columns: int | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[N, columns]`` copy of the first ``columns`` (default all) values of rows at ``slots``."""

    def write(self, slots: torch.Tensor, values: torch.Tensor, columns: int | None = None) -> None:
        """Overwrite the first ``columns`` of rows at ``slots`` (distinct) with ``values``; marks them
        dirty."""

    def apply_optimizer(self, optimizer, slots: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        """Fused optimizer step on rows at ``slots`` (distinct) with ``grad [N, dim]``; marks them dirty."""

    def admit(
        self,
        incoming: Rows,
        protected: torch.Tensor | None = None,
        before_evicting: Callable[[Rows], None] | None = None,
    ) -> tuple[torch.Tensor, Rows]:
        """Cache ``incoming`` (keys distinct, absent); returns ``(their slots [N], evicted Rows)``.
        Victims are the policy's choice outside ``protected`` slots; every evicted row is handed
        back (dirty or not), never dropped: first to ``before_evicting`` while it is still here,
        which moves it down; if that raises, the tier is left as it was. Raises
        ``CacheCapacityError``, changing nothing, when the rows cannot fit."""

    def take(self, keys: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, Rows]:
        """Remove the cached ones of ``keys`` (distinct), counting ``counts`` lookups of each;
        returns ``(found bool [N] on CPU, their Rows in key order)``."""

    def holds(self, slots: torch.Tensor, keys: torch.Tensor) -> bool:
        """Whether ``slots [N]`` still hold ``keys [N]``."""

    def pin(self, slots: torch.Tensor) -> None:
        """Keep the rows at ``slots`` (distinct) from eviction until as many ``unpin``s."""

    def pinned_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Which of ``keys`` (int64 CPU) the tier holds pinned (int64 CPU)."""
        ...

    def unpin(self, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Undo a ``pin`` of ``slots`` where they still hold ``keys``."""

    def clear(self) -> None:
        """Drop every cached row, counting nothing (a read-only store's rows, all clean)."""

    def dirty_rows(self, batch_size: int) -> Iterator[tuple[torch.Tensor, Rows]]:
        """Slots and Rows of every dirty row, ``batch_size`` rows at a time (a flush's memory stays
        bounded whatever the tier's size)."""

    def dirty_keys(self) -> torch.Tensor:
        """The ids (int64 CPU) of the dirty rows."""
        ...

    def mark_clean(self, slots: torch.Tensor) -> None:
        """The rows at ``slots`` reached the cold store: neither dirty nor fresh now."""

    def fresh_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """bool [N]: which ``keys`` are cached here and were never written to the cold store."""

    def fresh_count(self) -> int:
        """Cached rows never written to the cold store."""

    def iter_fresh(
        self, batch_size: int, columns: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every ``(keys [n], rows [n, columns])`` cached here and never written to the cold store."""

    def report(self) -> dict:
        """``stats`` with capacity, residency, memory, device and backend, as plain values."""
