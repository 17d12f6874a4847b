// hadamard_transform and hla_project (SPEC §1, §3 steps 1-2, §4 step 1).
#include <set>

#include "test_util.h"

namespace {

using namespace hot_test;

const int kBlocks[] = {1, 2, 4, 8, 16, 32, 64, 128, 256};

HostTensor run_hadamard(const HostTensor& in, int block, int axis) {
  HostTensor out = HostTensor::make2d(DType::f32, in.rows(), in.cols());
  hot::hadamard_transform(in, out, block, axis);
  return out;
}

TEST(Cpu_Hadamard, TransformOfIdentityIsSylvesterMatrix) {
  for (int n : kBlocks)
    for (int axis : {0, 1}) {
      std::vector<float> eye(static_cast<size_t>(n * n), 0.0f);
      for (int i = 0; i < n; ++i) eye[i * n + i] = 1.0f;
      const HostTensor out = run_hadamard(host_from(DType::f32, n, n, eye), n, axis);
      const std::vector<int> H = sylvester(n);
      const std::vector<float> got = out.to_f32();
      for (int i = 0; i < n * n; ++i) ASSERT_EQ(got[i], static_cast<float>(H[i])) << "n " << n << " axis " << axis << " at " << i;
    }
}

TEST(Cpu_Hadamard, AppliedTwiceIsNTimesInputExactly) {
  // Integer inputs in [-8, 8]: every intermediate is an integer below 2^24, so H H x = n x exactly.
  for (int n : kBlocks)
    for (int axis : {0, 1}) {
      const int64_t R = axis == 1 ? 3 : 2 * n, C = axis == 1 ? 2 * n : 3;
      std::vector<float> x(static_cast<size_t>(R * C));
      const auto iv = randint(x.size(), 100 + n, -8, 8);
      for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(iv[i]);
      const HostTensor once = run_hadamard(host_from(DType::f32, R, C, x), n, axis);
      const HostTensor twice = run_hadamard(once, n, axis);
      const std::vector<float> got = twice.to_f32();
      for (size_t i = 0; i < x.size(); ++i)
        ASSERT_EQ(got[i], static_cast<float>(n) * x[i]) << "n " << n << " axis " << axis << " at " << i;
    }
}

TEST(Cpu_Hadamard, MatchesExplicitBlockDiagonalProduct) {
  for (int n : kBlocks)
    for (int axis : {0, 1}) {
      const int64_t R = axis == 1 ? 5 : 3 * n, C = axis == 1 ? 3 * n : 7;
      const std::vector<float> x = randn(static_cast<size_t>(R * C), 7 * n + axis);
      const HostTensor out = run_hadamard(host_from(DType::f32, R, C, x), n, axis);
      const std::vector<double> ref = hadamard_f64(x, R, C, n, axis);
      // fp32 butterflies: log2(n) rounded additions per output, |err| <= log2(n) u sum|x_block| (1st order).
      int stages = 0;
      while ((1 << stages) < n) ++stages;
      const std::vector<float> got = out.to_f32();
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c) {
          double sabs = 0;
          if (axis == 1) {
            const int64_t c0 = c / n * n;
            for (int k = 0; k < n; ++k) sabs += std::fabs(x[r * C + c0 + k]);
          } else {
            const int64_t r0 = r / n * n;
            for (int k = 0; k < n; ++k) sabs += std::fabs(x[(r0 + k) * C + c]);
          }
          const double tol = 1.01 * stages * std::ldexp(1.0, -24) * sabs;
          ASSERT_LE(std::fabs(got[r * C + c] - ref[r * C + c]), tol) << "n " << n << " axis " << axis;
        }
      // and bit-identical to the butterfly order every backend must use
      const std::vector<float> rep = hadamard_f32(x, R, C, n, axis);
      for (size_t i = 0; i < rep.size(); ++i)
        ASSERT_EQ(f32_bits(got[i]), f32_bits(rep[i])) << "butterfly order differs: n " << n << " axis " << axis << " at " << i;
    }
}

