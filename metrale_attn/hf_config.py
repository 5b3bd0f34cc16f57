"""What a Hugging Face ``config.json`` says about a model's attention layers (for ``precompile``).

Pure: a parsed ``config.json`` in, an ``HFModel`` out (the whole model's heads, head dim,
model dtype, and the kinds of attention layer it has, each with its count, features and, where
it differs from the model's, its own shape and softmax scale).
Only keys whose meaning the real configs of Llama 3, Qwen 2/3, Mistral, Gemma 2/3/4, gpt-oss,
Falcon, ChatGLM, GPT-BigCode (StarCoder), DBRX, DeepSeek-V2/V3 and Kimi-K2 pin down are read,
with transformers' (and, for the MLA softmax scale, vLLM's) semantics; a key that changes attention in a way not mapped here is refused with its name,
never ignored. A ``config.json`` is hostile input: ``load`` reads at most
``MAX_CONFIG_BYTES`` of UTF-8 nested at most ``MAX_DEPTH`` deep, layer kinds are counted
(never one entry per layer), and every refusal is an ``HFConfigError`` naming the file and
the key.

=============================  ==============================================================
key                            what it sets
=============================  ==============================================================
``text_config``                a multimodal model's language model: every key below is read
                               from it (``torch_dtype``/``dtype`` and ``model_type`` from it,
                               else from the top level)
``num_attention_heads``        q heads (the whole model's; ``shard_heads`` splits them)
``num_key_value_heads``        KV heads; absent or null: ``num_attention_heads``. Other model
                               families' KV-head keys (``KV_HEAD_KEYS``) are read by their model
                               type (``KV_RULES``): Falcon's ``num_kv_heads`` under
                               ``new_decoder_architecture`` or without ``multi_query`` (default
                               true: one KV head), GPT-BigCode's ``multi_query``, ChatGLM's
                               ``multi_query_group_num`` under ``multi_query_attention``, DBRX's
                               ``attn_config.kv_n_heads``; one a model type does not read must
                               agree, else the config is refused
``n_head``, ``num_layers``...  a model type's own names for the keys here
                               (``MODEL_TYPE_ALIASES``: GPT-BigCode, DBRX, ChatGLM's
                               ``kv_channels`` as ``head_dim``)
``head_dim``                   head dim; absent or null: ``hidden_size / num_attention_heads``
``torch_dtype`` / ``dtype``    q dtype when ``bfloat16`` or ``float16`` (vLLM's ``--dtype auto``)
``sliding_window``             ``window_left = sliding_window - 1`` on sliding layers (vLLM's
                               convention: the window counts the current token); null: none
``use_sliding_window``         false: no layer slides (Qwen 2/3), whatever ``sliding_window`` says
``layer_types``                each layer's kind: ``full_attention`` or ``sliding_attention``
``sliding_window_pattern``     layer ``i`` slides unless ``(i + 1) % pattern == 0`` (Gemma 3)
``max_window_layers``          layers ``i >= max_window_layers`` slide (Qwen 2/3)
``attn_logit_softcapping``     ``logits_soft_cap`` on every layer (Gemma 2); null or 0: none
``query_pre_attn_scalar``      Gemma 2/3: ``sm_scale = query_pre_attn_scalar ** -0.5`` (default 256)
``model_type == "gpt_oss"``    ``sinks=True`` on every layer (learned per-head sinks)
``global_head_dim``            Gemma 4 (``gemma4``, ``gemma4_text``): the head dim of its
                               ``full_attention`` layers (default 512); null or 0: ``head_dim``.
                               Gemma 4's logits are unscaled on every layer (``sm_scale`` 1)
``attention_k_eq_v``           Gemma 4: its full layers compute V with K's projection (``k_eq_v``;
                               the cached K and V still differ: K is normed with a weight and
                               rotated, V normed without one) and take
                               ``num_global_key_value_heads`` KV heads (null: ``num_key_value_heads``)
``use_bidirectional_attention``  Gemma 4's ``"vision"``: an image's tokens see each other at
                               prefill; decode stays causal (any other true value is refused)
``num_kv_shared_layers``       Gemma 4: the last layers read earlier layers' caches (same kernels)
``per_layer_config``           Gemma 4 (transformers' saved overrides): must agree with the above
``kv_lora_rank``               multi-head latent attention (DeepSeek-V2/V3, Kimi-K2: model types
                               ``MLA_MODEL_TYPES``), decoded in the absorbed form: one latent KV
                               head of ``head_dim = kv_lora_rank + qk_rope_head_dim`` (576) whose
                               values are its first ``kv_lora_rank`` dims (``v_head_dim`` 512,
                               ``v_in_k``), ``num_attention_heads`` q heads; ``num_key_value_heads``
                               and the model's ``v_head_dim`` (128) do not enter it
``qk_nope_head_dim``,          MLA: the softmax scale ``1 / sqrt(qk_nope_head_dim +
``qk_rope_head_dim``           qk_rope_head_dim)``
``rope_scaling`` /             MLA: with type ``yarn``, the scale times ``mscale ** 2``, ``mscale =
``rope_parameters``            0.1 mscale_all_dim ln(factor) + 1`` (1 where ``factor <= 1``), as
                               vLLM's ``deepseek_v2.py``; another type is refused
=============================  ==============================================================

Where no ``layer_types`` is given, the layer kinds follow transformers' defaults in this
order: ``sliding_window_pattern``, the model type's alternation (``ALTERNATING``: Gemma 2
and gpt-oss slide on even layers), ``max_window_layers``, else every layer slides
(Mistral 7B v0.1); Gemma 4's last layer is a full one whatever they say (transformers
forces it). A key a config omits takes its model type's transformers default where
``MODEL_TYPE_DEFAULTS`` has one (Gemma 3's ``text_config`` omits ``head_dim`` 256, which is
not ``hidden_size / num_attention_heads``). Refused: bidirectional attention, chunked local
attention (``attention_chunk_size``, Llama 4), multi-head latent attention of other model
types, DeepSeek's sparse attention (``index_topk``), ALiBi (Falcon's ``alibi``; BLOOM, Jais, MPT, Baichuan: ``REFUSED_MODEL_TYPES``),
unscaled logits (``scale_attn_weights`` false), and layer kinds other than the two above.

Why ours, not transformers' ``AutoConfig``, even where transformers is installed: this is the one
reader (two would be two behaviours for one file). transformers is a multi-second import absent
from the serving venvs that precompile for other machines; its config classes accept unknown
keys silently, where a key that changes attention must be refused here; and it knows neither the
absorbed MLA form nor the limits of hostile input above. Its defaults are what ours must agree
with: ``tests/test_hf_config_transformers.py`` reads every fixture through both (in CI's vLLM
venv, where vLLM brings transformers) and compares heads, KV heads, head dims, layer kinds and
windows, per layer where transformers keeps per-layer shapes (Gemma 4).
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections import Counter
from dataclasses import dataclass, replace
from itertools import accumulate
from pathlib import Path
from typing import Optional

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)

MODEL_DTYPES = {"bfloat16": "bfloat16", "float16": "float16"}
"""``torch_dtype`` values that are our q dtype as they are (vLLM serves them as they are)."""

MODEL_TYPE_DEFAULTS: dict[str, dict] = {
    # transformers' Gemma2Config class defaults (configuration_gemma2.py).
    "gemma2": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096,
               "attn_logit_softcapping": 50.0, "query_pre_attn_scalar": 256},
    # transformers' Gemma3TextConfig class defaults (configuration_gemma3.py): Gemma 3's
    # text_config omits those equal to them (head_dim on every size; heads on the 4B).
    "gemma3_text": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096,
                    "sliding_window_pattern": 6, "query_pre_attn_scalar": 256},
}
"""A model type's defaults for the keys its ``config.json`` may omit (a saved config
leaves out values equal to its class's defaults)."""
MODEL_TYPE_DEFAULTS["gemma3"] = MODEL_TYPE_DEFAULTS["gemma3_text"]  # a text_config without its model_type
# transformers' Gemma4TextConfig class defaults (configuration_gemma4.py: global_head_dim is
# popped with default 512; layer_types default to 5 sliding : 1 full).
MODEL_TYPE_DEFAULTS["gemma4_text"] = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                                      "sliding_window": 512, "sliding_window_pattern": 6, "global_head_dim": 512}
MODEL_TYPE_DEFAULTS["gemma4"] = MODEL_TYPE_DEFAULTS["gemma4_text"]

