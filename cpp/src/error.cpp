#include "hot/error.h"

#include <cstring>

namespace hot::detail {

[[noreturn]] void throw_error(ErrorKind kind, const char* file, int line, const std::string& msg) {
  if (kind == ErrorKind::internal) {
    const char* base = std::strrchr(file, '/');
    throw Error(kind, concat("internal error (", base ? base + 1 : file, ":", line, "): ", msg));
  }
  throw Error(kind, msg);
}

}  // namespace hot::detail
