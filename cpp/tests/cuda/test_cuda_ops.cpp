// CUDA backend vs the CPU backend (the reference): every integer result bit for bit, on a
// non-default stream, over odd and large shapes and the three float dtypes. Outputs start poisoned and
// are compared byte for byte including row padding, so unwritten or overwritten elements show.
#include <cmath>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda_test_util.h"

namespace hot_cuda_test {
namespace {

using hot::Device;
using hot::ScaleMode;
using hot::Rounding;

const DType kFloatTypes[] = {DType::f32, DType::bf16, DType::f16};

// ---- Hadamard / HLA ----------------------------------------------------------------------------------

class Cuda_Hadamard : public CudaTest {};
TEST_F(Cuda_Hadamard, BitExactVsCpu) {
  const std::vector<std::tuple<int64_t, int64_t, int>> cases = {
      {1, 1, 1}, {3, 16, 16}, {32, 5, 16}, {7, 256, 256}, {256, 3, 256}, {64, 96, 32}, {130, 24, 8}, {33, 50, 2}};
  uint64_t seed = 1;
  for (DType dt : kFloatTypes)
    for (auto [R, C, block] : cases)
      for (int axis : {0, 1}) {
        if ((axis == 0 ? R : C) % block != 0) continue;
        SCOPED_TRACE(testing::Message() << dt_name(dt) << " " << R << "x" << C << " block " << block << " axis "
                                        << axis);
        HostTensor in = rand_float(dt, R, C, seed++, C + 3);
        HostTensor oc = out2d(DType::f32, R, C, C + 1), og = oc;
        DevTensor din(in), dout(og);
        hot::hadamard_transform(in, oc, block, axis);
        hot::hadamard_transform(din, dout, block, axis, st());
        sync();
        EXPECT_TRUE(all_bytes_equal(oc, dout.to_host()));
      }
}

class Cuda_Hla : public CudaTest {};
TEST_F(Cuda_Hla, BitExactVsCpu) {
  uint64_t seed = 100;
  for (DType dt : kFloatTypes)
    for (int64_t L : {1, 15, 17, 333, 4097})
      for (int64_t C : {1, 7, 64})
        for (int rank : {1, 8, 16}) {
          SCOPED_TRACE(testing::Message() << dt_name(dt) << " L " << L << " C " << C << " rank " << rank);
          HostTensor in = rand_float(dt, L, C, seed++);
          const int64_t K = hot::hla_rows(L, rank);
          HostTensor oc = out2d(DType::f32, K, C), og = oc;
          DevTensor din(in), dout(og);
          hot::hla_project(in, oc, rank);
          hot::hla_project(din, dout, rank, st());
          sync();
          EXPECT_TRUE(all_bytes_equal(oc, dout.to_host()));
        }
}

// ---- quantise / dequantise / int4 --------------------------------------------------------------------

class Cuda_Quantize : public CudaTest {
 protected:
  // The codes (row stride q_ld) and scales of the GPU equal the CPU backend's, byte for byte.
  void expect_bit_exact(const HostTensor& in, const hot::QuantizeParams& p, int64_t q_ld) {
    const int64_t R = in.rows(), C = in.cols();
    const int64_t ns = p.scale == ScaleMode::tensor ? 1 : R;
    HostTensor qc = out2d(DType::s8, R, C, q_ld), qg = qc;
    HostTensor sc = out1d(DType::f32, ns), sg = sc;
    DevTensor din(in), dq(qg), ds(sg);
    hot::quantize(in, qc, sc, p);
    hot::quantize(din, dq, ds, p, st());
    sync();
    EXPECT_TRUE(all_bytes_equal(qc, dq.to_host()));
    EXPECT_TRUE(all_bytes_equal(sc, ds.to_host()));
  }
};
TEST_F(Cuda_Quantize, BitExactVsCpu) {
  for_each_quantize_case({std::begin(kFloatTypes), std::end(kFloatTypes)},
                         {{1, 1}, {3, 1}, {37, 53}, {1000, 129}, {5, 4099}},
                         [&](const HostTensor& in, const hot::QuantizeParams& p) {
                           expect_bit_exact(in, p, in.cols() + 5);
                         });
}

// Contiguous input and codes with one scale: the flat kernels (8 elements per vector, any n, a partial last group;
// stochastic with C % 8 == 0: 4 rows x 8 columns per thread, rows past a multiple of 4, several row and column calls).
TEST_F(Cuda_Quantize, ContiguousBitExactVsCpu) {
  uint64_t seed = 400;
  for (DType dt : kFloatTypes)
    for (auto [R, C] :
         std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {1, 7}, {3, 8}, {37, 53}, {1000, 129}, {64, 4096}, {130, 264}})
      for (int bits : {4, 8})
        for (hot::Rounding rd : {hot::Rounding::nearest, hot::Rounding::stochastic}) {
          SCOPED_TRACE(testing::Message() << dt_name(dt) << " " << R << "x" << C << " bits " << bits);
          hot::QuantizeParams p;
          p.bits = bits;
          p.rounding = rd;
          p.seed = 0x9e3779b97f4a7c15ull + seed;
          expect_bit_exact(rand_float(dt, R, C, seed++, C, 3.0f), p, C);
        }
}

TEST_F(Cuda_Quantize, NonFiniteGivesNaNScaleAndZeros) {
  for (ScaleMode sm : {ScaleMode::tensor, ScaleMode::token}) {
    std::vector<float> v = hot_test::randn(6 * 40, 7);
    v[2 * 40 + 5] = std::nanf("");
    v[4 * 40 + 1] = INFINITY;
    HostTensor in = hot_test::host_from(DType::f32, 6, 40, v);
    hot::QuantizeParams p;
    p.bits = 8;
    p.scale = sm;
    p.rounding = Rounding::stochastic;
    p.seed = 5;
    const int64_t ns = sm == ScaleMode::tensor ? 1 : 6;
    HostTensor qc = out2d(DType::s8, 6, 40), qg = qc, sc = out1d(DType::f32, ns), sg = sc;
    DevTensor din(in), dq(qg), ds(sg);
    hot::quantize(in, qc, sc, p);
    hot::quantize(din, dq, ds, p, st());
    sync();
    const HostTensor qh = dq.to_host(), sh = ds.to_host();
    EXPECT_TRUE(all_bytes_equal(qc, qh));
    for (int64_t i = 0; i < ns; ++i) {
      const bool bad_row = sm == ScaleMode::tensor || i == 2 || i == 4;
      EXPECT_EQ(std::isnan(sh.getf(i)), bad_row) << "scale " << i;
      EXPECT_EQ(std::isnan(sc.getf(i)), bad_row) << "cpu scale " << i;
    }
  }
}

// amax below ~3.7e-37: qmax / amax overflows, the rules pre-scale by 2^64 (QuantScale::pre).
TEST_F(Cuda_Quantize, TinyAmaxBitExactVsCpu) {
  uint64_t seed = 250;
  for (DType dt : {DType::f32, DType::bf16})
    for (ScaleMode sm : {ScaleMode::tensor, ScaleMode::token})
      for (Rounding rd : {Rounding::nearest, Rounding::stochastic}) {
        HostTensor in = rand_float(dt, 33, 70, seed++, -1, 1e-38f);
        hot::QuantizeParams p;
        p.bits = 8;
        p.scale = sm;
        p.rounding = rd;
        p.seed = seed;
        const int64_t ns = sm == ScaleMode::tensor ? 1 : 33;
        HostTensor qc = out2d(DType::s8, 33, 70), qg = qc, sc = out1d(DType::f32, ns), sg = sc;
        DevTensor din(in), dq(qg), ds(sg);
        hot::quantize(in, qc, sc, p);
        hot::quantize(din, dq, ds, p, st());
        sync();
        EXPECT_TRUE(all_bytes_equal(qc, dq.to_host())) << dt_name(dt);
        EXPECT_TRUE(all_bytes_equal(sc, ds.to_host())) << dt_name(dt);
      }
  // and through the fused g_y pass
  for (ScaleMode sm : {ScaleMode::tensor, ScaleMode::token}) {
    const int64_t L = 70, O = 48;
    HostTensor gy = rand_float(DType::f32, L, O, seed++, -1, 1e-38f);
    hot::GradOutputPlan plan;
    plan.gx = plan.gw = true;
    plan.gx_bits = 4;
    plan.block = 16;
    plan.gx_scale = sm;
    plan.seed = 9;
    const int64_t Kp = hot::padded_k(hot::hla_rows(L, 8));
    HostTensor qg = out2d(DType::s8, L, 48), sg = out1d(DType::f32, sm == ScaleMode::tensor ? 1 : L);
    HostTensor qh = out2d(DType::s8, O, Kp), sh = out1d(DType::f32, 1);
    DevTensor dqg(qg), dsg(sg), dqh(qh), dsh(sh), dgy(gy);
    hot::GradOutputQuant oc, og;
    oc.q_g = qg, oc.s_g = sg, oc.q_gh_t = qh, oc.s_gh = sh;
    og.q_g = dqg, og.s_g = dsg, og.q_gh_t = dqh, og.s_gh = dsh;
    hot::cpu::quantize_grad_output(gy, plan, oc, {});
    hot::cuda::quantize_grad_output(dgy, plan, og, st());
    sync();
    EXPECT_TRUE(all_bytes_equal(qg, dqg.to_host()));
    EXPECT_TRUE(all_bytes_equal(sg, dsg.to_host()));
    EXPECT_TRUE(all_bytes_equal(qh, dqh.to_host()));
    EXPECT_TRUE(all_bytes_equal(sh, dsh.to_host()));
  }
}

class Cuda_Dequantize : public CudaTest {};
TEST_F(Cuda_Dequantize, BitExactVsCpu) {
  uint64_t seed = 300;
  for (DType dt : kFloatTypes)
    for (auto [R, C] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {17, 33}, {300, 257}})
      for (bool per_row : {false, true}) {
        HostTensor q = rand_int(DType::s8, R, C, -127, 127, seed++, C + 1);
        HostTensor s = hot_test::host_from(DType::f32, 1, per_row ? R : 1,
                                           hot_test::randn(static_cast<size_t>(per_row ? R : 1), seed++, 0.1f));
        HostTensor s1 = HostTensor::make1d(DType::f32, per_row ? R : 1);
        for (int64_t i = 0; i < s1.cols(); ++i) s1.setf(i, std::fabs(s.getf(0, i)));
        HostTensor oc = out2d(dt, R, C, C + 2), og = oc;
        DevTensor dq(q), ds(s1), dout(og);
        hot::dequantize(q, s1, oc);
        hot::dequantize(dq, ds, dout, st());
        sync();
        EXPECT_TRUE(all_bytes_equal(oc, dout.to_host())) << dt_name(dt) << " " << R << "x" << C;
      }
}

