// Devices, streams and events.
//
// Ordering model: every nn kernel and copy for a tensor on cuda:N is queued
// on the calling thread's *current stream* of device N. It is the device's
// legacy default stream unless a StreamGuard selects another one, so code
// that never mentions streams is ordered exactly as it is written. Work on a
// second stream (a communication stream) is ordered against it only through
// events: record on one stream, make the other wait (Stream::Wait).
//
// Host waits (for a copy to the host, or Synchronize) poll with a deadline
// (WaitTimeout(), default 600 s, DDP_NN_CUDA_TIMEOUT_S overrides) and throw
// naming what was awaited, rather than block forever on a wedged device.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>

#include "nn/tensor/device.h"

namespace ddp::nn::cuda {

/// Makes `index` the current CUDA device for its scope and restores the
/// previous one, unless that one has no context yet (the default device 0 of
/// a thread that never chose one: since CUDA 12 restoring it would create a
/// context there).
class DeviceGuard {
 public:
  explicit DeviceGuard(int index);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_;
  bool changed_;
};

/// Number of visible CUDA devices (0 when there is none or no driver).
int DeviceCount();
/// Throws naming the device unless it is a CUDA device this process can see.
void CheckDevice(Device device);

/// An owned, non-blocking CUDA stream on one device.
class Stream {
 public:
  /// Creates a stream on `device` (cudaStreamNonBlocking: it does not
  /// serialize with the legacy default stream; order it with events).
  explicit Stream(Device device);
  /// Queued work still completes. Never throws: a failed destroy is
  /// reported on stderr.
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  cudaStream_t get() const { return stream_; }
  Device device() const { return device_; }
  /// Never reused in this process, unlike the handle, which CUDA may give
  /// to a stream created after this one is destroyed: per-stream caches key
  /// by it (see StreamId).
  uint64_t id() const { return id_; }
  /// Makes later work on this stream wait for everything recorded in `event`
  /// (no host wait).
  void Wait(cudaEvent_t event) const;
  /// Host wait, with the deadline of WaitTimeout(), until the stream is idle.
  void Synchronize() const;

 private:
  Device device_;
  cudaStream_t stream_ = nullptr;
  uint64_t id_ = 0;
};

/// An owned CUDA event (timing disabled: it only orders work).
class Event {
 public:
  explicit Event(Device device);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  cudaEvent_t get() const { return event_; }
  /// Captures the work queued on `stream` so far.
  void Record(cudaStream_t stream) const;
  /// True when the captured work has finished (never blocks).
  bool Query() const;
  /// Host wait with the deadline of WaitTimeout(); `what` names the wait in the error.
  void Synchronize(const char* what) const;

 private:
  Device device_;
  cudaEvent_t event_ = nullptr;
};

/// The stream nn work for `device` goes to on this thread.
cudaStream_t CurrentStream(Device device);

/// A key for per-stream state that a destroyed and re-created stream cannot
/// alias: the id() of the live Stream whose handle is `stream`. Any other
/// handle (the legacy default stream, a stream not made by Stream) maps to
/// its value with the top bit set, and aliases as the handle itself does.
uint64_t StreamId(cudaStream_t stream);
/// StreamId(CurrentStream(device)), without a lookup.
uint64_t CurrentStreamId(Device device);
/// False once the Stream with this id has been destroyed; true for a live
/// one and for every id StreamId gives to other handles.
bool StreamAlive(uint64_t id);

/// Makes `stream` (on `device`) the current stream of this thread for its scope.
class StreamGuard {
 public:
  StreamGuard(Device device, cudaStream_t stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  int index_;
  cudaStream_t previous_;
  uint64_t previous_id_;
};

/// Longest host wait on the device before it is reported as an error.
std::chrono::milliseconds WaitTimeout();
void SetWaitTimeout(std::chrono::milliseconds timeout);

/// Polls cudaEventQuery until the event has completed; throws CudaError on a
/// device error and std::runtime_error naming `what` past the deadline.
void WaitEvent(cudaEvent_t event, const char* what);

/// Waits for the work queued on `device` so far: its legacy default stream
/// (which, by its legacy semantics, covers every blocking stream) and this
/// thread's current stream. Streams created non-blocking elsewhere are their
/// owners' to wait for.
void SynchronizeDevice(Device device);

}  // namespace ddp::nn::cuda
