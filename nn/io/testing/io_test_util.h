#ifndef DDP_NN_IO_TESTING_IO_TEST_UTIL_H_
#define DDP_NN_IO_TESTING_IO_TEST_UTIL_H_

// Helpers shared by the nn/io tests.

#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "nn/io/safetensors.h"

namespace ddp::nn::io::test_util {

/// A path for one of a test's files: under TEST_TMPDIR (or /tmp), prefixed
/// with this process's id.
inline std::string TmpPath(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  return std::string(base ? base : "/tmp") + "/" + std::to_string(getpid()) + "_" + name;
}

/// The message of the CheckpointError `f` throws; a test failure, and "",
/// when it throws none.
template <typename F>
std::string ErrorOf(F&& f) {
  try {
    f();
  } catch (const CheckpointError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no CheckpointError thrown";
  return "";
}

}  // namespace ddp::nn::io::test_util

#endif  // DDP_NN_IO_TESTING_IO_TEST_UTIL_H_
