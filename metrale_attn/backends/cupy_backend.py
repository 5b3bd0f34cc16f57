"""The CuPy backend: kernels compiled by NVRTC, loaded and launched through CuPy.

``nvrtc_program`` is the single definition of what NVRTC sees and ``nvrtc_compile``
the single way it is compiled, for the device's exact ``sm_XY``: CI runs the same
function without a GPU for sm_90, sm_100 and sm_120, so the binary a GPU loads is
one CI has compiled and inspected. (Handing the source to ``cupy.RawModule`` instead
would let CuPy append ``-ftz=true``, which flushes the fp32 denormals the fp16/fp8
fast path relies on: a build neither CI nor the CPU backend ever runs.) NVRTC is
called through cuda-bindings (``backends.nvrtc``: CuPy's ``getCUBIN`` drops the cubin's
last byte), and cubins are cached on disk by a hash of source, options, architecture and NVRTC version
with their size and SHA-256 beside them (a damaged entry is rebuilt, an unwritable
cache directory gives way to a private temporary one, a missing one is compiled once
under its inter-process lock however many processes miss it at once, and a cache whose
cubins for this architecture another NVRTC version built is warned about once,
``cubin.warn_other_nvrtc``), loaded with
``cupy.RawModule(path=...)`` and memoized per ``(device, spec)``.

Launches go to the stream ``launch_stream`` picks: the one the caller names, else
PyTorch's current stream when the inputs are torch tensors (so a decode step joins
the caller's stream and its CUDA-graph capture), else CuPy's current stream.
``current_stream`` and ``stream_busy`` let ``DecodeAttention`` notice a second
stream reusing a workspace while the first is still busy (one driver query, only
when the stream changes, never during a capture).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import threading
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..cache import cache_root
from ..kernels import KernelSpec
from . import ArrayInfo, DeviceInfo, Launch, cubin, dependent_launch, nvrtc, refuse_unstrided

logger = logging.getLogger(__name__)

DIALECT_PRELUDE = "#define DYNAMIC_SHARED(T, name) extern __shared__ __align__(16) T name[]\n"
"""How the shared dialect's dynamic shared memory reads on the GPU."""

BASE_OPTIONS = ("-std=c++17", "-ftz=false")
"""NVRTC's default, spelled out: the exact conversions and the simt fp16/fp8 fast path need fp32
denormals (pd_common.cuh, simt/simt_core.cuh)."""


def nvrtc_program(spec: KernelSpec, text: str | None = None) -> tuple[str, tuple[str, ...]]:
    """``(source, options)`` NVRTC compiles for ``spec``; no ``-arch`` (the caller adds it)."""
    options = BASE_OPTIONS + tuple(f"-D{k}={v}" for k, v in sorted(spec.defines().items()))
    return DIALECT_PRELUDE + spec.source(text), options


def nvrtc_compile(spec: KernelSpec, arch: str, *, ptxas_verbose: bool = False, with_ptx: bool = False):
    """Compile ``spec`` with NVRTC, no GPU needed: ``arch="sm_90"`` gives a cubin,
    ``"compute_90"`` PTX. Returns ``(binary, log)``; with ``ptxas_verbose`` the log
    holds ptxas's registers, stack frame and spills per kernel; with ``with_ptx``,
    ``(binary, log, ptx)`` (the PTX the cubin was assembled from, from the same compile)."""
    source, options = nvrtc_program(spec)
    return nvrtc_compile_source(source, spec.name, arch, options, ptxas_verbose=ptxas_verbose, with_ptx=with_ptx)


def nvrtc_compile_source(source: str, name: str, arch: str, options: tuple[str, ...] = BASE_OPTIONS, *,
                         ptxas_verbose: bool = False, with_ptx: bool = False):
    """``nvrtc_compile`` for a complete source (headers inlined) that is not a spec: the toy
    kernels of the tests. ``options`` exclude ``-arch``; the dialect prelude is the caller's."""
    options = (*options, f"--gpu-architecture={arch}") + (("--ptxas-options=-v",) if ptxas_verbose else ())
    try:
        built = nvrtc.compile_program(source, f"{name}.cu", options, cubin=not arch.startswith("compute_"))
    except nvrtc.NvrtcCompileError as err:
        raise RuntimeError(f"NVRTC failed on {name} for {arch}:\n{err.log}") from err
    if built.cubin is None:
        binary = built.ptx
    else:
        binary = built.cubin
        cubin.check_cubin(binary)  # whole: its ELF tables, sections and segments lie inside it
    return (binary, built.log, built.ptx) if with_ptx else (binary, built.log)


