#include "cpu/parallel.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "hot/error.h"
#include "hot/ops.h"

namespace hot {

namespace {
constexpr int kMaxThreads = 1024;

int hardware_threads() {
  const unsigned hc = std::thread::hardware_concurrency();
  return hc == 0 ? 1 : static_cast<int>(std::min<unsigned>(hc, kMaxThreads));
}

// HOT_NUM_THREADS (0 or unset: all cores), else the cores.
int default_threads() {
  const char* env = std::getenv("HOT_NUM_THREADS");
  if (env == nullptr || env[0] == '\0') return hardware_threads();
  char* end = nullptr;
  errno = 0;
  const long n = std::strtol(env, &end, 10);
  HOT_CHECK_VALUE(errno == 0 && *end == '\0' && n >= 0 && n <= kMaxThreads,
                  "environment variable HOT_NUM_THREADS: expected an integer in 0..", kMaxThreads,
                  " (0 = all cores), got '", env, "'");
  return n == 0 ? hardware_threads() : static_cast<int>(n);
}
std::atomic<int> g_threads{0};
thread_local bool t_in_parallel = false;
}  // namespace

void set_num_threads(int n) {
  HOT_CHECK_VALUE(n >= 0 && n <= kMaxThreads, "set_num_threads: n must be in 0..", kMaxThreads,
                  " (0 = all cores), got ", n);
  g_threads.store(n == 0 ? hardware_threads() : n);
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
  int64_t started = 1;
  try {
    for (; started < threads; ++started) pool.emplace_back(run, started);
  } catch (const std::exception&) {
    // No more threads to be had (a process or memory limit): the calling thread runs the chunks that got none.
    // Letting this unwind would destroy running std::threads, which terminates the process.
  }
  run(0);
  for (int64_t t = started; t < threads; ++t) run(t);
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace cpu
}  // namespace hot
