// mma_features.cuh: THE FEATURES of the "mma" core (one struct per entry of
// config.FEATURES, with the hooks the core calls; the section comment below lists them),
// `Features` (their runtime values), and the keys of a row (row_range, cta_range), where
// the window and multi_token enter.

#ifndef PD_MMA_FEATURES_CUH
#define PD_MMA_FEATURES_CUH

#include "mma_layout.cuh"

#if !defined(PD_MULTI_TOKEN) || !defined(PD_WINDOW) || !defined(PD_SOFT_CAP) || !defined(PD_SINKS) || \
    !defined(PD_OUT_F32) || !defined(PD_DEVICE_SCALES) || !defined(PD_CSR)
#error "PD_MULTI_TOKEN, PD_WINDOW, PD_SOFT_CAP, PD_SINKS, PD_OUT_F32, PD_DEVICE_SCALES and PD_CSR must be defined (0 or 1)"
#endif

namespace pd_mma {

// =======================================================================================
// THE FEATURES
// =======================================================================================
//
// One struct per feature of config.FEATURES, named after it: `on` is its define
// PD_<NAME> (0 | 1, from Python; an enum, since NVRTC emits a static constexpr member as a
// global), and its hooks hold the feature's code. The core is the plain algorithm; where a
// feature enters it reads `Feature::on ? hook : plain`, a constant the front end folds
// before anything is emitted, so a spec without the feature compiles none of its code
// and its SASS is the plain core's, instruction for instruction (a hook called
// unconditionally, even one returning the plain value, moves the plain specs' SASS):
//
// The hooks, one vocabulary for every feature (after FlashInfer's attention/variants.cuh);
// a feature defines only those it uses:
//   first_key         the keys a row sees: where they start
//   logits_mask       the keys each column of a score tile sees (FlashInfer's LogitsMask)
//   logits_transform  a logit from a raw score (LogitsTransform)
//   output_transform  a row's state before its output is written (OutputTransform), and
//   merge_transform     what the split-K merge folds after the splits
//   out_t, output_store  out's element, and how one value is written
//   kv_scales         a KV head's score and value scales
//   kv_pages, kv_len  a sequence's page ids and its length
//
// The features (tests/test_kernel_sources.py checks this list against config.FEATURES):
//   feature        struct        hooks                            called in       plain path
//   multi_token    MultiToken    logits_mask                      attend: logits  every column sees
//                                                                                 the CTA's keys
//   window         Window        first_key                        row_range       keys from 0
//   soft_cap       SoftCap       logits_transform (the tile then  attend: logits  the raw score, its
//                                holds x: the max and the                         scale entering in
//                                weights take no scale)                           the max and exp2's fmaf
//   sinks          Sinks         output_transform,                store_rows;     no sink
//                                merge_transform                  the merge
//   out_f32        OutF32        out_t, output_store              store_rows;     q's dtype, staged
//                                                                 the kernels     in shared memory
//   device_scales  DeviceScales  kv_scales                        the kernel      the host's scales
//   csr            Csr           kv_pages, kv_len                 the kernel      block_tables, seq_lens
//
// A feature's runtime value (window_left, cap_log2, sinks) is a parameter of the kernel
// (mma_kernel.cuh), which fills `Features` from its parameters; the core
// hands `Features` to the hooks. A feature that changes which pages a call reads also
// tells the host (validation.check_indices, as the window does); one that changes the
// split-K merge works through pd_splitk.cuh (as the sinks do).

// window (PD_WINDOW): a sliding window, FlashInfer's convention: a token at position p
// sees the keys [p - window_left, p]; window_left = -1: none. The keys a row sees start
// there (row_range); a split then tiles the window only, and block-table entries of keys
// before every window are never read.
struct Window {
  enum { on = PD_WINDOW };
  int left;  // window_left, the kernel parameter

