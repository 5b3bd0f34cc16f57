// decode_gqa_packed.cu: the gated GQA-packed paged decode on the tensor-core core (impl
// "mma"): the PD_GQA query heads of one KV head in one CTA, head dim PD_HDIM only; the
// kernel of decode_core.cuh (what it computes, its parameters, the layout, the features)
// on the packed arm.
//
// Computes the same function as decode_unpacked.cu (same core, rows = PD_GQA), so its
// bytes equal the unpacked arm's at heads_per_cta = PD_GQA: grid (num_kv_heads,
// num_seqs), block PD_THREADS, dynamic shared memory PD_SMEM_BYTES; CTA (g, s) serves
// heads g * PD_GQA .. g * PD_GQA + PD_GQA - 1 of sequence s (num_q_heads = num_kv_heads *
// PD_GQA and one query token, which the policy's gqa_pack_shape_ok and the plan guarantee).
//
// PD_GQA and PD_HDIM are defined here; Python reads them back from this text and refuses
// to load the kernel when they differ from the policy's DECODE_GQA_PACK_WIDTH /
// DECODE_GQA_PACK_HEAD_DIM. Other defines as decode_core.cuh (PD_ROW_TILES must hold
// PD_GQA rows).
//
// Performance notes: benchmarks/NOTES.md.

#define PD_GQA 6
#define PD_HDIM 256

#define PD_ENTRY decode_gqa_packed
#define PD_ARM PD_ARM_GQA_PACKED
#include "decode_core.cuh"

#if PD_HEAD_DIM != PD_HDIM
#error "decode_gqa_packed is compiled only for PD_HEAD_DIM == PD_HDIM (256)"
#endif
static_assert(PD_GQA <= pd_mma::ROWS, "PD_ROW_TILES must hold the pack width");
