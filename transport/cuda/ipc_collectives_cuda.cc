// CUDA IPC collectives (see ipc_collectives.h). Every wait polls an event
// against the call's deadline; handles opened for a call are closed before
// it returns.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "transport/cuda/cuda_util.h"
#include "transport/cuda/ipc_collectives.h"
#include "transport/cuda/reduce_kernels.h"

namespace ddp::transport::cuda {
namespace {

using std::chrono::milliseconds;

// One exported buffer as it travels between ranks.
struct Record {
  cudaIpcMemHandle_t handle;  // of the allocation holding the buffer
  uint64_t offset = 0;        // of the buffer inside that allocation
  // The device's PCI bus id ("0000:65:00.0"): device ordinals are each
  // process's own (CUDA_VISIBLE_DEVICES may differ between ranks).
  char bus_id[16] = {};
  int32_t ok = 0;  // 1: exported
};

// What each rank contributes: up to two buffers (send, recv).
struct Exchange {
  Record buffers[2];
};

// cuMemGetAddressRange from the driver, found through the runtime so that
// nothing links libcuda: the IPC handle covers a whole allocation, and its
// holder must know where inside it the buffer starts.
using AddressRangeFn = int (*)(unsigned long long* base, size_t* size, unsigned long long ptr);
AddressRangeFn AddressRange() {
  static const AddressRangeFn fn = [] {
    void* symbol = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &symbol, 12000,
                                         cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return AddressRangeFn{nullptr};
    }
    return reinterpret_cast<AddressRangeFn>(symbol);
  }();
  return fn;
}

Record Export(const void* p) {
  Record r;
  std::memset(&r.handle, 0, sizeof(r.handle));
  cudaPointerAttributes attributes{};
  if (p == nullptr || cudaPointerGetAttributes(&attributes, p) != cudaSuccess ||
      attributes.type != cudaMemoryTypeDevice) {
    cudaGetLastError();
    return r;
  }
  if (cudaDeviceGetPCIBusId(r.bus_id, sizeof(r.bus_id), attributes.device) != cudaSuccess) {
    cudaGetLastError();
    return r;
  }
  DeviceScope scope(attributes.device);
  if (scope.status() != cudaSuccess) {  // not exportable from here: this rank says no
    cudaGetLastError();
    return r;
  }
  const AddressRangeFn range = AddressRange();
  unsigned long long base = 0;
  size_t size = 0;
  if (range == nullptr || range(&base, &size, reinterpret_cast<uintptr_t>(p)) != 0) return r;
  // Fails for memory that cannot be shared this way (cudaMallocAsync pools,
  // VMM allocations): that rank then says no and everyone stages.
  if (cudaIpcGetMemHandle(&r.handle, reinterpret_cast<void*>(base)) != cudaSuccess) {
    cudaGetLastError();
    return r;
  }
  r.offset = reinterpret_cast<uintptr_t>(p) - base;
  r.ok = 1;
  return r;
}

}  // namespace

struct IpcCollectives::State {
  int device = 0;
  int rank = 0;
  int size = 1;
  cudaStream_t stream = nullptr;
  cudaEvent_t done = nullptr;
};

namespace {

// One call's view of the peers' buffers: opened on Open, closed (after the
// stream drained) when it goes away.
class Session {
 public:
  explicit Session(IpcCollectives::State& s) : s_(s) {}
  ~Session() {
    // Nothing may still read a mapping being closed: drain first (bounded;
    // on a wedged device the mappings are left open rather than closed
    // under a running kernel).
    const bool idle =
        WaitStream(s_.stream, s_.done, DeadlineIn(milliseconds(2000)), "IPC copies").ok();
    if (!idle) return;
    for (auto& [key, base] : opened_) cudaIpcCloseMemHandle(base);
  }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Closes the peers' mappings once this rank's copies and kernels drained
  // (the caller waited for its stream): called before the call's last
  // barrier, so that no rank returns, and may free the buffer it exported,
  // while a peer still has it mapped.
  void Close() {
    for (auto& [key, base] : opened_) cudaIpcCloseMemHandle(base);
    opened_.clear();
  }

