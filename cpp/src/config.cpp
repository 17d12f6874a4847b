#include "hot/config.h"

#include "hot/error.h"

namespace hot {

const char* rounding_name(Rounding r) { return r == Rounding::stochastic ? "stochastic" : "nearest"; }
const char* scale_mode_name(ScaleMode s) { return s == ScaleMode::tensor ? "tensor" : "token"; }

Rounding parse_rounding(const std::string& name, const char* what) {
  if (name == "stochastic") return Rounding::stochastic;
  if (name == "nearest") return Rounding::nearest;
  HOT_FAIL(value, what, " must be ", kRoundingAllowed, ", got '", name, "'");
}

ScaleMode parse_scale_mode(const std::string& name, const char* what) {
  if (name == "tensor") return ScaleMode::tensor;
  if (name == "token") return ScaleMode::token;
  HOT_FAIL(value, what, " must be ", kScaleAllowed, ", got '", name, "'");
}

void Config::validate() const {
  HOT_CHECK_VALUE(gx_bits == 4 || gx_bits == 8, "Config: gx_bits must be ", kGxBitsAllowed, ", got ", gx_bits);
  HOT_CHECK_VALUE(rank >= 1 && rank <= 16, "Config: rank must be ", kRankAllowed, ", got ", rank);
  HOT_CHECK_VALUE(rounding == Rounding::stochastic || rounding == Rounding::nearest, "Config: rounding must be ",
                  kRoundingAllowed, ", got ", static_cast<int>(rounding));
  HOT_CHECK_VALUE(gx_scale == ScaleMode::tensor || gx_scale == ScaleMode::token, "Config: gx_scale must be ",
                  kScaleAllowed, ", got ", static_cast<int>(gx_scale));
}

std::string Config::str() const {
  return detail::concat("Config(gx_bits=", gx_bits, ", rank=", rank, ", rounding=", rounding_name(rounding),
                        ", gx_scale=", scale_mode_name(gx_scale), ", exact=", exact ? "true" : "false", ")");
}

std::string Config::describe() const {
  if (exact) return "exact (unquantised backward)";
  const std::string gw = rank == 16 ? std::string("full rank") : detail::concat("HLA rank ", rank);
  return detail::concat("g_x ", gx_bits, "-bit HQ per ", scale_mode_name(gx_scale), ", g_w 8-bit ", gw, ", ",
                        rounding_name(rounding), " rounding");
}

int64_t Config::code() const {
  validate();
  return static_cast<int64_t>(gx_bits) | static_cast<int64_t>(rank) << 4 |
         static_cast<int64_t>(rounding == Rounding::nearest) << 9 |
         static_cast<int64_t>(gx_scale == ScaleMode::token) << 10 | static_cast<int64_t>(exact) << 11;
}

Config Config::from_code(int64_t code) {
  HOT_CHECK_VALUE(code >= 0 && code < (int64_t{1} << 12), "Config.from_code: code must be in 0..4095 (the encoding of "
                  "Config::code()), got ", code);
  Config c;
  c.gx_bits = static_cast<int>(code & 0xf);
  c.rank = static_cast<int>(code >> 4 & 0x1f);
  c.rounding = code >> 9 & 1 ? Rounding::nearest : Rounding::stochastic;
  c.gx_scale = code >> 10 & 1 ? ScaleMode::token : ScaleMode::tensor;
  c.exact = code >> 11 & 1;
  try {
    c.validate();
  } catch (const Error& e) {
    HOT_FAIL(value, "Config.from_code: code ", code, " is no configuration's code: ", e.what());
  }
  return c;
}

}  // namespace hot
