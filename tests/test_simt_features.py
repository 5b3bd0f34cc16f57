"""The features the simt kernels serve (``features.SIMT_FEATURES``): FlashInfer's CSR page table
(``page_table="csr"``) and dequantization scales read on the device (``device_scales=True``), with
the mma core's semantics, on every simt arm: at head dim 512 (Gemma 4's global layers) and MLA's
576/512 they are how SGLang (csr) and vLLM's fp8 caches (device scales) reach those shapes. A CSR
run gives the bytes of the dense table it stands for; device scales give the bytes of the same host
floats, and per-KV-head ones meet the bar of the per-head reference. The plain simt kernels keep
their ABI (a feature's parameters exist only in its spec); every other feature stays refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from metrale_attn import tolerance
from metrale_attn.features import SIMT_FEATURES
from metrale_attn.kernels import KernelSpec, kernel_params
from metrale_attn.sources import KernelSourceError, parse_kernel_params

from support.problems import CountingBackend, check_against_reference, decoder, problem, run_poisoned, to_csr

ARMS = {"unpacked": dict(splitk="off"), "splitk": dict(splitk="3"), "gqa_packed": dict(splitk="off", gqa_pack=True)}
"""The simt arms and the options that pick each (the packed arm: 6 query heads a KV head at 256)."""
CSR_ARRAYS = ("kv_indptr", "kv_indices", "kv_last_page_len")
SCALE_ARRAYS = ("k_scales", "k_scales_stride", "v_scales", "v_scales_stride", "sm_scale")


def _problem(head_dim: int, *, seed=0, page_size=16, seq_lens=None, kv="bf16", q="bf16", layout="NHD", heads=None,
             v="view", **kw):
    """A problem at ``head_dim`` (128, 256 for the packed arm, 512, or 576: MLA's 576/512, whose
    ``v_cache`` is ``k_cache``'s first 512 dims, ``v="view"``, or a tensor of its own): sequences
    of 0, 1, just over a page, and several splits' worth of tokens by default."""
    seq_lens = seq_lens or (0, 1, page_size + 1, 300)
    shape = heads or (dict(num_q_heads=12, num_kv_heads=2) if head_dim == 256 else
                      dict(num_q_heads=16, num_kv_heads=1) if head_dim == 576 else
                      dict(num_q_heads=8, num_kv_heads=2))
    p = problem(seed=seed, head_dim=head_dim, page_size=page_size, seq_lens=seq_lens, kv_dtype=kv, q_dtype=q,
                layout=layout, share_prefix_pages=1, **shape, **kw)
    if head_dim == 576:
        v_cache = p.k_cache[..., :512] if v == "view" else np.ascontiguousarray(p.v_cache[..., 64:])
        p = dataclasses.replace(p, v_cache=v_cache)
    return p


def _fp32_scales(p):
    """``p`` with its scales fp32 values (as engines keep them), so a host float and a device fp32
    scale hold the same number."""
    def fp32(scale):
        values = np.asarray(scale, np.float32).astype(np.float64)
        return float(values) if values.ndim == 0 else values

    p.k_scale, p.v_scale = fp32(p.k_scale), fp32(p.v_scale)
    return p


def _csr_run(attn, p):
    indptr, indices, last = to_csr(p)
    return run_poisoned(attn, p, kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last, csr=True)


def _same_bytes(a, b) -> bool:
    return [x.tobytes() for x in a] == [x.tobytes() for x in b]


def _check_csr_is_dense(p, arm, **options):
    """The simt arm ``arm`` with a CSR table gives the bytes of the dense table (and of its
    reference's bar), lse included; ``options``: more of the layer's keywords."""
    dense_attn = decoder(p, impl="simt", **ARMS[arm], **options)
    csr_attn = decoder(p, impl="simt", page_table="csr", **ARMS[arm], **options)
    assert (csr_attn.impl, csr_attn.plan(len(p.seq_lens)).arm) == ("simt", arm)
    dense, csr = run_poisoned(dense_attn, p), _csr_run(csr_attn, p)
    check_against_reference(p, *dense)
    assert _same_bytes(dense, csr)


# -- the default run: a sample -------------------------------------------------------------


@pytest.mark.parametrize("head_dim, arm, page_size, kv", [
    (512, "unpacked", 16, "bf16"),
    (512, "splitk", 1, "fp8"),
    (576, "splitk", 64, "bf16"),
    (256, "gqa_packed", 16, "fp16"),
])
def test_a_csr_page_table_on_the_simt_kernels_gives_the_bytes_of_the_dense_one(head_dim, arm, page_size, kv):
    """At 512, 576/512 and on the packed arm; a sequence of no page is empty (zeros, lse -inf)."""
    _check_csr_is_dense(_problem(head_dim, seed=head_dim + page_size, page_size=page_size, kv=kv), arm)


def test_at_head_dim_512_per_kv_head_device_scales_of_an_fp8_cache_meet_the_per_head_reference_and_give_each_heads_host_bytes():
    """Two KV heads, each its own k and v scale: a CTA reads its KV head's (stride 1)."""
    p = _fp32_scales(_problem(512, seed=51, kv="fp8", per_head_scales=True))
    assert np.ndim(p.k_scale) == 1 and len(set(p.k_scale)) == 2
    device = run_poisoned(decoder(p, impl="simt", splitk="3", device_scales=True), p)
    check_against_reference(p, *device)
    for h in range(2):  # each KV head's query heads: the bytes of a host run at that head's floats
        one = dataclasses.replace(p, k_scale=p.k_scale[h], v_scale=p.v_scale[h])
        host = run_poisoned(decoder(one, impl="simt", splitk="3"), one)
        heads = slice(4 * h, 4 * h + 4)
        assert host[0][:, heads].tobytes() == device[0][:, heads].tobytes()
        assert host[1][:, heads].tobytes() == device[1][:, heads].tobytes()


def test_at_576_512_one_device_scale_of_an_fp8_cache_and_a_csr_table_give_the_bytes_of_the_host_float_and_the_dense_table():
    """MLA under vLLM's fp8 cache (one latent KV head: one value) and SGLang's table together."""
    p = _fp32_scales(_problem(576, seed=57, kv="fp8", page_size=64, seq_lens=(0, 1, 65, 200)))
    host = run_poisoned(decoder(p, impl="simt", splitk="off"), p)
    check_against_reference(p, *host)
    both = _csr_run(decoder(p, impl="simt", splitk="off", page_table="csr", device_scales=True), p)
    assert _same_bytes(host, both)


def test_a_simt_layer_with_csr_refuses_a_missing_or_mistyped_table_naming_the_argument_before_any_launch():
    p = _problem(512, seed=3, seq_lens=(5, 40))
    indptr, indices, last = to_csr(p)
    be = CountingBackend()
    attn = decoder(p, backend=be, impl="simt", page_table="csr", device_scales=True)
    scales = dict(k_scales=np.ones(1, np.float32), v_scales=np.ones(1, np.float32))
    with pytest.raises(ValueError, match="built with page_table='csr': pass kv_indptr="):
        attn.run(p.q, p.k_cache, p.v_cache, kv_indices=indices, kv_last_page_len=last, **scales)
    with pytest.raises(ValueError, match=r"kv_indptr must be contiguous int32 \[3\], got int64"):
        attn.run(p.q, p.k_cache, p.v_cache, kv_indptr=indptr.astype(np.int64), kv_indices=indices,
                 kv_last_page_len=last, **scales)
    with pytest.raises(ValueError, match=r"kv_last_page_len\[1\] = 17 must be in 1..16"):
        attn.run(p.q, p.k_cache, p.v_cache, kv_indptr=indptr, kv_indices=indices,
                 kv_last_page_len=np.array([5, 17], np.int32), **scales)
    with pytest.raises(ValueError, match="k_scales must be a float32 array"):
        attn.run(p.q, p.k_cache, p.v_cache, kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last,
                 k_scales=np.ones(1, np.float64), v_scales=scales["v_scales"])
    with pytest.raises(ValueError, match="k_scales and v_scales must both be given"):
        attn.run(p.q, p.k_cache, p.v_cache, kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last,
                 k_scale=0.5, v_scale=0.5)
    assert be.launches == []


def test_simt_serves_csr_and_device_scales_and_still_refuses_every_other_feature_naming_it():
    assert SIMT_FEATURES == {"csr", "device_scales", "multi_token"}
    p = _problem(512, seq_lens=(5,))
    attn = decoder(p, impl="simt", page_table="csr", device_scales=True)
    assert attn.impl == "simt" and attn.config.features == {"csr", "device_scales"}
    for options, name in ((dict(sinks=True), "sinks"), (dict(window_left=8), "window"),
                          (dict(logits_soft_cap=30.0), "soft_cap"), (dict(out_dtype="float32"), "out_f32")):
        with pytest.raises(ValueError, match=rf"impl='simt' has no {name} \(features it lacks: window = "):
            decoder(p, impl="simt", page_table="csr", **options)
    with pytest.raises(ValueError, match="the simt kernels have no features but csr, device_scales, multi_token"):
        KernelSpec("unpacked", 512, "bf16", "bf16", "simt", features={"csr", "sinks"})


def test_a_simt_features_parameters_and_define_exist_only_in_its_spec_so_the_plain_abi_is_unchanged():
    plain = KernelSpec("splitk", 512, "bf16", "fp8", "simt")
    both = KernelSpec("splitk", 512, "bf16", "fp8", "simt", features={"csr", "device_scales"})
    assert plain.name == "simt_decode_splitk_qbf16_kvfp8_hd512"
    assert both.name == "simt_decode_splitk_qbf16_kvfp8_hd512_device_scales_csr"
    assert not {"PD_CSR", "PD_DEVICE_SCALES"} & set(plain.defines())
    assert both.defines()["PD_CSR"] == both.defines()["PD_DEVICE_SCALES"] == 1
    base = [q.name for q in kernel_params(plain)["simt_decode_splitk"]]
    assert base[-1] == "lse_scale" and not set(CSR_ARRAYS + SCALE_ARRAYS) & set(base)
    assert [q.name for q in kernel_params(both)["simt_decode_splitk"]] == base + list(SCALE_ARRAYS + CSR_ARRAYS)
    assert kernel_params(both)["simt_decode_splitk_merge"] == kernel_params(plain)["simt_decode_splitk_merge"]


# -- with multi-token decode: the three together, as the mma core combines them --------------


def _multi_token_check(p, out, lse, q):
    """``out`` within the bar of the float64 reference of the multi-token ``q`` (per-KV-head
    scales: the per-head reference), lse -inf exactly where a row sees no key, 2e-6 elsewhere."""
    ref_out, ref_lse = p.reference(return_lse=True, q=q)
    tolerance.assert_close_to_reference(out, ref_out, v_absmax=p.v_absmax(), logit_absmax=lambda: p.logit_absmax(q=q))
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty)
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=2e-6, atol=2e-6)


