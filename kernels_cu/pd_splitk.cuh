// pd_splitk.cuh: what every split-K arm shares, whatever its core: the token range of a
// split, the workspace slot a CTA writes, and the merge of the splits.
//
// A split's range comes from the sequence's own length L only (never from the batch),
// floored at PD_MIN_KV_PER_SPLIT (the policy's constant, passed by Python):
//   split_len = max(ceil(L / num_splits), PD_MIN_KV_PER_SPLIT),
//   split i covers [i * split_len, min((i + 1) * split_len, L))   (possibly empty).
// Slot ((seq * num_q_heads) + head) * num_splits + split of the workspace holds
// PD_V_HEAD_DIM + 2 fp32 values: o[D] (normalized within the split, v_scale included), then
// m = max_t x_t (log2 units), then l = sum_t 2^(x_t - m); an empty split writes o = 0,
// m = -inf, l = 0, so every slot is always written and the host never clears it. Slots
// are not 16-byte aligned: scalar accesses only.
//
// The merge combines the splits of (row, head) in the fixed order 0..n-1, then the sink if
// there is one (pd_add_sink):
//   M = max m_i; w_i = l_i 2^(m_i - M); L = sum w_i; out = sum w_i o_i / L;
//   lse = (M + log2 L) ln 2 (natural log; lse may be null), or the sink itself where it
//   alone is the state (a finite sink beyond +-FLT_MAX ln 2, see pd_add_sink).
// M = -inf (no token at all, seq_len 0) gives out = 0 and lse = -inf (the sink's, with one).
//
// Defines: PD_V_HEAD_DIM, PD_Q_DTYPE (pd_common.cuh), PD_MIN_KV_PER_SPLIT.

#ifndef PD_SPLITK_CUH
#define PD_SPLITK_CUH

#include "pd_common.cuh"

#ifndef PD_MIN_KV_PER_SPLIT
#error "PD_MIN_KV_PER_SPLIT must be defined (the split-K policy's constant, 256)"
#endif

// This split's token range [start, end) (no overflow for any int32 length: ceil without
// L + n - 1, products in 64 bits).
__device__ __forceinline__ void pd_split_range(int seq_len, int split, int num_splits, int& start, int& end) {
  long long split_len = seq_len / num_splits + (seq_len % num_splits != 0 ? 1 : 0);
  split_len = split_len > PD_MIN_KV_PER_SPLIT ? split_len : PD_MIN_KV_PER_SPLIT;
  const long long start64 = (long long)split * split_len;
  const long long end64 = start64 + split_len;
  start = start64 < seq_len ? (int)start64 : seq_len;
  end = end64 < seq_len ? (int)end64 : seq_len;
}

__device__ __forceinline__ float* pd_split_slot(float* workspace, int seq, int num_q_heads, int head, int split,
                                                int num_splits) {
  return workspace + (((long long)seq * num_q_heads + head) * num_splits + split) * (PD_V_HEAD_DIM + 2);
}

// Writes dim d (and, for d == 0, m and l) of a split's state (M, L, O unnormalized).
__device__ __forceinline__ void pd_store_split(float* slot, int d, float M, float L, float O, float v_scale) {
  slot[d] = pd_normalize(O, L, v_scale);  // empty split: M = -inf, L = 0, O = 0 -> o = 0
  if (d == 0) {
    slot[PD_V_HEAD_DIM] = M;
    slot[PD_V_HEAD_DIM + 1] = L;
  }
}

// Fold a sink into a state (M, L, O): a logit `sink_ln` (natural-log units of the scaled
// scores) that joins the softmax denominator and contributes no value:
//   M' = max(M, s), L' = L 2^(M - M') + 2^(s - M'), O' = O 2^(M - M'),   s = sink_ln log2 e.
// A sink of -inf leaves (M, L, O) bit for bit (2^0 = 1, + 0); an empty state (M = -inf)
// takes M' = s, L' = 1, O' = 0. Returns false then, and the state's lse is pd_lse(M', L').
//
// A finite sink beyond +-FLT_MAX ln 2 (~2.36e38) has no fp32 s: sink_ln log2 e rounds to
// +-inf, and the formula would take inf - inf = NaN. Such a sink lies more than 2^103 (log2
// units) beyond every finite logit, so every other weight is 2^-(> 2^103) = 0 exactly: above
// them (s = +inf), or below them with nothing else seen (M = -inf), the state is the sink's
// alone, L' = 1 and O' = 0 (a NaN state stays NaN); below a non-empty state its weight is 0
// and the formula leaves the state bit for bit, as for -inf. The sink alone has lse =
// sink_ln exactly, but M' = s has no fp32 value: M' saturates at +-FLT_MAX (pd_lse would
// give +-FLT_MAX ln 2) and the function returns true, telling the caller to write sink_ln
// itself as the lse.
__device__ __forceinline__ bool pd_add_sink(float sink_ln, float& M, float& L, float& O) {
  const float neg_inf = pd_neg_inf();
  const float s = sink_ln * (float)PD_LOG2E;
  if (sink_ln != s && fabsf(s) == -neg_inf && (s > 0.f || M == neg_inf)) {  // finite sink_ln, s = +-inf
    L = fmaf(L, 0.f, 1.f);  // 1, or NaN
    O *= 0.f;
    M = __uint_as_float(s > 0.f ? 0x7f7fffffu : 0xff7fffffu);  // +-FLT_MAX
    return L == 1.f;
  }
  const float mx = fmaxf(M, s);
  const float ms = mx == neg_inf ? 0.f : mx;  // both -inf: avoid -inf - -inf
  const float a = exp2f(M - ms);
  L = fmaf(L, a, exp2f(s - ms));
  O = O * a;
  M = mx;
  return false;
}

