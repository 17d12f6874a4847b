// A minimal fork-join parallel_for for the CPU backend. Work is split into contiguous chunks of the
// index range; results never depend on the split (every reduction in the CPU backend is either
// order-independent, like max, or done per output element in a fixed order).
#pragma once

#include <cstdint>
#include <functional>

namespace hot::cpu {

// Calls fn(begin, end) on disjoint chunks covering [0, n), each of at least `grain` indices, on up
// to get_num_threads() threads. Nested calls run serially. Exceptions are rethrown in the caller.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace hot::cpu
