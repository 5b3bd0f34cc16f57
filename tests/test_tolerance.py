"""Tests of the correctness bar (metrale_attn.tolerance): exact rounding, ulp distances, the 1-ulp bar
and its near-zero allowance."""

from __future__ import annotations

import ast
import math
import pathlib

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale_attn import DecodeAttention
from metrale_attn import tolerance as T
from metrale_attn.problems import make_problem

BF16 = np.dtype(ml_dtypes.bfloat16)
FP16 = np.dtype(np.float16)


# --------------------------------------------------------------------------------------
# Rounding and ulps
# --------------------------------------------------------------------------------------


def bits_to(dtype, bits):
    return np.array(bits, dtype=np.uint16).view(dtype)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_adjacent_values_are_one_ulp_apart(dtype):
    one = np.array([1.0], dtype=dtype).view(np.uint16)[0]
    a = bits_to(dtype, [one, one, 0x0001, 0x8001, 0x0100, 0x8100])
    b = bits_to(dtype, [one + 1, one - 1, 0x0002, 0x8002, 0x0101, 0x80FF])
    np.testing.assert_array_equal(T.ulp_distance(a, b), [1, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(T.ulp_distance(a, a), 0)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_positive_and_negative_zero_are_zero_ulps_apart(dtype):
    assert T.ulp_distance(bits_to(dtype, [0x0000]), bits_to(dtype, [0x8000]))[0] == 0


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_ulp_distance_across_zero_counts_the_steps_on_both_sides(dtype):
    tiny, minus_tiny = bits_to(dtype, [0x0001]), bits_to(dtype, [0x8001])
    minus_zero = bits_to(dtype, [0x8000])
    assert T.ulp_distance(tiny, minus_tiny)[0] == 2
    assert T.ulp_distance(minus_zero, tiny)[0] == 1
    assert T.ulp_distance(bits_to(dtype, [0x0003]), bits_to(dtype, [0x8002]))[0] == 5


def test_ulp_distance_of_known_bf16_and_fp16_values():
    assert T.ulp_distance(np.array([1.0], BF16), np.array([1.0 + 2**-7], BF16))[0] == 1
    assert T.ulp_distance(np.array([1.0], BF16), np.array([2.0], BF16))[0] == 128
    assert T.ulp_distance(np.array([1.0], FP16), np.array([1.0 + 2**-10], FP16))[0] == 1
    assert T.ulp_distance(np.array([-1.0], FP16), np.array([1.0], FP16))[0] == 2 * 0x3C00
    assert T.ulp_distance(np.array([65504.0], FP16), np.array([np.inf], FP16))[0] == 1


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_nan_is_flagged_as_infinitely_far_from_everything(dtype):
    nan = np.array([np.nan, np.nan, 1.0], dtype=dtype)
    other = np.array([1.0, np.nan, np.nan], dtype=dtype)
    assert (T.ulp_distance(nan, other) == T.ULP_NAN).all()
    assert T.ULP_NAN > 2**17


def test_ulp_distance_refuses_mixed_dtypes():
    with pytest.raises(TypeError):
        T.ulp_distance(np.zeros(2, BF16), np.zeros(2, FP16))


def test_round_to_rounds_once_from_float64_to_nearest_even():
    # Just above the bf16 halfway point between 1 and 1 + 2**-7: rounding through
    # float32 first would land exactly on the tie and go down to 1.
    x = np.array([1 + 2**-8 + 2**-30, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8 + 2**-30)])
    np.testing.assert_array_equal(T.round_to(x, BF16).astype(np.float64), [1 + 2**-7, 1.0, 1 + 2**-6, -(1 + 2**-7)])
    y = np.array([1 + 2**-11 + 2**-40, 1 + 2**-11, 1 + 3 * 2**-11])
    np.testing.assert_array_equal(T.round_to(y, FP16).astype(np.float64), [1 + 2**-10, 1.0, 1 + 2**-9])


def test_round_to_handles_zero_signs_subnormals_overflow_and_nan():
    x = np.array([-0.0, 0.0, -(2.0**-140), 2.0**-133 * 0.75, 1e300, -1e300, np.inf, np.nan, 3.39e38])
    got = T.round_to(x, BF16)
    assert got.dtype == BF16
    bits = got.view(np.uint16)
    assert bits[0] == 0x8000 and bits[1] == 0x0000 and bits[2] == 0x8000
    assert bits[3] == 0x0001  # 0.75 of the smallest subnormal rounds up to it
    assert np.isposinf(got[4]) and np.isneginf(got[5]) and np.isposinf(got[6]) and np.isnan(got[7])
    assert np.isfinite(got[8])
    bf16_max = (2 - 2.0**-7) * 2.0**127
    halfway_to_inf = (2 - 2.0**-8) * 2.0**127  # a tie: even goes up, to infinity
    edge = T.round_to(np.array([halfway_to_inf, np.nextafter(halfway_to_inf, 0)]), BF16)
    assert np.isposinf(edge[0]) and float(edge[1]) == bf16_max
    f16 = T.round_to(np.array([65520.0, 65519.9, 2.0**-25, 2.0**-25 * 1.01]), FP16)
    assert np.isposinf(f16[0]) and f16[1] == 65504.0
    assert f16.view(np.uint16)[2] == 0x0000 and f16.view(np.uint16)[3] == 0x0001


def test_round_to_fp16_agrees_with_numpys_correctly_rounded_cast():
    rng = np.random.default_rng(16)
    x = rng.standard_normal(20000) * np.exp2(rng.uniform(-30, 17, 20000))
    with np.errstate(over="ignore"):  # numpy warns when its cast overflows to inf
        want = x.astype(FP16)
    np.testing.assert_array_equal(T.round_to(x, FP16).view(np.uint16), want.view(np.uint16))


def test_round_to_bf16_agrees_with_ml_dtypes_on_values_already_in_float32():
    rng = np.random.default_rng(17)
    x32 = (rng.standard_normal(20000) * np.exp2(rng.uniform(-140, 127, 20000))).astype(np.float32)
    np.testing.assert_array_equal(
        T.round_to(x32.astype(np.float64), BF16).view(np.uint16), x32.astype(BF16).view(np.uint16)
    )


@settings(max_examples=500, deadline=None)
@given(st.floats(min_value=-3e38, max_value=3e38, allow_nan=False))
def test_round_to_bf16_picks_the_nearer_neighbour(x):
    r = T.round_to(np.array([x]), BF16)
    bits = int(r.view(np.uint16)[0])
    err = abs(float(r[0]) - x)
    for neighbour_bits in (bits + 1, bits - 1):
        neighbour = float(np.array([neighbour_bits & 0xFFFF], np.uint16).view(BF16)[0])
        if math.isfinite(neighbour) and (neighbour >= 0) == (float(r[0]) >= 0):
            assert err <= abs(neighbour - x)


# --------------------------------------------------------------------------------------
# THE correctness bar
# --------------------------------------------------------------------------------------


def _shift_ulps(values, dtype, ulps):
    """Move each (positive) value by `ulps` steps in `dtype`."""
    bits = np.asarray(values, dtype=dtype).view(np.uint16).astype(np.int64) + ulps
    return bits.astype(np.uint16).view(dtype)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_the_bar_accepts_one_ulp_and_rejects_two_ulps_away_from_zero(dtype):
    ref = np.array([0.5, 1.25, 3.0, 0.1])
    rounded = T.round_to(ref, dtype)
    T.assert_close_to_reference(rounded, ref, v_absmax=4.0)
    T.assert_close_to_reference(_shift_ulps(rounded, dtype, 1), ref, v_absmax=4.0)
    T.assert_close_to_reference(_shift_ulps(rounded, dtype, -1), ref, v_absmax=4.0)
    with pytest.raises(AssertionError):
        T.assert_close_to_reference(_shift_ulps(rounded, dtype, 2), ref, v_absmax=4.0)
    bad = rounded.copy()
    bad[2] = _shift_ulps(rounded[2:3], dtype, -2)[0]
    assert list(T.close_to_reference_mask(bad, ref, v_absmax=4.0)) == [True, True, False, True]


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_the_near_zero_allowance_accepts_absolute_errors_up_to_two_to_the_minus_20_of_max_v(dtype):
    v_absmax = 8.0
    allowance = T.NEAR_ZERO_ABS * v_absmax  # 2**-17
    ref = np.array([0.0, 1e-7, -3e-6, 2.0**-30])
    within = (ref + 0.9 * allowance).astype(dtype)  # many ulps off, but tiny in absolute terms
    assert (T.ulp_distance(within, T.round_to(ref, dtype)) > 1).any()
    T.assert_close_to_reference(within, ref, v_absmax=v_absmax)
    beyond = (ref + 1.5 * allowance).astype(dtype)
    assert not T.close_to_reference_mask(beyond, ref, v_absmax=v_absmax).any()
    with pytest.raises(AssertionError):
        T.assert_close_to_reference(beyond, ref, v_absmax=v_absmax)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_nan_in_the_kernel_output_always_fails(dtype):
    ref = np.array([1.0, 0.0])
    out = np.array([1.0, np.nan], dtype=dtype)
    with pytest.raises(AssertionError, match="NaN"):
        T.assert_close_to_reference(out, ref, v_absmax=1e30)


def test_a_failure_message_gives_the_count_the_worst_ulp_its_index_and_both_values():
    ref = np.array([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]])
    out = T.round_to(ref, BF16)
    out[1, 2] = _shift_ulps(out[1, 2:3], BF16, 5)[0]
    out[0, 1] = _shift_ulps(out[0, 1:2], BF16, 3)[0]
    with pytest.raises(AssertionError) as info:
        T.assert_close_to_reference(out, ref, v_absmax=32.0, what="paged_decode out")
    message = str(info.value)
    assert "paged_decode out" in message
    assert "2 of 6" in message
    assert "worst 5 ulp" in message
    assert "(1, 2)" in message
    assert repr(float(out[1, 2])) in message and "32.0" in message


