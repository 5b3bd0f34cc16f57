"""Kernel v2.3 with 6 warps per CTA where 8 do not fit (tiling.WARP_CANDIDATES_V23 = (8, 6, 4, 2), 6 only
from tiling.SIX_WARPS_MIN_HEAD_DIM on): bf16/fp16 hd 208..256 on 227 KiB, 144..192 on 163 KiB, fp8
176..224 on 99 KiB. W = 6 is not a power of two: warp w takes the tiles k = w mod 6 (k0 % 6, not
a mask), stage_q converts 8 or 16 rows in rounds of 6 (the last partial), and the combine runs
over 6 warps. W stays a function of head dim, cache dtype and target, so a row's 6-warp bytes
(its own, not the 4-warp bytes these specs had before) are the same for every batch, position
and heads_per_cta, and within the one bar of float64 on every arm, dtype and feature."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from metrale_attn import binding, dtypes, tolerance
from metrale_attn.backends.cpu_backend import CpuBackend
from metrale_attn.config import HEAD_DIMS
from metrale_attn.kernels import KernelSpec, all_specs, specs_for
from metrale_attn.plan import KernelGrid
from metrale_attn.targets import TARGETS
from metrale_attn.tiling import (SIX_WARPS_MIN_HEAD_DIM, carve, max_row_tiles, mma_tiling, q_parts, resident_ctas,
                                 warps_for)

from support.builds import needs_nvrtc, nvrtc_build, spill_frames, tightest_spill_params
from support.problems import (check_against_reference, check_bytes_free_of_heads_per_cta_company_and_position,
                              check_features_within_bar_and_on_fewer_persistent_ctas, decoder, problem,
                              run_poisoned, to_csr)

LIMITS = {99 * 1024: "99 KiB (sm_86, sm_89, sm_120, sm_121)", 163 * 1024: "163 KiB (sm_80)",
          227 * 1024: "227 KiB (sm_90, sm_100, sm_103)"}


def _six_warp_head_dims(limit: int, kv_dtype: str) -> set:
    """Where the rule gives 6 warps (pinned): where 8 warps' rings of 2 stages do not fit but 6
    do, from head dim 144 on. 227 KiB: bf16/fp16 208..256 (one row tile); 163 KiB: bf16 144 and
    160 (176 and 192 with fp16 q in two parts do not fit 6), fp16 144..192; 99 KiB: fp8 176..224
    (6 would fit at 80 and 96 too, where the model has them lose: 4 warps there)."""
    fp8 = kv_dtype in dtypes.FP8_KINDS
    if limit == 227 * 1024:
        return set() if fp8 else {d for d in HEAD_DIMS if d >= 208}
    if limit == 163 * 1024:
        return set() if fp8 else {d for d in HEAD_DIMS if 144 <= d <= (160 if kv_dtype == "bf16" else 192)}
    return {176, 192, 208, 224} if fp8 else set()


@pytest.mark.parametrize("limit", list(LIMITS), ids=list(LIMITS.values()))
def test_six_warps_go_where_eight_do_not_fit_and_depend_on_head_dim_cache_dtype_and_target_only(limit):
    """W is the same for both q dtypes and every row-tile count (which follow heads_per_cta, so
    the batch); a 6-warp spec takes rings of 2 stages where v2.2's 4 warps take 3, the same ring
    bytes (12 stages a CTA) or nearly."""
    for kv in dtypes.KV_DTYPES:
        for head_dim in HEAD_DIMS:
            tilings = [mma_tiling(head_dim, q, kv, rt, limit, "v2.3") for q in dtypes.Q_DTYPES
                       for rt in range(1, max_row_tiles(head_dim) + 1)]
            assert {t.warps for t in tilings} == {warps_for(head_dim, kv, limit, "v2.3")}, (kv, head_dim)
            six = head_dim in _six_warp_head_dims(limit, kv)
            assert ({t.warps for t in tilings} == {6}) == six, (kv, head_dim)
            if six:
                assert warps_for(head_dim, kv, limit, "v2.2") == 4, (kv, head_dim)
                assert {(t.stages, t.persistent, t.bt_staged) for t in tilings} == {(2, True, True)}, (kv, head_dim)
                assert all(t.smem_bytes <= limit and t.prefetch <= 1 for t in tilings), (kv, head_dim)


def test_six_warps_stay_out_of_head_dims_below_144_even_where_their_cta_fits():
    """At 80 and 96 on the 99 KiB targets a 6-warp CTA of 2 stages fits, but the model has 6 warps
    lose to 4 x 3 (benchmarks/NOTES.md, "Kernel v2.3: 6 warps where 8 do not fit"): 4 warps stay."""
    assert SIX_WARPS_MIN_HEAD_DIM == 144
    limit = 99 * 1024
    for kv in ("bf16", "fp16", "fp8"):
        parts = max(q_parts(q, kv) for q in dtypes.Q_DTYPES)
        for head_dim in (80, 96):
            assert carve(head_dim, parts, kv, max_row_tiles(head_dim), 6, 2) <= limit, (kv, head_dim)
            assert warps_for(head_dim, kv, limit, "v2.3") == warps_for(head_dim, kv, limit, "v2.2") == 4


def test_v21_and_v22_never_take_six_warps():
    for limit in LIMITS:
        for kv in dtypes.KV_DTYPES:
            for head_dim in HEAD_DIMS:
                for kernel in ("v2.2", "v2.1"):
                    assert warps_for(head_dim, kv, limit, kernel) in (4, 2), (limit, kv, head_dim, kernel)


def test_every_six_warp_spec_launches_192_threads_and_its_carve_on_its_target():
    seen = 0
    for target in TARGETS.values():
        for v in all_specs():
            if v.impl != "mma":
                continue
            sized = replace(v, smem_limit=target.smem_per_block, mma_kernel="v2.3")
            if sized.tiling.warps != 6:
                continue
            seen += 1
            assert sized.threads == 192 and sized.defines()["PD_MMA_WARPS"] == 6, sized.name
            assert sized.tiling.smem_bytes == sized.shared_bytes <= target.smem_per_block, (target.name, sized.name)
    assert seen > 0


def test_a_six_warp_cta_is_alone_on_its_sm_and_a_persistent_launch_is_one_per_sm():
    """hd256 bf16 on sm_90: 6 warps x 2 stages, 208,640 bytes (4 x 3 took 208,128), one CTA per SM
    by shared memory (and 6 x 8,192 = 49,152 registers)."""
    hopper = TARGETS["hopper"]
    spec = KernelSpec("splitk", 256, "bf16", "bf16", mma_kernel="v2.3")
    t = spec.tiling
    assert (t.warps, t.tile_tokens, t.stages, t.smem_bytes, t.prefetch, spec.threads) == (6, 16, 2, 208640, 1, 192)
    assert resident_ctas(t, hopper.smem_per_block) == 1
    assert resident_ctas(replace(t, smem_bytes=1024), hopper.smem_per_block) == 1  # by registers: 65,536 // 49,152
    assert binding.launch_grid_of(spec, KernelGrid("k", (4, 2, 64)), hopper) == (132, 1, 1)
    assert binding.launch_grid_of(spec, KernelGrid("k", (4, 2, 3)), hopper) == (24, 1, 1)


def _v23(attn):
    return list(specs_for(attn.config).values())


def _bytes(out, lse):
    return out.tobytes(), lse.tobytes()


CASES = {  # (arm, options, heads, kv dtype, target): every arm and cache dtype at 6 warps, one and two row tiles
    "unpacked bf16 hd256": ("unpacked", dict(splitk="off"), dict(num_q_heads=4, num_kv_heads=2, head_dim=256),
                            "bf16", "hopper"),
    "split-K fp16 hd208": ("splitk", dict(splitk="3"), dict(num_q_heads=4, num_kv_heads=2, head_dim=208), "fp16",
                           "hopper"),
    "packed bf16 hd256": ("gqa_packed", dict(splitk="off", gqa_pack=True),
                          dict(num_q_heads=6, num_kv_heads=1, head_dim=256), "bf16", "hopper"),
    "unpacked fp8 hd176 12 rows on 99 KiB": ("unpacked", dict(splitk="off", heads_per_cta=12),
                                            dict(num_q_heads=12, num_kv_heads=1, head_dim=176), "fp8", "rtx5090"),
    "split-K bf16 hd160 12 rows on 163 KiB": ("splitk", dict(splitk="3", heads_per_cta=12),
                                             dict(num_q_heads=12, num_kv_heads=1, head_dim=160), "bf16", "a100"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_six_warps_are_within_one_ulp_of_the_reference_on_every_arm_and_dtype_with_a_window_sinks_and_query_tokens(
        case, backend, monkeypatch):
    """Query tokens (3; 1 on the packed arm and with 12 heads a CTA: two row tiles, 12 rows over 6
    warps in stage_q; fp8 hd176's 16-row ring has no room for lever 5's prefetch), a
    window of 300 keys and sinks, on 3 persistent CTAs (fewer than the items, so each walks
    several) and on as many as the device holds: the same bytes, within the bar."""
    arm, arm_options, heads, kv_dtype, target = CASES[case]
    p = problem(seed=91, page_size=16, seq_lens=(0, 700, 37, 290), kv_dtype=kv_dtype, **heads)
    q_len = 1 if arm == "gqa_packed" or heads["num_q_heads"] > 8 else 3
    q = np.random.default_rng(92).standard_normal((4, q_len) + p.q.shape[1:]).astype(p.q.dtype)
    sinks = np.random.default_rng(93).normal(0, 2, p.q.shape[1]).astype(np.float32)
    options = dict(max_q_len=q_len, window_left=300, sinks=True, mma_kernel="v2.3", target=target, **arm_options)
    attn = decoder(p, backend=backend, **options)
    assert {v.tiling.warps for v in _v23(attn)} == {6}
    assert attn.plan(4).heads_per_cta == arm_options.get("heads_per_cta", attn.plan(4).heads_per_cta)
    check_features_within_bar_and_on_fewer_persistent_ctas(attn, p, q, sinks, monkeypatch, **options)


def test_six_warps_are_within_one_ulp_whichever_tile_mod_six_a_rows_keys_start_at(backend):
    """A window whose first key lies in tile k0 = 0..5 (and 6, 13: past a whole round), so the
    first tile of warp w, k0 - k0 % 6 + w (+ 6 for w < k0 % 6), takes every offset."""
    p = problem(seed=97, page_size=16, seq_lens=(700, 300), num_q_heads=4, num_kv_heads=2, head_dim=256,
                kv_dtype="bf16")
    for k0 in (0, 1, 2, 3, 4, 5, 6, 13):
        window_left = 699 - 16 * k0 - 3  # the first key 16 k0 + 3 (the 300-token row: within its window or all)
        attn = decoder(p, backend=backend, window_left=window_left, mma_kernel="v2.3", splitk="off")
        assert {v.tiling.warps for v in _v23(attn)} == {6}
        out, lse = run_poisoned(attn, p)
        ref_out, ref_lse = p.reference(return_lse=True, window_left=window_left)
        tolerance.assert_close_to_reference(out, ref_out, v_absmax=p.v_absmax())
        np.testing.assert_allclose(lse, ref_lse, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("arm", ["unpacked", "splitk"])
def test_six_warps_read_a_csr_page_table_and_device_scales_within_one_ulp(arm, backend, monkeypatch):
    """Per-KV-head device scales on an fp8 cache (99 KiB, hd 192), each item folding its own (two KV
    heads walked by 2 CTAs)."""
    p = problem(seed=94, page_size=16, seq_lens=(530, 0, 45), kv_dtype="fp8", num_q_heads=4, num_kv_heads=2,
                head_dim=192, per_head_scales=True)
    indptr, indices, last = to_csr(p)
    csr = dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last, csr=True)
    monkeypatch.setattr(binding, "persistent_ctas", lambda tiling, target: 2)
    attn = decoder(p, backend=backend, page_table="csr", device_scales=True, mma_kernel="v2.3", target="rtx5090",
                   splitk="3" if arm == "splitk" else "off")
    assert {v.tiling.warps for v in _v23(attn)} == {6}
    check_against_reference(p, *run_poisoned(attn, p, **csr))


def test_a_six_warp_rows_bytes_do_not_depend_on_heads_per_cta_its_company_or_its_position(backend):
    """bf16 hd160 on 163 KiB (sm_80), 16 query heads on one KV head: heads_per_cta 1, 2, 4, 8 and
    16 (one and two row tiles: 8 and 16 rows over 6 warps in stage_q, the last round partial) give
    one set of bytes; a sequence alone or among others, at any position, gives its own; all within
    the bar. Keys start at every tile offset mod 6 across the splits."""
    p = problem(seed=95, page_size=16, seq_lens=(700, 3, 0, 257, 129), head_dim=160, num_q_heads=16,
                num_kv_heads=1, kv_dtype="bf16")
    check_bytes_free_of_heads_per_cta_company_and_position(p, backend, 6, splitk="4", mma_kernel="v2.3", target="a100")


@pytest.mark.parametrize("order", ["reverse", "warp-ahead:3"])
def test_six_warp_bytes_are_identical_under_other_thread_orders_of_the_cpu_backend(order):
    p = problem(seed=96, page_size=16, seq_lens=(300, 41), head_dim=256, kv_dtype="bf16")
    options = dict(splitk="4", mma_kernel="v2.3")
    default = run_poisoned(decoder(p, backend=CpuBackend(order="default"), **options), p)
    assert _bytes(*run_poisoned(decoder(p, backend=CpuBackend(order=order), **options), p)) == _bytes(*default)


TIGHTEST = [  # (head dim, q, cache, row tiles, limit): every feature, 6 warps each
    (256, "fp16", "bf16", 1, 227 * 1024),  # the widest 6-warp dim, two q parts
    (208, "fp16", "bf16", 1, 227 * 1024),
    (192, "fp16", "fp16", 2, 163 * 1024),  # the widest 16-row 6-warp dim
    (192, "fp16", "fp8", 2, 99 * 1024),    # 16 rows, no prefetch (the state fills the ring)
    (224, "fp16", "fp8", 1, 99 * 1024),
]
@needs_nvrtc
@pytest.mark.parametrize("spec, arch", tightest_spill_params(TIGHTEST, first=("unpacked", 256, "bf16")))
def test_the_tightest_six_warp_specs_compile_with_no_stack_frame_and_no_spills(spec, arch):
    """Every feature at once with fp16 q: launch bounds (192, 1) leave ptxas 255 registers a thread."""
    assert spec.tiling.warps == 6
    _, log = nvrtc_build(spec, arch)
    frames = spill_frames(log)
    assert len(frames) == len(spec.kernels) and all(f == ("0", "0", "0") for f in frames), (spec.name, log)
