#ifndef DDP_TRANSPORT_TESTING_READER_DESCRIPTOR_FLAGS_H_
#define DDP_TRANSPORT_TESTING_READER_DESCRIPTOR_FLAGS_H_

// For tests that a file reader opens its descriptor close-on-exec: the
// file is a FIFO, which keeps the reader's descriptor open long enough to
// look at its flags.

#include <functional>
#include <string>

namespace ddp::transport::testing {

/// Makes a FIFO at `path`, runs `read` on another thread, and returns the
/// flags (/proc/self/fdinfo, octal "flags:") of the descriptor `read`
/// opened on the FIFO, or -1 when none showed within 10 s or `read`
/// returned first (or the FIFO could not be made). The FIFO holds the
/// reader's read until this side closes its end, so the descriptor is there
/// to look at. Then the FIFO's name is removed (a later open fails) and the
/// reader is let go; should `read` not return within 10 s more, the process
/// aborts saying so, rather than hang.
int FlagsOfTheReadersDescriptor(const std::string& path, const std::function<void()>& read);

}  // namespace ddp::transport::testing

#endif  // DDP_TRANSPORT_TESTING_READER_DESCRIPTOR_FLAGS_H_
