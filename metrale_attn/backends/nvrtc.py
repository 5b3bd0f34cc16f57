"""NVRTC, the one way this package compiles CUDA C for a GPU, through ``cuda.bindings.nvrtc``
(the ``cuda-bindings`` package, NVIDIA's own Python binding of the CUDA libraries).

What it owns: creating, compiling and reading a program (log, PTX, cubin) and NVRTC's version
(every cubin cache key holds it) and architectures.

Why the binding and not CuPy's ``cupy_backends.cuda.libs.nvrtc``: CuPy's ``getCUBIN`` hands
back NVRTC's buffer minus its last byte (it strips a trailing NUL, as it must for PTX text,
but a cubin is binary: that byte is the last of the ELF program-header table, and ``nvdisasm``
refuses the file). The binding exposes ``nvrtcGetCUBINSize`` and ``nvrtcGetCUBIN`` as NVRTC
defines them, so the cubin comes whole, and the whole program (create, compile, log, PTX,
cubin) lives and dies on one library: no handle crosses into another NVRTC. It loads
``libnvrtc`` through ``cuda-pathfinder``, as CuPy 14 does, so with the same CUDA major (the
``cuda12`` and ``cuda13`` extras pair them) both use the same file and report the same
version (``tests/test_cubin_cache.py`` checks both, and that our cubin is CuPy's plus the
byte CuPy drops).

Imported lazily: ``import metrale_attn`` and the CPU backend never need it.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple, Optional

INSTALL = ("pip install 'metrale-attn[cuda12]' (or [cuda13]), which brings cuda-bindings and the NVRTC "
           "wheel of the same CUDA major")


class NvrtcCompileError(RuntimeError):
    """NVRTC refused the source; ``log`` is its program log."""

    def __init__(self, message: str, log: str):
        super().__init__(message)
        self.log = log


class Compiled(NamedTuple):
    """One compile's results: the program log, the PTX (without NVRTC's terminating NUL) and
    the cubin (whole: every byte of ``nvrtcGetCUBIN``; None for a ``compute_XY`` target)."""

    log: str
    ptx: bytes
    cubin: Optional[bytes]


def _binding():
    """``cuda.bindings.nvrtc``; ImportError naming the install line where it is missing."""
    try:
        return importlib.import_module("cuda.bindings.nvrtc")
    except ImportError as err:
        raise ImportError(f"NVRTC is called through cuda-bindings, which is not installed ({err}): {INSTALL}") from err


def _checked(nvrtc, call: str, result):
    """The values of a binding call's ``(nvrtcResult, *values)``; RuntimeError naming ``call``
    and NVRTC's error unless it succeeded."""
    status, *values = result
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, name = nvrtc.nvrtcGetErrorString(status)
        raise RuntimeError(f"{call} failed: {name.decode(errors='replace')} ({int(status)})")
    return values[0] if len(values) == 1 else tuple(values)


def version() -> tuple[int, int]:
    """NVRTC's ``(major, minor)``, as the cache keys and sidecars spell it."""
    nvrtc = _binding()
    major, minor = _checked(nvrtc, "nvrtcVersion", nvrtc.nvrtcVersion())
    return int(major), int(minor)


def supported_archs() -> tuple[int, ...]:
    """The ``XY`` of every ``sm_XY`` this NVRTC compiles for."""
    nvrtc = _binding()
    return tuple(int(a) for a in _checked(nvrtc, "nvrtcGetSupportedArchs", nvrtc.nvrtcGetSupportedArchs()))


def _read(nvrtc, program, what: str) -> bytes:
    """All ``nvrtcGet<what>Size`` bytes of ``nvrtcGet<what>`` (PTX, CUBIN, ProgramLog)."""
    size = _checked(nvrtc, f"nvrtcGet{what}Size", getattr(nvrtc, f"nvrtcGet{what}Size")(program))
    buffer = bytearray(size)
    _checked(nvrtc, f"nvrtcGet{what}", getattr(nvrtc, f"nvrtcGet{what}")(program, buffer))
    return bytes(buffer)


def _text(data: bytes) -> bytes:
    """NVRTC's text results end in a NUL the text does not include."""
    return data[:-1] if data.endswith(b"\0") else data


def compile_program(source: str, filename: str, options: tuple[str, ...], *, cubin: bool) -> Compiled:
    """Compile ``source`` (named ``filename`` in messages) with ``options`` (the architecture
    among them); ``cubin``: read the cubin too (a real ``sm_XY`` target; a ``compute_XY`` one
    has none). Raises ``NvrtcCompileError`` with the log when NVRTC refuses the source."""
    nvrtc = _binding()
    program = _checked(nvrtc, "nvrtcCreateProgram",
                       nvrtc.nvrtcCreateProgram(source.encode(), filename.encode(), 0, [], []))
    try:
        encoded = [o.encode() for o in options]
        (status,) = nvrtc.nvrtcCompileProgram(program, len(encoded), encoded)
        log = _text(_read(nvrtc, program, "ProgramLog")).decode(errors="replace")
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, name = nvrtc.nvrtcGetErrorString(status)
            raise NvrtcCompileError(f"nvrtcCompileProgram failed: {name.decode(errors='replace')}", log)
        return Compiled(log, _text(_read(nvrtc, program, "PTX")), _read(nvrtc, program, "CUBIN") if cubin else None)
    finally:
        nvrtc.nvrtcDestroyProgram(program)
