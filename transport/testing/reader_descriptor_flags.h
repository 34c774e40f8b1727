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
/// opened on the FIFO, or -1 when none showed within 10 s (or the FIFO
/// could not be made). The FIFO holds the reader's open until this side
/// opens it for writing, and its read until this side closes it, so the
/// descriptor is there to look at. Removes the FIFO before it returns.
int FlagsOfTheReadersDescriptor(const std::string& path, const std::function<void()>& read);

}  // namespace ddp::transport::testing

#endif  // DDP_TRANSPORT_TESTING_READER_DESCRIPTOR_FLAGS_H_
