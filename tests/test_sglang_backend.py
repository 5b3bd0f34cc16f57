"""metrale-attn as an SGLang attention backend: the pure parts (refusals, the req_to_token ->
CSR arithmetic) in any venv with torch; the backend itself through SGLang's own classes
(its token pools, ``ForwardBatch``, ``RadixAttention``, its registry and torch-native
prefill backend) on the CPU backend, where SGLang is installed (skipped elsewhere, an
error under ``METRALE_ATTN_REQUIRE_SGLANG=1``)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from support.optional import import_sglang, import_torch

torch = import_torch()

from metrale_attn import reference, tolerance  # noqa: E402
from metrale_attn.config import HEAD_DIMS  # noqa: E402
from metrale_attn.integrations.sglang import csr, options  # noqa: E402
from metrale_attn.torch_op import to_numpy  # noqa: E402


# -- without SGLang -----------------------------------------------------------------------------


def test_importing_the_sglang_integration_imports_no_sglang():
    code = ("import sys, metrale_attn.integrations.sglang, metrale_attn.integrations.sglang.options, "
            "metrale_attn.integrations.sglang.csr; print(any(m.split('.')[0] == 'sglang' for m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


def _table(rows=6, cols=12):
    return torch.arange(rows * cols, dtype=torch.int32).view(rows, cols) + 100


def test_req_to_token_rows_become_the_csr_table_of_their_first_seq_len_slots():
    r2t = _table()
    buffers = csr.allocate_csr(4, 40, "cpu")
    seq_lens = torch.tensor([3, 0, 12, 1])
    indptr, indices, last = csr.fill_csr(r2t, torch.tensor([5, 1, 2, 0]), seq_lens, 16, *buffers)
    assert indptr.tolist() == [0, 3, 3, 15, 16]
    assert indices[:16].tolist() == r2t[5, :3].tolist() + r2t[2].tolist() + r2t[0, :1].tolist()
    assert last.tolist() == [1, 0, 1, 1]  # pages of one token; an empty sequence reads as length 0
    # the views are the buffers themselves: a captured graph reads what the next fill writes
    assert indptr.data_ptr() == buffers[0].data_ptr() and indices.data_ptr() == buffers[1].data_ptr()


def test_a_smaller_batch_refills_the_same_buffers_and_leaves_the_rest_unread():
    r2t, buffers = _table(), csr.allocate_csr(4, 48, "cpu")
    csr.fill_csr(r2t, torch.tensor([1, 2, 3, 4]), torch.tensor([12, 12, 12, 12]), 48, *buffers)
    indptr, indices, last = csr.fill_csr(r2t, torch.tensor([3]), torch.tensor([2]), 2, *buffers)
    assert indptr.tolist() == [0, 2] and indices[:2].tolist() == r2t[3, :2].tolist() and last.tolist() == [1]
    assert indices.shape == (48,)


@pytest.mark.parametrize("change, match", [
    (dict(num_tokens=5), "num_tokens 5 is not the sum of seq_lens, 4"),
    (dict(num_tokens=100), "num_tokens 100 does not fit kv_indices"),
    (dict(seq_lens=torch.tensor([13, 1])), "seq_lens must be within 0..12"),
    (dict(req_pool_indices=torch.tensor([6, 0])), "req_pool_indices must be within 0..5"),
    (dict(req_pool_indices=torch.tensor([1])), r"req_pool_indices must be \[2\]"),
    (dict(kv_indptr=torch.zeros(2, dtype=torch.int32)), "hold fewer than 2 requests"),
    (dict(kv_indices=torch.zeros(40, dtype=torch.int64)), "kv_indices must be contiguous int32"),
    (dict(req_to_token=_table().long()), "req_to_token must be contiguous int32"),
])
def test_a_batch_that_does_not_fit_is_refused_naming_the_argument_before_anything_is_written(change, match):
    args = dict(req_to_token=_table(), req_pool_indices=torch.tensor([1, 2]), seq_lens=torch.tensor([3, 1]),
                num_tokens=4, kv_indptr=torch.full((3,), -7, dtype=torch.int32),
                kv_indices=torch.full((40,), -7, dtype=torch.int32),
                kv_last_page_len=torch.full((2,), -7, dtype=torch.int32))
    args.update(change)
    if "seq_lens" in change:
        args["num_tokens"] = int(change["seq_lens"].sum())
    with pytest.raises(ValueError, match=match):
        csr.fill_csr(**args)
    assert all((args[name] == -7).all() for name in ("kv_indptr", "kv_indices", "kv_last_page_len") if name not in change)


def test_model_refusals_name_each_reason_and_the_supported_values():
    reasons = options.model_refusals(dtype="torch.float32", kv_cache_dtype="torch.float32", page_size=16,
                                     use_mla=True, kv_pool="DSATokenToKVPool", dcp=True, capability=(7, 5))
    text = "; ".join(reasons)
    assert len(reasons) == 5
    for part in ("dtype torch.float32 not supported (metrale-attn: torch.bfloat16, torch.float16)",
                 "page_size 16 not supported", "--page-size 1",
                 "the MLA KV pool DSATokenToKVPool not supported (metrale-attn reads MLATokenToKVPool's latent rows",
                 "decode context parallelism (--dcp-size > 1) not supported",
                 "compute capability 7.5 not supported (metrale-attn launches on 8.0 (sm_80"):
        assert part in text
    swa = options.model_refusals(dtype="torch.bfloat16", kv_cache_dtype="torch.bfloat16", page_size=1, use_mla=False,
                                 kv_pool="SWAKVPool", dcp=False, capability=(9, 0))
    assert len(swa) == 1 and "--disable-hybrid-swa-memory" in swa[0]
    fp8 = options.model_refusals(dtype="torch.bfloat16", kv_cache_dtype="torch.float8_e4m3fn", page_size=1,
                                 use_mla=False, kv_pool="MHATokenToKVPool", dcp=False, capability=(9, 0))
    assert fp8 == ["kv_cache_dtype torch.float8_e4m3fn not supported: the SGLang backend reads a KV pool of the "
                   "model dtype (torch.bfloat16; --kv-cache-dtype auto), not yet fp8"]
    for mla, pool in ((False, "MHATokenToKVPool"), (True, options.MLA_POOL)):
        assert options.model_refusals(dtype="torch.float16", kv_cache_dtype="torch.float16", page_size=1, use_mla=mla,
                                      kv_pool=pool, dcp=False, capability=None) == []


PLAIN_LAYER = dict(num_q_heads=8, num_kv_heads=1, is_cross_attention=False, attn_type="decoder", logit_capping_method="tanh",
                   logit_cap=0.0)


def test_layer_refusals_name_the_head_dims_and_attention_kinds_we_serve():
    reasons = options.layer_refusals(head_dim=80 + 1, v_head_dim=64, num_q_heads=8, num_kv_heads=1,
                                     is_cross_attention=True,
                                     attn_type="encoder_only", logit_capping_method="xai", logit_cap=30.0)
    assert len(reasons) == 5
    assert reasons[0] == f"head_dim 81 not supported (metrale-attn: {options.head_sizes_line()})"
    assert "512 (512 on the reference kernels)" in reasons[0]
    assert "v_head_dim 64 differs from head_dim 81 (metrale-attn needs them equal, or MLA's absorbed 576/512" \
        in reasons[1]
    for head_dim in (*HEAD_DIMS, 512):
        assert options.layer_refusals(head_dim=head_dim, v_head_dim=head_dim, **PLAIN_LAYER) == []


@pytest.mark.parametrize("asks", [dict(sliding_window_size=1023), dict(logit_cap=30.0)])
def test_a_512_wide_layer_with_a_window_or_a_logit_cap_is_refused_with_the_librarys_reason(asks):
    reasons = options.layer_refusals(head_dim=512, v_head_dim=512, **{**PLAIN_LAYER, **asks})
    assert len(reasons) == 1
    assert reasons[0].startswith("head_dim 512 with a sliding window or a logit cap not supported (metrale-attn: ")
    assert "simt" in reasons[0]
    assert options.layer_refusals(head_dim=256, v_head_dim=256, **{**PLAIN_LAYER, **asks}) == []


@pytest.mark.parametrize("asks, why", [(dict(), None), (dict(num_q_heads=128), None),
                                       (dict(num_kv_heads=2), "num_kv_heads"),
                                       (dict(sliding_window_size=1023), "simt"), (dict(logit_cap=30.0), "simt")])
def test_an_mla_layer_is_served_over_one_kv_head_and_anything_else_is_refused_with_the_librarys_reason(asks, why):
    reasons = options.layer_refusals(head_dim=576, v_head_dim=512, **{**PLAIN_LAYER, **asks})
    if why is None:
        assert reasons == []
    else:
        assert len(reasons) == 1 and reasons[0].startswith("MLA's 576/512 layer as asked not supported (metrale-attn: ")
        assert why in reasons[0]


def test_sglang_window_and_soft_cap_conventions_are_ours():
    assert options.window_left(-1) == -1 and options.window_left(None) == -1 and options.window_left(511) == 511
    assert options.soft_cap(0.0) is None and options.soft_cap(30.0) == 30.0
    with pytest.raises(ValueError, match="sliding_window_size must be an int"):
        options.window_left(3.5)


# -- through SGLang's own classes ---------------------------------------------------------------


@pytest.fixture(scope="module")
def sg():
    """SGLang's classes, with our plugin registered and prefill on its torch-native backend."""
    import_sglang()
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    import metrale_attn.integrations.sglang as plugin

    plugin.register()
    plugin.register()  # idempotent
    return dict(ATTENTION_BACKENDS=ATTENTION_BACKENDS, RadixAttention=RadixAttention, KVPool=MHATokenToKVPool,
                MLAPool=MLATokenToKVPool, ReqToTokenPool=ReqToTokenPool, ForwardBatch=ForwardBatch,
                ForwardMode=ForwardMode)


