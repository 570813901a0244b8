"""``serialized``: a store's method run holding its lock."""

from __future__ import annotations

import functools


def serialized(method):
    """``method`` run holding the store's lock: a lookahead pipeline's worker moves rows between
    the tiers while the training loop reads and updates them."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked
