// cuda_on_cpu.h: the kernel-facing half of the CUDA-on-CPU shim.
//
// The loader compiles a kernel source (CUDA C, unchanged) with the host C++ compiler as
//
//     #include "cuda_on_cpu.h"   <- this file
//     <kernel source>            <- with the caller's #line directives
//     <registration>             <- one cocpu_kernel_desc per extern "C" __global__
//
// and links it with the runtime (runtime/*.cpp: fibers and the block scheduler, the PTX
// emulation, error and crash reporting; runtime/internal.h lists the parts) into one
// shared library per kernel variant. Every CUDA thread of a block runs on its own fiber;
// blocks run one after another on the calling OS thread.
//
// Kernel style this backend supports (the same sources must also build with NVRTC):
//   * entry points are `extern "C" __global__ void name(...)`; parameters are pointers
//     and 32/64-bit integers and floats (passed from Python as NumPy arrays / typed
//     NumPy scalars);
//   * no #include in kernel sources other than the caller's own headers, which it
//     inlines; bf16/fp8 conversions are bit operations in a shared header;
//   * no host macros such as INFINITY, NAN or M_PI (they are #undef'd below so that a
//     kernel using them fails here as it would under NVRTC): write
//     __int_as_float(0x7f800000) and spell constants out;
//   * warp intrinsics (__shfl*_sync, __ballot_sync, __any/__all_sync, __syncwarp) with
//     the full mask in warp-converged code, in blocks whose size is a multiple of 32;
//   * no early `return` before a __syncthreads (every non-exited thread must reach the
//     same __syncthreads; an exited thread is an error here, a hang or worse on a GPU);
//   * fminf/fmaxf (or same-type min/max) rather than mixed-type min/max;
//   * dynamic shared memory only as the declaration statement `DYNAMIC_SHARED(T, name);`
//     inside the kernel body (on a GPU: `extern __shared__ __align__(16) T name[]`, so
//     within one source a name must always have the same T: NVRTC rejects a second
//     type for the same extern array);
//   * PTX only through an intrinsics header such as metrale-attn's kernels_cu/pd_ptx.cuh
//     (the one file with `asm`: one function per instruction, which calls the runtime
//     interface below on the CPU; what is emulated is listed below); no cooperative
//     groups, no textures, no `extern "C" { ... }` blocks around kernels (the loader
//     looks for `extern "C" __global__` definitions);
//   * __shared__ variables in the kernel body (function templates and inline functions
//     work, but GCC ignores section attributes there, so theirs are not poisoned), or the
//     DYNAMIC_SHARED buffer;
//   * per-thread data lives on a fiber stack of 256 KiB (1 MiB under ASan; set
//     METRALE_ATTN_CPU_STACK_KB): plenty for register arrays of a few hundred floats,
//     not for unbounded recursion. An overflow hits a guard page and is reported.
//
// Semantics and what the shim checks:
//   * __shared__ variables are `static` (one copy; blocks run sequentially). They are
//     placed in the section "cocpu_shared", which the runtime fills with 0xFF bytes
//     (NaN for floats, -1 for ints) at the start of every block, as it does the dynamic
//     shared buffer: a kernel that reads shared memory it did not write sees garbage.
//     Under AddressSanitizer static shared arrays are plain statics instead (ASan does
//     not guard variables in named sections), so they are not poisoned in that mode but
//     overflows of them are reported. Not thread_local on purpose: static TLS breaks
//     dlopen and hides overflows from ASan.
//   * static (all of the module's __shared__ variables) + dynamic shared memory is
//     limited to 227 KiB as on sm_90; blocks to 1024 threads and to __launch_bounds__.
//   * __syncthreads(): all non-exited threads of the block must wait at the same
//     __syncthreads (same file:line); otherwise the launch fails naming block, thread and
//     both source lines. Warp ops: every lane named in the mask must reach a warp op of
//     the same kind, mask and width; a mask naming an exited lane, a lane stuck at a
//     barrier or a disagreeing lane, a shuffle reading a lane outside the mask, a width
//     that is not a power of two <= 32 and any warp op in a partial warp are errors.
//     Each error aborts the launch and surfaces as CudaOnCpuError in Python.
//   * float math maps to the host libm (correctly rounded where CUDA is exact, sane
//     fp32 elsewhere: __expf is expf, rsqrtf is 1/sqrtf, ...). Compiled with
//     -ffp-contract=off and without -ffast-math: a*b+c is never fused behind your back
//     (nvcc does contract by default; write fmaf() where a fused multiply-add is meant).
//     Compiled with -fno-strict-aliasing: type-punned vector loads behave as on a GPU.
//   * __CUDA_ON_CPU__ is defined; __CUDA_ARCH__, __CUDACC__ and __CUDACC_RTC__ are not.
//   * thread order: fibers of a block are resumed in an order chosen per launch
//     ("default": thread order, "reverse", "shuffle:SEED", "warp-ahead:SEED"; the seeded
//     ones also permute the block order). Race-free kernels give identical bytes under
//     all of them. __activemask() returns the lanes of the warp that have not exited.
//   * atomics exist (blocks and fibers never run concurrently, so they are plain
//     read-modify-writes), but results then depend on the block order, which the
//     "reverse"/"shuffle"/"warp-ahead" launch orders permute.
//
// The PTX instructions of kernels_cu/pd_ptx.cuh (PTX ISA 9.1 sections):
//   * warp-collective ldmatrix / movmatrix / mma.m16n8k16 (.sync.aligned, §9.7.14.5): all 32
//     lanes must reach the same function (same variant: x1/x2/x4, trans, bf16/f16) at the
//     same line; a lane that exits, waits at a barrier or reaches another call is an error
//     naming kernel, block, thread and the kernel line of the call. The last lane to arrive
//     completes the op: every lane's result from every lane's operands (per-lane payloads).
//   * ldmatrix: lane l's address is row l % 8 of matrix l / 8, 16 bytes, 16-byte aligned,
//     inside the block's shared memory (else an error); the rows are read when the whole
//     warp has arrived. Fragment: lane i gets row i/4, columns 2(i%4) (low half) and
//     2(i%4)+1; .trans: rows 2(i%4) and 2(i%4)+1 of column i/4. movmatrix: the fragment of
//     the transpose.
//   * mma.m16n8k16.row.col.f32.{bf16,f16}: D[m][n] = C[m][n], then + A[m][k] * B[k][n] for
//     k = 0..15 in that order, each an IEEE fp32 multiply (exact for these inputs unless
//     it underflows) and fp32 add rounded to nearest, subnormals kept, NaN -> 0x7fffffff.
//     The PTX ISA leaves the order, rounding and subnormal handling open: a tensor core may
//     differ in the last bits, so nothing downstream of an MMA may require CPU == GPU bytes.
//   * cp.async is deferred. At issue the source bytes are read (ASan checks the source at
//     that line), the destination is checked to be shared memory aligned to the copy size
//     and filled with 0xFF, and the copy joins the thread's open group; commit_group closes
//     the group; wait_group N lands every copy of the thread's committed groups except the
//     newest N (open ones are not waited for); wait_all commits and lands everything.
//     __syncthreads lands nothing. Under "shuffle:S" / "warp-ahead:S" a pending copy may
//     also land at a random scheduling point before its wait; under "default"/"reverse"
//     exactly at the wait. Bytes past src_bytes are zero; copies still pending when their
//     thread exits are dropped. So a missing or too-short wait reads 0xFF (or a stale tile).
//   * cvt / prmt: bit-exact pure functions (below); NaN results 0x7fff (f16, bf16) and
//     0x7fffffff (f32), as CUDA's own headers produce them.
#ifndef CUDA_ON_CPU_H
#define CUDA_ON_CPU_H

