"""NumPy float64 reference for paged-decode attention, and the one correctness bar.

Every kernel in this package is checked against the functions here. All math is
float64; inputs may be bf16 (``ml_dtypes.bfloat16``), fp16 (``numpy.float16``),
fp8 e4m3 (``ml_dtypes.float8_e4m3fn``, or a ``uint8`` array holding its bits),
float32 or float64.

Layout summary (see DESIGN):

* ``q``: ``[num_seqs, num_q_heads, head_dim]``.
* ``k_cache`` / ``v_cache``: ``"NHD"`` = ``[num_pages, page_size, num_kv_heads, head_dim]``
  (vLLM) or ``"HND"`` = ``[num_pages, num_kv_heads, page_size, head_dim]`` (FlashInfer).
  The dequantized value is ``stored * scale`` (``k_scale`` / ``v_scale``, per tensor,
  applied to every dtype).
* ``block_tables``: int32 ``[num_seqs, max_pages_per_seq]``; ``seq_lens``: int32
  ``[num_seqs]``. Token ``t`` of sequence ``s`` lives in page
  ``block_tables[s, t // page_size]`` at offset ``t % page_size``. Entries past a
  sequence's last page are garbage and are never read (an out-of-range id there is
  never even looked at; an out-of-range id that *is* needed raises ``IndexError``).
* GQA: query head ``h`` reads kv head ``h // (num_q_heads // num_kv_heads)``.

Logarithms: ``lse`` values returned by :func:`attention`, :func:`paged_decode` and
:func:`merge_partials` are NATURAL logs of the softmax denominator of the scaled
logits ``s_t = sm_scale * k_scale * (q . k_t_stored)``. Split-K partials
(:func:`splitk_partials`) use LOG2 units, exactly like the kernel's fp32 workspace.

The code is organised as

1. gathering pages  -- :func:`to_float64`, :func:`gather_kv`;
2. attention math   -- :func:`attention`, :func:`paged_decode`;
3. split-K          -- :func:`split_bounds`, :func:`splitk_partials`, :func:`merge_partials`;
4. comparison       -- :func:`round_to`, :func:`ulp_distance`,
   :func:`close_to_reference_mask`, :func:`assert_close_to_reference`,
   :func:`max_abs_v_read` and the constants :data:`ULP_BAR`, :data:`NEAR_ZERO_ABS`;
5. test problems    -- :func:`make_problem`, :class:`Problem`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import ml_dtypes
import numpy as np

from .policy import PD_MIN_KV_PER_SPLIT

__all__ = [
    "ULP_BAR",
    "NEAR_ZERO_ABS",
    "GARBAGE_PAGE_ID",
    "LAYOUTS",
    "to_float64",
    "gather_kv",
    "attention",
    "paged_decode",
    "split_bounds",
    "splitk_partials",
    "merge_partials",
    "round_to",
    "ulp_distance",
    "close_to_reference_mask",
    "assert_close_to_reference",
    "max_abs_v_read",
    "Problem",
    "make_problem",
]

LAYOUTS = ("NHD", "HND")

LOG2E = 1.0 / math.log(2.0)  # log2(e)
LN2 = math.log(2.0)  # ln(2)

#: Block-table filler for entries past a sequence's last page (see :func:`make_problem`).
#: It is far outside any page pool, so reading such an entry as a page id fails loudly.
GARBAGE_PAGE_ID = 0x3FFF_FFFF

BF16 = np.dtype(ml_dtypes.bfloat16)
FP16 = np.dtype(np.float16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


# --------------------------------------------------------------------------------------
# 1. Gathering pages
# --------------------------------------------------------------------------------------


def _check_layout(layout: str, arg_name: str) -> str:
    """Return ``"NHD"`` or ``"HND"`` (input is case-insensitive); else ValueError."""
    if isinstance(layout, str) and layout.upper() in LAYOUTS:
        return layout.upper()
    raise ValueError(f"{arg_name} must be 'NHD' or 'HND' (case-insensitive), got {layout!r}")


def _cache_geometry(cache: np.ndarray, layout: str, arg_name: str = "cache") -> tuple[int, int, int, int]:
    """``(num_pages, page_size, num_kv_heads, head_dim)`` of a 4-D cache in ``layout``."""
    if cache.ndim != 4:
        raise ValueError(f"{arg_name} must be 4-D, got shape {cache.shape}")
    if layout == "NHD":
        num_pages, page_size, num_kv_heads, head_dim = cache.shape
    else:
        num_pages, num_kv_heads, page_size, head_dim = cache.shape
    return num_pages, page_size, num_kv_heads, head_dim


def to_float64(a) -> np.ndarray:
    """Convert stored values to float64 exactly (no scale applied).

    ``uint8`` arrays are fp8 e4m3fn bit patterns and are reinterpreted as
    ``ml_dtypes.float8_e4m3fn`` first. Float dtypes (fp8, bf16, fp16, fp32, fp64)
    convert exactly. Any other dtype is a TypeError.
    """
    a = np.asarray(a)
    if a.dtype == np.uint8:
        a = a.view(FP8)
    if a.dtype not in (FP8, BF16, FP16, np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(
            f"unsupported dtype {a.dtype}: expected bfloat16, float16, float8_e4m3fn, "
            "uint8 (fp8 e4m3fn bits), float32 or float64"
        )
    return a.astype(np.float64)


def gather_kv(cache, block_tables, seq_lens, seq: int, layout: str) -> np.ndarray:
    """Gather one sequence's tokens out of a paged cache.

    Args:
        cache: 4-D paged cache, ``[num_pages, page_size, num_kv_heads, head_dim]``
            for ``"NHD"`` or ``[num_pages, num_kv_heads, page_size, head_dim]`` for
            ``"HND"``; any dtype accepted by :func:`to_float64`.
        block_tables: int ``[num_seqs, max_pages_per_seq]``.
        seq_lens: int ``[num_seqs]``.
        seq: which sequence.
        layout: ``"NHD"`` or ``"HND"`` (case-insensitive).

    Returns:
        float64 ``[seq_lens[seq], num_kv_heads, head_dim]``: the STORED values
        (fp8 bits decoded, no ``k_scale``/``v_scale`` applied -- the caller scales).

    Only the first ``ceil(seq_len / page_size)`` block-table entries are looked at;
    one of those outside ``[0, num_pages)`` raises IndexError (NumPy would silently
    wrap a negative id).
    """
    layout = _check_layout(layout, "layout")
    cache = np.asarray(cache)
    block_tables = np.asarray(block_tables)
    num_pages, page_size, _, _ = _cache_geometry(cache, layout)
    seq_len = int(np.asarray(seq_lens)[seq])
    if seq_len < 0:
        raise ValueError(f"seq_lens[{seq}] = {seq_len} is negative")
    n_used = -(-seq_len // page_size)  # ceil
    if n_used > block_tables.shape[1]:
        raise ValueError(
            f"seq_lens[{seq}] = {seq_len} needs {n_used} pages of {page_size} tokens but "
            f"block_tables has only {block_tables.shape[1]} columns"
        )
    pages = block_tables[seq, :n_used].astype(np.int64)
    bad = np.flatnonzero((pages < 0) | (pages >= num_pages))
    if bad.size:
        j = int(bad[0])
        raise IndexError(
            f"block_tables[{seq}, {j}] = {int(pages[j])} is outside the page pool "
            f"[0, {num_pages}) but is needed for seq_lens[{seq}] = {seq_len}"
        )
    t = np.arange(seq_len)
    page_of_t = pages[t // page_size]
    offset_of_t = t % page_size
    if layout == "NHD":
        gathered = cache[page_of_t, offset_of_t]  # [T, Hkv, D]
    else:
        # Two advanced indices separated by a slice: NumPy puts the broadcast index
        # axis first, giving [T, Hkv, D] as wanted.
        gathered = cache[page_of_t, :, offset_of_t]
    return to_float64(gathered)


# --------------------------------------------------------------------------------------
# 2. Attention math
# --------------------------------------------------------------------------------------


def attention(q_seq, k, v, sm_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Dense single-token attention for one sequence, in float64.

    Args:
        q_seq: ``[num_q_heads, head_dim]``.
        k, v: ``[T, num_kv_heads, head_dim]``, already dequantized (scales applied).
        sm_scale: multiplies ``q . k``.

    Returns:
        ``(out, lse)``: float64 ``[num_q_heads, head_dim]`` and float64
        ``[num_q_heads]``, where ``lse = ln(sum_t exp(sm_scale * q . k_t))`` (natural
        log). For ``T == 0``: ``out`` is zeros and ``lse`` is ``-inf``.

    Query head ``h`` attends with kv head ``h // (num_q_heads // num_kv_heads)``.
    """
    q_seq = to_float64(q_seq)
    k = to_float64(k)
    v = to_float64(v)
    num_q_heads, head_dim = q_seq.shape
    num_tokens, num_kv_heads, _ = k.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if num_tokens == 0:
        return np.zeros((num_q_heads, head_dim)), np.full(num_q_heads, -np.inf)
    group = num_q_heads // num_kv_heads
    q_grouped = q_seq.reshape(num_kv_heads, group, head_dim)  # [Hkv, G, D]
    logits = sm_scale * np.einsum("kgd,tkd->kgt", q_grouped, k)  # [Hkv, G, T]
    m = logits.max(axis=-1, keepdims=True)
    p = np.exp(logits - m)
    denom = p.sum(axis=-1)  # [Hkv, G]
    out = np.einsum("kgt,tkd->kgd", p, v) / denom[..., None]
    lse = m[..., 0] + np.log(denom)
    return out.reshape(num_q_heads, head_dim), lse.reshape(num_q_heads)


