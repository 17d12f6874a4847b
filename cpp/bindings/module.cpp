// hot._C: the pybind11 module (this file: the module, errors, Array, introspection; each area registers its own
// operations: bindings.h). It translates DLPack arrays to hot::TensorViews (interop.h), calls the
// core (hot/ops.h) and maps hot::Error to Python exceptions. Every operation takes its outputs from the
// caller (arrays of the caller's framework, written in place) or, where None is given, allocates a
// hot::Tensor and returns it as a hot._C.Array (DLPack exportable). `stream` is the cudaStream_t the
// operation runs on (an int; 0 = legacy default stream); CPU operations ignore it.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "hot/error.h"
#include "hot/ops.h"

#ifndef HOT_VERSION
#define HOT_VERSION "0.0.0"
#endif

namespace py = pybind11;
using hotpy::Array;
using hotpy::OpContext;

PYBIND11_MODULE(_C, m) {
  m.doc() = "hot native module: DLPack bindings over the hot C++ core";
  m.attr("__version__") = HOT_VERSION;

  hotpy::register_config(m);
  hotpy::register_blocks(m);
  hotpy::register_layers(m);

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const hot::Error& e) {
      switch (e.kind()) {
        case hot::ErrorKind::type: PyErr_SetString(PyExc_TypeError, e.what()); break;
        case hot::ErrorKind::value: PyErr_SetString(PyExc_ValueError, e.what()); break;
        default: PyErr_SetString(PyExc_RuntimeError, e.what()); break;
      }
    }
  });

  py::class_<Array>(m, "Array",
                    "An array owned by hot (a hot::Tensor), exported through DLPack: pass it to "
                    "numpy/torch/cupy/jax from_dlpack.")
      .def("__dlpack__", &Array::dlpack, py::kw_only(), py::arg("stream") = py::none(),
           py::arg("max_version") = py::none(), py::arg("dl_device") = py::none(), py::arg("copy") = py::none())
      .def("__dlpack_device__", &Array::dlpack_device)
      .def_property_readonly("shape", [](const Array& a) {
        hot::Shape s = a.view.shape;
        if (a.view.dtype == hot::DType::s4 && !s.empty()) s.back() = (s.back() + 1) / 2;
        return py::tuple(py::cast(s));
      })
      .def_property_readonly("dtype", [](const Array& a) {
        return std::string(a.view.dtype == hot::DType::s4 ? "uint8" : hot::dtype_name(a.view.dtype));
      })
      .def_property_readonly("device", [](const Array& a) { return hot::device_str(a.view.device); })
      .def_property_readonly("nbytes", [](const Array& a) { return hot::storage_bytes(a.view.dtype, a.view.shape); })
      .def("__repr__", [](const Array& a) {
        return hot::detail::concat("hot._C.Array(shape=", hot::shape_str(a.view.shape), ", dtype=",
                                   hot::dtype_name(a.view.dtype), ", device=", hot::device_str(a.view.device), ")");
      });

  // ---- introspection (tests, debugging) ----------------------------------------------------------
  m.def(
      "_inspect",
      [](py::handle obj, bool writable) {
        OpContext ctx("inspect", 0);
        auto imp = hotpy::import_capsule(obj, "inspect", "x", 0);
        hot::TensorView v = hotpy::to_view(*imp, "inspect", "x",
                                           hotpy::kFloat | hotpy::kS8 | hotpy::kS32 | hotpy::kPackedS4);
        py::dict d;
        d["capsule"] = imp->capsule_name;
        d["version"] = py::make_tuple(imp->version_major, imp->version_minor);
        d["read_only"] = imp->read_only;
        d["dtype"] = std::string(hot::dtype_name(v.dtype));
        d["shape"] = py::tuple(py::cast(v.shape));
        d["strides"] = py::tuple(py::cast(v.strides));
        d["device"] = hot::device_str(v.device);
        HOT_CHECK_VALUE(!(writable && imp->read_only), "inspect: x is read-only");
        return d;
      },
      py::arg("x"), py::arg("writable") = false,
      "Imports x through DLPack and describes what hot sees (capsule kind, version, flags, dtype, shape, "
      "strides in elements; packed int4 is shown in nibbles).");

  m.def("cuda_available", &hot::cuda_available);
  m.def("cuda_unavailable_reason", &hot::cuda_unavailable_reason);
  m.def("build_info", &hot::build_info);
  m.def("set_num_threads", &hot::set_num_threads, py::arg("n"));
  m.def("get_num_threads", &hot::get_num_threads);
  m.def("hla_rows", &hot::hla_rows, py::arg("L"), py::arg("rank"));
  m.def("padded_k", &hot::padded_k, py::arg("k"));
}
