"""The reference policies' replay compiled for the CPU (``replay.cpp``, g++), called through ctypes:
Belady's MIN (one access at a time, or over batches resident whole), LRU and FIFO over a dense key
trace, in native loops.
``tierstore.analysis.reference_policies`` uses it where it builds, and its Python loops elsewhere.
"""

from __future__ import annotations

import ctypes
import functools
import subprocess

import numpy as np

from .build_cache import cached_build, source_dir

SOURCE = "replay.cpp"
_FLAGS = ["-std=c++17", "-O2", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror"]
_I64 = ctypes.c_longlong
_POINTER = ctypes.c_void_p


@functools.cache
def replay_library() -> ctypes.CDLL | None:
    """The compiled replay (built once into the kernel cache), None where g++ cannot build it."""
    try:
        compiler = subprocess.run(
            ["g++", "--version"], capture_output=True, text=True, check=True
        ).stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError):
        return None
    source = source_dir() / SOURCE

    def compile_library(partial) -> None:
        command = ["g++", *_FLAGS, "-x", "c++", str(source), "-o", str(partial)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"host build of {SOURCE} failed:\n{result.stderr}")

    inputs = [source.read_bytes(), " ".join(_FLAGS + [compiler]).encode()]
    try:
        library = ctypes.CDLL(str(cached_build("replay", inputs, ".so", compile_library)))
    except (OSError, RuntimeError):
        return None
    library.replay_belady.restype = _I64
    library.replay_belady.argtypes = [_POINTER, _POINTER, _I64, _I64, _I64]
    library.replay_belady_batched.restype = _I64
    library.replay_belady_batched.argtypes = [_POINTER, _POINTER, _I64, _I64, _I64, _I64]
    for name in ("replay_lru", "replay_fifo"):
        getattr(library, name).restype = _I64
        getattr(library, name).argtypes = [_POINTER, _I64, _I64, _I64]
    return library


def native_hits(
    library: ctypes.CDLL, policy: str, dense: np.ndarray, distinct: int, capacity: int, following=None
) -> int:
    """Hits of ``policy`` ("belady", "lru" or "fifo") with ``capacity`` keys over ``dense`` keys
    (int64 in ``[0, distinct)``, contiguous); "belady" also takes ``following`` (each access's next
    use, as ``reference_policies.next_uses`` gives it)."""
    if policy == "belady":
        return library.replay_belady(dense.ctypes.data, following.ctypes.data, dense.size, distinct, capacity)
    return getattr(library, f"replay_{policy}")(dense.ctypes.data, dense.size, distinct, capacity)


def native_batched_belady_hits(
    library: ctypes.CDLL, dense: np.ndarray, distinct: int, capacity: int, batch: int, following: np.ndarray
) -> int:
    """Hits of MIN over batches of ``batch`` accesses resident whole (``replay_belady_batched``) with
    ``capacity`` keys over ``dense`` keys and their ``following`` next uses; -1 where a batch holds
    more distinct keys than ``capacity``."""
    return library.replay_belady_batched(
        dense.ctypes.data, following.ctypes.data, dense.size, distinct, capacity, batch
    )
