"""``DecodeAttention``: the object a serving loop builds once and calls every decode step.

Construction resolves the target and policy, compiles (or loads cached) every
kernel the policy can reach, and allocates the split-K workspace once for
``max_batch`` rows (or takes the caller's, which many objects may share:
``workspace_bytes`` sizes one for several layer shapes). ``run`` validates cheaply on the host, looks up the memoized
plan for the batch size and launches; with ``out`` (and ``lse``) given it
allocates nothing and never synchronizes, so a CUDA graph can capture it.

The objects that use one split-K workspace (one object's own, or a caller's shared
by many) serialize the launches of one call per workspace (a lock), and on a GPU
serve one stream at a time between them (see ``DecodeAttention``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import numbers
import os
import threading
import time
import warnings
import weakref
from dataclasses import replace
from typing import Optional

import numpy as np

from . import dtypes, policy
from .backends import ArrayInfo, Launch, get_backend
from .kernels import Variant, kernel_params, mma_smem_bytes, source_constants
from .plan import (ENV_HEADS_PER_CTA, ENV_IMPL, LEGACY_MAX_DECODE_SEQS, MAX_Q_LEN, DecodePlan, ModelShape,
                   heads_per_cta_choices, impl_chosen, make_plan, max_rows_per_cta, resolve_heads_per_cta,
                   resolve_impl, workspace_for)
from .targets import DEFAULT_TARGET, Defaults, Target, detect_target, get_target, resolve_defaults

logger = logging.getLogger(__name__)

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
ARRAY_ARGUMENTS = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "sinks", "out", "lse")
"""The array arguments of ``run``, in order; each is checked by ``DecodeAttention._check_<name>``."""
MAX_PAGE_SIZE = 256
MAX_WINDOW_LEFT = 2**31 - 1  # the kernels take window_left as an int32
INDEX_BYTES = 4  # int32 block tables and seq_lens, float32 lse and sinks: 4-byte loads and stores
LOG2E = 1.4426950408889634
VECTOR_BYTES = 16  # kernels load K/V and q rows with 16-byte vector loads
FP32_MAX = float(np.finfo(np.float32).max)  # 3.40282e+38
MAX_SINK = FP32_MAX / LOG2E  # the kernels hold sinks in base 2: a larger one overflows
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

    Workspace: by default each object allocates its own split-K workspace
    (``workspace_nbytes`` bytes). ``workspace=`` takes the caller's instead: an
    array on this object's device (any dtype, dense, writable, 16-byte aligned) of
    at least ``workspace_nbytes`` bytes, refused with both sizes when smaller.
    ``metrale_attn.workspace_bytes(shapes, max_batch=...)`` sizes one buffer for
    every layer shape of a model, so 80 layers of one shape, or several shapes,
    allocate once. Objects sharing a workspace write their partials into the same
    bytes, so **they must not run concurrently**: a decode step runs its layers one
    after another on one stream, which is exactly that.

    Concurrency: calls from several threads are safe: the launches of one call
    (split kernel and merge) run under one lock per workspace (shared by every
    object that uses it), so no call sees another's partials; validation runs
    outside it. On a GPU the lock orders the enqueueing only, so the objects of one
    workspace serve **one stream at a time**: a second stream may use it once the
    first has finished (or waits on it), else the two calls race on the
    workspace. Give each concurrent stream its own workspace (own objects).
    When a call launches on a different stream than the previous call into the
    workspace, ``run`` asks the driver (``cudaStreamQuery``, only on that
    change, never while either stream is capturing a graph) whether the previous
    stream is still busy, and if so warns with ``StreamReuseWarning`` (the previous
    stream is the workspace's: any object sharing it counts). A warning,
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
        workspace=None,
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
        self.window_left = _int_in("window_left", window_left, -1, MAX_WINDOW_LEFT)
        self.logits_soft_cap = _soft_cap(logits_soft_cap)
        if not isinstance(sinks, bool):
            raise TypeError(f"sinks must be a bool (whether run() takes sink logits), got {sinks!r}")
        self.sinks = sinks
        self.out_dtype = self.q_dtype if out_dtype is None else dtypes.canonical(
            out_dtype, argument="out_dtype", allowed=(self.q_dtype, dtypes.FLOAT32))
        self._features = frozenset(name for name, on in (
            ("win", self.window_left >= 0), ("cap", self.logits_soft_cap is not None), ("sink", sinks),
            ("of32", self.out_dtype == dtypes.FLOAT32)) if on)
        self.backend = get_backend(backend) if backend is None or isinstance(backend, str) else backend
        self.defaults: Defaults = resolve_defaults(self._target(target), splitk=splitk, gqa_pack=gqa_pack)
        self.check_indices = check_indices or self.backend.always_check_indices
        self._device = self.backend.current_device()
        self.workspace_spec = workspace_for(
            self.defaults, self.shape, max_batch=max_batch, max_decode_seqs=max_decode_seqs,
            max_q_len=self.max_q_len)
        self.workspace = self._allocate_workspace() if workspace is None else self._adopt_workspace(workspace)
        # A caller's torch tensor can lose its memory under us (resize_(0), set_()): checked every call.
        self._workspace_guard = None if workspace is None else _storage_guard(workspace, self.workspace_nbytes)
        info = self.backend.describe(self.workspace, "workspace")
        self._workspace_ptr = self.backend.pointer(self.workspace, info)
        # One call's launches at a time per workspace (they share its partials), whichever
        # objects share it; and the stream of its previous launch, for StreamReuseWarning.
        self._shared = _WorkspaceUsers.join(self._device, info.byte_range())
        self._seen: list = [None] * len(ARRAY_ARGUMENTS)  # per argument: the last buffer checked (_Seen)
        self._last: Optional[_Call] = None  # the last validated call, reused for the same buffers and scales
        with _HANDLES_LOCK:
            self._handle = next(_NEXT_HANDLE)
            _BY_HANDLE[self._handle] = self
        self._templates: dict = {}  # (plan, scalars, strides) -> per kernel typed values and pointer slots
        self._checkers = [getattr(type(self), f"_check_{name}") for name in ARRAY_ARGUMENTS]  # unbound: no cycle
        self.impl = resolve_impl(impl, os.environ.get(ENV_IMPL))
        wanted = sorted(self._features | ({"mt"} if self.max_q_len > 1 else set()))
        mma_only = bool(wanted) or self.kv_dtype == dtypes.FP8_E5M2  # what only the mma kernels serve
        if self.impl == "simt" and mma_only:
            raise ValueError(f"impl='simt' has no {', '.join(wanted) or 'fp8 e5m2 cache'} (features: mt = "
                             "max_q_len > 1, win = window_left, cap = logits_soft_cap, sink = sinks, of32 = "
                             "out_dtype float32; fp8_e5m2 caches): use impl='mma'")
        if self.impl == "mma":
            disagree = self.backend.verify_mma()
            if disagree:  # never return bytes from instructions that differ from their emulation
                if mma_only:
                    raise RuntimeError(f"this device's {', '.join(disagree)} disagree with the emulation the mma "
                                       "kernels were verified on, and only they serve the features asked for")
                _fall_back(f"this device's {', '.join(disagree)} disagree with the emulation the mma kernels were "
                           "verified on")
                self.impl = "simt"
        if self.impl == "mma":  # a kernel asking for more shared memory than the target has never launches
            need, target = mma_smem_bytes(head_dim, self.q_dtype, self.kv_dtype), self.defaults.target
            if need > target.smem_per_block:
                why = (f"the mma kernels of this shape ask for {need} bytes of shared memory per block; "
                       f"{target.name} (sm_{target.compute_capability[0]}{target.compute_capability[1]}) allows "
                       f"{target.smem_per_block}")
                if mma_only or impl_chosen(impl, os.environ.get(ENV_IMPL)):
                    raise ValueError(f"{why}: they cannot launch there (impl='simt' has no features and no e5m2)")
                _fall_back(why)
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
        variants: dict[tuple[str, int, bool], Variant] = {}
        for q_len in range(1, self.max_q_len + 1):
            for plan in (self.plan(1, q_len), self.plan(max_batch, q_len)):
                if plan.impl == "simt" or plan.arm == "gqa_packed":
                    options = {plan.heads_per_cta}
                elif self.heads_per_cta is not None:
                    options = {self.heads_per_cta}
                else:
                    options = set(heads_per_cta_choices(self.shape.group_size, q_len, max_rows))
                for rt in sorted({replace(plan, heads_per_cta=h).row_tiles for h in options}):
                    variants.setdefault((plan.arm, rt, q_len > 1), Variant(
                        plan.arm, head_dim, self.q_dtype, self.kv_dtype, plan.impl, rt,
                        self._features | ({"mt"} if q_len > 1 else set())))
        with _said_while_slow(f"compiling {len(variants)} kernel variant(s) for {self.defaults.target.arch} "
                              f"({', '.join(v.name for v in variants.values())})"):
            modules = self.backend.load_many(variants.values())
        self._modules = {key: (v, m) for (key, v), m in zip(variants.items(), modules)}  # (arm, rows, multi-token)
        self._abi: dict[str, tuple] = {}  # kernel -> ((argument name, scalar type or None), ...)
        for variant in variants.values():
            for kernel, params in kernel_params(variant).items():
                self._abi[kernel] = tuple((p.name, None if p.is_pointer else p.numpy_type) for p in params)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("DecodeAttention %d/%d/%d, page %d, %s, impl %s, max_batch %d: %s; batch 1: %s; batch %d: %s",
                         num_q_heads, num_kv_heads, head_dim, page_size, self.target_line(), self.impl, max_batch,
                         ", ".join(variants[k].name for k in variants), self.plan(1).reason, max_batch,
                         self.plan(max_batch).reason)

    def _target(self, name: Optional[str]) -> Target:
        return _resolve_target(self.backend, name)

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

    def _adopt_workspace(self, workspace):
        """A caller's workspace, after checking that it can hold this object's partials:
        on this object's device, dense, writable, 16-byte aligned, and at least
        ``workspace_nbytes`` bytes (any dtype: it is used as bytes)."""
        info = self.backend.describe(workspace, "workspace")
        span = info.byte_range()
        nbytes = 0 if span is None else span[1] - span[0]
        if info.device != self._device:
            raise ValueError(f"workspace must be on the device this DecodeAttention is built on "
                             f"({_where(self._device)}), got {_where(info.device)}")
        if span is not None and (nbytes != math.prod(info.shape) * info.itemsize or span[0] != info.ptr):
            raise ValueError(f"workspace must be a dense array (no gaps, no negative strides), got shape "
                             f"{list(info.shape)} strides {list(info.strides)}")
        _writable(info, "workspace")
        _aligned(info, "workspace")
        need = self.workspace_spec
        if nbytes < need.nbytes:
            raise ValueError(
                f"workspace too small: it has {nbytes} bytes, but this DecodeAttention needs {need.nbytes} bytes "
                f"({need.slots} slots x {need.slot_floats} fp32 for max_batch={self.max_batch}, "
                f"{self.shape.num_q_heads} q heads, attn_decode_splitk={self.defaults.splitk.label()}); size one "
                "for every layer shape with metrale_attn.workspace_bytes(...)")
        return workspace

    @property
    def workspace_nbytes(self) -> int:
        """Bytes of split-K workspace this object needs (``workspace_spec``: slots x
        ``head_dim + 2`` fp32); a workspace passed to the constructor must hold at least
        this many (``policy.workspace_slots``, which reserves slots even for a pinned
        single split)."""
        return self.workspace_spec.nbytes

    @property
    def handle(self) -> int:
        """An int naming this object for ``torch.ops.metrale_attn.paged_decode`` (see
        ``metrale_attn.torch_op``): ``DecodeAttention.from_handle(attn.handle) is attn``
        while the object lives. Assigned at construction, so reading it is one attribute
        read (``torch.compile`` traces it as a constant). The registry holds objects
        weakly: keep the object (as a layer keeps its attention state) for as long as a
        compiled graph may call it."""
        return self._handle

    @staticmethod
    def from_handle(handle: int) -> "DecodeAttention":
        """The live object whose ``handle`` is ``handle``; a ValueError if there is none (a
        bool is not a handle: ``True == 1``)."""
        if isinstance(handle, bool) or not isinstance(handle, numbers.Integral):
            raise TypeError(f"a handle is the int attn.handle, got {handle!r}")
        attn = _BY_HANDLE.get(int(handle))
        if attn is None:
            raise ValueError(f"no live DecodeAttention has handle {handle!r} (handles come from attn.handle; the "
                             "registry holds objects weakly, so the object must be kept alive by its owner)")
        return attn

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

        Host cost: every check holds for every call, but a call whose arrays are the
        same buffers as the previous call's (same pointer, shape, strides, dtype; the
        backend's ``fingerprint``) and whose scales are the same floats reuses that
        call's validated launches; an array that changed is described and checked
        again on its own, then the checks across arrays (overlaps) run again.
        The object keeps the last call's arrays alive until the next call.
        """
        want_lse = return_lse or lse is not None
        if out is None or (want_lse and lse is None):
            out, lse = self._allocate_outputs(q, out, lse, want_lse)
        arrays = (q, k_cache, v_cache, block_tables, seq_lens, sinks, out, lse)
        fingerprint = self.backend.fingerprint
        prints = (fingerprint(q), fingerprint(k_cache), fingerprint(v_cache), fingerprint(block_tables),
                  fingerprint(seq_lens), _ABSENT if sinks is None else fingerprint(sinks), fingerprint(out),
                  _ABSENT if lse is None else fingerprint(lse))
        last = self._last
        if self._workspace_guard is not None:
            self._workspace_guard()
        if (last is not None and last.prints == prints and last.k_scale == k_scale and last.v_scale == v_scale
                and type(k_scale) is float and type(v_scale) is float  # noqa: E721  (True == 1.0: types too)
                and last.workspace_span is self._shared.span):  # no object joined the workspace since
            call = last
        else:
            call = self._validate(arrays, prints, k_scale, v_scale)
            self._last = call if None not in prints else None
        if self.check_indices:
            self._check_indices(block_tables, seq_lens, call.num_pages, call.max_pages, call.q_len)
        if sinks is not None and self._device is None:  # host values: read on every call, like the indices
            _check_sink_values(sinks)
        launch_stream = self.backend.launch_stream(stream, like=q)
        if call.launches:
            shared = self._shared
            with launch_stream, shared.lock:
                self._note_stream(self.backend.current_stream())
                for module, launch in call.launches:
                    module.launch(launch)
        return (out, lse) if want_lse else out

    # -- one call: validate, then build the launches --------------------------

    def _validate(self, arrays: tuple, prints: tuple, k_scale, v_scale) -> "_Call":
        """Check a call's arguments and build its launches: every check of every argument.

        ``arrays`` are ``ARRAY_ARGUMENTS`` in order (``sinks`` and ``lse`` may be None). Each array is
        described and checked by its own checker (``_check_<name>``) unless it is the
        buffer the same argument was checked as last time (``prints``: the backend's
        fingerprints; None: unknown, check); then the checks across arrays run, and the
        scalars'. A new array argument is one entry in ``ARRAY_ARGUMENTS``, a
        ``_check_<name>`` method and its entry in ``_launch_args``; a new scalar, one
        check below and its entry in ``_launch_args``.
        """
        q_seen = self._checked(0, arrays[0], prints[0], None)
        rows = q_seen.derived  # out's leading dims: (num_seqs, num_q_heads) or (num_seqs, q_len, num_q_heads)
        if (arrays[5] is None) == self.sinks:
            self._refuse_sinks()
        seen = [q_seen] + [None if a is None else self._checked(i, a, prints[i], rows)
                           for i, a in enumerate(arrays[1:], 1)]
        self._check_together(seen)
        k_scale, v_scale = _scales(self.sm_scale, k_scale, v_scale)
        qk_scale, cap_log2 = self._logit_scales(k_scale)
        # simt kernels take qk_scale_log2, mma ones qk_scale (the same value without a cap)
        scalars = dict(qk_scale_log2=qk_scale, qk_scale=qk_scale, cap_log2=cap_log2, v_scale=v_scale)
        num_seqs, q_len = rows[0], (rows[1] if len(rows) == 3 else 1)
        plan = self.plan(num_seqs, q_len)
        launches = self._launches(plan, seen, scalars) if num_seqs else ()
        return _Call(prints, k_scale, v_scale, launches, seen[1].info.shape[0], seen[3].info.shape[1], q_len, seen,
                     self._shared.span)

    def _launch_args(self, plan: DecodePlan, seen: list, scalars: dict) -> dict:
        """Every kernel parameter of this call (``LAUNCH_ARGUMENTS``) by name: pointers
        from the checked arrays, strides and scalars; each kernel takes the ones its
        source declares (``_launches``). Values other than the arrays' pointers may
        depend only on the plan, the scalars, the arrays' strides and the object's own
        configuration: ``_launches`` keeps one template per such set."""
        q, k, v, bt, sl, sk, out, lse = seen
        qs = q.info.strides
        q_strides = qs[:3] if len(qs) == 4 else (qs[0], 0, qs[1])  # (seq, token, head)
        return dict(
            q=q.pointer, q_stride_seq=q_strides[0], q_stride_token=q_strides[1], q_stride_head=q_strides[2],
            k_cache=k.pointer, k_stride_page=k.derived[0], k_stride_token=k.derived[1], k_stride_head=k.derived[2],
            v_cache=v.pointer, v_stride_page=v.derived[0], v_stride_token=v.derived[1], v_stride_head=v.derived[2],
            block_tables=bt.pointer, block_tables_stride=bt.info.strides[0], seq_lens=sl.pointer,
            num_kv_heads=self.shape.num_kv_heads, page_size=self.page_size, heads_per_cta=plan.heads_per_cta,
            q_len=plan.q_len, window_left=self.window_left,
            sinks=self.backend.pointer(None) if sk is None else sk.pointer,
            out=out.pointer, lse=self.backend.pointer(None) if lse is None else lse.pointer,
            workspace=self._workspace_ptr, num_splits=plan.num_splits, **scalars,
        )

    def _launches(self, plan: DecodePlan, seen: list, scalars: dict) -> tuple:
        """``plan``'s launches ``((module, Launch), ...)``, each with the parameters its
        source declares, by name (``_launch_args``).

        Built once per plan, scalars and strides as a template: each kernel's typed
        values (NumPy scalars of the ABI's types) with a slot per array pointer; a call
        with new buffers of the same strides only fills the slots."""
        key = (id(plan), *scalars.values(), *[None if x is None else x.info.strides for x in seen])
        template = self._templates.get(key)
        if template is None:
            if len(self._templates) >= _MAX_TEMPLATES:  # strides of many cache views: start over
                self._templates.clear()
            template = self._templates[key] = self._launch_template(plan, seen, self._launch_args(plan, seen, scalars))
        launches = []
        for module, kernel, grid, block, shared, values, slots in template:
            values = values.copy()
            for j, index in slots:
                values[j] = seen[index].pointer
            launches.append((module, Launch(kernel, grid, block, shared, tuple(values))))
        return tuple(launches)

    def _launch_template(self, plan: DecodePlan, seen: list, args: dict) -> tuple:
        """Per kernel of ``plan``: ``(module, kernel, grid, block, shared bytes, values,
        slots)``; ``slots`` are ``(position, argument index)`` of the array pointers."""
        variant, module = self._modules[plan.arm, plan.row_tiles, plan.q_len > 1]
        index = {name: i for i, name in enumerate(ARRAY_ARGUMENTS) if seen[i] is not None}
        template = []
        for i, grid in enumerate(plan.launches):
            abi = self._abi[grid.kernel]
            values = [args[name] if typ is None else typ(args[name]) for name, typ in abi]
            slots = tuple((j, index[name]) for j, (name, typ) in enumerate(abi) if typ is None and name in index)
            for j, _ in slots:  # filled per call; the template keeps no array alive
                values[j] = None
            if i == 0:  # the attention kernel
                block, shared = (self._threads, 1, 1), variant.shared_bytes
            else:  # the merge
                block, shared = (self._merge_threads, 1, 1), 0
            template.append((module, grid.kernel, grid.grid, block, shared, values, slots))
        return tuple(template)

    def _checked(self, index: int, array, fingerprint, rows) -> "_Seen":
        """``array`` (argument ``ARRAY_ARGUMENTS[index]``) described and checked, or what
        was found of it last time when it is the same buffer checked for the same rows.

        A new buffer of the argument's last layout (the fingerprint past its first item:
        shape, strides, dtype, device, writability) at an address that moved by a multiple
        of ``VECTOR_BYTES`` gets the last verdict of its checker without running it: the
        checkers read an array's address only modulo ``VECTOR_BYTES`` (alignment), which
        a new checker must keep to. Everything else about it is read anew."""
        seen = self._seen[index]
        if fingerprint is not None and seen is not None and seen.rows == rows:
            if seen.fingerprint == fingerprint:
                return seen
            if seen.fingerprint[1:] == fingerprint[1:]:
                info = self.backend.moved(seen.info, array)
                shift = info.ptr - seen.info.ptr
                if shift % VECTOR_BYTES == 0:
                    span = None if seen.span is None else (seen.span[0] + shift, seen.span[1] + shift)
                    seen = _Seen(fingerprint, rows, array, info, span, seen.derived, self.backend.pointer(array, info))
                    self._seen[index] = seen
                    return seen
        info = self.backend.describe(array, ARRAY_ARGUMENTS[index])
        if info.device != self._device:
            raise ValueError(f"{ARRAY_ARGUMENTS[index]} must be on the device this DecodeAttention was built on "
                             f"({_where(self._device)}), got {_where(info.device)}")
        derived = self._checkers[index](self, info, rows)
        seen = _Seen(fingerprint, rows, array, info, info.byte_range(), derived, self.backend.pointer(array, info))
        self._seen[index] = seen if fingerprint is not None else None
        return seen

    def _allocate_outputs(self, q, out, lse, want_lse):
        """New ``out`` (q's library, ``out_dtype``) and, when asked, ``lse``, shaped by q (checked first)."""
        rows = self._checked(0, q, self.backend.fingerprint(q), None).derived
        be = self.backend
        if out is None:
            out = be.empty(rows + (self.shape.head_dim,), _OUT_NUMPY[self.out_dtype], like=q)
        if want_lse and lse is None:
            lse = be.empty(rows, np.float32, like=q)
        return out, lse

    # -- the checks of one argument: (description, out's leading dims) -> what the launch needs of it

    def _check_q(self, qi: ArrayInfo, rows) -> tuple[int, ...]:
        """q ``[num_seqs, num_q_heads, head_dim]`` or ``[num_seqs, q_len, num_q_heads, head_dim]``;
        returns out's leading dims ``(num_seqs, num_q_heads)`` or ``(num_seqs, q_len, num_q_heads)``."""
        H, D = self.shape.num_q_heads, self.shape.head_dim
        if len(qi.shape) == 4 and qi.shape[2:] == (H, D) and 1 <= qi.shape[1] <= self.max_q_len:
            leading = qi.shape[:3]
        elif len(qi.shape) == 3 and qi.shape[1:] == (H, D):
            leading = qi.shape[:2]
        else:
            tokens = f" or [num_seqs, q_len (1..{self.max_q_len}), {H}, {D}]" if self.max_q_len > 1 else ""
            raise ValueError(f"q must have shape [num_seqs, {H}, {D}]{tokens}, got {list(qi.shape)}")
        num_seqs = qi.shape[0]
        if num_seqs > self.max_batch:
            raise ValueError(f"q has {num_seqs} sequences but this DecodeAttention was built for max_batch="
                             f"{self.max_batch} (its workspace is sized for that)")
        _dtype(qi, "q", self.q_dtype)
        _vector_rows(qi, "q")
        return tuple(leading)

    def _check_k_cache(self, info: ArrayInfo, rows) -> tuple[int, int, int]:
        return self._cache_strides(info, "k_cache")

    def _check_v_cache(self, info: ArrayInfo, rows) -> tuple[int, int, int]:
        return self._cache_strides(info, "v_cache")

    def _check_block_tables(self, bi: ArrayInfo, rows) -> None:
        """int32 ``[num_seqs, max_pages]`` with rows of adjacent page ids (any strides
        when it has no columns)."""
        num_seqs = rows[0]
        _forward_strides(bi, "block_tables")
        if len(bi.shape) != 2 or bi.shape[0] != num_seqs or dtypes.name_of(bi.dtype) != dtypes.INT32:
            raise ValueError(f"block_tables must be int32 [{num_seqs}, max_pages] with contiguous rows, got "
                             f"{bi.dtype} {list(bi.shape)}")
        if not _empty(bi) and bi.strides[1] != 1:
            raise ValueError(f"block_tables must be int32 [{num_seqs}, max_pages] with contiguous rows, got strides "
                             f"{list(bi.strides)} (a row's page ids must be adjacent: stride 1)")
        _aligned(bi, "block_tables", INDEX_BYTES)

    def _check_seq_lens(self, si: ArrayInfo, rows) -> None:
        """Contiguous int32 ``[num_seqs]``."""
        num_seqs = rows[0]
        _forward_strides(si, "seq_lens")
        if len(si.shape) != 1 or si.shape[0] != num_seqs or dtypes.name_of(si.dtype) != dtypes.INT32:
            raise ValueError(f"seq_lens must be contiguous int32 [{num_seqs}], got {si.dtype} {list(si.shape)}")
        if num_seqs > 1 and si.strides[0] != 1:
            raise ValueError(f"seq_lens must be contiguous int32 [{num_seqs}], got a strided view (element stride "
                             f"{si.strides[0]}, not 1)")
        _aligned(si, "seq_lens", INDEX_BYTES)

    def _check_sinks(self, info: ArrayInfo, rows) -> None:
        """Contiguous float32 ``[num_q_heads]`` (given only to an object built with sinks:
        ``_refuse_sinks``); host values are checked on every call (``_check_sink_values``)."""
        H = self.shape.num_q_heads
        if info.shape != (H,) or (H > 1 and info.strides != (1,)) or dtypes.name_of(info.dtype) != dtypes.FLOAT32:
            raise ValueError(f"sinks must be a contiguous float32 [{H}] array, got {info.dtype} {list(info.shape)} "
                             f"strides {list(info.strides)}")
        _aligned(info, "sinks", INDEX_BYTES)

    def _refuse_sinks(self) -> None:
        """Sinks given to an object built without them, or missing from one built with them."""
        if not self.sinks:
            raise ValueError("sinks given, but this DecodeAttention was built without sinks: build it with "
                             "sinks=True (a kernel without sinks would ignore them)")
        raise ValueError(f"sinks must be given: this DecodeAttention was built with sinks=True (a float32 "
                         f"[{self.shape.num_q_heads}] array of sink logits; -inf for no sink)")

    def _check_out(self, oi: ArrayInfo, rows) -> None:
        shape = rows + (self.shape.head_dim,)
        if oi.shape != shape or (rows[0] and oi.strides != _contiguous(shape)):
            raise ValueError(f"out must be a contiguous {list(shape)} array, got shape {list(oi.shape)} "
                             f"strides {list(oi.strides)}")
        _dtype(oi, "out", self.out_dtype)
        _aligned(oi, "out")
        _writable(oi, "out")

    def _check_lse(self, li: ArrayInfo, rows) -> None:
        if li.shape != rows or (rows[0] and li.strides != _contiguous(rows)) or dtypes.name_of(li.dtype) != dtypes.FLOAT32:
            raise ValueError(f"lse must be a contiguous float32 {list(rows)} array, got {li.dtype} "
                             f"{list(li.shape)} strides {list(li.strides)}")
        _writable(li, "lse")
        _aligned(li, "lse", INDEX_BYTES)

    def _check_together(self, seen: list) -> None:
        """The checks across arrays (each is on this object's device already: ``_checked``):
        the caches agree, and the outputs overlap nothing and no input lies in the split-K
        workspace of any object sharing this one's (``_refuse_overlaps``)."""
        q, k, v, bt, sl, sk, out, lse = seen
        if k.info.shape != v.info.shape:
            raise ValueError(f"k_cache and v_cache must have the same shape, got {list(k.info.shape)} and "
                             f"{list(v.info.shape)}")
        _refuse_overlaps((out.span, None if lse is None else lse.span),
                         (q.span, k.span, v.span, bt.span, sl.span, None if sk is None else sk.span),
                         self._shared.span)

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
        shared = self._shared
        previous, shared.last_stream = shared.last_stream, stream
        if stream is previous or previous is None or stream is None:
            return
        if self.backend.stream_busy(previous, stream):
            warnings.warn(
                f"DecodeAttention.run launches on stream {_stream_name(stream)} while stream "
                f"{_stream_name(previous)}, which launched into the same split-K workspace before, still has work "
                "queued: one DecodeAttention (and every object sharing its workspace) serves one stream at a time. "
                "Make this stream wait for the other (an event or a synchronize), or give each stream its own "
                "workspace.",
                StreamReuseWarning, stacklevel=3)

    def _check_indices(self, block_tables, seq_lens, num_pages: int, max_pages: int, q_len: int = 1) -> None:
        """Every length in range, and every page id a call reads a page id: those of the
        pages the window of the first query token touches, to the sequence's end (pages
        before every window may be freed, e.g. -1)."""
        lens = np.asarray(self.backend.host_copy(seq_lens)).astype(np.int64)  # lens - q_len - window: no wrap
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


