"""The C side of the native passes in Python: the structures ``host_step.cpp`` takes and fills
(``ctypes.Structure``s), library functions given their C types (``typed``), tensors as pointers."""

from __future__ import annotations

import ctypes
import dataclasses

import torch

_POINTER, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class HostTierArrays(ctypes.Structure):
    """host_step.cpp's ``HostTier``: a host cache tier's arrays (``RowCache.native_arrays``)."""

    _fields_ = [
        ("index_keys", _POINTER),
        ("index_values", _POINTER),
        ("index_mask", _I64),
        ("slot_keys", _POINTER),
        ("rows", _POINTER),
        ("row_width", _I64),
        ("dirty", _POINTER),
        ("fresh", _POINTER),
        ("scores", _POINTER),
        ("format", _I64),  # FLOAT32 (-1) or a 16-bit row's code (launch.HALF_FORMATS)
        ("direct_bases", _POINTER),  # its DirectLayout (direct_tables 0: none)
        ("direct_sizes", _POINTER),
        ("direct_tables", _I64),
        ("direct_slots", _I64),
    ]


class ColdFiles(ctypes.Structure):
    """host_step.cpp's ``ColdFiles``: where the mmap cold store keeps its rows (its ``make_resident_in``)."""

    _fields_ = [
        ("main_keys", _POINTER),
        ("main_values", _POINTER),
        ("main_mask", _I64),
        ("main_count", _I64),
        ("main_rows", _POINTER),
        ("log_keys", _POINTER),
        ("log_values", _POINTER),
        ("log_mask", _I64),
        ("log_rows", _POINTER),
        ("log_count", _I64),
        ("committed", _I64),
        ("stored_bytes", _I64),
        ("row_bytes", _I64),
        ("check_bytes", _I64),
        ("log_prepared", _I64),  # bytes of the log's rows file whose pages are made ahead of appends
        ("log_allocated", _I64),  # bytes of the log's rows file whose blocks are on disk
        ("log_runs", _POINTER),  # a LogRuns (the log index's sealed runs), or null
    ]


class LogRun(ctypes.Structure):
    """host_step.cpp's ``LogRun``: one sealed run of the mmap store's log index (``LogIndex``)."""

    _fields_ = [
        ("hashes", _POINTER),
        ("values", _POINTER),
        ("length", _I64),
        ("filter", _POINTER),
        ("filter_mask", _I64),
        ("starts", _POINTER),
        ("shift", _I64),
    ]


class LogRuns(ctypes.Structure):
    """host_step.cpp's ``LogRuns``: the log index's sealed runs, oldest first, and the table being
    sealed (``frozen_mask`` -1: none)."""

    _fields_ = [
        ("runs", _POINTER),
        ("count", _I64),
        ("frozen_keys", _POINTER),
        ("frozen_values", _POINTER),
        ("frozen_mask", _I64),
    ]


class TierChoice(ctypes.Structure):
    """host_step.cpp's ``TierChoice``: a host tier's free slots and LFU's pool, the weight of an access
    now, and room for a scan's ranking (``RowCache.native_choice``)."""

    _fields_ = [
        ("pins", _POINTER),
        ("capacity", _I64),
        ("free_slots", _POINTER),
        ("free_positions", _POINTER),  # where the tier has a DirectLayout, else null
        ("free_count", _I64),
        ("pool", _POINTER),
        ("pool_scores", _POINTER),
        ("pool_keys", _POINTER),
        ("pool_length", _I64),
        ("pool_size", _I64),
        ("ranked", _POINTER),
        ("ranked_scores", _POINTER),
        ("ranked_keys", _POINTER),
        ("increment", ctypes.c_float),
    ]


class Residency(ctypes.Structure):
    """host_step.cpp's ``Residency``: what ``StepPasses.make_resident`` did (``status``: 0 done, 1 rows
    failed their check, 2 too few slots evictable, 3 a write failed; see host_step.cpp)."""

    _fields_ = [
        (name, _I64)
        for name in (
            "status",
            "detail",
            "hit_lookups",
            "missed_lookups",
            "misses",
            "from_free",
            "victims",
            "pool_taken",
            "ranked_count",
            "held_lookups",
            "written_back",
            "appended",
            "new_to_log",
            "bad",
            "log_prepared",
            "find_ns",
            "choose_ns",
            "admit_ns",
            "distinct_ns",
            "pooled_ns",
            "read_ns",
            "log_ns",
            "reindex_ns",
            "fill_ns",
        )
    ]

    RESIDENT, DAMAGED, NO_ROOM, WRITE_FAILED, TOO_MANY = range(5)  # TOO_MANY: step_lookup_bags'


