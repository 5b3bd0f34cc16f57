"""Random paged-decode problems: the inputs the tests, the demo and the benchmarks run.

:func:`make_problem` builds a :class:`Problem` deterministically from a NumPy
``Generator``: q, a paged K/V cache in either layout and any supported dtype (fp8
calibrated per tensor the way serving stacks do it), block tables with shuffled and
optionally shared pages, and every block-table entry past a sequence's last page set
to :data:`GARBAGE_PAGE_ID`, so a kernel that reads one reads far outside the cache.
:meth:`Problem.reference` and :meth:`Problem.v_absmax` ask the oracle
(:mod:`metrale_attn.reference`) about the problem; judging a kernel's output is
:mod:`metrale_attn.tolerance`'s business. Shapes and layouts are the reference's
(see its module docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .reference import BF16, FP8, FP8_E5M2, FP16, check_layout, max_abs_logit, max_abs_v_read, paged_decode

__all__ = ["GARBAGE_PAGE_ID", "Problem", "make_problem"]

#: Block-table filler for entries past a sequence's last page (see :func:`make_problem`).
#: It is far outside any page pool, so reading such an entry as a page id fails loudly.
GARBAGE_PAGE_ID = 0x3FFF_FFFF

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_E5M2_MAX = 57344.0  # largest finite float8_e5m2

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
    "fp8_e5m2": FP8_E5M2,
    "fp8e5m2": FP8_E5M2,
    "float8_e5m2": FP8_E5M2,
    "uint8": np.dtype(np.uint8),
    "fp8_bits": np.dtype(np.uint8),
}


def _as_dtype(dtype) -> np.dtype:
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[dtype.lower()]
    return np.dtype(dtype)


@dataclass
class Problem:
    """A paged-decode problem, as NumPy arrays (layouts: the :mod:`metrale_attn.reference` docstring).

    ``k_scale`` / ``v_scale`` are per-tensor floats, or float32 arrays per KV head (dequantized = stored * scale).
    """

    q: np.ndarray  # [num_seqs, num_q_heads, head_dim], q_dtype
    k_cache: np.ndarray  # 4-D in kv_layout, kv_dtype
    v_cache: np.ndarray  # 4-D in kv_layout, kv_dtype
    block_tables: np.ndarray  # int32 [num_seqs, max_pages_per_seq]
    seq_lens: np.ndarray  # int32 [num_seqs]
    k_scale: float | np.ndarray  # per tensor, or float32 [num_kv_heads] (per_head_scales)
    v_scale: float | np.ndarray
    kv_layout: str  # "NHD" or "HND"

    def reference(self, *, sm_scale: float | None = None, return_lse: bool = False, q=None, **features):
        """:func:`paged_decode` on this problem (``q`` replaces the problem's, e.g. by a
        multi-token one; ``features``: ``window_left``, ``logits_soft_cap``, ``sinks``)."""
        return paged_decode(
            self.q if q is None else q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            kv_layout=self.kv_layout,
            sm_scale=sm_scale,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            return_lse=return_lse,
            v_head_dim=self.v_cache.shape[-1],
            **features,
        )

    def logit_absmax(self, *, sm_scale: float | None = None, q=None, logits_soft_cap: float | None = None,
                     sinks=None) -> float:
        """:func:`max_abs_logit` on this problem (``q`` replaces the problem's)."""
        return max_abs_logit(self.q if q is None else q, self.k_cache, self.block_tables, self.seq_lens,
                             kv_layout=self.kv_layout, sm_scale=sm_scale, k_scale=self.k_scale,
                             logits_soft_cap=logits_soft_cap, sinks=sinks)

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
    if dtype == FP8_E5M2:
        if scale is None:
            scale = float(np.abs(values).max()) / FP8_E5M2_MAX
        return np.clip(values / scale, -FP8_E5M2_MAX, FP8_E5M2_MAX).astype(FP8_E5M2), float(scale)
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
    per_head_scales: bool = False,
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
        per_head_scales: make ``k_scale`` and ``v_scale`` float32 arrays ``[num_kv_heads]``
            (the per-tensor scale times a factor in [0.5, 2) per KV head), as engines that
            calibrate per head keep them.

    q is ~ N(0, 1). ``block_tables`` has one more column than the longest sequence
    needs; every entry past a sequence's last page is :data:`GARBAGE_PAGE_ID`, out of
    range of any pool, so a kernel reading one reads far outside the cache.
    """
    layout = check_layout(layout, "layout")
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
    if per_head_scales:
        k_scale, v_scale = ((scale * rng.uniform(0.5, 2.0, num_kv_heads)).astype(np.float32)
                            for scale in (k_scale, v_scale))
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
