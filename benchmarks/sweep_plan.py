"""What the benchmark sweep runs, and in which order: jobs grouped in tiers by what they decide.

The sweep runs after the GPU check's decisive step (``metrale-attn check`` on the decisive
cells: the policy's default launch of the default kernel, simt and the peers, every output
checked first; ``benchmarks/schedule.py``), with what the deadline leaves, so its tiers go
from the questions the decisive step does not answer to the grid (``plan_jobs``):

1. ``heads_per_cta``: 32/8/128 and 64/8/128 bf16 at batch 1, 16 and 64 x 16k, the mma
   kernels with ``heads_per_cta`` forced to every choice of the group
   (``plan.heads_per_cta_choices``: 1, 2, 4 and 1, 2, 4, 8), the plan's choice marked.
2. ``features``: Llama-3-8B batch 64 x 16k on the mma kernels, plain and with each
   feature of the kernels' specializations, each row's time against the plain row's
   (``vs_plain``): bf16 with ``FEATURES`` (a 4k sliding window, multi-token decode of 4 query
   tokens, a logits soft-cap, sinks, FlashInfer's CSR page table, device-side scales), then
   fp8 e4m3 with ``FP8_FEATURES`` (the serving engine's fp8 path: host-scale dense beside the
   CSR page table and the scales read from the device).
3. ``decisive-bf16``: Llama-3-8B (32/8/128) batch 64 x 4k and 16k, one sequence x 32k,
   Llama-3-70B (64/8/128) batch 64 x 4k and one sequence x 32k, and 24/4/256 batch 64 x 4k,
   KV bf16; every FORCED arm on both kernel implementations (``impls.IMPLS``: simt, mma),
   and the SDPA baselines.
4. ``decisive-fp8``: the same configurations with an fp8 e4m3 KV cache.
5. ``rest``: the grid (models x KV dtypes x batch 1, 16, 64, 256 x context 4k, 16k, 64k),
   less what the tiers above measured; ours only.

FlexAttention (one configuration per shape) and FlashInfer (whatever its JIT built in
time) are timed last, on the configurations already measured, in the same order
(``sweep.py``'s late phase).

Profiles: ``full`` (the above), ``quick`` (tiers 1, 3 and 4, no baselines: the short
rerun) and ``cpu`` (the CPU dry run: one 6/1/256 configuration per dtype, a tiny
``heads_per_cta`` sweep on groups of 4 and 8, the features on 4/1/64, then a tiny grid).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from metrale_attn import policy
from metrale_attn.models import MODELS
from metrale_attn.config import ModelShape, heads_per_cta_choices

from .impls import IMPLS, SWEEP_IMPL

ITEMSIZE = {"bf16": 2, "fp8": 1}
Q_ITEMSIZE = 2  # q and out are bf16

ARM_OPTIONS = {
    "unpacked": dict(splitk="off", gqa_pack=False),
    "splitk": dict(splitk="auto", gqa_pack=False),
    "gqa_packed": dict(splitk="off", gqa_pack=True),
}
DEFAULT_ARMS = ("unpacked", "splitk", "gqa_packed")
BASELINE_NAMES = ("sdpa_gather", "sdpa_nogather", "flex_paged", "flashinfer")
LATE_BASELINES = ("flex_paged", "flashinfer")
"""Timed after every configuration of ours: FlexAttention compiles for tens of seconds per shape, and
FlashInfer's JIT (nvcc, in the background) gets the whole run to finish."""