_MAX_TEMPLATES = 64
_ABSENT = ()
"""The fingerprint of an absent optional array (``lse=None``)."""

_BY_HANDLE: "weakref.WeakValueDictionary[int, DecodeAttention]" = weakref.WeakValueDictionary()
_NEXT_HANDLE = itertools.count(1)
_HANDLES_LOCK = threading.Lock()


class _Seen:
    """One array argument as last checked: its fingerprint and the rows it was checked
    for, the array (kept alive: a fingerprint may stand for its pointer by ``id``), its
    description, byte range, what its checker derived, and its launch pointer."""

    __slots__ = ("fingerprint", "rows", "array", "info", "span", "derived", "pointer")

    def __init__(self, fingerprint, rows, array, info: ArrayInfo, span, derived, pointer):
        self.fingerprint, self.rows, self.array, self.info = fingerprint, rows, array, info
        self.span, self.derived, self.pointer = span, derived, pointer


class _Call:
    """A validated call: the fingerprints and scales it was validated for, its launches
    ``((module, Launch), ...)``, what the index check reads, and its arguments (kept
    alive with the launches' pointers)."""

    __slots__ = ("prints", "k_scale", "v_scale", "launches", "num_pages", "max_pages", "q_len", "seen",
                 "workspace_span")

    def __init__(self, prints, k_scale, v_scale, launches, num_pages, max_pages, q_len, seen, workspace_span):
        self.prints, self.k_scale, self.v_scale, self.launches = prints, k_scale, v_scale, launches
        self.num_pages, self.max_pages, self.q_len, self.seen = num_pages, max_pages, q_len, seen
        self.workspace_span = workspace_span  # the shared workspace's bytes the arrays were checked against


