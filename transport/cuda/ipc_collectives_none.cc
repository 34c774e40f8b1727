// The build without CUDA: no IPC collectives.

#include "transport/cuda/ipc_collectives.h"

namespace ddp::transport::cuda {

struct IpcCollectives::State {};

StatusOr<std::unique_ptr<IpcCollectives>> IpcCollectives::Create(int, int, int) {
  return UnavailableError("CUDA IPC needs a build with --config=cuda");
}

IpcCollectives::IpcCollectives(std::unique_ptr<State> state) : state_(std::move(state)) {}
IpcCollectives::~IpcCollectives() = default;

StatusOr<bool> IpcCollectives::AllReduce(const void*, void*, size_t, DataType, ReduceOp,
                                         const IpcHostSteps&, Deadline) {
  return false;
}
StatusOr<bool> IpcCollectives::Broadcast(void*, size_t, DataType, int, const IpcHostSteps&,
                                         Deadline) {
  return false;
}
StatusOr<bool> IpcCollectives::AllGather(const void*, void*, size_t, DataType,
                                         const IpcHostSteps&, Deadline) {
  return false;
}
StatusOr<bool> IpcCollectives::ReduceScatter(const void*, void*, size_t, DataType, ReduceOp,
                                             const IpcHostSteps&, Deadline) {
  return false;
}

}  // namespace ddp::transport::cuda
