// The CUDA kernels of the fused g_y pass (quantize_grad_output) and of the ABC buffer (compress_activation),
// run on the CPU by the host emulation (cuda_emu.h) and compared byte for byte with the CPU backend. These
// are the kernel sources the GPU runs, so a machine without a GPU (CI) checks their indexing, tiling, RNG
// counters, padding and alignment conditions; the Cuda_* suites check the same on the GPU itself.
//
// Compiled twice (CMakeLists.txt): hot_emu_tests with AddressSanitizer (every case; cp.async copies land at the
// wait), and hot_emu_race_tests with ThreadSanitizer and HOT_EMU_RACE defined (fewer, smaller cases, each with
// copies landing at the wait and at the issue), where a missing barrier in a kernel is reported as a data race.
#include "emu/cuda_emu.h"  // first: it includes the CUDA headers in emulation mode

#include "cuda/qgo_kernels.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "cuda/cuda_test_util.h"

namespace {

using hot::DType;
using hot::GradOutputPlan;
using hot::GradOutputQuant;
using hot::Rounding;
using hot::ScaleMode;
using hot::TensorView;
using hot_cuda_test::out1d;
using hot_cuda_test::out2d;
using hot_cuda_test::rand_float;
using hot_test::HostTensor;

// What hot::cuda::quantize_grad_output does, with host memory and the emulated kernels; with cast_from, what
// compress_activation_cast does (gy the copy of *cast_from): returns whether pass 1 read *cast_from itself.
bool emu_quantize_grad_output(const TensorView& gy, const GradOutputPlan& plan, const GradOutputQuant& out,
                              const TensorView* cast_from = nullptr) {
  hot::cuda::QgoSetup su = hot::cuda::qgo_setup(gy, plan, out);
  std::vector<uint32_t> scratch(su.scratch_bytes() / 4 + 1, 0xdeadbeefu);
  su.bind_scratch(scratch.data());
  const float* cast_src =
      cast_from != nullptr ? hot::cuda::qgo_cast_or_bind(su, *cast_from, gy, hot_emu::Launch{}) : nullptr;
  hot::cuda::dispatch_float(gy.dtype, "emu", [&](auto t) {
    using T = decltype(t);
    hot::cuda::qgo_launch<T>(su, plan, out, static_cast<const T*>(gy.data), hot_emu::Launch{}, cast_src);
  });
  return cast_src != nullptr;
}

using Case = hot_cuda_test::QgoCase;

// `special`: 0 = normal data, 1 = a NaN and an Inf in g_y, 2 = rows of tiny magnitude (the pre-scaled path).
// device_seed: the emulated kernels take the seed from memory (GradOutputPlan::seed_ptr: pass 2's DeviceSeed
// kernels), a stored value plus the plan's offset whose sum (mod 2^64) is the CPU run's seed.
void run_case(DType dt, const Case& c, uint64_t seed, int special, bool device_seed = false) {
  SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " L " << c.L << " O " << c.O << " bits " << c.bits << " "
                                  << hot::scale_mode_name(c.sm) << " " << hot::rounding_name(c.rd) << " gx " << c.gx
                                  << " gw " << c.gw << " bias " << c.bias << " rank " << c.rank << " special " << special);
  HostTensor gy = rand_float(dt, c.L, c.O, seed, c.O + (c.L % 2));
  if (special == 1) {
    gy.setf(c.L / 2, c.O / 3, std::nanf(""));
    gy.setf(c.L - 1, c.O - 1, INFINITY);
  } else if (special == 2) {
    for (int64_t l = 0; l < c.L; l += 3)
      for (int64_t o = 0; o < c.O; ++o) gy.setf(l, o, gy.getf(l, o) * 1e-38f);
  }
  const GradOutputPlan plan = hot_cuda_test::qgo_plan(c, seed);
  GradOutputPlan eplan = plan;
  const uint64_t stored = plan.seed * 0x9E3779B97F4A7C15ull + 0x123456789ull;  // the sum wraps around 2^64
  if (device_seed) {
    eplan.seed = plan.seed - stored;
    eplan.seed_ptr = &stored;
  }
  const int64_t Op = hot::padded_k(c.O), Kp = hot::padded_k(hot::hla_rows(c.L, c.rank));
  HostTensor qg = out2d(DType::s8, c.L, Op), sg = out1d(DType::f32, c.sm == ScaleMode::tensor ? 1 : c.L);
  HostTensor qh = out2d(DType::s8, c.O, Kp), sh = out1d(DType::f32, 1), gb = out1d(dt, c.O);
  HostTensor eqg = qg, esg = sg, eqh = qh, esh = sh, egb = gb;
  GradOutputQuant oc, oe;
  if (c.gx) oc.q_g = qg, oc.s_g = sg, oe.q_g = eqg, oe.s_g = esg;
  if (c.gw) oc.q_gh_t = qh, oc.s_gh = sh, oe.q_gh_t = eqh, oe.s_gh = esh;
  if (c.bias) oc.g_b = gb, oe.g_b = egb;
  hot::cpu::quantize_grad_output(gy, plan, oc, {});
  emu_quantize_grad_output(gy, eplan, oe);
  if (c.gx) {
    EXPECT_TRUE(hot_cuda_test::all_bytes_equal(qg, eqg)) << "q_g";
    EXPECT_TRUE(hot_cuda_test::all_bytes_equal(sg, esg)) << "s_g";
  }
  if (c.gw) {
    EXPECT_TRUE(hot_cuda_test::all_bytes_equal(qh, eqh)) << "q_gh_t";
    EXPECT_TRUE(hot_cuda_test::all_bytes_equal(sh, esh)) << "s_gh";
  }
  if (c.bias && special == 0) {
    // g_b is a float sum in a different (fixed) association order: the fp32 summation bound n u sum|g|
    // against float64, plus the output dtype's rounding.
    const std::vector<float> g = gy.to_f32();
    for (int64_t o = 0; o < c.O; ++o) {
      double s = 0, sa = 0;
      for (int64_t l = 0; l < c.L; ++l) s += g[l * c.O + o], sa += std::fabs(g[l * c.O + o]);
      const double tol = 2.0 * c.L * std::ldexp(1.0, -24) * sa + hot_test::unit_roundoff(dt) * std::fabs(s) + 1e-30;
      ASSERT_NEAR(egb.getf(o), s, tol) << "g_b[" << o << "]";
    }
  }
}

