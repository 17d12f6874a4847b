// The CUDA kernels of compress_columns (columns_kernels.cuh), run on the CPU by the host emulation (cuda_emu.h) and
// compared byte for byte with the CPU backend (q_t with its padding columns and row-stride padding, and the scale;
// outputs start poisoned). Compiled into hot_emu_tests (AddressSanitizer) and hot_emu_race_tests (ThreadSanitizer).
#include "emu/cuda_emu.h"  // first: it includes the CUDA headers in emulation mode

#include "cuda/columns_kernels.cuh"

#include <gtest/gtest.h>

#include <vector>

#include "cuda/cuda_test_util.h"

namespace {

using hot::DType;
using hot_cuda_test::out1d;
using hot_cuda_test::out2d;
using hot_cuda_test::rand_int;
using hot_test::HostTensor;

TEST(Emu_CompressColumns, BitExactVsCpu) {
#if defined(HOT_EMU_RACE)
  const std::vector<hot::ConvGeometry> geoms = {hot_cuda_test::col2im_geometries()[0]};
  const int ranks[] = {16};
#else
  const std::vector<hot::ConvGeometry> geoms = hot_cuda_test::col2im_geometries();
  const int ranks[] = {1, 3, 8, 16};  // tiles of 32, 40, 16 and 8 blocks
#endif
  uint64_t seed = 9100;
  for (const hot::ConvGeometry& g : geoms)
    for (int rank : ranks)
      for (int64_t pad : {0, 3}) {
        SCOPED_TRACE(testing::Message() << "case " << seed << " rank " << rank << " pad " << pad);
        const int64_t L = g.N * g.out_h() * g.out_w(), K = g.C * g.kh * g.kw, Kp = hot::padded_k(hot::hla_rows(L, rank));
        HostTensor map = rand_int(DType::s8, g.N * g.H * g.W, g.C, -127, 127, seed++, g.C + pad);
        HostTensor qc = out2d(DType::s8, K, Kp, Kp + pad), qe = qc, sc = out1d(DType::f32, 1), se = sc;
        hot::cpu::compress_columns(map, g, qc, sc, rank, {});
        unsigned key = 0xdeadbeefu;
        hot::cuda::compress_columns_launch(map.view(), g, qe.view(), se.view(), rank, &key, hot_emu::Launch{});
        EXPECT_TRUE(hot_cuda_test::all_bytes_equal(qc, qe)) << "q_t";
        EXPECT_TRUE(hot_cuda_test::all_bytes_equal(sc, se)) << "scale";
      }
}

// im2col_t's kernels (V = 4 and 16 gathers; the byte kernel of other channel runs, its units in one chunk and in
// several; 16-byte and byte stores) against the CPU's bytes, the zeros past L and the outputs' row padding included.
TEST(Emu_Im2colT, BitExactVsCpu) {
#if defined(HOT_EMU_RACE)
  const std::vector<hot::ConvGeometry> geoms = {hot_cuda_test::col2im_geometries()[0]};
#else
  std::vector<hot::ConvGeometry> geoms = hot_cuda_test::col2im_geometries();
  hot::ConvGeometry g4;  // C % 4 == 0: the 32-bit gathers
  g4.N = 3, g4.C = 8, g4.H = 9, g4.W = 7, g4.kh = 3, g4.kw = 3, g4.ph = 1, g4.pw = 1;
  geoms.push_back(g4);
  g4.patches = true, g4.sh = 2, g4.sw = 2, g4.H = 16, g4.W = 16;  // patch order, stride 2
  geoms.push_back(g4);
  hot::ConvGeometry big;  // 131,072 rows: 256 tiles of 512 rows; at C = 16 the 16-byte gathers
  big.N = 8, big.C = 4, big.H = 128, big.W = 128, big.kh = 3, big.kw = 3, big.ph = 1, big.pw = 1;
  geoms.push_back(big);
  big.N = 2, big.C = 16, big.H = 96, big.W = 96;  // 18,432 rows: 144 tiles of 128 rows
  geoms.push_back(big);
  hot::ConvGeometry g7;  // 7 channels of a 7 x 7 kernel, dilated: 343 units, two chunks of the byte kernel
  g7.N = 2, g7.C = 7, g7.H = 13, g7.W = 11, g7.kh = 7, g7.kw = 7, g7.ph = 5, g7.pw = 4, g7.dh = 2, g7.dw = 2;
  geoms.push_back(g7);
  g7.C = 3, g7.H = 40, g7.W = 40, g7.sh = 2, g7.sw = 2, g7.ph = 3, g7.pw = 3, g7.dh = 1, g7.dw = 1;  // a stem
  geoms.push_back(g7);
#endif
  uint64_t seed = 9160;
  for (const hot::ConvGeometry& g : geoms)
    for (int64_t pad : {0, 1}) {
      SCOPED_TRACE(testing::Message() << "case " << seed << " C " << g.C << " pad " << pad);
      const int64_t L = g.N * g.out_h() * g.out_w(), K = g.C * g.kh * g.kw, Kp = hot::padded_k(L) + 16 * pad;
      HostTensor map = rand_int(DType::s8, g.N * g.H * g.W, g.C, -128, 127, seed++, g.C + 4 * pad);
      HostTensor qc = out2d(DType::s8, K, Kp, Kp + pad), qe = qc;
      hot::cpu::im2col_t(map, g, qc, {});
      hot::cuda::im2col_t_launch(map.view(), g, qe.view(), hot_emu::Launch{});
      EXPECT_TRUE(hot_cuda_test::all_bytes_equal(qc, qe)) << "cols_t";
    }
}

// im2col_t's shifting kernel (convolutions whose output has the map's size: the 1 x 1 im2col_t into map_t, then the
// taps as shifted rows of it) against the CPU's bytes: zero chunks past L (pad 1) and cols_t's row padding (pad 1, 2)
// included; each geometry is checked to take that kernel.
TEST(Emu_Im2colT, ShiftsBitExactVsCpu) {
#if defined(HOT_EMU_RACE)
  const std::vector<hot::ConvGeometry> geoms = {hot_cuda_test::shift_geometries()[0]};
#else
  const std::vector<hot::ConvGeometry> geoms = hot_cuda_test::shift_geometries();
#endif
  uint64_t seed = 9180;
  for (const hot::ConvGeometry& g : geoms)
    for (int64_t pad : {0, 1, 2}) {
      SCOPED_TRACE(testing::Message() << "case " << seed << " C " << g.C << " H " << g.H << " W " << g.W << " pad "
                                      << pad);
      const int64_t L = g.N * g.H * g.W, K = g.C * g.kh * g.kw, Kp = hot::padded_k(L) + 16 * (pad % 2);
      HostTensor map = rand_int(DType::s8, L, g.C, -128, 127, seed++, g.C + 16 * pad);
      HostTensor qc = out2d(DType::s8, K, Kp, Kp + 16 * (pad / 2)), qe = qc;
      HostTensor scratch = out2d(DType::s8, g.C, hot::padded_k(L));
      ASSERT_TRUE(hot::cuda::im2col_t_shifts(map.view(), g, qe.view()));
      ASSERT_EQ(hot::cuda::im2col_t_scratch_bytes(map.view(), g, qe.view()),
                static_cast<size_t>(g.C * hot::padded_k(L)));
      hot::cpu::im2col_t(map, g, qc, {});
      hot::cuda::im2col_t_launch(map.view(), g, qe.view(), hot_emu::Launch{}, scratch.view().ptr<int8_t>());
      EXPECT_TRUE(hot_cuda_test::all_bytes_equal(qc, qe)) << "cols_t";
    }
}

// The largest transform coefficients (|.| = 16 * 127: every code of a 16-row block +-127, one sign or mixed), where
// the kernels' integer transform of two channels per register (split_lanes) is closest to its lanes' limits.
TEST(Emu_CompressColumns, ExtremeCodesBitExactVsCpu) {
  const std::vector<hot::ConvGeometry> all = hot_cuda_test::col2im_geometries();
  uint64_t seed = 9700;
  for (const hot::ConvGeometry& g : {all[7], all[8], all[0], all[9]})  // C = 16, 64: four channels per gathered
                                                                       // word; C = 3, 6: three
    for (int pattern = 0; pattern < 3; ++pattern) {
      SCOPED_TRACE(testing::Message() << "C " << g.C << " pattern " << pattern);
      const int64_t rows = g.N * g.H * g.W, L = g.N * g.out_h() * g.out_w(), K = g.C * g.kh * g.kw;
      const int64_t Kp = hot::padded_k(hot::hla_rows(L, 16));
      std::vector<int64_t> v = hot_test::randint(static_cast<size_t>(rows * g.C), seed++, 0, 1);
      for (int64_t& e : v) e = pattern == 0 ? 127 : pattern == 1 ? -127 : 254 * e - 127;
      HostTensor map = hot_test::host_from_int(DType::s8, rows, g.C, v);
      HostTensor qc = out2d(DType::s8, K, Kp), qe = qc, sc = out1d(DType::f32, 1), se = sc;
      hot::cpu::compress_columns(map, g, qc, sc, 16, {});
      unsigned key = 0u;
      hot::cuda::compress_columns_launch(map.view(), g, qe.view(), se.view(), 16, &key, hot_emu::Launch{});
      EXPECT_TRUE(hot_cuda_test::all_bytes_equal(qc, qe)) << "q_t";
      EXPECT_TRUE(hot_cuda_test::all_bytes_equal(sc, se)) << "scale";
    }
}

}  // namespace
