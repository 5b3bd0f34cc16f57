"""The checks of one call's arguments: each refusal names the argument and what was expected,
and happens before anything is launched.

Array checks read an array's description (``backends.ArrayInfo``), never its values
(values are read only by ``check_indices`` and ``check_sink_values``, on the host). Each
array argument of ``run`` has one checker in ``CHECKERS``: ``(config, info, rows) ->``
what the launch needs of it, where ``rows`` are out's leading dims, from q. The plain call's
checkers are here; a feature's arrays bring theirs in their record (``features.Array``). A
checker reads an array's address only modulo ``VECTOR_BYTES`` (alignment): ``binding`` relies
on that to keep a verdict for a buffer of the same layout at a moved address.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from . import dtypes
from .backends import ArrayInfo
from .config import FP32_MAX, FP32_MIN_NORMAL, LOG2E, LayerConfig, as_float, fp32_normal
from .features import (FEATURE_ARRAYS, INDEX_BYTES, MAX_SEQ_LEN, VECTOR_BYTES, aligned, empty,
                       forward_strides)

PLAIN_ARRAYS = ("q", "k_cache", "v_cache", "block_tables", "seq_lens")
"""The plain call's input arrays (the dense page table is absent where a feature replaces it)."""
ARRAY_ARGUMENTS = PLAIN_ARRAYS + tuple(a.name for a in FEATURE_ARRAYS) + ("out", "lse")
"""The array arguments of ``run``, in order: the plain inputs, every feature's arrays
(``features.FEATURE_ARRAYS``, absent without the feature), the outputs (``lse`` may be absent)."""
INPUTS = ARRAY_ARGUMENTS[:-2]
MAX_SINK = FP32_MAX / LOG2E  # the kernels hold sinks in base 2: a larger one overflows
_FP32_RANGE = f"({FP32_MIN_NORMAL:.6g} .. {FP32_MAX:.6g})"


# -- one array each: (config, description, out's leading dims) -> what the launch needs ----


def check_q(config: LayerConfig, qi: ArrayInfo, rows=None) -> tuple[int, ...]:
    """q ``[num_seqs, num_q_heads, head_dim]`` or ``[num_seqs, q_len, num_q_heads, head_dim]``;
    returns out's leading dims ``(num_seqs, num_q_heads)`` or ``(num_seqs, q_len, num_q_heads)``."""
    H, D, max_q_len = config.shape.num_q_heads, config.shape.head_dim, config.max_q_len
    if len(qi.shape) == 4 and qi.shape[2:] == (H, D) and 1 <= qi.shape[1] <= max_q_len:
        leading = qi.shape[:3]
    elif len(qi.shape) == 3 and qi.shape[1:] == (H, D):
        leading = qi.shape[:2]
    else:
        tokens = f" or [num_seqs, q_len (1..{max_q_len}), {H}, {D}]" if max_q_len > 1 else ""
        raise ValueError(f"q must have shape [num_seqs, {H}, {D}]{tokens}, got {list(qi.shape)}")
    num_seqs = qi.shape[0]
    if num_seqs > config.max_batch:
        raise ValueError(f"q has {num_seqs} sequences but this DecodeAttention was built for max_batch="
                         f"{config.max_batch} (its workspace is sized for that)")
    _dtype(qi, "q", config.q_dtype)
    _vector_rows(qi, "q")
    return tuple(leading)


def check_cache(config: LayerConfig, info: ArrayInfo, argument: str) -> tuple[int, int, int]:
    """``(page, token, head)`` strides in elements of a cache, after checking its shape: the last
    dim is ``head_dim`` (k_cache) or ``v_head_dim`` (v_cache, which may be a strided view of
    k_cache's first dims)."""
    P_S, KV = config.page_size, config.shape.num_kv_heads
    D = config.shape.v_head_dim if argument == "v_cache" else config.shape.head_dim
    expected = ("num_pages", P_S, KV, D) if config.kv_layout == "NHD" else ("num_pages", KV, P_S, D)
    if len(info.shape) != 4 or tuple(info.shape[1:]) != expected[1:]:
        narrow = (f" (its last dim is v_head_dim {D})" if argument == "v_cache"
                  and config.shape.v_head_dim != config.shape.head_dim else "")
        raise ValueError(f"{argument} must be {config.kv_layout} [{', '.join(map(str, expected))}]{narrow}, "
                         f"got {list(info.shape)}")
    _dtype(info, argument, config.kv_dtype)
    _vector_rows(info, argument)
    s = info.strides
    return (s[0], s[1], s[2]) if config.kv_layout == "NHD" else (s[0], s[2], s[1])


