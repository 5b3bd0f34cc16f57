"""The CPU backend: the same kernel sources run by the CUDA-on-CPU shim, on NumPy arrays
and PyTorch CPU tensors.

A testing and demo backend, not a fast one. Torch CPU tensors are taken by their data
pointer (never copied): the shim is handed a NumPy byte view of the memory a tensor
spans, so bf16 and fp8 tensors (which NumPy cannot hold) work as they would on a GPU. ``order`` picks the shim's thread
order (``"default"``, ``"shuffle:SEED"``, ``"warp-ahead:SEED"``, ...; ``None``
reads ``METRALE_ATTN_CPU_ORDER``) and ``asan`` builds and runs under
AddressSanitizer. The shim (the package ``cuda_on_cpu``, below this one) builds into
metrale-attn's cache (``cache.cache_root()/cuda_on_cpu``) and logs under this module's logger.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np

from ..cache import CACHE_DIR, cache_root
from ..kernels import SMEM_LIMIT_BYTES, KernelSpec
from . import ArrayInfo, Launch, refuse_unstrided

logger = logging.getLogger(__name__)


class _CpuModule:
    """A spec's module; a launch past the shared memory per block of the target the spec was
    built for (``KernelSpec.smem_limit``) is refused, as that GPU would refuse it."""

    def __init__(self, module, order: Optional[str], max_shared_bytes: int):
        self._module = module
        self._order = order
        self._max_shared = max_shared_bytes

    def launch(self, launch: Launch) -> None:
        self._module.launch(launch.kernel, launch.grid, launch.block, launch.shared_bytes, launch.args,
                            order=self._order, max_shared_bytes=self._max_shared)


class CpuBackend:
    name = "cpu"
    always_check_indices = True  # host memory: proving indices in range costs no copy
    emulated = True  # the CUDA-on-CPU shim: times are the emulator's

    def __init__(self, *, order: Optional[str] = None, asan: bool = False) -> None:
        self.order = order
        self.asan = asan

    def load_many(self, specs) -> list:
        """The modules of ``specs``, in order, built concurrently (one host compiler per
        core): a first construction builds several specs, each a compiler run."""
        specs = list(specs)
        workers = min(len(specs), os.cpu_count() or 1)
        if workers < 2:
            return [self.load(v) for v in specs]
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="metrale-attn-build") as pool:
            return list(pool.map(self.load, specs))

    def uncached(self, specs) -> list:
        """The specs among ``specs`` whose libraries ``load`` would build (neither this process
        nor the cache has them), so that a construction can say a cold compile is starting."""
        from cuda_on_cpu.build import is_cached

        return [v for v in specs if not is_cached(v.source(), name=v.name, defines=v.defines(), asan=self.asan,
                                                  cache_dir=cache_root() / "cuda_on_cpu")]

    def load(self, spec: KernelSpec) -> _CpuModule:
        from cuda_on_cpu import compile_module  # not at import: ``import metrale_attn`` stays light

        module = compile_module(spec.source(), name=spec.name, defines=spec.defines(), asan=self.asan,
                                cache_dir=cache_root() / "cuda_on_cpu", cache_setting=CACHE_DIR, logger=logger)
        return _CpuModule(module, self.order, getattr(spec, "smem_limit", SMEM_LIMIT_BYTES))

    def describe(self, array, argument: str) -> ArrayInfo:
        if isinstance(array, np.ndarray):
            item = array.dtype.itemsize
            return ArrayInfo(array.__array_interface__["data"][0], array.shape,
                             tuple([s // item for s in array.strides]), array.dtype, item, None,
                             array.flags.writeable)
        if _is_torch(array):
            if array.device.type != "cpu":
                raise ValueError(f"{argument} must be a CPU tensor on the cpu backend, got a tensor on {array.device}")
            refuse_unstrided(array, argument)
            return ArrayInfo(array.data_ptr(), tuple(array.shape), tuple(array.stride()), array.dtype,
                             array.element_size(), None)
        raise TypeError(f"{argument} must be a NumPy array or a torch CPU tensor on the cpu backend, got "
                        f"{type(array).__name__}")

    def fingerprint(self, array):
        """What identifies ``describe(array)`` without describing it (see ``Backend.fingerprint``).

        A NumPy array's data pointer never changes while the object lives (its shape,
        strides, dtype and writeable flag can), so the object's ``id`` stands for the
        pointer; the caller keeps the array alive while it keeps the fingerprint. A torch
        tensor's storage can be swapped in place (``set_``, ``.data =``): its data
        pointer is read."""
        if type(array) is np.ndarray:
            return id(array), array.shape, array.strides, array.dtype, array.flags.writeable
        if _is_torch(array):
            try:
                return array.data_ptr(), array.shape, array.stride(), array.dtype, array.device
            except RuntimeError:  # no strided storage (sparse, mkldnn): describe names the argument
                return None
        return None

    def moved(self, info: ArrayInfo, array) -> ArrayInfo:
        ptr = array.__array_interface__["data"][0] if type(array) is np.ndarray else array.data_ptr()
        return ArrayInfo(ptr, info.shape, info.strides, info.dtype, info.itemsize, info.device, info.writable)

    def empty(self, shape, dtype, like=None):
        if like is not None and _is_torch(like):
            import torch

            return torch.empty(shape, dtype=_torch_dtype(torch, np.dtype(dtype)))
        return np.empty(shape, dtype=dtype)

    def pointer(self, array, info: Optional[ArrayInfo] = None):
        if array is None:
            return None
        if isinstance(array, np.ndarray):
            return _contiguous_alias(array)
        return _bytes_at(info or self.describe(array, "array"))

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
        """The array itself (a NumPy view of a torch tensor's memory): host memory needs no copy."""
        if _is_torch(array):
            return array.detach().numpy()
        return np.asarray(array)

    def synchronize(self) -> None:
        pass


_TORCH_TYPES: set = set()  # tensor classes seen (torch.Tensor, Parameter, ...): one set lookup on the hot path


def _is_torch(x) -> bool:
    kind = type(x)
    if kind in _TORCH_TYPES:
        return True
    if kind.__module__.startswith("torch") and hasattr(x, "data_ptr"):
        _TORCH_TYPES.add(kind)
        return True
    return False


_TORCH_DTYPES = {"float32": "float32", "int32": "int32", "bfloat16": "bfloat16", "float16": "float16",
                 "float8_e4m3fn": "float8_e4m3fn", "uint8": "uint8"}


def _torch_dtype(torch, dtype: np.dtype):
    return getattr(torch, _TORCH_DTYPES[dtype.name])


def _bytes_at(info: ArrayInfo) -> np.ndarray:
    """A NumPy byte view of the memory an array spans, from its lowest element byte to
    one past its highest, by address: how the shim is handed a torch tensor, without a
    copy (and, like ``_contiguous_alias``, with the kernel's own address and strides).
    The view does not keep the tensor alive: the caller does, for the launch."""
    span = info.byte_range()
    if span is None:
        return np.empty(0, np.uint8)
    if span[0] != info.ptr:
        raise ValueError("arrays with negative strides are not supported")
    view = _VIEWS.get(span)
    if view is None:
        if len(_VIEWS) >= 1024:
            _VIEWS.clear()
        view = _VIEWS[span] = np.frombuffer((ctypes.c_char * (span[1] - span[0])).from_address(span[0]), np.uint8)
    return view


_VIEWS: dict = {}
"""Byte views by ``(first, end)`` address: an eager loop's allocator hands the same few
buffers out again and again. A view outlives the memory it names harmlessly: it is only
handed out again for a live tensor spanning exactly those bytes."""


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

