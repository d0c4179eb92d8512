// bfloat16 and float16 to and from float32, rounding to nearest even, in integer arithmetic
// (independent of the thread's floating-point flags): what XLA's converts compute.
#pragma once

#include <cstdint>
#include <cstring>

namespace jaxk3 {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float Bf16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

inline uint16_t FloatToBf16(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return BitsFloat(sign | 0x7f800000u | (mant << 13));  // inf, NaN
  if (exp == 0) {
    if (mant == 0) return BitsFloat(sign);
    exp = 127 - 15 + 1;  // subnormal: normalise
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    return BitsFloat(sign | (exp << 23) | ((mant & 0x3ffu) << 13));
  }
  return BitsFloat(sign | ((exp + 127 - 15) << 23) | (mant << 13));
}

inline uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u | static_cast<uint16_t>((a >> 13) & 0x3ffu);  // NaN
  if (a >= 0x47800000u) return sign | 0x7c00u;  // >= 2^16 (and inf): inf
  if (a >= 0x38800000u) {                       // a normal half; mantissa carry may round to inf
    a += 0xc8000fffu + ((a >> 13) & 1u);        // rebias the exponent, round half to even
    return sign | static_cast<uint16_t>(a >> 13);
  }
  if (a < 0x33000000u) return sign;  // < 2^-25 (2^-25 itself ties to the even 0)
  // A subnormal half: value = m * 2^-24.
  const uint32_t shift = 126 - (a >> 23);  // 14..24
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return sign | static_cast<uint16_t>(q);
}

}  // namespace jaxk3
