#include "examples/trainer/metrics_log.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "examples/trainer/format.h"
#include "examples/trainer/svg_chart.h"
#include "nn/io/atomic_file.h"

namespace ddp::examples::trainer {

namespace internal {
namespace {
std::atomic<int64_t> metrics_read_pause_ms{0};
}  // namespace

void SetMetricsReadPause(std::chrono::milliseconds pause) { metrics_read_pause_ms.store(pause.count()); }

}  // namespace internal

namespace {

std::vector<std::string> SplitCsv(const std::string& line) {
  std::vector<std::string> out(1);
  for (char c : line) {
    if (c == ',') {
      out.emplace_back();
    } else {
      out.back().push_back(c);
    }
  }
  return out;
}

void WriteFileAtomically(const std::string& path, const std::string& content) {
  nn::io::AtomicFileWriter writer(path);
  writer.Write(content.data(), content.size());
  writer.Commit();
}

std::string StepRow(const StepRecord& r) {
  return StringPrintf("%lld,%lld,%.6g,%.6g,%.1f,,", static_cast<long long>(r.step),
                      static_cast<long long>(r.epoch), r.loss, r.lr, r.samples_per_s);
}

std::string EvalRow(const EvalRecord& r) {
  return StringPrintf("%lld,%lld,,,,%.6g,%.6g", static_cast<long long>(r.step),
                      static_cast<long long>(r.epoch), r.test_loss, r.test_acc);
}

// A step or epoch field as the trainer writes it: decimal digits only,
// no sign, no space, no trailing text, within int64_t. nullopt otherwise.
std::optional<int64_t> ParseCount(const std::string& text) {
  if (text.empty() || text.size() > 18 || text.find_first_not_of("0123456789") != std::string::npos) {
    return std::nullopt;
  }
  return std::stoll(text);
}

}  // namespace

// A fresh run's metrics.csv replaced the one an earlier run had left in
// the same --log_dir, and its rows were gone without a word (a second
// experiment started with the first one's --log_dir). They are kept, as
// the trainer keeps another run's checkpoint, under the first free pair of
// names: metrics.prev.csv and chart.prev.svg, then metrics.prev.2.csv and
// chart.prev.2.svg, ... A metrics.csv with no row (a run stopped before
// its first) has nothing to keep.
void MetricsLog::KeepEarlierRun() {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(csv_path(), ec)) return;
  const uintmax_t size = std::filesystem::file_size(csv_path(), ec);
  if (ec || size <= std::strlen(CsvHeader()) + 1) return;
  const auto absent = [](const std::string& path) {
    std::error_code e;
    return std::filesystem::symlink_status(path, e).type() == std::filesystem::file_type::not_found;
  };
  constexpr int kMostKept = 10000;
  for (int n = 1; n <= kMostKept; ++n) {
    const std::string suffix = n == 1 ? ".prev" : ".prev." + std::to_string(n);
    const std::string csv = dir_ + "/metrics" + suffix + ".csv";
    const std::string chart = dir_ + "/chart" + suffix + ".svg";
    if (!absent(csv) || !absent(chart)) continue;
    const auto keep = [&](const std::string& from, const std::string& to) {
      std::error_code e;
      std::filesystem::rename(from, to, e);
      if (e) {
        throw std::runtime_error("--log_dir=" + dir_ + ": cannot keep the earlier run's " + from +
                                 " as " + to + ": " + e.message() +
                                 "; move it away, or pass another --log_dir");
      }
    };
    keep(csv_path(), csv);
    kept_previous_ = csv;
    if (std::filesystem::is_regular_file(chart_path(), ec)) {
      keep(chart_path(), chart);
      kept_previous_chart_ = chart;
    }
    return;
  }
  throw std::runtime_error("--log_dir=" + dir_ + " holds " + std::to_string(kMostKept) +
                           " earlier runs' metrics (metrics.prev.*.csv); delete those you no longer "
                           "need, or pass another --log_dir");
}

std::string MetricsLog::LoggedRun() const {
  // A regular file only: opening a FIFO would wait for a writer.
  std::error_code ec;
  if (!std::filesystem::is_regular_file(run_path(), ec)) return "";
  std::ifstream in(run_path());
  std::string line;
  std::getline(in, line);
  return line;
}

const char* MetricsLog::CsvHeader() { return "step,epoch,loss,lr,samples_per_s,test_loss,test_acc"; }

