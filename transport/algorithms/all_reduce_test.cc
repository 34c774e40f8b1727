#include "transport/algorithms/all_reduce.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transport/algorithms/all_reduce_test_util.h"
#include "transport/algorithms/selection.h"
#include "transport/p2p/loopback.h"
#include "transport/testing/thread_harness.h"

namespace ddp::transport::algorithms {
namespace {

using namespace std::chrono_literals;
using testing::AllReduceFn;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr Algorithm kAll[] = {Algorithm::kRing, Algorithm::kTree, Algorithm::kRhd,
                              Algorithm::kHierarchical};

std::vector<int> TwoPerHost(int world) {
  std::vector<int> hosts(world);
  for (int r = 0; r < world; ++r) hosts[r] = world % 2 == 0 ? r / 2 : 0;
  return hosts;
}

// Every algorithm forced in turn through the dispatcher, on the same sweep.
class ForcedAlgorithmTest : public ::testing::TestWithParam<Algorithm> {};

TEST_P(ForcedAlgorithmTest, SweepsThroughTheDispatcher) {
  const Algorithm algo = GetParam();
  for (int world : {1, 2, 3, 4, 6, 7}) {
    const std::vector<int> hosts = TwoPerHost(world);
    const AllReduceFn fn = [&](p2p::PointToPoint& p2p, const CollectiveArgs& args) {
      auto resolved = ResolveAllReduceAlgorithm(p2p, args, algo, hosts);
      if (!resolved.ok()) return resolved.status();
      if (*resolved != algo) return InternalError("resolved to another algorithm");
      return AllReduce(p2p, args, algo, hosts);
    };
    testing::SweepCounts(fn, world);
  }
}

INSTANTIATE_TEST_SUITE_P(Algorithms, ForcedAlgorithmTest, ::testing::ValuesIn(kAll),
                         [](const auto& info) { return std::string(AlgorithmName(info.param)); });

TEST(AllReduceTest, EnvironmentForcesTheAlgorithm) {
  const char* old = std::getenv(kAllReduceAlgoEnv);
  const std::string saved = old ? old : "";
  for (Algorithm algo : kAll) {
    setenv(kAllReduceAlgoEnv, AlgorithmName(algo), 1);
    p2p::LoopbackHub hub(3);
    auto ep = std::move(hub.Connect(0)).value();
    CollectiveArgs args;
    args.count = 10;
    auto resolved = ResolveAllReduceAlgorithm(*ep, args, Algorithm::kAuto, {});
    ASSERT_TRUE(resolved.ok());
    EXPECT_EQ(*resolved, algo);
    testing::CheckAllReduce(
        [](p2p::PointToPoint& p2p, const CollectiveArgs& a) { return AllReduce(p2p, a); },
        {5, 100, DataType::kF32, ReduceOp::kAvg, false, 8});
  }
  if (old) {
    setenv(kAllReduceAlgoEnv, saved.c_str(), 1);
  } else {
    unsetenv(kAllReduceAlgoEnv);
  }
}

// Integers near their type's limits, where sums and products overflow:
// every algorithm must wrap them (two's complement, as NCCL and PyTorch
// do), every rank must end with the same bits, and avg must divide the
// wrapped sum, truncating toward zero. The closed-form sweeps use small
// integers, which never overflow, so they cannot tell wrapping from
// saturating or from a sum taken in a wider type.
template <typename T>
T NearLimit(int rank, size_t i) {
  // Alternately just below the maximum and just above the minimum, so
  // that sums overflow both ways and products wrap.
  const T step = static_cast<T>(rank + 1 + static_cast<int>(i % 3));
  return i % 2 == 0 ? static_cast<T>(std::numeric_limits<T>::max() - step)
                    : static_cast<T>(std::numeric_limits<T>::min() + step);
}

template <typename T>
T Wrapped(ReduceOp op, int world, size_t i) {
  using U = std::make_unsigned_t<T>;
  // u8 promotes to int for * and +: take every step in unsigned int and cut.
  using W = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, U>;
  W acc = static_cast<W>(static_cast<U>(NearLimit<T>(0, i)));
  T best_max = NearLimit<T>(0, i), best_min = best_max;
  for (int r = 1; r < world; ++r) {
    const T v = NearLimit<T>(r, i);
    const W w = static_cast<W>(static_cast<U>(v));
    acc = static_cast<W>(static_cast<U>(op == ReduceOp::kProd ? acc * w : acc + w));
    best_max = std::max(best_max, v);
    best_min = std::min(best_min, v);
  }
  if (op == ReduceOp::kMax) return best_max;
  if (op == ReduceOp::kMin) return best_min;
  const T wrapped = static_cast<T>(static_cast<U>(acc));
  if (op == ReduceOp::kAvg) return static_cast<T>(static_cast<int64_t>(wrapped) / world);
  return wrapped;
}

template <typename T>
void CheckIntegersWrap(Algorithm algo, DataType dtype) {
  constexpr size_t kCount = 13;
  for (int world : {2, 3, 5, 6}) {
    const std::vector<int> hosts = TwoPerHost(world);
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kProd, ReduceOp::kMax,
                        ReduceOp::kMin}) {
      // 0: each algorithm's default chunks and modes; 1: chunks of one
      // element, and halving-doubling instead of recursive doubling.
      for (size_t tiny : {size_t{0}, size_t{1}}) {
        std::vector<std::vector<T>> out(world);
        auto statuses = transport::testing::RunRanks(world, [&](p2p::PointToPoint& p2p) {
          std::vector<T> in(kCount);
          for (size_t i = 0; i < kCount; ++i) in[i] = NearLimit<T>(p2p.rank(), i);
          out[p2p.rank()].assign(kCount, T{0});
          CollectiveArgs args;
          args.send = in.data();
          args.recv = out[p2p.rank()].data();
          args.count = kCount;
          args.dtype = dtype;
          args.op = op;
          args.deadline = DeadlineIn(10s);
          args.tuning.chunk_bytes = tiny * sizeof(T);
          args.tuning.rhd_doubling_bytes = tiny;
          return AllReduce(p2p, args, algo, hosts);
        });
        const std::string what = std::string(AlgorithmName(algo)) + ", " + DataTypeName(dtype) +
                                 " " + ReduceOpName(op) + ", world " + std::to_string(world) +
                                 (tiny ? ", one-element chunks" : "");
        for (int r = 0; r < world; ++r) {
          ASSERT_TRUE(statuses[r].ok()) << what << ", rank " << r << ": " << statuses[r];
          for (size_t i = 0; i < kCount; ++i) {
            ASSERT_EQ(+out[r][i], +Wrapped<T>(op, world, i))
                << what << ", rank " << r << ", element " << i;
          }
        }
      }
    }
  }
}

