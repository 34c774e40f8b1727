#include "ddp/trace.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string_view>
#include <thread>

#include "nn/io/atomic_file.h"
#include "transport/pipe_write.h"

namespace ddp::dist {
namespace {

// Length of the well-formed UTF-8 sequence at the start of `text`, or 0
// when it does not start with one (a stray continuation byte, a cut
// sequence, an overlong form, a surrogate, or a code point past U+10FFFF).
size_t Utf8SequenceLength(std::string_view text) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char lead = byte(0);
  if (lead < 0x80) return 1;
  // The accepted range of the second byte depends on the lead byte (RFC
  // 3629's table); later bytes are plain continuations, 0x80..0xbf.
  size_t length = 0;
  unsigned char low = 0x80, high = 0xbf;
  if (lead >= 0xc2 && lead <= 0xdf) {
    length = 2;
  } else if (lead >= 0xe0 && lead <= 0xef) {
    length = 3;
    if (lead == 0xe0) low = 0xa0;
    if (lead == 0xed) high = 0x9f;
  } else if (lead >= 0xf0 && lead <= 0xf4) {
    length = 4;
    if (lead == 0xf0) low = 0x90;
    if (lead == 0xf4) high = 0x8f;
  } else {
    return 0;
  }
  if (text.size() < length || byte(1) < low || byte(1) > high) return 0;
  for (size_t i = 2; i < length; ++i) {
    if (byte(i) < 0x80 || byte(i) > 0xbf) return 0;
  }
  return length;
}

// Escapes a string for a JSON string literal. JSON text must be UTF-8:
// names come from user labels and module paths, which may hold any bytes,
// and one ill-formed byte makes strict readers (Python's json, nlohmann)
// refuse the whole file, so each such byte becomes U+FFFD.
std::string JsonEscape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    const char c = text[i];
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x80) {
      const size_t length = Utf8SequenceLength(text.substr(i));
      if (length == 0) {
        out += "\\ufffd";
        ++i;
      } else {
        out.append(text.data() + i, length);
        i += length;
      }
      continue;
    }
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (u < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(u));
          out += buf;
        } else {
          out += c;
        }
    }
    ++i;
  }
  return out;
}

std::string ProcessNameJson(int rank) {
  return "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": " + std::to_string(rank) +
         ", \"args\": {\"name\": \"rank " + std::to_string(rank) + "\"}}";
}

std::string LaneNameJson(int rank, int tid, const std::string& lane) {
  return "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": " + std::to_string(rank) +
         ", \"tid\": " + std::to_string(tid) + ", \"args\": {\"name\": \"" + JsonEscape(lane) + "\"}}";
}

// Writes all of `text` to `fd`; "" or what went wrong. A non-blocking `fd`
// (a FIFO's, a terminal's) that takes nothing is waited for up to `wait`
// in all. A reader that went away is an error here, not a SIGPIPE that
// would end the whole run.
std::string WriteAll(int fd, std::string_view text, std::chrono::milliseconds wait) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point until = Clock::now() + wait;
  while (!text.empty()) {
    const ssize_t n = transport::WriteWithoutSigpipe(fd, text);
    if (n > 0) {
      text.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
      if (left.count() <= 0) {
        return "its reader took nothing for " + std::to_string(wait.count()) + " ms";
      }
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, static_cast<int>(left.count()));
      continue;
    }
    if (n < 0 && errno == EPIPE) return "its reader went away (EPIPE)";
    return n < 0 ? std::strerror(errno) : "nothing written";
  }
  return "";
}

// What ends StreamTo's file after each flush (the next one starts over it).
constexpr std::string_view kStreamTail = "\n]\n";

// The document's head and end (Write's, streamed in pieces between them).
constexpr std::string_view kDocumentHead = "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";

std::string DocumentEnd(size_t max_events, size_t dropped) {
  // The events past max_events were not kept: say how many, in the file's
  // metadata (otherData, shown by chrome://tracing and Perfetto), so that a
  // timeline that stops early is not read as a run that did.
  return "\n], \"otherData\": {\"max_events\": " + std::to_string(max_events) +
         ", \"dropped_events\": " + std::to_string(dropped) + "}}\n";
}

}  // namespace