def test_a_shape_mismatch_fails_the_bar():
    with pytest.raises(AssertionError, match="shape"):
        T.assert_close_to_reference(np.zeros((2, 3), BF16), np.zeros((3, 2)), v_absmax=1.0)


def test_the_reference_rounded_to_the_output_dtype_passes_its_own_bar():
    p = make_problem(
        np.random.default_rng(18), num_seqs=3, num_q_heads=8, num_kv_heads=1, head_dim=16,
        page_size=16, seq_lens=[1, 77, 400], kv_dtype="fp8", q_dtype="bf16", layout="NHD",
    )
    ref = p.reference()
    for dtype in (BF16, FP16):
        T.assert_close_to_reference(T.round_to(ref, dtype), ref, v_absmax=p.v_absmax())


def test_the_bar_is_defined_in_one_module_and_nowhere_else():
    """No test, benchmark or package module keeps a tolerance of its own: every ``ULP_BAR`` or
    ``NEAR_ZERO_ABS`` binding in the repository's Python is the one in metrale_attn/tolerance.py."""
    root = pathlib.Path(__file__).resolve().parents[1]
    owner = root / "metrale_attn" / "tolerance.py"
    bindings = []
    for path in sorted(p for folder in ("metrale_attn", "tests", "benchmarks") for p in (root / folder).rglob("*.py")):
        text = path.read_text()
        if "ULP_BAR" not in text and "NEAR_ZERO_ABS" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            bindings += [(path, name) for name in names & {"ULP_BAR", "NEAR_ZERO_ABS"}]
    assert sorted(bindings) == [(owner, "NEAR_ZERO_ABS"), (owner, "ULP_BAR")]


