// decode_core.cuh: the "mma" implementation: the tensor-core decode core, its features,
// and its one attention kernel, written once for the three arms (decode_unpacked.cu,
// decode_splitk.cu, decode_gqa_packed.cu each only name the kernel and pick the arm).
//
// The file, top to bottom: the constants and the shared-memory carve; what a CTA serves
// (Rows); THE FEATURES (one named piece each, with the hooks the core calls); the keys
// of a row; Q staging; the K/V stream; the MMA operands; the core (attend: the plain
// algorithm, calling the hooks); and THE KERNEL (its parameter list, the launch ABI of
// every arm, and its body), with the split-K merge.
//
// What one CTA computes
//   PD_MMA_THREADS threads (W = PD_MMA_WARPS warps) attend `rows` = heads_per_cta x q_len query rows of
//   one sequence, all reading one KV head: row r = t * heads_per_cta + h is query token
//   t (0 .. q_len - 1) of head head0 + h. Each row r sees the keys [lo_r, hi_r) (its
//   causal prefix, its sliding window, its split: row_range), and the CTA leaves per row
//   the state (M, L, O): M = max_t x_t, L = sum_t 2^(x_t - M), O[d] = sum_t 2^(x_t - M)
//   v_t[d], in log2 units: x_t = qk_scale * (q . k_t) (the host folds sm_scale * k_scale
//   * log2 e), or with the logits soft-cap x_t = cap_log2 * tanh(qk_scale * (q . k_t))
//   (the host folds sm_scale * k_scale / cap and cap * log2 e).
//
// Data flow
//   * Q: staged once into shared memory as MMA operands (bf16 or fp16 bits, rows past
//     `rows` zero). q fp16 with bf16 K is split exactly into two bf16 parts (hi + lo); q
//     bf16 with fp16/fp8 K is stored as fp16 of q * 2^c_r, a power of two per row chosen
//     so that max |q_r| lands in [2^14, 2^15) (exact but for elements below 2^-28
//     max |q_r|, which round to fp16 subnormals: < 2^-39 max |q_r| absolute; a row of bf16
//     subnormals lands lower, exactly), and 2^-c_r is folded into that row's score scale,
//     for every bf16 magnitude (stage_q).
//   * K and V stream in tiles of TT tokens aligned to absolute token positions (tile k
//     covers [k * TT, (k + 1) * TT) and goes to warp k % W), so a row's arithmetic
//     depends only on the keys it sees, never on the range of its CTA: rows whose ranges
//     differ (query tokens of a multi-token request, a split starting mid-tile) and the
//     same row in another CTA give identical bytes. Each warp owns a ring of PD_STAGES
//     shared-memory stages filled by cp.async: every copy of a stage is issued before any
//     of it is used, keys outside the CTA's range are zero-filled (src-size 0) and masked
//     in the scores, so full and ragged tiles run the same branch-free code. Page
//     lookups: lane i < TT owns token i of the warp's next tile; its (page, offset in
//     page) advances by W * TT tokens per tile without a division, its block-table entry
//     is staged (copied by a 4-byte cp.async into the pad of a K row of the stage its
//     tile will use, with the copies of the tile S - 1 before, so it lands S - 1 tiles,
//     more than a DRAM round trip, before it is read); only entries of keys in the CTA's
//     range are read; the 64-bit K and V row offsets are computed once per token and
//     handed to the copying lanes through a small shared-memory table, or (PD_LANE_OFFSETS:
//     the 8-warp tilings of 16-bit caches) each copying lane computes its own rows' from
//     their staged entries. A lane
//     reads eight rows' offsets (or entries) before it issues their copies, and every copy
//     of its tile names one shared-memory register plus the row's offset as an immediate.
//   * Scores on tensor cores, transposed: S^T[token][row] = K Q^T, mma.m16n8k16 with the
//     16 tokens of an MMA tile as M and the query rows (heads x q tokens) as N, 8 per
//     row tile. Decode has at most 16 query rows per KV head, so putting them on the
//     8-wide N side wastes half as much as padding them to M = 16. q's B operands are
//     read from shared memory every tile, or once an item at 8 warps where they fit in 16
//     registers (Q_IN_REGS).
//   * Online softmax per row in fp32 (exp2f), then P^T is split into PP parts of the PV
//     operand type (3 bf16 parts carry all 24 bits of an fp32 p; 2 fp16 parts of p *
//     2^15 carry 22), moved into the B-operand layout with movmatrix, and O^T[dim][row]
//     += V^T P^T on tensor cores, one MMA per part, so rounding of p never reaches the
//     output.
//   * fp8 K and V are converted exactly by cvt.rn.f16x2.{e4m3x2,e5m2x2} after an ldmatrix
//     of their bytes as b16 pairs; the byte order that gives is absorbed by permuting q's
//     dims (K) and the output dims (V), never by moving data.
//
// The features (config.FEATURES: multi_token, window, soft_cap, sinks, out_f32) live in
// one section below, each a struct named after it with the hooks the core calls
// (FlashInfer's attention/variants.cuh: the keys a row sees, LogitsMask, LogitsTransform,
// OutputTransform); the section's opening comment lists them. A feature's define is
// PD_<NAME> (0 or 1, from Python), and the core calls its hooks only where it is 1
// (`Feature::on ? hook : plain`, folded at compile time), so the plain spec compiles none
// of the feature. A feature's runtime value is a parameter of the kernel (the last
// section), carried to its hook in `Features`. docs/adding-a-kernel-feature.md walks
// through adding one.
//
// Bytes do not depend on which heads share the CTA: a row's column of every MMA is
// computed from that column alone; the token -> tile -> warp order, the online softmax,
// the shuffle reductions and the warp combine (cta_combine, warps 0..W-1) are the same
// code for every heads_per_cta, q_len and both row-tile counts. On the CPU backend this
// holds by construction of the MMA emulation (each output element summed in one fixed
// order); on a GPU it rests on the tensor core computing each column independently,
// which the GPU tests check.
//
// Defines (all required, from Python): PD_HEAD_DIM (any multiple of 16 in 64..256), PD_Q_DTYPE,
//   PD_KV_DTYPE (pd_common.cuh),
//   PD_ROW_TILES   1 | 2      query-row tiles of 8 (rows <= 8 * PD_ROW_TILES)
//   PD_TILE_TOKENS 16 | 32    tokens of one warp's stage
//   PD_STAGES      2 .. 4     depth of each warp's cp.async ring
//   PD_MMA_WARPS   2|4|6|8    W, the warps of a CTA (block PD_MMA_THREADS = 32 W); with TT
//                             what a row's bytes depend on (tiling.warps_for fixes it per
//                             head dim, cache dtype and target)
//   PD_PREFETCH    0 .. S - 1 the stages of the next item each warp fills before the current
//                             item's epilogue (tiling.prefetch_stages; "lever 5" below)
//   PD_SMEM_BYTES             the dynamic shared memory the launch gives; must equal
//                             pd_mma::SMEM_BYTES (checked at compile time), so the host's
//                             sizing and this carve cannot drift apart.
//   PD_MIN_KV_PER_SPLIT       the split rule's floor (pd_splitk.cuh)
//   PD_MULTI_TOKEN, PD_WINDOW, PD_SOFT_CAP, PD_SINKS, PD_OUT_F32, PD_DEVICE_SCALES, PD_CSR   0 | 1: the features
// and from the arm's .cu, before it includes this file: PD_ENTRY (the kernel's name),
// PD_ARM (PD_ARM_UNPACKED | PD_ARM_SPLITK | PD_ARM_GQA_PACKED; pd_common.cuh), and on the
// packed arm PD_GQA and PD_HDIM.
//
// Performance notes: see benchmarks/NOTES.md ("kernel v2", and the static SASS report of
// `python -m benchmarks.sass_model`).
//
// Numerics: fp32 denormals must be preserved (never -ftz=true / --use_fast_math), as for
// pd_common.cuh. bf16 V with |v| < 2^-100 can give products that are fp32 denormals; the
// CPU emulation keeps them, a tensor core may flush them (see benchmarks/NOTES.md).

#ifndef PD_DECODE_CORE_CUH
#define PD_DECODE_CORE_CUH

#include "pd_common.cuh"
#include "pd_ptx.cuh"
#include "pd_splitk.cuh"

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
#if !defined(PD_MULTI_TOKEN) || !defined(PD_WINDOW) || !defined(PD_SOFT_CAP) || !defined(PD_SINKS) || \
    !defined(PD_OUT_F32) || !defined(PD_DEVICE_SCALES) || !defined(PD_CSR)
#error "PD_MULTI_TOKEN, PD_WINDOW, PD_SOFT_CAP, PD_SINKS, PD_OUT_F32, PD_DEVICE_SCALES and PD_CSR must be defined (0 or 1)"
#endif
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
constexpr int ROWS = 8 * NT;
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

// =======================================================================================
// THE FEATURES
// =======================================================================================
//
// One struct per feature of config.FEATURES, named after it: `on` is its define
// PD_<NAME> (0 | 1, from Python; an enum, since NVRTC emits a static constexpr member as a
// global), and its hooks hold the feature's code. The core is the plain algorithm; where a
// feature enters it reads `Feature::on ? hook : plain`, a constant the front end folds
// before anything is emitted, so a spec without the feature compiles none of its code
// and its SASS is the plain core's, instruction for instruction (a hook called
// unconditionally, even one returning the plain value, moved the plain specs' SASS:
// benchmarks/NOTES.md, "feature hooks"):
//
//   feature      hook (FlashInfer's variant)         called in             plain path
//   window       Window::first_key                   row_range             keys from 0
//                  (the keys a row sees)
//   multi_token  MultiToken::columns                 attend: the mask      every column sees
//                  (LogitsMask: each column's keys)                        the CTA's keys
//   soft_cap     SoftCap::logits                     attend: the logits    the raw score, its
//                  (LogitsTransform; the tile then                         scale entering in
//                  holds x: the max and the                                the max and in
//                  weights take no scale)                                  exp2's fmaf
//   sinks        Sinks::fold, Sinks::merged          store_rows; the       no sink
//                  (OutputTransform)                   split-K merge
//   out_f32      OutF32::out_t, OutF32::put          store_rows; the       q's dtype, staged
//                                                      kernel, the merge   in shared memory
//
// A feature's runtime value (window_left, cap_log2, sinks) is a parameter of the kernel
// (the last section of this file), which fills `Features` from its parameters; the core
// hands `Features` to the hooks. A feature that changes which pages a call reads also
// tells the host (validation.check_indices, as the window does); one that changes the
// split-K merge works through pd_splitk.cuh (as the sinks do).

// window (PD_WINDOW): a sliding window, FlashInfer's convention: a token at position p
// sees the keys [p - window_left, p]; window_left = -1: none. The keys a row sees start
// there (row_range); a split then tiles the window only, and block-table entries of keys
// before every window are never read.
struct Window {
  enum { on = PD_WINDOW };
  int left;  // window_left, the kernel parameter

