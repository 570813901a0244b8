"""``DirectLayout``: the rows of a tier's bounded tables addressed directly, without hashing.

A store holds the keys ``number << 47 | id`` of its tables (a lone table is number 0). A host tier
given a layout gives each id of the tables it covers a home slot, ``bases[number] + id``: a miss is
placed at its home where that slot is free, and a lookup finds a key at its home by reading one
slot's key (``host_cache.cpp``'s ``slot_of``), where the index would take a hashed probe. The index
stays the truth for every key: a key away from its home (its home was taken while it was out, or
its table has none) is found through it, so a layout changes where rows live and how fast they are
found, never what is found. In a tier that grows on demand, a home past its slots counts as none
until it has grown past it (the native calls take the tier's slots now).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

ID_BITS = 47  # a key's id below, its table's number above (nn.jagged_batch's)
BYTES_PER_SLOT = 4  # each free slot's place in the free stack (int32)


@dataclasses.dataclass(frozen=True)
class DirectLayout:
    """``bases`` and ``sizes`` (int64 [tables]): table ``number``'s ids below ``sizes[number]`` have the
    home slots ``bases[number] + id`` (size 0: the table has none)."""

    bases: torch.Tensor
    sizes: torch.Tensor

    @property
    def rows(self) -> int:
        """Slots the homes take."""
        return int(self.sizes.sum())

    @classmethod
    def choose(cls, table_rows: Sequence[int | None], capacity: int) -> DirectLayout | None:
        """The layout for a tier of ``capacity`` slots holding tables of ``table_rows`` (by number;
        None: the table grows on demand and has no homes): every table where they are all bounded
        and fit, else the smallest (most lookups per row, in click logs) while their homes take at
        most half the slots, leaving the rest to the other tables' rows (an unbounded table's
        among them). None where no table gets homes."""
        bounded = sorted((rows, number) for number, rows in enumerate(table_rows) if rows)
        if None in table_rows or sum(rows for rows, _ in bounded) > capacity:
            chosen, total = [], 0
            for rows, number in bounded:
                if total + rows > capacity // 2:
                    break
                chosen.append(number)
                total += rows
        else:
            chosen = [number for _, number in bounded]
        if not chosen:
            return None
        sizes = torch.zeros(len(table_rows), dtype=torch.int64)
        bases = torch.zeros(len(table_rows), dtype=torch.int64)
        base = 0
        for number in sorted(chosen):
            bases[number], sizes[number] = base, table_rows[number]
            base += table_rows[number]
        return cls(bases, sizes)

    def homes(self, keys: torch.Tensor) -> torch.Tensor:
        """Each of ``keys``' (int64) home slot, -1 where it has none."""
        numbers = keys >> ID_BITS
        ids = keys & ((1 << ID_BITS) - 1)
        known = (numbers >= 0) & (numbers < self.sizes.numel())
        numbers = numbers.clamp(0, self.sizes.numel() - 1)
        has_home = known & (ids < self.sizes[numbers])
        return torch.where(has_home, self.bases[numbers] + ids, -1)
