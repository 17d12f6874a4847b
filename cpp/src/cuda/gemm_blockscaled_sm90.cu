// The block-scaled integer GEMM on sm_90a (see backend.h, gemm_s8_blockscaled): s8 operands, both K-major, and per
// K-block scales promoted into fp32 accumulators inside the main loop, so that operands whose scales are local to a
// block of 128 of the contraction need no pass over the whole tensor for a scale:
//     out[m, n] = factor * acc,  acc = sum over kb (in order) of float(sum_{k in kb} a[m, k] b[n, k]) * s,
//     s = sa[kb, m] * sb[kb, n / 128]   (sa alone when there is no sb)
// each term added by one fused multiply-add, acc starting at +0 (the CPU backend's order).
//
// A warp-specialised persistent kernel of cute primitives: warpgroup 0's first warp loads 128 x 128 tiles of A and B
// by TMA into a ring of kStages stages (one mbarrier pair per stage); warpgroups 1 and 2 each own 64 rows of the
// 128 x 128 output tile, run the k-tile's four wgmma m64n128k32 into int32 registers, release the stage, and add the
// int32 sums into fp32 accumulators with the k-tile's scales (read from global memory, issued before the wgmma wait).
// Tiles go round-robin over the CTAs (one per SM), N fastest (consecutive tiles share A's rows in L2); the producer
// runs ahead into the next tile while the consumers store the last one.
#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <vector>

#include <cute/tensor.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>

#include "common.cuh"

namespace hot::cuda::sm90 {

using namespace cute;

namespace {

constexpr int kBM = 128, kBN = 192, kBK = 128, kStages = 5;
constexpr int kCluster = 2;            // CTAs of a cluster: consecutive M tiles of one N tile, sharing B's loads
constexpr int kThreads = 384;          // producer warpgroup + two consumer warpgroups
constexpr int kConsumerWarps = 8;

using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<int8_t>{},
                                           make_shape(Int<kBM>{}, Int<kBK>{}, Int<kStages>{})));
using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<int8_t>{},
                                           make_shape(Int<kBN>{}, Int<kBK>{}, Int<kStages>{})));
using TiledMma = decltype(make_tiled_mma(SM90::GMMA::MMA_64x192x32_S32S8S8_SS_TN{},
                                         Layout<cute::Shape<_2, _1, _1>>{}));

struct SharedStorage {
  alignas(1024) cute::ArrayEngine<int8_t, cosize_v<SmemLayoutA>> A;
  alignas(1024) cute::ArrayEngine<int8_t, cosize_v<SmemLayoutB>> B;
  alignas(8) uint64_t full[kStages];
  alignas(8) uint64_t empty[kStages];
};

using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
using EmptyBarrier = cutlass::arch::ClusterBarrier;

struct Problem {
  int M, N, K;
  const float* sa;  // [KB, ld_sa]
  int64_t ld_sa;
  const float* sb;  // [KB, ld_sb] (one per 128 columns of N), or null
  int64_t ld_sb;
  void* out;
  int64_t ldd;
  float factor;
  int lag;
};

