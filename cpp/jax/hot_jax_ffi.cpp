// XLA FFI handlers of hot's JAX front (python/hot/jax.py): the ABC compression of a layer input and the HOT backward
// of a linear layer, as custom calls that jax.jit / jax.grad programs contain. Each handler views the buffers XLA
// gives as hot::TensorView and calls the public C++ API (hot/ops.h) directly: no Python, no DLPack.
//
// Built as a small shared library (not a Python module) when jaxlib's FFI headers are found at build time
// (CMake option HOT_BUILD_JAX); python/hot/jax.py loads it with ctypes and registers each exported symbol with
// jax.ffi.register_ffi_target: the *Cpu handlers for platform "cpu", the *Cuda handlers (present when hot is built
// with CUDA, HotJaxHasCuda() == 1) for "CUDA", where they run on the stream XLA gives the call.
//
// Targets (operands / results / attributes):
//   hot_compress_activation      x (..., I) float               -> q s8 (I, K_pad), scale f32 (1,)
//                                attributes rank: i32, codes (0/1: x's own codes instead, activation_codes): i32
//   hot_backward_linear          g_y (..., O), w (O, I), q (I, K_pad) s8, scale f32 (1,), seed u32 (2,)
//                                                                -> g_x (..., I), g_w (O, I)
//   hot_backward_linear_bias     the same                        -> g_x, g_w, g_b (O,)
//                                attributes of both: codes (0/1: q, scale are x's codes, SPEC §4): i32, config: i64
//                                (hot::Config::code(), the whole configuration)
//   hot_backward_conv2d          g_y (N*Ho*Wo, O), w (O, kh*kw*C), q (kh*kw*C, K_pad) s8, scale f32 (1,), seed u32 (2,)
//                                                                -> g_x (N*H*W, C) channels-last, g_w (O, kh*kw*C)
//   hot_backward_conv2d_bias     the same                        -> g_x, g_w, g_b (O,)
//                                attributes of both: n, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, patches (0/1),
//                                codes (0/1: q, scale are hot_im2col_t's codes and the map's scale, SPEC §4): i32,
//                                config: i64 (hot::backward_conv2d, SPEC §8)
//   hot_quantize_nearest         x (..., C) float                -> q s8 (..., C), scale f32 (1,)
//                                (Q8 per tensor, round-to-nearest: a convolution's kept feature map, SPEC §8)
//   hot_compress_columns         q_map (N, H, W, C) s8           -> q s8 (kh*kw*C, K_pad), scale f32 (1,)
//                                (the ABC buffer of a convolution's im2col columns from its int8 map, SPEC §8)
//                                attributes kh, kw, sh, sw, ph, pw, dh, dw, patches (0/1), rank: i32
//   hot_im2col_t                 q_map (N, H, W, C) s8           -> q s8 (kh*kw*C, padded_k(N*Ho*Wo))
//                                (the codes of the map's im2col columns, transposed: g_w at full rank, SPEC §4, §8)
//                                attributes kh, kw, sh, sw, ph, pw, dh, dw, patches (0/1): i32
// The seed operand holds two words of jax.random.bits(key, (2,), uint32); the 64-bit seed of the stochastic rounding
// is word0 | word1 << 32 (hot.jax.seed_from_key documents and computes the same). It is an operand, not an
// attribute, so a jitted step compiles once whatever its key. On the GPU the kernels read it where it is (hot::Seed):
// the host never waits for it, and a step XLA records in a CUDA graph rounds with the seed of each run.
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>

#include "hot/config.h"
#include "hot/error.h"
#include "hot/ops.h"
#include "hot/tensor.h"
#include "xla/ffi/api/ffi.h"

#if defined(HOT_WITH_CUDA) && HOT_WITH_CUDA
#include <cuda_runtime_api.h>
#define HOT_JAX_CUDA 1
#else
#define HOT_JAX_CUDA 0
#endif

#define HOT_JAX_EXPORT extern "C" __attribute__((visibility("default")))

namespace ffi = xla::ffi;

namespace {

const char* ffi_dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::PRED: return "bool";
    default: return "an unsupported dtype";
  }
}

