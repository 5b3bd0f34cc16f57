// ptx.cpp: the PTX emulation of the CUDA-on-CPU runtime (the parts are listed in
// internal.h): the runtime half of the instructions of an intrinsics header such as
// metrale-attn's kernels_cu/pd_ptx.cuh that involve the whole warp (ldmatrix, movmatrix,
// mma) or the scheduler (cp.async, deferred). The conversions and prmt are pure functions
// in cuda_on_cpu.h.
#include "internal.h"

#include <string.h>

namespace cocpu_runtime {

// ---------------------------------------------------------------------------------
// Matrix ops (PTX ISA 9.1 §9.7.14.5): one step computes every lane's results from every
// lane's operands, reading all of them before writing any (so d may alias c).
// ---------------------------------------------------------------------------------
namespace {

// An 8x8 matrix of 16-bit elements as a warp holds it in one register per lane (the
// ldmatrix / movmatrix / mma fragment, PTX ISA Figure 104): lane 4r + c/2 holds row r,
// columns c & ~1 (low half) and c | 1 (high half).
inline unsigned frag_elem(const unsigned* frag, unsigned r, unsigned c) {
  return (frag[4 * r + c / 2] >> (16 * (c & 1))) & 0xffffu;
}
inline unsigned pack2(unsigned lo, unsigned hi) { return lo | hi << 16; }

template <class T>
T& args_of(Fiber& f) {
  return *static_cast<T*>(f.payload);
}

// ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.shared.b16 (§9.7.14.5.15): matrix j's row
// r is the 16 bytes at lane (8j + r)'s address; lane i receives row i/4, columns 2(i%4) and
// 2(i%4)+1 of each matrix (.trans: rows 2(i%4) and 2(i%4)+1 of column i/4).
void complete_ldmatrix(Fiber* lanes, int variant) {
  const unsigned num = (unsigned)variant & 7u;
  const bool trans = (variant & COCPU_LDMATRIX_TRANS) != 0;
  unsigned rows[4][32];  // matrix j in fragment form: rows[j][4r + c/2]
  for (unsigned j = 0; j < num; ++j)
    for (unsigned r = 0; r < 8; ++r)
      memcpy(&rows[j][4 * r], args_of<cocpu_ldmatrix_args>(lanes[8 * j + r]).row, 16);
  for (unsigned i = 0; i < 32; ++i) {
    unsigned* out = args_of<cocpu_ldmatrix_args>(lanes[i]).r;
    const unsigned r = i / 4, c = 2 * (i % 4);
    for (unsigned j = 0; j < num; ++j)
      out[j] = trans ? pack2(frag_elem(rows[j], c, r), frag_elem(rows[j], c + 1, r)) : rows[j][i];
  }
}

// movmatrix.sync.aligned.m8n8.trans.b16 (§9.7.14.5.17): the fragment of the transpose.
void complete_movmatrix(Fiber* lanes) {
  unsigned a[32];
  for (unsigned i = 0; i < 32; ++i) a[i] = args_of<cocpu_movmatrix_args>(lanes[i]).a;
  for (unsigned i = 0; i < 32; ++i) {
    const unsigned r = i / 4, c = 2 * (i % 4);
    args_of<cocpu_movmatrix_args>(lanes[i]).d = pack2(frag_elem(a, c, r), frag_elem(a, c + 1, r));
  }
}

inline float mma_input(unsigned bits16, bool f16) {
  return __uint_as_float(f16 ? cocpu_f16_to_f32_bits(bits16) : bits16 << 16);
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 (§9.7.14.5.14, fragments
// §9.7.14.5.8; g = lane >> 2, t = lane % 4): A element ai at row g + 8 * ((i >> 1) & 1),
// column 2t + (i & 1) + 8 * (i >> 2); B element bi at row 2t + (i & 1) + 8 * (i >> 1),
// column g; C/D element ci at row g + 8 * (i >> 1), column 2t + (i & 1); element i is half
// i % 2 of register i / 2. D[m][n] = c, then + A[m][k] * B[k][n] for k = 0..15 in that
// order, each product and each sum an IEEE fp32 operation rounded to nearest (the products
// of two bf16 or two f16 values are exact unless they underflow), subnormals kept, NaN
// results 0x7fffffff. The PTX ISA leaves the order, rounding and subnormal handling
// unspecified, so a tensor core may differ in the last bits.
void complete_mma(Fiber* lanes, int variant) {
  const bool f16 = variant == COCPU_MMA_F16;
  float A[16][16], B[16][8], C[16][8];
  for (unsigned i = 0; i < 32; ++i) {
    const cocpu_mma_args& p = args_of<cocpu_mma_args>(lanes[i]);
    const unsigned g = i >> 2, t = i & 3;
    for (unsigned e = 0; e < 8; ++e)
      A[g + 8 * ((e >> 1) & 1)][2 * t + (e & 1) + 8 * (e >> 2)] =
          mma_input((p.a[e / 2] >> (16 * (e & 1))) & 0xffffu, f16);
    for (unsigned e = 0; e < 4; ++e) {
      B[2 * t + (e & 1) + 8 * (e >> 1)][g] = mma_input((p.b[e / 2] >> (16 * (e & 1))) & 0xffffu, f16);
      C[g + 8 * (e >> 1)][2 * t + (e & 1)] = p.c[e];
    }
  }
  for (unsigned i = 0; i < 32; ++i) {
    float* d = args_of<cocpu_mma_args>(lanes[i]).d;
    const unsigned g = i >> 2, t = i & 3;
    for (unsigned e = 0; e < 4; ++e) {
      const unsigned m = g + 8 * (e >> 1), n = 2 * t + (e & 1);
      float acc = C[m][n];
      for (unsigned k = 0; k < 16; ++k) acc = acc + A[m][k] * B[k][n];
      d[e] = acc != acc ? __uint_as_float(0x7fffffffu) : acc;
    }
  }
}

}  // namespace

void complete_matrix_op(Fiber* lanes, const Fiber& a) {
  switch (a.kind) {
    case COCPU_OP_LDMATRIX: complete_ldmatrix(lanes, a.arg); break;
    case COCPU_OP_MOVMATRIX: complete_movmatrix(lanes); break;
    case COCPU_OP_MMA: complete_mma(lanes, a.arg); break;
  }
  for (unsigned l = 0; l < 32; ++l) lanes[l].state = RUNNABLE;
}

// ---------------------------------------------------------------------------------
// cp.async (PTX ISA 9.1 §9.7.9.25.3): copies are deferred. At issue the source bytes are
// read, the destination is checked and filled with 0xFF, and the copy joins the thread's
// open group; it lands at a wait_group / wait_all that covers its group, or, under the
// seeded thread orders only, earlier at a random scheduling point (land_early). Copies of a
// thread that exits before waiting are dropped.
// ---------------------------------------------------------------------------------

std::vector<unsigned> g_copy_fibers;

namespace {

void remove_copy_fiber(Fiber* f) {
  const unsigned last = g_copy_fibers.back();
  g_copy_fibers[(size_t)f->copy_slot] = last;
  g_fibers[last].copy_slot = f->copy_slot;
  g_copy_fibers.pop_back();
  f->copy_slot = -1;
}

inline void land(const AsyncCopy& c) { memcpy(c.dst, c.bytes, c.size); }

// Lands the copies of f whose group is older than `limit` (issue order), keeps the rest.
void land_groups_below(Fiber* f, unsigned limit) {
  size_t keep = 0;
  for (size_t i = 0; i < f->copies.size(); ++i) {
    if (f->copies[i].group < limit) land(f->copies[i]);
    else f->copies[keep++] = f->copies[i];
  }
  f->copies.resize(keep);
  if (!keep) remove_copy_fiber(f);
}

}  // namespace

void drop_copies(Fiber* f) {
  if (f->copies.empty()) return;
  f->copies.clear();
  remove_copy_fiber(f);
}

// A scheduling point of a seeded order: with probability 1/2, one pending copy of a random
// thread lands now (a GPU may complete a copy at any time after its issue). Consumes
// random numbers only while copies are pending, so kernels without cp.async keep their
// schedules.
void land_early() {
  if (next_random() & 1) return;
  Fiber& f = g_fibers[g_copy_fibers[next_random() % g_copy_fibers.size()]];
  const size_t i = next_random() % f.copies.size();
  land(f.copies[i]);
  f.copies.erase(f.copies.begin() + (long)i);
  if (f.copies.empty()) remove_copy_fiber(&f);
}

}  // namespace cocpu_runtime

using namespace cocpu_runtime;

// ---------------------------------------------------------------------------------
// Called by the kernel (on a fiber), from pd_ptx.cuh's functions
// ---------------------------------------------------------------------------------
extern "C" {

void cocpu_matrix_op(int kind, int variant, void* args, const char* file, int line) {
  Fiber* f = g_cur;
  check_whole_warp(f, kind, variant, file, line);
  if (kind == COCPU_OP_LDMATRIX && f->lane < 8u * ((unsigned)variant & 7u)) {
    const void* row = static_cast<cocpu_ldmatrix_args*>(args)->row;
    if ((uintptr_t)row % 16)
      fail_here(fmt("%s at %s:%d: lane %u's row address %p is not 16-byte aligned",
                    matrix_op_name(kind, variant).c_str(), file, line, f->lane, row));
    if (!in_shared(row, 16))
      fail_here(fmt("%s at %s:%d: lane %u's row address %p (16 bytes) is not in the block's "
                    "shared memory (a __shared__ variable or the %zu-byte dynamic buffer)",
                    matrix_op_name(kind, variant).c_str(), file, line, f->lane, row, L.dyn_bytes));
#if COCPU_ASAN
    // The row is read when the whole warp has arrived, on the scheduler's stack; touch it
    // here too so that an ASan report names this thread and line.
    const volatile unsigned char* probe = static_cast<const volatile unsigned char*>(row);
    for (int i = 0; i < 16; ++i) (void)probe[i];
#endif
  }
  f->kind = kind;
  f->mask = 0xffffffffu;
  f->value = 0;
  f->size = 0;
  f->arg = variant;
  f->width = 32;
  f->payload = args;
  f->file = file;
  f->line = line;
  f->state = AT_WARP;
  suspend(f, false);
}

void cocpu_cp_async(void* smem_dst, const void* gmem_src, int cp_size, unsigned src_bytes,
                    int cache_all, const char* file, int line) {
  Fiber* f = g_cur;
#define COCPU_CP_ASYNC_FAIL(what, ...)                                                          \
  fail_here(fmt("pd_cp_async_%s_%d at %s:%d: " what, cache_all ? "ca" : "cg", cp_size, file, line, \
                __VA_ARGS__))
  if (src_bytes > (unsigned)cp_size)
    COCPU_CP_ASYNC_FAIL("src_bytes %u exceeds the copy size %d", src_bytes, cp_size);
  AsyncCopy c{};
  c.size = (unsigned)cp_size;
  if (src_bytes) {  // src_bytes = 0 reads nothing (and the source may be any pointer)
    if ((uintptr_t)gmem_src % (unsigned)cp_size)
      COCPU_CP_ASYNC_FAIL("source address %p is not %d-byte aligned", gmem_src, cp_size);
    if (in_shared(gmem_src, src_bytes, false))
      COCPU_CP_ASYNC_FAIL("source address %p is in shared memory (cp.async copies global memory "
                          "to shared memory)", gmem_src);
    memcpy(c.bytes, gmem_src, src_bytes);  // read at issue: ASan checks the source here
  }
  unsigned char* dst = static_cast<unsigned char*>(smem_dst);
#if COCPU_ASAN
  memset(dst, 0xff, (size_t)cp_size);  // ASan checks the destination first, naming its object
#endif
  if ((uintptr_t)dst % (unsigned)cp_size)
    COCPU_CP_ASYNC_FAIL("destination address %p is not %d-byte aligned", smem_dst, cp_size);
  if (!in_shared(dst, (size_t)cp_size))
    COCPU_CP_ASYNC_FAIL("destination address %p (%d bytes) is not in the block's shared memory (a "
                        "__shared__ variable or the %zu-byte dynamic buffer)",
                        smem_dst, cp_size, L.dyn_bytes);
#undef COCPU_CP_ASYNC_FAIL
  memset(dst, 0xff, (size_t)cp_size);  // garbage until the copy lands
  c.dst = dst;
  c.group = f->committed;
  if (f->copies.empty()) {
    f->copy_slot = (int)g_copy_fibers.size();
    g_copy_fibers.push_back(f->linear);
  }
  f->copies.push_back(c);
}

void cocpu_cp_async_commit(void) { ++g_cur->committed; }

void cocpu_cp_async_wait(int n) {
  Fiber* f = g_cur;
  if (n < 0) {  // wait_all = commit_group; wait_group 0
    ++f->committed;
    n = 0;
  }
  if (!f->copies.empty())
    land_groups_below(f, f->committed > (unsigned)n ? f->committed - (unsigned)n : 0u);
}

}  // extern "C"