class Engine:
    """A model runner's worth of SGLang state on the CPU: its pools, one layer, our backend.
    ``mla``: an MLA model's (DeepSeek's absorbed decode): SGLang's latent pool of 512 + 64 dims a
    token and a layer of head dim 576, ``v_head_dim`` 512, one KV head, as DeepSeek-V2 builds it."""

    def __init__(self, sg, *, q_heads=8, kv_heads=2, head_dim=64, dtype=torch.bfloat16, window=-1, cap=0.0,
                 rows=8, context=96, slots=400, mla=False, **runner):
        from types import SimpleNamespace

        self.sg, self.dtype = sg, dtype
        self.r2t = sg["ReqToTokenPool"](size=rows, max_context_len=context, device="cpu", enable_memory_saver=False)
        if mla:
            kv_heads, head_dim = 1, 576
            self.kv = sg["MLAPool"](size=slots, page_size=1, dtype=dtype, kv_lora_rank=512, qk_rope_head_dim=64,
                                    layer_num=1, device="cpu", enable_memory_saver=False)
        else:
            self.kv = sg["KVPool"](size=slots, page_size=1, dtype=dtype, head_num=kv_heads, head_dim=head_dim,
                                   layer_num=1, device="cpu", enable_memory_saver=False)
        fields = dict(device="cpu", req_to_token_pool=self.r2t, token_to_kv_pool=self.kv, dtype=dtype,
                      kv_cache_dtype=dtype, page_size=1, use_mla_backend=mla, server_args=None, model_config=None)
        fields.update(runner)
        self.runner = SimpleNamespace(**fields)
        scale = 192 ** -0.5 if mla else head_dim ** -0.5  # DeepSeek's: 1/sqrt(qk_nope + qk_rope head dims)
        self.layer = sg["RadixAttention"](q_heads, head_dim, scale, kv_heads, 0, logit_cap=cap,
                                          sliding_window_size=window, v_head_dim=512 if mla else -1)
        self.gen = torch.Generator().manual_seed(7)
        self.free = (torch.randperm(slots - 1, generator=self.gen) + 1).tolist()  # slot 0: SGLang's padding slot

    def backend(self):
        return self.sg["ATTENTION_BACKENDS"]["metrale"](self.runner)

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.dtype)

    def batch(self, mode, rows, seq_lens, new_tokens):
        """A ForwardBatch whose requests own pool ``rows``, ``seq_lens`` tokens each (the last
        ``new_tokens`` of each new this step: their slots are this step's out_cache_loc)."""
        locs = []
        for row, n in zip(rows, seq_lens):
            have = int((self.r2t.req_to_token[row] != 0).sum())
            for col in range(have, n):
                self.r2t.req_to_token[row, col] = self.free.pop()
            locs.append(self.r2t.req_to_token[row, n - new_tokens:n].long())
        lens = torch.tensor(seq_lens)
        fields = dict(forward_mode=mode, batch_size=len(rows), input_ids=torch.zeros(sum(map(len, locs)), dtype=torch.long),
                      req_pool_indices=torch.tensor(rows), seq_lens=lens, out_cache_loc=torch.cat(locs),
                      seq_lens_sum=sum(seq_lens), seq_lens_cpu=lens.clone())
        if not mode.is_decode():
            fields.update(extend_seq_lens=torch.full((len(rows),), new_tokens), extend_prefix_lens=lens - new_tokens,
                          extend_seq_lens_cpu=[new_tokens] * len(rows),
                          extend_prefix_lens_cpu=[n - new_tokens for n in seq_lens], extend_num_tokens=new_tokens * len(rows))
        return self.sg["ForwardBatch"](**fields)

    def reference(self, q, fb, request, q_len=1):
        """float64 ``[q_len, heads, Dv]``: request ``request``'s tokens over the pool as it is now."""
        layer, D, Dv = self.layer, self.layer.qk_head_dim, self.layer.v_head_dim
        n = int(fb.seq_lens[request])
        table = self.r2t.req_to_token[fb.req_pool_indices[request], :n].numpy()[None]
        k = to_numpy(self.kv.get_key_buffer(0).contiguous()).reshape(-1, 1, layer.tp_k_head_num, D)
        v = to_numpy(self.kv.get_value_buffer(0).contiguous()).reshape(-1, 1, layer.tp_k_head_num, Dv)
        rows = to_numpy(q.view(-1, layer.tp_q_head_num, D)[request * q_len:(request + 1) * q_len])
        ref = reference.paged_decode(rows[None], k, v, table, np.array([n], np.int32), sm_scale=layer.scaling,
                                     v_head_dim=Dv,
                                     window_left=options.window_left(layer.sliding_window_size),
                                     logits_soft_cap=options.soft_cap(layer.logit_cap))[0]
        v_absmax = reference.max_abs_v_read(v, table, np.array([n], np.int32))
        return ref, v_absmax


