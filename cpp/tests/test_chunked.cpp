// Long g_w contractions (SPEC §4, "Long contractions"): past gw_chunk_rows(rank) rows, hot::backward_linear runs
// row chunks whose int32 sums cannot overflow. The chunked result must equal, bit for bit, the per-chunk calls
// combined by the documented rule (g_x rows as computed, g_w / g_b rounded per chunk to the output dtype, summed in
// fp32 in chunk order, rounded once more), and a C++ caller gets an answer close to the exact gradient.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "test_util.h"

namespace {

using hot::Config;
using hot::DType;
using hot::Rounding;
using hot::ScaleMode;
using hot::TensorView;
using hot_test::HostTensor;
using hot_test::host_from;
using hot_test::randn;
using hot_test::rounded;

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

TensorView rows_of(const TensorView& v, int64_t r0, int64_t r1) {
  TensorView r = v;
  r.data = static_cast<char*>(v.data) + r0 * v.strides[0] * (hot::dtype_bits(v.dtype) / 8);
  r.shape[0] = r1 - r0;
  return r;
}

TensorView cols_of(const TensorView& v, int64_t c0, int64_t c1) {
  TensorView r = v;
  r.data = static_cast<char*>(v.data) + c0 * (hot::dtype_bits(v.dtype) / 8);
  r.shape[1] = c1 - c0;
  return r;
}

// Bits of an element of a float host tensor (f32: 32 bits, f16 / bf16: 16), to compare exactly (NaN included).
uint32_t bits_at(const HostTensor& t, int64_t r, int64_t c) {
  const int64_t i = r * t.ld() + c;
  if (t.dtype() == DType::f32) {
    uint32_t u;
    std::memcpy(&u, t.bytes() + i * 4, 4);
    return u;
  }
  uint16_t h;
  std::memcpy(&h, t.bytes() + i * 2, 2);
  return h;
}

Config cfg_of(int bits, int rank, Rounding rd, ScaleMode sm) {
  Config c;
  c.gx_bits = bits;
  c.rank = rank;
  c.rounding = rd;
  c.gx_scale = sm;
  return c;
}

struct Problem {
  int64_t L, O, I;
  HostTensor gy, w, x;
};

// outlier: row 7 of g_y 40 times larger, so that the chunks' per-tensor scales differ.
Problem make_problem(DType dt, int64_t L, int64_t O, int64_t I, uint64_t seed, bool outlier = true) {
  Problem p{L, O, I, {}, {}, {}};
  std::vector<float> gy = randn(static_cast<size_t>(L * O), seed, 0.5f);
  if (outlier)
    for (int64_t o = 0; o < O; ++o) gy[7 * O + o] *= 40.0f;
  p.gy = host_from(dt, L, O, rounded(gy, dt));
  p.w = host_from(dt, O, I, rounded(randn(static_cast<size_t>(O * I), seed + 1, 0.3f), dt));
  p.x = host_from(dt, L, I, rounded(randn(static_cast<size_t>(L * I), seed + 2, 2.0f), dt));
  return p;
}

// The chunked call against the per-chunk calls it is defined by. from_saved: g_w from the ABC buffer of the whole x
// (each chunk reads its columns); else from the raw x (each chunk compresses its own rows).
void check_chunked_equals_chunk_calls(DType in_dt, DType out_dt, int64_t L, int64_t O, int64_t I, const Config& cfg,
                                      uint64_t seed, bool from_saved, bool want_gx, bool want_gb) {
  SCOPED_TRACE(testing::Message() << "L " << L << " rank " << cfg.rank << " in " << hot::dtype_name(in_dt) << " out "
                                  << hot::dtype_name(out_dt) << (from_saved ? " saved" : " raw x") << " gx "
                                  << want_gx << " gb " << want_gb);
  const int64_t step = hot::gw_chunk_rows(cfg.rank);
  ASSERT_GT(L, step) << "the case must be chunked";
  const Problem p = make_problem(in_dt, L, O, I, seed);
  const hot::SavedActivation saved = hot::compress_activation(p.x, cfg.rank);

  // the chunked call
  HostTensor gx = HostTensor::make2d(out_dt, L, I), gw = HostTensor::make2d(out_dt, O, I);
  HostTensor gb = HostTensor::make1d(out_dt, O);
  hot::BackwardOutputs out;
  if (want_gx) out.grad_input = gx.view();
  out.grad_weight = gw.view();
  if (want_gb) out.grad_bias = gb.view();
  if (from_saved) hot::backward_linear(p.gy, p.w, &saved, cfg, seed, out);
  else hot::backward_linear(p.gy, p.w, p.x.view(), cfg, seed, out);

  // the per-chunk calls, each of one GEMM
  std::vector<float> acc_w(static_cast<size_t>(O * I), 0.0f), acc_b(static_cast<size_t>(O), 0.0f);
  int64_t chunks = 0;
  for (int64_t r0 = 0; r0 < L; r0 += step, ++chunks) {
    const int64_t r1 = std::min(L, r0 + step);
    HostTensor cgx = HostTensor::make2d(out_dt, r1 - r0, I), cgw = HostTensor::make2d(out_dt, O, I);
    HostTensor cgb = HostTensor::make1d(out_dt, O);
    hot::BackwardOutputs co;
    if (want_gx) co.grad_input = cgx.view();
    co.grad_weight = cgw.view();
    if (want_gb) co.grad_bias = cgb.view();
    const uint64_t chunk_seed = seed + static_cast<uint64_t>(chunks) * kGolden;
    const TensorView gy_rows = rows_of(p.gy.view(), r0, r1);
    if (from_saved) {
      hot::SavedActivation part;
      part.rows = r1 - r0;
      part.cols = I;
      part.rank = cfg.rank;
      const int64_t k0 = hot::hla_rows(r0, cfg.rank);
      part.q = hot::Tensor::wrap(cols_of(saved.q.view(), k0, k0 + hot::padded_k(hot::hla_rows(r1 - r0, cfg.rank))),
                                 nullptr);
      part.scale = saved.scale;
      hot::backward_linear(gy_rows, p.w, &part, cfg, chunk_seed, co);
    } else {
      hot::backward_linear(gy_rows, p.w, rows_of(p.x.view(), r0, r1), cfg, chunk_seed, co);
    }
    if (want_gx)
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = 0; c < I; ++c)
          ASSERT_EQ(bits_at(gx, r, c), bits_at(cgx, r - r0, c)) << "g_x row " << r << " col " << c;
    for (int64_t o = 0; o < O; ++o) {
      for (int64_t c = 0; c < I; ++c) acc_w[o * I + c] += cgw.getf(o, c);
      if (want_gb) acc_b[o] += cgb.getf(o);
    }
  }
  EXPECT_EQ(chunks, (L + step - 1) / step);
  HostTensor want_w = HostTensor::make2d(out_dt, O, I), want_b = HostTensor::make1d(out_dt, O);
  want_w.from_f32(acc_w);
  want_b.from_f32(acc_b);
  for (int64_t o = 0; o < O; ++o) {
    for (int64_t c = 0; c < I; ++c) ASSERT_EQ(bits_at(gw, o, c), bits_at(want_w, o, c)) << "g_w " << o << ", " << c;
    if (want_gb) ASSERT_EQ(bits_at(gb, 0, o), bits_at(want_b, 0, o)) << "g_b " << o;
  }
}

