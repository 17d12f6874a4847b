// quantize / dequantize (SPEC §5) and packed INT4.
#include "test_util.h"

namespace {

using namespace hot_test;
using hot::QuantizeParams;
using hot::Rounding;
using hot::ScaleMode;

struct QOut {
  HostTensor q, scale;
};

QOut run_quantize(const HostTensor& in, const QuantizeParams& p, int64_t q_ld = -1) {
  QOut o;
  o.q = HostTensor::make2d(DType::s8, in.rows(), in.cols(), q_ld);
  o.scale = HostTensor::make1d(DType::f32, p.scale == ScaleMode::token ? in.rows() : 1);
  hot::quantize(in, o.q, o.scale, p);
  return o;
}

QuantizeParams params(int bits, ScaleMode sm, Rounding rd, uint64_t seed = 0, uint32_t stream = 0) {
  QuantizeParams p;
  p.bits = bits;
  p.scale = sm;
  p.rounding = rd;
  p.seed = seed;
  p.rng_stream = stream;
  return p;
}

::testing::AssertionResult matches_ref(const QOut& o, const RefQuant& ref) {
  const std::vector<int64_t> q = o.q.to_int();
  for (size_t i = 0; i < q.size(); ++i)
    if (q[i] != ref.q[i])
      return ::testing::AssertionFailure() << "q[" << i << "] = " << q[i] << ", expected " << ref.q[i];
  for (size_t i = 0; i < ref.scale.size(); ++i) {
    const float s = o.scale.getf(static_cast<int64_t>(i));
    if (f32_bits(s) != f32_bits(ref.scale[i]) && !(std::isnan(s) && std::isnan(ref.scale[i])))
      return ::testing::AssertionFailure() << "scale[" << i << "] = " << s << ", expected " << ref.scale[i];
  }
  return ::testing::AssertionSuccess();
}

TEST(Cpu_Quantize, NearestEqualsRuleExactly) {
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1}, {1, 17}, {7, 13}, {64, 100}, {3, 512}};
  for (auto [R, C] : shapes)
    for (int bits : {4, 8})
      for (ScaleMode sm : {ScaleMode::tensor, ScaleMode::token})
        for (DType dt : {DType::f32, DType::f16, DType::bf16})
          for (int64_t pad : {0, 3}) {
            std::vector<float> v = rounded(randn(static_cast<size_t>(R * C), R * 1000 + C + bits, 2.5f), dt);
            const HostTensor in = host_from(dt, R, C, v, C + pad);
            const QOut o = run_quantize(in, params(bits, sm, Rounding::nearest), C + 2 * pad);
            const RefQuant ref = ref_quantize(v, R, C, bits, sm == ScaleMode::token, false);
            ASSERT_TRUE(matches_ref(o, ref)) << R << "x" << C << " bits " << bits << " " << hot::scale_mode_name(sm)
                                             << " " << hot::dtype_name(dt) << " pad " << pad;
            EXPECT_TRUE(o.q.padding_untouched());
            const int qmax = (1 << (bits - 1)) - 1;
            for (int64_t q : o.q.to_int()) ASSERT_LE(std::abs(q), qmax);
            // the max |v| element maps to ±qmax (per tensor or per row)
            if (sm == ScaleMode::tensor) {
              int64_t best = 0;
              for (size_t i = 0; i < v.size(); ++i) if (std::fabs(v[i]) > std::fabs(v[best])) best = static_cast<int64_t>(i);
              EXPECT_EQ(std::abs(o.q.to_int()[best]), qmax);
            }
          }
}

TEST(Cpu_Quantize, NearestTiesToEven) {
  // amax = 127 gives inv = 1 exactly, so v * inv = v and ties are visible.
  const std::vector<float> v = {127.0f, 2.5f, 3.5f, -2.5f, -3.5f, 0.5f, -0.5f, 1.5f, 126.5f, -126.5f, 2.4999998f, 0.0f};
  const QOut o = run_quantize(host_from(DType::f32, 1, 12, v), params(8, ScaleMode::tensor, Rounding::nearest));
  const std::vector<int64_t> expect = {127, 2, 4, -2, -4, 0, 0, 2, 126, -126, 2, 0};
  EXPECT_EQ(o.q.to_int(), expect);
  EXPECT_EQ(o.scale.getf(0), 1.0f);
  // 4 bits: amax = 7
  const std::vector<float> w = {-7.0f, 6.5f, 5.5f, -0.5f, 1.5f, 3.0f};
  const QOut o4 = run_quantize(host_from(DType::f32, 1, 6, w), params(4, ScaleMode::tensor, Rounding::nearest));
  EXPECT_EQ(o4.q.to_int(), (std::vector<int64_t>{-7, 6, 6, 0, 2, 3}));
  EXPECT_EQ(o4.scale.getf(0), 1.0f);
}

