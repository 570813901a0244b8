"""The log index's sealed runs (``log_index.LogIndex``): a run of keys' mixes and their values in an
unlinked file (``SealedRun``), and its making, on a thread of its own or
right where it is asked for (``RunBuild``): a table's entries sealed (``RunSeal``), or two runs
merged (``RunMerge``), what they read left as it is until the run takes its place.
"""

from __future__ import annotations

import errno
import mmap
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from ...hashing import key_mix
from ...kernels.native_types import LogRun

MERGE_CHUNK = 1 << 16  # entries of each run merged at a time (the merge's memory)
_KEYS_A_FILTER_WORD = 4  # a run's filter has a word for about this many keys (rounded to a power of two)
_KEYS_A_BUCKET = 8  # a run's directory has an entry for about this many keys (rounded likewise)


class RunBuild:
    """A run made by ``build(self)``, on a thread of its own (at the process's priority: a step that
    waits for it must not wait on a starved thread) where
    ``background`` (what it reads stays as it is until ``result`` is taken or it is cancelled), else
    right here (its errors raised)."""

    def __init__(self, build, background: bool) -> None:
        self.cancelled = False
        self.error: BaseException | None = None  # why a build in the background failed
        self._run: SealedRun | None = None
        self._thread = None
        if not background:
            self._run = build(self)
            return
        # not a daemon: a process ending waits for it (one stopped inside torch or the kernels aborts)
        self._thread = threading.Thread(target=self._build, args=(build,), name="tierstore-log-run")
        self._thread.start()

    def _build(self, build) -> None:
        try:
            self._run = build(self)
        except BaseException as error:  # a full disk, or cancelled: what it read stays
            self.error = error

    @property
    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def result(self) -> SealedRun | None:
        """The run, once made (waiting for it); None where it failed."""
        if self._thread is not None:
            self._thread.join()
        return self._run

    def cancel(self) -> None:
        """Stop at the next chunk and wait, the run (if any) closed."""
        self.cancelled = True
        run = self.result()
        if run is not None:
            run.close()


class RunMerge(RunBuild):
    """Two neighbouring runs merged into one (``merged``, by ``passes`` where given: the newer's
    entry of a key wins), in a file from ``run_file`` written by ``write_run``."""

    def __init__(
        self, run_file, write_run, older: SealedRun, newer: SealedRun, background: bool, passes=None
    ) -> None:
        self.older, self.newer = older, newer
        length = older.length + newer.length

        def build(merge: RunBuild) -> SealedRun:
            return write_run(run_file(length), length, merged(older, newer, merge, passes))

        super().__init__(build, background)


class RunSeal(RunBuild):
    """A table's entries (no longer changed) sorted by their keys' mixes into a run, in ``file``
    (allocated for them) written by ``write_run``."""

    def __init__(self, write_run, table, file, background: bool) -> None:
        self.table = table
        super().__init__(lambda seal: write_run(file, table.live, sorted_entries(table, seal)), background)


class BuildCancelled(Exception):
    """A ``RunBuild`` stopped by ``cancel``."""


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


def ascending(hashes: np.ndarray) -> np.ndarray:
    """The order that sorts ``hashes`` (uint64) ascending: torch's sort (a radix sort, several times
    numpy's argsort on a table's worth) of them as int64 with the top bit flipped, their unsigned
    order."""
    return torch.sort(torch.from_numpy((hashes ^ np.uint64(1 << 63)).view(np.int64)))[1].numpy()


def _power_of_two(length: int, per_item: int) -> int:
    """The power of two nearest above ``length / per_item`` (at least 1)."""
    return 1 << max(0, (-(-length // per_item) - 1).bit_length())


def sorted_entries(table, seal: RunBuild):
    """The ``(hashes, values)`` part of ``table``'s entries in their mixes' order."""
    keys, values = table.items()
    hashes = key_mix(keys.numpy())
    if seal.cancelled:
        raise BuildCancelled
    order = ascending(hashes)
    yield hashes[order], values.numpy()[order]


def merged(older: SealedRun, newer: SealedRun, merge: RunBuild, passes=None):
    """``(hashes, values)`` parts of the two runs merged in the mixes' order, ``MERGE_CHUNK`` of each
    run at a time, a key in both taking ``newer``'s value (by the native pass of ``passes`` where
    given, one linear pass a chunk, else by a stable sort); ``BuildCancelled`` once ``merge`` is
    cancelled."""
    i = j = 0
    while i < older.length or j < newer.length:
        if merge.cancelled:
            raise BuildCancelled
        stop_i, stop_j = min(older.length, i + MERGE_CHUNK), min(newer.length, j + MERGE_CHUNK)
        ends = [run.hashes[stop - 1] for run, stop in ((older, stop_i), (newer, stop_j)) if stop < run.length]
        if ends:  # every entry up to the bound, from both runs: a key in both meets itself here
            bound = min(ends)
            stop_i = i + int(np.searchsorted(older.hashes[i:stop_i], bound, "right"))
            stop_j = j + int(np.searchsorted(newer.hashes[j:stop_j], bound, "right"))
        parts = (
            (older.hashes[i:stop_i], older.values[i:stop_i]),
            (newer.hashes[j:stop_j], newer.values[j:stop_j]),
        )
        yield passes.merge_runs(*parts) if passes is not None else _sorted_merge(*parts)
        i, j = stop_i, stop_j


def _sorted_merge(older: tuple, newer: tuple) -> tuple[np.ndarray, np.ndarray]:
    """``ColdPasses.merge_runs`` by a stable sort: older first among equal mixes (equal keys), the
    last of them kept."""
    hashes, values = np.concatenate([older[0], newer[0]]), np.concatenate([older[1], newer[1]])
    order = np.argsort(hashes, kind="stable")
    return last_of_each(hashes[order], values[order])


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
