#include "hot/config.h"

#include "hot/error.h"

namespace hot {

const char* rounding_name(Rounding r) { return r == Rounding::stochastic ? "stochastic" : "nearest"; }
const char* scale_mode_name(ScaleMode s) { return s == ScaleMode::tensor ? "tensor" : "token"; }

void Config::validate() const {
  HOT_CHECK_VALUE(gx_bits == 4 || gx_bits == 8, "Config: gx_bits must be 4 or 8, got ", gx_bits);
  HOT_CHECK_VALUE(rank >= 1 && rank <= 16, "Config: rank must be in 1..16, got ", rank);
  HOT_CHECK_VALUE(rounding == Rounding::stochastic || rounding == Rounding::nearest,
                  "Config: rounding must be stochastic or nearest, got ", static_cast<int>(rounding));
  HOT_CHECK_VALUE(gx_scale == ScaleMode::tensor || gx_scale == ScaleMode::token,
                  "Config: gx_scale must be tensor or token, got ", static_cast<int>(gx_scale));
}

std::string Config::str() const {
  return detail::concat("Config(gx_bits=", gx_bits, ", rank=", rank, ", rounding=", rounding_name(rounding),
                        ", gx_scale=", scale_mode_name(gx_scale), ", exact=", exact ? "true" : "false", ")");
}

}  // namespace hot
