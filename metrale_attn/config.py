"""One layer's configuration, validated once: what the plan, the specs and the launch read.

``configure`` turns the keyword arguments a caller gives ``DecodeAttention`` (shape,
dtypes, layout, features, implementation, policy inputs) into a frozen ``LayerConfig``,
refusing a bad value with the argument's name. Nothing below it checks those values
again: ``plan.make_plan``, ``kernels.specs_for`` and the launch binding take the
config as true.

A feature of the ``mma`` core is one record of ``features.FEATURE_RECORDS``; ``FEATURES``
(name -> when a layer has it) is derived from them. The name is the feature's only
spelling: the kernels compile it as ``-DPD_<NAME>=0|1`` (``PD_WINDOW``), spec names carry
it as a suffix (``..._window``), and a kernel parameter named after a ``LayerConfig`` field
(``int window_left``) takes that field's value. Its keyword is checked here.
docs/adding-a-kernel-feature.md walks through it.

Pure: no backend, no device, no kernel source is touched here.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from . import dtypes, policy
from .features import FEATURE_RECORDS, SIMT_FEATURES, simt_features_line
from .targets import TargetPolicy
from .tiling import ONE_ROW_TILE_HEAD_DIM, max_row_tiles

HEAD_DIMS = tuple(range(64, 257, 16))
"""Head dims the ``mma`` kernels serve: every multiple of 16 from 64 to 256 (FlashAttention
rounds head dims up to its compiled sizes the same way; the core pads to a multiple of 32)."""
SIMT_HEAD_DIMS = (64, 128, 256, 512)
"""Head dims the ``simt`` reference kernels serve: a thread's slice tiles the row in a power
of two of lanes (simt/simt_core.cuh refuses the others at compile time). 512 (Gemma 4's global
layers) is theirs alone: with the default ``impl`` a layer there falls back to them
(``kernels.mma_refusal``)."""
SIMT_ONLY_HEAD_DIMS = tuple(d for d in SIMT_HEAD_DIMS if d not in HEAD_DIMS)
"""The head dims only the ``simt`` kernels serve (512): wider than the ``mma`` core's."""
NARROW_V_SHAPES = ((576, 512),)
"""``(head_dim, v_head_dim)`` pairs with values narrower than keys: MLA's absorbed decode
(512 latent + 64 rope dims of keys, the 512 latent of values; one KV head), on the ``simt``
unpacked and split-K kernels alone. Every other layer has ``v_head_dim == head_dim``."""
LAYOUTS = ("NHD", "HND")
MAX_PAGE_SIZE = 256
MAX_Q_LEN = 8
"""Query tokens per sequence in one call (multi-token decode: speculative verification, MTP)."""
MAX_WINDOW_LEFT = 2**31 - 1  # the kernels take window_left as an int32

IMPLS = ("mma", "simt")
"""``mma``: the tensor-core core, a CTA serves ``heads_per_cta`` heads of one KV head;
``simt``: the first CUDA-core kernels (the reference implementation), one head per CTA."""
DEFAULT_IMPL = "mma"
ENV_IMPL = "METRALE_ATTN_DECODE_IMPL"
ENV_HEADS_PER_CTA = "METRALE_ATTN_DECODE_HEADS_PER_CTA"
ENV_DEPENDENT_LAUNCH = "METRALE_ATTN_DECODE_PDL"

ROW_TILE = 8
"""Query rows (heads x query tokens) in one row tile of an ``mma`` CTA: the MMA's N side."""
MAX_ROWS_PER_CTA = 2 * ROW_TILE
"""Query rows one ``mma`` CTA can hold: two row tiles; ``max_rows_per_cta`` lowers it from
``tiling.ONE_ROW_TILE_HEAD_DIM`` on."""
LSE_BASES = {"e": "e", "2": "2", 2: "2"}  # a string (trimmed, any case) or an integer 2
"""The spellings of ``lse_base`` and the one each means."""
PAGE_TABLES = ("dense", "csr")
"""How ``run`` names each sequence's pages: a dense int32 table and lengths, or CSR (FlashInfer's)."""

