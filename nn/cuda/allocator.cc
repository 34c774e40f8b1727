#include "nn/cuda/allocator.h"

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>

#include "nn/cuda/cuda_error.h"
#include "nn/cuda/stream.h"
#include "nn/tensor/env_value.h"

namespace ddp::nn::cuda {

namespace {

constexpr size_t kSmallStep = 512;
constexpr size_t kLargeThreshold = size_t{1} << 20;

// DDP_NN_CUDA_CACHE, with the spellings DDP_NN_CPU_CACHE takes: only "0"
// used to turn caching off, so "off" or "false" left it on without a word.
bool CachingFromEnv() { return OnOffFromEnv("DDP_NN_CUDA_CACHE", true, "the CUDA allocator's default (caching)"); }

// A block given up on the way back to the cache: it stays allocated and is
// never handed out again. For paths that must not throw (Deallocate runs in
// ~Storage), so the report goes to stderr.
void ReportLeak(void* ptr, size_t size, int device, const char* why) noexcept {
  std::fprintf(stderr, "CachingCudaAllocator: leaking the %zu-byte block %p on cuda:%d: %s\n", size, ptr, device,
               why);
}

void ReportLeak(void* ptr, size_t size, int device, const char* call, cudaError_t err) noexcept {
  std::fprintf(stderr, "CachingCudaAllocator: leaking the %zu-byte block %p on cuda:%d: %s failed: %s (%s)\n", size,
               ptr, device, call, cudaGetErrorString(err), cudaGetErrorName(err));
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
  const uint64_t stream_id = CurrentStreamId(device);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ProcessPendingLocked();
    AllocatorStats& st = StatsFor(device.index);
    ++st.requests;
    auto it = free_.find(FreeKey{device.index, stream_id, size});
    if (it != free_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      st.cached_bytes -= size;
      st.in_use_bytes += size;
      if (st.in_use_bytes > st.peak_in_use_bytes) st.peak_in_use_bytes = st.in_use_bytes;
      live_[p] = Block{size, device.index, stream_id, {}};
      return p;
    }
  }
  CheckDevice(device);
  DeviceGuard guard(device.index);
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, size);
  // Out of memory: the cache goes back to CUDA and the request is tried once
  // more. A failure while releasing is named in the out-of-memory error
  // instead of replacing it: callers that retry smaller on std::bad_alloc
  // (the cuDNN workspace search) must still get one.
  std::string release_failure;
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    try {
      ReleaseCached(device.index);
    } catch (const std::exception& e) {
      // Some blocks may have gone back before the failure: the retry is
      // still worth making. A device in a sticky error state fails it with
      // that error, which is then raised as it is, not as out of memory.
      release_failure = e.what();
    }
    err = cudaMalloc(&p, size);
  }
  std::lock_guard<std::mutex> lock(mu_);
  AllocatorStats& st = StatsFor(device.index);
  if (err != cudaSuccess && err != cudaErrorMemoryAllocation) {
    CheckCuda(err, ("cudaMalloc(" + std::to_string(size) + " bytes on " + device.ToString() + ")").c_str());
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    std::string message = "cudaMalloc of " + std::to_string(size) + " bytes on " + device.ToString() +
                          " failed: " + cudaGetErrorString(err) + " (" + cudaGetErrorName(err) + "); " +
                          std::to_string(st.in_use_bytes) + " bytes are held by live tensors of this process";
    if (!release_failure.empty()) {
      message += "; releasing the cached blocks for a retry failed too: " + release_failure;
    }
    throw CudaOutOfMemory(std::move(message));
  }
  ++st.system_allocations;
  st.in_use_bytes += size;
  if (st.in_use_bytes > st.peak_in_use_bytes) st.peak_in_use_bytes = st.in_use_bytes;
  live_[p] = Block{size, device.index, stream_id, {}};
  return p;
}

void CachingCudaAllocator::RecordStream(void* ptr, cudaStream_t stream) {
  const uint64_t stream_id = StreamId(stream);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    throw std::invalid_argument("RecordStream: the pointer is not a live block of the CUDA allocator");
  }
  Block& b = it->second;
  if (stream_id == b.stream_id) return;
  for (const UsedOn& u : b.used_on) {
    if (u.stream_id == stream_id) return;
  }
  b.used_on.push_back(UsedOn{stream, stream_id});
}

void CachingCudaAllocator::ProcessPendingLocked() noexcept {
  for (size_t i = 0; i < pending_.size();) {
    Pending& pd = pending_[i];
    bool done = true;
    cudaError_t failed = cudaSuccess;
    for (cudaEvent_t e : pd.events) {
      const cudaError_t err = cudaEventQuery(e);
      if (err == cudaSuccess) continue;
      if (err == cudaErrorNotReady) {
        done = false;
      } else {
        (void)cudaGetLastError();
        failed = err;
      }
      break;
    }
    if (!done) {
      ++i;
      continue;
    }
    for (cudaEvent_t e : pd.events) (void)cudaEventDestroy(e);
    if (failed != cudaSuccess) {
      // Whether the other streams are past the block is unknown: it must
      // never be handed out again.
      ReportLeak(pd.ptr, pd.block.size, pd.block.device, "cudaEventQuery (block used on another stream)", failed);
    } else {
      ReturnBlockLocked(pd.ptr, pd.block);
    }
    pending_[i] = std::move(pending_.back());
    pending_.pop_back();
  }
}