class Cuda_Col2im : public CudaTest {};
TEST_F(Cuda_Col2im, BitExactVsCpu) {
  uint64_t seed = 950;
  for (DType dt : kFloatTypes)
    for (const hot::ConvGeometry& g : col2im_geometries()) {
      const int64_t L = g.N * g.out_h() * g.out_w(), K = g.C * g.kh * g.kw;
      HostTensor cols = rand_float(dt, L, K, seed++, K + 3);
      HostTensor oc = out2d(dt, g.N * g.H * g.W, g.C, g.C + 2), o2 = oc;  // channels-last, a row stride
      DevTensor dcols(cols), dout(o2);
      hot::col2im(cols, g, oc);
      hot::col2im(dcols, g, dout, st());
      sync();
      EXPECT_TRUE(all_bytes_equal(oc, dout.to_host())) << dt_name(dt) << " case " << seed;
    }
}

class Cuda_Im2col : public CudaTest {};
TEST_F(Cuda_Im2col, BitExactVsCpu) {
  uint64_t seed = 960;
  for (DType dt : kFloatTypes)
    for (const hot::ConvGeometry& g : col2im_geometries())
      for (int64_t pad : {0, 1}) {
        const int64_t L = g.N * g.out_h() * g.out_w(), K = g.C * g.kh * g.kw;
        HostTensor map = rand_float(dt, g.N * g.H * g.W, g.C, seed++, g.C + pad);
        HostTensor cc = out2d(dt, L, K, K + pad), cg = cc;
        DevTensor dmap(map), dcols(cg);
        hot::im2col(map, g, cc);
        hot::im2col(dmap, g, dcols, st());
        sync();
        EXPECT_TRUE(all_bytes_equal(cc, dcols.to_host())) << dt_name(dt) << " case " << seed;
      }
}

class Cuda_Transpose : public CudaTest {};
TEST_F(Cuda_Transpose, BitExactVsCpu) {
  uint64_t seed = 1300;
  for (DType dt : {DType::f32, DType::bf16, DType::s8})
    for (const hot_test::TransposeCase& c : hot_test::transpose_cases()) {
      HostTensor in = HostTensor::make2d(dt, c.B * (c.R + c.gap), c.S, c.S + c.pad);
      hot_test::fill_random_bytes(in, seed++);
      HostTensor oc = out2d(dt, c.B * (c.S + c.gap), c.R, c.R + c.pad), og = oc;
      DevTensor din(in), dout(og);
      hot::transpose(hot_test::view3d(in, c.B, c.R, c.gap), hot_test::view3d(oc, c.B, c.S, c.gap));
      hot::transpose(hot_test::view3d(din, c.B, c.R, c.gap), hot_test::view3d(dout, c.B, c.S, c.gap), st());
      sync();
      EXPECT_TRUE(all_bytes_equal(oc, dout.to_host())) << dt_name(dt) << " " << c.B << "x" << c.R << "x" << c.S;
    }
}

class Cuda_CompressColumns : public CudaTest {};
TEST_F(Cuda_CompressColumns, BitExactVsCpu) {
  uint64_t seed = 9100;
  std::vector<hot::ConvGeometry> geoms = col2im_geometries();
  if (!small_run()) {  // ResNet-50 layer1's 3x3 at batch 8, patch order: 1568 blocks of 16 rows, 576 columns
    hot::ConvGeometry g;
    g.N = 8, g.C = 64, g.H = 56, g.W = 56, g.kh = 3, g.kw = 3, g.ph = 1, g.pw = 1, g.patches = true;
    geoms.push_back(g);
  }
  for (const hot::ConvGeometry& g : geoms)
    for (int rank : {8, 16}) {
      const int64_t L = g.N * g.out_h() * g.out_w(), K = g.C * g.kh * g.kw, Kp = hot::padded_k(hot::hla_rows(L, rank));
      HostTensor map = rand_int(DType::s8, g.N * g.H * g.W, g.C, -127, 127, seed++, g.C + 1);
      HostTensor qc = out2d(DType::s8, K, Kp), qg = qc, sc = out1d(DType::f32, 1), sg = sc;
      DevTensor dmap(map), dq(qg), ds(sg);
      hot::compress_columns(map, g, qc, sc, rank);
      hot::compress_columns(dmap, g, dq, ds, rank, st());
      sync();
      EXPECT_TRUE(all_bytes_equal(qc, dq.to_host())) << "case " << seed << " rank " << rank;
      EXPECT_TRUE(all_bytes_equal(sc, ds.to_host())) << "case " << seed << " rank " << rank;
    }
}

// im2col_t: the same bytes as the CPU's, for maps whose channel runs allow 32-bit gathers (C % 4 == 0) and not, cols_t
// rows 16-byte aligned and not (a row stride of K + 1), the zeros past L, a map row stride; convolutions whose output
// has the map's size take the shifting kernel (shift_geometries, ResNet-50 layer1's 3x3).
class Cuda_Im2colT : public CudaTest {};
TEST_F(Cuda_Im2colT, BitExactVsCpu) {
  uint64_t seed = 9150;
  std::vector<hot::ConvGeometry> geoms = col2im_geometries();
  hot::ConvGeometry g4;  // a 3x3 of 8 channels over 9 x 7 pixels at batch 3: 189 rows, V = 4
  g4.N = 3, g4.C = 8, g4.H = 9, g4.W = 7, g4.kh = 3, g4.kw = 3, g4.ph = 1, g4.pw = 1;
  geoms.push_back(g4);
  if (!small_run()) {  // ResNet-50 layer1's 3x3 at batch 8 and 48 (512-row tiles); its stem at batch 2 (C = 3)
    hot::ConvGeometry g;
    g.N = 8, g.C = 64, g.H = 56, g.W = 56, g.kh = 3, g.kw = 3, g.ph = 1, g.pw = 1;
    geoms.push_back(g);
    g.N = 48;
    geoms.push_back(g);
    g.N = 8;
    g.N = 2, g.C = 3, g.H = 224, g.W = 224, g.kh = 7, g.kw = 7, g.sh = 2, g.sw = 2, g.ph = 3, g.pw = 3;
    geoms.push_back(g);
  }
  for (const hot::ConvGeometry& g : shift_geometries()) geoms.push_back(g);
  for (const hot::ConvGeometry& g : geoms)
    for (int64_t pad : {0, 1, 2}) {  // 2: a zero chunk past L and 16-byte aligned rows with padding (the shifts)
      const int64_t L = g.N * g.out_h() * g.out_w(), K = g.C * g.kh * g.kw, Kp = hot::padded_k(L) + 16 * (pad > 0);
      const int64_t ldm = g.C + 16 * (pad == 2) + 4 * (pad == 1);
      HostTensor map = rand_int(DType::s8, g.N * g.H * g.W, g.C, -128, 127, seed++, ldm);
      HostTensor qc = out2d(DType::s8, K, Kp, Kp + (pad == 1 ? 1 : 16 * (pad == 2))), qg = qc;
      DevTensor dmap(map), dq(qg);
      hot::im2col_t(map, g, qc);
      hot::im2col_t(dmap, g, dq, st());
      sync();
      EXPECT_TRUE(all_bytes_equal(qc, dq.to_host())) << "case " << seed << " C " << g.C << " pad " << pad;
    }
}

class Cuda_ReluMask : public CudaTest {};
TEST_F(Cuda_ReluMask, BitExactVsCpu) {
  uint64_t seed = 970;
  for (DType dt : kFloatTypes)
    for (int64_t n : hot_test::relu_sizes()) {
      SCOPED_TRACE(testing::Message() << dt_name(dt) << " n " << n);
      const HostTensor x = hot_test::relu_input(dt, n, seed++);
      HostTensor yc = out1d(dt, n), bc = out1d(DType::s8, (n + 7) / 8);
      DevTensor dx(x), dy(yc), db(bc), di(x), dbi(bc);
      hot::relu_mask(x, yc, bc);
      hot::relu_mask(dx, dy, db, st());
      hot::relu_mask(di, di, dbi, st());  // in place
      const HostTensor gy = hot_test::relu_input(dt, n, seed++);
      HostTensor gc = out1d(dt, n);
      DevTensor dgy(gy), dgx(gc);
      hot::relu_mask_backward(gy, bc, gc);
      hot::relu_mask_backward(dgy, db, dgx, st());
      hot::relu_mask_backward(dgy, db, dgy, st());  // in place
      sync();
      EXPECT_TRUE(all_bytes_equal(yc, dy.to_host()));
      EXPECT_TRUE(all_bytes_equal(bc, db.to_host()));
      EXPECT_TRUE(all_bytes_equal(yc, di.to_host()));
      EXPECT_TRUE(all_bytes_equal(bc, dbi.to_host()));
      EXPECT_TRUE(all_bytes_equal(gc, dgx.to_host()));
      EXPECT_TRUE(all_bytes_equal(gc, dgy.to_host()));
    }
}