@pytest.mark.filterwarnings("ignore:.*(head_dim 512 is wider|576, 512.*has no mma kernel).*:RuntimeWarning")
@pytest.mark.parametrize("head_dim, arm, kv, q_len, per_head", [
    (576, "splitk", "fp8", 4, False),     # MLA under MTP: SGLang's table, vLLM's fp8 scale, V a view of K
    (576, "unpacked", "bf16", 3, False),  # the same with V read from K's registers (the _vink spec)
    (512, "splitk", "fp8", 3, True),      # Gemma 4's global layer: 2 KV heads, each its own fp8 scales
    (512, "unpacked", "fp8", 8, True),
])
def test_multi_token_csr_and_device_scales_together_meet_the_bar_and_give_the_dense_host_float_bytes(
        head_dim, arm, kv, q_len, per_head):
    """A layer of all three simt features (the default impl: simt at 512 and 576/512) holds the
    1-ulp bar against float64 with rows that see no key (short sequences, an empty one), gives the
    bytes of the dense table and host floats (one scale), and serves one-token calls of the same
    layer on its plain-token spec, whose ABI differs (the binder keys it by spec)."""
    p = _fp32_scales(_problem(head_dim, seed=head_dim + q_len, kv=kv, page_size=16, seq_lens=(0, 2, 37, 300),
                              per_head_scales=per_head, heads=dict(num_q_heads=4, num_kv_heads=2)
                              if head_dim == 512 else None))
    assert (head_dim != 576) or np.shares_memory(p.v_cache, p.k_cache)
    qs = np.random.default_rng(q_len).standard_normal(p.q.shape[:1] + (q_len,) + p.q.shape[1:]).astype(p.q.dtype)
    attn = decoder(p, max_q_len=8, page_table="csr", device_scales=True, **ARMS[arm])
    assert attn.impl == "simt" and attn.config.features == {"multi_token", "csr", "device_scales"}
    indptr, indices, last = to_csr(p)
    table = dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last, csr=True)
    got = run_poisoned(attn, p, q=qs, **table)
    assert got[0].shape == (4, q_len, p.q.shape[1], p.v_cache.shape[-1])
    _multi_token_check(p, *got, qs)
    one = run_poisoned(attn, p, **table)  # one token a sequence: the spec without multi_token
    check_against_reference(p, *one)
    if not per_head:  # the bytes of the dense table and the host float, multi-token and one-token
        plain = decoder(p, max_q_len=8, **ARMS[arm])
        assert _same_bytes(run_poisoned(plain, p, q=qs), got)
        assert _same_bytes(run_poisoned(plain, p), one)


