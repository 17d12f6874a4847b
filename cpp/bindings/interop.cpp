#include "interop.h"

#include <cstring>

#include "hot/error.h"
#include "hot/ops.h"

namespace hotpy {

namespace {

constexpr const char* kLegacyName = "dltensor";
constexpr const char* kVersionedName = "dltensor_versioned";
constexpr const char* kUsedLegacyName = "used_dltensor";
constexpr const char* kUsedVersionedName = "used_dltensor_versioned";

// A DLPack dtype as numpy and torch name it ("float32", "bool", "complex64", "float8_e4m3fn").
std::string dl_dtype_str(DLDataType t) {
  // DLPack 1.1's codes 7 .. 17 (DLDataTypeCode): formats whose name carries their width
  static const char* const narrow[] = {"float8_e3m4",    "float8_e4m3",     "float8_e4m3b11fnuz", "float8_e4m3fn",
                                       "float8_e4m3fnuz", "float8_e5m2",    "float8_e5m2fnuz",    "float8_e8m0fnu",
                                       "float6_e2m3fn",  "float6_e3m2fn",   "float4_e2m1fn"};
  const char* base = "unknown";
  std::string s;
  switch (t.code) {
    case kDLInt: base = "int"; break;
    case kDLUInt: base = "uint"; break;
    case kDLFloat: base = "float"; break;
    case kDLBfloat: base = "bfloat"; break;
    case kDLComplex: base = "complex"; break;
    case kDLBool: s = "bool"; break;
    default:
      if (t.code >= 7 && t.code <= 17) {
        s = narrow[t.code - 7];
        break;
      }
      return hot::detail::concat("dlpack(code=", int(t.code), ", bits=", int(t.bits), ", lanes=", t.lanes, ")");
  }
  if (s.empty()) s = hot::detail::concat(base, int(t.bits));
  if (t.lanes != 1) s += hot::detail::concat("x", t.lanes);
  return s;
}

std::string py_type_name(py::handle obj) {
  py::handle t = reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr()));
  std::string mod;
  if (py::hasattr(t, "__module__")) mod = py::str(t.attr("__module__"));
  std::string name = py::str(t.attr("__qualname__"));
  return mod.empty() || mod == "builtins" ? name : mod + "." + name;
}

bool is_type_error(py::error_already_set& e) { return e.matches(PyExc_TypeError); }

}  // namespace

std::string mask_str(DTypeMask m) {
  std::vector<std::string> names;
  for (unsigned i = 0; i <= static_cast<unsigned>(hot::DType::s64); ++i) {
    if (!(m & (1u << i))) continue;
    auto t = static_cast<hot::DType>(i);
    names.push_back(t == hot::DType::s4 ? "uint8 (packed int4)" : hot::dtype_name(t));
  }
  std::string r;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i) r += (i + 1 == names.size()) ? " or " : ", ";
    r += names[i];
  }
  return r;
}

Imported::~Imported() {
  if (versioned && versioned->deleter) versioned->deleter(versioned);
  if (legacy && legacy->deleter) legacy->deleter(legacy);
}