// y's amax from the GPU's ReLU (in place, the converted layers' case) fed to quantize and activation_codes of y on the
// GPU: the bytes of the CPU's quantize and codes without it; the amax the CPU's (a NaN as any NaN); specials, finite.
TEST_F(Cuda_ReluMask, AmaxFeedsQuantizeAndCodes) {
  uint64_t seed = 1970;
  for (DType dt : kFloatTypes)
    // the largest: 20M elements, more CTAs' worth than relu_mask launches with the amax (its grid-stride loop)
    for (auto [R, C] : std::vector<std::pair<int64_t, int64_t>>{{1, 1000}, {37, 64}, {3001, 77}, {312500, 64}})
      for (bool finite : {false, true}) {
        if (R == 312500 && (small_run() || dt != DType::bf16)) continue;
        SCOPED_TRACE(testing::Message() << dt_name(dt) << " " << R << "x" << C << " finite " << finite);
        const int64_t n = R * C;
        HostTensor x1 = hot_test::relu_input(dt, n, seed++);
        for (int64_t i = 0; i < n && finite; ++i)
          if (!std::isfinite(x1.getf(i))) x1.setf(i, 0.25f);
        HostTensor x = HostTensor::make2d(dt, R, C);  // the same elements as a matrix
        std::memcpy(x.bytes(), x1.bytes(), x1.nbytes());
        HostTensor y = HostTensor::make1d(dt, n), b = out1d(DType::s8, (n + 7) / 8), ac = out1d(DType::f32, 1);
        hot::relu_mask(x1, y, b, ac);
        HostTensor ym = HostTensor::make2d(dt, R, C);
        std::memcpy(ym.bytes(), y.bytes(), y.nbytes());
        hot::QuantizeParams p;
        HostTensor qc = out2d(DType::s8, R, C), sc = out1d(DType::f32, 1);
        hot::quantize(ym, qc, sc, p);
        const hot::SavedActivation cc = hot::activation_codes(ym);
        DevTensor dx(x), db(b), da(out1d(DType::f32, 1)), dq(qc), ds(sc);
        hot::TensorView flat = dx.view();
        flat.shape = {n};
        flat.strides = {1};
        hot::relu_mask(flat, flat, db, da, st());
        hot::quantize(dx, dq, ds, p, da, st());
        HostTensor qk = out2d(DType::s8, C, cc.q.view().shape[1]), sk = out1d(DType::f32, 1);
        DevTensor dqk(qk), dsk(sk);
        hot::activation_codes(dx, dqk, dsk, da, st());
        sync();
        const HostTensor ag = da.to_host();
        if (std::isnan(ac.getf(0)))
          EXPECT_TRUE(std::isnan(ag.getf(0)));
        else
          EXPECT_TRUE(all_bytes_equal(ac, ag));
        EXPECT_TRUE(all_bytes_equal(ym, dx.to_host()));
        EXPECT_TRUE(all_bytes_equal(qc, dq.to_host()));
        EXPECT_TRUE(all_bytes_equal(sc, ds.to_host()));
        const HostTensor qkh = dqk.to_host(), skh = dsk.to_host();
        EXPECT_EQ(std::memcmp(qkh.bytes(), cc.q.view().data, cc.q.nbytes()), 0);
        EXPECT_EQ(std::memcmp(skh.bytes(), cc.scale.view().data, 4), 0);
      }
}

// BatchNorm's per-channel sums on the GPU: the CPU's bits (sum_dy, sum_dy_xmu, grad_weight); a partial row group,
// channels not a multiple of 8 and padded rows (element-wise loads), two channel slices, and ResNet-50 sizes; with a
// ReLU's bits, g_relu's bytes too.
class Cuda_BatchNormBackwardReduce : public CudaTest {};
TEST_F(Cuda_BatchNormBackwardReduce, BitExactVsCpu) {
  uint64_t seed = 2500;
  for (DType dt : kFloatTypes)
    for (auto [R, C] : std::vector<std::pair<int64_t, int64_t>>{
             {1, 16}, {37, 13}, {3001, 72}, {2100, 264}, {100352, 64}, {25088, 256}, {6272, 2048}})
      for (int64_t pad : {0, 8})
        for (bool relu : {false, true}) {
          if (R * C > 1000000 && (small_run() || pad != 0)) continue;
          if (relu && pad != 0) continue;  // the bits follow contiguous rows
          SCOPED_TRACE(testing::Message() << dt_name(dt) << " " << R << "x" << C << " pad " << pad << " relu "
                                          << relu);
          const HostTensor gy = rand_float(dt, R, C, seed++, C + pad, 2.0f);
          const HostTensor x = rand_float(dt, R, C, seed++, C + pad, 3.0f);
          const HostTensor bits = rand_int(DType::s8, 1, (R * C + 7) / 8, -128, 127, seed++);
          HostTensor stats[2];  // mean, invstd
          const HostTensor u = rand_float(DType::f32, 2, C, seed++);
          for (int k = 0; k < 2; ++k) {
            stats[k] = HostTensor::make1d(DType::f32, C);
            for (int64_t c = 0; c < C; ++c) stats[k].setf(c, k == 1 ? 0.5f + std::fabs(u.getf(k, c)) : u.getf(k, c));
          }
          HostTensor oc[3], gr = HostTensor::make2d(dt, R, C);
          for (HostTensor& t : oc) t = HostTensor::make1d(DType::f32, C);
          hot::TensorView gwc = oc[2].view(), bv = bits.view(), grc = gr.view();
          bv.shape = {bits.cols()}, bv.strides = {1};
          hot::batch_norm_backward_reduce(gy, x, stats[0], stats[1], oc[0], oc[1], &gwc, relu ? &bv : nullptr,
                                          relu ? &grc : nullptr);
          DevTensor dgy(gy), dx(x), db(bits), dgr(HostTensor::make2d(dt, R, C)), dout[3];
          DevTensor ds[2] = {DevTensor(stats[0]), DevTensor(stats[1])};
          for (int k = 0; k < 3; ++k) dout[k] = DevTensor(HostTensor::make1d(DType::f32, C));
          hot::TensorView dgw = dout[2].view(), dbv = db.view(), dgrv = dgr.view();
          dbv.shape = {bits.cols()}, dbv.strides = {1};
          hot::batch_norm_backward_reduce(dgy, dx, ds[0], ds[1], dout[0], dout[1], &dgw, relu ? &dbv : nullptr,
                                          relu ? &dgrv : nullptr, st());
          sync();
          for (int k = 0; k < 3; ++k) EXPECT_TRUE(all_bytes_equal(oc[k], dout[k].to_host())) << k;
          if (relu) EXPECT_TRUE(all_bytes_equal(gr, dgr.to_host()));
        }
}

// BatchNorm's input gradient with G~'s amax on the GPU: the CPU's bytes (g_x, amax); widths with a partial 16-channel
// group and blocks below 16, padded rows (element-wise loads), no weight, and ResNet-50 sizes (more rows than the
// kernel's grid covers in one stride; 100000 x 48: 3 groups a row, so that the stride carries into the next row).
class Cuda_BatchNormBackwardInput : public CudaTest {};
TEST_F(Cuda_BatchNormBackwardInput, BitExactVsCpu) {
  uint64_t seed = 2400;
  for (DType dt : kFloatTypes)
    for (auto [R, C] : std::vector<std::pair<int64_t, int64_t>>{
             {1, 16}, {37, 24}, {3001, 72}, {20, 8}, {100352, 64}, {25088, 256}, {6272, 2048}, {100000, 48}})
      for (int64_t pad : {0, 8})
        for (bool affine : {true, false}) {
          if (R * C > 1000000 && (small_run() || pad != 0 || !affine)) continue;
          SCOPED_TRACE(testing::Message() << dt_name(dt) << " " << R << "x" << C << " pad " << pad << " affine "
                                          << affine);
          const HostTensor gy = rand_float(dt, R, C, seed++, C + pad, 2.0f);
          const HostTensor x = rand_float(dt, R, C, seed++, C + pad, 3.0f);
          HostTensor stats[5];
          for (HostTensor& t : stats) t = HostTensor::make1d(DType::f32, C);
          const HostTensor u = rand_float(DType::f32, 5, C, seed++);
          for (int k = 0; k < 5; ++k)
            for (int64_t c = 0; c < C; ++c) stats[k].setf(c, k == 1 ? 0.5f + std::fabs(u.getf(k, c)) : u.getf(k, c));
          HostTensor gc = out2d(dt, R, C, C + pad), ac = out1d(DType::f32, 1);
          const hot::TensorView w = stats[2].view();
          hot::batch_norm_backward_input(gy, x, stats[0], stats[1], affine ? &w : nullptr, stats[3], stats[4], gc, ac);
          DevTensor dgy(gy), dx(x), dg(out2d(dt, R, C, C + pad)), da(out1d(DType::f32, 1)), ds[5];
          for (int k = 0; k < 5; ++k) ds[k] = DevTensor(stats[k]);
          const hot::TensorView dw = ds[2].view();
          hot::batch_norm_backward_input(dgy, dx, ds[0], ds[1], affine ? &dw : nullptr, ds[3], ds[4], dg, da, st());
          sync();
          EXPECT_TRUE(all_bytes_equal(gc, dg.to_host()));
          EXPECT_TRUE(all_bytes_equal(ac, da.to_host()));
        }
}

// BatchNorm's statistics on the GPU: the CPU's bits (mean, invstd, running statistics); a partial row group, channels
// not a multiple of 8 and padded rows (element-wise loads), two channel slices, a map far from zero, and ResNet-50
// sizes (layer 1 at batch 8 and 32, the last stage at batch 128, and 13 channels over 25,088 rows).
class Cuda_BatchNormStats : public CudaTest {};
TEST_F(Cuda_BatchNormStats, BitExactVsCpu) {
  uint64_t seed = 2600;
  for (DType dt : kFloatTypes)
    for (auto [R, C] : std::vector<std::pair<int64_t, int64_t>>{
             {1, 16}, {37, 13}, {3001, 72}, {2100, 264}, {25088, 64}, {100352, 64}, {6272, 2048}, {25088, 13}})
      for (int64_t pad : {0, 3, 8})
        for (bool running : {false, true}) {
          if (R * C > 1000000 && (small_run() || pad != 0)) continue;
          if (running && R < 2) continue;
          const float offset = pad == 3 ? 600.0f : 0.0f;
          SCOPED_TRACE(testing::Message() << dt_name(dt) << " " << R << "x" << C << " pad " << pad << " running "
                                          << running);
          std::vector<float> v = hot_test::randn(static_cast<size_t>(R * C), seed++, 2.0f);
          for (float& e : v) e += offset;
          const HostTensor x = hot_test::host_from(dt, R, C, v, C + pad);
          const HostTensor u = rand_float(DType::f32, 2, C, seed++);
          HostTensor rm = HostTensor::make1d(DType::f32, C), rv = rm;
          for (int64_t c = 0; c < C; ++c) rm.setf(c, u.getf(0, c)), rv.setf(c, 0.5f + std::fabs(u.getf(1, c)));
          const DevTensor drm(rm), drv(rv);
          HostTensor mc = out1d(DType::f32, C), ic = mc;
          const hot::TensorView rmv = rm.view(), rvv = rv.view(), drmv = drm.view(), drvv = drv.view();
          hot::batch_norm_stats(x, mc, ic, 1e-5f, running ? &rmv : nullptr, running ? &rvv : nullptr, 0.1f);
          DevTensor dx(x), dm(out1d(DType::f32, C)), di(out1d(DType::f32, C));
          hot::batch_norm_stats(dx, dm, di, 1e-5f, running ? &drmv : nullptr, running ? &drvv : nullptr, 0.1f, st());
          sync();
          EXPECT_TRUE(all_bytes_equal(mc, dm.to_host()));
          EXPECT_TRUE(all_bytes_equal(ic, di.to_host()));
          EXPECT_TRUE(all_bytes_equal(rm, drm.to_host()));
          EXPECT_TRUE(all_bytes_equal(rv, drv.to_host()));
        }
}

