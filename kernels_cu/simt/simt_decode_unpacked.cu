// simt_decode_unpacked.cu: paged-decode attention on CUDA cores (impl "simt", the
// reference implementation; see simt/README.md), one query head per CTA.
//
// Computes, for sequence s and query head h (kv head g = h / (num_q_heads / num_kv_heads)):
//   x_t   = qk_scale_log2 * (q[s, h] . k_t)                 t < seq_lens[s]   (log2 units)
//   out   = v_scale * sum_t 2^(x_t - m) v_t / sum_t 2^(x_t - m),   m = max_t x_t
//   lse   = ln(sum_t e^(x_t ln 2)) = (m + log2 l) * ln 2   (natural log; optional)
// where k_t, v_t are row t of the sequence's paged cache: page block_tables[s, t / page_size],
// slot t % page_size. seq_len 0 gives out = 0 and lse = -inf.
//
// Grid (num_q_heads, num_seqs), block PD_THREADS (128 = 4 warps). Within the CTA each
// thread owns a 16-byte slice of the head dim (VEC = 8 bf16/fp16 or 16 fp8 elements),
// D / VEC threads cover a token row, warps interleave over tiles of 4 * (32 * VEC / D)
// tokens (see pd_attend in simt/simt_core.cuh); the 4 warp states are combined through
// static shared memory in warp order and the output row leaves as 16-byte stores.
//
// Layout: q [num_seqs, num_q_heads, D] and the caches addressed only through strides
// (elements): NHD [pages, page_size, kv_heads, D] and HND [pages, kv_heads, page_size, D]
// are both (stride_page, stride_token, stride_head) triples; the last dim is contiguous.
// out [num_seqs, num_q_heads, D] contiguous, lse [num_seqs, num_q_heads] fp32 or null.
//
// Defines: PD_HEAD_DIM, PD_Q_DTYPE, PD_KV_DTYPE (see pd_common.cuh).
//
// Performance notes (not measured yet; see benchmarks/NOTES.md): the CTA streams
// 2 * L * D * sizeof(KV) bytes; each thread issues 8 independent 16-byte loads per tile
// (4 KB in flight per warp). nvcc (sm_90, __launch_bounds__(128, 4)): ~80-90 registers
// for bf16/fp16 KV, 117 for fp8, no spills, so 4-6 CTAs (16-24 warps, 64-96 KB of loads
// in flight) per SM, several times what HBM latency x bandwidth needs per SM (~25 KB),
// provided the grid has that many CTAs. Per 16 bytes of K or V a thread spends ~1 (bf16),
// ~2.5 (fp16) or ~3.5 (fp8) integer ops per element on conversion (see pd_kv_slice) plus
// one FMA, and ~20 integer ops per token on the 64-bit row address: bf16 leaves the SM
// issue slots mostly idle, fp8 uses an estimated ~60-80% of the integer pipe at HBM
// speed, so fp8 is the spec most at risk of being ALU-bound. Limits: one CTA per
// (head, seq) means few CTAs at small batch (that is what split-K is for); the q heads
// of one GQA group each re-read the same KV rows (served by L2 when they run together,
// which adjacent blockIdx.x makes likely). Next steps: hardware fp8->f16x2 conversion
// (cvt.rn.f16x2.e4m3x2, exact) behind __CUDA_ARCH__ if the dialect allows it,
// precomputed 64-bit row offsets per lane, a second tile of loads in flight per warp for
// low-occupancy shapes, and an L2 evict-first hint on K/V.

#include "simt/simt_core.cuh"

extern "C" __global__ void PD_LAUNCH_BOUNDS(PD_THREADS, 4) simt_decode_unpacked(
    const pd_q_t* __restrict__ q, long long q_stride_seq, long long q_stride_head,
    const pd_kv_t* __restrict__ k_cache, long long k_stride_page, long long k_stride_token,
    long long k_stride_head,
    const pd_kv_t* __restrict__ v_cache, long long v_stride_page, long long v_stride_token,
    long long v_stride_head,
    const int* __restrict__ block_tables, long long block_tables_stride,
    const int* __restrict__ seq_lens,
    int num_kv_heads, int page_size,
    float qk_scale_log2, float v_scale,
    pd_q_t* __restrict__ out, float* __restrict__ lse) {
  constexpr int VEC = 16 / (int)sizeof(pd_kv_t);
  constexpr int UNROLL = 4;

  __shared__ float s_m[PD_WARPS];
  __shared__ float s_l[PD_WARPS];
  __shared__ float s_acc[PD_WARPS * PD_HEAD_DIM];
  __shared__ unsigned short s_out[PD_HEAD_DIM];

  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int num_q_heads = gridDim.x;
  const int kv_head = head / (num_q_heads / num_kv_heads);
  const int slice = (threadIdx.x & 31) % (PD_HEAD_DIM / VEC);
  int seq_len = seq_lens[seq];
  seq_len = seq_len > 0 ? seq_len : 0;

  float qf[1][VEC];
  pd_load_q<VEC>(q + seq * q_stride_seq + head * q_stride_head + slice * VEC, qf[0]);

  float m[1], l[1], acc[1][VEC];
  pd_attend<1, VEC, UNROLL>(qf, k_cache + kv_head * k_stride_head + slice * VEC, k_stride_page, k_stride_token,
                            v_cache + kv_head * v_stride_head + slice * VEC, v_stride_page, v_stride_token,
                            block_tables + seq * block_tables_stride, page_size, 0, seq_len, qk_scale_log2,
                            m, l, acc);
  pd_cta_publish<1, VEC>(m, l, acc, s_m, s_l, s_acc);

  for (int d = threadIdx.x; d < PD_HEAD_DIM; d += PD_THREADS) {
    float M, L, O;
    pd_cta_combine(s_m, s_l, s_acc, 0, d, M, L, O);
    // L >= 1 whenever a token was seen (the max token contributes 2^0); L == 0: zeros.
    s_out[d] = (unsigned short)pd_float_to_q(pd_normalize(O, L, v_scale));
    if (d == 0 && lse != nullptr) lse[(long long)seq * num_q_heads + head] = pd_lse(M, L);
  }
  __syncthreads();
  pd_store_span(out + ((long long)seq * num_q_heads + head) * PD_HEAD_DIM, s_out, PD_HEAD_DIM);
}
