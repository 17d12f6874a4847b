// Counter-based random numbers for stochastic rounding (SPEC §5), shared by every backend.
//
// The generator is Philox4x32-7 (Salmon et al., SC'11: 7 rounds, the fewest with which Philox4x32 passes TestU01's
// BigCrush; 10 is their general-purpose default, 3 rounds of margin that stochastic rounding, which needs uniform u
// independent of v, does not use: the g_y pass spends ~40 % of its instructions in Philox, and 7 rounds make its
// step 1 % faster, benchmarks/NOTES.md) with the standard constants
//   multipliers 0xD2511F53, 0xCD9E8D57; Weyl increments 0x9E3779B9, 0xBB67AE85.
// For element index e (row-major index in the logical, unpadded operand) of RNG stream s under seed k:
//   key     = (k & 0xffffffff, k >> 32)
//   counter = ((e >> 3) & 0xffffffff, (e >> 35), s, 0)
//   w       = word ((e >> 1) & 3) of Philox4x32-7(counter, key)
//   u       = ((w >> (16 * (e & 1))) & 0xffff) * 2^-16   (a float in [0, 1), exact in fp32)
// i.e. one Philox call serves 8 consecutive elements with 16-bit uniforms (low half first).
// The value depends only on (seed, stream, element index), so every thread count, tiling and backend
// draws the same u for the same element. Streams in use: see rng_stream below.
//
// Bias of 16-bit uniforms: u takes the values j * 2^-16 (j = 0 .. 65535). For t = v * inv with
// fractional part f, P(floor(t + u) = floor(t) + 1) = #{j : j >= (1 - f) 2^16} / 2^16 = floor(f 2^16) / 2^16,
// which lies in (f - 2^-16, f]: E[q] - t is in (-2^-16, 0], i.e. at most 2^-16 of a quantisation step
// (zero when f is a multiple of 2^-16; 24-bit uniforms would give 2^-24). The fp32 rounding of t + u
// adds the same tiny effect as with any uniform width. For the 4- and 8-bit grids of HOT this is far
// below the noise of stochastic rounding itself (variance f (1 - f) of a step squared).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define HOT_HD __host__ __device__ __forceinline__
#else
#define HOT_HD inline
#endif

namespace hot {

// RNG stream ids of the stochastically rounded operands.
namespace rng_stream {
constexpr uint32_t gx_grad = 0;  // G~ = g_y blockdiag(H_b), the g_x path operand (SPEC §3 step 3)
constexpr uint32_t gw_grad = 1;  // G^ = blockdiag(H^) g_y, the g_w path operand (SPEC §4 step 2)
}  // namespace rng_stream

struct Philox4 {
  uint32_t v[4];
};

HOT_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

// One Philox round with its round keys.
HOT_HD void philox_round(uint32_t& c0, uint32_t& c1, uint32_t& c2, uint32_t& c3, uint32_t k0, uint32_t k1) {
  uint32_t hi0, lo0, hi1, lo1;
  philox_mulhilo(0xD2511F53u, c0, hi0, lo0);
  philox_mulhilo(0xCD9E8D57u, c2, hi1, lo1);
  const uint32_t n0 = hi1 ^ c1 ^ k0;
  const uint32_t n2 = hi0 ^ c3 ^ k1;
  c0 = n0;
  c1 = lo1;
  c2 = n2;
  c3 = lo0;
}

// Philox4x32 with R rounds (Random123's philox4x32_R).
template <int R>
HOT_HD Philox4 philox4x32(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int round = 0; round < R; ++round) {
    philox_round(c0, c1, c2, c3, k0, k1);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// The rounds of stochastic rounding's generator.
constexpr int kPhiloxRounds = 7;

// The round keys of a seed, formed once per kernel launch (host side) instead of once per call: the same numbers as
// philox4x32's running keys.
struct PhiloxKeys {
  uint32_t k0[kPhiloxRounds], k1[kPhiloxRounds];
};
inline PhiloxKeys philox_keys(uint64_t seed) {
  PhiloxKeys k{};
  uint32_t a = static_cast<uint32_t>(seed), b = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < kPhiloxRounds; ++round, a += 0x9E3779B9u, b += 0xBB67AE85u)
    k.k0[round] = a, k.k1[round] = b;
  return k;
}

// sr_group_bits with the seed's round keys (identical bits).
HOT_HD Philox4 sr_group_bits_keyed(const PhiloxKeys& k, uint32_t stream, uint64_t group) {
  uint32_t c0 = static_cast<uint32_t>(group), c1 = static_cast<uint32_t>(group >> 32), c2 = stream, c3 = 0u;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int round = 0; round < kPhiloxRounds; ++round) philox_round(c0, c1, c2, c3, k.k0[round], k.k1[round]);
  return Philox4{{c0, c1, c2, c3}};
}

// Number of consecutive elements served by one Philox call.
constexpr int kSrGroup = 8;

// The random bits of the group of elements 8g .. 8g+7 (g = e >> 3).
HOT_HD Philox4 sr_group_bits(uint64_t seed, uint32_t stream, uint64_t group) {
  return philox4x32<kPhiloxRounds>(static_cast<uint32_t>(group), static_cast<uint32_t>(group >> 32), stream, 0u,
                                   static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// A 16-bit value h (0 .. 65535) as the uniform h * 2^-16.
HOT_HD float sr_half_to_uniform(uint32_t h) { return static_cast<float>(h & 0xffffu) * (1.0f / 65536.0f); }

// u of element j (0 .. 7) of a group: the low (j even) or high (j odd) half of word j >> 1.
HOT_HD float sr_group_uniform(const Philox4& r, unsigned j) {
  return sr_half_to_uniform(r.v[(j >> 1) & 3] >> (16 * (j & 1)));
}

// u in [0, 1) for element `index` of RNG stream `stream` under `seed`.
HOT_HD float sr_uniform(uint64_t seed, uint32_t stream, uint64_t index) {
  const Philox4 r = sr_group_bits(seed, stream, index >> 3);
  return sr_group_uniform(r, static_cast<unsigned>(index & 7));
}

}  // namespace hot
