"""The mma core's tiling (metrale_attn/tiling.py): sized from each target's shared memory per
block, so every spec launches on every target; W (8 where its CTA fits, else 6 from head dim
144 on, else 4, else 2) and TT (what a row's bytes depend on) a function of head dim, cache
dtype and target only; one CTA of 8 or 6 warps per SM, so a persistent launch is one CTA an
SM; each warp's prefetch leaves room for its state; the CPU backend refusing what the target
GPU would. The kernels run on every kind of tiling in tests/test_every_tiling.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cuda_on_cpu import CudaOnCpuError
from metrale_attn import dtypes, tiling
from metrale_attn.config import HEAD_DIMS
from metrale_attn.kernels import KernelSpec, all_specs, kernel_params
from metrale_attn.backends.cpu_backend import CpuBackend
from metrale_attn.config import ModelShape
from metrale_attn.plan import make_plan, persistent_ctas
from metrale_attn.problems import Problem
from metrale_attn.targets import TARGETS
from metrale_attn.tiling import (SIX_WARPS_MIN_HEAD_DIM, kv_row_bytes, max_row_tiles, mma_tiling, resident_ctas,
                                 tile_tokens_for, warps_for)

from support.builds import needs_nvrtc, nvrtc_build, spill_frames
from support.problems import check_against_reference, decoder, layer_config, problem, run_poisoned

LIMITS = sorted({t.smem_per_block for t in TARGETS.values()})
"""Every target's per-block limit: 99 KiB (sm_86, sm_89, sm_120, sm_121), 163 KiB (sm_80),
227 KiB (sm_90, sm_100, sm_103)."""


def _mma_specs():
    return [v for v in all_specs() if v.impl == "mma"]


def test_every_mma_spec_fits_the_shared_memory_of_every_target_and_launches_its_warps():
    seen = set()
    for target in TARGETS.values():
        for v in _mma_specs():
            sized = replace(v, smem_limit=target.smem_per_block)
            t = sized.tiling
            assert t.smem_bytes == sized.shared_bytes <= target.smem_per_block, (target.name, sized.name)
            assert sized.threads == 32 * t.warps and sized.defines()["PD_MMA_WARPS"] == t.warps
            assert sized.defines()["PD_PREFETCH"] == t.prefetch
            seen.add(t.warps)
    assert seen == set(tiling.WARP_CANDIDATES)


def _eight_warp_head_dims(limit: int, kv_dtype: str) -> set:
    """Where the rule gives 8 warps (pinned): every fp8 head dim on 163 KiB and up; bf16/fp16
    up to 192 on 227 KiB (8 rings of 2 stages of 16.5 KiB at 208 and up do not fit), up to
    128 on 163 KiB; on 99 KiB fp8 at 64, 144 and 160 only (16-token stages there: 144 and 160
    take TT = 16, 80..128 fp8 TT = 32, whose 8 rings do not fit), never bf16/fp16."""
    fp8 = kv_dtype in dtypes.FP8_KINDS
    if limit == 227 * 1024:
        return set(HEAD_DIMS) if fp8 else {d for d in HEAD_DIMS if d <= 192}
    if limit == 163 * 1024:
        return set(HEAD_DIMS) if fp8 else {d for d in HEAD_DIMS if d <= 128}
    return {64, 144, 160} if fp8 else set()


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


@pytest.mark.parametrize("limit", LIMITS)
def test_eight_warps_go_where_their_cta_fits_six_where_eight_do_not_from_head_dim_144_and_else_four_or_two(limit):
    for kv in dtypes.KV_DTYPES:
        for head_dim in HEAD_DIMS:
            warps = warps_for(head_dim, kv, limit)
            expected = (8 if head_dim in _eight_warp_head_dims(limit, kv)
                        else 6 if head_dim in _six_warp_head_dims(limit, kv) else None)
            if expected is None:
                assert warps in (4, 2), (kv, head_dim)
                four_fit = tiling.carve(head_dim, 2, kv, max_row_tiles(head_dim), 4, 2) <= limit
                assert warps == (4 if four_fit else 2), (kv, head_dim)
            else:
                assert warps == expected, (kv, head_dim)
            assert warps != 6 or head_dim >= SIX_WARPS_MIN_HEAD_DIM


def test_an_eight_or_six_warp_cta_is_alone_on_its_sm_and_a_persistent_launch_is_one_per_sm_at_most_one_per_item():
    """8 warps x 32 threads x 255 registers (8,192 a warp) = 65,536 and 6 warps' 49,152: one CTA
    per SM by registers whatever its shared memory; 4 warps of 107,776 bytes (fp8 hd128 on
    sm_80) two. A launch never has more CTAs than items."""
    hopper = TARGETS["hopper"]
    for head_dim, warps, stages, smem, prefetch in ((128, 8, 3, 213248, 2), (256, 6, 2, 208640, 1)):
        spec = KernelSpec("splitk", head_dim, "bf16", "bf16")
        t = spec.tiling
        assert (t.warps, t.stages, t.smem_bytes, t.prefetch, spec.threads) == (warps, stages, smem, prefetch, 32 * warps)
        assert resident_ctas(t, hopper.smem_per_block) == 1
        assert resident_ctas(replace(t, smem_bytes=1024), hopper.smem_per_block) == 1  # by registers
        assert persistent_ctas(t, hopper) == 132
    four = KernelSpec("splitk", 128, "bf16", "bf16", smem_limit=99 * 1024).tiling
    assert four.warps == 4 and resident_ctas(four, 99 * 1024) == 1
    assert resident_ctas(replace(four, smem_bytes=40 * 1024), 99 * 1024) == 2
    from metrale_attn.targets import resolve_target_policy

    hopper_policy = resolve_target_policy(TARGETS["hopper"], environ={})
    configs = {impl: layer_config(hopper_policy, ModelShape(32, 8, 128), max_batch=64, impl=impl)
               for impl in ("mma", "simt")}
    for batch, items in ((64, 4608), (1, 72)):
        mma, simt = (make_plan(configs[impl], batch) for impl in ("mma", "simt"))
        assert mma.items == items and mma.launch_grid(0) == (min(items, 132), 1, 1)
        assert simt.launch_grid(0) == simt.launches[0].grid and simt.ctas == simt.items  # one CTA an item
        assert mma.launch_grid(1) == mma.launches[1].grid  # the merge: one CTA an item

def test_each_warps_state_fits_past_the_stages_it_prefetches_and_one_more_stage_would_not_leave_room():
    """PREFETCH per spec family: S - 1 where a warp's state (rows x (D + 2) x 4 bytes) fits one
    stage (bf16 hd128 16 rows: 8320 <= 8704 bytes), S - 2 where it takes two (fp8 hd192 16
    rows: 12416 bytes, stages of 6656)."""
    for target in TARGETS.values():
        for head_dim in range(64, 257, 16):
            for kv in ("bf16", "fp8"):
                for row_tiles in (1, 2) if head_dim < tiling.ONE_ROW_TILE_HEAD_DIM else (1,):
                    t = mma_tiling(head_dim, "bf16", kv, row_tiles, target.smem_per_block)
                    stage = 2 * t.tile_tokens * (kv_row_bytes(head_dim, kv) + tiling.ROW_PAD)
                    state = 8 * row_tiles * (head_dim + 2) * 4
                    assert 0 <= t.prefetch <= t.stages - 1 and (t.stages - t.prefetch) * stage >= state
                    assert t.prefetch == t.stages - 1 or (t.stages - t.prefetch - 1) * stage < state
                    assert t.tile_tokens == tile_tokens_for(head_dim, kv)
    assert mma_tiling(128, "bf16", "bf16", 2, 99 * 1024).prefetch == 1
    assert mma_tiling(192, "bf16", "fp8", 2, 99 * 1024).prefetch == 0


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kv_dtype", dtypes.KV_DTYPES)
def test_warps_and_tile_tokens_follow_head_dim_cache_dtype_and_target_only(head_dim, kv_dtype):
    """What a row's bytes depend on (W: the tile -> warp order and the combine; TT) must not move
    with q's dtype or the row tiles, which follow heads_per_cta and so the batch."""
    for limit in LIMITS:
        shapes = {(t.warps, t.tile_tokens) for q in dtypes.Q_DTYPES for rt in range(1, max_row_tiles(head_dim) + 1)
                  for t in [mma_tiling(head_dim, q, kv_dtype, rt, limit)]}
        assert shapes == {(warps_for(head_dim, kv_dtype, limit), tile_tokens_for(head_dim, kv_dtype))}, limit