  // Waits for the inputs, exports `mine`, exchanges, opens the peers'
  // buffers and agrees with every rank whether IPC can run. false: it
  // cannot (same answer on every rank).
  StatusOr<bool> Prepare(std::initializer_list<const void*> mine, const IpcHostSteps& host,
                         Deadline deadline) {
    const int n = s_.size;
    // The inputs are complete once the stream, which waits for the legacy
    // default stream, reaches here; the exchange below then tells every
    // rank that every input is complete.
    DDP_RETURN_IF_ERROR(WaitStream(s_.stream, s_.done, deadline, "waiting for the inputs"));
    Exchange own;
    int k = 0;
    for (const void* p : mine) own.buffers[k++] = Export(p);
    std::vector<Exchange> all(n);
    DDP_RETURN_IF_ERROR(host.all_gather(&own, all.data(), sizeof(Exchange)));
    uint8_t usable = n <= kMaxIpcRanks;
    for (int q = 0; q < n && usable; ++q) {
      for (int b = 0; b < k && usable; ++b) {
        const Record& r = all[q].buffers[b];
        usable = r.ok == 1 && Reachable(r.bus_id);
      }
    }
    peers_.assign(n, std::vector<std::byte*>(k, nullptr));
    for (int q = 0; q < n && usable; ++q) {
      for (int b = 0; b < k && usable; ++b) {
        if (q == s_.rank) {
          peers_[q][b] = static_cast<std::byte*>(const_cast<void*>(*(mine.begin() + b)));
          continue;
        }
        std::byte* base = Open(all[q].buffers[b].handle);
        usable = base != nullptr;
        if (usable) peers_[q][b] = base + all[q].buffers[b].offset;
      }
    }
    std::vector<uint8_t> verdicts(n);
    DDP_RETURN_IF_ERROR(host.all_gather(&usable, verdicts.data(), 1));
    return std::all_of(verdicts.begin(), verdicts.end(), [](uint8_t v) { return v == 1; });
  }

  // Rank q's buffer b (this rank's own pointer for q == rank).
  std::byte* buffer(int q, int b) const { return peers_[q][b]; }

