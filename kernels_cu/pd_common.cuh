// pd_common.cuh: what both attention implementations share: the "mma" tensor-core kernel
// (decode_core.cuh) and the "simt" reference kernel (simt/simt_core.cuh), and the split-K
// pieces of pd_splitk.cuh that serve both.
//
// What lives here
//   * the required compile-time defines (checked with #error), the block sizes, the arm
//     codes (PD_ARM_*) and the storage types of q/out and K/V; the dtype codes and the
//     exact bf16 / fp16 / fp8 <-> fp32 conversions are pd_convert.cuh's,
//   * q's conversions to and from fp32, 16-byte (or 8-byte) vector loads,
//   * what turns a finished state into outputs: its natural-log lse, its normalized
//     output, and the 16-byte stores of an output span staged in shared memory,
//   * the code of the features both cores serve (csr, device_scales): each core's hook
//     (mma_features.cuh's Csr and DeviceScales, the simt kernel's) calls it, so the rule is
//     written once.
// Each implementation's own core lives with it: decode_core.cuh (mma), simt/simt_core.cuh.
//
// Units: every logit inside the kernels is in log2 units, x_t = qk_scale * (q . k_t)
// with qk_scale = sm_scale * k_scale * log2(e) folded by the host (the parameter
// qk_scale of both implementations' kernels), so the softmax uses exp2f. A state
// (M, L, O) means: M = max_t x_t, L = sum_t 2^(x_t - M), O[d] = sum_t 2^(x_t - M) * v_t[d]
// (v_t as stored, v_scale applied at the end).
//
// Defines (all required, given by Python as -D):
//   PD_HEAD_DIM  a multiple of 16 in 64 .. 256 (the mma core, which checks it), or 512 (the simt
//                kernels alone: 64 | 128 | 256 | 512)
//   PD_V_HEAD_DIM  optional, default PD_HEAD_DIM: the value (and output) width; 512 at
//                PD_HEAD_DIM 576 (MLA absorbed, the simt kernels only)
//   PD_Q_DTYPE   PD_DTYPE_BF16 (0) | PD_DTYPE_FP16 (1)            (q and out)
//   PD_KV_DTYPE  PD_DTYPE_BF16 (0) | PD_DTYPE_FP16 (1) | PD_DTYPE_FP8_E4M3 (2) |
//                PD_DTYPE_FP8_E5M2 (3, the tensor-core kernels only)
// Defined here and read back by Python as plain `#define NAME <int>` lines:
//   PD_THREADS (attention kernels' block size), PD_MERGE_THREADS (the merge kernels' largest
//   block: the launch bounds; kernels.merge_threads launches a thread per output dim).
//
// Dialect: no system headers, no cuda_bf16.h / cuda_fp16.h, warp intrinsics only in
// warp-converged code with the full mask, no atomics, every reduction in a fixed order.
//
// Numerics note: the fp16 and fp8 -> fp32 conversions work on values that can be fp32
// denormals and are exact only while denormals are preserved (NVRTC/nvcc default; both
// cores rely on it too), so never compile these sources with --use_fast_math or -ftz=true.

#ifndef PD_COMMON_CUH
#define PD_COMMON_CUH

#include "pd_convert.cuh"

#define PD_THREADS 128
// A merge thread per output dim up to head dim 256: a thread computing two dims in turn
// waits for the workspace twice as long (benchmarks/NOTES.md, "The merge at 256 threads").
#define PD_MERGE_THREADS 256


#ifndef PD_HEAD_DIM
#error "PD_HEAD_DIM must be defined (-DPD_HEAD_DIM=64..256, a multiple of 16, or 512)"
#endif
#ifndef PD_Q_DTYPE
#error "PD_Q_DTYPE must be defined (-DPD_Q_DTYPE=0 bf16 | 1 fp16)"
#endif
#ifndef PD_KV_DTYPE
#error "PD_KV_DTYPE must be defined (-DPD_KV_DTYPE=0 bf16 | 1 fp16 | 2 fp8_e4m3)"
#endif
#ifndef PD_V_HEAD_DIM
#define PD_V_HEAD_DIM PD_HEAD_DIM  // values as wide as keys, unless MLA's (576, 512)
#endif
#if (PD_HEAD_DIM < 64 || PD_HEAD_DIM > 256 || PD_HEAD_DIM % 16 != 0) && PD_HEAD_DIM != 512 && PD_HEAD_DIM != 576
#error "PD_HEAD_DIM must be a multiple of 16 in 64..256, or 512 or 576 (the simt kernels only)"
#endif
#if PD_V_HEAD_DIM != PD_HEAD_DIM && !(PD_HEAD_DIM == 576 && PD_V_HEAD_DIM == 512)
#error "PD_V_HEAD_DIM must be PD_HEAD_DIM, or 512 at PD_HEAD_DIM 576 (MLA absorbed)"
#endif
#if PD_HEAD_DIM == 576 && PD_V_HEAD_DIM != 512
#error "PD_HEAD_DIM 576 takes PD_V_HEAD_DIM 512 (MLA absorbed: 512 latent + 64 rope dims)"
#endif
#if PD_Q_DTYPE != PD_DTYPE_BF16 && PD_Q_DTYPE != PD_DTYPE_FP16
#error "PD_Q_DTYPE must be PD_DTYPE_BF16 (0) or PD_DTYPE_FP16 (1)"
#endif
#if PD_KV_DTYPE != PD_DTYPE_BF16 && PD_KV_DTYPE != PD_DTYPE_FP16 && PD_KV_DTYPE != PD_DTYPE_FP8_E4M3 && \
    PD_KV_DTYPE != PD_DTYPE_FP8_E5M2
