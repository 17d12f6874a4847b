// The CUDA kernels of the building-block operations (basic_kernels.cuh: Hadamard transform, HLA projection,
// quantise, dequantise, int4 pack/unpack, col2im, the ReLU mask, bias gradient), run on the CPU by the host emulation (cuda_emu.h) and
// compared byte for byte with the CPU backend; outputs start poisoned, so unwritten or overwritten bytes (row
// padding included) show. The shapes follow the Cuda_* suites, smaller where those are large. Compiled into
// hot_emu_tests (AddressSanitizer) and hot_emu_race_tests (ThreadSanitizer, fewer cases).
#include "emu/cuda_emu.h"  // first: it includes the CUDA headers in emulation mode

#include "cuda/basic_kernels.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda/cuda_test_util.h"

namespace {

using hot::DType;
using hot::Rounding;
using hot::ScaleMode;
using hot_cuda_test::all_bytes_equal;
using hot_cuda_test::out1d;
using hot_cuda_test::out2d;
using hot_cuda_test::rand_float;
using hot_cuda_test::rand_int;
using hot_test::HostTensor;

#if defined(HOT_EMU_RACE)
const DType kDtypes[] = {DType::bf16};
#else
const DType kDtypes[] = {DType::f32, DType::bf16, DType::f16};
#endif

// Runs f(T{}, launcher) for the float dtype dt.
template <typename F>
void with_type(DType dt, F&& f) {
  hot::cuda::dispatch_float(dt, "emu", [&](auto t) { f(t, hot_emu::Launch{}); });
}

// The kernels' rounding (fwht.cuh: an fp32 add of 1.5 * 2^23 in the rule's rounding direction, the code in the low
// byte) against hot/quant_rules.h's rules, for the inputs the kernels pass them (inv from the amax of values that
// include v, so |v| <= amax): the amax itself and its neighbours (where v * inv may round past qmax, so the stochastic
// clamp is needed at u = 0 and u = 1 - 2^-16), ties of round-to-nearest, tiny amax (the 2^64 pre-scale) and random v.
TEST(Emu_QuantRules, KernelRoundingEqualsRules) {
  std::vector<float> amaxes = {1e-38f, 3e-37f, 1e-20f, 0.37f, 1.0f, 7.0f, 127.0f, 254.0f, 2032.0f, 3.3e5f, 1e30f};
  const std::vector<float> r = hot_test::randn(64, 4242);
  for (float x : r) amaxes.push_back(std::ldexp(std::fabs(x) + 0.01f, static_cast<int>(x * 20.0f)));
  const std::vector<float> us = {0.0f, 1.0f / 65536, 0.5f, 32767.0f / 65536, 65535.0f / 65536};
  const std::vector<float> w = hot_test::randn(200, 4343);
  int64_t checked = 0;
  for (const int qmax : {7, 127})
    for (const float amax : amaxes) {
      const hot::QuantScale qs = hot::quant_scale_from_amax(amax, qmax);
      ASSERT_NE(qs.inv, 0.0f);
      std::vector<float> vs = {amax, std::nextafter(amax, 0.0f), amax * 0.5f, 0.0f};
      for (int k = 0; k <= 2 * qmax; ++k) vs.push_back(amax * (k + 0.5f) / (2 * qmax + 1));  // near ties
      for (float x : w) vs.push_back(amax * std::tanh(x));
      for (const float v0 : vs)
        for (const float v : {v0, -v0}) {
          SCOPED_TRACE(testing::Message() << "qmax " << qmax << " amax " << amax << " v " << v);
          ASSERT_EQ(hot::cuda::q_nearest(v, qs.inv, qs.pre), hot::quantize_nearest(v, qs, qmax));
          for (const float u : us) {
            const auto code = static_cast<int8_t>(
                hot::cuda::q_stochastic_bits(v, qs.inv, qs.pre, static_cast<float>(qmax), u) & 0xffu);
            ASSERT_EQ(code, hot::quantize_stochastic(v, qs, qmax, u)) << "u " << u;
          }
          ++checked;
        }
    }
  EXPECT_GT(checked, 10000);
}

TEST(Emu_Hadamard, BitExactVsCpu) {
  const std::vector<std::tuple<int64_t, int64_t, int>> cases = {
      {1, 1, 1}, {3, 16, 16}, {32, 5, 16}, {7, 256, 256}, {256, 3, 256}, {64, 96, 32}, {130, 24, 8}, {33, 50, 2}};
  uint64_t seed = 1;
  for (DType dt : kDtypes)
    for (auto [R, C, block] : cases)
      for (int axis : {0, 1}) {
        if ((axis == 0 ? R : C) % block != 0) continue;
        SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " " << R << "x" << C << " block " << block << " axis "
                                        << axis);
        HostTensor in = rand_float(dt, R, C, seed++, C + 3);
        HostTensor oc = out2d(DType::f32, R, C, C + 1), oe = oc;
        hot::cpu::hadamard_transform(in, oc, block, axis, {});
        with_type(dt, [&](auto t, auto launch) {
          hot::cuda::hadamard_launch<decltype(t)>(in.view(), oe.view(), block, axis, launch);
        });
        EXPECT_TRUE(all_bytes_equal(oc, oe));
      }
}

TEST(Emu_Hla, BitExactVsCpu) {
  uint64_t seed = 100;
  for (DType dt : kDtypes)
    for (int64_t L : {1, 15, 17, 333})
      for (int64_t C : {1, 7, 64})
        for (int rank : {1, 8, 16}) {
          SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " L " << L << " C " << C << " rank " << rank);
          HostTensor in = rand_float(dt, L, C, seed++, C + 1);
          const int64_t K = hot::hla_rows(L, rank);
          HostTensor oc = out2d(DType::f32, K, C, C + 2), oe = oc;
          hot::cpu::hla_project(in, oc, rank, {});
          with_type(dt, [&](auto t, auto launch) { hot::cuda::hla_launch<decltype(t)>(in.view(), oe.view(), rank, launch); });
          EXPECT_TRUE(all_bytes_equal(oc, oe));
        }
}

