// compress_activation and activation_codes (SPEC §2) and backward_linear / backward_linear_exact (SPEC §3, §4).
#include <cstdio>

#include "backend.h"
#include "test_util.h"

namespace {

using namespace hot_test;
using hot::Config;
using hot::TensorView;
using hot::Rounding;
using hot::ScaleMode;

// Contents of a Tensor (CPU) as integers / floats, row-major logical.
std::vector<int64_t> tensor_ints(const hot::Tensor& t) {
  const TensorView& v = t.view();
  std::vector<int64_t> out;
  for (int64_t r = 0; r < v.shape[0]; ++r)
    for (int64_t c = 0; c < v.shape[1]; ++c) out.push_back(v.ptr<int8_t>()[r * v.strides[0] + c * v.strides[1]]);
  return out;
}
float tensor_scalar(const hot::Tensor& t) { return t.view().ptr<float>()[0]; }

// ---- compress_activation ---------------------------------------------------------------------------

TEST(Cpu_Compress, ShapesPaddingAndValues) {
  for (int64_t L : {1, 15, 16, 17, 37, 100})
    for (int rank : {1, 3, 8, 16})
      for (int64_t I : {1, 5, 32}) {
        const std::vector<float> x = randn(static_cast<size_t>(L * I), L * 100 + rank * 10 + I);
        const hot::SavedActivation s = hot::compress_activation(host_from(DType::f32, L, I, x), rank);
        const int64_t K = ceil_div(L, 16) * rank, Kp = round_up16(K);
        ASSERT_EQ(s.q.view().dtype, DType::s8);
        ASSERT_EQ(s.q.view().shape, (hot::Shape{I, Kp}));
        ASSERT_EQ(s.scale.view().dtype, DType::f32);
        ASSERT_EQ(s.scale.view().shape, (hot::Shape{1}));
        EXPECT_EQ(s.rows, L);
        EXPECT_EQ(s.cols, I);
        EXPECT_EQ(s.rank, rank);
        EXPECT_EQ(s.nbytes(), static_cast<size_t>(I * Kp + 4));
        // q^T == Q8(HLA(x)) round to nearest, per tensor; zero past K
        const RefQuant ref = ref_quantize(hla_f32(x, L, I, rank), K, I, 8, false, false);
        const std::vector<int64_t> q = tensor_ints(s.q);
        for (int64_t i = 0; i < I; ++i)
          for (int64_t k = 0; k < Kp; ++k) {
            const int64_t want = k < K ? ref.q[k * I + i] : 0;
            ASSERT_EQ(q[i * Kp + k], want) << "L " << L << " rank " << rank << " I " << I << " (i " << i << ", k " << k << ")";
          }
        EXPECT_EQ(f32_bits(tensor_scalar(s.scale)), f32_bits(ref.scale[0]));
      }
}

TEST(Cpu_Compress, EqualsComposedPublicOps) {
  const int64_t L = 45, I = 23;
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    const std::vector<float> x = rounded(randn(static_cast<size_t>(L * I), 3, 4.0f), dt);
    const HostTensor xt = host_from(dt, L, I, x, I + 3);
    const hot::SavedActivation s = hot::compress_activation(xt, 8);
    const int64_t K = hot::hla_rows(L, 8);
    HostTensor xh = HostTensor::make2d(DType::f32, K, I);
    hot::hla_project(xt, xh, 8);
    HostTensor q = HostTensor::make2d(DType::s8, K, I), sc = HostTensor::make1d(DType::f32, 1);
    hot::QuantizeParams p;
    p.bits = 8;
    hot::quantize(xh, q, sc, p);
    const std::vector<int64_t> got = tensor_ints(s.q);
    const int64_t Kp = hot::padded_k(K);
    for (int64_t i = 0; i < I; ++i)
      for (int64_t k = 0; k < K; ++k) ASSERT_EQ(got[i * Kp + k], q.geti(k, i)) << hot::dtype_name(dt);
    EXPECT_EQ(tensor_scalar(s.scale), sc.getf(0));
  }
}

TEST(Cpu_Compress, ZeroAndNonFiniteInputs) {
  const std::vector<float> z(20 * 4, 0.0f);
  const hot::SavedActivation s = hot::compress_activation(host_from(DType::f32, 20, 4, z), 8);
  for (int64_t q : tensor_ints(s.q)) EXPECT_EQ(q, 0);
  EXPECT_EQ(tensor_scalar(s.scale), 0.0f);
  std::vector<float> x = randn(80, 1);
  x[17] = std::numeric_limits<float>::quiet_NaN();
  const hot::SavedActivation n = hot::compress_activation(host_from(DType::f32, 20, 4, x), 8);
  EXPECT_TRUE(std::isnan(tensor_scalar(n.scale)));
}

// compress_activation_cast: x_cast is x rounded to its dtype (to nearest, ties to even; the test's own rounding) and
// the buffer is compress_activation of x_cast, byte for byte; a padded row stride of x_cast keeps its padding.
TEST(Cpu_Compress, CastIsRoundingThenCompression) {
  const int64_t L = 37, I = 24;
  for (DType src : {DType::f32, DType::f16})
    for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
      std::vector<float> x = rounded(randn(static_cast<size_t>(L * I), 11, 3.0f), src);
      if (src == DType::f32) {
        x[0] = 1.0f + std::ldexp(1.0f, -8);       // a bf16 tie: to 1 (even)
        x[1] = 1.0f + 3 * std::ldexp(1.0f, -8);   // a bf16 tie: to 1 + 2^-6 (even)
        x[2] = 1.0f + std::ldexp(1.0f, -11);      // an fp16 tie: to 1
        x[3] = 1.0e5f;                             // past fp16's range: inf
      }
      const HostTensor xt = host_from(src, L, I, x, I + 5);
      HostTensor xc = HostTensor::make2d(dt, L, I, I + 3);
      for (int64_t r = 0; r < L; ++r)
        for (int64_t c = I; c < I + 3; ++c) xc.setf(r, c, 7.0f);  // padding, left alone
      const int64_t Kp = hot::padded_k(hot::hla_rows(L, 8));
      HostTensor q = HostTensor::make2d(DType::s8, I, Kp), sc = HostTensor::make1d(DType::f32, 1);
      hot::compress_activation_cast(xt, xc, q, sc, 8);
      for (int64_t r = 0; r < L; ++r) {
        for (int64_t c = 0; c < I; ++c) {
          const float v = x[r * I + c], want = round_to(dt, v);
          ASSERT_EQ(f32_bits(xc.getf(r, c)), f32_bits(want)) << hot::dtype_name(src) << " -> " << hot::dtype_name(dt)
                                                            << " (" << r << ", " << c << ") of " << v;
          if (std::isfinite(want)) EXPECT_LE(std::fabs(want - v), unit_roundoff(dt) * std::fabs(v));
        }
        for (int64_t c = I; c < I + 3; ++c) ASSERT_EQ(xc.getf(r, c), 7.0f);
      }
      if (src == DType::f32 && dt == DType::bf16) {
        EXPECT_EQ(xc.getf(0, 0), 1.0f);
        EXPECT_EQ(xc.getf(0, 1), 1.0f + std::ldexp(1.0f, -6));
      }
      if (src == DType::f32 && dt == DType::f16) {
        EXPECT_EQ(xc.getf(0, 2), 1.0f);
        EXPECT_TRUE(std::isinf(xc.getf(0, 3)));
      }
      const hot::SavedActivation s = hot::compress_activation(xc, 8);
      EXPECT_EQ(tensor_ints(s.q), tensor_ints(hot::Tensor::wrap(q.view(), nullptr)));
      EXPECT_EQ(f32_bits(tensor_scalar(s.scale)), f32_bits(sc.getf(0)));
    }
}

