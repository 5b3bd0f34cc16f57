// mma_stream.cuh: the K/V stream, one warp's producer: its tiles of the CTA's keys
// (warp_tiles), the page lookups (block-table entries staged in the ring's row pads), the
// cp.async copies of each tile into the warp's ring of S stages (issue_tile), and the next
// item's first tiles issued ahead (issue_ahead).

#ifndef PD_MMA_STREAM_CUH
#define PD_MMA_STREAM_CUH

#include "mma_layout.cuh"

namespace pd_mma {

// -- the K/V stream ------------------------------------------------------------------

// The block-table entries through shared memory. Loaded one tile ahead, an entry would
// arrive ~450 cycles before its use: less than a DRAM miss, so a tile whose entry misses
// would wait. Staged, lane i < TT copies the entry of
// its token of the warp's tile j + S - 1 with the K/V copies of tile j, in the same commit
// group (a 4-byte cp.async), into the 16-byte pad of K row i of the stage that tile will
// use (entry_at): no K/V copy and no ldmatrix touches a pad, so the entry waits there
// beside the tile the stage still holds, and costs no shared memory. The wait_group that
// lets tile j be read has landed it too, and issue_tile reads it S - 1 tiles later, just
// before that stage is refilled. Each lane reads only the entries it copied, so no barrier
// is needed beyond wait_group. The first S - 1 tiles' entries are loaded in the prologue
// (start_entries).

// PD_LANE_OFFSETS (derived here, not given: the 8-warp tilings of 16-bit caches,
// where the SM's shared memory paces a tile): each copying lane computes its own RPL rows' K and V addresses. Row r's
// block-table entry is the one lane r staged in the pad of K row r (entry_at: one LDS.32 a
// row, one wavefront, read after the wait_group and the __syncwarp that make every lane's
// landed copies visible to the warp); its offset in its page is
// (in_page(token lane) + r - lane) mod page_size, from the lane's own in_page (every lane
// tracks token lane's), taken mod page_size by a multiply-high with ceil(2^31 / page_size)
// (exact for every page size 1..256 on the values below 2^22 it sees). The entry producer
// stores 0 for a key outside the range, so an out-of-range row's source is row (its token
// mod page_size) of page 0, an element of the cache like the table's row 0, copied with
// src-size 0 (nothing read). Otherwise (fp8, whose tiles issue paces; 6, 4 and 2 warps,
// whose chains bind) lane r < TT computes its token's 64-bit offsets once and
// the copying lanes read them from the warp's offsets table: one STS.128 and RPL LDS.128 a
// tile, each LDS.128 four quarter-warp wavefronts. The same bytes land either way. The
// preprocessor, not a constexpr branch, picks the path, so neither path's source (or SASS)
// carries the other's.
#if (PD_KV_DTYPE == PD_DTYPE_BF16 || PD_KV_DTYPE == PD_DTYPE_FP16) && PD_MMA_WARPS == 8
#define PD_LANE_OFFSETS 1
static_assert(ES == 2 && TT <= 32, "2-byte elements; the in-page offsets stay below 2^22 (page_magic)");
#else
#define PD_LANE_OFFSETS 0
#endif

// One warp's producer: lane i < TT owns token i of the warp's next tile to issue.
// Token positions and page indices are unsigned: the producer advances up to S x W x TT
// tokens past the last key it loads (the staged entry producer S - 1 tiles more), past
// 2^31 near INT32_MAX keys (never near 2^32); unsigned, that is defined and every
// comparison with [lo, hi) stays exact.
struct Stream {
  const unsigned char* k_lane;  // k_cache + kv_head * k_stride_head + this lane's 16-byte chunk
  const unsigned char* v_lane;
  const int* bt_row;
  int page_size;
  unsigned lo, hi;          // the CTA's keys [lo, hi)
  unsigned tok, page;          // this lane's token of the next tile and its page index
  int in_page;                 // the token's offset in its page
  int step_pages, step_in_page;  // W * TT tokens as whole pages + an offset in page
  unsigned etok, epage;        // the entry producer: this lane's token (and its page index) of the tile
  int ein_page;                //   whose entry is copied next, S - 1 of this warp's tiles on
  unsigned char* ring;         // this warp's ring of S stages
#if PD_LANE_OFFSETS
  unsigned page_magic;         // ceil(2^31 / page_size)
  int row_bias;                // 2 (this lane's first row - lane + 32 page_size): positive (32 page_size > lane)
#endif
};

// Where lane `lane` keeps the block-table entry of the tile stage `slot` takes next
// (the pad of K row `lane`, past the zero-filled dims of a padded row).
__device__ __forceinline__ int* entry_at(unsigned char* ring, int slot, int lane) {
  return reinterpret_cast<int*>(ring + slot * STAGE_BYTES + lane * RS + PAD_OFF);
}

// W * TT tokens on from (tok, page, in_page), without a division.
__device__ __forceinline__ void advance(const Stream& st, unsigned& tok, unsigned& page, int& in_page) {
  tok += W * TT;
  in_page += st.step_in_page;
  page += st.step_pages;
  if (in_page >= st.page_size) {
    in_page -= st.page_size;
    page += 1;
  }
}

// Table path: row j's K and V offsets from the warp's table (koff, voff: bytes from the
// lane's chunk of the KV head), written there by lane j's token.
struct TableSources {
  const unsigned char* table;
  const unsigned char *k_lane, *v_lane;
  int row0;
  longlong2 off[COPY_BATCH];
  __device__ __forceinline__ void load(int j0) {
    PD_UNROLL
    for (int jj = 0; jj < COPY_BATCH; ++jj)
      off[jj] = *reinterpret_cast<const longlong2*>(table + (row0 + (j0 + jj) * RPI) * 16);
  }
  __device__ __forceinline__ void sources(int jj, int, const unsigned char*& k, const unsigned char*& v) const {
    k = k_lane + off[jj].x;
    v = v_lane + off[jj].y;
  }
};

#if PD_LANE_OFFSETS
// Lane-offsets path: row j's block-table entry (staged by lane j S - 1 tiles ago; 0 out of
// range) and its offset in its page, both times ES = 2 (an entry < 2^31: twice it fits 32
// bits unsigned), so the strides stay in elements and no product needs a shift.
struct LaneSources {
  const Stream& st;
  const long long (&strides)[4];
  int slot, row0;
  unsigned x0;  // 2 (row row0's token's offset in its page + a multiple of page_size)
  int entries[COPY_BATCH];
  __device__ __forceinline__ void load(int j0) {
    PD_UNROLL
    for (int jj = 0; jj < COPY_BATCH; ++jj) entries[jj] = *entry_at(st.ring, slot, row0 + (j0 + jj) * RPI);
  }
  __device__ __forceinline__ void sources(int jj, int j, const unsigned char*& k, const unsigned char*& v) const {
    const unsigned x = x0 + (unsigned)(2 * j * RPI);  // 2 (in_page + a multiple of page_size)
    const unsigned q = __umulhi(x, st.page_magic);      // x / (2 page_size), exact for x < 2^22
    const unsigned in_page2 = x - q * (unsigned)(2 * st.page_size);
    const unsigned entry2 = ES * (unsigned)entries[jj];
    k = st.k_lane + (unsigned long long)entry2 * (unsigned long long)strides[0] +
        (unsigned long long)in_page2 * (unsigned long long)strides[1];
    v = st.v_lane + (unsigned long long)entry2 * (unsigned long long)strides[2] +
        (unsigned long long)in_page2 * (unsigned long long)strides[3];
  }
};
#endif

// A lane's copies of one tile: rows row0 + j RPI, j in [0, RPL), COPY_BATCH at a time. A
// batch's row addresses are read (Sources::load: one shared-memory round trip a batch, where one
// register quad reused row after row serialised them) before its copies are issued; row
// row0 + j RPI lands j RPI RS bytes past dst0 (row row0's chunk), an immediate of the copy
// instruction, so every row shares one address register. Sources::sources gives batch row jj's
// K and V source; n = 16 for a row in [first, past) of a real chunk, else 0 (zero-filled).
// One chunk of a row, of K and of V, OFFSET bytes past dst0 in the K tile and in the V tile.
template <int OFFSET>
__device__ __forceinline__ void copy_kv(unsigned char* dst0, const unsigned char* k_src, const unsigned char* v_src,
                                        unsigned n) {
  pd_cp_async_cg_16_at<OFFSET>(dst0, k_src, n);
  pd_cp_async_cg_16_at<OFFSET + TILE_BYTES>(dst0, v_src, n);
}

template <int J0, int JJ, class Sources>
__device__ __forceinline__ void copy_batch(const Sources& rows, unsigned char* dst0, int row0, int first, int past,
                                           int chunk) {
  if constexpr (JJ < COPY_BATCH) {
    constexpr int j = J0 + JJ;
    const int r = row0 + j * RPI;
    const bool in_range = r >= first && r < past;
    const unsigned char *k_src, *v_src;
    rows.sources(JJ, j, k_src, v_src);
    // chunk (+ 1) < CPR: real bytes; else a padding chunk, zero-filled (src-size 0 reads
    // nothing) with a real chunk of the same row as its source: the lane's first (fp8 head
    // dims with an odd CPR, where the choice is made at run time) or the row's chunk 0
    const bool real = CPR == CPP || chunk < CPR;
    copy_kv<j * RPI * RS>(dst0, k_src, v_src, in_range && real ? 16u : 0u);
    if (CH == 2) {
      const bool next_real = CPR == CPP || chunk + 1 < CPR;
      const int on = next_real ? 16 : 0;
      copy_kv<j * RPI * RS + 16>(dst0, k_src + on, v_src + on, in_range && next_real ? 16u : 0u);
    }
    copy_batch<J0, JJ + 1>(rows, dst0, row0, first, past, chunk);
  }
}

template <int J0, class Sources>
__device__ __forceinline__ void copy_rows(Sources& rows, unsigned char* dst0, int row0, int first, int past,
                                          int chunk) {
  if constexpr (J0 < RPL) {
    rows.load(J0);
    copy_batch<J0, 0>(rows, dst0, row0, first, past, chunk);
    copy_rows<J0 + COPY_BATCH>(rows, dst0, row0, first, past, chunk);
  }
}

// A __syncwarp, then the offsets of the next tile's rows into the warp's table (PD_LANE_OFFSETS:
// no table, each copying lane computes its rows'), its
// cp.async copies into `stage` (keys outside the CTA's range zero-filled), the block-table
// entry of this lane's token S - 1 tiles on, and one commit (an empty group of K/V when the
// tile does not exist, so the wait_group arithmetic stays uniform). Advances the producer by
// W tiles. `slot`: the tile's stage in the ring (its warp-local index mod S; `stage` is that).
// `entry`: false leaves the entry's copy out (issue_ahead: that stage holds the warp's state).
__device__ __forceinline__ void issue_tile(Stream& st, const long long (&strides)[4], bool exists, int tile,
                                           unsigned char* stage, unsigned char* table, int slot, bool entry = true) {
  const int lane = threadIdx.x & 31;
  __syncwarp();  // every lane is done with the table, the stage and the copies it waited for
#if PD_LANE_OFFSETS
  if (exists) {
    const int tile_first = tile * TT;  // a tile that exists starts below hi: no overflow
    const int first = (int)st.lo - tile_first, past = (int)st.hi - tile_first;  // the tile's valid rows [first, past)
    const int row0 = lane / CPL, chunk = lane % CPL * CH;  // rows row0 + j * RPI, 16-byte chunks chunk ..
    const bool copies = CPL * CH == CPP || chunk < CPP;    // lanes past the padded row copy nothing
    // x0 / 2 + j * RPI: row row0 + j * RPI's token's offset in its page plus a multiple of
    // the page size (st.in_page is token lane's), in 1 .. 33 page_size + TT
    const unsigned x0 = (unsigned)(2 * st.in_page + st.row_bias);
    LaneSources rows{st, strides, slot, row0, x0};
    if (copies) copy_rows<0>(rows, stage + row0 * RS + chunk * 16, row0, first, past, chunk);
  }
  if (entry && lane < TT) {  // the entry S - 1 tiles on, in range only; 0 out of range (every copying lane reads it)
    int* e = entry_at(st.ring, (slot + S - 1) % S, lane);
    if (st.etok >= st.lo && st.etok < st.hi)
      pd_cp_async_ca_4(e, st.bt_row + st.epage, 4u);
    else
      *e = 0;
  }
#else
  if (exists) {
    const int tile_first = tile * TT;  // a tile that exists starts below hi: no overflow
    if (lane < TT) {
      const bool valid = st.tok >= st.lo && st.tok < st.hi;
      long long koff = 0, voff = 0;  // an invalid row is copied with src-size 0 from row 0
      if (valid) {
        const int row = *entry_at(st.ring, slot, lane);  // staged S - 1 tiles ago
        // strides in elements (kernel parameters, not held in registers); bytes = elements * ES
        koff = ((long long)row * strides[0] + (long long)st.in_page * strides[1]) * ES;
        voff = ((long long)row * strides[2] + (long long)st.in_page * strides[3]) * ES;
      }
      *reinterpret_cast<longlong2*>(table + lane * 16) = make_longlong2(koff, voff);
    }
    __syncwarp();
    const int first = (int)st.lo - tile_first, past = (int)st.hi - tile_first;  // the tile's valid rows [first, past)
    const int row0 = lane / CPL, chunk = lane % CPL * CH;  // rows row0 + j * RPI, 16-byte chunks chunk ..
    const bool copies = CPL * CH == CPP || chunk < CPP;    // lanes past the padded row copy nothing
    TableSources rows{table, st.k_lane, st.v_lane, row0};
    if (copies) copy_rows<0>(rows, stage + row0 * RS + chunk * 16, row0, first, past, chunk);
  }
  if (entry && lane < TT && st.etok >= st.lo && st.etok < st.hi)  // the entry S - 1 tiles on, in range only
    pd_cp_async_ca_4(entry_at(st.ring, (slot + S - 1) % S, lane), st.bt_row + st.epage, 4u);
#endif
  pd_cp_async_commit();
  // Advance to the warp's next tile: W * TT tokens on, no division.
  advance(st, st.tok, st.page, st.in_page);
  advance(st, st.etok, st.epage, st.ein_page);
}

// PREFETCH > 0 (persistent CTAs): every item's first PREFETCH tiles are in flight
// when its prologue starts (issue_ahead: the CTA's first item's at the kernel's start, a later
// one's before the previous item's epilogue; their copies and commit groups issued, the
// entries of tiles S .. S + PREFETCH - 2 copied with them); entry[j], j in PREFETCH .. S - 1:
// this lane's entry of tile j (0 outside the range), held in registers because stage j kept
// the warp's state until the combine. One path for every item: a cold first item beside
// carried later ones would lengthen the loop.
struct Carry {
  int entry[S];
};

// This lane's entries of the warp's first S - 1 tiles, loaded into stages 0 .. S - 2 (keys
// in the range only), and the entry producer set S - 1 tiles on. One round trip, the loads independent. PREFETCH > 0: the stream starts at
// tile PREFETCH; the entries of its stages PREFETCH .. S - 1 come from carry, no load.
__device__ __forceinline__ void start_entries(Stream& st, const Carry& carry) {
  const int lane = threadIdx.x & 31;
  st.etok = st.tok;
  st.epage = st.page;
  st.ein_page = st.in_page;
  if (PREFETCH > 0) {
    PD_UNROLL
    for (int j = PREFETCH; j < S; ++j)
      if (lane < TT) *entry_at(st.ring, j, lane) = carry.entry[j];
    PD_UNROLL
    for (int j = 0; j < S - 1; ++j) advance(st, st.etok, st.epage, st.ein_page);
    return;
  }
  PD_UNROLL
  for (int j = 0; j < S - 1; ++j) {
#if PD_LANE_OFFSETS  // 0 out of range: every copying lane reads every row's entry
    if (lane < TT) *entry_at(st.ring, j, lane) = st.etok >= st.lo && st.etok < st.hi ? st.bt_row[st.epage] : 0;
#else
    if (lane < TT && st.etok >= st.lo && st.etok < st.hi) *entry_at(st.ring, j, lane) = st.bt_row[st.epage];
#endif
    advance(st, st.etok, st.epage, st.ein_page);
  }
}

// This warp's tiles of the keys [lo, hi): tiles k of [k0, k1) at absolute positions k * TT,
// warp w taking k = w mod W; the first and how many. The ceiling without hi + TT - 1, which
// overflows for hi > INT32_MAX - TT + 1. W a power of two: (w - k0) mod W is a mask; 6 warps:
// k0 - k0 % W + w, one round on when w < k0 % W (k0 >= 0).
__device__ __forceinline__ void warp_tiles(int lo, int hi, int& first_tile, int& my_tiles) {
  const int warp = threadIdx.x >> 5;
  const int k0 = lo / TT, k1 = hi > lo ? hi / TT + (hi % TT != 0 ? 1 : 0) : k0;
#if (PD_MMA_WARPS & (PD_MMA_WARPS - 1)) == 0
  first_tile = k0 + ((warp - k0) & (W - 1));
#else
  const int k0_w = (int)((unsigned)k0 % (unsigned)W);
  first_tile = k0 - k0_w + warp + (warp < k0_w ? W : 0);
#endif
  my_tiles = first_tile < k1 ? (k1 - first_tile + W - 1) / W : 0;
}

// A producer for this warp's tiles of the keys [lo, hi) of one KV head (its K and V rows at
// k_head / v_head), from its tile `from` of those starting at first_tile (lane i < TT: token
// i of that tile).
__device__ __forceinline__ void open_stream(Stream& s, const unsigned char* k_head, const unsigned char* v_head,
                                            const int* __restrict__ bt_row, int page_size, int lo, int hi,
                                            int first_tile, int from, unsigned char* ring) {
  const int lane = threadIdx.x & 31;
  const int first_chunk = lane % CPL * CH;  // its CH chunks start here; a zero-filled one points at a real one
  const int chunk = (CPR == CPL * CH || first_chunk < CPR) ? first_chunk : 0;
  s.k_lane = k_head + chunk * 16;
  s.v_lane = v_head + chunk * 16;
  s.bt_row = bt_row;
  s.page_size = page_size;
  s.lo = lo;
  s.hi = hi;
  s.step_pages = (W * TT) / page_size;
  s.step_in_page = W * TT - s.step_pages * page_size;
  s.tok = (unsigned)first_tile * TT + from * W * TT + lane;
  s.page = s.tok / (unsigned)page_size;  // one division per lane per item; the rest are increments
  s.in_page = (int)(s.tok - s.page * page_size);
  s.ring = ring;
#if PD_LANE_OFFSETS
  s.page_magic = (0x7fffffffu + (unsigned)page_size) / (unsigned)page_size;
  s.row_bias = 2 * (lane / CPL - lane + 32 * page_size);
#endif
}

// PREFETCH > 0 (persistent CTAs): issue this warp's first PREFETCH tiles of the
// CTA's next item (its keys [lo, hi): cta_range, its KV head's k_head / v_head, its page ids
// bt_row) into stages 0 .. PREFETCH - 1 of its ring, once it has published the current item's
// state past them (the CTA's first item: at the kernel's start): the copies, the entries S - 1 tiles on and the commit groups attend's prologue would
// issue, so its cp.async.wait_group arithmetic is unchanged and the round trip runs under
// the epilogue and the next q staging. Stages PREFETCH .. S - 1 hold the state until the
// combine is done, so the entries of tiles PREFETCH .. S - 1 (issue_tile would copy tile
// S - 1's into stage S - 1) go to carry, loaded with the first ones in one round trip;
// attend stores them once the stages are free. The same producer, tiles and order as
// attend: no byte changes.
__device__ __forceinline__ void issue_ahead(unsigned char* smem, int lo, int hi, const unsigned char* k_head,
                                            long long k_stride_page,
                                            long long k_stride_token, const unsigned char* v_head,
                                            long long v_stride_page, long long v_stride_token,
                                            const int* __restrict__ bt_row, int page_size, Carry& carry) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int first_tile, my_tiles;
  warp_tiles(lo, hi, first_tile, my_tiles);
  unsigned char* ring = smem + RING_OFF + warp * RING_BYTES;
  unsigned char* table = smem + TABLE_OFF + warp * TT * 16;
  Stream s;
  const long long strides[4] = {k_stride_page, k_stride_token, v_stride_page, v_stride_token};
  open_stream(s, k_head, v_head, bt_row, page_size, lo, hi, first_tile, 0, ring);
  s.etok = s.tok;
  s.epage = s.page;
  s.ein_page = s.in_page;
  PD_UNROLL
  for (int j = 0; j < S; ++j) {  // tiles 0 .. S - 1, the producer left at S - 1 (start_entries')
    const int e = lane < TT && s.etok >= s.lo && s.etok < s.hi ? bt_row[s.epage] : 0;
    if (j < PREFETCH) {
      if (lane < TT) *entry_at(ring, j, lane) = e;
    } else {
      carry.entry[j] = e;
    }
    if (j < S - 1) advance(s, s.etok, s.epage, s.ein_page);
  }
  PD_UNROLL
  for (int k = 0; k < PREFETCH; ++k)  // tile 0's entry copy would land in stage S - 1: carried instead
    issue_tile(s, strides, k < my_tiles, first_tile + k * W, ring + k * STAGE_BYTES, table, k, k > 0);
}

}  // namespace pd_mma

#endif  // PD_MMA_STREAM_CUH
