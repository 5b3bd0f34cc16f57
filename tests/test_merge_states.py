"""merge_states: two attention states of the same queries over disjoint keys merge into the
state of their union, deterministically, exactly for empty states, on the CPU backend and
(the ``backend`` fixture, ``-m gpu``) on a CUDA device."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from metrale_attn import merge_states, reference, tolerance
from metrale_attn.problems import Problem

from support.backends import to_backend, to_host
from support.problems import decoder, problem, run_poisoned


def _part(p: Problem, block_tables, seq_lens, backend="cpu", **options):
    """fp32 out and lse of attending the keys block_tables/seq_lens describe."""
    sub = Problem(p.q, p.k_cache, p.v_cache, block_tables, seq_lens, p.k_scale, p.v_scale, p.kv_layout)
    return run_poisoned(decoder(sub, backend=backend, out_dtype="float32", **options), sub, out_dtype=np.float32)


def _merge(backend, v_a, s_a, v_b, s_b, out=None, lse=None):
    """``merge_states`` of NumPy states on ``backend`` (it follows the arrays: on the device
    they are copies, and so are the results brought back)."""
    put = lambda x: to_backend(backend, x)  # noqa: E731
    merged = merge_states(put(v_a), put(s_a), put(v_b), put(s_b), out=put(out), lse=put(lse))
    return to_host(merged[0]), to_host(merged[1])


@pytest.mark.parametrize("options", [dict(splitk="off"), dict(splitk="3")], ids=["unpacked", "splitk"])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_a_prefix_and_a_suffix_merged_equal_attention_over_the_whole_within_the_bar(backend, options, kv):
    page, prefix_pages = 16, 5
    p = problem(seed=1, page_size=page, seq_lens=(80, 81, 300, 1000), num_q_heads=8, num_kv_heads=2, kv_dtype=kv)
    prefix = prefix_pages * page
    head = _part(p, p.block_tables, np.minimum(p.seq_lens, prefix).astype(np.int32), backend, **options)
    tail = _part(p, np.ascontiguousarray(p.block_tables[:, prefix_pages:]),
                 np.maximum(p.seq_lens - prefix, 0).astype(np.int32), backend, **options)
    merged = np.full(p.q.shape, np.nan, p.q.dtype)
    merged_lse = np.full(p.q.shape[:-1], np.nan, np.float32)
    merged, merged_lse = _merge(backend, head[0], head[1], tail[0], tail[1], out=merged, lse=merged_lse)
    ref, ref_lse = p.reference(return_lse=True)
    tolerance.assert_close_to_reference(merged, ref, v_absmax=p.v_absmax())
    np.testing.assert_allclose(merged_lse, ref_lse, rtol=2e-6)
    assert np.all(np.isneginf(tail[1][0]))  # the 80-token sequence has no suffix: an empty state


def test_an_empty_state_leaves_the_other_bit_for_bit_and_two_give_zeros_and_minus_infinity(backend):
    rng = np.random.default_rng(2)
    v = rng.standard_normal((3, 4, 64)).astype(np.float32)
    s = rng.standard_normal((3, 4)).astype(np.float32)
    garbage = np.full_like(v, np.nan)  # an empty state's v is never read
    empty = np.full_like(s, -np.inf)
    out, lse = _merge(backend, v, s, garbage, empty)
    assert out.tobytes() == v.tobytes() and lse.tobytes() == s.tobytes()
    out, lse = _merge(backend, garbage, empty, v, s)
    assert out.tobytes() == v.tobytes() and lse.tobytes() == s.tobytes()
    out, lse = _merge(backend, garbage, empty, garbage.copy(), empty.copy())
    assert np.all(out == 0) and np.all(np.isneginf(lse))


@pytest.mark.parametrize("in_dtype, out_dtype", [(np.float32, np.float32), (ml_dtypes.bfloat16, ml_dtypes.bfloat16),
                                                 (np.float16, np.float32), (np.float32, np.float16)])
def test_the_merge_is_deterministic_and_matches_the_float64_merge(backend, in_dtype, out_dtype):
    rng = np.random.default_rng(3)
    v_a, v_b = (rng.standard_normal((5, 2, 8, 128)).astype(in_dtype) for _ in range(2))
    s_a, s_b = (rng.normal(0, 3, (5, 2, 8)).astype(np.float32) for _ in range(2))
    s_a[0, 0, :3] = -np.inf
    out = np.empty(v_a.shape, out_dtype)
    first = _merge(backend, v_a, s_a, v_b, s_b, out=out)
    again = _merge(backend, v_a, s_a, v_b, s_b, out=np.empty(v_a.shape, out_dtype))
    assert first[0].tobytes() == again[0].tobytes() and first[1].tobytes() == again[1].tobytes()
    ref, ref_lse = reference.merge_states(v_a, s_a, v_b, s_b)
    if out_dtype == np.float32:
        np.testing.assert_allclose(first[0], ref, rtol=1e-6, atol=1e-6)
    else:
        assert tolerance.ulp_distance(first[0], ref.astype(out_dtype)).max() <= 1
    np.testing.assert_allclose(first[1], ref_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("change, match", [
    (dict(v_b=np.zeros((2, 4, 32), np.float32)), "v_a and v_b must have one shape"),
    (dict(s_a=np.zeros((2, 3), np.float32)), r"s_a must be float32 \[2, 4\]"),
    (dict(s_b=np.zeros((2, 4), np.float64)), r"s_b must be float32"),
    (dict(v_b=np.zeros((2, 4, 64), np.float64)), "must both hold one of bf16, fp16, float32"),
    (dict(out=np.zeros((2, 4, 64), np.int32)), "out must be bf16, fp16 or float32"),
    (dict(v_a=np.zeros((2, 8, 64), np.float32)[:, ::2]), "v_a must be contiguous"),
])
def test_bad_states_are_refused_naming_the_argument(change, match):
    args = dict(v_a=np.zeros((2, 4, 64), np.float32), s_a=np.zeros((2, 4), np.float32),
                v_b=np.zeros((2, 4, 64), np.float32), s_b=np.zeros((2, 4), np.float32))
    out = change.pop("out", None)
    args.update(change)
    if "v_a" in change:
        args["v_b"] = np.zeros(args["v_a"].shape, np.float32)
    with pytest.raises(ValueError, match=match):
        merge_states(**args, out=out)


def test_an_output_that_overlaps_an_input_is_refused():
    v = np.zeros((2, 4, 64), np.float32)
    s = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="out overlaps v_a"):
        merge_states(v, s, v.copy(), s.copy(), out=v)
