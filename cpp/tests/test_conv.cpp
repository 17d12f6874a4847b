// col2im (SPEC §8) on the CPU backend against an independent scatter formulation: a zero fp32 map to which each
// kernel offset's window of the columns is added in turn (i, then j), as a framework's fold would do it, so that
// every pixel receives the same fp32 additions in the same order and the results are equal bit for bit; plus a
// float64 bound and the argument checks.
#include "backend.h"
#include "test_util.h"

#include <cmath>
#include <cstring>
#include <vector>

using namespace hot_test;

namespace {

struct Geom {
  int64_t N, C, H, W;
  int kh, kw, sh, sw, ph, pw, dh, dw;
  bool patches;
};

hot::ConvGeometry to_core(const Geom& g) {
  hot::ConvGeometry c;
  c.N = g.N, c.C = g.C, c.H = g.H, c.W = g.W, c.kh = g.kh, c.kw = g.kw, c.sh = g.sh, c.sw = g.sw;
  c.ph = g.ph, c.pw = g.pw, c.dh = g.dh, c.dw = g.dw, c.patches = g.patches;
  return c;
}

int64_t row_of(const Geom& g, int64_t Ho, int64_t Wo, int64_t n, int64_t ho, int64_t wo) {
  if (!g.patches) return (n * Ho + ho) * Wo + wo;
  return (((n * (Ho / 4) + ho / 4) * (Wo / 4) + wo / 4) * 4 + ho % 4) * 4 + wo % 4;
}

// Scatter: padded fp32 map, window (i, j) added for every output pixel; the first add of a non-overlapping geometry
// is a copy (as a fold that copies where windows do not overlap).
std::vector<float> scatter_ref(const Geom& g, const HostTensor& cols, std::vector<double>* f64,
                               std::vector<double>* abs_sum) {
  const hot::ConvGeometry cg = to_core(g);
  const int64_t Ho = cg.out_h(), Wo = cg.out_w(), Hp = g.H + 2 * g.ph, Wp = g.W + 2 * g.pw;
  const bool overlap = cg.overlapping();
  std::vector<float> map(static_cast<size_t>(g.N * g.C * Hp * Wp), 0.0f);
  std::vector<double> m64(map.size(), 0.0), a64(map.size(), 0.0);
  std::vector<int> seen(map.size(), 0);
  for (int i = 0; i < g.kh; ++i)
    for (int j = 0; j < g.kw; ++j)
      for (int64_t n = 0; n < g.N; ++n)
        for (int64_t c = 0; c < g.C; ++c)
          for (int64_t ho = 0; ho < Ho; ++ho)
            for (int64_t wo = 0; wo < Wo; ++wo) {
              const int64_t hp = ho * g.sh + i * g.dh, wp = wo * g.sw + j * g.dw;
              const size_t k = static_cast<size_t>(((n * g.C + c) * Hp + hp) * Wp + wp);
              const float v = cols.getf(row_of(g, Ho, Wo, n, ho, wo), (static_cast<int64_t>(i) * g.kw + j) * g.C + c);
              map[k] = (seen[k] || overlap) ? map[k] + v : v;
              seen[k] = 1;
              m64[k] += v;
              a64[k] += std::fabs(v);
            }
  std::vector<float> out(static_cast<size_t>(g.N * g.C * g.H * g.W));
  f64->assign(out.size(), 0.0);
  abs_sum->assign(out.size(), 0.0);
  for (int64_t r = 0; r < g.N * g.C; ++r)
    for (int64_t h = 0; h < g.H; ++h)
      for (int64_t w = 0; w < g.W; ++w) {
        const size_t src = static_cast<size_t>((r * Hp + h + g.ph) * Wp + w + g.pw);
        out[static_cast<size_t>((r * g.H + h) * g.W + w)] = map[src];
        (*f64)[static_cast<size_t>((r * g.H + h) * g.W + w)] = m64[src];
        (*abs_sum)[static_cast<size_t>((r * g.H + h) * g.W + w)] = a64[src];
      }
  return out;
}

const std::vector<Geom> kGeoms = {
    {2, 3, 7, 9, 3, 3, 1, 1, 1, 1, 1, 1, false},   // ResNet 3x3, padding 1
    {2, 5, 9, 8, 3, 3, 2, 2, 1, 1, 1, 1, false},   // strided 3x3 (overlapping)
    {1, 4, 8, 8, 2, 2, 2, 2, 0, 0, 1, 1, false},   // patch embedding: windows do not overlap
    {2, 3, 9, 7, 1, 1, 2, 2, 0, 0, 1, 1, false},   // 1x1 stride 2: pixels no window reads
    {1, 2, 11, 10, 3, 2, 1, 2, 2, 1, 2, 3, false},  // dilation, mixed sides
    {2, 3, 8, 8, 3, 3, 1, 1, 1, 1, 1, 1, true},    // 4 x 4 patch row order
    {1, 2, 5, 5, 7, 7, 1, 1, 3, 3, 1, 1, false},   // kernel larger than half the map
};

}  // namespace