def compile_cubin(spec: KernelSpec, arch: str) -> bytes:
    """Compile ``spec`` for ``arch`` (``"sm_90"``) with NVRTC, no GPU needed."""
    return nvrtc_compile(spec, arch)[0]


def cubin_entry(spec: KernelSpec, arch: str, root: Path | None = None) -> Path:
    """Where the cubin of ``spec`` for ``arch`` is cached: ``<root>/cubin/<name>_<arch>_<key>.cubin``,
    ``key`` a hash of the source, the options, the architecture and the NVRTC version (so
    another NVRTC misses); ``root`` defaults to ``cache.cache_root()``. Needs NVRTC, not a GPU."""
    source, options = nvrtc_program(spec)
    key = hashlib.sha256(repr((source, options, arch, nvrtc.version())).encode()).hexdigest()[:20]
    return (cache_root() if root is None else Path(root)) / "cubin" / f"{spec.name}_{arch}_{key}.cubin"


class CubinLookup(NamedTuple):
    """Where a cubin was found or put, and the seconds NVRTC took (None: a cache hit)."""

    path: Path
    compile_s: float | None


def cubin_lookup(spec: KernelSpec, arch: str, root: Path | None = None) -> CubinLookup:
    """The cached cubin of ``spec`` for ``arch`` (``cubin_entry``), compiled on a miss
    (no GPU needed) under the entry's inter-process lock.

    An entry whose size, SHA-256 or ELF tables do not check out is rebuilt, never
    loaded; where the cache directory cannot be written, the cubin goes to a private
    temporary directory (one warning per process)."""
    path = cubin_entry(spec, arch, root)
    built = []

    def build() -> bytes:
        start = time.perf_counter()
        data = compile_cubin(spec, arch)
        built.append(time.perf_counter() - start)
        return data

    built_by = {"arch": arch, "nvrtc": cubin.nvrtc_label(nvrtc.version())}
    found = cubin.cached_cubin(path, build, f"{spec.name} for {arch}", built_by)
    if built:
        logger.debug("compiled %s for %s with NVRTC in %.2f s (cache miss: %s)", spec.name, arch, built[0], found)
    else:
        logger.debug("loaded %s for %s from the cache (hit: %s)", spec.name, arch, found)
    return CubinLookup(found, built[0] if built else None)


def cubin_path(spec: KernelSpec, arch: str) -> str:
    """``cubin_lookup``'s path in the cache ``DecodeAttention`` uses (``cache.cache_root()``)."""
    return str(cubin_lookup(spec, arch).path)


class _StreamHandle:
    """A raw ``cudaStream_t`` dressed in the CUDA stream protocol, for ``Stream.from_external``."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged
_VERIFIED: dict[int, list[str]] = {}  # device ordinal -> what the known-answer test found
_MODULES: dict[tuple[int, str], _CupyModule] = {}
"""``(device ordinal, spec name)`` -> the loaded module. Per process, not per backend:
``get_backend`` makes a backend per ``DecodeAttention``, and every layer of a model would
otherwise load its own copy of the same cubin into the device's context. Bounded by
construction: devices x specs."""
MAX_EXTERNAL_STREAMS = 64
"""Raw stream handles one backend keeps a CuPy wrapper for (see ``launch_stream``)."""
_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


@functools.cache
def _driver() -> dependent_launch.Driver:
    """The CUDA driver's ``cuLaunchKernelEx``, loaded once per process, at the first dependent launch."""
    return dependent_launch.Driver()


def _launch_dependent(function, launch: Launch) -> None:
    """``launch`` of ``function`` (a CuPy ``Function``) as the programmatic dependent of the
    launch before it, on CuPy's current stream (inside ``launch_stream``: the launch stream)."""
    import cupy

    _driver().launch(function.ptr, launch.grid, launch.block, launch.shared_bytes,
                     cupy.cuda.get_current_stream().ptr, launch.args, launch.kernel)


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