GEMMA4_MODEL_TYPES = ("gemma4", "gemma4_text")
"""Gemma 4: full layers of their own head dim (``global_head_dim``) and KV heads, V from K's
projection under ``attention_k_eq_v``, logits unscaled (``scaling = 1.0``: q and k are
RMS-normed), the last layer full."""

MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
"""Model types whose ``kv_lora_rank`` is DeepSeek's multi-head latent attention as transformers'
DeepseekV2/V3 and vLLM's ``deepseek_v2.py`` compute it (Kimi-K2's ``kimi_k2`` is DeepseekV3's
architecture under its own name)."""

ALTERNATING = {"gemma2": 2, "gpt_oss": 2}
"""Model types whose layers alternate sliding and full attention when ``layer_types`` is
absent: transformers' default ``"sliding_attention" if (i + 1) % 2 else "full_attention"``."""

SINK_MODEL_TYPES = ("gpt_oss",)
"""Model types with learned attention sinks (one logit per q head) on every layer."""

REFUSED_KEYS = {
    "use_bidirectional_attention": "bidirectional attention (an encoder) is not causal decode",
    "attention_chunk_size": "chunked local attention (Llama 4) is not a sliding window; these kernels have none",
    "index_topk": "DeepSeek's sparse attention (a top-k token indexer, DeepSeek-V3.2) is not mapped",
    "alibi": "ALiBi position biases (Falcon's alibi) are not added by these kernels",
    "scale_attn_by_inverse_layer_idx": "a logits scale that changes with the layer (GPT-2) is not mapped",
    "num_key_value_heads_per_layer": "KV heads that differ from layer to layer (DeciLM) are not mapped",
    "block_configs": "attention that differs from block to block (Nemotron-NAS, DeciLM: n_heads_in_group, no_op) is "
                     "not mapped",
}
"""Keys that, when set (not null, false or 0), change attention in a way the kernels do not serve."""
UNSCALED_KEY = "scale_attn_weights"
"""GPT-2's and GPT-BigCode's: false means logits without the 1/sqrt(head_dim) scale, refused."""

REFUSED_MODEL_TYPES = {
    "bloom": "BLOOM's attention adds ALiBi position biases, which these kernels do not",
    "jais": "Jais's attention adds ALiBi position biases, which these kernels do not",
    "mpt": "MPT's attention (ALiBi by default, attn_config's attn_type, kv_n_heads, softmax_scale, prefix_lm) is "
           "not mapped",
    "baichuan": "Baichuan 13B adds ALiBi position biases and 7B does not, under the same model_type",
    "RefinedWeb": "Falcon's remote-code config (n_head_kv, before transformers' falcon) is not mapped; use the "
                  "model's model_type falcon config.json",
    "RefinedWebModel": "Falcon's remote-code config (before transformers' falcon) is not mapped; use the model's "
                       "model_type falcon config.json",
}
"""Model types whose attention these kernels do not serve, or whose config.json does not say
which attention it is."""

