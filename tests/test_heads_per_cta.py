"""The mma core: a head's bytes never depend on which heads share its CTA (heads_per_cta),
for every arm and group size, alone or batched, on either backend (the ``backend`` fixture;
on a device this rests on the tensor core computing each column of an MMA from that column
alone) and under every thread order of the CPU backend; and the gated packed arm is that
core at PD_GQA heads."""

from __future__ import annotations

import pytest

from metrale_attn import policy
from metrale_attn.problems import Problem
from metrale_attn.backends.cpu_backend import CpuBackend
from metrale_attn.config import heads_per_cta_choices

from support.problems import ARM_OPTIONS, check_against_reference, decoder, problem, run_poisoned

SPLIT_ARMS = {"unpacked": dict(splitk="off"), "splitk": dict(splitk="3")}


def _outputs(p, heads_per_cta, backend="cpu", **options):
    attn = decoder(p, backend=backend, heads_per_cta=heads_per_cta, **options)
    assert attn.plan(len(p.seq_lens)).heads_per_cta == heads_per_cta
    return run_poisoned(attn, p)


@pytest.mark.parametrize("arm", list(SPLIT_ARMS))
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8, 16])
def test_every_heads_per_cta_gives_identical_bytes_for_every_group_size(backend, arm, group):
    kv = ("bf16", "fp8", "fp16")[group % 3]
    q = ("bf16", "fp16")[group % 2]
    p = problem(seed=group, num_q_heads=group * 2, num_kv_heads=2, head_dim=64, page_size=5, seq_lens=(0, 37, 530),
                kv_dtype=kv, q_dtype=q)
    first = None
    for h in heads_per_cta_choices(group):
        out, lse = _outputs(p, h, backend, **SPLIT_ARMS[arm])
        if first is None:
            check_against_reference(p, out, lse)
            first = (out.tobytes(), lse.tobytes())
        assert (out.tobytes(), lse.tobytes()) == first, (arm, group, h)


@pytest.mark.parametrize("kv, q", [("bf16", "bf16"), ("bf16", "fp16"), ("fp8", "bf16"), ("fp16", "fp16")])
def test_a_head_gives_the_same_bytes_grouped_or_alone_at_every_position_of_a_batch(backend, kv, q):
    p = problem(seed=11, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16, seq_lens=(300, 5, 700, 0),
                kv_dtype=kv, q_dtype=q)
    full = {h: _outputs(p, h, backend, splitk="auto") for h in heads_per_cta_choices(4)}
    ref = full[1]
    for h, (out, lse) in full.items():
        assert out.tobytes() == ref[0].tobytes() and lse.tobytes() == ref[1].tobytes(), h
    # the second sequence alone, and the batch reversed, at every grouping
    rows = [3, 2, 1, 0]
    reversed_batch = Problem(p.q[rows], p.k_cache, p.v_cache, p.block_tables[rows], p.seq_lens[rows],
                             p.k_scale, p.v_scale, p.kv_layout)
    alone = Problem(p.q[1:2], p.k_cache, p.v_cache, p.block_tables[1:2], p.seq_lens[1:2],
                    p.k_scale, p.v_scale, p.kv_layout)
    for h in heads_per_cta_choices(4):
        out, lse = _outputs(reversed_batch, h, backend, splitk="auto")
        assert out[::-1].tobytes() == ref[0].tobytes() and lse[::-1].tobytes() == ref[1].tobytes(), h
        out, lse = _outputs(alone, h, backend, splitk="auto")
        assert out[0].tobytes() == ref[0][1].tobytes() and lse[0].tobytes() == ref[1][1].tobytes(), h


def test_the_packed_arm_and_the_unpacked_arm_at_six_heads_per_cta_give_identical_bytes(backend):
    p = problem(seed=6, num_q_heads=24, num_kv_heads=4, head_dim=256, page_size=16, seq_lens=(0, 1, 333, 1024),
                kv_dtype="fp8", q_dtype="bf16")
    packed = decoder(p, backend=backend, **ARM_OPTIONS["gqa_packed"])
    assert packed.plan(4).arm == "gqa_packed" and packed.plan(4).heads_per_cta == policy.DECODE_GQA_PACK_WIDTH
    a = run_poisoned(packed, p)
    b = _outputs(p, 6, backend, splitk="off", gqa_pack=False)
    check_against_reference(p, *a)
    assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()
    c = _outputs(p, 2, backend, splitk="off", gqa_pack=False)
    assert a[0].tobytes() == c[0].tobytes()


@pytest.mark.parametrize("order", ["reverse", "shuffle:3", "warp-ahead:5"])
def test_heads_per_cta_byte_identity_holds_under_the_seeded_thread_orders(order):
    """The seeded orders also land async copies early, at random points before their wait."""
    p = problem(seed=2, num_q_heads=8, num_kv_heads=1, head_dim=64, page_size=3, seq_lens=(90, 600),
                kv_dtype="fp8", q_dtype="fp16")
    base = _outputs(p, 8, splitk="2")
    for h in (1, 4, 8):
        attn = decoder(p, backend=CpuBackend(order=order), heads_per_cta=h, splitk="2")
        out, lse = run_poisoned(attn, p)
        assert out.tobytes() == base[0].tobytes() and lse.tobytes() == base[1].tobytes(), (order, h)


def test_a_group_of_thirty_two_uses_at_most_sixteen_heads_per_cta_and_matches_the_reference(backend):
    p = problem(seed=32, num_q_heads=32, num_kv_heads=1, head_dim=64, page_size=16, seq_lens=(100, 2))
    attn = decoder(p, backend=backend, splitk="off")
    assert attn.plan(2).heads_per_cta <= 16
    out, lse = run_poisoned(attn, p)
    check_against_reference(p, out, lse)
    sixteen, one = _outputs(p, 16, backend, splitk="off")[0], _outputs(p, 1, backend, splitk="off")[0]
    assert out.tobytes() == sixteen.tobytes() == one.tobytes()


def test_the_simt_and_mma_implementations_both_meet_the_bar_on_the_same_problem(backend):
    p = problem(seed=4, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=7, seq_lens=(0, 1, 77, 900),
                kv_dtype="fp8", q_dtype="bf16")
    for impl in ("simt", "mma"):
        out, lse = run_poisoned(decoder(p, backend=backend, impl=impl, splitk="auto"), p)
        check_against_reference(p, out, lse)
    assert decoder(p, backend=backend, impl="simt").plan(4).heads_per_cta == 1
