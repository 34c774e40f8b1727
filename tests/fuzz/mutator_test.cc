#include "tests/fuzz/mutator.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

namespace ddp::fuzz {
namespace {

TEST(MutatorTest, SameSeedGivesTheSameMutants) {
  Mutator a({"hello world", "\x00\x01\x02\x03"}, 42);
  Mutator b({"hello world", "\x00\x01\x02\x03"}, 42);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(a.Next(), b.Next()) << "mutant " << i;
}

TEST(MutatorTest, MutantsDifferFromTheirBasesAndFromEachOther) {
  const std::string base(64, 'a');
  Mutator m({base}, 7);
  std::set<std::string> seen;
  int changed = 0;
  for (int i = 0; i < 1000; ++i) {
    const std::string s = m.Next();
    changed += s != base;
    seen.insert(s);
  }
  EXPECT_GT(changed, 950);
  EXPECT_GT(seen.size(), 800u);
}

TEST(MutatorTest, MutantsStayWithinTheSizeBound) {
  Mutator m({std::string(100, 'x')}, 3, /*max_size=*/120);
  for (int i = 0; i < 2000; ++i) ASSERT_LE(m.Next().size(), 120u);
}

TEST(MutatorTest, EmptyCorpusStillMutates) {
  Mutator m({}, 1);
  bool grew = false;
  for (int i = 0; i < 100; ++i) grew |= !m.Next().empty();
  EXPECT_TRUE(grew);
}

}  // namespace
}  // namespace ddp::fuzz