// Every test runs under each timing of the emulated cp.async copies (the 16-bit tiles of qgo16_kernel).
using Param = hot_emu::CopyTiming;
class Emu_QuantizeGradOutput : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override { hot_emu::copy_timing = GetParam(); }
  void TearDown() override {
    hot::cuda::g_qgo_fixed_rank = true;
    hot_emu::copy_timing = hot_emu::CopyTiming::at_wait;
  }
};
class Emu_CompressActivation : public Emu_QuantizeGradOutput {};
std::string param_name(const ::testing::TestParamInfo<Param>& i) {
  return i.param == hot_emu::CopyTiming::at_wait ? "copy_at_wait" : "copy_at_issue";
}

#if defined(HOT_EMU_RACE)
// ThreadSanitizer runs the kernels ~10x slower: shapes of one and of several tiles and both tile widths; 16-bit
// input (qgo16_kernel, cp.async) and fp32 (qgo_kernel); a run-time rank and both compiled-in ranks.
constexpr int64_t kLs[] = {17, 130}, kOs[] = {24, 300}, kIs[] = {77, 264};
constexpr int kRanks[] = {3, 8, 16};
constexpr DType kDtypes[] = {DType::bf16, DType::f32};
const auto kTimings = ::testing::Values(hot_emu::CopyTiming::at_wait, hot_emu::CopyTiming::at_issue);
#else
constexpr int64_t kLs[] = {1, 17, 130}, kOs[] = {16, 24, 30, 7, 264, 300}, kIs[] = {8, 77, 264};
constexpr int kRanks[] = {1, 3, 8, 16};
constexpr DType kDtypes[] = {DType::f32, DType::bf16, DType::f16};
const auto kTimings = ::testing::Values(hot_emu::CopyTiming::at_wait);
#endif

