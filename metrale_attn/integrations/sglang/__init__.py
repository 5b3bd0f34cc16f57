"""metrale-attn as an SGLang attention backend (SGLang 0.5.23): ``--attention-backend metrale``.

Routing, by the batch's forward mode (SGLang runs one mode per forward): a DECODE batch
(one new token per request) runs on our kernels, over SGLang's own token pool (page size
1: ``req_to_token`` rows become FlashInfer's CSR ``kv_indptr``/``kv_indices`` with
``kv_last_page_len`` 1, read by ``DecodeAttention(page_table="csr")`` as they are);
every other mode (EXTEND, MIXED, speculative TARGET_VERIFY and DRAFT_EXTEND, IDLE) runs
on SGLang's own backend, ``triton`` unless ``METRALE_ATTN_SGLANG_PREFILL`` names another
registered one (``torch_native`` on the CPU), over the same pool. Why: decode is where a
step's time goes at scale (memory-bound, long contexts, batch-invariant split-K);
prefill and verification are compute-bound work SGLang's backends already do well. MLA
models decode here too: SGLang's DeepSeek code takes the absorbed path for a backend it
does not list (as for ``triton``), a layer of head dim 576 and ``v_head_dim`` 512 over the
latent pool (``options``).
With ``--prefill-attention-backend X --decode-attention-backend metrale`` SGLang's own
hybrid backend does that split and ours is asked for decode only.

``register`` is the plugin: SGLang calls it in every process (entry point group
``sglang.srt.plugins``, declared in pyproject.toml); it adds the name ``metrale`` to
SGLang's backend registry and its ``--attention-backend`` choices, and imports nothing
else until the backend is built. The backend is ``backend.MetraleSGLangBackend``; the
refusals and the CSR arithmetic, which need no SGLang, are in ``options`` and ``csr``.
"""

from __future__ import annotations

BACKEND_NAME = "metrale"
"""The name ``--attention-backend`` (or ``--decode-attention-backend``) takes."""


def register() -> None:
    """Add ``metrale`` to SGLang's attention backends (idempotent: SGLang may load plugins
    more than once per process)."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(_create)


def _create(runner):
    """SGLang's factory for the backend (the import of SGLang's classes happens here)."""
    from .backend import MetraleSGLangBackend

    return MetraleSGLangBackend(runner)