// activation_codes: x's own codes, transposed: quantize(x, 8 bits, per tensor, nearest) byte for byte, zero past L,
// one scale; a SavedActivation of rank 16 with codes set.
TEST(Cpu_ActivationCodes, QuantizeTransposed) {
  uint64_t seed = 900;
  for (DType dt : {DType::f32, DType::f16, DType::bf16})
    for (int64_t L : {1, 15, 16, 17, 100})
      for (int64_t I : {1, 5, 32}) {
        SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " L " << L << " I " << I);
        const std::vector<float> x = rounded(randn(static_cast<size_t>(L * I), seed++, 3.0f), dt);
        const HostTensor xt = host_from(dt, L, I, x, I + 2);
        const hot::SavedActivation s = hot::activation_codes(xt);
        const int64_t Kp = hot::padded_k(L);
        ASSERT_EQ(s.q.view().shape, (hot::Shape{I, Kp}));
        EXPECT_TRUE(s.codes);
        EXPECT_EQ(s.rank, 16);
        EXPECT_EQ(s.rows, L);
        EXPECT_EQ(s.cols, I);
        HostTensor q = HostTensor::make2d(DType::s8, L, I), sc = HostTensor::make1d(DType::f32, 1);
        hot::QuantizeParams p;
        p.bits = 8;
        p.scale = ScaleMode::tensor;
        p.rounding = Rounding::nearest;
        hot::quantize(xt, q, sc, p);
        const std::vector<int64_t> got = tensor_ints(s.q);
        for (int64_t i = 0; i < I; ++i)
          for (int64_t k = 0; k < Kp; ++k) ASSERT_EQ(got[i * Kp + k], k < L ? q.geti(k, i) : 0) << i << ", " << k;
        EXPECT_EQ(f32_bits(tensor_scalar(s.scale)), f32_bits(sc.getf(0)));
        // the caller's buffers: the same bytes
        HostTensor q2 = HostTensor::make2d(DType::s8, I, Kp), s2 = HostTensor::make1d(DType::f32, 1);
        hot::activation_codes(xt, q2, s2);
        EXPECT_EQ(tensor_ints(hot::Tensor::wrap(q2.view(), nullptr)), got);
        EXPECT_EQ(f32_bits(s2.getf(0)), f32_bits(sc.getf(0)));
      }
}

TEST(Cpu_ActivationCodes, ZeroNonFiniteAndBadArguments) {
  const std::vector<float> z(20 * 4, 0.0f);
  const hot::SavedActivation s = hot::activation_codes(host_from(DType::f32, 20, 4, z));
  for (int64_t q : tensor_ints(s.q)) EXPECT_EQ(q, 0);
  EXPECT_EQ(tensor_scalar(s.scale), 0.0f);
  std::vector<float> x = randn(80, 1);
  x[17] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(std::isfinite(tensor_scalar(hot::activation_codes(host_from(DType::f32, 20, 4, x)).scale)));  // §5
  const HostTensor xt = host_from(DType::f32, 20, 4, x);
  HostTensor q = HostTensor::make2d(DType::s8, 4, 16), sc = HostTensor::make1d(DType::f32, 1);  // 16 < padded_k(20)
  EXPECT_THROW(hot::activation_codes(xt, q, sc), hot::Error);
  HostTensor qi = HostTensor::make2d(DType::s8, 20, 4);
  EXPECT_THROW(hot::activation_codes(qi), hot::Error);  // int8 x
}

TEST(Cpu_Compress, DefaultRankIsOneEighthOfFp32) {
  const int64_t L = 1024, I = 64;
  const hot::SavedActivation s = hot::compress_activation(host_from(DType::f32, L, I, randn(L * I, 4)), 8);
  EXPECT_EQ(s.q.nbytes() * 8, static_cast<size_t>(L * I * 4));
}

// ---- backward_linear ---------------------------------------------------------------------------------

struct Case {
  int64_t L, O, I;
};
const Case kCases[] = {{64, 32, 48}, {37, 24, 20}, {50, 20, 33}, {17, 18, 7}, {33, 17, 9},
                       {1, 16, 16},  {5, 3, 2},    {100, 48, 40}, {16, 80, 1}};

struct BwdRun {
  HostTensor gx, gw, gb;
};

BwdRun run_backward(DType in_dt, DType out_dt, const std::vector<float>& gy, const std::vector<float>& w,
                 const std::vector<float>& x, int64_t L, int64_t O, int64_t I, const Config& cfg, uint64_t seed,
                 bool want_gx = true, bool want_gw = true, bool want_gb = true, int64_t pad = 0) {
  const HostTensor gyt = host_from(in_dt, L, O, gy, O + pad), wt = host_from(in_dt, O, I, w, I + pad);
  BwdRun r;
  hot::BackwardOutputs out;
  if (want_gx) {
    r.gx = HostTensor::make2d(out_dt, L, I, I + pad);
    out.grad_input = r.gx.view();
  }
  if (want_gw) {
    r.gw = HostTensor::make2d(out_dt, O, I, I + pad);
    out.grad_weight = r.gw.view();
  }
  if (want_gb) {
    r.gb = HostTensor::make1d(out_dt, O);
    out.grad_bias = r.gb.view();
  }
  hot::SavedActivation saved;
  if (want_gw) saved = hot::compress_activation(host_from(in_dt, L, I, x, I + 2 * pad), cfg.rank);
  hot::backward_linear(gyt, wt, want_gw ? &saved : nullptr, cfg, seed, out);
  return r;
}

