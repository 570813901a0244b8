"""Cache budgets: bytes (``"64MiB"``), a share of memory (``"10%"``) or a row count (``100_000``).

``rows_for_budget`` turns a budget into the number of rows a cache may hold, counting every byte
the cache allocates per row (row data plus index and bookkeeping), so a byte budget is a bound on
the cache's memory, not only on its row buffer.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import psutil

Budget = int | str | None

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
_PERCENT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")


def parse_bytes(text: str, total_memory: int | None = None) -> int:
    """Bytes named by ``text``: ``"2GiB"``, ``"512MB"``, ``"4096"``, or ``"10%"`` of ``total_memory``.

    ``total_memory`` defaults to the machine's RAM (psutil).
    """
    percent = _PERCENT_RE.match(text)
    if percent:
        share = float(percent.group(1))
        if not 0 <= share <= 100:
            raise ValueError(f"budget {text!r}: a share of memory must be between 0% and 100%")
        total = psutil.virtual_memory().total if total_memory is None else total_memory
        return int(total * share / 100)
    match = _BYTES_RE.match(text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(
            f"budget {text!r} is not understood: give bytes with a unit (e.g. '64MiB', '2GiB', "
            f"'500MB'), a share of memory (e.g. '10%'), or an int number of rows"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def check_budget(budget: Budget, name: str = "budget") -> None:
    """Raise ``TypeError``/``ValueError`` naming ``name`` unless ``budget`` is ``None``, a
    non-negative int row count, or a str of bytes or a share of memory that parses."""
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise TypeError(f"{name} must be an int row count or a str like '64MiB' or '10%', got {budget!r}")
    if isinstance(budget, int):
        if budget < 0:
            raise ValueError(f"{name} must be a non-negative row count, got {budget}")
        return
    try:
        parse_bytes(budget, total_memory=1)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None


def rows_for_budget(
    budget: Budget,
    nbytes_for_rows: Callable[[int], int],
    total_memory: int | None = None,
) -> int:
    """Rows that fit in ``budget``.

    An int budget is a row count. A string budget is bytes or a share of memory; the answer is the
    largest row count ``n`` with ``nbytes_for_rows(n) <= budget`` (``nbytes_for_rows`` must be
    non-decreasing). ``None`` or ``0`` means no rows.
    """
    check_budget(budget)
    if budget is None:
        return 0
    if isinstance(budget, int):
        return budget
    limit = parse_bytes(budget, total_memory)
    low, high = 0, 1
    while nbytes_for_rows(high) <= limit:
        low, high = high, high * 2
    while high - low > 1:  # invariant: fits(low), not fits(high)
        mid = (low + high) // 2
        if nbytes_for_rows(mid) <= limit:
            low = mid
        else:
            high = mid
    return low


# a lookahead horizon's memory per row lookup it spans (ids, next uses, slot hints, id map), and per
# top-tier slot (the key it pinned there, that row's next use, a cap's scratch)
HORIZON_BYTES_PER_LOOKUP = 52
HORIZON_BYTES_PER_SLOT = 16


def horizon_accesses(horizon: int | str, capacity: int) -> int:
    """Row lookups a lookahead ``horizon`` spans: an int (lookups) or ``"<k>x"`` (k times a top
    tier's ``capacity`` rows)."""
    if isinstance(horizon, str) and horizon.strip().lower().endswith("x"):
        try:
            factor = float(horizon.strip()[:-1])
        except ValueError:
            factor = -1.0
        if factor > 0:
            return max(1, round(factor * capacity))
    elif isinstance(horizon, int) and not isinstance(horizon, bool) and horizon > 0:
        return horizon
    raise ValueError(
        f"horizon must be a positive int (row lookups) or a multiple of the top tier's capacity "
        f"such as '10x', got {horizon!r}"
    )


def horizon_nbytes(horizon: int | str, capacity: int) -> int:
    """Bytes a top tier of ``capacity`` rows reserves for a lookahead ``horizon`` (``TierConfig``):
    the most the horizon then holds (``tierstore.horizon`` reads no further ahead)."""
    return HORIZON_BYTES_PER_SLOT * capacity + HORIZON_BYTES_PER_LOOKUP * horizon_accesses(horizon, capacity)