TEST_P(Emu_QuantizeGradOutput, BitExactVsCpu) {
  std::vector<Case> cases;
  // L: one row, a partial HLA block, a partial 64-row tile, several tiles; O: multiples of 16 and 8, b < 16,
  // odd, and wider than one 256-column tile (a multiple of 8, and not).
  for (int64_t L : kLs)
    for (int64_t O : kOs) {
      cases.push_back({L, O, 4, ScaleMode::tensor, Rounding::stochastic, true, true, true, 8});
      cases.push_back({L, O, 8, ScaleMode::token, Rounding::stochastic, true, true, false, 16});
      cases.push_back({L, O, 4, ScaleMode::tensor, Rounding::stochastic, true, true, false, 5});
      if (L == 130) {
        cases.push_back({L, O, 8, ScaleMode::token, Rounding::stochastic, false, true, false, 1});
        cases.push_back({L, O, 4, ScaleMode::token, Rounding::nearest, true, false, true, 3});
        cases.push_back({L, O, 8, ScaleMode::tensor, Rounding::nearest, false, true, false, 12});
        cases.push_back({L, O, 4, ScaleMode::tensor, Rounding::stochastic, false, false, true, 8});
      }
    }
  uint64_t seed = 5000;
  for (DType dt : kDtypes)
    for (const Case& c : cases) run_case(dt, c, seed++, 0);
}

TEST_P(Emu_QuantizeGradOutput, NonFiniteAndTinyBitExactVsCpu) {
  uint64_t seed = 6000;
  for (DType dt : kDtypes)
    for (int special : {1, 2}) {
      run_case(dt, {67, 48, 4, ScaleMode::tensor, Rounding::stochastic, true, true, false, 8}, seed++, special);
      run_case(dt, {67, 48, 4, ScaleMode::token, Rounding::stochastic, true, true, false, 8}, seed++, special);
    }
}

// Ranks 8 and 16 run kernels compiled for that rank (qgo_kernels.cuh, is_fixed_rank); the run-time-rank kernels,
// which the benchmark times against them, must give the same bytes at those ranks too.
TEST_P(Emu_QuantizeGradOutput, RunTimeRankKernelsAtFixedRanks) {
  uint64_t seed = 6500;
  for (const bool fixed : {true, false}) {
    hot::cuda::g_qgo_fixed_rank = fixed;
    for (DType dt : kDtypes)
      for (int rank : {8, 16})
        for (int64_t O : {24, 300}) {
          SCOPED_TRACE(testing::Message() << "compiled-in rank kernels " << fixed);
          run_case(dt, {130, O, 4, ScaleMode::tensor, Rounding::stochastic, true, true, true, rank}, seed++, 0);
        }
  }
  hot::cuda::g_qgo_fixed_rank = true;
}

// A seed read from device memory by the kernels (a seed drawn on the GPU, CUDA graphs): the same bytes as the host
// seed it sums to, for 16-bit (qgo16_kernel) and fp32 (qgo_kernel) inputs, O with and without 8-element RNG groups,
// per-tensor and per-token g_x scales, compiled-in and run-time ranks.
TEST_P(Emu_QuantizeGradOutput, DeviceSeedBitExactVsCpu) {
  uint64_t seed = 6800;
  for (DType dt : kDtypes)
    for (int64_t O : {24, 30, 300}) {
      run_case(dt, {130, O, 4, ScaleMode::tensor, Rounding::stochastic, true, true, true, 8}, seed++, 0, true);
      run_case(dt, {67, O, 8, ScaleMode::token, Rounding::stochastic, true, true, false, 5}, seed++, 0, true);
      run_case(dt, {17, O, 4, ScaleMode::tensor, Rounding::stochastic, true, true, false, 16}, seed++, 0, true);
    }
}

// compress_activation of an L x I input with row stride ld: the emulated kernels (what hot::cuda::compress_activation
// runs) against the CPU backend, bit for bit.
void run_abc_case(DType dt, int64_t L, int64_t I, int64_t ld, int rank, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " L " << L << " I " << I << " ld " << ld << " rank "
                                  << rank);
  HostTensor x = rand_float(dt, L, I, seed, ld);
  const int64_t Kp = hot::padded_k(hot::hla_rows(L, rank));
  HostTensor qc = out2d(DType::s8, I, Kp), qe = qc, sc = out1d(DType::f32, 1), se = sc;
  hot::cpu::compress_activation(x, qc, sc, rank, {});
  GradOutputQuant out;
  out.q_gh_t = qe;
  out.s_gh = se;
  emu_quantize_grad_output(x, hot::cuda::abc_plan(rank), out);
  EXPECT_TRUE(hot_cuda_test::all_bytes_equal(qc, qe));
  EXPECT_TRUE(hot_cuda_test::all_bytes_equal(sc, se));
}