MODEL_TYPE_ALIASES: dict[str, dict[str, str]] = {
    # transformers' attribute_map: these configs spell the keys read here their own way.
    "gpt_bigcode": {"num_attention_heads": "n_head", "num_hidden_layers": "n_layer", "hidden_size": "n_embd"},
    "dbrx": {"num_attention_heads": "n_heads", "num_hidden_layers": "n_layers", "hidden_size": "d_model"},
    # ChatGLM's remote code: kv_channels is the head dim (its projection is heads x kv_channels).
    "chatglm": {"num_hidden_layers": "num_layers", "head_dim": "kv_channels"},
}
"""A model type's own spelling of a key read here; the key itself, where also given, must agree."""

KV_COUNT_KEYS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "n_kv_heads", "multi_query_group_num")
KV_HEAD_KEYS = KV_COUNT_KEYS + ("multi_query", "multi_query_attention", "attn_config.kv_n_heads")
"""Every key a model family transformers or vLLM knows gives its KV heads by: Llama's and most
others' ``num_key_value_heads``, Falcon's ``num_kv_heads`` (``n_head_kv`` in its remote code)
with ``multi_query`` and ``new_decoder_architecture``, GPT-BigCode's ``multi_query``,
ChatGLM's ``multi_query_group_num`` with ``multi_query_attention``, DBRX's and MPT's
``attn_config.kv_n_heads``, and ``n_kv_heads`` (Meta's ``params.json``, OLMo's first
configs). Each model type reads some of them (``_kv_heads``); any other of them that a
config sets must say the same number of KV heads, or the config is refused. Per-layer KV
heads (``num_key_value_heads_per_layer``, ``block_configs``) are refused (``REFUSED_KEYS``)."""


class HFConfigError(ValueError):
    """A ``config.json`` these rules cannot map, naming the key."""


@dataclass(frozen=True)
class LayerKind:
    """One kind of attention layer: its name (``layer_types``' spelling), how many layers
    of the model have it, and its features (``DecodeAttention``'s keyword arguments); then
    where it differs from the model's: its KV heads and head dim (None: the model's), its
    values' width (``v_head_dim``, None: its head dim), its softmax scale (``sm_scale``, None:
    ``1 / sqrt(head_dim)``), and how its values relate to its keys: ``k_eq_v``, V computed
    with K's projection (Gemma 4; two caches all the same), ``v_in_k``, V is the first
    ``v_head_dim`` dims of each cached K row (MLA: one cache)."""

    name: str
    count: int
    window_left: int = -1
    logits_soft_cap: Optional[float] = None
    sinks: bool = False
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    sm_scale: Optional[float] = None
    k_eq_v: bool = False
    v_in_k: bool = False

    def describe(self) -> str:
        """``21 sliding_attention (window_left 4095, logits_soft_cap 50)``; a shape of its own
        first (``5 full_attention (head_dim 512, 2 KV heads, ...)``)."""
        features = [f"head_dim {self.head_dim}"] if self.head_dim is not None else []
        features += [f"v_head_dim {self.v_head_dim}"] if self.v_head_dim is not None else []
        features += [f"{self.num_kv_heads} KV heads"] if self.num_kv_heads is not None else []
        features += ["V the first v_head_dim dims of each K row"] if self.v_in_k else []
        features += ["V from K's projection"] if self.k_eq_v else []
        features += [f"sm_scale {self.sm_scale:.6g}"] if self.sm_scale is not None else []
        features += [f"window_left {self.window_left}"] if self.window_left >= 0 else []
        features += [f"logits_soft_cap {self.logits_soft_cap:g}"] if self.logits_soft_cap is not None else []
        features += ["sinks"] if self.sinks else []
        return f"{self.count} {self.name}" + (f" ({', '.join(features)})" if features else "")


@dataclass(frozen=True)
class HFModel:
    """A model's attention as its ``config.json`` says: the whole model's heads (before
    tensor parallelism), the head dim, the model dtype (None: not one we serve as it is),
    the layer kinds, and where each value came from (``notes``)."""

    source: str
    model_type: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: Optional[str]
    kinds: tuple[LayerKind, ...]
    notes: tuple[str, ...] = ()

    def shape_of(self, kind: LayerKind) -> tuple[int, int, int]:
        """``(num_kv_heads, head_dim, v_head_dim)`` of one of its layer kinds (the whole model's
        KV heads), each the kind's own where it has one, else the model's."""
        head_dim = kind.head_dim if kind.head_dim is not None else self.head_dim
        kv_heads = kind.num_kv_heads if kind.num_kv_heads is not None else self.num_kv_heads
        return kv_heads, head_dim, kind.v_head_dim if kind.v_head_dim is not None else head_dim


MAX_CONFIG_BYTES = 8 << 20
"""The largest ``config.json`` read (bytes): real ones are a few KiB (a quantized model's with
per-module lists, a few hundred); past this the file is not read on (``/dev/zero`` ends)."""

MAX_DEPTH = 64
"""The deepest nesting of JSON arrays and objects read: real configs nest 3 or 4 deep
(``text_config.rope_scaling``); past this the text is refused before it is parsed, so the
parser never recurses deeply (no RecursionError, whatever the caller's stack)."""

