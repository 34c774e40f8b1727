// //examples:train's launcher in its setup, before any rank starts. Stopped
// there, by a signal while it checks the data or by a refusal of its
// flags, it leaves no folder it made for --checkpoint or --log_dir, and
// every folder that was there before. A --flagfile that is a FIFO is read
// there once, checked, and its flags reach the ranks.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "examples/testing/subprocess.h"
#include "gtest/gtest.h"

namespace ddp::examples {
namespace {

using testing::Runfile;

// The names in `dir`, sorted.
std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

// Flags of a run that would be over in seconds.
std::vector<std::string> TinyRun(const std::string& program) {
  return {Runfile(program), "--dataset=synthetic", "--model=mlp", "--batch_size=16", "--workers=0",
          "--nproc_per_node=1", "--epochs=1", "--train_samples=64", "--test_samples=16"};
}

// Ctrl-C while the launcher read the data let it go on to make the folders
// of --log_dir and --checkpoint, then end by the signal: they were left
// empty. The program (a test build) is held where CheckSetup starts, past
// the last check for a signal before the folders are made, until the test
// closes its end of a FIFO; the signal comes in there.
TEST(TrainSetupTest, CtrlCWhileTheDataIsCheckedLeavesNoFolderItMade) {
  const std::string dir = testing::MakeTempDir("ctrl_c_data");
  const std::string hold = dir + "/hold";
  ASSERT_EQ(mkfifo(hold.c_str(), 0600), 0) << hold << ": " << std::strerror(errno);
  // A folder that was there stays, though the checkpoint's folder inside it goes.
  ASSERT_TRUE(std::filesystem::create_directory(dir + "/kept"));
  std::vector<std::string> args = TinyRun("examples/train_setup_hold");
  args.push_back("--log_dir=" + dir + "/logs/run1");
  args.push_back("--checkpoint=" + dir + "/kept/saved/model.ckpt");
  testing::Subprocess running(args, {{"DDP_TRAIN_SETUP_HOLD", hold}});
  int writer = -1;
  ASSERT_NO_FATAL_FAILURE(testing::OpenFifoOnceRead(hold, running, &writer));
  running.Signal(SIGINT);
  // Taken (its line is written by the handler) before the program goes on.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (running.Stderr().find("interrupted by Ctrl-C") == std::string::npos) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the signal was not taken:\n" << running.Stderr();
    ASSERT_EQ(running.Wait(std::chrono::milliseconds(20)), -1) << "the run ended first:\n" << running.Stderr();
  }
  close(writer);
  ASSERT_EQ(running.Wait(std::chrono::seconds(60)), 128 + SIGINT) << running.Stdout() << running.Stderr();
  EXPECT_EQ(running.Stderr(),
            "train: interrupted by Ctrl-C during setup; stopping before any rank starts (Ctrl-C again: at once)\n");
  EXPECT_EQ(running.Stdout(), "");
  EXPECT_EQ(Entries(dir), (std::vector<std::string>{"hold", "kept"}));
  EXPECT_EQ(Entries(dir + "/kept"), std::vector<std::string>{});
}

// The checkpoint's folder was made before --log_dir was looked at: a run
// refused for its --log_dir left it behind, empty.
TEST(TrainSetupTest, ARunRefusedForItsLogDirLeavesNoCheckpointFolder) {
  const std::string dir = testing::MakeTempDir("refused_log_dir");
  // A folder where metrics.csv is written: refused.
  ASSERT_TRUE(std::filesystem::create_directories(dir + "/logs/metrics.csv"));
  std::vector<std::string> args = TinyRun("examples/train");
  args.push_back("--log_dir=" + dir + "/logs");
  args.push_back("--checkpoint=" + dir + "/saved/deeper/model.ckpt");
  const testing::RunOutput r = testing::RunToEnd(args);
  ASSERT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_EQ(r.err, "train: --log_dir=" + dir + "/logs: " + dir +
                       "/logs/metrics.csv is a folder, not a regular file, and the run would replace it with its "
                       "metrics.csv; move it away, or pass another --log_dir (a named pipe or a terminal there takes "
                       "the rows as a stream)\n");
  EXPECT_EQ(Entries(dir), std::vector<std::string>{"logs"});
  EXPECT_EQ(Entries(dir + "/logs"), std::vector<std::string>{"metrics.csv"});
}

// A TCP port free now on 127.0.0.1, for a job's rendezvous.
std::string FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t size = sizeof(addr);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &size) != 0) {
    ADD_FAILURE() << "no free port: " << std::strerror(errno);
  }
  close(fd);
  return std::to_string(ntohs(addr.sin_port));
}

