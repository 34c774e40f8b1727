#include "examples/trainer/metrics_log.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <termios.h>
#include <unistd.h>

#include <chrono>

#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <sstream>
#include <thread>

#include "gtest/gtest.h"

namespace ddp::examples::trainer {
namespace {

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string TempDir(const std::string& name) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/" + name;
  std::filesystem::remove_all(dir);
  return dir;
}

TEST(MetricsLogTest, WritesCsvRowsAsTheyCome) {
  const std::string dir = TempDir("rows");
  MetricsLog log(dir, "t", "s", -1);
  log.AddStep({10, 1, 2.25, 0.05, 1234.5});
  log.AddEval({10, 1, 0.5, 0.8125});
  // Flushed at once: readable while the run goes on.
  EXPECT_EQ(Read(dir + "/metrics.csv"),
            "step,epoch,loss,lr,samples_per_s,test_loss,test_acc\n"
            "10,1,2.25,0.05,1234.5,,\n"
            "10,1,,,,0.5,0.8125\n");
}

// metrics.csv stays open for the whole run, in which rank 0 may start
// processes (a launcher's workers): they must not inherit it.
TEST(MetricsLogTest, CsvIsOpenedCloseOnExec) {
  const std::string dir = TempDir("cloexec");
  MetricsLog log(dir, "t", "s", -1);
  const std::filesystem::path csv = std::filesystem::canonical(log.csv_path());
  int found = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    if (std::filesystem::read_symlink(entry.path(), ec) != csv || ec) continue;
    const int fd = std::stoi(entry.path().filename().string());
    EXPECT_NE(fcntl(fd, F_GETFD) & FD_CLOEXEC, 0) << "fd " << fd << " of " << csv;
    ++found;
  }
  EXPECT_EQ(found, 1);
}

TEST(MetricsLogTest, ChartHasBothPanels) {
  const std::string dir = TempDir("chart");
  MetricsLog log(dir, "mlp on fashion_mnist", "2 ranks", -1);
  for (int s = 10; s <= 100; s += 10) log.AddStep({s, 1, 2.0 / s, 0.05, 1000});
  log.AddEval({50, 1, 0.6, 0.75});
  log.AddEval({100, 1, 0.4, 0.85});
  log.AddEpochEnd(1, 100);
  log.WriteChart();
  const std::string svg = Read(dir + "/chart.svg");
  EXPECT_NE(svg.find("mlp on fashion_mnist"), std::string::npos);
  EXPECT_NE(svg.find("train loss"), std::string::npos);
  EXPECT_NE(svg.find("test accuracy"), std::string::npos);
  EXPECT_NE(svg.find(">epoch 1<"), std::string::npos);
  // No temporary files are left next to the chart.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 2);
}

