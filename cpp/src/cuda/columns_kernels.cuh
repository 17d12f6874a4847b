// compress_columns (SPEC §8): the ABC buffer of a convolution's im2col columns X = im2col(Q), straight from the int8
// map Q (channels-last), never writing X. Included by layer_ops.cu (the backend) and by the host emulation test
// (cpp/tests/emu), which runs these kernels on the CPU against the CPU backend, bit for bit.
//
// The output q_t is (kh*kw*C) x K_pad: row `col` of it holds, block after block, the rank kept coefficients of
// column col of each 16-row block of X. A CTA takes a tile of TB consecutive blocks (TB*rank <= 128 bytes of every
// output row, TB a multiple of 4), decodes its TB*16 rows' window origins into shared memory once (64-bit divisions,
// once per row; rows past the last get an origin far outside the map, so they read as zeros), then walks the columns
// in chunks of 256 (each chunk's units decoded once into shared memory, unit_at; a thread's items stepped with a
// carry, no division per item); where the tiles are few, the chunks are spread over grid.y as well (CTA (x, y) takes
// tile x's chunks y, y + gridDim.y, ...). A work item is one unit of V channels (V = 4: one 32-bit load per gathered
// pixel, when the map's channel run and row stride allow; V = 3: three byte loads, for C a multiple of 3 (an RGB
// image: a stem conv); else V = 1) of one block: consecutive threads take consecutive units of
// one block (a warp's gathers read consecutive words of one map pixel); the item gathers its 16 x V values, transforms
// each column in registers (integers of magnitude at most 16 * 127, exact in fp32, hence the CPU's values whatever the
// butterfly order and arithmetic: V = 4 and 3 transform two channels per int32 register, split_lanes (V = 3: the
// fourth byte is 0, its lane all-zero coefficients, never stored); V = 1 fwht_regs<16>
// in fp32) and keeps the rank rows of kHlaOrder.
// Pass 1 (kQuant = false) takes their amax (a block max, one atomicMax per CTA; V = 4, 3: the range of the
// transform's biased 16-bit lanes, two per instruction, turned into a key once per thread). Pass 2 quantises them to
// nearest with the scale of that amax (hot/quant_rules.h's rule in fewer instructions, the same bits for these finite
// values; V = 4, 3: lane_code, no conversions) into a shared tile, one row per column (rows of TB*rank + 4 bytes,
// ordered by channel-in-unit first, so a warp's stores fall in distinct banks), then copies the tile out, a warp per
// tile row and a 32-bit word per lane: each output row gets TB*rank contiguous bytes (<= 128: one store instruction
// per row of a full tile, both pointers stepped). The tile of the last block also writes the zeros of columns
// K..K_pad. The gathers' addresses: each row's window origin as an element offset into the map (shared memory) plus
// the item's kernel-offset-and-channel offset, with unsigned bounds checks.
#pragma once

#include <algorithm>
#include <type_traits>

#include "common.cuh"
#include "conv_rules.h"
#include "fwht.cuh"
#include "hot/quant_rules.h"

