#include "examples/trainer/console.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>

#include "gtest/gtest.h"

namespace ddp::examples::trainer {
namespace {

// Everything written to a temporary FILE*.
class Capture {
 public:
  Capture() : file_(std::tmpfile()) {}
  ~Capture() { std::fclose(file_); }
  std::FILE* file() const { return file_; }
  std::string Text() const {
    std::fflush(file_);
    std::rewind(file_);
    std::string out;
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), file_)) > 0) out.append(buf, n);
    return out;
  }

 private:
  std::FILE* file_;
};

int CountOf(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// Output into a pipe whose reader is gone (`train | tee log` after Ctrl-C
// ended tee): with SIGPIPE ignored the first write fails with EPIPE, and
// the console writes nothing more.
TEST(ConsoleTest, StopsWritingOnceTheReaderIsGone) {
  struct sigaction ignore{}, old{};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(sigaction(SIGPIPE, &ignore, &old), 0);
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  close(fds[0]);
  std::FILE* out = fdopen(fds[1], "w");
  ASSERT_NE(out, nullptr);
  {
    Console console(out, ConsoleOptions{});
    EXPECT_FALSE(console.closed());
    console.Line("header");
    EXPECT_TRUE(console.closed());
    console.StartEpoch(1, 1, 10, 0);
    console.Line("epoch 1/1 done");
    EXPECT_TRUE(console.closed());
  }
  std::fclose(out);
  sigaction(SIGPIPE, &old, nullptr);
}

TEST(ConsoleTest, BarShowsStepRateLossAndEta) {
  Capture cap;
  ConsoleOptions o;
  o.interactive = true;
  Console console(cap.file(), o);
  console.StartEpoch(1, 2, 469, 0);
  const std::string bar = console.RenderBar(234, 2613.4, 0.41234, 9.5, 100);
  EXPECT_NE(bar.find("epoch 1/2"), std::string::npos) << bar;
  EXPECT_NE(bar.find("234/469"), std::string::npos) << bar;
  EXPECT_NE(bar.find("2,613 samples/s"), std::string::npos) << bar;
  EXPECT_NE(bar.find("loss 0.4123"), std::string::npos) << bar;
  EXPECT_NE(bar.find("ETA 0:09"), std::string::npos) << bar;
  EXPECT_NE(bar.find("[##########"), std::string::npos) << bar;  // about half done
  EXPECT_LE(bar.size(), 100u) << bar;
}

TEST(ConsoleTest, UnicodeBarFitsTheWidth) {
  Capture cap;
  ConsoleOptions o;
  o.interactive = true;
  o.unicode = true;
  Console console(cap.file(), o);
  console.StartEpoch(2, 2, 100, 0);
  const std::string bar = console.RenderBar(100, 1000, 0.2, 0, 80);
  EXPECT_NE(bar.find("\u2501"), std::string::npos);
  EXPECT_EQ(bar.find("\u2500"), std::string::npos) << "a finished bar has no light part";
}

TEST(ConsoleTest, TerminalRedrawsInPlaceAndLinesClearTheBar) {
  Capture cap;
  ConsoleOptions o;
  o.interactive = true;
  Console console(cap.file(), o);
  console.StartEpoch(1, 1, 10, 0);
  console.Progress(1, 100, 1.0, 5);
  console.Line("a note");
  const std::string text = cap.Text();
  EXPECT_NE(text.find("\r\033[2K"), std::string::npos);
  EXPECT_NE(text.find("a note\n"), std::string::npos);
  EXPECT_LT(text.find("1/10"), text.find("a note"));
}

TEST(ConsoleTest, PipesGetAboutTenPlainLinesPerEpoch) {
  Capture cap;
  ConsoleOptions o;
  o.interactive = false;
  o.min_plain_interval = std::chrono::milliseconds(0);
  Console console(cap.file(), o);
  console.StartEpoch(1, 2, 200, 0);
  for (int step = 1; step <= 200; ++step) console.Progress(step, 1000, 0.5, 1);
  console.EndEpoch();
  const std::string text = cap.Text();
  EXPECT_EQ(text.find('\r'), std::string::npos) << "no carriage returns in a pipe";
  EXPECT_EQ(text.find('\033'), std::string::npos) << "no escape sequences in a pipe";
  EXPECT_EQ(CountOf(text, "\n"), 9) << text;  // steps 20, 40, ..., 180
  EXPECT_NE(text.find("epoch 1/2  step  20/200  1,000 samples/s  loss 0.5000  ETA 0:01\n"),
            std::string::npos)
      << text;
}

TEST(ConsoleTest, PlainLinesAreThrottled) {
  Capture cap;
  ConsoleOptions o;
  o.interactive = false;
  o.min_plain_interval = std::chrono::hours(1);
  Console console(cap.file(), o);
  console.StartEpoch(1, 1, 100, 0);
  for (int step = 1; step <= 100; ++step) console.Progress(step, 1000, 0.5, 1);
  // The first line also waits one interval: a short epoch prints none.
  EXPECT_EQ(CountOf(cap.Text(), "\n"), 0);
}

// A loss that diverged reads the same on a terminal as in a log: the bar
// used to show "loss -" (as before the first batch) where plain lines
// showed "loss nan", hiding the divergence from whoever watched the bar.
TEST(ConsoleTest, NonFiniteLossReadsTheSameOnTheBarAsInPlainLines) {
  ConsoleOptions terminal;
  terminal.interactive = true;
  terminal.unicode = false;
  Capture bar_cap;
  Console bar_console(bar_cap.file(), terminal);
  bar_console.StartEpoch(1, 1, 10, 0);
  EXPECT_NE(bar_console.RenderBar(5, 100, NAN, 1, 100).find("  loss nan  "), std::string::npos)
      << bar_console.RenderBar(5, 100, NAN, 1, 100);
  EXPECT_NE(bar_console.RenderBar(5, 100, INFINITY, 1, 100).find("  loss inf  "), std::string::npos)
      << bar_console.RenderBar(5, 100, INFINITY, 1, 100);

  ConsoleOptions plain;
  plain.interactive = false;
  plain.min_plain_interval = std::chrono::milliseconds(0);
  Capture cap;
  Console console(cap.file(), plain);
  console.StartEpoch(1, 1, 10, 0);
  console.Progress(1, 100, NAN, 1);
  EXPECT_NE(cap.Text().find("  loss nan  "), std::string::npos) << cap.Text();
}

// Before the epoch's first batch there is no loss yet: "loss -" on the bar
// and in plain lines alike.
TEST(ConsoleTest, NoLossYetReadsAsADashOnTheBarAndInPlainLines) {
  ConsoleOptions terminal;
  terminal.interactive = true;
  Capture bar_cap;
  Console bar_console(bar_cap.file(), terminal);
  bar_console.StartEpoch(1, 1, 10, 0);
  EXPECT_NE(bar_console.RenderBar(0, 0, std::nullopt, 0, 100).find("  loss -  "), std::string::npos);

  ConsoleOptions plain;
  plain.interactive = false;
  plain.min_plain_interval = std::chrono::milliseconds(0);
  Capture cap;
  Console console(cap.file(), plain);
  console.StartEpoch(1, 1, 10, 0);
  console.Progress(1, 100, std::nullopt, 1);
  EXPECT_NE(cap.Text().find("  loss -  "), std::string::npos) << cap.Text();
}

}  // namespace
}  // namespace ddp::examples::trainer
