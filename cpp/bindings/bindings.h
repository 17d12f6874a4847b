// The registration units of the pybind11 module hot._C, one per area (module.cpp calls each), and the helpers they
// share.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "hot/error.h"
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

}  // namespace hotpy
