"""Point-in-time checkpoints of tables: every row, its optimizer state and the step count as of one
flush, written while training goes on, restored exactly.

A checkpoint is a directory; a table's part of it (the directory itself, or one subdirectory per
group of a collection) holds ``checkpoint.json`` (the store's layout, the row count, the flush and
the step it captures), ``ids.npy`` (int64 ``[rows]``) and ``rows.npy`` (``[rows, row_width]`` whole
rows: weights then optimizer state; bfloat16 rows as their uint16 bits). Plain ``.npy`` files:
numpy reads them, memory-mapped.

Writing reads a ``StoreSnapshot`` (taken at the call, after a flush) on a thread of its own while
the caller trains on, into ``.NAME.partial-PID`` beside the target, which is renamed into place once
every file is synced: a kill at any moment leaves no checkpoint at the target (an earlier one at
another path is untouched), and the store itself is only read. The files are written front to back
and synced and dropped from the page cache as they go (``NpyWriter``), so that a checkpoint holds no
more memory than a chunk of rows: dirty pages count against a memory limit until written back.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from .errors import StoreFormatError
from .metadata import StoreMetadata, fsync_directory
from .snapshot import StoreSnapshot

FORMAT = "tierstore-checkpoint/1"
INFO_FILE, IDS_FILE, ROWS_FILE = "checkpoint.json", "ids.npy", "rows.npy"
COPY_ROWS = 1 << 16  # rows a checkpoint is read in at once (restore)
WRITE_ROWS = 1 << 14  # rows copied from the snapshot at once while training goes on (its memory)
SYNC_BYTES = 32 << 20  # written bytes synced and dropped from the page cache at a time


class NpyWriter:
    """A ``.npy`` file of ``dtype`` and ``shape`` written front to back by ``write`` (rows in order),
    every ``SYNC_BYTES`` synced and its pages dropped from the page cache; ``close`` syncs the rest."""

    def __init__(self, path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self._file = open(path, "wb")
        header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
        np.lib.format.write_array_header_1_0(self._file, header)
        self._dtype, self._unsynced = dtype, 0

    def write(self, array: np.ndarray) -> None:
        if array.dtype != self._dtype:
            raise TypeError(f"rows of {array.dtype} written to a .npy file of {self._dtype}")
        self._file.write(np.ascontiguousarray(array).data)
        self._unsynced += array.nbytes
        if self._unsynced >= SYNC_BYTES:
            self._sync()

    def _sync(self) -> None:
        self._file.flush()
        descriptor = self._file.fileno()
        os.fdatasync(descriptor)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: let them go now
        self._unsynced = 0

    def close(self) -> None:
        try:
            self._sync()
        finally:
            self._file.close()


def numpy_bits(rows: torch.Tensor) -> np.ndarray:
    """``rows`` as a numpy array of their bits: bfloat16, which numpy lacks, as int16."""
    return (rows.view(torch.int16) if rows.dtype == torch.bfloat16 else rows).numpy()


def check_new_path(path: Path) -> None:
    """Raise ``FileExistsError`` where ``path`` exists: a checkpoint is never overwritten."""
    if path.exists():
        raise FileExistsError(
            f"checkpoint path {path} exists; give a new path (a checkpoint is never overwritten)"
        )


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """How rows of ``dtype`` are kept in ``rows.npy`` (bfloat16, which numpy lacks, as uint16 bits)."""
    return np.dtype(np.uint16) if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype


@dataclasses.dataclass(frozen=True)
class TablePart:
    """One table's rows in a checkpoint: ``snapshot`` written to ``name`` (None: the directory itself)."""

    name: str | None
    snapshot: StoreSnapshot
    step: int


