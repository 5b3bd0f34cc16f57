"""The toy kernels of tests/toy_kernels/ptx_*.cu, runnable on either backend, and NumPy models of
what the PTX ISA and CuTe say the instructions of kernels_cu/pd_ptx.cuh compute.

Shared by test_ptx_intrinsics.py (the CPU backend, exact) and test_gpu.py (the device, compared
with the CPU emulation). A runner launches ``kernel<<<grid, block, shared_bytes>>>(*args)`` with
NumPy arrays and typed scalars and writes every writeable array argument back in place.
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np

from cuda_on_cpu import compile_module
from metrale_attn import sources

TOYS = Path(__file__).resolve().parents[1] / "toy_kernels"
"""tests/toy_kernels/."""


def toy_source(name: str) -> str:
    """tests/toy_kernels/<name>.cu as the dispatch code compiles a kernel: a ``#line 1`` directive in front
    and each ``#include "x.cuh"`` of kernels_cu/ inlined with ``#line`` directives (metrale_attn.sources.inline),
    so errors name the real file and line on both backends."""
    path = f"tests/toy_kernels/{name}.cu"
    lines = (TOYS / f"{name}.cu").read_text().split("\n")
    out = [f'#line 1 "{path}"']
    for number, line in enumerate(lines, 1):
        include = re.fullmatch(r'\s*#\s*include\s*"([^"]+\.cuh)"\s*', line)
        out += [sources.inline(include.group(1)), f'#line {number + 1} "{path}"'] if include else [line]
    return "\n".join(out)


MATRIX, CP_ASYNC, CVT, MISUSE = "ptx_matrix", "ptx_cp_async", "ptx_cvt", "ptx_misuse"
COPY_THREADS = 64  # ptx_cp_async.cu
COPY_KERNELS = {"copy_ca4": 4, "copy_ca8": 8, "copy_ca16": 16, "copy_cg16": 16, "copy_cg16_at": 16}
LDMATRIX_VARIANTS = [(num, trans) for num in (1, 2, 4) for trans in (False, True)]
POISON = 0xFF  # what the shim writes into a cp.async destination until the copy lands


def line_of(toy: str, needle: str) -> int:
    """1-based line of tests/toy_kernels/<toy>.cu holding needle (exactly one line must)."""
    hits = [i for i, text in enumerate((TOYS / f"{toy}.cu").read_text().splitlines(), 1) if needle in text]
    assert len(hits) == 1, (needle, hits)
    return hits[0]


class CpuRunner:
    """The CUDA-on-CPU backend; ``order`` is its thread-order policy."""

    def __init__(self, order: str | None = "default", asan: bool = False):
        self.order, self.asan = order, asan

    def launch(self, toy: str, kernel: str, grid, block, shared_bytes: int, args) -> None:
        compile_module(toy_source(toy), name=toy, asan=self.asan).launch(kernel, grid, block, shared_bytes, args,
                                                                         order=self.order)


class GpuRunner:
    """CuPy on the current device: the toy compiled by the project's NVRTC path (no -ftz) for the
    device's sm_XY and loaded from the cubin file with ``cupy.RawModule(path=...)``."""

    def __init__(self, tmp_dir):
        import cupy

        self.cupy, self.tmp_dir, self.modules = cupy, tmp_dir, {}

    def function(self, toy: str, kernel: str):
        from metrale_attn.backends.cupy_backend import BASE_OPTIONS, DIALECT_PRELUDE, nvrtc_compile_source

        if toy not in self.modules:
            arch = f"sm_{self.cupy.cuda.Device().compute_capability}"
            cubin, _ = nvrtc_compile_source(DIALECT_PRELUDE + toy_source(toy), toy, arch, BASE_OPTIONS)
            path = self.tmp_dir / f"{toy}_{arch}.cubin"
            path.write_bytes(cubin)
            self.modules[toy] = self.cupy.RawModule(path=str(path))
        return self.modules[toy].get_function(kernel)

    def launch(self, toy: str, kernel: str, grid, block, shared_bytes: int, args) -> None:
        cupy = self.cupy
        device_args = [cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
        self.function(toy, kernel)(tuple(grid), tuple(block), tuple(device_args), shared_mem=shared_bytes)
        cupy.cuda.Device().synchronize()
        for a, d in zip(args, device_args):
            if isinstance(a, np.ndarray) and a.flags.writeable:
                a[...] = cupy.asnumpy(d)


# ---------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------


def rng_for(*key) -> np.random.Generator:
    """A generator seeded by the key (the same values on every backend and run)."""
    return np.random.default_rng([20261201, *(zlib.crc32(str(k).encode()) for k in key)])


DTYPES = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}


