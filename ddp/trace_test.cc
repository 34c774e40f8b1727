// TraceRecorder's file: the events it kept, and how many it dropped once
// full, in the document's metadata; a FIFO streamed as one document.

#include "ddp/trace.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <atomic>
#include <csignal>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

// While nonzero, flock fails with this errno, as on a file system that
// cannot lock (NFS without lockd: ENOLCK). This binary's flock comes before
// the C library's for every caller, the recorder's included; otherwise it
// is the C library's.
static std::atomic<int> flock_fails_with{0};

extern "C" int flock(int fd, int operation) {
  if (const int error = flock_fails_with.load(); error != 0) {
    errno = error;
    return -1;
  }
  using Flock = int (*)(int, int);
  static const auto real = reinterpret_cast<Flock>(::dlsym(RTLD_NEXT, "flock"));
  return real(fd, operation);
}

namespace ddp::dist {
namespace {

nlohmann::json WriteAndRead(const TraceRecorder& trace, const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(tmp != nullptr ? tmp : "/tmp") + "/" + name;
  trace.Write(path, 3);
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

int CompleteEvents(const nlohmann::json& doc) {
  int n = 0;
  for (const auto& e : doc["traceEvents"]) n += e["ph"] == "X";
  return n;
}

TEST(TraceTest, DroppedEventsAreCountedInTheFile) {
  TraceRecorder trace(2);
  const auto now = TraceRecorder::Clock::now();
  for (int i = 0; i < 3; ++i) trace.Complete("event " + std::to_string(i), "compute", now, now);
  EXPECT_EQ(trace.size(), 2u);
  EXPECT_EQ(trace.dropped(), 1u);
  const nlohmann::json doc = WriteAndRead(trace, "trace_full.json");
  EXPECT_EQ(CompleteEvents(doc), 2);
  ASSERT_TRUE(doc.contains("otherData")) << doc.dump();
  EXPECT_EQ(doc["otherData"]["dropped_events"], 1) << doc.dump();
  EXPECT_EQ(doc["otherData"]["max_events"], 2) << doc.dump();
}

TEST(TraceTest, NothingDroppedIsWrittenAsZero) {
  TraceRecorder trace(4);
  const auto now = TraceRecorder::Clock::now();
  trace.Complete("forward", "compute", now, now, "\"bytes\": 4096");
  const nlohmann::json doc = WriteAndRead(trace, "trace_room.json");
  EXPECT_EQ(CompleteEvents(doc), 1);
  ASSERT_TRUE(doc.contains("otherData")) << doc.dump();
  EXPECT_EQ(doc["otherData"]["dropped_events"], 0) << doc.dump();
}

// Names hold whatever a label or module path held. Quotes, backslashes and
// control characters are escaped; well-formed UTF-8 passes through as it is;
// a byte that is not part of well-formed UTF-8 (JSON text must be UTF-8, and
// strict readers refuse the whole file otherwise) reads back as U+FFFD.
TEST(TraceTest, AnyBytesInANameGiveValidJson) {
  std::string controls;
  for (char c = 1; c < 0x20; ++c) controls += c;
  const std::string replacement = "\xef\xbf\xbd";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"say \"hi\" \\ back\\slash", "say \"hi\" \\ back\\slash"},
      {controls + "\x7f", controls + "\x7f"},
      {"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"},
      {"latin-1 caf\xe9", "latin-1 caf" + replacement},
      {"stray \x80 and \xff", "stray " + replacement + " and " + replacement},
      {"cut \xe2\x82", "cut " + replacement + replacement},
      {"overlong \xc0\xaf", "overlong " + replacement + replacement},
      {"surrogate \xed\xa0\x80", "surrogate " + replacement + replacement + replacement},
  };
  TraceRecorder trace;
  const auto now = TraceRecorder::Clock::now();
  for (const auto& [name, expected] : cases) trace.Complete(name, "comm", now, now);
  nlohmann::json doc;
  ASSERT_NO_THROW(doc = WriteAndRead(trace, "trace_names.json"));
  std::vector<std::string> names;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] == "X") names.push_back(e["name"].get<std::string>());
  }
  ASSERT_EQ(names.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) EXPECT_EQ(names[i], cases[i].second) << "case " << i;
}

