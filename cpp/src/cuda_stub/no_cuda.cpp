// The CUDA backend when hot is built without CUDA: every entry point says clearly that it is missing.
#include "backend.h"
#include "hot/error.h"

#ifndef HOT_NO_CUDA_REASON
#define HOT_NO_CUDA_REASON "hot was built without the CUDA backend"
#endif

namespace hot::cuda {

namespace {
[[noreturn]] void missing() {
  HOT_FAIL(unavailable, "CUDA tensors given, but the CUDA backend is not compiled in (", HOT_NO_CUDA_REASON,
           "); rebuild with a CUDA toolkit (HOT_CUDA=ON)");
}
}  // namespace

bool available() { return false; }
std::string unavailable_reason() { return HOT_NO_CUDA_REASON; }
std::string build_info() { return std::string("cuda: not compiled in (") + HOT_NO_CUDA_REASON + ")"; }
void* allocate(size_t, int, Stream) { missing(); }
void deallocate(void*, int, Stream) {}
void memset_zero(void*, size_t, int, Stream) { missing(); }
void stream_order(int, Stream, Stream) { missing(); }

void hadamard_transform(const TensorView&, const TensorView&, int, int, Stream) { missing(); }
void hla_project(const TensorView&, const TensorView&, int, Stream) { missing(); }
void quantize(const TensorView&, const TensorView&, const TensorView&, const QuantizeParams&, const TensorView*,
              Stream) {
  missing();
}
void dequantize(const TensorView&, const TensorView&, const TensorView&, Stream) { missing(); }
void col2im(const TensorView&, const ConvGeometry&, const TensorView&, Stream) { missing(); }
void conv_grad_input(const TensorView&, const TensorView&, const TensorView&, const TensorView&, float,
                     const ConvGeometry&, const TensorView&, Stream) {
  missing();
}
void im2col(const TensorView&, const ConvGeometry&, const TensorView&, Stream) { missing(); }
void im2col_t(const TensorView&, const ConvGeometry&, const TensorView&, Stream) { missing(); }
void compress_columns(const TensorView&, const ConvGeometry&, const TensorView&, const TensorView&, int, Stream) {
  missing();
}
void transpose(const TensorView&, const TensorView&, Stream) { missing(); }
void relu_mask(const TensorView&, const TensorView&, const TensorView&, const TensorView*, Stream) { missing(); }
void relu_mask_backward(const TensorView&, const TensorView&, const TensorView&, Stream) { missing(); }
void batch_norm_stats(const TensorView&, const TensorView&, const TensorView&, float, const TensorView*,
                      const TensorView*, float, Stream) {
  missing();
}
void batch_norm_transform(const TensorView&, const TensorView&, const TensorView&, const TensorView*,
                          const TensorView*, const TensorView&, Stream) {
  missing();
}
void batch_norm_backward_reduce(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                                const TensorView&, const TensorView&, const TensorView*, const TensorView*,
                                const TensorView*, Stream) {
  missing();
}
void batch_norm_backward_input(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                               const TensorView*, const TensorView&, const TensorView&, const TensorView&,
                               const TensorView&, Stream) {
  missing();
}
void max_pool2d_offsets(const TensorView&, const ConvGeometry&, const TensorView&, const TensorView&, Stream) {
  missing();
}
void max_pool2d_offsets_backward(const TensorView&, const TensorView&, const ConvGeometry&, const TensorView&, Stream) {
  missing();
}
void pack_int4(const TensorView&, const TensorView&, Stream) { missing(); }
void unpack_int4(const TensorView&, const TensorView&, Stream) { missing(); }
void gemm_s8s8s32(const TensorView&, const TensorView&, const TensorView&, Stream) { missing(); }
void gemm_s4s4s32(const TensorView&, const TensorView&, const TensorView&, Stream) { missing(); }
void compress_activation(const TensorView&, const TensorView&, const TensorView&, int, Stream) { missing(); }
void activation_codes(const TensorView&, const TensorView&, const TensorView&, const TensorView*, Stream) {
  missing();
}
void compress_activation_cast(const TensorView&, const TensorView&, const TensorView&, const TensorView&, int, Stream) {
  missing();
}
void quantize_grad_output(const TensorView&, const GradOutputPlan&, const GradOutputQuant&, Stream) { missing(); }
void quantize_weight(const TensorView&, const TensorView&, const TensorView&, int, int, Stream) { missing(); }
void gemm_s8_dequant(const TensorView&, const TensorView&, const TensorView&, const TensorView&, float, int,
                     const TensorView&, Stream) {
  missing();
}
void bias_grad(const TensorView&, const TensorView&, Stream) { missing(); }
void matmul_exact(const TensorView&, bool, const TensorView&, bool, const TensorView&, Stream) { missing(); }

}  // namespace hot::cuda
