// Test helpers for the CPU GoogleTest suites: host tensors, fp16/bf16 conversion, and a small
// independent reference of SPEC §3-§5 (explicit Sylvester Hadamard matrices, an fp32 replica of the
// butterfly and quantisation pipeline that must give the same integers as every backend, and float64
// matrix products).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "hot/config.h"
#include "hot/error.h"
#include "hot/ops.h"
#include "hot/quant_rules.h"
#include "hot/rng.h"
#include "hot/tensor.h"

namespace hot_test {

using hot::DType;
using hot::TensorView;

// ---- fp16 / bf16 <-> fp32, round to nearest even --------------------------------------------------

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  const uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to Inf
  if (a < 0x38800000u) {  // below 2^-14: subnormal half (or zero)
    // value = a_float; half subnormal unit = 2^-24. Round a_float / 2^-24 to nearest even.
    const float af = bits_f32(a);
    const float scaled = af * 16777216.0f;  // exact (power of two scaling, result < 1024)
    const float r = std::nearbyint(scaled);  // default rounding mode: ties to even
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(r));
  }
  // normal half: rebias exponent 127 -> 15, keep 10 mantissa bits with RNE.
  uint32_t mant = a & 0x7fffffu;
  uint32_t exp = (a >> 23) - 127 + 15;
  uint32_t h = (exp << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h += 1;  // may carry into exponent: correct
  return static_cast<uint16_t>(sign | h);
}
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant << 13));
  return bits_f32(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

// Round an fp32 value to the precision of `dt` (f32, f16 or bf16) and back.
inline float round_to(DType dt, float f) {
  switch (dt) {
    case DType::f16: return f16_to_f32(f32_to_f16(f));
    case DType::bf16: return bf16_to_f32(f32_to_bf16(f));
    default: return f;
  }
}
// Unit roundoff of a float dtype.
inline double unit_roundoff(DType dt) {
  switch (dt) {
    case DType::f16: return std::ldexp(1.0, -11);
    case DType::bf16: return std::ldexp(1.0, -8);
    default: return std::ldexp(1.0, -24);
  }
}

// ---- host tensors -----------------------------------------------------------------------------------

// A 1-D or 2-D CPU tensor backed by a std::vector, with an optional row stride > cols. Padding
// elements (between cols and the row stride) are filled with a sentinel so that a backend reading or
// writing them is noticed.
class HostTensor {
 public:
  HostTensor() = default;
  static HostTensor make2d(DType dt, int64_t rows, int64_t cols, int64_t ld = -1) {
    HostTensor t;
    t.dtype_ = dt;
    t.rows_ = rows;
    t.cols_ = cols;
    t.ld_ = ld < 0 ? cols : ld;
    t.twod_ = true;
    t.alloc();
    return t;
  }
  static HostTensor make1d(DType dt, int64_t n) {
    HostTensor t;
    t.dtype_ = dt;
    t.rows_ = 1;
    t.cols_ = n;
    t.ld_ = n;
    t.twod_ = false;
    t.alloc();
    return t;
  }

  TensorView view() const {
    TensorView v;
    v.data = const_cast<uint64_t*>(store_.data());
    v.dtype = dtype_;
    v.device = hot::Device::cpu();
    if (twod_) {
      v.shape = {rows_, cols_};
      v.strides = {ld_, 1};
    } else {
      v.shape = {cols_};
      v.strides = {1};
    }
    return v;
  }
  operator TensorView() const { return view(); }

  DType dtype() const { return dtype_; }
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  int64_t ld() const { return ld_; }
  int64_t numel() const { return rows_ * cols_; }

  // Float access (float dtypes, stored value converted exactly to fp32).
  float getf(int64_t r, int64_t c) const {
    const int64_t i = r * ld_ + c;
    switch (dtype_) {
      case DType::f32: return reinterpret_cast<const float*>(bytes())[i];
      case DType::f16: return f16_to_f32(reinterpret_cast<const uint16_t*>(bytes())[i]);
      case DType::bf16: return bf16_to_f32(reinterpret_cast<const uint16_t*>(bytes())[i]);
      case DType::s8: return static_cast<float>(geti(r, c));
      case DType::s32: return static_cast<float>(geti(r, c));
      case DType::s4: return static_cast<float>(geti(r, c));
      case DType::s64: ADD_FAILURE() << "getf on an int64 tensor"; return 0.0f;
    }
    return 0.0f;
  }
  void setf(int64_t r, int64_t c, float v) {
    const int64_t i = r * ld_ + c;
    switch (dtype_) {
      case DType::f32: reinterpret_cast<float*>(bytes())[i] = v; break;
      case DType::f16: reinterpret_cast<uint16_t*>(bytes())[i] = f32_to_f16(v); break;
      case DType::bf16: reinterpret_cast<uint16_t*>(bytes())[i] = f32_to_bf16(v); break;
      default: ADD_FAILURE() << "setf on integer tensor";
    }
  }
  float getf(int64_t i) const { return getf(0, i); }
  void setf(int64_t i, float v) { setf(0, i, v); }

  int64_t geti(int64_t r, int64_t c) const {
    const int64_t i = r * ld_ + c;
    switch (dtype_) {
      case DType::s8: return reinterpret_cast<const int8_t*>(bytes())[i];
      case DType::s32: return reinterpret_cast<const int32_t*>(bytes())[i];
      case DType::s4: {
        const uint8_t byte = bytes()[i >> 1];
        const int nib = (i & 1) ? (byte >> 4) : (byte & 0xf);
        return nib >= 8 ? nib - 16 : nib;
      }
      default: ADD_FAILURE() << "geti on float tensor"; return 0;
    }
  }
  void seti(int64_t r, int64_t c, int64_t v) {
    const int64_t i = r * ld_ + c;
    switch (dtype_) {
      case DType::s8: reinterpret_cast<int8_t*>(bytes())[i] = static_cast<int8_t>(v); break;
      case DType::s32: reinterpret_cast<int32_t*>(bytes())[i] = static_cast<int32_t>(v); break;
      case DType::s4: {
        uint8_t& byte = bytes()[i >> 1];
        const uint8_t nib = static_cast<uint8_t>(v) & 0xf;
        byte = (i & 1) ? static_cast<uint8_t>((byte & 0x0f) | (nib << 4)) : static_cast<uint8_t>((byte & 0xf0) | nib);
        break;
      }
      default: ADD_FAILURE() << "seti on float tensor";
    }
  }
  int64_t geti(int64_t i) const { return geti(0, i); }

  uint8_t* bytes() { return reinterpret_cast<uint8_t*>(store_.data()); }
  const uint8_t* bytes() const { return reinterpret_cast<const uint8_t*>(store_.data()); }
  size_t nbytes() const { return nbytes_; }

  // Logical contents as fp32 (row-major, unpadded).
  std::vector<float> to_f32() const {
    std::vector<float> v(static_cast<size_t>(numel()));
    for (int64_t r = 0; r < rows_; ++r)
      for (int64_t c = 0; c < cols_; ++c) v[r * cols_ + c] = getf(r, c);
    return v;
  }
  std::vector<int64_t> to_int() const {
    std::vector<int64_t> v(static_cast<size_t>(numel()));
    for (int64_t r = 0; r < rows_; ++r)
      for (int64_t c = 0; c < cols_; ++c) v[r * cols_ + c] = geti(r, c);
    return v;
  }
  void from_f32(const std::vector<float>& v) {
    for (int64_t r = 0; r < rows_; ++r)
      for (int64_t c = 0; c < cols_; ++c) setf(r, c, v[r * cols_ + c]);
  }
  void from_int(const std::vector<int64_t>& v) {
    for (int64_t r = 0; r < rows_; ++r)
      for (int64_t c = 0; c < cols_; ++c) seti(r, c, v[r * cols_ + c]);
  }
  // True when every padding element still holds the sentinel written at allocation.
  bool padding_untouched() const {
    const int bits = hot::dtype_bits(dtype_);
    for (int64_t r = 0; r < rows_; ++r)
      for (int64_t c = cols_; c < ld_; ++c) {
        const int64_t i = r * ld_ + c;
        if (bits == 4) {
          const uint8_t byte = bytes()[i >> 1];
          const uint8_t nib = (i & 1) ? (byte >> 4) : (byte & 0xf);
          if (nib != ((i & 1) ? (kSentinel >> 4) : (kSentinel & 0xf))) return false;
        } else {
          const int nb = bits / 8;
          for (int k = 0; k < nb; ++k)
            if (bytes()[i * nb + k] != kSentinel) return false;
        }
      }
    return true;
  }

  static constexpr uint8_t kSentinel = 0x7f;  // f32 0x7f7f7f7f ~ 3.4e38, bf16/f16 NaN, s8 127

 private:
  void alloc() {
    const int bits = hot::dtype_bits(dtype_);
    const int64_t elems = rows_ * ld_;  // the last row has its padding too
    nbytes_ = static_cast<size_t>((std::max<int64_t>(elems, 1) * bits + 7) / 8);
    store_.assign((nbytes_ + 7) / 8 + 1, 0);
    std::memset(store_.data(), 0, store_.size() * 8);
    if (ld_ != cols_) {
      // sentinel everywhere, then zero the logical elements
      std::memset(store_.data(), kSentinel, nbytes_);
      for (int64_t r = 0; r < rows_; ++r) {
        const int64_t b0 = r * ld_ * bits / 8;
        const int64_t b1 = (r * ld_ + cols_) * bits / 8;
        std::memset(bytes() + b0, 0, static_cast<size_t>(b1 - b0));
      }
    }
  }

  DType dtype_ = DType::f32;
  int64_t rows_ = 0, cols_ = 0, ld_ = 0;
  bool twod_ = true;
  size_t nbytes_ = 0;
  std::vector<uint64_t> store_;
};

// ---- random data --------------------------------------------------------------------------------

inline std::vector<float> randn(size_t n, uint64_t seed, float sigma = 1.0f) {
  std::mt19937_64 g(seed);
  std::normal_distribution<double> d(0.0, 1.0);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(d(g) * sigma);
  return v;
}
inline std::vector<int64_t> randint(size_t n, uint64_t seed, int64_t lo, int64_t hi) {
  std::mt19937_64 g(seed);
  std::uniform_int_distribution<int64_t> d(lo, hi);
  std::vector<int64_t> v(n);
  for (auto& x : v) x = d(g);
  return v;
}
// Round every value to the precision of dt (so that the logical input is exactly what is stored).
inline std::vector<float> rounded(std::vector<float> v, DType dt) {
  for (auto& x : v) x = round_to(dt, x);
  return v;
}

inline HostTensor host_from(DType dt, int64_t rows, int64_t cols, const std::vector<float>& v, int64_t ld = -1) {
  HostTensor t = HostTensor::make2d(dt, rows, cols, ld);
  t.from_f32(v);
  return t;
}
inline HostTensor host_from_int(DType dt, int64_t rows, int64_t cols, const std::vector<int64_t>& v,
                                int64_t ld = -1) {
  HostTensor t = HostTensor::make2d(dt, rows, cols, ld);
  t.from_int(v);
  return t;
}

// ---- reference: Hadamard ------------------------------------------------------------------------

// Natural-order Sylvester Hadamard matrix H_n (n a power of two), row-major n x n.
inline std::vector<int> sylvester(int n) {
  std::vector<int> h(1, 1);
  for (int k = 1; k < n; k *= 2) {
    std::vector<int> g(static_cast<size_t>(4 * k * k));
    for (int i = 0; i < k; ++i)
      for (int j = 0; j < k; ++j) {
        const int v = h[i * k + j];
        g[i * 2 * k + j] = v;
        g[i * 2 * k + j + k] = v;
        g[(i + k) * 2 * k + j] = v;
        g[(i + k) * 2 * k + j + k] = -v;
      }
    h.swap(g);
  }
  return h;
}

// In-place fp32 fast Walsh-Hadamard transform of n values spaced `step` apart, in the butterfly
// order fixed for every backend: for h = 1, 2, 4, ...: pairs (j, j + h) in blocks of 2h: (a+b, a-b).
inline void fwht_f32(float* p, int n, int64_t step) {
  for (int h = 1; h < n; h *= 2)
    for (int j0 = 0; j0 < n; j0 += 2 * h)
      for (int j = j0; j < j0 + h; ++j) {
        const float a = p[j * step], b = p[(j + h) * step];
        p[j * step] = a + b;
        p[(j + h) * step] = a - b;
      }
}

// fp32 replica of hadamard_transform on a row-major R x C matrix.
inline std::vector<float> hadamard_f32(std::vector<float> v, int64_t R, int64_t C, int block, int axis) {
  if (axis == 1) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c0 = 0; c0 < C; c0 += block) fwht_f32(&v[r * C + c0], block, 1);
  } else {
    for (int64_t r0 = 0; r0 < R; r0 += block)
      for (int64_t c = 0; c < C; ++c) fwht_f32(&v[r0 * C + c], block, C);
  }
  return v;
}

