// cuda_on_cpu_runtime.cpp: fibers, the block scheduler and error reporting of the
// CUDA-on-CPU shim. Linked into every kernel module (each module has its own copy, all
// symbols hidden except the cocpu_* entry points the Python loader calls).
//
// Model. A launch runs its blocks one after another on the calling OS thread. A block's
// threads are fibers (one stack each, with a PROT_NONE guard below it). A fiber runs
// until it reaches a barrier (__syncthreads*), a warp op (__shfl*_sync, __ballot_sync,
// __syncwarp, ...) or its end, then control comes back here. Warp ops complete once
// every lane named in the mask waits at one of the same kind/mask/width; a barrier
// completes once every non-exited thread of the block waits at it. When nothing can run
// and something still waits, the launch fails with a message naming the block, the
// thread and the source lines: no hangs.
//
// The order in which runnable fibers are resumed is the launch's "order" policy (see
// cocpu_launch). Any kernel whose output depends on it has a race.
#include "cuda_on_cpu.h"

#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dlfcn.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>

#include <string>
#include <vector>

#if defined(COCPU_UCONTEXT) || !defined(__x86_64__)
#define COCPU_USE_UCONTEXT 1
#include <ucontext.h>
#else
#define COCPU_USE_UCONTEXT 0
#endif

#if defined(__SANITIZE_ADDRESS__)
#define COCPU_ASAN 1
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#else
#define COCPU_ASAN 0
#endif

// Defined by the kernel translation unit (the loader's registration block).
extern "C" COCPU_EXPORT const cocpu_kernel_desc cocpu_kernels[];
extern "C" COCPU_EXPORT const int cocpu_num_kernels;

// Bounds of the static __shared__ variables (linker-provided; absent when there are none
// or under ASan, where __shared__ does not use the section).
extern "C" char __start_cocpu_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_cocpu_shared[] __attribute__((weak, visibility("hidden")));

extern "C" {
uint3 cocpu_thread_idx;
uint3 cocpu_block_idx;
dim3 cocpu_block_dim;
dim3 cocpu_grid_dim;
void* cocpu_dynamic_shared;
#if !COCPU_USE_UCONTEXT
COCPU_HIDDEN void cocpu_switch(void** save_sp, void* new_sp);  // cuda_on_cpu_switch_x86_64.S
#endif
}

