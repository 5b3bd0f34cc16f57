// simt_core.cuh: the "simt" reference implementation (see simt/README.md): its core, an
// online softmax on CUDA cores, each thread owning a slice of the head dim, K and V read
// straight from global memory into registers; and its one attention kernel, written once
// for the three arms (simt_decode_unpacked.cu, simt_decode_splitk.cu,
// simt_decode_gqa_packed.cu each only name the kernel and pick the arm). Only the simt
// kernels include it; what they share with the "mma" kernels is pd_common.cuh's (and
// pd_splitk.cuh's).
//
// What lives here
//   * the hot loop's reading of fp16/fp8 K and V as exact values times a power of two
//     (pd_kv_slice, "KV slices" below) and q's 16-byte slices (pd_load_q),
//   * the online-softmax core `pd_attend<NH, VEC, UNROLL>` (NH = query heads per CTA: 1
//     on the unpacked and split-K arms, PD_GQA on the packed arm), and the warp/CTA
//     combine of its partial states (pd_merge_xor, pd_cta_publish, pd_cta_combine),
//   * THE KERNEL (the last section): the parameter list of the three arms' kernels (their
//     launch ABI), their body, and the split-K merge.
//
// Units: as pd_common.cuh (log2 units, x_t = qk_scale * (q . k_t)). A state
// (m, l, acc) means: m = max_t x_t, l = sum_t 2^(x_t - m), acc[d] = sum_t 2^(x_t - m) *
// v_t[d] (v_t as stored, v_scale applied at the end; inside the loop acc carries an
// extra power-of-two factor for fp16/fp8 KV, see pd_kv_slice).
//
// Defines: PD_HEAD_DIM, PD_Q_DTYPE, PD_KV_DTYPE (pd_common.cuh; no fp8 e5m2: the simt
// kernels refuse it), PD_MIN_KV_PER_SPLIT (pd_splitk.cuh); optional, 0 | 1, the features
// they serve: PD_MULTI_TOKEN, PD_DEVICE_SCALES, PD_CSR (below); from the arm's .cu, before it
// includes this file: PD_ENTRY (the kernel's name), PD_ARM (PD_ARM_UNPACKED |
// PD_ARM_SPLITK | PD_ARM_GQA_PACKED; pd_common.cuh), and on the packed arm PD_GQA and
// PD_HDIM. Static shared memory only, declared by the kernel.
//
// Numerics note: the hot loop's reading of fp16/fp8 K and V as exact values times
// 2^-112 / 2^-120 works on values that can be fp32 denormals; it is exact (resp.
// accurate to ~2^-29 absolute in q.k) only while denormals are preserved (never
// --use_fast_math or -ftz=true).

#ifndef PD_SIMT_CORE_CUH
#define PD_SIMT_CORE_CUH

#include "pd_common.cuh"
#include "pd_splitk.cuh"

// A thread's slice of VEC dims must tile the row in a power-of-two number of lanes (at
// most a warp: at 512 a slice is 16 dims, 32 bytes of a bf16/fp16 row, see THE KERNEL).
#if PD_HEAD_DIM != 64 && PD_HEAD_DIM != 128 && PD_HEAD_DIM != 256 && PD_HEAD_DIM != 512 && PD_HEAD_DIM != 576
#error "the simt kernels take PD_HEAD_DIM 64, 128, 256, 512 or 576 (the mma core takes every multiple of 16 in 64..256)"
#endif

// MLA absorbed (PD_HEAD_DIM 576, PD_V_HEAD_DIM 512): a K row is 512 latent dims, which map to
// the lanes exactly as a 512-wide row does (and are the V row's dims too), then 64 rope dims,
// PD_ROPE_LANE = 2 a lane (dims 512 + 2 lane, 512 + 2 lane + 1: one 4-byte load of bf16/fp16,
// one 2-byte load of fp8), which join the lane's partial dot before the butterfly. Elsewhere
// PD_ROPE_LANE is 0 and none of that code exists.
#if PD_HEAD_DIM != PD_V_HEAD_DIM
#if PD_ARM == PD_ARM_GQA_PACKED
#error "the simt packed arm has no PD_V_HEAD_DIM != PD_HEAD_DIM kernel"
#endif
#define PD_ROPE_LANE ((PD_HEAD_DIM - PD_V_HEAD_DIM) / 32)
#else
#define PD_ROPE_LANE 0
#endif
// PD_V_IN_K (0 | 1, MLA only; the plan sets it where v_cache is k_cache's first PD_V_HEAD_DIM dims:
// the same pointer, dtype and strides): V row t is the latent part of K row t, which the lane
// already holds, so V is not loaded again (the v_cache pointer and strides are passed and unused).
#ifndef PD_V_IN_K
#define PD_V_IN_K 0
#endif
#if PD_V_IN_K && !PD_ROPE_LANE
#error "PD_V_IN_K is MLA's (PD_HEAD_DIM 576, PD_V_HEAD_DIM 512)"
#endif

