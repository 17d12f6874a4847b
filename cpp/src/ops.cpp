// Validation and dispatch of the public operations. Everything a user can get wrong is checked here,
// once, so that the backends can assume consistent arguments.
#include "hot/ops.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <string_view>
#include <utility>

#include "backend.h"
#include "hot/error.h"
#include "hot/quant_rules.h"

namespace hot {

namespace {

bool requested(const TensorView& v) { return v.data != nullptr; }

// The bytes a non-empty view with non-negative strides spans: [first byte, one past its last element).
std::pair<const char*, const char*> byte_span(const TensorView& t) {
  int64_t last = 0;
  for (size_t i = 0; i < t.shape.size(); ++i) last += (t.shape[i] - 1) * t.strides[i];
  const auto* b = static_cast<const char*>(t.data);
  return {b, b + (last + 1) * (dtype_bits(t.dtype) / 8)};
}

// CUDA tensors need a usable CUDA backend: compiled in and a device present.
void require_cuda() {
  if (!cuda::available())
    HOT_FAIL(unavailable, "CUDA tensors given, but the CUDA backend is unavailable: ", cuda::unavailable_reason());
}

const char* kFloatTypes = "float32, float16 or bfloat16";

// A 2-D, non-empty, row-major operand with unit column stride.
void check_matrix(const char* op, const char* name, const TensorView& t) {
  HOT_CHECK_DIM(op, name, t, 2);
  HOT_CHECK_VALUE(t.strides.size() == 2, op, ": ", name, " has ", t.strides.size(), " strides for 2 dims");
  HOT_CHECK_NONEMPTY(op, name, t);
  HOT_CHECK_VALUE(t.is_row_major_2d(), op, ": ", name, " must be row-major with unit column stride (got shape ",
                  shape_str(t.shape), " and strides ", shape_str(t.strides), "); pass a contiguous copy");
  HOT_CHECK_VALUE(t.data != nullptr, op, ": ", name, " has no data (null pointer)");
  if (t.dtype == DType::s4) {
    HOT_CHECK_VALUE(t.shape[1] % 2 == 0 && t.strides[0] % 2 == 0, op, ": ", name,
                    " (packed int4) needs an even number of columns and an even row stride, got shape ",
                    shape_str(t.shape), " and strides ", shape_str(t.strides));
  }
}

void check_float_matrix(const char* op, const char* name, const TensorView& t) {
  check_matrix(op, name, t);
  HOT_CHECK_DTYPE(op, name, t, is_float(t.dtype), kFloatTypes);
}

void check_typed_matrix(const char* op, const char* name, const TensorView& t, DType dt) {
  check_matrix(op, name, t);
  HOT_CHECK_DTYPE(op, name, t, t.dtype == dt, dtype_name(dt));
}

void check_vector(const char* op, const char* name, const TensorView& t, int64_t n, bool float_any, DType dt) {
  HOT_CHECK_DIM(op, name, t, 1);
  HOT_CHECK_VALUE(t.strides.size() == 1, op, ": ", name, " has ", t.strides.size(), " strides for 1 dim");
  HOT_CHECK_VALUE(t.shape[0] == n, op, ": ", name, " has shape ", shape_str(t.shape), ", expected (", n, ",)");
  HOT_CHECK_VALUE(n <= 1 || t.strides[0] == 1, op, ": ", name, " must be contiguous, got stride ", t.strides[0]);
  HOT_CHECK_VALUE(t.data != nullptr, op, ": ", name, " has no data (null pointer)");
  if (float_any) {
    HOT_CHECK_DTYPE(op, name, t, is_float(t.dtype), kFloatTypes);
  } else {
    HOT_CHECK_DTYPE(op, name, t, t.dtype == dt, dtype_name(dt));
  }
}

void check_out_shape(const char* op, const char* name, const TensorView& t, int64_t rows, int64_t cols) {
  HOT_CHECK_DIM(op, name, t, 2);
  const Shape want{rows, cols};
  HOT_CHECK_SHAPE(op, name, t, want);
}

void check_scale(const char* op, const char* name, const TensorView& scale, ScaleMode mode, int64_t rows) {
  check_vector(op, name, scale, mode == ScaleMode::tensor ? 1 : rows, false, DType::f32);
}

void check_bits(const char* op, int bits) {
  HOT_CHECK_VALUE(bits == 4 || bits == 8, op, ": bits must be 4 or 8, got ", bits);
}

void check_rank(const char* op, int rank) {
  HOT_CHECK_VALUE(rank >= 1 && rank <= 16, op, ": rank must be in 1..16, got ", rank);
}

// int32 accumulation of K products of magnitude <= qmax^2 must not overflow.
// `hint` says what the caller can do about it.
void check_k_fits(const char* op, const char* what, int64_t k, int qmax_a, int qmax_b, const char* hint) {
  const int64_t max_k = std::numeric_limits<int32_t>::max() / (static_cast<int64_t>(qmax_a) * qmax_b);
  HOT_CHECK_VALUE(k <= max_k, op, ": ", what, " has ", k, " terms; int32 accumulation of ", qmax_a, "x", qmax_b,
                  " products overflows past ", max_k, " (", hint, ")");
}

#define HOT_DISPATCH(device, fn, ...) \
  ((device).is_cpu() ? cpu::fn(__VA_ARGS__) : (require_cuda(), cuda::fn(__VA_ARGS__)))

}  // namespace

int64_t hla_rows(int64_t L, int rank) { return (L + 15) / 16 * rank; }
int64_t padded_k(int64_t k) { return (k + 15) / 16 * 16; }

void hadamard_transform(const TensorView& in, const TensorView& out, int block, int axis, Stream stream) {
  const char* op = "hadamard_transform";
  check_float_matrix(op, "input", in);
  check_typed_matrix(op, "out", out, DType::f32);
  HOT_CHECK_SHAPE(op, "out", out, in.shape);
  HOT_CHECK_SAME_DEVICE(op, "input", in, "out", out);
  HOT_CHECK_VALUE(axis == 0 || axis == 1 || axis == -1 || axis == -2, op, ": axis must be 0 or 1 (or -2, -1), got ",
                  axis);
  if (axis < 0) axis += 2;
  HOT_CHECK_VALUE(block >= 1 && block <= 256 && (block & (block - 1)) == 0, op,
                  ": block must be a power of two in 1..256, got ", block);
  const int64_t n = in.shape[axis];
  HOT_CHECK_VALUE(n % block == 0, op, ": block ", block, " does not divide dimension ", axis, " of input (size ", n,
                  ")");
  HOT_DISPATCH(in.device, hadamard_transform, in, out, block, axis, stream);
}

void hla_project(const TensorView& in, const TensorView& out, int rank, Stream stream) {
  const char* op = "hla";
  check_rank(op, rank);
  check_float_matrix(op, "input", in);
  check_typed_matrix(op, "out", out, DType::f32);
  check_out_shape(op, "out", out, hla_rows(in.shape[0], rank), in.shape[1]);
  HOT_CHECK_SAME_DEVICE(op, "input", in, "out", out);
  HOT_DISPATCH(in.device, hla_project, in, out, rank, stream);
}

namespace {
void quantize_with(const TensorView& in, const TensorView& q, const TensorView& scale, const QuantizeParams& p,
                   const TensorView* amax, Stream stream) {
  const char* op = "quantize";
  check_bits(op, p.bits);
  HOT_CHECK_VALUE(p.scale == ScaleMode::tensor || p.scale == ScaleMode::token, op,
                  ": scale must be tensor or token, got ", static_cast<int>(p.scale));
  HOT_CHECK_VALUE(p.rounding == Rounding::stochastic || p.rounding == Rounding::nearest, op,
                  ": rounding must be stochastic or nearest, got ", static_cast<int>(p.rounding));
  check_float_matrix(op, "input", in);
  check_typed_matrix(op, "q", q, DType::s8);
  HOT_CHECK_SHAPE(op, "q", q, in.shape);
  check_scale(op, "scale", scale, p.scale, in.shape[0]);
  HOT_CHECK_SAME_DEVICE(op, "input", in, "q", q);
  HOT_CHECK_SAME_DEVICE(op, "input", in, "scale", scale);
  if (amax != nullptr) {
    HOT_CHECK_VALUE(p.scale == ScaleMode::tensor, op, ": amax goes with scale tensor (one amax), got token");
    check_vector(op, "amax", *amax, 1, false, DType::f32);
    HOT_CHECK_SAME_DEVICE(op, "input", in, "amax", *amax);
  }
  HOT_DISPATCH(in.device, quantize, in, q, scale, p, amax, stream);
}
}  // namespace

void quantize(const TensorView& in, const TensorView& q, const TensorView& scale, const QuantizeParams& p,
              Stream stream) {
  quantize_with(in, q, scale, p, nullptr, stream);
}

void quantize(const TensorView& in, const TensorView& q, const TensorView& scale, const QuantizeParams& p,
              const TensorView& amax, Stream stream) {
  quantize_with(in, q, scale, p, &amax, stream);
}

void dequantize(const TensorView& q, const TensorView& scale, const TensorView& out, Stream stream) {
  const char* op = "dequantize";
  check_typed_matrix(op, "q", q, DType::s8);
  HOT_CHECK_DIM(op, "scale", scale, 1);
  const ScaleMode mode = scale.shape[0] == 1 && q.shape[0] != 1 ? ScaleMode::tensor : ScaleMode::token;
  HOT_CHECK_VALUE(scale.shape[0] == 1 || scale.shape[0] == q.shape[0], op, ": scale has shape ",
                  shape_str(scale.shape), ", expected (1,) or (", q.shape[0], ",) for q of shape ", shape_str(q.shape));
  check_scale(op, "scale", scale, mode, q.shape[0]);
  check_float_matrix(op, "out", out);
  HOT_CHECK_SHAPE(op, "out", out, q.shape);
  HOT_CHECK_SAME_DEVICE(op, "q", q, "scale", scale);
  HOT_CHECK_SAME_DEVICE(op, "q", q, "out", out);
  HOT_DISPATCH(q.device, dequantize, q, scale, out, stream);
}

int64_t ConvGeometry::out_h() const { return (H + 2 * ph - static_cast<int64_t>(dh) * (kh - 1) - 1) / sh + 1; }
int64_t ConvGeometry::out_w() const { return (W + 2 * pw - static_cast<int64_t>(dw) * (kw - 1) - 1) / sw + 1; }
bool ConvGeometry::overlapping() const {
  return sh < static_cast<int64_t>(dh) * (kh - 1) + 1 || sw < static_cast<int64_t>(dw) * (kw - 1) + 1;
}

namespace {

// The geometry of col2im / im2col: sizes, kernel, strides, padding and dilation in range, an output map, patch order
// possible; returns (Ho, Wo).
std::pair<int64_t, int64_t> check_conv_geometry(const char* op, const ConvGeometry& g) {
  HOT_CHECK_VALUE(g.N >= 0 && g.C >= 0 && g.H >= 0 && g.W >= 0, op, ": input shape (", g.N, ", ", g.C, ", ", g.H,
                  ", ", g.W, ") has a negative size");
  HOT_CHECK_VALUE(g.kh >= 1 && g.kw >= 1 && g.sh >= 1 && g.sw >= 1 && g.dh >= 1 && g.dw >= 1 && g.ph >= 0 && g.pw >= 0,
                  op, ": kernel (", g.kh, ", ", g.kw, "), stride (", g.sh, ", ", g.sw, ") and dilation (", g.dh, ", ",
                  g.dw, ") must be >= 1 and padding (", g.ph, ", ", g.pw, ") >= 0");
  constexpr int64_t kMax32 = 0x3fffffff;  // the per-pixel index arithmetic is 32-bit (conv_rules.h)
  HOT_CHECK_VALUE(g.H + 2 * g.ph <= kMax32 && g.W + 2 * g.pw <= kMax32 && g.C * g.W <= kMax32 &&
                      static_cast<int64_t>(g.kh) * g.kw * g.C <= kMax32 &&
                      static_cast<int64_t>(g.dh) * g.kh <= kMax32 && static_cast<int64_t>(g.dw) * g.kw <= kMax32,
                  op, ": map sides, C * W, kh * kw * C and dilated kernel sides must stay below 2^30, got (N, C, H, W) = (",
                  g.N, ", ", g.C, ", ", g.H, ", ", g.W, ") and kernel (", g.kh, ", ", g.kw, ")");
  const int64_t Ho = g.out_h(), Wo = g.out_w();
  HOT_CHECK_VALUE(Ho >= 1 && Wo >= 1, op, ": an input of ", g.H, " x ", g.W, " with kernel (", g.kh, ", ", g.kw,
                  "), padding (", g.ph, ", ", g.pw, ") and dilation (", g.dh, ", ", g.dw, ") has no output pixel");
  HOT_CHECK_VALUE(!g.patches || (Ho % 4 == 0 && Wo % 4 == 0), op,
                  ": patch order needs an output map whose sides are multiples of 4, got ", Ho, " x ", Wo);
  return {Ho, Wo};
}

}  // namespace

void col2im(const TensorView& cols, const ConvGeometry& g, const TensorView& out, Stream stream) {
  const char* op = "col2im";
  const auto [Ho, Wo] = check_conv_geometry(op, g);
  check_float_matrix(op, "cols", cols);
  check_float_matrix(op, "out", out);
  HOT_CHECK_SHAPE(op, "cols", cols, (std::vector<int64_t>{g.N * Ho * Wo, g.kh * g.kw * g.C}));
  HOT_CHECK_SHAPE(op, "out", out, (std::vector<int64_t>{g.N * g.H * g.W, g.C}));
  HOT_CHECK_DTYPE(op, "out", out, out.dtype == cols.dtype, dtype_name(cols.dtype));
  HOT_CHECK_SAME_DEVICE(op, "cols", cols, "out", out);
  HOT_DISPATCH(cols.device, col2im, cols, g, out, stream);
}

void im2col(const TensorView& map, const ConvGeometry& g, const TensorView& cols, Stream stream) {
  const char* op = "im2col";
  const auto [Ho, Wo] = check_conv_geometry(op, g);
  check_float_matrix(op, "map", map);
  check_float_matrix(op, "cols", cols);
  HOT_CHECK_SHAPE(op, "map", map, (std::vector<int64_t>{g.N * g.H * g.W, g.C}));
  HOT_CHECK_SHAPE(op, "cols", cols, (std::vector<int64_t>{g.N * Ho * Wo, g.kh * g.kw * g.C}));
  HOT_CHECK_DTYPE(op, "cols", cols, cols.dtype == map.dtype, dtype_name(map.dtype));
  HOT_CHECK_SAME_DEVICE(op, "map", map, "cols", cols);
  HOT_DISPATCH(map.device, im2col, map, g, cols, stream);
}

void im2col_t(const TensorView& map, const ConvGeometry& g, const TensorView& cols_t, Stream stream) {
  const char* op = "im2col_t";
  const auto [Ho, Wo] = check_conv_geometry(op, g);
  check_typed_matrix(op, "q_map", map, DType::s8);
  HOT_CHECK_SHAPE(op, "q_map", map, (std::vector<int64_t>{g.N * g.H * g.W, g.C}));
  check_typed_matrix(op, "cols_t", cols_t, DType::s8);
  const int64_t L = g.N * Ho * Wo, CKK = static_cast<int64_t>(g.kh) * g.kw * g.C;
  HOT_CHECK_VALUE(cols_t.shape[0] == CKK && cols_t.shape[1] >= L, op, ": cols_t has shape ", shape_str(cols_t.shape),
                  ", expected kh * kw * C = ", CKK, " rows and at least N * Ho * Wo = ", L, " columns");
  HOT_CHECK_SAME_DEVICE(op, "q_map", map, "cols_t", cols_t);
  const auto [mb, me] = byte_span(map);
  const auto [cb, ce] = byte_span(cols_t);
  HOT_CHECK_VALUE(me <= cb || ce <= mb, op, ": cols_t must not overlap q_map");
  HOT_DISPATCH(map.device, im2col_t, map, g, cols_t, stream);
}

namespace {

// x and y of an elementwise operation: n-element float vectors of one dtype on one device, y either x itself or
// apart from it.
void check_elementwise(const char* op, const char* xname, const TensorView& x, const char* yname,
                       const TensorView& y) {
  HOT_CHECK_DIM(op, xname, x, 1);
  HOT_CHECK_NONEMPTY(op, xname, x);
  check_vector(op, xname, x, x.shape[0], true, DType::f32);
  check_vector(op, yname, y, x.shape[0], true, DType::f32);
  HOT_CHECK_DTYPE(op, yname, y, y.dtype == x.dtype, dtype_name(x.dtype));
  HOT_CHECK_SAME_DEVICE(op, xname, x, yname, y);
  const auto [xb, xe] = byte_span(x);
  const auto [yb, ye] = byte_span(y);
  HOT_CHECK_VALUE(xb == yb || xe <= yb || ye <= xb, op, ": ", yname, " must be ", xname, " itself or not overlap it");
}

void check_mask_bits(const char* op, const TensorView& bits, const char* xname, const TensorView& x) {
  check_vector(op, "bits", bits, (x.shape[0] + 7) / 8, false, DType::s8);
  HOT_CHECK_SAME_DEVICE(op, xname, x, "bits", bits);
}

}  // namespace

void transpose(const TensorView& in, const TensorView& out, Stream stream) {
  const char* op = "transpose";
  HOT_CHECK_DIM(op, "in", in, 3);
  HOT_CHECK_DIM(op, "out", out, 3);
  const int bits = dtype_bits(in.dtype);
  HOT_CHECK_TYPE(bits == 8 || bits == 16 || bits == 32, op, ": in must have an 8-, 16- or 32-bit dtype, got ",
                 dtype_name(in.dtype));
  HOT_CHECK_DTYPE(op, "out", out, out.dtype == in.dtype, dtype_name(in.dtype));
  HOT_CHECK_SHAPE(op, "out", out, (std::vector<int64_t>{in.shape[0], in.shape[2], in.shape[1]}));
  HOT_CHECK_SAME_DEVICE(op, "in", in, "out", out);
  for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"in", &in}, {"out", &out}}) {
    HOT_CHECK_VALUE(t->shape[2] <= 1 || t->strides[2] == 1, op, ": ", name,
                    " needs unit stride in its last dim, got strides ", shape_str(t->strides));
    HOT_CHECK_VALUE(t->strides[0] >= 0 && t->strides[1] >= 0, op, ": ", name, " needs non-negative strides, got ",
                    shape_str(t->strides));
  }
  if (in.numel() == 0) return;
  const auto [ib, ie] = byte_span(in);
  const auto [ob, oe] = byte_span(out);
  HOT_CHECK_VALUE(ie <= ob || oe <= ib, op, ": out must not overlap in");
  HOT_DISPATCH(in.device, transpose, in, out, stream);
}

