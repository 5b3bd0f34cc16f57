// simt_decode_unpacked.cu: paged-decode attention on CUDA cores (impl "simt", the
// reference implementation; see simt/README.md), one query head per CTA: the kernel of
// simt/simt_core.cuh (what it computes, its parameters, the layout) on the unpacked arm.
//
// Grid (num_q_heads, num_seqs), block PD_THREADS (128 = 4 warps); CTA (h, s) attends
// query head h of sequence s over all its keys and writes its out and lse rows. Multi-token
// (the _multi_token specs): grid (num_q_heads, num_seqs * q_len), CTA (h, s * q_len + i) attends token
// i over its causal prefix (simt/simt_core.cuh, THE KERNEL). Each
// thread owns a 16-byte slice of the head dim (VEC = 8 bf16/fp16 or 16 fp8 elements).
//
// Defines: PD_HEAD_DIM, PD_Q_DTYPE, PD_KV_DTYPE (see pd_common.cuh).
//
// Performance notes (not measured yet; see benchmarks/NOTES.md): the CTA streams
// 2 * L * D * sizeof(KV) bytes; each thread issues 8 independent 16-byte loads per tile
// (4 KB in flight per warp). nvcc (sm_90, __launch_bounds__(128, 4)): ~80-90 registers
// for bf16/fp16 KV, 117 for fp8, no spills, so 4-6 CTAs (16-24 warps, 64-96 KB of loads
// in flight) per SM, several times what HBM latency x bandwidth needs per SM (~25 KB),
// provided the grid has that many CTAs. Per 16 bytes of K or V a thread spends ~1 (bf16),
// ~2.5 (fp16) or ~3.5 (fp8) integer ops per element on conversion (see pd_kv_slice) plus
// one FMA, and ~20 integer ops per token on the 64-bit row address: bf16 leaves the SM
// issue slots mostly idle, fp8 uses an estimated ~60-80% of the integer pipe at HBM
// speed, so fp8 is the spec most at risk of being ALU-bound. Limits: one CTA per
// (head, seq) means few CTAs at small batch (that is what split-K is for); the q heads
// of one GQA group each re-read the same KV rows (served by L2 when they run together,
// which adjacent blockIdx.x makes likely). Next steps: hardware fp8->f16x2 conversion
// (cvt.rn.f16x2.e4m3x2, exact) behind __CUDA_ARCH__ if the dialect allows it,
// precomputed 64-bit row offsets per lane, a second tile of loads in flight per warp for
// low-occupancy shapes, and an L2 evict-first hint on K/V.

#define PD_ENTRY simt_decode_unpacked
#define PD_ARM PD_ARM_UNPACKED
#include "simt/simt_core.cuh"
