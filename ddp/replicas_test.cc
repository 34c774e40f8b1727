// The replica description DDP compares across ranks at construction: a
// tensor's GPU index is not part of it (one process per GPU puts rank r's
// replica on cuda:r), its GPU's order of first appearance is;
// BroadcastCoalesced's groups come in the order of their first tensor, not
// of the device index.

#include "ddp/replicas.h"

#include <gtest/gtest.h>

#include <chrono>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "ddp/testing/ddp_test_util.h"
#include "nn/tensor/allocator.h"

namespace ddp::dist::internal {
namespace {

// Metadata only: DescribeTensor never reads the memory behind it.
nn::Tensor On(float* storage, nn::Device device) {
  return nn::Tensor::FromBlob(storage, {2, 2}, nn::DType::kFloat32, device);
}

// Descriptions of one rank's parameters, as DDP makes them.
std::vector<std::string> Describe(const std::vector<nn::Tensor>& params) {
  GpuOrder gpus;
  std::vector<std::string> out;
  for (const nn::Tensor& p : params) out.push_back(DescribeTensor(p, true, gpus));
  return out;
}

TEST(DescribeTensorTest, GpuIndexIsNotPartOfTheDescription) {
  float storage[4] = {};
  const std::vector<std::string> gpu0 = Describe({On(storage, nn::Device(nn::DeviceType::kCUDA, 0))});
  const std::vector<std::string> gpu1 = Describe({On(storage, nn::Device(nn::DeviceType::kCUDA, 1))});
  const std::vector<std::string> cpu = Describe({On(storage, nn::kCPU)});
  EXPECT_EQ(gpu0, gpu1);
  EXPECT_EQ(gpu0.at(0), "f32 [2, 2] strides [2, 1] on cuda#0 no-grad");
  EXPECT_EQ(cpu.at(0), "f32 [2, 2] strides [2, 1] no-grad");
}

// Rank 0 has every parameter on cuda:0; rank 1 has its first layer on
// cuda:0 and the rest on cuda:1. BroadcastCoalesced and the Reducer form
// one group per GPU and pair the groups by position, so these ranks would
// pair broadcasts of different sizes: their descriptions must differ, from
// the first parameter on the second GPU on. Before, both were "on cuda" and
// VerifyReplicas let them through. The same split over other GPUs (cuda:3,
// then cuda:0) is the same model.
TEST(DescribeTensorTest, GpusAreNumberedInTheOrderTheyFirstAppear) {
  float storage[4] = {};
  const nn::Device gpu0(nn::DeviceType::kCUDA, 0), gpu1(nn::DeviceType::kCUDA, 1), gpu3(nn::DeviceType::kCUDA, 3);
  const std::vector<nn::Tensor> all_on_0 = {On(storage, gpu0), On(storage, gpu0), On(storage, gpu0)};
  const std::vector<nn::Tensor> split = {On(storage, gpu0), On(storage, gpu1), On(storage, gpu1)};
  ASSERT_NE(GroupByDtypeAndDevice(all_on_0), GroupByDtypeAndDevice(split));
  const std::vector<std::string> rank0 = Describe(all_on_0), rank1 = Describe(split);
  EXPECT_EQ(rank0[0], rank1[0]);
  EXPECT_EQ(rank0[1], "f32 [2, 2] strides [2, 1] on cuda#0 no-grad");
  EXPECT_EQ(rank1[1], "f32 [2, 2] strides [2, 1] on cuda#1 no-grad");
  EXPECT_EQ(rank1[2], rank1[1]);
  EXPECT_EQ(Describe({On(storage, gpu3), On(storage, gpu0), On(storage, gpu0)}), rank1);
  // A CPU tensor between them takes no number.
  EXPECT_EQ(Describe({On(storage, gpu3), On(storage, nn::kCPU), On(storage, gpu0)})[2], rank1[1]);
}

// BroadcastCoalesced's groups are paired across ranks by position. Ordered
// by device index, a model whose first part is on cuda:1 and second on
// cuda:0 on one rank (cuda:0 then cuda:1 on another, which VerifyReplicas
// accepts) sent its first part's values into the other rank's second part.
// In the order of first appearance, both ranks list the first part first.
TEST(GroupByDtypeAndDeviceTest, GroupsComeInTheOrderOfTheirFirstTensor) {
  float storage[4] = {};
  const nn::Device gpu0(nn::DeviceType::kCUDA, 0), gpu1(nn::DeviceType::kCUDA, 1);
  const nn::Tensor empty = nn::Tensor::FromBlob(storage, {0}, nn::DType::kFloat32, gpu0);
  const nn::Tensor half = nn::Tensor::FromBlob(storage, {2, 2}, nn::DType::kBFloat16, gpu1);
  // Rank A: first part on cuda:1, second on cuda:0; rank B the other way.
  const std::vector<std::vector<size_t>> a =
      GroupByDtypeAndDevice({On(storage, gpu1), empty, On(storage, gpu0), half, On(storage, gpu1)});
  const std::vector<std::vector<size_t>> b =
      GroupByDtypeAndDevice({On(storage, gpu0), empty, On(storage, gpu1), half, On(storage, gpu0)});
  // The empty tensor is in no group; bf16 on cuda:1 is a group of its own.
  const std::vector<std::vector<size_t>> expected = {{0, 4}, {2}, {3}};
  EXPECT_EQ(a, expected);
  EXPECT_EQ(b, expected);
  // A CPU tensor after the GPU ones comes after them.
  EXPECT_EQ(GroupByDtypeAndDevice({On(storage, gpu0), On(storage, nn::kCPU)}),
            (std::vector<std::vector<size_t>>{{0}, {1}}));
}

// ---------------------------------------------- the mismatch message ----

// One rank's entries: `count` parameters "layer<i>.weight" f32 [4, 4], and
// one option.
std::vector<ReplicaEntry> Model(int count) {
  std::vector<ReplicaEntry> entries;
  for (int i = 0; i < count; ++i) {
    entries.push_back({"parameter", "layer" + std::to_string(i) + ".weight", "f32 [4, 4] strides [4, 1]"});
  }
  entries.push_back({"option", "bucket_cap_mb", "25"});
  return entries;
}

size_t Occurrences(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

// The sentence naming a missing parameter comes once, naming every rank
// that lacks it, however many ranks have it.
TEST(ExplainReplicaDifferenceTest, AMissingNameIsSaidOnce) {
  std::vector<std::vector<ReplicaEntry>> ranks(8, Model(3));
  ranks[5].erase(ranks[5].begin() + 2);  // no layer2.weight on rank 5
  std::string m = ExplainReplicaDifference(ranks, "Models differ.");
  EXPECT_EQ(Occurrences(m, "has no parameter named"), 1u) << m;
  EXPECT_NE(m.find(" Rank 5 has no parameter named `layer2.weight`."), std::string::npos) << m;
  EXPECT_NE(m.find("rank 5 has no parameter #2 (it has 2 parameters)"), std::string::npos) << m;

  // Ranks 0 and 3 lack it: one sentence names both, though six ranks have it.
  ranks.assign(8, Model(3));
  ranks[0].erase(ranks[0].begin() + 1);
  ranks[3].erase(ranks[3].begin() + 1);
  m = ExplainReplicaDifference(ranks, "Models differ.");
  EXPECT_EQ(Occurrences(m, "no parameter named"), 1u) << m;
  EXPECT_NE(m.find(" Ranks 0, 3 have no parameter named `layer1.weight`."), std::string::npos) << m;
  EXPECT_NE(m.find("First difference at parameter #1: ranks 0, 3 have `layer2.weight`"), std::string::npos) << m;
}

// A rank with no parameters at all, beside ranks with some.
TEST(ExplainReplicaDifferenceTest, ARankWithNoParameters) {
  std::vector<std::vector<ReplicaEntry>> ranks = {Model(2), Model(0), Model(2)};
  const std::string m = ExplainReplicaDifference(ranks, "Models differ.");
  EXPECT_EQ(m.rfind("Models differ. First difference at parameter #0: ranks 0, 2 have `layer0.weight` f32 [4, 4] "
                    "strides [4, 1]; rank 1 has no parameter #0 (it has 0 parameters).",
                    0),
            0u)
      << m;
  EXPECT_NE(m.find("Counts: ranks 0, 2 have 2 parameters; rank 1 has 0 parameters."), std::string::npos) << m;
  EXPECT_EQ(Occurrences(m, " Rank 1 has no parameter named `layer0.weight`."), 1u) << m;
}

// Many parameters on many ranks, with very long names: the first
// difference is found deep in the list and every name is given whole.
TEST(ExplainReplicaDifferenceTest, ManyParametersWithLongNames) {
  const std::string prefix(1000, 'p');
  std::vector<ReplicaEntry> model;
  for (int i = 0; i < 3000; ++i) {
    model.push_back({"parameter", prefix + "." + std::to_string(i), "f32 [8] strides [1]"});
  }
  std::vector<std::vector<ReplicaEntry>> ranks(16, model);
  ranks[9][2345].value = "f32 [9] strides [1]";
  ranks[12].pop_back();
  const std::string m = ExplainReplicaDifference(ranks, "Models differ.");
  EXPECT_NE(m.find("First difference at parameter #2345: ranks 0-8, 10-15 have `" + prefix +
                   ".2345` f32 [8] strides [1]; rank 9 has `" + prefix + ".2345` f32 [9] strides [1]. They differ "
                   "in shape."),
            std::string::npos)
      << m;
  // The count differs too (rank 12), but #2345 comes first, and its name is on every rank.
  EXPECT_NE(m.find("Counts: ranks 0-11, 13-15 have 3000 parameters; rank 12 has 2999 parameters."),
            std::string::npos);
  EXPECT_EQ(Occurrences(m, "no parameter named"), 0u);
}

// 1024 ranks with the same model of long names, one rank with another
// shape: the ranks are named in two groups and the message stays a few KB.
// It named every rank with its entry, over 1 MB, thrown on every rank.
TEST(ExplainReplicaDifferenceTest, ManyRanksAreNamedInGroups) {
  const std::string prefix(1000, 'p');
  std::vector<ReplicaEntry> model;
  for (int i = 0; i < 50; ++i) model.push_back({"parameter", prefix + std::to_string(i), "f32 [8] strides [1]"});
  std::vector<std::vector<ReplicaEntry>> ranks(1024, model);
  ranks[1023][7].value = "f32 [9] strides [1]";
  const std::string m = ExplainReplicaDifference(ranks, "Models differ.");
  EXPECT_LT(m.size(), 8192u) << m.size();
  EXPECT_NE(m.find("First difference at parameter #7: ranks 0-1022 have `" + prefix + "7` f32 [8] strides [1]; "
                   "rank 1023 has `" + prefix + "7` f32 [9] strides [1]. They differ in shape."),
            std::string::npos)
      << m.substr(0, 4096);

  // Every rank apart (its own count of parameters): 8 groups, then the rest
  // counted, in the entry and in the counts.
  ranks.assign(1024, model);
  for (int r = 0; r < 1024; ++r) ranks[r].resize(r % 40 + 1);
  const std::string apart = ExplainReplicaDifference(ranks, "Models differ.");
  EXPECT_LT(apart.size(), 16384u) << apart.size();
  EXPECT_NE(apart.find("; and 32 more values on ranks "), std::string::npos) << apart.substr(0, 4096);
}

// A long value (bucket_order lists every trainable parameter) that differs
// on every one of 256 ranks is cut, start and end, in a bounded message;
// each was given whole (about 13 MB).
TEST(ExplainReplicaDifferenceTest, LongValuesAreCut) {
  std::vector<std::vector<ReplicaEntry>> ranks(256);
  for (int r = 0; r < 256; ++r) {
    std::string order;
    for (int i = 0; i < 10000; ++i) order += (i ? "," : "") + std::to_string((i + r) % 10000);
    ranks[r] = {{"option", "bucket_order", order}};
  }
  const std::string m = ExplainReplicaDifference(ranks, "Models differ.");
  EXPECT_LT(m.size(), 8192u) << m.size();
  EXPECT_NE(m.find("rank 0 has `bucket_order` 0,1,2,3,"), std::string::npos) << m;
  EXPECT_NE(m.find("9998,9999; rank 1 has"), std::string::npos) << m;
  EXPECT_NE(m.find("; and 248 more values on ranks 8-255."), std::string::npos) << m;
  EXPECT_EQ(Occurrences(m, "..."), 8u) << m;  // one in each of the 8 values shown
  EXPECT_NE(m.find(". They differ in value."), std::string::npos) << m;
}

// Two long values that differ only in the part the message leaves out are
// still two groups, not one that hides the difference.
TEST(ExplainReplicaDifferenceTest, ValuesThatDifferWhereTheyAreCutAreStillApart) {
  std::string order;
  for (int i = 0; i < 10000; ++i) order += (i ? "," : "") + std::to_string(i);
  std::vector<std::vector<ReplicaEntry>> ranks(3, {{"option", "bucket_order", order}});
  std::swap(ranks[2][0].value[order.size() / 2], ranks[2][0].value[order.size() / 2 + 1]);
  const std::string m = ExplainReplicaDifference(ranks, "Models differ.");
  EXPECT_NE(m.find("ranks 0-1 have `bucket_order` 0,1,2,"), std::string::npos) << m;
  EXPECT_NE(m.find("; rank 2 has `bucket_order` 0,1,2,"), std::string::npos) << m;
}

// The property that differs is named, so the reader need not compare two
// long descriptions by eye.
TEST(ExplainReplicaDifferenceTest, TheDifferingPropertyIsNamed) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"bf16 [4, 4] strides [4, 1]", "dtype"},
      {"f32 [4, 4] strides [1, 4]", "strides"},
      {"f32 [4, 4] strides [4, 1] no-grad", "requires_grad"},
      {"f32 [4, 4] strides [4, 1] on cuda#0", "device"},
      {"f32 [2, 8] strides [8, 1]", "shape, strides"},
  };
  for (const auto& [value, property] : cases) {
    std::vector<std::vector<ReplicaEntry>> ranks(3, Model(2));
    ranks[2][1].value = value;
    const std::string m = ExplainReplicaDifference(ranks, "Models differ.");
    EXPECT_NE(m.find(" They differ in " + property + "."), std::string::npos) << m;
  }
  std::vector<std::vector<ReplicaEntry>> ranks(2, Model(2));
  ranks[1][0].name = "layer9.weight";
  EXPECT_NE(ExplainReplicaDifference(ranks, "Models differ.").find(" They differ in name."), std::string::npos);
}