class _WorkspaceUsers:
    """What the objects sharing one workspace share: the lock under which one call's
    launches run (a split kernel and its merge, which must not interleave with another
    call's), and the stream of the last launch into it (``StreamReuseWarning``).

    Objects join by the workspace's byte range: one whose workspace overlaps a live
    group's joins it (the group's range grows to cover both); one that would bridge two
    groups is refused (their objects already hold different locks)."""

    __slots__ = ("lock", "last_stream", "device", "span", "__weakref__")
    _live: "weakref.WeakSet[_WorkspaceUsers]" = weakref.WeakSet()
    _registry = threading.Lock()

    def __init__(self, device, span):
        self.lock, self.last_stream, self.device, self.span = threading.Lock(), None, device, span

    @classmethod
    def join(cls, device, span) -> "_WorkspaceUsers":
        if span is None:  # an empty workspace: nothing to share
            return cls(device, None)
        with cls._registry:
            found = [u for u in list(cls._live) if u.device == device and _overlap(u.span, span)]
            if len(found) > 1:
                raise ValueError(f"workspace (bytes {span[0]:#x}..{span[1]:#x}) overlaps the workspaces of "
                                 f"{len(found)} groups of DecodeAttention objects that do not share one: pass every "
                                 "object the same buffer (or disjoint ones)")
            if found:
                users = found[0]
                users.span = (min(users.span[0], span[0]), max(users.span[1], span[1]))
            else:
                users = cls(device, span)
                cls._live.add(users)
            return users


