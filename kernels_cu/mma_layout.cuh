// mma_layout.cuh: the "mma" core's constants and its shared-memory carve: the required
// defines (decode_core.cuh lists them), the tile and operand geometry (D, DP, W, TT, S,
// the copy lanes), the carve (q, row scales, the offsets table, each warp's ring, the
// warp states after the loop), checked against the host's PD_SMEM_BYTES, and what a CTA
// serves (Rows, QRows).

#ifndef PD_MMA_LAYOUT_CUH
#define PD_MMA_LAYOUT_CUH

#include "pd_common.cuh"
#include "pd_ptx.cuh"
#include "pd_splitk.cuh"

#if PD_HEAD_DIM > 256
#error "the mma core takes PD_HEAD_DIM 64..256 (a multiple of 16); 512 is the simt kernels' alone"
#endif
#ifndef PD_ROW_TILES
#error "PD_ROW_TILES must be defined (-DPD_ROW_TILES=1|2)"
#endif
#ifndef PD_TILE_TOKENS
#error "PD_TILE_TOKENS must be defined (-DPD_TILE_TOKENS=16|32)"
#endif
#ifndef PD_STAGES
#error "PD_STAGES must be defined (-DPD_STAGES=2..4)"
#endif
#ifndef PD_SMEM_BYTES
#error "PD_SMEM_BYTES must be defined (the dynamic shared memory of the launch)"
#endif
#ifndef PD_MMA_WARPS
#error "PD_MMA_WARPS must be defined (-DPD_MMA_WARPS=2|4|6|8: the warps of a CTA)"
#endif
#ifndef PD_PREFETCH
#error "PD_PREFETCH must be defined (0 .. PD_STAGES - 1: the next item's stages issued before the epilogue)"
#endif

// The attention kernel's block (a define, not a constexpr: __launch_bounds__ takes it).
#define PD_MMA_THREADS (PD_MMA_WARPS * 32)
// Query rows of one row tile: the MMA's N (config.ROW_TILE, read back and checked by
// sources.source_constants).
#define PD_ROW_TILE 8
#if !defined(PD_ENTRY) || !defined(PD_ARM)
#error "define PD_ENTRY (the kernel's name) and PD_ARM (PD_ARM_UNPACKED | _SPLITK | _GQA_PACKED) first"
#endif

