// decode_core.cuh: the "mma" implementation: the tensor-core decode core, its features,
// and its one attention kernel, written once for the three arms (decode_unpacked.cu,
// decode_splitk.cu, decode_gqa_packed.cu each only name the kernel and pick the arm).
//
// This file is the entry: the overview below, and the sections, included in order (each
// header's first lines say what it owns):
//   mma_layout.cuh    the constants, the shared-memory carve, what a CTA serves (Rows)
//   mma_features.cuh  THE FEATURES (one struct each, with the hooks the core calls), the
//                     keys of a row
//   mma_stream.cuh    the K/V stream: one warp's producer of its tiles into its ring
//   mma_attend.cuh    Q staging, the MMA operands, attend (the plain algorithm, calling
//                     the hooks)
//   mma_combine.cuh   a CTA's item end to end, the warp combine and the outputs
//   mma_kernel.cuh    THE KERNEL (its parameter list, the launch ABI of every arm; the
//                     schedule), with the split-K merge
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
// The features (config.FEATURES) live in mma_features.cuh, each a struct named after it
// with hooks of one vocabulary the core calls (after FlashInfer's attention/variants.cuh:
// first_key, logits_mask, logits_transform, output_transform, ...); that section's opening
// comment lists the features and the hooks. A feature's define is PD_<NAME> (0 or 1, from
// Python), and the core calls its hooks only where it is 1 (`Feature::on ? hook : plain`,
// folded at compile time), so the plain spec compiles none of the feature. A feature's
// runtime value is a parameter of the kernel (mma_kernel.cuh), carried to its hook in
// `Features`. docs/adding-a-kernel-feature.md walks through adding one.
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
//                             item's epilogue (tiling.prefetch_stages; issue_ahead)
//   PD_SMEM_BYTES             the dynamic shared memory the launch gives; must equal
//                             pd_mma::SMEM_BYTES (checked at compile time), so the host's
//                             sizing and this carve cannot drift apart.
//   PD_MIN_KV_PER_SPLIT       the split rule's floor (pd_splitk.cuh)
//   PD_<NAME>      0 | 1      each feature of config.FEATURES (mma_features.cuh)
// and from the arm's .cu, before it includes this file: PD_ENTRY (the kernel's name),
// PD_ARM (PD_ARM_UNPACKED | PD_ARM_SPLITK | PD_ARM_GQA_PACKED; pd_common.cuh), and on the
// packed arm PD_GQA and PD_HDIM.
//
// Performance notes: benchmarks/NOTES.md, and the static SASS report of
// `python -m benchmarks.sass_model`.
//
// Numerics: fp32 denormals must be preserved (never -ftz=true / --use_fast_math), as for
// pd_common.cuh. bf16 V with |v| < 2^-100 can give products that are fp32 denormals; the
// CPU emulation keeps them, a tensor core may flush them (see benchmarks/NOTES.md).

#ifndef PD_DECODE_CORE_CUH
#define PD_DECODE_CORE_CUH

#include "mma_layout.cuh"
#include "mma_features.cuh"
#include "mma_stream.cuh"
#include "mma_attend.cuh"
#include "mma_combine.cuh"
#include "mma_kernel.cuh"

#endif  // PD_DECODE_CORE_CUH
