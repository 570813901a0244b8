"""An admission filter: a row stays in a cache tier only once its id has been looked up often
enough, so the one-off ids that make up most keys of a click log do not evict hot rows (TinyLFU,
Einziger et al., with its window).

Every lookup is counted in a count-min sketch of bounded size whose counters are halved every
``10 x capacity`` lookups (TinyLFU's sample): an id's count is how often it was looked up lately. A
missed row whose id's count is still below ``threshold`` is served through the tier without
being admitted for good: its slot is marked transient. The newest transient rows (a window of
``WINDOW_SHARE`` of the capacity) compete under LFU like any other, so a new id gets the chance
to be looked up again (a shifting hot set needs it); older ones are the first victims. A
transient row whose count reaches the threshold stays like any other. Which rows stay cached
never changes a row's value.
"""

from __future__ import annotations

import functools

import torch

from .policies import EvictionPolicy, LfuWithAgeing

SKETCH_DEPTH = 4
WINDOW_SHARE = 0.25  # of the capacity: the newest transient rows, ranked by LFU like any other
AGE_EVERY = 10  # lookups, in multiples of the capacity, between halvings of the counters
SKETCH_WIDTH = 16  # counters per row, in multiples of the capacity: few ids share all of theirs
MAX_COUNT = 255  # a counter's largest value (one byte): no threshold above it can be reached
_MULTIPLIERS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


