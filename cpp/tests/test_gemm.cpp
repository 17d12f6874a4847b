// Integer TN GEMMs: C (M x N s32) = A (M x K) B (N x K)^T, exact (SPEC §3 step 5, §4 step 3).
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>

#include "test_util.h"

namespace {

using namespace hot_test;

std::vector<int64_t> naive(const std::vector<int64_t>& a, const std::vector<int64_t>& b, int64_t M, int64_t N,
                           int64_t K) {
  std::vector<int64_t> c(static_cast<size_t>(M * N), 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      int64_t s = 0;
      for (int64_t k = 0; k < K; ++k) s += a[m * K + k] * b[n * K + k];
      c[m * N + n] = s;
    }
  return c;
}

struct Shape3 {
  int64_t M, N, K;
};

const Shape3 kShapes[] = {{1, 1, 1},   {1, 1, 2},    {3, 5, 1},   {7, 9, 11},   {16, 16, 16}, {17, 31, 33},
                          {64, 48, 128}, {33, 65, 130}, {5, 3, 1000}, {128, 96, 64}, {1, 200, 18},  {150, 1, 40}};

void check_gemm(DType dt, int64_t M, int64_t N, int64_t K, int64_t lo, int64_t hi, int64_t pad, uint64_t seed) {
  const std::vector<int64_t> a = randint(static_cast<size_t>(M * K), seed, lo, hi);
  const std::vector<int64_t> b = randint(static_cast<size_t>(N * K), seed + 1, lo, hi);
  const HostTensor A = host_from_int(dt, M, K, a, K + pad);
  const HostTensor B = host_from_int(dt, N, K, b, K + 2 * pad);
  HostTensor C = HostTensor::make2d(DType::s32, M, N, N + pad);
  if (dt == DType::s8)
    hot::gemm_s8s8s32(A, B, C);
  else
    hot::gemm_s4s4s32(A, B, C);
  const std::vector<int64_t> ref = naive(a, b, M, N, K);
  const std::vector<int64_t> got = C.to_int();
  for (size_t i = 0; i < ref.size(); ++i)
    ASSERT_EQ(got[i], ref[i]) << hot::dtype_name(dt) << " " << M << "x" << N << "x" << K << " pad " << pad << " at " << i;
  EXPECT_TRUE(C.padding_untouched());
}

TEST(Cpu_GemmS8, MatchesNaiveReference) {
  uint64_t seed = 1;
  for (const Shape3& s : kShapes)
    for (int64_t pad : {0, 5}) check_gemm(DType::s8, s.M, s.N, s.K, -127, 127, pad, seed++);
}

TEST(Cpu_GemmS8, FullRangeIncludingMinus128) {
  for (const Shape3& s : kShapes) check_gemm(DType::s8, s.M, s.N, s.K, -128, 127, 3, 50 + s.M);
}

TEST(Cpu_GemmS8, LargeKExtremeValues) {
  // K = 4096 with values ±127: |sum| up to 127^2 * 4096 = 66,064,384 (int32 accumulation, must be exact).
  const int64_t M = 9, N = 7, K = 4096;
  std::vector<int64_t> a(static_cast<size_t>(M * K)), b(static_cast<size_t>(N * K));
  const auto sa = randint(a.size(), 3, 0, 1), sb = randint(b.size(), 4, 0, 1);
  for (size_t i = 0; i < a.size(); ++i) a[i] = sa[i] ? 127 : -127;
  for (size_t i = 0; i < b.size(); ++i) b[i] = sb[i] ? 127 : -127;
  for (int64_t k = 0; k < K; ++k) {  // row 0 of A = row 0 of B: the maximum sum
    a[k] = 127;
    b[k] = 127;
    a[K + k] = -128;  // row 1 of A: -128 * ±127
  }
  HostTensor C = HostTensor::make2d(DType::s32, M, N);
  hot::gemm_s8s8s32(host_from_int(DType::s8, M, K, a), host_from_int(DType::s8, N, K, b), C);
  const std::vector<int64_t> ref = naive(a, b, M, N, K);
  EXPECT_EQ(C.to_int(), ref);
  EXPECT_EQ(C.geti(0, 0), 127 * 127 * K);
  // K = 65536 with -128 * -128: 2^30 still fits in int32
  const int64_t K2 = 65536;
  std::vector<int64_t> a2(static_cast<size_t>(K2), -128), b2(static_cast<size_t>(2 * K2), -128);
  for (int64_t k = 0; k < K2; ++k) b2[K2 + k] = 127;
  HostTensor C2 = HostTensor::make2d(DType::s32, 1, 2);
  hot::gemm_s8s8s32(host_from_int(DType::s8, 1, K2, a2), host_from_int(DType::s8, 2, K2, b2), C2);
  EXPECT_EQ(C2.geti(0, 0), int64_t{1} << 30);
  EXPECT_EQ(C2.geti(0, 1), -128 * 127 * K2);
}

TEST(Cpu_GemmS8, IdenticalAcrossThreadCounts) {
  ThreadGuard guard;
  const int64_t M = 257, N = 129, K = 300;
  const std::vector<int64_t> a = randint(static_cast<size_t>(M * K), 8, -127, 127);
  const std::vector<int64_t> b = randint(static_cast<size_t>(N * K), 9, -127, 127);
  const std::vector<int64_t> ref = naive(a, b, M, N, K);
  for (int nt : {1, 2, 3}) {
    hot::set_num_threads(nt);
    HostTensor C = HostTensor::make2d(DType::s32, M, N);
    hot::gemm_s8s8s32(host_from_int(DType::s8, M, K, a), host_from_int(DType::s8, N, K, b), C);
    EXPECT_EQ(C.to_int(), ref) << "threads " << nt;
  }
}

// A process that cannot start more threads (a memory or process limit) still gets its products: the chunks that got
// no thread run on the calling thread (an exception while threads run would terminate the process). The work runs in
// a child process whose address space is capped a little above what it uses, so new thread stacks cannot be mapped.
TEST(Cpu_Parallel, ChunksWithoutAThreadRunOnTheCaller) {
  const int64_t M = 2048, N = 2, K = 16;
  const std::vector<int64_t> a = randint(static_cast<size_t>(M * K), 21, -127, 127);
  const std::vector<int64_t> b = randint(static_cast<size_t>(N * K), 22, -127, 127);
  const std::vector<int64_t> ref = naive(a, b, M, N, K);
  const HostTensor A = host_from_int(DType::s8, M, K, a), B = host_from_int(DType::s8, N, K, b);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    long vm_pages = 0;
    std::ifstream("/proc/self/statm") >> vm_pages;
    const rlim_t cap = static_cast<rlim_t>(vm_pages) * static_cast<rlim_t>(sysconf(_SC_PAGESIZE)) + (24u << 20);
    const rlimit rl{cap, cap};
    if (vm_pages <= 0 || setrlimit(RLIMIT_AS, &rl) != 0) _exit(2);
    int code = 3;
    try {
      hot::set_num_threads(64);  // 64 stacks of 8 MB: most cannot be mapped under the cap
      HostTensor C = HostTensor::make2d(DType::s32, M, N);
      hot::gemm_s8s8s32(A, B, C);
      code = C.to_int() == ref ? 0 : 4;
    } catch (...) {
      code = 5;
    }
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status)) << "the child was killed by signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  EXPECT_EQ(WIFEXITED(status) ? WEXITSTATUS(status) : -1, 0) << "2: no limit set, 4: wrong products, 5: an error";
}

