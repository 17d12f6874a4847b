// g_x of a stride-1 convolution straight from the int8 codes of G~ (SPEC §8, "g_x of a k x k convolution"): the
// transposed convolution of the quantised g_y map (NHWC, channels O_pad) with W~, run as a CUTLASS 2.x int8
// implicit-GEMM forward convolution (mma.sync, sm_80 and later, Hopper included) over the flipped W~, whose epilogue
// scales the exact int32 sums once and writes g_x in its dtype. No columns, no col2im.
#include <limits>

#include <cutlass/conv/conv2d_problem_size.h>
#include <cutlass/conv/device/implicit_gemm_convolution.h>
#include <cutlass/conv/kernel/default_conv2d_fprop.h>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/numeric_types.h>

#include "common.cuh"

namespace hot::cuda {

namespace {

template <typename Out>
struct ConvGx {
  static constexpr int kAlignOut = 128 / cutlass::sizeof_bits<Out>::value;
  using Epilogue = cutlass::epilogue::thread::LinearCombination<Out, kAlignOut, int32_t, float,
                                                                cutlass::epilogue::thread::ScaleType::OnlyAlphaScaling>;
  using Kernel = typename cutlass::conv::kernel::DefaultConv2dFprop<
      int8_t, cutlass::layout::TensorNHWC, int8_t, cutlass::layout::TensorNHWC, Out, cutlass::layout::TensorNHWC,
      int32_t, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80, cutlass::gemm::GemmShape<128, 64, 64>,
      cutlass::gemm::GemmShape<64, 32, 64>, cutlass::gemm::GemmShape<16, 8, 32>, Epilogue,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>, 4, cutlass::arch::OpMultiplyAddSaturate,
      cutlass::conv::IteratorAlgorithm::kOptimized>::Kernel;
  using Conv = cutlass::conv::device::ImplicitGemmConvolution<Kernel>;
};

// The fprop problem of g_x: input = the G~ map (N, Ho, Wo, O_pad), filter (C, kh, kw, O_pad), output (N, H, W, C),
// padding dilation * (k - 1) - padding, stride 1.
cutlass::conv::Conv2dProblemSize problem(const ConvGeometry& g, int64_t o_pad) {
  const int ph = g.dh * (g.kh - 1) - g.ph, pw = g.dw * (g.kw - 1) - g.pw;
  return cutlass::conv::Conv2dProblemSize(
      {static_cast<int>(g.N), static_cast<int>(g.out_h()), static_cast<int>(g.out_w()), static_cast<int>(o_pad)},
      {static_cast<int>(g.C), g.kh, g.kw, static_cast<int>(o_pad)}, {ph, ph, pw, pw}, {1, 1}, {g.dh, g.dw},
      {static_cast<int>(g.N), static_cast<int>(g.H), static_cast<int>(g.W), static_cast<int>(g.C)},
      cutlass::conv::Mode::kCrossCorrelation, 1);
}

// filt[c][i][j][:] = q_wt[((kh-1-i) kw + (kw-1-j)) C + c][:], rows of o_pad bytes (a multiple of 16) as 16-byte units;
// thread 0 also writes alpha = (s_g * s_w) * factor, the one scale of every sum (as gemm_s8_dequant's (sa * sb) *
// factor).
__global__ void conv_setup_kernel(const int8_t* __restrict__ q_wt, int64_t ld, int8_t* __restrict__ filt, int64_t C,
                                  int kh, int kw, int64_t o_pad, const float* s_g, const float* s_w, float factor,
                                  float* alpha) {
  const int64_t units = o_pad / 16, n = C * kh * kw * units;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (first == 0) *alpha = __fmul_rn(__fmul_rn(*s_g, *s_w), factor);
  for (int64_t e = first; e < n; e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t u = e % units, row = e / units;  // row = (c, i, j)
    const int j = static_cast<int>(row % kw), i = static_cast<int>(row / kw % kh);
    const int64_t c = row / (static_cast<int64_t>(kh) * kw);
    const int64_t src = ((static_cast<int64_t>(kh - 1 - i) * kw + (kw - 1 - j)) * C + c) * ld;
    reinterpret_cast<uint4*>(filt + row * o_pad)[u] = reinterpret_cast<const uint4*>(q_wt + src)[u];
  }
}

template <typename Out>
typename ConvGx<Out>::Conv::Arguments arguments(const TensorView& q_g, const int8_t* filt, const ConvGeometry& g,
                                                int64_t o_pad, const TensorView& out, const float* alpha) {
  using Conv = typename ConvGx<Out>::Conv;
  const cutlass::conv::Conv2dProblemSize p = problem(g, o_pad);
  using Layout = cutlass::layout::TensorNHWC;
  const cutlass::TensorRef<int8_t, Layout> a(static_cast<int8_t*>(q_g.data), Layout::packed(p.activation_extent()));
  const cutlass::TensorRef<int8_t, Layout> b(const_cast<int8_t*>(filt), Layout::packed(p.filter_extent()));
  const cutlass::TensorRef<Out, Layout> d(static_cast<Out*>(out.data), Layout::packed(p.output_extent()));
  return typename Conv::Arguments{p, a, b, d, d, typename ConvGx<Out>::Epilogue::Params(alpha, nullptr)};
}

template <typename F>
bool dispatch_out(DType dt, F&& f) {
  switch (dt) {
    case DType::f32: return f(float{});
    case DType::f16: return f(cutlass::half_t{});
    case DType::bf16: return f(cutlass::bfloat16_t{});
    default: return false;
  }
}

bool int_sized(const ConvGeometry& g, int64_t o_pad) {
  const int64_t lim = std::numeric_limits<int>::max();
  return g.N <= lim && g.C <= lim && g.H <= lim && g.W <= lim && o_pad <= lim && g.N * g.H * g.W * g.C <= lim &&
         g.N * g.out_h() * g.out_w() * o_pad <= lim;
}

// The same sums element by element, where the CUTLASS kernel does not run (before sm_80, a strided g_x map, sizes
// past int): one thread per element of g_x, the int32 sum in (i, j, o) order (exact in any order), the same scaling.
template <typename T>
__global__ void conv_grad_input_generic_kernel(const int8_t* __restrict__ qg, int64_t ldg, const int8_t* __restrict__ qw,
                                               int64_t ldw, int64_t o_pad, ConvGeometry g, int64_t Ho, int64_t Wo,
                                               const float* alpha, T* out, int64_t ldo) {
  const int64_t n_el = g.N * g.H * g.W * g.C;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n_el;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = e % g.C, r = e / g.C, x = r % g.W, h = r / g.W % g.H, n = r / (g.W * g.H);
    int32_t acc = 0;
    for (int i = 0; i < g.kh; ++i) {
      const int64_t ho = h + g.ph - static_cast<int64_t>(i) * g.dh;
      if (ho < 0 || ho >= Ho) continue;
      for (int j = 0; j < g.kw; ++j) {
        const int64_t wo = x + g.pw - static_cast<int64_t>(j) * g.dw;
        if (wo < 0 || wo >= Wo) continue;
        const int8_t* a = qg + ((n * Ho + ho) * Wo + wo) * ldg;
        const int8_t* b = qw + ((static_cast<int64_t>(i) * g.kw + j) * g.C + c) * ldw;
        for (int64_t o = 0; o < o_pad; ++o) acc += static_cast<int32_t>(a[o]) * static_cast<int32_t>(b[o]);
      }
    }
    store_f(out + r * ldo + c, __fmul_rn(static_cast<float>(acc), *alpha));
  }
}

}  // namespace