// |got - ref| <= (8 u32 + u_out) |ref|: the integer products are exact, the epilogue does a few fp32
// multiplications (acc -> float, * s_a, * s_b, * 1/b) and one rounding to the output dtype.
double epilogue_rel(DType out_dt) { return 8 * std::ldexp(1.0, -24) + unit_roundoff(out_dt); }
// Absolute floor for results that land in the f16 subnormal range (half of its smallest step 2^-24).
double abs_floor(DType out_dt) { return out_dt == DType::f16 ? std::ldexp(1.0, -25) : 1e-30; }

// Bias: fp32 accumulation of L terms: |err| <= (L - 1) u32 sum|g_y| (+ output rounding).
void check_bias(const HostTensor& gb, const std::vector<float>& gy, int64_t L, int64_t O, DType out_dt) {
  for (int64_t o = 0; o < O; ++o) {
    double s = 0, sa = 0;
    for (int64_t l = 0; l < L; ++l) {
      s += gy[l * O + o];
      sa += std::fabs(gy[l * O + o]);
    }
    const double tol = (L - 1) * std::ldexp(1.0, -24) * sa * 1.01 + unit_roundoff(out_dt) * std::fabs(s) * 1.01 + abs_floor(out_dt);
    ASSERT_NEAR(gb.getf(o), s, tol) << "bias " << o;
  }
}

void check_against_replica(DType in_dt, DType out_dt, const Case& c, const Config& cfg, uint64_t seed, int64_t pad = 0) {
  const auto [L, O, I] = c;
  const std::vector<float> gy = rounded(randn(static_cast<size_t>(L * O), L + O + I + seed, 0.01f), in_dt);
  const std::vector<float> w = rounded(randn(static_cast<size_t>(O * I), O * I + 1, 0.1f), in_dt);
  const std::vector<float> x = rounded(randn(static_cast<size_t>(L * I), L * I + 2, 2.0f), in_dt);
  const BwdRun r = run_backward(in_dt, out_dt, gy, w, x, L, O, I, cfg, seed, true, true, true, pad);
  const RefBackward ref = ref_backward(gy, w, x, L, O, I, cfg, seed);
  const double rel = epilogue_rel(out_dt);
  const double tiny = abs_floor(out_dt);
  EXPECT_TRUE(all_close(r.gx.to_f32(), ref.gx, rel, tiny))
      << "g_x " << L << "x" << O << "x" << I << " bits " << cfg.gx_bits << " " << hot::scale_mode_name(cfg.gx_scale)
      << " " << hot::rounding_name(cfg.rounding) << " b " << ref.block << " in " << hot::dtype_name(in_dt) << " out "
      << hot::dtype_name(out_dt);
  EXPECT_TRUE(all_close(r.gw.to_f32(), ref.gw, rel, tiny))
      << "g_w " << L << "x" << O << "x" << I << " rank " << cfg.rank << " " << hot::rounding_name(cfg.rounding)
      << " in " << hot::dtype_name(in_dt) << " out " << hot::dtype_name(out_dt);
  check_bias(r.gb, gy, L, O, out_dt);
  if (pad) {
    EXPECT_TRUE(r.gx.padding_untouched());
    EXPECT_TRUE(r.gw.padding_untouched());
  }
}

TEST(Cpu_BackwardLinear, NearestMatchesReference) {
  for (const Case& c : kCases)
    for (int bits : {4, 8})
      for (ScaleMode sm : {ScaleMode::tensor, ScaleMode::token})
        for (int rank : {1, 8, 16})
          check_against_replica(DType::f32, DType::f32, c, make_cfg(bits, rank, Rounding::nearest, sm), 0);
}

TEST(Cpu_BackwardLinear, StochasticMatchesReference) {
  for (const Case& c : kCases)
    for (int bits : {4, 8})
      for (ScaleMode sm : {ScaleMode::tensor, ScaleMode::token})
        check_against_replica(DType::f32, DType::f32, c, make_cfg(bits, 8, Rounding::stochastic, sm), 0x5eed + c.L);
}

TEST(Cpu_BackwardLinear, StridedViews) {
  check_against_replica(DType::f32, DType::f32, {37, 24, 20}, make_cfg(4, 8, Rounding::stochastic, ScaleMode::tensor), 9, 5);
  check_against_replica(DType::bf16, DType::f16, {40, 32, 12}, make_cfg(8, 4, Rounding::nearest, ScaleMode::token), 9, 3);
}

TEST(Cpu_BackwardLinear, HalfPrecisionInputsAndOutputs) {
  for (DType in_dt : {DType::f32, DType::f16, DType::bf16})
    for (DType out_dt : {DType::f32, DType::f16, DType::bf16})
      check_against_replica(in_dt, out_dt, {48, 40, 24}, make_cfg(4, 8, Rounding::stochastic, ScaleMode::tensor), 77);
}

TEST(Cpu_BackwardLinear, BlockSizeFollowsO) {
  EXPECT_EQ(hot::hq_block_size(32), 16);
  EXPECT_EQ(hot::hq_block_size(24), 8);
  EXPECT_EQ(hot::hq_block_size(20), 4);
  EXPECT_EQ(hot::hq_block_size(18), 2);
  EXPECT_EQ(hot::hq_block_size(17), 1);
  // b = 1 (no transform) for O = 17: with an 8-bit per-tensor quantiser whose scale is set by an
  // exactly representable grid, g_x is exact. Values on the grid k/127 with amax 1.
  const int64_t L = 4, O = 17, I = 3;
  std::vector<float> gy(L * O), w(O * I);
  const auto a = randint(gy.size(), 1, -127, 127), b = randint(w.size(), 2, -127, 127);
  for (size_t i = 0; i < gy.size(); ++i) gy[i] = static_cast<float>(a[i]);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(b[i]);
  gy[0] = 127;
  w[0] = 127;  // amax = 127 -> inv = scale = 1: quantisation is the identity
  const BwdRun r = run_backward(DType::f32, DType::f32, gy, w, {}, L, O, I, make_cfg(8, 8, Rounding::nearest, ScaleMode::tensor),
                             0, true, false, false);
  const std::vector<double> exact = matmul64(to64(gy), L, O, false, to64(w), I, false);
  const std::vector<float> got = r.gx.to_f32();
  for (size_t i = 0; i < exact.size(); ++i) EXPECT_EQ(got[i], exact[i]) << i;
}

