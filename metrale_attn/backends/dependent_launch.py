"""Programmatic dependent launch: one kernel launched through the CUDA driver's
``cuLaunchKernelEx`` with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` (CUDA 12.0
and later, devices of compute capability 9.0 and later), which CuPy's launch cannot ask for.

Such a kernel may start once every CTA of the kernel before it in the stream has released
its dependents (``pd_release_dependents``) or exited, instead of after that kernel's end:
its launch overlaps the other's tail. It must wait on the device (``pd_wait_prior_grids``)
before it reads what the other wrote; the merge kernels do, first thing.

The structures are ``cuda.h``'s, field for field (``tests/test_dependent_launch.py`` compiles
a stand-in driver against the toolkit's ``cuda.h`` and checks what arrives). Kernel
arguments are the binding's typed NumPy scalars, passed by address as the driver asks.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np

PROGRAMMATIC_STREAM_SERIALIZATION = 6
"""``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` (``cuda.h``'s ``CUlaunchAttributeID``)."""
MIN_COMPUTE_CAPABILITY = (9, 0)
"""Devices that have programmatic dependent launch (``griddepcontrol`` is sm_90 PTX)."""
DRIVER_LIBRARY = "libcuda.so.1"


class _AttributeValue(ctypes.Union):
    """``CUlaunchAttributeValue``: 64 bytes, 8-byte aligned (it holds pointers)."""

    _fields_ = [("pad", ctypes.c_char * 64), ("allowed", ctypes.c_int), ("align", ctypes.c_uint64)]


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: the id, padded to 8 bytes, then the value."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttributeValue)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``."""

    _fields_ = [
        ("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
        ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
        ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint),
    ]


def supported(compute_capability: tuple[int, int]) -> bool:
    """Whether a device of ``compute_capability`` launches dependents (else a plain launch)."""
    return tuple(compute_capability) >= MIN_COMPUTE_CAPABILITY


class Driver:
    """``cuLaunchKernelEx`` of the CUDA driver library (``path``: ``libcuda.so.1``, or a
    stand-in's path in the tests); the CuPy backend loads it once per process."""

    def __init__(self, path: str = DRIVER_LIBRARY):
        lib = ctypes.CDLL(path)
        self._launch = lib.cuLaunchKernelEx
        self._launch.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                 ctypes.c_void_p]
        self._launch.restype = ctypes.c_int
        self._error_name = lib.cuGetErrorName
        self._error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self._error_name.restype = ctypes.c_int
        # the one attribute every launch passes: built once, read by the driver at each call
        self._attribute = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
        self._attribute.value.allowed = 1

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
        cells = [np.array(a) for a in args]  # each parameter's bytes, kept alive until the call returns
        params = (ctypes.c_void_p * max(len(cells), 1))(*[c.ctypes.data for c in cells])
        config = LaunchConfig(*grid, *block, shared_bytes, stream or None, ctypes.pointer(self._attribute), 1)
        status = self._launch(ctypes.byref(config), function, params, None)
        if status != 0:
            name = ctypes.c_char_p()
            self._error_name(status, ctypes.byref(name))
            raise RuntimeError(f"{kernel}: cuLaunchKernelEx (programmatic dependent launch) failed: "
                               f"{(name.value or b'?').decode()} ({status})")
