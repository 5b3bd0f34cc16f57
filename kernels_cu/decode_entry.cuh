// decode_entry.cuh: the attention kernel of the "mma" implementation, written once for its
// three arms: its parameter list (the launch ABI) and its body. Each arm's .cu names the
// kernel and picks the arm, then includes this file (decode_splitk.cu, for one):
//     #define PD_ENTRY decode_splitk    // the extern "C" name (plan.KERNELS)
//     #define PD_ARM PD_ARM_SPLITK      // PD_ARM_UNPACKED | PD_ARM_SPLITK | PD_ARM_GQA_PACKED
//
// The ABI. The three attention kernels take the one parameter list below: same names,
// same order, same types. Python reads it from this text (kernels.kernel_params, with the
// kernel's name PD_ENTRY taken from the including .cu's #define) and passes arguments by
// name (attention.LAUNCH_ARGUMENTS); the CPU shim reads the same list from the
// preprocessed source. A parameter an arm has no use for is taken and ignored: split-K
// writes the workspace and not out / lse (its merge does, decode_splitk.cu), the others
// the reverse, and the packed arm serves its compile-time PD_GQA heads per CTA (the host
// passes heads_per_cta = PD_GQA all the same).
//
// Computes, for sequence s, query token i < q_len and query head h (kv head h / G, G =
// num_q_heads / num_kv_heads), over the keys t the token sees (decode_core.cuh row_range:
// t < L - q_len + 1 + i with L = seq_lens[s], from its window when there is one):
//   x_t = qk_scale * (q[s, i, h] . k_t)     (log2 units; soft-cap: cap_log2 tanh(qk_scale q.k))
//   out = v_scale * sum_t 2^(x_t - m) v_t / (sum_t 2^(x_t - m) [+ 2^(sink_h log2 e - m)])
//   lse = ln of that denominator, with m added back (natural log; optional)
// with k_t, v_t row t of the sequence's paged cache (page block_tables[s, t / page_size],
// slot t % page_size). A token that sees no key gives out = 0 and lse = -inf. Split-K
// writes, instead of out and lse, each row's state over its split of the keys to the
// workspace (pd_splitk.cuh).
//
// Grid: the arm's (see its .cu); block PD_THREADS (4 warps), dynamic shared memory
// PD_SMEM_BYTES. A CTA serves the heads head0 .. head0 + heads_per_cta - 1 of one sequence
// (heads of one KV head: heads_per_cta divides G) and its q_len query tokens,
// heads_per_cta * q_len <= 8 * PD_ROW_TILES; the host guarantees both (and q_len == 1
// unless PD_MULTI_TOKEN). The core streams that KV head's K and V once for all of them; a
// row's bytes do not depend on heads_per_cta or q_len.
//
// Layout: q [num_seqs, q_len, num_q_heads, D] and the caches addressed by strides in
// elements (NHD and HND are both (stride_page, stride_token, stride_head)); K/V rows and
// q rows 16-byte aligned, last dim contiguous. out [num_seqs, q_len, num_q_heads, D]
// contiguous (fp32 with PD_OUT_F32, else q's dtype), lse [num_seqs, q_len, num_q_heads]
// fp32 or null, sinks [num_q_heads] fp32 (read only with PD_SINKS), workspace
// [num_seqs * q_len, num_q_heads, num_splits, D + 2] fp32 (split-K only).
//
// Defines: PD_ENTRY, PD_ARM (the arm's .cu; the packed arm PD_GQA too), and decode_core.cuh's.

#ifndef PD_DECODE_ENTRY_CUH
#define PD_DECODE_ENTRY_CUH

#include "decode_core.cuh"

#define PD_ARM_UNPACKED 0
#define PD_ARM_SPLITK 1
#define PD_ARM_GQA_PACKED 2

#if !defined(PD_ENTRY) || !defined(PD_ARM)
#error "define PD_ENTRY (the kernel's name) and PD_ARM (PD_ARM_UNPACKED | _SPLITK | _GQA_PACKED) first"
#endif
#if PD_ARM != PD_ARM_UNPACKED && PD_ARM != PD_ARM_SPLITK && PD_ARM != PD_ARM_GQA_PACKED
#error "PD_ARM must be PD_ARM_UNPACKED, PD_ARM_SPLITK or PD_ARM_GQA_PACKED"
#endif
#if PD_ARM == PD_ARM_GQA_PACKED && !defined(PD_GQA)
#error "the packed arm's .cu defines PD_GQA, the heads of one CTA"
#endif

