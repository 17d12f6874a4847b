// CPU backend: transforms, HLA, quantisers, INT4 packing, ABC and the fused g_y pass.
// This is the reference implementation: the CUDA backend reproduces its integer results bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

#include "backend.h"
#include "bn_rules.h"
#include "conv_rules.h"
#include "cpu/convert.h"
#include "cpu/fwht.h"
#include "cpu/parallel.h"
#include "hot/error.h"
#include "hot/quant_rules.h"

namespace hot::cpu {

namespace {

// Rows per parallel chunk so that a chunk touches roughly `target` elements.
int64_t row_grain(int64_t cols, int64_t target = 1 << 15) { return std::max<int64_t>(1, target / std::max<int64_t>(cols, 1)); }

// Dense fp32 scratch matrix.
struct Mat {
  int64_t rows = 0, cols = 0;
  std::vector<float> v;
  Mat(int64_t r, int64_t c) : rows(r), cols(c), v(static_cast<size_t>(r * c)) {}
  float* row(int64_t r) { return v.data() + r * cols; }
};

// max over amax_key(|v|) of a dense matrix (NaN > Inf > finite), order-independent.
float amax_of(const float* data, int64_t n) {
  std::mutex m;
  uint32_t key = 0;
  parallel_for(n, 1 << 16, [&](int64_t b, int64_t e) {
    uint32_t k = 0;
    for (int64_t i = b; i < e; ++i) k = std::max(k, amax_key(data[i]));
    std::lock_guard<std::mutex> lock(m);
    key = std::max(key, k);
  });
  return amax_from_key(key);
}

float amax_row(const float* data, int64_t n) {
  uint32_t k = 0;
  for (int64_t i = 0; i < n; ++i) k = std::max(k, amax_key(data[i]));
  return amax_from_key(k);
}

// Quantise row r (of R) of an operand of n columns with the given scale into dst (stride dst_stride); stochastic
// rounding draws each column's uniform from its row and column words (rng.h).
void quantize_row(const float* v, int64_t n, QuantScale s, int qmax, Rounding rounding, uint64_t seed,
                  uint32_t stream, int64_t R, int64_t r, int8_t* dst, int64_t dst_stride) {
  if (rounding == Rounding::nearest) {
    for (int64_t c = 0; c < n; ++c) dst[c * dst_stride] = quantize_nearest(v[c], s, qmax);
    return;
  }
  SrWalk walk{seed, stream, R, n};
  for (int64_t c = 0; c < n; ++c) dst[c * dst_stride] = quantize_stochastic(v[c], s, qmax, walk.uniform(r, c));
}

// Dense (L rounded up to 16) HLA projection of a float view into out (hla_rows x cols), fp32.
void hla_dense(const TensorView& in, int rank, Mat& out) {
  const int64_t L = in.shape[0], C = in.shape[1];
  const int64_t blocks = (L + 15) / 16;
  parallel_for(blocks, std::max<int64_t>(1, row_grain(C * 16)), [&](int64_t b0, int64_t b1) {
    std::vector<float> buf(static_cast<size_t>(16 * C));
    for (int64_t blk = b0; blk < b1; ++blk) {
      for (int j = 0; j < 16; ++j) {
        const int64_t r = blk * 16 + j;
        if (r < L) {
          load_row(in, r, buf.data() + j * C);
        } else {
          std::fill(buf.begin() + j * C, buf.begin() + (j + 1) * C, 0.0f);
        }
      }
      fwht_rows(buf.data(), 16, C, C);
      for (int k = 0; k < rank; ++k)
        std::memcpy(out.row(blk * rank + k), buf.data() + kHlaOrder[k] * C, C * sizeof(float));
    }
  });
}

// f(k, px) for the kernel offsets k = i * kw + j of im2col row r (conv_rules.h's row order): px is the channels-last map
// row (n * H + h) * W + w the offset reads, or -1 where it falls in the padding.
template <class F>
void for_each_window_pixel(const Col2imParams& p, int64_t r, F&& f) {
  int64_t n, ho, wo;
  im2col_pixel(p, r, n, ho, wo);
  for (int i = 0; i < p.kh; ++i)
    for (int j = 0; j < p.kw; ++j) {
      const int64_t h = ho * p.sh - p.ph + static_cast<int64_t>(i) * p.dh;
      const int64_t w = wo * p.sw - p.pw + static_cast<int64_t>(j) * p.dw;
      f(i * p.kw + j, h < 0 || h >= p.H || w < 0 || w >= p.W ? -1 : (n * p.H + h) * p.W + w);
    }
}

// Quantise a dense fp32 matrix per tensor and write it transposed into q_t (cols x K_pad, zero past rows).
// known_amax: m's amax when the caller knows it (activation_codes' amax), else null.
void quantize_transposed(Mat& m, int qmax, Rounding rounding, uint64_t seed, uint32_t stream, const TensorView& q_t,
                         float* scale_out, const float* known_amax = nullptr) {
  const float amax = known_amax != nullptr ? *known_amax : amax_of(m.v.data(), static_cast<int64_t>(m.v.size()));
  const QuantScale s = quant_scale_from_amax(amax, qmax);
  *scale_out = s.scale;
  const int64_t K = m.rows, C = m.cols, K_pad = q_t.shape[1], ld = q_t.strides[0];
  int8_t* q = q_t.ptr<int8_t>();
  // Quantise row k of m (a K x C operand) into column k of q_t.
  parallel_for(K, row_grain(C), [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) quantize_row(m.row(k), C, s, qmax, rounding, seed, stream, K, k, q + k, ld);
  });
  parallel_for(C, row_grain(K_pad - K + 1), [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) std::memset(q + c * ld + K, 0, static_cast<size_t>(K_pad - K));
  });
}

}  // namespace

