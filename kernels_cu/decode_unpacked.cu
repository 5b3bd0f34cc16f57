// decode_unpacked.cu: paged-decode attention on tensor cores (impl "mma"), one split.
//
// Computes, for sequence s, query token i < q_len and query head h (kv head h / G, G =
// num_q_heads / num_kv_heads), over the keys t the token sees (decode_core.cuh row_range:
// t < L - q_len + 1 + i with L = seq_lens[s], from its window when there is one):
//   x_t = qk_scale * (q[s, i, h] . k_t)     (log2 units; soft-cap: cap_log2 tanh(qk_scale q.k))
//   out = v_scale * sum_t 2^(x_t - m) v_t / (sum_t 2^(x_t - m) [+ 2^(sink_h log2 e - m)])
//   lse = ln of that denominator, with m added back (natural log; optional)
// with k_t, v_t row t of the sequence's paged cache (page block_tables[s, t / page_size],
// slot t % page_size). A token that sees no key gives out = 0 and lse = -inf.
//
// Grid (num_q_heads / heads_per_cta, num_seqs), block PD_THREADS (4 warps), dynamic
// shared memory PD_SMEM_BYTES. CTA (x, s) serves the heads_per_cta heads x *
// heads_per_cta .. of sequence s and its q_len query tokens: heads_per_cta divides G (the
// heads share one KV head) and heads_per_cta * q_len <= 8 * PD_ROW_TILES; the host
// guarantees both (and q_len == 1 unless PD_MULTI_TOKEN). The core streams that KV
// head's K and V once for all of them; a row's bytes do not depend on heads_per_cta or
// q_len.
//
// Layout: q [num_seqs, q_len, num_q_heads, D] and the caches addressed by strides in
// elements (NHD and HND are both (stride_page, stride_token, stride_head)); K/V rows and
// q rows 16-byte aligned, last dim contiguous. out [num_seqs, q_len, num_q_heads, D]
// contiguous (fp32 with PD_OUT_F32, else q's dtype), lse [num_seqs, q_len, num_q_heads]
// fp32 or null, sinks [num_q_heads] fp32 (read only with PD_SINKS).
//
// Defines: as decode_core.cuh.
//
// Performance notes: see benchmarks/NOTES.md ("kernel v2"); the budgets are held by
// benchmarks/sass_report.py.

#include "decode_core.cuh"

extern "C" __global__ void PD_LAUNCH_BOUNDS(PD_THREADS, 1) decode_unpacked(
    const pd_q_t* __restrict__ q, long long q_stride_seq, long long q_stride_token, long long q_stride_head,
    const pd_kv_t* __restrict__ k_cache, long long k_stride_page, long long k_stride_token,
    long long k_stride_head,
    const pd_kv_t* __restrict__ v_cache, long long v_stride_page, long long v_stride_token,
    long long v_stride_head,
    const int* __restrict__ block_tables, long long block_tables_stride,
    const int* __restrict__ seq_lens,
    int num_kv_heads, int page_size, int heads_per_cta, int q_len, int window_left,
    float qk_scale, float cap_log2, float v_scale, const float* __restrict__ sinks,
    pd_out_t* __restrict__ out, float* __restrict__ lse) {
  DYNAMIC_SHARED(unsigned char, smem);
  const int seq = blockIdx.y;
  const int num_q_heads = gridDim.x * heads_per_cta;
  const int head0 = blockIdx.x * heads_per_cta;
  const int kv_head = head0 / (num_q_heads / num_kv_heads);
  const int seq_len = seq_lens[seq];
  const pd_mma::Rows rw{heads_per_cta, q_len, heads_per_cta * q_len, seq_len > 0 ? seq_len : 0, window_left, 0, 1};

  const pd_mma::QRows q_rows{q + seq * q_stride_seq + head0 * q_stride_head, q_stride_token, q_stride_head,
                            heads_per_cta};
  pd_mma::run_cta(smem, rw, q_rows,
                  qk_scale, cap_log2, k_cache + kv_head * k_stride_head, k_stride_page, k_stride_token,
                  v_cache + kv_head * v_stride_head, v_stride_page, v_stride_token,
                  block_tables + seq * block_tables_stride, page_size);
  const long long row0 = (long long)seq * q_len * num_q_heads + head0;  // out[seq, 0, head0]
  pd_mma::store_rows(smem, rw, num_q_heads, v_scale, PD_SINKS ? sinks + head0 : nullptr, out + row0 * PD_HEAD_DIM,
                     lse == nullptr ? nullptr : lse + row0);
}
