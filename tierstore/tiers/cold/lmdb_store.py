"""LMDB cold store: key = 8-byte big-endian id, value = the stored row (its bytes and check).

Every row read is checked (``codec.RowCodec``), and a key not found is confirmed absent by checking
the entries on either side of it (a page damaged where the key should be gives a neighbour that
fails its check), so damage found by a read is ``StoreFormatError`` naming the file, as are LMDB's
own errors from damaged pages; ``tierstore verify`` reads and checks every entry. A data file not as
the store's writer last left it has every page walked at open before LMDB reads one
(``_check_pages``).

Staged writes go to a staging sub-database kept as an append-only log (``lmdb_staging``: entries
keyed by sequence number, an index in RAM finds an id's newest one), one transaction per batch that
appends to the B-tree's last leaves. There are two (``pending`` and ``pending.b``), and ``meta``
names which one stages. ``flush`` commits in one small transaction (its commit point): the flush
count, and the staging log's role turned to *being applied* while the other one stages from then on;
after a sync its entries are copied into ``rows`` in the log's order, a few thousand per transaction
(each sorted by id, an id's entries kept in order), and a last one empties it and clears the role. A
flush's own rows are staged without being indexed (``lmdb_staging``). LMDB keeps a write
transaction's dirty pages in memory until it commits (and their buffers for good after), so a
transaction writing a host cache's worth of rows at random ids (each in its own B-tree leaf) would
need about a page of RAM per row: a table several times larger than a memory limit could not train
or flush under it. Reads see ``rows`` overlaid by the log being applied (and, for the writer, by the
staging one), so a reader, a reopen or a crash anywhere in the apply all see exactly the committed
flush; the next flush (of a writer reopened after a crash, or after a failed apply) first applies it
again (copying the log again writes the same rows). A store that opens on a log being applied
rebuilds its index by scanning it (one flush's rows). Staged writes never committed by a flush are
dropped on the next writable open. LMDB maps an environment once per process, so a store open in
this process (for writing or reading) cannot be opened again here: a reader beside the writer runs
in another process. Reads sort the keys so the B-tree is walked in order (a log's entries by their
sequence numbers). A read that waits on the disk (the store is larger than the page cache) is split
into contiguous key ranges read by a thread pool, each range in its own read transaction: py-lmdb
releases the GIL inside ``get``, so the page faults overlap and the SSD's queue stays busy. A read
served from the page cache stays on one thread, where the GIL would make threads slower. Which
regime holds is measured, not guessed: a moving average of the seconds per key of recent reads
decides. The transactions of one parallel read can differ only if another process commits meanwhile;
this process never writes during a read. A read-only store reads one snapshot (one read transaction,
on one thread) from its open until ``refresh()``; a snapshot held long keeps the writer from reusing
the pages it holds, so the file grows (LMDB's rule for long read transactions). The memory map
doubles whenever a write transaction finds it full, and the write is retried.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import struct
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lmdb
import numpy as np
import torch
from lmdb.verify import VerifyError
from lmdb.verify import verify as verify_pages  # py-lmdb's offline walk of every page, never through LMDB

from ...errors import StoreBusyError, StoreFormatError
from .base import ColdStore
from .codec import decode_keys, encode_keys
from .lmdb_staging import StageLog

DIRECTORY = "lmdb"
INITIAL_MAP_SIZE = 256 * 2**20
READ_THREADS = 16  # concurrent page faults: an SSD serves many at once
MIN_KEYS_PER_THREAD = 512
LOW_DISK_BYTES = 16 * 2**20  # a failed write with less free than this is taken for a full disk
DISK_BOUND_SECONDS_PER_KEY = 5e-6  # between a page-cache hit and an SSD read per key


_META_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1
_BRANCH, _LEAF, _META_PAGE = 0x01, 0x02, 0x08  # page flags
_NO_PAGE = 2**64 - 1  # an empty database's root
_FREE_ROOT, _MAIN_ROOT = 80, 128  # byte offsets in a meta page (64-bit LMDB)
_OPEN_IN_THIS_PROCESS: set[Path] = set()  # LMDB directories this process has open
_FLUSHES_KEY = b"flushes"  # in the meta sub-database: the flushes completed, committed with them
_STAGES = (b"pending", b"pending.b")  # one stages writes, the other holds a flush being applied
_STAGING_KEY, _APPLYING_KEY = b"staging", b"applying"  # in meta: which stage does which (0 or 1)
APPLY_ROWS = 4096  # rows a transaction of a flush's apply moves: its dirty pages stay a few MiB
LEFT_FILE = "left.json"  # beside data.mdb: the file's size, time and inode as the writer last left it


def check_data_file(data_file: Path) -> None:
    """Raise ``StoreFormatError`` naming ``data_file`` unless its two LMDB meta pages are sound
    (page number, meta flag, magic number, data version, page size, root pages within the last
    page), the newer one's main root page is a branch or leaf page that knows its own number, and
    the file reaches the last page the newer meta page uses. LMDB trusts these: a truncated file
    would be SIGBUS when it reads past its end, a scrambled root an abort or SIGSEGV."""
    with open(data_file, "rb") as file:
        first = file.read(160)
        page_size = struct.unpack_from("<I", first, 40)[0] if len(first) == 160 else 0
        if page_size not in (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536):
            raise StoreFormatError(f"{data_file} is damaged: its first page is not an LMDB meta page")
        file.seek(page_size)
        metas = [first, file.read(160)]
        valid = [meta for number, meta in enumerate(metas) if _sound_meta(meta, number)]
        if not valid:
            raise StoreFormatError(f"{data_file} is damaged: neither LMDB meta page is valid")
        newest = max(valid, key=lambda meta: struct.unpack_from("<Q", meta, 144)[0])  # by transaction id
        last_page, root = (
            struct.unpack_from("<Q", newest, 136)[0],
            struct.unpack_from("<Q", newest, _MAIN_ROOT)[0],
        )
        if root != _NO_PAGE:
            file.seek(root * page_size)
            header = file.read(16)
            if len(header) == 16 and not (
                struct.unpack_from("<Q", header)[0] == root
                and struct.unpack_from("<H", header, 10)[0] & (_BRANCH | _LEAF)
            ):
                raise StoreFormatError(
                    f"{data_file} is damaged: its root page {root} is not a B-tree page; restore the store "
                    f"from a backup"
                )
    needed = (last_page + 1) * page_size
    # Sized after the meta pages are read: a writer commits its pages before the meta page that
    # names them, so a commit between the two reads cannot look like a truncation.
    size = data_file.stat().st_size
    if size < needed:
        raise StoreFormatError(
            f"{data_file} is truncated: {size:,} bytes, but its last committed page ends at {needed:,}; "
            f"restore the store from a backup"
        )


def _sound_meta(meta: bytes, number: int) -> bool:
    """Whether ``meta`` (a meta page's first 160 bytes) is LMDB meta page ``number`` (0 or 1)."""
    if len(meta) != 160:
        return False
    pgno, flags = struct.unpack_from("<Q", meta)[0], struct.unpack_from("<H", meta, 10)[0]
    magic, version = struct.unpack_from("<II", meta, 16)
    last_page = struct.unpack_from("<Q", meta, 136)[0]
    roots = [struct.unpack_from("<Q", meta, offset)[0] for offset in (_FREE_ROOT, _MAIN_ROOT)]
    return (
        pgno == number
        and flags & _META_PAGE
        and magic == _META_MAGIC
        and version == _DATA_VERSION
        and all(root == _NO_PAGE or 2 <= root <= last_page for root in roots)
    )


class LmdbColdStore(ColdStore):
    """Cold store in an LMDB environment at ``directory/lmdb``."""

    def __init__(
        self,
        directory: Path,
        row_width: int,
        dtype: torch.dtype,
        read_only: bool = False,
        map_size: int = INITIAL_MAP_SIZE,
        read_threads: int = READ_THREADS,
        create: bool = True,
        checksums: bool = True,
    ) -> None:
        super().__init__(directory, row_width, dtype, read_only, create, checksums)
        self._open_locked(lambda: self._open(map_size, read_threads))

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

    # -- reads -------------------------------------------------------------------------------

    def _values(
        self, encoded: list[bytes], database, txn: lmdb.Transaction | None, value_bytes: int
    ) -> tuple[np.ndarray, bytes]:
        """``(sizes, values)``: the stored value's size of each key in ``encoded`` (sorted), 0 where
        absent, and the values of the keys found, joined in order. Read in ``txn``, or in parallel
        transactions when ``txn`` is None and the reads wait on the disk. Values are checked to be
        ``value_bytes`` long before they are copied out of the map (a damaged length could
        reach past the end of the file)."""

        def read_range(txn: lmdb.Transaction, part: list[bytes]) -> tuple[np.ndarray, bytes]:
            values = list(map(txn.get, part, itertools.repeat(b""), itertools.repeat(database)))
            sizes = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
            if bool(((sizes != 0) & (sizes != value_bytes)).any()):
                raise StoreFormatError(
                    f"{self._data_file} is damaged: it holds rows that are not {self.codec.stored_bytes} "
                    f"bytes (or the store's metadata, dim and dtype, does not describe it)"
                )
            return sizes, b"".join(values)

        if txn is not None:
            return read_range(txn, encoded)
        threads = min(self._read_threads, len(encoded) // MIN_KEYS_PER_THREAD)
        if threads < 2:  # too small to split, or to time fairly
            with self._begin() as txn:
                return read_range(txn, encoded)
        start = time.perf_counter()
        if self._seconds_per_key < DISK_BOUND_SECONDS_PER_KEY:
            with self._begin() as txn:
                sizes, values = read_range(txn, encoded)
        else:

            def read_own_transaction(bounds: tuple[int, int]) -> tuple[np.ndarray, bytes]:
                with self._begin() as txn:
                    return read_range(txn, encoded[bounds[0] : bounds[1]])

            edges = np.linspace(0, len(encoded), threads + 1).astype(int).tolist()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._read_threads, thread_name_prefix="lmdb-read")
            parts = list(self._pool.map(read_own_transaction, zip(edges[:-1], edges[1:])))
            sizes = np.concatenate([part[0] for part in parts])
            values = b"".join(part[1] for part in parts)
            self.parallel_reads += 1
        per_key = (time.perf_counter() - start) / len(encoded)
        self._seconds_per_key = (
            per_key if self._seconds_per_key == float("inf") else 0.5 * (self._seconds_per_key + per_key)
        )
        return sizes, values

    def _begin(self):
        """A read transaction: a reader's snapshot, or a new one (as a context manager). Its values
        are copied out as bytes: py-lmdb's views into the map (``buffers=True``) cost 4-20x more
        per value than the copy they save."""
        if self._snapshot is not None:
            return contextlib.nullcontext(self._snapshot)
        return self._env.begin()

    def _refresh(self) -> None:
        self._snapshot.abort()
        self._snapshot = self._env.begin()
        self._read_state()

    def _read_state(self) -> None:
        """The flush count, which stage stages and which holds a flush being applied, and each
        one's log (a reader sees flushes only: the staging log is left empty), as the snapshot (a
        reader) or the newest commit (the writer) records."""
        self.flushes = self._read_flushes()
        self._staging, self._applying = 0, None
        self._logs = [StageLog(stage, self.codec.stored_bytes) for stage in self._stages]
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

    @property
    def _pending_count(self) -> int:
        """Entries the staging log holds (a reader's: none)."""
        return 0 if self.read_only else self._logs[self._staging].entries

    @property
    def _applying_count(self) -> int:
        """Entries the log being applied holds (0: none is)."""
        return 0 if self._applying is None else self._logs[self._applying].entries

    def _read(
        self, txn: lmdb.Transaction | None, keys: torch.Tensor, databases: list
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, found)`` for ``keys`` from ``databases`` in order (``rows``, then ``StageLog``s:
        a later one wins); read in ``txn``, or in fresh transactions (in parallel when disk-bound)
        when it is None. Every row is checked; a key absent from ``rows`` is confirmed absent by
        checking the entries beside it (``_check_neighbours``), so a damaged page is an error, not a
        silently new row."""
        rows = torch.empty(keys.numel(), self.row_width, dtype=self.dtype)
        found = torch.zeros(keys.numel(), dtype=torch.bool)
        if keys.numel() == 0:
            return rows, found
        txn = self._snapshot if txn is None else txn  # a reader reads its snapshot, on one thread
        try:
            for database in databases:
                if database is self._rows:
                    where, ids, stored = self._read_rows(txn, keys)
                else:
                    where, ids, stored = self._read_log(txn, keys, database)
                if where.numel():
                    rows[where] = self.codec.decode(ids, stored, self._data_file)
                    found[where] = True
        except lmdb.Error as error:
            raise self._damaged(error) from None
        return rows, found

    def _read_rows(self, txn, keys: torch.Tensor) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """``(positions in keys, their ids, their stored rows [n, stored_bytes])`` of the keys
        ``rows`` holds, read in id order."""
        key_array = keys.numpy()
        order = np.argsort(key_array, kind="stable")
        sorted_keys = key_array[order]
        encoded = encode_keys(sorted_keys)
        sizes, values = self._values(encoded, self._rows, txn, self.codec.stored_bytes)
        hit = sizes > 0
        if not hit.all():
            self._check_neighbours(txn, [key for key, held in zip(encoded, hit.tolist()) if not held])
        stored = np.frombuffer(values, dtype=np.uint8).reshape(int(hit.sum()), self.codec.stored_bytes)
        return torch.from_numpy(order[hit]), sorted_keys[hit], stored

    def _read_log(
        self, txn, keys: torch.Tensor, log: StageLog
    ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """``_read_rows`` of the keys ``log`` stages (their newest entries, read in log order); an
        entry missing or holding another id is damage."""
        numbers = log.find(keys)
        where = torch.nonzero(numbers >= 0).squeeze(1)
        if where.numel() == 0:
            return where, np.empty(0, dtype=np.int64), np.empty((0, self.codec.stored_bytes), np.uint8)
        where = where[torch.argsort(numbers[where])]
        return where, *self._staged_rows(txn, log, keys[where], numbers[where])

    def _staged_rows(
        self, txn, log: StageLog, keys: torch.Tensor, numbers: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, stored rows [n, stored_bytes])`` of ``log``'s entries ``numbers``, which its index
        gives for ``keys``: an entry missing or holding another id is damage."""
        _, values = self._values(encode_keys(numbers.numpy()), log.database, txn, log.entry_bytes)
        ids, stored = log.split(values)
        if ids.size != keys.numel() or not np.array_equal(ids, keys.numpy()):
            raise StoreFormatError(f"{self._data_file} is damaged: its staged rows do not match their index")
        return ids, stored

    def _check_neighbours(self, txn: lmdb.Transaction | None, absent: list[bytes]) -> None:
        """Check the committed entries on either side of each of the ``absent`` keys (sorted): a
        page damaged where a key should be yields a neighbour that fails its check, or is on the
        wrong side of it."""
        if not absent:
            return
        with contextlib.ExitStack() as stack:
            if txn is None:
                txn = stack.enter_context(self._begin())
            cursor = txn.cursor(self._rows)

            def item() -> tuple[bytes, bytes]:
                key, value = cursor.key(), cursor.value()  # views into the map: lengths checked
                if len(key) != 8 or len(value) != self.codec.stored_bytes:  # before a copy reads them
                    raise StoreFormatError(f"{self._data_file} is damaged: it holds malformed entries")
                return bytes(key), bytes(value)

            def neighbours(key: bytes) -> tuple[bytes, tuple | None, tuple | None]:
                after = item() if cursor.set_range(key) else None
                before = item() if (cursor.prev() if after else cursor.last()) else None
                return key, before, after

            found = list(map(neighbours, absent))
        if any(before and before[0] > key for key, before, _ in found) or any(
            after and after[0] < key for key, _, after in found
        ):
            raise StoreFormatError(f"{self._data_file} is damaged: its entries are out of order")
        entries = dict(entry for _, *pair in found for entry in pair if entry)  # each neighbour once
        if entries:
            self._checked_rows(decode_keys(list(entries)), list(entries.values()))

    def _checked_rows(self, ids: np.ndarray, values: list) -> torch.Tensor:
        """Rows ``[n, row_width]`` of ``ids`` from their stored ``values`` (bytes or map views),
        each checked; a value of the wrong length is ``StoreFormatError``."""
        if any(len(value) != self.codec.stored_bytes for value in values):
            raise StoreFormatError(f"{self._data_file} is damaged: it holds malformed entries")
        stored = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), self.codec.stored_bytes)
        return self.codec.decode(ids, stored, self._data_file)

    def _damaged(self, error: lmdb.Error) -> StoreFormatError:
        return StoreFormatError(
            f"{self._data_file} is damaged (LMDB: {error}); restore the store from a backup, or export "
            f"what still reads and re-import it"
        )

    def _databases(self) -> list:
        """What a read reads, a later one's rows overriding an earlier one's: ``rows``, the log of
        the flush being applied, the staging log."""
        databases = [self._rows]
        if self._applying_count:
            databases.append(self._logs[self._applying])
        if self._pending_count:
            databases.append(self._logs[self._staging])
        for log in databases[1:]:
            if not log.indexed:  # a flush's own rows, read before it committed (it failed)
                with self._begin() as txn:
                    self._load(txn, log)
        return databases

    def _get(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._read(None, keys, self._databases())

    def iter_rows(self, batch_size: int = 65536) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        try:
            yield from self._iter_rows(batch_size)
        except lmdb.Error as error:
            raise self._damaged(error) from None

    def _iter_rows(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        databases = self._databases()
        with self._begin() as txn:
            items = txn.cursor(self._rows).iternext()
            while chunk := list(itertools.islice(items, batch_size)):
                keys, rows = self._decode(chunk)
                staged, staged_found = self._read(txn, keys, databases[1:])  # newer values win
                rows[staged_found] = staged[staged_found]
                yield keys, rows
            for position in range(1, len(databases)):  # each staged key once, with its newest row
                for keys in databases[position].items()[0].split(batch_size):
                    held = self._read(txn, keys, databases[:position])[1]  # came with an earlier one
                    keys = keys[~held]
                    yield keys, self._read(txn, keys, databases[position:])[0]

    def snapshot(self) -> LmdbSnapshot:
        if self.read_only or self._pending_count or self._applying is not None:
            raise RuntimeError("a snapshot is taken of a flushed, writable store: flush first")
        return LmdbSnapshot(self)

    def _decode(self, chunk: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Checked ``(keys, rows)`` of a chunk of ``(key, value)`` entries (map views)."""
        keys, values = zip(*chunk)
        if any(len(key) != 8 for key in keys):
            raise StoreFormatError(f"{self._data_file} is damaged: it holds malformed entries")
        ids = decode_keys([bytes(key) for key in keys])
        return torch.from_numpy(ids), self._checked_rows(ids, list(values))

    def __len__(self) -> int:
        databases = self._databases()
        with self._begin() as txn:
            count = txn.stat(self._rows)["entries"]
            for position in range(1, len(databases)):  # keys no earlier database holds
                held = self._read(txn, databases[position].items()[0], databases[:position])[1]
                count += int((~held).sum())
            return count

    # -- writes ------------------------------------------------------------------------------

    def _write(self, work):
        """Run ``work(txn)`` in one write transaction, doubling the map while it is full; returns
        what it returns. A transaction that fails leaves the data as it was; a full disk is
        ``OSError(ENOSPC)``."""
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    return work(txn)
            except lmdb.MapFullError:
                self._env.set_mapsize(self._env.info()["map_size"] * 2)
            except lmdb.Error as error:
                raise self._as_os_error(error) from None

    def _as_os_error(self, error: lmdb.Error) -> OSError:
        """LMDB reports a full disk as an I/O error of its commit: say which it was."""
        space = os.statvfs(self._path)
        free = space.f_bavail * space.f_frsize
        if free < LOW_DISK_BYTES:
            return OSError(
                errno.ENOSPC,
                f"the disk holding {self._path} is full ({free:,} bytes free; LMDB: {error}); free space "
                f"and retry: the store keeps its last flush, and rows not yet written stay cached",
            )
        return OSError(errno.EIO, f"LMDB could not write to {self._path}: {error}")

    def _put(self, keys: torch.Tensor, rows: torch.Tensor, before_flush: bool) -> None:
        log = self._logs[self._staging]
        stored = np.ascontiguousarray(self.codec.encode(keys.numpy(), rows))
        items, numbers = log.entries_of(keys.numpy(), stored)

        def stage(txn: lmdb.Transaction) -> None:
            txn.cursor(log.database).putmulti(items, append=True)

        self._write(stage)
        if before_flush:  # not indexed: the flush copies the log by scanning it
            log.appended(keys.numel())
        else:
            log.record(keys, numbers)

    def flush(self) -> None:
        self._check_writable()
        if self._applying is not None:  # the last flush's apply was cut short: apply it again
            self._apply()
        flushes, staging = self.flushes + 1, self._staging

        def commit(txn: lmdb.Transaction) -> None:  # the commit point: the count, and the roles
            txn.put(_FLUSHES_KEY, struct.pack("<Q", flushes), db=self._meta)
            if self._pending_count:
                txn.put(_APPLYING_KEY, bytes([staging]), db=self._meta)
                txn.put(_STAGING_KEY, bytes([1 - staging]), db=self._meta)

        self._write(commit)
        self.flushes = flushes
        if self._pending_count:
            self._applying, self._staging = staging, 1 - staging
        self._sync()
        if self._applying is not None:
            self._apply()
        self._record_as_left()

    def _apply(self) -> None:
        """Copy the log being applied into ``rows`` in its order (an id's newest entry last),
        ``APPLY_ROWS`` entries a transaction, each sorted by id; then empty the log and clear its
        role; then sync."""
        log = self._logs[self._applying]
        start = 0
        while True:

            def move(txn: lmdb.Transaction, start=start) -> int:
                cursor = txn.cursor(log.database)
                if not cursor.set_range(encode_keys(np.array([start], dtype=np.int64))[0]):
                    return 0
                values = [value for _, value in itertools.islice(cursor.iternext(), APPLY_ROWS)]
                if any(len(value) != log.entry_bytes for value in values):
                    raise StoreFormatError(f"{self._data_file} is damaged: it holds malformed staged rows")
                ids, stored = log.split(b"".join(values))
                order = np.argsort(ids, kind="stable")  # an id's entries stay in order: its newest last
                stored = np.ascontiguousarray(stored[order]).view(f"V{self.codec.stored_bytes}")
                txn.cursor(self._rows).putmulti(list(zip(encode_keys(ids[order]), stored.ravel().tolist())))
                return ids.size

            moved = self._write(move)
            if not moved:
                break
            start += moved

        def clear(txn: lmdb.Transaction) -> None:
            txn.drop(log.database, delete=False)
            txn.delete(_APPLYING_KEY, db=self._meta)

        self._write(clear)
        log.clear()
        self._applying = None
        self._sync()

    def _sync(self) -> None:
        try:
            self._env.sync(True)
        except lmdb.Error as error:
            raise self._as_os_error(error) from None

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

    def last_flush_time(self) -> float | None:
        return (self._path / "data.mdb").stat().st_mtime

    def report(self) -> dict:
        """The base counters; ``index_bytes``: the RAM of the staged rows' indexes (16 to 32 bytes
        an id staged since the last flush)."""
        return {**super().report(), "index_bytes": sum(log.nbytes for log in self._logs)}

    def structure_problems(self) -> list[str]:
        """Entries of ``rows`` whose key is not 8 bytes or whose value is not ``stored_bytes`` (a
        short value would otherwise fail, or worse, in the row decoder); a log being applied was
        checked when the store opened."""
        try:
            with self._begin() as txn:
                wrong = [
                    (len(key), len(value))
                    for key, value in txn.cursor(self._rows)
                    if len(key) != 8 or len(value) != self.codec.stored_bytes
                ]
        except lmdb.Error as error:
            return [f"the LMDB data in {self._path} is damaged: {error}"]
        problems = [
            f"an LMDB entry has a {key_length}-byte key and a {value_length}-byte value "
            f"(expected 8 and {self.codec.stored_bytes})"
            for key_length, value_length in wrong[:3]
        ]
        if len(wrong) > 3:
            problems.append(f"... {len(wrong)} malformed LMDB entries in all")
        return problems

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        if self._snapshot is not None:
            self._snapshot.abort()
        self._env.close()
        if not self.read_only:
            self._record_as_left()
        _OPEN_IN_THIS_PROCESS.discard(self._path.resolve())
        self._release_lock()


class LmdbSnapshot:
    """The rows of a flushed LMDB store in one read transaction (LMDB's own snapshot): its writer
    goes on committing beside it, and reuses none of the pages it holds until it is closed."""

    def __init__(self, store: LmdbColdStore) -> None:
        self._store = store
        self._txn = store._env.begin()
        self.flushes = store.flushes

    def __len__(self) -> int:
        return self._txn.stat(self._store._rows)["entries"]

    def iter_rows(self, batch_size: int = 65536) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        items = self._txn.cursor(self._store._rows).iternext()
        try:
            while chunk := list(itertools.islice(items, batch_size)):
                yield self._store._decode(chunk)
        except lmdb.Error as error:
            raise self._store._damaged(error) from None

    def close(self) -> None:
        self._txn.abort()