@pytest.mark.filterwarnings("ignore:.*576, 512.*has no mma kernel.*:RuntimeWarning")
def test_the_combined_simt_specs_bind_each_kernels_abi_by_spec():
    """A layer with max_q_len > 1 compiles a spec with and one without multi-token, whose one
    kernel name takes two parameter lists: each launch takes its own spec's (csr and
    device_scales' parameters in both, q_stride_token and q_len in the multi-token one)."""
    from metrale_attn.kernels import specs_for

    p = _problem(576, seq_lens=(5,), kv="fp8")
    attn = decoder(p, max_q_len=4, page_table="csr", device_scales=True, splitk="3")
    specs = {spec.features: spec for spec in specs_for(attn.config).values()}
    assert set(specs) == {frozenset({"csr", "device_scales"}), frozenset({"multi_token", "csr", "device_scales"})}
    one, multi = specs[frozenset({"csr", "device_scales"})], specs[frozenset(SIMT_FEATURES)]
    assert multi.name == "simt_decode_splitk_qbf16_kvfp8_hd576_v512_multi_token_device_scales_csr"
    base = [q.name for q in kernel_params(one)["simt_decode_splitk"]]
    assert base[-len(SCALE_ARRAYS + CSR_ARRAYS):] == list(SCALE_ARRAYS + CSR_ARRAYS)
    tail = ["q_stride_token", "q_len"] + list(SCALE_ARRAYS + CSR_ARRAYS)
    assert [q.name for q in kernel_params(multi)["simt_decode_splitk"]] == base[:-len(SCALE_ARRAYS + CSR_ARRAYS)] + tail
    be = CountingBackend()
    attn = decoder(p, backend=be, max_q_len=4, page_table="csr", device_scales=True, splitk="3")
    indptr, indices, last = to_csr(p)
    table = dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last, csr=True)
    qs = np.zeros((1, 3) + p.q.shape[1:], p.q.dtype)
    run_poisoned(attn, p, q=qs, **table)
    run_poisoned(attn, p, **table)
    assert [(a.kernel, len(a.args)) for a in be.launched] == [
        ("simt_decode_splitk", len(base) + 2), ("simt_decode_splitk_merge", 5),
        ("simt_decode_splitk", len(base)), ("simt_decode_splitk_merge", 5)]


