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

TEST(Cpu_Rng, UniformFollowsDocumentedCounterLayout) {
  const uint64_t seeds[] = {0ull, 1ull, 0x123456789abcdef0ull, ~0ull};
  const uint64_t idx[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 1000003, (1ull << 35) - 1, (1ull << 35), (1ull << 35) + 6,
                          0xfedcba9876543ull};
  for (uint64_t s : seeds)
    for (uint32_t st : {0u, 1u, 7u})
      for (uint64_t e : idx) {
        const float u = hot::sr_uniform(s, st, e);
        EXPECT_EQ(f32_bits(u), f32_bits(ref_uniform(s, st, e))) << "seed " << s << " stream " << st << " index " << e;
        EXPECT_GE(u, 0.0f);
        EXPECT_LT(u, 1.0f);
        const hot::Philox4 g = hot::sr_group_bits(s, st, e >> 3);
        EXPECT_EQ(f32_bits(u), f32_bits(hot::sr_group_uniform(g, static_cast<unsigned>(e & 7))));
        // Spelled out: word (e >> 1) & 3, low half for even e, high half for odd e.
        const uint32_t w = g.v[(e >> 1) & 3];
        EXPECT_EQ(u, static_cast<float>((e & 1) ? (w >> 16) : (w & 0xffffu)) / 65536.0f);
      }
  // Eight consecutive elements share one Philox call: their uniforms are the 8 halves of its 4 words.
  const hot::Philox4 g = hot::sr_group_bits(99, 1, 5);
  for (unsigned j = 0; j < 8; ++j) {
    const uint32_t h = (g.v[j / 2] >> (16 * (j % 2))) & 0xffffu;
    EXPECT_EQ(hot::sr_uniform(99, 1, 40 + j), static_cast<float>(h) * std::ldexp(1.0f, -16)) << "element " << j;
  }
}

TEST(Cpu_Rng, UniformExtremesAreInRange) {
  EXPECT_EQ(hot::sr_half_to_uniform(0u), 0.0f);
  EXPECT_LT(hot::sr_half_to_uniform(0xffffu), 1.0f);
  EXPECT_EQ(hot::sr_half_to_uniform(0xffffu), 1.0f - std::ldexp(1.0f, -16));
  EXPECT_EQ(hot::sr_half_to_uniform(0x8000u), 0.5f);
  EXPECT_EQ(hot::sr_half_to_uniform(0xffff8000u), 0.5f);  // only the low 16 bits count
  const hot::Philox4 ones{{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}};
  for (unsigned j = 0; j < 8; ++j) EXPECT_EQ(hot::sr_group_uniform(ones, j), 1.0f - std::ldexp(1.0f, -16));
}

TEST(Cpu_Rng, UniformMomentsAndBuckets) {
  // n uniforms: mean 1/2 (sd 1/sqrt(12 n)), variance 1/12, 16 buckets each n/16 (chi-square, 15 dof).
  const int n = 1 << 18;
  double s = 0, s2 = 0;
  std::vector<int> buckets(16, 0);
  for (int i = 0; i < n; ++i) {
    const double u = hot::sr_uniform(42, 0, static_cast<uint64_t>(i));
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

TEST(Cpu_Rng, StreamsSeedsAndIndicesDecorrelate) {
  // The Philox words behind the uniforms (32 bits each): 3 seeds x 2 streams x 128 groups x 4 words.
  std::set<uint32_t> seen;
  int collisions = 0;
  for (uint64_t seed : {1ull, 2ull, (1ull << 32) + 1})
    for (uint32_t st : {0u, 1u})
      for (uint64_t g = 0; g < 128; ++g) {
        const hot::Philox4 r = hot::sr_group_bits(seed, st, g);
        for (uint32_t w : r.v)
          if (!seen.insert(w).second) ++collisions;
      }
  // 3072 draws out of 2^32 values: expected collisions ~0.001.
  EXPECT_LE(collisions, 1);
  // 16-bit uniforms: 3072 draws out of 2^16 values collide ~n^2 / 2^17 = 72 times (sd ~8.5).
  std::set<uint32_t> seen16;
  int coll16 = 0;
  for (uint64_t e = 0; e < 3072; ++e)
    if (!seen16.insert(f32_bits(hot::sr_uniform(3, 0, e))).second) ++coll16;
  EXPECT_GT(coll16, 72 - 45);
  EXPECT_LT(coll16, 72 + 45);
  // The high word of the seed matters, the stream matters, the high part of the index matters.
  EXPECT_NE(hot::sr_group_bits(1, 0, 5).v[0], hot::sr_group_bits(1 + (1ull << 32), 0, 5).v[0]);
  EXPECT_NE(hot::sr_group_bits(1, 0, 5).v[0], hot::sr_group_bits(1, 1, 5).v[0]);
  EXPECT_NE(hot::sr_group_bits(1, 0, 5).v[0], hot::sr_group_bits(1, 0, 5 + (1ull << 32)).v[0]);
  EXPECT_NE(hot::sr_uniform(1, 0, 5), hot::sr_uniform(1, 0, 5 + (1ull << 35)));
}

}  // namespace
