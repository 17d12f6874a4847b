// Helpers of the CUDA GoogleTest suites: device copies of hot_test::HostTensor (same layout, padding
// included), a non-default stream per test, poisoned outputs, and the GPU skip conditions.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend.h"
#include "test_util.h"

namespace hot_cuda_test {

using hot::DType;
using hot::TensorView;
using hot_test::HostTensor;

#define CUDA_OK(expr)                                                                   \
  do {                                                                                  \
    const cudaError_t e_ = (expr);                                                      \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_);              \
  } while (0)

inline int device_cc() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  return major * 10 + minor;
}

#define SKIP_WITHOUT_GPU()                                                                       \
  do {                                                                                           \
    if (!hot::cuda::available()) GTEST_SKIP() << "no CUDA device: " << hot::cuda::unavailable_reason(); \
  } while (0)

#define SKIP_UNLESS_SM90()                                                        \
  do {                                                                            \
    SKIP_WITHOUT_GPU();                                                           \
    if (device_cc() != 90) GTEST_SKIP() << "needs an sm_90 GPU, have sm_" << device_cc(); \
  } while (0)

// A device buffer mirroring a HostTensor byte for byte (padding and all).
class DevTensor {
 public:
  DevTensor() = default;
  // On CUDA device `device` (the current device is left as it was).
  explicit DevTensor(const HostTensor& h, int device = 0) : host_(h), device_(device) {
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device);
    void* p = nullptr;
    const bool ok = cudaMalloc(&p, h.nbytes() + 16) == cudaSuccess;
    if (ok) ptr_.reset(p, [](void* q) { cudaFree(q); });
    const bool copied = ok && cudaMemcpy(p, h.bytes(), h.nbytes(), cudaMemcpyHostToDevice) == cudaSuccess;
    // A pageable H2D cudaMemcpy may return before the DMA lands, and the tests' non-blocking stream
    // does not order after the legacy stream: wait here so no kernel races the upload.
    const bool synced = copied && cudaDeviceSynchronize() == cudaSuccess;
    cudaSetDevice(prev);
    if (!ok) throw std::runtime_error("cudaMalloc failed");
    if (!copied) throw std::runtime_error("cudaMemcpy H2D failed");
    if (!synced) throw std::runtime_error("cudaDeviceSynchronize failed");
  }
  TensorView view() const {
    TensorView v = host_.view();
    v.data = ptr_.get();
    v.device = hot::Device::cuda(device_);
    return v;
  }
  operator TensorView() const { return view(); }
  // The device contents in a HostTensor of the same layout.
  HostTensor to_host() const {
    HostTensor h = host_;
    if (cudaMemcpy(h.bytes(), ptr_.get(), h.nbytes(), cudaMemcpyDeviceToHost) != cudaSuccess)
      throw std::runtime_error("cudaMemcpy D2H failed");
    return h;
  }

 private:
  HostTensor host_;
  int device_ = 0;
  std::shared_ptr<void> ptr_;
};

// Every byte of the tensor (logical and padding) set to `byte`: outputs start poisoned.
inline HostTensor poisoned(HostTensor h, uint8_t byte = 0x5a) {
  std::memset(h.bytes(), byte, h.nbytes());
  return h;
}
inline HostTensor out2d(DType dt, int64_t r, int64_t c, int64_t ld = -1) {
  return poisoned(HostTensor::make2d(dt, r, c, ld));
}
inline HostTensor out1d(DType dt, int64_t n) { return poisoned(HostTensor::make1d(dt, n)); }

// A test fixture with a non-default stream; every CUDA call of the tests runs on it.
class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!hot::cuda::available()) GTEST_SKIP() << "no CUDA device: " << hot::cuda::unavailable_reason();
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream_) {
      EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
      EXPECT_EQ(cudaGetLastError(), cudaSuccess);
      cudaStreamDestroy(stream_);
    }
  }
  hot::Stream st() const { return hot::Stream{stream_}; }
  void sync() { ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess); }
  cudaStream_t stream_ = nullptr;
};

// HOT_CUDA_TEST_SMALL=1 (used under compute-sanitizer): skip the largest shapes.
inline bool small_run() {
  const char* e = std::getenv("HOT_CUDA_TEST_SMALL");
  return e != nullptr && e[0] != '\0' && e[0] != '0';
}

inline const char* dt_name(DType d) { return hot::dtype_name(d); }