namespace hot::cuda {

namespace {

constexpr int kColumnsThreads = 256;
constexpr int kColumnsChunk = 256;       // columns per pass over the tile
constexpr int kColumnsMaxTileRows = 512;  // TB * 16 <= this
constexpr int kColumnsMaxPitch = 132;     // TB * rank + 4
constexpr int64_t kColumnsGridTarget = 1024;  // CTAs a launch aims at (several per SM) when its tiles are few

// TB: the blocks of one tile (a multiple of 4, so that every tile starts on a 4-byte boundary of the output rows).
inline int columns_tile_blocks(int rank) { return std::min(32, std::max(4, 128 / rank / 4 * 4)); }

// Two 16-bit lanes in one int32: x = lo + 65536 * hi with lo, hi in [-32768, 32767]. Sums and differences of such
// registers are the lane-wise sums and differences while every lane stays in that range, so a Walsh-Hadamard transform
// of 16 registers transforms both lanes exactly. The 4 int8 channels of a gathered word enter offset by +128 (byte ^
// 0x80: 0..255, no borrow between lanes): channels 0, 2 in `even`, 1, 3 in `odd`. The offset adds 128 * 16 = 2048 to
// coefficient 0 of each lane only (H times the all-ones vector), removed after the transform (fwht_lanes); every
// coefficient is then the exact integer of the channel's transform (|.| <= 16 * 127 = 2032), the CPU's fp32 values.
__device__ __forceinline__ void split_lanes(uint32_t word, int32_t& even, int32_t& odd) {
  const uint32_t x = word ^ 0x80808080u;
  even = static_cast<int32_t>(x & 0x00ff00ffu);
  odd = static_cast<int32_t>((x >> 8) & 0x00ff00ffu);
}
// The transform of 16 such registers, each lane then biased by +2048: lane = coefficient + 2048 in [16, 4080], so
// that both 16-bit halves of a register hold their lane as an unsigned field (no borrow from the low lane into the
// high one). Coefficient 0 comes out of the transform biased already (the +128 offset of its 16 rows).
__device__ __forceinline__ void fwht_lanes_biased(int32_t (&x)[16]) {
#pragma unroll
  for (int h = 1; h < 16; h *= 2)
#pragma unroll
    for (int j = 0; j < 16; ++j)
      if ((j & h) == 0) {
        const int32_t a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
#pragma unroll
  for (int j = 1; j < 16; ++j) x[j] += 2048 + 2048 * 65536;
}
// The code of the biased lane `hi` (0: low half, 1: high half) of y: q_nearest(v, inv, 1) of the coefficient v
// = lane - 2048, in the low byte of the result, without the conversion instructions (a quarter of the rate of an
// add): the lane put under the exponent of 1.5 * 2^23 (a byte permute) is the float 12,584,960 + v exactly, minus
// 12,584,960 gives v; v * inv rounded to an integer, ties to even, by adding 1.5 * 2^23 (the float's ulp there is 1),
// whose low byte is then the code's two's complement. Equal to q_nearest's bits because |v * inv| <= 127 (v is one
// of the values whose amax gave inv; 127.5 is out of reach) and pre == 1: the amax of integers is 0 or >= 1, so
// quant_scale_from_amax never needs the 2^64 pre-scale here.
__device__ __forceinline__ uint32_t lane_code(int32_t y, int hi, float inv) {
  const float v = __fsub_rn(__uint_as_float(__byte_perm(static_cast<uint32_t>(y), 0x4B400000u, hi ? 0x7632u : 0x7610u)),
                            kRoundMagic + 2048.0f);  // 0x4B400000 is kRoundMagic's bits; 2048 the lane's bias
  return __float_as_uint(__fadd_rn(__fmul_rn(v, inv), kRoundMagic));
}

// The codes of the rank kept rows of one column block into dst (its row of the tile): code(k) gives bits whose low byte
// is the code of row hla_order(k). Whole 32-bit words where rank % 4 == 0 (pitch and b * rank are multiples of 4).
template <typename Code>
__device__ __forceinline__ void store_block_codes(int8_t* dst, int rank, const Code& code) {
  if (rank % 4 == 0) {
#pragma unroll
    for (int k = 0; k < 16; k += 4)
      if (k < rank) *reinterpret_cast<uint32_t*>(dst + k) = pack_codes(code(k), code(k + 1), code(k + 2), code(k + 3));
  } else {
#pragma unroll
    for (int k = 0; k < 16; ++k)
      if (k < rank) dst[k] = static_cast<int8_t>(code(k) & 0xffu);
  }
}

// (ul, b) += (dul, db) with the carry of ul into b (dul < nu).
__device__ __forceinline__ void step_item(int& ul, int& b, int dul, int db, int nu) {
  ul += dul, b += db;
  if (ul >= nu) ul -= nu, ++b;
}

struct __align__(16) ColumnsOrigin {
  int64_t off;
  int h, w;
};

// The window origin of im2col row r (of L; a row past L lies outside the map): its element offset in the map (row
// stride ldm; may lie outside) and its (h, w).
__device__ __forceinline__ ColumnsOrigin window_origin(const Col2imParams& p, int64_t r, int64_t L, int64_t ldm) {
  int64_t n = 0, ho = 0, wo = 0;
  if (r < L) im2col_pixel(p, r, n, ho, wo);
  const int h0 = r < L ? static_cast<int>(ho) * p.sh - p.ph : -(1 << 30);
  const int w0 = static_cast<int>(wo) * p.sw - p.pw;
  return {r < L ? ((n * p.H + h0) * p.W + w0) * ldm : 0, h0, w0};
}

template <bool kQuant, int V>
__global__ void __launch_bounds__(kColumnsThreads, 4)  // 64 registers: 4 CTAs (42 KB of shared memory each) per SM
    compress_columns_kernel(const int8_t* __restrict__ map, int64_t ldm, Col2imParams p, int rank, int TB,
                            unsigned* __restrict__ key, float* __restrict__ scale, int8_t* __restrict__ q,
                            int64_t ldq, int64_t K_pad) {
  // Per tile row: the window origin's element offset in the map (may lie outside) and its (h, w); per unit of the
  // chunk: its kernel offset's element offset plus channel, and its (i * dh, j * dw). 16 bytes each: one load.
  __shared__ ColumnsOrigin origin[kColumnsMaxTileRows];
  __shared__ ColumnsOrigin unit_at[kColumnsChunk];
  __shared__ __align__(16) int8_t tile[kColumnsChunk * kColumnsMaxPitch];
  __shared__ uint32_t red[32];
  const int64_t L = p.N * p.Ho * p.Wo, nblk = (L + 15) / 16, ntiles = (nblk + TB - 1) / TB;
  const int C = static_cast<int>(p.C), cu = C / V, units = p.kh * p.kw * cu, chunk_units = kColumnsChunk / V;
  const int pitch = TB * rank + 4, nthr = static_cast<int>(blockDim.x), tid = static_cast<int>(threadIdx.x);
  const bool words = ldq % 4 == 0 && reinterpret_cast<uintptr_t>(q) % 4 == 0;
  QuantScale qs{};
  if (kQuant) {
    qs = quant_scale_from_amax(amax_from_key(*key), 127);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *scale = qs.scale;
  }
  uint32_t m = 0;                                      // pass 1: the amax key (V = 1)
  uint32_t lane_max = 0u, lane_min = 0xffffffffu;      // pass 1: the biased lanes' range (V = 4, 3)
  for (int64_t tl = blockIdx.x; tl < ntiles; tl += gridDim.x) {
    const int64_t jb0 = tl * TB;
    const int nb = nblk - jb0 < TB ? static_cast<int>(nblk - jb0) : TB;  // blocks of this tile
    for (int t = tid; t < TB * 16; t += nthr) origin[t] = window_origin(p, jb0 * 16 + t, L, ldm);
    __syncthreads();
    for (int u0 = static_cast<int>(blockIdx.y) * chunk_units; u0 < units;
         u0 += static_cast<int>(gridDim.y) * chunk_units) {  // the column chunks of this CTA's grid row
      const int nu = units - u0 < chunk_units ? units - u0 : chunk_units;  // units of this chunk
      for (int ul = tid; ul < nu; ul += nthr) {  // the chunk's units decoded once, not once per item (the last
                                                 // chunk's items are past the barrier that ends it)
        const int gu = u0 + ul;
        const int ij = gu / cu, c = (gu - ij * cu) * V, i = ij / p.kw, j = ij - i * p.kw;
        const int idh = i * p.dh, jdw = j * p.dw;
        unit_at[ul] = {(static_cast<int64_t>(idh) * p.W + jdw) * ldm + c, idh, jdw};
      }
      __syncthreads();
      // items e = tid, tid + nthr, ... of nu * nb: (unit ul, block b) = (e % nu, e / nu), stepped with a carry
      const int dul = nthr % nu, db = nthr / nu;
      for (int ul = tid % nu, b = tid / nu; b < nb; step_item(ul, b, dul, db, nu)) {
        const ColumnsOrigin ua = unit_at[ul];
        const int64_t off = ua.off;  // of kernel offset (i, j), channel c
        const int idh = ua.h, jdw = ua.w;
        uint32_t word[16];  // the 16 rows' V bytes (V = 3: the fourth 0; V = 1: one byte, sign-extended)
#pragma unroll
        for (int t = 0; t < 16; ++t) {
          const ColumnsOrigin o = origin[b * 16 + t];
          const int h = o.h + idh, w = o.w + jdw;
          const bool in = static_cast<unsigned>(h) < static_cast<unsigned>(p.H) &&
                          static_cast<unsigned>(w) < static_cast<unsigned>(p.W);
          const int8_t* src = map + (o.off + off);
          if constexpr (V == 4) {
            word[t] = in ? *reinterpret_cast<const uint32_t*>(src) : 0u;
          } else if constexpr (V == 3) {
            const auto* u = reinterpret_cast<const uint8_t*>(src);
            word[t] = in ? static_cast<uint32_t>(u[0]) | (static_cast<uint32_t>(u[1]) << 8) |
                               (static_cast<uint32_t>(u[2]) << 16)
                         : 0u;
          } else {
            word[t] = in ? static_cast<uint32_t>(*src) : 0u;
          }
        }
        if constexpr (V >= 3) {
          // The transform in integers, two channels per 32-bit register (channels 0, 2 in even, 1, 3 in odd, as
          // biased 16-bit lanes, see split_lanes and fwht_lanes_biased): half the adds of a float transform per channel
          // and no conversions.
          int32_t even[16], odd[16];
#pragma unroll
          for (int t = 0; t < 16; ++t) split_lanes(word[t], even[t], odd[t]);
          fwht_lanes_biased(even);
          fwht_lanes_biased(odd);
          if (!kQuant) {  // the lanes' range, two lanes per instruction: |coefficient| <= max(mx - 2048, 2048 - mn)
#pragma unroll
            for (int k = 0; k < 16; ++k)
              if (k < rank) {
                const auto e = static_cast<uint32_t>(even[hla_order(k)]), o = static_cast<uint32_t>(odd[hla_order(k)]);
                lane_max = __vmaxu2(lane_max, __vmaxu2(e, o));
                lane_min = __vminu2(lane_min, __vminu2(e, o));
              }
          } else {
#pragma unroll
            for (int s = 0; s < V; ++s) {
              const int32_t(&y)[16] = (s & 1) ? odd : even;
              const int hi = s >> 1;
              store_block_codes(tile + (s * nu + ul) * pitch + b * rank, rank,
                                [&](int k) { return lane_code(y[hla_order(k)], hi, qs.inv); });
            }
          }
        } else {  // V = 1: one channel, a float transform
          float v[16];
#pragma unroll
          for (int t = 0; t < 16; ++t) v[t] = static_cast<float>(static_cast<int8_t>(word[t]));
          fwht_regs<16>(v);
          if (!kQuant) {
#pragma unroll
            for (int k = 0; k < 16; ++k)
              if (k < rank) m = max(m, amax_key(v[hla_order(k)]));
          } else {
            store_block_codes(tile + ul * pitch + b * rank, rank,
                              [&](int k) { return q_nearest_bits(v[hla_order(k)], qs.inv, qs.pre); });
          }
        }
      }
      if (kQuant) {
        __syncthreads();  // the tile is complete
        // row rl of the tile: channel s of unit ul (rl = s * nu + ul) = output row (u0 + ul) * V + s; its bytes
        // [jb0 * rank, end), and the zeros up to K_pad after the last block
        const int64_t start = jb0 * rank, end = jb0 + nb == nblk ? K_pad : start + int64_t{nb} * rank;
        const int seg = static_cast<int>(end - start), have = nb * rank;
        const int lane = tid & 31, warp = tid >> 5, nwarps = nthr >> 5;
        const int nw = seg / 4;  // start, K_pad and TB * rank are multiples of 4
        if (words && have == seg && nw <= 32) {
          // Every tile but the last (TB * rank <= 128 bytes): a warp per tile row, a word per lane, the rows of one
          // channel-in-unit sv after another with both pointers stepped (no index arithmetic per row).
#pragma unroll
          for (int sv = 0; sv < V; ++sv) {
            const int8_t* src = tile + (sv * nu + warp) * pitch + lane * 4;
            int8_t* dst = q + (static_cast<int64_t>(u0 + warp) * V + sv) * ldq + start + lane * 4;
            const int64_t dst_step = static_cast<int64_t>(nwarps) * V * ldq;
#pragma unroll 2
            for (int u = warp; u < nu; u += nwarps, src += nwarps * pitch, dst += dst_step)
              if (lane < nw) *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src);
          }
        } else if (words) {
          // The last tile: a warp per tile row (rows warp, warp + nwarps, ...), its lanes on the row's words, with a
          // partial word and the zeros up to K_pad; the row's (channel s, unit ul) advance with a carry.
          int rl = warp, s = 0, ul = rl;
          while (ul >= nu) ul -= nu, ++s;
          for (; rl < nu * V; rl += nwarps) {
            const int8_t* src_row = tile + rl * pitch;
            int8_t* dst_row = q + (static_cast<int64_t>(u0 + ul) * V + s) * ldq + start;
            for (int wi = lane; wi < nw; wi += 32) {
              const int8_t* src = src_row + wi * 4;
              uint32_t word = 0;
              if (wi * 4 + 4 <= have) {
                word = *reinterpret_cast<const uint32_t*>(src);
              } else {  // the last block's row ends inside this word, or the zeros past K
                for (int z = 0; z < 4; ++z)
                  if (wi * 4 + z < have) word |= static_cast<uint32_t>(static_cast<uint8_t>(src[z])) << (8 * z);
              }
              *reinterpret_cast<uint32_t*>(dst_row + wi * 4) = word;
            }
            ul += nwarps;
            while (ul >= nu) ul -= nu, ++s;
          }
        } else {
          for (int e = tid; e < nu * V * seg; e += nthr) {
            const int rl = e / seg, bi = e - rl * seg, s = rl / nu, ul = rl - s * nu;
            q[(static_cast<int64_t>(u0 + ul) * V + s) * ldq + start + bi] = bi < have ? tile[rl * pitch + bi] : 0;
          }
        }
      }
      __syncthreads();  // the tile (and, after the last chunk, the origins) are rewritten next
    }
  }
  if (!kQuant) {
    if constexpr (V >= 3) {  // the amax key of the largest |coefficient| (an integer: the key of its float)
      const int lo = max(static_cast<int>(lane_max & 0xffffu) - 2048, 2048 - static_cast<int>(lane_min & 0xffffu));
      const int hi = max(static_cast<int>(lane_max >> 16) - 2048, 2048 - static_cast<int>(lane_min >> 16));
      m = amax_key(static_cast<float>(max(0, max(lo, hi))));
    }
    m = block_max_u32(m, red);
    if (threadIdx.x == 0) atomicMax(key, m);
  }
}

// im2col_t (SPEC §8): the int8 map's im2col columns written transposed, cols_t = im2col(Q)^T (kh*kw*C x K, zero past
// L), the g_w operand of a convolution at full rank. A CTA takes `rows` consecutive rows (a multiple of 128, up to
// kIm2colTMaxRows: long runs of every output row, whose writes bound this pass) and the units of its grid row
// (blockIdx.y's share, where the row tiles are few), their window origins decoded once into shared memory. A work item
// is a unit of V channels of one kernel offset (V = 16: one 16-byte load per row, where the channel run, the map's row
// stride and its address allow; else V = 4: a 32-bit load) over 16 rows: 8 consecutive threads take one unit's 8
// consecutive items, so each of its V output rows receives 128 contiguous bytes from 8 neighbouring lanes per store,
// and the units of a warp are consecutive channel runs of one pixel. An item's 16 x V bytes are turned by byte
// permutes (4 x 4 blocks) into V rows of 16 bytes, each one 16-byte store (byte stores where cols_t's rows are not
// 16-byte aligned or past K). Channel runs of other lengths (the stem's 3 channels) take im2col_t_bytes_kernel.
constexpr int kIm2colTMaxRows = 512;
constexpr int kIm2colTThreads = 256;

template <int V>
__device__ __forceinline__ void im2col_t_load(const int8_t* src, uint32_t (&w)[V / 4]) {
  if constexpr (V == 16) {
    const uint4 v = *reinterpret_cast<const uint4*>(src);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else {
    w[0] = *reinterpret_cast<const uint32_t*>(src);
  }
}

template <int V>
__global__ void __launch_bounds__(kIm2colTThreads)
    im2col_t_kernel(const int8_t* __restrict__ map, int64_t ldm, Col2imParams p, int8_t* __restrict__ q, int64_t ldq,
                    int64_t K, bool vec, int rows, int unit_chunk) {
  static_assert(V == 4 || V == 16, "4- or 16-byte channel runs");
  constexpr int W = V / 4;  // 32-bit words of a row's V bytes
  __shared__ ColumnsOrigin origin[kIm2colTMaxRows];
  const int64_t L = p.N * p.Ho * p.Wo, r0 = static_cast<int64_t>(blockIdx.x) * rows;
  for (int t = threadIdx.x; t < rows; t += blockDim.x) origin[t] = window_origin(p, r0 + t, L, ldm);
  __syncthreads();
  const int cu = static_cast<int>(p.C) / V, u0 = static_cast<int>(blockIdx.y) * unit_chunk;
  const int nu = min(unit_chunk, p.kh * p.kw * cu - u0), nsub = rows / 16;  // this CTA's units; items per unit
  for (int e = threadIdx.x; e < nu * nsub; e += blockDim.x) {
    // e = (sb / 8, unit, sb % 8)
    const int hi = e / (nu * 8), rem = e - hi * nu * 8;
    int u = rem / 8;
    const int sb = (rem - u * 8) + 8 * hi;
    u += u0;
    const int ij = u / cu, c = (u - ij * cu) * V, i = ij / p.kw, j = ij - i * p.kw;
    const int idh = i * p.dh, jdw = j * p.dw;
    const int64_t off = (static_cast<int64_t>(idh) * p.W + jdw) * ldm + c;
    uint32_t word[16][W];  // row t's V bytes
#pragma unroll
    for (int t = 0; t < 16; ++t) {
      const ColumnsOrigin o = origin[sb * 16 + t];
      const int h = o.h + idh, w = o.w + jdw;
#pragma unroll
      for (int k = 0; k < W; ++k) word[t][k] = 0u;
      const bool in = static_cast<unsigned>(h) < static_cast<unsigned>(p.H) &&
                      static_cast<unsigned>(w) < static_cast<unsigned>(p.W);
      if (in) im2col_t_load<V>(map + (o.off + off), word[t]);
    }
    const int64_t rs = r0 + sb * 16;  // this item's first row
    const bool full = vec && rs + 16 <= K;
    const auto store = [&](int ch, uint32_t a, uint32_t b, uint32_t cc, uint32_t d) {  // 16 row bytes of channel c + ch
      int8_t* dst = q + static_cast<int64_t>(ij * static_cast<int>(p.C) + c + ch) * ldq + rs;
      if (full) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(a, b, cc, d);
      } else {
        const uint32_t x[4] = {a, b, cc, d};
        for (int t = 0; t < 16 && rs + t < K; ++t) dst[t] = static_cast<int8_t>((x[t / 4] >> (8 * (t % 4))) & 0xffu);
      }
    };
#pragma unroll
    for (int m = 0; m < W; ++m) {  // channels 4m .. 4m + 3 of the unit
      uint32_t out[4][4];  // out[k][s]: byte s of rows 4k .. 4k + 3, i.e. those rows of channel 4m + s
#pragma unroll
      for (int k = 0; k < 4; ++k)
        transpose_bytes4(word[4 * k][m], word[4 * k + 1][m], word[4 * k + 2][m], word[4 * k + 3][m], out[k]);
#pragma unroll
      for (int s2 = 0; s2 < 4; ++s2) store(4 * m + s2, out[0][s2], out[1][s2], out[2][s2], out[3][s2]);
    }
  }
}

// map_t = the int8 map (L x C, C % 16 == 0) transposed, C x Lr with zeros past L: the operand of im2col_t's shifting
// kernel. A CTA takes kTrRows pixels x kTrCols channels: the pixels' 16-byte channel runs loaded as they lie (4 lanes a
// 64-byte run) into shared memory pixel-major, 4-byte word w of pixel p at word w ^ (p / 16 % 16) of its row; then a
// thread takes 4 channels x 16 consecutive pixels: 16 word loads (the swizzle spreads the 16 pixel groups of a warp's
// lanes over the banks), a 4 x 4 byte transpose in registers, 4 16-byte stores, so that a warp's store covers 256
// contiguous bytes of each of two map_t rows. (A thread per channel writing 32 bytes, 32 rows a warp store, took 31 us
// for ResNet-50 layer1's 25.7 MB map at b128: bound by L2 write requests, benchmarks/NOTES.md.)
// mt's rows are Lr = padded_k(L) bytes long, one after another.
constexpr int kTrRows = 256, kTrCols = 64, kTrThreads = 256;

__global__ void __launch_bounds__(kTrThreads)
    map_transpose_kernel(const int8_t* __restrict__ map, int64_t ldm, int64_t L, int64_t C, int8_t* __restrict__ mt,
                         int64_t Lr) {
  static_assert(kTrRows == 16 * 16 && kTrCols == 64 && kTrThreads == 16 * 16,
                "16 pixel groups x 16 channel words: one item a thread");
  __shared__ uint32_t tile[kTrRows * (kTrCols / 4)];
  const int64_t l0 = static_cast<int64_t>(blockIdx.x) * kTrRows, c0 = static_cast<int64_t>(blockIdx.y) * kTrCols;
  const int tid = static_cast<int>(threadIdx.x);
  for (int e = tid; e < kTrRows * (kTrCols / 16); e += kTrThreads) {
    const int px = e / (kTrCols / 16), u = e % (kTrCols / 16), sw = (px >> 4) & 15;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (l0 + px < L && c0 + 16 * u < C) v = *reinterpret_cast<const uint4*>(map + (l0 + px) * ldm + c0 + 16 * u);
    uint32_t* row = tile + px * (kTrCols / 4);
    row[(4 * u) ^ sw] = v.x, row[(4 * u + 1) ^ sw] = v.y, row[(4 * u + 2) ^ sw] = v.z, row[(4 * u + 3) ^ sw] = v.w;
  }
  __syncthreads();
  const int k = tid & 15, g = tid >> 4;  // pixels 16 k .. 16 k + 15, channels 4 g .. 4 g + 3
  const int64_t l = l0 + 16 * k;
  if (c0 + 4 * g >= C || l >= Lr) return;
  uint32_t x[16];  // x[t]: channels 4 g .. 4 g + 3 of pixel 16 k + t
#pragma unroll
  for (int t = 0; t < 16; ++t) x[t] = tile[(16 * k + t) * (kTrCols / 4) + (g ^ k)];
  uint32_t out[4][4];  // out[q][s]: pixels 4 q .. 4 q + 3 of channel 4 g + s
#pragma unroll
  for (int q = 0; q < 4; ++q) transpose_bytes4(x[4 * q], x[4 * q + 1], x[4 * q + 2], x[4 * q + 3], out[q]);
#pragma unroll
  for (int s2 = 0; s2 < 4; ++s2)
    *reinterpret_cast<uint4*>(mt + (c0 + 4 * g + s2) * Lr + l) =
        make_uint4(out[0][s2], out[1][s2], out[2][s2], out[3][s2]);
}

// im2col_t of a convolution whose output has the map's size (stride 1, Ho = H, Wo = W, rows in raster order): every
// row (i, j, c) of cols_t is row c of the map transposed (map_t: C rows of Lr bytes, zero past L; map_transpose_kernel
// forms it) shifted along L by d = (i dh - ph) W + (j dw - pw), with zeros where the tap falls outside the image. The
// gathering kernel above reads the map once per tap through L1 in 16-byte pieces of scattered pixels (Nsight Compute:
// L1-bound at ~1.4 TB/s, benchmarks/NOTES.md); here a warp's loads and stores are each 512 contiguous bytes of one row.
// A thread takes one 16-byte chunk of the output rows (16 consecutive l) and kShiftChannels channels. Per tap it
// forms the chunk's 16-bit validity mask (a walk over the chunk's image-row segments, each valid on a range of w),
// then per channel loads the aligned 16-byte chunks of map_t that hold its window (zeros outside map_t's row: those
// bytes are outside the image, hence masked) and extracts the window: its byte offset d mod 16 is the same for every
// chunk of the tap (no divergence).
constexpr int kShiftChannels = 4;

// Bytes o .. o + 15 of the 32 bytes v0 (low) v1 (high).
__device__ __forceinline__ uint4 window16(uint4 v0, uint4 v1, int o) {
  const uint32_t w[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
  const int s = 8 * (o & 3);
  const int q = o >> 2;  // the words from q on (o is uniform across the warp)
  uint32_t r[5];
#pragma unroll
  for (int m = 0; m < 5; ++m) r[m] = q == 0 ? w[m] : q == 1 ? w[m + 1] : q == 2 ? w[m + 2] : w[m + 3];
  uint32_t out[4];
#pragma unroll
  for (int m = 0; m < 4; ++m)
    out[m] = static_cast<uint32_t>(((static_cast<uint64_t>(r[m + 1]) << 32) | r[m]) >> s);
  return make_uint4(out[0], out[1], out[2], out[3]);
}

__global__ void __launch_bounds__(kIm2colTThreads)
    im2col_t_shift_kernel(const int8_t* __restrict__ mt, int64_t Lr, Col2imParams p, int8_t* __restrict__ q,
                          int64_t ldq, int64_t K) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // the output chunk
  if (16 * k >= K) return;
  const int c0 = static_cast<int>(blockIdx.y) * kShiftChannels;
  const int H = static_cast<int>(p.H), W = static_cast<int>(p.W);
  const int64_t l0 = 16 * k, left = p.N * p.H * p.W - l0;  // rows of L from l0 on
  const int64_t nch = Lr / 16;                              // 16-byte chunks of a map_t row
  const uint32_t lmask = left >= 16 ? 0xffffu : left > 0 ? (1u << left) - 1u : 0u;
  int w0 = 0, h0 = 0;
  if (lmask != 0u) {
    const int64_t r = l0 / W;
    w0 = static_cast<int>(l0 - r * W), h0 = static_cast<int>(r % H);
  }
  for (int i = 0; i < p.kh; ++i) {
    const int ai = i * p.dh - p.ph;
    for (int j = 0; j < p.kw; ++j) {
      const int bj = j * p.dw - p.pw, wlo = max(0, -bj), whi = min(W, W - bj);
      uint32_t mask = 0u;  // bit t: row l0 + t's tap lies in the image
      for (int t = 0, w = w0, h = h0; t < 16 && lmask != 0u;) {
        const int len = min(16 - t, W - w);  // this segment: positions t .. t + len - 1 of one image row
        if (static_cast<unsigned>(h + ai) < static_cast<unsigned>(H)) {
          const int a = t + max(0, wlo - w), b = t + min(len, whi - w);
          if (a < b) mask |= ((1u << b) - 1u) & ~((1u << a) - 1u);
        }
        t += len, w = 0;
        if (++h == H) h = 0;
      }
      mask &= lmask;
      uint32_t bm[4];  // the mask's bits as byte masks, 4 per word
#pragma unroll
      for (int m = 0; m < 4; ++m) bm[m] = ((((mask >> (4 * m)) & 0xfu) * 0x00204081u) & 0x01010101u) * 0xffu;
      const int64_t d = static_cast<int64_t>(ai) * W + bj;
      const int64_t da = d >= 0 ? d / 16 : -((15 - d) / 16);  // floor(d / 16)
      const int o = static_cast<int>(d - 16 * da);
      const int64_t a0 = k + da;  // the first aligned chunk of the window
      const bool in0 = a0 >= 0 && a0 < nch, in1 = o != 0 && a0 + 1 >= 0 && a0 + 1 < nch;
      int8_t* dst = q + (static_cast<int64_t>(i * p.kw + j) * p.C + c0) * ldq + l0;
      uint4 v[kShiftChannels][2];
#pragma unroll
      for (int cc = 0; cc < kShiftChannels; ++cc) {
        const uint4* row = reinterpret_cast<const uint4*>(mt + (c0 + cc) * Lr);
        const uint4 z = make_uint4(0u, 0u, 0u, 0u);
        v[cc][0] = mask != 0u && in0 ? row[a0] : z;
        v[cc][1] = mask != 0u && in1 ? row[a0 + 1] : z;
      }
#pragma unroll
      for (int cc = 0; cc < kShiftChannels; ++cc) {
        const uint4 x = window16(v[cc][0], v[cc][1], o);
        *reinterpret_cast<uint4*>(dst + cc * ldq) = make_uint4(x.x & bm[0], x.y & bm[1], x.z & bm[2], x.w & bm[3]);
      }
    }
  }
}

// im2col_t for channel runs that are not 4-byte words (V = 1: the stem's 3 channels). A CTA takes 128 rows and up to
// kIm2colTByteUnits units (a unit: one channel of one kernel offset, one row of cols_t). Its bytes are gathered into
// shared memory transposed (unit ul's 128 row bytes at ul * kIm2colTBytePitch), consecutive threads on consecutive
// units of one row, so a warp's loads are neighbouring bytes of the map's pixels and its byte stores fall in 32
// different banks; then each unit's 128 bytes are written 16 bytes a thread, 8 threads a unit: 128 contiguous bytes of
// cols_t's row a store (byte stores where its rows are not 16-byte aligned or past K). (Gathered by 16-row items
// straight to 16-byte stores, a warp's stores went to 32 different rows.)
constexpr int kIm2colTByteRows = 128, kIm2colTByteUnits = 256, kIm2colTBytePitch = kIm2colTByteRows + 4;

__global__ void __launch_bounds__(kIm2colTThreads)
    im2col_t_bytes_kernel(const int8_t* __restrict__ map, int64_t ldm, Col2imParams p, int8_t* __restrict__ q,
                          int64_t ldq, int64_t K, bool vec, int unit_chunk) {
  __shared__ ColumnsOrigin origin[kIm2colTByteRows];
  __shared__ ColumnsOrigin unit_at[kIm2colTByteUnits];  // the unit's offset from the window origin, its (i dh, j dw)
  __shared__ uint32_t tile[kIm2colTByteUnits * kIm2colTBytePitch / 4];
  const int64_t L = p.N * p.Ho * p.Wo, r0 = static_cast<int64_t>(blockIdx.x) * kIm2colTByteRows;
  const int tid = threadIdx.x;
  const int u0 = static_cast<int>(blockIdx.y) * unit_chunk;
  const int nu = min(unit_chunk, p.kh * p.kw * static_cast<int>(p.C) - u0);
  for (int t = tid; t < kIm2colTByteRows; t += blockDim.x) origin[t] = window_origin(p, r0 + t, L, ldm);
  for (int ul = tid; ul < nu; ul += blockDim.x) {
    const int u = u0 + ul, ij = u / static_cast<int>(p.C), c = u - ij * static_cast<int>(p.C);
    const int i = ij / p.kw, j = ij - i * p.kw;
    unit_at[ul] = {(static_cast<int64_t>(i * p.dh) * p.W + j * p.dw) * ldm + c, i * p.dh, j * p.dw};
  }
  __syncthreads();
  auto* tb = reinterpret_cast<uint8_t*>(tile);
  const int dul = kIm2colTThreads % nu, dt = kIm2colTThreads / nu;
  for (int ul = tid % nu, t = tid / nu; t < kIm2colTByteRows; step_item(ul, t, dul, dt, nu)) {
    const ColumnsOrigin o = origin[t], a = unit_at[ul];
    const int h = o.h + a.h, w = o.w + a.w;
    const bool in = static_cast<unsigned>(h) < static_cast<unsigned>(p.H) &&
                    static_cast<unsigned>(w) < static_cast<unsigned>(p.W);
    tb[ul * kIm2colTBytePitch + t] = in ? static_cast<uint8_t>(map[o.off + a.off]) : uint8_t{0};
  }
  __syncthreads();
  for (int e = tid; e < nu * 8; e += blockDim.x) {
    const int ul = e >> 3, m = e & 7;
    const uint32_t* src = tile + (ul * kIm2colTBytePitch + 16 * m) / 4;
    const int64_t rs = r0 + 16 * m;
    int8_t* dst = q + static_cast<int64_t>(u0 + ul) * ldq + rs;
    if (vec && rs + 16 <= K) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(src[0], src[1], src[2], src[3]);
    } else {
      for (int t = 0; t < 16 && rs + t < K; ++t) dst[t] = static_cast<int8_t>((src[t / 4] >> (8 * (t % 4))) & 0xffu);
    }
  }
}

}  // namespace

