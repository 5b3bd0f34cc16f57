"""What today's models need from decode, on the mma core: attention sinks, a sliding window,
the logits soft-cap, multi-token decode, fp8 e5m2 caches; each against the float64
reference under the one bar, batch-invariant, and refused where a kernel cannot serve it.
The cases that take the ``backend`` fixture run on a CUDA device too (``-m gpu``)."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale_attn import tolerance
from metrale_attn.backends.cpu_backend import CpuBackend
from metrale_attn.config import FEATURES, heads_per_cta_choices
from metrale_attn.features import FEATURE_RECORDS
from metrale_attn.problems import Problem

from support.problems import CountingBackend, decoder, problem, run_poisoned

SPLIT = {"unpacked": dict(splitk="off"), "splitk": dict(splitk="3")}
ARMS = dict(SPLIT, gqa_packed=dict(splitk="off", gqa_pack=True))


def _heads(arm):
    return dict(num_q_heads=6, num_kv_heads=1, head_dim=256) if arm == "gqa_packed" else dict(num_q_heads=4,
                                                                                             num_kv_heads=2)


def _run(attn, p: Problem, q=None, sinks=None, out_dtype=None):
    """(out, lse) of a run with both poisoned first, on attn's backend; q may be multi-token."""
    return run_poisoned(attn, p, q=q, sinks=sinks, out_dtype=out_dtype)


def _check(p: Problem, out, lse, q=None, v_absmax=None, **features):
    ref_out, ref_lse = p.reference(return_lse=True, q=q, **features)
    tolerance.assert_close_to_reference(out, ref_out, v_absmax=p.v_absmax() if v_absmax is None else v_absmax)
    neg = np.isneginf(ref_lse)
    assert np.all(np.isneginf(lse[neg]))
    np.testing.assert_allclose(lse[~neg], ref_lse[~neg], rtol=2e-6, atol=2e-6)


def _sinks(num_q_heads, seed=0):
    return np.random.default_rng(seed).normal(0, 2, num_q_heads).astype(np.float32)


# -- attention sinks ---------------------------------------------------------------------


@pytest.mark.parametrize("arm", list(ARMS))
@pytest.mark.parametrize("kv, q", [("bf16", "bf16"), ("fp8", "bf16"), ("fp16", "fp16"), ("bf16", "fp16")])
def test_sinks_join_the_denominator_on_every_arm_and_the_lse_includes_them(backend, arm, kv, q):
    p = problem(seed=3, page_size=7, seq_lens=(0, 1, 40, 700), kv_dtype=kv, q_dtype=q, **_heads(arm))
    sinks = _sinks(p.q.shape[1])
    attn = decoder(p, backend=backend, sinks=True, **ARMS[arm])
    assert attn.plan(4).arm == arm
    out, lse = _run(attn, p, sinks=sinks)
    _check(p, out, lse, sinks=sinks)
    assert np.all(lse[0] == sinks)  # an empty sequence: only the sink's e^sink is in the denominator


def test_a_sink_of_minus_infinity_gives_the_bytes_of_no_sink_and_a_huge_one_silences_the_head(backend):
    p = problem(seed=4, page_size=16, seq_lens=(300, 5), num_q_heads=8, num_kv_heads=2)
    for options in SPLIT.values():
        plain = _run(decoder(p, backend=backend, **options), p)
        none = _run(decoder(p, backend=backend, sinks=True, **options), p, sinks=np.full(8, -np.inf, np.float32))
        assert plain[0].tobytes() == none[0].tobytes() and plain[1].tobytes() == none[1].tobytes()
        huge = np.full(8, 80.0, np.float32)
        out, lse = _run(decoder(p, backend=backend, sinks=True, **options), p, sinks=huge)
        _check(p, out, lse, sinks=huge)
        assert np.abs(out.astype(np.float32)).max() < 1e-20 and np.allclose(lse, 80.0)


