"""What a vLLM attention layer asks for, mapped exactly onto ``DecodeAttention``'s options,
or refused with the reason vLLM prints, naming the value and what works. Pure functions over
plain values: no vLLM import.

The conventions that differ between the two, pinned by tests:

* vLLM's ``sliding_window`` counts the current token (a window of ``W`` attends to the
  last ``W`` positions); ours, ``window_left``, does not: ``window_left = W - 1``.
* vLLM (like FlashAttention and FlashInfer) passes ``logits_soft_cap`` 0 or None for
  "no cap"; we take None.
* ``kv_cache_dtype="auto"`` stores the cache in the model dtype; ``"fp8"`` means e4m3,
  stored as uint8 bits with per-tensor scales (value = stored x scale, both sides), the
  layer's fp32 tensors ``_k_scale``/``_v_scale``, which our kernels read on the device.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

from ...config import ENV_IMPL, HEAD_DIMS, MAX_Q_LEN, NARROW_V_SHAPES, SIMT_ONLY_HEAD_DIMS, configure, impl_chosen
from ...config import soft_cap as config_soft_cap
from ...kernels import launchable_config
from ...targets import DEFAULT_TARGET, FP8_CVT_CAPABILITY, TARGETS, detect_target, get_target, resolve_target_policy

MODEL_DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16"}
"""vLLM's activation dtypes we take, by ``str(torch dtype)``: our q and out."""

KV_CACHE_DTYPES = {"auto": None, "bfloat16": "bfloat16", "float16": "float16", "fp8": "fp8_e4m3",
                   "fp8_e4m3": "fp8_e4m3"}
"""vLLM's ``kv_cache_dtype`` spellings we take -> our ``kv_dtype`` (None: the model dtype)."""

REFUSED_KV_CACHE_DTYPES = {
    "fp8_e5m2": "kv_cache_dtype fp8_e5m2 has no prefill backend in vLLM 0.33 (FlashAttention takes no e5m2 and "
                "Triton reads the cache as e4m3), so the prefill tokens of a batch would be wrong; use fp8 (e4m3)",
}

HEAD_SIZES = tuple(sorted({*HEAD_DIMS, *SIMT_ONLY_HEAD_DIMS}))
"""Head sizes a layer may have: the ``mma`` kernels' (``config.HEAD_DIMS``) and those only the
``simt`` reference kernels serve (``config.SIMT_ONLY_HEAD_DIMS``: 512, Gemma 4's global
layers), where the library's default falls back to them. Derived, never copied: a head dim
the library learns is one vLLM may select us for."""


def head_sizes_line() -> str:
    """The head sizes we serve, as refusals list them: "64, 80, ..., 256, 512 (512 on the
    reference kernels)"."""
    wide = ", ".join(map(str, SIMT_ONLY_HEAD_DIMS))
    return f"{', '.join(map(str, HEAD_SIZES))}" + (f" ({wide} on the reference kernels)" if wide else "")


SUPPORTED_CAPABILITIES = {tuple(t.compute_capability): t.name for t in TARGETS.values()}
"""Compute capabilities whose every kernel spec launches (the ``mma`` tiling is sized from each
target's shared memory), and their targets: sm_80, 86, 89, 90, 100, 103, 120, 121."""


def kv_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """Our ``kv_dtype`` for vLLM's ``kv_cache_dtype`` (``model_dtype``: ours, for ``auto``)."""
    if kv_cache_dtype in REFUSED_KV_CACHE_DTYPES:
        raise ValueError(REFUSED_KV_CACHE_DTYPES[kv_cache_dtype])
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def is_fp8(kv_cache_dtype: str) -> bool:
    """Whether the cache holds fp8 bits (scales apply) rather than model-dtype values."""
    return kv_cache_dtype.startswith("fp8")


def window_left(sliding_window: Optional[int]) -> int:
    """Our ``window_left`` for vLLM's ``sliding_window`` (None: no window -> -1)."""
    if sliding_window is None:
        return -1
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int (tokens, the current one included) or None, "
                         f"got {sliding_window!r}")
    return sliding_window - 1


