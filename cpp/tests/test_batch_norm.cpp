// BatchNorm on the CPU backend. batch_norm_stats: mean, invstd and the running statistics against float64 (within
// the error bound derived from ops.h's fp32 order: the shifted sums, then each per-channel step rounded) and bit for
// bit against a literal fp32 evaluation of that order, invstd +0 where var + eps == 0, a NaN kept to its channel.
// batch_norm_transform: y against float64 within its roundings, with and without weight and bias, in place, padded
// rows. batch_norm_backward_reduce: the per-channel sums against float64 (within the error bound of ops.h's order of
// fp32 adds), grad_weight = sum_dy_xmu * invstd rounded once. batch_norm_backward_input: g_x against a float64
// evaluation of BatchNorm's input gradient (within the fp32 steps' and the final rounding's error), and its G~ amax
// equal, bit for bit, to the amax that quantize_grad_output's g_x path finds in that g_x (its per-tensor scale). The
// argument checks of all four.
#include "test_util.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "backend.h"

using namespace hot_test;
using hot::DType;

namespace {

struct BnCase {
  HostTensor gy, x, mean, invstd, weight, sum_dy, sum_dy_xmu;
};

BnCase make_case(DType dt, int64_t R, int64_t C, uint64_t seed) {
  BnCase b;
  b.gy = host_from(dt, R, C, randn(static_cast<size_t>(R * C), seed));
  b.x = host_from(dt, R, C, randn(static_cast<size_t>(R * C), seed + 1, 2.0f));
  const std::vector<float> u = randn(static_cast<size_t>(5 * C), seed + 2);
  b.mean = HostTensor::make1d(DType::f32, C), b.invstd = b.mean, b.weight = b.mean, b.sum_dy = b.mean;
  b.sum_dy_xmu = b.mean;
  for (int64_t c = 0; c < C; ++c) {
    b.mean.setf(c, 0.1f * u[c]);
    b.invstd.setf(c, 0.5f + std::fabs(u[C + c]));
    b.weight.setf(c, u[2 * C + c]);
    b.sum_dy.setf(c, static_cast<float>(R) * 0.05f * u[3 * C + c]);
    b.sum_dy_xmu.setf(c, static_cast<float>(R) * 0.05f * u[4 * C + c]);
  }
  return b;
}

// An fp32 result's exact value v (float64, from the stored inputs) and a bound e on |fp32 result - v|. A rounded step
// adds its operands' propagated error and its own rounding, at most u (|v| + e) with u = 2^-24 (round to nearest; no
// underflow or overflow in these cases).
struct Bounded {
  double v, e;
};
constexpr double kU = 0x1p-24;
Bounded round32(double v, double e) { return {v, e + kU * (std::fabs(v) + e)}; }
Bounded exact(double v) { return {v, 0.0}; }
Bounded neg(Bounded a) { return {-a.v, a.e}; }
Bounded add(Bounded a, Bounded b) { return round32(a.v + b.v, a.e + b.e); }
Bounded mul(Bounded a, Bounded b) {
  return round32(a.v * b.v, std::fabs(a.v) * b.e + std::fabs(b.v) * a.e + a.e * b.e);
}
Bounded div_exact(Bounded a, double n) { return round32(a.v / n, a.e / n); }  // n > 0, exact in fp32
// |sqrt(x) - sqrt(v)| = |x - v| / (sqrt(x) + sqrt(v)) <= e / sqrt(v), for v > 0.
Bounded sqrt_b(Bounded a) { return round32(std::sqrt(a.v), a.e / std::sqrt(a.v)); }
// |1 / x - 1 / v| = |x - v| / (x v) <= e / (v (v - e)), for v > e.
Bounded recip(Bounded a) {
  return a.e < a.v ? round32(1.0 / a.v, a.e / (a.v * (a.v - a.e))) : Bounded{1.0 / a.v, INFINITY};
}

// The bounds of ops.h's fp32 batch_norm_stats on one channel (xs: its stored values). Each term of the sums a = sum d
// and b = sum d * d (d = x - K, K = xs[0]) passes at most n = kBnReduceRows / kBnReduceLanes + 5 + groups rounded
// adds (in its lane from +0, the lanes pairwise, the groups from +0), so each sum is off by at most gamma_n = n u /
// (1 - n u) times the sum of its rounded terms' magnitudes, plus the terms' own errors: d one rounding (u |x - K|),
// d * d three ((1 + u)^3 - 1 of (x - K)^2). Then q = a / R, mean = K + q, M2 = b - a * q (the clamp at +0 only moves
// M2 toward its exact value, which is >= 0), var = M2 / R, invstd = 1 / sqrt(var + eps); the running statistics
// momentum * s + om * r with om = 1 - momentum rounded and s the mean or M2 / (R - 1). Relative to sum |x - K| and
// sum (x - K)^2, not to the map's offset: what the shift buys.
struct StatsBound {
  Bounded mean, invstd, rm, rv;
};
StatsBound stats_bound(const std::vector<double>& xs, double eps, double momentum, double rm_old, double rv_old) {
  const auto R = static_cast<int64_t>(xs.size());
  const int64_t groups = (R + hot::kBnReduceRows - 1) / hot::kBnReduceRows;
  const double K = xs[0], n = static_cast<double>(hot::kBnReduceRows / hot::kBnReduceLanes + 5 + groups);
  double A = 0, B = 0, S1 = 0;
  for (double x : xs) A += x - K, B += (x - K) * (x - K), S1 += std::fabs(x - K);
  const double gamma = n * kU / (1 - n * kU), t3 = std::pow(1 + kU, 3) - 1;
  const Bounded a{A, gamma * (1 + kU) * S1 + kU * S1}, b{B, gamma * (1 + t3) * B + t3 * B};
  const Bounded q = div_exact(a, static_cast<double>(R)), m2 = add(b, neg(mul(a, q)));
  StatsBound s;
  s.mean = add(exact(K), q);
  s.invstd = recip(sqrt_b(add(div_exact(m2, static_cast<double>(R)), exact(eps))));
  const Bounded om = round32(1 - momentum, 0);
  s.rm = add(mul(exact(momentum), s.mean), mul(om, exact(rm_old)));
  s.rv = R > 1 ? add(mul(exact(momentum), div_exact(m2, static_cast<double>(R - 1))), mul(om, exact(rv_old)))
               : Bounded{0, 0};
  return s;
}

// The float64 statistics of a channel: the mean and the biased variance, two passes.
std::pair<double, double> mean_var64(const std::vector<double>& xs) {
  double m = 0, v = 0;
  for (double x : xs) m += x;
  m /= static_cast<double>(xs.size());
  for (double x : xs) v += (x - m) * (x - m);
  return {m, v / static_cast<double>(xs.size())};
}

std::vector<double> column(const HostTensor& x, int64_t c) {
  std::vector<double> v(static_cast<size_t>(x.rows()));
  for (int64_t r = 0; r < x.rows(); ++r) v[r] = x.getf(r, c);
  return v;
}

// ops.h's batch_norm_stats of channel c in fp32, written out literally with the shift K given: the lanes of each group
// of kBnReduceRows rows, the lanes pairwise, the groups in order; then mean and invstd, and the running statistics
// from rm, rv (R >= 2).
struct Replica {
  float mean, invstd, rm, rv;
};
Replica stats_replica(const HostTensor& x, int64_t c, float K, float eps, float momentum = 0.0f, float rm = 0.0f,
                      float rv = 0.0f) {
  const int64_t R = x.rows(), L = hot::kBnReduceLanes;
  float a = 0.0f, b = 0.0f;
  for (int64_t g0 = 0; g0 < R; g0 += hot::kBnReduceRows) {
    std::vector<float> la(static_cast<size_t>(L), 0.0f), lb = la;
    for (int64_t r = g0; r < std::min(R, g0 + hot::kBnReduceRows); ++r) {
      const float d = x.getf(r, c) - K;
      la[(r - g0) % L] += d, lb[(r - g0) % L] += d * d;
    }
    for (int64_t h = L / 2; h >= 1; h /= 2)
      for (int64_t k = 0; k < h; ++k) la[k] += la[k + h], lb[k] += lb[k + h];
    a += la[0], b += lb[0];
  }
  const float n = static_cast<float>(R), q = a / n, mean = K + q;
  float m2 = b - a * q;
  m2 = m2 < 0.0f ? 0.0f : m2;
  const float var = m2 / n, om = 1.0f - momentum;
  const float unbiased = R > 1 ? m2 / static_cast<float>(R - 1) : 0.0f;
  return {mean, var + eps == 0.0f ? 0.0f : 1.0f / std::sqrt(var + eps), momentum * mean + om * rm,
          momentum * unbiased + om * rv};
}

// A map R x C of dt: offset + sigma * randn, stored (rounded) in x.
HostTensor offset_map(DType dt, int64_t R, int64_t C, float offset, float sigma, uint64_t seed, int64_t ld = -1) {
  std::vector<float> v = randn(static_cast<size_t>(R * C), seed, sigma);
  for (float& e : v) e += offset;
  return host_from(dt, R, C, v, ld);
}

HostTensor f32_vector(const std::vector<float>& v) {
  HostTensor t = HostTensor::make1d(DType::f32, static_cast<int64_t>(v.size()));
  for (size_t i = 0; i < v.size(); ++i) t.setf(static_cast<int64_t>(i), v[i]);
  return t;
}

}  // namespace