namespace {

constexpr unsigned kMaxThreads = 1024;
constexpr size_t kMaxShared = 227 * 1024;  // sm_90 opt-in maximum per block
constexpr size_t kGuardBytes = 64 * 1024;  // below each stack; the build also uses
                                           // -fstack-clash-protection so big frames probe

enum State : unsigned char { RUNNABLE, RUNNING, AT_BARRIER, AT_WARP, EXITED };
enum Policy { POLICY_DEFAULT = 0, POLICY_REVERSE = 1, POLICY_SHUFFLE = 2, POLICY_WARP_AHEAD = 3 };

// One deferred cp.async: the source bytes as read at issue (zero-filled past src_bytes),
// landing in dst at a wait_group that covers its group (or earlier, see land_early).
struct AsyncCopy {
  unsigned char* dst;
  unsigned group;
  unsigned size;
  unsigned char bytes[16];
};

struct Fiber {
  void* sp;  // saved stack pointer while suspended (asm switch)
#if COCPU_USE_UCONTEXT
  ucontext_t uc;
#endif
  unsigned char* stack_lo;
  size_t stack_size;
  uint3 tid;
  unsigned linear, lane, warp;
  State state;
  // What the fiber waits at (barrier or warp op) and the result it gets back.
  int kind;
  unsigned mask;
  int width, arg, size;
  unsigned long long value, result;
  const char* file;
  int line;
  void* payload;  // matrix ops: the lane's cocpu_*_args
  void* asan_fake_stack;
  // cp.async: this thread's pending copies in issue order; group ids count commits.
  std::vector<AsyncCopy> copies;
  unsigned committed;  // groups committed so far (the open group's id)
  int copy_slot;       // index in g_copy_fibers while copies is not empty, else -1
};

struct Launch {
  const cocpu_kernel_desc* k;
  void* const* args;
  unsigned nthreads, nwarps;
  size_t dyn_bytes;
  int policy;
  unsigned long long rng;
  bool failed;
  std::string err;
  void* sched_sp;
#if COCPU_USE_UCONTEXT
  ucontext_t sched_uc;
#endif
  unsigned mxcsr_fpcw[2];
  const void* sched_stack_bottom;  // ASan fiber annotations
  size_t sched_stack_size;
};

Launch L;
std::vector<Fiber> g_fibers;
Fiber* g_cur;  // the running fiber, null while the scheduler runs
std::vector<unsigned> g_copy_fibers;  // fibers of the block with pending cp.async copies

// ---------------------------------------------------------------------------------
// Stacks: mmap'd once and reused across blocks and launches.
// ---------------------------------------------------------------------------------
struct Stack {
  unsigned char* map;
  size_t map_size;
};
std::vector<Stack> g_stacks;
size_t g_stack_usable;
bool g_stacks_dirty;  // ASan: fibers were abandoned mid-frame, their shadow is stale

size_t page_size() {
  static size_t p = (size_t)sysconf(_SC_PAGESIZE);
  return p;
}

bool ensure_stacks(unsigned n, size_t usable) {
  usable = (usable + page_size() - 1) / page_size() * page_size();
  if (usable != g_stack_usable) {
    for (Stack& s : g_stacks) munmap(s.map, s.map_size);
    g_stacks.clear();
    g_stack_usable = usable;
  }
  while (g_stacks.size() < n) {
    const size_t total = kGuardBytes + usable;
    void* m = mmap(nullptr, total, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    if (m == MAP_FAILED) return false;
    if (mprotect(m, kGuardBytes, PROT_NONE) != 0) {
      munmap(m, total);
      return false;
    }
    g_stacks.push_back(Stack{static_cast<unsigned char*>(m), total});
  }
  return true;
}

// ---------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------
std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

std::string thread_name(const Fiber& f) {
  return fmt("thread (%u,%u,%u)", f.tid.x, f.tid.y, f.tid.z);
}

// Records the first error of the launch, prefixed with kernel, block and thread.
void fail(const Fiber* f, const std::string& what) {
  if (L.failed) return;
  L.failed = true;
  L.err = fmt("kernel '%s' block (%u,%u,%u)", L.k->name, cocpu_block_idx.x, cocpu_block_idx.y,
              cocpu_block_idx.z);
  if (f) L.err += " " + thread_name(*f);
  L.err += ": " + what;
}

const char* op_name(int kind) {
  switch (kind) {
    case COCPU_OP_SYNCWARP: return "__syncwarp";
    case COCPU_OP_SHFL_IDX: return "__shfl_sync";
    case COCPU_OP_SHFL_UP: return "__shfl_up_sync";
    case COCPU_OP_SHFL_DOWN: return "__shfl_down_sync";
    case COCPU_OP_SHFL_XOR: return "__shfl_xor_sync";
    case COCPU_OP_BALLOT: return "__ballot_sync";
    case COCPU_OP_ANY: return "__any_sync";
    case COCPU_OP_ALL: return "__all_sync";
    case COCPU_OP_LDMATRIX: return "pd_ldmatrix";
    case COCPU_OP_MOVMATRIX: return "pd_movmatrix_trans";
    case COCPU_OP_MMA: return "pd_mma_m16n8k16";
  }
  return "?";
}

// The .sync.aligned matrix ops: the whole warp must execute the same instruction.
bool is_matrix_op(int kind) { return kind >= COCPU_OP_LDMATRIX && kind <= COCPU_OP_MMA; }

// The pd_ptx.cuh function a matrix op came from, variant included.
std::string matrix_op_name(int kind, int variant) {
  if (kind == COCPU_OP_LDMATRIX)
    return fmt("pd_ldmatrix_x%d%s", variant & 7, (variant & COCPU_LDMATRIX_TRANS) ? "_trans" : "");
  if (kind == COCPU_OP_MMA) return variant == COCPU_MMA_F16 ? "pd_mma_f16_m16n8k16" : "pd_mma_bf16_m16n8k16";
  return op_name(kind);
}

const char* barrier_name(int kind) {
  switch (kind) {
    case COCPU_BAR_SYNC: return "__syncthreads";
    case COCPU_BAR_COUNT: return "__syncthreads_count";
    case COCPU_BAR_AND: return "__syncthreads_and";
    case COCPU_BAR_OR: return "__syncthreads_or";
  }
  return "?";
}

std::string where(const Fiber& f) {
  if (f.state == AT_BARRIER) return fmt("%s at %s:%d", barrier_name(f.kind), f.file, f.line);
  if (f.state == AT_WARP && is_matrix_op(f.kind))
    return fmt("%s at %s:%d", matrix_op_name(f.kind, f.arg).c_str(), f.file, f.line);
  if (f.state == AT_WARP)
    return fmt("%s(mask=0x%08x, width=%d, %d-byte value) at %s:%d", op_name(f.kind), f.mask,
               f.width, f.size, f.file, f.line);
  return f.state == EXITED ? "exited" : "running";
}

// ---------------------------------------------------------------------------------
// Context switches
// ---------------------------------------------------------------------------------
void fiber_main();
void land_early();
void drop_copies(Fiber* f);

void prepare_fiber(Fiber* f) {
#if COCPU_ASAN
  if (g_stacks_dirty) __asan_unpoison_memory_region(f->stack_lo, f->stack_size);
#endif
#if COCPU_USE_UCONTEXT
  getcontext(&f->uc);
  f->uc.uc_stack.ss_sp = f->stack_lo;
  f->uc.uc_stack.ss_size = f->stack_size;
  f->uc.uc_link = nullptr;
  makecontext(&f->uc, fiber_main, 0);
#else
  // The frame cocpu_switch pops (see the .S file): fp control words, six callee-saved
  // registers (zero: rbp = 0 ends frame-pointer walks), then fiber_main as the return
  // address and a zero fake return address for fiber_main itself, which is thus
  // entered with rsp = 8 mod 16 as after a call.
  const uintptr_t top = (uintptr_t)(f->stack_lo + f->stack_size) & ~(uintptr_t)15;
  void** p = reinterpret_cast<void**>(top);
  p[-1] = nullptr;
  p[-2] = reinterpret_cast<void*>(&fiber_main);
  for (int i = 3; i <= 8; ++i) p[-i] = nullptr;
  unsigned* cw = reinterpret_cast<unsigned*>(top - 72);
  cw[0] = L.mxcsr_fpcw[0];
  cw[1] = L.mxcsr_fpcw[1];
  f->sp = reinterpret_cast<void*>(top - 72);
#endif
}

// Scheduler -> fiber f; returns when f blocks, exits or fails.
inline void resume(Fiber* f) {
  g_cur = f;
  cocpu_thread_idx = f->tid;
  f->state = RUNNING;
#if COCPU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f->stack_lo, f->stack_size);
#endif
#if COCPU_USE_UCONTEXT
  swapcontext(&L.sched_uc, &f->uc);
#else
  cocpu_switch(&L.sched_sp, f->sp);
#endif
#if COCPU_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  g_cur = nullptr;
  if (!g_copy_fibers.empty() && (L.policy == POLICY_SHUFFLE || L.policy == POLICY_WARP_AHEAD))
    land_early();
}

// Fiber f -> scheduler. `final`: f will never be resumed (exited or failed).
void suspend(Fiber* f, bool final) {
#if COCPU_ASAN
  __sanitizer_start_switch_fiber(final ? nullptr : &f->asan_fake_stack, L.sched_stack_bottom,
                                 L.sched_stack_size);
#else
  (void)final;
#endif
#if COCPU_USE_UCONTEXT
  swapcontext(&f->uc, &L.sched_uc);
#else
  cocpu_switch(&f->sp, L.sched_sp);
#endif
#if COCPU_ASAN
  __sanitizer_finish_switch_fiber(f->asan_fake_stack, &L.sched_stack_bottom,
                                  &L.sched_stack_size);
#endif
}

void fiber_main() {
#if COCPU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &L.sched_stack_bottom, &L.sched_stack_size);
#endif
  L.k->invoke(L.k->fn, L.args);
  Fiber* f = g_cur;
  drop_copies(f);  // copies a thread never waited for never land
  f->state = EXITED;
  suspend(f, true);
  __builtin_trap();  // an exited fiber is never resumed
}

// Called on a fiber: record the error and leave for good.
[[noreturn]] void fail_here(const std::string& what) {
  Fiber* f = g_cur;
  fail(f, what);
  drop_copies(f);
  f->state = EXITED;
  g_stacks_dirty = true;
  suspend(f, true);
  __builtin_trap();
}

// ---------------------------------------------------------------------------------
// Random numbers for the shuffle policies (splitmix64: seeded, platform independent)
// ---------------------------------------------------------------------------------
unsigned long long next_random() {
  unsigned long long z = (L.rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

template <class T>
void shuffle(std::vector<T>& v) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[next_random() % i]);
}

// ---------------------------------------------------------------------------------
// Warp ops
// ---------------------------------------------------------------------------------
unsigned warp_lanes(unsigned w) {
  const unsigned n = L.nthreads - w * 32;
  return n >= 32 ? 32 : n;
}

bool same_site(const Fiber& a, const Fiber& b) {
  return a.line == b.line && (a.file == b.file || !strcmp(a.file, b.file));
}

// Shuffles and votes of one kind/mask/width complete together wherever their lanes call
// them (as on Volta and later); a matrix op needs the same instruction: variant and site.
bool same_op(const Fiber& a, const Fiber& b) {
  if (a.kind != b.kind || a.mask != b.mask || a.width != b.width || a.size != b.size) return false;
  return !is_matrix_op(a.kind) || (a.arg == b.arg && same_site(a, b));
}

// Source lane of a shuffle, exactly as PTX shfl.sync computes it (CUDA passes
// c = ((32 - width) << 8) | clamp, clamp = 0 for up and 0x1f otherwise); an
// out-of-segment source yields the lane's own value.
unsigned shuffle_source(int kind, unsigned lane, int arg, int width) {
  const unsigned segmask = (unsigned)(32 - width) & 31u;
  const unsigned b = (unsigned)arg & 31u;
  const unsigned seg_lo = lane & segmask;
  const unsigned seg_hi = seg_lo | (31u & ~segmask);
  switch (kind) {
    case COCPU_OP_SHFL_UP: {
      const int j = (int)lane - (int)b;
      return j >= (int)seg_lo ? (unsigned)j : lane;
    }
    case COCPU_OP_SHFL_DOWN: {
      const unsigned j = lane + b;
      return j <= seg_hi ? j : lane;
    }
    case COCPU_OP_SHFL_XOR: {
      const unsigned j = lane ^ b;
      return j <= seg_hi ? j : lane;
    }
    default:  // idx
      return seg_lo | (b & ~segmask);
  }
}

// ---------------------------------------------------------------------------------
// Matrix ops (PTX ISA 9.1 §9.7.14.5): one step computes every lane's results from every
// lane's operands, reading all of them before writing any (so d may alias c).
// ---------------------------------------------------------------------------------

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

void complete_matrix_op(Fiber* lanes, const Fiber& a) {
  switch (a.kind) {
    case COCPU_OP_LDMATRIX: complete_ldmatrix(lanes, a.arg); break;
    case COCPU_OP_MOVMATRIX: complete_movmatrix(lanes); break;
    case COCPU_OP_MMA: complete_mma(lanes, a.arg); break;
  }
  for (unsigned l = 0; l < 32; ++l) lanes[l].state = RUNNABLE;
}

// Completes the warp op that the lanes in `mask` of warp w all wait at.
void complete_warp_op(Fiber* lanes, unsigned mask) {
  const Fiber& a = lanes[__builtin_ctz(mask)];
  if (is_matrix_op(a.kind)) return complete_matrix_op(lanes, a);
  unsigned long long common = 0;
  if (a.kind == COCPU_OP_BALLOT || a.kind == COCPU_OP_ANY || a.kind == COCPU_OP_ALL) {
    unsigned ballot = 0;
    for (unsigned m = mask; m; m &= m - 1) {
      const unsigned l = __builtin_ctz(m);
      if (lanes[l].value) ballot |= 1u << l;
    }
    common = a.kind == COCPU_OP_BALLOT ? ballot
             : a.kind == COCPU_OP_ANY  ? (ballot != 0)
                                       : (ballot == mask);
  }
  const bool is_shuffle = a.kind >= COCPU_OP_SHFL_IDX && a.kind <= COCPU_OP_SHFL_XOR;
  for (unsigned m = mask; m; m &= m - 1) {
    Fiber& f = lanes[__builtin_ctz(m)];
    if (is_shuffle) {
      const unsigned src = shuffle_source(f.kind, f.lane, f.arg, f.width);
      if (!((mask >> src) & 1u)) {
        fail(&f, fmt("%s at %s:%d reads lane %u, which is not in the mask 0x%08x (undefined "
                     "value on a GPU)",
                     op_name(f.kind), f.file, f.line, src, mask));
        return;
      }
      f.result = lanes[src].value;
    } else {
      f.result = common;
    }
  }
  for (unsigned m = mask; m; m &= m - 1) lanes[__builtin_ctz(m)].state = RUNNABLE;
}

// Completes every warp op of warp w whose lanes have all arrived. True if any did.
bool resolve_warp(unsigned w) {
  Fiber* lanes = &g_fibers[w * 32];
  const unsigned n = warp_lanes(w);
  unsigned waiting = 0;
  for (unsigned l = 0; l < n; ++l)
    if (lanes[l].state == AT_WARP) waiting |= 1u << l;
  bool released = false;
  for (unsigned todo = waiting; todo;) {
    const Fiber& a = lanes[__builtin_ctz(todo)];
    const unsigned mask = a.mask;
    todo &= ~(1u << a.lane);
    if ((mask & waiting) != mask) continue;  // some lane has not arrived (yet)
    bool agree = true;
    for (unsigned m = mask; m && agree; m &= m - 1) agree = same_op(a, lanes[__builtin_ctz(m)]);
    if (!agree) continue;  // diagnosed if the block gets stuck
    complete_warp_op(lanes, mask);
    if (L.failed) return false;
    waiting &= ~mask;
    todo &= ~mask;
    released = true;
  }
  return released;
}

// Why the warp op `a` waits at can never complete (nothing is runnable any more).
void diagnose_stuck_warp_op(const Fiber& a) {
  const Fiber* lanes = &g_fibers[a.warp * 32];
  for (unsigned m = a.mask; m; m &= m - 1) {
    const Fiber& b = lanes[__builtin_ctz(m)];
    const char* names = is_matrix_op(a.kind) ? "the whole warp must execute it, but lane"
                                              : "the mask names lane";
    const char* which = is_matrix_op(a.kind) ? "" : ", which";
    if (b.state == EXITED) {
      fail(&a, fmt("%s: %s %u (%s)%s has exited", where(a).c_str(), names, b.lane,
                   thread_name(b).c_str(), which));
      return;
    }
    if (b.state == AT_BARRIER) {
      fail(&a, fmt("%s: %s %u (%s)%s waits at %s", where(a).c_str(), names, b.lane,
                   thread_name(b).c_str(), which, where(b).c_str()));
      return;
    }
    if (b.state == AT_WARP && !same_op(a, b)) {
      fail(&a, fmt("lanes of warp %u disagree: lane %u waits at %s, lane %u (%s) at %s", a.warp,
                   a.lane, where(a).c_str(), b.lane, thread_name(b).c_str(), where(b).c_str()));
      return;
    }
  }
  fail(&a, where(a) + " cannot complete");
}

// ---------------------------------------------------------------------------------
// Block scheduling
// ---------------------------------------------------------------------------------

// Resumes the runnable lanes of warp w in lane order.
void run_warp(unsigned w) {
  Fiber* lanes = &g_fibers[w * 32];
  const unsigned n = warp_lanes(w);
  for (unsigned l = 0; l < n && !L.failed; ++l)
    if (lanes[l].state == RUNNABLE) resume(&lanes[l]);
}

// Runs the block until no fiber is runnable (all wait at a barrier, at a stuck warp op,
// or have exited), in the launch's policy order.
void drive() {
  const unsigned n = L.nthreads;
  std::vector<Fiber>& F = g_fibers;
  switch (L.policy) {
    case POLICY_DEFAULT:
    case POLICY_REVERSE:
      for (;;) {
        if (L.policy == POLICY_DEFAULT) {
          for (unsigned i = 0; i < n && !L.failed; ++i)
            if (F[i].state == RUNNABLE) resume(&F[i]);
        } else {
          for (unsigned i = n; i-- > 0 && !L.failed;)
            if (F[i].state == RUNNABLE) resume(&F[i]);
        }
        bool released = false;
        for (unsigned w = 0; w < L.nwarps && !L.failed; ++w) released |= resolve_warp(w);
        if (!released || L.failed) return;
      }
    case POLICY_SHUFFLE: {
      // A fresh permutation of the runnable fibers every round.
      std::vector<unsigned> order;
      for (;;) {
        order.clear();
        for (unsigned i = 0; i < n; ++i)
          if (F[i].state == RUNNABLE) order.push_back(i);
        shuffle(order);
        for (unsigned i : order) {
          if (L.failed) return;
          resume(&F[i]);
        }
        bool released = false;
        for (unsigned w = 0; w < L.nwarps && !L.failed; ++w) released |= resolve_warp(w);
        if (!released || L.failed) return;
      }
    }
    case POLICY_WARP_AHEAD: {
      // Warps are the scheduling units. A random number of them, in random order, each
      // run alone through the whole phase (to the next barrier or their end, warp ops
      // included) before any other warp starts it; the rest then interleave round by
      // round in a fresh random warp order each round.
      std::vector<unsigned> warps(L.nwarps);
      for (unsigned w = 0; w < L.nwarps; ++w) warps[w] = w;
      shuffle(warps);
      const size_t ahead = next_random() % (L.nwarps + 1);
      for (size_t i = 0; i < ahead; ++i) {
        do {
          run_warp(warps[i]);
          if (L.failed) return;
        } while (resolve_warp(warps[i]));
        if (L.failed) return;
      }
      std::vector<unsigned> rest(warps.begin() + ahead, warps.end());
      for (;;) {
        shuffle(rest);
        for (unsigned w : rest) {
          run_warp(w);
          if (L.failed) return;
        }
        bool released = false;
        for (unsigned w : rest) {
          released |= resolve_warp(w);
          if (L.failed) return;
        }
        if (!released) return;
      }
    }
  }
}

// Bytes of static __shared__ variables (compared as integers: the section bounds are
// distinct objects to the compiler).
size_t static_shared_size() {
  const uintptr_t lo = (uintptr_t)__start_cocpu_shared, hi = (uintptr_t)__stop_cocpu_shared;
  return lo && hi > lo ? hi - lo : 0;
}

void poison_shared() {
  if (const size_t n = static_shared_size()) memset(__start_cocpu_shared, 0xff, n);
  if (L.dyn_bytes) memset(cocpu_dynamic_shared, 0xff, L.dyn_bytes);
}

bool in_range(const void* p, size_t n, const void* lo, size_t len) {
  const uintptr_t a = (uintptr_t)p, b = (uintptr_t)lo;
  return a >= b && n <= len && a - b <= len - n;
}

// The address ranges of this module's loaded segments (found once).
struct Segment {
  uintptr_t lo, hi;
};
std::vector<Segment> g_module_segments;

// dl_iterate_phdr callback: records the segments of the object that holds cocpu_kernels.
int find_module_segments(struct dl_phdr_info* info, size_t, void*) {
  std::vector<Segment> segments;
  bool ours = false;
  for (int i = 0; i < info->dlpi_phnum; ++i)
    if (info->dlpi_phdr[i].p_type == PT_LOAD) {
      const uintptr_t lo = info->dlpi_addr + info->dlpi_phdr[i].p_vaddr;
      segments.push_back(Segment{lo, lo + info->dlpi_phdr[i].p_memsz});
      ours |= (uintptr_t)cocpu_kernels >= lo && (uintptr_t)cocpu_kernels < segments.back().hi;
    }
  if (ours) g_module_segments = segments;
  return ours;
}

bool in_this_module(const void* p) {
  if (g_module_segments.empty()) dl_iterate_phdr(find_module_segments, nullptr);
  for (const Segment& s : g_module_segments)
    if ((uintptr_t)p >= s.lo && (uintptr_t)p < s.hi) return true;
  return false;
}

// Whether [p, p + n) lies in the block's shared memory: the dynamic buffer, or a __shared__
// variable. Those of the static section are checked to the byte. Some __shared__ variables
// are ordinary statics instead: all of them under ASan (so that ASan guards them), and those
// of function templates and inline functions (GCC ignores section attributes there); with
// `module_statics` any static object of this module is accepted for them, and ASan (when
// on) checks the object's bounds when the bytes are accessed.
bool in_shared(const void* p, size_t n, bool module_statics = true) {
  if (L.dyn_bytes && in_range(p, n, cocpu_dynamic_shared, L.dyn_bytes)) return true;
  const size_t s = static_shared_size();
  const uintptr_t lo = (uintptr_t)__start_cocpu_shared;
  if (s && (uintptr_t)p >= lo && (uintptr_t)p - lo < s) return in_range(p, n, __start_cocpu_shared, s);
  return module_statics && n && in_this_module(p) && in_this_module(static_cast<const char*>(p) + n - 1);
}

// ---------------------------------------------------------------------------------
// cp.async (PTX ISA 9.1 §9.7.9.25.3): copies are deferred. At issue the source bytes are
// read, the destination is checked and filled with 0xFF, and the copy joins the thread's
// open group; it lands at a wait_group / wait_all that covers its group, or, under the
// seeded thread orders only, earlier at a random scheduling point (land_early). Copies of a
// thread that exits before waiting are dropped.
// ---------------------------------------------------------------------------------

void remove_copy_fiber(Fiber* f) {
  const unsigned last = g_copy_fibers.back();
  g_copy_fibers[(size_t)f->copy_slot] = last;
  g_fibers[last].copy_slot = f->copy_slot;
  g_copy_fibers.pop_back();
  f->copy_slot = -1;
}

inline void land(const AsyncCopy& c) { memcpy(c.dst, c.bytes, c.size); }

void drop_copies(Fiber* f) {
  if (f->copies.empty()) return;
  f->copies.clear();
  remove_copy_fiber(f);
}

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

// Runs one block to completion; false (with L.err set) on an error.
bool run_block() {
  poison_shared();
  g_copy_fibers.clear();
  for (Fiber& f : g_fibers) {
    f.state = RUNNABLE;
    f.copies.clear();
    f.committed = 0;
    f.copy_slot = -1;
    prepare_fiber(&f);
  }
  g_stacks_dirty = false;
  for (;;) {
    drive();
    if (L.failed) return false;
    const Fiber* first_barrier = nullptr;
    const Fiber* first_exited = nullptr;
    for (const Fiber& f : g_fibers) {
      if (f.state == AT_WARP) {
        diagnose_stuck_warp_op(f);
        return false;
      }
      if (f.state == AT_BARRIER && !first_barrier) first_barrier = &f;
      if (f.state == EXITED && !first_exited) first_exited = &f;
    }
    if (!first_barrier) return true;  // every thread has exited
    const Fiber& b = *first_barrier;
    if (first_exited) {
      fail(&b, fmt("%s is not reached by all threads of the block: %s has exited",
                   where(b).c_str(), thread_name(*first_exited).c_str()));
      return false;
    }
    int count = 0;
    for (const Fiber& f : g_fibers) {
      if (f.kind != b.kind || f.line != b.line || (f.file != b.file && strcmp(f.file, b.file))) {
        fail(&f, fmt("waits at %s while %s waits at %s", where(f).c_str(),
                     thread_name(b).c_str(), where(b).c_str()));
        return false;
      }
      count += f.arg;
    }
    const unsigned long long result = b.kind == COCPU_BAR_COUNT ? (unsigned long long)count
                                      : b.kind == COCPU_BAR_AND ? count == (int)L.nthreads
                                      : b.kind == COCPU_BAR_OR  ? count != 0
                                                                : 0;
    for (Fiber& f : g_fibers) {
      f.result = result;
      f.state = RUNNABLE;
    }
  }
}

// ---------------------------------------------------------------------------------
// Crash reporting (in-process launches): a SIGSEGV/SIGBUS handler, installed for the
// duration of a launch, prints which kernel/block/thread faulted (and whether it hit a
// fiber stack guard), restores the previous handler and lets the fault repeat, so
// Python's faulthandler (or the default action) takes it from there. Never silent.
// ---------------------------------------------------------------------------------
#if !COCPU_ASAN
struct sigaction g_old_segv, g_old_bus;
stack_t g_old_altstack;
bool g_own_altstack;
void* g_altstack_mem;

void on_fault(int sig, siginfo_t* si, void*) {
  const uintptr_t a = (uintptr_t)si->si_addr;
  const char* what = "invalid memory access";
  for (const Stack& s : g_stacks)
    if (a >= (uintptr_t)s.map && a < (uintptr_t)s.map + kGuardBytes)
      what = "fiber stack overflow (raise METRALE_ATTN_CPU_STACK_KB)";
  char buf[512];
  int n;
  if (g_cur)
    n = snprintf(buf, sizeof buf,
                 "\ncuda_on_cpu: %s at address %p (signal %d) in kernel '%s' block (%u,%u,%u) "
                 "thread (%u,%u,%u)\n",
                 what, si->si_addr, sig, L.k->name, cocpu_block_idx.x, cocpu_block_idx.y,
                 cocpu_block_idx.z, g_cur->tid.x, g_cur->tid.y, g_cur->tid.z);
  else
    n = snprintf(buf, sizeof buf, "\ncuda_on_cpu: %s at address %p (signal %d) in the scheduler\n",
                 what, si->si_addr, sig);
  if (n > 0) {
    ssize_t r = write(2, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
    (void)r;
  }
  sigaction(sig, sig == SIGSEGV ? &g_old_segv : &g_old_bus, nullptr);
  if (si->si_code <= 0) raise(sig);  // sent, not a fault: re-raise under the old handler
}

void install_fault_handler() {
  stack_t cur;
  sigaltstack(nullptr, &cur);
  g_own_altstack = (cur.ss_flags & SS_DISABLE) != 0;
  if (g_own_altstack) {
    const size_t size = 64 * 1024;
    if (!g_altstack_mem) g_altstack_mem = malloc(size);
    stack_t st{};
    st.ss_sp = g_altstack_mem;
    st.ss_size = size;
    sigaltstack(&st, &g_old_altstack);
  }
  struct sigaction sa{};
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_old_segv);
  sigaction(SIGBUS, &sa, &g_old_bus);
}

void remove_fault_handler() {
  sigaction(SIGSEGV, &g_old_segv, nullptr);
  sigaction(SIGBUS, &g_old_bus, nullptr);
  if (g_own_altstack) {
    stack_t off{};
    off.ss_flags = SS_DISABLE;
    sigaltstack(&off, nullptr);
  }
}
#else
// Under ASan the sanitizer owns SIGSEGV; name the fiber after its report instead.
void on_asan_report(const char*) {
  char buf[256];
  int n;
  if (g_cur)
    n = snprintf(buf, sizeof buf,
                 "cuda_on_cpu: the report above is from kernel '%s' block (%u,%u,%u) thread "
                 "(%u,%u,%u)\n",
                 L.k->name, cocpu_block_idx.x, cocpu_block_idx.y, cocpu_block_idx.z, g_cur->tid.x,
                 g_cur->tid.y, g_cur->tid.z);
  else
    n = snprintf(buf, sizeof buf, "cuda_on_cpu: the report above is from the scheduler\n");
  if (n > 0) {
    ssize_t r = write(2, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
    (void)r;
  }
}
void install_fault_handler() { __asan_set_error_report_callback(on_asan_report); }
void remove_fault_handler() {}
#endif

int launch_error(char* err, int errlen, const std::string& msg) {
  if (errlen > 0) snprintf(err, (size_t)errlen, "%s", msg.c_str());
  return 1;
}

}  // namespace

// ---------------------------------------------------------------------------------
// Entry points for the Python loader
// ---------------------------------------------------------------------------------
extern "C" {

COCPU_EXPORT int cocpu_abi_version(void) { return 1; }

COCPU_EXPORT int cocpu_fiber_impl(void) { return COCPU_USE_UCONTEXT; }

COCPU_EXPORT unsigned long long cocpu_static_shared_bytes(void) {
  return static_shared_size();
}

// Runs kernel `kernel` over grid x block. args[i] points at the value of parameter i
// (as cuLaunchKernel's kernelParams). policy: 0 default (thread order), 1 reverse,
// 2 shuffle, 3 warp-ahead; seed seeds 2 and 3 (and the block order of 2 and 3).
// Returns 0, or nonzero with a message in err.
COCPU_EXPORT int cocpu_launch(int kernel, const unsigned* grid, const unsigned* block,
                              unsigned long long shared_bytes, void* const* args, int policy,
                              unsigned long long seed, unsigned long long stack_bytes, char* err,
                              int errlen) {
  if (kernel < 0 || kernel >= cocpu_num_kernels)
    return launch_error(err, errlen, fmt("no kernel number %d", kernel));
  const cocpu_kernel_desc* k = &cocpu_kernels[kernel];
  const std::string who = fmt("kernel '%s': ", k->name);
  if (policy < POLICY_DEFAULT || policy > POLICY_WARP_AHEAD)
    return launch_error(err, errlen, who + fmt("unknown order policy %d", policy));
  const unsigned long long nthreads = (unsigned long long)block[0] * block[1] * block[2];
  if (!block[0] || !block[1] || !block[2] || block[0] > 1024 || block[1] > 1024 ||
      block[2] > 64 || nthreads > kMaxThreads)
    return launch_error(err, errlen,
                        who + fmt("invalid block (%u,%u,%u): at most (1024,1024,64) and %u "
                                  "threads",
                                  block[0], block[1], block[2], kMaxThreads));
  if (k->max_threads > 0 && nthreads > (unsigned long long)k->max_threads)
    return launch_error(err, errlen,
                        who + fmt("block of %llu threads exceeds __launch_bounds__(%d)", nthreads,
                                  k->max_threads));
  if (!grid[0] || !grid[1] || !grid[2] || grid[0] > 0x7fffffffu || grid[1] > 65535 ||
      grid[2] > 65535)
    return launch_error(err, errlen, who + fmt("invalid grid (%u,%u,%u)", grid[0], grid[1], grid[2]));
  const unsigned long long nblocks = (unsigned long long)grid[0] * grid[1] * grid[2];
  if (nblocks > 0xffffffffull)
    return launch_error(err, errlen, who + "grid too large for the CPU backend");
  // The static part is that of the whole module (the section cannot tell kernels apart),
  // so this errs on the strict side for modules with several shared-hungry kernels. The
  // 48 KiB limit on static shared memory is left to NVRTC, which sees it per kernel.
  const unsigned long long static_bytes = cocpu_static_shared_bytes();
  if (static_bytes + shared_bytes > kMaxShared)
    return launch_error(err, errlen,
                        who + fmt("shared memory of %llu bytes (%llu static in the module + %llu "
                                  "dynamic) exceeds the 227 KiB per block",
                                  static_bytes + shared_bytes, static_bytes, shared_bytes));
  if (!ensure_stacks((unsigned)nthreads, (size_t)stack_bytes))
    return launch_error(err, errlen, who + "cannot map fiber stacks");

  L.k = k;
  L.args = args;
  L.nthreads = (unsigned)nthreads;
  L.nwarps = (unsigned)((nthreads + 31) / 32);
  L.dyn_bytes = (size_t)shared_bytes;
  L.policy = policy;
  L.rng = seed;
  L.failed = false;
  L.err.clear();
#if !COCPU_USE_UCONTEXT
  {
    unsigned mxcsr = __builtin_ia32_stmxcsr();
    unsigned short fpcw;
    __asm__ volatile("fnstcw %0" : "=m"(fpcw));
    L.mxcsr_fpcw[0] = mxcsr;
    L.mxcsr_fpcw[1] = fpcw;
  }
#endif
  void* dyn = nullptr;
  // Exactly shared_bytes long, so ASan flags the first byte past it.
  if (posix_memalign(&dyn, 16, (size_t)shared_bytes) != 0)
    return launch_error(err, errlen, who + "cannot allocate dynamic shared memory");
  cocpu_dynamic_shared = dyn;

  g_fibers.assign(nthreads, Fiber{});
  for (unsigned i = 0; i < nthreads; ++i) {
    Fiber& f = g_fibers[i];
    f.tid = uint3{i % block[0], (i / block[0]) % block[1], i / (block[0] * block[1])};
    f.linear = i;
    f.lane = i % 32;
    f.warp = i / 32;
    f.stack_lo = g_stacks[i].map + kGuardBytes;
    f.stack_size = g_stack_usable;
  }
  cocpu_block_dim = dim3(block[0], block[1], block[2]);
  cocpu_grid_dim = dim3(grid[0], grid[1], grid[2]);

  // Block order: linear (x fastest) by default, reversed for "reverse", a seeded
  // permutation for the shuffling policies.
  std::vector<unsigned> order;
  if (policy == POLICY_SHUFFLE || policy == POLICY_WARP_AHEAD) {
    order.resize((size_t)nblocks);
    for (size_t i = 0; i < order.size(); ++i) order[i] = (unsigned)i;
    shuffle(order);
  }
  install_fault_handler();
  bool ok = true;
  for (unsigned long long i = 0; i < nblocks && ok; ++i) {
    const unsigned long long b = policy == POLICY_REVERSE ? nblocks - 1 - i
                                 : order.empty()          ? i
                                                          : order[(size_t)i];
    cocpu_block_idx = uint3{(unsigned)(b % grid[0]), (unsigned)((b / grid[0]) % grid[1]),
                            (unsigned)(b / ((unsigned long long)grid[0] * grid[1]))};
    ok = run_block();
  }
  remove_fault_handler();
  if (!ok) g_stacks_dirty = true;
  free(dyn);
  cocpu_dynamic_shared = nullptr;
  if (!ok) return launch_error(err, errlen, L.err);
  return 0;
}

// ---------------------------------------------------------------------------------
// Called by the kernel (on a fiber)
// ---------------------------------------------------------------------------------
int cocpu_barrier(int kind, int pred, const char* file, int line) {
  Fiber* f = g_cur;
  f->kind = kind;
  f->arg = pred;
  f->file = file;
  f->line = line;
  f->state = AT_BARRIER;
  suspend(f, false);
  return (int)f->result;
}

}  // extern "C"

namespace {
// `variant` < 0: a shuffle or vote (named by its kind), else a matrix op's variant.
void check_whole_warp(const Fiber* f, int kind, int variant, const char* file, int line) {
  if (warp_lanes(f->warp) != 32)
    fail_here(fmt("%s at %s:%d in a partial warp: the block has %u threads, warp %u only %u "
                  "lanes (warp intrinsics need whole warps)",
                  variant < 0 ? op_name(kind) : matrix_op_name(kind, variant).c_str(), file, line,
                  L.nthreads, f->warp, warp_lanes(f->warp)));
}
}  // namespace

extern "C" {

unsigned long long cocpu_warp_op(int kind, unsigned mask, unsigned long long value, int size,
                                 int arg, int width, const char* file, int line) {
  Fiber* f = g_cur;
  check_whole_warp(f, kind, -1, file, line);
  if (!((mask >> f->lane) & 1u))
    fail_here(fmt("%s at %s:%d with mask 0x%08x, which does not include the calling lane %u",
                  op_name(kind), file, line, mask, f->lane));
  if (width < 1 || width > 32 || (width & (width - 1)))
    fail_here(fmt("%s at %s:%d with width %d (must be a power of two <= 32)", op_name(kind), file,
                  line, width));
  f->kind = kind;
  f->mask = mask;
  f->value = value;
  f->size = size;
  f->arg = arg;
  f->width = width;
  f->file = file;
  f->line = line;
  f->state = AT_WARP;
  suspend(f, false);
  return f->result;
}

unsigned cocpu_activemask(void) {
  const Fiber* lanes = &g_fibers[g_cur->warp * 32];
  unsigned m = 0;
  for (unsigned l = 0; l < warp_lanes(g_cur->warp); ++l)
    if (lanes[l].state != EXITED) m |= 1u << l;
  return m;
}

void cocpu_trap(const char* file, int line) { fail_here(fmt("__trap() at %s:%d", file, line)); }

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
