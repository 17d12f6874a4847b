// Elementwise fp32 accumulation and rounding of the CUDA backend: the sum of the row chunks of a long g_w contraction
// (hot::backward_linear, SPEC §4 "Long contractions"). One IEEE fp32 addition per element and chunk, in chunk order,
// and one round-to-nearest-even conversion, as the CPU backend does (cpu/ops_cpu.cpp).
#include "common.cuh"

namespace hot::cuda {

namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void accumulate_f32_kernel(Mat<const T> in, Mat<float> acc) {
  const int64_t n = in.rows * in.cols;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / in.cols, c = e % in.cols;
    float* a = acc.p + r * acc.ld + c;
    *a = __fadd_rn(*a, load_f(in.p + r * in.ld + c));
  }
}

template <typename T>
__global__ void round_f32_kernel(Mat<const float> in, Mat<T> out) {
  const int64_t n = in.rows * in.cols;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / in.cols, c = e % in.cols;
    store_f(out.p + r * out.ld + c, in.p[r * in.ld + c]);
  }
}

}  // namespace

void accumulate_f32(const TensorView& in, const TensorView& acc, Stream st) {
  DeviceGuard dg(in.device.index);
  dispatch_float(in.dtype, "accumulate_f32", [&](auto t) {
    using T = decltype(t);
    StreamLaunch{to_cuda(st)}(accumulate_f32_kernel<T>, dim3(grid_1d(in.numel(), kThreads)), kThreads, 0,
                              mat<const T>(in), mat<float>(acc));
  });
}

void cast_f32(const TensorView& in, const TensorView& out, Stream st) {
  DeviceGuard dg(in.device.index);
  dispatch_float(out.dtype, "cast_f32", [&](auto t) {
    using T = decltype(t);
    StreamLaunch{to_cuda(st)}(round_f32_kernel<T>, dim3(grid_1d(in.numel(), kThreads)), kThreads, 0,
                              mat<const float>(in), mat<T>(out));
  });
}

}  // namespace hot::cuda