  // The first key of a token that sees the keys before position `seen` (its own is seen - 1).
  __device__ __forceinline__ int first_key(int seen) const {
    int first = 0;
    if (left >= 0) {
      const int w0 = seen - 1 - left;  // a token at position seen - 1 sees [seen - 1 - w, seen - 1]
      first = w0 > 0 ? w0 : 0;
    }
    return first;
  }
};

// soft_cap (PD_SOFT_CAP): the logits soft-cap, x = cap_log2 tanh(qk_scale q.k) (the host
// folds sm_scale * k_scale / cap into qk_scale and cap * log2 e into cap_log2). The
// LogitsTransform: a tile then holds x itself, in log2 units (the plain tile holds the
// raw q.k, and the row's scale enters in the max and in one fmaf per weight).
struct SoftCap {
  enum { on = PD_SOFT_CAP };
  float cap_log2;  // the kernel parameter

  // x of a raw score s of a row whose score scale is `scale`.
  __device__ __forceinline__ float logits(float s, float scale) const { return cap_log2 * tanhf(s * scale); }
};

// sinks (PD_SINKS): a learned sink logit per head (natural-log units of the scaled scores)
// joins the softmax denominator and contributes no value. The OutputTransform: it enters
// once per row, after every key: into the CTA's state before the output is written
// (unpacked, packed), or in the split-K merge after the splits (pd_merge_splits of
// pd_splitk.cuh; the split states never see it).
struct Sinks {
  enum { on = PD_SINKS };
  const float* logit;  // the CTA's heads' sinks (sinks + head0)

  // Fold head h's sink into its state (M, L, O) (pd_add_sink). True when the sink alone
  // is the state: its lse is then the sink itself, logit[h].
  __device__ __forceinline__ bool fold(int h, float& M, float& L, float& O) const {
    return pd_add_sink(logit[h], M, L, O);
  }
  // What the split-K merge folds after the splits: every head's sink, or none.
  __device__ __forceinline__ static const float* merged(const float* sinks) { return on ? sinks : nullptr; }
};

// out_f32 (PD_OUT_F32): out (and the split-K merge's out) in fp32 instead of q's dtype:
// each value goes straight to out, where the plain path stages bf16/fp16 in shared memory
// (where q was) and stores each token's heads as 16-byte spans.
struct OutF32 {
  enum { on = PD_OUT_F32 };
#if PD_OUT_F32
  typedef float out_t;
#else
  typedef pd_q_t out_t;  // bf16 / fp16 bits, q's dtype
#endif

  // Element d of the row at out_row0[at * D].
  __device__ __forceinline__ static void put(out_t* out_row0, long long at, int d, float value) {
    reinterpret_cast<float*>(out_row0)[at * D + d] = value;
  }
};

// device_scales (PD_DEVICE_SCALES): the dequantization scales are fp32 values on the device,
// one for the tensor (stride 0) or one per KV head (stride 1), that a CTA reads for its KV
// head, so a captured CUDA graph follows a scale that changes and nothing syncs to read one.
// They are folded exactly as the host folds host floats (validation.scales and
// logit_scales): in double, sm_scale * k_scale * log2 e (with the soft-cap: sm_scale *
// k_scale / cap), then one rounding to fp32; equal values give equal bytes.
struct DeviceScales {
  enum { on = PD_DEVICE_SCALES };
  const float* k;  // k_scales, k_scales_stride: the kernel parameters
  long long k_stride;
  const float* v;
  long long v_stride;
  double sm_scale, soft_cap;

  // The score scale and the value scale of KV head `kv_head`.
  __device__ __forceinline__ void fold(int kv_head, float& qk_scale, float& v_scale) const {
    const double folded = sm_scale * (double)k[kv_head * k_stride];
    qk_scale = (float)(SoftCap::on ? folded / soft_cap : folded * 1.4426950408889634);  // log2 e, as the host's
    v_scale = v[kv_head * v_stride];
  }
};

// csr (PD_CSR): FlashInfer's CSR page table, read as it is (no conversion to a dense
// table): sequence s's pages are kv_indices[kv_indptr[s] .. kv_indptr[s + 1]) and its last
// page holds kv_last_page_len[s] tokens. The kernel takes a sequence's row of page ids and
// its length from them instead of block_tables and seq_lens; the last page's count is
// clamped to 0 .. page_size, so a CTA never reads past its sequence's own pages.
struct Csr {
  enum { on = PD_CSR };
  const int* indptr;  // kv_indptr, kv_indices, kv_last_page_len: the kernel parameters
  const int* indices;
  const int* last_page_len;

  // Sequence seq's page ids, in order.
  __device__ __forceinline__ const int* row(int seq) const { return indices + indptr[seq]; }
  // Its length in tokens: (pages - 1) * page_size + the last page's count, or 0 with no page.
  __device__ __forceinline__ int seq_len(int seq, int page_size) const {
    const int pages = indptr[seq + 1] - indptr[seq];
    int last = last_page_len[seq];
    last = last < 0 ? 0 : (last > page_size ? page_size : last);
    return pages > 0 ? (pages - 1) * page_size + last : 0;
  }
};

// The features' runtime values, filled by the kernel from its parameters.
struct Features {
  Window window;
  SoftCap soft_cap;
  Sinks sinks;
  DeviceScales device_scales;
};

// The keys of query token t (row_range, after this section); multi_token masks with them.
__device__ __forceinline__ void row_range(const Rows& rw, const Features& f, int t, int& lo, int& hi);

// multi_token (PD_MULTI_TOKEN): q_len > 1 query tokens per sequence (speculative
// verification, MTP); token t sees L - q_len + 1 + t keys (row_range), so the rows of a
// CTA see different keys. The LogitsMask: a column of a score tile (query row nt * 8 + 2t
// + j of lane (g, t)) sees the keys [lo[nt][j], hi[nt][j]) of its own row; padding rows
// see none. (The plain path's rows all see the CTA's keys.)
struct MultiToken {
  enum { on = PD_MULTI_TOKEN };

  // The keys [lo, hi) of each of this lane's columns (t = lane % 4).
  __device__ __forceinline__ static void columns(const Rows& rw, const Features& f, int t, int (&lo)[NT][2],
                                                 int (&hi)[NT][2]) {
    PD_UNROLL
    for (int nt = 0; nt < NT; ++nt)
      PD_UNROLL
      for (int j = 0; j < 2; ++j) {
        const int r = nt * 8 + 2 * t + j;
        lo[nt][j] = 0;
        hi[nt][j] = 0;
        if (r < rw.rows) row_range(rw, f, r / rw.heads, lo[nt][j], hi[nt][j]);
      }
  }
};

// =======================================================================================

// -- the keys of a row -----------------------------------------------------------------

// Keys [lo, hi) query token t sees: its causal prefix (L - q_len + 1 + t keys), from its
// window's first key (the window feature), cut to split `split` of `num_splits` by the
// split rule of pd_splitk.cuh applied to that range alone (so the split covers the
// window only and depends on the row's own keys, never on the batch or on the other rows).
__device__ __forceinline__ void row_range(const Rows& rw, const Features& f, int t, int& lo, int& hi) {
  int seen = rw.seq_len - rw.q_len + 1 + t;  // causal: positions < seen
  seen = seen > 0 ? seen : 0;
  const int first = Window::on ? f.window.first_key(seen) : 0;
  int a, b;
  pd_split_range(seen - first, rw.split, rw.num_splits, a, b);
  lo = first + a;
  hi = first + b;
}

// The CTA's key range: the union of its rows' ranges (empty when every row's is).
__device__ __forceinline__ void cta_range(const Rows& rw, const Features& f, int& lo, int& hi) {
  lo = 0;
  hi = 0;
  for (int t = 0; t < rw.q_len; ++t) {
    int a, b;
    row_range(rw, f, t, a, b);
    if (a >= b) continue;
    if (hi == 0 || a < lo) lo = a;
    if (b > hi) hi = b;
  }
}

// -- Q staging -----------------------------------------------------------------------

// Stage the CTA's query rows (warp w converts rows w, w + W, ...; lane c holds dims
// 8c .. 8c + 7) and each row's score scale qk_scale * 2^-c_r. q_row(r) points at row r's
// D elements. Ends with __syncthreads(); every thread of the CTA calls it.
template <class QRow>
__device__ __forceinline__ void stage_q(unsigned char* smem, const QRow& q_row, int rows, float qk_scale) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  PD_UNROLL
  for (int k = 0; k < Q_ROWS_PER_WARP; ++k) {
    const int r = warp + k * W;
    if (ROWS % W != 0 && r >= ROWS) continue;  // 6 warps: the last round converts ROWS % W rows (warp-uniform)
    unsigned bits[8];
    float x[8];
    const bool mine = r < rows && lane < D / 8;  // dims >= D (and rows >= rows) are staged as zeros
    {
      unsigned w4[4] = {0u, 0u, 0u, 0u};
      if (mine) pd_load_words(q_row(r) + lane * 8, w4);
      PD_UNROLL
      for (int j = 0; j < 8; ++j) {
        bits[j] = (w4[j >> 1] >> ((j & 1) * 16)) & 0xffffu;
        x[j] = pd_q_to_float(bits[j]);
      }
    }
    float scale = qk_scale;
    if (Q_SCALED) {
      float amax = 0.f;
      PD_UNROLL
      for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(x[j]));
      PD_UNROLL
      for (int off = 16; off >= 1; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(PD_FULL_MASK, amax, off));
      // c = 14 - floor(log2 amax). bf16 has fp32's exponents, so c runs from -114 (inf/NaN,
      // e = 128) to 141: exponent field 0 (a row of zeros or bf16 subnormals, multiples of
      // 2^-133) reads as e = -127, and q 2^141 holds such a row exactly (fp16 integers
      // below 2^15). Neither 2^c nor 2^-c need be a normal float, so each is applied in two
      // steps, c1 = c clamped to [-100, 100] and then c2 = c - c1 in [-14, 41]: q's steps are
      // exact (scaling up, or down to where fp16 rounds to 0 anyway) and the scale's
      // intermediate lies between qk_scale and the final scale, so it is normal whenever
      // that is. A row with |c| <= 100 takes c2 = 0: the scale of a single 2^-c.
      const int e = (int)((__float_as_uint(amax) >> 23) & 0xffu) - 127;
      const int c = 14 - e;
      const int c1 = c < -100 ? -100 : (c > 100 ? 100 : c), c2 = c - c1;
      const float up1 = __uint_as_float((unsigned)(127 + c1) << 23), up2 = __uint_as_float((unsigned)(127 + c2) << 23);
      PD_UNROLL
      for (int j = 0; j < 8; ++j) bits[j] = pd_float_to_fp16(x[j] * up1 * up2);
      scale = qk_scale * __uint_as_float((unsigned)(127 - c1) << 23) * __uint_as_float((unsigned)(127 - c2) << 23);
      // A scale that underflowed to 0 (a zero row, or one whose logits are below 2^-110:
      // |q 2^c . k| < 2^39) would make a masked score -inf * 0 = NaN in attend. The least
      // denormal keeps it > 0, and logits that small weigh exactly 1 either way.
      scale = fmaxf(scale, __uint_as_float(1u));
    }
    if (lane == 0) reinterpret_cast<float*>(smem + SCALE_OFF)[r] = scale;
    PD_UNROLL
    for (int part = 0; part < QP; ++part) {
      unsigned v[8];
      PD_UNROLL
      for (int j = 0; j < 8; ++j) {
        if (QP == 2) {  // fp16 q for a bf16 MMA: hi = bf16(q), lo = bf16(q - hi), both exact
          const unsigned hi = pd_float_to_bf16(x[j]);
          v[j] = part == 0 ? hi : pd_float_to_bf16(x[j] - pd_bf16_to_float(hi));
        } else {
          v[j] = bits[j];
        }
      }
      if (lane < DP / 8) {
        unsigned char* row = smem + Q_OFF + (part * ROWS + r) * QS;
        PD_UNROLL
        for (int j = 0; j < 8; j += 2)
          *reinterpret_cast<unsigned*>(row + 2 * q_position(lane * 8 + j)) = v[j] | (v[j + 1] << 16);
      }
    }
  }
  __syncthreads();
}

