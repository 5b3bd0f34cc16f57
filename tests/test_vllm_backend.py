"""metrale-attn inside vLLM 0.33 on the CPU: the plugin, backend selection, the routing of one
batch between our kernels and vLLM's prefill backend, vLLM's KV cache layouts, CUDA-graph
buckets, tensor parallelism and torch.compile, all through vLLM's own machinery
(``tests/vllm_harness.py``). Needs vLLM: skipped where it is not installed, except in CI's
vLLM venv (``METRALE_ATTN_REQUIRE_VLLM=1``)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from support.optional import import_vllm

vllm = import_vllm()

import torch  # noqa: E402  (after the skip: vLLM brings its torch)
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

import vllm_harness as h  # noqa: E402
from metrale_attn import workspace_bytes  # noqa: E402
from metrale_attn.integrations.vllm import backend as ours  # noqa: E402
from metrale_attn.integrations.vllm import options  # noqa: E402
from metrale_attn.serving import ModelAttention  # noqa: E402

HOPPER = DeviceCapability(9, 0)


@pytest.fixture(autouse=True)
def _prefill_on_the_cpu(monkeypatch):
    """vLLM's Triton prefill kernel needs a GPU: its forward runs in torch (``cpu_prefill_forward``)."""
    monkeypatch.setattr(TritonAttentionImpl, "forward", h.cpu_prefill_forward)
    h.PREFILL_CALLS.clear()
    yield


def _python(code: str) -> str:
    """Run ``code`` in a fresh interpreter (this venv's), returning its stdout."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# -- the plugin and selection ---------------------------------------------------------------


def test_importing_metrale_attn_and_its_torch_layers_imports_no_vllm():
    out = _python("""
        import sys
        import metrale_attn, metrale_attn.torch_op, metrale_attn.serving, metrale_attn.integrations.vllm.options
        print(sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.")))
    """)
    assert out.strip() == "[]"


def test_vllms_plugin_loader_registers_METRALE_ATTN_and_changes_nothing_else():
    """The entry point adds two enum members (METRALE_ATTN, and METRALE_ATTN_MLA for MLA models) and
    their class paths; every other backend resolves
    to what it did before, and nothing of ours beyond the name is imported (so a run that
    selects another backend runs exactly as without the plugin)."""
    out = _python("""
        import json, sys
        from vllm.v1.attention.backends import registry
        before = {name: member.value for name, member in registry.AttentionBackendEnum.__members__.items()}
        overrides_before = dict(registry._ATTN_OVERRIDES)
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        load_general_plugins()  # vLLM may call it again
        after = {name: member.value for name, member in registry.AttentionBackendEnum.__members__.items()}
        print(json.dumps(dict(
            added={k: v for k, v in after.items() if k not in before},
            changed=[k for k in before if after.get(k) != before[k]],
            overrides={m.name: p for m, p in registry._ATTN_OVERRIDES.items() if m.name not in overrides_before},
            flash=registry.AttentionBackendEnum.FLASH_ATTN.get_path(),
            imported=sorted(m for m in sys.modules if m.startswith("metrale_attn.") and m not in (
                "metrale_attn.integrations", "metrale_attn.integrations.vllm")))))
    """)
    import json

    found = json.loads(out.strip().splitlines()[-1])
    ours_added = {"METRALE_ATTN": "metrale_attn.integrations.vllm.backend.MetraleAttentionBackend",
                  "METRALE_ATTN_MLA": "metrale_attn.integrations.vllm.mla.MetraleMLABackend"}
    assert found["added"] == ours_added
    assert found["changed"] == []
    assert found["overrides"] == ours_added
    assert found["flash"] == "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"
    assert "metrale_attn.integrations.vllm.backend" not in found["imported"]
    assert "metrale_attn.integrations.vllm.mla" not in found["imported"]
    assert "metrale_attn.torch_op" not in found["imported"]


def test_the_backend_resolves_through_AttentionBackendEnum_by_its_name():
    assert AttentionBackendEnum["METRALE_ATTN"].get_class() is ours.MetraleAttentionBackend
    assert ours.MetraleAttentionBackend.get_name() == "METRALE_ATTN"


def test_vllms_argument_parser_accepts_attention_backend_METRALE_ATTN(monkeypatch):
    """``vllm serve``'s parser (AsyncEngineArgs, which loads the plugins first), as on a GPU
    machine: this one has no device type, which the parser's defaults would ask for."""
    from vllm.config import AttentionConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setattr(type(current_platform), "device_type", "cuda")
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "some/model", "--attention-backend", "METRALE_ATTN"])
    engine_args = AsyncEngineArgs.from_cli_args(args)
    backend = AttentionConfig(backend=engine_args.attention_backend).backend
    assert backend is AttentionBackendEnum.METRALE_ATTN
    assert backend.get_class() is ours.MetraleAttentionBackend


def _selector(**changes):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    config = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16)
    config.update(changes)
    return AttentionSelectorConfig(**config)


def _reasons(capability=HOPPER, **changes) -> list[str]:
    """What vLLM's CUDA platform asks of the backend named by ``--attention-backend
    METRALE_ATTN`` on a device of ``capability`` (``CudaPlatformBase.get_attn_backend_cls``:
    the class resolved through the enum, then ``validate_configuration`` with the selector's
    fields; that module needs libcuda, so the call is made here as it makes it). Empty: we
    are selected; else vLLM raises "Selected backend ... is not valid" with these."""
    backend = AttentionBackendEnum.METRALE_ATTN.get_class()
    return backend.validate_configuration(device_capability=capability, **_selector(**changes)._asdict())