// quantize through the emulated kernels; the scratch starts as garbage.
void emu_quantize(const HostTensor& in, HostTensor& q, HostTensor& s, const hot::QuantizeParams& p) {
  std::vector<uint32_t> scratch(hot::cuda::quantize_scratch_bytes(in.view(), p) / 4 + 1, 0xdeadbeefu);
  with_type(in.dtype(), [&](auto t, auto launch) {
    hot::cuda::quantize_launch<decltype(t)>(in.view(), q.view(), s.view(), p, scratch.data(), launch);
  });
}

TEST(Emu_Quantize, BitExactVsCpu) {
#if defined(HOT_EMU_RACE)
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{37, 53}, {5, 1031}};
#else
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 1}, {3, 1}, {37, 53}, {300, 129}, {5, 1031}};
#endif
  hot_cuda_test::for_each_quantize_case(
      {std::begin(kDtypes), std::end(kDtypes)}, shapes, [&](const HostTensor& in, const hot::QuantizeParams& p) {
        const int64_t R = in.rows(), C = in.cols();
        const int64_t ns = p.scale == ScaleMode::tensor ? 1 : R;
        HostTensor qc = out2d(DType::s8, R, C, C + 5), qe = qc, sc = out1d(DType::f32, ns), se = sc;
        hot::cpu::quantize(in, qc, sc, p, nullptr, {});
        emu_quantize(in, qe, se, p);
        EXPECT_TRUE(all_bytes_equal(qc, qe));
        EXPECT_TRUE(all_bytes_equal(sc, se));
      });
}

// Contiguous input and codes with one scale: the flat kernels (8 elements per vector, any n, a partial last group;
// stochastic with C % 8 == 0: 4 rows x 8 columns per thread, rows past a multiple of 4, several row and column calls).
TEST(Emu_Quantize, ContiguousBitExactVsCpu) {
  uint64_t seed = 400;
  for (DType dt : {DType::f32, DType::bf16, DType::f16})  // 2 and 1 vector loads per group
    for (auto [R, C] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {1, 7}, {3, 8}, {37, 53}, {300, 129}, {70, 264}})
      for (hot::Rounding rd : {hot::Rounding::nearest, hot::Rounding::stochastic}) {
        SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " " << R << "x" << C);
        const HostTensor in = hot_cuda_test::rand_float(dt, R, C, seed++, C, 3.0f);
        hot::QuantizeParams p;
        p.bits = 8;
        p.rounding = rd;
        p.seed = 0x9e3779b97f4a7c15ull + seed;
        HostTensor qc = out2d(DType::s8, R, C), qe = qc, sc = out1d(DType::f32, 1), se = sc;
        hot::cpu::quantize(in, qc, sc, p, nullptr, {});
        emu_quantize(in, qe, se, p);
        EXPECT_TRUE(all_bytes_equal(qc, qe));
        EXPECT_TRUE(all_bytes_equal(sc, se));
      }
}

// A known amax (relu_mask's, quantize's `amax`): no amax pass, the bytes of quantize without it; fp32 / 16-bit inputs,
// the flat and element-wise kernels (row padding), both roundings, a NaN.
TEST(Emu_Quantize, KnownAmaxBitExactVsCpu) {
  uint64_t seed = 470;
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (int64_t pad : {0, 3})
      for (hot::Rounding rd : {hot::Rounding::nearest, hot::Rounding::stochastic})
        for (bool nan : {false, true}) {
          SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " pad " << pad << " nan " << nan);
          HostTensor in = hot_cuda_test::rand_float(dt, 37, 56, seed++, 56 + pad, 3.0f);
          if (nan) in.setf(20, 7, std::nanf(""));
          hot::QuantizeParams p;
          p.rounding = rd;
          p.seed = seed;
          HostTensor qc = out2d(DType::s8, 37, 56), qe = qc, sc = out1d(DType::f32, 1), se = sc;
          HostTensor amax = out1d(DType::f32, 1);
          float m = 0.0f;
          for (int64_t r = 0; r < 37; ++r)
            for (int64_t c = 0; c < 56; ++c) m = std::max(m, std::fabs(in.getf(r, c)));  // the NaN skipped
          amax.setf(0, nan ? std::nanf("") : m);
          hot::cpu::quantize(in, qc, sc, p, nullptr, {});
          std::vector<uint32_t> scratch(hot::cuda::quantize_scratch_bytes(in.view(), p) / 4 + 1, 0xdeadbeefu);
          with_type(in.dtype(), [&](auto t, auto launch) {
            hot::cuda::quantize_launch<decltype(t)>(in.view(), qe.view(), se.view(), p, scratch.data(), launch,
                                                    static_cast<const unsigned*>(amax.view().data));
          });
          EXPECT_TRUE(all_bytes_equal(qc, qe));
          EXPECT_TRUE(all_bytes_equal(sc, se));
        }
}

// Non-finite input: a NaN scale for the tensor or for the rows that hold it, the same bytes as the CPU backend.
// Tiny amax (below ~3.7e-37, the pre-scaled path): the same bytes too.
TEST(Emu_Quantize, NonFiniteAndTinyBitExactVsCpu) {
  uint64_t seed = 250;
  for (ScaleMode sm : {ScaleMode::tensor, ScaleMode::token})
    for (Rounding rd : {Rounding::nearest, Rounding::stochastic})
      for (int special : {0, 1}) {
        std::vector<float> v = hot_test::randn(6 * 40, seed++, special == 0 ? 1.0f : 1e-38f);
        if (special == 0) v[2 * 40 + 5] = std::nanf(""), v[4 * 40 + 1] = INFINITY;
        HostTensor in = hot_test::host_from(DType::f32, 6, 40, v);
        hot::QuantizeParams p;
        p.bits = 8;
        p.scale = sm;
        p.rounding = rd;
        p.seed = seed;
        const int64_t ns = sm == ScaleMode::tensor ? 1 : 6;
        HostTensor qc = out2d(DType::s8, 6, 40), qe = qc, sc = out1d(DType::f32, ns), se = sc;
        hot::cpu::quantize(in, qc, sc, p, nullptr, {});
        emu_quantize(in, qe, se, p);
        EXPECT_TRUE(all_bytes_equal(qc, qe)) << "special " << special;
        EXPECT_TRUE(all_bytes_equal(sc, se)) << "special " << special;
        if (special == 0)
          for (int64_t i = 0; i < ns; ++i)
            EXPECT_EQ(std::isnan(se.getf(i)), sm == ScaleMode::tensor || i == 2 || i == 4) << "scale " << i;
      }
}

