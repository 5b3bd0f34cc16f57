"""Build and cache: ``compile_module`` turns a complete CUDA C source into a loaded ``Module``.

One shared library per kernel variant: the kernel source, unchanged, prefixed with the
shim header (``cuda_on_cpu.h``) and followed by a registration table of its
``extern "C" __global__`` kernels (``declarations``), linked with the runtime objects
(``runtime/*.cpp`` and, on x86-64, the hand-written fiber switch ``runtime/switch_x86_64.S``),
which are compiled once per set of flags, concurrently, and cached beside the libraries.
Libraries are cached on disk, keyed by a hash of everything that goes into them, and
memoized in-process. Threads may build different libraries at once (a caller's pool of
builds); one library builds once.

A cached library is trusted only as far as its record proves: the ``.json`` beside each
``.so`` names the variant (module name and key) and the ``.so``'s size and SHA-256, and
both are checked before the library is loaded. A truncated or foreign ``.so`` (which
would crash dlopen's user with SIGBUS or SIGSEGV), an empty one, or a record that is
missing, not JSON or names another variant is a miss: the library is rebuilt and both
files replaced atomically; the runtime objects every library links are checked the same
way (size and SHA-256 against their own record). A cache directory this process cannot
write, or one that fills up (no space, over quota) during a build, falls back to a
private temporary directory (removed at exit), with one warning per process naming both.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import hashlib
import json
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from importlib import resources
from pathlib import Path

from . import environment
from .abi import ABI_VERSION, read_descs
from .asan import COMPILE_FLAGS as ASAN_FLAGS
from .declarations import find_kernels, registration
from .errors import CudaOnCpuCompileError
from .isolation import child_describe
from .module import Module

_LOGGER = logging.getLogger(__name__)  # unless the caller names its own (compile_module)

# Bumped whenever the generated code or the cache layout changes meaning.
_FORMAT_VERSION = "cocpu-1"

_HEADER = "cuda_on_cpu.h"
_RUNTIME_HEADER = "runtime/internal.h"
_RUNTIME = ("runtime/launch.cpp", "runtime/scheduler.cpp", "runtime/ptx.cpp", "runtime/errors.cpp")
_SWITCH = "runtime/switch_x86_64.S"

# Every compiler invocation of this process (argv lists): tests check cache reuse with it.
compiler_calls: list[list[str]] = []

_MEMO: dict[str, Module] = {}  # source hash -> module, this process's
_MEMO_LOCK = threading.Lock()  # guards _MEMO, _BUILDING and the cache-directory choice
_BUILDING: dict[str, threading.Lock] = {}  # source hash -> held while that library builds
_RUNTIME_LOCK = threading.Lock()  # the runtime objects every library links
_CXX_VERSION: dict[tuple[str, ...], str] = {}

_FALLBACK_DIRS: dict[Path, Path] = {}  # unwritable cache dir -> this process's private one
_FALLBACK_WARNED = False


class CacheFallbackWarning(RuntimeWarning):
    """The kernel cache directory cannot be written; this process builds into a temporary one."""


def _writable_cache_dir(configured: Path, setting: str, logger: logging.Logger) -> Path:
    """``configured`` (created if need be) when this process can create files in it, else a
    private temporary directory for the rest of the process, with one warning per process.

    Asked by trying: permission bits say nothing for root or a read-only mount.
    """
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
        return _fall_back(configured, err.strerror or str(err), setting, logger)


def _fall_back(configured: Path, why: str, setting: str, logger: logging.Logger) -> Path:
    """This process's private temporary directory in place of ``configured`` (created once,
    removed at exit), with one warning per process naming both, why, and the ``setting``
    that moves the cache."""
    global _FALLBACK_WARNED
    fallback = _FALLBACK_DIRS.get(configured)
    if fallback is None:
        fallback = Path(tempfile.mkdtemp(prefix="cuda_on_cpu-"))  # mode 0700
        atexit.register(shutil.rmtree, fallback, ignore_errors=True)
        _FALLBACK_DIRS[configured] = fallback
    if not _FALLBACK_WARNED:
        _FALLBACK_WARNED = True
        message = (f"cannot write the CUDA-on-CPU kernel cache {configured} ({why}); this process builds its "
                   f"kernels in {fallback} instead, removed at exit (point {setting} at a writable "
                   "directory with space to keep them)")
        logger.warning("%s", message)
        warnings.warn(message, CacheFallbackWarning, stacklevel=5)
    return fallback


_FULL = (errno.ENOSPC, errno.EDQUOT)
"""A cache directory that is full (no space, over quota): its builds move to a private one."""


def _is_full(err: Exception) -> bool:
    if isinstance(err, OSError):
        return err.errno in _FULL
    return isinstance(err, CudaOnCpuCompileError) and "No space left on device" in str(err)


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
        common += list(ASAN_FLAGS)
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


def _runtime_sources(fiber: str) -> tuple[str, ...]:
    """The runtime's sources a library links, as objects: the switch only with the asm fiber."""
    return _RUNTIME + ((_SWITCH,) if fiber == "asm" else ())