// -- the K/V stream ------------------------------------------------------------------

// The block-table entries through shared memory. Loaded one tile ahead, an entry would
// arrive ~450 cycles before its use: less than a DRAM miss, so a tile whose entry misses
// would wait (benchmarks/NOTES.md, kernel v2.1). Staged, lane i < TT copies the entry of
// its token of the warp's tile j + S - 1 with the K/V copies of tile j, in the same commit
// group (a 4-byte cp.async), into the 16-byte pad of K row i of the stage that tile will
// use (entry_at): no K/V copy and no ldmatrix touches a pad, so the entry waits there
// beside the tile the stage still holds, and costs no shared memory. The wait_group that
// lets tile j be read has landed it too, and issue_tile reads it S - 1 tiles later, just
// before that stage is refilled. Each lane reads only the entries it copied, so no barrier
// is needed beyond wait_group. The first S - 1 tiles' entries are loaded in the prologue
// (start_entries).

// PD_LANE_OFFSETS (derived here, not given: the 8-warp tilings of 16-bit caches,
// where the SM's shared memory paced a tile; benchmarks/NOTES.md, "The row-offset table,
// replaced"): each copying lane computes its own RPL rows' K and V addresses. Row r's
// block-table entry is the one lane r staged in the pad of K row r (entry_at: one LDS.32 a
// row, one wavefront, read after the wait_group and the __syncwarp that make every lane's
// landed copies visible to the warp); its offset in its page is
// (in_page(token lane) + r - lane) mod page_size, from the lane's own in_page (every lane
// tracks token lane's), taken mod page_size by a multiply-high with ceil(2^31 / page_size)
// (exact for every page size 1..256 on the values below 2^22 it sees). The entry producer
// stores 0 for a key outside the range, so an out-of-range row's source is row (its token
// mod page_size) of page 0, an element of the cache like the table's row 0, copied with
// src-size 0 (nothing read). Otherwise (fp8, whose tiles issue paces; 6, 4 and 2 warps,
// whose chains bind) lane r < TT computes its token's 64-bit offsets once and
// the copying lanes read them from the warp's offsets table: one STS.128 and RPL LDS.128 a
// tile, each LDS.128 four quarter-warp wavefronts. The same bytes land either way. The
// preprocessor, not a constexpr branch, picks the path, so the table path's source (and
// SASS) is the one it was.
#if (PD_KV_DTYPE == PD_DTYPE_BF16 || PD_KV_DTYPE == PD_DTYPE_FP16) && PD_MMA_WARPS == 8
#define PD_LANE_OFFSETS 1
static_assert(ES == 2 && TT <= 32, "2-byte elements; the in-page offsets stay below 2^22 (page_magic)");
#else
#define PD_LANE_OFFSETS 0
#endif

// One warp's producer: lane i < TT owns token i of the warp's next tile to issue.
// Token positions and page indices are unsigned: the producer advances up to S x W x TT
// tokens past the last key it loads (the staged entry producer S - 1 tiles more), past
// 2^31 near INT32_MAX keys (never near 2^32); unsigned, that is defined and every
// comparison with [lo, hi) stays exact.
struct Stream {
  const unsigned char* k_lane;  // k_cache + kv_head * k_stride_head + this lane's 16-byte chunk
  const unsigned char* v_lane;
  const int* bt_row;
  int page_size;
  unsigned lo, hi;          // the CTA's keys [lo, hi)
  unsigned tok, page;          // this lane's token of the next tile and its page index
  int in_page;                 // the token's offset in its page
  int step_pages, step_in_page;  // W * TT tokens as whole pages + an offset in page
  unsigned etok, epage;        // the entry producer: this lane's token (and its page index) of the tile
  int ein_page;                //   whose entry is copied next, S - 1 of this warp's tiles on
  unsigned char* ring;         // this warp's ring of S stages
#if PD_LANE_OFFSETS
  unsigned page_magic;         // ceil(2^31 / page_size)
  int row_bias;                // 2 (this lane's first row - lane + 32 page_size): positive (32 page_size > lane)
#endif
};

// Where lane `lane` keeps the block-table entry of the tile stage `slot` takes next
// (the pad of K row `lane`, past the zero-filled dims of a padded row).
__device__ __forceinline__ int* entry_at(unsigned char* ring, int slot, int lane) {
  return reinterpret_cast<int*>(ring + slot * STAGE_BYTES + lane * RS + PAD_OFF);
}

// W * TT tokens on from (tok, page, in_page), without a division.
__device__ __forceinline__ void advance(const Stream& st, unsigned& tok, unsigned& page, int& in_page) {
  tok += W * TT;
  in_page += st.step_in_page;
  page += st.step_pages;
  if (in_page >= st.page_size) {
    in_page -= st.page_size;
    page += 1;
  }
}

// Table path: row j's K and V offsets from the warp's table (koff, voff: bytes from the
// lane's chunk of the KV head), written there by lane j's token.
struct TableSources {
  const unsigned char* table;
  const unsigned char *k_lane, *v_lane;
  int row0;
  longlong2 off[COPY_BATCH];
  __device__ __forceinline__ void load(int j0) {
    PD_UNROLL
    for (int jj = 0; jj < COPY_BATCH; ++jj)
      off[jj] = *reinterpret_cast<const longlong2*>(table + (row0 + (j0 + jj) * RPI) * 16);
  }
  __device__ __forceinline__ void sources(int jj, int, const unsigned char*& k, const unsigned char*& v) const {
    k = k_lane + off[jj].x;
    v = v_lane + off[jj].y;
  }
};

#if PD_LANE_OFFSETS
// Lane-offsets path: row j's block-table entry (staged by lane j S - 1 tiles ago; 0 out of
// range) and its offset in its page, both times ES = 2 (an entry < 2^31: twice it fits 32
// bits unsigned), so the strides stay in elements and no product needs a shift.
struct LaneSources {
  const Stream& st;
  const long long (&strides)[4];
  int slot, row0;
  unsigned x0;  // 2 (row row0's token's offset in its page + a multiple of page_size)
  int entries[COPY_BATCH];
  __device__ __forceinline__ void load(int j0) {
    PD_UNROLL
    for (int jj = 0; jj < COPY_BATCH; ++jj) entries[jj] = *entry_at(st.ring, slot, row0 + (j0 + jj) * RPI);
  }
  __device__ __forceinline__ void sources(int jj, int j, const unsigned char*& k, const unsigned char*& v) const {
    const unsigned x = x0 + (unsigned)(2 * j * RPI);  // 2 (in_page + a multiple of page_size)
    const unsigned q = __umulhi(x, st.page_magic);      // x / (2 page_size), exact for x < 2^22
    const unsigned in_page2 = x - q * (unsigned)(2 * st.page_size);
    const unsigned entry2 = ES * (unsigned)entries[jj];
    k = st.k_lane + (unsigned long long)entry2 * (unsigned long long)strides[0] +
        (unsigned long long)in_page2 * (unsigned long long)strides[1];
    v = st.v_lane + (unsigned long long)entry2 * (unsigned long long)strides[2] +
        (unsigned long long)in_page2 * (unsigned long long)strides[3];
  }
};
#endif

// A lane's copies of one tile: rows row0 + j RPI, j in [0, RPL), COPY_BATCH at a time. A
// batch's row addresses are read (Sources::load: one shared-memory round trip a batch, where one
// register quad reused row after row serialised them) before its copies are issued; row
// row0 + j RPI lands j RPI RS bytes past dst0 (row row0's chunk), an immediate of the copy
// instruction, so every row shares one address register. Sources::sources gives batch row jj's
// K and V source; n = 16 for a row in [first, past) of a real chunk, else 0 (zero-filled).
// One chunk of a row, of K and of V, OFFSET bytes past dst0 in the K tile and in the V tile.
template <int OFFSET>
__device__ __forceinline__ void copy_kv(unsigned char* dst0, const unsigned char* k_src, const unsigned char* v_src,
                                        unsigned n) {
  pd_cp_async_cg_16_at<OFFSET>(dst0, k_src, n);
  pd_cp_async_cg_16_at<OFFSET + TILE_BYTES>(dst0, v_src, n);
}

template <int J0, int JJ, class Sources>
__device__ __forceinline__ void copy_batch(const Sources& rows, unsigned char* dst0, int row0, int first, int past,
                                           int chunk) {
  if constexpr (JJ < COPY_BATCH) {
    constexpr int j = J0 + JJ;
    const int r = row0 + j * RPI;
    const bool in_range = r >= first && r < past;
    const unsigned char *k_src, *v_src;
    rows.sources(JJ, j, k_src, v_src);
    // chunk (+ 1) < CPR: real bytes; else a padding chunk, zero-filled (src-size 0 reads
    // nothing) with a real chunk of the same row as its source: the lane's first (fp8 head
    // dims with an odd CPR, where the choice is made at run time) or the row's chunk 0
    const bool real = CPR == CPP || chunk < CPR;
    copy_kv<j * RPI * RS>(dst0, k_src, v_src, in_range && real ? 16u : 0u);
    if (CH == 2) {
      const bool next_real = CPR == CPP || chunk + 1 < CPR;
      const int on = next_real ? 16 : 0;
      copy_kv<j * RPI * RS + 16>(dst0, k_src + on, v_src + on, in_range && next_real ? 16u : 0u);
    }
    copy_batch<J0, JJ + 1>(rows, dst0, row0, first, past, chunk);
  }
}

