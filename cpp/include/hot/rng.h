// Counter-based random numbers for stochastic rounding (SPEC §5), shared by every backend.
//
// The generator is Philox4x32-10 (Salmon et al., SC'11) with the standard constants
//   multipliers 0xD2511F53, 0xCD9E8D57; Weyl increments 0x9E3779B9, 0xBB67AE85.
// For element index e (row-major index in the logical, unpadded operand) of RNG stream s under seed k:
//   key     = (k & 0xffffffff, k >> 32)
//   counter = ((e >> 2) & 0xffffffff, (e >> 34), s, 0)
//   w       = word (e & 3) of Philox4x32-10(counter, key)
//   u       = (w >> 8) * 2^-24                       (a float in [0, 1), exact in fp32)
// The value depends only on (seed, stream, element index), so every thread count, tiling and backend
// draws the same u for the same element. Streams in use: see rng_stream below.
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

HOT_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(0xD2511F53u, c0, hi0, lo0);
    philox_mulhilo(0xCD9E8D57u, c2, hi1, lo1);
    uint32_t n0 = hi1 ^ c1 ^ k0;
    uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// All four uniforms of the group of elements 4g .. 4g+3.
HOT_HD Philox4 sr_group_bits(uint64_t seed, uint32_t stream, uint64_t group) {
  return philox4x32_10(static_cast<uint32_t>(group), static_cast<uint32_t>(group >> 32), stream, 0u,
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

HOT_HD float sr_bits_to_uniform(uint32_t w) { return static_cast<float>(w >> 8) * (1.0f / 16777216.0f); }

// u in [0, 1) for element `index` of RNG stream `stream` under `seed`.
HOT_HD float sr_uniform(uint64_t seed, uint32_t stream, uint64_t index) {
  Philox4 r = sr_group_bits(seed, stream, index >> 2);
  return sr_bits_to_uniform(r.v[index & 3]);
}

}  // namespace hot
