"""A known-answer test of the PTX instructions the ``mma`` kernels use, on any backend.

``kernels_cu/pd_selftest.cu`` runs ldmatrix (plain and .trans), movmatrix, cp.async with
zero fill, mma.m16n8k16 in bf16 and fp16, and the cvt/prmt conversions on fixed inputs;
``expected`` computes what the PTX ISA says each lane must hold, in NumPy, and
``disagreements`` compares. On the CPU backend this is a test of the emulation (CI runs
it); on a GPU the CuPy backend runs it once per device before trusting the ``mma``
kernels, so a device whose instructions disagree with the emulation the kernels were
verified on falls back to ``simt`` instead of returning wrong bytes.

Every input is chosen so that the expected values are exact on any hardware: the
matrices hold small integers (every MMA sum is an integer below 2^9), NaN results of
cvt are compared as NaN only (their payload is not part of what the kernels rely on).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..kernels import SelfTest
from ..sources import read_define, read_source
from ..targets import FP8_CVT_CAPABILITY
from . import Launch

WORDS, FLOATS, LANES = 19, 9, 32

FIELDS = (
    [("ldmatrix.x4", k) for k in range(4)]
    + [("ldmatrix.x4.trans", k) for k in range(4)]
    + [("movmatrix.trans", 0)]
    + [("cvt.rn.f16x2.e4m3x2", k) for k in range(4)]
    + [("prmt.b32", 0), ("cp.async zero-fill", 0), ("cvt.rn.bf16x2.f32", 0), ("cvt.rn.f16x2.f32", 0)]
    + [("cvt.rn.f16x2.e4m3x2 of a high half", k) for k in range(2)]
)
FLOAT_FIELDS = [("mma.m16n8k16 bf16", k) for k in range(4)] + [("mma.m16n8k16 f16", k) for k in range(4)] + [
    ("cvt.f32.f16", 0)]


@dataclass(frozen=True)
class Inputs:
    mat_bf16: np.ndarray  # uint16 [256]: bf16 bits of a 16x16 matrix of small integers
    mat_f16: np.ndarray  # uint16 [256]: fp16 bits of another
    data: np.ndarray  # uint8 [256]: every byte value once


def inputs() -> Inputs:
    r, c = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    a = ((r * 16 + c) % 9 - 4).astype(np.float32)
    b = ((r * 5 + c * 3) % 7 - 3).astype(np.float32)
    return Inputs(a.astype(ml_dtypes.bfloat16).view(np.uint16).reshape(-1),
                  b.astype(np.float16).view(np.uint16).reshape(-1),
                  ((np.arange(256) * 37) % 256).astype(np.uint8))


def _pack(lo, hi) -> np.ndarray:
    return (np.asarray(lo, np.uint32) & 0xFFFF) | ((np.asarray(hi, np.uint32) & 0xFFFF) << 16)


def _prmt(a: int, b: int, sel: int) -> int:
    src = (int(b) << 32 | int(a)).to_bytes(8, "little")
    out = 0
    for k in range(4):
        nib = (sel >> (4 * k)) & 0xF
        byte = src[nib & 7]
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * k)
    return out


def expected(x: Inputs) -> tuple[np.ndarray, np.ndarray]:
    """What every lane must write: ``(words uint32 [32, WORDS], floats float32 [32, FLOATS])``."""
    m16 = x.mat_bf16.reshape(16, 16)
    h16 = x.mat_f16.reshape(16, 16)
    lane = np.arange(LANES)
    g, t = lane // 4, lane % 4
    words = np.zeros((LANES, WORDS), np.uint32)
    for q in range(4):  # quadrant q: rows 8 * (q % 2) .., cols 8 * (q // 2) ..
        quad = m16[8 * (q % 2):8 * (q % 2) + 8, 8 * (q // 2):8 * (q // 2) + 8]
        words[:, q] = _pack(quad[g, 2 * t], quad[g, 2 * t + 1])
        words[:, 4 + q] = _pack(quad[2 * t, g], quad[2 * t + 1, g])
    words[:, 8] = words[:, 4]  # movmatrix.trans of quadrant 0's fragment is its .trans load
    f8 = x.data.view(ml_dtypes.float8_e4m3fn).astype(np.float16).view(np.uint16)
    for k in range(4):
        words[:, 9 + k] = _pack(f8[lane * 8 + 2 * k], f8[lane * 8 + 2 * k + 1])
    words[:, 13] = [_prmt(words[i, 0], words[i, 1], 0x3120 + i) for i in range(LANES)]
    filled = np.zeros(16, np.uint8)
    filled[:7] = x.data[:7]
    words[:, 14] = filled.view(np.uint32)[lane & 3]
    xs = lane.astype(np.float32) * np.float32(1.00390625)
    ys = -lane.astype(np.float32) / np.float32(3.0)
    words[:, 15] = _pack(ys.astype(ml_dtypes.bfloat16).view(np.uint16), xs.astype(ml_dtypes.bfloat16).view(np.uint16))
    words[:, 16] = _pack(ys.astype(np.float16).view(np.uint16), xs.astype(np.float16).view(np.uint16))
    words[:, 17], words[:, 18] = words[:, 10], words[:, 12]  # bytes 8l+2, +3 and 8l+6, +7

    floats = np.zeros((LANES, FLOATS), np.float32)
    for base, mat in ((0, m16.view(ml_dtypes.bfloat16)), (4, h16.view(np.float16))):
        a = mat.astype(np.float64)
        d = a @ a[:8].T  # B[k][n] = A[n][k]: D[m][n] = sum_k A[m][k] A[n][k], exact integers
        floats[:, base + 0] = d[g, 2 * t]
        floats[:, base + 1] = d[g, 2 * t + 1]
        floats[:, base + 2] = d[g + 8, 2 * t]
        floats[:, base + 3] = d[g + 8, 2 * t + 1]
    floats[:, 8] = x.mat_f16[:32].view(np.float16).astype(np.float32)
    return words, floats


def disagreements(words: np.ndarray, floats: np.ndarray, x: Inputs | None = None, *,
                  fp8: bool = True) -> list[str]:
    """The instructions whose results differ from ``expected`` (empty: all agree);
    ``fp8=False`` on a device without the fp8 cvt (before sm_89), which the kernel leaves out."""
    want_w, want_f = expected(x or inputs())
    bad = set()
    for j, (name, _) in enumerate(FIELDS):
        got, want = words[:, j], want_w[:, j]
        if name.startswith("cvt.rn.f16x2.e4m3x2"):  # NaN as NaN, payload free
            if not fp8:
                continue
            halves = lambda v: np.stack([v & 0xFFFF, v >> 16]).astype(np.uint16).view(np.float16)  # noqa: E731
            g16, w16 = halves(got), halves(want)
            same = (g16.view(np.uint16) == w16.view(np.uint16)) | (np.isnan(g16) & np.isnan(w16))
            if not same.all():
                bad.add(name)
        elif not np.array_equal(got, want):
            bad.add(name)
    for j, (name, _) in enumerate(FLOAT_FIELDS):
        if not np.array_equal(floats[:, j], want_f[:, j]):
            bad.add(name)
    return sorted(bad)


def run(backend) -> list[str]:
    """Run the test kernel on ``backend`` and return what disagreed (empty: nothing).
    Checks first that the source still writes the layout ``expected`` models."""
    test = SelfTest()
    text = read_source(test.filename)
    if (read_define(text, "SELFTEST_WORDS"), read_define(text, "SELFTEST_FLOATS")) != (WORDS, FLOATS):
        raise RuntimeError(f"kernels_cu/{test.filename} writes another layout than backends/selftest.py expects")
    x = inputs()
    module = backend.load(test)
    device = [backend.upload(a) for a in (x.mat_bf16, x.mat_f16, x.data)]
    words = backend.empty((LANES * WORDS,), np.uint32)
    floats = backend.empty((LANES * FLOATS,), np.float32)
    ptr = backend.pointer
    module.launch(Launch(test.kernels[0], (1, 1, 1), (LANES, 1, 1), 0,
                         tuple(ptr(a) for a in (*device, words, floats))))
    backend.synchronize()
    gpu = backend.device()  # None on the CPU backend: the emulation has every instruction
    fp8 = gpu is None or tuple(gpu.compute_capability) >= FP8_CVT_CAPABILITY
    return disagreements(np.asarray(backend.host_copy(words)).reshape(LANES, WORDS),
                         np.asarray(backend.host_copy(floats)).reshape(LANES, FLOATS), x, fp8=fp8)