MetricsLog::MetricsLog(std::string dir, std::string title, std::string subtitle,
                       int64_t resume_step, bool resume_at_epoch_end, const std::string& run)
    : dir_(std::move(dir)), title_(std::move(title)), subtitle_(std::move(subtitle)) {
  if (const int64_t pause = internal::metrics_read_pause_ms.load(); pause > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(pause));
  }
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) {
    throw std::runtime_error("cannot create --log_dir " + dir_ + ": " + ec.message());
  }
  if (IsStream(csv_path())) {
    OpenStream();
    return;
  }
  // The rows of another run (another checkpoint resumed with this
  // --log_dir) are not continued: spliced into this run's, they made one
  // chart of two runs, and their evaluation at the resumed step was taken
  // for this run's. Kept aside as a fresh run keeps them.
  bool another_run = false;
  if (resume_step >= 0 && !run.empty()) {
    const std::string logged = LoggedRun();
    another_run = !logged.empty() && logged != run;
    if (another_run) resume_step = -1;
  }
  // Keep the rows of the interrupted run up to the resumed step; later rows
  // are written again by this run.
  std::string kept = std::string(CsvHeader()) + "\n";
  if (resume_step >= 0) {
    // A metrics.csv that is there but cannot be read is refused: it would
    // be replaced below by the header alone, and its rows lost. (Absent:
    // nothing to keep.)
    const auto unreadable = [&](const std::string& why) {
      return std::runtime_error("--log_dir: cannot read " + csv_path() +
                                " to keep its rows up to the resumed step " +
                                std::to_string(resume_step) + ": " + why +
                                "; fix or move it, or pass another --log_dir");
    };
    const std::filesystem::file_status status = std::filesystem::status(csv_path(), ec);
    if (status.type() != std::filesystem::file_type::not_found) {
      if (ec) throw unreadable(ec.message());
      if (status.type() != std::filesystem::file_type::regular) {
        throw unreadable("not a regular file");
      }
    }
    std::ifstream in;
    if (status.type() != std::filesystem::file_type::not_found) {
      errno = 0;
      in.open(csv_path());
      if (!in.is_open()) throw unreadable(errno != 0 ? std::strerror(errno) : "open failed");
    }
    std::string line;
    bool header = true;
    int64_t line_number = 0;
    // A row that is not one of the trainer's is dropped, and said (the
    // trainer prints dropped_rows()): the rows after it would otherwise
    // be charted without a word about the gap.
    const auto drop = [&](const std::string& why) {
      dropped_rows_.push_back(csv_path() + " line " + std::to_string(line_number) + " ('" +
                              (line.size() > 60 ? line.substr(0, 60) + "..." : line) + "'): " + why);
    };
    while (std::getline(in, line)) {
      ++line_number;
      if (header) {
        header = false;
        continue;
      }
      // Every row is written with its newline: a last line without one is
      // the torn end of a row that was being written when the run died or
      // its disk filled, and its last field may be cut yet still parse
      // ("0.8765" as "0.8").
      if (in.eof()) {
        drop("the last line has no newline (a row cut short as it was written)");
        break;
      }
      const std::vector<std::string> f = SplitCsv(line);
      if (f.size() != 7) {
        drop(std::to_string(f.size()) + " fields, not 7");
        continue;
      }
      // Exactly the digits the trainer writes: std::stoll read "12abc" as
      // 12 and " 12" as 12, and kept such a row as the trainer's.
      const std::optional<int64_t> step = ParseCount(f[0]);
      if (!step) {
        drop("its step '" + f[0] + "' is not a whole number");
        continue;
      }
      if (*step > resume_step) continue;  // written again by this run
      const std::optional<int64_t> epoch = ParseCount(f[1]);
      if (!epoch) {
        drop("its epoch '" + f[1] + "' is not a whole number");
        continue;
      }
      try {
        // ParseExactDouble, not std::stod: a learning rate decayed below
        // the smallest normal double is written as "1e-310", which std::stod
        // refuses (out_of_range).
        if (!f[2].empty()) {
          steps_.push_back(
              {*step, *epoch, ParseExactDouble(f[2]), ParseExactDouble(f[3]), ParseExactDouble(f[4])});
        } else if (!f[5].empty()) {
          evals_.push_back({*step, *epoch, ParseExactDouble(f[5]), ParseExactDouble(f[6])});
        } else {
          drop("neither a training loss nor a test loss");
          continue;
        }
      } catch (const std::exception&) {
        drop("a field that is not a number");
        continue;
      }
      kept += line + "\n";
    }
    // getline stops on a read error as at the end: only the bad bit tells.
    if (in.bad()) throw unreadable("read error");
    for (size_t i = 1; i < steps_.size(); ++i) {
      if (steps_[i].epoch != steps_[i - 1].epoch) {
        epoch_ends_.emplace_back(steps_[i - 1].epoch, steps_[i - 1].step);
      }
    }
    // The last kept epoch's end has no row of the next epoch after it.
    if (resume_at_epoch_end && !steps_.empty()) epoch_ends_.emplace_back(steps_.back().epoch, resume_step);
  } else {
    KeepEarlierRun();
    kept_another_run_ = another_run && !kept_previous_.empty();
  }
  WriteFileAtomically(csv_path(), kept);
  // Whose rows these are, for the next resume. (Written after the rows:
  // a crash in between leaves the earlier run's name beside this run's
  // header alone, which has no rows to splice.)
  if (!run.empty()) {
    WriteFileAtomically(run_path(), run + "\n");
  } else {
    std::filesystem::remove(run_path(), ec);
  }
  // "e": O_CLOEXEC, so that processes started meanwhile do not inherit it.
  csv_ = std::fopen(csv_path().c_str(), "ae");
  if (csv_ == nullptr) {
    throw std::runtime_error("cannot open " + csv_path() + ": " + std::strerror(errno));
  }
}

