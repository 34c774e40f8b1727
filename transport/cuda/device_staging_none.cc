// The build without CUDA: no pointer is device memory, no engine exists.

#include "transport/cuda/device_staging.h"

namespace ddp::transport::cuda {

struct DeviceCopyEngine::State {};

bool BuiltWithCuda() { return false; }

PointerKind ClassifyPointer(const void*) { return {}; }

StatusOr<std::unique_ptr<DeviceCopyEngine>> DeviceCopyEngine::Create(int device, size_t) {
  return UnavailableError("device " + std::to_string(device) +
                          ": this build has no CUDA support (build with --config=cuda)");
}

DeviceCopyEngine::DeviceCopyEngine(std::unique_ptr<State> state) : state_(std::move(state)) {}
DeviceCopyEngine::~DeviceCopyEngine() = default;
size_t DeviceCopyEngine::slot_bytes() const { return 0; }
std::byte* DeviceCopyEngine::slot(int) { return nullptr; }
std::byte* DeviceCopyEngine::scratch(int) { return nullptr; }
Status DeviceCopyEngine::Reduce(void*, const void* const*, int, size_t, DataType, ReduceOp) {
  return UnavailableError("no CUDA support in this build");
}
Status DeviceCopyEngine::Copy2D(void*, size_t, const void*, size_t, size_t, size_t) {
  return UnavailableError("no CUDA support in this build");
}
Status DeviceCopyEngine::MarkIn(int) { return UnavailableError("no CUDA support in this build"); }
Status DeviceCopyEngine::WaitIn(int, Deadline) {
  return UnavailableError("no CUDA support in this build");
}
Status DeviceCopyEngine::WaitAll(Deadline) {
  return UnavailableError("no CUDA support in this build");
}

}  // namespace ddp::transport::cuda
