// CPU backend GEMMs: exact integer GEMMs (int8 / packed int4 operands, int32 accumulation) with an
// AVX2 micro-kernel chosen at run time (portable fallback otherwise), the dequantising integer GEMM of
// the backward pass, and the fp32 GEMM of exact mode.
#include <algorithm>
#include <cstring>
#include <vector>

#include "backend.h"
#include "cpu/convert.h"
#include "cpu/parallel.h"
#include "hot/error.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HOT_X86 1
#endif

namespace hot::cpu {

namespace {

constexpr int64_t kKc = 512;  // K block (int16 elements): 4 A rows + 2 B rows stay in L1
constexpr int64_t kNc = 256;  // N block: the B panel stays in L2
constexpr int64_t kMc = 32;   // rows of A per parallel task

// Operand widened to int16, K padded with zeros to a multiple of 16, rows contiguous (ld = Kp).
struct Packed16 {
  int64_t rows = 0, kp = 0;
  std::vector<int16_t> v;
  const int16_t* row(int64_t r) const { return v.data() + r * kp; }
};

Packed16 pack_s8(const TensorView& t) {
  Packed16 p;
  p.rows = t.shape[0];
  p.kp = (t.shape[1] + 15) / 16 * 16;
  p.v.assign(static_cast<size_t>(p.rows * p.kp), 0);
  const int64_t K = t.shape[1];
  parallel_for(p.rows, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int8_t* src = t.ptr<int8_t>() + r * t.strides[0];
      int16_t* dst = p.v.data() + r * p.kp;
      for (int64_t k = 0; k < K; ++k) dst[k] = src[k];
    }
  });
  return p;
}

Packed16 pack_s4(const TensorView& t) {
  Packed16 p;
  p.rows = t.shape[0];
  p.kp = (t.shape[1] + 15) / 16 * 16;
  p.v.assign(static_cast<size_t>(p.rows * p.kp), 0);
  const int64_t K = t.shape[1];
  parallel_for(p.rows, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* src = static_cast<const uint8_t*>(t.data) + r * t.strides[0] / 2;
      int16_t* dst = p.v.data() + r * p.kp;
      for (int64_t k = 0; k < K; k += 2) {
        const uint8_t b = src[k / 2];
        dst[k] = static_cast<int8_t>(static_cast<int8_t>(b << 4) >> 4);
        dst[k + 1] = static_cast<int8_t>(static_cast<int8_t>(b) >> 4);
      }
    }
  });
  return p;
}

// acc[i][j] += dot(a_i[0..kc), b_j[0..kc)) for a 4 x 2 tile; kc is a multiple of 16.
void micro_generic(const int16_t* const a[4], const int16_t* const b[2], int64_t kc, int32_t acc[4][2]) {
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 2; ++j) {
      int32_t s = 0;
      const int16_t* x = a[i];
      const int16_t* y = b[j];
      for (int64_t k = 0; k < kc; ++k) s += static_cast<int32_t>(x[k]) * static_cast<int32_t>(y[k]);
      acc[i][j] += s;
    }
  }
}

#ifdef HOT_X86
__attribute__((target("avx2"))) inline int32_t hsum256(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

__attribute__((target("avx2"))) void micro_avx2(const int16_t* const a[4], const int16_t* const b[2], int64_t kc,
                                                int32_t acc[4][2]) {
  __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
          c31 = c00;
  for (int64_t k = 0; k < kc; k += 16) {
    const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[0] + k));
    const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[1] + k));
    __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[0] + k));
    c00 = _mm256_add_epi32(c00, _mm256_madd_epi16(x, b0));
    c01 = _mm256_add_epi32(c01, _mm256_madd_epi16(x, b1));
    x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[1] + k));
    c10 = _mm256_add_epi32(c10, _mm256_madd_epi16(x, b0));
    c11 = _mm256_add_epi32(c11, _mm256_madd_epi16(x, b1));
    x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[2] + k));
    c20 = _mm256_add_epi32(c20, _mm256_madd_epi16(x, b0));
    c21 = _mm256_add_epi32(c21, _mm256_madd_epi16(x, b1));
    x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[3] + k));
    c30 = _mm256_add_epi32(c30, _mm256_madd_epi16(x, b0));
    c31 = _mm256_add_epi32(c31, _mm256_madd_epi16(x, b1));
  }
  acc[0][0] += hsum256(c00);
  acc[0][1] += hsum256(c01);
  acc[1][0] += hsum256(c10);
  acc[1][1] += hsum256(c11);
  acc[2][0] += hsum256(c20);
  acc[2][1] += hsum256(c21);
  acc[3][0] += hsum256(c30);
  acc[3][1] += hsum256(c31);
}
#endif

using MicroFn = void (*)(const int16_t* const[4], const int16_t* const[2], int64_t, int32_t[4][2]);

MicroFn pick_micro() {
#ifdef HOT_X86
  if (__builtin_cpu_supports("avx2")) return micro_avx2;
#endif
  return micro_generic;
}

