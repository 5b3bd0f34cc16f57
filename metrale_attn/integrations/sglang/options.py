"""What an SGLang model and its attention layers ask for, mapped onto ``DecodeAttention``'s
options or refused with the reason SGLang prints. Pure functions over plain values: no
SGLang import (the capability refusal is the library's one, shared with vLLM's backend).

SGLang's conventions, as they meet ours:

* ``RadixAttention.sliding_window_size`` is FlashInfer's ``window_left`` (a token at ``p``
  attends ``[p - W, p]``; -1: none), ours exactly.
* ``logit_cap`` 0 means no cap; ``cap * tanh(s / cap)`` is our ``logits_soft_cap``.
* The token pool has pages of one token: slot ``s`` of layer ``l`` is
  ``k_buffer[l][s]`` (``[slots, kv_heads, head_dim]``), an NHD cache of page size 1.
"""

from __future__ import annotations

from typing import Optional

from ...config import SIMT_ONLY_HEAD_DIMS
from ...config import soft_cap as config_soft_cap
from ..vllm.options import HEAD_SIZES, SUPPORTED_CAPABILITIES, capability_refusal, head_sizes_line, layer_refusal

__all__ = ["HEAD_SIZES", "MODEL_DTYPES", "SUPPORTED_CAPABILITIES", "capability_refusal", "model_refusals",
           "layer_refusals", "window_left", "soft_cap", "PREFILL_ENV", "DEFAULT_PREFILL"]

MODEL_DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16"}
"""SGLang's activation dtypes we take, by ``str(torch dtype)``: our q and out (and the cache)."""

PREFILL_ENV = "METRALE_ATTN_SGLANG_PREFILL"
"""Names the SGLang backend that serves every batch that is not a decode batch."""
DEFAULT_PREFILL = "triton"


def model_refusals(*, dtype: str, kv_cache_dtype: str, page_size: int, use_mla: bool, swa_pool: bool,
                   capability: Optional[tuple[int, int]]) -> list[str]:
    """Why this model's configuration is not ours (empty: it is), asked when SGLang builds
    the backend. ``dtype``/``kv_cache_dtype``: ``str(torch dtype)`` of the activations and of
    the KV pool; ``capability``: the device's, None on the host (the CPU backend)."""
    reasons = []
    if dtype not in MODEL_DTYPES:
        reasons.append(f"dtype {dtype} not supported (metrale-attn: {', '.join(MODEL_DTYPES)})")
    elif kv_cache_dtype != dtype:
        reasons.append(f"kv_cache_dtype {kv_cache_dtype} not supported: the SGLang backend reads a KV pool of the "
                       f"model dtype ({dtype}; --kv-cache-dtype auto), not yet fp8")
    if page_size != 1:
        reasons.append(f"page_size {page_size} not supported: the SGLang backend reads SGLang's token pool of "
                       "page size 1 (--page-size 1)")
    if use_mla:
        reasons.append("MLA models are not supported (metrale-attn serves MHA/GQA/MQA decode)")
    if swa_pool:
        reasons.append("a hybrid sliding-window KV pool is not supported (its indices need SGLang's translation); "
                       "run with --disable-hybrid-swa-memory")
    if capability is not None:
        refusal = capability_refusal(capability)
        if refusal is not None:
            reasons.append(refusal)
    return reasons


def layer_refusals(*, head_dim: int, v_head_dim: int, is_cross_attention: bool, attn_type: str,
                   logit_capping_method: str, logit_cap: float, sliding_window_size: Optional[int] = None
                   ) -> list[str]:
    """Why this ``RadixAttention`` layer is not ours (empty: it is), asked at its first decode.
    Head dim 512 (Gemma 4's global layers) runs on the reference kernels, which take no window
    or soft-cap: such a layer is refused with the library's own reason (``layer_refusal``)."""
    reasons = []
    if head_dim not in HEAD_SIZES:
        reasons.append(f"head_dim {head_dim} not supported (metrale-attn: {head_sizes_line()})")
    elif head_dim in SIMT_ONLY_HEAD_DIMS and v_head_dim == head_dim:
        why = layer_refusal(num_heads=1, num_kv_heads=1, head_size=head_dim, q_dtype="bfloat16", kv_dtype="bfloat16",
                            window_left=window_left(sliding_window_size), logits_soft_cap=soft_cap(logit_cap))
        if why is not None:
            reasons.append(f"head_dim {head_dim} with a sliding window or a logit cap not supported (metrale-attn: "
                           f"{why})")
    if v_head_dim != head_dim:
        reasons.append(f"v_head_dim {v_head_dim} differs from head_dim {head_dim} (metrale-attn needs them equal)")
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