def soft_cap(logits_soft_cap) -> Optional[float]:
    """Our ``logits_soft_cap`` for vLLM's: 0 and None mean no cap, as ours; a cap the kernels
    cannot take or fold is refused by the one rule of it (``config.soft_cap``)."""
    return config_soft_cap(logits_soft_cap)


def decode_q_len(num_speculative_tokens: Optional[int], *, batch_invariant: bool) -> int:
    """The longest uniform query a decode call takes: 1 + the speculative tokens, when that
    fits our multi-token decode (<= 8), else 1.

    Under vLLM's batch-invariant mode a verification request stays on the prefill
    backend: which backend serves a request must not depend on its co-batched requests,
    and a uniform multi-token batch is a property of the whole batch (a request whose
    drafts came up short makes the batch non-uniform and moves every request of its
    length to the prefill backend)."""
    q_len = 1 + (num_speculative_tokens or 0)
    if batch_invariant or q_len > MAX_Q_LEN:
        return 1
    return q_len


KERNEL_BLOCK_SIZES = (256, 128, 64, 32, 16)
"""The page sizes we offer vLLM for a kernel block, largest first: ours are 1..256 tokens
and both prefill backends take multiples of 16; vLLM splits a larger manager block. A
manager block is ours where one of them divides it: a multiple of 16."""


def target_policy(capability: Optional[tuple[int, int]]):
    """The target policy a device of this capability runs (None, or not one of ours: the
    default target's; selection refuses an unknown capability with its own reason)."""
    try:
        target = get_target(DEFAULT_TARGET) if capability is None else detect_target(tuple(capability), 1)
    except ValueError:
        target = get_target(DEFAULT_TARGET)
    return resolve_target_policy(target)


def layer_refusal(*, num_heads: int, num_kv_heads: int, head_size: int, q_dtype: str, kv_dtype: str,
                  v_head_dim: Optional[int] = None, max_q_len: int = 1, window_left: int = -1, logits_soft_cap: Optional[float] = None,
                  sinks: bool = False, fp8: bool = False, capability: Optional[tuple[int, int]] = None
                  ) -> Optional[str]:
    """Why the library's own rules refuse this layer on every kernel it could run, or None: the
    rules ``DecodeAttention`` applies when the layer is built (``config.configure``, then
    ``kernels.launchable_config``, the fallback to the ``simt`` reference kernels), asked here
    so vLLM hears it at selection or model construction rather than once the KV cache exists.
    Head size 512 is served by the reference kernels alone, which take fp8 scales on the device
    and multi-token decode but none of the other features (a window, sinks, a soft-cap)."""
    try:
        config = configure(num_heads, num_kv_heads, head_size, 16, v_head_dim=v_head_dim, q_dtype=q_dtype,
                           kv_dtype=kv_dtype, max_batch=1,
                           target_policy=target_policy(capability), kv_layout="HND", max_q_len=max_q_len,
                           window_left=window_left, logits_soft_cap=logits_soft_cap, sinks=sinks, device_scales=fp8)
        launchable_config(config, (), impl_chosen(None, os.environ.get(ENV_IMPL)))
    except ValueError as error:
        return str(error)
    return None


def reference_kernel_refusal(*, head_size: int, kv_cache_dtype: Optional[str], has_sink: bool,
                             has_sliding_window: bool, capability: Optional[tuple[int, int]]) -> Optional[str]:
    """Why a layer of this head size with what the selector sees of it (sinks, a window, an fp8
    cache: its scales on the device) is refused by the library (``layer_refusal``), naming
    what works; None where it is not (every ``mma`` head size, and layers at 512 with neither
    sinks nor a window, a model-dtype or an fp8 cache)."""
    if head_size not in SIMT_ONLY_HEAD_DIMS:
        return None
    fp8 = kv_cache_dtype is not None and is_fp8(kv_cache_dtype)
    why = layer_refusal(num_heads=1, num_kv_heads=1, head_size=head_size, q_dtype="bfloat16",
                        kv_dtype="fp8_e4m3" if fp8 else "bfloat16", window_left=0 if has_sliding_window else -1,
                        sinks=has_sink, fp8=fp8, capability=capability)
    if why is None:
        return None
    return (f"head_size {head_size} with {what_the_layer_asks(fp8, has_sink, has_sliding_window)} not supported "
            f"(metrale-attn: {why}; head sizes {min(HEAD_DIMS)} to {max(HEAD_DIMS)} take them, {head_size} a "
            "model-dtype or fp8 cache without sinks or a window)")