// A value that is not a DescribeTensor text (ZeRO describes a parameter
// with its group: "f32 [4, 8] in param group 1") still gets a "They differ
// in" sentence when no tensor field tells the two apart (it had none).
TEST(ExplainReplicaDifferenceTest, AValueThatIsNotATensorDescriptionDiffersInValue) {
  std::vector<std::vector<ReplicaEntry>> ranks(2, {{"parameter", "w", "f32 [4, 8] in param group 0"}});
  ranks[1][0].value = "f32 [4, 8] in param group 1";
  const std::string m = ExplainReplicaDifference(ranks, "Models differ.");
  EXPECT_NE(m.find(" They differ in value."), std::string::npos) << m;
}

// The first name shown in `message`, between its first two backquotes.
std::string FirstShownName(const std::string& message) {
  const size_t open = message.find('`');
  const size_t close = open == std::string::npos ? open : message.find('`', open + 1);
  return close == std::string::npos ? std::string() : message.substr(open + 1, close - open - 1);
}

// `text` is `unit` repeated, after `prefix` and before `suffix`.
bool Repeats(const std::string& text, const std::string& prefix, const std::string& unit, const std::string& suffix) {
  if (text.size() < prefix.size() + suffix.size() || text.rfind(prefix, 0) != 0 ||
      text.compare(text.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return false;
  }
  const std::string middle = text.substr(prefix.size(), text.size() - prefix.size() - suffix.size());
  if (middle.size() % unit.size() != 0) return false;
  for (size_t at = 0; at < middle.size(); at += unit.size()) {
    if (middle.compare(at, unit.size(), unit) != 0) return false;
  }
  return true;
}

// A long name cut for the message keeps its characters whole at both cuts:
// a two-byte UTF-8 character, or a control byte shown as \xNN, is shown
// whole or left out. The cuts fell at fixed byte counts, inside both here.
TEST(ExplainReplicaDifferenceTest, ALongNameIsCutBetweenCharacters) {
  for (const std::string& unit : {std::string("\xc3\xa9"), std::string("\x01")}) {
    std::string name = "ab";
    for (int i = 0; i < 550; ++i) name += unit;
    name += "c";
    std::vector<std::vector<ReplicaEntry>> ranks(2, {{"parameter", name, "f32 [2] strides [1]"}});
    ranks[1][0].value = "f32 [3] strides [1]";
    const std::string shown = FirstShownName(ExplainReplicaDifference(ranks, "Models differ."));
    const std::string seen = unit == "\x01" ? "\\x01" : unit;  // as the message shows it
    const size_t dots = shown.find("...");
    ASSERT_NE(dots, std::string::npos) << shown;
    EXPECT_LE(shown.size(), 1024u);
    EXPECT_TRUE(Repeats(shown.substr(0, dots), "ab", seen, "")) << shown.substr(0, dots);
    EXPECT_TRUE(Repeats(shown.substr(dots + 3), "", seen, "c")) << shown.substr(dots + 3);
  }
}

// Whether `text` is valid UTF-8 (no overlong form, surrogate or code
// point past U+10FFFF).
bool IsUtf8(const std::string& text) {
  for (size_t i = 0; i < text.size();) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    size_t more = 0;
    unsigned char low = 0x80, high = 0xbf;  // the second byte's range
    if (c < 0x80) {
      ++i;
      continue;
    } else if (c >= 0xc2 && c <= 0xdf) {
      more = 1;
    } else if (c >= 0xe0 && c <= 0xef) {
      more = 2;
      if (c == 0xe0) low = 0xa0;
      if (c == 0xed) high = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      more = 3;
      if (c == 0xf0) low = 0x90;
      if (c == 0xf4) high = 0x8f;
    } else {
      return false;
    }
    if (i + more >= text.size()) return false;
    for (size_t k = 1; k <= more; ++k) {
      const unsigned char b = static_cast<unsigned char>(text[i + k]);
      if (k == 1 ? (b < low || b > high) : (b & 0xc0) != 0x80) return false;
    }
    i += more + 1;
  }
  return true;
}

