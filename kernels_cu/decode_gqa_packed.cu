// decode_gqa_packed.cu: the gated GQA-packed paged decode on the tensor-core core (impl
// "mma"): the PD_GQA query heads of one KV head in one CTA, head dim PD_HDIM only.
//
// Computes the same function as decode_unpacked.cu (same core, rows = PD_GQA), so its
// bytes equal the unpacked arm's at heads_per_cta = PD_GQA: grid (num_kv_heads,
// num_seqs), CTA (g, s) serves heads g * PD_GQA .. g * PD_GQA + PD_GQA - 1 of sequence s
// (num_q_heads = num_kv_heads * PD_GQA, which the policy's gqa_pack_shape_ok guarantees).
//
// PD_GQA and PD_HDIM are defined here; Python reads them back from this text and refuses
// to load the kernel when they differ from the policy's DECODE_GQA_PACK_WIDTH /
// DECODE_GQA_PACK_HEAD_DIM. Other defines as decode_core.cuh (PD_ROW_TILES must hold
// PD_GQA rows).
//
// Performance notes: see benchmarks/NOTES.md ("kernel v2").

#include "decode_core.cuh"

#define PD_GQA 6
#define PD_HDIM 256

#if PD_HEAD_DIM != PD_HDIM
#error "decode_gqa_packed is compiled only for PD_HEAD_DIM == PD_HDIM (256)"
#endif
static_assert(PD_GQA <= pd_mma::ROWS, "PD_ROW_TILES must hold the pack width");

extern "C" __global__ void PD_LAUNCH_BOUNDS(PD_THREADS, 1) decode_gqa_packed(
    const pd_q_t* __restrict__ q, long long q_stride_seq, long long q_stride_token, long long q_stride_head,
    const pd_kv_t* __restrict__ k_cache, long long k_stride_page, long long k_stride_token,
    long long k_stride_head,
    const pd_kv_t* __restrict__ v_cache, long long v_stride_page, long long v_stride_token,
    long long v_stride_head,
    const int* __restrict__ block_tables, long long block_tables_stride,
    const int* __restrict__ seq_lens,
    int num_kv_heads, int page_size, int q_len, int window_left,
    float qk_scale, float cap_log2, float v_scale, const float* __restrict__ sinks,
    pd_out_t* __restrict__ out, float* __restrict__ lse) {
  DYNAMIC_SHARED(unsigned char, smem);
  const int kv_head = blockIdx.x;
  const int seq = blockIdx.y;
  const int num_q_heads = num_kv_heads * PD_GQA;
  const int head0 = kv_head * PD_GQA;
  const int seq_len = seq_lens[seq];
  const pd_mma::Rows rw{PD_GQA, q_len, PD_GQA * q_len, seq_len > 0 ? seq_len : 0, window_left, 0, 1};

  const pd_mma::QRows q_rows{q + seq * q_stride_seq + head0 * q_stride_head, q_stride_token, q_stride_head,
                            PD_GQA};
  pd_mma::run_cta(smem, rw, q_rows,
                  qk_scale, cap_log2, k_cache + kv_head * k_stride_head, k_stride_page, k_stride_token,
                  v_cache + kv_head * v_stride_head, v_stride_page, v_stride_token,
                  block_tables + seq * block_tables_stride, page_size);
  const long long row0 = (long long)seq * q_len * num_q_heads + head0;
  pd_mma::store_rows(smem, rw, num_q_heads, v_scale, PD_SINKS ? sinks + head0 : nullptr, out + row0 * PD_HEAD_DIM,
                     lse == nullptr ? nullptr : lse + row0);
}