// float64 explicit product: axis 1: x blockdiag(H); axis 0: blockdiag(H) x.
inline std::vector<double> hadamard_f64(const std::vector<float>& v, int64_t R, int64_t C, int block, int axis) {
  const std::vector<int> H = sylvester(block);
  std::vector<double> out(v.size(), 0.0);
  if (axis == 1) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c0 = 0; c0 < C; c0 += block)
        for (int j = 0; j < block; ++j) {
          double s = 0;
          for (int k = 0; k < block; ++k) s += static_cast<double>(v[r * C + c0 + k]) * H[k * block + j];
          out[r * C + c0 + j] = s;
        }
  } else {
    for (int64_t r0 = 0; r0 < R; r0 += block)
      for (int i = 0; i < block; ++i)
        for (int64_t c = 0; c < C; ++c) {
          double s = 0;
          for (int k = 0; k < block; ++k) s += H[i * block + k] * static_cast<double>(v[(r0 + k) * C + c]);
          out[(r0 + i) * C + c] = s;
        }
  }
  return out;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- transpose cases ---------------------------------------------------------------------------------
// A 3-D view (B, R, S) of a 2-D tensor of at least B * (R + gap) rows of S columns: batch b starts at row
// b * (R + gap), so a gap > 0 gives a batch stride beyond the rows.
inline TensorView view3d(const TensorView& v2, int64_t B, int64_t R, int64_t gap) {
  TensorView v = v2;
  v.shape = {B, R, v2.shape[1]};
  v.strides = {(R + gap) * v2.strides[0], v2.strides[0], 1};
  return v;
}

