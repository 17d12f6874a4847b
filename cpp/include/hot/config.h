// The HOT configuration of one layer (SPEC §3-§5, §7, §10). This is the one configuration type of hot: the Python
// class hot.Config is this struct, bound by pybind11 (cpp/bindings/config.cpp), and it reaches the operations whole.
#pragma once

#include <cstdint>
#include <string>

namespace hot {

enum class Rounding : uint8_t { stochastic, nearest };
enum class ScaleMode : uint8_t { tensor, token };

// The allowed values of each field, as the messages of validate() and of the bindings' type checks name them.
inline constexpr const char* kGxBitsAllowed = "4 or 8";
inline constexpr const char* kRankAllowed = "an integer in 1..16";
inline constexpr const char* kRoundingAllowed = "'stochastic' or 'nearest'";
inline constexpr const char* kScaleAllowed = "'tensor' or 'token'";

struct Config {
  int gx_bits = 8;                        // bit width of the g_x path (SPEC §3, default §10): 4 or 8
  int rank = 16;                          // HLA rank r of the g_w path (SPEC §4, default §10): 1..16
  Rounding rounding = Rounding::stochastic;  // rounding of the g_y-derived operands (W and x: always nearest)
  ScaleMode gx_scale = ScaleMode::tensor;    // g_x-path scale of G~: per tensor or per row (token), from LQS
  bool exact = false;                     // exact mode: unquantised backward from the raw x

  // Throws hot::Error(value) "Config: <field> must be <allowed>, got <value>".
  void validate() const;
  // "Config(gx_bits=8, rank=16, rounding=stochastic, gx_scale=tensor, exact=false)".
  std::string str() const;
  // One line: what the two backward GEMMs run ("g_x 8-bit HQ per tensor, g_w 8-bit full rank, stochastic rounding").
  std::string describe() const;

  // The compact encoding of a configuration, for boundaries that carry only scalars (the schemas of the torch custom
  // ops). Produced and parsed here and nowhere else: an integer in 0..4095 whose bits are
  //   0-3 gx_bits, 4-8 rank, 9 rounding (1 = nearest), 10 gx_scale (1 = token), 11 exact.
  // code() validates first; from_code() throws hot::Error(value) naming the code for one that no valid Config has.
  int64_t code() const;
  static Config from_code(int64_t code);

  bool operator==(const Config& o) const {
    return gx_bits == o.gx_bits && rank == o.rank && rounding == o.rounding && gx_scale == o.gx_scale &&
           exact == o.exact;
  }
  bool operator!=(const Config& o) const { return !(*this == o); }
};

const char* rounding_name(Rounding r);
const char* scale_mode_name(ScaleMode s);
// The value of a field given by name ("stochastic", "token"); throws hot::Error(value)
// "<what> must be 'stochastic' or 'nearest', got '<name>'" for any other name.
Rounding parse_rounding(const std::string& name, const char* what = "Config: rounding");
ScaleMode parse_scale_mode(const std::string& name, const char* what = "Config: gx_scale");

}  // namespace hot