TEST_P(ForcedAlgorithmTest, IntegersWrapAndAverageTheWrappedSum) {
  CheckIntegersWrap<int32_t>(GetParam(), DataType::kI32);
  CheckIntegersWrap<int64_t>(GetParam(), DataType::kI64);
  CheckIntegersWrap<uint8_t>(GetParam(), DataType::kU8);
}

TEST(AllReduceTest, AutoUsesTheTable) {
  p2p::LoopbackHub hub(8);
  auto ep = std::move(hub.Connect(0)).value();
  // The table only speaks when the variable is unset.
  const char* old = std::getenv(kAllReduceAlgoEnv);
  const std::string saved = old ? old : "";
  unsetenv(kAllReduceAlgoEnv);
  CollectiveArgs args;
  args.count = 1000;
  EXPECT_EQ(*ResolveAllReduceAlgorithm(*ep, args, Algorithm::kAuto, {}), Algorithm::kRhd);
  args.count = 1 << 18;  // 1 MiB of f32 on 8 ranks
  EXPECT_EQ(*ResolveAllReduceAlgorithm(*ep, args, Algorithm::kAuto, {}), Algorithm::kTree);
  args.count = 1 << 24;
  EXPECT_EQ(*ResolveAllReduceAlgorithm(*ep, args, Algorithm::kAuto, {}), Algorithm::kRing);
  EXPECT_EQ(*ResolveAllReduceAlgorithm(*ep, args, Algorithm::kAuto, TwoPerHost(8)),
            Algorithm::kHierarchical);
  // shm is resolved but is not a PointToPoint algorithm.
  EXPECT_EQ(*ResolveAllReduceAlgorithm(*ep, args, Algorithm::kSharedMemory, {}),
            Algorithm::kSharedMemory);
  EXPECT_EQ(AllReduce(*ep, args, Algorithm::kSharedMemory).code(),
            StatusCode::kFailedPrecondition);
  auto bad = ResolveAllReduceAlgorithm(*ep, args, Algorithm::kAuto, std::vector<int>{0, 1});
  EXPECT_THAT(bad.status().message(), HasSubstr("host_of_rank has 2 entries for 8 ranks"));
  if (old) setenv(kAllReduceAlgoEnv, saved.c_str(), 1);
}

