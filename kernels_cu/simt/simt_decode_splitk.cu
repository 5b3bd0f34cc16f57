// simt_decode_splitk.cu: paged-decode attention on CUDA cores (impl "simt", the
// reference implementation; see simt/README.md) split along the KV sequence (split-K),
// and the merge of the splits.
//
// simt_decode_splitk: grid (num_q_heads, num_splits, num_seqs), block PD_THREADS.
//   CTA (h, i, s) attends query head h of sequence s (kv head h / (num_q_heads /
//   num_kv_heads)) over its split's tokens. The split length comes from the sequence's
//   own length L only (never from the batch), floored at PD_MIN_KV_PER_SPLIT:
//     chunk = max(ceil(L / num_splits), PD_MIN_KV_PER_SPLIT),
//     split i covers [i * chunk, min((i + 1) * chunk, L))   (possibly empty).
//   It writes workspace slot ((s * num_q_heads) + h) * num_splits + i, PD_HEAD_DIM + 2
//   fp32 values: o[D] = v_scale * sum_t 2^(x_t - m) v_t / l (normalized within the split,
//   v_scale included), then m = max_t x_t (log2 units), then l = sum_t 2^(x_t - m).
//   An empty split writes o = 0, m = -inf, l = 0: every slot is always written, the
//   workspace is never initialized by the host.
//
// simt_decode_splitk_merge: grid (num_q_heads, num_seqs), block PD_MERGE_THREADS.
//   Combines the splits of (s, h) in the fixed order 0..n-1:
//     M = max m_i; w_i = l_i 2^(m_i - M); L = sum w_i; out = sum w_i o_i / L;
//     lse = (M + log2 L) ln 2 (natural log; lse may be null).
//   M = -inf (no token at all, seq_len 0) gives out = 0 and lse = -inf.
//
// Layout: as simt_decode_unpacked.cu (strides in elements, NHD and HND alike);
// workspace [num_seqs, num_q_heads, num_splits, D + 2] fp32 (slots are not 16-byte
// aligned, so they are written and read with scalar accesses).
//
// Defines: PD_HEAD_DIM, PD_Q_DTYPE, PD_KV_DTYPE (pd_common.cuh), PD_MIN_KV_PER_SPLIT
// (the policy's constant, 256, passed by Python).
//
// Batch invariance: a split's range, the order of every reduction inside the CTA and
// the merge order depend only on (L, num_splits), so a sequence's output bytes do not
// depend on what it is batched with as long as num_splits does not (auto / pinned).
//
// Performance notes (not measured yet; see benchmarks/NOTES.md): the split kernel is
// the unpacked kernel's loop over a sub-range (same per-CTA bandwidth behaviour); the
// point is CTA count: num_q_heads * num_splits CTAs for one long sequence. The cost
// over the unpacked arm is the workspace round trip (D + 2 floats per split per head:
// ~1 KB per (head, split) at D=256, i.e. <1% of the KV bytes of a 256-token split) and
// a second launch. The floor of 256 tokens per split keeps that overhead bounded for
// short sequences. Next steps: fuse the merge into the last CTA of each (seq, head)
// (needs a counter and atomics, which the determinism rules here exclude today), or
// launch the merge with programmatic dependent launch to hide its launch latency.

#include "simt/simt_core.cuh"
#include "pd_splitk.cuh"

extern "C" __global__ void PD_LAUNCH_BOUNDS(PD_THREADS, 4) simt_decode_splitk(
    const pd_q_t* __restrict__ q, long long q_stride_seq, long long q_stride_head,
    const pd_kv_t* __restrict__ k_cache, long long k_stride_page, long long k_stride_token,
    long long k_stride_head,
    const pd_kv_t* __restrict__ v_cache, long long v_stride_page, long long v_stride_token,
    long long v_stride_head,
    const int* __restrict__ block_tables, long long block_tables_stride,
    const int* __restrict__ seq_lens,
    int num_kv_heads, int page_size,
    float qk_scale_log2, float v_scale,
    float* __restrict__ workspace) {
  constexpr int VEC = 16 / (int)sizeof(pd_kv_t);
  constexpr int UNROLL = 4;

  __shared__ float s_m[PD_WARPS];
  __shared__ float s_l[PD_WARPS];
  __shared__ float s_acc[PD_WARPS * PD_HEAD_DIM];

  const int head = blockIdx.x;
  const int split = blockIdx.y;
  const int seq = blockIdx.z;
  const int num_q_heads = gridDim.x;
  const int num_splits = gridDim.y;
  const int kv_head = head / (num_q_heads / num_kv_heads);
  const int slice = (threadIdx.x & 31) % (PD_HEAD_DIM / VEC);
  int seq_len = seq_lens[seq];
  seq_len = seq_len > 0 ? seq_len : 0;

  int start, end;
  pd_split_range(seq_len, split, num_splits, start, end);

  float qf[1][VEC];
  pd_load_q<VEC>(q + seq * q_stride_seq + head * q_stride_head + slice * VEC, qf[0]);

  float m[1], l[1], acc[1][VEC];
  pd_attend<1, VEC, UNROLL>(qf, k_cache + kv_head * k_stride_head + slice * VEC, k_stride_page, k_stride_token,
                            v_cache + kv_head * v_stride_head + slice * VEC, v_stride_page, v_stride_token,
                            block_tables + seq * block_tables_stride, page_size, start, end, qk_scale_log2,
                            m, l, acc);
  pd_cta_publish<1, VEC>(m, l, acc, s_m, s_l, s_acc);

  float* slot = pd_split_slot(workspace, seq, num_q_heads, head, split, num_splits);
  for (int d = threadIdx.x; d < PD_HEAD_DIM; d += PD_THREADS) {
    float M, L, O;
    pd_cta_combine(s_m, s_l, s_acc, 0, d, M, L, O);
    pd_store_split(slot, d, M, L, O, v_scale);
  }
}

extern "C" __global__ void PD_LAUNCH_BOUNDS(PD_MERGE_THREADS, 4) simt_decode_splitk_merge(
    const float* __restrict__ workspace, int num_splits,
    pd_q_t* __restrict__ out, float* __restrict__ lse) {
  __shared__ unsigned short s_out[PD_HEAD_DIM];
  pd_merge_splits(workspace, num_splits, (const float*)nullptr, out, lse, s_out);
}
