// The kernels of the CUDA backend's building-block operations (Hadamard transform, HLA projection, quantise /
// dequantise, int4 packing, im2col and col2im, the ReLU mask, bias gradient) and their launch sequences. Included by ops_basic.cu (the backend,
// which validates the arguments, allocates scratch and launches on the caller's stream) and by the host
// emulation test (cpp/tests/emu), which runs these same kernels on the CPU. Integer results match the CPU backend
// bit for bit (same fp32 butterfly order, same scalar rules from hot/quant_rules.h, same Philox draws).
// Launchers have the interface of qgo_launch's: launch(kernel, grid, threads, smem, args...), launch.zero(p, bytes).
#pragma once

#include <algorithm>
#include <type_traits>

#include "common.cuh"
#include "bn_rules.h"
#include "conv_rules.h"
#include "fwht.cuh"
#include "hot/quant_rules.h"
#include "hot/rng.h"

namespace hot::cuda {

namespace {

constexpr int kBasicThreads = 256;

// ---- Hadamard transform -------------------------------------------------------------------------
// One thread per transformed vector of B elements (held in registers for small B).
template <int B, typename T>
__global__ void hadamard_kernel(Mat<const T> in, Mat<float> out, int axis) {
  const int64_t nvec = axis == 1 ? in.rows * (in.cols / B) : (in.rows / B) * in.cols;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < nvec;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t base_in, base_out, step_in, step_out;
    if (axis == 1) {
      const int64_t nb = in.cols / B;
      const int64_t r = v / nb, g = v % nb;
      base_in = r * in.ld + g * B;
      base_out = r * out.ld + g * B;
      step_in = 1;
      step_out = 1;
    } else {
      const int64_t g = v / in.cols, c = v % in.cols;
      base_in = g * B * in.ld + c;
      base_out = g * B * out.ld + c;
      step_in = in.ld;
      step_out = out.ld;
    }
    float x[B];
#pragma unroll
    for (int i = 0; i < B; ++i) x[i] = load_f(in.p + base_in + i * step_in);
    fwht_regs<B>(x);
#pragma unroll
    for (int i = 0; i < B; ++i) out.p[base_out + i * step_out] = x[i];
  }
}

// ---- HLA projection -------------------------------------------------------------------------------
template <typename T>
__global__ void hla_kernel(Mat<const T> in, Mat<float> out, int rank) {
  const int64_t nb = (in.rows + 15) / 16;
  const int64_t n = nb * in.cols;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < n;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = v / in.cols, c = v % in.cols;
    float x[16];
#pragma unroll
    for (int t = 0; t < 16; ++t) {
      const int64_t r = j * 16 + t;
      x[t] = r < in.rows ? load_f(in.p + r * in.ld + c) : 0.0f;
    }
    fwht_regs<16>(x);
#pragma unroll
    for (int k = 0; k < 16; ++k)
      if (k < rank) out.p[(j * rank + k) * out.ld + c] = x[hla_order(k)];
  }
}

// ---- quantise -------------------------------------------------------------------------------------
// amax keys (hot::amax_key) reduced with atomicMax: max is order independent, so the result is exact.
template <typename T>
__global__ void amax_tensor_kernel(Mat<const T> in, unsigned* key) {
  const int64_t n = in.rows * in.cols;
  uint32_t m = 0;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / in.cols, c = e % in.cols;
    m = max(m, amax_key(load_f(in.p + r * in.ld + c)));
  }
  m = block_max_u32(m);
  if (threadIdx.x == 0) atomicMax(key, m);
}

// The flat forms of amax_tensor_kernel and quantize_kernel, for an input and codes whose rows are contiguous (one
// array of n elements; the input 16-byte aligned, the codes 8-byte aligned) and one scale: 8 elements per 16-byte load
// (two for fp32) and 8 codes per 8-byte store, no index division per element. The same elements, rules and random
// groups (group g = elements 8g .. 8g+7), so the same bytes. (The element-wise forms, a 64-bit division per element,
// ran at ~1/7 of the memory bandwidth on the feature maps every k x k conv quantises in the forward.)
// 8 values of T as loaded (16 or 32 bytes), apart from their conversion, so that a thread can have several rows'
// loads in flight before their arithmetic (bn_reduce_kernel).
template <typename T>
struct Raw8 {
  uint4 w[sizeof(T) / 2];
};
template <typename T>
__device__ __forceinline__ void raw8_load(const T* p, Raw8<T>& r) {
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(T) / 2); ++i) r.w[i] = __ldg(reinterpret_cast<const uint4*>(p) + i);
}
template <typename T>
__device__ __forceinline__ void raw8_to_f(const Raw8<T>& r, float (&v)[8]) {
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(T) / 2); ++i) {
    const uint32_t u[4] = {r.w[i].x, r.w[i].y, r.w[i].z, r.w[i].w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (sizeof(T) == 4) {
        v[4 * i + k] = __uint_as_float(u[k]);
      } else {
        v[2 * k] = f16bits_to_f<T>(static_cast<unsigned short>(u[k]));
        v[2 * k + 1] = f16bits_to_f<T>(static_cast<unsigned short>(u[k] >> 16));
      }
    }
  }
}

template <typename T>
__device__ __forceinline__ void load8_f(const T* p, float (&v)[8]) {
  Raw8<T> r;
  raw8_load(p, r);
  raw8_to_f(r, v);
}

template <typename T>
__global__ void amax_flat_kernel(const T* __restrict__ in, int64_t n, unsigned* key) {
  const int64_t ng = n / kSrGroup, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  uint32_t m = 0;
  for (int64_t g = tid; g < ng; g += stride) {
    float v[8];
    load8_f(in + g * kSrGroup, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) m = max(m, amax_key(v[i]));
  }
  if (tid < n - ng * kSrGroup) m = max(m, amax_key(load_f(in + ng * kSrGroup + tid)));  // the last partial group
  m = block_max_u32(m);
  if (threadIdx.x == 0) atomicMax(key, m);
}

// The flat kernel: the operand's rows (cols elements each) are one contiguous array of n elements; one thread per 8
// consecutive elements. Round-to-nearest (SR false: no generator code at all), or stochastic rounding where
// cols % 8 != 0 (else quantize_flat_sr_kernel): the element's row and column from one division per group, then
// advanced with a carry.
template <typename T, bool SR>
__global__ void quantize_flat_kernel(const T* __restrict__ in, int8_t* __restrict__ q, int64_t n, int64_t cols,
                                     const float* inv, const float* pre, int qmax, uint64_t seed, uint32_t rng) {
  const QuantScale qs{inv[0], 0.0f, pre[0]};
  const int64_t ngroups = (n + kSrGroup - 1) / kSrGroup;
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < ngroups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e0 = g * kSrGroup;
    if constexpr (!SR) {
      if (e0 + kSrGroup <= n) {
        float v[8];
        load8_f(in + e0, v);
        uint32_t w[2] = {0u, 0u};
#pragma unroll
        for (int j = 0; j < 8; ++j)
          w[j >> 2] |= static_cast<uint32_t>(static_cast<uint8_t>(quantize_nearest(v[j], qs, qmax))) << (8 * (j & 3));
        *reinterpret_cast<uint2*>(q + e0) = make_uint2(w[0], w[1]);
      } else {
        for (int64_t e = e0; e < n; ++e) q[e] = quantize_nearest(load_f(in + e), qs, qmax);
      }
    } else {
      SrWalk walk{seed, rng, n / cols, cols};
      int64_t r = e0 / cols, c = e0 - r * cols;
      for (int64_t e = e0; e < std::min<int64_t>(e0 + kSrGroup, n); ++e) {
        q[e] = quantize_stochastic(load_f(in + e), qs, qmax, walk.uniform(r, c));
        if (++c == cols) c = 0, ++r;
      }
    }
  }
}

// Stochastic rounding of a flat operand (quantize_flat_kernel's layout) of R rows of C % 8 == 0 columns: one thread
// per 4 rows x 8 columns (4r0 .. 4r0 + 3, 8c0 .. 8c0 + 7), whose 32 uniforms take one row call and one column call
// (rng.h: rows 4r0 .. of one 256-column segment share the row call, their 64-row block and 8 columns the column call).
template <typename T>
__global__ void quantize_flat_sr_kernel(const T* __restrict__ in, int8_t* __restrict__ q, int64_t R, int64_t C,
                                        const float* inv, const float* pre, int qmax, uint64_t seed, uint32_t rng) {
  const QuantScale qs{inv[0], 0.0f, pre[0]};
  const int64_t groups = C / kSrGroup, units = (R + 3) / 4 * groups;
  for (int64_t u = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; u < units;
       u += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t quad = u / groups, r0 = 4 * quad, c0 = (u - quad * groups) * kSrGroup;
    const Philox4 a = sr_call(seed, rng, kSrRowCall, sr_row_call_index(R, r0, c0));
    const Philox4 b = sr_call(seed, rng, kSrColumnCall, sr_column_call_index(C, r0, c0));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (r0 + i < R) {
        float v[8];
        load8_f(in + (r0 + i) * C + c0, v);
        uint32_t w[2] = {0u, 0u};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int8_t code = quantize_stochastic(v[j], qs, qmax, sr_pair_uniform(a.v[i], b.v[j >> 1], j));
          w[j >> 2] |= static_cast<uint32_t>(static_cast<uint8_t>(code)) << (8 * (j & 3));
        }
        *reinterpret_cast<uint2*>(q + (r0 + i) * C + c0) = make_uint2(w[0], w[1]);
      }
    }
  }
}

template <typename T>
__global__ void amax_row_kernel(Mat<const T> in, unsigned* keys) {
  const int64_t r = blockIdx.x;
  uint32_t m = 0;
  for (int64_t c = threadIdx.x; c < in.cols; c += blockDim.x) m = max(m, amax_key(load_f(in.p + r * in.ld + c)));
  m = block_max_u32(m);
  if (threadIdx.x == 0) keys[r] = m;
}

// scale[i] / inv[i] from the amax keys (n = 1 or R).
__global__ void finalize_scales_kernel(const unsigned* keys, int64_t n, int qmax, float* scale, float* inv, float* pre) {
  store_scales_from_keys(keys, n, qmax, scale, inv, pre);
}

// One thread per group of 8 logical elements (row-major); stochastic rounding's uniforms by SrWalk (rng.h).
template <typename T>
__global__ void quantize_kernel(Mat<const T> in, Mat<int8_t> q, const float* inv, const float* pre, bool per_row, int qmax,
                                bool stochastic, uint64_t seed, uint32_t rng) {
  const int64_t n = in.rows * in.cols;
  const int64_t ngroups = (n + kSrGroup - 1) / kSrGroup;
  SrWalk walk{seed, rng, in.rows, in.cols};
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < ngroups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
#pragma unroll
    for (int j = 0; j < kSrGroup; ++j) {
      const int64_t e = g * kSrGroup + j;
      if (e >= n) break;
      const int64_t r = e / in.cols, c = e % in.cols;
      const float v = load_f(in.p + r * in.ld + c);
      const QuantScale qs{inv[per_row ? r : 0], 0.0f, pre[per_row ? r : 0]};
      q.p[r * q.ld + c] = stochastic ? quantize_stochastic(v, qs, qmax, walk.uniform(r, c))
                                     : quantize_nearest(v, qs, qmax);
    }
  }
}

// ---- dequantise, int4 -------------------------------------------------------------------------------
template <typename T>
__global__ void dequantize_kernel(Mat<const int8_t> q, const float* scale, bool per_row, Mat<T> out) {
  const int64_t n = q.rows * q.cols;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / q.cols, c = e % q.cols;
    store_f(out.p + r * out.ld + c, hot_mul(static_cast<float>(q.p[r * q.ld + c]), scale[per_row ? r : 0]));
  }
}