FP32_MAX = 3.4028234663852886e38
FP32_MIN_NORMAL = 1.1754943508222875e-38
LOG2E = 1.4426950408889634
"""log2(e): the kernels hold logits in base 2, so the host folds this into their scales (the
kernels' own copy, ``PD_LOG2E``, is read back and checked: ``sources.source_constants``)."""
LN2 = 0.6931471805599453
"""ln 2: the kernels' lse is in base 2; the host passes this as ``lse_scale`` for a natural-log lse
(``PD_LN2`` in the kernels, checked the same way)."""


@dataclass(frozen=True)
class ModelShape:
    """Attention heads of one layer. ``num_q_heads`` is a multiple of ``num_kv_heads``."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: Optional[int] = None
    """The value and output width: None (``head_dim``) or a ``NARROW_V_SHAPES`` pair's."""

    def __post_init__(self) -> None:
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        for name in ("num_q_heads", "num_kv_heads", "head_dim", "v_head_dim"):
            value = policy.as_int(getattr(self, name))  # NumPy integers too, not bools
            if value is None or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
            object.__setattr__(self, name, value)
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.v_head_dim != self.head_dim:
            pairs = ", ".join(f"({k}, {v})" for k, v in NARROW_V_SHAPES)
            if (self.head_dim, self.v_head_dim) not in NARROW_V_SHAPES:
                raise ValueError(f"v_head_dim must equal head_dim, or (head_dim, v_head_dim) be one of {pairs} "
                                 f"(MLA absorbed), got head_dim {self.head_dim}, v_head_dim {self.v_head_dim}")
            if self.num_kv_heads != 1:
                raise ValueError(f"(head_dim, v_head_dim) ({self.head_dim}, {self.v_head_dim}) is MLA's absorbed "
                                 f"decode over one latent KV head: num_kv_heads must be 1, got {self.num_kv_heads}")
            return
        if self.head_dim not in HEAD_DIMS and self.head_dim not in SIMT_ONLY_HEAD_DIMS:
            narrow = [v for k, v in NARROW_V_SHAPES if k == self.head_dim]
            hint = f"; head_dim {self.head_dim} takes v_head_dim={narrow[0]} (MLA absorbed)" if narrow else ""
            raise ValueError(f"head_dim must be a multiple of 16 from 64 to 256 ({', '.join(map(str, HEAD_DIMS))}) "
                             f"or {', '.join(map(str, SIMT_ONLY_HEAD_DIMS))} (the simt kernels only), "
                             f"got {self.head_dim}{hint}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads


@dataclass(frozen=True)
class LayerConfig:
    """One attention layer as ``DecodeAttention`` serves it; every value already checked.

    Units and meanings are ``DecodeAttention``'s: ``sm_scale`` multiplies ``q . k``;
    ``window_left`` is -1 (none) or the keys before a token's position it still sees;
    ``logits_soft_cap`` None (none) or the cap; ``device_scales``: the dequantization scales
    are fp32 arrays on the device (per tensor or per KV head) that the kernels read, not host
    floats; ``lse_base`` ``"e"`` (the natural log, the default) or ``"2"`` (FlashInfer's
    base-2 states); ``page_table`` ``"dense"`` (``block_tables`` and ``seq_lens``, vLLM's) or
    ``"csr"`` (FlashInfer's ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``, read by the
    kernels as they are); ``heads_per_cta`` None (the plan's rule) or the override; ``impl``
    the implementation after any fallback; ``dependent_launch``
    whether the ``mma`` split-K merge is launched as the attention kernel's programmatic
    dependent where the device has it (sm_90 and later): it then starts while the attention
    grid's last items run and waits on the device for its end, which hides the merge's launch
    gap; bytes are the same either way.
    """

    shape: ModelShape
    page_size: int
    q_dtype: str
    kv_dtype: str
    max_batch: int
    target_policy: TargetPolicy
    kv_layout: str = "NHD"
    out_dtype: Optional[str] = None  # None: q_dtype
    sm_scale: Optional[float] = None  # None: 1 / sqrt(head_dim)
    max_decode_seqs: int = 1
    impl: str = DEFAULT_IMPL
    heads_per_cta: Optional[int] = None
    max_q_len: int = 1
    window_left: int = -1
    logits_soft_cap: Optional[float] = None
    sinks: bool = False
    device_scales: bool = False
    lse_base: str = "e"
    page_table: str = "dense"
    dependent_launch: bool = True
    features: frozenset = field(init=False)
    """The ``FEATURES`` this layer compiles (``multi_token`` for calls of ``q_len > 1`` only)."""

    def __post_init__(self) -> None:
        if self.out_dtype is None:
            object.__setattr__(self, "out_dtype", self.q_dtype)
        if self.sm_scale is None:
            object.__setattr__(self, "sm_scale", 1.0 / math.sqrt(self.shape.head_dim))
        object.__setattr__(self, "features", frozenset(name for name, has in FEATURES.items() if has(self)))

    @property
    def target(self):
        return self.target_policy.target

    @property
    def max_rows(self) -> int:
        """Query rows an ``mma`` CTA of this head dim holds (``max_rows_per_cta``)."""
        return max_rows_per_cta(self.shape.head_dim)

    def features_at(self, q_len: int) -> frozenset:
        """The features a call of ``q_len`` query tokens runs with: ``multi_token`` only when
        ``q_len > 1`` (a one-token call of a multi-token layer takes the plain kernels)."""
        return self.features if q_len > 1 else self.features - {"multi_token"}

    @property
    def mma_only(self) -> tuple[str, ...]:
        """What this layer asks that only the ``mma`` kernels serve: its features but those the
        ``simt`` kernels serve too (``features.SIMT_FEATURES``: multi-token decode, device scales,
        the CSR page table), an e5m2 cache, a
        head dim outside ``SIMT_HEAD_DIMS``."""
        head_dim = self.shape.head_dim
        return (tuple(sorted(self.features - SIMT_FEATURES)) + (("fp8 e5m2 cache",) if self.kv_dtype == dtypes.FP8_E5M2 else ())
                + ((simt_head_dim_refusal(head_dim),)
                   if head_dim not in SIMT_HEAD_DIMS and self.shape.v_head_dim == head_dim else ()))


FEATURES: dict[str, Callable[[LayerConfig], bool]] = {f.name: f.has for f in FEATURE_RECORDS}
"""The ``mma`` core's specializations, by name, and when a layer has each (``features``:
one record per feature says it, and everything else the host derives for it). Each compiles
as ``-DPD_<NAME>=0|1`` (``feature_define``), so the plain path compiles none of their code."""


def feature_define(name: str) -> str:
    """The ``-D`` name of a feature: ``PD_`` and the name in capitals (``PD_WINDOW``)."""
    return f"PD_{name.upper()}"


def configure(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    *,
    v_head_dim: Optional[int] = None,
    q_dtype,
    kv_dtype,
    max_batch: int,
    target_policy: TargetPolicy,
    kv_layout: str = "NHD",
    out_dtype=None,
    sm_scale: Optional[float] = None,
    max_decode_seqs: int = 1,
    impl: Optional[str] = None,
    heads_per_cta: Optional[int] = None,
    max_q_len: int = 1,
    window_left: int = -1,
    logits_soft_cap: Optional[float] = None,
    sinks: bool = False,
    device_scales: bool = False,
    lse_base="e",
    page_table: str = "dense",
    dependent_launch: Optional[bool] = None,
    environ=None,
) -> LayerConfig:
    """A ``LayerConfig`` from ``DecodeAttention``'s keyword arguments, each checked here and
    refused with its name: integers may be any ``numbers.Integral`` (never a bool), dtypes
    strings or NumPy/ml_dtypes/torch dtypes, and ``impl``/``heads_per_cta`` fall back to
    ``METRALE_ATTN_DECODE_IMPL``/``METRALE_ATTN_DECODE_HEADS_PER_CTA`` (read from
    ``environ``, default ``os.environ``) when None, and ``dependent_launch`` to
    ``METRALE_ATTN_DECODE_PDL``, else on. ``target_policy``: the target and its resolved
    policy (``targets.resolve_target_policy``)."""
    env = os.environ if environ is None else environ
    shape = ModelShape(num_q_heads, num_kv_heads, head_dim, v_head_dim)
    page_size = int_in("page_size", page_size, 1, MAX_PAGE_SIZE)
    max_batch = int_in("max_batch", max_batch, 1)
    max_decode_seqs = int_in("max_decode_seqs", max_decode_seqs, 0)
    layout = str(kv_layout).strip().upper()  # trimmed, like every other string option
    if layout not in LAYOUTS:
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    q_dtype = dtypes.canonical(q_dtype, argument="q_dtype", allowed=dtypes.Q_DTYPES)
    kv_dtype = dtypes.canonical(kv_dtype, argument="kv_dtype", allowed=dtypes.KV_DTYPES)
    sm_scale = 1.0 / math.sqrt(shape.head_dim) if sm_scale is None else positive("sm_scale", sm_scale)
    max_q_len = int_in("max_q_len", max_q_len, 1, MAX_Q_LEN)
    window_left = int_in("window_left", window_left, -1, MAX_WINDOW_LEFT)
    logits_soft_cap = soft_cap(logits_soft_cap)
    check_logit_fold(sm_scale, logits_soft_cap)
    if not isinstance(sinks, bool):
        raise TypeError(f"sinks must be a bool (whether run() takes sink logits), got {sinks!r}")
    if not isinstance(device_scales, bool):
        raise TypeError(f"device_scales must be a bool (whether run() takes k_scales and v_scales arrays on the "
                        f"device), got {device_scales!r}")
    base = LSE_BASES.get(lse_base.strip().lower() if isinstance(lse_base, str) else policy.as_int(lse_base))
    if base is None:
        raise ValueError(f"lse_base must be 'e' (natural log, the default) or 2 (base 2, as FlashInfer's states), "
                         f"got {lse_base!r}")
    table = page_table.strip().lower() if isinstance(page_table, str) else None
    if table not in PAGE_TABLES:
        raise ValueError(f"page_table must be one of {', '.join(PAGE_TABLES)} (block_tables and seq_lens, or "
                         f"FlashInfer's kv_indptr, kv_indices and kv_last_page_len), got {page_table!r}")
    out_dtype = q_dtype if out_dtype is None else dtypes.canonical(out_dtype, argument="out_dtype",
                                                                   allowed=(q_dtype, dtypes.FLOAT32))
    chosen = impl_chosen(impl, env.get(ENV_IMPL))
    impl = resolve_impl(impl, env.get(ENV_IMPL))
    if impl == "mma" and chosen and shape.head_dim not in HEAD_DIMS:
        raise ValueError(f"impl='mma' has no {mma_head_dim_refusal(shape.head_dim)}: use impl='simt', or leave impl "
                         f"and {ENV_IMPL} unset (the default takes simt there)")
    if impl == "simt" and shape.head_dim not in SIMT_HEAD_DIMS and shape.v_head_dim == shape.head_dim:
        raise ValueError(f"impl='simt' has no {simt_head_dim_refusal(shape.head_dim)}: use impl='mma' (impl or "
                         f"{ENV_IMPL})")
    config = LayerConfig(shape, page_size, q_dtype, kv_dtype, max_batch, target_policy, layout, out_dtype, sm_scale,
                         max_decode_seqs, impl, None, max_q_len, window_left, logits_soft_cap, sinks, device_scales,
                         base, table, resolve_dependent_launch(dependent_launch, env.get(ENV_DEPENDENT_LAUNCH)))
    if config.impl == "simt" and config.mma_only:
        raise ValueError(f"impl='simt' has no {', '.join(config.mma_only)} (features it lacks: {simt_features_line()}; "
                         "fp8_e5m2 caches): use impl='mma'")
    override = resolve_heads_per_cta(heads_per_cta, env.get(ENV_HEADS_PER_CTA), shape.group_size, max_q_len,
                                     max_rows_per_cta(shape.head_dim))
    return replace(config, heads_per_cta=override)


# -- the implementation and heads per CTA -----------------------------------------------


def resolve_impl(impl: Optional[str], env_raw: Optional[str]) -> str:
    """The implementation: the ``impl`` argument, else a non-empty ``METRALE_ATTN_DECODE_IMPL``,
    else ``mma``. Either spelling must be one of ``IMPLS`` (trimmed, case-insensitive)."""
    for value, where in ((impl, "impl"), (env_raw, ENV_IMPL)):
        if value is None or (where == ENV_IMPL and not policy.normalize(value)):
            continue
        name = policy.normalize(str(value))
        if name not in IMPLS:
            raise ValueError(f"{where} must be one of {', '.join(IMPLS)}, got {value!r}")
        return name
    return DEFAULT_IMPL


def resolve_dependent_launch(value: Optional[bool], env_raw: Optional[str]) -> bool:
    """Whether the split-K merge is launched as a programmatic dependent: the
    ``dependent_launch`` argument (a bool), else a non-empty ``METRALE_ATTN_DECODE_PDL``
    (``1``/``on``/``true``/``yes`` or ``0``/``off``/``false``/``no``, trimmed, any case), else on."""
    if value is not None:
        if not isinstance(value, bool):
            raise ValueError(f"dependent_launch must be True, False or None, got {value!r}")
        return bool(value)
    if env_raw is None or not policy.normalize(env_raw):
        return True
    parsed = policy.parse_gqa_pack(env_raw)  # the package's one on/off spelling
    if parsed is None:
        raise ValueError(f"{ENV_DEPENDENT_LAUNCH} must be on or off (1/0, true/false, yes/no), got {env_raw!r}")
    return parsed


def impl_chosen(impl: Optional[str], env_raw: Optional[str]) -> bool:
    """Whether the caller chose the implementation (the ``impl`` argument, or a non-empty
    ``METRALE_ATTN_DECODE_IMPL``) rather than taking the default: a chosen ``mma`` is never
    silently replaced."""
    return impl is not None or bool(policy.normalize(env_raw or ""))


def mma_head_dim_refusal(head_dim: int) -> str:
    """What the ``mma`` kernels lack at ``head_dim``, as the errors name it."""
    return (f"head_dim {head_dim} (the mma kernels take every multiple of 16 from {min(HEAD_DIMS)} to "
            f"{max(HEAD_DIMS)})")


def simt_head_dim_refusal(head_dim: int) -> str:
    """What the ``simt`` kernels lack at ``head_dim``, as the errors name it."""
    return f"head_dim {head_dim} (the simt kernels take head_dim {', '.join(map(str, SIMT_HEAD_DIMS))})"


def max_rows_per_cta(head_dim: int) -> int:
    """Query rows an ``mma`` CTA holds at ``head_dim``: 16, but 8 from ``ONE_ROW_TILE_HEAD_DIM``
    (208) on, where 16 rows' fp32 accumulators leave ptxas no room without spilling
    (``tiling.max_row_tiles``)."""
    return ROW_TILE * max_row_tiles(head_dim)


def heads_per_cta_choices(group_size: int, q_len: int = 1, max_rows: int = MAX_ROWS_PER_CTA) -> tuple[int, ...]:
    """The divisors of the group size an ``mma`` CTA can hold with ``q_len`` query tokens
    each (``h x q_len <= max_rows``, see ``max_rows_per_cta``)."""
    return tuple(d for d in range(1, min(group_size, max_rows // q_len) + 1) if group_size % d == 0)


def resolve_heads_per_cta(value, env_raw: Optional[str], group_size: int, max_q_len: int = 1,
                          max_rows: int = MAX_ROWS_PER_CTA) -> Optional[int]:
    """An override of the rule: the ``heads_per_cta`` argument, else a non-empty
    ``METRALE_ATTN_DECODE_HEADS_PER_CTA``; None when neither is set. It must be one of
    ``heads_per_cta_choices(group_size)``: a value the kernels cannot serve is an error,
    never silently replaced."""
    where = "heads_per_cta"
    if value is None:
        if env_raw is None or not policy.normalize(env_raw):
            return None
        value, where = policy.parse_count(env_raw), ENV_HEADS_PER_CTA
        if value is None:
            raise ValueError(f"{ENV_HEADS_PER_CTA} must be a positive decimal integer (ASCII digits), got {env_raw!r}")
    elif policy.as_int(value) is None:
        raise TypeError(f"heads_per_cta must be an int (any numbers.Integral, not a bool) or None, got {value!r}")
    value = policy.as_int(value)
    choices = heads_per_cta_choices(group_size, max_q_len, max_rows)
    if value not in choices:
        limit = f" ({max_q_len} query tokens each)" if max_q_len > 1 else ""
        if max_rows < MAX_ROWS_PER_CTA:
            limit += f" (a CTA holds {max_rows} rows from head_dim {ONE_ROW_TILE_HEAD_DIM} on)"
        raise ValueError(f"{where} must divide the group size {group_size} and be at most "
                         f"{max_rows // max_q_len}{limit}: one of {', '.join(map(str, choices))}; got {value}")
    return value


# -- scalar arguments ---------------------------------------------------------------------


def int_in(argument: str, value, low: int, high: Optional[int] = None) -> int:
    """``value`` as an int (any ``numbers.Integral``, not a bool) in ``low..high``."""
    checked = policy.as_int(value)
    if checked is None or checked < low or (high is not None and checked > high):
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{argument} must be an int {bound}, got {value!r}")
    return checked


def as_float(argument: str, value) -> float:
    """A real number as a Python float; an integer beyond the float range is inf."""
    if type(value) is float:  # the common case, without the ABC check below
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{argument} must be a Python or NumPy float, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:  # float(10**400)
        return math.inf if value > 0 else -math.inf


def positive(argument: str, value) -> float:
    """A finite float > 0."""
    as_float_ = as_float(argument, value)
    if not math.isfinite(as_float_) or as_float_ <= 0:
        raise ValueError(f"{argument} must be a finite float > 0, got {as_float_}")
    return as_float_


def soft_cap(value) -> Optional[float]:
    """The logits soft-cap, or None for none: None and 0 mean no cap, as in FlashInfer, vLLM
    and FlashAttention.

    The kernels take the cap and ``cap * log2(e)`` (logits in base 2) as fp32 values: a cap
    for which either is past ``FP32_MAX`` or below the smallest normal fp32 would fail every
    ``run`` (``validation.logit_scales``), so it is refused here, where it is known."""
    if value is None:
        return None
    cap = as_float("logits_soft_cap", value)
    if cap == 0:
        return None
    if not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"logits_soft_cap must be a finite float > 0 (or 0/None: no cap), got {value!r}")
    if not (fp32_normal(cap) and fp32_normal(cap * LOG2E)):
        raise ValueError(f"logits_soft_cap = {cap:.6g}: the kernels fold it into cap * log2(e) = {cap * LOG2E:.6g}; "
                         f"both must be finite normal fp32 values ({FP32_MIN_NORMAL:.6g} .. {FP32_MAX:.6g}), so the "
                         f"cap must lie in {FP32_MIN_NORMAL:.6g} .. {FP32_MAX / LOG2E:.6g}")
    return cap


def check_logit_fold(sm_scale: float, cap: Optional[float]) -> None:
    """Some k_scale lets a call run: the kernels' logit scale, ``sm_scale * k_scale * log2(e)``
    (with a soft-cap ``sm_scale * k_scale / cap``), must be a normal fp32 value for a k_scale
    that is one (``validation.scales``, ``logit_scales``), so a factor ``sm_scale * log2(e)``
    (``sm_scale / cap``) outside ``FP32_MIN_NORMAL / FP32_MAX .. FP32_MAX / FP32_MIN_NORMAL``
    would have every ``run`` refused: refused here instead, naming ``sm_scale``."""
    factor, what = (sm_scale * LOG2E, "sm_scale * log2(e)") if cap is None else (sm_scale / cap, "sm_scale / cap")
    low, high = FP32_MIN_NORMAL / FP32_MAX, FP32_MAX / FP32_MIN_NORMAL
    if not low <= factor <= high:
        with_cap = "" if cap is None else f" with logits_soft_cap = {cap:.6g}"
        raise ValueError(f"sm_scale = {sm_scale:.6g}{with_cap}: the kernels' logit scale {what} x k_scale = "
                         f"{factor:.6g} x k_scale is a normal fp32 value for no normal fp32 k_scale, so every run() "
                         f"would be refused: {what} must lie in {low:.6g} .. {high:.6g}")


def fp32_normal(value: float) -> bool:
    """Whether ``value`` is a finite normal fp32 magnitude (what the kernels can fold a scale into)."""
    return FP32_MIN_NORMAL <= value <= FP32_MAX
