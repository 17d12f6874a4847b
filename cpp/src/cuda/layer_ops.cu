// The HOT layer operations of the CUDA backend: the fused pass over g_y (quantize_grad_output) and the
// ABC buffer (compress_activation), whose kernels live in qgo_kernels.cuh, and the quantised transposed
// weight (quantize_weight).
#include <algorithm>
#include <utility>

#include "qgo_kernels.cuh"

namespace hot::cuda {

namespace {

// Launches kernels on one stream (the interface qgo_launch expects).
struct StreamLaunch {
  cudaStream_t s;
  template <typename... KArgs, typename... Args>
  void operator()(void (*kernel)(KArgs...), dim3 grid, int threads, size_t smem, Args&&... args) const {
    kernel<<<grid, threads, smem, s>>>(std::forward<Args>(args)...);
    HOT_CUDA_CHECK_LAUNCH();
  }
  void zero(void* p, size_t bytes) const { HOT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, s)); }
};

// The shared implementation of quantize_grad_output and compress_activation.
void run_qgo(const TensorView& gy, const GradOutputPlan& plan, const GradOutputQuant& out, Stream st) {
  const int dev = gy.device.index;
  DeviceGuard dg(dev);
  QgoSetup su = qgo_setup(gy, plan, out);
  su.ctas[0] = 3 * static_cast<int64_t>(sm_count(dev));  // the kernels' __launch_bounds__ residency
  su.ctas[1] = 2 * static_cast<int64_t>(sm_count(dev));
  Scratch scratch(su.scratch_bytes(), dev, st);
  su.bind_scratch(scratch.get());
  const StreamLaunch launch{to_cuda(st)};
  dispatch_float(gy.dtype, "quantize_grad_output", [&](auto t) {
    using T = decltype(t);
    static bool attr_set = false;  // per instantiation (and process; one attribute value for all devices)
    if (!attr_set) {
      const int smem = static_cast<int>(qgo_smem_bytes());
      HOT_CUDA_CHECK(cudaFuncSetAttribute(qgo_kernel<T, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      HOT_CUDA_CHECK(cudaFuncSetAttribute(qgo_kernel<T, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      if constexpr (sizeof(T) == 2) {
        HOT_CUDA_CHECK(cudaFuncSetAttribute(qgo16_kernel<T, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(qgo16_smem_bytes(1))));
        HOT_CUDA_CHECK(cudaFuncSetAttribute(qgo16_kernel<T, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(qgo16_smem_bytes(2))));
      }
      attr_set = true;
    }
    qgo_launch<T>(su, plan, out, static_cast<const T*>(gy.data), launch);
  });
}

// ---- quantize_weight ---------------------------------------------------------------------------------
// W~ = blockdiag(H_b) W (groups of b rows, per column), RTN per tensor, written transposed (I x O_pad).
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

// Tiled: a CTA quantises rows [o0, o0 + 64) x columns [i0, i0 + 64) of W~, stages the bytes transposed
// in shared memory and writes 64 contiguous bytes per row of q_wt (full sectors, no partial writes).
constexpr int kWT = 64;
template <int B, typename T>
__global__ void __launch_bounds__(256) weight_quant_kernel(Mat<const T> w, const unsigned* key, int qmax, float* s_w,
                                                           Mat<int8_t> qt) {
  __shared__ __align__(4) uint8_t tile[kWT][kWT + 4];
  const QuantScale qs = quant_scale_from_amax(amax_from_key(*key), qmax);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *s_w = qs.scale;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kWT, o0 = static_cast<int64_t>(blockIdx.y) * kWT;
  constexpr int kGroups = kWT / B;
  for (int v = threadIdx.x; v < kGroups * kWT; v += 256) {
    const int il = v % kWT, gl = v / kWT;
    const int64_t i = i0 + il, ob = o0 + static_cast<int64_t>(gl) * B;
    float x[B];
    if (i < w.cols && ob < w.rows) {
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
  const int64_t ncols = std::min<int64_t>(kWT, w.rows - o0);  // valid o in this tile
  const bool words = ncols == kWT && (qt.ld % 4) == 0 && (reinterpret_cast<uintptr_t>(qt.p) % 4) == 0;
  if (words) {
    for (int v = threadIdx.x; v < kWT * (kWT / 4); v += 256) {
      const int row = v / (kWT / 4), wd = v % (kWT / 4);
      if (i0 + row < w.cols)
        *reinterpret_cast<uint32_t*>(qt.p + (i0 + row) * qt.ld + o0 + 4 * wd) =
            *reinterpret_cast<const uint32_t*>(&tile[row][4 * wd]);
    }
  } else {
    for (int v = threadIdx.x; v < kWT * kWT; v += 256) {
      const int row = v / kWT, c = v % kWT;
      if (i0 + row < w.cols && c < ncols) qt.p[(i0 + row) * qt.ld + o0 + c] = static_cast<int8_t>(tile[row][c]);
    }
  }
}

}  // namespace

int set_qgo_variant(int variant) {
  HOT_CHECK_VALUE(variant >= 5 && variant <= 7, "set_qgo_variant: variant must be 5, 6 or 7, got ", variant);
  return g_qgo_variant.exchange(variant);
}

void quantize_grad_output(const TensorView& gy, const GradOutputPlan& plan, const GradOutputQuant& out, Stream st) {
  run_qgo(gy, plan, out, st);
}

void compress_activation(const TensorView& x, const TensorView& q_t, const TensorView& scale, int rank, Stream st) {
  GradOutputQuant out;
  out.q_gh_t = q_t;
  out.s_gh = scale;
  run_qgo(x, abc_plan(rank), out, st);
}

void quantize_weight(const TensorView& w, const TensorView& q_wt, const TensorView& s_w, int bits, int block,
                     Stream st) {
  const int dev = w.device.index;
  DeviceGuard dg(dev);
  const cudaStream_t s = to_cuda(st);
  const int64_t O = w.shape[0], I = w.shape[1];
  const int64_t O_pad = q_wt.shape[1];
  const int qmax = qmax_for_bits(bits);
  Scratch key(4, dev, st);
  HOT_CUDA_CHECK(cudaMemsetAsync(key.get(), 0, 4, s));
  if (O_pad > O) {
    HOT_CUDA_CHECK(cudaMemset2DAsync(static_cast<int8_t*>(q_wt.data) + O, static_cast<size_t>(q_wt.strides[0]), 0,
                                     static_cast<size_t>(O_pad - O), static_cast<size_t>(I), s));
  }
  const int64_t nvec = O / block * I;
  HOT_CHECK_VALUE(ceil_div(O, kWT) < 65536, "quantize_weight: too many rows (", O, ")");
  const dim3 qgrid(static_cast<unsigned>(ceil_div(I, kWT)), static_cast<unsigned>(ceil_div(O, kWT)));
  dispatch_float(w.dtype, "quantize_weight", [&](auto t) {
    using T = decltype(t);
    const Mat<const T> mw = mat<const T>(w);
    switch (block) {
#define HOT_QW(B)                                                                                              \
  case B:                                                                                                      \
    weight_amax_kernel<B, T><<<grid_1d(nvec, 256, 2048), 256, 0, s>>>(mw, key.as<unsigned>());                 \
    HOT_CUDA_CHECK_LAUNCH();                                                                                   \
    weight_quant_kernel<B, T><<<qgrid, 256, 0, s>>>(mw, key.as<unsigned>(), qmax, static_cast<float*>(s_w.data), \
                                                   mat<int8_t>(q_wt));                                          \
    HOT_CUDA_CHECK_LAUNCH();                                                                                   \
    break;
      HOT_QW(1) HOT_QW(2) HOT_QW(4) HOT_QW(8) HOT_QW(16)
#undef HOT_QW
      default: HOT_FAIL(internal, "quantize_weight: unsupported block ", block);
    }
  });
}

}  // namespace hot::cuda

