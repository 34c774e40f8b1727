// The --config=cuda build: pointers classified by the CUDA runtime, copies
// on a dedicated stream, waits by polling events against deadlines.

#include <cuda_runtime.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstddef>
#include <cstdlib>
#include <string>

#include "transport/cuda/cuda_util.h"
#include "transport/cuda/device_staging.h"
#include "transport/cuda/reduce_kernels.h"

namespace ddp::transport::cuda {

static_assert(kMaxDeviceReduceSources == kMaxReduceSources,
              "the pipeline's limit is the kernel's");

struct DeviceCopyEngine::State {
  int device = 0;
  size_t slot_bytes = 0;
  std::byte* pinned = nullptr;  // kSlots * slot_bytes, page-aligned, cudaHostRegister'ed
  bool registered = false;
  std::byte* scratch = nullptr;  // kSlots * slot_bytes of device memory
  cudaStream_t stream = nullptr;
  cudaEvent_t in_done[kSlots] = {};
  cudaEvent_t all_done = nullptr;
  size_t max_pitch = 0;  // cudaDevAttrMaxPitch: the widest row a 2-D copy takes
};

bool BuiltWithCuda() { return true; }

PointerKind ClassifyPointer(const void* p) {
  // Set once the runtime said there is no driver or no device: that does
  // not change during a process, and asking again costs a failed driver
  // initialisation per call on a CPU machine running the CUDA build.
  static std::atomic<bool> no_cuda{false};
  if (p == nullptr || no_cuda.load(std::memory_order_relaxed)) return {};
  // cudaPointerGetAttributes creates the current device's primary context
  // (hundreds of MiB on GPU 0 in every rank, even of a CPU trainer built
  // with CUDA). Memory the runtime allocated belongs to a device whose
  // primary context is active: with none active, `p` is host memory (or
  // the driver API's own contexts', which the transport does not take);
  // otherwise ask with such a device current.
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();
    if (status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver) {
      no_cuda.store(true, std::memory_order_relaxed);
    }
    return {};
  }
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) {
    cudaGetLastError();
    current = -1;
  }
  int ask = current >= 0 && current < count && PrimaryContextActive(current) ? current : -1;
  for (int d = 0; d < count && ask < 0; ++d) {
    if (PrimaryContextActive(d)) ask = d;
  }
  if (ask < 0) return {};
  DeviceScope scope(ask);  // no-op when `ask` is current already
  if (scope.status() != cudaSuccess) {
    cudaGetLastError();
    return {};
  }
  cudaPointerAttributes attributes{};
  status = cudaPointerGetAttributes(&attributes, p);
  if (status != cudaSuccess) {
    // Host memory either way; clear the sticky last error.
    cudaGetLastError();
    if (status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver) {
      no_cuda.store(true, std::memory_order_relaxed);
    }
    return {};
  }
  // Managed memory is staged too: the host may touch it only while no
  // kernel uses it, which the transport cannot know.
  if (attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged) {
    return {.device = true, .device_id = attributes.device};
  }
  return {};
}