def _resolve_target(backend, name: Optional[str]) -> Target:
    """The target: the device's on a GPU (``name`` then keeps its table but the device's
    SM count), else the named one or the default."""
    device = backend.device()
    if device is None:  # no GPU: the target's table stands in
        return get_target(name or DEFAULT_TARGET)
    if name is None:
        return detect_target(device.compute_capability, device.sm_count)
    return replace(get_target(name), sm_count=device.sm_count)


def workspace_bytes(shapes, *, max_batch: int, backend=None, target: Optional[str] = None,
                    splitk: Optional[str] = None, max_decode_seqs: int = LEGACY_MAX_DECODE_SEQS,
                    max_q_len: int = 1) -> int:
    """Bytes of one split-K workspace that serves every layer shape in ``shapes`` at up to
    ``max_batch`` sequences: the largest ``DecodeAttention.workspace_nbytes`` among them.

    ``shapes``: ``(num_q_heads, num_kv_heads, head_dim)`` tuples (or ``ModelShape``); the
    other arguments as ``DecodeAttention`` takes them (the target and split-K policy
    decide the split count, and so the size). Allocate it once (any dtype, e.g.
    ``torch.empty(n, dtype=torch.uint8, device="cuda")``) and pass it as ``workspace=``
    to every layer's object: a model of 80 layers of one shape, or of several shapes,
    allocates one workspace. Objects sharing a workspace must not run concurrently (see
    ``DecodeAttention``).
    """
    be = get_backend(backend) if backend is None or isinstance(backend, str) else backend
    max_batch = _int_in("max_batch", max_batch, 1)
    max_decode_seqs = _int_in("max_decode_seqs", max_decode_seqs, 0)
    max_q_len = _int_in("max_q_len", max_q_len, 1, MAX_Q_LEN)
    defaults = resolve_defaults(_resolve_target(be, target), splitk=splitk, gqa_pack=None)
    sizes = [workspace_for(defaults, s if isinstance(s, ModelShape) else ModelShape(*s), max_batch=max_batch,
                           max_decode_seqs=max_decode_seqs, max_q_len=max_q_len).nbytes for s in shapes]
    if not sizes:
        raise ValueError("shapes must name at least one (num_q_heads, num_kv_heads, head_dim)")
    return max(sizes)


