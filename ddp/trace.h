#ifndef DDP_DDP_TRACE_H_
#define DDP_DDP_TRACE_H_

// A per-rank timeline in Chrome's trace-event format, readable by
// chrome://tracing and ui.perfetto.dev: one "complete" event per forward,
// backward and collective, on a lane per thread ("compute", "comm"). Open
// the files of several ranks together to see them side by side (the rank is
// the trace's process id; times count from the host's monotonic clock's
// epoch, so the ranks of one host line up).
//
// A trace path that is a FIFO (named pipe) or a terminal is streamed
// instead (StreamDocumentTo): opened for writing, the events appended as
// they are flushed, and the document ended by EndDocument, with no
// temporary file and no rename (which would replace the pipe). Such a path
// takes one writer: a second recorder (another rank's, through a link to
// the same pipe) is refused, naming it, as two documents interleaved in one
// pipe would be neither.

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace ddp::dist {

class TraceRecorder {
 public:
  using Clock = std::chrono::steady_clock;

  /// Keeps at most `max_events` events; later ones are counted and dropped.
  explicit TraceRecorder(size_t max_events = size_t{1} << 20);

  /// Records an event named `name` on `lane` from `start` to `end`.
  /// `name` may hold any bytes: the file has each byte that is not part of
  /// well-formed UTF-8 as U+FFFD. `args_json` is empty or a JSON object body
  /// ("\"bytes\": 4096"). Thread-safe.
  void Complete(std::string name, const char* lane, Clock::time_point start,
                Clock::time_point end, std::string args_json = "");

  /// Writes every event as a JSON document to `path` (replacing it
  /// atomically), with `rank` as the process id, and in its "otherData"
  /// the capacity ("max_events") and the events dropped past it
  /// ("dropped_events"). Throws on I/O errors.
  void Write(const std::string& path, int rank) const;

  /// Starts streaming to `path` (created or truncated): Flush appends the
  /// events recorded since the last flush, in the format's array form,
  /// and the file is a complete JSON array after every flush (the closing
  /// bracket is written over by the next), so a process that dies without
  /// unwinding (a crash, SIGKILL) leaves every event flushed before, and
  /// a write that fails partway is cut back to the last whole event. The
  /// file is locked (flock) while streamed: a second recorder of the same
  /// file, in this process or another, is refused. On a file system that
  /// cannot lock (ENOLCK, ENOSYS, EOPNOTSUPP) it is streamed unlocked,
  /// after a warning on stderr naming it. The descriptor is close-on-exec,
  /// but a child forked without exec shares it, and with it the lock: until
  /// that child exits (or closes it), a later StreamTo of the same path, in
  /// this process or another, is refused as another writer's, even after
  /// EndStream. Throws std::runtime_error naming the path when it cannot
  /// be created or written, or when another writer holds its lock; a
  /// second call is refused.
  void StreamTo(const std::string& path, int rank);
  /// Whether `path` (through links) is a FIFO or a terminal: a trace there
  /// is streamed with StreamDocumentTo, not written by Write. Told by the
  /// file's type and device number alone, without opening it.
  static bool IsStreamTarget(const std::string& path);
  /// Starts streaming the whole document to `path`, a FIFO or a terminal:
  /// Flush appends the events recorded since the last flush, EndDocument
  /// the rest and the document's end (Write's document, in pieces). A
  /// FIFO's open waits up to `wait` for a reader, and each later write up
  /// to `wait` for the reader to take it. Throws std::runtime_error naming
  /// the path when nothing opened it for reading within `wait`, when
  /// another writer holds it, or when it cannot be opened or written; a
  /// second call (or StreamTo) is refused. Where it cannot be locked at all
  /// (ENOLCK, ENOSYS, EOPNOTSUPP) it is streamed unlocked, after a warning
  /// on stderr naming it, as StreamTo does.
  void StreamDocumentTo(const std::string& path, int rank, std::chrono::milliseconds wait);
  /// Whether StreamDocumentTo started the stream.
  bool streams_document() const { return document_; }
  /// Appends the unflushed events (nothing without a stream). A failed
  /// write (a reader gone, EPIPE, without SIGPIPE; one that took nothing
  /// for the stream's wait) is reported once on stderr, naming the path,
  /// and ends the streaming; Write is unaffected. Called by one thread at a
  /// time; Complete may run meanwhile.
  void Flush();
  /// Ends StreamDocumentTo's stream: appends the unflushed events and the
  /// document's end, then closes it. Throws std::runtime_error naming the
  /// path when the stream failed before (its reader got a cut document) or
  /// fails now, or when there is no such stream.
  void EndDocument();
  /// Stops streaming and removes the streamed file when `remove` (the
  /// complete file was written) and it was StreamTo's; otherwise leaves it
  /// as it is (a FIFO or terminal is never removed).
  void EndStream(bool remove);

  ~TraceRecorder();

  /// Events recorded so far, and events dropped for lack of room.
  size_t size() const;
  size_t dropped() const;

 private:
  struct Event {
    std::string name;
    const char* lane;
    int64_t start_us;
    int64_t duration_us;
    std::string args_json;
  };
  static std::string EventJson(const Event& e, int rank, int tid);
  // The unflushed events (and their lanes' names) as the stream's next
  // piece; marks them streamed.
  std::string TakeUnflushed();
  // Writes `text` to the stream within its wait; "" or the failure's text.
  std::string WriteToStream(const std::string& text);
  const Clock::time_point origin_;
  const size_t max_events_;
  mutable std::mutex mu_;
  std::vector<Event> events_;
  size_t dropped_ = 0;
  // The stream (StreamTo, StreamDocumentTo): its file, the events written
  // to it, and its lanes' thread ids in the order they appeared.
  int stream_fd_ = -1;
  bool document_ = false;    // StreamDocumentTo's: never removed
  bool stream_failed_ = false;
  std::chrono::milliseconds stream_wait_{0};  // per write (a file never makes one wait)
  std::string stream_path_;
  int stream_rank_ = 0;
  off_t stream_end_ = 0;  // StreamTo's file: where its closing bracket starts
  size_t streamed_ = 0;
  std::map<std::string, int> stream_lanes_;
};

}  // namespace ddp::dist

#endif  // DDP_DDP_TRACE_H_
