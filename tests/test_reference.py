"""Tests of the float64 reference (metrale_attn.reference): against naive loops, paging, lse, split-K."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale_attn import reference as R
from metrale_attn.policy import PD_MIN_KV_PER_SPLIT
from metrale_attn.problems import GARBAGE_PAGE_ID, Problem, make_problem


# --------------------------------------------------------------------------------------
# A deliberately naive implementation: explicit loops, element-by-element cache reads,
# fp8 bits decoded by hand.
# --------------------------------------------------------------------------------------


def decode_e4m3fn_bits(byte: int) -> float:
    """fp8 e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no inf."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent = (byte >> 3) & 0xF
    mantissa = byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * (mantissa / 8.0) * 2.0**-6
    return sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)


def stored_value(cache, page, offset, kv_head, d, layout) -> float:
    if layout.upper() == "NHD":
        element = cache[page, offset, kv_head, d]
    else:
        element = cache[page, kv_head, offset, d]
    if cache.dtype == np.uint8:
        return decode_e4m3fn_bits(int(element))
    return float(element)


def naive_paged_decode(q, k_cache, v_cache, block_tables, seq_lens, layout, sm_scale, k_scale, v_scale):
    num_seqs, num_q_heads, head_dim = q.shape
    if layout.upper() == "NHD":
        page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    else:
        num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = np.zeros((num_seqs, num_q_heads, head_dim))
    lse = np.full((num_seqs, num_q_heads), -np.inf)
    for s in range(num_seqs):
        length = int(seq_lens[s])
        for h in range(num_q_heads):
            kv_head = h // group
            qv = [float(q[s, h, d]) for d in range(head_dim)]
            logits, values = [], []
            for t in range(length):
                page = int(block_tables[s, t // page_size])
                offset = t % page_size
                k = [k_scale * stored_value(k_cache, page, offset, kv_head, d, layout) for d in range(head_dim)]
                values.append(
                    [v_scale * stored_value(v_cache, page, offset, kv_head, d, layout) for d in range(head_dim)]
                )
                logits.append(sm_scale * math.fsum(qv[d] * k[d] for d in range(head_dim)))
            if not logits:
                continue
            m = max(logits)
            weights = [math.exp(x - m) for x in logits]
            denom = math.fsum(weights)
            for d in range(head_dim):
                out[s, h, d] = math.fsum(w * vt[d] for w, vt in zip(weights, values)) / denom
            lse[s, h] = m + math.log(denom)
    return out, lse


def decode_args(p: Problem) -> dict:
    return dict(kv_layout=p.kv_layout, k_scale=p.k_scale, v_scale=p.v_scale)


# --------------------------------------------------------------------------------------
# Reference against the naive loops
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16", "fp8", "uint8"])
@pytest.mark.parametrize("gqa_ratio", [1, 4, 6])
@pytest.mark.parametrize("page_size", [1, 16, 7])
def test_reference_matches_a_naive_loop_implementation(layout, kv_dtype, gqa_ratio, page_size):
    rng = np.random.default_rng([page_size, gqa_ratio, len(kv_dtype), len(layout)])
    num_kv_heads = 2
    scales = {} if kv_dtype in ("fp8", "uint8") else dict(k_scale=0.75, v_scale=1.5)
    p = make_problem(
        rng,
        num_seqs=4,
        num_q_heads=num_kv_heads * gqa_ratio,
        num_kv_heads=num_kv_heads,
        head_dim=8,
        page_size=page_size,
        seq_lens=[0, 1, 17, 40],
        kv_dtype=kv_dtype,
        q_dtype="fp16" if kv_dtype == "fp16" else "bf16",
        layout=layout,
        share_prefix_pages=1,
        **scales,
    )
    sm_scale = 0.3
    out, lse = R.paged_decode(
        p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, sm_scale=sm_scale, return_lse=True, **decode_args(p)
    )
    want_out, want_lse = naive_paged_decode(
        p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, layout, sm_scale, p.k_scale, p.v_scale
    )
    assert out.dtype == np.float64 and out.shape == p.q.shape
    assert lse.dtype == np.float64 and lse.shape == p.q.shape[:2]
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-12, atol=1e-13)


def test_every_finite_fp8_bit_pattern_decodes_like_the_hand_written_e4m3fn_decoder():
    bits = np.arange(256, dtype=np.uint8)
    decoded = R.to_float64(bits)
    for byte in range(256):
        want = decode_e4m3fn_bits(byte)
        if math.isnan(want):
            assert math.isnan(decoded[byte])
        else:
            assert decoded[byte] == want, byte


def test_fp8_as_uint8_bits_and_as_float8_dtype_give_identical_results():
    p = make_problem(
        np.random.default_rng(1), num_seqs=3, num_q_heads=4, num_kv_heads=2, head_dim=16,
        page_size=16, seq_lens=[5, 33, 64], kv_dtype="fp8", q_dtype="bf16", layout="NHD",
    )
    as_float8 = R.paged_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, **decode_args(p))
    as_bits = R.paged_decode(
        p.q, p.k_cache.view(np.uint8), p.v_cache.view(np.uint8), p.block_tables, p.seq_lens, **decode_args(p)
    )
    np.testing.assert_array_equal(as_float8, as_bits)


