// The fused pass over g_y (quantize_grad_output) and the ABC buffer (compress_activation, the same kernel
// restricted to the HLA part with round-to-nearest): the kernels, the host-side setup of one call and the
// launch sequence. Included by layer_ops.cu (the CUDA backend) and by the host emulation test
// (cpp/tests/emu), which runs these same kernels on the CPU; it must be included by one translation unit
// per binary (everything here has internal linkage).
//
// quantize_grad_output design (measured in benchmarks/NOTES.md): per-tensor scales need the global
// amax before any value can be rounded, so the work is two passes over g_y with one kernel template:
//   pass 1 (stats): G~ = g_y blockdiag(H_b) and G^ = blockdiag(H^) g_y are formed on chip; only their
//                   amax (per tensor, or per row for per-token G~) and the column sums of g_y (g_b
//                   partials, fixed order) leave the SM.
//   finalize:       scales and inverse scales from the amax keys.
//   pass 2 (quant): the transforms are recomputed and quantised; q_g is written row-major (16 bytes per
//                   thread), q_gh_t transposed through shared memory so that its rows are written whole; where
//                   g_w comes from G~'s codes (no G^), q_g_t is q_g transposed the same way (qgt_copy_out).
// Tile order: pass 1 walks the tiles from the last to the first, so that it starts on the tail of g_y (or x) that
// its producer has just written and L2 still holds, and pass 2 from the first to the last, starting on what pass 1
// read last.
// Tile: 64 rows x 256 columns of g_y, one CTA of 256 threads per tile; a narrow 16-bit g_y (max(O, O_pad) <= 128 or
// <= 64) packs 2 or 4 row tiles side by side into one tile (QgoParams::pack, tile_spot), so that O = 64 does not leave
// three quarters of the threads on zero columns. bf16/fp16 g_y whose rows load as aligned
// 16-byte vectors stays 16-bit in shared memory (qgo16_kernel: 32 KB filled by cp.async, plus 21 KB of q_gh_t
// staging in pass 2); anything else (fp32, unaligned rows) is converted to fp32 in shared memory (qgo_kernel:
// 64 KB, the q_gh_t staging reuses it). Both tiles spread their accesses over the 32 banks.
// G~: a thread transforms 16 consecutive columns of one row in registers (4 such units);
// G^: a thread transforms 2 columns of one 16-row block in registers (2 such units: 32 live values rather than the 64
// of 4 columns, which kept pass 2 at 128 registers and 2 CTAs per SM). The transforms take no shuffles; the butterfly
// order is the one of the CPU backend, so fp32 values, and therefore integers, are identical.
// Stochastic rounding (rng.h, SPEC §5: element (r, c)'s 16-bit uniform is a half of its row word + its column pair's
// word, words drawn by Philox4x32-7 per 4 rows x 256 columns and per 64 rows x 8 columns): when O % 8 == 0 (p.sr8)
// pass 2 of the 16-bit kernel draws G~'s words of a tile once into shared memory (gx_fill_words: 48 calls a tile;
// other kernels, 3 calls a G~ unit), and G^'s rows of a warp take their row words from one call a lane by shuffles
// and their column word from one call a unit (gw_sr_words, gw_quant_sr8). Other O take the generic per-element
// paths (quant_slow; G^'s inline loop in gw_amax_or_quant).
// The per-tile work is split into gx_transform (G~), bias_partials (g_b without G^), gw_projection (G^; g_b's partials
// from its row 0, bias_from_block_sums) and the staging of G^'s codes for their transposed store (stage_clear,
// stage_unit, stage_copy_out); qgo_tile runs them in that order.
// compress_activation_cast (a float32 x that the layer reads as bf16/fp16): pass 1 is qgo16_kernel with a float32
// source, which rounds each chunk to the 16-bit type as it fills the tile and writes the rounded copy; pass 2 reads
// the copy as any 16-bit input (qgo_cast_or_bind; other layouts cast first with cast_kernel).
// The HLA rank is a template parameter R of the kernels: 8 or 16 (compiled-in ranks: with R = 8 the G^ rows not kept
// are dead code, so pass 2 fits 64 registers and 4 CTAs per SM; with R = 16 the rank loops and the staging layout are
// constants) or 0 (any rank 1..16, read at run time); or kAsIs: the g_w path's rows as they are, no H^, all 16 of a
// block kept in row order (activation_codes: x's own codes, transposed); or kGxOnly: no g_w path (a convolution's g_y,
// whose g_w comes from G~'s codes), so that G^'s code is dead and the 16-bit kernels run 4 CTAs per SM.
#pragma once

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "common.cuh"
#include "fwht.cuh"
#include "hot/quant_rules.h"
#include "hot/rng.h"

namespace hot::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kTileRows = 64;                 // 4 HLA row blocks
constexpr int kTileCols = 256;
constexpr int kRowBlocks = kTileRows / 16;

// Whether a call with a compiled-in HLA rank (8 or 16, is_fixed_rank) runs the kernels compiled for that rank rather
// than the run-time-rank ones (R = 0). Identical bytes; the switch exists so the benchmark can time both.
std::atomic<bool> g_qgo_fixed_rank{true};
constexpr bool is_fixed_rank(int rank) { return rank == 8 || rank == 16; }
constexpr int kAsIs = -16;  // R of activation_codes' kernels (see the header)
constexpr int kGxOnly = -1;  // R of the kernels of a call without the g_w path (see the header)

// Minimum resident CTAs per SM that qgo_kernel is compiled for (__launch_bounds__), i.e. the registers it may
// use: 3 (64 KB of shared memory each: the most that fit), 80 registers.
constexpr int kQgoMinCtas = 3;
// The same for qgo16_kernel (32 KB of tile, + 21 KB of q_gh_t staging in pass 2): pass 2 at 3 CTAs (80 registers; 4,
// 64 registers, at R = 8 and without G^, kGxOnly), pass 1 at 4 (64; 3 at run-time ranks, R = 0). G^ on 2 columns per
// thread made these fit (pass 2 took 128 registers and 2 CTAs with 4 columns); ptxas figures in benchmarks/NOTES.md.
constexpr int qgo16_min_ctas(int pass, int r) {
  return pass == 2 ? (r == 8 || r == kGxOnly ? 4 : 3) : (r == 0 ? 3 : 4);
}

struct QgoParams {
  int64_t L, O;
  int64_t ld_in;
  // g_x path
  bool gx;
  int gx_qmax;
  int block;            // b
  bool gx_per_row;
  int8_t* q_g;          // L x O_pad
  int64_t ld_qg, O_pad;
  int8_t* q_gt = nullptr;  // O x K_t, q_g transposed (zero past L), or null (GradOutputQuant::q_g_t)
  int64_t ld_qgt = 0, K_t = 0;
  // g_w path
  bool gw;
  int rank;
  int8_t* q_gh;         // O x K_pad (transposed)
  int64_t ld_qgh, K, K_pad;
  // rounding
  bool stochastic;
  uint64_t seed;
  const uint64_t* seed_ptr;  // a seed in device memory (GradOutputPlan::seed_ptr), read by pass 2 (DeviceSeed)
  // bias
  bool bias;
  float* bias_partial;  // [n_row_tiles][O]
  // statistics / scales (scratch)
  unsigned* key_gx;     // [1] or [L]
  unsigned* key_gw;     // [1]
  const float* inv_gx;  // [1] or [L]
  const float* inv_gw;  // [1]
  const float* pre_gx;  // [1] or [L]: QuantScale::pre (1, or 2^64 for a tiny amax)
  const float* pre_gw;  // [1]
  bool sr8;             // stochastic and O % 8 == 0: the fast paths of the row and column words (8 columns all in or
                        // all out of a row)
  bool vec_load;        // 4 consecutive columns load as one vector
  bool vec_store_qg;    // 4 consecutive q_g bytes store as one word
  bool word_store_qgh;  // q_gh_t rows can be written in 4-byte words
  bool vec_store_qgt = false;  // q_gt's runs of 16 rows can be written as 16-byte vectors
  // Row tiles packed side by side in one 64 x 256 tile (qgo16_kernel only): 1, or 2 / 4 for a narrow g_y (max(O,
  // O_pad) <= 128 / 64): tile t holds row tiles t * pack + q, q = 0 .. pack - 1, in columns q * seg .. q * seg + seg - 1
  // (seg = 256 / pack = 1 << seg_shift), so that every thread has columns to work on.
  int pack;
  int seg_shift;
  // compress_activation_cast's pass 1 (qgo16_kernel with a float32 source S): the 16-bit copy of the input it writes
  // (row stride ld_in; pass 2 reads it as its input) and the float32 source's row stride.
  void* cast_out = nullptr;
  int64_t ld_src = 0;
};

// An element's place for stochastic rounding (rng.h): row r and column c of an R x C operand.
struct SrSpot {
  int64_t R, C, r, c;
};

// Generic (slow, out of line) quantisation of n <= 4 consecutive elements (at.r, at.c .. at.c + n - 1) of one row: any
// alignment, any n; each uniform from its own two Philox calls. Kept out of line so that the unrolled main loops stay
// small (I-cache).
__device__ __noinline__ void quant_slow(const float* v, int n, float inv, float pre, int qmax, bool stochastic,
                                        uint64_t seed, uint32_t stream, SrSpot at, int8_t* q) {
  const QuantScale qs{inv, 0.0f, pre};
  for (int i = 0; i < n; ++i)
    q[i] = stochastic ? quantize_stochastic(v[i], qs, qmax, sr_uniform(seed, stream, at.R, at.C, at.r, at.c + i))
                      : quantize_nearest(v[i], qs, qmax);
}

