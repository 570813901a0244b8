"""The reading commands (``verify``, ``inspect``, ``export``) of stores that hold LMDB data run in
a child process. LMDB trusts the pages it reads: some damage it does not check (a scrambled
B-tree page) ends the reading process with SIGABRT or SIGSEGV, where no Python code can catch
it. Run in a child, that damage becomes a clear error of the command (``verify``: a problem).
The child shares the terminal, so its output and progress bars are the command's own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from ..errors import StoreFormatError
from ..metadata import METADATA_FILE, read_metadata

READING_COMMANDS = ("verify", "inspect", "export")
CHILD = "TIERSTORE_READING_CHILD"  # set in the child: it runs the command itself


def reads_in_a_child(command: str, store: Path) -> bool:
    """Whether ``command`` on ``store`` (a store or a collection's directory) runs in a child:
    a reading command of a store holding LMDB data, not already in the child."""
    if command not in READING_COMMANDS or os.environ.get(CHILD):
        return False
    stores = [store, *(store.iterdir() if store.is_dir() else [])]  # a collection's groups
    for path in stores:
        try:
            if (path / METADATA_FILE).exists() and read_metadata(path).backend == "lmdb":
                return True
        except (StoreFormatError, OSError):
            continue  # the command itself says what is wrong with it
    return False


def run_in_a_child(argv: list[str], store: Path, outputs: list[Path]) -> tuple[int, str | None]:
    """Run ``tierstore argv`` in a child process: ``(its exit code, None)``, or where a signal
    ended it, ``(-1, what that means)`` after removing the ``outputs`` it created."""
    existed = [path.exists() for path in outputs]
    child = subprocess.run([sys.executable, "-m", "tierstore", *argv], env={**os.environ, CHILD: "1"})
    if child.returncode >= 0:
        return child.returncode, None
    for path, was_there in zip(outputs, existed):
        if not was_there:
            path.unlink(missing_ok=True)  # a partial export
    name = signal.Signals(-child.returncode).name
    return -1, (
        f"reading {store} ended the reading process with {name} inside LMDB: its data is damaged where "
        f"LMDB does not check (a scrambled B-tree page); restore the store from a backup"
    )
