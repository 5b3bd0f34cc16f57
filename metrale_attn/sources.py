"""Kernel sources: reading ``kernels_cu/``, inlining its includes, and what the Python side
reads back from the text (constants, and each kernel's parameter list: the launch ABI).

Sources are read from a checkout's ``kernels_cu/``, or from an install's with ``importlib.resources``
(the directory ships inside the wheel as ``metrale_attn.kernels_cu``, its ``simt/`` folder too);
``#include "x.cuh"`` names a header by its path under ``kernels_cu/`` (``pd_common.cuh``,
``simt/simt_core.cuh``) and is inlined textually with ``#line`` directives, so both
compilers see one self-contained string and their errors name the real file and line.
Nothing is compiled here, and nothing at import time.

What the Python side relies on that lives in the sources is read back from them:
the constants (``PD_GQA``, ``PD_HDIM``, block sizes, dtype codes; ``PD_GQA``/``PD_HDIM``
must equal the policy's constants) and each kernel's parameter list, which is the launch
ABI (``parse_kernel_params``, per spec ``kernels.kernel_params``; the three arms' attention
kernels of each implementation share one list): the dispatch passes arguments by name.
"""

from __future__ import annotations

import functools
import importlib.resources
import pathlib
import re
from dataclasses import dataclass

import numpy as np

from . import config, dtypes, policy

SOURCE_PACKAGE = "metrale_attn.kernels_cu"
COMMON_HEADER = "pd_common.cuh"
CONVERT_HEADER = "pd_convert.cuh"
CORE_HEADER = "decode_core.cuh"
LAYOUT_HEADER = "mma_layout.cuh"
SOURCE_FILES = {
    ("mma", "unpacked"): "decode_unpacked.cu",
    ("mma", "splitk"): "decode_splitk.cu",
    ("mma", "gqa_packed"): "decode_gqa_packed.cu",
    ("simt", "unpacked"): "simt/simt_decode_unpacked.cu",
    ("simt", "splitk"): "simt/simt_decode_splitk.cu",
    ("simt", "gqa_packed"): "simt/simt_decode_gqa_packed.cu",
}
"""(impl, arm) -> the source that defines the kernels ``plan.KERNELS`` names."""

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.MULTILINE)


class KernelSourceError(RuntimeError):
    """A kernel source is missing, malformed, or disagrees with the Python constants."""


@functools.cache
def _source_dir():
    """The kernel sources of this copy of the package: a source checkout's ``kernels_cu/`` (beside
    the package's folder, the checkout marked by its ``pyproject.toml``), installed or not (the GPU
    check runs uninstalled on a bare machine); else ``metrale_attn/kernels_cu`` of an install. The
    checkout comes first because an editable install's import mapping names *its* checkout's
    folder: a second checkout (a git worktree) imported first on ``sys.path`` would otherwise
    compile the installed checkout's kernels, not its own."""
    root = pathlib.Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "kernels_cu" / COMMON_HEADER).is_file():
        return root / "kernels_cu"
    return importlib.resources.files(SOURCE_PACKAGE)


@functools.cache
def read_source(filename: str) -> str:
    """The raw text of ``kernels_cu/<filename>``; ``filename`` is a path under it with
    ``/`` separators (``simt/simt_core.cuh``)."""
    path = _source_dir()
    for part in filename.split("/"):  # one level at a time: Python 3.10's Traversable joins one name
        path = path / part
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KernelSourceError(f"kernel source kernels_cu/{filename} not found") from None


def source_names() -> tuple[str, ...]:
    """Every ``.cu`` and ``.cuh`` file under ``kernels_cu/``, as ``read_source`` names
    them (``decode_core.cuh``, ``simt/simt_core.cuh``), sorted."""
    names, folders = [], [(_source_dir(), "")]
    while folders:
        folder, prefix = folders.pop()
        for entry in folder.iterdir():
            if entry.is_dir():
                folders.append((entry, f"{prefix}{entry.name}/"))
            elif entry.name.endswith((".cu", ".cuh")):
                names.append(prefix + entry.name)
    return tuple(sorted(names))


def inline(filename: str, text: str | None = None, _seen: tuple[str, ...] = ()) -> str:
    """``kernels_cu/<filename>`` with the headers it includes inlined, each part
    preceded by a ``#line`` directive naming its real file. An include names a path
    under ``kernels_cu/`` whatever folder the including file is in (as a compiler
    given ``-I kernels_cu`` finds it). A header included twice is inlined once (the
    sources' include guards make the rest empty). ``text`` overrides the file's own
    contents (tests edit copies this way)."""
    return _inline(filename, text, _seen, set())


