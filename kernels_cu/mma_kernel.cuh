// mma_kernel.cuh: THE KERNEL: the one attention kernel of the three arms (its parameter
// list is the launch ABI), the schedule of its persistent CTAs over the work items (Item,
// pd_item, warm_item), and the split-K merge kernel.

#ifndef PD_MMA_KERNEL_CUH
#define PD_MMA_KERNEL_CUH

#include "mma_combine.cuh"

namespace pd_mma {

// Persistent CTAs: bring into L2 what the prologue of the CTA's next item
// (rows rw of q_row, its keys on bt_row) waits on: its q rows and the block-table entries of
// the tiles its warps take first (S tiles each from the first tile of its range). Only
// lines it will read are touched (no entry of a key outside its range); nothing is written,
// so no byte depends on it. Every thread calls it; a few issue prefetches. Leaves the item's
// keys [lo, hi) (cta_range) for issue_ahead.
template <class QRow>
__device__ __forceinline__ void warm_item(const Rows& rw, const Features& f, const QRow& q_row,
                                          const int* __restrict__ bt_row, int page_size, int& lo, int& hi) {
  constexpr int LINE = 128, ROW_LINES = (D * 2 + LINE - 1) / LINE + 1;  // + 1: a row need not start a line
  for (int i = threadIdx.x; i < rw.rows * ROW_LINES; i += THREADS) {
    const int r = i / ROW_LINES, k = i - r * ROW_LINES;
    const int byte = k * LINE < D * 2 ? k * LINE : D * 2 - 1;
    pd_prefetch_l2(reinterpret_cast<const unsigned char*>(q_row(r)) + byte);
  }
  cta_range(rw, f.window, lo, hi);
  if (lo >= hi) return;
  const int first = lo / TT * TT, end = first + S * W * TT < hi ? first + S * W * TT : hi;
  const int pages = (end - 1) / page_size - lo / page_size + 1;
  for (int i = threadIdx.x; i < pages; i += THREADS) pd_prefetch_l2(bt_row + lo / page_size + i);
}

}  // namespace pd_mma

// =======================================================================================
// THE KERNEL
// =======================================================================================
//
// The attention kernel of the three arms, written once: its parameter list (the launch
// ABI) and its body. Each arm's .cu names the kernel and picks the arm, then includes
// decode_core.cuh (decode_splitk.cu, for one):
//     #define PD_ENTRY decode_splitk    // the extern "C" name (plan.KERNELS)
//     #define PD_ARM PD_ARM_SPLITK      // PD_ARM_UNPACKED | PD_ARM_SPLITK | PD_ARM_GQA_PACKED
//
// The ABI. The three attention kernels take the one parameter list below: same names,
// same order, same types. Python reads it from this text (kernels.kernel_params, with the
// kernel's name PD_ENTRY taken from the including .cu's #define) and binds arguments by
// name (binding.ARGUMENTS; a parameter named after a LayerConfig field, as window_left,
// takes that field's value); the CPU shim reads the same list from the preprocessed
// source. A parameter an arm has no use for is taken and ignored: split-K writes the
// workspace and not out / lse (its merge does, below), the others the reverse, and the
// packed arm serves its compile-time PD_GQA heads per CTA (the host passes heads_per_cta
// = PD_GQA all the same); a feature's parameter is ignored where the feature is off. A
// feature that takes a value adds its parameter here and hands it to its hook in
// `Features` (the window: `int window_left`, `Window{window_left}`).
//
// Computes, for sequence s, query token i < q_len and query head h (kv head h / G, G =
// num_q_heads / num_kv_heads), over the keys t the token sees (row_range: t < L - q_len +
// 1 + i with L = seq_lens[s], from its window when there is one):
//   x_t = qk_scale * (q[s, i, h] . k_t)     (log2 units; soft-cap: cap_log2 tanh(qk_scale q.k))
//   out = v_scale * sum_t 2^(x_t - m) v_t / (sum_t 2^(x_t - m) [+ 2^(sink_h log2 e - m)])
//   lse = log of that denominator, with m added back (natural log, or base 2 with lse_scale
//         = 1; optional)
// with k_t, v_t row t of the sequence's paged cache (page block_tables[s, t / page_size],
// offset in page t % page_size). A token that sees no key gives out = 0 and lse = -inf.
// Split-K writes, instead of out and lse, each row's state over its split of the keys to
// the workspace (pd_splitk.cuh).
//
// Grid: the arm's (see its .cu); block PD_MMA_THREADS (PD_MMA_WARPS warps), dynamic shared memory
// PD_SMEM_BYTES. A CTA serves the heads head0 .. head0 + heads_per_cta - 1 of one sequence
// (heads of one KV head: heads_per_cta divides G) and its q_len query tokens,
// heads_per_cta * q_len <= 8 * PD_ROW_TILES; the host guarantees both (and q_len == 1
// unless multi_token). The core streams that KV head's K and V once for all of them; a
// row's bytes do not depend on heads_per_cta or q_len.
//
// Layout: q [num_seqs, q_len, num_q_heads, D] and the caches addressed by strides in
// elements (NHD and HND are both (stride_page, stride_token, stride_head)); K/V rows and
// q rows 16-byte aligned, last dim contiguous. out [num_seqs, q_len, num_q_heads, D]
// contiguous (fp32 with out_f32, else q's dtype), lse [num_seqs, q_len, num_q_heads] fp32
// or null, sinks [num_q_heads] fp32 (read only with sinks), workspace [num_seqs * q_len,
// num_q_heads, num_splits, D + 2] fp32 (split-K only).