// The features the simt kernels serve (features.SIMT_FEATURES), each a define 0 | 1 that
// kernels.KernelSpec.defines passes only where a spec has it, in any combination (as the mma
// core's; the packed arm: no multi-token):
//   * PD_MULTI_TOKEN (config.FEATURES' multi_token, passed only for calls of q_len > 1, whose
//     one-token calls take the plain spec): q_len query tokens a sequence (speculative
//     verification, MTP). A CTA serves one query ROW, row = seq * q_len + t, which sees the causal
//     prefix of its own position: keys [0, L - q_len + 1 + t) of its sequence's L (THE KERNEL).
//   * PD_DEVICE_SCALES: the scales read on the device (pd_common.cuh's pd_device_kv_scales).
//   * PD_CSR: FlashInfer's CSR page table (pd_csr_pages / pd_csr_len), which gives L.
// Off, none of their code or parameters exist, so a plain spec is the kernel it was before
// them, byte for byte.
#ifndef PD_MULTI_TOKEN
#define PD_MULTI_TOKEN 0
#endif
#if PD_MULTI_TOKEN && PD_ARM == PD_ARM_GQA_PACKED
#error "the simt packed arm serves one query token (no PD_MULTI_TOKEN)"
#endif
#ifndef PD_DEVICE_SCALES
#define PD_DEVICE_SCALES 0
#endif
#ifndef PD_CSR
#define PD_CSR 0
#endif

#if PD_KV_DTYPE == PD_DTYPE_FP8_E5M2
#error "the simt kernels do not read fp8 e5m2 caches (impl mma does)"
#endif
#if !defined(PD_ENTRY) || !defined(PD_ARM)
#error "define PD_ENTRY (the kernel's name) and PD_ARM (PD_ARM_UNPACKED | _SPLITK | _GQA_PACKED) first"
#endif

// ---------------------------------------------------------------------------------
// KV slices in the hot loop: exact values times a power of two
// ---------------------------------------------------------------------------------
//
// The exact fp16/fp8 conversions of pd_convert.cuh cost ~8 integer operations per
// element, which would make the fp8 loop integer-pipe bound on sm_90 (64 int ops/clk/SM).
// In the hot loop the kernels instead read each K/V element as
//     kv' = kv * 2^-BIAS   (BIAS = 112 for fp16, 120 for fp8; bit-exact, a reinterpretation)
// which takes 2-3 integer operations (shift, arithmetic shift, mask): the fp16 or fp8
// exponent field is placed on fp32's exponent field unchanged, so the value is read with
// bias 127 instead of 15 (fp16, shift 112) or 7 (fp8 e4m3fn, shift 120), and the sign
// lands on bit 31 through the arithmetic shift. Subnormals become fp32 denormals with
// the same scaling, so the mapping is exact for every finite input. Inf/NaN (fp16
// exponent 31, fp8 magnitude 0x7f) would not be: a SWAR test per 32-bit word spots them
// and a rarely taken branch rewrites those elements as inf/NaN.
// The scale is undone where it is cheap:
//   * scores:  x_t = (sum_i q_i k'_i * 2^BIAS) * qk_scale -- one
//     multiply per token; k' * q may be an fp32 denormal, whose absolute rounding error
//     (2^-149 * 2^120 = 2^-29 in q.k units per operation) is negligible in a logit;
//   * values:  acc'' = sum_t (p_t * 2^64) v'_t = acc * 2^(64 - BIAS),
//     p_t <= 1 is scaled up by 2^64 once per token and head so that the products stay
//     normal fp32 numbers (>= 2^-126 unless p_t v_t < 2^-70); the CTA combine multiplies
//     the accumulator back by 2^(BIAS - 64) (exact, a power of two).
// bf16 needs none of this (its fast path is one shift or mask per element, scale 1).
//
// All of this relies on fp32 denormals being preserved (no -ftz=true/--use_fast_math).
#if PD_KV_DTYPE == PD_DTYPE_FP8_E4M3
#define PD_KV_SCALED 1
__device__ __forceinline__ float pd_k_unscale() { return __uint_as_float(0x7b800000u); }    // 2^120
__device__ __forceinline__ float pd_p_scale() { return __uint_as_float(0x5f800000u); }      // 2^64
__device__ __forceinline__ float pd_acc_unscale() { return __uint_as_float(0x5b800000u); }  // 2^56
#elif PD_KV_DTYPE == PD_DTYPE_FP16
#define PD_KV_SCALED 1
__device__ __forceinline__ float pd_k_unscale() { return __uint_as_float(0x77800000u); }    // 2^112
__device__ __forceinline__ float pd_p_scale() { return __uint_as_float(0x5f800000u); }      // 2^64
__device__ __forceinline__ float pd_acc_unscale() { return __uint_as_float(0x57800000u); }  // 2^48
#else
#define PD_KV_SCALED 0
#endif