def _runtime_objects(cxx: list[str], flags: list[str], fiber: str, src_dir: Path, out_dir: Path) -> list[Path]:
    """The runtime objects for these flags, compiled once and cached."""
    with _RUNTIME_LOCK:  # concurrent builds share the objects and their temporary names
        return _runtime_objects_locked(cxx, flags, fiber, src_dir, out_dir)


def _runtime_objects_locked(cxx: list[str], flags: list[str], fiber: str, src_dir: Path, out_dir: Path) -> list[Path]:
    objs, missing = [], []
    for fname in _runtime_sources(fiber):
        h = hashlib.sha256()
        for part in (_FORMAT_VERSION, _compiler_version(cxx), shlex.join(cxx), shlex.join(flags),
                     _resource_text(_HEADER), _resource_text(_RUNTIME_HEADER), _resource_text(fname)):
            h.update(part.encode() + b"\0")
        obj = out_dir / f"runtime-{Path(fname).stem}-{h.hexdigest()[:20]}.o"
        if not _object_proves_itself(obj):  # missing, truncated or foreign: rebuilt
            missing.append((fname, obj))
        objs.append(obj)

    def compile_object(fname: str, obj: Path) -> None:
        tmp = out_dir / f"{obj.name}.{os.getpid()}.tmp.o"
        _run_compiler(cxx + flags + ["-I", str(src_dir), "-c", str(src_dir / fname), "-o", str(tmp)],
                      f"compiling the CUDA-on-CPU runtime ({fname})")
        data = tmp.read_bytes()
        os.replace(tmp, obj)  # the object first, then the record that vouches for it
        _atomic_write(_object_record_path(obj), json.dumps(_object_record(data)).encode())

    if missing:  # one compiler per object: a first build waits for the slowest, not the sum
        with ThreadPoolExecutor(max_workers=len(missing), thread_name_prefix="cuda_on_cpu-runtime") as pool:
            for done in [pool.submit(compile_object, fname, obj) for fname, obj in missing]:
                done.result()
    return objs