@pytest.mark.parametrize("changes", [
    dict(), dict(dtype=torch.float16), dict(head_size=64), dict(head_size=256), dict(head_size=80), dict(kv_cache_dtype="fp8"),
    dict(kv_cache_dtype="fp8_e4m3"), dict(kv_cache_dtype="bfloat16"), dict(has_sink=True),
    dict(has_sliding_window=True), dict(block_size=256), dict(block_size=512), dict(use_batch_invariant=True),
    dict(head_size=512), dict(head_size=512, dtype=torch.float16), dict(head_size=512, kv_cache_dtype="fp8"),
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_vllms_cuda_selector_accepts_what_we_serve(changes):
    assert _reasons(**changes) == []


@pytest.mark.parametrize("changes, reason", [
    (dict(head_size=72), "head_size 72 not supported (metrale-attn: 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, "
                         "224, 240, 256, 512 (512 on the reference kernels))"),
    (dict(head_size=520), "head_size 520 not supported (metrale-attn: 64, 80,"),
    (dict(head_size=32), "head_size 32 not supported (metrale-attn: 64, 80,"),
    (dict(head_size=512, has_sink=True), "head_size 512 with sinks not supported (metrale-attn: head_dim 512 is "
                                         "wider than the mma core's 64..256"),
    (dict(head_size=512, has_sliding_window=True), "(impl='simt' has no window); head sizes 64 to 256 take them, 512 "
                                                   "a model-dtype or fp8 cache without sinks or a window)"),
    (dict(head_size=512, kv_cache_dtype="fp8", has_sink=True), "head_size 512 with an fp8 cache and sinks not "
                                                                "supported"),
    (dict(dtype=torch.float32), "dtype torch.float32 not supported (metrale-attn: torch.bfloat16, torch.float16)"),
    (dict(kv_cache_dtype="fp8_e5m2"), "fp8_e5m2 has no prefill backend"),
    (dict(kv_cache_dtype="int8_per_token_head"), "kv_cache_dtype int8_per_token_head not supported (metrale-attn: "
                                                 "auto, bfloat16, float16, fp8, fp8_e4m3)"),
    (dict(block_size=8), "block_size 8 not supported (metrale-attn: a multiple of 16, which vLLM splits into kernel "
                         "blocks of 16, 32, 64, 128, 256 tokens)"),
    (dict(use_mla=True), "MLA not supported"),
    (dict(use_sparse=True), "sparse not supported"),
    (dict(use_mm_prefix=True), "partial multimodal token full attention not supported"),
    (dict(use_per_head_quant_scales=True), "per-head quant scales not supported"),
    (dict(attn_type=AttentionType.ENCODER), "not supported (metrale-attn: decoder self-attention only)"),
    (dict(attn_type=AttentionType.ENCODER_ONLY), "attention type"),
    (dict(attn_type=AttentionType.ENCODER_DECODER), "attention type"),
    (dict(use_non_causal=True), "non-causal attention not supported"),
    (dict(use_pcp=True), "PCP not supported"),
    (dict(use_dcp=True), "DCP not supported"),
    (dict(use_rswa=True), "R-SWA not supported"),
    (dict(use_adaptive_verification=True), "device-cpu query lens mismatch not supported"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_vllms_cuda_selector_refuses_what_we_do_not_serve_with_our_reason(changes, reason):
    assert any(reason in found for found in _reasons(**changes)), _reasons(**changes)


@pytest.mark.parametrize("changes", [dict(block_size=8), dict(block_size=24), dict(head_size=520), dict(head_size=32)],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_a_refusal_of_ours_is_said_once_without_the_prefill_routes_consequence_of_it(changes):
    found = _reasons(**changes)
    assert len(found) == 1 and "no prefill backend" not in found[0], found


@pytest.mark.parametrize("capability", [DeviceCapability(7, 5), DeviceCapability(11, 0)])
def test_devices_our_kernels_do_not_launch_on_are_refused_at_selection(capability):
    found = _reasons(capability)
    assert any(f"compute capability {capability.major}.{capability.minor} not supported (metrale-attn launches on "
               "8.0 (sm_80, a100), " in r and "9.0 (sm_90, hopper)" in r for r in found), found


@pytest.mark.parametrize("capability", [DeviceCapability(8, 0), DeviceCapability(8, 6), DeviceCapability(8, 9),
                                        DeviceCapability(9, 0), DeviceCapability(10, 0), DeviceCapability(10, 3),
                                        DeviceCapability(12, 0), DeviceCapability(12, 1)])
def test_every_target_of_ours_ampere_to_consumer_blackwell_is_accepted(capability):
    assert _reasons(capability) == []


@pytest.mark.parametrize("capability", [DeviceCapability(8, 0), DeviceCapability(8, 6)])
def test_an_fp8_cache_is_refused_where_the_gpu_has_no_fp8_conversion(capability):
    assert any("fp8 cvt of sm_89" in r for r in _reasons(capability, kv_cache_dtype="fp8")), _reasons(capability)
    assert _reasons(DeviceCapability(8, 9), kv_cache_dtype="fp8") == []


def test_batch_invariance_is_declared_under_auto_and_pinned_and_refused_under_legacy(monkeypatch):
    for spelling, invariant in (("auto", True), ("4", True), ("off", True), ("legacy", False)):
        monkeypatch.setenv("METRALE_ATTN_DECODE_SPLITK", spelling)
        assert ours.MetraleAttentionBackend.supports_batch_invariance() is invariant, spelling
    assert "batch invariance not supported" in _reasons(use_batch_invariant=True)


def test_the_impl_refuses_what_the_selector_cannot_see_when_the_layer_is_built(tmp_path):
    vc = h.config(tmp_path)
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vc):
        with pytest.raises(ValueError, match="no ALiBi"):
            ours.MetraleAttentionImpl(4, 64, 0.125, 2, alibi_slopes=[1.0, 0.5, 0.25, 0.125])
        with pytest.raises(ValueError, match="decoder self-attention only"):
            ours.MetraleAttentionImpl(4, 64, 0.125, 2, attn_type=AttentionType.ENCODER_DECODER)
        with pytest.raises(ValueError, match="logits_soft_cap must be a finite float > 0"):
            ours.MetraleAttentionImpl(4, 64, 0.125, 2, logits_soft_cap=-1.0)
        with pytest.raises(ValueError, match="fp8_e5m2 has no prefill backend"):
            ours.MetraleAttentionImpl(4, 64, 0.125, 2, kv_cache_dtype="fp8_e5m2")


def test_vllm_splits_a_block_of_more_than_256_tokens_into_kernel_blocks_we_and_the_prefill_backend_take(tmp_path):
    from vllm.v1.worker.utils import select_common_block_size

    layer = h.layers(h.config(tmp_path), 1)[0]
    for manager, kernel in ((16, 16), (64, 64), (256, 256), (512, 256), (1024, 256)):
        spec = h.spec_of(layer, manager)
        assert select_common_block_size(manager, [ours.MetraleAttentionBackend], [spec]) == kernel, manager


def test_every_field_of_vllms_common_attention_metadata_has_a_routing_rule():
    """An upgrade of vLLM that adds a field to ``CommonAttentionMetadata`` fails here, until
    ``prefill_part`` says how the prefill requests' metadata carries it."""
    fields = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    assert fields == set(ours.COMMON_METADATA_FIELDS)


def test_the_head_sizes_vllm_may_select_us_for_are_the_librarys_own_mma_and_reference_kernel_head_dims():
    from metrale_attn.config import HEAD_DIMS, SIMT_ONLY_HEAD_DIMS

    assert ours.MetraleAttentionBackend.get_supported_head_sizes() == sorted({*HEAD_DIMS, *SIMT_ONLY_HEAD_DIMS})
    assert 512 in ours.MetraleAttentionBackend.get_supported_head_sizes()
    assert options.head_sizes_line().endswith("256, 512 (512 on the reference kernels)")


GEMMA_4 = "gemma-4-26b-a4b-it.json"


def _gemma_4(tmp_path, **model):
    """A ``VllmConfig`` of Gemma-4-26B-A4B-it (its checkpoint's ``config.json``; vLLM reads the
    per-layer head sizes from it) with ``--attention-backend METRALE_ATTN``; ``model``: more
    ``ModelConfig`` fields (``language_model_only=True`` is ``--language-model-only``)."""
    import shutil
    from pathlib import Path

    from vllm.config import AttentionConfig, DeviceConfig, ModelConfig, VllmConfig

    shutil.copy(Path(__file__).parent / "hf_configs" / GEMMA_4, tmp_path / "config.json")
    config = ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096, **model)
    return VllmConfig(model_config=config, device_config=DeviceConfig(device="cpu"),
                      attention_config=AttentionConfig(backend=AttentionBackendEnum.METRALE_ATTN))


def _layer_selections(vc) -> list[tuple[int, str, list[str]]]:
    """Per layer of the model: (head size, layer type, our reasons), with the selector fields
    vLLM's ``Attention`` gives ``get_attn_backend`` for it (its head size, whether it has a
    window, the model's multimodal prefix), checked as the CUDA platform checks the backend
    named by ``--attention-backend`` (``_reasons``)."""
    model = vc.model_config
    types = model.hf_text_config.layer_types
    found = []
    for i, kind in enumerate(types):
        head_size = model.model_arch_config[i].head_size
        found.append((head_size, kind, _reasons(head_size=head_size, block_size=None,
                                                has_sliding_window=kind == "sliding_attention",
                                                use_mm_prefix=model.is_mm_prefix_lm)))
    return found


def test_vllm_keeps_METRALE_ATTN_for_text_only_gemma_4_and_selects_it_for_its_sliding_256_and_global_512_layers(
        tmp_path):
    """vLLM selects per layer: each ``Attention`` asks ``get_attn_backend`` with its own head size,
    and the backend ``--attention-backend`` names must accept every layer (else vLLM stops).
    ``Gemma4Config.verify_and_update_config`` forces TRITON_ATTN only when no backend is named.
    Text-only serving (``--language-model-only``) turns off the multimodal prefix."""
    vc = _gemma_4(tmp_path, language_model_only=True)
    assert not vc.model_config.is_mm_prefix_lm
    assert vc.attention_config.backend is AttentionBackendEnum.METRALE_ATTN
    found = _layer_selections(vc)
    assert {(head, kind) for head, kind, _ in found} == {(256, "sliding_attention"), (512, "full_attention")}
    assert [kind for _, kind, _ in found].count("full_attention") == 5
    assert all(reasons == [] for _, _, reasons in found), found


def test_gemma_4_with_multimodal_inputs_is_refused_on_every_layer_for_its_multimodal_prefix_attention(tmp_path):
    """With images allowed, vLLM 0.33 gives Gemma 4's layers bidirectional attention over image
    tokens (``use_mm_prefix``), which we do not serve: vLLM stops with that reason."""
    vc = _gemma_4(tmp_path)
    assert vc.model_config.is_mm_prefix_lm
    assert all("partial multimodal token full attention not supported" in reasons
               for _, _, reasons in _layer_selections(vc))


def test_the_prefill_tokens_of_a_512_wide_layer_go_to_vllms_triton_backend_flashattention_taking_512_only_with_fa4(
        monkeypatch):
    from vllm.v1.attention.backends import fa_utils, flash_attn
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    assert ours.prefill_backend(head_size=512, dtype=torch.bfloat16, kv_cache_dtype="auto") is TritonAttentionBackend
    monkeypatch.setattr(fa_utils, "is_flash_attn_varlen_func_available", lambda: True)
    monkeypatch.setattr(flash_attn, "is_fa_version_supported", lambda version: False)
    assert ours.prefill_backend(head_size=512, dtype=torch.bfloat16, kv_cache_dtype="auto") is TritonAttentionBackend
    monkeypatch.setattr(flash_attn, "is_fa_version_supported", lambda version: version == 4)
    assert ours.prefill_backend(head_size=512, dtype=torch.bfloat16,
                                kv_cache_dtype="auto") is flash_attn.FlashAttentionBackend


def test_a_512_wide_layer_verifies_speculative_tokens_on_the_reference_kernels_within_the_bar(tmp_path):
    """Gemma 4's global layer (8 q / 1 KV heads at 512, TP 2) under speculative decoding with 2
    draft tokens: the verification requests of 3 tokens run the simt kernels' multi-token decode
    (each token sees its own prefix), the short verification and the prompt vLLM's Triton
    prefill; every token against float64."""
    rng = np.random.default_rng(21)
    shape = dict(num_heads=8, num_kv_heads=1, head_size=512)
    vc, built = _model(tmp_path, rng, count=1, num_blocks=48, scale=1.0, num_speculative_tokens=2, **shape)
    layer = built[0]
    requests = [(40, 3), (300, 3), (90, 2), (12, 12)]
    b = h.batch(requests, num_blocks=48, rng=rng, **shape)
    md = h.builder(vc, built, 16).build(0, b.cm)
    assert (md.num_decodes, md.decode_q_len) == (2, 3)
    config = layer.impl.decoder.config
    assert (config.impl, config.max_q_len) == ("simt", 3)
    out = h.forward(vc, built, md, b)[0]
    for r in range(2):
        h.check_decode(layer, b, out, r, f"512 verification request {r}")
    for r in range(2, len(requests)):
        h.check_prefill(layer, b, out, r, f"512 prefill request {r}")


def test_vllms_conventions_map_exactly():
    assert options.window_left(None) == -1 and options.window_left(1) == 0 and options.window_left(4096) == 4095
    assert options.soft_cap(None) is None and options.soft_cap(0) is None and options.soft_cap(0.0) is None
    assert options.soft_cap(30) == 30.0
    assert options.kv_dtype("auto", "bfloat16") == "bfloat16" and options.kv_dtype("fp8", "float16") == "fp8_e4m3"
    assert options.decode_q_len(None, batch_invariant=False) == 1
    assert options.decode_q_len(3, batch_invariant=False) == 4
    assert options.decode_q_len(7, batch_invariant=False) == 8
    assert options.decode_q_len(8, batch_invariant=False) == 1  # 9 query tokens: past our multi-token decode
    assert options.decode_q_len(3, batch_invariant=True) == 1


# -- one batch, routed ---------------------------------------------------------------------


def _model(tmp_path, rng, *, layout=KVCacheLayout.LBNHC, count=2, block_size=16, num_blocks=128, **config):
    layer_options = {k: config.pop(k) for k in ("sliding_window", "logits_soft_cap", "sinks", "scale") if k in config}
    shape = {k: config[k] for k in ("num_heads", "num_kv_heads", "head_size") if k in config}
    vc = h.config(tmp_path, block_size=block_size, **config)
    built = h.layers(vc, count, **shape, **layer_options)
    for layer in built:
        h.allocate_kv_cache(layer, num_blocks, block_size, layout, rng)
    return vc, built


def test_a_mixed_batch_runs_its_decodes_on_metrale_and_its_prefills_on_vllms_backend(tmp_path):
    """Speculative decoding with 2 draft tokens: three verification requests of 3 tokens
    (ours, multi-token decode), a verification request whose drafts came up short (2 tokens:
    the batch is no longer uniform past it), a chunked prefill (20 new tokens on 30 of
    context) and a fresh prompt (12): the first three on our kernels, the rest on vLLM's
    prefill backend, in one forward per layer; every token against float64."""
    rng = np.random.default_rng(0)
    vc, built = _model(tmp_path, rng, num_speculative_tokens=2)
    requests = [(40, 3), (17, 3), (300, 3), (90, 2), (50, 20), (12, 12)]
    b = h.batch(requests, rng=rng)
    md = h.builder(vc, built, 16).build(0, b.cm)
    assert (md.num_decodes, md.decode_q_len, md.prefill_start) == (3, 3, 9)
    outs = h.forward(vc, built, md, b)
    assert [(name, rows, starts, lens) for name, rows, starts, lens in h.PREFILL_CALLS] == [
        (layer.layer_name, 34, [0, 2, 22, 34], [90, 50, 12]) for layer in built]
    for layer, out in zip(built, outs):
        for r in range(3):
            h.check_decode(layer, b, out, r, f"{layer.layer_name} decode request {r}")
        for r in range(3, len(requests)):
            h.check_prefill(layer, b, out, r, f"{layer.layer_name} prefill request {r}")


def test_a_batch_of_only_decodes_never_touches_the_prefill_backend(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    vc, built = _model(tmp_path, rng)
    builder = h.builder(vc, built, 16)
    monkeypatch.setattr(builder.prefill_builder, "build", lambda *a, **k: pytest.fail("prefill metadata built"))
    b = h.batch([(700, 1), (1, 1), (33, 1), (16, 1), (17, 1)], rng=rng)
    md = builder.build(0, b.cm)
    assert md.prefill is None and md.num_decodes == 5
    outs = h.forward(vc, built, md, b)
    assert h.PREFILL_CALLS == []
    for layer, out in zip(built, outs):
        for r in range(5):
            h.check_decode(layer, b, out, r, f"{layer.layer_name} request {r}")


@pytest.mark.parametrize("speculative, batch_invariant, dbo, support", [
    (None, False, False, "UNIFORM_BATCH"), (2, False, False, "UNIFORM_BATCH"), (7, False, False, "UNIFORM_BATCH"),
    (8, False, False, "UNIFORM_SINGLE_TOKEN_DECODE"), (2, True, False, "UNIFORM_SINGLE_TOKEN_DECODE"),
    (2, False, True, "UNIFORM_SINGLE_TOKEN_DECODE"), (None, False, True, "UNIFORM_BATCH"),
])
def test_full_cuda_graphs_are_declared_only_for_the_uniform_batches_we_decode(tmp_path, monkeypatch, speculative,
                                                                              batch_invariant, dbo, support):
    """vLLM captures uniform batches of 1 + speculative tokens per request. Past our
    multi-token decode (8), in batch-invariant mode (verification on the prefill backend) or
    with micro-batching (which can cut a verification request in two), such a batch would
    run the prefill backend on per-step metadata: only single-token decode graphs then."""
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1" if batch_invariant else "0")
    vc = h.config(tmp_path, num_speculative_tokens=speculative)
    vc.parallel_config.enable_dbo = dbo
    layer = h.layers(vc, 1)[0]
    found = h.builder(vc, [layer], 16).get_cudagraph_support(vc, h.spec_of(layer, 16))
    assert found is getattr(AttentionCGSupport, support)


def test_a_padded_cuda_graph_bucket_replays_after_seq_lens_and_block_tables_change_in_place(tmp_path):
    """vLLM pads a uniform decode batch to its graph's bucket (padding requests: no query
    tokens, seq_len 0, null-block rows). Our metadata holds views of the persistent seq_lens
    and block table, so the captured launch reads them again: after they change in place
    (the next step's lengths and a new page), the same metadata gives the next step's
    outputs. The real rows' bytes are those of the unpadded batch."""
    rng = np.random.default_rng(2)
    vc, built = _model(tmp_path, rng, num_speculative_tokens=2, count=1)
    layer = built[0]
    builder = h.builder(vc, built, 16)
    requests = [(40, 3), (31, 3), (200, 3)]
    padded = h.batch(requests, rng=rng, pad_to=8)
    md = builder.build_for_cudagraph_capture(padded.cm)
    assert (md.num_decodes, md.decode_q_len, md.prefill) == (8, 3, None)
    # What the captured launch reads is vLLM's persistent buffers themselves, not per-step copies.
    assert md.seq_lens.data_ptr() == padded.cm.seq_lens.data_ptr()
    assert md.block_table.data_ptr() == padded.cm.block_table_tensor.data_ptr()
    out = h.forward(vc, built, md, padded)[0]
    for r in range(3):
        h.check_decode(layer, padded, out, r, f"padded bucket, request {r}")
    assert not out[9:24].float().any(), "padding rows must be zeros"

    alone = h.Batch(dataclasses.replace(padded.cm, query_start_loc=padded.cm.query_start_loc[:4],
                                        query_start_loc_cpu=padded.cm.query_start_loc_cpu[:4],
                                        seq_lens=padded.cm.seq_lens[:3], num_reqs=3, num_actual_tokens=9,
                                        block_table_tensor=padded.cm.block_table_tensor[:3],
                                        slot_mapping=torch.full((9,), -1, dtype=torch.int64)),
                    padded.seq_lens, padded.query_lens, padded.block_table, padded.qkv[:9], 4, 2, 64)
    unpadded = h.forward(vc, built, builder.build(0, alone.cm), alone)[0]
    assert torch.equal(unpadded.view(torch.int16), out[:9].view(torch.int16))

    # The next step, written in place: each request's seq_len moves on by 3 tokens (new pages
    # where it crosses into one) in the same persistent seq_lens and block table.
    grown = [(50, 3), (34, 3), (203, 3)]
    free = sorted(set(range(1, 128)) - set(padded.block_table.flatten().tolist()))
    for r, (seq_len, _) in enumerate(grown):
        for page in range(-(-padded.seq_lens[r] // 16), -(-seq_len // 16)):
            padded.block_table[r, page] = free.pop()
    padded.cm.seq_lens[:3] = torch.tensor([s for s, _ in grown], dtype=torch.int32)
    padded.cm.slot_mapping[:9] = torch.tensor([int(padded.block_table[r, p // 16]) * 16 + p % 16
                                               for r, (s, q) in enumerate(grown) for p in range(s - q, s)])
    step2 = dataclasses.replace(padded, seq_lens=[s for s, _ in grown])
    out2 = h.forward(vc, built, md, step2)[0]  # the captured metadata, unchanged
    for r in range(3):
        h.check_decode(layer, step2, out2, r, f"replayed bucket, request {r}")


@pytest.mark.parametrize("layout", list(ours.LAYOUTS), ids=lambda layout: layout.name)
def test_every_kv_cache_layout_vllm_allocates_is_read_in_place(tmp_path, layout, monkeypatch):
    """Each ``KVCacheLayout`` vLLM 0.33 allocates, through the same call: the kernels get the
    K and V halves of vLLM's cache, its block table, seq_lens, the strided q inside the
    fused qkv and the output itself, as views (same addresses), never copies."""
    rng = np.random.default_rng(3)
    vc, built = _model(tmp_path, rng, layout=layout, count=1)
    layer = built[0]
    b = h.batch([(70, 1), (5, 1), (129, 1)], rng=rng)
    md = h.builder(vc, built, 16).build(0, b.cm)
    seen = []
    decode = ModelAttention.decode
    monkeypatch.setattr(ModelAttention, "decode", staticmethod(lambda *a, **k: seen.append(a) or decode(*a, **k)))
    out = h.forward(vc, built, md, b)[0]
    for r in range(3):
        h.check_decode(layer, b, out, r, f"{layout.name} request {r}")
    (_, q, k_cache, v_cache, block_tables, seq_lens, out_arg), = seen
    item = layer.kv_cache.element_size()
    assert k_cache.data_ptr() == layer.kv_cache.data_ptr()
    assert v_cache.data_ptr() == layer.kv_cache.data_ptr() + 64 * item
    assert block_tables.data_ptr() == b.cm.block_table_tensor.data_ptr()
    assert seq_lens.data_ptr() == b.cm.seq_lens.data_ptr()
    assert q.data_ptr() == b.qkv.data_ptr() and q.stride(0) == b.qkv.stride(0)  # q inside the fused qkv
    assert out_arg.data_ptr() == out.data_ptr()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_on_the_host_the_kv_cache_update_follows_reshape_and_cache_flashs_semantics(tmp_path, kv_cache_dtype):
    """On a GPU the step's K and V go in by vLLM's own kernel (the prefill impl's
    ``do_kv_cache_update``); on the host by a torch write with its semantics, pinned here:
    slot -> (block, offset), negative slots skipped, fp8 as ``x / scale`` rounded to e4m3
    with saturation."""
    rng = np.random.default_rng(4)
    vc, built = _model(tmp_path, rng, count=1, kv_cache_dtype=kv_cache_dtype)
    layer = built[0]
    layer._k_scale_float, layer._v_scale_float = 0.02, 0.03
    cache = layer.kv_cache
    before = cache.clone()
    key = torch.randn(5, 2, 64).to(torch.bfloat16) * 3
    value = torch.randn(5, 2, 64).to(torch.bfloat16) * 3
    key[0, 0, 0] = 1e4  # beyond e4m3's range after the scale: saturates to 448
    slots = torch.tensor([3 * 16 + 5, -1, 7 * 16 + 0, 7 * 16 + 15, 100 * 16 + 2])
    layer.impl.do_kv_cache_update(layer, key, value, cache, slots)
    expected = before.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for half, (x, scale) in enumerate(((key[i], 0.02), (value[i], 0.03))):
            if kv_cache_dtype == "fp8":
                x = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
            expected[slot // 16, :, slot % 16, half * 64:(half + 1) * 64] = x
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    if kv_cache_dtype == "fp8":
        assert cache[3, 0, 5, 0].view(torch.float8_e4m3fn).float() == 448.0


def test_vllms_sliding_window_counts_the_current_token(tmp_path):
    """vLLM's ``sliding_window=W`` attends to the last W positions, the current one included:
    our ``window_left = W - 1``. The output matches the reference at W - 1 and not at W."""
    rng = np.random.default_rng(5)
    W = 32
    vc, built = _model(tmp_path, rng, count=1, sliding_window=W)
    layer = built[0]
    assert layer.impl.window_left == W - 1
    b = h.batch([(200, 1), (33, 1), (32, 1), (31, 1), (90, 12)], rng=rng)
    md = h.builder(vc, built, 16).build(0, b.cm)
    out = h.forward(vc, built, md, b)[0]
    for r in range(4):
        h.check_decode(layer, b, out, r, f"window {W}, request {r}")
    h.check_prefill(layer, b, out, 4, "window prefill")
    layer.impl.window_left = W  # one token too many: the reference of the other convention disagrees
    with pytest.raises(AssertionError):
        h.check_decode(layer, b, out, 0, "window W")


def test_soft_cap_sinks_and_fp8_scales_pass_through_exactly(tmp_path):
    """Gemma's ``logits_soft_cap`` (0 means off), gpt-oss's sinks (a float32 copy made once
    from the layer's parameter) and the layer's fp8 scales (vLLM keeps each as an fp32 tensor,
    ``_k_scale``, which our kernels read on the device, and its float, ``_k_scale_float``,
    which the prefill backend and the host cache write take), on decode and prefill tokens
    alike."""
    rng = np.random.default_rng(6)
    sinks = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0, float("-inf")]).to(torch.bfloat16), requires_grad=False)
    vc, built = _model(tmp_path, rng, count=1, kv_cache_dtype="fp8", logits_soft_cap=30.0, sinks=sinks)
    layer = built[0]
    layer._k_scale_float, layer._v_scale_float = 0.5, 0.25
    layer._k_scale.fill_(0.5), layer._v_scale.fill_(0.25)  # as vLLM's kv-cache quantization sets both
    assert layer.impl.logits_soft_cap == 30.0 and layer.impl.kv_dtype == "fp8_e4m3"
    b = h.batch([(300, 1), (17, 1), (40, 9)], rng=rng)
    md = h.builder(vc, built, 16).build(0, b.cm)
    assert layer.impl._sinks.dtype == torch.float32
    out = h.forward(vc, built, md, b)[0]
    for r in range(2):
        h.check_decode(layer, b, out, r, f"cap+sinks+fp8 request {r}")
    h.check_prefill(layer, b, out, 2, "cap+sinks+fp8 prefill")
    no_cap = h.config(tmp_path / "nocap")
    assert h.layers(no_cap, 1, logits_soft_cap=0.0)[0].impl.logits_soft_cap is None


def test_a_512_wide_layer_with_an_fp8_cache_decodes_within_the_bar_reading_its_scales_on_the_device(tmp_path):
    """Gemma 4's global layer (8 q / 1 KV heads at 512, TP 2) with ``--kv-cache-dtype fp8``: the
    reference kernels read the layer's ``_k_scale``/``_v_scale`` tensors (``device_scales``) as
    the mma kernels do at 64..256; decodes within 1 ulp of float64, the prefill on Triton."""
    rng = np.random.default_rng(17)
    shape = dict(num_heads=8, num_kv_heads=1, head_size=512)
    vc, built = _model(tmp_path, rng, count=1, num_blocks=32, kv_cache_dtype="fp8", scale=1.0, **shape)
    layer = built[0]
    layer._k_scale_float, layer._v_scale_float = 0.5, 0.25
    layer._k_scale.fill_(0.5), layer._v_scale.fill_(0.25)
    b = h.batch([(300, 1), (17, 1), (24, 6)], num_blocks=32, rng=rng, **shape)
    md = h.builder(vc, built, 16).build(0, b.cm)
    out = h.forward(vc, built, md, b)[0]
    config = layer.impl.decoder.config
    assert (config.impl, config.kv_dtype, config.device_scales) == ("simt", "fp8", True)
    for r in range(2):
        h.check_decode(layer, b, out, r, f"512 fp8 request {r}")
    h.check_prefill(layer, b, out, 2, "512 fp8 prefill")


def test_with_flashattention_present_model_dtype_caches_prefill_on_it_and_its_scheduler_sees_every_window(
        tmp_path, monkeypatch):
    """Where FlashAttention is present (any GPU install; not this machine, so its presence is
    stood in for) a bf16 cache prefills on FlashAttention, through its own metadata builder;
    its ahead-of-time scheduler (FA3) reads every layer's window through
    ``get_impl_variants``, which lists the FlashAttention impl inside ours; fp8 caches stay
    on Triton."""
    from vllm.v1.attention.backends import fa_utils
    from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                                       FlashAttentionMetadata, _get_sliding_window_configs)

    monkeypatch.setattr(fa_utils, "is_flash_attn_varlen_func_available", lambda: True)
    monkeypatch.setattr(FlashAttentionImpl, "forward", h.cpu_prefill_forward)
    assert ours.prefill_backend(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto") is FlashAttentionBackend
    assert ours.prefill_backend(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="fp8") is not FlashAttentionBackend
    rng = np.random.default_rng(11)
    vc, built = _model(tmp_path, rng, sliding_window=64, num_speculative_tokens=2)
    assert all(isinstance(layer.impl.prefill_impl, FlashAttentionImpl) for layer in built)
    assert _get_sliding_window_configs(vc) == {(63, 0)}
    requests = [(90, 3), (40, 3), (200, 20), (30, 30)]
    b = h.batch(requests, rng=rng)
    md = h.builder(vc, built, 16).build(0, b.cm)
    assert isinstance(md.prefill, FlashAttentionMetadata) and md.num_decodes == 2
    outs = h.forward(vc, built, md, b)
    for layer, out in zip(built, outs):
        for r in range(2):
            h.check_decode(layer, b, out, r, f"{layer.layer_name} decode {r}")
        for r in range(2, 4):
            h.check_prefill(layer, b, out, r, f"{layer.layer_name} FlashAttention prefill {r}")


def test_a_weight_reload_refreshes_the_kernels_sinks_in_place(tmp_path):
    """vLLM reloads weights in place (RL weight syncs) and calls process_weights_after_loading
    again: the float32 sinks our kernels read are updated where a captured graph reads them."""
    rng = np.random.default_rng(12)
    sinks = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.bfloat16), requires_grad=False)
    vc, built = _model(tmp_path, rng, count=1, sinks=sinks)  # bf16, as a bf16 checkpoint loads them: a copy
    layer = built[0]
    builder = h.builder(vc, built, 16)
    before = layer.impl._sinks.data_ptr()
    with torch.no_grad():
        sinks.copy_(torch.tensor([3.0, 1.0, -2.0, float("-inf")]))
    layer.process_weights_after_loading(torch.bfloat16)
    assert layer.impl._sinks.data_ptr() == before and torch.equal(layer.impl._sinks, sinks.detach().float())
    b = h.batch([(120, 1), (9, 1)], rng=rng)
    out = h.forward(vc, built, builder.build(0, b.cm), b)[0]
    for r in range(2):
        h.check_decode(layer, b, out, r, f"reloaded sinks, request {r}")


def test_a_cache_whose_v_head_size_differs_from_ks_is_refused_when_the_builder_is_made(tmp_path):
    import dataclasses as dc

    vc = h.config(tmp_path)
    layer = h.layers(vc, 1)[0]
    spec = dc.replace(h.spec_of(layer, 16), head_size_v=128)
    with pytest.raises(ValueError, match="V's head size to equal K's, got 128 and 64"):
        ours.MetraleMetadataBuilder(spec, [layer.layer_name], vc, torch.device("cpu"))


def test_one_torch_workspace_serves_every_layer_and_exists_before_the_kv_cache(tmp_path):
    """The model's one split-K workspace is a torch tensor allocated when the weights are
    loaded (before vLLM profiles memory and sizes the KV cache), sized by
    ``workspace_bytes`` over the model's layer shapes, and every layer's object uses it."""
    rng = np.random.default_rng(7)
    vc = h.config(tmp_path, max_num_seqs=16)
    built = h.layers(vc, 3)
    model = built[0].impl.model
    assert all(layer.impl.model is model for layer in built)
    workspace = model._workspace
    assert isinstance(workspace, torch.Tensor) and workspace.dtype == torch.uint8
    assert workspace.numel() == workspace_bytes([(4, 2, 64)], max_batch=16, backend="cpu")
    for layer in built:
        h.allocate_kv_cache(layer, 64, 16, KVCacheLayout.LBNHC, rng)
    h.builder(vc, built, 16)
    for layer in built:
        assert layer.impl.decoder.workspace is workspace
    assert model._workspace is workspace  # it never moved


def _tp_slice_outputs(tmp_path, tp: int, q_full, kv_full, b_full, rng_seed: int):
    """Llama-3-70B's attention (64 q heads, 8 kv heads, head dim 128) on rank 0..tp-1 of a
    tp-way split: each rank's layer has 64/tp heads and 8/tp kv heads, and its cache holds
    its kv heads of the full cache. Returns the ranks' outputs concatenated by head."""
    H, KV, D = 64 // tp, 8 // tp, 128
    outs = []
    for rank in range(tp):
        rng = np.random.default_rng(rng_seed)
        vc, built = _model(tmp_path / f"tp{tp}-{rank}", rng, count=1, num_heads=H, num_kv_heads=KV, head_size=D,
                           num_blocks=32)
        layer = built[0]
        layer.kv_cache.copy_(kv_full[:, rank * KV:(rank + 1) * KV])
        qkv = torch.cat([q_full[:, rank * H * D:(rank + 1) * H * D],
                         torch.zeros(q_full.shape[0], 2 * KV * D, dtype=q_full.dtype)], dim=1)
        b = dataclasses.replace(b_full, qkv=qkv, num_heads=H, num_kv_heads=KV,
                                cm=dataclasses.replace(b_full.cm, slot_mapping=torch.full_like(b_full.cm.slot_mapping, -1)))
        md = h.builder(vc, built, 16).build(0, b.cm)
        outs.append(h.forward(vc, built, md, b)[0])
    return torch.cat(outs, dim=1)


def test_tensor_parallel_slices_of_llama_3_70b_give_each_head_the_full_models_bytes_when_pinned(tmp_path, monkeypatch):
    """One process per rank, each with ``num_heads / tp`` heads: with the split count pinned
    (``METRALE_ATTN_DECODE_SPLITK=4``), every head's output bytes at tp 2 and tp 4 equal
    the full model's. (Under ``auto`` the split count follows the heads per rank, so bytes
    may differ between degrees, within the bar: the README says so.)"""
    monkeypatch.setenv("METRALE_ATTN_DECODE_SPLITK", "4")
    rng = np.random.default_rng(8)
    vc, built = _model(tmp_path / "tp1", rng, count=1, num_heads=64, num_kv_heads=8, head_size=128, num_blocks=32)
    layer = built[0]
    b = h.batch([(300, 1), (45, 1)], num_heads=64, num_kv_heads=8, head_size=128, num_blocks=32, rng=rng)
    b = dataclasses.replace(b, cm=dataclasses.replace(b.cm, slot_mapping=torch.full_like(b.cm.slot_mapping, -1)))
    md = h.builder(vc, built, 16).build(0, b.cm)
    assert layer.impl.decoder.plan(2).num_splits == 4
    full = h.forward(vc, built, md, b)[0]
    for r in range(2):
        h.check_decode(layer, b, full, r, f"tp1 request {r}")
    q_full = b.split()[0].contiguous()
    for tp in (2, 4):
        sliced = _tp_slice_outputs(tmp_path, tp, q_full, layer.kv_cache, b, 8)
        assert torch.equal(sliced[:2].view(torch.int16), full[:2].view(torch.int16)), f"tp={tp}"


def test_a_layers_forward_compiles_with_fullgraph(tmp_path):
    """``torch.compile(fullgraph=True)`` of vLLM's ``Attention.forward`` on our backend, under
    vLLM's forward context: no graph break, our part one opaque node
    (``torch.ops.metrale_attn.paged_decode``), and the outputs meet the bar. This platform
    takes vLLM's direct-call path, which traces into the impl; on CUDA vLLM wraps the whole
    attention in its own opaque op (``unified_attention_with_output``), inside which ours runs
    eagerly or in a captured graph."""
    from vllm.forward_context import set_forward_context

    rng = np.random.default_rng(9)
    vc, built = _model(tmp_path, rng, count=1)
    layer = built[0]
    b = h.batch([(70, 1), (5, 1), (129, 1)], rng=rng)
    md = h.builder(vc, built, 16).build(0, b.cm)
    compiled = torch.compile(lambda q, k, v: layer(q, k, v), fullgraph=True, backend="aot_eager")
    with set_forward_context({layer.layer_name: md}, vc, slot_mapping={layer.layer_name: b.cm.slot_mapping}):
        out = compiled(*b.split()).view(-1, 4, 64)
    for r in range(3):
        h.check_decode(layer, b, out, r, f"compiled request {r}")


def test_gemma_4s_global_layer_at_head_size_512_decodes_within_the_bar_with_softmax_scale_1(tmp_path):
    """One rank's share at TP 2 of Gemma-4-26B-A4B's global layer (8 q / 1 KV heads, head size
    512, softmax scale 1.0: q and k are RMS-normed) through vLLM's ``Attention`` and our
    backend: the decodes on our reference kernels within 1 ulp of float64, the prefill on
    vLLM's Triton backend (FlashAttention takes no 512 without FA4)."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    rng = np.random.default_rng(13)
    shape = dict(num_heads=8, num_kv_heads=1, head_size=512)
    vc, built = _model(tmp_path, rng, count=2, num_blocks=32, scale=1.0, **shape)
    assert all(layer.impl.prefill_backend is TritonAttentionBackend for layer in built)
    requests = [(70, 1), (5, 1), (129, 1), (24, 8)]
    b = h.batch(requests, num_blocks=32, rng=rng, **shape)
    md = h.builder(vc, built, 16).build(0, b.cm)
    assert md.num_decodes == 3 and all(layer.impl.decoder.config.sm_scale == 1.0 for layer in built)
    outs = h.forward(vc, built, md, b)
    for layer, out in zip(built, outs):
        assert layer.impl.decoder.config.impl == "simt"
        for r in range(3):
            h.check_decode(layer, b, out, r, f"{layer.layer_name} head size 512 decode {r}")
        h.check_prefill(layer, b, out, 3, f"{layer.layer_name} head size 512 prefill")