namespace {
void relu_mask_with(const TensorView& x, const TensorView& y, const TensorView& bits, const TensorView* amax,
                    Stream stream) {
  const char* op = "relu_mask";
  check_elementwise(op, "x", x, "y", y);
  check_mask_bits(op, bits, "x", x);
  if (amax != nullptr) {
    check_vector(op, "amax", *amax, 1, false, DType::f32);
    HOT_CHECK_SAME_DEVICE(op, "x", x, "amax", *amax);
    const auto [yb, ye] = byte_span(y);
    const auto [ab, ae] = byte_span(*amax);
    HOT_CHECK_VALUE(ae <= yb || ye <= ab, op, ": amax must not overlap y");
  }
  HOT_DISPATCH(x.device, relu_mask, x, y, bits, amax, stream);
}
}  // namespace

void relu_mask(const TensorView& x, const TensorView& y, const TensorView& bits, Stream stream) {
  relu_mask_with(x, y, bits, nullptr, stream);
}

void relu_mask(const TensorView& x, const TensorView& y, const TensorView& bits, const TensorView& amax,
               Stream stream) {
  relu_mask_with(x, y, bits, &amax, stream);
}

void relu_mask_backward(const TensorView& g_y, const TensorView& bits, const TensorView& g_x, Stream stream) {
  const char* op = "relu_mask_backward";
  check_elementwise(op, "g_y", g_y, "g_x", g_x);
  check_mask_bits(op, bits, "g_y", g_y);
  HOT_DISPATCH(g_y.device, relu_mask_backward, g_y, bits, g_x, stream);
}