// The VEC elements of one row slice (NW words), as kv' = kv * 2^-BIAS.
template <int NW, int VEC>
__device__ __forceinline__ void pd_kv_slice(const unsigned (&w)[NW], float (&f)[VEC]) {
#if PD_KV_DTYPE == PD_DTYPE_FP8_E4M3
  static_assert(VEC == 4 * NW, "4 fp8 per word");
  unsigned special = 0u;
  PD_UNROLL
  for (int j = 0; j < NW; ++j) {
    // byte k moved to the top byte, then arithmetic >> 4: sign on bits 31..27, the
    // 4 exponent bits on 26..23 (fp32 exponent field, high bits zero), mantissa 22..20.
    f[4 * j + 0] = __uint_as_float((unsigned)((int)(w[j] << 24) >> 4) & 0x87f00000u);
    f[4 * j + 1] = __uint_as_float((unsigned)((int)(w[j] << 16) >> 4) & 0x87f00000u);
    f[4 * j + 2] = __uint_as_float((unsigned)((int)(w[j] << 8) >> 4) & 0x87f00000u);
    f[4 * j + 3] = __uint_as_float((unsigned)((int)w[j] >> 4) & 0x87f00000u);
    special |= (w[j] & 0x7f7f7f7fu) + 0x01010101u;  // a byte's bit 7 set iff magnitude 0x7f
  }
  if (special & 0x80808080u) {
    PD_UNROLL
    for (int i = 0; i < VEC; ++i)
      if (((w[i >> 2] >> ((i & 3) * 8)) & 0x7fu) == 0x7fu) f[i] = __uint_as_float(0x7fc00000u);  // NaN
  }
#elif PD_KV_DTYPE == PD_DTYPE_FP16
  static_assert(VEC == 2 * NW, "2 fp16 per word");
  unsigned special = 0u;
  PD_UNROLL
  for (int j = 0; j < NW; ++j) {
    // half moved to the top, arithmetic >> 3: sign on bits 31..28, the 5 exponent bits
    // on 27..23, the 10 mantissa bits on 22..13.
    f[2 * j + 0] = __uint_as_float((unsigned)((int)(w[j] << 16) >> 3) & 0x8fffe000u);
    f[2 * j + 1] = __uint_as_float((unsigned)((int)w[j] >> 3) & 0x8fffe000u);
    special |= (w[j] & 0x7c007c00u) + 0x04000400u;  // a half's bit 15 set iff exponent 31
  }
  if (special & 0x80008000u) {
    PD_UNROLL
    for (int i = 0; i < VEC; ++i) {
      const unsigned h = (w[i >> 1] >> ((i & 1) * 16)) & 0xffffu;
      if ((h & 0x7c00u) == 0x7c00u) f[i] = pd_fp16_to_float(h);  // inf or NaN: scale-free
    }
  }
#else
  static_assert(VEC == 2 * NW, "2 bf16 per word");
  PD_UNROLL
  for (int j = 0; j < NW; ++j) {
    f[2 * j + 0] = __uint_as_float(w[j] << 16);
    f[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
  }
#endif
}

// VEC consecutive q elements (VEC a multiple of 8: whole 16-byte chunks) -> fp32.
template <int VEC>
__device__ __forceinline__ void pd_load_q(const pd_q_t* p, float (&qf)[VEC]) {
  static_assert(VEC % 8 == 0, "q slices are whole 16-byte chunks");
  PD_UNROLL
  for (int c = 0; c < VEC / 8; ++c) {
    unsigned w[4];
    pd_load_words(p + c * 8, w);
    PD_UNROLL
    for (int j = 0; j < 8; ++j) qf[c * 8 + j] = pd_q_to_float((w[j >> 1] >> ((j & 1) * 16)) & 0xffffu);
  }
}

// ---------------------------------------------------------------------------------
// The online-softmax core
// ---------------------------------------------------------------------------------
//
// One CTA of PD_THREADS threads attends NH query heads (all reading the same KV head)
// over the tokens [start, end) of one sequence.
//
// Thread mapping: a thread owns VEC consecutive elements of the head dim (its "slice"),
// TPR = D / VEC threads cover a row, a warp covers R = 32 / TPR token rows per load
// instruction. A warp-iteration ("tile") is TILE = R * UNROLL consecutive tokens:
// token base + u * R + row for u in 0..UNROLL-1, so each load instruction reads R
// consecutive tokens' rows, each a contiguous 16*TPR-byte segment. Warps take tiles
// w, w + W, w + 2W, ... (W = PD_WARPS); the trip count depends only on the warp id, so
// it is uniform across the warp and the shuffles inside the loop are converged.
//
// Page lookup: lane i of a warp resolves token base + i of the tile (one division, one
// block-table load) and the UNROLL tokens of each thread are fetched from their lanes
// with __shfl_sync; the lookup of the warp's next tile is issued before this tile's
// K/V loads, so the block-table latency is off the critical path. Block-table entries
// and K/V rows of tokens >= end are never read.
//
// Each thread keeps per head a running state (m, l, acc[VEC]) for its row group (acc
// scaled by a power of two for fp16/fp8 KV, see pd_kv_slice; pd_cta_combine undoes it): the
// lanes of one row hold identical m and l (the score reduction is a xor butterfly,
// whose result is bitwise the same on every lane of the row) and disjoint acc slices.
template <int NH, int VEC, int UNROLL>
__device__ __forceinline__ void pd_attend(
    const float (&q)[NH][VEC],
#if PD_ROPE_LANE
    const float (&q_rope)[NH][2],      // q's dims PD_V_HEAD_DIM + 2 lane, + 1
    const pd_kv_t* __restrict__ k_rope,  // k_cache + kv_head * k_stride_head + PD_V_HEAD_DIM + 2 lane
#endif
    const pd_kv_t* __restrict__ k_lane,  // k_cache + kv_head * k_stride_head + slice * VEC
    long long k_stride_page, long long k_stride_token,
    const pd_kv_t* __restrict__ v_lane,  // v_cache + kv_head * v_stride_head + slice * VEC
    long long v_stride_page, long long v_stride_token,
    const int* __restrict__ bt_row,  // this sequence's block-table row
    int page_size, int start, int end, float qk_scale,
    float (&m)[NH], float (&l)[NH], float (&acc)[NH][VEC]) {
  constexpr int TPR = PD_V_HEAD_DIM / VEC;
  constexpr int R = 32 / TPR;
  constexpr int TILE = R * UNROLL;
  constexpr int NW = VEC * (int)sizeof(pd_kv_t) / 4;  // 32-bit words per row slice
  static_assert(TPR >= 1 && TPR <= 32 && (32 % TPR) == 0, "a row is a power-of-two part of a warp");
  static_assert(NW == 8 || NW == 4 || NW == 2, "row slices are 32-, 16- or 8-byte loads");
  static_assert(TILE <= 32, "one lane resolves one token of the tile");
#if PD_ROPE_LANE
  static_assert(TPR == 32 && PD_ROPE_LANE == 2, "the rope dims take 2 a lane of a whole-warp row");
#endif

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int row = lane / TPR;
  const float neg_inf = pd_neg_inf();

  PD_UNROLL
  for (int h = 0; h < NH; ++h) {
    m[h] = neg_inf;
    l[h] = 0.f;
    PD_UNROLL
    for (int i = 0; i < VEC; ++i) acc[h][i] = 0.f;
  }

  const int n = end > start ? end - start : 0;
  const int num_tiles = (n + TILE - 1) / TILE;

  // Lane-parallel lookup of tile `t`: (page id, token offset in page) of token
  // start + t * TILE + lane, or (0, 0) where that token does not exist.
  int it = warp;
  int pg = 0, ip = 0;
  {
    const int tok = start + it * TILE + lane;
    if (it < num_tiles && lane < TILE && tok < end) {
      const int pi = tok / page_size;
      ip = tok - pi * page_size;
      pg = bt_row[pi];
    }
  }

  for (; it < num_tiles; it += PD_WARPS) {
    const int cur_pg = pg, cur_ip = ip;
    {  // prefetch the next tile's lookup
      const int nit = it + PD_WARPS;
      const int tok = start + nit * TILE + lane;
      pg = 0;
      ip = 0;
      if (nit < num_tiles && lane < TILE && tok < end) {
        const int pi = tok / page_size;
        ip = tok - pi * page_size;
        pg = bt_row[pi];
      }
    }
    const int base = start + it * TILE;

    // Issue all K and V loads of the tile before using any of them.
#if PD_V_IN_K
    unsigned kw[UNROLL][NW];
    unsigned (&vw)[UNROLL][NW] = kw;  // V = K's latent words, already loaded
#else
    unsigned kw[UNROLL][NW], vw[UNROLL][NW];
#endif
#if PD_ROPE_LANE
    unsigned kr[UNROLL];  // the lane's 2 rope elements (fp8: in the low 2 bytes)
#endif
    bool valid[UNROLL];
    PD_UNROLL
    for (int u = 0; u < UNROLL; ++u) {
      const int src = u * R + row;
      const long long p = (long long)__shfl_sync(PD_FULL_MASK, cur_pg, src);
      const long long o = (long long)__shfl_sync(PD_FULL_MASK, cur_ip, src);
      valid[u] = base + src < end;
      if (valid[u]) {
        pd_load_words(k_lane + p * k_stride_page + o * k_stride_token, kw[u]);
#if !PD_V_IN_K
        pd_load_words(v_lane + p * v_stride_page + o * v_stride_token, vw[u]);
#endif
#if PD_ROPE_LANE
#if PD_KV_DTYPE == PD_DTYPE_FP8_E4M3
        kr[u] = *reinterpret_cast<const unsigned short*>(k_rope + p * k_stride_page + o * k_stride_token);
#else
        kr[u] = *reinterpret_cast<const unsigned*>(k_rope + p * k_stride_page + o * k_stride_token);
#endif
#endif
      } else {  // masked token: nothing loaded, zeros (0 bits are +0.0 in every dtype)
        PD_UNROLL
        for (int j = 0; j < NW; ++j) {
          kw[u][j] = 0u;
#if !PD_V_IN_K
          vw[u][j] = 0u;
#endif
        }
#if PD_ROPE_LANE
        kr[u] = 0u;
#endif
      }
    }

    // -- scores: partial dot over the slice, xor-butterfly over the row's TPR lanes
    float s[NH][UNROLL];
    PD_UNROLL
    for (int u = 0; u < UNROLL; ++u) {
      float kf[VEC];  // k * 2^-BIAS
      pd_kv_slice(kw[u], kf);
#if PD_ROPE_LANE
      float kf_rope[4 / (int)sizeof(pd_kv_t)];  // fp8: 4 values, the top 2 from zero bytes (unused)
      {
        const unsigned krw[1] = {kr[u]};
        pd_kv_slice(krw, kf_rope);
      }
#endif
      PD_UNROLL
      for (int h = 0; h < NH; ++h) {
        float d = 0.f;
        PD_UNROLL
        for (int i = 0; i < VEC; ++i) d = fmaf(q[h][i], kf[i], d);
#if PD_ROPE_LANE
        d = fmaf(q_rope[h][0], kf_rope[0], d);
        d = fmaf(q_rope[h][1], kf_rope[1], d);
#endif
        PD_UNROLL
        for (int off = TPR / 2; off >= 1; off >>= 1) d += __shfl_xor_sync(PD_FULL_MASK, d, off);
#if PD_KV_SCALED
        d *= pd_k_unscale();  // exact: undoes the 2^-BIAS of kf
#endif
        s[h][u] = valid[u] ? d * qk_scale : neg_inf;
      }
    }

    // -- update m and l, rescale acc by alpha = 2^(m_old - m_new)
    float p[NH][UNROLL];
    PD_UNROLL
    for (int h = 0; h < NH; ++h) {
      float mx = m[h];
      PD_UNROLL
      for (int u = 0; u < UNROLL; ++u) mx = fmaxf(mx, s[h][u]);
      // Nothing valid seen yet (mx = -inf): subtract 0 instead, so that
      // -inf - -inf = NaN never happens; alpha and every p are then exp2f(-inf) = 0.
      const float ms = (mx == neg_inf) ? 0.f : mx;
      const float alpha = exp2f(m[h] - ms);
      float ls = 0.f;
      PD_UNROLL
      for (int u = 0; u < UNROLL; ++u) {
        p[h][u] = exp2f(s[h][u] - ms);
        ls += p[h][u];
      }
      l[h] = fmaf(l[h], alpha, ls);
      m[h] = mx;
      PD_UNROLL
      for (int i = 0; i < VEC; ++i) acc[h][i] *= alpha;
    }

    // -- acc += p * v, token by token (each V slice converted once for all heads)
    PD_UNROLL
    for (int u = 0; u < UNROLL; ++u) {
      float vf[VEC];  // v * 2^-BIAS
      pd_kv_slice(vw[u], vf);
      PD_UNROLL
      for (int h = 0; h < NH; ++h) {
#if PD_KV_SCALED
        const float pu = p[h][u] * pd_p_scale();  // exact (power of two), keeps p * v' normal
#else
        const float pu = p[h][u];
#endif
        PD_UNROLL
        for (int i = 0; i < VEC; ++i) acc[h][i] = fmaf(pu, vf[i], acc[h][i]);
      }
    }
  }
}

// Merge two states (m, l, acc) of the same head: the one of this lane and the one of
// lane ^ off. Weights 2^(m_i - M); an empty state (m = -inf) gets weight 0 and, with
// both empty, M is replaced by 0 so that -inf - -inf = NaN never happens.
template <int NH, int VEC>
__device__ __forceinline__ void pd_merge_xor(float (&m)[NH], float (&l)[NH], float (&acc)[NH][VEC], int off) {
  const float neg_inf = pd_neg_inf();
  PD_UNROLL
  for (int h = 0; h < NH; ++h) {
    const float mo = __shfl_xor_sync(PD_FULL_MASK, m[h], off);
    const float lo = __shfl_xor_sync(PD_FULL_MASK, l[h], off);
    const float mx = fmaxf(m[h], mo);
    const float ms = (mx == neg_inf) ? 0.f : mx;
    const float a = exp2f(m[h] - ms);
    const float b = exp2f(mo - ms);
    l[h] = fmaf(lo, b, l[h] * a);
    PD_UNROLL
    for (int i = 0; i < VEC; ++i) {
      const float ao = __shfl_xor_sync(PD_FULL_MASK, acc[h][i], off);
      acc[h][i] = fmaf(ao, b, acc[h][i] * a);
    }
    m[h] = mx;
  }
}

// CTA combine, part 1: merge the R row groups of each warp (xor shuffles at distances
// TPR, 2*TPR, .., 16: a fixed pairing), then lanes of row 0 write their warp's state to
// shared memory: s_m[h * W + w], s_l[h * W + w], s_acc[(h * W + w) * D + d].
// Ends with __syncthreads(); every thread of the CTA must call it.
template <int NH, int VEC>
__device__ __forceinline__ void pd_cta_publish(float (&m)[NH], float (&l)[NH], float (&acc)[NH][VEC],
                                               float* s_m, float* s_l, float* s_acc) {
  constexpr int TPR = PD_V_HEAD_DIM / VEC;
  PD_UNROLL
  for (int off = TPR; off < 32; off <<= 1) pd_merge_xor<NH, VEC>(m, l, acc, off);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane < TPR) {
    PD_UNROLL
    for (int h = 0; h < NH; ++h) {
      if (lane == 0) {
        s_m[h * PD_WARPS + warp] = m[h];
        s_l[h * PD_WARPS + warp] = l[h];
      }
      PD_UNROLL
      for (int i = 0; i < VEC; ++i) s_acc[(h * PD_WARPS + warp) * PD_V_HEAD_DIM + lane * VEC + i] = acc[h][i];
    }
  }
  __syncthreads();
}