#error "PD_KV_DTYPE must be PD_DTYPE_BF16 (0), PD_DTYPE_FP16 (1), PD_DTYPE_FP8_E4M3 (2) or PD_DTYPE_FP8_E5M2 (3)"
#endif

#if (PD_THREADS % 32) != 0 || (PD_MERGE_THREADS % 32) != 0
#error "block sizes must be whole warps"
#endif
#define PD_WARPS (PD_THREADS / 32)

// The three arms. An arm's .cu names its kernel (#define PD_ENTRY ...) and picks its arm
// (#define PD_ARM ...) before it includes its implementation's core (decode_core.cuh,
// simt/simt_core.cuh), whose one attention kernel serves them all.
#define PD_ARM_UNPACKED 0
#define PD_ARM_SPLITK 1
#define PD_ARM_GQA_PACKED 2
#ifdef PD_ARM  // (the tests' toy kernels include these headers without an arm)
#if PD_ARM != PD_ARM_UNPACKED && PD_ARM != PD_ARM_SPLITK && PD_ARM != PD_ARM_GQA_PACKED
#error "PD_ARM must be PD_ARM_UNPACKED, PD_ARM_SPLITK or PD_ARM_GQA_PACKED"
#endif
#if PD_ARM == PD_ARM_GQA_PACKED && !defined(PD_GQA)
#error "the packed arm's .cu defines PD_GQA, the heads of one CTA"
#endif
#endif


// Storage types: 16-bit floats and fp8 travel as raw bits.
typedef unsigned short pd_q_t;  // q and out: bf16 or fp16 bits
#if PD_KV_DTYPE == PD_DTYPE_FP8_E4M3 || PD_KV_DTYPE == PD_DTYPE_FP8_E5M2
typedef unsigned char pd_kv_t;  // fp8 e4m3fn / e5m2 bits
#else
typedef unsigned short pd_kv_t;  // bf16 or fp16 bits
#endif


__device__ __forceinline__ float pd_q_to_float(unsigned bits) {
#if PD_Q_DTYPE == PD_DTYPE_BF16
  return pd_bf16_to_float(bits);
#else
  return pd_fp16_to_float(bits);
#endif
}

__device__ __forceinline__ unsigned pd_float_to_q(float f) {
#if PD_Q_DTYPE == PD_DTYPE_BF16
  return pd_float_to_bf16(f);
#else
  return pd_float_to_fp16(f);
#endif
}

// ---------------------------------------------------------------------------------
// Vector loads (the caller guarantees 16-byte, resp. 8-byte, alignment)
// ---------------------------------------------------------------------------------

__device__ __forceinline__ void pd_load_words(const void* p, unsigned (&w)[4]) {
  const uint4 t = *reinterpret_cast<const uint4*>(p);
  w[0] = t.x; w[1] = t.y; w[2] = t.z; w[3] = t.w;
}

__device__ __forceinline__ void pd_load_words(const void* p, unsigned (&w)[2]) {
  const uint2 t = *reinterpret_cast<const uint2*>(p);
  w[0] = t.x; w[1] = t.y;
}

__device__ __forceinline__ void pd_load_words(const void* p, unsigned (&w)[8]) {  // two 16-byte loads
  const uint4 a = reinterpret_cast<const uint4*>(p)[0];
  const uint4 b = reinterpret_cast<const uint4*>(p)[1];
  w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
  w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
}

// ---------------------------------------------------------------------------------
// From a state to outputs
// ---------------------------------------------------------------------------------