@pytest.fixture(autouse=True)
def _prefill_on_torch_native(monkeypatch):
    monkeypatch.setenv(options.PREFILL_ENV, "torch_native")  # SGLang's Triton backend needs a GPU


def _decode_step(engine, be, rows, seq_lens, check=True):
    fb = engine.batch(engine.sg["ForwardMode"].DECODE, rows, seq_lens, 1)
    be.init_forward_metadata(fb)
    L = engine.layer
    q, k = engine.randn(len(rows), L.tp_q_head_num * L.qk_head_dim), engine.randn(len(rows), L.tp_k_head_num,
                                                                                  L.qk_head_dim)
    v = k[..., :L.v_head_dim] if L.v_head_dim != L.qk_head_dim else engine.randn(len(rows), L.tp_k_head_num,
                                                                                  L.qk_head_dim)
    out = be.forward(q, k, v, L, fb)
    assert out.shape == (len(rows), L.tp_q_head_num * L.v_head_dim) and out.dtype == q.dtype
    if check:
        for r in range(len(rows)):
            ref, v_absmax = engine.reference(q, fb, r)
            tolerance.assert_close_to_reference(to_numpy(out.view(len(rows), -1, L.v_head_dim)[r:r + 1]), ref,
                                                v_absmax=v_absmax, what=f"request {r}")
    return fb, q, out