// CTA combine, part 2: the state of head h, dim d over all warps, in warp order
// 0..W-1. M = max m_w (-inf when the CTA saw no token), L = sum l_w 2^(m_w - M),
// O = sum acc_w[d] 2^(m_w - M). Thread j reading dim j of each warp row: no bank conflict.
__device__ __forceinline__ void pd_cta_combine(const float* s_m, const float* s_l, const float* s_acc,
                                               int h, int d, float& M, float& L, float& O) {
  const float neg_inf = pd_neg_inf();
  float mx = neg_inf;
  PD_UNROLL
  for (int w = 0; w < PD_WARPS; ++w) mx = fmaxf(mx, s_m[h * PD_WARPS + w]);
  const float ms = (mx == neg_inf) ? 0.f : mx;  // all warps empty: avoid -inf - -inf
  float lsum = 0.f, o = 0.f;
  PD_UNROLL
  for (int w = 0; w < PD_WARPS; ++w) {
    const float wt = exp2f(s_m[h * PD_WARPS + w] - ms);  // empty warp: 2^-inf = 0, and l_w = acc_w = 0
    lsum = fmaf(s_l[h * PD_WARPS + w], wt, lsum);
    o = fmaf(s_acc[(h * PD_WARPS + w) * PD_V_HEAD_DIM + d], wt, o);
  }
  M = mx;
  L = lsum;
#if PD_KV_SCALED
  O = o * pd_acc_unscale();  // exact: back from acc'' = acc * 2^(64 - BIAS) to acc
#else
  O = o;
#endif
}

