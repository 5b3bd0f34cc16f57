"""Multi-token decode (speculative verification, MTP: ``max_q_len`` up to 8) on the simt
kernels, so head dim 512 (Gemma 4's global layers) and MLA's 576/512 serve it: a CTA per query
row (sequence, token, head), whose keys are the causal prefix of its own position, held to the
float64 reference's 1-ulp bar on the unpacked and split-K arms; a row's bytes are those of a
one-token call on its own prefix, whatever else is in the batch. The default run takes a sample;
the grid is ``slow``."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from metrale_attn import tolerance
from metrale_attn.config import FEATURES
from metrale_attn.features import FEATURE_RECORDS, SIMT_FEATURES
from metrale_attn.kernels import KernelSpec, all_specs, kernel_params, specs_for
from metrale_attn.problems import Problem
from metrale_attn.sources import KernelSourceError, parse_kernel_params

from support.problems import CountingBackend, decoder, problem, run_poisoned

WIDE = "ignore:.*(head_dim 512 is wider|576, 512.*has no mma kernel).*:RuntimeWarning"
pytestmark = pytest.mark.filterwarnings(WIDE)

ARM = {"unpacked": dict(splitk="off"), "splitk": dict(splitk="3")}


def shaped(head_dim: int, *, v: str = "own", seed=0, page_size=16, seq_lens=(0, 2, 40), kv="bf16", q="bf16",
           layout="NHD") -> Problem:
    """A problem at ``head_dim`` 128 or 512 (4 q heads on 2 KV heads), or MLA's 576/512 (8 q heads
    on one latent KV head) whose v_cache is ``k_cache[..., :512]`` (``v="view"``) or its own tensor."""
    heads = dict(num_q_heads=8, num_kv_heads=1) if head_dim == 576 else dict(num_q_heads=4, num_kv_heads=2)
    p = problem(seed=seed, page_size=page_size, seq_lens=seq_lens, kv_dtype=kv, q_dtype=q, layout=layout,
                head_dim=head_dim, **heads)
    if head_dim != 576:
        return p
    v_cache = p.k_cache[..., :512] if v == "view" else np.ascontiguousarray(p.v_cache[..., 64:])
    return dataclasses.replace(p, v_cache=v_cache)


def tokens(p: Problem, q_len: int, seed=0) -> np.ndarray:
    """A q of ``q_len`` query tokens a sequence, ``[num_seqs, q_len, num_q_heads, head_dim]``."""
    n, h, d = p.q.shape
    return np.random.default_rng(seed).standard_normal((n, q_len, h, d)).astype(p.q.dtype)


def check(p: Problem, out, lse, q) -> None:
    """out within the one bar of the float64 reference for the multi-token q, lse -inf exactly
    where a row sees no key and within 2e-6 elsewhere."""
    ref_out, ref_lse = p.reference(return_lse=True, q=q)
    tolerance.assert_close_to_reference(out, ref_out, v_absmax=p.v_absmax(),
                                        logit_absmax=lambda: p.logit_absmax(q=q))
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty)
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=2e-6, atol=2e-6)


def run_and_check(head_dim, arm, q_len, *, v="own", kv="bf16", q="bf16", page_size=16, seq_lens=(0, 2, 40),
                  layout="NHD", seed=0, impl=None):
    p = shaped(head_dim, v=v, seed=seed, page_size=page_size, seq_lens=seq_lens, kv=kv, q=q, layout=layout)
    qs = tokens(p, q_len, seed)
    attn = decoder(p, max_q_len=8, **ARM[arm], **({"impl": impl} if impl else {}))
    plan = attn.plan(len(seq_lens), q_len)
    assert (attn.impl, plan.impl, plan.arm, plan.q_len) == ("simt", "simt", arm, q_len)
    out, lse = run_poisoned(attn, p, q=qs)
    assert out.shape == (len(seq_lens), q_len, p.q.shape[1], p.v_cache.shape[-1])
    check(p, out, lse, qs)
    return p, qs, out, lse


# -- the bar: a sample here, the grid in the slow step ----------------------------------------


@pytest.mark.parametrize("head_dim, arm, q_len, v, kv, q, page_size", [
    (128, "unpacked", 3, "own", "fp8", "bf16", 1),
    (128, "splitk", 8, "own", "fp16", "fp16", 16),
    (512, "splitk", 2, "own", "bf16", "bf16", 64),
    (512, "unpacked", 8, "own", "fp8", "fp16", 256),
    (576, "splitk", 4, "view", "bf16", "bf16", 16),
    (576, "unpacked", 5, "own", "fp8", "bf16", 1),
])
def test_simt_multi_token_decode_meets_the_one_ulp_bar_with_lse_on_both_arms(head_dim, arm, q_len, v, kv, q, page_size):
    """Sequences of 0 keys, of fewer keys than query tokens (the first tokens see none: out 0,
    lse -inf) and of several pages; 576/512 with v_cache a view of k_cache and its own tensor.
    Head dims 512 and 576/512 run simt under the default impl, 128 under impl='simt'."""
    run_and_check(head_dim, arm, q_len, v=v, kv=kv, q=q, page_size=page_size,
                  seq_lens=(0, 2, 3 * page_size + 5 if page_size < 64 else 70), impl="simt" if head_dim == 128 else None)


@pytest.mark.slow
@pytest.mark.parametrize("head_dim, v", [(128, "own"), (512, "own"), (576, "view"), (576, "own")])
@pytest.mark.parametrize("arm", list(ARM))
@pytest.mark.parametrize("kv, q", [("bf16", "bf16"), ("fp16", "fp16"), ("fp8", "bf16"), ("bf16", "fp16")])
@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
def test_every_simt_multi_token_shape_arm_dtype_and_page_size_meets_the_one_ulp_bar(head_dim, v, arm, kv, q,
                                                                                     page_size):
    """The grid (``slow``): q_len 2..8 across it, both layouts, sequences shorter than q_len,
    one page, several pages, and past a split's 256 keys."""
    case = (head_dim, v, arm, kv, q, page_size)
    q_len = 2 + sum(map(ord, repr(case))) % 7  # 2..8, spread over the grid
    run_and_check(head_dim, arm, q_len, v=v, kv=kv, q=q, page_size=page_size, seq_lens=(0, 1, q_len + 3, 300),
                  layout=("NHD", "HND")[page_size % 3 == 1], seed=page_size + q_len,
                  impl="simt" if head_dim == 128 else None)


