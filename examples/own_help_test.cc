// FlagProblem and ShowOwnHelpIfAsked against the flags of this file, in
// every spelling gflags takes: what passes must parse, and what gflags
// would refuse in its own words (exit status 1, no program named) is said
// here in one line instead.

#include "examples/own_help.h"

#include <gflags/gflags.h>
#include <stdlib.h>

#include <string>
#include <vector>

#include "gtest/gtest.h"

DEFINE_uint64(seed, 0, "a seed");
DEFINE_string(model, "cnn", "a model");
DEFINE_bool(zero, false, "a bool");

namespace ddp::examples {
namespace {

constexpr char kSource[] = "examples/own_help_test";

// FlagProblem for `args` after a program name.
std::string Problem(std::vector<std::string> args) {
  args.insert(args.begin(), "own_help_test");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  return FlagProblem(static_cast<int>(args.size()), argv.data(), kSource);
}

bool HelpAsked(std::vector<std::string> args) {
  args.insert(args.begin(), "own_help_test");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  return ShowOwnHelpIfAsked(static_cast<int>(args.size()), argv.data(), kSource);
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

  setenv("FLAGS_seed", "-1", 1);
  EXPECT_EQ(Problem({"--tryfromenv=seed"}),
            "--tryfromenv=seed: FLAGS_seed=-1: the flag takes a whole number, at least 0");
  setenv("FLAGS_seed", "99999999999999999999", 1);
  EXPECT_EQ(Problem({"--fromenv=seed"}),
            "--fromenv=seed: FLAGS_seed=99999999999999999999 is out of range: the flag takes a whole number from 0 "
            "to 18446744073709551615");
  setenv("FLAGS_seed", "fromenv", 1);
  EXPECT_EQ(Problem({"--fromenv=seed"}),
            "--fromenv=seed: FLAGS_seed=fromenv is refused by gflags (it would read the environment again)");
  // The second name is checked too; a comma at the end ends the list, as
  // gflags reads it.
  setenv("FLAGS_seed", "7", 1);
  EXPECT_EQ(Problem({"--fromenv=seed,model"}),
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

}  // namespace
}  // namespace ddp::examples
