#include "cpu/parallel.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "hot/error.h"
#include "hot/ops.h"

namespace hot {

namespace {
int default_threads() {
  if (const char* env = std::getenv("HOT_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  const unsigned hc = std::thread::hardware_concurrency();
  return hc == 0 ? 1 : static_cast<int>(hc);
}
std::atomic<int> g_threads{0};
thread_local bool t_in_parallel = false;
}  // namespace

void set_num_threads(int n) {
  HOT_CHECK_VALUE(n >= 0 && n <= 1024, "set_num_threads: n must be in 0..1024 (0 = all cores), got ", n);
  g_threads.store(n == 0 ? default_threads() : n);
}

int get_num_threads() {
  int n = g_threads.load();
  if (n == 0) {
    n = default_threads();
    g_threads.store(n);
  }
  return n;
}

namespace cpu {

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t max_chunks = (n + grain - 1) / grain;
  const int64_t threads = t_in_parallel ? 1 : std::min<int64_t>(get_num_threads(), max_chunks);
  if (threads <= 1) {
    fn(0, n);
    return;
  }
  const int64_t chunk = (n + threads - 1) / threads;
  std::exception_ptr error;
  std::mutex error_mutex;
  auto run = [&](int64_t t) {
    const int64_t b = t * chunk, e = std::min(n, b + chunk);
    if (b >= e) return;
    t_in_parallel = true;
    try {
      fn(b, e);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
    t_in_parallel = false;
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(run, t);
  run(0);
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace cpu
}  // namespace hot
