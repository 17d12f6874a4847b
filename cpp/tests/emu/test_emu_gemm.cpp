// The generic CUDA-core integer GEMM kernels (generic_gemm_kernels.cuh: s32 output, fused dequantisation, and the
// dequantisation of an s32 matrix after the sm_80 GEMM), run on the CPU by the host emulation (cuda_emu.h) and
// compared byte for byte with the CPU backend over shapes that leave partial 64 x 64 tiles and partial 32-deep K
// steps, strided operands and outputs. Compiled into hot_emu_tests (AddressSanitizer) and hot_emu_race_tests
// (ThreadSanitizer, fewer cases).
#include "emu/cuda_emu.h"  // first: it includes the CUDA headers in emulation mode

#include "cuda/generic_gemm_kernels.cuh"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/cuda_test_util.h"

namespace {

using hot::DType;
using hot_cuda_test::all_bytes_equal;
using hot_cuda_test::out2d;
using hot_cuda_test::rand_int;
using hot_test::HostTensor;
using Shape = std::tuple<int64_t, int64_t, int64_t>;  // M, N, K

#if defined(HOT_EMU_RACE)
const std::vector<Shape> kShapes = {{70, 65, 40}};
const DType kDtypes[] = {DType::bf16};
#else
const std::vector<Shape> kShapes = {{1, 1, 1}, {1, 1, 16}, {17, 33, 48}, {129, 70, 77}, {64, 128, 32}, {65, 3, 100}};
const DType kDtypes[] = {DType::f32, DType::bf16, DType::f16};
#endif

TEST(Emu_GemmS8Generic, BitExactVsCpu) {
  uint64_t seed = 900;
  for (auto [M, N, K] : kShapes) {
    SCOPED_TRACE(testing::Message() << "M " << M << " N " << N << " K " << K);
    HostTensor a = rand_int(DType::s8, M, K, -127, 127, seed++, K + 3);
    HostTensor b = rand_int(DType::s8, N, K, -127, 127, seed++, K + 1);
    HostTensor cc = out2d(DType::s32, M, N, N + 2), ce = cc;
    hot::cpu::gemm_s8s8s32(a, b, cc, {});
    const hot::cuda::Mat<int32_t> c = hot::cuda::mat<int32_t>(ce.view());
    hot::cuda::generic_gemm_launch(hot::cuda::mat<const int8_t>(a.view()), hot::cuda::mat<const int8_t>(b.view()),
                                   hot::cuda::StoreS32{c.p, c.ld}, hot_emu::Launch{});
    EXPECT_TRUE(all_bytes_equal(cc, ce));
  }
}

// M (tokens) in the millions fits the grid: M tiles run on grid.x (65535 tiles of 64 rows would cap M at 4.19 M on
// grid.y). Recorded, not run. N past 65535 tiles is a clear error naming the sizes.
TEST(Emu_GemmS8Generic, MillionsOfRowsFitTheGrid) {
  const hot::cuda::Mat<const int8_t> a{nullptr, 40000000, 64, 64}, b{nullptr, 768, 64, 64};
  hot_emu::RecordLaunch rec;
  hot::cuda::generic_gemm_launch(a, b, hot::cuda::StoreS32{nullptr, 768}, rec);
  ASSERT_EQ(rec.launches.size(), 1u);
  EXPECT_TRUE(rec.launches[0].ok) << rec.launches[0].grid.x << " x " << rec.launches[0].grid.y;
  const hot::cuda::Mat<const int8_t> wide{nullptr, 65536 * 64 + 1, 64, 64};
  try {
    hot::cuda::generic_gemm_launch(a, wide, hot::cuda::StoreS32{nullptr, 768}, rec);
    ADD_FAILURE() << "N = " << wide.rows << " was accepted";
  } catch (const hot::Error& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(wide.rows)), std::string::npos) << e.what();
  }
}