TEST(Cpu_GemmS4, MatchesNaiveReference) {
  uint64_t seed = 100;
  for (const Shape3& s : kShapes) {
    const int64_t K = s.K % 2 ? s.K + 1 : s.K;  // s4: K even
    for (int64_t pad : {0, 6}) check_gemm(DType::s4, s.M, s.N, K, -8, 7, pad, seed++);
  }
}

TEST(Cpu_GemmS4, LargeKExtremeValues) {
  const int64_t M = 5, N = 6, K = 4096;
  std::vector<int64_t> a(static_cast<size_t>(M * K)), b(static_cast<size_t>(N * K));
  const auto sa = randint(a.size(), 13, 0, 1), sb = randint(b.size(), 14, 0, 1);
  for (size_t i = 0; i < a.size(); ++i) a[i] = sa[i] ? 7 : -8;
  for (size_t i = 0; i < b.size(); ++i) b[i] = sb[i] ? 7 : -8;
  for (int64_t k = 0; k < K; ++k) {
    a[k] = -8;
    b[k] = -8;
  }
  HostTensor C = HostTensor::make2d(DType::s32, M, N);
  hot::gemm_s4s4s32(host_from_int(DType::s4, M, K, a), host_from_int(DType::s4, N, K, b), C);
  EXPECT_EQ(C.to_int(), naive(a, b, M, N, K));
  EXPECT_EQ(C.geti(0, 0), 64 * K);
}

TEST(Cpu_GemmS4, AgreesWithS8OnSameValues) {
  // §6: 4-bit values in int8 containers through the s8 GEMM are bit-identical to the s4 GEMM.
  const int64_t M = 23, N = 19, K = 94;
  const std::vector<int64_t> a = randint(static_cast<size_t>(M * K), 21, -7, 7);
  const std::vector<int64_t> b = randint(static_cast<size_t>(N * K), 22, -7, 7);
  HostTensor C4 = HostTensor::make2d(DType::s32, M, N), C8 = HostTensor::make2d(DType::s32, M, N);
  hot::gemm_s4s4s32(host_from_int(DType::s4, M, K, a), host_from_int(DType::s4, N, K, b), C4);
  hot::gemm_s8s8s32(host_from_int(DType::s8, M, K, a), host_from_int(DType::s8, N, K, b), C8);
  EXPECT_TRUE(bits_equal(C4, C8));
}

}  // namespace