// A name of bytes that are not UTF-8 (Latin-1 0xa0, here) is shown as
// \xNN escapes and still cut to about 1 KB at both ends, and the message
// is valid UTF-8. Such bytes passed through unescaped (invalid text), and
// the cut, which stepped back over every byte it took for the inside of a
// character, walked to both ends of the name: it was shown as "..." alone.
TEST(ExplainReplicaDifferenceTest, ANameOfBytesThatAreNotUtf8IsEscapedAndCut) {
  std::vector<std::vector<ReplicaEntry>> ranks(2, {{"parameter", std::string(1100, '\xa0'), "f32 [2] strides [1]"}});
  ranks[1][0].value = "f32 [3] strides [1]";
  const std::string m = ExplainReplicaDifference(ranks, "Models differ.");
  EXPECT_TRUE(IsUtf8(m)) << m;
  const std::string shown = FirstShownName(m);
  const size_t dots = shown.find("...");
  ASSERT_NE(dots, std::string::npos) << shown;
  EXPECT_GE(shown.size(), 1000u) << shown;
  EXPECT_LE(shown.size(), 1024u) << shown;
  EXPECT_TRUE(Repeats(shown.substr(0, dots), "", "\\xa0", "")) << shown.substr(0, dots);
  EXPECT_TRUE(Repeats(shown.substr(dots + 3), "", "\\xa0", "")) << shown.substr(dots + 3);
}

