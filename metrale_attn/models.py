"""Named model shapes (``--model NAME`` on the command line): one layer kind each, the whole model's
heads, and the ``Q/KV/HEAD_DIM`` (or ``Q/KV/HEAD_DIM/V_HEAD_DIM``) spelling of any other shape. A
model's full description, with its layer kinds and features, comes from its ``config.json``
instead (``hf_config``).

A shape with values narrower than keys is MLA's absorbed decode (``config.NARROW_V_SHAPES``, one
latent KV head): its V is the first ``v_head_dim`` dims of each cached K row, never a cache of its
own, so whoever builds its caches builds one (``v_in_k``)."""

from __future__ import annotations

from .config import ModelShape

MODELS: dict[str, ModelShape] = {
    "qwen3.8-27b": ModelShape(24, 4, 256),  # the GQA-pack width: 24 = 4 x 6 at head_dim 256
    "llama-3-8b": ModelShape(32, 8, 128),
    "llama-3-70b": ModelShape(64, 8, 128),
    # Gemma-4-26B-A4B's global (full-attention) layers: 16 q heads over 2 KV heads of 512 (its
    # num_global_key_value_heads); V from K's projection but cached apart, as wide as K. Its sliding
    # layers (16/8/256, a 1,024-token window) are --hf-config's.
    "gemma-4-26b-global": ModelShape(16, 2, 512),
    # DeepSeek-V3/R1 decode in MLA's absorbed form: 128 q heads over one latent KV head of 576
    # (512 latent + 64 rope), V the first 512 dims of each K row. --tp 8 gives a rank's 16 heads.
    "deepseek-v3": ModelShape(128, 1, 576, 512),
    # DeepSeek-V2-Lite in MLA's absorbed form: 16 q heads over one latent head of 576/512, the shape
    # of one rank of DeepSeek-V3 at TP 8 (and of Kimi-K2 at TP 4): MLA's memory-bound regime.
    "deepseek-v2-lite": ModelShape(16, 1, 576, 512),
}


def model_shape(name: str) -> ModelShape:
    """A preset of ``MODELS`` or ``32/8/128`` (q heads / KV heads / head dim), or ``16/1/576/512``
    (and the value width), as a shape; else a ValueError naming ``--model`` and what it takes."""
    if name in MODELS:
        return MODELS[name]
    try:
        dims = [int(x) for x in name.split("/")]
        if len(dims) not in (3, 4):
            raise ValueError
    except ValueError:
        raise ValueError(f"--model takes {', '.join(sorted(MODELS))}, Q/KV/HEAD_DIM (32/8/128) or "
                         f"Q/KV/HEAD_DIM/V_HEAD_DIM (16/1/576/512); got {name!r}") from None
    if min(dims) < 1:
        raise ValueError(f"--model {name}: heads and head dims must be >= 1")
    try:
        return ModelShape(*dims)
    except ValueError as err:
        raise ValueError(f"--model {name}: {err}") from None
