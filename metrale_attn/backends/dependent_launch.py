"""Programmatic dependent launch: one kernel launched through the CUDA driver's
``cuLaunchKernelEx`` with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` (CUDA 12.0
and later, devices of compute capability 9.0 and later), which CuPy's launch cannot ask for.

Such a kernel may start once every CTA of the kernel before it in the stream has released
its dependents (``pd_release_dependents``) or exited, instead of after that kernel's end:
its launch overlaps the other's tail. It must wait on the device (``pd_wait_prior_grids``)
before it reads what the other wrote; the merge kernels do, first thing.

The call goes through cuda-bindings (``cuda.bindings.driver``: ``CUlaunchConfig``,
``CUlaunchAttribute``, ``cuLaunchKernelEx``), NVIDIA's own binding of ``cuda.h``, rather than
ctypes copies of its structures. ``tests/test_dependent_launch.py`` runs it against a stand-in
``libcuda.so.1`` built from the toolkit's ``cuda.h`` (found first on the library path, as
cuda-bindings loads the driver by that name) and checks what arrives. Kernel arguments are the
binding's typed NumPy scalars, passed by address as the driver asks. The binding is imported at
the first dependent launch only: ``import metrale_attn`` and the CPU backend never need it.
"""

from __future__ import annotations

import importlib
from typing import Optional

import numpy as np

MIN_COMPUTE_CAPABILITY = (9, 0)
"""Devices that have programmatic dependent launch (``griddepcontrol`` is sm_90 PTX)."""


def supported(compute_capability: tuple[int, int]) -> bool:
    """Whether a device of ``compute_capability`` launches dependents (else a plain launch)."""
    return tuple(compute_capability) >= MIN_COMPUTE_CAPABILITY


class Driver:
    """``cuLaunchKernelEx`` of the CUDA driver, through cuda-bindings; the CuPy backend makes one
    per process, at the first dependent launch."""

    def __init__(self):
        try:
            self._cuda = importlib.import_module("cuda.bindings.driver")
        except ImportError as err:
            raise ImportError(f"programmatic dependent launch calls the CUDA driver through cuda-bindings, which "
                              f"is not installed ({err}): pip install 'metrale-attn[cuda12]' (or [cuda13])") from err
        # the one attribute every launch passes: built once, read by the driver at each call
        attribute = self._cuda.CUlaunchAttribute()
        attribute.id = self._cuda.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        self._attributes = [attribute]

    def launch(self, function: int, grid, block, shared_bytes: int, stream: Optional[int], args: tuple,
               kernel: str = "kernel") -> None:
        """Launch ``function`` (a ``CUfunction`` handle) as the programmatic dependent of the
        launch before it on ``stream`` (a ``CUstream`` handle; 0 or None: the legacy default
        stream). ``args``: the kernel's parameters in order, each a NumPy scalar of the
        parameter's C type. Raises ``RuntimeError`` naming ``kernel`` and the driver's error."""
        for a in args:
            if not isinstance(a, np.generic):
                raise TypeError(f"{kernel}: kernel arguments must be NumPy scalars of the parameter's type, "
                                f"got {type(a).__name__}")
        cuda = self._cuda
        cells = [np.array(a) for a in args]  # each parameter's bytes, kept alive until the call returns
        params = np.array([c.ctypes.data for c in cells] or [0], dtype=np.uintp)  # the void*[] the driver reads
        config = cuda.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = block
        config.sharedMemBytes = shared_bytes
        config.hStream = cuda.CUstream(stream or 0)
        config.attrs = self._attributes
        config.numAttrs = len(self._attributes)
        (status,) = cuda.cuLaunchKernelEx(config, cuda.CUfunction(function), params.ctypes.data, 0)
        if status != cuda.CUresult.CUDA_SUCCESS:
            _, name = cuda.cuGetErrorName(status)
            raise RuntimeError(f"{kernel}: cuLaunchKernelEx (programmatic dependent launch) failed: "
                               f"{(name or b'?').decode()} ({int(status)})")