// Random bytes in every byte of h (a float dtype gets every bit pattern, NaNs included: a transpose copies bits).
inline void fill_random_bytes(HostTensor& h, uint64_t seed) {
  std::mt19937_64 g(seed);
  for (size_t i = 0; i < h.nbytes(); ++i) h.bytes()[i] = static_cast<uint8_t>(g());
}

struct TransposeCase {
  int64_t B, R, S, gap, pad;  // pad: extra elements per row on both sides
};
// Tiles cut at both edges, a single row or column, a batch stride beyond the rows, padded rows (element units on the
// GPU), the same with every size and stride a multiple of 4 (32-bit words of 2 or 4 elements), and a map of
// ResNet-50's layer-1 shape at batch 2 (C = 64, H*W = 3136); entries of at most 8 rows (the few-rows kernel: an image
// batch's 3 channels, 8 rows with padding and a batch gap) and of 9 (the tiled kernel again).
inline std::vector<TransposeCase> transpose_cases() {
  return {{2, 5, 37, 0, 0},  {3, 33, 64, 2, 3},  {1, 1, 7, 0, 0},   {4, 40, 1, 1, 0},
          {3, 36, 100, 1, 4}, {2, 64, 3136, 0, 0}, {3, 3, 1000, 0, 0}, {2, 8, 257, 1, 2}, {2, 9, 40, 0, 1}};
}
inline int64_t round_up16(int64_t k) { return ceil_div(k, 16) * 16; }