TEST(Cpu_Col2im, EqualsScatterAndFloat64Bound) {
  uint64_t seed = 900;
  for (const Geom& g : kGeoms)
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
      const hot::ConvGeometry cg = to_core(g);
      const int64_t L = g.N * cg.out_h() * cg.out_w(), K = g.C * g.kh * g.kw;
      HostTensor cols = host_from(dt, L, K, randn(static_cast<size_t>(L * K), seed++), K + 3);  // a row stride
      HostTensor out = HostTensor::make2d(dt, g.N * g.H * g.W, g.C, g.C + 1);  // channels-last, a row stride
      hot::col2im(cols, cg, out);
      std::vector<double> f64, asum;
      const std::vector<float> ref = scatter_ref(g, cols, &f64, &asum);
      HostTensor ref_t = host_from(dt, g.N * g.C, g.H * g.W, ref);
      const int terms = g.kh * g.kw;  // at most one contribution per kernel offset
      const auto got = [&](int64_t r, int64_t p) {  // pixel p of NCHW row r = (n, c), read from the channels-last out
        return out.getf((r / g.C) * g.H * g.W + p, r % g.C);
      };
      for (int64_t r = 0; r < g.N * g.C; ++r)
        for (int64_t p = 0; p < g.H * g.W; ++p) {
          ASSERT_EQ(f32_bits(got(r, p)), f32_bits(ref_t.getf(r, p)))
              << dtype_name(dt) << " geometry " << (&g - kGeoms.data()) << " pixel " << r << "," << p;
          // fp32 summation of at most kh*kw terms (error <= (terms - 1) 2^-24 sum |v|), then one rounding to the
          // dtype (unit roundoff u of it, relative to the result)
          const size_t i = static_cast<size_t>(r * g.H * g.W + p);
          const double u = dt == DType::f32 ? 0x1p-24 : dt == DType::bf16 ? 0x1p-8 : 0x1p-11;
          const double sum_err = (terms - 1) * 0x1p-24 * asum[i];
          EXPECT_LE(std::fabs(got(r, p) - f64[i]), sum_err + u * (std::fabs(f64[i]) + sum_err) + 1e-30);
        }
    }
}

TEST(Cpu_Col2im, RefusesBadArguments) {
  hot::ConvGeometry g;
  g.N = 1, g.C = 2, g.H = 4, g.W = 4, g.kh = 3, g.kw = 3, g.ph = 1, g.pw = 1;
  HostTensor cols = HostTensor::make2d(DType::f32, 16, 18), out = HostTensor::make2d(DType::f32, 16, 2);
  EXPECT_NO_THROW(hot::col2im(cols, g, out));
  HostTensor bad_cols = HostTensor::make2d(DType::f32, 16, 17);
  EXPECT_THROW(hot::col2im(bad_cols, g, out), hot::Error);
  HostTensor bad_dtype = HostTensor::make2d(DType::bf16, 16, 2);
  HostTensor nchw = HostTensor::make2d(DType::f32, 2, 16);  // the (N*C) x (H*W) matrix: not the channels-last map
  EXPECT_TRUE(throws_hot([&] { hot::col2im(cols, g, nchw); }, hot::ErrorKind::value, {"col2im", "out", "(16, 2)"}));
  EXPECT_THROW(hot::col2im(cols, g, bad_dtype), hot::Error);
  hot::ConvGeometry neg = g;
  neg.ph = -1;
  EXPECT_THROW(hot::col2im(cols, neg, out), hot::Error);
  hot::ConvGeometry patches = g;
  patches.H = 5, patches.W = 5, patches.patches = true;  // a 5 x 5 output map is not made of 4 x 4 patches
  HostTensor c5 = HostTensor::make2d(DType::f32, 25, 18), o5 = HostTensor::make2d(DType::f32, 25, 2);
  try {
    hot::col2im(c5, patches, o5);
    ADD_FAILURE() << "no error";
  } catch (const hot::Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiples of 4"), std::string::npos) << e.what();
  }
}

// im2col against a gather from the zero-padded NCHW map, element by element (a copy: equal bits), for maps with and
// without a row stride, every float dtype; and the transposition identity with col2im where windows do not overlap
// (each pixel then has at most one contribution, so col2im(im2col(x)) is x on the pixels some window reads).
TEST(Cpu_Im2col, EqualsPaddedGather) {
  uint64_t seed = 1900;
  for (const Geom& g : kGeoms)
    for (DType dt : {DType::f32, DType::bf16, DType::f16})
      for (int64_t pad : {0, 5}) {
        const hot::ConvGeometry cg = to_core(g);
        const int64_t Ho = cg.out_h(), Wo = cg.out_w(), L = g.N * Ho * Wo, K = g.C * g.kh * g.kw;
        HostTensor map = host_from(dt, g.N * g.H * g.W, g.C, randn(static_cast<size_t>(g.N * g.H * g.W * g.C), seed++),
                                   g.C + pad);
        HostTensor cols = HostTensor::make2d(dt, L, K, K + pad);
        hot::im2col(map, cg, cols);
        for (int64_t n = 0; n < g.N; ++n)
          for (int64_t ho = 0; ho < Ho; ++ho)
            for (int64_t wo = 0; wo < Wo; ++wo)
              for (int i = 0; i < g.kh; ++i)
                for (int j = 0; j < g.kw; ++j)
                  for (int64_t c = 0; c < g.C; ++c) {
                    const int64_t hp = ho * g.sh + i * g.dh, wp = wo * g.sw + j * g.dw;  // padded coordinates
                    const bool inside = hp >= g.ph && hp < g.H + g.ph && wp >= g.pw && wp < g.W + g.pw;
                    const float want = inside ? map.getf((n * g.H + hp - g.ph) * g.W + wp - g.pw, c) : 0.0f;
                    const float got = cols.getf(row_of(g, Ho, Wo, n, ho, wo), (static_cast<int64_t>(i) * g.kw + j) * g.C + c);
                    ASSERT_EQ(f32_bits(got), f32_bits(want)) << dtype_name(dt) << " geometry " << (&g - kGeoms.data());
                  }
        if (cg.overlapping() || pad) continue;
        HostTensor back = HostTensor::make2d(dt, g.N * g.H * g.W, g.C);
        hot::col2im(cols, cg, back);
        for (int64_t r = 0; r < g.N * g.H * g.W; ++r)
          for (int64_t c = 0; c < g.C; ++c) {
            const float v = back.getf(r, c);
            ASSERT_TRUE(v == 0.0f || f32_bits(v) == f32_bits(map.getf(r, c)));
          }
      }
}