std::unique_ptr<Imported> import_capsule(py::handle obj, const char* op, const char* name, int64_t stream_handle) {
  py::object capsule;
  if (PyCapsule_CheckExact(obj.ptr())) {
    capsule = py::reinterpret_borrow<py::object>(obj);
  } else {
    HOT_CHECK_TYPE(py::hasattr(obj, "__dlpack__") && py::hasattr(obj, "__dlpack_device__"), op, ": ", name,
                   " is a ", py_type_name(obj),
                   ", expected an array that supports DLPack (numpy, torch, cupy or jax array)");
    py::tuple dev = obj.attr("__dlpack_device__")();
    const int dev_type = dev[0].cast<int>();
    py::object stream = py::none();
    if (dev_type == kDLCUDA || dev_type == kDLCUDAManaged) stream = py::int_(dlpack_stream_arg(stream_handle));
    try {
      capsule = obj.attr("__dlpack__")(py::arg("stream") = stream,
                                       py::arg("max_version") = py::make_tuple(kHotDLPackMajor, kHotDLPackMinor));
    } catch (py::error_already_set& e) {
      if (!is_type_error(e)) throw;
      // A producer older than DLPack 1.0 does not know max_version.
      capsule = obj.attr("__dlpack__")(py::arg("stream") = stream);
    }
  }
  PyObject* cap = capsule.ptr();
  auto imp = std::make_unique<Imported>();
  if (PyCapsule_IsValid(cap, kVersionedName)) {
    auto* m = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(cap, kVersionedName));
    if (PyCapsule_SetName(cap, kUsedVersionedName) != 0) throw py::error_already_set();
    imp->versioned = m;
    imp->capsule_name = kVersionedName;
    imp->version_major = m->version.major;
    imp->version_minor = m->version.minor;
    // A newer major version may change the layout: only version and deleter may be touched.
    HOT_CHECK_VALUE(m->version.major == kHotDLPackMajor, op, ": ", name, " was exported with DLPack ",
                    m->version.major, ".", m->version.minor, ", expected major version ", kHotDLPackMajor);
    imp->dl = &m->dl_tensor;
    imp->read_only = (m->flags & kDLPackFlagBitmaskReadOnly) != 0;
  } else if (PyCapsule_IsValid(cap, kLegacyName)) {
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, kLegacyName));
    if (PyCapsule_SetName(cap, kUsedLegacyName) != 0) throw py::error_already_set();
    imp->legacy = m;
    imp->capsule_name = kLegacyName;
    imp->dl = &m->dl_tensor;
  } else {
    const char* cname = PyCapsule_CheckExact(cap) ? PyCapsule_GetName(cap) : nullptr;
    PyErr_Clear();
    HOT_FAIL(value, op, ": ", name, " gave a capsule named '", cname ? cname : "(not a capsule)",
             "', expected 'dltensor' or 'dltensor_versioned' (a capsule can be consumed only once)");
  }
  return imp;
}

hot::TensorView to_view(const Imported& imp, const char* op, const char* name, DTypeMask allowed) {
  const DLTensor& t = *imp.dl;
  hot::TensorView v;
  // Device.
  switch (t.device.device_type) {
    case kDLCPU:
    case kDLCUDAHost: v.device = hot::Device::cpu(); break;
    case kDLCUDA: v.device = hot::Device::cuda(t.device.device_id); break;
    default:
      HOT_FAIL(value, op, ": ", name, " is on DLPack device type ", t.device.device_type,
               ", expected the CPU (1), CUDA (2) or CUDA host memory (3)");
  }
  // Dtype.
  HOT_CHECK_TYPE(t.dtype.lanes == 1, op, ": ", name, " has dtype ", dl_dtype_str(t.dtype), ", expected ",
                 mask_str(allowed));
  bool known = true;
  const int code = t.dtype.code, bits = t.dtype.bits;
  if (code == kDLFloat && bits == 32) v.dtype = hot::DType::f32;
  else if (code == kDLFloat && bits == 16) v.dtype = hot::DType::f16;
  else if (code == kDLBfloat && bits == 16) v.dtype = hot::DType::bf16;
  else if (code == kDLInt && bits == 8) v.dtype = hot::DType::s8;
  else if (code == kDLInt && bits == 32) v.dtype = hot::DType::s32;
  else if (code == kDLInt && bits == 64) v.dtype = hot::DType::s64;
  else if (code == kDLUInt && bits == 8 && (allowed & kPackedS4)) v.dtype = hot::DType::s4;
  else known = false;
  HOT_CHECK_TYPE(known && (allowed & bit(v.dtype)), op, ": ", name, " has dtype ", dl_dtype_str(t.dtype),
                 ", expected ", mask_str(allowed));
  // Shape, strides (elements; NULL = compact row-major).
  HOT_CHECK_VALUE(t.ndim >= 0, op, ": ", name, " has ", t.ndim, " dims");
  v.shape.assign(t.shape, t.shape + t.ndim);
  if (t.strides) v.strides.assign(t.strides, t.strides + t.ndim);
  else v.strides = hot::contiguous_strides(v.shape);
  v.data = static_cast<char*>(t.data) + t.byte_offset;
  if (v.dtype == hot::DType::s4) {
    // uint8 bytes, two nibbles each: nibble shape doubles the last dim and every other stride.
    HOT_CHECK_VALUE(t.ndim >= 1, op, ": ", name, " (packed int4) must have at least 1 dim");
    const int last = t.ndim - 1;
    HOT_CHECK_VALUE(v.shape[last] <= 1 || v.strides[last] == 1, op, ": ", name,
                    " (packed int4) must be contiguous along its last dim (got strides ",
                    hot::shape_str(v.strides), "); pass a contiguous copy");
    for (int d = 0; d < t.ndim; ++d) v.strides[d] *= 2;
    v.strides[last] = 1;
    v.shape[last] *= 2;
  }
  return v;
}