// mean, invstd and the running statistics against float64 from the stored x, within stats_bound (the factor 1.001
// covers the float64 reference's own rounding, below 1e-6 of the bound here): rows spanning several groups of
// kBnReduceRows and a partial one, channels not a multiple of 8, one row (no running statistics), a map near zero and
// one far from it (600 + 2 randn). The same bits at one CPU thread.
TEST(BatchNormStats, AgainstFloat64) {
  ThreadGuard guard;
  uint64_t seed = 300;
  const float eps = 1e-5f, momentum = 0.1f;
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (auto [R, C] : std::vector<std::pair<int64_t, int64_t>>{{1, 16}, {37, 13}, {3000, 24}, {2048, 64}})
      for (float offset : {0.0f, 600.0f})
        for (bool running : {false, true}) {
          if (running && R < 2) continue;
          SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " " << R << "x" << C << " offset " << offset
                                          << " running " << running);
          const HostTensor x = offset_map(dt, R, C, offset, offset == 0.0f ? 1.0f : 2.0f, seed += 3);
          const std::vector<float> u = randn(static_cast<size_t>(2 * C), seed + 1);
          std::vector<float> rv0(u.begin() + C, u.end());
          for (float& e : rv0) e = 0.5f + std::fabs(e);
          const HostTensor rm_old = f32_vector({u.begin(), u.begin() + C}), rv_old = f32_vector(rv0);
          HostTensor mean = HostTensor::make1d(DType::f32, C), invstd = mean, rm = rm_old, rv = rv_old;
          const hot::TensorView rmv = rm.view(), rvv = rv.view();
          hot::batch_norm_stats(x, mean, invstd, eps, running ? &rmv : nullptr, running ? &rvv : nullptr, momentum);
          for (int64_t c = 0; c < C; ++c) {
            const std::vector<double> xs = column(x, c);
            const auto [m, var] = mean_var64(xs);
            const StatsBound b = stats_bound(xs, eps, momentum, rm_old.getf(c), rv_old.getf(c));
            EXPECT_LE(std::fabs(mean.getf(c) - m), 1.001 * b.mean.e) << c;
            EXPECT_LE(std::fabs(invstd.getf(c) - 1 / std::sqrt(var + eps)), 1.001 * b.invstd.e) << c;
            if (!running) continue;
            const double mo = momentum;
            EXPECT_LE(std::fabs(rm.getf(c) - (mo * m + (1 - mo) * rm_old.getf(c))), 1.001 * b.rm.e) << c;
            const double unbiased = var * static_cast<double>(R) / static_cast<double>(R - 1);
            EXPECT_LE(std::fabs(rv.getf(c) - (mo * unbiased + (1 - mo) * rv_old.getf(c))), 1.001 * b.rv.e) << c;
          }
          hot::set_num_threads(1);
          HostTensor mean1 = HostTensor::make1d(DType::f32, C), invstd1 = mean1, rm1 = rm_old, rv1 = rv_old;
          const hot::TensorView rmv1 = rm1.view(), rvv1 = rv1.view();
          hot::batch_norm_stats(x, mean1, invstd1, eps, running ? &rmv1 : nullptr, running ? &rvv1 : nullptr,
                                momentum);
          hot::set_num_threads(guard.saved);
          EXPECT_TRUE(bits_equal(mean1, mean));
          EXPECT_TRUE(bits_equal(invstd1, invstd));
          EXPECT_TRUE(bits_equal(rm1, rm));
          EXPECT_TRUE(bits_equal(rv1, rv));
        }
}