TEST(Cpu_Im2col, RefusesBadArguments) {
  hot::ConvGeometry g;
  g.N = 1, g.C = 2, g.H = 4, g.W = 4, g.kh = 3, g.kw = 3, g.ph = 1, g.pw = 1;
  HostTensor map = HostTensor::make2d(DType::f32, 16, 2), cols = HostTensor::make2d(DType::f32, 16, 18);
  EXPECT_NO_THROW(hot::im2col(map, g, cols));
  HostTensor bad_map = HostTensor::make2d(DType::f32, 2, 16);  // an NCHW matrix, not channels-last
  EXPECT_TRUE(throws_hot([&] { hot::im2col(bad_map, g, cols); }, hot::ErrorKind::value, {"im2col", "map", "(16, 2)"}));
  HostTensor bad_cols = HostTensor::make2d(DType::bf16, 16, 18);
  EXPECT_TRUE(throws_hot([&] { hot::im2col(map, g, bad_cols); }, hot::ErrorKind::type, {"im2col", "cols", "float32"}));
  hot::ConvGeometry big = g;
  big.kh = 7;  // a 4 x 4 map with padding 1 has no 7-row window
  EXPECT_TRUE(throws_hot([&] { hot::im2col(map, big, cols); }, hot::ErrorKind::value, {"im2col", "no output pixel"}));
}

// compress_columns (SPEC §8) is compress_activation of the im2col columns of the int8 map's integers: equal bytes of
// q_t (padding columns included, outputs poisoned first) and an equal scale, over the geometries (raster and patch
// order), ranks and a map row stride.
TEST(Cpu_CompressColumns, EqualsCompressActivationOfIm2col) {
  uint64_t seed = 2900;
  for (const Geom& g : kGeoms)
    for (int rank : {4, 8, 16})
      for (int64_t pad : {0, 3}) {
        const hot::ConvGeometry cg = to_core(g);
        const int64_t L = g.N * cg.out_h() * cg.out_w(), K = g.C * g.kh * g.kw, P = g.N * g.H * g.W;
        const std::vector<int64_t> ints = randint(static_cast<size_t>(P * g.C), seed++, -127, 127);
        HostTensor map = host_from_int(DType::s8, P, g.C, ints, g.C + pad);
        std::vector<float> as_float(ints.begin(), ints.end());
        HostTensor mapf = host_from(DType::f32, P, g.C, as_float);
        HostTensor cols = HostTensor::make2d(DType::f32, L, K);
        hot::im2col(mapf, cg, cols);
        const int64_t K_pad = hot::padded_k(hot::hla_rows(L, rank));
        HostTensor q_ref = HostTensor::make2d(DType::s8, K, K_pad), s_ref = HostTensor::make1d(DType::f32, 1);
        HostTensor q = HostTensor::make2d(DType::s8, K, K_pad), s = HostTensor::make1d(DType::f32, 1);
        std::memset(q.bytes(), 0x5a, q.nbytes());
        hot::compress_activation(cols, q_ref, s_ref, rank);
        hot::compress_columns(map, cg, q, s, rank);
        EXPECT_TRUE(bits_equal(q, q_ref)) << "geometry " << (&g - kGeoms.data()) << " rank " << rank;
        EXPECT_EQ(f32_bits(s.getf(0)), f32_bits(s_ref.getf(0)));
        EXPECT_GT(s.getf(0), 0.0f);
      }
}

TEST(Cpu_CompressColumns, RefusesBadArguments) {
  hot::ConvGeometry g;
  g.N = 1, g.C = 2, g.H = 4, g.W = 4, g.kh = 3, g.kw = 3, g.ph = 1, g.pw = 1;
  const int64_t K_pad = hot::padded_k(hot::hla_rows(16, 8));
  HostTensor map = HostTensor::make2d(DType::s8, 16, 2), q = HostTensor::make2d(DType::s8, 18, K_pad);
  HostTensor s = HostTensor::make1d(DType::f32, 1);
  EXPECT_NO_THROW(hot::compress_columns(map, g, q, s, 8));
  HostTensor mapf = HostTensor::make2d(DType::f32, 16, 2);
  EXPECT_TRUE(throws_hot([&] { hot::compress_columns(mapf, g, q, s, 8); }, hot::ErrorKind::type,
                         {"compress_columns", "q_map", "int8"}));
  HostTensor q_short = HostTensor::make2d(DType::s8, 17, K_pad);
  EXPECT_TRUE(throws_hot([&] { hot::compress_columns(map, g, q_short, s, 8); }, hot::ErrorKind::value,
                         {"compress_columns", "q"}));
  EXPECT_TRUE(throws_hot([&] { hot::compress_columns(map, g, q, s, 17); }, hot::ErrorKind::value,
                         {"compress_columns", "rank"}));
}