// BatchNorm's output on the GPU: the CPU's bytes (y poisoned, its padding included); channels not a multiple of 8 and
// padded rows (element-wise), three channel slices (C = 520), with and without weight and bias, in place, and ResNet-50
// sizes (more rows than the launcher's ~2,048 CTAs cover at one row a thread).
class Cuda_BatchNormTransform : public CudaTest {};
TEST_F(Cuda_BatchNormTransform, BitExactVsCpu) {
  uint64_t seed = 2700;
  for (DType dt : kFloatTypes)
    for (auto [R, C] : std::vector<std::pair<int64_t, int64_t>>{
             {1, 16}, {37, 13}, {3001, 72}, {70, 520}, {25088, 64}, {100352, 64}, {6272, 2048}, {25088, 13}})
      for (int64_t pad : {0, 3, 8})
        for (int affine = 0; affine < 4; ++affine) {  // bit 0: weight, bit 1: bias
          if (R * C > 1000000 && (small_run() || pad != 0 || affine == 1 || affine == 2)) continue;
          SCOPED_TRACE(testing::Message() << dt_name(dt) << " " << R << "x" << C << " pad " << pad << " affine "
                                          << affine);
          const HostTensor x = rand_float(dt, R, C, seed++, C + pad, 2.0f);
          HostTensor stats[4];  // mean, invstd, weight, bias
          const HostTensor u = rand_float(DType::f32, 4, C, seed++);
          for (int k = 0; k < 4; ++k) {
            stats[k] = HostTensor::make1d(DType::f32, C);
            for (int64_t c = 0; c < C; ++c) stats[k].setf(c, k == 1 ? 0.25f + std::fabs(u.getf(k, c)) : u.getf(k, c));
          }
          const hot::TensorView w = stats[2].view(), b = stats[3].view();
          HostTensor yc = out2d(dt, R, C, C + pad);
          hot::batch_norm_transform(x, stats[0], stats[1], affine & 1 ? &w : nullptr, affine & 2 ? &b : nullptr, yc);
          DevTensor dx(x), dy(out2d(dt, R, C, C + pad)), ds[4];
          for (int k = 0; k < 4; ++k) ds[k] = DevTensor(stats[k]);
          const hot::TensorView dw = ds[2].view(), db = ds[3].view();
          const hot::TensorView* dwp = affine & 1 ? &dw : nullptr;
          const hot::TensorView* dbp = affine & 2 ? &db : nullptr;
          hot::batch_norm_transform(dx, ds[0], ds[1], dwp, dbp, dy, st());
          sync();
          EXPECT_TRUE(all_bytes_equal(yc, dy.to_host()));
          if (affine != 3) continue;
          hot::batch_norm_transform(dx, ds[0], ds[1], dwp, dbp, dx, st());  // in place
          sync();
          HostTensor xc = x;
          hot::batch_norm_transform(xc, stats[0], stats[1], &w, &b, xc);
          EXPECT_TRUE(all_bytes_equal(xc, dx.to_host()));
        }
}

// Max-pool with window offsets on the GPU: the CPU's bytes (y, offsets, g_x), NCHW and channels-last, with NaN,
// infinities and ties; ResNet's stem pool at a larger size.
class Cuda_MaxPoolOffsets : public CudaTest {};
TEST_F(Cuda_MaxPoolOffsets, BitExactVsCpu) {
  struct P {
    int64_t N, C, H, W;
    int k, s, p, d;
    int64_t Ho, Wo;
  };
  const P cases[] = {{2, 3, 9, 9, 3, 2, 1, 1, 5, 5}, {1, 4, 8, 7, 2, 2, 0, 1, 4, 4}, {2, 5, 7, 6, 3, 1, 1, 2, 5, 4},
                     {4, 64, 112, 112, 3, 2, 1, 1, 56, 56}};
  uint64_t seed = 8800;
  for (DType dt : kFloatTypes)
    for (const P& c : cases)
      for (bool last : {false, true}) {
        SCOPED_TRACE(testing::Message() << dt_name(dt) << " " << c.N << "x" << c.C << "x" << c.H << "x" << c.W
                                        << (last ? " channels-last" : " NCHW"));
        hot::ConvGeometry g;
        g.N = c.N, g.C = c.C, g.H = c.H, g.W = c.W, g.kh = g.kw = c.k, g.sh = g.sw = c.s, g.ph = g.pw = c.p;
        g.dh = g.dw = c.d;
        const auto view4 = [&](hot::TensorView v, int64_t h, int64_t w) {
          v.shape = {c.N, c.C, h, w};
          v.strides = last ? hot::Shape{h * w * c.C, 1, w * c.C, c.C} : hot::Shape{c.C * h * w, h * w, w, 1};
          return v;
        };
        HostTensor x = rand_float(dt, 1, c.N * c.C * c.H * c.W, seed++);
        const int64_t n = x.numel(), m = c.N * c.C * c.Ho * c.Wo;
        for (int64_t e = 5; e < n; e += 11) x.setf(e, x.getf(e - 1));  // ties
        x.setf(n / 3, std::nanf(""));
        x.setf(n / 2, -INFINITY);
        HostTensor yc = out1d(dt, m), oc = out1d(DType::s8, m), gy = rand_float(dt, 1, m, seed++), gc = out1d(dt, n);
        DevTensor dx(x), dy(yc), doff(oc), dgy(gy), dgx(gc);
        hot::max_pool2d_offsets(view4(x.view(), c.H, c.W), g, view4(yc.view(), c.Ho, c.Wo), view4(oc.view(), c.Ho, c.Wo));
        hot::max_pool2d_offsets(view4(dx.view(), c.H, c.W), g, view4(dy.view(), c.Ho, c.Wo),
                                view4(doff.view(), c.Ho, c.Wo), st());
        hot::max_pool2d_offsets_backward(view4(gy.view(), c.Ho, c.Wo), view4(oc.view(), c.Ho, c.Wo), g,
                                         view4(gc.view(), c.H, c.W));
        hot::max_pool2d_offsets_backward(view4(dgy.view(), c.Ho, c.Wo), view4(doff.view(), c.Ho, c.Wo), g,
                                         view4(dgx.view(), c.H, c.W), st());
        sync();
        EXPECT_TRUE(all_bytes_equal(yc, dy.to_host())) << "y";
        EXPECT_TRUE(all_bytes_equal(oc, doff.to_host())) << "off";
        EXPECT_TRUE(all_bytes_equal(gc, dgx.to_host())) << "g_x";
      }
}

class Cuda_Int4 : public CudaTest {};
TEST_F(Cuda_Int4, PackUnpackBitExactVsCpu) {
  uint64_t seed = 400;
  for (auto [R, C] : std::vector<std::pair<int64_t, int64_t>>{{1, 2}, {7, 34}, {129, 1000}}) {
    HostTensor q = rand_int(DType::s8, R, C, -8, 7, seed++, C + 4);
    HostTensor pc = out2d(DType::s4, R, C, C + 6), pg = pc;
    DevTensor dq(q), dp(pg);
    hot::pack_int4(q, pc);
    hot::pack_int4(dq, dp, st());
    sync();
    const HostTensor ph = dp.to_host();
    EXPECT_TRUE(all_bytes_equal(pc, ph));
    HostTensor uc = out2d(DType::s8, R, C, C + 2), ug = uc;
    DevTensor du(ug), dp2(ph);
    hot::unpack_int4(pc, uc);
    hot::unpack_int4(dp2, du, st());
    sync();
    const HostTensor uh = du.to_host();
    EXPECT_TRUE(all_bytes_equal(uc, uh));
    EXPECT_TRUE(same_bits(q, uh));  // round trip
  }
}

// ---- integer GEMMs ---------------------------------------------------------------------------------

// int64 reference of selected entries of A B^T (for shapes too large for the CPU backend in a test).
::testing::AssertionResult check_sampled(const HostTensor& a, const HostTensor& b, const HostTensor& c, int samples,
                                         uint64_t seed) {
  std::mt19937_64 g(seed);
  const int64_t M = a.rows(), N = b.rows(), K = a.cols();
  for (int s = 0; s < samples; ++s) {
    const int64_t m = (s == 0) ? M - 1 : static_cast<int64_t>(g() % M);
    const int64_t n = (s == 0) ? N - 1 : static_cast<int64_t>(g() % N);
    int64_t acc = 0;
    for (int64_t k = 0; k < K; ++k) acc += a.geti(m, k) * b.geti(n, k);
    if (acc != c.geti(m, n))
      return ::testing::AssertionFailure() << "C[" << m << "," << n << "] = " << c.geti(m, n) << ", expected " << acc;
  }
  return ::testing::AssertionSuccess();
}