// fp32 replica of hla_project: L x C -> ceil(L/16)*rank x C.
inline std::vector<float> hla_f32(const std::vector<float>& x, int64_t L, int64_t C, int rank) {
  const int64_t nb = ceil_div(L, 16);
  std::vector<float> out(static_cast<size_t>(nb * rank * C));
  float buf[16];
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t c = 0; c < C; ++c) {
      for (int k = 0; k < 16; ++k) {
        const int64_t r = b * 16 + k;
        buf[k] = r < L ? x[r * C + c] : 0.0f;
      }
      fwht_f32(buf, 16, 1);
      for (int k = 0; k < rank; ++k) out[(b * rank + k) * C + c] = buf[hot::kHlaOrder[k]];
    }
  return out;
}

// float64 explicit product blockdiag(H^) x with H^ = H_16[order[:rank]].
inline std::vector<double> hla_f64(const std::vector<float>& x, int64_t L, int64_t C, int rank) {
  const std::vector<int> H = sylvester(16);
  const int64_t nb = ceil_div(L, 16);
  std::vector<double> out(static_cast<size_t>(nb * rank * C), 0.0);
  for (int64_t b = 0; b < nb; ++b)
    for (int k = 0; k < rank; ++k)
      for (int64_t c = 0; c < C; ++c) {
        double s = 0;
        for (int t = 0; t < 16; ++t) {
          const int64_t r = b * 16 + t;
          if (r < L) s += H[hot::kHlaOrder[k] * 16 + t] * static_cast<double>(x[r * C + c]);
        }
        out[(b * rank + k) * C + c] = s;
      }
  return out;
}

