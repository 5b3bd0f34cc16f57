// scheduler.cpp: fibers and the block scheduler of the CUDA-on-CPU runtime (the parts are
// listed in internal.h). Linked into every kernel module (each module has its own copy, all
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
#include "internal.h"

#include <string.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>

#if COCPU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

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
COCPU_HIDDEN void cocpu_switch(void** save_sp, void* new_sp);  // switch_x86_64.S
#endif
}

namespace cocpu_runtime {

Launch L;
std::vector<Fiber> g_fibers;
Fiber* g_cur;

// ---------------------------------------------------------------------------------
// Stacks: mmap'd once and reused across blocks and launches.
// ---------------------------------------------------------------------------------
std::vector<Stack> g_stacks;
size_t g_stack_usable;
bool g_stacks_dirty;

namespace {
size_t page_size() {
  static size_t p = (size_t)sysconf(_SC_PAGESIZE);
  return p;
}
}  // namespace

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

// Unmaps every stack (abi.py calls it, through cocpu_release_stacks, on the library that
// launched last when another launches): each library keeps its own pool, two mappings per
// stack, and a process holding hundreds of libraries of 256-thread blocks would otherwise
// reach the kernel's limit on mappings (vm.max_map_count, 65530), past which creating a
// thread fails.
void release_stacks() {
  for (Stack& s : g_stacks) {
#if COCPU_ASAN
    __asan_unpoison_memory_region(s.map + kGuardBytes, s.map_size - kGuardBytes);
#endif
    munmap(s.map, s.map_size);
  }
  g_stacks.clear();
  g_stack_usable = 0;
  g_stacks_dirty = false;
}

// ---------------------------------------------------------------------------------
// Context switches
// ---------------------------------------------------------------------------------
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

namespace {
void fiber_main();

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

}  // namespace

// Called on a fiber: record the error and leave for good.
void fail_here(const std::string& what) {
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

// ---------------------------------------------------------------------------------
// Warp ops
// ---------------------------------------------------------------------------------
namespace {

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
}  // namespace

// ---------------------------------------------------------------------------------
// The block's shared memory
// ---------------------------------------------------------------------------------
// Bytes of static __shared__ variables (compared as integers: the section bounds are
// distinct objects to the compiler).
size_t static_shared_size() {
  const uintptr_t lo = (uintptr_t)__start_cocpu_shared, hi = (uintptr_t)__stop_cocpu_shared;
  return lo && hi > lo ? hi - lo : 0;
}

namespace {
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
}  // namespace

// Whether [p, p + n) lies in the block's shared memory: the dynamic buffer, or a __shared__
// variable. Those of the static section are checked to the byte. Some __shared__ variables
// are ordinary statics instead: all of them under ASan (so that ASan guards them), and those
// of function templates and inline functions (GCC ignores section attributes there); with
// `module_statics` any static object of this module is accepted for them, and ASan (when
// on) checks the object's bounds when the bytes are accessed.
bool in_shared(const void* p, size_t n, bool module_statics) {
  if (L.dyn_bytes && in_range(p, n, cocpu_dynamic_shared, L.dyn_bytes)) return true;
  const size_t s = static_shared_size();
  const uintptr_t lo = (uintptr_t)__start_cocpu_shared;
  if (s && (uintptr_t)p >= lo && (uintptr_t)p - lo < s) return in_range(p, n, __start_cocpu_shared, s);
  return module_statics && n && in_this_module(p) && in_this_module(static_cast<const char*>(p) + n - 1);
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

// `variant` < 0: a shuffle or vote (named by its kind), else a matrix op's variant.
void check_whole_warp(const Fiber* f, int kind, int variant, const char* file, int line) {
  if (warp_lanes(f->warp) != 32)
    fail_here(fmt("%s at %s:%d in a partial warp: the block has %u threads, warp %u only %u "
                  "lanes (warp intrinsics need whole warps)",
                  variant < 0 ? op_name(kind) : matrix_op_name(kind, variant).c_str(), file, line,
                  L.nthreads, f->warp, warp_lanes(f->warp)));
}

}  // namespace cocpu_runtime

using namespace cocpu_runtime;

// ---------------------------------------------------------------------------------
// Called by the kernel (on a fiber)
// ---------------------------------------------------------------------------------
extern "C" {

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

}  // extern "C"
