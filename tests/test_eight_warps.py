"""Kernel v2.3, the default (tiling.WARP_CANDIDATES_V23): v2.2's persistent CTAs with 8 warps per CTA where
their CTA fits the target (6 where 8 do not: tests/test_six_warps.py). W is a function of head dim, cache dtype and target only, so a
row's v2.3 bytes (its own, not v2.2's: W decides the tile -> warp order and the combine) are
the same for every batch, position and heads_per_cta, and within the one bar of float64 on
every arm, dtype and feature."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from metrale_attn import binding, dtypes
from metrale_attn.backends.cpu_backend import CpuBackend
from metrale_attn.config import HEAD_DIMS, resolve_mma_kernel
from metrale_attn.kernels import MMA_KERNEL_SUFFIX, KernelSpec, all_specs, mma_refusal, specs_for
from metrale_attn.plan import KernelGrid
from metrale_attn.targets import TARGETS
from metrale_attn.tiling import max_row_tiles, mma_tiling, resident_ctas, warps_for

from support.builds import needs_nvrtc, nvrtc_build, spill_frames, tightest_spill_params
from support.problems import (check_against_reference, check_bytes_free_of_heads_per_cta_company_and_position,
                              check_features_within_bar_and_on_fewer_persistent_ctas, decoder, problem,
                              run_poisoned, to_csr)

ARMS = {"unpacked": dict(splitk="off"), "splitk": dict(splitk="3"), "gqa_packed": dict(splitk="off", gqa_pack=True)}
LIMITS = {99 * 1024: "99 KiB (sm_86, sm_89, sm_120, sm_121)", 163 * 1024: "163 KiB (sm_80)",
          227 * 1024: "227 KiB (sm_90, sm_100, sm_103)"}


def _v23(attn):
    return list(specs_for(attn.config).values())


def _bytes(out, lse):
    return out.tobytes(), lse.tobytes()


def test_every_v23_spec_fits_the_shared_memory_of_every_target_and_launches_its_warps():
    for target in TARGETS.values():
        for v in all_specs():
            if v.impl != "mma":
                continue
            sized = replace(v, smem_limit=target.smem_per_block, mma_kernel="v2.3")
            t = sized.tiling
            assert t.smem_bytes == sized.shared_bytes <= target.smem_per_block, (target.name, sized.name)
            assert t.persistent and t.bt_staged and not any(s in sized.name for s in MMA_KERNEL_SUFFIX.values()), sized.name
            assert sized.threads == 32 * t.warps and sized.defines()["PD_MMA_WARPS"] == t.warps
            assert sized.defines()["PD_PERSISTENT"] == 1


@pytest.mark.filterwarnings("ignore:metrale-attn.*fp8 cvt:RuntimeWarning")  # sm_80, sm_86 fall back to simt
def test_v23_is_refused_on_a_target_exactly_where_v22_is():
    """Only an fp8 cache without the fp8 cvt (sm_80, sm_86): every v2.3 tiling fits every target."""
    for name, target in TARGETS.items():
        for kv in ("bf16", "fp8"):
            p = problem(seq_lens=(5,), head_dim=256, num_q_heads=4, num_kv_heads=1, kv_dtype=kv)
            configs = [decoder(p, target=name, mma_kernel=k).config for k in ("v2.2", "v2.3")]
            assert configs[1].mma_kernel == "v2.3"
            new, old = (mma_refusal(replace(c, impl="mma")) for c in configs)
            assert new == old and (new is None) == (kv == "bf16" or target.converts_fp8), (name, kv, new)


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


@pytest.mark.parametrize("limit", list(LIMITS), ids=list(LIMITS.values()))
def test_eight_warps_go_where_their_cta_fits_and_depend_on_head_dim_cache_dtype_and_target_only(limit):
    """W (what a row's bytes depend on, with TT) is the same for both q dtypes and every row-tile
    count (which follow heads_per_cta, so the batch); where neither 8 nor 6 warps go
    (tests/test_six_warps.py), v2.3 takes v2.2's W and tiling."""
    for kv in dtypes.KV_DTYPES:
        for head_dim in HEAD_DIMS:
            warps = {mma_tiling(head_dim, q, kv, rt, limit, "v2.3").warps for q in dtypes.Q_DTYPES
                     for rt in range(1, max_row_tiles(head_dim) + 1)}
            assert warps == {warps_for(head_dim, kv, limit, "v2.3")}, (kv, head_dim)
            eight = head_dim in _eight_warp_head_dims(limit, kv)
            six = warps == {6}
            assert eight or six or warps == {warps_for(head_dim, kv, limit, "v2.2")}, (kv, head_dim)
            assert (warps == {8}) == eight, (kv, head_dim)
            if not eight and not six:
                for q in dtypes.Q_DTYPES:
                    for rt in range(1, max_row_tiles(head_dim) + 1):
                        old, new = (mma_tiling(head_dim, q, kv, rt, limit, k) for k in ("v2.2", "v2.3"))
                        assert (new.warps, new.tile_tokens, new.stages, new.smem_bytes) == (
                            old.warps, old.tile_tokens, old.stages, old.smem_bytes)


def test_an_eight_warp_cta_is_alone_on_its_sm_and_a_persistent_launch_is_one_per_sm():
    """8 warps x 32 threads x 255 registers (8,192 a warp) = 65,536: one CTA per SM by registers
    whatever its shared memory (bf16 hd128: 213,248 bytes, 3 stages; 4 warps took 2 CTAs)."""
    hopper = TARGETS["hopper"]
    spec = KernelSpec("splitk", 128, "bf16", "bf16", mma_kernel="v2.3")
    assert (spec.tiling.warps, spec.tiling.tile_tokens, spec.tiling.stages, spec.threads) == (8, 16, 3, 256)
    assert resident_ctas(spec.tiling, hopper.smem_per_block) == 1
    assert resident_ctas(replace(spec.tiling, smem_bytes=1024), hopper.smem_per_block) == 1  # by registers
    assert binding.launch_grid_of(spec, KernelGrid("k", (8, 9, 64)), hopper) == (132, 1, 1)
    assert binding.launch_grid_of(spec, KernelGrid("k", (4, 2, 3)), hopper) == (24, 1, 1)
    assert resolve_mma_kernel("2.3", None) == resolve_mma_kernel(None, "V2.3") == "v2.3"


def _heads(arm):
    return dict(num_q_heads=6, num_kv_heads=1, head_dim=256) if arm == "gqa_packed" else dict(
        num_q_heads=4, num_kv_heads=2, head_dim=128)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("arm", list(ARMS))
def test_v23_is_within_one_ulp_of_the_reference_on_every_arm_and_dtype_with_a_window_sinks_and_query_tokens(
        arm, kv_dtype, backend, monkeypatch):
    """Three query tokens (one on the packed arm), a window of 300 keys and sinks, on 3
    persistent CTAs (fewer than the items, so each walks several) and on as many as the
    device holds: the same bytes, within the bar. 8 warps but on the packed arm's bf16 hd256 (6)."""
    p = problem(seed=81, page_size=16, seq_lens=(0, 700, 37, 290), kv_dtype=kv_dtype, **_heads(arm))
    q_len = 1 if arm == "gqa_packed" else 3
    q = np.random.default_rng(82).standard_normal((4, q_len) + p.q.shape[1:]).astype(p.q.dtype)
    sinks = np.random.default_rng(83).normal(0, 2, p.q.shape[1]).astype(np.float32)
    options = dict(max_q_len=q_len, window_left=300, sinks=True, mma_kernel="v2.3", **ARMS[arm])
    attn = decoder(p, backend=backend, **options)
    assert {v.tiling.warps for v in _v23(attn)} == ({6} if (arm, kv_dtype) == ("gqa_packed", "bf16") else {8})
    check_features_within_bar_and_on_fewer_persistent_ctas(attn, p, q, sinks, monkeypatch, **options)


@pytest.mark.parametrize("arm", ["unpacked", "splitk"])
def test_v23_reads_a_csr_page_table_and_device_scales_within_one_ulp(arm, backend, monkeypatch):
    """Per-KV-head device scales, each item folding its own (two KV heads walked by 2 CTAs)."""
    p = problem(seed=84, page_size=16, seq_lens=(530, 0, 45), kv_dtype="fp8", num_q_heads=4, num_kv_heads=2,
                head_dim=128, per_head_scales=True)
    indptr, indices, last = to_csr(p)
    csr = dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last, csr=True)
    monkeypatch.setattr(binding, "persistent_ctas", lambda tiling, target: 2)
    attn = decoder(p, backend=backend, page_table="csr", device_scales=True, mma_kernel="v2.3", **ARMS[arm])
    assert {v.tiling.warps for v in _v23(attn)} == {8}
    check_against_reference(p, *run_poisoned(attn, p, **csr))


