"""Compile CUDA C kernel sources for the CPU and launch them.

``compile_module`` builds one shared library per kernel variant: the kernel source,
unchanged, prefixed with the shim header (``cuda_on_cpu.h``) and followed by a
registration table of its ``extern "C" __global__`` kernels, linked with the runtime
(``cuda_on_cpu_runtime.cpp`` and, on x86-64, the hand-written fiber switch). Libraries are
cached on disk, keyed by a hash of everything that goes into them, and memoized in-process.

A cached library is trusted only as far as its record proves: the ``.json`` beside each
``.so`` names the variant (module name and key) and the ``.so``'s size and SHA-256, and
both are checked before the library is loaded. A truncated or foreign ``.so`` (which
would crash dlopen's user with SIGBUS or SIGSEGV), an empty one, or a record that is
missing, not JSON or names another variant is a miss: the library is rebuilt and both
files replaced atomically. A cache directory this process cannot write falls back to a
private temporary directory (removed at exit), with one warning per process.

``Module.launch`` runs a kernel with CUDA semantics (see the header's top comment); every
launch error surfaces as :class:`CudaOnCpuError`.

Crash policy: in-process launches install a SIGSEGV/SIGBUS handler for the duration of
the launch that prints the kernel, block and thread (and "fiber stack overflow" when a
fiber ran into the guard page under its stack) to stderr and then lets the fault take its
normal course (Python's faulthandler traceback, or death by the signal): loud, never
silent. ``launch(..., isolate=True)`` runs the launch in a child process instead and turns
a crash into a CudaOnCpuError carrying the child's stderr; ASan modules always launch
that way.

Environment:
  METRALE_ATTN_CACHE_DIR       cache root (else $XDG_CACHE_HOME/metrale-attn, else
                               ~/.cache/metrale-attn); libraries go under cuda_on_cpu/
  CXX                          host compiler (default g++), may carry options
  METRALE_ATTN_CPU_ORDER       default thread-order policy for launch(order=None)
  METRALE_ATTN_CPU_FIBER       "asm" (default on x86-64) or "ucontext": the fiber switch
  METRALE_ATTN_CPU_STACK_KB    fiber stack size (default 256, ASan modules 1024)
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import functools
import hashlib
import json
import os
import pickle
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from contextlib import ExitStack
from importlib import resources
from pathlib import Path

import numpy as np

from ..cache import cache_root

__all__ = [
    "CudaOnCpuCompileError",
    "CudaOnCpuError",
    "Module",
    "Param",
    "compile_module",
    "compiler_calls",
    "parse_order",
]

# Bumped whenever the generated code or the cache layout changes meaning.
_FORMAT_VERSION = "cocpu-1"
_ABI_VERSION = 1

_HEADER = "cuda_on_cpu.h"
_RUNTIME = "cuda_on_cpu_runtime.cpp"
_SWITCH = "cuda_on_cpu_switch_x86_64.S"

MAX_SHARED_BYTES = 227 * 1024

# Parameter kinds, as cocpu_param_kind in the header.
POINTER, SIGNED, UNSIGNED, FLOAT, BOOL, OTHER = range(6)
_NUMPY_KIND = {SIGNED: "i", UNSIGNED: "u", FLOAT: "f", BOOL: "b"}

POLICIES = {"default": 0, "reverse": 1, "shuffle": 2, "warp-ahead": 3}

# Every compiler invocation of this process (argv lists): tests check cache reuse with it.
compiler_calls: list[list[str]] = []

_LAUNCH_LOCK = threading.Lock()  # the runtime's launch state is per library, not reentrant
_MEMO: dict[str, "Module"] = {}
_MEMO_LOCK = threading.Lock()
_CXX_VERSION: dict[tuple[str, ...], str] = {}


class CudaOnCpuError(RuntimeError):
    """A launch that CUDA would reject, or that misbehaved (barrier/warp-op misuse,
    argument mismatch, AddressSanitizer report, crash of an isolated launch)."""


class CudaOnCpuCompileError(CudaOnCpuError):
    """The host compiler rejected the source; the message is the compiler's output."""


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


# ---------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where compiled libraries live (created on demand)."""
    return cache_root() / "cuda_on_cpu"


