// Shared helpers of the CUDA backend: status checks, stream/dtype plumbing, typed loads and stores,
// stream-ordered scratch memory and the one architecture dispatch function.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "backend.h"
#include "hot/error.h"
#include "hot/tensor.h"

// The runtime keeps the last error of any call (not only of launches) until cudaGetLastError reads it. Before a
// launch whose error is read back that way, an error left by an earlier call (one whose failure was already
// returned to its caller, ours or another library's) is cleared, so that it is not reported as this launch's; a
// failure that is reported (HOT_CUDA_CHECK) or ignored (in a destructor) is cleared likewise. Sticky errors (a
// kernel fault) are not cleared by this and still surface.
namespace hot::cuda {
inline void clear_stale_error() { (void)cudaGetLastError(); }
}  // namespace hot::cuda

#define HOT_CUDA_CHECK(expr)                                                                          \
  do {                                                                                                \
    const cudaError_t hot_err_ = (expr);                                                              \
    if (hot_err_ != cudaSuccess) {                                                                    \
      ::hot::cuda::clear_stale_error(); /* reported here: not again by the next launch check */       \
      HOT_FAIL(internal, "CUDA error ", cudaGetErrorName(hot_err_), " (", cudaGetErrorString(hot_err_), \
               ") in ", #expr);                                                                       \
    }                                                                                                 \
  } while (0)

// After every kernel launch: a launch error (bad configuration, missing kernel image) surfaces here.
#define HOT_CUDA_CHECK_LAUNCH() HOT_CUDA_CHECK(cudaGetLastError())

// The dynamic shared memory of a kernel, as a byte array `name`. The host emulation of the kernels
// (cpp/tests/emu/cuda_emu.h, which defines HOT_CUDA_EMULATION) supplies the current block's buffer.
#if defined(HOT_CUDA_EMULATION)
#define HOT_DYNAMIC_SMEM(name) unsigned char* name = ::hot_emu::dynamic_smem()
#else
#define HOT_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace hot::cuda {

inline cudaStream_t to_cuda(Stream s) { return static_cast<cudaStream_t>(s.handle); }

// Makes `device` current for the scope and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    HOT_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) HOT_CUDA_CHECK(cudaSetDevice(device));
    cur_ = device;
  }
  ~DeviceGuard() {
    if (prev_ != cur_ && cudaSetDevice(prev_) != cudaSuccess) clear_stale_error();  // no throw in a destructor
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0, cur_ = 0;
};

// The GEMM implementation chosen for a device: decided in exactly one place (select_gemm_path).
enum class GemmPath { sm90_wgmma, sm80_cutlass, generic };
GemmPath select_gemm_path(int device);
const char* gemm_path_name(GemmPath p);
// Compute capability (major*10+minor) of a device, cached.
int compute_capability(int device);
int sm_count(int device);
// The most shared memory one block may use on a device (cudaDevAttrMaxSharedMemoryPerBlockOptin): 227 KB on
// sm_80 / sm_90, 99 KB on sm_86 / sm_89, 64 KB on sm_75.
int64_t smem_per_block_optin(int device);

// Stream-ordered scratch memory. Every temporary of the backend comes from the device's default
// memory pool through cudaMallocAsync/cudaFreeAsync on the call's stream; the pool's release threshold
// is raised to "keep everything" the first time a device is used, so after the first call a scratch
// allocation is a pool lookup (no cudaMalloc, no synchronisation), and freed blocks are reused by
// later calls on any stream in stream order. Peak scratch of one call is documented at each op. A Scratch of 0
// bytes allocates nothing (get() is null): each pool call costs host time on every layer call.
class Scratch {
 public:
  Scratch(size_t bytes, int device, Stream s);
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  void* get() const { return p_; }
  template <typename T>
  T* as() const { return static_cast<T*>(p_); }

 private:
  void* p_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

// ---- asynchronous global -> shared copies (sm_80+), emulated in cpp/tests/emu ------------------------
// cp_async16 copies 16 bytes (zeros when !valid: nothing is read); the copies of a thread become visible
// to it at cp_async_wait<N>() once at most N of its committed groups are still pending; __syncthreads()
// after the wait makes them visible to the block.
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src, bool valid) {
#if defined(HOT_CUDA_EMULATION)
  ::hot_emu::cp_async16(smem_dst, gmem_src, valid);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(valid ? 16 : 0));
#else
  *static_cast<uint4*>(smem_dst) = valid ? *static_cast<const uint4*>(gmem_src) : make_uint4(0, 0, 0, 0);
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(HOT_CUDA_EMULATION)
  ::hot_emu::cp_async_commit();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(HOT_CUDA_EMULATION)
  ::hot_emu::cp_async_wait(N);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// ---- typed element access (device) -------------------------------------------------------------

