// The HOT layer operations of the CUDA backend: the fused pass over g_y (quantize_grad_output) and the
// ABC buffer (compress_activation), whose kernels live in qgo_kernels.cuh, the quantised transposed weight
// (quantize_weight, weight_kernels.cuh) and a convolution's ABC buffer from its int8 map (compress_columns,
// columns_kernels.cuh).
#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "columns_kernels.cuh"
#include "qgo_kernels.cuh"
#include "weight_kernels.cuh"

namespace hot::cuda {

namespace {

// One-time setup, per device, of the kernels of one input type and rank R: the dynamic shared memory they may need
// (cudaFuncSetAttribute applies to the current device only, so a process that uses several GPUs must set it on each;
// qgo_setup has checked that the device allows it).
template <typename T, int R>
struct QgoKernels {
  QgoKernels() {
    const int smem = static_cast<int>(qgo_smem_bytes());
    HOT_CUDA_CHECK(cudaFuncSetAttribute(qgo_kernel<T, 1, R>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    HOT_CUDA_CHECK(cudaFuncSetAttribute(qgo_kernel<T, 2, R>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    HOT_CUDA_CHECK(cudaFuncSetAttribute(qgo_kernel<T, 2, R, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    if constexpr (sizeof(T) == 2) {
      HOT_CUDA_CHECK(cudaFuncSetAttribute(qgo16_kernel<T, 1, R>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(qgo16_smem_bytes(1))));
      HOT_CUDA_CHECK(cudaFuncSetAttribute(qgo16_kernel<T, 1, R, false, float>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(qgo16_smem_bytes(1))));
      HOT_CUDA_CHECK(cudaFuncSetAttribute(qgo16_kernel<T, 2, R>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(qgo16_smem_bytes(2))));
      HOT_CUDA_CHECK(cudaFuncSetAttribute(qgo16_kernel<T, 2, R, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(qgo16_smem_bytes(2))));
    }
  }
  // Sets up `device`, which must be the current device (run_qgo's DeviceGuard), once.
  static void ensure(int device) {
    static std::mutex m;
    static std::map<int, std::unique_ptr<const QgoKernels>> per_device;
    const std::lock_guard<std::mutex> lock(m);
    std::unique_ptr<const QgoKernels>& k = per_device[device];
    if (!k) k = std::make_unique<const QgoKernels>();  // if this throws, the next call tries again
  }
};

// The shared implementation of quantize_grad_output, compress_activation and (with cast_from, the float input gy is
// the cast of) compress_activation_cast.
void run_qgo(const TensorView& gy, const GradOutputPlan& plan, const GradOutputQuant& out, Stream st,
             const TensorView* cast_from = nullptr) {
  const int dev = gy.device.index;
  DeviceGuard dg(dev);
  QgoSetup su = qgo_setup(gy, plan, out, smem_per_block_optin(dev));
  Scratch scratch(su.scratch_bytes(), dev, st);
  su.bind_scratch(scratch.get());
  const StreamLaunch launch{to_cuda(st)};
  const float* cast_src = cast_from != nullptr ? qgo_cast_or_bind(su, *cast_from, gy, launch) : nullptr;
  dispatch_float(gy.dtype, "quantize_grad_output", [&](auto t) {
    using T = decltype(t);
    // Only the instantiation this call launches is set up.
    with_rank(su.fixed_rank, [&](auto r) { QgoKernels<T, decltype(r)::value>::ensure(dev); });
    qgo_launch<T>(su, plan, out, static_cast<const T*>(gy.data), launch, cast_src);
  });
}

}  // namespace

bool set_qgo_fixed_rank(bool on) { return g_qgo_fixed_rank.exchange(on); }

void quantize_grad_output(const TensorView& gy, const GradOutputPlan& plan, const GradOutputQuant& out, Stream st) {
  run_qgo(gy, plan, out, st);
}

void compress_activation(const TensorView& x, const TensorView& q_t, const TensorView& scale, int rank, Stream st) {
  GradOutputQuant out;
  out.q_gh_t = q_t;
  out.s_gh = scale;
  run_qgo(x, abc_plan(rank), out, st);
}

void activation_codes(const TensorView& x, const TensorView& q_t, const TensorView& scale, const TensorView* amax,
                      Stream st) {
  GradOutputQuant out;
  out.q_gh_t = q_t;
  out.s_gh = scale;
  run_qgo(x, abc_plan(16, true, amax != nullptr ? static_cast<const unsigned*>(amax->data) : nullptr), out, st);
}

void compress_activation_cast(const TensorView& x, const TensorView& x_cast, const TensorView& q_t,
                              const TensorView& scale, int rank, Stream st) {
  GradOutputQuant out;
  out.q_gh_t = q_t;
  out.s_gh = scale;
  run_qgo(x_cast, abc_plan(rank), out, st, &x);
}

void quantize_weight(const TensorView& w, const TensorView& q_wt, const TensorView& s_w, int bits, int block,
                     Stream st) {
  const int dev = w.device.index;
  DeviceGuard dg(dev);
  Scratch key(4, dev, st);
  dispatch_float(w.dtype, "quantize_weight", [&](auto t) {
    weight_launch<decltype(t)>(w, q_wt, s_w, bits, block, key.as<unsigned>(), StreamLaunch{to_cuda(st)});
  });
}

void compress_columns(const TensorView& map, const ConvGeometry& g, const TensorView& q_t, const TensorView& scale,
                      int rank, Stream st) {
  const int dev = map.device.index;
  DeviceGuard dg(dev);
  Scratch key(4, dev, st);
  compress_columns_launch(map, g, q_t, scale, rank, key.as<unsigned>(), StreamLaunch{to_cuda(st)});
}

void im2col_t(const TensorView& map, const ConvGeometry& g, const TensorView& cols_t, Stream st) {
  const int dev = map.device.index;
  DeviceGuard dg(dev);
  Scratch map_t(im2col_t_scratch_bytes(map, g, cols_t), dev, st);
  im2col_t_launch(map, g, cols_t, StreamLaunch{to_cuda(st)}, map_t.as<int8_t>());
}

}  // namespace hot::cuda

