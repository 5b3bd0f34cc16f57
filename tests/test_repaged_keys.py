"""The same keys and values paged any way give the same bytes. The 8-warp tilings of 16-bit
caches compute each copying lane's row addresses in the lane itself (mma_stream.cuh, LANE_OFFSETS): row r's block-table entry from the pad where
lane r staged it, its offset in its page as (in_page(token lane) + r - lane) mod page_size by
a multiply-high. A lane that took another row's entry or offset would copy another key's bytes:
the same logical keys and values, paged in any page size (1, 3, 16, 48: tiles inside a page,
straddling two, or one page a row), either layout and any scattering of the pages, must give
the same bytes, within the bar of float64, with ranges that start mid-tile (splits of 334
keys, a window, query tokens)."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_attn import tolerance
from metrale_attn.kernels import specs_for
from metrale_attn.problems import GARBAGE_PAGE_ID, Problem

from support.problems import check_against_reference, decoder, problem, run_poisoned

PAGE_SIZES = (1, 3, 16, 48)


def _repaged(p: Problem, page_size: int, layout: str, seed: int) -> Problem:
    """``p`` (pages of one token, in order) with the same keys and values in pages of
    ``page_size``, scattered at random over a pool with two spare pages, in ``layout``; every
    slot no key uses is NaN, so a copy of one that is not zero-filled shows."""
    rng = np.random.default_rng(seed)
    lens = [int(n) for n in p.seq_lens]
    pages = [-(-n // page_size) for n in lens]
    physical = rng.permutation(sum(pages) + 2)
    heads, dim = p.k_cache.shape[2], p.k_cache.shape[3]
    caches = [np.full((len(physical), page_size, heads, dim), np.nan, dtype=p.k_cache.dtype) for _ in range(2)]
    tables = np.full((len(lens), max(pages) + 1), GARBAGE_PAGE_ID, dtype=np.int32)
    used = 0
    for s, n in enumerate(lens):
        tables[s, :pages[s]] = physical[used:used + pages[s]]
        used += pages[s]
        for cache, source in zip(caches, (p.k_cache, p.v_cache)):
            for t in range(n):
                cache[tables[s, t // page_size], t % page_size] = source[p.block_tables[s, t], 0]
    if layout == "HND":
        caches = [np.ascontiguousarray(c.transpose(0, 2, 1, 3)) for c in caches]
    return Problem(p.q, caches[0], caches[1], tables, p.seq_lens, p.k_scale, p.v_scale, layout)


def _logical(seed: int, head_dim: int, kv_dtype: str = "bf16") -> Problem:
    return problem(seed=seed, page_size=1, seq_lens=(1, 1000, 37, 0, 161), head_dim=head_dim, num_q_heads=4,
                   num_kv_heads=1, kv_dtype=kv_dtype, shuffle_pages=False)


@pytest.mark.parametrize("head_dim", [128, 64])  # 16-token tiles, two rows a copy; 32-token, four rows a copy
def test_a_copying_lane_takes_its_own_rows_entry_and_offset_for_every_page_size_and_layout(head_dim):
    base = _logical(91, head_dim)
    first = None
    for page_size in PAGE_SIZES:
        for layout in ("NHD", "HND") if page_size in (3, 48) else ("NHD",):
            p = _repaged(base, page_size, layout, seed=page_size)
            attn = decoder(p, splitk="3")
            assert {(v.tiling.warps, v.kv_dtype) for v in specs_for(attn.config).values()} == {(8, "bf16")}
            got = run_poisoned(attn, p)
            check_against_reference(p, *got)
            if first is None:
                first = got
            assert got[0].tobytes() == first[0].tobytes() and got[1].tobytes() == first[1].tobytes(), (page_size,
                                                                                                        layout)


def test_repaged_keys_give_the_same_bytes_with_a_window_and_query_tokens_starting_mid_tile():
    """Two query tokens and a window of 45 keys: each row's range starts mid-tile, the CTA's
    one key earlier; fp16 cache (the other 16-bit type)."""
    base = _logical(92, 128, "fp16")
    q = np.random.default_rng(93).standard_normal((5, 2) + base.q.shape[1:]).astype(base.q.dtype)
    first = None
    for page_size in (3, 48):
        p = _repaged(base, page_size, "NHD", seed=page_size + 1)
        attn = decoder(p, splitk="3", max_q_len=2, window_left=45)
        assert {v.tiling.warps for v in specs_for(attn.config).values()} == {8}
        got = run_poisoned(attn, p, q=q)
        ref_out, ref_lse = p.reference(return_lse=True, q=q, window_left=45)
        tolerance.assert_close_to_reference(got[0], ref_out, v_absmax=p.v_absmax())
        empty = np.isneginf(ref_lse)
        assert np.all(np.isneginf(got[1][empty]))
        np.testing.assert_allclose(got[1][~empty], ref_lse[~empty], rtol=2e-6, atol=2e-6)
        if first is None:
            first = got
        assert got[0].tobytes() == first[0].tobytes() and got[1].tobytes() == first[1].tobytes(), page_size