def what_the_layer_asks(fp8: bool, sinks: bool, window: bool) -> str:
    """The selector-visible features of a layer, as a refusal names them."""
    asked = [name for name, has in (("an fp8 cache", fp8), ("sinks", sinks), ("a sliding window", window)) if has]
    return " and ".join(asked) or "nothing"


def selection_refusals(*, head_size: int, dtype: str, kv_cache_dtype: Optional[str], block_size: Optional[int],
                       capability: Optional[tuple[int, int]], attn_type=None) -> dict[str, str]:
    """Why this configuration is not ours, at selection (empty: it is), each reason naming the
    value and what works, keyed by the bare reason vLLM's ``validate_configuration`` gives for
    the same check ("head_size not supported"), which ``with_what_works`` replaces by it.
    ``dtype``: ``str(torch dtype)`` of the model; ``capability``: (major, minor) or None."""
    reasons = {}
    if head_size not in HEAD_SIZES:
        reasons["head_size not supported"] = f"head_size {head_size} not supported (metrale-attn: {head_sizes_line()})"
    if dtype not in MODEL_DTYPES:
        reasons["dtype not supported"] = f"dtype {dtype} not supported (metrale-attn: {', '.join(MODEL_DTYPES)})"
    if kv_cache_dtype is not None and kv_cache_dtype not in (*KV_CACHE_DTYPES, *REFUSED_KV_CACHE_DTYPES):
        # fp8_e5m2 is read by our kernels: ``supports_combination`` refuses it with its own reason
        reasons["kv_cache_dtype not supported"] = (f"kv_cache_dtype {kv_cache_dtype} not supported (metrale-attn: "
                                                   f"{', '.join(KV_CACHE_DTYPES)})")
    if block_size is not None and block_size % min(KERNEL_BLOCK_SIZES):
        reasons["block_size not supported"] = (
            f"block_size {block_size} not supported (metrale-attn: a multiple of {min(KERNEL_BLOCK_SIZES)}, which "
            f"vLLM splits into kernel blocks of {', '.join(map(str, sorted(KERNEL_BLOCK_SIZES)))} tokens)")
    if capability is not None and capability_refusal(capability):
        reasons["compute capability not supported"] = capability_refusal(capability)
    if attn_type is not None and attn_type != "decoder":
        reasons[f"attention type {attn_type} not supported"] = (f"attention type {attn_type} not supported "
                                                                "(metrale-attn: decoder self-attention only)")
    return reasons


def with_what_works(reasons: Sequence[str], ours: dict[str, str]) -> list[str]:
    """vLLM's ``reasons``, each bare one that ``ours`` (``selection_refusals``) answers replaced by
    our reason, which names the value and what works."""
    return [ours.get(reason, reason) for reason in reasons]


def prefill_refusal(refused: Sequence[tuple[str, Sequence[str]]], ours: dict[str, str]) -> Optional[str]:
    """Why no prefill backend takes this configuration's prefill tokens, from each candidate's
    (name, vLLM's reasons), or None where there is none to say: no candidate refused, or one
    refused only for reasons ``ours`` (``selection_refusals``) already gives, a consequence of
    ours (meet them and it takes the tokens)."""
    if not refused or any(all(reason in ours for reason in reasons) for _, reasons in refused):
        return None
    each = "; ".join(f"{name}: {', '.join(reasons)}" for name, reasons in refused)
    return f"no prefill backend for the prefill tokens ({each})"


