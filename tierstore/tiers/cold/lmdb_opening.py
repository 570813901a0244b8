"""Opening an LMDB cold store: its data file checked, the environment and sub-databases opened, the
state of its staging logs and its flush count read (``LmdbColdStore``'s part)."""

from __future__ import annotations

import contextlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor

import lmdb
from lmdb.verify import VerifyError
from lmdb.verify import verify as verify_pages  # py-lmdb's offline walk of every page, never through LMDB

from ...errors import StoreBusyError, StoreFormatError
from .lmdb_layout import (
    _APPLYING_KEY,
    _FLUSHES_KEY,
    _OPEN_IN_THIS_PROCESS,
    _STAGES,
    _STAGING_KEY,
    DIRECTORY,
    LEFT_FILE,
    check_data_file,
)
from .lmdb_staging import StageLog


class LmdbOpening:
    """``LmdbColdStore``'s opening."""

    def _open(self, map_size: int, read_threads: int) -> None:
        read_only = self.read_only
        path = self._path = self.directory / DIRECTORY
        self._data_file = path / "data.mdb"
        if (path / "data.mdb").exists():
            check_data_file(path / "data.mdb")  # before LMDB maps it: a short file would be SIGBUS
        elif read_only or not self._create:
            raise StoreFormatError(
                f"{path} is missing its LMDB data file (data.mdb): the store's rows are gone; restore the "
                f"directory from a backup (opening it would start an empty table)"
            )
        path.mkdir(exist_ok=True)
        if path.resolve() in _OPEN_IN_THIS_PROCESS:
            raise StoreBusyError(
                f"store {self.directory} is already open in this process, and LMDB maps a store once per "
                f"process: read it through the TieredStore that has it open, or open the reader in "
                f"another process (readers there are allowed beside the writer)"
            )
        try:
            # metasync=False: each commit syncs its data pages; flush() forces a full sync.
            self._env = lmdb.open(
                str(path),
                map_size=map_size,
                max_dbs=4,
                readonly=read_only,
                metasync=False,
                readahead=False,
                lock=True,  # readers register, so the writer never reuses pages a reader's snapshot holds
            )
        except lmdb.Error as error:
            raise StoreFormatError(f"cannot open the LMDB data in {path}: {error}") from None
        try:
            with self._env.begin():  # a reader's slot: a writer elsewhere reuses none of its pages
                self._check_pages()
            try:
                self._rows = self._env.open_db(b"rows", create=not read_only)
                self._stages = [self._open_optional(name) for name in _STAGES]
                self._meta = self._open_optional(b"meta")
            except lmdb.Error as error:
                raise StoreFormatError(f"cannot open the LMDB data in {path}: {error}") from None
            self._snapshot = self._env.begin() if read_only else None  # a reader's one flush
            self._read_state()
            if not read_only and self._pending_count:  # writes staged before a crash, never flushed
                self._write(lambda txn: txn.drop(self._stages[self._staging], delete=False))
                self._logs[self._staging].clear()
        except BaseException:
            self._env.close()  # a later open in this process must find it closed
            raise
        _OPEN_IN_THIS_PROCESS.add(path.resolve())
        self._read_threads = read_threads
        self._pool: ThreadPoolExecutor | None = None
        self._seconds_per_key = float("inf")  # assume the disk until a read shows otherwise
        self.parallel_reads = 0

    def _check_pages(self) -> None:
        """``StoreFormatError`` naming data.mdb if a page LMDB would follow is damaged (every page
        walked by py-lmdb's offline verifier), unless the file is as this store's writer last left
        it (``LEFT_FILE``): LMDB trusts its pages, and py-lmdb touches every page of the length a
        damaged entry claims, a bus error past the file's end. A file changed since (a crash, a
        writer still writing, a copy, damage) is walked once, about 5 s a GiB."""
        if self._left_as_recorded():
            return
        try:
            problems = verify_pages(str(self._path))
        except VerifyError as error:
            problems = [str(error)]
        if problems:
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            raise StoreFormatError(
                f"{self._data_file} is damaged: {problems[0]}{more}; restore the store from a backup, or "
                f"export what still reads and re-import it"
            )

    def _file_identity(self) -> list[int]:
        status = self._data_file.stat()
        return [status.st_size, status.st_mtime_ns, status.st_ino]

    def _left_as_recorded(self) -> bool:
        try:
            return json.loads((self._path / LEFT_FILE).read_text()) == self._file_identity()
        except (OSError, ValueError):
            return False

    def _record_as_left(self) -> None:
        """Record data.mdb as this writer leaves it (after a flush's sync, and at close): a reopen
        finding it so skips the walk of its pages. Not synced: a record lost only costs a walk."""
        record = self._path / LEFT_FILE
        partial = record.with_suffix(".partial")
        try:
            partial.write_text(json.dumps(self._file_identity()))
            os.replace(partial, record)
        except OSError:  # a full disk: the next open walks the pages
            with contextlib.suppress(OSError):
                partial.unlink()

    def _read_state(self) -> None:
        """The flush count, which stage stages and which holds a flush being applied, and each
        one's log (a reader sees flushes only: the staging log is left empty), as the snapshot (a
        reader) or the newest commit (the writer) records."""
        self.flushes = self._read_flushes()
        self._staging, self._applying = 0, None
        self._logs = [StageLog(stage, self.codec.stored_bytes, self._path) for stage in self._stages]
        try:
            with self._begin() as txn:
                if self._meta is not None:
                    staging = txn.get(_STAGING_KEY, db=self._meta)
                    applying = txn.get(_APPLYING_KEY, db=self._meta)
                    self._staging = 0 if staging is None else bytes(staging)[0]
                    self._applying = None if applying is None else bytes(applying)[0]
                if {self._staging, self._applying} - {0, 1, None}:
                    raise StoreFormatError(f"the LMDB data in {self._path} is damaged: its stage roles")
                if self._applying is not None:
                    self._load(txn, self._logs[self._applying])
                if not self.read_only:  # staged, never flushed: dropped by a writable open
                    self._logs[self._staging].entries = txn.stat(self._stages[self._staging])["entries"]
        except lmdb.Error as error:
            raise self._damaged(error) from None

    def _load(self, txn, log: StageLog) -> None:
        """``log``'s index rebuilt from the log as ``txn`` sees it; a malformed entry is damage."""
        try:
            log.load(txn)
        except ValueError as error:
            raise StoreFormatError(f"{self._data_file} is damaged: {error}") from None

    def _open_optional(self, name: bytes):
        """The sub-database ``name``; None in a read-only store written before it existed."""
        try:
            return self._env.open_db(name, create=not self.read_only)
        except lmdb.NotFoundError:
            return None

    def _read_flushes(self) -> int:
        """The flushes completed, as the snapshot a reader reads (a writer: the newest) records."""
        if self._meta is None:
            return 0
        try:
            with self._begin() as txn:
                value = txn.get(_FLUSHES_KEY, db=self._meta)
                value = None if value is None else bytes(value)
        except lmdb.Error as error:
            raise self._damaged(error) from None
        if value is None:
            return 0
        if len(value) != 8:
            raise StoreFormatError(f"the LMDB data in {self._path} is damaged: its flush count is {value!r}")
        return struct.unpack("<Q", value)[0]
