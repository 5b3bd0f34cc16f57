"""The slow step's grid of the wide shapes (issue 32): head dim 512 (Gemma 4's global layers) at
every group size 1..16, and MLA's absorbed 576/512 at 8 to 128 query heads a rank, on both
arms the simt kernels serve, every cache dtype, both q dtypes and page sizes 1 to 256, held to
the float64 reference's 1-ulp bar. The default run's samples are in test_head_dims.py and
test_mla.py; this file is the grid they sample."""

from __future__ import annotations

import dataclasses

import pytest

from support.problems import check_against_reference, decoder, problem, run_poisoned

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:.*has no mma kernel:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:.*wider than the mma core's:RuntimeWarning")]

PAGE_SIZES = (1, 16, 64, 256)


def _seq_lens(page_size: int) -> tuple[int, ...]:
    """An empty sequence, one token, a ragged tail past two pages, and one long enough to split."""
    return (0, 1, 2 * page_size + 3, 300)


@pytest.mark.parametrize("arm", ["unpacked", "splitk"])
@pytest.mark.parametrize("kv", ["bf16", "fp16", "fp8"])
@pytest.mark.parametrize("q", ["bf16", "fp16"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_at_head_dim_512_every_arm_dtype_and_page_size_up_to_256_holds_the_one_ulp_bar(arm, kv, q, page_size):
    p = problem(seed=page_size, num_q_heads=16, num_kv_heads=2, head_dim=512, page_size=page_size,
                seq_lens=_seq_lens(page_size), kv_dtype=kv, q_dtype=q)
    attn = decoder(p, splitk="off" if arm == "unpacked" else "auto")
    assert (attn.impl, attn.plan(4).arm) == ("simt", arm)
    check_against_reference(p, *run_poisoned(attn, p))


@pytest.mark.parametrize("group", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("arm", ["unpacked", "splitk"])
def test_at_head_dim_512_every_group_size_from_1_to_16_holds_the_one_ulp_bar(group, arm):
    p = problem(seed=group, num_q_heads=2 * group, num_kv_heads=2, head_dim=512, page_size=16,
                seq_lens=(5, 300), kv_dtype="bf16")
    attn = decoder(p, splitk="off" if arm == "unpacked" else "auto")
    check_against_reference(p, *run_poisoned(attn, p))


def _mla(*, heads: int, page_size: int, kv: str = "bf16", q: str = "bf16", v: str = "view", seed: int = 0):
    """A 576/512 problem of ``heads`` q heads on one latent KV head; ``v="view"``: V is K's first 512 dims."""
    p = problem(seed=seed, num_q_heads=heads, num_kv_heads=1, head_dim=576, page_size=page_size,
                seq_lens=_seq_lens(page_size), kv_dtype=kv, q_dtype=q)
    v_cache = p.k_cache[..., :512] if v == "view" else p.v_cache[..., 64:].copy()
    return dataclasses.replace(p, v_cache=v_cache)


@pytest.mark.parametrize("heads", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("arm", ["unpacked", "splitk"])
def test_at_576_512_every_head_count_a_rank_from_8_to_128_holds_the_one_ulp_bar(heads, arm):
    p = _mla(heads=heads, page_size=64, seed=heads)
    attn = decoder(p, splitk="off" if arm == "unpacked" else "auto")
    assert (attn.impl, attn.plan(4).arm) == ("simt", arm)
    check_against_reference(p, *run_poisoned(attn, p))


@pytest.mark.parametrize("kv", ["bf16", "fp16", "fp8"])
@pytest.mark.parametrize("v", ["view", "own"])
@pytest.mark.parametrize("arm", ["unpacked", "splitk"])
def test_at_576_512_pages_of_256_tokens_hold_the_one_ulp_bar(kv, v, arm):
    p = _mla(heads=16, page_size=256, kv=kv, v=v, seed=256)
    attn = decoder(p, splitk="off" if arm == "unpacked" else "auto")
    check_against_reference(p, *run_poisoned(attn, p))
