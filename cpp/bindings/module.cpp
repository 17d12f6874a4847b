// hot._C: the pybind11 module. It translates DLPack arrays to hot::TensorViews (interop.h), calls the
// core (hot/ops.h) and maps hot::Error to Python exceptions. Every operation takes its outputs from the
// caller (arrays of the caller's framework, written in place) or, where None is given, allocates a
// hot::Tensor and returns it as a hot._C.Array (DLPack exportable). `stream` is the cudaStream_t the
// operation runs on (an int; 0 = legacy default stream); CPU operations ignore it.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "hot/config.h"
#include "hot/error.h"
#include "hot/ops.h"
#include "bindings.h"
#include "interop.h"

#ifndef HOT_VERSION
#define HOT_VERSION "0.0.0"
#endif

namespace py = pybind11;
using hotpy::Array;
using hotpy::OpContext;

namespace {

hot::DType parse_float_dtype(const std::string& s, const char* op) {
  if (s == "float32") return hot::DType::f32;
  if (s == "float16") return hot::DType::f16;
  if (s == "bfloat16") return hot::DType::bf16;
  HOT_FAIL(type, op, ": dtype must be float32, float16 or bfloat16, got ", s);
}

// An output: the caller's array (written in place; returns None) or, for None, a new hot::Tensor of
// `dtype` and `shape` on the operation's device (returned as an Array).
py::object output(OpContext& ctx, py::handle obj, const char* name, hotpy::DTypeMask allowed, hot::DType dtype,
                  const hot::Shape& shape, hot::TensorView& view, int split = -1) {
  if (!obj.is_none()) {
    view = ctx.output(obj, name, allowed, split);
    return py::none();
  }
  HOT_INTERNAL_CHECK(ctx.has_device(), "an output is allocated before any input fixed the device");
  hot::Tensor t = hot::Tensor::empty(dtype, shape, ctx.device(), ctx.stream());
  view = t.view();
  return py::cast(Array(std::move(t), ctx.stream_handle()));
}

hot::TensorView nonempty(const hot::TensorView& v, const char* op, const char* name) {
  HOT_CHECK_NONEMPTY(op, name, v);
  return v;
}

// The core's SavedActivation, shared with the Python object that wraps it.
struct PySaved {
  std::shared_ptr<hot::SavedActivation> s;
  int64_t stream_handle = 0;
  bool q_read_only = false, scale_read_only = false;  // wrapped arrays their producers flagged read-only
};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hot native module: DLPack bindings over the hot C++ core";
  m.attr("__version__") = HOT_VERSION;

  hotpy::register_config(m);

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

  py::class_<PySaved>(m, "SavedActivation", "The core's ABC buffer (q: I x K_pad int8, scale: [1] float32).")
      .def_property_readonly("q", [](const PySaved& s) { return Array(s.s->q, s.stream_handle, s.q_read_only); })
      .def_property_readonly("scale",
                             [](const PySaved& s) { return Array(s.s->scale, s.stream_handle, s.scale_read_only); })
      .def_property_readonly("rows", [](const PySaved& s) { return s.s->rows; })
      .def_property_readonly("cols", [](const PySaved& s) { return s.s->cols; })
      .def_property_readonly("rank", [](const PySaved& s) { return s.s->rank; })
      .def_property_readonly("nbytes", [](const PySaved& s) { return s.s->nbytes(); })
      .def_static(
          "wrap",
          [](py::handle q, py::handle scale, int64_t rows, int64_t cols, int rank, int64_t stream,
             const std::string& op_name) {
            const char* op = op_name.c_str();
            HOT_CHECK_VALUE(rows > 0 && cols > 0, op, ": saved activation rows and cols must be positive, got ", rows,
                            " and ", cols);
            HOT_CHECK_VALUE(rank >= 1 && rank <= 16, op, ": saved activation rank must be in 1..16, got ", rank);
            OpContext ctx(op, stream);
            auto s = std::make_shared<hot::SavedActivation>();
            s->rows = rows;
            s->cols = cols;
            s->rank = rank;
            hot::TensorView qv = ctx.input(q, "saved.q", hotpy::kS8, -2);
            const bool q_ro = ctx.last_read_only();
            s->q = hot::Tensor::wrap(qv, ctx.release_last());
            hot::TensorView sv = ctx.input(scale, "saved.scale", hotpy::kF32, -2);
            const bool s_ro = ctx.last_read_only();
            s->scale = hot::Tensor::wrap(sv, ctx.release_last());
            return PySaved{s, stream, q_ro, s_ro};
          },
          py::arg("q"), py::arg("scale"), py::arg("rows"), py::arg("cols"), py::arg("rank"), py::arg("stream"),
          py::arg("op") = "backward_linear",
          "A core SavedActivation over the caller's q and scale arrays (no copy; they are kept alive).");

