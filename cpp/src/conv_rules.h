// The col2im rule (SPEC §8), shared by the CPU backend and the CUDA kernel so that both add the same values in the
// same order: pixel (n, c, h, w) of the input map receives column (i, j, c) of every im2col row (n, ho, wo) that read
// it, kernel offsets in (i, j) order, summed in fp32 from zero (or taken as it is where windows cannot overlap, so
// a pixel has at most one contribution).
#pragma once

#include <cstdint>

#include "hot/ops.h"
#include "hot/rng.h"  // HOT_HD

namespace hot {

// A ConvGeometry flattened for device code, with its derived sizes (also the im2col rule below).
struct ConvParams {
  int64_t N, C, H, W, Ho, Wo;
  int kh, kw, sh, sw, ph, pw, dh, dw;
  bool patches, overlap;
};

inline ConvParams conv_params(const ConvGeometry& g) {
  return ConvParams{g.N,  g.C,  g.H,  g.W,  g.out_h(), g.out_w(), g.kh,      g.kw,           g.sh,
                      g.sw, g.ph, g.pw, g.dh, g.dw,      g.patches, g.overlapping()};
}

// Row of the im2col matrix for output pixel (n, ho, wo): raster, or 4 x 4 patch order.
HOT_HD int64_t im2col_row(const ConvParams& p, int64_t n, int64_t ho, int64_t wo) {
  if (!p.patches) return (n * p.Ho + ho) * p.Wo + wo;
  return (((n * (p.Ho / 4) + ho / 4) * (p.Wo / 4) + wo / 4) * 4 + ho % 4) * 4 + wo % 4;
}

// The value of input pixel (n, c, h, w); get(row, col) reads cols as fp32. The per-offset index arithmetic is 32-bit
// (sizes of one map side; checked by hot::col2im) with a division-free path for unit strides: integer division,
// 64-bit above all, costs tens of instructions on a GPU, and this runs kh*kw times per pixel.
template <class Get>
HOT_HD float col2im_pixel(const ConvParams& p, int64_t n, int64_t c, int h, int w, const Get& get) {
  float acc = 0.0f;
  bool any = false;
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
      const float v = get(im2col_row(p, n, ho, wo), (static_cast<int64_t>(i) * p.kw + j) * p.C + c);
      acc = (any || p.overlap) ? acc + v : v;
      any = true;
    }
  }
  return acc;
}

// The output pixel (n, ho, wo) of im2col row r and its successors, without divisions past the first row: rows in
// raster order, or in 4 x 4 patch order (n, ho / 4, wo / 4, ho % 4, wo % 4).
struct Im2colRowWalker {
  int64_t n;
  int ho, wo;  // pixel; in patch order also its patch (pho, pwo) and offset (a, b) inside it
  int pho, pwo, a, b;
  HOT_HD Im2colRowWalker(const ConvParams& p, int64_t r) {
    if (!p.patches) {
      const int64_t t = r / p.Wo;
      wo = static_cast<int>(r - t * p.Wo);
      n = t / p.Ho;
      ho = static_cast<int>(t - n * p.Ho);
      pho = pwo = a = b = 0;
    } else {
      const int64_t pw4 = p.Wo / 4, ph4 = p.Ho / 4;
      const int64_t patch = r / 16, in = r - patch * 16;
      a = static_cast<int>(in / 4), b = static_cast<int>(in % 4);
      const int64_t t = patch / pw4;
      pwo = static_cast<int>(patch - t * pw4);
      n = t / ph4;
      pho = static_cast<int>(t - n * ph4);
      ho = pho * 4 + a, wo = pwo * 4 + b;
    }
  }
  HOT_HD void next(const ConvParams& p) {
    if (!p.patches) {
      if (++wo == p.Wo) {
        wo = 0;
        if (++ho == p.Ho) ho = 0, ++n;
      }
      return;
    }
    if (++b == 4) {
      b = 0;
      if (++a == 4) {
        a = 0;
        if (++pwo == p.Wo / 4) {
          pwo = 0;
          if (++pho == p.Ho / 4) pho = 0, ++n;
        }
      }
    }
    ho = pho * 4 + a, wo = pwo * 4 + b;
  }
};

// Element (row at walker w, column (i, j, c)) of the im2col matrix of an int8 map kept channels-last (q_map: (N*H*W) x
// C) with one scale: the dequantised value q * scale (hot::dequantize's fp32 product), zero in the padding.
// im2col_s8_offset: the map index of that element, or false where it lies in the padding.
HOT_HD bool im2col_s8_offset(const ConvParams& p, const Im2colRowWalker& w, int i, int j, int c, int64_t& off) {
  const int h = w.ho * p.sh - p.ph + i * p.dh, x = w.wo * p.sw - p.pw + j * p.dw;
  if (h < 0 || h >= static_cast<int>(p.H) || x < 0 || x >= static_cast<int>(p.W)) return false;
  off = ((w.n * p.H + h) * p.W + x) * p.C + c;
  return true;
}
HOT_HD float im2col_s8_value(const ConvParams& p, const int8_t* q_map, float scale, const Im2colRowWalker& w, int i,
                             int j, int c) {
  int64_t off = 0;
  return im2col_s8_offset(p, w, i, j, c, off) ? static_cast<float>(q_map[off]) * scale : 0.0f;
}

}  // namespace hot