// The stream holds, after each flush, every event so far exactly once and
// each lane's name once, and reads as JSON as it is; EndStream(true)
// removes it, EndStream(false) keeps it.
TEST(TraceTest, FlushAppendsOnlyTheNewEvents) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(tmp != nullptr ? tmp : "/tmp") + "/trace_stream.json";
  auto read = [&] {
    std::ifstream in(path);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return nlohmann::json::parse(text);
  };
  for (const bool remove : {false, true}) {
    TraceRecorder trace;
    const auto now = TraceRecorder::Clock::now();
    trace.Complete("before", "compute", now, now);
    trace.StreamTo(path, 5);
    EXPECT_THROW(trace.StreamTo(path, 5), std::logic_error);
    trace.Flush();
    trace.Complete("a", "comm", now, now);
    trace.Complete("b", "compute", now, now);
    trace.Flush();
    trace.Flush();
    const nlohmann::json events = read();
    std::vector<std::string> names;
    int lanes = 0;
    for (const auto& e : events) {
      EXPECT_EQ(e["pid"], 5);
      if (e["ph"] == "X") names.push_back(e["name"].get<std::string>());
      lanes += e["name"] == "thread_name";
    }
    EXPECT_EQ(names, (std::vector<std::string>{"before", "a", "b"}));
    EXPECT_EQ(lanes, 2);
    trace.EndStream(remove);
    EXPECT_EQ(std::ifstream(path).good(), !remove);
  }
  TraceRecorder trace;
  EXPECT_THROW(trace.StreamTo("/nonexistent-dir/trace.json", 0), std::runtime_error);
}

// The streamed file is a whole JSON array at every point a flush leaves
// it (strict readers such as Python's json take it as it is), and stays
// one when the stream ends without the complete file. Before, it lacked
// its closing bracket until removed.
TEST(TraceTest, AStreamedFileIsJsonAfterEveryFlush) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(tmp != nullptr ? tmp : "/tmp") + "/trace_json_stream.json";
  auto names = [&] {
    std::ifstream in(path);
    const nlohmann::json events = nlohmann::json::parse(in);  // throws on a cut document
    std::vector<std::string> out;
    for (const auto& e : events) {
      if (e["ph"] == "X") out.push_back(e["name"].get<std::string>());
    }
    return out;
  };
  TraceRecorder trace;
  trace.StreamTo(path, 0);
  ASSERT_NO_THROW(EXPECT_TRUE(names().empty()));
  const auto now = TraceRecorder::Clock::now();
  trace.Complete("first", "compute", now, now);
  trace.Flush();
  ASSERT_NO_THROW(EXPECT_EQ(names(), (std::vector<std::string>{"first"})));
  trace.Complete("second", "comm", now, now, "\"bytes\": 8");
  trace.Complete("third", "compute", now, now);
  trace.Flush();
  trace.EndStream(/*remove=*/false);
  ASSERT_NO_THROW(EXPECT_EQ(names(), (std::vector<std::string>{"first", "second", "third"})));
}

// A write that fails partway (here the file size limit, EFBIG; a full disk
// alike) leaves the file cut back to the last whole event and closed: JSON
// with the events flushed before. The failure is reported once, naming the
// file, later flushes write nothing, and the file stays locked. Before, the
// file ended inside an event, and its lock was released at the failure.
TEST(TraceTest, AWriteThatFailsPartwayLeavesTheFileJson) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(tmp != nullptr ? tmp : "/tmp") + "/trace_cut.json";
  TraceRecorder trace;
  trace.StreamTo(path, 0);
  const auto now = TraceRecorder::Clock::now();
  trace.Complete("kept", "compute", now, now);
  trace.Flush();
  const auto size_before = std::filesystem::file_size(path);
  for (int i = 0; i < 1000; ++i) trace.Complete("cut " + std::to_string(i), "compute", now, now);
  // Past the limit, write() stops partway, then fails with EFBIG (and
  // SIGXFSZ, ignored here, as its default ends the process).
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit old_limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  rlimit limit = old_limit;
  limit.rlim_cur = size_before + 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limit), 0);
  testing::internal::CaptureStderr();
  trace.Flush();
  trace.Complete("after the failure", "compute", now, now);
  trace.Flush();
  const std::string err = testing::internal::GetCapturedStderr();
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_EQ(err, "[ddp] trace: writing " + path + " failed (" + std::strerror(EFBIG) + "); it stops here, and "
                 "the complete trace is still written at the end\n");
  // The file is still this recorder's (locked) until EndStream: another
  // one would have it removed under it by EndStream(true).
  TraceRecorder other;
  EXPECT_THROW(other.StreamTo(path, 1), std::runtime_error);
  trace.EndStream(/*remove=*/false);
  std::ifstream in(path);
  nlohmann::json events;
  ASSERT_NO_THROW(events = nlohmann::json::parse(in));
  std::vector<std::string> names;
  for (const auto& e : events) {
    if (e["ph"] == "X") names.push_back(e["name"].get<std::string>());
  }
  EXPECT_EQ(names, (std::vector<std::string>{"kept"}));
}

