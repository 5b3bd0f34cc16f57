"""``metrale-attn precompile``: the kernels a model needs, compiled without a GPU into the cache a
construction on a GPU then finds; a Hugging Face config mapped onto layer kinds; bad input refused
with its name.

The spec set is checked against what ``DecodeAttention`` itself loads (a backend that records
its loads and pretends to be a GPU, so nothing compiles), both outcomes of the self-test included.
Only two tests compile with NVRTC (three small kernels, then one), so the default run stays fast.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import shlex
import sys
import types
import warnings

import pytest

from metrale_attn import DecodeAttention, hf_config
from metrale_attn.backends import DeviceInfo
from metrale_attn.backends.cpu_backend import CpuBackend
from metrale_attn.cli import main
from metrale_attn.kernels import SelfTest
from metrale_attn.precompile import Layer, Options, PrecompileError, check_nvrtc, layers_of, needed_specs
from metrale_attn.targets import TARGETS

CONFIGS = pathlib.Path(__file__).parent / "hf_configs"
README = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()


# -- the spec set is DecodeAttention's -------------------------------------------------


class RecordingGpu(CpuBackend):
    """A backend that says it is a GPU of ``capability`` and records what a construction
    loads (the self-test, then the specs) without compiling anything; ``disagree`` is
    what its self-test reports."""

    def __init__(self, capability, sm_count, disagree=()):
        super().__init__()
        self.capability, self.sm_count, self.disagree, self.loaded = capability, sm_count, list(disagree), []

    def device(self):
        return DeviceInfo(0, self.capability, self.sm_count, "recording")

    def verify_mma(self):
        self.loaded.append(SelfTest().name)
        return self.disagree

    def load_many(self, specs):
        specs = list(specs)
        self.loaded += [v.name for v in specs]
        return [object() for _ in specs]


def constructed(layer: Layer, options: Options, capability, sm_count, disagree=()) -> set:
    """What a ``DecodeAttention`` of ``layer`` loads on a GPU of ``capability`` whose self-test
    reports ``disagree``; empty when the construction refuses."""
    backend = RecordingGpu(capability, sm_count, disagree)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the fallbacks' warnings
        try:
            DecodeAttention(layer.num_q_heads, layer.num_kv_heads, layer.head_dim, options.page_size,
                            q_dtype=options.q_dtype, kv_dtype=options.kv_dtype or options.q_dtype,
                            max_batch=options.max_batch, backend=backend, splitk=options.splitk,
                            gqa_pack=options.gqa_pack, impl=options.impl, heads_per_cta=options.heads_per_cta,
                            max_q_len=options.max_q_len, out_dtype=options.out_dtype,
                            window_left=layer.window_left, logits_soft_cap=layer.logits_soft_cap, sinks=layer.sinks)
        except RuntimeError:  # a failed self-test and an mma-only feature: refused, nothing more loads
            return set()
    return set(backend.loaded)


CASES = {
    "plain, small": (Layer("layer", 4, 4, 64), Options(), "hopper"),
    "llama 3 8b, fp8 cache, speculative": (Layer("layer", 32, 8, 128), Options(kv_dtype="fp8_e4m3", max_q_len=3),
                                           "b200"),
    "gemma 2 sliding, soft-cap (mma only)": (Layer("sliding", 8, 4, 256, 4095, 50.0), Options(), "hopper"),
    "gpt-oss full, sinks": (Layer("full", 32, 4, 64, sinks=True), Options(), "b300"),
    "legacy split-K, batch moves the arm": (Layer("layer", 32, 8, 128), Options(splitk="legacy", max_batch=64),
                                            "hopper"),
    "gqa pack on": (Layer("layer", 24, 4, 256), Options(splitk="off", gqa_pack=True), "hopper"),
    "pinned heads per cta": (Layer("layer", 32, 4, 128), Options(heads_per_cta=4), "hopper"),
    "gb10, 99 KiB: the default kernel sized for it": (Layer("layer", 4, 4, 256), Options(), "gb10"),
    "a10, fp8 cache: simt": (Layer("layer", 4, 4, 64), Options(kv_dtype="fp8_e4m3"), "a10"),
    "simt chosen": (Layer("layer", 32, 8, 128), Options(impl="simt"), "hopper"),
    "head dim 80, fp8 cache (mma only)": (Layer("layer", 32, 32, 80), Options(kv_dtype="fp8_e4m3"), "b200"),
}


@pytest.mark.parametrize("case", CASES)
def test_precompile_needs_exactly_what_a_construction_loads_whichever_way_its_self_test_goes(case):
    layer, options, name = CASES[case]
    target = TARGETS[name]
    plan = needed_specs([layer], target, options, environ={})
    agree = constructed(layer, options, target.compute_capability, target.sm_count)
    disagree = constructed(layer, options, target.compute_capability, target.sm_count, ["mma.m16n8k16 bf16"])
    assert agree  # a construction that agrees always builds
    assert {n.name for n in plan.needed} == agree | disagree


def test_the_simt_fallback_is_compiled_only_where_a_failed_self_test_falls_back_rather_than_refuses():
    plain = needed_specs([Layer("layer", 4, 4, 64)], TARGETS["hopper"], environ={})
    assert [n.why for n in plain.needed if n.name.startswith("simt_decode_")] == [
        "simt fallback of layer, if the device fails the self-test"]
    featured = needed_specs([Layer("layer", 4, 4, 64, window_left=127)], TARGETS["hopper"], environ={})
    assert not [n for n in featured.needed if n.name.startswith("simt_decode_")]
    assert featured.needed[0].name == "pd_selftest" and not featured.notes


def test_the_environment_a_construction_reads_is_read_the_same_way():
    layer = Layer("layer", 32, 8, 128)
    by_env = needed_specs([layer], TARGETS["hopper"], environ={"METRALE_ATTN_DECODE_IMPL": "simt"})
    assert {n.name for n in by_env.needed} == {"simt_decode_splitk_qbf16_kvbf16_hd128"}
    legacy = needed_specs([layer], TARGETS["hopper"], environ={"METRALE_ATTN_DECODE_SPLITK": "legacy"})
    assert legacy.defaults_line.endswith("(attn_decode_splitk from environment)")
    assert "attn_decode_splitk=legacy" in legacy.defaults_line


def test_layer_kinds_that_share_a_variant_compile_it_once_and_say_who_needs_it():
    layers = [Layer("a", 32, 8, 128), Layer("b", 32, 8, 128)]
    plan = needed_specs(layers, TARGETS["hopper"], environ={})
    names = [n.name for n in plan.needed]
    assert len(names) == len(set(names)) == 3
    assert plan.needed[1].why == "a, b"


# -- Hugging Face configs ---------------------------------------------------------------


def kinds(name: str) -> list[tuple]:
    model = hf_config.load(CONFIGS / name)
    return [(k.name, k.count, k.window_left, k.logits_soft_cap, k.sinks) for k in model.kinds]


def test_llama_3_8b_is_32_full_attention_layers_of_32_q_and_8_kv_heads_at_head_dim_128():
    model = hf_config.load(CONFIGS / "llama-3-8b.json")
    assert (model.model_type, model.num_q_heads, model.num_kv_heads, model.head_dim, model.dtype) == (
        "llama", 32, 8, 128, "bfloat16")
    assert kinds("llama-3-8b.json") == [("full_attention", 32, -1, None, False)]
    assert "head_dim 128 (hidden_size 4096 / num_attention_heads 32)" in model.notes


def test_qwen_configs_slide_nowhere_when_use_sliding_window_is_false_whatever_sliding_window_says():
    assert kinds("qwen3-8b.json") == [("full_attention", 36, -1, None, False)]
    assert hf_config.load(CONFIGS / "qwen3-8b.json").head_dim == 128  # its own head_dim key
    assert kinds("qwen2-7b-instruct.json") == [("full_attention", 28, -1, None, False)]
    assert "sliding_window 131072 unused (use_sliding_window false)" in hf_config.load(
        CONFIGS / "qwen2-7b-instruct.json").notes


def test_a_qwen_config_with_use_sliding_window_slides_from_max_window_layers_on():
    config = json.loads((CONFIGS / "qwen2-7b-instruct.json").read_text())
    config.update(use_sliding_window=True, sliding_window=4096, max_window_layers=20)
    model = hf_config.from_dict(config)
    assert [(k.name, k.count, k.window_left) for k in model.kinds] == [("sliding_attention", 8, 4095),
                                                                      ("full_attention", 20, -1)]


def test_mistral_v0_1_slides_on_every_layer_with_window_left_one_less_than_its_sliding_window():
    assert kinds("mistral-7b-v0.1.json") == [("sliding_attention", 32, 4095, None, False)]


def test_gemma_2_has_sliding_and_full_layers_both_soft_capped_and_no_served_dtype_of_its_own():
    assert kinds("gemma-2-9b.json") == [("sliding_attention", 21, 4095, 50.0, False),
                                        ("full_attention", 21, -1, 50.0, False)]
    model = hf_config.load(CONFIGS / "gemma-2-9b.json")
    assert (model.num_q_heads, model.num_kv_heads, model.head_dim, model.dtype) == (16, 8, 256, None)
    assert "torch_dtype float32 is not a dtype served as it is (bfloat16, float16)" in model.notes


def test_gpt_oss_has_sinks_on_its_sliding_and_its_full_layers():
    assert kinds("gpt-oss-20b.json") == [("sliding_attention", 12, 127, None, True),
                                         ("full_attention", 12, -1, None, True)]
    model = hf_config.load(CONFIGS / "gpt-oss-20b.json")
    assert (model.num_q_heads, model.num_kv_heads, model.head_dim) == (64, 8, 64)


def test_gemma_3_reads_its_text_config_and_the_defaults_transformers_gives_the_keys_it_omits():
    model = hf_config.load(CONFIGS / "gemma-3-12b-it.json")
    assert (model.model_type, model.num_q_heads, model.num_kv_heads, model.head_dim, model.dtype) == (
        "gemma3_text", 16, 8, 256, "bfloat16")  # head_dim 256, not hidden_size / heads = 240
    assert kinds("gemma-3-12b-it.json") == [("sliding_attention", 40, 1023, None, False),
                                            ("full_attention", 8, -1, None, False)]
    assert "head_dim 256 (gemma3_text's default: the config omits it)" in model.notes


def test_tensor_parallelism_splits_heads_as_vllm_does():
    assert hf_config.shard_heads(64, 8, 8) == (8, 1)
    assert hf_config.shard_heads(64, 8, 16) == (4, 1)  # KV heads replicated
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 must divide num_attention_heads 32"):
        hf_config.shard_heads(32, 8, 3)
    with pytest.raises(ValueError, match="--tensor-parallel-size 4 must divide num_key_value_heads 6"):
        hf_config.shard_heads(24, 6, 4)


@pytest.mark.parametrize("change, message", [
    ({"num_attention_heads": None}, "num_attention_heads is missing"),
    ({"num_attention_heads": "32"}, "num_attention_heads must be a positive integer, got '32'"),
    ({"hidden_size": 4001}, "head_dim is missing and hidden_size 4001 is not a multiple of num_attention_heads 32"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types has 'chunked_attention'; only"),
    ({"layer_types": ["sliding_attention"]}, "layer_types has sliding_attention layers but no sliding_window"),
    ({"attention_chunk_size": 8192}, "attention_chunk_size = 8192: chunked local attention"),
    ({"sliding_window": 0}, "sliding_window must be a positive integer"),
    ({"attn_logit_softcapping": -1}, "attn_logit_softcapping must be a positive number"),
    ({"text_config": [1]}, "text_config must be a JSON object"),
])
def test_a_config_these_rules_cannot_map_is_refused_naming_the_key(change, message):
    config = json.loads((CONFIGS / "llama-3-8b.json").read_text())
    config.update(change)
    with pytest.raises(ValueError, match=re.escape(message)):
        hf_config.from_dict(config)


# -- the command line -------------------------------------------------------------------


def precompile_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(["precompile", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_command_prints_the_layer_kinds_it_found_and_each_kernel_it_would_compile(capsys):
    code, out, _ = precompile_cli(capsys, "--target", "hopper", "--hf-config", str(CONFIGS / "gemma-2-9b.json"),
                                  "--tensor-parallel-size", "2", "--dry-run")
    assert code == 0
    assert "16 q heads, 8 KV heads, head_dim 256; one rank of 2: 8 q heads, 4 KV heads" in out
    assert ("layer kinds: 21 sliding_attention (window_left 4095, logits_soft_cap 50), 21 full_attention "
            "(logits_soft_cap 50)") in out
    assert "dtypes: q bfloat16 (the default), KV bfloat16" in out
    assert "  decode_splitk_qbf16_kvbf16_hd256_r8_window_soft_cap  [sliding_attention]" in out
    assert "  decode_splitk_qbf16_kvbf16_hd256_r8_soft_cap  [full_attention]" in out
    assert out.rstrip().endswith("would compile 3 kernel(s) for sm_90 (dry run: nothing compiled)")


HF_LLAMA = ("--hf-config", str(CONFIGS / "llama-3-8b.json"))
SMALL = ("--q-heads", "4", "--kv-heads", "4", "--head-dim", "64")


@pytest.mark.parametrize("argv, message", [
    (("--target", "v100", *SMALL), "--target must be one of hopper, b200, b300, gb10, a100, a10, l40s, rtx5090; got 'v100'"),
    (SMALL, "give the GPUs to compile for with --target"),
    (("--target", "hopper", "--arch", "sm_90", *SMALL), "give the GPUs to compile for with --target"),
    (("--arch", "sm_75", *SMALL), "--arch must name a target's architecture"),
    (("--target", "hopper", *HF_LLAMA, "--q-heads", "4"), "--hf-config gives the shape and the features; drop "
                                                          "--q-heads"),
    (("--target", "hopper", *HF_LLAMA, "--sinks"), "drop --sinks"),
    (("--target", "hopper", "--q-heads", "4"), "missing --kv-heads, --head-dim"),
    (("--target", "hopper", *SMALL, "--tensor-parallel-size", "2"), "--tensor-parallel-size splits the heads of "
                                                                     "--model or --hf-config"),
    (("--target", "hopper", *HF_LLAMA, "--model", "llama-3-8b"), "--model and --hf-config both describe the model: "
                                                                 "give one of the two"),
    (("--target", "hopper", "--model", "llama-3-8b", "--head-dim", "64"), "--model gives the shape; drop --head-dim"),
    (("--target", "hopper", "--model", "llama-3-9b"), "--model takes deepseek-v2-lite, deepseek-v3, "
     "gemma-4-26b-global, llama-3-70b, llama-3-8b, qwen3.8-27b, Q/KV/HEAD_DIM (32/8/128) or Q/KV/HEAD_DIM/V_HEAD_DIM "
     "(16/1/576/512); got 'llama-3-9b'"),
    (("--target", "hopper", *HF_LLAMA, "--tensor-parallel-size", "3"), "--tensor-parallel-size 3 must divide"),
    (("--target", "hopper", "--hf-config", "/nonexistent/config.json"), "--hf-config /nonexistent/config.json: "
                                                                        "cannot read it"),
    (("--target", "hopper", "--q-heads", "4", "--kv-heads", "4", "--head-dim", "72"),
     "head_dim must be a multiple of 16 from 64 to 256 (64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256) "
     "or 512 (the simt kernels only), got 72"),
    (("--target", "hopper", "--q-heads", "6", "--kv-heads", "4", "--head-dim", "64"),
     "num_q_heads (6) must be a multiple of num_kv_heads (4)"),
    (("--target", "hopper", *SMALL, "--kv-dtype", "int8"), "kv_dtype must be one of"),
    (("--target", "hopper", *SMALL, "--max-q-len", "9"), "max_q_len must be an int in 1..8"),
    (("--target", "hopper", *SMALL, "--page-size", "300"), "page_size must be an int in 1..256"),
    (("--target", "hopper", *SMALL, "--splitk", "sometimes"), "splitk must be 'auto', 'legacy'"),
    (("--target", "hopper", "--q-heads", "32", "--kv-heads", "8", "--head-dim", "128", "--heads-per-cta", "3"),
     "heads_per_cta must divide the group size 4"),
    (("--target", "a10", *SMALL, "--impl", "mma", "--kv-dtype", "fp8_e4m3"),
     "a10 (sm_86) lacks (sm_89 and later have it): they cannot launch there"),
])
def test_bad_input_is_refused_with_the_argument_it_came_from(capsys, argv, message):
    code, out, err = precompile_cli(capsys, *argv, "--dry-run")
    assert code == 2 and not out
    assert err.startswith("metrale-attn precompile: error: ") and message in err, err


@pytest.mark.parametrize("flag, value", [("--window-left", "-2"), ("--logits-soft-cap", "0"), ("--q-heads", "0"),
                                         ("--max-batch", "x"), ("--tensor-parallel-size", "0")])
def test_a_malformed_number_is_refused_by_the_parser_naming_the_flag(capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        main(["precompile", "--target", "hopper", *SMALL, flag, value])
    assert exit_.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


GPT_OSS_FP8 = ("--hf-config", str(CONFIGS / "gpt-oss-20b.json"), "--tp", "2", "--kv-dtype", "fp8_e4m3")


def test_a_target_that_refuses_a_layer_kind_is_skipped_naming_each_refusal_and_the_others_are_planned(capsys):
    code, out, err = precompile_cli(capsys, "--target", "hopper,a100,b200", *GPT_OSS_FP8, "--dry-run")
    assert code == 3 and not err
    lines = out.splitlines()
    refused = [line for line in lines if line.startswith("sm_80: skipped: ")]
    assert [line.split(": ")[2].split(" (")[0] for line in refused] == ["sliding_attention", "full_attention"]
    assert ("sm_80: skipped: full_attention (32 q heads, 4 KV heads, head_dim 64) on a100: the mma kernels read fp8 "
            "caches with PTX's fp8 cvt, which a100 (sm_80) lacks") in out
    assert all(line.endswith(f"(layer kinds from --hf-config {CONFIGS / 'gpt-oss-20b.json'})") for line in refused)
    assert lines[-2].startswith("would compile ") and lines[-2].endswith(" for sm_90, sm_100 (dry run: nothing "
                                                                         "compiled)")
    assert lines[-1] == ("skipped a100 (sm_80): a layer kind of the model is refused there (above); exit 3 "
                         "(--skip-unsupported to exit 0)")
    code, out, _ = precompile_cli(capsys, "--target", "hopper,a100,b200", *GPT_OSS_FP8, "--dry-run",
                                  "--skip-unsupported")
    assert code == 0 and out.splitlines()[-1].endswith("exit 0 (--skip-unsupported)")


def test_a_model_no_target_takes_is_an_error_naming_every_refusal(capsys):
    code, out, err = precompile_cli(capsys, "--target", "a100,a10", *GPT_OSS_FP8, "--dry-run", "--skip-unsupported")
    assert code == 2 and not out
    assert err.count("lacks (sm_89 and later have it)") == 4 and "on a100: " in err and "on a10: " in err


def test_without_cuda_bindings_nvrtc_the_command_names_the_install_line(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", None)  # import fails, as without cuda-bindings
    code, out, err = precompile_cli(capsys, "--target", "hopper", *SMALL)
    assert code == 2 and not out
    assert "precompile compiles with NVRTC through cuda-bindings, which is not installed" in err
    assert "pip install 'metrale-attn[cuda12]' (or [cuda13])" in err
    with pytest.raises(PrecompileError, match="pip install 'metrale-attn"):
        check_nvrtc(["sm_90"])


def test_an_nvrtc_too_old_for_the_architecture_is_refused_before_compiling(capsys, monkeypatch):
    pytest.importorskip("cuda.bindings.nvrtc")
    from metrale_attn.backends import nvrtc

    monkeypatch.setattr(nvrtc, "supported_archs", lambda: (80, 90))
    code, _, err = precompile_cli(capsys, "--target", "hopper,b200", *SMALL)
    assert code == 2 and "cannot compile for sm_100: pip install 'nvidia-cuda-nvrtc-cu12>=12.9'" in err


def test_every_precompile_command_of_the_readme_parses():
    from metrale_attn.cli import build_parser

    commands = re.findall(r"^metrale-attn (precompile [^\n]*)$", README, re.M)
    assert len(commands) >= 2
    for command in commands:
        args = build_parser().parse_args(shlex.split(command))
        assert args.command == "precompile" and (args.target or args.arch)


# -- compiling: into the cache a construction reads -------------------------------------


def test_a_precompiled_cache_is_all_hits_the_second_time_and_a_gpu_construction_loads_it_without_compiling(
        tmp_path, monkeypatch, capsys):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (cupy) is not installed")
    from metrale_attn import precompile
    from metrale_attn.backends import cupy_backend

    code, out, _ = precompile_cli(capsys, "--target", "hopper", *SMALL, "--cache-dir", str(tmp_path))
    assert code == 0
    lines = out.splitlines()
    assert [line.split()[0] for line in lines if line.startswith("  ")] == ["miss"] * 3
    assert f"into {tmp_path / 'cubin'}: 3 compiled, 0 already cached" in lines[-2]
    assert lines[-1] == f"serve with METRALE_ATTN_CACHE_DIR={tmp_path} (the same NVRTC version: the cache key holds it) to find them"

    def no_compile(spec, arch):
        raise AssertionError(f"compiled {spec.name} for {arch}: the cache should have had it")

    monkeypatch.setattr(cupy_backend, "compile_cubin", no_compile)
    layer = Layer("layer", 4, 4, 64)
    again = precompile.precompile([layer], [TARGETS["hopper"]], cache_dir=tmp_path)
    assert [b.hit for b in again] == [True] * 3

    # What a construction on an H200 does (CupyBackend.load: its own cache key, the package's
    # cache directory), minus the driver: every kernel found, none compiled, no lock taken.
    for lock in tmp_path.glob("cubin/*.lock"):
        lock.unlink()
    monkeypatch.setenv("METRALE_ATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cupy_backend, "_MODULES", {})
    loaded = []

    class RawModule:
        def __init__(self, path):
            loaded.append(pathlib.Path(path))

        def get_function(self, name):
            return types.SimpleNamespace(max_dynamic_shared_size_bytes=0)

    backend = cupy_backend.CupyBackend()
    backend._cupy = types.SimpleNamespace(RawModule=RawModule)
    backend.device = lambda: DeviceInfo(0, (9, 0), 132, "NVIDIA H200 (pretend)")
    needed = needed_specs([layer], TARGETS["hopper"], environ={}).needed
    backend.load_many(n.spec for n in needed)
    assert sorted(loaded) == sorted(b.path for b in again)
    assert not list(tmp_path.glob("cubin/*.lock"))  # a hit takes no lock: a read-only cache serves as it is


def test_kernels_compile_in_parallel_processes_for_the_targets_that_take_the_model_and_a_refusal_exits_3(
        tmp_path, capsys):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (cupy) is not installed")
    argv = ("--target", "a10,hopper", *SMALL, "--kv-dtype", "fp8_e4m3", "--sinks", "-j", "2", "--cache-dir",
            str(tmp_path))
    code, out, _ = precompile_cli(capsys, *argv)
    assert code == 3
    lines = out.splitlines()
    assert lines[2].startswith("sm_86: skipped: layer (4 q heads, 4 KV heads, head_dim 64) on a10: ")
    assert lines[3].startswith("sm_90: target defaults (hopper")
    assert lines[4] == "compiling 2 kernel(s), 2 at a time, each said as it is done:"
    assert sorted(line.split()[4] for line in lines[5:7]) == ["decode_splitk_qbf16_kvfp8_hd64_r8_sinks", "pd_selftest"]
    assert {line.split()[0] for line in lines[5:7]} == {"miss"}
    assert lines[7].endswith(": 2 compiled, 0 already cached, " + lines[7].split(", ")[-1])
    assert lines[7].endswith("(2 processes)") and lines[8].startswith("skipped a10 (sm_86): ")
    code, out, _ = precompile_cli(capsys, *argv, "--skip-unsupported")
    assert code == 0 and ": 0 compiled, 2 already cached, " in out


def test_a_cache_directory_that_cannot_take_a_missing_kernel_is_an_error_not_a_silent_temporary_one(
        tmp_path, monkeypatch, capsys):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (cupy) is not installed")
    from support.builds import nvrtc_build
    from metrale_attn.backends import cubin, cupy_backend

    monkeypatch.setattr(cubin, "_fallback_dir", None)
    monkeypatch.setattr(cupy_backend, "compile_cubin", lambda v, a: nvrtc_build(v, a)[0])
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.warns(RuntimeWarning, match="not writable"):
        code, out, err = precompile_cli(capsys, "--target", "hopper", *SMALL, "--impl", "simt",
                                        "--cache-dir", str(blocker / "cache"))
    assert code == 2 and "  miss" not in out
    assert (f"error: cannot make the cache directory {blocker / 'cache' / 'cubin'}: {blocker} is a file, not a "
            "directory; give --cache-dir a directory (the kernel went to ") in err


@pytest.mark.parametrize("blocked", ["entry", "sidecar", "read-only"])
def test_a_cache_that_cannot_take_a_kernel_says_what_is_actually_in_the_way(tmp_path, monkeypatch, capsys, blocked):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (cupy) is not installed")
    import os

    from support.builds import nvrtc_build
    from metrale_attn.backends import cubin, cupy_backend

    if blocked == "read-only" and os.geteuid() == 0:
        pytest.skip("root writes into a read-only directory")
    monkeypatch.setattr(cubin, "_fallback_dir", None)
    monkeypatch.setattr(cupy_backend, "compile_cubin", lambda v, a: nvrtc_build(v, a)[0])
    layer = Layer("layer", 4, 4, 64)
    options = Options(impl="simt")
    entry = cupy_backend.cubin_entry(needed_specs([layer], TARGETS["hopper"], options, environ={}).needed[0].spec,
                                     "sm_90", tmp_path)
    entry.parent.mkdir(parents=True)
    if blocked == "read-only":
        entry.parent.chmod(0o555)
    else:
        (entry if blocked == "entry" else entry.with_name(entry.name + ".json")).mkdir()
    from metrale_attn import precompile

    with pytest.warns(RuntimeWarning), pytest.raises(PrecompileError) as refused:
        precompile.precompile([layer], [TARGETS["hopper"]], options, cache_dir=tmp_path)
    entry.parent.chmod(0o755)
    if blocked == "read-only":
        assert f"cannot write the cache directory {entry.parent}: {entry.parent} is not writable" in str(refused.value)
    else:
        blocker = entry if blocked == "entry" else entry.with_name(entry.name + ".json")
        assert str(refused.value).startswith(f"cannot write the kernel into the cache: {blocker} is a directory where "
                                             "the cache keeps a file; remove it (the kernel went to ")
        assert "writable --cache-dir" not in str(refused.value)


def _fake_plans(names):
    from metrale_attn.precompile import Needed, TargetPlan
    from types import SimpleNamespace

    needed = tuple(Needed(SimpleNamespace(name=name), "test") for name in names)
    return [TargetPlan(TARGETS["hopper"], "defaults", needed, ())]


def test_parallel_builds_run_in_this_process_and_in_the_pool_and_come_back_in_the_plans_order(
        tmp_path, monkeypatch):
    import os

    from metrale_attn import precompile as pc
    from support import precompile_doubles

    monkeypatch.setenv("PRECOMPILE_DOUBLES_PARENT", str(os.getpid()))
    monkeypatch.setattr(pc, "_build_one", precompile_doubles.build_saying_the_process)
    names = [f"k{i}" for i in range(12)]
    seen = []
    built = pc.build_all(_fake_plans(names), tmp_path, jobs=3, on_built=seen.append)
    assert [b.name for b in built] == names and sorted(b.name for b in seen) == sorted(names)
    builders = {b.why for b in built}
    assert f"pid {os.getpid()}" in builders  # this process compiles while the pool's processes start
    assert len(builders) >= 2  # and a pool process compiled some


def test_a_pool_process_that_dies_fails_its_own_kernel_and_this_process_builds_the_rest(tmp_path, monkeypatch):
    import os

    from metrale_attn import precompile as pc
    from support import precompile_doubles

    monkeypatch.setenv("PRECOMPILE_DOUBLES_PARENT", str(os.getpid()))
    monkeypatch.setattr(pc, "_build_one", precompile_doubles.build_saying_the_process)
    names = ["crash", *(f"k{i}" for i in range(8))]
    built = pc.build_all(_fake_plans(names), tmp_path, jobs=2, keep_going=True)
    assert [b.name for b in built] == names
    failed = [b for b in built if b.error]
    assert [b.name for b in failed] == ["crash"]  # its own error only, wherever it was built
    if "BrokenProcessPool" in failed[0].error:  # the pool took it and died: this process built every other one
        assert {b.why for b in built[1:]} == {f"pid {os.getpid()}"}
    else:  # this process took it first (the double fails it here): the pool lived on
        assert failed[0].why == "here"


def test_without_keep_going_no_kernel_starts_after_one_fails(tmp_path, monkeypatch):
    from metrale_attn import precompile as pc

    started = []

    def build(job):
        started.append(job[1].name)
        return pc.Built(job[0], job[1].name, "test", False, 0.0, None, "broken" if job[1].name == "k1" else "")

    monkeypatch.setattr(pc, "_build_one", build)
    built = pc.build_all(_fake_plans([f"k{i}" for i in range(6)]), tmp_path, jobs=1)
    assert started == ["k0", "k1"] and [b.error for b in built] == ["", "broken"]


# -- 512-wide values: Gemma 4's full layers and MLA's 576/512 latent head served by the simt kernels ----


def test_gemma_4_26b_maps_25_sliding_layers_at_256_and_5_full_ones_at_512_with_two_kv_heads_and_v_from_k():
    model = hf_config.load(CONFIGS / "gemma-4-26b-a4b-it.json")
    assert (model.model_type, model.num_q_heads, model.num_kv_heads, model.head_dim, model.dtype) == (
        "gemma4_text", 16, 8, 256, "bfloat16")
    sliding, full = model.kinds
    assert (sliding.name, sliding.count, sliding.window_left, sliding.sm_scale, model.shape_of(sliding)) == (
        "sliding_attention", 25, 1023, 1.0, (8, 256, 256))
    assert (full.name, full.count, full.window_left, full.sm_scale, model.shape_of(full)) == (
        "full_attention", 5, -1, 1.0, (2, 512, 512))
    assert full.k_eq_v and not full.v_in_k and not sliding.k_eq_v


def test_gemma_4_reads_num_global_key_value_heads_only_under_attention_k_eq_v_as_transformers_does():
    config = json.loads((CONFIGS / "gemma-4-26b-a4b-it.json").read_text())
    config["text_config"]["attention_k_eq_v"] = False
    model = hf_config.from_dict(config)
    assert model.shape_of(model.kinds[1]) == (8, 512, 512) and not model.kinds[1].k_eq_v
    assert "num_global_key_value_heads 2 unused (attention_k_eq_v false)" in model.notes


def test_gemma_4_forces_its_last_layer_to_full_attention_as_transformers_does():
    config = json.loads((CONFIGS / "gemma-4-26b-a4b-it.json").read_text())
    text = config["text_config"]
    text["layer_types"] = text["layer_types"][:-1] + ["sliding_attention"]
    assert [(k.name, k.count) for k in hf_config.from_dict(config).kinds] == [("sliding_attention", 25),
                                                                            ("full_attention", 5)]
    del text["layer_types"]
    text["num_hidden_layers"] = 8  # pattern 6: layer 5 full, layer 7 forced full
    assert [(k.name, k.count) for k in hf_config.from_dict(config).kinds] == [("sliding_attention", 6),
                                                                            ("full_attention", 2)]


@pytest.mark.parametrize("change, message", [
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention = 'all': bidirectional attention"),
    ({"per_layer_config": {"5": {"head_dim": 256}}}, "per_layer_config['5'] = {'head_dim': 256} is not what"),
    ({"per_layer_config": {"0": {"head_dim": 512}}}, "per_layer_config['0'] = {'head_dim': 512} is not what"),
    ({"num_kv_shared_layers": -1}, "num_kv_shared_layers must be a non-negative integer, got -1"),
    ({"num_global_key_value_heads": 0}, "num_global_key_value_heads must be a positive integer, got 0"),
])
def test_a_gemma_4_key_that_cannot_be_mapped_is_refused_naming_it(change, message):
    config = json.loads((CONFIGS / "gemma-4-26b-a4b-it.json").read_text())
    config["text_config"].update(change)
    with pytest.raises(hf_config.HFConfigError, match=re.escape(message)):
        hf_config.from_dict(config)


def test_gemma_4s_saved_per_layer_config_that_agrees_is_accepted():
    config = json.loads((CONFIGS / "gemma-4-26b-a4b-it.json").read_text())
    config["text_config"]["per_layer_config"] = {str(i): {"head_dim": 512, "num_key_value_heads": 2}
                                                 for i in (5, 11, 17, 23, 29)}
    model = hf_config.from_dict(config)
    assert model.shape_of(model.kinds[1]) == (2, 512, 512)


def yarn_scale(qk: int, factor: float, all_dim: float) -> float:
    """DeepSeek's softmax scale, written out again: 1/sqrt(qk) x (0.1 all_dim ln(factor) + 1)^2."""
    mscale = 0.1 * all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
    return mscale * mscale / math.sqrt(qk)


