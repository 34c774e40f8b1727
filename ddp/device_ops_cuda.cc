// The CUDA build of device_ops.h (see there for the ordering model).

#include <cuda_runtime_api.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ddp/device_ops.h"
#include "nn/cuda/allocator.h"
#include "nn/cuda/stream.h"

namespace ddp::dist::internal {
namespace {

transport::Status CudaFailure(cudaError_t error, const std::string& what) {
  return transport::InternalError(what + ": " + cudaGetErrorName(error) + " (" +
                                  cudaGetErrorString(error) + ")");
}

// One communication stream per device for the whole process. Never
// destroyed: work may still reference it while static objects are torn down
// after main returns, when the CUDA runtime may already be gone.
cudaStream_t CommStream(nn::Device device) {
  static std::mutex mu;
  static auto* streams = new std::map<int, nn::cuda::Stream*>();
  std::lock_guard lock(mu);
  auto it = streams->find(device.index);
  // Made before it is entered: a creation that throws leaves no entry.
  if (it == streams->end()) it = streams->emplace(device.index, new nn::cuda::Stream(device)).first;
  return it->second->get();
}

class CudaFence final : public DeviceFence {
 public:
  CudaFence(nn::Device device, const std::vector<nn::Tensor>& tensors)
      : device_(device),
        ready_(device),
        done_(device),
        converted_(device),
        comm_(CommStream(device)) {
    ready_.Record(nn::cuda::CurrentStream(device));
    for (const nn::Tensor& t : tensors) {
      if (!t.defined() || t.numel() == 0) continue;
      try {
        nn::cuda::RecordStream(t, comm_);
      } catch (const std::invalid_argument&) {
        // Memory not from nn's allocator (Tensor::FromBlob over the
        // caller's buffer): its owner keeps it alive, and the Work holds
        // the tensor until the collective is done.
      }
    }
  }

  transport::Status WaitReady(transport::Deadline deadline) override {
    nn::cuda::DeviceGuard guard(device_.index);
    const cudaError_t wait = cudaStreamWaitEvent(comm_, ready_.get(), 0);
    if (wait != cudaSuccess) return CudaFailure(wait, "cudaStreamWaitEvent(input ready)");
    // The transport copies on its own stream: the host learns that the
    // inputs are complete before it hands their pointers over.
    return Poll(ready_.get(), deadline, "the input of a collective");
  }

  transport::Status ConvertOnCommStream(const nn::Tensor& dst, const nn::Tensor& src, bool wait,
                                        transport::Deadline deadline) override {
    try {
      nn::cuda::DeviceGuard guard(device_.index);
      nn::cuda::StreamGuard stream(device_, comm_);
      nn::NoGradGuard no_grad;
      dst.CopyFrom(src);
    } catch (const std::exception& e) {
      return transport::InternalError(std::string("converting a bucket on the communication stream: ") +
                                      e.what());
    }
    if (!wait) return transport::Status::Ok();
    nn::cuda::DeviceGuard guard(device_.index);
    const cudaError_t status = cudaEventRecord(converted_.get(), comm_);
    if (status != cudaSuccess) return CudaFailure(status, "cudaEventRecord(converted)");
    return Poll(converted_.get(), deadline, "a conversion on the communication stream");
  }

  transport::Status CopyOnCommStream(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0 || dst == src) return transport::Status::Ok();
    nn::cuda::DeviceGuard guard(device_.index);
    const cudaError_t status = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, comm_);
    if (status != cudaSuccess) return CudaFailure(status, "cudaMemcpyAsync(one-process collective)");
    return transport::Status::Ok();
  }

  transport::Status MarkDone() override {
    nn::cuda::DeviceGuard guard(device_.index);
    const cudaError_t status = cudaEventRecord(done_.get(), comm_);
    if (status != cudaSuccess) return CudaFailure(status, "cudaEventRecord(collective done)");
    return transport::Status::Ok();
  }

  void OrderConsumer() override {
    nn::cuda::DeviceGuard guard(device_.index);
    const cudaError_t status =
        cudaStreamWaitEvent(nn::cuda::CurrentStream(device_), done_.get(), 0);
    if (status != cudaSuccess) {
      throw std::runtime_error(CudaFailure(status, "cudaStreamWaitEvent(collective done)").ToString());
    }
  }

 private:
  // Polls `event` until it completed or `deadline` passed: never a blocking
  // synchronize, so a wedged peer or device becomes a TIMED_OUT. A short
  // spin, then yields, then sleeps of 2 us doubling up to 50 us (never past
  // the deadline), so that a long wait on the communication thread does not
  // hold the core the training thread launches kernels from.
  transport::Status Poll(cudaEvent_t event, transport::Deadline deadline, const std::string& what) {
    std::chrono::microseconds sleep{2};
    for (int polls = 0;; ++polls) {
      const cudaError_t status = cudaEventQuery(event);
      if (status == cudaSuccess) return transport::Status::Ok();
      if (status != cudaErrorNotReady) return CudaFailure(status, "waiting for " + what);
      const transport::Deadline now = transport::Clock::now();
      if (now >= deadline) {
        return transport::TimedOutError(what + " on " + device_.ToString() +
                                        " did not finish by the collective's deadline");
      }
      if (polls < 64) continue;
      if (polls < 512) {
        sched_yield();
        continue;
      }
      std::this_thread::sleep_for(std::min<transport::Clock::duration>(sleep, deadline - now));
      sleep = std::min(sleep * 2, std::chrono::microseconds(50));
    }
  }

  nn::Device device_;
  nn::cuda::Event ready_;
  nn::cuda::Event done_;
  nn::cuda::Event converted_;
  cudaStream_t comm_;
};

}  // namespace

bool DeviceSupportBuilt() { return true; }

std::string NoCudaMessage(const std::string& what) {
  return what + " needs CUDA, but this binary was built without it; rebuild with "
                "`bazel build --config=cuda ...`";
}

void CheckCollectiveDevice(nn::Device device, const std::string& where) {
  if (device.is_cpu()) return;
  if (!device.is_cuda()) {
    throw std::invalid_argument(where + " is on " + device.ToString() +
                                "; collectives take CPU or CUDA tensors");
  }
  try {
    nn::cuda::CheckDevice(device);
  } catch (const std::exception& e) {
    throw std::invalid_argument(where + " is on " + device.ToString() + ", which cannot be used: " +
                                e.what());
  }
}

std::unique_ptr<DeviceFence> MakeFence(nn::Device device, const std::vector<nn::Tensor>& tensors) {
  return std::make_unique<CudaFence>(device, tensors);
}

namespace {
class CudaCapturedStreams final : public CapturedStreams {
 public:
  CudaCapturedStreams() {
    for (int i = 0; i < nn::cuda::DeviceCount(); ++i) {
      const nn::Device device(nn::DeviceType::kCUDA, i);
      const cudaStream_t stream = nn::cuda::CurrentStream(device);
      // Any thread's default: nothing to install.
      if (stream != cudaStreamLegacy) streams_.emplace_back(device, stream);
    }
  }

  void Run(const std::function<void()>& fn) const override {
    std::vector<std::unique_ptr<nn::cuda::StreamGuard>> guards;
    guards.reserve(streams_.size());
    for (const auto& [device, stream] : streams_) {
      guards.push_back(std::make_unique<nn::cuda::StreamGuard>(device, stream));
    }
    fn();
  }

 private:
  std::vector<std::pair<nn::Device, cudaStream_t>> streams_;
};
}  // namespace

std::unique_ptr<CapturedStreams> CaptureCurrentStreams() { return std::make_unique<CudaCapturedStreams>(); }

}  // namespace ddp::dist::internal