// A fresh run into a --log_dir that holds an earlier run's rows replaced
// its metrics.csv and chart.svg, and the rows were gone. They are kept
// under the first free pair of .prev names; a file with no row has nothing
// to keep, and a resumed run continues the rows instead.
TEST(MetricsLogTest, AFreshRunKeepsAnEarlierRunsRowsAndChart) {
  namespace fs = std::filesystem;
  const std::string dir = TempDir("earlier_run");
  const std::string header = std::string(MetricsLog::CsvHeader()) + "\n";
  {
    MetricsLog first(dir, "t", "s", -1);
    first.AddStep({10, 1, 2.25, 0.05, 100});
    first.WriteChart();
  }
  const std::string first_chart = Read(dir + "/chart.svg");
  {
    MetricsLog second(dir, "t", "s", -1);
    second.AddStep({10, 1, 1.5, 0.05, 100});
  }
  EXPECT_EQ(Read(dir + "/metrics.prev.csv"), header + "10,1,2.25,0.05,100.0,,\n");
  EXPECT_EQ(Read(dir + "/chart.prev.svg"), first_chart);
  EXPECT_EQ(Read(dir + "/metrics.csv"), header + "10,1,1.5,0.05,100.0,,\n");
  // The second run wrote no chart: the third keeps its rows alone, under
  // the next free pair, and the first run's stay as they were.
  { MetricsLog third(dir, "t", "s", -1); }
  EXPECT_EQ(Read(dir + "/metrics.prev.2.csv"), header + "10,1,1.5,0.05,100.0,,\n");
  EXPECT_FALSE(fs::exists(dir + "/chart.prev.2.svg"));
  EXPECT_EQ(Read(dir + "/metrics.prev.csv"), header + "10,1,2.25,0.05,100.0,,\n");
  // The third run logged no row: nothing to keep.
  { MetricsLog fourth(dir, "t", "s", -1); }
  EXPECT_FALSE(fs::exists(dir + "/metrics.prev.3.csv"));
  // A resumed run continues the rows in place.
  {
    MetricsLog fifth(dir, "t", "s", -1);
    fifth.AddStep({10, 1, 0.75, 0.05, 100});
  }
  { MetricsLog resumed(dir, "t", "s", 10); }
  EXPECT_FALSE(fs::exists(dir + "/metrics.prev.3.csv"));
  EXPECT_EQ(Read(dir + "/metrics.csv"), header + "10,1,0.75,0.05,100.0,,\n");
}

TEST(MetricsLogTest, ResumeKeepsRowsUpToTheCheckpointStep) {
  const std::string dir = TempDir("resume");
  {
    MetricsLog log(dir, "t", "s", -1);
    for (int s = 10; s <= 60; s += 10) log.AddStep({s, s <= 30 ? 1 : 2, 1.0, 0.05, 100});
    log.AddEval({30, 1, 0.5, 0.8});
    log.AddEval({60, 2, 0.4, 0.9});
  }
  // A killed run may leave a torn last line.
  std::ofstream(dir + "/metrics.csv", std::ios::app) << "70,2,0.9";
  MetricsLog log(dir, "t", "s", 40);
  EXPECT_EQ(log.steps().size(), 4u);
  EXPECT_EQ(log.evals().size(), 1u);
  log.AddStep({50, 2, 0.7, 0.05, 100});
  const std::string csv = Read(dir + "/metrics.csv");
  EXPECT_EQ(csv.find("60,2"), std::string::npos) << csv;
  EXPECT_EQ(csv.find("70,2"), std::string::npos) << csv;
  EXPECT_NE(csv.find("40,2,1,0.05,100.0,,\n30,1,,,,0.5,0.8\n50,2,0.7,0.05,100.0,,\n"),
            std::string::npos)
      << csv;
}

// A learning rate decayed below the smallest normal double is written as
// "1e-310"; std::stod refused it (out_of_range), so a resume dropped the
// row as "not a row of ours".
TEST(MetricsLogTest, ResumeKeepsARowWhoseLearningRateIsSubnormal) {
  const std::string dir = TempDir("subnormal");
  {
    MetricsLog log(dir, "t", "s", -1);
    log.AddStep({10, 1, 1.0, 1e-310, 100});
    log.AddStep({20, 1, 0.5, 0.05, 100});
  }
  MetricsLog log(dir, "t", "s", 20);
  ASSERT_EQ(log.steps().size(), 2u);
  EXPECT_EQ(log.steps()[0].lr, 1e-310);
}

// A row cut short by a kill or a full disk can still have its seven fields
// ("0.8765" cut to "0.8"): a last line without its newline is not kept,
// though its step is at or before the resumed one.
TEST(MetricsLogTest, ResumeDropsALastLineWithoutItsNewline) {
  const std::string dir = TempDir("resume_torn_row");
  {
    MetricsLog log(dir, "t", "s", -1);
    log.AddStep({10, 1, 1.5, 0.05, 100});
  }
  std::ofstream(dir + "/metrics.csv", std::ios::app) << "20,1,,,,0.5,0.8";
  MetricsLog log(dir, "t", "s", 40);
  EXPECT_EQ(log.steps().size(), 1u);
  EXPECT_TRUE(log.evals().empty());
  EXPECT_FALSE(log.HasEvalAt(20));
  EXPECT_EQ(Read(dir + "/metrics.csv"),
            "step,epoch,loss,lr,samples_per_s,test_loss,test_acc\n"
            "10,1,1.5,0.05,100.0,,\n");
}

