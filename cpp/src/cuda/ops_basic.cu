// Building-block operations of the CUDA backend: Hadamard transform, HLA projection, quantise /
// dequantise, int4 packing and the bias gradient. Integer results match the CPU backend bit for bit
// (same fp32 butterfly order, same scalar rules from hot/quant_rules.h, same Philox draws).
#include "common.cuh"
#include "fwht.cuh"
#include "hot/quant_rules.h"
#include "hot/rng.h"

namespace hot::cuda {

namespace {

constexpr int kThreads = 256;

// ---- Hadamard transform -------------------------------------------------------------------------
// One thread per transformed vector of B elements (held in registers for small B).
template <int B, typename T>
__global__ void hadamard_kernel(Mat<const T> in, Mat<float> out, int axis) {
  const int64_t nvec = axis == 1 ? in.rows * (in.cols / B) : (in.rows / B) * in.cols;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < nvec;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t base_in, base_out, step_in, step_out;
    if (axis == 1) {
      const int64_t nb = in.cols / B;
      const int64_t r = v / nb, g = v % nb;
      base_in = r * in.ld + g * B;
      base_out = r * out.ld + g * B;
      step_in = 1;
      step_out = 1;
    } else {
      const int64_t g = v / in.cols, c = v % in.cols;
      base_in = g * B * in.ld + c;
      base_out = g * B * out.ld + c;
      step_in = in.ld;
      step_out = out.ld;
    }
    float x[B];
#pragma unroll
    for (int i = 0; i < B; ++i) x[i] = load_f(in.p + base_in + i * step_in);
    fwht_regs<B>(x);
#pragma unroll
    for (int i = 0; i < B; ++i) out.p[base_out + i * step_out] = x[i];
  }
}

template <typename T>
void launch_hadamard(const TensorView& in, const TensorView& out, int block, int axis, cudaStream_t s) {
  const Mat<const T> mi = mat<const T>(in);
  const Mat<float> mo = mat<float>(out);
  const int64_t nvec = in.numel() / block;
  const unsigned grid = grid_1d(nvec, kThreads);
  switch (block) {
#define HOT_H(B) \
  case B: hadamard_kernel<B, T><<<grid, kThreads, 0, s>>>(mi, mo, axis); break;
    HOT_H(1) HOT_H(2) HOT_H(4) HOT_H(8) HOT_H(16) HOT_H(32) HOT_H(64) HOT_H(128) HOT_H(256)
#undef HOT_H
    default: HOT_FAIL(internal, "hadamard_transform: unsupported block ", block);
  }
  HOT_CUDA_CHECK_LAUNCH();
}

// ---- HLA projection -------------------------------------------------------------------------------
template <typename T>
__global__ void hla_kernel(Mat<const T> in, Mat<float> out, int rank) {
  const int64_t nb = (in.rows + 15) / 16;
  const int64_t n = nb * in.cols;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < n;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = v / in.cols, c = v % in.cols;
    float x[16];
#pragma unroll
    for (int t = 0; t < 16; ++t) {
      const int64_t r = j * 16 + t;
      x[t] = r < in.rows ? load_f(in.p + r * in.ld + c) : 0.0f;
    }
    fwht_regs<16>(x);
#pragma unroll
    for (int k = 0; k < 16; ++k)
      if (k < rank) out.p[(j * rank + k) * out.ld + c] = x[hla_order(k)];
  }
}

// ---- quantise -------------------------------------------------------------------------------------
// amax keys (hot::amax_key) reduced with atomicMax: max is order independent, so the result is exact.
template <typename T>
__global__ void amax_tensor_kernel(Mat<const T> in, unsigned* key) {
  const int64_t n = in.rows * in.cols;
  uint32_t m = 0;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / in.cols, c = e % in.cols;
    m = max(m, amax_key(load_f(in.p + r * in.ld + c)));
  }
  m = block_max_u32(m);
  if (threadIdx.x == 0) atomicMax(key, m);
}

template <typename T>
__global__ void amax_row_kernel(Mat<const T> in, unsigned* keys) {
  const int64_t r = blockIdx.x;
  uint32_t m = 0;
  for (int64_t c = threadIdx.x; c < in.cols; c += blockDim.x) m = max(m, amax_key(load_f(in.p + r * in.ld + c)));
  m = block_max_u32(m);
  if (threadIdx.x == 0) keys[r] = m;
}

// scale[i] / inv[i] from the amax keys (n = 1 or R).
__global__ void finalize_scales_kernel(const unsigned* keys, int64_t n, int qmax, float* scale, float* inv, float* pre) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const QuantScale qs = quant_scale_from_amax(amax_from_key(keys[i]), qmax);
    scale[i] = qs.scale;
    inv[i] = qs.inv;
    pre[i] = qs.pre;
  }
}