HPC_MODELS = "llama-3-8b,llama-3-70b"
"""The heads_per_cta tier's shapes: groups of 4 (choices 1, 2, 4) and 8 (1, 2, 4, 8)."""
FEATURES = ("plain", "window", "multi_token", "soft_cap", "sinks", "csr", "device_scales")
"""The features tier's rows on a bf16 cache, in order: ``plain`` (the dense page table, host
scales) is the baseline the others are timed against."""
FP8_FEATURES = ("plain", "csr", "device_scales")
"""The features tier's rows on an fp8 cache: where a serving engine's scales and page table
matter (vLLM keeps ``k_scale``/``v_scale`` on the device; FlashInfer passes a CSR table)."""
MULTI_TOKEN_Q_LEN = 4  # query tokens per sequence of the multi_token row (speculative decode's 3 + 1)
SOFT_CAP = 30.0  # Gemma 2's attention logit soft-cap
FEATURES_AT = "llama-3-8b:64:16384"
DECISIVE = ("llama-3-8b:64:4096,llama-3-8b:64:16384,llama-3-8b:1:32768,llama-3-70b:64:4096,llama-3-70b:1:32768,"
            "qwen3.8-27b:64:4096")
"""Issue 19's decisive calls: batch 64 x 4k and 1 x 32k of 32/8/128 and 64/8/128 (bf16 and, in the
next tier, fp8), each on simt and mma, so mma over simt is a ratio measured side by side in one run."""
PROFILES = {
    "full": dict(models="llama-3-8b,llama-3-70b,qwen3.8-27b", kv_dtypes="bf16,fp8", batches="1,16,64,256",
                 contexts="4096,16384,65536", page_size=16, decisive=DECISIVE, decisive_dtypes="bf16,fp8",
                 hpc_models=HPC_MODELS, hpc_batches="1,16,64", hpc_context=16384, features=FEATURES_AT,
                 features_dtypes="bf16,fp8", feature_window=4095, rest=True, baselines=",".join(BASELINE_NAMES)),
    "quick": dict(models="llama-3-8b,llama-3-70b,qwen3.8-27b", kv_dtypes="bf16,fp8", batches="1,16,64,256",
                  contexts="4096,16384,65536", page_size=16, decisive=DECISIVE, decisive_dtypes="bf16,fp8",
                  hpc_models=HPC_MODELS, hpc_batches="1,16,64", hpc_context=16384, features="none",
                  features_dtypes="bf16,fp8", feature_window=4095, rest=False, baselines="none"),
    "cpu": dict(models="6/1/256", kv_dtypes="bf16", batches="1,2", contexts="64,300", page_size=16,
                decisive="6/1/256:2:300", decisive_dtypes="bf16,fp8", hpc_models="4/1/64,8/1/64", hpc_batches="1,2",
                hpc_context=64, features="4/1/64:2:300", features_dtypes="bf16,fp8", feature_window=63, rest=True,
                baselines="none"),
}
"""The CPU profile uses the smallest shape that reaches all three arms (the GQA pack needs
q_heads = 6 x kv_heads at head_dim 256), and for the heads_per_cta sweep the smallest shapes
with the Llama groups (4 and 8: the same choices as on the GPU)."""


