// Integer GEMM entry points of the CUDA backend and their dispatch (select_gemm_path, runtime.cu); the
// generic CUDA-core kernels (generic_gemm_kernels.cuh) serve shapes the tensor-core paths do not take (K not a
// multiple of 16, misaligned views) and GPUs without a compiled tensor-core path.
#include <algorithm>

#include "generic_gemm_kernels.cuh"

namespace hot::cuda {

namespace {

TensorView s8_view(void* p, int64_t rows, int64_t cols, Device d) { return make_view(p, DType::s8, d, {rows, cols}); }

}  // namespace

void gemm_s8_generic(const Mat<const int8_t>& a, const Mat<const int8_t>& b, const Mat<int32_t>& c, cudaStream_t s) {
  generic_gemm_launch(a, b, StoreS32{c.p, c.ld}, StreamLaunch{s});
}

void gemm_s8_dequant_generic(const TensorView& a, const TensorView& b, const TensorView& sa, const TensorView& sb,
                             float factor, const TensorView& out, cudaStream_t s) {
  dispatch_float(out.dtype, "gemm_s8_dequant", [&](auto t) {
    using T = decltype(t);
    generic_gemm_launch(mat<const int8_t>(a), mat<const int8_t>(b), make_dequant<T>(sa, sb, factor, out),
                        StreamLaunch{s});
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

namespace {

// The dequantising GEMM of a K past kMaxInt32K where the sm_90 split-K route did not take it (sm_80, the generic
// kernel, K / 16 without a fitting divisor): consecutive K pieces of at most kMaxInt32K (multiples of 16 but the last),
// each an exact int32 GEMM into its own s32 partial, then reduce_s32 adds them in int64 and dequantises.
void gemm_s8_dequant_long_k(const TensorView& a, const TensorView& b, const TensorView& sa, const TensorView& sb,
                            float factor, const TensorView& out, Stream st) {
  const int64_t M = a.shape[0], N = b.shape[0], K = a.shape[1];
  const int64_t pieces = (K + kMaxInt32K - 1) / kMaxInt32K;
  const int64_t step = ((K + pieces - 1) / pieces + 15) / 16 * 16;  // <= kMaxInt32K (a multiple of 16)
  Scratch part(static_cast<size_t>(pieces * M * N) * 4, a.device.index, st);
  for (int64_t p = 0; p < pieces; ++p) {
    const int64_t k0 = p * step, k1 = std::min(K, k0 + step);
    TensorView ap = a, bp = b;
    ap.data = static_cast<int8_t*>(a.data) + k0;
    bp.data = static_cast<int8_t*>(b.data) + k0;
    ap.shape[1] = bp.shape[1] = k1 - k0;
    cuda::gemm_s8s8s32(ap, bp, make_view(part.as<int32_t>() + p * M * N, DType::s32, a.device, {M, N}), st);
  }
  dispatch_float(out.dtype, "gemm_s8_dequant", [&](auto t) {
    reduce_s32_launch(make_view(part.get(), DType::s32, a.device, {M, N}), static_cast<int>(pieces), M * N,
                      make_dequant<decltype(t)>(sa, sb, factor, out), false, StreamLaunch{to_cuda(st)});
  });
}

}  // namespace

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
  if (a.shape[1] > kMaxInt32K) {
    gemm_s8_dequant_long_k(a, b, sa, sb, factor, out, st);
    return;
  }
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
      dispatch_float(out.dtype, "gemm_s8_dequant",
                     [&](auto t) { dequant_s32_launch<decltype(t)>(cv, sa, sb, factor, out, StreamLaunch{s}); });
      return;
    }
  }
#endif
  (void)path;
  gemm_s8_dequant_generic(a, b, sa, sb, factor, out, s);
}

}  // namespace hot::cuda