// Relative Frobenius errors against the exact gradients.
TEST(Cpu_BackwardLinear, CloseToExactGradient) {
  const int64_t L = 256, O = 64, I = 96;
  const std::vector<float> gy = randn(static_cast<size_t>(L * O), 1, 0.01f);
  const std::vector<float> w = randn(static_cast<size_t>(O * I), 2, 0.05f);
  const std::vector<float> x = randn(static_cast<size_t>(L * I), 3, 1.0f);
  const std::vector<double> gx_exact = matmul64(to64(gy), L, O, false, to64(w), I, false);
  const std::vector<double> gw_exact = matmul64(to64(gy), O, L, true, to64(x), I, false);
  for (Rounding rd : {Rounding::nearest, Rounding::stochastic}) {
    // 8-bit g_x, rank 16 (full rank): only 8-bit quantisation error (~1% per operand)
    {
      const Config cfg = make_cfg(8, 16, rd, ScaleMode::tensor);
      const BwdRun r = run_backward(DType::f32, DType::f32, gy, w, x, L, O, I, cfg, 11);
      const double egx = rel_frob_err(r.gx.to_f32(), gx_exact), egw = rel_frob_err(r.gw.to_f32(), gw_exact);
      std::printf("  [%s] 8-bit g_x rel. Frobenius error %.4f, rank-16 g_w %.4f\n", hot::rounding_name(rd), egx, egw);
      EXPECT_LT(egx, 0.05) << hot::rounding_name(rd);
      EXPECT_LT(egw, 0.05) << hot::rounding_name(rd);
    }
    // 4-bit g_x: bound from the measured operand errors of the same quantisation. For independent
    // errors, ||E||/||G W|| ~ sqrt(e_g^2 + e_w^2 + e_g^2 e_w^2) with e the relative Frobenius error of
    // each quantised (transformed) operand; allow 1.5x (stochastic rounding doubles the variance).
    {
      const Config cfg = make_cfg(4, 8, rd, ScaleMode::tensor);
      const BwdRun r = run_backward(DType::f32, DType::f32, gy, w, x, L, O, I, cfg, 12);
      const RefBackward ref = ref_backward(gy, w, x, L, O, I, cfg, 12);
      auto op_err = [](const std::vector<float>& v, const RefQuant& q) {
        double e = 0, n = 0;
        for (size_t i = 0; i < v.size(); ++i) {
          const double s = q.scale.size() == 1 ? q.scale[0] : q.scale[i / (v.size() / q.scale.size())];
          e += (q.q[i] * s - v[i]) * (q.q[i] * s - v[i]);
          n += static_cast<double>(v[i]) * v[i];
        }
        return std::sqrt(e / n);
      };
      const double eg = op_err(hadamard_f32(gy, L, O, ref.block, 1), ref.qg);
      const double ew = op_err(hadamard_f32(w, O, I, ref.block, 0), ref.qw);
      const double bound = 1.5 * std::sqrt(eg * eg + ew * ew + eg * eg * ew * ew);
      const double egx = rel_frob_err(r.gx.to_f32(), gx_exact);
      std::printf("  [%s] 4-bit g_x rel. Frobenius error %.4f (bound %.4f from e_g %.4f, e_w %.4f)\n",
                  hot::rounding_name(rd), egx, bound, eg, ew);
      EXPECT_LT(egx, bound) << hot::rounding_name(rd) << " e_g " << eg << " e_w " << ew;
      EXPECT_LT(egx, 0.5);
      // g_w at rank 8 approximates g_yᵀ P x (P the HLA projector), up to 8-bit quantisation
      const std::vector<double> gh = hla_f64(gy, L, O, 8), xh = hla_f64(x, L, I, 8);
      std::vector<double> proj = matmul64(gh, O, hot::hla_rows(L, 8), true, xh, I, false);
      for (double& p : proj) p /= 16.0;
      EXPECT_LT(rel_frob_err(r.gw.to_f32(), proj), 0.05) << hot::rounding_name(rd);
    }
  }
}

TEST(Cpu_BackwardLinear, PerTokenScaleHelpsUnevenRows) {
  // Rows of g_y with magnitudes spread over 4 decades: per-token scales must beat per-tensor (LQS, §7).
  const int64_t L = 64, O = 32, I = 16;
  std::vector<float> gy = randn(static_cast<size_t>(L * O), 5);
  for (int64_t l = 0; l < L; ++l)
    for (int64_t o = 0; o < O; ++o) gy[l * O + o] *= std::pow(10.0f, -4.0f * l / L);
  const std::vector<float> w = randn(static_cast<size_t>(O * I), 6);
  const std::vector<double> exact = matmul64(to64(gy), L, O, false, to64(w), I, false);
  const BwdRun tok = run_backward(DType::f32, DType::f32, gy, w, {}, L, O, I, make_cfg(4, 8, Rounding::nearest, ScaleMode::token),
                               1, true, false, false);
  const BwdRun ten = run_backward(DType::f32, DType::f32, gy, w, {}, L, O, I, make_cfg(4, 8, Rounding::nearest, ScaleMode::tensor),
                               1, true, false, false);
  // relative error per row, averaged: per tensor loses the small rows entirely
  auto mean_row_err = [&](const std::vector<float>& got) {
    double acc = 0;
    for (int64_t l = 0; l < L; ++l) {
      double e = 0, n = 0;
      for (int64_t i = 0; i < I; ++i) {
        e += (got[l * I + i] - exact[l * I + i]) * (got[l * I + i] - exact[l * I + i]);
        n += exact[l * I + i] * exact[l * I + i];
      }
      acc += std::sqrt(e / n);
    }
    return acc / L;
  };
  const double et = mean_row_err(tok.gx.to_f32()), en = mean_row_err(ten.gx.to_f32());
  EXPECT_LT(et, 0.5);
  std::printf("  mean per-row rel. error of g_x: token %.4f, tensor %.4f\n", et, en);
  EXPECT_LT(et, 0.5 * en) << "token " << et << " tensor " << en;
}

