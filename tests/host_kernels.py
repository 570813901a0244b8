"""Test-only: the ``cuda/`` kernels built for the host with ``cuda/host_shim.h`` (g++), called
through ctypes with CPU tensors, behind the same ``launch(name, n, *args)`` as ``KernelModule``."""

from __future__ import annotations

import ctypes
import functools
import subprocess
import tempfile
from pathlib import Path

import torch

from tierstore.kernels import SOURCE, source_dir

GXX_FLAGS = ["-std=c++17", "-O2", "-shared", "-fPIC", "-fno-strict-aliasing", "-Wall", "-Wextra", "-Werror",
             "-DTIERSTORE_HOST_SHIM"]


def build(directory: Path, source_name: str = SOURCE) -> Path:
    """Compile ``cuda/<source_name>`` with g++ into ``directory``; a warning fails the build."""
    library = directory / f"{Path(source_name).stem}_host.so"
    command = ["g++", *GXX_FLAGS, f"-I{source_dir()}", "-x", "c++", str(source_dir() / source_name), "-o", str(library)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"host build of {source_name} failed:\n{result.stderr}")
    return library


class HostKernels:
    """The kernels of one host build; arguments as ``KernelModule.launch`` (CPU tensors)."""

    def __init__(self, library: Path) -> None:
        self._library = ctypes.CDLL(str(library))

    def launch(self, name: str, n: int, *args) -> None:
        if n <= 0:
            return
        converted = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                assert arg.device.type == "cpu" and arg.is_contiguous(), name
                converted.append(ctypes.c_void_p(arg.data_ptr()))
            elif isinstance(arg, float):
                converted.append(ctypes.c_float(arg))
            else:
                converted.append(ctypes.c_int64(int(arg)))
        getattr(self._library, name)(*converted)


@functools.cache
def shared_host_kernels() -> HostKernels:
    """One host build per test process."""
    return HostKernels(build(Path(tempfile.mkdtemp(prefix="tierstore-host-kernels-"))))
