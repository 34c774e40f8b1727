#include "examples/testing/checkpoint_step.h"

#include <sys/stat.h>

#include <exception>
#include <filesystem>
#include <vector>

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

namespace {

// What a look at `path` (stat, no read) tells of which file is there: a
// save renames a new file over it, which changes some of these.
std::vector<int64_t> IdentityOf(const std::string& path) {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) return {};
  return {static_cast<int64_t>(st.st_ino), static_cast<int64_t>(st.st_size), st.st_mtim.tv_sec,
          st.st_mtim.tv_nsec, st.st_ctim.tv_sec, st.st_ctim.tv_nsec};
}

}  // namespace

int64_t WaitForCheckpointStep(const std::string& path, const std::function<bool(int64_t)>& done,
                              const std::function<bool()>& keep_waiting, std::chrono::seconds limit) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + limit;
  std::vector<int64_t> read_at;
  bool read_once = false;
  auto read_by = Clock::now();
  while (Clock::now() < deadline) {
    std::vector<int64_t> now = IdentityOf(path);
    if (!read_once || now != read_at || Clock::now() >= read_by) {
      read_once = true;
      read_at = std::move(now);
      read_by = Clock::now() + std::chrono::seconds(1);
      const int64_t step = CheckpointStep(path);
      if (done(step)) return step;
    }
    if (!keep_waiting()) return -1;
  }
  return -1;
}

}  // namespace ddp::examples::testing