def test_a_v23_rows_bytes_do_not_depend_on_heads_per_cta_its_company_or_its_position(backend):
    """bf16 hd128, 16 query heads on one KV head: heads_per_cta 1, 2, 4, 8 and 16 (one and two
    row tiles: 2 rows a warp in stage_q) give one set of bytes; a sequence alone or among
    others, at any position, gives its own; all within the bar."""
    p = problem(seed=85, page_size=16, seq_lens=(700, 3, 0, 257, 129), head_dim=128, num_q_heads=16,
                num_kv_heads=1, kv_dtype="bf16")
    check_bytes_free_of_heads_per_cta_company_and_position(p, backend, 8, splitk="4", mma_kernel="v2.3")


@pytest.mark.parametrize("order", ["reverse", "warp-ahead:3"])
def test_eight_warp_bytes_are_identical_under_other_thread_orders_of_the_cpu_backend(order):
    p = problem(seed=86, page_size=16, seq_lens=(300, 41), head_dim=128, kv_dtype="fp8")
    options = dict(splitk="4", mma_kernel="v2.3")
    default = run_poisoned(decoder(p, backend=CpuBackend(order="default"), **options), p)
    assert _bytes(*run_poisoned(decoder(p, backend=CpuBackend(order=order), **options), p)) == _bytes(*default)


TIGHTEST = [  # (head dim, q, cache, row tiles, limit): every feature, 8 warps each
    (192, "fp16", "bf16", 2, 227 * 1024),  # the widest 16-row dim, 2 stages
    (128, "fp16", "bf16", 2, 227 * 1024),
    (256, "fp16", "fp8", 1, 227 * 1024),   # one row tile from 208 on: fp8 only takes 8 warps there
    (160, "fp16", "fp8", 2, 99 * 1024),    # the widest 8-warp 99 KiB spec
]
@needs_nvrtc
@pytest.mark.parametrize("spec, arch", tightest_spill_params(TIGHTEST, first=("unpacked", 192, "bf16")))
def test_the_tightest_eight_warp_specs_compile_with_no_stack_frame_and_no_spills(spec, arch):
    """Every feature at once with fp16 q (two q parts on a bf16 cache): launch bounds (256, 1)
    leave ptxas 255 registers a thread, as (128, 1) did."""
    assert spec.tiling.warps == 8
    _, log = nvrtc_build(spec, arch)
    frames = spill_frames(log)
    assert len(frames) == len(spec.kernels) and all(f == ("0", "0", "0") for f in frames), (spec.name, log)