namespace {

// A BatchNorm's per-channel views (null: absent): each f32 [C], C being ref's columns, on ref's device.
template <typename PerChannel>
void check_bn_channels(const char* op, const char* ref_name, const TensorView& ref, const PerChannel& per_channel) {
  for (const auto& [name, t] : per_channel) {
    if (t == nullptr) continue;
    check_vector(op, name, *t, ref.shape[1], false, DType::f32);
    HOT_CHECK_SAME_DEVICE(op, ref_name, ref, name, *t);
  }
}

using BnChannels = std::initializer_list<std::pair<const char*, const TensorView*>>;

// A BatchNorm backward's arguments: g_y and x R x C rows of one float dtype, each per-channel one (null: absent)
// f32 [C], all on g_y's device.
template <size_t N>
void check_bn_args(const char* op, const TensorView& g_y, const TensorView& x,
                   const std::pair<const char*, const TensorView*> (&per_channel)[N]) {
  check_float_matrix(op, "g_y", g_y);
  check_float_matrix(op, "x", x);
  HOT_CHECK_SHAPE(op, "x", x, g_y.shape);
  HOT_CHECK_DTYPE(op, "x", x, x.dtype == g_y.dtype, dtype_name(g_y.dtype));
  HOT_CHECK_SAME_DEVICE(op, "g_y", g_y, "x", x);
  check_bn_channels(op, "g_y", g_y, per_channel);
}

// Views the op writes overlap no other argument (null entries skipped; an output is named in `all` too, and is not
// compared with its own entry there, by name: one view passed as two arguments is an overlap).
void check_disjoint(const char* op, BnChannels outs, BnChannels all) {
  for (const auto& [on, o] : outs) {
    if (o == nullptr) continue;
    const auto [ob, oe] = byte_span(*o);
    for (const auto& [in, i] : all) {
      if (i == nullptr || std::string_view(in) == on) continue;
      const auto [ib, ie] = byte_span(*i);
      HOT_CHECK_VALUE(ie <= ob || oe <= ib, op, ": ", on, " must not overlap ", in);
    }
  }
}

}  // namespace

void batch_norm_stats(const TensorView& x, const TensorView& mean, const TensorView& invstd, float eps,
                      const TensorView* running_mean, const TensorView* running_var, float momentum, Stream stream) {
  const char* op = "batch_norm_stats";
  check_float_matrix(op, "x", x);
  check_bn_channels(op, "x", x, BnChannels{{"mean", &mean}, {"invstd", &invstd}, {"running_mean", running_mean},
                                           {"running_var", running_var}});
  HOT_CHECK_VALUE((running_mean == nullptr) == (running_var == nullptr), op,
                  ": running_mean and running_var are given both or neither");
  HOT_CHECK_VALUE(std::isfinite(eps) && eps >= 0.0f, op, ": eps must be finite and >= 0, got ", eps);
  HOT_CHECK_VALUE(momentum >= 0.0f && momentum <= 1.0f, op, ": momentum must be in [0, 1], got ", momentum);
  HOT_CHECK_VALUE(running_var == nullptr || x.shape[0] >= 2, op,
                  ": x needs at least 2 rows to update the running variance, got ", x.shape[0]);
  const BnChannels all = {
      {"x", &x}, {"mean", &mean}, {"invstd", &invstd}, {"running_mean", running_mean}, {"running_var", running_var}};
  check_disjoint(op, {{"mean", &mean}, {"invstd", &invstd}, {"running_mean", running_mean},
                      {"running_var", running_var}}, all);
  HOT_DISPATCH(x.device, batch_norm_stats, x, mean, invstd, eps, running_mean, running_var, momentum, stream);
}

