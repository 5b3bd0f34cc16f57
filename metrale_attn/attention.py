"""``DecodeAttention``: the object a serving loop builds once and calls every decode step.

Construction resolves the target and policy, compiles (or loads cached) every
kernel the policy can reach, and allocates the split-K workspace once for
``max_batch`` rows. ``run`` validates cheaply on the host, looks up the memoized
plan for the batch size and launches; with ``out`` (and ``lse``) given it
allocates nothing and never synchronizes, so a CUDA graph can capture it.

One object owns one split-K workspace, so the launches of one call are serialized
per object (a lock), and on a GPU one object serves one stream at a time (see
``DecodeAttention``).
"""

from __future__ import annotations

import math
import numbers
import os
import threading
import warnings
from dataclasses import replace
from typing import Optional

import numpy as np

from . import dtypes, policy
from .backends import ArrayInfo, Launch, get_backend
from .kernels import Variant, kernel_params, source_constants
from .plan import (ENV_HEADS_PER_CTA, ENV_IMPL, LEGACY_MAX_DECODE_SEQS, MAX_Q_LEN, DecodePlan, ModelShape,
                   heads_per_cta_choices, make_plan, max_rows_per_cta, resolve_heads_per_cta, resolve_impl,
                   workspace_for)
from .targets import DEFAULT_TARGET, Defaults, detect_target, get_target, resolve_defaults

LAYOUTS = ("NHD", "HND")
LAUNCH_ARGUMENTS = {
    "q": "pointer", "q_stride_seq": "int", "q_stride_token": "int", "q_stride_head": "int",
    "k_cache": "pointer", "k_stride_page": "int", "k_stride_token": "int", "k_stride_head": "int",
    "v_cache": "pointer", "v_stride_page": "int", "v_stride_token": "int", "v_stride_head": "int",
    "block_tables": "pointer", "block_tables_stride": "int", "seq_lens": "pointer",
    "num_kv_heads": "int", "page_size": "int", "heads_per_cta": "int", "num_splits": "int",
    "q_len": "int", "window_left": "int",
    "qk_scale_log2": "float", "qk_scale": "float", "cap_log2": "float", "v_scale": "float",
    "sinks": "pointer", "out": "pointer", "lse": "pointer", "workspace": "pointer",
}
"""Every argument ``run`` can hand a kernel, by the parameter name the sources use (the
launch ABI is read from the sources; a test checks each kernel's names against this)."""
MAX_PAGE_SIZE = 256
LOG2E = 1.4426950408889634
VECTOR_BYTES = 16  # kernels load K/V and q rows with 16-byte vector loads
FP32_MAX = float(np.finfo(np.float32).max)  # 3.40282e+38
FP32_MIN_NORMAL = float(np.finfo(np.float32).tiny)  # 1.17549e-38
_FP32_RANGE = f"({FP32_MIN_NORMAL:.6g} .. {FP32_MAX:.6g})"


class StreamReuseWarning(RuntimeWarning):
    """``run`` launched on a second stream while the previous stream that used the same
    workspace still had work queued: the two calls may race on the split-K workspace.
    ``warnings.simplefilter("error", StreamReuseWarning)`` turns it into an error."""