@pytest.mark.parametrize("name, model_type, heads, layers, factor, all_dim", [
    ("deepseek-v3.json", "deepseek_v3", 128, 61, 40, 1.0),
    ("kimi-k2-instruct.json", "kimi_k2", 64, 61, 32, 1.0),
    ("deepseek-v2-lite.json", "deepseek_v2", 16, 27, 40, 0.707),
])
def test_mla_models_are_one_latent_kv_head_of_576_dims_whose_values_are_its_first_512(name, model_type, heads, layers,
                                                                                         factor, all_dim):
    model = hf_config.load(CONFIGS / name)
    assert (model.model_type, model.num_q_heads, model.num_kv_heads, model.head_dim, model.dtype) == (
        model_type, heads, 1, 576, "bfloat16")
    (kind,) = model.kinds
    assert (kind.name, kind.count, model.shape_of(kind), kind.v_in_k, kind.k_eq_v) == (
        "full_attention", layers, (1, 576, 512), True, False)
    assert kind.sm_scale == pytest.approx(yarn_scale(192, factor, all_dim), rel=1e-15)


def test_deepseek_v3s_softmax_scale_is_the_yarn_mscale_squared_over_sqrt_192():
    assert hf_config.load(CONFIGS / "deepseek-v3.json").kinds[0].sm_scale == pytest.approx(
        (0.1 * math.log(40) + 1) ** 2 / math.sqrt(192), rel=1e-15)  # 0.13523...