// The hot dtype of an FFI buffer; hot::Error(type) naming the operand for any other.
hot::DType hot_dtype(const char* op, const char* name, ffi::DataType t, bool float_only) {
  switch (t) {
    case ffi::DataType::F32: return hot::DType::f32;
    case ffi::DataType::F16: return hot::DType::f16;
    case ffi::DataType::BF16: return hot::DType::bf16;
    case ffi::DataType::S8:
      if (!float_only) return hot::DType::s8;
      break;
    default: break;
  }
  HOT_FAIL(type, op, ": ", name, " has dtype ", ffi_dtype_name(t), ", expected ",
           float_only ? "float32, float16 or bfloat16" : "int8");
}

// A row-major 2-D view over a dense FFI buffer: its leading dims flattened into rows, the last dim the columns
// (XLA lays out custom-call operands and results major-to-minor, as ffi_call asks).
hot::TensorView view_2d(const char* op, const char* name, const ffi::AnyBuffer& b, hot::Device dev, bool float_only) {
  const auto dims = b.dimensions();
  HOT_CHECK_VALUE(dims.size() >= 1, op, ": ", name, " has 0 dims, expected at least 1 (..., columns)");
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) rows *= dims[i];
  const int64_t cols = dims[dims.size() - 1];
  hot::TensorView v = hot::make_view(b.untyped_data(), hot_dtype(op, name, b.element_type(), float_only), dev,
                                     {rows, cols});
  return v;
}

// A 1-D view (n elements) over an FFI buffer of any rank whose element count is n.
hot::TensorView view_1d(const char* op, const char* name, const ffi::AnyBuffer& b, hot::Device dev, hot::DType want,
                        bool float_any) {
  const hot::DType dt = hot_dtype(op, name, b.element_type(), float_any);
  if (!float_any)
    HOT_CHECK_TYPE(dt == want, op, ": ", name, " has dtype ", hot::dtype_name(dt), ", expected ",
                   hot::dtype_name(want));
  return hot::make_view(b.untyped_data(), dt, dev, {static_cast<int64_t>(b.element_count())});
}

// The configuration of an attribute: hot::Config::code(), as hot.Config.code gives it (validated by from_code).
hot::Config make_config(int64_t code) { return hot::Config::from_code(code); }

uint64_t combine_seed(const uint32_t w[2]) { return static_cast<uint64_t>(w[0]) | (static_cast<uint64_t>(w[1]) << 32); }

// Runs fn, turning hot's errors (and any other exception, which must not cross the C boundary) into FFI errors.
template <typename Fn>
ffi::Error guarded(Fn&& fn) {
  try {
    fn();
    return ffi::Error::Success();
  } catch (const hot::Error& e) {
    const bool user = e.kind() == hot::ErrorKind::type || e.kind() == hot::ErrorKind::value;
    return ffi::Error(user ? ffi::ErrorCode::kInvalidArgument : ffi::ErrorCode::kInternal, e.what());
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("hot.jax: ") + e.what());
  } catch (...) {
    return ffi::Error(ffi::ErrorCode::kInternal, "hot.jax: unknown exception");
  }
}

// ---- the operations, backend-neutral: dev and stream say where they run ----------------------------------------

void compress(hot::Device dev, hot::Stream stream, const ffi::AnyBuffer& x, ffi::AnyBuffer q, ffi::AnyBuffer scale,
              int32_t rank, int32_t codes) {
  const char* op = "hot.jax compress_activation";
  const hot::TensorView xv = view_2d(op, "x", x, dev, true);
  const hot::TensorView qv = view_2d(op, "q", q, dev, false);
  HOT_CHECK_VALUE(q.dimensions().size() == 2, op, ": q has ", q.dimensions().size(), " dims, expected 2");
  const hot::TensorView sv = view_1d(op, "scale", scale, dev, hot::DType::f32, false);
  if (codes != 0) {
    hot::activation_codes(xv, qv, sv, stream);
  } else {
    hot::compress_activation(xv, qv, sv, rank, stream);
  }
}

// The geometry attributes of hot_compress_columns, in the handlers' order.
struct ColumnsAttrs {
  int32_t kh, kw, sh, sw, ph, pw, dh, dw, patches, rank;
};

// The geometry of a convolution over the int8 map m (N, H, W, C) with a's kernel, strides, padding, dilation and row
// order.
hot::ConvGeometry map_geometry(const char* op, const ffi::AnyBuffer& m, const ColumnsAttrs& a) {
  const auto dims = m.dimensions();
  HOT_CHECK_VALUE(dims.size() == 4, op, ": q_map has ", dims.size(), " dims, expected 4 (N, H, W, C)");
  hot::ConvGeometry g;
  g.N = dims[0], g.H = dims[1], g.W = dims[2], g.C = dims[3];
  g.kh = a.kh, g.kw = a.kw, g.sh = a.sh, g.sw = a.sw, g.ph = a.ph, g.pw = a.pw, g.dh = a.dh, g.dw = a.dw;
  g.patches = a.patches != 0;
  return g;
}