// im2col_t (SPEC §8) is the transpose of the int8 map's im2col columns: every byte against a gather from the map
// (zeros in the padding), the columns past L zero (outputs poisoned first), for cols_t wider than padded_k(L) and with
// a row stride, and a map row stride.
TEST(Cpu_Im2colT, EqualsTransposedGather) {
  uint64_t seed = 2950;
  for (const Geom& g : kGeoms)
    for (int64_t pad : {0, 3}) {
      const hot::ConvGeometry cg = to_core(g);
      const int64_t Ho = cg.out_h(), Wo = cg.out_w(), L = g.N * Ho * Wo, K = g.C * g.kh * g.kw, P = g.N * g.H * g.W;
      const std::vector<int64_t> ints = randint(static_cast<size_t>(P * g.C), seed++, -128, 127);
      HostTensor map = host_from_int(DType::s8, P, g.C, ints, g.C + pad);
      const int64_t width = hot::padded_k(L) + 16 * pad;
      HostTensor q = HostTensor::make2d(DType::s8, K, width, width + pad);
      std::memset(q.bytes(), 0x5a, q.nbytes());
      hot::im2col_t(map, cg, q);
      for (int64_t n = 0; n < g.N; ++n)
        for (int64_t ho = 0; ho < Ho; ++ho)
          for (int64_t wo = 0; wo < Wo; ++wo)
            for (int i = 0; i < g.kh; ++i)
              for (int j = 0; j < g.kw; ++j)
                for (int64_t c = 0; c < g.C; ++c) {
                  const int64_t hp = ho * g.sh + i * g.dh, wp = wo * g.sw + j * g.dw;  // padded coordinates
                  const bool inside = hp >= g.ph && hp < g.H + g.ph && wp >= g.pw && wp < g.W + g.pw;
                  const size_t px = static_cast<size_t>(((n * g.H + hp - g.ph) * g.W + wp - g.pw) * g.C + c);
                  const int64_t want = inside ? ints[px] : 0;
                  const int64_t col = (static_cast<int64_t>(i) * g.kw + j) * g.C + c;
                  ASSERT_EQ(q.geti(col, row_of(g, Ho, Wo, n, ho, wo)), want) << "geometry " << (&g - kGeoms.data());
                }
      for (int64_t col = 0; col < K; ++col)
        for (int64_t l = L; l < width; ++l) ASSERT_EQ(q.geti(col, l), 0) << "geometry " << (&g - kGeoms.data());
    }
}

TEST(Cpu_Im2colT, RefusesBadArguments) {
  hot::ConvGeometry g;
  g.N = 1, g.C = 2, g.H = 4, g.W = 4, g.kh = 3, g.kw = 3, g.ph = 1, g.pw = 1;
  HostTensor map = HostTensor::make2d(DType::s8, 16, 2), q = HostTensor::make2d(DType::s8, 18, 16);
  EXPECT_NO_THROW(hot::im2col_t(map, g, q));
  HostTensor mapf = HostTensor::make2d(DType::f32, 16, 2);
  EXPECT_TRUE(throws_hot([&] { hot::im2col_t(mapf, g, q); }, hot::ErrorKind::type, {"im2col_t", "q_map", "int8"}));
  HostTensor narrow = HostTensor::make2d(DType::s8, 18, 15);
  EXPECT_TRUE(throws_hot([&] { hot::im2col_t(map, g, narrow); }, hot::ErrorKind::value,
                         {"im2col_t", "cols_t", "(18, 15)", "16"}));
  HostTensor short_rows = HostTensor::make2d(DType::s8, 17, 16);
  EXPECT_TRUE(throws_hot([&] { hot::im2col_t(map, g, short_rows); }, hot::ErrorKind::value,
                         {"im2col_t", "cols_t", "18"}));
}

// transpose against an element-by-element copy of the raw bytes (a copy: equal bits, NaN patterns included), with
// the output's padding (row padding and rows between batches) left as it was.
TEST(Cpu_Transpose, EqualsElementwiseCopy) {
  uint64_t seed = 1200;
  for (DType dt : {DType::f32, DType::bf16, DType::s8})
    for (const TransposeCase& c : transpose_cases()) {
      const size_t es = static_cast<size_t>(hot::dtype_bits(dt) / 8);
      HostTensor in = HostTensor::make2d(dt, c.B * (c.R + c.gap), c.S, c.S + c.pad);
      fill_random_bytes(in, seed++);
      HostTensor out = HostTensor::make2d(dt, c.B * (c.S + c.gap), c.R, c.R + c.pad), before = out;
      const TensorView iv = view3d(in, c.B, c.R, c.gap), ov = view3d(out, c.B, c.S, c.gap);
      hot::transpose(iv, ov);
      HostTensor want = before;
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t r = 0; r < c.R; ++r)
          for (int64_t s = 0; s < c.S; ++s)
            std::memcpy(want.bytes() + (b * ov.strides[0] + s * ov.strides[1] + r) * es,
                        in.bytes() + (b * iv.strides[0] + r * iv.strides[1] + s) * es, es);
      EXPECT_TRUE(bits_equal(want, out)) << hot::dtype_name(dt) << " " << c.B << "x" << c.R << "x" << c.S;
    }
}

