"""Kernel specs: what each backend compiles (``KernelSpec``), which specs a layer reaches
(``specs_for``, ``all_specs``), and where the ``mma`` kernels cannot run (``mma_refusal``,
``launchable_config``). The sources themselves, and what is read back from them, are
``sources``.

Two implementations (``config.IMPLS``) serve the same three arms (``plan.ARMS``):

- ``mma`` (the default): ``decode_core.cuh``, the tensor-core core, its features and
  its one kernel (which each arm's ``decode_<arm>.cu`` names and selects): a CTA serves
  ``heads_per_cta`` query heads of one KV head, K and V stream through cp.async rings in
  shared memory, QK^T and PV run on ``mma.sync``.
- ``simt``: the reference implementation, the first CUDA-core kernels:
  ``simt/simt_core.cuh``, its core and its one kernel (which each
  ``simt/simt_decode_<arm>.cu`` names and selects), one query head per CTA (the packed
  arm: ``PD_GQA``). Kept selectable until a GPU has measured ``mma``.
What both share is ``pd_common.cuh`` (and ``pd_splitk.cuh``, ``pd_convert.cuh``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from . import dtypes, policy
from .config import (DEFAULT_IMPL, FEATURES, HEAD_DIMS, IMPLS, NARROW_V_SHAPES, ROW_TILE, SIMT_HEAD_DIMS, LayerConfig, ModelShape,
                     feature_define, heads_per_cta_choices, max_rows_per_cta)
from .features import SIMT_FEATURES
from .plan import ARMS, KERNELS, make_plan
from .sources import (SOURCE_FILES, KernelSourceError, Param, check_pack_constants, inline, parse_kernel_params,
                      read_define, read_source, source_constants)
from .targets import FP8_CVT_CAPABILITY
from .tiling import ONE_ROW_TILE_HEAD_DIM, SMEM_LIMIT_BYTES, Tiling, max_row_tiles, mma_tiling

# ---------------------------------------------------------------------------------------
# Specs
# ---------------------------------------------------------------------------------------


def mma_shape_refusal(config: LayerConfig) -> str | None:
    """Why the ``mma`` core has no kernel of this layer's shape on any target, or None: a head
    dim past its widest (512, which only the ``simt`` kernels serve). Asks nothing of a device,
    so a construction does not run the ``mma`` self-test for such a layer."""
    return mma_shape_refusal_of(config.shape)


def mma_shape_refusal_of(shape: ModelShape) -> str | None:
    """``mma_shape_refusal`` of a shape alone (what ``metrale-attn check`` plans with)."""
    head_dim = shape.head_dim
    if shape.v_head_dim != head_dim:
        return (f"(head_dim, v_head_dim) ({head_dim}, {shape.v_head_dim}) has no mma kernel (values "
                f"narrower than keys: MLA's absorbed decode is the simt kernels')")
    if head_dim in HEAD_DIMS:
        return None
    return f"head_dim {head_dim} is wider than the mma core's {min(HEAD_DIMS)}..{max(HEAD_DIMS)}"


def mma_refusal(config: LayerConfig) -> str | None:
    """Why the ``mma`` kernels of this layer cannot run on its target, or None when they can:
    its head dim is past the core's (``mma_shape_refusal``), its fp8 cache needs the fp8
    ``cvt`` the target lacks (sm_80, sm_86; the ``simt`` kernels convert in software), or no
    tiling fits the target's shared memory per block (one fits every target today: 2 warps
    of 2 stages fit 99 KiB at head dim 256)."""
    shape_why = mma_shape_refusal(config)
    if shape_why:
        return shape_why
    target = config.target
    if config.kv_dtype in dtypes.FP8_KINDS and not target.converts_fp8:
        return (f"the mma kernels read fp8 caches with PTX's fp8 cvt, which {target.name} ({target.arch}) lacks "
                f"(sm_89 and later have it)")
    shape = (config.shape.head_dim, config.q_dtype, config.kv_dtype, max_row_tiles(config.shape.head_dim))
    if mma_tiling(*shape, target.smem_per_block) is None:
        need = mma_tiling(*shape, SMEM_LIMIT_BYTES)
        return (f"the mma kernels of this shape ask for {need.smem_bytes} bytes of shared memory "
                f"per block; {target.name} ({target.arch}) allows {target.smem_per_block}")
    return None


def launchable_config(config: LayerConfig, disagree, chosen: bool) -> tuple[LayerConfig, str | None]:
    """``(config, None)``, or the same with ``impl="simt"`` and why, where the ``mma`` kernels
    cannot serve it: ``disagree`` (the instructions the device's known-answer self-test found
    to differ from the emulation the kernels were verified on) is not empty, or the target
    cannot run them (``mma_refusal``); a head dim only ``simt`` serves falls back for that
    reason whatever the self-test found. Refused when the layer asks for something only
    ``mma`` serves, or (the target) when the caller chose ``mma`` (``chosen``). Pure: the
    caller runs the self-test and reports the fallback (``precompile`` asks what each outcome
    of a self-test it cannot run would compile)."""
    if config.impl != "mma":
        return config, None
    if disagree and mma_shape_refusal(config) is None:  # never return bytes from instructions that differ
        if config.mma_only:
            raise RuntimeError(f"this device's {', '.join(disagree)} disagree with the emulation the mma "
                               f"kernels were verified on, and only they serve the features asked for "
                               f"({', '.join(config.mma_only)})")
        return replace(config, impl="simt"), (f"this device's {', '.join(disagree)} disagree with the emulation "
                                              "the mma kernels were verified on")
    why = mma_refusal(config)
    if why:  # a kernel the target cannot run never launches
        if config.mma_only or chosen:
            lacks = ", ".join(config.mma_only) or f"features but {', '.join(sorted(SIMT_FEATURES))}, no e5m2"
            raise ValueError(f"{why}: they cannot launch there (impl='simt' has no {lacks})")
        return replace(config, impl="simt"), why
    return config, None


@dataclass(frozen=True)
class KernelSpec:
    """One compiled specialization. Its ``name`` carries every parameter and is the memo key.

    ``row_tiles`` (``mma`` only): query-row tiles of 8 the CTA holds, so it serves up
    to ``8 * row_tiles`` heads. The KV layout is not a parameter: kernels address the
    cache by strides. ``smem_limit`` (``mma``): the dynamic shared memory per block of the
    target it is built for (bytes), which sizes its ``tiling`` (``tiling.mma_tiling``). The
    name carries the tiling wherever it differs from the sm_90 one (``_w2t16s2``).
    """

    arm: str
    head_dim: int
    q_dtype: str
    kv_dtype: str
    impl: str = DEFAULT_IMPL
    row_tiles: int = 1
    features: frozenset = frozenset()
    """Which of ``FEATURES`` this spec is compiled with (each a specialization: the plain path
    compiles none of their code); ``simt``: only ``features.SIMT_FEATURES``, in any combination
    but multi-token on the packed arm (it serves one query token)."""
    smem_limit: int = SMEM_LIMIT_BYTES
    v_head_dim: int | None = None
    """The values' width: None or ``head_dim`` (the same kernel), else a ``NARROW_V_SHAPES`` pair's
    (``simt`` unpacked and split-K only; ``-DPD_V_HEAD_DIM`` and ``_v<dim>`` in the name)."""
    v_in_k: bool = False
    """With ``v_head_dim``: V read from K's registers, for calls whose ``v_cache`` is ``k_cache``'s
    first ``v_head_dim`` dims (``-DPD_V_IN_K=1``, ``_vink`` in the name; the binder picks it)."""

    def __post_init__(self) -> None:
        if self.v_head_dim == self.head_dim:
            object.__setattr__(self, "v_head_dim", None)
        if self.v_head_dim is not None:
            if ((self.head_dim, self.v_head_dim) not in NARROW_V_SHAPES or self.impl != "simt"
                    or self.arm == "gqa_packed"):
                raise ValueError(f"(head_dim, v_head_dim) ({self.head_dim}, {self.v_head_dim}) has no {self.impl} "
                                 f"{self.arm} kernel: only the simt unpacked and split-K kernels take "
                                 f"{', '.join(map(str, NARROW_V_SHAPES))}")
        if self.v_in_k is not False and (self.v_in_k is not True or self.v_head_dim is None
                                         or self.kv_dtype not in V_IN_K_KV_DTYPES):
            raise ValueError(f"v_in_k is a bool, True only with a v_head_dim narrower than head_dim and a "
                             f"{', '.join(V_IN_K_KV_DTYPES)} cache, got {self.v_in_k!r} at v_head_dim "
                             f"{self.v_head_dim}, {self.kv_dtype}")
        if isinstance(self.smem_limit, bool) or not isinstance(self.smem_limit, int) or self.smem_limit <= 0:
            raise ValueError(f"smem_limit must be a positive int (bytes per block), got {self.smem_limit!r}")
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {self.impl!r}")
        if self.arm not in ARMS:
            raise ValueError(f"arm must be one of {', '.join(ARMS)}, got {self.arm!r}")
        if self.q_dtype not in dtypes.Q_DTYPES or self.kv_dtype not in dtypes.KV_DTYPES:
            raise ValueError(f"unsupported dtypes q={self.q_dtype!r} kv={self.kv_dtype!r}")
        allowed = ((policy.DECODE_GQA_PACK_HEAD_DIM,) if self.arm == "gqa_packed"
                   else HEAD_DIMS if self.impl == "mma" else SIMT_HEAD_DIMS)
        if self.head_dim not in allowed and self.v_head_dim is None:
            raise ValueError(f"the {self.arm} kernel supports head_dim {allowed}, got {self.head_dim}")
        if self.row_tiles not in (tuple(range(1, max_rows_per_cta(self.head_dim) // ROW_TILE + 1)) if self.impl == "mma"
                                  else (1,)):
            raise ValueError(f"row_tiles must be 1 or 2 (mma; 1 from head dim {ONE_ROW_TILE_HEAD_DIM} on) "
                             f"or 1 (simt), got {self.row_tiles!r}")
        object.__setattr__(self, "features", frozenset(self.features))
        unknown = self.features - set(FEATURES)
        if unknown:
            raise ValueError(f"features must be among {', '.join(FEATURES)}, got {sorted(unknown)}")
        if self.impl == "simt" and (self.features - SIMT_FEATURES or self.kv_dtype == dtypes.FP8_E5M2):
            raise ValueError(f"the simt kernels have no features but {', '.join(sorted(SIMT_FEATURES))} (no sinks, "
                             "window, soft-cap, fp32 out) and no fp8 e5m2 cache: use impl='mma'")
        if self.impl == "simt" and self.arm == "gqa_packed" and "multi_token" in self.features:
            raise ValueError("the simt gqa_packed kernel serves one query token (no multi_token spec)")

    @property
    def name(self) -> str:
        dt = f"q{self.q_dtype}_kv{self.kv_dtype}_hd{self.head_dim}"
        if self.impl == "simt":
            return (f"simt_decode_{self.arm}_{dt}" + (f"_v{self.v_head_dim}" if self.v_head_dim else "")
                    + ("_vink" if self.v_in_k else "") + "".join(f"_{f}" for f in FEATURES if f in self.features))
        sm90 = mma_tiling(self.head_dim, self.q_dtype, self.kv_dtype, self.row_tiles)
        return (f"decode_{self.arm}_{dt}_r{ROW_TILE * self.row_tiles}" + "".join(
            f"_{f}" for f in FEATURES if f in self.features) + (f"_{self.tiling.label}" if self.tiling != sm90 else ""))

    def builds_for(self, arch: str) -> bool:
        """Whether this spec compiles for ``arch`` (``sm_XY``): the ``mma`` core reads fp8
        caches with the fp8 ``cvt`` of sm_89 and later (``targets.FP8_CVT_CAPABILITY``)."""
        fp8_cvt = int(arch.removeprefix("sm_")) >= 10 * FP8_CVT_CAPABILITY[0] + FP8_CVT_CAPABILITY[1]
        return fp8_cvt or self.impl != "mma" or self.kv_dtype not in dtypes.FP8_KINDS

    @property
    def filename(self) -> str:
        return SOURCE_FILES[self.impl, self.arm]

    @property
    def kernels(self) -> tuple[str, ...]:
        return KERNELS[self.impl, self.arm]

    @property
    def max_rows(self) -> int:
        """Query heads one CTA of this spec serves at most."""
        return ROW_TILE * self.row_tiles if self.impl == "mma" else 1

    @functools.cached_property
    def tiling(self) -> Tiling | None:
        """The K/V stream of an ``mma`` spec on its target (None for ``simt``)."""
        if self.impl != "mma":
            return None
        tiling = mma_tiling(self.head_dim, self.q_dtype, self.kv_dtype, self.row_tiles, self.smem_limit)
        if tiling is None:
            raise KernelSourceError(f"no tiling of the mma kernel at head dim {self.head_dim} "
                                    f"({self.kv_dtype} cache, {self.row_tiles} row tile(s)) fits {self.smem_limit} "
                                    "bytes of shared memory per block (kernels.mma_refusal says so first)")
        return tiling

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory of the attention kernel's launch (the merge takes none)."""
        return self.tiling.smem_bytes if self.tiling else 0

    @property
    def threads(self) -> int:
        """The attention kernel's block size: the tiling's warps (``mma``), ``PD_THREADS`` (``simt``)."""
        return self.tiling.threads if self.tiling else source_constants().threads

    def source(self, text: str | None = None) -> str:
        """The self-contained source; ``text`` replaces the arm's file (tests)."""
        full = inline(self.filename, text)
        if self.arm == "gqa_packed":
            check_pack_constants(full, self.filename)
        return full

    def defines(self) -> dict[str, int]:
        """``-D`` values: everything the kernels take from Python."""
        codes = source_constants().dtype_codes
        out = {
            "PD_HEAD_DIM": self.head_dim,
            "PD_Q_DTYPE": codes[self.q_dtype],
            "PD_KV_DTYPE": codes[self.kv_dtype],
            "PD_MIN_KV_PER_SPLIT": policy.PD_MIN_KV_PER_SPLIT,
        }
        if self.v_head_dim is not None:
            out["PD_V_HEAD_DIM"] = self.v_head_dim
        if self.v_in_k:
            out["PD_V_IN_K"] = 1
        if self.impl == "simt":  # only the features it has: a plain simt spec's defines are as before them
            out.update({feature_define(f): 1 for f in FEATURES if f in self.features})
        if self.tiling:
            t = self.tiling
            out.update(PD_ROW_TILES=self.row_tiles, PD_TILE_TOKENS=t.tile_tokens, PD_STAGES=t.stages,
                       PD_MMA_WARPS=t.warps, PD_PREFETCH=t.prefetch, PD_SMEM_BYTES=t.smem_bytes)
            out.update({feature_define(f): int(f in self.features) for f in FEATURES})
        return out