@pytest.mark.parametrize("params, match", [
    ("int a\n#if PD_X\n#if PD_Y\n, int b\n#endif\n#endif\n", "only unnested"),
    ("int a\n#ifdef PD_X\n, int b\n#endif\n", "only unnested"),
    ("int a\n#if PD_X\n, int b\n", "has no '#endif'"),
    ("int a\n#endif\n", "only unnested"),
])
def test_a_parameter_list_directive_the_abi_reader_cannot_evaluate_is_refused(params, match):
    with pytest.raises(KernelSourceError, match=match):
        parse_kernel_params(f'extern "C" __global__ void k({params}) {{}}', {"PD_X": 1})


def test_the_abi_reader_keeps_an_if_block_of_a_parameter_list_exactly_where_its_define_is_set():
    text = 'extern "C" __global__ void k(int a\n#if PD_X\n  , float b  // b\n#endif\n  ) {}'
    names = [[q.name for q in parse_kernel_params(text, d)["k"]] for d in (None, {"PD_X": 0}, {"PD_X": 1})]
    assert names == [["a"], ["a"], ["a", "b"]]


# -- the slow grid --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("head_dim, arm", [(128, "unpacked"), (128, "splitk"), (256, "gqa_packed"), (512, "unpacked"),
                                           (512, "splitk"), (576, "unpacked"), (576, "splitk")])
