// errors.cpp: how the CUDA-on-CPU runtime reports (the parts are listed in internal.h): the
// messages of a failed launch, naming kernel, block, thread and source lines, and the crash
// reports of a launch that faults.
#include "internal.h"

#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#if COCPU_ASAN
#include <sanitizer/asan_interface.h>
#endif

namespace cocpu_runtime {

// ---------------------------------------------------------------------------------
// Error messages
// ---------------------------------------------------------------------------------
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

// The pd_ptx.cuh function a matrix op came from, variant included.
std::string matrix_op_name(int kind, int variant) {
  if (kind == COCPU_OP_LDMATRIX)
    return fmt("pd_ldmatrix_x%d%s", variant & 7, (variant & COCPU_LDMATRIX_TRANS) ? "_trans" : "");
  if (kind == COCPU_OP_MMA) return variant == COCPU_MMA_F16 ? "pd_mma_f16_m16n8k16" : "pd_mma_bf16_m16n8k16";
  return op_name(kind);
}

namespace {
const char* barrier_name(int kind) {
  switch (kind) {
    case COCPU_BAR_SYNC: return "__syncthreads";
    case COCPU_BAR_COUNT: return "__syncthreads_count";
    case COCPU_BAR_AND: return "__syncthreads_and";
    case COCPU_BAR_OR: return "__syncthreads_or";
  }
  return "?";
}
}  // namespace

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
// Crash reporting (in-process launches): a SIGSEGV/SIGBUS handler, installed for the
// duration of a launch, prints which kernel/block/thread faulted (and whether it hit a
// fiber stack guard), restores the previous handler and lets the fault repeat, so
// Python's faulthandler (or the default action) takes it from there. Never silent.
// ---------------------------------------------------------------------------------
#if !COCPU_ASAN
namespace {
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
}  // namespace

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
namespace {
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
}  // namespace

void install_fault_handler() { __asan_set_error_report_callback(on_asan_report); }
void remove_fault_handler() {}
#endif

}  // namespace cocpu_runtime
