"""``TierStack``: the cache tiers over the cold tier, and the movement of rows between them.

The cache tiers are exclusive (a row lives in at most one) and write-back: a batch's distinct ids
are made resident in the top tier, misses are taken from the tier below (the next cache tier, then
the cold store, then the deterministic initialiser), and rows a tier evicts move down one tier;
the lowest cache tier's dirty victims are staged in the cold store. ``flush`` stages every dirty
cached row and commits the cold store atomically. Tiers are reached through their contract
(``contract.CacheTier``, ``cold.ColdStore``) only.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..errors import CacheCapacityError
from ..heap import release_free_heap
from ..initializer import initial_rows, native_initial_rows
from ..metadata import StoreMetadata
from .cold import ColdStore
from .contract import CacheTier, Rows, too_many_distinct

FLUSH_BATCH_ROWS = 1 << 14  # dirty rows copied out and staged at once by a flush


class TierStack:
    """``caches`` (top first, at least one) over ``cold``, for rows laid out as ``metadata`` says."""

    def __init__(self, caches: list[CacheTier], cold: ColdStore, metadata: StoreMetadata) -> None:
        self.caches = caches
        self.cold = cold
        self.metadata = metadata

    @property
    def top(self) -> CacheTier:
        return self.caches[0]

    def make_resident(self, unique: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Slots in the top tier of ``unique`` ids (int64 [U], distinct), each looked up ``counts``
        times, fetching and evicting as needed."""
        top = self.top
        if unique.numel() > top.max_capacity:
            raise too_many_distinct(top.name, top.max_capacity, unique.numel())
        top.make_room(unique)
        top.policy.observe(unique, counts)
        if self._admits_directly():  # one native call: found, victims chosen, misses read in
            return self.cold.make_resident_in(top, unique, counts, None, self._native_initial())
        resolved = top.resolve(unique, counts)
        if resolved is not None:  # one native pass: found, hits touched, misses listed
            slots, hit_slots, missed, lookups = resolved
            missed_counts = counts[missed]
            admitted = self._bring_in(unique[missed], missed_counts, hit_slots) if missed.numel() else missed
            slots[missed] = admitted
            top.touch_admitted(admitted, missed_counts, lookups)
            return slots
        slots = top.find(unique)
        hit = slots >= 0
        missed = None
        if not bool(hit.all()):
            missed = ~hit
            missed_cpu = missed.cpu()
            slots[missed] = self._bring_in(unique[missed_cpu], counts[missed_cpu], slots[hit])
        top.touch(slots, counts, missed)
        return slots

    def lookup_bags(self, ids: torch.Tensor, padding: int | None, bags) -> tuple | None:
        """A training lookup in one native call where a single host tier over the mmap cold store
        serves it and is at its full size or has room for every id (``ColdStore.lookup_bags_in``:
        ``(Distinct of ids, their slots, (pooled, entry bags, scales))``, as ``make_resident`` and
        ``StepPasses.pooled`` of ``bags`` give them); None where the batch takes the general path."""
        top = self.top
        if not self._admits_directly() or not top.fits_as_sized(ids.numel()):
            return None
        return self.cold.lookup_bags_in(top, ids, padding, bags, self._native_initial())

    def _bring_in(self, keys: torch.Tensor, counts: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        """Top-tier slots of ``keys`` (distinct, none in the top tier), taken from the tiers below and
        admitted without evicting ``protected`` slots."""
        taken: list[tuple[CacheTier, Rows]] = []
        fetched = self._fetch(keys, counts, 1, taken)
        try:
            slots, _ = self.top.admit(fetched, protected, lambda victims: self._move_down(victims, 1))
        except BaseException:  # e.g. a full disk while staging victims: every row stays where it was
            for cache, rows in taken:
                cache.admit(rows)  # into the slots taking them freed
            raise
        return slots

    def _admits_directly(self) -> bool:
        """Whether a single cache tier makes its batches resident straight from the cold store
        (``ColdStore.make_resident_in``)."""
        return len(self.caches) == 1 and self.cold.admits_into(self.top)

    def _native_initial(self):
        return native_initial_rows(self.metadata.dim, self.metadata.seed)

    def pin_held(self, unique: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Make the rows of ``unique`` (distinct) ids that the table holds resident in the top tier and
        pin them there, counting no access (a lookahead pipeline's move ahead of a batch; ids the
        table does not hold are left to the batch, which adds them). Returns ``(their keys, their
        slots, how many were moved up)``."""
        top = self.top
        slots = top.find(unique)
        resident = slots >= 0
        keys, slots = unique[resident.cpu()], slots[resident]
        absent = unique[~resident.cpu()]
        moving = absent[self.contains(absent)] if absent.numel() else absent
        if moving.numel():
            if keys.numel() + moving.numel() > top.max_capacity:
                raise CacheCapacityError(
                    f"pinning {keys.numel() + moving.numel()} rows needs more than the {top.name} cache's "
                    f"{top.max_capacity}; pin fewer"
                )
            top.make_room(moving)
            counts = torch.zeros_like(moving)  # moved ahead of the batch, which counts the lookups
            if self._admits_directly():
                moved = self.cold.make_resident_in(top, moving, counts, slots, self._native_initial())
            else:
                moved = self._bring_in(moving, counts, slots)
            slots = torch.cat([slots, moved])
            keys = torch.cat([keys, moving])
        top.pin(slots)
        return keys, slots, moving.numel()

    def unpin(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        self.top.unpin(slots, keys)

    def rows_without_growing(
        self, unique: torch.Tensor, counts: torch.Tensor, width: int, device: torch.device
    ) -> torch.Tensor:
        """``[U, width]`` rows of ``unique`` ids on ``device``: held ids through the tiers, the others
        their initial rows, which are not cached (a cached row is always one the table holds)."""
        known = self.contains(unique)
        rows = torch.empty(unique.numel(), width, dtype=self.metadata.torch_dtype, device=device)
        if bool(known.any()):
            slots = self.make_resident(unique[known], counts[known])
            rows[known.to(device)] = self.top.read(slots, width).to(device)
        unknown = ~known
        if bool(unknown.any()):
            self.cold.get(unique[unknown], counts[unknown])  # counted as lookups of new ids
            rows[unknown.to(device)] = self._initial_rows(unique[unknown].to(device))[:, :width]
        return rows

    def _initial_rows(self, keys: torch.Tensor) -> torch.Tensor:
        metadata = self.metadata
        state_columns = metadata.row_width - metadata.dim  # zero: the state of every optimizer at the start
        return initial_rows(keys, metadata.dim, state_columns, metadata.seed, metadata.torch_dtype)

    def _fetch(self, keys: torch.Tensor, counts: torch.Tensor, level: int, taken: list) -> Rows:
        """Rows of ``keys`` (none in tiers above ``level``, same order), taken out of the tiers below
        (each cache tier and the rows taken from it are appended to ``taken``)."""
        if level < len(self.caches):
            self.caches[level].policy.observe(keys, counts)
            found, rows = self.caches[level].take(keys, counts)
            taken.append((self.caches[level], rows))
            if bool(found.all()):
                return rows
            return Rows.merge(found, rows, self._fetch(keys[~found], counts[~found], level + 1, taken))
        rows, found = self.cold.get(keys, counts)
        new = ~found
        if bool(new.any()):
            rows = self._with_initial_rows(keys, rows, new)
        return Rows(keys, rows, new, new.clone())

    def _with_initial_rows(self, keys: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """``rows`` (of ``keys``, read from the cold store) with the initial rows of the ``new`` ones,
        on the top tier's device: new rows are made where they are going, so they are neither
        hashed on the host nor copied to the device."""
        device = self.top.device
        if rows.device != device:
            found = ~new
            on_device = torch.empty(rows.shape, dtype=rows.dtype, device=device)
            if bool(found.any()):
                on_device[found.to(device)] = rows[found].to(device)
            rows, new = on_device, new.to(device)
        rows[new] = self._initial_rows(keys.to(device)[new])
        return rows

    def load(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``rows`` of distinct ``keys`` straight into the cold store, then drop the cached
        copies they replace; the caller's cold-store flush commits them. ``rows`` are whole rows,
        or weights only: then each row keeps the optimizer state it has (zero for a new id). Keys
        the table does not hold go in by the cold store's bulk path. If the cold store refuses
        them (a full disk), no cached row has changed."""
        if rows.shape[1] < self.metadata.row_width:
            whole = self._current_rows(keys)
            whole[:, : rows.shape[1]] = rows
            rows = whole
        if self.cold.can_bulk_load() and not bool(self.contains(keys).any()):
            self.cold.bulk_load(keys, rows)  # staged on disk, committed by the caller's flush
        else:
            self.cold.put(keys, rows)
            self.cold.flush()  # bounds what a backend stages in memory
        for cache in self.caches:
            cache.take(keys, torch.zeros_like(keys))  # counts no lookup

    def pinned_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Which of distinct ``keys`` (int64 CPU) a cache tier holds pinned (int64 CPU)."""
        return torch.cat([cache.pinned_keys(keys) for cache in self.caches])

    def remove(self, keys: torch.Tensor) -> int:
        """Remove distinct ``keys`` (int64 CPU) from every tier: the cold store stages their removal
        (a full disk raises there, nothing changed), then the cached rows are dropped, dirty or not.
        Rows pinned for batches in flight are refused before any change. Returns how many the table held."""
        pinned = self.pinned_keys(keys)
        if pinned.numel():
            raise RuntimeError(
                f"{pinned.numel()} of the ids to remove (such as {int(pinned[0])}) are pinned for "
                f"batches in flight (a lookahead pipeline): remove them once those batches are done"
            )
        held = int(self.contains(keys).sum())
        self.cold.remove(keys)
        for cache in self.caches:
            cache.take(keys, torch.zeros_like(keys))  # counts no lookup
        return held

    def _current_rows(self, keys: torch.Tensor) -> torch.Tensor:
        """``[N, row_width]`` newest rows of distinct ``keys`` on CPU, zero where the table holds none."""
        stored, found = self.cold.get(keys, torch.zeros_like(keys))  # counts no lookup
        rows = torch.zeros(keys.numel(), self.metadata.row_width, dtype=self.metadata.torch_dtype)
        rows[found] = stored[found]
        return self._with_cached_rows(keys, rows)

    def _with_cached_rows(self, keys: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (CPU, of ``keys``) with the cached tiers' newer copies written over them."""
        for cache in self.caches:
            slots = cache.find(keys)
            cached = slots >= 0
            rows[cached.cpu()] = cache.read(slots[cached]).cpu()
        return rows

    def _move_down(self, evicted: Rows, level: int) -> None:
        """Hand rows being evicted from tier ``level - 1`` to tier ``level`` (or the cold store). Rows
        that tier evicts in turn go down first, so a failure (a full disk) loses no row."""
        if len(evicted) == 0:
            return
        if level < len(self.caches):
            cache = self.caches[level]
            evicted = evicted.to(cache.device)
            fits = min(len(evicted), cache.max_capacity)
            self._move_down(evicted.select(slice(fits, None)), level + 1)  # more than the tier holds
            cache.admit(
                evicted.select(slice(0, fits)), None, lambda victims: self._move_down(victims, level + 1)
            )
        else:
            self._stage_in_cold(evicted.select(evicted.dirty.cpu()))

    def _stage_in_cold(self, rows: Rows, before_flush: bool = False) -> None:
        if len(rows):
            self.cold.put(rows.keys.cpu(), rows.rows.cpu(), before_flush)

    def flush(self) -> None:
        """Stage every dirty cached row in the cold store (``FLUSH_BATCH_ROWS`` at a time) and commit
        it atomically; only then are the rows clean. The heap's free pages go back to the system
        first and after (``heap``): under a memory limit they are the flush's page cache."""
        release_free_heap()
        staged = []
        for cache in self.caches:
            for slots, rows in cache.dirty_rows(FLUSH_BATCH_ROWS):
                self._stage_in_cold(rows, before_flush=True)  # still dirty, cached, until it commits
                staged.append((cache, slots))
        self.cold.flush()
        for cache, slots in staged:
            cache.mark_clean(slots)
        release_free_heap()

    def unflushed_keys(self) -> torch.Tensor:
        """The ids (int64 CPU, distinct) whose rows the next flush commits: staged in the cold store
        since the last one, or dirty in a cache tier."""
        keys = [self.cold.staged_keys()] + [cache.dirty_keys() for cache in self.caches]
        return torch.cat(keys).unique()

    def refresh(self) -> None:
        """A read-only stack moves to the cold store's newest flush: its cached rows (of the old
        one) are dropped. A writable stack holds its newest rows already."""
        if self.cold.read_only:
            for cache in self.caches:
                cache.clear()
            self.cold.refresh()

    def __len__(self) -> int:
        return len(self.cold) + sum(cache.fresh_count() for cache in self.caches)

    def contains(self, unique: torch.Tensor) -> torch.Tensor:
        """bool [U] on CPU: which ``unique`` ids (distinct) the table holds; counts nothing."""
        present = self.cold.contains(unique)
        for cache in self.caches:  # a cached row that is not fresh is in the cold store too
            present |= cache.fresh_keys(unique)
        return present

    def iter_rows(self, batch_size: int, width: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every ``(ids [n], rows [n, width])`` the table holds, newest values, on CPU."""
        for keys, rows in self.cold.iter_rows(batch_size):
            yield keys, self._with_cached_rows(keys, rows)[:, :width]
        for cache in self.caches:
            yield from cache.iter_fresh(batch_size, width)

    def report(self) -> dict:
        """Each tier's counters by name ("device", "host", "cold")."""
        tiers = {cache.name: cache.report() for cache in self.caches}
        tiers["cold"] = {**self.cold.report(), "backend": self.metadata.backend}
        return tiers