// Random float matrix rounded to dt, with optional row stride > cols.
inline HostTensor rand_float(DType dt, int64_t r, int64_t c, uint64_t seed, int64_t ld = -1, float sigma = 1.0f) {
  return hot_test::host_from(dt, r, c, hot_test::randn(static_cast<size_t>(r * c), seed, sigma), ld);
}
inline HostTensor rand_int(DType dt, int64_t r, int64_t c, int64_t lo, int64_t hi, uint64_t seed, int64_t ld = -1) {
  return hot_test::host_from_int(dt, r, c, hot_test::randint(static_cast<size_t>(r * c), seed, lo, hi), ld);
}

// Byte-identical logical elements.
inline ::testing::AssertionResult same_bits(const HostTensor& a, const HostTensor& b) {
  return hot_test::bits_equal(a, b);
}

// Every byte of two tensors of one layout equal (logical elements and row padding); a: the CPU backend's result.
inline ::testing::AssertionResult all_bytes_equal(const HostTensor& a, const HostTensor& b) {
  if (a.nbytes() != b.nbytes()) return ::testing::AssertionFailure() << "sizes differ";
  for (size_t i = 0; i < a.nbytes(); ++i)
    if (a.bytes()[i] != b.bytes()[i]) {
      const int64_t eb = std::max(1, hot::dtype_bits(a.dtype()) / 8);
      const int64_t e = static_cast<int64_t>(i) / eb;
      return ::testing::AssertionFailure() << "byte " << i << " differs (element row " << e / a.ld() << ", col "
                                           << e % a.ld() << " of " << a.rows() << " x " << a.cols() << ", ld "
                                           << a.ld() << "): cpu " << int(a.bytes()[i]) << " kernel "
                                           << int(b.bytes()[i]);
    }
  return ::testing::AssertionSuccess();
}

// Equal elements of two float tensors of one shape and dtype, a NaN equal to any NaN (the CPU backend keeps a NaN's
// payload where the CUDA conversions write the canonical NaN); a: the CPU backend's result.
inline ::testing::AssertionResult same_floats(const HostTensor& a, const HostTensor& b) {
  if (a.dtype() != b.dtype() || a.rows() != b.rows() || a.cols() != b.cols())
    return ::testing::AssertionFailure() << "dtype or shape differs";
  const int eb = hot::dtype_bits(a.dtype()) / 8;
  for (int64_t r = 0; r < a.rows(); ++r)
    for (int64_t c = 0; c < a.cols(); ++c) {
      const float x = a.getf(r, c), y = b.getf(r, c);
      if (std::isnan(x) && std::isnan(y)) continue;
      if (std::memcmp(a.bytes() + (r * a.ld() + c) * eb, b.bytes() + (r * b.ld() + c) * eb, eb) != 0)
        return ::testing::AssertionFailure() << "element (" << r << ", " << c << ") differs: cpu " << x << " kernel "
                                             << y;
    }
  return ::testing::AssertionSuccess();
}

// The cases of the quantize bit-exactness suites (Cuda_* and Emu_*): f(in, params) for every dtype, shape (R, C),
// bit width, scale mode and rounding, each with its own input (row stride C + 2) and seed, under a SCOPED_TRACE.
template <typename F>
void for_each_quantize_case(const std::vector<DType>& dtypes, const std::vector<std::pair<int64_t, int64_t>>& shapes,
                            F&& f) {
  uint64_t seed = 200;
  for (DType dt : dtypes)
    for (auto [R, C] : shapes)
      for (int bits : {4, 8})
        for (hot::ScaleMode sm : {hot::ScaleMode::tensor, hot::ScaleMode::token})
          for (hot::Rounding rd : {hot::Rounding::nearest, hot::Rounding::stochastic}) {
            SCOPED_TRACE(testing::Message() << hot::dtype_name(dt) << " " << R << "x" << C << " bits " << bits << " "
                                            << hot::scale_mode_name(sm) << " " << hot::rounding_name(rd));
            const HostTensor in = rand_float(dt, R, C, seed++, C + 2, 3.0f);
            hot::QuantizeParams p;
            p.bits = bits;
            p.scale = sm;
            p.rounding = rd;
            p.seed = 0x1234567890abcdefull + seed;
            p.rng_stream = static_cast<uint32_t>(seed % 3);
            f(in, p);
          }
}