  // ---- building blocks -------------------------------------------------------------------------
  m.def(
      "hadamard_transform",
      [](py::handle x, py::handle out, int block, int split, int axis, int64_t stream) {
        const char* op = "hadamard_transform";
        OpContext ctx(op, stream);
        hot::TensorView in = nonempty(ctx.input(x, "x", hotpy::kFloat, split), op, "x");
        hot::TensorView o;
        py::object r = output(ctx, out, "out", hotpy::kF32, hot::DType::f32, in.shape, o, split);
        {
          py::gil_scoped_release nogil;
          hot::hadamard_transform(in, o, block, axis, ctx.stream());
        }
        return r;
      },
      py::arg("x"), py::arg("out"), py::arg("block"), py::arg("split"), py::arg("axis"), py::arg("stream"));

  m.def(
      "hla",
      [](py::handle x, py::handle out, int rank, int64_t stream) {
        const char* op = "hla";
        OpContext ctx(op, stream);
        hot::TensorView in = nonempty(ctx.input(x, "x", hotpy::kFloat), op, "x");
        HOT_CHECK_VALUE(rank >= 1 && rank <= 16, op, ": rank must be in 1..16, got ", rank);
        hot::TensorView o;
        py::object r = output(ctx, out, "out", hotpy::kF32, hot::DType::f32,
                              {hot::hla_rows(in.shape[0], rank), in.shape[1]}, o);
        {
          py::gil_scoped_release nogil;
          hot::hla_project(in, o, rank, ctx.stream());
        }
        return r;
      },
      py::arg("x"), py::arg("out"), py::arg("rank"), py::arg("stream"));

  m.def(
      "quantize",
      [](py::handle x, py::handle q, py::handle scale, int bits, const std::string& scale_mode,
         const std::string& rounding, uint64_t seed, uint32_t rng_stream, int64_t stream) {
        const char* op = "quantize";
        OpContext ctx(op, stream);
        hot::TensorView in = nonempty(ctx.input(x, "x", hotpy::kFloat), op, "x");
        hot::QuantizeParams p;
        HOT_CHECK_VALUE(bits == 4 || bits == 8, op, ": bits must be 4 or 8, got ", bits);
        p.bits = bits;
        p.scale = hot::parse_scale_mode(scale_mode, "quantize: scale");
        p.rounding = hot::parse_rounding(rounding, "quantize: rounding");
        p.seed = seed;
        p.rng_stream = rng_stream;
        hot::TensorView qv, sv;
        py::object rq = output(ctx, q, "q", hotpy::kS8, hot::DType::s8, in.shape, qv);
        py::object rs = output(ctx, scale, "scale", hotpy::kF32, hot::DType::f32,
                               {p.scale == hot::ScaleMode::tensor ? 1 : in.shape[0]}, sv, -2);
        {
          py::gil_scoped_release nogil;
          hot::quantize(in, qv, sv, p, ctx.stream());
        }
        return py::make_tuple(rq, rs);
      },
      py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("bits"), py::arg("scale_mode"), py::arg("rounding"),
      py::arg("seed"), py::arg("rng_stream"), py::arg("stream"));

  m.def(
      "dequantize",
      [](py::handle q, py::handle scale, py::handle out, const std::string& dtype, int64_t stream) {
        const char* op = "dequantize";
        OpContext ctx(op, stream);
        hot::TensorView qv = nonempty(ctx.input(q, "q", hotpy::kS8), op, "q");
        hot::TensorView sv = ctx.input(scale, "scale", hotpy::kF32, -2);
        hot::TensorView o;
        py::object r = output(ctx, out, "out", hotpy::kFloat, parse_float_dtype(dtype, op), qv.shape, o);
        {
          py::gil_scoped_release nogil;
          hot::dequantize(qv, sv, o, ctx.stream());
        }
        return r;
      },
      py::arg("q"), py::arg("scale"), py::arg("out"), py::arg("dtype"), py::arg("stream"));

