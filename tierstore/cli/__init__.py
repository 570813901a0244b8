"""The ``tierstore`` command line (``commands``) and what its commands run: table files and
streaming import/export (``table_files``, ``transfer``), delta exports (``deltas``),
``inspect``/``verify`` (``inspection``), and the text and plots of ``bench`` and ``profile``
(``bench``, ``profile``, ``plotting``) over the analysis in ``tierstore.analysis``."""

from .commands import main

__all__ = ["main"]