hot::TensorView flatten_2d(const hot::TensorView& v, int split, const char* op, const char* name) {
  const int nd = v.ndim();
  HOT_CHECK_VALUE(nd >= 1, op, ": ", name, " has 0 dims, expected at least 1");
  if (split == -1) split = nd - 1;
  HOT_CHECK_VALUE(split >= 0 && split <= nd, op, ": split must be -1 or in 0..", nd, " (the leading dims of ", name,
                  " taken as rows), got ", split);
  auto fail = [&]() {
    HOT_FAIL(value, op, ": ", name, " with shape ", hot::shape_str(v.shape), " and strides ",
             hot::shape_str(v.strides),
             " cannot be viewed as a row-major 2-D matrix without a copy (the last dim must have unit stride "
             "and the leading dims must be evenly strided); pass a contiguous copy (x.contiguous() in torch, "
             "numpy.ascontiguousarray(x) in numpy)");
  };
  // Collapse a range of dims into one (size, stride); skips size-1 dims, which carry no stride.
  auto collapse = [&](int lo, int hi, int64_t& size, int64_t& stride, int64_t unit_stride) -> bool {
    size = 1;
    stride = unit_stride;
    int64_t expect = -1;
    for (int d = hi - 1; d >= lo; --d) {
      size *= v.shape[d];
      if (v.shape[d] == 1) continue;
      if (expect < 0) {
        stride = v.strides[d];
      } else if (v.strides[d] != expect) {
        return false;
      }
      expect = v.strides[d] * v.shape[d];
    }
    return true;
  };
  int64_t cols, col_stride, rows, row_stride;
  if (!collapse(split, nd, cols, col_stride, 1)) fail();
  if (cols > 1 && col_stride != 1) fail();
  if (!collapse(0, split, rows, row_stride, cols)) fail();
  if (rows <= 1) row_stride = cols;
  if (row_stride < cols && cols > 0 && rows > 1) fail();
  hot::TensorView r = v;
  r.shape = {rows, cols};
  r.strides = {row_stride, 1};
  return r;
}

hot::TensorView OpContext::import(py::handle obj, const char* name, DTypeMask allowed, int split, bool writable) {
  auto imp = import_capsule(obj, op_, name, stream_handle_);
  hot::TensorView v = to_view(*imp, op_, name, allowed);
  HOT_CHECK_VALUE(!(writable && imp->read_only), op_, ": ", name,
                  " is read-only (its DLPack export is flagged read-only), expected a writable output");
  if (has_device_) {
    HOT_CHECK_VALUE(v.device == device_, op_, ": ", name, " is on ", hot::device_str(v.device),
                    " but the other arrays are on ", hot::device_str(device_), "; all arrays must be on one device");
  } else {
    has_device_ = true;
    device_ = v.device;
  }
  keep_.push_back(std::move(imp));
  if (split == -2) return v;
  return flatten_2d(v, split, op_, name);
}

std::shared_ptr<void> OpContext::release_last() {
  HOT_INTERNAL_CHECK(!keep_.empty(), "no import to release");
  std::shared_ptr<Imported> p(keep_.back().release());
  keep_.pop_back();
  return p;
}

hot::TensorView OpContext::input(py::handle obj, const char* name, DTypeMask allowed, int split) {
  return import(obj, name, allowed, split, false);
}

hot::TensorView OpContext::output(py::handle obj, const char* name, DTypeMask allowed, int split) {
  return import(obj, name, allowed, split, true);
}

// ---- export -------------------------------------------------------------------------------------