template <int J0, class Sources>
__device__ __forceinline__ void copy_rows(Sources& rows, unsigned char* dst0, int row0, int first, int past,
                                          int chunk) {
  if constexpr (J0 < RPL) {
    rows.load(J0);
    copy_batch<J0, 0>(rows, dst0, row0, first, past, chunk);
    copy_rows<J0 + COPY_BATCH>(rows, dst0, row0, first, past, chunk);
  }
}

// A __syncwarp, then the offsets of the next tile's rows into the warp's table (PD_LANE_OFFSETS:
// no table, each copying lane computes its rows'), its
// cp.async copies into `stage` (keys outside the CTA's range zero-filled), the block-table
// entry of this lane's token S - 1 tiles on, and one commit (an empty group of K/V when the
// tile does not exist, so the wait_group arithmetic stays uniform). Advances the producer by
// W tiles. `slot`: the tile's stage in the ring (its warp-local index mod S; `stage` is that).
// `entry`: false leaves the entry's copy out (issue_ahead: that stage holds the warp's state).
__device__ __forceinline__ void issue_tile(Stream& st, const long long (&strides)[4], bool exists, int tile,
                                           unsigned char* stage, unsigned char* table, int slot, bool entry = true) {
  const int lane = threadIdx.x & 31;
  __syncwarp();  // every lane is done with the table, the stage and the copies it waited for
#if PD_LANE_OFFSETS
  if (exists) {
    const int tile_first = tile * TT;  // a tile that exists starts below hi: no overflow
    const int first = (int)st.lo - tile_first, past = (int)st.hi - tile_first;  // the tile's valid rows [first, past)
    const int row0 = lane / CPL, chunk = lane % CPL * CH;  // rows row0 + j * RPI, 16-byte chunks chunk ..
    const bool copies = CPL * CH == CPP || chunk < CPP;    // lanes past the padded row copy nothing
    // x0 / 2 + j * RPI: row row0 + j * RPI's token's offset in its page plus a multiple of
    // the page size (st.in_page is token lane's), in 1 .. 33 page_size + TT
    const unsigned x0 = (unsigned)(2 * st.in_page + st.row_bias);
    LaneSources rows{st, strides, slot, row0, x0};
    if (copies) copy_rows<0>(rows, stage + row0 * RS + chunk * 16, row0, first, past, chunk);
  }
  if (entry && lane < TT) {  // the entry S - 1 tiles on, in range only; 0 out of range (every copying lane reads it)
    int* e = entry_at(st.ring, (slot + S - 1) % S, lane);
    if (st.etok >= st.lo && st.etok < st.hi)
      pd_cp_async_ca_4(e, st.bt_row + st.epage, 4u);
    else
      *e = 0;
  }
#else
  if (exists) {
    const int tile_first = tile * TT;  // a tile that exists starts below hi: no overflow
    if (lane < TT) {
      const bool valid = st.tok >= st.lo && st.tok < st.hi;
      long long koff = 0, voff = 0;  // an invalid row is copied with src-size 0 from row 0
      if (valid) {
        const int row = *entry_at(st.ring, slot, lane);  // staged S - 1 tiles ago
        // strides in elements (kernel parameters, not held in registers); bytes = elements * ES
        koff = ((long long)row * strides[0] + (long long)st.in_page * strides[1]) * ES;
        voff = ((long long)row * strides[2] + (long long)st.in_page * strides[3]) * ES;
      }
      *reinterpret_cast<longlong2*>(table + lane * 16) = make_longlong2(koff, voff);
    }
    __syncwarp();
    const int first = (int)st.lo - tile_first, past = (int)st.hi - tile_first;  // the tile's valid rows [first, past)
    const int row0 = lane / CPL, chunk = lane % CPL * CH;  // rows row0 + j * RPI, 16-byte chunks chunk ..
    const bool copies = CPL * CH == CPP || chunk < CPP;    // lanes past the padded row copy nothing
    TableSources rows{table, st.k_lane, st.v_lane, row0};
    if (copies) copy_rows<0>(rows, stage + row0 * RS + chunk * 16, row0, first, past, chunk);
  }
  if (entry && lane < TT && st.etok >= st.lo && st.etok < st.hi)  // the entry S - 1 tiles on, in range only
    pd_cp_async_ca_4(entry_at(st.ring, (slot + S - 1) % S, lane), st.bt_row + st.epage, 4u);
#endif
  pd_cp_async_commit();
  // Advance to the warp's next tile: W * TT tokens on, no division.
  advance(st, st.tok, st.page, st.in_page);
  advance(st, st.etok, st.epage, st.ein_page);
}

// lever 5 (PREFETCH > 0, persistent CTAs): every item's first PREFETCH tiles are in flight
// when its prologue starts (issue_ahead: the CTA's first item's at the kernel's start, a later
// one's before the previous item's epilogue; their copies and commit groups issued, the
// entries of tiles S .. S + PREFETCH - 2 copied with them); entry[j], j in PREFETCH .. S - 1:
// this lane's entry of tile j (0 outside the range), held in registers because stage j kept
// the warp's state until the combine. One path for every item: a first item started cold
// and a later one carried made the loop ~9 instructions a tile longer (ptxas).
struct Carry {
  int entry[S];
};

// This lane's entries of the warp's first S - 1 tiles, loaded into stages 0 .. S - 2 (keys
// in the range only), and the entry producer set S - 1 tiles on. One round trip, the loads independent. PREFETCH > 0: the stream starts at
// tile PREFETCH; the entries of its stages PREFETCH .. S - 1 come from carry, no load.
__device__ __forceinline__ void start_entries(Stream& st, const Carry& carry) {
  const int lane = threadIdx.x & 31;
  st.etok = st.tok;
  st.epage = st.page;
  st.ein_page = st.in_page;
  if (PREFETCH > 0) {
    PD_UNROLL
    for (int j = PREFETCH; j < S; ++j)
      if (lane < TT) *entry_at(st.ring, j, lane) = carry.entry[j];
    PD_UNROLL
    for (int j = 0; j < S - 1; ++j) advance(st, st.etok, st.epage, st.ein_page);
    return;
  }
  PD_UNROLL
  for (int j = 0; j < S - 1; ++j) {
#if PD_LANE_OFFSETS  // 0 out of range: every copying lane reads every row's entry
    if (lane < TT) *entry_at(st.ring, j, lane) = st.etok >= st.lo && st.etok < st.hi ? st.bt_row[st.epage] : 0;
#else
    if (lane < TT && st.etok >= st.lo && st.etok < st.hi) *entry_at(st.ring, j, lane) = st.bt_row[st.epage];
#endif
    advance(st, st.etok, st.epage, st.ein_page);
  }
}

// -- MMA operand builders -------------------------------------------------------------

__device__ __forceinline__ void mma(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  if (MMA_BF16)
    pd_mma_bf16_m16n8k16(acc, a, b, acc);
  else
    pd_mma_f16_m16n8k16(acc, a, b, acc);
}

// Two fp8 bytes (the low or high half of w) as an f16x2 pair.
__device__ __forceinline__ unsigned fp8_pair(unsigned short two) {
#if PD_KV_DTYPE == PD_DTYPE_FP8_E5M2
  return pd_cvt_f16x2_e5m2x2(two);
#else
  return pd_cvt_f16x2_e4m3x2(two);
#endif
}
__device__ __forceinline__ unsigned fp8_lo(unsigned w) { return fp8_pair((unsigned short)(w & 0xffffu)); }
__device__ __forceinline__ unsigned fp8_hi(unsigned w) {
#if PD_KV_DTYPE == PD_DTYPE_FP8_E5M2
  return pd_cvt_f16x2_e5m2x2_hi(w);
#else
  return pd_cvt_f16x2_e4m3x2_hi(w);
#endif
}

// The PP parts of four probabilities as B operands of the PV MMA: p[0..1] are token g,
// rows 2t, 2t+1 and p[2..3] token g + 8 (the S^T accumulator layout). Part k rounds
// what parts < k left (each residual exact in fp32); movmatrix turns each 8x8 (tokens x
// rows) b16 block into the B layout (k = tokens 2t, 2t+1, n = row g).
__device__ __forceinline__ void p_operands(const float (&p)[4], unsigned (&b)[PP][2]) {
  float r[4] = {p[0], p[1], p[2], p[3]};
  PD_UNROLL
  for (int part = 0; part < PP; ++part) {
    PD_UNROLL
    for (int h = 0; h < 2; ++h) {
      const unsigned v = MMA_BF16 ? pd_cvt_bf16x2_f32(r[2 * h + 1], r[2 * h]) : pd_cvt_f16x2_f32(r[2 * h + 1], r[2 * h]);
      b[part][h] = pd_movmatrix_trans(v);
      if (part + 1 < PP) {
        r[2 * h] -= MMA_BF16 ? __uint_as_float(v << 16) : pd_cvt_f32_f16((unsigned short)(v & 0xffffu));
        r[2 * h + 1] -= MMA_BF16 ? __uint_as_float(v & 0xffff0000u) : pd_cvt_f32_f16((unsigned short)(v >> 16));
      }
    }
  }
}

// -- the core --------------------------------------------------------------------------

// The per-warp state: for row tile nt and column j in {0, 1} (row nt * 8 + 2t + j,
// t = lane % 4): m (identical on the 8 lanes of a column), this lane's share of l, and
// O^T fragments o[dt][nt][4] (dims of 16-dim block dt, see out_dim).
struct State {
  float m[NT][2];
  float l[NT][2];
  float o[KD][NT][4];
};

// Dim of O^T fragment element e (0..3) of block dt held by lane (g, t): rows g and g + 8
// of the block. bf16/fp16 V: block rows are its 16 dims in order; fp8 V: the byte pairs
// of ldmatrix.trans put even dims on rows 0..7 and odd dims on rows 8..15.
__device__ __forceinline__ int out_dim(int dt, int g, int e) {
  const int upper = e >> 1;
  return FP8 ? dt * 16 + 2 * g + upper : dt * 16 + 8 * upper + g;
}

// This warp's tiles of the keys [lo, hi): tiles k of [k0, k1) at absolute positions k * TT,
// warp w taking k = w mod W; the first and how many. The ceiling without hi + TT - 1, which
// overflows for hi > INT32_MAX - TT + 1. W a power of two: (w - k0) mod W is a mask; 6 warps:
// k0 - k0 % W + w, one round on when w < k0 % W (k0 >= 0).
__device__ __forceinline__ void warp_tiles(int lo, int hi, int& first_tile, int& my_tiles) {
  const int warp = threadIdx.x >> 5;
  const int k0 = lo / TT, k1 = hi > lo ? hi / TT + (hi % TT != 0 ? 1 : 0) : k0;
#if (PD_MMA_WARPS & (PD_MMA_WARPS - 1)) == 0
  first_tile = k0 + ((warp - k0) & (W - 1));
#else
  const int k0_w = (int)((unsigned)k0 % (unsigned)W);
  first_tile = k0 - k0_w + warp + (warp < k0_w ? W : 0);
#endif
  my_tiles = first_tile < k1 ? (k1 - first_tile + W - 1) / W : 0;
}

