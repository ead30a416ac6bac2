// CUDA device code compiled by the host C++ compiler: the names TVM's CUDA source uses, each GPU
// thread a fiber of souffle/runtime/emulator/runtime.cpp, which runs the threads of every block
// in a chosen order between barriers and checks every shared and global memory access for races
// (the kernel is compiled with -fsanitize=thread, whose per-access hooks the runtime defines).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

struct souffle_dim3 {
  unsigned int x, y, z;
};

extern "C" {
// The running fiber's indices and the launch's shape, set by the scheduler at every switch.
extern souffle_dim3 souffle_thread_idx, souffle_block_idx, souffle_block_dim, souffle_grid_dim;
void souffle_syncthreads(int line);
void souffle_grid_sync();
// A warp-level rendezvous: every lane of ``mask`` deposits ``value``; what each gets back depends
// on ``kind`` (souffle_warp_op) and ``arg`` (source lane, delta or lane mask).
uint64_t souffle_warp_exchange(int line, int kind, unsigned mask, uint64_t value, int arg, int width);
unsigned souffle_activemask();
// cp.async (codegen.tensor_core's asynchronous pipeline): a copy is held until the
// cp.async.wait_group that retires its group, then written (souffle.runtime.emulated rewrites
// TVM's inline PTX into these).
void souffle_cp_async_issue(void* destination, const void* source, const void* data, int bytes);
void souffle_cp_async_commit();
void souffle_cp_async_wait(int pending);
}

// The source is read here, in the kernel's instrumented code, where the race checks see it.
inline void souffle_cp_async(void* destination, const void* source, int bytes) {
  unsigned char data[16];
  for (int b = 0; b < bytes; ++b) data[b] = static_cast<const unsigned char*>(source)[b];
  souffle_cp_async_issue(destination, source, data, bytes);
}

// A predicated cp.async whose predicate fails stores zeros at once (``st.shared``).
inline void souffle_zeros(void* destination, int bytes) {
  for (int b = 0; b < bytes; ++b) static_cast<unsigned char*>(destination)[b] = 0;
}

enum souffle_warp_op { SOUFFLE_SHFL_IDX, SOUFFLE_SHFL_UP, SOUFFLE_SHFL_DOWN, SOUFFLE_SHFL_XOR,
                       SOUFFLE_BALLOT, SOUFFLE_ALL, SOUFFLE_ANY, SOUFFLE_SYNCWARP };

#define threadIdx souffle_thread_idx
#define blockIdx souffle_block_idx
#define blockDim souffle_block_dim
#define gridDim souffle_grid_dim
#define warpSize 32

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
// A timeline build's stamp (codegen.timeline) touches its own __device__ variables, which are
// no kernel buffer: the race and bounds checks are for the model's code, not the stamp's.
#define SOUFFLE_UNCHECKED __attribute__((no_sanitize("thread", "bounds")))
#define __launch_bounds__(...)
// One copy per block: the runtime swaps the module's thread-local block when it switches blocks.
#define __shared__ thread_local
#define __constant__ static const
#define __align__(n) __attribute__((aligned(n)))
// TVM writes `__shared__ alignas(64) T x[n]`, which C++ refuses after a decl-specifier.
#define alignas(n) __attribute__((aligned(n)))

#define __syncthreads() souffle_syncthreads(__LINE__)
inline void __threadfence() {}
inline void __threadfence_block() {}

