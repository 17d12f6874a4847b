// Internal backend interface. ops.cpp validates every argument and then calls exactly one backend;
// backends may assume valid, consistent arguments (shapes, dtypes, one device, row-major 2-D views
// with unit column stride). The CPU backend is the reference: every CUDA function must give the same
// integer results (quantised values, int32 products) bit for bit for the same inputs and seed.
#pragma once

#include <cstdint>

#include "hot/config.h"
#include "hot/ops.h"
#include "hot/tensor.h"

namespace hot {

// The longest contraction whose int32 sum of 8-bit products (codes in -127..127, SPEC §5) is exact, as a multiple of
// 16: K * 127 * 127 < 2^31. Longer ones are summed in int64 from int32 slices of at most this length (SPEC §4).
constexpr int64_t kMaxInt32K = 133136;

// What the backward pass needs from g_y (L x O), produced in one pass where the backend can.
struct GradOutputPlan {
  bool gx = false;        // produce q_g / s_g for the g_x path
  int gx_bits = 4;
  int block = 16;         // Hadamard block b of the g_x path (hq_block_size(O))
  ScaleMode gx_scale = ScaleMode::tensor;
  bool gw = false;        // produce q_gh_t / s_gh for the g_w path
  int rank = 8;
  Rounding rounding = Rounding::stochastic;
  uint64_t seed = 0;
  const uint64_t* seed_ptr = nullptr;  // a seed in the call's device memory (Seed::tensor): the seed is *seed_ptr + seed,
                                       // read by the backend when the work runs (on the GPU: by the kernels)
  bool bias = false;      // produce g_b
  bool codes = false;     // the g_w path's rows as they are (no H^, rank 16, round-to-nearest, no g_x, no g_b): x's
                          // own codes, transposed (activation_codes)
  // The amax key of the one path a plan quantises with one scale, when the caller knows it (in the call's device
  // memory, an f32 amax's bits): x's amax with codes (activation_codes' amax), or G~'s for the g_x path alone (no
  // G^, no g_b, a per-tensor scale: backward_conv2d's grad_output_amax). No pass to find it.
  const unsigned* amax_key = nullptr;
};

// Whether a plan may take a known amax (GradOutputPlan::amax_key): it quantises one path with one scale.
inline bool takes_known_amax(const GradOutputPlan& plan) {
  return plan.codes || (plan.gx && !plan.gw && !plan.bias && plan.gx_scale == ScaleMode::tensor);
}

struct GradOutputQuant {
  TensorView q_g;     // s8, L x O_pad (O_pad = padded_k(O)): Q(g_y blockdiag(H_b)), zero columns past O
  TensorView q_g_t;   // optional, with q_g and no q_gh_t: s8, O x padded_k(L), q_g's first O columns transposed, zero
                      // past L (the K-major operand of g_w from G~'s codes, SPEC §4)
  TensorView s_g;     // f32, [1] (tensor) or [L] (token)
  TensorView q_gh_t;  // s8, O x K_pad (K = hla_rows(L, rank)): Q8(blockdiag(H^) g_y) transposed, zero past K
  TensorView s_gh;    // f32, [1]
  TensorView g_b;     // float, [O]: sum over rows of g_y, fp32 accumulation
};

#define HOT_BACKEND_FUNCTIONS                                                                               \
  void hadamard_transform(const TensorView& in, const TensorView& out, int block, int axis, Stream s);     \
  void hla_project(const TensorView& in, const TensorView& out, int rank, Stream s);                       \
  /* amax: in's amax (f32 [1]) when the caller knows it, else null */                                       \
  void quantize(const TensorView& in, const TensorView& q, const TensorView& scale, const QuantizeParams& p, \
                const TensorView* amax, Stream s);                                                         \
  void dequantize(const TensorView& q, const TensorView& scale, const TensorView& out, Stream s);          \
  void pack_int4(const TensorView& q, const TensorView& packed, Stream s);                                 \
  void col2im(const TensorView& cols, const ConvGeometry& g, const TensorView& out, Stream s);              \
  void im2col(const TensorView& map, const ConvGeometry& g, const TensorView& cols, Stream s);              \
  void im2col_t(const TensorView& map, const ConvGeometry& g, const TensorView& cols_t, Stream s);         \
  void transpose(const TensorView& in, const TensorView& out, Stream s);                                   \
  void relu_mask(const TensorView& x, const TensorView& y, const TensorView& bits, const TensorView* amax,  \
                 Stream s);                                                                                \
  void relu_mask_backward(const TensorView& gy, const TensorView& bits, const TensorView& gx, Stream s);   \
  void batch_norm_stats(const TensorView& x, const TensorView& mean, const TensorView& invstd, float eps,  \
                        const TensorView* running_mean, const TensorView* running_var, float momentum,     \
                        Stream s);                                                                         \
  void batch_norm_transform(const TensorView& x, const TensorView& mean, const TensorView& invstd,         \
                            const TensorView* weight, const TensorView* bias, const TensorView& y,         \
                            Stream s);                                                                     \
  void batch_norm_backward_reduce(const TensorView& gy, const TensorView& x, const TensorView& mean,         \
                                  const TensorView& invstd, const TensorView& sum_dy,                      \
                                  const TensorView& sum_dy_xmu, const TensorView* grad_weight,             \
                                  const TensorView* relu_bits, const TensorView* g_relu, Stream s);        \
  void batch_norm_backward_input(const TensorView& gy, const TensorView& x, const TensorView& mean,          \
                                 const TensorView& invstd, const TensorView* weight, const TensorView& sum_dy, \
                                 const TensorView& sum_dy_xmu, const TensorView& gx, const TensorView& amax, \
                                 Stream s);                                                                \
  void max_pool2d_offsets(const TensorView& x, const ConvGeometry& g, const TensorView& y, const TensorView& off, \
                          Stream s);                                                                       \
  void max_pool2d_offsets_backward(const TensorView& gy, const TensorView& off, const ConvGeometry& g,     \
                                   const TensorView& gx, Stream s);                                        \
  void unpack_int4(const TensorView& packed, const TensorView& q, Stream s);                               \
  void gemm_s8s8s32(const TensorView& a, const TensorView& b, const TensorView& c, Stream s);              \
  void gemm_s4s4s32(const TensorView& a, const TensorView& b, const TensorView& c, Stream s);              \
  /* ABC: q_t is I x K_pad s8 (zero past K), scale [1] f32 */                                              \
  void compress_activation(const TensorView& x, const TensorView& q_t, const TensorView& scale, int rank,   \
                           Stream s);                                                                      \
  /* x's own codes (per-tensor round-to-nearest), transposed: q_t is I x padded_k(L) s8 (zero past L) */   \
  void activation_codes(const TensorView& x, const TensorView& q_t, const TensorView& scale,                \
                        const TensorView* amax, Stream s);                                                 \
  /* x rounded to x_cast's dtype into x_cast, and the ABC buffer of x_cast */                               \
  void compress_activation_cast(const TensorView& x, const TensorView& x_cast, const TensorView& q_t,       \
                                const TensorView& scale, int rank, Stream s);                              \
  void compress_columns(const TensorView& map, const ConvGeometry& g, const TensorView& q_t,                \
                        const TensorView& scale, int rank, Stream s);                                      \
  void quantize_grad_output(const TensorView& gy, const GradOutputPlan& plan, const GradOutputQuant& out,   \
                            Stream s);                                                                     \
  /* W~ = blockdiag(H_b) W quantised to `bits` round-to-nearest per tensor, written transposed: q_wt is  \
     I x O_pad s8 (zero past O), s_w [1] f32 */                                                            \
  void quantize_weight(const TensorView& w, const TensorView& q_wt, const TensorView& s_w, int bits,      \
                       int block, Stream s);                                                               \
  /* out (M x N, float) = (a (M x K s8) b (N x K s8)^T) * sa[m or 0] * sb[0] * factor, the integer sum   \
     exact for any K (int64 past kMaxInt32K); `bits` (4 or 8) says the operands hold 4-bit values, so a     \
     backend may run an s4 GEMM */                                                                        \
  void gemm_s8_dequant(const TensorView& a, const TensorView& b, const TensorView& sa, const TensorView& sb, \
                       float factor, int bits, const TensorView& out, Stream s);                           \
  /* g_x of a stride-1 convolution from the codes of G~ (SPEC §8): out (N*H*W x C, float, the channels-last  \
     map, any row stride) = ((s_g * s_w) * factor) * sum over (i, j, o) of q_g[(n, h + ph - i dh, w + pw - j dw), \
     o] q_wt[(i, j, c), o] (int32, exact); q_g: N*Ho*Wo x O_pad s8, q_wt: kh*kw*C x O_pad s8 */            \
  void conv_grad_input(const TensorView& q_g, const TensorView& q_wt, const TensorView& s_g,                \
                       const TensorView& s_w, float factor, const ConvGeometry& g, const TensorView& out,  \
                       Stream s);                                                                          \
  /* out (O, float) = sum over rows of gy (L x O), fp32 accumulation */                                    \
  void bias_grad(const TensorView& gy, const TensorView& out, Stream s);                                   \
  /* out = op(a) op(b), float operands of one dtype, fp32 accumulation; op = transpose when flag set */    \
  void matmul_exact(const TensorView& a, bool trans_a, const TensorView& b, bool trans_b,                  \
                    const TensorView& out, Stream s);

namespace cpu {
HOT_BACKEND_FUNCTIONS
}  // namespace cpu

namespace cuda {
HOT_BACKEND_FUNCTIONS
bool available();
std::string unavailable_reason();
std::string build_info();
// Allocation used by Tensor::empty for CUDA devices (stream-ordered).
void* allocate(size_t bytes, int device, Stream s);
void deallocate(void* p, int device, Stream s);
void memset_zero(void* p, size_t bytes, int device, Stream s);
void stream_order(int device, Stream first, Stream then);
// Internal (benchmark, tests): whether calls of rank 8 or 16 run the kernels compiled for that rank (the default) or
// the run-time-rank ones (qgo_kernels.cuh); returns the previous setting. Process-wide; identical bytes either way.
bool set_qgo_fixed_rank(bool on);
}  // namespace cuda

}  // namespace hot
