"""What one iteration of a spec's steady-state K/V loop consumes: the part of the static
SASS model (``sass_model.py``) that is not in the SASS.

``hot_loop(spec)`` is computed from the spec's public fields (arm, head dim, KV dtype,
implementation, ``tiling``, ``kernels``, ``max_rows``, ``shared_bytes``) and its source text:
the ``mma`` loop is one stage of each warp's ``cp.async`` ring (``KernelSpec.tiling``); the
``simt`` loop is read off the arm file's ``constexpr int VEC``/``UNROLL`` (``read_constexpr``,
with a small evaluator of C integer arithmetic). A new kernel implementation adds its case to
``hot_loop`` and the rest of the model needs no edit.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass

from metrale_attn import dtypes, policy
from metrale_attn.kernels import KernelSpec
from metrale_attn.sources import KernelSourceError, read_define


@dataclass(frozen=True)
class HotLoop:
    """What the static SASS model must know about a spec beyond its SASS: the shape of
    the CTA and what one iteration of one warp of the steady-state K/V loop consumes.
    Units: bytes, tokens, per CTA or per warp as named."""

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
    registers (the model then reads the loads in flight off the SASS)."""
    stage_bytes: int = 0
    """K + V bytes of one stage of one CTA (with ``pipeline_stages``)."""
    dynamic_smem_bytes: int = 0
    """Dynamic shared memory per CTA at launch."""
    grouped: bool = False
    """``heads_per_cta`` is a capacity: the launch picks any divisor of the group up to it
    (``mma``), and a model row takes the largest one that divides its shape's group."""


@functools.cache
def hot_loop(spec: KernelSpec) -> HotLoop:
    """``mma``: each warp consumes one stage of ``tile_tokens`` tokens per iteration from
    its ring of ``stages`` (a CTA's stage: 4 warps' worth). ``simt`` (``pd_attend`` in
    simt/simt_core.cuh): a thread owns ``VEC`` elements of the head dim, ``D / VEC`` threads a
    row, so a warp covers ``R = 32 / (D / VEC)`` rows per load and an iteration takes
    ``R * UNROLL`` tokens; ``VEC`` and ``UNROLL`` are the arm file's ``constexpr``s."""
    itemsize = dtypes.NUMPY_DTYPES[spec.kv_dtype].itemsize
    warps = spec.threads // 32
    if spec.tiling:
        tokens = spec.tiling.tile_tokens
        stage = tokens * spec.head_dim * itemsize * 2
        packed = spec.arm == "gqa_packed"
        return HotLoop(kernel=spec.kernels[0],
                       heads_per_cta=policy.DECODE_GQA_PACK_WIDTH if packed else spec.max_rows,
                       warps_per_cta=warps, tokens_per_warp_iter=tokens, kv_bytes_per_warp_iter=stage,
                       pipeline_stages=spec.tiling.stages, stage_bytes=warps * stage,
                       dynamic_smem_bytes=spec.shared_bytes, grouped=not packed)
    text = spec.source()
    v_dim = spec.v_head_dim or spec.head_dim  # MLA's 576/512: the slices tile the 512 values' dims
    vec = read_constexpr(text, "VEC", kv_itemsize=itemsize, head_dim=spec.head_dim, v_head_dim=v_dim)
    unroll = read_constexpr(text, "UNROLL", kv_itemsize=itemsize, head_dim=spec.head_dim, v_head_dim=v_dim,
                            known={"VEC": vec})
    tokens = 32 // (v_dim // vec) * unroll
    return HotLoop(
        kernel=spec.kernels[0],
        heads_per_cta=read_define(text, "PD_GQA") if spec.arm == "gqa_packed" else 1,
        warps_per_cta=warps,
        tokens_per_warp_iter=tokens,
        kv_bytes_per_warp_iter=tokens * (spec.head_dim + v_dim) * itemsize,
    )


def read_constexpr(text: str, name: str, *, kv_itemsize: int, head_dim: int | None = None,
                   known: dict[str, int] | None = None, v_head_dim: int | None = None) -> int:
    """The value of the one ``constexpr int <name> = <expr>;`` in ``text`` as its arm
    compiles it (``arm_text``), where ``<expr>`` is integer arithmetic on literals,
    ``sizeof(pd_kv_t)`` (the KV element size, ``kv_itemsize``), ``PD_HEAD_DIM`` (``head_dim``) and
    ``PD_V_HEAD_DIM`` (``v_head_dim``, default ``head_dim``),
    the constants ``known`` gives (read before it: ``{"VEC": 8}``), with comparisons and C's
    conditional operator, e.g. ``16 / (int)sizeof(pd_kv_t)`` or ``PD_HEAD_DIM / 32 > 8 ? PD_HEAD_DIM / 32 : 8``."""
    found = re.findall(rf"\bconstexpr[ \t]+int[ \t]+{name}[ \t]*=[ \t]*([^;]+);", arm_text(text))
    if len(found) != 1:
        raise KernelSourceError(f"expected exactly one 'constexpr int {name} = ...;' in the kernel source, "
                                f"found {len(found)}")
    expr = re.sub(r"\(int\)\s*sizeof\(pd_kv_t\)|sizeof\(pd_kv_t\)", str(kv_itemsize), found[0])
    dims = {} if head_dim is None else {"PD_HEAD_DIM": head_dim,
                                        "PD_V_HEAD_DIM": head_dim if v_head_dim is None else v_head_dim}
    for known_name, value in {**dims, **(known or {})}.items():
        expr = re.sub(rf"\b{known_name}\b", str(value), expr)
    try:
        return _int_arithmetic(ast.parse(_python_conditional(expr.strip()), mode="eval").body)
    except (SyntaxError, ValueError):
        raise KernelSourceError(f"cannot evaluate constexpr {name} = {found[0]!r} (only integer arithmetic, "
                                "comparisons, ?:, sizeof(pd_kv_t), PD_HEAD_DIM and the known constants are understood)") from None