// std::stoll read a step of "12abc" as 12 (and " 12" as 12): a line that
// is not the trainer's was kept as a row on resume. Each field is read
// exactly, and each line dropped is named with its reason.
TEST(MetricsLogTest, ResumeDropsAndNamesARowWhoseStepOrEpochIsNotAWholeNumber) {
  const std::string dir = TempDir("resume_inexact_step");
  {
    MetricsLog log(dir, "t", "s", -1);
    log.AddStep({10, 1, 1.5, 0.05, 100});
  }
  std::ofstream(dir + "/metrics.csv", std::ios::app) << "12abc,1,0.9,0.05,100.0,,\n"
                                                     << "14,1x,0.8,0.05,100.0,,\n"
                                                     << " 16,1,,,,0.5,0.8\n"
                                                     << "20,1,0.7,0.05,100.0,,\n";
  MetricsLog log(dir, "t", "s", 40);
  ASSERT_EQ(log.steps().size(), 2u);
  EXPECT_EQ(log.steps()[1].step, 20);
  EXPECT_TRUE(log.evals().empty());
  EXPECT_EQ(Read(dir + "/metrics.csv"),
            "step,epoch,loss,lr,samples_per_s,test_loss,test_acc\n"
            "10,1,1.5,0.05,100.0,,\n"
            "20,1,0.7,0.05,100.0,,\n");
  ASSERT_EQ(log.dropped_rows().size(), 3u);
  EXPECT_EQ(log.dropped_rows()[0],
            dir + "/metrics.csv line 3 ('12abc,1,0.9,0.05,100.0,,'): its step '12abc' is not a whole number");
  EXPECT_EQ(log.dropped_rows()[1],
            dir + "/metrics.csv line 4 ('14,1x,0.8,0.05,100.0,,'): its epoch '1x' is not a whole number");
  EXPECT_EQ(log.dropped_rows()[2],
            dir + "/metrics.csv line 5 (' 16,1,,,,0.5,0.8'): its step ' 16' is not a whole number");
}

// A resume whose --log_dir holds another run's metrics (another checkpoint
// resumed with it) kept that run's rows up to the resumed step, spliced
// into this run's chart, and took its evaluation at that step for this
// run's. metrics.run names the run whose rows metrics.csv holds: another
// run's files are kept aside as a fresh run keeps them, and the resumed run
// starts new ones. Its own rows, and those of a log that names no run (an
// older trainer's), are continued as before.
TEST(MetricsLogTest, ResumeWithAnotherRunsMetricsKeepsThemAsideAndStartsAfresh) {
  const std::string dir = TempDir("another_run");
  const std::string header = std::string(MetricsLog::CsvHeader()) + "\n";
  {
    MetricsLog b(dir, "t", "s", -1, false, "run-b");
    for (int s = 10; s <= 60; s += 10) b.AddStep({s, 1, 2.0, 0.05, 100});
    b.AddEval({30, 1, 0.5, 0.8});
    b.WriteChart();
  }
  EXPECT_EQ(Read(dir + "/metrics.run"), "run-b\n");
  const std::string b_rows = Read(dir + "/metrics.csv");
  const std::string b_chart = Read(dir + "/chart.svg");
  {
    MetricsLog a(dir, "t", "s", 30, false, "run-a");
    EXPECT_TRUE(a.kept_another_run());
    EXPECT_TRUE(a.steps().empty());
    EXPECT_FALSE(a.HasEvalAt(30));
    EXPECT_EQ(a.kept_previous(), dir + "/metrics.prev.csv");
    EXPECT_EQ(a.kept_previous_chart(), dir + "/chart.prev.svg");
    a.AddStep({40, 2, 1.0, 0.05, 100});
  }
  EXPECT_EQ(Read(dir + "/metrics.prev.csv"), b_rows);
  EXPECT_EQ(Read(dir + "/chart.prev.svg"), b_chart);
  EXPECT_EQ(Read(dir + "/metrics.csv"), header + "40,2,1,0.05,100.0,,\n");
  EXPECT_EQ(Read(dir + "/metrics.run"), "run-a\n");
  {
    MetricsLog again(dir, "t", "s", 40, false, "run-a");
    EXPECT_FALSE(again.kept_another_run());
    EXPECT_EQ(again.steps().size(), 1u);
    EXPECT_TRUE(again.kept_previous().empty());
  }
  std::filesystem::remove(dir + "/metrics.run");
  {
    MetricsLog older(dir, "t", "s", 40, false, "run-c");
    EXPECT_FALSE(older.kept_another_run());
    EXPECT_EQ(older.steps().size(), 1u);
  }
  EXPECT_EQ(Read(dir + "/metrics.run"), "run-c\n");
  // A log made without a run's name has none beside it.
  { MetricsLog unnamed(dir, "t", "s", -1); }
  EXPECT_FALSE(std::filesystem::exists(dir + "/metrics.run"));
}