void hadamard_transform(const TensorView& in, const TensorView& out, int block, int axis, Stream) {
  const int64_t R = in.shape[0], C = in.shape[1];
  if (axis == 1) {
    parallel_for(R, row_grain(C), [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(static_cast<size_t>(C));
      for (int64_t r = r0; r < r1; ++r) {
        load_row(in, r, buf.data());
        fwht_blocks(buf.data(), C, block);
        store_row(out, r, buf.data());
      }
    });
  } else {
    parallel_for(R / block, row_grain(C * block), [&](int64_t g0, int64_t g1) {
      std::vector<float> buf(static_cast<size_t>(block * C));
      for (int64_t g = g0; g < g1; ++g) {
        for (int j = 0; j < block; ++j) load_row(in, g * block + j, buf.data() + j * C);
        fwht_rows(buf.data(), block, C, C);
        for (int j = 0; j < block; ++j) store_row(out, g * block + j, buf.data() + j * C);
      }
    });
  }
}

void hla_project(const TensorView& in, const TensorView& out, int rank, Stream) {
  Mat m(out.shape[0], out.shape[1]);
  hla_dense(in, rank, m);
  for (int64_t r = 0; r < m.rows; ++r) store_row(out, r, m.row(r));
}

void quantize(const TensorView& in, const TensorView& q, const TensorView& scale, const QuantizeParams& p,
              const TensorView* amax, Stream) {
  const int64_t R = in.shape[0], C = in.shape[1];
  const int qmax = qmax_for_bits(p.bits);
  Mat m(R, C);
  parallel_for(R, row_grain(C), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) load_row(in, r, m.row(r));
  });
  float* sc = scale.ptr<float>();
  QuantScale tensor_scale{0.0f, 0.0f, 1.0f};
  if (p.scale == ScaleMode::tensor) {
    tensor_scale = quant_scale_from_amax(amax != nullptr ? amax->ptr<float>()[0] : amax_of(m.v.data(), R * C), qmax);
    sc[0] = tensor_scale.scale;
  }
  int8_t* qd = q.ptr<int8_t>();
  parallel_for(R, row_grain(C), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      QuantScale s = tensor_scale;
      if (p.scale == ScaleMode::token) {
        s = quant_scale_from_amax(amax_row(m.row(r), C), qmax);
        sc[r] = s.scale;
      }
      quantize_row(m.row(r), C, s, qmax, p.rounding, p.seed, p.rng_stream, R, r, qd + r * q.strides[0], 1);
    }
  });
}

void dequantize(const TensorView& q, const TensorView& scale, const TensorView& out, Stream) {
  const int64_t R = q.shape[0], C = q.shape[1];
  const bool per_row = scale.shape[0] == R && !(R > 1 && scale.shape[0] == 1);
  const float* sc = scale.ptr<float>();
  parallel_for(R, row_grain(C), [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(static_cast<size_t>(C));
    for (int64_t r = r0; r < r1; ++r) {
      const int8_t* qr = q.ptr<int8_t>() + r * q.strides[0];
      const float s = sc[per_row ? r : 0];
      for (int64_t c = 0; c < C; ++c) buf[c] = static_cast<float>(qr[c]) * s;
      store_row(out, r, buf.data());
    }
  });
}

void col2im(const TensorView& cols, const ConvGeometry& g, const TensorView& out, Stream) {
  const Col2imParams p = col2im_params(g);
  const int64_t ld = cols.strides[0];
  const auto get = [&](int64_t r, int64_t c) { return load_float(cols.data, cols.dtype, r * ld + c); };
  parallel_for(g.N * g.H * g.W, row_grain(g.C), [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(static_cast<size_t>(g.C));
    for (int64_t r = r0; r < r1; ++r) {  // pixel (n, h, w) of the channels-last map
      const int64_t n = r / (g.H * g.W), hw = r % (g.H * g.W);
      const int h = static_cast<int>(hw / g.W), w = static_cast<int>(hw % g.W);
      for (int64_t c = 0; c < g.C; ++c) buf[static_cast<size_t>(c)] = col2im_pixel(p, n, c, h, w, get);
      store_row(out, r, buf.data());
    }
  });
}

