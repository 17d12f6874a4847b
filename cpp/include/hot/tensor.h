// Non-owning tensor views and owning buffers: the only array types the core knows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace hot {

// s4 is packed INT4 (SPEC §5): two's-complement nibbles, element 2k in the low nibble and 2k+1 in the
// high nibble of byte k. Shapes and strides of an s4 view count elements (nibbles), not bytes; its
// innermost dimension must be contiguous and even, and the data pointer addresses element 0.
enum class DType : uint8_t { f32, f16, bf16, s8, s4, s32, s64 };

const char* dtype_name(DType t);
// Size in bits of one element (4 for s4).
int dtype_bits(DType t);
bool is_float(DType t);

struct Device {
  enum class Kind : uint8_t { cpu, cuda };
  Kind kind = Kind::cpu;
  int index = 0;

  static Device cpu() { return Device{Kind::cpu, 0}; }
  static Device cuda(int i) { return Device{Kind::cuda, i}; }
  bool is_cpu() const { return kind == Kind::cpu; }
  bool is_cuda() const { return kind == Kind::cuda; }
  bool operator==(const Device& o) const { return kind == o.kind && (kind == Kind::cpu || index == o.index); }
  bool operator!=(const Device& o) const { return !(*this == o); }
};
std::string device_str(const Device& d);

// An explicit execution stream. For CUDA it holds a cudaStream_t (nullptr = legacy default stream);
// the CPU backend ignores it.
struct Stream {
  void* handle = nullptr;
};

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);

// Non-owning view: data pointer, dtype, device, shape and strides counted in elements.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device;
  Shape shape;
  Shape strides;

  int ndim() const { return static_cast<int>(shape.size()); }
  int64_t size(int d) const { return shape[d < 0 ? d + ndim() : d]; }
  int64_t stride(int d) const { return strides[d < 0 ? d + ndim() : d]; }
  int64_t numel() const;
  bool is_contiguous() const;
  // 2-D with unit stride along columns and a row stride of at least the number of columns.
  bool is_row_major_2d() const;
  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
};

// Contiguous (row-major) strides for `shape`.
Shape contiguous_strides(const Shape& shape);
TensorView make_view(void* data, DType dtype, Device device, Shape shape);

// Owning buffer: a view plus shared ownership of its storage. CPU memory is 64-byte aligned host
// memory; CUDA memory is stream-ordered (cudaMallocAsync on the given stream, freed with cudaFreeAsync
// on the same stream), so it is safe to use on that stream without any device-wide synchronisation.
class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(DType dtype, const Shape& shape, Device device, Stream stream = {});
  static Tensor zeros(DType dtype, const Shape& shape, Device device, Stream stream = {});
  // A Tensor over memory owned elsewhere (a framework's array): `keepalive` is held as long as the
  // Tensor or any copy of it lives, and releases the memory when the last one goes.
  static Tensor wrap(const TensorView& view, std::shared_ptr<void> keepalive);

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }
  bool defined() const { return storage_ != nullptr || view_.numel() == 0; }
  size_t nbytes() const;

 private:
  std::shared_ptr<void> storage_;
  TensorView view_;
};

// Bytes needed by a contiguous tensor of this dtype and shape (s4 rounds up to whole bytes).
size_t storage_bytes(DType dtype, const Shape& shape);

}  // namespace hot
