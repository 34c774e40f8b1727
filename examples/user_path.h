#ifndef DDP_EXAMPLES_USER_PATH_H_
#define DDP_EXAMPLES_USER_PATH_H_

// Paths on an example's command line mean what they mean in the user's
// shell. `bazel run` starts a binary in its runfiles folder, so a relative
// path taken as it is would read from, or write into, that folder instead;
// every example resolves its path flags here.

#include <string>

namespace ddp::examples {

/// The directory relative paths on the command line are meant from: under
/// `bazel run`, the user's ($BUILD_WORKING_DIRECTORY), else the current one.
std::string UserWorkingDirectory();

/// `path` made absolute against UserWorkingDirectory() and lexically
/// normalized ("a/../b" is "b"); an absolute path is only normalized, and ""
/// stays "" (the flag was not given).
std::string UserPath(const std::string& path);

}  // namespace ddp::examples

#endif  // DDP_EXAMPLES_USER_PATH_H_
