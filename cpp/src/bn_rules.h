// BatchNorm's per-channel forward rules (ops.h batch_norm_stats and batch_norm_transform), written once for every
// backend so that the CPU and the GPU give the same bits.
#pragma once

#include "hot/quant_rules.h"

namespace hot {

// From the sums a = sum(x - K) and b = sum((x - K)^2) of R rows (K: the channel's first-row value): mean and invstd
// into *mean, *invstd; with running statistics (rm, rv non-null) r = momentum * s + om * r, om = 1 - momentum.
HOT_HD void bn_store_stats(float a, float b, float K, int64_t R, float eps, float momentum, float om, float* mean,
                           float* invstd, float* rm, float* rv) {
  const float n = static_cast<float>(R), q = hot_div(a, n), m = hot_add(K, q);
  float m2 = hot_add(b, -hot_mul(a, q));
  m2 = m2 < 0.0f ? 0.0f : m2;  // NaN stays NaN
  const float var = hot_div(m2, n);
  *mean = m;
  *invstd = var == 0.0f && eps == 0.0f ? 0.0f : hot_div(1.0f, hot_sqrt(hot_add(var, eps)));
  if (rm != nullptr) {
    const float unbiased = hot_div(m2, static_cast<float>(R - 1));
    *rm = hot_add(hot_mul(momentum, m), hot_mul(om, *rm));
    *rv = hot_add(hot_mul(momentum, unbiased), hot_mul(om, *rv));
  }
}

// One element of batch_norm_transform: s = weight * invstd (or invstd), b = bias (or +0).
HOT_HD float bn_transform(float x, float mean, float s, float b) { return hot_fma(hot_add(x, -mean), s, b); }

}  // namespace hot