_FALLBACK_DIRS: dict[Path, Path] = {}  # unwritable cache dir -> this process's private one
_FALLBACK_WARNED = False


class CacheFallbackWarning(RuntimeWarning):
    """The kernel cache directory cannot be written; this process builds into a temporary one."""


def _writable_cache_dir(configured: Path) -> Path:
    """``configured`` (created if need be) when this process can create files in it, else a
    private temporary directory for the rest of the process, with one warning per process.

    Asked by trying: permission bits say nothing for root or a read-only mount.
    """
    global _FALLBACK_WARNED
    fallback = _FALLBACK_DIRS.get(configured)
    if fallback is not None:
        return fallback
    try:
        configured.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=configured, prefix=".write-probe-")
        os.close(fd)
        os.unlink(probe)
        return configured
    except OSError as err:
        fallback = Path(tempfile.mkdtemp(prefix="metrale-attn-cuda_on_cpu-"))  # mode 0700
        atexit.register(shutil.rmtree, fallback, ignore_errors=True)
        _FALLBACK_DIRS[configured] = fallback
        if not _FALLBACK_WARNED:
            _FALLBACK_WARNED = True
            warnings.warn(f"cannot write the CUDA-on-CPU kernel cache {configured} ({err.strerror or err}); this "
                          f"process builds its kernels in {fallback} instead, removed at exit (point "
                          "METRALE_ATTN_CACHE_DIR at a writable directory to keep them)",
                          CacheFallbackWarning, stacklevel=4)
        return fallback


def _cxx() -> list[str]:
    return shlex.split(os.environ.get("CXX") or "g++")


def _fiber_impl() -> str:
    impl = os.environ.get("METRALE_ATTN_CPU_FIBER", "").strip() or "asm"
    if impl not in ("asm", "ucontext"):
        raise ValueError(f"METRALE_ATTN_CPU_FIBER must be 'asm' or 'ucontext', not {impl!r}")
    if platform.machine() not in ("x86_64", "AMD64"):
        impl = "ucontext"  # the hand-written switch is x86-64 only
    return impl


def _stack_bytes(asan: bool) -> int:
    kb = os.environ.get("METRALE_ATTN_CPU_STACK_KB", "").strip()
    if not kb:
        return (1024 if asan else 256) * 1024
    kib = int(kb) if re.fullmatch(r"[0-9]+", kb) else -1
    if kib < 16:
        raise ValueError(f"METRALE_ATTN_CPU_STACK_KB must be a whole number of KiB >= 16, got {kb!r}")
    return kib * 1024


def parse_order(order: str | None) -> tuple[int, int]:
    """Thread-order policy -> (policy number, seed). None reads METRALE_ATTN_CPU_ORDER.

    "default" (thread order), "reverse", "shuffle:SEED" (a seeded permutation of the
    runnable threads every round), "warp-ahead:SEED" (warps as units; a random subset
    runs alone through each whole phase before the others start it). The two seeded
    policies also permute the block order. Anything else is a ValueError.
    """
    if order is None:
        order = os.environ.get("METRALE_ATTN_CPU_ORDER", "").strip() or "default"
    if order in ("default", "reverse"):
        return POLICIES[order], 0
    m = re.fullmatch(r"(shuffle|warp-ahead):(\d+)", order)
    if not m:
        raise ValueError(
            f"unknown thread order {order!r}: expected 'default', 'reverse', 'shuffle:SEED' or 'warp-ahead:SEED'"
        )
    return POLICIES[m.group(1)], int(m.group(2)) % (1 << 64)


def _flags(asan: bool, fiber: str) -> list[str]:
    # -ffp-contract=off: no silent a*b+c -> fma (kernels write fmaf when they mean it);
    # no -ffast-math. -fno-strict-aliasing: kernels type-pun (uint4 loads of bf16 rows).
    # -fstack-clash-protection: big frames probe page by page, so they hit the guard.
    common = [
        "-std=c++17",
        "-fPIC",
        "-fvisibility=hidden",
        "-ffp-contract=off",
        "-fno-strict-aliasing",
        "-fno-exceptions",
        "-fstack-clash-protection",
    ]
    if asan:
        # -gdwarf-4: binutils addr2line (our fallback symbolizer) names the wrong file for
        # #line'd code in DWARF 5 line tables.
        common += ["-O1", "-g", "-gdwarf-4", "-fsanitize=address", "-fno-omit-frame-pointer"]
    else:
        common += ["-O2"]
    if fiber == "ucontext":
        common += ["-DCOCPU_UCONTEXT=1"]
    return common