// The automatic choice reads host_of_rank only to pick an algorithm: a list
// of the wrong size is named as that argument, with what was expected, not
// as a failure of the hierarchical all-reduce the caller never asked for.
TEST(AllReduceTest, AutoNamesAHostOfRankOfTheWrongSize) {
  p2p::LoopbackHub hub(8);
  auto ep = std::move(hub.Connect(0)).value();
  CollectiveArgs args;
  args.count = 1000;
  for (const std::vector<int>& hosts : {std::vector<int>{0, 1}, std::vector<int>(9, 0)}) {
    auto chosen = ResolveAllReduceAlgorithm(*ep, args, Algorithm::kAuto, hosts);
    EXPECT_EQ(chosen.status().code(), StatusCode::kInvalidArgument) << chosen.status();
    EXPECT_THAT(chosen.status().message(),
                HasSubstr("all-reduce (automatic choice of algorithm): host_of_rank has " +
                          std::to_string(hosts.size()) + " entries for 8 ranks; expected 8"));
    EXPECT_THAT(chosen.status().message(), Not(HasSubstr("hierarchical")));
  }
}

// A rank that runs another algorithm than the others (another per-call
// algorithm, or a count on the other side of the table's threshold) makes
// every rank fail, quickly, naming the disagreement, whichever rank it is:
// the tree checks its ring neighbours as well as its tree parent, so it
// meets a ring rank's check of its predecessor.
TEST(AllReduceTest, RanksRunningDifferentAlgorithmsFailFast) {
  const std::pair<Algorithm, Algorithm> pairs[] = {{Algorithm::kTree, Algorithm::kRing},
                                                   {Algorithm::kRing, Algorithm::kTree}};
  for (int world : {3, 4, 5, 8}) {
    for (int odd = 0; odd < world; ++odd) {
      for (const auto& [its, theirs] : pairs) {
        SCOPED_TRACE(std::to_string(world) + " ranks, rank " + std::to_string(odd) + " runs " +
                     AlgorithmName(its) + ", the others " + AlgorithmName(theirs));
        const auto deadline = DeadlineIn(5s);
        auto statuses = ::ddp::transport::testing::RunRanks(world, [&](p2p::PointToPoint& p2p) {
          std::vector<float> data(64, 1.0f);
          CollectiveArgs args;
          args.send = data.data();
          args.recv = data.data();
          args.count = data.size();
          args.deadline = deadline;
          return AllReduce(p2p, args, p2p.rank() == odd ? its : theirs);
        });
        EXPECT_LT(Clock::now() + 3s, deadline);
        int named = 0;
        for (const Status& s : statuses) {
          EXPECT_FALSE(s.ok());
          named += s.message().find("tree all-reduce, count 64") != std::string::npos;
        }
        EXPECT_GT(named, 0);
      }
    }
  }
}

