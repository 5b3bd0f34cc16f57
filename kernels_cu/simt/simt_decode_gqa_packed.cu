// simt_decode_gqa_packed.cu: paged-decode attention on CUDA cores (impl "simt", the
// reference implementation; see simt/README.md) with the PD_GQA query heads of one KV
// head packed into one CTA (GQA packing), head dim PD_HDIM only.
//
// The kernel of simt/simt_core.cuh (its parameters, the layout) on the packed arm:
// computes the same function as simt_decode_unpacked.cu for the query heads
// kv_head * PD_GQA + j, j = 0..PD_GQA-1 (so num_q_heads = num_kv_heads * PD_GQA), but
// each K and V row of the KV head is read from memory ONCE for all PD_GQA heads:
//   x_{j,t} = qk_scale * (q[s, kv*G + j] . k_t),
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
// Layout: as simt/simt_core.cuh (strides in elements, NHD and HND alike).
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

#define PD_GQA 6
#define PD_HDIM 256

#define PD_ENTRY simt_decode_gqa_packed
#define PD_ARM PD_ARM_GQA_PACKED
#include "simt/simt_core.cuh"

#if PD_HEAD_DIM != PD_HDIM
#error "simt_decode_gqa_packed is compiled only for PD_HEAD_DIM == PD_HDIM (256)"
#endif
