// //examples:ddp_bench, nn_bench and allreduce_bench: a tiny run prints its
// figures, and flags out of range are refused with a message that names
// them (a batch as large as the data used to read past the sample list and
// crash; a --max_bytes beyond the host's memory was left to the kernel's
// out-of-memory killer).

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "examples/testing/subprocess.h"
#include "gtest/gtest.h"
#include "nn/data/idx.h"
#include "nn/data/test_files.h"

namespace ddp::examples {
namespace {

std::vector<std::string> Fields(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> fields;
  for (std::string f; in >> f;) fields.push_back(f);
  return fields;
}

// --help started every rank to print the flags of every linked library
// (gflags' own among them), and exited 1.
TEST(AllreduceBenchTest, HelpListsItsOwnFlagsOnce) {
  const testing::RunOutput r = testing::RunToEnd({testing::Runfile("examples/allreduce_bench"), "--help"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const std::string all = r.out + r.err;
  EXPECT_NE(all.find("-algo ("), std::string::npos) << all;
  EXPECT_EQ(all.find("-algo ("), all.rfind("-algo (")) << "listed more than once:\n" << all;
  EXPECT_EQ(all.find("tab_completion"), std::string::npos) << all;
}

TEST(DdpBenchTest, TwoRanksPrintOneLineOfFigures) {
  const testing::RunOutput r =
      testing::RunToEnd({testing::Runfile("examples/ddp_bench"), "--model=mlp", "--steps=3",
                         "--nproc_per_node=2", "--eval=false"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::vector<std::string> lines = testing::Lines(r.out);
  ASSERT_EQ(lines.size(), 1u) << r.out;
  const std::vector<std::string> f = Fields(lines[0]);
  ASSERT_EQ(f.size(), 15u) << lines[0];
  EXPECT_EQ(f[0], "mlp");
  EXPECT_EQ(f[1], "2");
  EXPECT_GT(std::stod(f[2]), 0) << "samples/s: " << lines[0];
  EXPECT_EQ(f[11], "3") << "buckets: " << lines[0];
  EXPECT_GE(std::stod(f[14]), 0) << "rank 0's wait for the other rank: " << lines[0];
}

TEST(DdpBenchTest, ABatchAsLargeAsARanksShareIsRefused) {
  // 60,000 training samples on 2 ranks: 30,000 each.
  for (const char* batch : {"--batch=30000", "--batch=0"}) {
    const testing::RunOutput r =
        testing::RunToEnd({testing::Runfile("examples/ddp_bench"), "--model=mlp", "--steps=3",
                           "--nproc_per_node=2", "--eval=false", batch});
    EXPECT_EQ(r.exit_code, 2) << batch << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find(std::string("ddp_bench: ") + batch +
                         " must be in [1, 30000): each of the 2 ranks draws its batches from its "
                         "30000-sample share of"),
              std::string::npos)
        << r.err;
    EXPECT_EQ(r.out, "");
  }
}

// A trace name that is a folder (or another file that is neither a
// regular one nor a FIFO or terminal) is refused before training, naming
// the flag; the traces are written at the end, and the run only warned
// then, with exit status 0.
TEST(DdpBenchTest, ATraceNameThatIsAFolderIsRefusedBeforeTraining) {
  const std::string dir = testing::MakeTempDir("bench_trace_folder");
  std::filesystem::create_directory(dir + "/t_rank1.json");
  const testing::RunOutput r =
      testing::RunToEnd({testing::Runfile("examples/ddp_bench"), "--model=mlp", "--steps=3", "--nproc_per_node=2",
                         "--eval=false", "--trace_prefix=" + dir + "/t_"});
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("ddp_bench: --trace_prefix=" + dir + "/t_: rank 1's trace " + dir +
                       "/t_rank1.json exists and is neither a regular file nor a FIFO or terminal"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out, "");
  EXPECT_FALSE(std::filesystem::exists(dir + "/t_rank0.json"));
}

// A FIFO at a rank's trace name (`mkfifo t_rank1.json; cat t_rank1.json &`)
// gets that rank's whole trace streamed, one JSON document, while the
// other rank's trace is a file. It was refused before training, as a name
// the end-of-run rename could not replace.
TEST(DdpBenchTest, AFifoAtATraceNameStreamsThatRanksTrace) {
  const std::string dir = testing::MakeTempDir("bench_trace_fifo");
  const std::string fifo = dir + "/t_rank1.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  testing::FifoReader reader(fifo);
  const testing::RunOutput r =
      testing::RunToEnd({testing::Runfile("examples/ddp_bench"), "--model=mlp", "--steps=3", "--nproc_per_node=2",
                         "--eval=false", "--trace_prefix=" + dir + "/t_"});
  const std::string streamed = reader.Finish();
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(reader.ended()) << "the trace was not ended: " << streamed;
  nlohmann::json doc;
  ASSERT_NO_THROW(doc = nlohmann::json::parse(streamed)) << streamed;
  int forwards = 0;
  for (const auto& e : doc["traceEvents"]) {
    EXPECT_EQ(e["pid"], 1) << e.dump();
    forwards += e["ph"] == "X" && e["name"] == "forward";
  }
  EXPECT_GE(forwards, 3) << streamed;
  EXPECT_EQ(std::filesystem::status(fifo).type(), std::filesystem::file_type::fifo);
  EXPECT_TRUE(std::filesystem::is_regular_file(dir + "/t_rank0.json"));
}

TEST(DdpBenchTest, LocalSgdAndNoopHooksRunAndBadPeriodsAreRefused) {
  for (const std::vector<std::string>& hook :
       {std::vector<std::string>{"--hook=local_sgd", "--average_period=2"}, {"--hook=noop"}}) {
    std::vector<std::string> argv = {testing::Runfile("examples/ddp_bench"), "--model=mlp", "--steps=6",
                                     "--nproc_per_node=2", "--eval=false"};
    argv.insert(argv.end(), hook.begin(), hook.end());
    const testing::RunOutput r = testing::RunToEnd(argv);
    ASSERT_EQ(r.exit_code, 0) << hook[0] << "\n" << r.out << r.err;
    ASSERT_EQ(testing::Lines(r.out).size(), 1u) << r.out;
  }
  const testing::RunOutput r =
      testing::RunToEnd({testing::Runfile("examples/ddp_bench"), "--model=mlp", "--steps=3",
                         "--nproc_per_node=1", "--hook=local_sgd", "--average_period=0"});
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("ddp_bench: --local_sgd_start=0 must be at least 0 and --average_period=0 at least 1"),
            std::string::npos)
      << r.err;
}

// A flag of one hook given with another is refused, naming it (before, it
// was accepted and ignored); left at its default it is no mistake.
TEST(DdpBenchTest, AHookFlagGivenWithAnotherHookIsRefused) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--hook=noop", "--average_period=2"},
       "ddp_bench: --average_period=2 applies to --hook=local_sgd only, not --hook=noop; drop it\n"},
      {{"--average_period=4"},
       "ddp_bench: --average_period=4 applies to --hook=local_sgd only, not --hook=allreduce; drop it\n"},
      {{"--hook=local_sgd", "--powersgd_rank=2"},
       "ddp_bench: --powersgd_rank=2 applies to --hook=powersgd only, not --hook=local_sgd; drop it\n"},
      {{"--hook=fp16", "--powersgd_start=10"},
       "ddp_bench: --powersgd_start=10 applies to --hook=powersgd only, not --hook=fp16; drop it\n"},
      {{"--hook=powersgd", "--local_sgd_start=3"},
       "ddp_bench: --local_sgd_start=3 applies to --hook=local_sgd only, not --hook=powersgd; drop it\n"},
  };
  for (const auto& [flags, message] : cases) {
    std::vector<std::string> argv = {testing::Runfile("examples/ddp_bench"), "--model=mlp", "--steps=1",
                                     "--nproc_per_node=1", "--eval=false"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    const testing::RunOutput r = testing::RunToEnd(argv);
    EXPECT_EQ(r.exit_code, 2) << flags.back() << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
    EXPECT_EQ(r.out, "") << flags.back();
  }
  // The hook's own flags are accepted.
  const testing::RunOutput ok = testing::RunToEnd(
      {testing::Runfile("examples/ddp_bench"), "--model=mlp", "--steps=1", "--nproc_per_node=1",
       "--eval=false", "--hook=powersgd", "--powersgd_rank=2", "--powersgd_start=1"});
  EXPECT_EQ(ok.exit_code, 0) << ok.out << ok.err;
}

TEST(DdpBenchTest, NoTimedStepsIsRefused) {
  const testing::RunOutput r = testing::RunToEnd(
      {testing::Runfile("examples/ddp_bench"), "--steps=-5", "--nproc_per_node=1"});
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("ddp_bench: --steps=-5 must be at least 1\n"), std::string::npos) << r.err;
}

// An unknown --dtype, --op or --algo is refused with the values that are
// accepted (before, only "is not recognised").
TEST(AllreduceBenchTest, AnUnknownEnumValueListsTheAcceptedOnes) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--dtype=f8", "--dtype=f8 is not recognised; expected one of f32, f64, f16, bf16, i32, i64, u8\n"},
      {"--op=mean", "--op=mean is not recognised; expected one of sum, avg, max, min, prod\n"},
      {"--algo=butterfly",
       "--algo=butterfly is not recognised; expected one of auto, ring, tree, rhd, hierarchical, shm\n"},
  };
  for (const auto& [flag, message] : cases) {
    const testing::RunOutput r =
        testing::RunToEnd({testing::Runfile("examples/allreduce_bench"), "--nproc_per_node=1", flag});
    EXPECT_EQ(r.exit_code, 2) << flag << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find("allreduce_bench: " + message), std::string::npos) << r.err;
    EXPECT_EQ(r.out, "");
  }
}

