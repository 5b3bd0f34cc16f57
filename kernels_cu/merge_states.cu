// merge_states.cu: merge two attention states of the same queries over disjoint key sets
// (cascade / shared-prefix attention: a prefix attended once, each suffix apart).
//
// A state is (v, s): v[D] the normalized output, s the NATURAL-log sum of exponentials
// of its logits (the lse DecodeAttention returns). For each row (query token x head):
//   M = max(s_a, s_b);  w_a = e^(s_a - M), w_b = e^(s_b - M);  W = w_a + w_b
//   v = (w_a v_a + w_b v_b) / W   (a first, then b: one fixed order, deterministic)
//   s = M + ln W
// An empty state (s = -inf) has weight 0 whatever its v; two empty states give v = 0,
// s = -inf (M = -inf is replaced by 0 before any subtraction: -inf - -inf never
// happens). max() drops a NaN s of one side, as FlashInfer's merge does.
//
// Grid (rows), block PD_STATE_THREADS; row r reads v_a/v_b[r * head_dim ..] and s_a/s_b[r]
// (rows contiguous, head_dim a multiple of 8) and writes v[r * head_dim ..], s[r].
// Defines: PD_IN_DTYPE, PD_OUT_DTYPE: PD_DTYPE_BF16 (0) | PD_DTYPE_FP16 (1) | PD_DTYPE_FP32 (4).

#include "pd_convert.cuh"

#define PD_STATE_THREADS 128

#if PD_IN_DTYPE == PD_DTYPE_FP32
typedef float pd_in_t;
#else
typedef unsigned short pd_in_t;
#endif
#if PD_OUT_DTYPE == PD_DTYPE_FP32
typedef float pd_state_out_t;
#else
typedef unsigned short pd_state_out_t;
#endif

__device__ __forceinline__ float pd_state_in(pd_in_t x) {
#if PD_IN_DTYPE == PD_DTYPE_FP32
  return x;
#elif PD_IN_DTYPE == PD_DTYPE_BF16
  return pd_bf16_to_float(x);
#else
  return pd_fp16_to_float(x);
#endif
}

__device__ __forceinline__ pd_state_out_t pd_state_out(float x) {
#if PD_OUT_DTYPE == PD_DTYPE_FP32
  return x;
#elif PD_OUT_DTYPE == PD_DTYPE_BF16
  return (unsigned short)pd_float_to_bf16(x);
#else
  return (unsigned short)pd_float_to_fp16(x);
#endif
}

extern "C" __global__ void PD_LAUNCH_BOUNDS(PD_STATE_THREADS, 4) merge_states(
    const pd_in_t* __restrict__ v_a, const float* __restrict__ s_a,
    const pd_in_t* __restrict__ v_b, const float* __restrict__ s_b,
    pd_state_out_t* __restrict__ v, float* __restrict__ s, int head_dim) {
  const long long row = blockIdx.x;
  const float neg_inf = pd_neg_inf();
  const float sa = s_a[row], sb = s_b[row];
  const float mx = fmaxf(sa, sb);
  const float ms = mx == neg_inf ? 0.f : mx;
  const float wa = expf(sa - ms), wb = expf(sb - ms);  // an empty side: e^-inf = 0
  const float W = wa + wb;
  for (int d = threadIdx.x; d < head_dim; d += PD_STATE_THREADS) {
    const long long at = row * head_dim + d;
    // An empty side's v is never read (it may be anything, NaN included: 0 * NaN = NaN);
    // both empty: v = 0.
    const float ta = wa != 0.f ? wa * pd_state_in(v_a[at]) : 0.f;
    const float merged = W != 0.f ? (wb != 0.f ? fmaf(wb, pd_state_in(v_b[at]), ta) : ta) / W : 0.f;
    v[at] = pd_state_out(merged);
  }
  if (threadIdx.x == 0) s[row] = W != 0.f ? ms + logf(W) : neg_inf;
}