void conv_grad_input(const TensorView& q_g, const TensorView& q_wt, const TensorView& s_g, const TensorView& s_w,
                     float factor, const ConvGeometry& g, const TensorView& out, Stream st) {
  const int dev = q_g.device.index;
  DeviceGuard dg(dev);
  const cudaStream_t s = to_cuda(st);
  const int64_t o_pad = q_g.shape[1];
  Scratch scratch(static_cast<size_t>(g.C * g.kh * g.kw * o_pad) + 16, dev, st);
  int8_t* filt = static_cast<int8_t*>(scratch.get());
  float* alpha = reinterpret_cast<float*>(filt + g.C * g.kh * g.kw * o_pad);
  const int64_t units = g.C * g.kh * g.kw * (o_pad / 16);
  conv_setup_kernel<<<grid_1d(units, 256), 256, 0, s>>>(static_cast<const int8_t*>(q_wt.data), q_wt.strides[0], filt,
                                                        g.C, g.kh, g.kw, o_pad, static_cast<const float*>(s_g.data),
                                                        static_cast<const float*>(s_w.data), factor, alpha);
  HOT_CUDA_CHECK_LAUNCH();
  const bool packed = out.strides[0] == g.C && reinterpret_cast<uintptr_t>(out.data) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(q_g.data) % 16 == 0 && q_g.strides[0] == o_pad;
  const bool ran = packed && compute_capability(dev) >= 80 && int_sized(g, o_pad) &&
                   dispatch_out(out.dtype, [&](auto t) {
    using Out = decltype(t);
    using Conv = typename ConvGx<Out>::Conv;
    if (g.C % ConvGx<Out>::kAlignOut != 0) return false;
    const typename Conv::Arguments args = arguments<Out>(q_g, filt, g, o_pad, out, alpha);
    Conv conv;
    if (conv.can_implement(args) != cutlass::Status::kSuccess) return false;
    Scratch ws(conv.get_workspace_size(args), dev, st);
    cutlass::Status status = conv.initialize(args, ws.get(), s);
    HOT_CHECK(status == cutlass::Status::kSuccess, internal, "CUTLASS int8 conv (g_x) initialize failed: ",
              cutlass::cutlassGetStatusString(status));
    clear_stale_error();  // CUTLASS reads cudaGetLastError after its launch
    status = conv(s);
    HOT_CHECK(status == cutlass::Status::kSuccess, internal, "CUTLASS int8 conv (g_x) failed: ",
              cutlass::cutlassGetStatusString(status));
    HOT_CUDA_CHECK_LAUNCH();
    return true;
  });
  if (ran) return;
  dispatch_float(out.dtype, "conv_grad_input", [&](auto t) {
    using T = decltype(t);
    conv_grad_input_generic_kernel<T><<<grid_1d(g.N * g.H * g.W * g.C, 256), 256, 0, s>>>(
        static_cast<const int8_t*>(q_g.data), q_g.strides[0], static_cast<const int8_t*>(q_wt.data), q_wt.strides[0],
        o_pad, g, g.out_h(), g.out_w(), alpha, static_cast<T*>(out.data), out.strides[0]);
  });
  HOT_CUDA_CHECK_LAUNCH();
}

}  // namespace hot::cuda
