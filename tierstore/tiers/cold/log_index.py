"""The cold stores' log index: each key staged since the last flush -> its last record in the log
(the mmap store's write-ahead log, the LMDB store's staging log: the record's number, or ``-2 -
number`` where that record removes the key), in memory bounded however long the log grows.

The newest entries live in a hash table (``KernelHashTable`` on the kernels, else ``HashIndex``) of
at most ``SEAL_AT`` keys. When more would pass that, the table is sealed: its entries, sorted by their
keys' mixes (``hashing.key_mix``, a bijection: a run holds mixes, not keys), are written to an
unlinked file beside the store (written in order and synced, so their pages are clean and the kernel
reclaims them under a memory limit) and mapped; the table starts again empty. On the kernels a run
also keeps in RAM a filter (a 64-bit word for about 4 keys) and a directory (where the mixes of each
value of their top bits start, about 8 keys apart), so the native lookups ask the table, then the
runs newest first: where the filter does not rule the key out, the directory points at the few mixes
to compare (a cache line or two, not a binary search's ~20 in a file far larger than the caches).
Lookups from Python binary-search the mixes. Runs merge pairwise as a binary counter (the newer
run's entry of a key wins), so they stay about ``log2(entries / SEAL_AT)`` and an entry is rewritten
about as many times. Seals and merges run on a thread of their own
(``RunSeal``, ``RunMerge``): the table being sealed, or the two runs being merged, serve lookups
until the run takes their place (at a later ``make_room``), so no step waits for them, unless seals
come faster than the thread keeps up with (a seal waits for the one before; seals wait for merges
``MERGES_BEHIND`` runs past a binary counter's). RAM: the table (two while a seal runs), plus 3 to
6 bytes a sealed entry (its filter's 2 to 4, its directory's 1 to 2). Runs describe only what this
process staged: reopening rebuilds the index from the committed log, and a killed process leaves no
file behind.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import torch

from ...hashing import key_mix, key_unmix
from ...kernels.native_types import LogRun, LogRuns
from ...kernels.step_passes import host_passes
from ..hash_index import HashIndex
from ..kernel_hash_table import KernelHashTable
from .mmap_files import write_at
from .sealed_runs import RunMerge, RunSeal, SealedRun, ascending, last_of_each, temporary_file

SEAL_AT = 1 << 18  # keys the table holds before it is sealed into a run
LOG_CHUNK = 1 << 18  # the log's records a flush looks at, and its keys it applies, at a time
MERGES_BEHIND = 3  # runs a binary counter would have merged, sealed while a merge runs, before seals wait


class LogIndex:
    """Map ``int64 key >= 0 -> int64 value`` (never -1) for the mmap store's log, with ``HashIndex``'s
    ``find`` / ``insert`` / ``remove`` / ``make_room``. ``kernels``: the index kernels (None: torch
    ops, and runs without filters); ``directory``: where run files are made (unlinked; the system's
    temporary directory where it is read-only); ``in_background``: seals and merges on a thread of
    their own (else in the ``make_room`` that asks for them)."""

    def __init__(
        self, directory: Path, kernels, seal_at: int | None = None, in_background: bool = True
    ) -> None:
        self.directory = Path(directory)
        self._kernels = kernels
        self.seal_at = SEAL_AT if seal_at is None else seal_at
        self.in_background = in_background
        self._passes = host_passes() if kernels is not None else None  # the runs' filters, if any
        self.runs: list[SealedRun] = []
        self.sealing: RunSeal | None = None  # the table being sealed, newer than every run
        self.merge: RunMerge | None = None  # the merge under way
        self.native_runs: LogRuns | None = None  # the runs as the native lookups take them
        self._native_array = None
        self.clear()

    def _new_table(self, capacity: int) -> HashIndex | KernelHashTable:
        if self._kernels is None:
            return HashIndex(capacity)
        return KernelHashTable(capacity, self._kernels, value_dtype=torch.int64, huge_pages=False)

    @property
    def keys(self) -> torch.Tensor:
        """The table's keys (for the native passes, with ``values`` and ``native_runs``)."""
        return self.table.keys

    @property
    def values(self) -> torch.Tensor:
        return self.table.values

    @property
    def nbytes(self) -> int:
        """RAM held: the table (and the one being sealed) and the runs' filters."""
        frozen = 0 if self.sealing is None else self.sealing.table.nbytes
        return self.table.nbytes + frozen + sum(run.filter_bytes for run in self.runs)

    @property
    def file_bytes(self) -> int:
        """Bytes of the runs' files (page cache while read, reclaimable)."""
        return sum(run.file_bytes for run in self.runs)

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Value of each key (int64 [N]), -1 where absent; repeated keys are fine."""
        found = self.table.find(keys)
        if self.sealing is not None:
            missing = found == -1
            found[missing] = self.sealing.table.find(keys[missing])
        if not self.runs:
            return found
        missing = (found == -1).nonzero().squeeze(1).numpy()
        query = key_mix(keys.numpy()[missing])
        order = ascending(query)  # so each run's binary searches narrow as they go
        missing, query = missing[order], query[order]
        for run in reversed(self.runs):
            if not missing.size:
                break
            at = np.minimum(np.searchsorted(run.hashes, query), run.length - 1)
            hit = run.hashes[at] == query
            found[torch.from_numpy(missing[hit])] = torch.from_numpy(run.values[at[hit]])
            missing, query = missing[~hit], query[~hit]
        return found

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every key and its value (int64 [n] each), by key: all of them in RAM at once, so for
        listing the staged keys, not for a training step."""
        tables = [self.table] if self.sealing is None else [self.sealing.table, self.table]
        listed = [table.items() for table in tables]
        keys = np.concatenate([key_unmix(run.hashes) for run in self.runs] + [k.numpy() for k, _ in listed])
        values = np.concatenate([run.values for run in self.runs] + [v.numpy() for _, v in listed])
        order = np.argsort(keys, kind="stable")
        keys, values = last_of_each(keys[order], values[order])
        return torch.from_numpy(keys), torch.from_numpy(values)

    def insert(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``keys`` (distinct, not in the table) with ``values``, sealing the table as it fills;
        an entry supersedes the runs' entries of its key."""
        for start, stop in self.parts_with_room(keys.numel()):
            self.table.insert(keys[start:stop], values[start:stop])

    def parts_with_room(self, count: int):
        """``(start, stop)`` of a batch of ``count`` keys, at most ``seal_at`` at a time, the table's
        room made for each part before it is yielded: a seal failing on a full disk raises here,
        before the caller writes anything of that part."""
        step = max(1, self.seal_at)
        for start in range(0, count, step):
            stop = min(count, start + step)
            self.make_room(stop - start)
            yield start, stop

    def remove(self, keys: torch.Tensor) -> torch.Tensor:
        """Drop the table's entries of ``keys`` (distinct; the caller inserts their new values next,
        which supersede the runs'); returns the dropped values (-1 where the table had none)."""
        return self.table.remove(keys)

    def make_room(self, count: int) -> None:
        """Room in the table for ``count`` more keys: sealed first where they would pass ``seal_at``
        (its run's file allocated first: a full disk raises ``OSError`` with the index unchanged).
        A seal or merge finished meanwhile puts its run in place."""
        if any(build is not None and build.done for build in (self.sealing, self.merge)):
            self._settle_runs()
        if self.table.live and self.table.live + count > self.seal_at:
            self._seal()
        self.table.make_room(count)

    def settle(self) -> None:
        """Wait for the seal and the merges under way, and those they lead to: the runs as sealing
        and merging in ``make_room`` would leave them."""
        self._settle_runs(wait=True)

    def clear(self) -> None:
        """Forget every entry (the log was emptied): the runs closed, the table empty."""
        self.close()
        self.table = self._new_table(min(1024, self.seal_at))

    def close(self) -> None:
        for build in (self.merge, self.sealing):  # what they read is read until they stop
            if build is not None:
                build.cancel()
        self.merge = self.sealing = None
        for run in self.runs:
            run.close()
        self.runs = []
        self._set_native_runs()

    def _seal(self) -> None:
        """The table frozen and sealed into a run (``RunSeal``), a new one taking its place; a seal
        under way is finished first. Its file is allocated here: a full disk raises before any change."""
        if self.sealing is not None:
            self._settle_runs(seal=True)
        file = self._run_file(self.table.live)
        seal = RunSeal(self._write_run, self.table, file, self.in_background)  # here: raises, or done
        self.table, self.sealing = self._new_table(self.seal_at), seal
        if self.in_background:  # its run in place at a later make_room; the frozen table answers now
            self._set_native_runs()
        else:
            self._settle_runs()

    def _settle_runs(self, wait: bool = False, seal: bool = False) -> None:
        """A finished seal's run added (waiting for it where ``wait`` or ``seal``; sealed again here
        where it failed in the background, raising its error where it fails again, the index
        unchanged), then merges: a finished merge's run in place of its two, and the next merge the
        binary counter asks for started (in the background, or run here): two neighbouring runs, the
        older no more than twice the newer's length. Waits for a merge under way where ``wait``, or
        where the runs pass ``_runs_allowed``. A merge that failed (a full disk) leaves its runs, and
        the next seal tries again; one run here raises its error."""
        try:
            sealing = self.sealing
            if sealing is not None and (wait or seal or sealing.done):
                run = sealing.result()
                if run is None:  # failed in the background: sealed again here
                    table = sealing.table
                    run = RunSeal(self._write_run, table, self._run_file(table.live), False).result()
                self.runs.append(run)
                self.sealing = None
            while True:
                merge = self.merge
                if merge is not None:
                    if not (wait or merge.done or len(self.runs) > self._runs_allowed()):
                        break
                    self.merge, merged = None, merge.result()
                    if merged is None:
                        break
                    at = self.runs.index(merge.older)
                    self.runs[at : at + 2] = [merged]
                    merge.older.close()
                    merge.newer.close()
                pair = next(
                    (
                        self.runs[at : at + 2]
                        for at in reversed(range(len(self.runs) - 1))
                        if self.runs[at].length <= 2 * self.runs[at + 1].length
                    ),
                    None,
                )
                if pair is None:
                    break
                self.merge = RunMerge(
                    self._run_file, self._write_run, *pair, self.in_background, self._passes
                )
        finally:  # the native lookups see the runs as they are, whatever was raised
            self._set_native_runs()

    def _runs_allowed(self) -> int:
        """Runs past which a seal waits for the merge under way: as many as a binary counter holds for
        the entries sealed, and ``MERGES_BEHIND`` more."""
        sealed = sum(run.length for run in self.runs)
        return (sealed // max(1, self.seal_at)).bit_length() + 1 + MERGES_BEHIND

    def _run_file(self, capacity: int):
        """A run's file for up to ``capacity`` entries, its blocks allocated (a full disk raises here)."""
        file = temporary_file(self.directory)
        try:
            os.posix_fallocate(file.fileno(), 0, 16 * max(1, capacity))
        except BaseException:
            file.close()
            raise
        return file

    def _write_run(self, file, capacity: int, parts) -> SealedRun:
        """A run of up to ``capacity`` entries in ``file`` (``_run_file``'s) from ``parts``
        (``(hashes, values)`` arrays: the keys' mixes, ascending and distinct across parts), written
        and synced before it is mapped; the file closed where this raises."""
        try:
            descriptor = file.fileno()
            length = 0
            for keys, values in parts:
                write_at(descriptor, keys, 8 * length)
                write_at(descriptor, values, 8 * (capacity + length))
                length += len(keys)
            os.fdatasync(descriptor)
            return SealedRun(file, length, capacity, self._passes)
        except BaseException:
            file.close()
            raise

    def _set_native_runs(self) -> None:
        frozen = None if self.sealing is None else self.sealing.table
        if self._passes is None or (not self.runs and frozen is None):  # filters where passes are built
            self.native_runs, self._native_array = None, None
            return
        self._native_array = (LogRun * len(self.runs))(*(run.native() for run in self.runs))
        table = (0, 0, -1)  # the table being sealed: its keys, values and mask (-1: none)
        if frozen is not None:
            table = (frozen.keys.data_ptr(), frozen.values.data_ptr(), frozen.keys.numel() - 1)
        self.native_runs = LogRuns(ctypes.cast(self._native_array, ctypes.c_void_p), len(self.runs), *table)


class StagedLog:
    """What a flush applies: each key of the log once, with its last record's value in the log index
    and its row in ``rows.bin`` (-1: none), as int64 triples in an unlinked file, appended and read
    back ``LOG_CHUNK`` at a time, so a flush's memory is a chunk's however long the log."""

    def __init__(self, directory: Path) -> None:
        self.file = temporary_file(directory)
        self.length = 0
        self.new_rows = 0  # keys that take a new row in rows.bin (not in it, and not removed)

    def append(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor) -> None:
        triples = torch.stack([keys, values, rows], 1).numpy()
        write_at(self.file.fileno(), triples, 24 * self.length)  # a full disk raises here
        self.length += len(triples)
        self.new_rows += int(((rows < 0) & (values >= 0)).sum())

    @staticmethod
    def record_chunks(count: int):
        """``(start, stop)`` of the log's first ``count`` records, ``LOG_CHUNK`` at a time."""
        for start in range(0, count, LOG_CHUNK):
            yield start, min(count, start + LOG_CHUNK)

    def written(self) -> None:
        """Synced: its pages clean, which a memory limit can reclaim until they are read back."""
        os.fdatasync(self.file.fileno())

    def chunks(self):
        """``(keys, values, rows)`` int64 tensors, ``LOG_CHUNK`` keys at a time, in order."""
        for start in range(0, self.length, LOG_CHUNK):
            count = min(LOG_CHUNK, self.length - start)
            raw = os.pread(self.file.fileno(), 24 * count, 24 * start)
            triples = torch.from_numpy(np.frombuffer(raw, np.int64).reshape(count, 3).copy())
            yield triples[:, 0].contiguous(), triples[:, 1].contiguous(), triples[:, 2].contiguous()

    def close(self) -> None:
        self.file.close()