def _object_record(data: bytes) -> dict:
    return dict(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


def _object_record_path(obj: Path) -> Path:
    return obj.with_name(f"{obj.name}.json")


def _object_proves_itself(obj: Path) -> bool:
    """Whether a cached runtime object has the size and SHA-256 its record gives (a
    damaged one would fail every later link with ``file too short`` until deleted)."""
    try:
        return json.loads(_object_record_path(obj).read_text()) == _object_record(obj.read_bytes())
    except (OSError, ValueError):
        return False


def compile_module(source: str, *, name: str, defines: dict[str, int | str] | None = None,
                   asan: bool = False, cache_dir: Path | None = None,
                   cache_setting: str = environment.CACHE_DIR, logger: logging.Logger = _LOGGER) -> Module:
    """Compile (or fetch from the caches) the CPU build of a complete CUDA C source.

    ``source`` must be self-contained (headers inlined; ``#line`` directives make compiler
    messages and ASan reports point at the real .cu files; without one the text is named
    ``<name>.cu``). ``defines`` become -D options. ``asan`` builds with AddressSanitizer;
    such a module always launches in a child process. Raises CudaOnCpuCompileError with
    the compiler's message.

    A library built on the shim passes its own ``cache_dir`` (else ``environment.cache_dir()``),
    the ``cache_setting`` its users change to move it (named by the warning when the
    directory cannot be written) and its ``logger`` (each build, cache hit and fallback is
    logged there), so that its users see one cache and one logger.
    """
    cxx, flags, dflags, fiber, digest = _identity(source, name, defines, asan)
    with _MEMO_LOCK:
        if digest in _MEMO:
            return _MEMO[digest]
        building = _BUILDING.setdefault(digest, threading.Lock())
    # One build per library; different libraries build concurrently (one compiler each).
    with building:
        with _MEMO_LOCK:
            if digest in _MEMO:
                return _MEMO[digest]
            stem = f"{name}-{digest[:20]}{'-asan' if asan else ''}"
            identity = {"name": name, "key": digest}
            home = Path(cache_dir) if cache_dir is not None else environment.cache_dir()
            meta, where = _cached_meta(home, stem, identity), home
            if meta is None:
                where = _writable_cache_dir(home, cache_setting, logger)
                meta = _cached_meta(where, stem, identity) if where != home else None
        if meta is not None:
            logger.debug("loaded %s for the CPU backend from the cache (hit: %s)", name, where / f"{stem}.so")
        else:
            start = time.perf_counter()
            try:
                meta = _build(source, name, cxx, flags, dflags, fiber, asan, where / f"{stem}.so",
                              where / f"{stem}.json", identity)
            except (OSError, CudaOnCpuCompileError) as err:
                if not _is_full(err) or where in _FALLBACK_DIRS.values():
                    raise
                with _MEMO_LOCK:
                    where = _fall_back(home, f"{os.strerror(errno.ENOSPC)}: {err}", cache_setting, logger)
                meta = _build(source, name, cxx, flags, dflags, fiber, asan, where / f"{stem}.so",
                              where / f"{stem}.json", identity)
            logger.debug("compiled %s for the CPU backend (%s) in %.2f s (cache miss: %s)", name, platform.machine(),
                         time.perf_counter() - start, where / f"{stem}.so")
        module = Module(name, where / f"{stem}.so", meta, asan=asan)
        with _MEMO_LOCK:
            _MEMO[digest] = module
            del _BUILDING[digest]
        return module


def _identity(source: str, name: str, defines: dict | None, asan: bool):
    """``(cxx, flags, define flags, fiber, digest)`` of a library: the digest hashes everything
    that goes into it (its cache key)."""
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", name or ""):
        raise ValueError(f"module name {name!r} must be a plain file-name stem")
    cxx = environment.cxx()
    fiber = environment.fiber_impl()
    flags = _flags(asan, fiber)
    dflags = _define_flags(defines)
    h = hashlib.sha256()
    for part in (_FORMAT_VERSION, platform.machine(), _compiler_version(cxx), shlex.join(cxx),
                 shlex.join(flags), shlex.join(dflags), name, source, _resource_text(_HEADER),
                 _resource_text(_RUNTIME_HEADER), *map(_resource_text, _runtime_sources(fiber))):
        h.update(part.encode() + b"\0")
    return cxx, flags, dflags, fiber, h.hexdigest()


def is_cached(source: str, *, name: str, defines: dict[str, int | str] | None = None, asan: bool = False,
              cache_dir: Path | None = None) -> bool:
    """Whether ``compile_module`` with these arguments would find its library (this process's
    memo, or a cache entry that proves itself) rather than run the host compiler: asked
    before a build so that a caller can say a cold compile is starting. Writes nothing."""
    digest = _identity(source, name, defines, asan)[-1]
    with _MEMO_LOCK:
        if digest in _MEMO:
            return True
        home = Path(cache_dir) if cache_dir is not None else environment.cache_dir()
        places = [home] + ([_FALLBACK_DIRS[home]] if home in _FALLBACK_DIRS else [])
    stem = f"{name}-{digest[:20]}{'-asan' if asan else ''}"
    identity = {"name": name, "key": digest}
    return any(_cached_meta(where, stem, identity) is not None for where in places)


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
    if not isinstance(meta, dict) or meta.get("abi") != ABI_VERSION or not isinstance(meta.get("kernels"), list):
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
        module_src.write_text(body + '#line 1 "<cuda_on_cpu registration>"\n' + registration(kernels))
        tmp_so = tmp / so_path.name
        # -Bsymbolic: the runtime binds to this library's kernel table even if another
        # module was loaded RTLD_GLOBAL.
        _run_compiler(cxx + flags + dflags + ["-shared", "-Wl,-Bsymbolic", str(module_src)] +
                      [str(o) for o in objs] + ["-o", str(tmp_so)], f"compiling {name}")
        if asan:
            meta = child_describe(tmp_so)
        else:
            meta = read_descs(ctypes.CDLL(str(tmp_so)))
        meta["library"] = _library_record(identity, tmp_so.read_bytes())
        # The library first, then the record that vouches for it; each replaced atomically.
        # A reader that meets one writer's .so with another's record sees a mismatch and
        # rebuilds: never a crash.
        os.replace(tmp_so, so_path)
        _atomic_write(meta_path, json.dumps(meta, indent=1).encode())
    return meta
