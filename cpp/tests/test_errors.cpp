// Argument validation: wrong dtype -> ErrorKind::type, wrong dims/shape/empty/layout/config ->
// ErrorKind::value, and messages that name the operation, the argument and what was given.
#include "test_util.h"

namespace {

using namespace hot_test;
using hot::ErrorKind;

#define EXPECT_HOT_ERROR(stmt, kind, ...) EXPECT_TRUE(throws_hot([&] { stmt; }, ErrorKind::kind, {__VA_ARGS__}))

HostTensor f32(int64_t r, int64_t c) { return HostTensor::make2d(DType::f32, r, c); }

TEST(Cpu_Errors, HadamardTransform) {
  const HostTensor in = f32(4, 32), out = f32(4, 32);
  EXPECT_NO_THROW(hot::hadamard_transform(in, out, 16, 1));
  const HostTensor s8 = HostTensor::make2d(DType::s8, 4, 32);
  EXPECT_HOT_ERROR(hot::hadamard_transform(s8, out, 16, 1), type, "hadamard_transform", hot::dtype_name(DType::s8));
  const HostTensor h = HostTensor::make2d(DType::f16, 4, 32);
  EXPECT_HOT_ERROR(hot::hadamard_transform(in, h, 16, 1), type, "hadamard_transform", "out", hot::dtype_name(DType::f16));
  for (int bad : {0, 3, 24, 512, -16})
    EXPECT_HOT_ERROR(hot::hadamard_transform(in, out, bad, 1), value, "hadamard_transform", "block", std::to_string(bad));
  EXPECT_HOT_ERROR(hot::hadamard_transform(in, out, 64, 1), value, "block", "64");   // does not divide 32
  EXPECT_HOT_ERROR(hot::hadamard_transform(in, out, 8, 0), value, "block", "8");     // does not divide 4 rows
  EXPECT_HOT_ERROR(hot::hadamard_transform(in, out, 4, 2), value, "axis", "2");
  EXPECT_HOT_ERROR(hot::hadamard_transform(in, f32(4, 16), 16, 1), value, "out", hot::shape_str({4, 16}));
  const HostTensor v1 = HostTensor::make1d(DType::f32, 32);
  EXPECT_HOT_ERROR(hot::hadamard_transform(v1, v1, 16, 1), value, "hadamard_transform", "dims");
  const HostTensor empty = f32(0, 32);
  EXPECT_HOT_ERROR(hot::hadamard_transform(empty, empty, 16, 1), value, "empty");
}

TEST(Cpu_Errors, LayoutAndPointer) {
  const HostTensor out = f32(4, 32);
  HostTensor store = f32(32, 4);
  // a transposed (column-major) view: unit row stride
  TensorView t = store.view();
  t.shape = {4, 32};
  t.strides = {1, 4};
  EXPECT_HOT_ERROR(hot::hadamard_transform(t, out, 16, 1), value, "row-major");
  // row stride smaller than the number of columns
  TensorView s = out.view();
  s.strides = {16, 1};
  EXPECT_HOT_ERROR(hot::hadamard_transform(s, out, 16, 1), value, "stride");
  TensorView n = out.view();
  n.data = nullptr;
  EXPECT_HOT_ERROR(hot::hadamard_transform(n, out, 16, 1), value, "null");
  // 3 dims
  TensorView d3 = out.view();
  d3.shape = {2, 2, 32};
  d3.strides = {64, 32, 1};
  EXPECT_HOT_ERROR(hot::hadamard_transform(d3, out, 16, 1), value, "3 dims");
}

TEST(Cpu_Errors, DeviceMismatchAndUnavailableBackend) {
  const HostTensor in = f32(4, 32), out = f32(4, 32);
  TensorView cu = out.view();
  cu.device = hot::Device::cuda(0);
  EXPECT_HOT_ERROR(hot::hadamard_transform(in, cu, 16, 1), value, "device");
  EXPECT_NE(hot::build_info().find("cpu"), std::string::npos) << hot::build_info();
  if (!hot::cuda_available()) {
    EXPECT_FALSE(hot::cuda_unavailable_reason().empty());
    TensorView ci = in.view();
    ci.device = hot::Device::cuda(0);
    // every tensor on a CUDA device that is not compiled in / not present: unavailable, not a crash
    EXPECT_TRUE(throws_hot([&] { hot::hadamard_transform(ci, cu, 16, 1); }, ErrorKind::unavailable, {}));
  }
}

TEST(Cpu_Errors, Hla) {
  const HostTensor in = f32(20, 8);
  for (int bad : {0, 17, -1}) {
    HostTensor out = f32(std::max<int64_t>(1, hot::hla_rows(20, 8)), 8);
    EXPECT_HOT_ERROR(hot::hla_project(in, out, bad), value, "rank", std::to_string(bad));
  }
  EXPECT_HOT_ERROR(hot::hla_project(in, f32(8, 8), 8), value, "out", hot::shape_str({16, 8}));
  EXPECT_HOT_ERROR(hot::hla_project(HostTensor::make2d(DType::s32, 20, 8), f32(16, 8), 8), type,
                   hot::dtype_name(DType::s32));
}

TEST(Cpu_Errors, Quantize) {
  const HostTensor in = f32(4, 8);
  HostTensor q = HostTensor::make2d(DType::s8, 4, 8), s1 = HostTensor::make1d(DType::f32, 1),
             s4 = HostTensor::make1d(DType::f32, 4);
  hot::QuantizeParams p;
  EXPECT_NO_THROW(hot::quantize(in, q, s1, p));
  for (int bad : {5, 0, 16, 2}) {
    p.bits = bad;
    EXPECT_HOT_ERROR(hot::quantize(in, q, s1, p), value, "quantize", "bits", std::to_string(bad));
  }
  p.bits = 8;
  EXPECT_HOT_ERROR(hot::quantize(in, HostTensor::make2d(DType::s32, 4, 8), s1, p), type, "q",
                   hot::dtype_name(DType::s32));
  EXPECT_HOT_ERROR(hot::quantize(in, HostTensor::make2d(DType::s8, 4, 7), s1, p), value, "q", hot::shape_str({4, 7}));
  EXPECT_HOT_ERROR(hot::quantize(in, q, s4, p), value, "scale");  // tensor mode wants (1,)
  p.scale = hot::ScaleMode::token;
  EXPECT_NO_THROW(hot::quantize(in, q, s4, p));
  EXPECT_HOT_ERROR(hot::quantize(in, q, s1, p), value, "scale");  // token mode wants (4,)
  EXPECT_HOT_ERROR(hot::quantize(in, q, HostTensor::make1d(DType::f16, 4), p), type, "scale");
  EXPECT_HOT_ERROR(hot::quantize(HostTensor::make2d(DType::s8, 4, 8), q, s4, p), type, "quantize");
  {
    hot::QuantizeParams bad;
    bad.scale = static_cast<hot::ScaleMode>(2);
    EXPECT_HOT_ERROR(hot::quantize(in, q, s1, bad), value, "quantize", "scale");
    bad = hot::QuantizeParams();
    bad.rounding = static_cast<hot::Rounding>(7);
    EXPECT_HOT_ERROR(hot::quantize(in, q, s1, bad), value, "quantize", "rounding", "7");
  }
  {
    // a hand-built view with negative sizes (numel() > 0 all the same) is refused, naming the argument
    TensorView neg = in.view();
    neg.shape = {-2, -4};
    TensorView qn = q.view();
    qn.shape = {-2, -4};
    EXPECT_HOT_ERROR(hot::quantize(neg, qn, s1, p), value, "quantize", "input", "negative size");
    // a 1-D view without strides
    TensorView s_nostride = s4.view();
    s_nostride.strides.clear();
    EXPECT_HOT_ERROR(hot::quantize(in, q, s_nostride, p), value, "scale", "strides");
  }
  // dequantize
  EXPECT_HOT_ERROR(hot::dequantize(in, s1, f32(4, 8)), type, "dequantize", "q");
  EXPECT_HOT_ERROR(hot::dequantize(q, HostTensor::make1d(DType::f32, 3), f32(4, 8)), value, "scale");
  EXPECT_HOT_ERROR(hot::dequantize(q, s1, HostTensor::make2d(DType::s8, 4, 8)), type, "out");
  EXPECT_HOT_ERROR(hot::dequantize(q, s1, f32(8, 4)), value, "out");
}

TEST(Cpu_Errors, Int4) {
  const HostTensor q = HostTensor::make2d(DType::s8, 2, 8);
  HostTensor packed = HostTensor::make2d(DType::s4, 2, 8);
  EXPECT_NO_THROW(hot::pack_int4(q, packed));
  EXPECT_HOT_ERROR(hot::pack_int4(q, HostTensor::make2d(DType::s8, 2, 8)), type, "pack_int4", "packed");
  EXPECT_HOT_ERROR(hot::pack_int4(HostTensor::make2d(DType::f32, 2, 8), packed), type, "pack_int4", "q");
  EXPECT_HOT_ERROR(hot::pack_int4(HostTensor::make2d(DType::s8, 2, 7), packed), value, "pack_int4");
  EXPECT_HOT_ERROR(hot::pack_int4(q, HostTensor::make2d(DType::s4, 2, 6)), value, "packed");
  EXPECT_HOT_ERROR(hot::unpack_int4(q, HostTensor::make2d(DType::s8, 2, 8)), type, "unpack_int4", "packed");
  EXPECT_HOT_ERROR(hot::unpack_int4(packed, HostTensor::make2d(DType::s8, 2, 6)), value, "unpack_int4", "q");
  // packed int4 with an odd row stride
  TensorView odd = packed.view();
  odd.shape = {1, 6};
  odd.strides = {7, 1};
  EXPECT_HOT_ERROR(hot::unpack_int4(odd, HostTensor::make2d(DType::s8, 1, 6)), value, "packed");
}

TEST(Cpu_Errors, Gemm) {
  const HostTensor a = HostTensor::make2d(DType::s8, 3, 16), b = HostTensor::make2d(DType::s8, 5, 16);
  HostTensor c = HostTensor::make2d(DType::s32, 3, 5);
  EXPECT_NO_THROW(hot::gemm_s8s8s32(a, b, c));
  EXPECT_HOT_ERROR(hot::gemm_s8s8s32(f32(3, 16), b, c), type, "gemm_s8", hot::dtype_name(DType::f32));
  EXPECT_HOT_ERROR(hot::gemm_s8s8s32(a, HostTensor::make2d(DType::s4, 5, 16), c), type, "b");
  EXPECT_HOT_ERROR(hot::gemm_s8s8s32(a, b, HostTensor::make2d(DType::s8, 3, 5)), type, "c");
  EXPECT_HOT_ERROR(hot::gemm_s8s8s32(a, HostTensor::make2d(DType::s8, 5, 15), c), value, hot::shape_str({3, 16}), hot::shape_str({5, 15}));
  EXPECT_HOT_ERROR(hot::gemm_s8s8s32(a, b, HostTensor::make2d(DType::s32, 5, 3)), value, "c", hot::shape_str({3, 5}));
  EXPECT_HOT_ERROR(hot::gemm_s8s8s32(HostTensor::make2d(DType::s8, 0, 16), b, HostTensor::make2d(DType::s32, 0, 5)),
                   value, "empty");
  const HostTensor a4 = HostTensor::make2d(DType::s4, 3, 16), b4 = HostTensor::make2d(DType::s4, 5, 16);
  EXPECT_NO_THROW(hot::gemm_s4s4s32(a4, b4, c));
  EXPECT_HOT_ERROR(hot::gemm_s4s4s32(a, b4, c), type, "gemm_s4", "a");
  EXPECT_HOT_ERROR(hot::gemm_s4s4s32(HostTensor::make2d(DType::s4, 3, 15), HostTensor::make2d(DType::s4, 5, 15), c),
                   value, "gemm_s4");
  {
    // s4 products reach 64 (-8 x -8): past 2^31 / 64 terms an int32 sum can overflow, on every backend alike
    const int64_t k = (int64_t{1} << 31) / 64;  // 33,554,432: one more than fits
    const HostTensor a1 = HostTensor::make2d(DType::s4, 1, k), b1 = HostTensor::make2d(DType::s4, 1, k);
    HostTensor c1 = HostTensor::make2d(DType::s32, 1, 1);
    EXPECT_HOT_ERROR(hot::gemm_s4s4s32(a1, b1, c1), value, "gemm_s4", "contraction", std::to_string(k), "split K");
  }
}

TEST(Cpu_Errors, CompressActivation) {
  EXPECT_HOT_ERROR(hot::compress_activation(HostTensor::make2d(DType::s8, 16, 4), 8), type, "compress_activation", "x");
  for (int bad : {0, 17})
    EXPECT_HOT_ERROR(hot::compress_activation(f32(16, 4), bad), value, "compress_activation", "rank", std::to_string(bad));
  EXPECT_HOT_ERROR(hot::compress_activation(HostTensor::make1d(DType::f32, 16), 8), value, "x", "dims");
  EXPECT_HOT_ERROR(hot::compress_activation(f32(0, 4), 8), value, "x", "empty");
}

TEST(Cpu_Errors, CompressActivationCast) {
  const char* op = "compress_activation_cast";
  const HostTensor x = f32(16, 8), xc = HostTensor::make2d(DType::bf16, 16, 8);
  HostTensor q = HostTensor::make2d(DType::s8, 8, 16), sc = HostTensor::make1d(DType::f32, 1);
  EXPECT_NO_THROW(hot::compress_activation_cast(x, xc, q, sc, 8));
  EXPECT_HOT_ERROR(hot::compress_activation_cast(x, HostTensor::make2d(DType::s8, 16, 8), q, sc, 8), type, op,
                   "x_cast");
  EXPECT_HOT_ERROR(hot::compress_activation_cast(x, HostTensor::make2d(DType::bf16, 16, 9), q, sc, 8), value, op,
                   "x_cast", hot::shape_str({16, 8}));
  EXPECT_HOT_ERROR(hot::compress_activation_cast(x, xc, HostTensor::make2d(DType::s8, 8, 32), sc, 8), value, op, "q");
  EXPECT_HOT_ERROR(hot::compress_activation_cast(x, xc, q, sc, 0), value, op, "rank");
  // x_cast over x's own memory: refused, not written
  TensorView over = xc.view();
  over.data = x.view().data;
  EXPECT_HOT_ERROR(hot::compress_activation_cast(x, over, q, sc, 8), value, op, "x_cast", "overlap");
}

TEST(Cpu_Errors, ConfigValidate) {
  hot::Config c;
  EXPECT_NO_THROW(c.validate());
  EXPECT_FALSE(c.str().empty());
  c.gx_bits = 5;
  EXPECT_HOT_ERROR(c.validate(), value, "gx_bits", "5");
  c.gx_bits = 8;
  EXPECT_NO_THROW(c.validate());
  for (int bad : {0, 17, -3}) {
    c.rank = bad;
    EXPECT_HOT_ERROR(c.validate(), value, "rank", std::to_string(bad));
  }
  EXPECT_STREQ(hot::rounding_name(hot::Rounding::nearest), "nearest");
  EXPECT_STREQ(hot::rounding_name(hot::Rounding::stochastic), "stochastic");
  EXPECT_STREQ(hot::scale_mode_name(hot::ScaleMode::tensor), "tensor");
  EXPECT_STREQ(hot::scale_mode_name(hot::ScaleMode::token), "token");
  EXPECT_EQ(hot::parse_rounding("nearest"), hot::Rounding::nearest);
  EXPECT_EQ(hot::parse_scale_mode("token"), hot::ScaleMode::token);
  EXPECT_HOT_ERROR(hot::parse_rounding("floor"), value, "Config: rounding", "'stochastic' or 'nearest'", "'floor'");
  EXPECT_HOT_ERROR(hot::parse_scale_mode("row", "quantize: scale"), value, "quantize: scale", "'tensor' or 'token'",
                   "'row'");
}

TEST(Cpu_Errors, ConfigCode) {
  // every valid configuration survives its code; codes of no valid configuration are refused, naming the code
  int n = 0;
  for (int bits : {4, 8})
    for (int rank = 1; rank <= 16; ++rank)
      for (auto rd : {hot::Rounding::stochastic, hot::Rounding::nearest})
        for (auto sm : {hot::ScaleMode::tensor, hot::ScaleMode::token})
          for (bool exact : {false, true}) {
            hot::Config c;
            c.gx_bits = bits;
            c.rank = rank;
            c.rounding = rd;
            c.gx_scale = sm;
            c.exact = exact;
            const int64_t code = c.code();
            EXPECT_TRUE(code >= 0 && code < 4096) << code;
            EXPECT_TRUE(hot::Config::from_code(code) == c) << c.str();
            ++n;
          }
  EXPECT_EQ(n, 256);
  EXPECT_EQ(hot::Config().code(), 8 | 16 << 4);
  EXPECT_HOT_ERROR(hot::Config::from_code(-1), value, "from_code", "-1");
  EXPECT_HOT_ERROR(hot::Config::from_code(4096), value, "from_code", "4096");
  EXPECT_HOT_ERROR(hot::Config::from_code(5 | 16 << 4), value, "from_code", "gx_bits", "5");  // gx_bits 5
  EXPECT_HOT_ERROR(hot::Config::from_code(8), value, "from_code", "rank", "0");               // rank 0
  hot::Config bad;
  bad.rank = 17;
  EXPECT_HOT_ERROR(bad.code(), value, "rank", "17");
  EXPECT_EQ(hot::Config().describe(), "g_x 8-bit HQ per tensor, g_w 8-bit full rank, stochastic rounding");
  hot::Config p;
  p.gx_bits = 4;
  p.rank = 8;
  p.gx_scale = hot::ScaleMode::token;
  p.rounding = hot::Rounding::nearest;
  EXPECT_EQ(p.describe(), "g_x 4-bit HQ per token, g_w 8-bit HLA rank 8, nearest rounding");
  p.exact = true;
  EXPECT_EQ(p.describe(), "exact (unquantised backward)");
  EXPECT_TRUE(p != hot::Config());
}

struct BwdFixture {
  int64_t L = 20, O = 8, I = 6;
  HostTensor gy = f32(L, O), w = f32(O, I), x = f32(L, I);
  HostTensor gx = f32(L, I), gw = f32(O, I), gb = HostTensor::make1d(DType::f32, O);
  hot::SavedActivation saved = hot::compress_activation(x, hot::Config().rank);
  hot::BackwardOutputs out() const { return {gx.view(), gw.view(), gb.view()}; }
};

TEST(Cpu_Errors, BackwardLinear) {
  BwdFixture f;
  hot::Config cfg;
  EXPECT_NO_THROW(hot::backward_linear(f.gy, f.w, &f.saved, cfg, 0, f.out()));
  // bad configs
  cfg.gx_bits = 5;
  EXPECT_HOT_ERROR(hot::backward_linear(f.gy, f.w, &f.saved, cfg, 0, f.out()), value, "gx_bits", "5");
  cfg = hot::Config();
  for (int bad : {0, 17}) {
    cfg.rank = bad;
    EXPECT_HOT_ERROR(hot::backward_linear(f.gy, f.w, &f.saved, cfg, 0, f.out()), value, "rank", std::to_string(bad));
  }
  cfg = hot::Config();
  cfg.exact = true;
  EXPECT_HOT_ERROR(hot::backward_linear(f.gy, f.w, &f.saved, cfg, 0, f.out()), value, "exact");
  cfg = hot::Config();
  // dtypes
  EXPECT_HOT_ERROR(hot::backward_linear(HostTensor::make2d(DType::s8, f.L, f.O), f.w, &f.saved, cfg, 0, f.out()), type,
                   "backward_linear", "grad_output", hot::dtype_name(DType::s8));
  EXPECT_HOT_ERROR(hot::backward_linear(f.gy, HostTensor::make2d(DType::s32, f.O, f.I), &f.saved, cfg, 0, f.out()), type,
                   "weight", hot::dtype_name(DType::s32));
  {
    HostTensor gxi = HostTensor::make2d(DType::s32, f.L, f.I);
    hot::BackwardOutputs o = f.out();
    o.grad_input = gxi.view();
    EXPECT_HOT_ERROR(hot::backward_linear(f.gy, f.w, &f.saved, cfg, 0, o), type, "grad_input");
  }
  // shapes
  {
    TensorView w3 = f.w.view();
    w3.shape = {1, f.O, f.I};
    w3.strides = {f.O * f.I, f.I, 1};
    EXPECT_HOT_ERROR(hot::backward_linear(f.gy, w3, &f.saved, cfg, 0, f.out()), value, "backward_linear", "weight",
                     "3 dims");
  }
  EXPECT_HOT_ERROR(hot::backward_linear(f.gy, f32(f.O + 1, f.I), &f.saved, cfg, 0, f.out()), value, "weight");
  {
    hot::BackwardOutputs o = f.out();
    HostTensor bad = f32(f.L, f.I + 1);
    o.grad_input = bad.view();
    EXPECT_HOT_ERROR(hot::backward_linear(f.gy, f.w, &f.saved, cfg, 0, o), value, "grad_input");
    o = f.out();
    HostTensor badw = f32(f.I, f.O);
    o.grad_weight = badw.view();
    EXPECT_HOT_ERROR(hot::backward_linear(f.gy, f.w, &f.saved, cfg, 0, o), value, "grad_weight");
    o = f.out();
    HostTensor badb = HostTensor::make1d(DType::f32, f.O + 1);
    o.grad_bias = badb.view();
    EXPECT_HOT_ERROR(hot::backward_linear(f.gy, f.w, &f.saved, cfg, 0, o), value, "grad_bias");
  }
  {
    const HostTensor gy0 = f32(0, f.O);
    hot::BackwardOutputs o;
    HostTensor gb = HostTensor::make1d(DType::f32, f.O);
    o.grad_bias = gb.view();
    EXPECT_HOT_ERROR(hot::backward_linear(gy0, f.w, nullptr, cfg, 0, o), value, "grad_output", "empty");
  }
  {
    // 8-bit g_x: the contraction runs over the output features; past kMaxInt32K of them its integer sums go in int64
    // slices (SPEC §4), so such a layer is no error: its g_x is the float64 product within 8-bit accuracy
    const int64_t O = 133152, L = 16, I = 4;
    const std::vector<float> gv = hot_test::randn(static_cast<size_t>(L * O), 3), wv = hot_test::randn(
        static_cast<size_t>(O * I), 4);
    const HostTensor gy = hot_test::host_from(DType::f32, L, O, gv), w = hot_test::host_from(DType::f32, O, I, wv);
    HostTensor gx = f32(L, I);
    hot::BackwardOutputs o;
    o.grad_input = gx.view();
    hot::Config c8;
    c8.gx_bits = 8;
    ASSERT_NO_THROW(hot::backward_linear(gy, w, nullptr, c8, 0, o));
    EXPECT_LT(hot_test::rel_err_of_product(gx, gv, wv, L, O, I), 0.05);
  }
  // the saved activation
  EXPECT_HOT_ERROR(hot::backward_linear(f.gy, f.w, nullptr, cfg, 0, f.out()), value, "saved");
  {
    const hot::SavedActivation other = hot::compress_activation(f32(f.L + 16, f.I), cfg.rank);
    EXPECT_HOT_ERROR(hot::backward_linear(f.gy, f.w, &other, cfg, 0, f.out()), value, "saved");
    const hot::SavedActivation r4 = hot::compress_activation(f.x, 4);
    EXPECT_HOT_ERROR(hot::backward_linear(f.gy, f.w, &r4, cfg, 0, f.out()), value, "rank");
    const hot::SavedActivation wide = hot::compress_activation(f32(f.L, f.I + 1), cfg.rank);
    EXPECT_HOT_ERROR(hot::backward_linear(f.gy, f.w, &wide, cfg, 0, f.out()), value, "saved");
  }
}

TEST(Cpu_Errors, BackwardLinearRawX) {
  BwdFixture f;
  const hot::Config cfg;
  EXPECT_NO_THROW(hot::backward_linear(f.gy, f.w, f.x.view(), cfg, 0, f.out()));
  const HostTensor x_rows = f32(f.L + 1, f.I);
  EXPECT_HOT_ERROR(hot::backward_linear(f.gy, f.w, x_rows.view(), cfg, 0, f.out()), value, "backward_linear", "x",
                   "(21, 6)");
  const HostTensor x_int = HostTensor::make2d(DType::s8, f.L, f.I);
  EXPECT_HOT_ERROR(hot::backward_linear(f.gy, f.w, x_int.view(), cfg, 0, f.out()), type, "backward_linear", "x",
                   "int8");
  hot::Config bad;
  bad.rank = 0;
  EXPECT_HOT_ERROR(hot::backward_linear(f.gy, f.w, f.x.view(), bad, 0, f.out()), value, "rank", "0");
  // no g_w requested: the x is not read (an empty view is fine)
  hot::BackwardOutputs o = f.out();
  o.grad_weight = TensorView{};
  EXPECT_NO_THROW(hot::backward_linear(f.gy, f.w, TensorView{}, cfg, 0, o));
}

TEST(Cpu_Errors, BackwardLinearExact) {
  BwdFixture f;
  const TensorView xv = f.x.view();
  EXPECT_NO_THROW(hot::backward_linear_exact(f.gy, f.w, &xv, f.out()));
  EXPECT_HOT_ERROR(hot::backward_linear_exact(f.gy, f.w, nullptr, f.out()), value, "backward_linear_exact", "x");
  const HostTensor wh = HostTensor::make2d(DType::f16, f.O, f.I);
  EXPECT_HOT_ERROR(hot::backward_linear_exact(f.gy, wh, &xv, f.out()), type, "weight", hot::dtype_name(DType::f16));
  HostTensor xb = f32(f.L + 1, f.I);
  const TensorView xbv = xb.view();
  EXPECT_HOT_ERROR(hot::backward_linear_exact(f.gy, f.w, &xbv, f.out()), value, "x");
  EXPECT_HOT_ERROR(hot::backward_linear_exact(HostTensor::make2d(DType::s8, f.L, f.O), f.w, &xv, f.out()), type,
                   "grad_output");
}

}  // namespace
