// Device discovery, build information, memory and the architecture dispatch of the CUDA backend.
#include <cstdio>
#include <mutex>
#include <sstream>
#include <vector>

#include <cublas_v2.h>

#include "common.cuh"

#ifndef HOT_CUDA_ARCHS_STR
#define HOT_CUDA_ARCHS_STR "?"
#endif
#ifndef HOT_CUTLASS_VERSION_STR
#define HOT_CUTLASS_VERSION_STR "?"
#endif

namespace hot::cuda {

namespace {

struct DeviceInfo {
  int cc = 0;
  int sms = 0;
  int64_t smem_optin = 0;  // dynamic + static shared memory one block may have (opt-in maximum)
  bool pool_ready = false;
};

std::mutex g_mutex;
std::vector<DeviceInfo> g_devices;
bool g_probed = false;
std::string g_reason;

void probe_locked() {
  if (g_probed) return;
  g_probed = true;
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    int drv = 0;
    if (cudaDriverGetVersion(&drv) != cudaSuccess) cudaGetLastError();
    if (drv == 0) {  // the runtime says "driver version is insufficient" when there is no driver at all
      g_reason = "CUDA backend compiled in, but no NVIDIA driver is loaded on this machine (no GPU?)";
    } else {
      g_reason = std::string("CUDA backend compiled in, but the CUDA runtime reports: ") + cudaGetErrorString(e);
    }
    return;
  }
  if (n == 0) {
    g_reason = "CUDA backend compiled in, but no CUDA device is visible";
    return;
  }
  g_devices.resize(n);
  for (int d = 0; d < n; ++d) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, d) == cudaSuccess) {
      g_devices[d].cc = prop.major * 10 + prop.minor;
      g_devices[d].sms = prop.multiProcessorCount;
      g_devices[d].smem_optin = static_cast<int64_t>(prop.sharedMemPerBlockOptin);
    } else {
      clear_stale_error();
    }
  }
}

const DeviceInfo& info(int device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  probe_locked();
  HOT_CHECK(device >= 0 && device < static_cast<int>(g_devices.size()), value, "CUDA device ", device,
            " does not exist (", g_devices.size(), " visible)");
  return g_devices[device];
}

// Raise the release threshold of the device's default pool once, so that freed scratch stays in the
// pool and later cudaMallocAsync calls are served from it.
void ensure_pool(int device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  probe_locked();
  if (device < 0 || device >= static_cast<int>(g_devices.size()) || g_devices[device].pool_ready) return;
  cudaMemPool_t pool;
  HOT_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
  uint64_t threshold = UINT64_MAX;
  HOT_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  g_devices[device].pool_ready = true;
}

}  // namespace

bool available() {
  std::lock_guard<std::mutex> lock(g_mutex);
  probe_locked();
  return !g_devices.empty();
}

std::string unavailable_reason() {
  std::lock_guard<std::mutex> lock(g_mutex);
  probe_locked();
  return g_devices.empty() ? g_reason : std::string();
}

int compute_capability(int device) { return info(device).cc; }
int sm_count(int device) { return info(device).sms; }
int64_t smem_per_block_optin(int device) { return info(device).smem_optin; }

// The one architecture dispatch of the backend.
GemmPath select_gemm_path(int device) {
  const int cc = compute_capability(device);
#if defined(HOT_CUDA_HAS_SM90A)
  if (cc == 90) return GemmPath::sm90_wgmma;
#endif
#if defined(HOT_CUDA_HAS_SM80)
  if (cc == 80 || cc == 86 || cc == 87 || cc == 89) return GemmPath::sm80_cutlass;
#endif
  static std::once_flag warned;
  std::call_once(warned, [cc] {
    std::fprintf(stderr,
                 "hot: warning: no tensor-core integer GEMM compiled for compute capability %d.%d (built for %s); "
                 "using the generic CUDA-core GEMM, which is much slower\n",
                 cc / 10, cc % 10, HOT_CUDA_ARCHS_STR);
  });
  return GemmPath::generic;
}