@pytest.mark.parametrize("features", [dict(), dict(window=5), dict(cap=30.0), dict(q_heads=4, kv_heads=4, head_dim=128,
                                                                                      dtype=torch.float16),
                                      dict(q_heads=8, kv_heads=1, head_dim=512)])  # Gemma 4's global layer, TP 2
def test_a_prefill_then_decode_steps_run_through_sglangs_classes_within_one_ulp_of_float64(sg, features):
    engine = Engine(sg, **features)
    be = engine.backend()
    L = engine.layer
    # the prompt: an EXTEND batch, routed to SGLang's torch-native backend, which writes the pool
    rows, prompt = [1, 4, 2], [6, 17, 1]
    for row, n in zip(rows, prompt):
        fb = engine.batch(sg["ForwardMode"].EXTEND, [row], [n], n)
        be.init_forward_metadata(fb)
        q = engine.randn(n, L.tp_q_head_num * L.qk_head_dim)
        out = be.forward(q, engine.randn(n, L.tp_k_head_num, L.qk_head_dim),
                         engine.randn(n, L.tp_k_head_num, L.qk_head_dim), L, fb)
        assert out.shape == (n, L.tp_q_head_num * L.qk_head_dim) and torch.isfinite(out.float()).all()
    assert be._prefill is not None and type(be._prefill).__name__ == "TorchNativeAttnBackend"
    for step in range(3):
        _decode_step(engine, be, rows, [n + 1 + step for n in prompt])