// LSE of a state in the caller's base: (m + log2 l) * lse_scale, -inf when empty, with
// lse_scale = PD_LN2 for the natural log, ln(sum_t e^(s_t)) (the host passes fp32 ln 2, the
// same value), or 1 for base 2 (FlashInfer's states: the kernels' own log2 units, exactly).
// Empty means L == 0 exactly (no token: every weight was 2^-inf = 0). Testing L != 0
// rather than L > 0 or M != -inf lets a NaN input (L = NaN) come out as NaN, as in
// the reference, instead of being mistaken for an empty state.
__device__ __forceinline__ float pd_lse(float M, float L, float lse_scale) {
  return (L != 0.f) ? (M + log2f(L)) * lse_scale : pd_neg_inf();
}

// Normalized output of a state: v_scale * O / L, 0 for an empty state (L == 0, see pd_lse).
__device__ __forceinline__ float pd_normalize(float O, float L, float v_scale) {
  return (L != 0.f) ? O * (v_scale / L) : 0.f;
}

// Copy n output elements (n a multiple of 8) staged in shared memory to global memory,
// 16 bytes per thread-store when dst is 16-byte aligned, element by element otherwise.
// Every thread of the CTA calls it (after the __syncthreads that completes s_src).
__device__ __forceinline__ void pd_store_span(pd_q_t* dst, const unsigned short* s_src, int n) {
  if ((((unsigned long long)dst) & 15ull) == 0ull) {
    for (int c = threadIdx.x; c < n / 8; c += blockDim.x) {
      const unsigned short* e = s_src + c * 8;
      uint4 v;
      v.x = (unsigned)e[0] | ((unsigned)e[1] << 16);
      v.y = (unsigned)e[2] | ((unsigned)e[3] << 16);
      v.z = (unsigned)e[4] | ((unsigned)e[5] << 16);
      v.w = (unsigned)e[6] | ((unsigned)e[7] << 16);
      *reinterpret_cast<uint4*>(dst + c * 8) = v;
    }
  } else {
    for (int c = threadIdx.x; c < n; c += blockDim.x) dst[c] = s_src[c];
  }
}

// ---------------------------------------------------------------------------------
// The features both cores serve (csr, device_scales; config.FEATURES)
// ---------------------------------------------------------------------------------
//
// Plain functions of the feature's kernel parameters: each core calls them where its feature
// is on (the mma core through its hooks, Csr::kv_pages / kv_len and DeviceScales::kv_scales;
// the simt kernel under its features' defines), and nothing where it is off.

// csr: FlashInfer's CSR page table, read as it is (no conversion to a dense table): sequence
// seq's pages are indices[indptr[seq] .. indptr[seq + 1]) in order, and its last page holds
// last_page_len[seq] tokens. Sequence seq's page ids:
__device__ __forceinline__ const int* pd_csr_pages(const int* indptr, const int* indices, int seq) {
  return indices + indptr[seq];
}
// Its length in tokens: (pages - 1) * page_size + the last page's count, or 0 with no page. The
// last page's count is clamped to 0 .. page_size, so a CTA never reads past the sequence's own
// pages whatever the table holds (validation.dense_pages refuses such a table on the host).
__device__ __forceinline__ int pd_csr_len(const int* indptr, const int* last_page_len, int seq, int page_size) {
  const int pages = indptr[seq + 1] - indptr[seq];
  int last = last_page_len[seq];
  last = last < 0 ? 0 : (last > page_size ? page_size : last);
  return pages > 0 ? (pages - 1) * page_size + last : 0;
}

// device_scales: the fp32 dequantization scales on the device, one for the tensor (stride 0)
// or one per KV head (stride 1), read for KV head kv_head, so a captured CUDA graph follows a
// scale that changes and nothing syncs to read one. Folded exactly as the host folds host
// floats (validation.scales and logit_scales): in double, sm_scale * k_scale * log2 e (with the
// soft-cap, `soft_capped`: sm_scale * k_scale / cap), then one rounding to fp32; equal values
// give equal bytes.
__device__ __forceinline__ void pd_device_kv_scales(const float* k, long long k_stride, const float* v,
                                                    long long v_stride, double sm_scale, bool soft_capped,
                                                    double soft_cap, int kv_head, float& qk_scale, float& v_scale) {
  const double folded = sm_scale * (double)k[kv_head * k_stride];
  qk_scale = (float)(soft_capped ? folded / soft_cap : folded * PD_LOG2E);  // as the host folds it
  v_scale = v[kv_head * v_stride];
}

#endif  // PD_COMMON_CUH
