// simt_decode_gqa_packed.cu: paged-decode attention on CUDA cores (impl "simt", the
// reference implementation; see simt/README.md) with the PD_GQA query heads of one KV
// head packed into one CTA (GQA packing), head dim PD_HDIM only.
//
// Computes the same function as simt_decode_unpacked.cu for the query heads
// kv_head * PD_GQA + j, j = 0..PD_GQA-1 (so num_q_heads = num_kv_heads * PD_GQA), but
// each K and V row of the KV head is read from memory ONCE for all PD_GQA heads:
//   x_{j,t} = qk_scale_log2 * (q[s, kv*G + j] . k_t),
//   out[s, kv*G + j] = v_scale * sum_t 2^(x_{j,t} - m_j) v_t / l_j,
//   lse = (m_j + log2 l_j) ln 2 (natural log; optional). seq_len 0: zeros and -inf.
//
// Grid (num_kv_heads, num_seqs), block PD_THREADS (4 warps). A thread owns 8
// consecutive dims of the 256-wide head (16-byte loads for bf16/fp16; for fp8 the
// slice is also 8 dims, i.e. 8-byte loads, so that the PD_GQA q vectors and
// accumulators stay at 8 floats each per thread and in registers), a warp covers one
// token row per load instruction (32 lanes x 8 dims), warps interleave over 4-token
// tiles (pd_attend in simt/simt_core.cuh with NH = PD_GQA). The output of the PD_GQA
// heads is one contiguous span of PD_GQA * D elements, written as 16-byte stores.
//
// Layout: as simt_decode_unpacked.cu (strides in elements, NHD and HND alike).
// Defines: PD_HEAD_DIM (must equal PD_HDIM), PD_Q_DTYPE, PD_KV_DTYPE. PD_GQA and PD_HDIM
// are defined here; Python reads them back from this text and refuses to load the
// kernel when they differ from the policy's DECODE_GQA_PACK_WIDTH / _HEAD_DIM.
//
// Performance notes (not measured yet; see benchmarks/NOTES.md): reading KV once for 6
// heads cuts the bytes the CTAs request 6x against the unpacked arm (where the 6 CTAs
// of a group hit L2 for 5 of the 6 reads at best), but it raises arithmetic per byte
// 6x: per token row each thread does 6 dot slices of 8, 6 x 5 butterfly shuffles and 6
// exp2f, about as many issue slots as the HBM time of that row on H200, so this kernel
// sits near the SM issue limit (shuffle and FP32 pipes) rather than purely at the HBM
// limit. It holds 6 x 8 q and 6 x 8 accumulator floats per thread: nvcc reports
// ~190-240 registers (no spills) under __launch_bounds__(128, 2), so 2 CTAs per SM; the
// 4-token tile keeps 4 KB (fp8: 2 KB) of K/V loads in flight per warp. The grid is only
// num_kv_heads * num_seqs CTAs: below ~2 CTAs per SM (e.g. 4 KV heads x 32 seqs = 128
// CTAs on 132 SMs) too few loads are in flight to saturate HBM, so the arm pays off
// only at large batch. Next steps: a transposed (reduce-scatter) butterfly over the
// UNROLL x PD_GQA partial dots (~half the shuffles, one exp2f per lane), and a split-K
// variant of the packed arm for small batches.

#include "simt/simt_core.cuh"

#define PD_GQA 6
#define PD_HDIM 256

#if PD_HEAD_DIM != PD_HDIM
#error "simt_decode_gqa_packed is compiled only for PD_HEAD_DIM == PD_HDIM (256)"
#endif
static_assert(PD_HEAD_DIM == PD_HDIM, "packed kernel head dim");

extern "C" __global__ void PD_LAUNCH_BOUNDS(PD_THREADS, 2) simt_decode_gqa_packed(
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
  constexpr int VEC = 8;  // 16-byte loads for bf16/fp16, 8-byte loads for fp8
  constexpr int UNROLL = 4;

  __shared__ float s_m[PD_GQA * PD_WARPS];
  __shared__ float s_l[PD_GQA * PD_WARPS];
  __shared__ float s_acc[PD_GQA * PD_WARPS * PD_HEAD_DIM];
  __shared__ unsigned short s_out[PD_GQA * PD_HEAD_DIM];

  const int kv_head = blockIdx.x;
  const int seq = blockIdx.y;
  const int num_q_heads = num_kv_heads * PD_GQA;
  const int head0 = kv_head * PD_GQA;
  const int slice = (threadIdx.x & 31) % (PD_HEAD_DIM / VEC);
  int seq_len = seq_lens[seq];
  seq_len = seq_len > 0 ? seq_len : 0;

  float qf[PD_GQA][VEC];
  PD_UNROLL
  for (int j = 0; j < PD_GQA; ++j)
    pd_load_q<VEC>(q + seq * q_stride_seq + (head0 + j) * q_stride_head + slice * VEC, qf[j]);

  float m[PD_GQA], l[PD_GQA], acc[PD_GQA][VEC];
  pd_attend<PD_GQA, VEC, UNROLL>(qf, k_cache + kv_head * k_stride_head + slice * VEC, k_stride_page,
                                 k_stride_token, v_cache + kv_head * v_stride_head + slice * VEC,
                                 v_stride_page, v_stride_token, block_tables + seq * block_tables_stride,
                                 page_size, 0, seq_len, qk_scale_log2, m, l, acc);
  pd_cta_publish<PD_GQA, VEC>(m, l, acc, s_m, s_l, s_acc);

  for (int idx = threadIdx.x; idx < PD_GQA * PD_HEAD_DIM; idx += PD_THREADS) {
    const int j = idx / PD_HEAD_DIM;
    const int d = idx - j * PD_HEAD_DIM;
    float M, L, O;
    pd_cta_combine(s_m, s_l, s_acc, j, d, M, L, O);
    s_out[idx] = (unsigned short)pd_float_to_q(pd_normalize(O, L, v_scale));  // zeros for seq_len 0
    if (d == 0 && lse != nullptr) lse[(long long)seq * num_q_heads + head0 + j] = pd_lse(M, L);
  }
  __syncthreads();
  pd_store_span(out + ((long long)seq * num_q_heads + head0) * PD_HEAD_DIM, s_out, PD_GQA * PD_HEAD_DIM);
}