@pytest.fixture
def one_rank_published(sg):
    """What a launch publishes before any backend is built, and SGLang's MLA pool asks at each
    write: one rank's decode, no decode context parallelism."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(dcp_enabled=False):
        yield


def test_an_mla_model_decodes_over_sglangs_latent_pool_within_one_ulp_of_float64(sg, one_rank_published,
                                                                                  monkeypatch):
    """DeepSeek's absorbed decode as SGLang sends it: q ``[bs, heads x 576]``, the new latent row as
    K and its first 512 dims as V; the pool keeps one 576-wide row a token and returns V as a view
    of it; out is ``[bs, heads x 512]``. The kernels read V from K's rows (the ``_vink`` kernels)."""
    from support.backends import SpecRecorder

    from metrale_attn.integrations.sglang import backend as sglang_backend
    from metrale_attn.serving import ModelAttention

    recorder = SpecRecorder()
    monkeypatch.setattr(sglang_backend, "ModelAttention",
                        lambda device, **kwargs: ModelAttention(device, backend=recorder, **kwargs))
    engine = Engine(sg, q_heads=16, mla=True)  # DeepSeek-V3's 128 heads at TP 8
    be = engine.backend()
    rows, prompt = [1, 4, 2], [6, 17, 1]
    for row, n in zip(rows, prompt):  # the prompts' latent rows, as the prefill backend would write them
        engine.batch(sg["ForwardMode"].EXTEND, [row], [n], n)
        engine.kv.get_key_buffer(0)[engine.r2t.req_to_token[row, :n].long()] = engine.randn(n, 1, 576)
    value = engine.kv.get_value_buffer(0)
    assert value.data_ptr() == engine.kv.get_key_buffer(0).data_ptr() and value.shape[-1] == 512
    for step in range(3):
        _decode_step(engine, be, rows, [n + 1 + step for n in prompt])
    decodes = [name for name in recorder.specs if "merge" not in name]
    assert decodes and all(name.startswith("simt_") and "_hd576_v512_vink" in name for name in decodes), decodes


def test_decode_context_parallelism_is_refused_at_start_up(sg, monkeypatch):
    """Under ``--dcp-size`` > 1 SGLang merges each rank's partial attention by its lse, which our
    decode does not return to it."""
    from metrale_attn.integrations.sglang import backend as sglang_backend

    monkeypatch.setattr(sglang_backend, "_dcp_enabled", lambda: True)
    for mla in (False, True):
        with pytest.raises(ValueError, match=r"refuses this model: decode context parallelism \(--dcp-size > 1\)"):
            Engine(sg, mla=mla).backend()