def _define_flags(defines: dict | None) -> list[str]:
    out = []
    for key, value in (defines or {}).items():
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_]\w*(\([\w\s,]*\))?", key):
            raise ValueError(f"invalid macro name {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise TypeError(f"define {key}: value must be int or str, not {type(value).__name__}")
        out.append(f"-D{key}={value}")
    return out


def _compiler_version(cxx: list[str]) -> str:
    key = tuple(cxx)
    if key not in _CXX_VERSION:
        try:
            r = subprocess.run(cxx + ["--version"], capture_output=True, text=True, check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            raise CudaOnCpuCompileError(f"cannot run the host compiler {shlex.join(cxx)}: {e}") from e
        _CXX_VERSION[key] = r.stdout.strip()
    return _CXX_VERSION[key]


def _resource_text(fname: str) -> str:
    return resources.files(__package__).joinpath(fname).read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------
# Kernel discovery
# ---------------------------------------------------------------------------------------

_TYPE_WORDS = {
    "void", "bool", "char", "short", "int", "long", "float", "double", "signed", "unsigned",
    "const", "volatile", "__restrict__", "__restrict", "restrict", "struct", "enum",
}


def _balanced(text: str, i: int) -> int:
    """Index just past the parenthesis group that starts at text[i] == '('."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "(":
            depth += 1
        elif text[j] == ")":
            depth -= 1
            if depth == 0:
                return j + 1
    raise ValueError("unbalanced parentheses")


def _split_top(text: str, sep: str = ",") -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def _parse_param(text: str, index: int) -> tuple[str, str]:
    text = " ".join(text.split("=")[0].split())
    m = re.search(r"(\w+)\s*$", text)
    if m and m.group(1) not in _TYPE_WORDS and m.start() > 0:
        return m.group(1), text[: m.start()].strip()
    return f"arg{index}", text


@dataclasses.dataclass
class _KernelDecl:
    name: str
    names: list[str]
    types: list[str]
    launch_bounds: str  # first __launch_bounds__ argument, or ""


def find_kernels(preprocessed: str) -> list[_KernelDecl]:
    """The ``extern "C" __global__`` kernel definitions in preprocessed source text."""
    kernels: dict[str, _KernelDecl] = {}
    for m in re.finditer(r'\bextern\s*"C"', preprocessed):
        # The declaration header runs to the first '{' (definition) or ';' outside parens.
        i, depth = m.end(), 0
        while i < len(preprocessed):
            ch = preprocessed[i]
            if ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
            elif depth == 0 and ch in "{;":
                break
            i += 1
        if i >= len(preprocessed) or preprocessed[i] != "{":
            continue
        head = preprocessed[m.end() : i]
        if not re.search(r"\b__global__\b", head):
            continue
        bounds = ""
        lb = re.search(r"\b__launch_bounds__\s*\(", head)
        if lb:
            end = _balanced(head, lb.end() - 1)
            bounds = _split_top(head[lb.end() : end - 1])[0].strip()
            head = head[: lb.start()] + " " + head[end:]
        fm = re.search(r"(\w+)\s*\(", head)
        if not fm:
            continue
        end = _balanced(head, fm.end() - 1)
        plist = head[fm.end() : end - 1].strip()
        names, types = [], []
        if plist and plist != "void":
            for n, p in enumerate(_split_top(plist)):
                pname, ptype = _parse_param(p, n)
                names.append(pname)
                types.append(ptype)
        kernels[fm.group(1)] = _KernelDecl(fm.group(1), names, types, bounds)
    return list(kernels.values())


def _c_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _registration(kernels: list[_KernelDecl]) -> str:
    lines = [
        "// Registration of the extern \"C\" __global__ kernels (generated by the loader).",
        f'extern "C" COCPU_EXPORT const int cocpu_num_kernels = {len(kernels)};',
        'extern "C" COCPU_EXPORT const cocpu_kernel_desc cocpu_kernels[] = {',
    ]
    for k in kernels:
        lines.append(
            f"  cocpu_detail::make_kernel_desc(&{k.name}, {_c_string(k.name)}, "
            f"{_c_string(','.join(k.names))}, {_c_string('|'.join(k.types))}, "
            f"(int)({k.launch_bounds or 0})),"
        )
    if not kernels:
        lines.append("  cocpu_kernel_desc{},")
    lines.append("};")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------


def _run_compiler(argv: list[str], what: str) -> None:
    compiler_calls.append(list(argv))
    try:
        r = subprocess.run(argv, capture_output=True, text=True)
    except OSError as e:
        raise CudaOnCpuCompileError(f"{what}: cannot run {argv[0]}: {e}") from e
    if r.returncode != 0:
        raise CudaOnCpuCompileError(f"{what} failed:\n{r.stderr.strip()}")


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _runtime_objects(cxx: list[str], flags: list[str], fiber: str, src_dir: Path, out_dir: Path) -> list[Path]:
    """The runtime (and switch) objects for these flags, compiled once and cached."""
    objs = []
    sources = [_RUNTIME] + ([_SWITCH] if fiber == "asm" else [])
    for fname in sources:
        h = hashlib.sha256()
        for part in (_FORMAT_VERSION, _compiler_version(cxx), shlex.join(cxx), shlex.join(flags),
                     _resource_text(_HEADER), _resource_text(fname)):
            h.update(part.encode() + b"\0")
        obj = out_dir / f"{Path(fname).stem}-{h.hexdigest()[:20]}.o"
        if not obj.exists():
            tmp = out_dir / f"{obj.name}.{os.getpid()}.tmp.o"
            _run_compiler(cxx + flags + ["-I", str(src_dir), "-c", str(src_dir / fname), "-o", str(tmp)],
                          f"compiling the CUDA-on-CPU runtime ({fname})")
            os.replace(tmp, obj)
        objs.append(obj)
    return objs


def _read_descs(lib: ctypes.CDLL) -> dict:
    """Kernel metadata from a loaded library's registration table."""

    class ParamDesc(ctypes.Structure):
        _fields_ = [(n, ctypes.c_int) for n in
                    ("kind", "size", "align", "pointee_size", "pointee_align", "pointee_const")]

    class KernelDesc(ctypes.Structure):
        _fields_ = [("name", ctypes.c_char_p), ("param_names", ctypes.c_char_p),
                    ("param_types", ctypes.c_char_p), ("nparams", ctypes.c_int),
                    ("params", ctypes.POINTER(ParamDesc)), ("fn", ctypes.c_void_p),
                    ("invoke", ctypes.c_void_p), ("max_threads", ctypes.c_int)]

    if lib.cocpu_abi_version() != _ABI_VERSION:
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
    return {"abi": _ABI_VERSION, "kernels": kernels,
            "static_shared_bytes": int(lib.cocpu_static_shared_bytes())}


def compile_module(source: str, *, name: str, defines: dict[str, int | str] | None = None,
                   asan: bool = False) -> "Module":
    """Compile (or fetch from the caches) the CPU build of a complete CUDA C source.

    ``source`` must be self-contained (headers inlined; ``#line`` directives make compiler
    messages and ASan reports point at the real .cu files; without one the text is named
    ``<name>.cu``). ``defines`` become -D options. ``asan`` builds with AddressSanitizer;
    such a module always launches in a child process. Raises CudaOnCpuCompileError with
    the compiler's message.
    """
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", name or ""):
        raise ValueError(f"module name {name!r} must be a plain file-name stem")
    cxx = _cxx()
    fiber = _fiber_impl()
    flags = _flags(asan, fiber)
    dflags = _define_flags(defines)
    h = hashlib.sha256()
    for part in (_FORMAT_VERSION, platform.machine(), _compiler_version(cxx), shlex.join(cxx),
                 shlex.join(flags), shlex.join(dflags), name, source,
                 _resource_text(_HEADER), _resource_text(_RUNTIME),
                 _resource_text(_SWITCH) if fiber == "asm" else ""):
        h.update(part.encode() + b"\0")
    digest = h.hexdigest()
    with _MEMO_LOCK:
        if digest in _MEMO:
            return _MEMO[digest]
        stem = f"{name}-{digest[:20]}{'-asan' if asan else ''}"
        identity = {"name": name, "key": digest}
        home = cache_dir()
        meta, where = _cached_meta(home, stem, identity), home
        if meta is None:
            where = _writable_cache_dir(home)
            meta = _cached_meta(where, stem, identity) if where != home else None
        if meta is None:
            meta = _build(source, name, cxx, flags, dflags, fiber, asan, where / f"{stem}.so",
                          where / f"{stem}.json", identity)
        module = Module(name, where / f"{stem}.so", meta, asan=asan)
        _MEMO[digest] = module
        return module


def _cached_meta(directory: Path, stem: str, identity: dict) -> dict | None:
    """The record of a cached library that proves itself, else None (a miss: rebuild).

    The record must name this variant and the ``.so`` must have the size and SHA-256 it
    records: dlopen of a truncated library dies of SIGBUS, of a foreign one of SIGSEGV.
    """
    try:
        meta = json.loads((directory / f"{stem}.json").read_text())
        data = (directory / f"{stem}.so").read_bytes()
    except (OSError, ValueError):  # missing, unreadable, not UTF-8 or not JSON
        return None
    if not isinstance(meta, dict) or meta.get("abi") != _ABI_VERSION or not isinstance(meta.get("kernels"), list):
        return None
    return meta if meta.get("library") == _library_record(identity, data) else None


def _library_record(identity: dict, data: bytes) -> dict:
    return dict(identity, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


def _build(source, name, cxx, flags, dflags, fiber, asan, so_path: Path, meta_path: Path, identity: dict) -> dict:
    """Build the library into ``so_path`` and its record into ``meta_path``; returns the record."""
    out_dir = so_path.parent
    with ExitStack() as stack:
        src_dir = Path(stack.enter_context(resources.as_file(resources.files(__package__))))
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="build-", dir=out_dir)))
        body = f'#include "{src_dir / _HEADER}"\n#line 1 "{name}.cu"\n{source}\n'

        # Which kernels exist for these defines: preprocess in scan mode and parse.
        scan_src = tmp / f"{name}.scan.cpp"
        scan_src.write_text(body)
        scan_out = tmp / f"{name}.scan.ii"
        _run_compiler(cxx + ["-std=c++17", "-DCOCPU_SCAN=1"] + dflags +
                      ["-E", "-P", str(scan_src), "-o", str(scan_out)], f"preprocessing {name}")
        kernels = find_kernels(scan_out.read_text())

        objs = _runtime_objects(cxx, flags, fiber, src_dir, out_dir)
        module_src = tmp / f"{name}.cpp"
        module_src.write_text(body + '#line 1 "<cuda_on_cpu registration>"\n' + _registration(kernels))
        tmp_so = tmp / so_path.name
        # -Bsymbolic: the runtime binds to this library's kernel table even if another
        # module was loaded RTLD_GLOBAL.
        _run_compiler(cxx + flags + dflags + ["-shared", "-Wl,-Bsymbolic", str(module_src)] +
                      [str(o) for o in objs] + ["-o", str(tmp_so)], f"compiling {name}")
        if asan:
            meta = _child_describe(tmp_so)
        else:
            meta = _read_descs(ctypes.CDLL(str(tmp_so)))
        meta["library"] = _library_record(identity, tmp_so.read_bytes())
        # The library first, then the record that vouches for it; each replaced atomically.
        # A reader that meets one writer's .so with another's record sees a mismatch and
        # rebuilds: never a crash.
        os.replace(tmp_so, so_path)
        _atomic_write(meta_path, json.dumps(meta, indent=1).encode())
    return meta