class DecodeAttention:
    """Paged decode for one layer shape: ``out[s, h] = softmax(q[s, h] . K_s^T * sm_scale) V_s``.

    Shapes (elements): q and out ``[num_seqs, num_q_heads, head_dim]``; k_cache and
    v_cache ``[num_pages, page_size, num_kv_heads, head_dim]`` (``NHD``) or
    ``[num_pages, num_kv_heads, page_size, head_dim]`` (``HND``), addressed by
    strides, last dim contiguous; block_tables int32 ``[num_seqs, max_pages]``;
    seq_lens int32 ``[num_seqs]``; lse float32 ``[num_seqs, num_q_heads]``, the
    NATURAL log of the softmax denominator of the scaled logits.

    ``splitk`` (``"auto"``, ``"legacy"``, ``"off"``, ``"4"``, ...) and ``gqa_pack``
    override ``METRALE_ATTN_DECODE_SPLITK``/``METRALE_ATTN_DECODE_GQA_PACK`` and the
    target's declaration; ``None`` means as declared. ``impl`` (``"mma"``, the
    tensor-core kernels, default; ``"simt"``, the first CUDA-core ones) overrides
    ``METRALE_ATTN_DECODE_IMPL``. ``heads_per_cta`` (``mma``: query heads one CTA
    serves, a divisor of the group size up to 16) overrides
    ``METRALE_ATTN_DECODE_HEADS_PER_CTA`` and the plan's rule; a head's output bytes
    are the same for every value. ``max_decode_seqs`` is the
    floor of the reference batch only ``legacy`` reads. ``check_indices`` copies
    block_tables and seq_lens to the host on every call to prove every page id
    and length is in range (always on for the CPU backend). Integer arguments may
    be any ``numbers.Integral`` (NumPy integers too), never a bool.

    Features (``impl="mma"``; each compiles a specialization of the kernels, so the
    plain path pays nothing, and a feature a kernel cannot serve is refused, never
    ignored):

    * ``max_q_len`` (1..8): multi-token decode. ``run`` then takes q of shape
      ``[num_seqs, q_len, num_q_heads, head_dim]`` with ``q_len <= max_q_len``, and
      query token ``i`` of a sequence of length ``L`` (its keys, the q tokens'
      included) attends to positions ``< L - q_len + 1 + i``; out and lse have the q
      token axis too. Token ``i``'s bytes are those of a ``q_len = 1`` call on the first
      ``L - q_len + 1 + i`` keys (same split count), so they do not depend on ``q_len``.
    * ``window_left`` (-1: none): a token at position ``p`` attends to ``[p -
      window_left, p]`` (FlashInfer's convention). Split-K splits the window only;
      block-table entries of pages before every window are never read (may be -1).
    * ``logits_soft_cap`` (> 0, or None): ``s = cap * tanh(s / cap)`` on the scaled
      score before the softmax (Gemma 2/3).
    * ``sinks=True``: ``run(..., sinks=)`` takes a float32 ``[num_q_heads]`` array of
      per-head sink logits in natural-log units of the (capped) scaled scores, which
      join the softmax denominator and contribute no value (gpt-oss): ``out = sum_t
      e^{s_t} v_t / (e^{sink} + sum_t e^{s_t})``. Under split-K the sink enters once,
      in the merge. The returned lse includes it. A sink of -inf is no sink.
    * ``out_dtype="float32"``: fp32 out (e.g. partial states for ``merge_states``).
    * ``kv_dtype="fp8_e5m2"``: an fp8 e5m2 cache (``ml_dtypes.float8_e5m2`` or its
      ``uint8`` bits), with ``k_scale``/``v_scale`` as for e4m3.

    Outputs never share memory: ``out`` and ``lse`` may not overlap each other, any
    input, or the workspace, and that includes ``out`` being ``q`` itself. Exact
    aliasing happens to be safe for today's kernels (each CTA reads only its own
    heads' q rows before it writes their out rows, and the merge runs after the
    split kernel), but that is a property of the kernels' internals that no check
    keeps; a separate ``out`` costs ``num_seqs x num_q_heads x head_dim`` elements.

    Concurrency: one object owns one split-K workspace. Calls from several threads
    are safe: the launches of one call (split kernel and merge) run under one lock
    per object, so no call sees another's partials; validation runs outside it. On
    a GPU the lock orders the enqueueing only, so one object serves **one stream
    at a time**: a second stream may use it once the first has finished (or waits
    on it), else the two calls race on the workspace. Build one object per stream
    for concurrent streams. When a call launches on a different stream than the
    previous call, ``run`` asks the driver (``cudaStreamQuery``, only on that
    change, never while either stream is capturing a graph) whether the previous
    stream is still busy, and if so warns with ``StreamReuseWarning``. A warning,
    not an error: a caller may have ordered the streams with an event, which the
    driver cannot show us, and the previous stream may be busy with unrelated
    work; a graph replayed later is the caller's to order. The hot path (the same
    stream again) costs one identity comparison, and capture on one stream never
    queries anything.
    """

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        q_dtype,
        kv_dtype,
        kv_layout: str = "NHD",
        max_batch: int,
        target: Optional[str] = None,
        backend=None,
        splitk: Optional[str] = None,
        gqa_pack: Optional[bool] = None,
        sm_scale: Optional[float] = None,
        max_decode_seqs: int = LEGACY_MAX_DECODE_SEQS,
        check_indices: bool = False,
        impl: Optional[str] = None,
        heads_per_cta: Optional[int] = None,
        max_q_len: int = 1,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sinks: bool = False,
        out_dtype=None,
    ) -> None:
        self.shape = ModelShape(num_q_heads, num_kv_heads, head_dim)
        head_dim = self.shape.head_dim
        page_size = _int_in("page_size", page_size, 1, MAX_PAGE_SIZE)
        max_batch = _int_in("max_batch", max_batch, 1)
        max_decode_seqs = _int_in("max_decode_seqs", max_decode_seqs, 0)
        layout = str(kv_layout).strip().upper()  # trimmed, like every other string option
        if layout not in LAYOUTS:
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        self.page_size, self.max_batch, self.kv_layout = page_size, max_batch, layout
        self.max_decode_seqs = max_decode_seqs
        self.q_dtype = dtypes.canonical(q_dtype, argument="q_dtype", allowed=dtypes.Q_DTYPES)
        self.kv_dtype = dtypes.canonical(kv_dtype, argument="kv_dtype", allowed=dtypes.KV_DTYPES)
        self.sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else _positive("sm_scale", sm_scale)
        self.max_q_len = _int_in("max_q_len", max_q_len, 1, MAX_Q_LEN)
        self.window_left = _int_in("window_left", window_left, -1)
        self.logits_soft_cap = None if logits_soft_cap is None else _soft_cap(logits_soft_cap)
        if not isinstance(sinks, bool):
            raise TypeError(f"sinks must be a bool (whether run() takes sink logits), got {sinks!r}")
        self.sinks = sinks
        self.out_dtype = self.q_dtype if out_dtype is None else dtypes.canonical(
            out_dtype, argument="out_dtype", allowed=(self.q_dtype, dtypes.FLOAT32))
        self._features = frozenset(name for name, on in (
            ("win", self.window_left >= 0), ("cap", self.logits_soft_cap is not None), ("sink", sinks),
            ("of32", self.out_dtype == dtypes.FLOAT32)) if on)
        self._lock = threading.Lock()  # one call's launches at a time: they share the workspace
        self._last_stream = None  # the stream of the previous launch (GPU), for StreamReuseWarning

        self.backend = get_backend(backend) if backend is None or isinstance(backend, str) else backend
        self.defaults: Defaults = resolve_defaults(self._target(target), splitk=splitk, gqa_pack=gqa_pack)
        self.check_indices = check_indices or self.backend.always_check_indices
        self._device = self.backend.current_device()
        self.workspace_spec = workspace_for(
            self.defaults, self.shape, max_batch=max_batch, max_decode_seqs=max_decode_seqs,
            max_q_len=self.max_q_len)
        self.workspace = self._allocate_workspace()
        self._workspace_range = self.backend.describe(self.workspace, "workspace").byte_range()
        self._workspace_ptr = self.backend.pointer(self.workspace)
        self.impl = resolve_impl(impl, os.environ.get(ENV_IMPL))
        wanted = sorted(self._features | ({"mt"} if self.max_q_len > 1 else set()))
        if self.impl == "simt" and (wanted or self.kv_dtype == dtypes.FP8_E5M2):
            raise ValueError(f"impl='simt' has no {', '.join(wanted) or 'fp8 e5m2 cache'} (features: mt = "
                             "max_q_len > 1, win = window_left, cap = logits_soft_cap, sink = sinks, of32 = "
                             "out_dtype float32; fp8_e5m2 caches): use impl='mma'")
        if self.impl == "mma":
            disagree = self.backend.verify_mma()
            if disagree:  # never return bytes from instructions that differ from their emulation
                if wanted or self.kv_dtype == dtypes.FP8_E5M2:
                    raise RuntimeError(f"this device's {', '.join(disagree)} disagree with the emulation the mma "
                                       "kernels were verified on, and only they serve the features asked for")
                warnings.warn(f"metrale-attn: this device's {', '.join(disagree)} disagree with the emulation the "
                              "mma kernels were verified on; using impl='simt' instead", RuntimeWarning, stacklevel=2)
                self.impl = "simt"
        max_rows = max_rows_per_cta(head_dim)
        self.heads_per_cta = resolve_heads_per_cta(heads_per_cta, os.environ.get(ENV_HEADS_PER_CTA),
                                                   self.shape.group_size, self.max_q_len, max_rows)
        self._plans: dict[tuple[int, int], DecodePlan] = {}
        constants = source_constants()
        self._threads, self._merge_threads = constants.threads, constants.merge_threads
        # Compile every variant a call can reach now, so that run() never compiles:
        # legacy's split count only falls as the batch grows, so batch 1 and max_batch
        # bound the arms; the row tiles follow heads_per_cta x q_len, which may be any
        # choice; q_len > 1 takes the multi-token specialization.
        self._modules: dict[tuple[str, int, bool], tuple] = {}
        self._abi: dict[str, tuple] = {}  # kernel -> ((argument name, scalar type or None), ...)
        for q_len in range(1, self.max_q_len + 1):
            for plan in (self.plan(1, q_len), self.plan(max_batch, q_len)):
                if plan.impl == "simt" or plan.arm == "gqa_packed":
                    options = {plan.heads_per_cta}
                elif self.heads_per_cta is not None:
                    options = {self.heads_per_cta}
                else:
                    options = set(heads_per_cta_choices(self.shape.group_size, q_len, max_rows))
                for rt in sorted({replace(plan, heads_per_cta=h).row_tiles for h in options}):
                    key = (plan.arm, rt, q_len > 1)
                    if key not in self._modules:
                        variant = Variant(plan.arm, head_dim, self.q_dtype, self.kv_dtype, plan.impl, rt,
                                          self._features | ({"mt"} if q_len > 1 else set()))
                        self._modules[key] = (variant, self.backend.load(variant))
                        for kernel, params in kernel_params(variant).items():
                            self._abi[kernel] = tuple((p.name, None if p.is_pointer else p.numpy_type)
                                                      for p in params)

    def _target(self, name: Optional[str]):
        device = self.backend.device()
        if device is None:  # no GPU: the target's table stands in
            return get_target(name or DEFAULT_TARGET)
        if name is None:
            return detect_target(device.compute_capability, device.sm_count)
        return replace(get_target(name), sm_count=device.sm_count)

    def _allocate_workspace(self):
        spec = self.workspace_spec
        try:
            return self.backend.empty((spec.slots * spec.slot_floats,), np.float32)
        except MemoryError as err:  # CuPy's OutOfMemoryError is one too
            raise MemoryError(
                f"cannot allocate the split-K workspace of {spec.nbytes} bytes ({spec.slots} slots x "
                f"{spec.slot_floats} fp32) for max_batch={self.max_batch}, {self.shape.num_q_heads} q heads and "
                f"attn_decode_splitk={self.defaults.splitk.label()}: lower max_batch (the workspace grows "
                f"linearly with it) or pin fewer splits (splitk=)"
            ) from err

    def plan(self, num_seqs: int, q_len: int = 1) -> DecodePlan:
        """The memoized geometry of a call with ``num_seqs`` sequences of ``q_len`` query tokens."""
        plan = self._plans.get((num_seqs, q_len))
        if plan is None:
            if not 1 <= q_len <= self.max_q_len:
                raise ValueError(f"q_len must be in 1..max_q_len={self.max_q_len}, got {q_len!r}")
            plan = make_plan(self.defaults, self.shape, num_seqs, max_batch=self.max_batch,
                             max_decode_seqs=self.max_decode_seqs, workspace=self.workspace_spec,
                             impl=self.impl, heads_per_cta=self.heads_per_cta, q_len=q_len)
            self._plans[num_seqs, q_len] = plan
        return plan

    def target_line(self) -> str:
        """``target defaults (...): ...``, for logs and the CLI."""
        return self.defaults.line()

    def run(self, q, k_cache, v_cache, block_tables, seq_lens, *, k_scale: float = 1.0, v_scale: float = 1.0,
            out=None, return_lse: bool = False, lse=None, stream=None, sinks=None):
        """Decode one step. Returns ``out`` (and ``lse`` when ``return_lse`` or ``lse`` is given).

        q is ``[num_seqs, num_q_heads, head_dim]``, or ``[num_seqs, q_len, num_q_heads,
        head_dim]`` (``q_len <= max_q_len``); out and lse follow q's axes.
        ``k_scale``/``v_scale`` dequantize the cache: value = stored * scale (fp8
        mostly; any dtype). ``sinks``: float32 ``[num_q_heads]`` sink logits, given
        exactly when the object was built with ``sinks=True``. ``stream``: a CuPy or
        torch stream or a raw handle; ``None`` launches on torch's current stream for
        torch inputs, else on CuPy's. Errors name the argument and what was expected,
        and are raised before anything is launched: shapes, dtypes, strides (none
        negative), alignment, writable outputs that overlap nothing else (``out`` may
        not be ``q``), and scales whose folded fp32 values (``sm_scale * k_scale *
        log2(e)``, ``v_scale``; with the soft-cap ``sm_scale * k_scale / cap`` and ``cap *
        log2(e)``) are finite and normal. Thread-safe; one stream at a time on a GPU
        (see the class docstring).
        """
        be = self.backend
        H, D = self.shape.num_q_heads, self.shape.head_dim
        qi = be.describe(q, "q")
        if len(qi.shape) == 4 and qi.shape[2:] == (H, D) and 1 <= qi.shape[1] <= self.max_q_len:
            q_len = qi.shape[1]
            q_strides = qi.strides[:3]
        elif len(qi.shape) == 3 and qi.shape[1:] == (H, D):
            q_len = 1
            q_strides = (qi.strides[0], 0, qi.strides[1])
        else:
            tokens = f" or [num_seqs, q_len (1..{self.max_q_len}), {H}, {D}]" if self.max_q_len > 1 else ""
            raise ValueError(f"q must have shape [num_seqs, {H}, {D}]{tokens}, got {list(qi.shape)}")
        num_seqs = qi.shape[0]
        if num_seqs > self.max_batch:
            raise ValueError(f"q has {num_seqs} sequences but this DecodeAttention was built for max_batch="
                             f"{self.max_batch} (its workspace is sized for that)")
        _dtype(qi, "q", self.q_dtype)
        _vector_rows(qi, "q")
        ki, vi = be.describe(k_cache, "k_cache"), be.describe(v_cache, "v_cache")
        k_strides = self._cache_strides(ki, "k_cache")
        v_strides = self._cache_strides(vi, "v_cache")
        if ki.shape != vi.shape:
            raise ValueError(f"k_cache and v_cache must have the same shape, got {list(ki.shape)} and {list(vi.shape)}")
        bi, si = be.describe(block_tables, "block_tables"), be.describe(seq_lens, "seq_lens")
        _check_index_arrays(bi, si, num_seqs)
        k_scale, v_scale = _scales(self.sm_scale, k_scale, v_scale)
        qk_scale, cap_log2 = self._logit_scales(k_scale)
        sink_info = self._check_sinks(sinks)

        rows = (num_seqs, H) if len(qi.shape) == 3 else (num_seqs, q_len, H)
        if out is None:
            out = be.empty(rows + (D,), _OUT_NUMPY[self.out_dtype], like=q)
        oi = be.describe(out, "out")
        if oi.shape != rows + (D,) or (num_seqs and oi.strides != _contiguous(rows + (D,))):
            raise ValueError(f"out must be a contiguous {list(rows + (D,))} array, got shape {list(oi.shape)} "
                             f"strides {list(oi.strides)}")
        _dtype(oi, "out", self.out_dtype)
        _aligned(oi, "out")
        _writable(oi, "out")
        want_lse = return_lse or lse is not None
        if lse is None and want_lse:
            lse = be.empty(rows, np.float32, like=q)
        described, li = [qi, ki, vi, bi, si, oi], None
        if lse is not None:
            li = be.describe(lse, "lse")
            described.append(li)
            if li.shape != rows or (num_seqs and li.strides != _contiguous(rows)) or \
                    dtypes.name_of(li.dtype) != dtypes.FLOAT32:
                raise ValueError(f"lse must be a contiguous float32 {list(rows)} array, got {li.dtype} "
                                 f"{list(li.shape)} strides {list(li.strides)}")
            _writable(li, "lse")
        if sink_info is not None:
            described.append(sink_info)
        devices = {x.device for x in described}
        if devices != {self._device}:
            raise ValueError(f"q, k_cache, v_cache, block_tables, seq_lens, out, lse and sinks must all be on the "
                             f"device this DecodeAttention was built on ({_where(self._device)}), got "
                             f"{sorted(map(_where, devices))}")
        _refuse_overlaps((oi, li), (qi, ki, vi, bi, si), self._workspace_range)
        if self.check_indices:
            self._check_indices(block_tables, seq_lens, ki.shape[0], bi.shape[1], q_len)

        launch_stream = be.launch_stream(stream, like=q)
        plan = self.plan(num_seqs, q_len)
        if num_seqs:
            ptr = be.pointer
            args = dict(
                q=ptr(q, qi), q_stride_seq=q_strides[0], q_stride_token=q_strides[1], q_stride_head=q_strides[2],
                k_cache=ptr(k_cache, ki), k_stride_page=k_strides[0], k_stride_token=k_strides[1],
                k_stride_head=k_strides[2],
                v_cache=ptr(v_cache, vi), v_stride_page=v_strides[0], v_stride_token=v_strides[1],
                v_stride_head=v_strides[2],
                block_tables=ptr(block_tables, bi), block_tables_stride=bi.strides[0], seq_lens=ptr(seq_lens, si),
                num_kv_heads=self.shape.num_kv_heads, page_size=self.page_size, heads_per_cta=plan.heads_per_cta,
                q_len=q_len, window_left=self.window_left,
                qk_scale_log2=qk_scale, qk_scale=qk_scale, cap_log2=cap_log2, v_scale=v_scale,
                sinks=ptr(sinks, sink_info), out=ptr(out, oi), lse=ptr(lse, li), workspace=self._workspace_ptr,
                num_splits=plan.num_splits,
            )
            with launch_stream, self._lock:
                self._note_stream(be.current_stream())
                self._launch(plan, args)
        return (out, lse) if want_lse else out

    def _logit_scales(self, k_scale: float) -> tuple[float, float]:
        """``(qk_scale, cap_log2)`` the kernels take: ``sm_scale * k_scale * log2(e)`` and 0,
        or with the soft-cap ``sm_scale * k_scale / cap`` and ``cap * log2(e)``."""
        folded = self.sm_scale * k_scale
        if self.logits_soft_cap is None:
            return folded * LOG2E, 0.0
        pre, post = folded / self.logits_soft_cap, self.logits_soft_cap * LOG2E
        if not (_fp32_normal(pre) and _fp32_normal(post)):
            raise ValueError(f"with logits_soft_cap = {self.logits_soft_cap:.6g} the kernels scale q.k by sm_scale * "
                             f"k_scale / cap = {pre:.6g} and tanh by cap * log2(e) = {post:.6g}: both must be finite "
                             f"normal fp32 values {_FP32_RANGE}")
        return pre, post

    def _check_sinks(self, sinks) -> Optional[ArrayInfo]:
        """The sinks array's description, after checking it is what this object takes."""
        if not self.sinks:
            if sinks is not None:
                raise ValueError("sinks given, but this DecodeAttention was built without sinks: build it with "
                                 "sinks=True (a kernel without sinks would ignore them)")
            return None
        if sinks is None:
            raise ValueError(f"sinks must be given: this DecodeAttention was built with sinks=True (a float32 "
                             f"[{self.shape.num_q_heads}] array of sink logits; -inf for no sink)")
        info = self.backend.describe(sinks, "sinks")
        H = self.shape.num_q_heads
        if info.shape != (H,) or (H > 1 and info.strides != (1,)) or dtypes.name_of(info.dtype) != dtypes.FLOAT32:
            raise ValueError(f"sinks must be a contiguous float32 [{H}] array, got {info.dtype} {list(info.shape)} "
                             f"strides {list(info.strides)}")
        if info.device is None:  # host memory: the values are checked too (a device array would need a copy)
            values = np.asarray(sinks)
            bad = np.flatnonzero(np.isnan(values) | (values == np.inf))
            if bad.size:
                raise ValueError(f"sinks[{int(bad[0])}] = {values[bad[0]]}: sink logits must be finite or -inf")
        return info

    # -- helpers ------------------------------------------------------------

    def _cache_strides(self, info: ArrayInfo, argument: str) -> tuple[int, int, int]:
        """``(page, token, head)`` strides in elements of a cache, after checking its shape."""
        P_S, KV, D = self.page_size, self.shape.num_kv_heads, self.shape.head_dim
        expected = ("num_pages", P_S, KV, D) if self.kv_layout == "NHD" else ("num_pages", KV, P_S, D)
        if len(info.shape) != 4 or tuple(info.shape[1:]) != expected[1:]:
            raise ValueError(f"{argument} must be {self.kv_layout} [{', '.join(map(str, expected))}], "
                             f"got {list(info.shape)}")
        _dtype(info, argument, self.kv_dtype)
        _vector_rows(info, argument)
        s = info.strides
        return (s[0], s[1], s[2]) if self.kv_layout == "NHD" else (s[0], s[2], s[1])

    def _note_stream(self, stream) -> None:
        """Remember this launch's stream; on a change, warn if the previous one is busy.

        Called under the lock. The same stream again (the hot path, and every launch
        of a graph captured on one stream) costs one identity comparison.
        """
        previous, self._last_stream = self._last_stream, stream
        if stream is previous or previous is None or stream is None:
            return
        if self.backend.stream_busy(previous, stream):
            warnings.warn(
                f"DecodeAttention.run launches on stream {_stream_name(stream)} while stream "
                f"{_stream_name(previous)}, which launched into the same split-K workspace before, still has work "
                "queued: one DecodeAttention serves one stream at a time. Make this stream wait for the other "
                "(an event or a synchronize), or build one DecodeAttention per stream.",
                StreamReuseWarning, stacklevel=3)

    def _check_indices(self, block_tables, seq_lens, num_pages: int, max_pages: int, q_len: int = 1) -> None:
        """Every length in range, and every page id a call reads a page id: those of the
        pages the window of the first query token touches, to the sequence's end (pages
        before every window may be freed, e.g. -1)."""
        lens = np.asarray(self.backend.host_copy(seq_lens))
        table = np.asarray(self.backend.host_copy(block_tables))
        if max_pages == 0 and lens.any():
            s = int(np.flatnonzero(lens)[0])
            raise ValueError(f"block_tables has 0 columns but seq_lens[{s}] = {int(lens[s])}")
        capacity = max_pages * self.page_size
        bad = np.flatnonzero((lens < 0) | (lens > capacity))
        if bad.size:
            s = int(bad[0])
            raise ValueError(f"seq_lens[{s}] = {int(lens[s])} is outside 0..{capacity} "
                             f"(max_pages {max_pages} x page_size {self.page_size})")
        pages = np.arange(max_pages)[None, :]
        used = pages < -(-lens[:, None] // self.page_size)
        if self.window_left >= 0:
            first_key = np.maximum(lens[:, None] - q_len - self.window_left, 0)
            used &= pages >= first_key // self.page_size
        wild = used & ((table < 0) | (table >= num_pages))
        if wild.any():
            s, j = map(int, np.argwhere(wild)[0])
            raise ValueError(f"block_tables[{s}, {j}] = {int(table[s, j])} is not a page id in 0..{num_pages - 1}")

    def _launch(self, plan: DecodePlan, args: dict) -> None:
        """Launch ``plan``'s kernels, each with the parameters its source declares, by name."""
        variant, module = self._modules[plan.arm, plan.row_tiles, plan.q_len > 1]
        for i, grid in enumerate(plan.launches):
            values = tuple(args[name] if typ is None else typ(args[name]) for name, typ in self._abi[grid.kernel])
            if i == 0:  # the attention kernel
                module.launch(Launch(grid.kernel, grid.grid, (self._threads, 1, 1), variant.shared_bytes, values))
            else:  # the merge
                module.launch(Launch(grid.kernel, grid.grid, (self._merge_threads, 1, 1), 0, values))


def _where(device) -> str:
    return "host memory" if device is None else f"cuda:{device}"


def _stream_name(stream) -> str:
    handle = getattr(stream, "ptr", None)
    return f"{handle:#x}" if isinstance(handle, int) else repr(stream)


def _int_in(argument: str, value, low: int, high: Optional[int] = None) -> int:
    """``value`` as an int (any ``numbers.Integral``, not a bool) in ``low..high``."""
    checked = policy.as_int(value)
    if checked is None or checked < low or (high is not None and checked > high):
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{argument} must be an int {bound}, got {value!r}")
    return checked


def _check_index_arrays(bi: ArrayInfo, si: ArrayInfo, num_seqs: int) -> None:
    """block_tables int32 ``[num_seqs, max_pages]`` with rows of adjacent page ids (any
    strides when it has no columns); seq_lens contiguous int32 ``[num_seqs]``."""
    _forward_strides(bi, "block_tables")
    _forward_strides(si, "seq_lens")
    if len(bi.shape) != 2 or bi.shape[0] != num_seqs or dtypes.name_of(bi.dtype) != dtypes.INT32:
        raise ValueError(f"block_tables must be int32 [{num_seqs}, max_pages] with contiguous rows, got "
                         f"{bi.dtype} {list(bi.shape)}")
    if bi.shape[1] and bi.strides[1] != 1:
        raise ValueError(f"block_tables must be int32 [{num_seqs}, max_pages] with contiguous rows, got strides "
                         f"{list(bi.strides)} (a row's page ids must be adjacent: stride 1)")
    if len(si.shape) != 1 or si.shape[0] != num_seqs or dtypes.name_of(si.dtype) != dtypes.INT32:
        raise ValueError(f"seq_lens must be contiguous int32 [{num_seqs}], got {si.dtype} {list(si.shape)}")
    if num_seqs > 1 and si.strides[0] != 1:
        raise ValueError(f"seq_lens must be contiguous int32 [{num_seqs}], got a strided view (element stride "
                         f"{si.strides[0]}, not 1)")


def _forward_strides(info: ArrayInfo, argument: str) -> None:
    if info.strides and min(info.strides) < 0:
        raise ValueError(f"{argument} has negative strides {list(info.strides)}, which are not supported: pass a "
                         f"copy (np.ascontiguousarray) or a view with positive strides")


def _writable(info: ArrayInfo, argument: str) -> None:
    if not info.writable:
        raise ValueError(f"{argument} must be writable, got a read-only array")


_OUTPUTS = ("out", "lse")
_INPUTS = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "the split-K workspace")


