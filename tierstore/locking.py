"""``serialized``: a store's method run holding its lock, Ctrl-C held off until it returns.

A store changes its files and its caches in several steps; a ``KeyboardInterrupt`` raised between
two of them (Python raises it at the next bytecode of the main thread) would leave the store's
state half changed, and a ``flush`` or ``close`` in the program's handler would then write that
state out. So while the main thread runs a store's method, a Ctrl-C is recorded and raised when
the outermost method returns; a second one meanwhile is raised at once (a long ``load`` stays
stoppable, at the cost the first one avoids). ``hold_interrupts`` installs the handler that does
this, where SIGINT still has Python's default handler (a program's own handler is left alone).
"""

from __future__ import annotations

import functools
import signal
import threading

_MAIN_THREAD = threading.main_thread().ident


class _Interrupts:
    """The main thread's store methods in progress, and whether a Ctrl-C came meanwhile."""

    depth = 0
    pending = False


def _on_interrupt(signum, frame) -> None:
    if _Interrupts.depth and not _Interrupts.pending:
        _Interrupts.pending = True
        return
    _Interrupts.pending = False  # a second Ctrl-C meanwhile is not held: the user insists
    signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt


def hold_interrupts() -> None:
    """Hold Ctrl-C off during store methods from now on (see the module docstring); called when a
    store opens. Only the main thread may install a handler: elsewhere this does nothing."""
    if threading.get_ident() != _MAIN_THREAD:
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_interrupt)


def serialized(method):
    """``method`` run holding the store's lock (a lookahead pipeline's worker moves rows between
    the tiers while the training loop reads and updates them), a Ctrl-C held off until it returns."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        if threading.get_ident() != _MAIN_THREAD:
            with self._lock:
                return method(self, *args, **kwargs)
        _Interrupts.depth += 1
        try:
            with self._lock:
                return method(self, *args, **kwargs)
        finally:
            _Interrupts.depth -= 1
            if _Interrupts.pending and not _Interrupts.depth:
                _Interrupts.pending = False
                raise KeyboardInterrupt

    return locked