// G~'s codes transposed (GradOutputQuant::q_g_t, the g_x path alone): q_g, s_g, q_g_t and g_b against the CPU backend,
// bit for bit (q_g_t zero past L); fp32 tiles and 16-bit ones (packed narrow ones too), a device seed.
void run_qgt_case(DType dt, int64_t L, int64_t O, Rounding rd, bool bias, uint64_t seed, bool device_seed = false) {
  SCOPED_TRACE(testing::Message() << "q_g_t " << hot::dtype_name(dt) << " L " << L << " O " << O << " "
                                  << hot::rounding_name(rd) << " bias " << bias << " device seed " << device_seed);
  HostTensor gy = rand_float(dt, L, O, seed, O + (L % 2));
  const GradOutputPlan plan =
      hot_cuda_test::qgo_plan({L, O, 8, ScaleMode::tensor, rd, true, false, bias, 16}, seed);
  GradOutputPlan eplan = plan;
  const uint64_t stored = plan.seed * 3 + 77;
  if (device_seed) {
    eplan.seed = plan.seed - stored;
    eplan.seed_ptr = &stored;
  }
  const int64_t Op = hot::padded_k(O), Kp = hot::padded_k(L);
  HostTensor qg = out2d(DType::s8, L, Op), sg = out1d(DType::f32, 1), qt = out2d(DType::s8, O, Kp);
  HostTensor gb = out1d(DType::f32, O);
  HostTensor eqg = qg, esg = sg, eqt = qt, egb = gb;
  GradOutputQuant oc, oe;
  oc.q_g = qg, oc.s_g = sg, oc.q_g_t = qt, oe.q_g = eqg, oe.s_g = esg, oe.q_g_t = eqt;
  if (bias) oc.g_b = gb, oe.g_b = egb;
  hot::cpu::quantize_grad_output(gy, plan, oc, {});
  emu_quantize_grad_output(gy, eplan, oe);
  EXPECT_TRUE(hot_cuda_test::all_bytes_equal(qg, eqg)) << "q_g";
  EXPECT_TRUE(hot_cuda_test::all_bytes_equal(sg, esg)) << "s_g";
  EXPECT_TRUE(hot_cuda_test::all_bytes_equal(qt, eqt)) << "q_g_t";
  for (int64_t c = 0; c < O; ++c)
    for (int64_t r = 0; r < Kp; ++r)
      ASSERT_EQ(eqt.geti(c, r), r < L ? eqg.geti(r, c) : 0) << "q_g_t[" << c << ", " << r << "]";
  if (bias) return;
  // G~'s amax known (a BatchNorm's backward hands it over): no pass 1, the same bytes
  HostTensor gt = out2d(DType::f32, L, O), amax = out1d(DType::f32, 1);
  hot::cpu::hadamard_transform(gy, gt, plan.block, 1, {});
  float m = 0.0f;
  for (int64_t r = 0; r < L; ++r)
    for (int64_t c = 0; c < O; ++c) m = std::max(m, std::fabs(gt.getf(r, c)));
  amax.setf(0, m);
  GradOutputPlan kplan = eplan;
  kplan.amax_key = static_cast<const unsigned*>(amax.view().data);
  HostTensor kqg = out2d(DType::s8, L, Op), ksg = out1d(DType::f32, 1), kqt = out2d(DType::s8, O, Kp);
  GradOutputQuant ok;
  ok.q_g = kqg, ok.s_g = ksg, ok.q_g_t = kqt;
  emu_quantize_grad_output(gy, kplan, ok);
  EXPECT_TRUE(hot_cuda_test::all_bytes_equal(qg, kqg)) << "q_g, known amax";
  EXPECT_TRUE(hot_cuda_test::all_bytes_equal(sg, ksg)) << "s_g, known amax";
  EXPECT_TRUE(hot_cuda_test::all_bytes_equal(qt, kqt)) << "q_g_t, known amax";
}

