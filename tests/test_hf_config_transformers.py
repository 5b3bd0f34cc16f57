"""``hf_config`` against transformers: for every fixture ``config.json`` whose model type the
installed transformers knows, both read the same heads, KV heads, head dim, layer kinds and
window. ``hf_config`` is the one reader in the product (see its first lines); this is what keeps
its table of model-type defaults from drifting from transformers'. transformers is not in the
main venv: CI runs this file in its vLLM venv, where vLLM brings transformers, and there a
missing transformers is a failure (``METRALE_ATTN_REQUIRE_VLLM``)."""

from __future__ import annotations

import collections
import json
import pathlib

import pytest

from metrale_attn import hf_config
from support.optional import REQUIRE_VLLM

FIXTURES = sorted((pathlib.Path(__file__).parent / "hf_configs").glob("*.json"))
MIN_COMPARED = 12
"""At least this many fixtures must be compared (transformers 5.20, vLLM 0.33's, knows 14 of the 16: not
ChatGLM or Kimi-K2, which ship their own code): the test cannot pass by skipping them."""


def _transformers():
    import os

    if os.environ.get(REQUIRE_VLLM, "").strip() not in ("", "0"):
        import transformers

        return transformers
    return pytest.importorskip("transformers")


def _theirs(transformers, raw: dict):
    """transformers' text config for ``raw``, or None where it does not know the model type."""
    from transformers import CONFIG_MAPPING

    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        return None
    config = transformers.AutoConfig.for_model(**raw)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _kv_heads(text) -> int:
    for name in ("num_key_value_heads", "num_kv_heads"):
        value = getattr(text, name, None)
        if value is not None:
            return value
    return text.num_attention_heads


def test_hf_config_reads_every_fixture_transformers_knows_as_transformers_does():
    transformers = _transformers()
    compared, unknown = [], []
    for path in FIXTURES:
        raw = json.loads(path.read_text())
        text = _theirs(transformers, raw)
        if text is None:
            unknown.append(path.name)
            continue
        ours = hf_config.load(path)
        where = f"{path.name} (transformers {transformers.__version__})"
        assert ours.num_q_heads == text.num_attention_heads, where
        latent = getattr(text, "kv_lora_rank", None)
        if latent:  # MLA, read in its absorbed form: one latent KV head of latent + rope dims, values the latent
            (kind,) = ours.kinds
            assert (ours.num_kv_heads, ours.head_dim) == (1, latent + text.qk_rope_head_dim), where
            assert kind.v_head_dim == latent and kind.v_in_k, where
        elif text.to_dict().get("per_layer_config"):  # per-layer shapes (Gemma 4): each kind its own
            shapes = collections.defaultdict(set)
            for layer_type, layer in zip(text.to_dict()["layer_types"], text.per_layer_config):
                shapes[layer_type].add((layer.num_key_value_heads, layer.head_dim))
            assert {k.name: {ours.shape_of(k)[:2]} for k in ours.kinds} == dict(shapes), where
        elif ours.model_type not in ("falcon", "gpt_bigcode", "dbrx"):  # those keep KV heads in their modeling code
            assert ours.num_kv_heads == _kv_heads(text), where
            head_dim = getattr(text, "head_dim", None)
            if head_dim is not None:
                assert ours.head_dim == head_dim, where
        scalar = text.to_dict().get("query_pre_attn_scalar")  # Gemma 2/3: transformers' scaling
        if scalar is not None and ours.model_type in hf_config.QUERY_SCALAR_MODEL_TYPES:
            for kind in ours.kinds:
                assert (kind.sm_scale or ours.head_dim ** -0.5) == pytest.approx(scalar ** -0.5), where
        layer_types = text.to_dict().get("layer_types")
        if layer_types:
            assert {k.name: k.count for k in ours.kinds} == dict(collections.Counter(layer_types)), where
            window = getattr(text, "sliding_window", None)
            for kind in ours.kinds:
                if kind.name == hf_config.SLIDING:
                    assert kind.window_left == window - 1, where
        compared.append(path.name)
    assert len(compared) >= MIN_COMPARED, f"compared {compared}; transformers does not know {unknown}"