// A producer for this warp's tiles of the keys [lo, hi) of one KV head (its K and V rows at
// k_head / v_head), from its tile `from` of those starting at first_tile (lane i < TT: token
// i of that tile).
__device__ __forceinline__ void open_stream(Stream& s, const unsigned char* k_head, const unsigned char* v_head,
                                            const int* __restrict__ bt_row, int page_size, int lo, int hi,
                                            int first_tile, int from, unsigned char* ring) {
  const int lane = threadIdx.x & 31;
  const int first_chunk = lane % CPL * CH;  // its CH chunks start here; a zero-filled one points at a real one
  const int chunk = (CPR == CPL * CH || first_chunk < CPR) ? first_chunk : 0;
  s.k_lane = k_head + chunk * 16;
  s.v_lane = v_head + chunk * 16;
  s.bt_row = bt_row;
  s.page_size = page_size;
  s.lo = lo;
  s.hi = hi;
  s.step_pages = (W * TT) / page_size;
  s.step_in_page = W * TT - s.step_pages * page_size;
  s.tok = (unsigned)first_tile * TT + from * W * TT + lane;
  s.page = s.tok / (unsigned)page_size;  // one division per lane per item; the rest are increments
  s.in_page = (int)(s.tok - s.page * page_size);
  s.ring = ring;
#if PD_LANE_OFFSETS
  s.page_magic = (0x7fffffffu + (unsigned)page_size) / (unsigned)page_size;
  s.row_bias = 2 * (lane / CPL - lane + 32 * page_size);
#endif
}

// Attend every row's keys and leave the warp state in `st`: the plain algorithm, the
// features entering through their hooks (f, MultiToken). `smem` is the launch's dynamic
// shared memory, Q staged (stage_q). PREFETCH > 0 (lever 5): the first PREFETCH of this warp's
// tiles are in flight already (issue_ahead), the prologue issues the rest.
__device__ __forceinline__ void attend(unsigned char* smem, const Rows& rw, const Features& f,
                                       const unsigned char* k_head, long long k_stride_page, long long k_stride_token,
                                       const unsigned char* v_head, long long v_stride_page,
                                       long long v_stride_token, const int* __restrict__ bt_row, int page_size,
                                       const Carry& carry, State& st) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const float neg_inf = pd_neg_inf();

  PD_UNROLL
  for (int nt = 0; nt < NT; ++nt)
    PD_UNROLL
    for (int j = 0; j < 2; ++j) {
      st.m[nt][j] = neg_inf;
      st.l[nt][j] = 0.f;
    }
  PD_UNROLL
  for (int dt = 0; dt < KD; ++dt)
    PD_UNROLL
    for (int nt = 0; nt < NT; ++nt)
      PD_UNROLL
      for (int e = 0; e < 4; ++e) st.o[dt][nt][e] = 0.f;

  float scale[NT][2];
  PD_UNROLL
  for (int nt = 0; nt < NT; ++nt)
    PD_UNROLL
    for (int j = 0; j < 2; ++j) scale[nt][j] = reinterpret_cast<const float*>(smem + SCALE_OFF)[nt * 8 + 2 * t + j];

  int lo, hi;  // the CTA's keys
  cta_range(rw, f, lo, hi);
  int col_lo[NT][2], col_hi[NT][2];  // multi_token: the keys each of this lane's columns sees
  if (MultiToken::on) MultiToken::columns(rw, f, t, col_lo, col_hi);
  int first_tile, my_tiles;
  warp_tiles(lo, hi, first_tile, my_tiles);

  unsigned char* ring = smem + RING_OFF + warp * RING_BYTES;
  unsigned char* table = smem + TABLE_OFF + warp * TT * 16;

  constexpr int from = PREFETCH;  // tiles in flight already (issue_ahead)
  Stream s;
  const long long strides[4] = {k_stride_page, k_stride_token, v_stride_page, v_stride_token};
  open_stream(s, k_head, v_head, bt_row, page_size, lo, hi, first_tile, from, ring);
  start_entries(s, carry);

  PD_UNROLL
  for (int k = 0; k < S - 1; ++k)
    if (k >= from) issue_tile(s, strides, k < my_tiles, first_tile + k * W, ring + k * STAGE_BYTES, table, k);

  // ldmatrix row address of this lane within a tile: token ((lane >> 3) & 1) * 8 +
  // (lane & 7) of a 16-token block, 16-byte chunk lane >> 4 of a chunk pair.
  const int kv_lane = ((((lane >> 3) & 1) * 8) + (lane & 7)) * RS + (lane >> 4) * 16;
  const unsigned char* q_lane = smem + Q_OFF + (lane & 7) * QS + (lane >> 3) * 16;
  // Q_IN_REGS: q's B operands read once here, not once per 16 keys (each reading shared memory)
  unsigned q_frag[Q_IN_REGS ? KS / 2 : 1][QP][NT][4];
  PD_UNROLL
  for (int kk = 0; kk < (Q_IN_REGS ? KS / 2 : 0); ++kk)
    PD_UNROLL
    for (int part = 0; part < QP; ++part)
      PD_UNROLL
      for (int nt = 0; nt < NT; ++nt)
        pd_ldmatrix_x4(q_frag[kk][part][nt], q_lane + (part * ROWS + nt * 8) * QS + kk * 64);

  for (int k = 0; k < my_tiles; ++k) {
    pd_cp_async_wait<S - 2>();  // this lane's copies of tile k have landed; issue_tile's
                                // __syncwarp makes every lane's visible and frees the stage read last
    issue_tile(s, strides, k + S - 1 < my_tiles, first_tile + (k + S - 1) * W, ring + ((k + S - 1) % S) * STAGE_BYTES,
               table, (k + S - 1) % S);

    const unsigned char* kt = ring + (k % S) * STAGE_BYTES;
    const unsigned char* vt = kt + TILE_BYTES;
    const int base = (first_tile + k * W) * TT;  // absolute position of the tile's first key

    // -- scores S^T[token][row] = K Q^T, two 16-dim steps per ldmatrix.x4
    float sc[MT][NT][4];
    PD_UNROLL
    for (int mt = 0; mt < MT; ++mt)
      PD_UNROLL
      for (int nt = 0; nt < NT; ++nt)
        PD_UNROLL
        for (int e = 0; e < 4; ++e) sc[mt][nt][e] = 0.f;
    PD_UNROLL
    for (int kk = 0; kk < KS / 2; ++kk) {
      PD_UNROLL
      for (int mt = 0; mt < MT; ++mt) {
        unsigned a[2][4];
        if (FP8) {  // chunks 2kk, 2kk + 1 of 16 dims each: one step per chunk
          unsigned r[4];
          pd_ldmatrix_x4(r, kt + mt * 16 * RS + kk * 32 + kv_lane);
          PD_UNROLL
          for (int h = 0; h < 2; ++h) {
            if (2 * kk + h >= KD) continue;  // a padding step (compile time)
            a[h][0] = fp8_lo(r[2 * h]);
            a[h][1] = fp8_lo(r[2 * h + 1]);
            a[h][2] = fp8_hi(r[2 * h]);
            a[h][3] = fp8_hi(r[2 * h + 1]);
          }
        } else {  // chunks of 8 dims: two per step
          PD_UNROLL
          for (int h = 0; h < 2; ++h) {
            if (2 * kk + h >= KD) continue;
            unsigned r[4];
            pd_ldmatrix_x4(r, kt + mt * 16 * RS + (2 * kk + h) * 32 + kv_lane);
            a[h][0] = r[0];
            a[h][1] = r[1];
            a[h][2] = r[2];
            a[h][3] = r[3];
          }
        }
        // q's B operands of steps 2kk, 2kk + 1, one row tile and part at a time: from
        // q_frag (Q_IN_REGS), else re-read from shared memory every tile (few registers live)
        PD_UNROLL
        for (int part = 0; part < QP; ++part)
          PD_UNROLL
          for (int nt = 0; nt < NT; ++nt) {
            unsigned qb[4];  // [step 2kk: b0b1, b2b3, step 2kk + 1: b0b1, b2b3]
            if (Q_IN_REGS) {
              PD_UNROLL
              for (int e = 0; e < 4; ++e) qb[e] = q_frag[Q_IN_REGS ? kk : 0][part][nt][e];
            } else {
              pd_ldmatrix_x4(qb, q_lane + (part * ROWS + nt * 8) * QS + kk * 64);
            }
            PD_UNROLL
            for (int h = 0; h < 2; ++h) {
              if (2 * kk + h >= KD) continue;
              const unsigned b[2] = {qb[2 * h], qb[2 * h + 1]};
              mma(sc[mt][nt], a[h], b);
            }
          }
      }
    }

    // -- logits: keys a row does not see masked (-inf), the others transformed (soft_cap)
    PD_UNROLL
    for (int mt = 0; mt < MT; ++mt)
      PD_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int pos = base + mt * 16 + g + 8 * (e >> 1);
        PD_UNROLL
        for (int nt = 0; nt < NT; ++nt) {
          const bool sees = MultiToken::on ? pos >= col_lo[nt][e & 1] && pos < col_hi[nt][e & 1]  // its row's
                                           : pos >= lo && pos < hi;                               // the CTA's
          sc[mt][nt][e] = sees ? (SoftCap::on ? f.soft_cap.logits(sc[mt][nt][e], scale[nt][e & 1]) : sc[mt][nt][e])
                               : neg_inf;
        }
      }

    // -- update m and l, rescale O by alpha = 2^(m_old - m_new)
    float alpha[NT][2];
    PD_UNROLL
    for (int nt = 0; nt < NT; ++nt)
      PD_UNROLL
      for (int j = 0; j < 2; ++j) {
        float mx = neg_inf;  // plain: of the raw scores (scale > 0 keeps their order); soft_cap: of x
        PD_UNROLL
        for (int mt = 0; mt < MT; ++mt) mx = fmaxf(mx, fmaxf(sc[mt][nt][j], sc[mt][nt][j + 2]));
        PD_UNROLL
        for (int off = 4; off <= 16; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(PD_FULL_MASK, mx, off));
        const float m_new = fmaxf(st.m[nt][j], SoftCap::on ? mx : mx * scale[nt][j]);  // log2 units
        // Nothing valid seen yet (m_new = -inf): subtract 0, so -inf - -inf = NaN never
        // happens; alpha and every p are then exp2f(-inf) = 0.
        const float ms = m_new == neg_inf ? 0.f : m_new;
        alpha[nt][j] = exp2f(st.m[nt][j] - ms);
        st.m[nt][j] = m_new;
        float lsum = 0.f;
        PD_UNROLL
        for (int mt = 0; mt < MT; ++mt)
          PD_UNROLL
          for (int e = j; e < 4; e += 2) {
            // p = 2^(x - ms); plain: x = scale * the raw score, folded into one fmaf
            const float p = SoftCap::on ? exp2f(sc[mt][nt][e] - ms) : exp2f(fmaf(sc[mt][nt][e], scale[nt][j], -ms));
            lsum += p;
            sc[mt][nt][e] = p * p_scale();  // exact (a power of two)
          }
        st.l[nt][j] = fmaf(st.l[nt][j], alpha[nt][j], lsum);
      }
    PD_UNROLL
    for (int dt = 0; dt < KD; ++dt)
      PD_UNROLL
      for (int nt = 0; nt < NT; ++nt)
        PD_UNROLL
        for (int e = 0; e < 4; ++e) st.o[dt][nt][e] *= alpha[nt][e & 1];

    // -- O^T[dim][row] += V^T P^T, one MMA per part of p
    PD_UNROLL
    for (int mt = 0; mt < MT; ++mt) {
      unsigned pb[NT][PP][2];
      PD_UNROLL
      for (int nt = 0; nt < NT; ++nt) p_operands(sc[mt][nt], pb[nt]);
      PD_UNROLL
      for (int dp = 0; dp < KS / 2; ++dp) {  // two 16-dim blocks per ldmatrix.x4.trans
        unsigned a[2][4];
        if (FP8) {  // one chunk per block; bytes (token 2t, 2t+1) x (dim 2g, 2g+1) per register
          unsigned r[4];
          pd_ldmatrix_x4_trans(r, vt + mt * 16 * RS + dp * 32 + kv_lane);
          PD_UNROLL
          for (int h = 0; h < 2; ++h) {
            if (2 * dp + h >= KD) continue;
            const unsigned lo8 = pd_prmt(r[2 * h], 0u, 0x3120u);      // tokens 0..7: (dim 2g | dim 2g + 1) pairs
            const unsigned hi8 = pd_prmt(r[2 * h + 1], 0u, 0x3120u);  // tokens 8..15
            a[h][0] = fp8_lo(lo8);
            a[h][1] = fp8_hi(lo8);
            a[h][2] = fp8_lo(hi8);
            a[h][3] = fp8_hi(hi8);
          }
        } else {  // two chunks of 8 dims per block
          PD_UNROLL
          for (int h = 0; h < 2; ++h) {
            if (2 * dp + h >= KD) continue;
            unsigned r[4];
            pd_ldmatrix_x4_trans(r, vt + mt * 16 * RS + (2 * (2 * dp + h)) * 16 + kv_lane);
            a[h][0] = r[0];
            a[h][1] = r[2];
            a[h][2] = r[1];
            a[h][3] = r[3];
          }
        }
        PD_UNROLL
        for (int h = 0; h < 2; ++h)
          PD_UNROLL
          for (int nt = 0; nt < NT; ++nt)
            PD_UNROLL
            for (int part = 0; part < PP; ++part)
              if (2 * dp + h < KD) mma(st.o[2 * dp + h][nt], a[h], pb[nt][part]);
      }
    }
  }
  pd_cp_async_wait_all();  // only empty groups can be left; the rings are reused next

  // This lane's share of l over the 8 lanes of its column (xor butterfly: every lane of
  // the column ends with the same bits).
  PD_UNROLL
  for (int nt = 0; nt < NT; ++nt)
    PD_UNROLL
    for (int j = 0; j < 2; ++j)
      PD_UNROLL
      for (int off = 4; off <= 16; off <<= 1) st.l[nt][j] += __shfl_xor_sync(PD_FULL_MASK, st.l[nt][j], off);
}