void conv_grad_input(const TensorView& q_g, const TensorView& q_wt, const TensorView& s_g, const TensorView& s_w,
                     float factor, const ConvGeometry& g, const TensorView& out, Stream) {
  const int64_t Ho = g.out_h(), Wo = g.out_w(), o_pad = q_g.shape[1], C = g.C;
  const float alpha = s_g.ptr<float>()[0] * s_w.ptr<float>()[0] * factor;
  const auto* qg = static_cast<const int8_t*>(q_g.data);
  const auto* qw = static_cast<const int8_t*>(q_wt.data);
  const int64_t ldg = q_g.strides[0], ldw = q_wt.strides[0];
  parallel_for(g.N * g.H * g.W, row_grain(C * g.kh * g.kw * o_pad / 16), [&](int64_t r0, int64_t r1) {
    std::vector<int32_t> acc(static_cast<size_t>(C));
    std::vector<float> row(static_cast<size_t>(C));
    for (int64_t r = r0; r < r1; ++r) {  // input pixel (n, h, w)
      const int64_t n = r / (g.H * g.W), hw = r % (g.H * g.W), h = hw / g.W, w = hw % g.W;
      std::fill(acc.begin(), acc.end(), 0);
      for (int i = 0; i < g.kh; ++i) {
        const int64_t ho = h + g.ph - static_cast<int64_t>(i) * g.dh;  // stride 1: the output row that read h
        if (ho < 0 || ho >= Ho) continue;
        for (int j = 0; j < g.kw; ++j) {
          const int64_t wo = w + g.pw - static_cast<int64_t>(j) * g.dw;
          if (wo < 0 || wo >= Wo) continue;
          const int8_t* gr = qg + ((n * Ho + ho) * Wo + wo) * ldg;
          const int8_t* wr = qw + (static_cast<int64_t>(i) * g.kw + j) * C * ldw;
          for (int64_t c = 0; c < C; ++c) {
            const int8_t* wc = wr + c * ldw;
            int32_t d = 0;
            for (int64_t o = 0; o < o_pad; ++o) d += static_cast<int32_t>(gr[o]) * static_cast<int32_t>(wc[o]);
            acc[static_cast<size_t>(c)] += d;
          }
        }
      }
      for (size_t c = 0; c < acc.size(); ++c) row[c] = static_cast<float>(acc[c]) * alpha;
      store_row(out, r, row.data());
    }
  });
}

void im2col(const TensorView& map, const ConvGeometry& g, const TensorView& cols, Stream) {
  const Col2imParams p = col2im_params(g);
  const size_t es = static_cast<size_t>(dtype_bits(map.dtype) / 8), run = static_cast<size_t>(g.C) * es;
  const auto* src = static_cast<const unsigned char*>(map.data);
  auto* dst = static_cast<unsigned char*>(cols.data);
  parallel_for(cols.shape[0], row_grain(cols.shape[1]), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      unsigned char* out = dst + r * cols.strides[0] * es;
      for_each_window_pixel(p, r, [&](int k, int64_t px) {
        if (px < 0)
          std::memset(out + k * run, 0, run);
        else
          std::memcpy(out + k * run, src + px * map.strides[0] * es, run);
      });
    }
  });
}

// Rows of the columns in runs of 64 per task (each task writes its own 64-byte run of every cols_t row); the tail
// columns L..K zero.
void im2col_t(const TensorView& map, const ConvGeometry& g, const TensorView& cols_t, Stream) {
  const Col2imParams p = col2im_params(g);
  const int64_t L = g.N * p.Ho * p.Wo, C = g.C, CKK = static_cast<int64_t>(g.kh) * g.kw * C;
  const int64_t K = cols_t.shape[1], ld = cols_t.strides[0], ldm = map.strides[0];
  const int8_t* src = map.ptr<int8_t>();
  int8_t* dst = cols_t.ptr<int8_t>();
  parallel_for((L + 63) / 64, std::max<int64_t>(1, row_grain(CKK * 64)), [&](int64_t t0, int64_t t1) {
    for (int64_t r = t0 * 64; r < std::min(L, t1 * 64); ++r)
      for_each_window_pixel(p, r, [&](int k, int64_t px) {
        int8_t* out = dst + static_cast<int64_t>(k) * C * ld + r;
        for (int64_t c = 0; c < C; ++c) out[c * ld] = px < 0 ? int8_t{0} : src[px * ldm + c];
      });
  });
  for (int64_t col = 0; col < CKK; ++col) std::fill(dst + col * ld + L, dst + col * ld + K, int8_t{0});
}

// In 32 x 32 tiles (both sides' rows touched 32 elements at a time), one (batch, tile row) per task.
void transpose(const TensorView& in, const TensorView& out, Stream) {
  const int64_t B = in.shape[0], R = in.shape[1], S = in.shape[2], tr = (R + 31) / 32;
  const size_t es = static_cast<size_t>(dtype_bits(in.dtype) / 8);
  const auto* src = static_cast<const unsigned char*>(in.data);
  auto* dst = static_cast<unsigned char*>(out.data);
  parallel_for(B * tr, std::max<int64_t>(1, (1 << 14) / (32 * std::max<int64_t>(S, 1))), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / tr, r0 = (t % tr) * 32, r1 = std::min(R, r0 + 32);
      for (int64_t s0 = 0; s0 < S; s0 += 32)
        for (int64_t s = s0; s < std::min(S, s0 + 32); ++s)
          for (int64_t r = r0; r < r1; ++r)
            std::memcpy(dst + (b * out.strides[0] + s * out.strides[1] + r) * es,
                        src + (b * in.strides[0] + r * in.strides[1] + s) * es, es);
    }
  });
}

