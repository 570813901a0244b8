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
about as many times. A merge runs on a thread of its own at the lowest priority (``RunMerge``; its
two runs serve lookups until its run takes their place, at a later ``make_room``), so no step waits
for one unless seals run ``MERGES_BEHIND`` runs past a binary counter's. RAM: the table, plus 3 to 6
bytes a sealed entry (its filter's 2 to 4, its directory's 1 to 2). Runs describe only what this
process staged: reopening rebuilds the index from the committed log, and a killed process leaves no
file behind.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from ...hashing import key_mix, key_unmix
from ...kernels.native_types import LogRun, LogRuns
from ...kernels.step_passes import host_passes
from ..hash_index import HashIndex
from ..kernel_hash_table import KernelHashTable
from .mmap_files import write_at

SEAL_AT = 1 << 18  # keys the table holds before it is sealed into a run
MERGE_CHUNK = 1 << 16  # entries of each run merged at a time (the merge's memory)
LOG_CHUNK = 1 << 18  # the log's records a flush looks at, and its keys it applies, at a time
MERGES_BEHIND = 3  # runs a binary counter would have merged, sealed while a merge runs, before seals wait
_KEYS_A_FILTER_WORD = 4  # a run's filter has a word for about this many keys (rounded to a power of two)
_KEYS_A_BUCKET = 8  # a run's directory has an entry for about this many keys (rounded likewise)


