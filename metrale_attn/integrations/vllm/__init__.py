"""metrale-attn as a vLLM attention backend (vLLM 0.33): ``--attention-backend METRALE_ATTN``.

Routing, within one forward call of one batch (vLLM puts decodes first): the leading
requests whose query lengths are all equal and at most ``decode_q_len`` (1, or 1 +
``num_speculative_tokens`` when that is at most 8) are decodes and run on our kernels;
every other request (prefills, chunked prefills, a verification request of another
length) runs on vLLM's own FlashAttention backend, or its Triton backend for fp8
caches and where FlashAttention is absent, over the same KV cache. Why: decode is
where a step's time goes at scale (memory-bound, long contexts, batch-invariant
split-K), and a uniform query length is what our kernels and vLLM's uniform-batch
CUDA graphs share; prefill is compute-bound work vLLM's backends already do well. A
batch of only decodes never touches the other backend.

``register`` is the plugin: vLLM calls it in every process (entry point group
``vllm.general_plugins``, declared in pyproject.toml), and it only adds the names
``METRALE_ATTN`` and ``METRALE_ATTN_MLA`` to ``AttentionBackendEnum`` (and sends the
``metrale_attn`` logger's records through vLLM's log handlers, ``logs.follow_vllm``); nothing
else is imported or changed until a backend of ours is selected. The backends themselves are
``backend.MetraleAttentionBackend`` and, for MLA models, ``mla.MetraleMLABackend`` (decode on the
latent cache, prefill on vLLM's own MLA prefill path).
"""

from __future__ import annotations

BACKEND_NAME = "METRALE_ATTN"
"""The name ``--attention-backend`` takes: a new ``AttentionBackendEnum`` member."""
BACKEND_CLASS = "metrale_attn.integrations.vllm.backend.MetraleAttentionBackend"
"""Where vLLM finds the backend class (imported only once the backend is selected)."""
MLA_BACKEND_NAME = "METRALE_ATTN_MLA"
"""The name for MLA models (DeepSeek-V2/V3/R1, Kimi-K2): vLLM 0.33 resolves a name to one backend
class and asks that class whether it ``is_mla()`` (``validate_configuration`` refuses a mismatch,
``MLAAttention`` asserts it), so MLA decode is a class, and a name, of its own, as vLLM's own
backends pair FLASH_ATTN/FLASH_ATTN_MLA and TRITON_ATTN/TRITON_MLA."""
MLA_BACKEND_CLASS = "metrale_attn.integrations.vllm.mla.MetraleMLABackend"
"""Where vLLM finds the MLA backend class (imported only once it is selected)."""


def register() -> None:
    """Add ``METRALE_ATTN`` and ``METRALE_ATTN_MLA`` to vLLM's ``AttentionBackendEnum``
    (idempotent; vLLM may load plugins more than once per process)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from ...logs import follow_vllm

    follow_vllm()  # our records in vLLM's log, at its level (again when the backend is imported)
    for name, path in ((BACKEND_NAME, BACKEND_CLASS), (MLA_BACKEND_NAME, MLA_BACKEND_CLASS)):
        if name not in AttentionBackendEnum.__members__:
            register_backend(name, path)