TEST(Emu_Dequantize, BitExactVsCpu) {
  uint64_t seed = 300;
  for (DType dt : kDtypes)
    for (auto [R, C] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {17, 33}, {300, 257}})
      for (bool per_row : {false, true}) {
        HostTensor q = rand_int(DType::s8, R, C, -127, 127, seed++, C + 1);
        HostTensor s = HostTensor::make1d(DType::f32, per_row ? R : 1);
        const std::vector<float> r = hot_test::randn(static_cast<size_t>(s.cols()), seed++, 0.1f);
        for (int64_t i = 0; i < s.cols(); ++i) s.setf(i, std::fabs(r[i]));
        HostTensor oc = out2d(dt, R, C, C + 2), oe = oc;
        hot::cpu::dequantize(q, s, oc, {});
        with_type(dt, [&](auto t, auto launch) {
          hot::cuda::dequantize_launch<decltype(t)>(q.view(), s.view(), oe.view(), launch);
        });
        EXPECT_TRUE(all_bytes_equal(oc, oe)) << hot::dtype_name(dt) << " " << R << "x" << C << " per_row " << per_row;
      }
}

TEST(Emu_Col2im, BitExactVsCpu) {
  uint64_t seed = 950;
  for (DType dt : kDtypes)
    for (const hot::ConvGeometry& g : hot_cuda_test::col2im_geometries())
      for (int64_t pad : {0, 3}) {  // dense rows (16-byte units where C allows) or row strides (element units)
        const int64_t L = g.N * g.out_h() * g.out_w(), K = g.C * g.kh * g.kw;
        HostTensor cols = rand_float(dt, L, K, seed++, K + pad);
        HostTensor oc = out2d(dt, g.N * g.H * g.W, g.C, g.C + pad), o2 = oc;  // channels-last
        hot::cpu::col2im(cols, g, oc, {});
        with_type(dt, [&](auto t, auto launch) {
          hot::cuda::col2im_launch<decltype(t)>(cols.view(), g, o2.view(), launch);
        });
        EXPECT_TRUE(all_bytes_equal(oc, o2)) << hot::dtype_name(dt) << " case " << seed;
      }
}

TEST(Emu_Im2col, BitExactVsCpu) {
  uint64_t seed = 960;
  for (DType dt : kDtypes)
    for (const hot::ConvGeometry& g : hot_cuda_test::col2im_geometries())
      for (int64_t pad : {0, 1}) {  // map row stride C (wide units where C allows) or C + 1 (element units)
        const int64_t L = g.N * g.out_h() * g.out_w(), K = g.C * g.kh * g.kw;
        HostTensor map = rand_float(dt, g.N * g.H * g.W, g.C, seed++, g.C + pad);
        HostTensor cc = out2d(dt, L, K, K + pad), ce = cc;
        hot::cpu::im2col(map, g, cc, {});
        hot::cuda::im2col_launch(map.view(), g, ce.view(), hot_emu::Launch{});
        EXPECT_TRUE(all_bytes_equal(cc, ce)) << hot::dtype_name(dt) << " case " << seed;
      }
}

TEST(Emu_Transpose, BitExactVsCpu) {
  uint64_t seed = 1300;
  for (DType dt : {DType::f32, DType::bf16, DType::s8})
    for (const hot_test::TransposeCase& c : hot_test::transpose_cases()) {
      HostTensor in = HostTensor::make2d(dt, c.B * (c.R + c.gap), c.S, c.S + c.pad);
      hot_test::fill_random_bytes(in, seed++);
      HostTensor oc = out2d(dt, c.B * (c.S + c.gap), c.R, c.R + c.pad), oe = oc;
      hot::cpu::transpose(hot_test::view3d(in, c.B, c.R, c.gap), hot_test::view3d(oc, c.B, c.S, c.gap), {});
      hot::cuda::transpose_launch(hot_test::view3d(in, c.B, c.R, c.gap), hot_test::view3d(oe, c.B, c.S, c.gap),
                                  hot_emu::Launch{});
      EXPECT_TRUE(all_bytes_equal(oc, oe)) << hot::dtype_name(dt) << " " << c.B << "x" << c.R << "x" << c.S;
    }
}

