"""Kernel arguments, the same for the GPU and the CPU builds: tensors pass as pointers, floats as
float32, ints as int64 (the kernels' ``i64``), in the order of the kernel's parameters."""

from __future__ import annotations

import ctypes

import torch

# Rows the kernels store: float32, or 16-bit rows (their ``format`` code in the kernels) updated in
# float32 with their optimizer state in float32 (``metadata.row_width``).
HALF_FORMATS = {torch.float16: 0, torch.bfloat16: 1}
KERNEL_DTYPES = (torch.float32, *HALF_FORMATS)
ROW_FORMATS = {torch.float32: -1, **HALF_FORMATS}  # the native step's codes (host_step.cpp's FLOAT32: -1)


def kernel_arguments(
    name: str, args: tuple, device: torch.device, error: type[Exception] = ValueError
) -> tuple[tuple, tuple]:
    """``(values, ctypes types)`` of ``args`` for kernel ``name``. Tensors must be contiguous and on
    ``device`` (the kernels read them packed); anything else raises ``error`` naming the kernel."""
    values, types = [], []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            if arg.device != device or not arg.is_contiguous():
                raise error(
                    f"{name}: a tensor argument is on {arg.device} (contiguous: {arg.is_contiguous()}); "
                    f"the kernel needs contiguous tensors on {device}"
                )
            values.append(arg.data_ptr())
            types.append(ctypes.c_void_p)
        elif isinstance(arg, float):
            values.append(arg)
            types.append(ctypes.c_float)
        else:
            values.append(int(arg))
            types.append(ctypes.c_int64)
    return tuple(values), tuple(types)