def test_with_sinks_a_heads_bytes_do_not_depend_on_heads_per_cta_or_on_the_batch(backend):
    p = problem(seed=5, page_size=5, seq_lens=(333, 0, 20), num_q_heads=8, num_kv_heads=1, kv_dtype="fp8")
    sinks = _sinks(8, 1)
    first = None
    for h in heads_per_cta_choices(8):
        out, lse = _run(decoder(p, backend=backend, sinks=True, heads_per_cta=h, splitk="auto"), p, sinks=sinks)
        first = first or (out.tobytes(), lse.tobytes())
        assert (out.tobytes(), lse.tobytes()) == first, h
    alone = Problem(p.q[:1], p.k_cache, p.v_cache, p.block_tables[:1], p.seq_lens[:1], p.k_scale, p.v_scale,
                    p.kv_layout)
    out, _ = _run(decoder(alone, backend=backend, sinks=True, splitk="auto"), alone, sinks=sinks)
    assert out[0].tobytes() == np.frombuffer(first[0], p.q.dtype).reshape(p.q.shape)[0].tobytes()


# -- sliding window ------------------------------------------------------------------------


@pytest.mark.parametrize("arm", list(SPLIT))
@pytest.mark.parametrize("window", [0, 1, 15, 16, 255, 256, 300, 5000])
def test_a_sliding_window_attends_to_the_last_window_left_plus_one_keys(backend, arm, window):
    """Windows of 0 keys back, across page (16) and split (256, and 3 splits of >= 256)
    boundaries, and wider than every sequence."""
    p = problem(seed=window, page_size=16, seq_lens=(0, 1, 17, 290, 1100), kv_dtype="fp8", q_dtype="fp16")
    attn = decoder(p, backend=backend, window_left=window, **SPLIT[arm])
    out, lse = _run(attn, p)
    _check(p, out, lse, window_left=window)