class Cuda_GemmS8 : public CudaTest {};
TEST_F(Cuda_GemmS8, BitExactVsCpu) {
  uint64_t seed = 500;
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> shapes = {
      {1, 1, 1}, {1, 1, 16}, {17, 33, 48}, {129, 257, 512}, {300, 77, 1000}, {64, 128, 32}, {333, 200, 96},
      {1000, 40, 1024}, {7, 300, 2048},
      // Few output tiles and a long K: the sm90 path's split-K route (128 and 64 slices), and a K / 16 that is prime
      // (no equal slices: stream-K); N % 4 != 0 (a 7 x 7 stem's g_w): the route's transposed product (66 slices),
      // and the padded route where K / 16 is prime
      {64, 256, 65536}, {200, 72, 40960}, {64, 256, 16 * 4099}, {64, 147, 16 * 2112}, {64, 147, 16 * 4099},
      // K not a multiple of 16 takes the generic kernel on every GPU: M in the millions (more 64-row tiles than a
      // grid's y dimension holds)
      {4200000, 5, 8}};
  for (auto [M, N, K] : shapes) {
    if (M > 1000000 && small_run()) continue;
    SCOPED_TRACE(testing::Message() << "M " << M << " N " << N << " K " << K);
    HostTensor a = rand_int(DType::s8, M, K, -127, 127, seed++);
    HostTensor b = rand_int(DType::s8, N, K, -127, 127, seed++);
    HostTensor cc = out2d(DType::s32, M, N), cg = cc;
    DevTensor da(a), db(b), dc(cg);
    hot::gemm_s8s8s32(a, b, cc);
    hot::gemm_s8s8s32(da, db, dc, st());
    sync();
    EXPECT_TRUE(all_bytes_equal(cc, dc.to_host()));
  }
}

TEST_F(Cuda_GemmS8, ExtremeValuesAndLargeShapes) {
  // All -127 / 127: the largest int32 sums the contraction allows.
  for (auto [M, N, K] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{256, 256, 8192}, {4096, 2304, 4096}}) {
    if (M > 256 && small_run()) continue;
    HostTensor a = rand_int(DType::s8, M, K, -127, 127, 11);
    HostTensor b = rand_int(DType::s8, N, K, -127, 127, 12);
    if (M == 256)
      for (int64_t i = 0; i < M; ++i)
        for (int64_t k = 0; k < K; ++k) a.seti(i, k, (i % 2) ? 127 : -127), b.seti(i % N, k, -127);
    HostTensor cg = out2d(DType::s32, M, N);
    DevTensor da(a), db(b), dc(cg);
    hot::gemm_s8s8s32(da, db, dc, st());
    sync();
    EXPECT_TRUE(check_sampled(a, b, dc.to_host(), 3000, M + N));
  }
}

class Cuda_GemmS4 : public CudaTest {};
TEST_F(Cuda_GemmS4, BitExactVsCpu) {
  uint64_t seed = 600;
  for (auto [M, N, K] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {1, 1, 2}, {17, 33, 64}, {129, 257, 512}, {300, 77, 1000}, {64, 128, 30}}) {
    SCOPED_TRACE(testing::Message() << "M " << M << " N " << N << " K " << K);
    HostTensor a = rand_int(DType::s4, M, K, -8, 7, seed++);
    HostTensor b = rand_int(DType::s4, N, K, -8, 7, seed++);
    HostTensor cc = out2d(DType::s32, M, N), cg = cc;
    DevTensor da(a), db(b), dc(cg);
    hot::gemm_s4s4s32(a, b, cc);
    hot::gemm_s4s4s32(da, db, dc, st());
    sync();
    EXPECT_TRUE(all_bytes_equal(cc, dc.to_host()));
  }
}

class Cuda_GemmDequant : public CudaTest {
 protected:
  // One M x N x K dequantising GEMM of random codes in [-qmax, qmax] (bits 4 or 8), per-row or per-tensor sa, into an
  // output of row stride ldd, on the CPU and on the GPU: the same bytes. Draws three seeds.
  void expect_bit_exact(DType dt, int64_t M, int64_t N, int64_t K, bool per_row, int bits, int64_t ldd,
                        uint64_t& seed) {
    SCOPED_TRACE(testing::Message() << dt_name(dt) << " M " << M << " N " << N << " K " << K << " per_row " << per_row
                                    << " bits " << bits << " ldd " << ldd);
    const int qmax = bits == 4 ? 7 : 127;
    HostTensor a = rand_int(DType::s8, M, K, -qmax, qmax, seed++);
    HostTensor b = rand_int(DType::s8, N, K, -qmax, qmax, seed++);
    HostTensor sa = HostTensor::make1d(DType::f32, per_row ? M : 1);
    std::vector<float> r = hot_test::randn(static_cast<size_t>(sa.cols()), seed++);
    for (int64_t i = 0; i < sa.cols(); ++i) sa.setf(i, 1e-3f * (1.0f + std::fabs(r[i])));
    HostTensor sb = HostTensor::make1d(DType::f32, 1);
    sb.setf(0, 0.0123f);
    HostTensor oc = out2d(dt, M, N, ldd), og = oc;
    DevTensor da(a), db(b), dsa(sa), dsb(sb), dout(og);
    hot::cpu::gemm_s8_dequant(a, b, sa, sb, 1.0f / 16, bits, oc, {});
    hot::cuda::gemm_s8_dequant(da, db, dsa, dsb, 1.0f / 16, bits, dout, st());
    sync();
    EXPECT_TRUE(all_bytes_equal(oc, dout.to_host()));
  }
};

TEST_F(Cuda_GemmDequant, BitExactVsCpu) {
  uint64_t seed = 700;
  for (DType dt : kFloatTypes)
    for (auto [M, N, K] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
             {1, 1, 16}, {37, 77, 48}, {200, 768, 2304}, {513, 40, 1008}, {100, 33, 30}, {2048, 512, 512}})
      for (bool per_row : {false, true})
        for (int bits : {4, 8}) expect_bit_exact(dt, M, N, K, per_row, bits, N, seed);
}

// The ping-pong configurations of the sm90 path (gemm_sm90.cuh use_pingpong: K <= 1024 over at least two waves of
// 128 x 256 tiles; 97 x 5 = 485 tiles is two waves on any GPU of up to 242 SMs; N <= 128: the 64 x 128 tiles), with
// M, N and K tails.
TEST_F(Cuda_GemmDequant, ShortKManyTilesBitExactVsCpu) {
  uint64_t seed = 740;
  for (DType dt : kFloatTypes)
    for (auto [M, N, K] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
             {12304, 1032, 272}, {16384, 768, 1024}, {70001, 64, 256}, {65573, 120, 528}})
      for (bool per_row : {false, true}) expect_bit_exact(dt, M, N, K, per_row, 8, N, seed);
}

// Output tiles that fill more than half of one wave, with the long K for which gemm_sm90.cuh's force_stream_k picks
// stream-K on GPUs of 103 to 144 SMs (72 tiles of 128 x 256, 160 k-tiles; M and N tails), whose K shares of one tile
// are summed in int32 before the one dequantisation; and one of 72 short tiles that stays data-parallel.
TEST_F(Cuda_GemmDequant, PartWaveBitExactVsCpu) {
  uint64_t seed = 760;
  expect_bit_exact(DType::bf16, 1052, 1848, 20480, false, 8, 1848, seed);
  expect_bit_exact(DType::f32, 1052, 1848, 20480, true, 8, 1848, seed);
  expect_bit_exact(DType::bf16, 3072, 768, 3136, true, 8, 768, seed);
}

// The split-K route of the sm90 path (few output tiles, a long K: 48 and 32 equal slices summed by one pass into the
// dequantised output; K / 16 prime: stream-K; N = 147: the transposed product, 66 slices), against the CPU's one
// dequantisation of the whole sum. The output's row stride N + 3 is one its TMA store could not take.
TEST_F(Cuda_GemmDequant, SplitKBitExactVsCpu) {
  uint64_t seed = 750;
  for (DType dt : kFloatTypes)
    for (auto [M, N, K] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
             {200, 256, 24576}, {300, 96, 16384}, {64, 256, 16 * 4099}, {64, 147, 16 * 2112}})
      for (bool per_row : {false, true}) expect_bit_exact(dt, M, N, K, per_row, 8, N + 3, seed);
}

// A K past kMaxInt32K (SPEC §4): few output tiles (the split-K route with slices of at most kMaxInt32K, summed in
// int64), many tiles (two equal slices: the batch of the same route), and a K / 16 with no fitting divisor or K not a
// multiple of 16 (gemm.cu's K pieces, each its own s32 GEMM, summed by the same pass). Rows of +127 codes make the
// sum overflow int32. Against the CPU's int64 sum, bit for bit.
TEST_F(Cuda_GemmDequant, LongKBitExactVsCpu) {
  uint64_t seed = 770;
  const int64_t kmax = hot::kMaxInt32K;
  for (auto [M, N, K] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {64, 256, 200000}, {1024, 768, kmax + 16}, {64, 48, 16 * 16661}, {40, 24, kmax + 37}})
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(testing::Message() << dt_name(dt) << " M " << M << " N " << N << " K " << K);
      HostTensor a = rand_int(DType::s8, M, K, -127, 127, seed++);
      HostTensor b = rand_int(DType::s8, N, K, -127, 127, seed++);
      for (int64_t k = 0; k < K; ++k) {
        a.seti(0, k, 127);
        b.seti(0, k, 127);
      }
      HostTensor sa = HostTensor::make1d(DType::f32, 1), sb = HostTensor::make1d(DType::f32, 1);
      sa.setf(0, 1e-4f);
      sb.setf(0, 0.0123f);
      HostTensor oc = out2d(dt, M, N), og = oc;
      DevTensor da(a), db(b), dsa(sa), dsb(sb), dout(og);
      hot::cpu::gemm_s8_dequant(a, b, sa, sb, 1.0f / 16, 8, oc, {});
      hot::cuda::gemm_s8_dequant(da, db, dsa, dsb, 1.0f / 16, 8, dout, st());
      sync();
      EXPECT_TRUE(all_bytes_equal(oc, dout.to_host()));
    }
}

// ---- layer operations ----------------------------------------------------------------------------------