void compress_columns(hot::Device dev, hot::Stream stream, const ffi::AnyBuffer& m, ffi::AnyBuffer q,
                      ffi::AnyBuffer scale, const ColumnsAttrs& a) {
  const char* op = "hot.jax compress_columns";
  const hot::ConvGeometry g = map_geometry(op, m, a);
  const hot::TensorView mv = view_2d(op, "q_map", m, dev, false);
  const hot::TensorView qv = view_2d(op, "q", q, dev, false);
  const hot::TensorView sv = view_1d(op, "scale", scale, dev, hot::DType::f32, false);
  hot::compress_columns(mv, g, qv, sv, a.rank, stream);
}

void im2col_t(hot::Device dev, hot::Stream stream, const ffi::AnyBuffer& m, ffi::AnyBuffer q, const ColumnsAttrs& a) {
  const char* op = "hot.jax im2col_t";
  const hot::ConvGeometry g = map_geometry(op, m, a);
  hot::im2col_t(view_2d(op, "q_map", m, dev, false), g, view_2d(op, "q", q, dev, false), stream);
}

// The ABC buffer (q, scale) of a rows x cols operand as the core's SavedActivation: non-owning tensors over XLA's
// buffers (Tensor::wrap without a keepalive: XLA keeps them for the call).
hot::SavedActivation saved_buffer(const char* op, hot::Device dev, const ffi::AnyBuffer& q, const ffi::AnyBuffer& scale,
                                  int64_t rows, int64_t cols, int rank, bool codes = false) {
  hot::SavedActivation saved;
  saved.rows = rows;
  saved.cols = cols;
  saved.rank = rank;
  saved.codes = codes;
  saved.q = hot::Tensor::wrap(view_2d(op, "saved.q", q, dev, false), nullptr);
  saved.scale = hot::Tensor::wrap(view_1d(op, "saved.scale", scale, dev, hot::DType::f32, false), nullptr);
  return saved;
}

void backward(hot::Device dev, hot::Stream stream, const hot::Seed& seed, const ffi::AnyBuffer& gy, const ffi::AnyBuffer& w,
              const ffi::AnyBuffer& q, const ffi::AnyBuffer& scale, ffi::AnyBuffer gx, ffi::AnyBuffer gw,
              const ffi::AnyBuffer* gb, const hot::Config& config, int32_t codes) {
  const char* op = "hot.jax backward_linear";
  const hot::TensorView gyv = view_2d(op, "grad_output", gy, dev, true);
  HOT_CHECK_VALUE(w.dimensions().size() == 2, op, ": weight has ", w.dimensions().size(), " dims, expected 2 (O x I)");
  const hot::TensorView wv = view_2d(op, "weight", w, dev, true);
  const int64_t L = gyv.shape[0], I = wv.shape[1];
  const hot::SavedActivation saved = saved_buffer(op, dev, q, scale, L, I, config.rank, codes != 0);

  hot::BackwardOutputs out;
  out.grad_input = view_2d(op, "grad_input", gx, dev, true);
  HOT_CHECK_VALUE(out.grad_input.shape[0] == L && out.grad_input.shape[1] == I, op, ": grad_input has ",
                  out.grad_input.shape[0], " x ", out.grad_input.shape[1], " elements (rows x columns), expected ",
                  L, " x ", I);
  out.grad_weight = view_2d(op, "grad_weight", gw, dev, true);
  if (gb != nullptr) out.grad_bias = view_1d(op, "grad_bias", *gb, dev, hot::DType::f32, true);
  hot::backward_linear(gyv, wv, &saved, config, seed, out, stream);
}

// The geometry attributes of hot_backward_conv2d, in the handlers' order.
struct ConvAttrs {
  int32_t n, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, patches, codes;
};