void batch_norm_transform(const TensorView& x, const TensorView& mean, const TensorView& invstd,
                          const TensorView* weight, const TensorView* bias, const TensorView& y, Stream stream) {
  const char* op = "batch_norm_transform";
  check_float_matrix(op, "x", x);
  check_float_matrix(op, "y", y);
  HOT_CHECK_SHAPE(op, "y", y, x.shape);
  HOT_CHECK_DTYPE(op, "y", y, y.dtype == x.dtype, dtype_name(x.dtype));
  HOT_CHECK_SAME_DEVICE(op, "x", x, "y", y);
  check_bn_channels(op, "x", x, BnChannels{{"mean", &mean}, {"invstd", &invstd}, {"weight", weight}, {"bias", bias}});
  const bool in_place = y.data == x.data && y.strides == x.strides;
  check_disjoint(op, {{"y", &y}}, {{"x", in_place ? nullptr : &x}, {"mean", &mean}, {"invstd", &invstd},
                                   {"weight", weight}, {"bias", bias}});
  HOT_DISPATCH(x.device, batch_norm_transform, x, mean, invstd, weight, bias, y, stream);
}

void batch_norm_backward_reduce(const TensorView& g_y, const TensorView& x, const TensorView& mean,
                                const TensorView& invstd, const TensorView& sum_dy, const TensorView& sum_dy_xmu,
                                const TensorView* grad_weight, const TensorView* relu_bits, const TensorView* g_relu,
                                Stream stream) {
  const char* op = "batch_norm_backward_reduce";
  const std::pair<const char*, const TensorView*> per_channel[] = {{"mean", &mean},
                                                                   {"invstd", &invstd},
                                                                   {"sum_dy", &sum_dy},
                                                                   {"sum_dy_xmu", &sum_dy_xmu},
                                                                   {"grad_weight", grad_weight}};
  check_bn_args(op, g_y, x, per_channel);
  // The outputs (sum_dy, sum_dy_xmu, grad_weight) overlap neither the inputs nor each other.
  const TensorView* all[] = {&g_y, &x, &mean, &invstd, &sum_dy, &sum_dy_xmu, grad_weight};
  for (size_t i = 4; i < std::size(all); ++i)
    for (size_t k = 0; k < i && all[i] != nullptr; ++k) {
      const auto [ob, oe] = byte_span(*all[i]);
      const auto [ib, ie] = byte_span(*all[k]);
      HOT_CHECK_VALUE(ie <= ob || oe <= ib, op, ": ", per_channel[i - 2].first,
                      " must not overlap g_y, x, mean, invstd or another output");
    }
  HOT_CHECK_VALUE(g_relu == nullptr || relu_bits != nullptr, op, ": g_relu needs relu_bits");
  if (relu_bits != nullptr) {
    const int64_t n = g_y.shape[0] * g_y.shape[1];
    HOT_CHECK_VALUE(g_y.shape[0] <= 1 || g_y.strides[0] == g_y.shape[1], op,
                    ": with relu_bits, g_y's rows must be contiguous (row stride ", g_y.shape[1], "), got ",
                    g_y.strides[0]);
    check_vector(op, "relu_bits", *relu_bits, (n + 7) / 8, false, DType::s8);
    HOT_CHECK_SAME_DEVICE(op, "g_y", g_y, "relu_bits", *relu_bits);
  }
  if (g_relu != nullptr) {
    check_float_matrix(op, "g_relu", *g_relu);
    HOT_CHECK_SHAPE(op, "g_relu", *g_relu, g_y.shape);
    HOT_CHECK_DTYPE(op, "g_relu", *g_relu, g_relu->dtype == g_y.dtype, dtype_name(g_y.dtype));
    HOT_CHECK_SAME_DEVICE(op, "g_y", g_y, "g_relu", *g_relu);
    const auto [gb, ge] = byte_span(*g_relu);
    const bool same = g_relu->data == g_y.data && g_relu->strides == g_y.strides;
    const TensorView* others[] = {&g_y, &x, &mean, &invstd, &sum_dy, &sum_dy_xmu, grad_weight, relu_bits};
    for (const TensorView* in : others) {
      if (in == nullptr || (in == &g_y && same)) continue;
      const auto [ib, ie] = byte_span(*in);
      HOT_CHECK_VALUE(ie <= gb || ge <= ib, op, ": g_relu must be g_y itself or overlap no other argument");
    }
  }
  HOT_DISPATCH(g_y.device, batch_norm_backward_reduce, g_y, x, mean, invstd, sum_dy, sum_dy_xmu, grad_weight,
               relu_bits, g_relu, stream);
}

void batch_norm_backward_input(const TensorView& g_y, const TensorView& x, const TensorView& mean,
                               const TensorView& invstd, const TensorView* weight, const TensorView& sum_dy,
                               const TensorView& sum_dy_xmu, const TensorView& g_x, const TensorView& gt_amax,
                               Stream stream) {
  const char* op = "batch_norm_backward_input";
  const std::pair<const char*, const TensorView*> per_channel[] = {
      {"mean", &mean}, {"invstd", &invstd}, {"weight", weight}, {"sum_dy", &sum_dy}, {"sum_dy_xmu", &sum_dy_xmu}};
  check_bn_args(op, g_y, x, per_channel);
  check_float_matrix(op, "g_x", g_x);
  HOT_CHECK_SHAPE(op, "g_x", g_x, g_y.shape);
  HOT_CHECK_DTYPE(op, "g_x", g_x, g_x.dtype == g_y.dtype, dtype_name(g_y.dtype));
  check_vector(op, "gt_amax", gt_amax, 1, false, DType::f32);
  HOT_CHECK_SAME_DEVICE(op, "g_y", g_y, "g_x", g_x);
  HOT_CHECK_SAME_DEVICE(op, "g_y", g_y, "gt_amax", gt_amax);
  const auto [ob, oe] = byte_span(g_x);
  for (const TensorView* in : {&g_y, &x}) {
    const auto [ib, ie] = byte_span(*in);
    HOT_CHECK_VALUE(ie <= ob || oe <= ib, op, ": g_x must not overlap g_y or x");
  }
  HOT_DISPATCH(g_y.device, batch_norm_backward_input, g_y, x, mean, invstd, weight, sum_dy, sum_dy_xmu, g_x, gt_amax,
               stream);
}