// Spawning two ranks, a wrong flag is refused once, by the process that
// would start them, before any starts: each rank printed the refusal
// before, and the launcher a line of its own about the failed ranks.
TEST(BenchLaunchTest, AWrongFlagIsRefusedOnceBeforeAnyRankStarts) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{testing::Runfile("examples/ddp_bench"), "--model=foo"}, "ddp_bench: unknown --model=foo (mlp or cnn)\n"},
      {{testing::Runfile("examples/ddp_bench"), "--steps=-1"}, "ddp_bench: --steps=-1 must be at least 1\n"},
      {{testing::Runfile("examples/allreduce_bench"), "--algo=foo"},
       "allreduce_bench: --algo=foo is not recognised; expected one of auto, ring, tree, rhd, hierarchical, shm\n"},
  };
  for (const auto& [flags, message] : cases) {
    std::vector<std::string> argv = flags;
    argv.push_back("--nproc_per_node=2");
    const testing::RunOutput r = testing::RunToEnd(argv);
    EXPECT_EQ(r.exit_code, 2) << flags[1] << "\n" << r.out << r.err;
    EXPECT_EQ(r.err, message) << flags[1];
    EXPECT_EQ(r.out, "") << flags[1];
  }
}

// ddp_bench with --nproc_per_node=1 and `fifo` as --flagfile, once `text`
// was written into it.
testing::RunOutput DdpBenchWithFifoFlagfile(const std::string& fifo, const std::string& text) {
  testing::Subprocess running({testing::Runfile("examples/ddp_bench"), "--nproc_per_node=1", "--flagfile=" + fifo});
  int writer = -1;
  testing::OpenFifoOnceRead(fifo, running, &writer);
  if (writer >= 0) {
    EXPECT_EQ(::write(writer, text.data(), text.size()), static_cast<ssize_t>(text.size())) << fifo;
    ::close(writer);
  }
  testing::RunOutput r;
  r.exit_code = running.Wait(std::chrono::seconds(120));
  r.out = running.Stdout();
  r.err = running.Stderr();
  return r;
}

// A --flagfile that is a FIFO (a shell's <(...)) was left to gflags, which
// ignored a misspelt flag in it without a word, and the ranks, parsing the
// same arguments, opened the FIFO again and waited on it for good. Its
// lines are checked now, naming it and the line, and its flags reach the
// ranks in its place.
TEST(BenchFlagsTest, AFifoFlagfileIsCheckedAndItsFlagsReachTheRanks) {
  const std::string dir = testing::MakeTempDir("bench_fifo_flagfile");
  const std::string fifo = dir + "/flags";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << fifo << ": " << std::strerror(errno);
  const testing::RunOutput typo = DdpBenchWithFifoFlagfile(fifo, "--steps=1\n--modle=mlp\n");
  EXPECT_EQ(typo.exit_code, 2) << typo.out << typo.err;
  EXPECT_EQ(typo.err, "ddp_bench: " + fifo + ":2: unknown flag --modle; did you mean --model? (--help lists the flags)\n");
  EXPECT_EQ(typo.out, "");
  const testing::RunOutput good = DdpBenchWithFifoFlagfile(fifo, "--model=mlp\n--steps=3\n--eval=false\n");
  ASSERT_EQ(good.exit_code, 0) << good.out << good.err;
  const std::vector<std::string> lines = testing::Lines(good.out);
  ASSERT_EQ(lines.size(), 1u) << good.out;
  EXPECT_EQ(Fields(lines[0])[0], "mlp") << lines[0];
}