@pytest.mark.parametrize("rope, scale", [
    (None, 192 ** -0.5),
    ({"rope_type": "default", "rope_theta": 10000}, 192 ** -0.5),
    ({"type": "yarn", "factor": 40}, 192 ** -0.5),  # no mscale_all_dim: mscale 1
    ({"type": "yarn", "factor": 1.0, "mscale_all_dim": 1.0}, 192 ** -0.5),  # factor <= 1: mscale 1
    ({"rope_type": "yarn", "factor": 4, "mscale_all_dim": 2.0}, (0.2 * math.log(4) + 1) ** 2 * 192 ** -0.5),
])
def test_the_mla_scale_takes_the_yarn_mscale_only_where_rope_scaling_asks_for_it(rope, scale):
    config = json.loads((CONFIGS / "deepseek-v2-lite.json").read_text())
    config["rope_scaling"] = rope
    assert hf_config.from_dict(config).kinds[0].sm_scale == pytest.approx(scale, rel=1e-15)


@pytest.mark.parametrize("name, change, message", [
    ("deepseek-v3.json", {"rope_scaling": {"type": "linear", "factor": 4}}, "rope_scaling type 'linear' on multi-head"),
    ("deepseek-v3.json", {"rope_scaling": {"type": "yarn", "factor": 10**400}}, "rope_scaling.factor must be a positive"),
    ("deepseek-v3.json", {"rope_scaling": {"type": "yarn", "factor": 40, "mscale_all_dim": -1}},
     "rope_scaling.mscale_all_dim must be a non-negative number, got -1"),
    ("deepseek-v3.json", {"qk_rope_head_dim": None}, "qk_rope_head_dim is missing"),
    ("deepseek-v3.json", {"index_topk": 2048}, "index_topk = 2048: DeepSeek's sparse attention"),
    ("llama-3-8b.json", {"kv_lora_rank": 512}, "multi-head latent attention of model_type llama is not mapped"),
])
def test_an_mla_config_that_cannot_be_mapped_is_refused_naming_the_key(name, change, message):
    config = dict(json.loads((CONFIGS / name).read_text()), **change)
    with pytest.raises(hf_config.HFConfigError, match=re.escape(message)):
        hf_config.from_dict(config)