void backward_conv(hot::Device dev, hot::Stream stream, const hot::Seed& seed, const ffi::AnyBuffer& gy,
                   const ffi::AnyBuffer& w, const ffi::AnyBuffer& q, const ffi::AnyBuffer& scale, ffi::AnyBuffer gx,
                   ffi::AnyBuffer gw, const ffi::AnyBuffer* gb, const hot::Config& config, const ConvAttrs& a) {
  const char* op = "hot.jax backward_conv2d";
  hot::ConvGeometry g;
  g.N = a.n, g.C = a.c, g.H = a.h, g.W = a.w, g.kh = a.kh, g.kw = a.kw, g.sh = a.sh, g.sw = a.sw;
  g.ph = a.ph, g.pw = a.pw, g.dh = a.dh, g.dw = a.dw, g.patches = a.patches != 0;
  const hot::TensorView gyv = view_2d(op, "grad_output", gy, dev, true);
  const hot::TensorView wv = view_2d(op, "weight", w, dev, true);
  const hot::SavedActivation saved =
      saved_buffer(op, dev, q, scale, gyv.shape[0], wv.shape[1], config.rank, a.codes != 0);
  hot::BackwardOutputs out;
  out.grad_input = view_2d(op, "grad_input", gx, dev, true);
  out.grad_weight = view_2d(op, "grad_weight", gw, dev, true);
  if (gb != nullptr) out.grad_bias = view_1d(op, "grad_bias", *gb, dev, hot::DType::f32, true);
  hot::backward_conv2d(gyv, wv, &saved, g, config, seed, out, stream);
}

void quantize_nearest(hot::Device dev, hot::Stream stream, const ffi::AnyBuffer& x, ffi::AnyBuffer q,
                      ffi::AnyBuffer scale) {
  const char* op = "hot.jax quantize";
  const hot::TensorView xv = view_2d(op, "x", x, dev, true);
  const hot::TensorView qv = view_2d(op, "q", q, dev, false);
  const hot::TensorView sv = view_1d(op, "scale", scale, dev, hot::DType::f32, false);
  hot::QuantizeParams p;
  p.bits = 8;
  p.scale = hot::ScaleMode::tensor;
  p.rounding = hot::Rounding::nearest;
  hot::quantize(xv, qv, sv, p, stream);
}

// ---- CPU handlers ------------------------------------------------------------------------------------------------

ffi::Error compress_cpu(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> scale,
                        int32_t rank, int32_t codes) {
  return guarded([&] { compress(hot::Device::cpu(), hot::Stream{}, x, *q, *scale, rank, codes); });
}

uint64_t host_seed(const char* op, const ffi::AnyBuffer& seed) {
  HOT_CHECK_TYPE(seed.element_type() == ffi::DataType::U32, op, ": seed has dtype ",
                 ffi_dtype_name(seed.element_type()), ", expected uint32 (two words of jax.random.bits)");
  HOT_CHECK_VALUE(seed.element_count() == 2, op, ": seed has ", seed.element_count(), " elements, expected 2");
  uint32_t w[2];
  std::memcpy(w, seed.untyped_data(), sizeof w);
  return combine_seed(w);
}

ffi::Error backward_cpu(ffi::AnyBuffer gy, ffi::AnyBuffer w, ffi::AnyBuffer q, ffi::AnyBuffer scale,
                        ffi::AnyBuffer seed, ffi::Result<ffi::AnyBuffer> gx, ffi::Result<ffi::AnyBuffer> gw,
                        int32_t codes, int64_t config) {
  return guarded([&] {
    const hot::Config c = make_config(config);
    backward(hot::Device::cpu(), hot::Stream{}, host_seed("hot.jax backward_linear", seed), gy, w, q, scale, *gx, *gw,
             nullptr, c, codes);
  });
}

ffi::Error backward_bias_cpu(ffi::AnyBuffer gy, ffi::AnyBuffer w, ffi::AnyBuffer q, ffi::AnyBuffer scale,
                             ffi::AnyBuffer seed, ffi::Result<ffi::AnyBuffer> gx, ffi::Result<ffi::AnyBuffer> gw,
                             ffi::Result<ffi::AnyBuffer> gb, int32_t codes, int64_t config) {
  return guarded([&] {
    const hot::Config c = make_config(config);
    const ffi::AnyBuffer b = *gb;
    backward(hot::Device::cpu(), hot::Stream{}, host_seed("hot.jax backward_linear", seed), gy, w, q, scale, *gx, *gw,
             &b, c, codes);
  });
}