  m.def(
      "pack_int4",
      [](py::handle q, py::handle packed, int64_t stream) {
        const char* op = "pack_int4";
        OpContext ctx(op, stream);
        hot::TensorView qv = nonempty(ctx.input(q, "q", hotpy::kS8), op, "q");
        HOT_CHECK_VALUE(qv.shape[1] % 2 == 0, op, ": q needs an even last dim to pack two values per byte, got ",
                        qv.shape[1]);
        hot::TensorView pv;
        py::object r = output(ctx, packed, "packed", hotpy::kPackedS4, hot::DType::s4, qv.shape, pv);
        {
          py::gil_scoped_release nogil;
          hot::pack_int4(qv, pv, ctx.stream());
        }
        return r;
      },
      py::arg("q"), py::arg("packed"), py::arg("stream"));

  m.def(
      "unpack_int4",
      [](py::handle packed, py::handle q, int64_t stream) {
        const char* op = "unpack_int4";
        OpContext ctx(op, stream);
        hot::TensorView pv = nonempty(ctx.input(packed, "packed", hotpy::kPackedS4), op, "packed");
        hot::TensorView qv;
        py::object r = output(ctx, q, "q", hotpy::kS8, hot::DType::s8, pv.shape, qv);
        {
          py::gil_scoped_release nogil;
          hot::unpack_int4(pv, qv, ctx.stream());
        }
        return r;
      },
      py::arg("packed"), py::arg("q"), py::arg("stream"));

  auto gemm = [](const char* op, hotpy::DTypeMask allowed, py::handle a, py::handle b, py::handle c,
                 int64_t stream) {
    OpContext ctx(op, stream);
    hot::TensorView av = nonempty(ctx.input(a, "a", allowed, -2), op, "a");
    hot::TensorView bv = nonempty(ctx.input(b, "b", allowed, -2), op, "b");
    HOT_CHECK_DIM(op, "a", av, 2);
    HOT_CHECK_DIM(op, "b", bv, 2);
    av = hotpy::flatten_2d(av, 1, op, "a");
    bv = hotpy::flatten_2d(bv, 1, op, "b");
    hot::TensorView cv;
    py::object r = output(ctx, c, "c", hotpy::kS32, hot::DType::s32, {av.shape[0], bv.shape[0]}, cv);
    {
      py::gil_scoped_release nogil;
      if (allowed == hotpy::kPackedS4) hot::gemm_s4s4s32(av, bv, cv, ctx.stream());
      else hot::gemm_s8s8s32(av, bv, cv, ctx.stream());
    }
    return r;
  };
  m.def(
      "gemm_s8",
      [gemm](py::handle a, py::handle b, py::handle c, int64_t stream) {
        return gemm("gemm_s8", hotpy::kS8, a, b, c, stream);
      },
      py::arg("a"), py::arg("b"), py::arg("c"), py::arg("stream"));
  m.def(
      "gemm_s4",
      [gemm](py::handle a, py::handle b, py::handle c, int64_t stream) {
        return gemm("gemm_s4", hotpy::kPackedS4, a, b, c, stream);
      },
      py::arg("a"), py::arg("b"), py::arg("c"), py::arg("stream"));

  // ---- layer operations ------------------------------------------------------------------------
  m.def(
      "compress_activation",
      [](py::handle x, const hot::Config& config, int64_t stream, const std::string& op_name,
         const std::string& arg_name, py::handle q, py::handle scale) {
        const char* op = op_name.c_str();
        const char* name = arg_name.c_str();
        const int rank = config.rank;
        OpContext ctx(op, stream);
        hot::TensorView xv = nonempty(ctx.input(x, name, hotpy::kFloat), op, name);
        auto s = std::make_shared<hot::SavedActivation>();
        if (q.is_none() != scale.is_none()) HOT_FAIL(value, op, ": give both q and scale outputs, or neither");
        if (q.is_none()) {
          py::gil_scoped_release nogil;
          *s = hot::compress_activation(xv, rank, ctx.stream());
          return PySaved{s, stream};
        }
        // Caller-allocated buffers (the framework's allocator): write into them and keep them alive.
        s->rows = xv.shape[0];
        s->cols = xv.shape[1];
        s->rank = rank;
        hot::TensorView qv = ctx.output(q, "q", hotpy::kS8, -2);
        s->q = hot::Tensor::wrap(qv, ctx.release_last());
        hot::TensorView sv = ctx.output(scale, "scale", hotpy::kF32, -2);
        s->scale = hot::Tensor::wrap(sv, ctx.release_last());
        {
          py::gil_scoped_release nogil;
          hot::compress_activation(xv, qv, sv, rank, ctx.stream());
        }
        return PySaved{s, stream};
      },
      py::arg("x"), py::arg("config"), py::arg("stream"), py::arg("op") = "compress_activation",
      py::arg("name") = "x", py::arg("q") = py::none(), py::arg("scale") = py::none(),
      "compress_activation(x, config.rank): the ABC buffer of x (a SavedActivation), into q and scale when given.");