def random_halves(rng, shape, dtype: str, *, tiny_fraction=0.1) -> np.ndarray:
    """Random bf16 / f16 bit patterns (uint16): normal values of mixed sign and size, some tiny
    ones (f16 subnormals; bf16 values whose products underflow fp32) and some zeros."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-6, 7, shape))
    tiny = rng.random(shape) < tiny_fraction
    x[tiny] *= 2.0**-20 if dtype == "f16" else 2.0**-66
    x[rng.random(shape) < 0.03] = 0.0
    return x.astype(np.float32).astype(DTYPES[dtype]).view(np.uint16)


def halves_as_float(bits: np.ndarray, dtype: str) -> np.ndarray:
    return bits.view(DTYPES[dtype]).astype(np.float32)


def fixed_order_mma(A: np.ndarray, B: np.ndarray, C: np.ndarray) -> np.ndarray:
    """The CPU emulation's D = C + A B: per element acc = c, then acc = acc + A[m, k] B[k, n] for
    k = 0, 1, ... in fp32 round-to-nearest; products in float64 (exact), rounded to fp32 once."""
    acc = np.array(C, dtype=np.float32)
    for k in range(A.shape[1]):
        acc = acc + np.outer(A[:, k].astype(np.float64), B[k].astype(np.float64)).astype(np.float32)
    return acc


def float64_mma(A, B, C) -> tuple[np.ndarray, np.ndarray]:
    """(exact D in float64, sum of |terms|) for the GPU's tolerance."""
    A64, B64, C64 = (np.asarray(x, np.float64) for x in (A, B, C))
    return C64 + A64 @ B64, np.abs(C64) + np.abs(A64) @ np.abs(B64)


# ---------------------------------------------------------------------------------------
# Cases: each runs a toy on a runner and returns what the tests compare
# ---------------------------------------------------------------------------------------


def run_mma(runner, dtype: str, rng, *, warps=2, in_place=False):
    """One 16x8x16 MMA per warp (every warp the same problem). Returns A, B, C (fp32 values) and
    D [warps, 16, 8]."""
    A, B = random_halves(rng, (16, 16), dtype), random_halves(rng, (16, 8), dtype)
    C = (rng.standard_normal((16, 8)) * 4).astype(np.float32)
    D = np.full((warps, 16, 8), np.nan, np.float32)
    runner.launch(MATRIX, f"mma_{dtype}", (1, 1, 1), (32 * warps, 1, 1), 0, (A, B, C, D, np.int32(in_place)))
    return halves_as_float(A, dtype), halves_as_float(B, dtype), C, D


def run_mma_regs(runner, a: np.ndarray, b: np.ndarray, c: np.ndarray, f16: bool) -> np.ndarray:
    """The MMA on raw per-lane registers a [lanes, 4], b [lanes, 2], c [lanes, 4]; returns d [lanes, 4]."""
    d = np.full(c.shape, np.nan, np.float32)
    runner.launch(MATRIX, "mma_regs", (1, 1, 1), (a.shape[0], 1, 1), 0,
                  (np.ascontiguousarray(a, np.uint32), np.ascontiguousarray(b, np.uint32),
                   np.ascontiguousarray(c, np.float32), d, np.int32(f16)))
    return d


def run_gemm(runner, dtype: str, rng):
    """The 64x64x64 GEMM through cp.async, ldmatrix(.trans) and mma. Returns A, B (fp32 values), D."""
    A, B = random_halves(rng, (64, 64), dtype), random_halves(rng, (64, 64), dtype)
    D = np.full((64, 64), np.nan, np.float32)
    runner.launch(MATRIX, f"gemm64_{dtype}", (1, 1, 1), (128, 1, 1), 0, (A, B, D))
    return halves_as_float(A, dtype), halves_as_float(B, dtype), D


def run_ldmatrix(runner, num: int, trans: bool, rows: np.ndarray, row_of_lane: np.ndarray) -> np.ndarray:
    """ldmatrix.x<num>(.trans) of rows [nrows, 8] (uint16) staged in shared memory, lane l
    addressing row row_of_lane[l]; returns r [32, num] (uint32)."""
    out = np.zeros((32, num), np.uint32)
    name = f"ldmatrix_x{num}{'_trans' if trans else ''}"
    runner.launch(MATRIX, name, (1, 1, 1), (32, 1, 1), rows.size * 2,
                  (np.ascontiguousarray(rows, np.uint16), np.int32(rows.shape[0]),
                   np.ascontiguousarray(row_of_lane, np.int32), out))
    return out


def run_movmatrix(runner, frags: np.ndarray) -> np.ndarray:
    out = np.zeros_like(frags)
    runner.launch(MATRIX, "movmatrix", (1, 1, 1), (frags.size, 1, 1), 0, (frags, out))
    return out


def copy_case(rng, size: int, ntiles=5):
    """Input bytes and per-chunk src_bytes (0..size, often the full size) for the pipelined copy."""
    data = rng.integers(0, 256, ntiles * COPY_THREADS * size, dtype=np.uint8)
    src_bytes = np.where(rng.random(ntiles * COPY_THREADS) < 0.5, size,
                         rng.integers(0, size + 1, ntiles * COPY_THREADS)).astype(np.uint8)
    expect = data.reshape(-1, size).copy()
    expect[np.arange(size)[None, :] >= src_bytes[:, None]] = 0  # zero-filled past src_bytes
    return data, src_bytes, expect.reshape(-1)


