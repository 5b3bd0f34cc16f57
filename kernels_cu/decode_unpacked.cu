// decode_unpacked.cu: paged-decode attention on tensor cores (impl "mma"), one split: the
// kernel of decode_core.cuh (what it computes, its parameters, the layout, the features)
// on the unpacked arm.
//
// Grid (num_q_heads / heads_per_cta, num_seqs), block PD_MMA_THREADS (PD_MMA_WARPS warps), dynamic
// shared memory PD_SMEM_BYTES. CTA (x, s) serves the heads_per_cta heads x *
// heads_per_cta .. of sequence s and its q_len query tokens over all of each row's keys,
// and writes their out and lse rows.
//
// Defines: as decode_core.cuh.
//
// Performance notes: benchmarks/NOTES.md; the budgets are held by
// the static SASS report (python -m benchmarks.sass_model).

#define PD_ENTRY decode_unpacked
#define PD_ARM PD_ARM_UNPACKED
#include "decode_core.cuh"