def _refuse_overlaps(outputs: tuple, inputs: tuple, workspace: Optional[tuple[int, int]]) -> None:
    """``(out, lse)`` may share no byte with each other, an input ``(q, k_cache, v_cache,
    block_tables, seq_lens)`` or the workspace (``lse`` may be None).

    Ranges are hulls (``ArrayInfo.byte_range``): from an array's lowest element byte to
    its highest. Outputs are contiguous, so theirs are exact; a strided input's gaps
    count as its own, which refuses only layouts nobody uses (an output inside the
    gaps of a strided input). Exact aliasing (``out`` is ``q``) is refused too.
    """
    others = [info.byte_range() for info in inputs]
    others.append(workspace)
    names = _INPUTS
    for name, info in zip(_OUTPUTS, outputs):
        mine = None if info is None else info.byte_range()
        if mine is not None:
            for other, theirs in zip(names, others):
                if theirs is not None and mine[0] < theirs[1] and theirs[0] < mine[1]:
                    raise ValueError(
                        f"{name} overlaps {other} in memory (bytes {mine[0]:#x}..{mine[1]:#x} and {theirs[0]:#x}.."
                        f"{theirs[1]:#x}): outputs may share memory with nothing else, not even out with q; pass a "
                        f"separate {name}")
        others.insert(0, mine)  # later outputs are checked against this one too
        names = (name,) + names


