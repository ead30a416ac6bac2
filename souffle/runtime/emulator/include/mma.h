// CUDA's warp matrix functions (nvcuda::wmma, m16n16k16) for the emulated build, as TVM's
// tensor-core intrinsics call them.
//
// On a GPU a fragment is spread over the warp's 32 lanes in an unspecified layout. Here every
// lane holds the whole 16 x 16 fragment, so that mma_sync needs no exchange between lanes:
// - load_matrix_sync: every lane reads the whole tile (the load is collective: a race on any
//   element of it is a race of the warp's load);
// - store_matrix_sync: lane l writes its share only, the 8 consecutive elements from l * 8 of the
//   row- (or column-) major tile, so that each element is written once, as on a GPU;
// - fill_fragment and mma_sync: each lane computes the whole fragment (float32 sums of products
//   of halves or bfloat16s, k in order; a product of two is exact in float32).
// There is no implicit __syncwarp: as on a GPU, memory written by some lanes is read by another's
// load only after a barrier, and the runtime's race checks see every element each lane touches.
#pragma once

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

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the emulator has wmma's m16n16k16 shape only");
  static constexpr int rows = 16, columns = 16;
  static constexpr int num_elements = rows * columns;
  T x[num_elements];  // row-major, whatever the layout it was loaded from
};

template <class Use, int M, int N, int K, class T, class Layout, class V>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, const V& value) {
  for (int e = 0; e < f.num_elements; ++e) f.x[e] = static_cast<T>(value);
}

// Element (row, column) of a 16 x 16 tile at ``p``, ``ldm`` elements between rows (row-major) or
// columns (column-major).
inline int souffle_wmma_offset(int row, int column, unsigned ldm, bool column_major) {
  return column_major ? column * static_cast<int>(ldm) + row : row * static_cast<int>(ldm) + column;
}

template <class Use, int M, int N, int K, class T, class Layout>
inline void souffle_wmma_load(fragment<Use, M, N, K, T, Layout>& f, const T* p, unsigned ldm, bool column_major) {
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) f.x[r * 16 + c] = p[souffle_wmma_offset(r, c, ldm, column_major)];
}

template <class Use, int M, int N, int K, class T>
inline void load_matrix_sync(fragment<Use, M, N, K, T, row_major>& f, const T* p, unsigned ldm) {
  souffle_wmma_load(f, p, ldm, false);
}

template <class Use, int M, int N, int K, class T>
inline void load_matrix_sync(fragment<Use, M, N, K, T, col_major>& f, const T* p, unsigned ldm) {
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
  TC sum[256];
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      TC s = c.x[i * 16 + j];
      for (int k = 0; k < 16; ++k) s += static_cast<TC>(a.x[i * 16 + k]) * static_cast<TC>(b.x[k * 16 + j]);
      sum[i * 16 + j] = s;
    }
  for (int e = 0; e < 256; ++e) d.x[e] = sum[e];
}

}  // namespace wmma
}  // namespace nvcuda
