"""Kernel sources and variants: what each backend compiles.

Sources are read from ``kernels_cu/`` with ``importlib.resources`` (the directory
ships inside the wheel as ``metrale_attn.kernels_cu``); ``#include "x.cuh"`` of a
sibling header is inlined textually with ``#line`` directives, so both compilers
see one self-contained string and their errors name the real file and line.
Nothing is compiled here, and nothing at import time.

Constants the Python side relies on that live in the sources (``PD_GQA``,
``PD_HDIM``, block sizes, dtype codes, the hot loop's ``VEC``/``UNROLL``) are read
back from the source text; ``PD_GQA``/``PD_HDIM`` must equal the policy's constants
or loading is refused.
"""

from __future__ import annotations

import ast
import functools
import importlib.resources
import pathlib
import re
from dataclasses import dataclass

from . import dtypes, policy

SOURCE_PACKAGE = "metrale_attn.kernels_cu"
COMMON_HEADER = "pd_common.cuh"
FAMILIES = {
    "unpacked": ("paged_decode_unpacked.cu", ("paged_decode_unpacked",)),
    "splitk": ("paged_decode_splitk.cu", ("paged_decode_splitk", "paged_decode_splitk_merge")),
    "gqa_packed": ("paged_decode_gqa_packed.cu", ("paged_decode_gqa_packed",)),
}
"""Plan arm -> (source file, its ``extern "C"`` kernels)."""

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.MULTILINE)


class KernelSourceError(RuntimeError):
    """A kernel source is missing, malformed, or disagrees with the Python constants."""


@functools.cache
def _source_dir():
    """``metrale_attn/kernels_cu`` of an install, else ``kernels_cu/`` of a source checkout
    run without installing (the GPU check runs that way on a bare machine)."""
    try:
        return importlib.resources.files(SOURCE_PACKAGE)
    except ModuleNotFoundError:
        return pathlib.Path(__file__).resolve().parent.parent / "kernels_cu"


@functools.cache
def read_source(filename: str) -> str:
    """The raw text of ``kernels_cu/<filename>``."""
    try:
        return (_source_dir() / filename).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KernelSourceError(f"kernel source kernels_cu/{filename} not found") from None


def inline(filename: str, text: str | None = None, _seen: tuple[str, ...] = ()) -> str:
    """``kernels_cu/<filename>`` with its sibling headers inlined, each part
    preceded by a ``#line`` directive naming its real file. ``text`` overrides the
    file's own contents (tests edit copies this way)."""
    if filename in _seen:
        raise KernelSourceError(f"include cycle: {' -> '.join(_seen + (filename,))}")
    body = read_source(filename) if text is None else text
    parts, last, line = [f'#line 1 "kernels_cu/{filename}"\n'], 0, 1
    for match in _INCLUDE.finditer(body):
        parts.append(body[last:match.start()])
        line += body.count("\n", last, match.end()) + 1
        parts.append(inline(match.group(1), None, _seen + (filename,)))
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


@dataclass(frozen=True)
class SourceConstants:
    """Constants defined in the sources that the launcher relies on."""

    threads: int
    merge_threads: int
    dtype_codes: dict


@functools.cache
def source_constants() -> SourceConstants:
    header = read_source(COMMON_HEADER)
    return SourceConstants(
        threads=read_define(header, "PD_THREADS"),
        merge_threads=read_define(header, "PD_MERGE_THREADS"),
        dtype_codes={name: read_define(header, define) for name, define in dtypes.CODE_DEFINES.items()},
    )


def read_constexpr(text: str, name: str, *, kv_itemsize: int) -> int:
    """The value of the one ``constexpr int <name> = <expr>;`` in ``text``, where
    ``<expr>`` is integer arithmetic on literals and ``sizeof(pd_kv_t)`` (the KV
    element size, ``kv_itemsize``), e.g. ``16 / (int)sizeof(pd_kv_t)``."""
    found = re.findall(rf"\bconstexpr[ \t]+int[ \t]+{name}[ \t]*=[ \t]*([^;]+);", text)
    if len(found) != 1:
        raise KernelSourceError(f"expected exactly one 'constexpr int {name} = ...;' in the kernel source, "
                                f"found {len(found)}")
    expr = re.sub(r"\(int\)\s*sizeof\(pd_kv_t\)|sizeof\(pd_kv_t\)", str(kv_itemsize), found[0])
    try:
        return _int_arithmetic(ast.parse(expr.strip(), mode="eval").body)
    except (SyntaxError, ValueError):
        raise KernelSourceError(f"cannot evaluate constexpr {name} = {found[0]!r} (only integer arithmetic and "
                                "sizeof(pd_kv_t) are understood)") from None


_C_INT_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
              ast.Div: lambda a, b: int(a / b)}  # C's int division truncates toward zero