namespace pd_mma {
// One work item (bx, by, bz) of the plan's gx x gy x gz grid of items (the arm's, its .cu): the query heads head0 .. head0 + heads - 1 (all of KV
// head kv_head) of sequence seq, split `split` of num_splits of its keys.
struct Item {
  int seq, split, num_splits, head0, heads, kv_head, num_q_heads;
};

// Where a sequence's length and its row of page ids come from: block_tables and seq_lens,
// or the CSR table (csr).
struct Tables {
  const int* block_tables;
  long long block_tables_stride;
  const int* seq_lens;
  Csr csr;
  int page_size;
  __device__ __forceinline__ int seq_len(int seq) const {
    return Csr::on ? csr.kv_len(seq, page_size) : seq_lens[seq];
  }
  __device__ __forceinline__ const int* row(int seq) const {
    return Csr::on ? csr.kv_pages(seq) : block_tables + seq * block_tables_stride;
  }
};
}  // namespace pd_mma

// The sequence of item `at` (x fastest) of a gx x gy x (any) grid: its by, or its bz on split-K.
__device__ __forceinline__ int pd_item_seq(int at, int gx, int gy) {
  return PD_ARM == PD_ARM_SPLITK ? at / (gx * gy) : (at / gx) % gy;
}

// Item (bx, by, bz) of a gx x gy x (any) grid of items.
__device__ __forceinline__ pd_mma::Item pd_item(int bx, int by, int bz, int gx, int gy, int num_kv_heads,
                                                int heads_per_cta) {
  pd_mma::Item it;
#if PD_ARM == PD_ARM_SPLITK
  it.split = by, it.seq = bz, it.num_splits = gy;
#else
  it.split = 0, it.seq = by, it.num_splits = 1;
  (void)bz;
  (void)gy;
#endif
#if PD_ARM == PD_ARM_GQA_PACKED
  // The pack: the PD_GQA heads of KV head bx, a row count the compiler knows.
  it.heads = PD_GQA;
  it.kv_head = bx;
  it.num_q_heads = num_kv_heads * PD_GQA;
  it.head0 = bx * PD_GQA;
  (void)heads_per_cta;
  (void)gx;
#else
  it.heads = heads_per_cta;
  it.num_q_heads = gx * heads_per_cta;
  it.head0 = bx * heads_per_cta;
  it.kv_head = it.head0 / (it.num_q_heads / num_kv_heads);
#endif
  return it;
}

// Item `at` of the plan's gx x gy x gz grid of items, x fastest (THE SCHEDULE's order). `at`
// is blockIdx.x (unsigned: the first item's, unsigned divisions) or an int.
template <class Index>
__device__ __forceinline__ pd_mma::Item pd_item_at(Index at, int gx, int gy, int num_kv_heads, int heads_per_cta) {
  return pd_item(at % gx, (at / gx) % gy, at / (gx * gy), gx, gy, num_kv_heads, heads_per_cta);
}

// The query rows of item `it`, whose sequence holds seq_len keys (a negative length: none).
__device__ __forceinline__ pd_mma::Rows pd_item_rows(const pd_mma::Item& it, int q_len, int seq_len) {
  return pd_mma::Rows{it.heads, q_len, it.heads * q_len, seq_len > 0 ? seq_len : 0, it.split, it.num_splits};
}

typedef pd_mma::OutF32::out_t pd_out_t;  // out's element: q's dtype, or fp32 (out_f32)