#define __CUDA_ON_CPU__ 1

#ifdef COCPU_SCAN
// Scan mode: the loader preprocesses the kernel source with this header to find the
// kernels that exist for the given defines. Only the markers the scanner looks for are
// kept (a self-referential macro expands to itself).
#define __global__ __global__
#define __launch_bounds__(...) __launch_bounds__(__VA_ARGS__)
#else  // !COCPU_SCAN

#include <math.h>

#include <limits>
#include <type_traits>
#include <utility>

// Host macros that NVRTC does not have (see the style notes above).
#undef INFINITY
#undef NAN
#undef HUGE_VAL
#undef HUGE_VALF
#undef HUGE_VALL
#undef MAXFLOAT
#undef M_E
#undef M_LOG2E
#undef M_LOG10E
#undef M_LN2
#undef M_LN10
#undef M_PI
#undef M_PI_2
#undef M_PI_4
#undef M_1_PI
#undef M_2_PI
#undef M_2_SQRTPI
#undef M_SQRT2
#undef M_SQRT1_2

// ------------------------------------------------------------------------------------
// Qualifiers
// ------------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __constant__
#define __grid_constant__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#if defined(__SANITIZE_ADDRESS__) || defined(COCPU_NO_SHARED_SECTION)
#define __shared__ static
#else
#define __shared__ static __attribute__((section("cocpu_shared")))
#endif

