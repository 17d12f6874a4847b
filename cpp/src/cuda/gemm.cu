// Integer GEMM entry points of the CUDA backend and their dispatch (select_gemm_path, runtime.cu),
// plus the generic CUDA-core kernels used for shapes the tensor-core paths do not take (K not a
// multiple of 16, misaligned views) and for GPUs without a compiled tensor-core path.
#include "common.cuh"
#include "hot/quant_rules.h"

namespace hot::cuda {

namespace {

constexpr int kTM = 64, kTN = 64, kTK = 32;

struct StoreS32 {
  int32_t* c;
  int64_t ld;
  __device__ void operator()(int64_t m, int64_t n, int32_t acc) const { c[m * ld + n] = acc; }
};

template <typename T>
struct Dequant {
  T* out;
  int64_t ld;
  const float* sa;
  bool per_row;
  const float* sb;
  float factor;
  __device__ void operator()(int64_t m, int64_t n, int32_t acc) const {
    // acc * ((sa * sb) * factor), fp32, round to nearest: the order of the CPU backend and the CUTLASS
    // epilogue.
    const float alpha = __fmul_rn(__fmul_rn(sa[per_row ? m : 0], sb[0]), factor);
    const float v = __fmul_rn(static_cast<float>(acc), alpha);
    store_f(out + m * ld + n, v);
  }
};

// 64x64 output tile, 256 threads, 4x4 outputs each, exact int32 accumulation.
template <typename Epi>
__global__ void __launch_bounds__(256) gemm_s8_generic_kernel(Mat<const int8_t> A, Mat<const int8_t> B, Epi epi) {
  __shared__ int8_t As[kTM][kTK + 4];
  __shared__ int8_t Bs[kTN][kTK + 4];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t bm = static_cast<int64_t>(blockIdx.y) * kTM, bn = static_cast<int64_t>(blockIdx.x) * kTN;
  const int64_t M = A.rows, N = B.rows, K = A.cols;
  int32_t acc[4][4] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kTK) {
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
        for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
    }
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

template <typename Epi>
void launch_generic(const Mat<const int8_t>& a, const Mat<const int8_t>& b, const Epi& epi, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>(ceil_div(b.rows, kTN)), static_cast<unsigned>(ceil_div(a.rows, kTM)));
  HOT_CHECK_VALUE(grid.y < 65536, "integer GEMM: M = ", a.rows, " is too large for the generic kernel");
  gemm_s8_generic_kernel<Epi><<<grid, 256, 0, s>>>(a, b, epi);
  HOT_CUDA_CHECK_LAUNCH();
}

// out = float(acc) * sa[m | 0] * sb[0] * factor from an s32 matrix (sm80 path: the CUTLASS 2.x GEMM
// writes s32, this applies the same scalar rule as the fused epilogues).
template <typename T>
__global__ void dequant_s32_kernel(Mat<const int32_t> c, Dequant<T> epi) {
  const int64_t n = c.rows * c.cols;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / c.cols, k = e % c.cols;
    epi(r, k, c.p[r * c.ld + k]);
  }
}

template <typename T>
Dequant<T> make_dequant(const TensorView& sa, const TensorView& sb, float factor, const TensorView& out) {
  return Dequant<T>{static_cast<T*>(out.data), out.strides[0], static_cast<const float*>(sa.data),
                    sa.shape[0] != 1, static_cast<const float*>(sb.data), factor};
}

TensorView s8_view(void* p, int64_t rows, int64_t cols, Device d) { return make_view(p, DType::s8, d, {rows, cols}); }

}  // namespace

void gemm_s8_generic(const Mat<const int8_t>& a, const Mat<const int8_t>& b, const Mat<int32_t>& c, cudaStream_t s) {
  launch_generic(a, b, StoreS32{c.p, c.ld}, s);
}

void gemm_s8_dequant_generic(const TensorView& a, const TensorView& b, const TensorView& sa, const TensorView& sb,
                             float factor, const TensorView& out, cudaStream_t s) {
  dispatch_float(out.dtype, "gemm_s8_dequant", [&](auto t) {
    using T = decltype(t);
    launch_generic(mat<const int8_t>(a), mat<const int8_t>(b), make_dequant<T>(sa, sb, factor, out), s);
  });
}

void gemm_s8s8s32(const TensorView& a, const TensorView& b, const TensorView& c, Stream st) {
  const int dev = a.device.index;
  DeviceGuard dg(dev);
  const cudaStream_t s = to_cuda(st);
  switch (select_gemm_path(dev)) {
#if defined(HOT_CUDA_HAS_SM90A)
    case GemmPath::sm90_wgmma:
      if (sm90_gemm_s8s8s32(a, b, c, dev, s)) return;
      break;
#endif
#if defined(HOT_CUDA_HAS_SM80)
    case GemmPath::sm80_cutlass:
      if (sm80_gemm_s8s8s32(a, b, c, dev, s)) return;
      break;
#endif
    default: break;
  }
  gemm_s8_generic(mat<const int8_t>(a), mat<const int8_t>(b), mat<int32_t>(c), s);
}