std::string TraceRecorder::EventJson(const Event& e, int rank, int tid) {
  std::string json = "{\"name\": \"" + JsonEscape(e.name) + "\", \"ph\": \"X\", \"pid\": " +
                     std::to_string(rank) + ", \"tid\": " + std::to_string(tid) +
                     ", \"ts\": " + std::to_string(e.start_us) + ", \"dur\": " + std::to_string(e.duration_us);
  if (!e.args_json.empty()) json += ", \"args\": {" + e.args_json + "}";
  return json + "}";
}

// The clock's own epoch (CLOCK_MONOTONIC: boot), the same in every process
// of a host, so that the ranks' files line up; each recorder's creation
// time differed by however far apart the ranks started.
TraceRecorder::TraceRecorder(size_t max_events) : origin_(Clock::time_point{}), max_events_(max_events) {}

void TraceRecorder::Complete(std::string name, const char* lane, Clock::time_point start,
                             Clock::time_point end, std::string args_json) {
  using std::chrono::duration_cast;
  using std::chrono::microseconds;
  Event e{std::move(name), lane, duration_cast<microseconds>(start - origin_).count(),
          duration_cast<microseconds>(end - start).count(), std::move(args_json)};
  std::lock_guard lock(mu_);
  if (events_.size() >= max_events_) {
    ++dropped_;
    return;
  }
  events_.push_back(std::move(e));
}

size_t TraceRecorder::size() const {
  std::lock_guard lock(mu_);
  return events_.size();
}

size_t TraceRecorder::dropped() const {
  std::lock_guard lock(mu_);
  return dropped_;
}

void TraceRecorder::Write(const std::string& path, int rank) const {
  std::string json(kDocumentHead);
  size_t dropped = 0;
  {
    std::lock_guard lock(mu_);
    dropped = dropped_;  // read with the events it goes with
    // Lanes become numbered threads, named by metadata events.
    std::map<std::string, int> lanes;
    for (const Event& e : events_) lanes.emplace(e.lane, 0);
    int next = 1;
    for (auto& [lane, id] : lanes) id = next++;
    bool first = true;
    auto separator = [&] {
      if (!first) json += ",\n";
      first = false;
    };
    separator();
    json += ProcessNameJson(rank);
    for (const auto& [lane, id] : lanes) {
      separator();
      json += LaneNameJson(rank, id, lane);
    }
    for (const Event& e : events_) {
      separator();
      json += EventJson(e, rank, lanes[e.lane]);
    }
  }
  json += DocumentEnd(max_events_, dropped);
  nn::io::AtomicFileWriter writer(path);
  writer.Write(json.data(), json.size());
  writer.Commit();
}

TraceRecorder::~TraceRecorder() {
  if (stream_fd_ >= 0) ::close(stream_fd_);
}