// Ctrl-C while the process that starts the ranks checks the flags ended it
// without a word. Held in that check by a --flagfile that is a FIFO (the
// check's parse waits in its read, the writer's end held open until the
// program has ended), it now says so, and that the read stopped, ends by
// the signal, and starts no rank. (The writer's end closed right after the
// signal raced the read's stop: one line or two.)
TEST(BenchLaunchTest, CtrlCDuringTheCheckBeforeLaunchSaysSoInOneLine) {
  for (const std::string program : {"ddp_bench", "allreduce_bench"}) {
    SCOPED_TRACE(program);
    const std::string dir = testing::MakeTempDir("ctrl_c_setup_" + program);
    const std::string fifo = dir + "/flags";
    ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << fifo << ": " << std::strerror(errno);
    testing::Subprocess running(
        {testing::Runfile("examples/" + program), "--flagfile=" + fifo, "--nproc_per_node=1"});
    int writer = -1;
    ASSERT_NO_FATAL_FAILURE(testing::OpenFifoOnceRead(fifo, running, &writer));
    running.Signal(SIGINT);
    const int code = running.Wait(std::chrono::seconds(60));
    ::close(writer);
    ASSERT_EQ(code, 128 + SIGINT) << running.Stdout() << running.Stderr();
    EXPECT_EQ(running.Stderr(), program +
                                    ": interrupted by Ctrl-C during setup; stopping before any rank starts "
                                    "(Ctrl-C again: at once)\n" +
                                    program + ": --flagfile=" + fifo + ": stopped reading " + fifo +
                                    " before its end (its writer had not closed it); none of its flags were "
                                    "taken\n");
    EXPECT_EQ(running.Stdout(), "");
    EXPECT_TRUE(running.Children().empty());
  }
}

// SelfLaunchOrExit takes --nproc-per-node as well as --nproc_per_node; the
// flag check before it called the first an unknown flag.
TEST(BenchLaunchTest, TheHyphenatedNprocPerNodeIsTaken) {
  const testing::RunOutput r = testing::RunToEnd(
      {testing::Runfile("examples/ddp_bench"), "--nproc-per-node=2", "--model=mlp", "--steps=1", "--eval=false"});
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::vector<std::string> lines = testing::Lines(r.out);
  ASSERT_EQ(lines.size(), 1u) << r.out << r.err;
  EXPECT_EQ(Fields(lines[0]).at(1), "2") << "ranks: " << lines[0];
}

// With one dash SelfLaunchOrExit takes neither spelling: the ranks started
// without it, and gflags then refused it as unknown (exit status 1). It is
// refused before anything starts, naming the spelling that is taken.
TEST(BenchLaunchTest, NprocPerNodeWithOneDashIsRefusedNamingTheSpellingTaken) {
  for (const std::vector<std::string>& flag :
       {std::vector<std::string>{"-nproc_per_node=1"}, {"-nproc-per-node", "1"}}) {
    std::vector<std::string> argv = {testing::Runfile("examples/ddp_bench"), "--model=mlp", "--steps=1",
                                     "--eval=false"};
    argv.insert(argv.end(), flag.begin(), flag.end());
    const testing::RunOutput r = testing::RunToEnd(argv);
    const std::string given = flag.size() == 1 ? flag[0] : flag[0] + " " + flag[1];
    EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
    EXPECT_EQ(r.err, "ddp_bench: " + given + ": the launcher takes this flag with two dashes: -" + given + "\n");
    EXPECT_EQ(r.out, "");
  }
}

// A deadline of zero or less is refused naming --timeout_ms, before any
// rank connects (the communicator's own refusal said only "timeout must be
// positive").
TEST(BenchTimeoutTest, ATimeoutBelowOneMillisecondIsRefusedByName) {
  for (const char* timeout : {"--timeout_ms=0", "--timeout_ms=-5"}) {
    const std::string flag = timeout;
    const testing::RunOutput ddp =
        testing::RunToEnd({testing::Runfile("examples/ddp_bench"), "--model=mlp", "--steps=1",
                           "--nproc_per_node=1", "--eval=false", flag});
    EXPECT_EQ(ddp.exit_code, 2) << ddp.out << ddp.err;
    EXPECT_NE(ddp.err.find("ddp_bench: " + flag + " must be at least 1\n"), std::string::npos)
        << ddp.err;
    const testing::RunOutput all =
        testing::RunToEnd({testing::Runfile("examples/allreduce_bench"), "--nproc_per_node=1", flag});
    EXPECT_EQ(all.exit_code, 2) << all.out << all.err;
    EXPECT_NE(all.err.find("allreduce_bench: " + flag + " must be at least 1\n"), std::string::npos)
        << all.err;
    EXPECT_EQ(all.out, "");
  }
}

// Runs `argv` to its end and expects the refusal of a flag: exit status 2,
// `err` alone on stderr, nothing on stdout.
void ExpectRefusedInOneLine(const std::vector<std::string>& argv, const std::string& err) {
  const testing::RunOutput r = testing::RunToEnd(argv);
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_EQ(r.err, err);
  EXPECT_EQ(r.out, "");
}

// nn_bench starts no ranks: --nproc_per_node is refused in one line that
// says so (gflags' "ERROR: unknown command line flag", exit 1, before).
TEST(NnBenchTest, NprocPerNodeIsRefusedSayingItRunsOneProcess) {
  for (const std::vector<std::string>& flag :
       {std::vector<std::string>{"--nproc_per_node=2"}, {"--nproc_per_node", "2"}, {"-nproc-per-node=2"},
        {"--nproc-per-node", "2"}}) {
    std::vector<std::string> argv = {testing::Runfile("examples/nn_bench")};
    argv.insert(argv.end(), flag.begin(), flag.end());
    ExpectRefusedInOneLine(argv, "nn_bench: " + flag[0] +
                                     ": nn_bench runs one process; drop the flag (ddp_bench runs several ranks)\n");
  }
}

