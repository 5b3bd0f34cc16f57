// Probes of the asynchronous copies of kernels_cu/pd_ptx.cuh: a double-buffered pipeline
// that must be byte-exact under every thread order (with planted wait bugs that must not
// be), the async-group accounting, and out-of-bounds copies for AddressSanitizer.
#include "pd_ptx.cuh"

#define COPY_THREADS 64

template <int S, bool CA>
__device__ __forceinline__ void copy_chunk(void* dst, const void* src, unsigned src_bytes) {
  if constexpr (S == 4) pd_cp_async_ca_4(dst, src, src_bytes);
  else if constexpr (S == 8) pd_cp_async_ca_8(dst, src, src_bytes);
  else if constexpr (CA) pd_cp_async_ca_16(dst, src, src_bytes);
  else pd_cp_async_cg_16(dst, src, src_bytes);
}

// A copy into slot `which` (0 or 1) of two stages of COPY_THREADS * S bytes, given slot 0's
// address: AT (16-byte .cg only) names the stage by an immediate offset (pd_cp_async_cg_16_at).
template <int S, bool CA, bool AT>
__device__ __forceinline__ void copy_to(unsigned char* slot0, int which, const void* src, unsigned src_bytes) {
  if constexpr (AT) {
    static_assert(S == 16 && !CA, "pd_cp_async_cg_16_at copies 16 bytes through L2");
    if (which) pd_cp_async_cg_16_at<COPY_THREADS * 16>(slot0, src, src_bytes);
    else pd_cp_async_cg_16_at<0>(slot0, src, src_bytes);
  } else {
    copy_chunk<S, CA>(slot0 + which * COPY_THREADS * S, src, src_bytes);
  }
}

// Copies ntiles tiles of COPY_THREADS * S bytes from in to out through two shared-memory
// stages (dynamic, 2 * COPY_THREADS * S bytes), one cp.async of S bytes per thread per tile:
// chunk i copies src_bytes[i] bytes (0..S) and is zero-filled to S. Tile k + 1 is in flight
// while tile k is stored, and thread t stores chunk t ^ 32 (another warp's copy), so the
// barrier after the wait is needed too. One block of COPY_THREADS threads.
// bug: 0 none; 1 no wait at all; 2 wait_group 2 where 1 is right (the tile read is pending).
template <int S, bool CA, bool AT>
__device__ __forceinline__ void pipelined_copy(const unsigned char* in, const unsigned char* src_bytes,
                                               unsigned char* out, int ntiles, int bug) {
  DYNAMIC_SHARED(unsigned char, stage);
  const int t = threadIdx.x, tile = COPY_THREADS * S;
  copy_to<S, CA, AT>(stage + t * S, 0, in + t * S, src_bytes[t]);
  pd_cp_async_commit();
  for (int k = 0; k < ntiles; ++k) {
    if (k + 1 < ntiles) {
      const int i = (k + 1) * COPY_THREADS + t;
      copy_to<S, CA, AT>(stage + t * S, (k + 1) & 1, in + i * S, src_bytes[i]);
    }
    pd_cp_async_commit();  // empty on the last tile: wait_group 1 then covers tile k
    if (bug == 0) pd_cp_async_wait<1>();
    if (bug == 2) pd_cp_async_wait<2>();
    __syncthreads();
    const int j = t ^ 32;
    const unsigned char* s = stage + (k & 1) * tile + j * S;
    unsigned char* o = out + (k * COPY_THREADS + j) * S;
    for (int b = 0; b < S; ++b) o[b] = s[b];
    __syncthreads();  // stage k & 1 is refilled next iteration
  }
}

#define PIPELINED_COPY(NAME, S, CA, AT)                                                                \
  extern "C" __global__ void NAME(const unsigned char* in, const unsigned char* src_bytes, unsigned char* out, \
                                  int ntiles, int bug) {                                               \
    pipelined_copy<S, CA, AT>(in, src_bytes, out, ntiles, bug);                                        \
  }
PIPELINED_COPY(copy_ca4, 4, true, false)
PIPELINED_COPY(copy_ca8, 8, true, false)
PIPELINED_COPY(copy_ca16, 16, true, false)
PIPELINED_COPY(copy_cg16, 16, false, false)
PIPELINED_COPY(copy_cg16_at, 16, false, true)

// Async-group accounting. Thread t copies in[4t + c] into its slot c (dynamic shared,
// 4 words per thread) with one ca.4 copy each: slots 0, 1, 2 in groups 0, 1, 2 (each
// committed), slot 3 left uncommitted. seen[(5t + s) * 4 + c] is slot c at snapshot s:
// 0 after a __syncthreads, 1 after wait_group 2, 2 after wait_group 1, 3 after
// wait_group 0, 4 after wait_all.
extern "C" __global__ void group_accounting(const unsigned* in, unsigned* seen) {
  DYNAMIC_SHARED(unsigned, slots);
  const int t = threadIdx.x;
  unsigned* mine = slots + 4 * t;
  unsigned* snap = seen + 20 * t;
  for (int c = 0; c < 3; ++c) {
    pd_cp_async_ca_4(&mine[c], &in[4 * t + c], 4);
    pd_cp_async_commit();
  }
  pd_cp_async_ca_4(&mine[3], &in[4 * t + 3], 4);
  __syncthreads();
  for (int c = 0; c < 4; ++c) snap[c] = mine[c];
  pd_cp_async_wait<2>();
  for (int c = 0; c < 4; ++c) snap[4 + c] = mine[c];
  pd_cp_async_wait<1>();
  for (int c = 0; c < 4; ++c) snap[8 + c] = mine[c];
  pd_cp_async_wait<0>();
  for (int c = 0; c < 4; ++c) snap[12 + c] = mine[c];
  pd_cp_async_wait_all();
  for (int c = 0; c < 4; ++c) snap[16 + c] = mine[c];
}

// Planted out-of-bounds copies: lane l copies 16 bytes from in + 16 l + src_shift to the
// dynamic buffer (32 * 16 bytes) at 16 l + dst_shift; shifts of 0 stay in bounds.
extern "C" __global__ void shifted_copy(const unsigned char* in, unsigned char* out, int src_shift, int dst_shift) {
  DYNAMIC_SHARED(unsigned char, buf);
  const int l = threadIdx.x;
  pd_cp_async_cg_16(buf + 16 * l + dst_shift, in + 16 * l + src_shift, 16);
  pd_cp_async_wait_all();
  __syncthreads();
  for (int b = 0; b < 16; ++b) out[16 * l + b] = buf[16 * l + b];
}

// Misuse the shim reports (the GPU faults or is undefined): mode 1 src_bytes past the copy
// size, 2 a misaligned destination, 3 a destination in global memory, 4 a source in shared
// memory. Mode 5 is fine: src_bytes 0 with a null source reads nothing and zero-fills, and
// the 16 bytes go back to global.
extern "C" __global__ void bad_copy(unsigned char* global, int mode) {
  DYNAMIC_SHARED(unsigned char, buf);
  const int l = threadIdx.x;
  unsigned char* dst = mode == 2 ? buf + 16 * l + 4 : mode == 3 ? global + 16 * l : buf + 16 * l;
  const unsigned char* src = mode == 4 ? buf + 16 * ((l + 1) & 31) : mode == 5 ? nullptr : global + 16 * l;
  pd_cp_async_ca_16(dst, src, mode == 1 ? 17u : mode == 5 ? 0u : 16u);
  pd_cp_async_wait_all();
  if (mode == 5)
    for (int b = 0; b < 16; ++b) global[16 * l + b] = buf[16 * l + b];
}