TEST(Cpu_Hadamard, HalfInputsStridedViews) {
  for (DType dt : {DType::f32, DType::f16, DType::bf16})
    for (int axis : {0, 1}) {
      const int n = 16;
      const int64_t R = axis == 1 ? 9 : 32, C = axis == 1 ? 48 : 11;
      const std::vector<float> x = rounded(randn(static_cast<size_t>(R * C), 11), dt);
      const HostTensor in = host_from(dt, R, C, x, C + 5);
      HostTensor out = HostTensor::make2d(DType::f32, R, C, C + 3);
      hot::hadamard_transform(in, out, n, axis);
      const std::vector<float> rep = hadamard_f32(x, R, C, n, axis);
      const std::vector<float> got = out.to_f32();
      for (size_t i = 0; i < rep.size(); ++i)
        ASSERT_EQ(f32_bits(got[i]), f32_bits(rep[i])) << hot::dtype_name(dt) << " axis " << axis << " at " << i;
      EXPECT_TRUE(out.padding_untouched());
    }
}

TEST(Cpu_Hadamard, BlockOneIsIdentity) {
  const std::vector<float> x = randn(30, 3);
  for (int axis : {0, 1}) {
    const HostTensor out = run_hadamard(host_from(DType::f32, 5, 6, x), 1, axis);
    const std::vector<float> got = out.to_f32();
    for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(got[i], x[i]);
  }
}

TEST(Cpu_Hadamard, NonFinitePropagates) {
  std::vector<float> x(32, 1.0f);
  x[3] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> got = run_hadamard(host_from(DType::f32, 2, 16, x), 16, 1).to_f32();
  for (int c = 0; c < 16; ++c) EXPECT_TRUE(std::isnan(got[c])) << c;   // row 0 block contains NaN
  for (int c = 16; c < 32; ++c) EXPECT_TRUE(std::isfinite(got[c])) << c;  // row 1 does not
}

// ---- HLA -------------------------------------------------------------------------------------------

TEST(Cpu_Hla, RowCount) {
  EXPECT_EQ(hot::hla_rows(16, 8), 8);
  EXPECT_EQ(hot::hla_rows(17, 8), 16);
  EXPECT_EQ(hot::hla_rows(1, 1), 1);
  EXPECT_EQ(hot::hla_rows(37, 16), 48);
  EXPECT_EQ(hot::hla_rows(4096, 4), 1024);
  EXPECT_EQ(hot::padded_k(0), 0);
  EXPECT_EQ(hot::padded_k(1), 16);
  EXPECT_EQ(hot::padded_k(16), 16);
  EXPECT_EQ(hot::padded_k(17), 32);
}

TEST(Cpu_Hla, OrderIsLowPassSet) {
  std::set<int> all(hot::kHlaOrder, hot::kHlaOrder + 16);
  EXPECT_EQ(all.size(), 16u);
  std::set<int> r8(hot::kHlaOrder, hot::kHlaOrder + 8);
  EXPECT_EQ(r8, (std::set<int>{0, 2, 3, 4, 8, 10, 12, 14}));
}

// Ĥ as the implementation applies it: hla_project of the 16 x 16 identity is Ĥ (r x 16).
std::vector<double> impl_hhat(int rank) {
  std::vector<float> eye(256, 0.0f);
  for (int i = 0; i < 16; ++i) eye[i * 16 + i] = 1.0f;
  HostTensor out = HostTensor::make2d(DType::f32, rank, 16);
  hot::hla_project(host_from(DType::f32, 16, 16, eye), out, rank);
  return to64(out.to_f32());
}

TEST(Cpu_Hla, RowsAreHlaOrderRowsOfH16) {
  const std::vector<int> H = sylvester(16);
  for (int r = 1; r <= 16; ++r) {
    const std::vector<double> hh = impl_hhat(r);
    for (int k = 0; k < r; ++k)
      for (int t = 0; t < 16; ++t)
        ASSERT_EQ(hh[k * 16 + t], H[hot::kHlaOrder[k] * 16 + t]) << "rank " << r << " row " << k << " col " << t;
  }
}