// col2im (conv_rules.h): one thread per input pixel and unit of V channels (V * sizeof(T) = 16 bytes where the
// channel run, both row strides and both pointers allow, else V = 1), a block per map row (or several short rows), the
// units fastest, so that a warp's reads of
// one kernel offset are consecutive columns (i*kw + j)*C + c of one im2col row, and its writes consecutive channels of
// one pixel of the channels-last map: whole sectors both ways, each read or written once. Each of the V channels sums
// its terms in col2im_sources' order, as col2im_pixel does (the CPU's values, bit for bit).
template <typename T, int V>
struct alignas(V * sizeof(T)) Col2imUnit {
  T x[V];
};

template <typename T, int V>
__global__ void col2im_kernel(const T* __restrict__ cols, int64_t ld, Col2imParams p, T* __restrict__ out,
                              int64_t ldo) {
  using Unit = Col2imUnit<T, V>;
  // A block takes G map rows (n, h) at a time (G = max(1, blockDim / units per row)); its threads the rows' units in
  // order. (n, h) of the group's first row is decoded once per group (the 64-bit divisions), the rest in 32 bits
  // (C * W < 2^30: hot::col2im checks the sizes).
  const int cu = static_cast<int>(p.C) / V, row_units = cu * static_cast<int>(p.W);
  const int G = max(1, static_cast<int>(blockDim.x) / row_units), H = static_cast<int>(p.H);
  const int64_t rows = p.N * p.H;
  for (int64_t nh0 = blockIdx.x * static_cast<int64_t>(G); nh0 < rows; nh0 += static_cast<int64_t>(gridDim.x) * G) {
    const int h0 = static_cast<int>(nh0 % p.H);
    const int64_t n0 = nh0 / p.H;
    const int span = static_cast<int>(min(static_cast<int64_t>(G), rows - nh0)) * row_units;
    for (int t = static_cast<int>(threadIdx.x); t < span; t += static_cast<int>(blockDim.x)) {
      const int g = t / row_units, r = t - g * row_units, w = r / cu, c = (r - w * cu) * V;
      int h = h0 + g;
      int64_t n = n0;
      while (h >= H) h -= H, ++n;
      float acc[V] = {};
      bool any = false;
      col2im_sources(p, n, h, w, [&](int64_t row, int ij) {
        const Unit u = *reinterpret_cast<const Unit*>(cols + row * ld + static_cast<int64_t>(ij) * p.C + c);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float v = load_f(&u.x[k]);
          acc[k] = (any || p.overlap) ? acc[k] + v : v;
        }
        any = true;
      });
      Unit o;
#pragma unroll
      for (int k = 0; k < V; ++k) store_f(&o.x[k], acc[k]);
      *reinterpret_cast<Unit*>(out + ((nh0 + g) * p.W + w) * ldo + c) = o;
    }
  }
}

// im2col (conv_rules.h's row order): a copy in units U of 2 to 16 bytes (the widest that the channel run, both row
// strides and both pointers allow: 16 for bf16 maps of 8k channels). A block takes `rows` consecutive rows at a time:
// their windows' origins are decoded once into shared memory (64-bit divisions, once per row), then its threads copy
// the rows' units in order, consecutive threads on consecutive units of one (i, j) run (coalesced reads and writes),
// with 32-bit index arithmetic per unit (rows * kh * kw * C stays below 2^31: hot::im2col checks kh * kw * C).
constexpr int kIm2colThreads = 256;

template <typename U>
__global__ void im2col_kernel(const U* __restrict__ map, int64_t ldm, Col2imParams p, int cu, int rows, int64_t L,
                              U* __restrict__ cols, int64_t ldc) {
  __shared__ int64_t base[kIm2colThreads];
  __shared__ int hb[kIm2colThreads], wb[kIm2colThreads];
  const int per_row = p.kh * p.kw * cu;
  for (int64_t r0 = blockIdx.x * static_cast<int64_t>(rows); r0 < L; r0 += static_cast<int64_t>(gridDim.x) * rows) {
    const int nr = static_cast<int>(min(static_cast<long long>(rows), static_cast<long long>(L - r0)));
    for (int t = static_cast<int>(threadIdx.x); t < nr; t += static_cast<int>(blockDim.x)) {
      int64_t n, ho, wo;
      im2col_pixel(p, r0 + t, n, ho, wo);
      base[t] = n * p.H;
      hb[t] = static_cast<int>(ho) * p.sh - p.ph;
      wb[t] = static_cast<int>(wo) * p.sw - p.pw;
    }
    __syncthreads();
    for (int e = static_cast<int>(threadIdx.x); e < nr * per_row; e += static_cast<int>(blockDim.x)) {
      const int rl = e / per_row, rem = e - rl * per_row, ij = rem / cu, c = rem - ij * cu;
      const int i = ij / p.kw, j = ij - i * p.kw;
      const int h = hb[rl] + i * p.dh, w = wb[rl] + j * p.dw;
      U v{};
      if (h >= 0 && h < p.H && w >= 0 && w < p.W) v = map[((base[rl] + h) * p.W + w) * ldm + c];
      cols[(r0 + rl) * ldc + rem] = v;
    }
    __syncthreads();  // the next rows' origins overwrite these
  }
}

// transpose: one CTA of kBasicThreads = 256 threads (8 warps) per tile of 32E x 32E elements of one batch entry
// (grid-stride over tiles), moved in 32-bit words of E = 4 / sizeof(U) elements where both sides' runs, strides and
// pointers allow (else E = 1 and words of one element): a warp reads one input row's 32 consecutive words (128 bytes),
// the tile goes through shared memory (rows padded by one word: the column reads fall in distinct banks), and a warp
// writes 32 consecutive words of one output row, each word packed from E input rows. Each warp takes 4E of the tile's
// rows: all 4E words of a thread are loaded before any is stored to shared memory, so that they are in flight together.
constexpr int kTransposeWords = 32;  // words per tile side

template <typename U, int E>
__global__ void __launch_bounds__(kBasicThreads) transpose_kernel(const U* __restrict__ in, int64_t ib, int64_t ir,
                                                                  U* __restrict__ out, int64_t ob, int64_t os,
                                                                  int64_t B, int64_t R, int64_t S) {
  constexpr int kSide = kTransposeWords * E, kPitch = kSide + E;  // elements
  constexpr int kWarps = kBasicThreads / 32, kPer = kSide / kWarps;  // rows per warp
  using W = std::conditional_t<E == 1, U, uint32_t>;
  __shared__ __align__(16) U tile[kSide * kPitch];
  const int64_t tr = (R + kSide - 1) / kSide, ts = (S + kSide - 1) / kSide;
  const int lane = static_cast<int>(threadIdx.x) % kTransposeWords;
  const int warp = static_cast<int>(threadIdx.x) / kTransposeWords;
  for (int64_t t = blockIdx.x; t < B * tr * ts; t += gridDim.x) {
    const int64_t b = t / (tr * ts), rest = t - b * tr * ts, r0 = rest / ts * kSide, s0 = (rest % ts) * kSide;
    const int nr = static_cast<int>(R - r0 < kSide ? R - r0 : kSide);
    const int ns = static_cast<int>(S - s0 < kSide ? S - s0 : kSide);
    W v[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {  // input row r0 + k, word `lane`: elements s0 + E*lane ..
      const int k = warp + i * kWarps;
      if (k < nr && lane * E < ns) v[i] = *reinterpret_cast<const W*>(in + b * ib + (r0 + k) * ir + s0 + lane * E);
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int k = warp + i * kWarps;
      if (k < nr && lane * E < ns) *reinterpret_cast<W*>(tile + k * kPitch + lane * E) = v[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kPer; ++i) {  // output row s0 + k, word `lane`: elements r0 + E*lane ..
      const int k = warp + i * kWarps;
      if (k < ns && lane * E < nr) {
        W w = 0;
#pragma unroll
        for (int e = 0; e < E; ++e) w |= static_cast<W>(tile[(lane * E + e) * kPitch + k]) << (8 * sizeof(U) * e);
        *reinterpret_cast<W*>(out + b * ob + (s0 + k) * os + r0 + lane * E) = w;
      }
    }
    __syncthreads();  // the next tile overwrites this one
  }
}

// transpose of batch entries with at most kTransposeFewRows rows (the 3 channels of an image batch: a 32E x 32E tile
// would move R rows of 32E, a tenth of its bytes): a thread per element column s of entry b (grid y over the entries,
// x over the columns, no index division); each of its R loads is one of the warp's consecutive elements of row r, and
// its R stores fill its output row, next to the next thread's.
constexpr int kTransposeFewRows = 8;

template <typename U>
__global__ void __launch_bounds__(kBasicThreads) transpose_few_rows_kernel(const U* __restrict__ in, int64_t ib,
                                                                           int64_t ir, U* __restrict__ out, int64_t ob,
                                                                           int64_t os, int64_t B, int R, int64_t S) {
  for (int64_t b = blockIdx.y; b < B; b += gridDim.y)
    for (int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; s < S;
         s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      U v[kTransposeFewRows];
#pragma unroll
      for (int r = 0; r < kTransposeFewRows; ++r)
        if (r < R) v[r] = in[b * ib + r * ir + s];
#pragma unroll
      for (int r = 0; r < kTransposeFewRows; ++r)
        if (r < R) out[b * ob + s * os + r] = v[r];
    }
}

// relu_mask on the raw bits R of a float format with sign bit kSign and +Inf kInf, so that every element is copied or
// zeroed bit for bit: m = |x|'s bits; x <= 0 where m == 0 or (sign and m <= kInf); x < 0 where also m != 0 (NaN: m >
// kInf, neither). A thread takes groups of 8 consecutive elements, the elements of one mask byte: 8 x 16 or 8 x 32 bits
// move as one or two 16-byte vectors when the arrays are 16-byte aligned (`vec`, a group past the end of n and
// unaligned arrays go element by element), and the thread writes the group's byte itself, so a warp stores 32
// consecutive bytes of mask. kMaskUnroll groups a step per thread, all loaded before anything is stored (x and y may be
// one array, the in-place ReLU, so neither is __restrict__ and the compiler could not hoist a load above a store).
constexpr int kMaskUnroll = 4;

template <typename R>
__device__ __forceinline__ void load_group8(const R* p, int64_t e0, int64_t n, bool vec, R (&v)[8]) {
  if (vec && e0 + 8 <= n) {
    constexpr int kWords = static_cast<int>(sizeof(R)) / 2;  // 16-byte words in 8 elements: 1 (16-bit) or 2 (32-bit)
    uint4 w[kWords];
#pragma unroll
    for (int k = 0; k < kWords; ++k) w[k] = reinterpret_cast<const uint4*>(p + e0)[k];
    memcpy(v, w, sizeof(v));
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = e0 + j < n ? p[e0 + j] : R(0);
  }
}

template <typename R>
__device__ __forceinline__ void store_group8(R* p, int64_t e0, int64_t n, bool vec, const R (&v)[8]) {
  if (vec && e0 + 8 <= n) {
    constexpr int kWords = static_cast<int>(sizeof(R)) / 2;
    uint4 w[kWords];
    memcpy(w, v, sizeof(v));
#pragma unroll
    for (int k = 0; k < kWords; ++k) reinterpret_cast<uint4*>(p + e0)[k] = w[k];
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (e0 + j < n) p[e0 + j] = v[j];
  }
}

// amax_key of the value whose |bits| (sign clear) are m in the raw format (R, kInf): the max of the raw |bits| is the
// max of the keys (both order |v|, NaN above +Inf), so a thread keeps raw bits and converts once.
template <typename R, R kInf>
__device__ __forceinline__ uint32_t raw_amax_key(uint32_t m) {
  if constexpr (sizeof(R) == 4) {
    return m;
  } else if constexpr (kInf == 0x7f80) {  // bfloat16: the upper half of the float
    return m << 16;
  } else {
    return amax_key(f16bits_to_f<__half>(static_cast<unsigned short>(m)));
  }
}

template <typename R, R kSign, R kInf, bool kAmax>
__global__ void __launch_bounds__(kBasicThreads) relu_mask_kernel(const R* x, R* y, int64_t n,
                                                                  uint8_t* __restrict__ bits, bool vec,
                                                                  unsigned* __restrict__ key) {
  const int64_t groups = (n + 7) / 8;
  uint32_t m = 0;  // kAmax: the max of |y|'s raw bits over this thread's outputs (16-bit: per half-word lane)
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g0 = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g0 < groups;
       g0 += kMaskUnroll * step) {
    R v[kMaskUnroll][8];
#pragma unroll
    for (int u = 0; u < kMaskUnroll; ++u)
      if (g0 + u * step < groups) load_group8(x, (g0 + u * step) * 8, n, vec, v[u]);
#pragma unroll
    for (int u = 0; u < kMaskUnroll; ++u) {
      const int64_t g = g0 + u * step;
      if (g >= groups) break;
      unsigned zero = 0, neg = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        // x < 0 (not NaN, not -0): kSign < bits <= kSign + kInf, one unsigned compare; x <= 0: that, or |x| == 0
        const uint32_t r = v[u][j];
        const bool lt = r - (uint32_t{kSign} + 1u) <= uint32_t{kInf} - 1u;
        neg |= static_cast<unsigned>(lt) << j;
        zero |= static_cast<unsigned>(lt || (r & ~uint32_t{kSign}) == 0) << j;
        v[u][j] = lt ? R(0) : v[u][j];
      }
      if constexpr (kAmax) {  // the group's |y| bits as 32-bit words: two 16-bit lanes a word (__vmaxu2) or one float
        uint32_t w[8 * sizeof(R) / 4];
        memcpy(w, v[u], sizeof(w));
#pragma unroll
        for (int k = 0; k < static_cast<int>(8 * sizeof(R) / 4); ++k)
          m = sizeof(R) == 2 ? __vmaxu2(m, w[k] & 0x7fff7fffu) : max(m, w[k] & 0x7fffffffu);
      }
      if (g * 8 + 8 > n) zero &= (1u << (n - g * 8)) - 1u;  // the last group's bits past n stay clear
      if (y != x || neg != 0) store_group8(y, g * 8, n, vec, v[u]);  // in place: only groups with a negative
      bits[g] = static_cast<uint8_t>(zero);
    }
  }
  if constexpr (kAmax) {
    if constexpr (sizeof(R) == 2) m = max(m & 0xffffu, m >> 16);  // the larger of the two 16-bit lanes
    m = block_max_u32(raw_amax_key<R, kInf>(m));
    if (threadIdx.x == 0 && m != 0) atomicMax(key, m);
  }
}