// ops.h fixes the order of every fp32 step, so the op gives the bits of stats_replica, a literal fp32 evaluation of
// it: mean, invstd and the running statistics (the cases of AgainstFloat64).
TEST(BatchNormStats, EqualsAnFp32ReplicaOfTheOrder) {
  uint64_t seed = 400;
  const float eps = 1e-5f, momentum = 0.1f;
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (auto [R, C] : std::vector<std::pair<int64_t, int64_t>>{{1, 16}, {37, 13}, {3000, 24}, {2048, 64}})
      for (float offset : {0.0f, 600.0f}) {
        SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " " << R << "x" << C << " offset " << offset);
        const HostTensor x = offset_map(dt, R, C, offset, offset == 0.0f ? 1.0f : 2.0f, seed += 3);
        const std::vector<float> u = randn(static_cast<size_t>(2 * C), seed + 1);
        HostTensor mean = HostTensor::make1d(DType::f32, C), invstd = mean, rm = mean, rv = mean;
        for (int64_t c = 0; c < C; ++c) rm.setf(c, u[c]), rv.setf(c, 0.5f + std::fabs(u[C + c]));
        const HostTensor rm_old = rm, rv_old = rv;
        const hot::TensorView rmv = rm.view(), rvv = rv.view();
        hot::batch_norm_stats(x, mean, invstd, eps, R > 1 ? &rmv : nullptr, R > 1 ? &rvv : nullptr, momentum);
        for (int64_t c = 0; c < C; ++c) {
          const Replica want = stats_replica(x, c, x.getf(0, c), eps, momentum, rm_old.getf(c), rv_old.getf(c));
          EXPECT_EQ(f32_bits(mean.getf(c)), f32_bits(want.mean)) << c;
          EXPECT_EQ(f32_bits(invstd.getf(c)), f32_bits(want.invstd)) << c;
          if (R < 2) continue;
          EXPECT_EQ(f32_bits(rm.getf(c)), f32_bits(want.rm)) << c;
          EXPECT_EQ(f32_bits(rv.getf(c)), f32_bits(want.rv)) << c;
        }
      }
}

// The shift is what keeps the bound: without it (K = 0 in the replica: the one-pass sums of x and x^2) invstd falls
// outside stats_bound on most channels of a map far from zero (600 + 2 randn, f32), so AgainstFloat64's bound does
// not pass an unshifted implementation.
TEST(BatchNormStats, TheShiftKeepsTheBound) {
  const int64_t R = 3000, C = 24;
  const float eps = 1e-5f;
  const HostTensor x = offset_map(DType::f32, R, C, 600.0f, 2.0f, 77);
  int naive_off = 0;
  for (int64_t c = 0; c < C; ++c) {
    const std::vector<double> xs = column(x, c);
    const double var = mean_var64(xs).second, bound = stats_bound(xs, eps, 0.1, 0.0, 0.0).invstd.e;
    const float shifted = stats_replica(x, c, x.getf(0, c), eps).invstd, naive = stats_replica(x, c, 0.0f, eps).invstd;
    EXPECT_LE(std::fabs(shifted - 1 / std::sqrt(var + eps)), bound) << c;
    naive_off += std::fabs(naive - 1 / std::sqrt(var + eps)) > bound;
  }
  EXPECT_GE(naive_off, C / 2) << "the unshifted sums should miss the bound";
}