const char* gemm_path_name(GemmPath p) {
  switch (p) {
    case GemmPath::sm90_wgmma: return "sm90a CUTLASS 3.x wgmma s8";
    case GemmPath::sm80_cutlass: return "sm80 CUTLASS 2.x mma.sync s4/s8";
    case GemmPath::generic: return "generic CUDA-core";
  }
  return "?";
}

std::string build_info() {
  std::ostringstream os;
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  os << "cuda: compiled for " << HOT_CUDA_ARCHS_STR << " with CUDA " << CUDART_VERSION / 1000 << "."
     << (CUDART_VERSION % 1000) / 10 << ", CUTLASS " << HOT_CUTLASS_VERSION_STR << ", cuBLAS " << CUBLAS_VER_MAJOR
     << "." << CUBLAS_VER_MINOR << "; runtime " << rt / 1000 << "." << (rt % 1000) / 10 << ", driver ";
  if (drv == 0) {
    os << "none loaded";
  } else {
    os << drv / 1000 << "." << (drv % 1000) / 10;
  }
  os << "; kernels:";
#if defined(HOT_CUDA_HAS_SM90A)
  os << " sm90a-wgmma-s8";
#endif
#if defined(HOT_CUDA_HAS_SM80)
  os << " sm80-mma-s4/s8";
#endif
  os << " generic";
  if (!available()) {
    os << "; no device: " << unavailable_reason();
  } else {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) clear_stale_error();
    for (int d = 0; d < n; ++d) {
      cudaDeviceProp prop{};
      const cudaError_t e = cudaGetDeviceProperties(&prop, d);
      if (e != cudaSuccess) {
        clear_stale_error();
        os << "\ncuda:" << d << ": properties unavailable (" << cudaGetErrorName(e) << ")";
        continue;
      }
      os << "\ncuda:" << d << ": " << prop.name << " (sm_" << prop.major << prop.minor << ", "
         << prop.multiProcessorCount << " SMs), integer GEMM: " << gemm_path_name(select_gemm_path(d));
    }
  }
  return os.str();
}

void* allocate(size_t bytes, int device, Stream s) {
  DeviceGuard g(device);
  ensure_pool(device);
  void* p = nullptr;
  HOT_CUDA_CHECK(cudaMallocAsync(&p, bytes == 0 ? 1 : bytes, to_cuda(s)));
  return p;
}

void deallocate(void* p, int device, Stream s) {
  if (p == nullptr) return;
  int prev = 0;
  if (cudaGetDevice(&prev) != cudaSuccess) return;
  bool failed = prev != device && cudaSetDevice(device) != cudaSuccess;
  failed |= cudaFreeAsync(p, to_cuda(s)) != cudaSuccess;  // no throw: called from destructors
  failed |= prev != device && cudaSetDevice(prev) != cudaSuccess;
  if (failed) clear_stale_error();
}

void stream_order(int device, Stream first, Stream then) {
  DeviceGuard g(device);
  cudaEvent_t ev = nullptr;
  HOT_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  cudaError_t e = cudaEventRecord(ev, to_cuda(first));
  if (e == cudaSuccess) e = cudaStreamWaitEvent(to_cuda(then), ev, 0);
  cudaEventDestroy(ev);  // released once the wait is satisfied
  HOT_CUDA_CHECK(e);
}

void memset_zero(void* p, size_t bytes, int device, Stream s) {
  DeviceGuard g(device);
  HOT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, to_cuda(s)));
}

Scratch::Scratch(size_t bytes, int device, Stream s) : stream_(to_cuda(s)) {
  if (bytes == 0) return;  // nothing asked (a GEMM without workspace, a direct path): no pool call
  ensure_pool(device);
  HOT_CUDA_CHECK(cudaMallocAsync(&p_, bytes, stream_));
}

Scratch::~Scratch() {
  if (p_ && cudaFreeAsync(p_, stream_) != cudaSuccess) clear_stale_error();  // no throw in a destructor
}

}  // namespace hot::cuda
