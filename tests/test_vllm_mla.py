"""metrale-attn as vLLM 0.33's MLA backend (``METRALE_ATTN_MLA``) on the CPU: selection for
DeepSeek-V3 / Kimi-K2 / DeepSeek-V2-Lite configs, the refusals, and whole forwards of vLLM's own
``MLAAttention`` layer (its cache write, its W_UK absorption, its metadata builder, its CPU MLA
prefill backend for prefill tokens) with every decode row's latent output held to our 1-ulp bar
of the float64 reference. Needs vLLM: skipped where it is not installed, except in CI's vLLM venv
(``METRALE_ATTN_REQUIRE_VLLM=1``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from support.optional import import_vllm

vllm = import_vllm()

import torch  # noqa: E402  (after the skip: vLLM brings its torch)
import vllm.model_executor.layers.attention.mla_attention as vllm_mla  # noqa: E402
import vllm.utils.torch_utils as vllm_torch_utils  # noqa: E402
from vllm.config import AttentionConfig, ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport  # noqa: E402
from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

import vllm_harness as h  # noqa: E402
from metrale_attn import hf_config, reference, tolerance  # noqa: E402
from metrale_attn.integrations.vllm import mla as ours  # noqa: E402
from metrale_attn.integrations.vllm import options  # noqa: E402
from metrale_attn.torch_op import to_numpy  # noqa: E402

HOPPER = DeviceCapability(9, 0)
FIXTURES = Path(__file__).parent / "hf_configs"
MLA_MODELS = ("deepseek-v3.json", "kimi-k2-instruct.json", "deepseek-v2-lite.json")
TP = 8  # a rank's heads: DeepSeek-V3 16, Kimi-K2 8 (V2-Lite's 16 stay whole)
BACKEND = AttentionBackendEnum["METRALE_ATTN_MLA"].get_class()


@pytest.fixture(autouse=True)
def _cpu_host_buffers(monkeypatch):
    """vLLM's MLA builder pins its host buffers where it thinks a GPU is (and so does its copy of a
    prefill's chunked-context bounds to the device); this machine has none."""
    monkeypatch.setattr(vllm_mla, "PIN_MEMORY", False)
    monkeypatch.setattr(vllm_torch_utils, "PIN_MEMORY", False)


def _vllm_config(tmp_path, fixture: str = "deepseek-v3.json", *, kv_cache_dtype: str = "auto",
                 num_speculative_tokens=None, block_size: int = 16) -> VllmConfig:
    """A ``VllmConfig`` of the checkpoint's ``config.json`` (weights are never read; its fp8 weight
    quantization is dropped, which concerns the linear layers, not attention), ``--attention-backend
    METRALE_ATTN_MLA``, on the CPU device."""
    config = json.loads((FIXTURES / fixture).read_text())
    config.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096)
    return h.cpu_config(model, block_size=block_size, num_speculative_tokens=num_speculative_tokens,
                        kv_cache_dtype=kv_cache_dtype,
                        attention_config=AttentionConfig(backend=AttentionBackendEnum["METRALE_ATTN_MLA"]))


