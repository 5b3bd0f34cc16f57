"""Kernel v2.2, persistent CTAs (decode_core.cuh, "THE SCHEDULE"): a launch of P CTAs walks
the plan's grid of work items, CTA b taking items b, b + P, ...; every row's output and lse
bytes are v2.1's, whatever P, the arm, the dtypes, the features or the batch."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_attn import binding, tiling
from metrale_attn.kernels import KernelSpec
from metrale_attn.problems import Problem
from metrale_attn.targets import TARGETS
from metrale_attn.tiling import mma_tiling, resident_ctas

from support.builds import needs_nvrtc, nvrtc_build, spill_frames
from support.problems import check_against_reference, decoder, problem, run_poisoned, to_csr

ARMS = {"unpacked": dict(splitk="off"), "splitk": dict(splitk="3"), "gqa_packed": dict(splitk="off", gqa_pack=True)}


def _heads(arm):
    return dict(num_q_heads=6, num_kv_heads=1, head_dim=256) if arm == "gqa_packed" else dict(
        num_q_heads=4, num_kv_heads=2, head_dim=128)


def _bytes(out, lse):
    return out.tobytes(), lse.tobytes()


def _launch_grids(attn, p) -> set:
    """The attention kernel's launch grids a call of ``p`` may take on ``attn`` (one per spec)."""
    plan = attn.plan(len(p.seq_lens))
    return {binding.launch_grid_of(v, plan.launches[0], attn.config.target) for v in _specs(attn)}


def _specs(attn):
    from metrale_attn.kernels import specs_for

    return specs_for(attn.config).values()


@pytest.mark.parametrize("ctas", [1, 2, 3])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("arm", list(ARMS))
def test_persistent_ctas_give_the_bytes_of_one_cta_per_item_on_every_arm_and_dtype(arm, kv_dtype, ctas,
                                                                                    monkeypatch):
    """P = 1, 2, 3 CTAs (fewer than the items, so every CTA walks several, some one more than
    others) give v2.1's bytes, with a window, sinks and three query tokens."""
    p = problem(seed=61, page_size=16, seq_lens=(0, 300, 37, 90), kv_dtype=kv_dtype, **_heads(arm))
    q = np.random.default_rng(62).standard_normal((4, 3) + p.q.shape[1:]).astype(p.q.dtype)
    sinks = np.random.default_rng(63).normal(0, 2, p.q.shape[1]).astype(np.float32)
    options = dict(max_q_len=3, window_left=70, sinks=True, **ARMS[arm])
    plain = run_poisoned(decoder(p, mma_kernel="v2.1", **options), p, q=q, sinks=sinks)
    monkeypatch.setattr(binding, "persistent_ctas", lambda tiling, target: ctas)
    attn = decoder(p, mma_kernel="v2.2", **options)
    assert all("_v22" in v.name and v.tiling.persistent for v in _specs(attn))
    items = attn.plan(4).launches[0].ctas
    assert items > ctas and _launch_grids(attn, p) == {(ctas, 1, 1)}
    assert _bytes(*run_poisoned(attn, p, q=q, sinks=sinks)) == _bytes(*plain)


def test_a_sequences_persistent_bytes_do_not_depend_on_its_company_or_position(monkeypatch):
    p = problem(seed=64, page_size=16, seq_lens=(700, 3, 0, 257, 64), head_dim=128, num_q_heads=4,
                num_kv_heads=1, kv_dtype="fp8")
    monkeypatch.setattr(binding, "persistent_ctas", lambda tiling, target: 3)
    attn = decoder(p, mma_kernel="v2.2", splitk="4", max_batch=5)
    full = run_poisoned(attn, p)
    check_against_reference(p, *full)
    for rows in ([3], [1, 3, 0], [4, 2, 3, 1, 0]):
        sub = Problem(p.q[rows], p.k_cache, p.v_cache, p.block_tables[rows], p.seq_lens[rows], p.k_scale,
                      p.v_scale, p.kv_layout)
        out, lse = run_poisoned(attn, sub)
        at = rows.index(3)
        assert out[at].tobytes() == full[0][3].tobytes() and lse[at].tobytes() == full[1][3].tobytes(), rows


