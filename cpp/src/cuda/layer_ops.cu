// The HOT layer operations of the CUDA backend: the fused pass over g_y (quantize_grad_output) and the
// ABC buffer (compress_activation), whose kernels live in qgo_kernels.cuh, and the quantised transposed
// weight (quantize_weight, weight_kernels.cuh).
#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>

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
    if constexpr (std::is_same_v<T, float>) {  // the im2col source's ABC pass runs on the same fp32 tile
      HOT_CUDA_CHECK(cudaFuncSetAttribute(qgo_im2col_kernel<1, R>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      HOT_CUDA_CHECK(cudaFuncSetAttribute(qgo_im2col_kernel<2, R>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    if constexpr (sizeof(T) == 2) {
      HOT_CUDA_CHECK(cudaFuncSetAttribute(qgo16_kernel<T, 1, R>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(qgo16_smem_bytes(1))));
      HOT_CUDA_CHECK(cudaFuncSetAttribute(qgo16_kernel<T, 2, R>, cudaFuncAttributeMaxDynamicSharedMemorySize,
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

template <int R>
void ensure_f32_kernels(int dev) {
  QgoKernels<float, R>::ensure(dev);
}

// The shared implementation of quantize_grad_output and compress_activation.
void run_qgo(const TensorView& gy, const GradOutputPlan& plan, const GradOutputQuant& out, Stream st) {
  const int dev = gy.device.index;
  DeviceGuard dg(dev);
  QgoSetup su = qgo_setup(gy, plan, out, smem_per_block_optin(dev));
  Scratch scratch(su.scratch_bytes(), dev, st);
  su.bind_scratch(scratch.get());
  const StreamLaunch launch{to_cuda(st)};
  dispatch_float(gy.dtype, "quantize_grad_output", [&](auto t) {
    using T = decltype(t);
    // Only the instantiation this call launches is set up.
    if (su.fixed_rank == 8) {
      QgoKernels<T, 8>::ensure(dev);
    } else if (su.fixed_rank == 16) {
      QgoKernels<T, 16>::ensure(dev);
    } else {
      QgoKernels<T, 0>::ensure(dev);
    }
    qgo_launch<T>(su, plan, out, static_cast<const T*>(gy.data), launch);
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

void compress_im2col(const Im2colSource& src, int64_t r0, int64_t r1, const TensorView& q_t, const TensorView& scale,
                     int rank, Stream st) {
  const int dev = src.q_map.device.index;
  DeviceGuard dg(dev);
  const ConvParams conv = conv_params(src.geometry);
  // The plan and scratch of compress_activation over an (r1 - r0) x I fp32 matrix; no matrix exists, so no vector
  // loads (the im2col kernel gathers its tile element by element).
  const TensorView shape_only =
      make_view(nullptr, DType::f32, src.q_map.device, {r1 - r0, static_cast<int64_t>(conv.kh) * conv.kw * conv.C});
  GradOutputQuant out;
  out.q_gh_t = q_t;
  out.s_gh = scale;
  const GradOutputPlan plan = abc_plan(rank);
  QgoSetup su = qgo_setup(shape_only, plan, out, smem_per_block_optin(dev));
  su.p.vec_load = false;
  su.raw16 = false;
  Scratch scratch(su.scratch_bytes(), dev, st);
  su.bind_scratch(scratch.get());
  if (su.fixed_rank == 8) {
    ensure_f32_kernels<8>(dev);
  } else if (su.fixed_rank == 16) {
    ensure_f32_kernels<16>(dev);
  } else {
    ensure_f32_kernels<0>(dev);
  }
  const Im2colS8Src s{static_cast<const int8_t*>(src.q_map.data), static_cast<const float*>(src.scale.data), conv, r0};
  qgo_launch<float>(su, plan, out, s, StreamLaunch{to_cuda(st)});
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