// Two recorders streaming to one file (two wrappers given the same trace
// prefix in one process, or two processes) would write over each other's
// events: the second is refused, naming the file, and the first's file is
// left whole. Once the first ends, the path is free again. Before, the
// second truncated the first's file and both wrote into it.
TEST(TraceTest, ASecondRecorderOfOneFileIsRefused) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(tmp != nullptr ? tmp : "/tmp") + "/trace_shared.json";
  const auto now = TraceRecorder::Clock::now();
  TraceRecorder first, second;
  first.StreamTo(path, 0);
  first.Complete("first's", "compute", now, now);
  first.Flush();
  try {
    second.StreamTo(path, 0);
    ADD_FAILURE() << "two recorders stream to one file";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "trace: " + path + " is being written by another trace (another "
                                     "DistributedDataParallel or process with the same trace prefix and "
                                     "rank?); give each its own trace prefix");
  }
  second.Complete("second's", "compute", now, now);
  second.Flush();
  second.EndStream(/*remove=*/true);  // never started: must not remove the first's file
  {
    std::ifstream in(path);
    ASSERT_TRUE(in.good()) << "the first recorder's file was removed";
    nlohmann::json events;
    ASSERT_NO_THROW(events = nlohmann::json::parse(in));
    int firsts = 0;
    for (const auto& e : events) {
      EXPECT_NE(e["name"], "second's");
      firsts += e["name"] == "first's";
    }
    EXPECT_EQ(firsts, 1);
  }
  first.EndStream(/*remove=*/true);
  EXPECT_FALSE(std::filesystem::exists(path));
  TraceRecorder third;
  EXPECT_NO_THROW(third.StreamTo(path, 0));
  third.EndStream(/*remove=*/true);
}

// A FIFO named `name` in a fresh folder under the test's temporary one;
// empty, with the failure reported, when either cannot be made.
std::string FreshFifo(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/trace_fifo_XXXXXX";
  if (::mkdtemp(dir.data()) == nullptr) {
    ADD_FAILURE() << "mkdtemp " << dir << ": " << std::strerror(errno);
    return "";
  }
  const std::string fifo = dir + "/" + name;
  if (::mkfifo(fifo.c_str(), 0600) != 0) {
    ADD_FAILURE() << "mkfifo " << fifo << ": " << std::strerror(errno);
    return "";
  }
  return fifo;
}

// The folder FreshFifo made for `fifo`.
std::string FolderOf(const std::string& fifo) { return std::filesystem::path(fifo).parent_path().string(); }

