"""Named model shapes (``--model NAME`` on the command line): one layer kind each, the whole model's
heads, and the ``Q/KV/HEAD_DIM`` spelling of any other shape. A model's full description, with its
layer kinds and features, comes from its ``config.json`` instead (``hf_config``)."""

from __future__ import annotations

from .config import ModelShape

MODELS: dict[str, ModelShape] = {
    "qwen3.8-27b": ModelShape(24, 4, 256),  # the GQA-pack width: 24 = 4 x 6 at head_dim 256
    "llama-3-8b": ModelShape(32, 8, 128),
    "llama-3-70b": ModelShape(64, 8, 128),
}


def model_shape(name: str) -> ModelShape:
    """A preset of ``MODELS`` or ``32/8/128`` (q heads / KV heads / head dim) as a shape; else a
    ValueError naming ``--model`` and what it takes."""
    if name in MODELS:
        return MODELS[name]
    try:
        q, kv, d = (int(x) for x in name.split("/"))
    except ValueError:
        raise ValueError(f"--model takes {', '.join(sorted(MODELS))} or Q/KV/HEAD_DIM (32/8/128); got {name!r}") \
            from None
    if min(q, kv, d) < 1:
        raise ValueError(f"--model {name}: heads and head dim must be >= 1")
    return ModelShape(q, kv, d)
