#include "examples/testing/checkpoint_step.h"

#include <exception>
#include <filesystem>

#include "nn/io/checkpoint.h"

namespace ddp::examples::testing {

int64_t CheckpointStep(const std::string& path) {
  if (!std::filesystem::exists(path)) return -1;
  try {
    const nn::io::Checkpoint c = nn::io::LoadCheckpoint(path);
    return nn::io::MetadataInt(c.metadata, "step", path);
  } catch (const std::exception&) {
    return -1;
  }
}

}  // namespace ddp::examples::testing