def test_at_tensor_parallelism_mla_splits_the_q_heads_and_puts_the_latent_head_on_every_rank():
    (layer,) = layers_of(hf_config.load(CONFIGS / "deepseek-v3.json"), 8)
    assert (layer.num_q_heads, layer.num_kv_heads, layer.head_dim, layer.v_head_dim, layer.v_in_k) == (
        16, 1, 576, 512, True)
    assert layer.sm_scale == hf_config.load(CONFIGS / "deepseek-v3.json").kinds[0].sm_scale
    gemma = layers_of(hf_config.load(CONFIGS / "gemma-4-26b-a4b-it.json"), 4)
    assert [(x.name, x.num_q_heads, x.num_kv_heads, x.head_dim) for x in gemma] == [
        ("sliding_attention", 4, 2, 256), ("full_attention", 4, 1, 512)]
    config = json.loads((CONFIGS / "gemma-4-26b-a4b-it.json").read_text())
    config["text_config"]["num_global_key_value_heads"] = 3
    with pytest.raises(hf_config.HFConfigError, match="--tensor-parallel-size 2 must divide "
                                                      "num_global_key_value_heads 3"):
        layers_of(hf_config.from_dict(config), 2)


GEMMA4 = ("--hf-config", str(CONFIGS / "gemma-4-26b-a4b-it.json"))