ffi::Error backward_conv_cpu(ffi::AnyBuffer gy, ffi::AnyBuffer w, ffi::AnyBuffer q, ffi::AnyBuffer scale,
                             ffi::AnyBuffer seed, ffi::Result<ffi::AnyBuffer> gx, ffi::Result<ffi::AnyBuffer> gw,
                             int32_t n, int32_t c, int32_t h, int32_t wd, int32_t kh, int32_t kw, int32_t sh,
                             int32_t sw, int32_t ph, int32_t pw, int32_t dh, int32_t dw, int32_t patches,
                             int32_t codes, int64_t config) {
  return guarded([&] {
    backward_conv(hot::Device::cpu(), hot::Stream{}, host_seed("hot.jax backward_conv2d", seed), gy, w, q, scale, *gx,
                  *gw, nullptr, make_config(config), {n, c, h, wd, kh, kw, sh, sw, ph, pw, dh, dw, patches, codes});
  });
}

ffi::Error backward_conv_bias_cpu(ffi::AnyBuffer gy, ffi::AnyBuffer w, ffi::AnyBuffer q, ffi::AnyBuffer scale,
                                  ffi::AnyBuffer seed, ffi::Result<ffi::AnyBuffer> gx, ffi::Result<ffi::AnyBuffer> gw,
                                  ffi::Result<ffi::AnyBuffer> gb, int32_t n, int32_t c, int32_t h, int32_t wd,
                                  int32_t kh, int32_t kw, int32_t sh, int32_t sw, int32_t ph, int32_t pw, int32_t dh,
                                  int32_t dw, int32_t patches, int32_t codes, int64_t config) {
  return guarded([&] {
    const ffi::AnyBuffer b = *gb;
    backward_conv(hot::Device::cpu(), hot::Stream{}, host_seed("hot.jax backward_conv2d", seed), gy, w, q, scale, *gx,
                  *gw, &b, make_config(config), {n, c, h, wd, kh, kw, sh, sw, ph, pw, dh, dw, patches, codes});
  });
}

ffi::Error compress_columns_cpu(ffi::AnyBuffer m, ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> scale,
                                int32_t kh, int32_t kw, int32_t sh, int32_t sw, int32_t ph, int32_t pw, int32_t dh,
                                int32_t dw, int32_t patches, int32_t rank) {
  return guarded([&] {
    compress_columns(hot::Device::cpu(), hot::Stream{}, m, *q, *scale, {kh, kw, sh, sw, ph, pw, dh, dw, patches, rank});
  });
}

ffi::Error im2col_t_cpu(ffi::AnyBuffer m, ffi::Result<ffi::AnyBuffer> q, int32_t kh, int32_t kw, int32_t sh, int32_t sw,
                        int32_t ph, int32_t pw, int32_t dh, int32_t dw, int32_t patches) {
  return guarded(
      [&] { im2col_t(hot::Device::cpu(), hot::Stream{}, m, *q, {kh, kw, sh, sw, ph, pw, dh, dw, patches, 16}); });
}

ffi::Error quantize_cpu(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> scale) {
  return guarded([&] { quantize_nearest(hot::Device::cpu(), hot::Stream{}, x, *q, *scale); });
}

// ---- CUDA handlers -----------------------------------------------------------------------------------------------
#if HOT_JAX_CUDA

// The seed words live in device memory, where the kernels read them (hot::Seed): two little-endian uint32 words are
// the uint64 word0 | word1 << 32, the int64 element the core takes. Nothing waits for XLA's stream.
hot::Seed device_seed(const char* op, const ffi::AnyBuffer& seed, int32_t device) {
  HOT_CHECK_TYPE(seed.element_type() == ffi::DataType::U32, op, ": seed has dtype ",
                 ffi_dtype_name(seed.element_type()), ", expected uint32 (two words of jax.random.bits)");
  HOT_CHECK_VALUE(seed.element_count() == 2, op, ": seed has ", seed.element_count(), " elements, expected 2");
  static_assert(sizeof(uint32_t) * 2 == sizeof(int64_t), "two seed words make one int64");
  return hot::Seed(0, hot::make_view(seed.untyped_data(), hot::DType::s64, hot::Device::cuda(device), {}));
}

ffi::Error compress_cuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                         ffi::Result<ffi::AnyBuffer> scale, int32_t rank, int32_t codes) {
  return guarded([&] { compress(hot::Device::cuda(device), hot::Stream{stream}, x, *q, *scale, rank, codes); });
}