// ------------------------------------------------------------------------------------
// Built-in vector types (CUDA sizes and alignments)
// ------------------------------------------------------------------------------------
#define COCPU_VEC1(T, N, A)                                             \
  struct __attribute__((aligned(A))) N##1 { T x; };                   \
  static inline N##1 make_##N##1(T x) { return N##1{x}; }
#define COCPU_VEC2(T, N, A)                                             \
  struct __attribute__((aligned(A))) N##2 { T x, y; };                \
  static inline N##2 make_##N##2(T x, T y) { return N##2{x, y}; }
#define COCPU_VEC3(T, N, A)                                             \
  struct __attribute__((aligned(A))) N##3 { T x, y, z; };             \
  static inline N##3 make_##N##3(T x, T y, T z) { return N##3{x, y, z}; }
#define COCPU_VEC4(T, N, A)                                             \
  struct __attribute__((aligned(A))) N##4 { T x, y, z, w; };          \
  static inline N##4 make_##N##4(T x, T y, T z, T w) { return N##4{x, y, z, w}; }
#define COCPU_VECS(T, N, A1, A2, A3, A4) \
  COCPU_VEC1(T, N, A1) COCPU_VEC2(T, N, A2) COCPU_VEC3(T, N, A3) COCPU_VEC4(T, N, A4)

COCPU_VECS(signed char, char, 1, 2, 1, 4)
COCPU_VECS(unsigned char, uchar, 1, 2, 1, 4)
COCPU_VECS(short, short, 2, 4, 2, 8)
COCPU_VECS(unsigned short, ushort, 2, 4, 2, 8)
COCPU_VECS(int, int, 4, 8, 4, 16)
COCPU_VECS(unsigned int, uint, 4, 8, 4, 16)
COCPU_VECS(float, float, 4, 8, 4, 16)
COCPU_VECS(long, long, 8, 16, 8, 16)
COCPU_VECS(unsigned long, ulong, 8, 16, 8, 16)
COCPU_VECS(long long, longlong, 8, 16, 8, 16)
COCPU_VECS(unsigned long long, ulonglong, 8, 16, 8, 16)
COCPU_VECS(double, double, 8, 16, 8, 16)

#undef COCPU_VEC1
#undef COCPU_VEC2
#undef COCPU_VEC3
#undef COCPU_VEC4
#undef COCPU_VECS

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};

// ------------------------------------------------------------------------------------
// Runtime interface (runtime/*.cpp, linked into the same shared library)
// ------------------------------------------------------------------------------------
#define COCPU_HIDDEN __attribute__((visibility("hidden")))
#define COCPU_EXPORT __attribute__((visibility("default")))

// Warp-op kinds (shared with the runtime).
enum cocpu_op_kind {
  COCPU_OP_SYNCWARP = 1,
  COCPU_OP_SHFL_IDX,
  COCPU_OP_SHFL_UP,
  COCPU_OP_SHFL_DOWN,
  COCPU_OP_SHFL_XOR,
  COCPU_OP_BALLOT,
  COCPU_OP_ANY,
  COCPU_OP_ALL,
  // The warp-collective matrix instructions of kernels_cu/pd_ptx.cuh (.sync.aligned: every
  // lane of the warp at the same call site and variant; operands through per-lane payloads).
  COCPU_OP_LDMATRIX,   // variant: number of matrices (1, 2, 4) | COCPU_LDMATRIX_TRANS
  COCPU_OP_MOVMATRIX,  // variant: 0
  COCPU_OP_MMA,        // variant: COCPU_MMA_BF16 | COCPU_MMA_F16
};
enum { COCPU_LDMATRIX_TRANS = 8, COCPU_MMA_BF16 = 0, COCPU_MMA_F16 = 1 };
// Per-lane operands of the matrix ops: the completing lane's step reads every lane's
// inputs before it writes any output (so d may alias c).
struct cocpu_ldmatrix_args {
  const void* row;  // this lane's row address (lanes 0..8*num-1)
  unsigned* r;      // out: r[0..num-1]
};
struct cocpu_movmatrix_args {
  unsigned a;  // in
  unsigned d;  // out
};
struct cocpu_mma_args {
  const unsigned* a;  // 4 registers of A (2 x 16 bits each)
  const unsigned* b;  // 2 registers of B
  const float* c;     // 4 accumulators in
  float* d;           // 4 accumulators out
};
// Barrier kinds.
enum cocpu_bar_kind { COCPU_BAR_SYNC = 1, COCPU_BAR_COUNT, COCPU_BAR_AND, COCPU_BAR_OR };