def test_precompile_plans_gemma_4s_sliding_layers_on_mma_and_its_512_wide_full_layers_on_simt_saying_why(capsys):
    code, out, err = precompile_cli(capsys, "--target", "hopper", *GEMMA4, "--tp", "2", "--dry-run")
    assert code == 0 and not err and "not served" not in out
    assert ("  full_attention: head_dim 512 is wider than the mma core's 64..256; using impl='simt' instead, as a "
            "construction there does") in out
    assert "  decode_splitk_qbf16_kvbf16_hd256_r8_window  [sliding_attention]" in out
    assert "  simt_decode_splitk_qbf16_kvbf16_hd512  [full_attention]" in out
    assert out.splitlines()[-1] == "would compile 3 kernel(s) for sm_90 (dry run: nothing compiled)"


def test_gemma_4s_full_layers_plan_simt_on_every_target_and_no_self_test_for_them_alone():
    """The fallback is the shape's, not a device's: every target, and no mma self-test where no
    layer runs mma (a construction does not run it for a 512-wide layer either)."""
    full = layers_of(hf_config.load(CONFIGS / "gemma-4-26b-a4b-it.json"))[1]
    assert (full.num_q_heads, full.num_kv_heads, full.head_dim, full.sm_scale, full.k_eq_v) == (16, 2, 512, 1.0, True)
    for target in TARGETS.values():
        plan = needed_specs([full], target, Options(kv_dtype="fp8_e4m3"), environ={})
        names = [n.name for n in plan.needed]  # legacy targets (gb10) reach the unpacked arm at max_batch too
        assert "simt_decode_splitk_qbf16_kvfp8_hd512" in names, target.name
        assert set(names) <= {"simt_decode_splitk_qbf16_kvfp8_hd512", "simt_decode_unpacked_qbf16_kvfp8_hd512"}
        assert plan.notes == ("full_attention: head_dim 512 is wider than the mma core's 64..256; using impl='simt' "
                              "instead, as a construction there does",)
    off = needed_specs([full], TARGETS["hopper"], Options(splitk="off"), environ={})
    assert [n.name for n in off.needed] == ["simt_decode_unpacked_qbf16_kvbf16_hd512"]