extern "C" __global__ void PD_LAUNCH_BOUNDS(PD_THREADS, 1) PD_ENTRY(
    // q: [num_seqs, q_len, num_q_heads, D] by strides in elements
    const pd_q_t* __restrict__ q,
    long long q_stride_seq, long long q_stride_token, long long q_stride_head,
    // the paged caches by strides in elements, and each sequence's row of page ids
    const pd_kv_t* __restrict__ k_cache,
    long long k_stride_page, long long k_stride_token, long long k_stride_head,
    const pd_kv_t* __restrict__ v_cache,
    long long v_stride_page, long long v_stride_token, long long v_stride_head,
    const int* __restrict__ block_tables, long long block_tables_stride, const int* __restrict__ seq_lens,
    // the geometry: heads_per_cta query heads (all of one KV head) and q_len tokens per CTA
    int num_kv_heads, int page_size, int heads_per_cta, int q_len, int window_left,
    // scores x = qk_scale q.k in log2 units (soft-cap: cap_log2 tanh(qk_scale q.k)), values
    // times v_scale, a sink logit per head (natural log)
    float qk_scale, float cap_log2, float v_scale, const float* __restrict__ sinks,
    // results: out and lse (unpacked, packed), or the split states (split-K)
    pd_out_t* __restrict__ out, float* __restrict__ lse, float* __restrict__ workspace) {
  DYNAMIC_SHARED(unsigned char, smem);
#if PD_ARM == PD_ARM_SPLITK
  const int split = blockIdx.y, seq = blockIdx.z, num_splits = gridDim.y;
#else
  const int split = 0, seq = blockIdx.y, num_splits = 1;
#endif
#if PD_ARM == PD_ARM_GQA_PACKED
  // The pack: the PD_GQA heads of KV head blockIdx.x, a row count the compiler knows.
  constexpr int heads = PD_GQA;
  const int kv_head = blockIdx.x;
  const int num_q_heads = num_kv_heads * PD_GQA;
  const int head0 = kv_head * PD_GQA;
  (void)heads_per_cta;
#else
  const int heads = heads_per_cta;
  const int num_q_heads = gridDim.x * heads_per_cta;
  const int head0 = blockIdx.x * heads_per_cta;
  const int kv_head = head0 / (num_q_heads / num_kv_heads);
#endif
  const int seq_len = seq_lens[seq];
  const pd_mma::Rows rw{heads, q_len, heads * q_len, seq_len > 0 ? seq_len : 0, window_left, split, num_splits};

  const pd_mma::QRows q_rows{q + seq * q_stride_seq + head0 * q_stride_head, q_stride_token, q_stride_head, heads};
  pd_mma::run_cta(smem, rw, q_rows,
                  qk_scale, cap_log2, k_cache + kv_head * k_stride_head, k_stride_page, k_stride_token,
                  v_cache + kv_head * v_stride_head, v_stride_page, v_stride_token,
                  block_tables + seq * block_tables_stride, page_size);
#if PD_ARM == PD_ARM_SPLITK
  for (int idx = threadIdx.x; idx < rw.rows * PD_HEAD_DIM; idx += PD_THREADS) {
    const int r = idx / PD_HEAD_DIM, d = idx - r * PD_HEAD_DIM;
    float M, L, O;
    pd_mma::cta_combine(smem, r, d, M, L, O);
    const int row = seq * q_len + r / heads, head = head0 + r % heads;
    pd_store_split(pd_split_slot(workspace, row, num_q_heads, head, split, num_splits), d, M, L, O, v_scale);
  }
  (void)sinks;  // the sink enters once, in the merge
  (void)out;
  (void)lse;
#else
  const long long row0 = (long long)seq * q_len * num_q_heads + head0;  // out[seq, 0, head0]
  pd_mma::store_rows(smem, rw, num_q_heads, v_scale, PD_SINKS ? sinks + head0 : nullptr, out + row0 * PD_HEAD_DIM,
                     lse == nullptr ? nullptr : lse + row0);
  (void)workspace;
#endif
}

#endif  // PD_DECODE_ENTRY_CUH