# -- the causal rows ---------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim, arm", [(512, "splitk"), (576, "unpacked")])
def test_a_multi_token_row_on_simt_has_the_bytes_of_one_token_decode_on_its_own_prefix(head_dim, arm):
    """Token t of a q_len call on L keys sees exactly the keys before L - q_len + 1 + t: its bytes
    are a one-token call's on that prefix (the same split count), so speculative verification
    gives sequential decode's bytes. A one-token call of the multi-token layer takes the plain
    spec (no multi_token), and those bytes too."""
    L, q_len = 300, 4
    p = shaped(head_dim, v="view", seed=3, seq_lens=(L,))
    qs = tokens(p, q_len, 3)
    be = CountingBackend()
    attn = decoder(p, backend=be, max_q_len=q_len, **ARM[arm])
    out, lse = run_poisoned(attn, p, q=qs)
    check(p, out, lse, qs)
    plain_args = len(kernel_params(KernelSpec(arm, head_dim, "bf16", "bf16", "simt", v_head_dim=512))[
        f"simt_decode_{arm}"])
    assert len(be.launched[0].args) == plain_args + 2  # the multi-token kernel: q's token stride, q_len
    one = decoder(p, max_q_len=1, **ARM[arm])
    for t in range(q_len):
        prefix = dataclasses.replace(p, q=np.ascontiguousarray(qs[:, t]),
                                     seq_lens=np.array([L - q_len + 1 + t], np.int32))
        o1, l1 = run_poisoned(one, prefix)
        assert out[:, t].tobytes() == o1.tobytes() and lse[:, t].tobytes() == l1.tobytes(), t
        assert attn.plan(1, 1).num_splits == attn.plan(1, q_len).num_splits
    be.launched.clear()
    o1, l1 = run_poisoned(attn, dataclasses.replace(p, q=np.ascontiguousarray(qs[:, -1])))
    assert len(be.launched[0].args) == plain_args  # the plain kernel
    assert o1.tobytes() == out[:, -1].tobytes() and l1.tobytes() == lse[:, -1].tobytes()


def test_changing_a_key_after_a_tokens_position_leaves_that_tokens_output_unchanged():
    """The mask, from the data's side: keys past token t's position are invisible to it (the
    later tokens see them, and move)."""
    L, q_len = 40, 3
    p = shaped(512, seed=4, seq_lens=(L,))
    qs = tokens(p, q_len, 4)
    attn = decoder(p, max_q_len=q_len, splitk="off")
    out, _ = run_poisoned(attn, p, q=qs)
    k, v = p.k_cache.copy(), p.v_cache.copy()
    page, slot = divmod(L - 1, p.k_cache.shape[1])  # the last key: token q_len - 1's own position
    at = int(p.block_tables[0, page])
    k[at, slot] = k[at, slot][..., ::-1]
    v[at, slot] = v[at, slot][..., ::-1]
    moved, _ = run_poisoned(attn, dataclasses.replace(p, k_cache=k, v_cache=v), q=qs)
    assert moved[:, : q_len - 1].tobytes() == out[:, : q_len - 1].tobytes()
    assert moved[:, q_len - 1].tobytes() != out[:, q_len - 1].tobytes()


