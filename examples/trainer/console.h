#ifndef DDP_EXAMPLES_TRAINER_CONSOLE_H_
#define DDP_EXAMPLES_TRAINER_CONSOLE_H_

// What a person watching a run sees (rank 0 only). On a terminal: a live
// progress bar per epoch, redrawn in place at most ten times a second:
//
//   epoch 1/2 ━━━━━━━━━━━━━━╺━━━━━━━━━━━━  234/469  2,613 samples/s  loss 0.4123  ETA 0:09
//
// Elsewhere (a pipe, a log file, a CI job) the bar becomes a plain line
// about every tenth of an epoch, and never more often than every 2 s:
//
//   epoch 1/2  step 234/469  2,613 samples/s  loss 0.4123  ETA 0:09
//
// Other lines (the header, per-epoch results, notes) go through Line(),
// which clears the bar first so that nothing is drawn over.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

namespace ddp::examples::trainer {

/// How the console draws.
struct ConsoleOptions {
  bool interactive = false;  ///< Redraw a bar in place (a terminal).
  bool unicode = false;      ///< Box-drawing characters for the bar.
  bool color = false;        ///< ANSI colours (bold labels, green accuracy).
  int width = 100;           ///< Terminal columns.
  /// Non-interactive: at least this long between two progress lines.
  std::chrono::milliseconds min_plain_interval{2000};
};

/// Options for `file` as it is now: a terminal (isatty, TERM not "dumb")
/// gets the live bar; UTF-8 locales get box-drawing characters; NO_COLOR
/// turns colours off (https://no-color.org).
ConsoleOptions DetectConsoleOptions(std::FILE* file);

/// Live progress of one epoch at a time, plus ordinary lines.
class Console {
 public:
  Console(std::FILE* out, ConsoleOptions options);
  ~Console();
  Console(const Console&) = delete;
  Console& operator=(const Console&) = delete;

  /// Prints a whole line (clearing the bar first when one is shown).
  void Line(const std::string& text);
  /// Starts the bar of `epoch` (1-based) of `epochs`; the epoch has
  /// `total_steps` optimizer steps and `done_steps` of them are already done
  /// (a resumed epoch).
  void StartEpoch(int64_t epoch, int64_t epochs, int64_t total_steps, int64_t done_steps);
  /// Reports that `done_steps` of the epoch are done; `samples_per_s` is the
  /// recent global rate, `loss` rank 0's running training loss over the
  /// epoch so far (its samples since the epoch began, or since the resume
  /// within it; not the other ranks'), or none before its first batch
  /// ("loss -"); a non-finite loss shows as nan or inf on the bar and in
  /// plain lines alike. `eta_s` is the time left in this epoch. Draws at
  /// most every 100 ms (terminal) or per the plain-line rule.
  void Progress(int64_t done_steps, double samples_per_s, std::optional<double> loss, double eta_s);
  /// Removes the bar (the epoch's result line comes next).
  void EndEpoch();
  /// On a terminal, shows `text` in place of the bar until the next line
  /// (what the run is doing during a pause); elsewhere nothing.
  void Status(const std::string& text);

  /// Wraps text in bold / green / dim when colours are on.
  std::string Bold(const std::string& text) const;
  std::string Green(const std::string& text) const;
  std::string Dim(const std::string& text) const;

  const ConsoleOptions& options() const { return options_; }
  /// True once a write failed with EPIPE (the reader of the output is
  /// gone); nothing more is written then. SIGPIPE must be ignored for a
  /// write to fail so rather than end the process.
  bool closed() const { return closed_; }

  /// The bar's text for the given state, `width` columns wide (for tests).
  std::string RenderBar(int64_t done_steps, double samples_per_s, std::optional<double> loss,
                        double eta_s, int width) const;

 private:
  void ClearBar();
  // Writes and flushes `text`, unless closed.
  void Write(const std::string& text);

  std::FILE* out_;
  ConsoleOptions options_;
  int64_t epoch_ = 0;
  int64_t epochs_ = 0;
  int64_t total_steps_ = 0;
  int64_t last_plain_step_ = -1;
  bool bar_shown_ = false;
  bool closed_ = false;
  std::chrono::steady_clock::time_point last_draw_{};
};

}  // namespace ddp::examples::trainer

#endif  // DDP_EXAMPLES_TRAINER_CONSOLE_H_