ffi::Error backward_cuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer gy, ffi::AnyBuffer w, ffi::AnyBuffer q,
                         ffi::AnyBuffer scale, ffi::AnyBuffer seed, ffi::Result<ffi::AnyBuffer> gx,
                         ffi::Result<ffi::AnyBuffer> gw, int32_t codes, int64_t config) {
  return guarded([&] {
    const hot::Config c = make_config(config);
    const hot::Seed s = device_seed("hot.jax backward_linear", seed, device);
    backward(hot::Device::cuda(device), hot::Stream{stream}, s, gy, w, q, scale, *gx, *gw, nullptr, c, codes);
  });
}

ffi::Error backward_bias_cuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer gy, ffi::AnyBuffer w,
                              ffi::AnyBuffer q, ffi::AnyBuffer scale, ffi::AnyBuffer seed,
                              ffi::Result<ffi::AnyBuffer> gx, ffi::Result<ffi::AnyBuffer> gw,
                              ffi::Result<ffi::AnyBuffer> gb, int32_t codes, int64_t config) {
  return guarded([&] {
    const hot::Config c = make_config(config);
    const hot::Seed s = device_seed("hot.jax backward_linear", seed, device);
    const ffi::AnyBuffer b = *gb;
    backward(hot::Device::cuda(device), hot::Stream{stream}, s, gy, w, q, scale, *gx, *gw, &b, c, codes);
  });
}

ffi::Error backward_conv_cuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer gy, ffi::AnyBuffer w,
                              ffi::AnyBuffer q, ffi::AnyBuffer scale, ffi::AnyBuffer seed,
                              ffi::Result<ffi::AnyBuffer> gx, ffi::Result<ffi::AnyBuffer> gw, int32_t n, int32_t c,
                              int32_t h, int32_t wd, int32_t kh, int32_t kw, int32_t sh, int32_t sw, int32_t ph,
                              int32_t pw, int32_t dh, int32_t dw, int32_t patches, int32_t codes, int64_t config) {
  return guarded([&] {
    const hot::Seed s = device_seed("hot.jax backward_conv2d", seed, device);
    backward_conv(hot::Device::cuda(device), hot::Stream{stream}, s, gy, w, q, scale, *gx, *gw, nullptr,
                  make_config(config), {n, c, h, wd, kh, kw, sh, sw, ph, pw, dh, dw, patches, codes});
  });
}

ffi::Error backward_conv_bias_cuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer gy, ffi::AnyBuffer w,
                                   ffi::AnyBuffer q, ffi::AnyBuffer scale, ffi::AnyBuffer seed,
                                   ffi::Result<ffi::AnyBuffer> gx, ffi::Result<ffi::AnyBuffer> gw,
                                   ffi::Result<ffi::AnyBuffer> gb, int32_t n, int32_t c, int32_t h, int32_t wd,
                                   int32_t kh, int32_t kw, int32_t sh, int32_t sw, int32_t ph, int32_t pw, int32_t dh,
                                   int32_t dw, int32_t patches, int32_t codes, int64_t config) {
  return guarded([&] {
    const hot::Seed s = device_seed("hot.jax backward_conv2d", seed, device);
    const ffi::AnyBuffer b = *gb;
    backward_conv(hot::Device::cuda(device), hot::Stream{stream}, s, gy, w, q, scale, *gx, *gw, &b,
                  make_config(config), {n, c, h, wd, kh, kw, sh, sw, ph, pw, dh, dw, patches, codes});
  });
}

ffi::Error compress_columns_cuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer m, ffi::Result<ffi::AnyBuffer> q,
                                 ffi::Result<ffi::AnyBuffer> scale, int32_t kh, int32_t kw, int32_t sh, int32_t sw,
                                 int32_t ph, int32_t pw, int32_t dh, int32_t dw, int32_t patches, int32_t rank) {
  return guarded([&] {
    compress_columns(hot::Device::cuda(device), hot::Stream{stream}, m, *q, *scale,
                     {kh, kw, sh, sw, ph, pw, dh, dw, patches, rank});
  });
}

ffi::Error im2col_t_cuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer m, ffi::Result<ffi::AnyBuffer> q,
                         int32_t kh, int32_t kw, int32_t sh, int32_t sw, int32_t ph, int32_t pw, int32_t dh, int32_t dw,
                         int32_t patches) {
  return guarded([&] {
    im2col_t(hot::Device::cuda(device), hot::Stream{stream}, m, *q, {kh, kw, sh, sw, ph, pw, dh, dw, patches, 16});
  });
}

ffi::Error quantize_cuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                         ffi::Result<ffi::AnyBuffer> scale) {
  return guarded([&] { quantize_nearest(hot::Device::cuda(device), hot::Stream{stream}, x, *q, *scale); });
}

