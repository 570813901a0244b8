"""The native passes between a host tier and the mmap cold store: rows read and staged, misses
made resident in one call, bags pooled from the rows where they lie (``StepPasses``' part)."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from .native_types import (
    BagLookup,
    Bags,
    ColdFiles,
    Distinct,
    HostTierArrays,
    InitialRows,
    Residency,
    TierChoice,
    pointer,
)


class ColdPasses:
    """``StepPasses``' calls on the mmap cold store's files (``tiers.cold.mmap_store``)."""

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
        past the count are not read), ``log`` the same but for the count and with the index's sealed
        runs (``LogIndex.native_runs``, None: none) after its values (None: no log). Returns
        ``(row bytes uint8 [N, row_bytes], found bool [N], rows failing their check, the first of
        them)``; rows of keys not found are unspecified. ``advise``: the main index's and rows' pages
        are asked for first, all at once (``MADV_WILLNEED``: for files mostly on disk)."""
        keys = keys.contiguous()
        count = keys.numel()
        out = torch.empty(count, row_bytes, dtype=torch.uint8)
        found = torch.empty(count, dtype=torch.bool)
        first_bad = torch.empty(1, dtype=torch.int64)
        main_keys, main_values, main_rows, main_count = main
        log_keys, log_values, log_runs, log_rows = log if log is not None else (None,) * 4
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
            None if log_runs is None else ctypes.byref(log_runs),
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
        out, entry_bag, scale = bags.outputs(entries)
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
        outputs = (out, None, None) if lookup.own_bags else (out, entry_bag, scale)
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
        distinct) in its log, ``log`` being ``(index keys, index values (int64 record numbers), the
        index's sealed runs (``LogIndex.native_runs``, None: none), stored rows uint8 [R, stored bytes],
        writable)``: rows whose record is at or past ``committed`` are
        stored over it; returns the others' ``(stored rows uint8 [M, stored bytes], keys [M], whether
        each had an older record bool [M])``, in order."""
        keys = keys.contiguous()
        raw = rows.contiguous().view(torch.uint8)
        count, row_bytes = keys.numel(), raw.shape[1]
        index_keys, index_values, runs, log_rows = log
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
            None if runs is None else ctypes.byref(runs),
            committed,
            log_rows.ctypes.data if log_rows.size else None,
            out.ctypes.data,
            new_keys.data_ptr(),
            superseded.data_ptr(),
        )
        return out[:packed], new_keys[:packed], superseded[:packed]

    def log_filter(self, hashes: np.ndarray, words: torch.Tensor) -> None:
        """Set the bits of the keys whose mixes are ``hashes`` (uint64 [N], contiguous: ``key_mix``) in
        a sealed log run's filter ``words`` (int64, a power of two of them), as ``host_step.cpp``'s
        lookups test them."""
        self._functions["step_log_filter"](
            hashes.ctypes.data, hashes.size, words.data_ptr(), words.numel() - 1
        )

    def prepare_pages(self, descriptor: int, first: int, end: int) -> None:
        """Zeros over bytes ``[first, end)`` of the file open as ``descriptor`` (past everything written
        to it), so that its page cache pages exist before writes reach them; a failed write is left
        (a hint). The GIL is released meanwhile."""
        self._functions["step_prepare_pages"](descriptor, first, end)

    def merge_runs(
        self, older: tuple[np.ndarray, np.ndarray], newer: tuple[np.ndarray, np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Two sealed runs' ``(mixes uint64, values int64)`` parts (each ascending, distinct, contiguous)
        merged in ascending order, a mix in both taking ``newer``'s value (the GIL released meanwhile)."""
        room = older[0].size + newer[0].size
        hashes, values = np.empty(room, np.uint64), np.empty(room, np.int64)
        count = self._functions["step_merge_runs"](
            older[0].ctypes.data,
            older[1].ctypes.data,
            older[0].size,
            newer[0].ctypes.data,
            newer[1].ctypes.data,
            newer[0].size,
            hashes.ctypes.data,
            values.ctypes.data,
        )
        return hashes[:count], values[:count]