template <typename T>
struct FloatIO;
template <>
struct FloatIO<float> {
  static __device__ __forceinline__ float load(const float* p) { return *p; }
  static __device__ __forceinline__ void store(float* p, float v) { *p = v; }
};
template <>
struct FloatIO<__half> {
  static __device__ __forceinline__ float load(const __half* p) { return __half2float(*p); }
  static __device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }
};
template <>
struct FloatIO<__nv_bfloat16> {
  static __device__ __forceinline__ float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
  static __device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
};

template <typename T>
__device__ __forceinline__ float load_f(const T* p) { return FloatIO<T>::load(p); }
// The value of a 16-bit float type T given its bits (not through a pointer cast, which would break C++'s
// aliasing rules: the host build of the kernels in cpp/tests/emu read garbage that way).
template <typename T>
__device__ __forceinline__ float f16bits_to_f(unsigned short u) {
  static_assert(sizeof(T) == 2, "16-bit float types only");
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(__ushort_as_half(u));
  } else {
    return __bfloat162float(__ushort_as_bfloat16(u));
  }
}
template <typename T>
__device__ __forceinline__ void store_f(T* p, float v) { FloatIO<T>::store(p, v); }
// The bits of a and b rounded to the 16-bit float type T (to nearest even, as a cast does), a in the low half.
template <typename T>
__device__ __forceinline__ uint32_t f16x2_bits(float a, float b) {
  static_assert(sizeof(T) == 2, "16-bit float types only");
  uint32_t lo, hi;
  if constexpr (std::is_same_v<T, __half>) {
    lo = __half_as_ushort(__float2half_rn(a)), hi = __half_as_ushort(__float2half_rn(b));
  } else {
    lo = __bfloat16_as_ushort(__float2bfloat16_rn(a)), hi = __bfloat16_as_ushort(__float2bfloat16_rn(b));
  }
  return lo | (hi << 16);
}