// The launch sequence of one compress_columns call (arguments validated by the caller), through a launcher with the
// interface of qgo_launch's. `key`: 4 bytes of scratch.
template <typename Launch>
void compress_columns_launch(const TensorView& map, const ConvGeometry& g, const TensorView& q_t,
                             const TensorView& scale, int rank, unsigned* key, const Launch& launch) {
  const Col2imParams p = col2im_params(g);
  const int64_t nblk = ceil_div(g.N * p.Ho * p.Wo, 16);
  const int TB = columns_tile_blocks(rank);
  const int64_t K_pad = q_t.shape[1];  // K = nblk * rank, then the zero padding
  // Tiles of blocks down grid.x; where they are few (a deep layer's short L: 49 tiles at 7 x 7, b128) the column
  // chunks are spread over grid.y too, up to ~kColumnsGridTarget CTAs.
  const int V = g.C % 4 == 0 && map.strides[0] % 4 == 0 && reinterpret_cast<uintptr_t>(map.data) % 4 == 0 ? 4
                : g.C % 3 == 0                                                                             ? 3
                                                                                                           : 1;
  const int64_t tiles = std::min<int64_t>(ceil_div(nblk, TB), 8192);
  const int64_t chunks = ceil_div(static_cast<int64_t>(g.kh) * g.kw * (g.C / V), kColumnsChunk / V);
  const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(chunks, ceil_div(kColumnsGridTarget, tiles)));
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(rows));
  const auto* m = static_cast<const int8_t*>(map.data);
  auto* q = static_cast<int8_t*>(q_t.data);
  auto* s = static_cast<float*>(scale.data);
  const auto go = [&](auto v) {
    constexpr int V = decltype(v)::value;
    launch(compress_columns_kernel<false, V>, grid, kColumnsThreads, 0, m, map.strides[0], p, rank, TB, key, s, q,
           q_t.strides[0], K_pad);
    launch(compress_columns_kernel<true, V>, grid, kColumnsThreads, 0, m, map.strides[0], p, rank, TB, key, s, q,
           q_t.strides[0], K_pad);
  };
  launch.zero(key, 4);
  if (V == 4)
    go(std::integral_constant<int, 4>{});
  else if (V == 3)
    go(std::integral_constant<int, 3>{});
  else
    go(std::integral_constant<int, 1>{});
}

