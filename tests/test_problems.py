"""Tests of the random problem builder (metrale_attn.problems): determinism, block-table tails, page
ownership and sharing, fp8 calibration."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from metrale_attn import reference
from metrale_attn.problems import GARBAGE_PAGE_ID, make_problem

BF16 = np.dtype(ml_dtypes.bfloat16)


def _problem(seed, **overrides):
    args = dict(
        num_seqs=4, num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=16,
        seq_lens=[0, 20, 40, 70], kv_dtype="fp8", q_dtype="bf16", layout="HND", share_prefix_pages=1,
    )
    args.update(overrides)
    return make_problem(np.random.default_rng(seed), **args)


def test_make_problem_is_deterministic_from_the_rng():
    a, b, c = _problem(20), _problem(20), _problem(21)
    for field in ("q", "k_cache", "v_cache", "block_tables", "seq_lens"):
        np.testing.assert_array_equal(getattr(a, field).view(np.uint8), getattr(b, field).view(np.uint8))
    assert a.k_scale == b.k_scale and a.v_scale == b.v_scale
    assert not np.array_equal(a.k_cache.view(np.uint8), c.k_cache.view(np.uint8))


def test_make_problem_fills_block_table_tails_with_an_out_of_range_page_id():
    p = _problem(22)
    num_pages = p.k_cache.shape[0]
    assert p.block_tables.dtype == np.int32 and p.seq_lens.dtype == np.int32
    for s, length in enumerate(p.seq_lens):
        used = -(-int(length) // 16)
        assert ((p.block_tables[s, :used] >= 0) & (p.block_tables[s, :used] < num_pages)).all()
        assert (p.block_tables[s, used:] == GARBAGE_PAGE_ID).all() and used < p.block_tables.shape[1]
    assert GARBAGE_PAGE_ID >= 2**24


def test_make_problem_gives_each_page_to_one_sequence_except_the_shared_prefix():
    p = _problem(23, share_prefix_pages=2, seq_lens=[10, 40, 40, 100], num_pages=40)
    assert p.k_cache.shape[0] == 40
    shared = {int(p.block_tables[3, 0]), int(p.block_tables[3, 1])}
    assert p.block_tables[0, 0] in shared  # the short sequence shares what it has
    private = [int(x) for s in range(4) for x in p.block_tables[s, 2 : -(-int(p.seq_lens[s]) // 16)]]
    assert len(private) == len(set(private)) and not shared & set(private)
    unshuffled = _problem(23, shuffle_pages=False, share_prefix_pages=0, seq_lens=[16, 32, 0, 5])
    assert unshuffled.block_tables[:, :2].tolist()[:2] == [[0, GARBAGE_PAGE_ID], [1, 2]]


def test_make_problem_fp8_caches_span_the_e4m3_range_and_dequantize_near_unit_scale():
    p = _problem(24, kv_dtype="uint8")
    assert p.k_cache.dtype == np.uint8
    stored = reference.to_float64(p.k_cache)
    assert not np.isnan(stored).any()
    assert np.abs(stored).max() == 448.0
    dequantized = stored * p.k_scale
    assert 0.8 < dequantized.std() < 1.2
    assert 0.0 < p.k_scale < 0.05 and 0.0 < p.v_scale < 0.05
    bf = _problem(24, kv_dtype="bf16")
    assert bf.k_cache.dtype == BF16 and bf.k_scale == 1.0 and bf.v_scale == 1.0