// =======================================================================================
// THE KERNEL
// =======================================================================================
//
// The attention kernel of the three simt arms, written once: its parameter list (the
// launch ABI of every arm: same names, order and types; Python reads it from this text
// with the name the arm's .cu gives PD_ENTRY, the CPU shim from the preprocessed source)
// and its body. Each arm's .cu names the kernel and picks the arm, then includes this
// file (simt_decode_splitk.cu, for one):
//     #define PD_ENTRY simt_decode_splitk   // the extern "C" name (plan.KERNELS)
//     #define PD_ARM PD_ARM_SPLITK          // PD_ARM_UNPACKED | PD_ARM_SPLITK | PD_ARM_GQA_PACKED
// An arm takes and ignores what it has no use for: split-K writes the workspace and not
// out / lse (its merge does, below), the others the reverse.
//
// Computes, for sequence s and query head h (kv head g = h / (num_q_heads / num_kv_heads)):
//   x_t   = qk_scale * (q[s, h] . k_t)                 t < seq_lens[s]   (log2 units)
//   out   = v_scale * sum_t 2^(x_t - m) v_t / sum_t 2^(x_t - m),   m = max_t x_t
//   lse   = (m + log2 l) * lse_scale: the natural log (lse_scale = ln 2) or base 2 (1); optional
// where k_t, v_t are row t of the sequence's paged cache: page block_tables[s, t / page_size],
// offset in page t % page_size. seq_len 0 gives out = 0 and lse = -inf. With csr the length
// and the page ids come from the CSR table instead (pd_csr_len, pd_csr_pages), with
// device_scales qk_scale and v_scale from KV head g's device scales (pd_device_kv_scales);
// the features' parameters follow lse_scale, each feature's in its #if block (multi_token's,
// device_scales', csr's: the order of config.FEATURES). Split-K writes,
// instead of out and lse, the state of each (sequence, head) over its split of the keys
// to the workspace (pd_splitk.cuh), and its merge combines them.
//
// Multi-token (PD_MULTI_TOKEN, unpacked and split-K arms): q_len query tokens a sequence, each
// a row of its own, row = s * q_len + i (the grid's sequences axis holds num_seqs * q_len rows,
// seq-major): token i computes the above over t < max(L - q_len + 1 + i, 0), L = seq_lens[s]
// (with csr, pd_csr_len's), its causal prefix (that count is what split-K splits, so a token's bytes are a one-token
// call's on its prefix), and writes row `row` of out, lse and the workspace; the merge is
// unchanged (it already indexes rows). A row that sees no key (L < q_len - i) is empty:
// out 0, lse -inf, every split slot the empty state.
//
// Grid: the arm's (see its .cu); block PD_THREADS (4 warps). A CTA serves NH query heads
// of one sequence (one, or on the packed arm the PD_GQA heads of one KV head, whose K and
// V rows it then reads once for all of them). Within the CTA each thread owns VEC
// consecutive dims of the head (its slice), PD_HEAD_DIM / VEC threads cover a token row,
// warps interleave over tiles of UNROLL * (32 * VEC / D) tokens (pd_attend); the 4 warp states
// are combined through static shared memory in warp order and the output rows leave as
// 16-byte stores.
//
// Layout: q [num_seqs, (q_len,) num_q_heads, D] and the caches addressed only through strides
// (elements; q's token stride is a parameter of the multi-token kernels only): NHD [pages,
// page_size, kv_heads, D] and HND [pages, kv_heads, page_size, D] are both (stride_page,
// stride_token, stride_head) triples; the last dim is contiguous. out [num_seqs, (q_len,)
// num_q_heads, D] contiguous, lse [num_seqs, (q_len,) num_q_heads] fp32 or null, workspace
// [num_seqs * q_len, num_q_heads, num_splits, D + 2] fp32 (split-K only).