namespace {

// Every output position's window along one axis holds an input position (its first in-bounds tap exists).
void check_pool_axis(const char* op, const char* axis, int64_t in, int64_t out, int k, int s, int p, int d) {
  for (const int64_t o : {int64_t{0}, out - 1}) {
    const int64_t start = o * s - p;
    const int64_t first = start >= 0 ? start : start + (-start + d - 1) / d * d;
    HOT_CHECK_VALUE(first <= start + static_cast<int64_t>(k - 1) * d && first < in, op, ": output ", axis, " ", o,
                    "'s window (positions ", start, " + ", d, " i, i < ", k, ") holds none of the input's 0..", in - 1);
  }
}

// x / g_x (N, C, H, W) and y / g_y, off (N, C, Ho, Wo) of a max-pool: dims, dtypes, one device, the window.
void check_pool(const char* op, const char* xname, const TensorView& x, const char* yname, const TensorView& y,
                const TensorView& off, const ConvGeometry& g) {
  HOT_CHECK_DIM(op, xname, x, 4);
  HOT_CHECK_DIM(op, yname, y, 4);
  HOT_CHECK_DIM(op, "off", off, 4);
  HOT_CHECK_DTYPE(op, xname, x, is_float(x.dtype), "a float dtype");
  HOT_CHECK_TYPE(y.dtype == x.dtype, op, ": ", yname, " has dtype ", dtype_name(y.dtype), " but ", xname, " has ",
                 dtype_name(x.dtype));
  HOT_CHECK_DTYPE(op, "off", off, off.dtype == DType::s8, "int8");
  HOT_CHECK_SHAPE(op, xname, x, (std::vector<int64_t>{g.N, g.C, g.H, g.W}));
  HOT_CHECK_VALUE(y.shape[0] == g.N && y.shape[1] == g.C && y.shape[2] >= 1 && y.shape[3] >= 1, op, ": ", yname,
                  " has shape ", shape_str(y.shape), ", expected (", g.N, ", ", g.C, ", Ho >= 1, Wo >= 1)");
  HOT_CHECK_SHAPE(op, "off", off, y.shape);
  HOT_CHECK_SAME_DEVICE(op, xname, x, yname, y);
  HOT_CHECK_SAME_DEVICE(op, xname, x, "off", off);
  HOT_CHECK_VALUE(g.N * g.C * g.H * g.W > 0, op, ": ", xname, " is empty (shape ", shape_str(x.shape), ")");
  HOT_CHECK_VALUE(g.kh >= 1 && g.kw >= 1 && g.sh >= 1 && g.sw >= 1 && g.dh >= 1 && g.dw >= 1 && g.ph >= 0 && g.pw >= 0,
                  op, ": kernel (", g.kh, ", ", g.kw, "), stride (", g.sh, ", ", g.sw, ") and dilation (", g.dh, ", ",
                  g.dw, ") must be >= 1 and padding (", g.ph, ", ", g.pw, ") >= 0");
  HOT_CHECK_VALUE(static_cast<int64_t>(g.kh) * g.kw <= 128, op, ": a window of ", g.kh, " x ", g.kw,
                  " taps; at most 128 fit the int8 offsets");
  HOT_CHECK_VALUE(!g.patches, op, ": patch order is a convolution's, not a max-pool's");
  check_pool_axis(op, "row", g.H, y.shape[2], g.kh, g.sh, g.ph, g.dh);
  check_pool_axis(op, "column", g.W, y.shape[3], g.kw, g.sw, g.pw, g.dw);
}

}  // namespace

void max_pool2d_offsets(const TensorView& x, const ConvGeometry& g, const TensorView& y, const TensorView& off,
                        Stream stream) {
  check_pool("max_pool2d_offsets", "x", x, "y", y, off, g);
  HOT_DISPATCH(x.device, max_pool2d_offsets, x, g, y, off, stream);
}

void max_pool2d_offsets_backward(const TensorView& g_y, const TensorView& off, const ConvGeometry& g,
                                 const TensorView& g_x, Stream stream) {
  check_pool("max_pool2d_offsets_backward", "g_x", g_x, "g_y", g_y, off, g);
  HOT_DISPATCH(g_y.device, max_pool2d_offsets_backward, g_y, off, g, g_x, stream);
}

void pack_int4(const TensorView& q, const TensorView& packed, Stream stream) {
  const char* op = "pack_int4";
  check_typed_matrix(op, "q", q, DType::s8);
  HOT_CHECK_VALUE(q.shape[1] % 2 == 0, op, ": q needs an even number of columns to pack two per byte, got shape ",
                  shape_str(q.shape));
  check_typed_matrix(op, "packed", packed, DType::s4);
  HOT_CHECK_SHAPE(op, "packed", packed, q.shape);
  HOT_CHECK_SAME_DEVICE(op, "q", q, "packed", packed);
  HOT_DISPATCH(q.device, pack_int4, q, packed, stream);
}

void unpack_int4(const TensorView& packed, const TensorView& q, Stream stream) {
  const char* op = "unpack_int4";
  check_typed_matrix(op, "packed", packed, DType::s4);
  check_typed_matrix(op, "q", q, DType::s8);
  HOT_CHECK_SHAPE(op, "q", q, packed.shape);
  HOT_CHECK_SAME_DEVICE(op, "packed", packed, "q", q);
  HOT_DISPATCH(q.device, unpack_int4, packed, q, stream);
}

namespace {
void check_gemm(const char* op, const TensorView& a, const TensorView& b, const TensorView& c, DType in) {
  check_typed_matrix(op, "a", a, in);
  check_typed_matrix(op, "b", b, in);
  check_typed_matrix(op, "c", c, DType::s32);
  HOT_CHECK_VALUE(a.shape[1] == b.shape[1], op, ": a is ", shape_str(a.shape), " and b is ", shape_str(b.shape),
                  "; both must have K columns (C = A B^T)");
  check_out_shape(op, "c", c, a.shape[0], b.shape[0]);
  HOT_CHECK_SAME_DEVICE(op, "a", a, "b", b);
  HOT_CHECK_SAME_DEVICE(op, "a", a, "c", c);
}
}  // namespace

void gemm_s8s8s32(const TensorView& a, const TensorView& b, const TensorView& c, Stream stream) {
  check_gemm("gemm_s8", a, b, c, DType::s8);
  check_k_fits("gemm_s8", "the contraction", a.shape[1], 128, 128, "split K");
  HOT_DISPATCH(a.device, gemm_s8s8s32, a, b, c, stream);
}

void gemm_s4s4s32(const TensorView& a, const TensorView& b, const TensorView& c, Stream stream) {
  check_gemm("gemm_s4", a, b, c, DType::s4);
  check_k_fits("gemm_s4", "the contraction", a.shape[1], 8, 8, "split K");
  HOT_DISPATCH(a.device, gemm_s4s4s32, a, b, c, stream);
}

namespace {
// The arguments of an ABC buffer of x: q_t s8 I x K_pad, scale f32 [1], on x's device.
void check_compress(const char* op, const TensorView& x, const TensorView& q_t, const TensorView& scale, int rank) {
  check_rank(op, rank);
  check_float_matrix(op, "x", x);
  check_typed_matrix(op, "q", q_t, DType::s8);
  check_out_shape(op, "q", q_t, x.shape[1], padded_k(hla_rows(x.shape[0], rank)));
  check_vector(op, "scale", scale, 1, false, DType::f32);
  HOT_CHECK_SAME_DEVICE(op, "x", x, "q", q_t);
  HOT_CHECK_SAME_DEVICE(op, "x", x, "scale", scale);
}
}  // namespace

void compress_activation(const TensorView& x, const TensorView& q_t, const TensorView& scale, int rank,
                         Stream stream) {
  check_compress("compress_activation", x, q_t, scale, rank);
  HOT_DISPATCH(x.device, compress_activation, x, q_t, scale, rank, stream);
}

namespace {
void activation_codes_with(const TensorView& x, const TensorView& q_t, const TensorView& scale, const TensorView* amax,
                           Stream stream) {
  const char* op = "activation_codes";
  check_compress(op, x, q_t, scale, 16);
  if (amax != nullptr) {
    check_vector(op, "amax", *amax, 1, false, DType::f32);
    HOT_CHECK_SAME_DEVICE(op, "x", x, "amax", *amax);
  }
  HOT_DISPATCH(x.device, activation_codes, x, q_t, scale, amax, stream);
}
}  // namespace

void activation_codes(const TensorView& x, const TensorView& q_t, const TensorView& scale, Stream stream) {
  activation_codes_with(x, q_t, scale, nullptr, stream);
}

void activation_codes(const TensorView& x, const TensorView& q_t, const TensorView& scale, const TensorView& amax,
                      Stream stream) {
  activation_codes_with(x, q_t, scale, &amax, stream);
}

void compress_activation_cast(const TensorView& x, const TensorView& x_cast, const TensorView& q_t,
                              const TensorView& scale, int rank, Stream stream) {
  const char* op = "compress_activation_cast";
  check_compress(op, x, q_t, scale, rank);
  check_float_matrix(op, "x_cast", x_cast);
  HOT_CHECK_SHAPE(op, "x_cast", x_cast, x.shape);
  HOT_CHECK_SAME_DEVICE(op, "x", x, "x_cast", x_cast);
  const auto [xb, xe] = byte_span(x);
  const auto [cb, ce] = byte_span(x_cast);
  HOT_CHECK_VALUE(xe <= cb || ce <= xb, op, ": x_cast must not overlap x");
  HOT_DISPATCH(x.device, compress_activation_cast, x, x_cast, q_t, scale, rank, stream);
}

