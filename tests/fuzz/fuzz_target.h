#ifndef DDP_TESTS_FUZZ_FUZZ_TARGET_H_
#define DDP_TESTS_FUZZ_FUZZ_TARGET_H_

// What a fuzz target includes. A target defines LLVMFuzzerTestOneInput; it is
// run by libFuzzer (--config=fuzz) or by the replay drivers in this folder,
// and must behave the same under both: no state carried from one input to
// the next, no output on the happy path, and a crash (abort) for every
// property that does not hold.

#include <cstddef>
#include <cstdint>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace ddp::fuzz {

/// Prints "fuzz check failed: <file>:<line>: <condition>: <message>" to stderr
/// and aborts, so that both drivers treat a broken property like a crash.
[[noreturn]] void CheckFailed(const char* file, int line, const char* condition,
                              const char* message);

}  // namespace ddp::fuzz

/// Asserts a property of the code under test on the current input.
#define FUZZ_CHECK(condition, message)                                      \
  do {                                                                      \
    if (!(condition)) {                                                     \
      ::ddp::fuzz::CheckFailed(__FILE__, __LINE__, #condition, (message));  \
    }                                                                       \
  } while (false)

#endif  // DDP_TESTS_FUZZ_FUZZ_TARGET_H_
