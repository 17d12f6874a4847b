// CUTLASS 3.x warp-specialised wgmma GEMM for sm_90a: C[M,N] = A[M,K] B[N,K]^T with s8 operands
// (both K-major, "TN"), s32 accumulation, and an epilogue visitor tree that either stores the s32
// accumulators (gemm_s8s8s32) or dequantises them in registers:
//     D = cast<ElementD>(float(acc) * ((sa[m or 0] * sb[0]) * factor))
// (fp32 multiplications in this order, round to nearest; the CPU backend uses the same order).
// The main configuration: 128x256x128 tile, cooperative schedule with the stream-K tile scheduler, which splits K
// when there are too few output tiles to fill the GPU (the g_w GEMM: M = O, N = I, K = L/2), in clusters of 2x1
// (a pair of M tiles shares B's loads through TMA multicast) or, where M fits one tile (M <= 128: a conv's g_w GEMM
// with O = 64 or 128), of 1x1: a pair would leave one CTA of each cluster without an M tile. Integer partial sums are
// exact in any order, so stream-K is bit-exact. Problems of very few output tiles take a split-K route instead
// (split_k_slices; gemm_s32_sm90.cu): the K slices as a batch of GEMMs into s32 partials, then one summing pass.
// Dequantising GEMMs of a short K over many tiles (a g_x GEMM of a layer with few output features) run a ping-pong
// configuration instead (use_pingpong).
// Included only by *_sm90.cu files, which CMake compiles only for sm_90a.
#pragma once

#include <algorithm>
#include <mutex>
#include <vector>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/epilogue/thread/activation.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

#include "common.cuh"