// Runs an all-reduce of 64 floats on `world` ranks (`setup` may give the
// odd rank up to 66 elements of f32 or f64), nobody killed, under a 6 s
// deadline; rank `odd` starts last, once every other rank is about to call
// and 50 ms more, so that the others are inside the call when it comes.
// (A fixed 300 ms head start did the same at 23 s over the 77 cases of the
// two tests below; counting the callers also holds however slowly threads
// start on a loaded machine.) `setup` gives each rank its count, dtype,
// algorithm and tuning (by whether it is the odd one). Returns every rank's
// status, and in `took` each rank's time from the start.
std::vector<Status> RunWithALateOddRank(int world, int odd,
                                        const std::function<Algorithm(bool is_odd, CollectiveArgs&)>& setup,
                                        std::vector<Clock::duration>* took) {
  took->assign(world, Clock::duration::zero());
  ::ddp::transport::testing::HarnessOptions options;
  options.kill_on_error = false;
  const auto start = Clock::now();
  const auto deadline = start + 6s;
  std::atomic<int> calling{0};
  return ::ddp::transport::testing::RunRanks(
      world,
      [&](p2p::PointToPoint& p2p) -> Status {
        const bool is_odd = p2p.rank() == odd;
        std::vector<double> data(66, 1.0);  // room for 66 of f32 or f64
        CollectiveArgs args;
        args.send = data.data();
        args.recv = data.data();
        args.count = 64;
        args.deadline = deadline;
        const Algorithm algo = setup(is_odd, args);
        if (is_odd) {
          // Bounded by the call's own deadline: a rank that never came
          // leaves the others to time out, which the checks report.
          while (calling.load() < world - 1 && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
          std::this_thread::sleep_for(50ms);
        } else {
          calling.fetch_add(1);
        }
        Status status = AllReduce(p2p, args, algo);
        (*took)[p2p.rank()] = Clock::now() - start;
        return status;
      },
      options);
}

// One rank runs the tree where the others run the ring (or the ring with
// another count), on 5 and 6 ranks, nobody killed: every ring rank fails
// well before the deadline, naming the disagreement. The rank after the odd
// one finds it and sends a note on around the ring; the ring ranks further
// on waited for its data until their deadline. The odd rank starts last,
// so that the others are inside the call when the note comes.
TEST(AllReduceTest, RingRanksFarFromADisagreeingRankFailPromptly) {
  enum class Odd { kTree, kCount };
  for (int world : {5, 6}) {
    for (int odd = 0; odd < world; ++odd) {
      for (Odd differs : {Odd::kTree, Odd::kCount}) {
        const std::string what = std::to_string(world) + " ranks, rank " + std::to_string(odd) +
                                 (differs == Odd::kTree ? " runs the tree" : " passes count 65");
        std::vector<Clock::duration> took;
        const std::vector<Status> statuses = RunWithALateOddRank(
            world, odd,
            [&](bool is_odd, CollectiveArgs& args) {
              if (is_odd && differs == Odd::kCount) args.count = 65;
              return is_odd && differs == Odd::kTree ? Algorithm::kTree : Algorithm::kRing;
            },
            &took);
        const std::string odd_one = differs == Odd::kTree ? "tree all-reduce, count 64"
                                                          : "ring all-reduce, count 65";
        for (int r = 0; r < world; ++r) {
          const Status& s = statuses[r];
          EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << what << ": rank " << r << ": " << s;
          EXPECT_THAT(s.message(), HasSubstr("rank " + std::to_string(odd) + " passed " + odd_one))
              << what << ": rank " << r;
          EXPECT_THAT(s.message(), HasSubstr("passed ring all-reduce, count 64"))
              << what << ": rank " << r;
          EXPECT_LT(took[r], 3s) << what << ": rank " << r << ": " << s;
        }
        // The first case that fails says enough; the rest would each wait
        // for the deadline.
        if (HasFailure()) return;
      }
    }
  }
}

// The same for the tree and halving-doubling, each forced on every rank, one
// rank passing count 65 (on the tree also 66, or 64 of f64) among ranks
// passing 64 of f32, nobody killed: only the ranks whose check sees the
// odd one find the mismatch; the others waited for data that the failed
// ranks never sent, until their deadline, unless a stop note reaches them. Every rank fails within 3 s (the deadline is
// 6 s), INVALID_ARGUMENT naming the odd rank's count and dtype and the
// others'.
TEST(AllReduceTest, TreeAndRhdRanksFarFromADisagreeingRankFailPromptly) {
  struct Forced {
    Algorithm algo;
    const char* name;               // as the fingerprint names it
    size_t rhd_doubling_bytes = 0;  // 1: halving-doubling even for 256 B
  };
  const Forced forced[] = {{Algorithm::kTree, "tree all-reduce"},
                           {Algorithm::kRhd, "rhd all-reduce"},
                           {Algorithm::kRhd, "rhd all-reduce", 1}};
  // What the odd rank passes, as the fingerprint names it. 65 changes only
  // the tree's first half (33 elements against 32); 66 and f64 change
  // both, so the odd rank's tree-1 parent and children see it too. They
  // run on the tree only, the one they are for.
  struct Odd {
    size_t count;
    DataType dtype;
    const char* passed;
  };
  const Odd odds[] = {{65, DataType::kF32, "count 65 of f32"},
                      {66, DataType::kF32, "count 66 of f32"},
                      {64, DataType::kF64, "count 64 of f64"}};
  for (const Forced& f : forced) {
    for (const Odd& o : odds) {
      if (f.algo != Algorithm::kTree && o.count != 65) continue;
      for (int world : {5, 6}) {
        for (int odd = 0; odd < world; ++odd) {
          const std::string what = std::string(f.name) +
                                   (f.rhd_doubling_bytes != 0 ? " (halving)" : "") + ", " +
                                   std::to_string(world) + " ranks, rank " + std::to_string(odd) +
                                   " passes " + o.passed;
          std::vector<Clock::duration> took;
          const std::vector<Status> statuses = RunWithALateOddRank(
              world, odd,
              [&](bool is_odd, CollectiveArgs& args) {
                if (is_odd) {
                  args.count = o.count;
                  args.dtype = o.dtype;
                }
                args.tuning.rhd_doubling_bytes = f.rhd_doubling_bytes;
                return f.algo;
              },
              &took);
          for (int r = 0; r < world; ++r) {
            const Status& s = statuses[r];
            EXPECT_EQ(s.code(), StatusCode::kInvalidArgument)
                << what << ": rank " << r << ": " << s;
            // Both algorithms check every rank they take data from before
            // waiting for its data, so no rank fails on the data's size
            // ("message size mismatch", naming neither count).
            const std::string& m = s.message();
            EXPECT_THAT(m, HasSubstr("rank " + std::to_string(odd) + " passed " + f.name +
                                     ", " + o.passed))
                << what << ": rank " << r << ": " << s;
            EXPECT_THAT(m, HasSubstr("passed " + std::string(f.name) + ", count 64 of f32"))
                << what << ": rank " << r << ": " << s;
            EXPECT_LT(took[r], 3s) << what << ": rank " << r << ": " << s;
          }
          // The first case that fails says enough; the rest would each wait
          // for the deadline.
          if (HasFailure()) return;
        }
      }
    }
  }
}

// Under the automatic choice, a rank whose short count takes it to
// halving-doubling while the others' long one takes them to the ring, on 5,
// 6 and 7 ranks, nobody killed: where it is a rank of the fold that takes
// its partner's share (odd, below 2 (p - 4)), it fails at once, naming
// itself and both counts. Its partner, rank r - 1, runs the ring and sends
// it a fingerprint; it waited first for one from its predecessor in the
// exchanging ranks' ring, which the ring never sends, until its deadline.
// Nobody is killed until the odd rank has its result, which is therefore
// its own finding; then every rank is, so that the ring ranks, which no
// note reaches, fail at once instead of at their 4 s deadline (20 s of
// waiting over the six cases). No rank can return OK after that: each
// needs data from the odd rank, which sends none once it has failed.
TEST(AllReduceTest, AFoldRankChoosingRhdAmongRingRanksFailsAtOnce) {
  constexpr size_t kShort = 16, kLong = 65536;  // 64 B: rhd; 256 KiB: the ring on 5-7 ranks
  for (int world : {5, 6, 7}) {
    for (int odd = 1; odd < 2 * (world - 4); odd += 2) {
      const std::string what = std::to_string(world) + " ranks, rank " + std::to_string(odd);
      std::vector<Clock::duration> took(world);
      std::vector<Algorithm> chose(world);
      ::ddp::transport::testing::HarnessOptions options;
      options.kill_on_error = false;
      p2p::LoopbackHub hub(world);
      auto statuses = ::ddp::transport::testing::RunRanks(
          hub,
          [&](p2p::PointToPoint& p2p) -> Status {
            std::vector<float> data(kLong, 1.0f);
            CollectiveArgs args;
            args.send = data.data();
            args.recv = data.data();
            args.count = p2p.rank() == odd ? kShort : kLong;
            DDP_ASSIGN_OR_RETURN(chose[p2p.rank()],
                                 ResolveAllReduceAlgorithm(p2p, args, Algorithm::kAuto, {}));
            const auto start = Clock::now();
            args.deadline = start + 4s;
            Status status = AllReduce(p2p, args, Algorithm::kAuto);
            took[p2p.rank()] = Clock::now() - start;
            if (p2p.rank() == odd) {
              for (int r = 0; r < world; ++r) hub.Kill(r);
            }
            return status;
          },
          options);
      ASSERT_EQ(chose[odd], Algorithm::kRhd) << what;
      ASSERT_EQ(chose[odd - 1], Algorithm::kRing) << what;
      const Status& s = statuses[odd];
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << what << ": " << s;
      EXPECT_THAT(s.message(), HasSubstr("rank " + std::to_string(odd) +
                                         " passed rhd all-reduce, count 16 of f32"))
          << what;
      EXPECT_THAT(s.message(), HasSubstr("ring all-reduce, count 65536 of f32")) << what;
      EXPECT_LT(took[odd], 2s) << what << ": " << s;
      for (int r = 0; r < world; ++r) EXPECT_FALSE(statuses[r].ok()) << what << ": rank " << r;
    }
  }
}

// One rank passes another dtype of the same size (i32 against f32: the
// messages match in size), another op or another count, at every place of
// 5 and 6 ranks, on every algorithm: no rank may return OK (with bits
// reduced as another type or op). With the harness killing failed ranks,
// every rank fails well before the deadline; without, by it at the latest
// (the existing sweeps move only the count, of the rank in the middle).
TEST(AllReduceTest, OneRankWithAnotherDtypeOpOrCountFailsEveryRank) {
  enum class Odd { kDtype, kOp, kCount };
  for (Algorithm algo : kAll) {
    for (int world : {5, 6}) {
      const std::vector<int> hosts = TwoPerHost(world);
      for (int odd = 0; odd < world; ++odd) {
        for (Odd differs : {Odd::kDtype, Odd::kOp, Odd::kCount}) {
          // Without the kill, ranks not next to the odd one wait for their
          // (short) deadline: on 5 ranks only, to keep the test short.
          for (bool kill : {true, false}) {
            if (!kill && world != 5) continue;
            const std::string what =
                std::string(AlgorithmName(algo)) + " world=" + std::to_string(world) +
                " odd rank " + std::to_string(odd) +
                (differs == Odd::kDtype ? " i32" : differs == Odd::kOp ? " max" : " count+1") +
                (kill ? "" : " (nobody killed)");
            const auto timeout = kill ? Clock::duration(10s) : Clock::duration(300ms);
            std::vector<Clock::duration> took(world);
            ::ddp::transport::testing::HarnessOptions options;
            options.kill_on_error = kill;
            auto statuses = ::ddp::transport::testing::RunRanks(
                world,
                [&](p2p::PointToPoint& p2p) -> Status {
                  const bool is_odd = p2p.rank() == odd;
                  std::vector<float> data(65, 1.0f);
                  CollectiveArgs args;
                  args.send = data.data();
                  args.recv = data.data();
                  args.count = is_odd && differs == Odd::kCount ? 65 : 64;
                  args.dtype = is_odd && differs == Odd::kDtype ? DataType::kI32 : DataType::kF32;
                  args.op = is_odd && differs == Odd::kOp ? ReduceOp::kMax : ReduceOp::kSum;
                  args.tuning.chunk_bytes = 16;
                  const auto start = Clock::now();
                  args.deadline = start + timeout;
                  Status status = AllReduce(p2p, args, algo, hosts);
                  took[p2p.rank()] = Clock::now() - start;
                  return status;
                },
                options);
            for (int r = 0; r < world; ++r) {
              EXPECT_FALSE(statuses[r].ok()) << what << ": rank " << r << " returned OK";
              EXPECT_LT(took[r], kill ? Clock::duration(2s) : timeout + 2s)
                  << what << ": rank " << r << ": " << statuses[r];
            }
            if (HasFailure()) return;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace ddp::transport::algorithms
