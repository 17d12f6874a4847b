// sm_90a entry points: the s32-output GEMM and the dispatch of the dequantising GEMMs, including the
// padded-output route for N that TMA cannot store directly (rows of D must be 16-byte multiples) and the split-K
// route for outputs of very few tiles (split_k_slices).
#include "gemm_sm90.cuh"
#include "generic_gemm_kernels.cuh"

namespace hot::cuda::sm90 {

extern template bool dequant_gemm<float>(const int8_t*, int64_t, const int8_t*, int64_t, float*, int64_t, int, int,
                                         int, const float*, bool, const float*, float, int, cudaStream_t);
extern template bool dequant_gemm<cutlass::half_t>(const int8_t*, int64_t, const int8_t*, int64_t, cutlass::half_t*,
                                                   int64_t, int, int, int, const float*, bool, const float*, float,
                                                   int, cudaStream_t);
extern template bool dequant_gemm<cutlass::bfloat16_t>(const int8_t*, int64_t, const int8_t*, int64_t,
                                                       cutlass::bfloat16_t*, int64_t, int, int, int, const float*,
                                                       bool, const float*, float, int, cudaStream_t);

bool store_gemm(const int8_t* a, int64_t lda, const int8_t* b, int64_t ldb, int32_t* d, int64_t ldd, int M, int N,
                int K, int device, cudaStream_t stream) {
  typename StoreEVT::Arguments fusion{{}, {}};
  return run_gemm_for_m<int32_t, StoreEVT>(a, lda, b, ldb, d, ldd, M, N, K, fusion, device, stream);
}

namespace {

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

}  // namespace

// What the kernel needs of A (M x K) and of the sizes, checked before the padded route of with_padding allocates
// anything: int sizes (CUTLASS's problem shape; the padded N too), K a multiple of 16, A's rows 16-byte aligned.
bool a_operand_ok(const TensorView& a, const TensorView& b) {
  const int64_t M = a.shape[0], K = a.shape[1], N = b.shape[0];
  return fits_int32(M) && fits_int32(round_up(N, 16)) && fits_int32(K) && K % 16 == 0 && a.strides[0] % 16 == 0 &&
         aligned16(a.data);
}

namespace {

// Calls run(b, ldb, d, ldd, N_run) directly when the output can be stored by TMA, else through a
// padded copy of B (zero rows up to a multiple of 16) and a padded scratch D, copied back with one 2-D
// memcpy. Returns false when even the padded route is not implementable (A/B alignment).
template <typename Run>
bool with_padding(const TensorView& bv, const TensorView& out, int elem_bytes, int device, cudaStream_t s, Run&& run) {
  const int64_t N = out.shape[1], M = out.shape[0], K = bv.shape[1];
  const auto* b = static_cast<const int8_t*>(bv.data);
  if (run(b, bv.strides[0], out.data, out.strides[0], static_cast<int>(N))) return true;
  if (K % 16 != 0) return false;
  const int64_t Np = round_up(N, 16);
  Scratch dpad(static_cast<size_t>(M * Np * elem_bytes), device, Stream{s});
  const int8_t* bp = b;
  int64_t ldb = bv.strides[0];
  Scratch bpad(N % 16 != 0 || ldb % 16 != 0 || !aligned16(b) ? static_cast<size_t>(Np * K) : 0, device, Stream{s});
  if (N % 16 != 0 || ldb % 16 != 0 || !aligned16(b)) {
    HOT_CUDA_CHECK(cudaMemsetAsync(bpad.get(), 0, static_cast<size_t>(Np * K), s));
    HOT_CUDA_CHECK(cudaMemcpy2DAsync(bpad.get(), static_cast<size_t>(K), b, static_cast<size_t>(ldb),
                                     static_cast<size_t>(K), static_cast<size_t>(N), cudaMemcpyDeviceToDevice, s));
    bp = bpad.as<int8_t>();
    ldb = K;
  }
  if (!run(bp, ldb, dpad.get(), Np, static_cast<int>(Np))) return false;
  HOT_CUDA_CHECK(cudaMemcpy2DAsync(out.data, static_cast<size_t>(out.strides[0] * elem_bytes), dpad.get(),
                                   static_cast<size_t>(Np * elem_bytes), static_cast<size_t>(N * elem_bytes),
                                   static_cast<size_t>(M), cudaMemcpyDeviceToDevice, s));
  return true;
}

// The split-K route (split_k_slices > 1): the equal K slices of A B^T as one batch of s32-output GEMMs into scratch,
// then reduce(partials, slices, slice stride, transposed) sums them (reduce_s32_launch) into the caller's output.
// Where N cannot be a row of the partials (N % 4 != 0: a conv's g_w with C k^2 columns, 147 for a 7 x 7 stem) but M
// can, the batch computes the transposed product B A^T (N x M partials; `transposed`: element (r, c) of the sum is
// output (c, r)), so that B needs neither padding nor a copy. False, with nothing launched, when the route does not
// apply (the caller runs the one GEMM).
template <typename Reduce>
bool split_k(const TensorView& a, const TensorView& b, int device, cudaStream_t s, Reduce&& reduce) {
  const int64_t M = a.shape[0], K = a.shape[1], N = b.shape[0];
  const bool transposed = N % 4 != 0 && M % 4 == 0 && a_operand_ok(b, a);
  const TensorView& x = transposed ? b : a;  // the problem's A (rows: the partials' rows) and B
  const TensorView& y = transposed ? a : b;
  const int64_t Mx = x.shape[0], Ny = y.shape[0];
  const int S = split_k_slices(Mx, Ny, K, sm_count(device));
  if (S < 2 || Ny % 4 != 0 || y.strides[0] % 16 != 0 || !aligned16(y.data)) return false;
  const int64_t Ks = K / S;  // a multiple of 16
  Scratch part(static_cast<size_t>(S * Mx * Ny) * 4, device, Stream{s});
  typename StoreEVT::Arguments fusion{{}, {}};
  if (!run_gemm_for_m<int32_t, StoreEVT>(static_cast<const int8_t*>(x.data), x.strides[0],
                                         static_cast<const int8_t*>(y.data), y.strides[0], part.get(), Ny,
                                         static_cast<int>(Mx), static_cast<int>(Ny), static_cast<int>(Ks), fusion,
                                         device, s, S, Ks, Ks, Mx * Ny))
    return false;
  reduce(make_view(part.get(), DType::s32, a.device, {Mx, Ny}), S, Mx * Ny, transposed);
  return true;
}

}  // namespace
}  // namespace hot::cuda::sm90