// var + eps == 0 (every row of a channel equal, eps = 0): invstd +0 (as torch's), mean the constant exactly (d = 0,
// q = +0); the running variance momentum * 0 + om * r = om * r rounded once. One row, one group, a partial second.
TEST(BatchNormStats, ZeroVarianceAndEpsGiveInvstdZero) {
  const int64_t C = 12;
  const float momentum = 0.25f, om = 1.0f - momentum;
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (int64_t R : {1, 37, 1500}) {
      SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " R " << R);
      HostTensor x = HostTensor::make2d(dt, R, C);
      for (int64_t c = 0; c < C; ++c)
        for (int64_t r = 0; r < R; ++r) x.setf(r, c, 0.75f * static_cast<float>(c - 5) + (c % 3 == 0 ? 300.0f : 0.0f));
      HostTensor mean = HostTensor::make1d(DType::f32, C), invstd = mean, rm = mean, rv = mean;
      for (int64_t c = 0; c < C; ++c) rm.setf(c, 0.1f * static_cast<float>(c)), rv.setf(c, 1.0f + 0.3f * c);
      const HostTensor rv_old = rv;
      const hot::TensorView rmv = rm.view(), rvv = rv.view();
      hot::batch_norm_stats(x, mean, invstd, 0.0f, R > 1 ? &rmv : nullptr, R > 1 ? &rvv : nullptr, momentum);
      for (int64_t c = 0; c < C; ++c) {
        EXPECT_EQ(f32_bits(mean.getf(c)), f32_bits(x.getf(0, c))) << c;
        EXPECT_EQ(f32_bits(invstd.getf(c)), 0u) << c;
        if (R > 1) {
          EXPECT_EQ(f32_bits(rv.getf(c)), f32_bits(om * rv_old.getf(c))) << c;
        }
      }
    }
}

// A NaN in x, in a middle row, the last row or the first (the shift K), makes its channel's mean, invstd and running
// statistics NaN; the other channels stay finite.
TEST(BatchNormStats, NonFiniteStaysVisible) {
  const int64_t C = 12;
  uint64_t seed = 500;
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (int64_t R : {37, 1500}) {
      SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " R " << R);
      HostTensor x = offset_map(dt, R, C, 0.0f, 1.0f, seed += 3);
      x.setf(R / 2, 7, std::nanf("")), x.setf(R - 1, 2, std::nanf("")), x.setf(0, 5, std::nanf(""));
      HostTensor mean = HostTensor::make1d(DType::f32, C), invstd = mean, rm = mean, rv = mean;
      for (int64_t c = 0; c < C; ++c) rv.setf(c, 1.0f);
      const hot::TensorView rmv = rm.view(), rvv = rv.view();
      hot::batch_norm_stats(x, mean, invstd, 1e-5f, &rmv, &rvv, 0.1f);
      for (int64_t c = 0; c < C; ++c) {
        const bool nan = c == 2 || c == 5 || c == 7;
        for (const HostTensor* t : {&mean, &invstd, &rm, &rv}) {
          if (nan)
            EXPECT_TRUE(std::isnan(t->getf(c))) << c;
          else
            EXPECT_TRUE(std::isfinite(t->getf(c))) << c;
        }
      }
    }
}

TEST(BatchNormStats, ArgumentErrors) {
  const HostTensor x = offset_map(DType::bf16, 8, 16, 0.0f, 1.0f, 1), x1 = offset_map(DType::bf16, 1, 16, 0, 1, 2);
  HostTensor mean = HostTensor::make1d(DType::f32, 16), invstd = mean, rm = mean, rv = mean;
  const HostTensor mean16 = HostTensor::make1d(DType::f16, 16), short_invstd = HostTensor::make1d(DType::f32, 15);
  const hot::TensorView rmv = rm.view(), rvv = rv.view(), mv = mean.view();
  using hot::ErrorKind;
  const char* op = "batch_norm_stats";
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_stats(x, mean16, invstd, 1e-5f); }, ErrorKind::type,
                         {op, "mean", "float32"}));
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_stats(x, mean, short_invstd, 1e-5f); }, ErrorKind::value,
                         {op, "invstd", "(16,)"}));
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_stats(x, mean, invstd, 1e-5f, &rmv, nullptr); }, ErrorKind::value,
                         {op, "both or neither"}));
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_stats(x, mean, invstd, 1e-5f, nullptr, &rvv); }, ErrorKind::value,
                         {op, "both or neither"}));
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_stats(x1, mean, invstd, 1e-5f, &rmv, &rvv); }, ErrorKind::value,
                         {op, "x", "2 rows"}));
  EXPECT_NO_THROW(hot::batch_norm_stats(x1, mean, invstd, 1e-5f));
  const HostTensor x0 = HostTensor::make2d(DType::bf16, 0, 16);
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_stats(x0, mean, invstd, 1e-5f); }, ErrorKind::value,
                         {op, "x", "empty"}));
  for (float eps : {-1e-5f, std::nanf(""), INFINITY})
    EXPECT_TRUE(throws_hot([&] { hot::batch_norm_stats(x, mean, invstd, eps); }, ErrorKind::value, {op, "eps"}));
  for (float momentum : {1.5f, -0.1f, std::nanf("")})
    EXPECT_TRUE(throws_hot([&] { hot::batch_norm_stats(x, mean, invstd, 1e-5f, &rmv, &rvv, momentum); },
                           ErrorKind::value, {op, "momentum"}));
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_stats(x, mean, mean, 1e-5f); }, ErrorKind::value, {op, "overlap"}));
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_stats(x, mv, mv, 1e-5f); }, ErrorKind::value, {op, "overlap"}))
      << "one view passed as mean and invstd";
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_stats(x, mean, invstd, 1e-5f, &rmv, &rmv); }, ErrorKind::value,
                         {op, "overlap"}));
  hot::TensorView in_x = x.view();  // invstd over x's first row (x is bf16: 16 floats cover its first two rows)
  in_x.dtype = DType::f32, in_x.shape = {16}, in_x.strides = {1};
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_stats(x, mean, in_x, 1e-5f); }, ErrorKind::value,
                         {op, "invstd must not overlap x"}));
}

