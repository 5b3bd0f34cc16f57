// internal.h: what the translation units of the CUDA-on-CPU runtime share: the launch
// state, the fibers, and the functions one part of the runtime calls in another. Kernels
// never see it (they see cuda_on_cpu.h), and the built library exports none of its
// cocpu_runtime names (-fvisibility=hidden).
//
// The runtime, by job:
//   launch.cpp     the entry points the Python loader calls (cocpu_launch and the rest)
//   scheduler.cpp  fibers and the block scheduler: stacks, context switches, thread
//                  orders, barriers, shuffles and votes, the block's shared memory
//   ptx.cpp        the PTX emulation of the collective and deferred instructions of an
//                  intrinsics header (metrale-attn's kernels_cu/pd_ptx.cuh): ldmatrix,
//                  movmatrix, mma, cp.async (the conversions are pure functions in
//                  cuda_on_cpu.h)
//   errors.cpp     error messages, and crash reporting (SIGSEGV/SIGBUS, ASan reports)
//   switch_x86_64.S  the fiber context switch on x86-64 (ucontext elsewhere)
#ifndef CUDA_ON_CPU_RUNTIME_INTERNAL_H
#define CUDA_ON_CPU_RUNTIME_INTERNAL_H

#include "cuda_on_cpu.h"

#include <stddef.h>
#include <stdint.h>

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
#else
#define COCPU_ASAN 0
#endif

// Defined by the kernel translation unit (the loader's registration block).
extern "C" COCPU_EXPORT const cocpu_kernel_desc cocpu_kernels[];
extern "C" COCPU_EXPORT const int cocpu_num_kernels;

namespace cocpu_runtime {

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

extern Launch L;
extern std::vector<Fiber> g_fibers;
extern Fiber* g_cur;  // the running fiber, null while the scheduler runs

// Fiber stacks (scheduler.cpp): mmap'd once and reused across blocks and launches, each
// with a PROT_NONE guard of kGuardBytes below it.
struct Stack {
  unsigned char* map;
  size_t map_size;
};
extern std::vector<Stack> g_stacks;
extern size_t g_stack_usable;
extern bool g_stacks_dirty;  // ASan: fibers were abandoned mid-frame, their shadow is stale

// scheduler.cpp
bool ensure_stacks(unsigned n, size_t usable);
void release_stacks();
bool run_block();  // one block to completion; false (with L.err set) on an error
void suspend(Fiber* f, bool final);
[[noreturn]] void fail_here(const std::string& what);  // on a fiber: fail and leave for good
void check_whole_warp(const Fiber* f, int kind, int variant, const char* file, int line);
size_t static_shared_size();
bool in_shared(const void* p, size_t n, bool module_statics = true);
unsigned long long next_random();

// The seeded permutation of the shuffling thread orders.
template <class T>
void shuffle(std::vector<T>& v) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[next_random() % i]);
}

// ptx.cpp
void complete_matrix_op(Fiber* lanes, const Fiber& a);
extern std::vector<unsigned> g_copy_fibers;  // fibers of the block with pending cp.async copies
void drop_copies(Fiber* f);
void land_early();

// errors.cpp
std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string thread_name(const Fiber& f);
void fail(const Fiber* f, const std::string& what);  // records the launch's first error
const char* op_name(int kind);
std::string matrix_op_name(int kind, int variant);
std::string where(const Fiber& f);
void install_fault_handler();
void remove_fault_handler();

// The .sync.aligned matrix ops: the whole warp must execute the same instruction.
inline bool is_matrix_op(int kind) { return kind >= COCPU_OP_LDMATRIX && kind <= COCPU_OP_MMA; }

}  // namespace cocpu_runtime

#endif  // CUDA_ON_CPU_RUNTIME_INTERNAL_H
