// The registration units of the pybind11 module hot._C, one per area (module.cpp calls each), and the helpers they
// share.
#pragma once

#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "hot/error.h"
#include "hot/ops.h"
#include "hot/tensor.h"
#include "interop.h"

namespace hotpy {

void register_config(pybind11::module_& m);  // hot._C.Config: the core's hot::Config (config.cpp)
void register_blocks(pybind11::module_& m);  // the building blocks: transforms, quantisers, GEMMs (blocks.cpp)
void register_layers(pybind11::module_& m);  // SavedActivation, compress_activation, backward_linear (layers.cpp)

inline hot::DType parse_float_dtype(const std::string& s, const char* op) {
  if (s == "float32") return hot::DType::f32;
  if (s == "float16") return hot::DType::f16;
  if (s == "bfloat16") return hot::DType::bf16;
  HOT_FAIL(type, op, ": dtype must be float32, float16 or bfloat16, got ", s);
}

// An output: the caller's array (written in place; returns None) or, for None, a new hot::Tensor of
// `dtype` and `shape` on the operation's device (returned as an Array).
inline pybind11::object output(OpContext& ctx, pybind11::handle obj, const char* name, DTypeMask allowed,
                               hot::DType dtype, const hot::Shape& shape, hot::TensorView& view, int split = -1) {
  if (!obj.is_none()) {
    view = ctx.output(obj, name, allowed, split);
    return pybind11::none();
  }
  HOT_INTERNAL_CHECK(ctx.has_device(), "an output is allocated before any input fixed the device");
  hot::Tensor t = hot::Tensor::empty(dtype, shape, ctx.device(), ctx.stream());
  view = t.view();
  return pybind11::cast(Array(std::move(t), ctx.stream_handle()));
}

inline hot::TensorView nonempty(const hot::TensorView& v, const char* op, const char* name) {
  HOT_CHECK_NONEMPTY(op, name, v);
  return v;
}

// The ConvGeometry of the convolution operations from the Python arguments (the core checks the values).
inline hot::ConvGeometry geometry(const char* op, const std::vector<int64_t>& nchw, const std::vector<int>& kernel,
                                  const std::vector<int>& stride, const std::vector<int>& padding,
                                  const std::vector<int>& dilation, bool patches) {
  const auto pair = [op](const std::vector<int>& v, const char* name) {
    HOT_CHECK_VALUE(v.size() == 2, op, ": ", name, " needs 2 values (height, width), got ", v.size());
  };
  HOT_CHECK_VALUE(nchw.size() == 4, op, ": x_shape needs 4 values (N, C, H, W), got ", nchw.size());
  pair(kernel, "kernel"), pair(stride, "stride"), pair(padding, "padding"), pair(dilation, "dilation");
  hot::ConvGeometry g;
  g.N = nchw[0], g.C = nchw[1], g.H = nchw[2], g.W = nchw[3];
  g.kh = kernel[0], g.kw = kernel[1], g.sh = stride[0], g.sw = stride[1];
  g.ph = padding[0], g.pw = padding[1], g.dh = dilation[0], g.dw = dilation[1];
  g.patches = patches;
  return g;
}

}  // namespace hotpy
