"""Id traces for the cache benchmark: synthetic specs and files, as an int64 array of keys in
access order.

Synthetic specs (``name:key=value,...``):

- ``zipf:alpha=1.05,n=10000000[,length=1000000][,seed=0]``: truncated Zipf over ``n`` ids;
- ``uniform:n=1000000[,length=...][,seed=0]``;
- ``drift:n=1000000[,hot=10000][,period=100000][,alpha=1.05][,length=...][,seed=0]``: Zipf over a hot
  window of ``hot`` ids that moves to fresh ids every ``period`` accesses.

``once=0.6`` (zipf and drift) turns that share of the accesses, drawn at random, into ids looked up
exactly once (ids from ``n`` on): the one-off ids that make up most keys of a click log.

Files: ``.npy`` (1-D integer ids); CSV/TSV (``.csv``, ``.tsv``, ``.txt``) with ``columns`` chosen
by name (with a header line) or 0-based index; the Criteo Kaggle TSV layout (``criteo=True``:
label, 13 integer and 26 hexadecimal categorical columns, the categorical ones used, empty fields
skipped). A column of non-negative integers keeps them as ids; any other column (strings such as
``pv``, or integers some of which are negative, such as Avazu's ``-1`` category) is mapped to ids
in order of first appearance (Criteo's hex is parsed). Empty fields are skipped. Several columns
fuse into one key space with per-column offsets: key = value + offset of its column, each column's
offset past the previous column's largest key; ``split_columns`` gives each column back as its own
table.
"""

from __future__ import annotations

import csv
import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..workloads import ZipfIds

CRITEO_CATEGORICAL = range(14, 40)  # label, I1-I13, then C1-C26
_INT64_MAX = 2**63 - 1
DEFAULT_LENGTH = 1_000_000


class TraceError(ValueError):
    """A trace spec or file that cannot be read; the message says what is wrong."""


@dataclass
class Trace:
    """``keys`` (int64, access order) and, per source column, ``(name, first key, last key + 1)``."""

    keys: np.ndarray
    name: str
    columns: list[tuple[str, int, int]]

    @functools.cached_property
    def distinct_ids(self) -> int:
        """How many distinct keys the trace looks up (computed once)."""
        return int(np.unique(self.keys).size)


def load_trace(
    spec: str, columns: list[str] | None = None, criteo: bool = False, delimiter: str | None = None
) -> Trace:
    """The trace ``spec`` names: a synthetic spec or a file path (see the module docstring)."""
    kind, _, options = spec.partition(":")
    synthetic = kind in ("zipf", "uniform", "drift") and not Path(spec).exists()
    if delimiter is not None and len(delimiter) != 1:
        raise TraceError(f"the delimiter must be one character (e.g. ',' or a tab), got {delimiter!r}")
    if columns and criteo:
        raise TraceError("columns and criteo exclude each other: the Criteo layout names its own columns")
    if synthetic or Path(spec).suffix == ".npy":
        given = [
            name
            for name, value in (("columns", columns), ("criteo", criteo), ("delimiter", delimiter))
            if value
        ]
        if given:
            raise TraceError(
                f"{spec}: {' and '.join(given)} apply to CSV/TSV traces only, and this trace is "
                f"{'a synthetic spec' if synthetic else 'a .npy of ids'}: leave them out"
            )
    if synthetic:
        keys = _synthetic(kind, _options(spec, options))
        trace = Trace(keys, spec, [(kind, 0, int(keys.max()) + 1 if keys.size else 0)])
    else:
        trace = _from_file(Path(spec), columns, criteo, delimiter)
    if trace.keys.size == 0:
        raise TraceError(f"{spec}: the trace is empty")
    return trace


def _options(spec: str, text: str) -> dict[str, float]:
    options = {}
    for item in filter(None, text.split(",")):
        name, equals, value = item.partition("=")
        if name.strip() in options:
            raise TraceError(f"{spec}: option {name.strip()!r} is given twice; give each option once")
        try:
            options[name.strip()] = float(value)
        except ValueError:
            raise TraceError(f"{spec}: option {item!r} must be name=number") from None
        if not equals:
            raise TraceError(f"{spec}: option {item!r} must be name=number")
    return options