class _KvBProj(torch.nn.Module):
    """An unquantized ``kv_b_proj`` (latent 512 -> per head nope + v), as ``split_kv_b_proj`` reads it."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.quant_method = None

    def forward(self, x):
        return x @ self.weight.T, None


def _layers(vc: VllmConfig, count: int = 1, *, seed: int = 0) -> list:
    """``count`` vLLM ``MLAAttention`` layers of the model's shape at TP 8, on our backend, with vLLM's
    CPU MLA prefill backend (the platform's own choice on a CPU), weights "loaded"."""
    text = vc.model_config.hf_text_config
    heads = max(text.num_attention_heads // TP, 1) if text.num_attention_heads > 16 else text.num_attention_heads
    scale = hf_config.load(FIXTURES / _fixture_of(vc)).kinds[0].sm_scale
    gen = torch.Generator().manual_seed(seed)
    built = []
    with set_current_vllm_config(vc), set_default_torch_dtype(torch.bfloat16):
        for i in range(count):
            weight = torch.randn(heads * (text.qk_nope_head_dim + text.v_head_dim), text.kv_lora_rank, generator=gen)
            layer = vllm_mla.MLAAttention(
                num_heads=heads, scale=scale, qk_nope_head_dim=text.qk_nope_head_dim,
                qk_rope_head_dim=text.qk_rope_head_dim, v_head_dim=text.v_head_dim, q_lora_rank=text.q_lora_rank,
                kv_lora_rank=text.kv_lora_rank, kv_b_proj=_KvBProj((weight / 16).to(torch.bfloat16)),
                cache_config=vc.cache_config, prefix=f"model.layers.{i}.self_attn.attn", attn_backend=BACKEND,
                prefill_backend_cls=CPUSDPAMLAPrefillBackend)
            layer.process_weights_after_loading(torch.bfloat16)
            built.append(layer)
    return built


def _fixture_of(vc: VllmConfig) -> str:
    model_type = vc.model_config.hf_config.model_type
    return {"deepseek_v3": "deepseek-v3.json", "kimi_k2": "kimi-k2-instruct.json",
            "deepseek_v2": "deepseek-v2-lite.json"}[model_type]


def _allocate(layer, num_blocks: int, block_size: int, rng: np.random.Generator) -> torch.Tensor:
    """The layer's latent cache as vLLM allocates it (logical ``[blocks, 1, block_size, 576]`` bound
    through ``bind_kv_cache``, which drops the head dim), random values (fp8: finite bits)."""
    spec = layer.get_kv_cache_spec(layer._vllm_config)
    shape = (num_blocks, 1, block_size, spec.head_size)
    if spec.dtype == torch.uint8:
        bits = rng.integers(0, 0x7f, shape, dtype=np.uint8) | (rng.integers(0, 2, shape, dtype=np.uint8) << 7)
        cache = torch.from_numpy(bits)
    else:
        cache = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(spec.dtype)
    layer.bind_kv_cache(cache)
    return layer.kv_cache


def _builder(vc, built, block_size: int):
    spec = built[0].get_kv_cache_spec(vc)
    with set_current_vllm_config(vc):
        return BACKEND.get_builder_cls()(spec, [layer.layer_name for layer in built], vc, torch.device("cpu"))


def _spy_on_decode(monkeypatch) -> list:
    """Every ``forward_mqa`` call's (layer, latent q [rows, H, 576] float, latent out), recorded."""
    calls = []
    real = ours.MetraleMLAImpl.forward_mqa

    def spy(self, q, cache, md, layer):
        out, lse = real(self, q, cache, md, layer)
        joined = torch.cat(q, dim=-1) if isinstance(q, tuple) else q
        calls.append((layer, joined.clone(), out.clone()))
        return out, lse

    monkeypatch.setattr(ours.MetraleMLAImpl, "forward_mqa", spy)
    return calls


def _record_prefills(monkeypatch) -> list:
    """Every ``forward_mha`` call's (rows, its requests' query lengths, whether it reads a cached
    context), recorded; its output rows zeroed instead of computed: vLLM's MLA prefill over a cached
    context (a verification request whose drafts came up short has one) runs CUDA and Triton ops
    (``gather_and_maybe_dequant_cache``, ``merge_attn_states``) with no host path, and what is ours
    is which rows reach it."""
    calls = []

    def record(self, q, kv_c_normed, k_pe, cache, md, k_scale, output, output_scale=None):
        calls.append((q.shape[0], md.prefill.query_lens_cpu.tolist(), md.prefill.chunked_context is not None))
        output.zero_()

    monkeypatch.setattr(ours.MetraleMLAImpl, "forward_mha", record)
    return calls


def _forward(vc, built, md, b: h.Batch, rng: np.random.Generator) -> list[torch.Tensor]:
    """Each layer's ``MLAAttention.forward`` under vLLM's forward context: the step's latent rows written
    to the cache, prefill tokens on vLLM's MLA prefill, decode tokens through ``forward_mqa``."""
    tokens = b.cm.num_actual_tokens
    text = vc.model_config.hf_text_config
    names = [layer.layer_name for layer in built]
    outs = []
    with set_forward_context({n: md for n in names}, vc, slot_mapping={n: b.cm.slot_mapping for n in names}):
        for layer in built:
            q = torch.from_numpy(rng.standard_normal((tokens, layer.num_heads, layer.qk_head_dim), dtype=np.float32))
            kv_c = torch.from_numpy(rng.standard_normal((tokens, text.kv_lora_rank), dtype=np.float32))
            k_pe = torch.from_numpy(rng.standard_normal((tokens, 1, text.qk_rope_head_dim), dtype=np.float32))
            outs.append(layer(q.to(torch.bfloat16), kv_c.to(torch.bfloat16), k_pe.to(torch.bfloat16),
                              output_shape=(tokens, layer.num_heads * layer.v_head_dim)))
    return outs


def _check_decode_rows(layer, b: h.Batch, q: torch.Tensor, out: torch.Tensor, rows: int, what: str,
                       q_len: int = 1) -> None:
    """The latent output of the first ``rows`` requests' ``q_len`` tokens each (request-major) within
    our 1-ulp bar of float64 over the layer's cache as it is now (this step's rows written), token
    ``t`` of a request of ``L`` keys over keys ``0..L-q_len+t`` only: keys the 576-dim rows, values
    their first 512 dims, fp8 values times the layer's scale (the bar of ``tests/test_mla.py``, the
    logit-scaled near-zero allowance included)."""
    cache = to_numpy(layer.kv_cache)
    if layer.impl.fp8:
        cache = cache.view(reference_fp8_dtype())
    k_cache = cache[:, :, None, :]  # NHD, one latent head
    v_cache = k_cache[..., :ours.V_HEAD_DIM]
    scale = layer._k_scale_float if layer.impl.fp8 else 1.0
    # one reference row a query token: its request's pages, its own causal prefix
    tables = np.repeat(b.cm.block_table_tensor[:rows].numpy(), q_len, axis=0)
    lens = (np.repeat(np.array(b.seq_lens[:rows], np.int32), q_len) - (q_len - 1)
            + np.tile(np.arange(q_len, dtype=np.int32), rows))
    q = to_numpy(q)
    ref = reference.paged_decode(q, k_cache, v_cache, tables, lens, kv_layout="NHD", sm_scale=layer.scale,
                                 v_head_dim=ours.V_HEAD_DIM, k_scale=scale, v_scale=scale)
    v_absmax = reference.max_abs_v_read(v_cache, tables, lens, kv_layout="NHD", v_scale=scale)
    # The bar's near-zero allowance grows with the logits (large with fp8 caches' random bits), as test_mla's
    logits = lambda: reference.max_abs_logit(q, k_cache, tables, lens, kv_layout="NHD", sm_scale=layer.scale,  # noqa: E731
                                             k_scale=scale)
    tolerance.assert_close_to_reference(to_numpy(out), ref, v_absmax=v_absmax, logit_absmax=logits, what=what)


def reference_fp8_dtype():
    import ml_dtypes

    return ml_dtypes.float8_e4m3fn


def _selector_reasons(backend=BACKEND, capability=HOPPER, **changes) -> list[str]:
    """What vLLM's CUDA platform asks of the backend ``--attention-backend`` names for an MLA layer
    (``CudaPlatformBase.get_attn_backend_cls``): ``validate_configuration`` with the selector's fields."""
    from vllm.v1.attention.selector import AttentionSelectorConfig

    config = dict(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None, use_mla=True)
    config.update(changes)
    return backend.validate_configuration(device_capability=capability, **AttentionSelectorConfig(**config)._asdict())


# -- selection -------------------------------------------------------------------------------


def test_the_plugin_registers_METRALE_ATTN_MLA_beside_METRALE_ATTN_and_it_resolves_to_our_mla_backend():
    assert AttentionBackendEnum["METRALE_ATTN_MLA"].get_class() is ours.MetraleMLABackend
    assert ours.MetraleMLABackend.get_name() == "METRALE_ATTN_MLA" and ours.MetraleMLABackend.is_mla()
    assert AttentionBackendEnum["METRALE_ATTN"].get_class().is_mla() is False


@pytest.mark.parametrize("fixture", MLA_MODELS)
def test_vllm_selects_METRALE_ATTN_MLA_for_the_latent_layers_of_deepseek_and_kimi_configs(tmp_path, fixture):
    """vLLM reads the checkpoint's config as MLA of head size 576 (kv_lora_rank 512 + rope 64),
    and our backend is valid for the selector fields its ``MLAAttention`` layers ask with, in
    bf16 and fp8 caches."""
    vc = _vllm_config(tmp_path, fixture)
    assert vc.model_config.use_mla and vc.model_config.get_head_size() == 576
    assert vc.attention_config.backend is AttentionBackendEnum.METRALE_ATTN_MLA
    for kv_cache_dtype in ("auto", "bfloat16", "fp8", "fp8_e4m3"):
        assert _selector_reasons(head_size=vc.model_config.get_head_size(), kv_cache_dtype=kv_cache_dtype) == []


def test_METRALE_ATTN_refuses_an_mla_layer_naming_METRALE_ATTN_MLA():
    found = _selector_reasons(AttentionBackendEnum["METRALE_ATTN"].get_class())
    assert any(r.startswith("MLA not supported by METRALE_ATTN") and "--attention-backend METRALE_ATTN_MLA" in r
               for r in found), found


@pytest.mark.parametrize("changes, reason", [
    (dict(head_size=320), "head_size 320 not supported (metrale-attn MLA: 576, a kv_lora_rank of 512 + a "
                          "qk_rope_head_dim of 64: DeepSeek-V2/V3/R1, Kimi-K2)"),
    (dict(use_mla=False, head_size=128), "non-MLA not supported"),
    (dict(dtype=torch.float32), "dtype torch.float32 not supported (metrale-attn: torch.bfloat16, torch.float16)"),
    (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype fp8_e5m2 not supported (metrale-attn MLA: auto, bfloat16, "
                                      "float16, fp8, fp8_e4m3)"),
    (dict(block_size=8), "block_size 8 not supported (metrale-attn: a multiple of 16"),
    (dict(use_sparse=True), "sparse not supported"),
    (dict(use_dcp=True), "DCP not supported"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_vllms_selector_refuses_what_our_mla_backend_does_not_serve_with_our_reason(changes, reason):
    found = _selector_reasons(**changes)
    assert any(reason in r for r in found), found


def test_a_gpu_our_kernels_do_not_launch_on_is_refused_for_mla_too():
    found = _selector_reasons(capability=DeviceCapability(7, 5))
    assert any(r.startswith("compute capability 7.5 not supported (metrale-attn launches on 8.0") for r in found), found


@pytest.mark.parametrize("speculative, batch_invariant, dbo, support, threshold", [
    (None, False, False, "UNIFORM_BATCH", 1), (2, False, False, "UNIFORM_BATCH", 3),
    (7, False, False, "UNIFORM_BATCH", 8), (8, False, False, "UNIFORM_SINGLE_TOKEN_DECODE", 1),
    (2, True, False, "UNIFORM_SINGLE_TOKEN_DECODE", 1), (2, False, True, "UNIFORM_SINGLE_TOKEN_DECODE", 3),
])
def test_full_cuda_graphs_and_the_reorder_threshold_follow_the_mla_decode_query_length(
        tmp_path, monkeypatch, speculative, batch_invariant, dbo, support, threshold):
    """vLLM captures uniform batches of 1 + speculative tokens a request: full graphs of them where
    they are our decodes (the GQA backend's rule), of single-token decodes where verification is a
    prefill (past 7 speculative tokens, batch-invariant mode) or DBO could cut a request in two.
    vLLM's UNIFORM support raises the reorder threshold to 1 + the speculative tokens; ours is the
    layer's decode query length, which its ``DecodeAttention`` is built for."""
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1" if batch_invariant else "0")
    vc = _vllm_config(tmp_path, num_speculative_tokens=speculative)
    vc.parallel_config.enable_dbo = dbo
    built = _layers(vc)
    builder = _builder(vc, built, 16)
    assert builder.query_len_support is vllm_mla.QueryLenSupport.UNIFORM
    assert builder.get_cudagraph_support(vc, built[0].get_kv_cache_spec(vc)) is getattr(AttentionCGSupport, support)
    assert builder.reorder_batch_threshold == threshold == built[0].impl.decoder.config.max_q_len


# -- forwards through vLLM's MLAAttention -----------------------------------------------------


@pytest.mark.parametrize("fixture, kv_cache_dtype", [("deepseek-v3.json", "auto"), ("kimi-k2-instruct.json", "fp8"),
                                                     ("deepseek-v2-lite.json", "fp8_e4m3")])
def test_a_decode_batch_through_vllms_mla_layer_is_within_one_ulp_of_float64_in_the_latent_space(
        tmp_path, monkeypatch, fixture, kv_cache_dtype):
    """Five decode requests (one token each, lengths across page boundaries) on two layers: vLLM
    writes the step's latent rows, absorbs W_UK into the query and calls our ``forward_mqa``, whose
    latent output (before W_UV) meets the bar against the float64 reference over the cache; fp8
    caches hold e4m3 values of ``value / _k_scale``."""
    rng = np.random.default_rng(3)
    calls = _spy_on_decode(monkeypatch)
    vc = _vllm_config(tmp_path, fixture, kv_cache_dtype=kv_cache_dtype)
    built = _layers(vc, 2)
    for layer in built:
        if options.is_fp8(kv_cache_dtype):
            layer._k_scale.fill_(0.5)
            layer._k_scale_float = 0.5
        _allocate(layer, 64, 16, rng)
    b = h.batch([(700, 1), (1, 1), (33, 1), (16, 1), (17, 1)], num_heads=1, num_kv_heads=1, head_size=64,
                num_blocks=64, rng=rng)
    md = _builder(vc, built, 16).build(0, b.cm)
    assert (md.num_decodes, md.num_prefills) == (5, 0)
    outs = _forward(vc, built, md, b, rng)
    assert [call[0] for call in calls] == built
    for (layer, q, latent), out in zip(calls, outs):
        assert q.shape == (5, layer.num_heads, 576) and latent.shape == (5, layer.num_heads, 512)
        assert layer.impl.decoder.impl == "simt"
        # fp8: the kernels read the layer's scale tensor on the device (a reload that changes it is followed)
        assert layer.impl.decoder.config.device_scales == options.is_fp8(kv_cache_dtype)
        _check_decode_rows(layer, b, q, latent, 5, f"{layer.layer_name} ({kv_cache_dtype})")
        assert torch.isfinite(out).all() and out.shape == (5, layer.num_heads * layer.v_head_dim)


def test_a_mixed_batch_decodes_on_metrale_and_prefills_on_vllms_mla_prefill_backend(tmp_path, monkeypatch):
    """Three decodes then two fresh prompts in one forward: the decode rows go through our
    ``forward_mqa`` (within the bar), the prompts' 20 tokens through vLLM's MLA prefill
    (``forward_mha`` on its CPU SDPA backend) and nowhere else."""
    rng = np.random.default_rng(4)
    calls = _spy_on_decode(monkeypatch)
    prefill_rows = []
    real_mha = ours.MetraleMLAImpl.forward_mha
    monkeypatch.setattr(ours.MetraleMLAImpl, "forward_mha",
                        lambda self, q, *a, **k: prefill_rows.append(q.shape[0]) or real_mha(self, q, *a, **k))
    vc = _vllm_config(tmp_path)
    built = _layers(vc, 1)
    _allocate(built[0], 64, 16, rng)
    b = h.batch([(40, 1), (300, 1), (17, 1), (12, 12), (8, 8)], num_heads=1, num_kv_heads=1, head_size=64,
                num_blocks=64, rng=rng)
    md = _builder(vc, built, 16).build(0, b.cm)
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens) == (3, 2, 3)
    out = _forward(vc, built, md, b, rng)[0]
    assert prefill_rows == [20]
    (layer, q, latent), = calls
    assert q.shape[0] == 3
    _check_decode_rows(layer, b, q, latent, 3, "mixed batch decode rows")
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_on_the_host_the_latent_cache_write_follows_concat_and_cache_mlas_semantics(tmp_path, kv_cache_dtype):
    """Token i's kv_c then k_pe into row ``slot % block_size`` of block ``slot // block_size``;
    slot -1 (padding) writes nothing; fp8 stores ``value / scale`` as e4m3 bits."""
    vc = _vllm_config(tmp_path, kv_cache_dtype=kv_cache_dtype)
    layer = _layers(vc)[0]
    cache = _allocate(layer, 8, 16, np.random.default_rng(5))
    before = cache.clone()
    kv_c = torch.randn(3, 512).to(torch.bfloat16)
    k_pe = torch.randn(3, 1, 64).to(torch.bfloat16)
    slots = torch.tensor([5 * 16 + 3, -1, 2 * 16 + 15])
    layer.impl.do_kv_cache_update(kv_c, k_pe, cache, slots, kv_cache_dtype, torch.tensor(0.25))
    rows = torch.cat([kv_c, k_pe[:, 0]], dim=-1)
    for token, (block, offset) in ((0, (5, 3)), (2, (2, 15))):
        got = cache[block, offset]
        if kv_cache_dtype == "fp8":
            expect = (rows[token].float() / 0.25).to(torch.float8_e4m3fn).view(torch.uint8)
            assert torch.equal(got, expect)
        else:
            assert torch.equal(got, rows[token])
    changed = (cache != before).reshape(8 * 16, -1).any(dim=-1).nonzero().flatten().tolist()
    assert set(changed) <= {5 * 16 + 3, 2 * 16 + 15}


def _verification_batch(vc, built, requests, rng, **pad):
    """The layers' caches allocated, the batch of ``requests``, and the builder's metadata for it."""
    for layer in built:
        _allocate(layer, 64, 16, rng)
    b = h.batch(requests, num_heads=1, num_kv_heads=1, head_size=64, num_blocks=64, rng=rng, **pad)
    return b, _builder(vc, built, 16).build(0, b.cm)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_speculative_verification_runs_as_one_multi_token_mla_decode_and_the_rest_on_vllms_mla_prefill(
        tmp_path, monkeypatch, kv_cache_dtype):
    """DeepSeek-V3 with 2 speculative tokens: three verification requests of 3 tokens (ours, one
    multi-token ``forward_mqa`` call of [3, 3, H, 576]), a request whose drafts came up short (2
    tokens: the decodes stop being uniform there) and a prompt of 12, both on vLLM's MLA prefill.
    Every verification token's latent output is within the bar of float64 over its own prefix."""
    rng = np.random.default_rng(6)
    calls = _spy_on_decode(monkeypatch)
    shapes = []
    real_decode = ours.ModelAttention.decode
    monkeypatch.setattr(ours.ModelAttention, "decode",
                        lambda handle, q, *a, **k: shapes.append(tuple(q.shape)) or real_decode(handle, q, *a, **k))
    prefills = _record_prefills(monkeypatch)
    vc = _vllm_config(tmp_path, kv_cache_dtype=kv_cache_dtype, num_speculative_tokens=2)
    built = _layers(vc, 2)
    if options.is_fp8(kv_cache_dtype):
        for layer in built:
            layer._k_scale.fill_(0.5)
            layer._k_scale_float = 0.5
    b, md = _verification_batch(vc, built, [(40, 3), (17, 3), (300, 3), (90, 2), (12, 12)], rng)
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills, md.decode.q_len) == (3, 9, 2, 3)
    outs = _forward(vc, built, md, b, rng)
    assert prefills == [(14, [2, 12], True)] * 2  # the short request's 88 cached tokens are its context
    assert [call[0] for call in calls] == built
    for (layer, q, latent), out in zip(calls, outs):
        assert layer.impl.decoder.config.max_q_len == 3 and layer.impl.decoder.impl == "simt"
        assert q.shape == (9, layer.num_heads, 576) and latent.shape == (9, layer.num_heads, 512)
        _check_decode_rows(layer, b, q, latent, 3, f"{layer.layer_name} verification ({kv_cache_dtype})", q_len=3)
        assert torch.isfinite(out).all() and out.shape == (23, layer.num_heads * layer.v_head_dim)
    assert shapes == [(3, 3, built[0].num_heads, 576)] * 2


def test_a_padded_cuda_graph_bucket_of_verification_requests_decodes_its_padding_to_zeros(tmp_path, monkeypatch):
    """vLLM pads a uniform batch to its graph's bucket: two requests of 3 tokens padded to four
    (padding: no query tokens, seq_len 0, their rows' slots -1). All four are decodes of 3
    tokens; the real rows meet the bar, the padding rows come out zero."""
    rng = np.random.default_rng(7)
    calls = _spy_on_decode(monkeypatch)
    vc = _vllm_config(tmp_path, num_speculative_tokens=2)
    built = _layers(vc)
    b, md = _verification_batch(vc, built, [(40, 3), (70, 3)], rng, pad_to=4)
    assert (md.num_decodes, md.num_decode_tokens, md.decode.q_len, md.decode.seq_lens.shape[0]) == (4, 12, 3, 4)
    _forward(vc, built, md, b, rng)
    (layer, q, latent), = calls
    _check_decode_rows(layer, b, q[:6], latent[:6], 2, "the bucket's real rows", q_len=3)
    assert torch.equal(latent[6:], torch.zeros_like(latent[6:]))


def test_forward_mqa_refuses_query_rows_that_are_not_the_decodes_times_their_query_length(tmp_path):
    vc = _vllm_config(tmp_path, num_speculative_tokens=2)
    built = _layers(vc)
    b, md = _verification_batch(vc, built, [(40, 3), (70, 3)], np.random.default_rng(8))
    layer = built[0]
    q = torch.zeros(5, layer.num_heads, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"METRALE_ATTN_MLA decodes 3 query token\(s\) a request: 5 query rows "
                                         r"for 2 decode requests"):
        layer.impl.forward_mqa(q, layer.kv_cache, md, layer)


def test_in_batch_invariant_mode_verification_requests_stay_on_vllms_mla_prefill(tmp_path, monkeypatch):
    """Under ``VLLM_BATCH_INVARIANT`` which backend serves a request must not depend on the batch
    (``options.decode_q_len``): the layer decodes one token a request, a verification request of 3
    tokens is a prefill, the single-token decodes before it ours, within the bar."""
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    rng = np.random.default_rng(9)
    calls = _spy_on_decode(monkeypatch)
    prefills = _record_prefills(monkeypatch)
    vc = _vllm_config(tmp_path, num_speculative_tokens=2)
    built = _layers(vc)
    assert built[0].impl.model.max_q_len == 1
    b, md = _verification_batch(vc, built, [(40, 1), (17, 1), (90, 3), (50, 3)], rng)
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills, md.decode.q_len) == (2, 2, 2, 1)
    _forward(vc, built, md, b, rng)
    assert prefills == [(6, [3, 3], True)]
    (layer, q, latent), = calls
    assert layer.impl.decoder.config.max_q_len == 1 and q.shape[0] == 2
    _check_decode_rows(layer, b, q, latent, 2, "batch-invariant decode rows")