def check_block_tables(config: LayerConfig, bi: ArrayInfo, rows) -> None:
    """int32 ``[num_seqs, max_pages]`` with rows of adjacent page ids (any strides when it
    has no columns)."""
    num_seqs = rows[0]
    forward_strides(bi, "block_tables")
    if len(bi.shape) != 2 or bi.shape[0] != num_seqs or dtypes.name_of(bi.dtype) != dtypes.INT32:
        raise ValueError(f"block_tables must be int32 [{num_seqs}, max_pages] with contiguous rows, got "
                         f"{bi.dtype} {list(bi.shape)}")
    if not empty(bi) and bi.strides[1] != 1:
        raise ValueError(f"block_tables must be int32 [{num_seqs}, max_pages] with contiguous rows, got strides "
                         f"{list(bi.strides)} (a row's page ids must be adjacent: stride 1)")
    aligned(bi, "block_tables", INDEX_BYTES)


def check_seq_lens(config: LayerConfig, si: ArrayInfo, rows) -> None:
    """Contiguous int32 ``[num_seqs]``."""
    num_seqs = rows[0]
    forward_strides(si, "seq_lens")
    if len(si.shape) != 1 or si.shape[0] != num_seqs or dtypes.name_of(si.dtype) != dtypes.INT32:
        raise ValueError(f"seq_lens must be contiguous int32 [{num_seqs}], got {si.dtype} {list(si.shape)}")
    if num_seqs > 1 and si.strides[0] != 1:
        raise ValueError(f"seq_lens must be contiguous int32 [{num_seqs}], got a strided view (element stride "
                         f"{si.strides[0]}, not 1)")
    aligned(si, "seq_lens", INDEX_BYTES)


def check_out(config: LayerConfig, oi: ArrayInfo, rows) -> None:
    shape = rows + (config.shape.v_head_dim,)
    if oi.shape != shape or (rows[0] and oi.strides != contiguous(shape)):
        raise ValueError(f"out must be a contiguous {list(shape)} array, got shape {list(oi.shape)} "
                         f"strides {list(oi.strides)}")
    _dtype(oi, "out", config.out_dtype)
    aligned(oi, "out")
    writable(oi, "out")


def check_lse(config: LayerConfig, li: ArrayInfo, rows) -> None:
    if li.shape != rows or (rows[0] and li.strides != contiguous(rows)) or dtypes.name_of(li.dtype) != dtypes.FLOAT32:
        raise ValueError(f"lse must be a contiguous float32 {list(rows)} array, got {li.dtype} "
                         f"{list(li.shape)} strides {list(li.strides)}")
    writable(li, "lse")
    aligned(li, "lse", INDEX_BYTES)


CHECKERS = (
    check_q,
    lambda config, info, rows: check_cache(config, info, "k_cache"),
    lambda config, info, rows: check_cache(config, info, "v_cache"),
    check_block_tables,
    check_seq_lens,
    *(a.check for a in FEATURE_ARRAYS),
    check_out,
    check_lse,
)
"""One checker per ``ARRAY_ARGUMENTS`` entry, in order."""


# -- across arrays -----------------------------------------------------------------------


def check_together(k_info: ArrayInfo, v_info: ArrayInfo, outputs: tuple, inputs: tuple,
                   workspace: Optional[tuple[int, int]]) -> None:
    """The checks across arrays (each is on the layer's device already): the caches agree,
    and ``refuse_overlaps``."""
    if k_info.shape[:-1] != v_info.shape[:-1]:  # the last dims: head_dim and v_head_dim, each checked
        raise ValueError(f"k_cache and v_cache must have the same shape but the last dim (head_dim, v_head_dim), "
                         f"got {list(k_info.shape)} and {list(v_info.shape)}")
    refuse_overlaps(outputs, inputs, workspace)


