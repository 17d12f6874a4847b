// The CUDA kernels of quantize_weight (weight_kernels.cuh), run on the CPU by the host emulation (cuda_emu.h) and
// compared byte for byte with the CPU backend, padding columns and row-stride padding included (outputs start
// poisoned). Compiled into hot_emu_tests (AddressSanitizer) and hot_emu_race_tests (ThreadSanitizer).
#include "emu/cuda_emu.h"  // first: it includes the CUDA headers in emulation mode

#include "cuda/weight_kernels.cuh"

#include <gtest/gtest.h>

#include <cstring>
#include <utility>
#include <vector>

#include "cuda/cuda_test_util.h"

namespace {

using hot::DType;
using hot_cuda_test::out1d;
using hot_cuda_test::out2d;
using hot_cuda_test::rand_float;
using hot_test::HostTensor;

struct WeightCase {
  int64_t O, I;
  int block;       // 0: the layer's own, hq_block_size(O)
  int64_t ld_pad;  // extra bytes per q_wt row beyond O_pad (0: contiguous, 16-byte word stores)
};

TEST(Emu_QuantizeWeight, BitExactVsCpu) {
  // O: below one 64-row tile, O_pad crossing into a further tile (130 -> 144), b < 16 and odd; I: below and above
  // one 64-column tile; every block size; contiguous q_wt and rows with odd padding (the byte-store path).
#if defined(HOT_EMU_RACE)
  const std::vector<WeightCase> cases = {{130, 70, 0, 0}, {48, 9, 4, 3}};
  const DType dtypes[] = {DType::bf16};
#else
  std::vector<WeightCase> cases = {{16, 5, 0, 0}, {48, 64, 0, 0}, {100, 33, 0, 0}, {7, 9, 0, 0},
                                   {130, 70, 0, 0}, {130, 70, 0, 3}, {200, 129, 0, 5}};
  for (int b : {1, 2, 4, 8, 16}) cases.push_back({144, 65, b, 0});
  const DType dtypes[] = {DType::f32, DType::bf16, DType::f16};
#endif
  uint64_t seed = 8000;
  for (DType dt : dtypes)
    for (const WeightCase& c : cases)
      for (int bits : {4, 8}) {
        const int b = c.block ? c.block : hot::hq_block_size(c.O);
        SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " O " << c.O << " I " << c.I << " b " << b << " bits "
                                        << bits << " ld pad " << c.ld_pad);
        HostTensor w = rand_float(dt, c.O, c.I, seed++, c.I + 1, 0.05f);
        const int64_t Op = hot::padded_k(c.O);
        HostTensor qc = out2d(DType::s8, c.I, Op, Op + c.ld_pad), qe = qc, sc = out1d(DType::f32, 1), se = sc;
        hot::cpu::quantize_weight(w, qc, sc, bits, b, {});
        unsigned key = 0xdeadbeefu;
        hot::cuda::dispatch_float(dt, "emu", [&](auto t) {
          hot::cuda::weight_launch<decltype(t)>(w.view(), qe.view(), se.view(), bits, b, &key, hot_emu::Launch{});
        });
        EXPECT_TRUE(hot_cuda_test::all_bytes_equal(qc, qe)) << "q_wt";
        EXPECT_TRUE(hot_cuda_test::all_bytes_equal(sc, se)) << "s_w";
      }
}

}  // namespace