_JSON_STRING = re.compile(r'"[^"]*"')  # once escapes are gone, a string holds no quote
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def load(path) -> HFModel:
    """``from_dict`` of the JSON file at ``path`` (a ``config.json``): UTF-8, at most
    ``MAX_CONFIG_BYTES`` and ``MAX_DEPTH`` deep, else an ``HFConfigError`` naming the file."""
    path = Path(path)
    where = f"--hf-config {path}"
    try:
        with path.open("rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)  # bounded: a device or a huge file is not read whole
    except OSError as err:
        raise HFConfigError(f"{where}: cannot read it ({err.strerror or err})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise HFConfigError(f"{where}: larger than {MAX_CONFIG_BYTES} bytes; a config.json is a few KiB")
    try:
        text = data.decode("utf-8")  # what transformers reads it as
    except UnicodeDecodeError as err:
        raise HFConfigError(f"{where}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); a "
                            "config.json is UTF-8 JSON") from None
    depth = json_depth(text)
    if depth > MAX_DEPTH:
        raise HFConfigError(f"{where}: JSON nested more than {MAX_DEPTH} deep; a config.json nests a few levels")
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as err:  # RecursionError: only on a nearly exhausted stack
        raise HFConfigError(f"{where}: not JSON ({err})") from None
    return from_dict(config, source=str(path))


def json_depth(text: str) -> int:
    """How deep the arrays and objects of JSON ``text`` nest (brackets inside strings do not
    count), without parsing it, in time linear in its length whatever it holds."""
    # JSON escapes pair from the left, so dropping each escaped backslash, then each escaped
    # quote, leaves strings without a quote inside (a backslash outside a string is no JSON:
    # the parser refuses it afterwards). Every step is linear: no regex retries a failed match.
    unescaped = text.replace("\\\\", "").replace('\\"', "")
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", unescaped))
    return max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)


def from_dict(config, source: str = "config.json") -> HFModel:
    """The attention of the model ``config`` (a parsed ``config.json``) describes."""
    if not isinstance(config, dict):
        raise HFConfigError(f"{source}: a config.json holds a JSON object, got {type(config).__name__}")
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise HFConfigError(f"{source}: text_config must be a JSON object, got {type(text).__name__}")
    where = f"{source} text_config" if text else source
    section = text or config
    model_type = section.get("model_type") or config.get("model_type") or ""
    if not isinstance(model_type, str):
        raise HFConfigError(f"{where}: model_type must be a string, got {model_type!r}")
    if model_type in REFUSED_MODEL_TYPES:
        raise HFConfigError(f"{where}: model_type {model_type!r}: {REFUSED_MODEL_TYPES[model_type]} (give the shape "
                            "and features explicitly only if the attention is plain causal softmax)")
    notes: list[str] = []
    section = _canonical(where, section, model_type, notes)
    defaults = MODEL_TYPE_DEFAULTS.get(model_type, {})

    def value(key: str):
        """The key's value, else the model type's default (noted), else None."""
        if section.get(key) is not None:
            return section[key]
        if key in defaults:
            notes.append(f"{key} {defaults[key]} ({model_type}'s default: the config omits it)")
            return defaults[key]
        return None

    for key, why in REFUSED_KEYS.items():
        if key == "use_bidirectional_attention" and model_type in GEMMA4_MODEL_TYPES and section.get(key) == "vision":
            notes.append("use_bidirectional_attention vision: an image's tokens see each other at prefill; decode "
                         "is causal")
            continue
        if section.get(key):
            raise HFConfigError(f"{where}: {key} = {section[key]!r}: {why}")
    if section.get(UNSCALED_KEY) is False:
        raise HFConfigError(f"{where}: {UNSCALED_KEY} = False: logits without the 1/sqrt(head_dim) scale are not "
                            "mapped")
    if section.get("kv_lora_rank") not in (None, False, 0):
        if model_type not in MLA_MODEL_TYPES:
            raise HFConfigError(f"{where}: kv_lora_rank = {section['kv_lora_rank']!r}: multi-head latent attention of "
                                f"model_type {model_type or '(none)'} is not mapped (only {', '.join(MLA_MODEL_TYPES)})")
        return _mla(where, source, section, config, model_type, value, notes)
    heads = _positive_int(where, "num_attention_heads", value("num_attention_heads"))
    kv_heads = _kv_heads(where, section, model_type, heads, value, notes)
    head_dim = _head_dim(where, value("head_dim"), section.get("hidden_size"), heads, notes)
    dtype = _dtype(section, config, notes)
    kinds = _kinds(where, section, model_type, value, notes)
    if model_type in GEMMA4_MODEL_TYPES:
        kinds = _gemma4_kinds(where, section, value, head_dim, kv_heads, kinds, notes)
    elif model_type in QUERY_SCALAR_MODEL_TYPES:
        kinds = _query_scalar_kinds(where, value, head_dim, kinds, notes)
    return HFModel(source, model_type, heads, kv_heads, head_dim, dtype, kinds, tuple(notes))


QUERY_SCALAR_MODEL_TYPES = ("gemma2", "gemma3", "gemma3_text")
"""Model types whose softmax scale is ``query_pre_attn_scalar ** -0.5`` (transformers' Gemma 2/3
``scaling``), not ``1 / sqrt(head_dim)``: Gemma-2-27B's 144 at head_dim 128, Gemma-3-27B's 168."""


def _query_scalar_kinds(where: str, value, head_dim: int, kinds: tuple[LayerKind, ...],
                        notes: list) -> tuple[LayerKind, ...]:
    """``kinds`` at the scale ``query_pre_attn_scalar`` gives, where it is not ``head_dim``."""
    scalar = _positive_int(where, "query_pre_attn_scalar", value("query_pre_attn_scalar"))
    if scalar == head_dim:
        return kinds
    notes.append(f"sm_scale {scalar ** -0.5:.6g} = 1/sqrt(query_pre_attn_scalar {scalar}), not 1/sqrt(head_dim "
                 f"{head_dim})")
    return tuple(replace(kind, sm_scale=scalar ** -0.5) for kind in kinds)


def shard_heads(num_q_heads: int, num_kv_heads: int, tensor_parallel: int,
                kv_key: str = "num_key_value_heads") -> tuple[int, int]:
    """One rank's ``(q heads, KV heads)`` under tensor parallelism, as vLLM splits them: q
    heads divide evenly; KV heads divide evenly when there are at least as many as ranks,
    else each is replicated over ``tensor_parallel / num_kv_heads`` ranks (one per rank: MLA's
    one latent head is on every rank). Each count is an int >= 1 (any ``numbers.Integral``,
    never a bool), else a ValueError naming it, as ``DecodeAttention`` checks its counts;
    ``kv_key`` is the config key the KV heads came from, which a refusal names."""
    num_q_heads = count_argument("num_q_heads", num_q_heads)
    num_kv_heads = count_argument("num_kv_heads", num_kv_heads)
    tensor_parallel = count_argument("tensor_parallel", tensor_parallel)
    if num_q_heads % tensor_parallel:
        raise HFConfigError(f"--tensor-parallel-size {tensor_parallel} must divide num_attention_heads "
                            f"{num_q_heads}")
    if num_kv_heads >= tensor_parallel:
        if num_kv_heads % tensor_parallel:
            raise HFConfigError(f"--tensor-parallel-size {tensor_parallel} must divide {kv_key} "
                                f"{num_kv_heads} (or be a multiple of it)")
        return num_q_heads // tensor_parallel, num_kv_heads // tensor_parallel
    if tensor_parallel % num_kv_heads:
        raise HFConfigError(f"--tensor-parallel-size {tensor_parallel} must be a multiple of {kv_key} "
                            f"{num_kv_heads} (or divide it)")
    return num_q_heads // tensor_parallel, 1


def count_argument(argument: str, value) -> int:
    """``value`` as an int >= 1 (a count of heads or ranks): any ``numbers.Integral``, not a
    bool (``config.int_in``'s rule and message; this module imports nothing of the package)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{argument} must be an int >= 1, got {value!r}")
    return int(value)


# -- the pieces --------------------------------------------------------------------------


def _canonical(where: str, section: dict, model_type: str, notes: list) -> dict:
    """``section`` with the keys read here under their own names, where the model type spells
    them its own way (``MODEL_TYPE_ALIASES``); both spellings given must agree."""
    aliases = MODEL_TYPE_ALIASES.get(model_type, {})
    found = {}
    for key, alias in aliases.items():
        if section.get(alias) is None:
            continue
        if section.get(key) is not None and section[key] != section[alias]:
            raise HFConfigError(f"{where}: {key} = {section[key]!r} and {alias} = {section[alias]!r} disagree "
                                f"({alias} is model_type {model_type}'s name for {key})")
        found[key] = section[alias]
        notes.append(f"{key} from {alias} (model_type {model_type}'s name for it)")
    return {**section, **found} if found else section


def _kv_heads(where: str, section: dict, model_type: str, heads: int, value, notes: list) -> int:
    """The whole model's KV heads, by the keys its model type reads (transformers' modelling
    code, vLLM's ``get_total_num_kv_heads``); any other key of ``KV_HEAD_KEYS`` the config sets
    must say the same number, else refused (never ignored)."""
    read, kv_heads = KV_RULES.get(model_type, _kv_num_key_value_heads)(where, section, heads, value, notes)
    for key, claimed in _kv_claims(section).items():
        if key in read:
            continue
        if isinstance(claimed, int) and not isinstance(claimed, bool) and claimed == kv_heads:
            notes.append(f"{key} agrees: {kv_heads} KV heads")
            continue
        raise HFConfigError(f"{where}: {key} = {_raw(section, key)!r} gives another model family's KV heads, "
                            f"but model_type {model_type or '(none)'} reads {' / '.join(read)} ({kv_heads} KV "
                            "heads): refused, not guessed (give --kv-heads with the shape instead)")
    return kv_heads


def _raw(section: dict, key: str):
    if key == "attn_config.kv_n_heads":
        return section["attn_config"]["kv_n_heads"]
    return section.get(key)


def _kv_claims(section: dict) -> dict:
    """The number of KV heads each key of ``KV_HEAD_KEYS`` the config sets says (1 for a true
    ``multi_query``; ChatGLM's ``multi_query_attention`` says ``multi_query_group_num``'s)."""
    claims = {key: section[key] for key in KV_COUNT_KEYS if section.get(key) is not None}
    if section.get("multi_query") not in (None, False):
        claims["multi_query"] = 1 if section["multi_query"] is True else section["multi_query"]
    if section.get("multi_query_attention") not in (None, False):
        claims["multi_query_attention"] = section.get("multi_query_group_num")
    attn = section.get("attn_config")
    if isinstance(attn, dict) and attn.get("kv_n_heads") is not None:
        claims["attn_config.kv_n_heads"] = attn["kv_n_heads"]
    return claims


def _flag(where: str, section: dict, key: str, default: bool) -> bool:
    raw = section.get(key)
    if raw is None:
        return default
    if not isinstance(raw, bool):
        raise HFConfigError(f"{where}: {key} must be true or false, got {raw!r}")
    return raw


def _kv_num_key_value_heads(where, section, heads, value, notes):
    """Llama's and most models': ``num_key_value_heads``, absent: one per q head."""
    raw = value("num_key_value_heads")
    return ("num_key_value_heads",), heads if raw is None else _positive_int(where, "num_key_value_heads", raw)


def _kv_falcon(where, section, heads, value, notes):
    """transformers' Falcon: ``num_kv_heads`` (absent: ``num_attention_heads``) under
    ``new_decoder_architecture`` or without ``multi_query`` (default true), else one."""
    read = ("new_decoder_architecture", "multi_query", "num_kv_heads")
    raw = section.get("num_kv_heads")
    if _flag(where, section, "new_decoder_architecture", False) or not _flag(where, section, "multi_query", True):
        return read, heads if raw is None else _positive_int(where, "num_kv_heads", raw)
    unused = f" (num_kv_heads {raw!r} unused, as Falcon's modelling ignores it here)" if raw is not None else ""
    notes.append(f"1 KV head: falcon's multi_query without new_decoder_architecture{unused}")
    return read, 1


def _kv_gpt_bigcode(where, section, heads, value, notes):
    """transformers' GPT-BigCode: one KV head under ``multi_query`` (default true), else one per q head."""
    if _flag(where, section, "multi_query", True):
        notes.append("1 KV head: gpt_bigcode's multi_query")
        return ("multi_query",), 1
    return ("multi_query",), heads


def _kv_chatglm(where, section, heads, value, notes):
    """ChatGLM's: ``multi_query_group_num`` under ``multi_query_attention`` (default false), else one per q head."""
    read = ("multi_query_attention", "multi_query_group_num")
    if _flag(where, section, "multi_query_attention", False):
        return read, _positive_int(where, "multi_query_group_num", section.get("multi_query_group_num"))
    if section.get("multi_query_group_num") is not None:
        notes.append(f"multi_query_group_num {section['multi_query_group_num']!r} unused (multi_query_attention "
                     "false)")
    return read, heads


def _kv_dbrx(where, section, heads, value, notes):
    """transformers' DBRX: ``attn_config.kv_n_heads`` (DbrxAttentionConfig's default 1)."""
    attn = section.get("attn_config")
    if attn is None:
        attn = {}
    if not isinstance(attn, dict):
        raise HFConfigError(f"{where}: attn_config must be a JSON object, got {type(attn).__name__}")
    if attn.get("kv_n_heads") is None:
        notes.append("attn_config.kv_n_heads 1 (dbrx's default: the config omits it)")
        return ("attn_config.kv_n_heads",), 1
    return ("attn_config.kv_n_heads",), _positive_int(where, "attn_config.kv_n_heads", attn["kv_n_heads"])


KV_RULES = {"falcon": _kv_falcon, "gpt_bigcode": _kv_gpt_bigcode, "chatglm": _kv_chatglm, "dbrx": _kv_dbrx}
"""Model types whose KV heads are not ``num_key_value_heads``: their rule returns the keys it
read and the KV heads."""


def _positive_int(where: str, key: str, raw) -> int:
    if raw is None:
        raise HFConfigError(f"{where}: {key} is missing (give the shape with --q-heads, --kv-heads, --head-dim "
                            "instead)")
    if isinstance(raw, bool) or not isinstance(raw, int) or raw <= 0:
        raise HFConfigError(f"{where}: {key} must be a positive integer, got {raw!r}")
    return raw


def _head_dim(where: str, raw, hidden_size, heads: int, notes: list) -> int:
    if raw is not None:
        return _positive_int(where, "head_dim", raw)
    if hidden_size is None:
        raise HFConfigError(f"{where}: head_dim is missing, and so is hidden_size to derive it from")
    hidden = _positive_int(where, "hidden_size", hidden_size)
    if hidden % heads:
        raise HFConfigError(f"{where}: head_dim is missing and hidden_size {hidden} is not a multiple of "
                            f"num_attention_heads {heads}")
    notes.append(f"head_dim {hidden // heads} (hidden_size {hidden} / num_attention_heads {heads})")
    return hidden // heads


def _dtype(section: dict, config: dict, notes: list) -> Optional[str]:
    for where in (section, config):
        for key in ("torch_dtype", "dtype"):  # transformers >= 4.56 writes "dtype"
            raw = where.get(key)
            if raw is not None:
                dtype = MODEL_DTYPES.get(str(raw))
                if dtype is None:
                    notes.append(f"{key} {raw} is not a dtype served as it is (bfloat16, float16)")
                return dtype
    return None


def _kinds(where: str, section: dict, model_type: str, value, notes: list) -> tuple[LayerKind, ...]:
    """The model's layer kinds with their counts and features."""
    window = _window(where, section, value, notes)
    layers = section.get("num_hidden_layers")
    types = section.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types) or not types:
            raise HFConfigError(f"{where}: layer_types must be a non-empty list of strings")
        unknown = sorted(set(types) - set(LAYER_TYPES))
        if unknown:
            raise HFConfigError(f"{where}: layer_types has {', '.join(map(repr, unknown))}; only "
                                f"{' and '.join(LAYER_TYPES)} are mapped (give the shape and features explicitly)")
        if SLIDING in types and window is None:
            raise HFConfigError(f"{where}: layer_types has {SLIDING} layers but no sliding_window applies "
                                "(null, or use_sliding_window false)")
        if layers is not None and _shown_layer_count(where, layers) != len(types):
            raise HFConfigError(f"{where}: layer_types has {len(types)} entries but num_hidden_layers is {layers}")
        counts = Counter(types)
    elif window is None:
        counts = {FULL: _shown_layer_count(where, layers)}
    else:
        counts = _sliding_pattern(where, section, model_type, value, layers, notes)
    if model_type in GEMMA4_MODEL_TYPES and counts.get(SLIDING) and _last_slides(types, section, value):
        counts = {SLIDING: counts[SLIDING] - 1, FULL: counts.get(FULL, 0) + 1}
        notes.append("the last layer is full_attention (gemma4: transformers forces it)")
    cap = _soft_cap(where, value("attn_logit_softcapping"))
    sinks = model_type in SINK_MODEL_TYPES
    if sinks:
        notes.append(f"sinks on every layer (model_type {model_type}: learned per-head sinks)")
    return tuple(LayerKind(name, counts[name], window - 1 if name == SLIDING else -1, cap, sinks)
                 for name in (SLIDING, FULL) if counts.get(name))