// The backward in the same groups: g_x = +0 where the element's bit is set, g_y elsewhere (g_x may be g_y itself).
template <typename R>
__global__ void relu_mask_backward_kernel(const R* gy, const uint8_t* __restrict__ bits, int64_t n, R* gx, bool vec) {
  const int64_t groups = (n + 7) / 8;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g0 = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g0 < groups;
       g0 += kMaskUnroll * step) {
    R v[kMaskUnroll][8];
    unsigned b[kMaskUnroll];
#pragma unroll
    for (int u = 0; u < kMaskUnroll; ++u)
      if (g0 + u * step < groups) {
        load_group8(gy, (g0 + u * step) * 8, n, vec, v[u]);
        b[u] = bits[g0 + u * step];
      }
#pragma unroll
    for (int u = 0; u < kMaskUnroll; ++u) {
      const int64_t g = g0 + u * step;
      if (g >= groups) break;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if ((b[u] >> j) & 1u) v[u][j] = 0;
      store_group8(gx, g * 8, n, vec, v[u]);
    }
  }
}

// ---- BatchNorm's per-channel sums (batch_norm_backward_reduce, ops.h) ----------------------------------
// Grid (row groups of kBnReduceRows, channel slices of 8 J); a CTA is kBnLanes row lanes x J (up to kBnMaxJ) threads of
// 8 channels: a warp reads 4 consecutive rows' 128 bytes (16-bit, J = 8). Thread (lane k, j) adds rows k, k + 32, ...
// of its group in order (U rows' loads issued before their adds: a lane's 32 rows in 4 rounds), the lanes are summed
// pairwise through shared memory and lane 0 writes the group's partial sums, [group][sum_dy (C), sum_dy_xmu (C)];
// bias_final_kernel then adds the groups in order (BnSums).
constexpr int kBnLanes = static_cast<int>(kBnReduceLanes), kBnMaxJ = 8;

// One row's terms added to a thread's sums: s += g_y, t += g_y * (x - mean), each step rounded (ops.h).
__device__ __forceinline__ void bn_reduce_add(const float (&d)[8], const float (&v)[8], const float (&mu)[8],
                                              float (&s)[8], float (&t)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    s[i] = hot_add(s[i], d[i]);
    t[i] = hot_add(t[i], hot_mul(d[i], hot_add(v[i], -mu[i])));
  }
}

// The ReLU's mask of 8 elements (bit k: element k masked) applied to their raw words: masked elements become +0.
template <typename T>
__device__ __forceinline__ void raw8_mask(Raw8<T>& r, uint32_t bits) {
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(T) / 2); ++i) {
    uint32_t u[4] = {r.w[i].x, r.w[i].y, r.w[i].z, r.w[i].w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (sizeof(T) == 4) {
        if ((bits >> (4 * i + k)) & 1u) u[k] = 0u;
      } else {
        if ((bits >> (2 * k)) & 1u) u[k] &= 0xffff0000u;
        if ((bits >> (2 * k + 1)) & 1u) u[k] &= 0x0000ffffu;
      }
    }
    r.w[i] = make_uint4(u[0], u[1], u[2], u[3]);
  }
}

// With `relu`: g_y's elements (row-major, rows contiguous) masked by the ReLU's bits, their bytes into `out` (null:
// not asked) as relu_mask_backward writes them (batch_norm_backward_reduce's relu_bits, ops.h).
struct BnRelu {
  const uint8_t* bits;
  void* out;
  int64_t ld_out;
};

// The 32 lanes' sums (s, t) of a CTA's thread column j added pairwise (lane k += lane k + h for h = 16, 8, ..., 1)
// through `hand`; lane 0 writes its cn channels' s to out[0, cn) and t to out[C, C + cn).
using BnHand = float[kBnLanes / 2][kBnMaxJ][17];
__device__ __forceinline__ void bn_lanes_to_partial(float (&s)[8], float (&t)[8], BnHand& hand, int k, int j, int cn,
                                                    float* out, int64_t C) {
  for (int step = kBnLanes / 2; step >= 1; step /= 2) {
    if (k >= step && k < 2 * step) {
#pragma unroll
      for (int i = 0; i < 8; ++i) hand[k - step][j][i] = s[i], hand[k - step][j][8 + i] = t[i];
    }
    __syncthreads();
    if (k < step) {
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] = hot_add(s[i], hand[k][j][i]), t[i] = hot_add(t[i], hand[k][j][8 + i]);
    }
    __syncthreads();
  }
  if (k == 0) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (i < cn) out[i] = s[i], out[C + i] = t[i];
  }
}

// kRelu: with the ReLU's bits (`relu`), bounded to 2 CTAs an SM (its masks took it to 138 registers); without them
// the kernel has no trace of them (a runtime test and the bound cost its plain use ~6 %, H200).
template <typename T, bool kRelu>
__global__ void __launch_bounds__(kBnLanes * kBnMaxJ, kRelu ? 2 : 1)
    bn_reduce_kernel(Mat<const T> gy, Mat<const T> x, const float* mean, float* partial, bool vec, BnRelu relu) {
  constexpr int U = sizeof(T) == 4 ? 4 : 8;  // rows in flight a thread (64 registers of loads)
  __shared__ float hand[kBnLanes / 2][kBnMaxJ][17];
  const int J = static_cast<int>(blockDim.x) / kBnLanes, j = static_cast<int>(threadIdx.x) % J,
            k = static_cast<int>(threadIdx.x) / J;
  const int64_t C = gy.cols, c0 = (static_cast<int64_t>(blockIdx.y) * J + j) * 8;
  const int cn = c0 < C ? static_cast<int>(C - c0 < 8 ? C - c0 : 8) : 0;
  float s[8], t[8], mu[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] = 0.0f, t[i] = 0.0f, mu[i] = i < cn ? mean[c0 + i] : 0.0f;
  const int64_t g0 = static_cast<int64_t>(blockIdx.x) * kBnReduceRows;
  const int64_t r1 = g0 + kBnReduceRows < gy.rows ? g0 + kBnReduceRows : gy.rows;
  T* out = static_cast<T*>(relu.out);
  if (vec && cn == 8) {  // with relu: C % 8 == 0, so the 8 elements' bits are one byte
    for (int64_t r = g0 + k; r < r1; r += kBnLanes * U) {
      Raw8<T> a[U], b[U];
      [[maybe_unused]] uint32_t m[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (r + u * kBnLanes < r1) {
          raw8_load(gy.p + (r + u * kBnLanes) * gy.ld + c0, a[u]);
          raw8_load(x.p + (r + u * kBnLanes) * x.ld + c0, b[u]);
          if constexpr (kRelu) m[u] = relu.bits[((r + u * kBnLanes) * C + c0) >> 3];
        }
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (r + u * kBnLanes < r1) {
          if constexpr (kRelu) {
            raw8_mask(a[u], m[u]);
            if (out != nullptr) {
              uint4* dst = reinterpret_cast<uint4*>(out + (r + u * kBnLanes) * relu.ld_out + c0);
#pragma unroll
              for (int i = 0; i < static_cast<int>(sizeof(T) / 2); ++i) dst[i] = a[u].w[i];
            }
          }
          float d[8], v[8];
          raw8_to_f(a[u], d);
          raw8_to_f(b[u], v);
          bn_reduce_add(d, v, mu, s, t);
        }
    }
  } else if (cn > 0) {  // unaligned rows or a partial group of 8 channels: element-wise loads, zeros past C (unstored)
    using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, unsigned short>;  // an element's bytes, as they are
    for (int64_t r = g0 + k; r < r1; r += kBnLanes) {
      float d[8], v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int64_t at = r * C + c0 + i;  // the element's bit (relu: rows contiguous)
        const bool zero = kRelu && i < cn && ((relu.bits[at >> 3] >> (at & 7)) & 1u);
        d[i] = i < cn && !zero ? load_f(gy.p + r * gy.ld + c0 + i) : 0.0f;
        v[i] = i < cn ? load_f(x.p + r * x.ld + c0 + i) : 0.0f;
        if (kRelu && i < cn && out != nullptr)
          reinterpret_cast<Bits*>(out + r * relu.ld_out + c0)[i] =
              zero ? Bits{0} : reinterpret_cast<const Bits*>(gy.p + r * gy.ld + c0)[i];
      }
      bn_reduce_add(d, v, mu, s, t);
    }
  }
  bn_lanes_to_partial(s, t, hand, k, j, cn, partial + static_cast<int64_t>(blockIdx.x) * 2 * C + c0, C);
}

