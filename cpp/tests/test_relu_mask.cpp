// relu_mask / relu_mask_backward (SPEC §2, keep_less) on the CPU backend against a per-element reference: the bits
// (x <= 0: +-0 and negatives including -Inf and negative subnormals; NaN of either sign clear), y bit for bit (+0
// where x < 0, x's bits elsewhere, -0 and NaN included), the unused bits of the last byte zero, in place and out of
// place; y's amax; the backward's selection with non-finite gradients; and the argument checks.
#include "test_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

using namespace hot_test;
using hot::DType;

namespace {

const DType kTypes[] = {DType::f32, DType::bf16, DType::f16};

std::vector<uint8_t> ref_bits(const HostTensor& x) {
  const int64_t n = x.cols();
  std::vector<uint8_t> b(static_cast<size_t>((n + 7) / 8), 0);
  for (int64_t i = 0; i < n; ++i)
    if (static_cast<double>(x.getf(i)) <= 0.0) b[static_cast<size_t>(i / 8)] |= static_cast<uint8_t>(1u << (i % 8));
  return b;
}

// The element bytes of x, zeroed where `zero(i)`.
template <typename Z>
std::vector<uint8_t> masked_bytes(const HostTensor& x, Z zero) {
  const size_t es = static_cast<size_t>(hot::dtype_bits(x.dtype()) / 8);
  std::vector<uint8_t> out(x.bytes(), x.bytes() + x.cols() * es);
  for (int64_t i = 0; i < x.cols(); ++i)
    if (zero(i)) std::memset(out.data() + i * es, 0, es);
  return out;
}

bool bytes_are(const HostTensor& t, const std::vector<uint8_t>& want) {
  return std::memcmp(t.bytes(), want.data(), want.size()) == 0;
}

HostTensor bits_of(int64_t n) {
  HostTensor b = HostTensor::make1d(DType::s8, (n + 7) / 8);
  std::memset(b.bytes(), 0xa5, b.nbytes());  // poisoned: every byte must be written
  return b;
}

TEST(ReluMask, BitsAndOutputAgainstReference) {
  uint64_t seed = 10;
  for (DType dt : kTypes)
    for (int64_t n : relu_sizes()) {
      SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " n " << n);
      const HostTensor x = relu_input(dt, n, seed++);
      const std::vector<uint8_t> bits = ref_bits(x);
      const std::vector<uint8_t> y_ref = masked_bytes(x, [&](int64_t i) { return static_cast<double>(x.getf(i)) < 0.0; });
      HostTensor y = HostTensor::make1d(dt, n), b = bits_of(n);
      std::memset(y.bytes(), 0x5a, y.nbytes());
      hot::relu_mask(x, y, b);
      EXPECT_TRUE(bytes_are(y, y_ref));
      EXPECT_TRUE(bytes_are(b, bits));
      HostTensor xi = x, bi = bits_of(n);  // in place: y is x
      hot::relu_mask(xi, xi, bi);
      EXPECT_TRUE(bytes_are(xi, y_ref));
      EXPECT_TRUE(bytes_are(bi, bits));
    }
}

TEST(ReluMask, SpecialValues) {
  // +0 and -0 set their bits and stay as they are; NaN clears its bit and passes; -Inf and the negative subnormal
  // become +0 with their bits set; +Inf and the positive subnormal pass with their bits clear.
  const HostTensor x = relu_input(DType::f32, 40, 1);
  HostTensor y = HostTensor::make1d(DType::f32, 40), b = bits_of(40);
  hot::relu_mask(x, y, b);
  const auto bit = [&](int64_t i) { return (b.bytes()[i / 8] >> (i % 8)) & 1u; };
  for (int64_t i = 3; i < 40; i += 5) {
    const float v = x.getf(i);
    SCOPED_TRACE(testing::Message() << "x[" << i << "] = " << v);
    if (std::isnan(v)) {
      EXPECT_EQ(bit(i), 0u);
      EXPECT_TRUE(std::isnan(y.getf(i)));
    } else if (v == 0.0f) {
      EXPECT_EQ(bit(i), 1u);
      EXPECT_EQ(f32_bits(y.getf(i)), f32_bits(v));
    } else if (v < 0.0f) {
      EXPECT_EQ(bit(i), 1u);
      EXPECT_EQ(f32_bits(y.getf(i)), 0u);
    } else {
      EXPECT_EQ(bit(i), 0u);
      EXPECT_EQ(y.getf(i), v);
    }
  }
}