TEST(Cpu_Quantize, PerRowScales) {
  const int64_t R = 5, C = 8;
  std::vector<float> v(static_cast<size_t>(R * C));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) v[r * C + c] = static_cast<float>((c + 1) * (r + 1)) * (c % 2 ? -0.25f : 0.25f);
  const QOut o = run_quantize(host_from(DType::f32, R, C, v), params(8, ScaleMode::token, Rounding::nearest));
  for (int64_t r = 0; r < R; ++r) {
    const float amax = static_cast<float>(C * (r + 1)) * 0.25f;
    EXPECT_EQ(o.scale.getf(r), amax / 127.0f) << r;
    EXPECT_EQ(std::abs(o.q.geti(r, C - 1)), 127) << r;  // each row reaches qmax
  }
}

TEST(Cpu_Quantize, ZeroAmaxGivesZeroQAndZeroScale) {
  for (Rounding rd : {Rounding::nearest, Rounding::stochastic}) {
    const std::vector<float> z(24, 0.0f);
    const QOut o = run_quantize(host_from(DType::f32, 3, 8, z), params(8, ScaleMode::tensor, rd, 5));
    for (int64_t q : o.q.to_int()) EXPECT_EQ(q, 0);
    EXPECT_EQ(o.scale.getf(0), 0.0f);
    // per token: only the zero row gets scale 0
    std::vector<float> v = randn(24, 3);
    for (int c = 0; c < 8; ++c) v[8 + c] = (c % 2) ? -0.0f : 0.0f;
    const QOut t = run_quantize(host_from(DType::f32, 3, 8, v), params(4, ScaleMode::token, rd, 5));
    EXPECT_EQ(t.scale.getf(1), 0.0f);
    EXPECT_GT(t.scale.getf(0), 0.0f);
    EXPECT_GT(t.scale.getf(2), 0.0f);
    for (int c = 0; c < 8; ++c) EXPECT_EQ(t.q.geti(1, c), 0);
    HostTensor deq = HostTensor::make2d(DType::f32, 3, 8);
    hot::dequantize(t.q, t.scale, deq);
    for (int c = 0; c < 8; ++c) EXPECT_EQ(deq.getf(1, c), 0.0f);
  }
}

TEST(Cpu_Quantize, NonFiniteInputGivesNaNScale) {
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity()};
  for (float sp : specials)
    for (Rounding rd : {Rounding::nearest, Rounding::stochastic})
      for (int bits : {4, 8}) {
        std::vector<float> v = randn(40, 8);
        v[13] = sp;  // row 1 of 4 x 10
        // per tensor: everything non-finite after dequantisation
        const QOut o = run_quantize(host_from(DType::f32, 4, 10, v), params(bits, ScaleMode::tensor, rd, 1));
        EXPECT_TRUE(std::isnan(o.scale.getf(0))) << sp;
        const int qmax = (1 << (bits - 1)) - 1;
        for (int64_t q : o.q.to_int()) EXPECT_LE(std::abs(q), qmax);
        HostTensor deq = HostTensor::make2d(DType::f32, 4, 10);
        hot::dequantize(o.q, o.scale, deq);
        for (float d : deq.to_f32()) EXPECT_FALSE(std::isfinite(d));
        // per token: only row 1
        const QOut t = run_quantize(host_from(DType::f32, 4, 10, v), params(bits, ScaleMode::token, rd, 1));
        EXPECT_TRUE(std::isnan(t.scale.getf(1)));
        for (int r : {0, 2, 3}) EXPECT_TRUE(std::isfinite(t.scale.getf(r))) << r;
        const RefQuant ref = ref_quantize(v, 4, 10, bits, true, rd == Rounding::stochastic, 1, 0);
        EXPECT_TRUE(matches_ref(t, ref));
        HostTensor deq2 = HostTensor::make2d(DType::f32, 4, 10);
        hot::dequantize(t.q, t.scale, deq2);
        for (int c = 0; c < 10; ++c) {
          EXPECT_FALSE(std::isfinite(deq2.getf(1, c)));
          EXPECT_TRUE(std::isfinite(deq2.getf(0, c)));
        }
      }
}

