"""The Python side of the runtime's C ABI: the kernel table read back from a built library,
and the marshalling of launch arguments into the one call, ``cocpu_launch``.

``read_descs`` turns a library's registration table into plain data (kept in the
cache record beside the library); ``Param`` is one parameter as the compiler typed it.
``prepare_args`` checks a launch's arguments against those parameters, naming the
parameter on any mismatch, and ``launch_raw`` makes the call. The child process of an
isolated launch uses the same two functions.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading

import numpy as np

from .errors import CudaOnCpuError

ABI_VERSION = 1

# Parameter kinds, as cocpu_param_kind in the header.
POINTER, SIGNED, UNSIGNED, FLOAT, BOOL, OTHER = range(6)
_NUMPY_KIND = {SIGNED: "i", UNSIGNED: "u", FLOAT: "f", BOOL: "b"}

_LAUNCH_LOCK = threading.Lock()  # the runtime's launch state is per library, not reentrant
_stacks_held_by = None
"""The library that launched last, which keeps its fiber stacks for its next launch. Every
library has its own pool, two memory mappings a stack; a process of hundreds of libraries of
256-thread blocks would reach vm.max_map_count (65530) if each kept its pool, after which
creating a thread fails. So a library's launch first releases the previous holder's stacks:
one pool is mapped at a time. Guarded by ``_LAUNCH_LOCK``."""


@dataclasses.dataclass(frozen=True)
class Param:
    """One kernel parameter: its name and C type as written, and what the compiler says
    about the type (kind: POINTER/SIGNED/UNSIGNED/FLOAT/BOOL/OTHER, sizes in bytes)."""

    name: str
    ctype: str
    kind: int
    size: int
    align: int
    pointee_size: int = 0
    pointee_align: int = 0
    pointee_const: bool = False


def read_descs(lib: ctypes.CDLL) -> dict:
    """Kernel metadata from a loaded library's registration table."""

    class ParamDesc(ctypes.Structure):
        _fields_ = [(n, ctypes.c_int) for n in
                    ("kind", "size", "align", "pointee_size", "pointee_align", "pointee_const")]

    class KernelDesc(ctypes.Structure):
        _fields_ = [("name", ctypes.c_char_p), ("param_names", ctypes.c_char_p),
                    ("param_types", ctypes.c_char_p), ("nparams", ctypes.c_int),
                    ("params", ctypes.POINTER(ParamDesc)), ("fn", ctypes.c_void_p),
                    ("invoke", ctypes.c_void_p), ("max_threads", ctypes.c_int)]

    if lib.cocpu_abi_version() != ABI_VERSION:
        raise CudaOnCpuError("CUDA-on-CPU library built for another runtime ABI")
    n = ctypes.c_int.in_dll(lib, "cocpu_num_kernels").value
    table = (KernelDesc * max(n, 1)).in_dll(lib, "cocpu_kernels")
    kernels = []
    for i in range(n):
        d = table[i]
        names = d.param_names.decode().split(",") if d.nparams else []
        types = d.param_types.decode().split("|") if d.nparams else []
        if len(names) != d.nparams:  # the textual parse and the compiler disagree
            names = [f"arg{j}" for j in range(d.nparams)]
            types = ["?"] * d.nparams
        params = []
        for j in range(d.nparams):
            p = d.params[j]
            params.append(dict(name=names[j], ctype=types[j], kind=p.kind, size=p.size, align=p.align,
                               pointee_size=p.pointee_size, pointee_align=p.pointee_align,
                               pointee_const=bool(p.pointee_const)))
        kernels.append(dict(name=d.name.decode(), max_threads=d.max_threads, params=params))
    lib.cocpu_static_shared_bytes.restype = ctypes.c_ulonglong
    return {"abi": ABI_VERSION, "kernels": kernels,
            "static_shared_bytes": int(lib.cocpu_static_shared_bytes())}


MAX_GRID = (0x7FFFFFFF, 65535, 65535)
MAX_BLOCK = (1024, 1024, 64)
MAX_THREADS_PER_BLOCK = 1024
"""CUDA's launch limits (every compute capability from sm_50): what a GPU refuses, refused here too."""


