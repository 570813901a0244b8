"""The LMDB cold store's layout: its directory, sub-databases and keys, the settings of its reads,
and the checks of its data file made before LMDB maps it (a short or damaged file would be SIGBUS
or worse inside LMDB)."""

from __future__ import annotations

import struct
from pathlib import Path

from ...errors import StoreFormatError

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
