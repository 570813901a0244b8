"""Before a reading command (``verify``, ``inspect``, ``export``) reads a store holding LMDB data,
a child process walks every entry of its LMDB databases. LMDB trusts the pages it reads: some
damage it does not check (a scrambled B-tree page) ends the reading process with SIGABRT or
SIGSEGV, where no Python code can catch it. Met in the child first, that damage becomes a clear
error of the command instead of killing it. The child imports only ``lmdb``, so it starts fast.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from ..errors import StoreFormatError
from ..metadata import METADATA_FILE, read_metadata
from ..tiers.cold.lmdb_layout import DIRECTORY, check_data_file

READING_COMMANDS = ("verify", "inspect", "export")

_WALK = """
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, max_dbs=4)
for name in (b"rows", b"pending", b"pending.b", b"meta"):
    try:
        database = env.open_db(name, create=False)
    except lmdb.NotFoundError:
        continue
    with env.begin() as txn:
        for _ in txn.cursor(database).iternext():
            pass
"""


def lmdb_damage(store: Path) -> str | None:
    """What it means where walking the LMDB data of ``store`` (a store or a collection's
    directory) ends a child process with a signal; None where it does not (other problems are
    left to the command, which names them)."""
    for path in [store, *(store.iterdir() if store.is_dir() else [])]:  # a collection's groups
        try:
            if not (path / METADATA_FILE).exists() or read_metadata(path).backend != "lmdb":
                continue
            check_data_file(path / DIRECTORY / "data.mdb")  # what it finds, the command reports
        except (StoreFormatError, OSError):
            continue
        walk = subprocess.run([sys.executable, "-c", _WALK, str(path / DIRECTORY)], capture_output=True)
        if walk.returncode < 0:
            return (
                f"reading {path} ends a process with {signal.Signals(-walk.returncode).name} inside LMDB: "
                f"its data is damaged where LMDB does not check (a scrambled B-tree page); restore the "
                f"store from a backup"
            )
    return None