def test_pages_before_every_window_may_be_freed_and_are_never_read():
    p = problem(seed=8, page_size=16, seq_lens=(700, 64), num_q_heads=4, num_kv_heads=1)
    table = p.block_tables.copy()
    table[0, : (700 - 1 - 100) // 16] = -1  # every page before the window of the last token
    freed = Problem(p.q, p.k_cache, p.v_cache, table, p.seq_lens, p.k_scale, p.v_scale, p.kv_layout)
    for options in SPLIT.values():
        out, lse = _run(decoder(freed, window_left=100, **options), freed)
        _check(freed, out, lse, window_left=100, v_absmax=p.v_absmax())
    with pytest.raises(ValueError, match=r"block_tables\[0, 0\] = -1"):
        _run(decoder(freed), freed)  # without the window every page is needed


def test_with_a_window_the_split_count_still_comes_from_the_policy_and_bytes_from_the_sequence_alone(backend):
    p = problem(seed=9, page_size=3, seq_lens=(2000, 40, 900), num_q_heads=8, num_kv_heads=2)
    attn = decoder(p, backend=backend, window_left=600, splitk="auto")
    assert attn.plan(3).num_splits == decoder(p, backend=backend, splitk="auto").plan(3).num_splits
    out, _ = _run(attn, p)
    alone = Problem(p.q[2:], p.k_cache, p.v_cache, p.block_tables[2:], p.seq_lens[2:], p.k_scale, p.v_scale,
                    p.kv_layout)
    alone_out, _ = _run(decoder(alone, backend=backend, window_left=600, splitk="auto"), alone)
    assert alone_out[0].tobytes() == out[2].tobytes()


# -- logits soft-cap -----------------------------------------------------------------------


@pytest.mark.parametrize("arm", list(ARMS))
@pytest.mark.parametrize("cap", [50.0, 5.0, 0.5])
def test_the_logits_soft_cap_matches_the_reference_even_with_huge_logits(backend, arm, cap):
    p = problem(seed=10, page_size=16, seq_lens=(1, 77, 600), kv_dtype="bf16", **_heads(arm))
    huge = (p.q.astype(np.float32) * 40).astype(p.q.dtype)  # logits of hundreds: capped to +-cap
    big = Problem(huge, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, p.k_scale, p.v_scale, p.kv_layout)
    out, lse = _run(decoder(big, backend=backend, logits_soft_cap=cap, **ARMS[arm]), big)
    _check(big, out, lse, logits_soft_cap=cap)


def test_soft_cap_and_sinks_and_a_window_together_match_the_reference(backend):
    p = problem(seed=11, page_size=7, seq_lens=(0, 10, 500), num_q_heads=8, num_kv_heads=2, kv_dtype="fp16")
    sinks = _sinks(8, 2)
    for options in SPLIT.values():
        attn = decoder(p, backend=backend, logits_soft_cap=20.0, sinks=True, window_left=130, **options)
        out, lse = _run(attn, p, sinks=sinks)
        _check(p, out, lse, logits_soft_cap=20.0, sinks=sinks, window_left=130)


# -- multi-token decode ----------------------------------------------------------------------


def _multi_q(p: Problem, q_len: int, seed=0) -> np.ndarray:
    n, h, d = p.q.shape
    return np.random.default_rng(seed).standard_normal((n, q_len, h, d)).astype(p.q.dtype)


@pytest.mark.parametrize("arm", list(SPLIT))
@pytest.mark.parametrize("q_len", [1, 2, 3, 8])
def test_multi_token_decode_attends_causally_and_matches_the_reference(backend, arm, q_len):
    p = problem(seed=q_len, page_size=5, seq_lens=(2, 9, 300, 1100), num_q_heads=4, num_kv_heads=2, kv_dtype="fp8")
    q = _multi_q(p, q_len)
    attn = decoder(p, backend=backend, max_q_len=8, **SPLIT[arm])
    out, lse = _run(attn, p, q=q)
    _check(p, out, lse, q=q)
    assert np.all(np.isneginf(lse[0, : max(q_len - 2, 0)]))  # q_len > seq_len: tokens that see nothing


@pytest.mark.parametrize("arm", list(SPLIT))
def test_a_query_tokens_bytes_are_those_of_one_token_decode_on_its_own_prefix(backend, arm):
    """Token i of a q_len call on L keys is a q_len = 1 call on the first L - q_len + 1 + i
    keys: speculative verification gives exactly the bytes of sequential decode."""
    L, q_len = 700, 5
    p = problem(seed=12, page_size=16, seq_lens=(L,), num_q_heads=8, num_kv_heads=2, kv_dtype="bf16")
    q = _multi_q(p, q_len, 1)
    attn = decoder(p, backend=backend, max_q_len=q_len, **SPLIT[arm])
    out, lse = _run(attn, p, q=q)
    one = decoder(p, backend=backend, **SPLIT[arm])
    for i in range(q_len):
        prefix = Problem(q[:, i], p.k_cache, p.v_cache, p.block_tables, np.array([L - q_len + 1 + i], np.int32),
                         p.k_scale, p.v_scale, p.kv_layout)
        o1, l1 = _run(one, prefix)
        assert out[:, i].tobytes() == o1.tobytes() and lse[:, i].tobytes() == l1.tobytes(), i


def test_multi_token_rows_give_identical_bytes_for_every_heads_per_cta_and_batch_position(backend):
    p = problem(seed=13, page_size=7, seq_lens=(400, 30, 0), num_q_heads=8, num_kv_heads=1, kv_dtype="fp16",
                q_dtype="bf16")
    q = _multi_q(p, 2, 2)
    first = None
    for h in heads_per_cta_choices(8, 2):
        out, lse = _run(decoder(p, backend=backend, max_q_len=2, heads_per_cta=h, splitk="auto"), p, q=q)
        first = first or (out.tobytes(), lse.tobytes())
        assert (out.tobytes(), lse.tobytes()) == first, h
    rows = [2, 0, 1]
    shuffled = Problem(p.q[rows], p.k_cache, p.v_cache, p.block_tables[rows], p.seq_lens[rows], p.k_scale,
                       p.v_scale, p.kv_layout)
    out, _ = _run(decoder(shuffled, backend=backend, max_q_len=2, splitk="auto"), shuffled, q=q[rows])
    assert out[1].tobytes() == np.frombuffer(first[0], q.dtype).reshape(q.shape)[0].tobytes()


def test_multi_token_decode_with_a_window_and_sinks_matches_the_reference(backend):
    p = problem(seed=14, page_size=16, seq_lens=(50, 520), num_q_heads=4, num_kv_heads=1, kv_dtype="bf16",
                q_dtype="fp16")
    q, sinks = _multi_q(p, 4, 3), _sinks(4, 3)
    for options in SPLIT.values():
        attn = decoder(p, backend=backend, max_q_len=4, window_left=33, sinks=True, **options)
        out, lse = _run(attn, p, q=q, sinks=sinks)
        _check(p, out, lse, q=q, window_left=33, sinks=sinks)


def test_the_plan_of_a_multi_token_call_keeps_heads_times_tokens_within_two_row_tiles():
    attn = decoder(problem(seq_lens=(10,), num_q_heads=16, num_kv_heads=1), max_q_len=8, splitk="off",
                   max_batch=256)
    assert [attn.plan(256, t).heads_per_cta for t in (1, 2, 4, 8)] == [16, 8, 4, 2]
    assert [attn.plan(256, t).row_tiles for t in (1, 2, 4, 8)] == [2, 2, 2, 2]
    assert attn.plan(256, 3).heads_per_cta * 3 <= 16


# -- fp8 e5m2 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("arm", list(ARMS))
@pytest.mark.parametrize("q", ["bf16", "fp16"])
def test_an_fp8_e5m2_cache_matches_the_reference_on_every_arm(backend, arm, q):
    p = problem(seed=15, page_size=16, seq_lens=(0, 3, 333), kv_dtype="fp8_e5m2", q_dtype=q, layout="HND",
                **_heads(arm))
    out, lse = _run(decoder(p, backend=backend, **ARMS[arm]), p)
    _check(p, out, lse)


def test_e5m2_bits_given_as_uint8_give_the_same_bytes():
    p = problem(seed=16, page_size=16, seq_lens=(99,), kv_dtype="fp8_e5m2")
    attn = decoder(p)
    a = attn.run(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, k_scale=p.k_scale, v_scale=p.v_scale)
    b = attn.run(p.q, p.k_cache.view(np.uint8), p.v_cache.view(np.uint8), p.block_tables, p.seq_lens,
                 k_scale=p.k_scale, v_scale=p.v_scale)
    assert a.tobytes() == b.tobytes()
    with pytest.raises(ValueError, match="k_cache must hold fp8e5m2"):
        attn.run(p.q, p.k_cache.astype(ml_dtypes.float8_e4m3fn), p.v_cache, p.block_tables, p.seq_lens)


# -- fp32 out ----------------------------------------------------------------------------------


@pytest.mark.parametrize("arm", list(ARMS))
def test_fp32_outputs_are_within_fp32_rounding_of_the_reference(backend, arm):
    p = problem(seed=17, page_size=16, seq_lens=(0, 5, 600), kv_dtype="fp8", **_heads(arm))
    out, lse = _run(decoder(p, backend=backend, out_dtype="float32", **ARMS[arm]), p, out_dtype=np.float32)
    ref, ref_lse = p.reference(return_lse=True)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=2e-6 * p.v_absmax())
    bf16 = _run(decoder(p, backend=backend, **ARMS[arm]), p)[0]
    assert tolerance.ulp_distance(out.astype(p.q.dtype), bf16).max() <= 1