// The matrix view (rows x cols, row-major) of a 1-D tensor's elements.
hot::TensorView as_matrix(const HostTensor& t, int64_t rows, int64_t cols) {
  hot::TensorView v = t.view();
  v.shape = {rows, cols};
  v.strides = {cols, 1};
  return v;
}

// y's amax (relu_mask's amax): max |y| by a per-element reference (NaN where y has a NaN; 0 for an x without positive
// values), in place as out of place; quantize and activation_codes of y given it are the bytes they give without it.
TEST(ReluMask, AmaxOfTheOutput) {
  uint64_t seed = 80;
  for (DType dt : kTypes)
    for (int64_t n : relu_sizes())
      for (int kind : {0, 1, 2}) {  // relu_input's specials (NaN among them), finite values, no positive value
        SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " n " << n << " kind " << kind);
        HostTensor x = relu_input(dt, n, seed++);
        for (int64_t i = 0; i < n && kind > 0; ++i) {
          const float v = std::isfinite(x.getf(i)) ? x.getf(i) : 0.5f;
          x.setf(i, kind == 2 ? -std::fabs(v) : v);
        }
        bool nan = false;
        double ref = 0.0;
        for (int64_t i = 0; i < n; ++i) {
          const float v = x.getf(i);
          nan = nan || std::isnan(v);
          if (v > 0.0f) ref = std::max(ref, static_cast<double>(v));
        }
        HostTensor y = HostTensor::make1d(dt, n), b = bits_of(n), a = HostTensor::make1d(DType::f32, 1);
        a.setf(0, -7.0f);  // poisoned
        hot::relu_mask(x, y, b, a);
        if (nan) {
          EXPECT_TRUE(std::isnan(a.getf(0)));
        } else {
          EXPECT_EQ(static_cast<double>(a.getf(0)), ref);
          EXPECT_EQ(f32_bits(a.getf(0)) >> 31, 0u);  // +0 without a positive value
        }
        HostTensor xi = x, bi = bits_of(n), ai = HostTensor::make1d(DType::f32, 1);
        hot::relu_mask(xi, xi, bi, ai);
        EXPECT_EQ(f32_bits(ai.getf(0)), f32_bits(a.getf(0)));
        hot::QuantizeParams p;  // 8 bits, per tensor, round-to-nearest
        HostTensor q1 = HostTensor::make2d(DType::s8, 1, n), q2 = q1;
        HostTensor s1 = HostTensor::make1d(DType::f32, 1), s2 = s1;
        hot::quantize(as_matrix(y, 1, n), q1, s1, p);
        hot::quantize(as_matrix(y, 1, n), q2, s2, p, a);
        EXPECT_TRUE(bytes_are(q2, std::vector<uint8_t>(q1.bytes(), q1.bytes() + n)));
        EXPECT_EQ(f32_bits(s2.getf(0)), f32_bits(s1.getf(0)));
        const hot::SavedActivation c1 = hot::activation_codes(as_matrix(y, n, 1));
        const hot::SavedActivation c2 = hot::activation_codes(as_matrix(y, n, 1), a);
        ASSERT_EQ(c1.q.nbytes(), c2.q.nbytes());
        EXPECT_EQ(std::memcmp(c1.q.view().data, c2.q.view().data, c1.q.nbytes()), 0);
        EXPECT_EQ(std::memcmp(c1.scale.view().data, c2.scale.view().data, 4), 0);
      }
}

TEST(ReluMask, BackwardSelectsByTheBits) {
  uint64_t seed = 50;
  for (DType dt : kTypes)
    for (int64_t n : relu_sizes()) {
      SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " n " << n);
      const HostTensor x = relu_input(dt, n, seed++);
      HostTensor y = HostTensor::make1d(dt, n), b = bits_of(n);
      hot::relu_mask(x, y, b);
      const HostTensor gy = relu_input(dt, n, seed++);  // non-finite gradients too
      const std::vector<uint8_t> want = masked_bytes(gy, [&](int64_t i) { return static_cast<double>(x.getf(i)) <= 0.0; });
      HostTensor gx = HostTensor::make1d(dt, n);
      std::memset(gx.bytes(), 0x5a, gx.nbytes());
      hot::relu_mask_backward(gy, b, gx);
      EXPECT_TRUE(bytes_are(gx, want));
      HostTensor gi = gy;
      hot::relu_mask_backward(gi, b, gi);
      EXPECT_TRUE(bytes_are(gi, want));
    }
}