void compress_columns(const TensorView& map, const ConvGeometry& g, const TensorView& q_t, const TensorView& scale,
                      int rank, Stream stream) {
  const char* op = "compress_columns";
  check_rank(op, rank);
  const auto [Ho, Wo] = check_conv_geometry(op, g);
  check_typed_matrix(op, "q_map", map, DType::s8);
  HOT_CHECK_SHAPE(op, "q_map", map, (std::vector<int64_t>{g.N * g.H * g.W, g.C}));
  const int64_t L = g.N * Ho * Wo, CKK = static_cast<int64_t>(g.kh) * g.kw * g.C;
  check_typed_matrix(op, "q", q_t, DType::s8);
  check_out_shape(op, "q", q_t, CKK, padded_k(hla_rows(L, rank)));
  check_vector(op, "scale", scale, 1, false, DType::f32);
  HOT_CHECK_SAME_DEVICE(op, "q_map", map, "q", q_t);
  HOT_CHECK_SAME_DEVICE(op, "q_map", map, "scale", scale);
  HOT_DISPATCH(map.device, compress_columns, map, g, q_t, scale, rank, stream);
}

namespace {
// The unfilled buffer (q I x padded_k(hla_rows(L, rank)), scale [1], on x's device) of a float matrix x (checked).
SavedActivation empty_saved(const char* op, const TensorView& x, int rank, bool codes, Stream stream) {
  check_rank(op, rank);
  check_float_matrix(op, "x", x);
  const int64_t L = x.shape[0], I = x.shape[1];
  SavedActivation s;
  s.rows = L;
  s.cols = I;
  s.rank = rank;
  s.codes = codes;
  s.q = Tensor::empty(DType::s8, {I, padded_k(hla_rows(L, rank))}, x.device, stream);
  s.scale = Tensor::empty(DType::f32, {1}, x.device, stream);
  return s;
}
}  // namespace

SavedActivation compress_activation(const TensorView& x, int rank, Stream stream) {
  SavedActivation s = empty_saved("compress_activation", x, rank, false, stream);
  compress_activation(x, s.q.view(), s.scale.view(), rank, stream);
  return s;
}

SavedActivation activation_codes(const TensorView& x, Stream stream) {
  SavedActivation s = empty_saved("activation_codes", x, 16, true, stream);
  activation_codes(x, s.q.view(), s.scale.view(), stream);
  return s;
}

SavedActivation activation_codes(const TensorView& x, const TensorView& amax, Stream stream) {
  SavedActivation s = empty_saved("activation_codes", x, 16, true, stream);
  activation_codes(x, s.q.view(), s.scale.view(), amax, stream);
  return s;
}

namespace {
// Checks shared by both backward entry points; returns (L, O, I).
void check_backward_common(const char* op, const TensorView& gy, const TensorView& w, const BackwardOutputs& out,
                           int64_t& L, int64_t& O, int64_t& I) {
  check_float_matrix(op, "grad_output", gy);
  HOT_CHECK_DIM(op, "weight", w, 2);
  check_float_matrix(op, "weight", w);
  L = gy.shape[0];
  O = gy.shape[1];
  I = w.shape[1];
  HOT_CHECK_VALUE(w.shape[0] == O, op, ": weight has shape ", shape_str(w.shape), " (O x I) but grad_output has ",
                  O, " columns (L x O); O must agree");
  HOT_CHECK_SAME_DEVICE(op, "grad_output", gy, "weight", w);
  if (requested(out.grad_input)) {
    check_float_matrix(op, "grad_input", out.grad_input);
    check_out_shape(op, "grad_input", out.grad_input, L, I);
    HOT_CHECK_SAME_DEVICE(op, "grad_output", gy, "grad_input", out.grad_input);
  }
  if (requested(out.grad_weight)) {
    check_float_matrix(op, "grad_weight", out.grad_weight);
    check_out_shape(op, "grad_weight", out.grad_weight, O, I);
    HOT_CHECK_SAME_DEVICE(op, "grad_output", gy, "grad_weight", out.grad_weight);
  }
  if (requested(out.grad_bias)) {
    check_vector(op, "grad_bias", out.grad_bias, O, true, DType::f32);
    HOT_CHECK_SAME_DEVICE(op, "grad_output", gy, "grad_bias", out.grad_bias);
  }
}

// A seed tensor (Seed::tensor): one s64 element on grad_output's device, 8-byte aligned (the kernels read it as one
// unsigned 64-bit word).
void check_seed(const char* op, const Seed& seed, const TensorView& gy) {
  const TensorView& t = seed.tensor;
  if (t.data == nullptr) return;
  HOT_CHECK_TYPE(t.dtype == DType::s64, op, ": the seed tensor has dtype ", dtype_name(t.dtype), ", expected int64");
  HOT_CHECK_VALUE(t.numel() == 1, op, ": the seed tensor has shape ", shape_str(t.shape),
                  ", expected one element (a 0-d or 1-element int64 tensor)");
  HOT_CHECK_SAME_DEVICE(op, "grad_output", gy, "the seed tensor", t);
  HOT_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data) % 8 == 0, op, ": the seed tensor's data is not 8-byte aligned");
}

// grad_output_amax (backward_linear, backward_conv2d): G~'s amax, f32 [1] on grad_output's device, or null.
void check_gy_amax(const char* op, const TensorView& gy, const TensorView* amax) {
  if (amax == nullptr) return;
  check_vector(op, "grad_output_amax", *amax, 1, false, DType::f32);
  HOT_CHECK_SAME_DEVICE(op, "grad_output", gy, "grad_output_amax", *amax);
}