class _CupyModule:
    """A spec's loaded kernels. ``launch_dependent(function, launch)`` (``_launch_dependent``, on
    devices that have programmatic dependent launch) launches a ``Launch.dependent`` one; without
    it every launch is CuPy's own."""

    def __init__(self, functions: dict, launch_dependent=None):
        self._functions = functions
        self._launch_dependent = launch_dependent

    def launch(self, launch: Launch) -> None:
        function = self._functions[launch.kernel]
        if launch.dependent and self._launch_dependent is not None:
            self._launch_dependent(function, launch)
        else:
            function(launch.grid, launch.block, launch.args, shared_mem=launch.shared_bytes)


class CupyBackend:
    name = "cupy"
    always_check_indices = False  # checking needs a synchronizing host copy; opt in
    emulated = False

    def __init__(self) -> None:
        import cupy

        self._cupy = cupy
        # Raw stream handle -> its CuPy wrapper. The same handle must give the same wrapper
        # object, because DecodeAttention notices a stream change by identity (one
        # comparison per call). Bounded, oldest first out, because handles are the
        # caller's: a loop that makes a stream per step would otherwise grow this forever.
        # A handle evicted and seen again costs one ptr comparison in stream_busy.
        self._external_streams: dict[int, object] = {}
        self._external_lock = threading.Lock()  # misses only: eviction from several threads

    def device(self) -> DeviceInfo:
        """The current device."""
        cupy = self._cupy
        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return DeviceInfo(dev.id, (props["major"], props["minor"]), props["multiProcessorCount"], name)

    def load_many(self, specs) -> list:
        """One after another, on the caller's thread: a module loads into the current
        device's context, which another thread would not share."""
        return [self.load(v) for v in specs]

    def uncached(self, specs) -> list:
        """The specs among ``specs`` that ``load`` would compile with NVRTC: neither loaded in
        this process nor whole in the cubin cache."""
        device = self.device()
        arch = "sm_{}{}".format(*device.compute_capability)
        return [v for v in specs
                if (device.ordinal, v.name) not in _MODULES and not cubin.is_cached(cubin_entry(v, arch))]

    def load(self, spec: KernelSpec) -> _CupyModule:
        device = self.device()
        key = (device.ordinal, spec.name)
        module = _MODULES.get(key)
        if module is None:
            arch = "sm_{}{}".format(*device.compute_capability)
            cubin.warn_other_nvrtc(cache_root() / "cubin", arch, nvrtc.version())  # once per cache and arch
            raw = self._cupy.RawModule(path=cubin_path(spec, arch))
            functions = {k: raw.get_function(k) for k in spec.kernels}
            if spec.shared_bytes:  # past 48 KiB a kernel must opt in to its dynamic shared memory
                functions[spec.kernels[0]].max_dynamic_shared_size_bytes = spec.shared_bytes
            dependent = _launch_dependent if dependent_launch.supported(device.compute_capability) else None
            module = _CupyModule(functions, dependent)
            _MODULES[key] = module
        return module

    def describe(self, array, argument: str) -> ArrayInfo:
        cupy = self._cupy
        if isinstance(array, cupy.ndarray):
            item = array.dtype.itemsize
            return ArrayInfo(array.data.ptr, array.shape, tuple(s // item for s in array.strides), array.dtype,
                             item, array.device.id)
        if _is_torch(array) and hasattr(array, "data_ptr"):
            if not array.is_cuda:
                raise ValueError(f"{argument} must be on a CUDA device, got a tensor on {array.device}")
            refuse_unstrided(array, argument)
            return ArrayInfo(array.data_ptr(), tuple(array.shape), tuple(array.stride()), array.dtype,
                             array.element_size(), array.device.index)
        cai = getattr(array, "__cuda_array_interface__", None)
        if cai is None and hasattr(array, "__dlpack__") and array.__dlpack_device__()[0] in _DLPACK_CUDA:
            return self.describe(cupy.from_dlpack(array), argument)  # zero-copy view
        if cai is None:
            raise TypeError(
                f"{argument} must be a CUDA array: a CuPy array, a torch CUDA tensor, or an object exposing "
                f"__cuda_array_interface__ or a CUDA __dlpack__; got {type(array).__name__}"
            )
        dtype = np.dtype(cai["typestr"])
        shape = tuple(cai["shape"])
        if cai.get("strides") is None:
            strides, acc = [], 1
            for n in reversed(shape):
                strides.append(acc)
                acc *= n
            strides = tuple(reversed(strides))
        else:
            strides = tuple(s // dtype.itemsize for s in cai["strides"])
        ptr, read_only = cai["data"]
        return ArrayInfo(ptr, shape, strides, dtype, dtype.itemsize, cupy.cuda.runtime.pointerGetAttributes(ptr).device,
                         not read_only)

    def fingerprint(self, array):
        """``describe``'s identity of a CuPy array or torch tensor, read without describing
        it (a CuPy array's memory pointer is fixed for its life, a tensor's is read)."""
        if type(array) is self._cupy.ndarray:
            return id(array), array.shape, array.strides, array.dtype
        if _is_torch(array):
            try:
                return array.data_ptr(), array.shape, array.stride(), array.dtype, array.device
            except RuntimeError:  # no strided storage (sparse, mkldnn): describe names the argument
                return None
        return None

    def moved(self, info: ArrayInfo, array) -> ArrayInfo:
        ptr = array.data.ptr if type(array) is self._cupy.ndarray else array.data_ptr()
        return ArrayInfo(ptr, info.shape, info.strides, info.dtype, info.itemsize, info.device, info.writable)

    def empty(self, shape, dtype, like=None):
        if like is not None and _is_torch(like):
            import torch

            return torch.empty(shape, dtype=getattr(torch, _TORCH_DTYPES[np.dtype(dtype).name]), device=like.device)
        return self._cupy.empty(shape, dtype=dtype)

    def pointer(self, array, info: ArrayInfo | None = None):
        if array is None:
            return np.uint64(0)
        return np.uint64((info or self.describe(array, "array")).ptr)

    def launch_stream(self, stream, like=None):
        """A context manager making the launch stream current.

        ``stream`` is a CuPy stream, a torch stream (``.cuda_stream``) or a raw
        ``cudaStream_t`` int; ``None`` means torch's current stream when ``like`` is a
        torch tensor, else CuPy's current stream (nothing to enter).
        """
        if stream is None and _is_torch(like):
            import torch

            stream = torch.cuda.current_stream(like.device)
        if stream is None:
            return contextlib.nullcontext()
        if isinstance(stream, self._cupy.cuda.stream._BaseStream):
            return stream
        handle = getattr(stream, "cuda_stream", stream)  # torch streams carry their handle
        if isinstance(handle, bool) or not isinstance(handle, int):
            raise TypeError(f"stream must be a CuPy stream, a torch CUDA stream or a cudaStream_t int, got {stream!r}")
        external = self._external_streams.get(handle)
        if external is None:
            with self._external_lock:
                external = self._external_streams.get(handle)
                if external is None:
                    external = self._cupy.cuda.Stream.from_external(_StreamHandle(handle))
                    if len(self._external_streams) >= MAX_EXTERNAL_STREAMS:
                        del self._external_streams[next(iter(self._external_streams))]
                    self._external_streams[handle] = external
        return external

    def current_stream(self):
        """CuPy's current stream object (inside ``launch_stream``: the launch stream)."""
        return self._cupy.cuda.get_current_stream()

    def stream_busy(self, previous, current) -> bool:
        """Whether ``previous`` still has work queued (``cudaStreamQuery``), asked only
        when neither stream is capturing: a capture runs nothing now, and querying a
        capturing stream would invalidate its capture."""
        if previous.ptr == current.ptr:
            return False
        try:
            if current.is_capturing() or previous.is_capturing():
                return False
            return not previous.done
        except self._cupy.cuda.runtime.CUDARuntimeError:
            return False

    def current_device(self) -> int:
        return self._cupy.cuda.Device().id

    def upload(self, array):
        return self._cupy.asarray(array)

    def verify_mma(self) -> list[str]:
        """Run the known-answer test (backends/selftest.py) once per device."""
        device = self.current_device()
        if device not in _VERIFIED:
            from . import selftest

            _VERIFIED[device] = selftest.run(self)
        return _VERIFIED[device]

    def host_copy(self, array):
        if _is_torch(array):
            return array.detach().cpu().numpy()
        return self._cupy.asnumpy(self._cupy.asarray(array))

    def synchronize(self) -> None:
        self._cupy.cuda.get_current_stream().synchronize()