// ---- reference: quantisers (SPEC §5), fp32 exactly as specified --------------------------------------

struct RefQuant {
  std::vector<int64_t> q;     // R x C
  std::vector<float> scale;   // 1 or R
  std::vector<float> inv;     // 1 or R
};

inline float ref_uniform(uint64_t seed, uint32_t stream, int64_t R, int64_t C, int64_t r, int64_t c) {
  // Written from the rng.h comment, independently of sr_uniform.
  const auto P = [&](uint64_t i, uint32_t t) {
    return hot::philox4x32<7>(static_cast<uint32_t>(i & 0xffffffffu), static_cast<uint32_t>(i >> 32), stream, t,
                              static_cast<uint32_t>(seed & 0xffffffffu), static_cast<uint32_t>(seed >> 32));
  };
  const uint64_t row_call = static_cast<uint64_t>(c / 256) * static_cast<uint64_t>((R + 3) / 4) +
                            static_cast<uint64_t>(r / 4);
  const uint64_t column_call = static_cast<uint64_t>(r / 64) * static_cast<uint64_t>((C + 7) / 8) +
                               static_cast<uint64_t>(c / 8);
  const uint32_t a = P(row_call, 1u).v[r % 4];
  const uint32_t b = P(column_call, 2u).v[(c / 2) % 4];
  const uint32_t w = a + b;
  const uint32_t half = (c % 2) ? (w >> 16) : (w & 0xffffu);
  return static_cast<float>(half) * std::ldexp(1.0f, -16);
}