// Reads a FIFO on a thread of its own, as `cat fifo` would: opened before
// the writer (non-blocking, so the open does not wait), read until the
// writer closes it or `deadline` passes. With `leave_after` set, it closes
// its end once that much arrived (a reader that goes away mid-run).
class FifoReader {
 public:
  FifoReader(const std::string& path, std::chrono::milliseconds deadline, size_t leave_after = 0)
      : fd_(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC)) {
    thread_ = std::thread([this, deadline, leave_after] { Read(deadline, leave_after); });
  }
  ~FifoReader() { Join(); }
  bool opened() const { return fd_ >= 0; }
  void Join() {
    if (thread_.joinable()) thread_.join();
  }
  std::string text() {
    std::lock_guard lock(mu_);
    return text_;
  }
  bool ended() {
    std::lock_guard lock(mu_);
    return ended_;
  }
  // Waits, up to `deadline`, for `piece` to arrive.
  bool WaitFor(const std::string& piece, std::chrono::milliseconds deadline) {
    const auto until = std::chrono::steady_clock::now() + deadline;
    while (std::chrono::steady_clock::now() < until) {
      if (text().find(piece) != std::string::npos) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return text().find(piece) != std::string::npos;
  }

 private:
  void Read(std::chrono::milliseconds deadline, size_t leave_after) {
    if (fd_ < 0) return;
    const auto until = std::chrono::steady_clock::now() + deadline;
    char buffer[4096];
    for (;;) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      if (left.count() <= 0) break;
      // Until a writer has come, Linux reports nothing here (no POLLHUP).
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      const ssize_t n = ::read(fd_, buffer, sizeof(buffer));
      if (n < 0) continue;  // EAGAIN, EINTR
      std::lock_guard lock(mu_);
      if (n == 0) {
        ended_ = true;  // the writer closed its end
        break;
      }
      text_.append(buffer, static_cast<size_t>(n));
      if (leave_after > 0 && text_.size() >= leave_after) break;
    }
    ::close(fd_);
  }

  int fd_;
  std::thread thread_;
  std::mutex mu_;
  std::string text_;
  bool ended_ = false;
};

std::vector<std::string> CompleteEventNames(const nlohmann::json& doc) {
  std::vector<std::string> names;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] == "X") names.push_back(e["name"].get<std::string>());
  }
  return names;
}

// A FIFO's reader gets the events as they are flushed, then one complete
// JSON document (the one Write makes) once the stream is ended; the FIFO
// stays a FIFO (no temporary file renamed over it).
TEST(TraceTest, AFifoIsStreamedAsOneCompleteDocument) {
  const std::string fifo = FreshFifo("trace_rank3.json");
  ASSERT_FALSE(fifo.empty());
  const std::string dir = FolderOf(fifo);
  EXPECT_TRUE(TraceRecorder::IsStreamTarget(fifo));
  EXPECT_FALSE(TraceRecorder::IsStreamTarget(dir));
  EXPECT_FALSE(TraceRecorder::IsStreamTarget(dir + "/missing.json"));
  FifoReader reader(fifo, std::chrono::seconds(60));
  ASSERT_TRUE(reader.opened());
  TraceRecorder trace(3);
  const auto now = TraceRecorder::Clock::now();
  trace.Complete("before", "compute", now, now);
  trace.StreamDocumentTo(fifo, 3, std::chrono::seconds(10));
  EXPECT_TRUE(trace.streams_document());
  EXPECT_THROW(trace.StreamDocumentTo(fifo, 3, std::chrono::seconds(10)), std::logic_error);
  trace.Complete("a", "comm", now, now, "\"bytes\": 64");
  trace.Flush();
  EXPECT_TRUE(reader.WaitFor("\"name\": \"a\"", std::chrono::seconds(30))) << reader.text();
  EXPECT_FALSE(reader.ended());
  trace.Complete("b", "compute", now, now);
  trace.Complete("dropped", "compute", now, now);
  trace.EndDocument();
  reader.Join();
  EXPECT_TRUE(reader.ended()) << reader.text();
  nlohmann::json doc;
  ASSERT_NO_THROW(doc = nlohmann::json::parse(reader.text())) << reader.text();
  EXPECT_EQ(CompleteEventNames(doc), (std::vector<std::string>{"before", "a", "b"})) << doc.dump();
  for (const auto& e : doc["traceEvents"]) EXPECT_EQ(e["pid"], 3) << e.dump();
  EXPECT_EQ(doc["otherData"]["dropped_events"], 1) << doc.dump();
  EXPECT_EQ(doc["otherData"]["max_events"], 3) << doc.dump();
  trace.EndStream(/*remove=*/true);
  EXPECT_EQ(std::filesystem::status(fifo).type(), std::filesystem::file_type::fifo);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir), std::filesystem::directory_iterator()), 1)
      << "something beside the FIFO";
}

