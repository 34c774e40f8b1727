#include "transport/launch/error_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <future>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace ddp::transport::launch {
namespace {

class ErrorFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = ::testing::TempDir() + "/error_file_XXXXXX";
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void Write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ + "/" + name) << text;
  }
  std::string Read(const std::string& name) {
    std::ifstream in(dir_ + "/" + name);
    std::stringstream out;
    out << in.rdbuf();
    return out.str();
  }
  // The names in dir_, sorted.
  std::vector<std::string> Entries() {
    std::vector<std::string> names;
    if (DIR* dir = opendir(dir_.c_str())) {
      while (const dirent* entry = readdir(dir)) {
        if (entry->d_name[0] != '.') names.push_back(entry->d_name);
      }
      closedir(dir);
    }
    std::sort(names.begin(), names.end());
    return names;
  }
  std::string dir_;
};

TEST_F(ErrorFileTest, WhatIsWrittenReadsBackWithItsTime) {
  const std::string path = dir_ + "/error.json";
  const auto when = std::chrono::system_clock::time_point(std::chrono::microseconds(1700000000123456));
  ASSERT_TRUE(WriteErrorFile(path, "loss is NaN at step 12\n\"quoted\" \xc3\xa9", when).ok());
  StatusOr<WorkerError> read = ReadErrorFile(path);
  ASSERT_TRUE(read.ok()) << read.status().message();
  EXPECT_EQ(read->message, "loss is NaN at step 12\n\"quoted\" \xc3\xa9");
  EXPECT_EQ(read->timestamp_us, 1700000000123456);
  // torchrun's reader takes extraInfo.timestamp, whole seconds as a string.
  EXPECT_NE(Read("error.json").find("\"timestamp\":\"1700000000\""), std::string::npos) << Read("error.json");
  // Written whole: no temporary is left beside it.
  EXPECT_EQ(Entries(), std::vector<std::string>{"error.json"});
}