TEST(Cpu_BackwardChunked, ChunkRows) {
  // the largest multiple of 256 rows whose padded HLA rows fit int32 accumulation of 8-bit products
  const int64_t max_k = std::numeric_limits<int32_t>::max() / (127 * 127);
  EXPECT_EQ(max_k, 133144);
  EXPECT_EQ(hot::gw_chunk_rows(16), 133120);
  EXPECT_EQ(hot::gw_chunk_rows(8), 266240);
  for (int rank = 1; rank <= 16; ++rank) {
    const int64_t step = hot::gw_chunk_rows(rank);
    EXPECT_EQ(step % 256, 0) << rank;
    EXPECT_LE(hot::padded_k(hot::hla_rows(step, rank)), max_k) << rank;
    EXPECT_GT(hot::padded_k(hot::hla_rows(step + 256, rank)), max_k) << rank;
  }
  EXPECT_THROW(hot::gw_chunk_rows(0), hot::Error);
  EXPECT_THROW(hot::gw_chunk_rows(17), hot::Error);
}

TEST(Cpu_BackwardChunked, EqualsSumOfChunkCalls) {
  const int64_t s16 = hot::gw_chunk_rows(16), s8 = hot::gw_chunk_rows(8), s5 = hot::gw_chunk_rows(5);
  // three chunks (the fp32 sum's order matters), fp32 in and out, from the ABC buffer and from the raw x
  for (bool from_saved : {true, false})
    check_chunked_equals_chunk_calls(DType::f32, DType::f32, 2 * s16 + 37, 16, 12,
                                     cfg_of(8, 16, Rounding::stochastic, ScaleMode::tensor), 0xfeedbeefcafe1234ull,
                                     from_saved, true, true);
  // 16-bit outputs: each chunk's g_w and g_b rounded to the output dtype before the fp32 sum
  check_chunked_equals_chunk_calls(DType::bf16, DType::bf16, s16 + 1, 8, 24,
                                   cfg_of(8, 16, Rounding::stochastic, ScaleMode::token), 77, true, true, true);
  check_chunked_equals_chunk_calls(DType::f16, DType::f16, s8 + 300, 8, 16,
                                   cfg_of(4, 8, Rounding::stochastic, ScaleMode::tensor), 5, false, true, true);
  // a rank that is not a power of two, g_w only, round-to-nearest, and a seed whose chunk seeds wrap past 2^64
  check_chunked_equals_chunk_calls(DType::f32, DType::bf16, s5 + 16, 12, 8,
                                   cfg_of(8, 5, Rounding::nearest, ScaleMode::tensor), ~uint64_t{0} - 3, true, false,
                                   false);
}

