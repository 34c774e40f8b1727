#ifndef DDP_EXAMPLES_TESTING_CHECKPOINT_STEP_H_
#define DDP_EXAMPLES_TESTING_CHECKPOINT_STEP_H_

// What a trainer's checkpoint says while a test watches it being written.

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

namespace ddp::examples::testing {

/// Step recorded in the checkpoint at `path`, or -1 when there is no
/// complete checkpoint there (none yet, or being replaced right now: the
/// trainer renames atomically, so a caller simply retries).
int64_t CheckpointStep(const std::string& path);

/// Waits until `done` holds for the step of the checkpoint at `path` and
/// returns that step; -1 when `keep_waiting` says to stop (the run ended)
/// or `limit` passes. Between looks it calls `keep_waiting`, which waits a
/// little (a child's Wait of 10 ms). The file is read whole
/// (CheckpointStep) only when a look (stat) finds another file there, or
/// once a second in case a look missed one: reading it at every look took
/// a whole core of the two that runs share.
int64_t WaitForCheckpointStep(const std::string& path, const std::function<bool(int64_t)>& done,
                              const std::function<bool()>& keep_waiting, std::chrono::seconds limit);

}  // namespace ddp::examples::testing

#endif  // DDP_EXAMPLES_TESTING_CHECKPOINT_STEP_H_