// Resumed from the checkpoint at the end of epoch 1 (step 30): the chart
// still marks that epoch's end, though no row of epoch 2 follows it.
TEST(MetricsLogTest, ResumeAtAnEpochEndKeepsThatEpochsMark) {
  const std::string dir = TempDir("resume_epoch_end");
  {
    MetricsLog log(dir, "t", "s", -1);
    for (int s = 10; s <= 60; s += 10) log.AddStep({s, s <= 30 ? 1 : 2, 1.0, 0.05, 100});
  }
  MetricsLog log(dir, "t", "s", 30, /*resume_at_epoch_end=*/true);
  log.AddStep({40, 2, 0.7, 0.05, 100});
  log.WriteChart();
  EXPECT_NE(Read(dir + "/chart.svg").find(">epoch 1<"), std::string::npos);
}

std::string RuntimeErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

// A metrics.csv that is there but cannot be read is refused naming it: it
// was replaced by the header alone, without a word. (The tests run as root,
// for whom no file is unreadable for its mode; a link to a folder, or a
// link to itself, is there and cannot be read.)
TEST(MetricsLogTest, ResumeRefusesAMetricsCsvThatCannotBeRead) {
  const std::string dir = TempDir("resume_unreadable");
  std::filesystem::create_directories(dir + "/elsewhere");
  const std::string csv = dir + "/metrics.csv";
  std::filesystem::create_directory_symlink(dir + "/elsewhere", csv);
  const std::string tail = "; fix or move it, or pass another --log_dir";
  EXPECT_EQ(RuntimeErrorOf([&] { MetricsLog log(dir, "t", "s", 40); }),
            "--log_dir: cannot read " + csv +
                " to keep its rows up to the resumed step 40: not a regular file" + tail);
  EXPECT_TRUE(std::filesystem::is_symlink(csv));

  std::filesystem::remove(csv);
  std::filesystem::create_symlink(csv, csv);
  const std::string loop = RuntimeErrorOf([&] { MetricsLog log(dir, "t", "s", 40); });
  EXPECT_EQ(loop.rfind("--log_dir: cannot read " + csv + " to keep its rows up to the resumed "
                       "step 40: ", 0),
            0u)
      << loop;
  EXPECT_TRUE(std::filesystem::is_symlink(csv));

  // Absent: a fresh file.
  std::filesystem::remove(csv);
  MetricsLog log(dir, "t", "s", 40);
  EXPECT_EQ(Read(csv), "step,epoch,loss,lr,samples_per_s,test_loss,test_acc\n");
}

