// The generic CUDA-core integer GEMM (exact: int32 sums of k blocks added in int64; s32 output or the fused
// dequantisation) and the
// dequantisation of an s32 matrix, with their launch sequences. Used for shapes the tensor-core paths do not take
// (K not a multiple of 16, misaligned views), for GPUs without a compiled tensor-core path, and (dequant_s32) after
// the sm_80 CUTLASS GEMM; reduce_s32 sums the K slices of the sm_90 GEMM's split-K route. Included by gemm.cu,
// gemm_s32_sm90.cu and by the host emulation test (cpp/tests/emu), which runs these same
// kernels on the CPU. Launchers: the interface of StreamLaunch (common.cuh).
#pragma once

#include "common.cuh"
#include "hot/quant_rules.h"

namespace hot::cuda {

namespace {

constexpr int kTM = 64, kTN = 64, kTK = 32;

// The epilogues take the exact integer sum as int64 (SPEC §4: a contraction longer than int32 allows is summed in
// int64 from int32 slices); StoreS32 serves the s32 GEMM, whose K check_k_fits bounds.
struct StoreS32 {
  int32_t* c;
  int64_t ld;
  __device__ void operator()(int64_t m, int64_t n, int64_t acc) const { c[m * ld + n] = static_cast<int32_t>(acc); }
};

template <typename T>
struct Dequant {
  T* out;
  int64_t ld;
  const float* sa;
  bool per_row;
  const float* sb;
  float factor;
  __device__ void operator()(int64_t m, int64_t n, int64_t acc) const {
    // acc * ((sa * sb) * factor), fp32, round to nearest (acc converted once, to nearest): the order of the CPU
    // backend and the CUTLASS epilogue.
    const float alpha = __fmul_rn(__fmul_rn(sa[per_row ? m : 0], sb[0]), factor);
    const float v = __fmul_rn(static_cast<float>(acc), alpha);
    store_f(out + m * ld + n, v);
  }
};

// 64x64 output tile, 256 threads, 4x4 outputs each: int32 sums of each 32-wide k block added in int64 (exact for any
// K).
template <typename Epi>
__global__ void __launch_bounds__(256) gemm_s8_generic_kernel(Mat<const int8_t> A, Mat<const int8_t> B, Epi epi) {
  __shared__ int8_t As[kTM][kTK + 4];
  __shared__ int8_t Bs[kTN][kTK + 4];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  // M (rows of A: tokens, up to millions) on grid.x, N (a feature dimension) on grid.y.
  const int64_t bm = static_cast<int64_t>(blockIdx.x) * kTM, bn = static_cast<int64_t>(blockIdx.y) * kTN;
  const int64_t M = A.rows, N = B.rows, K = A.cols;
  int64_t acc[4][4] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kTK) {
    int32_t blk[4][4] = {};
    for (int i = threadIdx.x; i < kTM * kTK; i += 256) {
      const int r = i / kTK, c = i % kTK;
      const int64_t m = bm + r, n = bn + r, k = k0 + c;
      As[r][c] = (m < M && k < K) ? A.p[m * A.ld + k] : int8_t(0);
      Bs[r][c] = (n < N && k < K) ? B.p[n * B.ld + k] : int8_t(0);
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < kTK; ++kk) {
      int32_t a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = As[ty + 16 * i][kk];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = Bs[tx + 16 * j][kk];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) blk[i][j] += a[i] * b[j];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] += blk[i][j];
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t m = bm + ty + 16 * i, n = bn + tx + 16 * j;
      if (m < M && n < N) epi(m, n, acc[i][j]);
    }
}

// epi(m, n, c[m][n]) for every element of an s32 matrix: the sm_80 path's dequantisation (the CUTLASS 2.x GEMM writes
// s32; this applies the scalar rule of the fused epilogues).
template <typename Epi>
__global__ void apply_s32_kernel(Mat<const int32_t> c, Epi epi) {
  const int64_t n = c.rows * c.cols;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / c.cols, k = e - r * c.cols;
    epi(r, k, c.p[r * c.ld + k]);
  }
}