TEST(Emu_ReluMask, BitExactVsCpu) {
  uint64_t seed = 970;
#if defined(HOT_EMU_RACE)
  const std::vector<int64_t> sizes = {257, 1000};
#else
  const std::vector<int64_t> sizes = hot_test::relu_sizes();
#endif
  for (DType dt : kDtypes)
    for (int64_t n : sizes) {
      SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " n " << n);
      const HostTensor x = hot_test::relu_input(dt, n, seed++);
      HostTensor yc = out1d(dt, n), ye = yc, bc = out1d(DType::s8, (n + 7) / 8), be = bc;
      hot::cpu::relu_mask(x, yc, bc, nullptr, {});
      hot::cuda::relu_mask_launch(x.view(), ye.view(), be.view(), hot_emu::Launch{});
      EXPECT_TRUE(all_bytes_equal(yc, ye));
      EXPECT_TRUE(all_bytes_equal(bc, be));
      HostTensor xi = x, bi = out1d(DType::s8, (n + 7) / 8);  // in place
      hot::cuda::relu_mask_launch(xi.view(), xi.view(), bi.view(), hot_emu::Launch{});
      EXPECT_TRUE(all_bytes_equal(yc, xi));
      EXPECT_TRUE(all_bytes_equal(bc, bi));
      // y's amax (relu_input has a NaN from n = 24 on; its finite part as well): the CPU's, bit for bit where finite
      for (bool finite : {false, true}) {
        HostTensor xa = x;
        for (int64_t i = 0; i < n && finite; ++i)
          if (!std::isfinite(xa.getf(i))) xa.setf(i, 0.25f);
        HostTensor ya = out1d(dt, n), ba = out1d(DType::s8, (n + 7) / 8), ac = out1d(DType::f32, 1), ae = ac;
        ae.setf(0, 3.0f);  // the launch zeroes it
        const hot::TensorView acv = ac.view();
        hot::cpu::relu_mask(xa, ya, ba, &acv, {});
        HostTensor ye = out1d(dt, n), be2 = ba;
        hot::cuda::relu_mask_launch(xa.view(), ye.view(), be2.view(), hot_emu::Launch{},
                                    static_cast<unsigned*>(ae.view().data));
        EXPECT_TRUE(all_bytes_equal(ya, ye));
        if (std::isnan(ac.getf(0)))
          EXPECT_TRUE(std::isnan(ae.getf(0)));
        else
          EXPECT_TRUE(all_bytes_equal(ac, ae)) << ac.getf(0) << " vs " << ae.getf(0);
      }
      const HostTensor gy = hot_test::relu_input(dt, n, seed++);
      HostTensor gc = out1d(dt, n), ge = gc;
      hot::cpu::relu_mask_backward(gy, bc, gc, {});
      hot::cuda::relu_mask_backward_launch(gy.view(), be.view(), ge.view(), hot_emu::Launch{});
      EXPECT_TRUE(all_bytes_equal(gc, ge));
      if (n < 2) continue;
      // Arrays that start one element past a 16-byte boundary take the element-by-element path: the same bits.
      const auto from1 = [](const HostTensor& t) {
        hot::TensorView v = t.view();
        v.data = static_cast<char*>(v.data) + hot::dtype_bits(v.dtype) / 8;
        v.shape[0] -= 1;
        return v;
      };
      HostTensor yu = out1d(dt, n), bu = out1d(DType::s8, (n + 6) / 8), bcu = bu, gu = out1d(dt, n), gcu = gu;
      HostTensor ycu = yu;
      hot::cpu::relu_mask(from1(x), from1(ycu), bcu.view(), nullptr, {});
      hot::cuda::relu_mask_launch(from1(x), from1(yu), bu.view(), hot_emu::Launch{});
      EXPECT_TRUE(all_bytes_equal(ycu, yu));
      EXPECT_TRUE(all_bytes_equal(bcu, bu));
      hot::cpu::relu_mask_backward(from1(gy), bcu.view(), from1(gcu), {});
      hot::cuda::relu_mask_backward_launch(from1(gy), bu.view(), from1(gu), hot_emu::Launch{});
      EXPECT_TRUE(all_bytes_equal(gcu, gu));
    }
}

// BatchNorm's input gradient with G~'s amax: the emulated kernels against the CPU's bytes (g_x, amax); fp32 / 16-bit,
// widths with a partial 16-channel group, block sizes below 16, row padding (element-wise loads), no weight.
TEST(Emu_BatchNormBackwardInput, BitExactVsCpu) {
  uint64_t seed = 2100;
  for (DType dt : kDtypes)
    for (auto [R, C] : std::vector<std::pair<int64_t, int64_t>>{{1, 16}, {37, 24}, {130, 64}, {9, 72}, {20, 8}})
      for (int64_t pad : {0, 8})
        for (bool affine : {true, false}) {
          SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " " << R << "x" << C << " pad " << pad);
          const HostTensor gy = hot_cuda_test::rand_float(dt, R, C, seed++, C + pad, 2.0f);
          const HostTensor x = hot_cuda_test::rand_float(dt, R, C, seed++, C + pad, 3.0f);
          HostTensor stats[5];
          for (HostTensor& t : stats) t = hot_cuda_test::rand_float(DType::f32, 1, C, seed++, C, 1.0f);
          for (int64_t c = 0; c < C; ++c) stats[1].setf(0, c, 0.5f + std::fabs(stats[1].getf(0, c)));  // invstd
          const auto vec = [](const HostTensor& t) {
            hot::TensorView v = t.view();
            v.shape = {t.cols()};
            v.strides = {1};
            return v;
          };
          const hot::TensorView w = vec(stats[2]);
          HostTensor gc = out2d(dt, R, C, C + pad), ge = gc, ac = out1d(DType::f32, 1), ae = ac;
          hot::cpu::batch_norm_backward_input(gy, x, vec(stats[0]), vec(stats[1]), affine ? &w : nullptr,
                                              vec(stats[3]), vec(stats[4]), gc, ac, {});
          with_type(dt, [&](auto t, auto launch) {
            hot::cuda::bn_backward_input_launch<decltype(t)>(gy.view(), x.view(), vec(stats[0]), vec(stats[1]),
                                                             affine ? &w : nullptr, vec(stats[3]), vec(stats[4]),
                                                             ge.view(), static_cast<unsigned*>(ae.view().data),
                                                             launch);
          });
          EXPECT_TRUE(all_bytes_equal(gc, ge));
          EXPECT_TRUE(all_bytes_equal(ac, ae));
        }
}

// The g_x kernel's grid-stride loop on one CTA: 100 rows of 3 groups (300 units for 256 threads), so that a thread's
// step carries its group into the next row; the CPU's bytes. fp32, and bf16 / f16 whose vector rows with C % 16 == 0
// take the loop that loads a thread's next unit before this unit's arithmetic (rows padded: the plain loop).
template <typename T>
void gx_one_cta(DType dt, int64_t ld) {
  SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " row stride " << ld);
  const int64_t R = 100, C = 48;
  const HostTensor gy = hot_cuda_test::rand_float(dt, R, C, 2150, ld, 2.0f);
  const HostTensor x = hot_cuda_test::rand_float(dt, R, C, 2151, ld, 3.0f);
  HostTensor st = out2d(DType::f32, 4, C, C);  // mean, invstd, sum_dy, sum_dy_xmu
  for (int64_t c = 0; c < C; ++c)
    st.setf(0, c, 0.1f * static_cast<float>(c % 7)), st.setf(1, c, 0.5f + 0.01f * static_cast<float>(c)),
        st.setf(2, c, 3.0f - 0.1f * static_cast<float>(c)), st.setf(3, c, 0.2f * static_cast<float>(c % 5));
  const auto row = [&](int k) {
    hot::TensorView v = st.view();
    v.data = static_cast<char*>(v.data) + k * C * 4;
    v.shape = {C}, v.strides = {1};
    return v;
  };
  HostTensor gc = out2d(dt, R, C, C), ge = gc, ac = out1d(DType::f32, 1), ae = ac;
  hot::cpu::batch_norm_backward_input(gy, x, row(0), row(1), nullptr, row(2), row(3), gc, ac, {});
  const auto* f = static_cast<const float*>(st.view().data);
  const hot::cuda::BnStats bs{f, f + C, nullptr, f + 2 * C, f + 3 * C, hot::hot_div(1.0f, static_cast<float>(R))};
  unsigned key = 0;
  hot_emu::Launch{}(hot::cuda::bn_backward_input_kernel<T>, dim3(1, 1), hot::cuda::kBasicThreads, 0,
                    hot::cuda::mat<const T>(gy.view()), hot::cuda::mat<const T>(x.view()), bs,
                    hot::cuda::mat<T>(ge.view()), hot::hq_block_size(C), ld == C, &key);
  static_cast<float*>(ae.view().data)[0] = hot::amax_from_key(key);
  EXPECT_TRUE(all_bytes_equal(gc, ge));
  EXPECT_TRUE(all_bytes_equal(ac, ae));
}

