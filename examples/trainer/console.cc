#include "examples/trainer/console.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "examples/trainer/format.h"

namespace ddp::examples::trainer {
namespace {

using Clock = std::chrono::steady_clock;

bool Utf8Locale() {
  for (const char* name : {"LC_ALL", "LC_CTYPE", "LANG"}) {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') continue;
    std::string s(v);
    for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    return s.find("utf-8") != std::string::npos || s.find("utf8") != std::string::npos;
  }
  return false;
}

// Display width of a string whose only multi-byte characters are the bar's
// (each one column): counts bytes that do not continue a UTF-8 sequence and
// skips ANSI escape sequences.
int DisplayWidth(const std::string& s) {
  int w = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == 0x1b) {
      while (i < s.size() && s[i] != 'm') ++i;
      continue;
    }
    if ((c & 0xC0) != 0x80) ++w;
  }
  return w;
}

}  // namespace

ConsoleOptions DetectConsoleOptions(std::FILE* file) {
  ConsoleOptions o;
  const int fd = fileno(file);
  const char* term = std::getenv("TERM");
  o.interactive = fd >= 0 && isatty(fd) && !(term != nullptr && std::strcmp(term, "dumb") == 0);
  o.unicode = o.interactive && Utf8Locale();
  const char* no_color = std::getenv("NO_COLOR");
  o.color = o.interactive && (no_color == nullptr || *no_color == '\0');
  winsize ws{};
  if (o.interactive && ioctl(fd, TIOCGWINSZ, &ws) == 0 && ws.ws_col >= 20) {
    o.width = ws.ws_col;
  } else if (const char* cols = std::getenv("COLUMNS"); cols != nullptr && std::atoi(cols) >= 20) {
    o.width = std::atoi(cols);
  }
  return o;
}

Console::Console(std::FILE* out, ConsoleOptions options) : out_(out), options_(options) {}

Console::~Console() { ClearBar(); }

std::string Console::Bold(const std::string& t) const {
  return options_.color ? "\033[1m" + t + "\033[0m" : t;
}
std::string Console::Green(const std::string& t) const {
  return options_.color ? "\033[32m" + t + "\033[0m" : t;
}
std::string Console::Dim(const std::string& t) const {
  return options_.color ? "\033[2m" + t + "\033[0m" : t;
}

void Console::Write(const std::string& text) {
  if (closed_) return;
  if (std::fputs(text.c_str(), out_) >= 0 && std::fflush(out_) == 0) return;
  // The reader is gone (`train | tee log` after a Ctrl-C ended tee). The run
  // goes on to its checkpoint; what it would print has nowhere to go.
  // (Other errors, a full disk under a redirect, may pass: try again.)
  if (errno == EPIPE) closed_ = true;
  std::clearerr(out_);
}

void Console::ClearBar() {
  if (!bar_shown_) return;
  Write("\r\033[2K");
  bar_shown_ = false;
}

void Console::Line(const std::string& text) {
  ClearBar();
  Write(text + "\n");
}

void Console::StartEpoch(int64_t epoch, int64_t epochs, int64_t total_steps, int64_t done_steps) {
  ClearBar();
  epoch_ = epoch;
  epochs_ = epochs;
  total_steps_ = std::max<int64_t>(total_steps, 1);
  last_plain_step_ = done_steps;
  // Plain lines start one interval into the epoch, when there is a rate to
  // report; short epochs get none (their result line follows soon).
  last_draw_ = options_.interactive ? Clock::time_point{} : Clock::now();
}

namespace {

// "loss 0.4123"; "loss nan" or "loss inf" for a loss that diverged (shown
// as it is, the way PyTorch prints one), and "loss -" before there is any.
std::string LossText(std::optional<double> loss) {
  return loss ? StringPrintf("loss %.4f", *loss) : "loss -";
}

}  // namespace

std::string Console::RenderBar(int64_t done, double rate, std::optional<double> loss, double eta_s,
                               int width) const {
  const std::string epoch = StringPrintf("epoch %lld/%lld", static_cast<long long>(epoch_),
                                         static_cast<long long>(epochs_));
  const int digits = static_cast<int>(std::to_string(total_steps_).size());
  const std::string steps = StringPrintf("%*lld/%lld", digits, static_cast<long long>(done),
                                         static_cast<long long>(total_steps_));
  std::string tail = "  " + steps + "  " + FormatRate(rate) + " samples/s  " +
                     LossText(loss) +
                     "  ETA " + FormatClock(eta_s);
  // Bar between the epoch label and the figures; it gets what is left of
  // the line (at least 10 columns, at most 40).
  const int room = width - 1 - static_cast<int>(epoch.size()) - 1 - DisplayWidth(tail);
  const int bar_width = std::clamp(room - (options_.unicode ? 0 : 2), 10, 40);  // ASCII adds [ ]
  const double frac = std::clamp(static_cast<double>(done) / total_steps_, 0.0, 1.0);
  std::string bar;
  if (options_.unicode) {
    // Heavy line for the part done, a light one for the rest.
    const int full = static_cast<int>(frac * bar_width);
    for (int i = 0; i < bar_width; ++i) bar += i < full ? "\u2501" : (i == full ? "\u257a" : "\u2500");
    bar = (options_.color ? "\033[35m" : "") + bar.substr(0, full * 3) +
          (options_.color ? "\033[0;2m" : "") + bar.substr(full * 3) +
          (options_.color ? "\033[0m" : "");
  } else {
    const int full = static_cast<int>(frac * bar_width);
    bar = "[" + std::string(full, '#') + std::string(bar_width - full, '.') + "]";
  }
  return Bold(epoch) + " " + bar + tail;
}

void Console::Progress(int64_t done, double rate, std::optional<double> loss, double eta_s) {
  const auto now = std::chrono::steady_clock::now();
  if (options_.interactive) {
    if (done < total_steps_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    std::string text = RenderBar(done, rate, loss, eta_s, options_.width);
    Write("\r\033[2K" + text);
    bar_shown_ = true;
    return;
  }
  // Plain lines: about ten per epoch, never closer than min_plain_interval,
  // and none for the last step (the epoch's result line follows).
  const int64_t every = std::max<int64_t>(1, total_steps_ / 10);
  if (done >= total_steps_ || done - last_plain_step_ < every) return;
  if (now - last_draw_ < options_.min_plain_interval) {
    return;
  }
  last_draw_ = now;
  last_plain_step_ = done;
  const int digits = static_cast<int>(std::to_string(total_steps_).size());
  Line(StringPrintf("epoch %lld/%lld  step %*lld/%lld  %s samples/s  %s  ETA %s",
                    static_cast<long long>(epoch_), static_cast<long long>(epochs_), digits,
                    static_cast<long long>(done), static_cast<long long>(total_steps_),
                    FormatRate(rate).c_str(), LossText(loss).c_str(), FormatClock(eta_s).c_str()));
}

void Console::EndEpoch() { ClearBar(); }

void Console::Status(const std::string& text) {
  if (!options_.interactive) return;
  Write("\r\033[2K" + Dim(text + "..."));
  bar_shown_ = true;
}

}  // namespace ddp::examples::trainer