  // The first key of a token that sees the keys before position `seen` (its own is seen - 1).
  __device__ __forceinline__ int first_key(int seen) const {
    int first = 0;
    if (left >= 0) {
      const int w0 = seen - 1 - left;  // a token at position seen - 1 sees [seen - 1 - w, seen - 1]
      first = w0 > 0 ? w0 : 0;
    }
    return first;
  }
};

// soft_cap (PD_SOFT_CAP): the logits soft-cap, x = cap_log2 tanh(qk_scale q.k) (the host
// folds sm_scale * k_scale / cap into qk_scale and cap * log2 e into cap_log2). The
// LogitsTransform: a tile then holds x itself, in log2 units (the plain tile holds the
// raw q.k, and the row's scale enters in the max and in one fmaf per weight).
struct SoftCap {
  enum { on = PD_SOFT_CAP };
  float cap_log2;  // the kernel parameter

  // x of a raw score s of a row whose score scale is `scale`.
  __device__ __forceinline__ float logits_transform(float s, float scale) const { return cap_log2 * tanhf(s * scale); }
};

// sinks (PD_SINKS): a learned sink logit per head (natural-log units of the scaled scores)
// joins the softmax denominator and contributes no value. The OutputTransform: it enters
// once per row, after every key: into the CTA's state before the output is written
// (unpacked, packed), or in the split-K merge after the splits (pd_merge_splits of
// pd_splitk.cuh; the split states never see it).
struct Sinks {
  enum { on = PD_SINKS };
  const float* logit;  // the CTA's heads' sinks (sinks + head0)

  // Fold head h's sink into its state (M, L, O) (pd_add_sink). True when the sink alone
  // is the state: its lse is then the sink itself, logit[h].
  __device__ __forceinline__ bool output_transform(int h, float& M, float& L, float& O) const {
    return pd_add_sink(logit[h], M, L, O);
  }
  // What the split-K merge folds after the splits: every head's sink, or none.
  __device__ __forceinline__ static const float* merge_transform(const float* sinks) { return on ? sinks : nullptr; }
};

// out_f32 (PD_OUT_F32): out (and the split-K merge's out) in fp32 instead of q's dtype:
// each value goes straight to out, where the plain path stages bf16/fp16 in shared memory
// (where q was) and stores each token's heads as 16-byte spans.
struct OutF32 {
  enum { on = PD_OUT_F32 };
#if PD_OUT_F32
  typedef float out_t;
#else
  typedef pd_q_t out_t;  // bf16 / fp16 bits, q's dtype
#endif

  // Element d of the row at out_row0[at * D].
  __device__ __forceinline__ static void output_store(out_t* out_row0, long long at, int d, float value) {
    reinterpret_cast<float*>(out_row0)[at * D + d] = value;
  }
};

// device_scales (PD_DEVICE_SCALES): the dequantization scales are fp32 values on the device,
// one for the tensor (stride 0) or one per KV head (stride 1), that a CTA reads for its KV
// head and folds with sm_scale (and the soft-cap) as the host folds host floats: the rule is
// pd_common.cuh's pd_device_kv_scales, which the simt kernel calls too.
struct DeviceScales {
  enum { on = PD_DEVICE_SCALES };
  const float* k;  // k_scales, k_scales_stride: the kernel parameters
  long long k_stride;
  const float* v;
  long long v_stride;
  double sm_scale, soft_cap;

  // The score scale and the value scale of KV head `kv_head`.
  __device__ __forceinline__ void kv_scales(int kv_head, float& qk_scale, float& v_scale) const {
    pd_device_kv_scales(k, k_stride, v, v_stride, sm_scale, SoftCap::on, soft_cap, kv_head, qk_scale, v_scale);
  }
};

// csr (PD_CSR): FlashInfer's CSR page table, read as it is (no conversion to a dense
// table): sequence s's pages are kv_indices[kv_indptr[s] .. kv_indptr[s + 1]) and its last
// page holds kv_last_page_len[s] tokens. The kernel takes a sequence's row of page ids and
// its length from them instead of block_tables and seq_lens (pd_common.cuh's pd_csr_pages
// and pd_csr_len, which the simt kernel calls too: the last page's count clamped to
// 0 .. page_size, so a CTA never reads past its sequence's own pages).
struct Csr {
  enum { on = PD_CSR };
  const int* indptr;  // kv_indptr, kv_indices, kv_last_page_len: the kernel parameters
  const int* indices;
  const int* last_page_len;

