#include "nn/cuda/copy.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>

#include "nn/cuda/cuda_error.h"
#include "nn/cuda/indexing.h"
#include "nn/cuda/launch.h"
#include "nn/cuda/stream.h"

namespace ddp::nn::cuda {

namespace {

// Two pinned chunks per device. A chunk's event marks the end of the last
// DMA that used it; the buffer is touched by the host only after it.
struct Staging {
  std::mutex mu;
  void* buffers[2] = {nullptr, nullptr};
  std::unique_ptr<Event> events[2];
  bool pending[2] = {false, false};

  // All four parts are made first and kept only when every one exists: a
  // failure part way (pinned memory short, an event refused) frees what was
  // made and leaves the slot empty, so the next copy tries again instead of
  // using a null buffer or event.
  void EnsureAllocated(Device device) {
    if (buffers[0] != nullptr && buffers[1] != nullptr && events[0] && events[1]) return;
    DeviceGuard guard(device.index);
    void* made[2] = {nullptr, nullptr};
    std::unique_ptr<Event> made_events[2];
    try {
      for (int b = 0; b < 2; ++b) {
        // Portable: the DMA engines of every device may read it.
        void* p = nullptr;
        CheckCuda(cudaHostAlloc(&p, kStagingChunkBytes, cudaHostAllocPortable), "cudaHostAlloc(staging buffer)");
        made[b] = p;
        made_events[b] = std::make_unique<Event>(device);
      }
    } catch (...) {
      for (void* p : made) {
        // A failed free is not reported over the error being raised; its
        // code is read so that it is not blamed on a later call.
        if (p != nullptr && cudaFreeHost(p) != cudaSuccess) (void)cudaGetLastError();
      }
      throw;
    }
    for (int b = 0; b < 2; ++b) {
      buffers[b] = made[b];
      events[b] = std::move(made_events[b]);
      pending[b] = false;
    }
  }
  void WaitFor(int b) {
    if (pending[b]) {
      events[b]->Synchronize("reuse of a pinned staging buffer");
      pending[b] = false;
    }
  }
};

Staging& StagingFor(Device device) {
  // Never destroyed (pinned memory must not be freed after the runtime is gone).
  static std::mutex* mu = new std::mutex();
  static auto* table = new std::unordered_map<int, std::unique_ptr<Staging>>();
  std::lock_guard<std::mutex> lock(*mu);
  auto& slot = (*table)[device.index];
  if (!slot) slot = std::make_unique<Staging>();
  return *slot;
}

void HostToDevice(void* dst, Device dd, const void* src, size_t nbytes) {
  CheckDevice(dd);
  DeviceGuard guard(dd.index);
  const cudaStream_t stream = CurrentStream(dd);
  Staging& st = StagingFor(dd);
  std::lock_guard<std::mutex> lock(st.mu);
  st.EnsureAllocated(dd);
  size_t done = 0;
  for (int i = 0; done < nbytes; ++i) {
    const int b = i % 2;
    const size_t len = std::min(kStagingChunkBytes, nbytes - done);
    st.WaitFor(b);
    std::memcpy(st.buffers[b], static_cast<const char*>(src) + done, len);
    CheckCuda(cudaMemcpyAsync(static_cast<char*>(dst) + done, st.buffers[b], len, cudaMemcpyHostToDevice, stream),
              "cudaMemcpyAsync(host to device)");
    st.events[b]->Record(stream);
    st.pending[b] = true;
    done += len;
  }
}

void DeviceToHost(void* dst, const void* src, Device sd, size_t nbytes) {
  CheckDevice(sd);
  DeviceGuard guard(sd.index);
  const cudaStream_t stream = CurrentStream(sd);
  Staging& st = StagingFor(sd);
  std::lock_guard<std::mutex> lock(st.mu);
  st.EnsureAllocated(sd);
  size_t offsets[2] = {0, 0}, lengths[2] = {0, 0};
  // Drains chunk slot b into the destination once its DMA is done.
  auto drain = [&](int b) {
    st.WaitFor(b);
    std::memcpy(static_cast<char*>(dst) + offsets[b], st.buffers[b], lengths[b]);
    lengths[b] = 0;
  };
  size_t queued = 0;
  for (int i = 0; queued < nbytes; ++i) {
    const int b = i % 2;
    if (lengths[b] != 0) drain(b);
    st.WaitFor(b);
    const size_t len = std::min(kStagingChunkBytes, nbytes - queued);
    CheckCuda(cudaMemcpyAsync(st.buffers[b], static_cast<const char*>(src) + queued, len, cudaMemcpyDeviceToHost,
                              stream),
              "cudaMemcpyAsync(device to host)");
    st.events[b]->Record(stream);
    st.pending[b] = true;
    offsets[b] = queued;
    lengths[b] = len;
    queued += len;
    // Copy out the previous chunk while this one is in flight.
    if (i > 0 && lengths[1 - b] != 0) drain(1 - b);
  }
  for (int b = 0; b < 2; ++b) {
    if (lengths[b] != 0) drain(b);
  }
}

void DeviceToDevice(void* dst, Device dd, const void* src, Device sd, size_t nbytes) {
  CheckDevice(dd);
  CheckDevice(sd);
  if (dd == sd) {
    DeviceGuard guard(dd.index);
    CheckCuda(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, CurrentStream(dd)),
              "cudaMemcpyAsync(device to device)");
    return;
  }
  Event dst_ready(dd);
  dst_ready.Record(CurrentStream(dd));
  Event copied(sd);
  {
    DeviceGuard guard(sd.index);
    const cudaStream_t s = CurrentStream(sd);
    CheckCuda(cudaStreamWaitEvent(s, dst_ready.get(), 0), "cudaStreamWaitEvent(destination ready)");
    CheckCuda(cudaMemcpyPeerAsync(dst, dd.index, src, sd.index, nbytes, s),
              ("cudaMemcpyPeerAsync(" + sd.ToString() + " to " + dd.ToString() + ")").c_str());
    copied.Record(s);
  }
  DeviceGuard guard(dd.index);
  // Destroying the events right after is allowed: CUDA releases them once
  // the waits that captured them have been satisfied.
  CheckCuda(cudaStreamWaitEvent(CurrentStream(dd), copied.get(), 0), "cudaStreamWaitEvent(copy done)");
}

}  // namespace