DLDataType to_dl_dtype(hot::DType t) {
  switch (t) {
    case hot::DType::f32: return DLDataType{kDLFloat, 32, 1};
    case hot::DType::f16: return DLDataType{kDLFloat, 16, 1};
    case hot::DType::bf16: return DLDataType{kDLBfloat, 16, 1};
    case hot::DType::s8: return DLDataType{kDLInt, 8, 1};
    case hot::DType::s32: return DLDataType{kDLInt, 32, 1};
    case hot::DType::s64: return DLDataType{kDLInt, 64, 1};
    case hot::DType::s4: return DLDataType{kDLUInt, 8, 1};
  }
  return DLDataType{kDLUInt, 8, 1};
}

namespace {

// Everything an exported capsule points to; freed by the DLPack deleter (which needs no GIL: the
// storage is a hot::Tensor, not a Python object).
struct ExportCtx {
  hot::Tensor tensor;
  std::vector<int64_t> shape, strides;
  DLManagedTensor legacy{};
  DLManagedTensorVersioned versioned{};
};

void legacy_deleter(DLManagedTensor* m) { delete static_cast<ExportCtx*>(m->manager_ctx); }
void versioned_deleter(DLManagedTensorVersioned* m) { delete static_cast<ExportCtx*>(m->manager_ctx); }

// Capsule destructors: a capsule that was never consumed still owns its tensor.
void legacy_capsule_dtor(PyObject* cap) {
  if (PyCapsule_IsValid(cap, kLegacyName)) {
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, kLegacyName));
    if (m && m->deleter) m->deleter(m);
  }
}
void versioned_capsule_dtor(PyObject* cap) {
  if (PyCapsule_IsValid(cap, kVersionedName)) {
    auto* m = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(cap, kVersionedName));
    if (m && m->deleter) m->deleter(m);
  }
}

DLDevice dl_device_of(const hot::Device& d) {
  return d.is_cpu() ? DLDevice{kDLCPU, 0} : DLDevice{kDLCUDA, d.index};
}

}  // namespace

py::tuple Array::dlpack_device() const {
  DLDevice d = dl_device_of(view.device);
  return py::make_tuple(d.device_type, d.device_id);
}

