// The im2col row order and the col2im rule (SPEC §8), shared by the CPU backend and the CUDA kernel so that both add the same values in the
// same order: pixel (n, c, h, w) of the input map receives column (i, j, c) of every im2col row (n, ho, wo) that read
// it, kernel offsets in (i, j) order, summed in fp32 from zero (or taken as it is where windows cannot overlap, so
// a pixel has at most one contribution).
#pragma once

#include <cstdint>

#include "hot/ops.h"
#include "hot/rng.h"  // HOT_HD

namespace hot {

// A ConvGeometry flattened for device code, with its derived sizes.
struct Col2imParams {
  int64_t N, C, H, W, Ho, Wo;
  int kh, kw, sh, sw, ph, pw, dh, dw;
  bool patches, overlap;
};

inline Col2imParams col2im_params(const ConvGeometry& g) {
  return Col2imParams{g.N,  g.C,  g.H,  g.W,  g.out_h(), g.out_w(), g.kh,      g.kw,           g.sh,
                      g.sw, g.ph, g.pw, g.dh, g.dw,      g.patches, g.overlapping()};
}

// Row of the im2col matrix for output pixel (n, ho, wo): raster, or 4 x 4 patch order.
HOT_HD int64_t im2col_row(const Col2imParams& p, int64_t n, int64_t ho, int64_t wo) {
  if (!p.patches) return (n * p.Ho + ho) * p.Wo + wo;
  return (((n * (p.Ho / 4) + ho / 4) * (p.Wo / 4) + wo / 4) * 4 + ho % 4) * 4 + wo % 4;
}

// The output pixel (n, ho, wo) of im2col row r (the inverse of im2col_row).
HOT_HD void im2col_pixel(const Col2imParams& p, int64_t r, int64_t& n, int64_t& ho, int64_t& wo) {
  if (!p.patches) {
    n = r / (p.Ho * p.Wo);
    const int64_t t = r - n * p.Ho * p.Wo;
    ho = t / p.Wo;
    wo = t - ho * p.Wo;
    return;
  }
  const int64_t iw = r % 4, ih = (r / 4) % 4, pw = p.Wo / 4, ph = p.Ho / 4;
  int64_t t = r / 16;
  const int64_t bw = t % pw;
  t /= pw;
  const int64_t bh = t % ph;
  n = t / ph;
  ho = bh * 4 + ih;
  wo = bw * 4 + iw;
}

// The im2col entries that sum to input pixel (n, h, w): visit(row, ij) for each kernel offset ij = i * kw + j whose
// window covers it, in (i, j) order (col2im's summation order, on every backend). The per-offset index arithmetic is
// 32-bit (sizes of one map side; checked by hot::col2im) with a division-free path for unit strides: integer
// division, 64-bit above all, costs tens of instructions on a GPU, and this runs kh*kw times per pixel.
template <class Visit>
HOT_HD void col2im_sources(const Col2imParams& p, int64_t n, int h, int w, const Visit& visit) {
  const int Ho = static_cast<int>(p.Ho), Wo = static_cast<int>(p.Wo);
  for (int i = 0; i < p.kh; ++i) {
    int ho = h + p.ph - i * p.dh;
    if (ho < 0) continue;
    if (p.sh != 1) {
      if (ho % p.sh != 0) continue;
      ho /= p.sh;
    }
    if (ho >= Ho) continue;
    for (int j = 0; j < p.kw; ++j) {
      int wo = w + p.pw - j * p.dw;
      if (wo < 0) continue;
      if (p.sw != 1) {
        if (wo % p.sw != 0) continue;
        wo /= p.sw;
      }
      if (wo >= Wo) continue;
      visit(im2col_row(p, n, ho, wo), i * p.kw + j);
    }
  }
}

// The value of input pixel (n, c, h, w); get(row, col) reads cols as fp32. The first term is taken as it is (a lone
// -0.0 stays -0.0) unless windows overlap.
template <class Get>
HOT_HD float col2im_pixel(const Col2imParams& p, int64_t n, int64_t c, int h, int w, const Get& get) {
  float acc = 0.0f;
  bool any = false;
  col2im_sources(p, n, h, w, [&](int64_t r, int ij) {
    const float v = get(r, static_cast<int64_t>(ij) * p.C + c);
    acc = (any || p.overlap) ? acc + v : v;
    any = true;
  });
  return acc;
}

}  // namespace hot