# -- what a kernel cannot do is refused, never ignored ------------------------------------------


P = problem(seed=1, seq_lens=(5, 40))


@pytest.mark.parametrize("options, run_kwargs, match", [
    (dict(), dict(sinks=np.zeros(4, np.float32)), "built without sinks"),
    (dict(sinks=True), dict(), "sinks must be given"),
    (dict(sinks=True), dict(sinks=np.zeros(3, np.float32)), r"sinks must be a contiguous float32 \[4\]"),
    (dict(sinks=True), dict(sinks=np.zeros(4, np.float64)), r"sinks must be a contiguous float32 \[4\]"),
    (dict(sinks=True), dict(sinks=np.array([0, np.nan, 0, 0], np.float32)), r"sinks\[1\] = nan"),
    (dict(sinks=True), dict(sinks=np.array([0, 0, np.inf, 0], np.float32)), r"sinks\[2\] = inf"),
    (dict(), dict(q=np.zeros((2, 2, 4, 64), ml_dtypes.bfloat16)), r"q must have shape \[num_seqs, 4, 64\]"),
    (dict(max_q_len=2), dict(q=np.zeros((2, 3, 4, 64), ml_dtypes.bfloat16)), r"q_len \(1..2\)"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_a_feature_the_object_was_not_built_for_is_refused_before_any_launch(options, run_kwargs, match):
    be = CountingBackend()
    attn = decoder(P, backend=be, **options)
    q = run_kwargs.pop("q", P.q)
    with pytest.raises(ValueError, match=match):
        attn.run(q, P.k_cache, P.v_cache, P.block_tables, P.seq_lens, **run_kwargs)
    assert be.launches == []


ASKED = {"multi_token": dict(max_q_len=2), "window": dict(window_left=4), "soft_cap": dict(logits_soft_cap=30.0),
         "sinks": dict(sinks=True), "out_f32": dict(out_dtype="float32"), "device_scales": dict(device_scales=True),
         "csr": dict(page_table="csr")}
"""The keyword that asks for each feature (a new feature adds its own here)."""


@pytest.mark.parametrize("record", [f for f in FEATURE_RECORDS if f.arrays], ids=lambda f: f.name)
def test_a_features_arrays_given_to_a_layer_without_it_are_refused_naming_the_keyword_that_builds_one(record):
    be = CountingBackend()
    attn = decoder(P, backend=be)
    arrays = {a.name: np.zeros(1, np.float32) for a in record.arrays}
    with pytest.raises(ValueError) as refused:
        attn.run(P.q, P.k_cache, P.v_cache, P.block_tables, P.seq_lens, **arrays)
    message = str(refused.value)  # the layer's refusal (Feature.refuse_without), not an array checker's
    assert "this DecodeAttention was built" in message and next(iter(ASKED[record.name])) in message
    assert be.launches == []


def test_a_misspelt_array_keyword_of_run_is_refused_not_ignored():
    attn = decoder(P, sinks=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'sink'"):
        attn.run(P.q, P.k_cache, P.v_cache, P.block_tables, P.seq_lens, sink=np.zeros(4, np.float32))


@pytest.mark.parametrize("options, match", [
    (dict(logits_soft_cap=-1.0), "logits_soft_cap must be a finite float > 0"),
    (dict(logits_soft_cap=float("inf")), "logits_soft_cap must be a finite float > 0"),
    (dict(window_left=-2), r"window_left must be an int in -1\.\.2147483647"),
    (dict(window_left=2**31), r"window_left must be an int in -1\.\.2147483647"),  # the kernels' int32
    (dict(max_q_len=9), r"max_q_len must be an int in 1..8"),
    (dict(max_q_len=2, heads_per_cta=16), r"heads_per_cta must divide the group size 16 and be at most 8"),
    (dict(impl="simt", sinks=True), "impl='simt' has no sink"),
    (dict(impl="simt", window_left=10), "impl='simt' has no win"),
    (dict(out_dtype="float16"), "out_dtype must be one of bf16, float32"),
])
def test_a_feature_the_kernels_cannot_serve_is_refused_at_construction(options, match):
    p = problem(seq_lens=(5,), num_q_heads=16, num_kv_heads=1) if "heads_per_cta" in options else P
    with pytest.raises((ValueError, TypeError), match=match):
        decoder(p, **options)


def test_the_simt_refusal_names_every_feature_it_lacks_and_the_keyword_that_asks_for_it():
    """A layer asking ``simt`` for a feature it lacks is refused naming that feature first, and the
    message lists every feature it lacks with the keyword that asks for it (from the records); a
    feature it serves (``Feature.simt``: multi_token, device_scales, csr) builds a simt layer that
    has it, and is not listed."""
    assert set(ASKED) == set(FEATURES)
    for record in FEATURE_RECORDS:
        if record.simt:
            attn = decoder(P, impl="simt", **ASKED[record.name])
            assert attn.impl == "simt" and attn.config.features == {record.name}
            continue
        with pytest.raises(ValueError) as refused:
            decoder(P, impl="simt", **ASKED[record.name])
        message = str(refused.value)
        assert message.startswith(f"impl='simt' has no {record.name} (features it lacks: ")
        assert message.endswith("impl='mma'")
        for other in FEATURE_RECORDS:
            keyword = next(iter(ASKED[other.name]))
            assert other.asked.startswith(keyword), other.name
            assert (f"{other.name} = {other.asked}" in message) != other.simt, other.name


def test_simt_refuses_an_fp8_e5m2_cache():
    p = problem(seq_lens=(5,), kv_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="fp8 e5m2"):
        decoder(p, impl="simt")


def test_features_are_carried_in_the_variant_names_and_compiled_only_when_used():
    be = CountingBackend()
    decoder(P, backend=be, splitk="off")
    assert be.loaded == ["decode_unpacked_qbf16_kvbf16_hd64_r8"]
    be = CountingBackend()
    decoder(P, backend=be, splitk="off", sinks=True, window_left=5, logits_soft_cap=3.0, max_q_len=2)
    assert sorted(be.loaded) == ["decode_unpacked_qbf16_kvbf16_hd64_r8_multi_token_window_soft_cap_sinks",
                                 "decode_unpacked_qbf16_kvbf16_hd64_r8_window_soft_cap_sinks"]


def test_feature_bytes_hold_under_the_seeded_thread_orders():
    p = problem(seed=18, page_size=3, seq_lens=(90, 250), num_q_heads=4, num_kv_heads=1, kv_dtype="fp8_e5m2")
    q, sinks = _multi_q(p, 3, 4), _sinks(4, 4)
    options = dict(max_q_len=3, window_left=70, sinks=True, logits_soft_cap=10.0, splitk="2")
    base = _run(decoder(p, **options), p, q=q, sinks=sinks)
    for order in ("reverse", "shuffle:4", "warp-ahead:3"):
        got = _run(decoder(p, backend=CpuBackend(order=order), **options), p, q=q, sinks=sinks)
        assert got[0].tobytes() == base[0].tobytes() and got[1].tobytes() == base[1].tobytes(), order


@settings(max_examples=int(os.environ.get("METRALE_FUZZ_EXAMPLES", 12)), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    arm=st.sampled_from(list(SPLIT)),
    kv=st.sampled_from(["bf16", "fp16", "fp8", "fp8_e5m2"]),
    q=st.sampled_from(["bf16", "fp16"]),
    group=st.sampled_from([1, 2, 3, 4, 8]),
    head_dim=st.sampled_from([64, 128, 256]),
    page_size=st.sampled_from([1, 3, 16, 64]),
    q_len=st.integers(1, 4),
    window=st.sampled_from([-1, 0, 7, 200]),
    cap=st.sampled_from([None, 8.0]),
    with_sinks=st.booleans(),
    lengths=st.lists(st.integers(0, 900), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_random_feature_combinations_match_the_reference(arm, kv, q, group, head_dim, page_size, q_len, window,
                                                         cap, with_sinks, lengths, seed):
    p = problem(seed=seed, num_q_heads=group * 2, num_kv_heads=2, head_dim=head_dim, page_size=page_size,
                seq_lens=tuple(lengths), kv_dtype=kv, q_dtype=q, layout=("NHD", "HND")[seed % 2])
    qm = _multi_q(p, q_len, seed)
    sinks = _sinks(group * 2, seed) if with_sinks else None
    attn = decoder(p, max_q_len=q_len, window_left=window, logits_soft_cap=cap, sinks=with_sinks, **SPLIT[arm])
    out, lse = _run(attn, p, q=qm, sinks=sinks)
    _check(p, out, lse, q=qm, window_left=window, logits_soft_cap=cap, sinks=sinks)