void TraceRecorder::StreamTo(const std::string& path, int rank) {
  if (stream_fd_ >= 0 || !stream_path_.empty()) {
    throw std::logic_error("TraceRecorder::StreamTo: already streaming to " + stream_path_);
  }
  // Not truncated before the lock: the file may be another recorder's,
  // which would be cut under it.
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw std::runtime_error("trace: cannot create " + path + ": " + std::strerror(errno));
  }
  // One writer per file, in this process or another: two recorders would
  // write their events over each other's (and the end of one run would
  // remove the file the other still streams to). The lock goes with the
  // descriptor, so a second open of the same file in this process is
  // refused too. Only a lock held elsewhere refuses: a file system that
  // cannot lock (NFS without lockd: ENOLCK; some FUSE, CIFS or Lustre
  // mounts: ENOSYS, EOPNOTSUPP) is a common place for traces, and there
  // the file is written unguarded, with a warning.
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    if (error == EWOULDBLOCK) {
      ::close(fd);
      throw std::runtime_error("trace: " + path + " is being written by another trace (another "
                               "DistributedDataParallel or process with the same trace prefix and rank?); "
                               "give each its own trace prefix");
    }
    std::fprintf(stderr, "[ddp] warning: trace: cannot lock %s (%s); writing it unlocked, so another writer "
                 "of the same file would not be noticed\n", path.c_str(), std::strerror(error));
  }
  // The file is a JSON array after every flush: the events so far, then
  // kStreamTail, which the next flush writes over.
  const std::string head = "[\n" + ProcessNameJson(rank);
  std::string error;
  if (::ftruncate(fd, 0) != 0) {
    error = std::strerror(errno);
  } else {
    error = WriteAll(fd, head + std::string(kStreamTail), std::chrono::milliseconds(0));
  }
  if (!error.empty()) {
    ::unlink(path.c_str());
    ::close(fd);
    throw std::runtime_error("trace: cannot write " + path + ": " + error);
  }
  stream_fd_ = fd;
  stream_path_ = path;
  stream_rank_ = rank;
  stream_end_ = static_cast<off_t>(head.size());
}

bool TraceRecorder::IsStreamTarget(const std::string& path) { return nn::io::IsStreamPath(path); }

