"""The mma kernel on every kind of tiling a target gives it (tiling.py): 8 warps (16-bit caches:
each copying lane computes its own rows' addresses; fp8: the offsets table), 6 warps where 8 do
not fit (W not a power of two: warp w takes tiles k = w mod 6, stage_q converts rows in rounds
of 6, the combine runs over 6 warps), 4 and 2 warps on the 99 KiB targets; with each warp's
prefetch of the next item across the epilogue, or none where its state fills the ring. On each:
within the one bar of float64 on every arm, dtype and feature; a row's bytes the same whatever
the number of persistent CTAs walking the items, the prefetch depth, heads_per_cta, the
sequence's company and position, and the CPU backend's thread order; and the tightest specs
build with no spills."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_attn import tiling, tolerance
from metrale_attn.backends.cpu_backend import CpuBackend
from metrale_attn.kernels import specs_for

from support.builds import needs_nvrtc, nvrtc_build, spill_frames, tightest_spill_params
from support.problems import (check_against_reference, check_bytes_free_of_heads_per_cta_company_and_position,
                              check_features_within_bar_and_on_fewer_persistent_ctas, decoder, pick, problem,
                              run_poisoned, to_csr)

ARMS = {"unpacked": dict(splitk="off"), "splitk": dict(splitk="3"), "gqa_packed": dict(splitk="off", gqa_pack=True)}
HD128 = dict(num_q_heads=4, num_kv_heads=2, head_dim=128)
PACKED = dict(num_q_heads=6, num_kv_heads=1, head_dim=256)  # the packed arm's one shape

CASES = {  # name: (arm, heads, kv dtype, target, extra options, the tiling's warps)
    "8 warps, lane offsets: unpacked bf16 hd128": ("unpacked", HD128, "bf16", "hopper", {}, 8),
    "8 warps, lane offsets: split-K bf16 hd128": ("splitk", HD128, "bf16", "hopper", {}, 8),
    "8 warps, offsets table: unpacked fp8 hd128": ("unpacked", HD128, "fp8", "hopper", {}, 8),
    "8 warps, offsets table: split-K fp8 hd128": ("splitk", HD128, "fp8", "hopper", {}, 8),
    "8 warps: packed fp8 hd256": ("gqa_packed", PACKED, "fp8", "hopper", {}, 8),
    "6 warps: packed bf16 hd256": ("gqa_packed", PACKED, "bf16", "hopper", {}, 6),
    "6 warps: unpacked bf16 hd256": ("unpacked", dict(HD128, head_dim=256), "bf16", "hopper", {}, 6),
    "6 warps: split-K fp16 hd208": ("splitk", dict(HD128, head_dim=208), "fp16", "hopper", {}, 6),
    "6 warps, 12 rows, no prefetch: unpacked fp8 hd176 on 99 KiB": (
        "unpacked", dict(num_q_heads=12, num_kv_heads=1, head_dim=176), "fp8", "rtx5090", dict(heads_per_cta=12), 6),
    "6 warps, 12 rows: split-K bf16 hd160 on 163 KiB": (
        "splitk", dict(num_q_heads=12, num_kv_heads=1, head_dim=160), "bf16", "a100", dict(heads_per_cta=12), 6),
    "4 warps: split-K bf16 hd128 on 99 KiB": ("splitk", HD128, "bf16", "gb10", {}, 4),
    "2 warps: unpacked bf16 hd256 on 99 KiB": ("unpacked", dict(HD128, head_dim=256), "bf16", "gb10", {}, 2),
}


def _warps(attn) -> set:
    return {v.tiling.warps for v in specs_for(attn.config).values()}


def _bytes(got) -> list:
    return [a.tobytes() for a in got]


@pytest.mark.parametrize("case", list(CASES))
def test_every_tiling_is_within_one_ulp_with_a_window_sinks_and_query_tokens_on_any_number_of_persistent_ctas(
        case, backend, monkeypatch):
    """Three query tokens (one on the packed arm and with 12 heads a CTA), a window of 300 keys
    and sinks, on as many persistent CTAs as the device holds and on 3, fewer than the items,
    so each walks several: the same bytes, within the bar."""
    arm, heads, kv_dtype, target, extra, warps = CASES[case]
    p = problem(seed=81, page_size=16, seq_lens=(0, 700, 37, 290), kv_dtype=kv_dtype, **heads)
    q_len = 1 if arm == "gqa_packed" or heads["num_q_heads"] > 8 else 3
    q = np.random.default_rng(82).standard_normal((4, q_len) + p.q.shape[1:]).astype(p.q.dtype)
    sinks = np.random.default_rng(83).normal(0, 2, p.q.shape[1]).astype(np.float32)
    options = dict(max_q_len=q_len, window_left=300, sinks=True, target=target, **ARMS[arm], **extra)
    attn = decoder(p, backend=backend, **options)
    assert _warps(attn) == {warps}
    check_features_within_bar_and_on_fewer_persistent_ctas(attn, p, q, sinks, monkeypatch, **options)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("arm", list(ARMS))
def test_one_two_or_three_persistent_ctas_give_the_bytes_of_a_ctas_per_sm_launch(arm, kv_dtype, monkeypatch):
    """P = 1, 2, 3 CTAs (fewer than the items, so every CTA walks several, some one more than
    others) give the bytes of the launch of as many CTAs as the SMs hold, with a window, sinks
    and three query tokens."""
    p = problem(seed=61, page_size=16, seq_lens=(0, 300, 37, 90), kv_dtype=kv_dtype,
                **(PACKED if arm == "gqa_packed" else HD128))
    q = np.random.default_rng(62).standard_normal((4, 3) + p.q.shape[1:]).astype(p.q.dtype)
    sinks = np.random.default_rng(63).normal(0, 2, p.q.shape[1]).astype(np.float32)
    options = dict(max_q_len=3, window_left=70, sinks=True, **ARMS[arm])
    full = run_poisoned(decoder(p, **options), p, q=q, sinks=sinks)
    for ctas in (1, 2, 3):
        monkeypatch.setattr("metrale_attn.plan.persistent_ctas", lambda tiling, target: ctas)
        attn = decoder(p, **options)
        plan = attn.plan(4)
        assert plan.items > ctas and plan.launch_grid(0) == (ctas, 1, 1)
        assert _bytes(run_poisoned(attn, p, q=q, sinks=sinks)) == _bytes(full), ctas


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("arm", list(ARMS))
def test_the_next_items_tiles_in_flight_across_the_epilogue_change_no_byte_at_any_depth(arm, kv_dtype, monkeypatch):
    """Lever 5: each warp issues its first PREFETCH tiles of the CTA's next item before the
    epilogue and publishes its state past them. Two CTAs walk items of long sequences (every
    warp's tiles S - 1 and S exist, so the entries carried across the epilogue are used)
    between empty ones, with a window, sinks and two query tokens; the spec's own depth
    (S - 1 here) and a shallower one (1: the prologue issues the rest) give the bytes of none
    (the warp states in every ring)."""
    p = problem(seed=71, page_size=16, seq_lens=(520, 0, 300, 1, 0, 700), kv_dtype=kv_dtype,
                **(PACKED if arm == "gqa_packed" else HD128))
    q = np.random.default_rng(72).standard_normal((6, 2) + p.q.shape[1:]).astype(p.q.dtype)
    sinks = np.random.default_rng(73).normal(0, 2, p.q.shape[1]).astype(np.float32)
    options = dict(max_q_len=2, window_left=260, sinks=True, **dict(ARMS[arm], splitk="2") if arm == "splitk"
                   else ARMS[arm])
    monkeypatch.setattr("metrale_attn.plan.persistent_ctas", lambda tiling, target: 2)
    most = tiling.prefetch_stages
    got = {}
    for depth in (0, 1, "the most"):
        monkeypatch.setattr(tiling, "prefetch_stages", most if depth == "the most" else lambda *a: min(depth, most(*a)))
        attn = decoder(p, **options)
        expected = {v.tiling.stages - 1 if depth == "the most" else depth for v in specs_for(attn.config).values()}
        assert {v.tiling.prefetch for v in specs_for(attn.config).values()} == expected
        assert attn.plan(6).launch_grid(0) == (2, 1, 1)
        got[depth] = _bytes(run_poisoned(attn, p, q=q, sinks=sinks))
    assert got[1] == got[0] and got["the most"] == got[0]


CSR_CASES = {"8 warps fp8 hd128": (128, "hopper", 8), "6 warps fp8 hd192 on 99 KiB": (192, "rtx5090", 6)}


@pytest.mark.parametrize("case", list(CSR_CASES))
@pytest.mark.parametrize("arm", ["unpacked", "splitk"])
def test_every_tiling_reads_a_csr_page_table_and_device_scales_within_one_ulp(arm, case, backend, monkeypatch):
    """Per-KV-head device scales on an fp8 cache, each item folding its own (two KV heads walked
    by 2 CTAs); the next item's length and page row from the CSR table, the sequences long
    enough that the carried entries (Carry) are read."""
    head_dim, target, warps = CSR_CASES[case]
    p = problem(seed=84, page_size=16, seq_lens=(530, 0, 45, 333), kv_dtype="fp8", num_q_heads=4, num_kv_heads=2,
                head_dim=head_dim, per_head_scales=True)
    indptr, indices, last = to_csr(p)
    csr = dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last, csr=True)
    monkeypatch.setattr("metrale_attn.plan.persistent_ctas", lambda tiling, target: 2)
    attn = decoder(p, backend=backend, page_table="csr", device_scales=True, target=target, **ARMS[arm])
    assert _warps(attn) == {warps}
    check_against_reference(p, *run_poisoned(attn, p, **csr))


@pytest.mark.parametrize("head_dim, target, warps", [(128, "hopper", 8), (160, "a100", 6)])
def test_a_rows_bytes_do_not_depend_on_heads_per_cta_its_company_or_its_position(head_dim, target, warps, backend):
    """bf16, 16 query heads on one KV head: heads_per_cta 1, 2, 4, 8 and 16 (one and two row
    tiles: 8 and 16 rows over W warps in stage_q, with 6 the last round partial) give one set of
    bytes; a sequence alone or among others, at any position, gives its own; all within the
    bar. Keys start at every tile offset mod W across the splits."""
    p = problem(seed=85, page_size=16, seq_lens=(700, 3, 0, 257, 129), head_dim=head_dim, num_q_heads=16,
                num_kv_heads=1, kv_dtype="bf16")
    check_bytes_free_of_heads_per_cta_company_and_position(p, backend, warps, splitk="4", target=target)


def test_a_sequences_bytes_on_three_persistent_ctas_do_not_depend_on_its_company_or_position(monkeypatch):
    p = problem(seed=64, page_size=16, seq_lens=(700, 3, 0, 257, 64), head_dim=128, num_q_heads=4,
                num_kv_heads=1, kv_dtype="fp8")
    monkeypatch.setattr("metrale_attn.plan.persistent_ctas", lambda tiling, target: 3)
    attn = decoder(p, splitk="4", max_batch=5)
    full = run_poisoned(attn, p)
    check_against_reference(p, *full)
    for rows in ([3], [1, 3, 0], [4, 2, 3, 1, 0]):
        out, lse = run_poisoned(attn, pick(p, rows))
        at = rows.index(3)
        assert out[at].tobytes() == full[0][3].tobytes() and lse[at].tobytes() == full[1][3].tobytes(), rows


def test_six_warps_are_within_one_ulp_whichever_tile_mod_six_a_rows_keys_start_at(backend):
    """A window whose first key lies in tile k0 = 0..5 (and 6, 13: past a whole round), so the
    first tile of warp w, k0 - k0 % 6 + w (+ 6 for w < k0 % 6), takes every offset."""
    p = problem(seed=97, page_size=16, seq_lens=(700, 300), num_q_heads=4, num_kv_heads=2, head_dim=256,
                kv_dtype="bf16")
    for k0 in (0, 1, 2, 3, 4, 5, 6, 13):
        window_left = 699 - 16 * k0 - 3  # the first key 16 k0 + 3 (the 300-token row: within its window or all)
        attn = decoder(p, backend=backend, window_left=window_left, splitk="off")
        assert _warps(attn) == {6}
        out, lse = run_poisoned(attn, p)
        ref_out, ref_lse = p.reference(return_lse=True, window_left=window_left)
        tolerance.assert_close_to_reference(out, ref_out, v_absmax=p.v_absmax())
        np.testing.assert_allclose(lse, ref_lse, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("order", ["reverse", "warp-ahead:3"])
@pytest.mark.parametrize("head_dim, kv_dtype, warps", [(128, "fp8", 8), (256, "bf16", 6)])
def test_bytes_are_identical_under_other_thread_orders_of_the_cpu_backend(head_dim, kv_dtype, warps, order):
    p = problem(seed=86, page_size=16, seq_lens=(300, 41), head_dim=head_dim, kv_dtype=kv_dtype)
    attn = decoder(p, backend=CpuBackend(order="default"), splitk="4")
    assert _warps(attn) == {warps}
    default = run_poisoned(attn, p)
    assert _bytes(run_poisoned(decoder(p, backend=CpuBackend(order=order), splitk="4"), p)) == _bytes(default)


TIGHTEST_8 = [  # (head dim, q, cache, row tiles, limit): every feature, 8 warps each
    (192, "fp16", "bf16", 2, 227 * 1024),  # the widest 16-row dim, 2 stages (the item loop spilled 8 bytes on sm_100
    (128, "fp16", "bf16", 2, 227 * 1024),  # before the next item's indices were recomputed where they are used)
    (256, "fp16", "fp8", 1, 227 * 1024),   # one row tile from 208 on: fp8 only takes 8 warps there
    (160, "fp16", "fp8", 2, 99 * 1024),    # the widest 8-warp 99 KiB spec
]
TIGHTEST_6 = [  # every feature, 6 warps each
    (256, "fp16", "bf16", 1, 227 * 1024),  # the widest 6-warp dim, two q parts
    (208, "fp16", "bf16", 1, 227 * 1024),
    (192, "fp16", "fp16", 2, 163 * 1024),  # the widest 16-row 6-warp dim
    (192, "fp16", "fp8", 2, 99 * 1024),    # 16 rows, no prefetch (the state fills the ring)
    (224, "fp16", "fp8", 1, 99 * 1024),
]
TIGHTEST_2 = [(256, "fp16", "bf16", 1, 99 * 1024)]  # a 99 KiB target's 2-warp tiling


def _tightest_params() -> list:
    """Every list's specs on every architecture; the default run builds the 8-warp list for
    sm_90 (and its first for sm_120 too) and the first 6-warp and 2-warp specs for sm_90; the
    rest are ``slow`` (CI's slow step)."""
    def first_only(params):  # the first row's two arms on sm_90
        first = [p for p in params if p.values[1] == "sm_90"][:2]
        return [p if p in first else pytest.param(*p.values, id=p.id, marks=[pytest.mark.slow]) for p in params]
    return (tightest_spill_params(TIGHTEST_8, first=("unpacked", 192, "bf16"))
            + first_only(tightest_spill_params(TIGHTEST_6, first=("unpacked", 256, "bf16")))
            + first_only(tightest_spill_params(TIGHTEST_2, first=None)))


@needs_nvrtc
@pytest.mark.parametrize("spec, arch", _tightest_params())
def test_the_tightest_specs_of_every_warp_count_compile_with_no_stack_frame_and_no_spills(spec, arch):
    """Every feature at once with fp16 q (two q parts on a bf16 cache): launch bounds (32 W, 1)
    leave ptxas 255 registers a thread."""
    _, log = nvrtc_build(spec, arch)
    frames = spill_frames(log)
    assert len(frames) == len(spec.kernels) and all(f == ("0", "0", "0") for f in frames), (spec.name, log)


def test_the_tightest_lists_hold_the_warp_counts_they_name():
    from metrale_attn.tiling import mma_tiling

    for rows, warps in ((TIGHTEST_8, 8), (TIGHTEST_6, 6), (TIGHTEST_2, 2)):
        assert {mma_tiling(d, q, kv, rt, limit).warps for d, q, kv, rt, limit in rows} == {warps}