def capability_refusal(capability: tuple[int, int]) -> Optional[str]:
    """Why a device of this compute capability is not ours, naming the ones that are, or None."""
    if tuple(capability) in SUPPORTED_CAPABILITIES:
        return None
    major, minor = capability
    known = ", ".join(f"{a}.{b} (sm_{a}{b}, {SUPPORTED_CAPABILITIES[a, b]})" for a, b in sorted(SUPPORTED_CAPABILITIES))
    return f"compute capability {major}.{minor} not supported (metrale-attn launches on {known})"


def fp8_refusal(kv_cache_dtype: Optional[str], capability: Optional[tuple[int, int]]) -> Optional[str]:
    """Why an fp8 cache is not ours on this device, or None: the tensor-core kernels read fp8
    with PTX's fp8 ``cvt``, which sm_80 and sm_86 lack (the ``simt`` kernels that convert in
    software serve none of the features a model may bring, so the layer is refused here, at
    selection, rather than at start-up)."""
    if kv_cache_dtype is None or not is_fp8(kv_cache_dtype) or capability is None:
        return None
    if tuple(capability) >= FP8_CVT_CAPABILITY:
        return None
    major, minor = capability
    return (f"kv_cache_dtype {kv_cache_dtype} not supported on compute capability {major}.{minor} (metrale-attn's "
            "tensor-core kernels read fp8 with the fp8 cvt of sm_89 and later)")


# -- MLA (``mla.MetraleMLABackend``, the name ``METRALE_ATTN_MLA``) -----------------------------

MLA_HEAD_SIZE, MLA_V_HEAD_DIM = NARROW_V_SHAPES[0]
"""MLA's absorbed decode as the library serves it (``config.NARROW_V_SHAPES``): keys of 576 dims
(``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64) over one latent KV head, values its first 512.
vLLM's ``MLAAttention`` layers have ``head_size = kv_lora_rank + qk_rope_head_dim``: DeepSeek-V2,
V2-Lite, V3, R1 and Kimi-K2 are all 576."""


MLA_ELSEWHERE = ("MLA not supported by METRALE_ATTN (vLLM 0.33 resolves a backend name to one class, MLA or not): "
                 "--attention-backend METRALE_ATTN_MLA serves MLA models (DeepSeek-V2/V3/R1, Kimi-K2), decode on "
                 "metrale-attn and prefill on vLLM's MLA prefill backend")
"""What ``METRALE_ATTN`` says for an MLA layer instead of vLLM's bare "MLA not supported"."""


def mla_selection_refusals(*, head_size: int, dtype: str, kv_cache_dtype: Optional[str], block_size: Optional[int],
                           capability: Optional[tuple[int, int]], attn_type=None) -> dict[str, str]:
    """``selection_refusals`` for an MLA layer: the same rules (dtype, cache dtype, block size,
    device, decoder only), but the one head size MLA's absorbed decode has, 576."""
    reasons = selection_refusals(head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                 block_size=block_size, capability=capability, attn_type=attn_type)
    reasons.pop("head_size not supported", None)  # the GQA head sizes' reason; MLA's is its own
    if kv_cache_dtype in REFUSED_KV_CACHE_DTYPES:  # the reference kernels, the only ones at 576, read e4m3 only
        reasons["kv_cache_dtype not supported"] = (f"kv_cache_dtype {kv_cache_dtype} not supported (metrale-attn MLA: "
                                                   f"{', '.join(KV_CACHE_DTYPES)})")
    if head_size != MLA_HEAD_SIZE:
        reasons["head_size not supported"] = (
            f"head_size {head_size} not supported (metrale-attn MLA: {MLA_HEAD_SIZE}, a kv_lora_rank of "
            f"{MLA_V_HEAD_DIM} + a qk_rope_head_dim of {MLA_HEAD_SIZE - MLA_V_HEAD_DIM}: DeepSeek-V2/V3/R1, Kimi-K2)")
    return reasons