namespace pd_mma {


// The head dim D (a multiple of 16) is what q, K, V, out and the workspace hold; the core
// computes at DP, D rounded up to a multiple of 32, since one ldmatrix.x4 takes two 16-dim
// steps. The steps past D are never multiplied (KD bounds every MMA loop and the
// accumulators), so the arithmetic is exactly the unpadded one, and their shared-memory
// chunks are zero-filled, never read from global memory.
constexpr int D = PD_HEAD_DIM;
constexpr int DP = (D + 31) / 32 * 32;
constexpr int W = PD_MMA_WARPS;
constexpr int THREADS = PD_MMA_THREADS;
constexpr int NT = PD_ROW_TILES;  // query-row tiles of 8 (the MMA's N)
constexpr int ROWS = PD_ROW_TILE * NT;
constexpr int TT = PD_TILE_TOKENS;  // tokens of one warp's stage
constexpr int MT = TT / 16;         // 16-token MMA tiles (the MMA's M) per stage
constexpr int S = PD_STAGES;
constexpr int KS = DP / 16;  // 16-dim steps of the padded row (ldmatrix walks these in pairs)
constexpr int KD = D / 16;   // the real ones: the K dimension of QK, the M tiles of PV

constexpr bool FP8 = PD_KV_DTYPE == PD_DTYPE_FP8_E4M3 || PD_KV_DTYPE == PD_DTYPE_FP8_E5M2;
constexpr bool MMA_BF16 = PD_KV_DTYPE == PD_DTYPE_BF16;               // else fp16 operands
constexpr int QP = (MMA_BF16 && PD_Q_DTYPE == PD_DTYPE_FP16) ? 2 : 1;  // q parts
constexpr bool Q_SCALED = !MMA_BF16 && PD_Q_DTYPE == PD_DTYPE_BF16;    // q * 2^c_r as fp16
constexpr int PP = MMA_BF16 ? 3 : 2;                                   // p parts
// q's B operands held in registers for the whole loop at 8 warps (whose shared-memory traffic
// paces an SM that holds one CTA) where they take at most 16 a thread (KS x QP x NT x 2: head
// dim <= 128 at 8 rows, one q part); elsewhere re-read every tile, which is shorter for the chain
constexpr bool Q_IN_REGS = W == 8 && KS * QP * NT * 2 <= 16;

constexpr int ES = (int)sizeof(pd_kv_t);
constexpr int RB = D * ES;        // bytes of one K or V row in global memory
constexpr int RS = DP * ES + 16;  // a padded row's shared-memory stride: 16-byte pad, conflict-free ldmatrix
constexpr int CPR = RB / 16;      // 16-byte chunks of a row's real bytes
constexpr int CPP = DP * ES / 16; // of its padded row (chunks CPR .. CPP - 1 zero-filled)
// A copying lane takes CH adjacent chunks of each of its rows (2 from 8 chunks a row on): the
// per-row work (its offsets or entry, the 64-bit address, the range test) is paid once for
// CH copies, the second chunk's source 16 bytes on, an immediate of the copy.
constexpr int CH = CPP >= 8 ? 2 : 1;
constexpr int CPL = CPP / CH <= 4 ? 4 : CPP / CH <= 8 ? 8 : CPP / CH <= 16 ? 16 : 32;  // lanes per row: a power of two
constexpr int RPI = 32 / CPL;     // rows one warp-wide cp.async covers
constexpr int RPL = TT / RPI;     // rows each lane copies per tile
constexpr int COPY_BATCH = RPL < 8 ? RPL : 8;  // rows whose offsets a copying lane reads before their copies
static_assert(RPL % COPY_BATCH == 0, "the copy batches tile the rows a lane copies");
constexpr int QS = 2 * DP + 16;   // q row stride in shared memory (bytes)
constexpr int PAD_OFF = RS - 16;  // a row's pad: past the padded row, so no copy and no ldmatrix touches it

// Warp w takes the tiles k = w mod W (warp_tiles): a mask where W is a power of two, k0 % W
// for 6 warps (where 8 do not fit). 8 warps x 32 threads x 255 registers
// fit an SM's 65536 (launch bounds (256, 1)); 6 warps take 49,152 (launch bounds (192, 1)).
static_assert(W == 2 || W == 4 || W == 6 || W == 8, "2, 4, 6 or 8 warps (tiling.WARP_CANDIDATES)");
constexpr int Q_ROWS_PER_WARP = (ROWS + W - 1) / W;  // stage_q: 1 or 2 with 8 warps, 2 or 3 with 6 (the last partial)
static_assert(NT == 1 || NT == 2, "one or two row tiles");
static_assert(TT == 16 || TT == 32, "stages of 16 or 32 tokens");
static_assert(S >= 2 && S <= 4, "2..4 stages");
static_assert(D % 16 == 0 && D >= 64 && DP <= 256, "head dims: multiples of 16 in 64..256");
static_assert(CPP >= 4 && CPP % CH == 0 && CPP <= CH * CPL && CPL <= 32 && TT % RPI == 0, "rows split evenly over lanes");
static_assert(KS % 2 == 0, "ldmatrix.x4 takes two 16-dim steps");

// -- shared memory carve (bytes, every region 16-byte aligned) -------------------------
constexpr int Q_OFF = 0;                               // QP x ROWS x QS  (after the loop: s_out)
constexpr int SCALE_OFF = Q_OFF + QP * ROWS * QS;      // ROWS floats: per-row score scale
constexpr int TABLE_OFF = SCALE_OFF + ROWS * 4;        // W x TT x {k offset, v offset}
constexpr int RING_OFF = (TABLE_OFF + W * TT * 16 + 127) / 128 * 128;
constexpr int TILE_BYTES = TT * RS;                    // one K or one V tile
constexpr int STAGE_BYTES = 2 * TILE_BYTES;            // K then V
constexpr int RING_BYTES = S * STAGE_BYTES;            // one warp's ring
constexpr int SMEM_BYTES = RING_OFF + W * RING_BYTES;
// After the loop the rings hold the warp states: m, l [ROWS * W] and o [ROWS * W * D]; with
// PREFETCH > 0 each warp's own in stages PREFETCH .. S - 1 of its ring (m, l [ROWS], o [ROWS * D]).
constexpr int PREFETCH = PD_PREFETCH;
constexpr int STATE_BYTES = ROWS * (D + 2) * 4;  // one warp's m, l and o
constexpr int OWN_STATE_OFF = PREFETCH * STAGE_BYTES;  // in its ring
static_assert(PREFETCH >= 0 && PREFETCH <= S - 1, "prefetch: <= S - 1");
static_assert(PREFETCH == 0 || OWN_STATE_OFF + STATE_BYTES <= RING_BYTES, "a warp's state fits past its prefetch");
constexpr int EPI_M_OFF = RING_OFF;
constexpr int EPI_L_OFF = EPI_M_OFF + ROWS * W * 4;
constexpr int EPI_O_OFF = EPI_L_OFF + ROWS * W * 4;
static_assert(SCALE_OFF % 16 == 0 && TABLE_OFF % 16 == 0, "aligned regions");
static_assert(EPI_O_OFF + ROWS * W * D * 4 <= SMEM_BYTES, "the warp states fit in the rings");
static_assert(ROWS * D * 2 <= QP * ROWS * QS, "the output rows fit where q was");
static_assert(SMEM_BYTES == PD_SMEM_BYTES, "the host sized the dynamic shared memory differently");

// fp16 path: p is scaled by 2^15 before it is split (so its parts stay clear of fp16
// subnormals) and O by 2^-15 at the end; both exact.
__device__ __forceinline__ float p_scale() { return MMA_BF16 ? 1.f : __uint_as_float(0x47000000u); }    // 2^15
__device__ __forceinline__ float o_unscale() { return MMA_BF16 ? 1.f : __uint_as_float(0x38000000u); }  // 2^-15

// Position of dim d of a 16-dim block in q's shared-memory row. fp8 K is read by
// ldmatrix as b16 pairs, so lane (g, t) of the A operand receives dims 4t, 4t+1 (k = 2t,
// 2t+1) and 4t+2, 4t+3 (k = 2t+8, 2t+9) of its token; storing q with dim d at k-position
// 8 * ((d >> 1) & 1) + 2 * ((d >> 2) & 3) + (d & 1) lines the B operand up with that.
__device__ __forceinline__ int q_position(int d) {
  if (!FP8) return d;
  return (d & ~15) | (((d >> 1) & 1) << 3) | (((d >> 2) & 3) << 1) | (d & 1);
}

// -- what a CTA serves -----------------------------------------------------------------

// The query rows of one CTA. Rows r = t * heads + h, t < q_len.
struct Rows {
  int heads;    // heads_per_cta
  int q_len;    // query tokens per sequence (1 but with multi_token)
  int rows;     // heads * q_len
  int seq_len;  // the sequence's length (its keys, the q tokens' included)
  int split, num_splits;
};

// Where row r = t * heads + h of a CTA reads q: query token t of head head0 + h (the
// kernel's q layout; run_cta takes any functor of this shape).
struct QRows {
  const pd_q_t* q;  // q[seq, 0, head0]
  long long stride_token, stride_head;
  int heads;
  __device__ __forceinline__ const pd_q_t* operator()(int r) const {
    return q + (r / heads) * stride_token + (r % heads) * stride_head;
  }
};

}  // namespace pd_mma

#endif  // PD_MMA_LAYOUT_CUH