// Rounding of 4 consecutive elements of one row, n of them valid (n <= 4), where the RNG fast paths do not apply:
// inline round-to-nearest, else the out-of-line generic path.
__device__ __forceinline__ void quant4(const float (&v)[4], int n, float inv, float pre, int qmax, bool stochastic, uint64_t seed,
                                       uint32_t stream, SrSpot at, int8_t (&q)[4]) {
  if (n == 4 && !stochastic) {
#pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = 0;
    if (inv != 0.0f) {
#pragma unroll
      for (int i = 0; i < 4; ++i) q[i] = q_nearest(v[i], inv, pre);
    }
  } else {
    float vv[4] = {v[0], v[1], v[2], v[3]};
    int8_t qq[4] = {0, 0, 0, 0};
    quant_slow(vv, n, inv, pre, qmax, stochastic, seed, stream, at, qq);
    q[0] = qq[0], q[1] = qq[1], q[2] = qq[2], q[3] = qq[3];
  }
}

// Where pass 2 takes its stochastic-rounding seed from. HostSeed: the kernel's parameters. DeviceSeed: device memory,
// read once per thread at the kernel's start (GradOutputPlan::seed_ptr: a seed drawn on the GPU, which a CUDA graph
// redraws at every replay). The same bits for the same seed.
struct HostSeed {
  __device__ __forceinline__ uint64_t seed(const QgoParams& p) const { return p.seed; }
};
struct DeviceSeed {
  uint64_t s;
  __device__ __forceinline__ uint64_t seed(const QgoParams&) const { return s; }
};

// Word j (0 .. 3, uniform or a constant after unrolling) of a Philox result, by selects rather than a local array.
__device__ __forceinline__ uint32_t philox_word(const Philox4& w, int j) {
  return j == 0 ? w.v[0] : j == 1 ? w.v[1] : j == 2 ? w.v[2] : w.v[3];
}

// The 16-bit uniforms of rng.h (low / high half of a Philox word, times 2^-16) without an int-to-float
// conversion: 1 + h * 2^-16 is exact in fp32 (16 mantissa bits), so subtracting 1 gives h * 2^-16 exactly.
__device__ __forceinline__ float u16_lo(uint32_t w) { return __fsub_rn(__uint_as_float(0x3f800000u | ((w & 0xffffu) << 7)), 1.0f); }
__device__ __forceinline__ float u16_hi(uint32_t w) { return __fsub_rn(__uint_as_float(0x3f800000u | ((w >> 9) & 0x7fff80u)), 1.0f); }

// Stochastic rounding of 4 values whose uniforms are the 4 halves of words a (elements 0, 1) and b (2, 3).
__device__ __forceinline__ uint32_t sr4_packed(float v0, float v1, float v2, float v3, uint32_t a, uint32_t b, float inv,
                                               float pre, int qmax) {
  const float qm = static_cast<float>(qmax);
  return pack_codes(q_stochastic_bits(v0, inv, pre, qm, u16_lo(a)), q_stochastic_bits(v1, inv, pre, qm, u16_hi(a)),
                    q_stochastic_bits(v2, inv, pre, qm, u16_lo(b)), q_stochastic_bits(v3, inv, pre, qm, u16_hi(b)));
}

__device__ __forceinline__ uint32_t pack4(const int8_t (&q)[4]) {
  return static_cast<uint32_t>(static_cast<uint8_t>(q[0])) | (static_cast<uint32_t>(static_cast<uint8_t>(q[1])) << 8) |
         (static_cast<uint32_t>(static_cast<uint8_t>(q[2])) << 16) |
         (static_cast<uint32_t>(static_cast<uint8_t>(q[3])) << 24);
}

template <typename T>
struct VecIO {
  static constexpr int N = 16 / sizeof(T);  // elements per 16-byte load
  static __device__ __forceinline__ void load(const T* p, float* out) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    if constexpr (sizeof(T) == 4) {
      out[0] = __uint_as_float(v.x), out[1] = __uint_as_float(v.y), out[2] = __uint_as_float(v.z),
      out[3] = __uint_as_float(v.w);
    } else {
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        out[2 * i] = f16bits_to_f<T>(static_cast<unsigned short>(w[i]));
        out[2 * i + 1] = f16bits_to_f<T>(static_cast<unsigned short>(w[i] >> 16));
      }
    }
  }
};

// The fp32 tile of qgo_kernel: row-major, 256 floats a row, bank-spread: float4 k of each 16-column group is stored
// at k ^ ((group >> 1) & 3), so that the G~ loads (lanes 16 columns apart), the 16-byte stores of bf16/fp16 loads
// (lanes 8 columns apart) and the row-contiguous accesses all spread over the 32 banks (4 wavefronts per warp-wide
// 16-byte access; a plain layout takes 16 and 8, benchmarks/NOTES.md). q_gh_t is staged in the same shared memory
// once the tile is read.
struct TileF32 {
  static constexpr bool kStageAliases = true;
  float (*t)[kTileCols];
  static __device__ __forceinline__ int phys(int c) { return c ^ ((c >> 3) & 12); }
  // 4 consecutive columns c .. c+3 (c a multiple of 4) of a row
  __device__ __forceinline__ void load4(int row, int c, float& a, float& b, float& d, float& e) const {
    const float4 v = *reinterpret_cast<const float4*>(&t[row][phys(c)]);
    a = v.x, b = v.y, d = v.z, e = v.w;
  }
  // 2 consecutive columns c, c+1 (c even: phys keeps them adjacent)
  __device__ __forceinline__ void load2(int row, int c, float& a, float& b) const {
    const float2 v = *reinterpret_cast<const float2*>(&t[row][phys(c)]);
    a = v.x, b = v.y;
  }
  __device__ __forceinline__ float at(int row, int c) const { return t[row][phys(c)]; }
  // 16 consecutive columns c .. c+15 (c a multiple of 16) of a row
  __device__ __forceinline__ void load16(int row, int c, float (&x)[16]) const {
#pragma unroll
    for (int i = 0; i < 16; i += 4) load4(row, c + i, x[i], x[i + 1], x[i + 2], x[i + 3]);
  }
};

// Where column lc of tile t lives in g_y: its row tile (rows rt * 64 ..) and its column (see QgoParams::pack).
struct TileSpot {
  int64_t rt, c;
};
__device__ __forceinline__ TileSpot tile_spot(const QgoParams& p, int64_t t, int64_t c0, int lc) {
  if (p.pack == 1) return {t, c0 + lc};
  const int q = lc >> p.seg_shift;
  return {t * p.pack + q, c0 + (lc - (q << p.seg_shift))};
}

// ---- the work on one 64 x 256 tile of g_y once it is in shared memory ------------------------------------
// Read through `tile` (TileF32 or TileRaw16). Tile (t, ct) covers rows t * 64 .. t * 64 + 63 and columns
// c0 = ct * 256 .. c0 + 255 of g_y, or (packed) row tiles t * pack + q side by side (tile_spot); the parts below run in
// this order (qgo_tile).

// G~, pass 1, one unit (16 columns x of row r): the unit's amax into the row's key (per token) or amax_gx.
__device__ __forceinline__ void gx_unit_amax(const QgoParams& p, const float (&x)[16], int64_t r, uint32_t& amax_gx) {
  const int lane = threadIdx.x & 31;
  uint32_t k = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) k = max(k, amax_key(x[i]));
  if (p.gx_per_row) {
    // lanes 0-15 and 16-31 hold one row each
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) k = max(k, __shfl_xor_sync(0xffffffffu, k, o));
    if ((lane & 15) == 0 && r < p.L) atomicMax(p.key_gx + r, k);
  } else {
    amax_gx = max(amax_gx, k);
  }
}

// G~, pass 2, one unit (16 columns x of row r from column c, r < L, c < O_pad): quantised and stored into q_g
// (codes past O are the zero padding), and returned in w (bytes in column order). With p.sr8, a is the row word of r
// and b[m] the column word of columns c + 2m, c + 2m + 1 (rng.h; gx_transform forms them).
template <class Key>
__device__ __forceinline__ void gx_unit_quant_store(const QgoParams& p, const Key& key, const float (&x)[16], int64_t r,
                                                    int64_t c, uint32_t a, const uint32_t (&b)[8], uint32_t (&w)[4]) {
  w[0] = w[1] = w[2] = w[3] = 0u;
  if (c < p.O) {
    const float inv = p.gx_per_row ? p.inv_gx[r] : p.inv_gx[0];
    const float pre = p.gx_per_row ? p.pre_gx[r] : p.pre_gx[0];
    if (inv == 0.0f) {
      // all codes 0: w stays zero
    } else if (p.sr8) {
      // Two groups of 8 columns (O % 8 == 0), each all in or all out; a column pair's uniforms are the two halves of
      // a + b[m].
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (c + 8 * h < p.O) {
          w[2 * h] = sr4_packed(x[8 * h], x[8 * h + 1], x[8 * h + 2], x[8 * h + 3], a + b[4 * h], a + b[4 * h + 1], inv,
                                pre, p.gx_qmax);
          w[2 * h + 1] = sr4_packed(x[8 * h + 4], x[8 * h + 5], x[8 * h + 6], x[8 * h + 7], a + b[4 * h + 2],
                                    a + b[4 * h + 3], inv, pre, p.gx_qmax);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t ci = c + 4 * i;
        const int nvalid = static_cast<int>(std::min<int64_t>(4, std::max<int64_t>(0, p.O - ci)));
        int8_t q[4] = {0, 0, 0, 0};
        if (nvalid > 0) {
          const float g[4] = {x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]};
          quant4(g, nvalid, inv, pre, p.gx_qmax, p.stochastic, key.seed(p), rng_stream::gx_grad,
                 SrSpot{p.L, p.O, r, ci}, q);
        }
        w[i] = pack4(q);
      }
    }
  }
  int8_t* dst = p.q_g + r * p.ld_qg + c;
  if (p.vec_store_qg) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
  } else {
    for (int i = 0; i < 16; ++i)
      if (c + i < p.O_pad) dst[i] = static_cast<int8_t>(w[i >> 2] >> (8 * (i & 3)));
  }
}

