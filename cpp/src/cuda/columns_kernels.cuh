// compress_columns (SPEC §8): the ABC buffer of a convolution's im2col columns X = im2col(Q), straight from the int8
// map Q (channels-last), never writing X. Included by layer_ops.cu (the backend) and by the host emulation test
// (cpp/tests/emu), which runs these kernels on the CPU against the CPU backend, bit for bit.
//
// One CTA per 16-row block of X at a time (grid-stride): the block's rows' window origins are decoded once into
// shared memory; each thread then takes columns (i, j, c) of X, c fastest (a warp's gathers read consecutive bytes of
// one map pixel), gathers the column's 16 values (zero in the padding and past the last row), transforms them in
// registers (fwht_regs<16>: integers of magnitude at most 16 * 127, exact in fp32, hence the CPU's values whatever the
// butterfly order) and keeps the rank rows of kHlaOrder. Pass 1 takes their amax (a block max, one atomicMax per CTA);
// pass 2 quantises them to nearest with the scale of that amax (hot/quant_rules.h), writes the rank bytes of column
// (i, j, c) of block jb at q_t[(i, j, c)][jb * rank ...], and the CTA of the last block zeros the padding columns.
#pragma once

#include <algorithm>

#include "common.cuh"
#include "conv_rules.h"
#include "fwht.cuh"
#include "hot/quant_rules.h"

namespace hot::cuda {

namespace {

constexpr int kColumnsThreads = 256;

template <bool kQuant>
__global__ void __launch_bounds__(kColumnsThreads)
    compress_columns_kernel(const int8_t* __restrict__ map, int64_t ldm, Col2imParams p, int rank,
                            unsigned* __restrict__ key, float* __restrict__ scale, int8_t* __restrict__ q,
                            int64_t ldq, int64_t K, int64_t K_pad) {
  __shared__ int64_t base[16];
  __shared__ int hb[16], wb[16];
  __shared__ bool live[16];
  __shared__ uint32_t red[32];
  const int64_t L = p.N * p.Ho * p.Wo, nblk = (L + 15) / 16;
  const int C = static_cast<int>(p.C), ckk = p.kh * p.kw * C;
  QuantScale qs{};
  if (kQuant) {
    qs = quant_scale_from_amax(amax_from_key(*key), 127);
    if (blockIdx.x == 0 && threadIdx.x == 0) *scale = qs.scale;
  }
  uint32_t m = 0;
  for (int64_t jb = blockIdx.x; jb < nblk; jb += gridDim.x) {
    if (threadIdx.x < 16) {
      const int t = static_cast<int>(threadIdx.x);
      const int64_t r = jb * 16 + t;
      live[t] = r < L;
      int64_t n = 0, ho = 0, wo = 0;
      if (r < L) im2col_pixel(p, r, n, ho, wo);
      base[t] = n * p.H;
      hb[t] = static_cast<int>(ho) * p.sh - p.ph;
      wb[t] = static_cast<int>(wo) * p.sw - p.pw;
    }
    __syncthreads();
    for (int col = static_cast<int>(threadIdx.x); col < ckk; col += static_cast<int>(blockDim.x)) {
      const int ij = col / C, c = col - ij * C, i = ij / p.kw, j = ij - i * p.kw;
      float v[16];
#pragma unroll
      for (int t = 0; t < 16; ++t) {
        const int h = hb[t] + i * p.dh, w = wb[t] + j * p.dw;
        const bool in = live[t] && h >= 0 && h < p.H && w >= 0 && w < p.W;
        v[t] = in ? static_cast<float>(map[((base[t] + h) * p.W + w) * ldm + c]) : 0.0f;
      }
      fwht_regs<16>(v);
      if (!kQuant) {
#pragma unroll
        for (int k = 0; k < 16; ++k)
          if (k < rank) m = max(m, amax_key(v[hla_order(k)]));
      } else {
        int8_t* dst = q + col * ldq + jb * rank;
#pragma unroll
        for (int k = 0; k < 16; ++k)
          if (k < rank) dst[k] = quantize_nearest(v[hla_order(k)], qs, 127);
        if (jb == nblk - 1)
          for (int64_t kk = K; kk < K_pad; ++kk) q[col * ldq + kk] = 0;
      }
    }
    __syncthreads();  // the next block's origins overwrite these
  }
  if (!kQuant) {
    m = block_max_u32(m, red);
    if (threadIdx.x == 0) atomicMax(key, m);
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
  const int64_t K = hla_rows(g.N * p.Ho * p.Wo, rank), K_pad = q_t.shape[1];
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(nblk, 8192)));
  const auto* m = static_cast<const int8_t*>(map.data);
  auto* q = static_cast<int8_t*>(q_t.data);
  auto* s = static_cast<float*>(scale.data);
  launch.zero(key, 4);
  launch(compress_columns_kernel<false>, grid, kColumnsThreads, 0, m, map.strides[0], p, rank, key, s, q,
         q_t.strides[0], K, K_pad);
  launch(compress_columns_kernel<true>, grid, kColumnsThreads, 0, m, map.strides[0], p, rank, key, s, q,
         q_t.strides[0], K, K_pad);
}

}  // namespace hot::cuda