bool MetricsLog::IsStream(const std::string& path) { return nn::io::IsStreamPath(path); }

MetricsLog::~MetricsLog() {
  if (csv_ != nullptr) std::fclose(csv_);
  if (stream_fd_ >= 0) ::close(stream_fd_);
}

void MetricsLog::OpenStream() {
  using Clock = std::chrono::steady_clock;
  // Non-blocking: a FIFO's open would otherwise wait for a reader without
  // end (here it fails with ENXIO until one comes), and a row would wait
  // for a reader that stopped taking them.
  const Clock::time_point until = Clock::now() + kStreamReaderWait;
  for (;;) {
    stream_fd_ = ::open(csv_path().c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (stream_fd_ >= 0 || errno != ENXIO || Clock::now() >= until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (stream_fd_ < 0 && errno == ENXIO) {
    throw std::runtime_error("--log_dir: " + csv_path() + " is a FIFO, and nothing opened it for reading within " +
                             std::to_string(kStreamReaderWait.count()) + " s of the start; start its reader " +
                             "first (cat " + csv_path() + "), or move it away");
  }
  if (stream_fd_ < 0) throw std::runtime_error("cannot open " + csv_path() + ": " + std::strerror(errno));
  WriteToStream(std::string(CsvHeader()) + "\n");
}

void MetricsLog::WriteToStream(const std::string& text) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point until = Clock::now() + kStreamWriteDeadline;
  size_t done = 0;
  // A row is far below PIPE_BUF, so a pipe takes it whole or not at all:
  // a reader never sees half a line.
  while (done < text.size()) {
    const ssize_t n = ::write(stream_fd_, text.data() + done, text.size() - done);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
      if (left.count() <= 0) {
        throw std::runtime_error("cannot write " + csv_path() + ": its reader took no row for " +
                                 std::to_string(kStreamWriteDeadline.count()) + " s");
      }
      pollfd p{stream_fd_, POLLOUT, 0};
      ::poll(&p, 1, static_cast<int>(left.count()));
      continue;
    }
    throw std::runtime_error("cannot write " + csv_path() + ": " +
                             (n < 0 ? std::strerror(errno) : "nothing written"));
  }
}

void MetricsLog::Append(const std::string& line) {
  if (stream_fd_ >= 0) {
    WriteToStream(line + "\n");
    return;
  }
  std::fputs(line.c_str(), csv_);
  std::fputc('\n', csv_);
  if (std::fflush(csv_) != 0) {
    throw std::runtime_error("cannot write " + csv_path() + ": " + std::strerror(errno));
  }
}

void MetricsLog::AddStep(const StepRecord& r) {
  steps_.push_back(r);
  Append(StepRow(r));
}

void MetricsLog::AddEval(const EvalRecord& r) {
  evals_.push_back(r);
  Append(EvalRow(r));
}

bool MetricsLog::HasEvalAt(int64_t step) const {
  for (const EvalRecord& e : evals_) {
    if (e.step == step) return true;
  }
  return false;
}

void MetricsLog::AddEpochEnd(int64_t epoch, int64_t step) {
  if (!epoch_ends_.empty() && epoch_ends_.back().first == epoch) return;
  epoch_ends_.emplace_back(epoch, step);
}

void MetricsLog::WriteChart() const {
  Chart chart;
  chart.title = title_;
  chart.subtitle = subtitle_;
  chart.x_label = "step";
  ChartPanel loss;
  loss.y_label = "loss (cross-entropy)";
  loss.y_from_zero = true;
  ChartSeries train{"train loss", kTrainLossColor, {}, false, false};
  for (const StepRecord& r : steps_) train.points.emplace_back(r.step, r.loss);
  ChartSeries test{"test loss", kTestLossColor, {}, true, true};
  for (const EvalRecord& r : evals_) test.points.emplace_back(r.step, r.test_loss);
  loss.series = {train, test};
  ChartPanel acc;
  acc.y_label = "test accuracy";
  acc.percent = true;
  ChartSeries accuracy{"test accuracy", kAccuracyColor, {}, true, false};
  for (const EvalRecord& r : evals_) accuracy.points.emplace_back(r.step, r.test_acc);
  acc.series = {accuracy};
  chart.panels = {loss, acc};
  for (const auto& [epoch, step] : epoch_ends_) {
    chart.marks.push_back({static_cast<double>(step), "epoch " + std::to_string(epoch)});
  }
  WriteFileAtomically(chart_path(), RenderSvgChart(chart));
}

}  // namespace ddp::examples::trainer
