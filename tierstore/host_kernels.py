"""The ``cuda/`` kernels compiled for the CPU (g++ with ``cuda/host_shim.h``), called through ctypes.

``parallel=True`` builds the host tier's kernels: OpenMP threads, one row per iteration
(``host_cache_backend="openmp"``). ``parallel=False`` builds one thread running the GPU's own
loops, which the tests check against the torch reference where there is no GPU. Libraries are
built at first use and cached beside the CUBINs (``tierstore.kernels.cache_dir()``), keyed by
the sources' SHA-256, the flags, the compiler's version and (for the OpenMP build, tuned with
``-march=native``) the CPU's model and instruction sets; a warning fails the build.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
from pathlib import Path

import torch

from .kernels import SOURCE, cache_dir, source_dir

_FLAGS = ["-std=c++17", "-O3", "-shared", "-fPIC", "-fno-strict-aliasing", "-Wall", "-Wextra", "-Werror",
          "-DTIERSTORE_HOST_SHIM"]
# -march=native: AVX2/FMA made the SGD update 1.6-2x faster here; 256-bit vectors because the
# AVX-512 code gcc chose for this AMD EPYC ran the gradient sum 1.5x slower.
_PARALLEL_FLAGS = ["-fopenmp", "-DTIERSTORE_OPENMP", "-Wno-unknown-pragmas", "-march=native",
                   "-mprefer-vector-width=256"]


def _cpu_identity() -> str:
    """The CPU's model and instruction-set flags (what ``-march=native`` compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(wanted[:2])


class HostKernels:
    """One host build's kernels behind ``KernelModule``'s ``launch(name, n, *args)`` (CPU tensors;
    ``n`` sizes GPU grids and is unused here: each kernel loops over all its items)."""

    def __init__(self, library: Path) -> None:
        self._library = ctypes.CDLL(str(library))

    def launch(self, name: str, n: int, *args) -> None:
        if n <= 0:
            return
        converted = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                if arg.device.type != "cpu" or not arg.is_contiguous():
                    raise ValueError(f"{name}: host kernels take contiguous CPU tensors, got one on {arg.device}")
                converted.append(ctypes.c_void_p(arg.data_ptr()))
            elif isinstance(arg, float):
                converted.append(ctypes.c_float(arg))
            else:
                converted.append(ctypes.c_int64(int(arg)))
        getattr(self._library, name)(*converted)


def build(parallel: bool, source_name: str = SOURCE) -> Path:
    """Compile ``cuda/<source_name>`` for the host into the kernel cache (once per source, flags
    and compiler); returns the library's path."""
    flags = _FLAGS + (_PARALLEL_FLAGS if parallel else [])
    compiler = subprocess.run(["g++", "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    digest = hashlib.sha256()
    for part in (source_dir() / source_name, source_dir() / "host_shim.h"):
        digest.update(part.read_bytes())
    digest.update(" ".join(flags + [compiler]).encode())
    if parallel:
        digest.update(_cpu_identity().encode())
    library = cache_dir() / f"{Path(source_name).stem}-{digest.hexdigest()[:24]}-host.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    partial = library.with_suffix(f".{os.getpid()}.partial")
    command = ["g++", *flags, f"-I{source_dir()}", "-x", "c++", str(source_dir() / source_name), "-o", str(partial)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"host build of {source_name} failed:\n{result.stderr}")
    partial.replace(library)
    return library


@functools.cache
def host_kernels(parallel: bool = True) -> tuple[HostKernels | None, str]:
    """``(the host build, "")``, or ``(None, why it cannot be built here)``."""
    try:
        return HostKernels(build(parallel)), ""
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        return None, f"{type(error).__name__}: {error}"