TEST(Cpu_BackwardChunked, CallerPastOneGemmGetsAnAnswer) {
  // Before the chunking moved into the core this call failed ("split the batch"); now it is the gradient, within
  // 8-bit accuracy of the float64 products.
  const int64_t L = hot::gw_chunk_rows(16) + 300, O = 16, I = 16;
  const Problem p = make_problem(DType::f32, L, O, I, 21, false);
  const Config cfg = cfg_of(8, 16, Rounding::nearest, ScaleMode::tensor);
  const hot::SavedActivation saved = hot::compress_activation(p.x, cfg.rank);
  HostTensor gx = HostTensor::make2d(DType::f32, L, I), gw = HostTensor::make2d(DType::f32, O, I);
  HostTensor gb = HostTensor::make1d(DType::f32, O);
  ASSERT_NO_THROW(hot::backward_linear(p.gy, p.w, &saved, cfg, 3, {gx.view(), gw.view(), gb.view()}));
  const std::vector<float> gyv = p.gy.to_f32(), wv = p.w.to_f32(), xv = p.x.to_f32();
  double ew = 0, nw = 0, ex = 0, nx = 0;
  for (int64_t o = 0; o < O; ++o)
    for (int64_t i = 0; i < I; ++i) {
      double s = 0;
      for (int64_t l = 0; l < L; ++l) s += static_cast<double>(gyv[l * O + o]) * xv[l * I + i];
      ew += (gw.getf(o, i) - s) * (gw.getf(o, i) - s);
      nw += s * s;
    }
  for (int64_t l = 0; l < L; ++l)
    for (int64_t i = 0; i < I; ++i) {
      double s = 0;
      for (int64_t o = 0; o < O; ++o) s += static_cast<double>(gyv[l * O + o]) * wv[o * I + i];
      ex += (gx.getf(l, i) - s) * (gx.getf(l, i) - s);
      nx += s * s;
    }
  // 8-bit per-tensor round-to-nearest of both operands: about 1% each
  EXPECT_LT(std::sqrt(ew / nw), 0.05);
  EXPECT_LT(std::sqrt(ex / nx), 0.05);
  for (int64_t o = 0; o < O; ++o) {  // g_b: exact up to fp32 summation
    double s = 0, sa = 0;
    for (int64_t l = 0; l < L; ++l) {
      s += gyv[l * O + o];
      sa += std::fabs(gyv[l * O + o]);
    }
    EXPECT_NEAR(gb.getf(o), s, 1e-5 * sa) << o;
  }
}

TEST(Cpu_BackwardChunked, RawXOverloadEqualsSavedPathWhenOneGemm) {
  // Below one chunk, backward_linear from the raw x is compress_activation then backward_linear, bit for bit.
  const Problem p = make_problem(DType::bf16, 300, 24, 20, 8);
  const Config cfg = cfg_of(8, 8, Rounding::stochastic, ScaleMode::tensor);
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