void CachingCudaAllocator::ReturnBlockLocked(void* ptr, const Block& b) noexcept {
  try {
    if (caching_) {
      AllocatorStats& st = StatsFor(b.device);  // exists since the block's Allocate
      free_[FreeKey{b.device, b.stream_id, b.size}].push_back(ptr);
      st.cached_bytes += b.size;
      return;
    }
    // Without the cache, the block may still be in use by queued work:
    // cudaFree waits for the device before it releases the memory.
    DeviceGuard guard(b.device);
    const cudaError_t err = cudaFree(ptr);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      ReportLeak(ptr, b.size, b.device, "cudaFree", err);
    }
  } catch (const std::exception& e) {
    ReportLeak(ptr, b.size, b.device, e.what());
  } catch (...) {
    ReportLeak(ptr, b.size, b.device, "unknown exception");
  }
}

void CachingCudaAllocator::HoldUntilStreamsPassLocked(void* ptr, Block b) noexcept {
  // Reuse only after every other stream has passed this point: an event is
  // recorded on each now, and ProcessPendingLocked returns the block.
  Pending pd{ptr, std::move(b), {}};
  try {
    pd.events.reserve(pd.block.used_on.size());
    DeviceGuard guard(pd.block.device);
    for (const UsedOn& u : pd.block.used_on) {
      // A destroyed stream's handle may name another stream by now, and its
      // remaining work cannot be waited for.
      if (!StreamAlive(u.stream_id)) {
        throw std::runtime_error("a stream it was used on (RecordStream) was destroyed before it was freed");
      }
      cudaEvent_t e = nullptr;
      CheckCuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      pd.events.push_back(e);  // reserved: cannot throw, so e is destroyed below on failure
      CheckCuda(cudaEventRecord(e, u.stream), "cudaEventRecord (block used on another stream)");
    }
    pending_.push_back(std::move(pd));  // on failure pd is left as it was
  } catch (const std::exception& e) {
    for (cudaEvent_t ev : pd.events) (void)cudaEventDestroy(ev);
    ReportLeak(ptr, pd.block.size, pd.block.device, e.what());
    return;
  }
  if (!caching_) {
    // Without the cache the block must still not be freed before those
    // streams are done: wait for them (rare: sanitizer runs only).
    try {
      for (cudaEvent_t e : pending_.back().events) WaitEvent(e, "free of a block used on another stream");
    } catch (const std::exception& e) {
      // Left pending: a later ProcessPendingLocked frees it once the streams
      // are past it, or gives it up if their events fail.
      std::fprintf(stderr, "CachingCudaAllocator: the %zu-byte block %p on cuda:%d stays held: %s\n",
                   pending_.back().block.size, ptr, pending_.back().block.device, e.what());
    }
    ProcessPendingLocked();
  }
}

void CachingCudaAllocator::Deallocate(void* ptr, size_t /*nbytes*/, Device device) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    // An invariant of Storage, not a user error: abort loudly.
    std::fprintf(stderr, "CachingCudaAllocator: Deallocate of unknown pointer %p on cuda:%d\n", ptr, device.index);
    std::abort();
  }
  Block b = std::move(it->second);
  live_.erase(it);
  StatsFor(b.device).in_use_bytes -= b.size;  // exists since the block's Allocate
  if (b.used_on.empty()) {
    ReturnBlockLocked(ptr, b);
  } else {
    HoldUntilStreamsPassLocked(ptr, std::move(b));
  }
}

bool CachingCudaAllocator::HoldsCachedLocked(int device) const {
  for (const auto& [key, list] : free_) {
    if (std::get<0>(key) == device && !list.empty()) return true;
  }
  return false;
}

void CachingCudaAllocator::ReleaseCached(int device) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!HoldsCachedLocked(device)) return;
  }
  // The long wait, for everything queued so far, is made without the lock,
  // so that frees and cache hits on other threads go on meanwhile.
  // ReleaseCachedLocked waits again under the lock, which then covers only
  // the work queued since, before it frees anything.
  SynchronizeDevice(Device(DeviceType::kCUDA, device));
  std::lock_guard<std::mutex> lock(mu_);
  ReleaseCachedLocked(device);
}

void CachingCudaAllocator::ReleaseCachedLocked(int device) {
  if (!HoldsCachedLocked(device)) return;
  DeviceGuard guard(device);
  // Blocks on a stream may still be read by work queued before they were
  // freed; wait for the device so that cudaFree never races it.
  SynchronizeDevice(Device(DeviceType::kCUDA, device));
  AllocatorStats& st = StatsFor(device);
  // Every block leaves the cache, freed or not: after a failed cudaFree the
  // block's state is unknown, so it is leaked rather than handed out again.
  cudaError_t first_error = cudaSuccess;
  size_t leaked_blocks = 0, leaked_bytes = 0;
  for (auto it = free_.begin(); it != free_.end();) {
    if (std::get<0>(it->first) != device) {
      ++it;
      continue;
    }
    const size_t size = std::get<2>(it->first);
    for (void* p : it->second) {
      const cudaError_t err = cudaFree(p);
      if (err != cudaSuccess) {
        (void)cudaGetLastError();
        if (first_error == cudaSuccess) first_error = err;
        ++leaked_blocks;
        leaked_bytes += size;
      }
      st.cached_bytes -= size;
    }
    it = free_.erase(it);
  }
  if (first_error != cudaSuccess) {
    throw CudaError("cudaFree of cached blocks on cuda:" + std::to_string(device) + " failed: " +
                        cudaGetErrorString(first_error) + " (" + cudaGetErrorName(first_error) + "); " +
                        std::to_string(leaked_blocks) + " block(s), " + std::to_string(leaked_bytes) +
                        " bytes, were left allocated and dropped from the cache",
                    static_cast<int>(first_error));
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
