// FlagProblem and ShowOwnHelpIfAsked against the flags of this file, in
// every spelling gflags takes: what passes must parse, and what gflags
// would refuse in its own words (exit status 1, no program named) is said
// here in one line instead.

#include "examples/own_help.h"

#include <fcntl.h>
#include <gflags/gflags.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

DEFINE_uint64(seed, 0, "a seed");
DEFINE_string(model, "cnn", "a model");
DEFINE_bool(zero, false, "a bool");
DEFINE_double(rate, 0.1, "a rate");
DEFINE_double(decay, 0, "a decay");
DEFINE_double(minimum, 1, "a minimum");

namespace ddp::examples {
namespace {

constexpr char kSource[] = "examples/own_help_test";

// `check` (FlagProblem or ShowOwnHelpIfAsked) called with `args` after a
// program name, as main passes its argc and argv.
template <typename Check>
auto WithArgv(std::vector<std::string> args, Check check) {
  args.insert(args.begin(), "own_help_test");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  return check(static_cast<int>(args.size()), argv.data());
}

// FlagProblem for `args` after a program name.
std::string Problem(std::vector<std::string> args) {
  return WithArgv(std::move(args), [](int argc, char** argv) { return FlagProblem(argc, argv, kSource); });
}

bool HelpAsked(std::vector<std::string> args) {
  return WithArgv(std::move(args), [](int argc, char** argv) { return ShowOwnHelpIfAsked(argc, argv, kSource); });
}

// Problem(`args`) with the variable FLAGS_seed set to `value`.
std::string ProblemWithSeedVariable(const char* value, std::vector<std::string> args) {
  setenv("FLAGS_seed", value, 1);
  return Problem(std::move(args));
}

// SelfLaunchOrExit takes --nproc_per_node and --nproc-per-node, with two
// dashes only; with one, gflags refused it as unknown after the launcher
// had started the ranks without it (exit status 1).
TEST(FlagProblemTest, NprocPerNodeWithOneDashIsRefusedSayingTheSpellingTheLauncherTakes) {
  for (const std::vector<std::string>& taken :
       {std::vector<std::string>{"--nproc_per_node=2"}, {"--nproc_per_node", "2"}, {"--nproc-per-node=2"},
        {"--nproc-per-node", "2"}}) {
    EXPECT_EQ(Problem(taken), "") << taken[0];
  }
  EXPECT_EQ(Problem({"-nproc_per_node=2"}), "-nproc_per_node=2: the launcher takes this flag with two dashes: "
                                            "--nproc_per_node=2");
  EXPECT_EQ(Problem({"-nproc_per_node", "2"}), "-nproc_per_node 2: the launcher takes this flag with two dashes: "
                                               "--nproc_per_node 2");
  EXPECT_EQ(Problem({"-nproc-per-node=cpu"}), "-nproc-per-node=cpu: the launcher takes this flag with two dashes: "
                                              "--nproc-per-node=cpu");
  EXPECT_EQ(Problem({"--model=mlp", "-nproc-per-node", "2"}),
            "-nproc-per-node 2: the launcher takes this flag with two dashes: --nproc-per-node 2");
  EXPECT_EQ(Problem({"-nproc_per_node"}), "-nproc_per_node: the launcher takes this flag with two dashes: "
                                          "--nproc_per_node");
  EXPECT_EQ(Problem({"-nproc_per_node", "--model=mlp"}),
            "-nproc_per_node: the launcher takes this flag with two dashes: --nproc_per_node");
  // After "--" nothing is a flag.
  EXPECT_EQ(Problem({"--", "-nproc_per_node=2"}), "");
}

// gflags' "ERROR: illegal value 'foo' specified for bool flag 'help'" and
// "ERROR: flag '--helpon' is missing its argument; ..." (exit status 1).
TEST(FlagProblemTest, HelpFlagsWithABadOrMissingValueAreNamed) {
  EXPECT_EQ(Problem({"--help=foo"}), "--help=foo: the flag takes true or false");
  EXPECT_EQ(Problem({"-helpshort=maybe"}), "--helpshort=maybe: the flag takes true or false");
  EXPECT_EQ(Problem({"--helpon"}), "--helpon needs a value: --helpon=VALUE");
  EXPECT_EQ(Problem({"--helpmatch"}), "--helpmatch needs a value: --helpmatch=VALUE");
  EXPECT_EQ(Problem({"--zero=maybe"}), "--zero=maybe: the flag takes true or false");
  for (const char* passes : {"--help=false", "--help=TRUE", "--helpon=own_help_test", "--helpmatch=own", "--zero=no",
                             "--helpfull", "--version"}) {
    EXPECT_EQ(Problem({passes}), "") << passes;
  }
  EXPECT_TRUE(HelpAsked({"--help=true"}));
  EXPECT_TRUE(HelpAsked({"-helpshort=1"}));
  EXPECT_FALSE(HelpAsked({"--help=false"}));
  EXPECT_FALSE(HelpAsked({"--", "--help"}));
}

// gflags' "ERROR: FLAGS_seed not found in environment", "ERROR: unknown
// command line flag 'sede' (via --fromenv or --tryfromenv)", "ERROR: empty
// flaglist entry", "ERROR: illegal value '-1' specified for uint64 flag
// 'seed'" and the like (exit status 1).
TEST(FlagProblemTest, FromenvAndTryfromenvProblemsNameTheFlagAndTheVariable) {
  unsetenv("FLAGS_seed");
  unsetenv("FLAGS_model");
  EXPECT_EQ(Problem({"--fromenv"}), "--fromenv needs a value: --fromenv=FLAG[,FLAG...]");
  EXPECT_EQ(Problem({"--fromenv=seed"}),
            "--fromenv=seed: FLAGS_seed is not set; set it (export FLAGS_seed=VALUE), or use --tryfromenv, which "
            "skips a flag whose variable is unset");
  EXPECT_EQ(Problem({"--tryfromenv=seed"}), "");
  EXPECT_EQ(Problem({"--tryfromenv", "sede"}),
            "--tryfromenv=sede: unknown flag sede; did you mean seed? (--help lists the flags)");
  EXPECT_EQ(Problem({"--fromenv=,seed"}),
            "--fromenv=,seed: an empty name in the list; give flag names separated by commas");
  EXPECT_EQ(Problem({"--fromenv=--seed"}),
            "--fromenv=--seed: --seed is written with dashes; give the flag's name alone (--fromenv=seed)");
  EXPECT_EQ(Problem({"--fromenv=-"}),
            "--fromenv=-: - is written with dashes; give the flag's name alone (--fromenv=NAME)");

  EXPECT_EQ(ProblemWithSeedVariable("-1", {"--tryfromenv=seed"}),
            "--tryfromenv=seed: FLAGS_seed=-1: the flag takes a whole number, at least 0");
  EXPECT_EQ(ProblemWithSeedVariable("99999999999999999999", {"--fromenv=seed"}),
            "--fromenv=seed: FLAGS_seed=99999999999999999999 is out of range: the flag takes a whole number from 0 "
            "to 18446744073709551615");
  EXPECT_EQ(ProblemWithSeedVariable("fromenv", {"--fromenv=seed"}),
            "--fromenv=seed: FLAGS_seed=fromenv is refused by gflags (it would read the environment again)");
  // The second name is checked too; a comma at the end ends the list, as
  // gflags reads it.
  EXPECT_EQ(ProblemWithSeedVariable("7", {"--fromenv=seed,model"}),
            "--fromenv=seed,model: FLAGS_model is not set; set it (export FLAGS_model=VALUE), or use --tryfromenv, "
            "which skips a flag whose variable is unset");
  setenv("FLAGS_model", "mlp", 1);
  EXPECT_EQ(Problem({"--fromenv=seed,model,"}), "");
  EXPECT_EQ(FLAGS_seed, 7u) << "set as parsing sets it";
  unsetenv("FLAGS_seed");
  unsetenv("FLAGS_model");
}

// gflags lets a flag no library defines pass when --undefok names it
// (wherever --undefok comes, the last one counting); FlagProblem called it
// unknown.
TEST(FlagProblemTest, FlagsThatUndefokNamesPass) {
  EXPECT_EQ(Problem({"--foo=1", "--undefok=foo,bar", "--nobar", "-bar"}), "");
  EXPECT_EQ(Problem({"--undefok", "foo", "-foo"}), "");
  EXPECT_EQ(Problem({"--undefok=foo", "--baz=1"}), "unknown flag --baz (--help lists the flags)");
  EXPECT_EQ(Problem({"--undefok=foo", "--undefok=bar", "--foo"}), "unknown flag --foo (--help lists the flags)");
  EXPECT_EQ(Problem({"--", "--undefok=foo"}), "");
  EXPECT_EQ(Problem({"--foo", "--", "--undefok=foo"}), "unknown flag --foo (--help lists the flags)");
}

// A fresh folder under TEST_TMPDIR.
std::string TempDir() {
  const char* root = std::getenv("TEST_TMPDIR");
  std::string pattern = std::string(root != nullptr ? root : "/tmp") + "/own_help_XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) ADD_FAILURE() << "mkdtemp " << pattern;
  return pattern;
}

// Writes `text` to `dir`/`name` and returns its path.
std::string WriteFile(const std::string& dir, const std::string& name, const std::string& text) {
  const std::string path = dir + "/" + name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// Flags inside a --flagfile were not checked: gflags ignores an unknown one
// there without a word (a misspelt flag ran with its default), and refuses
// a bad value in its own words, exit status 1. They are checked as on the
// command line now, naming the file and the line.
TEST(FlagProblemTest, FlagsInAFlagfileAreCheckedNamingTheFileAndLine) {
  const std::string dir = TempDir();
  const std::string typo = WriteFile(dir, "typo", "# the model\n\n  --model=mlp\n--modle=cnn\n");
  EXPECT_EQ(Problem({"--flagfile=" + typo}),
            typo + ":4: unknown flag --modle; did you mean --model? (--help lists the flags)");
  const std::string value = WriteFile(dir, "value", "--zero\r\n--seed=-1\r\n");
  EXPECT_EQ(Problem({"--flagfile", value}), value + ":2: --seed=-1: the flag takes a whole number, at least 0");
  const std::string blank = WriteFile(dir, "blank", "--seed 3\n");
  EXPECT_EQ(Problem({"--flagfile=" + blank}),
            blank + ":1: --seed 3: in a file of flags the value follows '=': --seed=3");
  const std::string missing_value = WriteFile(dir, "missing_value", "--seed\n");
  EXPECT_EQ(Problem({"--flagfile=" + missing_value}), missing_value + ":1: --seed needs a value: --seed=VALUE");
  const std::string nproc = WriteFile(dir, "nproc", "--nproc_per_node=2\n");
  EXPECT_EQ(Problem({"--flagfile=" + nproc}),
            nproc + ":1: --nproc_per_node=2: the launcher takes this flag on the command line only, not in a "
                    "--flagfile; give it there (--nproc_per_node=N)");
  // Good flags pass, and are set as parsing sets them next.
  const std::string good = WriteFile(dir, "good", "--zero\n--nozero\n-seed=7\n--model=mlp");
  EXPECT_EQ(Problem({"--flagfile=" + good}), "");
  EXPECT_EQ(FLAGS_seed, 7u);
  // Several files, comma-separated: each is read.
  EXPECT_EQ(Problem({"--flagfile=" + good + "," + typo}),
            typo + ":4: unknown flag --modle; did you mean --model? (--help lists the flags)");
  // --undefok on the command line covers the files too.
  EXPECT_EQ(Problem({"--undefok=modle", "--flagfile=" + typo}), "");
  FLAGS_seed = 0;
  FLAGS_model = "cnn";
}

// A double below the smallest normal one (1e-310) is a valid double that
// Python's float() and PyTorch take, but gflags refused it ("illegal
// value", exit status 1), and FlagProblem said it was out of range. On the
// command line it is taken, as the same double; underflow to 0 is 0 with
// its sign. Only a number past a double's largest is out of range. In a
// file of flags, which gflags reads itself, the refusal names the exact
// spelling gflags reads.
TEST(CommandLineProblemTest, DoublesBelowTheSmallestNormalOneAreTakenExactly) {
  std::vector<std::string> args = {"own_help_test", "--rate=1e-310", "--decay", "-4.9406564584124654e-324",
                                   "--minimum=-1e-400", "--seed=3"};
  std::vector<char*> pointers;
  for (std::string& a : args) pointers.push_back(a.data());
  pointers.push_back(nullptr);
  int argc = static_cast<int>(args.size());
  char** argv = pointers.data();
  ASSERT_EQ(CommandLineProblem(&argc, &argv, kSource), "");
  gflags::ParseCommandLineFlags(&argc, &argv, /*remove_flags=*/true);
  EXPECT_EQ(argc, 1);
  EXPECT_EQ(FLAGS_rate, 1e-310);
  EXPECT_EQ(FLAGS_decay, -4.9406564584124654e-324);
  EXPECT_EQ(FLAGS_minimum, 0.0);
  EXPECT_TRUE(std::signbit(FLAGS_minimum));
  EXPECT_EQ(FLAGS_seed, 3u);
  EXPECT_EQ(Problem({"--rate=1e400"}), "--rate=1e400 is out of range: the flag takes a number of magnitude up to "
                                       "about 1.8e308");
  EXPECT_EQ(Problem({"--rate", "-1e999"}), "--rate=-1e999 is out of range: the flag takes a number of magnitude up "
                                           "to about 1.8e308");
  char exact[40];
  std::snprintf(exact, sizeof(exact), "%a", 1e-310);
  const std::string small = WriteFile(TempDir(), "small", "--rate=1e-310\n");
  EXPECT_EQ(Problem({"--flagfile=" + small}),
            small + ":1: --rate=1e-310: gflags cannot read a number this small in decimal here; write it as " +
                exact + " (the same number, exactly) or give it on the command line");
  const std::string hex = WriteFile(TempDir(), "hex", "--rate=" + std::string(exact) + "\n");
  EXPECT_EQ(Problem({"--flagfile=" + hex}), "");
  EXPECT_EQ(FLAGS_rate, 1e-310);
  FLAGS_rate = 0.1;
  FLAGS_decay = 0;
  FLAGS_minimum = 1;
  FLAGS_seed = 0;
}

// A file of flags that another one reads (nested --flagfile) is checked the
// same way; one that cannot be read is named with the line that names it,
// and one that reads itself again is refused (gflags went round until its
// stack overflowed).
TEST(FlagProblemTest, NestedFlagfilesAreCheckedAndNamed) {
  const std::string dir = TempDir();
  const std::string inner = WriteFile(dir, "inner", "\n--sed=1\n");
  const std::string outer = WriteFile(dir, "outer", "--zero\n--flagfile=" + inner + "\n");
  EXPECT_EQ(Problem({"--flagfile=" + outer}),
            inner + ":2: unknown flag --sed; did you mean --seed? (--help lists the flags)");
  const std::string lost = WriteFile(dir, "lost", "--flagfile=" + dir + "/missing\n");
  EXPECT_EQ(Problem({"--flagfile=" + lost}), lost + ":1: --flagfile=" + dir + "/missing: cannot read " + dir +
                                                 "/missing (No such file or directory)");
  const std::string loop = dir + "/loop";
  WriteFile(dir, "loop", "--flagfile=" + loop + "\n");
  EXPECT_EQ(Problem({"--flagfile=" + loop}), loop + ":1: --flagfile=" + loop + ": " + loop +
                                                 " reads itself again through --flagfile (gflags would go round "
                                                 "without end)");
}

// A line of program names starts a section whose flags are for those
// programs only (gflags' rule): another program's flags are not checked.
TEST(FlagProblemTest, FlagsOfAnotherProgramsSectionInAFlagfilePass) {
  const std::string dir = TempDir();
  const std::string others = WriteFile(dir, "others", "other_program *_bench\n--bogus=1\n");
  EXPECT_EQ(Problem({"--flagfile=" + others}), "");
  const std::string ours = WriteFile(dir, "ours", "other_program\n--bogus=1\nown_help_*\n--bogux=2\n");
  EXPECT_EQ(Problem({"--flagfile=" + ours}), ours + ":4: unknown flag --bogux (--help lists the flags)");
}

// Writes `text` into the FIFO `path` from a thread of its own once a reader
// has opened it, then closes it; gives up after 30 s without a reader.
class FifoFeeder {
 public:
  FifoFeeder(std::string path, std::string text)
      : thread_([path = std::move(path), text = std::move(text)] {
          const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
          int fd = -1;
          while ((fd = open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC)) < 0) {
            if (errno != ENXIO || std::chrono::steady_clock::now() >= deadline) {
              ADD_FAILURE() << path << " was not opened for reading: " << std::strerror(errno);
              return;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
          }
          EXPECT_EQ(write(fd, text.data(), text.size()), static_cast<ssize_t>(text.size())) << path;
          close(fd);
        }) {}
  ~FifoFeeder() { thread_.join(); }
  FifoFeeder(const FifoFeeder&) = delete;
  FifoFeeder& operator=(const FifoFeeder&) = delete;

 private:
  std::thread thread_;
};

// A new FIFO `name` in `dir`.
std::string MakeFifo(const std::string& dir, const std::string& name) {
  const std::string path = dir + "/" + name;
  if (mkfifo(path.c_str(), 0600) != 0) ADD_FAILURE() << "mkfifo " << path << ": " << std::strerror(errno);
  return path;
}

// A --flagfile that is a FIFO (a shell's <(...)) was left to gflags: its
// lines were not checked, and a self-launched program's ranks, parsing the
// same arguments, read the FIFO again and waited on it. Its flags for this
// program take its place now, checked as those of any file of flags.
TEST(InlineStreamFlagfilesTest, AFifosFlagsForThisProgramTakeItsPlace) {
  const std::string dir = TempDir();
  const std::string fifo = MakeFifo(dir, "fifo");
  std::vector<std::string> args = {"own_help_test", "--model=mlp", "--flagfile=" + fifo, "--", "--flagfile=x"};
  {
    FifoFeeder feeder(fifo, "# quick\n  --zero\nother_program\n--bogus=1\nown_help_*\n--seed=7\n");
    EXPECT_EQ(InlineStreamFlagfiles(args, kSource), "");
  }
  EXPECT_EQ(args, (std::vector<std::string>{"own_help_test", "--model=mlp", "--zero", "--seed=7", "--",
                                            "--flagfile=x"}));
  // Beside regular files, which stay, and as a separate argument.
  const std::string good = WriteFile(dir, "good", "--zero\n");
  args = {"own_help_test", "--flagfile", good + "," + fifo + "," + good};
  {
    FifoFeeder feeder(fifo, "--seed=3");
    EXPECT_EQ(InlineStreamFlagfiles(args, kSource), "");
  }
  EXPECT_EQ(args, (std::vector<std::string>{"own_help_test", "--flagfile=" + good, "--seed=3", "--flagfile=" + good}));
  // Regular files alone are left as they are.
  args = {"own_help_test", "--flagfile", good};
  EXPECT_EQ(InlineStreamFlagfiles(args, kSource), "");
  EXPECT_EQ(args, (std::vector<std::string>{"own_help_test", "--flagfile", good}));
  FLAGS_seed = 0;
  FLAGS_zero = false;
}

TEST(InlineStreamFlagfilesTest, AFifosLinesAreCheckedNamingItAndTheLine) {
  const std::string dir = TempDir();
  const std::string fifo = MakeFifo(dir, "fifo");
  std::vector<std::string> args = {"own_help_test", "--flagfile=" + fifo};
  {
    FifoFeeder feeder(fifo, "--zero\n--modle=cnn\n");
    EXPECT_EQ(InlineStreamFlagfiles(args, kSource),
              fifo + ":2: unknown flag --modle; did you mean --model? (--help lists the flags)");
  }
  // Named twice: its flags were taken the first time.
  args = {"own_help_test", "--flagfile=" + fifo + "," + fifo};
  {
    FifoFeeder feeder(fifo, "--zero\n");
    EXPECT_EQ(InlineStreamFlagfiles(args, kSource),
              "--flagfile=" + fifo + "," + fifo + ": " + fifo +
                  " was read already (a stream is read once: its flags were taken the first time); name it once");
  }
  FLAGS_zero = false;
}

// A stream was read with no deadline and no bound: a FIFO nobody writes to
// held the program for ever (Ctrl-C printed its line and changed nothing),
// and /dev/zero filled the memory. Both are named now.
TEST(InlineStreamFlagfilesTest, AStreamThatDoesNotEndOrHoldsTooMuchIsNamed) {
  const std::string dir = TempDir();
  const std::string fifo = MakeFifo(dir, "fifo");
  std::vector<std::string> args = {"own_help_test", "--flagfile=" + fifo};
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(InlineStreamFlagfiles(args, kSource, nullptr, std::chrono::milliseconds(300)),
            "--flagfile=" + fifo + ": " + fifo + " did not end within 300 ms (a FIFO ends when its writer closes it)");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  // A writer that never stops: it gets EPIPE (not SIGPIPE: blocked on its
  // thread) once the reader gave up.
  std::thread writer([&fifo] {
    sigset_t pipe_signal;
    sigemptyset(&pipe_signal);
    sigaddset(&pipe_signal, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_signal, nullptr);
    const int fd = open(fifo.c_str(), O_WRONLY | O_CLOEXEC);  // waits for the reader
    if (fd < 0) return;
    const std::string lines(65536, '\n');
    while (write(fd, lines.data(), lines.size()) > 0) {
    }
    close(fd);
  });
  EXPECT_EQ(InlineStreamFlagfiles(args, kSource),
            "--flagfile=" + fifo + ": " + fifo + " holds more than 1 MiB: that is not a file of flags");
  writer.join();
}

}  // namespace
}  // namespace ddp::examples