// Kernel parameter kinds as the launcher checks them.
enum cocpu_param_kind {
  COCPU_PARAM_POINTER = 0,
  COCPU_PARAM_SIGNED = 1,
  COCPU_PARAM_UNSIGNED = 2,
  COCPU_PARAM_FLOAT = 3,
  COCPU_PARAM_BOOL = 4,
  COCPU_PARAM_OTHER = 5,
};

struct cocpu_param_desc {
  int kind, size, align;
  int pointee_size, pointee_align, pointee_const;  // pointers only
};

struct cocpu_kernel_desc {
  const char* name;
  const char* param_names;  // comma-separated, as written in the source
  const char* param_types;  // '|'-separated C types, as written in the source
  int nparams;
  const cocpu_param_desc* params;
  void* fn;                                     // the kernel itself
  void (*invoke)(void* fn, void* const* args);  // calls fn(*(A0*)args[0], ...)
  int max_threads;                              // from __launch_bounds__, 0 = none
};

extern "C" {
COCPU_HIDDEN extern uint3 cocpu_thread_idx;  // of the fiber now running
COCPU_HIDDEN extern uint3 cocpu_block_idx;
COCPU_HIDDEN extern dim3 cocpu_block_dim;
COCPU_HIDDEN extern dim3 cocpu_grid_dim;
COCPU_HIDDEN extern void* cocpu_dynamic_shared;
COCPU_HIDDEN int cocpu_barrier(int kind, int pred, const char* file, int line);
COCPU_HIDDEN unsigned long long cocpu_warp_op(int kind, unsigned mask, unsigned long long value,
                                              int size, int arg, int width, const char* file,
                                              int line);
COCPU_HIDDEN unsigned cocpu_activemask(void);
COCPU_HIDDEN void cocpu_trap(const char* file, int line) __attribute__((noreturn));
COCPU_HIDDEN void cocpu_matrix_op(int kind, int variant, void* args, const char* file, int line);
// cp.async (deferred copies, see the top comment): cp_size 4/8/16, src_bytes 0..cp_size.
COCPU_HIDDEN void cocpu_cp_async(void* smem_dst, const void* gmem_src, int cp_size, unsigned src_bytes,
                                 int cache_all, const char* file, int line);
COCPU_HIDDEN void cocpu_cp_async_commit(void);
COCPU_HIDDEN void cocpu_cp_async_wait(int n);  // wait_group n; n < 0: wait_all
}

#define threadIdx (static_cast<const uint3&>(cocpu_thread_idx))
#define blockIdx (static_cast<const uint3&>(cocpu_block_idx))
#define blockDim (static_cast<const dim3&>(cocpu_block_dim))
#define gridDim (static_cast<const dim3&>(cocpu_grid_dim))
static constexpr int warpSize = 32;

// `DYNAMIC_SHARED(T, name);` : the launch's dynamic shared buffer (shared_bytes long,
// 16-byte aligned, refilled with 0xFF at the start of every block).
#define DYNAMIC_SHARED(T, name) \
  T* const name = static_cast<T*>(__builtin_assume_aligned(cocpu_dynamic_shared, 16))

// ------------------------------------------------------------------------------------
// Synchronisation and warp intrinsics (call sites recorded for error messages)
// ------------------------------------------------------------------------------------
// Trailing default parameters that record the caller's file and line (the .cu line, as the
// loader's #line directives name it). kernels_cu/pd_ptx.cuh uses it too, so an error in an
// intrinsic names the kernel line that called it, not the header's.
#define COCPU_CALLER_SITE const char *cocpu_file = __builtin_FILE(), int cocpu_line = __builtin_LINE()
#define COCPU_SITE COCPU_CALLER_SITE

static inline void __syncthreads(COCPU_SITE) {
  cocpu_barrier(COCPU_BAR_SYNC, 0, cocpu_file, cocpu_line);
}
static inline int __syncthreads_count(int pred, COCPU_SITE) {
  return cocpu_barrier(COCPU_BAR_COUNT, pred != 0, cocpu_file, cocpu_line);
}
static inline int __syncthreads_and(int pred, COCPU_SITE) {
  return cocpu_barrier(COCPU_BAR_AND, pred != 0, cocpu_file, cocpu_line);
}
static inline int __syncthreads_or(int pred, COCPU_SITE) {
  return cocpu_barrier(COCPU_BAR_OR, pred != 0, cocpu_file, cocpu_line);
}
static inline void __syncwarp(unsigned mask = 0xffffffffu, COCPU_SITE) {
  cocpu_warp_op(COCPU_OP_SYNCWARP, mask, 0, 0, 0, 32, cocpu_file, cocpu_line);
}

