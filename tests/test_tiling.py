"""The mma core's tiling (metrale_attn/tiling.py): sized from each target's shared memory per
block, so every spec launches on every target; W and TT (what a row's bytes depend on) a
function of head dim, cache dtype and target only; the CPU backend refusing what the target
GPU would; and the previous kernel (v2) kept selectable beside v2.1 and the default v2.2
(which share one tiling)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cuda_on_cpu import CudaOnCpuError
from metrale_attn import dtypes
from metrale_attn.config import ENV_MMA_KERNEL, HEAD_DIMS, resolve_mma_kernel
from metrale_attn.kernels import KernelSpec, all_specs, kernel_params
from metrale_attn.backends.cpu_backend import CpuBackend
from metrale_attn.problems import Problem
from metrale_attn.targets import TARGETS
from metrale_attn.tiling import MMA_KERNELS, max_row_tiles, mma_tiling, tile_tokens_for, warps_for

from support.builds import needs_nvrtc, nvrtc_build, spill_frames
from support.problems import check_against_reference, decoder, problem, run_poisoned

LIMITS = sorted({t.smem_per_block for t in TARGETS.values()})
"""Every target's per-block limit: 99 KiB (sm_86, sm_89, sm_120, sm_121), 163 KiB (sm_80),
227 KiB (sm_90, sm_100, sm_103)."""


def _mma_specs(kernel: str = "v2.1"):
    return [replace(v, mma_kernel=kernel) for v in all_specs() if v.impl == "mma"]


def test_every_mma_spec_fits_the_shared_memory_of_every_target():
    for target in TARGETS.values():
        for v in _mma_specs():
            sized = replace(v, smem_limit=target.smem_per_block)
            assert sized.tiling.smem_bytes == sized.shared_bytes <= target.smem_per_block, (target.name, sized.name)
            assert sized.threads == 32 * sized.tiling.warps and sized.defines()["PD_MMA_WARPS"] == sized.tiling.warps


def test_the_previous_kernel_is_sized_for_sm90_and_refused_where_that_does_not_fit():
    for v in _mma_specs("v2"):
        sm90 = v.tiling
        assert (sm90.warps, sm90.bt_staged) == (4, False) and v.name.endswith("_v2")
        for limit in LIMITS:
            sized = mma_tiling(v.head_dim, v.q_dtype, v.kv_dtype, v.row_tiles, limit, "v2")
            assert sized == (sm90 if sm90.smem_bytes <= limit else None)
    assert mma_tiling(256, "bf16", "bf16", 1, 99 * 1024, "v2") is None  # 208 KiB: gb10 runs simt with v2


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kv_dtype", dtypes.KV_DTYPES)
def test_warps_and_tile_tokens_follow_head_dim_cache_dtype_and_target_only(head_dim, kv_dtype):
    """What a row's bytes depend on (W: the tile -> warp order and the combine; TT) must not move
    with q's dtype or the row tiles, which follow heads_per_cta and so the batch."""
    for limit in LIMITS:
        shapes = {(t.warps, t.tile_tokens) for q in dtypes.Q_DTYPES for rt in range(1, max_row_tiles(head_dim) + 1)
                  for t in [mma_tiling(head_dim, q, kv_dtype, rt, limit)]}
        assert shapes == {(warps_for(head_dim, kv_dtype, limit), tile_tokens_for(head_dim, kv_dtype))}, limit


def test_spec_names_are_unique_per_distinct_tiling_and_kernel():
    by_name = {}
    for limit in LIMITS:
        for kernel in MMA_KERNELS:
            for v in _mma_specs(kernel):
                sized = replace(v, smem_limit=limit)
                if mma_tiling(v.head_dim, v.q_dtype, v.kv_dtype, v.row_tiles, limit, kernel) is None:
                    continue
                by_name.setdefault(sized.name, set()).add((sized.tiling, kernel))
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


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_the_previous_kernel_is_selectable_and_within_the_bar(kv_dtype, monkeypatch):
    p = problem(seed=43, num_q_heads=8, num_kv_heads=2, head_dim=128, seq_lens=(300, 1, 0, 97), kv_dtype=kv_dtype)
    old = decoder(p, mma_kernel="v2", splitk="2")
    assert old.config.mma_kernel == "v2" and all(v.name.endswith("_v2") for v in attn_specs(old))
    check_against_reference(p, *run_poisoned(old, p))
    monkeypatch.setenv(ENV_MMA_KERNEL, "2")
    assert decoder(p).config.mma_kernel == "v2"
    assert decoder(p, mma_kernel="v2.1").config.mma_kernel == "v2.1"  # the argument wins


def test_the_mma_kernel_spellings():
    assert resolve_mma_kernel(None, None) == resolve_mma_kernel(None, " ") == "v2.3"
    assert resolve_mma_kernel("2.2", None) == resolve_mma_kernel(None, "V2.2") == "v2.2"
    assert resolve_mma_kernel(" V2 ", "v2.1") == resolve_mma_kernel(None, "2") == "v2"
    assert resolve_mma_kernel("2.1", None) == resolve_mma_kernel(None, "V2.1") == "v2.1"
    assert resolve_mma_kernel("2.3", None) == resolve_mma_kernel(" V2.3", "v2") == resolve_mma_kernel(None, "2.3") == "v2.3"
    with pytest.raises(ValueError, match="mma_kernel must be one of v2.3, v2.2, v2.1, v2"):
        resolve_mma_kernel("v3", None)
    with pytest.raises(ValueError, match=f"{ENV_MMA_KERNEL} must be one of"):
        resolve_mma_kernel(None, "fast")


@needs_nvrtc
@pytest.mark.slow  # ~10 s an architecture on two cores: .ci/run's slow step runs it
@pytest.mark.parametrize("arch", ["sm_120", "sm_121"])
def test_the_heaviest_99_kib_tilings_compile_for_consumer_blackwell_with_no_stack_frame_and_no_spills(arch):
    """Every feature at once, 2 warps at head dim 256 and 4 warps of 2 stages at 128 x 16 rows: the
    99 KiB specs CI's arch matrix (sized for sm_90) does not build."""
    heaviest = [replace(v, smem_limit=99 * 1024) for v in all_specs() if len(v.features) > 1]
    assert {v.tiling.warps for v in heaviest} == {2, 4}
    for v in heaviest:
        _, log = nvrtc_build(v, arch)
        frames = spill_frames(log)
        assert len(frames) == len(v.kernels) and all(f == ("0", "0", "0") for f in frames), (v.name, log)