TEST(Cpu_BackwardLinear, RequestFlagsGiveSameBitsAsFullRun) {
  const Case c{40, 24, 20};
  const std::vector<float> gy = randn(static_cast<size_t>(c.L * c.O), 1, 0.1f);
  const std::vector<float> w = randn(static_cast<size_t>(c.O * c.I), 2);
  const std::vector<float> x = randn(static_cast<size_t>(c.L * c.I), 3);
  const Config cfg = make_cfg(4, 8, Rounding::stochastic, ScaleMode::tensor);
  const BwdRun full = run_backward(DType::f32, DType::f32, gy, w, x, c.L, c.O, c.I, cfg, 99);
  const BwdRun only_gx = run_backward(DType::f32, DType::f32, gy, w, x, c.L, c.O, c.I, cfg, 99, true, false, false);
  const BwdRun only_gw = run_backward(DType::f32, DType::f32, gy, w, x, c.L, c.O, c.I, cfg, 99, false, true, false);
  const BwdRun only_gb = run_backward(DType::f32, DType::f32, gy, w, x, c.L, c.O, c.I, cfg, 99, false, false, true);
  EXPECT_TRUE(bits_equal(full.gx, only_gx.gx));
  EXPECT_TRUE(bits_equal(full.gw, only_gw.gw));
  EXPECT_TRUE(bits_equal(full.gb, only_gb.gb));
  // nothing requested: a no-op that must not throw
  hot::BackwardOutputs none;
  EXPECT_NO_THROW(hot::backward_linear(host_from(DType::f32, c.L, c.O, gy), host_from(DType::f32, c.O, c.I, w), nullptr,
                                       cfg, 1, none));
}

TEST(Cpu_BackwardLinear, BiasGradient) {
  // integer-valued g_y: every fp32 partial sum is exact, so g_b is exact whatever the order
  const int64_t L = 300, O = 37, I = 4;
  std::vector<float> gy(static_cast<size_t>(L * O));
  const auto a = randint(gy.size(), 8, -1000, 1000);
  for (size_t i = 0; i < gy.size(); ++i) gy[i] = static_cast<float>(a[i]);
  const std::vector<float> w = randn(static_cast<size_t>(O * I), 9);
  const Config cfg = make_cfg(4, 8, Rounding::nearest, ScaleMode::tensor);
  const BwdRun r = run_backward(DType::f32, DType::f32, gy, w, {}, L, O, I, cfg, 0, false, false, true);
  for (int64_t o = 0; o < O; ++o) {
    int64_t s = 0;
    for (int64_t l = 0; l < L; ++l) s += a[l * O + o];
    EXPECT_EQ(r.gb.getf(o), static_cast<float>(s)) << o;
  }
  // random g_y: within the fp32 summation bound, for every output dtype
  const std::vector<float> g2 = randn(static_cast<size_t>(L * O), 10);
  for (DType out_dt : {DType::f32, DType::f16, DType::bf16}) {
    const BwdRun r2 = run_backward(DType::f32, out_dt, g2, w, {}, L, O, I, cfg, 0, false, false, true);
    check_bias(r2.gb, g2, L, O, out_dt);
  }
}

TEST(Cpu_BackwardLinear, IdenticalBitsAcrossThreadCounts) {
  ThreadGuard guard;
  // large enough that every parallel loop of the CPU backend (amax, HLA blocks, rows) splits in chunks
  const Case c{2061, 96, 80};
  const std::vector<float> gy = randn(static_cast<size_t>(c.L * c.O), 1, 0.1f);
  const std::vector<float> w = randn(static_cast<size_t>(c.O * c.I), 2);
  const std::vector<float> x = randn(static_cast<size_t>(c.L * c.I), 3);
  for (ScaleMode sm : {ScaleMode::tensor, ScaleMode::token}) {
    const Config cfg = make_cfg(4, 8, Rounding::stochastic, sm);
    std::vector<BwdRun> runs;
    for (int nt : {1, 2, 3}) {
      hot::set_num_threads(nt);
      runs.push_back(run_backward(DType::f32, DType::f32, gy, w, x, c.L, c.O, c.I, cfg, 4242));
    }
    const RefBackward ref = ref_backward(gy, w, x, c.L, c.O, c.I, cfg, 4242);
    EXPECT_TRUE(all_close(runs[0].gx.to_f32(), ref.gx, epilogue_rel(DType::f32), 1e-30));
    EXPECT_TRUE(all_close(runs[0].gw.to_f32(), ref.gw, epilogue_rel(DType::f32), 1e-30));
    for (int k = 1; k < 3; ++k) {
      EXPECT_TRUE(bits_equal(runs[0].gx, runs[k].gx)) << "g_x threads " << k + 1;
      EXPECT_TRUE(bits_equal(runs[0].gw, runs[k].gw)) << "g_w threads " << k + 1;
      EXPECT_TRUE(bits_equal(runs[0].gb, runs[k].gb)) << "g_b threads " << k + 1;
    }
  }
  // exact mode too
  std::vector<HostTensor> ex;
  const HostTensor gyt = host_from(DType::f32, c.L, c.O, gy), wt = host_from(DType::f32, c.O, c.I, w),
                   xt = host_from(DType::f32, c.L, c.I, x);
  const TensorView xv = xt.view();
  for (int nt : {1, 2, 3}) {
    hot::set_num_threads(nt);
    HostTensor gx = HostTensor::make2d(DType::f32, c.L, c.I), gw = HostTensor::make2d(DType::f32, c.O, c.I);
    hot::backward_linear_exact(gyt, wt, &xv, {gx.view(), gw.view(), TensorView()});
    ex.push_back(std::move(gx));
    ex.push_back(std::move(gw));
  }
  for (int k = 1; k < 3; ++k) {
    EXPECT_TRUE(bits_equal(ex[0], ex[2 * k])) << "exact g_x threads " << k + 1;
    EXPECT_TRUE(bits_equal(ex[1], ex[2 * k + 1])) << "exact g_w threads " << k + 1;
  }
}

