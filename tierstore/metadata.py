"""The store directory's versioned metadata file, ``tierstore.json``.

It records what every reader must agree on: format version, backend, row ``dim``, ``dtype``,
optimizer-state width and dtype, and the initialisation seed. It is written once, atomically, when
a store is created; opening validates it before any other file is touched, so a bad open changes
nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from .errors import StoreFormatError, StoreMismatchError

FORMAT_NAME = "tierstore"
FORMAT_VERSION = 2  # 2: stored rows carry a checksum (1 is still read and written)
METADATA_FILE = "tierstore.json"
BACKENDS = ("lmdb", "mmap")
RANK_DIRECTORY = re.compile(r"rank(\d+)-of-(\d+)")  # a sharded table's store of one rank
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32 -> "float32"``; raises ``TypeError`` for dtypes a store cannot hold."""
    for name, candidate in DTYPES.items():
        if candidate == dtype:
            return name
    raise TypeError(f"dtype must be one of {', '.join('torch.' + n for n in DTYPES)}, got {dtype}")


@dataclasses.dataclass(frozen=True)
class StoreMetadata:
    """What a store is: its backend and the layout of its rows ``[weights (dim) | state]``."""

    backend: str
    dim: int
    dtype: str
    optimizer_state_width: int
    seed: int
    format_version: int = FORMAT_VERSION
    optimizer: str | None = None  # the optimizer's registry name; None: not recorded (older stores)
    # "float32": a float16/bfloat16 row holds its optimizer state as float32 (``row_width``);
    # None: the state in the row's dtype (float32 and float64 rows, and half rows of older stores).
    state_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        for name in ("dim", "optimizer_state_width", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if self.dim <= 0:
            raise ValueError(f"dim must be positive, got {self.dim}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63) (it seeds an int64 hash), got {self.seed}")
        if self.optimizer_state_width < 0:
            raise ValueError(f"optimizer_state_width must be >= 0, got {self.optimizer_state_width}")
        if self.optimizer is not None and not isinstance(self.optimizer, str):
            raise TypeError(f"optimizer must be an optimizer's name or None, got {self.optimizer!r}")
        if self.dtype not in DTYPES:
            raise TypeError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.state_dtype not in (None, "float32") or (
            self.state_dtype is not None and self.dtype not in HALF_DTYPES
        ):
            raise ValueError(
                f"state_dtype must be None, or 'float32' for float16/bfloat16 rows, got {self.state_dtype!r}"
            )

    @property
    def row_width(self) -> int:
        """Values (of ``dtype``) per stored row: weights then optimizer state (``row_width``)."""
        return row_width(self.dim, self.optimizer_state_width, self.state_dtype is not None)

    @property
    def state_in_row_dtype(self) -> bool:
        """Whether this 16-bit store keeps its optimizer state in its rows' dtype (made before state
        was kept in float32): the kernels, which read the state as float32, cannot update it."""
        return self.dtype in HALF_DTYPES and self.state_dtype is None and self.optimizer_state_width > 0

    @property
    def row_checksums(self) -> bool:
        """Whether the cold store's rows carry checks (format version 2 on)."""
        return self.format_version >= 2

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def row_bytes(self) -> int:
        return self.row_width * self.torch_dtype.itemsize


HALF_DTYPES = ("float16", "bfloat16")


def row_width(dim: int, state_width: int, float32_state: bool) -> int:
    """Values per stored row of ``dim`` weights and ``state_width`` optimizer-state values: with
    ``float32_state`` (a 16-bit row), each state value is a float32 held as two of the row's values,
    after the weights padded to an even count (so the state lies on 4-byte boundaries)."""
    if not float32_state or not state_width:
        return dim + state_width
    return dim + dim % 2 + 2 * state_width


def state_of(rows: torch.Tensor, dim: int, state_width: int) -> torch.Tensor:
    """The optimizer state of stored ``rows [N, row_width]`` (weights of ``dim`` values, ``state_width``
    state values): a ``[N, state_width]`` view, float32 where the rows hold it so (``row_width``),
    else in the rows' dtype."""
    if rows.shape[1] == dim + state_width:
        return rows[:, dim:]
    return rows[:, dim + dim % 2 :].view(torch.float32)


def finite_rows(rows: torch.Tensor, dim: int, state_width: int) -> torch.Tensor:
    """Whether each of stored ``rows [N, row_width]`` holds finite weights and state (bool [N]),
    the state read as stored (``state_of``: float32 state's halves are not numbers of their own)."""
    weights, state = rows[:, :dim], state_of(rows, dim, state_width)
    return torch.isfinite(weights).all(dim=1) & torch.isfinite(state).all(dim=1)


def new_state_dtype(dtype: str) -> str | None:
    """The optimizer state's dtype a new store of ``dtype`` rows records: float32 for 16-bit rows
    (their own precision and range lose updates: a float16 sum of squares overflows), else None."""
    return "float32" if dtype in HALF_DTYPES else None


def read_metadata(directory: Path) -> StoreMetadata:
    """Read and validate ``directory/tierstore.json``; ``StoreFormatError`` says what is wrong."""
    path = Path(directory) / METADATA_FILE
    try:
        document: Any = json.loads(path.read_text())
    except FileNotFoundError:
        raise StoreFormatError(f"{directory} is not a tierstore store: {METADATA_FILE} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise StoreFormatError(
            f"{path} is damaged (not valid JSON: {error}); restore it from a backup"
        ) from None
    if not isinstance(document, dict) or document.get("format") != FORMAT_NAME:
        raise StoreFormatError(f'{path} is not tierstore metadata (no "format": "{FORMAT_NAME}" field)')
    version = document.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise StoreFormatError(f"{path} is damaged: format_version is {version!r}, expected an int")
    if version < 1:
        raise StoreFormatError(f"{path} is damaged: format_version is {version}, expected 1 or above")
    if version > FORMAT_VERSION:
        raise StoreFormatError(
            f"{path} has format version {version}, but this tierstore reads versions up to "
            f"{FORMAT_VERSION}; upgrade tierstore to open it"
        )
    fields = {field.name for field in dataclasses.fields(StoreMetadata)}
    missing = sorted(fields - document.keys() - _OPTIONAL_FIELDS)
    if missing:
        raise StoreFormatError(f"{path} is damaged: missing fields {missing}")
    try:
        return StoreMetadata(**{name: document[name] for name in fields if name in document})
    except (TypeError, ValueError) as error:
        raise StoreFormatError(f"{path} is damaged: {error}") from None


def resolve_metadata(
    path: Path | None, requested: dict[str, Any], read_only: bool
) -> tuple[StoreMetadata, bool]:
    """``(metadata, whether the store is new)``: the metadata of the store at ``path``, checked
    against ``requested`` settings (``None``: as stored), or for a new store (``path`` None, missing
    or an empty directory, and not ``read_only``) the metadata ``requested`` describes. Writes
    nothing (``create_store`` does). Raises ``StoreFormatError`` when ``path`` is not a store."""
    if path is None:
        return _new_metadata(requested), True
    if path.exists() and not path.is_dir():
        raise StoreFormatError(f"{path} is a file; a store is a directory")
    if (path / METADATA_FILE).exists():
        metadata = read_metadata(path)
        check_matches(metadata, requested, path)
        return metadata, False
    if path.is_dir() and any(path.iterdir()):
        worlds = sorted(
            {match.group(2) for match in map(RANK_DIRECTORY.fullmatch, os.listdir(path)) if match}
        )
        if worlds:
            raise StoreFormatError(
                f"{path} holds a table sharded over {worlds[0]} ranks (one store per rank): open it as a "
                f"TieredEmbeddingBag or collection with process_group= a group of {worlds[0]} ranks"
            )
        raise StoreFormatError(f"{path} is not empty and has no {METADATA_FILE}: not a tierstore store")
    if read_only:
        raise StoreFormatError(f"{path} holds no store to open read-only")
    return _new_metadata(requested), True


_OPTIONAL_FIELDS = {"optimizer", "state_dtype"}  # fields added later: a store written before them lacks them


def _new_metadata(requested: dict[str, Any]) -> StoreMetadata:
    if requested["dim"] is None:
        raise ValueError("dim is required to create a new store")
    dtype = requested["dtype"] or "float32"
    metadata = StoreMetadata(
        backend=requested["backend"] or "mmap",
        dim=requested["dim"],
        dtype=dtype,
        optimizer_state_width=requested["optimizer_state_width"] or 0,
        seed=requested["seed"] or 0,
        optimizer=requested.get("optimizer"),
        state_dtype=new_state_dtype(dtype),
    )
    return metadata


def create_store(path: Path, metadata: StoreMetadata) -> None:
    """Make ``path`` a new store directory holding ``metadata``."""
    path.mkdir(parents=True, exist_ok=True)
    write_metadata(path, metadata)


def write_metadata(directory: Path, metadata: StoreMetadata) -> None:
    """Write ``directory/tierstore.json`` atomically (temp file, fsync, rename, fsync dir)."""
    document = {"format": FORMAT_NAME, **dataclasses.asdict(metadata)}
    write_json_atomic(Path(directory) / METADATA_FILE, document)


def check_matches(metadata: StoreMetadata, requested: dict[str, Any], directory: Path) -> None:
    """Raise ``StoreMismatchError`` naming every requested setting that differs from the store's."""
    differences = [
        f"{name}={value!r} (the store has {getattr(metadata, name)!r})"
        for name, value in requested.items()
        if value is not None and getattr(metadata, name) not in (value, *_unrecorded(name))
    ]
    if differences:
        raise StoreMismatchError(
            f"store {directory} was opened with {', '.join(differences)}; pass the store's own "
            f"settings, or leave them out (None) to use them"
        )


def _unrecorded(name: str) -> tuple:
    """Stored values that match any request: an optional field a store did not record."""
    return (None,) if name in _OPTIONAL_FIELDS else ()


def write_json_atomic(path: Path, document: dict) -> None:
    """Replace ``path`` with ``document`` so a crash leaves either the old or the new file (the
    temporary file is this process's own: processes writing the same file do not collide)."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(temporary, "w") as file:
        json.dump(document, file, indent=2)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    """Make a rename or file creation in ``directory`` durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
