"""The kernels on a GPU: compiled by NVRTC to a CUBIN, cached, loaded and launched through the
CUDA driver API (cuda-python).

NVRTC compiles for the device's own compute capability (PTX from a newer NVRTC does not JIT on an
older driver); the CUBIN is cached by ``build_cache`` under the sources' SHA-256, the architecture
and the NVRTC version. ``CudaKernels`` loads it into torch's context and launches kernels on
torch's current stream. Every CUDA result is checked; a failure raises ``CudaError`` naming the
kernel (or file) and the call. Warnings fail the compile, so a kernel that compiles here
compiles clean.
"""

from __future__ import annotations

import torch

from .build_cache import SOURCE, cached_build, source_dir
from .launch import KERNEL_DTYPES, kernel_arguments

THREADS_PER_BLOCK = 256
NVRTC_OPTIONS = ("-std=c++17",)  # warnings fail the build through the log check, on any NVRTC


class CudaError(RuntimeError):
    """A CUDA driver or NVRTC call failed."""


def _check(result, call: str, subject: str):
    """Unpack a cuda-python ``(status, *values)`` result, raising ``CudaError`` unless it is success."""
    status, *values = result if isinstance(result, tuple) else (result,)
    if int(status) != 0:
        raise CudaError(f"{subject}: {call} failed with {status!r}")
    return values[0] if len(values) == 1 else tuple(values)


def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    return _check(nvrtc.nvrtcVersion(), "nvrtcVersion", "NVRTC")


def compile_cubin(source_name: str = SOURCE, arch: str = "sm_90") -> bytes:
    """CUBIN of the kernel source ``source_name`` for ``arch`` (``"sm_80"``, ``"sm_90"``...).
    Raises ``CudaError`` with NVRTC's log on any error or warning."""
    from cuda.bindings import nvrtc

    source = (source_dir() / source_name).read_bytes()
    program = _check(
        nvrtc.nvrtcCreateProgram(source, source_name.encode(), 0, [], []), "nvrtcCreateProgram", source_name
    )
    try:
        options = [f"--gpu-architecture={arch}".encode(), *(option.encode() for option in NVRTC_OPTIONS)]
        status = nvrtc.nvrtcCompileProgram(program, len(options), options)[0]
        log_size = _check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize", source_name)
        log = b" " * log_size
        _check(nvrtc.nvrtcGetProgramLog(program, log), "nvrtcGetProgramLog", source_name)
        log_text = log.rstrip(b"\x00").decode(errors="replace").strip()
        if int(status) != 0 or log_text:
            raise CudaError(
                f"{source_name}: nvrtcCompileProgram for {arch} failed with {status!r}:\n{log_text}"
            )
        size = _check(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize", source_name)
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN", source_name)
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def cached_cubin(source_name: str, arch: str) -> bytes:
    """``compile_cubin`` through the kernel cache."""
    major, minor = nvrtc_version()
    stem = f"{source_name.rsplit('.', 1)[0]}-{arch}-nvrtc{major}.{minor}"
    source = (source_dir() / source_name).read_bytes()
    path = cached_build(
        stem, [source], ".cubin", lambda partial: partial.write_bytes(compile_cubin(source_name, arch))
    )
    return path.read_bytes()


def device_arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


class CudaKernels:
    """The kernel source loaded on one CUDA device; ``launch(name, n, *args)`` runs a kernel over
    ``n`` items (grid-stride: the grid is capped, every kernel loops)."""

    def __init__(self, device: torch.device, source_name: str = SOURCE) -> None:
        from cuda.bindings import driver

        self._driver = driver
        self.device = torch.device(device)
        torch.zeros(1, device=self.device)  # torch creates the device's primary context
        _check(driver.cuInit(0), "cuInit", source_name)
        cu_device = _check(driver.cuDeviceGet(self.device.index or 0), "cuDeviceGet", source_name)
        # The primary context is the one torch uses; it is made current before every call, since
        # autograd runs backward hooks on its own threads.
        self._context = _check(
            driver.cuDevicePrimaryCtxRetain(cu_device), "cuDevicePrimaryCtxRetain", source_name
        )
        _check(driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent", source_name)
        cubin = cached_cubin(source_name, device_arch(self.device))
        self._module = _check(driver.cuModuleLoadData(cubin), "cuModuleLoadData", source_name)
        self._functions: dict = {}
        self._max_blocks = torch.cuda.get_device_properties(self.device).multi_processor_count * 32

    def _function(self, name: str):
        if name not in self._functions:
            self._functions[name] = _check(
                self._driver.cuModuleGetFunction(self._module, name.encode()), "cuModuleGetFunction", name
            )
        return self._functions[name]

    def launch(self, name: str, n: int, *args) -> None:
        """Run kernel ``name`` over ``n`` items with ``args`` (see ``launch.kernel_arguments``)."""
        if n <= 0:
            return
        arguments = kernel_arguments(name, args, self.device, CudaError)
        blocks = min(self._max_blocks, -(-n // THREADS_PER_BLOCK))
        stream = self._driver.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        _check(self._driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent", name)
        _check(
            self._driver.cuLaunchKernel(
                self._function(name), blocks, 1, 1, THREADS_PER_BLOCK, 1, 1, 0, stream, arguments, 0
            ),
            "cuLaunchKernel",
            name,
        )


_loaded: dict[torch.device, CudaKernels] = {}


def device_kernels(
    device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[CudaKernels | None, str]:
    """``(the kernels loaded on device, "")``, or ``(None, why they cannot run there for rows of dtype)``."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, f"the device is {device}, not a CUDA device"
    if dtype not in KERNEL_DTYPES:
        return None, f"the kernels store float32, float16 or bfloat16 rows, not {dtype}"
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA device"
    try:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in _loaded:
            _loaded[device] = CudaKernels(device)
    except (ImportError, RuntimeError, OSError) as error:  # no GPU or driver, no NVRTC, CudaError
        return None, f"{type(error).__name__}: {error}"
    return _loaded[device], ""