def test_the_prefill_backend_is_built_only_when_a_batch_needs_it(sg):
    engine = Engine(sg)
    be = engine.backend()
    engine.batch(sg["ForwardMode"].EXTEND, [1], [4], 4)
    _decode_step(engine, be, [1], [5])
    assert be._prefill is None


def test_cuda_graph_metadata_fills_fixed_buffers_at_capture_and_replay(sg):
    engine = Engine(sg)
    be = engine.backend()
    assert be.get_cuda_graph_seq_len_fill_value() == 1
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    for row, n in zip([1, 2, 3], [5, 9, 2]):
        engine.batch(sg["ForwardMode"].EXTEND, [row], [n - 1], n - 1)
        engine.kv.k_buffer[0][engine.r2t.req_to_token[row, :n - 1].long()] = engine.randn(n - 1, 2, 64)
        engine.kv.v_buffer[0][engine.r2t.req_to_token[row, :n - 1].long()] = engine.randn(n - 1, 2, 64)
    # capture: a padded batch of 4 (padding request: pool row 0, one token)
    fb = engine.batch(sg["ForwardMode"].DECODE, [1, 2, 3], [5, 9, 2], 1)
    padded = sg["ForwardBatch"](forward_mode=fb.forward_mode, batch_size=4, input_ids=torch.zeros(4, dtype=torch.long),
                                req_pool_indices=torch.tensor([1, 2, 3, 0]), seq_lens=torch.tensor([5, 9, 2, 1]),
                                out_cache_loc=torch.cat([fb.out_cache_loc, torch.zeros(1, dtype=torch.long)]),
                                seq_lens_sum=17, seq_lens_cpu=torch.tensor([5, 9, 2, 1]))
    be.init_forward_metadata_out_graph(padded, in_capture=True)
    captured = be.forward_metadata
    pointers = [t.data_ptr() for t in (captured.kv_indptr, captured.kv_indices, captured.kv_last_page_len)]
    assert captured.kv_indptr.tolist() == [0, 5, 14, 16, 17] and captured.kv_indices.shape == (4 * 96,)
    L = engine.layer
    q = engine.randn(4, L.tp_q_head_num * 64)
    out = be.forward(q, engine.randn(4, 2, 64), engine.randn(4, 2, 64), L, padded)
    for r in range(3):
        ref, v_absmax = engine.reference(q, padded, r)
        tolerance.assert_close_to_reference(to_numpy(out.view(4, -1, 64)[r:r + 1]), ref, v_absmax=v_absmax,
                                            what=f"request {r}")
    # replay: other requests and lengths, the same addresses
    padded.seq_lens.copy_(torch.tensor([6, 10, 3, 1]))
    padded.seq_lens_cpu = padded.seq_lens.clone()
    padded.seq_lens_sum = 20
    be.init_forward_metadata_out_graph(padded)
    replayed = be.forward_metadata
    assert [t.data_ptr() for t in (replayed.kv_indptr, replayed.kv_indices, replayed.kv_last_page_len)] == pointers
    assert replayed.kv_indptr.tolist() == [0, 6, 16, 19, 20]
    with pytest.raises(ValueError, match="CUDA-graph batch size 99 exceeds the 8 requests"):
        be.init_cuda_graph_state(max_bs=99, max_num_tokens=99)


@pytest.fixture
def recording_prefill(sg, monkeypatch):
    """A prefill backend registered under a name of its own that records what it is asked."""
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    calls = []

    class Recording(AttentionBackend):
        def __init__(self, runner):
            super().__init__()
            calls.append(("built",))

        def init_cuda_graph_state(self, max_bs, max_num_tokens):
            calls.append(("init_cuda_graph_state", max_bs, max_num_tokens))

        @property
        def verify_mask(self):
            return "the prefill backend's mask"

        def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs):
            calls.append(("update_verify_buffers_to_fill_after_draft", spec_info, cuda_graph_bs))

        def init_mha_chunk_metadata(self, forward_batch, disable_flashinfer_ragged=False):
            calls.append(("init_mha_chunk_metadata", forward_batch, disable_flashinfer_ragged))

    monkeypatch.setitem(sg["ATTENTION_BACKENDS"], "recording_prefill", Recording)
    monkeypatch.setenv(options.PREFILL_ENV, "recording_prefill")
    return calls


