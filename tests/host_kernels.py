"""The kernels' two host builds, for the tests: one thread running the GPU's loops, and OpenMP."""

from __future__ import annotations

from tierstore.kernels import HostKernels, host_kernels


def shared_host_kernels() -> HostKernels:
    """The serial host build (built once per machine, cached); fails loudly if it cannot be built."""
    kernels, why_not = host_kernels(parallel=False)
    assert kernels is not None, f"the kernels' host build is needed for these tests: {why_not}"
    return kernels


def parallel_host_kernels() -> HostKernels:
    """The host tier's OpenMP build."""
    kernels, why_not = host_kernels(parallel=True)
    assert kernels is not None, f"the kernels' OpenMP host build is needed for these tests: {why_not}"
    return kernels