// The last step of a bias gradient (bias_grad and the fused g_y pass) and of BatchNorm's sums: out(c, s) with s = the
// sum of partial[k][c] over the nchunks row chunks, in chunk order from +0 (deterministic, the CPU backend's order).
// `out` is a functor; StoreCast<T> stores s cast to T at p[c].
// The sum of one column is a chain of dependent adds, so what bounds the kernel is keeping that chain fed: one CTA
// per kBiasFinalCols columns; warp 0 adds up one round of kBiasFinalRows staged chunks (one column per lane, 8
// shared-memory loads issued ahead of their adds) while warps 1-7 stage the next round into the other buffer
// (coalesced rows of 128 bytes, all of a thread's loads in flight at once). (Staging and adding in turn ran ~10 us per
// ViT-B layer on an H100, for 394 chunks; one thread per column reading its partials in sequence ran on ceil(O / 128)
// SMs: 24-48 us.)
constexpr int kBiasFinalCols = 32, kBiasFinalRows = 128, kBiasFinalThreads = 256;
inline dim3 bias_final_grid(int64_t cols) {
  return dim3(static_cast<unsigned>((cols + kBiasFinalCols - 1) / kBiasFinalCols));
}
template <typename T>
struct StoreCast {
  T* p;
  __device__ void operator()(int64_t c, float s) const { store_f(p + c, s); }
};
template <typename Out>
__global__ void __launch_bounds__(kBiasFinalThreads) bias_final_kernel(const float* partial, int64_t nchunks,
                                                                        int64_t cols, Out out) {
  __shared__ float stage[2][kBiasFinalRows][kBiasFinalCols + 1];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t c = blockIdx.x * static_cast<int64_t>(kBiasFinalCols) + lane;
  const int64_t rounds = (nchunks + kBiasFinalRows - 1) / kBiasFinalRows;
  const auto rows_of = [&](int64_t k) {
    return static_cast<int>(std::min<int64_t>(nchunks - k * kBiasFinalRows, kBiasFinalRows));
  };
  // Rows r0, r0 + STEP, ... of round k into buffer b: every load issued before the first store (a store to shared
  // memory between them would keep the loads one at a time: `partial` might alias it, as far as the compiler knows).
  const auto stage_round = [&](auto step_tag, int64_t k, int b, int r0) {
    constexpr int STEP = decltype(step_tag)::value, N = (kBiasFinalRows + STEP - 1) / STEP;
    const int n = rows_of(k);
    float v[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int r = r0 + i * STEP;
      v[i] = c < cols && r < n ? partial[(k * kBiasFinalRows + r) * cols + c] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (r0 + i * STEP < n) stage[b][r0 + i * STEP][lane] = v[i];
  };
  constexpr int kWarps = kBiasFinalThreads / 32;
  if (rounds > 0) stage_round(std::integral_constant<int, kWarps>{}, 0, 0, warp);
  __syncthreads();
  float s = 0.0f;
  for (int64_t k = 0; k < rounds; ++k) {
    const int b = static_cast<int>(k & 1);
    if (warp != 0) {
      if (k + 1 < rounds) stage_round(std::integral_constant<int, kWarps - 1>{}, k + 1, b ^ 1, warp - 1);
    } else {
      const int n = rows_of(k);
      int r = 0;
      for (; r + 8 <= n; r += 8) {
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = stage[b][r + i][lane];
#pragma unroll
        for (int i = 0; i < 8; ++i) s = __fadd_rn(s, v[i]);
      }
      for (; r < n; ++r) s = __fadd_rn(s, stage[b][r][lane]);
    }
    __syncthreads();  // round k + 1 staged; buffer b free for round k + 2
  }
  if (warp == 0 && c < cols) out(c, s);
}

// Calls f(T{}) with T the C++ type of a float dtype.
template <typename F>
void dispatch_float(DType dt, const char* what, F&& f) {
  switch (dt) {
    case DType::f32: f(float{}); break;
    case DType::f16: f(__half{}); break;
    case DType::bf16: f(__nv_bfloat16{}); break;
    default: HOT_FAIL(internal, what, ": unsupported dtype ", dtype_name(dt));
  }
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
// CUDA's launch limits: grid.x up to 2^31 - 1 blocks, grid.y and grid.z up to 65535.
constexpr int64_t kMaxGridX = 0x7fffffff;
constexpr int64_t kMaxGridYZ = 65535;

inline bool fits_int32(int64_t v) { return v >= 0 && v <= 0x7fffffff; }

inline unsigned grid_1d(int64_t n, int threads, int64_t cap = 65535LL * 32) {
  int64_t g = ceil_div(n, threads);
  if (g < 1) g = 1;
  if (g > cap) g = cap;
  return static_cast<unsigned>(g);
}

// Packs the column count, row stride and data of a row-major 2-D view.
template <typename T>
struct Mat {
  T* p;
  int64_t rows, cols, ld;
};
template <typename T>
inline Mat<T> mat(const TensorView& v) {
  return Mat<T>{static_cast<T*>(v.data), v.shape[0], v.ndim() > 1 ? v.shape[1] : 1,
                v.ndim() > 1 ? v.strides[0] : v.shape[0]};
}

#if !defined(HOT_CUDA_EMULATION)
// Launches kernels on one stream: the launcher interface of the launch sequences in qgo_kernels.cuh,
// weight_kernels.cuh, basic_kernels.cuh and generic_gemm_kernels.cuh (the host emulation in cpp/tests/emu supplies
// its own, hot_emu::Launch).
struct StreamLaunch {
  cudaStream_t s;
  template <typename... KArgs, typename... Args>
  void operator()(void (*kernel)(KArgs...), dim3 grid, int threads, size_t smem, Args&&... args) const {
    clear_stale_error();
    kernel<<<grid, threads, smem, s>>>(std::forward<Args>(args)...);
    HOT_CUDA_CHECK_LAUNCH();
  }
  void zero(void* p, size_t bytes) const { HOT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, s)); }
};
#endif

// Internal entry points shared between translation units.
// Generic (any arch) exact s8 x s8 -> s32 GEMM, TN layout; used for K not a multiple of 16 and for
// GPUs without a tensor-core path.
void gemm_s8_generic(const Mat<const int8_t>& a, const Mat<const int8_t>& b, const Mat<int32_t>& c, cudaStream_t s);
// Generic fused dequant GEMM: out = float(acc) * sa[m | 0] * sb[0] * factor.
void gemm_s8_dequant_generic(const TensorView& a, const TensorView& b, const TensorView& sa, const TensorView& sb,
                             float factor, const TensorView& out, cudaStream_t s);

#if defined(HOT_CUDA_HAS_SM90A)
// CUTLASS 3.x warp-specialised wgmma kernels (gemm_sm90.cu). Return false when the problem does not
// meet the kernel's requirements (the caller then uses another path).
bool sm90_gemm_s8s8s32(const TensorView& a, const TensorView& b, const TensorView& c, int device, cudaStream_t s);
bool sm90_gemm_s8_dequant(const TensorView& a, const TensorView& b, const TensorView& sa, const TensorView& sb,
                          float factor, const TensorView& out, int device, cudaStream_t s);
#endif
#if defined(HOT_CUDA_HAS_SM80)
// CUTLASS 2.x tensor-core kernels for sm_80/86/89 (gemm_sm80.cu): packed s4 and s8, s32 output.
bool sm80_gemm_s4s4s32(const TensorView& a, const TensorView& b, const TensorView& c, int device, cudaStream_t s);
bool sm80_gemm_s8s8s32(const TensorView& a, const TensorView& b, const TensorView& c, int device, cudaStream_t s);
#endif

}  // namespace hot::cuda