def test_a_persistent_launch_is_the_ctas_the_sms_hold_at_most_one_per_item():
    """hopper: two 107,776-byte CTAs per SM (bf16 hd128) on 132 SMs, one 212,352-byte CTA
    (bf16 hd256); never more CTAs than items; a plain kernel launches the plan's grid."""
    from metrale_attn.plan import KernelGrid

    hopper = TARGETS["hopper"]
    for head_dim, per_sm in ((128, 2), (256, 1)):
        spec = KernelSpec("splitk", head_dim, "bf16", "bf16", mma_kernel="v2.2")
        assert resident_ctas(spec.tiling, hopper.smem_per_block) == per_sm
        assert binding.launch_grid_of(spec, KernelGrid("k", (8, 9, 64)), hopper) == (per_sm * 132, 1, 1)
        assert binding.launch_grid_of(spec, KernelGrid("k", (8, 1, 3)), hopper) == (24, 1, 1)
    plain = KernelSpec("splitk", 128, "bf16", "bf16", mma_kernel="v2.1")
    assert binding.launch_grid_of(plain, KernelGrid("k", (8, 9, 64)), hopper) == (8, 9, 64)


def test_the_persistent_kernel_keeps_the_tiling_of_v21_on_every_target():
    for target in TARGETS.values():
        for head_dim, kv in ((64, "fp8"), (128, "bf16"), (128, "fp8"), (256, "bf16")):
            old = mma_tiling(head_dim, "bf16", kv, 1, target.smem_per_block, "v2.1")
            new = mma_tiling(head_dim, "bf16", kv, 1, target.smem_per_block, "v2.2")
            assert (new.warps, new.tile_tokens, new.stages, new.smem_bytes, new.persistent) == (
                old.warps, old.tile_tokens, old.stages, old.smem_bytes, True)


@pytest.mark.parametrize("depth", ["the most", 1, 0])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("arm", list(ARMS))
def test_the_next_items_tiles_in_flight_across_the_epilogue_keep_the_bytes_of_v21(arm, kv_dtype, depth,
                                                                                   monkeypatch):
    """Lever 5: each warp issues its first PREFETCH tiles of the CTA's next item before the
    epilogue and publishes its state past them. Two CTAs walk items of long sequences (every
    warp's tiles S - 1 and S exist, so the entries carried across the epilogue are used)
    between empty ones, with a window, sinks and two query tokens; the spec's own depth
    (S - 1 here), a shallower one (1 of 2: the prologue issues the rest) and none (the
    warp states in every ring, as v2.1) all give v2.1's bytes."""
    p = problem(seed=71, page_size=16, seq_lens=(520, 0, 300, 1, 0, 700), kv_dtype=kv_dtype, **_heads(arm))
    q = np.random.default_rng(72).standard_normal((6, 2) + p.q.shape[1:]).astype(p.q.dtype)
    sinks = np.random.default_rng(73).normal(0, 2, p.q.shape[1]).astype(np.float32)
    arm_options = dict(ARMS[arm], splitk="2") if arm == "splitk" else ARMS[arm]
    options = dict(max_q_len=2, window_left=260, sinks=True, **arm_options)
    plain = run_poisoned(decoder(p, mma_kernel="v2.1", **options), p, q=q, sinks=sinks)
    most = tiling.prefetch_stages
    if depth != "the most":
        monkeypatch.setattr(tiling, "prefetch_stages", lambda *a: min(depth, most(*a)))
    monkeypatch.setattr(binding, "persistent_ctas", lambda tiling, target: 2)
    attn = decoder(p, mma_kernel="v2.2", **options)
    expected = {v.tiling.stages - 1 if depth == "the most" else depth for v in _specs(attn)}
    assert {v.tiling.prefetch for v in _specs(attn)} == expected and _launch_grids(attn, p) == {(2, 1, 1)}
    assert _bytes(*run_poisoned(attn, p, q=q, sinks=sinks)) == _bytes(*plain)


