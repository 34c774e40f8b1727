#include "nn/cuda/allocator.h"

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>

#include "nn/cuda/cuda_error.h"
#include "nn/cuda/stream.h"

namespace ddp::nn::cuda {

namespace {

constexpr size_t kSmallStep = 512;
constexpr size_t kLargeThreshold = size_t{1} << 20;

bool CachingFromEnv() {
  const char* env = std::getenv("DDP_NN_CUDA_CACHE");
  return env == nullptr || std::string_view(env) != "0";
}

}  // namespace

CachingCudaAllocator::CachingCudaAllocator() : caching_(CachingFromEnv()) {}

size_t CachingCudaAllocator::RoundSize(size_t nbytes) {
  if (nbytes == 0) return kSmallStep;  // a distinct, valid address for empty tensors
  if (nbytes < kLargeThreshold) return (nbytes + kSmallStep - 1) / kSmallStep * kSmallStep;
  // Eight classes between consecutive powers of two.
  size_t pow2 = kLargeThreshold;
  while (pow2 * 2 < nbytes) pow2 *= 2;
  const size_t step = pow2 / 8;
  return (nbytes + step - 1) / step * step;
}

AllocatorStats& CachingCudaAllocator::StatsFor(int device) { return stats_[device]; }

void* CachingCudaAllocator::Allocate(size_t nbytes, Device device) {
  if (!device.is_cuda()) {
    throw std::invalid_argument("CUDA allocator asked for memory on " + device.ToString());
  }
  const size_t size = RoundSize(nbytes);
  const cudaStream_t stream = CurrentStream(device);
  {
    std::lock_guard<std::mutex> lock(mu_);
    AllocatorStats& st = StatsFor(device.index);
    ++st.requests;
    auto it = free_.find(FreeKey{device.index, stream, size});
    if (it != free_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      st.cached_bytes -= size;
      st.in_use_bytes += size;
      if (st.in_use_bytes > st.peak_in_use_bytes) st.peak_in_use_bytes = st.in_use_bytes;
      live_[p] = Block{size, device.index, stream};
      return p;
    }
  }
  CheckDevice(device);
  DeviceGuard guard(device.index);
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, size);
  std::lock_guard<std::mutex> lock(mu_);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    ReleaseCachedLocked(device.index);
    err = cudaMalloc(&p, size);
  }
  AllocatorStats& st = StatsFor(device.index);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw CudaOutOfMemory("cudaMalloc of " + std::to_string(size) + " bytes on " + device.ToString() +
                          " failed: " + cudaGetErrorString(err) + " (" + cudaGetErrorName(err) + "); " +
                          std::to_string(st.in_use_bytes) + " bytes are held by live tensors of this process");
  }
  ++st.system_allocations;
  st.in_use_bytes += size;
  if (st.in_use_bytes > st.peak_in_use_bytes) st.peak_in_use_bytes = st.in_use_bytes;
  live_[p] = Block{size, device.index, stream};
  return p;
}

void CachingCudaAllocator::Deallocate(void* ptr, size_t /*nbytes*/, Device device) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    // An invariant of Storage, not a user error: abort loudly.
    std::fprintf(stderr, "CachingCudaAllocator: Deallocate of unknown pointer %p on %s\n", ptr,
                 device.ToString().c_str());
    std::abort();
  }
  const Block b = it->second;
  live_.erase(it);
  AllocatorStats& st = StatsFor(b.device);
  st.in_use_bytes -= b.size;
  if (caching_) {
    free_[FreeKey{b.device, b.stream, b.size}].push_back(ptr);
    st.cached_bytes += b.size;
    return;
  }
  // Without the cache, the block may still be in use by queued work:
  // cudaFree waits for the device before it releases the memory.
  DeviceGuard guard(b.device);
  (void)cudaFree(ptr);
}

void CachingCudaAllocator::ReleaseCachedLocked(int device) {
  bool any = false;
  for (auto& [key, list] : free_) any = any || (std::get<0>(key) == device && !list.empty());
  if (!any) return;
  DeviceGuard guard(device);
  // Blocks on a stream may still be read by work queued before they were
  // freed; wait for the device so that cudaFree never races it.
  SynchronizeDevice(Device(DeviceType::kCUDA, device));
  AllocatorStats& st = StatsFor(device);
  for (auto it = free_.begin(); it != free_.end();) {
    if (std::get<0>(it->first) != device) {
      ++it;
      continue;
    }
    for (void* p : it->second) {
      CheckCuda(cudaFree(p), "cudaFree");
      st.cached_bytes -= std::get<2>(it->first);
    }
    it = free_.erase(it);
  }
}

void CachingCudaAllocator::EmptyCache() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int> devices;
  for (const auto& [key, list] : free_) {
    if (!list.empty() && (devices.empty() || devices.back() != std::get<0>(key))) devices.push_back(std::get<0>(key));
  }
  for (int d : devices) ReleaseCachedLocked(d);
}

AllocatorStats CachingCudaAllocator::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  AllocatorStats sum;
  for (const auto& [device, st] : stats_) {
    sum.in_use_bytes += st.in_use_bytes;
    sum.peak_in_use_bytes += st.peak_in_use_bytes;
    sum.cached_bytes += st.cached_bytes;
    sum.requests += st.requests;
    sum.system_allocations += st.system_allocations;
  }
  return sum;
}

AllocatorStats CachingCudaAllocator::Stats(Device device) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = stats_.find(device.index);
  return it == stats_.end() ? AllocatorStats{} : it->second;
}

void CachingCudaAllocator::set_caching_enabled(bool enabled) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    caching_ = enabled;
  }
  if (!enabled) EmptyCache();
}

CachingCudaAllocator& CudaAllocator() {
  // Never destroyed: tensors in static objects may be freed after main
  // returns, and the CUDA runtime may already be gone by then.
  static CachingCudaAllocator* allocator = new CachingCudaAllocator();
  return *allocator;
}

}  // namespace ddp::nn::cuda