// bias_final_kernel's store for BatchNorm's sums: columns [0, C) are sum_dy, [C, 2C) sum_dy_xmu (and grad_weight).
struct BnSums {
  float *sum_dy, *sum_dy_xmu, *grad_weight;
  const float* invstd;
  int64_t C;
  __device__ void operator()(int64_t c, float v) const {
    if (c < C) {
      sum_dy[c] = v;
    } else {
      sum_dy_xmu[c - C] = v;
      if (grad_weight != nullptr) grad_weight[c - C] = hot_mul(v, invstd[c - C]);
    }
  }
};

// ---- BatchNorm's statistics and output (batch_norm_stats, batch_norm_transform, ops.h) ------------------------
// bn_stats_kernel: bn_reduce_kernel's grid, lanes and order over x alone: thread (lane k, j) adds d = x - K and d * d
// (K: the first row's value of its channel) over rows k, k + 32, ... of its group (U rows' loads in flight: one tensor
// read, so twice the reduce's), then the lanes pairwise; partial [group][a (C), b (C)]. bias_final_kernel adds the
// groups in order into sums [a (C), b (C)] and bn_stats_final_kernel applies bn_store_stats per channel.
template <typename T>
__global__ void __launch_bounds__(kBnLanes * kBnMaxJ, 2) bn_stats_kernel(Mat<const T> x, float* partial, bool vec) {
  constexpr int U = sizeof(T) == 4 ? 8 : 16;
  __shared__ float hand[kBnLanes / 2][kBnMaxJ][17];
  const int J = static_cast<int>(blockDim.x) / kBnLanes, j = static_cast<int>(threadIdx.x) % J,
            k = static_cast<int>(threadIdx.x) / J;
  const int64_t C = x.cols, c0 = (static_cast<int64_t>(blockIdx.y) * J + j) * 8;
  const int cn = c0 < C ? static_cast<int>(C - c0 < 8 ? C - c0 : 8) : 0;
  float s[8], t[8], K[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] = 0.0f, t[i] = 0.0f, K[i] = i < cn ? load_f(x.p + c0 + i) : 0.0f;
  const auto add = [&](const float (&v)[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float d = hot_add(v[i], -K[i]);
      s[i] = hot_add(s[i], d);
      t[i] = hot_add(t[i], hot_mul(d, d));
    }
  };
  const int64_t g0 = static_cast<int64_t>(blockIdx.x) * kBnReduceRows;
  const int64_t r1 = g0 + kBnReduceRows < x.rows ? g0 + kBnReduceRows : x.rows;
  if (vec && cn == 8) {
    for (int64_t r = g0 + k; r < r1; r += kBnLanes * U) {
      Raw8<T> a[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (r + u * kBnLanes < r1) raw8_load(x.p + (r + u * kBnLanes) * x.ld + c0, a[u]);
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (r + u * kBnLanes < r1) {
          float v[8];
          raw8_to_f(a[u], v);
          add(v);
        }
    }
  } else if (cn > 0) {  // element-wise loads; channels past C: zeros, unstored
    for (int64_t r = g0 + k; r < r1; r += kBnLanes) {
      float v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = i < cn ? load_f(x.p + r * x.ld + c0 + i) : 0.0f;
      add(v);
    }
  }
  bn_lanes_to_partial(s, t, hand, k, j, cn, partial + static_cast<int64_t>(blockIdx.x) * 2 * C + c0, C);
}

// Per channel: the statistics from the groups' sums (bn_store_stats); rm, rv null without running statistics.
struct BnStatsOut {
  float *mean, *invstd, *rm, *rv;
  float eps, momentum, om;
};
template <typename T>
__global__ void bn_stats_final_kernel(Mat<const T> x, const float* sums, BnStatsOut o) {
  const int64_t C = x.cols, c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  bn_store_stats(sums[c], sums[C + c], load_f(x.p + c), x.rows, o.eps, o.momentum, o.om, o.mean + c, o.invstd + c,
                 o.rm != nullptr ? o.rm + c : nullptr, o.rv != nullptr ? o.rv + c : nullptr);
}

// bn_transform_kernel: a CTA is (256 / J) rows x J threads of 8 channels (J up to 32; blockIdx.y: slices of 8 J
// channels); a thread forms its channels' coefficients once, then steps over rows (U rows' loads in flight), stores
// in 16-byte vectors where the rows allow.
struct BnAffine {
  const float *mean, *invstd, *weight, *bias;
  bool vec;  // every array 16-byte aligned: a thread's 8 coefficients of each in two float4 loads
};

// c[0, 8) = p[c0, c0 + 8): two float4 loads where `vec` and cn == 8, else element-wise (zeros past cn; p null: `dflt`).
__device__ __forceinline__ void bn_coef8(const float* p, int64_t c0, int cn, bool vec, float dflt, float (&c)[8]) {
  if (p != nullptr && vec && cn == 8) {
    const float4* v = reinterpret_cast<const float4*>(p + c0);
    const float4 a = __ldg(v), b = __ldg(v + 1);
    c[0] = a.x, c[1] = a.y, c[2] = a.z, c[3] = a.w, c[4] = b.x, c[5] = b.y, c[6] = b.z, c[7] = b.w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) c[i] = i < cn ? (p != nullptr ? p[c0 + i] : dflt) : 0.0f;
  }
}
constexpr int kBnTransformMaxJ = 32;
template <typename T>
__global__ void __launch_bounds__(kBasicThreads) bn_transform_kernel(Mat<const T> x, BnAffine a, Mat<T> y, int J,
                                                                     bool vec) {
  constexpr int U = 4;
  const int j = static_cast<int>(threadIdx.x) % J, k = static_cast<int>(threadIdx.x) / J,
            rows = static_cast<int>(blockDim.x) / J;
  if (k >= rows) return;
  const int64_t C = x.cols, c0 = (static_cast<int64_t>(blockIdx.y) * J + j) * 8;
  if (c0 >= C) return;
  const int cn = static_cast<int>(C - c0 < 8 ? C - c0 : 8);
  float mu[8], sc[8], bs[8], w[8];
  bn_coef8(a.mean, c0, cn, a.vec, 0.0f, mu);
  bn_coef8(a.invstd, c0, cn, a.vec, 0.0f, sc);
  bn_coef8(a.bias, c0, cn, a.vec, 0.0f, bs);
  if (a.weight != nullptr) {
    bn_coef8(a.weight, c0, cn, a.vec, 0.0f, w);
#pragma unroll
    for (int i = 0; i < 8; ++i) sc[i] = hot_mul(w[i], sc[i]);
  }
  const int64_t step = static_cast<int64_t>(gridDim.x) * rows;
  const bool full = vec && cn == 8;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * rows + k; r < x.rows; r += step * U) {
    Raw8<T> in[U];
    if (full) {
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (r + u * step < x.rows) raw8_load(x.p + (r + u * step) * x.ld + c0, in[u]);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t row = r + u * step;
      if (row >= x.rows) break;
      float v[8];
      if (full) {
        raw8_to_f(in[u], v);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = i < cn ? load_f(x.p + row * x.ld + c0 + i) : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = bn_transform(v[i], mu[i], sc[i], bs[i]);
      T* dst = y.p + row * y.ld + c0;
      if (full) {
        if constexpr (sizeof(T) == 2) {
          *reinterpret_cast<uint4*>(dst) = make_uint4(f16x2_bits<T>(v[0], v[1]), f16x2_bits<T>(v[2], v[3]),
                                                      f16x2_bits<T>(v[4], v[5]), f16x2_bits<T>(v[6], v[7]));
        } else {
          reinterpret_cast<float4*>(dst)[0] = make_float4(v[0], v[1], v[2], v[3]);
          reinterpret_cast<float4*>(dst)[1] = make_float4(v[4], v[5], v[6], v[7]);
        }
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
          if (i < cn) store_f(dst + i, v[i]);
      }
    }
  }
}

// ---- BatchNorm's input gradient with G~'s amax (batch_norm_backward_input, ops.h) ---------------------
// Per slice of kBnSlice 16-channel groups (blockIdx.y), each CTA forms the slice's per-channel coefficients {mean,
// m_dy, f1, f2} in the CPU backend's order into shared memory (a row of 17 float4 a group: the 16 loads of a warp's
// threads, 16 channels apart, fall in distinct banks; zeros past C); then one thread per 16 channels of a row: g_y and
// x loaded (16-byte vectors where the rows allow), g_x formed, rounded and stored, and the rounded values transformed
// in blocks of b (fwht_regs, the CPU's butterfly order) for the amax (one atomicMax a CTA; a grid-stride loop over the
// slice's rows). 64 registers, 4 CTAs an SM: more loads in flight than at 3 (its 65 registers unbounded): ResNet-50's
// BatchNorms at b128 3.00 -> 2.73 ms on the H200.
constexpr int kBnSlice = 64;  // 16-channel groups a CTA's coefficients cover: 1,024 channels, 17 KB of shared memory

// A BatchNorm's per-channel inputs (f32 [C]; weight null without affine) and nf = 1 / R rounded to float.
struct BnStats {
  const float *mean, *invstd, *weight, *sum_dy, *sum_dy_xmu;
  float nf;
};

template <typename T>
__device__ __forceinline__ void load16_row(const T* p, int n, bool vec, float (&v)[16]) {
  if (vec && n == 16) {
    float a[8], b[8];
    load8_f(p, a);
    load8_f(p + 8, b);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = a[k], v[8 + k] = b[k];
  } else {
#pragma unroll
    for (int k = 0; k < 16; ++k) v[k] = k < n ? load_f(p + k) : 0.0f;
  }
}

// One unit of bn_backward_input_kernel: g_x of row r's 16 channels from c0 = (g0 + j) * 16 (cn of them: channels past C
// have zero coefficients and are neither stored nor counted), rounded, stored, transformed for G~'s amax into m.
template <typename T>
__device__ __forceinline__ void bn_gx_unit(float (&d)[16], const float (&v)[16], const float4* cs, int j, T* dst,
                                           int cn, bool vec, int block, uint32_t& m) {
#pragma unroll
  for (int k = 0; k < 16; ++k) {  // channels past C: zero coefficients, neither stored nor counted
    const float4 f = cs[j * 17 + k];
    d[k] = __fmul_rn(__fmaf_rn(-__fadd_rn(v[k], -f.x), f.z, __fadd_rn(d[k], -f.y)), f.w);
  }
  if constexpr (sizeof(T) == 2) {  // rounded in pairs to 32-bit words; d takes the rounded values
    uint32_t u[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      u[i] = f16x2_bits<T>(d[2 * i], d[2 * i + 1]);
      d[2 * i] = 2 * i < cn ? f16bits_to_f<T>(static_cast<unsigned short>(u[i])) : 0.0f;
      d[2 * i + 1] = 2 * i + 1 < cn ? f16bits_to_f<T>(static_cast<unsigned short>(u[i] >> 16)) : 0.0f;
    }
    if (vec && cn == 16) {
      reinterpret_cast<uint4*>(dst)[0] = make_uint4(u[0], u[1], u[2], u[3]);
      reinterpret_cast<uint4*>(dst)[1] = make_uint4(u[4], u[5], u[6], u[7]);
    } else {
#pragma unroll
      for (int k = 0; k < 16; ++k)  // constant indices: u stays in registers
        if (k < cn)
          reinterpret_cast<unsigned short*>(dst)[k] = static_cast<unsigned short>(u[k / 2] >> (16 * (k % 2)));
    }
  } else {
    if (vec && cn == 16) {
#pragma unroll
      for (int k = 0; k < 4; ++k)
        reinterpret_cast<float4*>(dst)[k] = make_float4(d[4 * k], d[4 * k + 1], d[4 * k + 2], d[4 * k + 3]);
    } else {
#pragma unroll
      for (int k = 0; k < 16; ++k)
        if (k < cn) dst[k] = d[k];
    }
#pragma unroll
    for (int k = 0; k < 16; ++k) d[k] = k < cn ? d[k] : 0.0f;
  }
  fwht_regs<16>(d, block);
#pragma unroll
  for (int k = 0; k < 16; ++k) m = max(m, amax_key(d[k]));
}