StatusOr<std::unique_ptr<DeviceCopyEngine>> DeviceCopyEngine::Create(int device,
                                                                     size_t slot_bytes) {
  if (slot_bytes == 0) return InvalidArgumentError("device staging slots of 0 bytes");
  // Slot 1 and scratch 1 start slot_bytes after slot 0: aligned for every
  // dtype only if slot_bytes is (the communicator rounds already:
  // StagingSlotBytes).
  slot_bytes = StagingSlotBytes(slot_bytes, 1);
  DeviceScope scope(device);
  if (scope.status() != cudaSuccess) {
    return CudaError(scope.status(), "selecting CUDA device " + std::to_string(device));
  }
  auto state = std::make_unique<State>();
  state->device = device;
  int max_pitch = 0;
  if (cudaDeviceGetAttribute(&max_pitch, cudaDevAttrMaxPitch, device) != cudaSuccess || max_pitch <= 0) {
    (void)cudaGetLastError();
    max_pitch = INT_MAX;  // 2^31 - 1, what devices report
  }
  state->max_pitch = static_cast<size_t>(max_pitch);
  state->slot_bytes = slot_bytes;
  // Owned by the engine from here: its destructor frees whatever was made.
  std::unique_ptr<DeviceCopyEngine> engine(new DeviceCopyEngine(std::move(state)));
  State& s = *engine->state_;
  // Ordinary anonymous pages, pinned by registration rather than allocated
  // by cudaHostAlloc: the shared-memory all-reduce reads the peers' slots
  // with process_vm_readv, which needs pages the kernel can look up, and
  // the driver's own pinned mappings may not be.
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t bytes = (kSlots * slot_bytes + page - 1) / page * page;
  s.pinned = static_cast<std::byte*>(std::aligned_alloc(page, bytes));
  if (s.pinned == nullptr) {
    return ResourceExhaustedError("allocating " + std::to_string(bytes) +
                                  " bytes of staging memory");
  }
  cudaError_t status = cudaHostRegister(s.pinned, bytes, cudaHostRegisterPortable);
  if (status != cudaSuccess) {
    return CudaError(status, "pinning " + std::to_string(bytes) + " bytes of staging memory");
  }
  s.registered = true;
  // A blocking stream (not cudaStreamNonBlocking): it waits for work on the
  // legacy default stream, where a simple program's kernels wrote the input.
  // Made before the scratch, which the destructor frees on it.
  status = cudaStreamCreateWithFlags(&s.stream, cudaStreamDefault);
  if (status != cudaSuccess) return CudaError(status, "creating the staging stream");
  for (cudaEvent_t& event : s.in_done) {
    status = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    if (status != cudaSuccess) return CudaError(status, "creating a staging event");
  }
  status = cudaEventCreateWithFlags(&s.all_done, cudaEventDisableTiming);
  if (status != cudaSuccess) return CudaError(status, "creating a staging event");
  // Device scratch for the device-reduce mode: 2 x 4 MiB by default, made
  // with the engine so that no call allocates. cudaMalloc rather than a
  // stream-ordered pool: a CUDA-aware UCX writes it, and pool memory is
  // not exportable to every UCX CUDA transport.
  status = cudaMalloc(reinterpret_cast<void**>(&s.scratch), kSlots * slot_bytes);
  if (status != cudaSuccess) {
    s.scratch = nullptr;
    return CudaError(status, "allocating " + std::to_string(kSlots * slot_bytes) +
                                 " bytes of device staging scratch");
  }
  return engine;
}

DeviceCopyEngine::DeviceCopyEngine(std::unique_ptr<State> state) : state_(std::move(state)) {}

DeviceCopyEngine::~DeviceCopyEngine() {
  State& s = *state_;
  DeviceScope scope(s.device);
  bool idle = true;
  if (s.stream != nullptr && s.all_done != nullptr) {
    idle = cudaEventRecord(s.all_done, s.stream) == cudaSuccess &&
           PollEvent(s.all_done, DeadlineIn(std::chrono::milliseconds(2000)), "staging copies")
               .ok();
  }
  if (!idle) return;  // a wedged device: leak rather than free under live copies
  // cudaFree waits for the whole device (the user's kernels too), without
  // bound: the scratch is freed in the stream's order instead (the stream
  // and events exist whenever the scratch does) and the free awaited,
  // bounded. A free that cannot be queued leaks the scratch; one that does
  // not finish in time leaks the slots, the stream and the events too,
  // rather than this destructor blocking in the driver.
  if (s.scratch != nullptr) {
    if (cudaFreeAsync(s.scratch, s.stream) != cudaSuccess) {
      (void)cudaGetLastError();
    } else if (cudaEventRecord(s.all_done, s.stream) != cudaSuccess ||
               !PollEvent(s.all_done, DeadlineIn(std::chrono::milliseconds(2000)),
                          "freeing the staging scratch")
                    .ok()) {
      (void)cudaGetLastError();
      return;
    }
  }
  for (cudaEvent_t event : s.in_done) {
    if (event != nullptr) cudaEventDestroy(event);
  }
  if (s.all_done != nullptr) cudaEventDestroy(s.all_done);
  if (s.stream != nullptr) cudaStreamDestroy(s.stream);
  if (s.registered) cudaHostUnregister(s.pinned);
  std::free(s.pinned);
}

