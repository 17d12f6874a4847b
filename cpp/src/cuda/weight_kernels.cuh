// quantize_weight (SPEC §3): W~ = blockdiag(H_b) W (groups of b rows, per column), round-to-nearest with one
// per-tensor scale, written transposed as q_wt (I x O_pad, K-major for the g_x GEMM; columns O .. O_pad zero).
// The kernels and the launch sequence; included by layer_ops.cu (the CUDA backend) and by the host emulation
// test (cpp/tests/emu), which runs these same kernels on the CPU. Internal linkage: one translation unit per binary.
//   amax:  a grid-stride pass over the column groups; the transform in registers, the block maximum into one
//          amax key (atomicMax);
//   quant: a CTA transforms and quantises rows [o0, o0 + 64) x columns [i0, i0 + 64) of W~, stages the bytes
//          transposed in shared memory and writes 64 contiguous bytes per row of q_wt (full sectors); the
//          CTAs of the last row tile also write the zero padding O .. O_pad.
#pragma once

#include <algorithm>

#include "common.cuh"
#include "fwht.cuh"
#include "hot/quant_rules.h"

namespace hot::cuda {

namespace {

constexpr int kWT = 64;
constexpr int kWThreads = 256;

template <int B, typename T>
__global__ void weight_amax_kernel(Mat<const T> w, unsigned* key) {
  const int64_t n = (w.rows / B) * w.cols;
  uint32_t m = 0;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < n;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t g = v / w.cols, i = v % w.cols;
    float x[B];
#pragma unroll
    for (int t = 0; t < B; ++t) x[t] = load_f(w.p + (g * B + t) * w.ld + i);
    fwht_regs<B>(x);
#pragma unroll
    for (int t = 0; t < B; ++t) m = max(m, amax_key(x[t]));
  }
  m = block_max_u32(m);
  if (threadIdx.x == 0) atomicMax(key, m);
}

// qt: I x O_pad (O_pad = qt.cols >= w.rows); rows o >= O of W~ are zero, so they quantise to 0.
template <int B, typename T>
__global__ void __launch_bounds__(kWThreads) weight_quant_kernel(Mat<const T> w, const unsigned* key, int qmax,
                                                                 float* s_w, Mat<int8_t> qt) {
  __shared__ __align__(4) uint8_t tile[kWT][kWT + 4];
  const QuantScale qs = quant_scale_from_amax(amax_from_key(*key), qmax);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *s_w = qs.scale;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kWT, o0 = static_cast<int64_t>(blockIdx.y) * kWT;
  constexpr int kGroups = kWT / B;
  for (int v = threadIdx.x; v < kGroups * kWT; v += kWThreads) {
    const int il = v % kWT, gl = v / kWT;
    const int64_t i = i0 + il, ob = o0 + static_cast<int64_t>(gl) * B;
    float x[B];
    if (i < w.cols && ob < w.rows) {  // O % B == 0: a group is all in or all out
#pragma unroll
      for (int t = 0; t < B; ++t) x[t] = load_f(w.p + (ob + t) * w.ld + i);
    } else {
#pragma unroll
      for (int t = 0; t < B; ++t) x[t] = 0.0f;
    }
    fwht_regs<B>(x);
#pragma unroll
    for (int t = 0; t < B; ++t) tile[il][gl * B + t] = static_cast<uint8_t>(quantize_nearest(x[t], qs, qmax));
  }
  __syncthreads();
  const int64_t ncols = std::min<int64_t>(kWT, qt.cols - o0);  // columns of q_wt in this tile, padding included
  const bool words = ncols == kWT && (qt.ld % 4) == 0 && (reinterpret_cast<uintptr_t>(qt.p) % 4) == 0;
  if (words) {
    for (int v = threadIdx.x; v < kWT * (kWT / 4); v += kWThreads) {
      const int row = v / (kWT / 4), wd = v % (kWT / 4);
      if (i0 + row < w.cols)
        *reinterpret_cast<uint32_t*>(qt.p + (i0 + row) * qt.ld + o0 + 4 * wd) =
            *reinterpret_cast<const uint32_t*>(&tile[row][4 * wd]);
    }
  } else {
    for (int v = threadIdx.x; v < kWT * kWT; v += kWThreads) {
      const int row = v / kWT, c = v % kWT;
      if (i0 + row < w.cols && c < ncols) qt.p[(i0 + row) * qt.ld + o0 + c] = static_cast<int8_t>(tile[row][c]);
    }
  }
}

// The launch sequence of one quantize_weight call (arguments validated by the caller), through a launcher with
// the interface of qgo_launch's: launch(kernel, grid, threads, smem, args...) and launch.zero(p, bytes). `key`:
// 4 bytes of scratch.
template <typename T, typename Launch>
void weight_launch(const TensorView& w, const TensorView& q_wt, const TensorView& s_w, int bits, int block,
                   unsigned* key, const Launch& launch) {
  const int64_t O = w.shape[0], I = w.shape[1], O_pad = q_wt.shape[1];
  HOT_CHECK_VALUE(ceil_div(O_pad, kWT) < 65536, "quantize_weight: too many rows (", O, ")");
  const int qmax = qmax_for_bits(bits);
  const Mat<const T> mw = mat<const T>(w);
  const Mat<int8_t> mq = mat<int8_t>(q_wt);
  const dim3 qgrid(static_cast<unsigned>(ceil_div(I, kWT)), static_cast<unsigned>(ceil_div(O_pad, kWT)));
  float* scale = static_cast<float*>(s_w.data);
  launch.zero(key, 4);
  const auto run = [&](auto amax_kernel, auto quant_kernel) {
    launch(amax_kernel, dim3(grid_1d(O / block * I, kWThreads, 2048)), kWThreads, 0, mw, key);
    launch(quant_kernel, qgrid, kWThreads, 0, mw, static_cast<const unsigned*>(key), qmax, scale, mq);
  };
  switch (block) {
    case 1: run(weight_amax_kernel<1, T>, weight_quant_kernel<1, T>); break;
    case 2: run(weight_amax_kernel<2, T>, weight_quant_kernel<2, T>); break;
    case 4: run(weight_amax_kernel<4, T>, weight_quant_kernel<4, T>); break;
    case 8: run(weight_amax_kernel<8, T>, weight_quant_kernel<8, T>); break;
    case 16: run(weight_amax_kernel<16, T>, weight_quant_kernel<16, T>); break;
    default: HOT_FAIL(internal, "quantize_weight: unsupported block ", block);
  }
}

}  // namespace

}  // namespace hot::cuda
