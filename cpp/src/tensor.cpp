#include "hot/tensor.h"

#include <cstdlib>
#include <cstring>

#include "backend.h"
#include "hot/error.h"

namespace hot {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::s8: return "int8";
    case DType::s4: return "int4 (packed)";
    case DType::s32: return "int32";
    case DType::s64: return "int64";
  }
  return "unknown";
}

int dtype_bits(DType t) {
  switch (t) {
    case DType::f32: case DType::s32: return 32;
    case DType::f16: case DType::bf16: return 16;
    case DType::s8: return 8;
    case DType::s4: return 4;
    case DType::s64: return 64;
  }
  return 0;
}

bool is_float(DType t) { return t == DType::f32 || t == DType::f16 || t == DType::bf16; }

std::string device_str(const Device& d) {
  return d.is_cpu() ? std::string("cpu") : detail::concat("cuda:", d.index);
}

std::string shape_str(const Shape& s) {
  std::string r = "(";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) r += ", ";
    r += std::to_string(s[i]);
  }
  if (s.size() == 1) r += ",";
  return r + ")";
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (auto v : shape) n *= v;
  return n;
}

bool TensorView::is_contiguous() const { return strides == contiguous_strides(shape); }

bool TensorView::is_row_major_2d() const {
  return ndim() == 2 && strides.size() == 2 && (strides[1] == 1 || shape[1] <= 1) && strides[0] >= shape[1];
}

Shape contiguous_strides(const Shape& shape) {
  Shape st(shape.size());
  int64_t s = 1;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    st[i] = s;
    s *= shape[i];
  }
  return st;
}

TensorView make_view(void* data, DType dtype, Device device, Shape shape) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.strides = contiguous_strides(shape);
  v.shape = std::move(shape);
  return v;
}

size_t storage_bytes(DType dtype, const Shape& shape) {
  int64_t n = 1;
  for (auto v : shape) n *= v;
  return static_cast<size_t>((n * dtype_bits(dtype) + 7) / 8);
}

size_t Tensor::nbytes() const { return storage_bytes(view_.dtype, view_.shape); }

Tensor Tensor::empty(DType dtype, const Shape& shape, Device device, Stream stream) {
  for (auto v : shape) HOT_CHECK_VALUE(v >= 0, "Tensor::empty: negative size in shape ", shape_str(shape));
  Tensor t;
  const size_t bytes = storage_bytes(dtype, shape);
  const size_t alloc = bytes == 0 ? 64 : bytes;
  if (device.is_cpu()) {
    void* p = std::aligned_alloc(64, (alloc + 63) / 64 * 64);
    HOT_CHECK(p != nullptr, internal, "out of host memory allocating ", alloc, " bytes");
    t.storage_ = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  } else {
    HOT_CHECK(cuda::available(), unavailable, "cannot allocate on ", device_str(device),
              ": the CUDA backend is unavailable: ", cuda::unavailable_reason());
    const int dev = device.index;
    void* p = cuda::allocate(alloc, dev, stream);
    t.storage_ = std::shared_ptr<void>(p, [dev, stream](void* q) { cuda::deallocate(q, dev, stream); });
  }
  t.view_ = make_view(t.storage_.get(), dtype, device, shape);
  return t;
}

Tensor Tensor::wrap(const TensorView& view, std::shared_ptr<void> keepalive) {
  HOT_CHECK_VALUE(view.data != nullptr || view.numel() == 0, "Tensor::wrap: view has no data");
  Tensor t;
  t.storage_ = keepalive ? std::move(keepalive) : std::shared_ptr<void>(view.data, [](void*) {});
  t.view_ = view;
  return t;
}

Tensor Tensor::zeros(DType dtype, const Shape& shape, Device device, Stream stream) {
  Tensor t = empty(dtype, shape, device, stream);
  const size_t bytes = t.nbytes();
  if (bytes == 0) return t;
  if (device.is_cpu()) {
    std::memset(t.view_.data, 0, bytes);
  } else {
    cuda::memset_zero(t.view_.data, bytes, device.index, stream);
  }
  return t;
}

}  // namespace hot