def refuse_overlaps(outputs: tuple, inputs: tuple, workspace: Optional[tuple[int, int]]) -> None:
    """``(out, lse)`` may share no byte with each other, an input ``(q, k_cache, v_cache,
    block_tables, seq_lens, sinks)`` or the workspace, and no input may lie in the
    workspace (the kernels write their partials there mid-call); ``sinks`` and ``lse`` may
    be None. Each is given by its byte range (``ArrayInfo.byte_range``; None: empty or
    absent); ``workspace`` is that of every object sharing the caller's.

    Ranges are hulls: from an array's lowest element byte to its highest. Outputs are
    contiguous, so theirs are exact; a strided input's gaps count as its own, which
    refuses only layouts nobody uses (an output inside the gaps of a strided input).
    Exact aliasing (``out`` is ``q``) is refused too.
    """
    out, lse = outputs
    names = INPUTS + ("the split-K workspace",)
    spans = tuple(inputs) + (workspace,)
    for name, mine, others, theirs_all in (("out", out, names, spans), ("lse", lse, ("out",) + names, (out,) + spans)):
        for other, theirs in zip(others, theirs_all):
            if overlap(mine, theirs):
                raise ValueError(
                    f"{name} overlaps {other} in memory (bytes {mine[0]:#x}..{mine[1]:#x} and {theirs[0]:#x}.."
                    f"{theirs[1]:#x}): outputs may share memory with nothing else, not even out with q; pass a "
                    f"separate {name}")
    for name, span in zip(INPUTS, inputs):
        if overlap(span, workspace):
            raise ValueError(f"{name} lies in the split-K workspace (bytes {span[0]:#x}..{span[1]:#x} and "
                             f"{workspace[0]:#x}..{workspace[1]:#x}, the workspace of every object sharing it): "
                             f"the kernels write their partials there; pass {name} in its own memory")


def overlap(a: Optional[tuple[int, int]], b: Optional[tuple[int, int]]) -> bool:
    """Whether two byte ranges ``[first, end)`` share a byte (None: no bytes)."""
    return a is not None and b is not None and a[0] < b[1] and b[0] < a[1]


# -- scalars -----------------------------------------------------------------------------


def scales(sm_scale: float, k_scale, v_scale) -> tuple[float, float]:
    """``(k_scale, v_scale)`` as floats, after checking that they are > 0, that each is a
    per-tensor fp32 scale (a finite normal fp32 value, as serving stacks store them),
    and that the kernels' fp32 logit scale ``sm_scale * k_scale * log2(e)`` (logits in
    base 2) is one too.

    Past fp32's range the logits are inf and the output all NaN, with no error
    (``k_scale=1e39``; ``sm_scale=10`` with ``k_scale=3e38``); ``v_scale=1e39`` gives
    inf; a subnormal scale has lost its precision. Scales inside the range can still
    overflow the logits of large ``q . k`` products: the inputs' business.
    """
    k, v = as_float("k_scale", k_scale), as_float("v_scale", v_scale)
    for argument, value in (("k_scale", k), ("v_scale", v)):
        if not value > 0:  # NaN too
            raise ValueError(f"{argument} must be a finite float > 0, got {value}")
    folded = sm_scale * k * LOG2E
    if not (fp32_normal(k) and fp32_normal(folded)):
        raise ValueError(f"k_scale = {k:.6g} (with sm_scale = {sm_scale:.6g}, the kernels' logit scale sm_scale * "
                         f"k_scale * log2(e) = {folded:.6g}): both must be finite normal fp32 values {_FP32_RANGE}")
    if not fp32_normal(v):
        raise ValueError(f"v_scale = {v:.6g} must be a finite normal fp32 value {_FP32_RANGE}: the kernels "
                         "multiply by it in fp32")
    return k, v


def logit_scales(config: LayerConfig, k_scale: float) -> tuple[float, float]:
    """``(qk_scale, cap_log2)`` the kernels take: ``sm_scale * k_scale * log2(e)`` and 0,
    or with the soft-cap ``sm_scale * k_scale / cap`` and ``cap * log2(e)``."""
    folded = config.sm_scale * k_scale
    cap = config.logits_soft_cap
    if cap is None:
        return folded * LOG2E, 0.0
    pre, post = folded / cap, cap * LOG2E
    if not (fp32_normal(pre) and fp32_normal(post)):
        raise ValueError(f"with logits_soft_cap = {cap:.6g} the kernels scale q.k by sm_scale * "
                         f"k_scale / cap = {pre:.6g} and tanh by cap * log2(e) = {post:.6g}: both must be finite "
                         f"normal fp32 values {_FP32_RANGE}")
    return pre, post


# -- values, read on the host --------------------------------------------------------------