inline RefQuant ref_quantize(const std::vector<float>& v, int64_t R, int64_t C, int bits, bool per_row,
                             bool stochastic, uint64_t seed = 0, uint32_t stream = 0) {
  const int qmax = (1 << (bits - 1)) - 1;
  RefQuant out;
  out.q.assign(v.size(), 0);
  const int64_t ns = per_row ? R : 1;
  out.scale.assign(static_cast<size_t>(ns), 0.0f);
  out.inv.assign(static_cast<size_t>(ns), 0.0f);
  for (int64_t g = 0; g < ns; ++g) {
    const int64_t r0 = per_row ? g : 0, r1 = per_row ? g + 1 : R;
    float amax = 0.0f;
    bool nonfinite = false;
    for (int64_t i = r0 * C; i < r1 * C; ++i) {
      if (!std::isfinite(v[i])) nonfinite = true;
      amax = std::max(amax, std::fabs(v[i]));
    }
    float inv, s;
    if (nonfinite) {
      inv = 0.0f;
      s = std::numeric_limits<float>::quiet_NaN();
    } else if (amax == 0.0f) {
      inv = 0.0f;
      s = 0.0f;
    } else {
      inv = static_cast<float>(qmax) / amax;
      s = amax / static_cast<float>(qmax);
    }
    out.scale[g] = s;
    out.inv[g] = inv;
    for (int64_t i = r0 * C; i < r1 * C; ++i) {
      if (inv == 0.0f) continue;
      const float t = v[i] * inv;
      float r;
      if (stochastic) {
        const float u = ref_uniform(seed, stream, R, C, i / C, i % C);
        const float tu = t + u;
        r = std::floor(tu);
      } else {
        r = std::nearbyint(t);
      }
      r = std::min(r, static_cast<float>(qmax));
      r = std::max(r, -static_cast<float>(qmax));
      out.q[i] = static_cast<int64_t>(r);
    }
  }
  return out;
}

inline int ref_block_size(int64_t O) {
  int b = 16;
  while (b > 1 && O % b != 0) b /= 2;
  return b;
}

// ---- reference: backward_linear, quantised (§3, §4) with integers from the fp32 replica -----------

struct RefBackward {
  std::vector<double> gx;  // L x I
  std::vector<double> gw;  // O x I
  std::vector<double> gb;  // O
  // the integer operands, for inspection
  RefQuant qg, qw, qgh, qx;
  int block = 0;
};

// gy: L x O, w: O x I, x: L x I, all as fp32 values (already rounded to their storage dtype).
inline RefBackward ref_backward(const std::vector<float>& gy, const std::vector<float>& w, const std::vector<float>& x,
                                int64_t L, int64_t O, int64_t I, const hot::Config& cfg, uint64_t seed) {
  RefBackward r;
  const bool sto = cfg.rounding == hot::Rounding::stochastic;
  const int b = ref_block_size(O);
  r.block = b;
  // g_x path
  {
    const std::vector<float> gt = hadamard_f32(gy, L, O, b, 1);
    const std::vector<float> wt = hadamard_f32(w, O, I, b, 0);
    r.qg = ref_quantize(gt, L, O, cfg.gx_bits, cfg.gx_scale == hot::ScaleMode::token, sto, seed,
                        hot::rng_stream::gx_grad);
    r.qw = ref_quantize(wt, O, I, cfg.gx_bits, false, false);
    r.gx.assign(static_cast<size_t>(L * I), 0.0);
    for (int64_t l = 0; l < L; ++l) {
      const double sg = r.qg.scale.size() == 1 ? r.qg.scale[0] : r.qg.scale[l];
      for (int64_t i = 0; i < I; ++i) {
        int64_t acc = 0;
        for (int64_t o = 0; o < O; ++o) acc += r.qg.q[l * O + o] * r.qw.q[o * I + i];
        r.gx[l * I + i] = static_cast<double>(acc) * sg * static_cast<double>(r.qw.scale[0]) / b;
      }
    }
  }
  // g_w path
  if (!x.empty()) {
    const int64_t K = ceil_div(L, 16) * cfg.rank;
    const std::vector<float> xh = hla_f32(x, L, I, cfg.rank);
    const std::vector<float> gh = hla_f32(gy, L, O, cfg.rank);
    r.qx = ref_quantize(xh, K, I, 8, false, false);
    r.qgh = ref_quantize(gh, K, O, 8, false, sto, seed, hot::rng_stream::gw_grad);
    r.gw.assign(static_cast<size_t>(O * I), 0.0);
    for (int64_t o = 0; o < O; ++o)
      for (int64_t i = 0; i < I; ++i) {
        int64_t acc = 0;
        for (int64_t k = 0; k < K; ++k) acc += r.qgh.q[k * O + o] * r.qx.q[k * I + i];
        r.gw[o * I + i] = static_cast<double>(acc) * r.qgh.scale[0] * static_cast<double>(r.qx.scale[0]) / 16.0;
      }
  }
  r.gb.assign(static_cast<size_t>(O), 0.0);
  for (int64_t l = 0; l < L; ++l)
    for (int64_t o = 0; o < O; ++o) r.gb[o] += gy[l * O + o];
  return r;
}