// Opening a FIFO for writing waits for a reader: with none, the wait ends
// at its deadline with an error naming the FIFO, and nothing replaced it.
TEST(TraceTest, AFifoWithNoReaderIsAnErrorNamingItAtTheDeadline) {
  const std::string fifo = FreshFifo("trace_rank0.json");
  ASSERT_FALSE(fifo.empty());
  TraceRecorder trace;
  const auto start = std::chrono::steady_clock::now();
  try {
    trace.StreamDocumentTo(fifo, 0, std::chrono::milliseconds(300));
    ADD_FAILURE() << "streaming to a FIFO nobody reads started";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "trace: " + fifo + " is a FIFO, and nothing opened it for reading within "
                                     "300 ms; start its reader first (cat " + fifo + "), or move it away");
  }
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(waited, 0.3);
  EXPECT_LT(waited, 10.0);
  EXPECT_FALSE(trace.streams_document());
  EXPECT_EQ(std::filesystem::status(fifo).type(), std::filesystem::file_type::fifo);
}

// A reader that goes away mid-run: the next write fails with EPIPE, which
// is a warning naming the FIFO (not SIGPIPE, whose default action would end
// the test's process), and ending the document says it was cut.
TEST(TraceTest, AReaderThatGoesAwayIsAWarningNamingTheFifo) {
  const std::string fifo = FreshFifo("trace_rank1.json");
  ASSERT_FALSE(fifo.empty());
  FifoReader reader(fifo, std::chrono::seconds(60), /*leave_after=*/1);
  ASSERT_TRUE(reader.opened());
  TraceRecorder trace;
  trace.StreamDocumentTo(fifo, 1, std::chrono::seconds(10));
  reader.Join();  // it read the document's head and closed its end
  const auto now = TraceRecorder::Clock::now();
  trace.Complete("after the reader left", "compute", now, now);
  testing::internal::CaptureStderr();
  trace.Flush();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(err, "[ddp] trace: writing " + fifo + " failed (its reader went away (EPIPE)); its reader got the "
                 "trace cut there, and the run goes on without it\n");
  try {
    trace.EndDocument();
    ADD_FAILURE() << "a cut document was ended";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "trace: " + fifo + " failed before the end of the run; its reader got "
                                     "the trace cut there");
  }
  EXPECT_EQ(std::filesystem::status(fifo).type(), std::filesystem::file_type::fifo);
}

// A reader that stays but stops reading (the pipe full) does not hold the
// run: a write waits the stream's wait at most, then is a warning naming
// the FIFO, and the stream ends.
TEST(TraceTest, AReaderThatStopsReadingHoldsAFlushOnlyForTheWait) {
  const std::string fifo = FreshFifo("trace_rank2.json");
  ASSERT_FALSE(fifo.empty());
  const int idle_reader = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  ASSERT_GE(idle_reader, 0);
  TraceRecorder trace;
  trace.StreamDocumentTo(fifo, 2, std::chrono::milliseconds(300));
  // Far more than a pipe holds (64 KiB by default).
  const auto now = TraceRecorder::Clock::now();
  for (int i = 0; i < 4000; ++i) trace.Complete("event " + std::to_string(i), "compute", now, now);
  const auto start = std::chrono::steady_clock::now();
  testing::internal::CaptureStderr();
  trace.Flush();
  const std::string err = testing::internal::GetCapturedStderr();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(waited, 0.3);
  EXPECT_LT(waited, 10.0);
  EXPECT_EQ(err, "[ddp] trace: writing " + fifo + " failed (its reader took nothing for 300 ms); its reader "
                 "got the trace cut there, and the run goes on without it\n");
  EXPECT_THROW(trace.EndDocument(), std::runtime_error);
  ::close(idle_reader);
}