TEST(Cpu_BackwardLinear, StochasticBackwardIsUnbiased) {
  // Over seeds, E[g_x] = G~ (s_w q_w) / b and E[g_w] = Ĝᵀ (s_x q_x) / 16: only the g_y operands are
  // stochastically rounded, their scales do not depend on the seed. Per element, the mean of N runs has
  // sd <= sqrt(sum_k (s/2)^2 c_k^2) / sqrt(N), c_k the deterministic coefficients; bound 6 sd + 1e-5 rel.
  const int64_t L = 40, O = 24, I = 12;
  const int N = 400;
  const std::vector<float> gy = randn(static_cast<size_t>(L * O), 31, 0.1f);
  const std::vector<float> w = randn(static_cast<size_t>(O * I), 32);
  const std::vector<float> x = randn(static_cast<size_t>(L * I), 33);
  const Config cfg = make_cfg(4, 8, Rounding::stochastic, ScaleMode::tensor);
  std::vector<double> sum_gx(static_cast<size_t>(L * I), 0.0), sum_gw(static_cast<size_t>(O * I), 0.0);
  for (int k = 0; k < N; ++k) {
    const BwdRun r = run_backward(DType::f32, DType::f32, gy, w, x, L, O, I, cfg, 1000 + k, true, true, false);
    const std::vector<float> a = r.gx.to_f32(), b = r.gw.to_f32();
    for (size_t i = 0; i < a.size(); ++i) sum_gx[i] += a[i];
    for (size_t i = 0; i < b.size(); ++i) sum_gw[i] += b[i];
  }
  const RefBackward ref = ref_backward(gy, w, x, L, O, I, cfg, 1);  // for the deterministic operands and scales
  const int b = ref.block;
  const std::vector<float> gt = hadamard_f32(gy, L, O, b, 1);
  const double sg = ref.qg.scale[0], sw = ref.qw.scale[0];
  for (int64_t l = 0; l < L; ++l)
    for (int64_t i = 0; i < I; ++i) {
      double e = 0, var = 0;
      for (int64_t o = 0; o < O; ++o) {
        const double c = sw * ref.qw.q[o * I + i] / b;
        e += gt[l * O + o] * c;
        var += 0.25 * sg * sg * c * c;
      }
      ASSERT_NEAR(sum_gx[l * I + i] / N, e, 6 * std::sqrt(var / N) + 1e-5 * std::fabs(e)) << "g_x " << l << "," << i;
    }
  const int64_t K = hot::hla_rows(L, cfg.rank);
  const std::vector<float> gh = hla_f32(gy, L, O, cfg.rank);
  const double sgh = ref.qgh.scale[0], sx = ref.qx.scale[0];
  for (int64_t o = 0; o < O; ++o)
    for (int64_t i = 0; i < I; ++i) {
      double e = 0, var = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double c = sx * ref.qx.q[k * I + i] / 16.0;
        e += gh[k * O + o] * c;
        var += 0.25 * sgh * sgh * c * c;
      }
      ASSERT_NEAR(sum_gw[o * I + i] / N, e, 6 * std::sqrt(var / N) + 1e-5 * std::fabs(e)) << "g_w " << o << "," << i;
    }
}

TEST(Cpu_BackwardLinear, SeedDeterminesBits) {
  const Case c{64, 32, 16};
  const std::vector<float> gy = randn(static_cast<size_t>(c.L * c.O), 1);
  const std::vector<float> w = randn(static_cast<size_t>(c.O * c.I), 2);
  const std::vector<float> x = randn(static_cast<size_t>(c.L * c.I), 3);
  const Config cfg = make_cfg(4, 8, Rounding::stochastic, ScaleMode::tensor);
  const BwdRun a = run_backward(DType::f32, DType::f32, gy, w, x, c.L, c.O, c.I, cfg, 1);
  const BwdRun b = run_backward(DType::f32, DType::f32, gy, w, x, c.L, c.O, c.I, cfg, 1);
  const BwdRun d = run_backward(DType::f32, DType::f32, gy, w, x, c.L, c.O, c.I, cfg, 2);
  EXPECT_TRUE(bits_equal(a.gx, b.gx));
  EXPECT_TRUE(bits_equal(a.gw, b.gw));
  EXPECT_FALSE(bits_equal(a.gx, d.gx));
  EXPECT_FALSE(bits_equal(a.gw, d.gw));
  EXPECT_TRUE(bits_equal(a.gb, d.gb));  // the bias does not depend on the seed
  // nearest rounding ignores the seed
  const Config nc = make_cfg(4, 8, Rounding::nearest, ScaleMode::tensor);
  const BwdRun n1 = run_backward(DType::f32, DType::f32, gy, w, x, c.L, c.O, c.I, nc, 1);
  const BwdRun n2 = run_backward(DType::f32, DType::f32, gy, w, x, c.L, c.O, c.I, nc, 2);
  EXPECT_TRUE(bits_equal(n1.gx, n2.gx));
  EXPECT_TRUE(bits_equal(n1.gw, n2.gw));
}