// activation_codes of an L x I input with row stride ld: the emulated kernels (R = kAsIs) against the CPU backend.
void run_codes_case(DType dt, int64_t L, int64_t I, int64_t ld, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "codes " << hot::dtype_name(dt) << " L " << L << " I " << I << " ld " << ld);
  HostTensor x = rand_float(dt, L, I, seed, ld);
  const int64_t Kp = hot::padded_k(L);
  HostTensor qc = out2d(DType::s8, I, Kp), qe = qc, sc = out1d(DType::f32, 1), se = sc;
  hot::cpu::activation_codes(x, qc, sc, nullptr, {});
  GradOutputQuant out;
  out.q_gh_t = qe;
  out.s_gh = se;
  const GradOutputPlan plan = hot::cuda::abc_plan(16, true);
  EXPECT_EQ(hot::cuda::qgo_setup(x, plan, out).fixed_rank, hot::cuda::kAsIs);
  emu_quantize_grad_output(x, plan, out);
  EXPECT_TRUE(hot_cuda_test::all_bytes_equal(qc, qe));
  EXPECT_TRUE(hot_cuda_test::all_bytes_equal(sc, se));
  // x's amax known (relu_mask's): no pass 1, the same bytes
  HostTensor amax = out1d(DType::f32, 1), qk = out2d(DType::s8, I, Kp), sk = out1d(DType::f32, 1);
  float m = 0.0f;
  for (int64_t r = 0; r < L; ++r)
    for (int64_t c = 0; c < I; ++c) m = std::max(m, std::fabs(x.getf(r, c)));
  amax.setf(0, m);
  HostTensor qa = qc, sa = sc;
  const hot::TensorView av = amax.view();
  hot::cpu::activation_codes(x, qa, sa, &av, {});
  EXPECT_TRUE(hot_cuda_test::all_bytes_equal(qc, qa));
  EXPECT_TRUE(hot_cuda_test::all_bytes_equal(sc, sa));
  GradOutputQuant known;
  known.q_gh_t = qk;
  known.s_gh = sk;
  emu_quantize_grad_output(x, hot::cuda::abc_plan(16, true, static_cast<const unsigned*>(amax.view().data)), known);
  EXPECT_TRUE(hot_cuda_test::all_bytes_equal(qc, qk));
  EXPECT_TRUE(hot_cuda_test::all_bytes_equal(sc, sk));
}

// Narrow 16-bit g_y (max(O, O_pad) <= 128): 2 or 4 row tiles of 64 rows share one tile (QgoParams::pack). Row counts
// whose last tile is partly past L (130: 3 row tiles, 600: 10), widths packing 4 (16, 48, 64), 2 (72, 128) and none
// (136); with and without bias, each path alone, compiled-in and run-time ranks, a device seed; and ABC of such x.
TEST_P(Emu_QuantizeGradOutput, PackedNarrowTilesBitExactVsCpu) {
  uint64_t seed = 8100;
#if defined(HOT_EMU_RACE)
  const std::vector<int64_t> Ls = {130}, Os = {48, 72};
#else
  const std::vector<int64_t> Ls = {130, 600}, Os = {16, 48, 64, 72, 128, 136};
#endif
  for (const DType dt : {DType::bf16, DType::f16})
    for (const int64_t L : Ls)
      for (const int64_t O : Os) {
        {
          GradOutputPlan plan = hot_cuda_test::qgo_plan({L, O, 8, ScaleMode::tensor, Rounding::stochastic, true, true,
                                                         true, 16}, 1);
          HostTensor gy = rand_float(dt, L, O, 1, O);
          GradOutputQuant out;
          HostTensor qg = out2d(DType::s8, L, O), qgh = out2d(DType::s8, O, hot::padded_k(hot::hla_rows(L, 16)));
          out.q_g = qg;
          out.q_gh_t = qgh;
          const hot::cuda::QgoSetup su = hot::cuda::qgo_setup(gy, plan, out);
          EXPECT_EQ(su.p.pack, O <= 64 ? 4 : O <= 128 ? 2 : 1) << "O " << O;
        }
        if (dt == DType::f16 && O != 48) continue;
        run_case(dt, {L, O, 8, ScaleMode::tensor, Rounding::stochastic, true, true, true, 16}, seed++, 0);
        run_case(dt, {L, O, 8, ScaleMode::tensor, Rounding::stochastic, true, true, false, 8}, seed++, 0);
        run_case(dt, {L, O, 4, ScaleMode::tensor, Rounding::nearest, false, true, false, 5}, seed++, 0);
        run_case(dt, {L, O, 8, ScaleMode::tensor, Rounding::stochastic, true, false, true, 16}, seed++, 0);
        if (L == 600) run_case(dt, {L, O, 8, ScaleMode::tensor, Rounding::stochastic, true, true, true, 8}, seed++, 0, true);
      }
}

TEST_P(Emu_CompressActivation, PackedNarrowTilesBitExactVsCpu) {
  uint64_t seed = 8300;
#if defined(HOT_EMU_RACE)
  const std::vector<int64_t> Ls = {130}, Is = {64};
#else
  const std::vector<int64_t> Ls = {130, 600}, Is = {32, 64, 128};
#endif
  for (const int64_t L : Ls)
    for (const int64_t I : Is)
      for (const int rank : {8, 16}) run_abc_case(DType::bf16, L, I, I, rank, seed++);
}