// Invalid UTF-8 of every kind is escaped byte by byte (a lone continuation
// byte, a lead byte without its continuation, an overlong form, a
// surrogate, 0xff) and valid characters of 2, 3 and 4 bytes pass.
TEST(ExplainReplicaDifferenceTest, BytesThatAreNotUtf8AreEscaped) {
  const std::string name = std::string("a\x80") + "b\xc3" + "c\xc0\xaf" + "d\xed\xa0\x80" + "e\xff" +
                           "\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80";
  std::vector<std::vector<ReplicaEntry>> ranks(2, {{"parameter", name, "f32 [2] strides [1]"}});
  ranks[1][0].value = "f32 [3] strides [1]";
  const std::string m = ExplainReplicaDifference(ranks, "Models differ.");
  EXPECT_TRUE(IsUtf8(m)) << m;
  EXPECT_EQ(FirstShownName(m),
            "a\\x80b\\xc3c\\xc0\\xafd\\xed\\xa0\\x80e\\xff\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80");
}

// A backslash in a name is escaped too (\x5c), so that every backslash the
// message shows begins an escape: a name of literal "\x" repeated is cut
// to about 1 KB, not around every byte of it (it was shown as "..."), and
// each end is the start, or the end, of the name as shown.
TEST(ExplainReplicaDifferenceTest, ANameOfLiteralBackslashXIsCutToItsBound) {
  std::string name;
  for (int i = 0; i < 600; ++i) name += "\\x";
  std::vector<std::vector<ReplicaEntry>> ranks(2, {{"parameter", name, "f32 [2] strides [1]"}});
  ranks[1][0].value = "f32 [3] strides [1]";
  const std::string shown = FirstShownName(ExplainReplicaDifference(ranks, "Models differ."));
  std::string whole;  // the name as the message shows it, uncut
  for (int i = 0; i < 600; ++i) whole += "\\x5cx";
  const size_t dots = shown.find("...");
  ASSERT_NE(dots, std::string::npos) << shown;
  EXPECT_GE(shown.size(), 1000u) << shown;
  EXPECT_LE(shown.size(), 1024u) << shown;
  const std::string head = shown.substr(0, dots), tail = shown.substr(dots + 3);
  EXPECT_EQ(whole.compare(0, head.size(), head), 0) << head;
  EXPECT_EQ(whole.compare(whole.size() - tail.size(), tail.size(), tail), 0) << tail;
  // Neither end splits an escape.
  EXPECT_EQ(head.find('\\', head.size() >= 3 ? head.size() - 3 : 0), std::string::npos) << head;
  EXPECT_TRUE(tail.empty() || tail[0] == '\\' || tail[0] == 'x') << tail;
}

