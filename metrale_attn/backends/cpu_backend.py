"""The CPU backend: the same kernel sources run by the CUDA-on-CPU shim, on NumPy arrays.

A testing and demo backend, not a fast one. ``order`` picks the shim's thread
order (``"default"``, ``"shuffle:SEED"``, ``"warp-ahead:SEED"``, ...; ``None``
reads ``METRALE_ATTN_CPU_ORDER``) and ``asan`` builds and runs under
AddressSanitizer.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np

from ..kernels import Variant
from . import ArrayInfo, Launch

class _CpuModule:
    def __init__(self, module, order: Optional[str]):
        self._module = module
        self._order = order

    def launch(self, launch: Launch) -> None:
        self._module.launch(launch.kernel, launch.grid, launch.block, launch.shared_bytes, launch.args,
                            order=self._order)


class CpuBackend:
    name = "cpu"
    always_check_indices = True  # host memory: proving indices in range costs no copy
    emulated = True  # the CUDA-on-CPU shim: times are the emulator's

    def __init__(self, *, order: Optional[str] = None, asan: bool = False) -> None:
        self.order = order
        self.asan = asan

    def load(self, variant: Variant) -> _CpuModule:
        from ..cuda_on_cpu import compile_module

        module = compile_module(variant.source(), name=variant.name, defines=variant.defines(), asan=self.asan)
        return _CpuModule(module, self.order)

    def describe(self, array, argument: str) -> ArrayInfo:
        if not isinstance(array, np.ndarray):
            raise TypeError(f"{argument} must be a NumPy array on the cpu backend, got {type(array).__name__}")
        item = array.dtype.itemsize
        return ArrayInfo(array.__array_interface__["data"][0], array.shape,
                         tuple(s // item for s in array.strides), array.dtype, item, None,
                         bool(array.flags.writeable))

    def empty(self, shape, dtype, like=None):
        return np.empty(shape, dtype=dtype)

    def pointer(self, array, info: Optional[ArrayInfo] = None):
        return None if array is None else _contiguous_alias(array)

    def launch_stream(self, stream, like=None):
        if stream is not None:
            raise ValueError("stream must be None on the cpu backend (launches run synchronously)")
        return contextlib.nullcontext()

    def current_stream(self) -> None:
        """No streams: every launch has finished when it returns."""
        return None

    def stream_busy(self, previous, current) -> bool:
        return False

    def device(self) -> None:
        """No GPU: the target's table stands in for the device."""
        return None

    def current_device(self) -> None:
        return None

    def upload(self, array):
        return np.array(array, copy=True, order="C")

    def verify_mma(self) -> list[str]:
        """Nothing: the emulation is what the kernels are verified against (CI runs the
        known-answer test here too, as a test of the emulation)."""
        return []

    def host_copy(self, array):
        return np.asarray(array)

    def synchronize(self) -> None:
        pass


def _contiguous_alias(array: np.ndarray) -> np.ndarray:
    """``array`` itself when C-contiguous, else a flat byte view of the memory it spans.

    The shim takes contiguous arrays; a strided view (a K half of a combined KV
    tensor, q inside a wider buffer) is passed as the bytes from its first to its
    last element, so the kernel sees the same address and strides as on a GPU.
    """
    if array.flags.c_contiguous:
        return array
    if min(array.strides) < 0:
        raise ValueError("arrays with negative strides are not supported")
    extent = sum((n - 1) * s for n, s in zip(array.shape, array.strides)) + array.itemsize if array.size else 0
    # view(uint8) needs a contiguous last dim, which run() has already checked.
    return np.lib.stride_tricks.as_strided(array.view(np.uint8), shape=(extent,), strides=(1,), writeable=False)