template <class T>
inline uint64_t souffle_bits(T value) {
  static_assert(sizeof(T) <= 8, "warp exchanges of at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  return bits;
}

template <class T>
inline T souffle_from_bits(uint64_t bits) {
  T value;
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}

template <class T>
inline T souffle_shuffle(int line, int kind, unsigned mask, T value, int arg, int width) {
  return souffle_from_bits<T>(souffle_warp_exchange(line, kind, mask, souffle_bits(value), arg, width));
}

#define __shfl_sync(mask, value, lane, ...) \
  souffle_shuffle(__LINE__, SOUFFLE_SHFL_IDX, (mask), (value), (lane), souffle_width(__VA_ARGS__ + 0))
#define __shfl_up_sync(mask, value, delta, ...) \
  souffle_shuffle(__LINE__, SOUFFLE_SHFL_UP, (mask), (value), (delta), souffle_width(__VA_ARGS__ + 0))
#define __shfl_down_sync(mask, value, delta, ...) \
  souffle_shuffle(__LINE__, SOUFFLE_SHFL_DOWN, (mask), (value), (delta), souffle_width(__VA_ARGS__ + 0))
#define __shfl_xor_sync(mask, value, lanes, ...) \
  souffle_shuffle(__LINE__, SOUFFLE_SHFL_XOR, (mask), (value), (lanes), souffle_width(__VA_ARGS__ + 0))
#define __ballot_sync(mask, predicate) \
  ((unsigned)souffle_warp_exchange(__LINE__, SOUFFLE_BALLOT, (mask), (predicate) != 0, 0, 32))
#define __all_sync(mask, predicate) \
  ((int)souffle_warp_exchange(__LINE__, SOUFFLE_ALL, (mask), (predicate) != 0, 0, 32))
#define __any_sync(mask, predicate) \
  ((int)souffle_warp_exchange(__LINE__, SOUFFLE_ANY, (mask), (predicate) != 0, 0, 32))
#define __syncwarp(...) souffle_warp_exchange(__LINE__, SOUFFLE_SYNCWARP, souffle_mask(__VA_ARGS__ + 0), 0, 0, 32)
#define __activemask() souffle_activemask()

// A width or mask argument left out is written `+ 0`: 0 stands for the default.
inline int souffle_width(int width) { return width == 0 ? 32 : width; }
inline unsigned souffle_mask(unsigned mask) { return mask == 0 ? 0xffffffffu : mask; }

namespace cooperative_groups {
struct grid_group {
  void sync() const { souffle_grid_sync(); }
};
inline grid_group this_grid() { return grid_group(); }
}  // namespace cooperative_groups

// CUDA's vector types, as TVM's vectorized loads and stores use them (``*(float2*)(p) = v``),
// with CUDA's sizes and alignments.
struct __attribute__((aligned(8))) float2 { float x, y; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct __attribute__((aligned(8))) int2 { int x, y; };
struct __attribute__((aligned(16))) int4 { int x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
// TVM's vectorized comparisons and selects of halves hold their masks in these.
struct __attribute__((aligned(4))) ushort2 { unsigned short x, y; };
struct __attribute__((aligned(8))) ushort4 { unsigned short x, y, z, w; };
struct __attribute__((aligned(4))) short2 { short x, y; };
struct __attribute__((aligned(8))) short4 { short x, y, z, w; };
struct __attribute__((aligned(2))) uchar2 { unsigned char x, y; };
struct __attribute__((aligned(4))) uchar4 { unsigned char x, y, z, w; };
struct __attribute__((aligned(8))) uint2 { unsigned x, y; };
struct __attribute__((aligned(16))) uint4 { unsigned x, y, z, w; };
// TVM zero-fills a padded 16-byte vector of 16-bit elements as ``make_uint4`` of four packed pairs.
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

// CUDA's max and min of floats are fmaxf and fminf, which return the other operand for a NaN.
inline float max(float a, float b) { return fmaxf(a, b); }
inline float min(float a, float b) { return fminf(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline int64_t max(int64_t a, int64_t b) { return a > b ? a : b; }
inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }

inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __saturatef(float x) { return x != x ? 0.0f : fminf(fmaxf(x, 0.0f), 1.0f); }
inline int __float_as_int(float x) { return souffle_from_bits<int>(souffle_bits(x)); }
inline float __int_as_float(int x) { return souffle_from_bits<float>(souffle_bits(x)); }
inline unsigned __float_as_uint(float x) { return souffle_from_bits<unsigned>(souffle_bits(x)); }
inline float __uint_as_float(unsigned x) { return souffle_from_bits<float>(souffle_bits(x)); }

// Threads run one at a time between barriers, so an atomic is a plain read-modify-write.
template <class T>
inline T atomicAdd(T* address, T value) {
  T old = *address;
  *address = old + value;
  return old;
}
