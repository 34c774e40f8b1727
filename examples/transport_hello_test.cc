// //examples:transport_hello, the smallest program on //transport alone:
// its ranks all-reduce their rank numbers and rank 0 prints the sum (the
// program itself exits 1 when the sum is wrong).

#include <string>

#include "examples/testing/subprocess.h"
#include "gtest/gtest.h"

namespace ddp::examples {
namespace {

TEST(TransportHelloTest, RanksSumTheirNumbers) {
  for (int n : {1, 2, 4}) {
    const testing::RunOutput r = testing::RunToEnd(
        {testing::Runfile("examples/transport_hello"), "--nproc_per_node=" + std::to_string(n)});
    ASSERT_EQ(r.exit_code, 0) << n << " ranks\n" << r.out << r.err;
    const std::string prefix = n > 1 ? "[0] " : "";
    EXPECT_EQ(r.out, prefix + "hello from " + std::to_string(n) + " ranks: 0 + 1 + ... + " +
                         std::to_string(n - 1) + " = " + std::to_string(n * (n - 1) / 2) + "\n");
  }
}

// Anything but --nproc_per_node is refused with the usage line, and --help
// prints it; before, both were ignored and the program ran on one rank.
TEST(TransportHelloTest, AnUnknownArgumentIsRefusedAndHelpPrintsTheUsage) {
  const std::string hello = testing::Runfile("examples/transport_hello");
  const testing::RunOutput typo = testing::RunToEnd({hello, "--nprocs=2"});
  EXPECT_EQ(typo.exit_code, 2) << typo.out << typo.err;
  EXPECT_NE(typo.err.find("transport_hello: unknown argument '--nprocs=2'\n"
                          "usage: transport_hello [--nproc_per_node=N]\n"),
            std::string::npos)
      << typo.err;
  EXPECT_EQ(typo.out, "");
  const testing::RunOutput help = testing::RunToEnd({hello, "--help"});
  EXPECT_EQ(help.exit_code, 0) << help.out << help.err;
  EXPECT_EQ(help.out, "usage: transport_hello [--nproc_per_node=N]\n");
}

}  // namespace
}  // namespace ddp::examples