def dim3(value, what: str) -> tuple[int, int, int]:
    """A grid or block as three ints within CUDA's limits (``what``: "grid" or "block")."""
    t = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not 1 <= len(t) <= 3 or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in t):
        raise CudaOnCpuError(f"{what} must be a tuple of up to three ints, got {value!r}")
    t = tuple(int(v) for v in t) + (1,) * (3 - len(t))
    limits = MAX_BLOCK if what == "block" else MAX_GRID
    if min(t) < 1 or any(n > limit for n, limit in zip(t, limits)):
        raise CudaOnCpuError(f"invalid {what} {t}: out of range, CUDA allows 1..{limits} per dimension")
    if what == "block" and t[0] * t[1] * t[2] > MAX_THREADS_PER_BLOCK:
        raise CudaOnCpuError(f"invalid block {t}: {t[0] * t[1] * t[2]} threads, CUDA allows at most "
                             f"{MAX_THREADS_PER_BLOCK} per block")
    return t


def _numpy_name(kind: int, size: int) -> str:
    if kind == BOOL:
        return "numpy.bool_"
    prefix = {SIGNED: "int", UNSIGNED: "uint", FLOAT: "float"}[kind]
    return f"numpy.{prefix}{size * 8}"


def prepare_args(kernel: str, params: tuple[Param, ...], args) -> list:
    """Checks args against the parameters. Returns per parameter either an ndarray, None
    (null pointer) or the scalar's bytes. Raises CudaOnCpuError naming the parameter."""
    if not isinstance(args, (tuple, list)):
        raise CudaOnCpuError(f"kernel '{kernel}': args must be a tuple, got {type(args).__name__}")
    if len(args) != len(params):
        raise CudaOnCpuError(
            f"kernel '{kernel}' takes {len(params)} arguments "
            f"({', '.join(p.name for p in params)}), got {len(args)}")
    out = []
    for i, (p, a) in enumerate(zip(params, args)):
        where = f"kernel '{kernel}' parameter {i} '{p.name}' ({p.ctype})"
        if p.kind == POINTER:
            if a is None:
                out.append(None)
                continue
            if not isinstance(a, np.ndarray):
                raise CudaOnCpuError(f"{where} expects a NumPy array or None, got {type(a).__name__}")
            if not a.flags.c_contiguous:
                raise CudaOnCpuError(f"{where}: the array must be C-contiguous")
            if not p.pointee_const and not a.flags.writeable:
                raise CudaOnCpuError(f"{where}: read-only array for a pointer to non-const")
            if p.pointee_align > 1 and a.size and a.ctypes.data % p.pointee_align:
                raise CudaOnCpuError(f"{where}: array data is not {p.pointee_align}-byte aligned")
            out.append(a)
        elif p.kind in _NUMPY_KIND:
            want = _numpy_name(p.kind, p.size)
            if isinstance(a, np.ndarray):
                raise CudaOnCpuError(f"{where} expects a scalar ({want}), got an array")
            if not isinstance(a, np.generic):
                raise CudaOnCpuError(f"{where} expects {want}, got Python {type(a).__name__} "
                                     "(pass a typed NumPy scalar)")
            if a.dtype.kind != _NUMPY_KIND[p.kind] or a.dtype.itemsize != p.size:
                raise CudaOnCpuError(f"{where} expects {want}, got numpy.{a.dtype.name}")
            out.append(a.tobytes())
        else:
            raise CudaOnCpuError(f"{where}: parameter type not supported by the CPU backend")
    return out


def launch_raw(lib, kernel_index: int, grid, block, shared_bytes: int, values: list,
               policy: int, seed: int, stack_bytes: int) -> None:
    """Calls cocpu_launch. values: per parameter an int address / None (pointers) or
    bytes (scalars). Raises CudaOnCpuError with the runtime's message."""
    keep = []
    argv = (ctypes.c_void_p * max(len(values), 1))()
    for i, v in enumerate(values):
        buf = ctypes.create_string_buffer(v, len(v)) if isinstance(v, bytes) else ctypes.c_void_p(v)
        keep.append(buf)
        argv[i] = ctypes.addressof(buf)
    err = ctypes.create_string_buffer(4096)
    g = (ctypes.c_uint * 3)(*grid)
    b = (ctypes.c_uint * 3)(*block)
    fn = lib.cocpu_launch
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_void_p,
                   ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_char_p, ctypes.c_int]
    global _stacks_held_by
    with _LAUNCH_LOCK:
        if _stacks_held_by is not None and _stacks_held_by is not lib:
            release = _stacks_held_by.cocpu_release_stacks
            release.restype, release.argtypes = None, []
            release()
        _stacks_held_by = lib
        rc = fn(kernel_index, g, b, shared_bytes, argv, policy, seed, stack_bytes, err, len(err))
    if rc != 0:
        raise CudaOnCpuError(err.value.decode(errors="replace"))