TEST(Cpu_Hla, ProjectorIsIdempotentAndFullRankIdentity) {
  for (int r = 1; r <= 16; ++r) {
    const std::vector<double> hh = impl_hhat(r);
    std::vector<double> P = matmul64(hh, 16, r, true, hh, 16, false);  // Ĥᵀ Ĥ (16 x 16)
    for (double& p : P) p /= 16.0;
    const std::vector<double> PP = matmul64(P, 16, 16, false, P, 16, false);
    double trace = 0;
    for (int i = 0; i < 16; ++i) {
      trace += P[i * 16 + i];
      for (int j = 0; j < 16; ++j) {
        // entries are multiples of 1/16 (P) and 1/256 (PP) with small numerators: exact in double
        ASSERT_EQ(PP[i * 16 + j], P[i * 16 + j]) << "rank " << r << " (" << i << "," << j << ")";
        ASSERT_EQ(P[i * 16 + j], P[j * 16 + i]);
        if (r == 16) ASSERT_EQ(P[i * 16 + j], i == j ? 1.0 : 0.0);
      }
    }
    EXPECT_EQ(trace, static_cast<double>(r));
  }
}

TEST(Cpu_Hla, MatchesExplicitProductWithZeroPadding) {
  for (int64_t L : {1, 15, 16, 17, 37, 64}) {
    for (int rank : {1, 2, 4, 8, 13, 16}) {
      const int64_t C = 7;
      const int64_t K = hot::hla_rows(L, rank);
      ASSERT_EQ(K, ceil_div(L, 16) * rank);
      // integer inputs: exact
      std::vector<float> xi(static_cast<size_t>(L * C));
      const auto iv = randint(xi.size(), L * 31 + rank, -100, 100);
      for (size_t i = 0; i < xi.size(); ++i) xi[i] = static_cast<float>(iv[i]);
      HostTensor out = HostTensor::make2d(DType::f32, K, C);
      hot::hla_project(host_from(DType::f32, L, C, xi), out, rank);
      const std::vector<double> ref = hla_f64(xi, L, C, rank);
      const std::vector<float> got = out.to_f32();
      for (size_t i = 0; i < ref.size(); ++i) ASSERT_EQ(got[i], ref[i]) << "L " << L << " rank " << rank << " at " << i;
      // float inputs: bit-identical to the fp32 butterfly replica, close to float64
      const std::vector<float> xf = randn(static_cast<size_t>(L * C), L + 1000 * rank);
      HostTensor out2 = HostTensor::make2d(DType::f32, K, C);
      hot::hla_project(host_from(DType::f32, L, C, xf), out2, rank);
      const std::vector<float> rep = hla_f32(xf, L, C, rank);
      const std::vector<float> got2 = out2.to_f32();
      const std::vector<double> ref2 = hla_f64(xf, L, C, rank);
      for (size_t i = 0; i < rep.size(); ++i) {
        ASSERT_EQ(f32_bits(got2[i]), f32_bits(rep[i])) << "L " << L << " rank " << rank << " at " << i;
        ASSERT_NEAR(got2[i], ref2[i], 1e-5 * 16 * 4);
      }
    }
  }
}

TEST(Cpu_Hla, HalfAndStridedInputs) {
  const int64_t L = 40, C = 9;
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    const std::vector<float> x = rounded(randn(static_cast<size_t>(L * C), 5), dt);
    const int64_t K = hot::hla_rows(L, 8);
    HostTensor out = HostTensor::make2d(DType::f32, K, C, C + 2);
    hot::hla_project(host_from(dt, L, C, x, C + 4), out, 8);
    const std::vector<float> rep = hla_f32(x, L, C, 8);
    const std::vector<float> got = out.to_f32();
    for (size_t i = 0; i < rep.size(); ++i) ASSERT_EQ(f32_bits(got[i]), f32_bits(rep[i])) << hot::dtype_name(dt) << " " << i;
    EXPECT_TRUE(out.padding_untouched());
  }
}