def _dtype(info: ArrayInfo, argument: str, expected: str) -> None:
    name = dtypes.name_of(info.dtype)
    if expected in dtypes.FP8_KINDS and name == dtypes.FP8 and info.itemsize == 1 and _is_uint8(info.dtype):
        return  # uint8 bits of the declared fp8 kind
    if name != expected:
        raise ValueError(f"{argument} must hold {expected} values (as this DecodeAttention was built), got {info.dtype}")


def _aligned(info: ArrayInfo, argument: str) -> None:
    if info.ptr % VECTOR_BYTES:
        raise ValueError(f"{argument} must start on a {VECTOR_BYTES}-byte boundary for vector loads "
                         f"(address {info.ptr:#x})")


def _vector_rows(info: ArrayInfo, argument: str) -> None:
    """No negative strides; last dim contiguous; base and every other stride a multiple of 16 bytes."""
    _forward_strides(info, argument)
    if info.strides[-1] != 1:
        raise ValueError(f"{argument} must be contiguous in its last dim (stride 1), got strides {list(info.strides)}")
    _aligned(info, argument)
    per_vector = VECTOR_BYTES // info.itemsize
    odd = [s for s in info.strides[:-1] if s % per_vector]
    if odd:
        raise ValueError(f"{argument} strides must be multiples of {per_vector} elements ({VECTOR_BYTES} bytes) "
                         f"for vector loads, got {list(info.strides)}")