// One byte of relu_mask per index k of [0, ceil(n / 8)): elements 8k..8k+7. A zeroed element is written as +0 (all
// bits zero in every float dtype); the others are copied bit for bit.
// amax (if given): max over amax_key of y's elements (the zeroed ones are +0).
void relu_mask(const TensorView& x, const TensorView& y, const TensorView& bits, const TensorView* amax, Stream) {
  const int64_t n = x.shape[0];
  const size_t es = static_cast<size_t>(dtype_bits(x.dtype) / 8);
  const auto* src = static_cast<const unsigned char*>(x.data);
  auto* dst = static_cast<unsigned char*>(y.data);
  auto* out = static_cast<uint8_t*>(bits.data);
  std::mutex mu;
  uint32_t key = 0;
  parallel_for((n + 7) / 8, 1 << 13, [&](int64_t k0, int64_t k1) {
    uint32_t part = 0;
    for (int64_t k = k0; k < k1; ++k) {
      uint8_t b = 0;
      for (int64_t i = 8 * k; i < std::min(n, 8 * k + 8); ++i) {
        const float v = load_float(x.data, x.dtype, i);
        b |= static_cast<uint8_t>(v <= 0.0f) << (i - 8 * k);
        if (v < 0.0f)
          std::memset(dst + i * es, 0, es);
        else if (dst != src)
          std::memcpy(dst + i * es, src + i * es, es);
        if (!(v < 0.0f)) part = std::max(part, amax_key(v));  // y = x there (-0 and NaN included), else +0
      }
      out[k] = b;
    }
    std::lock_guard<std::mutex> lock(mu);
    key = std::max(key, part);
  });
  if (amax != nullptr) amax->ptr<float>()[0] = amax_from_key(key);
}

// BatchNorm's statistics (ops.h): the sums of d = x - K and d * d in batch_norm_backward_reduce's order, then
// bn_store_stats per channel.
void batch_norm_stats(const TensorView& x, const TensorView& mean, const TensorView& invstd, float eps,
                      const TensorView* running_mean, const TensorView* running_var, float momentum, Stream) {
  const int64_t R = x.shape[0], C = x.shape[1], groups = (R + kBnReduceRows - 1) / kBnReduceRows;
  std::vector<float> K(static_cast<size_t>(C));
  load_row(x, 0, K.data());
  std::vector<float> part(static_cast<size_t>(groups * 2 * C));  // [group][a, b][C]
  parallel_for(groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> v(static_cast<size_t>(C)), lane(static_cast<size_t>(kBnReduceLanes * 2 * C));
    for (int64_t g = g0; g < g1; ++g) {
      std::fill(lane.begin(), lane.end(), 0.0f);
      for (int64_t r = g * kBnReduceRows; r < std::min(R, (g + 1) * kBnReduceRows); ++r) {
        float* s = lane.data() + (r % kBnReduceLanes) * 2 * C;
        load_row(x, r, v.data());
        for (int64_t c = 0; c < C; ++c) {
          const float d = hot_add(v[c], -K[c]);
          s[c] = hot_add(s[c], d);
          s[C + c] = hot_add(s[C + c], hot_mul(d, d));
        }
      }
      for (int64_t step = kBnReduceLanes / 2; step >= 1; step /= 2)
        for (int64_t k = 0; k < step; ++k) {
          float *to = lane.data() + k * 2 * C, *from = lane.data() + (k + step) * 2 * C;
          for (int64_t i = 0; i < 2 * C; ++i) to[i] = hot_add(to[i], from[i]);
        }
      std::copy(lane.begin(), lane.begin() + 2 * C, part.begin() + g * 2 * C);
    }
  });
  const float om = hot_add(1.0f, -momentum);
  float *rm = running_mean != nullptr ? running_mean->ptr<float>() : nullptr,
        *rv = running_var != nullptr ? running_var->ptr<float>() : nullptr;
  for (int64_t c = 0; c < C; ++c) {
    float a = 0.0f, b = 0.0f;
    for (int64_t g = 0; g < groups; ++g) a = hot_add(a, part[g * 2 * C + c]), b = hot_add(b, part[g * 2 * C + C + c]);
    bn_store_stats(a, b, K[c], R, eps, momentum, om, mean.ptr<float>() + c, invstd.ptr<float>() + c,
                   rm != nullptr ? rm + c : nullptr, rv != nullptr ? rv + c : nullptr);
  }
}