class CheckpointWriting:
    """A checkpoint being written on its own thread (``background``; else written, or raising what
    stopped it, before the constructor returns): ``wait()`` returns its path once it is complete
    (or raises what stopped it); ``done()`` says whether it has finished."""

    def __init__(self, path: str | os.PathLike, parts: list[TablePart], background: bool = True) -> None:
        self.path = Path(path)
        try:
            check_new_path(self.path)
        except FileExistsError:
            for part in parts:
                part.snapshot.close()
            raise
        self._parts = parts
        self._error: BaseException | None = None
        # not a daemon: a checkpoint started before the program ends is completed before it exits
        self._thread = threading.Thread(target=self._write, name="tierstore-checkpoint")
        if background:
            self._thread.start()
        else:
            self._thread.run()
            self.wait()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        """The checkpoint's path once it is complete; raises ``TimeoutError`` after ``timeout`` seconds,
        or what stopped the writing (then no checkpoint is at the path)."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        if not self.done():
            raise TimeoutError(f"checkpoint {self.path} is still being written")
        if self._error is not None:
            raise self._error
        return self.path

    def _write(self) -> None:
        partial = self.path.with_name(f".{self.path.name}.partial-{os.getpid()}")
        try:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            for part in self._parts:
                directory = partial if part.name is None else partial / part.name
                directory.mkdir(exist_ok=True)
                _write_table(part.snapshot, directory, part.step)
            fsync_directory(partial)
            os.rename(partial, self.path)
            fsync_directory(self.path.parent)
        except BaseException as error:  # reported by wait()
            self._error = error
            shutil.rmtree(partial, ignore_errors=True)
        finally:
            for part in self._parts:
                part.snapshot.close()


def _write_table(snapshot: StoreSnapshot, directory: Path, step: int) -> None:
    metadata, count = snapshot.metadata, len(snapshot)
    ids = NpyWriter(directory / IDS_FILE, np.dtype(np.int64), (count,))
    rows_dtype = numpy_dtype(metadata.torch_dtype)
    rows = NpyWriter(directory / ROWS_FILE, rows_dtype, (count, metadata.row_width))
    try:
        written = 0
        for keys, values in snapshot.iter_rows(WRITE_ROWS):
            stop = written + keys.numel()
            if stop > count:
                raise StoreFormatError(f"the snapshot yielded more than its {count} rows")
            ids.write(keys.numpy())
            rows.write(numpy_bits(values).view(rows_dtype))  # bfloat16: its bits as uint16
            written = stop
        if written != count:
            raise StoreFormatError(f"the snapshot yielded {written} of its {count} rows")
    finally:
        ids.close()
        rows.close()
    info = {
        "format": FORMAT,
        "store": dataclasses.asdict(metadata),
        "rows": count,
        "flushes": snapshot.flushes,
        "step": int(step),
    }
    with open(directory / INFO_FILE, "w") as file:
        json.dump(info, file, indent=2)
    descriptor = os.open(directory / INFO_FILE, os.O_RDONLY)  # the .npy files: synced as written
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    fsync_directory(directory)


class TableCheckpoint:
    """One table's part of a checkpoint at ``path``, read memory-mapped: ``metadata`` (the store's
    layout), ``step``, ``flushes``, ``len()`` rows and ``iter_rows``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            info = json.loads((self.path / INFO_FILE).read_text())
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{self.path} is not a tierstore checkpoint: it has no {INFO_FILE}"
            ) from None
        except (ValueError, UnicodeDecodeError) as error:
            raise StoreFormatError(f"{self.path / INFO_FILE} is damaged: {error}") from None
        if not isinstance(info, dict) or info.get("format") != FORMAT:
            raise StoreFormatError(f"{self.path / INFO_FILE} is not a {FORMAT} checkpoint")
        try:
            self.metadata = StoreMetadata(**info["store"])
            self.step, self.flushes, count = int(info["step"]), int(info["flushes"]), int(info["rows"])
            self._ids = np.load(self.path / IDS_FILE, mmap_mode="r")
            self._rows = np.load(self.path / ROWS_FILE, mmap_mode="r")
        except (KeyError, TypeError, ValueError, OSError) as error:
            raise StoreFormatError(f"checkpoint {self.path} is damaged: {error}") from None
        expected = ((count,), (count, self.metadata.row_width))
        if (self._ids.shape, self._rows.shape) != expected or self._rows.dtype != numpy_dtype(
            self.metadata.torch_dtype
        ):
            raise StoreFormatError(
                f"checkpoint {self.path} is damaged: its files hold {self._ids.shape} ids and "
                f"{self._rows.shape} {self._rows.dtype} rows where {INFO_FILE} says {expected}"
            )

    def __len__(self) -> int:
        return self._ids.shape[0]

    @property
    def ids(self) -> np.ndarray:
        """int64 ``[rows]``, memory-mapped."""
        return self._ids

    @property
    def rows(self) -> np.ndarray:
        """``[rows, row_width]`` whole rows (``numpy_dtype`` of the store's), memory-mapped."""
        return self._rows

    def iter_rows(self, batch_size: int = COPY_ROWS) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(ids [n], whole rows [n, row_width])`` of every row, ``batch_size`` at a time."""
        for start in range(0, len(self), batch_size):
            ids = torch.from_numpy(np.array(self._ids[start : start + batch_size]))
            rows = torch.from_numpy(np.array(self._rows[start : start + batch_size]))
            yield ids, rows.view(torch.bfloat16) if self.metadata.torch_dtype == torch.bfloat16 else rows

    def check_layout(self, metadata: StoreMetadata) -> None:
        """Raise ``ValueError`` unless rows laid out as this checkpoint's fit a store of ``metadata``."""
        fields = ("dim", "dtype", "optimizer_state_width", "state_dtype", "seed")
        different = [
            f"{name} {getattr(self.metadata, name)!r} (the table's: {getattr(metadata, name)!r})"
            for name in fields
            if getattr(self.metadata, name) != getattr(metadata, name)
        ]
        if different:
            raise ValueError(
                f"checkpoint {self.path} holds rows of another layout: {', '.join(different)}; restore it "
                f"into a table built with the checkpoint's settings"
            )
