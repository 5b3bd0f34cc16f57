// decode_splitk.cu: paged-decode attention on tensor cores (impl "mma") split along the
// KV sequence (split-K), and the merge of the splits.
//
// decode_splitk: grid (num_q_heads / heads_per_cta, num_splits, num_seqs), block
//   PD_THREADS, dynamic shared memory PD_SMEM_BYTES. CTA (x, i, s) serves the
//   heads_per_cta heads x * heads_per_cta .. of sequence s and its q_len tokens (one KV
//   head; see decode_unpacked.cu) over split i of each row's keys (row_range) and
//   writes, for each row, its workspace slot (pd_split_slot with row seq * q_len + t):
//   the slot addressing and the split ranges do not depend on heads_per_cta, and neither
//   do the bytes.
// decode_splitk_merge: grid (num_q_heads, num_seqs * q_len), block PD_MERGE_THREADS; the
//   merge of pd_splitk.cuh, splits 0..n-1 in order, then the sink (PD_SINKS).
//
// Batch invariance: a split's range, every reduction order inside the CTA and the merge
// order depend only on (L, num_splits), so a sequence's bytes do not depend on what it
// is batched with as long as num_splits does not (auto / pinned).
//
// Layout and defines: as decode_unpacked.cu, plus PD_MIN_KV_PER_SPLIT (pd_splitk.cuh);
// workspace [num_seqs * q_len, num_q_heads, num_splits, D + 2] fp32.
//
// Performance notes: see benchmarks/NOTES.md ("kernel v2").

#include "decode_core.cuh"

extern "C" __global__ void PD_LAUNCH_BOUNDS(PD_THREADS, 1) decode_splitk(
    const pd_q_t* __restrict__ q, long long q_stride_seq, long long q_stride_token, long long q_stride_head,
    const pd_kv_t* __restrict__ k_cache, long long k_stride_page, long long k_stride_token,
    long long k_stride_head,
    const pd_kv_t* __restrict__ v_cache, long long v_stride_page, long long v_stride_token,
    long long v_stride_head,
    const int* __restrict__ block_tables, long long block_tables_stride,
    const int* __restrict__ seq_lens,
    int num_kv_heads, int page_size, int heads_per_cta, int q_len, int window_left,
    float qk_scale, float cap_log2, float v_scale, const float* __restrict__ sinks,
    float* __restrict__ workspace) {
  DYNAMIC_SHARED(unsigned char, smem);
  const int split = blockIdx.y;
  const int seq = blockIdx.z;
  const int num_splits = gridDim.y;
  const int num_q_heads = gridDim.x * heads_per_cta;
  const int head0 = blockIdx.x * heads_per_cta;
  const int kv_head = head0 / (num_q_heads / num_kv_heads);
  const int seq_len = seq_lens[seq];
  const pd_mma::Rows rw{heads_per_cta, q_len, heads_per_cta * q_len, seq_len > 0 ? seq_len : 0, window_left, split,
                        num_splits};

  const pd_mma::QRows q_rows{q + seq * q_stride_seq + head0 * q_stride_head, q_stride_token, q_stride_head,
                            heads_per_cta};
  pd_mma::run_cta(smem, rw, q_rows,
                  qk_scale, cap_log2, k_cache + kv_head * k_stride_head, k_stride_page, k_stride_token,
                  v_cache + kv_head * v_stride_head, v_stride_page, v_stride_token,
                  block_tables + seq * block_tables_stride, page_size);
  for (int idx = threadIdx.x; idx < rw.rows * PD_HEAD_DIM; idx += PD_THREADS) {
    const int r = idx / PD_HEAD_DIM, d = idx - r * PD_HEAD_DIM;
    float M, L, O;
    pd_mma::cta_combine(smem, r, d, M, L, O);
    const int row = seq * q_len + r / heads_per_cta, head = head0 + r % heads_per_cta;
    pd_store_split(pd_split_slot(workspace, row, num_q_heads, head, split, num_splits), d, M, L, O, v_scale);
  }
  (void)sinks;  // the sink enters once, in the merge
}

extern "C" __global__ void PD_LAUNCH_BOUNDS(PD_MERGE_THREADS, 4) decode_splitk_merge(
    const float* __restrict__ workspace, int num_splits, const float* __restrict__ sinks,
    pd_out_t* __restrict__ out, float* __restrict__ lse) {
  __shared__ unsigned short s_out[PD_HEAD_DIM];
  pd_merge_splits(workspace, num_splits, PD_SINKS ? sinks : nullptr, out, lse, s_out);
}