#if PD_ARM == PD_ARM_GQA_PACKED
#define PD_SIMT_MIN_CTAS 2  // ~190-240 registers (6 q vectors and accumulators): 2 CTAs per SM
#else
#define PD_SIMT_MIN_CTAS 4
#endif

extern "C" __global__ void PD_LAUNCH_BOUNDS(PD_THREADS, PD_SIMT_MIN_CTAS) PD_ENTRY(
    const pd_q_t* __restrict__ q, long long q_stride_seq, long long q_stride_head,
    const pd_kv_t* __restrict__ k_cache, long long k_stride_page, long long k_stride_token,
    long long k_stride_head,
    const pd_kv_t* __restrict__ v_cache, long long v_stride_page, long long v_stride_token,
    long long v_stride_head,
    const int* __restrict__ block_tables, long long block_tables_stride,
    const int* __restrict__ seq_lens,
    int num_kv_heads, int page_size,
    float qk_scale, float v_scale,
    pd_q_t* __restrict__ out, float* __restrict__ lse, float* __restrict__ workspace, float lse_scale
#if PD_MULTI_TOKEN
    // multi_token (the plain kernels have neither): q's token stride (elements), tokens a sequence
    , long long q_stride_token, int q_len
#endif
#if PD_DEVICE_SCALES
    // device_scales: fp32 scales on the device, folded with sm_scale here (qk_scale, v_scale unused)
    , const float* __restrict__ k_scales, long long k_scales_stride, const float* __restrict__ v_scales,
    long long v_scales_stride, double sm_scale
#endif
#if PD_CSR
    // csr: FlashInfer's page table in place of block_tables and seq_lens (both null)
    , const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices, const int* __restrict__ kv_last_page_len
#endif
    ) {
#if PD_ARM == PD_ARM_GQA_PACKED
  constexpr int NH = PD_GQA;  // the PD_GQA query heads of one KV head
  constexpr int VEC = 8;      // 8 dims a thread whatever the dtype (fp8: 8-byte loads): NH q vectors and
                              // accumulators of 8 floats stay in registers
#else
  constexpr int NH = 1;
  // 16-byte loads: a slice of 16 / sizeof(kv) dims, as long as a row takes at most a warp's
  // 32 slices; a wider row (bf16/fp16 at head dim 512: 64 slices of 8) gives each thread
  // D / 32 dims instead (two 16-byte loads: VEC 16, 32 bytes) and 2 tokens a tile instead of
  // 4 (UNROLL 2), so a warp keeps the same 4 KB of K/V loads in flight and a thread the same
  // 32 K/V words in registers (84..123 registers at 512, no spills, on every target).
  // (MLA's 576-wide keys: the slice of the 512 latent dims, which are also the values', and 2 rope
  // dims a lane besides: PD_ROPE_LANE.)
  constexpr int VEC = PD_V_HEAD_DIM / 32 > 16 / (int)sizeof(pd_kv_t) ? PD_V_HEAD_DIM / 32 : 16 / (int)sizeof(pd_kv_t);
#endif
  constexpr int UNROLL = VEC * (int)sizeof(pd_kv_t) > 16 ? 2 : 4;  // 32-byte slices: 2, else 4

  __shared__ float s_m[NH * PD_WARPS];
  __shared__ float s_l[NH * PD_WARPS];
  __shared__ float s_acc[NH * PD_WARPS * PD_V_HEAD_DIM];
#if PD_ARM != PD_ARM_SPLITK
  __shared__ unsigned short s_out[NH * PD_V_HEAD_DIM];
#endif

#if PD_ARM == PD_ARM_GQA_PACKED
  const int kv_head = blockIdx.x;
  const int seq = blockIdx.y;
  const int num_q_heads = num_kv_heads * PD_GQA;
  const int head0 = kv_head * PD_GQA;
#else
  const int head0 = blockIdx.x;  // the CTA's one head
#if PD_ARM == PD_ARM_SPLITK
  const int split = blockIdx.y;
#if PD_MULTI_TOKEN
  const int row = blockIdx.z;  // query token `token` of sequence `seq` (rows are seq-major)
#else
  const int seq = blockIdx.z;
#endif
  const int num_q_heads = gridDim.x;
  const int num_splits = gridDim.y;
#else
#if PD_MULTI_TOKEN
  const int row = blockIdx.y;
#else
  const int seq = blockIdx.y;
#endif
  const int num_q_heads = gridDim.x;
#endif
  const int kv_head = head0 / (num_q_heads / num_kv_heads);
#endif
#if PD_MULTI_TOKEN
  const int seq = row / q_len;
  const int token = row - seq * q_len;
  q += token * q_stride_token;  // the token's q rows; every other index below takes the row
#else
  const int row = seq;  // the CTA's row of out, lse and the workspace: its sequence
#endif
  const int slice = (threadIdx.x & 31) % (PD_V_HEAD_DIM / VEC);
#if PD_CSR
  int seq_len = pd_csr_len(kv_indptr, kv_last_page_len, seq, page_size);
  const int* bt_row = pd_csr_pages(kv_indptr, kv_indices, seq);
#else
  int seq_len = seq_lens[seq];
  const int* bt_row = block_tables + seq * block_tables_stride;
#endif
  seq_len = seq_len > 0 ? seq_len : 0;  // L: the sequence's length (csr: from its CSR row)
#if PD_MULTI_TOKEN
  // The row's keys: positions below L - q_len + 1 + token (its own included), causal within the
  // new tokens; none where the sequence is shorter than that (the row is then empty: m = -inf,
  // l = 0, so out 0 and lse -inf, and every split-K slot of it the empty state). From here on
  // seq_len is the row's key count, so the split rule tiles the row's own keys (as the mma
  // core's row_range), never the batch's or the other rows'.
  seq_len = seq_len - q_len + 1 + token;
  seq_len = seq_len > 0 ? seq_len : 0;
#endif
#if PD_ARM == PD_ARM_SPLITK
  int start, end;  // this split's keys
  pd_split_range(seq_len, split, num_splits, start, end);
#else
  const int start = 0, end = seq_len;
#endif

  float qf[NH][VEC];
  PD_UNROLL
  for (int j = 0; j < NH; ++j)
    pd_load_q<VEC>(q + seq * q_stride_seq + (head0 + j) * q_stride_head + slice * VEC, qf[j]);

#if PD_ROPE_LANE
  float qr[NH][2];
  PD_UNROLL
  for (int j = 0; j < NH; ++j) {
    const unsigned w = *reinterpret_cast<const unsigned*>(q + seq * q_stride_seq + (head0 + j) * q_stride_head +
                                                          PD_V_HEAD_DIM + 2 * (threadIdx.x & 31));
    qr[j][0] = pd_q_to_float(w & 0xffffu);
    qr[j][1] = pd_q_to_float(w >> 16);
  }
#endif

#if PD_DEVICE_SCALES
  pd_device_kv_scales(k_scales, k_scales_stride, v_scales, v_scales_stride, sm_scale, false, 0.0, kv_head, qk_scale,
                      v_scale);  // this CTA's KV head's (no soft-cap on simt)
#endif
  float m[NH], l[NH], acc[NH][VEC];
  pd_attend<NH, VEC, UNROLL>(qf,
#if PD_ROPE_LANE
                             qr, k_cache + kv_head * k_stride_head + PD_V_HEAD_DIM + 2 * (threadIdx.x & 31),
#endif
                             k_cache + kv_head * k_stride_head + slice * VEC, k_stride_page, k_stride_token,
                             v_cache + kv_head * v_stride_head + slice * VEC, v_stride_page, v_stride_token,
                             bt_row, page_size, start, end, qk_scale, m, l, acc);
  pd_cta_publish<NH, VEC>(m, l, acc, s_m, s_l, s_acc);

#if PD_ARM == PD_ARM_SPLITK
  float* slot = pd_split_slot(workspace, row, num_q_heads, head0, split, num_splits);
  for (int d = threadIdx.x; d < PD_V_HEAD_DIM; d += PD_THREADS) {
    float M, L, O;
    pd_cta_combine(s_m, s_l, s_acc, 0, d, M, L, O);
    pd_store_split(slot, d, M, L, O, v_scale);
  }
  (void)out;
  (void)lse;
#else
  for (int idx = threadIdx.x; idx < NH * PD_V_HEAD_DIM; idx += PD_THREADS) {
    const int j = NH == 1 ? 0 : idx / PD_V_HEAD_DIM;  // the CTA's head j (one head: 0, no division), dim d
    const int d = idx - j * PD_V_HEAD_DIM;
    float M, L, O;
    pd_cta_combine(s_m, s_l, s_acc, j, d, M, L, O);
    // L >= 1 whenever a token was seen (the max token contributes 2^0); L == 0: zeros.
    s_out[idx] = (unsigned short)pd_float_to_q(pd_normalize(O, L, v_scale));
    if (d == 0 && lse != nullptr) lse[(long long)row * num_q_heads + head0 + j] = pd_lse(M, L, lse_scale);
  }
  __syncthreads();
  pd_store_span(out + ((long long)row * num_q_heads + head0) * PD_V_HEAD_DIM, s_out, NH * PD_V_HEAD_DIM);
  (void)workspace;
#endif
}

#if PD_ARM == PD_ARM_SPLITK
// The split-K merge: grid (num_q_heads, num_seqs * q_len), a thread per output dim (at most
// PD_MERGE_THREADS; kernels.merge_threads); the merge of pd_splitk.cuh, splits 0..n-1 in
// order (no sinks: the simt kernels serve none; their features, multi_token, csr and
// device_scales, are the attention kernel's alone: rows are the merge's unit already and v_scale
// is in each split's state).
extern "C" __global__ void PD_LAUNCH_BOUNDS(PD_MERGE_THREADS, 4) simt_decode_splitk_merge(
    const float* __restrict__ workspace, int num_splits, pd_q_t* __restrict__ out, float* __restrict__ lse,
    float lse_scale) {
  __shared__ unsigned short s_out[PD_V_HEAD_DIM];
  pd_merge_splits(workspace, num_splits, (const float*)nullptr, out, lse, lse_scale, s_out);
}
#endif

#endif  // PD_SIMT_CORE_CUH
