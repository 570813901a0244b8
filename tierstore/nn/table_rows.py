"""``TableRows``: a tiered table's rows in its ``state_dict()``, as of the call, without reading them.

Under the key ``rows`` (sharded: ``rows.rankR-of-W``) a table's state dict holds a ``uint8 [rows,
RECORD]`` tensor of records (an id's 8 little-endian bytes, then its whole row's bytes: weights and
optimizer state). It holds no memory: it is a store snapshot (``StoreSnapshot``) taken by
``state_dict()`` after a flush, read only when someone reads it, and it implements the protocol by
which ``torch.distributed.checkpoint`` saves and loads sharded tensors:

- ``dcp.save``: the records are written in chunks of ``CHUNK_BYTES``, each read from the snapshot
  when the writer asks for it (training may go on meanwhile: the rows are those of the call).
- ``dcp.load`` into a model whose tables are on other (even empty) stores: the chunks read from the
  checkpoint are written to a file beside the table's store; ``load_state_dict`` (which ``dcp.load``
  calls) then replaces the table's rows with them (``TieredStore.replace_rows``). The number of rows
  is the table's content, not its shape: the two tables' counts need not agree.

``load_state_dict`` of another table's (or its own) earlier ``state_dict()`` restores that moment's
rows likewise. Pickled (``torch.save(model.state_dict())``), the records are left out: such a state
dict names the store (``_extra_state``), as before.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..snapshot import StoreSnapshot
from ..store import TieredStore

if TYPE_CHECKING:  # imported where dcp calls: torch.distributed.checkpoint and its sympy cost memory
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem

CHUNK_BYTES = 64 * 2**20  # the most bytes of records read or written at once
ANY_ROWS = 2**40  # the rows a table being loaded accepts (its shape's first size, to the planner)
_ID_BYTES = 8


def record_bytes(store: TieredStore) -> int:
    return _ID_BYTES + store.row_width * store.dtype.itemsize


class _Counted(Sequence):
    """A records tensor's size, ``(rows, record_bytes)``: equal to any size with the same record
    width. ``dcp.load`` checks the saved size against the one it loads into, and a table's row count
    is its content, not its shape. (Not a tuple: a tuple's comparison would come first.)"""

    def __init__(self, size: torch.Size) -> None:
        self._size = size

    def __getitem__(self, index):
        return self._size[index]

    def __len__(self) -> int:
        return len(self._size)

    def __eq__(self, other) -> bool:
        return isinstance(other, (tuple, _Counted)) and len(other) == 2 and other[1] == self[1]

    def __ne__(self, other) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(self._size[1])

    def numel(self) -> int:
        return self._size.numel()

    def __repr__(self) -> str:
        return repr(self._size)


class TableRows(torch.Tensor):
    """``uint8 [len(snapshot), record_bytes]`` records of ``snapshot`` (see the module docstring)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, store: TieredStore, snapshot: StoreSnapshot):
        return torch.Tensor._make_wrapper_subclass(
            cls, (len(snapshot), record_bytes(store)), dtype=torch.uint8
        )

    def __init__(self, store: TieredStore, snapshot: StoreSnapshot) -> None:
        self.snapshot = snapshot
        self.record_bytes = record_bytes(store)
        self._incoming = Path(store.path).with_name(
            f".{Path(store.path).name}.incoming-{os.getpid()}-{id(self)}"
        )
        self._received_rows = None  # rows dcp.load wrote to the incoming file; None: none came

    def size(self, dim: int | None = None):
        return _Counted(super().size()) if dim is None else super().size(dim)

    @property
    def shape(self):
        return self.size()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return args[0]
        raise RuntimeError(
            f"{func}: a tiered table's rows in a state_dict are records of a store snapshot, read by "
            f"torch.distributed.checkpoint and load_state_dict; read rows with store.get or iter_rows"
        )

    def __repr__(self) -> str:
        return f"TableRows(rows={len(self.snapshot)}, record_bytes={self.record_bytes})"

    def __reduce_ex__(self, protocol):
        return (_left_out, ())

    def __deepcopy__(self, memo) -> TableRows:
        return self  # a snapshot never changes

    # -- torch.distributed.checkpoint: saving ----------------------------------------------------

    def _chunk_rows(self) -> int:
        return max(1, CHUNK_BYTES // self.record_bytes)

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        rows, chunk = len(self.snapshot), self._chunk_rows()
        properties = TensorProperties(dtype=torch.uint8)
        size = torch.Size((rows, self.record_bytes))
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size((start, 0))),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(
                        offsets=torch.Size((start, 0)),
                        sizes=torch.Size((min(chunk, rows - start), self.record_bytes)),
                    ),
                    properties=properties,
                    size=size,
                ),
            )
            for start in range(0, rows, chunk)
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        start = index.offset[0]
        if self._received_rows is not None:  # being loaded into: the chunks go to the incoming file
            return _Incoming(self, start)
        ids, rows = self.snapshot.read(start, min(start + self._chunk_rows(), len(self.snapshot)))
        return _records(ids, rows)

    # -- torch.distributed.checkpoint: loading ---------------------------------------------------

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """Called by ``dcp.load`` only: from here on this object takes the rows it reads."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        self._received_rows = 0
        self._incoming.unlink(missing_ok=True)
        return [
            ChunkStorageMetadata(offsets=torch.Size((0, 0)), sizes=torch.Size((ANY_ROWS, self.record_bytes)))
        ]

    def receive(self, start: int, records: torch.Tensor) -> None:
        """``records`` (uint8 [n, record_bytes]) read by ``dcp.load``, rows ``start:start+n``."""
        if records.dim() != 2 or records.shape[1] != self.record_bytes:
            raise ValueError(
                f"the checkpoint holds rows of {records.shape[-1]}-byte records where this table's are "
                f"{self.record_bytes} bytes: its dim, dtype or optimizer differ from the saved table's"
            )
        with open(self._incoming, "ab") as file:
            os.pwrite(file.fileno(), records.contiguous().numpy().tobytes(), start * self.record_bytes)
        self._received_rows = max(self._received_rows, start + records.shape[0])

    def rows_for(self, store: TieredStore) -> Iterator[tuple[torch.Tensor, torch.Tensor]] | None:
        """``(ids, whole rows)`` batches this state dict entry gives ``store``: those ``dcp.load``
        read into it, else its snapshot's; None if neither (a dcp.load that found no rows)."""
        if record_bytes(store) != self.record_bytes:
            raise ValueError(
                f"the state_dict holds {self.record_bytes}-byte rows where this table's are "
                f"{record_bytes(store)} bytes: its dim, dtype or optimizer differ"
            )
        if self._received_rows is not None:
            return self._incoming_rows(store)
        return _batches(self.snapshot) if not self.snapshot.closed else None

    def discard_received(self) -> None:
        """Drop the rows ``dcp.load`` read into this object (a load refused after reading)."""
        self._incoming.unlink(missing_ok=True)
        self._received_rows = None

    def _incoming_rows(self, store: TieredStore) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        try:
            if self._received_rows:
                records = np.memmap(
                    self._incoming, np.uint8, "r", shape=(self._received_rows, self.record_bytes)
                )
                for start in range(0, self._received_rows, self._chunk_rows()):
                    yield _split(
                        torch.from_numpy(np.array(records[start : start + self._chunk_rows()])), store
                    )
                del records
        finally:
            self.discard_received()


class _Incoming(torch.Tensor):
    """Rows ``start:`` of a ``TableRows`` being loaded: ``dcp.load`` narrows it to a chunk's rows and
    copies the chunk into it, which hands the chunk to ``TableRows.receive``."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, owner: TableRows, start: int, rows: int = ANY_ROWS):
        return torch.Tensor._make_wrapper_subclass(cls, (rows, owner.record_bytes), dtype=torch.uint8)

    def __init__(self, owner: TableRows, start: int, rows: int = ANY_ROWS) -> None:
        self.owner, self.start = owner, start

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        target = args[0]
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return target
        if func is torch.ops.aten.slice.Tensor:
            dim = args[1] if len(args) > 1 else 0
            start = (args[2] if len(args) > 2 else None) or 0
            stop = min(args[3] if len(args) > 3 and args[3] is not None else 2**62, target.shape[dim])
            if dim == 1 and start == 0 and stop == target.shape[1]:
                return target
            if dim == 0:
                return _Incoming(target.owner, target.start + start, stop - start)
        if func is torch.ops.aten.copy_.default:
            target.owner.receive(target.start, args[1])
            return target
        raise RuntimeError(
            f"{func} on rows being loaded into a tiered table: only dcp.load's narrow and copy_ are taken"
        )


def _left_out():
    return None


def _records(ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 8 + row bytes]: each id's bytes, then its row's."""
    return torch.cat(
        [
            ids.view(torch.uint8).view(-1, _ID_BYTES),
            rows.contiguous().view(torch.uint8).view(ids.numel(), -1),
        ],
        1,
    )


def _split(records: torch.Tensor, store: TieredStore) -> tuple[torch.Tensor, torch.Tensor]:
    ids = records[:, :_ID_BYTES].contiguous().view(torch.int64).view(-1)
    rows = records[:, _ID_BYTES:].contiguous().view(store.dtype).view(-1, store.row_width)
    return ids, rows


def _batches(snapshot: StoreSnapshot) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    yield from snapshot.iter_rows()
