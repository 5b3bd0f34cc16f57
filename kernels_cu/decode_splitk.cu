// decode_splitk.cu: paged-decode attention on tensor cores (impl "mma") split along the
// KV sequence (split-K), and the merge of the splits.
//
// decode_splitk: grid (num_q_heads / heads_per_cta, num_splits, num_seqs), block
//   PD_THREADS, dynamic shared memory PD_SMEM_BYTES. CTA (x, i, s) serves the
//   heads_per_cta heads x * heads_per_cta .. of sequence s (one KV head; see
//   decode_unpacked.cu) over split i's tokens (pd_split_range) and writes, for each of
//   its heads, that head's workspace slot (pd_split_slot): the slot addressing and the
//   split ranges do not depend on heads_per_cta, and neither do the bytes.
// decode_splitk_merge: grid (num_q_heads, num_seqs), block PD_MERGE_THREADS; the merge
//   of pd_splitk.cuh, splits 0..n-1 in order.
//
// Batch invariance: a split's range, every reduction order inside the CTA and the merge
// order depend only on (L, num_splits), so a sequence's bytes do not depend on what it
// is batched with as long as num_splits does not (auto / pinned).
//
// Layout and defines: as decode_unpacked.cu, plus PD_MIN_KV_PER_SPLIT (pd_splitk.cuh);
// workspace [num_seqs, num_q_heads, num_splits, D + 2] fp32.
//
// Performance notes: see benchmarks/NOTES.md ("kernel v2").

#include "decode_core.cuh"
#include "pd_splitk.cuh"

extern "C" __global__ void PD_LAUNCH_BOUNDS(PD_THREADS, 1) decode_splitk(
    const pd_q_t* __restrict__ q, long long q_stride_seq, long long q_stride_head,
    const pd_kv_t* __restrict__ k_cache, long long k_stride_page, long long k_stride_token,
    long long k_stride_head,
    const pd_kv_t* __restrict__ v_cache, long long v_stride_page, long long v_stride_token,
    long long v_stride_head,
    const int* __restrict__ block_tables, long long block_tables_stride,
    const int* __restrict__ seq_lens,
    int num_kv_heads, int page_size, int heads_per_cta,
    float qk_scale_log2, float v_scale,
    float* __restrict__ workspace) {
  DYNAMIC_SHARED(unsigned char, smem);
  const int split = blockIdx.y;
  const int seq = blockIdx.z;
  const int num_splits = gridDim.y;
  const int num_q_heads = gridDim.x * heads_per_cta;
  const int head0 = blockIdx.x * heads_per_cta;
  const int kv_head = head0 / (num_q_heads / num_kv_heads);
  int seq_len = seq_lens[seq];
  seq_len = seq_len > 0 ? seq_len : 0;
  int start, end;
  pd_split_range(seq_len, split, num_splits, start, end);

  pd_mma::run_cta(smem, q + seq * q_stride_seq + head0 * q_stride_head, q_stride_head, heads_per_cta,
                  qk_scale_log2, k_cache + kv_head * k_stride_head, k_stride_page, k_stride_token,
                  v_cache + kv_head * v_stride_head, v_stride_page, v_stride_token,
                  block_tables + seq * block_tables_stride, page_size, start, end);
  for (int idx = threadIdx.x; idx < heads_per_cta * PD_HEAD_DIM; idx += PD_THREADS) {
    const int h = idx / PD_HEAD_DIM, d = idx - h * PD_HEAD_DIM;
    float M, L, O;
    pd_mma::cta_combine(smem, h, d, M, L, O);
    pd_store_split(pd_split_slot(workspace, seq, num_q_heads, head0 + h, split, num_splits), d, M, L, O, v_scale);
  }
}

extern "C" __global__ void PD_LAUNCH_BOUNDS(PD_MERGE_THREADS, 4) decode_splitk_merge(
    const float* __restrict__ workspace, int num_splits,
    pd_q_t* __restrict__ out, float* __restrict__ lse) {
  __shared__ unsigned short s_out[PD_HEAD_DIM];
  pd_merge_splits(workspace, num_splits, out, lse, s_out);
}