// Whether im2col_t takes the shifting kernel (im2col_t_shift_kernel): 16-byte channel runs, a convolution whose
// output has the map's size in raster order with more than one tap, cols_t's rows 16-byte aligned and whole chunks
// long, int32 image sizes.
inline bool im2col_t_shifts(const TensorView& map, const ConvGeometry& g, const TensorView& cols_t) {
  const bool runs16 = g.C % 16 == 0 && map.strides[0] % 16 == 0 && reinterpret_cast<uintptr_t>(map.data) % 16 == 0;
  const bool vec = cols_t.strides[0] % 16 == 0 && reinterpret_cast<uintptr_t>(cols_t.data) % 16 == 0;
  return runs16 && vec && cols_t.shape[1] % 16 == 0 && !g.patches && g.sh == 1 && g.sw == 1 && g.out_h() == g.H &&
         g.out_w() == g.W && g.kh * g.kw > 1 && g.N * g.H * g.W < (int64_t{1} << 31);
}

// The scratch bytes one im2col_t call needs: map_t (C x padded_k(L)) where it takes the shifting kernel, else 0.
inline size_t im2col_t_scratch_bytes(const TensorView& map, const ConvGeometry& g, const TensorView& cols_t) {
  return im2col_t_shifts(map, g, cols_t) ? static_cast<size_t>(g.C * padded_k(g.N * g.H * g.W)) : 0;
}

