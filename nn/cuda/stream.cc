#include "nn/cuda/stream.h"

#include <cuda.h>  // types only: nothing links libcuda

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "nn/cuda/cuda_error.h"
#include "nn/tensor/env_value.h"

namespace ddp::nn::cuda {

namespace {

// DDP_NN_CUDA_TIMEOUT_S: a value it does not take ("abc", "10s", "0") used
// to keep 600 s without a word, and "12abc" gave 12 s. At most a year, so
// that now() + the timeout stays within steady_clock's range.
std::chrono::milliseconds TimeoutFromEnv() {
  constexpr int64_t kDefaultSeconds = 600;
  constexpr int64_t kMostSeconds = int64_t{365} * 24 * 3600;
  std::string problem;
  const std::optional<int64_t> seconds =
      ParseSeconds("DDP_NN_CUDA_TIMEOUT_S", std::getenv("DDP_NN_CUDA_TIMEOUT_S"), kMostSeconds, &problem);
  if (!problem.empty()) {
    std::fprintf(stderr, "[ddp] warning: %s; keeping %lld s\n", problem.c_str(),
                 static_cast<long long>(kDefaultSeconds));
  }
  return std::chrono::seconds(seconds.value_or(kDefaultSeconds));
}

std::atomic<int64_t> g_timeout_ms{TimeoutFromEnv().count()};

// Ids that StreamId gives to handles not owned by a Stream; Stream ids are
// counted from 1 and never reach this bit.
constexpr uint64_t kForeignStreamBit = uint64_t{1} << 63;

uint64_t ForeignStreamId(cudaStream_t stream) {
  return kForeignStreamBit | static_cast<uint64_t>(reinterpret_cast<uintptr_t>(stream));
}

std::atomic<uint64_t> g_next_stream_id{1};

// The live Streams by handle (a handle names at most one live stream).
// Never destroyed: Streams may be destroyed after main returns.
struct StreamRegistry {
  std::mutex mu;
  std::unordered_map<cudaStream_t, uint64_t> ids;
  std::unordered_set<uint64_t> live;
};

StreamRegistry& Registry() {
  static auto* registry = new StreamRegistry();
  return *registry;
}

struct CurrentStreamEntry {
  cudaStream_t stream;
  uint64_t id;  // StreamId(stream), looked up once by StreamGuard
};

// Per thread: device index -> current stream (absent: the legacy default stream).
thread_local std::unordered_map<int, CurrentStreamEntry> tls_streams;

}  // namespace

namespace {

// Whether `device`'s primary context exists already. Since CUDA 12,
// cudaSetDevice creates it: a scope that put device 0 back on a thread that
// never used it (a communication thread) would give every process a
// context on GPU 0, hundreds of MiB each. The runtime has no call for this;
// the driver's cuDevicePrimaryCtxGetState is reached through its entry
// point (nothing links libcuda). True when it cannot be asked, which keeps
// the plain restore.
// (transport/cuda/cuda_util.h has the same check for its DeviceScope.)
bool PrimaryContextActive(int device) {
  using DeviceGet = CUresult (*)(CUdevice*, int);
  using GetState = CUresult (*)(CUdevice, unsigned int*, int*);
  struct Driver {
    DeviceGet device_get = nullptr;
    GetState get_state = nullptr;
  };
  static const Driver driver = [] {
    Driver d;
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuDeviceGet", &fn, 12000, cudaEnableDefault, &found) ==
            cudaSuccess &&
        found == cudaDriverEntryPointSuccess) {
      d.device_get = reinterpret_cast<DeviceGet>(fn);
    }
    if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &fn, 12000, cudaEnableDefault,
                                         &found) == cudaSuccess &&
        found == cudaDriverEntryPointSuccess) {
      d.get_state = reinterpret_cast<GetState>(fn);
    }
    (void)cudaGetLastError();
    return d;
  }();
  if (driver.device_get == nullptr || driver.get_state == nullptr) return true;
  CUdevice handle{};
  unsigned int flags = 0;
  int active = 1;
  if (driver.device_get(&handle, device) != CUDA_SUCCESS) return true;
  if (driver.get_state(handle, &flags, &active) != CUDA_SUCCESS) return true;
  return active != 0;
}

}  // namespace

DeviceGuard::DeviceGuard(int index) : previous_(0), changed_(false) {
  CheckCuda(cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != index) {
    CheckCuda(cudaSetDevice(index), ("cudaSetDevice(" + std::to_string(index) + ")").c_str());
    changed_ = true;
  }
}

DeviceGuard::~DeviceGuard() {
  if (changed_ && PrimaryContextActive(previous_)) (void)cudaSetDevice(previous_);
}

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

void CheckDevice(Device device) {
  if (!device.is_cuda()) throw std::invalid_argument("expected a CUDA device, got " + device.ToString());
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw CudaError("device " + device.ToString() + " is not usable: cudaGetDeviceCount failed: " +
                        cudaGetErrorString(err) + " (" + cudaGetErrorName(err) + ")",
                    static_cast<int>(err));
  }
  if (device.index < 0 || device.index >= n) {
    throw std::invalid_argument("device " + device.ToString() + " does not exist: this process sees " +
                                std::to_string(n) + " CUDA device(s)");
  }
}