// One configuration of quantize_grad_output in the bit-exactness suites (Cuda_* and Emu_*), and its plan.
struct QgoCase {
  int64_t L, O;
  int bits;
  hot::ScaleMode sm;
  hot::Rounding rd;
  bool gx, gw, bias;
  int rank;
};
inline hot::GradOutputPlan qgo_plan(const QgoCase& c, uint64_t seed) {
  hot::GradOutputPlan plan;
  plan.gx = c.gx;
  plan.gx_bits = c.bits;
  plan.block = hot::hq_block_size(c.O);
  plan.gx_scale = c.sm;
  plan.gw = c.gw;
  plan.rank = c.rank;
  plan.rounding = c.rd;
  plan.seed = 0xfeedbeef00000000ull + seed;
  plan.bias = c.bias;
  return plan;
}

// Convolution geometries of the col2im and im2col tests (Cuda_ and Emu_): ResNet 3x3, strided, non-overlapping, 1x1
// stride 2, dilated, patch order, a map of more pixels than one grid-stride pass of a small grid, and channel counts
// that give im2col's 16-, 8- and 4-byte units (16, 64; 6).
inline std::vector<hot::ConvGeometry> col2im_geometries() {
  struct G {
    int64_t N, C, H, W;
    int kh, kw, sh, sw, ph, pw, dh, dw;
    bool patches;
  };
  const G cases[] = {{2, 3, 7, 9, 3, 3, 1, 1, 1, 1, 1, 1, false},  {2, 5, 9, 8, 3, 3, 2, 2, 1, 1, 1, 1, false},
                     {1, 4, 8, 8, 2, 2, 2, 2, 0, 0, 1, 1, false},  {2, 3, 9, 7, 1, 1, 2, 2, 0, 0, 1, 1, false},
                     {1, 2, 11, 10, 3, 2, 1, 2, 2, 1, 2, 3, false}, {2, 3, 8, 8, 3, 3, 1, 1, 1, 1, 1, 1, true},
                     {3, 17, 20, 19, 3, 3, 1, 1, 1, 1, 1, 1, false}, {2, 16, 9, 9, 3, 3, 1, 1, 1, 1, 1, 1, false},
                     {1, 64, 8, 8, 3, 3, 2, 2, 1, 1, 1, 1, true},    {2, 6, 7, 7, 2, 2, 1, 1, 0, 0, 1, 1, false},
                     // many columns on few rows: compress_columns spreads its column chunks over grid.y (V = 3, 1)
                     {1, 33, 6, 6, 3, 3, 1, 1, 1, 1, 1, 1, false},   {1, 35, 5, 7, 3, 3, 1, 1, 1, 1, 1, 1, false}};
  std::vector<hot::ConvGeometry> out;
  for (const G& c : cases) {
    hot::ConvGeometry g;
    g.N = c.N, g.C = c.C, g.H = c.H, g.W = c.W, g.kh = c.kh, g.kw = c.kw, g.sh = c.sh, g.sw = c.sw;
    g.ph = c.ph, g.pw = c.pw, g.dh = c.dh, g.dw = c.dw, g.patches = c.patches;
    out.push_back(g);
  }
  return out;
}

// Convolutions whose output has the map's size at stride 1 with channel runs of 16 bytes: im2col_t's shifting kernel
// (im2col_t_shift_kernel). Image rows shorter than a 16-byte chunk (W = 9, 2, 1: a chunk spans several rows),
// kernels of 3 x 3, 5 x 3, 3 x 1 and 7 x 7, dilation 2.
inline std::vector<hot::ConvGeometry> shift_geometries() {
  struct G {
    int64_t N, C, H, W;
    int kh, kw, ph, pw, dh, dw;
  };
  const G cases[] = {{2, 16, 9, 9, 3, 3, 1, 1, 1, 1},   {3, 32, 20, 19, 3, 3, 1, 1, 1, 1},
                     {1, 16, 11, 10, 5, 3, 2, 1, 1, 1}, {2, 16, 13, 18, 3, 3, 2, 2, 2, 2},
                     {2, 16, 17, 1, 3, 1, 1, 0, 1, 1},  {5, 16, 3, 2, 3, 3, 1, 1, 1, 1},
                     {1, 16, 10, 12, 7, 7, 3, 3, 1, 1}, {2, 64, 56, 56, 3, 3, 1, 1, 1, 1}};
  std::vector<hot::ConvGeometry> out;
  for (const G& c : cases) {
    hot::ConvGeometry g;
    g.N = c.N, g.C = c.C, g.H = c.H, g.W = c.W, g.kh = c.kh, g.kw = c.kw, g.ph = c.ph, g.pw = c.pw, g.dh = c.dh;
    g.dw = c.dw;
    out.push_back(g);
  }
  return out;
}

}  // namespace hot_cuda_test
