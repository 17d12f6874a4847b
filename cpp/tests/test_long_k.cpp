// Long g_w contractions (SPEC §4, "Long contractions"): a backward over any number of rows is one call (one scale of
// each g_y operand, one seed), and its g_w contraction, longer than an exact int32 sum of 8-bit products allows past
// hot::kMaxInt32K, is summed exactly in int64 from int32 slices: g_w is the int64 sum of its operands' codes, scaled
// once. Checked against that sum computed here, and against the float64 gradient.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "backend.h"
#include "test_util.h"

namespace {

using hot::Config;
using hot::DType;
using hot::Rounding;
using hot::ScaleMode;
using hot::TensorView;
using hot_test::HostTensor;
using hot_test::expect_int64_dequant;
using hot_test::host_from;
using hot_test::make_cfg;
using hot_test::host_from_int;
using hot_test::randint;
using hot_test::randn;
using hot_test::rounded;

TEST(Cpu_LongContraction, TheInt32Limit) {
  // the longest multiple of 16 whose sum of 127 * 127 products fits int32, and the next one does not
  EXPECT_EQ(hot::kMaxInt32K % 16, 0);
  EXPECT_LE(hot::kMaxInt32K * 127 * 127, int64_t{std::numeric_limits<int32_t>::max()});
  EXPECT_GT((hot::kMaxInt32K + 16) * 127 * 127, int64_t{std::numeric_limits<int32_t>::max()});
}

TEST(Cpu_LongContraction, DequantGemmSumsExactlyPastInt32) {
  // all-127 rows (the sum 127 * 127 * K is past 2^31: an int32 sum would wrap), +-127 rows, random codes; K a multiple
  // of 16 and not, one and several int32 slices.
  for (const int64_t K : {hot::kMaxInt32K, hot::kMaxInt32K + 16, int64_t{200000}, 3 * hot::kMaxInt32K + 37}) {
    SCOPED_TRACE(testing::Message() << "K " << K);
    const int64_t M = 3, N = 2;
    std::vector<int64_t> av(static_cast<size_t>(M * K)), bv(static_cast<size_t>(N * K));
    const std::vector<int64_t> ra = randint(static_cast<size_t>(K), 5, -127, 127);
    const std::vector<int64_t> rb = randint(static_cast<size_t>(K), 6, -127, 127);
    for (int64_t k = 0; k < K; ++k) {
      av[k] = 127;
      av[K + k] = k % 3 == 0 ? -127 : 127;
      av[2 * K + k] = ra[k];
      bv[k] = 127;
      bv[K + k] = rb[k];
    }
    const HostTensor a = host_from_int(DType::s8, M, K, av), b = host_from_int(DType::s8, N, K, bv);
    const HostTensor sa = host_from(DType::f32, 1, 1, {0.5f}), sb = host_from(DType::f32, 1, 1, {0.375f});
    HostTensor out = HostTensor::make2d(DType::f32, M, N);
    TensorView sav = sa.view(), sbv = sb.view();
    sav.shape = {1};
    sav.strides = {1};
    sbv.shape = {1};
    sbv.strides = {1};
    hot::cpu::gemm_s8_dequant(a, b, sav, sbv, 1.0f / 16, 8, out, {});
    expect_int64_dequant(a, b, 0.5f, 0.375f, 1.0f / 16, out);
    EXPECT_EQ(out.getf(0, 0), static_cast<float>(127 * 127 * K) * (0.5f * 0.375f / 16));
  }
}

struct Problem {
  int64_t L, O, I;
  HostTensor gy, w, x;
};

Problem make_problem(DType dt, int64_t L, int64_t O, int64_t I, uint64_t seed) {
  Problem p{L, O, I, {}, {}, {}};
  p.gy = host_from(dt, L, O, rounded(randn(static_cast<size_t>(L * O), seed, 0.5f), dt));
  p.w = host_from(dt, O, I, rounded(randn(static_cast<size_t>(O * I), seed + 1, 0.3f), dt));
  p.x = host_from(dt, L, I, rounded(randn(static_cast<size_t>(L * I), seed + 2, 2.0f), dt));
  return p;
}

// A call whose g_w contraction is past kMaxInt32K: with round-to-nearest, G^ is the ABC buffer of g_y itself
// (compress_activation: the same projection and per-tensor quantisation, SPEC §2, §4), so g_w is the int64 sum of the
// codes of compress_activation(g_y) and of x's ABC buffer, times (s_gh * s_x) / 16, rounded once. The raw-x overload
// compresses all rows at once: the same bits as the ABC buffer's call.
TEST(Cpu_LongContraction, BackwardIsOneCallOverAllRows) {
  for (const int rank : {16, 8}) {
    const int64_t L = (hot::kMaxInt32K + 300) * 16 / rank, O = 16, I = 12;
    SCOPED_TRACE(testing::Message() << "rank " << rank << " L " << L);
    const Config cfg = make_cfg(8, rank, Rounding::nearest, ScaleMode::tensor);
    const Problem p = make_problem(DType::f32, L, O, I, 31 + rank);
    const hot::SavedActivation saved = hot::compress_activation(p.x, rank);
    ASSERT_GT(saved.q.view().shape[1], hot::kMaxInt32K);
    HostTensor gw = HostTensor::make2d(DType::f32, O, I), gw_raw = HostTensor::make2d(DType::f32, O, I);
    HostTensor gx = HostTensor::make2d(DType::f32, L, I), gx_raw = HostTensor::make2d(DType::f32, L, I);
    hot::backward_linear(p.gy, p.w, &saved, cfg, 9, {gx.view(), gw.view(), {}});
    hot::backward_linear(p.gy, p.w, p.x.view(), cfg, 9, {gx_raw.view(), gw_raw.view(), {}});
    EXPECT_EQ(std::memcmp(gw.bytes(), gw_raw.bytes(), gw.nbytes()), 0);
    EXPECT_EQ(std::memcmp(gx.bytes(), gx_raw.bytes(), gx.nbytes()), 0);
    const hot::SavedActivation gh = hot::compress_activation(p.gy, rank);  // O x K_pad: G^'s codes, transposed
    const float s_gh = static_cast<const float*>(gh.scale.view().data)[0];
    const float s_x = static_cast<const float*>(saved.scale.view().data)[0];
    expect_int64_dequant(gh.q.view(), saved.q.view(), s_gh, s_x, 1.0f / 16, gw);
  }
}

TEST(Cpu_LongContraction, CallerGetsTheGradient) {
  // a call past one int32 GEMM is the gradient, within 8-bit accuracy of the float64 products
  const int64_t L = hot::kMaxInt32K + 300, O = 16, I = 16;
  const Problem p = make_problem(DType::f32, L, O, I, 21);
  const Config cfg = make_cfg(8, 16, Rounding::stochastic, ScaleMode::tensor);
  const hot::SavedActivation saved = hot::compress_activation(p.x, cfg.rank);
  HostTensor gx = HostTensor::make2d(DType::f32, L, I), gw = HostTensor::make2d(DType::f32, O, I);
  HostTensor gb = HostTensor::make1d(DType::f32, O);
  ASSERT_NO_THROW(hot::backward_linear(p.gy, p.w, &saved, cfg, 3, {gx.view(), gw.view(), gb.view()}));
  const std::vector<float> gyv = p.gy.to_f32(), wv = p.w.to_f32(), xv = p.x.to_f32();
  std::vector<float> gyt(static_cast<size_t>(O * L));  // g_y^T, for g_w = g_y^T x
  for (int64_t l = 0; l < L; ++l)
    for (int64_t o = 0; o < O; ++o) gyt[o * L + l] = gyv[l * O + o];
  // 8-bit per-tensor quantisation of both operands: about 1% each
  EXPECT_LT(hot_test::rel_err_of_product(gw, gyt, xv, O, L, I), 0.05);
  EXPECT_LT(hot_test::rel_err_of_product(gx, gyv, wv, L, O, I), 0.05);
  for (int64_t o = 0; o < O; ++o) {  // g_b: exact up to fp32 summation
    double s = 0, sa = 0;
    for (int64_t l = 0; l < L; ++l) {
      s += gyv[l * O + o];
      sa += std::fabs(gyv[l * O + o]);
    }
    EXPECT_NEAR(gb.getf(o), s, 1e-5 * sa) << o;
  }
}

TEST(Cpu_LongContraction, RawXOverloadEqualsSavedPath) {
  // backward_linear from the raw x is compress_activation then backward_linear, bit for bit
  const Problem p = make_problem(DType::bf16, 300, 24, 20, 8);
  const Config cfg = make_cfg(8, 8, Rounding::stochastic, ScaleMode::tensor);
  const hot::SavedActivation saved = hot::compress_activation(p.x, cfg.rank);
  HostTensor a = HostTensor::make2d(DType::bf16, 24, 20), b = HostTensor::make2d(DType::bf16, 24, 20);
  HostTensor ga = HostTensor::make2d(DType::bf16, 300, 20), gb = HostTensor::make2d(DType::bf16, 300, 20);
  hot::backward_linear(p.gy, p.w, &saved, cfg, 99, {ga.view(), a.view(), {}});
  hot::backward_linear(p.gy, p.w, p.x.view(), cfg, 99, {gb.view(), b.view(), {}});
  EXPECT_EQ(std::memcmp(a.bytes(), b.bytes(), a.nbytes()), 0);
  EXPECT_EQ(std::memcmp(ga.bytes(), gb.bytes(), ga.nbytes()), 0);
  // exact mode through the raw-x overload is backward_linear_exact
  Config ex;
  ex.exact = true;
  const HostTensor pf = host_from(DType::f32, 300, 24, p.gy.to_f32()), wf = host_from(DType::f32, 24, 20, p.w.to_f32());
  const HostTensor xf = host_from(DType::f32, 300, 20, p.x.to_f32());
  HostTensor e1 = HostTensor::make2d(DType::f32, 24, 20), e2 = HostTensor::make2d(DType::f32, 24, 20);
  const TensorView xfv = xf.view();
  hot::backward_linear(pf, wf, xfv, ex, 0, {{}, e1.view(), {}});
  hot::backward_linear_exact(pf, wf, &xfv, {{}, e2.view(), {}});
  EXPECT_EQ(std::memcmp(e1.bytes(), e2.bytes(), e1.nbytes()), 0);
}

}  // namespace