template <typename TOut, int kP, class TmaA, class TmaB>
__global__ void __launch_bounds__(kThreads, 1)
    blockscaled_gemm_kernel(Problem p, CUTE_GRID_CONSTANT TmaA const tma_a, CUTE_GRID_CONSTANT TmaB const tma_b) {
#if defined(__CUDA_ARCH__) && defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
  const int warp = threadIdx.x / 32;
  const int rank = static_cast<int>(cute::block_rank_in_cluster());  // this CTA's M tile within the pair
  const int tiles_n = (p.N + kBN - 1) / kBN;
  const int pairs = ((p.M + kBM * kCluster - 1) / (kBM * kCluster)) * tiles_n;  // cluster tiles (2 M tiles x 1 N)
  const int clusters = static_cast<int>(gridDim.x) / kCluster, cluster = static_cast<int>(blockIdx.x) / kCluster;
  const int k_tiles = (p.K + kBK - 1) / kBK;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      FullBarrier::init(&smem.full[s], 1);
      EmptyBarrier::init(&smem.empty[s], kConsumerWarps * kCluster);  // both CTAs' consumers read B's halves
    }
    cutlass::arch::fence_barrier_init();
  }
  cute::cluster_sync();  // the peer's barriers exist before anything arrives on them

  auto mA = tma_a.get_tma_tensor(make_shape(p.M, p.K));  // (M, K)
  auto mB = tma_b.get_tma_tensor(make_shape(p.N, p.K));  // (N, K)
  auto sA = make_tensor(make_smem_ptr(smem.A.begin()), SmemLayoutA{});  // (BM, BK, stage)
  auto sB = make_tensor(make_smem_ptr(smem.B.begin()), SmemLayoutB{});

  if (warp < 4) {  // producer warpgroup: one thread issues every load
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp == 0 && cute::elect_one_sync()) {
      constexpr uint32_t kBytes = (kBM + kBN) * kBK;  // A, and both halves of B (this CTA's and the peer's)
      int it = 0;
      for (int c = cluster; c < pairs; c += clusters) {
        const int tm = (c / tiles_n) * kCluster + rank, tn = c % tiles_n;
        auto gA = local_tile(mA, make_shape(Int<kBM>{}, Int<kBK>{}), make_coord(tm, _));  // (BM, BK, k)
        auto gB = local_tile(mB, make_shape(Int<kBN>{}, Int<kBK>{}), make_coord(tn, _));
        auto [tAgA, tAsA] = tma_partition(tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
        // This CTA loads half of B's tile and multicasts it to both CTAs of the pair.
        auto [tBgB, tBsB] = tma_partition(tma_b, rank, Layout<Int<kCluster>>{}, group_modes<0, 2>(sB),
                                          group_modes<0, 2>(gB));
        for (int kt = 0; kt < k_tiles; ++kt, ++it) {
          const int stage = it % kStages;
          const uint32_t phase = (it / kStages) & 1;
          if (it >= kStages) EmptyBarrier::wait(&smem.empty[stage], phase ^ 1);
          FullBarrier::arrive_and_expect_tx(&smem.full[stage], kBytes);
          copy(tma_a.with(smem.full[stage]), tAgA(_, kt), tAsA(_, stage));
          copy(tma_b.with(smem.full[stage], static_cast<uint16_t>((1 << kCluster) - 1)), tBgB(_, kt), tBsB(_, stage));
        }
      }
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<232>();
    const int ct = threadIdx.x - 128;  // consumer thread 0..255
    TiledMma mma;
    ThrMMA thr = mma.get_thread_slice(ct);
    auto tCsA = thr.partition_A(sA);  // (MMA, MMA_M, MMA_K, stage)
    auto tCsB = thr.partition_B(sB);
    auto tCrA = thr.make_fragment_A(tCsA);  // wgmma descriptors
    auto tCrB = thr.make_fragment_B(tCsB);
    auto cC = make_identity_tensor(make_shape(Int<kBM>{}, Int<kBN>{}));
    auto tCcC = thr.partition_C(cC);  // (m, n) of each accumulator inside the tile
    auto tmp = partition_fragment_C(mma, make_shape(Int<kBM>{}, Int<kBN>{}));  // int32, one k-tile
    auto acc = make_tensor<float>(tmp.layout());
    static_assert(size(tmp) == kBN / 2, "64 x kBN accumulators per consumer warpgroup");
    // This thread's two rows of the tile (its values alternate between them in pairs).
    const int r0 = get<0>(tCcC(0)), r1 = get<0>(tCcC(2));
    const bool arriver = cute::elect_one_sync();

    // Warpgroup 1 starts p.lag k-tiles after warpgroup 0, so that their promotions (which wait for the tensor cores)
    // fall while the other one's wgmma run.
    const int wg = ct / 128;
    int issued = 0;
    if (wg == 1 && p.lag > 0) cutlass::arch::NamedBarrier::sync(256, 1);
    int it0 = 0;  // k-tiles consumed before this tile (the ring's position)
    for (int c = cluster; c < pairs; c += clusters, it0 += k_tiles) {
      const int tm = (c / tiles_n) * kCluster + rank, tn = c % tiles_n;
      const int m0 = tm * kBM, n0 = tn * kBN;
      const bool ok0 = m0 + r0 < p.M, ok1 = m0 + r1 < p.M;
      CUTE_UNROLL
      for (int i = 0; i < size(acc); ++i) acc(i) = 0.0f;
      float s0 = 0.0f, s1 = 0.0f, sb0 = 1.0f, sb1 = 1.0f;
      for (int kt = 0; kt < k_tiles; ++kt) {
        const int stage = (it0 + kt) % kStages;
        const bool opens = kt % kP == 0, closes = kt % kP == kP - 1 || kt + 1 == k_tiles;
        if (opens) {  // the block's scales, loaded while the tensor cores work
          const int kb = kt / kP;
          const float* sak = p.sa + kb * p.ld_sa + m0;
          s0 = ok0 ? __ldg(sak + r0) : 0.0f;
          s1 = ok1 ? __ldg(sak + r1) : 0.0f;
          if (p.sb) {  // B's scales of the (at most two) 128-column blocks of N that the tile touches
            const float* sbk = p.sb + kb * p.ld_sb;
            const int nb0 = n0 / 128, nb1 = (n0 + kBN - 1) / 128;
            sb0 = __ldg(sbk + nb0);
            sb1 = nb1 * 128 < p.N ? __ldg(sbk + nb1) : 0.0f;
          }
        }
        FullBarrier::wait(&smem.full[stage], static_cast<uint32_t>(((it0 + kt) / kStages) & 1));
        warpgroup_fence_operand(tmp);
        warpgroup_arrive();
        mma.accumulate_ = opens ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(tCrA); ++kb) {
          cute::gemm(mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), tmp);
          mma.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
        if (wg == 0 && p.lag > 0 && ++issued == p.lag) cutlass::arch::NamedBarrier::arrive(256, 1);
        // Release a stage once its wgmma retired: the previous k-tile's (inside the block), and at the block's end
        // this one's. This warp is done with it in both CTAs (B's halves came from both).
        auto release = [&](int k) {
          __syncwarp();
          if (arriver) {
            const int st = (it0 + k) % kStages;
            CUTE_UNROLL
            for (int peer = 0; peer < kCluster; ++peer) EmptyBarrier::arrive(&smem.empty[st], peer, 1);
          }
        };
        if (!closes) {
          warpgroup_wait<1>();
          if (!opens) release(kt - 1);
          continue;
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(tmp);
        if (!opens) release(kt - 1);
        release(kt);
        CUTE_UNROLL
        for (int i = 0; i < size(acc); ++i) {
          float s = get<0>(tCcC(i)) == r0 ? s0 : s1;
          if (p.sb) s *= ((n0 + get<1>(tCcC(i))) / 128 == n0 / 128) ? sb0 : sb1;
          acc(i) = __fmaf_rn(static_cast<float>(tmp(i)), s, acc(i));
        }
      }
      warpgroup_wait<0>();  // (a no-op: the last k-tile closed a block; said so that ptxas sees every group retired)
      // Epilogue: out = acc * factor, stored from registers (pairs of adjacent columns).
      TOut* out = static_cast<TOut*>(p.out);
      CUTE_UNROLL
      for (int i = 0; i < size(acc); i += 2) {
        const int m = m0 + get<0>(tCcC(i)), n = n0 + get<1>(tCcC(i));
        if (m >= p.M) continue;
        TOut* dst = out + static_cast<int64_t>(m) * p.ldd + n;
        const float v0 = acc(i) * p.factor, v1 = acc(i + 1) * p.factor;
        if (n + 1 < p.N) {
          if constexpr (std::is_same_v<TOut, float>) {
            *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
          } else if constexpr (std::is_same_v<TOut, __nv_bfloat16>) {
            *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(v0, v1);
          } else {
            *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(v0, v1);
          }
        } else if (n < p.N) {
          FloatIO<TOut>::store(dst, v0);
        }
      }
    }
    if (wg == 0 && p.lag > 0 && issued < p.lag) cutlass::arch::NamedBarrier::arrive(256, 1);  // fewer k-tiles
  }
  cute::cluster_sync();  // neither CTA leaves while the peer may still write its shared memory or barriers
#endif
}