TEST(Cpu_Quantize, TinyAmaxStaysExact) {
  // amax below qmax / FLT_MAX (~3.7e-37 for 8 bits): inv = qmax / amax overflows fp32. The quantised
  // values must still be round(v qmax / amax) (zero stays zero, half of amax is ~qmax/2) and the
  // scale amax / qmax must be finite, so that tiny gradients are not turned into ±qmax or NaN.
  for (Rounding rd : {Rounding::nearest, Rounding::stochastic})
    for (float amax : {1e-38f, 2e-39f, 1e-41f}) {
      const std::vector<float> v = {amax, 0.0f, -amax / 2, amax / 4, -amax, 0.0f, amax / 8, -0.0f};
      const QOut o = run_quantize(host_from(DType::f32, 1, 8, v), params(8, ScaleMode::tensor, rd, 3));
      const float s = o.scale.getf(0);
      EXPECT_TRUE(std::isfinite(s)) << amax;
      EXPECT_GT(s, 0.0f) << amax;
      for (int i = 0; i < 8; ++i) {
        const double t = static_cast<double>(v[i]) * 127.0 / amax;  // exact target in float64
        EXPECT_LE(std::fabs(o.q.geti(0, i) - t), rd == Rounding::nearest ? 0.5 + 1e-3 : 1.0 + 1e-3)
            << hot::rounding_name(rd) << " amax " << amax << " v[" << i << "] = " << v[i];
      }
    }
}

TEST(Cpu_Quantize, HalfPrecisionNonFinite) {
  for (DType dt : {DType::f16, DType::bf16}) {
    std::vector<float> v = rounded(randn(16, 2), dt);
    v[5] = std::numeric_limits<float>::infinity();
    const QOut o = run_quantize(host_from(dt, 2, 8, v), params(8, ScaleMode::tensor, Rounding::nearest));
    EXPECT_TRUE(std::isnan(o.scale.getf(0))) << hot::dtype_name(dt);
  }
}

TEST(Cpu_Quantize, DequantizeIsQTimesScale) {
  const int64_t R = 6, C = 10;
  const std::vector<float> v = randn(static_cast<size_t>(R * C), 77, 3.0f);
  for (ScaleMode sm : {ScaleMode::tensor, ScaleMode::token}) {
    const QOut o = run_quantize(host_from(DType::f32, R, C, v), params(8, sm, Rounding::nearest));
    for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
      HostTensor out = HostTensor::make2d(dt, R, C, C + 1);
      hot::dequantize(o.q, o.scale, out);
      EXPECT_TRUE(out.padding_untouched());
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c) {
          const float s = o.scale.getf(sm == ScaleMode::token ? r : 0);
          const float e = round_to(dt, static_cast<float>(o.q.geti(r, c)) * s);
          ASSERT_EQ(out.getf(r, c), e) << hot::dtype_name(dt) << " " << r << "," << c;
          // and close to the input: |deq - v| <= s/2 (+ output rounding)
          ASSERT_LE(std::fabs(out.getf(r, c) - v[r * C + c]), 0.5 * s * (1 + 1e-6) + unit_roundoff(dt) * std::fabs(e) * 1.01);
        }
    }
  }
}

TEST(Cpu_Quantize, StochasticEqualsRuleExactly) {
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1}, {1, 3}, {5, 7}, {33, 65}, {2, 1030}};
  for (auto [R, C] : shapes)
    for (int bits : {4, 8})
      for (ScaleMode sm : {ScaleMode::tensor, ScaleMode::token})
        for (uint32_t stream : {0u, 1u})
          for (uint64_t seed : {0ull, 123456789ull, 0xdeadbeef00000001ull}) {
            const std::vector<float> v = randn(static_cast<size_t>(R * C), R + C + seed);
            const QOut o = run_quantize(host_from(DType::f32, R, C, v, C + 1), params(bits, sm, Rounding::stochastic, seed, stream));
            const RefQuant ref = ref_quantize(v, R, C, bits, sm == ScaleMode::token, true, seed, stream);
            ASSERT_TRUE(matches_ref(o, ref)) << R << "x" << C << " bits " << bits << " seed " << seed << " stream " << stream;
            // |q - v inv| < 1 (up to one fp32 ulp of the sum v inv + u, |v inv| <= 127)
            const std::vector<int64_t> q = o.q.to_int();
            for (int64_t r = 0; r < R; ++r) {
              const float inv = ref.inv[sm == ScaleMode::token ? r : 0];
              for (int64_t c = 0; c < C; ++c) {
                const double t = static_cast<double>(v[r * C + c] * inv);
                ASSERT_LT(std::fabs(q[r * C + c] - t), 1.0 + std::ldexp(1.0, -16));
              }
            }
          }
}