TEST(Cpu_Transpose, RefusesBadArguments) {
  HostTensor in = HostTensor::make2d(DType::bf16, 6, 4), out = HostTensor::make2d(DType::bf16, 8, 3);
  const TensorView iv = view3d(in, 2, 3, 0), ov = view3d(out, 2, 4, 0);
  EXPECT_NO_THROW(hot::transpose(iv, ov));
  EXPECT_TRUE(throws_hot([&] { hot::transpose(in.view(), ov); }, hot::ErrorKind::value, {"transpose", "in"}));
  EXPECT_TRUE(throws_hot([&] { hot::transpose(iv, view3d(out, 2, 3, 0)); }, hot::ErrorKind::value,
                         {"transpose", "out", "(2, 4, 3)"}));
  HostTensor o32 = HostTensor::make2d(DType::f32, 8, 3);
  EXPECT_TRUE(throws_hot([&] { hot::transpose(iv, view3d(o32, 2, 4, 0)); }, hot::ErrorKind::type,
                         {"transpose", "out", "bfloat16"}));
  HostTensor p4 = HostTensor::make2d(DType::s4, 6, 4), o4 = HostTensor::make2d(DType::s4, 8, 3);
  EXPECT_TRUE(throws_hot([&] { hot::transpose(view3d(p4, 2, 3, 0), view3d(o4, 2, 4, 0)); }, hot::ErrorKind::type,
                         {"transpose", "8-, 16- or 32-bit", "int4"}));
  TensorView strided = iv;
  strided.shape = {2, 4, 3}, strided.strides = {12, 1, 4};  // the transposed view: not unit stride in its last dim
  EXPECT_TRUE(throws_hot([&] { hot::transpose(strided, view3d(in, 2, 3, 0)); }, hot::ErrorKind::value,
                         {"transpose", "unit stride"}));
  HostTensor sq = HostTensor::make2d(DType::bf16, 8, 4);
  EXPECT_TRUE(throws_hot([&] { hot::transpose(view3d(sq, 2, 4, 0), view3d(sq, 2, 4, 0)); }, hot::ErrorKind::value,
                         {"transpose", "overlap"}));
}

// backward_conv2d (SPEC §8). At stride 1 its g_x is the transposed convolution of the codes of G~ with W~: the
// test's replica of the g_y pass and of W~ (ref_backward: the same quantisation rules and random draws) gives the
// codes, their int64 sum over (i, j, o) per input pixel and channel, times (s_g s_w) / b in float64, bounds the
// result by the epilogue's few fp32 roundings. Every other geometry (stride 2, patch order) gives col2im of
// backward_linear's columns bit for bit, and g_w and g_b are backward_linear's over the columns bit for bit.
namespace {

struct ConvRun {
  HostTensor gx, gw, gb, cols_gx;
};

ConvRun run_conv_backward(const Geom& g, int64_t O, const std::vector<float>& gy, const std::vector<float>& w,
                          const std::vector<int64_t>& map_ints, const hot::Config& cfg, uint64_t seed, DType out_dt) {
  const hot::ConvGeometry cg = to_core(g);
  const int64_t L = g.N * cg.out_h() * cg.out_w(), CKK = g.C * g.kh * g.kw, P = g.N * g.H * g.W;
  const HostTensor gyt = host_from(DType::f32, L, O, gy), wt = host_from(DType::f32, O, CKK, w);
  HostTensor map = host_from_int(DType::s8, P, g.C, map_ints);
  hot::SavedActivation saved;
  saved.rows = L, saved.cols = CKK, saved.rank = cfg.rank;
  saved.q = hot::Tensor::empty(DType::s8, {CKK, hot::padded_k(hot::hla_rows(L, cfg.rank))}, hot::Device::cpu());
  saved.scale = hot::Tensor::empty(DType::f32, {1}, hot::Device::cpu());
  hot::compress_columns(map, cg, saved.q.view(), saved.scale.view(), cfg.rank);
  ConvRun r;
  r.gx = HostTensor::make2d(out_dt, P, g.C);
  r.gw = HostTensor::make2d(out_dt, O, CKK);
  r.gb = HostTensor::make1d(out_dt, O);
  hot::backward_conv2d(gyt, wt, &saved, cg, cfg, seed, {r.gx.view(), r.gw.view(), r.gb.view()});
  // backward_linear over the columns, for g_w, g_b and the column path's g_x
  HostTensor cols = HostTensor::make2d(out_dt, L, CKK), gw = HostTensor::make2d(out_dt, O, CKK);
  HostTensor gb = HostTensor::make1d(out_dt, O);
  hot::backward_linear(gyt, wt, &saved, cfg, seed, {cols.view(), gw.view(), gb.view()});
  EXPECT_TRUE(bits_equal(r.gw, gw));
  EXPECT_TRUE(bits_equal(r.gb, gb));
  r.cols_gx = HostTensor::make2d(out_dt, P, g.C);
  hot::col2im(cols, cg, r.cols_gx);
  return r;
}

}  // namespace