// One FIFO takes one rank's trace: a second recorder (another rank's
// through a link to the same pipe) is refused, naming the path.
TEST(TraceTest, ASecondWriterOfOneFifoIsRefused) {
  const std::string fifo = FreshFifo("trace_rank0.json");
  ASSERT_FALSE(fifo.empty());
  const std::string link = FolderOf(fifo) + "/trace_rank1.json";
  ASSERT_EQ(::symlink(fifo.c_str(), link.c_str()), 0);
  FifoReader reader(fifo, std::chrono::seconds(60));
  ASSERT_TRUE(reader.opened());
  TraceRecorder first, second;
  first.StreamDocumentTo(fifo, 0, std::chrono::seconds(10));
  try {
    second.StreamDocumentTo(link, 1, std::chrono::seconds(10));
    ADD_FAILURE() << "two recorders stream into one FIFO";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("trace: " + link + " is being written by another trace"),
              std::string::npos) << e.what();
  }
  first.EndDocument();
  reader.Join();
  nlohmann::json doc;
  EXPECT_NO_THROW(doc = nlohmann::json::parse(reader.text())) << reader.text();
}

// A file system that cannot lock (ENOLCK, ENOSYS, EOPNOTSUPP) is not
// someone else holding the file: the stream is written unlocked, after one
// warning naming the file and the error. Before, StreamTo threw "cannot
// lock", which failed a DDP's construction on such a mount.
TEST(TraceTest, AFileSystemThatCannotLockIsStreamedUnlockedWithAWarning) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(tmp != nullptr ? tmp : "/tmp") + "/trace_no_locks.json";
  const auto now = TraceRecorder::Clock::now();
  for (const int error : {ENOLCK, ENOSYS, EOPNOTSUPP}) {
    SCOPED_TRACE(std::strerror(error));
    TraceRecorder trace;
    ::testing::internal::CaptureStderr();
    flock_fails_with = error;
    try {
      trace.StreamTo(path, 0);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "StreamTo threw: " << e.what();
    }
    flock_fails_with = 0;
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find("cannot lock " + path + " (" + std::strerror(error) + ")"), std::string::npos) << err;
    trace.Complete("step", "compute", now, now);
    trace.Flush();
    std::ifstream in(path);
    nlohmann::json events;
    ASSERT_NO_THROW(events = nlohmann::json::parse(in));
    int steps = 0;
    for (const auto& e : events) steps += e["name"] == "step";
    EXPECT_EQ(steps, 1);
    trace.EndStream(/*remove=*/true);
  }
  // Someone else holding the lock still refuses.
  flock_fails_with = EWOULDBLOCK;
  TraceRecorder refused;
  try {
    refused.StreamTo(path, 0);
    ADD_FAILURE() << "StreamTo took a file whose lock another writer holds";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("is being written by another trace"), std::string::npos) << e.what();
  }
  flock_fails_with = 0;
}

// The same for a FIFO: a pipe that cannot be locked (ENOLCK, ENOSYS,
// EOPNOTSUPP) is streamed unlocked after a warning naming it. Before,
// StreamDocumentTo threw "cannot lock" for any error but EWOULDBLOCK.
TEST(TraceTest, AFifoThatCannotBeLockedIsStreamedUnlockedWithAWarning) {
  const auto now = TraceRecorder::Clock::now();
  for (const int error : {ENOLCK, ENOSYS, EOPNOTSUPP}) {
    SCOPED_TRACE(std::strerror(error));
    const std::string fifo = FreshFifo("trace_rank0.json");
    ASSERT_FALSE(fifo.empty());
    FifoReader reader(fifo, std::chrono::seconds(60));
    ASSERT_TRUE(reader.opened());
    TraceRecorder trace;
    ::testing::internal::CaptureStderr();
    flock_fails_with = error;
    try {
      trace.StreamDocumentTo(fifo, 0, std::chrono::seconds(10));
    } catch (const std::exception& e) {
      ADD_FAILURE() << "StreamDocumentTo threw: " << e.what();
    }
    flock_fails_with = 0;
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find("cannot lock " + fifo + " (" + std::strerror(error) + ")"), std::string::npos) << err;
    ASSERT_TRUE(trace.streams_document());
    trace.Complete("step", "compute", now, now);
    trace.EndDocument();
    reader.Join();
    nlohmann::json doc;
    ASSERT_NO_THROW(doc = nlohmann::json::parse(reader.text())) << reader.text();
    EXPECT_EQ(CompleteEventNames(doc), (std::vector<std::string>{"step"})) << doc.dump();
  }
}

}  // namespace
}  // namespace ddp::dist