// y = bn_transform per element (ops.h).
void batch_norm_transform(const TensorView& x, const TensorView& mean, const TensorView& invstd,
                          const TensorView* weight, const TensorView* bias, const TensorView& y, Stream) {
  const int64_t R = x.shape[0], C = x.shape[1];
  std::vector<float> mu(static_cast<size_t>(C)), sc(mu.size()), bs(mu.size());
  for (int64_t c = 0; c < C; ++c) {
    const float is = invstd.ptr<float>()[c];
    mu[c] = mean.ptr<float>()[c];
    sc[c] = weight != nullptr ? hot_mul(weight->ptr<float>()[c], is) : is;
    bs[c] = bias != nullptr ? bias->ptr<float>()[c] : 0.0f;
  }
  parallel_for(R, row_grain(C), [&](int64_t r0, int64_t r1) {
    std::vector<float> v(static_cast<size_t>(C));
    for (int64_t r = r0; r < r1; ++r) {
      load_row(x, r, v.data());
      for (int64_t c = 0; c < C; ++c) v[c] = bn_transform(v[c], mu[c], sc[c], bs[c]);
      store_row(y, r, v.data());
    }
  });
}

// BatchNorm's per-channel sums in ops.h's order: per group of kBnReduceRows rows, kBnReduceLanes lanes of interleaved
// rows, then their pairwise sum; the groups' sums in group order. With relu_bits, g_y masked as relu_mask_backward
// masks it (its bytes into g_relu).
void batch_norm_backward_reduce(const TensorView& gy, const TensorView& x, const TensorView& mean,
                                const TensorView& invstd, const TensorView& sum_dy, const TensorView& sum_dy_xmu,
                                const TensorView* grad_weight, const TensorView* relu_bits, const TensorView* g_relu,
                                Stream) {
  const int64_t R = gy.shape[0], C = gy.shape[1], groups = (R + kBnReduceRows - 1) / kBnReduceRows;
  const float* mu = mean.ptr<float>();
  const auto* bits = relu_bits != nullptr ? static_cast<const uint8_t*>(relu_bits->data) : nullptr;
  const size_t es = static_cast<size_t>(dtype_bits(gy.dtype) / 8);
  std::vector<float> part(static_cast<size_t>(groups * 2 * C));  // [group][sum_dy, sum_dy_xmu][C]
  parallel_for(groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> d(static_cast<size_t>(C)), v(d.size()), lane(static_cast<size_t>(kBnReduceLanes * 2 * C));
    for (int64_t g = g0; g < g1; ++g) {
      std::fill(lane.begin(), lane.end(), 0.0f);
      for (int64_t r = g * kBnReduceRows; r < std::min(R, (g + 1) * kBnReduceRows); ++r) {
        float* s = lane.data() + (r % kBnReduceLanes) * 2 * C;
        load_row(gy, r, d.data());
        load_row(x, r, v.data());
        if (bits != nullptr) {
          const auto* src = static_cast<const unsigned char*>(gy.data) + r * gy.strides[0] * es;
          auto* dst = g_relu != nullptr ? static_cast<unsigned char*>(g_relu->data) + r * g_relu->strides[0] * es
                                        : nullptr;
          for (int64_t c = 0; c < C; ++c) {
            const bool zero = (bits[(r * C + c) >> 3] >> ((r * C + c) & 7)) & 1u;
            if (zero) d[c] = 0.0f;
            if (dst == nullptr) continue;
            if (zero)
              std::memset(dst + c * es, 0, es);
            else if (dst != src)
              std::memcpy(dst + c * es, src + c * es, es);
          }
        }
        for (int64_t c = 0; c < C; ++c) {
          s[c] = hot_add(s[c], d[c]);
          s[C + c] = hot_add(s[C + c], hot_mul(d[c], hot_add(v[c], -mu[c])));
        }
      }
      for (int64_t step = kBnReduceLanes / 2; step >= 1; step /= 2)
        for (int64_t k = 0; k < step; ++k) {
          float *to = lane.data() + k * 2 * C, *from = lane.data() + (k + step) * 2 * C;
          for (int64_t i = 0; i < 2 * C; ++i) to[i] = hot_add(to[i], from[i]);
        }
      std::copy(lane.begin(), lane.begin() + 2 * C, part.begin() + g * 2 * C);
    }
  });
  float *sd = sum_dy.ptr<float>(), *sx = sum_dy_xmu.ptr<float>();
  for (int64_t c = 0; c < C; ++c) {
    float a = 0.0f, b = 0.0f;
    for (int64_t g = 0; g < groups; ++g) a = hot_add(a, part[g * 2 * C + c]), b = hot_add(b, part[g * 2 * C + C + c]);
    sd[c] = a;
    sx[c] = b;
    if (grad_weight != nullptr) grad_weight->ptr<float>()[c] = hot_mul(b, invstd.ptr<float>()[c]);
  }
}