def test_impl_mma_chosen_for_gemma_4_is_refused_at_its_full_layers_naming_head_dim_and_what_mma_takes(capsys):
    message = ("full_attention (16 q heads, 2 KV heads, head_dim 512) on hopper: impl='mma' has no head_dim 512 (the "
               "mma kernels take every multiple of 16 from 64 to 256): use impl='simt', or leave impl and "
               "METRALE_ATTN_DECODE_IMPL unset (the default takes simt there)")
    with pytest.raises(ValueError, match=re.escape(message)):
        needed_specs(layers_of(hf_config.load(CONFIGS / "gemma-4-26b-a4b-it.json")), TARGETS["hopper"],
                     Options(impl="mma"), environ={})
    with pytest.raises(ValueError, match=re.escape(message)):
        needed_specs(layers_of(hf_config.load(CONFIGS / "gemma-4-26b-a4b-it.json")), TARGETS["hopper"],
                     Options(), environ={"METRALE_ATTN_DECODE_IMPL": "mma"})


def test_an_mla_model_plans_its_latent_layer_on_the_simt_kernels_saying_why(capsys):
    code, out, err = precompile_cli(capsys, "--target", "hopper", "--hf-config", str(CONFIGS / "deepseek-v3.json"),
                                    "--tp", "8", "--dry-run")
    assert code == 0, err
    assert ("  full_attention: (head_dim, v_head_dim) (576, 512) has no mma kernel (values narrower than keys: MLA's "
            "absorbed decode is the simt kernels'); using impl='simt' instead, as a construction there does") in out
    assert "  simt_decode_splitk_qbf16_kvbf16_hd576_v512  [full_attention]" in out
    assert "not served" not in out + err


