// matmul_exact: the unquantised path (exact mode and baselines) through cuBLAS, fp32 accumulation.
#include <cublas_v2.h>

#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common.cuh"

#define HOT_CUBLAS_CHECK(expr)                                                               \
  do {                                                                                       \
    const cublasStatus_t hot_st_ = (expr);                                                   \
    if (hot_st_ != CUBLAS_STATUS_SUCCESS)                                                    \
      HOT_FAIL(internal, "cuBLAS error ", cublasGetStatusName(hot_st_), " (", cublasGetStatusString(hot_st_), \
               ") in ", #expr);                                                              \
  } while (0)

namespace hot::cuda {

namespace {

// One handle per (host thread, device) at a time: cuBLAS handles are not meant to be shared between threads that
// set different streams concurrently. A thread takes a handle from its device's pool on first use and gives it
// back when the thread ends, so programs that start threads again and again reuse a few handles instead of
// creating (and leaking) one per thread. The pool itself lives until the process ends (never destroyed: handles
// must not be destroyed after the CUDA runtime has shut down).
struct HandlePool {
  std::mutex m;
  std::unordered_map<int, std::vector<cublasHandle_t>> free;
};
HandlePool& handle_pool() {
  static HandlePool* pool = new HandlePool;
  return *pool;
}

struct ThreadHandles {
  std::unordered_map<int, cublasHandle_t> held;
  ~ThreadHandles() {
    HandlePool& pool = handle_pool();
    const std::lock_guard<std::mutex> lock(pool.m);
    for (const auto& [device, h] : held) pool.free[device].push_back(h);
  }
};

cublasHandle_t handle_for(int device) {
  thread_local ThreadHandles handles;
  auto it = handles.held.find(device);
  if (it != handles.held.end()) return it->second;
  cublasHandle_t h = nullptr;
  {
    HandlePool& pool = handle_pool();
    const std::lock_guard<std::mutex> lock(pool.m);
    std::vector<cublasHandle_t>& v = pool.free[device];
    if (!v.empty()) {
      h = v.back();
      v.pop_back();
    }
  }
  if (h == nullptr) {
    HOT_CUBLAS_CHECK(cublasCreate(&h));  // on the current device: the caller's DeviceGuard
    HOT_CUBLAS_CHECK(cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH));  // no TF32, no reduced-precision reductions
  }
  handles.held.emplace(device, h);
  return h;
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::f32: return CUDA_R_32F;
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    default: HOT_FAIL(internal, "matmul_exact: unsupported dtype ", dtype_name(t));
  }
}

template <typename T>
__global__ void cast_f32_kernel(const float* in, int64_t rows, int64_t cols, T* out, int64_t ld) {
  const int64_t n = rows * cols;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / cols, c = e % cols;
    store_f(out + r * ld + c, in[e]);
  }
}

}  // namespace

// Row-major out (M x N) = op(a) op(b) computed as the column-major product out^T = op(b)^T op(a)^T.
void matmul_exact(const TensorView& a, bool trans_a, const TensorView& b, bool trans_b, const TensorView& out,
                  Stream st) {
  const int dev = a.device.index;
  DeviceGuard dg(dev);
  const cudaStream_t s = to_cuda(st);
  const int64_t M = out.shape[0], N = out.shape[1];
  const int64_t K = trans_a ? a.shape[0] : a.shape[1];
  // cuBLAS takes its sizes and leading dimensions as int.
  const std::pair<const char*, int64_t> sizes[] = {{"rows of the output", M},   {"columns of the output", N},
                                                   {"the contraction", K},      {"the row stride of a", a.strides[0]},
                                                   {"the row stride of b", b.strides[0]}, {"the row stride of the output", out.strides[0]}};
  for (const auto& [what, v] : sizes)
    HOT_CHECK_VALUE(fits_int32(v), "exact GEMM (cuBLAS): ", what, " is ", v, "; at most 2147483647 is supported");
  cublasHandle_t h = handle_for(dev);
  HOT_CUBLAS_CHECK(cublasSetStream(h, s));
  const bool direct = out.dtype == a.dtype || out.dtype == DType::f32;
  Scratch tmp(direct ? 0 : static_cast<size_t>(M * N) * 4, dev, st);
  void* c = direct ? out.data : tmp.get();
  const int64_t ldc = direct ? out.strides[0] : N;
  const cudaDataType_t tc = direct ? cuda_type(out.dtype) : CUDA_R_32F;
  const float one = 1.0f, zero = 0.0f;
  HOT_CUBLAS_CHECK(cublasGemmEx(h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                                static_cast<int>(N), static_cast<int>(M), static_cast<int>(K), &one, b.data,
                                cuda_type(b.dtype), static_cast<int>(b.strides[0]), a.data, cuda_type(a.dtype),
                                static_cast<int>(a.strides[0]), &zero, c, tc, static_cast<int>(ldc),
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  if (!direct) {
    dispatch_float(out.dtype, "matmul_exact", [&](auto t) {
      using T = decltype(t);
      clear_stale_error();
      cast_f32_kernel<T><<<grid_1d(M * N, 256), 256, 0, s>>>(tmp.as<float>(), M, N, static_cast<T*>(out.data),
                                                             out.strides[0]);
    });
    HOT_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace hot::cuda
