// Building-block operations of the CUDA backend: Hadamard transform, HLA projection, quantise /
// dequantise, int4 packing, im2col, col2im, the ReLU's mask and the bias gradient. The kernels and launch sequences are in basic_kernels.cuh;
// here each operation takes the inputs' device, its scratch (stream-ordered) and the caller's stream.
#include "basic_kernels.cuh"

namespace hot::cuda {

void bias_grad(const TensorView& gy, const TensorView& out, Stream st) {
  DeviceGuard dg(gy.device.index);
  Scratch partial(bias_partial_bytes(gy), gy.device.index, st);
  bias_grad_launch(gy, out, partial.as<float>(), StreamLaunch{to_cuda(st)});
}

void hadamard_transform(const TensorView& in, const TensorView& out, int block, int axis, Stream st) {
  DeviceGuard dg(in.device.index);
  dispatch_float(in.dtype, "hadamard_transform",
                 [&](auto t) { hadamard_launch<decltype(t)>(in, out, block, axis, StreamLaunch{to_cuda(st)}); });
}

void hla_project(const TensorView& in, const TensorView& out, int rank, Stream st) {
  DeviceGuard dg(in.device.index);
  dispatch_float(in.dtype, "hla_project",
                 [&](auto t) { hla_launch<decltype(t)>(in, out, rank, StreamLaunch{to_cuda(st)}); });
}

void quantize(const TensorView& in, const TensorView& q, const TensorView& scale, const QuantizeParams& p,
              const TensorView* amax, Stream st) {
  const int dev = in.device.index;
  DeviceGuard dg(dev);
  Scratch scratch(quantize_scratch_bytes(in, p), dev, st);
  const unsigned* key = amax != nullptr ? static_cast<const unsigned*>(amax->data) : nullptr;
  dispatch_float(in.dtype, "quantize", [&](auto t) {
    quantize_launch<decltype(t)>(in, q, scale, p, scratch.get(), StreamLaunch{to_cuda(st)}, key);
  });
}

void dequantize(const TensorView& q, const TensorView& scale, const TensorView& out, Stream st) {
  DeviceGuard dg(q.device.index);
  dispatch_float(out.dtype, "dequantize",
                 [&](auto t) { dequantize_launch<decltype(t)>(q, scale, out, StreamLaunch{to_cuda(st)}); });
}

void col2im(const TensorView& cols, const ConvGeometry& g, const TensorView& out, Stream st) {
  DeviceGuard dg(cols.device.index);
  dispatch_float(cols.dtype, "col2im",
                 [&](auto t) { col2im_launch<decltype(t)>(cols, g, out, StreamLaunch{to_cuda(st)}); });
}

void im2col(const TensorView& map, const ConvGeometry& g, const TensorView& cols, Stream st) {
  DeviceGuard dg(map.device.index);
  im2col_launch(map, g, cols, StreamLaunch{to_cuda(st)});
}

void transpose(const TensorView& in, const TensorView& out, Stream st) {
  DeviceGuard dg(in.device.index);
  transpose_launch(in, out, StreamLaunch{to_cuda(st)});
}

void relu_mask(const TensorView& x, const TensorView& y, const TensorView& bits, const TensorView* amax, Stream st) {
  DeviceGuard dg(x.device.index);
  unsigned* key = amax != nullptr ? static_cast<unsigned*>(amax->data) : nullptr;  // y's amax as its bits
  relu_mask_launch(x, y, bits, StreamLaunch{to_cuda(st)}, key);
}

void batch_norm_stats(const TensorView& x, const TensorView& mean, const TensorView& invstd, float eps,
                      const TensorView* running_mean, const TensorView* running_var, float momentum, Stream st) {
  DeviceGuard dg(x.device.index);
  Scratch partial(bn_stats_scratch_bytes(x), x.device.index, st);
  dispatch_float(x.dtype, "batch_norm_stats", [&](auto t) {
    bn_stats_launch<decltype(t)>(x, mean, invstd, eps, running_mean, running_var, momentum, partial.as<float>(),
                                 StreamLaunch{to_cuda(st)});
  });
}

void batch_norm_transform(const TensorView& x, const TensorView& mean, const TensorView& invstd,
                          const TensorView* weight, const TensorView* bias, const TensorView& y, Stream st) {
  DeviceGuard dg(x.device.index);
  dispatch_float(x.dtype, "batch_norm_transform", [&](auto t) {
    bn_transform_launch<decltype(t)>(x, mean, invstd, weight, bias, y, StreamLaunch{to_cuda(st)});
  });
}

void batch_norm_backward_reduce(const TensorView& gy, const TensorView& x, const TensorView& mean,
                                const TensorView& invstd, const TensorView& sum_dy, const TensorView& sum_dy_xmu,
                                const TensorView* grad_weight, const TensorView* relu_bits, const TensorView* g_relu,
                                Stream st) {
  DeviceGuard dg(gy.device.index);
  Scratch partial(bn_reduce_partial_bytes(gy), gy.device.index, st);
  dispatch_float(gy.dtype, "batch_norm_backward_reduce", [&](auto t) {
    bn_reduce_launch<decltype(t)>(gy, x, mean, invstd, sum_dy, sum_dy_xmu, grad_weight, relu_bits, g_relu,
                                  partial.as<float>(), StreamLaunch{to_cuda(st)});
  });
}

void batch_norm_backward_input(const TensorView& gy, const TensorView& x, const TensorView& mean,
                               const TensorView& invstd, const TensorView* weight, const TensorView& sum_dy,
                               const TensorView& sum_dy_xmu, const TensorView& gx, const TensorView& amax, Stream st) {
  DeviceGuard dg(gy.device.index);
  dispatch_float(gy.dtype, "batch_norm_backward_input", [&](auto t) {
    bn_backward_input_launch<decltype(t)>(gy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, gx,
                                          static_cast<unsigned*>(amax.data), StreamLaunch{to_cuda(st)});
  });
}

void relu_mask_backward(const TensorView& gy, const TensorView& bits, const TensorView& gx, Stream st) {
  DeviceGuard dg(gy.device.index);
  relu_mask_backward_launch(gy, bits, gx, StreamLaunch{to_cuda(st)});
}

void max_pool2d_offsets(const TensorView& x, const ConvGeometry& g, const TensorView& y, const TensorView& off,
                        Stream st) {
  DeviceGuard dg(x.device.index);
  max_pool_offsets_launch(x, g, y, off, StreamLaunch{to_cuda(st)});
}

void max_pool2d_offsets_backward(const TensorView& gy, const TensorView& off, const ConvGeometry& g,
                                 const TensorView& gx, Stream st) {
  DeviceGuard dg(gy.device.index);
  max_pool_offsets_backward_launch(gy, off, g, gx, StreamLaunch{to_cuda(st)});
}

void pack_int4(const TensorView& q, const TensorView& packed, Stream st) {
  DeviceGuard dg(q.device.index);
  pack_int4_launch(q, packed, StreamLaunch{to_cuda(st)});
}

void unpack_int4(const TensorView& packed, const TensorView& q, Stream st) {
  DeviceGuard dg(q.device.index);
  unpack_int4_launch(packed, q, StreamLaunch{to_cuda(st)});
}

}  // namespace hot::cuda