def test_under_speculative_decoding_verification_is_the_prefill_backends_cuda_graphs_and_mask_included(
        sg, recording_prefill, monkeypatch):
    """SGLang captures verification batches with the model's backend and asks it for the draft's
    tree mask: ours hands both to the backend that verifies, as SGLang's own split backend does."""
    from metrale_attn.integrations.sglang import backend as sglang_backend

    be = Engine(sg).backend()
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    assert recording_prefill == [] and be._prefill is None  # no speculation: the prefill backend is never built
    monkeypatch.setattr(sglang_backend, "_speculating", lambda: True)
    be = Engine(sg).backend()
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=12)
    assert recording_prefill == [("built",), ("init_cuda_graph_state", 4, 12)]
    assert be.verify_mask == "the prefill backend's mask"
    be.update_verify_buffers_to_fill_after_draft("spec", 4)
    assert recording_prefill[-1] == ("update_verify_buffers_to_fill_after_draft", "spec", 4)


def test_deepseeks_chunked_prefix_planning_is_the_prefill_backends(sg, recording_prefill, monkeypatch):
    be = Engine(sg).backend()
    be.init_mha_chunk_metadata("batch")
    assert recording_prefill[-1] == ("init_mha_chunk_metadata", "batch", False)
    monkeypatch.delattr(type(be.prefill), "init_mha_chunk_metadata")
    asked = len(recording_prefill)
    be.init_mha_chunk_metadata("batch")  # a prefill backend without the step (Triton's): nothing to plan
    assert len(recording_prefill) == asked


def test_the_backend_is_registered_and_refuses_what_is_not_ours_at_selection(sg):
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES

    assert "metrale" in ATTENTION_BACKEND_CHOICES and "metrale" in sg["ATTENTION_BACKENDS"]
    with pytest.raises(ValueError, match="refuses this model: page_size 16 not supported"):
        Engine(sg, page_size=16).backend()
    with pytest.raises(ValueError, match="refuses this model: dtype torch.float32 not supported"):
        Engine(sg, dtype=torch.float32).backend()
    with pytest.raises(ValueError, match="kv_cache_dtype torch.float8_e4m3fn not supported"):
        Engine(sg, kv_cache_dtype=torch.float8_e4m3fn).backend()
    engine = Engine(sg, head_dim=72)
    with pytest.raises(ValueError, match="refuses layer 0: head_dim 72 not supported"):
        _decode_step(engine, engine.backend(), [1], [3], check=False)


def test_a_prefill_backend_that_is_not_registered_is_refused_by_name(sg, monkeypatch):
    monkeypatch.setenv(options.PREFILL_ENV, "nonesuch")
    with pytest.raises(ValueError, match="METRALE_ATTN_SGLANG_PREFILL must name another registered SGLang attention "
                                         "backend, got 'nonesuch'"):
        Engine(sg).backend()


def test_a_layer_that_comes_back_different_is_refused_not_run_on_its_old_kernels(sg):
    engine = Engine(sg)
    be = engine.backend()
    _decode_step(engine, be, [1], [3])
    engine.layer.scaling = 0.5
    with pytest.raises(ValueError, match="layer 0 was built as"):
        _decode_step(engine, be, [1], [4], check=False)


def test_the_sglang_plugin_is_declared_and_names_a_function_that_exists():
    import importlib
    from pathlib import Path

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    plugins = project["entry-points"]["sglang.srt.plugins"]
    assert plugins == {"metrale_attn": "metrale_attn.integrations.sglang:register"}
    module, function = plugins["metrale_attn"].split(":")
    assert callable(getattr(importlib.import_module(module), function))
    assert "sglang==0.5.23" in project["optional-dependencies"]["sglang"]