// The lse of a state that is its sink alone (pd_add_sink returned true): the sink itself
// in natural log, or in base 2 (lse_scale 1, see pd_lse) the sink in log2 units as the
// kernels hold it.
__device__ __forceinline__ float pd_sink_lse(float sink_ln, float lse_scale) {
  return lse_scale == 1.f ? sink_ln * (float)PD_LOG2E : sink_ln;
}

// The merge of (row = blockIdx.y, head = blockIdx.x) over grid (num_q_heads, rows): a row
// is a sequence (a query token of one, for multi-token decode: row = seq * q_len + t).
// `sinks` (may be null) holds each head's sink logit; it enters here, once, after the
// splits. `Out` is the output element: unsigned short (bf16/fp16 bits of PD_Q_DTYPE,
// staged in s_out, PD_V_HEAD_DIM shared elements of the caller's: a __shared__ array
// inside an inline function is not portable to the CPU build) or float. Every thread
// of the CTA calls it. lse (may be null) in the caller's base (lse_scale, see pd_lse).
template <class Out>
__device__ __forceinline__ void pd_merge_splits(const float* __restrict__ workspace, int num_splits,
                                                const float* __restrict__ sinks, Out* __restrict__ out,
                                                float* __restrict__ lse, float lse_scale, unsigned short* s_out) {
  const int head = blockIdx.x;
  const int row = blockIdx.y;
  const int num_q_heads = gridDim.x;
  const float neg_inf = pd_neg_inf();
  const float* slots = workspace + ((long long)row * num_q_heads + head) * num_splits * (PD_V_HEAD_DIM + 2);
  Out* out_row = out + ((long long)row * num_q_heads + head) * PD_V_HEAD_DIM;

  for (int d = threadIdx.x; d < PD_V_HEAD_DIM; d += blockDim.x) {
    float mx = neg_inf;
    for (int i = 0; i < num_splits; ++i) mx = fmaxf(mx, slots[i * (PD_V_HEAD_DIM + 2) + PD_V_HEAD_DIM]);
    // The -inf - -inf trap: when every split is empty, M = -inf and m_i - M would be NaN.
    // Subtract 0 instead; an empty split (m_i = -inf, l_i = 0) then gets
    // w_i = 0 * 2^-inf = 0 * 0 = 0, with M finite or not.
    const float ms = (mx == neg_inf) ? 0.f : mx;
    float L = 0.f, o = 0.f;
    for (int i = 0; i < num_splits; ++i) {
      const float* sl = slots + i * (PD_V_HEAD_DIM + 2);
      const float w = sl[PD_V_HEAD_DIM + 1] * exp2f(sl[PD_V_HEAD_DIM] - ms);
      L += w;
      o = fmaf(w, sl[d], o);
    }
    bool alone = false;  // the sink alone: its lse is sinks[head] itself (pd_add_sink)
    if (sinks != nullptr) alone = pd_add_sink(sinks[head], mx, L, o);
    // L >= w of the split holding the max (its l >= 1) unless every split is empty (L = 0).
    const float value = pd_normalize(o, L, 1.f);
    if (sizeof(Out) == 4)
      reinterpret_cast<float*>(out_row)[d] = value;
    else
      s_out[d] = (unsigned short)pd_float_to_q(value);
    if (d == 0 && lse != nullptr)
      lse[(long long)row * num_q_heads + head] = alone ? pd_sink_lse(sinks[head], lse_scale) : pd_lse(mx, L, lse_scale);
  }
  if (sizeof(Out) != 4) {
    __syncthreads();
    pd_store_span(reinterpret_cast<pd_q_t*>(out_row), s_out, PD_V_HEAD_DIM);
  }
}

#endif  // PD_SPLITK_CUH