template <typename TOut>
bool launch(const int8_t* a, int64_t lda, const int8_t* b, int64_t ldb, const Problem& p, int device,
            cudaStream_t stream) {
  auto mA = make_tensor(make_gmem_ptr(a), make_shape(p.M, p.K), make_stride(lda, _1{}));
  auto mB = make_tensor(make_gmem_ptr(b), make_shape(p.N, p.K), make_stride(ldb, _1{}));
  auto tma_a = make_tma_atom(SM90_TMA_LOAD{}, mA, SmemLayoutA{}(_, _, 0), make_shape(Int<kBM>{}, Int<kBK>{}));
  auto tma_b = make_tma_atom(SM90_TMA_LOAD_MULTICAST{}, mB, SmemLayoutB{}(_, _, 0),
                             make_shape(Int<kBN>{}, Int<kBK>{}), Int<kCluster>{});
  static const int env_p = std::getenv("HOT_BS_P") ? std::atoi(std::getenv("HOT_BS_P")) : 1;
  auto* kernel = env_p == 4   ? &blockscaled_gemm_kernel<TOut, 4, decltype(tma_a), decltype(tma_b)>
                 : env_p == 2 ? &blockscaled_gemm_kernel<TOut, 2, decltype(tma_a), decltype(tma_b)>
                              : &blockscaled_gemm_kernel<TOut, 1, decltype(tma_a), decltype(tma_b)>;
  constexpr int smem = static_cast<int>(sizeof(SharedStorage)) + 1024;  // + alignment slack
  static std::mutex mu;
  static std::vector<char> done;
  {
    const std::lock_guard<std::mutex> lock(mu);
    if (static_cast<size_t>(device) >= done.size()) done.resize(static_cast<size_t>(device) + 1, 0);
    if (!done[static_cast<size_t>(device)]) {
      HOT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      done[static_cast<size_t>(device)] = 1;
    }
  }
  const int64_t pairs = ceil_div(p.M, kBM * kCluster) * ceil_div(p.N, kBN);
  const int clusters = static_cast<int>(std::min<int64_t>(pairs, sm_count(device) / kCluster));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(clusters * kCluster));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  HOT_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, tma_a, tma_b));
  return true;
}

}  // namespace