@dataclass(frozen=True)
class Config:
    """One point of the sweep."""

    model: str
    shape: ModelShape
    kv_dtype: str
    batch: int
    context: int
    page_size: int

    @property
    def shape_label(self) -> str:
        s = self.shape
        return f"{s.num_q_heads}/{s.num_kv_heads}/{s.head_dim}"

    @property
    def kv_bytes(self) -> int:
        """K and V bytes a call must read: tokens x kv_heads x head_dim x itemsize x 2."""
        s = self.shape
        return self.batch * self.context * s.num_kv_heads * s.head_dim * ITEMSIZE[self.kv_dtype] * 2

    @property
    def bytes_moved(self) -> int:
        """KV read + q read + out written (block tables and lengths are negligible and not counted)."""
        s = self.shape
        return self.kv_bytes + 2 * self.batch * s.num_q_heads * s.head_dim * Q_ITEMSIZE

    @property
    def pages(self) -> int:
        return self.batch * -(-self.context // self.page_size)

    @property
    def pool_key(self) -> tuple:
        """Configurations with the same key share one paged K/V pool."""
        return (self.shape.num_kv_heads, self.shape.head_dim, self.kv_dtype, self.page_size)

    def describe(self) -> dict:
        return dict(model=self.model, shape=self.shape_label, q_heads=self.shape.num_q_heads,
                    kv_heads=self.shape.num_kv_heads, head_dim=self.shape.head_dim, kv_dtype=self.kv_dtype,
                    q_dtype="bf16", page_size=self.page_size, batch=self.batch, context=self.context,
                    kv_bytes=self.kv_bytes, bytes=self.bytes_moved)

    def short(self) -> str:
        """``llama-3-8b bf16 b64 16k``: a progress-line label."""
        return f"{self.model} {self.kv_dtype} b{self.batch} {ctx_label(self.context)}"


@dataclass(frozen=True)
class Job:
    """One configuration in one tier. ``kind``: ``arms`` (every forced arm x implementation, the
    policy's default, ``baselines``), ``hpc`` (``heads_per_cta`` forced to each of ``hpc_values``,
    every choice of the shape's group) or ``features`` (each of ``FEATURES`` on the mma kernels)."""

    tier: str
    config: Config
    kind: str = "arms"
    baselines: tuple = ()
    hpc_values: tuple = ()


@dataclass(frozen=True)
class Slot:
    """One timed spec of ours on a configuration: an arm (``default``: the policy's choice), an
    implementation forced (None: the default), a forced ``heads_per_cta`` (None: the plan's rule)
    and a feature of ``FEATURES`` (None: plain decode outside the features tier)."""

    arm: str
    impl: Optional[str] = None
    heads_per_cta: Optional[int] = None
    feature: Optional[str] = None

    @property
    def label(self) -> str:
        """``splitk``, ``splitk/mma``, ``default/mma/h4``, ``default/mma/+window``: the row's arm label."""
        out = self.arm
        if self.impl:
            out += f"/{self.impl}"
        if self.heads_per_cta is not None:
            out += f"/h{self.heads_per_cta}"
        if self.feature is not None:
            out += f"/+{self.feature}"
        return out


def features_for(kv_dtype: str) -> tuple:
    """The features tier's rows on a ``kv_dtype`` cache."""
    return FEATURES if kv_dtype == "bf16" else FP8_FEATURES


def feature_options(feature: Optional[str], window_left: int) -> dict:
    """The ``DecodeAttention`` options of a feature row (``window_left``: the window's keys
    before a token's own, the profile's ``feature_window``)."""
    return {None: {}, "plain": {}, "window": dict(window_left=window_left),
            "multi_token": dict(max_q_len=MULTI_TOKEN_Q_LEN), "soft_cap": dict(logits_soft_cap=SOFT_CAP),
            "sinks": dict(sinks=True), "csr": dict(page_table="csr"), "device_scales": dict(device_scales=True)}[feature]


def feature_q_len(feature: Optional[str]) -> int:
    """Query tokens per sequence a feature row decodes."""
    return MULTI_TOKEN_Q_LEN if feature == "multi_token" else 1


def feature_kv_fraction(feature: Optional[str], window_left: int, context: int) -> float:
    """The share of a sequence's K/V a feature row must read (the window's keys only)."""
    if feature != "window" or window_left < 0:
        return 1.0
    return min(1.0, (window_left + 1) / context)


def ctx_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def ints(text) -> list[int]:
    if text in (None, "", "none"):
        return []
    return [int(x) for x in str(text).split(",") if x.strip()]


def parse_models(text: str) -> list[tuple[str, ModelShape]]:
    """``qwen3.8-27b,llama-3-8b`` or ``24/4/256`` spellings -> (label, shape)."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        out.append((item, model_shape(item)))
    return out


def model_shape(item: str) -> ModelShape:
    if item in MODELS:
        return MODELS[item]
    try:
        h, kv, d = (int(x) for x in item.split("/"))
    except ValueError:
        raise SystemExit(f"{item!r} is neither one of {', '.join(MODELS)} nor q/kv/head_dim") from None
    return ModelShape(h, kv, d)


def parse_decisive(text: str, option: str = "--decisive") -> list[tuple[str, int, int]]:
    """``llama-3-8b:64:4096,...`` -> [(model, batch, context)]; ``none`` -> []."""
    if text in (None, "", "none"):
        return []
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        try:
            model, batch, context = item.rsplit(":", 2)
            out.append((model, int(batch), int(context)))
        except ValueError:
            raise SystemExit(f"{option}: {item!r} is not MODEL:BATCH:CONTEXT") from None
    return out


def arms_for(shape: ModelShape, arms: list[str]) -> list[str]:
    """The forced arms that exist for ``shape`` (the GQA pack only where the shape fits)."""
    out = []
    for arm in arms:
        if arm == "gqa_packed" and not policy.gqa_pack_shape_ok(shape.num_q_heads, shape.num_kv_heads,
                                                               shape.head_dim):
            continue
        out.append(arm)
    return out


def arm_options(arm: str) -> dict:
    """DecodeAttention overrides that force ``arm`` (``splitk:N`` pins N splits)."""
    if arm.startswith("splitk:"):
        return dict(splitk=arm.split(":", 1)[1], gqa_pack=False)
    if arm == "default":
        return {}
    return ARM_OPTIONS[arm]


def baseline_list(text: str) -> list[str]:
    if text in (None, "", "none"):
        return []
    names = [b.strip() for b in text.split(",") if b.strip()]
    unknown = [b for b in names if b not in BASELINE_NAMES]
    if unknown:
        raise SystemExit(f"--baselines: unknown {unknown}; choose from {', '.join(BASELINE_NAMES)}")
    return names


def apply_profile(args) -> None:
    """Fill every sweep option left unset (None) from ``args.profile`` (``cpu`` under ``--cpu``)."""
    if args.cpu:
        args.profile = "cpu"
    for key, value in PROFILES[args.profile].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def plan_jobs(args) -> list[Job]:
    """Every job, in the order it runs (see the module docstring); ``args`` after ``apply_profile``."""
    page, jobs, seen = args.page_size, [], set()
    main_baselines = tuple(b for b in baseline_list(args.baselines) if b not in LATE_BASELINES)

    def add(tier, model, dtype, batch, context, **kw):
        config = Config(model, model_shape(model), dtype, batch, context, page)
        if kw.get("kind", "arms") == "arms":
            if config in seen:
                return
            seen.add(config)
        jobs.append(Job(tier, config, **kw))

    for model, shape in parse_models("" if args.hpc_models in (None, "none") else args.hpc_models):
        for batch in ints(args.hpc_batches):
            add("heads_per_cta", model, "bf16", batch, int(args.hpc_context), kind="hpc",
                hpc_values=heads_per_cta_choices(shape.group_size))
    for dtype in [d for d in args.features_dtypes.split(",") if d]:
        for model, batch, context in parse_decisive(args.features, "--features"):
            add("features", model, dtype, batch, context, kind="features")
    for dtype in [d for d in args.decisive_dtypes.split(",") if d]:
        for model, batch, context in parse_decisive(args.decisive):
            add(f"decisive-{dtype}", model, dtype, batch, context, baselines=main_baselines)
    if args.rest:
        for dtype in args.kv_dtypes.split(","):
            for model, _ in parse_models(args.models):
                for batch in ints(args.batches):
                    for context in ints(args.contexts):
                        add("rest", model, dtype, batch, context)
    return jobs


def slots_for(job: Job, arms: list[str]) -> list[Slot]:
    """The specs of ours a job times: each forced arm on each implementation, (``hpc``) each
    ``heads_per_cta`` on the mma kernels, or (``features``) each feature on them."""
    if job.kind == "hpc":
        return [Slot("default", SWEEP_IMPL, h) for h in job.hpc_values]
    if job.kind == "features":
        return [Slot("default", SWEEP_IMPL, feature=f) for f in features_for(job.config.kv_dtype)]
    return [Slot(arm, impl) for arm in arms_for(job.config.shape, arms) for impl in IMPLS]