  m.def(
      "backward_linear",
      [](py::handle grad_output, py::handle weight, py::handle saved, py::handle grad_input, py::handle grad_weight,
         py::handle grad_bias, bool need_grad_input, bool need_grad_weight, bool bias, const hot::Config& config,
         uint64_t seed, int64_t stream) {
        const char* op = "backward_linear";
        OpContext ctx(op, stream);
        hot::TensorView gy = nonempty(ctx.input(grad_output, "grad_output", hotpy::kFloat), op, "grad_output");
        hot::TensorView wv = ctx.input(weight, "weight", hotpy::kFloat, -2);
        HOT_CHECK_VALUE(wv.ndim() == 2, op, ": weight has ", wv.ndim(), " dims, expected 2 (O x I) (got shape ",
                        hot::shape_str(wv.shape), ")");
        wv = nonempty(hotpy::flatten_2d(wv, 1, op, "weight"), op, "weight");
        const int64_t L = gy.shape[0], O = gy.shape[1], I = wv.shape[1];
        const hot::DType out_dt = gy.dtype;
        // saved: the core's SavedActivation, or the raw x (compressed by the core, or used as it is in exact mode)
        hot::TensorView xv;
        const hot::SavedActivation* sp = nullptr;
        if (need_grad_weight) {
          HOT_CHECK_VALUE(!saved.is_none(), op, ": need_grad_weight=True needs `saved` (",
                          config.exact ? "the raw x in exact mode" : "a SavedActivation or the raw x", "), got None");
          if (py::isinstance<PySaved>(saved)) {
            HOT_CHECK_VALUE(!config.exact, op,
                            ": config.exact needs the raw input x as `saved`, got a SavedActivation");
            sp = saved.cast<const PySaved&>().s.get();
          } else {
            xv = nonempty(ctx.input(saved, "saved", hotpy::kFloat), op, "saved");
          }
        }
        hot::BackwardOutputs outs;
        py::object rx = py::none(), rw = py::none(), rb = py::none();
        if (need_grad_input) rx = output(ctx, grad_input, "grad_input", hotpy::kFloat, out_dt, {L, I}, outs.grad_input);
        if (need_grad_weight)
          rw = output(ctx, grad_weight, "grad_weight", hotpy::kFloat, out_dt, {O, I}, outs.grad_weight);
        if (bias) rb = output(ctx, grad_bias, "grad_bias", hotpy::kFloat, out_dt, {O}, outs.grad_bias, -2);
        {
          py::gil_scoped_release nogil;
          if (sp != nullptr) hot::backward_linear(gy, wv, sp, config, seed, outs, ctx.stream());
          else hot::backward_linear(gy, wv, xv, config, seed, outs, ctx.stream());
        }
        return py::make_tuple(rx, rw, rb);
      },
      py::arg("grad_output"), py::arg("weight"), py::arg("saved"), py::arg("grad_input"), py::arg("grad_weight"),
      py::arg("grad_bias"), py::arg("need_grad_input"), py::arg("need_grad_weight"), py::arg("bias"),
      py::arg("config"), py::arg("seed"), py::arg("stream"),
      "hot::backward_linear: (grad_input, grad_weight, grad_bias), each None where the caller gave the array or did "
      "not ask for it. saved: a SavedActivation, the raw x, or None without g_w.");

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
  m.def("gw_chunk_rows", &hot::gw_chunk_rows, py::arg("rank"));
}
