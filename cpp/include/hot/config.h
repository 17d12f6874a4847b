// The HOT configuration of one layer (SPEC §3-§5, §7).
#pragma once

#include <cstdint>
#include <string>

namespace hot {

enum class Rounding : uint8_t { stochastic, nearest };
enum class ScaleMode : uint8_t { tensor, token };

struct Config {
  int gx_bits = 8;                        // bit width of the g_x path (SPEC §3, default §10): 4 or 8
  int rank = 16;                          // HLA rank r of the g_w path (SPEC §4, default §10): 1..16
  Rounding rounding = Rounding::stochastic;  // rounding of the g_y-derived operands (W and x: always nearest)
  ScaleMode gx_scale = ScaleMode::tensor;    // g_x-path scale of G~: per tensor or per row (token), from LQS
  bool exact = false;                     // exact mode: unquantised backward from the raw x

  // Throws hot::Error(value) naming the field, the allowed values and the value given.
  void validate() const;
  std::string str() const;
};

const char* rounding_name(Rounding r);
const char* scale_mode_name(ScaleMode s);

}  // namespace hot