// Per channel c of a BatchNorm's backward (ops.h): m_dy, f1 and f2 in fp32, in the order ops.h gives.
void batch_norm_backward_input(const TensorView& gy, const TensorView& x, const TensorView& mean,
                               const TensorView& invstd, const TensorView* weight, const TensorView& sum_dy,
                               const TensorView& sum_dy_xmu, const TensorView& gx, const TensorView& amax, Stream) {
  const int64_t R = gy.shape[0], C = gy.shape[1];
  const float nf = hot_div(1.0f, static_cast<float>(R));
  std::vector<float> gm(static_cast<size_t>(C)), pj(gm.size()), sc(gm.size());
  const float *mu = mean.ptr<float>(), *is = invstd.ptr<float>(), *sd = sum_dy.ptr<float>(),
              *sx = sum_dy_xmu.ptr<float>(), *w = weight != nullptr ? weight->ptr<float>() : nullptr;
  for (int64_t c = 0; c < C; ++c) {
    gm[c] = hot_mul(sd[c], nf);
    pj[c] = hot_mul(hot_mul(hot_mul(is[c], is[c]), sx[c]), nf);
    sc[c] = w != nullptr ? hot_mul(w[c], is[c]) : is[c];
  }
  const int block = hq_block_size(C);
  std::mutex mu_key;
  uint32_t key = 0;
  parallel_for(R, row_grain(C), [&](int64_t r0, int64_t r1) {
    std::vector<float> d(static_cast<size_t>(C)), v(d.size());
    uint32_t part = 0;
    for (int64_t r = r0; r < r1; ++r) {
      load_row(gy, r, d.data());
      load_row(x, r, v.data());
      for (int64_t c = 0; c < C; ++c)
        d[c] = hot_mul(std::fma(-hot_add(v[c], -mu[c]), pj[c], hot_add(d[c], -gm[c])), sc[c]);
      store_row(gx, r, d.data());
      load_row(gx, r, d.data());  // the rounded values
      fwht_blocks(d.data(), C, block);
      for (int64_t c = 0; c < C; ++c) part = std::max(part, amax_key(d[c]));
    }
    std::lock_guard<std::mutex> lock(mu_key);
    key = std::max(key, part);
  });
  amax.ptr<float>()[0] = amax_from_key(key);
}

void relu_mask_backward(const TensorView& gy, const TensorView& bits, const TensorView& gx, Stream) {
  const int64_t n = gy.shape[0];
  const size_t es = static_cast<size_t>(dtype_bits(gy.dtype) / 8);
  const auto* src = static_cast<const unsigned char*>(gy.data);
  auto* dst = static_cast<unsigned char*>(gx.data);
  const auto* in = static_cast<const uint8_t*>(bits.data);
  parallel_for(n, 1 << 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if ((in[i >> 3] >> (i & 7)) & 1u)
        std::memset(dst + i * es, 0, es);
      else if (dst != src)
        std::memcpy(dst + i * es, src + i * es, es);
    }
  });
}

namespace {
// Offset of element (n, c, h, w) of a 4-D view.
inline int64_t at4(const TensorView& t, int64_t n, int64_t c, int64_t h, int64_t w) {
  return n * t.strides[0] + c * t.strides[1] + h * t.strides[2] + w * t.strides[3];
}
}  // namespace

void max_pool2d_offsets(const TensorView& x, const ConvGeometry& g, const TensorView& y, const TensorView& off,
                        Stream) {
  const int64_t Ho = y.shape[2], Wo = y.shape[3];
  const size_t es = static_cast<size_t>(dtype_bits(x.dtype) / 8);
  auto* o8 = static_cast<int8_t*>(off.data);
  parallel_for(g.N * g.C, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = p / g.C, c = p % g.C;
      for (int64_t oh = 0; oh < Ho; ++oh)
        for (int64_t ow = 0; ow < Wo; ++ow) {
          const int64_t h0 = oh * g.sh - g.ph, w0 = ow * g.sw - g.pw;
          float best = 0.0f;
          int arg = -1;
          int64_t at = 0;
          for (int i = 0; i < g.kh; ++i) {
            const int64_t h = h0 + static_cast<int64_t>(i) * g.dh;
            if (h < 0 || h >= g.H) continue;
            for (int j = 0; j < g.kw; ++j) {
              const int64_t w = w0 + static_cast<int64_t>(j) * g.dw;
              if (w < 0 || w >= g.W) continue;
              const float v = load_float(x.data, x.dtype, at4(x, n, c, h, w));
              if (arg < 0 || v > best || std::isnan(v)) best = v, arg = i * g.kw + j, at = at4(x, n, c, h, w);
            }
          }
          std::memcpy(static_cast<char*>(y.data) + at4(y, n, c, oh, ow) * es,
                      static_cast<const char*>(x.data) + at * es, es);  // the element itself, bit for bit
          o8[at4(off, n, c, oh, ow)] = static_cast<int8_t>(arg);
        }
    }
  });
}