// The file's mode is 0644 less the umask, as a plain open() with 0644 makes
// it: a worker run under umask 077 leaves no file others can read (fchmod
// to 0644 ignored the umask).
TEST_F(ErrorFileTest, TheFilesModeHonoursTheUmask) {
  const std::string path = dir_ + "/error.json";
  const mode_t saved = umask(077);
  const Status private_write = WriteErrorFile(path, "private");
  umask(027);
  const std::string group_path = dir_ + "/group.json";
  const Status group_write = WriteErrorFile(group_path, "group");
  umask(022);
  const std::string plain_path = dir_ + "/plain.json";
  const Status plain_write = WriteErrorFile(plain_path, "plain");
  umask(saved);
  ASSERT_TRUE(private_write.ok()) << private_write.message();
  ASSERT_TRUE(group_write.ok()) << group_write.message();
  ASSERT_TRUE(plain_write.ok()) << plain_write.message();
  struct stat st{};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(stat(group_path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0640u);
  ASSERT_EQ(stat(plain_path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
}

// Threads of one worker that fail at once each write whole: the file read
// back is one of their messages, never a mix, and every write succeeds (a
// temporary shared by the process was truncated under a writer, and the
// rename of the one moved away failed).
TEST_F(ErrorFileTest, ThreadsWritingAtOnceEachWriteWhole) {
  const std::string path = dir_ + "/error.json";
  constexpr int kThreads = 4;
  constexpr int kRounds = 200;
  std::vector<std::string> messages;
  for (int t = 0; t < kThreads; ++t) messages.push_back(std::string(20000 + 7919 * t, static_cast<char>('a' + t)));
  std::atomic<int> failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < kRounds; ++round) {
        if (!WriteErrorFile(path, messages[t]).ok()) ++failed;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failed.load(), 0);
  StatusOr<WorkerError> read = ReadErrorFile(path);
  ASSERT_TRUE(read.ok()) << read.status().message();
  EXPECT_NE(std::find(messages.begin(), messages.end(), read->message), messages.end())
      << read->message.size() << " bytes, not one of the messages";
  EXPECT_EQ(Entries(), std::vector<std::string>{"error.json"});
}

TEST_F(ErrorFileTest, InvalidUtf8IsReplacedNotRefused) {
  const std::string path = dir_ + "/error.json";
  ASSERT_TRUE(WriteErrorFile(path, "bad byte \xff here").ok());
  StatusOr<WorkerError> read = ReadErrorFile(path);
  ASSERT_TRUE(read.ok()) << read.status().message();
  EXPECT_EQ(read->message.rfind("bad byte ", 0), 0u);
  EXPECT_NE(read->message.find(" here"), std::string::npos);
}

TEST_F(ErrorFileTest, ReadsWhatTorchElasticsRecordWrites) {
  // The layout of torch.distributed.elastic's @record, and the older one.
  Write("record.json",
        R"({"message": {"message": "ValueError: bad batch", "extraInfo": )"
        R"({"py_callstack": "Traceback ...", "timestamp": "1700000001"}}})");
  StatusOr<WorkerError> read = ReadErrorFile(dir_ + "/record.json");
  ASSERT_TRUE(read.ok()) << read.status().message();
  EXPECT_EQ(read->message, "ValueError: bad batch");
  EXPECT_EQ(read->timestamp_us, int64_t{1700000001} * 1000000);

  Write("old.json", R"({"message": "RuntimeError: x", "timestamp": 1700000002})");
  read = ReadErrorFile(dir_ + "/old.json");
  ASSERT_TRUE(read.ok()) << read.status().message();
  EXPECT_EQ(read->message, "RuntimeError: x");
  EXPECT_EQ(read->timestamp_us, int64_t{1700000002} * 1000000);

  Write("no_time.json", R"({"message": {"message": "no time"}})");
  read = ReadErrorFile(dir_ + "/no_time.json");
  ASSERT_TRUE(read.ok()) << read.status().message();
  EXPECT_EQ(read->timestamp_us, 0);
}

// torchrun's launcher copies the root-cause worker's file into its own
// whole (ErrorHandler.dump_error_file), so that whoever reads the launcher's
// file (a scheduler, TorchX) gets the traceback, with the worker's exit code
// as errorCode. ddprun wrote only the message and time before.
TEST_F(ErrorFileTest, CopyErrorRecordKeepsTheWholeRecordAndSetsTheErrorCode) {
  Write("record.json",
        R"({"message": {"message": "ValueError: bad batch", "extraInfo": )"
        R"({"py_callstack": "Traceback (most recent call last): ...", "timestamp": "1700000001"}}})");
  StatusOr<WorkerError> read = ReadErrorFile(dir_ + "/record.json");
  ASSERT_TRUE(read.ok()) << read.status().message();
  const std::string own = dir_ + "/launcher.json";
  ASSERT_TRUE(CopyErrorRecord(own, read->record, 3).ok());
  EXPECT_EQ(Read("launcher.json"),
            R"({"message":{"errorCode":3,"extraInfo":{"py_callstack":"Traceback (most recent call last): ...",)"
            R"("timestamp":"1700000001"},"message":"ValueError: bad batch"}})"
            "\n");
  // What the copy says reads back as what the worker said.
  StatusOr<WorkerError> copied = ReadErrorFile(own);
  ASSERT_TRUE(copied.ok()) << copied.status().message();
  EXPECT_EQ(copied->message, "ValueError: bad batch");
  EXPECT_EQ(copied->timestamp_us, int64_t{1700000001} * 1000000);
  // Killed by a signal: minus the signal, as torchrun's exit code. 0 leaves
  // the worker's own errorCode alone, and the older layout has no place for
  // one.
  ASSERT_TRUE(CopyErrorRecord(own, read->record, -9).ok());
  EXPECT_NE(Read("launcher.json").find(R"("errorCode":-9)"), std::string::npos);
  ASSERT_TRUE(CopyErrorRecord(own, R"({"message": {"message": "m", "errorCode": 5}})", 0).ok());
  EXPECT_EQ(Read("launcher.json"), R"({"message":{"errorCode":5,"message":"m"}})" "\n");
  ASSERT_TRUE(CopyErrorRecord(own, R"({"message": "old", "timestamp": 1700000002})", 1).ok());
  EXPECT_EQ(Read("launcher.json"), R"({"message":"old","timestamp":1700000002})" "\n");
  EXPECT_EQ(CopyErrorRecord(own, "not json", 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Entries(), (std::vector<std::string>{"launcher.json", "record.json"}));  // no temporaries left
}

// A time that is negative, or too large to be had in microseconds, is no
// time: it used to overflow (or stay negative) and then read as the
// earliest of all, naming its worker the root cause.
TEST_F(ErrorFileTest, TimestampsOutOfRangeCountAsUnknown) {
  const char* cases[] = {
      R"({"message": "x", "timestamp": "999999999999999999"})",
      R"({"message": "x", "timestamp": 9223372036854775807})",
      R"({"message": "x", "timestamp": 18446744073709551615})",
      R"({"message": "x", "timestamp": -5})",
      R"({"message": {"message": "x", "extraInfo": {"timestamp": "999999999999999999"}}})",
      R"({"message": {"message": "x", "extraInfo": {"timestamp_us": -1}}})",
      R"({"message": {"message": "x", "extraInfo": {"timestamp_us": 18446744073709551615}}})",
  };
  for (const char* text : cases) {
    Write("range.json", text);
    StatusOr<WorkerError> read = ReadErrorFile(dir_ + "/range.json");
    ASSERT_TRUE(read.ok()) << text << ": " << read.status().message();
    EXPECT_EQ(read->message, "x") << text;
    EXPECT_EQ(read->timestamp_us, 0) << text;
  }
  // The largest that fits is still taken; a bad timestamp_us falls back to
  // the whole seconds beside it.
  Write("range.json", R"({"message": "x", "timestamp": 9223372036854})");
  StatusOr<WorkerError> read = ReadErrorFile(dir_ + "/range.json");
  ASSERT_TRUE(read.ok()) << read.status().message();
  EXPECT_EQ(read->timestamp_us, int64_t{9223372036854} * 1000000);
  Write("range.json",
        R"({"message": {"message": "x", "extraInfo": {"timestamp_us": -1, "timestamp": "1700000003"}}})");
  read = ReadErrorFile(dir_ + "/range.json");
  ASSERT_TRUE(read.ok()) << read.status().message();
  EXPECT_EQ(read->timestamp_us, int64_t{1700000003} * 1000000);
}

TEST_F(ErrorFileTest, MissingAndMalformedFilesAreNamed) {
  StatusOr<WorkerError> read = ReadErrorFile(dir_ + "/none.json");
  EXPECT_EQ(read.status().code(), StatusCode::kNotFound);
  EXPECT_NE(read.status().message().find("none.json"), std::string::npos);

  const std::pair<const char*, const char*> cases[] = {
      {"{\"message\": ", "not JSON"},
      {"[1, 2]", "no \"message\""},
      {"{\"other\": 1}", "no \"message\""},
      {"{\"message\": 7}", "neither a string nor an object"},
      {"{\"message\": {\"text\": \"x\"}}", "neither a string nor an object"},
  };
  for (const auto& [text, why] : cases) {
    Write("bad.json", text);
    read = ReadErrorFile(dir_ + "/bad.json");
    ASSERT_FALSE(read.ok()) << text;
    EXPECT_EQ(read.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_NE(read.status().message().find(dir_ + "/bad.json"), std::string::npos) << read.status().message();
    EXPECT_NE(read.status().message().find(why), std::string::npos) << read.status().message();
  }
  Write("huge.json", std::string((size_t{1} << 20) + 10, ' '));
  read = ReadErrorFile(dir_ + "/huge.json");
  EXPECT_NE(read.status().message().find("is over 1048576 bytes"), std::string::npos) << read.status().message();
}

// A FIFO (or anything but a regular file) where the error file should be
// is refused at once: the launcher's read of it used to block until some
// process wrote to the FIFO, which none may ever do.
TEST_F(ErrorFileTest, AFifoInPlaceOfTheFileIsRefusedWithoutWaiting) {
  const std::string path = dir_ + "/fifo.json";
  ASSERT_EQ(mkfifo(path.c_str(), 0644), 0);
  std::future<StatusOr<WorkerError>> read =
      std::async(std::launch::async, [&] { return ReadErrorFile(path); });
  if (read.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
    ADD_FAILURE() << "ReadErrorFile still waits on the FIFO after 5 s";
    // Let it go: a writer that opens and closes the FIFO ends its wait.
    const int writer = open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (writer >= 0) close(writer);
  }
  StatusOr<WorkerError> result = read.get();
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument) << result.status();
  EXPECT_EQ(result.status().message(), "error file '" + path + "' is not a regular file");

  const std::string folder = dir_ + "/folder.json";
  ASSERT_EQ(mkdir(folder.c_str(), 0755), 0);
  result = ReadErrorFile(folder);
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument) << result.status();
  EXPECT_EQ(result.status().message(), "error file '" + folder + "' is not a regular file");
}

TEST_F(ErrorFileTest, RecordWorkerErrorWritesWhereTheLauncherSaid) {
  unsetenv(kEnvErrorFile);
  EXPECT_TRUE(RecordWorkerError("nobody asked").ok());
  const std::string path = dir_ + "/rank_3.error.json";
  setenv(kEnvErrorFile, path.c_str(), 1);
  ASSERT_TRUE(RecordWorkerError("rank 3: dataset missing").ok());
  unsetenv(kEnvErrorFile);
  StatusOr<WorkerError> read = ReadErrorFile(path);
  ASSERT_TRUE(read.ok()) << read.status().message();
  EXPECT_EQ(read->message, "rank 3: dataset missing");
  EXPECT_GT(read->timestamp_us, int64_t{1600000000} * 1000000);

  setenv(kEnvErrorFile, (dir_ + "/no/such/dir/e.json").c_str(), 1);
  Status status = RecordWorkerError("x");
  unsetenv(kEnvErrorFile);
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("no/such/dir"), std::string::npos) << status.message();
}

}  // namespace
}  // namespace ddp::transport::launch