def _python_conditional(expr: str) -> str:
    """C's ``a ? b : c`` (one, unparenthesised, as the sources write it) as Python's
    ``(b) if (a) else (c)``; other text unchanged."""
    if expr.count("?") != 1 or expr.count(":") != 1:
        return expr
    condition, rest = expr.split("?")
    then, otherwise = rest.split(":")
    return f"({then}) if ({condition}) else ({otherwise})"


_C_INT_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
              ast.Div: lambda a, b: int(a / b)}  # C's int division truncates toward zero
_C_COMPARISONS = {ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b, ast.Lt: lambda a, b: a < b,
                  ast.LtE: lambda a, b: a <= b, ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b}


def _int_arithmetic(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _C_INT_OPS:
        return _C_INT_OPS[type(node.op)](_int_arithmetic(node.left), _int_arithmetic(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_int_arithmetic(node.operand)
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _C_COMPARISONS:
        return int(_C_COMPARISONS[type(node.ops[0])](_int_arithmetic(node.left), _int_arithmetic(node.comparators[0])))
    if isinstance(node, ast.IfExp):
        return _int_arithmetic(node.body) if _int_arithmetic(node.test) else _int_arithmetic(node.orelse)
    raise ValueError(f"not integer arithmetic: {ast.dump(node)}")


_SIMPLE_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)[ \t]+(\w+)[ \t]*(?://.*)?$", re.MULTILINE)
_CONDITIONAL = re.compile(r"^[ \t]*#[ \t]*(if|ifdef|ifndef|elif|else|endif)\b[ \t]*(.*?)[ \t]*(?://.*)?$")
_COMPARISON = re.compile(r"^(\w+)[ \t]*(==|!=)[ \t]*(\w+)$")


def text_define(text: str, token: str) -> str | None:
    """What ``token`` stands for in ``text``: followed through the text's one-word
    ``#define``s that are the only definition of their name (``PD_ENTRY`` ->
    ``simt_decode_splitk``, ``PD_ARM`` -> ``PD_ARM_SPLITK`` -> ``1``); the token itself when
    the text does not define it, None when it defines it more than once (in branches
    ``arm_text`` did not drop, the compiler's to choose)."""
    definitions: dict[str, list[str]] = {}
    for name, value in _SIMPLE_DEFINE.findall(text):
        definitions.setdefault(name, []).append(value)
    seen = set()
    while token in definitions and token not in seen:
        if len(set(definitions[token])) != 1:
            return None
        seen.add(token)
        token = definitions[token][0]
    return token


def arm_text(text: str) -> str:
    """``text`` without the branches its arm does not compile, as far as the text decides:
    an ``#if A == B`` / ``#if A != B`` (``#else``) on names the text ``#define``s
    (``#if PD_ARM == PD_ARM_GQA_PACKED``: the arm's ``.cu`` defines ``PD_ARM``, pd_common.cuh
    the arm codes), so the kernel written once for three arms (simt/simt_core.cuh) reads as
    the arm's. Every other conditional (include guards, conditions on ``-D`` values) keeps
    both branches."""
    def decide(condition: str):
        found = _COMPARISON.match(condition)
        if not found:
            return None
        left, right = text_define(text, found.group(1)), text_define(text, found.group(3))
        if left is None or right is None or not (left.isdigit() and right.isdigit()):
            return None
        return (int(left) == int(right)) == (found.group(2) == "==")

    kept, branches = [], []  # per open conditional: [this branch: True / False / None (unknown: kept), any taken]
    for line in text.split("\n"):
        found = _CONDITIONAL.match(line)
        if found:
            kind = found.group(1)
            if kind in ("if", "ifdef", "ifndef"):
                state = decide(found.group(2)) if kind == "if" else None
                branches.append([state, state])
            elif kind in ("elif", "else") and branches:
                branch = branches[-1]
                if branch[1]:  # a branch before was compiled
                    branch[0] = False
                elif branch[1] is None or kind == "elif":
                    branch[0] = branch[1] = None
                else:
                    branch[0] = branch[1] = True
            elif kind == "endif" and branches:
                branches.pop()
            continue
        if not any(branch[0] is False for branch in branches):
            kept.append(line)
    return "\n".join(kept)