def _int_arithmetic(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _C_INT_OPS:
        return _C_INT_OPS[type(node.op)](_int_arithmetic(node.left), _int_arithmetic(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_int_arithmetic(node.operand)
    raise ValueError(f"not integer arithmetic: {ast.dump(node)}")


def check_pack_constants(text: str) -> None:
    """Refuse a packed source whose ``PD_GQA``/``PD_HDIM`` differ from the policy's."""
    for define, expected in (("PD_GQA", policy.DECODE_GQA_PACK_WIDTH), ("PD_HDIM", policy.DECODE_GQA_PACK_HEAD_DIM)):
        found = read_define(text, define)
        if found != expected:
            raise KernelSourceError(
                f"kernels_cu/{FAMILIES['gqa_packed'][0]} defines {define} {found}, but the dispatch uses "
                f"{expected} (policy.{'DECODE_GQA_PACK_WIDTH' if define == 'PD_GQA' else 'DECODE_GQA_PACK_HEAD_DIM'}); "
                "refusing to load a kernel that would read the wrong heads"
            )


@dataclass(frozen=True)
class HotLoop:
    """What the static SASS report (``benchmarks/sass_report.py``) must know about a
    variant beyond its SASS: the shape of the CTA and what one iteration of one warp
    of the steady-state K/V loop consumes. Units: bytes, tokens, per CTA or per warp
    as named. A new kernel implementation fills these in for its variants
    (``Variant.hot_loop``) and the report needs no edit.
    """

    kernel: str
    """The ``extern "C"`` kernel that runs the loop."""
    heads_per_cta: int
    """Query heads one CTA serves; the ``G / heads_per_cta`` CTAs of a GQA group each read the same K/V."""
    warps_per_cta: int
    tokens_per_warp_iter: int
    """K/V tokens one warp consumes in one iteration of the loop."""
    kv_bytes_per_warp_iter: int
    """Their K + V bytes: ``tokens_per_warp_iter * head_dim * kv itemsize * 2``."""
    pipeline_stages: int = 0
    """Depth of a ``cp.async``/TMA ring of shared-memory stages; 0 = plain loads into
    registers (the report then reads the loads in flight off the SASS)."""
    stage_bytes: int = 0
    """K + V bytes of one stage of one CTA (with ``pipeline_stages``)."""
    dynamic_smem_bytes: int = 0
    """Dynamic shared memory per CTA at launch."""


@dataclass(frozen=True)
class Variant:
    """One compiled specialization. Its ``name`` carries every parameter and is the memo key.

    The KV layout is not a parameter: kernels address the cache by strides.
    """

    family: str
    head_dim: int
    q_dtype: str
    kv_dtype: str

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        if self.q_dtype not in dtypes.Q_DTYPES or self.kv_dtype not in dtypes.KV_DTYPES:
            raise ValueError(f"unsupported dtypes q={self.q_dtype!r} kv={self.kv_dtype!r}")
        allowed = (policy.DECODE_GQA_PACK_HEAD_DIM,) if self.family == "gqa_packed" else (64, 128, 256)
        if self.head_dim not in allowed:
            raise ValueError(f"the {self.family} kernel supports head_dim {allowed}, got {self.head_dim}")

    @property
    def name(self) -> str:
        return f"paged_decode_{self.family}_q{self.q_dtype}_kv{self.kv_dtype}_hd{self.head_dim}"

    @property
    def filename(self) -> str:
        return FAMILIES[self.family][0]

    @property
    def kernels(self) -> tuple[str, ...]:
        return FAMILIES[self.family][1]

    def source(self, text: str | None = None) -> str:
        """The self-contained source; ``text`` replaces the family file (tests)."""
        full = inline(self.filename, text)
        if self.family == "gqa_packed":
            check_pack_constants(full)
        return full

    @property
    def hot_loop(self) -> HotLoop:
        """The steady-state K/V loop, from the sources' own constants (see ``HotLoop``)."""
        return _hot_loop(self)

    def defines(self) -> dict[str, int]:
        """``-D`` values: everything the kernels take from Python."""
        codes = source_constants().dtype_codes
        return {
            "PD_HEAD_DIM": self.head_dim,
            "PD_Q_DTYPE": codes[self.q_dtype],
            "PD_KV_DTYPE": codes[self.kv_dtype],
            "PD_MIN_KV_PER_SPLIT": policy.PD_MIN_KV_PER_SPLIT,
        }


@functools.cache
def _hot_loop(variant: Variant) -> HotLoop:
    """Today's CUDA-core loop (``pd_attend`` in pd_common.cuh): a thread owns ``VEC``
    elements of the head dim, ``D / VEC`` threads a row, so a warp covers
    ``R = 32 / (D / VEC)`` rows per load and an iteration takes ``R * UNROLL``
    tokens; ``VEC`` and ``UNROLL`` are the family file's ``constexpr``s."""
    text = variant.source()
    itemsize = dtypes.ITEMSIZE[variant.kv_dtype]
    vec = read_constexpr(text, "VEC", kv_itemsize=itemsize)
    unroll = read_constexpr(text, "UNROLL", kv_itemsize=itemsize)
    tokens = 32 // (variant.head_dim // vec) * unroll
    return HotLoop(
        kernel=variant.kernels[0],
        heads_per_cta=read_define(text, "PD_GQA") if variant.family == "gqa_packed" else 1,
        warps_per_cta=source_constants().threads // 32,
        tokens_per_warp_iter=tokens,
        kv_bytes_per_warp_iter=tokens * variant.head_dim * itemsize * 2,
    )


def all_variants() -> list[Variant]:
    """Every variant the dispatch can ask for."""
    return [
        Variant(family, head_dim, q, kv)
        for family in FAMILIES
        for head_dim in ((policy.DECODE_GQA_PACK_HEAD_DIM,) if family == "gqa_packed" else (64, 128, 256))
        for q in dtypes.Q_DTYPES
        for kv in dtypes.KV_DTYPES
    ]