def test_spec_names_are_unique_per_distinct_tiling():
    by_name = {}
    for limit in LIMITS:
        for v in _mma_specs():
            sized = replace(v, smem_limit=limit)
            by_name.setdefault(sized.name, set()).add(sized.tiling)
    assert all(len(tilings) == 1 for tilings in by_name.values())
    assert "decode_splitk_qbf16_kvbf16_hd256_r8_w2t16s2" in by_name  # 2 warps where 4 do not fit 99 KiB


def test_the_cpu_backend_refuses_a_launch_past_the_shared_memory_of_the_target_it_emulates():
    """A spec built for a 99 KiB target (gb10) launched with sm_90's carve is refused by the
    shim, as that GPU would refuse it; the same launch within the limit runs."""
    from metrale_attn.backends import Launch

    small = KernelSpec("unpacked", 64, "bf16", "bf16", smem_limit=99 * 1024)
    module = CpuBackend().load(small)
    args = tuple(np.zeros(1, np.int64) if p.is_pointer else p.numpy_type(0)
                 for p in kernel_params(small)[small.kernels[0]])
    big = KernelSpec("unpacked", 64, "bf16", "bf16").shared_bytes
    assert big > 99 * 1024 >= small.shared_bytes
    with pytest.raises(CudaOnCpuError, match=r"exceed the 99 KiB per block \(101376 bytes\) of the device emulated"):
        module.launch(Launch(small.kernels[0], (1, 1, 1), (small.threads, 1, 1), big, args))