class Cuda_CompressActivation : public CudaTest {};
TEST_F(Cuda_CompressActivation, BitExactVsCpu) {
  uint64_t seed = 800;
  for (DType dt : kFloatTypes)
    for (int64_t L : {1, 31, 1000, 20011})
      for (int64_t I : {8, 77, 130})
        for (int rank : {1, 3, 8, 16}) {
          if (L == 20011 && (rank == 3 || I == 8 || small_run())) continue;
          SCOPED_TRACE(testing::Message() << dt_name(dt) << " L " << L << " I " << I << " rank " << rank);
          HostTensor x = rand_float(dt, L, I, seed++, I + (L % 3));
          const int64_t Kp = hot::padded_k(hot::hla_rows(L, rank));
          HostTensor qc = out2d(DType::s8, I, Kp), qg = qc, sc = out1d(DType::f32, 1), sg = sc;
          DevTensor dx(x), dq(qg), ds(sg);
          hot::cpu::compress_activation(x, qc, sc, rank, {});
          hot::cuda::compress_activation(dx, dq, ds, rank, st());
          sync();
          EXPECT_TRUE(all_bytes_equal(qc, dq.to_host()));
          EXPECT_TRUE(all_bytes_equal(sc, ds.to_host()));
        }
}

// activation_codes (the ABC kernels with the rows as they are): the CPU's bytes, fp32 and 16-bit inputs, narrow
// inputs (packed row tiles), odd widths and rows (the generic per-element path), a NaN.
TEST_F(Cuda_CompressActivation, CodesBitExactVsCpu) {
  uint64_t seed = 850;
  for (DType dt : kFloatTypes)
    for (int64_t L : {1, 31, 1000, 20011})
      for (int64_t I : {8, 64, 77, 264}) {
        if (L == 20011 && small_run()) continue;
        SCOPED_TRACE(testing::Message() << dt_name(dt) << " L " << L << " I " << I);
        HostTensor x = rand_float(dt, L, I, seed++, I + (L % 3));
        if (L == 1000 && I == 77) x.setf(500, 40, std::nanf(""));
        const int64_t Kp = hot::padded_k(L);
        HostTensor qc = out2d(DType::s8, I, Kp), qg = qc, sc = out1d(DType::f32, 1), sg = sc;
        DevTensor dx(x), dq(qg), ds(sg);
        hot::cpu::activation_codes(x, qc, sc, nullptr, {});
        hot::cuda::activation_codes(dx, dq, ds, nullptr, st());
        sync();
        EXPECT_TRUE(all_bytes_equal(qc, dq.to_host()));
        EXPECT_TRUE(all_bytes_equal(sc, ds.to_host()));
      }
}

// compress_activation_cast: the copy (a NaN as any NaN) and the buffer against the CPU backend's cast and buffer; rows
// the GPU reads in one pass (float32 rows of 16-byte multiples, the copy's of 8 elements) and rows it casts first.
TEST_F(Cuda_CompressActivation, CastBitExactVsCpu) {
  uint64_t seed = 900;
  for (DType dt : {DType::bf16, DType::f16})
    for (int64_t L : {1, 130, 20011})
      for (int64_t I : {64, 77, 768})
        for (int64_t pad : {0, 4, 1}) {
          if (L == 20011 && (pad != 0 || small_run())) continue;
          SCOPED_TRACE(testing::Message() << dt_name(dt) << " L " << L << " I " << I << " pad " << pad);
          HostTensor x = rand_float(DType::f32, L, I, seed++, I + pad, 3.0f);
          if (pad == 4) {
            x.setf(L / 2, I / 3, std::nanf(""));
            x.setf(L - 1, I - 1, INFINITY);
            x.setf(0, 0, 1.0e5f);
          }
          const int64_t Kp = hot::padded_k(hot::hla_rows(L, 16));
          HostTensor cc = out2d(dt, L, I, I + 2 * pad), cg = cc;
          HostTensor qc = out2d(DType::s8, I, Kp), qg = qc, sc = out1d(DType::f32, 1), sg = sc;
          DevTensor dx(x), dc(cg), dq(qg), ds(sg);
          hot::cpu::compress_activation_cast(x, cc, qc, sc, 16, {});
          hot::cuda::compress_activation_cast(dx, dc, dq, ds, 16, st());
          sync();
          EXPECT_TRUE(same_floats(cc, dc.to_host()));
          EXPECT_TRUE(all_bytes_equal(qc, dq.to_host()));
          EXPECT_TRUE(all_bytes_equal(sc, ds.to_host()));
        }
}

class Cuda_QuantizeWeight : public CudaTest {};
TEST_F(Cuda_QuantizeWeight, BitExactVsCpu) {
  uint64_t seed = 900;
  for (DType dt : kFloatTypes)
    for (auto [O, I] : std::vector<std::pair<int64_t, int64_t>>{{16, 5}, {48, 64}, {100, 33}, {7, 9}, {2304, 768}})
      for (int bits : {4, 8}) {
        const int b = hot::hq_block_size(O);
        SCOPED_TRACE(testing::Message() << dt_name(dt) << " O " << O << " I " << I << " bits " << bits << " b " << b);
        HostTensor w = rand_float(dt, O, I, seed++, I + 1, 0.05f);
        const int64_t Op = hot::padded_k(O);
        HostTensor qc = out2d(DType::s8, I, Op), qg = qc, sc = out1d(DType::f32, 1), sg = sc;
        DevTensor dw(w), dq(qg), ds(sg);
        hot::cpu::quantize_weight(w, qc, sc, bits, b, {});
        hot::cuda::quantize_weight(dw, dq, ds, bits, b, st());
        sync();
        EXPECT_TRUE(all_bytes_equal(qc, dq.to_host()));
        EXPECT_TRUE(all_bytes_equal(sc, ds.to_host()));
      }
}


class Cuda_QuantizeGradOutput : public CudaTest {
 protected:
  // One g_y-pass case on the GPU against the CPU backend: integer codes and scales byte for byte, g_b within the
  // fp32 summation bound.
  // On `device` with `stream` (default: device 0 and the fixture's stream). qgt: G~'s codes transposed as well (q_g_t,
  // the g_x path alone).
  void check_qgo_case(DType dt, const QgoCase& c, uint64_t seed, int device = 0, cudaStream_t stream = nullptr,
                      bool qgt = false) {
    cudaStream_t strm = stream != nullptr ? stream : stream_;
    SCOPED_TRACE(testing::Message() << dt_name(dt) << " L " << c.L << " O " << c.O << " bits " << c.bits << " "
                                    << hot::scale_mode_name(c.sm) << " " << hot::rounding_name(c.rd) << " gx " << c.gx
                                    << " gw " << c.gw << " bias " << c.bias << " rank " << c.rank);
    HostTensor gy = rand_float(dt, c.L, c.O, seed, c.O + (c.L % 2));
    const hot::GradOutputPlan plan = qgo_plan(c, seed);
    const int64_t Op = hot::padded_k(c.O), Kp = hot::padded_k(hot::hla_rows(c.L, c.rank));
    HostTensor qg = out2d(DType::s8, c.L, Op), sg = out1d(DType::f32, c.sm == ScaleMode::tensor ? 1 : c.L);
    HostTensor qh = out2d(DType::s8, c.O, Kp), sh = out1d(DType::f32, 1), gb = out1d(DType::f32, c.O);
    HostTensor qt = out2d(DType::s8, c.O, hot::padded_k(c.L));
    DevTensor dqg(qg, device), dsg(sg, device), dqh(qh, device), dsh(sh, device), dgb(gb, device), dqt(qt, device);
    hot::GradOutputQuant oc, og;
    if (c.gx) oc.q_g = qg, oc.s_g = sg, og.q_g = dqg, og.s_g = dsg;
    if (qgt) oc.q_g_t = qt, og.q_g_t = dqt;
    if (c.gw) oc.q_gh_t = qh, oc.s_gh = sh, og.q_gh_t = dqh, og.s_gh = dsh;
    if (c.bias) oc.g_b = gb, og.g_b = dgb;
    DevTensor dgy(gy, device);
    hot::cpu::quantize_grad_output(gy, plan, oc, {});
    hot::cuda::quantize_grad_output(dgy, plan, og, hot::Stream{strm});
    ASSERT_EQ(cudaStreamSynchronize(strm), cudaSuccess);
    if (c.gx) {
      EXPECT_TRUE(all_bytes_equal(qg, dqg.to_host())) << "q_g";
      EXPECT_TRUE(all_bytes_equal(sg, dsg.to_host())) << "s_g";
    }
    if (c.gw) {
      EXPECT_TRUE(all_bytes_equal(qh, dqh.to_host())) << "q_gh_t";
      EXPECT_TRUE(all_bytes_equal(sh, dsh.to_host())) << "s_gh";
    }
    if (qgt) EXPECT_TRUE(all_bytes_equal(qt, dqt.to_host())) << "q_g_t";
    if (c.bias) {
      // g_b is a float sum: different (fixed) association orders, so compare against float64 with
      // the fp32 summation bound n * u * sum|g|.
      const std::vector<float> g = gy.to_f32();
      const HostTensor got = dgb.to_host();
      for (int64_t o = 0; o < c.O; ++o) {
        double s = 0, sa = 0;
        for (int64_t l = 0; l < c.L; ++l) s += g[l * c.O + o], sa += std::fabs(g[l * c.O + o]);
        const double tol = 2.0 * c.L * std::ldexp(1.0, -24) * sa + 1e-30;
        ASSERT_NEAR(got.getf(o), s, tol) << "g_b[" << o << "]";
      }
    }
  }
};
TEST_F(Cuda_QuantizeGradOutput, BitExactVsCpu) {
  std::vector<QgoCase> cases;
  for (int64_t L : {1, 17, 513, 20003})
    for (int64_t O : {16, 24, 30, 7, 129, 2304}) {
      if (L == 20003 && (O == 2304 || small_run())) continue;
      cases.push_back({L, O, 4, ScaleMode::tensor, Rounding::stochastic, true, true, true, 8});
      cases.push_back({L, O, 8, ScaleMode::token, Rounding::stochastic, true, true, false, 16});
      cases.push_back({L, O, 4, ScaleMode::tensor, Rounding::stochastic, true, true, false, 5});
      cases.push_back({L, O, 8, ScaleMode::token, Rounding::stochastic, false, true, false, 1});
      if (L == 513) {
        cases.push_back({L, O, 4, ScaleMode::token, Rounding::nearest, true, false, true, 3});
        cases.push_back({L, O, 8, ScaleMode::tensor, Rounding::nearest, false, true, false, 1});
        cases.push_back({L, O, 4, ScaleMode::tensor, Rounding::stochastic, false, false, true, 8});
      }
    }
  uint64_t seed = 1000;
  for (DType dt : kFloatTypes)
    for (const QgoCase& c : cases) {
      check_qgo_case(dt, c, seed);
      seed += 2;
    }
}