// The same under a launcher (launch variables set, one rank), where rank 0
// checks the folders at its setup instead of CheckSetup.
TEST(TrainSetupTest, ALaunchedRankRefusedForItsLogDirLeavesNoCheckpointFolder) {
  const std::string dir = testing::MakeTempDir("launched_refused_log_dir");
  ASSERT_TRUE(std::filesystem::create_directories(dir + "/logs/metrics.csv"));
  std::vector<std::string> args = TinyRun("examples/train");
  args.erase(std::find(args.begin(), args.end(), "--nproc_per_node=1"));
  args.push_back("--log_dir=" + dir + "/logs");
  args.push_back("--checkpoint=" + dir + "/saved/deeper/model.ckpt");
  testing::Subprocess rank(args, {{"RANK", "0"},
                                  {"WORLD_SIZE", "1"},
                                  {"MASTER_ADDR", "127.0.0.1"},
                                  {"MASTER_PORT", FreePort()}});
  ASSERT_EQ(rank.Wait(std::chrono::seconds(120)), 2) << rank.Stdout() << rank.Stderr();
  EXPECT_NE(rank.Stderr().find("/logs/metrics.csv is a folder, not a regular file"), std::string::npos)
      << rank.Stderr();
  EXPECT_EQ(Entries(dir), std::vector<std::string>{"logs"});
}

// An exception that is not a std::exception (the test build throws one
// where $DDP_TRAIN_THROW_FOR_TESTING says) ends the program with its own
// line and exit status 1, wherever it is thrown: in the launcher's check,
// in a rank's run, or outside both. It used to escape main's handlers,
// which took std::exception alone, and abort the program (SIGABRT, a core
// file) with the C++ runtime's "terminate called after throwing ...".
TEST(TrainSetupTest, AnExceptionThatIsNotAStdExceptionEndsWithALineAndStatusOne) {
  const std::string line = "train: error: an exception that is not a std::exception\n";
  for (const char* where : {"setup", "main"}) {
    const testing::RunOutput r =
        testing::RunToEnd(TinyRun("examples/train_setup_hold"), {{"DDP_TRAIN_THROW_FOR_TESTING", where}});
    EXPECT_EQ(r.exit_code, 1) << where << ": " << r.out << r.err;
    EXPECT_EQ(r.err, line) << where;
  }
  std::vector<std::string> args = TinyRun("examples/train_setup_hold");
  args.erase(std::find(args.begin(), args.end(), "--nproc_per_node=1"));
  testing::Subprocess rank(args, {{"RANK", "0"},
                                  {"WORLD_SIZE", "1"},
                                  {"MASTER_ADDR", "127.0.0.1"},
                                  {"MASTER_PORT", FreePort()},
                                  {"DDP_TRAIN_THROW_FOR_TESTING", "rank"}});
  EXPECT_EQ(rank.Wait(std::chrono::seconds(120)), 1) << rank.Stdout() << rank.Stderr();
  EXPECT_EQ(rank.Stderr(), line);
}

// Writes `text` into the FIFO `path` once `running` has opened it for
// reading, then closes it.
void FeedFifo(const std::string& path, const std::string& text, testing::Subprocess& running) {
  int writer = -1;
  ASSERT_NO_FATAL_FAILURE(testing::OpenFifoOnceRead(path, running, &writer));
  EXPECT_EQ(write(writer, text.data(), text.size()), static_cast<ssize_t>(text.size())) << path;
  close(writer);
}