// With 16-bit types, vector rows and C % 16 == 0, a thread loads its next unit's g_y and x before this unit's
// arithmetic (its loads were latency-bound: 7.5 of 13.2 cycles between a warp's instructions waited on L1TEX), at 3
// CTAs an SM (80 registers, no spills): ResNet-50's 53 g_x at b128 2744 -> 2535 us on the H200; at 4 CTAs it spilled
// 116 bytes and took 3251 us.
template <typename T>
__global__ void __launch_bounds__(kBasicThreads, sizeof(T) == 2 ? 3 : 4)
    bn_backward_input_kernel(Mat<const T> gy, Mat<const T> x, BnStats st, Mat<T> gx, int block, bool vec,
                             unsigned* key) {
  __shared__ float4 cs[kBnSlice * 17];
  const int64_t C = gy.cols, g0 = static_cast<int64_t>(blockIdx.y) * kBnSlice;
  const int gs = static_cast<int>((C + 15) / 16 - g0 < kBnSlice ? (C + 15) / 16 - g0 : kBnSlice);  // groups here
  for (int i = threadIdx.x; i < gs * 16; i += blockDim.x) {
    const int64_t c = g0 * 16 + i;
    float4 f = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (c < C) {
      const float is = st.invstd[c];
      f = make_float4(st.mean[c], __fmul_rn(st.sum_dy[c], st.nf),
                      __fmul_rn(__fmul_rn(__fmul_rn(is, is), st.sum_dy_xmu[c]), st.nf),
                      st.weight != nullptr ? __fmul_rn(st.weight[c], is) : is);
    }
    cs[(i / 16) * 17 + i % 16] = f;
  }
  __syncthreads();
  const int64_t n = gy.rows * gs, step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  uint32_t m = 0;
  if constexpr (sizeof(T) == 2) {
    if (vec && C % 16 == 0) {
      struct Raw {
        Raw8<T> g[2], x[2];
      };
      const auto load = [&](int64_t e, Raw& w) {
        const int64_t r = e / gs, c0 = (g0 + (e - r * gs)) * 16;
        raw8_load(gy.p + r * gy.ld + c0, w.g[0]), raw8_load(gy.p + r * gy.ld + c0 + 8, w.g[1]);
        raw8_load(x.p + r * x.ld + c0, w.x[0]), raw8_load(x.p + r * x.ld + c0 + 8, w.x[1]);
      };
      int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      Raw cur;
      if (e < n) load(e, cur);
      for (; e < n; e += step) {
        Raw nxt;
        if (e + step < n) load(e + step, nxt);
        const int64_t r = e / gs;
        const int j = static_cast<int>(e - r * gs);
        float d[16], v[16], a[8], b[8];
        raw8_to_f(cur.g[0], a), raw8_to_f(cur.g[1], b);
#pragma unroll
        for (int k = 0; k < 8; ++k) d[k] = a[k], d[8 + k] = b[k];
        raw8_to_f(cur.x[0], a), raw8_to_f(cur.x[1], b);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = a[k], v[8 + k] = b[k];
        bn_gx_unit(d, v, cs, j, gx.p + r * gx.ld + (g0 + j) * 16, 16, true, block, m);
        cur = nxt;
      }
      m = block_max_u32(m);
      if (threadIdx.x == 0 && m != 0) atomicMax(key, m);
      return;
    }
  }
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n; e += step) {
    const int64_t r = e / gs;
    const int j = static_cast<int>(e - r * gs);
    const int64_t c0 = (g0 + j) * 16;
    const int cn = static_cast<int>(C - c0 < 16 ? C - c0 : 16);
    float d[16], v[16];
    load16_row(gy.p + r * gy.ld + c0, cn, vec, d);
    load16_row(x.p + r * x.ld + c0, cn, vec, v);
    bn_gx_unit(d, v, cs, j, gx.p + r * gx.ld + c0, cn, vec, block, m);
  }
  m = block_max_u32(m);
  if (threadIdx.x == 0 && m != 0) atomicMax(key, m);
}

// q: R x C s8, packed: bytes with row stride ldb (bytes); C even.
__global__ void pack_int4_kernel(Mat<const int8_t> q, uint8_t* packed, int64_t ldb) {
  const int64_t half = q.cols / 2;
  const int64_t n = q.rows * half;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / half, k = e % half;
    const uint8_t lo = static_cast<uint8_t>(q.p[r * q.ld + 2 * k]) & 0xf;
    const uint8_t hi = static_cast<uint8_t>(q.p[r * q.ld + 2 * k + 1]) & 0xf;
    packed[r * ldb + k] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

__global__ void unpack_int4_kernel(const uint8_t* packed, int64_t ldb, Mat<int8_t> q) {
  const int64_t half = q.cols / 2;
  const int64_t n = q.rows * half;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / half, k = e % half;
    const uint8_t b = packed[r * ldb + k];
    const int lo = b & 0xf, hi = b >> 4;
    q.p[r * q.ld + 2 * k] = static_cast<int8_t>(lo >= 8 ? lo - 16 : lo);
    q.p[r * q.ld + 2 * k + 1] = static_cast<int8_t>(hi >= 8 ? hi - 16 : hi);
  }
}

// ---- bias gradient ------------------------------------------------------------------------------------
constexpr int kBiasRowsPerChunk = 128;

template <typename T>
__global__ void bias_partial_kernel(Mat<const T> gy, float* partial) {
  // Row chunks (up to millions of rows) on grid.x, 128-column groups on grid.y.
  const int64_t c = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= gy.cols) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kBiasRowsPerChunk;
  const int64_t r1 = min(r0 + kBiasRowsPerChunk, gy.rows);
  float s = 0.0f;
  for (int64_t r = r0; r < r1; ++r) s = hot_add(s, load_f(gy.p + r * gy.ld + c));
  partial[static_cast<int64_t>(blockIdx.x) * gy.cols + c] = s;
}


// ---- launch sequences ---------------------------------------------------------------------------------

template <typename T, typename Launch>
void hadamard_launch(const TensorView& in, const TensorView& out, int block, int axis, const Launch& launch) {
  const Mat<const T> mi = mat<const T>(in);
  const Mat<float> mo = mat<float>(out);
  const dim3 grid(grid_1d(in.numel() / block, kBasicThreads));
  const auto run = [&](auto kernel) { launch(kernel, grid, kBasicThreads, 0, mi, mo, axis); };
  switch (block) {
    case 1: run(hadamard_kernel<1, T>); break;
    case 2: run(hadamard_kernel<2, T>); break;
    case 4: run(hadamard_kernel<4, T>); break;
    case 8: run(hadamard_kernel<8, T>); break;
    case 16: run(hadamard_kernel<16, T>); break;
    case 32: run(hadamard_kernel<32, T>); break;
    case 64: run(hadamard_kernel<64, T>); break;
    case 128: run(hadamard_kernel<128, T>); break;
    case 256: run(hadamard_kernel<256, T>); break;
    default: HOT_FAIL(internal, "hadamard_transform: unsupported block ", block);
  }
}

template <typename T, typename Launch>
void hla_launch(const TensorView& in, const TensorView& out, int rank, const Launch& launch) {
  const int64_t n = ceil_div(in.shape[0], 16) * in.shape[1];
  launch(hla_kernel<T>, dim3(grid_1d(n, kBasicThreads)), kBasicThreads, 0, mat<const T>(in), mat<float>(out), rank);
}

// Scratch bytes of quantize: keys, inverse scales and pre-scales, 12 bytes per row (token) or 12 bytes (tensor).
inline size_t quantize_scratch_bytes(const TensorView& in, const QuantizeParams& p) {
  return static_cast<size_t>(p.scale == ScaleMode::token ? in.shape[0] : 1) * 12;
}

// known_key: in's amax key (relu_mask's amax, per-tensor scale only) when the caller knows it: no amax pass.
template <typename T, typename Launch>
void quantize_launch(const TensorView& in, const TensorView& q, const TensorView& scale, const QuantizeParams& p,
                     void* scratch, const Launch& launch, const unsigned* known_key = nullptr) {
  const int64_t R = in.shape[0];
  const bool per_row = p.scale == ScaleMode::token;
  const int64_t ns = per_row ? R : 1;
  const int qmax = qmax_for_bits(p.bits);
  unsigned* keys = static_cast<unsigned*>(scratch);
  float* inv = reinterpret_cast<float*>(keys + ns);
  float* pre = inv + ns;
  const Mat<const T> mi = mat<const T>(in);
  const Mat<int8_t> mq = mat<int8_t>(q);
  const int64_t n = in.numel();
  // one array each (rows contiguous), aligned for the vector loads and stores: the flat kernels
  const bool flat = !per_row && (mi.rows == 1 || mi.ld == mi.cols) && (mq.rows == 1 || mq.ld == mq.cols) &&
                    reinterpret_cast<uintptr_t>(mi.p) % 16 == 0 && reinterpret_cast<uintptr_t>(mq.p) % 8 == 0;
  if (per_row) {
    launch(amax_row_kernel<T>, dim3(static_cast<unsigned>(R)), kBasicThreads, 0, mi, keys);
  } else if (known_key != nullptr) {
    keys = const_cast<unsigned*>(known_key);  // read by finalize_scales_kernel only
  } else {
    launch.zero(keys, sizeof(unsigned));
    if (flat)
      launch(amax_flat_kernel<T>, dim3(grid_1d(std::max<int64_t>(n / kSrGroup, 1), kBasicThreads, 1024)),
             kBasicThreads, 0, static_cast<const T*>(mi.p), n, keys);
    else
      launch(amax_tensor_kernel<T>, dim3(grid_1d(n, kBasicThreads, 1024)), kBasicThreads, 0, mi, keys);
  }
  launch(finalize_scales_kernel, dim3(grid_1d(ns, kBasicThreads)), kBasicThreads, 0, static_cast<const unsigned*>(keys),
         ns, qmax, static_cast<float*>(scale.data), inv, pre);
  const bool stochastic = p.rounding == Rounding::stochastic;
  const int64_t cols = std::max<int64_t>(mi.cols, 1);
  if (flat && stochastic && cols % kSrGroup == 0)
    launch(quantize_flat_sr_kernel<T>, dim3(grid_1d(ceil_div(n, 4 * kSrGroup), kBasicThreads)), kBasicThreads, 0,
           static_cast<const T*>(mi.p), mq.p, n / cols, cols, static_cast<const float*>(inv),
           static_cast<const float*>(pre), qmax, p.seed, p.rng_stream);
  else if (flat)
    launch(stochastic ? quantize_flat_kernel<T, true> : quantize_flat_kernel<T, false>,
           dim3(grid_1d(ceil_div(n, kSrGroup), kBasicThreads)), kBasicThreads, 0, static_cast<const T*>(mi.p), mq.p, n,
           cols, static_cast<const float*>(inv), static_cast<const float*>(pre), qmax, p.seed, p.rng_stream);
  else
    launch(quantize_kernel<T>, dim3(grid_1d(ceil_div(n, kSrGroup), kBasicThreads)), kBasicThreads, 0, mi, mq,
           static_cast<const float*>(inv), static_cast<const float*>(pre), per_row, qmax,
           p.rounding == Rounding::stochastic, p.seed, p.rng_stream);
}

