"""The ``tierstore`` command line (``commands``: the parser; ``store_commands``, ``trace_commands``:
what each command does; ``arguments``: what they share) and what its commands run: table files and
streaming import/export (``table_files``, ``transfer``), delta exports (``deltas``),
``inspect``/``verify`` (``inspection``), and the text and plots of ``bench`` and ``profile``
(``bench``, ``profile``, ``plotting``) over the analysis in ``tierstore.analysis``."""

from .commands import main

__all__ = ["main"]
