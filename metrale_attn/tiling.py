"""The ``mma`` core's tiling: how a CTA streams K and V, sized from the target's shared memory.

Pure arithmetic, no kernel source: ``kernels.py`` carries a spec's ``Tiling`` into its
defines, and ``mma_layout.cuh`` checks the carve at compile time (``PD_SMEM_BYTES`` must
equal its own sum), so the host's sizing and the kernel's carve cannot drift apart.

A tiling is W warps per CTA, each owning a ring of S shared-memory stages of TT tokens of K
and V (every row padded by 16 bytes, where the block-table entries are staged), behind a
front of q rows, score scales and the offsets table. W is the first of 8, 6, 4, 2
(``WARP_CANDIDATES``) whose CTA of the most row tiles fits the target with rings of 2 stages
(6 only from head dim 144 on: ``SIX_WARPS_MIN_HEAD_DIM``), then S the deepest ring that fits.
The CTAs are persistent: ``resident_ctas`` x SMs of them walk the plan's work items
(``mma_kernel.cuh``, "THE SCHEDULE"), each warp issuing its first tiles of the next item
before the current item's epilogue (``prefetch_stages``, ``issue_ahead``).

Which specs get 8 warps: hd 64..192 bf16/fp16 and every hd fp8 on 227 KiB targets (sm_90,
sm_100, sm_103; at 144..192 bf16 with 2 stages); bf16/fp16 hd >= 208 take 6 there (8 warps'
rings of 2 stages of 16.5 KiB, 264 KiB, do not fit); on sm_80 (163 KiB) hd <= 128 bf16/fp16
and every fp8 hd; on the 99 KiB targets fp8 hd 64, 144 and 160 only. Which get 6: bf16/fp16
hd 208..256 on 227 KiB, bf16 144..160 and fp16 144..192 on 163 KiB, fp8 176..224 on 99 KiB.
8 warps x 32 threads x 255 registers (8,192 a warp, allocated in 256s) = 65,536: one 8-warp
CTA per SM by registers (``resident_ctas``); 6 x 32 x 255 = 49,152, one CTA per SM too.
Where a batch-1 call has fewer items than the SMs hold, more warps per CTA stream more bytes
per busy SM (benchmarks/NOTES.md, "Kernel v2.3").

The earlier kernels (v2: 4 warps, entries loaded one tile ahead; v2.1: sized per target,
entries staged; v2.2: v2.1 with persistent CTAs) are in git at the tag
``mma-kernels-v2-to-v2.3`` (benchmarks/NOTES.md, "Kernel history").

What decides a row's bytes is (W, TT): the tile -> warp order and the combine over the warps.
So ``warps_for`` chooses W from the head dim, the cache dtype and the target's limit only,
never from the row tiles (which follow the batch through ``heads_per_cta``), q's dtype or the
batch; TT follows the head dim and the cache dtype. The row tiles and q's dtype move only S
and the front, which change no byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from . import dtypes
from .targets import DEFAULT_TARGET, TARGETS

SMEM_LIMIT_BYTES = TARGETS[DEFAULT_TARGET].smem_per_block
"""Dynamic shared memory one block may use on the default target (sm_90's opt-in maximum,
227 KiB; sm_100's too): the default of a spec built without a target."""

STAGE_TARGET_BYTES = 8192
"""K+V bytes one warp's stage aims at: 32-token stages where 32 rows of K and V fit, else 16
(an MMA needs 16 tokens). With 3 stages and 4 warps a CTA keeps 64 KiB of loads in flight,
twice what Little's law asks of one SM at 4.3 TB/s and 800 ns."""
ROW_PAD = 16
"""Bytes of padding per K/V row in shared memory (conflict-free ldmatrix)."""
MMA_DIM_STEP = 32
"""The ``mma`` core computes at the head dim rounded up to this (``mma_layout.cuh``'s ``DP``:
one ``ldmatrix.x4`` takes two 16-dim steps); the core's carve, which the host's
``PD_SMEM_BYTES`` must equal at compile time, checks that both sides round alike."""
ONE_ROW_TILE_HEAD_DIM = 208
"""From this head dim on an ``mma`` CTA holds one row tile (8 query rows): 16 rows' fp32
accumulators alone (16 x 208 / 32 lanes = 104 registers, 128 at 256) leave ptxas no room for
the rest of the loop (plain split-K at 240 spilled 12 bytes on sm_120; every feature with
fp16 q on a bf16 cache spilled at 224 in a 99 KiB target's 2-warp tiling and at 208 on
sm_100; 192 and 176 build clean for every architecture in both tilings)."""

WARP_CANDIDATES = (8, 6, 4, 2)
"""W of a spec, most first (``warps_for``): 8 warps where their CTA fits with 2 stages at
least; else 6 (from ``SIX_WARPS_MIN_HEAD_DIM`` on), else 4, else 2 (the 99 KiB targets at
head dim 256 bf16, where 4 warps' rings of 2 stages of 16.5 KiB do not fit)."""
SIX_WARPS_MIN_HEAD_DIM = 144
"""6 warps only from this head dim on (benchmarks/NOTES.md, "Kernel v2.3: 6 warps
where 8 do not fit"): where 8 do not fit, 6 warps x 2 stages beat 4 x 3 in the model at every
batch from 144 on (227 KiB: bf16/fp16 208..256; 163 KiB: 144..192; 99 KiB: fp8 176..224), but
at 80 and 96 on the 99 KiB targets, whose stages are small and cheap to compute, they keep 6
stages in flight where 4 x 3 keep 8 and lose 0.3-3.3 points at 8 query rows a CTA. A
function of the head dim alone, so W stays one of (head dim, cache dtype, limit)."""


@dataclass(frozen=True)
class Tiling:
    """How an ``mma`` spec streams K and V: ``warps`` warps, each with a ring of ``stages``
    stages of ``tile_tokens`` tokens, ``smem_bytes`` of dynamic shared memory (the carve of
    ``mma_layout.cuh``)."""

    warps: int
    tile_tokens: int
    stages: int
    smem_bytes: int
    prefetch: int = 0
    """The next item's tiles each warp issues before the current item's epilogue
    (``prefetch_stages``; ``PD_PREFETCH``, which the kernel checks against its carve); 0: none."""

    @property
    def threads(self) -> int:
        """The attention kernel's block size."""
        return 32 * self.warps

    @property
    def label(self) -> str:
        """``w<W>t<TT>s<S>``: what a spec's name adds when its tiling is not the sm_90 one."""
        return f"w{self.warps}t{self.tile_tokens}s{self.stages}"


SMEM_RESERVED_PER_BLOCK = 1024
"""Shared memory the driver reserves per resident block (CUDA C++ Programming Guide,
"Shared Memory": 1 KiB on sm_80 and later); a target's shared memory per SM is its opt-in
per-block maximum plus this (227 + 1 = 228 KiB on sm_90, 99 + 1 on sm_86/89/120/121)."""
REGISTERS_PER_SM = 65536
MAX_REGISTERS_PER_THREAD = 255
"""The launch bounds ``(threads, 1)`` leave ptxas up to 255 registers a thread: the
resident count assumes all of them (a lower bound on what the device holds)."""


def resident_ctas(tiling: Tiling, smem_limit: int) -> int:
    """CTAs of ``tiling`` one SM holds at once on a target of ``smem_limit`` bytes of
    shared memory per block, by shared memory (``smem_limit`` + 1 KiB per SM, 1 KiB
    reserved per block) and by registers at 255 a thread (65536 per SM, allocated per warp
    in 256s); at least 1. A function of the tiling and the target only: never of the batch.
    A launch is ``min(items, resident_ctas x SMs)`` persistent CTAs (8 warps: 8 x 8,192
    registers = 65,536, one CTA per SM)."""
    by_smem = (smem_limit + SMEM_RESERVED_PER_BLOCK) // (tiling.smem_bytes + SMEM_RESERVED_PER_BLOCK)
    per_warp = (MAX_REGISTERS_PER_THREAD * 32 + 255) // 256 * 256
    by_registers = REGISTERS_PER_SM // (per_warp * tiling.warps)
    return max(1, min(by_smem, by_registers))


def mma_padded_dim(head_dim: int) -> int:
    """The dim the ``mma`` core's shared-memory rows hold for ``head_dim`` (80 -> 96, 128 -> 128):
    the dims past ``head_dim`` are zeros and never multiplied."""
    return -(-head_dim // MMA_DIM_STEP) * MMA_DIM_STEP


def kv_row_bytes(head_dim: int, kv_dtype: str) -> int:
    """Bytes of one K or V row in shared memory (its padded dims, not its pad)."""
    return mma_padded_dim(head_dim) * dtypes.NUMPY_DTYPES[kv_dtype].itemsize


def q_parts(q_dtype: str, kv_dtype: str) -> int:
    """q's parts in shared memory: fp16 q on a bf16 MMA is split into two bf16 parts."""
    return 2 if (kv_dtype, q_dtype) == (dtypes.BF16, dtypes.FP16) else 1


def tile_tokens_for(head_dim: int, kv_dtype: str) -> int:
    """TT: 32 where 32 rows of K and V fit ``STAGE_TARGET_BYTES``, else 16."""
    return 32 if 2 * 32 * kv_row_bytes(head_dim, kv_dtype) <= STAGE_TARGET_BYTES else 16


def max_stages(head_dim: int, kv_dtype: str) -> int:
    """4 stages for stages of <= 4 KiB, else 3."""
    return 4 if 2 * tile_tokens_for(head_dim, kv_dtype) * kv_row_bytes(head_dim, kv_dtype) <= 4096 else 3


def carve(head_dim: int, parts: int, kv_dtype: str, row_tiles: int, warps: int, stages: int) -> int:
    """Bytes of ``mma_layout.cuh``'s carve: q (parts x rows x (2 DP + 16), DP the padded
    dim), the rows' score scales (4 B each), the offsets table (W x TT x 16; unused by
    the 8-warp 16-bit tilings, whose lanes compute their own offsets), 128-byte
    aligned, then W rings of S stages of K and V (the staged block-table entries live in the
    rows' pads: no bytes)."""
    tt = tile_tokens_for(head_dim, kv_dtype)
    rows = 8 * row_tiles
    front = parts * rows * (2 * mma_padded_dim(head_dim) + 16) + rows * 4 + warps * tt * 16
    ring_off = -(-front // 128) * 128
    return ring_off + warps * stages * 2 * tt * (kv_row_bytes(head_dim, kv_dtype) + ROW_PAD)


def prefetch_stages(head_dim: int, kv_dtype: str, row_tiles: int, stages: int) -> int:
    """The stages of its ring each warp fills with the next
    item's first tiles before the current item's epilogue (``mma_stream.cuh``, ``issue_ahead``), the most (<= S - 1)
    that leave the rest of the ring room for the warp's state (m, l and o of every row, fp32:
    rows x (D + 2) x 4 bytes), which the epilogue publishes there; 0 when one stage short of
    the ring does not hold it."""
    tt = tile_tokens_for(head_dim, kv_dtype)
    stage = 2 * tt * (kv_row_bytes(head_dim, kv_dtype) + ROW_PAD)
    state = 8 * row_tiles * (head_dim + 2) * 4
    return max(0, stages - -(-state // stage))


def max_row_tiles(head_dim: int) -> int:
    """Row tiles an ``mma`` CTA holds at ``head_dim`` (``config.max_rows_per_cta`` / 8): one from
    ``ONE_ROW_TILE_HEAD_DIM`` on, else two."""
    return 1 if head_dim >= ONE_ROW_TILE_HEAD_DIM else 2


def warps_for(head_dim: int, kv_dtype: str, smem_limit: int) -> Optional[int]:
    """W of a spec: the first of ``WARP_CANDIDATES`` (6 only from ``SIX_WARPS_MIN_HEAD_DIM``
    on) whose CTA of the most row tiles fits ``smem_limit`` bytes with rings of 2 stages,
    whatever q's dtype (q in two parts where it can be); None when none does. A function of
    (head dim, cache dtype, limit) only: the invariant that keeps a row's bytes the same for
    every ``heads_per_cta`` and batch."""
    parts = max(q_parts(q, kv_dtype) for q in dtypes.Q_DTYPES)
    for warps in WARP_CANDIDATES:
        if warps == 6 and head_dim < SIX_WARPS_MIN_HEAD_DIM:
            continue
        if carve(head_dim, parts, kv_dtype, max_row_tiles(head_dim), warps, 2) <= smem_limit:
            return warps
    return None


def mma_tiling(head_dim: int, q_dtype: str, kv_dtype: str, row_tiles: int,
               smem_limit: int = SMEM_LIMIT_BYTES) -> Optional[Tiling]:
    """The tiling of an ``mma`` spec on a target of ``smem_limit`` bytes per block, or None
    when it does not fit: W from ``warps_for``, then the deepest ring (4 stages of <= 4 KiB,
    else 3) that fits, at least 2, and the prefetch that ring leaves room for."""
    warps = warps_for(head_dim, kv_dtype, smem_limit)
    if warps is None:
        return None
    tt = tile_tokens_for(head_dim, kv_dtype)
    parts = q_parts(q_dtype, kv_dtype)
    for stages in range(max_stages(head_dim, kv_dtype), 1, -1):
        smem = carve(head_dim, parts, kv_dtype, row_tiles, warps, stages)
        if smem <= smem_limit:
            return Tiling(warps, tt, stages, smem, prefetch_stages(head_dim, kv_dtype, row_tiles, stages))
    return None