// Ranks whose names at the first difference are more than the check looks
// for on every rank (64; 1 here, through the test knob): the message counts
// the names it did not check, each distinct name once. It said nothing of
// them, and counted a name once per rank that had it.
DDP_TEST_WORKER(names_beyond_the_checked_ones) {
  auto pg = testing::WorkerGroup();
  SetNamesCheckedForTesting(1);
  // Rank 0 has `w0`; ranks 1-3 have `v`.
  const std::vector<ReplicaEntry> entries = {{"parameter", pg->rank() == 0 ? "w0" : "v", "f32 [2] strides [1]"}};
  std::string message;
  try {
    VerifyReplicas(*pg, entries, "Models differ.");
  } catch (const std::invalid_argument& e) {
    message = e.what();
  }
  SetNamesCheckedForTesting(0);
  WORKER_EXPECT(message.find(" Ranks 1-3 have no parameter named `w0`.") != std::string::npos, message);
  WORKER_EXPECT(message.find(" 1 more distinct name at #0 was not checked for ranks that lack it") != std::string::npos,
                message);
  return testing::WorkerExit();
}

TEST(VerifyReplicasTest, NamesBeyondTheCheckedOnesAreCounted) {
  auto run = testing::RunWorkers("names_beyond_the_checked_ones", 4);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Rank 1 has no memory for the flat buffer of a bucket of two 16 MiB
// tensors (its address space is capped a little above what it maps): it
// aborts the group, so that rank 0, the root, fails at once naming it,
// and rank 1 gets its std::bad_alloc. Rank 1 threw alone and rank 0
// waited in the bucket's broadcast until the group's timeout.
DDP_TEST_WORKER(flat_buffer_out_of_memory) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const std::string on = " on rank " + std::to_string(pg->rank());
  constexpr int64_t kElements = int64_t{4} << 20;
  const std::vector<nn::Tensor> tensors = {nn::Ones({kElements}), nn::Ones({kElements})};
  nn::CpuAllocator().EmptyCache();  // no cached block to take the 32 MiB from
  pg->Barrier().Wait();              // the communication thread runs before the limit
  std::optional<testing::AddressSpaceLimit> limit;
  if (pg->rank() == 1) {
    limit.emplace(8 << 20);
    WORKER_EXPECT(limit->ok(), "no VmSize in /proc/self/status");
  }
  const auto start = std::chrono::steady_clock::now();
  std::string outcome = "broadcast";
  try {
    BroadcastCoalesced(*pg, tensors, 0, "test tensors");
  } catch (const std::bad_alloc&) {
    outcome = "std::bad_alloc";
  } catch (const DistributedError& e) {
    outcome = std::string("DistributedError: ") + e.what();
  } catch (const std::exception& e) {
    outcome = std::string("another exception: ") + e.what();
  }
  limit.reset();
  if (pg->rank() == 1) {
    WORKER_EXPECT(outcome == "std::bad_alloc", outcome + on);
    testing::StayAliveUntilTheOtherRanksAreDone(*pg);
    return testing::WorkerExit();
  }
  testing::MarkThisRankDone(*pg);
  WORKER_EXPECT(std::chrono::steady_clock::now() - start < std::chrono::seconds(10), "waited for the timeout" + on);
  WORKER_EXPECT(outcome.rfind("DistributedError: ", 0) == 0 &&
                    outcome.find("broadcasting the test tensors failed on rank 1: std::bad_alloc") != std::string::npos,
                outcome + on);
  return testing::WorkerExit();
}