// ---- float64 matrix helpers -------------------------------------------------------------------------

// C (M x N) = op(A) op(B), A/B row-major with given logical dims.
inline std::vector<double> matmul64(const std::vector<double>& A, int64_t M, int64_t K, bool transA,
                                    const std::vector<double>& B, int64_t N, bool transB) {
  std::vector<double> C(static_cast<size_t>(M * N), 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double a = transA ? A[k * M + m] : A[m * K + k];
        const double b = transB ? B[n * K + k] : B[k * N + n];
        s += a * b;
      }
      C[m * N + n] = s;
    }
  return C;
}
inline std::vector<double> to64(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }
inline std::vector<double> abs64(std::vector<double> v) {
  for (auto& x : v) x = std::fabs(x);
  return v;
}
inline double frob(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}
inline double rel_frob_err(const std::vector<float>& got, const std::vector<double>& ref) {
  double e = 0, n = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    e += (got[i] - ref[i]) * (got[i] - ref[i]);
    n += ref[i] * ref[i];
  }
  return std::sqrt(e / n);
}
inline double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

// Asserts |got - ref| <= rel * |ref| + abs elementwise; reports the first few failures.
inline ::testing::AssertionResult all_close(const std::vector<float>& got, const std::vector<double>& ref, double rel,
                                            double abs_tol) {
  if (got.size() != ref.size())
    return ::testing::AssertionFailure() << "size " << got.size() << " vs " << ref.size();
  int bad = 0;
  std::string msg;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double tol = rel * std::fabs(ref[i]) + abs_tol;
    if (!(std::fabs(got[i] - ref[i]) <= tol)) {
      if (bad < 5)
        msg += "\n  [" + std::to_string(i) + "] got " + std::to_string(got[i]) + " ref " + std::to_string(ref[i]) +
               " tol " + std::to_string(tol);
      ++bad;
    }
  }
  if (bad) return ::testing::AssertionFailure() << bad << " of " << ref.size() << " elements off:" << msg;
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult bits_equal(const HostTensor& a, const HostTensor& b) {
  if (a.rows() != b.rows() || a.cols() != b.cols() || a.dtype() != b.dtype())
    return ::testing::AssertionFailure() << "shape/dtype differ";
  const int bytes = hot::dtype_bits(a.dtype()) / 8;
  for (int64_t r = 0; r < a.rows(); ++r)
    if (std::memcmp(a.bytes() + r * a.ld() * bytes, b.bytes() + r * b.ld() * bytes,
                    static_cast<size_t>(a.cols() * bytes)) != 0)
      return ::testing::AssertionFailure() << "bits differ in row " << r;
  return ::testing::AssertionSuccess();
}

