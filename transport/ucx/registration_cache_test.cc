#include "transport/ucx/registration_cache.h"

#include <gtest/gtest.h>

#include <vector>

#include "transport/ucx/resources.h"

namespace ddp::transport::ucx {
namespace {

TEST(RegistrationCache, FindsContainingRegionOnly) {
  auto context = Context::Create({.default_tls = "sm,self"});
  ASSERT_TRUE(context.ok()) << context.status();
  RegistrationCache cache;
  cache.set_context((*context)->get());
  std::vector<char> a(1 << 20), b(1 << 16);
  ASSERT_TRUE(cache.Register(a.data(), a.size()).ok());
  ASSERT_TRUE(cache.Register(b.data(), b.size()).ok());
  EXPECT_EQ(cache.regions(), 2u);
  EXPECT_NE(cache.Find(a.data(), a.size()), nullptr);
  EXPECT_NE(cache.Find(a.data() + 100, 1000), nullptr);
  EXPECT_NE(cache.Find(a.data(), a.size()), cache.Find(b.data(), b.size()));
  EXPECT_EQ(cache.Find(a.data() + 1, a.size()), nullptr);  // runs past the end
  std::vector<char> c(10);
  EXPECT_EQ(cache.Find(c.data(), c.size()), nullptr);
  cache.Clear();
  EXPECT_EQ(cache.Find(a.data(), 10), nullptr);
}

TEST(RegistrationCache, RejectsOverlapAndEmpty) {
  auto context = Context::Create({.default_tls = "sm,self"});
  ASSERT_TRUE(context.ok()) << context.status();
  RegistrationCache cache;
  cache.set_context((*context)->get());
  std::vector<char> a(1 << 16);
  ASSERT_TRUE(cache.Register(a.data() + 4096, 4096).ok());
  Status overlap = cache.Register(a.data(), 8192);
  EXPECT_EQ(overlap.code(), StatusCode::kInvalidArgument) << overlap;
  EXPECT_EQ(cache.Register(a.data() + 6000, 100).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Register(a.data(), 0).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(cache.Register(a.data(), 4096).ok());  // adjacent is fine
}

TEST(RegistrationCache, NeedsContext) {
  RegistrationCache cache;
  char x[8];
  EXPECT_EQ(cache.Register(x, 8).code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace ddp::transport::ucx