// Where warp w's state lies after publish, for cta_combine: m and l of row r, o of row r
// dim d. PREFETCH > 0 (lever 5): in its own ring past the stages issue_ahead fills.
__device__ __forceinline__ int state_m(int r, int w) {
  return PREFETCH > 0 ? RING_OFF + w * RING_BYTES + OWN_STATE_OFF + r * 4 : EPI_M_OFF + (r * W + w) * 4;
}
__device__ __forceinline__ int state_l(int r, int w) {
  return PREFETCH > 0 ? state_m(r, w) + ROWS * 4 : EPI_L_OFF + (r * W + w) * 4;
}
__device__ __forceinline__ int state_o(int r, int w, int d) {
  return PREFETCH > 0 ? state_m(0, w) + (2 * ROWS + r * D + d) * 4 : EPI_O_OFF + ((r * W + w) * D + d) * 4;
}

// Publish every warp's state to shared memory for cta_combine, call ahead(), and end with
// __syncthreads(); every thread of the CTA calls it. PREFETCH == 0: into the rings of every
// warp (free once every warp has left `attend`: the first __syncthreads here ensures it).
// PREFETCH > 0 (lever 5): into the warp's own ring, past stages 0 .. PREFETCH - 1, so no
// barrier first (a fast warp publishes while others still stream), and ahead() then issues
// the next item's first tiles into those stages, in flight across the barrier and the
// combine.
template <class Ahead>
__device__ __forceinline__ void publish(unsigned char* smem, const State& st, const Ahead& ahead) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
#if PD_PREFETCH
  __syncwarp();  // every lane of the warp is done with its ring (attend waited for its copies)
  PD_UNROLL
  for (int nt = 0; nt < NT; ++nt)
    PD_UNROLL
    for (int j = 0; j < 2; ++j) {
      const int h = nt * 8 + 2 * t + j;
      if (g == 0) {
        *reinterpret_cast<float*>(smem + state_m(h, warp)) = st.m[nt][j];
        *reinterpret_cast<float*>(smem + state_l(h, warp)) = st.l[nt][j];
      }
      PD_UNROLL
      for (int dt = 0; dt < KD; ++dt)
        PD_UNROLL
        for (int e = j; e < 4; e += 2)
          *reinterpret_cast<float*>(smem + state_o(h, warp, out_dim(dt, g, e))) = st.o[dt][nt][e];
    }
  ahead();
  __syncthreads();
#else
  (void)ahead;
  __syncthreads();
  float* s_m = reinterpret_cast<float*>(smem + EPI_M_OFF);
  float* s_l = reinterpret_cast<float*>(smem + EPI_L_OFF);
  float* s_o = reinterpret_cast<float*>(smem + EPI_O_OFF);
  PD_UNROLL
  for (int nt = 0; nt < NT; ++nt)
    PD_UNROLL
    for (int j = 0; j < 2; ++j) {
      const int h = nt * 8 + 2 * t + j;
      if (g == 0) {
        s_m[h * W + warp] = st.m[nt][j];
        s_l[h * W + warp] = st.l[nt][j];
      }
      PD_UNROLL
      for (int dt = 0; dt < KD; ++dt)
        PD_UNROLL
        for (int e = j; e < 4; e += 2) s_o[(h * W + warp) * D + out_dim(dt, g, e)] = st.o[dt][nt][e];
    }
  __syncthreads();
#endif
}

// The CTA's state of row r, dim d over the warps in order 0..W-1: M = max m_w (-inf when
// the CTA saw no key), L = sum l_w 2^(m_w - M), O = sum o_w 2^(m_w - M).
__device__ __forceinline__ void cta_combine(const unsigned char* smem, int r, int d, float& M, float& L, float& O) {
#if PD_PREFETCH
  const auto s_m = [&](int w) { return *reinterpret_cast<const float*>(smem + state_m(r, w)); };
  const auto s_l = [&](int w) { return *reinterpret_cast<const float*>(smem + state_l(r, w)); };
  const auto s_o = [&](int w) { return *reinterpret_cast<const float*>(smem + state_o(r, w, d)); };
#else
  const float* m_at = reinterpret_cast<const float*>(smem + EPI_M_OFF);
  const float* l_at = reinterpret_cast<const float*>(smem + EPI_L_OFF);
  const float* o_at = reinterpret_cast<const float*>(smem + EPI_O_OFF);
  const auto s_m = [&](int w) { return m_at[r * W + w]; };
  const auto s_l = [&](int w) { return l_at[r * W + w]; };
  const auto s_o = [&](int w) { return o_at[(r * W + w) * D + d]; };
#endif
  const float neg_inf = pd_neg_inf();
  float mx = neg_inf;
  PD_UNROLL
  for (int w = 0; w < W; ++w) mx = fmaxf(mx, s_m(w));
  const float ms = mx == neg_inf ? 0.f : mx;  // every warp empty: avoid -inf - -inf
  float lsum = 0.f, o = 0.f;
  PD_UNROLL
  for (int w = 0; w < W; ++w) {
    const float wt = exp2f(s_m(w) - ms);  // an empty warp: 2^-inf = 0, and its l = o = 0
    lsum = fmaf(s_l(w), wt, lsum);
    o = fmaf(s_o(w), wt, o);
  }
  M = mx;
  L = lsum;
  O = o * o_unscale();  // exact
}

// Persistent CTAs: bring into L2 what the prologue of the CTA's next item
// (rows rw of q_row, its keys on bt_row) waits on: its q rows and the block-table entries of
// the tiles its warps take first (S tiles each from the first tile of its range). Only
// lines it will read are touched (no entry of a key outside its range); nothing is written,
// so no byte depends on it. Every thread calls it; a few issue prefetches. Leaves the item's
// keys [lo, hi) (cta_range) for issue_ahead.
template <class QRow>
__device__ __forceinline__ void warm_item(const Rows& rw, const Features& f, const QRow& q_row,
                                          const int* __restrict__ bt_row, int page_size, int& lo, int& hi) {
  constexpr int LINE = 128, ROW_LINES = (D * 2 + LINE - 1) / LINE + 1;  // + 1: a row need not start a line
  for (int i = threadIdx.x; i < rw.rows * ROW_LINES; i += THREADS) {
    const int r = i / ROW_LINES, k = i - r * ROW_LINES;
    const int byte = k * LINE < D * 2 ? k * LINE : D * 2 - 1;
    pd_prefetch_l2(reinterpret_cast<const unsigned char*>(q_row(r)) + byte);
  }
  cta_range(rw, f, lo, hi);
  if (lo >= hi) return;
  const int first = lo / TT * TT, end = first + S * W * TT < hi ? first + S * W * TT : hi;
  const int pages = (end - 1) / page_size - lo / page_size + 1;
  for (int i = threadIdx.x; i < pages; i += THREADS) pd_prefetch_l2(bt_row + lo / page_size + i);
}