def test_the_nhd_and_hnd_layouts_of_the_same_cache_give_identical_results():
    p = make_problem(
        np.random.default_rng(2), num_seqs=3, num_q_heads=6, num_kv_heads=3, head_dim=16,
        page_size=7, seq_lens=[1, 20, 50], kv_dtype="bf16", q_dtype="bf16", layout="NHD",
    )
    nhd = R.paged_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, kv_layout="NHD", return_lse=True)
    hnd = R.paged_decode(
        p.q,
        np.ascontiguousarray(p.k_cache.transpose(0, 2, 1, 3)),
        np.ascontiguousarray(p.v_cache.transpose(0, 2, 1, 3)),
        p.block_tables,
        p.seq_lens,
        kv_layout="HND",
        return_lse=True,
    )
    np.testing.assert_array_equal(nhd[0], hnd[0])
    np.testing.assert_array_equal(nhd[1], hnd[1])


def test_layout_names_are_case_insensitive_and_a_bad_one_is_rejected_naming_the_argument():
    p = make_problem(
        np.random.default_rng(3), num_seqs=2, num_q_heads=2, num_kv_heads=1, head_dim=8,
        page_size=4, seq_lens=[3, 9], kv_dtype="fp16", q_dtype="fp16", layout="HND",
    )
    upper = R.paged_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, kv_layout="HND")
    lower = R.paged_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, kv_layout="hnd")
    np.testing.assert_array_equal(upper, lower)
    with pytest.raises(ValueError, match="kv_layout"):
        R.paged_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, kv_layout="NDH")
    with pytest.raises(ValueError, match="layout"):
        R.gather_kv(p.k_cache, p.block_tables, p.seq_lens, 0, "BHSD")


def test_gather_kv_returns_the_stored_tokens_in_order_without_scaling():
    page_size, num_kv_heads, head_dim = 4, 2, 3
    num_pages = 5
    # Stored value encodes (page, offset, head, d) so the gather order is visible.
    cache = np.zeros((num_pages, page_size, num_kv_heads, head_dim))
    for idx in np.ndindex(cache.shape):
        cache[idx] = 1000 * idx[0] + 100 * idx[1] + 10 * idx[2] + idx[3]
    block_tables = np.array([[3, 0, 4, GARBAGE_PAGE_ID]], dtype=np.int32)
    seq_lens = np.array([10], dtype=np.int32)
    got = R.gather_kv(cache, block_tables, seq_lens, 0, "nhd")
    assert got.shape == (10, num_kv_heads, head_dim) and got.dtype == np.float64
    for t in range(10):
        page = block_tables[0, t // page_size]
        np.testing.assert_array_equal(got[t], cache[page, t % page_size])
    got_hnd = R.gather_kv(np.ascontiguousarray(cache.transpose(0, 2, 1, 3)), block_tables, seq_lens, 0, "HND")
    np.testing.assert_array_equal(got_hnd, got)


# --------------------------------------------------------------------------------------
# Paging: order, sharing, garbage
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_permuting_the_page_pool_and_the_block_table_together_changes_nothing(layout):
    rng = np.random.default_rng(4)
    p = make_problem(
        rng, num_seqs=3, num_q_heads=8, num_kv_heads=2, head_dim=16, page_size=16,
        seq_lens=[1, 100, 300], kv_dtype="bf16", q_dtype="bf16", layout=layout, shuffle_pages=False,
    )
    before = R.paged_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, return_lse=True, **decode_args(p))
    num_pages = p.k_cache.shape[0]
    perm = rng.permutation(num_pages)  # new page j holds old page perm[j]
    new_id_of_old = np.argsort(perm)
    tables = p.block_tables.copy()
    used = tables != GARBAGE_PAGE_ID
    tables[used] = new_id_of_old[tables[used]]
    after = R.paged_decode(p.q, p.k_cache[perm], p.v_cache[perm], tables, p.seq_lens, return_lse=True, **decode_args(p))
    np.testing.assert_array_equal(before[0], after[0])
    np.testing.assert_array_equal(before[1], after[1])


