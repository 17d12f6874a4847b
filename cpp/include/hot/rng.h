// Counter-based random numbers for stochastic rounding (SPEC §5), shared by every backend.
//
// The generator is Philox4x32-7 (Salmon et al., SC'11: 7 rounds, the fewest with which Philox4x32 passes TestU01's
// BigCrush; 10 is their general-purpose default, 3 rounds of margin that stochastic rounding, which needs uniform u
// independent of v, does not use: the g_y pass spends ~40 % of its instructions in Philox, and 7 rounds make its
// step 1 % faster, benchmarks/NOTES.md) with the standard constants
//   multipliers 0xD2511F53, 0xCD9E8D57; Weyl increments 0x9E3779B9, 0xBB67AE85.
// Element (r, c) of an R x C operand (row r, column c of the logical, unpadded matrix) of RNG stream s under seed k
// rounds with a uniform formed from two words (SPEC §5):
//   a = word (r & 3) of P(row call (c >> 8) * ceil(R / 4) + (r >> 2), 1)       the row word of r, per 256 columns
//   b = word ((c >> 1) & 3) of P(column call (r >> 6) * ceil(C / 8) + (c >> 3), 2)  the column word of c and c ^ 1,
//                                                                                   per 64 rows
//   w = a + b (mod 2^32)
//   u = ((w >> (16 * (c & 1))) & 0xffff) * 2^-16   (a float in [0, 1), exact in fp32)
// where P(i, t) = Philox4x32-7(counter = (i & 0xffffffff, i >> 32, s, t), key = (k & 0xffffffff, k >> 32)).
// The value depends only on (seed, stream, R, C, r, c), so every thread count, tiling and backend draws the same u for
// the same element. Streams in use: see rng_stream below.
//
// Why two words: any two distinct elements have independent uniforms. They differ in the row word or in the column
// word, and (a + b) mod 2^32 with one term uniform and independent of everything else is uniform and independent of
// the other element's value; the two 16-bit halves of one sum are independent too (the high half has its own uniform
// bits, whatever carry the low half sends it). Pairwise independence is all that the mean and the variance of a sum of
// rounding errors depend on, so every linear function of an operand's codes (a GEMM's outputs, and the gradients
// computed from them) has exactly the mean and variance it would have with independent uniforms; only joint laws of
// four or more elements differ. The cost: a 64 x 256 tile draws 16 row calls and 32 column calls instead of 2048
// calls of 8 uniforms, and a thread forms two uniforms by one 32-bit addition (benchmarks/NOTES.md).
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

// Column words of one column call: 8 consecutive columns (4 pairs).
constexpr int kSrGroup = 8;
// The counter word that tells row calls from column calls.
constexpr uint32_t kSrRowCall = 1u, kSrColumnCall = 2u;

HOT_HD Philox4 sr_call(uint64_t seed, uint32_t stream, uint32_t kind, uint64_t call) {
  return philox4x32<kPhiloxRounds>(static_cast<uint32_t>(call), static_cast<uint32_t>(call >> 32), stream, kind,
                                   static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// The row call of (r, c) in an operand of R rows; its word r & 3 is the row word.
HOT_HD uint64_t sr_row_call_index(int64_t R, int64_t r, int64_t c) {
  return static_cast<uint64_t>(c >> 8) * static_cast<uint64_t>((R + 3) / 4) + static_cast<uint64_t>(r >> 2);
}
// The column call of (r, c) in an operand of C columns; its word (c >> 1) & 3 is the column word.
HOT_HD uint64_t sr_column_call_index(int64_t C, int64_t r, int64_t c) {
  return static_cast<uint64_t>(r >> 6) * static_cast<uint64_t>((C + 7) / 8) + static_cast<uint64_t>(c >> 3);
}

// A 16-bit value h (0 .. 65535) as the uniform h * 2^-16.
HOT_HD float sr_half_to_uniform(uint32_t h) { return static_cast<float>(h & 0xffffu) * (1.0f / 65536.0f); }

// u of column c from its row word a and column word b.
HOT_HD float sr_pair_uniform(uint32_t a, uint32_t b, int64_t c) {
  return sr_half_to_uniform((a + b) >> (16 * (c & 1)));
}

// u in [0, 1) of element (r, c) of an R x C operand of RNG stream `stream` under `seed`.
HOT_HD float sr_uniform(uint64_t seed, uint32_t stream, int64_t R, int64_t C, int64_t r, int64_t c) {
  const uint32_t a = sr_call(seed, stream, kSrRowCall, sr_row_call_index(R, r, c)).v[r & 3];
  const uint32_t b = sr_call(seed, stream, kSrColumnCall, sr_column_call_index(C, r, c)).v[(c >> 1) & 3];
  return sr_pair_uniform(a, b, c);
}

// The uniforms of consecutive elements of an R x C operand, each Philox call drawn once for the elements it serves
// (the generic paths; the same values as sr_uniform).
struct SrWalk {
  uint64_t seed;
  uint32_t stream;
  int64_t R, C;
  uint64_t row_call = ~uint64_t(0), column_call = ~uint64_t(0);
  Philox4 a{}, b{};
  HOT_HD float uniform(int64_t r, int64_t c) {
    const uint64_t rc = sr_row_call_index(R, r, c), cc = sr_column_call_index(C, r, c);
    if (rc != row_call) a = sr_call(seed, stream, kSrRowCall, row_call = rc);
    if (cc != column_call) b = sr_call(seed, stream, kSrColumnCall, column_call = cc);
    return sr_pair_uniform(a.v[r & 3], b.v[(c >> 1) & 3], c);
  }
};

}  // namespace hot