// G~'s stochastic-rounding words of one tile (rng.h), where pass 2 has shared memory for them (the q_gh_t staging of
// the 16-bit kernel, behind q_gt's 16 KB there, before G^ uses it): the row words of the tile's rows, [q * 64 + row] for packed row tile q, and
// the column words of its column pairs, [kGxRowWords + lc / 2]. 16 row calls per packed row tile and 32 column calls,
// one per thread.
constexpr int kGxRowWords = 4 * kTileRows;
constexpr int kGxWordBytes = (kGxRowWords + kTileCols / 2) * 4;
__device__ __forceinline__ void gx_fill_words(const QgoParams& p, uint64_t seed, int64_t t, int64_t c0,
                                              uint32_t* words) {
  const int tid = threadIdx.x;
  Philox4 w{};
  int at = -1;
  if (tid < 16 * p.pack) {  // the row call of rows 4m .. 4m + 3 of packed row tile q
    const int q = tid >> 4, m = tid & 15;
    const int64_t r = (t * p.pack + q) * kTileRows + 4 * m;
    w = sr_call(seed, rng_stream::gx_grad, kSrRowCall, sr_row_call_index(p.L, r, c0));
    at = q * kTileRows + 4 * m;
  } else if (tid >= 64 && tid < 64 + kTileCols / 8) {  // the column call of local columns 8m .. 8m + 7
    const int lc = 8 * (tid - 64);
    const TileSpot sp = tile_spot(p, t, c0, lc);
    w = sr_call(seed, rng_stream::gx_grad, kSrColumnCall, sr_column_call_index(p.O, sp.rt * kTileRows, sp.c));
    at = kGxRowWords + lc / 2;
  }
  if (at >= 0) *reinterpret_cast<uint4*>(words + at) = make_uint4(w.v[0], w.v[1], w.v[2], w.v[3]);
}

// The column words of the 16 columns c .. c + 15 (c a multiple of 16) of row tile rt of G~: two Philox calls.
__device__ __forceinline__ void gx_column_words(const QgoParams& p, uint64_t seed, int64_t rt, int64_t c,
                                                uint32_t (&b)[8]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const Philox4 w =
        sr_call(seed, rng_stream::gx_grad, kSrColumnCall, sr_column_call_index(p.O, rt * kTileRows, c + 8 * h));
#pragma unroll
    for (int m = 0; m < 4; ++m) b[4 * h + m] = w.v[m];
  }
}

// A unit's stochastic-rounding words (p.sr8, pass 2): its row word a and its 8 column words b, from `words`
// (gx_fill_words) where given, else from its own Philox calls (one row call, two column calls).
template <class Key>
__device__ __forceinline__ void gx_unit_words(const QgoParams& p, const Key& key, const uint32_t* words, int q, int row,
                                              int lc, int64_t rt, int64_t r, int64_t c, uint32_t& a, uint32_t (&b)[8]) {
  if (words != nullptr) {
    a = words[q * kTileRows + row];
    const uint4 b0 = *reinterpret_cast<const uint4*>(words + kGxRowWords + lc / 2);
    const uint4 b1 = *reinterpret_cast<const uint4*>(words + kGxRowWords + lc / 2 + 4);
    b[0] = b0.x, b[1] = b0.y, b[2] = b0.z, b[3] = b0.w, b[4] = b1.x, b[5] = b1.y, b[6] = b1.z, b[7] = b1.w;
  } else {
    const uint64_t seed = key.seed(p);
    a = philox_word(sr_call(seed, rng_stream::gx_grad, kSrRowCall, sr_row_call_index(p.L, r, c)),
                    static_cast<int>(r & 3));
    gx_column_words(p, seed, rt, c, b);
  }
}

// G~'s codes transposed (pass 2 with p.q_gt: the g_w operand of SPEC §4's "g_w from G~'s codes") go through 16 KB of
// `stage`: the tile's codes row-major, 4-byte word w of row r at word r * 64 + (w ^ qgt_swizzle(r)), stored by
// gx_transform a unit at a time (16 bytes: the 16 lanes of a row hit different banks) and read by qgt_copy_out 4
// columns x 16 rows a thread (a warp's word loads: 8 words of each of 4 rows 16 apart, which the swizzle spreads over
// the banks).
__device__ __forceinline__ int qgt_swizzle(int r) { return ((r >> 4) & 3) * 8; }
constexpr int kQgtStageBytes = kTileCols * kTileRows;