def test_sequences_sharing_pages_read_the_shared_pages_and_match_the_naive_loops():
    rng = np.random.default_rng(5)
    p = make_problem(
        rng, num_seqs=3, num_q_heads=4, num_kv_heads=4, head_dim=8, page_size=8,
        seq_lens=[40, 20, 3], kv_dtype="fp16", q_dtype="fp16", layout="NHD", share_prefix_pages=2,
    )
    assert p.block_tables[0, 0] == p.block_tables[1, 0] == p.block_tables[2, 0]
    assert p.block_tables[0, 1] == p.block_tables[1, 1]
    # Same query and same length on the same shared pages -> same result.
    q = p.q.copy()
    q[1] = q[0]
    lens = np.array([16, 16, 3], dtype=np.int32)
    out = R.paged_decode(q, p.k_cache, p.v_cache, p.block_tables, lens, **decode_args(p))
    np.testing.assert_array_equal(out[0], out[1])
    want, _ = naive_paged_decode(
        p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, "NHD", 1 / math.sqrt(8), 1.0, 1.0
    )
    np.testing.assert_allclose(R.paged_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens), want, rtol=1e-12)


@pytest.mark.parametrize("garbage", [GARBAGE_PAGE_ID, -1, -(2**31), 2**31 - 1])
def test_garbage_block_table_entries_past_the_last_page_are_never_read(garbage):
    rng = np.random.default_rng(6)
    p = make_problem(
        rng, num_seqs=3, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=16,
        seq_lens=[0, 16, 17], kv_dtype="bf16", q_dtype="bf16", layout="HND",
    )
    clean = p.block_tables.copy()
    clean[clean == GARBAGE_PAGE_ID] = 0  # a valid page, whose contents must not matter
    dirty = p.block_tables.copy()
    dirty[dirty == GARBAGE_PAGE_ID] = garbage
    assert (dirty == garbage).sum() >= 3  # every row has a garbage tail
    want = R.paged_decode(p.q, p.k_cache, p.v_cache, clean, p.seq_lens, return_lse=True, **decode_args(p))
    got = R.paged_decode(p.q, p.k_cache, p.v_cache, dirty, p.seq_lens, return_lse=True, **decode_args(p))
    np.testing.assert_array_equal(want[0], got[0])
    np.testing.assert_array_equal(want[1], got[1])
    parts = R.splitk_partials(p.q, p.k_cache, p.v_cache, dirty, p.seq_lens, 3, **decode_args(p))
    assert not np.isnan(parts).any()


@pytest.mark.parametrize("bad_page", [-1, 10**6])
def test_a_needed_page_id_outside_the_pool_raises_instead_of_wrapping(bad_page):
    rng = np.random.default_rng(7)
    p = make_problem(
        rng, num_seqs=1, num_q_heads=2, num_kv_heads=1, head_dim=8, page_size=4,
        seq_lens=[9], kv_dtype="bf16", q_dtype="bf16", layout="NHD",
    )
    tables = p.block_tables.copy()
    tables[0, 2] = bad_page  # token 8 lives here
    with pytest.raises(IndexError, match=r"block_tables\[0, 2\]"):
        R.paged_decode(p.q, p.k_cache, p.v_cache, tables, p.seq_lens)