TEST(ReluMask, ArgumentErrors) {
  const HostTensor x = relu_input(DType::bf16, 20, 3);
  HostTensor y = HostTensor::make1d(DType::bf16, 20), b = bits_of(20);
  HostTensor y32 = HostTensor::make1d(DType::f32, 20), y_short = HostTensor::make1d(DType::bf16, 19);
  HostTensor b_long = bits_of(21 * 8), b_f32 = HostTensor::make1d(DType::f32, 3);
  HostTensor x2 = HostTensor::make2d(DType::bf16, 4, 5), xi = HostTensor::make1d(DType::s8, 20);
  using hot::ErrorKind;
  EXPECT_TRUE(throws_hot([&] { hot::relu_mask(x, y32, b); }, ErrorKind::type, {"relu_mask", "y", "bfloat16"}));
  EXPECT_TRUE(throws_hot([&] { hot::relu_mask(x, y_short, b); }, ErrorKind::value, {"relu_mask", "y", "(20,)"}));
  EXPECT_TRUE(throws_hot([&] { hot::relu_mask(x, y, b_long); }, ErrorKind::value, {"relu_mask", "bits", "(3,)"}));
  EXPECT_TRUE(throws_hot([&] { hot::relu_mask(x, y, b_f32); }, ErrorKind::type, {"relu_mask", "bits", "int8"}));
  EXPECT_TRUE(throws_hot([&] { hot::relu_mask(x2, y, b); }, ErrorKind::value, {"relu_mask", "x", "1"}));
  EXPECT_TRUE(throws_hot([&] { hot::relu_mask(xi, xi, b); }, ErrorKind::type, {"relu_mask", "x"}));
  hot::TensorView empty = x.view();
  empty.shape = {0};
  EXPECT_TRUE(throws_hot([&] { hot::relu_mask(empty, empty, b); }, ErrorKind::value, {"relu_mask", "x", "empty"}));
  hot::TensorView shifted = y.view();  // overlaps x's bytes without being x
  shifted.data = static_cast<char*>(x.view().data) + 2;
  EXPECT_TRUE(throws_hot([&] { hot::relu_mask(x, shifted, b); }, ErrorKind::value, {"relu_mask", "overlap"}));
  hot::TensorView strided = x.view();
  strided.shape = {10};
  strided.strides = {2};
  HostTensor y10 = HostTensor::make1d(DType::bf16, 10), b10 = bits_of(10);
  EXPECT_TRUE(throws_hot([&] { hot::relu_mask(strided, y10, b10); }, ErrorKind::value, {"relu_mask", "contiguous"}));
  HostTensor a = HostTensor::make1d(DType::f32, 1), a16 = HostTensor::make1d(DType::f16, 1);
  HostTensor a2 = HostTensor::make1d(DType::f32, 2);
  EXPECT_TRUE(throws_hot([&] { hot::relu_mask(x, y, b, a16); }, ErrorKind::type, {"relu_mask", "amax", "float32"}));
  EXPECT_TRUE(throws_hot([&] { hot::relu_mask(x, y, b, a2); }, ErrorKind::value, {"relu_mask", "amax", "(1,)"}));
  hot::TensorView a_in_y = a.view();  // amax inside y's bytes
  a_in_y.data = y.view().data;
  EXPECT_TRUE(throws_hot([&] { hot::relu_mask(x, y, b, a_in_y); }, ErrorKind::value, {"relu_mask", "amax", "overlap"}));
  hot::QuantizeParams token;
  token.scale = hot::ScaleMode::token;
  HostTensor q = HostTensor::make2d(DType::s8, 4, 5), s4 = HostTensor::make1d(DType::f32, 4);
  EXPECT_TRUE(throws_hot([&] { hot::quantize(x2, q, s4, token, a); }, ErrorKind::value, {"quantize", "amax", "token"}));
  HostTensor s1 = HostTensor::make1d(DType::f32, 1);
  EXPECT_TRUE(throws_hot([&] { hot::quantize(x2, q, s1, hot::QuantizeParams{}, a2); }, ErrorKind::value,
                         {"quantize", "amax"}));
  EXPECT_TRUE(throws_hot([&] { hot::activation_codes(x2, a16); }, ErrorKind::type, {"activation_codes", "amax"}));
  EXPECT_TRUE(throws_hot([&] { hot::relu_mask_backward(x, b_long, y); }, ErrorKind::value,
                         {"relu_mask_backward", "bits"}));
  EXPECT_TRUE(throws_hot([&] { hot::relu_mask_backward(x, b, y32); }, ErrorKind::type,
                         {"relu_mask_backward", "g_x"}));
}

}  // namespace

