"""Named model shapes (``--model NAME`` on the command line): one layer kind each, the whole model's
heads. A model's full description, with its layer kinds and features, comes from its
``config.json`` instead (``hf_config``)."""

from __future__ import annotations

from .config import ModelShape

MODELS: dict[str, ModelShape] = {
    "qwen3.8-27b": ModelShape(24, 4, 256),  # the GQA-pack width: 24 = 4 x 6 at head_dim 256
    "llama-3-8b": ModelShape(32, 8, 128),
    "llama-3-70b": ModelShape(64, 8, 128),
}
