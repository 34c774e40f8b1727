#ifndef DDP_EXAMPLES_TRAINER_METRICS_LOG_H_
#define DDP_EXAMPLES_TRAINER_METRICS_LOG_H_

// --log_dir: the run's metrics as CSV and as an SVG chart.
//
//   metrics.csv  step,epoch,loss,lr,samples_per_s,test_loss,test_acc
//                one row per logged training interval (test fields empty)
//                and one per evaluation (training fields empty); appended
//                and flushed as the run goes, so `tail -f` follows it.
//   chart.svg    training loss and test loss (top), test accuracy (bottom)
//                over steps, epoch boundaries dotted; rewritten atomically at
//                each epoch end (the trainer also draws it when stopped).
//
//   metrics.run  the identity of the run whose rows metrics.csv holds (one
//                line), which its checkpoints carry through its resumes
//
// On --resume, rows after the checkpoint's step are dropped (the resumed
// run writes them again) and the chart continues from the earlier rows;
// when metrics.run names another run than the checkpoint's, its files are
// kept as a fresh run keeps them (below) and the resumed run starts new
// ones, rather than continue another run's rows.
// Without it, a metrics.csv with rows of an earlier run is kept as
// metrics.prev.csv, its chart.svg as chart.prev.svg (then .prev.2, ...:
// the first pair of names both free), and the new run starts new files.
//
// A metrics.csv that is (through links) a FIFO or a terminal, say a named
// pipe made with mkfifo or a link to /dev/stdout where that is a pipe or a
// terminal, is a stream (IsStream): the header and then each row are
// written into it as they come, whole lines, nothing replaced or read back
// (a resumed run's chart then has this run's rows only). A FIFO's reader
// must open it within kStreamReaderWait of the start, and take each row
// within kStreamWriteDeadline; else the constructor, or the row's Add*,
// throws naming the file.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace ddp::examples::trainer {

/// A logged stretch of training steps.
struct StepRecord {
  int64_t step = 0;            ///< Optimizer steps done (global, from the run's start).
  int64_t epoch = 0;           ///< 1-based.
  double loss = 0;             ///< Mean training loss per sample over the stretch, all ranks.
  double lr = 0;               ///< Learning rate the stretch's last step trained with.
  double samples_per_s = 0;    ///< Global throughput over the stretch.
};

/// One evaluation on the test set.
struct EvalRecord {
  int64_t step = 0;
  int64_t epoch = 0;
  double test_loss = 0;
  double test_acc = 0;         ///< Fraction in [0, 1].
};

class MetricsLog {
 public:
  /// How long the constructor waits for a reader of a FIFO at metrics.csv.
  static constexpr std::chrono::seconds kStreamReaderWait{10};
  /// How long a row waits for room in a stream (a reader that stopped).
  static constexpr std::chrono::seconds kStreamWriteDeadline{10};

  /// Creates `dir` (and parents). `title` and `subtitle` head the chart.
  /// With `resume_step` >= 0, keeps the rows of an existing metrics.csv up
  /// to that step; otherwise starts a new file. `resume_at_epoch_end`: the
  /// checkpoint was saved where an epoch ended (the last kept epoch is
  /// complete, and the chart marks its end). `run`: the identity of the
  /// run (its checkpoint's, on a resume), written to metrics.run; a resume
  /// whose metrics.run names another run starts new files as a fresh run
  /// does (kept_another_run). Empty: not known, the rows of a resume are
  /// kept whoever wrote them, and a metrics.run there is removed. Throws
  /// std::runtime_error naming the path on I/O errors.
  MetricsLog(std::string dir, std::string title, std::string subtitle, int64_t resume_step,
             bool resume_at_epoch_end = false, const std::string& run = "");
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  void AddStep(const StepRecord& r);
  void AddEval(const EvalRecord& r);
  /// Marks the end of `epoch` at `step` (a dotted line on the chart).
  void AddEpochEnd(int64_t epoch, int64_t step);
  /// Writes chart.svg (atomically).
  void WriteChart() const;

  std::string csv_path() const { return dir_ + "/metrics.csv"; }
  std::string chart_path() const { return dir_ + "/chart.svg"; }
  std::string run_path() const { return dir_ + "/metrics.run"; }
  const std::vector<StepRecord>& steps() const { return steps_; }
  const std::vector<EvalRecord>& evals() const { return evals_; }
  /// Whether an evaluation at `step` is logged (kept from before a resume
  /// or added since).
  bool HasEvalAt(int64_t step) const;
  /// Whether `path`, through links, is a FIFO or a terminal (a character
  /// device of the tty, console or pseudo-terminal majors): a metrics.csv
  /// there is a stream. Other devices (/dev/null, /dev/mem) are not.
  static bool IsStream(const std::string& path);
  /// Whether metrics.csv is a stream (a FIFO or a terminal), whose
  /// earlier rows were not read back.
  bool streaming() const { return stream_fd_ >= 0; }

  /// The CSV's header line (without newline).
  static const char* CsvHeader();

  /// Where an earlier run's metrics.csv was kept (a fresh run only), or ""
  /// when there was none to keep; likewise its chart.svg.
  const std::string& kept_previous() const { return kept_previous_; }
  const std::string& kept_previous_chart() const { return kept_previous_chart_; }
  /// Whether, at a resume, metrics.csv was another run's (metrics.run named
  /// another run than the checkpoint's), and was kept as kept_previous().
  bool kept_another_run() const { return kept_another_run_; }
  /// At a resume, the lines of metrics.csv at or before the resumed step
  /// that were not kept as rows because they are not rows the trainer
  /// writes (a step that is not a whole number, a field missing, a row cut
  /// short), each as "<path> line N ('<text>'): <why>". Rows after the
  /// resumed step are not listed: the resumed run writes them again.
  const std::vector<std::string>& dropped_rows() const { return dropped_rows_; }

 private:
  // Without a resume: renames an earlier run's metrics.csv (with rows) and
  // chart.svg to the first free metrics.prev[.N].csv and chart.prev[.N].svg.
  // Throws std::runtime_error naming the files when it cannot.
  void KeepEarlierRun();
  // The run named in metrics.run: "" when absent or unreadable (a log of
  // an older trainer, or one that did not know its run).
  std::string LoggedRun() const;
  void Append(const std::string& line);
  // Opens the stream at metrics.csv and writes the header into it.
  void OpenStream();
  void WriteToStream(const std::string& text);

  std::string dir_;
  std::string title_;
  std::string subtitle_;
  std::FILE* csv_ = nullptr;   // a regular metrics.csv
  int stream_fd_ = -1;         // a stream's (non-blocking)
  std::vector<StepRecord> steps_;
  std::vector<EvalRecord> evals_;
  std::vector<std::pair<int64_t, int64_t>> epoch_ends_;  // (epoch, step)
  std::string kept_previous_;
  std::string kept_previous_chart_;
  bool kept_another_run_ = false;
  std::vector<std::string> dropped_rows_;
};

namespace internal {

/// Makes MetricsLog's constructor wait `pause` before it looks at its
/// folder's files, as a disk that hangs would; for tests of the trainer's
/// deadline on it. Process-wide; zero (the default) turns it off. For
/// tests only.
void SetMetricsReadPause(std::chrono::milliseconds pause);

}  // namespace internal

}  // namespace ddp::examples::trainer

#endif  // DDP_EXAMPLES_TRAINER_METRICS_LOG_H_