def _last_slides(types, section: dict, value) -> bool:
    """Whether the last layer slides by ``layer_types``, else by ``sliding_window_pattern`` (both
    checked by ``_kinds`` already): the layer Gemma 4's config turns into a full one."""
    if types is not None:
        return types[-1] == SLIDING
    pattern = value("sliding_window_pattern")
    return pattern is not None and section.get("num_hidden_layers") % pattern != 0


def _window(where: str, section: dict, value, notes: list) -> Optional[int]:
    """``sliding_window`` (tokens, the current one included), or None when no layer slides."""
    if section.get("use_sliding_window") is False:
        if section.get("sliding_window") is not None:
            notes.append(f"sliding_window {section['sliding_window']} unused (use_sliding_window false)")
        return None
    raw = value("sliding_window")
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise HFConfigError(f"{where}: sliding_window must be a positive integer (tokens, the current one "
                            f"included) or null, got {raw!r}")
    return raw


def _sliding_pattern(where: str, section: dict, model_type: str, value, layers, notes: list) -> dict[str, int]:
    """How many layers of each kind, where ``layer_types`` is absent, as transformers derives
    each layer's kind; counted, never listed (``num_hidden_layers`` may be any integer)."""
    pattern = value("sliding_window_pattern")
    rule = None
    if pattern is not None:
        rule = f"sliding_window_pattern {pattern}"
    elif model_type in ALTERNATING:
        pattern, rule = ALTERNATING[model_type], f"model_type {model_type} alternates"
    if pattern is not None:
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise HFConfigError(f"{where}: sliding_window_pattern must be a positive integer, got {pattern!r}")
        count = _layer_count(where, layers, rule)
        notes.append(f"layer kinds from {rule}: layer i slides unless (i + 1) % {pattern} == 0")
        full = count // pattern  # the layers i + 1 = pattern, 2 * pattern, ... <= count
        return {SLIDING: count - full, FULL: full}
    first = section.get("max_window_layers")
    if first is not None:
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise HFConfigError(f"{where}: max_window_layers must be a non-negative integer, got {first!r}")
        count = _layer_count(where, layers, "max_window_layers")
        notes.append(f"layer kinds from max_window_layers {first}: layers {first} and up slide")
        return {SLIDING: max(count - first, 0), FULL: min(count, first)}
    return {SLIDING: _shown_layer_count(where, layers)}