class BagLookup(ctypes.Structure):
    """host_step.cpp's ``BagLookup``: ``step_lookup_bags``' batch, shadow caches and bags."""

    _fields_ = [
        ("ids", _POINTER),
        ("entries", _I64),
        ("padding", _I64),
        ("has_padding", _INT),
        ("scratch", _POINTER),
        ("distinct", _POINTER),
        ("max_rows", _I64),
        ("threshold", ctypes.c_uint64),
        ("shadows", _POINTER),
        ("shadow_count", _I64),
        ("memory", ctypes.c_double),
        ("hits", _POINTER),
        ("offsets", _POINTER),
        ("bag_length", _I64),
        ("last_end", _I64),
        ("bags", _I64),
        ("mean", _INT),
        ("weights", _POINTER),
        ("out", _POINTER),
        ("dim", _I64),
        ("entry_bag", _POINTER),
        ("scale", _POINTER),
        ("distinct_count", _I64),
        ("sampled", _I64),
        ("own_bags", _I64),
    ]


@dataclasses.dataclass(frozen=True)
class Bags:
    """A batch's bags as ``step_pooled_forward`` takes them: ``offsets`` (int64 [count] or
    [count + 1], or None: bags of ``length`` entries), ``count`` bags, the last ending before entry
    ``last_end``, summed or averaged (``mean``), each entry times ``weights`` (float32 [N] or None);
    pooled into ``[count, dim]`` float32, or laid out as ``shape`` ([count / k, k x dim])."""

    offsets: torch.Tensor | None
    length: int
    count: int
    last_end: int
    mean: bool
    weights: torch.Tensor | None
    dim: int
    shape: tuple[int, int] | None

    def outputs(self, entries: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Room for ``(pooled, each entry's bag int64 [entries], its gradient scale float32)``."""
        return (
            torch.empty(self.shape or (self.count, self.dim), dtype=torch.float32),
            torch.empty(entries, dtype=torch.int64),
            torch.empty(entries, dtype=torch.float32),
        )


class InitialRows(ctypes.Structure):
    """host_step.cpp's ``InitialRows``: ``initial_rows``' arguments."""

    _fields_ = [("dim", _I64), ("seed_hash", ctypes.c_uint64), ("bound", ctypes.c_double)]


def typed(function, result, arguments: list):
    """``function`` with its C types, refusing a call with another number of arguments (ctypes
    would pass extra ones as 32-bit ints)."""
    function.restype, function.argtypes = result, arguments

    def call(*values):
        if len(values) != len(arguments):
            raise TypeError(f"{function.__name__} takes {len(arguments)} arguments, got {len(values)}")
        return function(*values)

    return call


def pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class Distinct:
    """A batch's distinct ids: ``unique [U]`` in first-appearance order (from 16,384 entries: part
    by part of their hashes, first appearance within a part; ``step_distinct``), ``counts [U]``,
    ``entry_rows [N]`` (each entry's row in ``unique``; U for padding entries), ``starts [U + 1]``
    and ``order [M]`` (row r's entries are ``order[starts[r]:starts[r + 1]]``, ascending); all int64,
    views of one buffer (``step_distinct``'s) made when read (``count``: U): the native passes take
    their addresses."""

    __slots__ = ("count", "padding_row", "entries", "_buffer")

    def __init__(self, buffer: torch.Tensor, entries: int, count: int, padding_row: int) -> None:
        self._buffer, self.entries, self.count = buffer, entries, count  # N, U
        self.padding_row = padding_row  # -1: no padding

    @property
    def unique(self) -> torch.Tensor:
        return self._buffer[: self.count]

    @property
    def counts(self) -> torch.Tensor:
        return self._buffer[self.entries : self.entries + self.count]

    # Where each part lies in the buffer (N-entry parts: unique, counts, entry rows, order, starts).
    @property
    def entry_rows_address(self) -> int:
        return self._buffer.data_ptr() + 16 * self.entries

    @property
    def order_address(self) -> int:
        return self._buffer.data_ptr() + 24 * self.entries

    @property
    def starts_address(self) -> int:
        return self._buffer.data_ptr() + 32 * self.entries

    @property
    def entry_rows(self) -> torch.Tensor:
        return self._buffer[2 * self.entries : 3 * self.entries]

    @property
    def starts(self) -> torch.Tensor:
        rows = self.count + (self.padding_row >= 0)
        return self._buffer[4 * self.entries : 4 * self.entries + rows + 1]

    @property
    def order(self) -> torch.Tensor:
        kept = int(self._buffer[4 * self.entries + self.count])  # starts[U]
        return self._buffer[3 * self.entries : 3 * self.entries + kept]