TEST(Emu_BatchNormBackwardInput, OneCtaStridesOverRows) {
  gx_one_cta<float>(DType::f32, 48);
  gx_one_cta<__nv_bfloat16>(DType::bf16, 48);
  gx_one_cta<__half>(DType::f16, 48);
  gx_one_cta<__nv_bfloat16>(DType::bf16, 52);
}

// BatchNorm's per-channel sums: the emulated kernels (row groups, lanes, the pairwise hand-over, the groups' sums in
// order) against the CPU's bits; a partial last group, channels not a multiple of 8 (element-wise loads), more than
// kBnMaxJ * 8 channels (two slices), row padding, grad_weight asked or not; with a ReLU's bits (g_relu's bytes too,
// into a buffer and in place).
TEST(Emu_BatchNormBackwardReduce, BitExactVsCpu) {
  uint64_t seed = 2200;
  for (DType dt : kDtypes)
    for (auto [R, C] : std::vector<std::pair<int64_t, int64_t>>{{1, 16}, {37, 13}, {2100, 24}, {1030, 264}})
      for (int64_t pad : {0, 8})
        for (int relu : {0, 1, 2, 3}) {  // none; bits; bits and g_relu; bits, g_relu in place
          if (relu != 0 && pad != 0) continue;  // the bits follow contiguous rows
          const bool weight = relu != 1;
          SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " " << R << "x" << C << " pad " << pad << " relu "
                                          << relu);
          HostTensor gy = hot_cuda_test::rand_float(dt, R, C, seed++, C + pad, 2.0f), gye = gy;
          const HostTensor x = hot_cuda_test::rand_float(dt, R, C, seed++, C + pad, 3.0f);
          const HostTensor st = hot_cuda_test::rand_float(DType::f32, 2, C, seed++, C, 1.0f);  // mean, invstd
          const HostTensor bits = rand_int(DType::s8, 1, (R * C + 7) / 8, -128, 127, seed++);
          const auto vec = [](const HostTensor& t, int64_t row) {
            hot::TensorView v = t.view();
            v.data = static_cast<char*>(v.data) + row * t.cols() * hot::dtype_bits(t.view().dtype) / 8;
            v.shape = {t.cols()};
            v.strides = {1};
            return v;
          };
          HostTensor oc = out2d(DType::f32, 3, C, C), oe = oc;  // sum_dy, sum_dy_xmu, grad_weight
          HostTensor gr = out2d(dt, R, C, C), gre = gr;
          const hot::TensorView gwc = vec(oc, 2), gwe = vec(oe, 2), bv = vec(bits, 0);
          const hot::TensorView grc = relu == 3 ? gy.view() : gr.view(), grv = relu == 3 ? gye.view() : gre.view();
          hot::cpu::batch_norm_backward_reduce(gy, x, vec(st, 0), vec(st, 1), vec(oc, 0), vec(oc, 1),
                                               weight ? &gwc : nullptr, relu ? &bv : nullptr,
                                               relu >= 2 ? &grc : nullptr, {});
          std::vector<float> partial(hot::cuda::bn_reduce_partial_bytes(gy.view()) / sizeof(float));
          with_type(dt, [&](auto t, auto launch) {
            hot::cuda::bn_reduce_launch<decltype(t)>(gye.view(), x.view(), vec(st, 0), vec(st, 1), vec(oe, 0),
                                                     vec(oe, 1), weight ? &gwe : nullptr, relu ? &bv : nullptr,
                                                     relu >= 2 ? &grv : nullptr, partial.data(), launch);
          });
          EXPECT_TRUE(all_bytes_equal(oc, oe));
          EXPECT_TRUE(all_bytes_equal(gr, gre));
          EXPECT_TRUE(all_bytes_equal(gy, gye));
        }
}

// A map R x C of dt with row stride ld: offset + sigma * randn, stored (rounded).
HostTensor bn_map(DType dt, int64_t R, int64_t C, int64_t ld, float offset, float sigma, uint64_t seed) {
  std::vector<float> v = hot_test::randn(static_cast<size_t>(R * C), seed, sigma);
  for (float& e : v) e += offset;
  return hot_test::host_from(dt, R, C, v, ld);
}

// Row `row` of a row-major f32 matrix as a vector view.
hot::TensorView bn_row(const HostTensor& t, int64_t row) {
  hot::TensorView v = t.view();
  v.data = static_cast<float*>(v.data) + row * t.ld();
  v.shape = {t.cols()};
  v.strides = {1};
  return v;
}

