#ifndef DDP_DDP_TESTING_DDP_TEST_UTIL_H_
#define DDP_DDP_TESTING_DDP_TEST_UTIL_H_

// Helpers for //ddp's multi-process tests (test-only). Worker side: a
// process group from the launch environment, Fashion-MNIST batches, model
// comparisons and a failure counter whose count becomes the exit code.
// Test side: running a worker on N ranks and checking every rank's exit.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ddp/comm_hooks.h"
#include "ddp/distributed_data_parallel.h"
#include "ddp/process_group.h"
#include "nn/modules/layers.h"
#include "nn/modules/module.h"
#include "nn/optim/optimizer.h"
#include "nn/tensor/tensor.h"
#include "transport/launch/test_spawn.h"

namespace ddp::dist::testing {

// ------------------------------------------------------------ worker ----

/// Failures seen by WORKER_EXPECT in this process (the worker's exit code
/// is 1 when non-zero).
int& WorkerFailures();

#define WORKER_EXPECT(cond, message)                                                     \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      ++::ddp::dist::testing::WorkerFailures();                                          \
      std::fprintf(stderr, "FAIL %s:%d: %s: %s\n", __FILE__, __LINE__, #cond,            \
                   std::string(message).c_str());                                        \
    }                                                                                    \
  } while (0)

/// Runs `f`, which must throw a std::exception whose message holds each of
/// `parts`: the message is printed with `rank`; a failed WORKER_EXPECT with
/// `accepted` when nothing is thrown, or with the message when a part is
/// missing.
void ExpectRefused(int rank, const std::function<void()>& f, const std::string& accepted,
                   const std::vector<std::string>& parts);

/// The exit code of a worker: 0 when nothing failed.
int WorkerExit();

/// The group of this worker (collective timeout DDP_TEST_TIMEOUT_MS,
/// default 20 s).
std::shared_ptr<ProcessGroup> WorkerGroup();

/// For a test where one rank fails alone and must stay alive while the
/// others learn of it (as a program that caught the error and goes on
/// would), so that their failure cannot come from its exit. Every other
/// rank calls MarkThisRankDone once it has seen the failure (or given up);
/// the failing rank calls StayAliveUntilTheOtherRanksAreDone, which returns
/// when they all have, or after `most` (a failed WORKER_EXPECT naming the
/// ranks still missing). `most` should exceed the time the others are
/// allowed, so that others waiting for this exit still fail their bound.
/// Marks are files in TEST_TMPDIR named by the run's DDP_JOB_TOKEN.
void MarkThisRankDone(const ProcessGroup& pg);
void StayAliveUntilTheOtherRanksAreDone(const ProcessGroup& pg,
                                        std::chrono::seconds most = std::chrono::seconds(30));
/// The same wait for the marks of `ranks` only.
void WaitUntilRanksAreDone(const ProcessGroup& pg, const std::vector<int>& ranks,
                           std::chrono::seconds most = std::chrono::seconds(30));
/// The same for rank `rank`, where its group is already destroyed.
void MarkThisRankDone(int rank);
void WaitUntilRanksAreDone(int rank, const std::vector<int>& ranks,
                           std::chrono::seconds most = std::chrono::seconds(30));

/// The first `n` Fashion-MNIST test images as f32 [n, 1, 28, 28] in [0, 1]
/// and their labels [n] (i64). Loaded once per process.
struct Data {
  nn::Tensor images;
  nn::Tensor labels;
};
const Data& FashionMnist(int64_t n = 2048);

/// Samples [start, start + count) (wrapping around), as new tensors.
std::pair<nn::Tensor, nn::Tensor> Batch(const Data& data, int64_t start, int64_t count);

/// Largest |a - b| divided by the largest |b| (|a - b| when b is all 0),
/// over two CPU tensors of one shape.
double RelativeDifference(const nn::Tensor& a, const nn::Tensor& b);

/// Largest |a - b| over every parameter, divided by the largest |b| of that
/// parameter (per tensor), maximized over tensors; also returns the name of
/// the worst tensor.
std::pair<double, std::string> MaxRelativeDifference(const nn::modules::Module& a,
                                                     const nn::modules::Module& b);

