// Host emulation of the CUDA execution model, enough to run hot's own kernels on the CPU so that a machine
// without a GPU can test them for bit-exactness against the CPU backend (ctest, CI).
//
// Include this before anything else in a translation unit compiled by the host compiler (not nvcc); it
// includes the CUDA headers itself. What it provides:
// - every thread of a block is a std::thread; the blocks of a grid run one after another, in a shuffled order, so
//   function-local __shared__ arrays (made `static` here) and the dynamic shared memory (HOT_DYNAMIC_SMEM) are per
//   block;
// - __syncthreads() is a barrier of the block's threads, __shfl_xor_sync, __shfl_sync and __ballot_sync
//   barrier-separated exchanges among the 32 lanes of a warp (every lane of the warp must call it, as on the GPU with
//   a full mask);
// - threadIdx / blockIdx / blockDim / gridDim are thread-local;
// - the float intrinsics the kernels use are single IEEE fp32 operations (the build disables FMA
//   contraction), atomicMax is an atomic compare-and-swap loop, and __ldg of a vector checks its alignment;
// - cp.async copies land at the wait that retires their group (the latest moment the hardware may deliver them),
//   or, with copy_timing = at_issue, at the issue (the earliest). Under ThreadSanitizer the two timings expose the
//   two hazards of a cp.async pipeline: a tile read by other threads without a barrier after the wait that landed
//   it (at_wait), and a prefetch into a buffer that other threads may still be reading (at_issue).
// The emulation checks semantics, not speed or the GPU's resource limits (registers, shared memory size).
// Build the test with AddressSanitizer and UBSan's alignment check: out-of-bounds and misaligned vector
// accesses that would fault on the GPU then fail on the CPU too. Built with ThreadSanitizer instead, a missing
// __syncthreads() between one thread's shared-memory write and another's read is reported as a data race
// (the barrier and the shuffles synchronise through std::barrier, which ThreadSanitizer understands).
#pragma once

#define HOT_CUDA_EMULATION 1
#define __shared__ static
#define __launch_bounds__(...)
#define __noinline__

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "cpu/convert.h"

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

namespace hot_emu {

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "cuda_emu: %s\n", what);
  std::abort();
}

// The state one block's threads share.
struct Block {
  explicit Block(int threads, size_t smem_bytes)
      : bar(threads), smem((smem_bytes + 15) / 16 + 1), warps((threads + 31) / 32) {
    for (auto& w : warps) w.bar = std::make_unique<std::barrier<>>(32);
  }
  std::barrier<> bar;
  std::vector<uint4> smem;  // 16-byte aligned dynamic shared memory
  struct Warp {
    std::unique_ptr<std::barrier<>> bar;
    uint32_t slot[32];
  };
  std::vector<Warp> warps;
};

inline thread_local Block* current = nullptr;

inline unsigned char* dynamic_smem() { return reinterpret_cast<unsigned char*>(current->smem.data()); }

// cp.async. With copy_timing == at_wait a thread's copies are held back until a cp_async_wait leaves at most N of
// its committed groups pending, so a read before the wait sees garbage; with at_issue they land at once.
enum class CopyTiming { at_wait, at_issue };
inline std::atomic<CopyTiming> copy_timing{CopyTiming::at_wait};
struct PendingCopy {
  void* dst;  // null: landed at issue
  uint4 data;
};
inline thread_local std::vector<PendingCopy> open_group;
inline thread_local std::vector<std::vector<PendingCopy>> committed;
inline void cp_async16(void* dst, const void* src, bool valid) {
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 || (valid && reinterpret_cast<uintptr_t>(src) % 16 != 0))
    fail("cp.async: misaligned 16-byte copy");
  PendingCopy c{dst, make_uint4(0, 0, 0, 0)};
  if (valid) std::memcpy(&c.data, src, 16);
  if (copy_timing.load() == CopyTiming::at_issue) {
    std::memcpy(dst, &c.data, 16);
    c.dst = nullptr;
  }
  open_group.push_back(c);
}
inline void cp_async_commit() {
  committed.push_back(std::move(open_group));
  open_group.clear();
}
inline void cp_async_wait(int n) {
  while (committed.size() > static_cast<size_t>(n)) {
    for (const PendingCopy& c : committed.front())
      if (c.dst) std::memcpy(c.dst, &c.data, 16);
    committed.erase(committed.begin());
  }
}