// One integer backward over the rows of gy (L x O) whose g_w contraction fits one GEMM: q and scale are the ABC
// buffer of those rows (I x >= padded_k(hla_rows(L, rank)) s8, [1] f32; used when out.grad_weight is requested).
// conv: a stride-1 convolution whose g_x (the rows' images' channels-last map) is the transposed convolution of the
// codes of G~ (conv_grad_input), else nullptr (g_x = G~ W~ as a GEMM). gy_amax: G~'s amax when the caller knows it
// (backward_conv2d's grad_output_amax), taken where the g_y pass would find nothing else (the g_x path alone).
void backward_rows(const TensorView& gy, const QuantizedWeight& wq, const TensorView& q, const TensorView& scale,
                   const Config& config, const Seed& seed, const BackwardOutputs& out, Stream stream,
                   const ConvGeometry* conv = nullptr, bool codes = false, const TensorView* gy_amax = nullptr) {
  const bool gx = requested(out.grad_input), gw = requested(out.grad_weight), gb = requested(out.grad_bias);
  const bool gw_codes = gw && codes;  // g_w from G~'s codes and x's (SPEC §4): G~ is formed, G^ is not
  const int64_t L = gy.shape[0], O = gy.shape[1];
  const Device dev = gy.device;
  const int block = hq_block_size(O);
  const int64_t O_pad = padded_k(O);
  const int64_t K = gw && !gw_codes ? hla_rows(L, config.rank) : 0;

  GradOutputPlan plan;
  plan.gx = gx || gw_codes;
  plan.gx_bits = config.gx_bits;
  plan.block = block;
  plan.gx_scale = config.gx_scale;
  plan.gw = gw && !gw_codes;
  plan.rank = config.rank;
  plan.rounding = config.rounding;
  plan.seed = seed.value;
  plan.seed_ptr = seed.tensor.data != nullptr ? static_cast<const uint64_t*>(seed.tensor.data) : nullptr;
  plan.bias = gb;
  if (gy_amax != nullptr && takes_known_amax(plan)) plan.amax_key = static_cast<const unsigned*>(gy_amax->data);

  Tensor q_g, s_g, q_gh_t, s_gh, q_g_t;
  GradOutputQuant qo;
  if (plan.gx) {
    q_g = Tensor::empty(DType::s8, {L, O_pad}, dev, stream);
    s_g = Tensor::empty(DType::f32, {config.gx_scale == ScaleMode::tensor ? 1 : L}, dev, stream);
    qo.q_g = q_g.view();
    qo.s_g = s_g.view();
  }
  if (gw_codes) {  // x's codes q are I x padded_k(L) (checked): G~'s codes transposed to match
    q_g_t = Tensor::empty(DType::s8, {O, q.shape[1]}, dev, stream);
    qo.q_g_t = q_g_t.view();
  }
  if (plan.gw) {
    q_gh_t = Tensor::empty(DType::s8, {O, padded_k(K)}, dev, stream);
    s_gh = Tensor::empty(DType::f32, {1}, dev, stream);
    qo.q_gh_t = q_gh_t.view();
    qo.s_gh = s_gh.view();
  }
  if (gb) qo.g_b = out.grad_bias;
  HOT_DISPATCH(dev, quantize_grad_output, gy, plan, qo, stream);

  if (gx && conv != nullptr)
    HOT_DISPATCH(dev, conv_grad_input, q_g.view(), wq.q_wt.view(), s_g.view(), wq.s_w.view(), 1.0f / block, *conv,
                 out.grad_input, stream);
  else if (gx)
    HOT_DISPATCH(dev, gemm_s8_dequant, q_g.view(), wq.q_wt.view(), s_g.view(), wq.s_w.view(), 1.0f / block,
                 config.gx_bits, out.grad_input, stream);
  if (gw_codes) {
    // g_w = blockdiag(H_b) (G~ᵀ x) / b: G~'s codes transposed (q_g_t, O x K, zero past L: the K-major A operand,
    // written by the g_y pass) against x's codes (q: I x K), dequantised by s_g * s_x / b into grad_weight (f32), then
    // H_b along O in place
    HOT_DISPATCH(dev, gemm_s8_dequant, q_g_t.view(), q, s_g.view(), scale, 1.0f / block, 8, out.grad_weight, stream);
    HOT_DISPATCH(dev, hadamard_transform, out.grad_weight, out.grad_weight, block, 0, stream);
  } else if (gw) {
    HOT_DISPATCH(dev, gemm_s8_dequant, q_gh_t.view(), q, s_gh.view(), scale, 1.0f / 16.0f, 8, out.grad_weight,
                 stream);
  }
}

// The arguments of an integer backward over L rows (backward_linear's, and backward_conv2d's over its columns): shapes,
// devices, the saved ABC buffer or the raw x where g_w is wanted, the caller's W~ where g_x is
// wanted (`gx`: out.grad_input's shape is the caller's to check when it is not the L x I rows). Returns (L, O, I).
void check_backward_inputs(const char* op, const TensorView& gy, const TensorView& w, const SavedActivation* saved,
                           const TensorView* raw_x, const Config& config, const BackwardOutputs& out,
                           const QuantizedWeight* weight_q, bool gx, int64_t& L, int64_t& O, int64_t& I) {
  check_backward_common(op, gy, w, out, L, O, I);
  const bool gw = requested(out.grad_weight);
  const int rank = config.rank;
  if (gw && raw_x == nullptr) {
    HOT_CHECK_VALUE(saved != nullptr, op, ": grad_weight requested but no saved activation was given");
    HOT_CHECK_VALUE(saved->rows == L, op, ": saved activation has ", saved->rows, " rows (L) but grad_output has ",
                    L);
    HOT_CHECK_VALUE(saved->cols == I, op, ": saved activation has ", saved->cols, " columns (I) but weight has ", I);
    HOT_CHECK_VALUE(saved->rank == rank, op, ": saved activation was compressed with rank ", saved->rank,
                    " but config.rank is ", rank);
    const TensorView& q = saved->q.view();
    check_typed_matrix(op, "saved.q", q, DType::s8);
    check_out_shape(op, "saved.q", q, I, padded_k(hla_rows(L, rank)));
    if (saved->codes) {  // g_w from the codes of G~ and of x (SPEC §4): full rank, G~ in 8 bits with one scale
      HOT_CHECK_VALUE(rank == 16 && config.gx_bits == 8 && config.gx_scale == ScaleMode::tensor, op,
                      ": saved holds x's codes (saved.codes), which needs config.rank 16, gx_bits 8 and a per-tensor "
                      "g_x scale; got rank ", rank, ", gx_bits ", config.gx_bits, ", gx_scale ",
                      config.gx_scale == ScaleMode::tensor ? "tensor" : "token");
      HOT_CHECK_DTYPE(op, "grad_weight", out.grad_weight, out.grad_weight.dtype == DType::f32,
                      "float32 (g_w from the codes is transformed in float32 in place)");
    }
    check_vector(op, "saved.scale", saved->scale.view(), 1, false, DType::f32);
    HOT_CHECK_SAME_DEVICE(op, "grad_output", gy, "saved.q", q);
    HOT_CHECK_SAME_DEVICE(op, "grad_output", gy, "saved.scale", saved->scale.view());
  }
  if (gw && raw_x != nullptr) {
    check_float_matrix(op, "x", *raw_x);
    const Shape want{L, I};
    HOT_CHECK_SHAPE(op, "x", *raw_x, want);
    HOT_CHECK_SAME_DEVICE(op, "grad_output", gy, "x", *raw_x);
  }
  if (gx && weight_q != nullptr) {
    HOT_CHECK_VALUE(weight_q->out_features == O && weight_q->in_features == I, op, ": weight_q was formed from a ",
                    weight_q->out_features, " x ", weight_q->in_features, " weight but weight is ", O, " x ", I);
    HOT_CHECK_VALUE(weight_q->gx_bits == config.gx_bits, op, ": weight_q was quantised to ", weight_q->gx_bits,
                    " bits but config.gx_bits is ", config.gx_bits);
    check_typed_matrix(op, "weight_q.q_wt", weight_q->q_wt.view(), DType::s8);
    check_out_shape(op, "weight_q.q_wt", weight_q->q_wt.view(), I, padded_k(O));
    check_vector(op, "weight_q.s_w", weight_q->s_w.view(), 1, false, DType::f32);
    HOT_CHECK_SAME_DEVICE(op, "grad_output", gy, "weight_q.q_wt", weight_q->q_wt.view());
    HOT_CHECK_SAME_DEVICE(op, "grad_output", gy, "weight_q.s_w", weight_q->s_w.view());
  }
}

// backward_linear from the ABC buffer (saved) or the raw x: validation, then one backward over all rows (SPEC §4: the
// g_w contraction's integer sum is exact for any L, gemm_s8_dequant).
void backward_linear_impl(const TensorView& gy, const TensorView& w, const SavedActivation* saved,
                          const TensorView* raw_x, const Config& config, const Seed& seed, const BackwardOutputs& out,
                          Stream stream, const QuantizedWeight* weight_q, const TensorView* gy_amax = nullptr) {
  const char* op = "backward_linear";
  config.validate();
  HOT_CHECK_VALUE(!config.exact, op, ": config.exact is set; use backward_linear_exact with the raw x");
  const bool gx = requested(out.grad_input), gw = requested(out.grad_weight), gb = requested(out.grad_bias);
  int64_t L, O, I;
  check_backward_inputs(op, gy, w, saved, raw_x, config, out, weight_q, gx, L, O, I);
  check_seed(op, seed, gy);
  check_gy_amax(op, gy, gy_amax);
  const Device dev = gy.device;
  const int rank = config.rank;
  if (!gx && !gw && !gb) return;

  QuantizedWeight wq;  // the g_x path's W~: the caller's, or formed for this call
  if (gx) wq = weight_q != nullptr ? *weight_q : quantize_weight(w, config.gx_bits, stream);
  SavedActivation own;
  if (gw && raw_x != nullptr) {
    own.q = Tensor::empty(DType::s8, {I, padded_k(hla_rows(L, rank))}, dev, stream);
    own.scale = Tensor::empty(DType::f32, {1}, dev, stream);
    HOT_DISPATCH(dev, compress_activation, *raw_x, own.q.view(), own.scale.view(), rank, stream);
    saved = &own;
  }
  backward_rows(gy, wq, gw ? saved->q.view() : TensorView{}, gw ? saved->scale.view() : TensorView{}, config, seed,
                out, stream, nullptr, gw && saved->codes, gy_amax);
}

}  // namespace