# -- the split-K workspace and merge -----------------------------------------------------------


def test_the_split_k_workspace_holds_each_rows_partials_at_its_seq_token_head_slot():
    """Slot ((seq x q_len + token) x heads + head) x splits + split: each row's split of its own
    keys, against the reference's partials of the one-token call on the row's prefix (a split
    past a row's keys holds the empty state: m = -inf, l = 0)."""
    from metrale_attn import reference

    q_len, splits = 3, 3
    p = shaped(512, seed=6, seq_lens=(600, 2, 0))
    qs = tokens(p, q_len, 6)
    attn = decoder(p, max_q_len=q_len, splitk=str(splits))
    out, lse = run_poisoned(attn, p, q=qs)
    check(p, out, lse, qs)
    n, h, d = len(p.seq_lens), p.q.shape[1], p.v_cache.shape[-1]
    ws = attn.workspace[: n * q_len * h * splits * (d + 2)].reshape(n, q_len, h, splits, d + 2).astype(np.float64)
    for t in range(q_len):
        seen = np.maximum(p.seq_lens - q_len + 1 + t, 0).astype(np.int32)
        ref = reference.splitk_partials(qs[:, t], p.k_cache, p.v_cache, p.block_tables, seen, splits,
                                        kv_layout=p.kv_layout, k_scale=p.k_scale, v_scale=p.v_scale)
        filled = ref[..., -1] != 0
        np.testing.assert_allclose(ws[:, t][filled], ref[filled], rtol=1e-5, atol=1e-5)
        assert np.all(np.isneginf(ws[:, t][~filled][:, -2])) and np.all(ws[:, t][~filled][:, -1] == 0)


# -- batch invariance --------------------------------------------------------------------------


# (a row's bytes alone, in any batch, at any position and under every thread order:
# tests/test_invariance.py)


def test_the_split_count_of_a_simt_multi_token_call_comes_from_the_policy_alone():
    """Not from the batch or q_len: the launch policy's auto count at every batch and token count."""
    p = shaped(512, seq_lens=(5,) * 4)
    attn = decoder(p, max_batch=16, max_q_len=8, splitk="auto")
    counts = {attn.plan(n, t).num_splits for n in (1, 4, 16) for t in (1, 2, 8)}
    assert counts == {attn.plan(1).num_splits}


# -- what is compiled and launched -------------------------------------------------------------


def test_a_simt_multi_token_call_launches_a_cta_per_query_row_and_merges_each_row():
    p = shaped(512, seq_lens=(5,) * 3)
    attn = decoder(p, max_q_len=8, splitk="4")
    plan = attn.plan(3, 5)
    assert [g.grid for g in plan.launches] == [(4, 4, 15), (4, 15, 1)]  # (heads, splits, seqs x tokens)
    assert plan.slots_used == 3 * 5 * 4 * 4
    unpacked = decoder(p, max_q_len=8, splitk="off").plan(3, 5)
    assert [g.grid for g in unpacked.launches] == [(4, 15, 1)]


def test_the_simt_packed_arm_serves_one_token_and_a_multi_token_call_takes_the_unpacked_arm():
    p = problem(seq_lens=(5,), num_q_heads=6, num_kv_heads=1, head_dim=256)
    attn = decoder(p, impl="simt", max_q_len=4, splitk="off", gqa_pack=True)
    assert attn.plan(1, 1).arm == "gqa_packed" and attn.plan(1, 2).arm == "unpacked"
    assert {spec.name for spec in specs_for(attn.config).values()} == {
        "simt_decode_gqa_packed_qbf16_kvbf16_hd256", "simt_decode_unpacked_qbf16_kvbf16_hd256_multi_token"}
    qs = tokens(p, 2, 1)
    out, lse = run_poisoned(attn, p, q=qs)
    check(p, out, lse, qs)
    with pytest.raises(ValueError, match="serves one query token"):
        KernelSpec("gqa_packed", 256, "bf16", "bf16", "simt", features={"multi_token"})