void max_pool2d_offsets_backward(const TensorView& gy, const TensorView& off, const ConvGeometry& g,
                                 const TensorView& gx, Stream) {
  const int64_t Ho = gy.shape[2], Wo = gy.shape[3];
  const auto* o8 = static_cast<const int8_t*>(off.data);
  parallel_for(g.N * g.C, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> acc(static_cast<size_t>(g.H * g.W));
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = p / g.C, c = p % g.C;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t oh = 0; oh < Ho; ++oh)  // (oh, ow) order: each pixel's terms are added in that order
        for (int64_t ow = 0; ow < Wo; ++ow) {
          const int t = o8[at4(off, n, c, oh, ow)];
          if (t < 0 || t >= g.kh * g.kw) continue;  // not an offset of the window: contributes nothing
          const int64_t h = oh * g.sh - g.ph + static_cast<int64_t>(t / g.kw) * g.dh;
          const int64_t w = ow * g.sw - g.pw + static_cast<int64_t>(t % g.kw) * g.dw;
          if (h < 0 || h >= g.H || w < 0 || w >= g.W) continue;  // a tap in the padding: likewise
          acc[static_cast<size_t>(h * g.W + w)] += load_float(gy.data, gy.dtype, at4(gy, n, c, oh, ow));
        }
      for (int64_t h = 0; h < g.H; ++h)
        for (int64_t w = 0; w < g.W; ++w) store_float(gx.data, gx.dtype, at4(gx, n, c, h, w), acc[h * g.W + w]);
    }
  });
}

void pack_int4(const TensorView& q, const TensorView& packed, Stream) {
  const int64_t R = q.shape[0], C = q.shape[1];
  parallel_for(R, row_grain(C), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int8_t* src = q.ptr<int8_t>() + r * q.strides[0];
      uint8_t* dst = static_cast<uint8_t*>(packed.data) + r * packed.strides[0] / 2;
      for (int64_t c = 0; c < C; c += 2) {
        const int lo = src[c], hi = src[c + 1];
        HOT_CHECK_VALUE(lo >= -8 && lo <= 7 && hi >= -8 && hi <= 7, "pack_int4: q[", r, ", ",
                        (lo < -8 || lo > 7) ? c : c + 1, "] = ", (lo < -8 || lo > 7) ? lo : hi,
                        " is outside the int4 range [-8, 7]");
        dst[c / 2] = static_cast<uint8_t>((lo & 0xf) | ((hi & 0xf) << 4));
      }
    }
  });
}

void unpack_int4(const TensorView& packed, const TensorView& q, Stream) {
  const int64_t R = q.shape[0], C = q.shape[1];
  parallel_for(R, row_grain(C), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* src = static_cast<const uint8_t*>(packed.data) + r * packed.strides[0] / 2;
      int8_t* dst = q.ptr<int8_t>() + r * q.strides[0];
      for (int64_t c = 0; c < C; c += 2) {
        const uint8_t b = src[c / 2];
        dst[c] = static_cast<int8_t>(static_cast<int8_t>(b << 4) >> 4);
        dst[c + 1] = static_cast<int8_t>(static_cast<int8_t>(b) >> 4);
      }
    }
  });
}

void compress_activation(const TensorView& x, const TensorView& q_t, const TensorView& scale, int rank, Stream) {
  Mat m(hla_rows(x.shape[0], rank), x.shape[1]);
  hla_dense(x, rank, m);
  quantize_transposed(m, 127, Rounding::nearest, 0, 0, q_t, scale.ptr<float>());
}

// x's own codes: its rows as they are (zero rows up to a multiple of 16), quantised as compress_activation's HLA rows.
void activation_codes(const TensorView& x, const TensorView& q_t, const TensorView& scale, const TensorView* amax,
                      Stream) {
  const int64_t L = x.shape[0], I = x.shape[1];
  Mat m(hla_rows(L, 16), I);
  parallel_for(L, row_grain(I), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) load_row(x, r, m.row(r));
  });
  quantize_transposed(m, 127, Rounding::nearest, 0, 0, q_t, scale.ptr<float>(),
                      amax != nullptr ? amax->ptr<float>() : nullptr);
}

void compress_activation_cast(const TensorView& x, const TensorView& x_cast, const TensorView& q_t,
                              const TensorView& scale, int rank, Stream st) {
  const int64_t L = x.shape[0], I = x.shape[1];
  parallel_for(L, row_grain(I), [&](int64_t r0, int64_t r1) {
    std::vector<float> row(static_cast<size_t>(I));
    for (int64_t r = r0; r < r1; ++r) {
      load_row(x, r, row.data());
      store_row(x_cast, r, row.data());
    }
  });
  cpu::compress_activation(x_cast, q_t, scale, rank, st);
}

// The HLA of the im2col columns one 16-row block at a time, gathered from the int8 map (the block's 16 rows of columns
// as im2col would write them, as floats), then the same transform, row selection and quantisation as
// compress_activation: the same bits as compress_activation(im2col(Q)), without the L x kh*kw*C columns.
void compress_columns(const TensorView& map, const ConvGeometry& g, const TensorView& q_t, const TensorView& scale,
                      int rank, Stream) {
  const Col2imParams p = col2im_params(g);
  const int64_t L = g.N * p.Ho * p.Wo, C = g.C, CKK = static_cast<int64_t>(g.kh) * g.kw * C;
  const int64_t blocks = (L + 15) / 16, ldm = map.strides[0];
  const int8_t* src = map.ptr<int8_t>();
  Mat m(hla_rows(L, rank), CKK);
  parallel_for(blocks, std::max<int64_t>(1, row_grain(CKK * 16)), [&](int64_t b0, int64_t b1) {
    std::vector<float> buf(static_cast<size_t>(16 * CKK));
    for (int64_t blk = b0; blk < b1; ++blk) {
      std::fill(buf.begin(), buf.end(), 0.0f);
      for (int t = 0; t < 16 && blk * 16 + t < L; ++t) {
        float* row = buf.data() + t * CKK;
        for_each_window_pixel(p, blk * 16 + t, [&](int k, int64_t px) {
          if (px < 0) return;  // the padding: zeros, as filled
          const int8_t* in = src + px * ldm;
          for (int64_t c = 0; c < C; ++c) row[k * C + c] = static_cast<float>(in[c]);
        });
      }
      fwht_rows(buf.data(), 16, CKK, CKK);
      for (int k = 0; k < rank; ++k)
        std::memcpy(m.row(blk * rank + k), buf.data() + kHlaOrder[k] * CKK, CKK * sizeof(float));
    }
  });
  quantize_transposed(m, 127, Rounding::nearest, 0, 0, q_t, scale.ptr<float>());
}