namespace cocpu_detail {
template <class T>
inline T shfl(int kind, unsigned mask, T var, int arg, int width, const char* file, int line) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8,
                "warp shuffles move values of at most 8 bytes");
  unsigned long long bits = 0;
  __builtin_memcpy(&bits, &var, sizeof(T));
  bits = cocpu_warp_op(kind, mask, bits, (int)sizeof(T), arg, width, file, line);
  T out;
  __builtin_memcpy(&out, &bits, sizeof(T));
  return out;
}
}  // namespace cocpu_detail

template <class T>
inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = warpSize, COCPU_SITE) {
  return cocpu_detail::shfl(COCPU_OP_SHFL_IDX, mask, var, srcLane, width, cocpu_file, cocpu_line);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize, COCPU_SITE) {
  return cocpu_detail::shfl(COCPU_OP_SHFL_UP, mask, var, (int)delta, width, cocpu_file,
                            cocpu_line);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                          COCPU_SITE) {
  return cocpu_detail::shfl(COCPU_OP_SHFL_DOWN, mask, var, (int)delta, width, cocpu_file,
                            cocpu_line);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = warpSize, COCPU_SITE) {
  return cocpu_detail::shfl(COCPU_OP_SHFL_XOR, mask, var, laneMask, width, cocpu_file,
                            cocpu_line);
}
static inline unsigned __ballot_sync(unsigned mask, int pred, COCPU_SITE) {
  return (unsigned)cocpu_warp_op(COCPU_OP_BALLOT, mask, pred != 0, 4, 0, 32, cocpu_file,
                                 cocpu_line);
}
static inline int __any_sync(unsigned mask, int pred, COCPU_SITE) {
  return (int)cocpu_warp_op(COCPU_OP_ANY, mask, pred != 0, 4, 0, 32, cocpu_file, cocpu_line);
}
static inline int __all_sync(unsigned mask, int pred, COCPU_SITE) {
  return (int)cocpu_warp_op(COCPU_OP_ALL, mask, pred != 0, 4, 0, 32, cocpu_file, cocpu_line);
}
// Lanes of the caller's warp that have not exited (no synchronisation).
static inline unsigned __activemask() { return cocpu_activemask(); }

static inline void __threadfence() {}
static inline void __threadfence_block() {}
static inline void __threadfence_system() {}
static inline void __nanosleep(unsigned) {}
static inline void __trap_at(COCPU_SITE) { cocpu_trap(cocpu_file, cocpu_line); }
#define __trap() __trap_at()

#undef COCPU_SITE

// ------------------------------------------------------------------------------------
// Memory access hints: plain loads and stores here
// ------------------------------------------------------------------------------------
template <class T> static inline T __ldg(const T* p) { return *p; }
template <class T> static inline T __ldca(const T* p) { return *p; }
template <class T> static inline T __ldcg(const T* p) { return *p; }
template <class T> static inline T __ldcs(const T* p) { return *p; }
template <class T> static inline T __ldlu(const T* p) { return *p; }
template <class T> static inline T __ldcv(const T* p) { return *p; }
template <class T> static inline void __stwb(T* p, T v) { *p = v; }
template <class T> static inline void __stcg(T* p, T v) { *p = v; }
template <class T> static inline void __stcs(T* p, T v) { *p = v; }
template <class T> static inline void __stwt(T* p, T v) { *p = v; }

// ------------------------------------------------------------------------------------
// Float intrinsics and bit casts
// ------------------------------------------------------------------------------------
static inline float __int_as_float(int x) { float f; __builtin_memcpy(&f, &x, 4); return f; }
static inline float __uint_as_float(unsigned x) { float f; __builtin_memcpy(&f, &x, 4); return f; }
static inline int __float_as_int(float f) { int x; __builtin_memcpy(&x, &f, 4); return x; }
static inline unsigned __float_as_uint(float f) { unsigned x; __builtin_memcpy(&x, &f, 4); return x; }
static inline double __longlong_as_double(long long x) { double d; __builtin_memcpy(&d, &x, 8); return d; }
static inline long long __double_as_longlong(double d) { long long x; __builtin_memcpy(&x, &d, 8); return x; }