# ---------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------


def _dim3(value, what: str) -> tuple[int, int, int]:
    t = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not 1 <= len(t) <= 3 or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in t):
        raise CudaOnCpuError(f"{what} must be a tuple of up to three ints, got {value!r}")
    t = tuple(int(v) for v in t) + (1,) * (3 - len(t))
    if min(t) < 1 or max(t) > 0x7FFFFFFF:
        raise CudaOnCpuError(f"{what} {t} out of range")
    return t


def _numpy_name(kind: int, size: int) -> str:
    if kind == BOOL:
        return "numpy.bool_"
    prefix = {SIGNED: "int", UNSIGNED: "uint", FLOAT: "float"}[kind]
    return f"numpy.{prefix}{size * 8}"


def _prepare_args(kernel: str, params: tuple[Param, ...], args) -> list:
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


def _launch_raw(lib, kernel_index: int, grid, block, shared_bytes: int, values: list,
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
    with _LAUNCH_LOCK:
        rc = fn(kernel_index, g, b, shared_bytes, argv, policy, seed, stack_bytes, err, len(err))
    if rc != 0:
        raise CudaOnCpuError(err.value.decode(errors="replace"))


class Module:
    """A compiled kernel variant. ``kernels``: names of its extern "C" __global__ kernels."""

    def __init__(self, name: str, path: Path, meta: dict, *, asan: bool):
        self.name = name
        self.path = Path(path)
        self.asan = asan
        self.static_shared_bytes = meta.get("static_shared_bytes", 0)
        self._meta = meta
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
               order: str | None = None, isolate: bool = False) -> None:
        """Run ``kernel<<<grid, block, shared_bytes>>>(*args)`` with CUDA semantics.

        args: per pointer parameter a C-contiguous NumPy array (its data pointer is passed;
        the dtype is not checked, only writability for non-const pointees and alignment to
        the pointee type) or None (null); per scalar parameter a NumPy scalar of exactly the
        parameter's kind and size (numpy.int32 for int, numpy.uint32 for unsigned,
        numpy.int64 for long long, numpy.float32 for float, ...). ``order``: see
        parse_order. ``isolate``: run in a child process (arrays are shipped there and
        copied back), so a crash becomes a CudaOnCpuError; always the case with asan.
        """
        self._check_kernel(kernel)
        grid, block = _dim3(grid, "grid"), _dim3(block, "block")
        if isinstance(shared_bytes, bool) or not isinstance(shared_bytes, (int, np.integer)) or shared_bytes < 0:
            raise CudaOnCpuError(f"kernel '{kernel}': shared_bytes must be a non-negative int")
        shared_bytes = int(shared_bytes)
        if shared_bytes > MAX_SHARED_BYTES:
            raise CudaOnCpuError(
                f"kernel '{kernel}': {shared_bytes} bytes of dynamic shared memory exceed the 227 KiB per block")
        policy, seed = parse_order(order)
        values = _prepare_args(kernel, self._params[kernel], args)
        stack = _stack_bytes(self.asan)
        if self.asan or isolate:
            _launch_in_child(self, kernel, grid, block, shared_bytes, values, policy, seed, stack)
            return
        raw = [v.ctypes.data if isinstance(v, np.ndarray) else v for v in values]
        _launch_raw(self._lib, self._index[kernel], grid, block, shared_bytes, raw, policy, seed, stack)