void TraceRecorder::StreamDocumentTo(const std::string& path, int rank, std::chrono::milliseconds wait) {
  using Clock = std::chrono::steady_clock;
  if (stream_fd_ >= 0 || !stream_path_.empty()) {
    throw std::logic_error("TraceRecorder::StreamDocumentTo: already streaming to " + stream_path_);
  }
  if (wait.count() < 0) wait = std::chrono::milliseconds(0);
  // Non-blocking: a FIFO's open would wait for a reader without end (here
  // it fails with ENXIO until one comes), and a write for a reader that
  // stopped taking the trace. O_NOCTTY: a terminal stays the session's.
  const Clock::time_point until = Clock::now() + wait;
  struct stat st{};
  const bool fifo = ::stat(path.c_str(), &st) == 0 && S_ISFIFO(st.st_mode);
  int fd = -1;
  for (;;) {
    fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (fd >= 0 || (errno != EINTR && !(fifo && errno == ENXIO))) break;
    if (errno == ENXIO && Clock::now() >= until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (fd < 0 && fifo && errno == ENXIO) {
    throw std::runtime_error("trace: " + path + " is a FIFO, and nothing opened it for reading within " +
                             std::to_string(wait.count()) + " ms; start its reader first (cat " + path +
                             "), or move it away");
  }
  if (fd < 0) throw std::runtime_error("trace: cannot open " + path + ": " + std::strerror(errno));
  // The path was looked at before this open: it may have been replaced by
  // a regular file since, which this descriptor would write without
  // truncating it.
  if (::fstat(fd, &st) != 0 || !(S_ISFIFO(st.st_mode) || S_ISCHR(st.st_mode))) {
    ::close(fd);
    throw std::runtime_error("trace: " + path + " is no longer a FIFO or a terminal; nothing was written to it");
  }
  // One writer per pipe or terminal: another one's document would be cut
  // into this one's. As in StreamTo, only a lock held elsewhere refuses: a
  // pipe on a file system that cannot lock (ENOLCK, ENOSYS, EOPNOTSUPP) is
  // written unguarded, with a warning, rather than failing the run.
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    if (error == EWOULDBLOCK) {
      ::close(fd);
      throw std::runtime_error("trace: " + path + " is being written by another trace (another rank's, "
                               "through a link to the same pipe or terminal?); a FIFO or terminal takes "
                               "one rank's trace: give each rank its own");
    }
    std::fprintf(stderr, "[ddp] warning: trace: cannot lock %s (%s); writing it unlocked, so another writer "
                 "of the same pipe or terminal would not be noticed\n", path.c_str(), std::strerror(error));
  }
  if (const std::string error = WriteAll(fd, std::string(kDocumentHead) + ProcessNameJson(rank), wait);
      !error.empty()) {
    ::close(fd);
    throw std::runtime_error("trace: cannot write " + path + ": " + error);
  }
  stream_fd_ = fd;
  stream_path_ = path;
  stream_rank_ = rank;
  stream_wait_ = wait;
  document_ = true;
}

std::string TraceRecorder::TakeUnflushed() {
  std::string text;
  std::lock_guard lock(mu_);
  for (; streamed_ < events_.size(); ++streamed_) {
    const Event& e = events_[streamed_];
    auto [lane, added] = stream_lanes_.emplace(e.lane, static_cast<int>(stream_lanes_.size()) + 1);
    if (added) text += ",\n" + LaneNameJson(stream_rank_, lane->second, lane->first);
    text += ",\n" + EventJson(e, stream_rank_, lane->second);
  }
  return text;
}

std::string TraceRecorder::WriteToStream(const std::string& text) {
  if (text.empty()) return "";
  std::string error;
  if (document_) {
    error = WriteAll(stream_fd_, text, stream_wait_);
  } else if (::lseek(stream_fd_, stream_end_, SEEK_SET) < 0) {
    error = std::strerror(errno);
  } else {
    // Over the previous tail: the file ends in a closing bracket again,
    // unless this write stops partway (a full disk).
    error = WriteAll(stream_fd_, text + std::string(kStreamTail), std::chrono::milliseconds(0));
    if (error.empty()) {
      stream_end_ += static_cast<off_t>(text.size());
    } else if (::ftruncate(stream_fd_, stream_end_) == 0 && ::lseek(stream_fd_, stream_end_, SEEK_SET) >= 0) {
      // Back to the last whole event, and the array closed: the file stays
      // JSON (the write that failed may fail again here; the truncation
      // freed what it had written).
      WriteAll(stream_fd_, kStreamTail, std::chrono::milliseconds(0));
    }
  }
  if (!error.empty()) {
    stream_failed_ = true;
    // A file's descriptor is kept, and with it the lock, until EndStream:
    // another recorder that took the path meanwhile would have its file
    // removed by EndStream(true).
    if (document_) {
      ::close(stream_fd_);
      stream_fd_ = -1;
    }
  }
  return error;
}

void TraceRecorder::Flush() {
  if (stream_fd_ < 0 || stream_failed_) return;
  const std::string error = WriteToStream(TakeUnflushed());
  if (error.empty()) return;
  if (document_) {
    std::fprintf(stderr, "[ddp] trace: writing %s failed (%s); its reader got the trace cut there, and "
                 "the run goes on without it\n", stream_path_.c_str(), error.c_str());
  } else {
    std::fprintf(stderr, "[ddp] trace: writing %s failed (%s); it stops here, and the complete trace is "
                 "still written at the end\n", stream_path_.c_str(), error.c_str());
  }
}

void TraceRecorder::EndDocument() {
  if (!document_) throw std::logic_error("TraceRecorder::EndDocument: no StreamDocumentTo stream");
  if (stream_fd_ < 0) {
    throw std::runtime_error("trace: " + stream_path_ + (stream_failed_ ? " failed before the end of the run; "
                             "its reader got the trace cut there" : " was already ended"));
  }
  std::string text = TakeUnflushed();
  {
    std::lock_guard lock(mu_);
    text += DocumentEnd(max_events_, dropped_);
  }
  if (const std::string error = WriteToStream(text); !error.empty()) {
    throw std::runtime_error("trace: cannot end the trace in " + stream_path_ + ": " + error +
                             "; its reader got it cut there");
  }
  ::close(stream_fd_);
  stream_fd_ = -1;
}

void TraceRecorder::EndStream(bool remove) {
  // Removed before the descriptor (and its lock) goes: once the lock is
  // released another recorder may take the path, whose file this would
  // remove.
  if (remove && !document_ && !stream_path_.empty()) ::unlink(stream_path_.c_str());
  if (stream_fd_ >= 0) ::close(stream_fd_);
  stream_fd_ = -1;
}

}  // namespace ddp::dist