// Lever 5 (PREFETCH > 0, persistent CTAs): issue this warp's first PREFETCH tiles of the
// CTA's next item (its keys [lo, hi): cta_range, its KV head's k_head / v_head, its page ids
// bt_row) into stages 0 .. PREFETCH - 1 of its ring, once it has published the current item's
// state past them (the CTA's first item: at the kernel's start): the copies, the entries S - 1 tiles on and the commit groups attend's prologue would
// issue, so its cp.async.wait_group arithmetic is unchanged and the round trip runs under
// the epilogue and the next q staging. Stages PREFETCH .. S - 1 hold the state until the
// combine is done, so the entries of tiles PREFETCH .. S - 1 (issue_tile would copy tile
// S - 1's into stage S - 1) go to carry, loaded with the first ones in one round trip;
// attend stores them once the stages are free. The same producer, tiles and order as
// attend: no byte changes.
__device__ __forceinline__ void issue_ahead(unsigned char* smem, int lo, int hi, const unsigned char* k_head,
                                            long long k_stride_page,
                                            long long k_stride_token, const unsigned char* v_head,
                                            long long v_stride_page, long long v_stride_token,
                                            const int* __restrict__ bt_row, int page_size, Carry& carry) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int first_tile, my_tiles;
  warp_tiles(lo, hi, first_tile, my_tiles);
  unsigned char* ring = smem + RING_OFF + warp * RING_BYTES;
  unsigned char* table = smem + TABLE_OFF + warp * TT * 16;
  Stream s;
  const long long strides[4] = {k_stride_page, k_stride_token, v_stride_page, v_stride_token};
  open_stream(s, k_head, v_head, bt_row, page_size, lo, hi, first_tile, 0, ring);
  s.etok = s.tok;
  s.epage = s.page;
  s.ein_page = s.in_page;
  PD_UNROLL
  for (int j = 0; j < S; ++j) {  // tiles 0 .. S - 1, the producer left at S - 1 (start_entries')
    const int e = lane < TT && s.etok >= s.lo && s.etok < s.hi ? bt_row[s.epage] : 0;
    if (j < PREFETCH) {
      if (lane < TT) *entry_at(ring, j, lane) = e;
    } else {
      carry.entry[j] = e;
    }
    if (j < S - 1) advance(s, s.etok, s.epage, s.ein_page);
  }
  PD_UNROLL
  for (int k = 0; k < PREFETCH; ++k)  // tile 0's entry copy would land in stage S - 1: carried instead
    issue_tile(s, strides, k < my_tiles, first_tile + k * W, ring + k * STAGE_BYTES, table, k, k > 0);
}

// The whole CTA: stage q (q_row(r) = row r's D elements), call between(), attend (carry: lever
// 5's tiles in flight), publish (calling ahead(): lever 5's issue_ahead). Afterwards
// cta_combine(r, d) gives row r's state; the caller writes the outputs of rows < rows.
template <class QRow, class Between, class Ahead>
__device__ __forceinline__ void run_cta(unsigned char* smem, const Rows& rw, const Features& f, const QRow& q_row,
                                        float qk_scale, const pd_kv_t* k_head, long long k_stride_page,
                                        long long k_stride_token, const pd_kv_t* v_head, long long v_stride_page,
                                        long long v_stride_token, const int* __restrict__ bt_row, int page_size,
                                        const Between& between, const Carry& carry, const Ahead& ahead) {
  stage_q(smem, q_row, rw.rows, qk_scale);
  between();  // persistent CTAs: warm the next item (warm_item); plain: nothing
  State st;
  attend(smem, rw, f, reinterpret_cast<const unsigned char*>(k_head), k_stride_page, k_stride_token,
         reinterpret_cast<const unsigned char*>(v_head), v_stride_page, v_stride_token, bt_row, page_size, carry, st);
  publish(smem, st, ahead);
}

// Write every row's normalized output and, when lse != nullptr, its lse. Row r = t *
// heads + h goes to out_row0[(t * num_q_heads + h) * D] (the q tokens of one sequence
// are num_q_heads rows apart), lse_row0[t * num_q_heads + h]. Every thread calls it.
__device__ __forceinline__ void store_rows(unsigned char* smem, const Rows& rw, const Features& f, int num_q_heads,
                                           float v_scale, float lse_scale, OutF32::out_t* out_row0, float* lse_row0) {
  unsigned short* s_out = reinterpret_cast<unsigned short*>(smem + Q_OFF);
  for (int idx = threadIdx.x; idx < rw.rows * D; idx += THREADS) {
    const int r = idx / D, d = idx - r * D;
    float M, L, O;
    cta_combine(smem, r, d, M, L, O);
    const bool alone = Sinks::on ? f.sinks.fold(r % rw.heads, M, L, O) : false;  // the sink alone is the state
    const float value = pd_normalize(O, L, v_scale);  // zeros for an empty state
    const long long at = (long long)(r / rw.heads) * num_q_heads + r % rw.heads;
    if (OutF32::on)
      OutF32::put(out_row0, at, d, value);
    else
      s_out[idx] = (unsigned short)pd_float_to_q(value);
    if (d == 0 && lse_row0 != nullptr)
      lse_row0[at] = alone ? pd_sink_lse(f.sinks.logit[r % rw.heads], lse_scale) : pd_lse(M, L, lse_scale);
  }
  if (!OutF32::on) {
    __syncthreads();
    for (int t = 0; t < rw.q_len; ++t)  // the heads of one token are contiguous in out
      pd_store_span(reinterpret_cast<pd_q_t*>(out_row0) + (long long)t * num_q_heads * D, s_out + t * rw.heads * D,
                    rw.heads * D);
  }
}

}  // namespace pd_mma

// =======================================================================================
// THE KERNEL
// =======================================================================================
//
// The attention kernel of the three arms, written once: its parameter list (the launch
// ABI) and its body. Each arm's .cu names the kernel and picks the arm, then includes
// this file (decode_splitk.cu, for one):
//     #define PD_ENTRY decode_splitk    // the extern "C" name (plan.KERNELS)
//     #define PD_ARM PD_ARM_SPLITK      // PD_ARM_UNPACKED | PD_ARM_SPLITK | PD_ARM_GQA_PACKED
//
// The ABI. The three attention kernels take the one parameter list below: same names,
// same order, same types. Python reads it from this text (kernels.kernel_params, with the
// kernel's name PD_ENTRY taken from the including .cu's #define) and binds arguments by
// name (binding.ARGUMENTS; a parameter named after a LayerConfig field, as window_left,
// takes that field's value); the CPU shim reads the same list from the preprocessed
// source. A parameter an arm has no use for is taken and ignored: split-K writes the
// workspace and not out / lse (its merge does, below), the others the reverse, and the
// packed arm serves its compile-time PD_GQA heads per CTA (the host passes heads_per_cta
// = PD_GQA all the same); a feature's parameter is ignored where the feature is off. A
// feature that takes a value adds its parameter here and hands it to its hook in
// `Features` (the window: `int window_left`, `Window{window_left}`).
//
// Computes, for sequence s, query token i < q_len and query head h (kv head h / G, G =
// num_q_heads / num_kv_heads), over the keys t the token sees (row_range: t < L - q_len +
// 1 + i with L = seq_lens[s], from its window when there is one):
//   x_t = qk_scale * (q[s, i, h] . k_t)     (log2 units; soft-cap: cap_log2 tanh(qk_scale q.k))
//   out = v_scale * sum_t 2^(x_t - m) v_t / (sum_t 2^(x_t - m) [+ 2^(sink_h log2 e - m)])
//   lse = log of that denominator, with m added back (natural log, or base 2 with lse_scale
//         = 1; optional)
// with k_t, v_t row t of the sequence's paged cache (page block_tables[s, t / page_size],
// offset in page t % page_size). A token that sees no key gives out = 0 and lse = -inf.
// Split-K writes, instead of out and lse, each row's state over its split of the keys to
// the workspace (pd_splitk.cuh).
//
// Grid: the arm's (see its .cu); block PD_MMA_THREADS (PD_MMA_WARPS warps), dynamic shared memory
// PD_SMEM_BYTES. A CTA serves the heads head0 .. head0 + heads_per_cta - 1 of one sequence
// (heads of one KV head: heads_per_cta divides G) and its q_len query tokens,
// heads_per_cta * q_len <= 8 * PD_ROW_TILES; the host guarantees both (and q_len == 1
// unless PD_MULTI_TOKEN). The core streams that KV head's K and V once for all of them; a
// row's bytes do not depend on heads_per_cta or q_len.
//
// Layout: q [num_seqs, q_len, num_q_heads, D] and the caches addressed by strides in
// elements (NHD and HND are both (stride_page, stride_token, stride_head)); K/V rows and
// q rows 16-byte aligned, last dim contiguous. out [num_seqs, q_len, num_q_heads, D]
// contiguous (fp32 with out_f32, else q's dtype), lse [num_seqs, q_len, num_q_heads] fp32
// or null, sinks [num_q_heads] fp32 (read only with sinks), workspace [num_seqs * q_len,
// num_q_heads, num_splits, D + 2] fp32 (split-K only).

namespace pd_mma {
// One work item (bx, by, bz) of the plan's gx x gy x gz grid of items (the arm's, its .cu): the query heads head0 .. head0 + heads - 1 (all of KV
// head kv_head) of sequence seq, split `split` of num_splits of its keys.
struct Item {
  int seq, split, num_splits, head0, heads, kv_head, num_q_heads;
};

// Where a sequence's length and its row of page ids come from: block_tables and seq_lens,
// or the CSR table (csr).
struct Tables {
  const int* block_tables;
  long long block_tables_stride;
  const int* seq_lens;
  Csr csr;
  int page_size;
  __device__ __forceinline__ int seq_len(int seq) const {
    return Csr::on ? csr.seq_len(seq, page_size) : seq_lens[seq];
  }
  __device__ __forceinline__ const int* row(int seq) const {
    return Csr::on ? csr.row(seq) : block_tables + seq * block_tables_stride;
  }
};
}  // namespace pd_mma

// The sequence of item `at` (x fastest) of a gx x gy x (any) grid: its by, or its bz on split-K.
__device__ __forceinline__ int pd_item_seq(int at, int gx, int gy) {
  return PD_ARM == PD_ARM_SPLITK ? at / (gx * gy) : (at / gx) % gy;
}

// Item (bx, by, bz) of a gx x gy x (any) grid of items.
__device__ __forceinline__ pd_mma::Item pd_item(int bx, int by, int bz, int gx, int gy, int num_kv_heads,
                                                int heads_per_cta) {
  pd_mma::Item it;
#if PD_ARM == PD_ARM_SPLITK
  it.split = by, it.seq = bz, it.num_splits = gy;
#else
  it.split = 0, it.seq = by, it.num_splits = 1;
  (void)bz;
  (void)gy;
#endif
#if PD_ARM == PD_ARM_GQA_PACKED
  // The pack: the PD_GQA heads of KV head bx, a row count the compiler knows.
  it.heads = PD_GQA;
  it.kv_head = bx;
  it.num_q_heads = num_kv_heads * PD_GQA;
  it.head0 = bx * PD_GQA;
  (void)heads_per_cta;
  (void)gx;
#else
  it.heads = heads_per_cta;
  it.num_q_heads = gx * heads_per_cta;
  it.head0 = bx * heads_per_cta;
  it.kv_head = it.head0 / (it.num_q_heads / num_kv_heads);
#endif
  return it;
}

