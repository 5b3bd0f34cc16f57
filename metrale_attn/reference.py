"""NumPy float64 reference for paged-decode attention: the oracle every kernel is checked against.

All math is float64; inputs may be bf16 (``ml_dtypes.bfloat16``), fp16 (``numpy.float16``),
fp8 e4m3 (``ml_dtypes.float8_e4m3fn``, or a ``uint8`` array holding its bits),
float32 or float64. This module computes; it does not judge (the bar an output must
meet is :mod:`metrale_attn.tolerance`) and it builds no inputs (random problems come
from :mod:`metrale_attn.problems`). It imports nothing of the package but the policy,
so it cannot share a mistake with the code it checks.

Layout summary (the same as ``DecodeAttention``'s):

* ``q``: ``[num_seqs, num_q_heads, head_dim]``.
* ``k_cache`` / ``v_cache``: ``"NHD"`` = ``[num_pages, page_size, num_kv_heads, head_dim]``
  (vLLM) or ``"HND"`` = ``[num_pages, num_kv_heads, page_size, head_dim]`` (FlashInfer).
  Values may be narrower than keys: ``v_cache``'s last dim is ``v_head_dim <= head_dim``
  (default ``head_dim``), and outputs are ``v_head_dim`` wide. ``v_cache`` may be the same
  array as ``k_cache`` (K = V) or a view of its first ``v_head_dim`` dims (MLA's absorbed
  decode: the 512 latent dims of each 576-wide row); the reference only reads.
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

1. gathering pages  -- :func:`check_layout`, :func:`to_float64`, :func:`gather_kv`;
2. attention math   -- :func:`attention`, :func:`paged_decode`;
3. split-K          -- :func:`split_bounds`, :func:`splitk_partials`, :func:`merge_partials`;
4. what was read    -- :func:`max_abs_v_read`, the ``max|V|`` the bar's near-zero
   allowance scales with.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from .policy import PD_MIN_KV_PER_SPLIT

__all__ = [
    "LAYOUTS",
    "check_layout",
    "to_float64",
    "gather_kv",
    "attention",
    "paged_decode",
    "split_bounds",
    "splitk_partials",
    "merge_partials",
    "merge_states",
    "max_abs_v_read",
]

LAYOUTS = ("NHD", "HND")

LOG2E = 1.0 / math.log(2.0)  # log2(e)
LN2 = math.log(2.0)  # ln(2)

BF16 = np.dtype(ml_dtypes.bfloat16)
FP16 = np.dtype(np.float16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_E5M2 = np.dtype(ml_dtypes.float8_e5m2)


# --------------------------------------------------------------------------------------
# 1. Gathering pages
# --------------------------------------------------------------------------------------


def check_layout(layout: str, arg_name: str) -> str:
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
    ``ml_dtypes.float8_e4m3fn`` first (view e5m2 bits as ``ml_dtypes.float8_e5m2``
    yourself). Float dtypes (fp8 e4m3fn and e5m2, bf16, fp16, fp32, fp64) convert
    exactly. Any other dtype is a TypeError.
    """
    a = np.asarray(a)
    if a.dtype == np.uint8:
        a = a.view(FP8)
    if a.dtype not in (FP8, FP8_E5M2, BF16, FP16, np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(
            f"unsupported dtype {a.dtype}: expected bfloat16, float16, float8_e4m3fn, float8_e5m2, "
            "uint8 (fp8 e4m3fn bits), float32 or float64"
        )
    return a.astype(np.float64)


def gather_kv(cache, block_tables, seq_lens, seq: int, layout: str, start: int = 0) -> np.ndarray:
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
        float64 ``[seq_lens[seq] - start, num_kv_heads, head_dim]``: the STORED values
        of tokens ``start .. seq_len - 1`` (fp8 bits decoded, no ``k_scale``/``v_scale``
        applied -- the caller scales).

    Only the block-table entries of those tokens' pages are looked at (a sliding
    window frees the pages before it); one of those outside ``[0, num_pages)`` raises
    IndexError (NumPy would silently wrap a negative id).
    """
    layout = check_layout(layout, "layout")
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
    start = min(max(int(start), 0), seq_len)
    needed = np.arange(n_used) >= start // page_size
    bad = np.flatnonzero(needed & ((pages < 0) | (pages >= num_pages)))
    if bad.size:
        j = int(bad[0])
        raise IndexError(
            f"block_tables[{seq}, {j}] = {int(pages[j])} is outside the page pool "
            f"[0, {num_pages}) but is needed for seq_lens[{seq}] = {seq_len}"
        )
    t = np.arange(start, seq_len)
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


def attention(q_seq, k, v, sm_scale: float, *, logits_soft_cap: float | None = None,
              sinks=None) -> tuple[np.ndarray, np.ndarray]:
    """Dense single-token attention for one sequence, in float64.

    Args:
        q_seq: ``[num_q_heads, head_dim]``.
        k: ``[T, num_kv_heads, head_dim]``; v: ``[T, num_kv_heads, v_head_dim]`` (``v_head_dim``
            may be narrower than ``head_dim``); both already dequantized (scales applied).
        sm_scale: multiplies ``q . k``.
        logits_soft_cap: ``s = cap * tanh(s / cap)`` on each scaled score, if given.
        sinks: ``[num_q_heads]`` sink logits (natural-log units of the scores, -inf for
            none) that join each head's softmax denominator with no value.

    Returns:
        ``(out, lse)``: float64 ``[num_q_heads, v_head_dim]`` and float64
        ``[num_q_heads]``, where ``lse = ln(e^sink + sum_t exp(s_t))`` (natural log,
        the sink term only with ``sinks``). For ``T == 0``: ``out`` is zeros and
        ``lse`` is ``-inf`` (the sink, with one).

    Query head ``h`` attends with kv head ``h // (num_q_heads // num_kv_heads)``.
    """
    q_seq = to_float64(q_seq)
    k = to_float64(k)
    v = to_float64(v)
    num_q_heads, head_dim = q_seq.shape
    num_tokens, num_kv_heads, _ = k.shape
    v_head_dim = v.shape[-1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    sink = None if sinks is None else np.asarray(sinks, np.float64).reshape(num_kv_heads, group)
    if num_tokens == 0:
        lse = np.full(num_q_heads, -np.inf) if sink is None else sink.reshape(num_q_heads).copy()
        return np.zeros((num_q_heads, v_head_dim)), lse
    q_grouped = q_seq.reshape(num_kv_heads, group, head_dim)  # [Hkv, G, D]
    logits = sm_scale * np.einsum("kgd,tkd->kgt", q_grouped, k)  # [Hkv, G, T]
    if logits_soft_cap is not None:
        logits = logits_soft_cap * np.tanh(logits / logits_soft_cap)
    m = logits.max(axis=-1)
    if sink is not None:
        m = np.maximum(m, sink)
    p = np.exp(logits - m[..., None])
    denom = p.sum(axis=-1)  # [Hkv, G]
    if sink is not None:
        denom = denom + np.exp(sink - m)
    out = np.einsum("kgt,tkd->kgd", p, v) / denom[..., None]
    lse = m + np.log(denom)
    return out.reshape(num_q_heads, v_head_dim), lse.reshape(num_q_heads)


def _check_decode_args(q, k_cache, v_cache, block_tables, seq_lens, kv_layout, v_head_dim=None):
    """Validate shapes shared by :func:`paged_decode` and :func:`splitk_partials`; returns the
    checked arrays and ``v_head_dim`` (None: ``head_dim``; else an int in ``1..head_dim`` that
    ``v_cache``'s last dim must equal)."""
    layout = check_layout(kv_layout, "kv_layout")
    q = np.asarray(q)
    k_cache = np.asarray(k_cache)
    v_cache = np.asarray(v_cache)
    block_tables = np.asarray(block_tables)
    seq_lens = np.asarray(seq_lens)
    if q.ndim not in (3, 4):
        raise ValueError(f"q must be [num_seqs, (q_len,) num_q_heads, head_dim], got shape {q.shape}")
    _, _, num_kv_heads, head_dim = _cache_geometry(k_cache, layout, "k_cache")
    if v_head_dim is None:
        v_head_dim = head_dim
    if isinstance(v_head_dim, bool) or not isinstance(v_head_dim, (int, np.integer)) or not 1 <= v_head_dim <= head_dim:
        raise ValueError(f"v_head_dim must be an int in 1..head_dim ({head_dim}), got {v_head_dim!r}")
    v_head_dim = int(v_head_dim)
    if k_cache.shape[:-1] != v_cache.shape[:-1] or v_cache.shape[-1] != v_head_dim:
        raise ValueError(f"v_cache shape {v_cache.shape} must be k_cache's {k_cache.shape} with v_head_dim "
                         f"{v_head_dim} as its last dim")
    num_seqs, num_q_heads, q_head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    if q_head_dim != head_dim:
        raise ValueError(f"q head_dim {q_head_dim} != cache head_dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_pages], got {block_tables.shape}")
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [num_seqs={num_seqs}], got {seq_lens.shape}")
    return layout, q, k_cache, v_cache, block_tables, seq_lens, v_head_dim


def per_head(scale) -> float | np.ndarray:
    """A dequantization scale as the reference applies it: a per-tensor float, or per KV head
    (an array of ``num_kv_heads``) as ``[num_kv_heads, 1]``, which broadcasts over a gathered
    ``[T, num_kv_heads, head_dim]`` block."""
    values = np.asarray(scale, np.float64)
    return float(values) if values.ndim == 0 else values.reshape(-1, 1)


def paged_decode(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    *,
    kv_layout: str = "NHD",
    sm_scale: float | None = None,
    k_scale=1.0,
    v_scale=1.0,
    return_lse: bool = False,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    sinks=None,
    v_head_dim: int | None = None,
):
    """Reference paged decode: each sequence's query tokens over its paged KV cache.

    Args:
        q: ``[num_seqs, num_q_heads, head_dim]``, or ``[num_seqs, q_len,
            num_q_heads, head_dim]`` for multi-token decode (bf16, fp16, fp32, fp64).
            Query token ``i`` of a sequence of length ``L`` (its keys, the q tokens'
            included) attends causally to positions ``< L - q_len + 1 + i``.
        k_cache, v_cache: 4-D caches in ``kv_layout`` (see module docstring); ``v_cache``'s
            last dim is ``v_head_dim``, its others are ``k_cache``'s.
        block_tables: int ``[num_seqs, max_pages_per_seq]``.
        seq_lens: int ``[num_seqs]``.
        kv_layout: ``"NHD"`` or ``"HND"`` (case-insensitive).
        sm_scale: logit scale; default ``1 / sqrt(head_dim)`` (the keys' head dim, whatever
            ``v_head_dim`` is).
        k_scale, v_scale: dequantization scales (dequantized = stored * scale): per tensor
            (a float), or per KV head (an array ``[num_kv_heads]``).
        return_lse: also return the log-sum-exp.
        window_left: a token at position ``p`` attends to ``[p - window_left, p]``
            (-1: no window); pages before every window are never looked at.
        logits_soft_cap, sinks: as :func:`attention` (sinks ``[num_q_heads]``).
        v_head_dim: the values' width, ``1..head_dim``; default ``head_dim``.

    Returns:
        ``out`` float64 with q's shape but ``v_head_dim`` as its last dim, and if ``return_lse`` also ``lse`` float64
        ``[num_seqs, (q_len,) num_q_heads]`` = ``ln(e^sink + sum_t exp(s_t))`` with
        ``s_t = sm_scale * k_scale * q . k_t_stored`` (soft-capped when asked;
        NATURAL log). A query token that sees no key gives zeros and ``lse = -inf``
        (the sink, with one).
    """
    layout, q, k_cache, v_cache, block_tables, seq_lens, v_head_dim = _check_decode_args(
        q, k_cache, v_cache, block_tables, seq_lens, kv_layout, v_head_dim
    )
    tokens = q if q.ndim == 4 else q[:, None]
    num_seqs, q_len, num_q_heads, head_dim = tokens.shape
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    out = np.zeros((num_seqs, q_len, num_q_heads, v_head_dim))
    lse = np.full((num_seqs, q_len, num_q_heads), -np.inf)
    for s in range(num_seqs):
        length = int(seq_lens[s])
        seen = [max(length - q_len + 1 + i, 0) for i in range(q_len)]  # causal: positions < seen[i]
        first = [max(n - 1 - window_left, 0) if window_left >= 0 else 0 for n in seen]
        start = min(first)
        k = gather_kv(k_cache, block_tables, seq_lens, s, layout, start) * per_head(k_scale)
        v = gather_kv(v_cache, block_tables, seq_lens, s, layout, start) * per_head(v_scale)
        for i in range(q_len):
            lo, hi = first[i] - start, max(seen[i] - start, first[i] - start)
            out[s, i], lse[s, i] = attention(tokens[s, i], k[lo:hi], v[lo:hi], sm_scale,
                                             logits_soft_cap=logits_soft_cap, sinks=sinks)
    if q.ndim == 3:
        out, lse = out[:, 0], lse[:, 0]
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------
# 3. Split-K
# --------------------------------------------------------------------------------------


def split_bounds(seq_len: int, num_splits: int) -> list[tuple[int, int]]:
    """Token ranges of the ``num_splits`` splits of a sequence of ``seq_len`` tokens.

    ``split_len = max(ceil(seq_len / num_splits), PD_MIN_KV_PER_SPLIT)``; split ``i``
    covers ``[i * split_len, min((i + 1) * split_len, seq_len))``. Trailing splits may be
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
    split_len = max(-(-seq_len // num_splits), PD_MIN_KV_PER_SPLIT)
    return [(min(i * split_len, seq_len), min((i + 1) * split_len, seq_len)) for i in range(num_splits)]


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
    k_scale=1.0,
    v_scale=1.0,
    v_head_dim: int | None = None,
) -> np.ndarray:
    """What the split-K kernel writes to its workspace, in float64 (``k_scale``, ``v_scale``
    per tensor or per KV head, as :func:`paged_decode` takes them).

    Returns float64 ``[num_seqs, num_q_heads, num_splits, v_head_dim + 2]`` (``v_head_dim``
    default ``head_dim``: the values' width); the last axis is ``(o[0], ..., o[v_head_dim -
    1], m, l)``. This is the kernel's slot order (slot ``(seq * num_q_heads + head) *
    num_splits + split``, ``v_head_dim + 2`` values each), so ``workspace.reshape(result.shape)``
    compares directly.

    Per (seq, head, split) over the split's tokens ``t`` (:func:`split_bounds`):

    * ``x_t = (sm_scale * k_scale * log2(e)) * (q . k_t_stored)`` -- logits in LOG2 units;
    * ``m = max_t x_t``;
    * ``l = sum_t 2**(x_t - m)``;
    * ``o = v_scale * sum_t 2**(x_t - m) * v_t_stored / l`` (normalized within the split).

    An empty split has ``o = 0``, ``m = -inf``, ``l = 0``.
    """
    layout, q, k_cache, v_cache, block_tables, seq_lens, v_head_dim = _check_decode_args(
        q, k_cache, v_cache, block_tables, seq_lens, kv_layout, v_head_dim
    )
    if q.ndim != 3:
        raise ValueError(f"splitk_partials takes one query token per sequence, got q of shape {q.shape}")
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = _cache_geometry(k_cache, layout)[2]
    group = num_q_heads // num_kv_heads
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    # per KV head as [Hkv, 1, 1] against the [Hkv, G, ...] blocks below (or a per-tensor float)
    k_heads, v_heads = (np.asarray(x, np.float64).reshape(-1, 1, 1) if np.ndim(x) else float(x)
                        for x in (k_scale, v_scale))
    log2_scale = sm_scale * k_heads * LOG2E

    partials = np.zeros((num_seqs, num_q_heads, num_splits, v_head_dim + 2))
    partials[..., v_head_dim] = -np.inf  # m of an empty split; o and l stay 0
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
            o = v_heads * np.einsum("kgt,tkd->kgd", p, v[begin:end]) / l[..., None]
            partials[s, :, i, :v_head_dim] = o.reshape(num_q_heads, v_head_dim)
            partials[s, :, i, v_head_dim] = m.reshape(num_q_heads)
            partials[s, :, i, v_head_dim + 1] = l.reshape(num_q_heads)
    return partials


def merge_partials(partials) -> tuple[np.ndarray, np.ndarray]:
    """Combine split-K partials, splits in the fixed order ``0 .. num_splits - 1``.

    Args:
        partials: ``[..., num_splits, head_dim + 2]`` as from :func:`splitk_partials`
            (``head_dim`` here is the values' width, ``v_head_dim`` there)
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


def merge_states(v_a, s_a, v_b, s_b) -> tuple[np.ndarray, np.ndarray]:
    """Merge two attention states of the same queries over disjoint keys, in float64.

    ``v_*``: ``[..., head_dim]`` normalized outputs; ``s_*``: ``[...]`` NATURAL-log
    softmax denominators (lse). Returns ``(v, s)`` of the union: ``M = max(s_a, s_b)``,
    ``w = exp(s - M)``, ``v = (w_a v_a + w_b v_b) / (w_a + w_b)``, ``s = M + ln(w_a +
    w_b)``; an empty state (``s = -inf``) weighs 0, two give ``v = 0``, ``s = -inf``.
    """
    v_a, v_b = to_float64(v_a), to_float64(v_b)
    s_a, s_b = np.asarray(s_a, np.float64), np.asarray(s_b, np.float64)
    m = np.maximum(s_a, s_b)
    empty = np.isneginf(m)
    safe = np.where(empty, 0.0, m)
    w_a, w_b = np.exp(s_a - safe), np.exp(s_b - safe)
    total = w_a + w_b
    ta = np.where((w_a > 0)[..., None], w_a[..., None] * np.nan_to_num(v_a), 0.0)
    tb = np.where((w_b > 0)[..., None], w_b[..., None] * np.nan_to_num(v_b), 0.0)
    v = np.where(empty[..., None], 0.0, (ta + tb) / np.where(empty, 1.0, total)[..., None])
    return v, np.where(empty, -np.inf, safe + np.log(np.where(empty, 1.0, total)))


# --------------------------------------------------------------------------------------
# 4. What the kernel read
# --------------------------------------------------------------------------------------


def _first_key(seq_len: int, q_len: int, window_left: int) -> int:
    """The first position any of a sequence's ``q_len`` query tokens sees (``paged_decode``'s
    rule); pages before it are never read."""
    return max(seq_len - q_len - window_left, 0) if window_left >= 0 else 0


def max_abs_logit(q, k_cache, block_tables, seq_lens, *, kv_layout: str = "NHD", sm_scale: float | None = None,
                  k_scale=1.0, logits_soft_cap: float | None = None, sinks=None,
                  window_left: int = -1) -> float:
    """``max|s|`` over the logits any query row's softmax can see (``s = sm_scale * k_scale
    * q . k_stored`` of the tokens from the first any query token's window reaches to
    ``seq_lens[s]``, soft-capped when asked; natural-log units) and the finite sinks: the
    logit magnitude the bar's near-zero allowance grows with (``logit_absmax`` of
    :func:`metrale_attn.tolerance.assert_close_to_reference`). Causality inside the range is
    ignored: an upper bound. 0.0 if nothing is seen."""
    layout, q, k_cache, _, block_tables, seq_lens, _ = _check_decode_args(q, k_cache, k_cache, block_tables,
                                                                          seq_lens, kv_layout)
    tokens = q if q.ndim == 4 else q[:, None]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(tokens.shape[-1])
    best = 0.0
    for s in range(tokens.shape[0]):
        start = _first_key(int(seq_lens[s]), tokens.shape[1], window_left)
        k = gather_kv(k_cache, block_tables, seq_lens, s, layout, start) * per_head(k_scale)  # [T, KV, D]
        if not k.size:
            continue
        q_seq = to_float64(tokens[s])  # [q_len, H, D]
        group = q_seq.shape[1] // k.shape[1]
        logits = sm_scale * np.einsum("ihd,thd->iht", q_seq, np.repeat(k, group, axis=1))
        if logits_soft_cap is not None:
            logits = logits_soft_cap * np.tanh(logits / logits_soft_cap)
        best = max(best, float(np.abs(logits).max()))
    if sinks is not None:
        finite = np.asarray(sinks, np.float64)
        finite = finite[np.isfinite(finite)]
        if finite.size:
            best = max(best, float(np.abs(finite).max()))
    return best


def max_abs_v_read(v_cache, block_tables, seq_lens, *, kv_layout: str = "NHD", v_scale=1.0,
                   window_left: int = -1, q_len: int = 1) -> float:
    """``max|V|`` over the dequantized V values of the tokens actually attended to.

    That is ``max |v_scale * v_stored|`` (``v_scale`` per tensor or per KV head) over the tokens of every
    sequence from the first
    its query tokens' windows reach (all, without a window) to ``seq_lens[s]``; 0.0 if no
    token is read. The bar's near-zero allowance scales with it (``v_absmax`` of
    :func:`metrale_attn.tolerance.assert_close_to_reference`).
    """
    layout = check_layout(kv_layout, "kv_layout")
    best = 0.0
    lens = np.asarray(seq_lens)
    for s in range(len(lens)):
        v = gather_kv(v_cache, block_tables, seq_lens, s, layout, _first_key(int(lens[s]), q_len, window_left))
        if v.size:
            best = max(best, float(np.abs(v * per_head(v_scale)).max()))
    return best