def check_values(config: LayerConfig, host, call, arrays: dict) -> None:
    """What ``check_indices`` proves on host copies (``host``: the backend's ``host_copy``) of a
    call's arrays (``arrays``: ``ARRAY_ARGUMENTS`` by name, None where absent; ``call``: the
    ``binding.BoundCall`` they were bound as): the page table's page ids and lengths
    (``check_indices``, a CSR table through ``dense_pages``), and the values of the layer's
    features' arrays that have a host check: its device scales (``check_scale_values``), its
    sinks (``check_sink_values``). A feature whose arrays' values need a host check adds it here."""
    def values(name: str) -> np.ndarray:
        return np.asarray(host(arrays[name]))

    if config.page_table == "csr":
        indptr = values("kv_indptr")
        table, lens = dense_pages(indptr, values("kv_indices"), values("kv_last_page_len"), config.page_size)
        check_indices(config, table, lens, call.num_pages, table.shape[1], call.q_len, indptr=indptr)
    else:
        check_indices(config, values("block_tables"), values("seq_lens"), call.num_pages, call.max_pages, call.q_len)
    if config.device_scales:
        check_scale_values(config, values("k_scales"), values("v_scales"))
    if config.sinks:
        check_sink_values(values("sinks"))


def check_sink_values(sinks) -> None:
    """Host sink logits are -inf or finite within ``MAX_SINK`` in magnitude: +inf or NaN
    would make every output NaN, and a larger finite one overflows the kernels' base-2
    sink. A torch parameter (requires_grad) is read through ``detach``."""
    values = np.asarray(sinks.detach() if hasattr(sinks, "detach") else sinks)
    bad = np.flatnonzero(np.isnan(values) | (values == np.inf) | (np.isfinite(values) & (np.abs(values) > MAX_SINK)))
    if bad.size:
        raise ValueError(f"sinks[{int(bad[0])}] = {values[bad[0]]}: sink logits must be -inf or finite with "
                         f"|sink| <= {MAX_SINK:.6g} (FLT_MAX / log2(e))")


def check_scale_values(config: LayerConfig, k_scales: np.ndarray, v_scales: np.ndarray) -> None:
    """Host copies of device scales hold what ``scales`` requires of host floats, value by
    value (``k_scales[h]`` named in the error)."""
    for argument, values in (("k_scales", k_scales), ("v_scales", v_scales)):
        for h, value in enumerate(np.asarray(values, np.float64).reshape(-1)):
            try:
                scales(config.sm_scale, float(value) if argument == "k_scales" else 1.0,
                       float(value) if argument == "v_scales" else 1.0)
                if argument == "k_scales":
                    logit_scales(config, float(value))
            except ValueError as err:
                raise ValueError(f"{argument}[{h}] = {value:.6g}: {err}") from None