// The g_x transform: G~ = g_y blockdiag(H_b) on units (row, 16 columns), 4 per thread; its amax (pass 1) or its
// codes in q_g (pass 2), and in q_gt's staging where qstage is given (zeros for rows past L). Only the tile's column
// groups below max(O, O_pad) are walked (a narrow g_y, O = 64, has 4 of the 16 in each packed row tile), except with
// per-token scales, whose amax reduction needs 16 consecutive lanes on one row (such g_y is never packed).
template <int PASS, class Tile, class Key>
__device__ __forceinline__ void gx_transform(const QgoParams& p, const Key& key, const Tile& tile, int64_t t,
                                             int64_t c0, uint32_t& amax_gx, const uint32_t* words,
                                             unsigned char* qstage = nullptr) {
  const int seg = 1 << p.seg_shift;  // columns per packed row tile (256 unpacked)
  const int64_t width = std::max(p.O, p.O_pad) - c0;  // > 0 for every column tile
  const int gq = p.gx_per_row || width >= seg ? seg / 16 : static_cast<int>((width + 15) / 16);  // groups per segment
  const int groups = gq * p.pack;
#pragma unroll 1
  for (int u = threadIdx.x; u < kTileRows * groups; u += kThreads) {
    const int row = groups == kTileCols / 16 ? u / (kTileCols / 16) : u / groups;  // a shift in the common case
    const int gi = u - row * groups;
    const int q = p.pack == 1 ? 0 : gi / gq;
    const int lc = (q << p.seg_shift) + (gi - q * gq) * 16;
    const TileSpot at = tile_spot(p, t, c0, lc);
    const int64_t r = at.rt * kTileRows + row, c = at.c;
    float x[16];
    tile.load16(row, lc, x);
    fwht_regs<16>(x, p.block);  // G~: blocks of b columns
    if (PASS == 1) {
      gx_unit_amax(p, x, r, amax_gx);
    } else {
      uint32_t w[4] = {0u, 0u, 0u, 0u};
      if (r < p.L && c < p.O_pad) {
        uint32_t a = 0u, b[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
        if (PASS == 2 && p.sr8) gx_unit_words(p, key, words, q, row, lc, at.rt, r, c, a, b);
        gx_unit_quant_store(p, key, x, r, c, a, b, w);
      }
      if (qstage != nullptr)
        *reinterpret_cast<uint4*>(qstage + 4 * (row * (kTileCols / 4) + ((lc >> 2) ^ qgt_swizzle(row)))) =
            make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// The g_b partials (pass 1) of a call without G^: column sums of the tile in row order, one column per thread.
template <class Tile>
__device__ __forceinline__ void bias_partials(const QgoParams& p, const Tile& tile, int64_t t, int64_t c0) {
  const int tid = threadIdx.x;
  const TileSpot at = tile_spot(p, t, c0, tid);
  float sum = 0.0f;
  for (int row = 0; row < kTileRows; ++row) sum = __fadd_rn(sum, tile.at(row, tid));
  if (at.c < p.O && at.rt * kTileRows < p.L) p.bias_partial[at.rt * p.O + at.c] = sum;
}

// G^ = blockdiag(H^) g_y for one G^ unit of a thread (row block jb, the 2 columns c2, c2 + 1): the 16 transformed rows,
// hx[t][v] = row t of the block (in transform order), column c2 + v.
// kRaw (activation_codes): no transform; row t goes where the kept row t is read from (hx[hla_order(t)]), so that
// the codes come out in row order.
template <bool kRaw, class Tile>
__device__ __forceinline__ void gw_load_transform(const Tile& tile, int jb, int c2, float (&hx)[16][2]) {
  if constexpr (kRaw) {
#pragma unroll
    for (int t = 0; t < 16; ++t) tile.load2(jb * 16 + t, c2, hx[hla_order(t)][0], hx[hla_order(t)][1]);
  } else {
#pragma unroll
    for (int t = 0; t < 16; ++t) tile.load2(jb * 16 + t, c2, hx[t][0], hx[t][1]);
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      float col[16];
#pragma unroll
      for (int t = 0; t < 16; ++t) col[t] = hx[t][v];
      fwht_regs<16>(col);
#pragma unroll
      for (int t = 0; t < 16; ++t) hx[t][v] = col[t];
    }
  }
}

// The low byte of `code` (a *_bits code) as byte i (0..3, a constant after unrolling) of `word`: one byte permute.
__device__ __forceinline__ uint32_t insert_code(uint32_t word, uint32_t code, int i) {
  return __byte_perm(word, code, i == 0 ? 0x3214 : i == 1 ? 0x3240 : i == 2 ? 0x3410 : 0x4210);
}

// G^'s stochastic-rounding words of one unit (p.sr8, pass 2). The G^ operand has nb * rank rows (row R = jglob * rank +
// k) and O columns; the unit's columns cg, cg + 1 (cg even) take the two halves of a + b (rng.h), a the row word of R,
// b the column word of the pair. A warp's 32 lanes hold one row block (jglob is warp-uniform: a warp spans 64 columns
// of one segment), so its rows' words come from at most 5 row calls: lane l draws call l / 4 and keeps its word l % 4
// (`mine`, one register a lane); row R's word is then one shuffle from lane 4 * (call of R) + R % 4. The rows of a
// block meet a second 64-row block of column words (b1) only for a rank that does not divide 64 (a constant test for the
// compiled-in ranks). Drawn before the transform, so that the Philox rounds do not share registers with its 32 values.
struct GwWords {
  uint32_t mine, b0, b1;
};
template <class Key>
__device__ __forceinline__ GwWords gw_sr_words(const QgoParams& p, const Key& key, int rank, int64_t jglob, int64_t nb,
                                               int64_t cg) {
  const uint64_t seed = key.seed(p);
  const int64_t rows = nb * rank, R0 = jglob * rank;  // G^'s rows; the block's first row (warp-uniform)
  const int lane = threadIdx.x & 31;
  GwWords w;
  w.mine = philox_word(
      sr_call(seed, rng_stream::gw_grad, kSrRowCall, sr_row_call_index(rows, R0, cg) + (lane >> 2)), lane & 3);
  w.b0 = philox_word(sr_call(seed, rng_stream::gw_grad, kSrColumnCall, sr_column_call_index(p.O, R0, cg)),
                     static_cast<int>((cg >> 1) & 3));
  w.b1 = w.b0;
  if (64 % rank != 0 && (R0 & 63) + rank > 64)
    w.b1 = philox_word(sr_call(seed, rng_stream::gw_grad, kSrColumnCall, sr_column_call_index(p.O, R0 + rank - 1, cg)),
                       static_cast<int>((cg >> 1) & 3));
  return w;
}

// G^, pass 2, stochastic with p.sr8: the codes of the kept rows k < rank into packed[v][k / 4], from the unit's words
// (gw_sr_words). Every lane reaches the shuffles (the conditions around them are warp-uniform: the scale, the rank); a
// lane past L or O (keep false) only leaves its codes zero.
__device__ __forceinline__ void gw_quant_sr8(const QgoParams& p, const GwWords& w, const float (&hx)[16][2], int rank,
                                             int64_t jglob, int64_t nb, int nvalid, uint32_t (&packed)[2][4]) {
  const float inv = p.inv_gw[0], pre = p.pre_gw[0];
  if (inv == 0.0f) return;  // warp-uniform: all codes 0, packed stays zero
  const bool keep = nvalid > 0 && jglob < nb;
  const int64_t R0 = jglob * rank;
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    if (k < rank) {
      const int64_t R = R0 + k;
      const int src = 4 * static_cast<int>((R >> 2) - (R0 >> 2)) + static_cast<int>(R & 3);  // warp-uniform
      const uint32_t a = __shfl_sync(0xffffffffu, w.mine, src);
      if (keep) {
        const uint32_t sum = a + (((R >> 6) == (R0 >> 6)) ? w.b0 : w.b1);
        const int ka = hla_order(k);
        packed[0][k >> 2] =
            insert_code(packed[0][k >> 2], q_stochastic_bits(hx[ka][0], inv, pre, 127.0f, u16_lo(sum)), k & 3);
        packed[1][k >> 2] =
            insert_code(packed[1][k >> 2], q_stochastic_bits(hx[ka][1], inv, pre, 127.0f, u16_hi(sum)), k & 3);
      }
    }
  }
}

// G^, the other cases: the amax of the kept rows k < rank (pass 1), or their codes into packed[v][k / 4] (pass 2:
// round-to-nearest, or stochastic by the generic per-element path).
template <int PASS, class Key>
__device__ __forceinline__ void gw_amax_or_quant(const QgoParams& p, const Key& key, const float (&hx)[16][2], int rank,
                                                 int64_t jglob, int64_t nb, int64_t cg, int nvalid, uint32_t& amax_gw,
                                                 uint32_t (&packed)[2][4]) {
  if (PASS == 2 && !p.stochastic && nvalid == 2) {
    // Round-to-nearest of 2 whole columns (the common case): the scale read and tested once, no per-row branches.
    const float inv = p.inv_gw[0], pre = p.pre_gw[0];
    if (jglob >= nb || inv == 0.0f) return;  // codes 0: packed stays zero
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      if (4 * g < rank) {
#pragma unroll
        for (int v = 0; v < 2; ++v) {
          uint32_t c[4];
#pragma unroll
          for (int i = 0; i < 4; ++i)
            c[i] = 4 * g + i < rank ? q_nearest_bits(hx[hla_order(4 * g + i)][v], inv, pre) : 0u;
          packed[v][g] = pack_codes(c[0], c[1], c[2], c[3]);
        }
      }
    }
    return;
  }
  if (PASS == 1) {
#pragma unroll
    for (int k = 0; k < 16; ++k)
      if (k < rank) amax_gw = max(amax_gw, max(amax_key(hx[hla_order(k)][0]), amax_key(hx[hla_order(k)][1])));
    return;
  }
  if (nvalid == 0 || jglob >= nb) return;
  // The generic per-element path, inline and not unrolled: rows in a run-time loop over a copy of the codes' inputs
  // (local memory on this rare path only). No call: a call inside the row loop made every path save hx around it.
  const QuantScale qs{p.inv_gw[0], 0.0f, p.pre_gw[0]};
  const uint64_t seed = p.stochastic ? key.seed(p) : 0;
  const int64_t rows = nb * rank, R0 = jglob * rank;
  float h[16][2];
  uint32_t out[2][4] = {{0u, 0u, 0u, 0u}, {0u, 0u, 0u, 0u}};
#pragma unroll
  for (int k = 0; k < 16; ++k) h[k][0] = hx[hla_order(k)][0], h[k][1] = hx[hla_order(k)][1];
#pragma unroll 1
  for (int k = 0; k < rank; ++k) {
#pragma unroll 1
    for (int v = 0; v < nvalid; ++v) {
      const int8_t q = p.stochastic ? quantize_stochastic(h[k][v], qs, 127,
                                                          sr_uniform(seed, rng_stream::gw_grad, rows, p.O, R0 + k, cg + v))
                                    : quantize_nearest(h[k][v], qs, 127);
      out[v][k >> 2] |= static_cast<uint32_t>(static_cast<uint8_t>(q)) << (8 * (k & 3));
    }
  }
#pragma unroll
  for (int v = 0; v < 2; ++v)
#pragma unroll
    for (int g = 0; g < 4; ++g) packed[v][g] = out[v][g];
}

// The g_w projection of one G^ unit (row block jb, columns c2, c2 + 1): its amax (pass 1) or the codes of the kept
// rows, packed[v][k / 4] byte k % 4 = code of row k, column c2 + v (pass 2; zeros outside L x O).
// Also the unit's two column sums over its 16 rows (G^'s row 0, H_16's row of ones; the g_b partials of pass 1).
template <int PASS, bool kRaw, class Tile, class Key>
__device__ __forceinline__ void gw_projection(const QgoParams& p, const Key& key, const Tile& tile, int rank, int64_t rt,
                                              int64_t c0, int jb, int c2, uint32_t& amax_gw, uint32_t (&packed)[2][4],
                                              float (&block_sum)[2]) {
  const int64_t nb = (p.L + 15) / 16;
  const TileSpot at = tile_spot(p, rt, c0, c2);  // the 2 columns (and the quad's 8) share a segment
  const int64_t jglob = at.rt * kRowBlocks + jb;
  const int64_t cg = at.c;
  const bool sr8 = PASS == 2 && p.sr8;
  GwWords words{};
  if (sr8) words = gw_sr_words(p, key, rank, jglob, nb, cg);
  float hx[16][2];
  gw_load_transform<kRaw>(tile, jb, c2, hx);
  block_sum[0] = hx[0][0], block_sum[1] = hx[0][1];
  const int nvalid = static_cast<int>(std::min<int64_t>(2, std::max<int64_t>(0, p.O - cg)));
  if (sr8) {
    gw_quant_sr8(p, words, hx, rank, jglob, nb, nvalid, packed);
  } else {
    gw_amax_or_quant<PASS>(p, key, hx, rank, jglob, nb, cg, nvalid, amax_gw, packed);
  }
}

// Rows [c0, c0 + nrows) of q_gh_t, bytes [col0, col1), from the staged rows src (stage_ld bytes apart).
__device__ __forceinline__ void copy_qgh_rows(const QgoParams& p, const unsigned char* src0, int stage_ld, int64_t c0,
                                              int nrows, int64_t col0, int64_t col1) {
  const int tid = threadIdx.x;
  const int width = static_cast<int>(col1 - col0);
  // Item i = rr * units + w (units: words or bytes per row), i = tid, tid + kThreads, ...: (rr, w) advance by a fixed
  // (rows, units) step with a carry, so the loop has no division (one per item was a quarter of pass 2's instructions).
  const bool words = p.word_store_qgh;
  const int unit = words ? 4 : 1, units = width / unit;
  if (units == 0) return;
  const int drr = kThreads / units, dw = kThreads % units;
  int rr = tid / units, w = tid % units;
  if (words && dw == 0) {
    // Whole rows per step (a full row tile: kRowBlocks * rank / 4 words a row divide the block): a thread's word
    // column stays fixed, both pointers advance by drr rows.
    const int64_t dst_step = drr * p.ld_qgh;
    int8_t* dst = p.q_gh + (c0 + rr) * p.ld_qgh + col0 + 4 * w;
    const unsigned char* src = src0 + rr * stage_ld + 4 * w;
    for (; rr < nrows; rr += drr, dst += dst_step, src += drr * stage_ld)
      *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src);
    return;
  }
  while (rr < nrows) {
    int8_t* dst = p.q_gh + (c0 + rr) * p.ld_qgh + col0 + unit * w;
    const unsigned char* src = src0 + rr * stage_ld + unit * w;
    if (words) {
      *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src);
    } else {
      *dst = static_cast<int8_t>(*src);
    }
    rr += drr, w += dw;
    if (w >= units) w -= units, ++rr;
  }
}