TEST(BroadcastCoalescedTest, ARankWithoutMemoryForTheFlatBufferFailsTheOthersAtOnce) {
  auto run = testing::RunWorkers("flat_buffer_out_of_memory", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Rank 1 throws `thrown` before bucket 1 of 2 (each of two 4-element
// tensors is a bucket of its own): rank 0, the root, must fail at once
// with a DistributedError naming rank 1 and a reason of whole UTF-8
// characters; rank 1 gets what it threw.
template <typename Thrown>
int OneRankThrowsInTheSecondBucket(const std::string& what) {
  auto pg = testing::WorkerGroup();  // a 20 s timeout
  const std::string on = " on rank " + std::to_string(pg->rank());
  const std::vector<nn::Tensor> tensors = {nn::Ones({4}), nn::Ones({4})};
  if (pg->rank() == 1) {
    SetBucketFaultForTesting([what](int bucket) {
      if (bucket == 1) throw Thrown(what);
    });
  }
  const auto start = std::chrono::steady_clock::now();
  std::string outcome = "broadcast";
  try {
    BroadcastCoalesced(*pg, tensors, 0, "test tensors", 4 * sizeof(float));
  } catch (const DistributedError& e) {
    outcome = std::string("DistributedError: ") + e.what();
  } catch (const Thrown& e) {
    outcome = std::string("thrown: ") + e.what();
  } catch (const std::exception& e) {
    outcome = std::string("another exception: ") + e.what();
  }
  SetBucketFaultForTesting({});
  if (pg->rank() == 1) {
    WORKER_EXPECT(outcome == "thrown: " + what, outcome + on);
    testing::StayAliveUntilTheOtherRanksAreDone(*pg);
    return testing::WorkerExit();
  }
  testing::MarkThisRankDone(*pg);
  WORKER_EXPECT(std::chrono::steady_clock::now() - start < std::chrono::seconds(10), "waited for the timeout" + on);
  WORKER_EXPECT(outcome.rfind("DistributedError: ", 0) == 0 &&
                    outcome.find("broadcasting the test tensors failed on rank 1: x\xc3\xa9") != std::string::npos,
                outcome + on);
  WORKER_EXPECT(IsUtf8(outcome), "a character cut short in: " + outcome + on);
  return testing::WorkerExit();
}

// "x" then 300 two-byte characters: a cut at 512 bytes falls inside one.
std::string XThenAccents() {
  std::string what = "x";
  for (int i = 0; i < 300; ++i) what += "\xc3\xa9";
  return what;
}

DDP_TEST_WORKER(runtime_error_in_a_bucket_on_one_rank) {
  return OneRankThrowsInTheSecondBucket<std::runtime_error>(XThenAccents());
}

DDP_TEST_WORKER(logic_error_in_a_bucket_on_one_rank) {
  return OneRankThrowsInTheSecondBucket<std::invalid_argument>("x\xc3\xa9 refused on this rank only");
}

// The abort's reason holds what() up to 512 bytes, cut on a character
// boundary: it ended in half a character (a lone 0xC3).
TEST(BroadcastCoalescedTest, TheAbortsReasonEndsOnACharacterBoundary) {
  auto run = testing::RunWorkers("runtime_error_in_a_bucket_on_one_rank", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A logic_error thrown on one rank once the buckets started aborts the
// group too: it was rethrown without an abort, and the root waited in the
// next bucket's broadcast until the group's timeout.
TEST(BroadcastCoalescedTest, ALogicErrorOnOneRankInABucketFailsTheOthersAtOnce) {
  auto run = testing::RunWorkers("logic_error_in_a_bucket_on_one_rank", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Two CUDA tensors in a build with no CUDA backend: every rank refuses
// them alike before any exchange, and the group stays usable (a barrier
// gets through). Every rank aborted the group, at the flat buffer.
DDP_TEST_WORKER(a_device_without_a_backend_on_every_rank) {
  auto pg = testing::WorkerGroup();
  const std::string on = " on rank " + std::to_string(pg->rank());
  WORKER_EXPECT(!nn::HasDeviceBackend(nn::DeviceType::kCUDA), "this test needs a build with no CUDA backend" + on);
  float a[2] = {1, 2}, b[2] = {3, 4};
  const nn::Device cuda(nn::DeviceType::kCUDA, 0);
  const std::vector<nn::Tensor> tensors = {nn::Tensor::FromBlob(a, {2}, nn::DType::kFloat32, cuda, [](void*) {}),
                                           nn::Tensor::FromBlob(b, {2}, nn::DType::kFloat32, cuda, [](void*) {})};
  std::string outcome = "broadcast";
  try {
    BroadcastCoalesced(*pg, tensors, 0, "test tensors");
  } catch (const std::exception& e) {
    outcome = e.what();
  }
  WORKER_EXPECT(outcome.find("device cuda:0 is not available") != std::string::npos, outcome + on);
  try {
    pg->Barrier().Wait();
  } catch (const std::exception& e) {
    WORKER_EXPECT(false, std::string("the barrier after the refusal failed: ") + e.what() + on);
  }
  return testing::WorkerExit();
}

TEST(BroadcastCoalescedTest, ARefusalOnEveryRankBeforeTheFirstExchangeLeavesTheGroupUsable) {
  auto run = testing::RunWorkers("a_device_without_a_backend_on_every_rank", 2);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(Utf8PrefixBytesTest, KeepsWholeCharactersOnly) {
  EXPECT_EQ(Utf8PrefixBytes("abc", 8), 3);
  EXPECT_EQ(Utf8PrefixBytes("abc", 2), 2);
  EXPECT_EQ(Utf8PrefixBytes("abc", 0), 0);
  EXPECT_EQ(Utf8PrefixBytes("a\xc3\xa9", 2), 1);          // é cut after its first byte
  EXPECT_EQ(Utf8PrefixBytes("a\xc3\xa9", 3), 3);          // whole
  EXPECT_EQ(Utf8PrefixBytes("a\xe2\x82\xac", 3), 1);      // € cut after 2 of 3
  EXPECT_EQ(Utf8PrefixBytes("a\xf0\x9f\x98\x80", 4), 1);  // an emoji cut after 3 of 4
  EXPECT_EQ(Utf8PrefixBytes("\xf0\x9f\x98\x80z", 4), 4);
}

}  // namespace
}  // namespace ddp::dist::internal