size_t DeviceCopyEngine::slot_bytes() const { return state_->slot_bytes; }

std::byte* DeviceCopyEngine::slot(int s) { return state_->pinned + s * state_->slot_bytes; }

std::byte* DeviceCopyEngine::scratch(int s) { return state_->scratch + s * state_->slot_bytes; }

Status DeviceCopyEngine::Reduce(void* dst, const void* const* sources, int num_sources,
                                size_t count, DataType dtype, ReduceOp op) {
  if (count == 0) return Status::Ok();
  DeviceScope scope(state_->device);
  DDP_RETURN_IF_ERROR(ScopeStatus(scope, state_->device));
  bool failed_before = false;
  const int status = ReduceAsync(dst, sources, num_sources, count, static_cast<int>(dtype),
                                 static_cast<int>(op), state_->stream, &failed_before);
  if (status != cudaSuccess) {
    return LaunchError(status, failed_before,
                       "a " + std::string(ReduceOpName(op)) + " of " +
                           std::to_string(num_sources) + " x " + std::to_string(count) + " " +
                           DataTypeName(dtype) + " on the device");
  }
  return Status::Ok();
}

Status DeviceCopyEngine::Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                                size_t width, size_t rows) {
  if (width == 0 || rows == 0) return Status::Ok();
  DeviceScope scope(state_->device);
  DDP_RETURN_IF_ERROR(ScopeStatus(scope, state_->device));
  // cudaMemcpyDefault: unified addressing tells each side's memory type, so
  // the same call serves device->pinned, pinned->device and device->device.
  // A 2-D copy takes pitches up to the device's limit (2 GiB): wider rows (a
  // reduce-scatter of more than 2 GiB per rank) go one row at a time.
  const size_t limit = state_->max_pitch;
  cudaError_t status = cudaSuccess;
  if (rows == 1) {
    status = cudaMemcpyAsync(dst, src, width, cudaMemcpyDefault, state_->stream);
  } else if (dst_pitch <= limit && src_pitch <= limit && width <= limit) {
    status = cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDefault,
                               state_->stream);
  } else {
    for (size_t r = 0; r < rows && status == cudaSuccess; ++r) {
      status = cudaMemcpyAsync(static_cast<std::byte*>(dst) + r * dst_pitch,
                               static_cast<const std::byte*>(src) + r * src_pitch, width,
                               cudaMemcpyDefault, state_->stream);
    }
  }
  if (status != cudaSuccess) {
    return CudaError(status, "queueing a staging copy of " + std::to_string(rows) + " x " +
                                 std::to_string(width) + " bytes");
  }
  return Status::Ok();
}

Status DeviceCopyEngine::MarkIn(int s) {
  DeviceScope scope(state_->device);
  DDP_RETURN_IF_ERROR(ScopeStatus(scope, state_->device));
  const cudaError_t status = cudaEventRecord(state_->in_done[s], state_->stream);
  if (status != cudaSuccess) return CudaError(status, "recording a staging event");
  return Status::Ok();
}

Status DeviceCopyEngine::WaitIn(int s, Deadline deadline) {
  DeviceScope scope(state_->device);
  DDP_RETURN_IF_ERROR(ScopeStatus(scope, state_->device));
  // Covers this slot's copy in and, queued before it, earlier copies out.
  return PollEvent(state_->in_done[s], deadline, "staging copies into slot " + std::to_string(s));
}

Status DeviceCopyEngine::WaitAll(Deadline deadline) {
  DeviceScope scope(state_->device);
  DDP_RETURN_IF_ERROR(ScopeStatus(scope, state_->device));
  const cudaError_t status = cudaEventRecord(state_->all_done, state_->stream);
  if (status != cudaSuccess) return CudaError(status, "recording a staging event");
  return PollEvent(state_->all_done, deadline, "staging copies");
}

}  // namespace ddp::transport::cuda
