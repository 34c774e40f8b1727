#include "transport/algorithms/disagreement_test_util.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ddp::transport::algorithms::testing {

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

}  // namespace ddp::transport::algorithms::testing