// The fused dequantising epilogue, and the s32 dequantisation kernel applied to the CPU backend's s32 product:
// both the same bytes as the CPU backend's gemm_s8_dequant, per-row and per-tensor scales.
TEST(Emu_GemmDequantGeneric, BitExactVsCpu) {
  uint64_t seed = 950;
  for (DType dt : kDtypes)
    for (auto [M, N, K] : kShapes)
      for (bool per_row : {false, true}) {
        SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " M " << M << " N " << N << " K " << K << " per_row "
                                        << per_row);
        HostTensor a = rand_int(DType::s8, M, K, -127, 127, seed++);
        HostTensor b = rand_int(DType::s8, N, K, -127, 127, seed++, K + 5);
        HostTensor sa = HostTensor::make1d(DType::f32, per_row ? M : 1);
        const std::vector<float> r = hot_test::randn(static_cast<size_t>(sa.cols()), seed++);
        for (int64_t i = 0; i < sa.cols(); ++i) sa.setf(i, 1e-3f * (1.0f + std::fabs(r[i])));
        HostTensor sb = HostTensor::make1d(DType::f32, 1);
        sb.setf(0, 0.0123f);
        const float factor = 1.0f / 16;
        HostTensor oc = out2d(dt, M, N, N + 1), oe = oc, os = oc;
        hot::cpu::gemm_s8_dequant(a, b, sa, sb, factor, 8, oc, {});
        HostTensor c32 = out2d(DType::s32, M, N);
        hot::cpu::gemm_s8s8s32(a, b, c32, {});
        hot::cuda::dispatch_float(dt, "emu", [&](auto t) {
          using T = decltype(t);
          hot::cuda::generic_gemm_launch(hot::cuda::mat<const int8_t>(a.view()), hot::cuda::mat<const int8_t>(b.view()),
                                         hot::cuda::make_dequant<T>(sa.view(), sb.view(), factor, oe.view()),
                                         hot_emu::Launch{});
          hot::cuda::dequant_s32_launch<T>(c32.view(), sa.view(), sb.view(), factor, os.view(), hot_emu::Launch{});
        });
        EXPECT_TRUE(all_bytes_equal(oc, oe)) << "fused epilogue";
        EXPECT_TRUE(all_bytes_equal(oc, os)) << "s32 dequantisation";
      }
}

// reduce_s32 as the split-K route uses it: the s32 products of K slices (the CPU backend's, on column ranges of A
// and B) summed in slice order, then dequantised or stored: the CPU's bytes for the whole K. Transposed: the slices
// of B A^T (N x M), each element stored at its transpose (the route for N % 4 != 0).
TEST(Emu_ReduceS32, SlicesBitExactVsCpu) {
  uint64_t seed = 990;
  for (auto [M, N, K, S] : std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>{
           {37, 20, 96, 3}, {5, 64, 256, 8}, {70, 9, 160, 2}, {12, 28, 352, 11}, {6, 40, 640, 40}})
    for (bool transposed : {false, true}) {
      SCOPED_TRACE(testing::Message() << "M " << M << " N " << N << " K " << K << " slices " << S << " transposed "
                                      << transposed);
      HostTensor a = rand_int(DType::s8, M, K, -127, 127, seed++);
      HostTensor b = rand_int(DType::s8, N, K, -127, 127, seed++);
      const int64_t R = transposed ? N : M, C = transposed ? M : N;  // the partials' shape
      HostTensor part = out2d(DType::s32, S * R, C);  // slice s: rows s * R .. s * R + R - 1
      const int64_t ks = K / S;
      for (int64_t sl = 0; sl < S; ++sl) {
        hot::TensorView av = a.view(), bv = b.view(), pv = part.view();
        av.data = static_cast<int8_t*>(av.data) + sl * ks, av.shape[1] = ks;
        bv.data = static_cast<int8_t*>(bv.data) + sl * ks, bv.shape[1] = ks;
        pv.data = static_cast<int32_t*>(pv.data) + sl * R * C, pv.shape[0] = R;
        hot::cpu::gemm_s8s8s32(transposed ? bv : av, transposed ? av : bv, pv, {});
      }
      hot::TensorView first = part.view();
      first.shape[0] = R;
      HostTensor cc = out2d(DType::s32, M, N), ce = out2d(DType::s32, M, N, N + 2);
      hot::cpu::gemm_s8s8s32(a, b, cc, {});
      hot::cuda::reduce_s32_launch(first, static_cast<int>(S), R * C,
                                   hot::cuda::StoreS32{static_cast<int32_t*>(ce.view().data), ce.view().strides[0]},
                                   transposed, hot_emu::Launch{});
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) ASSERT_EQ(cc.geti(m, n), ce.geti(m, n)) << m << "," << n;
      for (DType dt : kDtypes) {
        HostTensor sa = HostTensor::make1d(DType::f32, M), sb = HostTensor::make1d(DType::f32, 1);
        for (int64_t i = 0; i < M; ++i) sa.setf(i, 1e-3f * static_cast<float>(1 + i % 7));
        sb.setf(0, 0.0123f);
        HostTensor oc = out2d(dt, M, N, N + 1), oe = oc;
        hot::cpu::gemm_s8_dequant(a, b, sa, sb, 0.0625f, 8, oc, {});
        hot::cuda::dispatch_float(dt, "emu", [&](auto t) {
          hot::cuda::reduce_s32_launch(first, static_cast<int>(S), R * C,
                                       hot::cuda::make_dequant<decltype(t)>(sa.view(), sb.view(), 0.0625f, oe.view()),
                                       transposed, hot_emu::Launch{});
        });
        EXPECT_TRUE(all_bytes_equal(oc, oe)) << hot::dtype_name(dt);
      }
    }
}