// y against float64 (x - mean) * (weight * invstd) + bias from the stored inputs, within its roundings: x - mean once
// (u |D|, D = x - mean), s = weight * invstd once (u |S|; exact without weight), so |d s - D S| <= (2u + u^2) |D S|;
// the fma's rounding to fp32 (u of |Y| and that error) and the rounding to y's dtype (its unit roundoff; none for
// f32), with half the smallest subnormal of each as an absolute floor. With and without weight and bias, a map near
// zero and one far from it (mean near x: cancellation), padded rows of x and y (y's padding untouched), and in place
// (y is x: the bytes of the out-of-place y).
TEST(BatchNormTransform, AgainstFloat64) {
  uint64_t seed = 700;
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (auto [R, C] : std::vector<std::pair<int64_t, int64_t>>{{1, 16}, {37, 13}, {300, 24}, {64, 520}})
      for (float offset : {0.0f, 600.0f})
        for (int64_t pad : {0, 5})
          for (int affine = 0; affine < 4; ++affine) {  // bit 0: weight, bit 1: bias
            SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " " << R << "x" << C << " offset " << offset
                                            << " pad " << pad << " affine " << affine);
            const HostTensor x = offset_map(dt, R, C, offset, 2.0f, seed += 3, C + pad);
            const std::vector<float> u = randn(static_cast<size_t>(4 * C), seed + 1);
            HostTensor st[4];  // mean, invstd, weight, bias
            for (int k = 0; k < 4; ++k) {
              st[k] = HostTensor::make1d(DType::f32, C);
              for (int64_t c = 0; c < C; ++c) {
                const float v = u[k * C + c];
                st[k].setf(c, k == 0 ? offset + 0.5f * v : k == 1 ? 0.25f + std::fabs(v) : v);
              }
            }
            const hot::TensorView w = st[2].view(), b = st[3].view();
            const hot::TensorView* wp = affine & 1 ? &w : nullptr;
            const hot::TensorView* bp = affine & 2 ? &b : nullptr;
            HostTensor y = HostTensor::make2d(dt, R, C, C + 3);
            hot::batch_norm_transform(x, st[0], st[1], wp, bp, y);
            EXPECT_TRUE(y.padding_untouched());
            const double uf = dt == DType::f32 ? 0.0 : unit_roundoff(dt);
            const double floor = dt == DType::f16 ? 0x1p-25 : dt == DType::bf16 ? 0x1p-134 : 0x1p-150;
            int bad = 0;
            for (int64_t r = 0; r < R; ++r)
              for (int64_t c = 0; c < C; ++c) {
                const double D = static_cast<double>(x.getf(r, c)) - st[0].getf(c);
                const double S = (wp ? st[2].getf(c) : 1.0) * st[1].getf(c), bias = bp ? st[3].getf(c) : 0.0;
                const double Y = D * S + bias, ed = kU * std::fabs(D), es = wp ? kU * std::fabs(S) : 0.0;
                const double ew = std::fabs(D) * es + std::fabs(S) * ed + ed * es;
                const double ez = ew + kU * (std::fabs(Y) + ew) + 0x1p-150;
                const double ey = ez + uf * (std::fabs(Y) + ez) + floor;
                if (!(std::fabs(y.getf(r, c) - Y) <= ey) && bad++ < 5)
                  ADD_FAILURE() << r << "," << c << ": got " << y.getf(r, c) << " want " << Y << " bound " << ey;
              }
            EXPECT_EQ(bad, 0);
            HostTensor in_place = x;
            hot::batch_norm_transform(in_place, st[0], st[1], wp, bp, in_place);
            EXPECT_TRUE(bits_equal(in_place, y));
            EXPECT_TRUE(in_place.padding_untouched());
          }
}

TEST(BatchNormTransform, ArgumentErrors) {
  const HostTensor x = offset_map(DType::f32, 8, 16, 0.0f, 1.0f, 1);
  const HostTensor mean = HostTensor::make1d(DType::f32, 16), invstd = f32_vector(std::vector<float>(16, 1.0f));
  const HostTensor y16 = HostTensor::make2d(DType::f16, 8, 16), y_tall = HostTensor::make2d(DType::f32, 9, 16);
  const HostTensor short_w = HostTensor::make1d(DType::f32, 15);
  HostTensor y = HostTensor::make2d(DType::f32, 8, 16), big = HostTensor::make2d(DType::f32, 9, 16);
  using hot::ErrorKind;
  const char* op = "batch_norm_transform";
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_transform(x, mean, invstd, nullptr, nullptr, y16); }, ErrorKind::type,
                         {op, "y", "float32"}));
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_transform(x, mean, invstd, nullptr, nullptr, y_tall); },
                         ErrorKind::value, {op, "y", "(8, 16)"}));
  const hot::TensorView wv = short_w.view();
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_transform(x, mean, invstd, &wv, nullptr, y); }, ErrorKind::value,
                         {op, "weight", "(16,)"}));
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_transform(x, mean, invstd, nullptr, &wv, y); }, ErrorKind::value,
                         {op, "bias", "(16,)"}));
  // mean in y's first row; y one row into x (not x itself)
  hot::TensorView mean_in_y = y.view(), y_shifted = big.view(), x_in_big = big.view();
  mean_in_y.shape = {16}, mean_in_y.strides = {1};
  y_shifted.data = static_cast<float*>(y_shifted.data) + 16, y_shifted.shape = {8, 16};
  x_in_big.shape = {8, 16};
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_transform(x, mean_in_y, invstd, nullptr, nullptr, y); },
                         ErrorKind::value, {op, "y must not overlap mean"}));
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_transform(x_in_big, mean, invstd, nullptr, nullptr, y_shifted); },
                         ErrorKind::value, {op, "y must not overlap x"}));
  EXPECT_NO_THROW(hot::batch_norm_transform(x_in_big, mean, invstd, nullptr, nullptr, x_in_big));
}

