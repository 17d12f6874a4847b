// The fast Walsh-Hadamard butterfly shared by the CPU kernels. Order of operations (the contract with
// the CUDA backend, for bit-identical fp32 results): for h = 1, 2, 4, ... < n, for every pair (j, j + h)
// inside each block of 2h: (a, b) -> (a + b, a - b). No normalisation.
#pragma once

#include <cstdint>

namespace hot::cpu {

// In-place transform of n (power of two) values at stride `stride`.
inline void fwht_strided(float* x, int n, int64_t stride) {
  for (int h = 1; h < n; h <<= 1) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = x[j * stride], b = x[(j + h) * stride];
        x[j * stride] = a + b;
        x[(j + h) * stride] = a - b;
      }
    }
  }
}

// Each row of `rows` (n rows of `cols` contiguous floats, row stride `ld`) is one transform input
// element: the transform mixes rows, vectorised across columns. Same butterfly order as above.
inline void fwht_rows(float* rows, int n, int64_t ld, int64_t cols) {
  for (int h = 1; h < n; h <<= 1) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        float* a = rows + j * ld;
        float* b = rows + (j + h) * ld;
        for (int64_t c = 0; c < cols; ++c) {
          const float va = a[c], vb = b[c];
          a[c] = va + vb;
          b[c] = va - vb;
        }
      }
    }
  }
}

// Transform each consecutive block of `block` values in x[0..n).
inline void fwht_blocks(float* x, int64_t n, int block) {
  if (block <= 1) return;
  for (int64_t s = 0; s < n; s += block) fwht_strided(x + s, block, 1);
}

}  // namespace hot::cpu
