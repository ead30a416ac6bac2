// CUDA's half precision for the emulated build: the host compiler's _Float16 (IEEE binary16,
// rounded to nearest even like the GPU's conversions), under the names TVM's CUDA source uses.
#pragma once

#include <cmath>

typedef _Float16 __half;
typedef _Float16 half;
struct __attribute__((aligned(4))) __half2 { __half x, y; };
typedef __half2 half2;

inline float __half2float(__half x) { return static_cast<float>(x); }
inline __half __float2half(float x) { return static_cast<__half>(x); }
inline __half __float2half_rn(float x) { return static_cast<__half>(x); }
inline bool __hgt(__half a, __half b) { return a > b; }
inline bool __hlt(__half a, __half b) { return a < b; }
inline __half2 make_half2(__half x, __half y) { return {x, y}; }
inline __half hexp(__half x) { return static_cast<__half>(expf(static_cast<float>(x))); }
inline __half hsqrt(__half x) { return static_cast<__half>(sqrtf(static_cast<float>(x))); }
inline __half hrsqrt(__half x) { return static_cast<__half>(1.0f / sqrtf(static_cast<float>(x))); }
inline __half htanh(__half x) { return static_cast<__half>(tanhf(static_cast<float>(x))); }
inline __half __habs(__half x) { return x < static_cast<__half>(0) ? static_cast<__half>(-x) : x; }
