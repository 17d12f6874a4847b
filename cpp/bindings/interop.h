// DLPack <-> hot::TensorView translation for the Python module hot._C. Nothing here computes: it
// imports framework arrays as views (owning the producer's deleter), exports hot::Tensors as DLPack
// capsules, and reshapes views without copying.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dlpack_abi.h"
#include "hot/tensor.h"

namespace hotpy {

namespace py = pybind11;

// Dtype sets accepted for an argument (bit i = DType i).
using DTypeMask = unsigned;
constexpr DTypeMask bit(hot::DType t) { return 1u << static_cast<unsigned>(t); }
constexpr DTypeMask kFloat = bit(hot::DType::f32) | bit(hot::DType::f16) | bit(hot::DType::bf16);
constexpr DTypeMask kF32 = bit(hot::DType::f32);
constexpr DTypeMask kS8 = bit(hot::DType::s8);
constexpr DTypeMask kS32 = bit(hot::DType::s32);
constexpr DTypeMask kS64 = bit(hot::DType::s64);
constexpr DTypeMask kPackedS4 = bit(hot::DType::s4);  // exchanged as uint8, last dim halved
std::string mask_str(DTypeMask m);

// One imported DLPack tensor. Owns the producer's managed tensor: its deleter runs when this dies.
class Imported {
 public:
  Imported() = default;
  Imported(const Imported&) = delete;
  Imported& operator=(const Imported&) = delete;
  ~Imported();

  DLManagedTensor* legacy = nullptr;
  DLManagedTensorVersioned* versioned = nullptr;
  const DLTensor* dl = nullptr;
  bool read_only = false;
  std::string capsule_name;
  uint32_t version_major = 0, version_minor = 0;
};

// DLPack stream argument for a CUDA consumer running on cudaStream_t `handle` (0 = legacy default -> 1).
inline int64_t dlpack_stream_arg(int64_t handle) { return handle == 0 ? 1 : handle; }

// Calls obj.__dlpack_device__() then obj.__dlpack__(stream=..., max_version=(1, 1)) (retrying without
// max_version on TypeError), or takes a capsule as is; renames the capsule to used_*.
std::unique_ptr<Imported> import_capsule(py::handle obj, const char* op, const char* name, int64_t stream_handle);

// The TensorView of an imported tensor. `allowed`: the accepted dtypes; if it contains kPackedS4, a
// uint8 tensor is read as packed int4 (shape in nibbles: last dim doubled).
hot::TensorView to_view(const Imported& imp, const char* op, const char* name, DTypeMask allowed);

// Collapses dims [0, split) into rows and [split, ndim) into columns without copying. Throws
// hot::Error(value) naming the argument when the strides do not allow it.
hot::TensorView flatten_2d(const hot::TensorView& v, int split, const char* op, const char* name);

// All arrays of one operation: imports (kept alive until the op is done), the device and stream.
class OpContext {
 public:
  OpContext(const char* op, int64_t stream_handle) : op_(op), stream_handle_(stream_handle) {}
  // An input (read-only is fine), flattened to 2-D with `split` leading dims as rows (-1: ndim - 1;
  // -2: keep as is, no flattening).
  hot::TensorView input(py::handle obj, const char* name, DTypeMask allowed, int split = -1);
  // A caller-allocated output: must be writable; flattened like input().
  hot::TensorView output(py::handle obj, const char* name, DTypeMask allowed, int split = -1);
  // Hands over ownership of the most recent import (e.g. to wrap it in a hot::Tensor that outlives the op).
  std::shared_ptr<void> release_last();
  // Whether the most recent import was flagged read-only by its producer.
  bool last_read_only() const { return !keep_.empty() && keep_.back()->read_only; }
  const char* op() const { return op_; }
  hot::Stream stream() const { return hot::Stream{reinterpret_cast<void*>(stream_handle_)}; }
  int64_t stream_handle() const { return stream_handle_; }
  bool has_device() const { return has_device_; }
  hot::Device device() const { return device_; }

 private:
  hot::TensorView import(py::handle obj, const char* name, DTypeMask allowed, int split, bool writable);
  const char* op_;
  int64_t stream_handle_;
  bool has_device_ = false;
  hot::Device device_;
  std::vector<std::unique_ptr<Imported>> keep_;
};

// hot._C.Array: an owning hot::Tensor exported through DLPack.
struct Array {
  hot::Tensor tensor;
  hot::TensorView view;  // what is exported (a reshaped view of tensor's storage)
  int64_t stream_handle = 0;
  bool read_only = false;  // wraps memory its producer flagged read-only: exported flagged so, never writable

  Array(hot::Tensor t, int64_t stream, bool ro = false)
      : tensor(std::move(t)), view(tensor.view()), stream_handle(stream), read_only(ro) {}
  py::tuple dlpack_device() const;
  py::object dlpack(py::object stream, py::object max_version, py::object dl_device, py::object copy) const;
};

// DLPack (code, bits) for a hot dtype and back; s4 is exported as uint8.
DLDataType to_dl_dtype(hot::DType t);

}  // namespace hotpy