def test_a_99_kib_target_runs_the_mma_kernels_with_identical_bytes_for_every_heads_per_cta_and_batch():
    """gb10 (sm_121): head dim 256 bf16 takes 2 warps there; a sequence's bytes do not depend on
    heads_per_cta or on its company, and are within the bar of float64."""
    p = problem(seed=41, num_q_heads=4, num_kv_heads=1, head_dim=256, seq_lens=(70, 0, 33), kv_dtype="bf16")
    first = None
    for h in (1, 2, 4):
        attn = decoder(p, target="gb10", heads_per_cta=h, splitk="3")
        assert attn.impl == "mma" and attn.plan(3).heads_per_cta == h
        assert {v.tiling.warps for v in attn_specs(attn)} == {2}
        out, lse = run_poisoned(attn, p)
        if first is None:
            check_against_reference(p, out, lse)
            first = (out, lse)
        assert out.tobytes() == first[0].tobytes() and lse.tobytes() == first[1].tobytes(), h
    alone = Problem(p.q[[2, 0]], p.k_cache, p.v_cache, p.block_tables[[2, 0]], p.seq_lens[[2, 0]], p.k_scale,
                    p.v_scale, p.kv_layout)
    out, lse = run_poisoned(decoder(alone, target="gb10", splitk="3", max_batch=3), alone)
    assert out[1].tobytes() == first[0][0].tobytes() and lse[0].tobytes() == first[1][2].tobytes()


def attn_specs(attn):
    from metrale_attn.kernels import specs_for

    return specs_for(attn.config).values()


@needs_nvrtc
@pytest.mark.slow  # ~10 s an architecture on two cores: .ci/run's slow step runs it
@pytest.mark.parametrize("arch", ["sm_120", "sm_121"])
def test_the_heaviest_99_kib_tilings_compile_for_consumer_blackwell_with_no_stack_frame_and_no_spills(arch):
    """Every feature at once, 2 warps at head dim 256 and 4 warps of 2 stages at 128 x 16 rows: the
    99 KiB specs CI's arch matrix (sized for sm_90) does not build."""
    heaviest = [replace(v, smem_limit=99 * 1024) for v in all_specs() if v.impl == "mma" and len(v.features) > 1]
    assert {v.tiling.warps for v in heaviest} == {2, 4}
    for v in heaviest:
        _, log = nvrtc_build(v, arch)
        frames = spill_frames(log)
        assert len(frames) == len(v.kernels) and all(f == ("0", "0", "0") for f in frames), (v.name, log)