// Packed s4: on sm_80/86/89 the CUTLASS 2.x s4 tensor-core GEMM; elsewhere (Hopper has no int4 tensor
// cores, SPEC §6) the operands are unpacked into int8 containers and run through the s8 GEMM, which
// gives the same products. Scratch: (M + N) * K bytes.
void gemm_s4s4s32(const TensorView& a, const TensorView& b, const TensorView& c, Stream st) {
  const int dev = a.device.index;
  DeviceGuard dg(dev);
  const cudaStream_t s = to_cuda(st);
#if defined(HOT_CUDA_HAS_SM80)
  if (select_gemm_path(dev) == GemmPath::sm80_cutlass && sm80_gemm_s4s4s32(a, b, c, dev, s)) return;
#endif
  const int64_t M = a.shape[0], N = b.shape[0], K = a.shape[1];
  const int64_t Kp = (K + 15) / 16 * 16;  // zero-padded K keeps the tensor-core path available
  Scratch buf(static_cast<size_t>((M + N) * Kp), dev, st);
  int8_t* a8 = buf.as<int8_t>();
  int8_t* b8 = a8 + M * Kp;
  if (Kp != K) HOT_CUDA_CHECK(cudaMemsetAsync(buf.get(), 0, static_cast<size_t>((M + N) * Kp), s));
  TensorView av = s8_view(a8, M, K, a.device), bv = s8_view(b8, N, K, a.device);
  av.strides[0] = Kp;
  bv.strides[0] = Kp;
  cuda::unpack_int4(a, av, st);
  cuda::unpack_int4(b, bv, st);
  av.shape[1] = Kp;
  bv.shape[1] = Kp;
  cuda::gemm_s8s8s32(av, bv, c, st);
}

// bits == 4 says the operands hold 4-bit values: on sm_80/86/89 they are packed and run through the s4
// tensor-core GEMM (s32 result, then the dequantisation kernel); on sm_90a the s8 wgmma GEMM with the
// fused dequantising epilogue runs for both widths.
void gemm_s8_dequant(const TensorView& a, const TensorView& b, const TensorView& sa, const TensorView& sb, float factor,
                     int bits, const TensorView& out, Stream st) {
  const int dev = a.device.index;
  DeviceGuard dg(dev);
  const cudaStream_t s = to_cuda(st);
  const GemmPath path = select_gemm_path(dev);
  (void)bits;
#if defined(HOT_CUDA_HAS_SM90A)
  if (path == GemmPath::sm90_wgmma && sm90_gemm_s8_dequant(a, b, sa, sb, factor, out, dev, s)) return;
#endif
#if defined(HOT_CUDA_HAS_SM80)
  if (path == GemmPath::sm80_cutlass) {
    const int64_t M = a.shape[0], N = b.shape[0], K = a.shape[1];
    const int64_t Np = (N + 3) / 4 * 4;
    Scratch cbuf(static_cast<size_t>(M * Np) * 4, dev, st);
    TensorView cv = make_view(cbuf.get(), DType::s32, a.device, {M, N});
    cv.strides[0] = Np;
    bool ok = false;
    if (bits == 4 && K % 2 == 0) {
      Scratch pbuf(static_cast<size_t>((M + N) * K / 2), dev, st);
      TensorView ap = make_view(pbuf.get(), DType::s4, a.device, {M, K});
      TensorView bp = make_view(pbuf.as<uint8_t>() + M * K / 2, DType::s4, a.device, {N, K});
      cuda::pack_int4(a, ap, st);
      cuda::pack_int4(b, bp, st);
      ok = sm80_gemm_s4s4s32(ap, bp, cv, dev, s);
    }
    if (!ok) ok = sm80_gemm_s8s8s32(a, b, cv, dev, s);
    if (ok) {
      dispatch_float(out.dtype, "gemm_s8_dequant", [&](auto t) {
        using T = decltype(t);
        dequant_s32_kernel<T><<<grid_1d(M * N, 256), 256, 0, s>>>(mat<const int32_t>(cv),
                                                                 make_dequant<T>(sa, sb, factor, out));
      });
      HOT_CUDA_CHECK_LAUNCH();
      return;
    }
  }
#endif
  (void)path;
  gemm_s8_dequant_generic(a, b, sa, sb, factor, out, s);
}

}  // namespace hot::cuda