def test_the_multi_token_kernels_add_their_parameters_and_the_plain_simt_abi_is_unchanged():
    """q's token stride and q_len exist only in the multi-token specs (an ``#if PD_MULTI_TOKEN``
    block of the one parameter list), so a plain simt spec's launch ABI, defines and cubin are
    as before the feature."""
    for arm in ARM:
        plain = KernelSpec(arm, 512, "bf16", "fp8", "simt")
        multi = KernelSpec(arm, 512, "bf16", "fp8", "simt", features={"multi_token"})
        kernel = plain.kernels[0]
        names = [p.name for p in kernel_params(plain)[kernel]]
        assert [p.name for p in kernel_params(multi)[kernel]] == names + ["q_stride_token", "q_len"]
        assert "q_len" not in names and "PD_MULTI_TOKEN" not in plain.defines()
        assert multi.defines() == {**plain.defines(), "PD_MULTI_TOKEN": 1}
        assert multi.name == plain.name + "_multi_token"
    assert SIMT_FEATURES == {"multi_token", "csr", "device_scales"} <= set(FEATURES)
    simt_multi_token = [s for s in all_specs() if s.impl == "simt" and s.features == {"multi_token"}]
    assert len(simt_multi_token) == 2 * (4 * 2 * 3) + 2 * 2 * (3 + 1)  # unpacked, split-K; 576/512 and V in K
    with pytest.raises(ValueError, match="no features but csr, device_scales, multi_token"):
        KernelSpec("unpacked", 512, "bf16", "bf16", "simt", features={"window"})


@pytest.mark.parametrize("text", [
    'extern "C" __global__ void k(int a\n#if PD_X\n#if PD_Y\n, int b\n#endif\n#endif\n) {}',
    'extern "C" __global__ void k(int a\n#if PD_X > 1\n, int b\n#endif\n) {}',
    'extern "C" __global__ void k(int a\n#ifdef PD_X\n, int b\n#endif\n) {}',
    'extern "C" __global__ void k(int a\n#if PD_X\n, int b\n) {}',
])
def test_a_parameter_list_conditional_the_host_cannot_evaluate_is_refused(text):
    with pytest.raises(KernelSourceError, match="parameter list"):
        parse_kernel_params(text, {"PD_X": 1})


def test_a_feature_block_of_a_parameter_list_is_read_where_its_define_is_set():
    text = 'extern "C" __global__ void k(int a\n#if PD_X\n  // the feature\'s\n  , float b\n#endif\n) {}'
    assert [p.name for p in parse_kernel_params(text)["k"]] == ["a"]
    assert [p.name for p in parse_kernel_params(text, {"PD_X": 0})["k"]] == ["a"]
    assert [p.name for p in parse_kernel_params(text, {"PD_X": 1})["k"]] == ["a", "b"]


# -- what simt still refuses -------------------------------------------------------------------


def test_simt_with_multi_token_still_refuses_every_other_feature_naming_what_it_lacks():
    p = shaped(512, seq_lens=(5,))
    lacking = [r for r in FEATURE_RECORDS if not r.simt]
    for asked, name in ((dict(window_left=8), "window"), (dict(sinks=True), "sinks"),
                        (dict(logits_soft_cap=30.0), "soft_cap"), (dict(out_dtype="float32"), "out_f32")):
        with pytest.raises(ValueError, match=rf"^impl='simt' has no {name} \(features it lacks: ") as e:
            decoder(p, impl="simt", max_q_len=4, **asked)
        message = str(e.value)
        assert all(f"{r.name} = {r.asked}" in message for r in lacking) and "multi_token = " not in message
        with pytest.raises(ValueError, match=rf"wider than the mma core's .*\(impl='simt' has no {name}\)$"):
            decoder(p, max_q_len=4, **asked)  # the default impl: the fallback's refusal
    for max_q_len, impl in itertools.product((1, 8), ("simt", None)):
        assert decoder(p, max_q_len=max_q_len, **({"impl": impl} if impl else {})).impl == "simt"


def test_precompile_of_a_512_wide_layer_with_speculative_tokens_compiles_the_simt_multi_token_specs():
    """What a construction compiles, ahead: the plain spec for one-token calls and the
    multi-token one for the rest (Gemma-4-26B's global layer, 16 q / 2 KV heads at 512)."""
    from metrale_attn.precompile import Layer, Options, needed_specs
    from metrale_attn.targets import TARGETS

    found = needed_specs([Layer("global", 16, 2, 512)], TARGETS["hopper"], Options(max_q_len=4), environ={})
    assert {n.name for n in found.needed} == {"simt_decode_splitk_qbf16_kvbf16_hd512",
                                              "simt_decode_splitk_qbf16_kvbf16_hd512_multi_token"}
