"""What an SGLang model and its attention layers ask for, mapped onto ``DecodeAttention``'s
options or refused with the reason SGLang prints. Pure functions over plain values: no
SGLang import (the capability refusal is the library's one, shared with vLLM's backend).

SGLang's conventions, as they meet ours:

* ``RadixAttention.sliding_window_size`` is FlashInfer's ``window_left`` (a token at ``p``
  attends ``[p - W, p]``; -1: none), ours exactly.
* ``logit_cap`` 0 means no cap; ``cap * tanh(s / cap)`` is our ``logits_soft_cap``.
* The token pool has pages of one token: slot ``s`` of layer ``l`` is
  ``k_buffer[l][s]`` (``[slots, kv_heads, head_dim]``), an NHD cache of page size 1.
* MLA models (DeepSeek-V2/V3/R1, Kimi-K2) keep one latent row a token (``MLATokenToKVPool``:
  ``[slots, 1, 576]``, values its first 512 dims) and decode through a ``RadixAttention`` of
  head dim 576, ``v_head_dim`` 512 and one KV head: our MLA layer (``config.NARROW_V_SHAPES``),
  its V a view of K's rows.
"""

from __future__ import annotations

from typing import Optional

from ...config import NARROW_V_SHAPES, SIMT_ONLY_HEAD_DIMS
from ...config import soft_cap as config_soft_cap
from ..vllm.options import HEAD_SIZES, SUPPORTED_CAPABILITIES, capability_refusal, head_sizes_line, layer_refusal

__all__ = ["HEAD_SIZES", "MODEL_DTYPES", "SUPPORTED_CAPABILITIES", "capability_refusal", "model_refusals",
           "layer_refusals", "window_left", "soft_cap", "PREFILL_ENV", "DEFAULT_PREFILL", "MLA_POOL"]

MODEL_DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16"}
"""SGLang's activation dtypes we take, by ``str(torch dtype)``: our q and out (and the cache)."""

PREFILL_ENV = "METRALE_ATTN_SGLANG_PREFILL"
"""Names the SGLang backend that serves every batch that is not a decode batch."""
DEFAULT_PREFILL = "triton"


MLA_POOL = "MLATokenToKVPool"
"""The MLA token pool we read: one latent row a token, model dtype. Its subclasses (DSA's
sparse-attention pool, the fp4 latent pool) store rows we cannot read as such."""


def model_refusals(*, dtype: str, kv_cache_dtype: str, page_size: int, use_mla: bool, kv_pool: str,
                   dcp: bool, capability: Optional[tuple[int, int]]) -> list[str]:
    """Why this model's configuration is not ours (empty: it is), asked when SGLang builds
    the backend. ``dtype``/``kv_cache_dtype``: ``str(torch dtype)`` of the activations and of
    the KV pool; ``kv_pool``: the token pool's class name; ``dcp``: decode context parallelism
    (``--dcp-size`` > 1); ``capability``: the device's, None on the host (the CPU backend)."""
    reasons = []
    if dtype not in MODEL_DTYPES:
        reasons.append(f"dtype {dtype} not supported (metrale-attn: {', '.join(MODEL_DTYPES)})")
    elif kv_cache_dtype != dtype:
        reasons.append(f"kv_cache_dtype {kv_cache_dtype} not supported: the SGLang backend reads a KV pool of the "
                       f"model dtype ({dtype}; --kv-cache-dtype auto), not yet fp8")
    if page_size != 1:
        reasons.append(f"page_size {page_size} not supported: the SGLang backend reads SGLang's token pool of "
                       "page size 1 (--page-size 1)")
    if use_mla and kv_pool != MLA_POOL:
        reasons.append(f"the MLA KV pool {kv_pool} not supported (metrale-attn reads {MLA_POOL}'s latent rows; "
                       "DSA's sparse attention and fp4 latents are not served)")
    if kv_pool == "SWAKVPool":
        reasons.append("a hybrid sliding-window KV pool is not supported (its indices need SGLang's translation); "
                       "run with --disable-hybrid-swa-memory")
    if dcp:
        reasons.append("decode context parallelism (--dcp-size > 1) not supported (metrale-attn returns no rank-local "
                       "lse for SGLang's cross-rank merge)")
    if capability is not None:
        refusal = capability_refusal(capability)
        if refusal is not None:
            reasons.append(refusal)
    return reasons


def layer_refusals(*, head_dim: int, v_head_dim: int, num_q_heads: int, num_kv_heads: int, is_cross_attention: bool,
                   attn_type: str, logit_capping_method: str, logit_cap: float,
                   sliding_window_size: Optional[int] = None) -> list[str]:
    """Why this ``RadixAttention`` layer is not ours (empty: it is), asked at its first decode.
    Head dim 512 (Gemma 4's global layers) and MLA's absorbed 576/512 run on the reference
    kernels, which take no window or soft-cap: such a layer is refused with the library's own
    reason (``layer_refusal``), as is an MLA layer of more than one KV head."""
    reasons = []
    mla = (head_dim, v_head_dim) in NARROW_V_SHAPES
    if head_dim not in HEAD_SIZES and not mla:
        reasons.append(f"head_dim {head_dim} not supported (metrale-attn: {head_sizes_line()})")
    elif mla or (head_dim in SIMT_ONLY_HEAD_DIMS and v_head_dim == head_dim):
        why = layer_refusal(num_heads=num_q_heads, num_kv_heads=num_kv_heads, head_size=head_dim,
                            v_head_dim=v_head_dim if mla else None, q_dtype="bfloat16", kv_dtype="bfloat16",
                            window_left=window_left(sliding_window_size), logits_soft_cap=soft_cap(logit_cap))
        if why is not None:
            asked = f"MLA's {head_dim}/{v_head_dim} layer as asked" if mla else \
                f"head_dim {head_dim} with a sliding window or a logit cap"
            reasons.append(f"{asked} not supported (metrale-attn: {why})")
    if v_head_dim != head_dim and not mla:
        pairs = ", ".join(f"{k}/{v}" for k, v in NARROW_V_SHAPES)
        reasons.append(f"v_head_dim {v_head_dim} differs from head_dim {head_dim} (metrale-attn needs them equal, "
                       f"or MLA's absorbed {pairs} over one KV head)")
    if is_cross_attention:
        reasons.append("cross attention is not supported (metrale-attn serves decoder self-attention)")
    if attn_type != "decoder":
        reasons.append(f"attn_type {attn_type} not supported (metrale-attn serves decoder self-attention)")
    if logit_cap and logit_capping_method != "tanh":
        reasons.append(f"logit_capping_method {logit_capping_method} not supported (metrale-attn: tanh)")
    return reasons


def window_left(sliding_window_size: Optional[int]) -> int:
    """Our ``window_left`` for SGLang's ``sliding_window_size`` (the same convention; None
    and negatives: no window -> -1)."""
    if sliding_window_size is None or sliding_window_size < 0:
        return -1
    if isinstance(sliding_window_size, bool) or not isinstance(sliding_window_size, int):
        raise ValueError(f"sliding_window_size must be an int (tokens before the current one) or -1, "
                         f"got {sliding_window_size!r}")
    return sliding_window_size


def soft_cap(logit_cap) -> Optional[float]:
    """Our ``logits_soft_cap`` for SGLang's ``logit_cap`` (0 and None: no cap), by the
    library's one rule (``config.soft_cap``)."""
    return config_soft_cap(logit_cap)
