"""benchmarks/model/hot_loop.py: a spec's steady-state K/V loop, described from its public fields and
the sources' own constants."""

import pytest

from benchmarks.model.hot_loop import hot_loop, read_constexpr
from metrale_attn.kernels import KernelSpec
from metrale_attn.sources import KernelSourceError


@pytest.mark.parametrize("spec, vec, unroll, tokens, kv_bytes, heads", [
    (KernelSpec("unpacked", 128, "bf16", "bf16", "simt"), 8, 4, 8, 4096, 1),   # 16 threads a row, 2 rows x UNROLL 4
    (KernelSpec("splitk", 64, "fp16", "fp8", "simt"), 16, 4, 32, 4096, 1),     # 4 threads a row, 8 rows x 4
    (KernelSpec("unpacked", 256, "bf16", "fp16", "simt"), 8, 4, 4, 4096, 1),   # a row per warp
    (KernelSpec("gqa_packed", 256, "bf16", "fp8", "simt"), 8, 4, 4, 2048, 6),  # 8-byte fp8 slices, 6 heads per CTA
    (KernelSpec("unpacked", 512, "bf16", "bf16", "simt"), 16, 2, 2, 4096, 1),  # 32-byte slices: UNROLL 2
    (KernelSpec("splitk", 512, "bf16", "fp8", "simt"), 16, 4, 4, 4096, 1),     # fp8 keeps its 16-byte slices
    (KernelSpec("unpacked", 576, "bf16", "bf16", "simt", v_head_dim=512), 16, 2, 2, 4352, 1),  # MLA: K 576 + V 512
    (KernelSpec("splitk", 576, "bf16", "fp8", "simt", v_head_dim=512), 16, 4, 4, 4352, 1),
], ids=lambda x: x.name if isinstance(x, KernelSpec) else None)
def test_the_hot_loop_is_described_from_the_sources_own_constants(spec, vec, unroll, tokens, kv_bytes, heads):
    itemsize = 1 if spec.kv_dtype == "fp8" else 2
    v_dim = spec.v_head_dim or spec.head_dim
    assert read_constexpr(spec.source(), "VEC", kv_itemsize=itemsize, head_dim=spec.head_dim, v_head_dim=v_dim) == vec
    assert read_constexpr(spec.source(), "UNROLL", kv_itemsize=itemsize, known={"VEC": vec}) == unroll
    loop = hot_loop(spec)
    assert (loop.tokens_per_warp_iter, loop.kv_bytes_per_warp_iter, loop.heads_per_cta) == (tokens, kv_bytes, heads)
    assert loop.kernel == spec.kernels[0] and loop.warps_per_cta == spec.threads // 32
    assert (loop.pipeline_stages, loop.stage_bytes, loop.dynamic_smem_bytes) == (0, 0, 0)  # plain loads


@pytest.mark.parametrize("spec, tokens, stages, heads", [
    (KernelSpec("unpacked", 128, "bf16", "bf16"), 16, 3, 8),   # 16 x 256-byte rows of K and V: 8 KiB a stage
    (KernelSpec("splitk", 128, "bf16", "fp8", row_tiles=2), 32, 3, 16),
    (KernelSpec("unpacked", 64, "fp16", "fp8"), 32, 4, 8),     # 4 KiB stages: one deeper
    (KernelSpec("gqa_packed", 256, "fp16", "bf16"), 16, 2, 6),  # 6 warps x 2 stages (8 do not fit)
], ids=lambda x: x.name if isinstance(x, KernelSpec) else None)
def test_the_mma_hot_loop_is_one_stage_of_each_warps_ring(spec, tokens, stages, heads):
    loop, tiling = hot_loop(spec), spec.tiling
    row = spec.head_dim * (1 if spec.kv_dtype == "fp8" else 2)
    assert (tiling.tile_tokens, tiling.stages, loop.heads_per_cta) == (tokens, stages, heads)
    assert loop.kv_bytes_per_warp_iter == 2 * tokens * row and loop.stage_bytes == tiling.warps * 2 * tokens * row
    assert loop.pipeline_stages == stages and loop.dynamic_smem_bytes == spec.shared_bytes > 48 * 1024
    assert loop.grouped == (spec.arm != "gqa_packed")


def test_a_constexpr_the_loader_cannot_evaluate_is_refused():
    assert read_constexpr("constexpr int VEC = 16 / (int)sizeof(pd_kv_t);", "VEC", kv_itemsize=1) == 16
    wide = "constexpr int VEC = PD_HEAD_DIM / 32 > 8 ? PD_HEAD_DIM / 32 : 8;"
    assert [read_constexpr(wide, "VEC", kv_itemsize=2, head_dim=d) for d in (128, 512)] == [8, 16]
    with pytest.raises(KernelSourceError, match="cannot evaluate"):  # PD_HEAD_DIM unknown without head_dim
        read_constexpr(wide, "VEC", kv_itemsize=2)
    with pytest.raises(KernelSourceError, match="cannot evaluate"):
        read_constexpr("constexpr int VEC = kVec<T>;", "VEC", kv_itemsize=2)
    with pytest.raises(KernelSourceError, match="exactly one"):
        read_constexpr("constexpr int UNROLL = 4; constexpr int UNROLL = 2;", "UNROLL", kv_itemsize=2)