// The approximate GPU intrinsics map to the libm functions (not bit-identical to a GPU).
// Macros, because glibc's math.h already declares these names (without defining them).
#define __expf expf
#define __exp10f exp10f
#define __logf logf
#define __log2f log2f
#define __log10f log10f
#define __sinf sinf
#define __cosf cosf
#define __tanf tanf
#define __powf powf
static inline float __fdividef(float a, float b) { return a / b; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline double rsqrt(double x) { return 1.0 / sqrt(x); }
static inline float rcbrtf(float x) { return 1.0f / cbrtf(x); }
static inline float __saturatef(float x) { return x >= 1.0f ? 1.0f : (x > 0.0f ? x : 0.0f); }
// The correctly rounded ones are exact IEEE operations here too (no contraction).
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __frcp_rn(float x) { return 1.0f / x; }
static inline float __fsqrt_rn(float x) { return sqrtf(x); }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }

// Conversions: round-to-nearest-even via rint (default rounding mode), saturating and
// NaN -> 0 like the GPU's cvt instructions.
namespace cocpu_detail {
template <class I>
inline I f2i(double r) {
  if (r != r) return 0;
  if (r <= (double)std::numeric_limits<I>::min()) return std::numeric_limits<I>::min();
  if (r >= (double)std::numeric_limits<I>::max()) return std::numeric_limits<I>::max();
  return (I)r;
}
}  // namespace cocpu_detail
static inline int __float2int_rn(float x) { return cocpu_detail::f2i<int>(rintf(x)); }
static inline int __float2int_rz(float x) { return cocpu_detail::f2i<int>(truncf(x)); }
static inline int __float2int_rd(float x) { return cocpu_detail::f2i<int>(floorf(x)); }
static inline int __float2int_ru(float x) { return cocpu_detail::f2i<int>(ceilf(x)); }
static inline unsigned __float2uint_rn(float x) { return cocpu_detail::f2i<unsigned>(rintf(x)); }
static inline unsigned __float2uint_rz(float x) { return cocpu_detail::f2i<unsigned>(truncf(x)); }
static inline long long __float2ll_rn(float x) { return cocpu_detail::f2i<long long>(rintf(x)); }
static inline long long __float2ll_rz(float x) { return cocpu_detail::f2i<long long>(truncf(x)); }
static inline float __int2float_rn(int x) { return (float)x; }
static inline float __uint2float_rn(unsigned x) { return (float)x; }
static inline float __ll2float_rn(long long x) { return (float)x; }
static inline float __double2float_rn(double x) { return (float)x; }

// ------------------------------------------------------------------------------------
// Integer intrinsics
// ------------------------------------------------------------------------------------
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
static inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  return __builtin_bswap32(x);
}
static inline unsigned long long __brevll(unsigned long long x) {
  return ((unsigned long long)__brev((unsigned)x) << 32) | __brev((unsigned)(x >> 32));
}
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long v = ((unsigned long long)y << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (((s >> (4 * i)) & 7u) * 8)) & 0xffu) << (8 * i);
  return r;
}
static inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
  const unsigned long long v = ((unsigned long long)hi << 32) | lo;
  return (unsigned)((v << (s & 31u)) >> 32);
}
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
  const unsigned long long v = ((unsigned long long)hi << 32) | lo;
  return (unsigned)(v >> (s & 31u));
}
static inline unsigned __funnelshift_lc(unsigned lo, unsigned hi, unsigned s) {
  return __funnelshift_l(lo, hi, s > 32u ? 32u : s);
}
static inline unsigned __funnelshift_rc(unsigned lo, unsigned hi, unsigned s) {
  return __funnelshift_r(lo, hi, s > 32u ? 32u : s);
}
static inline unsigned __umulhi(unsigned a, unsigned b) {
  return (unsigned)(((unsigned long long)a * b) >> 32);
}
static inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
static inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
static inline long long __mul64hi(long long a, long long b) {
  return (long long)(((__int128)a * b) >> 64);
}
static inline int __mul24(int a, int b) { return (int)((a << 8) >> 8) * (int)((b << 8) >> 8); }
static inline unsigned __umul24(unsigned a, unsigned b) { return (a & 0xffffffu) * (b & 0xffffffu); }

// min / max: CUDA's same-type overloads (int/unsigned mixes go unsigned, as on CUDA).
#define COCPU_MINMAX(T)                                  \
  static inline T min(T a, T b) { return b < a ? b : a; } \
  static inline T max(T a, T b) { return a < b ? b : a; }
