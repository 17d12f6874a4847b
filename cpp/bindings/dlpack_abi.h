// The DLPack ABI (https://dmlc.github.io/dlpack/latest/c_api.html), written from the specification:
// only the structs, codes and flags this project exchanges. Layouts are fixed by the spec (C ABI):
// DLManagedTensor is the legacy (pre-1.0) capsule payload, "dltensor"; DLManagedTensorVersioned is
// the 1.x payload, "dltensor_versioned", which carries a version and flags.
#pragma once

#include <cstdint>

extern "C" {

// Device types (DLDeviceType). Only the ones hot reads or writes.
enum HotDLDeviceType : int32_t {
  kDLCPU = 1,
  kDLCUDA = 2,
  kDLCUDAHost = 3,  // pinned host memory: CPU-addressable
  kDLCUDAManaged = 13,
};

// Type codes (DLDataTypeCode).
enum HotDLDataTypeCode : uint8_t {
  kDLInt = 0,
  kDLUInt = 1,
  kDLFloat = 2,
  kDLBfloat = 4,
  kDLComplex = 5,
  kDLBool = 6,
  // 7 .. 17: the 8-, 6- and 4-bit float formats (named in interop.cpp's messages only)
};

typedef struct {
  int32_t device_type;  // a DLDeviceType (C enums are int-sized)
  int32_t device_id;
} DLDevice;

typedef struct {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
} DLDataType;

typedef struct {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; NULL means compact row-major
  uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(struct DLManagedTensor* self);
} DLManagedTensor;

typedef struct {
  uint32_t major;
  uint32_t minor;
} DLPackVersion;

// Flags of DLManagedTensorVersioned.
constexpr uint64_t kDLPackFlagBitmaskReadOnly = 1ull << 0;
constexpr uint64_t kDLPackFlagBitmaskIsCopied = 1ull << 1;
constexpr uint64_t kDLPackFlagBitmaskIsSubbytePadded = 1ull << 2;

typedef struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(struct DLManagedTensorVersioned* self);
  uint64_t flags;
  DLTensor dl_tensor;
} DLManagedTensorVersioned;

}  // extern "C"

// The newest ABI version hot speaks (1.1 has the same layout as 1.0).
constexpr uint32_t kHotDLPackMajor = 1;
constexpr uint32_t kHotDLPackMinor = 1;