TEST(Cpu_BackwardConv2d, GxIsTheTransposedConvolutionOfTheCodes) {
  uint64_t seed = 3300;
  for (const Geom& g : kGeoms)
    for (int bits : {8, 4})
      for (DType out_dt : {DType::f32, DType::bf16}) {
        const hot::ConvGeometry cg = to_core(g);
        const int64_t Ho = cg.out_h(), Wo = cg.out_w(), L = g.N * Ho * Wo, CKK = g.C * g.kh * g.kw;
        const int64_t O = 20;  // O_pad 32, Hadamard block 4
        hot::Config cfg;
        cfg.gx_bits = bits;
        const std::vector<float> gy = randn(static_cast<size_t>(L * O), seed++, 0.01f);
        const std::vector<float> w = randn(static_cast<size_t>(O * CKK), seed++, 0.1f);
        const std::vector<int64_t> ints = randint(static_cast<size_t>(g.N * g.H * g.W * g.C), seed++, -127, 127);
        const ConvRun r = run_conv_backward(g, O, gy, w, ints, cfg, seed, out_dt);
        SCOPED_TRACE(testing::Message() << "geometry " << (&g - kGeoms.data()) << " bits " << bits << " out "
                                        << dtype_name(out_dt));
        const bool direct = g.sh == 1 && g.sw == 1 && !g.patches && g.ph <= g.dh * (g.kh - 1) &&
                            g.pw <= g.dw * (g.kw - 1);
        if (!direct) {
          EXPECT_TRUE(bits_equal(r.gx, r.cols_gx));
          continue;
        }
        const RefBackward ref = ref_backward(gy, w, {}, L, O, CKK, cfg, seed);
        std::vector<double> want(static_cast<size_t>(g.N * g.H * g.W * g.C), 0.0);
        const double scale = ref.qg.scale[0] * static_cast<double>(ref.qw.scale[0]) / ref.block;
        for (int64_t n = 0; n < g.N; ++n)
          for (int64_t h = 0; h < g.H; ++h)
            for (int64_t x = 0; x < g.W; ++x)
              for (int64_t c = 0; c < g.C; ++c) {
                int64_t acc = 0;
                for (int i = 0; i < g.kh; ++i)
                  for (int j = 0; j < g.kw; ++j) {
                    const int64_t ho = h + g.ph - i * g.dh, wo = x + g.pw - j * g.dw;
                    if (ho < 0 || ho >= Ho || wo < 0 || wo >= Wo) continue;
                    const int64_t row = (n * Ho + ho) * Wo + wo, col = (i * g.kw + j) * g.C + c;
                    for (int64_t o = 0; o < O; ++o) acc += ref.qg.q[row * O + o] * ref.qw.q[o * CKK + col];
                  }
                want[static_cast<size_t>(((n * g.H + h) * g.W + x) * g.C + c)] = static_cast<double>(acc) * scale;
              }
        EXPECT_TRUE(all_close(r.gx.to_f32(), want, 8 * std::ldexp(1.0, -24) + unit_roundoff(out_dt), 1e-30));
      }
}

// A call past one int32 g_w contraction (3 images of 224 x 224: K = 150,528 > kMaxInt32K) is one call (SPEC §4, §8):
// g_w and g_b are backward_linear's over the columns bit for bit (run_conv_backward checks them), g_w is the int64 sum
// of its operands' codes scaled once (round-to-nearest: G^ is the ABC buffer of g_y), and g_x is the column path's
// within the fp32 roundings of col2im's sums.
TEST(Cpu_BackwardConv2d, LongContractionsAreOneCall) {
  const Geom g{3, 8, 224, 224, 3, 3, 1, 1, 1, 1, 1, 1, false};
  const hot::ConvGeometry cg = to_core(g);
  const int64_t O = 16, L = 3 * 224 * 224, CKK = 72;
  hot::Config cfg;
  cfg.rounding = hot::Rounding::nearest;
  ASSERT_GT(hot::padded_k(hot::hla_rows(L, cfg.rank)), hot::kMaxInt32K);
  const std::vector<float> gy = randn(static_cast<size_t>(L * O), 41, 0.01f);
  const std::vector<float> w = randn(static_cast<size_t>(O * CKK), 42, 0.1f);
  const std::vector<int64_t> ints = randint(static_cast<size_t>(L * g.C), 43, -127, 127);
  const ConvRun r = run_conv_backward(g, O, gy, w, ints, cfg, 77, DType::f32);
  HostTensor map = host_from_int(DType::s8, L, g.C, ints);
  hot::SavedActivation cols;
  cols.q = hot::Tensor::empty(DType::s8, {CKK, hot::padded_k(hot::hla_rows(L, cfg.rank))}, hot::Device::cpu());
  cols.scale = hot::Tensor::empty(DType::f32, {1}, hot::Device::cpu());
  hot::compress_columns(map, cg, cols.q.view(), cols.scale.view(), cfg.rank);
  const hot::SavedActivation gh = hot::compress_activation(host_from(DType::f32, L, O, gy), cfg.rank);
  hot_test::expect_int64_dequant(gh.q.view(), cols.q.view(), static_cast<const float*>(gh.scale.view().data)[0],
                                 static_cast<const float*>(cols.scale.view().data)[0], 1.0f / 16, r.gw);
  const std::vector<float> gx = r.gx.to_f32(), gx_cols = r.cols_gx.to_f32();
  double e = 0, n = 0;
  for (size_t i = 0; i < gx.size(); ++i) {
    e += (static_cast<double>(gx[i]) - gx_cols[i]) * (static_cast<double>(gx[i]) - gx_cols[i]);
    n += static_cast<double>(gx_cols[i]) * gx_cols[i];
  }
  EXPECT_LT(std::sqrt(e / n), 1e-6);
}