def _layer_count(where: str, layers, rule: str) -> int:
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise HFConfigError(f"{where}: num_hidden_layers must be a positive integer to apply {rule}, got {layers!r}")
    return layers


def _shown_layer_count(where: str, layers) -> int:
    """``num_hidden_layers`` where only the printed count reads it: 1 when absent (one kind of
    layer, count unknown), else a positive integer."""
    if layers is None:
        return 1
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise HFConfigError(f"{where}: num_hidden_layers must be a positive integer, got {layers!r}")
    return layers


def _soft_cap(where: str, raw) -> Optional[float]:
    if raw is None or raw == 0:
        return None
    cap = _as_float(raw)
    if cap is None or not (cap > 0 and math.isfinite(cap)):
        raise HFConfigError(f"{where}: attn_logit_softcapping must be a positive number (or null), got {raw!r}")
    return cap


def _as_float(raw) -> Optional[float]:
    """A JSON number as a float (an integer past the float range is inf), else None."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        return None
    try:
        return float(raw)
    except OverflowError:  # float(10**400)
        return math.inf


# -- Gemma 4: full layers of their own shape ------------------------------------------------


def _gemma4_kinds(where: str, section: dict, value, head_dim: int, kv_heads: int, kinds: tuple, notes: list) -> tuple:
    """Gemma 4's layer kinds as transformers' Gemma4TextAttention builds them: every layer's logits
    unscaled (``scaling = 1.0``); full layers at ``global_head_dim`` (null or 0: ``head_dim``),
    with ``num_global_key_value_heads`` KV heads and V from K's projection where
    ``attention_k_eq_v`` (the override is gated on it, as transformers and vLLM gate it)."""
    raw_global = value("global_head_dim")
    global_dim = head_dim if raw_global in (None, 0) else _positive_int(where, "global_head_dim", raw_global)
    k_eq_v = _flag(where, section, "attention_k_eq_v", False)
    raw_global_kv = section.get("num_global_key_value_heads")
    global_kv = kv_heads
    if raw_global_kv is not None:
        if k_eq_v:
            global_kv = _positive_int(where, "num_global_key_value_heads", raw_global_kv)
        else:
            notes.append(f"num_global_key_value_heads {raw_global_kv!r} unused (attention_k_eq_v false)")
    shared = section.get("num_kv_shared_layers")
    if shared is not None:
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise HFConfigError(f"{where}: num_kv_shared_layers must be a non-negative integer, got {shared!r}")
        if shared:
            notes.append(f"num_kv_shared_layers {shared}: the last {shared} layers read earlier layers' caches "
                         "(the same kernels; counted with their kinds)")
    _check_per_layer_config(where, section, global_dim, global_kv, k_eq_v)
    notes.append("sm_scale 1 on every layer (gemma4: q and k are RMS-normed, transformers' scaling = 1.0)")
    full = dict(head_dim=global_dim if global_dim != head_dim else None,
                num_kv_heads=global_kv if global_kv != kv_heads else None, k_eq_v=k_eq_v)
    return tuple(replace(kind, sm_scale=1.0, **(full if kind.name == FULL else {})) for kind in kinds)


def _check_per_layer_config(where: str, section: dict, global_dim: int, global_kv: int, k_eq_v: bool) -> None:
    """transformers' saved ``per_layer_config`` (``{layer: {"head_dim": .., "num_key_value_heads":
    ..}}``, the full layers' overrides it derives from the keys above): each entry must be a full
    layer's and say what those keys say, else refused (never a second source of truth)."""
    overrides = section.get("per_layer_config")
    if overrides is None:
        return
    types = section.get("layer_types")
    if not isinstance(overrides, dict) or not isinstance(types, list):
        raise HFConfigError(f"{where}: per_layer_config is mapped only as a JSON object beside layer_types, got "
                            f"{type(overrides).__name__}")
    expected = {"head_dim": global_dim, **({"num_key_value_heads": global_kv} if k_eq_v else {})}
    for layer, entry in overrides.items():
        index = int(layer) if isinstance(layer, str) and layer.isdigit() and len(layer) < 8 else -1
        if not 0 <= index < len(types) or types[index] != FULL or not isinstance(entry, dict) or any(
                entry.get(key, want) != want for key, want in expected.items()) or set(entry) - set(expected):
            raise HFConfigError(f"{where}: per_layer_config[{layer!r}] = {entry!r} is not what global_head_dim, "
                                "num_global_key_value_heads and attention_k_eq_v give that layer: refused, not "
                                "guessed")