#endif  // HOT_JAX_CUDA

}  // namespace

// ---- exported symbols --------------------------------------------------------------------------------------------

// The library is compiled with hidden visibility; these declarations export the handler symbols.
HOT_JAX_EXPORT XLA_FFI_Error* HotJaxCompressCpu(XLA_FFI_CallFrame*);
HOT_JAX_EXPORT XLA_FFI_Error* HotJaxBackwardCpu(XLA_FFI_CallFrame*);
HOT_JAX_EXPORT XLA_FFI_Error* HotJaxBackwardBiasCpu(XLA_FFI_CallFrame*);
HOT_JAX_EXPORT XLA_FFI_Error* HotJaxQuantizeCpu(XLA_FFI_CallFrame*);
HOT_JAX_EXPORT XLA_FFI_Error* HotJaxCompressColumnsCpu(XLA_FFI_CallFrame*);
HOT_JAX_EXPORT XLA_FFI_Error* HotJaxBackwardConvCpu(XLA_FFI_CallFrame*);
HOT_JAX_EXPORT XLA_FFI_Error* HotJaxBackwardConvBiasCpu(XLA_FFI_CallFrame*);
HOT_JAX_EXPORT XLA_FFI_Error* HotJaxIm2colTCpu(XLA_FFI_CallFrame*);
#if HOT_JAX_CUDA
HOT_JAX_EXPORT XLA_FFI_Error* HotJaxCompressCuda(XLA_FFI_CallFrame*);
HOT_JAX_EXPORT XLA_FFI_Error* HotJaxBackwardCuda(XLA_FFI_CallFrame*);
HOT_JAX_EXPORT XLA_FFI_Error* HotJaxBackwardBiasCuda(XLA_FFI_CallFrame*);
HOT_JAX_EXPORT XLA_FFI_Error* HotJaxQuantizeCuda(XLA_FFI_CallFrame*);
HOT_JAX_EXPORT XLA_FFI_Error* HotJaxCompressColumnsCuda(XLA_FFI_CallFrame*);
HOT_JAX_EXPORT XLA_FFI_Error* HotJaxBackwardConvCuda(XLA_FFI_CallFrame*);
HOT_JAX_EXPORT XLA_FFI_Error* HotJaxBackwardConvBiasCuda(XLA_FFI_CallFrame*);
HOT_JAX_EXPORT XLA_FFI_Error* HotJaxIm2colTCuda(XLA_FFI_CallFrame*);
#endif

// The bindings' shared parts: the CUDA handlers' stream and device; the backward handlers' operands g_y, w, q, scale,
// seed and results g_x, g_w (+ g_b); the other handlers' one operand and two results (hot_im2col_t's one).
#define HOT_JAX_CUDA_CTX .Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>()
#define HOT_JAX_BACKWARD_IO                                                                                   \
  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()                      \
      .Arg<ffi::AnyBuffer>()                                                                                  \
      .Ret<ffi::AnyBuffer>()                                                                                  \
      .Ret<ffi::AnyBuffer>()
#define HOT_JAX_BACKWARD_BIAS_IO HOT_JAX_BACKWARD_IO.Ret<ffi::AnyBuffer>()
#define HOT_JAX_ONE_IN_TWO_OUT .Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
#define HOT_JAX_BACKWARD_ATTRS .Attr<int32_t>("codes").Attr<int64_t>("config")
#define HOT_JAX_CONV_ATTRS                                                                                    \
  .Attr<int32_t>("n").Attr<int32_t>("c").Attr<int32_t>("h").Attr<int32_t>("w").Attr<int32_t>("kh")             \
      .Attr<int32_t>("kw").Attr<int32_t>("sh").Attr<int32_t>("sw").Attr<int32_t>("ph").Attr<int32_t>("pw")      \
      .Attr<int32_t>("dh").Attr<int32_t>("dw").Attr<int32_t>("patches").Attr<int32_t>("codes").Attr<int64_t>("config")
#define HOT_JAX_IM2COL_T_ATTRS                                                                                \
  .Attr<int32_t>("kh").Attr<int32_t>("kw").Attr<int32_t>("sh").Attr<int32_t>("sw").Attr<int32_t>("ph")         \
      .Attr<int32_t>("pw").Attr<int32_t>("dh").Attr<int32_t>("dw").Attr<int32_t>("patches")