/// The same over the parameters' gradients (every one must have one).
std::pair<double, std::string> MaxRelativeGradDifference(const nn::modules::Module& a,
                                                         const nn::modules::Module& b);

/// FNV-1a over the bytes of every parameter and buffer.
uint64_t HashState(const nn::modules::Module& m);

/// Collective: true when every rank passed the same value.
bool SameOnAllRanks(ProcessGroup& pg, uint64_t value);

/// Each parameter's gradient after one backward of DDP over MakeMlp (seed
/// 7) with `hook` (none when null) on this rank's 8 Fashion-MNIST samples.
/// Collective.
std::vector<std::vector<float>> OneBackwardGrads(const std::shared_ptr<ProcessGroup>& pg, CommHook hook);

/// Two DDP wrappers of MakeMlp (seed 7), `first` on `first_group` and
/// `second` on `second_group`, built in that order (collective on each
/// group), then given `first_hook` and `second_hook`: for tests of one hook
/// state that two wrappers share. The samples are the first group's rank's
/// 8 Fashion-MNIST samples.
class TwoWrappers {
 public:
  TwoWrappers(const std::shared_ptr<ProcessGroup>& first_group, const std::shared_ptr<ProcessGroup>& second_group,
              CommHook first_hook, CommHook second_hook);
  /// One backward of the first (second) wrapper on the samples.
  void BackwardFirst();
  void BackwardSecond();

 private:
  std::shared_ptr<nn::modules::Module> first_model_, second_model_;
  DistributedDataParallel first_, second_;
  nn::Tensor x_, y_;
};

/// trunk -> (a when `use_a`, else b), for parameters a rank does not use;
/// `never` is never used. Input [N, 784] or [N, 1, 28, 28]; output [N, 10].
class Branchy : public nn::modules::Module {
 public:
  Branchy(uint64_t seed, bool use_a);
  nn::Tensor Forward(const nn::Tensor& x) override;
  using Module::Forward;
  std::string TypeName() const override { return "Branchy"; }
  bool use_a_;

 private:
  std::shared_ptr<nn::modules::Linear> trunk_, a_, b_, never_;
};

// ------------------------------------------------------ parameter groups ----

/// The usual AdamW split of `params`: weights (more than one dimension)
/// decayed by 0.05 at the optimizer's rate, biases undecayed at `bias_lr`.
/// The groups list the parameters in another order than the model (every
/// weight, then every bias), so a ZeRO partition cuts that order.
std::vector<nn::optim::ParamGroup> DecayGroups(const nn::optim::NamedParameters& params, double bias_lr = 2e-3);

/// AdamW (lr 1e-3) over `groups`: the ZeRO optimizers' GroupFactory in tests.
std::unique_ptr<nn::optim::Optimizer> MakeGroupedOptimizer(std::vector<nn::optim::ParamGroup> groups);

// -------------------------------------------------------------- test ----

/// Runs DDP_TEST_WORKER `worker` on `world_size` ranks, with `env` added,
/// for up to `timeout_ms` (times 5 under TSAN, 2 under ASan).
transport::launch::testing::TestRunResult RunWorkers(
    const std::string& worker, int world_size,
    std::vector<std::pair<std::string, std::string>> env = {}, int timeout_ms = 60000,
    bool stop_all_on_failure = true);

/// Everything every rank printed, for failure messages.
std::string AllOutput(const transport::launch::testing::TestRunResult& run);

/// Limits this process's address space (RLIMIT_AS) to what it maps now plus
/// `headroom` bytes: room for small allocations but not for a new thread's
/// stack (8 MiB), so that starting a thread fails. Restores the previous
/// limit when destroyed. ok() is false, and nothing is limited, when
/// /proc/self/status has no VmSize. Not under ASan or TSan, whose runtimes
/// reserve address space of their own.
class AddressSpaceLimit {
 public:
  explicit AddressSpaceLimit(size_t headroom);
  ~AddressSpaceLimit();
  AddressSpaceLimit(const AddressSpaceLimit&) = delete;
  AddressSpaceLimit& operator=(const AddressSpaceLimit&) = delete;
  bool ok() const { return ok_; }

 private:
  bool ok_ = false;
  unsigned long long old_cur_ = 0;
};

}  // namespace ddp::dist::testing

#endif  // DDP_DDP_TESTING_DDP_TEST_UTIL_H_