TEST(Cpu_Quantize, StochasticIsUnbiased) {
  // mean over N seeds of q s -> v; each draw is floor(t) or floor(t)+1 with p = frac(t), so the mean
  // of N draws has sd s sqrt(p(1-p)/N). Bound: 6 sd + 1e-5 s (u is on a 2^-24 grid; t + u rounds in fp32).
  const int64_t C = 65;
  const int N = 4000;
  std::vector<float> v = randn(C, 99, 0.4f);
  v[0] = 1.0f;  // amax
  for (auto& x : v) x = std::max(-1.0f, std::min(1.0f, x));
  for (int bits : {4, 8}) {
    const HostTensor in = host_from(DType::f32, 1, C, v);
    std::vector<double> sum(C, 0.0);
    float s = 0, inv = 0;
    double total_err = 0;
    for (int k = 0; k < N; ++k) {
      const QOut o = run_quantize(in, params(bits, ScaleMode::tensor, Rounding::stochastic, 1000 + k, 0));
      s = o.scale.getf(0);
      for (int64_t c = 0; c < C; ++c) sum[c] += o.q.geti(0, c) * static_cast<double>(s);
    }
    inv = static_cast<float>((1 << (bits - 1)) - 1) / 1.0f;
    for (int64_t c = 0; c < C; ++c) {
      const double t = static_cast<double>(v[c] * inv);
      const double p = t - std::floor(t);
      const double sd = s * std::sqrt(p * (1 - p) / N);
      const double mean = sum[c] / N;
      EXPECT_NEAR(mean, v[c], 6 * sd + 1e-5 * s) << "bits " << bits << " c " << c << " p " << p;
      total_err += mean - v[c];
    }
    // aggregate over all elements: sd <= s / (2 sqrt(N C))
    EXPECT_NEAR(total_err / C, 0.0, 6 * s / (2 * std::sqrt(static_cast<double>(N) * C)) + 1e-5 * s);
  }
}

TEST(Cpu_Quantize, SeedsAndStreamsChangeBits) {
  const int64_t R = 16, C = 64;
  const std::vector<float> v = randn(static_cast<size_t>(R * C), 5);
  const HostTensor in = host_from(DType::f32, R, C, v);
  const QOut a = run_quantize(in, params(8, ScaleMode::tensor, Rounding::stochastic, 7, 0));
  const QOut b = run_quantize(in, params(8, ScaleMode::tensor, Rounding::stochastic, 7, 0));
  const QOut c = run_quantize(in, params(8, ScaleMode::tensor, Rounding::stochastic, 8, 0));
  const QOut d = run_quantize(in, params(8, ScaleMode::tensor, Rounding::stochastic, 7, 1));
  const QOut e = run_quantize(in, params(8, ScaleMode::tensor, Rounding::stochastic, 7 + (1ull << 32), 0));
  EXPECT_TRUE(bits_equal(a.q, b.q));
  EXPECT_FALSE(bits_equal(a.q, c.q));
  EXPECT_FALSE(bits_equal(a.q, d.q));
  EXPECT_FALSE(bits_equal(a.q, e.q));
}