void backward_conv2d(const TensorView& gy, const TensorView& w, const SavedActivation* saved, const ConvGeometry& g,
                     const Config& config, const Seed& seed, const BackwardOutputs& out, Stream stream,
                     const QuantizedWeight* weight_q, const TensorView* grad_output_amax) {
  const char* op = "backward_conv2d";
  config.validate();
  HOT_CHECK_VALUE(!config.exact, op, ": config.exact is set; the exact backward of a convolution is not hot's");
  const auto [Ho, Wo] = check_conv_geometry(op, g);
  const int64_t P = Ho * Wo, L = g.N * P, CKK = static_cast<int64_t>(g.kh) * g.kw * g.C;
  const bool gx = requested(out.grad_input), gw = requested(out.grad_weight);
  const Device dev = gy.device;
  BackwardOutputs rest = out;  // g_x is the channels-last map (checked below), not backward_linear's L x I rows
  rest.grad_input = TensorView{};
  int64_t rows, O, cols;
  check_backward_inputs(op, gy, w, saved, nullptr, config, rest, weight_q, gx, rows, O, cols);
  HOT_CHECK_VALUE(rows == L, op, ": grad_output has ", rows, " rows but the geometry has N * Ho * Wo = ", L,
                  " output pixels");
  HOT_CHECK_VALUE(cols == CKK, op, ": weight has ", cols, " columns but the geometry has kh * kw * C = ", CKK);
  check_seed(op, seed, gy);
  check_gy_amax(op, gy, grad_output_amax);
  if (gx) {
    check_float_matrix(op, "grad_input", out.grad_input);
    HOT_CHECK_SHAPE(op, "grad_input", out.grad_input, (std::vector<int64_t>{g.N * g.H * g.W, g.C}));
    HOT_CHECK_SAME_DEVICE(op, "grad_output", gy, "grad_input", out.grad_input);
  }
  // g_x straight from the codes of G~ where a window's sum has one scale and fits int32 (SPEC §8)
  const int qmax = qmax_for_bits(config.gx_bits);
  const int64_t o_pad = padded_k(O);
  const bool direct = gx && g.sh == 1 && g.sw == 1 && !g.patches && config.gx_scale == ScaleMode::tensor &&
                      g.ph <= static_cast<int64_t>(g.dh) * (g.kh - 1) && g.pw <= static_cast<int64_t>(g.dw) * (g.kw - 1) &&
                      static_cast<int64_t>(g.kh) * g.kw * o_pad <= std::numeric_limits<int32_t>::max() / (qmax * qmax);
  if (!direct) {  // the g_x GEMM into the columns, then col2im
    Tensor cols;
    BackwardOutputs lo = out;
    if (gx) {
      cols = Tensor::empty(out.grad_input.dtype, {L, CKK}, dev, stream);
      lo.grad_input = cols.view();
    }
    backward_linear_impl(gy, w, saved, nullptr, config, seed, lo, stream, weight_q, grad_output_amax);
    if (gx) HOT_DISPATCH(dev, col2im, cols.view(), g, out.grad_input, stream);
    return;
  }
  const QuantizedWeight wq = weight_q != nullptr ? *weight_q : quantize_weight(w, config.gx_bits, stream);
  backward_rows(gy, wq, gw ? saved->q.view() : TensorView{}, gw ? saved->scale.view() : TensorView{}, config, seed, out,
                stream, &g, gw && saved->codes, grad_output_amax);
}

QuantizedWeight quantize_weight(const TensorView& w, int gx_bits, Stream stream) {
  const char* op = "quantize_weight";
  check_float_matrix(op, "weight", w);
  check_bits(op, gx_bits);
  const int64_t O = w.shape[0], I = w.shape[1];
  QuantizedWeight wq;
  wq.out_features = O;
  wq.in_features = I;
  wq.gx_bits = gx_bits;
  wq.q_wt = Tensor::empty(DType::s8, {I, padded_k(O)}, w.device, stream);
  wq.s_w = Tensor::empty(DType::f32, {1}, w.device, stream);
  HOT_DISPATCH(w.device, quantize_weight, w, wq.q_wt.view(), wq.s_w.view(), gx_bits, hq_block_size(O), stream);
  return wq;
}

void backward_linear(const TensorView& gy, const TensorView& w, const SavedActivation* saved, const Config& config,
                     const Seed& seed, const BackwardOutputs& out, Stream stream, const QuantizedWeight* weight_q,
                     const TensorView* grad_output_amax) {
  backward_linear_impl(gy, w, saved, nullptr, config, seed, out, stream, weight_q, grad_output_amax);
}

void backward_linear(const TensorView& gy, const TensorView& w, const TensorView& x, const Config& config,
                     const Seed& seed, const BackwardOutputs& out, Stream stream, const QuantizedWeight* weight_q) {
  config.validate();
  if (config.exact) {
    backward_linear_exact(gy, w, requested(out.grad_weight) ? &x : nullptr, out, stream);
    return;
  }
  backward_linear_impl(gy, w, nullptr, &x, config, seed, out, stream, weight_q);
}

void backward_linear_exact(const TensorView& gy, const TensorView& w, const TensorView* x,
                           const BackwardOutputs& out, Stream stream) {
  const char* op = "backward_linear_exact";
  int64_t L, O, I;
  check_backward_common(op, gy, w, out, L, O, I);
  if (requested(out.grad_input)) {
    HOT_CHECK_TYPE(w.dtype == gy.dtype, op, ": weight has dtype ", dtype_name(w.dtype), " but grad_output has ",
                   dtype_name(gy.dtype), "; exact mode needs one dtype");
    HOT_DISPATCH(gy.device, matmul_exact, gy, false, w, false, out.grad_input, stream);
  }
  if (requested(out.grad_weight)) {
    HOT_CHECK_VALUE(x != nullptr, op, ": grad_weight requested but no x was given");
    check_float_matrix(op, "x", *x);
    const Shape want{L, I};
    HOT_CHECK_SHAPE(op, "x", *x, want);
    HOT_CHECK_SAME_DEVICE(op, "grad_output", gy, "x", *x);
    HOT_CHECK_TYPE(x->dtype == gy.dtype, op, ": x has dtype ", dtype_name(x->dtype), " but grad_output has ",
                   dtype_name(gy.dtype), "; exact mode needs one dtype");
    HOT_DISPATCH(gy.device, matmul_exact, gy, true, *x, false, out.grad_weight, stream);
  }
  if (requested(out.grad_bias)) HOT_DISPATCH(gy.device, bias_grad, gy, out.grad_bias, stream);
}

// The legacy default stream has two handles: nullptr and cudaStreamLegacy (1, DLPack's name for it).
static bool same_stream(Stream a, Stream b) {
  const auto h = [](Stream s) { return reinterpret_cast<uintptr_t>(s.handle) == 1 ? uintptr_t{0} : reinterpret_cast<uintptr_t>(s.handle); };
  return h(a) == h(b);
}

void stream_order(Device device, Stream first, Stream then) {
  if (device.is_cpu() || same_stream(first, then)) return;
  require_cuda();
  cuda::stream_order(device.index, first, then);
}

bool cuda_available() { return cuda::available(); }
std::string cuda_unavailable_reason() { return cuda::available() ? std::string() : cuda::unavailable_reason(); }
std::string build_info() {
  return detail::concat("hot core: cpu backend (", get_num_threads(), " threads)\n", cuda::build_info());
}

}  // namespace hot