// In a --flagfile too: the check of the file's lines said "the launcher
// takes this flag on the command line only", which nn_bench has none of.
TEST(NnBenchTest, NprocPerNodeInAFlagfileIsRefusedSayingItRunsOneProcess) {
  const std::string dir = testing::MakeTempDir("nn_bench_nproc");
  const std::string file = dir + "/flags";
  std::ofstream(file) << "--steps=1\n--nproc_per_node=2\n";
  ExpectRefusedInOneLine({testing::Runfile("examples/nn_bench"), "--flagfile=" + file},
                         "nn_bench: " + file +
                             ":2: --nproc_per_node=2: nn_bench runs one process; drop the flag (ddp_bench runs "
                             "several ranks)\n");
}

// Flags in a --flagfile were left to gflags, which ignored a misspelt one
// without a word (the run went on with the default) and refused a bad
// value in its own words, exit status 1. Both are one line now, naming the
// file and the line, exit status 2, before any rank starts.
TEST(BenchFlagsTest, AMisspeltFlagOrABadValueInAFlagfileIsOneLineNamingTheFileAndLine) {
  const std::string dir = testing::MakeTempDir("bench_flagfile");
  const std::string typo = dir + "/typo";
  std::ofstream(typo) << "# one quick step\n--steps=1\n--eval=false\n--modle=cnn\n";
  const std::string value = dir + "/value";
  std::ofstream(value) << "--steps=many\n";
  for (const auto& [file, problem] :
       {std::pair<std::string, std::string>{typo, ":4: unknown flag --modle; did you mean --model? (--help lists "
                                                  "the flags)"},
        {value, ":1: --steps=many: the flag takes a whole number"}}) {
    ExpectRefusedInOneLine(
        {testing::Runfile("examples/ddp_bench"), "--model=mlp", "--nproc_per_node=1", "--flagfile=" + file},
        "ddp_bench: " + file + problem + "\n");
  }
}