def _synthetic(kind: str, options: dict[str, float]) -> np.ndarray:
    known = {
        "zipf": {"alpha", "n", "length", "seed", "once"},
        "uniform": {"n", "length", "seed"},
        "drift": {"n", "hot", "period", "alpha", "length", "seed", "once"},
    }[kind]
    unknown = set(options) - known
    if unknown or "n" not in options:
        raise TraceError(
            f"{kind}: options are {', '.join(sorted(known))} (n required); got {', '.join(sorted(options))}"
        )
    limits = {
        "n": (1, 2**62),
        "length": (1, 2**40),
        "seed": (0, 2**63 - 1),
        "hot": (1, 2**62),
        "period": (1, 2**40),
    }
    for name, (low, high) in limits.items():
        value = options.get(name)
        if value is not None and not (low <= value <= high and float(value).is_integer()):
            raise TraceError(f"{kind}: {name} must be a whole number from {low:,} to {high:,}, got {value:g}")
    if not 0 < options.get("alpha", 1.05) < 100:
        raise TraceError(
            f"{kind}: alpha must be above 0 (a Zipf exponent, typically near 1), got {options['alpha']:g}"
        )
    if options.get("hot", 0) > options["n"]:
        raise TraceError(
            f"{kind}: hot ({options['hot']:g} ids) must be at most n ({options['n']:g}): the hot window "
            f"is drawn from the n ids"
        )
    if not 0 <= options.get("once", 0) < 1:
        raise TraceError(f"{kind}: once must be a share of the accesses in [0, 1), got {options['once']:g}")
    n, length, seed = (
        int(options["n"]),
        int(options.get("length", DEFAULT_LENGTH)),
        int(options.get("seed", 0)),
    )
    if kind == "uniform":
        return np.random.default_rng(seed).integers(0, n, length, dtype=np.int64)
    if kind == "zipf":
        keys = ZipfIds(n, options.get("alpha", 1.05), seed)(length)
    else:
        hot = int(options.get("hot", max(1, n // 100)))
        period = int(options.get("period", max(1, length // 10)))
        ranks = ZipfIds(min(hot, n), options.get("alpha", 1.05), seed).ranks(length)
        window_start = (np.arange(length) // period) * hot  # the hot window moves to fresh ids each period
        keys = (window_start + ranks) % n
    once = np.random.default_rng([seed, 1]).random(length) < options.get("once", 0)
    keys[once] = n + np.arange(int(once.sum()), dtype=np.int64)
    return keys


def _from_file(path: Path, columns: list[str] | None, criteo: bool, delimiter: str | None) -> Trace:
    if not path.is_file():
        raise TraceError(
            f"{path}: no such trace file (or an unknown synthetic spec; use zipf:, uniform: or drift:)"
        )
    if path.suffix == ".npy":
        try:
            keys = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as error:
            raise TraceError(f"{path}: not a readable .npy file ({error})") from None
        if keys.ndim != 1 or not np.issubdtype(keys.dtype, np.integer):
            raise TraceError(f"{path}: a trace is a 1-D integer array, got {keys.dtype} {keys.shape}")
        if keys.size and keys.min() < 0:
            raise TraceError(f"{path}: ids must be non-negative")
        return Trace(
            keys.astype(np.int64), path.name, [(path.name, 0, int(keys.max()) + 1 if keys.size else 0)]
        )
    if path.suffix not in (".csv", ".tsv", ".txt"):
        raise TraceError(f"{path}: unknown trace format {path.suffix!r}; use .npy, .csv, .tsv or .txt")
    delimiter = delimiter or ("\t" if criteo or path.suffix == ".tsv" else ",")
    with open(path, newline="") as file:
        reader = csv.reader(file, delimiter=delimiter)
        try:
            first = next(reader)
        except StopIteration:
            raise TraceError(f"{path}: the trace is empty") from None
        except (csv.Error, UnicodeDecodeError) as error:
            raise TraceError(f"{path}: not a readable delimited text file ({error})") from None
        names, indices, header = _choose_columns(path, first, columns, criteo)
        records = [] if header else [first]
        try:
            records.extend(reader)
        except (csv.Error, UnicodeDecodeError) as error:
            raise TraceError(f"{path}: line {reader.line_num} is malformed ({error})") from None
    first_line = 2 if header else 1  # of the first record
    return _fuse(path, names, [_column(path, records, index, criteo, first_line) for index in indices])


def _choose_columns(
    path: Path, first: list[str], columns: list[str] | None, criteo: bool
) -> tuple[list[str], list[int], bool]:
    """``(column names, 0-based indices, whether the first line is a header)``."""
    if criteo:
        if len(first) != 40:
            raise TraceError(
                f"{path}: the Criteo layout has 40 tab-separated fields, line 1 has {len(first)}"
            )
        return [f"C{i - 13}" for i in CRITEO_CATEGORICAL], list(CRITEO_CATEGORICAL), False
    header = not any(field.strip().lstrip("-").isdigit() for field in first)
    if not columns:
        raise TraceError(
            f"{path}: choose the id columns with --columns (names or 0-based indices; "
            f"line 1 is {','.join(first)})"
        )
    indices = []
    for column in columns:
        if column.isdigit():
            index = int(column)
        elif header and column in first:
            index = first.index(column)
        else:
            raise TraceError(
                f"{path}: unknown column {column!r}; "
                + (
                    "columns are " + ", ".join(first)
                    if header
                    else "the file has no header: use 0-based indices"
                )
            )
        if index >= len(first):
            raise TraceError(f"{path}: column {index} is past the {len(first)} fields of line 1")
        indices.append(index)
    names = [first[i] if header else f"column {i}" for i in indices]
    return names, indices, header


def _column(path: Path, records: list[list[str]], index: int, criteo: bool, first_line: int) -> np.ndarray:
    """One column's ids in record order (``first_line``: the file's line of the first record).
    Empty fields are skipped (-1 here, dropped by ``_fuse``). A column of non-negative integers
    keeps its values as ids; any other column (strings, or integers some of which are negative,
    such as Avazu's -1 category) is mapped to ids in order of first appearance, each distinct value
    its own id. An integer past int64 is refused, naming its line."""
    try:
        values = [record[index] for record in records]
    except IndexError:
        short = next(n for n, record in enumerate(records) if len(record) <= index)
        raise TraceError(f"{path}: record {short + 1} has no column {index}") from None
    try:
        numbers = [int(v, 16 if criteo else 10) if v else None for v in values]
    except ValueError:  # categorical strings
        numbers = None
    if numbers is not None:
        past = next((n for n, v in enumerate(numbers) if v is not None and not 0 <= v <= _INT64_MAX), None)
        if past is not None and numbers[past] > _INT64_MAX:
            raise TraceError(
                f"{path}: line {first_line + past}: {values[past]!r} in column {index} is past int64 "
                f"(ids must be below 2**63)"
            )
        if past is None:
            return np.array([-1 if v is None else v for v in numbers], dtype=np.int64)
    codes: dict[str, int] = {}
    return np.array([codes.setdefault(v, len(codes)) if v else -1 for v in values], dtype=np.int64)


def _fuse(path: Path, names: list[str], columns: list[np.ndarray]) -> Trace:
    """Interleave columns record by record into one key space with per-column offsets."""
    stacked = np.stack(columns, axis=1)  # [records, columns]
    offsets, spans, start = [], [], 0
    for name, column in zip(names, columns):
        present = column[column >= 0]
        width = int(present.max()) + 1 if present.size else 0
        offsets.append(start)
        spans.append((name, start, start + width))
        start += width
    keys = stacked + np.array(offsets, dtype=np.int64)
    return Trace(keys[stacked >= 0], path.name, spans)


def split_columns(trace: Trace) -> list[Trace]:
    """One trace per source column (its own table: keys back to the column's own ids, access order kept)."""
    parts = []
    for name, first, end in trace.columns:
        inside = (trace.keys >= first) & (trace.keys < end)
        parts.append(Trace(trace.keys[inside] - first, f"{trace.name} [{name}]", [(name, 0, end - first)]))
    return parts
