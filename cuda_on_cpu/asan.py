"""AddressSanitizer builds: their compile flags, the libasan a child preloads, its options, and
the report a failed launch turns into.

An ASan module is built with ``COMPILE_FLAGS`` and only ever loaded in a child process
(``isolation``), which needs the compiler's libasan preloaded ahead of Python. A report
is cut from the child's stderr and, where ASan left frames of the kernel library
unsymbolized, completed with ``addr2line`` file:line locations.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

from .environment import cxx
from .errors import CudaOnCpuError

# -gdwarf-4: binutils addr2line (our fallback symbolizer) names the wrong file for
# #line'd code in DWARF 5 line tables.
COMPILE_FLAGS = ("-O1", "-g", "-gdwarf-4", "-fsanitize=address", "-fno-omit-frame-pointer")

EXITCODE = 86  # a child's exit status when ASan reported


def libasan_path() -> str | None:
    """The compiler's libasan.so (preloaded into ASan children), or None without one."""
    return _libasan_for(tuple(cxx()))


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


def child_env(env: dict) -> None:
    """Add to a child's environment what an ASan launch needs: libasan preloaded, the
    options (halt on the first error, exit with ``EXITCODE``, no leak check; the
    caller's own ``ASAN_OPTIONS`` come last and win), and llvm-symbolizer when present."""
    libasan = libasan_path()
    if libasan is None:
        raise CudaOnCpuError(f"no libasan.so: {shlex.join(cxx())} -print-file-name=libasan.so finds none")
    env["LD_PRELOAD"] = libasan + (" " + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
    opts = f"detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode={EXITCODE}:symbolize=1"
    env["ASAN_OPTIONS"] = opts + (":" + env["ASAN_OPTIONS"] if env.get("ASAN_OPTIONS") else "")
    symbolizer = shutil.which("llvm-symbolizer")
    if symbolizer and "ASAN_SYMBOLIZER_PATH" not in env:
        env["ASAN_SYMBOLIZER_PATH"] = symbolizer


def report_in(stderr: str, so_path: Path) -> str | None:
    """The AddressSanitizer report in a child's (stripped) stderr, symbolized where ASan
    could not; None when there is none."""
    if "ERROR: AddressSanitizer" not in stderr:
        return None
    text = stderr[stderr.index("=================") if "=================" in stderr else 0:]
    return _symbolize_fallback(text, so_path)


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