def _check_decode_args(q, k_cache, v_cache, block_tables, seq_lens, kv_layout):
    """Validate shapes shared by :func:`paged_decode` and :func:`splitk_partials`."""
    layout = _check_layout(kv_layout, "kv_layout")
    q = np.asarray(q)
    k_cache = np.asarray(k_cache)
    v_cache = np.asarray(v_cache)
    block_tables = np.asarray(block_tables)
    seq_lens = np.asarray(seq_lens)
    if q.ndim != 3:
        raise ValueError(f"q must be [num_seqs, num_q_heads, head_dim], got shape {q.shape}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache shape {k_cache.shape} != v_cache shape {v_cache.shape}")
    _, _, num_kv_heads, head_dim = _cache_geometry(k_cache, layout, "k_cache")
    num_seqs, num_q_heads, q_head_dim = q.shape
    if q_head_dim != head_dim:
        raise ValueError(f"q head_dim {q_head_dim} != cache head_dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_pages], got {block_tables.shape}")
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [num_seqs={num_seqs}], got {seq_lens.shape}")
    return layout, q, k_cache, v_cache, block_tables, seq_lens


def paged_decode(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    *,
    kv_layout: str = "NHD",
    sm_scale: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    return_lse: bool = False,
):
    """Reference paged decode: one query token per sequence over its paged KV cache.

    Args:
        q: ``[num_seqs, num_q_heads, head_dim]`` (bf16, fp16, fp32 or fp64).
        k_cache, v_cache: 4-D caches in ``kv_layout`` (see module docstring).
        block_tables: int ``[num_seqs, max_pages_per_seq]``.
        seq_lens: int ``[num_seqs]``.
        kv_layout: ``"NHD"`` or ``"HND"`` (case-insensitive).
        sm_scale: logit scale; default ``1 / sqrt(head_dim)``.
        k_scale, v_scale: per-tensor dequantization scales (dequantized = stored * scale).
        return_lse: also return the log-sum-exp.

    Returns:
        ``out`` float64 ``[num_seqs, num_q_heads, head_dim]``, and if ``return_lse``
        also ``lse`` float64 ``[num_seqs, num_q_heads]`` =
        ``ln(sum_t exp(sm_scale * k_scale * q . k_t_stored))`` (NATURAL log).
        A sequence of length 0 gives zeros and ``lse = -inf``.
    """
    layout, q, k_cache, v_cache, block_tables, seq_lens = _check_decode_args(
        q, k_cache, v_cache, block_tables, seq_lens, kv_layout
    )
    num_seqs, num_q_heads, head_dim = q.shape
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    out = np.zeros((num_seqs, num_q_heads, head_dim))
    lse = np.full((num_seqs, num_q_heads), -np.inf)
    for s in range(num_seqs):
        k = gather_kv(k_cache, block_tables, seq_lens, s, layout) * k_scale
        v = gather_kv(v_cache, block_tables, seq_lens, s, layout) * v_scale
        out[s], lse[s] = attention(q[s], k, v, sm_scale)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------
