"""``DiskIndex``: the mmap cold store's map key -> row number, kept in a file and memory-mapped.

Opening a store reads none of it, and its pages are page cache the kernel can reclaim, not
anonymous memory: a table's index no longer has to fit in RAM (nor be rebuilt at every open).

``index.bin``: a 4 KiB header of int64 fields, then ``keys [P]`` (-1: empty) and ``rows [P]``, P a
power of two, linear probing by the kernels' ``index_*`` calls as ``KernelHashTable`` (erase
shifts entries back: no tombstones). The header says which committed state the table matches:
``rows`` and ``keys_crc32`` as ``state.json`` records them, and ``pending``, the row count being
added while new keys go in (their ids already written to ``keys.bin``). ``MmapColdStore`` calls
``begin(pending)`` before inserting them and ``commit(rows, crc)`` after its state is committed; a
process killed between the two leaves ``pending`` set, and the keys of rows ``rows..pending`` are
erased again (``repair``) before any row is appended. Lookups ignore rows at or past the count the
caller gives (a reader's committed count), so uncommitted entries are never read. Growing
rehashes, a chunk at a time, into a new file renamed over the old one (a reader keeps the old).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import torch

from ...metadata import fsync_directory
from ..kernel_hash_table import MAX_LOAD, KernelHashTable, positions_for

INDEX_FILE = "index.bin"
_HEADER_ITEMS = 512  # int64 items: 4 KiB, so the arrays start page-aligned
_MAGIC = 0x3158444953544954  # "TITSIDX1" as little-endian bytes
_FIELDS = {
    "magic": 0,
    "positions": 1,
    "rows": 2,
    "keys_crc32": 3,
    "pending": 4,
    "pending_crc32": 5,
    "live": 6,
    "removed": 7,  # removed rows of the committed state it matches (``MmapColdStore``'s removed.bin)
}
_NONE = -1
_REHASH_CHUNK = 1 << 20  # positions re-placed at once when growing


class DiskIndex(KernelHashTable):
    """The table in ``path`` (which must exist: ``create`` or an earlier run made it)."""

    def __init__(self, path: Path, kernels, read_only: bool) -> None:
        self.path, self.read_only = Path(path), read_only
        self._setup(kernels, "cpu", torch.int64)
        self._map()

    @classmethod
    def create(cls, path: Path, kernels, capacity: int, rows: int, keys_crc32: int | None) -> DiskIndex:
        """An empty table for ``capacity`` keys at ``path`` (replacing any), matching ``rows``."""
        _write_empty(path, positions_for(capacity), rows, keys_crc32)
        return cls(path, kernels, read_only=False)

    def _map(self) -> None:
        mode = "c" if self.read_only else "r+"  # a reader's pages are private and never written
        whole = np.memmap(self.path, dtype=np.int64, mode=mode)
        positions = int(whole[_FIELDS["positions"]]) if whole.size >= _HEADER_ITEMS else 0
        if (
            whole[_FIELDS["magic"]] != _MAGIC
            or positions <= 0
            or positions & (positions - 1)
            or whole.size != _HEADER_ITEMS + 2 * positions
        ):
            raise ValueError(f"{self.path} is not a key index of this format")
        if hasattr(whole._mmap, "madvise"):  # probes land anywhere: no read-ahead around them
            whole._mmap.madvise(mmap.MADV_RANDOM)
        self._whole = whole
        self._header = whole[:_HEADER_ITEMS]
        self.keys = torch.from_numpy(whole[_HEADER_ITEMS : _HEADER_ITEMS + positions])
        self.values = torch.from_numpy(whole[_HEADER_ITEMS + positions :])
        self.live = int(self._header[_FIELDS["live"]])
        self.tombstones = 0

    def header(self, field: str) -> int | None:
        value = int(self._header[_FIELDS[field]])
        return None if value == _NONE and field in ("keys_crc32", "pending", "pending_crc32") else value

    def _set(self, field: str, value: int | None) -> None:
        self._header[_FIELDS[field]] = _NONE if value is None else value

    @property
    def nbytes(self) -> int:
        """Anonymous memory: none (the table is a mapped file)."""
        return 0

    @property
    def file_bytes(self) -> int:
        return self._whole.nbytes

    def matches(self, rows: int, keys_crc32: int | None) -> bool:
        """Whether the table holds exactly the keys of committed rows ``0..rows`` (no rows pending)."""
        return (
            self.header("pending") is None
            and self.header("rows") == rows
            and (self.header("keys_crc32") == keys_crc32)
        )

    def matches_before_pending(self, rows: int, keys_crc32: int | None) -> bool:
        """Whether the table matches the committed state ``rows`` / ``keys_crc32`` but for keys of
        rows past it that a killed process was adding (``repair`` erases them)."""
        return (
            self.header("pending") is not None
            and self.header("rows") == rows
            and (self.header("keys_crc32") == keys_crc32)
        )

    def set_removed(self, removed: int, sync: bool = True) -> None:
        """The table matches a state with ``removed`` removed rows (-1: it is being changed and matches
        none: a process killed meanwhile leaves it to be rebuilt); ``sync``: written to the file
        at once (else with the next ``commit``)."""
        self._set("removed", removed)
        if sync:
            self._whole.flush()

    def begin(self, pending: int, pending_crc32: int | None) -> None:
        """Rows up to ``pending`` (their keys' CRC32 ``pending_crc32``) are about to have their
        keys inserted."""
        self._set("pending", pending)
        self._set("pending_crc32", pending_crc32)
        self._whole.flush()

    def completed(self, rows: int, keys_crc32: int | None) -> bool:
        """Whether the rows pending are those of the committed state ``rows`` / ``keys_crc32``: the
        process that added them died after committing them, with every key in (``commit`` finishes)."""
        return self.header("pending") == rows and self.header("pending_crc32") == keys_crc32

    def commit(self, rows: int, keys_crc32: int | None) -> None:
        """The table now matches the committed state ``rows`` / ``keys_crc32``."""
        self._set("rows", rows)
        self._set("keys_crc32", keys_crc32)
        self._set("pending", None)
        self._set("pending_crc32", None)
        self._set("live", self.live)
        self._whole.flush()

    def repair(self, pending_keys: torch.Tensor) -> None:
        """Erase ``pending_keys`` (those of rows ``rows..pending``, from ``keys.bin``) and clear pending."""
        for part in pending_keys.split(_REHASH_CHUNK):
            self.remove(part)
        self.commit(self.header("rows"), self.header("keys_crc32"))

    def insert(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.live + keys.numel() > MAX_LOAD * self.keys.numel():  # doubled: 16 to 64 bytes a key
            self._rehash(max(2 * self.keys.numel(), positions_for(self.live + keys.numel())))
        self._place(keys.to(torch.int64).contiguous(), values.to(torch.int64).contiguous())
        self._set("live", self.live)

    def remove(self, keys: torch.Tensor) -> torch.Tensor:
        former = super().remove(keys)
        self._set("live", self.live)
        return former

    def _rehash(self, positions: int) -> None:
        """Re-place every key in a new file of ``positions`` renamed over this one."""
        partial = self.path.with_name(self.path.name + ".grow")
        old_keys, old_values = self.keys, self.values
        _write_empty(partial, positions, self.header("rows"), self.header("keys_crc32"))
        grown = DiskIndex(partial, self.kernels, read_only=False)
        grown._set("pending", self.header("pending"))
        grown._set("pending_crc32", self.header("pending_crc32"))
        grown._set("removed", self.header("removed"))
        for start in range(0, old_keys.numel(), _REHASH_CHUNK):
            keys = old_keys[start : start + _REHASH_CHUNK]
            live = keys >= 0
            if bool(live.any()):
                grown._place(
                    keys[live].contiguous(), old_values[start : start + _REHASH_CHUNK][live].contiguous()
                )
        grown._set("live", grown.live)
        grown._whole.flush()
        os.replace(partial, self.path)
        fsync_directory(self.path.parent)
        self._map()

    def sync(self) -> None:
        self._set("live", self.live)
        self._whole.flush()


def _write_empty(path: Path, positions: int, rows: int, keys_crc32: int | None) -> None:
    """A table of ``positions`` empty positions at ``path``, its header matching ``rows``."""
    header = np.zeros(_HEADER_ITEMS, dtype=np.int64)
    header[_FIELDS["magic"]] = _MAGIC
    header[_FIELDS["positions"]] = positions
    header[_FIELDS["rows"]] = rows
    header[_FIELDS["keys_crc32"]] = _NONE if keys_crc32 is None else keys_crc32
    header[_FIELDS["pending"]] = header[_FIELDS["pending_crc32"]] = _NONE
    with open(path, "wb") as file:
        file.write(header.tobytes())
        empty = np.full(min(positions, _REHASH_CHUNK), -1, dtype=np.int64).tobytes()
        for _ in range(2):  # keys, then rows: every position empty
            for start in range(0, positions, _REHASH_CHUNK):
                file.write(empty[: 8 * min(_REHASH_CHUNK, positions - start)])
        file.flush()
        os.fsync(file.fileno())