// The launch configurations the GPU accepts (sm_80 .. sm_90): 1 .. 2^31 - 1 blocks in x, 1 .. 65535 in y and z,
// 1 .. 1024 threads, at most 227 KB of dynamic shared memory. A configuration outside them fails the launch
// (cudaErrorInvalidConfiguration), so it fails here too.
inline bool launch_config_ok(dim3 grid, int threads, size_t smem_bytes) {
  return grid.x >= 1 && grid.x <= 0x7fffffffu && grid.y >= 1 && grid.y <= 65535u && grid.z >= 1 && grid.z <= 65535u &&
         threads >= 1 && threads <= 1024 && smem_bytes <= 227u * 1024u;
}

// Runs kernel(args...) over the grid: `threads` std::threads run the blocks one after another.
template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, int threads, size_t smem_bytes, Args&&... args) {
  if (!launch_config_ok(grid, threads, smem_bytes)) fail("launch: a configuration the GPU would reject");
  if (threads % 32 != 0) fail("launch: the emulation needs whole warps");
  // The blocks run one after another in a shuffled order (fixed per grid size), so a kernel that depends on the
  // order in which blocks run, which the GPU does not promise, fails here too.
  std::vector<uint3> order;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) order.push_back(make_uint3(bx, by, bz));
  uint64_t rng = 0x9e3779b97f4a7c15ull ^ order.size();
  for (size_t i = order.size(); i > 1; --i) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    std::swap(order[i - 1], order[(rng >> 33) % i]);
  }
  Block block(threads, smem_bytes);
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      threadIdx = make_uint3(static_cast<unsigned>(t), 0, 0);
      blockDim = dim3(static_cast<unsigned>(threads));
      gridDim = grid;
      current = &block;
      for (const uint3& b : order) {
        // Shared memory starts as garbage, never as zeros.
        if (t == 0) std::memset(block.smem.data(), 0xA5, block.smem.size() * sizeof(uint4));
        block.bar.arrive_and_wait();
        blockIdx = b;
        kernel(args...);
        if (!open_group.empty() || !committed.empty()) fail("a block ended with cp.async copies pending");
        block.bar.arrive_and_wait();  // the block is done before the next one starts
      }
      current = nullptr;
    });
  for (auto& th : pool) th.join();
}

// The launcher the kernels' launch sequences take (the interface of hot::cuda::StreamLaunch), on the emulation.
struct Launch {
  template <typename... KArgs, typename... Args>
  void operator()(void (*kernel)(KArgs...), dim3 grid, int threads, size_t smem, Args&&... args) const {
    launch(kernel, grid, threads, smem, std::forward<Args>(args)...);
  }
  void zero(void* p, size_t bytes) const { std::memset(p, 0, bytes); }
};

// A launcher that runs nothing: it records each launch's configuration and whether the GPU would accept it. For
// the launch sequences of inputs too large to emulate (millions of rows; the views' data is never touched).
struct RecordLaunch {
  struct Entry {
    dim3 grid;
    int threads;
    size_t smem;
    bool ok;
  };
  mutable std::vector<Entry> launches;  // the launch sequences take their launcher by const reference
  template <typename... KArgs, typename... Args>
  void operator()(void (*)(KArgs...), dim3 grid, int threads, size_t smem, Args&&...) const {
    launches.push_back({grid, threads, smem, launch_config_ok(grid, threads, smem)});
  }
  void zero(void*, size_t) const {}
};

}  // namespace hot_emu

inline void __syncthreads() { hot_emu::current->bar.arrive_and_wait(); }