void bias_grad(const TensorView& gy, const TensorView& out, Stream) {
  const int64_t L = gy.shape[0], O = gy.shape[1];
  // Per column, a sum over rows in row order: deterministic whatever the thread count.
  parallel_for(O, 64, [&](int64_t c0, int64_t c1) {
    std::vector<float> acc(static_cast<size_t>(c1 - c0), 0.0f);
    for (int64_t r = 0; r < L; ++r) {
      const int64_t off = r * gy.strides[0];
      for (int64_t c = c0; c < c1; ++c) acc[c - c0] += load_float(gy.data, gy.dtype, off + c);
    }
    for (int64_t c = c0; c < c1; ++c) store_float(out.data, out.dtype, c * out.strides[0], acc[c - c0]);
  });
}

void quantize_grad_output(const TensorView& gy, const GradOutputPlan& plan, const GradOutputQuant& out, Stream s) {
  const int64_t L = gy.shape[0], O = gy.shape[1];
  const uint64_t seed = plan.seed + (plan.seed_ptr != nullptr ? *plan.seed_ptr : 0);  // host memory on the CPU
  if (plan.gx) {
    // G~ = g_y blockdiag(H_b), row by row.
    Mat g(L, O);
    parallel_for(L, row_grain(O), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        load_row(gy, r, g.row(r));
        fwht_blocks(g.row(r), O, plan.block);
      }
    });
    const int qmax = qmax_for_bits(plan.gx_bits);
    QuantScale ts{0.0f, 0.0f, 1.0f};
    float* sg = out.s_g.ptr<float>();
    if (plan.gx_scale == ScaleMode::tensor) {
      // G~'s amax: the caller's where known (GradOutputPlan::amax_key, host memory here), else found
      ts = quant_scale_from_amax(plan.amax_key != nullptr ? amax_from_key(*plan.amax_key) : amax_of(g.v.data(), L * O),
                                 qmax);
      sg[0] = ts.scale;
    }
    const int64_t O_pad = out.q_g.shape[1];
    parallel_for(L, row_grain(O), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        QuantScale sc = ts;
        if (plan.gx_scale == ScaleMode::token) {
          sc = quant_scale_from_amax(amax_row(g.row(r), O), qmax);
          sg[r] = sc.scale;
        }
        int8_t* dst = out.q_g.ptr<int8_t>() + r * out.q_g.strides[0];
        quantize_row(g.row(r), O, sc, qmax, plan.rounding, seed, rng_stream::gx_grad, L, r, dst, 1);
        std::memset(dst + O, 0, static_cast<size_t>(O_pad - O));
      }
    });
    if (out.q_g_t.data != nullptr) {  // q_g transposed, zero past L
      const int64_t K = out.q_g_t.shape[1];
      parallel_for(O, row_grain(K), [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) {
          int8_t* dst = out.q_g_t.ptr<int8_t>() + c * out.q_g_t.strides[0];
          for (int64_t r = 0; r < L; ++r) dst[r] = out.q_g.ptr<int8_t>()[r * out.q_g.strides[0] + c];
          std::memset(dst + L, 0, static_cast<size_t>(K - L));
        }
      });
    }
  }
  if (plan.gw) {
    Mat m(hla_rows(L, plan.rank), O);
    hla_dense(gy, plan.rank, m);
    quantize_transposed(m, 127, plan.rounding, seed, rng_stream::gw_grad, out.q_gh_t, out.s_gh.ptr<float>());
  }
  if (plan.bias) bias_grad(gy, out.g_b, s);
}

void quantize_weight(const TensorView& w, const TensorView& q_wt, const TensorView& s_w, int bits, int block, Stream) {
  const int64_t O = w.shape[0], I = w.shape[1];
  // W~ = blockdiag(H_b) W: groups of b rows mixed.
  Mat m(O, I);
  parallel_for(O / block, row_grain(I * block), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      for (int j = 0; j < block; ++j) load_row(w, g * block + j, m.row(g * block + j));
      fwht_rows(m.row(g * block), block, I, I);
    }
  });
  quantize_transposed(m, qmax_for_bits(bits), Rounding::nearest, 0, 0, q_wt, s_w.ptr<float>());
}

}  // namespace hot::cpu
