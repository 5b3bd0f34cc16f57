"""``DecodeAttention``: the object a serving loop builds once and calls every decode step.

The story of one layer: construction checks the configuration once (``config``),
resolves the target and policy, compiles (or loads cached) every kernel spec a call
can reach (``kernels.specs_for``), and allocates or adopts the split-K workspace once
(``workspace``). ``run`` hands the call's arguments to the binder (``binding``: checked
by ``validation`` unless they are the buffers checked last time), and launches the
plan's kernels under the workspace's lock. With ``out`` (and ``lse``) given it allocates
nothing and never synchronizes, so a CUDA graph can capture it.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import numbers
import os
import threading
import time
import warnings
import weakref
from typing import Optional

import numpy as np

from . import dtypes
from .backends import get_backend
from .binding import CallBinder, kernel_abi
from .cache import cache_root
from .config import ENV_IMPL, LayerConfig, configure, impl_chosen
from .features import FEATURE_ARRAYS
from .kernels import launchable_config, mma_shape_refusal, specs_for
from .sources import merge_threads, source_constants
from .plan import LEGACY_MAX_DECODE_SEQS, DecodePlan, make_plan
from .policy import as_int
from .targets import resolve_target_policy, target_for
from .validation import ARRAY_ARGUMENTS, check_values
from .workspace import SharedWorkspace, adopt, allocate, layer_workspace, storage_guard

logger = logging.getLogger(__name__)


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
    the page table (and device scales and sinks) to the host on every call to prove
    every page id and length is in range, and their values sound (``validation.check_values``;
    always on for the CPU backend). Integer arguments may
    be any ``numbers.Integral`` (NumPy integers too), never a bool. The checked
    configuration is ``attn.config`` (a ``LayerConfig``); its fields read through
    (``attn.q_dtype`` is ``attn.config.q_dtype``).

    Features (keyword arguments ``**features``, checked by ``config.configure``;
    ``impl="mma"``, and ``max_q_len`` on ``simt`` too, so head dims 512 and 576/512 take it;
    each compiles a specialization of the kernels, so the plain path
    pays nothing, and a feature a kernel cannot serve is refused, never ignored):

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
    * ``device_scales=True``: ``run(..., k_scales=, v_scales=)`` takes the dequantization
      scales as float32 arrays on the device, one value or one per KV head (vLLM's
      ``layer._k_scale``, FlashAttention 3's descale tensors), read by the kernels: a
      captured CUDA graph follows a scale that changes, and nothing syncs to read it.

    Not a feature (no specialization): ``lse_base`` ``"e"`` (default: the natural log, as
    vLLM and FlashAttention) or ``2`` (base 2, FlashInfer's convention for states it
    merges) for the returned lse.

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
        max_batch: int,
        v_head_dim: Optional[int] = None,
        kv_layout: str = "NHD",
        target: Optional[str] = None,
        backend=None,
        splitk: Optional[str] = None,
        gqa_pack: Optional[bool] = None,
        sm_scale: Optional[float] = None,
        max_decode_seqs: int = LEGACY_MAX_DECODE_SEQS,
        check_indices: bool = False,
        impl: Optional[str] = None,
        heads_per_cta: Optional[int] = None,
        workspace=None,
        **features,
    ) -> None:
        self.backend = get_backend(backend) if backend is None or isinstance(backend, str) else backend
        target_policy = resolve_target_policy(target_for(self.backend.device(), target), splitk=splitk, gqa_pack=gqa_pack)
        config = configure(num_q_heads, num_kv_heads, head_dim, page_size, v_head_dim=v_head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype,
                           max_batch=max_batch, target_policy=target_policy, kv_layout=kv_layout, sm_scale=sm_scale,
                           max_decode_seqs=max_decode_seqs, impl=impl, heads_per_cta=heads_per_cta, **features)
        self.config: LayerConfig = _with_launchable_impl(config, self.backend, impl_chosen(impl, os.environ.get(ENV_IMPL)))
        self.check_indices = check_indices or self.backend.always_check_indices
        self._device = self.backend.current_device()

        # The split-K workspace: this layer's own, or the caller's (which many layers may share).
        self.workspace_layout = layer_workspace(self.config)
        if workspace is None:
            self.workspace = allocate(self.backend, self.config, self.workspace_layout)
        else:
            self.workspace = adopt(self.backend, workspace, self.config, self.workspace_layout, self._device)
        # A caller's torch tensor can lose its memory under us (resize_(0), set_()): checked every call.
        self._workspace_guard = None if workspace is None else storage_guard(workspace, self.workspace_nbytes)
        info = self.backend.describe(self.workspace, "workspace")
        self._group = SharedWorkspace.join(self._device, info.byte_range())

        # Every spec a call can reach, compiled now, so that run() never compiles.
        self._plans: dict[tuple[int, int], DecodePlan] = {}
        specs = specs_for(self.config)
        with _compiling(self.backend, self.config.target.arch, list(specs.values())):
            modules = self.backend.load_many(specs.values())
        # By (spec, kernel): a feature may add parameters (the simt multi-token kernels' q_len), so a
        # kernel name's ABI is its spec's.
        abi = {(spec.name, kernel): params for spec in specs.values() for kernel, params in kernel_abi(spec).items()}
        constants = source_constants()
        self._binder = CallBinder(self.config, self.backend, self._device,
                                  {key: (v, m) for (key, v), m in zip(specs.items(), modules)}, abi, self._plan,
                                  self._group, self.backend.pointer(self.workspace, info),
                                  (constants.threads, merge_threads(self.config.shape.v_head_dim)))
        with _HANDLES_LOCK:
            self._handle = next(_NEXT_HANDLE)
            _BY_HANDLE[self._handle] = self
        self._say_layer(specs)

    def _say_layer(self, specs) -> None:
        """One line per layer configuration (INFO the first time in this process, DEBUG for
        each later layer like it: a model's 80 identical layers say it once): the shape, the
        target, the implementation and the plans of batch 1 and ``max_batch``, with the
        policy's reasons; at DEBUG, the kernel specs too."""
        config = self.config
        with _HANDLES_LOCK:
            first = config not in _LAYERS_SAID
            _LAYERS_SAID.add(config)
        level = logging.INFO if first else logging.DEBUG
        if not logger.isEnabledFor(level):
            return
        shape, features = config.shape, sorted(config.features)
        plans = "; ".join(f"batch {n}: {_plan_line(self.plan(n))}" for n in sorted({1, config.max_batch}))
        specs_line = f"; kernels {', '.join(v.name for v in specs.values())}" if logger.isEnabledFor(logging.DEBUG) else ""
        logger.log(level, "DecodeAttention %d/%d/%d, page %d, q %s, KV %s %s%s, %s, impl %s, max_batch %d: %s%s",
                   shape.num_q_heads, shape.num_kv_heads, shape.head_dim, config.page_size, config.q_dtype,
                   config.kv_dtype, config.kv_layout, f", features {'+'.join(features)}" if features else "",
                   self.target_line(), config.impl, config.max_batch, plans, specs_line)

    def __getattr__(self, name: str):
        """The configuration's fields read through: ``attn.q_dtype`` is ``attn.config.q_dtype``."""
        config = self.__dict__.get("config")
        if config is None or name.startswith("_") or not hasattr(config, name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(config, name)

    @property
    def workspace_nbytes(self) -> int:
        """Bytes of split-K workspace this object needs (``workspace_layout``: slots x
        ``head_dim + 2`` fp32); a workspace passed to the constructor must hold at least
        this many (``policy.workspace_slots``, which reserves slots even for a pinned
        single split)."""
        return self.workspace_layout.nbytes

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
        """The memoized geometry of a call with ``num_seqs`` sequences of ``q_len`` query tokens
        (ints, NumPy integers too, never bools or floats: ``True`` would find ``1``'s plan)."""
        for name, value in (("num_seqs", num_seqs), ("q_len", q_len)):
            if as_int(value) is None:
                raise TypeError(f"{name} must be an int, got {value!r}")
        return self._plan(int(num_seqs), int(q_len))

    def _plan(self, num_seqs: int, q_len: int) -> DecodePlan:
        """``plan`` for the binder, whose counts are a shape's ints."""
        plan = self._plans.get((num_seqs, q_len))
        if plan is None:
            plan = self._plans[num_seqs, q_len] = make_plan(self.config, num_seqs, q_len,
                                                             workspace=self.workspace_layout)
        return plan

    def target_line(self) -> str:
        """``target defaults (...): ...``, for logs and the CLI."""
        return self.config.target_policy.line()

    def run(self, q, k_cache, v_cache, block_tables=None, seq_lens=None, *, k_scale: float = 1.0,
            v_scale: float = 1.0, out=None, return_lse: bool = False, lse=None, stream=None, **arrays):
        """Decode one step. Returns ``out`` (and ``lse`` when ``return_lse`` or ``lse`` is given).

        q is ``[num_seqs, num_q_heads, head_dim]``, or ``[num_seqs, q_len, num_q_heads,
        head_dim]`` (``q_len <= max_q_len``); out and lse follow q's axes. The page table:
        ``block_tables`` int32 ``[num_seqs, max_pages]`` and ``seq_lens`` int32
        ``[num_seqs]``, or, for an object built with ``page_table="csr"``, FlashInfer's
        ``kv_indptr`` int32 ``[num_seqs + 1]``, ``kv_indices`` int32 ``[nnz]`` (sequence ``s``'s
        pages are ``kv_indices[kv_indptr[s]:kv_indptr[s + 1]]``) and ``kv_last_page_len``
        int32 ``[num_seqs]`` (1..page_size tokens in its last page), which the kernels read
        as they are (a sequence's length is ``(pages - 1) * page_size + last_page_len``).
        ``k_scale``/``v_scale`` dequantize the cache: value = stored * scale (fp8
        mostly; any dtype), host floats folded on the host. ``k_scales``/``v_scales``
        (instead, exactly when the object was built with ``device_scales=True``): float32
        arrays on its device of one value (``[]`` or ``[1]``, per tensor) or
        ``[num_kv_heads]`` (per KV head), read by the kernels and folded there exactly as the
        host folds floats, so a CUDA graph replays with whatever they hold then (their
        values are checked on the host only where it holds them: the CPU backend, or
        ``check_indices=True``). ``sinks``: float32 ``[num_q_heads]`` sink logits, given
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

        The features' arrays (``sinks``, ``k_scales``, ...) are keyword arguments named by their
        records (``features.FEATURE_ARRAYS``; the signature lists them); any other is a TypeError.
        """
        if arrays and not _FEATURE_ARRAY_NAMES.issuperset(arrays):
            unknown = sorted(set(arrays) - _FEATURE_ARRAY_NAMES)
            raise TypeError(f"run() got an unexpected keyword argument {unknown[0]!r}")
        want_lse = return_lse or lse is not None
        if out is None or (want_lse and lse is None):
            out, lse = self._allocate_outputs(q, out, lse, want_lse)
        if self._workspace_guard is not None:
            self._workspace_guard()
        feature_arrays = tuple(map(arrays.get, _FEATURE_ARRAY_ORDER)) if arrays else _NO_FEATURE_ARRAYS
        given = (q, k_cache, v_cache, block_tables, seq_lens, *feature_arrays, out, lse)
        call = self._binder.bind(given, k_scale, v_scale)
        if self.check_indices:  # host values: read on every call
            check_values(self.config, self.backend.host_copy, call, dict(zip(ARRAY_ARGUMENTS, given)))
        if call.launches:
            with self.backend.launch_stream(stream, like=q), self._group.lock:
                self._note_stream(self.backend.current_stream())
                for module, launch in call.launches:
                    module.launch(launch)
        return (out, lse) if want_lse else out

    def _allocate_outputs(self, q, out, lse, want_lse):
        """New ``out`` (q's library, ``out_dtype``) and, when asked, ``lse``, shaped by q (checked first)."""
        rows = self._binder.rows(q)
        be = self.backend
        if out is None:
            out = be.empty(rows + (self.config.shape.v_head_dim,), _OUT_NUMPY[self.config.out_dtype], like=q)
        if want_lse and lse is None:
            lse = be.empty(rows, np.float32, like=q)
        return out, lse

    def _note_stream(self, stream) -> None:
        """Remember this launch's stream; on a change, warn if the previous one is busy.

        Called under the lock. The same stream again (the hot path, and every launch
        of a graph captured on one stream) costs one identity comparison.
        """
        group = self._group
        previous, group.last_stream = group.last_stream, stream
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


def _run_signature() -> inspect.Signature:
    """``run``'s signature as callers see it: each feature array a keyword (None: absent)."""
    signature = inspect.signature(DecodeAttention.run)
    plain = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    return signature.replace(parameters=plain + [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
                                                 for name in _FEATURE_ARRAY_ORDER])


_FEATURE_ARRAY_ORDER = tuple(a.name for a in FEATURE_ARRAYS)
_FEATURE_ARRAY_NAMES = frozenset(_FEATURE_ARRAY_ORDER)
_NO_FEATURE_ARRAYS = (None,) * len(_FEATURE_ARRAY_ORDER)
DecodeAttention.run.__signature__ = _run_signature()
_BY_HANDLE: "weakref.WeakValueDictionary[int, DecodeAttention]" = weakref.WeakValueDictionary()
_NEXT_HANDLE = itertools.count(1)
_HANDLES_LOCK = threading.Lock()
_OUT_NUMPY = {**dtypes.NUMPY_DTYPES, dtypes.FLOAT32: np.dtype(np.float32)}


def _with_launchable_impl(config: LayerConfig, backend, chosen: bool) -> LayerConfig:
    """``launchable_config`` on this backend (its known-answer self-test runs here, once per
    device, unless the mma core has no kernel of the shape), with a warning and a log line
    when it falls back."""
    if config.impl != "mma":
        return config
    disagree = backend.verify_mma() if mma_shape_refusal(config) is None else []
    launchable, why = launchable_config(config, disagree, chosen)
    if why:
        _fall_back(why)
    return launchable


_LAYERS_SAID: set = set()
"""The ``LayerConfig``s this process has described at INFO (``_say_layer``)."""


def _plan_line(plan: DecodePlan) -> str:
    """``splitk, 11 splits, 6 heads/CTA (reason)``: a plan as the layer's log line gives it."""
    return f"{plan.arm}, {plan.num_splits} split(s), {plan.heads_per_cta} head(s)/CTA ({plan.reason})"


SLOW_COMPILE_S = 10.0
"""A construction still compiling after this many seconds says so (INFO), once."""


def _fall_back(why: str) -> None:
    """The one way a construction falls back to the simt kernels: a warning and a log line."""
    message = f"metrale-attn: {why}; using impl='simt' instead"
    logger.warning("%s", message)
    warnings.warn(message, RuntimeWarning, stacklevel=4)


@contextlib.contextmanager
def _compiling(backend, arch: str, specs: list):
    """Around a construction's ``load_many``: what an operator needs to tell a cold compile
    from a hang, at INFO. Before it, when the cache lacks some of ``specs`` (asked of the
    backend only when INFO is on: the question costs a hash of each source), ``compiling N
    kernel(s) for ARCH (not in the cache): names``, and after it, how long that took; while
    it runs past ``SLOW_COMPILE_S``, ``still compiling ...`` once (a wait on another
    process's build lock is said by ``cache.build_lock``)."""
    uncached = backend.uncached(specs) if logger.isEnabledFor(logging.INFO) else []
    names = ", ".join(v.name for v in uncached or specs)
    what = (f"compiling {len(uncached)} kernel(s) for {arch}" if uncached
            else f"loading {len(specs)} kernel(s) for {arch}")
    if uncached:
        logger.info("%s (%s backend; not in the cache %s): %s", what, backend.name, cache_root(), names)
    start = time.perf_counter()
    timer = threading.Timer(SLOW_COMPILE_S, lambda: logger.info("still %s (%.0f s so far): %s", what,
                                                                time.perf_counter() - start, names))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
    took = time.perf_counter() - start  # reached only when the loads succeeded
    if uncached:
        logger.info("compiled %d kernel(s) for %s in %.1f s", len(uncached), arch, took)
    elif took >= SLOW_COMPILE_S:
        logger.info("done %s in %.1f s", what, took)


def _stream_name(stream) -> str:
    handle = getattr(stream, "ptr", None)
    return f"{handle:#x}" if isinstance(handle, int) else repr(stream)