@pytest.mark.parametrize("kv", ["bf16", "fp16", "fp8"])
def test_every_simt_arm_head_dim_and_page_size_gives_the_dense_bytes_with_a_csr_table(backend, kv, head_dim, arm,
                                                                                    page_size):
    p = _problem(head_dim, seed=page_size + len(kv), page_size=page_size, kv=kv,
                 q=("bf16", "fp16")[page_size % 2], layout=("NHD", "HND")[len(kv) % 2],
                 v=("view", "own")[page_size // 16 % 2], seq_lens=(0, 1, page_size + 1, 300, 700))
    dense_attn = decoder(p, backend=backend, impl="simt", **ARMS[arm])
    csr_attn = decoder(p, backend=backend, impl="simt", page_table="csr", **ARMS[arm])
    dense, csr = run_poisoned(dense_attn, p), _csr_run(csr_attn, p)
    check_against_reference(p, *dense)
    assert _same_bytes(dense, csr)


@pytest.mark.slow
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("head_dim, arm", [(128, "unpacked"), (128, "splitk"), (256, "gqa_packed"), (512, "unpacked"),
                                           (512, "splitk"), (576, "unpacked"), (576, "splitk")])
@pytest.mark.parametrize("csr", [False, True])
def test_every_simt_arm_with_device_scales_of_an_fp8_cache_meets_the_reference_and_the_host_floats_bytes(
        backend, csr, head_dim, arm, per_head):
    """One value: the bytes of the same host float; one per KV head (not at 576/512, one KV head):
    the per-head reference's bar. With or without a CSR table."""
    if per_head and head_dim == 576:
        pytest.skip("MLA has one KV head: one value")
    p = _fp32_scales(_problem(head_dim, seed=head_dim + per_head, kv="fp8", page_size=16, per_head_scales=per_head))
    attn = decoder(p, backend=backend, impl="simt", device_scales=True, page_table="csr" if csr else "dense",
                   **ARMS[arm])
    device = _csr_run(attn, p) if csr else run_poisoned(attn, p)
    check_against_reference(p, *device)
    if not per_head:
        assert _same_bytes(run_poisoned(decoder(p, backend=backend, impl="simt", **ARMS[arm]), p), device)