Stream::Stream(Device device) : device_(device) {
  CheckDevice(device);
  DeviceGuard guard(device.index);
  CheckCuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  id_ = g_next_stream_id.fetch_add(1);
  try {
    StreamRegistry& r = Registry();
    std::lock_guard<std::mutex> lock(r.mu);
    r.ids[stream_] = id_;
    r.live.insert(id_);
  } catch (...) {
    (void)cudaStreamDestroy(stream_);  // the destructor will not run
    throw;
  }
}

Stream::~Stream() {
  if (stream_ == nullptr) return;
  {
    // Before the handle is released: from then on CUDA may hand it out again.
    StreamRegistry& r = Registry();
    std::lock_guard<std::mutex> lock(r.mu);
    r.ids.erase(stream_);
    r.live.erase(id_);
  }
  // A destructor must not throw: a failure is reported and the stream left
  // to the process.
  try {
    DeviceGuard guard(device_.index);
    const cudaError_t err = cudaStreamDestroy(stream_);  // returns at once; queued work still completes
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      std::fprintf(stderr, "nn::cuda::Stream: cudaStreamDestroy on cuda:%d failed: %s (%s)\n", device_.index,
                   cudaGetErrorString(err), cudaGetErrorName(err));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nn::cuda::Stream: the stream on cuda:%d was not destroyed: %s\n", device_.index, e.what());
  }
}

void Stream::Wait(cudaEvent_t event) const { CheckCuda(cudaStreamWaitEvent(stream_, event, 0), "cudaStreamWaitEvent"); }

void Stream::Synchronize() const {
  Event done(device_);
  done.Record(stream_);
  done.Synchronize("Stream::Synchronize");
}

Event::Event(Device device) : device_(device) {
  DeviceGuard guard(device.index);
  CheckCuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
}

Event::~Event() {
  if (event_ != nullptr) (void)cudaEventDestroy(event_);
}

void Event::Record(cudaStream_t stream) const {
  DeviceGuard guard(device_.index);
  CheckCuda(cudaEventRecord(event_, stream), "cudaEventRecord");
}

bool Event::Query() const {
  const cudaError_t err = cudaEventQuery(event_);
  if (err == cudaErrorNotReady) return false;
  CheckCuda(err, "cudaEventQuery");
  return true;
}

void Event::Synchronize(const char* what) const { WaitEvent(event_, what); }

cudaStream_t CurrentStream(Device device) {
  auto it = tls_streams.find(device.index);
  return it == tls_streams.end() ? cudaStreamLegacy : it->second.stream;
}

uint64_t StreamId(cudaStream_t stream) {
  StreamRegistry& r = Registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.ids.find(stream);
  return it != r.ids.end() ? it->second : ForeignStreamId(stream);
}

uint64_t CurrentStreamId(Device device) {
  auto it = tls_streams.find(device.index);
  return it == tls_streams.end() ? ForeignStreamId(cudaStreamLegacy) : it->second.id;
}

bool StreamAlive(uint64_t id) {
  if ((id & kForeignStreamBit) != 0) return true;
  StreamRegistry& r = Registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.live.count(id) != 0;
}

StreamGuard::StreamGuard(Device device, cudaStream_t stream) : index_(device.index) {
  previous_ = CurrentStream(device);
  previous_id_ = CurrentStreamId(device);
  tls_streams[index_] = CurrentStreamEntry{stream, StreamId(stream)};
}

StreamGuard::~StreamGuard() { tls_streams[index_] = CurrentStreamEntry{previous_, previous_id_}; }

std::chrono::milliseconds WaitTimeout() { return std::chrono::milliseconds(g_timeout_ms.load()); }

void SetWaitTimeout(std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0) {
    throw std::invalid_argument("SetWaitTimeout: the timeout must be positive, got " +
                                std::to_string(timeout.count()) + " ms");
  }
  g_timeout_ms = timeout.count();
}

void WaitEvent(cudaEvent_t event, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + WaitTimeout();
  // Spin with yields first (a small copy completes in microseconds), then
  // back off so a long kernel does not burn a host core.
  for (int spins = 0;; ++spins) {
    const cudaError_t err = cudaEventQuery(event);
    if (err == cudaSuccess) return;
    if (err != cudaErrorNotReady) CheckCuda(err, (std::string("cudaEventQuery (waiting for ") + what + ")").c_str());
    if (std::chrono::steady_clock::now() > deadline) {
      throw std::runtime_error(std::string("timed out after ") + std::to_string(WaitTimeout().count()) +
                               " ms waiting for the GPU (" + what +
                               "); raise DDP_NN_CUDA_TIMEOUT_S if the work is legitimately that long");
    }
    if (spins < 2000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

void SynchronizeDevice(Device device) {
  CheckDevice(device);
  Event legacy(device);
  legacy.Record(cudaStreamLegacy);
  legacy.Synchronize(("synchronize " + device.ToString()).c_str());
  const cudaStream_t current = CurrentStream(device);
  if (current != cudaStreamLegacy) {
    Event cur(device);
    cur.Record(current);
    cur.Synchronize(("synchronize the current stream of " + device.ToString()).c_str());
  }
}

}  // namespace ddp::nn::cuda
