#include "tests/fuzz/fuzz_target.h"

#include <cstdio>
#include <cstdlib>

namespace ddp::fuzz {

void CheckFailed(const char* file, int line, const char* condition, const char* message) {
  std::fprintf(stderr, "fuzz check failed: %s:%d: %s: %s\n", file, line, condition,
               message == nullptr ? "" : message);
  std::fflush(stderr);
  std::abort();
}

}  // namespace ddp::fuzz