// BatchNorm's statistics: the emulated kernels (row groups, lanes, the pairwise hand-over, the groups' sums in order,
// bn_store_stats per channel) against the CPU's bits: mean, invstd (outputs poisoned) and the running statistics. One
// row; channels not a multiple of 8 (element-wise loads); a partial last group after full ones with octets of aligned
// rows (16-byte loads), an odd row padding (element-wise again) and an aligned one; more than kBnMaxJ * 8 channels (a
// second, partial slice); maps far from zero; eps = 0 with a constant channel (invstd +0).
TEST(Emu_BatchNormStats, BitExactVsCpu) {
  struct Case {
    int64_t R, C, pad;
    bool running, eps0;
    float offset;
  };
  const Case cases[] = {{1, 16, 0, false, false, 0.0f},     {1, 16, 3, false, true, 600.0f},
                        {37, 13, 0, true, false, 0.0f},     {37, 13, 8, false, true, 0.0f},
                        {2100, 24, 0, true, false, 600.0f}, {2100, 24, 3, true, false, 0.0f},
                        {2100, 24, 8, false, true, 0.0f},   {1030, 72, 0, true, false, 0.0f},
                        {1030, 72, 3, true, true, 600.0f}};
  uint64_t seed = 2600;
  for (DType dt : kDtypes)
    for (const Case& k : cases) {
      const int64_t R = k.R, C = k.C;
      const float eps = k.eps0 ? 0.0f : 1e-5f;
      SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " " << R << "x" << C << " pad " << k.pad
                                      << " running " << k.running << " eps " << eps << " offset " << k.offset);
      HostTensor x = bn_map(dt, R, C, C + k.pad, k.offset, 2.0f, seed++);
      if (k.eps0)
        for (int64_t r = 1; r < R; ++r) x.setf(r, 1, x.getf(0, 1));
      HostTensor oc = out2d(DType::f32, 4, C, C);  // mean, invstd, running mean, running variance
      const HostTensor u = rand_float(DType::f32, 2, C, seed++);
      for (int64_t c = 0; c < C; ++c) oc.setf(2, c, u.getf(0, c)), oc.setf(3, c, 0.5f + std::fabs(u.getf(1, c)));
      HostTensor oe = oc;
      const hot::TensorView rmc = bn_row(oc, 2), rvc = bn_row(oc, 3), rme = bn_row(oe, 2), rve = bn_row(oe, 3);
      hot::cpu::batch_norm_stats(x, bn_row(oc, 0), bn_row(oc, 1), eps, k.running ? &rmc : nullptr,
                                 k.running ? &rvc : nullptr, 0.1f, {});
      std::vector<float> partial(hot::cuda::bn_stats_scratch_bytes(x.view()) / sizeof(float), NAN);
      with_type(dt, [&](auto t, auto launch) {
        hot::cuda::bn_stats_launch<decltype(t)>(x.view(), bn_row(oe, 0), bn_row(oe, 1), eps,
                                                k.running ? &rme : nullptr, k.running ? &rve : nullptr, 0.1f,
                                                partial.data(), launch);
      });
      EXPECT_TRUE(all_bytes_equal(oc, oe));
      if (k.eps0) {
        EXPECT_EQ(hot_test::f32_bits(oe.getf(1, 1)), 0u) << "invstd of the constant channel";
      }
    }
}

// BatchNorm's output: the emulated kernel against the CPU's bytes (y poisoned, its padding included): channels not a
// multiple of 8 (element-wise); octets of aligned rows (16-byte loads and stores) over two CTAs; an odd row padding
// (element-wise again) and an aligned one; more than 32 octets (C = 520: three channel slices); with and without
// weight and bias, maps far from zero, and in place (y is x).
TEST(Emu_BatchNormTransform, BitExactVsCpu) {
  struct Case {
    int64_t R, C, pad;
    int affine;  // bit 0: weight, bit 1: bias
    bool in_place;
    float offset;
  };
  const Case cases[] = {{37, 13, 0, 0, false, 0.0f}, {37, 13, 3, 3, true, 600.0f}, {100, 24, 0, 1, false, 0.0f},
                        {100, 24, 8, 2, true, 0.0f}, {100, 24, 3, 3, false, 0.0f}, {9, 64, 0, 3, true, 600.0f},
                        {8, 520, 0, 3, false, 0.0f}, {8, 520, 3, 1, false, 0.0f}};
  uint64_t seed = 2700;
  for (DType dt : kDtypes)
    for (const Case& k : cases) {
      const int64_t R = k.R, C = k.C;
      SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " " << R << "x" << C << " pad " << k.pad << " affine "
                                      << k.affine << " in place " << k.in_place);
      const HostTensor x = bn_map(dt, R, C, C + k.pad, k.offset, 2.0f, seed++);
      HostTensor st = rand_float(DType::f32, 4, C, seed++);  // mean, invstd, weight, bias
      for (int64_t c = 0; c < C; ++c)
        st.setf(0, c, k.offset + 0.5f * st.getf(0, c)), st.setf(1, c, 0.25f + std::fabs(st.getf(1, c)));
      const hot::TensorView w = bn_row(st, 2), b = bn_row(st, 3);
      const hot::TensorView* wp = k.affine & 1 ? &w : nullptr;
      const hot::TensorView* bp = k.affine & 2 ? &b : nullptr;
      HostTensor yc = out2d(dt, R, C, C + k.pad), ye = yc;
      hot::cpu::batch_norm_transform(x, bn_row(st, 0), bn_row(st, 1), wp, bp, yc, {});
      with_type(dt, [&](auto t, auto launch) {
        hot::cuda::bn_transform_launch<decltype(t)>(x.view(), bn_row(st, 0), bn_row(st, 1), wp, bp, ye.view(),
                                                    launch);
      });
      EXPECT_TRUE(all_bytes_equal(yc, ye));
      if (!k.in_place) continue;
      HostTensor xc = x, xe = x;
      hot::cpu::batch_norm_transform(xc, bn_row(st, 0), bn_row(st, 1), wp, bp, xc, {});
      with_type(dt, [&](auto t, auto launch) {
        hot::cuda::bn_transform_launch<decltype(t)>(xe.view(), bn_row(st, 0), bn_row(st, 1), wp, bp, xe.view(),
                                                    launch);
      });
      EXPECT_TRUE(all_bytes_equal(xc, xe));
    }
}

