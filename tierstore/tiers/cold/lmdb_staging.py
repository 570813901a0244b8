"""The LMDB cold store's staged rows, kept as an append-only log in an LMDB database.

An entry's key is its sequence number (8 bytes big-endian) and its value the row's id (8 bytes
big-endian) then the stored row, so a write transaction appends to the B-tree's last leaves: it
dirties a few pages per thousand rows whatever the ids, where entries keyed by id would dirty a
leaf per row (LMDB holds a transaction's dirty pages in RAM until it commits, and keeps their
buffers for reuse after: the most any transaction dirtied stays in the process for good). An
index (``LogIndex``: id -> sequence number of its newest entry, in bounded RAM with sealed runs in
unlinked files beside the data) finds an id's row. A
flush's own rows are appended without it (``appended``: the caller holds their newest values until
the flush commits, and the flush copies the log into ``rows`` by scanning it in order), so it need
not hold a host cache's worth of ids; a read that comes first rebuilds it by scanning the log, as a
store opening on a log that holds a committed flush does. A removal is an entry holding the id alone;
the index gives it ``-2 - its sequence number`` (below -1, where ``find`` says -1 for an id not staged).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .codec import decode_keys, encode_keys
from .log_index import LogIndex, last_of_each

ID_BYTES = 8  # an entry's value starts with its row's id, big-endian
LOAD_ENTRIES = 1 << 16  # entries a rebuild of the index decodes at a time (its memory)


class StageLog:
    """The log in ``database`` (an LMDB sub-database handle) of rows stored in ``stored_bytes``,
    and its index, whose sealed runs go in ``directory``."""

    def __init__(self, database, stored_bytes: int, directory: Path) -> None:
        self.database = database
        self.entry_bytes = ID_BYTES + stored_bytes  # an entry's value
        self.index = LogIndex(directory, None)
        self.next_entry = 0  # the sequence number the next entry takes
        self.entries = 0  # entries in the database (an id staged twice has two)
        self.indexed = True  # False: some entries are not in the index (``load`` before a read)

    @property
    def nbytes(self) -> int:
        """RAM the index takes."""
        return self.index.nbytes

    def entries_of(self, keys: np.ndarray, stored: np.ndarray) -> tuple[list, np.ndarray]:
        """``(items to append, their sequence numbers)`` for ``keys`` (int64 [N]) and their stored rows
        (uint8 [N, stored_bytes]); nothing changes until ``record``."""
        numbers = np.arange(self.next_entry, self.next_entry + keys.size, dtype=np.int64)
        values = np.empty((keys.size, ID_BYTES + stored.shape[1]), dtype=np.uint8)
        values[:, :ID_BYTES] = keys.astype(">u8").view(np.uint8).reshape(-1, ID_BYTES)
        values[:, ID_BYTES:] = stored
        items = list(zip(encode_keys(numbers), values.view(f"V{values.shape[1]}").ravel().tolist()))
        return items, numbers

    def removals_of(self, keys: np.ndarray) -> tuple[list, np.ndarray]:
        """``(items to append, their sequence numbers)`` removing ``keys`` (int64 [N]); nothing changes
        until ``record(keys, numbers, removal=True)``."""
        numbers = np.arange(self.next_entry, self.next_entry + keys.size, dtype=np.int64)
        return list(zip(encode_keys(numbers), encode_keys(keys))), numbers

    def record(self, keys: torch.Tensor, numbers: np.ndarray, removal: bool = False) -> None:
        """Index ``keys`` (distinct; a part of ``index.parts_with_room``) at the entries ``numbers`` that
        were just committed (``removal``: entries removing them)."""
        self.index.remove(keys)
        self.index.insert(keys, torch.from_numpy(-2 - numbers if removal else numbers))
        self.next_entry += keys.numel()
        self.entries += keys.numel()

    def appended(self, count: int) -> None:
        """``count`` entries were just committed without being indexed."""
        self.next_entry += count
        self.entries += count
        self.indexed = False

    def split_entries(self, values: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(ids int64 [n], stored rows uint8 [n, stored_bytes], removal bool [n])`` of entry values
        (rows or removals; a removal's row is zeros); a value of another length raises ``ValueError``."""
        if any(len(value) not in (ID_BYTES, self.entry_bytes) for value in values):
            raise ValueError("a staged entry has a value of the wrong length")
        removal = np.array([len(value) == ID_BYTES for value in values], dtype=bool)
        padding = bytes(self.entry_bytes - ID_BYTES)
        joined = b"".join(value + padding if len(value) == ID_BYTES else value for value in values)
        ids, stored = self.split(joined)
        return ids, stored, removal

    def split(self, values: bytes) -> tuple[np.ndarray, np.ndarray]:
        """``(ids int64 [n], stored rows uint8 [n, stored_bytes])`` of joined entry values."""
        entries = np.frombuffer(values, dtype=np.uint8).reshape(-1, self.entry_bytes)
        ids = entries[:, :ID_BYTES].copy().view(">u8").ravel().astype(np.int64)
        return ids, entries[:, ID_BYTES:]

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """The sequence number of each key's newest entry (int64 [N]), -1 where not staged, ``-2 -
        number`` where it is a removal."""
        return self.index.find(keys)

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every staged id and its newest entry's sequence number, by id (all in RAM at once)."""
        return self.index.items()

    def load(self, txn) -> None:
        """Rebuild the index from the database as ``txn`` sees it, ``LOAD_ENTRIES`` at a time;
        entries whose value is not ``entry_bytes`` long raise ``ValueError`` (the index is then
        rebuilt again by the next ``load``)."""
        self.clear()
        self.indexed = False
        numbers, ids, removals = [], [], []
        for number, value in txn.cursor(self.database).iternext():
            if len(number) != 8 or len(value) not in (self.entry_bytes, ID_BYTES):
                raise ValueError(f"a staged entry has a {len(number)}-byte key and a {len(value)}-byte value")
            numbers.append(bytes(number))
            ids.append(bytes(value[:ID_BYTES]))
            removals.append(len(value) == ID_BYTES)
            if len(ids) == LOAD_ENTRIES:
                self._index_loaded(numbers, ids, removals)
                numbers, ids, removals = [], [], []
        self._index_loaded(numbers, ids, removals)
        self.indexed = True

    def _index_loaded(self, numbers: list, ids: list, removals: list) -> None:
        """Index entries read in order (later than any indexed so far): each id's last one wins."""
        if not ids:
            return
        keys, sequence = decode_keys(ids), decode_keys(numbers)
        self.next_entry = int(sequence[-1]) + 1
        self.entries += len(ids)
        sequence = np.where(np.array(removals), -2 - sequence, sequence)
        order = np.argsort(keys, kind="stable")
        keys, sequence = last_of_each(keys[order], sequence[order])
        keys = torch.from_numpy(keys)
        self.index.remove(keys)
        self.index.insert(keys, torch.from_numpy(sequence))

    def clear(self) -> None:
        """Forget every entry (the database was emptied)."""
        self.index.clear()
        self.next_entry = self.entries = 0
        self.indexed = True

    def close(self) -> None:
        """Close the index's run files."""
        self.index.close()