def test_a_sequence_longer_than_its_block_table_row_is_rejected():
    rng = np.random.default_rng(8)
    p = make_problem(
        rng, num_seqs=1, num_q_heads=2, num_kv_heads=1, head_dim=8, page_size=4,
        seq_lens=[8], kv_dtype="bf16", q_dtype="bf16", layout="NHD",
    )
    with pytest.raises(ValueError, match="columns"):
        R.paged_decode(p.q, p.k_cache, p.v_cache, p.block_tables[:, :1], p.seq_lens)


# --------------------------------------------------------------------------------------
# LSE, sm_scale, empty sequences
# --------------------------------------------------------------------------------------


def test_lse_is_the_natural_log_of_the_sum_of_exponentiated_scaled_logits():
    rng = np.random.default_rng(9)
    p = make_problem(
        rng, num_seqs=2, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16,
        seq_lens=[7, 50], kv_dtype="fp8", q_dtype="bf16", layout="NHD",
    )
    sm_scale = 0.2
    _, lse = R.paged_decode(
        p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, sm_scale=sm_scale, return_lse=True, **decode_args(p)
    )
    for s in range(2):
        k_stored = R.gather_kv(p.k_cache, p.block_tables, p.seq_lens, s, "NHD")
        for h in range(4):
            logits = sm_scale * p.k_scale * (k_stored[:, h // 2, :] @ R.to_float64(p.q[s, h]))
            assert lse[s, h] == pytest.approx(np.log(np.sum(np.exp(logits))), rel=1e-13)


def test_default_sm_scale_is_one_over_the_square_root_of_head_dim():
    p = make_problem(
        np.random.default_rng(10), num_seqs=2, num_q_heads=2, num_kv_heads=1, head_dim=32,
        page_size=16, seq_lens=[5, 30], kv_dtype="bf16", q_dtype="bf16", layout="NHD",
    )
    default = R.paged_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, return_lse=True)
    explicit = R.paged_decode(
        p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, sm_scale=1 / math.sqrt(32), return_lse=True
    )
    np.testing.assert_array_equal(default[0], explicit[0])
    np.testing.assert_array_equal(default[1], explicit[1])


def test_an_empty_sequence_gives_zeros_and_minus_infinite_lse_without_nan_or_warnings():
    p = make_problem(
        np.random.default_rng(11), num_seqs=3, num_q_heads=4, num_kv_heads=2, head_dim=8,
        page_size=16, seq_lens=[0, 5, 0], kv_dtype="fp16", q_dtype="fp16", layout="NHD",
    )
    with np.errstate(all="raise"):
        out, lse = R.paged_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, return_lse=True)
        parts = R.splitk_partials(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, 4, kv_layout="NHD")
        merged_out, merged_lse = R.merge_partials(parts)
    for s in (0, 2):
        assert (out[s] == 0).all() and np.isneginf(lse[s]).all()
        assert (merged_out[s] == 0).all() and np.isneginf(merged_lse[s]).all()
        assert (parts[s, :, :, :8] == 0).all()
        assert np.isneginf(parts[s, :, :, 8]).all()
        assert (parts[s, :, :, 9] == 0).all()
    assert not np.isnan(out).any() and not np.isnan(merged_out).any() and not np.isnan(merged_lse).any()
    a_out, a_lse = R.attention(np.ones((4, 8)), np.zeros((0, 2, 8)), np.zeros((0, 2, 8)), 1.0)
    assert (a_out == 0).all() and np.isneginf(a_lse).all()


# --------------------------------------------------------------------------------------
# Split-K
# --------------------------------------------------------------------------------------


def _lengths_around_min_split_multiples():
    base = PD_MIN_KV_PER_SPLIT
    return [0, 1, base - 1, base, base + 1, 2 * base - 1, 2 * base, 2 * base + 1, 3 * base + 5, 16 * base + 1]