# 3. Split-K
# --------------------------------------------------------------------------------------


def split_bounds(seq_len: int, num_splits: int) -> list[tuple[int, int]]:
    """Token ranges of the ``num_splits`` splits of a sequence of ``seq_len`` tokens.

    ``chunk = max(ceil(seq_len / num_splits), PD_MIN_KV_PER_SPLIT)``; split ``i``
    covers ``[i * chunk, min((i + 1) * chunk, seq_len))``. Trailing splits may be
    empty; an empty split is reported as ``(seq_len, seq_len)`` (its begin is clamped
    too, so ``begin <= end`` always holds). The ranges tile ``[0, seq_len)`` in order
    with no overlap. This is the kernel's partitioning, shared with its dispatch.
    """
    seq_len = int(seq_len)
    num_splits = int(num_splits)
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    chunk = max(-(-seq_len // num_splits), PD_MIN_KV_PER_SPLIT)
    return [(min(i * chunk, seq_len), min((i + 1) * chunk, seq_len)) for i in range(num_splits)]


def splitk_partials(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    num_splits: int,
    *,
    kv_layout: str = "NHD",
    sm_scale: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> np.ndarray:
    """What the split-K kernel writes to its workspace, in float64.

    Returns float64 ``[num_seqs, num_q_heads, num_splits, head_dim + 2]``; the last
    axis is ``(o[0], ..., o[head_dim - 1], m, l)``. This is the kernel's slot order
    (slot ``(seq * num_q_heads + head) * num_splits + split``, ``head_dim + 2`` values
    each), so ``workspace.reshape(result.shape)`` compares directly.

    Per (seq, head, split) over the split's tokens ``t`` (:func:`split_bounds`):

    * ``x_t = (sm_scale * k_scale * log2(e)) * (q . k_t_stored)`` -- logits in LOG2 units;
    * ``m = max_t x_t``;
    * ``l = sum_t 2**(x_t - m)``;
    * ``o = v_scale * sum_t 2**(x_t - m) * v_t_stored / l`` (normalized within the split).

    An empty split has ``o = 0``, ``m = -inf``, ``l = 0``.
    """
    layout, q, k_cache, v_cache, block_tables, seq_lens = _check_decode_args(
        q, k_cache, v_cache, block_tables, seq_lens, kv_layout
    )
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = _cache_geometry(k_cache, layout)[2]
    group = num_q_heads // num_kv_heads
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    log2_scale = sm_scale * k_scale * LOG2E

    partials = np.zeros((num_seqs, num_q_heads, num_splits, head_dim + 2))
    partials[..., head_dim] = -np.inf  # m of an empty split; o and l stay 0
    for s in range(num_seqs):
        q_grouped = to_float64(q[s]).reshape(num_kv_heads, group, head_dim)
        k = gather_kv(k_cache, block_tables, seq_lens, s, layout)  # stored values
        v = gather_kv(v_cache, block_tables, seq_lens, s, layout)
        for i, (begin, end) in enumerate(split_bounds(int(seq_lens[s]), num_splits)):
            if begin == end:
                continue
            x = log2_scale * np.einsum("kgd,tkd->kgt", q_grouped, k[begin:end])  # [Hkv, G, T]
            m = x.max(axis=-1)
            p = np.exp2(x - m[..., None])
            l = p.sum(axis=-1)
            o = v_scale * np.einsum("kgt,tkd->kgd", p, v[begin:end]) / l[..., None]
            partials[s, :, i, :head_dim] = o.reshape(num_q_heads, head_dim)
            partials[s, :, i, head_dim] = m.reshape(num_q_heads)
            partials[s, :, i, head_dim + 1] = l.reshape(num_q_heads)
    return partials


def merge_partials(partials) -> tuple[np.ndarray, np.ndarray]:
    """Combine split-K partials, splits in the fixed order ``0 .. num_splits - 1``.

    Args:
        partials: ``[..., num_splits, head_dim + 2]`` as from :func:`splitk_partials`
            (``o``, then ``m`` in log2 units, then ``l``); any leading shape.

    Returns:
        ``(out, lse)``: float64 ``[..., head_dim]`` and ``[...]``. With
        ``M = max_i m_i``, ``w_i = l_i * 2**(m_i - M)``, ``L = sum_i w_i``:
        ``out = sum_i w_i * o_i / L`` and ``lse = (M + log2(L)) * ln(2)`` -- a
        NATURAL log, comparable with :func:`paged_decode`'s. If every split is empty
        (``M = -inf``): ``out = 0`` and ``lse = -inf``.
    """
    partials = np.asarray(partials, dtype=np.float64)
    head_dim = partials.shape[-1] - 2
    o = partials[..., :head_dim]  # [..., n, D]
    m = partials[..., head_dim]  # [..., n]
    l = partials[..., head_dim + 1]  # [..., n]
    big_m = m.max(axis=-1)  # [...]
    all_empty = np.isneginf(big_m)
    # The -inf - -inf trap: when every split is empty, M = -inf and m_i - M would be
    # NaN. Subtract a finite stand-in there instead, and give any empty split
    # (m_i = -inf) weight exactly 0, so no NaN can appear anywhere.
    safe_m = np.where(all_empty, 0.0, big_m)
    acc = np.zeros(o.shape[:-2] + (head_dim,))
    denom = np.zeros(big_m.shape)
    for i in range(partials.shape[-2]):  # fixed order 0..n-1
        m_i = m[..., i]
        w_i = np.where(np.isneginf(m_i), 0.0, l[..., i] * np.exp2(np.where(np.isneginf(m_i), 0.0, m_i - safe_m)))
        acc += w_i[..., None] * o[..., i, :]
        denom += w_i
    safe_denom = np.where(all_empty, 1.0, denom)
    out = np.where(all_empty[..., None], 0.0, acc / safe_denom[..., None])
    lse = np.where(all_empty, -np.inf, (safe_m + np.log2(safe_denom)) * LN2)
    return out, lse


# --------------------------------------------------------------------------------------
# 4. Rounding and comparison: the one tolerance
# --------------------------------------------------------------------------------------

#: A kernel output element passes if it is within ``ULP_BAR`` units in the last place
#: of the float64 reference rounded (to nearest even) to the output dtype.
ULP_BAR = 1

#: ...or if its absolute error is at most ``NEAR_ZERO_ABS * max|V|``, ``V`` being the
#: dequantized V values the kernel read. This is the single allowance for elements
#: near zero: each output is a convex combination of V rows accumulated in fp32, whose
#: rounding error is of order ``2**-24 * max|V|`` (times a small factor) regardless of
#: the size of the result. Where the result is tiny compared with ``max|V|``, one
#: bf16/fp16 ulp of it is smaller than that fp32 error, so an ulp bar would be
#: meaningless there. Away from zero the allowance is far below one ulp (bf16 ulp is
#: ``2**-8`` relative, fp16 ``2**-11``), so it never loosens the ulp bar.
#: ``2**-20 * max|V|`` is 16 fp32 ulps of ``max|V|``.
NEAR_ZERO_ABS = 2.0**-20

# (significand bits including the implicit one, smallest normal exponent, largest exponent)
_FORMATS = {
    BF16: (8, -126, 127),
    FP16: (11, -14, 15),
    np.dtype(np.float32): (24, -126, 127),
}


def round_to(x, dtype) -> np.ndarray:
    """Round float64 values to ``dtype`` (bf16, fp16 or fp32), round-to-nearest-even.

    The rounding is done once, from float64 (``ml_dtypes`` float64 -> bfloat16 goes
    through float32 and can round twice). Overflow goes to +-inf, NaN stays NaN, the
    sign of zero is kept, subnormals are produced where the format has them.
    """
    dtype = np.dtype(dtype)
    if dtype not in _FORMATS:
        raise TypeError(f"round_to supports bfloat16, float16 and float32, got {dtype}")
    precision, emin, emax = _FORMATS[dtype]
    x = np.asarray(x, dtype=np.float64)
    finite = np.isfinite(x)
    xf = np.where(finite, x, 0.0)
    _, exponent = np.frexp(xf)  # |x| in [2**(e-1), 2**e)
    # Spacing of the target format at |x|, never finer than its subnormal spacing.
    quantum_exp = np.maximum(exponent - precision, emin - precision + 1)
    rounded = np.ldexp(np.round(np.ldexp(xf, -quantum_exp)), quantum_exp)  # np.round: half to even
    max_finite = (2.0 - 2.0 ** (1 - precision)) * 2.0**emax
    rounded = np.where(np.abs(rounded) > max_finite, np.copysign(np.inf, rounded), rounded)
    rounded = np.where(finite, rounded, x)
    # Every value is now exactly representable, so this cast is exact.
    return rounded.astype(dtype)


def _ordered_ints(a: np.ndarray) -> np.ndarray:
    """Map float bit patterns onto a monotonic int64 line (+0 and -0 both map to 0)."""
    bits_dtype = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    bits = a.view(bits_dtype).astype(np.int64)
    sign = 1 << (8 * a.dtype.itemsize - 1)
    return np.where(bits & sign, -(bits & (sign - 1)), bits)


#: What :func:`ulp_distance` reports wherever either side is NaN.
ULP_NAN = 2**40


def ulp_distance(a, b) -> np.ndarray:
    """Elementwise distance in units in the last place between two float arrays.

    ``a`` and ``b`` must have the same dtype: bf16, fp16 (or fp32). Bit patterns are
    mapped to a monotonic integer line, so adjacent values are 1 apart, ``+0`` and
    ``-0`` are 0 apart, the two smallest subnormals of opposite sign are 2 apart, and
    the largest finite value is 1 from infinity. Where either side is NaN the result
    is :data:`ULP_NAN` (``2**40``, far beyond any finite distance).

    Returns int64 with the broadcast shape of ``a`` and ``b``.
    """
    a = np.asarray(a)
    b = np.asarray(b)
    if a.dtype != b.dtype:
        raise TypeError(f"ulp_distance needs equal dtypes, got {a.dtype} and {b.dtype}")
    if a.dtype not in _FORMATS:
        raise TypeError(f"ulp_distance supports bfloat16, float16 and float32, got {a.dtype}")
    dist = np.abs(_ordered_ints(a) - _ordered_ints(b))
    nan = np.isnan(a.astype(np.float64)) | np.isnan(b.astype(np.float64))
    return np.where(nan, ULP_NAN, dist)


def close_to_reference_mask(out, ref, *, v_absmax: float) -> np.ndarray:
    """Boolean mask of the elements of ``out`` that meet THE correctness bar.

    Args:
        out: kernel output, bf16 or fp16 (fp32 also accepted).
        ref: float64 reference of the same shape.
        v_absmax: ``max|V|`` over the dequantized V values actually read
            (:func:`max_abs_v_read`).

    An element passes iff it is not NaN, the reference is not NaN, and it is within
    :data:`ULP_BAR` ulp of ``round_to(ref, out.dtype)`` or its absolute error to
    ``ref`` is at most ``NEAR_ZERO_ABS * v_absmax``.
    """
    out = np.asarray(out)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        raise AssertionError(f"shape mismatch: kernel {out.shape} vs reference {ref.shape}")
    ulps = ulp_distance(out, round_to(ref, out.dtype))
    with np.errstate(invalid="ignore"):  # inf - inf gives NaN: a failure, as it should
        abs_err = np.abs(out.astype(np.float64) - ref)
        near_zero_ok = abs_err <= NEAR_ZERO_ABS * float(v_absmax)
    not_nan = ~np.isnan(out.astype(np.float64)) & ~np.isnan(ref)
    return not_nan & ((ulps <= ULP_BAR) | near_zero_ok)


def assert_close_to_reference(out, ref, *, v_absmax: float, what: str = "output") -> None:
    """Raise AssertionError unless every element meets :func:`close_to_reference_mask`.

    The message gives the number of failing elements, the worst ulp distance, its
    index, and the kernel value against the reference (float64 and rounded).
    """
    out = np.asarray(out)
    ref = np.asarray(ref, dtype=np.float64)
    ok = close_to_reference_mask(out, ref, v_absmax=v_absmax)
    if ok.all():
        return
    rounded = round_to(ref, out.dtype)
    ulps = np.where(ok, -1, ulp_distance(out, rounded))
    worst = np.unravel_index(int(np.argmax(ulps)), ulps.shape)
    n_bad = int((~ok).sum())
    worst_ulps = int(ulps[worst])
    worst_ulps_text = "NaN" if worst_ulps >= ULP_NAN else str(worst_ulps)
    raise AssertionError(
        f"{what}: {n_bad} of {ok.size} elements ({out.dtype}) miss the bar "
        f"(<= {ULP_BAR} ulp, or abs error <= {NEAR_ZERO_ABS:.3g} * max|V| = "
        f"{NEAR_ZERO_ABS * float(v_absmax):.6g}); worst {worst_ulps_text} ulp at index "
        f"{tuple(int(i) for i in worst)}: kernel {float(out[worst])!r} vs reference "
        f"{float(ref[worst])!r} (rounded {float(rounded[worst])!r})"
    )


def max_abs_v_read(v_cache, block_tables, seq_lens, *, kv_layout: str = "NHD", v_scale: float = 1.0) -> float:
    """``max|V|`` over the dequantized V values of the tokens actually attended to.

    That is ``|v_scale| * max |v_stored|`` over tokens ``t < seq_lens[s]`` of every
    sequence; 0.0 if no token is read. Feed it to :func:`assert_close_to_reference`.
    """
    layout = _check_layout(kv_layout, "kv_layout")
    best = 0.0
    for s in range(len(np.asarray(seq_lens))):
        v = gather_kv(v_cache, block_tables, seq_lens, s, layout)
        if v.size:
            best = max(best, float(np.abs(v).max()))
    return best * abs(float(v_scale))


# --------------------------------------------------------------------------------------
# 5. Random test problems
# --------------------------------------------------------------------------------------

_DTYPE_ALIASES = {
    "bf16": BF16,
    "bfloat16": BF16,
    "fp16": FP16,
    "float16": FP16,
    "half": FP16,
    "fp32": np.dtype(np.float32),
    "float32": np.dtype(np.float32),
    "fp8": FP8,
    "fp8_e4m3": FP8,
    "fp8_e4m3fn": FP8,
    "float8_e4m3fn": FP8,
    "uint8": np.dtype(np.uint8),
    "fp8_bits": np.dtype(np.uint8),
}


def _as_dtype(dtype) -> np.dtype:
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[dtype.lower()]
    return np.dtype(dtype)


@dataclass
class Problem:
    """A paged-decode problem, as NumPy arrays (see the module docstring for layouts).

    ``k_scale`` / ``v_scale`` are per-tensor floats (dequantized = stored * scale).
    """

    q: np.ndarray  # [num_seqs, num_q_heads, head_dim], q_dtype
    k_cache: np.ndarray  # 4-D in kv_layout, kv_dtype
    v_cache: np.ndarray  # 4-D in kv_layout, kv_dtype
    block_tables: np.ndarray  # int32 [num_seqs, max_pages_per_seq]
    seq_lens: np.ndarray  # int32 [num_seqs]
    k_scale: float
    v_scale: float
    kv_layout: str  # "NHD" or "HND"

    def reference(self, *, sm_scale: float | None = None, return_lse: bool = False):
        """:func:`paged_decode` on this problem."""
        return paged_decode(
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            kv_layout=self.kv_layout,
            sm_scale=sm_scale,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            return_lse=return_lse,
        )

    def v_absmax(self) -> float:
        """:func:`max_abs_v_read` on this problem."""
        return max_abs_v_read(
            self.v_cache, self.block_tables, self.seq_lens, kv_layout=self.kv_layout, v_scale=self.v_scale
        )


def _random_cache(rng: np.random.Generator, shape, dtype: np.dtype, scale: float | None):
    """Random cache contents ~ N(0, 1) after dequantization; returns (stored, scale).

    16/32-bit caches store the values directly (default scale 1.0). fp8 caches are
    quantized per tensor the way serving stacks do it: by default
    ``scale = max|x| / 448`` so the stored values span the whole e4m3 range; a given
    scale is honoured, with stored values clipped to +-448 (never NaN bits).
    """
    values = rng.standard_normal(shape)
    if dtype in (FP8, np.dtype(np.uint8)):
        if scale is None:
            scale = float(np.abs(values).max()) / FP8_MAX
        stored = np.clip(values / scale, -FP8_MAX, FP8_MAX).astype(FP8)
        return (stored.view(np.uint8) if dtype == np.uint8 else stored), float(scale)
    if dtype not in (BF16, FP16, np.dtype(np.float32)):
        raise TypeError(f"unsupported kv_dtype {dtype}")
    scale = 1.0 if scale is None else float(scale)
    return values.astype(dtype), scale


def make_problem(
    rng: np.random.Generator,
    *,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    seq_lens: int | Sequence[int],
    kv_dtype="bf16",
    q_dtype="bf16",
    layout: str = "NHD",
    num_pages: int | None = None,
    shuffle_pages: bool = True,
    share_prefix_pages: int = 0,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> Problem:
    """Build a random paged-decode problem, deterministically from ``rng``.

    Args:
        rng: ``numpy.random.Generator``; the same seed gives the same problem.
        seq_lens: one length for all sequences, or one per sequence (0 allowed).
        kv_dtype: ``"bf16"``, ``"fp16"``, ``"fp8"`` (``float8_e4m3fn``), ``"uint8"``
            (fp8 e4m3fn bits), ``"fp32"``, or the NumPy dtype itself.
        q_dtype: ``"bf16"``, ``"fp16"``, ``"fp32"`` or a dtype.
        layout: cache layout, ``"NHD"`` or ``"HND"``.
        num_pages: size of the page pool; default: the pages needed plus 2 unused.
        shuffle_pages: scatter pages randomly in the pool (else in order of use).
        share_prefix_pages: the first ``share_prefix_pages`` logical pages of every
            sequence (as many as it has) map to the same physical pages.
        k_scale, v_scale: dequantization scales. Default: 1.0 for 16/32-bit caches;
            for fp8, per-tensor calibration (``max|x| / 448``) so stored values span
            the e4m3 range while dequantized values are ~ N(0, 1).

    q is ~ N(0, 1). ``block_tables`` has one more column than the longest sequence
    needs; every entry past a sequence's last page is :data:`GARBAGE_PAGE_ID`, out of
    range of any pool, so a kernel reading one reads far outside the cache.
    """
    layout = _check_layout(layout, "layout")
    kv_dtype = _as_dtype(kv_dtype)
    q_dtype = _as_dtype(q_dtype)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    lens = np.broadcast_to(np.asarray(seq_lens, dtype=np.int64), (num_seqs,)).copy()
    if (lens < 0).any():
        raise ValueError(f"seq_lens must be >= 0, got {lens.tolist()}")
    pages_per_seq = -(-lens // page_size)  # ceil
    shared = min(share_prefix_pages, int(pages_per_seq.max(initial=0)))
    private_counts = np.maximum(pages_per_seq - shared, 0)
    needed = shared + int(private_counts.sum())
    if num_pages is None:
        num_pages = needed + 2
    if num_pages < needed:
        raise ValueError(f"num_pages={num_pages} is fewer than the {needed} pages needed")
    physical = rng.permutation(num_pages) if shuffle_pages else np.arange(num_pages)

    max_pages = int(pages_per_seq.max(initial=0)) + 1  # always at least one garbage column
    block_tables = np.full((num_seqs, max_pages), GARBAGE_PAGE_ID, dtype=np.int32)
    next_page = shared
    for s in range(num_seqs):
        n = int(pages_per_seq[s])
        n_shared = min(shared, n)
        block_tables[s, :n_shared] = physical[:n_shared]
        n_private = n - n_shared
        block_tables[s, n_shared:n] = physical[next_page : next_page + n_private]
        next_page += n_private

    if layout == "NHD":
        cache_shape = (num_pages, page_size, num_kv_heads, head_dim)
    else:
        cache_shape = (num_pages, num_kv_heads, page_size, head_dim)
    k_cache, k_scale = _random_cache(rng, cache_shape, kv_dtype, k_scale)
    v_cache, v_scale = _random_cache(rng, cache_shape, kv_dtype, v_scale)
    q = rng.standard_normal((num_seqs, num_q_heads, head_dim)).astype(q_dtype)
    return Problem(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        seq_lens=lens.astype(np.int32),
        k_scale=k_scale,
        v_scale=v_scale,
        kv_layout=layout,
    )