// What `fd` (non-blocking) holds now, waiting up to 5 s for `want` bytes.
std::string ReadAvailable(int fd, size_t want) {
  std::string out;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (out.size() < want && std::chrono::steady_clock::now() < until) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    char buffer[4096];
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n <= 0) break;
    out.append(buffer, static_cast<size_t>(n));
  }
  return out;
}

constexpr char kStreamed[] =
    "step,epoch,loss,lr,samples_per_s,test_loss,test_acc\n"
    "10,1,2.25,0.05,1234.5,,\n"
    "10,1,,,,0.5,0.8125\n";

// A named pipe at metrics.csv (a PyTorch user's `| grep`, `| tee`) gets
// the header and each row as they come, and stays a pipe: nothing is
// written beside it and renamed over it (the atomic writer refused it,
// and the run with it). A resumed run reads nothing back from it.
TEST(MetricsLogTest, AFifoAtMetricsCsvGetsTheRowsAsAStream) {
  const std::string dir = TempDir("fifo");
  std::filesystem::create_directories(dir);
  const std::string csv = dir + "/metrics.csv";
  ASSERT_EQ(::mkfifo(csv.c_str(), 0600), 0);
  const int reader = ::open(csv.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  ASSERT_GE(reader, 0);
  {
    MetricsLog log(dir, "t", "s", /*resume_step=*/40);
    EXPECT_TRUE(log.streaming());
    EXPECT_TRUE(log.steps().empty());
    log.AddStep({10, 1, 2.25, 0.05, 1234.5});
    log.AddEval({10, 1, 0.5, 0.8125});
    EXPECT_EQ(ReadAvailable(reader, sizeof(kStreamed) - 1), kStreamed);
    log.WriteChart();
  }
  ::close(reader);
  EXPECT_EQ(std::filesystem::status(csv).type(), std::filesystem::file_type::fifo);
  EXPECT_TRUE(std::filesystem::is_regular_file(dir + "/chart.svg"));
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 2) << "a temporary was left beside the pipe";
}

// A character device through a link (here a terminal this test opens, as
// metrics.csv -> /dev/stdout on a terminal) takes the rows too.
TEST(MetricsLogTest, ATerminalAtMetricsCsvGetsTheRows) {
  const std::string dir = TempDir("terminal");
  std::filesystem::create_directories(dir);
  const int master = ::posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
  ASSERT_GE(master, 0);
  ASSERT_EQ(::grantpt(master), 0);
  ASSERT_EQ(::unlockpt(master), 0);
  const std::string terminal = ::ptsname(master);
  // Held open, raw (no "\r\n" for "\n"), so that the rows arrive as written.
  const int held = ::open(terminal.c_str(), O_RDWR | O_NOCTTY | O_CLOEXEC);
  ASSERT_GE(held, 0);
  termios mode{};
  ASSERT_EQ(::tcgetattr(held, &mode), 0);
  ::cfmakeraw(&mode);
  ASSERT_EQ(::tcsetattr(held, TCSANOW, &mode), 0);
  ASSERT_EQ(::fcntl(master, F_SETFL, O_NONBLOCK), 0);
  std::filesystem::create_symlink(terminal, dir + "/metrics.csv");
  {
    MetricsLog log(dir, "t", "s", -1);
    EXPECT_TRUE(log.streaming());
    log.AddStep({10, 1, 2.25, 0.05, 1234.5});
    log.AddEval({10, 1, 0.5, 0.8125});
    EXPECT_EQ(ReadAvailable(master, sizeof(kStreamed) - 1), kStreamed);
  }
  EXPECT_TRUE(std::filesystem::is_symlink(dir + "/metrics.csv"));
  ::close(held);
  ::close(master);
}

