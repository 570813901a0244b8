"""The host build's training-step passes (``host_step.cpp``) behind typed Python calls: a batch's
distinct ids by hashing, the pooled forward read straight from a tier's rows, the gradient sum per
row fused with the optimizer, a collection's key layout and id check, the initial rows, the mmap
cold store's reads and log writes, and a host tier's misses admitted from that store in one call.
``nn.native_step`` builds a training lookup from them; ``initializer`` uses ``initial_rows``, the
mmap store the rest.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import threading

import numpy as np
import torch

from .host import host_kernels

# The optimizer kernels by number in host_step.cpp's update_row, with their float arguments.
_OPTIMIZER_CODES = {"update_sgd": 0, "update_adagrad": 1, "update_adam": 2, "update_rowwise_adagrad": 3}
_MAX_OPTIMIZER_ARGUMENTS = 6
_POINTER, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "step_distinct_scratch": (_I64, [_I64]),
    "step_distinct": (_I64, [_POINTER, _I64, _I64, _INT] + [_POINTER] * 6),
    "step_unique": (_I64, [_POINTER, _I64, _POINTER, _I64, _POINTER]),
    "step_pooled_forward": (
        None,
        [_POINTER, _I64, _I64, _POINTER, _POINTER, _I64, _POINTER, _I64, _I64, _I64, _I64, _INT]
        + [_POINTER, _POINTER, _I64, _POINTER, _POINTER],
    ),
    "step_backward": (
        None,
        [_POINTER, _I64, _POINTER, _POINTER, _POINTER, _POINTER, _I64, _I64, _POINTER, _I64]
        + [_POINTER, _POINTER, _INT, _POINTER, _POINTER],
    ),
    "step_rows_moved": (_I64, [_POINTER, _POINTER, _POINTER, _I64]),
    "step_check_batch": (_I64, [_POINTER, _I64, _POINTER, _I64, _I64] + [_POINTER] * 3),
    "step_initial_rows": (None, [_POINTER, _I64, _I64, _I64, ctypes.c_uint64, ctypes.c_double, _POINTER]),
    "step_row_hashes": (None, [_POINTER, _POINTER, _I64, _I64, _I64, _POINTER]),
    "step_cold_rows": (
        _I64,
        [_POINTER, _I64, _POINTER, _POINTER, _I64, _I64, _INT, _POINTER, _POINTER, _POINTER, _I64, _POINTER]
        + [_I64, _I64, _I64, _POINTER, _POINTER, _POINTER],
    ),
    "step_cold_stage": (
        _I64,
        [_POINTER, _I64, _POINTER, _I64, _I64, _POINTER, _POINTER, _I64, _I64] + [_POINTER] * 4,
    ),
    "step_group_keys": (None, [_POINTER, _POINTER, _I64, _POINTER, _POINTER, _I64] + [_POINTER] * 6),
    "step_will_need_homes": (None, [_POINTER, _I64, _POINTER, _POINTER, _I64]),
    "step_will_need_rows": (None, [_POINTER, _I64, _POINTER, _I64]),
    "step_make_resident": (
        None,
        [_POINTER, _POINTER, _I64, _POINTER, _I64, _POINTER, _POINTER, _POINTER, _INT, _INT, _INT]
        + [_POINTER, _POINTER, _POINTER],
    ),
    "step_lookup_bags": (None, [_POINTER] * 4 + [_INT, _INT, _INT] + [_POINTER] * 3),
}


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
    ]


class TierChoice(ctypes.Structure):
    """host_step.cpp's ``TierChoice``: a host tier's free slots and LFU's pool, the weight of an access
    now, and room for a scan's ranking (``RowCache.native_choice``)."""

    _fields_ = [
        ("pins", _POINTER),
        ("capacity", _I64),
        ("free_slots", _POINTER),
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
            "find_ns",
            "choose_ns",
            "admit_ns",
            "distinct_ns",
            "pooled_ns",
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


class StepPasses:
    """The native passes of one host build (``HostKernels.step_library``)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = {name: typed(getattr(library, name), *c) for name, c in _SIGNATURES.items()}
        self._scratch = threading.local()  # the dedupe's hash table, per thread, reused

    def _hash_table(self, entries: int) -> tuple[torch.Tensor, int]:
        """``(scratch [positions] int32, mask)`` with positions a power of two >= 2 x entries."""
        if entries >= 1 << 31:
            raise ValueError(f"a batch holds {entries} ids; split it into batches of fewer than 2^31")
        positions = 1 << max(4, (2 * entries - 1).bit_length())
        table = getattr(self._scratch, "table", None)
        if table is None or table.shape[0] < positions:
            table = self._scratch.table = torch.empty(positions, dtype=torch.int32)
        return table, positions - 1

    def _distinct_scratch(self, entries: int) -> torch.Tensor:
        """int32 scratch for ``step_distinct`` of ``entries`` ids."""
        if entries >= 1 << 31:
            raise ValueError(f"a batch holds {entries} ids; split it into batches of fewer than 2^31")
        scratch, serves = getattr(self._scratch, "distinct", (None, -1))  # and the most entries it serves
        if entries > serves:
            scratch = torch.empty(self._functions["step_distinct_scratch"](entries), dtype=torch.int32)
            self._scratch.distinct = scratch, entries
        return scratch

    def _distinct_room(self, ids: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
        """``(ids flat, their number N, step_distinct's scratch, room for a Distinct [5N + 2])``: the
        room holds unique, counts, entry rows, order and starts, in that order."""
        flat = ids.reshape(-1).contiguous()
        entries = flat.numel()
        return flat, entries, self._distinct_scratch(entries), torch.empty(5 * entries + 2, dtype=torch.int64)

    def distinct(self, ids: torch.Tensor, padding: int | None) -> Distinct:
        """``Distinct`` of ``ids`` (int64 CPU, any shape, validated), leaving out entries equal to
        ``padding`` (None: none)."""
        flat, entries, scratch, out = self._distinct_room(ids)
        address = out.data_ptr()
        count = self._functions["step_distinct"](
            flat.data_ptr(),
            entries,
            -1 if padding is None else padding,
            padding is not None,
            scratch.data_ptr(),
            address,
            address + 8 * entries,
            address + 16 * entries,
            address + 32 * entries,
            address + 24 * entries,
        )
        return Distinct(out, entries, count, count if padding is not None else -1)

    def unique(self, ids: torch.Tensor) -> torch.Tensor:
        """The distinct values of ``ids`` (int64 CPU), in first-appearance order (``step_unique``)."""
        flat = ids.reshape(-1).contiguous()
        table, mask = self._hash_table(flat.numel())
        unique = torch.empty(flat.numel(), dtype=torch.int64)
        count = self._functions["step_unique"](
            flat.data_ptr(), flat.numel(), table.data_ptr(), mask, unique.data_ptr()
        )
        return unique[:count]

    def pooled(
        self, rows: torch.Tensor, slots: torch.Tensor, distinct: Distinct, bags: Bags
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(pooled [bags, dim] (or as ``bags.shape``), each entry's bag int64 [N] (-1: none), its
        gradient scale float32 [N])`` of ``bags`` over ``rows`` (the host tier's buffer) at ``slots``
        (int64 [U])."""
        entries = distinct.entries
        out, entry_bag, scale = bags.outputs(entries)
        self._functions["step_pooled_forward"](
            rows.data_ptr(),
            rows.shape[1],
            bags.dim,
            slots.data_ptr(),
            distinct.entry_rows_address,
            distinct.padding_row,
            pointer(bags.offsets),
            bags.length,
            bags.last_end,
            bags.count,
            entries,
            bags.mean,
            pointer(bags.weights),
            out.data_ptr(),
            bags.dim,
            entry_bag.data_ptr(),
            scale.data_ptr(),
        )
        return out, entry_bag, scale

    def backward(
        self,
        grad: torch.Tensor,
        grad_stride: int,
        distinct: Distinct,
        entry_bag: torch.Tensor,
        scale: torch.Tensor,
        dim: int,
        update: tuple | None,
    ) -> torch.Tensor | None:
        """Each distinct row's gradient summed from ``grad`` (bag b's at ``b * grad_stride``).
        ``update``: ``(rows, slots int64 [U], dirty, optimizer kernel name, its float arguments)``:
        applied to the rows in place (returns None); None: the sums ``[U, dim]`` are returned."""
        count = distinct.count
        if update is None:
            summed = torch.empty(count, dim, dtype=torch.float32)
            rows = slots = dirty = None
            code, arguments = 0, ()
        else:
            summed = None
            rows, slots, dirty, name, arguments = update
            code = _OPTIMIZER_CODES[name]
        parameters = (ctypes.c_float * _MAX_OPTIMIZER_ARGUMENTS)(*arguments)
        self._functions["step_backward"](
            grad.data_ptr(),
            grad_stride,
            distinct.order_address,
            distinct.starts_address,
            entry_bag.data_ptr(),
            scale.data_ptr(),
            count,
            dim,
            pointer(rows),
            0 if rows is None else rows.shape[1],
            pointer(slots),
            pointer(dirty),
            code,
            parameters,
            pointer(summed),
        )
        return summed

    def rows_moved(self, slot_keys: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor) -> int:
        """How many ``keys`` are no longer at their ``slots`` (int64) of a tier's ``slot_keys``."""
        return self._functions["step_rows_moved"](
            slot_keys.data_ptr(), slots.data_ptr(), keys.data_ptr(), keys.numel()
        )

    def _cursors(self, features: int) -> torch.Tensor:
        """int64 scratch of at least ``features`` entries, this thread's."""
        cursors = getattr(self._scratch, "cursors", None)
        if cursors is None or cursors.numel() < features:
            cursors = self._scratch.cursors = torch.empty(max(features, 64), dtype=torch.int64)
        return cursors

    def check_batch(
        self, values: torch.Tensor, lengths: torch.Tensor, bounds: torch.Tensor
    ) -> tuple[torch.Tensor, int, int]:
        """``(feature starts int64 [F + 1], what is wrong, its detail)`` of a batch's ``values`` (int64,
        feature by feature) and ``lengths [F, batch]`` (int64) whose feature f's ids must be below
        ``bounds[f]``, as ``step_check_batch``: 0 nothing; 1 a negative length (detail: its flat
        position); 2 the lengths sum to detail, not to the values' count; 3 entry detail's id is
        negative or out of bounds."""
        features, batch = lengths.shape
        starts = torch.empty(features + 1, dtype=torch.int64)
        detail = getattr(self._scratch, "detail", None)
        if detail is None:
            detail = self._scratch.detail = torch.zeros(1, dtype=torch.int64)
        kind = self._functions["step_check_batch"](
            values.data_ptr(),
            values.numel(),
            lengths.data_ptr(),
            features,
            batch,
            bounds.data_ptr(),
            starts.data_ptr(),
            detail.data_ptr(),
        )
        return starts, kind, int(detail) if kind else 0

    def group_keys(
        self,
        values: torch.Tensor,
        lengths: torch.Tensor,
        feature_starts: torch.Tensor,
        features: list[int],
        numbers: torch.Tensor,
        weights: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(keys [M], bag starts [batch x len(features)], weights [M] or None)`` of the entries of
        ``features`` (positions in a KeyedJaggedTensor: ``values`` int64, ``lengths [F, batch]``,
        ``weights`` float32 or None) in the output's layout, sample by sample, as ``step_group_keys``."""
        batch = lengths.shape[1]
        group = _positions(tuple(features))
        count = int(lengths[group].sum()) if len(features) < lengths.shape[0] else values.numel()
        keys = torch.empty(count, dtype=torch.int64)
        starts = torch.empty(batch * len(features), dtype=torch.int64)
        group_weights = None if weights is None else torch.empty(count, dtype=torch.float32)
        cursors = self._cursors(len(features))  # scratch: each feature's next entry
        lengths = lengths.contiguous()
        self._functions["step_group_keys"](
            values.data_ptr(),
            lengths.data_ptr(),
            batch,
            feature_starts.data_ptr(),
            group.data_ptr(),
            len(features),
            numbers.data_ptr(),
            pointer(weights),
            keys.data_ptr(),
            starts.data_ptr(),
            pointer(group_weights),
            cursors.data_ptr(),
        )
        return keys, starts, group_weights

    def initial_rows(self, ids: torch.Tensor, dim: int, state_width: int, seed_hash: int) -> torch.Tensor:
        """float32 ``[N, dim + state_width]`` initial rows of ``ids`` (int64 CPU): ``initializer``'s,
        bit for bit. ``seed_hash``: the seed's SplitMix64 hash, as a uint64."""
        ids = ids.contiguous()
        rows = torch.empty(ids.numel(), dim + state_width, dtype=torch.float32)
        bound = 1.0 / math.sqrt(dim)
        width = dim + state_width
        self._functions["step_initial_rows"](
            ids.data_ptr(), ids.numel(), dim, width, seed_hash, bound, rows.data_ptr()
        )
        return rows

    def row_hashes(self, keys: np.ndarray, raw: np.ndarray) -> np.ndarray:
        """uint64 [N]: the cold stores' row checks of ``raw`` (uint8 [N, B], rows packed but maybe
        spaced: a prefix of wider stored rows) for ids ``keys`` (int64 [N]), as ``codec.row_hashes``."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        if raw.strides[1] != 1:
            raw = np.ascontiguousarray(raw)
        hashes = np.empty(raw.shape[0], dtype=np.uint64)
        stride = raw.strides[0] if raw.shape[0] > 1 else raw.shape[1]
        self._functions["step_row_hashes"](
            keys.ctypes.data, raw.ctypes.data, raw.shape[0], raw.shape[1], stride, hashes.ctypes.data
        )
        return hashes

    def cold_rows(
        self,
        keys: torch.Tensor,
        main: tuple,
        log: tuple | None,
        row_bytes: int,
        check_bytes: int,
        advise: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """The mmap cold store's read of ``keys`` (int64 [N]): ``main`` is ``(index keys, index values
        (int64 row numbers), stored rows uint8 [R, stored bytes], committed row count)`` (rows at or
        past the count are not read), ``log`` the same but for the count (None: no log). Returns
        ``(row bytes uint8 [N, row_bytes], found bool [N], rows failing their check, the first of
        them)``; rows of keys not found are unspecified. ``advise``: the main index's and rows' pages
        are asked for first, all at once (``MADV_WILLNEED``: for files mostly on disk)."""
        keys = keys.contiguous()
        count = keys.numel()
        out = torch.empty(count, row_bytes, dtype=torch.uint8)
        found = torch.empty(count, dtype=torch.bool)
        first_bad = torch.empty(1, dtype=torch.int64)
        main_keys, main_values, main_rows, main_count = main
        log_keys, log_values, log_rows = log if log is not None else (None, None, None)
        bad = self._functions["step_cold_rows"](
            keys.data_ptr(),
            count,
            main_keys.data_ptr(),
            main_values.data_ptr(),
            main_keys.numel() - 1,
            main_count,
            advise,
            main_rows.ctypes.data,
            pointer(log_keys),
            pointer(log_values),
            -1 if log is None else log_keys.numel() - 1,
            None if log is None else log_rows.ctypes.data,
            main_rows.shape[1],
            row_bytes,
            check_bytes,
            out.data_ptr(),
            found.data_ptr(),
            first_bad.data_ptr(),
        )
        return out, found, bad, int(first_bad)

    def make_resident(
        self,
        keys: torch.Tensor,
        counts: torch.Tensor,
        protected: torch.Tensor | None,
        tier: HostTierArrays,
        choice: TierChoice,
        cold: ColdFiles,
        advise: bool,
        log_files: tuple[int, int],
        initial: InitialRows,
    ) -> tuple[torch.Tensor, Residency]:
        """``step_make_resident``: ``keys`` (int64 [N], distinct, each looked up ``counts`` times)
        made resident in a host tier (``tier``, ``choice``) from the mmap cold store (``cold``; its
        log's rows and keys written through the file descriptors ``log_files``), the tier's slots at
        ``protected`` (int64, or None) kept. Returns ``(slots int64 [N], what it did)``; the slots
        hold nothing unless ``status`` is ``RESIDENT``."""
        slots = torch.empty(keys.numel(), dtype=torch.int64)
        done = Residency()
        self._functions["step_make_resident"](
            keys.data_ptr(),
            counts.data_ptr(),
            keys.numel(),
            pointer(protected),
            0 if protected is None else protected.numel(),
            ctypes.byref(tier),
            ctypes.byref(choice),
            ctypes.byref(cold),
            advise,
            log_files[0],
            log_files[1],
            ctypes.byref(initial),
            slots.data_ptr(),
            ctypes.byref(done),
        )
        return slots, done

    def lookup_bags(
        self,
        ids: torch.Tensor,
        padding: int | None,
        bags: Bags,
        max_rows: int,
        replay: tuple | None,
        admission: tuple,
    ) -> tuple[Distinct, torch.Tensor, tuple, Residency, int]:
        """``step_lookup_bags``: ``ids`` (int64 CPU, validated) deduplicated as ``distinct`` does,
        refused past ``max_rows`` distinct ones (status ``TOO_MANY``), replayed through LFU's shadow
        caches (``replay``: ``AgeingTuner.replay_arguments``, or None), made resident as
        ``make_resident`` does (``admission``: its arguments from ``tier`` to ``initial``) and pooled
        as ``pooled`` pools ``bags``. Returns ``(Distinct, slots int64 [U], pooled's three outputs,
        what it did, the lookups the replay sampled)``; slots and outputs hold nothing unless the
        status is ``RESIDENT``."""
        flat, entries, scratch, buffer = self._distinct_room(ids)
        slots = torch.empty(entries, dtype=torch.int64)
        outputs = out, entry_bag, scale = bags.outputs(entries)
        threshold, shadows, shadow_count, memory, hits = replay or (0, None, 0, 0.0, None)
        lookup = BagLookup(
            flat.data_ptr(),
            entries,
            -1 if padding is None else padding,
            padding is not None,
            scratch.data_ptr(),
            buffer.data_ptr(),
            max_rows,
            threshold,
            shadows,
            shadow_count,
            memory,
            hits,
            pointer(bags.offsets),
            bags.length,
            bags.last_end,
            bags.count,
            bags.mean,
            pointer(bags.weights),
            out.data_ptr(),
            bags.dim,
            entry_bag.data_ptr(),
            scale.data_ptr(),
        )
        tier, choice, cold, advise, (log_rows, log_keys), initial = admission
        done = Residency()
        self._functions["step_lookup_bags"](
            ctypes.byref(lookup),
            ctypes.byref(tier),
            ctypes.byref(choice),
            ctypes.byref(cold),
            advise,
            log_rows,
            log_keys,
            ctypes.byref(initial),
            slots.data_ptr(),
            ctypes.byref(done),
        )
        count = lookup.distinct_count
        distinct = Distinct(buffer, entries, count, count if padding is not None else -1)
        return distinct, slots[:count], outputs, done, lookup.sampled

    def will_need_homes(
        self, keys: torch.Tensor, table_keys: torch.Tensor, table_values: torch.Tensor
    ) -> None:
        """Ask for the pages of each of ``keys``' (int64) home position in a mapped table, all at once."""
        keys = keys.contiguous()
        self._functions["step_will_need_homes"](
            keys.data_ptr(),
            keys.numel(),
            table_keys.data_ptr(),
            table_values.data_ptr(),
            table_keys.numel() - 1,
        )

    def will_need_rows(self, array: np.ndarray, rows: torch.Tensor) -> None:
        """Ask for the pages of ``rows`` (int64, ascending) of a mapped ``[R, row bytes]`` uint8
        array, all at once (runs of pages merged)."""
        rows = rows.contiguous()
        self._functions["step_will_need_rows"](
            array.ctypes.data, array.shape[1], rows.data_ptr(), rows.numel()
        )

    def cold_stage(
        self, keys: torch.Tensor, rows: torch.Tensor, log: tuple, committed: int, check_bytes: int
    ) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """The mmap cold store's staging of ``rows`` (``[N, W]``, any dtype) of ``keys`` (int64 [N],
        distinct) in its log, ``log`` being ``(index keys, index values (int64 record numbers), stored
        rows uint8 [R, stored bytes], writable)``: rows whose record is at or past ``committed`` are
        stored over it; returns the others' ``(stored rows uint8 [M, stored bytes], keys [M], whether
        each had an older record bool [M])``, in order."""
        keys = keys.contiguous()
        raw = rows.contiguous().view(torch.uint8)
        count, row_bytes = keys.numel(), raw.shape[1]
        index_keys, index_values, log_rows = log
        out = np.empty((count, row_bytes + check_bytes), dtype=np.uint8)
        new_keys = torch.empty(count, dtype=torch.int64)
        superseded = torch.empty(count, dtype=torch.bool)
        packed = self._functions["step_cold_stage"](
            keys.data_ptr(),
            count,
            raw.data_ptr(),
            row_bytes,
            check_bytes,
            index_keys.data_ptr(),
            index_values.data_ptr(),
            index_keys.numel() - 1,
            committed,
            log_rows.ctypes.data if log_rows.size else None,
            out.ctypes.data,
            new_keys.data_ptr(),
            superseded.data_ptr(),
        )
        return out[:packed], new_keys[:packed], superseded[:packed]


@functools.lru_cache(maxsize=256)
def _positions(features: tuple[int, ...]) -> torch.Tensor:
    """int64 ``features``, made once per group layout (read only)."""
    return torch.tensor(features, dtype=torch.int64)


@functools.cache
def passes_of(library: ctypes.CDLL) -> StepPasses:
    """The passes of ``library``, made once per library."""
    return StepPasses(library)


def step_passes_of(kernels) -> StepPasses | None:
    """The passes of ``kernels`` (a ``HostKernels``/``CudaKernels`` or None): None unless it is a
    tuned host build."""
    library = getattr(kernels, "step_library", None)
    return None if library is None else passes_of(library)


@functools.cache
def host_passes() -> StepPasses | None:
    """The passes of this machine's tuned host build, None where it cannot be built (decided once)."""
    return step_passes_of(host_kernels(parallel=True)[0])


def distinct_ids(ids: torch.Tensor) -> torch.Tensor:
    """The distinct values of ``ids`` (int64 CPU): by hashing, in first-appearance order, where the
    tuned host build runs here (no sort); else ``torch.unique``'s, ascending."""
    passes = host_passes()
    if passes is None or ids.device.type != "cpu":
        return torch.unique(ids)
    return passes.unique(ids)
