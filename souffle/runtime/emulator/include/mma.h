// CUDA's warp matrix functions (nvcuda::wmma: m16n16k16 of halves or bfloat16s, m16n16k8 of
// precision::tf32) for the emulated build, as TVM's tensor-core intrinsics call them.
//
// On a GPU a fragment is spread over the warp's 32 lanes in an unspecified layout. Here every
// lane holds the whole fragment (matrix_a M x K, matrix_b K x N, accumulator M x N), so that
// mma_sync needs no exchange between lanes:
// - load_matrix_sync: every lane reads the whole tile (the load is collective: a race on any
//   element of it is a race of the warp's load);
// - store_matrix_sync: lane l writes its share only, the 8 consecutive elements from l * 8 of the
//   row- (or column-) major tile, so that each element is written once, as on a GPU;
// - fill_fragment and mma_sync: each lane computes the whole fragment (float32 sums of products
//   of halves, bfloat16s or TF32s, k in order; a product of two is exact in float32). A TF32
//   operand is held as a float; mma_sync reads its 19 high bits only, as the tensor cores do (the
//   13 low bits dropped), and __float_to_tf32 rounds a float to them (cvt.rna.tf32.f32: to
//   nearest, ties away from zero).
// There is no implicit __syncwarp: as on a GPU, memory written by some lanes is read by another's
// load only after a barrier, and the runtime's race checks see every element each lane touches.
#pragma once

#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

constexpr int souffle_lanes = 32;

namespace precision {
struct tf32 {};
}  // namespace precision

// What a fragment of element type T holds: a TF32 element is a float.
template <class T>
struct souffle_storage { using type = T; };
template <>
struct souffle_storage<precision::tf32> { using type = float; };

// A fragment's rows and columns: matrix_a is M x K, matrix_b K x N, the accumulator M x N.
template <class Use, int M, int N, int K>
struct souffle_shape { static constexpr int rows = M, columns = N; };
template <int M, int N, int K>
struct souffle_shape<matrix_a, M, N, K> { static constexpr int rows = M, columns = K; };
template <int M, int N, int K>
struct souffle_shape<matrix_b, M, N, K> { static constexpr int rows = K, columns = N; };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && (K == 16 || K == 8),
                "the emulator has wmma's m16n16k16 and m16n16k8 shapes only");
  using storage_element_type = typename souffle_storage<T>::type;
  static constexpr int rows = souffle_shape<Use, M, N, K>::rows, columns = souffle_shape<Use, M, N, K>::columns;
  static constexpr int num_elements = rows * columns;
  storage_element_type x[num_elements];  // row-major, whatever the layout it was loaded from
};

inline float __float_to_tf32(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7f800000u) != 0x7f800000u) bits = (bits + 0x1000u) & ~0x1fffu;  // infinities and NaNs as they are
  std::memcpy(&value, &bits, sizeof bits);
  return value;
}

// An operand as the tensor cores read it: a TF32 element's 13 low bits are dropped.
template <class T, class S>
inline S souffle_operand(S value) { return value; }
template <>
inline float souffle_operand<precision::tf32, float>(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  bits &= ~0x1fffu;
  std::memcpy(&value, &bits, sizeof bits);
  return value;
}

template <class Use, int M, int N, int K, class T, class Layout, class V>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, const V& value) {
  for (int e = 0; e < f.num_elements; ++e) f.x[e] = static_cast<typename souffle_storage<T>::type>(value);
}

// Element (row, column) of a tile at ``p``, ``ldm`` elements between rows (row-major) or
// columns (column-major).
inline int souffle_wmma_offset(int row, int column, unsigned ldm, bool column_major) {
  return column_major ? column * static_cast<int>(ldm) + row : row * static_cast<int>(ldm) + column;
}

template <class Use, int M, int N, int K, class T, class Layout>
inline void souffle_wmma_load(fragment<Use, M, N, K, T, Layout>& f, const typename souffle_storage<T>::type* p,
                              unsigned ldm, bool column_major) {
  for (int r = 0; r < f.rows; ++r)
    for (int c = 0; c < f.columns; ++c) f.x[r * f.columns + c] = p[souffle_wmma_offset(r, c, ldm, column_major)];
}

template <class Use, int M, int N, int K, class T>
inline void load_matrix_sync(fragment<Use, M, N, K, T, row_major>& f, const typename souffle_storage<T>::type* p,
                             unsigned ldm) {
  souffle_wmma_load(f, p, ldm, false);
}

template <class Use, int M, int N, int K, class T>
inline void load_matrix_sync(fragment<Use, M, N, K, T, col_major>& f, const typename souffle_storage<T>::type* p,
                             unsigned ldm) {
  souffle_wmma_load(f, p, ldm, true);
}

template <int M, int N, int K, class T>
inline void load_matrix_sync(fragment<accumulator, M, N, K, T, void>& f, const T* p, unsigned ldm, layout_t layout) {
  souffle_wmma_load(f, p, ldm, layout == mem_col_major);
}

template <int M, int N, int K, class T>
inline void store_matrix_sync(T* p, const fragment<accumulator, M, N, K, T, void>& f, unsigned ldm, layout_t layout) {
  const int share = f.num_elements / souffle_lanes;
  const int lane = static_cast<int>(((threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x) % souffle_lanes);
  for (int e = lane * share; e < (lane + 1) * share; ++e) {
    int major = e / 16, minor = e % 16;
    int row = layout == mem_col_major ? minor : major, column = layout == mem_col_major ? major : minor;
    p[souffle_wmma_offset(row, column, ldm, layout == mem_col_major)] = f.x[row * 16 + column];
  }
}

template <int M, int N, int K, class TA, class LA, class TB, class LB, class TC>
inline void mma_sync(fragment<accumulator, M, N, K, TC, void>& d, const fragment<matrix_a, M, N, K, TA, LA>& a,
                     const fragment<matrix_b, M, N, K, TB, LB>& b, const fragment<accumulator, M, N, K, TC, void>& c) {
  TC sum[M * N];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      TC s = c.x[i * N + j];
      for (int k = 0; k < K; ++k)
        s += static_cast<TC>(souffle_operand<TA>(a.x[i * K + k])) *
             static_cast<TC>(souffle_operand<TB>(b.x[k * N + j]));
      sum[i * N + j] = s;
    }
  for (int e = 0; e < M * N; ++e) d.x[e] = sum[e];
}

}  // namespace wmma
}  // namespace nvcuda
