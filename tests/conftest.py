import subprocess

import pytest
import torch
from host_kernels import parallel_host_kernels, shared_host_kernels

from tierstore.tiers import KernelRows


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["lmdb", "mmap"])
def backend(request):
    return request.param


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "store"


@pytest.fixture(params=["torch", "cuda-kernels-on-host", pytest.param("gpu", marks=pytest.mark.gpu)])
def device_tier(request):
    """The device tier's ``device`` and ``device_cache_backend``: torch ops on the CPU, the kernels'
    one-thread host build (the GPU's own loops, on CPU tensors) standing in for the GPU, or the
    kernels on a real GPU (skipped without one)."""
    if request.param == "gpu":
        return {"device": torch.device("cuda"), "device_cache_backend": "cuda"}
    if request.param == "torch":
        return {"device": torch.device("cpu"), "device_cache_backend": "torch"}
    return {"device": torch.device("cpu"), "device_cache_backend": KernelRows(shared_host_kernels(), "cuda")}


@pytest.fixture(scope="module", params=["one-thread-gpu-loops", "openmp"])
def host(request):
    """Both host builds of the kernels: one thread running the GPU's loops, and the host
    tier's OpenMP kernels."""
    return shared_host_kernels() if request.param == "one-thread-gpu-loops" else parallel_host_kernels()


@pytest.fixture
def tiny_filesystem(tmp_path):
    """A 2 MiB tmpfs (needs the right to mount; skipped, saying so, without it)."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)], capture_output=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tiny tmpfs here: {result.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)