def _inline(filename: str, text: str | None, seen: tuple[str, ...], done: set) -> str:
    if filename in seen:
        raise KernelSourceError(f"include cycle: {' -> '.join(seen + (filename,))}")
    body = read_source(filename) if text is None else text
    parts, last, line = [f'#line 1 "kernels_cu/{filename}"\n'], 0, 1
    for match in _INCLUDE.finditer(body):
        parts.append(body[last:match.start()])
        line += body.count("\n", last, match.end()) + 1
        header = match.group(1)
        if header not in done:
            done.add(header)
            parts.append(_inline(header, None, seen + (filename,), done))
        parts.append(f'\n#line {line} "kernels_cu/{filename}"')
        last = match.end()
    parts.append(body[last:])
    return "".join(parts)


def read_define(text: str, name: str) -> int:
    """The integer value of ``#define <name> <int>`` in ``text`` (exactly one such line)."""
    found = re.findall(rf"^[ \t]*#[ \t]*define[ \t]+{name}[ \t]+\(?([0-9]+)\)?[ \t]*(?://.*)?$", text, re.MULTILINE)
    if len(found) != 1:
        raise KernelSourceError(f"expected exactly one '#define {name} <int>' in the kernel source, found {len(found)}")
    return int(found[0])


def read_float_define(text: str, name: str) -> float:
    """The value of ``#define <name> <decimal>`` in ``text`` (exactly one such line)."""
    found = re.findall(rf"^[ \t]*#[ \t]*define[ \t]+{name}[ \t]+([0-9]+\.[0-9]+(?:[eE][-+]?[0-9]+)?)[ \t]*(?://.*)?$",
                       text, re.MULTILINE)
    if len(found) != 1:
        raise KernelSourceError(f"expected exactly one '#define {name} <decimal>' in the kernel source, found {len(found)}")
    return float(found[0])


@dataclass(frozen=True)
class SourceConstants:
    """Constants defined in the sources that the launcher relies on."""

    threads: int
    merge_threads: int
    dtype_codes: dict
    log2e: float
    ln2: float
    row_tile: int


@functools.cache
def source_constants() -> SourceConstants:
    """The constants, read from the sources; those the host holds too (``config.LOG2E``,
    ``config.LN2``, ``config.ROW_TILE``) must agree with it."""
    header, convert = read_source(COMMON_HEADER), read_source(CONVERT_HEADER)
    constants = SourceConstants(
        threads=read_define(header, "PD_THREADS"),
        merge_threads=read_define(header, "PD_MERGE_THREADS"),
        dtype_codes={name: read_define(convert, define) for name, define in dtypes.CODE_DEFINES.items()},
        log2e=read_float_define(convert, "PD_LOG2E"),
        ln2=read_float_define(convert, "PD_LN2"),
        row_tile=read_define(read_source(LAYOUT_HEADER), "PD_ROW_TILE"),
    )
    for define, found, host, name in (("PD_LOG2E", constants.log2e, config.LOG2E, "LOG2E"),
                                      ("PD_LN2", constants.ln2, config.LN2, "LN2"),
                                      ("PD_ROW_TILE", constants.row_tile, config.ROW_TILE, "ROW_TILE")):
        if found != host:
            raise KernelSourceError(f"the kernels define {define} {found!r}, but the host uses {host!r} "
                                    f"(config.{name})")
    return constants


