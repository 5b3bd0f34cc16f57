// launch.cpp: the entry points of the CUDA-on-CPU runtime that the Python loader calls
// (cuda_on_cpu/abi.py; the parts of the runtime are listed in internal.h): a launch's
// checks, its state, and its blocks in the order policy's order.
#include "internal.h"

#include <stdio.h>
#include <stdlib.h>

using namespace cocpu_runtime;

namespace {
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

// Unmaps this library's fiber stacks (the next launch maps them again); see release_stacks.
COCPU_EXPORT void cocpu_release_stacks(void) { release_stacks(); }

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

}  // extern "C"