bool blockscaled_gemm(const TensorView& a, const TensorView& b, const TensorView& sa, const TensorView& sb,
                      float factor, const TensorView& out, int device, cudaStream_t stream) {
  const int64_t M = a.shape[0], K = a.shape[1], N = b.shape[0];
  auto aligned = [](const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15u) == 0; };
  const int64_t out_bytes = dtype_bits(out.dtype) / 8;
  // TMA: 16-byte aligned bases and row strides; the paired stores: an even row stride and an aligned base.
  if (!fits_int32(M) || !fits_int32(N) || !fits_int32(K) || a.strides[0] % 16 != 0 || b.strides[0] % 16 != 0 ||
      !aligned(a.data) || !aligned(b.data) || out.strides[0] % 2 != 0 ||
      (reinterpret_cast<uintptr_t>(out.data) % (2 * out_bytes)) != 0)
    return false;
  const Problem p{static_cast<int>(M), static_cast<int>(N), static_cast<int>(K),
                  static_cast<const float*>(sa.data), sa.strides[0],
                  sb.data ? static_cast<const float*>(sb.data) : nullptr, sb.data ? sb.strides[0] : 0,
                  out.data, out.strides[0], factor,
                  std::getenv("HOT_BS_LAG") ? std::atoi(std::getenv("HOT_BS_LAG")) : 0};
  const auto* ap = static_cast<const int8_t*>(a.data);
  const auto* bp = static_cast<const int8_t*>(b.data);
  switch (out.dtype) {
    case DType::f32: return launch<float>(ap, a.strides[0], bp, b.strides[0], p, device, stream);
    case DType::bf16: return launch<__nv_bfloat16>(ap, a.strides[0], bp, b.strides[0], p, device, stream);
    case DType::f16: return launch<__half>(ap, a.strides[0], bp, b.strides[0], p, device, stream);
    default: return false;
  }
}

}  // namespace hot::cuda::sm90