// A contraction past kMaxInt32K (SPEC §4): its int32 slices summed in int64 by reduce_s32 give the CPU backend's
// dequantised bytes for the whole K; rows of +127 codes make the sum overflow int32, so an int32 sum would not.
TEST(Emu_ReduceS32, SlicesPastInt32BitExactVsCpu) {
  const int64_t M = 3, N = 2, S = 3, ks = hot::kMaxInt32K, K = S * ks;
  HostTensor a = rand_int(DType::s8, M, K, -127, 127, 4242), b = rand_int(DType::s8, N, K, -127, 127, 4243);
  for (int64_t k = 0; k < K; ++k) {
    a.seti(0, k, 127);
    b.seti(0, k, 127);
  }
  HostTensor part = out2d(DType::s32, S * M, N);
  for (int64_t sl = 0; sl < S; ++sl) {
    hot::TensorView av = a.view(), bv = b.view(), pv = part.view();
    av.data = static_cast<int8_t*>(av.data) + sl * ks, av.shape[1] = ks;
    bv.data = static_cast<int8_t*>(bv.data) + sl * ks, bv.shape[1] = ks;
    pv.data = static_cast<int32_t*>(pv.data) + sl * M * N, pv.shape[0] = M;
    hot::cpu::gemm_s8s8s32(av, bv, pv, {});
  }
  hot::TensorView first = part.view();
  first.shape[0] = M;
  HostTensor sa = HostTensor::make1d(DType::f32, 1), sb = HostTensor::make1d(DType::f32, 1);
  sa.setf(0, 0.5f);
  sb.setf(0, 0.375f);
  HostTensor oc = out2d(DType::f32, M, N), oe = oc;
  hot::cpu::gemm_s8_dequant(a, b, sa, sb, 0.0625f, 8, oc, {});
  hot::cuda::reduce_s32_launch(first, static_cast<int>(S), M * N,
                               hot::cuda::make_dequant<float>(sa.view(), sb.view(), 0.0625f, oe.view()), false,
                               hot_emu::Launch{});
  EXPECT_TRUE(all_bytes_equal(oc, oe));
  EXPECT_EQ(oe.getf(0, 0), static_cast<float>(int64_t{127} * 127 * K) * (0.5f * 0.375f * 0.0625f));
}

}  // namespace
