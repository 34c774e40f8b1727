#ifndef DDP_TRANSPORT_CUDA_IPC_COLLECTIVES_H_
#define DDP_TRANSPORT_CUDA_IPC_COLLECTIVES_H_

// Collectives between the ranks of one host directly on device memory with
// CUDA IPC: each rank exports its buffers (cudaIpcGetMemHandle), the handles
// travel through a host all-gather, and every rank reads its peers' buffers
// with copies and reduction kernels on its own GPU. Used when every rank
// can reach every peer's GPU (the same GPU, or cudaDeviceCanAccessPeer);
// otherwise every rank learns it in the same call and the caller stages
// instead. No CUDA header here.
//
// All-reduce: rank r reduces slice r of every rank's input into its own
// output (one kernel reading n buffers), a host barrier, then copies slice
// q from rank q's output for every q, and a last barrier so that no rank
// changes its buffers while a peer still reads them.

#include <cstddef>
#include <functional>
#include <memory>

#include "transport/status.h"
#include "transport/types.h"

namespace ddp::transport::cuda {

/// What an IPC collective needs from the host side of the communicator.
/// Both are collectives: every rank calls them in the same order.
struct IpcHostSteps {
  /// all[r * bytes, (r + 1) * bytes) = rank r's `mine`, on every rank.
  std::function<Status(const void* mine, void* all, size_t bytes)> all_gather;
  std::function<Status()> barrier;
};

/// Most ranks an IPC collective takes (kernel argument space).
inline constexpr int kMaxIpcRanks = 16;

/// The IPC collectives of one rank on one device: a stream and an event.
class IpcCollectives {
 public:
  /// UNAVAILABLE in builds without CUDA.
  static StatusOr<std::unique_ptr<IpcCollectives>> Create(int device, int rank, int size);
  ~IpcCollectives();

  // Each returns true when it ran, false when some rank cannot use IPC for
  // these buffers (every rank returns false together, having exchanged
  // nothing but the handles; the caller then takes another path). Inputs
  // must be complete on the legacy default stream.

  /// recv = op over ranks of send (count elements; send may equal recv).
  StatusOr<bool> AllReduce(const void* send, void* recv, size_t count, DataType dtype,
                           ReduceOp op, const IpcHostSteps& host, Deadline deadline);
  /// buffer = root's buffer.
  StatusOr<bool> Broadcast(void* buffer, size_t count, DataType dtype, int root,
                           const IpcHostSteps& host, Deadline deadline);
  /// recv[r * count + i] = rank r's send[i].
  StatusOr<bool> AllGather(const void* send, void* recv, size_t count, DataType dtype,
                           const IpcHostSteps& host, Deadline deadline);
  /// recv[i] = op over ranks q of q's send[rank * count + i].
  StatusOr<bool> ReduceScatter(const void* send, void* recv, size_t count, DataType dtype,
                               ReduceOp op, const IpcHostSteps& host, Deadline deadline);

  struct State;

 private:
  explicit IpcCollectives(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace ddp::transport::cuda

#endif  // DDP_TRANSPORT_CUDA_IPC_COLLECTIVES_H_
