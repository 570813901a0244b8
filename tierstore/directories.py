"""Whole directories replaced atomically: ``exchange`` (Linux ``renameat2(RENAME_EXCHANGE)``)."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

from .metadata import fsync_directory

_LIBC = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def exchange(first: Path, second: Path) -> None:
    """Swap the directories at ``first`` and ``second`` (same filesystem) in one step: a crash
    leaves both as they were or both swapped, never a path without a directory. Durable on return."""
    renameat2 = getattr(_LIBC, "renameat2", None)
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "this C library has no renameat2: directories cannot be exchanged")
    result = renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(
            code,
            f"cannot exchange {first} and {second} atomically ({os.strerror(code)}): the filesystem "
            f"must support renameat2(RENAME_EXCHANGE) (ext4, xfs, btrfs, tmpfs do)",
        )
    fsync_directory(Path(first).parent)
    if Path(second).parent != Path(first).parent:
        fsync_directory(Path(second).parent)