// G~'s codes transposed as well (q_g_t, the g_x path alone, 8 bits per tensor: g_w from G~'s codes): fp32 tiles and
// 16-bit ones, packed narrow ones (O <= 128), partial last row tiles, a million rows.
TEST_F(Cuda_QuantizeGradOutput, TransposedCodesBitExactVsCpu) {
  uint64_t seed = 2500;
  for (DType dt : kFloatTypes)
    for (int64_t L : {1, 17, 513, 20003})
      for (int64_t O : {16, 24, 30, 7, 64, 72, 129, 2304}) {
        if (L == 20003 && (O == 2304 || small_run())) continue;
        check_qgo_case(dt, {L, O, 8, ScaleMode::tensor, Rounding::stochastic, true, false, O % 3 == 0, 16}, seed, 0,
                       nullptr, true);
        seed += 2;
      }
  if (!small_run())
    check_qgo_case(DType::bf16, {1000000 + 7, 64, 8, ScaleMode::tensor, Rounding::stochastic, true, false, false, 16},
                   seed, 0, nullptr, true);
}

// Millions of rows (a convolution's L = batch x H x W): more tiles than a grid's y dimension holds (65535 tiles of
// 64 rows), the CPU backend's bytes all the same.
TEST_F(Cuda_QuantizeGradOutput, MillionsOfRows) {
  if (small_run()) GTEST_SKIP() << "large shapes are skipped under HOT_CUDA_TEST_SMALL";
  uint64_t seed = 1900;
  // bf16 (16-bit tiles) and fp32 (fp32 tiles)
  for (DType dt : {DType::bf16, DType::f32}) {
    check_qgo_case(dt, {4194304 + 100, 16, 4, ScaleMode::tensor, Rounding::stochastic, true, true, true, 8}, seed);
    seed += 2;
  }
}

// One process, every visible GPU, device 0 again last: each gets the CPU backend's bytes whichever device ran first
// (the kernels' shared-memory attribute is per device).
TEST_F(Cuda_QuantizeGradOutput, EveryDeviceOfOneProcess) {
  int n = 0;
  ASSERT_EQ(cudaGetDeviceCount(&n), cudaSuccess);
  if (n < 2) GTEST_SKIP() << "needs 2 CUDA devices, have " << n;
  uint64_t seed = 1700;
  std::vector<int> order;
  for (int d = 0; d < n; ++d) order.push_back(d);
  order.push_back(0);
  for (int d : order) {
    SCOPED_TRACE(testing::Message() << "device " << d);
    ASSERT_EQ(cudaSetDevice(d), cudaSuccess);
    cudaStream_t s = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    for (DType dt : {DType::bf16, DType::f32}) {
      check_qgo_case(dt, {513, 2304, 4, ScaleMode::tensor, Rounding::stochastic, true, true, true, 8}, seed, d, s);
      seed += 2;
    }
    cudaStreamDestroy(s);
  }
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

// Ranks 8 and 16 run kernels compiled for that rank (qgo_kernels.cuh, is_fixed_rank); the run-time-rank kernels
// must give the same bytes at those ranks too (the benchmark times both).
TEST_F(Cuda_QuantizeGradOutput, RunTimeRankKernelsAtFixedRanks) {
  const bool prev = hot::cuda::set_qgo_fixed_rank(false);
  uint64_t seed = 1500;
  for (DType dt : kFloatTypes)
    for (int rank : {8, 16})
      for (auto [L, O] : std::vector<std::pair<int64_t, int64_t>>{{17, 24}, {513, 30}, {513, 2304}}) {
        check_qgo_case(dt, {L, O, 4, ScaleMode::tensor, Rounding::stochastic, true, true, true, rank}, seed);
        seed += 2;
      }
  hot::cuda::set_qgo_fixed_rank(prev);
}

// ---- bias and exact matmul --------------------------------------------------------------------------------

class Cuda_BiasGrad : public CudaTest {};
TEST_F(Cuda_BiasGrad, MatchesFloat64) {
  uint64_t seed = 1100;
  for (DType dt : kFloatTypes)
    // 8.4 M rows: more 128-row chunks than a grid's y dimension holds
    for (auto [L, O] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {333, 17}, {25216, 768}, {8400000, 3}}) {
      if (L > 20000 && small_run()) continue;
      HostTensor gy = rand_float(dt, L, O, seed++);
      for (DType ot : {DType::f32, dt}) {
        HostTensor og = out1d(ot, O);
        DevTensor dgy(gy), dout(og);
        hot::cuda::bias_grad(dgy, dout, st());
        sync();
        const HostTensor got = dout.to_host();
        const std::vector<float> g = gy.to_f32();
        for (int64_t o = 0; o < O; ++o) {
          double s = 0, sa = 0;
          for (int64_t l = 0; l < L; ++l) s += g[l * O + o], sa += std::fabs(g[l * O + o]);
          const double tol = 2.0 * L * std::ldexp(1.0, -24) * sa + hot_test::unit_roundoff(ot) * std::fabs(s) + 1e-30;
          ASSERT_NEAR(got.getf(o), s, tol) << dt_name(dt) << " L " << L << " O " << O << " col " << o;
        }
      }
    }
}

class Cuda_MatmulExact : public CudaTest {};
TEST_F(Cuda_MatmulExact, MatchesFloat64) {
  uint64_t seed = 1200;
  for (DType dt : kFloatTypes)
    for (auto [M, K, N] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{1, 1, 1}, {37, 65, 19}, {300, 512, 129}})
      for (bool ta : {false, true})
        for (bool tb : {false, true})
          for (DType ot : {DType::f32, dt}) {
            HostTensor a = ta ? rand_float(dt, K, M, seed++) : rand_float(dt, M, K, seed++);
            HostTensor b = tb ? rand_float(dt, N, K, seed++) : rand_float(dt, K, N, seed++);
            HostTensor og = out2d(ot, M, N, N + 3);
            DevTensor da(a), db(b), dout(og);
            hot::cuda::matmul_exact(da, ta, db, tb, dout, st());
            sync();
            const std::vector<double> ref =
                hot_test::matmul64(hot_test::to64(a.to_f32()), M, K, ta, hot_test::to64(b.to_f32()), N, tb);
            const std::vector<double> refabs = hot_test::matmul64(hot_test::abs64(hot_test::to64(a.to_f32())), M, K,
                                                                  ta, hot_test::abs64(hot_test::to64(b.to_f32())), N, tb);
            const HostTensor got = dout.to_host();
            for (int64_t i = 0; i < M * N; ++i) {
              const double tol = 2.0 * K * std::ldexp(1.0, -24) * refabs[i] + hot_test::unit_roundoff(ot) * std::fabs(ref[i]) + 1e-30;
              ASSERT_NEAR(got.getf(i / N, i % N), ref[i], tol)
                  << dt_name(dt) << "->" << dt_name(ot) << " " << M << "x" << K << "x" << N << " ta " << ta << " tb " << tb;
            }
          }
}

// ---- end to end: public backward_linear on both devices ----------------------------------------------

class Cuda_BackwardLinear : public CudaTest {};
TEST_F(Cuda_BackwardLinear, BitExactVsCpu) {
  struct Shape3 {
    int64_t L, O, I;
  };
  uint64_t seed = 1300;
  for (DType dt : kFloatTypes)
    for (Shape3 s : {Shape3{1, 16, 8}, Shape3{197, 48, 40}, Shape3{515, 30, 77}, Shape3{20001, 64, 48}})
      for (int bits : {4, 8})
        for (ScaleMode sm : {ScaleMode::tensor, ScaleMode::token}) {
          if (s.L > 20000 && small_run()) continue;
          SCOPED_TRACE(testing::Message() << dt_name(dt) << " L " << s.L << " O " << s.O << " I " << s.I << " bits "
                                          << bits << " " << hot::scale_mode_name(sm));
          hot::Config cfg;
          cfg.gx_bits = bits;
          cfg.gx_scale = sm;
          HostTensor x = rand_float(dt, s.L, s.I, seed++);
          HostTensor w = rand_float(dt, s.O, s.I, seed++, -1, 0.05f);
          HostTensor gy = rand_float(dt, s.L, s.O, seed++);
          DevTensor dx(x), dw(w), dgy(gy);
          hot::SavedActivation sc = hot::compress_activation(x, cfg.rank);
          hot::SavedActivation sg = hot::compress_activation(dx, cfg.rank, st());
          HostTensor gxc = out2d(dt, s.L, s.I), gwc = out2d(dt, s.O, s.I), gbc = out1d(DType::f32, s.O);
          HostTensor gxg = gxc, gwg = gwc, gbg = gbc;
          DevTensor dgx(gxg), dgw(gwg), dgb(gbg);
          hot::backward_linear(gy, w, &sc, cfg, 42, {gxc, gwc, gbc});
          hot::backward_linear(dgy, dw, &sg, cfg, 42, {dgx, dgw, dgb}, st());
          sync();
          EXPECT_TRUE(all_bytes_equal(gxc, dgx.to_host())) << "grad_input";
          EXPECT_TRUE(all_bytes_equal(gwc, dgw.to_host())) << "grad_weight";
        }
}

