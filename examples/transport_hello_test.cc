// //examples:transport_hello, the smallest program on //transport alone:
// its ranks all-reduce their rank numbers and rank 0 prints the sum (the
// program itself exits 1 when the sum is wrong).

#include <string>
#include <utility>
#include <vector>

#include "examples/testing/subprocess.h"
#include "gtest/gtest.h"

namespace ddp::examples {
namespace {

// The sum is written out as it is: "0 + 1 + ... + 1" on two ranks and
// "1 ranks: 0 + 1 + ... + 0" on one were printed before.
TEST(TransportHelloTest, RanksSumTheirNumbers) {
  const std::vector<std::pair<int, std::string>> cases = {
      {1, "0 = 0"}, {2, "0 + 1 = 1"}, {3, "0 + 1 + 2 = 3"}, {4, "0 + 1 + ... + 3 = 6"}};
  for (const auto& [n, sum] : cases) {
    const testing::RunOutput r = testing::RunToEnd(
        {testing::Runfile("examples/transport_hello"), "--nproc_per_node=" + std::to_string(n)});
    ASSERT_EQ(r.exit_code, 0) << n << " ranks\n" << r.out << r.err;
    const std::string prefix = n > 1 ? "[0] " : "";
    EXPECT_EQ(r.out, prefix + "hello from " + std::to_string(n) + (n == 1 ? " rank: " : " ranks: ") + sum + "\n");
  }
}

// Anything but --nproc_per_node is refused with the usage, and --help
// prints it; before, both were ignored and the program ran on one rank.
// Both happen once, before any rank starts: every rank of
// --nproc_per_node=3 used to start and refuse the typo (three errors and the
// launcher's line), and --help was printed by every rank.
TEST(TransportHelloTest, AnUnknownArgumentIsRefusedOnceAndHelpPrintsTheUsage) {
  const std::string hello = testing::Runfile("examples/transport_hello");
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--nprocs=2"}, {"--nproc_per_node=3", "--nprocs=2"}}) {
    std::vector<std::string> argv = {hello};
    argv.insert(argv.end(), args.begin(), args.end());
    const testing::RunOutput typo = testing::RunToEnd(argv);
    EXPECT_EQ(typo.exit_code, 2) << args.size() << "\n" << typo.out << typo.err;
    EXPECT_EQ(typo.err,
              "transport_hello: unknown argument '--nprocs=2'; usage: transport_hello [--nproc_per_node=N]\n");
    EXPECT_EQ(typo.out, "");
  }
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--help"}, {"--nproc_per_node=2", "-h"}}) {
    std::vector<std::string> argv = {hello};
    argv.insert(argv.end(), args.begin(), args.end());
    const testing::RunOutput help = testing::RunToEnd(argv);
    EXPECT_EQ(help.exit_code, 0) << help.out << help.err;
    EXPECT_EQ(help.out, "usage: transport_hello [--nproc_per_node=N]\n");
    EXPECT_EQ(help.err, "");
  }
}

}  // namespace
}  // namespace ddp::examples