void CopyBytes(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes) {
  if (nbytes == 0) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, nbytes);
  } else if (dst_device.is_cpu()) {
    DeviceToHost(dst, src, src_device, nbytes);
  } else if (src_device.is_cpu()) {
    HostToDevice(dst, dst_device, src, nbytes);
  } else {
    DeviceToDevice(dst, dst_device, src, src_device, nbytes);
  }
}

void CopyStrided(const Tensor& dst, const Tensor& src) {
  if (dst.device() != src.device() || !dst.device().is_cuda()) {
    throw std::invalid_argument("CUDA copy_strided: source on " + src.device().ToString() + " and destination on " +
                                dst.device().ToString() + " (expected one CUDA device)");
  }
  if (dst.shape() != src.shape()) {
    throw std::invalid_argument("CUDA copy_strided: source " + ShapeToString(src.shape()) + " and destination " +
                                ShapeToString(dst.shape()) + " differ in shape");
  }
  if (dst.numel() == 0) return;
  DeviceGuard guard(dst.device().index);
  const cudaStream_t stream = CurrentStream(dst.device());
  if (dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous()) {
    if (dst.data_ptr() != src.data_ptr()) {
      CheckCuda(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), dst.nbytes(), cudaMemcpyDeviceToDevice, stream),
                "cudaMemcpyAsync(device to device)");
    }
    return;
  }
  const launch::Indexing ix = MakeIndexing("copy", dst.shape(), {dst.strides(), src.strides()});
  LaunchChecked("kernel `copy`", [&] {
    return launch::Copy(ix, dst.numel(), dst.data_ptr(), ToDt(dst.dtype()), src.data_ptr(), ToDt(src.dtype()), stream);
  });
}

void Fill(const Tensor& dst, const void* value) {
  if (!dst.device().is_cuda()) {
    throw std::invalid_argument("CUDA fill: tensor on " + dst.device().ToString() + " (expected a CUDA device)");
  }
  if (dst.numel() == 0) return;
  const size_t elem = dst.element_size();
  const auto* bytes = static_cast<const unsigned char*>(value);
  bool uniform = true;
  for (size_t i = 1; i < elem; ++i) uniform = uniform && bytes[i] == bytes[0];
  DeviceGuard guard(dst.device().index);
  const cudaStream_t stream = CurrentStream(dst.device());
  if (uniform && dst.is_contiguous()) {
    CheckCuda(cudaMemsetAsync(dst.data_ptr(), bytes[0], dst.nbytes(), stream), "cudaMemsetAsync (fill)");
    return;
  }
  const launch::Indexing ix = MakeIndexing("fill", dst.shape(), {dst.strides()});
  LaunchChecked("kernel `fill`",
                [&] { return launch::Fill(ix, dst.numel(), dst.data_ptr(), value, static_cast<int>(elem), stream); });
}

void Synchronize(Device device) { SynchronizeDevice(device); }

}  // namespace ddp::nn::cuda
