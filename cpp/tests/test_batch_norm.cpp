// BatchNorm's backward on the CPU backend. batch_norm_backward_reduce: the per-channel sums against float64 (within the
// error bound of ops.h's order of fp32 adds), grad_weight = sum_dy_xmu * invstd rounded once.
// batch_norm_backward_input: g_x against a float64 evaluation of BatchNorm's input gradient (within the fp32 steps' and
// the final rounding's error), and its G~ amax equal, bit for bit, to the amax that quantize_grad_output's g_x path
// finds in that g_x (its per-tensor scale). The argument checks of both.
#include "test_util.h"

#include <cmath>
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

}  // namespace

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