// hot::Seed with a tensor (a seed in the call's device memory, read when the work runs): the bits of the integer seed
// value + *tensor (mod 2^64); a bad seed tensor is refused with a named error.
TEST(Cpu_BackwardLinear, SeedTensorAddsToValue) {
  const Case c{70, 24, 20};
  const std::vector<float> gy = randn(static_cast<size_t>(c.L * c.O), 4);
  const std::vector<float> w = randn(static_cast<size_t>(c.O * c.I), 5);
  const std::vector<float> x = randn(static_cast<size_t>(c.L * c.I), 6);
  const Config cfg = make_cfg(4, 8, Rounding::stochastic, ScaleMode::tensor);
  const uint64_t full = 0xC0FFEE1234567ull;
  const BwdRun ref = run_backward(DType::f32, DType::f32, gy, w, x, c.L, c.O, c.I, cfg, full);
  int64_t stored = static_cast<int64_t>(full + 977);  // value = -977 (mod 2^64)
  const TensorView st = hot::make_view(&stored, DType::s64, hot::Device::cpu(), {});
  const HostTensor gyt = host_from(DType::f32, c.L, c.O, gy), wt = host_from(DType::f32, c.O, c.I, w);
  const hot::SavedActivation saved = hot::compress_activation(host_from(DType::f32, c.L, c.I, x), cfg.rank);
  BwdRun r;
  r.gx = HostTensor::make2d(DType::f32, c.L, c.I);
  r.gw = HostTensor::make2d(DType::f32, c.O, c.I);
  r.gb = HostTensor::make1d(DType::f32, c.O);
  hot::BackwardOutputs out;
  out.grad_input = r.gx.view();
  out.grad_weight = r.gw.view();
  out.grad_bias = r.gb.view();
  hot::backward_linear(gyt, wt, &saved, cfg, hot::Seed(~uint64_t{976}, st), out);  // ~976 = -977
  EXPECT_TRUE(bits_equal(ref.gx, r.gx));
  EXPECT_TRUE(bits_equal(ref.gw, r.gw));
  EXPECT_TRUE(bits_equal(ref.gb, r.gb));
  // the seed's value alone gives other bits
  const BwdRun other = run_backward(DType::f32, DType::f32, gy, w, x, c.L, c.O, c.I, cfg, ~uint64_t{976});
  EXPECT_FALSE(bits_equal(other.gx, r.gx));

  int32_t narrow = 1;
  int64_t two[2] = {1, 2};
  const hot::Seed bad_dtype(0, hot::make_view(&narrow, DType::s32, hot::Device::cpu(), {1}));
  const hot::Seed bad_size(0, hot::make_view(two, DType::s64, hot::Device::cpu(), {2}));
  const auto expect_refused = [&](const hot::Seed& bad, const std::string& message) {
    try {
      hot::backward_linear(gyt, wt, &saved, cfg, bad, out);
      ADD_FAILURE() << "no error for: " << message;
    } catch (const hot::Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  };
  expect_refused(bad_dtype, "seed tensor has dtype int32, expected int64");
  expect_refused(bad_size, "seed tensor has shape (2,), expected one element");
}

TEST(Cpu_BackwardLinear, NonFiniteGradOutputPropagates) {
  const Case c{32, 16, 8};
  for (float sp : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::vector<float> gy = randn(static_cast<size_t>(c.L * c.O), 1);
    gy[5 * c.O + 3] = sp;
    const std::vector<float> w = randn(static_cast<size_t>(c.O * c.I), 2);
    const std::vector<float> x = randn(static_cast<size_t>(c.L * c.I), 3);
    const BwdRun r = run_backward(DType::f32, DType::f32, gy, w, x, c.L, c.O, c.I,
                               make_cfg(4, 8, Rounding::stochastic, ScaleMode::tensor), 1);
    for (float v : r.gx.to_f32()) ASSERT_FALSE(std::isfinite(v));
    for (float v : r.gw.to_f32()) ASSERT_FALSE(std::isfinite(v));
    EXPECT_FALSE(std::isfinite(r.gb.getf(3)));
    EXPECT_TRUE(std::isfinite(r.gb.getf(4)));
    // per token: only row 5 of g_x is non-finite
    const BwdRun t = run_backward(DType::f32, DType::f32, gy, w, x, c.L, c.O, c.I,
                               make_cfg(4, 8, Rounding::nearest, ScaleMode::token), 1, true, false, false);
    for (int64_t l = 0; l < c.L; ++l)
      for (int64_t i = 0; i < c.I; ++i) ASSERT_EQ(std::isfinite(t.gx.getf(l, i)), l != 5) << l << "," << i;
  }
}

TEST(Cpu_BackwardLinear, NonFiniteWeightOrInputPropagates) {
  const Case c{32, 16, 8};
  const std::vector<float> gy = randn(static_cast<size_t>(c.L * c.O), 1);
  std::vector<float> w = randn(static_cast<size_t>(c.O * c.I), 2);
  std::vector<float> x = randn(static_cast<size_t>(c.L * c.I), 3);
  w[7] = std::numeric_limits<float>::infinity();
  x[40] = std::numeric_limits<float>::quiet_NaN();
  const BwdRun r = run_backward(DType::f32, DType::f32, gy, w, x, c.L, c.O, c.I,
                                make_cfg(8, 8, Rounding::nearest, ScaleMode::tensor), 1, true, true, true);
  for (float v : r.gx.to_f32()) ASSERT_FALSE(std::isfinite(v));  // W~ has a NaN scale
  for (float v : r.gw.to_f32()) ASSERT_FALSE(std::isfinite(v));  // the ABC buffer has a NaN scale
  for (float v : r.gb.to_f32()) ASSERT_TRUE(std::isfinite(v));   // g_b only depends on g_y
}

// ---- exact mode ----------------------------------------------------------------------------------

TEST(Cpu_BackwardLinear, ExactModeMatchesFloat64) {
  const Case cases[] = {{33, 17, 9}, {64, 48, 40}, {1, 1, 1}, {200, 3, 70}};
  for (const Case& c : cases)
    for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
      const auto [L, O, I] = c;
      const std::vector<float> gy = rounded(randn(static_cast<size_t>(L * O), L + O, 0.5f), dt);
      const std::vector<float> w = rounded(randn(static_cast<size_t>(O * I), O + I), dt);
      const std::vector<float> x = rounded(randn(static_cast<size_t>(L * I), L + I), dt);
      const HostTensor gyt = host_from(dt, L, O, gy), wt = host_from(dt, O, I, w), xt = host_from(dt, L, I, x, I + 1);
      HostTensor gx = HostTensor::make2d(dt, L, I), gw = HostTensor::make2d(DType::f32, O, I), gb = HostTensor::make1d(dt, O);
      hot::BackwardOutputs out{gx.view(), gw.view(), gb.view()};
      const TensorView xv = xt.view();
      hot::backward_linear_exact(gyt, wt, &xv, out);
      // fp32 accumulation of K products: |err| <= gamma_K (|A||B|), gamma_K = K u / (1 - K u);
      // the products of f16/bf16 inputs are exact in fp32; then one rounding to the output dtype.
      const double u = std::ldexp(1.0, -24);
      auto check = [&](const HostTensor& got, const std::vector<double>& ref, const std::vector<double>& absref, int64_t K,
                       DType odt, const char* what) {
        const double g = K * u / (1 - K * u);
        for (size_t i = 0; i < ref.size(); ++i) {
          const double tol = 1.01 * (g * absref[i] + unit_roundoff(odt) * (std::fabs(ref[i]) + g * absref[i])) + abs_floor(odt);
          const int64_t r = static_cast<int64_t>(i) / got.cols(), cc = static_cast<int64_t>(i) % got.cols();
          ASSERT_NEAR(got.getf(r, cc), ref[i], tol) << what << " " << L << "x" << O << "x" << I << " " << hot::dtype_name(dt);
        }
      };
      check(gx, matmul64(to64(gy), L, O, false, to64(w), I, false),
            matmul64(abs64(to64(gy)), L, O, false, abs64(to64(w)), I, false), O, dt, "g_x");
      check(gw, matmul64(to64(gy), O, L, true, to64(x), I, false),
            matmul64(abs64(to64(gy)), O, L, true, abs64(to64(x)), I, false), L, DType::f32, "g_w");
      check_bias(gb, gy, L, O, dt);
    }
}