// One thread per group of 8 logical elements (one Philox call per group, 16-bit uniforms: rng.h).
template <typename T>
__global__ void quantize_kernel(Mat<const T> in, Mat<int8_t> q, const float* inv, const float* pre, bool per_row, int qmax,
                                bool stochastic, uint64_t seed, uint32_t rng) {
  const int64_t n = in.rows * in.cols;
  const int64_t ngroups = (n + kSrGroup - 1) / kSrGroup;
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < ngroups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    Philox4 bits{};
    if (stochastic) bits = sr_group_bits(seed, rng, static_cast<uint64_t>(g));
#pragma unroll
    for (int j = 0; j < kSrGroup; ++j) {
      const int64_t e = g * kSrGroup + j;
      if (e >= n) break;
      const int64_t r = e / in.cols, c = e % in.cols;
      const float v = load_f(in.p + r * in.ld + c);
      const QuantScale qs{inv[per_row ? r : 0], 0.0f, pre[per_row ? r : 0]};
      q.p[r * q.ld + c] = stochastic ? quantize_stochastic(v, qs, qmax, sr_group_uniform(bits, static_cast<unsigned>(j)))
                                     : quantize_nearest(v, qs, qmax);
    }
  }
}

// ---- dequantise, int4 -------------------------------------------------------------------------------
template <typename T>
__global__ void dequantize_kernel(Mat<const int8_t> q, const float* scale, bool per_row, Mat<T> out) {
  const int64_t n = q.rows * q.cols;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / q.cols, c = e % q.cols;
    store_f(out.p + r * out.ld + c, hot_mul(static_cast<float>(q.p[r * q.ld + c]), scale[per_row ? r : 0]));
  }
}

// q: R x C s8, packed: bytes with row stride ldb (bytes); C even.
__global__ void pack_int4_kernel(Mat<const int8_t> q, uint8_t* packed, int64_t ldb) {
  const int64_t half = q.cols / 2;
  const int64_t n = q.rows * half;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / half, k = e % half;
    const uint8_t lo = static_cast<uint8_t>(q.p[r * q.ld + 2 * k]) & 0xf;
    const uint8_t hi = static_cast<uint8_t>(q.p[r * q.ld + 2 * k + 1]) & 0xf;
    packed[r * ldb + k] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

__global__ void unpack_int4_kernel(const uint8_t* packed, int64_t ldb, Mat<int8_t> q) {
  const int64_t half = q.cols / 2;
  const int64_t n = q.rows * half;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / half, k = e % half;
    const uint8_t b = packed[r * ldb + k];
    const int lo = b & 0xf, hi = b >> 4;
    q.p[r * q.ld + 2 * k] = static_cast<int8_t>(lo >= 8 ? lo - 16 : lo);
    q.p[r * q.ld + 2 * k + 1] = static_cast<int8_t>(hi >= 8 ? hi - 16 : hi);
  }
}

}  // namespace

// ---- bias gradient (also used by quantize_grad_output's callers) ------------------------------------
namespace {
constexpr int kBiasRowsPerChunk = 128;

template <typename T>
__global__ void bias_partial_kernel(Mat<const T> gy, float* partial) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= gy.cols) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kBiasRowsPerChunk;
  const int64_t r1 = min(r0 + kBiasRowsPerChunk, gy.rows);
  float s = 0.0f;
  for (int64_t r = r0; r < r1; ++r) s = hot_add(s, load_f(gy.p + r * gy.ld + c));
  partial[blockIdx.y * gy.cols + c] = s;
}

}  // namespace

// Deterministic column sums: fixed row chunks, then the chunk sums in chunk order.
void bias_grad(const TensorView& gy, const TensorView& out, Stream st) {
  DeviceGuard dg(gy.device.index);
  const cudaStream_t s = to_cuda(st);
  const int64_t L = gy.shape[0], O = gy.shape[1];
  const int64_t nchunks = ceil_div(L, kBiasRowsPerChunk);
  HOT_CHECK_VALUE(nchunks < 65536, "bias_grad: too many rows (", L, ")");
  Scratch partial(static_cast<size_t>(nchunks * O) * sizeof(float), gy.device.index, st);
  dispatch_float(gy.dtype, "bias_grad", [&](auto t) {
    using T = decltype(t);
    bias_partial_kernel<T><<<dim3(static_cast<unsigned>(ceil_div(O, 128)), static_cast<unsigned>(nchunks)), 128, 0,
                             s>>>(mat<const T>(gy), partial.as<float>());
  });
  HOT_CUDA_CHECK_LAUNCH();
  dispatch_float(out.dtype, "bias_grad", [&](auto t) {
    using T = decltype(t);
    bias_final_kernel<T><<<static_cast<unsigned>(ceil_div(O, 128)), 128, 0, s>>>(partial.as<float>(), nchunks, O,
                                                                                 static_cast<T*>(out.data));
  });
  HOT_CUDA_CHECK_LAUNCH();
}