// Rows spanning several groups of kBnReduceRows and a partial one, channels not a multiple of 8, row padding.
TEST(BatchNormBackwardReduce, AgainstFloat64) {
  uint64_t seed = 90;
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (auto [R, C] : std::vector<std::pair<int64_t, int64_t>>{{1, 16}, {37, 13}, {3000, 24}, {2048, 64}})
      for (bool weight : {true, false}) {
        SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " " << R << "x" << C << " weight " << weight);
        const BnCase b = make_case(dt, R, C, seed += 3);
        HostTensor sd = HostTensor::make1d(DType::f32, C), sx = sd, gw = sd;
        const hot::TensorView gwv = gw.view();
        hot::batch_norm_backward_reduce(b.gy, b.x, b.mean, b.invstd, sd, sx, weight ? &gwv : nullptr);
        // Each sum is a chain of at most 1024 / 32 in-lane adds, 5 lane adds and one add a group; a term of
        // sum_dy_xmu carries two more roundings (x - mean, the product).
        const int64_t groups = (R + hot::kBnReduceRows - 1) / hot::kBnReduceRows;
        const double u = std::ldexp(1.0, -24),
                     chain = static_cast<double>(hot::kBnReduceRows / hot::kBnReduceLanes + 5 + groups);
        for (int64_t c = 0; c < C; ++c) {
          double want_dy = 0, want_xmu = 0, abs_dy = 0, abs_xmu = 0;
          for (int64_t r = 0; r < R; ++r) {
            const double d = b.gy.getf(r, c), p = d * (static_cast<double>(b.x.getf(r, c)) - b.mean.getf(c));
            want_dy += d, want_xmu += p, abs_dy += std::fabs(d), abs_xmu += std::fabs(p);
          }
          EXPECT_LE(std::fabs(sd.getf(c) - want_dy), chain * u * abs_dy * 1.001) << c;
          EXPECT_LE(std::fabs(sx.getf(c) - want_xmu), (chain + 2) * u * abs_xmu * 1.001) << c;
          if (weight) EXPECT_EQ(f32_bits(gw.getf(c)), f32_bits(sx.getf(c) * b.invstd.getf(c))) << c;
        }
      }
}

// With a ReLU's bits: the sums of relu_mask_backward's output, bit for bit, and g_relu its bytes (into a buffer and in
// place); NaN and infinite g_y where masked and unmasked.
TEST(BatchNormBackwardReduce, WithTheReluBitsIsTheReduceOfTheMaskedGradient) {
  uint64_t seed = 130;
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (auto [R, C] : std::vector<std::pair<int64_t, int64_t>>{{37, 13}, {2100, 24}})
      for (bool in_place : {false, true}) {
        SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " " << R << "x" << C << " in place " << in_place);
        BnCase b = make_case(dt, R, C, seed += 3);
        b.gy.setf(0, 0, std::nanf("")), b.gy.setf(1, 1, INFINITY), b.gy.setf(2, 2, std::nanf(""));
        const int64_t n = R * C;
        HostTensor bits = HostTensor::make1d(DType::s8, (n + 7) / 8);
        const std::vector<int64_t> r = randint(static_cast<size_t>((n + 7) / 8), seed, -128, 127);
        for (int64_t i = 0; i < (n + 7) / 8; ++i) static_cast<int8_t*>(bits.view().data)[i] = static_cast<int8_t>(r[i]);
        const auto flat = [n](const HostTensor& t) {
          hot::TensorView v = t.view();
          v.shape = {n}, v.strides = {1};
          return v;
        };
        HostTensor masked = HostTensor::make2d(dt, R, C);
        hot::relu_mask_backward(flat(b.gy), bits, flat(masked));
        HostTensor want[2] = {HostTensor::make1d(DType::f32, C), HostTensor::make1d(DType::f32, C)};
        hot::batch_norm_backward_reduce(masked, b.x, b.mean, b.invstd, want[0], want[1], nullptr);
        HostTensor got[2] = {HostTensor::make1d(DType::f32, C), HostTensor::make1d(DType::f32, C)};
        HostTensor gr = HostTensor::make2d(dt, R, C), gy_copy = b.gy;
        const hot::TensorView bv = bits.view(), grv = in_place ? gy_copy.view() : gr.view();
        hot::batch_norm_backward_reduce(gy_copy, b.x, b.mean, b.invstd, got[0], got[1], nullptr, &bv, &grv);
        EXPECT_TRUE(bits_equal(got[0], want[0]));
        EXPECT_TRUE(bits_equal(got[1], want[1]));
        EXPECT_TRUE(bits_equal(in_place ? gy_copy : gr, masked));
      }
}

