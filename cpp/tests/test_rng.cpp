// Philox4x32 (7 rounds: stochastic rounding's generator; 10: Random123's default) and the stochastic-rounding
// uniforms of hot/rng.h (SPEC §5).
#include <cmath>
#include <set>

#include "test_util.h"

namespace {

using namespace hot_test;

struct Kat {
  int rounds;
  uint32_t ctr[4];
  uint32_t key[2];
  uint32_t expect[4];
};

// Known-answer vectors of Random123 (kat_vectors, philox4x32 7 and 10 rounds).
const Kat kKats[] = {
    {7, {0, 0, 0, 0}, {0, 0}, {0x5f6fb709u, 0x0d893f64u, 0x4f121f81u, 0x4f730a48u}},
    {7, {0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu},
     {0x5207ddc2u, 0x45165e59u, 0x4d8ee751u, 0x8c52f662u}},
    {7, {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u},
     {0x4dfccabau, 0x190a87f0u, 0xc47362bau, 0xb6b5242au}},
    {10, {0, 0, 0, 0}, {0, 0}, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
    {10, {0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu},
     {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
    {10, {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u},
     {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
};

TEST(Cpu_Rng, Philox4x32KnownAnswers) {
  static_assert(hot::kPhiloxRounds == 7, "stochastic rounding's generator is Philox4x32-7");
  for (const Kat& k : kKats) {
    const auto f = k.rounds == 7 ? hot::philox4x32<7> : hot::philox4x32<10>;
    const hot::Philox4 r = f(k.ctr[0], k.ctr[1], k.ctr[2], k.ctr[3], k.key[0], k.key[1]);
    for (int i = 0; i < 4; ++i)
      EXPECT_EQ(r.v[i], k.expect[i]) << "word " << i << " of the " << k.rounds << "-round KAT with ctr0=" << k.ctr[0];
  }
}

TEST(Cpu_Rng, UniformFollowsDocumentedLayout) {
  const uint64_t seeds[] = {0ull, 1ull, 0x123456789abcdef0ull, ~0ull};
  // (R, C) and the elements looked at: the corners, the 4-row, 8-column, 64-row and 256-column boundaries.
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1}, {3, 5}, {64, 256}, {130, 515}, {1 << 20, 3000},
                                                {int64_t(1) << 33, 8}};
  for (uint64_t s : seeds)
    for (uint32_t st : {0u, 1u, 7u})
      for (auto [R, C] : shapes)
        for (int64_t r : {int64_t(0), int64_t(1), int64_t(3), int64_t(4), int64_t(63), int64_t(64), R - 1})
          for (int64_t c : {int64_t(0), int64_t(1), int64_t(7), int64_t(8), int64_t(255), int64_t(256), C - 1}) {
            if (r >= R || c >= C) continue;
            const float u = hot::sr_uniform(s, st, R, C, r, c);
            EXPECT_EQ(f32_bits(u), f32_bits(ref_uniform(s, st, R, C, r, c)))
                << "seed " << s << " stream " << st << " R " << R << " C " << C << " r " << r << " c " << c;
            EXPECT_GE(u, 0.0f);
            EXPECT_LT(u, 1.0f);
          }
  // Spelled out for one element: the row word of r, the column word of c, the low half for even c.
  const uint32_t a = hot::philox4x32<7>(1 * 3 + 1, 0, 1, 1, 99, 0).v[5 % 4];  // (R + 3) / 4 = 3 row calls a block
  const uint32_t b = hot::philox4x32<7>(0 * 38 + 37, 0, 1, 2, 99, 0).v[(300 / 2) % 4];  // 38 column calls a block
  EXPECT_EQ(hot::sr_uniform(99, 1, 10, 300, 5, 300), static_cast<float>((a + b) & 0xffffu) * std::ldexp(1.0f, -16));
}

TEST(Cpu_Rng, UniformExtremesAreInRange) {
  EXPECT_EQ(hot::sr_half_to_uniform(0u), 0.0f);
  EXPECT_LT(hot::sr_half_to_uniform(0xffffu), 1.0f);
  EXPECT_EQ(hot::sr_half_to_uniform(0xffffu), 1.0f - std::ldexp(1.0f, -16));
  EXPECT_EQ(hot::sr_half_to_uniform(0x8000u), 0.5f);
  EXPECT_EQ(hot::sr_half_to_uniform(0xffff8000u), 0.5f);  // only the low 16 bits count
  for (int64_t c : {0, 1}) {
    EXPECT_EQ(hot::sr_pair_uniform(0xffffffffu, 0u, c), 1.0f - std::ldexp(1.0f, -16));
    EXPECT_EQ(hot::sr_pair_uniform(0x80008000u, 0x80008000u, c), c ? std::ldexp(1.0f, -16) : 0.0f);  // wraps; carry
  }
}

TEST(Cpu_Rng, UniformMomentsAndBuckets) {
  // n uniforms of one operand: mean 1/2 (sd 1/sqrt(12 n)), variance 1/12, 16 buckets each n/16 (chi-square, 15 dof).
  const int64_t R = 512, C = 512, n = R * C;
  double s = 0, s2 = 0;
  std::vector<int> buckets(16, 0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      const double u = hot::sr_uniform(42, 0, R, C, r, c);
      s += u;
      s2 += u * u;
      buckets[static_cast<int>(u * 16)]++;
    }
  const double mean = s / n, var = s2 / n - mean * mean;
  EXPECT_NEAR(mean, 0.5, 6.0 / std::sqrt(12.0 * n));
  EXPECT_NEAR(var, 1.0 / 12.0, 6.0 * std::sqrt(1.0 / 180.0 / n));  // sd of sample var of U(0,1)
  double chi2 = 0;
  for (int b : buckets) chi2 += (b - n / 16.0) * (b - n / 16.0) / (n / 16.0);
  EXPECT_LT(chi2, 60.0);  // P(chi2_15 > 60) ~ 1e-7
}

// Pairwise independence (rng.h): over many seeds, the uniforms of two elements that share a row word, a column word,
// one 32-bit sum (c, c ^ 1 of one row), or the column word from opposite halves, fall into the 8 x 8 cells of
// [0, 1)^2 alike (chi-square, 63 dof) and are uncorrelated. The same statistic on one element against itself must
// fail: the test can tell dependence.
TEST(Cpu_Rng, UniformsOfTwoElementsAreIndependent) {
  const int64_t R = 200, C = 600;
  struct Pair {
    int64_t r0, c0, r1, c1;
    bool independent;
  };
  const Pair pairs[] = {
      {5, 10, 5, 200, true},    // one row word, two column words
      {5, 10, 40, 10, true},    // one column word, two row words
      {5, 10, 5, 11, true},     // the two halves of one sum
      {5, 10, 40, 11, true},    // one column word, opposite halves, two row words
      {5, 10, 70, 10, true},    // nothing shared: other 64-row block
      {5, 300, 5, 301, true},   // the two halves, second 256-column block
      {5, 10, 5, 10, false},    // the element itself
  };
  const int n = 1 << 14;
  for (const Pair& q : pairs) {
    std::vector<int> cells(64, 0);
    double sx = 0, sy = 0, sxy = 0, sxx = 0, syy = 0;
    for (int i = 0; i < n; ++i) {
      const uint64_t seed = 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(i + 1);
      const double x = hot::sr_uniform(seed, 1, R, C, q.r0, q.c0), y = hot::sr_uniform(seed, 1, R, C, q.r1, q.c1);
      cells[static_cast<int>(x * 8) * 8 + static_cast<int>(y * 8)]++;
      sx += x, sy += y, sxy += x * y, sxx += x * x, syy += y * y;
    }
    double chi2 = 0;
    for (int k : cells) chi2 += (k - n / 64.0) * (k - n / 64.0) / (n / 64.0);
    const double cov = sxy / n - (sx / n) * (sy / n);
    const double rho = cov / std::sqrt((sxx / n - (sx / n) * (sx / n)) * (syy / n - (sy / n) * (sy / n)));
    SCOPED_TRACE(testing::Message() << "(" << q.r0 << ", " << q.c0 << ") and (" << q.r1 << ", " << q.c1 << ")");
    if (q.independent) {
      EXPECT_LT(chi2, 130.0);  // chi2_63: mean 63, sd 11.2; P(> 130) ~ 1e-7
      EXPECT_LT(std::fabs(rho), 6.0 / std::sqrt(static_cast<double>(n)));
    } else {
      EXPECT_GT(chi2, 1000.0);
    }
  }
}

TEST(Cpu_Rng, StreamsSeedsAndCallsDecorrelate) {
  // The Philox words behind the uniforms (32 bits each): 3 seeds x 2 streams x 2 kinds x 64 calls x 4 words.
  std::set<uint32_t> seen;
  int collisions = 0;
  for (uint64_t seed : {1ull, 2ull, (1ull << 32) + 1})
    for (uint32_t st : {0u, 1u})
      for (uint32_t kind : {hot::kSrRowCall, hot::kSrColumnCall})
        for (uint64_t g = 0; g < 64; ++g) {
          const hot::Philox4 r = hot::sr_call(seed, st, kind, g);
          for (uint32_t w : r.v)
            if (!seen.insert(w).second) ++collisions;
        }
  // 3072 draws out of 2^32 values: expected collisions ~0.001.
  EXPECT_LE(collisions, 1);
  // The high word of the seed, the stream, the kind and the high part of the call index matter.
  EXPECT_NE(hot::sr_call(1, 0, 1, 5).v[0], hot::sr_call(1 + (1ull << 32), 0, 1, 5).v[0]);
  EXPECT_NE(hot::sr_call(1, 0, 1, 5).v[0], hot::sr_call(1, 1, 1, 5).v[0]);
  EXPECT_NE(hot::sr_call(1, 0, 1, 5).v[0], hot::sr_call(1, 0, 2, 5).v[0]);
  EXPECT_NE(hot::sr_call(1, 0, 1, 5).v[0], hot::sr_call(1, 0, 1, 5 + (1ull << 32)).v[0]);
  // Rows past 2^34 and columns past 2^35 still reach distinct calls.
  EXPECT_NE(hot::sr_row_call_index(int64_t(1) << 36, int64_t(1) << 34, 0),
            hot::sr_row_call_index(int64_t(1) << 36, 0, 0));
  EXPECT_NE(hot::sr_column_call_index(int64_t(1) << 36, 0, int64_t(1) << 35),
            hot::sr_column_call_index(int64_t(1) << 36, 0, 0));
}

}  // namespace