// The staging of q_gh_t (pass 2): every thread's codes go to `stage` transposed (one staged row of stage_ld bytes per
// column of the tile), then each row tile's rows of q_gh_t are written whole, bytes [col0, col1). Three steps:
// stage_clear before the first code is staged, stage_unit per G^ unit, stage_copy_out once all are staged.
__device__ __forceinline__ int stage_ld_of(int rank) { return kRowBlocks * rank + 20; }  // bytes (a multiple of 4)

// Every G^ unit stores all `rank` bytes of its 2 columns for its row block, so the staged bytes [0, kRowBlocks * rank)
// of each column are all written; only the last row tile also writes bytes past them (the K .. K_pad zero padding),
// so only the tile holding it clears the staging first (a block-uniform condition: its barrier is reached by all).
__device__ __forceinline__ void stage_clear(const QgoParams& p, int rank, int64_t t, unsigned char* stage) {
  const int64_t n_rt = (p.L + kTileRows - 1) / kTileRows;
  if ((n_rt - 1) / p.pack == t) {
    uint32_t* s32 = reinterpret_cast<uint32_t*>(stage);
    for (int i = threadIdx.x; i < kTileCols * stage_ld_of(rank) / 4; i += kThreads) s32[i] = 0u;
    __syncthreads();
  }
}

// The codes of one G^ unit (row block jb, columns c2, c2 + 1; packed as gw_projection leaves them) into the staging.
__device__ __forceinline__ void stage_unit(const uint32_t (&packed)[2][4], int rank, int jb, int c2,
                                           unsigned char* stage) {
  const int stage_ld = stage_ld_of(rank);
  unsigned char* dst = stage + c2 * stage_ld + jb * rank;
  if ((rank & 3) == 0) {
#pragma unroll
    for (int v = 0; v < 2; ++v)
#pragma unroll
      for (int w = 0; w < 4; ++w)
        if (4 * w < rank) *reinterpret_cast<uint32_t*>(dst + v * stage_ld + 4 * w) = packed[v][w];
  } else {
#pragma unroll
    for (int v = 0; v < 2; ++v)
#pragma unroll
      for (int k = 0; k < 16; ++k)
        if (k < rank) dst[v * stage_ld + k] = static_cast<unsigned char>(packed[v][k >> 2] >> (8 * (k & 3)));
  }
}

// Once every unit is staged: per packed row tile rt, rows c of q_gh_t, bytes [col0, col1) (the last row tile also
// zero-fills K .. K_pad).
__device__ __forceinline__ void stage_copy_out(const QgoParams& p, int rank, int64_t t, int64_t c0,
                                               const unsigned char* stage) {
  __syncthreads();
  const int64_t n_rt = (p.L + kTileRows - 1) / kTileRows;
  const int stage_ld = stage_ld_of(rank);
  const int seg = 1 << p.seg_shift;
  const int nrows = static_cast<int>(std::min<int64_t>(seg, p.O - c0));
  for (int q = 0; q < p.pack; ++q) {
    const int64_t rt = t * p.pack + q;
    if (rt >= n_rt) break;
    const int64_t col0 = rt * kRowBlocks * rank;
    const int64_t col1 = rt == n_rt - 1 ? p.K_pad : std::min<int64_t>(col0 + kRowBlocks * rank, p.K_pad);
    copy_qgh_rows(p, stage + (q << p.seg_shift) * stage_ld, stage_ld, c0, nrows, col0, col1);
  }
}

// The g_b partials (pass 1) of a call with G^: a tile column's sum is the sum, in row-block order, of its 4 row blocks'
// sums that the G^ transform formed (block_sum[i][v]: unit i, column c2 + v; units jb0 and jb0 + 2), exchanged through
// 4 KB of the block's shared memory at `xch_base` + 256 that no thread reads once the barrier is passed (not the first
// 128 bytes, which the amax reduction borrows next). This saves a second walk of the tile: a load and an add an
// element.
__device__ __forceinline__ void bias_from_block_sums(const QgoParams& p, int64_t t, int64_t c0, int jb0, int c2,
                                                     const float (&block_sum)[2][2], unsigned char* xch_base) {
  float(*xch)[kTileCols] = reinterpret_cast<float(*)[kTileCols]>(xch_base + 256);
  __syncthreads();  // every thread is done with the tile
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int v = 0; v < 2; ++v) xch[jb0 + 2 * i][c2 + v] = block_sum[i][v];
  __syncthreads();
  const int tid = threadIdx.x;
  const TileSpot at = tile_spot(p, t, c0, tid);
  const float sum = __fadd_rn(__fadd_rn(__fadd_rn(xch[0][tid], xch[1][tid]), xch[2][tid]), xch[3][tid]);
  if (at.c < p.O && at.rt * kTileRows < p.L) p.bias_partial[at.rt * p.O + at.c] = sum;
}

// q_gt's staging where it aliases the (fp32) tile: once every thread is done with the tile (the barrier), the tile's
// q_g rows read back from L2 (16 bytes a unit, zeros past L or O_pad).
__device__ __forceinline__ void qgt_read_back(const QgoParams& p, int64_t t, int64_t c0, unsigned char* stage) {
  __syncthreads();
  for (int u = threadIdx.x; u < kTileRows * (kTileCols / 16); u += kThreads) {
    const int row = u >> 4, lc = (u & 15) << 4;
    const TileSpot at = tile_spot(p, t, c0, lc);
    const int64_t r = at.rt * kTileRows + row;
    uint32_t w[4] = {0u, 0u, 0u, 0u};
    if (r < p.L && at.c < p.O_pad) {
      const int8_t* src = p.q_g + r * p.ld_qg + at.c;
      for (int i = 0; i < 16; ++i)
        if (at.c + i < p.O_pad) w[i >> 2] |= static_cast<uint32_t>(static_cast<uint8_t>(src[i])) << (8 * (i & 3));
    }
    *reinterpret_cast<uint4*>(stage + 4 * (row * (kTileCols / 4) + ((lc >> 2) ^ qgt_swizzle(row)))) =
        make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// q_gt's columns [rt * 64, rt * 64 + 64) of rows c < O from the staging, once every thread has staged its codes (the
// barrier): a thread takes 4 columns (4cg ..) x 16 rows (16j ..): 16 word loads, 4 x 4 byte transposes, a 16-byte
// store to each column's row of q_gt (4 lanes a column's 64 bytes). Rows past L are staged as zeros; columns past K_t
// are not written (K_t = padded_k(L) <= the row tiles' rows).
__device__ __forceinline__ void qgt_copy_out(const QgoParams& p, int64_t t, int64_t c0, const unsigned char* stage) {
  __syncthreads();
  const int j = threadIdx.x & 3, cg = threadIdx.x >> 2;
  const TileSpot at = tile_spot(p, t, c0, 4 * cg);
  const int64_t k0 = at.rt * kTileRows + 16 * j;  // >= K_t for a row tile past the last
  if (at.c >= p.O || k0 >= p.K_t) return;
  const uint32_t* src = reinterpret_cast<const uint32_t*>(stage) + 16 * j * (kTileCols / 4) + (cg ^ (8 * j));
  uint32_t col[4][4];  // [column m][rows 4b .. 4b + 3 of the 16]
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    uint32_t out[4];
    transpose_bytes4(src[(4 * b) * (kTileCols / 4)], src[(4 * b + 1) * (kTileCols / 4)],
                     src[(4 * b + 2) * (kTileCols / 4)], src[(4 * b + 3) * (kTileCols / 4)], out);
#pragma unroll
    for (int m = 0; m < 4; ++m) col[m][b] = out[m];
  }
  int8_t* dst = p.q_gt + at.c * p.ld_qgt + k0;
#pragma unroll
  for (int m = 0; m < 4; ++m, dst += p.ld_qgt) {
    if (at.c + m >= p.O) break;
    if (p.vec_store_qgt) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(col[m][0], col[m][1], col[m][2], col[m][3]);
    } else {
      for (int i = 0; i < 16; ++i) dst[i] = static_cast<int8_t>(col[m][i >> 2] >> (8 * (i & 3)));
    }
  }
}