TEST(BatchNormBackwardReduce, ArgumentErrors) {
  const BnCase b = make_case(DType::bf16, 8, 16, 1);
  HostTensor sd = HostTensor::make1d(DType::f32, 16), sx = sd, short_out = HostTensor::make1d(DType::f32, 15);
  const HostTensor x32 = HostTensor::make2d(DType::f32, 8, 16), x_wide = HostTensor::make2d(DType::bf16, 8, 17);
  using hot::ErrorKind;
  const char* op = "batch_norm_backward_reduce";
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_backward_reduce(b.gy, x32, b.mean, b.invstd, sd, sx, nullptr); },
                         ErrorKind::type, {op, "x", "bfloat16"}));
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_backward_reduce(b.gy, x_wide, b.mean, b.invstd, sd, sx, nullptr); },
                         ErrorKind::value, {op, "x"}));
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_backward_reduce(b.gy, b.x, b.mean, b.invstd, short_out, sx, nullptr); },
                         ErrorKind::value, {op, "sum_dy", "(16,)"}));
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_backward_reduce(b.gy, b.x, b.mean, b.invstd, sd, sd, nullptr); },
                         ErrorKind::value, {op, "sum_dy_xmu", "overlap"}));
  const hot::TensorView mv = b.mean.view();
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_backward_reduce(b.gy, b.x, b.mean, b.invstd, sd, sx, &mv); },
                         ErrorKind::value, {op, "grad_weight", "overlap"}));
  HostTensor bits = HostTensor::make1d(DType::s8, 16), short_bits = HostTensor::make1d(DType::s8, 15);
  const hot::TensorView bv = bits.view(), sbv = short_bits.view(), xv = b.x.view(), gyv = b.gy.view();
  HostTensor gr = HostTensor::make2d(DType::bf16, 8, 16), padded = HostTensor::make2d(DType::bf16, 8, 24);
  hot::TensorView grv = gr.view(), pv = padded.view();
  pv.shape = {8, 16};
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_backward_reduce(b.gy, b.x, b.mean, b.invstd, sd, sx, nullptr, nullptr,
                                                               &grv); },
                         ErrorKind::value, {op, "g_relu needs relu_bits"}));
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_backward_reduce(b.gy, b.x, b.mean, b.invstd, sd, sx, nullptr, &sbv); },
                         ErrorKind::value, {op, "relu_bits", "(16,)"}));
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_backward_reduce(pv, b.x, b.mean, b.invstd, sd, sx, nullptr, &bv); },
                         ErrorKind::value, {op, "rows must be contiguous"}));
  EXPECT_TRUE(throws_hot([&] { hot::batch_norm_backward_reduce(b.gy, b.x, b.mean, b.invstd, sd, sx, nullptr, &bv,
                                                               &xv); },
                         ErrorKind::value, {op, "g_relu must be g_y itself"}));
  EXPECT_NO_THROW(hot::batch_norm_backward_reduce(b.gy, b.x, b.mean, b.invstd, sd, sx, nullptr, &bv, &gyv));
}

TEST(BatchNormBackwardInput, AgainstFloat64AndTheGyPassAmax) {
  uint64_t seed = 40;
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (auto [R, C] : std::vector<std::pair<int64_t, int64_t>>{{1, 16}, {37, 24}, {200, 64}, {64, 40}})
      for (bool affine : {true, false}) {
        SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " " << R << "x" << C << " affine " << affine);
        const BnCase b = make_case(dt, R, C, seed += 3);
        HostTensor gx = HostTensor::make2d(dt, R, C), amax = HostTensor::make1d(DType::f32, 1);
        const hot::TensorView w = b.weight.view();
        hot::batch_norm_backward_input(b.gy, b.x, b.mean, b.invstd, affine ? &w : nullptr, b.sum_dy, b.sum_dy_xmu,
                                       gx, amax);
        for (int64_t r = 0; r < R; ++r)
          for (int64_t c = 0; c < C; ++c) {
            const double is = b.invstd.getf(c), wt = affine ? b.weight.getf(c) : 1.0;
            const double gm = b.sum_dy.getf(c) / R, pj = b.sum_dy_xmu.getf(c) / R * is * is;
            const double want = (b.gy.getf(r, c) - gm - (b.x.getf(r, c) - b.mean.getf(c)) * pj) * is * wt;
            // the fp32 steps (a few units of 2^-24 of the terms) and the final rounding to dt
            const double terms = (std::fabs(b.gy.getf(r, c)) + std::fabs(gm) +
                                  std::fabs((b.x.getf(r, c) - b.mean.getf(c)) * pj)) * std::fabs(is * wt);
            EXPECT_LE(std::fabs(gx.getf(r, c) - want), 8 * std::ldexp(1.0, -24) * terms + unit_roundoff(dt) *
                                                            std::fabs(want) + 1e-30)
                << r << "," << c;
          }
        // the amax the conv's g_y pass takes of this g_x: its per-tensor scale from quantize_grad_output
        hot::GradOutputPlan plan;
        plan.gx = true;
        plan.gx_bits = 8;
        plan.block = hot::hq_block_size(C);
        plan.gx_scale = hot::ScaleMode::tensor;
        plan.rounding = hot::Rounding::nearest;
        hot::GradOutputQuant out;
        HostTensor qg = HostTensor::make2d(DType::s8, R, hot::padded_k(C)), sg = HostTensor::make1d(DType::f32, 1);
        out.q_g = qg;
        out.s_g = sg;
        hot::cpu::quantize_grad_output(gx, plan, out, {});
        EXPECT_EQ(f32_bits(sg.getf(0)), f32_bits(hot::quant_scale_from_amax(amax.getf(0), 127).scale));
      }
}