# -- MLA: DeepSeek-V2/V3 and Kimi-K2, decoded in the absorbed form ----------------------------


def _mla(where: str, source: str, section: dict, config: dict, model_type: str, value, notes: list) -> HFModel:
    """Multi-head latent attention in the absorbed decode form (vLLM's MLA backends, FlashMLA):
    every layer is multi-query attention of ``num_attention_heads`` q heads over one latent KV
    head of ``kv_lora_rank + qk_rope_head_dim`` dims, its values the first ``kv_lora_rank`` of
    them, at the model's softmax scale (``_mla_sm_scale``)."""
    heads = _positive_int(where, "num_attention_heads", value("num_attention_heads"))
    rank = _positive_int(where, "kv_lora_rank", section.get("kv_lora_rank"))
    rope = _positive_int(where, "qk_rope_head_dim", section.get("qk_rope_head_dim"))
    nope = _positive_int(where, "qk_nope_head_dim", section.get("qk_nope_head_dim"))
    if section.get("v_head_dim") is not None:
        model_v = _positive_int(where, "v_head_dim", section.get("v_head_dim"))
        notes.append(f"v_head_dim {model_v} is each head's value width before the output projection; the absorbed "
                     f"decode reads the {rank}-dim latent values (v_head_dim {rank})")
    if section.get("num_key_value_heads") is not None:
        notes.append(f"num_key_value_heads {section['num_key_value_heads']!r} unused: MLA caches one latent head")
    predict = section.get("num_nextn_predict_layers")
    if isinstance(predict, int) and not isinstance(predict, bool) and predict > 0:
        notes.append(f"num_nextn_predict_layers {predict}: the MTP module's attention is this kind too (not counted)")
    sm_scale = _mla_sm_scale(where, section, nope + rope, notes)
    kinds = tuple(replace(kind, v_head_dim=rank, sm_scale=sm_scale, v_in_k=True)
                  for kind in _kinds(where, section, model_type, value, notes))
    notes.append(f"absorbed MLA: 1 latent KV head, head_dim {rank + rope} (kv_lora_rank {rank} + qk_rope_head_dim "
                 f"{rope}), values its first {rank} dims")
    return HFModel(source, model_type, heads, 1, rank + rope, _dtype(section, config, notes), kinds, tuple(notes))


