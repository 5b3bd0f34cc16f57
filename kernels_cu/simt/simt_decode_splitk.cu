// simt_decode_splitk.cu: paged-decode attention on CUDA cores (impl "simt", the
// reference implementation; see simt/README.md) split along the KV sequence (split-K),
// and the merge of the splits: the kernels of simt/simt_core.cuh (what they compute,
// their parameters, the layout) on the split-K arm.
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
//   workspace is never initialized by the host. Multi-token (the _multi_token specs): grid
//   (num_q_heads, num_splits, num_seqs * q_len): blockIdx.z is the row s * q_len + j of query
//   token j, whose L is its causal prefix's L - q_len + 1 + j keys, and it writes slot
//   ((row * num_q_heads) + h) * num_splits + i (simt/simt_core.cuh, THE KERNEL).
//
// simt_decode_splitk_merge: grid (num_q_heads, num_seqs (x q_len: one a row)), block PD_MERGE_THREADS.
//   Combines the splits of (s, h) in the fixed order 0..n-1:
//     M = max m_i; w_i = l_i 2^(m_i - M); L = sum w_i; out = sum w_i o_i / L;
//     lse = (M + log2 L) ln 2 (natural log; lse may be null).
//   M = -inf (no token at all, seq_len 0) gives out = 0 and lse = -inf.
//
// Layout: as simt/simt_core.cuh (strides in elements, NHD and HND alike); workspace
// [num_seqs, num_q_heads, num_splits, D + 2] fp32 (slots are not 16-byte aligned, so they
// are written and read with scalar accesses).
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

#define PD_ENTRY simt_decode_splitk
#define PD_ARM PD_ARM_SPLITK
#include "simt/simt_core.cuh"