// A seed in device memory (hot::Seed with a tensor: what a CUDA graph of a training step uses), read by pass 2's
// DeviceSeed kernels: the CPU's bytes for the integer seed it sums to (16-bit and fp32 g_y, O with and without
// 8-element RNG groups), and other bytes once the stored seed changes between two calls.
TEST_F(Cuda_BackwardLinear, DeviceSeedBitExactVsCpu) {
  struct Shape3 {
    int64_t L, O, I;
  };
  uint64_t seed = 1700;
  for (DType dt : kFloatTypes)
    for (Shape3 s : {Shape3{197, 48, 40}, Shape3{515, 30, 77}, Shape3{4099, 264, 96}}) {
      SCOPED_TRACE(testing::Message() << dt_name(dt) << " L " << s.L << " O " << s.O << " I " << s.I);
      hot::Config cfg;
      HostTensor x = rand_float(dt, s.L, s.I, seed++);
      HostTensor w = rand_float(dt, s.O, s.I, seed++, -1, 0.05f);
      HostTensor gy = rand_float(dt, s.L, s.O, seed++);
      DevTensor dx(x), dw(w), dgy(gy);
      hot::SavedActivation sc = hot::compress_activation(x, cfg.rank);
      hot::SavedActivation sg = hot::compress_activation(dx, cfg.rank, st());
      const hot::Tensor stored = hot::Tensor::empty(DType::s64, {}, dgy.view().device, st());
      const uint64_t value = 0x5eed0000ull + seed, offset = 0xfffffffffff00000ull;  // the sum wraps around 2^64
      for (int call = 0; call < 2; ++call) {
        const uint64_t full = value + static_cast<uint64_t>(call) * 7919u;
        const uint64_t in_memory = full - offset;
        ASSERT_EQ(cudaMemcpyAsync(stored.view().data, &in_memory, 8, cudaMemcpyHostToDevice,
                                  static_cast<cudaStream_t>(st().handle)),
                  cudaSuccess);
        HostTensor gxc = out2d(dt, s.L, s.I), gwc = out2d(dt, s.O, s.I), gbc = out1d(DType::f32, s.O);
        HostTensor gxg = gxc, gwg = gwc, gbg = gbc;
        DevTensor dgx(gxg), dgw(gwg), dgb(gbg);
        hot::backward_linear(gy, w, &sc, cfg, full, {gxc, gwc, gbc});
        hot::backward_linear(dgy, dw, &sg, cfg, hot::Seed(offset, stored.view()), {dgx, dgw, dgb}, st());
        sync();
        EXPECT_TRUE(all_bytes_equal(gxc, dgx.to_host())) << "grad_input, call " << call;
        EXPECT_TRUE(all_bytes_equal(gwc, dgw.to_host())) << "grad_weight, call " << call;
      }
    }
}

// backward_conv2d: g_x by the transposed convolution of G~'s codes (CUTLASS's int8 conv on sm_80+, the element-wise
// kernel elsewhere) or by columns and col2im (strided, patch order), long calls (a g_w contraction past kMaxInt32K)
// included: all equal to the CPU's bytes.
class Cuda_BackwardConv2d : public CudaTest {};
TEST_F(Cuda_BackwardConv2d, BitExactVsCpu) {
  uint64_t seed = 9500;
  std::vector<hot::ConvGeometry> geoms = col2im_geometries();
  if (!small_run()) {
    hot::ConvGeometry g;  // ResNet-50 layer1's 3x3 at batch 4; then 3 images of 224 x 224: a g_w contraction past int32
    g.N = 4, g.C = 64, g.H = 56, g.W = 56, g.kh = 3, g.kw = 3, g.ph = 1, g.pw = 1;
    geoms.push_back(g);
    g.N = 3, g.C = 8, g.H = 224, g.W = 224;
    geoms.push_back(g);
  }
  for (const hot::ConvGeometry& g : geoms)
    for (DType dt : kFloatTypes)
      for (int64_t O : {16, 40})
      for (bool codes : {false, true}) {  // g_w from the ABC buffer of the columns, or from the codes (im2col_t)
        const int64_t L = g.N * g.out_h() * g.out_w(), CKK = g.C * g.kh * g.kw, P = g.N * g.H * g.W;
        hot::Config cfg;
        SCOPED_TRACE(testing::Message() << dt_name(dt) << " N " << g.N << " C " << g.C << " H " << g.H << " k "
                                        << g.kh << " stride " << g.sh << " O " << O << " codes " << codes);
        HostTensor map = rand_int(DType::s8, P, g.C, -127, 127, seed++);
        HostTensor w = rand_float(dt, O, CKK, seed++, -1, 0.05f);
        HostTensor gy = rand_float(dt, L, O, seed++);
        DevTensor dmap(map), dw(w), dgy(gy);
        const int64_t Kp = hot::padded_k(hot::hla_rows(L, cfg.rank));
        hot::SavedActivation sc, sg;
        for (hot::SavedActivation* s : {&sc, &sg}) {
          s->rows = L, s->cols = CKK, s->rank = cfg.rank, s->codes = codes;
          const hot::Device d = s == &sc ? hot::Device::cpu() : dgy.view().device;
          s->q = hot::Tensor::empty(DType::s8, {CKK, Kp}, d, st());
          s->scale = hot::Tensor::empty(DType::f32, {1}, d, st());
        }
        HostTensor s_map = out1d(DType::f32, 1);  // the map's scale, for the codes
        static_cast<float*>(s_map.view().data)[0] = 0.0173f;
        DevTensor ds_map(s_map);
        if (codes) {
          hot::im2col_t(map, g, sc.q.view());
          hot::im2col_t(dmap, g, sg.q.view(), st());
          sc.scale = hot::Tensor::wrap(s_map.view(), nullptr);
          sg.scale = hot::Tensor::wrap(ds_map.view(), nullptr);
        } else {
          hot::compress_columns(map, g, sc.q.view(), sc.scale.view(), cfg.rank);
          hot::compress_columns(dmap, g, sg.q.view(), sg.scale.view(), cfg.rank, st());
        }
        HostTensor gxc = out2d(dt, P, g.C), gwc = out2d(DType::f32, O, CKK), gbc = out1d(dt, O);
        HostTensor gxg = gxc, gwg = gwc, gbg = gbc;
        DevTensor dgx(gxg), dgw(gwg), dgb(gbg);
        hot::backward_conv2d(gy, w, &sc, g, cfg, 42, {gxc, gwc, gbc});
        hot::backward_conv2d(dgy, dw, &sg, g, cfg, 42, {dgx, dgw, dgb}, st());
        sync();
        EXPECT_TRUE(all_bytes_equal(gxc, dgx.to_host())) << "grad_input";
        EXPECT_TRUE(all_bytes_equal(gwc, dgw.to_host())) << "grad_weight";
        {  // G~'s amax given (grad_output_amax, as a BatchNorm's backward hands it over): the same bytes; a wrong one
           // is read (g_x changes) where g_w comes from the codes, and not where the g_y pass forms G^
          HostTensor gt = out2d(DType::f32, L, O);
          hot::hadamard_transform(gy, gt, hot::hq_block_size(O), 1);
          float m = 0.0f;
          for (int64_t r = 0; r < L; ++r)
            for (int64_t o = 0; o < O; ++o) m = std::max(m, std::fabs(gt.getf(r, o)));
          HostTensor am = out1d(DType::f32, 1), bad = out1d(DType::f32, 1);
          am.setf(0, m);
          bad.setf(0, 2.0f * m);
          DevTensor dam(am), dbad(bad);
          const hot::TensorView av = dam.view(), bv = dbad.view();
          DevTensor dgx2(gxg), dgw2(gwg), dgx3(gxg), dgw3(gwg);
          hot::backward_conv2d(dgy, dw, &sg, g, cfg, 42, {dgx2, dgw2, {}}, st(), nullptr, &av);
          hot::backward_conv2d(dgy, dw, &sg, g, cfg, 42, {dgx3, dgw3, {}}, st(), nullptr, &bv);
          sync();
          EXPECT_TRUE(all_bytes_equal(gxc, dgx2.to_host())) << "grad_input with G~'s amax";
          EXPECT_TRUE(all_bytes_equal(gwc, dgw2.to_host())) << "grad_weight with G~'s amax";
          EXPECT_EQ(static_cast<bool>(all_bytes_equal(gxc, dgx3.to_host())), !codes) << "a wrong amax";
        }
        // g_b: a float sum in another (fixed) association order than the CPU's: the fp32 bound against float64
        const std::vector<float> gv = gy.to_f32();
        const HostTensor gb = dgb.to_host();
        for (int64_t o = 0; o < O; ++o) {
          double sum = 0, sa = 0;
          for (int64_t l = 0; l < L; ++l) sum += gv[l * O + o], sa += std::fabs(gv[l * O + o]);
          ASSERT_NEAR(gb.getf(o), sum, 2.0 * L * std::ldexp(1.0, -24) * sa + hot_test::unit_roundoff(dt) * std::fabs(sum) + 1e-30)
              << "g_b[" << o << "]";
        }
      }
}

// ---- sm_90a: the wgmma kernels themselves -------------------------------------------------------------

class Cuda_Sm90_GemmS8 : public CudaTest {};
TEST_F(Cuda_Sm90_GemmS8, WgmmaPathSelectedAndExact) {
  SKIP_UNLESS_SM90();
  const std::string info = hot::cuda::build_info();
  EXPECT_NE(info.find("sm90a CUTLASS 3.x wgmma"), std::string::npos) << info;
  // Large, tile-unaligned M and N, stream-K friendly (small M N, long K) and wide shapes.
  for (auto [M, N, K] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {25216, 768, 2304}, {2304, 768, 12608}, {3072, 768, 25216}, {333, 4096, 1024}, {129, 130, 16}}) {
    if (M * N * K > (int64_t(1) << 32) && small_run()) continue;
    HostTensor a = rand_int(DType::s8, M, K, -127, 127, M);
    HostTensor b = rand_int(DType::s8, N, K, -127, 127, N);
    HostTensor cg = out2d(DType::s32, M, N);
    DevTensor da(a), db(b), dc(cg);
    hot::gemm_s8s8s32(da, db, dc, st());
    sync();
    EXPECT_TRUE(check_sampled(a, b, dc.to_host(), 2000, M * 7 + N)) << M << "x" << N << "x" << K;
  }
}

}  // namespace
}  // namespace hot_cuda_test