typedef pd_mma::OutF32::out_t pd_out_t;  // out's element: q's dtype, or fp32 (out_f32)

extern "C" __global__ void PD_LAUNCH_BOUNDS(PD_MMA_THREADS, 1) PD_ENTRY(
    // q: [num_seqs, q_len, num_q_heads, D] by strides in elements
    const pd_q_t* __restrict__ q,
    long long q_stride_seq, long long q_stride_token, long long q_stride_head,
    // the paged caches by strides in elements, and each sequence's row of page ids
    const pd_kv_t* __restrict__ k_cache,
    long long k_stride_page, long long k_stride_token, long long k_stride_head,
    const pd_kv_t* __restrict__ v_cache,
    long long v_stride_page, long long v_stride_token, long long v_stride_head,
    const int* __restrict__ block_tables, long long block_tables_stride, const int* __restrict__ seq_lens,
    // the geometry: heads_per_cta query heads (all of one KV head) and q_len tokens per CTA;
    // window: a token sees window_left keys before its own (-1: all)
    int num_kv_heads, int page_size, int heads_per_cta, int q_len, int window_left,
    // scores x = qk_scale q.k in log2 units (soft_cap: cap_log2 tanh(qk_scale q.k)), values
    // times v_scale; sinks: a sink logit per head (natural log)
    float qk_scale, float cap_log2, float v_scale, const float* __restrict__ sinks,
    // results: out and lse (unpacked, packed), or the split states (split-K)
    pd_out_t* __restrict__ out, float* __restrict__ lse, float* __restrict__ workspace,
    // device_scales: fp32 scales on the device, folded with sm_scale (and soft_cap) here;
    // lse in the caller's base: lse_scale = ln 2 (natural log) or 1 (base 2)
    const float* __restrict__ k_scales, long long k_scales_stride, const float* __restrict__ v_scales,
    long long v_scales_stride, double sm_scale, double soft_cap, float lse_scale,
    // csr: FlashInfer's page table in place of block_tables and seq_lens
    const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices, const int* __restrict__ kv_last_page_len,
    // the plan's grid of work items (x fastest): the persistent CTAs walk it, CTA b taking
    // items b, b + gridDim.x, ... (THE SCHEDULE)
    int items_x, int items_y, int items_z) {
  DYNAMIC_SHARED(unsigned char, smem);
  const pd_mma::Csr csr{kv_indptr, kv_indices, kv_last_page_len};
  const pd_mma::Tables tables{block_tables, block_tables_stride, seq_lens, csr, page_size};
  // THE SCHEDULE: the launch grid is (P, 1, 1), P <= items (binding.launch_grid_of: the CTAs
  // the device holds at once); CTA b serves items b, b + P, b + 2P, ... in that order. An
  // item's arithmetic is a function of the item alone, so a row's bytes do not depend on P:
  // the schedule changes only which CTA computes an item and when. While an item streams its keys, its CTA brings the next item's q rows and
  // the block-table entries of its first tiles into L2 (warm_item), so that item's prologue
  // waits on L2, not DRAM, for both; and each warp, done with its last tile of an item and
  // its state published, issues its first tiles of the next (lever 5: issue_ahead), which
  // land while the CTA combines, stores and stages the next q.
  const int items = items_x * items_y * items_z;
  pd_mma::Carry carry{};  // lever 5: what issue_ahead leaves the item's prologue
  // Lever 5: item `at`'s first PREFETCH tiles, this warp's share, its keys [lo, hi) (issue_ahead).
  const auto issue_item = [&](int at, int lo, int hi) {
    const pd_mma::Item it = pd_item(at % items_x, (at / items_x) % items_y, at / (items_x * items_y), items_x,
                                    items_y, num_kv_heads, heads_per_cta);
    pd_mma::issue_ahead(smem, lo, hi, reinterpret_cast<const unsigned char*>(k_cache + it.kv_head * k_stride_head),
                        k_stride_page, k_stride_token,
                        reinterpret_cast<const unsigned char*>(v_cache + it.kv_head * v_stride_head), v_stride_page,
                        v_stride_token, tables.row(it.seq), page_size, carry);
  };
  if (pd_mma::PREFETCH > 0 && (int)blockIdx.x < items) {  // the first item's, before anything else
    const pd_mma::Item it = pd_item(blockIdx.x % items_x, (blockIdx.x / items_x) % items_y,
                                    blockIdx.x / (items_x * items_y), items_x, items_y, num_kv_heads, heads_per_cta);
    const int len = tables.seq_len(it.seq);
    const pd_mma::Rows it_rw{it.heads, q_len, it.heads * q_len, len > 0 ? len : 0, it.split, it.num_splits};
    const pd_mma::Features keys{{window_left}, {cap_log2}, {nullptr}, {}};  // cta_range reads the window only
    int lo, hi;
    pd_mma::cta_range(it_rw, keys, lo, hi);
    issue_item(blockIdx.x, lo, hi);
  }
  for (int at = blockIdx.x; at < items; at += gridDim.x) {
    if (at != (int)blockIdx.x) __syncthreads();  // the previous item's epilogue is done with shared memory
    const pd_mma::Item item = pd_item(at % items_x, (at / items_x) % items_y, at / (items_x * items_y), items_x,
                                      items_y, num_kv_heads, heads_per_cta);
    const int next = at + gridDim.x;
    const bool last_item = next >= items;
    // The next item's length, loaded now so that it lands while this item stages q.
    const int upcoming_len = next < items ? tables.seq_len(pd_item_seq(next, items_x, items_y)) : 0;
    // Split-K: the merge is launched as this grid's programmatic dependent: it may start once
    // every CTA is in its last item (its launch then overlaps this grid's tail) and it waits for
    // this grid's end before it reads the workspace (pd_wait_prior_grids), so where this is
    // called moves only when the merge starts, never what it reads.
    if (PD_ARM == PD_ARM_SPLITK && last_item) pd_release_dependents();
    const int seq = item.seq, head0 = item.head0, heads = item.heads, num_q_heads = item.num_q_heads;
    const int seq_len = tables.seq_len(seq);
    const pd_mma::Rows rw{heads, q_len, heads * q_len, seq_len > 0 ? seq_len : 0, item.split, item.num_splits};
    // The features' values, as their hooks take them (sinks: no offset from a null pointer without the feature)
    const pd_mma::Features f{{window_left}, {cap_log2}, {pd_mma::Sinks::on ? sinks + head0 : nullptr},
                             {k_scales, k_scales_stride, v_scales, v_scales_stride, sm_scale, soft_cap}};
    float item_qk_scale = qk_scale, item_v_scale = v_scale;  // this item's KV head's (device_scales)
    if (pd_mma::DeviceScales::on) f.device_scales.fold(item.kv_head, item_qk_scale, item_v_scale);

    const pd_mma::QRows q_rows{q + seq * q_stride_seq + head0 * q_stride_head, q_stride_token, q_stride_head, heads};
    int next_lo = 0, next_hi = 0;  // the next item's keys, from warm_item (kept: recomputed cost the loop 16 instructions)
    const auto between = [&]() {
      if (next >= items) return;
      // recomputed here, not kept from the loop's top: fewer registers live across stage_q
      const pd_mma::Item upcoming = pd_item(next % items_x, (next / items_x) % items_y, next / (items_x * items_y),
                                            items_x, items_y, num_kv_heads, heads_per_cta);
      const pd_mma::Rows next_rw{upcoming.heads, q_len, upcoming.heads * q_len, upcoming_len > 0 ? upcoming_len : 0,
                                 upcoming.split, upcoming.num_splits};
      const pd_mma::QRows next_q{q + upcoming.seq * q_stride_seq + upcoming.head0 * q_stride_head, q_stride_token,
                                 q_stride_head, upcoming.heads};
      pd_mma::warm_item(next_rw, f, next_q, tables.row(upcoming.seq), page_size, next_lo, next_hi);
    };
    // Lever 5: once a warp has published this item's state, the next item's first tiles. The
    // last item of a CTA issues none: no copy may be outstanding into shared memory at exit.
    const auto ahead = [&]() {
      if (pd_mma::PREFETCH > 0 && next < items) issue_item(next, next_lo, next_hi);
    };
    pd_mma::run_cta(smem, rw, f, q_rows,
                    item_qk_scale, k_cache + item.kv_head * k_stride_head, k_stride_page, k_stride_token,
                    v_cache + item.kv_head * v_stride_head, v_stride_page, v_stride_token, tables.row(seq), page_size,
                    between, carry, ahead);
#if PD_ARM == PD_ARM_SPLITK
    for (int idx = threadIdx.x; idx < rw.rows * PD_HEAD_DIM; idx += pd_mma::THREADS) {
      const int r = idx / PD_HEAD_DIM, d = idx - r * PD_HEAD_DIM;
      float M, L, O;
      pd_mma::cta_combine(smem, r, d, M, L, O);
      const int row = seq * q_len + r / heads, head = head0 + r % heads;
      pd_store_split(pd_split_slot(workspace, row, num_q_heads, head, item.split, item.num_splits), d, M, L, O,
                     item_v_scale);
    }
    (void)out;  // split-K writes states: out, lse and the sinks are the merge's
    (void)lse;
#else
    const long long row0 = (long long)seq * q_len * num_q_heads + head0;  // out[seq, 0, head0]
    pd_mma::store_rows(smem, rw, f, num_q_heads, item_v_scale, lse_scale, out + row0 * PD_HEAD_DIM,
                       lse == nullptr ? nullptr : lse + row0);
    (void)workspace;
#endif
  }
}

#if PD_ARM == PD_ARM_SPLITK
// The split-K merge: grid (num_q_heads, num_seqs * q_len), a thread per output dim (at most
// PD_MERGE_THREADS; kernels.merge_threads); the merge of pd_splitk.cuh, splits 0..n-1 in
// order, then the sink (Sinks::merged).
extern "C" __global__ void PD_LAUNCH_BOUNDS(PD_MERGE_THREADS, 4) decode_splitk_merge(
    const float* __restrict__ workspace, int num_splits, const float* __restrict__ sinks,
    pd_out_t* __restrict__ out, float* __restrict__ lse, float lse_scale) {
  __shared__ unsigned short s_out[PD_HEAD_DIM];
  pd_wait_prior_grids();  // launched as the attention grid's dependent: its states are complete only now
  pd_merge_splits(workspace, num_splits, pd_mma::Sinks::merged(sinks), out, lse, lse_scale, s_out);
}
#endif

#endif  // PD_DECODE_CORE_CUH