// A --flagfile that is a FIFO (a shell's <(...)) was left to gflags, which
// ignored a misspelt flag in it without a word; its lines are checked now,
// naming it and the line.
TEST(TrainSetupTest, AMisspeltFlagInAFifoFlagfileIsNamedWithItsLine) {
  const std::string dir = testing::MakeTempDir("fifo_flagfile_typo");
  const std::string fifo = dir + "/flags";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0) << fifo << ": " << std::strerror(errno);
  std::vector<std::string> args = TinyRun("examples/train");
  args.push_back("--checkpoint=none");
  args.push_back("--flagfile=" + fifo);
  testing::Subprocess running(args);
  ASSERT_NO_FATAL_FAILURE(FeedFifo(fifo, "--max_steps=1\n--modle=cnn\n", running));
  ASSERT_EQ(running.Wait(std::chrono::seconds(60)), 2) << running.Stdout() << running.Stderr();
  EXPECT_EQ(running.Stderr(), "train: " + fifo + ":2: unknown flag --modle; did you mean --model? (--help lists the flags)\n");
  EXPECT_EQ(running.Stdout(), "");
}

// The ranks the trainer starts parse its arguments again: with a FIFO as
// --flagfile they opened it once more and waited for a writer that had
// gone. They get its flags in its place now (--model=mlp, which the RESULT
// line shows).
TEST(TrainSetupTest, TheFlagsOfAFifoFlagfileReachTheRanks) {
  const std::string dir = testing::MakeTempDir("fifo_flagfile_ranks");
  const std::string fifo = dir + "/flags";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0) << fifo << ": " << std::strerror(errno);
  std::vector<std::string> args = TinyRun("examples/train");
  args.erase(std::find(args.begin(), args.end(), "--model=mlp"));
  args.push_back("--checkpoint=none");
  args.push_back("--flagfile=" + fifo);
  testing::Subprocess running(args);
  ASSERT_NO_FATAL_FAILURE(FeedFifo(fifo, "--model=mlp\n--max_steps=2\n", running));
  ASSERT_EQ(running.Wait(std::chrono::seconds(120)), 0) << running.Stdout() << running.Stderr();
  const std::vector<std::string> lines = testing::Lines(running.Stdout());
  ASSERT_FALSE(lines.empty()) << running.Stderr();
  EXPECT_EQ(lines.back().rfind("RESULT model=mlp ranks=1 ", 0), 0u) << running.Stdout();
}

// Ctrl-C while the launcher read a --flagfile that is a FIFO (whose writer
// had not closed it) printed its "stopping" line, but the read went on to
// its 120 s deadline. It stops now, within a slice of the wait: the line
// names the flagfile, and the run ends by the signal, having made nothing.
// The FIFO is held open by the test and never written: the program is
// reading it from the moment the test can open it (OpenFifoOnceRead).
// This is also the case of a Ctrl-C in setup (no rank, no folder made);
// train_cli_test's, which closed the FIFO just after the signal, raced
// the read's stop (one line or two) and is gone.
TEST(TrainSetupTest, CtrlCWhileAFifoFlagfileIsReadStopsAtOnce) {
  const std::string dir = testing::MakeTempDir("ctrl_c_fifo_flagfile");
  const std::string fifo = dir + "/flags";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0) << fifo << ": " << std::strerror(errno);
  std::vector<std::string> args = TinyRun("examples/train");
  args.push_back("--log_dir=" + dir + "/logs");
  args.push_back("--checkpoint=" + dir + "/saved/model.ckpt");
  args.push_back("--flagfile=" + fifo);
  testing::Subprocess running(args);
  int writer = -1;
  ASSERT_NO_FATAL_FAILURE(testing::OpenFifoOnceRead(fifo, running, &writer));
  const auto signalled = std::chrono::steady_clock::now();
  running.Signal(SIGINT);
  const int code = running.Wait(std::chrono::seconds(30));
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - signalled).count();
  close(writer);
  ASSERT_EQ(code, 128 + SIGINT) << running.Stdout() << running.Stderr();
  // The wait's slice is 0.1 s; the rest is a loaded host's scheduling.
  EXPECT_LT(took, 10.0) << "Ctrl-C took " << took << " s to stop the read of " << fifo;
  EXPECT_EQ(running.Stderr(),
            "train: interrupted by Ctrl-C during setup; stopping before any rank starts (Ctrl-C again: at once)\n"
            "train: --flagfile=" + fifo + ": stopped reading " + fifo +
            " before its end (its writer had not closed it); none of its flags were taken\n");
  EXPECT_EQ(running.Stdout(), "");
  EXPECT_EQ(Entries(dir), std::vector<std::string>{"flags"});
}

}  // namespace
}  // namespace ddp::examples
