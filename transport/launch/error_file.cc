#include "transport/launch/error_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <nlohmann/json.hpp>

namespace ddp::transport::launch {
namespace {

constexpr size_t kMaxErrorFileBytes = size_t{1} << 20;

std::string ErrnoText(int err) { return std::strerror(err); }

// A timestamp as torchrun writes it (a string of digits) or as a number,
// at most `max` (the caller scales it to microseconds, which must not
// overflow). A negative or larger one is no time at all: as the earliest,
// it would make its worker the root cause over those that wrote real times.
bool ParseTimestamp(const nlohmann::json& value, int64_t max, int64_t& out) {
  if (value.is_number_unsigned()) {
    const uint64_t parsed = value.get<uint64_t>();
    if (parsed > static_cast<uint64_t>(max)) return false;
    out = static_cast<int64_t>(parsed);
    return true;
  }
  if (value.is_number_integer()) {
    const int64_t parsed = value.get<int64_t>();
    if (parsed < 0 || parsed > max) return false;
    out = parsed;
    return true;
  }
  if (!value.is_string()) return false;
  const std::string& text = value.get_ref<const std::string&>();
  if (text.empty() || text.size() > 18) return false;
  int64_t parsed = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
    parsed = parsed * 10 + (c - '0');
  }
  if (parsed > max) return false;
  out = parsed;
  return true;
}

// Largest timestamp in whole seconds whose microseconds fit an int64_t.
constexpr int64_t kMaxSeconds = std::numeric_limits<int64_t>::max() / 1000000;
constexpr int64_t kMaxMicroseconds = std::numeric_limits<int64_t>::max();

// The process's file mode creation mask, read without changing it (the
// umask() call sets it, and a file another thread creates in between would
// get the wrong mask). Where /proc does not say (Linux before 4.7), 077:
// the file stays as private as mkstemp made it.
mode_t ProcessUmask() {
  const int fd = open("/proc/self/status", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 077;
  std::string text;
  char buffer[4096];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof(buffer))) != 0) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    text.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  const size_t at = text.find("\nUmask:");
  if (at == std::string::npos) return 077;
  const char* start = text.c_str() + at + 7;
  char* end = nullptr;
  const unsigned long mask = std::strtoul(start, &end, 8);
  if (end == start || mask > 0777) return 077;
  return static_cast<mode_t>(mask);
}

// Writes `text` to `path` whole or not at all (a temporary file renamed
// over it).
Status WriteWhole(const std::string& path, const std::string& text) {
  if (path.empty()) return InvalidArgumentError("no error file path given");
  // A temporary of its own for every call (mkstemp): two threads of one
  // worker failing at once shared "<path>.tmp.<pid>", one truncated and
  // wrote into the file the other was renaming into place, and the
  // launcher could read a mix of both.
  std::string temp = path + ".tmp.XXXXXX";
  const int fd = mkostemp(temp.data(), O_CLOEXEC);
  if (fd < 0) return InternalError("cannot write error file '" + temp + "': " + ErrnoText(errno));
  // mkstemp's 0600; the file is no secret: 0644 less the umask, as a
  // plain open(path, O_CREAT, 0644) makes it.
  fchmod(fd, 0644 & ~ProcessUmask());
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      close(fd);
      unlink(temp.c_str());
      return InternalError("cannot write error file '" + temp + "': " + ErrnoText(err));
    }
    done += static_cast<size_t>(n);
  }
  if (close(fd) != 0) {
    const int err = errno;
    unlink(temp.c_str());
    return InternalError("cannot write error file '" + temp + "': " + ErrnoText(err));
  }
  if (rename(temp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    unlink(temp.c_str());
    return InternalError("cannot move error file '" + temp + "' to '" + path + "': " + ErrnoText(err));
  }
  return Status::Ok();
}

}  // namespace

