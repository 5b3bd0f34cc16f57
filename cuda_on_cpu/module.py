"""``Module``: one compiled kernel variant, and its launches with CUDA semantics.

In-process launches install a SIGSEGV/SIGBUS handler for the duration of the launch
that prints the kernel, block and thread (and "fiber stack overflow" when a fiber ran
into the guard page under its stack) to stderr and then lets the fault take its normal
course (Python's faulthandler traceback, or death by the signal): loud, never silent.
``launch(..., isolate=True)`` runs the launch in a child process instead
(``isolation``) and turns a crash into a CudaOnCpuError carrying the child's stderr;
ASan modules always launch that way.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from .abi import Param, dim3, launch_raw, prepare_args
from .environment import parse_order, stack_bytes
from .errors import CudaOnCpuError
from .isolation import launch_in_child

MAX_SHARED_BYTES = 227 * 1024


class Module:
    """A compiled kernel variant. ``kernels``: names of its extern "C" __global__ kernels."""

    def __init__(self, name: str, path: Path, meta: dict, *, asan: bool):
        self.name = name
        self.path = Path(path)
        self.asan = asan
        self._index = {k["name"]: i for i, k in enumerate(meta["kernels"])}
        self._params = {k["name"]: tuple(Param(**p) for p in k["params"]) for k in meta["kernels"]}
        self.kernels: tuple[str, ...] = tuple(self._index)
        # ASan libraries need libasan loaded first: they are only ever loaded in a child.
        self._lib = None if asan else ctypes.CDLL(str(self.path))

    def __repr__(self) -> str:
        return f"<cuda_on_cpu.Module {self.name} kernels={list(self.kernels)}{' asan' if self.asan else ''}>"

    def params(self, kernel: str) -> tuple[Param, ...]:
        """The parameters of ``kernel`` as the compiler sees them."""
        self._check_kernel(kernel)
        return self._params[kernel]

    def _check_kernel(self, kernel: str) -> None:
        if kernel not in self._index:
            raise CudaOnCpuError(f"module {self.name} has no kernel {kernel!r} (has: {', '.join(self.kernels)})")

    def launch(self, kernel: str, grid, block, shared_bytes: int, args, *,
               order: str | None = None, isolate: bool = False, max_shared_bytes: int = MAX_SHARED_BYTES) -> None:
        """Run ``kernel<<<grid, block, shared_bytes>>>(*args)`` with CUDA semantics.

        args: per pointer parameter a C-contiguous NumPy array (its data pointer is passed;
        the dtype is not checked, only writability for non-const pointees and alignment to
        the pointee type) or None (null); per scalar parameter a NumPy scalar of exactly the
        parameter's kind and size (numpy.int32 for int, numpy.uint32 for unsigned,
        numpy.int64 for long long, numpy.float32 for float, ...). ``order``: see
        parse_order. ``isolate``: run in a child process (arrays are shipped there and
        copied back), so a crash becomes a CudaOnCpuError; always the case with asan.
        ``max_shared_bytes``: the dynamic shared memory per block of the device emulated
        (227 KiB on sm_90 and sm_100, the most; 99 KiB on sm_86, sm_89, sm_120 and sm_121); a
        launch past it is refused, as that device would refuse it.
        """
        self._check_kernel(kernel)
        grid, block = dim3(grid, "grid"), dim3(block, "block")
        if isinstance(shared_bytes, bool) or not isinstance(shared_bytes, (int, np.integer)) or shared_bytes < 0:
            raise CudaOnCpuError(f"kernel '{kernel}': shared_bytes must be a non-negative int")
        shared_bytes = int(shared_bytes)
        limit = min(int(max_shared_bytes), MAX_SHARED_BYTES)
        if shared_bytes > limit:
            raise CudaOnCpuError(f"kernel '{kernel}': {shared_bytes} bytes of dynamic shared memory exceed the "
                                 f"{limit // 1024} KiB per block ({limit} bytes) of the device emulated")
        policy, seed = parse_order(order)
        values = prepare_args(kernel, self._params[kernel], args)
        stack = stack_bytes(self.asan)
        if self.asan or isolate:
            launch_in_child(self.path, self.asan, kernel, self._index[kernel], grid, block, shared_bytes, values,
                            policy, seed, stack)
            return
        raw = [v.ctypes.data if isinstance(v, np.ndarray) else v for v in values]
        launch_raw(self._lib, self._index[kernel], grid, block, shared_bytes, raw, policy, seed, stack)