// The whole tile: G~ (amax in pass 1; quantised and stored in pass 2), the g_b column sums (pass 1) and G^ (amax;
// quantised, staged in `stage` and stored transposed). amax_gx / amax_gw accumulate this thread's maxima. In pass 1
// `stage` is the tile's own shared memory (the g_b exchange, once the tile is read).
template <int PASS, int R, class Tile, class Key>
__device__ __forceinline__ void qgo_tile(const QgoParams& p, const Key& key, const Tile& tile, int64_t rt, int64_t ct,
                                         unsigned char* stage, uint32_t& amax_gx, uint32_t& amax_gw) {
  const int rank = R == kAsIs ? 16 : R > 0 ? R : p.rank;  // HLA rank: compile-time (R) or run-time (R == 0, kGxOnly)
  const bool gw = R != kGxOnly && p.gw;
  const int64_t c0 = ct * kTileCols;
  if (p.gx) {
    // Pass 2's stochastic-rounding words of G~ in the staging's shared memory, where it has its own (16-bit tiles),
    // until G^ stages codes there.
    uint32_t* words = nullptr;
    if (PASS == 2 && !Tile::kStageAliases && p.sr8) {
      words = reinterpret_cast<uint32_t*>(stage + kQgtStageBytes);
      gx_fill_words(p, key.seed(p), rt, c0, words);
      __syncthreads();
    }
    // q_gt's staging: its own memory beside the 16-bit tile; where it aliases the fp32 tile, q_g's rows are read back
    // once every thread is done with the tile.
    const bool qgt = PASS == 2 && p.q_gt != nullptr;
    gx_transform<PASS>(p, key, tile, rt, c0, amax_gx, words, qgt && !Tile::kStageAliases ? stage : nullptr);
    if (qgt && Tile::kStageAliases) qgt_read_back(p, rt, c0, stage);
    if (qgt) qgt_copy_out(p, rt, c0, stage);
    if (words != nullptr && gw) __syncthreads();  // every thread is done with the words: the staging is G^'s
  }
  if (PASS == 1 && p.bias && !gw) bias_partials(p, tile, rt, c0);
  if (gw) {
    // G^: 512 units (row block jb, 2 columns c2) of the tile, 2 per thread: row blocks jb0 and jb0 + 2, columns c2.
    // Pass 2 stages a unit's codes as soon as they are formed where the staging has its own memory (TileRaw16: one
    // unit's codes live at a time); where it aliases the tile (TileF32), after every thread is done reading the tile.
    const int jb0 = threadIdx.x / 128, c2 = (threadIdx.x % 128) * 2;
    constexpr bool kEarly = !Tile::kStageAliases;
    if (PASS == 2 && kEarly) stage_clear(p, rank, rt, stage);
    uint32_t packed[2][2][4] = {};  // pass 2: [unit][v][k / 4] bytes of q
    float block_sum[2][2];          // pass 1: [unit][v] column sums of the unit's 16 rows
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      gw_projection<PASS, R == kAsIs>(p, key, tile, rank, rt, c0, jb0 + 2 * i, c2, amax_gw, packed[i], block_sum[i]);
      if (PASS == 2 && kEarly) stage_unit(packed[i], rank, jb0 + 2 * i, c2, stage);
    }
    if (PASS == 1 && p.bias) bias_from_block_sums(p, rt, c0, jb0, c2, block_sum, stage);
    if (PASS == 2) {
      if (!kEarly) {
        __syncthreads();
        stage_clear(p, rank, rt, stage);
#pragma unroll
        for (int i = 0; i < 2; ++i) stage_unit(packed[i], rank, jb0 + 2 * i, c2, stage);
      }
      stage_copy_out(p, rank, rt, c0, stage);
    }
  }
}

// Pass 1: the block's maxima into the per-tensor amax keys (every thread of the block calls this, once the tile
// in `smem` is no longer needed: the reduction borrows its first 128 bytes, so that the kernels use no static
// shared memory and the 64 KB fp32 tile fits the 64 KB per block of sm_75).
__device__ __forceinline__ void qgo_publish_amax(const QgoParams& p, uint32_t amax_gx, uint32_t amax_gw,
                                                 unsigned char* smem) {
  uint32_t* red = reinterpret_cast<uint32_t*>(smem);
  if (p.gx && !p.gx_per_row) {
    const uint32_t k = block_max_u32(amax_gx, red);
    if (threadIdx.x == 0) atomicMax(p.key_gx, k);
  }
  if (p.gw) {
    const uint32_t k = block_max_u32(amax_gw, red);
    if (threadIdx.x == 0) atomicMax(p.key_gw, k);
  }
}

// DS: the stochastic-rounding seed is read from device memory (DeviceSeed; pass 2 with p.seed_ptr only).
template <typename T, int PASS, int R, bool DS = false>
__global__ void __launch_bounds__(kThreads, kQgoMinCtas) qgo_kernel(const T* __restrict__ gy, QgoParams p) {
  HOT_DYNAMIC_SMEM(smem);
  float(*tile)[kTileCols] = reinterpret_cast<float(*)[kTileCols]>(smem);
  const TileF32 tf{tile};
  const int tid = threadIdx.x;
  const int64_t n_ct = (std::max<int64_t>(p.O_pad, p.O) + kTileCols - 1) / kTileCols;
  const int64_t n_rt = (p.L + kTileRows - 1) / kTileRows;
  int64_t lin = blockIdx.x;  // a 1-D grid of n_ct * n_rt tiles (grid.y would cap L at 65535 tiles)
  if (PASS == 1) lin = n_ct * n_rt - 1 - lin;  // pass 1 from the end: see the header (tile order)
  const int64_t rt = static_cast<uint32_t>(lin) / static_cast<uint32_t>(n_ct);  // < kMaxGridX tiles: 32-bit division
  const int64_t ct = lin - rt * n_ct;
  const int64_t r0 = rt * kTileRows, c0 = ct * kTileCols;

  // ---- load the tile as fp32 (zeros outside L x O) ------------------------------------------------
  {
    constexpr int N = VecIO<T>::N;
    if (p.vec_load) {
      constexpr int per_row = kTileCols / N;
#pragma unroll 4
      for (int v = tid; v < kTileRows * per_row; v += kThreads) {
        const int row = v / per_row, cv = (v % per_row) * N;
        const int64_t r = r0 + row, c = c0 + cv;
        float f[N];
        if (r < p.L && c < p.O) {
          VecIO<T>::load(gy + r * p.ld_in + c, f);  // O % N == 0: the vector is all in or all out
        } else {
#pragma unroll
          for (int i = 0; i < N; ++i) f[i] = 0.0f;
        }
#pragma unroll
        for (int i = 0; i < N; i += 4)
          *reinterpret_cast<float4*>(&tile[row][tf.phys(cv + i)]) = make_float4(f[i], f[i + 1], f[i + 2], f[i + 3]);
      }
    } else {
      for (int v = tid; v < kTileRows * kTileCols; v += kThreads) {
        const int row = v / kTileCols, cc = v % kTileCols;
        const int64_t r = r0 + row, c = c0 + cc;
        tile[row][tf.phys(cc)] = (r < p.L && c < p.O) ? load_f(gy + r * p.ld_in + c) : 0.0f;
      }
    }
  }
  __syncthreads();

  uint32_t amax_gx = 0, amax_gw = 0;
  if constexpr (DS) {
    qgo_tile<PASS, R>(p, DeviceSeed{p.seed + *p.seed_ptr}, tf, rt, ct, smem, amax_gx, amax_gw);
  } else {
    qgo_tile<PASS, R>(p, HostSeed{}, tf, rt, ct, smem, amax_gx, amax_gw);
  }

  if (PASS == 1) qgo_publish_amax(p, amax_gx, amax_gw, smem);
}

// ---- 16-bit tiles (qgo16_kernel) -------------------------------------------------------------------------
// For bf16/fp16 g_y whose rows load as aligned 16-byte vectors (p.vec_load: O % 8 == 0), one CTA per tile: the tile
// stays in the input's 16 bits (32 KB), filled by cp.async; a row is 512 bytes, 32 chunks of 16 B, chunk c stored
// at c ^ ((c >> 3) & 1) so that the 16-byte G~ loads (lanes 2 chunks apart) and the copies spread over the banks.
// q_gh_t has its own staging (pass 2) after the tile: 53 KB in all, so that pass 2 runs 3 CTAs per SM (4 at R = 8) and
// a G^ unit's codes are staged as soon as they are formed.
constexpr int kRawRowBytes = kTileCols * 2;
constexpr int kRawTileBytes = kTileRows * kRawRowBytes;
constexpr int kStageBytes = kTileCols * (kRowBlocks * 16 + 20);
constexpr size_t qgo16_smem_bytes(int pass) { return kRawTileBytes + (pass == 2 ? kStageBytes : 0); }
static_assert(kQgtStageBytes + kGxWordBytes <= kStageBytes && kRawTileBytes % 16 == 0,
              "G~'s words live in the q_gh_t staging, after q_gt's");

template <typename T>
struct TileRaw16 {
  static constexpr bool kStageAliases = false;
  const unsigned char* base;
  // Byte offset of element c of a row.
  static __device__ __forceinline__ int off(int row, int c) {
    const int ch = c >> 3;
    return row * kRawRowBytes + ((ch ^ ((ch >> 3) & 1)) << 4) + ((c & 7) << 1);
  }
  // The low 16 bits as a T, converted to fp32 (exact).
  static __device__ __forceinline__ float cvt(uint32_t h) { return f16bits_to_f<T>(static_cast<unsigned short>(h)); }
  // 2 consecutive columns c, c+1 (c even)
  __device__ __forceinline__ void load2(int row, int c, float& a, float& b) const {
    const uint32_t v = *reinterpret_cast<const uint32_t*>(base + off(row, c));
    a = cvt(v), b = cvt(v >> 16);
  }
  __device__ __forceinline__ float at(int row, int c) const {
    return cvt(*reinterpret_cast<const uint16_t*>(base + off(row, c)));
  }
  __device__ __forceinline__ void load16(int row, int c, float (&x)[16]) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 v = *reinterpret_cast<const uint4*>(base + off(row, c + 8 * h));
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) x[8 * h + 2 * i] = cvt(w[i]), x[8 * h + 2 * i + 1] = cvt(w[i] >> 16);
    }
  }
};

