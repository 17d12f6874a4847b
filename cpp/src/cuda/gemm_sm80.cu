// CUTLASS 2.x tensor-core integer GEMMs for sm_80/86/89 (mma.sync): packed s4 x s4 -> s32 for the
// 4-bit g_x path (native INT4 tensor cores on Ampere/Ada) and s8 x s8 -> s32 for the g_w path.
// TN layout (A row-major M x K, B "column-major" = N x K row-major), s32 row-major output.
// Compiled only for the 80/86/89 entries of HOT_CUDA_ARCHS (CMake: *_sm80.cu).
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/gemm/device/gemm.h>
#include <cutlass/numeric_types.h>

#include "common.cuh"

namespace hot::cuda {

namespace {

using Epilogue = cutlass::epilogue::thread::LinearCombination<int32_t, 4, int32_t, int32_t>;

using GemmS4 = cutlass::gemm::device::Gemm<
    cutlass::int4b_t, cutlass::layout::RowMajor, cutlass::int4b_t, cutlass::layout::ColumnMajor, int32_t,
    cutlass::layout::RowMajor, int32_t, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
    cutlass::gemm::GemmShape<128, 256, 128>, cutlass::gemm::GemmShape<64, 64, 128>, cutlass::gemm::GemmShape<16, 8, 64>,
    Epilogue, cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>, 3, 32, 32, false,
    cutlass::arch::OpMultiplyAddSaturate>;

using GemmS8 = cutlass::gemm::device::Gemm<
    int8_t, cutlass::layout::RowMajor, int8_t, cutlass::layout::ColumnMajor, int32_t, cutlass::layout::RowMajor,
    int32_t, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80, cutlass::gemm::GemmShape<128, 256, 64>,
    cutlass::gemm::GemmShape<64, 64, 64>, cutlass::gemm::GemmShape<16, 8, 32>, Epilogue,
    cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>, 3, 16, 16, false,
    cutlass::arch::OpMultiplyAddSaturate>;

template <typename Gemm, typename Element>
bool run(const TensorView& a, const TensorView& b, const TensorView& c, int align_k, int device, cudaStream_t s) {
  if (!fits_int32(a.shape[0]) || !fits_int32(b.shape[0]) || !fits_int32(a.shape[1]) || !fits_int32(c.strides[0]))
    return false;  // CUTLASS 2.x takes int sizes (the generic kernel then runs, or says what does not fit)
  const int M = static_cast<int>(a.shape[0]), N = static_cast<int>(b.shape[0]), K = static_cast<int>(a.shape[1]);
  if (K % align_k != 0 || a.strides[0] % align_k != 0 || b.strides[0] % align_k != 0 || N % 4 != 0 ||
      c.strides[0] % 4 != 0)
    return false;
  using RefA = cutlass::TensorRef<Element const, cutlass::layout::RowMajor>;
  using RefB = cutlass::TensorRef<Element const, cutlass::layout::ColumnMajor>;
  using RefC = cutlass::TensorRef<int32_t, cutlass::layout::RowMajor>;
  typename Gemm::Arguments args({M, N, K}, RefA(static_cast<Element const*>(a.data), a.strides[0]),
                                RefB(static_cast<Element const*>(b.data), b.strides[0]),
                                RefC(static_cast<int32_t*>(c.data), c.strides[0]),
                                RefC(static_cast<int32_t*>(c.data), c.strides[0]), {1, 0});
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
  Scratch ws(Gemm::get_workspace_size(args), device, Stream{s});
  cutlass::Status st = gemm.initialize(args, ws.get(), s);
  HOT_CHECK(st == cutlass::Status::kSuccess, internal, "CUTLASS sm80 GEMM initialize failed: ",
            cutlass::cutlassGetStatusString(st));
  clear_stale_error();  // CUTLASS reads cudaGetLastError after its launch
  st = gemm(s);
  HOT_CHECK(st == cutlass::Status::kSuccess, internal, "CUTLASS sm80 GEMM failed: ", cutlass::cutlassGetStatusString(st));
  HOT_CUDA_CHECK_LAUNCH();
  return true;
}

}  // namespace

bool sm80_gemm_s4s4s32(const TensorView& a, const TensorView& b, const TensorView& c, int device, cudaStream_t s) {
  return run<GemmS4, cutlass::int4b_t>(a, b, c, 32, device, s);
}

bool sm80_gemm_s8s8s32(const TensorView& a, const TensorView& b, const TensorView& c, int device, cudaStream_t s) {
  return run<GemmS8, int8_t>(a, b, c, 16, device, s);
}

}  // namespace hot::cuda
