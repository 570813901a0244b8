"""The ids-only horizon of a lookahead pipeline: each row's next use, far ahead, kept for eviction.

Belady's MIN evicts the row whose next use is farthest away; its gains come from reuse distances
far longer than a pinned window of a few batches. Ids are 8 bytes, so the pipeline reads the ids
of batches up to ``accesses`` row lookups ahead (a batch counting its distinct ids per store)
while it moves and pins rows for only the short window.

``Foresight`` (one per store) keeps, for the batches in the horizon, each entry's next use (the
next batch holding the same id, ``NEVER`` if none within the horizon), linked as batches enter:
an id's latest entry is found in a hash map and given the new batch as its next use. A resident
row whose id has a next use in the horizon is pinned in the top tier (one pin of the horizon's);
a row with none is not, so victims come first from rows not used within the horizon, by the
tier's own policy (LFU with ageing). The horizon's pins are capped at what leaves room for the
next batch (its rows no one pins: its misses), the rows a pinned window holds that the horizon
does not pin (a row both pin takes one slot), and, while a window pins a batch, that batch's:
past the cap, the pinned rows whose next use is farthest are unpinned (a slack's worth more, so
that this happens every few batches, not at each; never a row a window pins too, whose slot
stays taken), and they become victims like the rest. A row moves only where the store moves it,
so training is the same, bit for bit, with or without the horizon.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import torch

from .budget import horizon_accesses
from .kernels.cache_passes import cache_passes_of
from .kernels.horizon_passes import horizon_passes_of, horizon_tier
from .tiers.hash_index import HashIndex

NEVER = torch.iinfo(torch.int32).max  # a next use (a batch number, int32) of none
SLACK_SHARE = 1 / 64  # of the top tier's capacity: pins dropped beyond the cap, so caps are rare


class Foresight:
    """The horizon of one store (``TieredStore``): ``enter`` each batch's distinct ids (int64)
    when the pipeline reads it, ``consume`` after the loop has run it (in the same order), and
    ``pin_window`` where a window pins a batch (the rows it pins beside the horizon's counted in
    ``window_slots``). Thread-safe."""

    def __init__(self, store: Any, horizon: int | str) -> None:
        self.store = store
        top = store.stack.top
        self.capacity = top.max_capacity  # a tier that grows on demand is planned for its budget
        self.accesses = horizon_accesses(horizon, top.max_capacity)
        self.ahead = 0  # row lookups of the batches entered and not yet consumed
        self.largest = 0  # most distinct ids a batch had
        self.protected = 0  # rows the horizon pins now
        self.unpinned_far = 0  # pins dropped by the cap (rows whose next use was farthest)
        self._need = None  # rows the next batch brings in (None: not known yet, its largest)
        self.window_slots: Callable[[], int] = lambda: 0  # slots a pinned window holds beside these pins
        self._pinning = 0  # slots the batch a window is pinning takes (while it does)
        self._lock = threading.Lock()
        self._batches: collections.deque = collections.deque()  # (keys, first code)
        self._next_code = 0  # entry numbers: an entry's next use lives at code % ring size
        self._next_use = torch.full((1024,), NEVER, dtype=torch.int32)
        self._entry_slot = torch.full((1024,), -1, dtype=torch.int32)  # native: entries' slot hints
        # the tuned host build's calls where the top tier runs on it, else torch ops
        self._passes = horizon_passes_of(top.kernels) if top.index.keys.dim() == 1 else None
        if self._passes is None:
            self._latest = HashIndex(1024)  # id -> the code of its latest entry in the horizon
        else:  # the same map, probed natively: keys (EMPTY_KEY where free) beside codes
            self._map_keys = torch.full((2048,), -1, dtype=torch.int64)
            self._map_codes = torch.zeros(2048, dtype=torch.int64)
            self._map_live = 0
        self._sequence = 0  # number of the next batch to enter
        self._ids_bytes = 0  # of the batches' ids it holds
        self._scratch = None  # the native cap's slots (int32 [capacity]), made at its first use
        self._pinned_key = torch.full((self.capacity,), -1, dtype=torch.int64, device=top.device)
        self._pinned_next = torch.full((self.capacity,), NEVER, dtype=torch.int32, device=top.device)

    @property
    def nbytes(self) -> int:
        """Memory the horizon holds (its batches' ids, next uses, map and per-slot arrays)."""
        return self._nbytes_with(0)

    def wants_more(self) -> bool:
        """Whether the horizon spans fewer lookups than it should and, where the store's budget
        holds its memory (``TierConfig.horizon``), one more batch as large as the largest yet
        would stay within it."""
        budget = self.store.stack.top.horizon_budget
        return self.ahead < self.accesses and (budget is None or self._nbytes_with(self.largest) <= budget)

    def _nbytes_with(self, count: int) -> int:
        """Memory the horizon would hold with a batch of ``count`` ids more (its arrays grown)."""
        ring = self._next_use.numel()
        while self.ahead + count > ring:  # the ring's live entries are the lookups ahead
            ring *= 2
        if self._passes is None:
            map_bytes = self._latest.keys.nbytes + self._latest.values.nbytes
        else:
            positions, wanted = self._map_keys.numel(), self._map_live + count
            if 2 * wanted > positions:
                positions = 1 << (2 * wanted - 1).bit_length()
            map_bytes = positions * (self._map_keys.element_size() + self._map_codes.element_size())
        ids = self._ids_bytes + count * 8
        slots = self._pinned_key.nbytes + self._pinned_next.nbytes
        entries = self._next_use.element_size()
        if self._passes is not None:  # the cap's scratch, and each entry's slot hint
            slots += 4 * self.capacity
            entries += self._entry_slot.element_size()
        return ids + ring * entries + map_bytes + slots

    def enter(self, keys: torch.Tensor) -> None:
        """The next batch read ahead looks up distinct ``keys`` (int64 CPU)."""
        keys = keys.reshape(-1).to(torch.int64).contiguous()
        with self._lock:
            count = keys.numel()
            sequence = self._sequence
            if sequence == NEVER:
                raise OverflowError(f"a horizon numbers its batches in int32: {NEVER:,} batches entered")
            self._sequence += 1
            self.ahead += count
            self.largest = max(self.largest, count)
            self._grow_ring(count)
            enter = self._enter_natively if self._passes is not None else self._enter_with_torch
            enter(keys, sequence)

    def consume(self) -> None:
        """The oldest batch entered has run: its rows' next uses move on to their next entries."""
        with self._lock:
            keys, first_code = self._batches.popleft()
            self._ids_bytes -= keys.nbytes
            self.ahead -= keys.numel()
            consume = self._consume_natively if self._passes is not None else self._consume_with_torch
            consume(keys, first_code)

    def _next_needs(self, top) -> int:
        """Slots the next batch in the horizon needs beyond the pinned ones: its misses, and its
        hits on rows no one pins (the cap unpinned them; a window counts the rows it pins)."""
        return _needs(top, self._batches[0][0]) if self._batches else self.largest

    def pin_window(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """A window's ``store.pin_rows(keys)`` (distinct int64), the farthest of the horizon's pins
        dropped first where the batch's slots (its rows pinned by no one) would not fit beside them
        and the next batch's; in one hold of the store's lock, so no other pass comes between.
        Returns ``pin_rows``' ``(keys, slots, rows moved up)`` and how many of those rows the
        horizon does not pin (the window's to count in ``window_slots``)."""
        with self._lock:

            def pin(top) -> tuple[torch.Tensor, torch.Tensor, int, int]:
                self._pinning = _needs(top, keys)
                while self._cap(top):  # it may have dropped pins of this batch's rows
                    needs = _needs(top, keys)
                    if needs <= self._pinning:
                        break
                    self._pinning = needs
                self._pinning = 0
                held, slots, moved = self.store.pin_rows(keys)
                unheld = int((~self._held(top, slots, held.to(top.device))).sum())
                return held, slots, moved, unheld

            pinned = self.store.with_top_tier(pin)
        return (*self.store.pin_rows(keys), keys.numel()) if pinned is None else pinned  # closed: raises

    def release(self) -> None:
        """Unpin every row the horizon pinned (the pipeline stops)."""
        with self._lock:

            def unpin_all(top) -> None:
                mine = self._mine(top)
                slots = mine.nonzero().squeeze(1)
                top.unpin(slots, self._pinned_key[slots])
                self._pinned_key.fill_(-1)

            self.store.with_top_tier(unpin_all)
            self.protected = 0

    # -- under the lock ------------------------------------------------------------------------

    def _links(self) -> tuple[torch.Tensor, ...]:
        return self._map_keys, self._map_codes, self._next_use, self._entry_slot

    def _enter_with_torch(self, keys: torch.Tensor, sequence: int) -> None:
        count = keys.numel()
        codes = self._next_code + torch.arange(count, dtype=torch.int64)
        self._next_code += count
        self._next_use[codes % self._next_use.numel()] = NEVER
        positions = self._latest.positions(keys)
        seen = positions >= 0
        flat = self._latest.values.view(-1)
        earlier = flat[positions[seen]]
        self._next_use[earlier % self._next_use.numel()] = sequence  # their next use: this batch
        flat[positions[seen]] = codes[seen]
        first = keys[~seen]
        self._latest.insert(first, codes[~seen])
        self._batches.append((keys, int(codes[0]) if count else self._next_code))
        self._ids_bytes += keys.nbytes

        def pin_new(top) -> None:  # ids new to the horizon: a resident row now has a next use
            self._pin(top, first, torch.full_like(first, sequence))
            self._cap(top)

        self.store.with_top_tier(pin_new)

    def _consume_with_torch(self, keys: torch.Tensor, first_code: int) -> None:
        codes = first_code + torch.arange(keys.numel(), dtype=torch.int64)
        following = self._next_use[codes % self._next_use.numel()]
        last = following == NEVER
        self._latest.remove(keys[last])

        def move_on(top) -> None:
            self._unpin(top, keys[last])
            self._pin(top, keys[~last], following[~last])
            self._need = self._next_needs(top)
            self._cap(top)

        self.store.with_top_tier(move_on)

    def _enter_natively(self, keys: torch.Tensor, sequence: int) -> None:
        if 2 * (self._map_live + keys.numel()) > self._map_keys.numel():
            self._grow_map(self._map_live + keys.numel())
        first_code = self._next_code
        self._next_code += keys.numel()
        self._batches.append((keys, first_code))
        self._ids_bytes += keys.nbytes

        def link(top) -> None:
            tier = horizon_tier(top, self._pinned_key, self._pinned_next)
            pinned, added = self._passes.enter(keys, first_code, sequence, self._links(), tier)
            self.protected += pinned
            self._map_live += added
            self._cap(top)

        self.store.with_top_tier(link)

    def _consume_natively(self, keys: torch.Tensor, first_code: int) -> None:
        following, next_code = self._batches[0] if self._batches else (keys[:0], 0)

        def move_on(top) -> None:
            tier = horizon_tier(top, self._pinned_key, self._pinned_next)
            change, removed, need = self._passes.consume(
                keys, first_code, self._links(), tier, following, next_code
            )
            self.protected += change
            self._map_live -= removed
            self._need = need if self._batches else self.largest
            self._cap(top)

        self.store.with_top_tier(move_on)

    def _grow_map(self, wanted: int) -> None:
        """The native map at a power of two of positions >= 2 x ``wanted`` ids (loaded at most half),
        its ids placed anew."""
        size = 1 << (2 * wanted - 1).bit_length()
        live = self._map_keys >= 0
        keys, codes = self._map_keys[live], self._map_codes[live]
        self._map_keys = torch.full((size,), -1, dtype=torch.int64)
        self._map_codes = torch.zeros(size, dtype=torch.int64)
        cache_passes_of(self.store.stack.top.kernels).insert(self._map_keys, self._map_codes, keys, codes)

    def _grow_ring(self, count: int) -> None:
        """Room in the ring of next uses for every live entry and ``count`` more."""
        live = self._next_code - (self._batches[0][1] if self._batches else self._next_code)
        size = self._next_use.numel()
        if live + count <= size:
            return
        grown = size
        while live + count > grown:
            grown *= 2
        codes = torch.arange(self._next_code - live, self._next_code, dtype=torch.int64)
        values, hints = self._next_use[codes % size], self._entry_slot[codes % size]
        self._next_use = torch.full((grown,), NEVER, dtype=torch.int32)
        self._next_use[codes % grown] = values
        self._entry_slot = torch.full((grown,), -1, dtype=torch.int32)
        self._entry_slot[codes % grown] = hints

    def _pin(self, top, keys: torch.Tensor, next_uses: torch.Tensor) -> None:
        """Pin the resident rows of ``keys`` not pinned by the horizon yet; record their next uses."""
        keys, next_uses = keys.to(top.device), next_uses.to(top.device, torch.int32)
        slots = top.find(keys)
        resident = slots >= 0
        slots, keys, next_uses = slots[resident], keys[resident], next_uses[resident]
        new = ~self._held(top, slots, keys)
        top.pin(slots[new])
        self._pinned_key[slots[new]] = keys[new]
        self._pinned_next[slots] = next_uses
        self.protected += int(new.sum())

    def _unpin(self, top, keys: torch.Tensor) -> None:
        keys = keys.to(top.device)
        slots = top.find(keys)
        resident = slots >= 0
        slots, keys = slots[resident], keys[resident]
        held = self._held(top, slots, keys)
        slots, keys = slots[held], keys[held]
        top.unpin(slots, keys)
        self._pinned_key[slots] = -1
        self.protected -= slots.numel()

    def _held(self, top, slots: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Which of ``slots`` (holding ``keys``) carry the horizon's pin."""
        return (self._pinned_key[slots] == keys) & (top.pins[slots] > 0)

    def _mine(self, top) -> torch.Tensor:
        """bool [capacity]: the slots carrying the horizon's pin (a row taken out of the tier since,
        by ``load`` or ``clear``, left none)."""
        pinned_key = self._pinned_key[: top.capacity]
        return (pinned_key >= 0) & (top.slot_keys == pinned_key) & (top.pins > 0)

    def _cap(self, top) -> bool:
        """Drop the farthest pins where the horizon's pins leave too few slots for the next batch
        (its slots beyond the pinned ones) and a window (``window_slots``, and the batch it is
        pinning), in the same hold of the store's lock as the pins it caps, so that no batch or
        window in between finds too few. Returns whether it dropped any."""
        limit = self.capacity - (self.largest if self._need is None else self._need)
        limit -= self.window_slots() + self._pinning
        if self.protected <= limit:
            return False
        keep = max(0, limit - int(self.capacity * SLACK_SHARE))
        if self._passes is not None:
            if self._scratch is None:
                self._scratch = torch.empty(self.capacity, dtype=torch.int32)
            tier = horizon_tier(top, self._pinned_key, self._pinned_next)
            self.protected, dropped = self._passes.drop_farthest(tier, top.slot_keys, keep, self._scratch)
            self.unpinned_far += dropped
            return dropped > 0
        mine = self._mine(top)
        self._pinned_key[: top.capacity][~mine] = -1  # slots past a growing tier's hold no pin
        slots = mine.nonzero().squeeze(1)
        excess = slots.numel() - keep
        slots = slots[top.pins[slots] == 1]  # a row a window pins too keeps its slot anyway
        dropped = slots[:0]
        if excess > 0 and slots.numel():
            dropped = slots[torch.topk(self._pinned_next[slots], min(excess, slots.numel())).indices]
            top.unpin(dropped, self._pinned_key[dropped])
            self._pinned_key[dropped] = -1
            self.unpinned_far += dropped.numel()
        self.protected = int((self._pinned_key >= 0).sum())
        return dropped.numel() > 0


def _needs(top, keys: torch.Tensor) -> int:
    """How many of distinct ``keys`` have no pinned row in ``top``: not resident, or pinned by no one."""
    slots = top.find(keys.to(top.device))
    return slots.numel() - int((top.pins[slots[slots >= 0]] > 0).sum())
