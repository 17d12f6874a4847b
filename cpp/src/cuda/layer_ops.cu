// The HOT layer operations of the CUDA backend: the fused pass over g_y (quantize_grad_output) and the
// ABC buffer (compress_activation), whose kernels live in qgo_kernels.cuh, and the quantised transposed
// weight (quantize_weight, weight_kernels.cuh).
#include <algorithm>
#include <utility>

#include "qgo_kernels.cuh"
#include "weight_kernels.cuh"

namespace hot::cuda {

namespace {

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
  Scratch key(4, dev, st);
  dispatch_float(w.dtype, "quantize_weight", [&](auto t) {
    weight_launch<decltype(t)>(w, q_wt, s_w, bits, block, key.as<unsigned>(), StreamLaunch{to_cuda(st)});
  });
}

}  // namespace hot::cuda

