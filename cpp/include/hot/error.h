// hot::Error and the check-macro vocabulary used by every layer of the core.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace hot {

// What went wrong, so that bindings can map it to the right exception type:
// type   -> TypeError   (wrong dtype)
// value  -> ValueError  (wrong shape, layout, device, range, empty input)
// internal -> RuntimeError (a CUDA/cuBLAS status, a broken invariant)
// unavailable -> RuntimeError (a backend or kernel that is not compiled in)
enum class ErrorKind { type, value, internal, unavailable };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& msg) : std::runtime_error(msg), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
[[noreturn]] void throw_error(ErrorKind kind, const char* file, int line, const std::string& msg);
}  // namespace detail

}  // namespace hot

// User errors carry only the message; internal errors carry "<kind> error (<file>:<line>): <msg>".
#define HOT_FAIL(kind, ...) \
  ::hot::detail::throw_error(::hot::ErrorKind::kind, __FILE__, __LINE__, ::hot::detail::concat(__VA_ARGS__))

#define HOT_CHECK(cond, kind, ...)  \
  do {                              \
    if (!(cond)) HOT_FAIL(kind, __VA_ARGS__); \
  } while (0)

#define HOT_CHECK_VALUE(cond, ...) HOT_CHECK(cond, value, __VA_ARGS__)
#define HOT_CHECK_TYPE(cond, ...) HOT_CHECK(cond, type, __VA_ARGS__)
#define HOT_INTERNAL_CHECK(cond, ...) HOT_CHECK(cond, internal, "check failed: " #cond ": ", __VA_ARGS__)

// Checks on a TensorView `t` called `name` inside operation `op` (all strings).
#define HOT_CHECK_DIM(op, name, t, nd)                                                          \
  HOT_CHECK_VALUE((t).ndim() == (nd), op, ": ", name, " has ", (t).ndim(), " dims, expected ", nd, \
                  " (got shape ", ::hot::shape_str((t).shape), ")")

#define HOT_CHECK_DTYPE(op, name, t, ok_expr, expected_str)                                     \
  HOT_CHECK_TYPE(ok_expr, op, ": ", name, " has dtype ", ::hot::dtype_name((t).dtype), ", expected ", \
                 expected_str)

#define HOT_CHECK_NONEMPTY(op, name, t)                                                                     \
  do {                                                                                                      \
    for (const int64_t hot_d_ : (t).shape)                                                                  \
      HOT_CHECK_VALUE(hot_d_ >= 0, op, ": ", name, " has a negative size (shape ", ::hot::shape_str((t).shape), \
                      ")");                                                                                 \
    HOT_CHECK_VALUE((t).numel() > 0, op, ": ", name, " is empty (shape ", ::hot::shape_str((t).shape), ")");  \
  } while (0)

#define HOT_CHECK_SAME_DEVICE(op, name_a, a, name_b, b)                                              \
  HOT_CHECK_VALUE((a).device == (b).device, op, ": ", name_a, " is on ", ::hot::device_str((a).device), \
                  " but ", name_b, " is on ", ::hot::device_str((b).device),                          \
                  "; all tensors must be on one device")

#define HOT_CHECK_SHAPE(op, name, t, expected_shape)                                                 \
  HOT_CHECK_VALUE((t).shape == (expected_shape), op, ": ", name, " has shape ", ::hot::shape_str((t).shape), \
                  ", expected ", ::hot::shape_str(expected_shape))