 private:
  // Whether this rank's device can read the device with PCI bus id
  // `bus_id` (the same one, or a peer): not when this process cannot see it.
  bool Reachable(const char bus_id[16]) const {
    char terminated[17] = {};
    std::memcpy(terminated, bus_id, 16);
    int peer_device = -1;
    if (cudaDeviceGetByPCIBusId(&peer_device, terminated) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    if (peer_device == s_.device) return true;
    int can = 0;
    return cudaDeviceCanAccessPeer(&can, s_.device, peer_device) == cudaSuccess && can == 1;
  }
  // The same allocation may hold two buffers of a peer (in place): one
  // mapping per handle and call.
  std::byte* Open(const cudaIpcMemHandle_t& handle) {
    const std::string key(handle.reserved, sizeof(handle.reserved));
    auto it = opened_.find(key);
    if (it != opened_.end()) return static_cast<std::byte*>(it->second);
    void* base = nullptr;
    if (cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    opened_.emplace(key, base);
    return static_cast<std::byte*>(base);
  }

  IpcCollectives::State& s_;
  std::map<std::string, void*> opened_;
  std::vector<std::vector<std::byte*>> peers_;
};

size_t SliceBegin(size_t count, int q, int n) { return count * q / n; }

}  // namespace

StatusOr<std::unique_ptr<IpcCollectives>> IpcCollectives::Create(int device, int rank, int size) {
  DeviceScope scope(device);
  if (scope.status() != cudaSuccess) {
    return CudaError(scope.status(), "selecting CUDA device " + std::to_string(device));
  }
  auto state = std::make_unique<State>();
  state->device = device;
  state->rank = rank;
  state->size = size;
  std::unique_ptr<IpcCollectives> ipc(new IpcCollectives(std::move(state)));
  // A blocking stream: it waits for the legacy default stream's work.
  cudaError_t status = cudaStreamCreateWithFlags(&ipc->state_->stream, cudaStreamDefault);
  if (status != cudaSuccess) return CudaError(status, "creating the IPC stream");
  status = cudaEventCreateWithFlags(&ipc->state_->done, cudaEventDisableTiming);
  if (status != cudaSuccess) return CudaError(status, "creating the IPC event");
  return ipc;
}

IpcCollectives::IpcCollectives(std::unique_ptr<State> state) : state_(std::move(state)) {}

IpcCollectives::~IpcCollectives() {
  DeviceScope scope(state_->device);
  if (state_->stream != nullptr && state_->done != nullptr &&
      !WaitStream(state_->stream, state_->done, DeadlineIn(milliseconds(2000)), "IPC work").ok()) {
    return;  // a wedged device: leave the stream rather than destroy it under work
  }
  if (state_->done != nullptr) cudaEventDestroy(state_->done);
  if (state_->stream != nullptr) cudaStreamDestroy(state_->stream);
}

StatusOr<bool> IpcCollectives::AllReduce(const void* send, void* recv, size_t count,
                                         DataType dtype, ReduceOp op, const IpcHostSteps& host,
                                         Deadline deadline) {
  State& s = *state_;
  DeviceScope scope(s.device);
  DDP_RETURN_IF_ERROR(ScopeStatus(scope, s.device));
  Session session(s);
  DDP_ASSIGN_OR_RETURN(bool usable, session.Prepare({send, recv}, host, deadline));
  if (!usable) return false;
  const size_t e = DataTypeSize(dtype);
  const int n = s.size, me = s.rank;
  // 1. This rank's slice, reduced from every rank's input into its output.
  const size_t begin = SliceBegin(count, me, n), end = SliceBegin(count, me + 1, n);
  const void* sources[kMaxIpcRanks];
  for (int q = 0; q < n; ++q) sources[q] = session.buffer(q, 0) + begin * e;
  bool failed_before = false;
  int launched = ReduceAsync(session.buffer(me, 1) + begin * e, sources, n, end - begin,
                             static_cast<int>(dtype), static_cast<int>(op), s.stream,
                             &failed_before);
  if (launched != cudaSuccess) return LaunchError(launched, failed_before, "the IPC reduction");
  DDP_RETURN_IF_ERROR(WaitStream(s.stream, s.done, deadline, "IPC reduction"));
  // 2. Every slice is reduced once every rank is past its kernel.
  DDP_RETURN_IF_ERROR(host.barrier());
  // 3. The other slices, from their owners' outputs.
  for (int q = 0; q < n; ++q) {
    if (q == me) continue;
    const size_t b = SliceBegin(count, q, n), len = SliceBegin(count, q + 1, n) - b;
    if (len == 0) continue;
    const cudaError_t status = cudaMemcpyAsync(session.buffer(me, 1) + b * e,
                                               session.buffer(q, 1) + b * e, len * e,
                                               cudaMemcpyDefault, s.stream);
    if (status != cudaSuccess) return CudaError(status, "copying a reduced slice over IPC");
  }
  DDP_RETURN_IF_ERROR(WaitStream(s.stream, s.done, deadline, "IPC slice copies"));
  session.Close();
  // 4. Nobody reuses its buffers while a peer may still read them.
  DDP_RETURN_IF_ERROR(host.barrier());
  return true;
}

StatusOr<bool> IpcCollectives::Broadcast(void* buffer, size_t count, DataType dtype, int root,
                                         const IpcHostSteps& host, Deadline deadline) {
  State& s = *state_;
  DeviceScope scope(s.device);
  DDP_RETURN_IF_ERROR(ScopeStatus(scope, s.device));
  Session session(s);
  DDP_ASSIGN_OR_RETURN(bool usable, session.Prepare({buffer}, host, deadline));
  if (!usable) return false;
  if (s.rank != root) {
    const cudaError_t status = cudaMemcpyAsync(buffer, session.buffer(root, 0),
                                               count * DataTypeSize(dtype), cudaMemcpyDefault,
                                               s.stream);
    if (status != cudaSuccess) return CudaError(status, "copying the root's buffer over IPC");
    DDP_RETURN_IF_ERROR(WaitStream(s.stream, s.done, deadline, "IPC broadcast copy"));
  }
  session.Close();
  DDP_RETURN_IF_ERROR(host.barrier());
  return true;
}

StatusOr<bool> IpcCollectives::AllGather(const void* send, void* recv, size_t count,
                                         DataType dtype, const IpcHostSteps& host,
                                         Deadline deadline) {
  State& s = *state_;
  DeviceScope scope(s.device);
  DDP_RETURN_IF_ERROR(ScopeStatus(scope, s.device));
  Session session(s);
  DDP_ASSIGN_OR_RETURN(bool usable, session.Prepare({send}, host, deadline));
  if (!usable) return false;
  const size_t bytes = count * DataTypeSize(dtype);
  auto* out = static_cast<std::byte*>(recv);
  for (int q = 0; q < s.size; ++q) {
    // In place, this rank's block already is its input.
    if (out + q * bytes == session.buffer(q, 0) && q == s.rank) continue;
    const cudaError_t status = cudaMemcpyAsync(out + q * bytes, session.buffer(q, 0), bytes,
                                               cudaMemcpyDefault, s.stream);
    if (status != cudaSuccess) return CudaError(status, "copying a block over IPC");
  }
  DDP_RETURN_IF_ERROR(WaitStream(s.stream, s.done, deadline, "IPC all-gather copies"));
  session.Close();
  DDP_RETURN_IF_ERROR(host.barrier());
  return true;
}

StatusOr<bool> IpcCollectives::ReduceScatter(const void* send, void* recv, size_t count,
                                             DataType dtype, ReduceOp op,
                                             const IpcHostSteps& host, Deadline deadline) {
  State& s = *state_;
  DeviceScope scope(s.device);
  DDP_RETURN_IF_ERROR(ScopeStatus(scope, s.device));
  Session session(s);
  DDP_ASSIGN_OR_RETURN(bool usable, session.Prepare({send}, host, deadline));
  if (!usable) return false;
  const size_t e = DataTypeSize(dtype);
  const void* sources[kMaxIpcRanks];
  for (int q = 0; q < s.size; ++q) sources[q] = session.buffer(q, 0) + s.rank * count * e;
  bool failed_before = false;
  const int launched = ReduceAsync(recv, sources, s.size, count, static_cast<int>(dtype),
                                   static_cast<int>(op), s.stream, &failed_before);
  if (launched != cudaSuccess) return LaunchError(launched, failed_before, "the IPC reduction");
  DDP_RETURN_IF_ERROR(WaitStream(s.stream, s.done, deadline, "IPC reduction"));
  session.Close();
  DDP_RETURN_IF_ERROR(host.barrier());
  return true;
}

}  // namespace ddp::transport::cuda
