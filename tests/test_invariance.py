"""Batch invariance: under auto and pinned policies a sequence's bytes never depend on its company,
on either backend (the ``backend`` fixture), and under every thread order of the CPU backend."""

from __future__ import annotations

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