// Inputs of the ReLU mask tests: n elements of dt, normal values with the specials mixed in at fixed positions (+0,
// -0, +-Inf, NaN of either sign, the smallest subnormals of either sign).
inline HostTensor relu_input(DType dt, int64_t n, uint64_t seed) {
  HostTensor t = HostTensor::make1d(dt, n);
  const std::vector<float> v = randn(static_cast<size_t>(n), seed);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const float tiny = dt == DType::f32 ? std::numeric_limits<float>::denorm_min()
                     : dt == DType::f16 ? 5.960464477539063e-08f  // 2^-24, f16's smallest subnormal
                                        : bits_f32(0x00010000u);  // bf16's smallest subnormal
  const float specials[] = {0.0f, -0.0f, inf, -inf, nan, -nan, tiny, -tiny};
  for (int64_t i = 0; i < n; ++i) t.setf(i, i % 5 == 3 ? specials[(i / 5) % 8] : v[static_cast<size_t>(i)]);
  return t;
}
// The ReLU mask's sizes: one element, partial bytes and words, exactly one warp's chunk (256), around it, and more.
inline std::vector<int64_t> relu_sizes() { return {1, 7, 8, 9, 31, 33, 255, 256, 257, 1000, 4099, 70001}; }

// Restores the CPU thread count at scope exit.
struct ThreadGuard {
  int saved = hot::get_num_threads();
  ~ThreadGuard() { hot::set_num_threads(saved); }
};

// Runs f, expecting a hot::Error of `kind` whose message contains every string in `needles`.
inline ::testing::AssertionResult throws_hot(const std::function<void()>& f, hot::ErrorKind kind,
                                             std::vector<std::string> needles) {
  try {
    f();
  } catch (const hot::Error& e) {
    if (e.kind() != kind)
      return ::testing::AssertionFailure() << "wrong ErrorKind " << static_cast<int>(e.kind()) << " (expected "
                                           << static_cast<int>(kind) << "), message: " << e.what();
    const std::string m = e.what();
    for (const auto& n : needles)
      if (m.find(n) == std::string::npos)
        return ::testing::AssertionFailure() << "message does not contain \"" << n << "\": " << m;
    return ::testing::AssertionSuccess() << m;
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-hot exception: " << e.what();
  } catch (...) {
    return ::testing::AssertionFailure() << "threw an unknown exception";
  }
  return ::testing::AssertionFailure() << "did not throw";
}

// A HOT configuration of the given g_x bits, rank, rounding and g_x scale mode (the others at their defaults).
inline hot::Config make_cfg(int bits, int rank, hot::Rounding rd, hot::ScaleMode sm) {
  hot::Config c;
  c.gx_bits = bits;
  c.rank = rank;
  c.rounding = rd;
  c.gx_scale = sm;
  return c;
}

// ||got - A B|| / ||A B|| (Frobenius) for got (M x N), A (M x K) and B (K x N) row-major float vectors, the product
// in float64: how far a quantised product is from the exact one.
inline double rel_err_of_product(const HostTensor& got, const std::vector<float>& a, const std::vector<float>& b,
                                 int64_t M, int64_t K, int64_t N) {
  double e = 0, n = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += static_cast<double>(a[m * K + k]) * b[k * N + j];
      e += (got.getf(m, j) - s) * (got.getf(m, j) - s);
      n += s * s;
    }
  return std::sqrt(e / n);
}

// out[m][n] == float(float(sum_k a[m][k] b[n][k]) * ((sa * sb) * factor)) bit for bit, the sum of the s8 codes in
// int64: the dequantising GEMM's rule (backend.h) for any K.
inline void expect_int64_dequant(const TensorView& a, const TensorView& b, float sa, float sb, float factor,
                                 const HostTensor& out) {
  const int64_t M = a.shape[0], N = b.shape[0], K = a.shape[1];
  const auto* pa = static_cast<const int8_t*>(a.data);
  const auto* pb = static_cast<const int8_t*>(b.data);
  const float alpha = (sa * sb) * factor;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      int64_t s = 0;
      for (int64_t k = 0; k < K; ++k) s += int64_t{pa[m * a.strides[0] + k]} * pb[n * b.strides[0] + k];
      ASSERT_EQ(f32_bits(out.getf(m, n)), f32_bits(static_cast<float>(s) * alpha)) << m << ", " << n << ": " << s;
    }
}

}  // namespace hot_test