@pytest.mark.parametrize("name", ["deepseek-v3.json", "kimi-k2-instruct.json", "deepseek-v2-lite.json"])
def test_every_mla_model_plans_576_512_on_simt_on_every_target_with_no_self_test(name):
    (layer,) = layers_of(hf_config.load(CONFIGS / name), 1)
    for target in TARGETS.values():
        plan = needed_specs([layer], target, Options(kv_dtype="fp8_e4m3"), environ={})
        names = {n.name for n in plan.needed}
        assert names and names <= {"simt_decode_splitk_qbf16_kvfp8_hd576_v512",  # no mma self-test either
                                   "simt_decode_unpacked_qbf16_kvfp8_hd576_v512"}, target.name


def test_the_library_refuses_a_narrow_layer_it_has_no_kernel_for_by_its_shape_before_configuring_it():
    from metrale_attn.precompile import not_served, plan_targets

    wide = Layer("full_attention", 16, 2, 576, v_head_dim=512, v_in_k=True)  # MLA takes one latent KV head
    assert not_served(Layer("layer", 8, 1, 256)) is None
    assert not_served(Layer("full_attention", 16, 2, 512, k_eq_v=True)) is None  # Gemma 4's: the simt kernels
    assert not_served(Layer("full_attention", 16, 1, 576, v_head_dim=512, v_in_k=True)) is None  # MLA: simt
    assert not_served(wide).endswith("not served yet; this version serves head dims 64 to 256 and 512 (simt) with "
                                     "values as wide as the keys, and (head_dim, v_head_dim) (576, 512) over one KV "
                                     "head (simt)")
    assert "head_dim 576 with v_head_dim 512" in not_served(wide)
    with pytest.raises(ValueError, match=re.escape("full_attention (16 q heads, 2 KV heads, head_dim 576, v_head_dim "
                                                   "512): head_dim 576 with v_head_dim 512")):
        needed_specs([wide], TARGETS["hopper"], environ={})
    plans, refusals = plan_targets([Layer("layer", 8, 1, 256), wide], [TARGETS["hopper"], TARGETS["b200"]],
                                   environ={})
    assert [p.target.name for p in plans] == ["hopper", "b200"] and all(p.needed for p in plans)
    assert [(r.layer.name, r.everywhere, r.target) for r in refusals] == [("full_attention", True, None)]


def test_the_plan_command_shows_each_gemma_4_layer_kind_and_why_the_wide_one_runs_simt(capsys):
    assert main(["plan", *GEMMA4, "--tp", "2", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "layer sliding_attention: q_heads=8 kv_heads=4 head_dim=256 " in out
    assert "layer full_attention: q_heads=8 kv_heads=1 head_dim=512 max_batch=1; impl simt; workspace " in out
    assert "\nimpl simt, not mma: head_dim 512 is wider than the mma core's 64..256\n" in out
    assert "not served" not in out