def test_the_near_zero_allowance_grows_with_the_logit_magnitude_as_derived():
    """``max|V| x (2^-20 + 2 u (head_dim / 16 + 2) max|s|)``, u = 2^-24 (module docstring)."""
    assert T.near_zero_allowance(2.0, 0.0, 64) == 2.0 * 2.0**-20
    assert T.near_zero_allowance(2.0, 10.0, 64) == 2.0 * (2.0**-20 + 2 * 2.0**-24 * 6 * 10.0)
    assert T.near_zero_allowance(1.0, 10.0, 256) == 2.0**-20 + 2 * 2.0**-24 * 18 * 10.0
    # At the usual 1/sqrt(head_dim) and unit inputs (|s| <= 8, head dim 128) below 2^-16 max|V|:
    # far under one ulp (bf16 2^-8, fp16 2^-11 relative) of any element but the nearly-cancelled.
    assert T.near_zero_allowance(1.0, 8.0, 128) < 2.0**-16


@pytest.mark.parametrize("seed", [8, 10, 17])
def test_honest_fp32_logits_of_magnitude_near_35_meet_the_bar_only_with_its_logit_term(seed):
    """fp16 q and KV at sm_scale = 1 (as FlashInfer's sink decode test runs it): the logits
    reach |s| ~ 35 and the fp32 rounding of each moves the softmax weights; one output in
    ~2k, where terms cancel, misses the allowance without the logit term, never with it."""
    p = make_problem(np.random.default_rng(seed), num_seqs=4, num_q_heads=8, num_kv_heads=1, head_dim=64,
                     page_size=16, seq_lens=[700, 1200, 333, 1500], kv_dtype="fp16", q_dtype="fp16", layout="NHD")
    attn = DecodeAttention(8, 1, 64, 16, q_dtype="fp16", kv_dtype="fp16", max_batch=4, sm_scale=1.0, backend="cpu")
    out = np.full(p.q.shape, np.nan, p.q.dtype)
    attn.run(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, out=out)
    ref = p.reference(sm_scale=1.0)
    logits = p.logit_absmax(sm_scale=1.0)
    assert logits > 30
    assert not T.close_to_reference_mask(out, ref, v_absmax=p.v_absmax()).all()
    T.assert_close_to_reference(out, ref, v_absmax=p.v_absmax(), logit_absmax=logits)
