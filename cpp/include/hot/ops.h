// Public operations of the hot engine. Every function validates its arguments (throwing hot::Error
// that names the argument, what was expected and what was given), then runs on the backend of the
// device its tensors live on, on the given stream. Outputs are caller-allocated views unless the
// function returns a Tensor.
//
// Conventions: 2-D operands are row-major with unit column stride (any row stride >= the number of
// columns); float inputs may be f32, f16 or bf16 and are computed in fp32; integer GEMMs contract
// over the innermost dimension of both operands (C = A B^T, "TN", K-major as integer wgmma wants).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "hot/config.h"
#include "hot/tensor.h"

namespace hot {

// ---- building blocks -------------------------------------------------------------------------

// Block Hadamard transform without normalisation, output f32 of the input's shape.
// axis = 1 (rows): each row, in consecutive blocks of `block` columns, times H_block (x blockdiag(H)).
// axis = 0 (columns): each group of `block` consecutive rows mixed by H_block (blockdiag(H) x).
// block: a power of two in 1..256 that divides the transformed dimension.
void hadamard_transform(const TensorView& in, const TensorView& out, int block, int axis, Stream stream = {});

// Rows of the HLA projection of an L-row matrix at rank r: ceil(L/16) * r.
int64_t hla_rows(int64_t L, int rank);
// HLA projection (SPEC §4 step 1): in L x C (float), out hla_rows(L, rank) x C f32. Block j of the
// output holds, for k < rank, row kHlaOrder[k] of H_16 applied to rows 16j..16j+15 of `in` (rows past L
// count as zero).
void hla_project(const TensorView& in, const TensorView& out, int rank, Stream stream = {});

struct QuantizeParams {
  int bits = 8;                       // 4 or 8
  ScaleMode scale = ScaleMode::tensor;  // tensor: one scale; token: one per row
  Rounding rounding = Rounding::nearest;
  uint64_t seed = 0;                  // stochastic rounding only
  uint32_t rng_stream = 0;            // stochastic rounding only (see hot/rng.h)
};
// in: R x C float; q: R x C s8 (values in [-qmax, qmax]); scale: f32 of shape [1] (tensor) or [R] (token).
void quantize(const TensorView& in, const TensorView& q, const TensorView& scale, const QuantizeParams& p,
              Stream stream = {});
// The same with in's amax known (per-tensor scale only): amax f32 [1] holding max |in| as relu_mask gives it for its
// output (NaN where in has a NaN). It replaces the pass that finds it; the codes and scale are those of quantize
// without it when it is in's amax (the caller's claim, not checked: checking would be the pass it saves).
void quantize(const TensorView& in, const TensorView& q, const TensorView& scale, const QuantizeParams& p,
              const TensorView& amax, Stream stream = {});
// q: R x C s8; scale: [1] or [R] f32; out: R x C float (any float dtype): out = q * scale.
void dequantize(const TensorView& q, const TensorView& scale, const TensorView& out, Stream stream = {});

// q: R x C s8 with values in [-8, 7] and C even; packed: R x C s4. Values outside [-8, 7] are an error
// on the CPU backend and are truncated to their low nibble on CUDA (documented, not checked there).
void pack_int4(const TensorView& q, const TensorView& packed, Stream stream = {});
void unpack_int4(const TensorView& packed, const TensorView& q, Stream stream = {});

// C (M x N s32) = A (M x K) B (N x K)^T, exact int32 accumulation. s8: any K; s4: K even.
void gemm_s8s8s32(const TensorView& a, const TensorView& b, const TensorView& c, Stream stream = {});
void gemm_s4s4s32(const TensorView& a, const TensorView& b, const TensorView& c, Stream stream = {});

// Geometry of a 2-D convolution over an (N, C, H, W) input with a kh x kw kernel (SPEC §8): strides, zero padding and
// dilation per side. The output map is Ho x Wo; the im2col matrix has N*Ho*Wo rows (n, ho, wo) in raster order, or
// with `patches` in 4 x 4 spatial patch order (n, ho / 4, wo / 4, ho % 4, wo % 4; Ho and Wo multiples of 4), and
// kh*kw*C columns (i, j, c): each kernel offset's channels contiguous (the weight as an (O, kh, kw, C) matrix).
struct ConvGeometry {
  int64_t N = 0, C = 0, H = 0, W = 0;
  int kh = 1, kw = 1, sh = 1, sw = 1, ph = 0, pw = 0, dh = 1, dw = 1;
  bool patches = false;
  int64_t out_h() const;  // Ho = (H + 2 ph - dh (kh - 1) - 1) / sh + 1
  int64_t out_w() const;
  // Whether two kernel offsets can land on one input pixel (stride < dilated kernel extent on a side).
  bool overlapping() const;
};
// col2im, the adjoint of im2col: out (N*H*W x C, row-major: the channels-last map, as im2col's `map`; any row stride
// >= C) = the columns of `cols` (N*Ho*Wo x kh*kw*C, float) summed onto the input pixels they were read from. Each
// pixel's contributions are added in fp32 in kernel-offset order (i, then j) starting from zero and rounded once to
// out's dtype (cols' dtype); where windows do not overlap a pixel takes its one contribution as it is. Deterministic:
// no atomics, the same bits on every backend.
void col2im(const TensorView& cols, const ConvGeometry& geometry, const TensorView& out, Stream stream = {});
// im2col: cols (N*Ho*Wo x kh*kw*C, row-major, rows in raster or patch order, columns (i, j, c)) = the pixels each
// output pixel's window reads from `map`, the input as a channels-last matrix (N*H*W x C: row (n, h, w), the channels
// contiguous; any row stride >= C), zeros where the window reaches into the padding. A copy: bit for bit on every
// backend. map and cols: one float dtype.
void im2col(const TensorView& map, const ConvGeometry& geometry, const TensorView& cols, Stream stream = {});

// Batched transpose: out[b][s][r] = in[b][r][s], bit for bit, for in (B, R, S) and out (B, S, R) of one 8-, 16- or
// 32-bit dtype, each with unit stride in its last dim (any strides in the others); in and out must not overlap. An
// NCHW map is (N, C, H*W): its channels-last rows are the transpose (N, H*W, C), and back.
void transpose(const TensorView& in, const TensorView& out, Stream stream = {});

// ReLU that records where its gradient is zero in one bit per element (SPEC §2, keep_less), one pass over x:
// y = x with its negative elements replaced by +0 (NaN and -0 pass unchanged, as torch's ReLU), and bit j of byte k
// of `bits` set where element 8k + j of y is <= 0 (x <= 0; a NaN's bit is clear), the last byte's unused bits zero.
// x, y: vectors of n elements of one float dtype (y may be x itself: the in-place ReLU); bits: ceil(n / 8) s8 bytes.
void relu_mask(const TensorView& x, const TensorView& y, const TensorView& bits, Stream stream = {});
// The same, also writing y's amax into amax (f32 [1]): max |y| over its n elements in amax_key order (NaN where y has a
// NaN), what quantize and activation_codes of y find (SPEC §8: the conv after a ReLU takes it instead of a pass).
void relu_mask(const TensorView& x, const TensorView& y, const TensorView& bits, const TensorView& amax,
               Stream stream = {});
// Its backward: g_x = +0 where the bit of the element is set, g_y elsewhere (the same selection as torch's
// threshold_backward of the output: a non-finite g_y at a zero output gives 0). g_y, g_x: n elements of one float
// dtype (g_x may be g_y itself); bits: relu_mask's.
void relu_mask_backward(const TensorView& g_y, const TensorView& bits, const TensorView& g_x, Stream stream = {});

// BatchNorm's statistics in training (SPEC §2, "BatchNorm's statistics"), for rows of a channels-last map x (R x C of
// one float dtype, R = N*H*W pixel rows, R >= 1; R >= 2 with running statistics): with K[c] = x[0][c] (the first row,
// a shift that keeps the sums' cancellation small on maps far from zero) and per element d = x - K (rounded), the sums
// a[c] of d and b[c] of d * d (the product rounded) in fp32 in batch_norm_backward_reduce's order (groups of
// kBnReduceRows rows, kBnReduceLanes interleaved lanes, the lanes pairwise, the groups in order). Then per channel in
// fp32: q = a / R, mean = K + q, M2 = b - a * q (set to +0 if negative), var = M2 / R, invstd = 1 / sqrt(var + eps)
// (+0 where var + eps == 0, as torch's), each step rounded. mean, invstd: f32 [C], written. running_mean and
// running_var (null: not tracked; f32 [C], updated in place, both or neither): r = momentum * s + (1 - momentum) * r
// with s = mean and the unbiased M2 / (R - 1), (1 - momentum) rounded once. eps >= 0, 0 <= momentum <= 1 (as floats).
void batch_norm_stats(const TensorView& x, const TensorView& mean, const TensorView& invstd, float eps,
                      const TensorView* running_mean = nullptr, const TensorView* running_var = nullptr,
                      float momentum = 0.1f, Stream stream = {});

// BatchNorm's output in training or evaluation (SPEC §2): y = fma(x - mean, s, bias) per element with s = weight *
// invstd (invstd without weight) and bias +0 when absent, x - mean and s rounded, the fused multiply-add rounded to
// fp32, then to y's dtype. x, y: R x C of one float dtype (y may be x itself, or overlaps nothing else); mean, invstd, weight,
// bias (null: absent): f32 [C].
void batch_norm_transform(const TensorView& x, const TensorView& mean, const TensorView& invstd,
                          const TensorView* weight, const TensorView* bias, const TensorView& y, Stream stream = {});

// BatchNorm's per-channel sums in training (SPEC §2), for rows of a channels-last map: sum_dy[c] = the sum of g_y and
// sum_dy_xmu[c] = the sum of g_y (x - mean[c]) over the rows, each in fp32 in this order (deterministic, the same bits
// on every backend): rows in groups of kBnReduceRows = 1024; in a group, lane k (0..31) adds rows k, k + 32, ... in
// order from +0 (per term g_y, and g_y * (x - mean) with the difference and the product each rounded); the 32 lanes
// then pairwise (for h = 16, 8, 4, 2, 1: v[k] += v[k + h] for k < h); the groups' sums added in group order from +0.
// grad_weight (null: not asked) = sum_dy_xmu * invstd, rounded once. g_y, x: R x C of one float dtype (R = N*H*W
// pixel rows); mean, invstd, sum_dy, sum_dy_xmu, grad_weight: f32 [C].
// With relu_bits (relu_mask's bits of the BatchNorm's output, one an element in g_y's row order: g_y's rows
// contiguous), g_y is the gradient of the ReLU after the BatchNorm and the sums are those of the ReLU's input gradient,
// relu_mask_backward's (g_y where the bit is clear, +0 where set), which g_relu receives (null: not asked; R x C of
// g_y's dtype, g_y itself or not overlapping it): the ReLU's backward and the BatchNorm's sums in one pass.
constexpr int64_t kBnReduceRows = 1024, kBnReduceLanes = 32;
void batch_norm_backward_reduce(const TensorView& g_y, const TensorView& x, const TensorView& mean,
                                const TensorView& invstd, const TensorView& sum_dy, const TensorView& sum_dy_xmu,
                                const TensorView* grad_weight, const TensorView* relu_bits = nullptr,
                                const TensorView* g_relu = nullptr, Stream stream = {});

// BatchNorm's input gradient in training (SPEC §2), for rows of a channels-last map, with the amax of its G~: the g_y
// of the convolution before the BatchNorm, whose g_y pass then needs no pass of its own to find that amax (SPEC §3).
// g_y, x, g_x: R x C of one float dtype (R = N*H*W pixel rows); mean, invstd, sum_dy, sum_dy_xmu
// (batch_norm_backward_reduce's, or torch's) and weight (null: affine=False): f32 [C]. In fp32 and this order (torch's
// CUDA kernels', so that from torch's sums g_x is theirs bit for bit): nf = 1 / R; per channel m_dy = sum_dy * nf,
// f1 = ((invstd * invstd) * sum_dy_xmu) * nf, f2 = weight * invstd (invstd without weight); per element
// g_x = fma(-(x - mean), f1, g_y - m_dy) * f2 (one fused multiply-add), rounded once to g_x's dtype. gt_amax (f32 [1])
// = max over rows and blocks of b = hq_block_size(C) channels of |blockdiag(H_b)| of the rounded g_x (SPEC §3's G~,
// the butterfly order of the CPU backend): bit for bit the amax quantize_grad_output's g_x path finds in that g_x.
void batch_norm_backward_input(const TensorView& g_y, const TensorView& x, const TensorView& mean,
                               const TensorView& invstd, const TensorView* weight, const TensorView& sum_dy,
                               const TensorView& sum_dy_xmu, const TensorView& g_x, const TensorView& gt_amax,
                               Stream stream = {});

// Max-pool that keeps, per output, the offset of its maximum inside the window (SPEC §2, keep_less) instead of the
// input and int64 positions. x: an (N, C, H, W) float map, y: (N, C, Ho, Wo) of x's dtype, off: (N, C, Ho, Wo) s8, all
// 4-D with any strides (NCHW or channels-last); geometry: N, C, H, W (x's shape), the window kh x kw, stride, padding
// and dilation (patches: false); Ho, Wo are y's (torch's floor or ceil output size). Window (oh, ow) scans its taps
// (i, j) in order from the first in-bounds one, skipping taps in the padding, and takes a tap whose value is larger
// than the maximum so far, or NaN (torch's max_pool2d: the first of equal maxima, the last NaN; a window of -inf
// takes its first in-bounds tap): y = that element, bit for bit, off = i * kw + j. kh * kw <= 128; every window must
// hold an in-bounds tap.
void max_pool2d_offsets(const TensorView& x, const ConvGeometry& geometry, const TensorView& y, const TensorView& off,
                        Stream stream = {});
// Its backward: g_x[n, c, h, w] = the sum of g_y over the outputs whose chosen tap is (h, w), added in fp32 in (oh, ow)
// order from zero and rounded once to g_x's dtype (0 where none chose it). g_y, off: (N, C, Ho, Wo), g_x: (N, C, H, W)
// of g_y's dtype, any strides; geometry and off as max_pool2d_offsets'. Deterministic, no atomics.
void max_pool2d_offsets_backward(const TensorView& g_y, const TensorView& off, const ConvGeometry& geometry,
                                 const TensorView& g_x, Stream stream = {});

// ---- the HOT layer operations ------------------------------------------------------------------

// ABC buffer of a layer input (SPEC §2): q = Q8(HLA(x)) round-to-nearest per tensor, stored transposed
// as I x K_pad int8 (K = hla_rows(L, rank), K_pad = K rounded up to a multiple of 16, zero padded),
// which is the K-major layout of the g_w GEMM, plus one f32 scale on the device.
struct SavedActivation {
  Tensor q;      // s8, I x K_pad
  Tensor scale;  // f32, [1]
  int64_t rows = 0;  // L, the number of rows of x
  int64_t cols = 0;  // I
  int rank = 8;
  // q holds x's own int8 codes, transposed (activation_codes, or im2col_t of a convolution's kept map; K_pad =
  // padded_k(L), zero past L),
  // and scale is their quantisation scale: no rotation along the rows, no second rounding. Then g_w comes from the
  // codes of G~ (SPEC §4, "g_w from G~'s codes"): rank 16, 8-bit g_x with a per-tensor scale only.
  bool codes = false;
  size_t nbytes() const { return q.nbytes() + scale.nbytes(); }
};
int64_t padded_k(int64_t k);  // round up to a multiple of 16
SavedActivation compress_activation(const TensorView& x, int rank, Stream stream = {});
// The same into caller-allocated buffers (e.g. a framework's allocator): q_t s8 I x K_pad, scale f32 [1].
void compress_activation(const TensorView& x, const TensorView& q_t, const TensorView& scale, int rank,
                         Stream stream = {});
// x's own codes (SPEC §2 "codes"), the g_w operand of a layer whose g_w comes from G~'s codes (SPEC §4): Q8(x) per
// tensor with round-to-nearest (the scale and codes of quantize(x, 8, tensor, nearest)), stored transposed as
// I x padded_k(L) int8, zero past L, and its scale f32 [1]; no rotation along the rows. A SavedActivation of rank 16
// with `codes` set.
SavedActivation activation_codes(const TensorView& x, Stream stream = {});
void activation_codes(const TensorView& x, const TensorView& q_t, const TensorView& scale, Stream stream = {});
// The same with x's amax known (f32 [1], as quantize's amax): no pass to find it.
SavedActivation activation_codes(const TensorView& x, const TensorView& amax, Stream stream = {});
void activation_codes(const TensorView& x, const TensorView& q_t, const TensorView& scale, const TensorView& amax,
                      Stream stream = {});
// The same for an input that the layer reads in another float dtype (autocast's cast of a float32 LayerNorm output to
// bfloat16): x_cast (float, L x I, row-major, not overlapping x) receives x rounded to x_cast's dtype (to nearest
// even), and q_t / scale are the ABC buffer of x_cast, bit for bit compress_activation(x_cast) after the cast. The CUDA
// backend forms both in one pass over x where the rows allow 16-byte loads (SPEC §2).
void compress_activation_cast(const TensorView& x, const TensorView& x_cast, const TensorView& q_t,
                              const TensorView& scale, int rank, Stream stream = {});

// The ABC buffer of a convolution's im2col columns, formed from its int8 feature map without the columns (SPEC §8):
// map s8 (N*H*W x C, channels-last: the integers Q of the layer's kept input; any row stride >= C); q_t s8
// (kh*kw*C) x K_pad with K = hla_rows(N*Ho*Wo, rank); scale f32 [1]. Equal bit for bit to compress_activation of
// im2col(Q) (rows in geometry's raster or patch order, Q's integers as floats): one scale over all rows.
void compress_columns(const TensorView& map, const ConvGeometry& geometry, const TensorView& q_t,
                      const TensorView& scale, int rank, Stream stream = {});

// The im2col columns of a convolution's int8 map, transposed (SPEC §8, the g_w operand of a convolution at full rank):
// cols_t s8 (kh*kw*C) x K with K >= L = N*Ho*Wo (any row stride >= K): cols_t[(i, j, c), l] = im2col(map)[l, (i, j, c)]
// for rows l in geometry's raster or patch order, zero for l >= L and where the window reaches into the padding. map:
// s8 N*H*W x C, channels-last (any row stride >= C). A copy: the same bytes on every backend.
void im2col_t(const TensorView& map, const ConvGeometry& geometry, const TensorView& cols_t, Stream stream = {});

// W~ of the g_x path (SPEC §3): W's rows mixed in blocks of hq_block_size(O) by the Hadamard matrix, quantised to
// gx_bits per tensor with round-to-nearest, stored K-major for the g_x GEMM: q_wt s8 I x padded_k(O), s_w f32 [1].
// Deterministic, so every backward_linear call with the same weight and gx_bits forms the same bytes; a caller whose
// weight does not change across several calls (micro-batches of one optimizer step, activation recomputation) forms
// it once with quantize_weight and passes it to backward_linear (`weight_q`) instead.
struct QuantizedWeight {
  Tensor q_wt;  // s8, I x padded_k(O)
  Tensor s_w;   // f32, [1]
  int64_t out_features = 0;  // O
  int64_t in_features = 0;   // I
  int gx_bits = 8;
  size_t nbytes() const { return q_wt.nbytes() + s_w.nbytes(); }
};
// weight: O x I float; gx_bits: 4 or 8 (config.gx_bits).
QuantizedWeight quantize_weight(const TensorView& weight, int gx_bits, Stream stream = {});

struct BackwardRequest {
  bool grad_input = true;
  bool grad_weight = true;
  bool grad_bias = false;
};

// Outputs of backward_linear: each is an undefined view (data == nullptr, empty shape) when not requested.
// grad_input: L x I, grad_weight: O x I, grad_bias: [O]; any float dtype each.
struct BackwardOutputs {
  TensorView grad_input;
  TensorView grad_weight;
  TensorView grad_bias;
};

// The stochastic-rounding seed of a backward (SPEC §5): `value`, plus, where `tensor` is given, the int64 held by that
// one-element tensor (dtype s64, on the call's device) when the call's kernels run, the sum taken mod 2^64. A seed in
// device memory is read by the kernels, not by the host: a CUDA graph that recorded the call, together with the
// kernel that wrote the seed (a random draw on the GPU), rounds with a new seed at every replay, and the host never
// waits for it. An integer converts to a Seed (no tensor).
struct Seed {
  uint64_t value = 0;
  TensorView tensor;  // empty (no data): none
  Seed() = default;
  Seed(uint64_t v) : value(v) {}  // NOLINT(google-explicit-constructor): a plain integer seed
  Seed(uint64_t v, const TensorView& t) : value(v), tensor(t) {}
};

// HOT backward of y = x W^T (+ b) (SPEC §3, §4). grad_output: L x O; weight: O x I; saved: the ABC buffer
// of x (needed for grad_weight). In exact mode use backward_linear_exact (or the raw-x overload below).
// One backward over all L rows, whatever L (SPEC §4, "Long contractions": the g_w contraction's integer sum is exact,
// int32 slices summed in int64, with one scale of each g_y operand and one seed per call).
// weight_q: W~ from quantize_weight(weight, config.gx_bits) when the caller keeps it (checked against weight's shape,
// device and config.gx_bits; its bytes are taken as they are), else nullptr and the call forms it.
// grad_output_amax: G~'s amax when the caller knows it (a pointwise convolution before a BatchNorm; see
// backward_conv2d), else nullptr.
void backward_linear(const TensorView& grad_output, const TensorView& weight, const SavedActivation* saved,
                     const Config& config, const Seed& seed, const BackwardOutputs& out, Stream stream = {},
                     const QuantizedWeight* weight_q = nullptr, const TensorView* grad_output_amax = nullptr);
// The same from the raw x (L x I float; read only when grad_weight is requested, else it may be an empty view):
// x is compressed as compress_activation(x, config.rank) would. With config.exact this is backward_linear_exact.
void backward_linear(const TensorView& grad_output, const TensorView& weight, const TensorView& x,
                     const Config& config, const Seed& seed, const BackwardOutputs& out, Stream stream = {},
                     const QuantizedWeight* weight_q = nullptr);

// HOT backward of a convolution over its im2col rows (SPEC §8): grad_output N*Ho*Wo x O (rows in geometry's raster
// or patch order), weight O x kh*kw*C (columns (i, j, c)), saved the ABC buffer of the columns (compress_columns) or,
// with saved->codes, the columns' codes (im2col_t) and the map's scale, whose g_w comes from G~'s codes (SPEC §4: rank
// 16, 8-bit per-tensor g_x, a float32 grad_weight; G~ is formed even without grad_input) (needed for grad_weight);
// out.grad_input is the channels-last map N*H*W x C. g_w and g_b are backward_linear's over the columns. g_x: at
// stride 1 (raster order, per-tensor g_x scale, padding <= dilation * (k - 1)) the transposed convolution of the int8
// codes of G~ with W~, one exact int32 sum over (i, j, o) per element scaled once by (s_g * s_w) / b and rounded once
// to grad_input's dtype. Otherwise the g_x GEMM writes the columns in grad_input's
// dtype and col2im adds them onto the map.
// grad_output_amax (f32 [1], optional): max |G~| of this grad_output (G~ = grad_output blockdiag(H_b), b =
// hq_block_size(O), in float32 in the CPU backend's butterfly order), as batch_norm_backward_input's gt_amax gives it
// when the convolution's output went through a BatchNorm. Where the g_y pass would find nothing else in its first pass
// over grad_output (a per-tensor g_x scale, g_w from the codes or not asked, no grad_bias) it is taken instead of
// that pass, else it is not read; the results are the same bits either way when it is G~'s amax.
void backward_conv2d(const TensorView& grad_output, const TensorView& weight, const SavedActivation* saved,
                     const ConvGeometry& geometry, const Config& config, const Seed& seed, const BackwardOutputs& out,
                     Stream stream = {}, const QuantizedWeight* weight_q = nullptr,
                     const TensorView* grad_output_amax = nullptr);

// Exact (unquantised) backward from the raw x (L x I): fp32 accumulation (cuBLAS on CUDA).
void backward_linear_exact(const TensorView& grad_output, const TensorView& weight, const TensorView* x,
                           const BackwardOutputs& out, Stream stream = {});

// Orders two streams of one device: work queued on `then` after this call starts only once the work queued on
// `first` before it is done (an event recorded on `first`, waited for by `then`; nothing blocks the host). No-op on
// the CPU and when both are the same stream. For memory shared between a producer and a consumer that run on
// different streams (the DLPack exchange).
void stream_order(Device device, Stream first, Stream then);

// ---- backends -------------------------------------------------------------------------------

bool cuda_available();             // CUDA backend compiled in and a device present
std::string cuda_unavailable_reason();  // why not ("" when available)
std::string build_info();          // one line per compiled backend / kernel family
void set_num_threads(int n);       // CPU backend threads (0 = hardware concurrency)
int get_num_threads();

}  // namespace hot