def _as_float(argument: str, value) -> float:
    """A real scale as a Python float; an integer beyond the float range is inf."""
    if type(value) is float:  # the common case, without the ABC check below
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{argument} must be a Python or NumPy float, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:  # float(10**400)
        return math.inf if value > 0 else -math.inf


def _positive(argument: str, value) -> float:
    as_float = _as_float(argument, value)
    if not math.isfinite(as_float) or as_float <= 0:
        raise ValueError(f"{argument} must be a finite float > 0, got {as_float}")
    return as_float


def _scales(sm_scale: float, k_scale, v_scale) -> tuple[float, float]:
    """``(k_scale, v_scale)`` as floats, after checking that they are > 0, that each is a
    per-tensor fp32 scale (a finite normal fp32 value, as serving stacks store them),
    and that the kernels' fp32 logit scale ``sm_scale * k_scale * log2(e)`` (logits in
    base 2) is one too.

    Past fp32's range the logits are inf and the output all NaN, with no error
    (``k_scale=1e39``; ``sm_scale=10`` with ``k_scale=3e38``); ``v_scale=1e39`` gives
    inf; a subnormal scale has lost its precision. Scales inside the range can still
    overflow the logits of large ``q . k`` products: the inputs' business.
    """
    k, v = _as_float("k_scale", k_scale), _as_float("v_scale", v_scale)
    for argument, value in (("k_scale", k), ("v_scale", v)):
        if not value > 0:  # NaN too
            raise ValueError(f"{argument} must be a finite float > 0, got {value}")
    folded = sm_scale * k * LOG2E
    if not (_fp32_normal(k) and _fp32_normal(folded)):
        raise ValueError(f"k_scale = {k:.6g} (with sm_scale = {sm_scale:.6g}, the kernels' logit scale sm_scale * "
                         f"k_scale * log2(e) = {folded:.6g}): both must be finite normal fp32 values {_FP32_RANGE}")
    if not _fp32_normal(v):
        raise ValueError(f"v_scale = {v:.6g} must be a finite normal fp32 value {_FP32_RANGE}: the kernels "
                         "multiply by it in fp32")
    return k, v


def _is_uint8(dtype) -> bool:
    return str(dtype) in ("uint8", "torch.uint8")


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides (elements) of ``shape``."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


_OUT_NUMPY = {**dtypes.NUMPY_DTYPES, dtypes.FLOAT32: np.dtype(np.float32)}


def _soft_cap(value) -> float:
    cap = _as_float("logits_soft_cap", value)
    if not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"logits_soft_cap must be a finite float > 0 (or None: no cap), got {value!r}")
    return cap


def _fp32_normal(value: float) -> bool:
    return FP32_MIN_NORMAL <= value <= FP32_MAX