Status WriteErrorFile(const std::string& path, std::string_view message,
                      std::chrono::system_clock::time_point when) {
  if (path.empty()) return InvalidArgumentError("no error file path given");
  const int64_t us =
      std::chrono::duration_cast<std::chrono::microseconds>(when.time_since_epoch()).count();
  nlohmann::json doc;
  // Invalid UTF-8 in the message would make dump() throw: replace it.
  doc["message"]["message"] = std::string(message);
  doc["message"]["extraInfo"]["timestamp"] = std::to_string(us / 1000000);
  doc["message"]["extraInfo"]["timestamp_us"] = std::to_string(us);
  return WriteWhole(path, doc.dump(-1, ' ', /*ensure_ascii=*/false,
                                   nlohmann::json::error_handler_t::replace) +
                              "\n");
}

Status CopyErrorRecord(const std::string& path, const std::string& record, int error_code) {
  if (path.empty()) return InvalidArgumentError("no error file path given");
  nlohmann::json doc = nlohmann::json::parse(record, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return InvalidArgumentError("the error record to copy is not JSON");
  // As torchrun: a worker killed by a signal could not write its own code.
  if (error_code != 0 && doc.is_object() && doc.contains("message") && doc["message"].is_object()) {
    doc["message"]["errorCode"] = error_code;
  }
  return WriteWhole(path, doc.dump(-1, ' ', /*ensure_ascii=*/false,
                                   nlohmann::json::error_handler_t::replace) +
                              "\n");
}

Status RecordWorkerError(std::string_view message) {
  const char* path = std::getenv(kEnvErrorFile);
  if (path == nullptr || *path == '\0') return Status::Ok();
  return WriteErrorFile(path, message);
}

StatusOr<WorkerError> ReadErrorFile(const std::string& path) {
  // Non-blocking, and a regular file only: the worker controls the path,
  // and a FIFO made there (or a link to a terminal) held the launcher's
  // open or read until someone else wrote to it, with no deadline.
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return NotFoundError("no error file '" + path + "'");
    return InternalError("cannot read error file '" + path + "': " + ErrnoText(err));
  }
  struct stat st{};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return InternalError("cannot read error file '" + path + "': " + ErrnoText(err));
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return InvalidArgumentError("error file '" + path + "' is not a regular file");
  }
  std::string text;
  char buffer[8192];
  while (true) {
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      close(fd);
      return InternalError("cannot read error file '" + path + "': " + ErrnoText(err));
    }
    if (n == 0) break;
    text.append(buffer, static_cast<size_t>(n));
    if (text.size() > kMaxErrorFileBytes) {
      close(fd);
      return InvalidArgumentError("error file '" + path + "' is over " +
                                  std::to_string(kMaxErrorFileBytes) + " bytes");
    }
  }
  close(fd);

  const nlohmann::json doc = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  auto malformed = [&path](const std::string& why) {
    return InvalidArgumentError("error file '" + path + "' is malformed: " + why);
  };
  if (doc.is_discarded()) return malformed("not JSON");
  if (!doc.is_object() || !doc.contains("message")) return malformed("no \"message\"");
  const nlohmann::json& message = doc["message"];
  WorkerError out;
  out.record = text;
  int64_t seconds = 0;
  if (message.is_string()) {
    // {"message": "...", "timestamp": N}
    out.message = message.get<std::string>();
    if (doc.contains("timestamp") && ParseTimestamp(doc["timestamp"], kMaxSeconds, seconds)) {
      out.timestamp_us = seconds * 1000000;
    }
    return out;
  }
  if (!message.is_object() || !message.contains("message") || !message["message"].is_string()) {
    return malformed("\"message\" is neither a string nor an object with a string \"message\"");
  }
  out.message = message["message"].get<std::string>();
  if (message.contains("extraInfo") && message["extraInfo"].is_object()) {
    const nlohmann::json& info = message["extraInfo"];
    int64_t us = 0;
    if (info.contains("timestamp_us") && ParseTimestamp(info["timestamp_us"], kMaxMicroseconds, us)) {
      out.timestamp_us = us;
    } else if (info.contains("timestamp") && ParseTimestamp(info["timestamp"], kMaxSeconds, seconds)) {
      out.timestamp_us = seconds * 1000000;
    }
  }
  return out;
}

}  // namespace ddp::transport::launch