TEST_P(Emu_CompressActivation, BitExactVsCpu) {
  uint64_t seed = 7000;
  for (DType dt : kDtypes)
    for (int64_t L : kLs)
      for (int64_t I : kIs)
        for (int rank : kRanks) run_abc_case(dt, L, I, I + 3 * (L % 2), rank, seed++);
}

TEST_P(Emu_QuantizeGradOutput, TransposedCodesBitExactVsCpu) {
  uint64_t seed = 9100;
  for (DType dt : kDtypes)
    for (int64_t L : kLs)
      for (int64_t O : kOs) run_qgt_case(dt, L, O, seed % 2 ? Rounding::nearest : Rounding::stochastic, seed % 3 == 0,
                                         seed++);
#if !defined(HOT_EMU_RACE)
  for (int64_t O : {16, 48, 64, 72, 128, 136}) run_qgt_case(DType::bf16, 600, O, Rounding::stochastic, true, seed++);
  run_qgt_case(DType::bf16, 600, 264, Rounding::stochastic, false, seed++, true);
#endif
}

// x's own codes: every dtype and shape of the ABC cases (16-bit tiles, packed narrow ones, fp32 tiles, odd widths).
TEST_P(Emu_CompressActivation, CodesBitExactVsCpu) {
  uint64_t seed = 7500;
  for (DType dt : kDtypes)
    for (int64_t L : kLs)
      for (int64_t I : kIs) run_codes_case(dt, L, I, I + 3 * (L % 2), seed++);
#if !defined(HOT_EMU_RACE)
  for (int64_t I : {32, 64, 128}) run_codes_case(DType::bf16, 600, I, I, seed++);  // packed row tiles
#endif
}

// compress_activation_cast of an L x I float input (row stride ld) into a 16-bit copy (row stride ld_cast): the
// emulated launch sequence of hot::cuda::compress_activation_cast (pass 1 reading the float32 input itself where its
// rows allow, `fused`; else the cast kernel first) against the CPU backend: the copy (a NaN as any NaN) and the buffer
// bit for bit. `special`: a NaN, an infinity and a value past fp16's range in x.
void run_abc_cast_case(DType src, DType dt, int64_t L, int64_t I, int64_t ld, int64_t ld_cast, int rank,
                       uint64_t seed, bool fused, bool special = false) {
  SCOPED_TRACE(testing::Message() << hot::dtype_name(src) << " -> " << hot::dtype_name(dt) << " L " << L << " I " << I
                                  << " ld " << ld << " ld_cast " << ld_cast << " rank " << rank << " special "
                                  << special);
  HostTensor x = rand_float(src, L, I, seed, ld, 3.0f);
  if (special) {
    x.setf(L / 2, I / 3, std::nanf(""));
    x.setf(L - 1, I - 1, -INFINITY);
    x.setf(0, 0, 1.0e5f);
  }
  const int64_t Kp = hot::padded_k(hot::hla_rows(L, rank));
  HostTensor cc = out2d(dt, L, I, ld_cast), ce = cc;
  HostTensor qc = out2d(DType::s8, I, Kp), qe = qc, sc = out1d(DType::f32, 1), se = sc;
  hot::cpu::compress_activation_cast(x, cc, qc, sc, rank, {});
  GradOutputQuant out;
  out.q_gh_t = qe;
  out.s_gh = se;
  const TensorView xv = x;
  EXPECT_EQ(emu_quantize_grad_output(ce, hot::cuda::abc_plan(rank), out, &xv), fused);
  EXPECT_TRUE(hot_cuda_test::same_floats(cc, ce));
  EXPECT_TRUE(hot_cuda_test::all_bytes_equal(qc, qe));
  EXPECT_TRUE(hot_cuda_test::all_bytes_equal(sc, se));
}