// The output kernel's row loop on a grid of 2 CTAs (on maps this small the launcher's grid gives a thread one row):
// each thread's U rows a step apart, the loop carried past them, the last step partial; the CPU's bytes, into a buffer
// and in place; 16-byte and element-wise coefficient loads (C = 24, 13).
TEST(Emu_BatchNormTransform, FewCtasStrideOverRows) {
  uint64_t seed = 2800;
  for (DType dt : kDtypes)
    for (auto [R, C] : std::vector<std::pair<int64_t, int64_t>>{{1000, 24}, {700, 13}}) {
      SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " " << R << "x" << C);
      const HostTensor x = bn_map(dt, R, C, C, 0.0f, 2.0f, seed++);
      HostTensor st = rand_float(DType::f32, 4, C, seed++);
      for (int64_t c = 0; c < C; ++c) st.setf(1, c, 0.25f + std::fabs(st.getf(1, c)));
      const hot::TensorView w = bn_row(st, 2), b = bn_row(st, 3);
      HostTensor yc = out2d(dt, R, C, C), ye = yc;
      hot::cpu::batch_norm_transform(x, bn_row(st, 0), bn_row(st, 1), &w, &b, yc, {});
      const auto* f = static_cast<const float*>(st.view().data);
      const bool a16 = reinterpret_cast<uintptr_t>(f) % 16 == 0 && C % 4 == 0;  // the launcher's coefficient rule
      const hot::cuda::BnAffine a{f, f + C, f + 2 * C, f + 3 * C, a16};
      const int J = static_cast<int>((C + 7) / 8);
      const auto run = [&](const HostTensor& in, HostTensor& out) {
        with_type(dt, [&](auto t, auto launch) {
          using T = decltype(t);
          launch(hot::cuda::bn_transform_kernel<T>, dim3(2, 1), hot::cuda::kBasicThreads, 0,
                 hot::cuda::mat<const T>(in.view()), a, hot::cuda::mat<T>(out.view()), J,
                 hot::cuda::bn_a16(in.view()) && hot::cuda::bn_a16(out.view()));
        });
      };
      run(x, ye);
      EXPECT_TRUE(all_bytes_equal(yc, ye));
      HostTensor xe = x;  // in place: each row read once, before it is written
      run(xe, xe);
      EXPECT_TRUE(all_bytes_equal(yc, xe));
    }
}

// Maps of millions of rows (ResNet-50's first BatchNorm at batch 256: 3.2 M rows of 64 channels) and thousands of
// channels fit the grids of both ops. Recorded, not run.
TEST(Emu_BatchNormStats, LargeMapsFitTheGrid) {
  void* const fake = reinterpret_cast<void*>(uintptr_t{1} << 20);  // never dereferenced
  const hot::Device cuda0 = hot::Device::cuda(0);
  for (auto [R, C] : std::vector<std::pair<int64_t, int64_t>>{{256 * 112 * 112, 64}, {256 * 7 * 7, 2048}}) {
    const hot::TensorView x = hot::make_view(fake, DType::bf16, cuda0, {R, C});
    const hot::TensorView v = hot::make_view(fake, DType::f32, cuda0, {C});
    hot_emu::RecordLaunch rec;
    hot::cuda::bn_stats_launch<__nv_bfloat16>(x, v, v, 1e-5f, &v, &v, 0.1f, static_cast<float*>(fake), rec);
    hot::cuda::bn_transform_launch<__nv_bfloat16>(x, v, v, &v, &v, x, rec);
    ASSERT_EQ(rec.launches.size(), 4u);
    for (const auto& e : rec.launches) EXPECT_TRUE(e.ok) << R << "x" << C << ": grid " << e.grid.x << " x " << e.grid.y;
  }
}

TEST(Emu_Int4, PackUnpackBitExactVsCpu) {
  uint64_t seed = 400;
  for (auto [R, C] : std::vector<std::pair<int64_t, int64_t>>{{1, 2}, {7, 34}, {129, 1000}}) {
    HostTensor q = rand_int(DType::s8, R, C, -8, 7, seed++, C + 4);
    HostTensor pc = out2d(DType::s4, R, C, C + 6), pe = pc;
    hot::cpu::pack_int4(q, pc, {});
    hot::cuda::pack_int4_launch(q.view(), pe.view(), hot_emu::Launch{});
    EXPECT_TRUE(all_bytes_equal(pc, pe));
    HostTensor uc = out2d(DType::s8, R, C, C + 2), ue = uc;
    hot::cpu::unpack_int4(pc, uc, {});
    hot::cuda::unpack_int4_launch(pe.view(), ue.view(), hot_emu::Launch{});
    EXPECT_TRUE(all_bytes_equal(uc, ue));
    EXPECT_TRUE(hot_cuda_test::same_bits(q, ue));  // round trip
  }
}

// g_b of millions of rows (a convolution's L = batch x H x W) fits the grid: the row chunks run on grid.x (65535
// chunks of 128 rows would cap L at 8.4 M on grid.y). Recorded, not run.
TEST(Emu_BiasGrad, MillionsOfRowsFitTheGrid) {
  void* const fake = reinterpret_cast<void*>(uintptr_t{1} << 20);  // never dereferenced
  const hot::Device cuda0 = hot::Device::cuda(0);
  const hot::TensorView gy = hot::make_view(fake, DType::bf16, cuda0, {40000000, 256});
  const hot::TensorView out = hot::make_view(fake, DType::bf16, cuda0, {256});
  hot_emu::RecordLaunch rec;
  hot::cuda::bias_grad_launch(gy, out, static_cast<float*>(fake), rec);
  ASSERT_EQ(rec.launches.size(), 2u);
  for (const auto& e : rec.launches) EXPECT_TRUE(e.ok) << "grid " << e.grid.x << " x " << e.grid.y;
}