#define HOT_JAX_COLUMNS_ATTRS                                                                                 \
  .Attr<int32_t>("kh").Attr<int32_t>("kw").Attr<int32_t>("sh").Attr<int32_t>("sw").Attr<int32_t>("ph")         \
      .Attr<int32_t>("pw").Attr<int32_t>("dh").Attr<int32_t>("dw").Attr<int32_t>("patches").Attr<int32_t>("rank")

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotJaxCompressCpu, compress_cpu,
                              ffi::Ffi::Bind() HOT_JAX_ONE_IN_TWO_OUT.Attr<int32_t>("rank").Attr<int32_t>("codes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotJaxBackwardCpu, backward_cpu,
                              ffi::Ffi::Bind() HOT_JAX_BACKWARD_IO HOT_JAX_BACKWARD_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotJaxBackwardBiasCpu, backward_bias_cpu,
                              ffi::Ffi::Bind() HOT_JAX_BACKWARD_BIAS_IO HOT_JAX_BACKWARD_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotJaxCompressColumnsCpu, compress_columns_cpu,
                              ffi::Ffi::Bind() HOT_JAX_ONE_IN_TWO_OUT HOT_JAX_COLUMNS_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotJaxBackwardConvCpu, backward_conv_cpu,
                              ffi::Ffi::Bind() HOT_JAX_BACKWARD_IO HOT_JAX_CONV_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotJaxBackwardConvBiasCpu, backward_conv_bias_cpu,
                              ffi::Ffi::Bind() HOT_JAX_BACKWARD_BIAS_IO HOT_JAX_CONV_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotJaxIm2colTCpu, im2col_t_cpu,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>() HOT_JAX_IM2COL_T_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotJaxQuantizeCpu, quantize_cpu,
                              ffi::Ffi::Bind() HOT_JAX_ONE_IN_TWO_OUT);

#if HOT_JAX_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(HotJaxCompressCuda, compress_cuda,
                              ffi::Ffi::Bind() HOT_JAX_CUDA_CTX HOT_JAX_ONE_IN_TWO_OUT.Attr<int32_t>("rank")
                                  .Attr<int32_t>("codes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotJaxBackwardCuda, backward_cuda,
                              ffi::Ffi::Bind() HOT_JAX_CUDA_CTX HOT_JAX_BACKWARD_IO HOT_JAX_BACKWARD_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotJaxBackwardBiasCuda, backward_bias_cuda,
                              ffi::Ffi::Bind() HOT_JAX_CUDA_CTX HOT_JAX_BACKWARD_BIAS_IO HOT_JAX_BACKWARD_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotJaxCompressColumnsCuda, compress_columns_cuda,
                              ffi::Ffi::Bind() HOT_JAX_CUDA_CTX HOT_JAX_ONE_IN_TWO_OUT HOT_JAX_COLUMNS_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotJaxBackwardConvCuda, backward_conv_cuda,
                              ffi::Ffi::Bind() HOT_JAX_CUDA_CTX HOT_JAX_BACKWARD_IO HOT_JAX_CONV_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotJaxBackwardConvBiasCuda, backward_conv_bias_cuda,
                              ffi::Ffi::Bind() HOT_JAX_CUDA_CTX HOT_JAX_BACKWARD_BIAS_IO HOT_JAX_CONV_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotJaxIm2colTCuda, im2col_t_cuda,
                              ffi::Ffi::Bind() HOT_JAX_CUDA_CTX.Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  HOT_JAX_IM2COL_T_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(HotJaxQuantizeCuda, quantize_cuda,
                              ffi::Ffi::Bind() HOT_JAX_CUDA_CTX HOT_JAX_ONE_IN_TWO_OUT);

#endif

// 1 when the *Cuda handlers are compiled in.
HOT_JAX_EXPORT int HotJaxHasCuda() { return HOT_JAX_CUDA; }
// The CPU backend's thread count of this library's copy of the core (it links its own, apart from hot._C's).
HOT_JAX_EXPORT int HotJaxSetNumThreads(int n) {
  try {
    hot::set_num_threads(n);
    return 0;
  } catch (...) {
    return -1;
  }
}
HOT_JAX_EXPORT int HotJaxGetNumThreads() { return hot::get_num_threads(); }
// hot::build_info() of this library's core, to tell which backends its handlers can reach.
HOT_JAX_EXPORT const char* HotJaxBuildInfo() {
  static const std::string info = hot::build_info();
  return info.c_str();
}
