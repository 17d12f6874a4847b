// The scalar rules of SPEC §5, written once and used by every backend so that quantised values agree
// bit for bit. All arithmetic is single IEEE operations in fp32 (no contraction into FMA: the CUDA
// side uses the _rn intrinsics, the CPU side is compiled without -ffast-math and with -ffp-contract=off).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "hot/rng.h"

namespace hot {

HOT_HD int qmax_for_bits(int bits) { return (1 << (bits - 1)) - 1; }

// |v| as an ordered key: for non-negative floats the IEEE bit pattern orders like the value, and
// NaN > +Inf > every finite value, so max over keys propagates non-finite input (SPEC §5).
HOT_HD uint32_t amax_key(float v) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint32_t>(__float_as_uint(v)) & 0x7fffffffu;
#else
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return u & 0x7fffffffu;
#endif
}

HOT_HD float amax_from_key(uint32_t k) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(k);
#else
  float f;
  std::memcpy(&f, &k, sizeof(f));
  return f;
#endif
}

// Scale of a tensor (or row) whose max |v| is `amax`. Values are rounded from (v * pre) * inv, and
// `scale` dequantises. amax == 0: inv = scale = 0 (q = 0, s = 0). Non-finite amax: inv = 0 and
// scale = NaN, so every dequantised value that uses this scale is NaN and the non-finite input stays
// visible. Tiny amax (qmax / amax overflows fp32, amax below about 3.7e-37): pre = 2^64 and
// inv = qmax / (amax * 2^64); both products are exact (|v| <= amax), so the rule is unchanged.
// Otherwise pre = 1, and (v * 1) * inv == v * inv bit for bit.
struct QuantScale {
  float inv;
  float scale;
  float pre;
};

HOT_HD float hot_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

HOT_HD QuantScale quant_scale_from_amax(float amax, int qmax) {
  QuantScale s;
  s.pre = 1.0f;
  const uint32_t key = amax_key(amax);
  if (key >= 0x7f800000u) {  // Inf or NaN
    s.inv = 0.0f;
    s.scale = amax_from_key(0x7fc00000u);
  } else if (amax == 0.0f) {
    s.inv = 0.0f;
    s.scale = 0.0f;
  } else {
    const float q = static_cast<float>(qmax);
    s.scale = hot_div(amax, q);
    s.inv = hot_div(q, amax);
    if (amax_key(s.inv) >= 0x7f800000u) {
      s.pre = 18446744073709551616.0f;  // 2^64
      s.inv = hot_div(q, amax * s.pre);
    }
  }
  return s;
}

HOT_HD float hot_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

HOT_HD float hot_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// The correctly rounded square root (IEEE; CUDA's __fsqrt_rn).
HOT_HD float hot_sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// The fused multiply-add a * b + c, rounded once.
HOT_HD float hot_fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

HOT_HD int clamp_q(float r, int qmax) {
  // r is finite here (v finite, inv finite); clamp in float before converting.
  const float hi = static_cast<float>(qmax);
  r = r > hi ? hi : r;
  r = r < -hi ? -hi : r;
  return static_cast<int>(r);
}

// Round-to-nearest, ties to even: q = clamp(rint(v * inv), -qmax, qmax) (with v pre-scaled, see
// QuantScale). inv == 0 gives 0 (amax == 0 or non-finite amax, where v itself may be non-finite).
HOT_HD int8_t quantize_nearest(float v, const QuantScale& s, int qmax) {
  if (s.inv == 0.0f) return 0;
  const float t = hot_mul(hot_mul(v, s.pre), s.inv);
#if defined(__CUDA_ARCH__)
  return static_cast<int8_t>(clamp_q(rintf(t), qmax));
#else
  return static_cast<int8_t>(clamp_q(std::nearbyint(t), qmax));
#endif
}

// Stochastic rounding: q = clamp(floor(v * inv + u), -qmax, qmax), u in [0, 1) from rng.h.
HOT_HD int8_t quantize_stochastic(float v, const QuantScale& s, int qmax, float u) {
  if (s.inv == 0.0f) return 0;
  return static_cast<int8_t>(clamp_q(floorf(hot_add(hot_mul(hot_mul(v, s.pre), s.inv), u)), qmax));
}

// Block size of the g_x path for a contraction dimension O (SPEC §3): 16, or the largest power of
// two <= 16 that divides O.
HOT_HD int hq_block_size(int64_t O) {
  int b = 16;
  while (b > 1 && (O % b) != 0) b >>= 1;
  return b;
}

// LP_L1 order of the rows of H_16 kept by HLA (SPEC §4).
constexpr int kHlaOrder[16] = {0, 8, 2, 12, 10, 3, 4, 14, 11, 1, 6, 15, 9, 7, 13, 5};

}  // namespace hot