// Fused: float32 rows of 16-byte multiples, the copy's rows of 8 elements (L past one tile and not a multiple of 64,
// widths packing 4, 2 and 1 row tiles, padded row strides, non-finite values); unfused: an odd float32 row stride,
// a width not a multiple of 8, a 16-bit source.
TEST_P(Emu_CompressActivation, CastBitExactVsCpu) {
  uint64_t seed = 9100;
#if defined(HOT_EMU_RACE)
  const std::vector<int64_t> Ls = {130}, Is = {64, 264};
#else
  const std::vector<int64_t> Ls = {1, 130, 600}, Is = {8, 64, 128, 264, 776};
#endif
  for (const DType dt : {DType::bf16, DType::f16})
    for (const int64_t L : Ls)
      for (const int64_t I : Is) {
        run_abc_cast_case(DType::f32, dt, L, I, I, I, 16, seed++, true);
        run_abc_cast_case(DType::f32, dt, L, I, I + 4, I + 8, 8, seed++, true, true);
      }
  run_abc_cast_case(DType::f32, DType::bf16, 130, 64, 67, 64, 16, seed++, false);
  run_abc_cast_case(DType::f32, DType::bf16, 130, 77, 77, 77, 16, seed++, false, true);
  run_abc_cast_case(DType::f16, DType::bf16, 130, 64, 64, 64, 3, seed++, false);
}

// Inputs with millions of rows (a convolution's L = batch x H x W): every launch of the pass fits the GPU's grid
// limits, for g_y and for ABC, 16-bit (qgo16_kernel) and fp32 (qgo_kernel). The launches are recorded, not run (the
// data is never touched).
TEST(Emu_QgoLaunch, MillionsOfRowsFitTheGrid) {
  void* const fake = reinterpret_cast<void*>(uintptr_t{1} << 20);  // 16-byte aligned, never dereferenced
  const hot::Device cuda0 = hot::Device::cuda(0);
  for (const int64_t L : {int64_t{4194304} + 64, int64_t{40000000}}) {  // past 65535 tiles of 64 rows
    const int64_t O = 768, Kp = hot::padded_k(hot::hla_rows(L, 8));
    const hot_cuda_test::QgoCase c{L, O, 4, ScaleMode::tensor, Rounding::stochastic, true, true, true, 8};
    GradOutputQuant out;
    out.q_g = hot::make_view(fake, DType::s8, cuda0, {L, O});
    out.s_g = hot::make_view(fake, DType::f32, cuda0, {1});
    out.q_gh_t = hot::make_view(fake, DType::s8, cuda0, {O, Kp});
    out.s_gh = hot::make_view(fake, DType::f32, cuda0, {1});
    for (const DType dt : {DType::bf16, DType::f32}) {
      const TensorView gy = hot::make_view(fake, dt, cuda0, {L, O});
      out.g_b = hot::make_view(fake, dt, cuda0, {O});
      for (const bool abc : {false, true}) {
        SCOPED_TRACE(testing::Message() << "L " << L << " " << hot::dtype_name(dt) << " abc " << abc);
        GradOutputQuant o = out;
        if (abc) o.q_g = o.s_g = o.g_b = TensorView{};
        const GradOutputPlan plan = abc ? hot::cuda::abc_plan(8) : hot_cuda_test::qgo_plan(c, 1);
        hot::cuda::QgoSetup su = hot::cuda::qgo_setup(gy, plan, o);
        EXPECT_EQ(su.raw16, dt != DType::f32);
        su.bind_scratch(fake);
        hot_emu::RecordLaunch rec;
        hot::cuda::dispatch_float(dt, "emu", [&](auto t) {
          using T = decltype(t);
          hot::cuda::qgo_launch<T>(su, plan, o, static_cast<const T*>(fake), rec);
        });
        ASSERT_GE(rec.launches.size(), 3u);
        for (const auto& e : rec.launches)
          EXPECT_TRUE(e.ok) << "grid " << e.grid.x << " x " << e.grid.y << " x " << e.grid.z << ", " << e.threads
                            << " threads, " << e.smem << " B";
      }
    }
  }
}

