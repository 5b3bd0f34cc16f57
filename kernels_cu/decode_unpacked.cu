// decode_unpacked.cu: paged-decode attention on tensor cores (impl "mma"), one split.
//
// Computes, for sequence s and query head h (kv head h / G, G = num_q_heads / num_kv_heads):
//   x_t = qk_scale_log2 * (q[s, h] . k_t)                   t < seq_lens[s]   (log2 units)
//   out = v_scale * sum_t 2^(x_t - m) v_t / sum_t 2^(x_t - m),   m = max_t x_t
//   lse = (m + log2 l) * ln 2   (natural log; optional)
// with k_t, v_t row t of the sequence's paged cache (page block_tables[s, t / page_size],
// slot t % page_size). seq_len 0 gives out = 0 and lse = -inf.
//
// Grid (num_q_heads / heads_per_cta, num_seqs), block PD_THREADS (4 warps), dynamic
// shared memory PD_SMEM_BYTES. CTA (x, s) serves the heads_per_cta heads x *
// heads_per_cta .. of sequence s, which must divide G (they share one KV head) and be at
// most 8 * PD_ROW_TILES; the host guarantees both. The core (decode_core.cuh) streams
// that KV head's K and V once for all of them; a head's bytes do not depend on
// heads_per_cta.
//
// Layout: q [num_seqs, num_q_heads, D] and the caches addressed by strides in elements
// (NHD and HND are both (stride_page, stride_token, stride_head)); K/V rows and q rows
// 16-byte aligned, last dim contiguous. out [num_seqs, num_q_heads, D] contiguous, lse
// [num_seqs, num_q_heads] fp32 or null.
//
// Defines: PD_HEAD_DIM, PD_Q_DTYPE, PD_KV_DTYPE, PD_ROW_TILES, PD_TILE_TOKENS, PD_STAGES,
// PD_SMEM_BYTES (decode_core.cuh).
//
// Performance notes: see benchmarks/NOTES.md ("kernel v2"); the budgets are held by
// benchmarks/sass_report.py.

#include "decode_core.cuh"

extern "C" __global__ void PD_LAUNCH_BOUNDS(PD_THREADS, 1) decode_unpacked(
    const pd_q_t* __restrict__ q, long long q_stride_seq, long long q_stride_head,
    const pd_kv_t* __restrict__ k_cache, long long k_stride_page, long long k_stride_token,
    long long k_stride_head,
    const pd_kv_t* __restrict__ v_cache, long long v_stride_page, long long v_stride_token,
    long long v_stride_head,
    const int* __restrict__ block_tables, long long block_tables_stride,
    const int* __restrict__ seq_lens,
    int num_kv_heads, int page_size, int heads_per_cta,
    float qk_scale_log2, float v_scale,
    pd_q_t* __restrict__ out, float* __restrict__ lse) {
  DYNAMIC_SHARED(unsigned char, smem);
  const int seq = blockIdx.y;
  const int num_q_heads = gridDim.x * heads_per_cta;
  const int head0 = blockIdx.x * heads_per_cta;
  const int kv_head = head0 / (num_q_heads / num_kv_heads);
  int seq_len = seq_lens[seq];
  seq_len = seq_len > 0 ? seq_len : 0;

  pd_mma::run_cta(smem, q + seq * q_stride_seq + head0 * q_stride_head, q_stride_head, heads_per_cta,
                  qk_scale_log2, k_cache + kv_head * k_stride_head, k_stride_page, k_stride_token,
                  v_cache + kv_head * v_stride_head, v_stride_page, v_stride_token,
                  block_tables + seq * block_tables_stride, page_size, 0, seq_len);
  const long long row0 = (long long)seq * num_q_heads + head0;
  pd_mma::store_rows(smem, heads_per_cta, v_scale, out + row0 * PD_HEAD_DIM, lse == nullptr ? nullptr : lse + row0);
}