@pytest.mark.parametrize("num_splits", [1, 3, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_merged_split_k_partials_equal_the_unsplit_result(num_splits, layout):
    lens = _lengths_around_min_split_multiples()
    p = make_problem(
        np.random.default_rng([12, num_splits]), num_seqs=len(lens), num_q_heads=4, num_kv_heads=2,
        head_dim=8, page_size=16, seq_lens=lens, kv_dtype="uint8", q_dtype="bf16", layout=layout,
    )
    sm_scale = 0.9  # sharper softmax than the default, so split weights differ a lot
    want_out, want_lse = R.paged_decode(
        p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, sm_scale=sm_scale, return_lse=True, **decode_args(p)
    )
    parts = R.splitk_partials(
        p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, num_splits, sm_scale=sm_scale, **decode_args(p)
    )
    assert parts.shape == (len(lens), 4, num_splits, 8 + 2) and parts.dtype == np.float64
    got_out, got_lse = R.merge_partials(parts)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(got_lse[finite], want_lse[finite], rtol=1e-12, atol=1e-12)


def test_more_splits_than_tokens_leave_trailing_splits_empty_with_neutral_values():
    p = make_problem(
        np.random.default_rng(13), num_seqs=2, num_q_heads=2, num_kv_heads=1, head_dim=8,
        page_size=1, seq_lens=[3, PD_MIN_KV_PER_SPLIT + 2], kv_dtype="bf16", q_dtype="bf16", layout="NHD",
    )
    num_splits = 8
    parts = R.splitk_partials(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, num_splits)
    # Sequence 0: 3 tokens, all in split 0. Sequence 1: splits 0 and 1 hold tokens.
    for s, nonempty in ((0, 1), (1, 2)):
        assert np.isfinite(parts[s, :, :nonempty, 8]).all() and (parts[s, :, :nonempty, 9] >= 1).all()
        assert (parts[s, :, nonempty:, :8] == 0).all()
        assert np.isneginf(parts[s, :, nonempty:, 8]).all()
        assert (parts[s, :, nonempty:, 9] == 0).all()
    with np.errstate(all="raise"):
        out, lse = R.merge_partials(parts)
    want_out, want_lse = R.paged_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, return_lse=True)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_partials_follow_the_workspace_formulas_in_log2_units():
    p = make_problem(
        np.random.default_rng(14), num_seqs=1, num_q_heads=6, num_kv_heads=2, head_dim=8,
        page_size=7, seq_lens=[2 * PD_MIN_KV_PER_SPLIT + 10], kv_dtype="fp8", q_dtype="bf16", layout="HND",
    )
    sm_scale, num_splits = 0.4, 3
    parts = R.splitk_partials(
        p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, num_splits, sm_scale=sm_scale, **decode_args(p)
    )
    k = R.gather_kv(p.k_cache, p.block_tables, p.seq_lens, 0, "HND")
    v = R.gather_kv(p.v_cache, p.block_tables, p.seq_lens, 0, "HND")
    for h in range(6):
        for i, (begin, end) in enumerate(R.split_bounds(int(p.seq_lens[0]), num_splits)):
            x = (sm_scale * p.k_scale * math.log2(math.e)) * (k[begin:end, h // 3] @ R.to_float64(p.q[0, h]))
            m = x.max()
            w = 2.0 ** (x - m)
            np.testing.assert_allclose(parts[0, h, i, 8], m, rtol=1e-14)
            np.testing.assert_allclose(parts[0, h, i, 9], w.sum(), rtol=1e-13)
            np.testing.assert_allclose(parts[0, h, i, :8], p.v_scale * (w @ v[begin:end, h // 3]) / w.sum(), rtol=1e-12, atol=1e-14)


def test_partials_are_laid_out_in_the_kernel_workspace_slot_order():
    p = make_problem(
        np.random.default_rng(15), num_seqs=3, num_q_heads=4, num_kv_heads=2, head_dim=8,
        page_size=16, seq_lens=[10, 600, 300], kv_dtype="bf16", q_dtype="bf16", layout="NHD",
    )
    num_splits, head_dim = 3, 8
    parts = R.splitk_partials(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, num_splits)
    workspace = parts.ravel()  # what the kernel writes, flat
    for s, h, i in np.ndindex(3, 4, num_splits):
        slot = (s * 4 + h) * num_splits + i
        np.testing.assert_array_equal(workspace[slot * (head_dim + 2) : (slot + 1) * (head_dim + 2)], parts[s, h, i])


def test_merge_of_only_empty_splits_is_zero_and_minus_infinity_without_nan():
    parts = np.zeros((2, 3, 5, 4 + 2))
    parts[..., 4] = -np.inf
    with np.errstate(all="raise"):
        out, lse = R.merge_partials(parts)
    assert out.shape == (2, 3, 4) and lse.shape == (2, 3)
    assert (out == 0).all() and np.isneginf(lse).all()


def test_merge_weights_splits_by_their_denominators_and_maxima():
    # Two splits in log2 units: split 0 has m=1, l=2 (weight 2), split 1 has m=3, l=1
    # (weight 4 relative to split 0's maximum); an empty split in between.
    parts = np.array([[[10.0, 1.0, 2.0], [0.0, -np.inf, 0.0], [40.0, 3.0, 1.0]]])
    out, lse = R.merge_partials(parts)
    # M = 3, w = [2 * 2**-2, 0, 1] = [0.5, 0, 1], L = 1.5
    assert out[0, 0] == pytest.approx((0.5 * 10 + 40) / 1.5, rel=1e-15)
    assert lse[0] == pytest.approx((3 + math.log2(1.5)) * math.log(2), rel=1e-15)


@settings(max_examples=300, deadline=None)
@given(seq_len=st.integers(0, 40_000), num_splits=st.integers(1, 128))
def test_split_bounds_tile_the_sequence_in_order_and_respect_the_minimum_chunk(seq_len, num_splits):
    bounds = R.split_bounds(seq_len, num_splits)
    assert len(bounds) == num_splits
    chunk = max(-(-seq_len // num_splits), PD_MIN_KV_PER_SPLIT)
    position = 0
    for i, (begin, end) in enumerate(bounds):
        assert begin == position and begin <= end  # contiguous, in order, no overlap
        assert begin == min(i * chunk, seq_len) and end == min((i + 1) * chunk, seq_len)
        if end < seq_len:  # every split before the last non-empty one is a full chunk
            assert end - begin == chunk >= PD_MIN_KV_PER_SPLIT
        position = end
    assert position == seq_len


def test_split_bounds_rejects_nonsense():
    with pytest.raises(ValueError):
        R.split_bounds(10, 0)
    with pytest.raises(ValueError):
        R.split_bounds(-1, 2)


def test_max_abs_v_read_only_counts_tokens_that_are_attended_to():
    p = make_problem(
        np.random.default_rng(19), num_seqs=2, num_q_heads=2, num_kv_heads=1, head_dim=4,
        page_size=4, seq_lens=[5, 2], kv_dtype="fp16", q_dtype="fp16", layout="NHD", v_scale=0.5,
    )
    v_cache = p.v_cache.copy()
    want = p.v_absmax()
    last_page = p.block_tables[0, 1]
    v_cache[last_page, 1:] = 1000.0  # past token 4 of sequence 0
    unused = sorted(set(range(v_cache.shape[0])) - set(p.block_tables[p.block_tables != GARBAGE_PAGE_ID].tolist()))
    v_cache[unused] = -2000.0
    got = R.max_abs_v_read(v_cache, p.block_tables, p.seq_lens, kv_layout="NHD", v_scale=0.5)
    assert got == want
    v_cache[last_page, 0, 0, 0] = 100.0  # token 4 of sequence 0 is read
    assert R.max_abs_v_read(v_cache, p.block_tables, p.seq_lens, kv_layout="NHD", v_scale=0.5) == 50.0


# --------------------------------------------------------------------------------------
# Values narrower than keys (v_head_dim): Gemma 4's K = V, MLA's absorbed decode
# --------------------------------------------------------------------------------------


def direct_wide_decode(q, k_cache, v_cache, block_tables, seq_lens, sm_scale, k_scale, v_scale, window_left=-1,
                       cap=None, sinks=None):
    """An independent NumPy computation over NHD caches: each query token's keys gathered one
    token at a time, the softmax written out (soft-cap, window, sinks), values of their own width."""
    tokens = q if q.ndim == 4 else q[:, None]
    num_seqs, q_len, num_q_heads, _ = tokens.shape
    page_size, num_kv_heads, v_head_dim = v_cache.shape[1], v_cache.shape[2], v_cache.shape[3]
    group = num_q_heads // num_kv_heads
    out = np.zeros((num_seqs, q_len, num_q_heads, v_head_dim))
    lse = np.full((num_seqs, q_len, num_q_heads), -np.inf)
    for s in range(num_seqs):
        length = int(seq_lens[s])
        for i in range(q_len):
            end = length - q_len + 1 + i  # causal: this token sees positions < end
            begin = max(end - 1 - window_left, 0) if window_left >= 0 else 0
            rows = [(int(block_tables[s, t // page_size]), t % page_size) for t in range(begin, max(end, begin))]
            for h in range(num_q_heads):
                kvh = h // group
                qv = tokens[s, i, h].astype(np.float64)
                logits = np.array([sm_scale * k_scale * float(k_cache[pg, off, kvh].astype(np.float64) @ qv)
                                   for pg, off in rows])
                if cap is not None:
                    logits = cap * np.tanh(logits / cap)
                extra = [] if sinks is None else [float(sinks[h])]
                if not len(logits) and not extra:
                    continue
                m = max([*logits, *extra])
                weights = np.exp(logits - m)
                denom = weights.sum() + sum(math.exp(x - m) for x in extra)
                values = np.array([v_scale * v_cache[pg, off, kvh].astype(np.float64) for pg, off in rows])
                if len(rows):
                    out[s, i, h] = weights @ values / denom
                lse[s, i, h] = m + math.log(denom)
    if q.ndim == 3:
        out, lse = out[:, 0], lse[:, 0]
    return out, lse


def wide_problem(seed, *, num_q_heads=8, num_kv_heads=2, head_dim=48, v_head_dim=32, q_len=None, kv_dtype="bf16",
                 seq_lens=(0, 1, 19, 40), page_size=8):
    """A paged problem whose V cache is the first ``v_head_dim`` dims of an independent cache
    (``make_problem`` builds the keys; a second problem's keys are the values)."""
    rng = np.random.default_rng(seed)
    p = make_problem(rng, num_seqs=len(seq_lens), num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, page_size=page_size, seq_lens=list(seq_lens), kv_dtype=kv_dtype,
                     layout="NHD")
    values = np.ascontiguousarray(make_problem(rng, num_seqs=len(seq_lens), num_q_heads=num_q_heads,
                                               num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                                               seq_lens=list(seq_lens), kv_dtype=kv_dtype, layout="NHD",
                                               num_pages=p.k_cache.shape[0]).k_cache[..., :v_head_dim])
    q = p.q
    if q_len is not None:
        q = rng.standard_normal((q.shape[0], q_len, *q.shape[1:])).astype(p.q.dtype)
    return p, q, values


@pytest.mark.parametrize("q_len", [None, 3])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_values_narrower_than_keys_match_a_direct_numpy_computation(q_len, kv_dtype):
    p, q, v_cache = wide_problem(21, q_len=q_len, kv_dtype=kv_dtype)
    scales = dict(k_scale=0.5, v_scale=1.25)
    out, lse = R.paged_decode(q, p.k_cache, v_cache, p.block_tables, p.seq_lens, sm_scale=0.3, v_head_dim=32,
                              return_lse=True, **scales)
    want_out, want_lse = direct_wide_decode(q, R.to_float64(p.k_cache), R.to_float64(v_cache), p.block_tables,
                                            p.seq_lens, 0.3, **scales)
    assert out.shape == (*q.shape[:-1], 32) and lse.shape == q.shape[:-1]
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)], rtol=1e-12)


def test_narrow_values_keep_the_window_soft_cap_and_sinks():
    p, q, v_cache = wide_problem(22, q_len=2)
    sinks = np.linspace(-1.0, 2.0, 8)
    features = dict(window_left=5, logits_soft_cap=4.0, sinks=sinks)
    out, lse = R.paged_decode(q, p.k_cache, v_cache, p.block_tables, p.seq_lens, sm_scale=0.7, v_head_dim=32,
                              return_lse=True, **features)
    want_out, want_lse = direct_wide_decode(q, R.to_float64(p.k_cache), R.to_float64(v_cache), p.block_tables,
                                            p.seq_lens, 0.7, 1.0, 1.0, window_left=5, cap=4.0, sinks=sinks)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)


def test_the_default_sm_scale_of_narrow_values_is_the_keys_head_dim():
    p, q, v_cache = wide_problem(23)
    default = R.paged_decode(q, p.k_cache, v_cache, p.block_tables, p.seq_lens, v_head_dim=32)
    explicit = R.paged_decode(q, p.k_cache, v_cache, p.block_tables, p.seq_lens, v_head_dim=32,
                              sm_scale=1 / math.sqrt(48))
    np.testing.assert_array_equal(default, explicit)


def test_k_equal_v_as_one_array_gives_the_same_as_a_separate_copy():
    p = make_problem(np.random.default_rng(24), num_seqs=3, num_q_heads=8, num_kv_heads=4, head_dim=64, page_size=16,
                     seq_lens=[1, 33, 70], kv_dtype="bf16", layout="NHD")
    shared = R.paged_decode(p.q, p.k_cache, p.k_cache, p.block_tables, p.seq_lens, return_lse=True)
    copied = R.paged_decode(p.q, p.k_cache, p.k_cache.copy(), p.block_tables, p.seq_lens, return_lse=True)
    np.testing.assert_array_equal(shared[0], copied[0])
    np.testing.assert_array_equal(shared[1], copied[1])


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_mla_values_as_the_first_dims_of_the_latent_row_give_the_same_as_a_separate_copy(layout):
    # MLA's absorbed decode, scaled down: one latent head of 72 dims (64 latent + 8 rope), the
    # values its first 64 (at full size: 576 and 512).
    p = make_problem(np.random.default_rng(25), num_seqs=3, num_q_heads=16, num_kv_heads=1, head_dim=72,
                     page_size=16, seq_lens=[0, 9, 50], kv_dtype="bf16", layout=layout)
    view = p.k_cache[..., :64]
    assert np.shares_memory(view, p.k_cache)
    for fn in (lambda v: R.paged_decode(p.q, p.k_cache, v, p.block_tables, p.seq_lens, kv_layout=layout,
                                        v_head_dim=64, return_lse=True),
               lambda v: (R.splitk_partials(p.q, p.k_cache, v, p.block_tables, p.seq_lens, 3, kv_layout=layout,
                                            v_head_dim=64),)):
        aliased, copied = fn(view), fn(np.ascontiguousarray(view))
        for a, b in zip(aliased, copied):
            np.testing.assert_array_equal(a, b)
    out = R.paged_decode(p.q, p.k_cache, view, p.block_tables, p.seq_lens, kv_layout=layout, v_head_dim=64)
    assert out.shape == (3, 16, 64)


def test_split_k_partials_of_narrow_values_are_v_head_dim_plus_two_wide_and_merge_to_the_unsplit_result():
    p, q, v_cache = wide_problem(26, seq_lens=(5, 300, 700))
    partials = R.splitk_partials(q, p.k_cache, v_cache, p.block_tables, p.seq_lens, 4, v_head_dim=32)
    assert partials.shape == (3, 8, 4, 34)
    merged, merged_lse = R.merge_partials(partials)
    out, lse = R.paged_decode(q, p.k_cache, v_cache, p.block_tables, p.seq_lens, v_head_dim=32, return_lse=True)
    np.testing.assert_allclose(merged, out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(merged_lse, lse, rtol=1e-12)


@pytest.mark.parametrize("v_head_dim, message", [
    (None, "v_cache shape (6, 8, 2, 32) must be k_cache's (6, 8, 2, 48) with v_head_dim 48 as its last dim"),
    (40, "with v_head_dim 40 as its last dim"),
    (64, "v_head_dim must be an int in 1..head_dim (48), got 64"),
    (0, "v_head_dim must be an int in 1..head_dim (48), got 0"),
    (32.0, "v_head_dim must be an int in 1..head_dim (48), got 32.0"),
])
def test_a_v_cache_or_v_head_dim_that_disagree_are_refused_naming_v_head_dim(v_head_dim, message):
    p, q, v_cache = wide_problem(27, seq_lens=(3, 20))
    with pytest.raises(ValueError, match=re.escape(message)):
        R.paged_decode(q, p.k_cache, v_cache, p.block_tables, p.seq_lens, v_head_dim=v_head_dim)
