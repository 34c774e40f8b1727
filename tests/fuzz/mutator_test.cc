#include "tests/fuzz/mutator.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

namespace ddp::fuzz {
namespace {

// A binary entry, NUL bytes included (a const char* would end at the first).
const std::string kBinary("\x00\x01\x02\x03", 4);

TEST(MutatorTest, SameSeedGivesTheSameMutants) {
  ASSERT_EQ(kBinary.size(), 4u);
  Mutator a({"hello world", kBinary}, 42);
  Mutator b({"hello world", kBinary}, 42);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(a.Next(), b.Next()) << "mutant " << i;
}

// The binary entry is a base of its own: with the same seed, a corpus whose
// second entry is those four bytes gives other mutants than one whose second
// entry is empty (what the bytes would be through a const char*), and some
// of its mutants keep NUL bytes.
TEST(MutatorTest, BinaryEntryIsMutatedAsItsBytes) {
  Mutator with_bytes({"hello world", kBinary}, 42);
  Mutator with_empty({"hello world", std::string()}, 42);
  int differ = 0, with_nul = 0;
  for (int i = 0; i < 1000; ++i) {
    const std::string s = with_bytes.Next();
    differ += s != with_empty.Next();
    with_nul += i % 2 == 1 && s.find('\0') != std::string::npos;
  }
  EXPECT_GT(differ, 100);
  EXPECT_GT(with_nul, 100);
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
