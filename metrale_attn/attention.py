"""``DecodeAttention``: the object a serving loop builds once and calls every decode step.

Construction resolves the target and policy, compiles (or loads cached) every
kernel the policy can reach, and allocates the split-K workspace once for
``max_batch`` rows. ``run`` validates cheaply on the host, looks up the memoized
plan for the batch size and launches; with ``out`` (and ``lse``) given it
allocates nothing and never synchronizes, so a CUDA graph can capture it.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import replace
from typing import Optional

import numpy as np

from . import dtypes
from .backends import ArrayInfo, Launch, get_backend
from .kernels import Variant, kernel_params, source_constants
from .plan import (ENV_HEADS_PER_CTA, ENV_IMPL, LEGACY_MAX_DECODE_SEQS, DecodePlan, ModelShape,
                   heads_per_cta_choices, make_plan, resolve_heads_per_cta, resolve_impl, workspace_for)
from .targets import DEFAULT_TARGET, Defaults, detect_target, get_target, resolve_defaults

LAYOUTS = ("NHD", "HND")
LAUNCH_ARGUMENTS = {
    "q": "pointer", "q_stride_seq": "int", "q_stride_head": "int",
    "k_cache": "pointer", "k_stride_page": "int", "k_stride_token": "int", "k_stride_head": "int",
    "v_cache": "pointer", "v_stride_page": "int", "v_stride_token": "int", "v_stride_head": "int",
    "block_tables": "pointer", "block_tables_stride": "int", "seq_lens": "pointer",
    "num_kv_heads": "int", "page_size": "int", "heads_per_cta": "int", "num_splits": "int",
    "qk_scale_log2": "float", "v_scale": "float",
    "out": "pointer", "lse": "pointer", "workspace": "pointer",
}
"""Every argument ``run`` can hand a kernel, by the parameter name the sources use (the
launch ABI is read from the sources; a test checks each kernel's names against this)."""
MAX_PAGE_SIZE = 256
LOG2E = 1.4426950408889634
VECTOR_BYTES = 16  # kernels load K/V and q rows with 16-byte vector loads


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
    and length is in range (always on for the CPU backend).
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
    ) -> None:
        self.shape = ModelShape(num_q_heads, num_kv_heads, head_dim)
        if isinstance(page_size, bool) or not isinstance(page_size, int) or not 1 <= page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"page_size must be an int in 1..{MAX_PAGE_SIZE}, got {page_size!r}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        layout = str(kv_layout).upper()
        if layout not in LAYOUTS:
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        self.page_size, self.max_batch, self.kv_layout = page_size, max_batch, layout
        self.max_decode_seqs = max_decode_seqs
        self.q_dtype = dtypes.canonical(q_dtype, argument="q_dtype", allowed=dtypes.Q_DTYPES)
        self.kv_dtype = dtypes.canonical(kv_dtype, argument="kv_dtype", allowed=dtypes.KV_DTYPES)
        self.sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else _positive("sm_scale", sm_scale)

        self.backend = get_backend(backend) if backend is None or isinstance(backend, str) else backend
        self.defaults: Defaults = resolve_defaults(self._target(target), splitk=splitk, gqa_pack=gqa_pack)
        self.check_indices = check_indices or self.backend.always_check_indices
        self._device = self.backend.current_device()
        self.workspace_spec = workspace_for(
            self.defaults, self.shape, max_batch=max_batch, max_decode_seqs=max_decode_seqs)
        self.workspace = self.backend.empty((self.workspace_spec.slots * self.workspace_spec.slot_floats,), np.float32)
        self._workspace_ptr = self.backend.pointer(self.workspace)
        self.impl = resolve_impl(impl, os.environ.get(ENV_IMPL))
        if self.impl == "mma":
            disagree = self.backend.verify_mma()
            if disagree:  # never return bytes from instructions that differ from their emulation
                warnings.warn(f"metrale-attn: this device's {', '.join(disagree)} disagree with the emulation the "
                              "mma kernels were verified on; using impl='simt' instead", RuntimeWarning, stacklevel=2)
                self.impl = "simt"
        self.heads_per_cta = resolve_heads_per_cta(heads_per_cta, os.environ.get(ENV_HEADS_PER_CTA),
                                                   self.shape.group_size)
        self._plans: dict[int, DecodePlan] = {}
        constants = source_constants()
        self._threads, self._merge_threads = constants.threads, constants.merge_threads
        # Compile every variant a batch size can reach now, so that run() never compiles:
        # legacy's split count only falls as the batch grows, so batch 1 and max_batch
        # bound the arms; the row tiles follow heads_per_cta, which may be any choice.
        self._modules: dict[tuple[str, int], tuple] = {}
        self._abi: dict[str, tuple] = {}  # kernel -> ((argument name, scalar type or None), ...)
        for plan in (self.plan(1), self.plan(max_batch)):
            if plan.impl == "simt" or plan.arm == "gqa_packed":
                row_tiles = {plan.row_tiles}
            elif self.heads_per_cta is not None:
                row_tiles = {replace(plan, heads_per_cta=self.heads_per_cta).row_tiles}
            else:
                row_tiles = {replace(plan, heads_per_cta=h).row_tiles for h in heads_per_cta_choices(self.shape.group_size)}
            for rt in sorted(row_tiles):
                if (plan.arm, rt) not in self._modules:
                    variant = Variant(plan.arm, head_dim, self.q_dtype, self.kv_dtype, plan.impl, rt)
                    self._modules[plan.arm, rt] = (variant, self.backend.load(variant))
                    for kernel, params in kernel_params(variant).items():
                        self._abi[kernel] = tuple((p.name, None if p.is_pointer else p.numpy_type) for p in params)

    def _target(self, name: Optional[str]):
        device = self.backend.device()
        if device is None:  # no GPU: the target's table stands in
            return get_target(name or DEFAULT_TARGET)
        _, capability, sm_count, _ = device
        if name is None:
            return detect_target(capability, sm_count)
        return replace(get_target(name), sm_count=sm_count)

    def plan(self, num_seqs: int) -> DecodePlan:
        """The memoized geometry of a call with ``num_seqs`` sequences."""
        plan = self._plans.get(num_seqs)
        if plan is None:
            plan = make_plan(self.defaults, self.shape, num_seqs, max_batch=self.max_batch,
                             max_decode_seqs=self.max_decode_seqs, workspace=self.workspace_spec,
                             impl=self.impl, heads_per_cta=self.heads_per_cta)
            self._plans[num_seqs] = plan
        return plan

    def target_line(self) -> str:
        """``target defaults (...): ...``, for logs and the CLI."""
        return self.defaults.line()

    def run(self, q, k_cache, v_cache, block_tables, seq_lens, *, k_scale: float = 1.0, v_scale: float = 1.0,
            out=None, return_lse: bool = False, lse=None, stream=None):
        """Decode one step. Returns ``out`` (and ``lse`` when ``return_lse`` or ``lse`` is given).

        ``k_scale``/``v_scale`` dequantize the cache: value = stored * scale (fp8
        mostly; any dtype). ``stream``: a CuPy or torch stream or a raw handle;
        ``None`` launches on torch's current stream for torch inputs, else on CuPy's.
        Errors name the argument and what was expected, and are raised before
        anything is launched.
        """
        be = self.backend
        H, D = self.shape.num_q_heads, self.shape.head_dim
        qi = be.describe(q, "q")
        if len(qi.shape) != 3 or qi.shape[1:] != (H, D):
            raise ValueError(f"q must have shape [num_seqs, {H}, {D}], got {list(qi.shape)}")
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
        if len(bi.shape) != 2 or bi.shape[0] != num_seqs or dtypes.name_of(bi.dtype) != dtypes.INT32 or bi.strides[1] != 1:
            raise ValueError(f"block_tables must be int32 [{num_seqs}, max_pages] with contiguous rows, got "
                             f"{bi.dtype} {list(bi.shape)} strides {list(bi.strides)}")
        if len(si.shape) != 1 or si.shape[0] != num_seqs or dtypes.name_of(si.dtype) != dtypes.INT32 or (
                num_seqs > 1 and si.strides[0] != 1):
            raise ValueError(f"seq_lens must be contiguous int32 [{num_seqs}], got {si.dtype} {list(si.shape)}")
        k_scale, v_scale = _positive("k_scale", k_scale), _positive("v_scale", v_scale)

        if out is None:
            out = be.empty((num_seqs, H, D), dtypes.NUMPY_DTYPES[self.q_dtype], like=q)
        oi = be.describe(out, "out")
        if oi.shape != (num_seqs, H, D) or (num_seqs and oi.strides != (H * D, D, 1)):
            raise ValueError(f"out must be a contiguous [{num_seqs}, {H}, {D}] array, got shape {list(oi.shape)} "
                             f"strides {list(oi.strides)}")
        _dtype(oi, "out", self.q_dtype)
        _aligned(oi, "out")
        want_lse = return_lse or lse is not None
        if lse is None and want_lse:
            lse = be.empty((num_seqs, H), np.float32, like=q)
        described, li = [qi, ki, vi, bi, si, oi], None
        if lse is not None:
            li = be.describe(lse, "lse")
            described.append(li)
            if li.shape != (num_seqs, H) or (num_seqs and li.strides != (H, 1)) or dtypes.name_of(li.dtype) != dtypes.FLOAT32:
                raise ValueError(f"lse must be a contiguous float32 [{num_seqs}, {H}] array, got {li.dtype} "
                                 f"{list(li.shape)}")
        devices = {x.device for x in described}
        if devices != {self._device}:
            raise ValueError(f"q, k_cache, v_cache, block_tables, seq_lens, out and lse must all be on the device this "
                             f"DecodeAttention was built on ({_where(self._device)}), got {sorted(map(_where, devices))}")
        if self.check_indices:
            self._check_indices(block_tables, seq_lens, ki.shape[0], bi.shape[1])

        launch_stream = be.launch_stream(stream, like=q)
        plan = self.plan(num_seqs)
        if num_seqs:
            ptr = be.pointer
            args = dict(
                q=ptr(q, qi), q_stride_seq=qi.strides[0], q_stride_head=qi.strides[1],
                k_cache=ptr(k_cache, ki), k_stride_page=k_strides[0], k_stride_token=k_strides[1],
                k_stride_head=k_strides[2],
                v_cache=ptr(v_cache, vi), v_stride_page=v_strides[0], v_stride_token=v_strides[1],
                v_stride_head=v_strides[2],
                block_tables=ptr(block_tables, bi), block_tables_stride=bi.strides[0], seq_lens=ptr(seq_lens, si),
                num_kv_heads=self.shape.num_kv_heads, page_size=self.page_size, heads_per_cta=plan.heads_per_cta,
                qk_scale_log2=self.sm_scale * k_scale * LOG2E, v_scale=v_scale,
                out=ptr(out, oi), lse=ptr(lse, li), workspace=self._workspace_ptr, num_splits=plan.num_splits,
            )
            with launch_stream:
                self._launch(plan, args)
        return (out, lse) if want_lse else out

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

    def _check_indices(self, block_tables, seq_lens, num_pages: int, max_pages: int) -> None:
        lens = np.asarray(self.backend.host_copy(seq_lens))
        table = np.asarray(self.backend.host_copy(block_tables))
        capacity = max_pages * self.page_size
        bad = np.flatnonzero((lens < 0) | (lens > capacity))
        if bad.size:
            s = int(bad[0])
            raise ValueError(f"seq_lens[{s}] = {int(lens[s])} is outside 0..{capacity} "
                             f"(max_pages {max_pages} x page_size {self.page_size})")
        used = np.arange(max_pages)[None, :] < -(-lens[:, None] // self.page_size)
        wild = used & ((table < 0) | (table >= num_pages))
        if wild.any():
            s, j = map(int, np.argwhere(wild)[0])
            raise ValueError(f"block_tables[{s}, {j}] = {int(table[s, j])} is not a page id in 0..{num_pages - 1}")

    def _launch(self, plan: DecodePlan, args: dict) -> None:
        """Launch ``plan``'s kernels, each with the parameters its source declares, by name."""
        variant, module = self._modules[plan.arm, plan.row_tiles]
        for i, grid in enumerate(plan.launches):
            values = tuple(args[name] if typ is None else typ(args[name]) for name, typ in self._abi[grid.kernel])
            if i == 0:  # the attention kernel
                module.launch(Launch(grid.kernel, grid.grid, (self._threads, 1, 1), variant.shared_bytes, values))
            else:  # the merge
                module.launch(Launch(grid.kernel, grid.grid, (self._merge_threads, 1, 1), 0, values))


def _where(device) -> str:
    return "host memory" if device is None else f"cuda:{device}"


def _dtype(info: ArrayInfo, argument: str, expected: str) -> None:
    name = dtypes.name_of(info.dtype)
    if name != expected:
        raise ValueError(f"{argument} must hold {expected} values (as this DecodeAttention was built), got {info.dtype}")


def _aligned(info: ArrayInfo, argument: str) -> None:
    if info.ptr % VECTOR_BYTES:
        raise ValueError(f"{argument} must start on a {VECTOR_BYTES}-byte boundary for vector loads "
                         f"(address {info.ptr:#x})")


def _vector_rows(info: ArrayInfo, argument: str) -> None:
    """Last dim contiguous; base and every other stride a multiple of 16 bytes."""
    if info.strides[-1] != 1:
        raise ValueError(f"{argument} must be contiguous in its last dim (stride 1), got strides {list(info.strides)}")
    _aligned(info, argument)
    per_vector = VECTOR_BYTES // info.itemsize
    odd = [s for s in info.strides[:-1] if s % per_vector]
    if odd:
        raise ValueError(f"{argument} strides must be multiples of {per_vector} elements ({VECTOR_BYTES} bytes) "
                         f"for vector loads, got {list(info.strides)}")


def _positive(argument: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{argument} must be a Python or NumPy float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{argument} must be a finite float > 0, got {value}")
    return value
