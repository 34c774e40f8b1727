#ifndef DDP_TRANSPORT_FILE_TEXT_H_
#define DDP_TRANSPORT_FILE_TEXT_H_

// Reading small text files the transport looks at (/proc, /sys, cgroup
// files) from inside a host program that may fork and exec on another
// thread at any time.

#include <optional>
#include <string>

namespace ddp::transport {

/// The whole text of the file at `path`; nullopt when it cannot be opened
/// or a read fails. The descriptor is opened close-on-exec, so a child that
/// another thread forks and execs meanwhile does not inherit it (an
/// ifstream's would leak into that child).
std::optional<std::string> ReadWholeFile(const std::string& path);

}  // namespace ddp::transport

#endif  // DDP_TRANSPORT_FILE_TEXT_H_
