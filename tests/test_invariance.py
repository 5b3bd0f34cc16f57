"""Batch invariance: under auto and pinned policies a sequence's bytes never depend on its company,
on either backend (the ``backend`` fixture), and under every thread order of the CPU backend."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_attn import tolerance
from metrale_attn.problems import Problem
from metrale_attn.backends.cpu_backend import CpuBackend

from support.problems import check_against_reference, decoder, problem, run_poisoned

LENGTHS = (700, 3, 0, 1500, 257, 64, 999, 16)


def _pick(p: Problem, rows) -> Problem:
    """The sub-batch of ``p`` made of ``rows``, in that order (same cache, same pages)."""
    rows = list(rows)
    return Problem(p.q[rows], p.k_cache, p.v_cache, p.block_tables[rows], p.seq_lens[rows],
                   p.k_scale, p.v_scale, p.kv_layout)


@pytest.fixture(scope="module")
def batch():
    return problem(seed=3, page_size=16, seq_lens=LENGTHS, head_dim=128, num_q_heads=4, num_kv_heads=1,
                   kv_dtype="fp8", share_prefix_pages=1)


@pytest.mark.parametrize("splitk", ["auto", "4", "off"])
def test_a_sequence_gives_identical_bytes_alone_in_any_batch_at_any_position_and_on_repeats(backend, batch, splitk):
    attn = decoder(batch, backend=backend, max_batch=len(LENGTHS), splitk=splitk)
    full, full_lse = run_poisoned(attn, batch)
    check_against_reference(batch, full, full_lse)
    for target in range(len(LENGTHS)):
        others = [r for r in range(len(LENGTHS)) if r != target]
        for rows in ([target], others[:2] + [target], [target] + others, others[:5] + [target] + others[5:]):
            out, lse = run_poisoned(attn, _pick(batch, rows))
            at = rows.index(target)
            assert out[at].tobytes() == full[target].tobytes(), (splitk, target, rows)
            assert lse[at].tobytes() == full_lse[target].tobytes()
    again, _ = run_poisoned(attn, batch)
    assert again.tobytes() == full.tobytes()


@pytest.mark.parametrize("order", ["reverse", "shuffle:1", "shuffle:2", "warp-ahead:1", "warp-ahead:7"])
@pytest.mark.parametrize("options", [dict(splitk="4"), dict(splitk="off"), dict(splitk="off", gqa_pack=True)],
                         ids=["splitk", "unpacked", "gqa_packed"])
def test_bytes_are_identical_under_every_thread_order_of_the_cpu_backend(order, options):
    heads = dict(num_q_heads=6, num_kv_heads=1, head_dim=256) if options.get("gqa_pack") else dict(head_dim=128)
    p = problem(seed=5, page_size=16, seq_lens=(300, 41), **heads)
    default = run_poisoned(decoder(p, backend=CpuBackend(order="default"), **options), p)
    shuffled = run_poisoned(decoder(p, backend=CpuBackend(order=order), **options), p)
    assert default[0].tobytes() == shuffled[0].tobytes()
    assert default[1].tobytes() == shuffled[1].tobytes()


def test_under_legacy_the_split_count_moves_with_the_batch(batch):
    """The documented difference: legacy sizes for the batch it is given, so bytes may move."""
    attn = decoder(batch, max_batch=len(LENGTHS), splitk="legacy")
    counts = [attn.plan(n).num_splits for n in (1, 2, 8)]
    assert counts == [33, 16, 4]  # 132 SMs // (4 q heads x n)
    alone, _ = run_poisoned(attn, _pick(batch, [3]))
    together, lse = run_poisoned(attn, batch)
    check_against_reference(batch, together, lse)
    assert tolerance.ulp_distance(alone[0], together[3]).max() <= 2


# -- multi-token decode on the simt kernels (head dim 512, MLA's 576/512) -----------------------


@pytest.fixture(scope="module")
def wide_tokens():
    """Gemma 4's global-layer width (head dim 512, 4 q heads on 2 KV heads), 3 query tokens a
    sequence over lengths past a split (256 keys), shorter than q_len and empty."""
    p = problem(seed=7, page_size=16, seq_lens=(300, 2, 0, 41), head_dim=512, num_q_heads=4, num_kv_heads=2)
    return p, np.random.default_rng(7).standard_normal((4, 3, 4, 512)).astype(p.q.dtype)


@pytest.mark.filterwarnings("ignore:.*head_dim 512 is wider.*:RuntimeWarning")
@pytest.mark.parametrize("splitk", ["auto", "off"])
def test_a_simt_multi_token_row_gives_identical_bytes_alone_in_any_batch_at_any_position_and_on_repeats(wide_tokens,
                                                                                                       splitk):
    p, q = wide_tokens
    attn = decoder(p, max_q_len=4, splitk=splitk)
    assert attn.impl == "simt"
    full, full_lse = run_poisoned(attn, p, q=q)
    ref, ref_lse = p.reference(return_lse=True, q=q)
    tolerance.assert_close_to_reference(full, ref, v_absmax=p.v_absmax())
    for rows in ([0], [3, 1], [2, 0, 3, 1], [1, 1, 0]):
        out, lse = run_poisoned(attn, _pick(p, rows), q=q[rows])
        for at, r in enumerate(rows):
            assert out[at].tobytes() == full[r].tobytes() and lse[at].tobytes() == full_lse[r].tobytes(), (rows, r)


@pytest.mark.filterwarnings("ignore:.*head_dim 512 is wider.*:RuntimeWarning")
@pytest.mark.parametrize("order", ["reverse", "shuffle:1", "warp-ahead:7"])
def test_simt_multi_token_bytes_are_identical_under_every_thread_order_of_the_cpu_backend(wide_tokens, order):
    p, q = wide_tokens
    default = run_poisoned(decoder(p, backend=CpuBackend(order="default"), max_q_len=3, splitk="4"), p, q=q)
    shuffled = run_poisoned(decoder(p, backend=CpuBackend(order=order), max_q_len=3, splitk="4"), p, q=q)
    assert default[0].tobytes() == shuffled[0].tobytes() and default[1].tobytes() == shuffled[1].tobytes()