// g_w from the codes of G~ and of the map's columns (SPEC §4, §8; saved.codes): the test's replica of the g_y pass
// gives G~'s codes (ref_backward's qg), whose int64 products with the map's columns, transformed along O by H_b in
// float64 and scaled by s_g s_map / b, bound the result by the dequantisation's fp32 roundings and the transform's
// log2(b) levels of fp32 additions (relative to the sum of the magnitudes that meet in each output). g_x and g_b are
// the call's with the ABC buffer of the columns bit for bit (the same G~), and g_w does not depend on whether g_x was
// asked for (G~ is formed for g_w alone then: the model's first layer).
TEST(Cpu_BackwardConv2d, GwFromTheCodes) {
  uint64_t seed = 3500;
  for (const Geom& g : kGeoms)
    for (int64_t O : {20, 32}) {  // Hadamard blocks 4 and 16
      SCOPED_TRACE(testing::Message() << "geometry " << (&g - kGeoms.data()) << " O " << O);
      const hot::ConvGeometry cg = to_core(g);
      const int64_t L = g.N * cg.out_h() * cg.out_w(), CKK = g.C * g.kh * g.kw, P = g.N * g.H * g.W;
      const hot::Config cfg;  // the default: rank 16, 8-bit g_x per tensor, stochastic rounding
      const std::vector<float> gy = randn(static_cast<size_t>(L * O), seed++, 0.01f);
      const std::vector<float> w = randn(static_cast<size_t>(O * CKK), seed++, 0.1f);
      const std::vector<int64_t> ints = randint(static_cast<size_t>(P * g.C), seed++, -127, 127);
      const HostTensor gyt = host_from(DType::f32, L, O, gy), wt = host_from(DType::f32, O, CKK, w);
      HostTensor map = host_from_int(DType::s8, P, g.C, ints);
      const float s_map = 0.0123f;
      hot::SavedActivation saved;
      saved.rows = L, saved.cols = CKK, saved.rank = 16, saved.codes = true;
      saved.q = hot::Tensor::empty(DType::s8, {CKK, hot::padded_k(L)}, hot::Device::cpu());
      saved.scale = hot::Tensor::empty(DType::f32, {1}, hot::Device::cpu());
      static_cast<float*>(saved.scale.view().data)[0] = s_map;
      hot::im2col_t(map, cg, saved.q.view());
      HostTensor gx = HostTensor::make2d(DType::f32, P, g.C), gw = HostTensor::make2d(DType::f32, O, CKK);
      HostTensor gb = HostTensor::make1d(DType::f32, O);
      hot::backward_conv2d(gyt, wt, &saved, cg, cfg, seed, {gx.view(), gw.view(), gb.view()});
      HostTensor gw_alone = HostTensor::make2d(DType::f32, O, CKK);
      hot::backward_conv2d(gyt, wt, &saved, cg, cfg, seed, {{}, gw_alone.view(), {}});
      EXPECT_TRUE(bits_equal(gw_alone, gw));
      // the same call with the ABC buffer of the columns: the same g_x and g_b
      hot::SavedActivation cols;
      cols.rows = L, cols.cols = CKK, cols.rank = 16;
      cols.q = hot::Tensor::empty(DType::s8, {CKK, hot::padded_k(hot::hla_rows(L, 16))}, hot::Device::cpu());
      cols.scale = hot::Tensor::empty(DType::f32, {1}, hot::Device::cpu());
      hot::compress_columns(map, cg, cols.q.view(), cols.scale.view(), 16);
      HostTensor gx2 = HostTensor::make2d(DType::f32, P, g.C), gw2 = HostTensor::make2d(DType::f32, O, CKK);
      HostTensor gb2 = HostTensor::make1d(DType::f32, O);
      hot::backward_conv2d(gyt, wt, &cols, cg, cfg, seed, {gx2.view(), gw2.view(), gb2.view()});
      EXPECT_TRUE(bits_equal(gx, gx2));
      EXPECT_TRUE(bits_equal(gb, gb2));
      // float64: D = G~ᵀ X (the codes), then H_b along O
      const RefBackward ref = ref_backward(gy, w, {}, L, O, CKK, cfg, seed);
      const int b = ref.block;
      std::vector<int64_t> colv(static_cast<size_t>(L * CKK));
      for (int64_t k = 0; k < CKK; ++k)
        for (int64_t l = 0; l < L; ++l)
          colv[static_cast<size_t>(l * CKK + k)] = saved.q.view().ptr<int8_t>()[k * hot::padded_k(L) + l];
      std::vector<double> D(static_cast<size_t>(O * CKK), 0.0);
      for (int64_t o = 0; o < O; ++o)
        for (int64_t k = 0; k < CKK; ++k) {
          int64_t acc = 0;
          for (int64_t l = 0; l < L; ++l) acc += ref.qg.q[l * O + o] * colv[static_cast<size_t>(l * CKK + k)];
          D[static_cast<size_t>(o * CKK + k)] = static_cast<double>(acc) * ref.qg.scale[0] * s_map / b;
        }
      const std::vector<float> got = gw.to_f32();
      const double u = std::ldexp(1.0, -24), tol_rel = (4 + std::log2(b)) * u * 1.01;
      int bad = 0;
      for (int64_t o = 0; o < O; ++o)
        for (int64_t k = 0; k < CKK; ++k) {
          double want = 0, mag = 0;
          const int64_t g0 = o / b * b;
          for (int64_t t = 0; t < b; ++t) {  // H_b[o % b][t] = (-1)^popcount((o % b) & t)
            const double d = D[static_cast<size_t>((g0 + t) * CKK + k)];
            want += (__builtin_popcountll(static_cast<uint64_t>((o % b) & t)) % 2 ? -d : d);
            mag += std::fabs(d);
          }
          if (!(std::fabs(got[static_cast<size_t>(o * CKK + k)] - want) <= tol_rel * mag + 1e-30)) ++bad;
        }
      EXPECT_EQ(bad, 0);
    }
}