def run_pipelined_copy(runner, kernel: str, data, src_bytes, *, bug=0) -> np.ndarray:
    size = COPY_KERNELS[kernel]
    ntiles = data.size // (COPY_THREADS * size)
    out = np.full(data.size, 0x5A, np.uint8)
    runner.launch(CP_ASYNC, kernel, (1, 1, 1), (COPY_THREADS, 1, 1), 2 * COPY_THREADS * size,
                  (data, src_bytes, out, np.int32(ntiles), np.int32(bug)))
    return out


def run_cvt(runner, kernel: str, *inputs, out_dtype=np.uint32) -> np.ndarray:
    n = inputs[0].size
    out = np.zeros(n, out_dtype)
    runner.launch(CVT, kernel, (64, 1, 1), (128, 1, 1), 0, (*inputs, out, np.int32(n)))
    return out


def ldmatrix_rows(rng, num):
    """40 random rows in shared memory; lanes of the used matrices address distinct ones,
    the others addresses of any rows."""
    rows = rng.integers(0, 1 << 16, (40, 8), dtype=np.uint16)
    row_of_lane = rng.integers(0, 40, 32)
    row_of_lane[: 8 * num] = rng.permutation(40)[: 8 * num]
    return rows, row_of_lane


def group_snapshots(runner):
    """landed[thread, snapshot, slot] of the group_accounting kernel (see MUST_HAVE_LANDED)."""
    data = np.arange(1, 32 * 4 + 1, dtype=np.uint32) * 0x01010101
    seen = np.zeros((32, 5, 4), np.uint32)
    runner.launch(CP_ASYNC, "group_accounting", (1, 1, 1), (32, 1, 1), 32 * 16, (data, seen))
    return seen == data.reshape(32, 1, 4)  # landed[thread, snapshot, slot]


# Slots 0, 1, 2 are in committed groups 0, 1, 2, slot 3 uncommitted. Snapshots: after a
# __syncthreads, wait_group 2, wait_group 1, wait_group 0, wait_all.
MUST_HAVE_LANDED = np.array([[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], bool)


ALL_16_BIT = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def rounding_inputs(rng, half_dtype) -> np.ndarray:
    """fp32 inputs that exercise rounding to 16 bits: every 16-bit value, every midpoint between
    neighbours (each a tie) and the fp32 values one ulp either side, the extremes of the range,
    and two million random fp32 bit patterns (NaN and inf included)."""
    values = ALL_16_BIT.view(half_dtype).astype(np.float32)
    finite = np.sort(values[np.isfinite(values)])
    finite = np.unique(finite)
    mids = (finite[:-1].astype(np.float64) + finite[1:]) / 2
    mids = mids.astype(np.float32)
    assert ((mids.astype(np.float64) * 2) == finite[:-1].astype(np.float64) + finite[1:]).all()  # exact ties
    near = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])
    extremes = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4028235e38, -3.4028235e38, 1e-45, -1e-45,
                         2.0**-25, 2.0**-25 * 1.0000001, 2.0**-24, 65504.0, 65519.996, 65520.0, 65536.0], np.float32)
    bf16_overflow = np.array([0x7F7F7FFF, 0x7F7F8000, 0x7F7F8001, 0xFF7F8000, 0x7FC00001, 0xFFFFFFFF],
                             np.uint32).view(np.float32)  # the tie to inf, a NaN payload, a negative NaN
    random = rng.integers(0, 1 << 32, 2_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([values, mids, near, extremes, bf16_overflow, random]).astype(np.float32)


# ---------------------------------------------------------------------------------------
# Reference conversions (NaN as pd_ptx.cuh documents it: canonical, sign dropped)
# ---------------------------------------------------------------------------------------

F16_NAN, BF16_NAN, F32_NAN = 0x7FFF, 0x7FFF, 0x7FFFFFFF


def fp8_to_f16_table(fp8_dtype) -> np.ndarray:
    """ml_dtypes' fp8 -> float16 for all 256 bytes, NaN -> 0x7fff."""
    values = np.arange(256, dtype=np.uint8).view(fp8_dtype)
    bits = values.astype(np.float16).view(np.uint16).astype(np.uint32)
    bits[np.isnan(values.astype(np.float32))] = F16_NAN
    return bits


def round_f32(x: np.ndarray, dtype) -> np.ndarray:
    """float32 -> bf16 / f16 bits by ml_dtypes / NumPy (round to nearest even), NaN -> 0x7fff."""
    with np.errstate(invalid="ignore", over="ignore"):
        bits = x.astype(dtype).view(np.uint16).astype(np.uint32)
    bits[np.isnan(x)] = 0x7FFF
    return bits


def prmt_model(a: np.ndarray, b: np.ndarray, sel: np.ndarray) -> np.ndarray:
    """prmt.b32 default mode, as the PTX ISA states it: bytes {b, a} = b7..b4 a3..a0; byte i of d
    is byte (sel >> 4i) & 7, or its sign bit replicated if bit 3 of that nibble is set."""
    v = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    d = np.zeros(a.shape, np.uint64)
    for i in range(4):
        nibble = (sel.astype(np.uint64) >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (v >> ((nibble & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        byte = np.where(nibble & np.uint64(8), np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0)), byte)
        d |= byte << np.uint64(8 * i)
    return d.astype(np.uint32)