@dataclass(frozen=True)
class SelfTest:
    """The known-answer test of the mma kernels' instructions (``kernels_cu/pd_selftest.cu``;
    expected values in ``backends/selftest.py``). Builds like a spec."""

    name: str = "pd_selftest"
    filename: str = "pd_selftest.cu"
    kernels: tuple[str, ...] = ("pd_selftest",)
    shared_bytes: int = 0

    def source(self, text: str | None = None) -> str:
        return inline(self.filename, text)

    def defines(self) -> dict[str, int]:
        return {}


@dataclass(frozen=True)
class MergeStates:
    """The state-merge kernel (``kernels_cu/merge_states.cu``) for one pair of dtypes
    (``bf16``, ``fp16`` or ``float32`` in and out). Builds like a spec."""

    in_dtype: str
    out_dtype: str
    filename: str = "merge_states.cu"
    kernels: tuple[str, ...] = ("merge_states",)
    shared_bytes: int = 0

    @property
    def name(self) -> str:
        return f"merge_states_in{self.in_dtype}_out{self.out_dtype}"

    def source(self, text: str | None = None) -> str:
        return inline(self.filename, text)

    def defines(self) -> dict[str, int]:
        codes = source_constants().dtype_codes
        return {"PD_IN_DTYPE": codes[self.in_dtype], "PD_OUT_DTYPE": codes[self.out_dtype]}

    @property
    def threads(self) -> int:
        return read_define(read_source(self.filename), "PD_STATE_THREADS")