def dense_pages(indptr: np.ndarray, indices: np.ndarray, last_page_len: np.ndarray,
                page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A CSR page table (host copies) as ``(block_tables, seq_lens)``, after checking what the
    kernels assume of it: ``indptr`` starts at 0 or more, never decreases and ends within
    ``indices``; a sequence with pages has 1 .. page_size tokens in its last page (``0`` is
    allowed only with no page). Rows are padded with -1 (never read: past every length)."""
    indptr, last = indptr.astype(np.int64), last_page_len.astype(np.int64)
    pages = np.diff(indptr)
    if indptr[0] < 0 or (pages < 0).any() or indptr[-1] > indices.shape[0]:
        raise ValueError(f"kv_indptr must start at >= 0, never decrease and end within kv_indices "
                         f"({indices.shape[0]} entries), got {indptr.tolist()[:8]}{'...' if len(indptr) > 8 else ''}")
    bad = np.flatnonzero(np.where(pages > 0, (last < 1) | (last > page_size), last != 0))
    if bad.size:
        s = int(bad[0])
        raise ValueError(f"kv_last_page_len[{s}] = {int(last[s])} must be in 1..{page_size} (page_size) for a sequence "
                         f"of {int(pages[s])} page(s), or 0 with none")
    lens = np.where(pages > 0, (pages - 1) * page_size + last, 0)
    check_lengths(lens, csr=True)
    table = np.full((len(pages), max(int(pages.max(initial=0)), 1)), -1, np.int64)
    for s, (a, n) in enumerate(zip(indptr[:-1], pages)):
        table[s, :n] = indices[a:a + n]
    return table, lens


def check_lengths(lens: np.ndarray, csr: bool) -> None:
    """Every length (int64 host values, of a dense or a CSR table) at most ``MAX_SEQ_LEN``:
    the one bound of a length the kernels hold in an int32, for both page-table forms
    (``check_indices`` applies it; ``dense_pages`` first, before it builds a table that long)."""
    long = np.flatnonzero(lens > MAX_SEQ_LEN)
    if long.size:
        s = int(long[0])
        what = (f"sequence {s}'s length (kv_indptr[{s + 1}] - kv_indptr[{s}] - 1) * page_size + kv_last_page_len[{s}]"
                if csr else f"seq_lens[{s}]")
        raise ValueError(f"{what} = {int(lens[s])} is past {MAX_SEQ_LEN} (2**31 - 1) tokens, the longest sequence "
                         "the kernels' int32 lengths hold")


def check_indices(config: LayerConfig, table: np.ndarray, lens: np.ndarray, num_pages: int, max_pages: int,
                  q_len: int = 1, indptr: Optional[np.ndarray] = None) -> None:
    """Every length in range (``check_lengths``: at most ``MAX_SEQ_LEN``, for both page-table
    forms), and every page id a call reads a page id: those of the
    pages the window of the first query token touches, to the sequence's end (pages
    before every window may be freed, e.g. -1). ``table`` and ``lens``: host copies (of a
    CSR table, ``dense_pages`` of it, and ``indptr`` to name the ``kv_indices`` entry)."""
    lens = lens.astype(np.int64)  # lens - q_len - window: no wrap
    page_size = config.page_size
    check_lengths(lens, csr=indptr is not None)
    if max_pages == 0 and lens.any():
        s = int(np.flatnonzero(lens)[0])
        raise ValueError(f"block_tables has 0 columns but seq_lens[{s}] = {int(lens[s])}")
    capacity = max_pages * page_size
    bad = np.flatnonzero((lens < 0) | (lens > capacity))
    if bad.size:
        s = int(bad[0])
        raise ValueError(f"seq_lens[{s}] = {int(lens[s])} is outside 0..{capacity} "
                         f"(max_pages {max_pages} x page_size {page_size})")
    pages = np.arange(max_pages)[None, :]
    used = pages < -(-lens[:, None] // page_size)
    if config.window_left >= 0:
        first_key = np.maximum(lens[:, None] - q_len - config.window_left, 0)
        used &= pages >= first_key // page_size
    wild = used & ((table < 0) | (table >= num_pages))
    if wild.any():
        s, j = map(int, np.argwhere(wild)[0])
        where = f"block_tables[{s}, {j}]" if indptr is None else f"kv_indices[{int(indptr[s]) + j}] (sequence {s}'s page {j})"
        raise ValueError(f"{where} = {int(table[s, j])} is not a page id in 0..{num_pages - 1}")


# -- helpers -------------------------------------------------------------------------------


def contiguous(shape: tuple) -> tuple:
    """C-contiguous strides (elements) of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def writable(info: ArrayInfo, argument: str) -> None:
    if not info.writable:
        raise ValueError(f"{argument} must be writable, got a read-only array")



def _dtype(info: ArrayInfo, argument: str, expected: str) -> None:
    name = dtypes.name_of(info.dtype)
    if expected in dtypes.FP8_KINDS and name == dtypes.FP8 and info.itemsize == 1 and _is_uint8(info.dtype):
        return  # uint8 bits of the declared fp8 kind
    if name != expected:
        raise ValueError(f"{argument} must hold {expected} values (as this DecodeAttention was built), got {info.dtype}")


def _vector_rows(info: ArrayInfo, argument: str) -> None:
    """No negative strides; last dim contiguous; base and every other stride a multiple of
    16 bytes (an empty array: nothing to check)."""
    if empty(info):
        return
    forward_strides(info, argument)
    if info.strides[-1] != 1:
        raise ValueError(f"{argument} must be contiguous in its last dim (stride 1), got strides {list(info.strides)}")
    aligned(info, argument)
    per_vector = VECTOR_BYTES // info.itemsize
    odd = [s for s in info.strides[:-1] if s % per_vector]
    if odd:
        raise ValueError(f"{argument} strides must be multiples of {per_vector} elements ({VECTOR_BYTES} bytes) "
                         f"for vector loads, got {list(info.strides)}")


def _is_uint8(dtype) -> bool:
    return str(dtype) in ("uint8", "torch.uint8")

