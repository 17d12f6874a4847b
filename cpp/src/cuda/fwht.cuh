// Device building blocks shared by the CUDA kernels: the FWHT butterfly (the order fixed by SPEC /
// the CPU backend), the HLA row order as a compile-time function, block reductions.
#pragma once

#include <cstdint>

#include "hot/quant_rules.h"

namespace hot::cuda {

// In-register fast Walsh-Hadamard transform of B values, natural (Sylvester) order, no normalisation:
// for h = 1, 2, 4, ... < B: for each pair (j, j + h) in blocks of 2h: (a, b) -> (a + b, a - b) in fp32.
// With block < B (a run-time value) only the stages h < block run: B / block independent transforms of size block.
template <int B>
__device__ __forceinline__ void fwht_regs(float (&x)[B], int block = B) {
#pragma unroll
  for (int h = 1; h < B; h *= 2) {
    if (h >= block) break;
#pragma unroll
    for (int j = 0; j < B; ++j) {
      if ((j & h) == 0) {
        const float a = x[j], b = x[j + h];
        x[j] = __fadd_rn(a, b);
        x[j + h] = __fsub_rn(a, b);
      }
    }
  }
}

// kHlaOrder[k] as a constant expression usable as a register index after unrolling.
__host__ __device__ constexpr int hla_order(int k) {
  constexpr int o[16] = {0, 8, 2, 12, 10, 3, 4, 14, 11, 1, 6, 15, 9, 7, 13, 5};
  return o[k];
}
constexpr bool hla_order_matches() {
  for (int k = 0; k < 16; ++k)
    if (hla_order(k) != kHlaOrder[k]) return false;
  return true;
}
static_assert(hla_order_matches(), "hla_order must equal hot::kHlaOrder");

// The rules of hot/quant_rules.h with fewer instructions, bit-identical for the inputs their callers pass (the g_y
// pass, compress_columns): the callers handle inv == 0 (an all-zero or non-finite amax: every code is 0) once per
// unit of work, or pass only finite v, for which inv == 0 gives 0 here too; otherwise these run only with inv != 0,
// which implies a finite, non-zero amax, so |v * inv| < qmax + 1/2 and |v * inv + u| <= qmax + 1. (A check of inv in
// here became a branch per element in the unrolled loops: two more instructions each, in SASS.)
// The rounding to an integer is an fp32 add of 1.5 * 2^23 (where the float's ulp is 1; exact for |x| < 2^22), in
// the rounding direction of the rule (to nearest even, or down), instead of a float-to-int conversion, which the
// GPU issues at a quarter of an add's rate (it throttled the g_y pass's quantisation): the code is the low byte of
// the sum's bits (two's complement of the integer). Round-to-nearest needs no clamp (|v * inv| < qmax + 1/2); the
// stochastic rule clamps the sum v * inv + u to [-qmax, qmax] first (floor is monotone: the clamped integer).
constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23
__device__ __forceinline__ uint32_t q_nearest_bits(float v, float inv, float pre) {
  return __float_as_uint(__fadd_rn(__fmul_rn(__fmul_rn(v, pre), inv), kRoundMagic));
}
__device__ __forceinline__ uint32_t q_stochastic_bits(float v, float inv, float pre, float qmax, float u) {
  const float s = __fadd_rn(__fmul_rn(__fmul_rn(v, pre), inv), u);
  return __float_as_uint(__fadd_rd(fminf(fmaxf(s, -qmax), qmax), kRoundMagic));
}
__device__ __forceinline__ int8_t q_nearest(float v, float inv, float pre) {
  return static_cast<int8_t>(q_nearest_bits(v, inv, pre) & 0xffu);
}

// Codes a, b, c, d (the low bytes of four words: ints in -127..127, or the *_bits above) as bytes 0..3 of a word:
// 3 byte permutes.
__device__ __forceinline__ uint32_t pack_codes(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
}

// The 4 x 4 byte transpose of words a, b, c, d (4 bytes each, low to high): out[s] holds byte s of a, b, c, d.
__device__ __forceinline__ void transpose_bytes4(uint32_t a, uint32_t b, uint32_t c, uint32_t d, uint32_t (&out)[4]) {
  // ab_lo = a0 b0 a1 b1, ab_hi = a2 b2 a3 b3 (bytes low to high); the same for c, d
  const uint32_t ab_lo = __byte_perm(a, b, 0x5140), ab_hi = __byte_perm(a, b, 0x7362);
  const uint32_t cd_lo = __byte_perm(c, d, 0x5140), cd_hi = __byte_perm(c, d, 0x7362);
  out[0] = __byte_perm(ab_lo, cd_lo, 0x5410);  // a0 b0 c0 d0
  out[1] = __byte_perm(ab_lo, cd_lo, 0x7632);  // a1 b1 c1 d1
  out[2] = __byte_perm(ab_hi, cd_hi, 0x5410);
  out[3] = __byte_perm(ab_hi, cd_hi, 0x7632);
}

// scale[i] / inv[i] / pre[i] of n quantisers from their amax keys (hot/quant_rules.h), grid-stride over the
// threads of the launch.
__device__ __forceinline__ void store_scales_from_keys(const unsigned* keys, int64_t n, int qmax, float* scale,
                                                       float* inv, float* pre) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const QuantScale qs = quant_scale_from_amax(amax_from_key(keys[i]), qmax);
    scale[i] = qs.scale;
    inv[i] = qs.inv;
    pre[i] = qs.pre;
  }
}

__device__ __forceinline__ uint32_t warp_max_u32(uint32_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Max over the block (any blockDim.x multiple of 32, at most 1024); the result is valid in thread 0.
// `red`: 32 words of shared memory that no thread touches during the call (the barrier at its start also waits
// for every thread to finish with what was there before, so a caller may lend a buffer it is done with).
__device__ __forceinline__ uint32_t block_max_u32(uint32_t v, uint32_t* red) {
  v = warp_max_u32(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int nw = (blockDim.x + 31) >> 5;
    v = lane < nw ? red[lane] : 0u;
    v = warp_max_u32(v);
  }
  return v;
}
__device__ __forceinline__ uint32_t block_max_u32(uint32_t v) {
  __shared__ uint32_t red[32];
  return block_max_u32(v, red);
}

}  // namespace hot::cuda