// S: the type read, T, or float32 for pass 1 of compress_activation_cast, which rounds what it reads to T (the tile
// holds what a T input would) and writes it to p.cast_out as well.
template <typename T, int PASS, int R, bool DS = false, typename S = T>
__global__ void __launch_bounds__(kThreads, qgo16_min_ctas(PASS, R)) qgo16_kernel(const S* __restrict__ gy, QgoParams p) {
  static_assert(sizeof(T) == 2, "16-bit inputs only");
  static_assert(std::is_same_v<S, T> || (std::is_same_v<S, float> && PASS == 1), "a cast is read by pass 1 only");
  HOT_DYNAMIC_SMEM(smem);
  const int tid = threadIdx.x;
  const int64_t n_ct = (std::max<int64_t>(p.O_pad, p.O) + kTileCols - 1) / kTileCols;
  const int64_t n_t = ((p.L + kTileRows - 1) / kTileRows + p.pack - 1) / p.pack;  // tiles down (pack row tiles each)
  int64_t lin = blockIdx.x;  // a 1-D grid of n_ct * n_t tiles
  if (PASS == 1) lin = n_ct * n_t - 1 - lin;  // pass 1 from the end: see the header (tile order)
  const int64_t t = static_cast<uint32_t>(lin) / static_cast<uint32_t>(n_ct);  // < kMaxGridX tiles: 32-bit division
  const int64_t ct = lin - t * n_ct;
  const int64_t c0 = ct * kTileCols;

  // ---- load the tile by cp.async (zeros outside L x O) ------------------------------------------------
  // A thread copies chunk ch = tid % 32 of rows tid / 32 + 8 k: one column test, and per row a pointer step and a row
  // test (the addresses are formed once; per-chunk 64-bit products were a fifth of pass 1's instructions). The chunk's
  // row tile and column: tile_spot (packed row tiles side by side, QgoParams::pack).
  {
    constexpr int kRowStep = kThreads / 32;
    const int ch = tid & 31, row0 = tid >> 5;
    const TileSpot at = tile_spot(p, t, c0, 8 * ch);
    const int64_t c = at.c, r0 = at.rt * kTileRows;
    const bool col_in = c < p.O;  // O % 8 == 0: a chunk is all in or all out
    const int rows_left = static_cast<int>(std::min<int64_t>(p.L - (r0 + row0), kTileRows));
    unsigned char* dst = smem + TileRaw16<T>::off(row0, 8 * ch);
    if constexpr (std::is_same_v<S, T>) {
      const T* src = gy + (r0 + row0) * p.ld_in + c;
      const int64_t step = kRowStep * p.ld_in;
#pragma unroll
      for (int k = 0; k < kTileRows / kRowStep; ++k, src += step) {
        const bool in = col_in && k * kRowStep < rows_left;
        cp_async16(dst + k * kRowStep * kRawRowBytes, in ? static_cast<const void*>(src) : gy, in);
      }
    } else {
      // A chunk is 8 floats (two 16-byte loads), rounded to T as a cast does and stored whole to the tile and to
      // the copy. Rows in batches of 4, each batch's loads issued before its stores (32 floats in flight a thread).
      constexpr int kBatch = 4;
      const int64_t src_step = kRowStep * p.ld_src, out_step = kRowStep * p.ld_in;
      const float* src = gy + (r0 + row0) * p.ld_src + c;
      T* out = static_cast<T*>(p.cast_out) + (r0 + row0) * p.ld_in + c;
#pragma unroll
      for (int k0 = 0; k0 < kTileRows / kRowStep; k0 += kBatch) {
        float4 v[kBatch][2];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const int k = k0 + j;
          if (col_in && k * kRowStep < rows_left) {
            const float4* s4 = reinterpret_cast<const float4*>(src + k * src_step);
            v[j][0] = __ldg(s4);
            v[j][1] = __ldg(s4 + 1);
          } else {
            v[j][0] = v[j][1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          }
        }
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const int k = k0 + j;
          const uint4 w = make_uint4(f16x2_bits<T>(v[j][0].x, v[j][0].y), f16x2_bits<T>(v[j][0].z, v[j][0].w),
                                     f16x2_bits<T>(v[j][1].x, v[j][1].y), f16x2_bits<T>(v[j][1].z, v[j][1].w));
          *reinterpret_cast<uint4*>(dst + k * kRowStep * kRawRowBytes) = w;
          if (col_in && k * kRowStep < rows_left) *reinterpret_cast<uint4*>(out + k * out_step) = w;
        }
      }
    }
  }
  if constexpr (std::is_same_v<S, T>) {
    cp_async_commit();
    cp_async_wait<0>();
  }
  __syncthreads();

  uint32_t amax_gx = 0, amax_gw = 0;
  if constexpr (DS) {
    qgo_tile<PASS, R>(p, DeviceSeed{p.seed + *p.seed_ptr}, TileRaw16<T>{smem}, t, ct, smem + kRawTileBytes, amax_gx,
                      amax_gw);
  } else {
    qgo_tile<PASS, R>(p, HostSeed{}, TileRaw16<T>{smem}, t, ct, PASS == 1 ? smem : smem + kRawTileBytes, amax_gx,
                      amax_gw);
  }

  if (PASS == 1) qgo_publish_amax(p, amax_gx, amax_gw, smem);  // its first barrier: everyone is done with the tile
}

// compress_activation_cast where pass 1 cannot read the float32 input itself: the input rounded to the copy's dtype
// first (a cast, as the framework's own; then the copy is compressed as any 16-bit input).
template <typename S, typename T>
__global__ void cast_kernel(Mat<const S> in, Mat<T> out) {
  const int64_t n = in.rows * in.cols;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / in.cols, c = e % in.cols;
    store_f(out.p + r * out.ld + c, load_f(in.p + r * in.ld + c));
  }
}

__global__ void qgo_finalize_kernel(const unsigned* key_gx, int64_t n_gx, int gx_qmax, float* s_g, float* inv_gx,
                                    float* pre_gx, const unsigned* key_gw, float* s_gh, float* inv_gw, float* pre_gw) {
  store_scales_from_keys(key_gx, n_gx, gx_qmax, s_g, inv_gx, pre_gx);
  if (key_gw != nullptr) store_scales_from_keys(key_gw, 1, 127, s_gh, inv_gw, pre_gw);
}

