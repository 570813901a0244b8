"""The ``tierstore`` command line (``commands``) and what its commands run: table files and
streaming import/export (``table_files``, ``transfer``), ``inspect``/``verify`` (``inspection``),
and ``bench`` (``bench``, ``traces``, ``reference_policies``: LRU, FIFO and Belady's MIN)."""

from .commands import main

__all__ = ["main"]
