#ifndef DDP_EXAMPLES_TESTING_CHECKPOINT_STEP_H_
#define DDP_EXAMPLES_TESTING_CHECKPOINT_STEP_H_

// What a trainer's checkpoint says while a test watches it being written.

#include <cstdint>
#include <string>

namespace ddp::examples::testing {

/// Step recorded in the checkpoint at `path`, or -1 when there is no
/// complete checkpoint there (none yet, or being replaced right now: the
/// trainer renames atomically, so a caller simply retries).
int64_t CheckpointStep(const std::string& path);

}  // namespace ddp::examples::testing

#endif  // DDP_EXAMPLES_TESTING_CHECKPOINT_STEP_H_
