// hot._C's layer operations: the core's SavedActivation (the ABC buffer), compress_activation, QuantizedWeight (W~ of
// the g_x path, kept by a caller whose weight does not change), quantize_weight and backward_linear.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "bindings.h"
#include "hot/config.h"
#include "hot/error.h"
#include "hot/ops.h"

namespace py = pybind11;

namespace hotpy {

namespace {

// The core's SavedActivation, shared with the Python object that wraps it.
struct PySaved {
  std::shared_ptr<hot::SavedActivation> s;
  int64_t stream_handle = 0;
  bool q_read_only = false, scale_read_only = false;  // wrapped arrays their producers flagged read-only
};

// The core's QuantizedWeight, shared with the Python object that wraps it.
struct PyQuantizedWeight {
  std::shared_ptr<hot::QuantizedWeight> w;
  int64_t stream_handle = 0;
};

// The core's W~ of a backward's weight_q argument (a QuantizedWeight, or None: nullptr).
const hot::QuantizedWeight* weight_q_arg(const char* op, py::handle weight_q) {
  if (weight_q.is_none()) return nullptr;
  HOT_CHECK_TYPE(py::isinstance<PyQuantizedWeight>(weight_q), op,
                 ": weight_q must be a QuantizedWeight (hot.quantize_weight) or None, got ",
                 std::string(py::str(py::type::of(weight_q).attr("__name__"))));
  return weight_q.cast<const PyQuantizedWeight&>().w.get();
}

// A backward's seed argument: a Python integer (0 .. 2^64 - 1), or an array of one int64 element on grad_output's
// device (imported after grad_output, whose device the call takes), which the kernels read when they run (hot::Seed;
// the core checks its size, device and alignment).
hot::Seed seed_arg(OpContext& ctx, const char* op, py::handle seed) {
  if (py::isinstance<py::int_>(seed)) {
    try {
      return hot::Seed(seed.cast<uint64_t>());
    } catch (const py::cast_error&) {
      HOT_FAIL(value, op, ": seed must be an integer in 0..2**64-1 or a one-element int64 array, got ",
               std::string(py::repr(seed)));
    }
  }
  return hot::Seed(0, ctx.input(seed, "seed", kS64, -2));
}

}  // namespace

void register_layers(py::module_& m) {
  py::class_<PySaved>(m, "SavedActivation", "The core's ABC buffer (q: I x K_pad int8, scale: [1] float32).")
      .def_property_readonly("q", [](const PySaved& s) { return Array(s.s->q, s.stream_handle, s.q_read_only); })
      .def_property_readonly("scale",
                             [](const PySaved& s) { return Array(s.s->scale, s.stream_handle, s.scale_read_only); })
      .def_property_readonly("rows", [](const PySaved& s) { return s.s->rows; })
      .def_property_readonly("cols", [](const PySaved& s) { return s.s->cols; })
      .def_property_readonly("rank", [](const PySaved& s) { return s.s->rank; })
      .def_property_readonly("codes", [](const PySaved& s) { return s.s->codes; })
      .def_property_readonly("nbytes", [](const PySaved& s) { return s.s->nbytes(); })
      .def_static(
          "wrap",
          [](py::handle q, py::handle scale, int64_t rows, int64_t cols, int rank, int64_t stream,
             const std::string& op_name, bool codes) {
            const char* op = op_name.c_str();
            HOT_CHECK_VALUE(rows > 0 && cols > 0, op, ": saved activation rows and cols must be positive, got ", rows,
                            " and ", cols);
            HOT_CHECK_VALUE(rank >= 1 && rank <= 16, op, ": saved activation rank must be in 1..16, got ", rank);
            OpContext ctx(op, stream);
            auto s = std::make_shared<hot::SavedActivation>();
            s->rows = rows;
            s->cols = cols;
            s->rank = rank;
            s->codes = codes;
            hot::TensorView qv = ctx.input(q, "saved.q", hotpy::kS8, -2);
            const bool q_ro = ctx.last_read_only();
            s->q = hot::Tensor::wrap(qv, ctx.release_last());
            hot::TensorView sv = ctx.input(scale, "saved.scale", hotpy::kF32, -2);
            const bool s_ro = ctx.last_read_only();
            s->scale = hot::Tensor::wrap(sv, ctx.release_last());
            return PySaved{s, stream, q_ro, s_ro};
          },
          py::arg("q"), py::arg("scale"), py::arg("rows"), py::arg("cols"), py::arg("rank"), py::arg("stream"),
          py::arg("op") = "backward_linear", py::arg("codes") = false,
          "A core SavedActivation over the caller's q and scale arrays (no copy; they are kept alive); codes: q holds "
          "x's own int8 codes, transposed (im2col_t), and scale their scale (SPEC §4, g_w from G~'s codes).");

  m.def(
      "compress_activation",
      [](py::handle x, const hot::Config& config, int64_t stream, const std::string& op_name,
         const std::string& arg_name, py::handle q, py::handle scale, py::handle x_cast, bool codes,
         py::handle amax) {
        const char* op = op_name.c_str();
        const char* name = arg_name.c_str();
        const int rank = codes ? 16 : config.rank;
        OpContext ctx(op, stream);
        hot::TensorView xv = nonempty(ctx.input(x, name, hotpy::kFloat), op, name);
        auto s = std::make_shared<hot::SavedActivation>();
        if (q.is_none() != scale.is_none()) HOT_FAIL(value, op, ": give both q and scale outputs, or neither");
        if (!x_cast.is_none() && q.is_none()) HOT_FAIL(value, op, ": x_cast needs the q and scale outputs as well");
        if (!x_cast.is_none() && codes) HOT_FAIL(value, op, ": x_cast is for the ABC buffer, not x's codes");
        if (!amax.is_none() && !codes) HOT_FAIL(value, op, ": amax (x's, known) goes with codes");
        const hot::TensorView av = amax.is_none() ? hot::TensorView{} : ctx.input(amax, "amax", hotpy::kF32, -2);
        if (q.is_none()) {
          py::gil_scoped_release nogil;
          *s = !amax.is_none() ? hot::activation_codes(xv, av, ctx.stream())
               : codes         ? hot::activation_codes(xv, ctx.stream())
                               : hot::compress_activation(xv, rank, ctx.stream());
          return PySaved{s, stream};
        }
        // Caller-allocated buffers (the framework's allocator): write into them and keep them alive.
        s->rows = xv.shape[0];
        s->cols = xv.shape[1];
        s->rank = rank;
        s->codes = codes;
        hot::TensorView qv = ctx.output(q, "q", hotpy::kS8, -2);
        s->q = hot::Tensor::wrap(qv, ctx.release_last());
        hot::TensorView sv = ctx.output(scale, "scale", hotpy::kF32, -2);
        s->scale = hot::Tensor::wrap(sv, ctx.release_last());
        if (!x_cast.is_none()) {
          const hot::TensorView cv = ctx.output(x_cast, "x_cast", hotpy::kFloat);
          py::gil_scoped_release nogil;
          hot::compress_activation_cast(xv, cv, qv, sv, rank, ctx.stream());
          return PySaved{s, stream};
        }
        {
          py::gil_scoped_release nogil;
          if (!amax.is_none()) {
            hot::activation_codes(xv, qv, sv, av, ctx.stream());
          } else if (codes) {
            hot::activation_codes(xv, qv, sv, ctx.stream());
          } else {
            hot::compress_activation(xv, qv, sv, rank, ctx.stream());
          }
        }
        return PySaved{s, stream};
      },
      py::arg("x"), py::arg("config"), py::arg("stream"), py::arg("op") = "compress_activation",
      py::arg("name") = "x", py::arg("q") = py::none(), py::arg("scale") = py::none(),
      py::arg("x_cast") = py::none(), py::arg("codes") = false, py::arg("amax") = py::none(),
      "compress_activation(x, config.rank): the ABC buffer of x (a SavedActivation), into q and scale when given; "
      "with x_cast (an array of x's shape), x rounded to x_cast's dtype goes there and the buffer is x_cast's "
      "(compress_activation_cast). codes: x's own codes instead (activation_codes: rank 16, no rotation); amax: "
      "x's amax when known (relu_mask's; with codes): no pass to find it.");

  py::class_<PyQuantizedWeight>(m, "QuantizedWeight",
                                 "The core's W~ of the g_x path (q_wt: I x padded_k(O) int8, s_w: [1] float32).")
      .def_property_readonly("q_wt", [](const PyQuantizedWeight& q) { return Array(q.w->q_wt, q.stream_handle); })
      .def_property_readonly("s_w", [](const PyQuantizedWeight& q) { return Array(q.w->s_w, q.stream_handle); })
      .def_property_readonly("out_features", [](const PyQuantizedWeight& q) { return q.w->out_features; })
      .def_property_readonly("in_features", [](const PyQuantizedWeight& q) { return q.w->in_features; })
      .def_property_readonly("gx_bits", [](const PyQuantizedWeight& q) { return q.w->gx_bits; })
      .def_property_readonly("nbytes", [](const PyQuantizedWeight& q) { return q.w->nbytes(); });

  m.def(
      "quantize_weight",
      [](py::handle weight, const hot::Config& config, int64_t stream) {
        const char* op = "quantize_weight";
        HOT_CHECK_VALUE(!config.exact, op, ": config.exact is set; an exact backward uses the weight as it is");
        OpContext ctx(op, stream);
        hot::TensorView wv = ctx.input(weight, "weight", hotpy::kFloat, -2);
        HOT_CHECK_VALUE(wv.ndim() == 2, op, ": weight has ", wv.ndim(), " dims, expected 2 (O x I) (got shape ",
                        hot::shape_str(wv.shape), ")");
        wv = nonempty(wv, op, "weight");
        auto q = std::make_shared<hot::QuantizedWeight>();
        {
          py::gil_scoped_release nogil;
          *q = hot::quantize_weight(wv, config.gx_bits, ctx.stream());
        }
        return PyQuantizedWeight{q, stream};
      },
      py::arg("weight"), py::arg("config"), py::arg("stream"),
      "hot::quantize_weight(weight, config.gx_bits): W~ of the g_x path, for backward_linear's weight_q.");

  m.def(
      "backward_linear",
      [](py::handle grad_output, py::handle weight, py::handle saved, py::handle grad_input, py::handle grad_weight,
         py::handle grad_bias, bool need_grad_input, bool need_grad_weight, bool bias, const hot::Config& config,
         py::handle seed, int64_t stream, py::handle weight_q, py::handle grad_output_amax) {
        const char* op = "backward_linear";
        OpContext ctx(op, stream);
        hot::TensorView gy = nonempty(ctx.input(grad_output, "grad_output", hotpy::kFloat), op, "grad_output");
        const hot::Seed sd = seed_arg(ctx, op, seed);
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
        const hot::QuantizedWeight* wq = weight_q_arg(op, weight_q);
        HOT_CHECK_VALUE(wq == nullptr || !config.exact, op,
                        ": config.exact takes no weight_q (the weight is used as it is)");
        hot::BackwardOutputs outs;
        py::object rx = py::none(), rw = py::none(), rb = py::none();
        if (need_grad_input) rx = output(ctx, grad_input, "grad_input", hotpy::kFloat, out_dt, {L, I}, outs.grad_input);
        if (need_grad_weight)  // g_w from the codes comes in float32 (transformed in place)
          rw = output(ctx, grad_weight, "grad_weight", hotpy::kFloat,
                      sp != nullptr && sp->codes ? hot::DType::f32 : out_dt, {O, I}, outs.grad_weight);
        if (bias) rb = output(ctx, grad_bias, "grad_bias", hotpy::kFloat, out_dt, {O}, outs.grad_bias, -2);
        hot::TensorView av;  // G~'s amax, known to the caller (a hint the core takes where it needs nothing else)
        if (!grad_output_amax.is_none()) av = ctx.input(grad_output_amax, "grad_output_amax", hotpy::kF32, -2);
        {
          py::gil_scoped_release nogil;
          if (!config.exact && xv.data == nullptr)  // a SavedActivation, or no g_w
            hot::backward_linear(gy, wv, sp, config, sd, outs, ctx.stream(), wq, av.data != nullptr ? &av : nullptr);
          else
            hot::backward_linear(gy, wv, xv, config, sd, outs, ctx.stream(), wq);
        }
        return py::make_tuple(rx, rw, rb);
      },
      py::arg("grad_output"), py::arg("weight"), py::arg("saved"), py::arg("grad_input"), py::arg("grad_weight"),
      py::arg("grad_bias"), py::arg("need_grad_input"), py::arg("need_grad_weight"), py::arg("bias"),
      py::arg("config"), py::arg("seed"), py::arg("stream"), py::arg("weight_q") = py::none(),
      py::arg("grad_output_amax") = py::none(),
      "hot::backward_linear: (grad_input, grad_weight, grad_bias), each None where the caller gave the array or did "
      "not ask for it. saved: a SavedActivation, the raw x, or None without g_w. seed: an integer, or a one-element "
      "int64 array on grad_output's device (read by the kernels: hot::Seed). grad_output_amax: G~'s amax (float32 "
      "[1]) when known, e.g. batch_norm_backward_input's (not read with the raw x).");

  m.def(
      "backward_conv2d",
      [](py::handle grad_output, py::handle weight, py::handle saved, py::handle grad_input, py::handle grad_weight,
         py::handle grad_bias, bool need_grad_input, bool need_grad_weight, bool bias, std::vector<int64_t> nchw,
         std::vector<int> kernel, std::vector<int> stride, std::vector<int> padding, std::vector<int> dilation,
         bool patches, const hot::Config& config, py::handle seed, int64_t stream, py::handle weight_q,
         py::handle grad_output_amax) {
        const char* op = "backward_conv2d";
        const hot::ConvGeometry g = geometry(op, nchw, kernel, stride, padding, dilation, patches);
        OpContext ctx(op, stream);
        hot::TensorView gy = nonempty(ctx.input(grad_output, "grad_output", hotpy::kFloat), op, "grad_output");
        const hot::Seed sd = seed_arg(ctx, op, seed);
        hot::TensorView wv = nonempty(ctx.input(weight, "weight", hotpy::kFloat), op, "weight");
        const hot::SavedActivation* sp = nullptr;
        if (need_grad_weight) {
          HOT_CHECK_TYPE(py::isinstance<PySaved>(saved), op,
                         ": need_grad_weight=True needs `saved`, the ABC buffer of the columns (a SavedActivation), "
                         "got ", std::string(py::str(py::type::of(saved).attr("__name__"))));
          sp = saved.cast<const PySaved&>().s.get();
        }
        const hot::QuantizedWeight* wq = weight_q_arg(op, weight_q);
        const int64_t O = gy.ndim() == 2 ? gy.shape[1] : 0, CKK = wv.ndim() == 2 ? wv.shape[1] : 0;  // (else: the core)
        hot::BackwardOutputs outs;
        py::object rx = py::none(), rw = py::none(), rb = py::none();
        if (need_grad_input)
          rx = output(ctx, grad_input, "grad_input", hotpy::kFloat, gy.dtype, {g.N * g.H * g.W, g.C}, outs.grad_input);
        if (need_grad_weight)  // g_w from the codes comes in float32 (transformed in place)
          rw = output(ctx, grad_weight, "grad_weight", hotpy::kFloat, sp->codes ? hot::DType::f32 : gy.dtype, {O, CKK},
                      outs.grad_weight);
        if (bias) rb = output(ctx, grad_bias, "grad_bias", hotpy::kFloat, gy.dtype, {O}, outs.grad_bias, -2);
        hot::TensorView av;
        if (!grad_output_amax.is_none()) av = ctx.input(grad_output_amax, "grad_output_amax", hotpy::kF32, -2);
        {
          py::gil_scoped_release nogil;
          hot::backward_conv2d(gy, wv, sp, g, config, sd, outs, ctx.stream(), wq, av.data != nullptr ? &av : nullptr);
        }
        return py::make_tuple(rx, rw, rb);
      },
      py::arg("grad_output"), py::arg("weight"), py::arg("saved"), py::arg("grad_input"), py::arg("grad_weight"),
      py::arg("grad_bias"), py::arg("need_grad_input"), py::arg("need_grad_weight"), py::arg("bias"),
      py::arg("x_shape"), py::arg("kernel"), py::arg("stride"), py::arg("padding"), py::arg("dilation"),
      py::arg("patches"), py::arg("config"), py::arg("seed"), py::arg("stream"), py::arg("weight_q") = py::none(),
      py::arg("grad_output_amax") = py::none(),
      "hot::backward_conv2d: (grad_input as the channels-last map N*H*W x C, grad_weight, grad_bias), each None where "
      "the caller gave the array or did not ask for it. saved: the columns' SavedActivation, or None without g_w. "
      "grad_output_amax: G~'s amax (float32 [1]) when known, e.g. batch_norm_backward_input's.");
}

}  // namespace hotpy