py::object Array::dlpack(py::object stream, py::object max_version, py::object dl_device, py::object copy) const {
  const DLDevice own = dl_device_of(view.device);
  if (view.device.is_cpu() && !stream.is_none()) {
    // The DLPack spec reserves stream for device arrays; accept the value -1 ("no synchronisation").
    const int64_t s = stream.cast<int64_t>();
    if (s != -1) throw py::buffer_error("Array.__dlpack__: stream must be None for a CPU array");
  }
  if (!stream.is_none() && stream.cast<int64_t>() == 0)
    throw py::buffer_error("Array.__dlpack__: stream=0 is ambiguous and not allowed by DLPack; use 1 for the legacy default stream");
  if (!dl_device.is_none()) {
    py::tuple want = dl_device;
    if (want[0].cast<int>() != own.device_type || want[1].cast<int>() != own.device_id)
      throw py::buffer_error("Array.__dlpack__: cannot export to another device (dl_device); copy with the framework instead");
  }
  const bool copied = !copy.is_none() && copy.cast<bool>();
  if (copied && !view.device.is_cpu())
    throw py::buffer_error("Array.__dlpack__: copy=True is supported for CPU arrays only");
  auto ctx = std::make_unique<ExportCtx>();
  ctx->tensor = tensor;
  ctx->shape = view.shape;
  ctx->strides = view.strides;
  void* data = view.data;
  if (view.dtype == hot::DType::s4) {
    // Exchanged as uint8 bytes: last dim halved, other strides halved (nibbles -> bytes).
    const size_t last = ctx->shape.size() - 1;
    for (size_t d = 0; d < last; ++d) ctx->strides[d] /= 2;
    ctx->shape[last] = (ctx->shape[last] + 1) / 2;
    ctx->strides[last] = 1;
  }
  if (copied) {
    // A compact row-major copy of exactly the exported elements (the view may be strided: a wrapped framework
    // array's row stride can exceed its row).
    const size_t elem = view.dtype == hot::DType::s4 ? 1 : static_cast<size_t>(hot::dtype_bits(view.dtype) / 8);
    int64_t n = 1;
    for (int64_t s : ctx->shape) n *= s;
    hot::Tensor c = hot::Tensor::empty(hot::DType::s8, {n * static_cast<int64_t>(elem)}, view.device);
    char* dst = static_cast<char*>(c.view().data);
    const int nd = static_cast<int>(ctx->shape.size());
    std::vector<int64_t> idx(nd, 0);
    for (int64_t i = 0; i < n; ++i) {
      int64_t off = 0;
      for (int d = 0; d < nd; ++d) off += idx[d] * ctx->strides[d];
      std::memcpy(dst + i * elem, static_cast<const char*>(data) + off * static_cast<int64_t>(elem), elem);
      for (int d = nd - 1; d >= 0 && ++idx[d] == ctx->shape[d]; --d) idx[d] = 0;
    }
    int64_t stride = 1;
    for (int d = nd - 1; d >= 0; --d) {
      ctx->strides[d] = stride;
      stride *= ctx->shape[d];
    }
    ctx->tensor = c;
    data = dst;
  }
  const bool read_only_export = read_only && !copied;
  if (!view.device.is_cpu()) {
    // DLPack: the consumer reads on `stream` (None: the legacy default stream, 1; -1: it asks for no ordering); hot
    // wrote the array on stream_handle, so work the consumer queues there waits for hot's. (Keeping the capsule
    // alive until its own work is done is the consumer's part, as for any DLPack producer: the consumer's stream
    // may no longer exist when the capsule is released, so the deleter does not touch it.)
    const int64_t consumer = stream.is_none() ? 1 : stream.cast<int64_t>();
    if (consumer != -1)
      hot::stream_order(view.device, hot::Stream{reinterpret_cast<void*>(stream_handle)},
                        hot::Stream{reinterpret_cast<void*>(consumer)});
  }
  DLTensor t{};
  t.data = data;
  t.device = own;
  t.ndim = static_cast<int32_t>(ctx->shape.size());
  t.dtype = to_dl_dtype(view.dtype);
  t.shape = ctx->shape.data();
  t.strides = ctx->strides.data();  // always filled
  t.byte_offset = 0;

  bool versioned = false;
  uint32_t minor = kHotDLPackMinor;
  if (!max_version.is_none()) {
    py::tuple mv = max_version;
    const auto major = mv[0].cast<int64_t>();
    if (major >= 1) {
      versioned = true;
      if (major == 1) minor = std::min<uint32_t>(kHotDLPackMinor, mv[1].cast<uint32_t>());
    }
  }
  if (versioned) {
    ExportCtx* x = ctx.get();
    x->versioned.version = DLPackVersion{kHotDLPackMajor, minor};
    x->versioned.manager_ctx = x;
    x->versioned.deleter = versioned_deleter;
    x->versioned.flags =
        (copied ? kDLPackFlagBitmaskIsCopied : 0) | (read_only_export ? kDLPackFlagBitmaskReadOnly : 0);
    x->versioned.dl_tensor = t;
    PyObject* cap = PyCapsule_New(&x->versioned, kVersionedName, versioned_capsule_dtor);
    if (!cap) throw py::error_already_set();  // ctx still owns x
    ctx.release();  // the capsule (then its consumer) owns it now
    return py::reinterpret_steal<py::object>(cap);
  }
  // A legacy capsule cannot say read-only, and its consumer would write through it (numpy refuses likewise).
  if (read_only_export)
    throw py::buffer_error("Array.__dlpack__: the array wraps read-only memory, which a legacy (unversioned) DLPack "
                           "capsule cannot flag; ask for max_version=(1, 0) or copy=True");
  ExportCtx* x = ctx.get();
  x->legacy.dl_tensor = t;
  x->legacy.manager_ctx = x;
  x->legacy.deleter = legacy_deleter;
  PyObject* cap = PyCapsule_New(&x->legacy, kLegacyName, legacy_capsule_dtor);
  if (!cap) throw py::error_already_set();
  ctx.release();
  return py::reinterpret_steal<py::object>(cap);
}

}  // namespace hotpy