def test_each_warps_state_fits_past_the_stages_it_prefetches_and_one_more_stage_would_not_leave_room():
    """PREFETCH per spec family: S - 1 where a warp's state (rows x (D + 2) x 4 bytes) fits one
    stage (bf16 hd128 16 rows: 8320 <= 8704 bytes), S - 2 where it takes two (fp8 hd192 16
    rows: 12416 bytes, stages of 6656), and only kernel v2.2 prefetches."""
    from metrale_attn.tiling import kv_row_bytes, tile_tokens_for

    for target in TARGETS.values():
        for head_dim in range(64, 257, 16):
            for kv in ("bf16", "fp8"):
                for row_tiles in (1, 2) if head_dim < tiling.ONE_ROW_TILE_HEAD_DIM else (1,):
                    t = mma_tiling(head_dim, "bf16", kv, row_tiles, target.smem_per_block, "v2.2")
                    if t is None:
                        continue
                    stage = 2 * t.tile_tokens * (kv_row_bytes(head_dim, kv) + tiling.ROW_PAD)
                    state = 8 * row_tiles * (head_dim + 2) * 4
                    assert 0 <= t.prefetch <= t.stages - 1 and (t.stages - t.prefetch) * stage >= state
                    assert t.prefetch == t.stages - 1 or (t.stages - t.prefetch - 1) * stage < state
                    assert t.tile_tokens == tile_tokens_for(head_dim, kv)
                    assert mma_tiling(head_dim, "bf16", kv, row_tiles, target.smem_per_block, "v2.1").prefetch == 0
    assert mma_tiling(128, "bf16", "bf16", 2, kernel="v2.2").prefetch == 2
    assert mma_tiling(192, "bf16", "fp8", 2, kernel="v2.2").prefetch == 1


@pytest.mark.parametrize("arm", ["unpacked", "splitk"])
def test_persistent_ctas_read_a_csr_page_table_and_device_scales_with_the_bytes_of_v21(arm, monkeypatch):
    """The next item's length and page row come from the CSR table, its scales from the
    device, per KV head: each item folds its own (two KV heads walked by one CTA); the
    sequences are long enough that lever 5's carried entries are read."""
    p = problem(seed=65, page_size=16, seq_lens=(400, 0, 45, 333), kv_dtype="fp8", num_q_heads=4, num_kv_heads=2,
                head_dim=128, per_head_scales=True)
    indptr, indices, last = to_csr(p)
    options = dict(page_table="csr", device_scales=True, **ARMS[arm])
    csr = dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last, csr=True)
    plain = run_poisoned(decoder(p, mma_kernel="v2.1", **options), p, **csr)
    monkeypatch.setattr(binding, "persistent_ctas", lambda tiling, target: 2)
    assert _bytes(*run_poisoned(decoder(p, mma_kernel="v2.2", **options), p, **csr)) == _bytes(*plain)


@needs_nvrtc
@pytest.mark.parametrize("head_dim, row_tiles, arch, limit", [(192, 2, "sm_100", 227 * 1024),
                                                              (256, 1, "sm_120", 99 * 1024)])
def test_the_tightest_persistent_specs_compile_with_no_stack_frame_and_no_spills(head_dim, row_tiles, arch, limit):
    """Every feature at once: head dim 192 with 16 rows (255 registers on sm_100; the item loop
    spilled 8 bytes there before the next item's indices were recomputed where they are used)
    and head dim 256 in a 99 KiB target's 2-warp tiling."""
    from metrale_attn.kernels import FEATURES

    spec = KernelSpec("unpacked", head_dim, "fp16", "bf16", "mma", row_tiles, set(FEATURES), smem_limit=limit,
                      mma_kernel="v2.2")
    _, log = nvrtc_build(spec, arch)
    frames = spill_frames(log)
    assert len(frames) == len(spec.kernels) and all(f == ("0", "0", "0") for f in frames), (spec.name, log)