// On a GPU with 64 KB of shared memory per block (sm_75, the oldest CUDA 13 builds for) every launch of the pass
// fits (the 16-bit tile with its staging: 53 KB; the fp32 tile: 64 KB). The kernels use no static shared memory (the
// amax reduction borrows the tile's), which ptxas shows (scripts/kernel_report.py).
TEST(Emu_QgoLaunch, FitsSixtyFourKilobytesPerBlock) {
  const int64_t L = 300, O = 264, Kp = hot::padded_k(hot::hla_rows(L, 8));
  for (const DType dt : {DType::bf16, DType::f16, DType::f32}) {
    HostTensor gy = rand_float(dt, L, O, 3, O);
    const hot_cuda_test::QgoCase c{L, O, 4, ScaleMode::tensor, Rounding::stochastic, true, true, true, 8};
    HostTensor qg = out2d(DType::s8, L, O), sg = out1d(DType::f32, 1), gb = out1d(dt, O);
    HostTensor qh = out2d(DType::s8, O, Kp), sh = out1d(DType::f32, 1);
    GradOutputQuant out;
    out.q_g = qg, out.s_g = sg, out.q_gh_t = qh, out.s_gh = sh, out.g_b = gb;
    const GradOutputPlan plan = hot_cuda_test::qgo_plan(c, 1);
    {
      SCOPED_TRACE(testing::Message() << hot::dtype_name(dt));
      hot::cuda::QgoSetup su = hot::cuda::qgo_setup(gy, plan, out, 65536);
      EXPECT_EQ(su.raw16, dt != DType::f32);
      su.bind_scratch(qg.view().data);  // never touched by the recording launcher
      hot_emu::RecordLaunch rec;
      hot::cuda::dispatch_float(dt, "emu", [&](auto t) {
        using T = decltype(t);
        hot::cuda::qgo_launch<T>(su, plan, out, static_cast<const T*>(gy.view().data), rec);
      });
      for (const auto& e : rec.launches) EXPECT_LE(e.smem, 65536u);
      // a GPU with less than the fp32 tile's 64 KB gets a clear error (none that CUDA 13 builds for)
      try {
        hot::cuda::qgo_setup(gy, plan, out, 48 * 1024);
        ADD_FAILURE() << "48 KB accepted";
      } catch (const hot::Error& e) {
        EXPECT_EQ(e.kind(), hot::ErrorKind::unavailable);
        EXPECT_NE(std::string(e.what()).find("49152"), std::string::npos) << e.what();
      }
    }
  }
}

// Ranks 8 and 16 select the kernels compiled for them (unless g_qgo_fixed_rank is off), every other rank 1..16 the
// run-time-rank ones (R = 0); ABC alike; a call without the g_w path the kernels without G^ (kGxOnly).
TEST(Emu_QgoLaunch, CompiledInRanks) {
  const int64_t L = 20, O = 24;
  HostTensor gy = rand_float(DType::bf16, L, O, 1, O);
  for (const bool fixed : {true, false}) {
    hot::cuda::g_qgo_fixed_rank = fixed;
    for (int rank = 1; rank <= 16; ++rank) {
      SCOPED_TRACE(testing::Message() << "rank " << rank << " fixed " << fixed);
      const int expected = fixed && (rank == 8 || rank == 16) ? rank : 0;
      const hot_cuda_test::QgoCase c{L, O, 4, ScaleMode::tensor, Rounding::stochastic, true, true, false, rank};
      HostTensor qg = out2d(DType::s8, L, hot::padded_k(O)), sg = out1d(DType::f32, 1);
      HostTensor qh = out2d(DType::s8, O, hot::padded_k(hot::hla_rows(L, rank))), sh = out1d(DType::f32, 1);
      GradOutputQuant out;
      out.q_g = qg, out.s_g = sg, out.q_gh_t = qh, out.s_gh = sh;
      EXPECT_EQ(hot::cuda::qgo_setup(gy, hot_cuda_test::qgo_plan(c, 1), out).fixed_rank, expected);
      GradOutputQuant abc;
      abc.q_gh_t = qh, abc.s_gh = sh;
      EXPECT_EQ(hot::cuda::qgo_setup(gy, hot::cuda::abc_plan(rank), abc).fixed_rank, expected);
    }
    GradOutputQuant gx_only;
    HostTensor qg = out2d(DType::s8, L, hot::padded_k(O)), sg = out1d(DType::f32, 1);
    gx_only.q_g = qg, gx_only.s_g = sg;
    const hot_cuda_test::QgoCase c{L, O, 8, ScaleMode::tensor, Rounding::stochastic, true, false, false, 16};
    EXPECT_EQ(hot::cuda::qgo_setup(gy, hot_cuda_test::qgo_plan(c, 1), gx_only).fixed_rank,
              fixed ? hot::cuda::kGxOnly : 0);
  }
  hot::cuda::g_qgo_fixed_rank = true;
}

INSTANTIATE_TEST_SUITE_P(CopyTimings, Emu_QuantizeGradOutput, kTimings, param_name);
INSTANTIATE_TEST_SUITE_P(CopyTimings, Emu_CompressActivation, kTimings, param_name);

}  // namespace