namespace hot::cuda::sm90 {

using namespace cute;
namespace fu = cutlass::epilogue::fusion;

using TileShape = cute::Shape<_128, _256, _128>;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

// Dequantising epilogue tree: acc * ((sa[m] * sb) * factor), cast to ElementD (the CPU backend forms
// alpha = (sa * sb) * factor per row and multiplies the converted accumulator by it).
template <typename ElementD, typename Tile = TileShape>
using DequantEVT = fu::Sm90EVT<
    fu::Sm90Compute<cutlass::multiplies, ElementD, float, kRound>, fu::Sm90AccFetch,
    fu::Sm90EVT<fu::Sm90Compute<cutlass::multiplies, float, float, kRound>,
                fu::Sm90EVT<fu::Sm90Compute<cutlass::multiplies, float, float, kRound>,
                            fu::Sm90ColBroadcast<0, Tile, float, float, cute::Stride<bool, _0, int64_t>>,
                            fu::Sm90ScalarBroadcast<float>>,
                fu::Sm90ScalarBroadcast<float>>>;

// Plain s32 store of the accumulators.
using StoreEVT = fu::Sm90EVT<fu::Sm90Compute<cutlass::epilogue::thread::Identity, int32_t, int32_t, kRound>,
                             fu::Sm90AccFetch>;

// A kernel configuration: the tile, the main loop's and the epilogue's schedules and the tile scheduler, around the
// s8 x s8 -> s32 wgmma main loop and the epilogue tree EVT writing ElementD.
template <typename ElementD, typename EVT, int kClusterM, typename Tile, typename MainloopSchedule,
          typename EpilogueSchedule, typename TileScheduler>
struct GemmKernelConfig {
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, _1, _1>;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, int32_t, float, void, cutlass::layout::RowMajor, kAlignD,
      ElementD, cutlass::layout::RowMajor, kAlignD, EpilogueSchedule, EVT>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, int8_t, cutlass::layout::RowMajor, 16, int8_t,
      cutlass::layout::ColumnMajor, 16, int32_t, Tile, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue, TileScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// The main configuration (see the top of this file).
template <typename ElementD, typename EVT, int kClusterM>
using GemmConfig =
    GemmKernelConfig<ElementD, EVT, kClusterM, TileShape, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                     cutlass::epilogue::TmaWarpSpecializedCooperative, cutlass::gemm::StreamKScheduler>;

// The second configuration, for short contractions with many output tiles (use_pingpong): ping-pong 64 x 256 tiles,
// the persistent scheduler, 2x1 clusters. Its two consumer warpgroups work on different output tiles, so one's epilogue
// runs under the other's main loop; with K <= 1024 (8 k-tiles or fewer) the cooperative kernel's epilogue, which both
// of its warpgroups wait for, is a large share of each tile. Same integer sums and the same epilogue arithmetic, so the
// same bits (H100, 2026-11-27: ViT-B fc2's g_x GEMM, 25216 x 3072 x 768, 119.5 -> 101.6 us; with K >= 2304 no better,
// and 8192^3 25 % slower: benchmarks/NOTES.md).
// Outputs of at most 128 columns (a pointwise conv's g_x with C = 64 or 128 input channels) take 64 x 128 tiles,
// which a 64 x 256 tile would leave a half or three quarters empty (measured in benchmarks/NOTES.md).
using TileShapePP = cute::Shape<_64, _256, _128>;
using TileShapePPNarrow = cute::Shape<_64, _128, _128>;
template <typename ElementD, typename EVT, int kClusterM, typename Tile = TileShapePP>
using GemmConfigPP =
    GemmKernelConfig<ElementD, EVT, kClusterM, Tile, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                     cutlass::epilogue::TmaWarpSpecialized, cutlass::gemm::PersistentScheduler>;

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Output tiles of an M x N problem.
inline int64_t gemm_tiles(int64_t M, int64_t N) {
  constexpr int64_t tm = size<0>(TileShape{}), tn = size<1>(TileShape{});
  return ((M + tm - 1) / tm) * ((N + tn - 1) / tn);
}

// Whether the stream-K schedule is forced on a problem of `tiles` output tiles (over `batches` problems) of k_tiles
// k-tiles each: with at most half a wave of tiles every tile gets the K shares of two or more SMs; with more, where the
// SMs a data-parallel schedule leaves idle in its last wave hold at least 48 k-tiles' worth of time. Stream-K's
// fix-up of the shared tiles cost about 30 k-tiles' time on an H100 (ViT-B fc1's g_w GEMM, 72 tiles of 197 k-tiles:
// 123 -> 86 us; ResNet-50 layer4.conv2's at batch 64, 72 tiles of 25: 25 -> 28 us; benchmarks/NOTES.md). CUTLASS's
// own heuristic keeps a last wave that is half full or more data-parallel. A batch (the split-K route) sized its
// slices to one wave already.
inline bool force_stream_k(int64_t tiles, int64_t k_tiles, int sm_count, int batches) {
  if (k_tiles < 16) return false;
  if (2 * tiles <= sm_count) return true;
  const int64_t slots = (tiles + sm_count - 1) / sm_count * sm_count;  // CTA slots of the data-parallel waves
  return batches == 1 && (slots - tiles) * k_tiles >= 48 * slots;
}

// Whether a dequantising GEMM runs the ping-pong configuration: a short contraction over at least two waves of
// 128 x 256 tiles (fewer take stream-K, which the cooperative kernel's scheduler provides), M past one tile (its 2x1
// clusters pair M tiles).
inline bool use_pingpong(int64_t M, int64_t N, int64_t K, int sm_count) {
  return K <= 1024 && M > 128 && gemm_tiles(M, N) >= 2 * static_cast<int64_t>(sm_count);
}

// Whether a tile scheduler's arguments choose a decomposition (stream-K's do; the persistent scheduler's do not).
template <typename T, typename = void>
struct has_decomposition : std::false_type {};
template <typename T>
struct has_decomposition<T, std::void_t<decltype(std::declval<T&>().decomposition_mode)>> : std::true_type {};

// The K slices of the split-K route for an M x N x K problem on sm_count SMs, or 1 (no split), or 0 (K needs slices
// and none fit). When the output has so few tiles that stream-K would give each tile 8 or more peers (a conv's g_w
// GEMM: M = O, N = C k^2, K = the pixels), the peers' fix-up of a shared 128 x 256 int32 tile dominated
// (benchmarks/NOTES.md); instead the K slices run as a batch of independent GEMMs in one wave, each writing its own s32
// partial, and one pass sums them. The slices are equal (a batch has one K): K / 16 = q is split into S slices of
// m = q / S units of 16, m a divisor of q of at least 32 (4 k-tiles), S as large as one wave allows; no such divisor
// with S >= max(2, wave / 2): no split. A K past kMaxInt32K needs slices whose int32 sums are exact (the pass adds them
// in int64): at least ceil(K / kMaxInt32K) of them, the fewest such equal slices (of at least 32 units) where the
// wave's choice has fewer; 0 where K / 16 has no such divisor (gemm.cu then runs K pieces).
inline int split_k_slices(int64_t M, int64_t N, int64_t K, int sm_count) {
  if (K % 16 != 0) return K > kMaxInt32K ? 0 : 1;
  const int64_t tiles = gemm_tiles(M, N), q = K / 16, need = (K + kMaxInt32K - 1) / kMaxInt32K;
  const int64_t wave = 8 * tiles <= sm_count ? sm_count / tiles : 0;  // 0: enough tiles, no split for the wave
  int64_t best = 1, fewest = 0;  // the wave's choice; the fewest slices a long K needs
  for (int64_t d = 1; d * d <= q; ++d) {
    if (q % d != 0) continue;
    for (const int64_t S : {d, q / d}) {  // S slices of m = q / S units
      if (q / S < 32) continue;
      if (S <= wave && S > best) best = S;
      if (S >= need && (fewest == 0 || S < fewest)) fewest = S;
    }
  }
  if (best < 2 || 2 * best < wave) best = 1;
  return static_cast<int>(best >= need ? best : fewest);
}

// The dynamic shared memory a GEMM kernel needs beyond 48 KB, granted once per device (the current one, which the
// caller's DeviceGuard set). CUTLASS's GemmUniversalAdapter::initialize() sets it on every call: one more CUDA API
// call of host time per GEMM, twice per layer backward.
template <typename Kernel>
void set_gemm_smem(int device) {
  constexpr int smem = Kernel::SharedStorageSize;
  if constexpr (smem >= (48 << 10)) {
    static std::mutex m;
    static std::vector<char> done;  // per device index
    const std::lock_guard<std::mutex> lock(m);
    if (static_cast<size_t>(device) >= done.size()) done.resize(static_cast<size_t>(device) + 1, 0);
    if (done[static_cast<size_t>(device)]) return;
    HOT_CUDA_CHECK(cudaFuncSetAttribute(cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        smem));
    done[static_cast<size_t>(device)] = 1;
  }
}

// Runs one GEMM; `make_fusion_args` builds the epilogue tree's arguments. Returns false when the
// problem does not meet the kernel's requirements (alignment), before launching anything.
// A batch of `batches` problems (batches > 1: the split-K route, see gemm_s32_sm90.cu) steps A, B and D by
// batch_a, batch_b and batch_d elements.
template <typename Cfg, typename FusionArgs>
bool run_gemm(const int8_t* a, int64_t lda, const int8_t* b, int64_t ldb, void* d, int64_t ldd, int M, int N, int K,
              const FusionArgs& fusion, int device, cudaStream_t stream, int batches = 1, int64_t batch_a = 0,
              int64_t batch_b = 0, int64_t batch_d = 0) {
  using Gemm = typename Cfg::Gemm;
  using ElementD = typename Gemm::ElementD;
  if (K % 16 != 0 || lda % 16 != 0 || ldb % 16 != 0 || !aligned16(a) || !aligned16(b) || !aligned16(d) ||
      (ldd * static_cast<int64_t>(sizeof(ElementD))) % 16 != 0 || N % Cfg::kAlignD != 0)
    return false;
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideC = typename Gemm::GemmKernel::StrideC;
  using StrideD = typename Gemm::GemmKernel::StrideD;
  StrideA sA = make_stride(static_cast<int64_t>(lda), _1{}, batch_a);
  StrideB sB = make_stride(static_cast<int64_t>(ldb), _1{}, batch_b);
  StrideC sC = make_stride(static_cast<int64_t>(ldd), _1{}, batch_d);
  StrideD sD = make_stride(static_cast<int64_t>(ldd), _1{}, batch_d);

  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count(device);

  // Few output tiles for the SMs, with a long K (the g_w GEMM: M = O, N = I, K = L): stream-K, so that every SM takes
  // a share of K (force_stream_k). Fewer tiles still (split_k_slices > 1) take the split-K route before they get here.
  typename Gemm::GemmKernel::TileSchedulerArguments sched{};
  const int64_t tiles = gemm_tiles(M, N) * batches;
  const int64_t k_tiles = (K + size<2>(TileShape{}) - 1) / size<2>(TileShape{});
  if constexpr (has_decomposition<decltype(sched)>::value) {
    if (force_stream_k(tiles, k_tiles, hw.sm_count, batches)) {
      sched.decomposition_mode = decltype(sched.decomposition_mode)::StreamK;
      // int32 partial sums are exact in any order: no need to serialise the fix-up of the K slices.
      sched.reduction_mode = decltype(sched.reduction_mode)::Nondeterministic;
    }
  }
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {M, N, K, batches},
                                {a, sA, b, sB},
                                {fusion, nullptr, sC, static_cast<ElementD*>(d), sD},
                                hw,
                                sched};
  using Kernel = typename Gemm::GemmKernel;
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return false;
  const size_t ws_bytes = Gemm::get_workspace_size(args);
  Scratch ws(ws_bytes, device, Stream{stream});  // none (no pool call) for a data-parallel schedule
  // The adapter's initialize() without its per-call cudaFuncSetAttribute (set_gemm_smem: once per device).
  cutlass::Status st = Kernel::initialize_workspace(args, ws.get(), stream, nullptr);
  HOT_CHECK(st == cutlass::Status::kSuccess, internal, "CUTLASS sm90 GEMM workspace initialisation failed: ",
            cutlass::cutlassGetStatusString(st), " (M=", M, " N=", N, " K=", K, ")");
  typename Kernel::Params params = Kernel::to_underlying_arguments(args, ws.get());
  set_gemm_smem<Kernel>(device);
  clear_stale_error();  // CUTLASS reads cudaGetLastError after its launch
  st = Gemm::run(params, stream);
  HOT_CHECK(st == cutlass::Status::kSuccess, internal, "CUTLASS sm90 GEMM run failed: ",
            cutlass::cutlassGetStatusString(st), " (M=", M, " N=", N, " K=", K, ")");
  HOT_CUDA_CHECK_LAUNCH();
  return true;
}

// run_gemm with the cluster shape for M (see the top of this file).
template <typename ElementD, typename EVT, typename FusionArgs>
bool run_gemm_for_m(const int8_t* a, int64_t lda, const int8_t* b, int64_t ldb, void* d, int64_t ldd, int M, int N,
                    int K, const FusionArgs& fusion, int device, cudaStream_t stream, int batches = 1,
                    int64_t batch_a = 0, int64_t batch_b = 0, int64_t batch_d = 0) {
  if (M <= size<0>(TileShape{}))
    return run_gemm<GemmConfig<ElementD, EVT, 1>>(a, lda, b, ldb, d, ldd, M, N, K, fusion, device, stream, batches,
                                                  batch_a, batch_b, batch_d);
  return run_gemm<GemmConfig<ElementD, EVT, 2>>(a, lda, b, ldb, d, ldd, M, N, K, fusion, device, stream, batches,
                                                batch_a, batch_b, batch_d);
}

template <typename ElementD>
bool dequant_gemm(const int8_t* a, int64_t lda, const int8_t* b, int64_t ldb, ElementD* d, int64_t ldd, int M, int N,
                  int K, const float* sa, bool sa_per_row, const float* sb, float factor, int device,
                  cudaStream_t stream) {
  const auto args = [&](auto evt) {
    typename decltype(evt)::Arguments fusion{
      {},                                                // acc
      {                                                  // alpha = (sa * sb) * factor
       {                                                 // sa * sb
        {sa, 0.0f, {sa_per_row, _0{}, int64_t(0)}},      // sa: per-row vector or scalar broadcast
        {{1.0f}, {sb}},                                  // sb (device scalar)
        {}},                                             // multiplies
       {{factor}, {nullptr}},                            // factor (host scalar)
       {}},                                              // multiplies
      {}};                                               // acc * alpha, cast
    return fusion;
  };
  if (use_pingpong(M, N, K, sm_count(device))) {
    if (N <= 128)
      return run_gemm<GemmConfigPP<ElementD, DequantEVT<ElementD, TileShapePPNarrow>, 2, TileShapePPNarrow>>(
          a, lda, b, ldb, d, ldd, M, N, K, args(DequantEVT<ElementD, TileShapePPNarrow>{}), device, stream);
    return run_gemm<GemmConfigPP<ElementD, DequantEVT<ElementD, TileShapePP>, 2>>(
        a, lda, b, ldb, d, ldd, M, N, K, args(DequantEVT<ElementD, TileShapePP>{}), device, stream);
  }
  return run_gemm_for_m<ElementD, DequantEVT<ElementD>>(a, lda, b, ldb, d, ldd, M, N, K, args(DequantEVT<ElementD>{}),
                                                        device, stream);
}

bool store_gemm(const int8_t* a, int64_t lda, const int8_t* b, int64_t ldb, int32_t* d, int64_t ldd, int M, int N,
                int K, int device, cudaStream_t stream);

}  // namespace hot::cuda::sm90
