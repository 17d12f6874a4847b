// Scalar conversions between fp32 and the 16-bit float formats (round to nearest even), and typed
// row access for the CPU backend.
#pragma once

#include <cstdint>
#include <cstring>

#include "hot/tensor.h"

namespace hot::cpu {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return bits_to_float(sign);
    // subnormal: value = man * 2^-24
    float v = static_cast<float>(man) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
}

inline uint16_t float_to_f16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (a < 0x38800000u) {                        // below the smallest normal half (2^-14): subnormal / zero
    // value / 2^-24, rounded to nearest even, as an integer mantissa.
    const float v = bits_to_float(a) * 16777216.0f;
    // v < 1024; rint with ties to even in fp32 (exact: v has at most 24 significant bits).
    float r = v + 8388608.0f;  // 2^23 forces rounding to an integer
    r -= 8388608.0f;
    return sign | static_cast<uint16_t>(r);
  }
  // normal: keep 10 mantissa bits, round to nearest even on the 13 dropped bits.
  uint32_t m = a + 0xfffu + ((a >> 13) & 1u);
  m -= 112u << 23;
  return sign | static_cast<uint16_t>(m >> 13);
}

inline float load_float(const void* base, DType dt, int64_t i) {
  switch (dt) {
    case DType::f32: return static_cast<const float*>(base)[i];
    case DType::bf16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::f16: return f16_to_float(static_cast<const uint16_t*>(base)[i]);
    default: return 0.0f;
  }
}

inline void store_float(void* base, DType dt, int64_t i, float v) {
  switch (dt) {
    case DType::f32: static_cast<float*>(base)[i] = v; break;
    case DType::bf16: static_cast<uint16_t*>(base)[i] = float_to_bf16(v); break;
    case DType::f16: static_cast<uint16_t*>(base)[i] = float_to_f16(v); break;
    default: break;
  }
}

// Row r of a row-major 2-D float view, converted to fp32 into dst[0..cols).
inline void load_row(const TensorView& t, int64_t r, float* dst) {
  const int64_t cols = t.shape[1];
  const int64_t off = r * t.strides[0];
  if (t.dtype == DType::f32) {
    std::memcpy(dst, static_cast<const float*>(t.data) + off, cols * sizeof(float));
    return;
  }
  for (int64_t c = 0; c < cols; ++c) dst[c] = load_float(t.data, t.dtype, off + c);
}

inline void store_row(const TensorView& t, int64_t r, const float* src) {
  const int64_t cols = t.shape[1];
  const int64_t off = r * t.strides[0];
  if (t.dtype == DType::f32) {
    std::memcpy(static_cast<float*>(t.data) + off, src, cols * sizeof(float));
    return;
  }
  for (int64_t c = 0; c < cols; ++c) store_float(t.data, t.dtype, off + c, src[c]);
}

}  // namespace hot::cpu