class FrequencySketch:
    """A count-min sketch of int64 keys: ``SKETCH_DEPTH`` rows of at least ``width`` one-byte
    counters (a power of two; they stop at 255), updated conservatively, halved every
    ``age_every`` counted lookups."""

    def __init__(self, width: int, age_every: int, device: torch.device) -> None:
        self.bits = max(4, (max(width, 2) - 1).bit_length())
        self.counters = torch.zeros(SKETCH_DEPTH, 1 << self.bits, dtype=torch.uint8, device=device)
        self.age_every = age_every
        self._counted = 0
        self._multipliers = [_signed(m) for m in _MULTIPLIERS[:SKETCH_DEPTH]]

    @property
    def nbytes(self) -> int:
        return self.counters.nbytes

    def _positions(self, keys: torch.Tensor) -> torch.Tensor:
        """int64 [depth, N]: each key's counter in each row (multiply-shift hashing)."""
        mask = (1 << self.bits) - 1
        return torch.stack([((keys * m) >> (64 - self.bits)) & mask for m in self._multipliers])

    def estimate(self, keys: torch.Tensor) -> torch.Tensor:
        """int32 [N]: at least how often each key was counted (up to 255; since ageing, halved)."""
        positions = self._positions(keys)
        return torch.gather(self.counters, 1, positions).min(dim=0).values.to(torch.int32)

    def add(self, keys: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Count ``counts [N]`` lookups of distinct ``keys [N]``; returns their estimates with these
        lookups counted (before the counters age)."""
        positions = self._positions(keys)
        least = torch.gather(self.counters, 1, positions).min(dim=0).values.to(torch.int32)
        raised = (least + counts.to(torch.int32)).clamp_(max=MAX_COUNT).to(torch.uint8)
        self.counters.scatter_reduce_(1, positions, raised.expand(SKETCH_DEPTH, -1), reduce="amax")
        self._counted += int(counts.sum())
        while self._counted >= self.age_every:
            self.counters >>= 1
            self._counted //= 2
        return raised.to(torch.int32)


class AdmissionFilter(EvictionPolicy):
    """LFU with ageing behind an admission filter of ``threshold`` lookups (see the module
    docstring). Build one for a store with ``admission_filter(threshold)``."""

    threshold = 2
    needs_keys = True
    # the flag, when it was set, the queue (under 2 entries a slot, 16 bytes each), the sketch (at most 2x)
    bytes_per_slot = LfuWithAgeing.bytes_per_slot + 1 + 8 + 32 + 2 * SKETCH_WIDTH * SKETCH_DEPTH

    def __init__(self, capacity: int, device: torch.device, backend) -> None:
        super().__init__(capacity, device, backend)
        self.ranking = LfuWithAgeing(capacity, device, backend, half_life=4.0 * capacity)  # fixed ageing
        self.sketch = FrequencySketch(SKETCH_WIDTH * capacity, AGE_EVERY * capacity, device)
        self.transient = torch.zeros(capacity, dtype=torch.bool, device=device)
        self._marked = torch.zeros(capacity, dtype=torch.int64, device=device)  # when made transient
        self._marks = 0
        self._queue = torch.zeros(0, dtype=torch.int64, device=device)  # transient slots, oldest first
        self._queue_marks = self._queue  # and when they were marked: a slot marked again is queued anew
        self.not_admitted = 0  # rows served without staying

    @property
    def nbytes(self) -> int:
        flags = self.transient.nbytes + self._marked.nbytes
        return self.ranking.nbytes + self.sketch.nbytes + flags + 32 * self.capacity  # the queue's bound

    def touch(
        self,
        slots: torch.Tensor,
        counts: torch.Tensor | None,
        keys: torch.Tensor | None = None,
        missed: torch.Tensor | None = None,
    ) -> None:
        counts = torch.ones_like(slots) if counts is None else counts.to(self.device)
        below = self.sketch.add(keys, counts) < self.threshold
        newly = below & missed.to(self.device) if missed is not None else torch.zeros_like(below)
        self.transient[slots[~below]] = False  # looked up often enough now: it stays
        self.ranking.touch(slots, counts)
        if bool(newly.any()):
            marked = slots[newly]
            marks = torch.arange(self._marks, self._marks + marked.numel(), device=self.device)
            self._marks += marked.numel()
            self.transient[marked] = True
            self._marked[marked] = marks
            self._queue, self._queue_marks = (
                torch.cat([self._queue, marked]),
                torch.cat([self._queue_marks, marks]),
            )
            self.not_admitted += marked.numel()
            if self._queue.numel() > self.capacity:  # at most one live entry a slot: the rest go
                self._drop_stale()

    def reset(self, slots: torch.Tensor) -> None:
        self.transient[slots] = False
        self.ranking.reset(slots)

    def _drop_stale(self) -> None:
        """Keep the queue's entries whose slot is still transient since it was queued."""
        live = self.transient[self._queue] & (self._marked[self._queue] == self._queue_marks)
        self._queue, self._queue_marks = self._queue[live], self._queue_marks[live]

    def victims(self, count: int, slot_keys: torch.Tensor, pins: torch.Tensor) -> torch.Tensor:
        """The oldest transient rows past the newest ``WINDOW_SHARE`` of the capacity, unpinned;
        then LFU's victims."""
        self._drop_stale()
        older = max(self._queue.numel() - int(WINDOW_SHARE * self.capacity), 0)
        queue = self._queue[:older]
        usable = pins[queue] == 0
        chosen = queue[usable][:count]
        taken = int(usable.nonzero()[count - 1]) + 1 if chosen.numel() == count and count else older
        self._queue, self._queue_marks = self._queue[taken:], self._queue_marks[taken:]
        if chosen.numel() == count:
            return chosen
        pins[chosen] += 1  # the rest from LFU, not these again
        try:
            return torch.cat([chosen, self.ranking.victims(count - chosen.numel(), slot_keys, pins)])
        finally:
            pins[chosen] -= 1


def admission_filter(threshold: int) -> type[AdmissionFilter]:
    """The ``AdmissionFilter`` policy with ``threshold`` (a store's ``policy=``); 1 admits every row.
    The class is named ``AdmissionFilter<threshold>`` in this module, so a table using it pickles."""
    if isinstance(threshold, bool) or not isinstance(threshold, int) or not 1 <= threshold <= MAX_COUNT:
        raise ValueError(
            f"threshold must be an int in [1, {MAX_COUNT}] (lookups: the filter's counters stop at "
            f"{MAX_COUNT}, so a larger threshold would never admit a row), got {threshold!r}"
        )
    return _with_threshold(threshold)


@functools.cache
def _with_threshold(threshold: int) -> type[AdmissionFilter]:
    name = f"AdmissionFilter{threshold}"
    policy = type(
        name, (AdmissionFilter,), {"threshold": threshold, "__module__": __name__, "__qualname__": name}
    )
    globals()[name] = policy
    return policy


def __getattr__(name: str):
    """``AdmissionFilter<N>``, made on first use (an unpickled table names its policy so)."""
    suffix = name.removeprefix("AdmissionFilter")
    if suffix != name and suffix.isdigit() and 1 <= int(suffix) <= MAX_COUNT:
        return _with_threshold(int(suffix))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