bool aligned(const void* p, int bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

size_t qgo_smem_bytes() { return static_cast<size_t>(kTileRows) * kTileCols * sizeof(float); }
static_assert(kTileCols * (kRowBlocks * 16 + 20) <= kTileRows * kTileCols * 4, "q_gh_t staging must fit the tile");

// ---- host side: one call's parameters, scratch layout and launch sequence --------------------------------

// compress_activation (ABC, SPEC §2) is the g_w part of the pass over x, with round-to-nearest; activation_codes the
// same without H^ (codes: x's rows as they are, rank 16).
GradOutputPlan abc_plan(int rank, bool codes = false, const unsigned* amax_key = nullptr) {
  GradOutputPlan plan;
  plan.amax_key = amax_key;
  plan.gx = false;
  plan.gw = true;
  plan.rank = codes ? 16 : rank;
  plan.codes = codes;
  plan.rounding = Rounding::nearest;
  plan.bias = false;
  return plan;
}

// Everything a call needs besides the scratch memory and the stream, derived from the views.
struct QgoSetup {
  QgoParams p;
  int64_t n_gx = 1;       // amax keys / scales of the g_x path: 1 (per tensor) or L (per token)
  int64_t n_rt = 0, n_ct = 0;  // row tiles (64 rows) and column tiles (256 columns) of g_y
  int64_t n_t = 0;              // tiles down the grid: n_rt / pack, rounded up
  int fixed_rank = 0;     // R of the kernels: a compiled-in rank (8, 16), 0 (run-time rank), kAsIs (plan.codes) or
                          // kGxOnly (no g_w path)
  bool raw16 = false;     // qgo16_kernel (16-bit g_y, aligned rows) rather than qgo_kernel
  size_t keys_bytes = 0, inv_bytes = 0, bias_bytes = 0;
  size_t scratch_bytes() const { return keys_bytes + inv_bytes + bias_bytes; }
  // Points the parameters at a scratch block of scratch_bytes() bytes (4-byte aligned).
  void bind_scratch(void* base) {
    unsigned* keys = static_cast<unsigned*>(base);
    float* invs = reinterpret_cast<float*>(static_cast<char*>(base) + keys_bytes);
    p.key_gx = keys;
    p.key_gw = keys + n_gx;
    p.inv_gx = invs;
    p.inv_gw = invs + n_gx;
    p.pre_gx = invs + n_gx + 1;
    p.pre_gw = invs + 2 * n_gx + 1;
    p.bias_partial = p.bias ? reinterpret_cast<float*>(static_cast<char*>(base) + keys_bytes + inv_bytes) : nullptr;
  }
};

// `smem_optin`: the most shared memory a block may have on the device (smem_per_block_optin).
QgoSetup qgo_setup(const TensorView& gy, const GradOutputPlan& plan, const GradOutputQuant& out,
                   int64_t smem_optin = kMaxGridX) {
  QgoSetup su;
  QgoParams& p = su.p;
  const int64_t L = gy.shape[0], O = gy.shape[1];
  const int64_t nb = (L + 15) / 16;
  su.n_rt = (L + kTileRows - 1) / kTileRows;
  p.L = L;
  p.O = O;
  p.ld_in = gy.strides[0];
  p.gx = plan.gx;
  p.gx_qmax = qmax_for_bits(plan.gx_bits);
  p.block = plan.block;
  p.gx_per_row = plan.gx_scale == ScaleMode::token;
  p.O_pad = O;
  if (plan.gx) {
    p.q_g = static_cast<int8_t*>(out.q_g.data);
    p.ld_qg = out.q_g.strides[0];
    p.O_pad = out.q_g.shape[1];
  }
  p.gw = plan.gw;
  p.rank = plan.gw ? plan.rank : 1;
  if (plan.gw) {
    p.q_gh = static_cast<int8_t*>(out.q_gh_t.data);
    p.ld_qgh = out.q_gh_t.strides[0];
    p.K = nb * plan.rank;
    p.K_pad = out.q_gh_t.shape[1];
  }
  p.stochastic = plan.rounding == Rounding::stochastic;
  p.seed = plan.seed;
  p.seed_ptr = p.stochastic ? plan.seed_ptr : nullptr;
  p.bias = plan.bias;
  su.n_ct = (std::max(p.O_pad, O) + kTileCols - 1) / kTileCols;

  // Scratch: amax keys (n_gx + 1), inverse scales and pre-scales (2 (n_gx + 1)), bias partials (n_rt x O).
  su.n_gx = p.gx_per_row ? L : 1;
  su.keys_bytes = static_cast<size_t>(su.n_gx + 1) * 4;
  su.inv_bytes = static_cast<size_t>(su.n_gx + 1) * 8;
  su.bias_bytes = plan.bias ? static_cast<size_t>(su.n_rt * O) * 4 : 0;

  const bool fixed = g_qgo_fixed_rank.load(std::memory_order_relaxed);
  su.fixed_rank = plan.gw && is_fixed_rank(plan.rank) && fixed ? plan.rank : !plan.gw && fixed ? kGxOnly : 0;
  if (plan.codes) {  // x's own codes (activation_codes): the g_w path alone, rank 16, round-to-nearest, untransformed
    HOT_CHECK(plan.gw && !plan.gx && !plan.bias && plan.rank == 16 && plan.rounding == Rounding::nearest, internal,
              "quantize_grad_output: a codes plan is the g_w path alone at rank 16 with round-to-nearest");
    su.fixed_rank = kAsIs;
  }
  HOT_CHECK(plan.amax_key == nullptr || takes_known_amax(plan), internal,
            "quantize_grad_output: a known amax goes with codes or with the per-tensor g_x path alone");
  p.sr8 = p.stochastic && O % kSrGroup == 0;
  const int vec = gy.dtype == DType::f32 ? 4 : 8;  // elements per 16-byte load
  p.vec_load = O % vec == 0 && p.ld_in % vec == 0 && aligned(gy.data, 16);
  su.raw16 = gy.dtype != DType::f32 && p.vec_load;
  // Shared memory per block (pass 2, the larger): both kernels fit the 64 KB of the oldest GPUs CUDA 13 builds for
  // (sm_75).
  const int64_t smem = static_cast<int64_t>(su.raw16 ? qgo16_smem_bytes(2) : qgo_smem_bytes());
  HOT_CHECK(smem <= smem_optin, unavailable, "quantize_grad_output / compress_activation: the CUDA kernels need ",
            smem, " bytes of shared memory per block; this GPU allows ", smem_optin);
  p.vec_store_qg = plan.gx && p.ld_qg % 16 == 0 && aligned(p.q_g, 16) && p.O_pad % 16 == 0;
  if (out.q_g_t.data != nullptr) {  // G~'s codes transposed as well (the g_x path alone: the staging is free)
    HOT_CHECK(plan.gx && !plan.gw && out.q_g_t.shape[0] == O && out.q_g_t.shape[1] == padded_k(L), internal,
              "quantize_grad_output: q_g_t goes with q_g and without q_gh_t, O x padded_k(L)");
    p.q_gt = static_cast<int8_t*>(out.q_g_t.data);
    p.ld_qgt = out.q_g_t.strides[0];
    p.K_t = out.q_g_t.shape[1];
    p.vec_store_qgt = p.ld_qgt % 16 == 0 && aligned(p.q_gt, 16);
  }
  p.word_store_qgh = plan.gw && p.ld_qgh % 4 == 0 && aligned(p.q_gh, 4) && p.K_pad % 4 == 0;
  // Narrow 16-bit g_y: 2 or 4 row tiles to a tile (QgoParams::pack); not with per-token G~ scales, whose amax needs a
  // tile row to be one g_y row.
  const int64_t width = std::max(p.O_pad, O);
  p.pack = su.raw16 && !p.gx_per_row ? (width <= kTileCols / 4 ? 4 : width <= kTileCols / 2 ? 2 : 1) : 1;
  p.seg_shift = p.pack == 4 ? 6 : p.pack == 2 ? 7 : 8;
  su.n_t = (su.n_rt + p.pack - 1) / p.pack;
  HOT_CHECK_VALUE(su.n_rt * su.n_ct <= kMaxGridX, "quantize_grad_output / compress_activation: an input of ", L, " x ", O, " has ",
                  su.n_rt * su.n_ct, " tiles of ", kTileRows, " x ", kTileCols, "; at most ", kMaxGridX,
                  " fit one launch (split the rows)");
  return su;
}

// compress_activation_cast of x into x_cast (the input of the call set up in su, after bind_scratch): where the
// 16-bit copy takes the 16-bit kernels (su.raw16) and x is float32 with 16-byte-aligned rows, pass 1 reads x itself
// and writes the copy (the parameters are pointed at both; returns x's data, qgo_launch's cast_src); otherwise x is
// cast into x_cast now and null is returned (the copy is then compressed as any input). The same bits either way.
template <class Launch>
const float* qgo_cast_or_bind(QgoSetup& su, const TensorView& x, const TensorView& x_cast, Launch&& launch) {
  if (su.raw16 && x.dtype == DType::f32 && x.strides[0] % 4 == 0 && aligned(x.data, 16)) {
    su.p.cast_out = x_cast.data;
    su.p.ld_src = x.strides[0];
    return static_cast<const float*>(x.data);
  }
  dispatch_float(x.dtype, "compress_activation_cast", [&](auto s) {
    using S = decltype(s);
    dispatch_float(x_cast.dtype, "compress_activation_cast", [&](auto t) {
      using T = decltype(t);
      launch(cast_kernel<S, T>, dim3(grid_1d(x.shape[0] * x.shape[1], 256)), 256, 0, mat<const S>(x), mat<T>(x_cast));
    });
  });
  return nullptr;
}

// f(std::integral_constant<int, R>{}) for the kernels' R of a call (QgoSetup::fixed_rank): the one place that lists
// the compiled instantiations.
template <class F>
void with_rank(int fixed_rank, F&& f) {
  if (fixed_rank == 8) {
    f(std::integral_constant<int, 8>{});
  } else if (fixed_rank == kAsIs) {
    f(std::integral_constant<int, kAsIs>{});
  } else if (fixed_rank == 16) {
    f(std::integral_constant<int, 16>{});
  } else if (fixed_rank == kGxOnly) {
    f(std::integral_constant<int, kGxOnly>{});
  } else {
    f(std::integral_constant<int, 0>{});
  }
}

// The launch sequence of one call, after bind_scratch: zero the amax keys, pass 1 (statistics, g_b
// partials), the scales, pass 2 (quantisation), g_b. `launch(kernel, grid, threads, smem_bytes, args...)`
// runs a kernel and `launch.zero(ptr, bytes)` clears memory, both in stream order (the CUDA backend's
// launcher, or the emulation's).
// cast_src: compress_activation_cast's float32 input, read by pass 1 (qgo_cast_or_bind), or null.
template <typename T, class Launch>
void qgo_launch(const QgoSetup& su, const GradOutputPlan& plan, const GradOutputQuant& out, const T* src,
                Launch&& launch, const float* cast_src = nullptr) {
  const QgoParams& p = su.p;
  const dim3 grid(static_cast<unsigned>(su.n_ct * su.n_t));  // one CTA per tile
  if (plan.amax_key == nullptr) launch.zero(p.key_gx, su.keys_bytes);
  const auto pass = [&](auto pass_tag, const QgoParams& pp) {
    constexpr int P = decltype(pass_tag)::value;
    const auto run = [&](auto r_tag) {
      constexpr int R = decltype(r_tag)::value;
      const auto go = [&](auto ds_tag) {
        constexpr bool DS = decltype(ds_tag)::value;
        if constexpr (sizeof(T) == 2) {
          if constexpr (P == 1 && !DS) {
            if (cast_src != nullptr) {
              launch(qgo16_kernel<T, 1, R, false, float>, grid, kThreads, qgo16_smem_bytes(1), cast_src, pp);
              return;
            }
          }
          if (su.raw16) {
            launch(qgo16_kernel<T, P, R, DS>, grid, kThreads, qgo16_smem_bytes(P), src, pp);
            return;
          }
        }
        launch(qgo_kernel<T, P, R, DS>, grid, kThreads, qgo_smem_bytes(), src, pp);
      };
      if constexpr (P == 2) {  // the only pass that rounds stochastically
        if (pp.seed_ptr != nullptr) {
          go(std::true_type{});
          return;
        }
      }
      go(std::false_type{});
    };
    with_rank(su.fixed_rank, run);
  };
  if (plan.amax_key == nullptr && (plan.gx || plan.gw || plan.bias)) pass(std::integral_constant<int, 1>{}, p);
  if (plan.gx || plan.gw) {
    float* invs = const_cast<float*>(p.inv_gx);
    // pass 1's keys, or the known one of the plan's one path
    const unsigned* key_gx = plan.amax_key != nullptr && plan.gx ? plan.amax_key : p.key_gx;
    const unsigned* key_gw = plan.amax_key != nullptr && plan.gw ? plan.amax_key : p.key_gw;
    launch(qgo_finalize_kernel, dim3(grid_1d(su.n_gx, 256)), 256, 0, key_gx, plan.gx ? su.n_gx : int64_t{0},
           p.gx_qmax, plan.gx ? static_cast<float*>(out.s_g.data) : nullptr, invs, invs + su.n_gx + 1,
           plan.gw ? key_gw : nullptr, plan.gw ? static_cast<float*>(out.s_gh.data) : nullptr, invs + su.n_gx,
           invs + 2 * su.n_gx + 1);
    QgoParams p2 = p;
    p2.bias = false;
    pass(std::integral_constant<int, 2>{}, p2);
  }
  if (plan.bias) {
    dispatch_float(out.g_b.dtype, "quantize_grad_output (g_b)", [&](auto t) {
      using B = decltype(t);
      launch(bias_final_kernel<StoreCast<B>>, bias_final_grid(p.O), kBiasFinalThreads, 0,
             static_cast<const float*>(p.bias_partial), su.n_rt, p.O, StoreCast<B>{static_cast<B*>(out.g_b.data)});
    });
  }
}

}  // namespace

}  // namespace hot::cuda