namespace hot::cuda {

bool sm90_gemm_s8s8s32(const TensorView& a, const TensorView& b, const TensorView& c, int device, cudaStream_t s) {
  if (!sm90::a_operand_ok(a, b) || a.shape[1] > kMaxInt32K) return false;
  if (sm90::split_k(a, b, device, s, [&](const TensorView& part, int slices, int64_t stride, bool transposed) {
        reduce_s32_launch(part, slices, stride, StoreS32{static_cast<int32_t*>(c.data), c.strides[0]}, transposed,
                          StreamLaunch{s});
      }))
    return true;
  const int M = static_cast<int>(a.shape[0]), K = static_cast<int>(a.shape[1]);
  const auto* ap = static_cast<const int8_t*>(a.data);
  return sm90::with_padding(b, c, 4, device, s, [&](const int8_t* bp, int64_t ldb, void* d, int64_t ldd, int N) {
    return sm90::store_gemm(ap, a.strides[0], bp, ldb, static_cast<int32_t*>(d), ldd, M, N, K, device, s);
  });
}

bool sm90_gemm_s8_dequant(const TensorView& a, const TensorView& b, const TensorView& sa, const TensorView& sb,
                          float factor, const TensorView& out, int device, cudaStream_t s) {
  if (!sm90::a_operand_ok(a, b)) return false;
  if (sm90::split_k(a, b, device, s, [&](const TensorView& part, int slices, int64_t stride, bool transposed) {
        dispatch_float(out.dtype, "gemm_s8_dequant", [&](auto t) {
          reduce_s32_launch(part, slices, stride, make_dequant<decltype(t)>(sa, sb, factor, out), transposed,
                            StreamLaunch{s});
        });
      }))
    return true;
  if (a.shape[1] > kMaxInt32K) return false;  // one GEMM's int32 sums would not be exact: gemm.cu's K pieces
  const int M = static_cast<int>(a.shape[0]), K = static_cast<int>(a.shape[1]);
  const auto* ap = static_cast<const int8_t*>(a.data);
  const bool per_row = sa.shape[0] != 1;
  const auto* sap = static_cast<const float*>(sa.data);
  const auto* sbp = static_cast<const float*>(sb.data);
  const int eb = out.dtype == DType::f32 ? 4 : 2;
  return sm90::with_padding(b, out, eb, device, s, [&](const int8_t* bp, int64_t ldb, void* d, int64_t ldd, int N) {
    switch (out.dtype) {
      case DType::f32:
        return sm90::dequant_gemm<float>(ap, a.strides[0], bp, ldb, static_cast<float*>(d), ldd, M, N, K, sap,
                                         per_row, sbp, factor, device, s);
      case DType::f16:
        return sm90::dequant_gemm<cutlass::half_t>(ap, a.strides[0], bp, ldb, static_cast<cutlass::half_t*>(d), ldd,
                                                   M, N, K, sap, per_row, sbp, factor, device, s);
      case DType::bf16:
        return sm90::dequant_gemm<cutlass::bfloat16_t>(ap, a.strides[0], bp, ldb,
                                                       static_cast<cutlass::bfloat16_t*>(d), ldd, M, N, K, sap,
                                                       per_row, sbp, factor, device, s);
      default: return false;
    }
  });
}

}  // namespace hot::cuda