def merge_threads(head_dim: int) -> int:
    """The split-K merge's block: a thread per output dim, rounded up to a warp, at most
    ``PD_MERGE_THREADS`` (the kernel's launch bounds; its loop takes any block size)."""
    return min(source_constants().merge_threads, 32 * -(-head_dim // 32))


def check_pack_constants(text: str, filename: str) -> None:
    """Refuse a packed source whose ``PD_GQA``/``PD_HDIM`` differ from the policy's."""
    for define, expected in (("PD_GQA", policy.DECODE_GQA_PACK_WIDTH), ("PD_HDIM", policy.DECODE_GQA_PACK_HEAD_DIM)):
        found = read_define(text, define)
        if found != expected:
            raise KernelSourceError(
                f"kernels_cu/{filename} defines {define} {found}, but the dispatch uses "
                f"{expected} (policy.{'DECODE_GQA_PACK_WIDTH' if define == 'PD_GQA' else 'DECODE_GQA_PACK_HEAD_DIM'}); "
                "refusing to load a kernel that would read the wrong heads"
            )


# ---------------------------------------------------------------------------------------
# The launch ABI, read from the sources
# ---------------------------------------------------------------------------------------

_KERNEL_DEF = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:[A-Z_][A-Z0-9_]*\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)\s*\{')
_COMMENT = re.compile(r'//[^\n]*|/\*.*?\*/|("(?:\\.|[^"\\\n])*")', re.DOTALL)
"""A comment (replaced by a space), or a string literal (kept: ``#line 1 "kernels_cu/..."``)."""
_NAME_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)[ \t]+([A-Za-z_]\w*)[ \t]*$", re.MULTILINE)

SCALAR_TYPES = {"int": np.int32, "unsigned": np.uint32, "long long": np.int64, "float": np.float32,
                "double": np.float64}
"""C scalar types a kernel parameter may have, and the NumPy type the launcher passes."""


@dataclass(frozen=True)
class Param:
    """One kernel parameter as the source declares it: a pointer, or a scalar whose
    launch value is ``numpy_type(value)``."""

    name: str
    ctype: str

    @property
    def is_pointer(self) -> bool:
        return "*" in self.ctype

    @property
    def numpy_type(self):
        return SCALAR_TYPES[self.ctype]


_PARAM_IF = re.compile(r"^[ \t]*#[ \t]*(if[ \t]+([A-Za-z_]\w*)|endif)[ \t]*$")


def _params_defined(kernel: str, params: str, defines: dict) -> str:
    """A parameter list's text with its ``#if NAME`` ... ``#endif`` blocks (not nested) kept
    where ``defines[NAME]`` is non-zero and dropped elsewhere; any other directive there is
    refused, since only the compiler could evaluate it."""
    kept, block = [], None  # block: the NAME of the '#if NAME' we are inside, else None
    for line in params.split("\n"):
        if not line.lstrip().startswith("#"):
            if block is None or defines.get(block, 0):
                kept.append(line)
            continue
        directive = _PARAM_IF.match(line)
        name = directive.group(2) if directive else None
        if directive is None or (name is None) == (block is None):  # an '#if' inside a block, an '#endif' outside
            raise KernelSourceError(f"kernel {kernel}: its parameter list may hold only unnested '#if NAME' ... "
                                    f"'#endif' blocks, got {line.strip()!r}")
        block = name
    if block is not None:
        raise KernelSourceError(f"kernel {kernel}: an '#if' of its parameter list has no '#endif'")
    return "\n".join(kept)


def parse_kernel_params(text: str, defines: dict | None = None) -> dict[str, tuple[Param, ...]]:
    """``extern "C" __global__`` kernel name -> its parameters, from source text
    (comments ignored). A kernel whose name is a macro takes the identifier that
    macro is ``#define``d as in the same text: the arms' one kernel of
    ``mma_kernel.cuh`` (and of ``simt/simt_core.cuh``) is ``PD_ENTRY``, which each
    arm's ``.cu`` defines before including it, so the inlined source of an arm reads as
    that arm's kernel. Parameters a feature adds sit in ``#if PD_<FEATURE>`` ... ``#endif``
    inside the list (the simt kernel's multi_token, device_scales and csr ones: its plain specs
    keep their ABI), kept where ``defines`` (a spec's ``-D`` values; a name absent reads 0, as the
    preprocessor's) sets that name non-zero."""
    text = _COMMENT.sub(lambda m: m.group(1) or " ", text)
    defined: dict[str, list[str]] = {}
    for macro, value in _NAME_DEFINE.findall(text):
        defined.setdefault(macro, []).append(value)
    kernels = {}
    for match in _KERNEL_DEF.finditer(text):
        name = match.group(1)
        if name in defined:
            if len(set(defined[name])) != 1:
                raise KernelSourceError(f"the kernel name {name} is defined as {' and '.join(defined[name])}")
            name = defined[name][0]
        params = []
        for decl in _params_defined(name, match.group(2), defines or {}).split(","):
            words = decl.replace("*", " * ").split()
            if len(words) < 2:
                raise KernelSourceError(f"kernel {name}: cannot read the parameter {decl.strip()!r}")
            ctype = " ".join(w for w in words[:-1] if w not in ("const", "__restrict__"))
            if "*" not in ctype and ctype not in SCALAR_TYPES:
                raise KernelSourceError(f"kernel {name}: parameter {words[-1]} has type {ctype!r}, "
                                        f"not a pointer or one of {', '.join(SCALAR_TYPES)}")
            params.append(Param(words[-1], ctype))
        kernels[name] = tuple(params)
    return kernels