TEST(Cpu_BackwardLinear, ExactModeRequestFlags) {
  const int64_t L = 20, O = 8, I = 6;
  const std::vector<float> gy = randn(L * O, 1), w = randn(O * I, 2), x = randn(L * I, 3);
  const HostTensor gyt = host_from(DType::f32, L, O, gy), wt = host_from(DType::f32, O, I, w), xt = host_from(DType::f32, L, I, x);
  HostTensor gx = HostTensor::make2d(DType::f32, L, I);
  hot::BackwardOutputs only_gx;
  only_gx.grad_input = gx.view();
  EXPECT_NO_THROW(hot::backward_linear_exact(gyt, wt, nullptr, only_gx));  // no x needed for g_x
  const std::vector<double> ref = matmul64(to64(gy), L, O, false, to64(w), I, false);
  EXPECT_TRUE(all_close(gx.to_f32(), ref, 1e-5, 1e-6));
  HostTensor gw = HostTensor::make2d(DType::f32, O, I);
  hot::BackwardOutputs only_gw;
  only_gw.grad_weight = gw.view();
  const TensorView xv = xt.view();
  hot::backward_linear_exact(gyt, wt, &xv, only_gw);
  EXPECT_TRUE(all_close(gw.to_f32(), matmul64(to64(gy), O, L, true, to64(x), I, false), 1e-5, 1e-6));
}

}  // namespace

namespace {

// W~ formed once by quantize_weight and passed as weight_q gives the bits of a call that forms it itself: the same
// round-to-nearest quantisation (SPEC §3), for the ABC and the raw-x overloads and for a chunked call.
void check_weight_q_same_bits(int64_t L, const Config& cfg, DType dt) {
  const int64_t O = 40, I = 24;
  const std::vector<float> gy = randn(static_cast<size_t>(L * O), 11, 0.1f);
  const std::vector<float> w = randn(static_cast<size_t>(O * I), 12);
  const std::vector<float> x = randn(static_cast<size_t>(L * I), 13);
  const HostTensor g = host_from(dt, L, O, gy), wt = host_from(dt, O, I, w), xt = host_from(dt, L, I, x);
  const hot::QuantizedWeight wq = hot::quantize_weight(wt, cfg.gx_bits);
  EXPECT_EQ(wq.out_features, O);
  EXPECT_EQ(wq.in_features, I);
  EXPECT_EQ(wq.gx_bits, cfg.gx_bits);
  EXPECT_EQ(wq.nbytes(), static_cast<size_t>(I * hot::padded_k(O) + 4));
  const hot::SavedActivation saved = hot::compress_activation(xt, cfg.rank);
  for (int raw = 0; raw < 2; ++raw) {
    HostTensor gx[2], gw[2], gb[2];
    for (int use = 0; use < 2; ++use) {
      gx[use] = HostTensor::make2d(dt, L, I);
      gw[use] = HostTensor::make2d(dt, O, I);
      gb[use] = HostTensor::make1d(dt, O);
      hot::BackwardOutputs out{gx[use].view(), gw[use].view(), gb[use].view()};
      const hot::QuantizedWeight* q = use ? &wq : nullptr;
      if (raw) hot::backward_linear(g, wt, xt.view(), cfg, 7, out, {}, q);
      else hot::backward_linear(g, wt, &saved, cfg, 7, out, {}, q);
    }
    EXPECT_TRUE(bits_equal(gx[0], gx[1])) << "raw " << raw;
    EXPECT_TRUE(bits_equal(gw[0], gw[1])) << "raw " << raw;
    EXPECT_TRUE(bits_equal(gb[0], gb[1])) << "raw " << raw;
  }
}

}  // namespace

TEST(Cpu_BackwardLinear, KeptQuantizedWeightGivesSameBits) {
  check_weight_q_same_bits(70, make_cfg(8, 16, Rounding::stochastic, ScaleMode::tensor), DType::f32);
  check_weight_q_same_bits(70, make_cfg(4, 8, Rounding::nearest, ScaleMode::token), DType::bf16);
  check_weight_q_same_bits(hot::kMaxInt32K + 40, make_cfg(8, 16, Rounding::stochastic, ScaleMode::tensor),
                           DType::f32);  // a g_w contraction past one int32 GEMM
}

TEST(Cpu_BackwardLinear, KeptQuantizedWeightIsChecked) {
  const int64_t L = 32, O = 40, I = 24;
  const HostTensor g = host_from(DType::f32, L, O, randn(L * O, 1)), wt = host_from(DType::f32, O, I, randn(O * I, 2));
  const HostTensor x = host_from(DType::f32, L, I, randn(L * I, 3));
  HostTensor gx = HostTensor::make2d(DType::f32, L, I), gw = HostTensor::make2d(DType::f32, O, I);
  const hot::BackwardOutputs out{gx.view(), gw.view(), {}};
  const Config c8 = make_cfg(8, 16, Rounding::nearest, ScaleMode::tensor);
  const hot::QuantizedWeight w4 = hot::quantize_weight(wt, 4);
  EXPECT_TRUE(hot_test::throws_hot([&] { hot::backward_linear(g, wt, x.view(), c8, 1, out, {}, &w4); },
                                   hot::ErrorKind::value, {"backward_linear", "weight_q", "4 bits", "gx_bits is 8"}));
  const HostTensor other = host_from(DType::f32, I, O, randn(O * I, 4));  // I x O: the transposed shape
  const hot::QuantizedWeight wt_other = hot::quantize_weight(other, 8);
  EXPECT_TRUE(hot_test::throws_hot([&] { hot::backward_linear(g, wt, x.view(), c8, 1, out, {}, &wt_other); },
                                   hot::ErrorKind::value, {"weight_q", "24 x 40", "40 x 24"}));
  EXPECT_TRUE(hot_test::throws_hot([&] { hot::quantize_weight(wt, 5); }, hot::ErrorKind::value,
                                   {"quantize_weight", "5"}));
  const HostTensor s8 = HostTensor::make2d(DType::s8, O, I);
  EXPECT_TRUE(hot_test::throws_hot([&] { hot::quantize_weight(s8, 8); }, hot::ErrorKind::type,
                                   {"quantize_weight", "weight"}));
}