TEST(Cpu_BackwardConv2d, RefusesBadArguments) {
  const Geom g{1, 4, 6, 6, 3, 3, 1, 1, 1, 1, 1, 1, false};
  const hot::ConvGeometry cg = to_core(g);
  HostTensor gy = HostTensor::make2d(DType::f32, 36, 8), w = HostTensor::make2d(DType::f32, 8, 36);
  HostTensor gx = HostTensor::make2d(DType::f32, 36, 4);
  const hot::Config cfg;
  EXPECT_NO_THROW(hot::backward_conv2d(gy, w, nullptr, cg, cfg, 1, {gx.view(), {}, {}}));
  HostTensor gy_bad = HostTensor::make2d(DType::f32, 35, 8);
  EXPECT_TRUE(throws_hot([&] { hot::backward_conv2d(gy_bad, w, nullptr, cg, cfg, 1, {gx.view(), {}, {}}); },
                         hot::ErrorKind::value, {"backward_conv2d", "grad_output", "36"}));
  HostTensor w_bad = HostTensor::make2d(DType::f32, 8, 35);
  EXPECT_TRUE(throws_hot([&] { hot::backward_conv2d(gy, w_bad, nullptr, cg, cfg, 1, {gx.view(), {}, {}}); },
                         hot::ErrorKind::value, {"backward_conv2d", "weight", "kh * kw * C"}));
  HostTensor gx_bad = HostTensor::make2d(DType::f32, 36, 3);
  EXPECT_TRUE(throws_hot([&] { hot::backward_conv2d(gy, w, nullptr, cg, cfg, 1, {gx_bad.view(), {}, {}}); },
                         hot::ErrorKind::value, {"backward_conv2d", "grad_input"}));
  HostTensor gw = HostTensor::make2d(DType::f32, 8, 36);
  EXPECT_TRUE(throws_hot([&] { hot::backward_conv2d(gy, w, nullptr, cg, cfg, 1, {{}, gw.view(), {}}); },
                         hot::ErrorKind::value, {"backward_conv2d", "saved"}));
  const hot::QuantizedWeight other = hot::quantize_weight(HostTensor::make2d(DType::f32, 8, 35), cfg.gx_bits);
  EXPECT_TRUE(throws_hot([&] { hot::backward_conv2d(gy, w, nullptr, cg, cfg, 1, {gx.view(), {}, {}}, {}, &other); },
                         hot::ErrorKind::value, {"backward_conv2d", "weight_q"}));
  // the codes of the columns (saved.codes) need rank 16, 8-bit g_x per tensor, and a float32 g_w
  hot::SavedActivation codes;
  codes.rows = 36, codes.cols = 36, codes.rank = 16, codes.codes = true;
  codes.q = hot::Tensor::zeros(DType::s8, {36, hot::padded_k(36)}, hot::Device::cpu());
  codes.scale = hot::Tensor::zeros(DType::f32, {1}, hot::Device::cpu());
  EXPECT_NO_THROW(hot::backward_conv2d(gy, w, &codes, cg, cfg, 1, {gx.view(), gw.view(), {}}));
  hot::Config four = cfg;
  four.gx_bits = 4;
  EXPECT_TRUE(throws_hot([&] { hot::backward_conv2d(gy, w, &codes, cg, four, 1, {gx.view(), gw.view(), {}}); },
                         hot::ErrorKind::value, {"backward_conv2d", "saved.codes", "gx_bits 4"}));
  HostTensor gw16 = HostTensor::make2d(DType::bf16, 8, 36);
  EXPECT_TRUE(throws_hot([&] { hot::backward_conv2d(gy, w, &codes, cg, cfg, 1, {gx.view(), gw16.view(), {}}); },
                         hot::ErrorKind::type, {"backward_conv2d", "grad_weight", "float32"}));
}
