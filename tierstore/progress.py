"""Progress bars by tqdm's convention: shown on a terminal, not written to logs or pipes."""

from __future__ import annotations

from tqdm import tqdm


def bar(iterable=None, *, progress: bool | None = None, **settings) -> tqdm:
    """A tqdm bar over ``iterable``: ``progress`` None shows it only when stderr is a terminal, True
    always, False never (``--quiet``). ``settings`` are tqdm's (``total``, ``desc``, ``unit``...)."""
    return tqdm(iterable, disable=None if progress is None else not progress, **settings)