// The launch of one im2col_t call (arguments validated by the caller); the last row tiles write the zeros past L.
// scratch: im2col_t_scratch_bytes(...) bytes, 16-byte aligned (null where that is 0).
template <typename Launch>
void im2col_t_launch(const TensorView& map, const ConvGeometry& g, const TensorView& cols_t, const Launch& launch,
                     int8_t* scratch = nullptr) {
  const Col2imParams p = col2im_params(g);
  const int64_t K = cols_t.shape[1];
  if (scratch != nullptr && im2col_t_shifts(map, g, cols_t)) {
    // map_t: the map transposed (zero past L), then the taps as shifts of its rows
    const int64_t L = g.N * g.H * g.W, Lr = padded_k(L);
    const dim3 tr_grid(static_cast<unsigned>(ceil_div(Lr, int64_t{kTrRows})),
                       static_cast<unsigned>(ceil_div(g.C, int64_t{kTrCols})));
    launch(map_transpose_kernel, tr_grid, kTrThreads, 0, static_cast<const int8_t*>(map.data), map.strides[0], L, g.C,
           scratch, Lr);
    const dim3 grid(static_cast<unsigned>(ceil_div(ceil_div(K, int64_t{16}), int64_t{kIm2colTThreads})),
                    static_cast<unsigned>(g.C / kShiftChannels));
    launch(im2col_t_shift_kernel, grid, kIm2colTThreads, 0, static_cast<const int8_t*>(scratch), Lr, p,
           static_cast<int8_t*>(cols_t.data), cols_t.strides[0], K);
    return;
  }
  const auto aligned = [&](int v) {
    return g.C % v == 0 && map.strides[0] % v == 0 && reinterpret_cast<uintptr_t>(map.data) % v == 0;
  };
  const bool vec = cols_t.strides[0] % 16 == 0 && reinterpret_cast<uintptr_t>(cols_t.data) % 16 == 0;
  const auto* m = static_cast<const int8_t*>(map.data);
  auto* q = static_cast<int8_t*>(cols_t.data);
  const int V = aligned(16) ? 16 : aligned(4) ? 4 : 1;
  const int units = static_cast<int>(g.kh * g.kw * (g.C / V));
  if (V == 1) {  // 128-row tiles, the units in chunks of at most kIm2colTByteUnits down grid.y
    const int chunks = static_cast<int>(ceil_div(int64_t{units}, int64_t{kIm2colTByteUnits}));
    const int unit_chunk = static_cast<int>(ceil_div(int64_t{units}, int64_t{chunks}));
    launch(im2col_t_bytes_kernel, dim3(static_cast<unsigned>(ceil_div(K, int64_t{kIm2colTByteRows})), chunks),
           kIm2colTThreads, 0, m, map.strides[0], p, q, cols_t.strides[0], K, vec, unit_chunk);
    return;
  }
  // the longest row tiles (512, 256 or 128 rows) of which there are still kColumnsGridTarget / 4 (a couple per SM),
  // then the units split over grid.y up to ~kColumnsGridTarget CTAs
  int rows = kIm2colTMaxRows;
  while (rows > 128 && ceil_div(K, int64_t{rows}) < kColumnsGridTarget / 4) rows /= 2;
  const int64_t tiles = ceil_div(K, int64_t{rows});
  const int ychunks =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(units, ceil_div(kColumnsGridTarget, tiles))));
  const int unit_chunk = static_cast<int>(ceil_div(int64_t{units}, int64_t{ychunks}));
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(ceil_div(int64_t{units}, int64_t{unit_chunk})));
  const auto go = [&](auto kernel) {
    launch(kernel, grid, kIm2colTThreads, 0, m, map.strides[0], p, q, cols_t.strides[0], K, vec, rows, unit_chunk);
  };
  if (V == 16)
    go(im2col_t_kernel<16>);
  else
    go(im2col_t_kernel<4>);
}

}  // namespace hot::cuda