SLOW_COMPILE_S = 10.0
"""A construction still compiling after this many seconds says so (INFO), once."""


def _fall_back(why: str) -> None:
    """The one way a construction falls back to the simt kernels: a warning and a log line."""
    message = f"metrale-attn: {why}; using impl='simt' instead"
    logger.warning("%s", message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


@contextlib.contextmanager
def _said_while_slow(what: str):
    """Log ``what`` at INFO if it is still running after ``SLOW_COMPILE_S`` (a cold cache's
    NVRTC or host-compiler builds), and how long it took when it ends after that."""
    start = time.perf_counter()
    timer = threading.Timer(SLOW_COMPILE_S, lambda: logger.info("still %s (%.0f s so far)", what,
                                                                time.perf_counter() - start))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        took = time.perf_counter() - start
        if took >= SLOW_COMPILE_S:
            logger.info("done %s in %.1f s", what, took)


def _storage_guard(workspace, nbytes: int):
    """For a torch tensor, a check that it still holds its memory at the address the
    launches use, at least ``nbytes`` of it (a caller can free or swap a tensor's storage
    in place: ``untyped_storage().resize_(0)``, ``set_()``); None for an array whose
    memory cannot move while it is referenced (NumPy, CuPy). About a microsecond."""
    storage_of = getattr(workspace, "untyped_storage", None)
    if storage_of is None:
        return None
    ptr = workspace.data_ptr()

    def check() -> None:
        storage = storage_of()
        if workspace.data_ptr() != ptr or storage.data_ptr() + storage.nbytes() - ptr < nbytes:
            raise ValueError(f"the workspace tensor no longer holds its memory (it was at {ptr:#x}, {nbytes} bytes; "
                             f"now {workspace.data_ptr():#x} in a storage of {storage.nbytes()} bytes): its storage "
                             "was freed or replaced; the objects built on it cannot run")
    return check


def _contiguous(shape: tuple) -> tuple:
    """C-contiguous strides (elements) of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


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


def _forward_strides(info: ArrayInfo, argument: str) -> None:
    if info.strides and min(info.strides) < 0:
        raise ValueError(f"{argument} has negative strides {list(info.strides)}, which are not supported: pass a "
                         f"copy (np.ascontiguousarray) or a view with positive strides")


def _writable(info: ArrayInfo, argument: str) -> None:
    if not info.writable:
        raise ValueError(f"{argument} must be writable, got a read-only array")


_INPUTS = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "sinks", "the split-K workspace")


def _refuse_overlaps(outputs: tuple, inputs: tuple, workspace: Optional[tuple[int, int]]) -> None:
    """``(out, lse)`` may share no byte with each other, an input ``(q, k_cache, v_cache,
    block_tables, seq_lens, sinks)`` or the workspace, and no input may lie in the
    workspace (the kernels write their partials there mid-call); ``sinks`` and ``lse`` may
    be None. Each is given by its byte range (``ArrayInfo.byte_range``; None: empty or
    absent); ``workspace`` is that of every object sharing this one's.

    Ranges are hulls: from an array's lowest element byte to its highest. Outputs are
    contiguous, so theirs are exact; a strided input's gaps count as its own, which
    refuses only layouts nobody uses (an output inside the gaps of a strided input).
    Exact aliasing (``out`` is ``q``) is refused too.
    """
    out, lse = outputs
    spans = tuple(inputs) + (workspace,)
    for name, mine, names, theirs_all in (("out", out, _INPUTS, spans), ("lse", lse, ("out",) + _INPUTS, (out,) + spans)):
        for other, theirs in zip(names, theirs_all):
            if _overlap(mine, theirs):
                raise ValueError(
                    f"{name} overlaps {other} in memory (bytes {mine[0]:#x}..{mine[1]:#x} and {theirs[0]:#x}.."
                    f"{theirs[1]:#x}): outputs may share memory with nothing else, not even out with q; pass a "
                    f"separate {name}")
    for name, span in zip(_INPUTS, inputs):
        if _overlap(span, workspace):
            raise ValueError(f"{name} lies in the split-K workspace (bytes {span[0]:#x}..{span[1]:#x} and "
                             f"{workspace[0]:#x}..{workspace[1]:#x}, the workspace of every object sharing it): "
                             f"the kernels write their partials there; pass {name} in its own memory")


def _overlap(a: Optional[tuple[int, int]], b: Optional[tuple[int, int]]) -> bool:
    """Whether two byte ranges ``[first, end)`` share a byte (None: no bytes)."""
    return a is not None and b is not None and a[0] < b[1] and b[0] < a[1]


def _dtype(info: ArrayInfo, argument: str, expected: str) -> None:
    name = dtypes.name_of(info.dtype)
    if expected in dtypes.FP8_KINDS and name == dtypes.FP8 and info.itemsize == 1 and _is_uint8(info.dtype):
        return  # uint8 bits of the declared fp8 kind
    if name != expected:
        raise ValueError(f"{argument} must hold {expected} values (as this DecodeAttention was built), got {info.dtype}")


def _aligned(info: ArrayInfo, argument: str, boundary: int = VECTOR_BYTES) -> None:
    if info.ptr % boundary and not _empty(info):
        what = "vector loads" if boundary == VECTOR_BYTES else f"its {boundary}-byte elements"
        raise ValueError(f"{argument} must start on a {boundary}-byte boundary for {what} (address {info.ptr:#x})")


def _empty(info: ArrayInfo) -> bool:
    """No element: nothing is read or written through it, so its strides and address do
    not matter (NumPy 2 gives ``np.empty((0, ...))`` strides of 0)."""
    return 0 in info.shape


def _vector_rows(info: ArrayInfo, argument: str) -> None:
    """No negative strides; last dim contiguous; base and every other stride a multiple of
    16 bytes (an empty array: nothing to check)."""
    if _empty(info):
        return
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


_OUT_NUMPY = {**dtypes.NUMPY_DTYPES, dtypes.FLOAT32: np.dtype(np.float32)}


def _soft_cap(value) -> Optional[float]:
    """The cap, or None for none: None and 0 mean no cap, as in FlashInfer, vLLM and
    FlashAttention."""
    if value is None:
        return None
    cap = _as_float("logits_soft_cap", value)
    if cap == 0:
        return None
    if not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"logits_soft_cap must be a finite float > 0 (or 0/None: no cap), got {value!r}")
    return cap


def _check_sink_values(sinks) -> None:
    """Host sink logits are -inf or finite within ``MAX_SINK`` in magnitude: +inf or NaN
    would make every output NaN, and a larger finite one overflows the kernels' base-2
    sink. A torch parameter (requires_grad) is read through ``detach``."""
    values = np.asarray(sinks.detach() if hasattr(sinks, "detach") else sinks)
    bad = np.flatnonzero(np.isnan(values) | (values == np.inf) | (np.isfinite(values) & (np.abs(values) > MAX_SINK)))
    if bad.size:
        raise ValueError(f"sinks[{int(bad[0])}] = {values[bad[0]]}: sink logits must be -inf or finite with "
                         f"|sink| <= {MAX_SINK:.6g} (FLT_MAX / log2(e))")


def _fp32_normal(value: float) -> bool:
    return FP32_MIN_NORMAL <= value <= FP32_MAX
