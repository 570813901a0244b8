"""The kernels compiled for the CPU (g++ with ``host_shim.h``), called through ctypes.

``parallel=True`` is the build the host tier and the mmap store's key indexes run on in
production (``host_cache_backend="openmp"``/``"auto"``): OpenMP threads, one row per iteration,
tuned for this CPU (``-march=native``, 256-bit vectors, which ran the gradient sum faster than
512-bit ones on AMD EPYC). ``parallel=False`` builds one thread running the GPU's own grid-stride
loops, which the tests check against the torch reference where there is no GPU. Libraries are
cached by ``build_cache`` under the sources' SHA-256, the flags, the compiler's version and (for
the tuned build) the CPU's model and instruction sets; a warning fails the build.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
from pathlib import Path

import torch

from .build_cache import (
    AGEING_SOURCE,
    CACHE_SOURCE,
    HORIZON_SOURCE,
    SHIM,
    SOURCE,
    STEP_SOURCE,
    cached_build,
    source_dir,
)
from .launch import kernel_arguments

_FLAGS = [
    "-std=c++17",
    "-O3",
    "-shared",
    "-fPIC",
    "-fno-strict-aliasing",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-DTIERSTORE_HOST_SHIM",
]
_PARALLEL_FLAGS = [
    "-fopenmp",
    "-DTIERSTORE_OPENMP",
    "-Wno-unknown-pragmas",
    "-march=native",
    "-mprefer-vector-width=256",
]
_CPU = torch.device("cpu")


def _cpu_identity() -> str:
    """The CPU's model and instruction-set flags (what ``-march=native`` compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(wanted[:2])


SERIAL_BELOW = 1024  # items: a launch of fewer runs on the calling thread alone


@functools.cache
def openmp_runtime() -> ctypes.CDLL | None:
    """libgomp (the OpenMP runtime g++ links and torch uses), None under another runtime."""
    try:
        runtime = ctypes.CDLL("libgomp.so.1")
        runtime.omp_get_max_threads, runtime.omp_set_num_threads  # noqa: B018 (both must exist)
        return runtime
    except (OSError, AttributeError):
        return None


class HostKernels:
    """One host build behind the GPU build's ``launch(name, n, *args)`` (CPU tensors; each kernel
    loops over all its ``n`` items). A launch of fewer than ``SERIAL_BELOW`` items runs on one
    thread: waking an OpenMP team costs more than such a loop, and far more on a busy machine,
    where the team's barrier waits for a thread the OS has put aside."""

    def __init__(self, library: Path) -> None:
        self._library = ctypes.CDLL(str(library))

    @property
    def step_library(self) -> ctypes.CDLL | None:
        """The library with the training step's passes (``host_step.cpp``: the tuned build), else None."""
        return self._library if hasattr(self._library, "step_distinct") else None

    def launch(self, name: str, n: int, *args) -> None:
        if n <= 0:
            return
        values, types = kernel_arguments(name, args, _CPU)
        kernel = getattr(self._library, name)
        runtime = openmp_runtime() if n < SERIAL_BELOW else None
        if runtime is None:
            kernel(*(kind(value) for value, kind in zip(values, types)))
            return
        threads = runtime.omp_get_max_threads()  # this thread's setting (OpenMP's is per thread)
        runtime.omp_set_num_threads(1)
        try:
            kernel(*(kind(value) for value, kind in zip(values, types)))
        finally:
            runtime.omp_set_num_threads(threads)


def build(parallel: bool) -> Path:
    """Compile the kernel source for the host into the kernel cache (once per source, flags,
    compiler and, for the tuned build, CPU); returns the library's path. The tuned build also
    holds the training step's passes (``host_step.cpp``, which includes the kernels)."""
    source_name = STEP_SOURCE if parallel else SOURCE
    flags = _FLAGS + (_PARALLEL_FLAGS if parallel else [])
    compiler = subprocess.run(
        ["g++", "--version"], capture_output=True, text=True, check=True
    ).stdout.splitlines()[0]
    inputs = [
        (source_dir() / name).read_bytes()
        for name in (SOURCE, SHIM, STEP_SOURCE, CACHE_SOURCE, HORIZON_SOURCE, AGEING_SOURCE)
    ]
    inputs.append(" ".join(flags + [compiler]).encode())
    if parallel:
        inputs.append(_cpu_identity().encode())

    def compile_library(partial: Path) -> None:
        command = [
            "g++",
            *flags,
            f"-I{source_dir()}",
            "-x",
            "c++",
            str(source_dir() / source_name),
            "-o",
            str(partial),
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"host build of {source_name} failed:\n{result.stderr}")

    return cached_build(f"{SOURCE.rsplit('.', 1)[0]}-host", inputs, ".so", compile_library)


@functools.cache
def host_kernels(parallel: bool = True) -> tuple[HostKernels | None, str]:
    """``(the host build, "")``, or ``(None, why it cannot be built here)``."""
    try:
        return HostKernels(build(parallel)), ""
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        return None, f"{type(error).__name__}: {error}"


def host_step_library() -> ctypes.CDLL | None:
    """The tuned host build's library (the training step's and the tiers' native calls), None where
    it cannot be built here."""
    kernels, _ = host_kernels(parallel=True)
    return None if kernels is None else kernels.step_library