@functools.cache
def kernel_params(spec: KernelSpec) -> dict[str, tuple[Param, ...]]:
    """The parameters of each kernel of ``spec``, read from its source: the ABI."""
    found = parse_kernel_params(spec.source(), spec.defines())
    missing = [k for k in spec.kernels if k not in found]
    if missing:
        raise KernelSourceError(f"kernels_cu/{spec.filename} defines no kernel {', '.join(missing)}")
    return {k: found[k] for k in spec.kernels}


V_IN_K_KV_DTYPES = (dtypes.BF16,)
"""The caches whose MLA kernels read V from K's registers when ``v_cache`` aliases ``k_cache``:
bf16 only. fp16 and fp8 rows spill with it on sm_90 and later (their V slices, converted apart
from K's, then share K's words: ptxas keeps both live at 128 registers), so they read V again."""


def v_in_k_served(config: LayerConfig) -> bool:
    """Whether this layer compiles the ``v_in_k`` specs beside its own (``specs_for``) for calls whose
    ``v_cache`` is ``k_cache``'s first ``v_head_dim`` dims (``binding.CallBinder`` decides per call)."""
    return config.shape.v_head_dim != config.shape.head_dim and config.kv_dtype in V_IN_K_KV_DTYPES


def all_specs() -> list[KernelSpec]:
    """Every plain spec the dispatch can ask for (MLA's 576/512 on the simt unpacked and split-K
    arms among them), and the feature specs CI compiles:
    each feature alone on every mma arm (head dim 128, fp8 KV; the packed arm at 256),
    and all of them together on the heaviest (8 rows of head dim 256, 16 of 192 and of 128);
    multi-token paired with csr and with device scales (``multi_token_pairs``);
    then the simt features' specs (``simt_feature_specs``), last, so the plain specs keep their
    places (``benchmarks/cubin_identity.py`` samples by index)."""
    plain = [
        KernelSpec(arm, head_dim, q, kv, impl, row_tiles)
        for impl in IMPLS
        for arm in ARMS
        for head_dim in ((policy.DECODE_GQA_PACK_HEAD_DIM,) if arm == "gqa_packed"
                         else HEAD_DIMS if impl == "mma" else SIMT_HEAD_DIMS)
        for row_tiles in (range(1, max_rows_per_cta(head_dim) // ROW_TILE + 1) if impl == "mma" and arm != "gqa_packed"
                          else (1,))
        for q in dtypes.Q_DTYPES
        for kv in dtypes.KV_DTYPES
        if impl == "mma" or kv != dtypes.FP8_E5M2
    ] + [
        KernelSpec(arm, head_dim, q, kv, "simt", v_head_dim=v_head_dim, v_in_k=v_in_k)  # MLA absorbed
        for head_dim, v_head_dim in NARROW_V_SHAPES
        for v_in_k in (False, True)
        for arm in ("unpacked", "splitk")
        for q in dtypes.Q_DTYPES
        for kv in dtypes.KV_DTYPES
        if kv != dtypes.FP8_E5M2 and (not v_in_k or kv in V_IN_K_KV_DTYPES)
    ]
    featured = [
        KernelSpec(arm, 256 if arm == "gqa_packed" else 128, dtypes.BF16, dtypes.FP8, "mma", 1, {feature})
        for arm in ARMS
        for feature in FEATURES
        if not (arm == "gqa_packed" and feature == "multi_token")  # the packed arm serves one query token
    ]
    every = [KernelSpec(arm, d, dtypes.FP16, dtypes.BF16, "mma", rt, set(FEATURES))
             for arm in ("unpacked", "splitk") for d, rt in ((256, 1), (192, 2), (128, 2))]
    return plain + featured + every + multi_token_pairs("mma") + simt_feature_specs(plain)


def multi_token_pairs(impl: str) -> list[KernelSpec]:
    """Multi-token with one of csr and device_scales on ``impl``'s widest rows, split and unsplit:
    mma at head dim 256, simt at 512 and MLA's 576/512, fp8 KV (the device scales' dtype), and
    MLA's bf16 cache with V read from K's rows (``v_in_k``: csr, its device scales having no use
    there). These are the pairs vLLM's speculative decoding (MLA's MTP among them) and
    FlashInfer's planner send, built apart from the all-features specs because a pair compiles
    code of its own (its ``#if`` blocks), whose registers the all-features count does not bound."""
    rows = ((256, None),) if impl == "mma" else ((512, None), (576, 512))
    pairs = [KernelSpec(arm, head_dim, dtypes.BF16, dtypes.FP8, impl, 1, {"multi_token", other}, v_head_dim=v_head_dim)
             for head_dim, v_head_dim in rows for arm in ("unpacked", "splitk") for other in ("csr", "device_scales")]
    if impl == "simt":
        pairs += [KernelSpec(arm, 576, dtypes.BF16, dtypes.BF16, impl, 1, {"multi_token", "csr"}, v_head_dim=512,
                             v_in_k=True) for arm in ("unpacked", "splitk")]
    return pairs


def simt_feature_specs(plain: list[KernelSpec]) -> list[KernelSpec]:
    """The simt specs of ``SIMT_FEATURES`` CI compiles: every plain simt unpacked and split-K spec
    with multi-token; device_scales and csr each alone on every arm (head dim 128, fp8 KV; the
    packed arm at 256); and all the arm serves together (the packed arm: no multi-token, it serves
    one query token) on every plain simt spec at head dim 512 and 576/512 (the widest rows: the
    most registers) and on the packed arm's; multi-token paired (``multi_token_pairs``); and
    csr alone at 512 and 576/512, bf16, as SGLang launches them."""
    simt = [spec for spec in plain if spec.impl == "simt"]
    multi_token = [replace(spec, features=frozenset({"multi_token"})) for spec in simt if spec.arm != "gqa_packed"]
    alone = [KernelSpec(arm, 256 if arm == "gqa_packed" else 128, dtypes.BF16, dtypes.FP8, "simt",
                        features={feature})
             for arm in ARMS for feature in sorted(SIMT_FEATURES - {"multi_token"})]
    together = [replace(spec, features=SIMT_FEATURES - ({"multi_token"} if spec.arm == "gqa_packed" else set()))
                for spec in simt if spec.head_dim >= 512 or spec.arm == "gqa_packed"]
    # What SGLang launches at the wide shapes: its token pool's CSR table alone, bf16, at Gemma 4's
    # 512 and over MLA's latent rows (V read from K's).
    sglang = [KernelSpec(arm, head_dim, dtypes.BF16, dtypes.BF16, "simt", features={"csr"}, v_head_dim=v_head_dim,
                         v_in_k=v_head_dim is not None)
              for head_dim, v_head_dim in ((512, None), (576, 512)) for arm in ("unpacked", "splitk")]
    return multi_token + alone + together + multi_token_pairs("simt") + sglang


def specs_for(config: LayerConfig) -> dict[tuple[str, int, bool], KernelSpec]:
    """Every spec a call of this layer can reach, by ``(arm, row_tiles, multi_token)``:
    what ``DecodeAttention`` compiles at construction so that ``run`` never compiles.

    Legacy's split count only falls as the batch grows, so batch 1 and ``max_batch``
    bound the arms; the row tiles follow ``heads_per_cta x q_len``, which the plan's rule
    may set to any choice unless the config pins it; ``q_len > 1`` takes the
    multi-token specialization."""
    specs: dict[tuple[str, int, bool], KernelSpec] = {}
    for q_len in range(1, config.max_q_len + 1):
        for plan in (make_plan(config, 1, q_len), make_plan(config, config.max_batch, q_len)):
            if plan.impl == "simt" or plan.arm == "gqa_packed" or config.heads_per_cta is not None:
                rows = {plan.heads_per_cta * q_len}
            else:
                rows = {h * q_len for h in heads_per_cta_choices(config.shape.group_size, q_len, config.max_rows)}
            for row_tiles in sorted({plan.row_tiles_for(r) for r in rows}):
                specs.setdefault((plan.arm, row_tiles, q_len > 1), KernelSpec(
                    plan.arm, config.shape.head_dim, config.q_dtype, config.kv_dtype, plan.impl, row_tiles,
                    config.features_at(q_len), config.target.smem_per_block, config.shape.v_head_dim))
    if v_in_k_served(config):  # MLA: V from K's registers where v_cache aliases k_cache
        specs.update({(*key, "v_in_k"): replace(spec, v_in_k=True) for key, spec in specs.items()})
    return specs
