// hot._C.Config: the core's hot::Config as a Python type. hot.Config (python/hot/_api.py) is a subclass that adds only
// Python conveniences; the operations of hot._C take it as the C++ struct, whole. Python values are converted here
// (type checks, naming the field and the value's repr); the values themselves are checked by the core
// (hot::Config::validate, hot::parse_rounding, hot::parse_scale_mode), which also writes the messages.
#include <pybind11/pybind11.h>

#include <climits>
#include <string>

#include "bindings.h"
#include "hot/config.h"
#include "hot/error.h"

namespace py = pybind11;

namespace hotpy {

namespace {

std::string repr_of(py::handle v) { return py::repr(v).cast<std::string>(); }

bool is_numpy_bool(py::handle v) {
  const py::handle t = reinterpret_cast<PyObject*>(Py_TYPE(v.ptr()));
  return t.attr("__module__").cast<std::string>() == "numpy" &&
         (t.attr("__name__").cast<std::string>() == "bool_" || t.attr("__name__").cast<std::string>() == "bool");
}

// An integer field: a Python int (not a bool) or a numbers.Integral (numpy integers), as an int.
int int_field(py::handle v, const char* field, const char* allowed) {
  bool ok;
  if (PyLong_Check(v.ptr())) {
    ok = !PyBool_Check(v.ptr());
  } else {
    static const py::object integral = py::module_::import("numbers").attr("Integral");
    ok = PyObject_IsInstance(v.ptr(), integral.ptr()) == 1 && !is_numpy_bool(v);
  }
  if (ok) {
    const py::object i = py::reinterpret_steal<py::object>(PyNumber_Index(v.ptr()));
    if (!i) throw py::error_already_set();
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
    if (overflow == 0 && x >= INT_MIN && x <= INT_MAX) return static_cast<int>(x);
  }
  HOT_FAIL(value, "Config: ", field, " must be ", allowed, ", got ", repr_of(v));
}

std::string str_field(py::handle v, const char* field, const char* allowed) {
  if (!py::isinstance<py::str>(v)) HOT_FAIL(value, "Config: ", field, " must be ", allowed, ", got ", repr_of(v));
  return v.cast<std::string>();
}

bool bool_field(py::handle v, const char* field) {
  if (!PyBool_Check(v.ptr()) && !is_numpy_bool(v))
    HOT_FAIL(value, "Config: ", field, " must be True or False, got ", repr_of(v));
  return PyObject_IsTrue(v.ptr()) == 1;
}

// Field by field in declaration order, so that the first invalid field is the one reported.
hot::Config make_config(py::handle gx_bits, py::handle rank, py::handle rounding, py::handle gx_scale,
                        py::handle exact) {
  hot::Config c;
  c.gx_bits = int_field(gx_bits, "gx_bits", hot::kGxBitsAllowed);
  c.rank = int_field(rank, "rank", hot::kRankAllowed);
  c.validate();
  c.rounding = hot::parse_rounding(str_field(rounding, "rounding", hot::kRoundingAllowed));
  c.gx_scale = hot::parse_scale_mode(str_field(gx_scale, "gx_scale", hot::kScaleAllowed));
  c.exact = bool_field(exact, "exact");
  return c;
}

}  // namespace

void register_config(py::module_& m) {
  py::class_<hot::Config> cls(m, "Config",
                              "The core's HOT configuration (hot::Config, cpp/include/hot/config.h); hot.Config "
                              "subclasses it. Immutable from Python.");
  cls.def(py::init(&make_config), py::arg("gx_bits") = 8, py::arg("rank") = 16, py::arg("rounding") = "stochastic",
          py::arg("gx_scale") = "tensor", py::arg("exact") = false)
      .def_property_readonly("gx_bits", [](const hot::Config& c) { return c.gx_bits; })
      .def_property_readonly("rank", [](const hot::Config& c) { return c.rank; })
      .def_property_readonly("rounding", [](const hot::Config& c) { return hot::rounding_name(c.rounding); })
      .def_property_readonly("gx_scale", [](const hot::Config& c) { return hot::scale_mode_name(c.gx_scale); })
      .def_property_readonly("exact", [](const hot::Config& c) { return c.exact; })
      .def_property_readonly("code", &hot::Config::code,
                             "The configuration as one integer (hot::Config::code): how it crosses boundaries that "
                             "carry only scalars, e.g. the schemas of the torch custom ops.")
      .def("describe", &hot::Config::describe, "One line: what the two backward GEMMs run.")
      .def("__repr__",
           [](py::handle self) {
             const auto& c = self.cast<const hot::Config&>();
             return py::str("{}(gx_bits={}, rank={}, rounding='{}', gx_scale='{}', exact={})")
                 .format(py::type::of(self).attr("__qualname__"), c.gx_bits, c.rank, hot::rounding_name(c.rounding),
                         hot::scale_mode_name(c.gx_scale), c.exact ? "True" : "False");
           })
      .def(
          "__eq__", [](const hot::Config& a, const hot::Config& b) { return a == b; }, py::is_operator())
      .def("__hash__", [](const hot::Config& c) { return c.code(); })
      .def("__reduce__", [](py::handle self) {
        const auto& c = self.cast<const hot::Config&>();
        return py::make_tuple(py::type::of(self), py::make_tuple(c.gx_bits, c.rank, hot::rounding_name(c.rounding),
                                                                 hot::scale_mode_name(c.gx_scale), c.exact));
      });
  // from_code is a classmethod, so that hot.Config.from_code gives a hot.Config.
  cls.attr("from_code") = py::reinterpret_steal<py::object>(PyClassMethod_New(
      py::cpp_function(
          [](py::type t, int64_t code) {
            py::object o = t();
            o.cast<hot::Config&>() = hot::Config::from_code(code);
            return o;
          },
          py::arg("cls"), py::arg("code"), "The configuration of a code (Config.code).")
          .ptr()));
}

}  // namespace hotpy
