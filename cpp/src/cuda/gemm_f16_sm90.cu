// sm_90a wgmma s8 GEMM with the dequantising epilogue, cutlass::half_t output (one type per translation unit so
// that the CUTLASS instantiations compile in parallel).
#include "gemm_sm90.cuh"

namespace hot::cuda::sm90 {
template bool dequant_gemm<cutlass::half_t>(const int8_t*, int64_t, const int8_t*, int64_t, cutlass::half_t*, int64_t, int, int, int,
                                const float*, bool, const float*, float, int, cudaStream_t);
}  // namespace hot::cuda::sm90
