// hot._C's building blocks: the Hadamard transform, HLA, quantise / dequantise, int4 packing, the integer GEMMs, im2col
// and col2im, a convolution's ABC buffer from its int8 map, the batched transpose, the ReLU mask.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <string>

#include "bindings.h"
#include "hot/config.h"
#include "hot/error.h"
#include "hot/ops.h"

namespace py = pybind11;

namespace hotpy {

void register_blocks(py::module_& m) {
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
         const std::string& rounding, uint64_t seed, uint32_t rng_stream, int64_t stream, py::handle amax) {
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
        if (!amax.is_none()) {  // x's amax, known (relu_mask's)
          const hot::TensorView av = ctx.input(amax, "amax", hotpy::kF32, -2);
          py::gil_scoped_release nogil;
          hot::quantize(in, qv, sv, p, av, ctx.stream());
        } else {
          py::gil_scoped_release nogil;
          hot::quantize(in, qv, sv, p, ctx.stream());
        }
        return py::make_tuple(rq, rs);
      },
      py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("bits"), py::arg("scale_mode"), py::arg("rounding"),
      py::arg("seed"), py::arg("rng_stream"), py::arg("stream"), py::arg("amax") = py::none());

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
      "col2im",
      [](py::handle cols, py::handle out, std::vector<int64_t> nchw, std::vector<int> kernel, std::vector<int> stride,
         std::vector<int> padding, std::vector<int> dilation, bool patches, int64_t stream) {
        const char* op = "col2im";
        const hot::ConvGeometry g = geometry(op, nchw, kernel, stride, padding, dilation, patches);
        OpContext ctx(op, stream);
        hot::TensorView cv = nonempty(ctx.input(cols, "cols", hotpy::kFloat), op, "cols");
        hot::TensorView o;
        py::object r = output(ctx, out, "out", hotpy::kFloat, cv.dtype, {g.N * g.H * g.W, g.C}, o);
        {
          py::gil_scoped_release nogil;
          hot::col2im(cv, g, o, ctx.stream());
        }
        return r;
      },
      py::arg("cols"), py::arg("out"), py::arg("x_shape"), py::arg("kernel"), py::arg("stride"), py::arg("padding"),
      py::arg("dilation"), py::arg("patches"), py::arg("stream"));

  m.def(
      "im2col",
      [](py::handle map, py::handle cols, std::vector<int64_t> nchw, std::vector<int> kernel, std::vector<int> stride,
         std::vector<int> padding, std::vector<int> dilation, bool patches, int64_t stream) {
        const char* op = "im2col";
        const hot::ConvGeometry g = geometry(op, nchw, kernel, stride, padding, dilation, patches);
        OpContext ctx(op, stream);
        hot::TensorView mv = nonempty(ctx.input(map, "map", hotpy::kFloat), op, "map"), o;
        py::object r = output(ctx, cols, "cols", hotpy::kFloat, mv.dtype,
                              {std::max<int64_t>(0, g.N * g.out_h() * g.out_w()), static_cast<int64_t>(g.kh) * g.kw * g.C},
                              o);  // (no output pixel: hot::im2col names the geometry)
        {
          py::gil_scoped_release nogil;
          hot::im2col(mv, g, o, ctx.stream());
        }
        return r;
      },
      py::arg("map"), py::arg("cols"), py::arg("x_shape"), py::arg("kernel"), py::arg("stride"), py::arg("padding"),
      py::arg("dilation"), py::arg("patches"), py::arg("stream"));

  m.def(
      "compress_columns",
      [](py::handle map, py::handle q, py::handle scale, std::vector<int64_t> nchw, std::vector<int> kernel,
         std::vector<int> stride, std::vector<int> padding, std::vector<int> dilation, bool patches, int rank,
         int64_t stream) {
        const char* op = "compress_columns";
        const hot::ConvGeometry g = geometry(op, nchw, kernel, stride, padding, dilation, patches);
        HOT_CHECK_VALUE(rank >= 1 && rank <= 16, op, ": rank must be in 1..16, got ", rank);
        OpContext ctx(op, stream);
        hot::TensorView mv = nonempty(ctx.input(map, "q_map", hotpy::kS8), op, "q_map"), qv, sv;
        const int64_t L = std::max<int64_t>(0, g.N * g.out_h() * g.out_w());  // (none: the core names the geometry)
        py::object rq = output(ctx, q, "q", hotpy::kS8, hot::DType::s8,
                               {static_cast<int64_t>(g.kh) * g.kw * g.C, hot::padded_k(hot::hla_rows(L, rank))}, qv, -2);
        py::object rs = output(ctx, scale, "scale", hotpy::kF32, hot::DType::f32, {1}, sv, -2);
        {
          py::gil_scoped_release nogil;
          hot::compress_columns(mv, g, qv, sv, rank, ctx.stream());
        }
        return py::make_tuple(rq, rs);
      },
      py::arg("map"), py::arg("q"), py::arg("scale"), py::arg("x_shape"), py::arg("kernel"), py::arg("stride"),
      py::arg("padding"), py::arg("dilation"), py::arg("patches"), py::arg("rank"), py::arg("stream"));

  m.def(
      "im2col_t",
      [](py::handle map, py::handle cols_t, std::vector<int64_t> nchw, std::vector<int> kernel, std::vector<int> stride,
         std::vector<int> padding, std::vector<int> dilation, bool patches, int64_t stream) {
        const char* op = "im2col_t";
        const hot::ConvGeometry g = geometry(op, nchw, kernel, stride, padding, dilation, patches);
        OpContext ctx(op, stream);
        hot::TensorView mv = nonempty(ctx.input(map, "q_map", hotpy::kS8), op, "q_map"), o;
        const int64_t L = std::max<int64_t>(0, g.N * g.out_h() * g.out_w());  // (none: the core names the geometry)
        py::object r = output(ctx, cols_t, "cols_t", hotpy::kS8, hot::DType::s8,
                              {static_cast<int64_t>(g.kh) * g.kw * g.C, hot::padded_k(L)}, o, -2);
        {
          py::gil_scoped_release nogil;
          hot::im2col_t(mv, g, o, ctx.stream());
        }
        return r;
      },
      py::arg("map"), py::arg("cols_t"), py::arg("x_shape"), py::arg("kernel"), py::arg("stride"), py::arg("padding"),
      py::arg("dilation"), py::arg("patches"), py::arg("stream"));

  m.def(
      "transpose",
      [](py::handle in, py::handle out, int64_t stream) {
        const char* op = "transpose";
        OpContext ctx(op, stream);
        hot::TensorView iv = ctx.input(in, "in", hotpy::kFloat | hotpy::kS8, -2), ov;
        HOT_CHECK_DIM(op, "in", iv, 3);
        py::object r = output(ctx, out, "out", hotpy::kFloat | hotpy::kS8, iv.dtype,
                              {iv.shape[0], iv.shape[2], iv.shape[1]}, ov, -2);
        {
          py::gil_scoped_release nogil;
          hot::transpose(iv, ov, ctx.stream());
        }
        return r;
      },
      py::arg("in"), py::arg("out"), py::arg("stream"));

  m.def(
      "relu_mask",
      [](py::handle x, py::handle y, py::handle bits, int64_t stream, py::handle amax) -> py::tuple {
        const char* op = "relu_mask";
        OpContext ctx(op, stream);
        hot::TensorView xv = ctx.input(x, "x", hotpy::kFloat, -2), yv, bv;
        py::object ry = output(ctx, y, "y", hotpy::kFloat, xv.dtype, xv.shape, yv, -2);
        py::object rb = output(ctx, bits, "bits", hotpy::kS8, hot::DType::s8, {(xv.numel() + 7) / 8}, bv, -2);
        if (py::isinstance<py::bool_>(amax) && !amax.cast<bool>()) {
          {
            py::gil_scoped_release nogil;
            hot::relu_mask(xv, yv, bv, ctx.stream());
          }
          return py::make_tuple(ry, rb);
        }
        hot::TensorView av;  // amax True or an array: y's amax as well, into a new f32 [1] or the caller's
        py::object ra = output(ctx, py::isinstance<py::bool_>(amax) ? py::none() : amax, "amax", hotpy::kF32,
                               hot::DType::f32, {1}, av, -2);
        {
          py::gil_scoped_release nogil;
          hot::relu_mask(xv, yv, bv, av, ctx.stream());
        }
        return py::make_tuple(ry, rb, ra);
      },
      py::arg("x"), py::arg("y"), py::arg("bits"), py::arg("stream"), py::arg("amax") = false);

  m.def(
      "relu_mask_backward",
      [](py::handle g_y, py::handle bits, py::handle g_x, int64_t stream) {
        const char* op = "relu_mask_backward";
        OpContext ctx(op, stream);
        hot::TensorView gv = ctx.input(g_y, "g_y", hotpy::kFloat, -2);
        hot::TensorView bv = ctx.input(bits, "bits", hotpy::kS8, -2), ov;
        py::object r = output(ctx, g_x, "g_x", hotpy::kFloat, gv.dtype, gv.shape, ov, -2);
        {
          py::gil_scoped_release nogil;
          hot::relu_mask_backward(gv, bv, ov, ctx.stream());
        }
        return r;
      },
      py::arg("g_y"), py::arg("bits"), py::arg("g_x"), py::arg("stream"));

  m.def(
      "batch_norm_stats",
      [](py::handle x, py::handle mean, py::handle invstd, float eps, py::handle running_mean,
         py::handle running_var, float momentum, int64_t stream) {
        const char* op = "batch_norm_stats";
        OpContext ctx(op, stream);
        const hot::TensorView xv = ctx.input(x, "x", hotpy::kFloat);
        const hot::Shape c{xv.shape.size() == 2 ? xv.shape[1] : 0};
        hot::TensorView mv, iv, rmv, rvv;
        py::object rm = output(ctx, mean, "mean", hotpy::kF32, hot::DType::f32, c, mv, -2);
        py::object ri = output(ctx, invstd, "invstd", hotpy::kF32, hot::DType::f32, c, iv, -2);
        if (!running_mean.is_none()) rmv = ctx.output(running_mean, "running_mean", hotpy::kF32, -2);
        if (!running_var.is_none()) rvv = ctx.output(running_var, "running_var", hotpy::kF32, -2);
        {
          py::gil_scoped_release nogil;
          hot::batch_norm_stats(xv, mv, iv, eps, running_mean.is_none() ? nullptr : &rmv,
                                running_var.is_none() ? nullptr : &rvv, momentum, ctx.stream());
        }
        return py::make_tuple(rm, ri);
      },
      py::arg("x"), py::arg("mean"), py::arg("invstd"), py::arg("eps"), py::arg("running_mean"),
      py::arg("running_var"), py::arg("momentum"), py::arg("stream"),
      "hot::batch_norm_stats over rows of channels (a channels-last map flattened to N*H*W x C): (mean, invstd), each "
      "None where the caller gave the array; running_mean, running_var (float32 [C] or None) updated in place.");

  m.def(
      "batch_norm_transform",
      [](py::handle x, py::handle mean, py::handle invstd, py::handle weight, py::handle bias, py::handle y,
         int64_t stream) {
        const char* op = "batch_norm_transform";
        OpContext ctx(op, stream);
        const hot::TensorView xv = ctx.input(x, "x", hotpy::kFloat);
        const hot::TensorView mv = ctx.input(mean, "mean", hotpy::kF32, -2);
        const hot::TensorView iv = ctx.input(invstd, "invstd", hotpy::kF32, -2);
        hot::TensorView wv, bv, yv;
        if (!weight.is_none()) wv = ctx.input(weight, "weight", hotpy::kF32, -2);
        if (!bias.is_none()) bv = ctx.input(bias, "bias", hotpy::kF32, -2);
        py::object ry = output(ctx, y, "y", hotpy::kFloat, xv.dtype, xv.shape, yv);
        {
          py::gil_scoped_release nogil;
          hot::batch_norm_transform(xv, mv, iv, weight.is_none() ? nullptr : &wv, bias.is_none() ? nullptr : &bv, yv,
                                    ctx.stream());
        }
        return ry;
      },
      py::arg("x"), py::arg("mean"), py::arg("invstd"), py::arg("weight"), py::arg("bias"), py::arg("y"),
      py::arg("stream"),
      "hot::batch_norm_transform over rows of channels (a channels-last map flattened to N*H*W x C): y, None where the "
      "caller gave the array.");

  m.def(
      "batch_norm_backward_reduce",
      [](py::handle g_y, py::handle x, py::handle mean, py::handle invstd, py::handle sum_dy, py::handle sum_dy_xmu,
         py::handle grad_weight, int64_t stream, py::handle relu_bits, py::handle g_relu) {
        const char* op = "batch_norm_backward_reduce";
        OpContext ctx(op, stream);
        const hot::TensorView gv = ctx.input(g_y, "g_y", hotpy::kFloat), xv = ctx.input(x, "x", hotpy::kFloat);
        const hot::TensorView mv = ctx.input(mean, "mean", hotpy::kF32, -2);
        const hot::TensorView iv = ctx.input(invstd, "invstd", hotpy::kF32, -2);
        hot::TensorView sv, sxv, wv;
        const hot::Shape c{gv.shape.size() == 2 ? gv.shape[1] : 0};
        py::object rs = output(ctx, sum_dy, "sum_dy", hotpy::kF32, hot::DType::f32, c, sv, -2);
        py::object rsx = output(ctx, sum_dy_xmu, "sum_dy_xmu", hotpy::kF32, hot::DType::f32, c, sxv, -2);
        py::object rw = py::none();  // grad_weight None: not asked; True: into a new f32 [C]; an array: into it
        if (!grad_weight.is_none())
          rw = output(ctx, py::isinstance<py::bool_>(grad_weight) ? py::none() : grad_weight, "grad_weight",
                      hotpy::kF32, hot::DType::f32, c, wv, -2);
        hot::TensorView bv, gv_relu;  // the ReLU's bits and the masked gradient, each where given
        if (!relu_bits.is_none()) bv = ctx.input(relu_bits, "relu_bits", hotpy::kS8, -2);
        if (!g_relu.is_none()) gv_relu = ctx.output(g_relu, "g_relu", hotpy::kFloat);
        {
          py::gil_scoped_release nogil;
          hot::batch_norm_backward_reduce(gv, xv, mv, iv, sv, sxv, grad_weight.is_none() ? nullptr : &wv,
                                          relu_bits.is_none() ? nullptr : &bv, g_relu.is_none() ? nullptr : &gv_relu,
                                          ctx.stream());
        }
        return py::make_tuple(rs, rsx, rw);
      },
      py::arg("g_y"), py::arg("x"), py::arg("mean"), py::arg("invstd"), py::arg("sum_dy"), py::arg("sum_dy_xmu"),
      py::arg("grad_weight"), py::arg("stream"), py::arg("relu_bits") = py::none(), py::arg("g_relu") = py::none(),
      "hot::batch_norm_backward_reduce over rows of channels (a channels-last map flattened to N*H*W x C): (sum_dy, "
      "sum_dy_xmu, grad_weight), each None where the caller gave the array or did not ask for it; relu_bits, "
      "g_relu: the ReLU after the BatchNorm (its bits; the masked gradient, written where given).");

  m.def(
      "batch_norm_backward_input",
      [](py::handle g_y, py::handle x, py::handle mean, py::handle invstd, py::handle weight, py::handle sum_dy,
         py::handle sum_dy_xmu, py::handle g_x, py::handle gt_amax, int64_t stream) {
        const char* op = "batch_norm_backward_input";
        OpContext ctx(op, stream);
        const hot::TensorView gv = ctx.input(g_y, "g_y", hotpy::kFloat), xv = ctx.input(x, "x", hotpy::kFloat);
        const hot::TensorView mv = ctx.input(mean, "mean", hotpy::kF32, -2);
        const hot::TensorView iv = ctx.input(invstd, "invstd", hotpy::kF32, -2);
        const hot::TensorView sv = ctx.input(sum_dy, "sum_dy", hotpy::kF32, -2);
        const hot::TensorView sxv = ctx.input(sum_dy_xmu, "sum_dy_xmu", hotpy::kF32, -2);
        hot::TensorView wv, ov, av;
        if (!weight.is_none()) wv = ctx.input(weight, "weight", hotpy::kF32, -2);
        py::object rx = output(ctx, g_x, "g_x", hotpy::kFloat, gv.dtype, gv.shape, ov);
        py::object ra = output(ctx, gt_amax, "gt_amax", hotpy::kF32, hot::DType::f32, {1}, av, -2);
        {
          py::gil_scoped_release nogil;
          hot::batch_norm_backward_input(gv, xv, mv, iv, weight.is_none() ? nullptr : &wv, sv, sxv, ov, av,
                                         ctx.stream());
        }
        return py::make_tuple(rx, ra);
      },
      py::arg("g_y"), py::arg("x"), py::arg("mean"), py::arg("invstd"), py::arg("weight"), py::arg("sum_dy"),
      py::arg("sum_dy_xmu"), py::arg("g_x"), py::arg("gt_amax"), py::arg("stream"),
      "hot::batch_norm_backward_input over rows of channels (a channels-last map flattened to N*H*W x C): (g_x, "
      "gt_amax), each None where the caller gave the array.");

  m.def(
      "max_pool2d_offsets",
      [](py::handle x, py::handle y, py::handle off, std::vector<int> kernel, std::vector<int> stride,
         std::vector<int> padding, std::vector<int> dilation, int64_t stream) {
        const char* op = "max_pool2d_offsets";
        OpContext ctx(op, stream);
        const hot::TensorView xv = ctx.input(x, "x", hotpy::kFloat, -2);
        const hot::TensorView yv = ctx.output(y, "y", hotpy::kFloat, -2);
        const hot::TensorView ov = ctx.output(off, "off", hotpy::kS8, -2);
        HOT_CHECK_VALUE(xv.ndim() == 4, op, ": x has ", xv.ndim(), " dims, expected 4 (N, C, H, W)");
        const hot::ConvGeometry g = geometry(op, xv.shape, kernel, stride, padding, dilation, false);
        {
          py::gil_scoped_release nogil;
          hot::max_pool2d_offsets(xv, g, yv, ov, ctx.stream());
        }
      },
      py::arg("x"), py::arg("y"), py::arg("off"), py::arg("kernel"), py::arg("stride"), py::arg("padding"),
      py::arg("dilation"), py::arg("stream"),
      "hot::max_pool2d_offsets into the caller's y and off (4-D, any strides).");

  m.def(
      "max_pool2d_offsets_backward",
      [](py::handle g_y, py::handle off, py::handle g_x, std::vector<int> kernel, std::vector<int> stride,
         std::vector<int> padding, std::vector<int> dilation, int64_t stream) {
        const char* op = "max_pool2d_offsets_backward";
        OpContext ctx(op, stream);
        const hot::TensorView gv = ctx.input(g_y, "g_y", hotpy::kFloat, -2);
        const hot::TensorView ov = ctx.input(off, "off", hotpy::kS8, -2);
        const hot::TensorView xv = ctx.output(g_x, "g_x", hotpy::kFloat, -2);
        HOT_CHECK_VALUE(xv.ndim() == 4, op, ": g_x has ", xv.ndim(), " dims, expected 4 (N, C, H, W)");
        const hot::ConvGeometry g = geometry(op, xv.shape, kernel, stride, padding, dilation, false);
        {
          py::gil_scoped_release nogil;
          hot::max_pool2d_offsets_backward(gv, ov, g, xv, ctx.stream());
        }
      },
      py::arg("g_y"), py::arg("off"), py::arg("g_x"), py::arg("kernel"), py::arg("stride"), py::arg("padding"),
      py::arg("dilation"), py::arg("stream"),
      "hot::max_pool2d_offsets_backward into the caller's g_x (4-D, any strides).");

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
}

}  // namespace hotpy