extern "C" __global__ void PD_LAUNCH_BOUNDS(PD_MMA_THREADS, 1) PD_ENTRY(
    // q: [num_seqs, q_len, num_q_heads, D] by strides in elements
    const pd_q_t* __restrict__ q,
    long long q_stride_seq, long long q_stride_token, long long q_stride_head,
    // the paged caches by strides in elements, and each sequence's row of page ids
    const pd_kv_t* __restrict__ k_cache,
    long long k_stride_page, long long k_stride_token, long long k_stride_head,
    const pd_kv_t* __restrict__ v_cache,
    long long v_stride_page, long long v_stride_token, long long v_stride_head,
    const int* __restrict__ block_tables, long long block_tables_stride, const int* __restrict__ seq_lens,
    // the geometry: heads_per_cta query heads (all of one KV head) and q_len tokens per CTA;
    // window: a token sees window_left keys before its own (-1: all)
    int num_kv_heads, int page_size, int heads_per_cta, int q_len, int window_left,
    // scores x = qk_scale q.k in log2 units (soft_cap: cap_log2 tanh(qk_scale q.k)), values
    // times v_scale; sinks: a sink logit per head (natural log)
    float qk_scale, float cap_log2, float v_scale, const float* __restrict__ sinks,
    // results: out and lse (unpacked, packed), or the split states (split-K)
    pd_out_t* __restrict__ out, float* __restrict__ lse, float* __restrict__ workspace,
    // device_scales: fp32 scales on the device, folded with sm_scale (and soft_cap) here;
    // lse in the caller's base: lse_scale = ln 2 (natural log) or 1 (base 2)
    const float* __restrict__ k_scales, long long k_scales_stride, const float* __restrict__ v_scales,
    long long v_scales_stride, double sm_scale, double soft_cap, float lse_scale,
    // csr: FlashInfer's page table in place of block_tables and seq_lens
    const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices, const int* __restrict__ kv_last_page_len,
    // the plan's grid of work items (x fastest): the persistent CTAs walk it, CTA b taking
    // items b, b + gridDim.x, ... (THE SCHEDULE)
    int items_x, int items_y, int items_z) {
  DYNAMIC_SHARED(unsigned char, smem);
  const pd_mma::Csr csr{kv_indptr, kv_indices, kv_last_page_len};
  const pd_mma::Tables tables{block_tables, block_tables_stride, seq_lens, csr, page_size};
  // THE SCHEDULE: the launch grid is (P, 1, 1), P <= items (binding.launch_grid_of: the CTAs
  // the device holds at once); CTA b serves items b, b + P, b + 2P, ... in that order. An
  // item's arithmetic is a function of the item alone, so a row's bytes do not depend on P:
  // the schedule changes only which CTA computes an item and when. While an item streams its keys, its CTA brings the next item's q rows and
  // the block-table entries of its first tiles into L2 (warm_item), so that item's prologue
  // waits on L2, not DRAM, for both; and each warp, done with its last tile of an item and
  // its state published, issues its first tiles of the next (issue_ahead), which
  // land while the CTA combines, stores and stages the next q.
  const int items = items_x * items_y * items_z;
  pd_mma::Carry carry{};  // what issue_ahead leaves the item's prologue
  // Item `at`'s first PREFETCH tiles, this warp's share, its keys [lo, hi) (issue_ahead).
  const auto issue_item = [&](int at, int lo, int hi) {
    const pd_mma::Item it = pd_item_at(at, items_x, items_y, num_kv_heads, heads_per_cta);
    pd_mma::issue_ahead(smem, lo, hi, reinterpret_cast<const unsigned char*>(k_cache + it.kv_head * k_stride_head),
                        k_stride_page, k_stride_token,
                        reinterpret_cast<const unsigned char*>(v_cache + it.kv_head * v_stride_head), v_stride_page,
                        v_stride_token, tables.row(it.seq), page_size, carry);
  };
  if (pd_mma::PREFETCH > 0 && (int)blockIdx.x < items) {  // the first item's, before anything else
    const pd_mma::Item it = pd_item_at(blockIdx.x, items_x, items_y, num_kv_heads, heads_per_cta);
    int lo, hi;
    pd_mma::cta_range(pd_item_rows(it, q_len, tables.seq_len(it.seq)), pd_mma::Window{window_left}, lo, hi);
    issue_item(blockIdx.x, lo, hi);
  }
  for (int at = blockIdx.x; at < items; at += gridDim.x) {
    if (at != (int)blockIdx.x) __syncthreads();  // the previous item's epilogue is done with shared memory
    const pd_mma::Item item = pd_item_at(at, items_x, items_y, num_kv_heads, heads_per_cta);
    const int next = at + gridDim.x;
    const bool last_item = next >= items;
    // The next item's length, loaded now so that it lands while this item stages q.
    const int upcoming_len = next < items ? tables.seq_len(pd_item_seq(next, items_x, items_y)) : 0;
    // Split-K: the merge is launched as this grid's programmatic dependent: it may start once
    // every CTA is in its last item (its launch then overlaps this grid's tail) and it waits for
    // this grid's end before it reads the workspace (pd_wait_prior_grids), so where this is
    // called moves only when the merge starts, never what it reads.
    if (PD_ARM == PD_ARM_SPLITK && last_item) pd_release_dependents();
    const int seq = item.seq, head0 = item.head0, heads = item.heads, num_q_heads = item.num_q_heads;
    const pd_mma::Rows rw = pd_item_rows(item, q_len, tables.seq_len(seq));
    // The features' values, as their hooks take them (sinks: no offset from a null pointer without the feature)
    const pd_mma::Features f{{window_left}, {cap_log2}, {pd_mma::Sinks::on ? sinks + head0 : nullptr},
                             {k_scales, k_scales_stride, v_scales, v_scales_stride, sm_scale, soft_cap}};
    float item_qk_scale = qk_scale, item_v_scale = v_scale;  // this item's KV head's (device_scales)
    if (pd_mma::DeviceScales::on) f.device_scales.kv_scales(item.kv_head, item_qk_scale, item_v_scale);

    const pd_mma::QRows q_rows{q + seq * q_stride_seq + head0 * q_stride_head, q_stride_token, q_stride_head, heads};
    int next_lo = 0, next_hi = 0;  // the next item's keys, from warm_item (kept: a shorter loop than recomputed)
    const auto between = [&]() {
      if (next >= items) return;
      // recomputed here, not kept from the loop's top: fewer registers live across stage_q
      const pd_mma::Item upcoming = pd_item_at(next, items_x, items_y, num_kv_heads, heads_per_cta);
      const pd_mma::QRows next_q{q + upcoming.seq * q_stride_seq + upcoming.head0 * q_stride_head, q_stride_token,
                                 q_stride_head, upcoming.heads};
      pd_mma::warm_item(pd_item_rows(upcoming, q_len, upcoming_len), f, next_q, tables.row(upcoming.seq), page_size,
                        next_lo, next_hi);
    };
    // Once a warp has published this item's state, the next item's first tiles. The last
    // item of a CTA issues none: no copy may be outstanding into shared memory at exit.
    const auto ahead = [&]() {
      if (pd_mma::PREFETCH > 0 && next < items) issue_item(next, next_lo, next_hi);
    };
    pd_mma::run_cta(smem, rw, f, q_rows,
                    item_qk_scale, k_cache + item.kv_head * k_stride_head, k_stride_page, k_stride_token,
                    v_cache + item.kv_head * v_stride_head, v_stride_page, v_stride_token, tables.row(seq), page_size,
                    between, carry, ahead);
#if PD_ARM == PD_ARM_SPLITK
    for (int idx = threadIdx.x; idx < rw.rows * PD_HEAD_DIM; idx += pd_mma::THREADS) {
      const int r = idx / PD_HEAD_DIM, d = idx - r * PD_HEAD_DIM;
      float M, L, O;
      pd_mma::cta_combine(smem, r, d, M, L, O);
      const int row = seq * q_len + r / heads, head = head0 + r % heads;
      pd_store_split(pd_split_slot(workspace, row, num_q_heads, head, item.split, item.num_splits), d, M, L, O,
                     item_v_scale);
    }
    (void)out;  // split-K writes states: out, lse and the sinks are the merge's
    (void)lse;
#else
    const long long row0 = (long long)seq * q_len * num_q_heads + head0;  // out[seq, 0, head0]
    pd_mma::store_rows(smem, rw, f, num_q_heads, item_v_scale, lse_scale, out + row0 * PD_HEAD_DIM,
                       lse == nullptr ? nullptr : lse + row0);
    (void)workspace;
#endif
  }
}

#if PD_ARM == PD_ARM_SPLITK
// The split-K merge: grid (num_q_heads, num_seqs * q_len), a thread per output dim (at most
// PD_MERGE_THREADS; kernels.merge_threads); the merge of pd_splitk.cuh, splits 0..n-1 in
// order, then the sink (Sinks::merge_transform).
extern "C" __global__ void PD_LAUNCH_BOUNDS(PD_MERGE_THREADS, 4) decode_splitk_merge(
    const float* __restrict__ workspace, int num_splits, const float* __restrict__ sinks,
    pd_out_t* __restrict__ out, float* __restrict__ lse, float lse_scale) {
  __shared__ unsigned short s_out[PD_HEAD_DIM];
  pd_wait_prior_grids();  // launched as the attention grid's dependent: its states are complete only now
  pd_merge_splits(workspace, num_splits, pd_mma::Sinks::merge_transform(sinks), out, lse, lse_scale, s_out);
}
#endif

#endif  // PD_MMA_KERNEL_CUH