namespace hot_emu {
// One full-warp exchange (the shuffles): every lane publishes v, then reads the slot of lane src(lane).
template <typename T, typename Src>
T warp_exchange(unsigned mask, T v, Src src) {
  static_assert(sizeof(T) == 4, "cuda_emu: 32-bit shuffles only");
  if (mask != 0xffffffffu) fail("shuffles: only full-warp masks are emulated");
  auto& w = current->warps[threadIdx.x / 32];
  const unsigned lane = threadIdx.x % 32;
  std::memcpy(&w.slot[lane], &v, 4);
  w.bar->arrive_and_wait();
  T r;
  std::memcpy(&r, &w.slot[src(lane) & 31u], 4);
  w.bar->arrive_and_wait();  // nobody overwrites a slot before its reader is done
  return r;
}
}  // namespace hot_emu

template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  return hot_emu::warp_exchange(mask, v, [&](unsigned lane) { return lane ^ static_cast<unsigned>(lane_mask); });
}

template <typename T>
T __shfl_sync(unsigned mask, T v, int src_lane) {
  return hot_emu::warp_exchange(mask, v, [&](unsigned) { return static_cast<unsigned>(src_lane); });
}

// Bit `lane` of the result is lane's predicate, for every lane of the warp (full-warp masks only, as the shuffle).
inline unsigned __ballot_sync(unsigned mask, int pred) {
  if (mask != 0xffffffffu) hot_emu::fail("__ballot_sync: only full-warp masks are emulated");
  auto& w = hot_emu::current->warps[threadIdx.x / 32];
  w.slot[threadIdx.x % 32] = pred != 0;
  w.bar->arrive_and_wait();
  unsigned r = 0;
  for (unsigned l = 0; l < 32; ++l) r |= (w.slot[l] & 1u) << l;
  w.bar->arrive_and_wait();
  return r;
}

inline unsigned atomicMax(unsigned* p, unsigned v) {
  std::atomic_ref<unsigned> a(*p);
  unsigned old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}

template <typename V>
V __ldg(const V* p) {
  if (reinterpret_cast<uintptr_t>(p) % alignof(V) != 0) hot_emu::fail("__ldg: misaligned vector load");
  return *p;
}

inline float __fadd_rn(float a, float b) { return a + b; }
// a + b rounded toward -infinity: the nearest sum r and its exact error e (a + b = r + e, Knuth's TwoSum); r is the
// rounded-down sum unless e < 0, then the float below it. Finite inputs whose sum is finite.
inline float __fadd_rd(float a, float b) {
  const float r = a + b, bv = r - a, av = r - bv, e = (a - av) + (b - bv);
  return e < 0.0f ? std::nextafter(r, -INFINITY) : r;
}
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __uint_as_float(unsigned u) { return hot::cpu::bits_to_float(u); }
inline unsigned __float_as_uint(float f) { return hot::cpu::float_to_bits(f); }
// The GPU conversions saturate and map NaN to 0; the kernels only convert finite values inside the int8
// range, and the emulation stops on anything outside the int32 range (where the two would differ).
inline int emu_to_int(float r) {
  if (!(r >= -2147483648.0f && r < 2147483648.0f)) hot_emu::fail("float-to-int conversion out of range");
  return static_cast<int>(r);
}
inline int __float2int_rn(float x) { return emu_to_int(std::nearbyint(x)); }
inline int __float2int_rd(float x) { return emu_to_int(std::floor(x)); }
// Byte i of the result: byte (s >> 4i) & 7 of the 8 bytes {y, x} (x bytes 0-3, y bytes 4-7), CUDA's default mode.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = (static_cast<uint64_t>(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<unsigned>((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
  return r;
}

// The per-halfword unsigned maximum / minimum of two words (SIMD within a register).
inline unsigned emu_halves(unsigned a, unsigned b, bool take_max) {
  unsigned r = 0;
  for (int h = 0; h < 2; ++h) {
    const unsigned x = (a >> (16 * h)) & 0xffffu, y = (b >> (16 * h)) & 0xffffu;
    r |= (take_max ? (x > y ? x : y) : (x < y ? x : y)) << (16 * h);
  }
  return r;
}
inline unsigned __vmaxu2(unsigned a, unsigned b) { return emu_halves(a, b, true); }
inline unsigned __vminu2(unsigned a, unsigned b) { return emu_halves(a, b, false); }

inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