class LogIndex:
    """Map ``int64 key >= 0 -> int64 value`` (never -1) for the mmap store's log, with ``HashIndex``'s
    ``find`` / ``insert`` / ``remove`` / ``make_room``. ``kernels``: the index kernels (None: torch
    ops, and runs without filters); ``directory``: where run files are made (unlinked; the system's
    temporary directory where it is read-only); ``merge_in_background``: merges on a thread of their
    own (else in the seal that asks for them)."""

    def __init__(
        self, directory: Path, kernels, seal_at: int | None = None, merge_in_background: bool = True
    ) -> None:
        self.directory = Path(directory)
        self._kernels = kernels
        self.seal_at = SEAL_AT if seal_at is None else seal_at
        self.merge_in_background = merge_in_background
        self._passes = host_passes() if kernels is not None else None  # the runs' filters, if any
        self.runs: list[SealedRun] = []
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
        """RAM held: the table and the runs' filters."""
        return self.table.nbytes + sum(run.filter_bytes for run in self.runs)

    @property
    def file_bytes(self) -> int:
        """Bytes of the runs' files (page cache while read, reclaimable)."""
        return sum(run.file_bytes for run in self.runs)

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Value of each key (int64 [N]), -1 where absent; repeated keys are fine."""
        found = self.table.find(keys)
        if not self.runs:
            return found
        missing = (found == -1).nonzero().squeeze(1).numpy()
        query = key_mix(keys.numpy()[missing])
        order = _ascending(query)  # so each run's binary searches narrow as they go
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
        keys, values = self.table.items()
        keys = np.concatenate([key_unmix(run.hashes) for run in self.runs] + [keys.numpy()])  # oldest first
        values = np.concatenate([run.values for run in self.runs] + [values.numpy()])
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
        (writing its run may raise ``OSError``, a full disk: the index is then unchanged). A merge
        finished meanwhile puts its run in place of its two."""
        if self.merge is not None and self.merge.done:
            self._merge_runs()
        if self.table.live and self.table.live + count > self.seal_at:
            self._seal()
        self.table.make_room(count)

    def settle(self) -> None:
        """Wait for merges under way, and those they lead to: the runs as merging in the seals
        would leave them."""
        self._merge_runs(wait=True)

    def clear(self) -> None:
        """Forget every entry (the log was emptied): the runs closed, the table empty."""
        self.close()
        self.table = self._new_table(min(1024, self.seal_at))

    def close(self) -> None:
        if self.merge is not None:  # its runs are read until it stops
            self.merge.cancel()
            self.merge = None
        for run in self.runs:
            run.close()
        self.runs = []
        self._set_native_runs()

    def _seal(self) -> None:
        keys, values = self.table.items()
        hashes = key_mix(keys.numpy())
        order = _ascending(hashes)
        self.runs.append(self._write_run(len(order), [(hashes[order], values.numpy()[order])]))
        self.table = self._new_table(self.seal_at)
        self._merge_runs()

    def _merge_runs(self, wait: bool = False) -> None:
        """A finished merge's run in place of its two, then the next merge the binary counter asks for
        started (in the background, or run here): two neighbouring runs, the older no more than twice
        the newer's length. Waits for a merge under way where ``wait``, or where the runs pass
        ``_runs_allowed``. A merge that failed (a full disk) leaves its runs, and the
        next seal tries again; one run here raises its error."""
        try:
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
                self.merge = RunMerge(self._write_run, *pair, self.merge_in_background)
        finally:  # the native lookups see the runs as they are, whatever was raised
            self._set_native_runs()

    def _runs_allowed(self) -> int:
        """Runs past which a seal waits for the merge under way: as many as a binary counter holds for
        the entries sealed, and ``MERGES_BEHIND`` more."""
        sealed = sum(run.length for run in self.runs)
        return (sealed // max(1, self.seal_at)).bit_length() + 1 + MERGES_BEHIND

    def _write_run(self, capacity: int, parts) -> SealedRun:
        """A run of up to ``capacity`` entries from ``parts`` (``(hashes, values)`` arrays: the keys'
        mixes, ascending and distinct across parts), written and synced before it is mapped."""
        file = temporary_file(self.directory)
        try:
            descriptor = file.fileno()
            os.posix_fallocate(descriptor, 0, 16 * capacity)  # a full disk fails here, before any change
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
        if not self.runs or self._passes is None:  # runs have filters where the passes are built
            self.native_runs, self._native_array = None, None
            return
        self._native_array = (LogRun * len(self.runs))(*(run.native() for run in self.runs))
        self.native_runs = LogRuns(ctypes.cast(self._native_array, ctypes.c_void_p), len(self.runs))


class RunMerge:
    """Two neighbouring runs merged into one (``_merged``: the newer's entry of a key wins) by
    ``write_run``, on a thread of its own where ``background`` (reading the two runs, which stay as
    they are until ``result`` is taken or the merge is cancelled), else right here."""

    def __init__(self, write_run, older: SealedRun, newer: SealedRun, background: bool) -> None:
        self.older, self.newer = older, newer
        self.cancelled = False
        self.error: BaseException | None = None  # why a merge in the background failed
        self._run: SealedRun | None = None
        self._thread = None
        if not background:  # its errors raised to the seal
            self._run = write_run(older.length + newer.length, _merged(older, newer, self))
            return
        self._thread = threading.Thread(target=self._merge, args=(write_run,), name="tierstore-log-merge")
        self._thread.daemon = True  # a process exiting mid-merge loses only an unlinked file
        self._thread.start()

    def _merge(self, write_run) -> None:
        _yield_to_every_other_thread()
        try:
            length = self.older.length + self.newer.length
            self._run = write_run(length, _merged(self.older, self.newer, self))
        except BaseException as error:  # a full disk, or cancelled: the two runs stay
            self.error = error

    @property
    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def result(self) -> SealedRun | None:
        """The merged run, once the merge is done (waiting for it); None where it failed."""
        if self._thread is not None:
            self._thread.join()
        return self._run

    def cancel(self) -> None:
        """Stop the merge at its next chunk and wait for it, its run (if any) closed."""
        self.cancelled = True
        run = self.result()
        if run is not None:
            run.close()


def _yield_to_every_other_thread() -> None:
    """The calling thread at the lowest priority (nice 19), so a merge takes the time the training
    steps leave a core idle; a hint, left out where the system has no per-thread priorities."""
    if hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:  # not permitted here: the merge runs at the process's priority
            pass


class MergeCancelled(Exception):
    """A ``RunMerge`` stopped by ``cancel``."""


class SealedRun:
    """One run in ``file``: ``length`` mixes of keys (``key_mix``, ascending uint64) at its start, their
    values ``capacity`` entries on, mapped read-only; without the kernels nothing else, on them in
    RAM its filter (int64 words) and directory (``starts``, int64 [2^bits + 1]: the mixes whose top
    ``bits`` are j lie at ``starts[j]`` to ``starts[j + 1] - 1``)."""

    def __init__(self, file, length: int, capacity: int, passes) -> None:
        self.file, self.length = file, length
        self.file_bytes = 16 * capacity
        self._map = mmap.mmap(file.fileno(), self.file_bytes, prot=mmap.PROT_READ)
        self._map.madvise(mmap.MADV_RANDOM)  # binary searches: no read-ahead
        self.hashes = np.frombuffer(self._map, np.uint64, length, 0)
        self.values = np.frombuffer(self._map, np.int64, length, 8 * capacity)
        self.filter = self.starts = None
        if passes is not None:
            self.filter = torch.zeros(_power_of_two(length, _KEYS_A_FILTER_WORD), dtype=torch.int64)
            passes.log_filter(self.hashes, self.filter)
            self.bits = max(1, _power_of_two(length, _KEYS_A_BUCKET).bit_length() - 1)
            firsts = np.arange(1 << self.bits, dtype=np.uint64) << np.uint64(64 - self.bits)
            self.starts = np.append(np.searchsorted(self.hashes, firsts), length).astype(np.int64)

    @property
    def filter_bytes(self) -> int:
        """RAM it holds: the filter and the directory."""
        return 0 if self.filter is None else self.filter.nbytes + self.starts.nbytes

    def native(self) -> LogRun:
        return LogRun(
            self.hashes.ctypes.data,
            self.values.ctypes.data,
            self.length,
            self.filter.data_ptr(),
            self.filter.numel() - 1,
            self.starts.ctypes.data,
            64 - self.bits,
        )

    def close(self) -> None:
        self.hashes = self.values = None
        try:
            self._map.close()
        except BufferError:  # a view still exported: the map closes when it goes
            pass
        self.file.close()


def _ascending(hashes: np.ndarray) -> np.ndarray:
    """The order that sorts ``hashes`` (uint64) ascending: torch's sort (a radix sort, several times
    numpy's argsort on a table's worth) of them as int64 with the top bit flipped, their unsigned
    order."""
    return torch.sort(torch.from_numpy((hashes ^ np.uint64(1 << 63)).view(np.int64)))[1].numpy()


def _power_of_two(length: int, per_item: int) -> int:
    """The power of two nearest above ``length / per_item`` (at least 1)."""
    return 1 << max(0, (-(-length // per_item) - 1).bit_length())


def _merged(older: SealedRun, newer: SealedRun, merge: RunMerge):
    """``(hashes, values)`` parts of the two runs merged in the mixes' order, ``MERGE_CHUNK`` of each
    run at a time, a key in both taking ``newer``'s value; ``MergeCancelled`` once ``merge`` is
    cancelled."""
    i = j = 0
    while i < older.length or j < newer.length:
        if merge.cancelled:
            raise MergeCancelled
        stop_i, stop_j = min(older.length, i + MERGE_CHUNK), min(newer.length, j + MERGE_CHUNK)
        ends = [run.hashes[stop - 1] for run, stop in ((older, stop_i), (newer, stop_j)) if stop < run.length]
        if ends:  # every entry up to the bound, from both runs: a key in both meets itself here
            bound = min(ends)
            stop_i = i + int(np.searchsorted(older.hashes[i:stop_i], bound, "right"))
            stop_j = j + int(np.searchsorted(newer.hashes[j:stop_j], bound, "right"))
        hashes = np.concatenate([older.hashes[i:stop_i], newer.hashes[j:stop_j]])
        values = np.concatenate([older.values[i:stop_i], newer.values[j:stop_j]])
        order = np.argsort(hashes, kind="stable")  # older first among equal mixes (equal keys)
        yield last_of_each(hashes[order], values[order])
        i, j = stop_i, stop_j


def last_of_each(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The last entry of each key of ``keys`` (sorted; keys or their mixes) and its value."""
    last = np.append(keys[1:] != keys[:-1], True)[: keys.size]
    return keys[last], values[last]


def temporary_file(directory: Path):
    """An unlinked file in ``directory`` (the system's temporary directory where it cannot be made there)."""
    try:
        return tempfile.TemporaryFile(dir=directory)
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        return tempfile.TemporaryFile()


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