def _mla_sm_scale(where: str, section: dict, qk_head_dim: int, notes: list) -> float:
    """``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``, times ``mscale ** 2`` under YaRN rope
    scaling (``yarn_get_mscale(factor, mscale_all_dim) = 0.1 mscale_all_dim ln(factor) + 1``, 1
    where ``factor <= 1``): DeepSeek's modelling and vLLM's ``deepseek_v2.py``. Rope scaling of
    another type is refused (vLLM turns any into its DeepSeek YaRN; not guessed here)."""
    scale = qk_head_dim ** -0.5
    key = "rope_scaling" if section.get("rope_scaling") is not None else "rope_parameters"
    rope = section.get(key)
    if rope is None:
        return scale
    if not isinstance(rope, dict):
        raise HFConfigError(f"{where}: {key} must be a JSON object, got {type(rope).__name__}")
    kind = rope.get("rope_type", rope.get("type"))
    if kind in (None, "default"):
        return scale
    if kind not in ("yarn", "deepseek_yarn"):
        raise HFConfigError(f"{where}: {key} type {kind!r} on multi-head latent attention: only yarn's softmax "
                            "scale is mapped")
    factor = _as_float(rope.get("factor"))
    if factor is None or not (factor > 0 and math.isfinite(factor)):
        raise HFConfigError(f"{where}: {key}.factor must be a positive number, got {rope.get('factor')!r}")
    raw_all = rope.get("mscale_all_dim")
    all_dim = 0.0 if raw_all in (None, False) else _as_float(raw_all)
    if all_dim is None or not (all_dim >= 0 and math.isfinite(all_dim)):
        raise HFConfigError(f"{where}: {key}.mscale_all_dim must be a non-negative number, got {raw_all!r}")
    mscale = 1.0 if factor <= 1 else 0.1 * all_dim * math.log(factor) + 1.0
    notes.append(f"sm_scale {scale * mscale * mscale:.6g} = 1/sqrt({qk_head_dim}) x mscale^2 (yarn factor {factor:g}, "
                 f"mscale_all_dim {all_dim:g}: mscale {mscale:.6g})")
    return scale * mscale * mscale