void hadamard_transform(const TensorView& in, const TensorView& out, int block, int axis, Stream st) {
  DeviceGuard dg(in.device.index);
  dispatch_float(in.dtype, "hadamard_transform",
                 [&](auto t) { launch_hadamard<decltype(t)>(in, out, block, axis, to_cuda(st)); });
}

void hla_project(const TensorView& in, const TensorView& out, int rank, Stream st) {
  DeviceGuard dg(in.device.index);
  const int64_t n = ceil_div(in.shape[0], 16) * in.shape[1];
  dispatch_float(in.dtype, "hla_project", [&](auto t) {
    using T = decltype(t);
    hla_kernel<T><<<grid_1d(n, kThreads), kThreads, 0, to_cuda(st)>>>(mat<const T>(in), mat<float>(out), rank);
  });
  HOT_CUDA_CHECK_LAUNCH();
}

// Scratch: keys, inverse scales and pre-scales: 12 bytes per row (token) or 12 bytes (tensor).
void quantize(const TensorView& in, const TensorView& q, const TensorView& scale, const QuantizeParams& p,
              Stream st) {
  const int dev = in.device.index;
  DeviceGuard dg(dev);
  const cudaStream_t s = to_cuda(st);
  const int64_t R = in.shape[0];
  const bool per_row = p.scale == ScaleMode::token;
  const int64_t ns = per_row ? R : 1;
  const int qmax = qmax_for_bits(p.bits);
  Scratch scratch(static_cast<size_t>(ns) * 12, dev, st);
  unsigned* keys = scratch.as<unsigned>();
  float* inv = reinterpret_cast<float*>(keys + ns);
  float* pre = inv + ns;
  dispatch_float(in.dtype, "quantize", [&](auto t) {
    using T = decltype(t);
    const Mat<const T> mi = mat<const T>(in);
    if (per_row) {
      amax_row_kernel<T><<<static_cast<unsigned>(R), kThreads, 0, s>>>(mi, keys);
    } else {
      HOT_CUDA_CHECK(cudaMemsetAsync(keys, 0, sizeof(unsigned), s));
      amax_tensor_kernel<T><<<grid_1d(in.numel(), kThreads, 1024), kThreads, 0, s>>>(mi, keys);
    }
    HOT_CUDA_CHECK_LAUNCH();
    finalize_scales_kernel<<<grid_1d(ns, kThreads), kThreads, 0, s>>>(keys, ns, qmax, static_cast<float*>(scale.data),
                                                                      inv, pre);
    HOT_CUDA_CHECK_LAUNCH();
    quantize_kernel<T><<<grid_1d(ceil_div(in.numel(), kSrGroup), kThreads), kThreads, 0, s>>>(
        mi, mat<int8_t>(q), inv, pre, per_row, qmax, p.rounding == Rounding::stochastic, p.seed, p.rng_stream);
    HOT_CUDA_CHECK_LAUNCH();
  });
}

void dequantize(const TensorView& q, const TensorView& scale, const TensorView& out, Stream st) {
  DeviceGuard dg(q.device.index);
  const bool per_row = !(scale.shape[0] == 1 && q.shape[0] != 1);
  dispatch_float(out.dtype, "dequantize", [&](auto t) {
    using T = decltype(t);
    dequantize_kernel<T><<<grid_1d(q.numel(), kThreads), kThreads, 0, to_cuda(st)>>>(
        mat<const int8_t>(q), static_cast<const float*>(scale.data), per_row, mat<T>(out));
  });
  HOT_CUDA_CHECK_LAUNCH();
}

void pack_int4(const TensorView& q, const TensorView& packed, Stream st) {
  DeviceGuard dg(q.device.index);
  pack_int4_kernel<<<grid_1d(q.numel() / 2, kThreads), kThreads, 0, to_cuda(st)>>>(
      mat<const int8_t>(q), static_cast<uint8_t*>(packed.data), packed.strides[0] / 2);
  HOT_CUDA_CHECK_LAUNCH();
}

void unpack_int4(const TensorView& packed, const TensorView& q, Stream st) {
  DeviceGuard dg(q.device.index);
  unpack_int4_kernel<<<grid_1d(q.numel() / 2, kThreads), kThreads, 0, to_cuda(st)>>>(
      static_cast<const uint8_t*>(packed.data), packed.strides[0] / 2, mat<int8_t>(q));
  HOT_CUDA_CHECK_LAUNCH();
}

}  // namespace hot::cuda