TEST(BatchNormBackwardInput, ArgumentErrors) {
  const BnCase b = make_case(DType::bf16, 8, 16, 1);
  HostTensor gx = HostTensor::make2d(DType::bf16, 8, 16), amax = HostTensor::make1d(DType::f32, 1);
  HostTensor gx32 = HostTensor::make2d(DType::f32, 8, 16), short_mean = HostTensor::make1d(DType::f32, 15);
  using hot::ErrorKind;
  const auto call = [&](const hot::TensorView& x, const hot::TensorView& mean, const hot::TensorView& out) {
    hot::batch_norm_backward_input(b.gy, x, mean, b.invstd, nullptr, b.sum_dy, b.sum_dy_xmu, out, amax);
  };
  EXPECT_TRUE(throws_hot([&] { call(b.x, b.mean, gx32); }, ErrorKind::type, {"batch_norm_backward_input", "g_x"}));
  EXPECT_TRUE(throws_hot([&] { call(b.x, short_mean, gx); }, ErrorKind::value,
                         {"batch_norm_backward_input", "mean", "(16,)"}));
  EXPECT_TRUE(throws_hot([&] { call(b.x, b.mean, b.gy); }, ErrorKind::value, {"batch_norm_backward_input", "overlap"}));
}

// The hand-over: a convolution followed by a BatchNorm gets its grad_output (the BatchNorm's g_x) with G~'s amax;
// backward_conv2d given that amax writes the bytes it writes without it (3x3 at stride 1 and 2, a pointwise conv; g_w
// from the codes and from the ABC buffer of the columns). The amax is read where the g_y pass would otherwise find it
// alone (g_w from the codes, or no g_w): there a wrong one changes g_x; with G^ (the ABC buffer's g_w) or g_b it is not
// read.
TEST(BatchNormBackwardInput, HandsGtAmaxToTheConvolutionBefore) {
  uint64_t seed = 700;
  for (DType dt : {DType::f32, DType::bf16})
    for (int stride : {1, 2})
      for (int k : {3, 1})
        for (bool codes : {true, false}) {
          hot::ConvGeometry g;
          g.N = 2, g.C = 8, g.H = 9, g.W = 9, g.kh = k, g.kw = k, g.ph = k / 2, g.pw = k / 2, g.sh = stride,
          g.sw = stride;
          const int64_t O = 24, L = g.N * g.out_h() * g.out_w(), CKK = g.C * k * k, P = g.N * g.H * g.W;
          SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " k " << k << " stride " << stride << " codes "
                                          << codes);
          const BnCase b = make_case(dt, L, O, seed += 3);
          HostTensor gy = HostTensor::make2d(dt, L, O), amax = HostTensor::make1d(DType::f32, 1);
          hot::batch_norm_backward_input(b.gy, b.x, b.mean, b.invstd, nullptr, b.sum_dy, b.sum_dy_xmu, gy, amax);
          const HostTensor map =
              host_from_int(DType::s8, P, g.C, randint(static_cast<size_t>(P * g.C), seed, -127, 127));
          const HostTensor w = host_from(dt, O, CKK, randn(static_cast<size_t>(O * CKK), seed + 1, 0.05f));
          hot::Config cfg;
          hot::SavedActivation s;
          s.rows = L, s.cols = CKK, s.rank = cfg.rank, s.codes = codes;
          s.q = hot::Tensor::empty(DType::s8, {CKK, hot::padded_k(hot::hla_rows(L, cfg.rank))}, hot::Device::cpu());
          s.scale = hot::Tensor::empty(DType::f32, {1}, hot::Device::cpu());
          if (codes) {
            hot::im2col_t(map, g, s.q.view());
            s.scale.view().ptr<float>()[0] = 0.0173f;
          } else {
            hot::compress_columns(map, g, s.q.view(), s.scale.view(), cfg.rank);
          }
          const auto run = [&](const hot::TensorView* a, bool bias) {
            HostTensor gx = HostTensor::make2d(dt, P, g.C), gw = HostTensor::make2d(DType::f32, O, CKK);
            HostTensor gb = HostTensor::make1d(DType::f32, O);
            hot::backward_conv2d(gy, w, &s, g, cfg, 42, {gx, gw, bias ? gb.view() : hot::TensorView{}}, {}, nullptr,
                                 a);
            return std::make_pair(gx, gw);
          };
          const auto [gx0, gw0] = run(nullptr, false);
          const hot::TensorView av = amax.view();
          const auto [gx1, gw1] = run(&av, false);
          EXPECT_TRUE(bits_equal(gx0, gx1));
          EXPECT_TRUE(bits_equal(gw0, gw1));
          HostTensor wrong = HostTensor::make1d(DType::f32, 1);
          wrong.setf(0, 2.0f * amax.getf(0));
          const hot::TensorView wv = wrong.view();
          EXPECT_EQ(static_cast<bool>(bits_equal(gx0, run(&wv, false).first)), !codes)
              << "a wrong amax is read iff g_w is the codes'";
          EXPECT_TRUE(bits_equal(gx0, run(&wv, true).first)) << "with g_b the g_y pass finds the amax itself";
          const hot::TensorView per_channel = b.mean.view();
          EXPECT_TRUE(throws_hot([&] { run(&per_channel, false); }, hot::ErrorKind::value,
                                 {"backward_conv2d", "grad_output_amax"}));
        }
}