// max_pool2d_offsets' arguments: named errors for the window, the shapes and dtypes, and a window without input.
TEST(MaxPoolOffsets, ArgumentErrors) {
  HostTensor xb = HostTensor::make1d(DType::f32, 2 * 3 * 8 * 8), yb = HostTensor::make1d(DType::f32, 2 * 3 * 4 * 4);
  HostTensor ob = HostTensor::make1d(DType::s8, 2 * 3 * 4 * 4), y16 = HostTensor::make1d(DType::bf16, 2 * 3 * 4 * 4);
  const auto v4 = [](const HostTensor& t, int64_t N, int64_t C, int64_t H, int64_t W) {
    return hot::make_view(t.view().data, t.view().dtype, hot::Device::cpu(), {N, C, H, W});
  };
  hot::ConvGeometry g;
  g.N = 2, g.C = 3, g.H = 8, g.W = 8, g.kh = g.kw = 3, g.sh = g.sw = 2, g.ph = g.pw = 1;
  const hot::TensorView x = v4(xb, 2, 3, 8, 8), y = v4(yb, 2, 3, 4, 4), off = v4(ob, 2, 3, 4, 4);
  hot::max_pool2d_offsets(x, g, y, off);  // the valid call
  using hot::ErrorKind;
  EXPECT_TRUE(throws_hot([&] { hot::max_pool2d_offsets(x, g, v4(y16, 2, 3, 4, 4), off); }, ErrorKind::type,
                         {"max_pool2d_offsets", "y", "bfloat16", "float32"}));
  EXPECT_TRUE(throws_hot([&] { hot::max_pool2d_offsets(x, g, y, v4(yb, 2, 3, 4, 4)); }, ErrorKind::type,
                         {"max_pool2d_offsets", "off", "int8"}));
  EXPECT_TRUE(throws_hot([&] { hot::max_pool2d_offsets(x, g, y, v4(ob, 2, 3, 2, 8)); }, ErrorKind::value,
                         {"max_pool2d_offsets", "off", "(2, 3, 2, 8)"}));
  hot::ConvGeometry big = g;
  big.kh = big.kw = 12, big.ph = big.pw = 0, big.sh = big.sw = 12;
  EXPECT_TRUE(throws_hot([&] { hot::max_pool2d_offsets(x, big, v4(yb, 2, 3, 1, 1), v4(ob, 2, 3, 1, 1)); },
                         ErrorKind::value, {"max_pool2d_offsets", "12 x 12", "128"}));
  hot::ConvGeometry outside = g;  // a 1 x 1 window 2 rows into the padding: output row 0 reads no input row
  outside.kh = outside.kw = 1, outside.ph = outside.pw = 2, outside.sh = outside.sw = 4;
  EXPECT_TRUE(throws_hot([&] { hot::max_pool2d_offsets(x, outside, v4(yb, 2, 3, 3, 3), v4(ob, 2, 3, 3, 3)); },
                         ErrorKind::value, {"max_pool2d_offsets", "output row 0", "window"}));
  EXPECT_TRUE(throws_hot([&] { hot::max_pool2d_offsets_backward(y, off, g, v4(yb, 2, 3, 4, 4)); }, ErrorKind::value,
                         {"max_pool2d_offsets_backward", "g_x", "(2, 3, 8, 8)"}));
}