COCPU_MINMAX(int)
COCPU_MINMAX(unsigned int)
COCPU_MINMAX(long)
COCPU_MINMAX(unsigned long)
COCPU_MINMAX(long long)
COCPU_MINMAX(unsigned long long)
#undef COCPU_MINMAX
static inline unsigned min(int a, unsigned b) { return min((unsigned)a, b); }
static inline unsigned min(unsigned a, int b) { return min(a, (unsigned)b); }
static inline unsigned max(int a, unsigned b) { return max((unsigned)a, b); }
static inline unsigned max(unsigned a, int b) { return max(a, (unsigned)b); }
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }

// ------------------------------------------------------------------------------------
// Atomics: fibers switch only at barriers and warp ops, so these are plain RMWs.
// ------------------------------------------------------------------------------------
template <class T> static inline T atomicAdd(T* p, T v) { T o = *p; *p = o + v; return o; }
template <class T> static inline T atomicSub(T* p, T v) { T o = *p; *p = o - v; return o; }
template <class T> static inline T atomicExch(T* p, T v) { T o = *p; *p = v; return o; }
template <class T> static inline T atomicMin(T* p, T v) { T o = *p; *p = v < o ? v : o; return o; }
template <class T> static inline T atomicMax(T* p, T v) { T o = *p; *p = o < v ? v : o; return o; }
template <class T> static inline T atomicAnd(T* p, T v) { T o = *p; *p = o & v; return o; }
template <class T> static inline T atomicOr(T* p, T v) { T o = *p; *p = o | v; return o; }
template <class T> static inline T atomicXor(T* p, T v) { T o = *p; *p = o ^ v; return o; }
template <class T> static inline T atomicCAS(T* p, T cmp, T v) {
  T o = *p;
  if (o == cmp) *p = v;
  return o;
}
static inline unsigned atomicInc(unsigned* p, unsigned v) {
  unsigned o = *p; *p = (o >= v) ? 0u : o + 1u; return o;
}
static inline unsigned atomicDec(unsigned* p, unsigned v) {
  unsigned o = *p; *p = (o == 0u || o > v) ? v : o - 1u; return o;
}

// ------------------------------------------------------------------------------------
// Conversion and byte-permute instructions of kernels_cu/pd_ptx.cuh: bit-exact, pure.
// NaN results are the canonical NaN CUDA's own headers produce for these conversions
// (cuda_fp16.hpp / cuda_bf16.hpp / cuda_fp8.hpp host paths): 0x7fff for f16 and bf16,
// 0x7fffffff for f32, sign dropped. The PTX ISA only says "NaN"; the GPU tests check it.
// ------------------------------------------------------------------------------------

// f32 -> f16 bits, round to nearest even, subnormals kept, overflow to +-inf.
static inline unsigned cocpu_f32_to_f16_rn(float x) {
  const unsigned bits = __float_as_uint(x);
  const unsigned sign = (bits >> 16) & 0x8000u, u = bits & 0x7fffffffu;
  if (u > 0x7f800000u) return 0x7fffu;
  unsigned h, rem, half;
  if (u >= 0x38800000u) {  // f16 normal range or beyond: rebias the exponent by 127 - 15
    const unsigned r = u - 0x38000000u;
    h = r >> 13, rem = r & 0x1fffu, half = 0x1000u;
  } else {  // f16 subnormal or zero: the value in units of 2^-24
    const unsigned e = u >> 23;
    if (e < 102) return sign;  // below 2^-25: rounds to zero (2^-25 itself ties to even 0)
    const unsigned m = (u & 0x7fffffu) | 0x800000u, shift = 126 - e;  // 14..24
    h = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  }
  if (rem > half || (rem == half && (h & 1u))) ++h;
  return sign | (h >= 0x7c00u ? 0x7c00u : h);
}

