#include "transport/algorithms/disagreement_test_util.h"

#include <chrono>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transport/testing/thread_harness.h"

namespace ddp::transport::algorithms::testing {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

void ExpectEveryRankNamesTheOddRank(const std::vector<Status>& statuses, int odd, const std::string& odd_value,
                                    const std::string& rest_value, const std::vector<int>& written,
                                    const std::string& what) {
  for (size_t r = 0; r < statuses.size(); ++r) {
    const Status& s = statuses[r];
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << what << ": rank " << r << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr("disagree")) << what << ": rank " << r;
    EXPECT_THAT(s.message(), HasSubstr("rank " + std::to_string(odd) + " passed")) << what << ": rank " << r;
    EXPECT_THAT(s.message(), HasSubstr(odd_value)) << what << ": rank " << r;
    EXPECT_THAT(s.message(), HasSubstr(rest_value)) << what << ": rank " << r;
    EXPECT_EQ(written[r], 0) << what << ": rank " << r << " had its recv written";
  }
}

void ExpectOddCollectiveStopsEveryRank(int world, int odd, const CollectiveCall& run_odd,
                                       const std::string& odd_name, const CollectiveCall& run_rest,
                                       const std::string& rest_name) {
  ::ddp::transport::testing::HarnessOptions options;
  options.kill_on_error = false;
  std::vector<Clock::duration> took(world);
  auto statuses = ::ddp::transport::testing::RunRanks(
      world,
      [&](p2p::PointToPoint& p2p) -> Status {
        CollectiveArgs args;
        args.tag = CollectiveTag(3);
        args.call_id = 7;
        const auto start = Clock::now();
        args.deadline = start + 30s;
        const Status status = p2p.rank() == odd ? run_odd(p2p, args) : run_rest(p2p, args);
        took[p2p.rank()] = Clock::now() - start;
        return status;
      },
      options);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(statuses[r].code(), StatusCode::kInvalidArgument) << "rank " << r << ": "
                                                                << statuses[r];
    EXPECT_THAT(statuses[r].message(), HasSubstr(odd_name)) << "rank " << r;
    EXPECT_THAT(statuses[r].message(), HasSubstr(rest_name)) << "rank " << r;
    EXPECT_LT(took[r], 15s) << "rank " << r << ": " << statuses[r];
  }
}

}  // namespace ddp::transport::algorithms::testing
