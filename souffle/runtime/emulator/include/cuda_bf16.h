// CUDA's bfloat16 for the emulated build, under the names TVM's CUDA source uses. g++ 12 has no
// bfloat16 arithmetic: __nv_bfloat16 holds the 16 bits and computes through float, each result
// rounded to nearest even. A float sum, difference, product or quotient of two bfloat16 values,
// rounded to bfloat16, is the correctly rounded one (float's 24 bits are at least 2 x 8 + 2), so
// the operators give what sm_80's bfloat16 instructions, which round once, give. htanh, hpow,
// htan, hatan and herf are defined by TVM's own prelude (for nvcc before 12.8, which this is).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

// float -> bfloat16 to nearest even, as __float2bfloat16_rn; a NaN becomes CUDA's 0x7fff.
inline unsigned short souffle_bf16_bits(float value) {
  uint32_t u;
  std::memcpy(&u, &value, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  return static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// A double (an integer, a half) rounded once, as CUDA's __double2bfloat16 and __int2bfloat16_rn:
// to float by rounding to odd, which leaves no false tie for the rounding to 8 bits after it.
inline unsigned short souffle_bf16_bits(double value) {
  float f = static_cast<float>(value);
  if (std::isfinite(f) && static_cast<double>(f) != value) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if (std::fabs(static_cast<double>(f)) > std::fabs(value)) --u;  // toward zero
    u |= 1u;
    std::memcpy(&f, &u, sizeof u);
  }
  return souffle_bf16_bits(f);
}

struct __nv_bfloat16_raw {
  unsigned short x;
};

struct __attribute__((aligned(2))) __nv_bfloat16 {
  unsigned short x;

  __nv_bfloat16() = default;
  __nv_bfloat16(float value) : x(souffle_bf16_bits(value)) {}
  template <class T, std::enable_if_t<!std::is_class_v<T> && std::is_convertible_v<T, double>, int> = 0>
  __nv_bfloat16(T value) : x(souffle_bf16_bits(static_cast<double>(value))) {}
  __nv_bfloat16(const __nv_bfloat16_raw& raw) : x(raw.x) {}

  operator float() const {
    uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  // As CUDA's __bfloat162int_rz and its kin: toward zero, saturated, a NaN to 0.
  template <class I, std::enable_if_t<std::is_integral_v<I> && !std::is_same_v<I, bool>, int> = 0>
  explicit operator I() const {
    const float f = *this;
    if (f != f) return 0;
    if (f <= static_cast<float>(std::numeric_limits<I>::min())) return std::numeric_limits<I>::min();
    if (f >= static_cast<float>(std::numeric_limits<I>::max())) return std::numeric_limits<I>::max();
    return static_cast<I>(f);
  }

  // TVM's shared-memory reductions copy through volatile pointers; CUDA's header allows it this way.
  operator __nv_bfloat16_raw() const volatile { return {x}; }
  volatile __nv_bfloat16& operator=(const __nv_bfloat16_raw& raw) volatile {
    x = raw.x;
    return *this;
  }
};
typedef __nv_bfloat16 nv_bfloat16;

struct __attribute__((aligned(4))) __nv_bfloat162 {
  __nv_bfloat16 x, y;
  __nv_bfloat162() = default;
  __nv_bfloat162(__nv_bfloat16 x, __nv_bfloat16 y) : x(x), y(y) {}
};
typedef __nv_bfloat162 nv_bfloat162;

inline __nv_bfloat16 operator+(__nv_bfloat16 a, __nv_bfloat16 b) { return static_cast<float>(a) + static_cast<float>(b); }
inline __nv_bfloat16 operator-(__nv_bfloat16 a, __nv_bfloat16 b) { return static_cast<float>(a) - static_cast<float>(b); }
inline __nv_bfloat16 operator*(__nv_bfloat16 a, __nv_bfloat16 b) { return static_cast<float>(a) * static_cast<float>(b); }
inline __nv_bfloat16 operator/(__nv_bfloat16 a, __nv_bfloat16 b) { return static_cast<float>(a) / static_cast<float>(b); }
inline __nv_bfloat16 operator-(__nv_bfloat16 a) { return __nv_bfloat16_raw{static_cast<unsigned short>(a.x ^ 0x8000u)}; }
inline __nv_bfloat16 operator+(__nv_bfloat16 a) { return a; }
inline __nv_bfloat16& operator+=(__nv_bfloat16& a, __nv_bfloat16 b) { return a = a + b; }
inline __nv_bfloat16& operator-=(__nv_bfloat16& a, __nv_bfloat16 b) { return a = a - b; }
inline __nv_bfloat16& operator*=(__nv_bfloat16& a, __nv_bfloat16 b) { return a = a * b; }
inline __nv_bfloat16& operator/=(__nv_bfloat16& a, __nv_bfloat16 b) { return a = a / b; }
inline bool operator==(__nv_bfloat16 a, __nv_bfloat16 b) { return static_cast<float>(a) == static_cast<float>(b); }
inline bool operator!=(__nv_bfloat16 a, __nv_bfloat16 b) { return static_cast<float>(a) != static_cast<float>(b); }
inline bool operator<(__nv_bfloat16 a, __nv_bfloat16 b) { return static_cast<float>(a) < static_cast<float>(b); }
inline bool operator<=(__nv_bfloat16 a, __nv_bfloat16 b) { return static_cast<float>(a) <= static_cast<float>(b); }
inline bool operator>(__nv_bfloat16 a, __nv_bfloat16 b) { return static_cast<float>(a) > static_cast<float>(b); }
inline bool operator>=(__nv_bfloat16 a, __nv_bfloat16 b) { return static_cast<float>(a) >= static_cast<float>(b); }

inline float __bfloat162float(__nv_bfloat16 x) { return x; }
inline __nv_bfloat16 __float2bfloat16(float x) { return x; }
inline __nv_bfloat16 __float2bfloat16_rn(float x) { return x; }
inline __nv_bfloat16 __double2bfloat16(double x) { return __nv_bfloat16_raw{souffle_bf16_bits(x)}; }
inline __nv_bfloat16 __int2bfloat16_rn(int x) { return __nv_bfloat16_raw{souffle_bf16_bits(static_cast<double>(x))}; }
inline bool __hgt(__nv_bfloat16 a, __nv_bfloat16 b) { return a > b; }
inline bool __hlt(__nv_bfloat16 a, __nv_bfloat16 b) { return a < b; }
inline __nv_bfloat16 __habs(__nv_bfloat16 x) { return __nv_bfloat16_raw{static_cast<unsigned short>(x.x & 0x7fffu)}; }

#define SOUFFLE_BF16_MATH(NAME, FLOAT_EXPRESSION) \
  inline __nv_bfloat16 NAME(__nv_bfloat16 bf16) { const float x = bf16; return FLOAT_EXPRESSION; }
SOUFFLE_BF16_MATH(hexp, expf(x))
SOUFFLE_BF16_MATH(hexp2, exp2f(x))
SOUFFLE_BF16_MATH(hexp10, exp10f(x))
SOUFFLE_BF16_MATH(hlog, logf(x))
SOUFFLE_BF16_MATH(hlog2, log2f(x))
SOUFFLE_BF16_MATH(hlog10, log10f(x))
SOUFFLE_BF16_MATH(hsqrt, sqrtf(x))
SOUFFLE_BF16_MATH(hrsqrt, 1.0f / sqrtf(x))
SOUFFLE_BF16_MATH(hsin, sinf(x))
SOUFFLE_BF16_MATH(hcos, cosf(x))
SOUFFLE_BF16_MATH(hceil, ceilf(x))
SOUFFLE_BF16_MATH(hfloor, floorf(x))
SOUFFLE_BF16_MATH(htrunc, truncf(x))
SOUFFLE_BF16_MATH(hrint, rintf(x))
#undef SOUFFLE_BF16_MATH
