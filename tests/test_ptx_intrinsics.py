"""kernels_cu/pd_ptx.cuh on the CPU backend: every intrinsic against the PTX ISA (and CuTe),
exactly; the planted bugs a pipeline can have must fail; the header builds under NVRTC.

The toy kernels are tests/toy_kernels/ptx_*.cu (see support/ptx_toys.py); test_gpu.py runs the same
ones on a device and compares them with this emulation.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from cuda_on_cpu import CudaOnCpuError
from cuda_on_cpu.asan import libasan_path
from metrale_attn import sources

from support.ptx_toys import (
    ALL_16_BIT,
    BF16_NAN,
    COPY_KERNELS,
    CP_ASYNC,
    CVT,
    F16_NAN,
    F32_NAN,
    LDMATRIX_VARIANTS,
    MATRIX,
    MISUSE,
    MUST_HAVE_LANDED,
    POISON,
    TOYS,
    CpuRunner,
    copy_case,
    fixed_order_mma,
    float64_mma,
    fp8_to_f16_table,
    group_snapshots,
    halves_as_float,
    ldmatrix_rows,
    line_of,
    prmt_model,
    random_halves,
    rng_for,
    round_f32,
    rounding_inputs,
    run_cvt,
    run_gemm,
    run_ldmatrix,
    run_mma,
    run_mma_regs,
    run_movmatrix,
    run_pipelined_copy,
    toy_source,
)

CPU = CpuRunner()
ORDERS = ["default", "reverse", "shuffle:1", "shuffle:2", "warp-ahead:1", "warp-ahead:2"]
SEEDED = [f"{policy}:{seed}" for policy in ("shuffle", "warp-ahead") for seed in range(1, 6)]

needs_asan = pytest.mark.skipif(libasan_path() is None, reason="the host compiler has no libasan.so")


# ---------------------------------------------------------------------------------------
# The fragment layouts, stated twice: as the PTX ISA's formulas and as CuTe's tables
# ---------------------------------------------------------------------------------------


def ptx_mma_a(lane, i):
    """(row, col) of element ai of A, PTX ISA 9.1 §9.7.14.5.8 (m16n8k16, .f16/.bf16)."""
    group, tig = lane >> 2, lane % 4
    row = group if (i < 2 or 4 <= i < 6) else group + 8
    col = tig * 2 + (i & 1) + (8 if i >= 4 else 0)
    return row, col


def ptx_mma_b(lane, i):
    group, tig = lane >> 2, lane % 4
    return tig * 2 + (i & 1) + (8 if i >= 2 else 0), group


def ptx_mma_c(lane, i):
    group, tig = lane >> 2, lane % 4
    return (group if i < 2 else group + 8), tig * 2 + (i & 1)


def ptx_ldmatrix(lane, element, trans):
    """(row, col) of the 8x8 matrix that half `element` of lane's register holds (§9.7.14.5.15,
    Figure 104): a group of four lanes holds a row; .trans loads the matrix column-major."""
    row, col = lane // 4, 2 * (lane % 4) + element
    return (col, row) if trans else (row, col)


def cute_size(shape) -> int:
    return shape if isinstance(shape, int) else int(np.prod([cute_size(s) for s in shape]))


def cute_offset(shape, stride, index: int) -> int:
    """A CuTe layout applied to a 1-D index (colexicographic: the leftmost mode fastest)."""
    if isinstance(shape, int):
        return (index % shape) * stride
    offset = 0
    for s, d in zip(shape, stride):
        offset += cute_offset(s, d, index % cute_size(s))
        index //= cute_size(s)
    return offset


def cute_tv(layout, thread: int, value: int) -> int:
    (t_shape, v_shape), (t_stride, v_stride) = layout
    return cute_offset(t_shape, t_stride, thread) + cute_offset(v_shape, v_stride, value)


# include/cute/atom/mma_traits_sm80.hpp, MMA_Traits<SM80_16x8x16_F32BF16BF16F32_TN> (= the
# F16F16F16F16 one's layouts): (thread, value) -> index of the MxK, NxK, MxN tile, column-major.
CUTE_SM80_16x8x16 = {
    "A": ((((4, 8), (2, 2, 2)), ((32, 1), (16, 8, 128))), 16),  # (layout, rows M of the (M, K) tile)
    "B": ((((4, 8), (2, 2)), ((16, 1), (8, 64))), 8),           # (N, K)
    "C": ((((4, 8), (2, 2)), ((32, 1), (16, 8))), 16),          # (M, N): SM80_16x8_Row
}

# include/cute/atom/copy_traits_sm75.hpp: (SrcLayout, DstLayout), (thread, value) -> bit.
CUTE_LDSM = {
    (1, False): ((((8, 4), 128), ((128, 0), 1)), ((32, 32), (32, 1))),                      # SM75_U32x1_LDSM_N
    (2, False): ((((16, 2), 128), ((128, 0), 1)), ((32, (32, 2)), (32, (1, 1024)))),        # SM75_U32x2_LDSM_N
    (4, False): (((32, 128), (128, 1)), ((32, (32, 4)), (32, (1, 1024)))),                  # SM75_U32x4_LDSM_N
    (1, True): ((((8, 4), 128), ((128, 0), 1)), (((4, 8), (16, 2)), ((256, 16), (1, 128)))),  # SM75_U16x2_LDSM_T
    (2, True): ((((16, 2), 128), ((128, 0), 1)),
                (((4, 8), (16, 2, 2)), ((256, 16), (1, 128, 1024)))),                       # SM75_U16x4_LDSM_T
    (4, True): (((32, 128), (128, 1)), (((4, 8), (16, 2, 4)), ((256, 16), (1, 128, 1024)))),  # SM75_U16x8_LDSM_T
}


def pack_halves(lo, hi):
    return (np.asarray(lo, np.uint32) | (np.asarray(hi, np.uint32) << 16)).astype(np.uint32)


def mma_problem(rng, dtype):
    A, B = random_halves(rng, (16, 16), dtype), random_halves(rng, (16, 8), dtype)
    C = (rng.standard_normal((16, 8)) * 4).astype(np.float32)
    return A, B, C, halves_as_float(A, dtype), halves_as_float(B, dtype)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_the_mma_emulation_places_fragments_where_the_ptx_isa_formulas_say(dtype):
    A, B, C, Af, Bf = mma_problem(rng_for("ptx-mma", dtype), dtype)
    lanes = range(32)
    a = [[pack_halves(A[ptx_mma_a(l, 2 * r)], A[ptx_mma_a(l, 2 * r + 1)]) for r in range(4)] for l in lanes]
    b = [[pack_halves(B[ptx_mma_b(l, 2 * r)], B[ptx_mma_b(l, 2 * r + 1)]) for r in range(2)] for l in lanes]
    c = [[C[ptx_mma_c(l, i)] for i in range(4)] for l in lanes]
    d = run_mma_regs(CPU, np.array(a), np.array(b), np.array(c), dtype == "f16")
    D = fixed_order_mma(Af, Bf, C)
    expect = np.array([[D[ptx_mma_c(l, i)] for i in range(4)] for l in lanes], np.float32)
    assert d.tobytes() == expect.tobytes()


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_the_mma_emulation_agrees_with_cutes_sm80_16x8x16_layout_tables(dtype):
    A, B, C, Af, Bf = mma_problem(rng_for("cute-mma", dtype), dtype)

    def element(matrix, name, lane, value):  # CuTe: value v of a thread is half v % 2 of register v // 2
        layout, rows = CUTE_SM80_16x8x16[name]
        offset = cute_tv(layout, lane, value)
        return matrix[offset % rows, offset // rows]

    lanes = range(32)
    a = [[pack_halves(element(A, "A", l, 2 * r), element(A, "A", l, 2 * r + 1)) for r in range(4)] for l in lanes]
    b = [[pack_halves(element(B.T, "B", l, 2 * r), element(B.T, "B", l, 2 * r + 1)) for r in range(2)]
         for l in lanes]  # B's tile is (N, K)
    c = [[element(C, "C", l, v) for v in range(4)] for l in lanes]
    d = run_mma_regs(CPU, np.array(a), np.array(b), np.array(c, np.float32), dtype == "f16")
    D = fixed_order_mma(Af, Bf, C)
    expect = np.array([[element(D, "C", l, v) for v in range(4)] for l in lanes], np.float32)
    assert d.tobytes() == expect.tobytes()


@pytest.mark.parametrize("num, trans", LDMATRIX_VARIANTS)
def test_ldmatrix_gives_each_lane_the_fragment_the_ptx_isa_figure_shows(num, trans):
    rows, row_of_lane = ldmatrix_rows(rng_for("ptx-ldmatrix", num, trans), num)
    r = run_ldmatrix(CPU, num, trans, rows, row_of_lane)
    for j in range(num):
        matrix = rows[row_of_lane[8 * j: 8 * j + 8]]  # row i of matrix j is addressed by lane 8j + i
        expect = [pack_halves(matrix[ptx_ldmatrix(l, 0, trans)], matrix[ptx_ldmatrix(l, 1, trans)]) for l in range(32)]
        np.testing.assert_array_equal(r[:, j], expect, err_msg=f"matrix {j}")


@pytest.mark.parametrize("num, trans", LDMATRIX_VARIANTS)
def test_ldmatrix_moves_every_bit_where_cutes_ldsm_copy_traits_say(num, trans):
    rows, row_of_lane = ldmatrix_rows(rng_for("cute-ldmatrix", num, trans), num)
    r = run_ldmatrix(CPU, num, trans, rows, row_of_lane)
    src_layout, dst_layout = CUTE_LDSM[(num, trans)]
    # Reference bit -> the (thread, bit of its 128-bit row) that supplies it; threads whose
    # stride is 0 in CuTe's table alias lower ones: the first (lowest) thread is the source.
    source = {}
    for thread in range(32):
        for bit in range(128):
            source.setdefault(cute_tv(src_layout, thread, bit), (thread, bit))
    row_bits = np.unpackbits(rows[row_of_lane].view(np.uint8), axis=1, bitorder="little")  # [32, 128]
    got_bits = np.unpackbits(r.astype("<u4").view(np.uint8).reshape(32, num, 4), axis=2, bitorder="little")
    for lane in range(32):
        for value in range(32 * num):  # value v: bit v % 32 of register v // 32
            thread, bit = source[cute_tv(dst_layout, lane, value)]
            assert got_bits[lane, value // 32, value % 32] == row_bits[thread, bit], (lane, value)


def test_movmatrix_gives_each_lane_its_fragment_of_the_transpose():
    rng = rng_for("movmatrix")
    matrices = rng.integers(0, 1 << 16, (3, 8, 8), dtype=np.uint16)  # one per warp

    def fragments(m):
        return np.array([pack_halves(m[ptx_ldmatrix(l, 0, False)], m[ptx_ldmatrix(l, 1, False)]) for l in range(32)])

    out = run_movmatrix(CPU, np.concatenate([fragments(m) for m in matrices]).astype(np.uint32))
    np.testing.assert_array_equal(out, np.concatenate([fragments(m.T) for m in matrices]))


# ---------------------------------------------------------------------------------------
# MMA and GEMM values against NumPy
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("in_place", [False, True], ids=["d-apart", "d-is-c"])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_one_m16n8k16_mma_is_the_fixed_order_fp32_sum_of_exact_products(dtype, in_place):
    A, B, C, D = run_mma(CPU, dtype, rng_for("mma", dtype, in_place), in_place=in_place)
    expect = fixed_order_mma(A, B, C)
    for warp in D:
        assert warp.tobytes() == expect.tobytes()
    exact, magnitude = float64_mma(A, B, C)
    assert (np.abs(D[0] - exact) <= 17 * 2.0**-24 * magnitude).all()  # and that is the product


def test_nan_results_of_the_emulated_mma_are_the_canonical_fp32_nan():
    lanes = 32
    a = np.zeros((lanes, 4), np.uint32)
    a[0, 0] = 0x7F80  # lane 0's a0 = A[0][0] = +inf (bf16), b = 0: inf * 0 = NaN in row 0
    d = run_mma_regs(CPU, a, np.zeros((lanes, 2), np.uint32), np.zeros((lanes, 4), np.float32), False)
    bits = d.view(np.uint32)
    assert (bits[:4, :2] == F32_NAN).all()  # lanes 0-3 hold row 0
    assert (bits[4:] == 0).all() and (bits[:4, 2:] == 0).all()


def test_mma_products_that_underflow_fp32_are_kept_as_subnormals():
    tiny = 57 << 7  # bf16 2^-70: every product is 2^-140, an fp32 subnormal
    a, b = np.full((32, 4), tiny * 0x10001, np.uint32), np.full((32, 2), tiny * 0x10001, np.uint32)
    d = run_mma_regs(CPU, a, b, np.zeros((32, 4), np.float32), False)
    assert (d.view(np.uint32) == 16 << 9).all()  # 16 * 2^-140 = 2^-136 = 2^13 * 2^-149


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_a_64x64x64_gemm_through_cp_async_ldmatrix_and_mma_matches_numpy(dtype):
    A, B, D = run_gemm(CPU, dtype, rng_for("gemm", dtype))
    assert D.tobytes() == fixed_order_mma(A, B, np.zeros((64, 64), np.float32)).tobytes()


# ---------------------------------------------------------------------------------------
# cp.async
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", list(COPY_KERNELS))
def test_a_double_buffered_cp_async_copy_is_byte_exact_with_zero_fill_under_every_order(kernel):
    data, src_bytes, expect = copy_case(rng_for("copy", kernel), COPY_KERNELS[kernel])
    assert (src_bytes < COPY_KERNELS[kernel]).any() and (src_bytes == 0).any()
    for order in ORDERS:
        out = run_pipelined_copy(CpuRunner(order), kernel, data, src_bytes)
        np.testing.assert_array_equal(out, expect, err_msg=order)


@pytest.mark.parametrize("bug", [1, 2], ids=["no-wait", "wait-group-too-short"])
@pytest.mark.parametrize("kernel", ["copy_ca4", "copy_cg16", "copy_cg16_at"])
def test_a_pipeline_with_a_missing_or_too_short_wait_gives_wrong_bytes_under_every_order(kernel, bug):
    """What it reads instead is the poison, or (too short) a stale tile whose copy landed late."""
    data, src_bytes, expect = copy_case(rng_for("bug", kernel, bug), COPY_KERNELS[kernel])
    for order in ["default", "reverse", *SEEDED[:4]]:
        out = run_pipelined_copy(CpuRunner(order), kernel, data, src_bytes, bug=bug)
        assert (out != expect).any(), order
    if bug == 1:  # without a wait nothing ever lands under the default order
        assert (run_pipelined_copy(CPU, kernel, data, src_bytes, bug=bug) == POISON).all()


@pytest.mark.parametrize("order", ["default", "reverse"])
def test_wait_group_n_lands_exactly_the_committed_groups_but_the_newest_n(order):
    landed = group_snapshots(CpuRunner(order))
    assert (landed == MUST_HAVE_LANDED).all()  # __syncthreads lands nothing; wait_group never the open group


def test_under_seeded_orders_copies_may_land_early_but_always_by_their_wait():
    early = 0
    for order in SEEDED:
        landed = group_snapshots(CpuRunner(order))
        assert (landed[:, MUST_HAVE_LANDED]).all(), order
        assert (landed[:, 1:] >= landed[:, :-1]).all(), order  # a landed copy stays landed
        early += int((landed & ~MUST_HAVE_LANDED).sum())
    assert early > 0, "no seeded order landed a copy before its wait"


@needs_asan
def test_asan_reports_an_out_of_bounds_cp_async_source_at_the_line_of_the_copy():
    mod_runner = CpuRunner(asan=True)
    data, out = np.zeros(32 * 16, np.uint8), np.zeros(32 * 16, np.uint8)
    mod_runner.launch(CP_ASYNC, "shifted_copy", (1, 1, 1), (32, 1, 1), 32 * 16, (data, out, np.int32(0), np.int32(0)))
    with pytest.raises(CudaOnCpuError) as e:
        mod_runner.launch(CP_ASYNC, "shifted_copy", (1, 1, 1), (32, 1, 1), 32 * 16,
                          (data, out, np.int32(16), np.int32(0)))
    msg = str(e.value)
    assert "heap-buffer-overflow" in msg and "READ of size" in msg
    assert f"tests/toy_kernels/ptx_cp_async.cu:{line_of(CP_ASYNC, 'pd_cp_async_cg_16(buf + 16 * l')}" in msg
    assert "kernel 'shifted_copy' block (0,0,0) thread (31,0,0)" in msg


@needs_asan
def test_asan_reports_a_cp_async_destination_past_the_dynamic_shared_buffer():
    data, out = np.zeros(32 * 16, np.uint8), np.zeros(32 * 16, np.uint8)
    with pytest.raises(CudaOnCpuError) as e:
        CpuRunner(asan=True).launch(CP_ASYNC, "shifted_copy", (1, 1, 1), (32, 1, 1), 32 * 16,
                                    (data, out, np.int32(0), np.int32(16)))
    msg = str(e.value)
    assert "heap-buffer-overflow" in msg and "WRITE of size 16" in msg
    assert f"tests/toy_kernels/ptx_cp_async.cu:{line_of(CP_ASYNC, 'pd_cp_async_cg_16(buf + 16 * l')}" in msg


@pytest.mark.parametrize("mode, pattern", [
    (1, r"src_bytes 17 exceeds the copy size 16"),
    (2, r"destination address 0x[0-9a-f]+ is not 16-byte aligned"),
    (3, r"destination address 0x[0-9a-f]+ \(16 bytes\) is not in the block's shared memory"),
    (4, r"source address 0x[0-9a-f]+ is in shared memory"),
])
def test_a_cp_async_the_gpu_would_reject_is_an_error_naming_its_line(mode, pattern):
    with pytest.raises(CudaOnCpuError) as e:
        CPU.launch(CP_ASYNC, "bad_copy", (1, 1, 1), (32, 1, 1), 32 * 16, (np.zeros(32 * 16, np.uint8), np.int32(mode)))
    msg = str(e.value)
    assert re.search(pattern, msg), msg
    assert f"pd_cp_async_ca_16 at tests/toy_kernels/ptx_cp_async.cu:{line_of(CP_ASYNC, 'pd_cp_async_ca_16(dst, src, mode')}" in msg


@pytest.mark.parametrize("asan", [False, pytest.param(True, marks=needs_asan)], ids=["plain", "asan"])
def test_a_cp_async_of_zero_source_bytes_reads_nothing_and_zero_fills(asan):
    out = np.full(32 * 16, 0x77, np.uint8)
    CpuRunner(asan=asan).launch(CP_ASYNC, "bad_copy", (1, 1, 1), (32, 1, 1), 32 * 16, (out, np.int32(5)))
    assert (out == 0).all()


def test_without_asan_a_cp_async_destination_past_the_dynamic_buffer_is_an_error_too():
    data, out = np.zeros(32 * 16, np.uint8), np.zeros(32 * 16, np.uint8)
    with pytest.raises(CudaOnCpuError, match=r"thread \(31,0,0\): pd_cp_async_cg_16 at .*not in the block's shared"):
        CPU.launch(CP_ASYNC, "shifted_copy", (1, 1, 1), (32, 1, 1), 32 * 16, (data, out, np.int32(0), np.int32(16)))


# ---------------------------------------------------------------------------------------
# Warp-collective misuse
# ---------------------------------------------------------------------------------------


def misuse(kernel, block=32, args=None):
    with pytest.raises(CudaOnCpuError) as e:
        CPU.launch(MISUSE, kernel, (1, 1, 1), (block, 1, 1), 32 * 16, args or (np.zeros(block, np.float32),))
    return str(e.value)


def at(needle):
    return f"tests/toy_kernels/ptx_misuse.cu:{line_of(MISUSE, needle)}"


def test_a_lane_divergent_mma_is_an_error_naming_both_lines():
    msg = misuse("mma_divergent")
    assert "kernel 'mma_divergent' block (0,0,0) thread (0,0,0)" in msg and "disagree" in msg
    assert f"pd_mma_bf16_m16n8k16 at {at('// first half')}" in msg
    assert f"pd_mma_bf16_m16n8k16 at {at('// second half')}" in msg


def test_an_mma_whose_lanes_pick_different_types_is_an_error_naming_both():
    msg = misuse("mma_mixed_types")
    assert "pd_mma_bf16_m16n8k16 at" in msg and "pd_mma_f16_m16n8k16 at" in msg and "disagree" in msg


def test_an_mma_that_one_lane_leaves_for_a_barrier_is_an_error():
    msg = misuse("mma_beside_barrier")
    assert f"pd_mma_bf16_m16n8k16 at {at('if (threadIdx.x != 3) pd_mma')}: the whole warp must execute it" in msg
    assert "lane 3 (thread (3,0,0)) waits at __syncthreads" in msg


def test_an_mma_in_a_partial_warp_is_an_error():
    msg = misuse("mma_partial_warp", block=48)
    assert "pd_mma_f16_m16n8k16 at" in msg and "partial warp" in msg and "thread (32,0,0)" in msg


def test_an_ldmatrix_that_one_lane_skips_is_an_error_naming_the_line_and_the_lane():
    msg = misuse("ldmatrix_skipped", args=(np.zeros(32, np.uint32),))
    assert f"pd_ldmatrix_x4 at {at('  pd_ldmatrix_x4(r, &rows[8 * threadIdx.x]);')}" in msg
    assert "the whole warp must execute it, but lane 5 (thread (5,0,0)) has exited" in msg


def test_an_ldmatrix_whose_lanes_pick_different_variants_is_an_error():
    msg = misuse("ldmatrix_mixed", args=(np.zeros(32, np.uint32),))
    assert "pd_ldmatrix_x4 at" in msg and "pd_ldmatrix_x4_trans at" in msg and "disagree" in msg


@pytest.mark.parametrize("mode, pattern", [
    (1, r"thread \(9,0,0\): pd_ldmatrix_x2 at .*: lane 9's row address 0x[0-9a-f]+ is not 16-byte aligned"),
    (2, r"lane 9's row address 0x[0-9a-f]+ \(16 bytes\) is not in the block's shared memory"),
    (3, r"lane 9's row address .* not in the block's shared memory .*the 512-byte dynamic buffer"),
])
def test_an_ldmatrix_row_outside_shared_memory_or_misaligned_is_an_error(mode, pattern):
    global_rows = np.zeros(64, np.uint16)
    msg = misuse("ldmatrix_bad_row", args=(global_rows, np.zeros(32, np.uint32), np.int32(mode)))
    assert re.search(pattern, msg), msg
    assert at("pd_ldmatrix_x2(r, row);") in msg


def test_lanes_beyond_the_matrices_of_an_ldmatrix_may_pass_any_address():
    out = np.zeros(32, np.uint32)
    CPU.launch(MISUSE, "ldmatrix_bad_row", (1, 1, 1), (32, 1, 1), 32 * 16, (np.zeros(64, np.uint16), out, np.int32(4)))
    np.testing.assert_array_equal(out & 0xFFFF, 8 * (np.arange(32) // 4) + 2 * (np.arange(32) % 4))


# ---------------------------------------------------------------------------------------
# Conversions and byte permutes, exhaustively
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel, fp8", [("cvt_f16x2_e4m3x2", ml_dtypes.float8_e4m3fn),
                                         ("cvt_f16x2_e5m2x2", ml_dtypes.float8_e5m2)])
def test_fp8x2_to_f16x2_is_exact_on_all_65536_inputs_with_canonical_nan(kernel, fp8):
    table = fp8_to_f16_table(fp8)
    out = run_cvt(CPU, kernel, ALL_16_BIT)
    np.testing.assert_array_equal(out, table[ALL_16_BIT >> 8] << 16 | table[ALL_16_BIT & 0xFF])
    assert (table == F16_NAN).sum() == (2 if kernel.endswith("e4m3x2") else 6)


@pytest.mark.parametrize("kernel, fp8", [("cvt_f16x2_e4m3x2_hi", ml_dtypes.float8_e4m3fn),
                                         ("cvt_f16x2_e5m2x2_hi", ml_dtypes.float8_e5m2)])
def test_the_high_half_fp8x2_conversion_is_the_pair_conversion_of_the_words_top_16_bits_whatever_the_low(kernel, fp8):
    table = fp8_to_f16_table(fp8)
    low = rng_for("high half", kernel).integers(0, 1 << 16, ALL_16_BIT.size, dtype=np.uint32)
    words = ALL_16_BIT.astype(np.uint32) << 16 | low
    out = run_cvt(CPU, kernel, words)
    np.testing.assert_array_equal(out, table[ALL_16_BIT >> 8] << 16 | table[ALL_16_BIT & 0xFF])
    np.testing.assert_array_equal(out, run_cvt(CPU, kernel[:-3], ALL_16_BIT))


@pytest.mark.parametrize("kernel, half_dtype, nan", [("cvt_bf16x2_f32", ml_dtypes.bfloat16, BF16_NAN),
                                                     ("cvt_f16x2_f32", np.float16, F16_NAN)])
def test_f32_pairs_round_to_nearest_even_16_bit_pairs_like_ml_dtypes_and_numpy(kernel, half_dtype, nan):
    rng = rng_for("round", kernel)
    lo = rounding_inputs(rng, half_dtype)
    hi = rng.permutation(lo)
    expect = round_f32(hi, half_dtype) << 16 | round_f32(lo, half_dtype)
    out = run_cvt(CPU, kernel, hi, lo)
    bad = np.flatnonzero(out != expect)
    assert not bad.size, [(hex(hi[i].view(np.uint32)), hex(lo[i].view(np.uint32)), hex(out[i]), hex(expect[i]))
                          for i in bad[:5]]
    assert (out[np.isnan(lo)] & 0xFFFF == nan).all()


def test_f16_to_f32_is_exact_on_all_65536_inputs_with_canonical_nan():
    expect = ALL_16_BIT.view(np.float16).astype(np.float32).view(np.uint32).copy()
    expect[np.isnan(ALL_16_BIT.view(np.float16))] = F32_NAN
    np.testing.assert_array_equal(run_cvt(CPU, "cvt_f32_f16", ALL_16_BIT), expect)


def test_prmt_matches_the_ptx_isa_on_every_selector_including_sign_replication():
    rng = rng_for("prmt")
    n = 1 << 16
    sel = np.arange(n, dtype=np.uint32) | (rng.integers(0, 1 << 16, n, dtype=np.uint32) << 16)  # high bits ignored
    a, b = (rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32) for _ in range(2))
    out = run_cvt(CPU, "prmt", a, b, sel)
    np.testing.assert_array_equal(out, prmt_model(a, b, sel))
    # Spot checks of the model itself: identity, a byte of b, and a replicated sign.
    x = np.array([0x80FF7F01], np.uint32)
    assert prmt_model(x, x * 0, np.array([0x3210], np.uint32))[0] == 0x80FF7F01
    assert prmt_model(x * 0, x, np.array([0x4444], np.uint32))[0] == 0x01010101
    assert prmt_model(x, x * 0, np.array([0xBA98], np.uint32))[0] == 0xFFFF0000


# ---------------------------------------------------------------------------------------
# The header itself
# ---------------------------------------------------------------------------------------

PTX_OF = {  # each pd_* function and the instruction it must be under NVRTC
    "pd_cp_async_cg_16": "cp.async.cg.shared.global", "pd_cp_async_cg_16_at": "cp.async.cg.shared.global",
    "pd_cp_async_ca_4": "cp.async.ca.shared.global",
    "pd_cp_async_commit": "cp.async.commit_group", "pd_cp_async_wait": "cp.async.wait_group",
    "pd_cp_async_wait_all": "cp.async.wait_all", "pd_ldmatrix_x4_trans": "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
    "pd_ldmatrix_x1": "ldmatrix.sync.aligned.m8n8.x1.shared.b16", "pd_movmatrix_trans": "movmatrix.sync.aligned.m8n8.trans.b16",
    "pd_mma_bf16_m16n8k16": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
    "pd_mma_f16_m16n8k16": "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
    "pd_cvt_f16x2_e4m3x2": "cvt.rn.f16x2.e4m3x2", "pd_cvt_f16x2_e5m2x2": "cvt.rn.f16x2.e5m2x2",
    "pd_cvt_f16x2_e4m3x2_hi": "mov.b32", "pd_cvt_f16x2_e5m2x2_hi": "mov.b32",
    "pd_cvt_bf16x2_f32": "cvt.rn.bf16x2.f32", "pd_cvt_f16x2_f32": "cvt.rn.f16x2.f32", "pd_cvt_f32_f16": "cvt.f32.f16",
    "pd_prmt": "prmt.b32",
}


def test_asm_appears_in_kernels_cu_only_in_the_intrinsics_header():
    for name in sources.source_names():  # simt/ too
        has_asm = re.search(r"\basm\b|__asm__", sources.read_source(name))
        assert bool(has_asm) == (name == "pd_ptx.cuh"), name


def test_every_intrinsic_cites_its_ptx_isa_section_and_names_its_instruction():
    text = sources.read_source("pd_ptx.cuh")
    assert len(re.findall(r"§9\.7\.\d+(?:\.\d+)*", text)) >= 10
    for function, instruction in PTX_OF.items():
        assert re.search(rf"\b{function}\b", text), function
        assert instruction.split(".shared")[0] in text, instruction


nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (cupy) is not installed")


@pytest.mark.parametrize("arch", ["sm_90", "sm_100", "sm_120"])
def test_the_intrinsics_compile_under_nvrtc_to_exactly_their_ptx_instructions(arch):
    from metrale_attn.backends.cupy_backend import BASE_OPTIONS, DIALECT_PRELUDE, nvrtc_compile_source

    ptx = ""
    for toy in (MATRIX, CP_ASYNC, CVT):
        source = DIALECT_PRELUDE + toy_source(toy)
        cubin, _ = nvrtc_compile_source(source, toy, arch, BASE_OPTIONS)
        assert cubin[:4] == b"\x7fELF"
        text, _ = nvrtc_compile_source(source, toy, "compute_" + arch[3:], BASE_OPTIONS)
        ptx += text.decode() if isinstance(text, bytes) else text
    for instruction in PTX_OF.values():
        assert instruction in ptx, instruction
    assert not re.search(r"\b(ld|st)\.local\b", ptx)
    # pd_cp_async_cg_16_at's offset is the instruction's immediate (copy_cg16_at: the second stage)
    assert re.search(r"cp\.async\.cg\.shared\.global \[%r\d+\+1024\]", ptx)


@pytest.mark.parametrize("name", sorted(p.stem for p in TOYS.glob("ptx_*.cu")))
def test_the_ptx_toy_kernels_compile_with_nvrtc_for_sm_90(name):
    """The same sources build with NVRTC (as the shim's own toys do, cuda_on_cpu/tests)."""
    try:
        prog = nvrtc.createProgram(toy_source(name), f"{name}.cu", [], [])
    except Exception as e:  # the NVRTC library itself is missing
        pytest.skip(f"NVRTC unavailable: {e}")
    opts = ["--gpu-architecture=sm_90", "-std=c++17", "-DDYNAMIC_SHARED(T,name)=extern __shared__ __align__(16) T name[]"]
    try:
        nvrtc.compileProgram(prog, opts)
    except Exception as e:
        pytest.fail(f"NVRTC rejected {name}.cu: {e}\n{nvrtc.getProgramLog(prog)}")
    finally:
        nvrtc.destroyProgram(prog)
