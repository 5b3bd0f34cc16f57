// mma_combine.cuh: a CTA's item end to end (run_cta: stage q, attend, publish) and its
// epilogue: the warp states published to shared memory, combined per row (cta_combine,
// warps 0..W-1 in order), and the outputs written (store_rows, with the sink and out_f32
// hooks).

#ifndef PD_MMA_COMBINE_CUH
#define PD_MMA_COMBINE_CUH

#include "mma_attend.cuh"

namespace pd_mma {

// Where warp w's state lies after publish, for cta_combine: m and l of row r, o of row r
// dim d. PREFETCH > 0: in its own ring past the stages issue_ahead fills.
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
// PREFETCH > 0: into the warp's own ring, past stages 0 .. PREFETCH - 1, so no
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

// The whole CTA: stage q (q_row(r) = row r's D elements), call between(), attend (carry: the
// tiles in flight already), publish (calling ahead(): issue_ahead). Afterwards
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
    const bool alone = Sinks::on ? f.sinks.output_transform(r % rw.heads, M, L, O) : false;  // the sink alone is the state
    const float value = pd_normalize(O, L, v_scale);  // zeros for an empty state
    const long long at = (long long)(r / rw.heads) * num_q_heads + r % rw.heads;
    if (OutF32::on)
      OutF32::output_store(out_row0, at, d, value);
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

#endif  // PD_MMA_COMBINE_CUH
