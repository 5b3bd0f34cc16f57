// pd_splitk.cuh: what every split-K arm shares, whatever its core: the token range of a
// split, the workspace slot a CTA writes, and the merge of the splits.
//
// A split's range comes from the sequence's own length L only (never from the batch),
// floored at PD_MIN_KV_PER_SPLIT (the policy's constant, passed by Python):
//   chunk = max(ceil(L / num_splits), PD_MIN_KV_PER_SPLIT),
//   split i covers [i * chunk, min((i + 1) * chunk, L))   (possibly empty).
// Slot ((seq * num_q_heads) + head) * num_splits + split of the workspace holds
// PD_HEAD_DIM + 2 fp32 values: o[D] (normalized within the split, v_scale included), then
// m = max_t x_t (log2 units), then l = sum_t 2^(x_t - m); an empty split writes o = 0,
// m = -inf, l = 0, so every slot is always written and the host never clears it. Slots
// are not 16-byte aligned: scalar accesses only.
//
// The merge combines the splits of (seq, head) in the fixed order 0..n-1:
//   M = max m_i; w_i = l_i 2^(m_i - M); L = sum w_i; out = sum w_i o_i / L;
//   lse = (M + log2 L) ln 2 (natural log; lse may be null).
// M = -inf (no token at all, seq_len 0) gives out = 0 and lse = -inf.
//
// Defines: PD_HEAD_DIM, PD_Q_DTYPE (pd_common.cuh), PD_MIN_KV_PER_SPLIT.

#ifndef PD_SPLITK_CUH
#define PD_SPLITK_CUH

#include "pd_common.cuh"

#ifndef PD_MIN_KV_PER_SPLIT
#error "PD_MIN_KV_PER_SPLIT must be defined (the split-K policy's constant, 256)"
#endif

// This split's token range [start, end) (no overflow for any int32 length: ceil without
// L + n - 1, products in 64 bits).
__device__ __forceinline__ void pd_split_range(int seq_len, int split, int num_splits, int& start, int& end) {
  long long chunk = seq_len / num_splits + (seq_len % num_splits != 0 ? 1 : 0);
  chunk = chunk > PD_MIN_KV_PER_SPLIT ? chunk : PD_MIN_KV_PER_SPLIT;
  const long long start64 = (long long)split * chunk;
  const long long end64 = start64 + chunk;
  start = start64 < seq_len ? (int)start64 : seq_len;
  end = end64 < seq_len ? (int)end64 : seq_len;
}

__device__ __forceinline__ float* pd_split_slot(float* workspace, int seq, int num_q_heads, int head, int split,
                                                int num_splits) {
  return workspace + (((long long)seq * num_q_heads + head) * num_splits + split) * (PD_HEAD_DIM + 2);
}

// Writes dim d (and, for d == 0, m and l) of a split's state (M, L, O unnormalized).
__device__ __forceinline__ void pd_store_split(float* slot, int d, float M, float L, float O, float v_scale) {
  slot[d] = pd_normalize(O, L, v_scale);  // empty split: M = -inf, L = 0, O = 0 -> o = 0
  if (d == 0) {
    slot[PD_HEAD_DIM] = M;
    slot[PD_HEAD_DIM + 1] = L;
  }
}

// The merge of (seq = blockIdx.y, head = blockIdx.x) over grid (num_q_heads, num_seqs),
// staging the output row in s_out (PD_HEAD_DIM shared elements: the caller's, since a
// __shared__ array inside an inline function is not portable to the CPU build). Every
// thread of the CTA calls it.
__device__ __forceinline__ void pd_merge_splits(const float* __restrict__ workspace, int num_splits,
                                                pd_q_t* __restrict__ out, float* __restrict__ lse,
                                                unsigned short* s_out) {
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int num_q_heads = gridDim.x;
  const float neg_inf = pd_neg_inf();
  const float* slots = workspace + ((long long)seq * num_q_heads + head) * num_splits * (PD_HEAD_DIM + 2);

  for (int d = threadIdx.x; d < PD_HEAD_DIM; d += blockDim.x) {
    float mx = neg_inf;
    for (int i = 0; i < num_splits; ++i) mx = fmaxf(mx, slots[i * (PD_HEAD_DIM + 2) + PD_HEAD_DIM]);
    // The -inf - -inf trap: when every split is empty, M = -inf and m_i - M would be NaN.
    // Subtract 0 instead; an empty split (m_i = -inf, l_i = 0) then gets
    // w_i = 0 * 2^-inf = 0 * 0 = 0, with M finite or not.
    const float ms = (mx == neg_inf) ? 0.f : mx;
    float L = 0.f, o = 0.f;
    for (int i = 0; i < num_splits; ++i) {
      const float* sl = slots + i * (PD_HEAD_DIM + 2);
      const float w = sl[PD_HEAD_DIM + 1] * exp2f(sl[PD_HEAD_DIM] - ms);
      L += w;
      o = fmaf(w, sl[d], o);
    }
    // L >= w of the split holding the max (its l >= 1) unless every split is empty (L = 0).
    s_out[d] = (unsigned short)pd_float_to_q(pd_normalize(o, L, 1.f));
    if (d == 0 && lse != nullptr) lse[(long long)seq * num_q_heads + head] = pd_lse(mx, L);
  }
  __syncthreads();
  pd_store_span(out + ((long long)seq * num_q_heads + head) * PD_HEAD_DIM, s_out, PD_HEAD_DIM);
}

#endif  // PD_SPLITK_CUH