// epi(m, n, the sum of `slices` s32 matrices c + s * slice_stride) for every element: the K slices of a GEMM (the
// split-K route of the sm90 path, gemm_s32_sm90.cu); `transposed`: element (r, k) of c is output (k, r) (the route's
// transposed product). Each slice is an exact int32 sum (at most kMaxInt32K long), the slices are added in int64.
constexpr int kReduceGroups = 8;  // slice groups of reduce_s32_kernel: one warp each, a block of 8 warps
template <typename Epi>
__global__ void __launch_bounds__(32 * kReduceGroups)
    reduce_s32_kernel(Mat<const int32_t> c, int slices, int64_t slice_stride, bool transposed, Epi epi) {
  // A block takes 32 consecutive elements at a time; warp y sums slices y, y + 8, ... of them (each load a warp's
  // 128 contiguous bytes; several loads in flight per thread), and warp 0 adds the 8 groups' sums and applies epi.
  // The pass is latency-bound (a few thousand elements, tens of slices each): one thread per element summing all
  // slices waited on one load after another. Any association of the integer sum is exact.
  __shared__ int64_t part[kReduceGroups][33];
  const int lane = static_cast<int>(threadIdx.x) & 31, group = static_cast<int>(threadIdx.x) >> 5;
  const int64_t n = c.rows * c.cols;
  for (int64_t e0 = blockIdx.x * int64_t{32}; e0 < n; e0 += gridDim.x * int64_t{32}) {
    const int64_t e = e0 + lane;
    const int64_t r = e < n ? e / c.cols : 0, k = e < n ? e - r * c.cols : 0;
    int64_t acc[4] = {};
    if (e < n) {
      const int32_t* p = c.p + r * c.ld + k;
      int s = group;
      for (; s + 3 * kReduceGroups < slices; s += 4 * kReduceGroups)
#pragma unroll
        for (int u = 0; u < 4; ++u) acc[u] += p[(s + u * kReduceGroups) * slice_stride];
      for (; s < slices; s += kReduceGroups) acc[0] += p[s * slice_stride];
    }
    part[group][lane] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    __syncthreads();
    if (group == 0 && e < n) {
      int64_t sum = 0;
#pragma unroll
      for (int g = 0; g < kReduceGroups; ++g) sum += part[g][lane];
      if (transposed)
        epi(k, r, sum);
      else
        epi(r, k, sum);
    }
    __syncthreads();  // part is rewritten next
  }
}

template <typename T>
Dequant<T> make_dequant(const TensorView& sa, const TensorView& sb, float factor, const TensorView& out) {
  return Dequant<T>{static_cast<T*>(out.data), out.strides[0], static_cast<const float*>(sa.data),
                    sa.shape[0] != 1, static_cast<const float*>(sb.data), factor};
}

// C (M x N) = A (M x K) B (N x K)^T through the epilogue epi(m, n, acc).
template <typename Epi, typename Launch>
void generic_gemm_launch(const Mat<const int8_t>& a, const Mat<const int8_t>& b, const Epi& epi, const Launch& launch) {
  const int64_t tiles_m = ceil_div(a.rows, kTM), tiles_n = ceil_div(b.rows, kTN);
  HOT_CHECK_VALUE(tiles_m <= kMaxGridX && tiles_n <= kMaxGridYZ, "integer GEMM: M = ", a.rows, ", N = ", b.rows,
                  " is too large for the generic kernel (at most ", kMaxGridYZ * kTN, " columns)");
  const dim3 grid(static_cast<unsigned>(tiles_m), static_cast<unsigned>(tiles_n));
  launch(gemm_s8_generic_kernel<Epi>, grid, 256, 0, a, b, epi);
}

// epi(m, n, sum over s < slices of c[s]) with c[s] at c.data + s * slice_stride (elements), c's shape and row stride;
// transposed: epi(n, m, ...) for element (m, n) of the sum.
template <typename Epi, typename Launch>
void reduce_s32_launch(const TensorView& c, int slices, int64_t slice_stride, const Epi& epi, bool transposed,
                       const Launch& launch) {
  launch(reduce_s32_kernel<Epi>, dim3(grid_1d(c.shape[0] * c.shape[1], 32)), 32 * kReduceGroups, 0,
         mat<const int32_t>(c), slices, slice_stride, transposed, epi);
}

// out = float(c) * sa[m | 0] * sb[0] * factor, for a float dtype T of out.
template <typename T, typename Launch>
void dequant_s32_launch(const TensorView& c, const TensorView& sa, const TensorView& sb, float factor,
                        const TensorView& out, const Launch& launch) {
  launch(apply_s32_kernel<Dequant<T>>, dim3(grid_1d(c.shape[0] * c.shape[1], 256)), 256, 0, mat<const int32_t>(c),
         make_dequant<T>(sa, sb, factor, out));
}

}  // namespace

}  // namespace hot::cuda