TEST(Cpu_Hla, FullRankReproducesWeightGradient) {
  // (1/16) Ĝᵀ X̂ = g_yᵀ (ĤᵀĤ/16 blockwise) x = g_yᵀ x at r = 16 (L padded with zero rows).
  const int64_t L = 53, O = 6, I = 10;
  const std::vector<float> gy = randn(static_cast<size_t>(L * O), 1);
  const std::vector<float> x = randn(static_cast<size_t>(L * I), 2);
  const int64_t K = hot::hla_rows(L, 16);
  HostTensor gh = HostTensor::make2d(DType::f32, K, O), xh = HostTensor::make2d(DType::f32, K, I);
  hot::hla_project(host_from(DType::f32, L, O, gy), gh, 16);
  hot::hla_project(host_from(DType::f32, L, I, x), xh, 16);
  std::vector<double> prod = matmul64(to64(gh.to_f32()), O, K, true, to64(xh.to_f32()), I, false);
  for (double& p : prod) p /= 16.0;
  const std::vector<double> ref = matmul64(to64(gy), O, L, true, to64(x), I, false);
  // Each fp32 HLA output has |err| <= 4 u S, S = sum over its 16-row block of |input| (4 butterfly
  // stages). First order: |err(prod_oi)| <= (1/16) sum_k (4u Sg |X̂| + 4u Sx |Ĝ|) <= (1/16) sum_k 8u Sg Sx.
  const double u = std::ldexp(1.0, -24);
  for (int64_t o = 0; o < O; ++o)
    for (int64_t i = 0; i < I; ++i) {
      double bound = 0;
      for (int64_t b = 0; b < ceil_div(L, 16); ++b) {
        double sg = 0, sx = 0;
        for (int64_t t = b * 16; t < std::min(L, b * 16 + 16); ++t) {
          sg += std::fabs(gy[t * O + o]);
          sx += std::fabs(x[t * I + i]);
        }
        bound += 16 * 8 * u * sg * sx / 16.0;  // 16 kept rows per block
      }
      EXPECT_NEAR(prod[o * I + i], ref[o * I + i], 1.01 * bound + 1e-12) << o << "," << i;
    }
}

TEST(Cpu_Hla, RankBelowSixteenIsProjection) {
  // g_yᵀ P x with P = blockdiag(ĤᵀĤ/16): compare (1/16) Ĝᵀ X̂ (integer inputs: exact) to the explicit projector.
  const int64_t L = 32, O = 3, I = 4;
  for (int rank : {1, 4, 8}) {
    std::vector<float> gy(static_cast<size_t>(L * O)), x(static_cast<size_t>(L * I));
    const auto a = randint(gy.size(), 9, -5, 5), b = randint(x.size(), 10, -5, 5);
    for (size_t i = 0; i < gy.size(); ++i) gy[i] = static_cast<float>(a[i]);
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(b[i]);
    const int64_t K = hot::hla_rows(L, rank);
    HostTensor gh = HostTensor::make2d(DType::f32, K, O), xh = HostTensor::make2d(DType::f32, K, I);
    hot::hla_project(host_from(DType::f32, L, O, gy), gh, rank);
    hot::hla_project(host_from(DType::f32, L, I, x), xh, rank);
    std::vector<double> prod = matmul64(to64(gh.to_f32()), O, K, true, to64(xh.to_f32()), I, false);
    for (double& p : prod) p /= 16.0;
    // explicit P (L x L block diagonal)
    const std::vector<int> H = sylvester(16);
    std::vector<double> P(static_cast<size_t>(L * L), 0.0);
    for (int64_t blk = 0; blk < L / 16; ++blk)
      for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) {
          double s = 0;
          for (int k = 0; k < rank; ++k) s += H[hot::kHlaOrder[k] * 16 + i] * H[hot::kHlaOrder[k] * 16 + j];
          P[(blk * 16 + i) * L + blk * 16 + j] = s / 16.0;
        }
    const std::vector<double> Px = matmul64(P, L, L, false, to64(x), I, false);
    const std::vector<double> ref = matmul64(to64(gy), O, L, true, Px, I, false);
    for (size_t i = 0; i < ref.size(); ++i) EXPECT_EQ(prod[i], ref[i]) << "rank " << rank << " at " << i;
  }
}

}  // namespace