template <typename T, typename Launch>
void dequantize_launch(const TensorView& q, const TensorView& scale, const TensorView& out, const Launch& launch) {
  const bool per_row = !(scale.shape[0] == 1 && q.shape[0] != 1);
  launch(dequantize_kernel<T>, dim3(grid_1d(q.numel(), kBasicThreads)), kBasicThreads, 0, mat<const int8_t>(q),
         static_cast<const float*>(scale.data), per_row, mat<T>(out));
}

template <typename T, typename Launch>
void col2im_launch(const TensorView& cols, const ConvGeometry& g, const TensorView& out, const Launch& launch) {
  constexpr int kWide = 16 / static_cast<int>(sizeof(T));
  const auto* c = static_cast<const T*>(cols.data);
  auto* o = static_cast<T*>(out.data);
  const bool wide = g.C % kWide == 0 && cols.strides[0] % kWide == 0 && out.strides[0] % kWide == 0 &&
                    reinterpret_cast<uintptr_t>(c) % 16 == 0 && reinterpret_cast<uintptr_t>(o) % 16 == 0;
  const auto go = [&](auto v) {
    constexpr int V = decltype(v)::value;
    const int64_t row_units = g.C / V * g.W, per_block = std::max<int64_t>(1, kBasicThreads / row_units);
    launch(col2im_kernel<T, V>, dim3(static_cast<unsigned>(std::min<int64_t>(ceil_div(g.N * g.H, per_block),
                                                                              kMaxGridX))),
           kBasicThreads, 0, c, cols.strides[0], col2im_params(g), o, out.strides[0]);
  };
  if (wide)
    go(std::integral_constant<int, kWide>{});
  else
    go(std::integral_constant<int, 1>{});
}

template <typename Launch>
void transpose_launch(const TensorView& in, const TensorView& out, const Launch& launch) {
  const int64_t B = in.shape[0], R = in.shape[1], S = in.shape[2];
  const auto go = [&](auto unit, auto e) {
    using U = decltype(unit);
    constexpr int E = decltype(e)::value;
    const int64_t side = int64_t{kTransposeWords} * E;
    const int64_t tiles = B * ceil_div(R, side) * ceil_div(S, side);
    launch(transpose_kernel<U, E>, dim3(static_cast<unsigned>(std::min<int64_t>(tiles, kMaxGridX))), kBasicThreads, 0,
           static_cast<const U*>(in.data), in.strides[0], in.strides[1], static_cast<U*>(out.data), out.strides[0],
           out.strides[1], B, R, S);
  };
  const auto words = [&](int64_t e) {  // whole 32-bit words of e elements on both sides
    const auto ok = [e](const TensorView& t) {
      return t.shape[2] % e == 0 && t.strides[0] % e == 0 && t.strides[1] % e == 0 &&
             reinterpret_cast<uintptr_t>(t.data) % 4 == 0;
    };
    return ok(in) && ok(out);
  };
  if (R <= kTransposeFewRows) {
    const auto few = [&](auto unit) {
      using U = decltype(unit);
      launch(transpose_few_rows_kernel<U>,
             dim3(grid_1d(S, kBasicThreads, 8192), static_cast<unsigned>(std::min<int64_t>(B, 65535))), kBasicThreads,
             0, static_cast<const U*>(in.data), in.strides[0], in.strides[1], static_cast<U*>(out.data),
             out.strides[0], out.strides[1], B, static_cast<int>(R), S);
    };
    switch (dtype_bits(in.dtype)) {
      case 8: few(uint8_t{}); break;
      case 16: few(uint16_t{}); break;
      default: few(uint32_t{}); break;
    }
    return;
  }
  using I1 = std::integral_constant<int, 1>;
  switch (dtype_bits(in.dtype)) {
    case 8:
      if (words(4)) go(uint8_t{}, std::integral_constant<int, 4>{});
      else go(uint8_t{}, I1{});
      break;
    case 16:
      if (words(2)) go(uint16_t{}, std::integral_constant<int, 2>{});
      else go(uint16_t{}, I1{});
      break;
    default: go(uint32_t{}, I1{}); break;
  }
}

template <typename Launch>
void im2col_launch(const TensorView& map, const ConvGeometry& g, const TensorView& cols, const Launch& launch) {
  const int64_t es = dtype_bits(map.dtype) / 8, run = g.C * es, L = cols.shape[0];
  const auto fits = [&](int64_t u) {
    return run % u == 0 && (map.strides[0] * es) % u == 0 && (cols.strides[0] * es) % u == 0 &&
           reinterpret_cast<uintptr_t>(map.data) % u == 0 && reinterpret_cast<uintptr_t>(cols.data) % u == 0;
  };
  const auto go = [&](auto unit) {
    using U = decltype(unit);
    const int64_t u = sizeof(U);
    const int cu = static_cast<int>(run / u), per_row = g.kh * g.kw * cu;
    const int rows = std::max(1, kIm2colThreads / per_row);
    launch(im2col_kernel<U>, dim3(static_cast<unsigned>(std::min<int64_t>(ceil_div(L, rows), kMaxGridX))),
           kIm2colThreads, 0, static_cast<const U*>(map.data), map.strides[0] * es / u, col2im_params(g), cu, rows, L,
           static_cast<U*>(cols.data), cols.strides[0] * es / u);
  };
  if (fits(16)) {
    go(uint4{});
  } else if (fits(8)) {
    go(uint2{});
  } else if (fits(4)) {
    go(uint32_t{});
  } else {
    go(uint16_t{});
  }
}

// A float format as raw bits: its unsigned type, sign bit and +Inf.
template <typename R, R kSign, R kInf>
struct RawFloat {
  using type = R;
  static constexpr R sign = kSign, inf = kInf;
};
template <typename F>
void dispatch_raw_float(DType dt, const char* op, F&& f) {
  switch (dt) {
    case DType::f32: f(RawFloat<uint32_t, 0x80000000u, 0x7f800000u>{}); break;
    case DType::f16: f(RawFloat<uint16_t, uint16_t{0x8000}, uint16_t{0x7c00}>{}); break;
    case DType::bf16: f(RawFloat<uint16_t, uint16_t{0x8000}, uint16_t{0x7f80}>{}); break;
    default: HOT_FAIL(internal, op, ": unsupported dtype ", dtype_name(dt));
  }
}

// ---- max-pool with window offsets (max_pool2d_offsets): the forward a thread per output element, numbered so that
// neighbouring threads take neighbouring addresses (the channel fastest for a channels-last map, else the column); the
// backward a gather (no atomics), a thread per input element. A channels-last map whose channels come in 16-byte
// groups gives each thread V = 16 / sizeof(T) channels, loaded and stored as one vector; other maps take the backward
// a strip of columns to a thread (max_pool_offsets_backward_strip_kernel). Maps whose every address fits 31 bits take
// 32-bit index arithmetic (I = uint32_t; 64-bit division costs the GPU several times more).
struct Pool4 {
  int64_t s0, s1, s2, s3;  // strides of (n, c, h, w)
};
struct PoolDims {
  int64_t N, C, H, W, Ho, Wo;
  int kh, kw, sh, sw, ph, pw, dh, dw;
  bool channels_fast;  // thread index order (n, h, w, c) rather than (n, c, h, w)
};
// V elements of E, loaded and stored as one access (aligned to their size).
template <typename E, int V>
struct alignas(sizeof(E) * V) PoolLanes {
  E v[V];
};
template <typename I>
__device__ __forceinline__ void pool_index(I e, I C, I H, I W, bool channels_fast, I& n, I& c, I& h, I& w) {
  if (channels_fast) {
    c = e % C, e /= C, w = e % W, e /= W, h = e % H, n = e / H;
  } else {
    w = e % W, e /= W, h = e % H, e /= H, c = e % C, n = e / C;
  }
}
template <typename I>
__device__ __forceinline__ I pool_at(const Pool4& s, I n, I c, I h, I w) {
  return n * static_cast<I>(s.s0) + c * static_cast<I>(s.s1) + h * static_cast<I>(s.s2) + w * static_cast<I>(s.s3);
}

template <typename T, int V, typename I>
__global__ void max_pool_offsets_kernel(const T* __restrict__ x, Pool4 sx, T* __restrict__ y, Pool4 sy,
                                        int8_t* __restrict__ off, Pool4 so, PoolDims d) {
  const I groups = static_cast<I>(d.C / V), Ho = static_cast<I>(d.Ho), Wo = static_cast<I>(d.Wo);
  const I total = static_cast<I>(d.N) * groups * Ho * Wo;
  const I step = static_cast<I>(gridDim.x) * blockDim.x;
  for (I e = blockIdx.x * static_cast<I>(blockDim.x) + threadIdx.x; e < total; e += step) {
    I n, c, oh, ow;
    pool_index<I>(e, groups, Ho, Wo, d.channels_fast, n, c, oh, ow);
    c *= V;
    const int h0 = static_cast<int>(oh) * d.sh - d.ph, w0 = static_cast<int>(ow) * d.sw - d.pw;
    float best[V];
    PoolLanes<T, V> pick;      // the chosen elements themselves, bit for bit
    PoolLanes<int8_t, V> arg;  // their offsets in the window, -1 before the first
#pragma unroll
    for (int j = 0; j < V; ++j) best[j] = 0.0f, arg.v[j] = -1, pick.v[j] = T();
    for (int i = 0; i < d.kh; ++i) {
      const int h = h0 + i * d.dh;
      if (h < 0 || h >= d.H) continue;
      for (int k = 0; k < d.kw; ++k) {
        const int w = w0 + k * d.dw;
        if (w < 0 || w >= d.W) continue;
        const PoolLanes<T, V> l =
            *reinterpret_cast<const PoolLanes<T, V>*>(x + pool_at<I>(sx, n, c, static_cast<I>(h), static_cast<I>(w)));
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float v = load_f(&l.v[j]);
          if (arg.v[j] < 0 || v > best[j] || v != v)  // v != v: NaN
            best[j] = v, arg.v[j] = static_cast<int8_t>(i * d.kw + k), pick.v[j] = l.v[j];
        }
      }
    }
    *reinterpret_cast<PoolLanes<T, V>*>(y + pool_at<I>(sy, n, c, oh, ow)) = pick;
    *reinterpret_cast<PoolLanes<int8_t, V>*>(off + pool_at<I>(so, n, c, oh, ow)) = arg;
  }
}

// The outputs whose window can hold input position `p` along one axis: o in [lo, hi] with o * s - pad <= p and
// o * s - pad + (k - 1) * dil >= p, clamped to [0, out).
__device__ __forceinline__ void pool_range(int p, int k, int s, int pad, int dil, int out, int& lo, int& hi) {
  const int top = p + pad, bottom = p + pad - (k - 1) * dil;
  hi = std::min(top / s, out - 1);
  lo = bottom <= 0 ? 0 : (bottom + s - 1) / s;
}