  // Sequence seq's page ids, in order.
  __device__ __forceinline__ const int* kv_pages(int seq) const { return pd_csr_pages(indptr, indices, seq); }
  // Its length in tokens: (pages - 1) * page_size + the last page's count, or 0 with no page.
  __device__ __forceinline__ int kv_len(int seq, int page_size) const {
    return pd_csr_len(indptr, last_page_len, seq, page_size);
  }
};

// The features' runtime values, filled by the kernel from its parameters.
struct Features {
  Window window;
  SoftCap soft_cap;
  Sinks sinks;
  DeviceScales device_scales;
};

// The keys of query token t (row_range, after this section); multi_token masks with them.
__device__ __forceinline__ void row_range(const Rows& rw, const Window& window, int t, int& lo, int& hi);

// multi_token (PD_MULTI_TOKEN): q_len > 1 query tokens per sequence (speculative
// verification, MTP); token t sees L - q_len + 1 + t keys (row_range), so the rows of a
// CTA see different keys. The LogitsMask: a column of a score tile (query row nt * 8 + 2t
// + j of lane (g, t)) sees the keys [lo[nt][j], hi[nt][j]) of its own row; padding rows
// see none. (The plain path's rows all see the CTA's keys.)
struct MultiToken {
  enum { on = PD_MULTI_TOKEN };

  // The keys [lo, hi) of each of this lane's columns (t = lane % 4).
  __device__ __forceinline__ static void logits_mask(const Rows& rw, const Features& f, int t, int (&lo)[NT][2],
                                                 int (&hi)[NT][2]) {
    PD_UNROLL
    for (int nt = 0; nt < NT; ++nt)
      PD_UNROLL
      for (int j = 0; j < 2; ++j) {
        const int r = nt * 8 + 2 * t + j;
        lo[nt][j] = 0;
        hi[nt][j] = 0;
        if (r < rw.rows) row_range(rw, f.window, r / rw.heads, lo[nt][j], hi[nt][j]);
      }
  }
};

// =======================================================================================

// -- the keys of a row -----------------------------------------------------------------

// Keys [lo, hi) query token t sees: its causal prefix (L - q_len + 1 + t keys), from its
// window's first key (the window feature), cut to split `split` of `num_splits` by the
// split rule of pd_splitk.cuh applied to that range alone (so the split covers the
// window only and depends on the row's own keys, never on the batch or on the other rows).
__device__ __forceinline__ void row_range(const Rows& rw, const Window& window, int t, int& lo, int& hi) {
  int seen = rw.seq_len - rw.q_len + 1 + t;  // causal: positions < seen
  seen = seen > 0 ? seen : 0;
  const int first = Window::on ? window.first_key(seen) : 0;
  int a, b;
  pd_split_range(seen - first, rw.split, rw.num_splits, a, b);
  lo = first + a;
  hi = first + b;
}

// The CTA's key range: the union of its rows' ranges (empty when every row's is).
__device__ __forceinline__ void cta_range(const Rows& rw, const Window& window, int& lo, int& hi) {
  lo = 0;
  hi = 0;
  for (int t = 0; t < rw.q_len; ++t) {
    int a, b;
    row_range(rw, window, t, a, b);
    if (a >= b) continue;
    if (hi == 0 || a < lo) lo = a;
    if (b > hi) hi = b;
  }
}

}  // namespace pd_mma

#endif  // PD_MMA_FEATURES_CUH
