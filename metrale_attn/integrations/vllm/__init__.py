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
``vllm.general_plugins``, declared in pyproject.toml), and it only adds the name
``METRALE_ATTN`` to ``AttentionBackendEnum`` (and sends the ``metrale_attn`` logger's records
through vLLM's log handlers, ``logs.follow_vllm``); nothing else is imported or changed until
that backend is selected. The backend itself is ``backend.MetraleAttentionBackend``.
"""

from __future__ import annotations

BACKEND_NAME = "METRALE_ATTN"
"""The name ``--attention-backend`` takes: a new ``AttentionBackendEnum`` member."""
BACKEND_CLASS = "metrale_attn.integrations.vllm.backend.MetraleAttentionBackend"
"""Where vLLM finds the backend class (imported only once the backend is selected)."""


def register() -> None:
    """Add ``METRALE_ATTN`` to vLLM's ``AttentionBackendEnum`` (idempotent; vLLM may load
    plugins more than once per process)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from ...logs import follow_vllm

    follow_vllm()  # our records in vLLM's log, at its level (again when the backend is imported)
    if BACKEND_NAME in AttentionBackendEnum.__members__:
        return
    register_backend(BACKEND_NAME, BACKEND_CLASS)