// --help printed "SetUsageMessage() never called" and the flags of every
// linked library, its own among them, and exited 1.
TEST(NnBenchTest, HelpListsItsOwnFlags) {
  const testing::RunOutput r = testing::RunToEnd({testing::Runfile("examples/nn_bench"), "--help"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const std::string all = r.out + r.err;
  EXPECT_NE(all.find("-eval_batch ("), std::string::npos) << all;
  EXPECT_EQ(all.find("SetUsageMessage"), std::string::npos) << all;
  EXPECT_EQ(all.find("tab_completion"), std::string::npos) << all;
}

// ddp_bench too: --help started both ranks to print every linked library's
// flags and exit 1, and a misspelt flag got gflags' message from each.
TEST(DdpBenchTest, HelpListsItsOwnFlagsOnceAndAMisspeltFlagIsOneLine) {
  const testing::RunOutput r = testing::RunToEnd({testing::Runfile("examples/ddp_bench"), "--help"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const std::string all = r.out + r.err;
  EXPECT_NE(all.find("-hook ("), std::string::npos) << all;
  EXPECT_EQ(all.find("-hook ("), all.rfind("-hook (")) << "listed more than once:\n" << all;
  EXPECT_EQ(all.find("tab_completion"), std::string::npos) << all;
  const testing::RunOutput bad = testing::RunToEnd({testing::Runfile("examples/ddp_bench"), "--step=3"});
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_EQ(bad.err, "ddp_bench: unknown flag --step; did you mean --steps? (--help lists the flags)\n");
}

// A misspelt flag or a value of the wrong type got gflags' "ERROR: unknown
// command line flag 'step'" and exit status 1 (allreduce_bench: from every
// rank it had started); now one line with the program's name, the nearest
// flag, and exit status 2.
TEST(BenchFlagsTest, AMisspeltFlagOrABadValueIsOneLineWithTheNearestFlag) {
  const testing::RunOutput nn = testing::RunToEnd({testing::Runfile("examples/nn_bench"), "--step=3"});
  EXPECT_EQ(nn.exit_code, 2) << nn.err;
  EXPECT_EQ(nn.err, "nn_bench: unknown flag --step; did you mean --steps? (--help lists the flags)\n");
  const testing::RunOutput ar =
      testing::RunToEnd({testing::Runfile("examples/allreduce_bench"), "--nproc_per_node=2", "--max_byte=1M"});
  EXPECT_EQ(ar.exit_code, 2) << ar.err;
  EXPECT_EQ(ar.err, "allreduce_bench: unknown flag --max_byte; did you mean --max_bytes? (--help lists the "
                    "flags)\n");
  const testing::RunOutput value = testing::RunToEnd({testing::Runfile("examples/nn_bench"), "--steps=many"});
  EXPECT_EQ(value.exit_code, 2) << value.err;
  EXPECT_EQ(value.err, "nn_bench: --steps=many: the flag takes a whole number\n");
}

TEST(NnBenchTest, RunsAndRefusesBatchesAndStepsOutOfRange) {
  const std::string bench = testing::Runfile("examples/nn_bench");
  const testing::RunOutput ok = testing::RunToEnd({bench, "--model=mlp", "--steps=3", "--eval=false"});
  ASSERT_EQ(ok.exit_code, 0) << ok.out << ok.err;
  const std::vector<std::string> lines = testing::Lines(ok.out);
  ASSERT_EQ(lines.size(), 1u) << ok.out;
  EXPECT_EQ(Fields(lines[0]).at(0), "mlp");

  const testing::RunOutput big = testing::RunToEnd({bench, "--steps=3", "--batch=60000"});
  EXPECT_EQ(big.exit_code, 2) << big.out << big.err;
  EXPECT_NE(big.err.find("nn_bench: --batch=60000 must be in [1, 60000): the batches are drawn from the "
                         "60000 samples of"),
            std::string::npos)
      << big.err;
  const testing::RunOutput steps = testing::RunToEnd({bench, "--steps=0"});
  EXPECT_EQ(steps.exit_code, 2) << steps.out << steps.err;
  EXPECT_EQ(steps.err, "nn_bench: --steps=0 must be at least 1\n");
  const testing::RunOutput threads = testing::RunToEnd({bench, "--threads=0"});
  EXPECT_EQ(threads.exit_code, 2) << threads.out << threads.err;
  EXPECT_EQ(threads.err, "nn_bench: --threads=0 must be in [1, 4096]\n");
  // 100,000 threads crashed the process (SIGSEGV) in the first GEMM.
  const testing::RunOutput many = testing::RunToEnd({bench, "--steps=1", "--threads=100000"});
  EXPECT_EQ(many.exit_code, 2) << many.out << many.err;
  EXPECT_EQ(many.err, "nn_bench: --threads=100000 must be in [1, 4096]\n");
  const testing::RunOutput eval_batch = testing::RunToEnd({bench, "--eval_batch=0"});
  EXPECT_EQ(eval_batch.exit_code, 2) << eval_batch.out << eval_batch.err;
  EXPECT_EQ(eval_batch.err, "nn_bench: --eval_batch=0 must be at least 1\n");
}

// A Fashion-MNIST folder whose training and test images are `train` and
// `test` pixels square (128 and 16 of them, all labels 0).
std::string FolderOfImages(const std::string& name, uint32_t train, uint32_t test) {
  const std::string dir = testing::MakeTempDir(name);
  nn::data::testing::WriteZeroIdx(dir + "/train-images-idx3-ubyte", {128, train, train});
  nn::data::testing::WriteZeroIdx(dir + "/train-labels-idx1-ubyte", {128});
  nn::data::testing::WriteZeroIdx(dir + "/t10k-images-idx3-ubyte", {16, test, test});
  nn::data::testing::WriteZeroIdx(dir + "/t10k-labels-idx1-ubyte", {16});
  return dir;
}

// An --eval_batch larger than the test set evaluates it in one batch. It
// used to size the evaluation buffers by the flag: 2,000,000,000 images of
// 28x28 floats, terabytes, so the run died after training.
TEST(NnBenchTest, AnEvalBatchLargerThanTheTestSetEvaluatesItInOneBatch) {
  const std::string dir = FolderOfImages("images_28", 28, 28);
  const testing::RunOutput r =
      testing::RunToEnd({testing::Runfile("examples/nn_bench"), "--model=mlp", "--steps=1",
                         "--batch=16", "--eval_batch=2000000000", "--data_dir=" + dir});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::vector<std::string> lines = testing::Lines(r.out);
  ASSERT_EQ(lines.size(), 1u) << r.out;
  const std::vector<std::string> f = Fields(lines[0]);
  ASSERT_EQ(f.size(), 6u) << lines[0];
  const double accuracy = std::stod(f[4]);
  EXPECT_GE(accuracy, 0) << lines[0];
  EXPECT_LE(accuracy, 1) << lines[0];
}

// The models take 1x28x28 images into fixed [batch, 1, 28, 28] tensors:
// other images are refused, naming the folder and their shape, before any
// step (before, nn_bench copied 32x32 images past the tensor's end and
// ddp_bench read the wrong pixels).
TEST(BenchDataTest, ImagesOtherThan28x28AreRefused) {
  const std::string wide = FolderOfImages("images_32", 32, 32);
  const std::string wide_test = FolderOfImages("test_images_32", 28, 32);
  for (const char* model : {"--model=mlp", "--model=cnn"}) {
    const testing::RunOutput nn = testing::RunToEnd(
        {testing::Runfile("examples/nn_bench"), model, "--steps=1", "--data_dir=" + wide});
    EXPECT_EQ(nn.exit_code, 2) << nn.out << nn.err;
    EXPECT_EQ(nn.err, "nn_bench: --data_dir=" + wide + ": the training images are [1, 32, 32]; " +
                          model + " takes Fashion-MNIST's [1, 28, 28]\n");
    EXPECT_EQ(nn.out, "");
    const testing::RunOutput ddp =
        testing::RunToEnd({testing::Runfile("examples/ddp_bench"), model, "--steps=1",
                           "--batch=16", "--nproc_per_node=2", "--data_dir=" + wide});
    EXPECT_EQ(ddp.exit_code, 2) << ddp.out << ddp.err;
    EXPECT_NE(ddp.err.find("ddp_bench: --data_dir=" + wide + ": the training images are [1, 32, 32]; " +
                           model + " takes Fashion-MNIST's [1, 28, 28]\n"),
              std::string::npos)
        << ddp.err;
    EXPECT_EQ(ddp.out, "");
  }
  // Test images are checked before training too, unless there is no evaluation.
  const testing::RunOutput nn = testing::RunToEnd(
      {testing::Runfile("examples/nn_bench"), "--model=mlp", "--steps=1", "--data_dir=" + wide_test});
  EXPECT_EQ(nn.exit_code, 2) << nn.out << nn.err;
  EXPECT_EQ(nn.err, "nn_bench: --data_dir=" + wide_test +
                        ": the test images are [1, 32, 32]; --model=mlp takes Fashion-MNIST's [1, 28, 28]\n");
  const testing::RunOutput ddp = testing::RunToEnd({testing::Runfile("examples/ddp_bench"),
                                                    "--model=mlp", "--steps=1", "--batch=16",
                                                    "--nproc_per_node=2", "--data_dir=" + wide_test});
  EXPECT_EQ(ddp.exit_code, 2) << ddp.out << ddp.err;
  EXPECT_NE(ddp.err.find("ddp_bench: --data_dir=" + wide_test + ": the test images are [1, 32, 32]"),
            std::string::npos)
      << ddp.err;
  const testing::RunOutput no_eval = testing::RunToEnd(
      {testing::Runfile("examples/nn_bench"), "--model=mlp", "--steps=1", "--batch=16",
       "--eval=false", "--data_dir=" + wide_test});
  EXPECT_EQ(no_eval.exit_code, 0) << no_eval.out << no_eval.err;
}

// Relative --data_dir and --trace_prefix are the user's (under `bazel run`,
// from $BUILD_WORKING_DIRECTORY), not the runfiles folder's the binary
// starts in.
TEST(BenchDataTest, RelativePathsAreFromTheUsersDirectory) {
  const std::string dir = testing::MakeTempDir("bench_relative");
  std::filesystem::create_directory_symlink(nn::data::kFashionMnistDebianDir, dir + "/fmnist");
  std::filesystem::create_directory(dir + "/traces");
  const std::vector<std::pair<std::string, std::string>> env = {{"BUILD_WORKING_DIRECTORY", dir}};
  const testing::RunOutput nn = testing::RunToEnd(
      {testing::Runfile("examples/nn_bench"), "--model=mlp", "--steps=1", "--eval=false",
       "--data_dir=fmnist"},
      env);
  EXPECT_EQ(nn.exit_code, 0) << nn.out << nn.err;
  const testing::RunOutput ddp = testing::RunToEnd(
      {testing::Runfile("examples/ddp_bench"), "--model=mlp", "--steps=1", "--eval=false",
       "--nproc_per_node=1", "--data_dir=./fmnist", "--trace_prefix=traces/run_"},
      env);
  EXPECT_EQ(ddp.exit_code, 0) << ddp.out << ddp.err;
  EXPECT_TRUE(std::filesystem::exists(dir + "/traces/run_rank0.json")) << ddp.out << ddp.err;
}

// The loader's message for missing files names --data_dir: the benches'
// flag is called that, as the trainer's and ddp_hello's (it was --data, so
// the advice named a flag they did not have).
TEST(BenchDataTest, MissingFilesNameTheFlagThatPointsAtThem) {
  const std::string empty = testing::MakeTempDir("bench_no_data");
  for (const std::string bench : {"nn_bench", "ddp_bench"}) {
    std::vector<std::string> args = {testing::Runfile("examples/" + bench), "--model=mlp", "--steps=1",
                                     "--data_dir=" + empty};
    if (bench == "ddp_bench") args.push_back("--nproc_per_node=1");
    const testing::RunOutput r = testing::RunToEnd(args);
    EXPECT_NE(r.exit_code, 0) << bench;
    EXPECT_NE(r.err.find(empty), std::string::npos) << bench << ": " << r.err;
    EXPECT_NE(r.err.find("--data_dir can point"), std::string::npos) << bench << ": " << r.err;
  }
}

TEST(AllreduceBenchTest, ChecksItsResultsAndRefusesSizesTheHostCannotHold) {
  const std::string bench = testing::Runfile("examples/allreduce_bench");
  const testing::RunOutput ok = testing::RunToEnd(
      {bench, "--nproc_per_node=2", "--min_bytes=4K", "--max_bytes=64K", "--step_factor=16", "--check"});
  ASSERT_EQ(ok.exit_code, 0) << ok.out << ok.err;
  int rows = 0;
  for (const std::string& line : testing::Lines(ok.out)) {
    if (line.empty() || line[0] == '#') continue;
    const std::vector<std::string> f = Fields(line);
    ASSERT_EQ(f.size(), 7u) << line;
    EXPECT_EQ(f[6], "0") << "wrong elements: " << line;
    ++rows;
  }
  EXPECT_EQ(rows, 2) << ok.out;  // 4 KiB and 64 KiB

  // 1 PiB per rank: no host here has that. In place (the default) a rank
  // holds one buffer (before, the check and its message counted two);
  // out of place, two.
  const testing::RunOutput huge = testing::RunToEnd({bench, "--nproc_per_node=2", "--max_bytes=1048576G"});
  EXPECT_EQ(huge.exit_code, 2) << huge.out << huge.err;
  EXPECT_NE(huge.err.find("allreduce_bench: --max_bytes=1048576G needs about 2097152.0 GiB on this host (one "
                          "buffer (in place) for each of its 2 ranks); it has "),
            std::string::npos)
      << huge.err;
  const testing::RunOutput huge_out = testing::RunToEnd(
      {bench, "--nproc_per_node=2", "--max_bytes=1048576G", "--in_place=false"});
  EXPECT_EQ(huge_out.exit_code, 2) << huge_out.out << huge_out.err;
  EXPECT_NE(huge_out.err.find("allreduce_bench: --max_bytes=1048576G needs about 4194304.0 GiB on this host "
                              "(a send and a receive buffer (out of place) for each of its 2 ranks); it "
                              "has "),
            std::string::npos)
      << huge_out.err;
  for (const char* bad : {"--max_bytes=nan", "--max_bytes=-1K", "--max_bytes=inf"}) {
    const testing::RunOutput r = testing::RunToEnd({bench, "--nproc_per_node=1", bad});
    EXPECT_EQ(r.exit_code, 2) << bad << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find(std::string("allreduce_bench: ") + bad + ": expected a non-negative size"),
              std::string::npos)
        << r.err;
  }
}

// With --check, a run with any wrong element fails (before, the count was
// printed and the exit status was 0, so a broken algorithm passed CI). The
// environment variable spoils one element of rank 0's all-reduce result.
TEST(AllreduceBenchTest, AWrongResultFailsTheRun) {
  const std::string bench = testing::Runfile("examples/allreduce_bench");
  const testing::RunOutput r = testing::RunToEnd(
      {bench, "--nproc_per_node=2", "--min_bytes=4K", "--max_bytes=16K", "--step_factor=4", "--check"},
      {{"ALLREDUCE_BENCH_TEST_CORRUPT", "1"}});
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  int rows = 0;
  for (const std::string& line : testing::Lines(r.out)) {
    if (line.empty() || line[0] == '#') continue;
    EXPECT_EQ(Fields(line).at(6), "1") << "wrong elements: " << line;
    ++rows;
  }
  EXPECT_EQ(rows, 2) << r.out;
  EXPECT_NE(r.err.find("allreduce_bench: --check found 2 wrong element(s) in all\n"), std::string::npos)
      << r.err;
}

// Out of place, the timed calls leave the right result in the output
// buffer: --check fills it with values it counts wrong before its own call,
// so that a checked all-reduce or reduce that writes nothing fails the run
// (before, it passed with 0 wrong). The environment variable makes every
// rank skip the checked call and take it as done.
TEST(AllreduceBenchTest, ACheckedCallThatWritesNothingOutOfPlaceFailsTheRun) {
  const std::string bench = testing::Runfile("examples/allreduce_bench");
  for (const char* collective : {"--collective=allreduce", "--collective=reduce"}) {
    const testing::RunOutput r = testing::RunToEnd(
        {bench, "--nproc_per_node=2", collective, "--in_place=false", "--min_bytes=4K",
         "--max_bytes=4K", "--check"},
        {{"ALLREDUCE_BENCH_TEST_SKIP_CHECKED_CALL", "1"}});
    EXPECT_EQ(r.exit_code, 1) << collective << "\n" << r.out << r.err;
    // 1024 f32s on each of the 2 ranks for the all-reduce; on the root only
    // for the reduce.
    const std::string wrong = std::string(collective) == "--collective=reduce" ? "1024" : "2048";
    EXPECT_NE(r.err.find("allreduce_bench: --check found " + wrong + " wrong element(s) in all\n"),
              std::string::npos)
        << collective << "\n" << r.err;
  }
}

// Broadcast's check starts the other ranks from values unlike the root's
// (their own inputs: with --op=prod rank 2's equal rank 0's, so a broadcast
// that wrote nothing there passed). Every rank skips the checked call: both
// non-root ranks count all 1024 elements wrong (before, rank 1 only).
TEST(AllreduceBenchTest, ABroadcastThatWritesNothingIsWrongOnEveryOtherRank) {
  const std::string bench = testing::Runfile("examples/allreduce_bench");
  for (const char* dtype : {"--dtype=f32", "--dtype=i32"}) {
    const testing::RunOutput r = testing::RunToEnd(
        {bench, "--nproc_per_node=3", "--collective=broadcast", "--op=prod", dtype, "--min_bytes=4K",
         "--max_bytes=4K", "--check"},
        {{"ALLREDUCE_BENCH_TEST_SKIP_CHECKED_CALL", "1"}});
    EXPECT_EQ(r.exit_code, 1) << dtype << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find("allreduce_bench: --check found 2048 wrong element(s) in all\n"), std::string::npos)
        << dtype << "\n" << r.err;
  }
}

// --time_of=rank0 prints rank 0's own mean time, the statistic the MPI and
// gloo all-reduce peers print (the default, the slowest rank's, was put
// beside theirs as like for like), and says so in the header; another
// value is refused, naming the flag.
TEST(AllreduceBenchTest, TimeOfRankZeroIsOfferedAndSaidInTheHeader) {
  const std::string bench = testing::Runfile("examples/allreduce_bench");
  const testing::RunOutput r = testing::RunToEnd(
      {bench, "--nproc_per_node=2", "--min_bytes=4K", "--max_bytes=4K", "--time_of=rank0", "--check"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::vector<std::string> lines = testing::Lines(r.out);
  ASSERT_EQ(lines.size(), 3u) << r.out;
  EXPECT_NE(lines[0].find(", time_us of rank 0"), std::string::npos) << lines[0];
  EXPECT_EQ(Fields(lines[2]).at(0), "4096") << lines[2];
  const testing::RunOutput slowest = testing::RunToEnd(
      {bench, "--nproc_per_node=2", "--min_bytes=4K", "--max_bytes=4K"});
  ASSERT_EQ(slowest.exit_code, 0) << slowest.out << slowest.err;
  EXPECT_EQ(slowest.out.find("time_us of rank 0"), std::string::npos) << slowest.out;
  const testing::RunOutput bad = testing::RunToEnd({bench, "--nproc_per_node=2", "--time_of=mean"});
  EXPECT_EQ(bad.exit_code, 2) << bad.out << bad.err;
  EXPECT_NE(bad.err.find("allreduce_bench: --time_of=mean is not recognised; expected slowest or rank0\n"),
            std::string::npos)
      << bad.err;
}

// A --max_bytes below the smallest message (one element; one per rank for
// all-to-all, gather and scatter) is refused, naming it (before, nothing
// was measured and the run exited 0). Sizes that round to the previous
// row's message are not printed twice.
TEST(AllreduceBenchTest, AMaxBytesBelowOneElementIsRefusedAndNoSizeIsPrintedTwice) {
  const std::string bench = testing::Runfile("examples/allreduce_bench");
  const std::vector<std::pair<std::vector<std::string>, std::string>> refused = {
      {{"--nproc_per_node=1", "--dtype=f64", "--max_bytes=4"},
       "allreduce_bench: --max_bytes=4 is less than one --dtype=f64 element (8 bytes): nothing "
       "would be measured\n"},
      {{"--nproc_per_node=1", "--min_bytes=0", "--max_bytes=2"},
       "allreduce_bench: --max_bytes=2 is less than one --dtype=f32 element (4 bytes): nothing "
       "would be measured\n"},
      {{"--nproc_per_node=2", "--collective=alltoall", "--max_bytes=4"},
       "allreduce_bench: --max_bytes=4 is less than one --dtype=f32 element per rank, which "
       "--collective=alltoall moves at least (2 ranks, 8 bytes): nothing would be measured\n"},
  };
  for (const auto& [flags, message] : refused) {
    std::vector<std::string> argv = {bench};
    argv.insert(argv.end(), flags.begin(), flags.end());
    const testing::RunOutput r = testing::RunToEnd(argv);
    EXPECT_EQ(r.exit_code, 2) << flags.back() << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
    EXPECT_EQ(testing::Lines(r.out).size(), 0u) << r.out;
  }
  // 4, 8, 16, 32 and 64 bytes over 2 ranks: blocks of 1, 1, 2, 4 and 8 f32s.
  for (const char* collective : {"alltoall", "gather", "scatter"}) {
    const testing::RunOutput r = testing::RunToEnd(
        {bench, "--nproc_per_node=2", std::string("--collective=") + collective, "--min_bytes=4",
         "--max_bytes=64", "--step_factor=2", "--check"});
    ASSERT_EQ(r.exit_code, 0) << collective << "\n" << r.out << r.err;
    std::vector<std::string> bytes;
    for (const std::string& line : testing::Lines(r.out)) {
      if (line.empty() || line[0] == '#') continue;
      bytes.push_back(Fields(line).at(0));
    }
    EXPECT_EQ(bytes, (std::vector<std::string>{"8", "16", "32", "64"})) << collective << "\n" << r.out;
  }
}

// Broadcast's input is filled for --op (prod uses 1s and 2s) and must be
// checked for it too (before, it was checked as a sum: every element of
// --op=prod counted wrong). Collectives that reduce nothing refuse an --op
// rather than print it in the header and ignore it.
TEST(AllreduceBenchTest, BroadcastChecksItsInputForTheOpAndMovingCollectivesRefuseAnOp) {
  const std::string bench = testing::Runfile("examples/allreduce_bench");
  for (const char* op : {"--op=prod", "--op=max", "--op=avg"}) {
    const testing::RunOutput r =
        testing::RunToEnd({bench, "--nproc_per_node=2", "--collective=broadcast", op,
                           "--min_bytes=4K", "--max_bytes=4K", "--check"});
    ASSERT_EQ(r.exit_code, 0) << op << "\n" << r.out << r.err;
    int rows = 0;
    for (const std::string& line : testing::Lines(r.out)) {
      if (line.empty() || line[0] == '#') continue;
      const std::vector<std::string> f = Fields(line);
      ASSERT_EQ(f.size(), 7u) << line;
      EXPECT_EQ(f[6], "0") << op << ": wrong elements: " << line;
      ++rows;
    }
    EXPECT_EQ(rows, 1) << r.out;
  }
  for (const char* collective : {"alltoall", "gather", "scatter"}) {
    const testing::RunOutput r = testing::RunToEnd(
        {bench, "--nproc_per_node=2", std::string("--collective=") + collective, "--op=max",
         "--min_bytes=4K", "--max_bytes=4K"});
    EXPECT_EQ(r.exit_code, 2) << collective << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find(std::string("allreduce_bench: --op=max does not apply to --collective=") +
                         collective + ", which reduces nothing; drop --op"),
              std::string::npos)
        << r.err;
    EXPECT_EQ(r.out, "") << collective;
  }
}

// A --step_factor that does not grow the size finitely is refused, naming
// it (before, nan and inf passed the "<= 1" check and ran one size).
TEST(AllreduceBenchTest, AStepFactorThatIsNotFiniteAndAboveOneIsRefused) {
  const std::string bench = testing::Runfile("examples/allreduce_bench");
  for (const std::string value : {"nan", "inf", "-inf", "1", "0.5"}) {
    const testing::RunOutput r = testing::RunToEnd(
        {bench, "--nproc_per_node=1", "--min_bytes=4K", "--max_bytes=4K", "--step_factor=" + value});
    EXPECT_EQ(r.exit_code, 2) << value << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find("allreduce_bench: --step_factor=" + value +
                         " must be a finite number greater than 1\n"),
              std::string::npos)
        << r.err;
    EXPECT_EQ(r.out, "") << value;
  }
}

// The header's buffer mode is the one used (before, it followed --in_place:
// "in place" for all-to-all, gather and scatter, which never are, and "out
// of place" for broadcast, which always is).
TEST(AllreduceBenchTest, TheHeaderShowsTheBufferModeUsed) {
  const std::string bench = testing::Runfile("examples/allreduce_bench");
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--collective=allreduce"}, ", in place,"},
      {{"--collective=allreduce", "--in_place=false"}, ", out of place,"},
      {{"--collective=reduce", "--in_place=false"}, ", out of place,"},
      {{"--collective=broadcast", "--in_place=false"}, ", in place,"},
      {{"--collective=alltoall"}, ", out of place,"},
      {{"--collective=gather"}, ", out of place,"},
      {{"--collective=scatter", "--in_place=true"}, ", out of place,"},
  };
  for (const auto& [flags, mode] : cases) {
    std::vector<std::string> argv = {bench, "--nproc_per_node=2", "--min_bytes=4K",
                                     "--max_bytes=4K", "--check"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    const testing::RunOutput r = testing::RunToEnd(argv);
    ASSERT_EQ(r.exit_code, 0) << flags[0] << "\n" << r.out << r.err;
    const std::vector<std::string> lines = testing::Lines(r.out);
    ASSERT_EQ(lines.size(), 3u) << r.out;
    EXPECT_NE(lines[0].find(mode), std::string::npos) << flags.back() << ": " << lines[0];
    EXPECT_EQ(Fields(lines[2]).at(6), "0") << flags[0] << ": wrong elements: " << lines[2];
  }
}

// --algo chooses all-reduce's and reduce's algorithm; --root is the root of
// broadcast, reduce, gather and scatter. Elsewhere they are refused, naming
// the flag (before, they were accepted and ignored). Broadcast goes from
// --root (before, always from rank 0), and --check expects the root's input.
TEST(AllreduceBenchTest, AlgoAndRootAreRefusedWhereTheyDoNotApplyAndBroadcastHonoursRoot) {
  const std::string bench = testing::Runfile("examples/allreduce_bench");
  for (const char* collective : {"broadcast", "alltoall", "gather", "scatter"}) {
    const testing::RunOutput r = testing::RunToEnd(
        {bench, "--nproc_per_node=2", std::string("--collective=") + collective, "--algo=ring",
         "--min_bytes=4K", "--max_bytes=4K"});
    EXPECT_EQ(r.exit_code, 2) << collective << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find(std::string("allreduce_bench: --algo=ring does not apply to --collective=") +
                         collective + ", which has one algorithm; drop --algo\n"),
              std::string::npos)
        << r.err;
    EXPECT_EQ(r.out, "") << collective;
  }
  const testing::RunOutput rhd = testing::RunToEnd(
      {bench, "--nproc_per_node=2", "--collective=reduce", "--algo=rhd", "--min_bytes=4K",
       "--max_bytes=4K"});
  EXPECT_EQ(rhd.exit_code, 2) << rhd.out << rhd.err;
  EXPECT_NE(rhd.err.find("allreduce_bench: --algo=rhd does not apply to --collective=reduce, which "
                         "runs auto, tree, ring or shm\n"),
            std::string::npos)
      << rhd.err;
  for (const char* collective : {"allreduce", "alltoall"}) {
    const testing::RunOutput r = testing::RunToEnd(
        {bench, "--nproc_per_node=2", std::string("--collective=") + collective, "--root=1",
         "--min_bytes=4K", "--max_bytes=4K"});
    EXPECT_EQ(r.exit_code, 2) << collective << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find(std::string("allreduce_bench: --root=1 does not apply to --collective=") +
                         collective + ", which has no root; drop --root\n"),
              std::string::npos)
        << r.err;
    EXPECT_EQ(r.out, "") << collective;
  }
  for (const char* op : {"--op=sum", "--op=prod"}) {
    const testing::RunOutput r =
        testing::RunToEnd({bench, "--nproc_per_node=2", "--collective=broadcast", "--root=1", op,
                           "--min_bytes=4K", "--max_bytes=4K", "--check"});
    ASSERT_EQ(r.exit_code, 0) << op << "\n" << r.out << r.err;
    const std::vector<std::string> lines = testing::Lines(r.out);
    ASSERT_EQ(lines.size(), 3u) << r.out;
    EXPECT_EQ(Fields(lines[2]).at(6), "0") << op << ": wrong elements: " << lines[2];
  }
  const testing::RunOutput outside = testing::RunToEnd(
      {bench, "--nproc_per_node=2", "--collective=broadcast", "--root=2", "--min_bytes=4K",
       "--max_bytes=4K"});
  EXPECT_EQ(outside.exit_code, 2) << outside.out << outside.err;
  EXPECT_NE(outside.err.find("allreduce_bench: --root=2 is outside [0, 2)\n"), std::string::npos)
      << outside.err;
}

}  // namespace
}  // namespace ddp::examples