template <typename T, int V, typename I>
__global__ void max_pool_offsets_backward_kernel(const T* __restrict__ gy, Pool4 sy, const int8_t* __restrict__ off,
                                                 Pool4 so, T* __restrict__ gx, Pool4 sx, PoolDims d) {
  const I groups = static_cast<I>(d.C / V), H = static_cast<I>(d.H), W = static_cast<I>(d.W);
  const I total = static_cast<I>(d.N) * groups * H * W;
  const I step = static_cast<I>(gridDim.x) * blockDim.x;
  for (I e = blockIdx.x * static_cast<I>(blockDim.x) + threadIdx.x; e < total; e += step) {
    I n, c, h, w;
    pool_index<I>(e, groups, H, W, d.channels_fast, n, c, h, w);
    c *= V;
    int oh0, oh1, ow0, ow1;
    pool_range(static_cast<int>(h), d.kh, d.sh, d.ph, d.dh, static_cast<int>(d.Ho), oh0, oh1);
    pool_range(static_cast<int>(w), d.kw, d.sw, d.pw, d.dw, static_cast<int>(d.Wo), ow0, ow1);
    float acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0.0f;
    for (int oh = oh0; oh <= oh1; ++oh) {  // (oh, ow) order, as the CPU backend adds
      const int di = static_cast<int>(h) - (oh * d.sh - d.ph);
      if (di % d.dh != 0) continue;
      for (int ow = ow0; ow <= ow1; ++ow) {
        const int dj = static_cast<int>(w) - (ow * d.sw - d.pw);
        if (dj % d.dw != 0) continue;
        const int8_t mine = static_cast<int8_t>(di / d.dh * d.kw + dj / d.dw);
        const PoolLanes<int8_t, V> o = *reinterpret_cast<const PoolLanes<int8_t, V>*>(
            off + pool_at<I>(so, n, c, static_cast<I>(oh), static_cast<I>(ow)));
        bool any = false;
#pragma unroll
        for (int j = 0; j < V; ++j) any |= o.v[j] == mine;
        if (!any) continue;  // g_y is read only where one of the V maxima came from here
        const PoolLanes<T, V> g = *reinterpret_cast<const PoolLanes<T, V>*>(
            gy + pool_at<I>(sy, n, c, static_cast<I>(oh), static_cast<I>(ow)));
#pragma unroll
        for (int j = 0; j < V; ++j)
          if (o.v[j] == mine) acc[j] += load_f(&g.v[j]);
      }
    }
    PoolLanes<T, V> out;
#pragma unroll
    for (int j = 0; j < V; ++j) store_f(&out.v[j], acc[j]);
    *reinterpret_cast<PoolLanes<T, V>*>(gx + pool_at<I>(sx, n, c, h, w)) = out;
  }
}

// The backward where the channels cannot go V to a thread (NCHW maps, or channels-last ones whose channels do not come
// in 16-byte groups): a thread per strip of kPoolStrip neighbouring columns of one (n, c, h) row. Each output whose
// window reaches the strip is read once (about (kPoolStrip + k) / s outputs per window row, where a thread per input
// element read up to k^2 / s^2 each) and its offset names the one input it adds to; each element still adds its
// outputs in (oh, ow) order.
constexpr int kPoolStrip = 8;
template <typename T, typename I>
__global__ void max_pool_offsets_backward_strip_kernel(const T* __restrict__ gy, Pool4 sy,
                                                       const int8_t* __restrict__ off, Pool4 so, T* __restrict__ gx,
                                                       Pool4 sx, PoolDims d) {
  const I strips = static_cast<I>((d.W + kPoolStrip - 1) / kPoolStrip), H = static_cast<I>(d.H),
          C = static_cast<I>(d.C);
  const I total = static_cast<I>(d.N) * C * H * strips;
  const I step = static_cast<I>(gridDim.x) * blockDim.x;
  for (I e = blockIdx.x * static_cast<I>(blockDim.x) + threadIdx.x; e < total; e += step) {
    I n, c, h, t;
    pool_index<I>(e, C, H, strips, false, n, c, h, t);
    const int w0 = static_cast<int>(t) * kPoolStrip, w1 = std::min(w0 + kPoolStrip, static_cast<int>(d.W)) - 1;
    int oh0, oh1, ow0, ow1, unused;
    pool_range(static_cast<int>(h), d.kh, d.sh, d.ph, d.dh, static_cast<int>(d.Ho), oh0, oh1);
    pool_range(w0, d.kw, d.sw, d.pw, d.dw, static_cast<int>(d.Wo), ow0, unused);
    pool_range(w1, d.kw, d.sw, d.pw, d.dw, static_cast<int>(d.Wo), unused, ow1);
    float acc[kPoolStrip];
#pragma unroll
    for (int j = 0; j < kPoolStrip; ++j) acc[j] = 0.0f;
    for (int oh = oh0; oh <= oh1; ++oh) {  // (oh, ow) order, as the CPU backend adds
      const int di = static_cast<int>(h) - (oh * d.sh - d.ph);
      if (di % d.dh != 0) continue;
      const int row = di / d.dh * d.kw;  // the offsets of this window row: row .. row + kw - 1
      for (int ow = ow0; ow <= ow1; ++ow) {
        const int k = off[pool_at<I>(so, n, c, static_cast<I>(oh), static_cast<I>(ow))] - row;
        if (k < 0 || k >= d.kw) continue;
        const int lane = ow * d.sw - d.pw + k * d.dw - w0;
        if (lane < 0 || lane >= kPoolStrip) continue;
        const float g = load_f(gy + pool_at<I>(sy, n, c, static_cast<I>(oh), static_cast<I>(ow)));
#pragma unroll
        for (int j = 0; j < kPoolStrip; ++j)
          if (lane == j) acc[j] += g;
      }
    }
#pragma unroll
    for (int j = 0; j < kPoolStrip; ++j)
      if (w0 + j <= w1) store_f(gx + pool_at<I>(sx, n, c, h, static_cast<I>(w0 + j)), acc[j]);
  }
}

inline Pool4 pool_strides(const TensorView& t) { return {t.strides[0], t.strides[1], t.strides[2], t.strides[3]}; }
inline PoolDims pool_dims(const ConvGeometry& g, const TensorView& small, const TensorView& order) {
  return {g.N, g.C, g.H, g.W, small.shape[2], small.shape[3], g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw,
          order.strides[1] == 1 && g.C > 1};
}
// Whether every address of t (non-negative strides) fits 31 bits.
inline bool pool_fits_int32(const TensorView& t) {
  int64_t last = 0;
  for (int i = 0; i < 4; ++i) {
    if (t.strides[i] < 0) return false;
    last += (t.shape[i] - 1) * t.strides[i];
  }
  return fits_int32(last) && fits_int32(t.numel());
}
// Whether t's channels can go V to a thread: unit channel stride, other strides multiples of V, the data aligned to
// V elements.
inline bool pool_lanes_ok(const TensorView& t, int V, int element_bytes) {
  const int64_t bytes = static_cast<int64_t>(V) * element_bytes;
  return t.strides[1] == 1 && t.shape[1] % V == 0 && t.strides[0] % V == 0 && t.strides[2] % V == 0 &&
         t.strides[3] % V == 0 && reinterpret_cast<uintptr_t>(t.data) % bytes == 0;
}
// Picks the kernel's channels per thread (V: 1 or a 16-byte vector of T) and index type for the three maps, and runs
// run(std::integral_constant<int, V>, an index-type value). narrow_index false: 64-bit indices whatever the sizes (the
// emulation tests reach that path so).
template <typename T, typename F>
void pool_variant(const TensorView& a, const TensorView& b, const TensorView& off, bool narrow_index, F&& run) {
  constexpr int kV = 16 / static_cast<int>(sizeof(T));
  const bool lanes = pool_lanes_ok(a, kV, sizeof(T)) && pool_lanes_ok(b, kV, sizeof(T)) && pool_lanes_ok(off, kV, 1);
  const bool narrow = narrow_index && pool_fits_int32(a) && pool_fits_int32(b) && pool_fits_int32(off);
  if (lanes && narrow) run(std::integral_constant<int, kV>{}, uint32_t{});
  else if (lanes) run(std::integral_constant<int, kV>{}, int64_t{});
  else if (narrow) run(std::integral_constant<int, 1>{}, uint32_t{});
  else run(std::integral_constant<int, 1>{}, int64_t{});
}

template <typename Launch>
void max_pool_offsets_launch(const TensorView& x, const ConvGeometry& g, const TensorView& y, const TensorView& off,
                             const Launch& launch, bool narrow_index = true) {
  const PoolDims d = pool_dims(g, y, y);
  dispatch_float(x.dtype, "max_pool2d_offsets", [&](auto t) {
    using T = decltype(t);
    pool_variant<T>(x, y, off, narrow_index, [&](auto v, auto i) {
      constexpr int V = decltype(v)::value;
      launch(max_pool_offsets_kernel<T, V, decltype(i)>, dim3(grid_1d(d.N * d.C / V * d.Ho * d.Wo, kBasicThreads)),
             kBasicThreads, 0, static_cast<const T*>(x.data), pool_strides(x), static_cast<T*>(y.data),
             pool_strides(y), static_cast<int8_t*>(off.data), pool_strides(off), d);
    });
  });
}

template <typename Launch>
void max_pool_offsets_backward_launch(const TensorView& gy, const TensorView& off, const ConvGeometry& g,
                                      const TensorView& gx, const Launch& launch, bool narrow_index = true) {
  const PoolDims d = pool_dims(g, gy, gx);
  dispatch_float(gy.dtype, "max_pool2d_offsets_backward", [&](auto t) {
    using T = decltype(t);
    pool_variant<T>(gx, gy, off, narrow_index, [&](auto v, auto i) {
      constexpr int V = decltype(v)::value;
      using I = decltype(i);
      if constexpr (V > 1)
        launch(max_pool_offsets_backward_kernel<T, V, I>, dim3(grid_1d(d.N * d.C / V * d.H * d.W, kBasicThreads)),
               kBasicThreads, 0, static_cast<const T*>(gy.data), pool_strides(gy),
               static_cast<const int8_t*>(off.data), pool_strides(off), static_cast<T*>(gx.data), pool_strides(gx), d);
      else
        launch(max_pool_offsets_backward_strip_kernel<T, I>,
               dim3(grid_1d(d.N * d.C * d.H * ceil_div(d.W, kPoolStrip), kBasicThreads)), kBasicThreads, 0,
               static_cast<const T*>(gy.data), pool_strides(gy), static_cast<const int8_t*>(off.data),
               pool_strides(off), static_cast<T*>(gx.data), pool_strides(gx), d);
    });
  });
}

// key: y's amax key (relu_mask's amax, f32 [1] read as its bits), zeroed here and written by the kernel; or null.
template <typename Launch>
void relu_mask_launch(const TensorView& x, const TensorView& y, const TensorView& bits, const Launch& launch,
                      unsigned* key = nullptr) {
  const int64_t n = x.shape[0];
  if (key != nullptr) launch.zero(key, sizeof(unsigned));
  dispatch_raw_float(x.dtype, "relu_mask", [&](auto fmt) {
    using F = decltype(fmt);
    using R = typename F::type;
    const bool vec =
        reinterpret_cast<uintptr_t>(x.data) % 16 == 0 && reinterpret_cast<uintptr_t>(y.data) % 16 == 0;
    const auto go = [&](auto kernel) {
      launch(kernel, dim3(grid_1d(ceil_div(ceil_div(n, 8), kMaskUnroll), kBasicThreads)), kBasicThreads, 0,
             static_cast<const R*>(x.data), static_cast<R*>(y.data), n, static_cast<uint8_t*>(bits.data), vec, key);
    };
    if (key != nullptr)
      go(relu_mask_kernel<R, F::sign, F::inf, true>);
    else
      go(relu_mask_kernel<R, F::sign, F::inf, false>);
  });
}