// Only a FIFO or a terminal is a stream, told without opening it: a node of
// the null device's number (1, 3) made in the test's folder is not, nor a
// regular file or nothing.
TEST(MetricsLogTest, OnlyAFifoOrATerminalIsAStream) {
  const std::string dir = TempDir("is_stream");
  std::filesystem::create_directories(dir);
  ASSERT_EQ(::mkfifo((dir + "/fifo").c_str(), 0600), 0);
  EXPECT_TRUE(MetricsLog::IsStream(dir + "/fifo"));
  const int master = ::posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
  ASSERT_GE(master, 0);
  ASSERT_EQ(::grantpt(master), 0);
  ASSERT_EQ(::unlockpt(master), 0);
  std::filesystem::create_symlink(::ptsname(master), dir + "/terminal");
  EXPECT_TRUE(MetricsLog::IsStream(dir + "/terminal"));
  ::close(master);
  ASSERT_EQ(::mknod((dir + "/null").c_str(), S_IFCHR | 0600, makedev(1, 3)), 0);
  EXPECT_FALSE(MetricsLog::IsStream(dir + "/null"));
  std::ofstream(dir + "/file") << "x";
  EXPECT_FALSE(MetricsLog::IsStream(dir + "/file"));
  EXPECT_FALSE(MetricsLog::IsStream(dir + "/absent"));
}

// Two waits on a FIFO, each bounded by a 10 s deadline of MetricsLog's;
// they run side by side (each on its own FIFO) so that the case takes one
// deadline, not two.
//
// Opening a FIFO for writing waits for a reader: with none within
// kStreamReaderWait, the log is refused naming the file, instead of the
// run waiting for ever.
//
// A reader that stops taking rows (a stopped pager) leaves the pipe full:
// the row that does not fit within kStreamWriteDeadline fails naming the
// file (the trainer then stops logging), instead of blocking training.
TEST(MetricsLogTest, AFifoThatNobodyReadsIsRefusedAndAStreamWhoseReaderStoppedFailsTheRowAfterTheDeadline) {
  const std::string unread_dir = TempDir("fifo_unread");
  std::filesystem::create_directories(unread_dir);
  const std::string unread_csv = unread_dir + "/metrics.csv";
  ASSERT_EQ(::mkfifo(unread_csv.c_str(), 0600), 0);
  const std::string full_dir = TempDir("fifo_full");
  std::filesystem::create_directories(full_dir);
  const std::string full_csv = full_dir + "/metrics.csv";
  ASSERT_EQ(::mkfifo(full_csv.c_str(), 0600), 0);
  const int reader = ::open(full_csv.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  ASSERT_GE(reader, 0);

  std::string unread_error;
  std::chrono::steady_clock::duration unread_took{};
  std::thread unread([&] {
    const auto t0 = std::chrono::steady_clock::now();
    unread_error = RuntimeErrorOf([&] { MetricsLog log(unread_dir, "t", "s", -1); });
    unread_took = std::chrono::steady_clock::now() - t0;
  });

  std::string full_error;
  std::chrono::steady_clock::duration full_took{};
  {
    MetricsLog log(full_dir, "t", "s", -1);
    const auto t0 = std::chrono::steady_clock::now();
    for (int s = 1; s <= 100000 && full_error.empty(); ++s) {
      full_error = RuntimeErrorOf([&] { log.AddStep({s, 1, 2.25, 0.05, 1234.5}); });
    }
    full_took = std::chrono::steady_clock::now() - t0;
  }
  unread.join();
  ::close(reader);

  EXPECT_EQ(unread_error, "--log_dir: " + unread_csv +
                              " is a FIFO, and nothing opened it for reading within 10 s of the "
                              "start; start its reader first (cat " + unread_csv + "), or move it away");
  EXPECT_GE(unread_took, MetricsLog::kStreamReaderWait);
  EXPECT_EQ(std::filesystem::status(unread_csv).type(), std::filesystem::file_type::fifo);

  EXPECT_EQ(full_error, "cannot write " + full_csv + ": its reader took no row for 10 s");
  EXPECT_GE(full_took, MetricsLog::kStreamWriteDeadline);
}

}  // namespace
}  // namespace ddp::examples::trainer
