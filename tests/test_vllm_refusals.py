"""The vLLM backend's selection refusals name the value and what works, and say a refusal of ours
once: pure functions of ``integrations/vllm/options.py``, tested without vLLM (the backend
only passes vLLM's values in; ``tests/test_vllm_backend.py`` runs them through vLLM's selector)."""

from __future__ import annotations

import pytest

from metrale_attn.config import HEAD_DIMS
from metrale_attn.integrations.vllm import options

SERVED = dict(head_size=128, dtype="torch.bfloat16", kv_cache_dtype="auto", block_size=16, capability=(9, 0),
              attn_type="decoder")


def refusals(**changes) -> dict[str, str]:
    return options.selection_refusals(**{**SERVED, **changes})


def test_what_we_serve_is_refused_for_nothing():
    assert refusals() == {}
    for capability in options.SUPPORTED_CAPABILITIES:
        assert refusals(capability=capability) == {}
    for block_size in (16, 32, 48, 256, 512):
        assert refusals(block_size=block_size) == {}


@pytest.mark.parametrize("head_size", [32, 72, 520])
def test_a_head_size_we_do_not_serve_is_refused_listing_every_one_we_do_512_on_the_reference_kernels(head_size):
    listed = ", ".join(map(str, HEAD_DIMS))
    assert refusals(head_size=head_size) == {
        "head_size not supported": f"head_size {head_size} not supported (metrale-attn: {listed}, 512 (512 on the "
                                   "reference kernels))"}
    assert listed.startswith("64, 80, 96, ") and listed.endswith(", 240, 256")


def test_head_size_512_is_served_plain_or_with_an_fp8_cache_and_refused_with_what_the_reference_kernels_lack():
    """An fp8 cache's scales are device tensors, which the reference kernels read (device_scales)."""
    assert refusals(head_size=512) == refusals(head_size=512, kv_cache_dtype="fp8") == {}
    plain = dict(head_size=512, kv_cache_dtype="auto", has_sink=False, has_sliding_window=False, capability=(9, 0))
    assert options.reference_kernel_refusal(**plain) is None
    assert options.reference_kernel_refusal(**{**plain, "kv_cache_dtype": "fp8"}) is None
    assert options.layer_refusal(num_heads=16, num_kv_heads=2, head_size=512, q_dtype="bfloat16", kv_dtype="fp8_e4m3",
                                 fp8=True, capability=(9, 0)) is None
    for change, lacks in ((dict(has_sink=True), "sinks"), (dict(has_sliding_window=True), "window"),
                          (dict(kv_cache_dtype="fp8", has_sink=True), "sinks")):
        found = options.reference_kernel_refusal(**{**plain, **change})
        assert f"(impl='simt' has no {lacks})" in found and "head sizes 64 to 256 take them" in found, found
        assert "512 a model-dtype or fp8 cache without sinks or a window" in found, found
    assert options.reference_kernel_refusal(**{**plain, "head_size": 256, "has_sink": True}) is None


@pytest.mark.parametrize("capability", [(7, 0), (7, 5), (11, 0)])
def test_a_gpu_we_do_not_launch_on_is_refused_listing_the_compute_capabilities_and_architectures_we_do(capability):
    said = refusals(capability=capability)["compute capability not supported"]
    assert said.startswith(f"compute capability {capability[0]}.{capability[1]} not supported (metrale-attn launches "
                           "on 8.0 (sm_80, a100), 8.6 (sm_86, a10), 8.9 (sm_89, l40s), 9.0 (sm_90, hopper), ")
    assert said.endswith("12.0 (sm_120, rtx5090), 12.1 (sm_121, gb10))")


@pytest.mark.parametrize("block_size", [1, 8, 24, 100])
def test_a_block_size_that_is_no_multiple_of_16_is_refused_saying_so(block_size):
    assert refusals(block_size=block_size) == {"block_size not supported": (
        f"block_size {block_size} not supported (metrale-attn: a multiple of 16, which vLLM splits into kernel "
        "blocks of 16, 32, 64, 128, 256 tokens)")}


def test_a_dtype_a_cache_dtype_and_an_attention_type_we_do_not_serve_are_refused_listing_what_we_do():
    assert refusals(dtype="torch.float32") == {
        "dtype not supported": "dtype torch.float32 not supported (metrale-attn: torch.bfloat16, torch.float16)"}
    assert refusals(kv_cache_dtype="int8") == {
        "kv_cache_dtype not supported": "kv_cache_dtype int8 not supported (metrale-attn: auto, bfloat16, float16, "
                                        "fp8, fp8_e4m3)"}
    assert refusals(attn_type="encoder") == {
        "attention type encoder not supported": "attention type encoder not supported (metrale-attn: decoder "
                                                "self-attention only)"}
    assert refusals(kv_cache_dtype="fp8_e5m2") == {}  # supports_combination says why, with the way out


def test_each_bare_reason_of_vllms_is_replaced_by_ours_and_any_other_kept():
    ours = refusals(head_size=72, block_size=8)
    said = options.with_what_works(["head_size not supported", "block_size not supported", "MLA not supported"], ours)
    assert said == [ours["head_size not supported"], ours["block_size not supported"], "MLA not supported"]


def test_the_prefill_routes_refusal_is_dropped_where_it_only_repeats_one_of_ours():
    ours = refusals(block_size=8)
    assert options.prefill_refusal([("TRITON_ATTN", ["block_size not supported"])], ours) is None
    assert options.prefill_refusal([("FLASH_ATTN", ["head_size not supported"]),
                                    ("TRITON_ATTN", ["block_size not supported"])], ours) is None


def test_the_prefill_routes_refusal_is_said_with_every_candidates_reasons_where_it_is_its_own():
    refused = [("FLASH_ATTN", ["attention sinks not supported"]),
               ("TRITON_ATTN", ["block_size not supported", "compute capability not supported"])]
    assert options.prefill_refusal(refused, refusals(block_size=8)) == (
        "no prefill backend for the prefill tokens (FLASH_ATTN: attention sinks not supported; TRITON_ATTN: "
        "block_size not supported, compute capability not supported)")
    assert options.prefill_refusal([], {}) is None


MLA = dict(SERVED, head_size=576)


def test_mlas_576_wide_latent_layer_is_served_and_every_other_head_size_refused_naming_576():
    assert options.mla_selection_refusals(**MLA) == {}
    for head_size in (320, 512, 128):
        said = options.mla_selection_refusals(**{**MLA, "head_size": head_size})
        assert said == {"head_size not supported": (
            f"head_size {head_size} not supported (metrale-attn MLA: 576, a kv_lora_rank of 512 + a qk_rope_head_dim "
            "of 64: DeepSeek-V2/V3/R1, Kimi-K2)")}


def test_under_mla_fp8_e5m2_is_refused_as_a_cache_dtype_and_e4m3_served():
    assert options.mla_selection_refusals(**{**MLA, "kv_cache_dtype": "fp8"}) == {}
    assert options.mla_selection_refusals(**{**MLA, "kv_cache_dtype": "fp8_e5m2"}) == {
        "kv_cache_dtype not supported": "kv_cache_dtype fp8_e5m2 not supported (metrale-attn MLA: auto, bfloat16, "
                                        "float16, fp8, fp8_e4m3)"}