TEST(Cpu_Quantize, IdenticalBitsAcrossThreadCounts) {
  ThreadGuard guard;
  const int64_t R = 777, C = 1031;
  const std::vector<float> v = randn(static_cast<size_t>(R * C), 2024);
  const HostTensor in = host_from(DType::f32, R, C, v);
  for (ScaleMode sm : {ScaleMode::tensor, ScaleMode::token})
    for (Rounding rd : {Rounding::stochastic, Rounding::nearest}) {
      std::vector<QOut> outs;
      for (int nt : {1, 2, 3}) {
        hot::set_num_threads(nt);
        EXPECT_EQ(hot::get_num_threads(), nt);
        outs.push_back(run_quantize(in, params(4, sm, rd, 31337, 0)));
      }
      for (int k = 1; k < 3; ++k) {
        EXPECT_TRUE(bits_equal(outs[0].q, outs[k].q)) << "threads " << k + 1;
        EXPECT_TRUE(bits_equal(outs[0].scale, outs[k].scale)) << "threads " << k + 1;
      }
      const RefQuant ref = ref_quantize(v, R, C, 4, sm == ScaleMode::token, rd == Rounding::stochastic, 31337, 0);
      EXPECT_TRUE(matches_ref(outs[0], ref));
    }
}

// ---- INT4 -----------------------------------------------------------------------------------------

TEST(Cpu_Int4, ExactNibbleLayout) {
  const std::vector<int64_t> q = {1, -1, 7, -8, 0, 5, -3, 2};
  HostTensor packed = HostTensor::make2d(DType::s4, 1, 8);
  hot::pack_int4(host_from_int(DType::s8, 1, 8, q), packed);
  ASSERT_EQ(packed.nbytes(), 4u);
  EXPECT_EQ(packed.bytes()[0], 0xF1);  // element 0 = 1 low, element 1 = -1 high
  EXPECT_EQ(packed.bytes()[1], 0x87);  // 7 low, -8 high
  EXPECT_EQ(packed.bytes()[2], 0x50);
  EXPECT_EQ(packed.bytes()[3], 0x2D);
}

TEST(Cpu_Int4, PackUnpackRoundTrip) {
  const std::pair<int64_t, int64_t> shapes[] = {{1, 2}, {3, 16}, {17, 34}, {64, 256}};
  for (auto [R, C] : shapes)
    for (int64_t pad : {0, 6}) {
      const std::vector<int64_t> q = randint(static_cast<size_t>(R * C), R * C + pad, -8, 7);
      const HostTensor src = host_from_int(DType::s8, R, C, q, C + pad + 1);
      HostTensor packed = HostTensor::make2d(DType::s4, R, C, C + pad);
      hot::pack_int4(src, packed);
      EXPECT_TRUE(packed.padding_untouched());
      for (int64_t r = 0; r < R; ++r)
        for (int64_t k = 0; k < C / 2; ++k) {
          const uint8_t byte = packed.bytes()[(r * (C + pad)) / 2 + k];
          const uint8_t expect = static_cast<uint8_t>((q[r * C + 2 * k] & 0xf) | ((q[r * C + 2 * k + 1] & 0xf) << 4));
          ASSERT_EQ(byte, expect) << R << "x" << C << " row " << r << " byte " << k;
        }
      HostTensor back = HostTensor::make2d(DType::s8, R, C, C + 2);
      hot::unpack_int4(packed, back);
      EXPECT_EQ(back.to_int(), q);
      EXPECT_TRUE(back.padding_untouched());
    }
}

TEST(Cpu_Int4, UnpackAllByteValues) {
  std::vector<int64_t> q(512);
  HostTensor packed = HostTensor::make2d(DType::s4, 1, 512);
  for (int b = 0; b < 256; ++b) packed.bytes()[b] = static_cast<uint8_t>(b);
  HostTensor back = HostTensor::make2d(DType::s8, 1, 512);
  hot::unpack_int4(packed, back);
  for (int b = 0; b < 256; ++b) {
    const int lo = b & 0xf, hi = b >> 4;
    EXPECT_EQ(back.geti(0, 2 * b), lo >= 8 ? lo - 16 : lo);
    EXPECT_EQ(back.geti(0, 2 * b + 1), hi >= 8 ? hi - 16 : hi);
  }
}

TEST(Cpu_Int4, PackOutOfRangeIsAnError) {
  for (int64_t bad : {8, -9, 127, -128}) {
    std::vector<int64_t> q(8, 0);
    q[5] = bad;
    const HostTensor src = host_from_int(DType::s8, 1, 8, q);
    HostTensor packed = HostTensor::make2d(DType::s4, 1, 8);
    EXPECT_TRUE(throws_hot([&] { hot::pack_int4(src, packed); }, hot::ErrorKind::value, {"pack_int4"})) << bad;
  }
}

}  // namespace
