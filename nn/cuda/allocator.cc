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
    ProcessPendingLocked();
    AllocatorStats& st = StatsFor(device.index);
    ++st.requests;
    auto it = free_.find(FreeKey{device.index, stream, size});
    if (it != free_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      st.cached_bytes -= size;
      st.in_use_bytes += size;
      if (st.in_use_bytes > st.peak_in_use_bytes) st.peak_in_use_bytes = st.in_use_bytes;
      live_[p] = Block{size, device.index, stream, {}};
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
  if (err != cudaSuccess && err != cudaErrorMemoryAllocation) {
    CheckCuda(err, ("cudaMalloc(" + std::to_string(size) + " bytes on " + device.ToString() + ")").c_str());
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw CudaOutOfMemory("cudaMalloc of " + std::to_string(size) + " bytes on " + device.ToString() +
                          " failed: " + cudaGetErrorString(err) + " (" + cudaGetErrorName(err) + "); " +
                          std::to_string(st.in_use_bytes) + " bytes are held by live tensors of this process");
  }
  ++st.system_allocations;
  st.in_use_bytes += size;
  if (st.in_use_bytes > st.peak_in_use_bytes) st.peak_in_use_bytes = st.in_use_bytes;
  live_[p] = Block{size, device.index, stream, {}};
  return p;
}

void CachingCudaAllocator::RecordStream(void* ptr, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    throw std::invalid_argument("RecordStream: the pointer is not a live block of the CUDA allocator");
  }
  Block& b = it->second;
  if (stream == b.stream) return;
  for (cudaStream_t s : b.used_on) {
    if (s == stream) return;
  }
  b.used_on.push_back(stream);
}

void CachingCudaAllocator::ProcessPendingLocked() {
  for (size_t i = 0; i < pending_.size();) {
    Pending& pd = pending_[i];
    bool done = true;
    for (cudaEvent_t e : pd.events) {
      const cudaError_t err = cudaEventQuery(e);
      if (err == cudaErrorNotReady) {
        done = false;
        break;
      }
      CheckCuda(err, "cudaEventQuery (block used on another stream)");
    }
    if (!done) {
      ++i;
      continue;
    }
    for (cudaEvent_t e : pd.events) (void)cudaEventDestroy(e);
    if (caching_) {
      free_[FreeKey{pd.block.device, pd.block.stream, pd.block.size}].push_back(pd.ptr);
      StatsFor(pd.block.device).cached_bytes += pd.block.size;
    } else {
      DeviceGuard guard(pd.block.device);
      (void)cudaFree(pd.ptr);
    }
    pending_[i] = std::move(pending_.back());
    pending_.pop_back();
  }
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
  if (!b.used_on.empty()) {
    // Reuse only after every other stream has passed this point. The
    // events are recorded now; ProcessPendingLocked returns the block.
    DeviceGuard guard(b.device);
    Pending pd{ptr, b, {}};
    for (cudaStream_t s : b.used_on) {
      cudaEvent_t e = nullptr;
      CheckCuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      CheckCuda(cudaEventRecord(e, s), "cudaEventRecord (block used on another stream)");
      pd.events.push_back(e);
    }
    pending_.push_back(std::move(pd));
    if (!caching_) {
      // Without the cache the block must still not be freed before those
      // streams are done: wait for them (rare: sanitizer runs only).
      for (cudaEvent_t e : pending_.back().events) WaitEvent(e, "free of a block used on another stream");
      ProcessPendingLocked();
    }
    return;
  }
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
  for (const Pending& pd : pending_) {
    for (cudaEvent_t e : pd.events) WaitEvent(e, "EmptyCache: a block used on another stream");
  }
  ProcessPendingLocked();
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

void RecordStream(const Tensor& t, cudaStream_t stream) {
  if (!t.defined() || !t.device().is_cuda()) {
    throw std::invalid_argument("RecordStream: expected a CUDA tensor");
  }
  CudaAllocator().RecordStream(t.storage()->data(), stream);
}

CachingCudaAllocator& CudaAllocator() {
  // Never destroyed: tensors in static objects may be freed after main
  // returns, and the CUDA runtime may already be gone by then.
  static CachingCudaAllocator* allocator = new CachingCudaAllocator();
  return *allocator;
}

}  // namespace ddp::nn::cuda