# ---------------------------------------------------------------------------------------
# Child processes (isolated and ASan launches)
# ---------------------------------------------------------------------------------------

_CHILD_LAUNCH_ERROR = 3  # the child's exit status for a CudaOnCpuError
_ASAN_EXITCODE = 86


def libasan_path() -> str | None:
    """The compiler's libasan.so (preloaded into ASan children), or None without one."""
    return _libasan_for(tuple(_cxx()))


@functools.lru_cache(maxsize=None)
def _libasan_for(cxx: tuple[str, ...]) -> str | None:
    try:
        r = subprocess.run(list(cxx) + ["-print-file-name=libasan.so"], capture_output=True, text=True)
    except OSError:
        return None
    path = r.stdout.strip()
    if r.returncode != 0 or not os.path.isabs(path) or not os.path.exists(path):
        return None  # gcc prints the bare name when it has no such file
    return os.path.realpath(path)


def _child_env(asan: bool) -> dict:
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if asan:
        libasan = libasan_path()
        if libasan is None:
            raise CudaOnCpuError(f"no libasan.so: {shlex.join(_cxx())} -print-file-name=libasan.so finds none")
        env["LD_PRELOAD"] = libasan + (" " + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
        opts = f"detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode={_ASAN_EXITCODE}:symbolize=1"
        env["ASAN_OPTIONS"] = opts + (":" + env["ASAN_OPTIONS"] if env.get("ASAN_OPTIONS") else "")
        symbolizer = shutil.which("llvm-symbolizer")
        if symbolizer and "ASAN_SYMBOLIZER_PATH" not in env:
            env["ASAN_SYMBOLIZER_PATH"] = symbolizer
    return env


def _run_child(request: dict, asan: bool) -> tuple[subprocess.CompletedProcess, dict | None]:
    with tempfile.TemporaryDirectory(prefix="cocpu-child-") as td:
        req_path, out_path = Path(td) / "request.pkl", Path(td) / "result.pkl"
        req_path.write_bytes(pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
        proc = subprocess.run(
            [sys.executable, "-m", "metrale_attn.cuda_on_cpu._child", str(req_path), str(out_path)],
            env=_child_env(asan), capture_output=True, text=True)
        result = pickle.loads(out_path.read_bytes()) if out_path.exists() else None
    return proc, result


def _child_describe(so_path: Path) -> dict:
    proc, result = _run_child({"op": "describe", "so": str(so_path)}, asan=True)
    if proc.returncode != 0 or result is None:
        raise CudaOnCpuCompileError(f"cannot load the ASan build {so_path.name}:\n{proc.stderr.strip()}")
    return result["meta"]


def _symbolize_fallback(report: str, so_path: Path) -> str:
    """Adds addr2line file:line for frames of our library that ASan left unsymbolized."""
    addr2line = shutil.which("addr2line")
    offsets = list(dict.fromkeys(re.findall(r"\(" + re.escape(str(so_path)) + r"\+(0x[0-9a-f]+)\)", report)))
    if not addr2line or not offsets:
        return report
    r = subprocess.run([addr2line, "-a", "-f", "-i", "-C", "-e", str(so_path)] + offsets,
                       capture_output=True, text=True)
    # Output: per address "0x...", then (function, file:line) pairs: the innermost
    # function first, then those it was inlined into.
    out, lines = [], r.stdout.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("0x"):
            addr, i, first = lines[i], i + 1, True
            while i + 1 < len(lines) and not lines[i].startswith("0x"):
                how = f"{addr} in" if first else f"{'':{len(addr)}} inlined into"
                out.append(f"    {how} {lines[i]} {lines[i + 1]}")
                i, first = i + 2, False
        else:
            i += 1
    return report + f"\naddr2line ({so_path.name}):\n" + "\n".join(out) + "\n"


def _launch_in_child(module: Module, kernel, grid, block, shared_bytes, values, policy, seed, stack) -> None:
    # Ship each distinct array once (by data pointer), so aliasing arguments stay aliased;
    # partial overlaps cannot be reproduced in the child and are refused.
    arrays: list[np.ndarray] = []
    slots: dict[tuple[int, int], int] = {}
    spec = []
    for v in values:
        if isinstance(v, np.ndarray):
            key = (v.ctypes.data, v.nbytes)
            if key not in slots:
                lo, hi = key[0], key[0] + key[1]
                for a in arrays:
                    if a.nbytes and v.nbytes and lo < a.ctypes.data + a.nbytes and a.ctypes.data < hi:
                        raise CudaOnCpuError(f"kernel '{kernel}': partially overlapping array arguments "
                                             "cannot be shipped to a child process")
                slots[key] = len(arrays)
                arrays.append(v)
            spec.append(("array", slots[key]))
        else:
            spec.append(("none",) if v is None else ("bytes", v))
    request = {
        "op": "launch", "so": str(module.path), "kernel_index": module._index[kernel],
        "grid": grid, "block": block, "shared_bytes": shared_bytes, "policy": policy,
        "seed": seed, "stack_bytes": stack, "args": spec,
        "arrays": [a.reshape(-1).view(np.uint8).tobytes() for a in arrays],
    }
    proc, result = _run_child(request, module.asan)
    if proc.returncode == 0 and result is not None:
        for a, data in zip(arrays, result["arrays"]):
            if a.flags.writeable:
                a.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
        return
    if proc.returncode == _CHILD_LAUNCH_ERROR and result is not None:
        raise CudaOnCpuError(result["error"])
    stderr = proc.stderr.strip()
    if "ERROR: AddressSanitizer" in stderr:
        report = stderr[stderr.index("=================") if "=================" in stderr else 0:]
        report = _symbolize_fallback(report, module.path)
        raise CudaOnCpuError(f"AddressSanitizer report for kernel '{kernel}':\n{report}")
    how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
    raise CudaOnCpuError(f"kernel '{kernel}' crashed the launch process ({how}):\n{stderr}")
