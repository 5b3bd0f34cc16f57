// decode_splitk.cu: paged-decode attention on tensor cores (impl "mma") split along the
// KV sequence (split-K), and the merge of the splits: the kernels of decode_core.cuh
// (what they compute, their parameters, the layout, the features) on the split-K arm.
//
// decode_splitk: grid (num_q_heads / heads_per_cta, num_splits, num_seqs), block
//   PD_THREADS, dynamic shared memory PD_SMEM_BYTES. CTA (x, i, s) serves the
//   heads_per_cta heads x * heads_per_cta .. of sequence s and its q_len tokens (one KV
//   head; see decode_unpacked.cu) over split i of each row's keys (row_range) and writes,
//   for each row, its workspace slot (pd_split_slot with row seq * q_len + t): the slot
//   addressing and the split ranges do not depend on heads_per_cta, and neither do the
//   bytes.
// decode_splitk_merge: grid (num_q_heads, num_seqs * q_len), a thread per output dim (at most
//   PD_MERGE_THREADS; kernels.merge_threads); the merge of pd_splitk.cuh, splits 0..n-1 in
//   order, then the sink (with sinks). Launched as
//   decode_splitk's programmatic dependent (sm_90 and later): each decode_splitk CTA releases
//   it at the start of its last item, and it waits for decode_splitk's end before it reads.
//
// Batch invariance: a split's range, every reduction order inside the CTA and the merge
// order depend only on (L, num_splits), so a sequence's bytes do not depend on what it
// is batched with as long as num_splits does not (auto / pinned).
//
// Layout: as decode_core.cuh; workspace [num_seqs * q_len, num_q_heads, num_splits, D + 2]
// fp32. Defines: as decode_core.cuh, PD_MIN_KV_PER_SPLIT among them (pd_splitk.cuh).
//
// Performance notes: benchmarks/NOTES.md.

#define PD_ENTRY decode_splitk
#define PD_ARM PD_ARM_SPLITK
#include "decode_core.cuh"
