"""The kernels of the cache tiers (``embedding_cache.cu``), for the GPU and for the CPU.

One source: hash find/insert/erase, LFU scores and victim scores, row gather/scatter, the fused
optimizers and the pooled lookup's weight gradient. ``cuda`` compiles it with NVRTC and launches it
through the driver API; ``host`` compiles it with g++ (``host_shim.h``): with OpenMP for the host
tier, or as one thread running the GPU's loops for the tests. Both share one build cache
(``build_cache``) and one argument convention (``launch``), so a kernel is called the same way on
either: ``kernels.launch(name, n, *args)``.
"""

from .build_cache import SOURCE, cache_dir, source_dir
from .cuda import CudaError, CudaKernels, compile_cubin, device_kernels
from .host import HostKernels, host_kernels

__all__ = [
    "SOURCE",
    "CudaError",
    "CudaKernels",
    "HostKernels",
    "cache_dir",
    "compile_cubin",
    "device_kernels",
    "host_kernels",
    "source_dir",
]