// g_b: fixed 128-row chunks summed in chunk order; against float64 with the fp32 summation bound n u sum|g| plus
// the output dtype's rounding, bit-identical between two runs (deterministic), and in fp32 equal to the sums taken in
// that order here (rows in order within a chunk, then the chunks in order). 16645 rows = 131 chunks: more than the
// final kernel stages at once (kBiasFinalRows), plus a partial chunk; 40000 rows = 313 chunks: three rounds, so the
// first staging buffer is refilled while the second is summed.
TEST(Emu_BiasGrad, MatchesFloat64AndDeterministic) {
  uint64_t seed = 500;
  for (DType dt : kDtypes)
    for (auto [L, O] :
         std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {129, 7}, {300, 130}, {16645, 40}, {40000, 33}}) {
      SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " L " << L << " O " << O);
      HostTensor gy = rand_float(dt, L, O, seed++, O + 1);
      HostTensor b1 = out1d(dt, O), b2 = b1;
      std::vector<float> partial(static_cast<size_t>(hot::cuda::bias_partial_bytes(gy.view()) / 4), NAN);
      hot::cuda::bias_grad_launch(gy.view(), b1.view(), partial.data(), hot_emu::Launch{});
      std::fill(partial.begin(), partial.end(), NAN);
      hot::cuda::bias_grad_launch(gy.view(), b2.view(), partial.data(), hot_emu::Launch{});
      EXPECT_TRUE(all_bytes_equal(b1, b2));
      const std::vector<float> g = gy.to_f32();
      if (dt == DType::f32) {
        for (int64_t o = 0; o < O; ++o) {
          float total = 0.0f;
          for (int64_t r0 = 0; r0 < L; r0 += 128) {
            float chunk = 0.0f;
            for (int64_t l = r0; l < std::min(L, r0 + 128); ++l) chunk += g[l * O + o];
            total += chunk;
          }
          ASSERT_EQ(b1.getf(o), total) << "g_b[" << o << "]: not the chunk-order sum";
        }
      }
      for (int64_t o = 0; o < O; ++o) {
        double s = 0, sa = 0;
        for (int64_t l = 0; l < L; ++l) s += g[l * O + o], sa += std::fabs(g[l * O + o]);
        const double tol = 2.0 * L * std::ldexp(1.0, -24) * sa + hot_test::unit_roundoff(dt) * std::fabs(s) + 1e-30;
        ASSERT_NEAR(b1.getf(o), s, tol) << "g_b[" << o << "]";
      }
    }
}

// Max-pool with window offsets: the emulated kernels against the CPU backend, NCHW and channels-last, overlapping and
// dilated windows, floor and ceil output sizes, with NaN, -inf and tied maxima in the map; channels one or a 16-byte
// vector to a thread (channels-last, C = 12: f32 only, 16 and 24: every dtype), 32- and 64-bit index arithmetic.
TEST(Emu_MaxPoolOffsets, BitExactVsCpu) {
  struct P {
    int64_t N, C, H, W;
    int k, s, p, d;
    bool ceil;
  };
  const P cases[] = {{2, 3, 9, 9, 3, 2, 1, 1, false}, {1, 4, 8, 7, 2, 2, 0, 1, true}, {2, 5, 7, 6, 3, 1, 1, 2, false},
                     {1, 2, 5, 5, 3, 3, 1, 1, true},  {1, 16, 6, 6, 3, 2, 1, 1, false}, {3, 1, 4, 9, 2, 3, 1, 1, true},
                     {2, 24, 9, 8, 3, 2, 1, 1, false}, {1, 12, 7, 7, 2, 2, 1, 2, true},
                     {1, 3, 5, 21, 3, 2, 1, 1, false}};
  const auto out_size = [](int64_t in, int k, int s, int p, int d, bool ceil) {
    const int64_t span = in + 2 * p - static_cast<int64_t>(d) * (k - 1) - 1;
    int64_t o = (ceil ? (span + s - 1) / s : span / s) + 1;
    if (ceil && (o - 1) * s >= in + p) --o;
    return o;
  };
  uint64_t seed = 4100;
  for (DType dt : kDtypes)
    for (const P& c : cases)
      for (bool last : {false, true})
        for (bool narrow : {true, false}) {
          SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " " << c.N << "x" << c.C << "x" << c.H << "x" << c.W
                                          << " k " << c.k << " s " << c.s << " p " << c.p << " d " << c.d << " ceil "
                                          << c.ceil << (last ? " channels-last" : " NCHW")
                                          << (narrow ? "" : " 64-bit indices"));
          const int64_t Ho = out_size(c.H, c.k, c.s, c.p, c.d, c.ceil), Wo = out_size(c.W, c.k, c.s, c.p, c.d, c.ceil);
          hot::ConvGeometry g;
          g.N = c.N, g.C = c.C, g.H = c.H, g.W = c.W, g.kh = g.kw = c.k, g.sh = g.sw = c.s, g.ph = g.pw = c.p;
          g.dh = g.dw = c.d;
          const auto view4 = [&](HostTensor& t, int64_t h, int64_t w) {
            hot::TensorView v = t.view();
            v.shape = {c.N, c.C, h, w};
            v.strides = last ? hot::Shape{h * w * c.C, 1, w * c.C, c.C} : hot::Shape{c.C * h * w, h * w, w, 1};
            return v;
          };
          HostTensor x = rand_float(dt, 1, c.N * c.C * c.H * c.W, seed++);
          const int64_t n = x.numel();
          for (int64_t e = 5; e < n; e += 11) x.setf(e, x.getf(e - 1));  // ties
          x.setf(n / 3, std::nanf(""));
          x.setf(n / 2, -INFINITY);
          x.setf(n - 2, INFINITY);
          HostTensor yc = out1d(dt, c.N * c.C * Ho * Wo), ye = yc, oc = out1d(DType::s8, c.N * c.C * Ho * Wo), oe = oc;
          hot::cpu::max_pool2d_offsets(view4(x, c.H, c.W), g, view4(yc, Ho, Wo), view4(oc, Ho, Wo), {});
          hot::cuda::max_pool_offsets_launch(view4(x, c.H, c.W), g, view4(ye, Ho, Wo), view4(oe, Ho, Wo),
                                             hot_emu::Launch{}, narrow);
          EXPECT_TRUE(all_bytes_equal(yc, ye)) << "y";
          EXPECT_TRUE(all_bytes_equal(oc, oe)) << "off";
          const HostTensor gy = rand_float(dt, 1, c.N * c.C * Ho * Wo, seed++);
          HostTensor gc = out1d(dt, n), ge = gc;
          hot::cpu::max_pool2d_offsets_backward(view4(const_cast<HostTensor&>(gy), Ho, Wo), view4(oc, Ho, Wo), g,
                                                view4(gc, c.H, c.W), {});
          hot::cuda::max_pool_offsets_backward_launch(view4(const_cast<HostTensor&>(gy), Ho, Wo), view4(oe, Ho, Wo), g,
                                                      view4(ge, c.H, c.W), hot_emu::Launch{}, narrow);
          EXPECT_TRUE(all_bytes_equal(gc, ge)) << "g_x";
        }
}

}  // namespace