// f32 -> bf16 bits, round to nearest even (overflow to +-inf).
static inline unsigned cocpu_f32_to_bf16_rn(float x) {
  const unsigned bits = __float_as_uint(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  return (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
}

// f16 bits -> f32 bits, exact (subnormals normalized), NaN -> 0x7fffffff.
static inline unsigned cocpu_f16_to_f32_bits(unsigned h) {
  const unsigned sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu;
  unsigned m = h & 0x3ffu;
  if (e == 0x1fu) return m ? 0x7fffffffu : (sign | 0x7f800000u);
  if (e) return sign | ((e + 112u) << 23) | (m << 13);
  if (!m) return sign;
  unsigned fe = 113;  // value m * 2^-24 = 2^(fe - 127) * 1.frac after normalizing
  while (!(m & 0x400u)) m <<= 1, --fe;
  return sign | (fe << 23) | ((m & 0x3ffu) << 13);
}

// fp8 e4m3 (bias 7, no inf, NaN = S.1111.111) -> f16 bits, exact.
static inline unsigned cocpu_e4m3_to_f16(unsigned x) {
  const unsigned sign = (x & 0x80u) << 8, em = x & 0x7fu;
  if (em == 0x7fu) return 0x7fffu;
  if (em >= 0x08u) return sign | ((em + 0x40u) << 7);  // exponent + 8, mantissa << 7
  if (!em) return sign;
  const unsigned p = 31u - (unsigned)__builtin_clz(em);  // subnormal M * 2^-9: an f16 normal
  return sign | ((p + 6u) << 10) | ((em << (10u - p)) & 0x3ffu);
}

// fp8 e5m2 (the top byte of an f16) -> f16 bits, exact.
static inline unsigned cocpu_e5m2_to_f16(unsigned x) {
  return (x & 0x7fu) > 0x7cu ? 0x7fffu : (x & 0xffu) << 8;
}

// prmt.b32 d, a, b, c in the default mode: byte i of d is byte (c >> 4i) & 7 of {b, a},
// or, when bit 3 of that nibble is set, that byte's sign bit replicated over 8 bits.
static inline unsigned cocpu_prmt(unsigned a, unsigned b, unsigned c) {
  const unsigned long long v = ((unsigned long long)b << 32) | a;
  unsigned d = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned sel = (c >> (4 * i)) & 0xfu;
    unsigned byte = (unsigned)(v >> ((sel & 7u) * 8)) & 0xffu;
    if (sel & 8u) byte = (byte & 0x80u) ? 0xffu : 0u;
    d |= byte << (8 * i);
  }
  return d;
}

// ------------------------------------------------------------------------------------
// Registration helpers (used by the code the loader appends)
// ------------------------------------------------------------------------------------
namespace cocpu_detail {
template <class T>
constexpr cocpu_param_desc param_desc() {
  if constexpr (std::is_pointer<T>::value) {
    using P = typename std::remove_pointer<T>::type;
    using U = typename std::remove_cv<P>::type;
    constexpr int psize = std::is_void<U>::value ? 1 : (int)sizeof(
        typename std::conditional<std::is_void<U>::value, char, U>::type);
    constexpr int palign = std::is_void<U>::value ? 1 : (int)alignof(
        typename std::conditional<std::is_void<U>::value, char, U>::type);
    return cocpu_param_desc{COCPU_PARAM_POINTER, (int)sizeof(T), (int)alignof(T), psize, palign,
                            std::is_const<P>::value ? 1 : 0};
  } else if constexpr (std::is_same<T, bool>::value) {
    return cocpu_param_desc{COCPU_PARAM_BOOL, (int)sizeof(T), (int)alignof(T), 0, 0, 0};
  } else if constexpr (std::is_floating_point<T>::value) {
    return cocpu_param_desc{COCPU_PARAM_FLOAT, (int)sizeof(T), (int)alignof(T), 0, 0, 0};
  } else if constexpr (std::is_integral<T>::value || std::is_enum<T>::value) {
    return cocpu_param_desc{std::is_signed<T>::value ? COCPU_PARAM_SIGNED : COCPU_PARAM_UNSIGNED,
                            (int)sizeof(T), (int)alignof(T), 0, 0, 0};
  } else {
    return cocpu_param_desc{COCPU_PARAM_OTHER, (int)sizeof(T), (int)alignof(T), 0, 0, 0};
  }
}

template <class... A>
struct signature {
  // One extra entry so that a kernel without parameters still has an array.
  static constexpr cocpu_param_desc params[sizeof...(A) + 1] = {param_desc<A>()...,
                                                                 cocpu_param_desc{}};
  template <size_t... I>
  static void call(void (*f)(A...), void* const* args, std::index_sequence<I...>) {
    f(*static_cast<typename std::remove_reference<A>::type*>(args[I])...);
  }
  static void invoke(void* fn, void* const* args) {
    call(reinterpret_cast<void (*)(A...)>(fn), args, std::index_sequence_for<A...>{});
  }
};

template <class... A>
inline cocpu_kernel_desc make_kernel_desc(void (*f)(A...), const char* name,
                                             const char* names, const char* types,
                                             int max_threads) {
  return cocpu_kernel_desc{name,
                           names,
                           types,
                           (int)sizeof...(A),
                           signature<A...>::params,
                           reinterpret_cast<void*>(f),
                           &signature<A...>::invoke,
                           max_threads};
}
}  // namespace cocpu_detail

#endif  // COCPU_SCAN
#endif  // CUDA_ON_CPU_H
