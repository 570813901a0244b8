"""One on-disk cache for compiled kernels (CUBINs from NVRTC, shared libraries from g++).

Artifacts live under ``$TIERSTORE_KERNEL_CACHE`` (default ``~/.cache/tierstore/kernels``), named
by what they were built from (a SHA-256 of the sources and every setting that changes the
output), and are written atomically (a rename), so concurrent processes never read half a file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

SOURCE = "embedding_cache.cu"
SHIM = "host_shim.h"
STEP_SOURCE = "host_step.cpp"  # the host build's training-step passes (includes SOURCE)
CACHE_SOURCE = "host_cache.cpp"  # the host cache tier's calls (included by STEP_SOURCE)
HORIZON_SOURCE = "host_horizon.cpp"  # a lookahead horizon's calls (included by STEP_SOURCE)
AGEING_SOURCE = "host_ageing.cpp"  # LFU's shadow caches (included by STEP_SOURCE)


def source_dir() -> Path:
    """The directory holding the kernel sources: in an installed wheel, the package
    ``tierstore.kernel_sources`` (the repository's top-level ``cuda/``, copied in at build time);
    in a source checkout (an editable install), ``cuda/`` itself. (``cuda/`` has no ``__init__.py``:
    run from the repository's root, one would hide cuda-python's own ``cuda`` package.)"""
    spec = importlib.util.find_spec("tierstore.kernel_sources")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return Path(__file__).resolve().parents[2] / "cuda"


def cache_dir() -> Path:
    return Path(os.environ.get("TIERSTORE_KERNEL_CACHE", Path.home() / ".cache" / "tierstore" / "kernels"))


def cached_build(stem: str, inputs: list[bytes], suffix: str, build: Callable[[Path], None]) -> Path:
    """The artifact ``cache_dir()/<stem>-<digest of inputs><suffix>``, made by ``build(partial_path)``
    (which writes the file) the first time it is asked for."""
    digest = hashlib.sha256()
    for part in inputs:
        digest.update(part)
    path = cache_dir() / f"{stem}-{digest.hexdigest()[:24]}{suffix}"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    build(partial)
    partial.replace(path)
    return path