template <typename Launch>
void relu_mask_backward_launch(const TensorView& gy, const TensorView& bits, const TensorView& gx,
                               const Launch& launch) {
  const int64_t n = gy.shape[0];
  dispatch_raw_float(gy.dtype, "relu_mask_backward", [&](auto fmt) {
    using R = typename decltype(fmt)::type;
    const bool vec =
        reinterpret_cast<uintptr_t>(gy.data) % 16 == 0 && reinterpret_cast<uintptr_t>(gx.data) % 16 == 0;
    launch(relu_mask_backward_kernel<R>, dim3(grid_1d(ceil_div(ceil_div(n, 8), kMaskUnroll), kBasicThreads)),
           kBasicThreads, 0, static_cast<const R*>(gy.data), static_cast<const uint8_t*>(bits.data), n,
           static_cast<R*>(gx.data), vec);
  });
}

// A BatchNorm operand whose rows start at 16-byte boundaries (vector loads of 8 channels).
inline bool bn_a16(const TensorView& t) {
  return reinterpret_cast<uintptr_t>(t.data) % 16 == 0 && t.strides[0] % (16 / (dtype_bits(t.dtype) / 8)) == 0;
}

// key: gt_amax's bits (zeroed here).
template <typename T, typename Launch>
void bn_backward_input_launch(const TensorView& gy, const TensorView& x, const TensorView& mean,
                              const TensorView& invstd, const TensorView* weight, const TensorView& sum_dy,
                              const TensorView& sum_dy_xmu, const TensorView& gx, unsigned* key, const Launch& launch) {
  const int64_t R = gy.shape[0], C = gy.shape[1], groups = (C + 15) / 16, slices = (groups + kBnSlice - 1) / kBnSlice;
  HOT_CHECK_VALUE(slices <= 65535, "batch_norm_backward_input: ", C, " channels; at most ", 65535LL * kBnSlice * 16,
                  " fit one launch");
  const BnStats st{static_cast<const float*>(mean.data), static_cast<const float*>(invstd.data),
                   weight != nullptr ? static_cast<const float*>(weight->data) : nullptr,
                   static_cast<const float*>(sum_dy.data), static_cast<const float*>(sum_dy_xmu.data),
                   hot_div(1.0f, static_cast<float>(R))};
  launch.zero(key, sizeof(unsigned));
  const bool vec = bn_a16(gy) && bn_a16(x) && bn_a16(gx);
  const int64_t per_slice = std::max<int64_t>(1, 1024 / slices);  // about 1,024 CTAs in all
  launch(bn_backward_input_kernel<T>,
         dim3(static_cast<unsigned>(grid_1d(R * std::min<int64_t>(groups, kBnSlice), kBasicThreads, per_slice)),
              static_cast<unsigned>(slices)),
         kBasicThreads, 0, mat<const T>(gy), mat<const T>(x), st, mat<T>(gx), hq_block_size(C), vec, key);
}

// partial: scratch of bn_reduce_partial_bytes.
inline int64_t bn_reduce_groups(const TensorView& gy) { return ceil_div(gy.shape[0], kBnReduceRows); }
inline size_t bn_reduce_partial_bytes(const TensorView& gy) {
  return static_cast<size_t>(bn_reduce_groups(gy) * 2 * gy.shape[1]) * sizeof(float);
}

template <typename T, typename Launch>
void bn_reduce_launch(const TensorView& gy, const TensorView& x, const TensorView& mean, const TensorView& invstd,
                      const TensorView& sum_dy, const TensorView& sum_dy_xmu, const TensorView* grad_weight,
                      const TensorView* relu_bits, const TensorView* g_relu, float* partial, const Launch& launch) {
  const int64_t C = gy.shape[1], groups = bn_reduce_groups(gy), octets = ceil_div(C, 8);
  const int J = static_cast<int>(std::min<int64_t>(octets, kBnMaxJ));
  const int64_t slices = ceil_div(octets, J);
  HOT_CHECK_VALUE(groups <= kMaxGridX && slices <= kMaxGridYZ, "batch_norm_backward_reduce: ", gy.shape[0], " x ", C,
                  " is too large (at most ", kMaxGridYZ * kBnMaxJ * 8, " channels)");
  const BnRelu relu{relu_bits != nullptr ? static_cast<const uint8_t*>(relu_bits->data) : nullptr,
                    g_relu != nullptr ? g_relu->data : nullptr, g_relu != nullptr ? g_relu->strides[0] : 0};
  const bool vec =
      bn_a16(gy) && bn_a16(x) && (g_relu == nullptr || bn_a16(*g_relu)) && (relu_bits == nullptr || C % 8 == 0);
  launch(relu_bits != nullptr ? bn_reduce_kernel<T, true> : bn_reduce_kernel<T, false>,
         dim3(static_cast<unsigned>(groups), static_cast<unsigned>(slices)), kBnLanes * J, 0, mat<const T>(gy),
         mat<const T>(x), static_cast<const float*>(mean.data), partial, vec, relu);
  const BnSums out{static_cast<float*>(sum_dy.data), static_cast<float*>(sum_dy_xmu.data),
                   grad_weight != nullptr ? static_cast<float*>(grad_weight->data) : nullptr,
                   static_cast<const float*>(invstd.data), C};
  launch(bias_final_kernel<BnSums>, bias_final_grid(2 * C), kBiasFinalThreads, 0, static_cast<const float*>(partial),
         groups, 2 * C, out);
}

// partial: scratch of bn_stats_scratch_bytes (the groups' partial sums, then the sums).
inline size_t bn_stats_scratch_bytes(const TensorView& x) {
  return static_cast<size_t>((bn_reduce_groups(x) + 1) * 2 * x.shape[1]) * sizeof(float);
}

template <typename T, typename Launch>
void bn_stats_launch(const TensorView& x, const TensorView& mean, const TensorView& invstd, float eps,
                     const TensorView* running_mean, const TensorView* running_var, float momentum, float* partial,
                     const Launch& launch) {
  const int64_t C = x.shape[1], groups = bn_reduce_groups(x), octets = ceil_div(C, 8);
  const int J = static_cast<int>(std::min<int64_t>(octets, kBnMaxJ));
  const int64_t slices = ceil_div(octets, J);
  HOT_CHECK_VALUE(groups <= kMaxGridX && slices <= kMaxGridYZ, "batch_norm_stats: ", x.shape[0], " x ", C,
                  " is too large (at most ", kMaxGridYZ * kBnMaxJ * 8, " channels)");
  launch(bn_stats_kernel<T>, dim3(static_cast<unsigned>(groups), static_cast<unsigned>(slices)), kBnLanes * J, 0,
         mat<const T>(x), partial, bn_a16(x));
  float* sums = partial + groups * 2 * C;
  launch(bias_final_kernel<StoreCast<float>>, bias_final_grid(2 * C), kBiasFinalThreads, 0,
         static_cast<const float*>(partial), groups, 2 * C, StoreCast<float>{sums});
  const auto f32 = [](const TensorView* t) { return t != nullptr ? static_cast<float*>(t->data) : nullptr; };
  const BnStatsOut o{static_cast<float*>(mean.data), static_cast<float*>(invstd.data), f32(running_mean),
                     f32(running_var), eps, momentum, hot_add(1.0f, -momentum)};
  launch(bn_stats_final_kernel<T>, dim3(static_cast<unsigned>(ceil_div(C, kBasicThreads))), kBasicThreads, 0,
         mat<const T>(x), static_cast<const float*>(sums), o);
}

template <typename T, typename Launch>
void bn_transform_launch(const TensorView& x, const TensorView& mean, const TensorView& invstd,
                         const TensorView* weight, const TensorView* bias, const TensorView& y, const Launch& launch) {
  const int64_t R = x.shape[0], C = x.shape[1], octets = ceil_div(C, 8);
  const int J = static_cast<int>(std::min<int64_t>(octets, kBnTransformMaxJ));
  const int64_t slices = ceil_div(octets, J), rows = kBasicThreads / J;
  HOT_CHECK_VALUE(slices <= kMaxGridYZ, "batch_norm_transform: ", C, " channels; at most ",
                  kMaxGridYZ * kBnTransformMaxJ * 8, " fit one launch");
  const auto f32 = [](const TensorView* t) { return t != nullptr ? static_cast<const float*>(t->data) : nullptr; };
  const auto a16 = [](const float* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const BnAffine a{static_cast<const float*>(mean.data), static_cast<const float*>(invstd.data), f32(weight),
                   f32(bias), a16(f32(&mean)) && a16(f32(&invstd)) && a16(f32(weight)) && a16(f32(bias))};
  // A thread over ~8 rows (its coefficients' loads paid once: on small maps they were most of its work), but at least
  // ~528 CTAs in all (4 an SM of an H100 / H200) where the rows allow.
  const int64_t most = ceil_div(R, rows);
  const int64_t blocks = std::min(most, std::max(ceil_div(most, 8), ceil_div(528, slices)));
  launch(bn_transform_kernel<T>, dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(slices)), kBasicThreads,
         0, mat<const T>(x), a, mat<T>(y), J, bn_a16(x) && bn_a16(y));
}

template <typename Launch>
void pack_int4_launch(const TensorView& q, const TensorView& packed, const Launch& launch) {
  launch(pack_int4_kernel, dim3(grid_1d(q.numel() / 2, kBasicThreads)), kBasicThreads, 0, mat<const int8_t>(q),
         static_cast<uint8_t*>(packed.data), packed.strides[0] / 2);
}

template <typename Launch>
void unpack_int4_launch(const TensorView& packed, const TensorView& q, const Launch& launch) {
  launch(unpack_int4_kernel, dim3(grid_1d(q.numel() / 2, kBasicThreads)), kBasicThreads, 0,
         static_cast<const uint8_t*>(packed.data), packed.strides[0] / 2, mat<int8_t>(q));
}

// Deterministic column sums: fixed row chunks, then the chunk sums in chunk order. `partial`: scratch of
// bias_partial_bytes.
inline int64_t bias_chunks(const TensorView& gy) { return ceil_div(gy.shape[0], kBiasRowsPerChunk); }
inline size_t bias_partial_bytes(const TensorView& gy) {
  return static_cast<size_t>(bias_chunks(gy) * gy.shape[1]) * sizeof(float);
}

template <typename Launch>
void bias_grad_launch(const TensorView& gy, const TensorView& out, float* partial, const Launch& launch) {
  const int64_t O = gy.shape[1], nchunks = bias_chunks(gy);
  HOT_CHECK_VALUE(nchunks <= kMaxGridX && ceil_div(O, 128) <= kMaxGridYZ, "bias_grad: g_y of ", gy.shape[0], " x ",
                  O, " is too large (at most ", kMaxGridYZ * 128, " columns)");
  dispatch_float(gy.dtype, "bias_grad", [&](auto t) {
    using T = decltype(t);
    launch(bias_partial_kernel<T>, dim3(static_cast<unsigned>(nchunks), static_cast<unsigned>(ceil_div(O, 128))), 128,
           0, mat<const T>(gy), partial);
  });
  dispatch_float(out.dtype, "bias_grad", [&](auto t) {
    using T = decltype(t);
    launch(bias_final_kernel<StoreCast<T>>, bias_final_grid(O), kBiasFinalThreads, 0,
           static_cast<const float*>(partial), nchunks, O, StoreCast<T>{static_cast<T*>(out.data)});
  });
}

}  // namespace

}  // namespace hot::cuda
