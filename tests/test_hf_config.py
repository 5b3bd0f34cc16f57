"""``hf_config`` treats a ``config.json`` as hostile input: any file, any JSON, any value is
either mapped or refused with an ``HFConfigError`` naming the file and the key, in bounded time
and memory; every key a model family uses for KV heads is read or refused; counts and ranks
given from Python are checked like ``DecodeAttention``'s.

(The mapping of the real configs of the served families is in ``tests/test_precompile.py``.)
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale_attn import hf_config
from metrale_attn.hf_config import HFConfigError

CONFIGS = pathlib.Path(__file__).parent / "hf_configs"


def fixture(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def counts(model) -> list[tuple[str, int]]:
    return [(kind.name, kind.count) for kind in model.kinds]


# -- sizes: counted, never listed --------------------------------------------------------

TRILLION = 10**12


@pytest.mark.parametrize("change, expected", [
    ({"model_type": "gemma2"}, [("sliding_attention", TRILLION // 2), ("full_attention", TRILLION // 2)]),
    ({"sliding_window_pattern": 6}, [("sliding_attention", TRILLION - TRILLION // 6),
                                     ("full_attention", TRILLION // 6)]),
    ({"max_window_layers": 20}, [("sliding_attention", TRILLION - 20), ("full_attention", 20)]),
    ({}, [("sliding_attention", TRILLION)]),
])
def test_a_config_with_a_trillion_layers_is_counted_not_listed(change, expected):
    config = fixture("mistral-7b-v0.1.json")
    config.update(num_hidden_layers=TRILLION, **change)
    assert counts(hf_config.from_dict(config)) == expected


def test_counted_layer_kinds_are_the_ones_transformers_gives_each_layer():
    # transformers' rules, one layer at a time, against the counts on small models
    for layers in range(1, 40):
        for pattern in range(1, 8):
            config = dict(fixture("mistral-7b-v0.1.json"), num_hidden_layers=layers, sliding_window_pattern=pattern)
            full = sum(1 for i in range(layers) if (i + 1) % pattern == 0)
            assert dict(counts(hf_config.from_dict(config))) == {
                name: n for name, n in (("sliding_attention", layers - full), ("full_attention", full)) if n}
        for first in range(0, 42, 3):
            config = dict(fixture("mistral-7b-v0.1.json"), num_hidden_layers=layers, max_window_layers=first)
            sliding = sum(1 for i in range(layers) if i >= first)
            assert dict(counts(hf_config.from_dict(config))) == {
                name: n for name, n in (("sliding_attention", sliding), ("full_attention", layers - sliding)) if n}


@pytest.mark.parametrize("layers", ["32", 32.0, True, 0, -1, [32]])
def test_a_malformed_num_hidden_layers_is_refused_naming_it_even_where_it_only_counts(layers):
    config = dict(fixture("llama-3-8b.json"), num_hidden_layers=layers)
    with pytest.raises(HFConfigError, match=re.escape(f"num_hidden_layers must be a positive integer, got {layers!r}")):
        hf_config.from_dict(config)


def test_layer_types_of_another_length_than_num_hidden_layers_is_refused():
    config = fixture("gpt-oss-20b.json")
    config["layer_types"] = config["layer_types"][:-1]
    with pytest.raises(HFConfigError, match="layer_types has 23 entries but num_hidden_layers is 24"):
        hf_config.from_dict(config)


# -- the file: bounded, UTF-8, shallow ----------------------------------------------------


def cli_refusal(capsys, path) -> str:
    """What ``metrale-attn precompile --hf-config path`` says on stderr (it must refuse it)."""
    from metrale_attn.cli import main

    code = main(["precompile", "--target", "hopper", "--hf-config", str(path), "--dry-run"])
    captured = capsys.readouterr()
    assert code == 2 and not captured.out
    return captured.err


@pytest.mark.parametrize("text", [
    '{"a": ' * 100_000 + "1" + "}" * 100_000,
    "[" * 100_000 + "]" * 100_000,
    '{"text_config": ' + "[" * 65 + "]" * 65 + "}",
])
def test_a_deeply_nested_config_is_refused_naming_the_file_not_a_recursion_error(tmp_path, capsys, text):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(HFConfigError, match=re.escape(f"--hf-config {path}: JSON nested more than 64 deep")):
        hf_config.load(path)
    assert f"error: --hf-config {path}: JSON nested more than 64 deep" in cli_refusal(capsys, path)


def test_the_nesting_check_takes_linear_time_on_a_file_of_escaped_quotes(tmp_path):
    import time

    path = tmp_path / "config.json"
    path.write_text('{"a": "' + '\\"[' * 300_000 + "}")  # an unterminated string of escaped quotes
    start = time.perf_counter()
    with pytest.raises(HFConfigError, match=re.escape(f"--hf-config {path}: ")):
        hf_config.load(path)
    assert time.perf_counter() - start < 5  # a regex retrying each quote takes tens of minutes here


def test_brackets_inside_strings_do_not_count_as_nesting(tmp_path):
    config = dict(fixture("llama-3-8b.json"), note="[[[[{{{{" * 100, escaped='\\"[[[' * 100)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert hf_config.load(path).num_kv_heads == 8
    assert hf_config.json_depth('{"a": [{"b": "]]]}}}"}]}') == 3
    assert hf_config.json_depth(r'["a\\", ["\"[[", "\\\"]"]]') == 2  # escaped backslashes and quotes


@pytest.mark.parametrize("data, byte, offset", [
    ('{"model_type": "llama", "note": "caf\u00e9"}'.encode("latin-1"), 0xE9, 36),
    ('{"model_type": "llama"}'.encode("utf-16"), 0xFF, 0),
    (b'{"num_attention_heads": 32, "\xc3": 1}', 0xC3, 29),
])
def test_a_config_that_is_not_utf8_is_refused_naming_the_file_and_the_byte(tmp_path, capsys, data, byte, offset):
    path = tmp_path / "config.json"
    path.write_bytes(data)
    message = f"--hf-config {path}: not UTF-8 text (byte 0x{byte:02x} at offset {offset})"
    with pytest.raises(HFConfigError, match=re.escape(message)):
        hf_config.load(path)
    assert message in cli_refusal(capsys, path)


def test_a_config_larger_than_the_bound_is_refused_without_reading_it_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_config, "MAX_CONFIG_BYTES", 1000)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(fixture("llama-3-8b.json"), padding=" " * 1000)))
    with pytest.raises(HFConfigError, match=re.escape(f"--hf-config {path}: larger than 1000 bytes")):
        hf_config.load(path)
    with pytest.raises(HFConfigError, match="larger than 1000 bytes"):
        hf_config.load("/dev/zero")  # endless: read up to the bound, no further


@pytest.mark.parametrize("text, message", [
    ("", "not JSON"),
    ("{'a': 1}", "not JSON"),
    ('{"a": 1', "not JSON"),
    ('{"num_attention_heads": 1' + "0" * 5000 + "}", "not JSON"),
    ("[1, 2]", "a config.json holds a JSON object, got list"),
    ("null", "a config.json holds a JSON object, got NoneType"),
])
def test_a_file_that_is_not_a_json_object_is_refused_naming_the_file(tmp_path, text, message):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(HFConfigError, match=re.escape(message)) as refused:
        hf_config.load(path)
    assert str(path) in str(refused.value)


def test_a_directory_is_refused_naming_it(tmp_path):
    with pytest.raises(HFConfigError, match=re.escape(f"--hf-config {tmp_path}: cannot read it")):
        hf_config.load(tmp_path)


# -- counts and ranks from Python ---------------------------------------------------------


@pytest.mark.parametrize("tensor_parallel", [0, -2, 2.0, "2", True, None])
def test_a_tensor_parallel_degree_that_is_not_an_int_of_at_least_one_is_refused_naming_it(tensor_parallel):
    from metrale_attn.precompile import layers_of

    model = hf_config.load(CONFIGS / "llama-3-8b.json")
    message = re.escape(f"tensor_parallel must be an int >= 1, got {tensor_parallel!r}")
    with pytest.raises(ValueError, match=message):
        hf_config.shard_heads(32, 8, tensor_parallel)
    with pytest.raises(ValueError, match=message):
        layers_of(model, tensor_parallel)


def test_a_tensor_parallel_degree_may_be_any_integral_type():
    np = pytest.importorskip("numpy")
    from metrale_attn.precompile import layers_of

    layers = layers_of(hf_config.load(CONFIGS / "llama-3-8b.json"), np.int64(2))
    assert (layers[0].num_q_heads, layers[0].num_kv_heads) == (16, 4)
    assert type(layers[0].num_q_heads) is int


@pytest.mark.parametrize("argument, heads", [("num_q_heads", (0, 8)), ("num_kv_heads", (32, -1)),
                                             ("num_q_heads", (32.0, 8)), ("num_kv_heads", (32, "8"))])
def test_head_counts_given_to_shard_heads_are_checked_like_decode_attentions(argument, heads):
    bad = heads[0] if argument == "num_q_heads" else heads[1]
    with pytest.raises(ValueError, match=re.escape(f"{argument} must be an int >= 1, got {bad!r}")):
        hf_config.shard_heads(*heads, 2)


@pytest.mark.parametrize("sm_count", [0, -1, 2.0, "132", True])
def test_an_sm_count_that_is_not_an_int_of_at_least_one_is_refused_naming_it(sm_count):
    from metrale_attn.precompile import Layer, needed_specs
    from metrale_attn.targets import TARGETS

    with pytest.raises(ValueError, match=re.escape(f"sm_count must be an int >= 1, got {sm_count!r}")):
        needed_specs([Layer("layer", 4, 4, 64)], TARGETS["hopper"], sm_count=sm_count, environ={})


# -- KV heads: every family's keys read or refused ----------------------------------------


def shape(name: str) -> tuple:
    model = hf_config.load(CONFIGS / name)
    return model.model_type, model.num_q_heads, model.num_kv_heads, model.head_dim, counts(model)


def test_falcon_7b_is_71_q_heads_sharing_one_kv_head_by_multi_query():
    assert shape("falcon-7b.json") == ("falcon", 71, 1, 64, [("full_attention", 32)])
    assert "1 KV head: falcon's multi_query without new_decoder_architecture" in hf_config.load(
        CONFIGS / "falcon-7b.json").notes


def test_falcon_40b_reads_num_kv_heads_under_the_new_decoder_architecture():
    assert shape("falcon-40b.json") == ("falcon", 128, 8, 64, [("full_attention", 60)])


def test_a_falcon_config_resaved_with_num_kv_heads_still_has_one_kv_head_under_multi_query():
    # FalconConfig fills num_kv_heads with num_attention_heads, so a re-saved Falcon-7B config
    # carries "num_kv_heads": 71, which its modelling ignores under multi_query.
    config = dict(fixture("falcon-7b.json"), num_kv_heads=71)
    model = hf_config.from_dict(config)
    assert model.num_kv_heads == 1
    assert any("num_kv_heads 71 unused" in note for note in model.notes)


def test_a_falcon_config_that_omits_multi_query_takes_transformers_default_of_one_kv_head():
    config = fixture("falcon-7b.json")
    del config["multi_query"], config["new_decoder_architecture"]
    assert hf_config.from_dict(config).num_kv_heads == 1
    config["multi_query"] = False
    assert hf_config.from_dict(config).num_kv_heads == 71


def test_chatglm3_is_32_q_heads_in_2_groups_by_multi_query_group_num():
    assert shape("chatglm3-6b.json") == ("chatglm", 32, 2, 128, [("full_attention", 28)])
    model = hf_config.load(CONFIGS / "chatglm3-6b.json")
    assert model.dtype == "float16"
    assert "head_dim from kv_channels (model_type chatglm's name for it)" in model.notes


def test_chatglm_without_multi_query_attention_has_a_kv_head_per_q_head():
    config = dict(fixture("chatglm3-6b.json"), multi_query_attention=False)
    assert hf_config.from_dict(config).num_kv_heads == 32


def test_starcoder_is_48_q_heads_sharing_one_kv_head_under_gpt_bigcodes_own_key_names():
    assert shape("starcoder.json") == ("gpt_bigcode", 48, 1, 128, [("full_attention", 40)])


def test_dbrx_reads_its_kv_heads_from_attn_config():
    assert shape("dbrx-instruct.json") == ("dbrx", 48, 8, 128, [("full_attention", 40)])


@pytest.mark.parametrize("name, change, message", [
    ("llama-3-8b.json", {"multi_query": True}, "multi_query = True gives another model family's KV heads, but "
                                               "model_type llama reads num_key_value_heads (8 KV heads)"),
    ("llama-3-8b.json", {"num_kv_heads": 4}, "num_kv_heads = 4 gives another model family's KV heads"),
    ("llama-3-8b.json", {"multi_query_attention": True, "multi_query_group_num": 2},
     "multi_query_group_num = 2 gives another model family's KV heads"),
    ("llama-3-8b.json", {"attn_config": {"kv_n_heads": 1}}, "attn_config.kv_n_heads = 1 gives another"),
    ("llama-3-8b.json", {"n_head_kv": 2}, "n_head_kv = 2 gives another model family's KV heads"),
    ("llama-3-8b.json", {"n_kv_heads": 2}, "n_kv_heads = 2 gives another model family's KV heads"),
    ("llama-3-8b.json", {"num_key_value_heads_per_layer": [8, 4]}, "num_key_value_heads_per_layer = [8, 4]: KV "
                                                                   "heads that differ from layer to layer"),
    ("llama-3-8b.json", {"block_configs": [{"attention": {"n_heads_in_group": 8}}]}, "block_configs = "),
    ("falcon-7b.json", {"num_key_value_heads": 71}, "num_key_value_heads = 71 gives another model family's KV "
                                                    "heads, but model_type falcon reads new_decoder_architecture / "
                                                    "multi_query / num_kv_heads (1 KV heads)"),
    ("falcon-7b.json", {"multi_query": "yes"}, "multi_query must be true or false, got 'yes'"),
    ("falcon-40b.json", {"num_kv_heads": 0}, "num_kv_heads must be a positive integer, got 0"),
    ("falcon-7b.json", {"alibi": True}, "alibi = True: ALiBi position biases"),
    ("chatglm3-6b.json", {"multi_query_group_num": None}, "multi_query_group_num is missing"),
    ("chatglm3-6b.json", {"multi_query_attention": 1}, "multi_query_attention must be true or false, got 1"),
    ("chatglm3-6b.json", {"num_hidden_layers": 40}, "num_hidden_layers = 40 and num_layers = 28 disagree"),
    ("starcoder.json", {"num_attention_heads": 32}, "num_attention_heads = 32 and n_head = 48 disagree"),
    ("starcoder.json", {"scale_attn_weights": False}, "scale_attn_weights = False: logits without the"),
    ("dbrx-instruct.json", {"attn_config": [8]}, "attn_config must be a JSON object, got list"),
    ("llama-3-8b.json", {"model_type": "bloom"}, "model_type 'bloom': BLOOM's attention adds ALiBi"),
    ("llama-3-8b.json", {"model_type": "mpt"}, "model_type 'mpt': MPT's attention"),
    ("llama-3-8b.json", {"model_type": ["llama"]}, "model_type must be a string, got ['llama']"),
])
def test_a_kv_head_key_the_model_type_does_not_read_or_a_malformed_one_is_refused_naming_it(name, change, message):
    config = dict(fixture(name), **change)
    with pytest.raises(HFConfigError, match=re.escape(message)):
        hf_config.from_dict(config, source="/models/x/config.json")
    try:
        hf_config.from_dict(config, source="/models/x/config.json")
    except HFConfigError as err:
        assert str(err).startswith("/models/x/config.json: ")


def test_a_kv_head_key_of_another_family_that_agrees_is_noted_not_refused():
    model = hf_config.from_dict(dict(fixture("llama-3-8b.json"), num_kv_heads=8, multi_query=False))
    assert model.num_kv_heads == 8 and "num_kv_heads agrees: 8 KV heads" in model.notes


@pytest.mark.parametrize("name, tp, line", [
    ("falcon-7b.json", 1, "71 q heads, 1 KV heads, head_dim 64; one rank of 1: 71 q heads, 1 KV heads"),
    ("falcon-40b.json", 8, "128 q heads, 8 KV heads, head_dim 64; one rank of 8: 16 q heads, 1 KV heads"),
    ("chatglm3-6b.json", 2, "32 q heads, 2 KV heads, head_dim 128; one rank of 2: 16 q heads, 1 KV heads"),
    ("starcoder.json", 4, "48 q heads, 1 KV heads, head_dim 128; one rank of 4: 12 q heads, 1 KV heads"),
])
def test_the_command_prints_and_compiles_the_kv_heads_each_family_gives(capsys, name, tp, line):
    from metrale_attn.cli import main
    from metrale_attn.precompile import layers_of

    code = main(["precompile", "--target", "hopper", "--hf-config", str(CONFIGS / name), "--tensor-parallel-size",
                 str(tp), "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0 and line in out, out
    q, kv = [int(n) for n in re.findall(r"(\d+) q heads, (\d+) KV heads$", line)[0]]
    assert {(layer.num_q_heads, layer.num_kv_heads) for layer in layers_of(hf_config.load(CONFIGS / name), tp)} == {
        (q, kv)}


# -- any config.json: mapped or refused by name ---------------------------------------------

READ_KEYS = ["num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size", "num_hidden_layers",
             "torch_dtype", "dtype", "sliding_window", "use_sliding_window", "layer_types", "sliding_window_pattern",
             "max_window_layers", "attn_logit_softcapping", "model_type", "text_config", "num_kv_heads", "n_head_kv",
             "multi_query", "multi_query_attention", "multi_query_group_num", "new_decoder_architecture",
             "attn_config", "n_head", "n_layer", "n_embd", "n_heads", "n_layers", "d_model", "num_layers",
             "kv_channels", "alibi", "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "attention_chunk_size",
             "kv_lora_rank", "use_bidirectional_attention", "n_kv_heads", "num_key_value_heads_per_layer",
             "block_configs", "global_head_dim", "num_global_key_value_heads", "attention_k_eq_v",
             "num_kv_shared_layers", "per_layer_config", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
             "rope_scaling", "rope_parameters", "index_topk", "num_nextn_predict_layers"]
MODEL_TYPES = ["llama", "gemma2", "gemma3", "gemma3_text", "gpt_oss", "falcon", "chatglm", "gpt_bigcode", "dbrx",
               "mpt", "bloom", "qwen2", "", "RefinedWeb", "gemma4", "gemma4_text", "deepseek_v2", "deepseek_v3",
               "kimi_k2"]
FIXTURES = sorted(path.name for path in CONFIGS.glob("*.json"))

scalars = (st.none() | st.booleans() | st.integers(-3, 300) | st.integers(-2**70, 2**70) | st.just(10**400)
           | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(MODEL_TYPES + ["full_attention",
                                                                                              "sliding_attention",
                                                                                              "yarn", "vision"])
           | st.text(max_size=4))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.sampled_from(READ_KEYS + ["kv_n_heads", "x", "type", "rope_type",
                                                                      "factor", "mscale_all_dim", "5", "head_dim"]),
                                             inner, max_size=4),
                           max_leaves=8)


@st.composite
def hostile_configs(draw) -> dict:
    """A real config with some of the keys read here replaced by any JSON value."""
    config = fixture(draw(st.sampled_from(FIXTURES)))
    section = config.get("text_config", config)
    for key in draw(st.lists(st.sampled_from(READ_KEYS), max_size=4)):
        section[key] = draw(json_values)
    if draw(st.booleans()):
        section["model_type"] = draw(st.sampled_from(MODEL_TYPES))
    return config


@pytest.mark.parametrize("cap", [10**400, -10**400, float("inf"), float("nan"), "50", True, [50]])
def test_a_soft_cap_that_is_no_finite_positive_number_is_refused_naming_it_even_past_the_float_range(cap):
    config = dict(fixture("gemma-2-9b.json"), attn_logit_softcapping=cap)
    with pytest.raises(HFConfigError, match=re.escape(f"attn_logit_softcapping must be a positive number (or null), "
                                                      f"got {cap!r}")):
        hf_config.from_dict(config)


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_configs())
def test_any_config_is_mapped_to_positive_counts_or_refused_with_an_hf_config_error_naming_the_file(config):
    from metrale_attn.precompile import layers_of

    try:
        model = hf_config.from_dict(config, source="/models/x/config.json")
    except HFConfigError as err:
        assert str(err).startswith("/models/x/config.json")
        return
    for count in (model.num_q_heads, model.num_kv_heads, model.head_dim, *(k.count for k in model.kinds)):
        assert type(count) is int and count >= 1
    assert model.kinds and all(kind.describe() for kind in model.kinds)
    try:
        layers_of(model, 2)
    except HFConfigError as err:
        assert "--tensor-parallel-size 2 must" in str(err)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.binary(max_size=200) | st.builds(lambda d, t: "[" * d + t + "]" * d, st.integers(0, 3000),
                                            st.sampled_from(["", "1", '{"a": 1}', '"]"'])).map(str.encode))
def test_any_file_is_mapped_or_refused_with_an_hf_config_error_naming_it(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("hostile") / "config.json"
    path.write_bytes(data)
    try:
        hf_config.load(path)
    except HFConfigError as err:
        assert str(path) in str(err)


# -- the command line with hostile arguments ------------------------------------------------

HOSTILE_FILES = {
    "@nested": b'{"a": ' * 5000 + b"1" + b"}" * 5000,
    "@latin1": '{"model_type": "llama", "note": "caf\u00e9"}'.encode("latin-1"),
    "@trillion": json.dumps(dict(fixture("gemma-2-9b.json"), num_hidden_layers=TRILLION)).encode(),
    "@falcon-with-llama-kv": json.dumps(dict(fixture("falcon-7b.json"), num_key_value_heads=71)).encode(),
}
"""Files the command-line fuzz may name (written once per session, named by these keys)."""


@pytest.fixture(scope="module")
def hostile_paths(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("hostile-configs")
    for key, data in HOSTILE_FILES.items():
        (folder / f"{key[1:]}.json").write_bytes(data)
    return {key: str(folder / f"{key[1:]}.json") for key in HOSTILE_FILES}


CLI_FLAGS = ["--target", "--arch", "--sm-count", "--model", "--hf-config", "--tensor-parallel-size", "--q-heads",
             "--kv-heads", "--head-dim", "--window-left", "--logits-soft-cap", "--q-dtype", "--kv-dtype", "--out-dtype",
             "--page-size", "--max-batch", "--max-q-len", "--max-decode-seqs", "--splitk", "--gqa-pack", "--impl",
             "--heads-per-cta"]
CLI_VALUES = (st.sampled_from(["0", "1", "2", "-1", "-2", "8", "16", "128", "2.0", "1e9", "1000000000000", "nan",
                               "inf", "", " ", "hopper", "gb10", "hopper,b200", "sm_90", "sm_121", "bfloat16",
                               "fp8_e4m3", "float32", "on", "off", "legacy", "auto", "mma", "simt", "/",
                               "/dev/zero", "/nonexistent/config.json", "--dry-run", "--skip-unsupported", "\x00",
                               "é", "llama-3-8b", "24/4/256", "8/3/64", *HOSTILE_FILES]
                              + [str(CONFIGS / name) for name in FIXTURES])
              | st.text(max_size=6))


CLI_BASES = st.tuples(st.sampled_from([[], ["--target", "hopper"], ["--target", "gb10,a100"], ["--arch", "sm_90"]]),
                      st.sampled_from([[], ["--q-heads", "8", "--kv-heads", "2", "--head-dim", "128"]]
                                      + [["--hf-config", str(CONFIGS / name)] for name in FIXTURES]
                                      + [["--hf-config", key] for key in HOSTILE_FILES]))


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(CLI_BASES, st.lists(st.tuples(st.sampled_from(CLI_FLAGS), CLI_VALUES), max_size=4))
def test_any_precompile_arguments_end_in_a_plan_or_a_refusal_naming_what_was_wrong(hostile_paths, base, pairs):
    from metrale_attn.cli import SKIPPED_EXIT, main

    argv = ["precompile", *base[0], *base[1], *(part for pair in pairs for part in pair), "--dry-run"]
    argv = [hostile_paths.get(arg, arg) for arg in argv]
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's refusal of a malformed flag or value
        assert exit_.code == 2, argv
        return
    assert code in (0, 2, SKIPPED_EXIT), argv


def test_a_layer_the_kernels_refuse_from_a_config_names_the_file_it_came_from(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(fixture("llama-3-8b.json"), head_dim=72)))
    err = cli_refusal(capsys, path)
    assert err.startswith("metrale-attn precompile: error: full_attention (32 q heads, 8 KV heads, head_dim 72) on "
                          "hopper: head_dim must be a multiple of 16"), err
    assert err.rstrip().endswith(f"got 72 (layer kinds from --hf-config {path})"), err


def test_gemma_2_and_3_take_their_softmax_scale_from_query_pre_attn_scalar_where_it_is_not_the_head_dim():
    nine_b = hf_config.from_dict(fixture("gemma-2-9b.json"))  # 256 at head_dim 256: the plain scale
    assert {kind.sm_scale for kind in nine_b.kinds} == {None}
    twenty_seven_b = hf_config.from_dict(dict(fixture("gemma-2-9b.json"), head_dim=128, query_pre_attn_scalar=144))
    assert {kind.sm_scale for kind in twenty_seven_b.kinds} == {144 ** -0.5}
    assert any("query_pre_attn_scalar 144" in note for note in twenty_seven_b.notes)
    gemma3 = fixture("gemma-3-12b-it.json")
    text = dict(gemma3["text_config"], head_dim=128, query_pre_attn_scalar=168)  # Gemma-3-27B's pair
    assert {kind.sm_scale for kind in hf_config.from_dict(dict(gemma3, text_config=text)).kinds} == {168 ** -0.5}
    assert {kind.sm_scale for kind in hf_config.from_dict(gemma3).kinds} == {None}  # omitted: 256, its head dim
    with pytest.raises(hf_config.HFConfigError, match="query_pre_attn_scalar"):
        hf_config.from_dict(dict(fixture("gemma-2-9b.json"), query_pre_attn_scalar=-1))