// C (M x N, row stride ldc) = A B^T over packed operands: int32 sums of each K block (kKc values) added into C's
// type Acc, int32 (a K that check_k_fits bounds) or int64 (any K, SPEC §4). Each output element is an exact integer
// sum, so the result does not depend on blocking or threads.
template <typename Acc>
void gemm_packed(const Packed16& A, const Packed16& B, Acc* C, int64_t ldc) {
  static const MicroFn micro = pick_micro();
  const int64_t M = A.rows, N = B.rows, Kp = A.kp;
  // Zero rows standing in for tile rows past M or N.
  const std::vector<int16_t> zero(static_cast<size_t>(std::min<int64_t>(Kp, kKc)), 0);
  const int64_t tasks = (M + kMc - 1) / kMc;
  parallel_for(tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m0 = t * kMc, m1 = std::min(M, m0 + kMc);
      for (int64_t m = m0; m < m1; ++m) std::fill(C + m * ldc, C + m * ldc + N, Acc{0});
      for (int64_t n0 = 0; n0 < N; n0 += kNc) {
        const int64_t n1 = std::min(N, n0 + kNc);
        for (int64_t k0 = 0; k0 < Kp; k0 += kKc) {
          const int64_t kc = std::min(kKc, Kp - k0);
          for (int64_t m = m0; m < m1; m += 4) {
            const int16_t* a[4];
            for (int i = 0; i < 4; ++i) a[i] = m + i < m1 ? A.row(m + i) + k0 : zero.data();
            for (int64_t n = n0; n < n1; n += 2) {
              const int16_t* b[2];
              for (int j = 0; j < 2; ++j) b[j] = n + j < n1 ? B.row(n + j) + k0 : zero.data();
              int32_t acc[4][2] = {{0, 0}, {0, 0}, {0, 0}, {0, 0}};
              micro(a, b, kc, acc);
              for (int i = 0; i < 4 && m + i < m1; ++i)
                for (int j = 0; j < 2 && n + j < n1; ++j) C[(m + i) * ldc + n + j] += acc[i][j];
            }
          }
        }
      }
    }
  });
}

}  // namespace

void gemm_s8s8s32(const TensorView& a, const TensorView& b, const TensorView& c, Stream) {
  gemm_packed(pack_s8(a), pack_s8(b), c.ptr<int32_t>(), c.strides[0]);
}

void gemm_s4s4s32(const TensorView& a, const TensorView& b, const TensorView& c, Stream) {
  gemm_packed(pack_s4(a), pack_s4(b), c.ptr<int32_t>(), c.strides[0]);
}

void gemm_s8_dequant(const TensorView& a, const TensorView& b, const TensorView& sa, const TensorView& sb,
                     float factor, int /*bits*/, const TensorView& out, Stream) {
  const int64_t M = a.shape[0], N = b.shape[0];
  std::vector<int64_t> acc(static_cast<size_t>(M * N));  // exact for any K
  gemm_packed(pack_s8(a), pack_s8(b), acc.data(), N);
  const bool per_row = sa.shape[0] == M && M > 1;
  const float* sap = sa.ptr<float>();
  const float sb0 = sb.ptr<float>()[0];
  parallel_for(M, std::max<int64_t>(1, 16384 / N), [&](int64_t m0, int64_t m1) {
    std::vector<float> row(static_cast<size_t>(N));
    for (int64_t m = m0; m < m1; ++m) {
      const float alpha = sap[per_row ? m : 0] * sb0 * factor;
      const int64_t* src = acc.data() + m * N;
      for (int64_t n = 0; n < N; ++n) row[n] = static_cast<float>(src[n]) * alpha;
      store_row(out, m, row.data());
    }
  });
}

void matmul_exact(const TensorView& a, bool trans_a, const TensorView& b, bool trans_b, const TensorView& out,
                  Stream) {
  // out (M x N) = op(a) (M x K) op(b) (K x N), fp32 accumulation in k order.
  const int64_t M = trans_a ? a.shape[1] : a.shape[0];
  const int64_t K = trans_a ? a.shape[0] : a.shape[1];
  const int64_t N = trans_b ? b.shape[0] : b.shape[1];
  // A as M x K fp32 row-major, B as K x N fp32 row-major.
  std::vector<float> A(static_cast<size_t>(M * K)), B(static_cast<size_t>(K * N));
  parallel_for(a.shape[0], 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < a.shape[1]; ++c) {
        const float v = load_float(a.data, a.dtype, r * a.strides[0] + c);
        if (trans_a) A[c * K + r] = v; else A[r * K + c] = v;
      }
  });
  parallel_for(b.shape[0], 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < b.shape[1]; ++c) {
        const float v = load_float(b.data, b.dtype, r * b.strides[0] + c);
        if (trans_b) B[c * N + r] = v; else B[r * N + c] = v;
      }
  });
  constexpr int64_t kNb = 512, kMb = 8;
  parallel_for((M + kMb - 1) / kMb, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> c(static_cast<size_t>(kMb * N));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m0 = t * kMb, mb = std::min(kMb, M - m0);
      std::fill(c.begin(), c.end(), 0.0f);
      for (int64_t n0 = 0; n0 < N; n0 += kNb) {
        const int64_t n1 = std::min(N, n0 + kNb);
        for (int64_t k = 0; k < K; ++k) {
          const float* brow = B.data() + k * N;
          for (int64_t i = 0; i < mb; ++i) {
            const float av = A[(m0 + i) * K + k];
            float* crow = c.data() + i * N;
            for (int64_t n = n0; n < n1; ++n) crow[n] += av * brow[n];
          }
        }
      }
      for (int64_t i = 0; i < mb; ++i) store_row(out, m0 + i, c.data() + i * N);
    }
  });
}

}  // namespace hot::cpu
