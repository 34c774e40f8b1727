// Checkpoints of data-parallel training over real processes: rank 0 saves,
// every rank loads, a resumed run equals an uninterrupted one bit for bit,
// failures on one rank become errors on every rank, and a rank killed in
// the middle of training makes the others fail within the deadline while
// the last checkpoint on disk stays intact; PowerSGD's, the averager's and
// the post-local-SGD hook's state resume with the rest.

#include "ddp/checkpoint.h"

#include <dirent.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ddp/distributed_data_parallel.h"
#include "ddp/model_averaging.h"
#include "ddp/powersgd_hook.h"
#include "ddp/testing/ddp_test_util.h"
#include "ddp/zero_redundancy_optimizer.h"
#include "nn/autograd/engine.h"
#include "nn/io/atomic_file.h"
#include "nn/loss/loss.h"
#include "nn/modules/layers.h"
#include "nn/modules/models.h"
#include "nn/ops/functional.h"
#include "nn/optim/adam.h"
#include "nn/optim/grad_scaler.h"
#include "nn/optim/lr_scheduler.h"
#include "nn/optim/sgd.h"

// Allocations on a thread fail while its flag is set, as when memory has
// run out. (Replacing the global operator new is the seam; it reaches the
// library too.)
namespace {
thread_local bool out_of_memory = false;
}  // namespace

void* operator new(std::size_t bytes) {
  if (out_of_memory) throw std::bad_alloc();
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
// Not inlined: GCC would take a free() of what a new expression returned
// for a mismatch.
[[gnu::noinline]] void operator delete(void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace ddp::dist {
namespace {

using nn::Tensor;
using testing::RunWorkers;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int64_t kBatch = 8;

std::shared_ptr<nn::modules::Module> Mlp(uint64_t seed) {
  nn::Generator gen(seed);
  return nn::modules::MakeMlp(gen);
}

// The model's first two parameters as one param group, the rest as another.
std::vector<nn::optim::ParamGroup> TwoParamGroups(nn::modules::Module& model) {
  std::vector<nn::optim::ParamGroup> groups(2);
  const nn::modules::NamedTensors params = model.NamedParameters();
  for (size_t i = 0; i < params.size(); ++i) groups[i < 2 ? 0 : 1].params.push_back(params[i]);
  return groups;
}

void TrainStep(DistributedDataParallel& ddp, nn::optim::Sgd& opt, ProcessGroup& pg, int step) {
  const auto& data = testing::FashionMnist();
  auto [x, y] = testing::Batch(data, (step * pg.size() + pg.rank()) * kBatch, kBatch);
  opt.ZeroGrad();
  nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  opt.Step();
}

std::string TempDir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/ddp_ckpt_" + std::to_string(getpid()) +
                    "_" + std::to_string(std::chrono::steady_clock::now().time_since_epoch().count());
  mkdir(dir.c_str(), 0700);
  return dir;
}

std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") names.push_back(n);
    }
    closedir(d);
  }
  return names;
}

// ------------------------------------------------------------- resume ----

DDP_TEST_WORKER(resume) {
  auto pg = testing::WorkerGroup();
  const std::string path = std::getenv("DDP_TEST_CKPT");
  uint64_t uninterrupted = 0;
  {
    auto model = Mlp(1);
    DistributedDataParallel ddp(model, {.process_group = pg});
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
    for (int s = 0; s < 6; ++s) {
      if (s == 3) SaveCheckpoint(*pg, path, MakeCheckpoint(ddp, &opt, {{"step", "3"}}));
      TrainStep(ddp, opt, *pg, s);
    }
    uninterrupted = testing::HashState(*model);
  }
  {
    // A fresh process state: other initial weights, a new optimizer.
    auto model = Mlp(99);
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
    nn::io::Checkpoint c = LoadCheckpoint(*pg, path);
    RestoreCheckpoint(c, *model, &opt);
    const int start = static_cast<int>(nn::io::MetadataInt(c.metadata, "step", path));
    WORKER_EXPECT(start == 3, "step " + std::to_string(start));
    DistributedDataParallel ddp(model, {.process_group = pg});
    for (int s = start; s < 6; ++s) TrainStep(ddp, opt, *pg, s);
    WORKER_EXPECT(testing::HashState(*model) == uninterrupted,
                  "the resumed run differs from the uninterrupted one");
  }
  // Keys carry no "module." prefix: the file loads into a plain model.
  nn::io::Checkpoint c = nn::io::LoadCheckpoint(path);
  WORKER_EXPECT(c.model.size() == 6 && c.model[0].first == "1.weight", c.model[0].first);
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, ResumeEqualsUninterruptedRun) {
  const std::string dir = TempDir();
  auto run = RunWorkers("resume", 2, {{"DDP_TEST_CKPT", dir + "/model.safetensors"}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ---------------------------------------------------------- slow write ----

// A group whose collectives time out after `timeout` (its creation after
// 20 s), for work that outlasts that timeout.
std::shared_ptr<ProcessGroup> GroupWithAShortTimeout(std::chrono::milliseconds timeout) {
  ProcessGroupOptions options;
  options.timeout = timeout;
  transport::CommunicatorOptions comm_options;
  comm_options.timeout = std::chrono::milliseconds(20000);
  return ProcessGroup::CreateFromEnvironment(options, comm_options);
}

// The error of the next collective (empty if it works): after an abort, the
// abort's reason.
std::string NextCollectivesError(ProcessGroup& pg) {
  try {
    nn::Tensor one = nn::Ones({1});
    pg.AllReduce(one).Wait();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// How a call ended: the message of the exception the test expects
// ("no error" when it threw none, a line naming what else escaped), and
// how long it took.
struct Outcome {
  std::string error = "no error";
  double seconds = 0;
};

// Runs `call`, expecting an E. Allocations work again (out_of_memory)
// before anything is caught: a message is built from what escaped.
template <typename E>
Outcome OutcomeOf(const std::function<void()>& call) {
  Outcome o;
  const auto start = std::chrono::steady_clock::now();
  try {
    try {
      call();
    } catch (...) {
      out_of_memory = false;
      throw;
    }
  } catch (const E& e) {
    o.error = e.what();
  } catch (const std::bad_alloc&) {
    o.error = "the std::bad_alloc escaped";
  } catch (const std::exception& e) {
    o.error = std::string("an exception of another kind: ") + e.what();
  } catch (...) {
    o.error = "an exception that is not a std::exception";
  }
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return o;
}

// A write that takes longer than the group's timeout (here 1 s; in real
// jobs, many GB to slow storage): rank 0 tells the others every quarter of
// it that it is still writing, so they wait for it instead of timing out.
// (With 200 ms, a rank 0 kept off the CPU that long on a loaded host missed
// its turn: the timeout must stay well above scheduling delays.)
// With SaveOptions::timeout shorter than the write, every rank throws the
// same error, the group is aborted, and rank 0 stops writing (within a
// 64 MiB piece), leaving no file behind. The write is made slow on purpose
// (every piece waits kPiecePause first), not left to the disk: on NVMe,
// tmpfs or the page cache even 512 MiB can take less than the group's
// timeout. Eight small tensors are eight pieces as 512 MiB in one are,
// without a second or more spent copying, checksumming and reading them.
DDP_TEST_WORKER(slow_write) {
  constexpr auto kPiecePause = std::chrono::milliseconds(400);
  constexpr int kTensors = 8;
  nn::io::Checkpoint big;
  if (std::string(std::getenv("RANK")) == "0") {
    for (int i = 0; i < kTensors; ++i) big.model.emplace_back("w" + std::to_string(i), nn::Ones({1024}));
  }
  nn::io::internal::SetWritePausePerPiece(kPiecePause);  // 8 pieces: at least 3.2 s
  auto pg = GroupWithAShortTimeout(std::chrono::milliseconds(1000));
  const std::string dir = std::getenv("DDP_TEST_CKPT");
  const auto start = std::chrono::steady_clock::now();
  SaveCheckpoint(*pg, dir + "/slow.safetensors", big);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "rank %d: the save took %.2f s\n", pg->rank(), took);
  // Not a test at all if the write was quicker than the group's timeout
  // (the pauses alone make it 3.2 s).
  WORKER_EXPECT(took > 2.0, "the write took only " + std::to_string(took) + " s");
  std::string error;
  const auto late_start = std::chrono::steady_clock::now();
  try {
    SaveCheckpoint(*pg, dir + "/late.safetensors", big, {.timeout = std::chrono::milliseconds(50)});
  } catch (const std::exception& e) {
    error = e.what();
  }
  const double late_took = std::chrono::duration<double>(std::chrono::steady_clock::now() - late_start).count();
  // The stop, asked for during the first piece's pause, ends the write
  // before that piece (0.4 s); the whole save took at least 3.2 s.
  WORKER_EXPECT(late_took < took / 2, "the stopped save took " + std::to_string(late_took) + " s, the whole one " +
                                          std::to_string(took) + " s");
  WORKER_EXPECT(error.find("rank 0 could not write " + dir + "/late.safetensors: the write did not finish "
                           "within SaveOptions::timeout (50 ms)") != std::string::npos,
                error);
  // Rank 0 is still writing, so the group was aborted with the reason: the
  // next collective fails at once instead of waiting for it.
  const std::string next = NextCollectivesError(*pg);
  WORKER_EXPECT(next.find("within SaveOptions::timeout (50 ms)") != std::string::npos, next);
  // Rank 0 alone, after the last collective.
  if (pg->rank() == 0) {
    WORKER_EXPECT(nn::io::LoadCheckpoint(dir + "/slow.safetensors").model.size() == kTensors, "no checkpoint");
    std::remove((dir + "/slow.safetensors").c_str());
    const std::vector<std::string> left = ListDir(dir);
    WORKER_EXPECT(left.empty(), "the stopped write left " + left.front());
  }
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, RankZeroWritingLongerThanTheGroupTimeoutKeepsTheOthersWaiting) {
  const std::string dir = TempDir();
  auto run = RunWorkers("slow_write", 3, {{"DDP_TEST_CKPT", dir}}, 120000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ------------------------------------------------------------- errors ----

DDP_TEST_WORKER(checkpoint_errors) {
  auto pg = testing::WorkerGroup();
  const std::string dir = std::getenv("DDP_TEST_CKPT");
  auto model = Mlp(1);
  // Rank 0 cannot write: every rank learns it.
  try {
    SaveCheckpoint(*pg, dir + "/no/such/dir/c.safetensors", MakeCheckpoint(*model, nullptr));
    WORKER_EXPECT(false, "save into a missing directory succeeded");
  } catch (const std::runtime_error& e) {
    WORKER_EXPECT(std::string(e.what()).find("rank 0 could not write " + dir + "/no/such/dir") !=
                      std::string::npos,
                  e.what());
  }
  // A path longer than the 1 KB record that carries rank 0's reason to
  // the others: rank 0's own error gives it in full. Before, it was cut
  // there too, in the middle of the path, without the reason.
  std::string deep = dir;
  for (int i = 0; i < 5; ++i) deep += "/" + std::string(250, 'a');
  deep += "/missing.safetensors";
  try {
    SaveCheckpoint(*pg, deep, MakeCheckpoint(*model, nullptr));
    WORKER_EXPECT(false, "save into a missing directory succeeded");
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    WORKER_EXPECT(m.find("rank 0 could not write " + deep) != std::string::npos, m);
    if (pg->rank() == 0) {
      WORKER_EXPECT(m.find(": cannot create temporary file: No such file or directory") != std::string::npos, m);
    }
  }
  // One rank cannot read: every rank learns which one and why.
  const std::string good = dir + "/good.safetensors";
  SaveCheckpoint(*pg, good, MakeCheckpoint(*model, nullptr));
  const std::string mine = pg->rank() == 1 ? dir + "/missing.safetensors" : good;
  try {
    LoadCheckpoint(*pg, mine);
    WORKER_EXPECT(false, "load succeeded although rank 1's file is missing");
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    WORKER_EXPECT(m.find("failed on rank 1: ") != std::string::npos && m.find("missing.safetensors") != std::string::npos &&
                      m.find("rank 0:") == std::string::npos,
                  m);
  }
  // Rank 1's path is longer than the 1 KB record that carries its reason
  // to the others: rank 1's own error gives it in full. Before, it was cut
  // there too, in the middle of the path, without the reason.
  try {
    LoadCheckpoint(*pg, pg->rank() == 1 ? deep : good);
    WORKER_EXPECT(false, "load succeeded although rank 1's file is missing");
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    WORKER_EXPECT(m.find("failed on rank 1: ") != std::string::npos, m);
    if (pg->rank() == 1) {
      WORKER_EXPECT(m.find(deep + ": cannot open: No such file or directory") != std::string::npos, m);
    }
  }
  // Rank 1 reads an older copy (a node-local disk, a stale cache): every
  // rank learns that the ranks read different files, and what each read.
  const std::string older = dir + "/older.safetensors";
  SaveCheckpoint(*pg, older, MakeCheckpoint(*Mlp(2), nullptr, {{"step", "7"}}));
  try {
    LoadCheckpoint(*pg, pg->rank() == 1 ? older : good);
    WORKER_EXPECT(false, "ranks loaded different checkpoints without an error");
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    WORKER_EXPECT(m.find("the ranks read different files") != std::string::npos &&
                      m.find("rank 1 read data checksum") != std::string::npos &&
                      m.find("step 7") != std::string::npos,
                  m);
  }
  // A checkpoint of another model: the keys are listed.
  nn::io::Checkpoint c = LoadCheckpoint(*pg, good);
  auto cnn = nn::modules::MakeCnn();
  try {
    RestoreCheckpoint(c, *cnn, nullptr);
    WORKER_EXPECT(false, "an MLP checkpoint loaded into a CNN");
  } catch (const std::exception& e) {
    WORKER_EXPECT(std::string(e.what()).find("1.weight") != std::string::npos, e.what());
  }
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, FailuresReachEveryRank) {
  const std::string dir = TempDir();
  auto run = RunWorkers("checkpoint_errors", 2, {{"DDP_TEST_CKPT", dir}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Ranks that pass SaveCheckpoint different paths (here rank 2 its own, as
// if each rank wrote its file) or options that one rank refuses. Before,
// rank 0 wrote its path and nobody heard of rank 2's; and a rank whose
// options were refused threw alone while rank 0 wrote, then waited for it
// until the group's timeout (60 s here). Now every rank throws the same
// error at once, naming the ranks and what they passed, nothing is
// written, and the group goes on.
DDP_TEST_WORKER(save_paths_differ) {
  auto pg = testing::WorkerGroup();  // DDP_TEST_TIMEOUT_MS: 60 s
  const std::string dir = std::getenv("DDP_TEST_CKPT");
  const std::string shared = dir + "/c.safetensors";
  const std::string own = dir + "/rank2.safetensors";
  const nn::io::Checkpoint c = MakeCheckpoint(*Mlp(1), nullptr);
  auto error_of = [](const std::function<void()>& save) {
    try {
      save();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    } catch (const std::exception& e) {
      return std::string("not an invalid_argument: ") + e.what();
    }
    return std::string("no error");
  };
  auto start = std::chrono::steady_clock::now();
  std::string error = error_of([&] { SaveCheckpoint(*pg, pg->rank() == 2 ? own : shared, c); });
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  WORKER_EXPECT(error == "SaveCheckpoint: not written, the ranks passed different paths (rank 0 writes the file, "
                         "and every rank must pass its path): ranks 0, 1 passed '" + shared + "'; rank 2 passed '" +
                         own + "'",
                "rank " + std::to_string(pg->rank()) + " got: " + error);
  WORKER_EXPECT(took < 20, "the paths' error took " + std::to_string(took) + " s");
  start = std::chrono::steady_clock::now();
  error = error_of([&] {
    SaveOptions options;
    if (pg->rank() == 1) options.heartbeat = std::chrono::milliseconds(0);
    SaveCheckpoint(*pg, shared, c, options);
  });
  took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  WORKER_EXPECT(error == "SaveCheckpoint " + shared + ": not written: invalid arguments on rank 1: "
                         "SaveOptions::heartbeat must be positive, got 0 ms",
                "rank " + std::to_string(pg->rank()) + " got: " + error);
  WORKER_EXPECT(took < 20, "the options' error took " + std::to_string(took) + " s");
  // An empty path, shown as '' (it used to vanish from the message).
  error = error_of([&] { SaveCheckpoint(*pg, "", c); });
  WORKER_EXPECT(error == "SaveCheckpoint '': not written: invalid arguments on rank 0: the path is empty; rank 1: "
                         "the path is empty; rank 2: the path is empty",
                "rank " + std::to_string(pg->rank()) + " got: " + error);
  // Nothing was written, and the group is still usable.
  pg->Barrier().Wait();
  const std::vector<std::string> left = ListDir(dir);
  WORKER_EXPECT(left.empty(), "written although the ranks disagreed: " + (left.empty() ? "" : left.front()));
  WORKER_EXPECT(NextCollectivesError(*pg).empty(), "the group failed after the refused saves");
  SaveCheckpoint(*pg, shared, c);
  WORKER_EXPECT(nn::io::LoadCheckpoint(shared).model.size() == c.model.size(), "the agreed save");
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, RanksThatPassDifferentPathsOrRefusedOptionsFailEveryRankAndNothingIsWritten) {
  const std::string dir = TempDir();
  auto run = RunWorkers("save_paths_differ", 3, {{"DDP_TEST_CKPT", dir}, {"DDP_TEST_TIMEOUT_MS", "60000"}},
                        180000, /*stop_all_on_failure=*/false);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Rank 1 passes SaveCheckpoint options it refuses; rank 2 throws while it
// tells the others its arguments (bad_alloc, as when memory runs out, or
// non_std, anything that is no std::exception), or (buffers) a bad_alloc
// while it makes the buffers to compare them. Before, only a
// DistributedError was caught there: rank 2 left the call alone, and
// ranks 0 and 1 waited for it in the all-gather of the arguments until the
// group's timeout (60 s here). Now rank 2 still takes part, and every rank
// throws at once naming it and what threw; nothing is written, and the
// group goes on, to the next case.
DDP_TEST_WORKER(save_telling_the_arguments_throws) {
  auto pg = testing::WorkerGroup();  // DDP_TEST_TIMEOUT_MS: 60 s
  const std::string dir = std::getenv("DDP_TEST_CKPT");
  const std::string path = dir + "/c.safetensors";
  const nn::io::Checkpoint c = MakeCheckpoint(*Mlp(1), nullptr);
  struct NotAStdException {};
  SaveOptions options;
  if (pg->rank() == 1) options.heartbeat = std::chrono::milliseconds(0);
  for (const std::string which : {"bad_alloc", "non_std", "buffers"}) {
    const internal::FaultPoint point = which == "buffers" ? internal::FaultPoint::kMakingArgumentBuffers
                                                          : internal::FaultPoint::kTellingArguments;
    if (pg->rank() == 2) {
      internal::SetFaultForTesting(point, [which] {
        if (which == "non_std") throw NotAStdException{};
        throw std::bad_alloc();
      });
    }
    std::string error = "no error";
    const auto start = std::chrono::steady_clock::now();
    try {
      SaveCheckpoint(*pg, path, c, options);
    } catch (const std::runtime_error& e) {
      error = e.what();
    } catch (const std::invalid_argument& e) {
      error = std::string("a std::invalid_argument: ") + e.what();
    } catch (const std::bad_alloc&) {
      error = "the std::bad_alloc escaped";
    } catch (...) {
      error = "an exception that is neither a std::runtime_error nor a std::invalid_argument";
    }
    internal::SetFaultForTesting(point, {});
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const std::string who = which + ", rank " + std::to_string(pg->rank());
    const std::string why = which == "non_std" ? "an exception that is not a std::exception" : "std::bad_alloc";
    const std::string expected =
        which == "buffers"
            ? "SaveCheckpoint " + path + ": not written: rank 2 could not make the buffers to compare the ranks' "
                                         "arguments" + (pg->rank() == 2 ? ": " + why : "")
            : "SaveCheckpoint " + path + ": not written: the ranks could not compare their arguments: rank 1: "
                                         "SaveOptions::heartbeat must be positive, got 0 ms; rank 2: telling the "
                                         "other ranks its arguments threw: " + why;
    WORKER_EXPECT(error == expected, who + " got: " + error);
    WORKER_EXPECT(took < 20, who + ": the failure took " + std::to_string(took) + " s");
    pg->Barrier().Wait();
    const std::vector<std::string> left = ListDir(dir);
    WORKER_EXPECT(left.empty(),
                  who + ": written although the comparison failed: " + (left.empty() ? "" : left.front()));
    WORKER_EXPECT(NextCollectivesError(*pg).empty(), who + ": the group failed after the failed save");
  }
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, ARankThatThrowsWhileComparingArgumentsIsNamedOnEveryRankPromptly) {
  const std::string dir = TempDir();
  auto run = RunWorkers("save_telling_the_arguments_throws", 3,
                        {{"DDP_TEST_CKPT", dir}, {"DDP_TEST_TIMEOUT_MS", "60000"}}, 180000,
                        /*stop_all_on_failure=*/false);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// The loads' arguments that one rank refuses (a root outside the group,
// a zero timeout) or that differ between ranks (the root). Before, the
// rank that refused them threw alone, and the others waited for it until
// the group's timeout (60 s here); ranks given different roots each read
// and sent as a root, in collectives that did not match. Now every rank
// throws the same error at once, naming the ranks and what they passed,
// and the group goes on.
DDP_TEST_WORKER(load_arguments_differ) {
  auto pg = testing::WorkerGroup();  // DDP_TEST_TIMEOUT_MS: 60 s
  const std::string path = std::string(std::getenv("DDP_TEST_CKPT")) + "/c.safetensors";
  SaveCheckpoint(*pg, path, MakeCheckpoint(*Mlp(1), nullptr));
  auto error_of = [](const std::function<void()>& load) {
    try {
      load();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    } catch (const std::exception& e) {
      return std::string("not an invalid_argument: ") + e.what();
    }
    return std::string("no error");
  };
  const struct {
    std::function<void()> load;
    std::string expected;
  } cases[] = {
      {[&] { LoadCheckpointFromRank(*pg, path, pg->rank() == 2 ? 1 : 0); },
       "LoadCheckpointFromRank: nothing was read, the ranks passed different roots (every rank must pass the rank "
       "that reads the file): ranks 0, 1 passed root 0; rank 2 passed root 1"},
      {[&] { LoadCheckpointFromRank(*pg, path, pg->rank() == 1 ? 5 : 0); },
       "LoadCheckpointFromRank " + path + ": nothing was read: invalid arguments on rank 1: root 5 is not a rank "
       "of the group (size 3)"},
      {[&] {
         LoadWaitOptions wait;
         if (pg->rank() == 2) wait.timeout = std::chrono::milliseconds(0);
         LoadCheckpoint(*pg, path, {}, wait);
       },
       "LoadCheckpoint " + path + ": nothing was read: invalid arguments on rank 2: LoadWaitOptions::timeout "
       "must be in (0 ms, 30 days], got 0 ms"},
      // An empty path, shown as '' (it used to vanish from the message),
      // on rank 1 for every rank's read, on the root for a read by root.
      {[&] { LoadCheckpoint(*pg, pg->rank() == 1 ? "" : path); },
       "LoadCheckpoint " + std::string(pg->rank() == 1 ? "''" : path) +
           ": nothing was read: invalid arguments on rank 1: the path is empty"},
      {[&] { LoadCheckpointFromRank(*pg, pg->rank() == 2 ? "" : path, 2); },
       "LoadCheckpointFromRank " + std::string(pg->rank() == 2 ? "''" : path) +
           ": nothing was read: invalid arguments on rank 2: the path is empty (rank 2 reads it)"},
  };
  for (const auto& c : cases) {
    const auto start = std::chrono::steady_clock::now();
    const std::string error = error_of(c.load);
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    WORKER_EXPECT(error == c.expected, "rank " + std::to_string(pg->rank()) + " got: " + error);
    WORKER_EXPECT(took < 20, "the error took " + std::to_string(took) + " s: " + error);
  }
  WORKER_EXPECT(NextCollectivesError(*pg).empty(), "the group failed after the refused loads");
  // Only the root's path is read: the others' may be empty.
  WORKER_EXPECT(LoadCheckpointFromRank(*pg, pg->rank() == 1 ? path : "", 1).model.size() == 6, "the agreed load");
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, LoadArgumentsThatOneRankRefusesOrThatDifferFailEveryRankAtOnce) {
  auto run = RunWorkers("load_arguments_differ", 3, {{"DDP_TEST_CKPT", TempDir()}, {"DDP_TEST_TIMEOUT_MS", "60000"}},
                        180000, /*stop_all_on_failure=*/false);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Load options that one rank refuses: a device_map target (rank 1, in
// LoadCheckpoint) or a device (rank 2, in LoadCheckpointFromRank) that no
// process of this test has (cuda:1000: no backend, or no such device).
// Before, they were checked only as each rank loaded: every other rank
// read the whole file (root read it and sent it to all) before every rank
// failed with a std::runtime_error. Now every rank throws the same
// std::invalid_argument naming the rank and the option, no rank reads a
// piece of the file, and the group goes on.
DDP_TEST_WORKER(load_options_refused) {
  auto pg = testing::WorkerGroup();  // DDP_TEST_TIMEOUT_MS: 60 s
  const std::string path = std::string(std::getenv("DDP_TEST_CKPT")) + "/c.safetensors";
  SaveCheckpoint(*pg, path, MakeCheckpoint(*Mlp(1), nullptr));
  // Called on the reading thread, before each piece of a read.
  std::atomic<int> pieces{0};
  nn::io::internal::SetReadPieceHookForTesting([&pieces](uint64_t) { ++pieces; });
  const std::string rank = "rank " + std::to_string(pg->rank());
  nn::io::LoadOptions bad_map;
  if (pg->rank() == 1) bad_map.device_map = {{"cpu", "cuda:1000"}};
  nn::io::LoadOptions bad_device;
  if (pg->rank() == 2) bad_device.device = nn::Device(nn::DeviceType::kCUDA, 1000);
  const struct {
    std::function<void()> load;
    std::string expected;  // the message's beginning: the rest depends on the build
  } cases[] = {
      {[&] { LoadCheckpoint(*pg, path, bad_map); },
       "LoadCheckpoint " + path + ": nothing was read: invalid arguments on rank 1: device_map entry \"cpu\" -> "
       "\"cuda:1000\": "},
      {[&] { LoadCheckpointFromRank(*pg, path, 0, bad_device); },
       "LoadCheckpointFromRank " + path + ": nothing was read: invalid arguments on rank 2: LoadOptions::device: "},
  };
  for (const auto& c : cases) {
    pieces = 0;
    const Outcome refused = OutcomeOf<std::invalid_argument>(c.load);
    WORKER_EXPECT(refused.error.rfind(c.expected, 0) == 0 && refused.error.find("cuda:1000") != std::string::npos,
                  rank + " got: " + refused.error);
    WORKER_EXPECT(pieces == 0, rank + " read " + std::to_string(pieces.load()) + " pieces for a refused load");
    WORKER_EXPECT(refused.seconds < 20, rank + ": the error took " + std::to_string(refused.seconds) + " s");
  }
  WORKER_EXPECT(NextCollectivesError(*pg).empty(), rank + ": the group failed after the refused loads");
  // The hook does count a read's pieces: every rank's own, then root's.
  pieces = 0;
  WORKER_EXPECT(LoadCheckpoint(*pg, path).model.size() == 6 && pieces > 0,
                rank + ": the valid load read " + std::to_string(pieces.load()) + " pieces");
  pieces = 0;
  WORKER_EXPECT(LoadCheckpointFromRank(*pg, path, 0).model.size() == 6 && (pg->rank() != 0 || pieces > 0),
                rank + ": the valid load from rank 0 read " + std::to_string(pieces.load()) + " pieces");
  nn::io::internal::SetReadPieceHookForTesting({});
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, LoadOptionsThatOneRankRefusesFailEveryRankBeforeAnyRead) {
  auto run = RunWorkers("load_options_refused", 3, {{"DDP_TEST_CKPT", TempDir()}, {"DDP_TEST_TIMEOUT_MS", "60000"}},
                        180000, /*stop_all_on_failure=*/false);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Rank 1's memory runs out once it has read the checkpoint (DDP_TEST_CASE:
// every_rank, LoadCheckpoint, or from_rank, LoadCheckpointFromRank from
// rank 0), every allocation of its thread failing from there until just
// before the ranks exchange what they read. Before, rank 1 could build
// neither its account nor the exchange's buffers, and the std::bad_alloc
// left the call on rank 1 alone: ranks 0 and 2 waited for it in the
// exchange until the group's timeout (60 s here). Now the buffers are made
// before the read and the account is written in place: every rank throws
// at once naming rank 1 and that it ran out of memory, and the group goes
// on.
DDP_TEST_WORKER(load_runs_out_of_memory) {
  auto pg = testing::WorkerGroup();  // DDP_TEST_TIMEOUT_MS: 60 s
  const std::string which = std::getenv("DDP_TEST_CASE");
  const std::string path = std::string(std::getenv("DDP_TEST_CKPT")) + "/c.safetensors";
  SaveCheckpoint(*pg, path, MakeCheckpoint(*Mlp(1), nullptr));
  auto load = [&] { return which == "every_rank" ? LoadCheckpoint(*pg, path) : LoadCheckpointFromRank(*pg, path, 0); };
  if (pg->rank() == 1) {
    internal::SetFaultForTesting(internal::FaultPoint::kAccountingForLoad, [] { out_of_memory = true; });
    internal::SetFaultForTesting(internal::FaultPoint::kExchangingLoadAccounts, [] { out_of_memory = false; });
  }
  const Outcome failed = OutcomeOf<std::runtime_error>([&] { load(); });
  internal::SetFaultForTesting(internal::FaultPoint::kAccountingForLoad, {});
  internal::SetFaultForTesting(internal::FaultPoint::kExchangingLoadAccounts, {});
  const std::string who = which + ", rank " + std::to_string(pg->rank());
  const std::string expected =
      which == "every_rank"
          ? "LoadCheckpoint " + path + " failed on rank 1: saying what it read ran out of memory: std::bad_alloc"
          : "LoadCheckpointFromRank '" + path + "' (read by rank 0) failed on rank 1: loading the checkpoint ran "
                                                "out of memory: std::bad_alloc";
  WORKER_EXPECT(failed.error == expected, who + " got: " + failed.error);
  WORKER_EXPECT(failed.seconds < 20, who + ": the failure took " + std::to_string(failed.seconds) + " s");
  WORKER_EXPECT(NextCollectivesError(*pg).empty(), who + ": the group failed after the failed load");
  // With its memory back, rank 1 loads like the others.
  const size_t tensors = load().model.size();
  WORKER_EXPECT(tensors == Mlp(1)->GetStateDict().size(), who + ": the second load read " + std::to_string(tensors) +
                                                              " tensors");
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, ARankThatRunsOutOfMemoryAfterItsReadIsNamedOnEveryRankPromptly) {
  for (const char* which : {"every_rank", "from_rank"}) {
    auto run = RunWorkers("load_runs_out_of_memory", 3,
                          {{"DDP_TEST_CASE", which}, {"DDP_TEST_CKPT", TempDir()}, {"DDP_TEST_TIMEOUT_MS", "60000"}},
                          180000, /*stop_all_on_failure=*/false);
    EXPECT_TRUE(run.AllSucceeded()) << which << ":\n" << testing::AllOutput(run);
  }
}

// In LoadCheckpointFromRank, rank 1 cannot make room for the bytes rank 0
// read (DDP_TEST_CASE out_of_memory: a std::bad_alloc there, as when the
// checkpoint is larger than what memory rank 1 has left), or its group
// fails at that point (group_fails: rank 1 aborts it). Before, the
// std::bad_alloc left the call on rank 1 alone while ranks 0 and 2 waited
// for it in the broadcast of the bytes until the group's timeout (60 s
// here), and a group that failed there gave the broadcast's own error,
// naming neither the call nor the file. Now every rank throws at once
// naming rank 1 and what ran out, and the group goes on; a group that
// fails gives a DistributedError naming the call and what was being sent.
DDP_TEST_WORKER(from_rank_cannot_receive) {
  auto pg = testing::WorkerGroup();  // DDP_TEST_TIMEOUT_MS: 60 s
  const std::string which = std::getenv("DDP_TEST_CASE");
  const std::string path = std::string(std::getenv("DDP_TEST_CKPT")) + "/c.safetensors";
  SaveCheckpoint(*pg, path, MakeCheckpoint(*Mlp(1), nullptr));
  struct stat st;
  WORKER_EXPECT(stat(path.c_str(), &st) == 0, "no file at " + path);
  const std::string bytes = std::to_string(st.st_size);
  if (pg->rank() == 1) {
    internal::SetFaultForTesting(internal::FaultPoint::kReceivingCheckpoint, [which, &pg] {
      if (which == "out_of_memory") throw std::bad_alloc();
      pg->Abort(transport::InternalError("rank 1's test broke the group"));
    });
  }
  const std::string who = which + ", rank " + std::to_string(pg->rank());
  const std::string call = "LoadCheckpointFromRank '" + path + "' (read by rank 0)";
  if (which == "out_of_memory") {
    const Outcome failed = OutcomeOf<std::runtime_error>([&] { LoadCheckpointFromRank(*pg, path, 0); });
    internal::SetFaultForTesting(internal::FaultPoint::kReceivingCheckpoint, {});
    const std::string expected =
        call + " failed on rank 1: making room for the " + bytes + " bytes rank 0 read ran out of memory: std::bad_alloc";
    WORKER_EXPECT(failed.error == expected, who + " got: " + failed.error);
    // Well within the group's 60 s, which a rank left waiting would spend.
    WORKER_EXPECT(failed.seconds < 20, who + ": the failure took " + std::to_string(failed.seconds) + " s");
    WORKER_EXPECT(NextCollectivesError(*pg).empty(), who + ": the group failed after the failed load");
    // With room for them, rank 1 receives the bytes like the others.
    const size_t tensors = LoadCheckpointFromRank(*pg, path, 0).model.size();
    WORKER_EXPECT(tensors == Mlp(1)->GetStateDict().size(),
                  who + ": the second load read " + std::to_string(tensors) + " tensors");
  } else {
    const Outcome failed = OutcomeOf<DistributedError>([&] { LoadCheckpointFromRank(*pg, path, 0); });
    internal::SetFaultForTesting(internal::FaultPoint::kReceivingCheckpoint, {});
    // The group's code (INTERNAL, as rank 1 aborted it) and its reason.
    const std::string begins = "INTERNAL: " + call + ": nothing was loaded: the group failed while rank 0 sent the " +
                               bytes + " bytes it read: ";
    WORKER_EXPECT(failed.error.rfind(begins, 0) == 0 &&
                      failed.error.find("rank 1's test broke the group") != std::string::npos,
                  who + " got: " + failed.error);
    WORKER_EXPECT(failed.seconds < 20, who + ": the failure took " + std::to_string(failed.seconds) + " s");
  }
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, ARankThatCannotReceiveTheRootsBytesIsNamedOnEveryRankPromptly) {
  for (const char* which : {"out_of_memory", "group_fails"}) {
    auto run = RunWorkers("from_rank_cannot_receive", 3,
                          {{"DDP_TEST_CASE", which}, {"DDP_TEST_CKPT", TempDir()}, {"DDP_TEST_TIMEOUT_MS", "60000"}},
                          180000, /*stop_all_on_failure=*/false);
    EXPECT_TRUE(run.AllSucceeded()) << which << ":\n" << testing::AllOutput(run);
  }
}

// Mlp's layers with 11 outputs instead of 10: the same keys, with
// `5.weight` and `5.bias` of other shapes.
std::shared_ptr<nn::modules::Module> MlpWithElevenClasses(uint64_t seed) {
  nn::Generator gen(seed);
  using namespace nn::modules;
  return std::make_shared<Sequential>(std::initializer_list<std::shared_ptr<Module>>{
      std::make_shared<Flatten>(), std::make_shared<Linear>(784, 512, true, gen), std::make_shared<ReLU>(),
      std::make_shared<Linear>(512, 256, true, gen), std::make_shared<ReLU>(),
      std::make_shared<Linear>(256, 11, true, gen)});
}

// Rank 1 built another model than the checkpoint's. Restored rank by rank,
// only rank 1 fails: the others restore and would go on to their first
// collective, to wait for rank 1 until the group's timeout (minutes in a
// real job). Restored collectively, every rank throws at once, naming rank
// 1 and the parameter, and no rank's model or optimizer has changed.
DDP_TEST_WORKER(restore_on_every_rank) {
  auto pg = testing::WorkerGroup();  // DDP_TEST_TIMEOUT_MS: 60 s
  const std::string path = std::string(std::getenv("DDP_TEST_CKPT")) + "/c.safetensors";
  auto saved = Mlp(1);
  nn::optim::Sgd saved_opt(saved->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  SaveCheckpoint(*pg, path, MakeCheckpoint(*saved, &saved_opt));
  const nn::io::Checkpoint c = LoadCheckpoint(*pg, path);
  auto build = [&pg] { return pg->rank() == 1 ? MlpWithElevenClasses(99) : Mlp(99); };
  {
    auto alone = build();
    nn::optim::Sgd alone_opt(alone->NamedParameters(), {.lr = 0.01, .momentum = 0.9});
    std::string error;
    try {
      RestoreCheckpoint(c, *alone, &alone_opt);
    } catch (const std::invalid_argument& e) {
      error = e.what();
    }
    WORKER_EXPECT(error.empty() == (pg->rank() != 1), "the rank-local restore: " + error);
  }
  auto model = build();
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.01, .momentum = 0.9});
  const uint64_t before = testing::HashState(*model);
  std::string error;
  const auto start = std::chrono::steady_clock::now();
  try {
    RestoreCheckpoint(*pg, c, *model, &opt);
  } catch (const std::invalid_argument& e) {
    error = e.what();
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  WORKER_EXPECT(error.find("RestoreCheckpoint: nothing was restored on any rank, it failed on rank 1: ") == 0 &&
                    error.find("`5.weight`: expected [11, 256]") != std::string::npos &&
                    error.find("rank 0:") == std::string::npos && error.find("rank 2:") == std::string::npos,
                "rank " + std::to_string(pg->rank()) + " got: " + error);
  // Well within the group's 60 s, which a rank left waiting would spend.
  WORKER_EXPECT(took < 20, "the failure took " + std::to_string(took) + " s to reach every rank");
  WORKER_EXPECT(testing::HashState(*model) == before, "the model was changed");
  WORKER_EXPECT(opt.lr() == 0.01, "the optimizer's lr is " + std::to_string(opt.lr()));
  // Nothing was aborted: the group goes on, and with the checkpoint's
  // model on every rank the collective restore restores it everywhere.
  WORKER_EXPECT(NextCollectivesError(*pg).empty(), "the group failed after the refused restore");
  auto right = Mlp(99);
  nn::optim::Sgd right_opt(right->NamedParameters(), {.lr = 0.01, .momentum = 0.9});
  RestoreCheckpoint(*pg, c, *right, &right_opt);
  WORKER_EXPECT(testing::HashState(*right) == testing::HashState(*saved), "the restored model differs");
  WORKER_EXPECT(right_opt.lr() == 0.05, "the restored lr is " + std::to_string(right_opt.lr()));
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, ARankThatCannotRestoreFailsEveryRankPromptlyAndChangesNothing) {
  const std::string dir = TempDir();
  auto run = RunWorkers("restore_on_every_rank", 3, {{"DDP_TEST_CKPT", dir}, {"DDP_TEST_TIMEOUT_MS", "60000"}},
                        180000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// One SGD step of `model` alone on the batch at `at`.
void LocalStep(nn::modules::Module& model, nn::optim::Sgd& opt, int64_t at) {
  auto [x, y] = testing::Batch(testing::FashionMnist(), at, kBatch);
  opt.ZeroGrad();
  nn::Backward(nn::loss::CrossEntropy(model(x), y));
  opt.Step();
}

// What most restore tests restore: Mlp(1) with SGD at rate 0.05 under a
// constant LambdaSchedule ("decay") three steps in, saved with `scaler`
// when given. `trained`: the SGD has momentum 0.9 and took one step (on
// the batch at 0) first, so that it has momentum buffers to save.
struct SavedMlp {
  explicit SavedMlp(bool trained, const nn::optim::GradScaler* scaler = nullptr)
      : model(Mlp(1)), opt(model->NamedParameters(), {.lr = 0.05, .momentum = trained ? 0.9 : 0.0}) {
    if (trained) LocalStep(*model, opt, 0);
    sched.emplace(opt, nn::optim::LambdaSchedule([](int64_t) { return 1.0; }, "decay"));
    for (int s = 0; s < 3; ++s) sched->Step();
    checkpoint = MakeCheckpoint(*model, &opt, {}, &*sched, scaler);
  }
  std::shared_ptr<nn::modules::Module> model;
  nn::optim::Sgd opt;
  std::optional<nn::optim::LrScheduler> sched;  // made after the step
  nn::io::Checkpoint checkpoint;
};

// Rank 1's checks fail in a way of DDP_TEST_CASE's:
// - non_std: its scheduler function throws something that is no
//   std::exception (an int) for the saved step. Before, it escaped rank
//   1's checks past the exchange of outcomes, and the other ranks waited
//   for rank 1 until the group's timeout (60 s here).
// - out_of_memory: its memory runs out as its checks begin, every
//   allocation of its thread failing from there until just before the
//   exchange of the outcomes. Before, the handler that caught the
//   std::bad_alloc built its message, which threw again, out of the call:
//   rank 1 left alone, and the others waited for it in the exchange until
//   the group's timeout.
// Now it is rank 1's problem like any other: every rank throws at once
// naming rank 1 and what failed, nothing is restored, and the group goes
// on.
DDP_TEST_WORKER(restore_checks_fail_on_one_rank) {
  auto pg = testing::WorkerGroup();  // DDP_TEST_TIMEOUT_MS: 60 s
  const std::string which = std::getenv("DDP_TEST_CASE");
  const SavedMlp saved(/*trained=*/false);
  const nn::io::Checkpoint& c = saved.checkpoint;
  auto model = Mlp(99);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1});
  const bool throws = pg->rank() == 1 && which == "non_std";
  nn::optim::LrScheduler sched(opt, nn::optim::LambdaSchedule(
                                        [throws](int64_t t) -> double {
                                          if (throws && t > 1) throw 42;
                                          return 1.0;
                                        },
                                        "decay"));
  if (pg->rank() == 1 && which == "out_of_memory") {
    internal::SetFaultForTesting(internal::FaultPoint::kCheckingRestore, [] { out_of_memory = true; });
    internal::SetFaultForTesting(internal::FaultPoint::kExchangingRestoreChecks, [] { out_of_memory = false; });
  }
  const uint64_t before = testing::HashState(*model);
  const Outcome restore = OutcomeOf<std::invalid_argument>([&] { RestoreCheckpoint(*pg, c, *model, &opt, &sched); });
  internal::SetFaultForTesting(internal::FaultPoint::kCheckingRestore, {});
  internal::SetFaultForTesting(internal::FaultPoint::kExchangingRestoreChecks, {});
  const std::string who = "rank " + std::to_string(pg->rank());
  const std::string why = which == "non_std" ? "1 problem(s):\n  checking the scheduler's state threw an exception "
                                               "that is not a std::exception"
                                             : "checking the checkpoint ran out of memory: std::bad_alloc";
  WORKER_EXPECT(restore.error == "RestoreCheckpoint: nothing was restored on any rank, it failed on rank 1: " + why,
                who + " got: " + restore.error);
  WORKER_EXPECT(restore.seconds < 20, who + ": the failure took " + std::to_string(restore.seconds) + " s");
  WORKER_EXPECT(testing::HashState(*model) == before, who + ": the model was changed");
  WORKER_EXPECT(opt.lr() == 0.1 && sched.step_count() == 0, who + ": the optimizer or the scheduler was changed");
  WORKER_EXPECT(NextCollectivesError(*pg).empty(), who + ": the group failed after the failed restore");
  if (which == "out_of_memory") {
    // With its memory back, rank 1 restores like the others.
    RestoreCheckpoint(*pg, c, *model, &opt, &sched);
    WORKER_EXPECT(testing::HashState(*model) == testing::HashState(*saved.model) && sched.step_count() == 3,
                  who + ": the second restore");
  }
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, ANonStdExceptionInOneRanksChecksFailsEveryRankPromptlyNamingIt) {
  auto run = RunWorkers("restore_checks_fail_on_one_rank", 3,
                        {{"DDP_TEST_CASE", "non_std"}, {"DDP_TEST_TIMEOUT_MS", "60000"}}, 180000,
                        /*stop_all_on_failure=*/false);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

TEST(DdpCheckpointTest, ARankWhoseChecksRunOutOfMemoryIsNamedOnEveryRankPromptly) {
  auto run = RunWorkers("restore_checks_fail_on_one_rank", 3,
                        {{"DDP_TEST_CASE", "out_of_memory"}, {"DDP_TEST_TIMEOUT_MS", "60000"}}, 180000,
                        /*stop_all_on_failure=*/false);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ----------------------------------------------------- non-strict ----

// Mlp's layers with its head (`5`, Linear(256, 10)) replaced: with
// `renamed`, by Linear(256, 5) under `6` (an Identity at `5`), otherwise by
// Linear(256, 5) under the same name.
std::shared_ptr<nn::modules::Module> MlpWithNewHead(uint64_t seed, bool renamed) {
  nn::Generator gen(seed);
  auto model = std::make_shared<nn::modules::Sequential>();
  model->Push(std::make_shared<nn::modules::Flatten>());
  model->Push(std::make_shared<nn::modules::Linear>(784, 512, true, gen));
  model->Push(std::make_shared<nn::modules::ReLU>());
  model->Push(std::make_shared<nn::modules::Linear>(512, 256, true, gen));
  model->Push(std::make_shared<nn::modules::ReLU>());
  if (renamed) model->Push(std::make_shared<nn::modules::Identity>());
  model->Push(std::make_shared<nn::modules::Linear>(256, 5, true, gen));
  return model;
}

std::vector<std::string> StateBytes(const nn::modules::Module& m);

// Whether `a` and `b` hold the same bytes.
bool SameBytes(const nn::Tensor& a, const nn::Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

// The value of `name` in `model`'s state dict.
nn::Tensor StateOf(const nn::modules::Module& model, const std::string& name) {
  for (const auto& [key, t] : model.GetStateDict()) {
    if (key == name) return t;
  }
  throw std::invalid_argument("no key `" + name + "`");
}

// Fine-tuning from a checkpoint of Mlp(1) (with its SGD's state) into a
// model with a new head, on every rank:
// - strict (the default): refused on every rank as before, naming the
//   keys, nothing changed;
// - strict = false, the model alone (the optimizer list cleared): the body
//   (`1.*`, `3.*`) is loaded, the new head keeps its values, and every
//   rank returns the head's keys as missing and the old head's as
//   unexpected; the one-rank overload returns the same;
// - strict = false with the optimizer, whose state names the old head's
//   parameters: refused, naming them, nothing changed;
// - a head of another shape under the old name: refused even when not
//   strict (as PyTorch), naming the key;
// - rank 1 built another model (the saved one: it skips nothing): every
//   rank refuses, naming rank 1, nothing changed.
DDP_TEST_WORKER(restore_new_head) {
  auto pg = testing::WorkerGroup();
  const std::string who = "rank " + std::to_string(pg->rank());
  const SavedMlp saved(/*trained=*/false);
  nn::io::Checkpoint model_only = saved.checkpoint;
  model_only.optimizer.clear();
  const RestoreOptions loose{.strict = false};

  auto model = MlpWithNewHead(99, /*renamed=*/true);
  const uint64_t before = testing::HashState(*model);
  const nn::Tensor head_before = StateOf(*model, "6.weight").Clone();

  const Outcome strict = OutcomeOf<std::invalid_argument>([&] { RestoreCheckpoint(*pg, model_only, *model, nullptr); });
  WORKER_EXPECT(strict.error.find("RestoreCheckpoint: nothing was restored on any rank, it failed on rank 0: ") == 0 &&
                    strict.error.find("6.weight") != std::string::npos &&
                    strict.error.find("5.weight") != std::string::npos,
                who + " got: " + strict.error);
  WORKER_EXPECT(testing::HashState(*model) == before, who + ": the strict restore changed the model");

  nn::modules::IncompatibleKeys keys = RestoreCheckpoint(*pg, model_only, *model, nullptr, nullptr, nullptr, nullptr,
                                                         nullptr, nullptr, nullptr, loose);
  const std::vector<std::string> missing{"6.weight", "6.bias"};
  const std::vector<std::string> unexpected{"5.weight", "5.bias"};
  WORKER_EXPECT(keys.missing == missing && keys.unexpected == unexpected,
                who + ": missing " + std::to_string(keys.missing.size()) + ", unexpected " +
                    std::to_string(keys.unexpected.size()));
  for (const char* name : {"1.weight", "1.bias", "3.weight", "3.bias"}) {
    WORKER_EXPECT(SameBytes(StateOf(*model, name), StateOf(*saved.model, name)), who + ": `" + name + "` not loaded");
  }
  WORKER_EXPECT(SameBytes(StateOf(*model, "6.weight"), head_before), who + ": the new head was changed");
  auto alone = MlpWithNewHead(98, /*renamed=*/true);
  keys = RestoreCheckpoint(model_only, *alone, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, loose);
  WORKER_EXPECT(keys.missing == missing && keys.unexpected == unexpected, who + ": the one-rank overload's keys");
  WORKER_EXPECT(SameBytes(StateOf(*alone, "3.weight"), StateOf(*saved.model, "3.weight")),
                who + ": the one-rank overload did not load `3.weight`");

  auto fresh = MlpWithNewHead(97, /*renamed=*/true);
  nn::optim::Sgd opt(fresh->NamedParameters(), {.lr = 0.1});
  const uint64_t fresh_before = testing::HashState(*fresh);
  const Outcome with_opt = OutcomeOf<std::invalid_argument>([&] {
    RestoreCheckpoint(*pg, saved.checkpoint, *fresh, &opt, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, loose);
  });
  WORKER_EXPECT(with_opt.error.find("RestoreOptions::strict = false, and the checkpoint's optimizer state names "
                                    "parameters the model does not load (`5.weight`, `5.bias`)") != std::string::npos,
                who + " got: " + with_opt.error);
  WORKER_EXPECT(testing::HashState(*fresh) == fresh_before && opt.lr() == 0.1,
                who + ": the refused restore changed the model or the optimizer");

  auto reshaped = MlpWithNewHead(96, /*renamed=*/false);
  const uint64_t reshaped_before = testing::HashState(*reshaped);
  const Outcome shape = OutcomeOf<std::invalid_argument>([&] {
    RestoreCheckpoint(*pg, model_only, *reshaped, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                      loose);
  });
  WORKER_EXPECT(shape.error.find("nothing was restored on any rank") != std::string::npos &&
                    shape.error.find("5.weight") != std::string::npos,
                who + " got: " + shape.error);
  WORKER_EXPECT(testing::HashState(*reshaped) == reshaped_before, who + ": the refused restore changed the model");

  auto mixed = pg->rank() == 1 ? Mlp(95) : MlpWithNewHead(95, /*renamed=*/true);
  const uint64_t mixed_before = testing::HashState(*mixed);
  const Outcome differ = OutcomeOf<std::invalid_argument>([&] {
    RestoreCheckpoint(*pg, model_only, *mixed, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, loose);
  });
  const std::string skips = pg->rank() == 1 ? "missing keys none and unexpected keys none"
                                            : "missing keys `6.weight`, `6.bias` and unexpected keys `5.weight`, "
                                              "`5.bias`";
  WORKER_EXPECT(differ.error == "RestoreCheckpoint: nothing was restored on any rank, the ranks would load different "
                                "keys of the model (RestoreOptions::strict = false): rank 1 skips other keys than "
                                "rank 0; this rank (" +
                                    std::to_string(pg->rank()) + ") skips " + skips +
                                    ": every rank must build the same model",
                who + " got: " + differ.error);
  WORKER_EXPECT(testing::HashState(*mixed) == mixed_before, who + ": the refused restore changed the model");
  WORKER_EXPECT(NextCollectivesError(*pg).empty(), who + ": the group failed after the refused restores");

  // Rollback still works when not strict: rank 1's scheduler target
  // refuses the saved rate once every check passed, and every rank puts
  // its model (body loaded by then) back as it was.
  nn::io::Checkpoint with_sched = model_only;
  for (const auto& [key, t] : saved.checkpoint.optimizer) {
    if (key.rfind("scheduler.", 0) == 0) with_sched.optimizer.emplace_back(key, t);
  }
  auto rolled = MlpWithNewHead(94, /*renamed=*/true);
  const std::vector<std::string> rolled_before = StateBytes(*rolled);
  double rate = 0.01;
  nn::optim::LrTarget target{[&rate] { return rate; },
                             [&rate, &pg](double lr) {
                               if (pg->rank() == 1 && lr > 0.02) {
                                 throw std::runtime_error("rank 1's target refuses the rate");
                               }
                               rate = lr;
                             }};
  nn::optim::LrScheduler sched(target, nn::optim::LambdaSchedule([](int64_t) { return 1.0; }, "decay"));
  const Outcome rollback = OutcomeOf<std::runtime_error>([&] {
    RestoreCheckpoint(*pg, with_sched, *rolled, nullptr, &sched, nullptr, nullptr, nullptr, nullptr, nullptr, loose);
  });
  WORKER_EXPECT(rollback.error.find("loading failed on rank 1: loading the scheduler's state threw: rank 1's "
                                    "target refuses the rate (the model was loaded before it); every rank put its "
                                    "model and components back") != std::string::npos,
                who + " got: " + rollback.error);
  WORKER_EXPECT(StateBytes(*rolled) == rolled_before && sched.step_count() == 0,
                who + ": the model or the scheduler was not put back");
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, ANonStrictRestoreLoadsTheBodyIntoAModelWithANewHeadAndReportsTheKeys) {
  auto run = RunWorkers("restore_new_head", 2, {{"DDP_TEST_TIMEOUT_MS", "60000"}}, 180000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// On rank 1, making the buffers of the first exchange of a collective call
// throws std::bad_alloc (memory running out; DDP_TEST_CASE names the call:
// save and load fail in the comparison of the arguments, load_account and
// from_rank_account in LoadCheckpoint's and LoadCheckpointFromRank's
// account of the read, restore in RestoreCheckpoint's exchange of the
// checks). Before, the std::bad_alloc took rank 1 out of the call alone,
// while ranks 0 and 2 waited for it in that exchange until the group's
// timeout (60 s here; a LoadCheckpoint's, as long as the reads). Now rank 1
// aborts the group before it rethrows: ranks 0 and 2 throw the group's
// DistributedError at once, naming the call, rank 1 and what threw, and
// their model is as it was.
DDP_TEST_WORKER(first_buffers_out_of_memory) {
  auto pg = testing::WorkerGroup();  // DDP_TEST_TIMEOUT_MS: 60 s
  const std::string which = std::getenv("DDP_TEST_CASE");
  const std::string path = std::string(std::getenv("DDP_TEST_CKPT")) + "/c.safetensors";
  const SavedMlp saved(/*trained=*/false);
  if (which != "save") SaveCheckpoint(*pg, path, saved.checkpoint);
  auto model = Mlp(99);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1});
  nn::optim::LrScheduler sched(opt, nn::optim::LambdaSchedule([](int64_t) { return 1.0; }, "decay"));
  const uint64_t before = testing::HashState(*model);
  // The fault's run that throws: the first exchange of a load compares
  // the arguments, its second is the account of the read.
  const bool account = which == "load_account" || which == "from_rank_account";
  const int failing_run = account ? 2 : 1;
  if (pg->rank() == 1) {
    // Shared: each run has its own copy of the function.
    auto runs = std::make_shared<int>(0);
    internal::SetFaultForTesting(internal::FaultPoint::kMakingFirstBuffers, [runs, failing_run] {
      if (++*runs == failing_run) throw std::bad_alloc();
    });
  }
  std::string call;
  auto run = [&] {
    if (which == "save") {
      call = "SaveCheckpoint " + path;
      SaveCheckpoint(*pg, path, saved.checkpoint);
    } else if (which == "load" || which == "load_account") {
      call = "LoadCheckpoint " + path;
      LoadCheckpoint(*pg, path);
    } else if (which == "from_rank_account") {
      call = "LoadCheckpointFromRank " + path;
      LoadCheckpointFromRank(*pg, path, 0);
    } else {
      call = "RestoreCheckpoint";
      RestoreCheckpoint(*pg, saved.checkpoint, *model, &opt, &sched);
    }
  };
  const std::string who = which + ", rank " + std::to_string(pg->rank());
  if (pg->rank() == 1) {
    std::string outcome = "no error";
    try {
      run();
    } catch (const std::bad_alloc&) {
      outcome = "std::bad_alloc";
    } catch (const std::exception& e) {
      outcome = std::string("another exception: ") + e.what();
    }
    internal::SetFaultForTesting(internal::FaultPoint::kMakingFirstBuffers, {});
    WORKER_EXPECT(outcome == "std::bad_alloc", who + " got: " + outcome);
    testing::StayAliveUntilTheOtherRanksAreDone(*pg, std::chrono::seconds(90));
    return testing::WorkerExit();
  }
  const Outcome failed = OutcomeOf<DistributedError>(run);
  testing::MarkThisRankDone(*pg);
  WORKER_EXPECT(failed.error.find(call) != std::string::npos &&
                    failed.error.find("rank 1 could not make the buffers to exchange its outcome with the other "
                                      "ranks: std::bad_alloc") != std::string::npos,
                who + " got: " + failed.error);
  WORKER_EXPECT(failed.seconds < 20, who + ": the failure took " + std::to_string(failed.seconds) + " s");
  WORKER_EXPECT(testing::HashState(*model) == before, who + ": the model was changed");
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, ARankWithNoMemoryForAFirstExchangesBuffersFailsEveryRankPromptly) {
  for (const char* which : {"save", "load", "load_account", "from_rank_account", "restore"}) {
    auto run = RunWorkers("first_buffers_out_of_memory", 3,
                          {{"DDP_TEST_CASE", which}, {"DDP_TEST_CKPT", TempDir()}, {"DDP_TEST_TIMEOUT_MS", "60000"}},
                          180000, /*stop_all_on_failure=*/false);
    EXPECT_TRUE(run.AllSucceeded()) << which << ":\n" << testing::AllOutput(run);
  }
}

// What a rank prepares alone between two exchanges of a collective call
// (the arguments' messages, then SaveCheckpoint's copy of the checkpoint,
// LoadCheckpoint's messages and work, LoadCheckpointFromRank's copy of
// root's path, then its messages and work, and the status buffer and
// thread of the wait that follows) throws on rank DDP_TEST_RANK, at its
// DDP_TEST_RUN'th such place in DDP_TEST_CASE's call, as when memory runs
// out (DDP_TEST_THROW bad_alloc), or as another failure (runtime_error).
// Before, that rank left the call alone and the others waited for it in
// the next exchange until the group's timeout (60 s here). Now it aborts
// the group first: the others throw at once, naming the call, that rank
// and what threw, with RESOURCE_EXHAUSTED for memory and ABORTED
// otherwise, and a save writes nothing unless rank 0 had begun its write
// (which a group failure lets finish). No rank's error blames rank 0's
// write or read, which did not fail (the wait's guard used to abort with
// the text meant for that).
DDP_TEST_WORKER(preparing_alone_throws) {
  auto pg = testing::WorkerGroup();  // DDP_TEST_TIMEOUT_MS: 60 s
  const std::string which = std::getenv("DDP_TEST_CASE");
  const int failing_rank = std::atoi(std::getenv("DDP_TEST_RANK"));
  const int failing_run = std::atoi(std::getenv("DDP_TEST_RUN"));
  const bool out_of_memory = std::string(std::getenv("DDP_TEST_THROW")) == "bad_alloc";
  const std::string path = std::string(std::getenv("DDP_TEST_CKPT")) + "/c.safetensors";
  const SavedMlp saved(/*trained=*/false);
  if (which != "save") SaveCheckpoint(*pg, path, saved.checkpoint);
  if (pg->rank() == failing_rank) {
    auto runs = std::make_shared<int>(0);
    internal::SetFaultForTesting(internal::FaultPoint::kPreparingAlone, [runs, failing_run, out_of_memory] {
      if (++*runs != failing_run) return;
      if (out_of_memory) throw std::bad_alloc();
      throw std::runtime_error("the fault's failure");
    });
  }
  auto run = [&] {
    if (which == "save") {
      SaveCheckpoint(*pg, path, saved.checkpoint);
    } else if (which == "load") {
      LoadCheckpoint(*pg, path);
    } else {
      LoadCheckpointFromRank(*pg, path, 0);
    }
  };
  const std::string who = which + " run " + std::to_string(failing_run) + ", rank " + std::to_string(pg->rank());
  if (pg->rank() == failing_rank) {
    std::string outcome = "no error";
    try {
      run();
    } catch (const std::bad_alloc&) {
      outcome = "std::bad_alloc";
    } catch (const std::exception& e) {
      outcome = std::string("another exception: ") + e.what();
    }
    internal::SetFaultForTesting(internal::FaultPoint::kPreparingAlone, {});
    // LoadCheckpoint puts its call before a std::runtime_error's message.
    WORKER_EXPECT(out_of_memory ? outcome == "std::bad_alloc"
                                : outcome.rfind("another exception: ", 0) == 0 &&
                                      outcome.find("the fault's failure") != std::string::npos,
                  who + " got: " + outcome);
    if (which == "save" && pg->rank() == 0) WORKER_EXPECT(access(path.c_str(), F_OK) != 0, who + ": written");
    testing::StayAliveUntilTheOtherRanksAreDone(*pg, std::chrono::seconds(90));
    return testing::WorkerExit();
  }
  const Outcome failed = OutcomeOf<DistributedError>(run);
  testing::MarkThisRankDone(*pg);
  const std::string call = which == "save" ? "SaveCheckpoint" : which == "load" ? "LoadCheckpoint"
                                                                                 : "LoadCheckpointFromRank";
  const std::string code = out_of_memory ? "RESOURCE_EXHAUSTED: " : "ABORTED: ";
  WORKER_EXPECT(failed.error.rfind(code, 0) == 0 && failed.error.find(call + " ") != std::string::npos &&
                    failed.error.find("rank " + std::to_string(failing_rank) +
                                      " threw while it prepared its part, before the ranks' next exchange: " +
                                      (out_of_memory ? "std::bad_alloc" : "the fault's failure")) != std::string::npos,
                who + " got: " + failed.error);
  WORKER_EXPECT(failed.error.find("could not write") == std::string::npos &&
                    failed.error.find("could not read") == std::string::npos,
                who + " blames a write or read that did not fail: " + failed.error);
  WORKER_EXPECT(failed.seconds < 20, who + ": the failure took " + std::to_string(failed.seconds) + " s");
  // Once the arguments agreed, rank 0 may have begun its write, which a
  // group failure lets finish.
  if (which == "save" && pg->rank() == 0 && failing_run == 1) {
    WORKER_EXPECT(access(path.c_str(), F_OK) != 0, who + ": written");
  }
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, ARankThatThrowsWhilePreparingAloneFailsEveryRankPromptly) {
  struct Case {
    const char* which;
    int rank;
    int runs;  // the places in the call, each tried in turn
    const char* thrown = "bad_alloc";
    bool only_the_wait = false;  // the last place alone: the wait's guard
  };
  for (const Case c :
       {Case{"save", 1, 3}, Case{"save", 0, 3, "bad_alloc", true}, Case{"load", 1, 3}, Case{"from_rank", 1, 4},
        Case{"save", 1, 3, "runtime_error", true}, Case{"load", 1, 3, "runtime_error", true}}) {
    for (int run = 1; run <= c.runs; ++run) {
      if (c.only_the_wait && run < c.runs) continue;
      auto workers = RunWorkers("preparing_alone_throws", 3,
                                {{"DDP_TEST_CASE", c.which},
                                 {"DDP_TEST_RANK", std::to_string(c.rank)},
                                 {"DDP_TEST_RUN", std::to_string(run)},
                                 {"DDP_TEST_THROW", c.thrown},
                                 {"DDP_TEST_CKPT", TempDir()},
                                 {"DDP_TEST_TIMEOUT_MS", "60000"}},
                                180000, /*stop_all_on_failure=*/false);
      EXPECT_TRUE(workers.AllSucceeded())
          << c.which << " run " << run << " on rank " << c.rank << ", " << c.thrown << ":\n"
          << testing::AllOutput(workers);
    }
  }
}

// Every rank's checks pass, then rank 1's load throws: its scheduler drives
// the optimizer's rate through a target (as one drives a sharded
// optimizer's slices) that refuses rates above 0.02, and the saved rate is
// 0.05. The check cannot ask the target, as asking would set the rate:
// the refusal comes during the load. Before, rank 1 threw alone, its model
// and optimizer already restored, and ranks 0 and 2 returned as if all
// went well, to go on and wait for rank 1 at their next collective. Now
// every rank throws at once, naming rank 1, the part that failed and what
// had been loaded before it; without RestoreOptions::rollback, the objects
// are where the header says, and the group goes on.
DDP_TEST_WORKER(restore_load_throws_after_the_checks) {
  auto pg = testing::WorkerGroup();  // DDP_TEST_TIMEOUT_MS: 60 s
  const SavedMlp saved(/*trained=*/false);
  const nn::io::Checkpoint& c = saved.checkpoint;
  auto model = Mlp(99);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.01});
  auto refuses = std::make_shared<bool>(pg->rank() == 1);
  nn::optim::LrTarget target{[&opt] { return opt.lr(); },
                             [&opt, refuses](double lr) {
                               if (*refuses && lr > 0.02) {
                                 throw std::runtime_error("rank 1's target refuses rates above 0.02");
                               }
                               opt.set_lr(lr);
                             }};
  nn::optim::LrScheduler sched(target, nn::optim::LambdaSchedule([](int64_t) { return 1.0; }, "decay"));
  std::string error = "no error";
  const auto start = std::chrono::steady_clock::now();
  try {
    RestoreCheckpoint(*pg, c, *model, &opt, &sched, nullptr, nullptr, nullptr, nullptr, nullptr, {.rollback = false});
  } catch (const std::runtime_error& e) {
    error = e.what();
  } catch (...) {
    error = "an exception that is not a std::runtime_error";
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  WORKER_EXPECT(error == "RestoreCheckpoint: every rank's checks passed, but loading failed on rank 1: loading "
                         "the scheduler's state threw: rank 1's target refuses rates above 0.02 (the model and "
                         "the optimizer were loaded before it); the ranks that did not fail loaded every part: "
                         "restore again on every rank before training",
                "rank " + std::to_string(pg->rank()) + " got: " + error);
  WORKER_EXPECT(took < 20, "the failure took " + std::to_string(took) + " s to reach every rank");
  // As the header says: every rank's model and optimizer hold the
  // checkpoint's state; rank 1's scheduler is as it was, the others' loaded.
  WORKER_EXPECT(testing::HashState(*model) == testing::HashState(*saved.model), "the model was not loaded");
  WORKER_EXPECT(sched.step_count() == (*refuses ? 0 : 3), "the scheduler's step is " +
                                                              std::to_string(sched.step_count()));
  WORKER_EXPECT(NextCollectivesError(*pg).empty(), "the group failed after the failed restore");
  // Restored again (the target now takes the rate), every rank succeeds.
  *refuses = false;
  RestoreCheckpoint(*pg, c, *model, &opt, &sched);
  WORKER_EXPECT(sched.step_count() == 3 && opt.lr() == 0.05, "the second restore");
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, ALoadThatFailsOnOneRankAfterTheChecksFailsEveryRankPromptlyNamingIt) {
  auto run = RunWorkers("restore_load_throws_after_the_checks", 3, {{"DDP_TEST_TIMEOUT_MS", "60000"}}, 180000,
                        /*stop_all_on_failure=*/false);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Every byte of the model's parameters and buffers.
std::vector<std::string> StateBytes(const nn::modules::Module& m) {
  std::vector<std::string> out;
  for (const auto& [name, t] : m.GetStateDict()) {
    const Tensor c = t.Detach().Contiguous();
    out.emplace_back(static_cast<const char*>(c.data_ptr()), c.nbytes());
  }
  return out;
}

std::vector<std::string> StateBytes(const nn::optim::NamedTensors& state) {
  std::vector<std::string> out;
  for (const auto& [name, t] : state) {
    const Tensor c = t.Detach().Contiguous();
    out.emplace_back(name + "=" + std::string(static_cast<const char*>(c.data_ptr()), c.nbytes()));
  }
  return out;
}

// As above, rank 1's target refuses the saved rate during the load, after
// every check passed; now with RestoreOptions::rollback, the default. All
// or nothing: every rank puts its model, its optimizer (momentum buffers,
// steps, rate), its scheduler (step, base rate, and the rate set by hand
// since its last step) and its scaler (which ranks 0 and 2 loaded) back,
// bitwise as they were before the call.
// Before, ranks 0 and 2 kept the checkpoint's state in every part and rank
// 1 in its model and optimizer.
DDP_TEST_WORKER(restore_load_throws_and_every_rank_puts_its_state_back) {
  auto pg = testing::WorkerGroup();  // DDP_TEST_TIMEOUT_MS: 60 s
  nn::optim::GradScaler saved_scaler({.init_scale = 1024});
  const SavedMlp saved(/*trained=*/true, &saved_scaler);
  const nn::io::Checkpoint& c = saved.checkpoint;
  auto model = Mlp(99);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.01, .momentum = 0.9});
  auto refuses = std::make_shared<bool>(pg->rank() == 1);
  nn::optim::LrTarget target{[&opt] { return opt.lr(); },
                             [&opt, refuses](double lr) {
                               if (*refuses && lr > 0.02) {
                                 throw std::runtime_error("rank 1's target refuses rates above 0.02");
                               }
                               opt.set_lr(lr);
                             }};
  nn::optim::LrScheduler sched(target, nn::optim::LambdaSchedule([](int64_t) { return 1.0; }, "decay"));
  LocalStep(*model, opt, kBatch * (1 + pg->rank()));
  sched.Step();
  opt.set_lr(0.0125);  // by hand, after the scheduler's step
  const std::vector<std::string> model_before = StateBytes(*model);
  const std::vector<std::string> opt_before = StateBytes(opt.StateDict());
  const std::vector<double> base_lrs_before = sched.base_lrs();
  nn::optim::GradScaler scaler({.init_scale = 8});
  const std::vector<std::string> scaler_before = StateBytes(scaler.StateDict());
  std::string error = "no error";
  try {
    RestoreCheckpoint(*pg, c, *model, &opt, &sched, &scaler);
  } catch (const std::runtime_error& e) {
    error = e.what();
  } catch (...) {
    error = "an exception that is not a std::runtime_error";
  }
  const std::string rank = "rank " + std::to_string(pg->rank());
  WORKER_EXPECT(error == "RestoreCheckpoint: every rank's checks passed, but loading failed on rank 1: loading "
                         "the scheduler's state threw: rank 1's target refuses rates above 0.02 (the model and "
                         "the optimizer were loaded before it); every rank put its model and components back as "
                         "they were before the call",
                rank + " got: " + error);
  WORKER_EXPECT(StateBytes(*model) == model_before, rank + ": the model is not as it was");
  WORKER_EXPECT(StateBytes(opt.StateDict()) == opt_before, rank + ": the optimizer is not as it was");
  WORKER_EXPECT(opt.lr() == 0.0125, rank + ": the rate is " + std::to_string(opt.lr()));
  WORKER_EXPECT(StateBytes(scaler.StateDict()) == scaler_before, rank + ": the scaler is not as it was");
  WORKER_EXPECT(sched.step_count() == 1 && sched.base_lrs() == base_lrs_before,
                rank + ": the scheduler's step is " + std::to_string(sched.step_count()) + ", its base rate " +
                    std::to_string(sched.base_lr()));
  WORKER_EXPECT(NextCollectivesError(*pg).empty(), "the group failed after the failed restore");
  // Restored again (the target now takes the rate), every rank succeeds.
  *refuses = false;
  RestoreCheckpoint(*pg, c, *model, &opt, &sched, &scaler);
  WORKER_EXPECT(testing::HashState(*model) == testing::HashState(*saved.model) && sched.step_count() == 3 &&
                    opt.lr() == 0.05 && StateBytes(opt.StateDict()) == StateBytes(saved.opt.StateDict()) &&
                    StateBytes(scaler.StateDict()) == StateBytes(saved_scaler.StateDict()),
                rank + ": the second restore");
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, ALoadThatFailsOnOneRankAfterTheChecksPutsEveryRanksStateBackBitwise) {
  auto run = RunWorkers("restore_load_throws_and_every_rank_puts_its_state_back", 3,
                        {{"DDP_TEST_TIMEOUT_MS", "60000"}}, 180000, /*stop_all_on_failure=*/false);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// One rank's side of a collective restore whose load fails once every
// check passed: Mlp(99) with SGD (rate 0.01, momentum 0.9) after a step
// on a batch of the rank's own, and a constant schedule that drives the
// rate through a target calling `refuse` first (what it throws is the
// load's failure); with the bytes of the model and the optimizer before.
struct LoadFailsOnOneRank {
  LoadFailsOnOneRank(int rank, std::function<void(double lr)> refuse)
      : model(Mlp(99)),
        opt(model->NamedParameters(), {.lr = 0.01, .momentum = 0.9}),
        sched(nn::optim::LrTarget{[this] { return opt.lr(); },
                                  [this, refuse = std::move(refuse)](double lr) {
                                    refuse(lr);
                                    opt.set_lr(lr);
                                  }},
              nn::optim::LambdaSchedule([](int64_t) { return 1.0; }, "decay")) {
    LocalStep(*model, opt, kBatch * (1 + rank));
    model_before = StateBytes(*model);
    opt_before = StateBytes(opt.StateDict());
  }
  LoadFailsOnOneRank(const LoadFailsOnOneRank&) = delete;
  LoadFailsOnOneRank& operator=(const LoadFailsOnOneRank&) = delete;

  // After the restore (`restore`) on the rank `who` names: it failed
  // promptly with `expected`, every object is bitwise as it was, and the
  // group goes on.
  void ExpectAsBefore(ProcessGroup& pg, const std::string& who, const Outcome& restore,
                      const std::string& expected) {
    WORKER_EXPECT(restore.error == expected, who + " got: " + restore.error);
    WORKER_EXPECT(restore.seconds < 20, who + ": the failure took " + std::to_string(restore.seconds) + " s");
    WORKER_EXPECT(StateBytes(*model) == model_before, who + ": the model is not as it was");
    WORKER_EXPECT(StateBytes(opt.StateDict()) == opt_before && opt.lr() == 0.01,
                  who + ": the optimizer is not as it was");
    WORKER_EXPECT(sched.step_count() == 0, who + ": the scheduler's step is " + std::to_string(sched.step_count()));
    WORKER_EXPECT(NextCollectivesError(pg).empty(), who + ": the group failed after the failed restore");
  }

  std::shared_ptr<nn::modules::Module> model;
  nn::optim::Sgd opt;
  nn::optim::LrScheduler sched;
  std::vector<std::string> model_before;
  std::vector<std::string> opt_before;
};

// What rank 1's learning-rate target throws below: no std::exception.
struct RateRefused {
  double lr;
};

// As above, every check passes and rank 1's load throws, but what it
// throws is no std::exception (a RateRefused, as a user's function may
// throw anything). Had the load's outcome been caught as a std::exception
// only, rank 1 would leave the call alone, its model and optimizer half
// restored, while ranks 0 and 2 waited for it in the comparison of the
// loads until the group's timeout (60 s here). Every rank throws at once
// instead, naming rank 1 and the part whose load threw, and puts its
// objects back bitwise; the group goes on.
DDP_TEST_WORKER(restore_load_throws_a_non_std_exception) {
  auto pg = testing::WorkerGroup();  // DDP_TEST_TIMEOUT_MS: 60 s
  const SavedMlp saved(/*trained=*/true);
  const nn::io::Checkpoint& c = saved.checkpoint;
  auto refuses = std::make_shared<bool>(pg->rank() == 1);
  LoadFailsOnOneRank mine(pg->rank(), [refuses](double lr) {
    if (*refuses && lr > 0.02) throw RateRefused{lr};
  });
  const Outcome restore =
      OutcomeOf<std::runtime_error>([&] { RestoreCheckpoint(*pg, c, *mine.model, &mine.opt, &mine.sched); });
  mine.ExpectAsBefore(*pg, "rank " + std::to_string(pg->rank()), restore,
                      "RestoreCheckpoint: every rank's checks passed, but loading failed on rank 1: loading the "
                      "scheduler's state threw: an exception that is not a std::exception (the model and the "
                      "optimizer were loaded before it); every rank put its model and components back as they "
                      "were before the call");
  *refuses = false;
  RestoreCheckpoint(*pg, c, *mine.model, &mine.opt, &mine.sched);
  WORKER_EXPECT(testing::HashState(*mine.model) == testing::HashState(*saved.model) && mine.sched.step_count() == 3,
                "rank " + std::to_string(pg->rank()) + ": the second restore");
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, ALoadThatThrowsANonStdExceptionOnOneRankFailsEveryRankPromptlyNamingIt) {
  auto run = RunWorkers("restore_load_throws_a_non_std_exception", 3, {{"DDP_TEST_TIMEOUT_MS", "60000"}}, 180000,
                        /*stop_all_on_failure=*/false);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Every check passes and rank 1's load throws (its target refuses the
// saved rate); then rank 2, once it has put its state back, throws while it
// tells the others how its own load went (bad_alloc, as when memory runs
// out there, or non_std, anything that is no std::exception). Before, only
// a DistributedError was caught there: rank 2 left the call alone, and
// ranks 0 and 1 waited for it in the comparison of the loads until the
// group's timeout (60 s here). Now rank 2 still takes part, its record
// saying what threw, and every rank throws at once naming ranks 1 and 2,
// each with its objects back bitwise as they were; the group goes on, to
// the next case.
DDP_TEST_WORKER(restore_telling_the_loads_throws) {
  auto pg = testing::WorkerGroup();  // DDP_TEST_TIMEOUT_MS: 60 s
  const SavedMlp saved(/*trained=*/true);
  const nn::io::Checkpoint& c = saved.checkpoint;
  const int rank = pg->rank();
  for (const std::string which : {"bad_alloc", "non_std"}) {
    LoadFailsOnOneRank mine(rank, [rank](double lr) {
      if (rank == 1 && lr > 0.02) throw std::runtime_error("rank 1's target refuses rates above 0.02");
    });
    if (rank == 2) {
      internal::SetFaultForTesting(internal::FaultPoint::kTellingLoads, [which] {
        if (which == "bad_alloc") throw std::bad_alloc();
        throw RateRefused{0.0};
      });
    }
    const Outcome restore =
        OutcomeOf<std::runtime_error>([&] { RestoreCheckpoint(*pg, c, *mine.model, &mine.opt, &mine.sched); });
    internal::SetFaultForTesting(internal::FaultPoint::kTellingLoads, {});
    const std::string why = which == "bad_alloc" ? "std::bad_alloc" : "an exception that is not a std::exception";
    mine.ExpectAsBefore(*pg, which + ", rank " + std::to_string(rank), restore,
                        "RestoreCheckpoint: every rank's checks passed, but loading failed on rank 1: loading the "
                        "scheduler's state threw: rank 1's target refuses rates above 0.02 (the model and the "
                        "optimizer were loaded before it); rank 2: loaded every part, then telling the other "
                        "ranks how its load went threw: " + why + "; every rank put its model and components "
                        "back as they were before the call");
  }
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, ARankThatThrowsWhileTellingHowItsLoadWentIsNamedOnEveryRankPromptly) {
  auto run = RunWorkers("restore_telling_the_loads_throws", 3, {{"DDP_TEST_TIMEOUT_MS", "60000"}}, 180000,
                        /*stop_all_on_failure=*/false);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// As above, rank 1's load fails; rank 2's loads, but its target then
// refuses the rate it had before the call (armed after the scheduler set
// it), so rank 2 cannot put its scheduler back. Every rank throws one
// error naming rank 1's load and rank 2's put-back and asking for another
// restore; rank 2 still put back the parts before the scheduler (its model
// and optimizer, bitwise), and the others put back everything.
DDP_TEST_WORKER(restore_put_back_fails_on_one_rank) {
  auto pg = testing::WorkerGroup();  // DDP_TEST_TIMEOUT_MS: 60 s
  const SavedMlp saved(/*trained=*/true);
  const nn::io::Checkpoint& c = saved.checkpoint;
  auto model = Mlp(99);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.01, .momentum = 0.9});
  LocalStep(*model, opt, kBatch * (1 + pg->rank()));
  const int rank = pg->rank();
  auto armed = std::make_shared<bool>(false);
  nn::optim::LrTarget target{[&opt] { return opt.lr(); },
                             [&opt, rank, armed](double lr) {
                               if (rank == 1 && lr > 0.02) throw std::runtime_error("rank 1's target refuses it");
                               if (rank == 2 && *armed && lr < 0.02) {
                                 throw std::runtime_error("rank 2's target refuses rates below 0.02");
                               }
                               opt.set_lr(lr);
                             }};
  nn::optim::LrScheduler sched(target, nn::optim::LambdaSchedule([](int64_t) { return 1.0; }, "decay"));
  *armed = true;
  const std::vector<std::string> model_before = StateBytes(*model);
  const std::vector<std::string> opt_before = StateBytes(opt.StateDict());
  std::string error = "no error";
  try {
    RestoreCheckpoint(*pg, c, *model, &opt, &sched);
  } catch (const std::runtime_error& e) {
    error = e.what();
  }
  const std::string who = "rank " + std::to_string(rank);
  WORKER_EXPECT(error == "RestoreCheckpoint: every rank's checks passed, but loading failed on rank 1: loading "
                         "the scheduler's state threw: rank 1's target refuses it (the model and the optimizer "
                         "were loaded before it); rank 2: loaded every part, then putting the scheduler's state "
                         "back threw: rank 2's target refuses rates below 0.02; not every rank could put its "
                         "state back as it was (said above): restore again on every rank, or rebuild the "
                         "objects, before training",
                who + " got: " + error);
  WORKER_EXPECT(StateBytes(*model) == model_before, who + ": the model is not as it was");
  WORKER_EXPECT(StateBytes(opt.StateDict()) == opt_before, who + ": the optimizer is not as it was");
  WORKER_EXPECT(sched.step_count() == (rank == 2 ? 3 : 0),
                who + ": the scheduler's step is " + std::to_string(sched.step_count()));
  WORKER_EXPECT(NextCollectivesError(*pg).empty(), "the group failed after the failed restore");
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, ARankThatCannotPutItsStateBackIsNamedAndTheOthersStillPutTheirsBack) {
  auto run = RunWorkers("restore_put_back_fails_on_one_rank", 3, {{"DDP_TEST_TIMEOUT_MS", "60000"}}, 180000,
                        /*stop_all_on_failure=*/false);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// The group fails while the ranks compare their loads: rank 1's target
// ends its process when the load sets the rate, after every check passed,
// and rank 0's target refuses that rate. Ranks 0 and 2 get a PEER_LOST
// DistributedError naming rank 1, well within the group's timeout (60 s
// here), that says how their own load went and that they put their
// objects back as they were before the call (RestoreOptions::rollback),
// which they did.
constexpr int kDiedDuringTheLoad = 7;

DDP_TEST_WORKER(restore_group_fails_after_the_loads) {
  auto pg = testing::WorkerGroup();  // DDP_TEST_TIMEOUT_MS: 60 s
  const SavedMlp saved(/*trained=*/false);
  const nn::io::Checkpoint& c = saved.checkpoint;
  auto model = Mlp(99);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.01});
  const int rank = pg->rank();
  nn::optim::LrTarget target{[&opt] { return opt.lr(); },
                             [&opt, rank](double lr) {
                               if (lr > 0.02 && rank == 1) _exit(kDiedDuringTheLoad);
                               if (lr > 0.02 && rank == 0) throw std::runtime_error("rank 0's target refuses it");
                               opt.set_lr(lr);
                             }};
  nn::optim::LrScheduler sched(target, nn::optim::LambdaSchedule([](int64_t) { return 1.0; }, "decay"));
  const std::vector<std::string> model_before = StateBytes(*model);
  const std::vector<std::string> opt_before = StateBytes(opt.StateDict());
  std::string error = "no error";
  const auto start = std::chrono::steady_clock::now();
  try {
    RestoreCheckpoint(*pg, c, *model, &opt, &sched);
  } catch (const DistributedError& e) {
    error = e.code() == transport::StatusCode::kPeerLost ? e.status().message() : e.what();
  } catch (const std::exception& e) {
    error = std::string("not a DistributedError: ") + e.what();
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string own = rank == 0 ? "loading the scheduler's state threw: rank 0's target refuses it (the model "
                                      "and the optimizer were loaded before it)"
                                    : "loaded every part";
  WORKER_EXPECT(error.rfind("RestoreCheckpoint: the group failed while the ranks compared their loads, after this "
                            "rank " + own + "; it put every part back as it was before the call: ",
                            0) == 0 &&
                    error.find("rank 1") != std::string::npos,
                "rank " + std::to_string(rank) + " got: " + error);
  WORKER_EXPECT(took < 20, "the failure took " + std::to_string(took) + " s");
  WORKER_EXPECT(StateBytes(*model) == model_before && StateBytes(opt.StateDict()) == opt_before &&
                    sched.step_count() == 0,
                "rank " + std::to_string(rank) + "'s objects are not as they were");
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, AGroupThatFailsWhileTheRanksCompareTheirLoadsSaysHowEachRanksLoadWent) {
  auto run = RunWorkers("restore_group_fails_after_the_loads", 3, {{"DDP_TEST_TIMEOUT_MS", "60000"}}, 180000,
                        /*stop_all_on_failure=*/false);
  const std::string out = testing::AllOutput(run);
  EXPECT_EQ(run.ExitCode(1), kDiedDuringTheLoad) << out;
  EXPECT_EQ(run.ExitCode(0), 0) << out;
  EXPECT_EQ(run.ExitCode(2), 0) << out;
}

// A collective restore asks each param group's LambdaSchedule function
// once for the saved step: the scheduler's check computes the rates, and
// the load sets those. Before, the check asked and the load asked again,
// so a function with side effects ran twice per group.
DDP_TEST_WORKER(restore_asks_each_function_once) {
  auto pg = testing::WorkerGroup();
  auto saved = Mlp(1);
  nn::optim::Sgd saved_opt(TwoParamGroups(*saved), {.lr = 0.05});
  const std::function<double(int64_t)> half = [](int64_t) { return 0.5; };
  nn::optim::LrScheduler saved_sched(saved_opt, nn::optim::LambdaSchedule(std::vector{half, half}, "halves"));
  for (int s = 0; s < 3; ++s) saved_sched.Step();
  const nn::io::Checkpoint c = MakeCheckpoint(*saved, &saved_opt, {}, &saved_sched);
  auto model = Mlp(99);
  nn::optim::Sgd opt(TwoParamGroups(*model), {.lr = 0.1});
  auto calls = std::make_shared<std::vector<int>>(2, 0);
  auto counted = [calls](size_t group) {
    return std::function<double(int64_t)>([calls, group](int64_t) {
      ++(*calls)[group];
      return 0.5;
    });
  };
  nn::optim::LrScheduler sched(opt, nn::optim::LambdaSchedule(std::vector{counted(0), counted(1)}, "halves"));
  *calls = {0, 0};  // the constructor's own calls are not the restore's
  RestoreCheckpoint(*pg, c, *model, &opt, &sched);
  WORKER_EXPECT(*calls == std::vector<int>({1, 1}), "the functions were called " + std::to_string((*calls)[0]) +
                                                        " and " + std::to_string((*calls)[1]) + " time(s)");
  WORKER_EXPECT(sched.step_count() == 3 && opt.lr(0) == 0.025 && opt.lr(1) == 0.025,
                "restored step " + std::to_string(sched.step_count()) + ", rates " + std::to_string(opt.lr(0)) +
                    " and " + std::to_string(opt.lr(1)));
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, ACollectiveRestoreAsksEachScheduleFunctionOncePerGroup) {
  auto run = RunWorkers("restore_asks_each_function_once", 2, {}, 180000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A save after another rank failed: rank 1 aborts the group, rank 0 sees
// its next collective fail (as a trainer's backward would), and both then
// call SaveCheckpoint, as an error handler might. Every rank throws, naming
// the path and the reason, and the file keeps the last checkpoint the group
// saved (step 2): rank 0's state follows a failed collective and may not
// match the other replicas. Before, rank 0 wrote it over the last one and
// then threw the group's error, which said nothing of the file.
DDP_TEST_WORKER(save_after_a_rank_failed) {
  auto pg = testing::WorkerGroup();
  const std::string dir = std::getenv("DDP_TEST_CKPT");
  const std::string path = dir + "/last.safetensors";
  SaveCheckpoint(*pg, path, MakeCheckpoint(*Mlp(1), nullptr, {{"step", "2"}}));
  if (pg->rank() == 1) {
    pg->Abort(transport::FailedPreconditionError("rank 1 failed, on purpose"));
  } else {
    const std::string error = NextCollectivesError(*pg);
    WORKER_EXPECT(error.find("on purpose") != std::string::npos, "rank 0's collective: " + error);
  }
  std::string message;
  try {
    SaveCheckpoint(*pg, path, MakeCheckpoint(*Mlp(2), nullptr, {{"step", "4"}}));
  } catch (const DistributedError& e) {
    message = e.what();
  }
  WORKER_EXPECT(message.find("SaveCheckpoint " + path + ": not written, the file is left as it was") !=
                        std::string::npos &&
                    message.find("on purpose") != std::string::npos,
                "reported: " + message);
  const nn::io::Checkpoint kept = nn::io::LoadCheckpoint(path);
  WORKER_EXPECT(nn::io::MetadataInt(kept.metadata, "step", path) == 2,
                "the file holds step " + kept.metadata.at("step"));
  WORKER_EXPECT(ListDir(dir) == std::vector<std::string>{"last.safetensors"}, "a file beside the checkpoint");
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, ASaveAfterARankFailedThrowsEverywhereAndKeepsTheLastCheckpoint) {
  const std::string dir = TempDir();
  // Each rank checks the file itself: one failing must not stop the other.
  auto run = RunWorkers("save_after_a_rank_failed", 2, {{"DDP_TEST_CKPT", dir}}, 60000,
                        /*stop_all_on_failure=*/false);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ----------------------------------------------- the file on one rank ----

DDP_TEST_WORKER(from_rank) {
  auto pg = testing::WorkerGroup();
  const std::string dir = std::getenv("DDP_TEST_CKPT");
  auto model = Mlp(1);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  // Only rank 0's "disk" has the file: each rank's own folder, as on hosts
  // without a shared filesystem. Every rank saves to the same path, which
  // rank 0 alone writes: here rank 0's folder.
  const std::string own = dir + "/rank" + std::to_string(pg->rank());
  mkdir(own.c_str(), 0700);
  SaveCheckpoint(*pg, dir + "/rank0/c.safetensors", MakeCheckpoint(*model, &opt, {{"step", "5"}}));
  struct stat st;
  WORKER_EXPECT((stat((own + "/c.safetensors").c_str(), &st) == 0) == (pg->rank() == 0),
                "rank 0 alone should have written the file");
  // Rank 1 could not read it itself; from rank 0 it gets the same state.
  auto other = Mlp(7);
  nn::optim::Sgd other_opt(other->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  nn::io::Checkpoint c = LoadCheckpointFromRank(*pg, own + "/c.safetensors");
  RestoreCheckpoint(c, *other, &other_opt);
  WORKER_EXPECT(testing::HashState(*other) == testing::HashState(*model), "the loaded model differs");
  WORKER_EXPECT(nn::io::MetadataInt(c.metadata, "step", "c") == 5, "step");
  // Rank 1 as the root: it has no file, so every rank fails naming it,
  // the call, and the path rank 1 read, whatever path this rank passed
  // (its own, or none). Before, each rank's message began "LoadCheckpoint"
  // and gave the path it passed itself, unquoted.
  const std::string rank1_path = dir + "/rank1/c.safetensors";
  for (const bool others_pass_none : {false, true}) {
    try {
      LoadCheckpointFromRank(*pg, others_pass_none && pg->rank() != 1 ? "" : own + "/c.safetensors", 1);
      WORKER_EXPECT(false, "a load from a rank without the file succeeded");
    } catch (const std::runtime_error& e) {
      const std::string m = e.what();
      const std::string start = "LoadCheckpointFromRank '" + rank1_path + "' (read by rank 1) failed on rank 1: ";
      WORKER_EXPECT(m.rfind(start, 0) == 0 &&
                        m.find(rank1_path + ": cannot open: No such file or directory") != std::string::npos,
                    "rank " + std::to_string(pg->rank()) + " got: " + m);
    }
  }
  // A file that rank 0 reads whole but that is no checkpoint (a header of
  // 2 bytes, not a JSON object): every rank parses it and fails the same way.
  if (pg->rank() == 0) {
    std::ofstream(own + "/bad.safetensors", std::ios::binary) << std::string("\x02\0\0\0\0\0\0\0[]", 10);
  }
  try {
    LoadCheckpointFromRank(*pg, own + "/bad.safetensors");
    WORKER_EXPECT(false, "a broken file loaded");
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    WORKER_EXPECT(m.find("rank 0: ") != std::string::npos && m.find("rank 1: ") != std::string::npos &&
                      m.find("read by rank 0") != std::string::npos,
                  m);
  }
  try {
    LoadCheckpointFromRank(*pg, own + "/c.safetensors", 2);
    WORKER_EXPECT(false, "root 2 of 2 ranks was accepted");
  } catch (const std::invalid_argument& e) {
    WORKER_EXPECT(std::string(e.what()).find("root 2") != std::string::npos, e.what());
  }
  try {
    LoadCheckpointFromRank(*pg, own + "/c.safetensors", 0, {}, {.timeout = std::chrono::milliseconds(0)});
    WORKER_EXPECT(false, "a zero timeout was accepted");
  } catch (const std::invalid_argument& e) {
    WORKER_EXPECT(std::string(e.what()).find("LoadWaitOptions::timeout must be in (0 ms, 30 days], got 0 ms") !=
                      std::string::npos,
                  e.what());
  }
  return testing::WorkerExit();
}

// What the root does alone, a write (SaveCheckpoint) or a read
// (LoadCheckpointFromRank) longer than the group's timeout (here 1 s, as
// for the slow write: with 200 ms a rank kept off the CPU that long on a
// loaded host would time out): the others wait for it as long as it goes
// on, whichever rank is the root, and learn its outcome; past the work's
// own timeout every rank fails with it and the group is aborted.
DDP_TEST_WORKER(root_works_alone) {
  auto pg = GroupWithAShortTimeout(std::chrono::milliseconds(1000));
  using std::chrono::milliseconds;
  // Twice the group's timeout.
  auto nap = [](const std::atomic<bool>&) { std::this_thread::sleep_for(milliseconds(2000)); };
  // 5 s unless asked to stop: long enough that a root that waits it out
  // cannot pass for one that stopped at the timeout, whatever the load.
  auto stoppable_nap = [](const std::atomic<bool>& stop) {
    for (int i = 0; i < 500 && !stop; ++i) std::this_thread::sleep_for(milliseconds(10));
  };
  for (int root : {0, 1}) {
    const auto start = std::chrono::steady_clock::now();
    const std::string outcome =
        internal::RunOnRootWhileOthersWait(*pg, root, nap, milliseconds(20000), milliseconds(1000), "the test's call",
                                           "the nap", "Nap::timeout", "the nap failed");
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    WORKER_EXPECT(outcome.empty(), "root " + std::to_string(root) + ": " + outcome);
    WORKER_EXPECT(took > 1.9, "root " + std::to_string(root) + " took only " + std::to_string(took) + " s");
  }
  const std::string failed = internal::RunOnRootWhileOthersWait(
      *pg, 1, [](const std::atomic<bool>&) { throw std::runtime_error("no luck"); }, milliseconds(20000),
      milliseconds(1000), "the test's call", "the nap", "Nap::timeout", "the nap failed");
  WORKER_EXPECT(failed == "no luck", failed);
  const auto late_start = std::chrono::steady_clock::now();
  const std::string late =
      internal::RunOnRootWhileOthersWait(*pg, 1, stoppable_nap, milliseconds(300), milliseconds(1000),
                                         "the test's call", "the nap", "Nap::timeout", "the nap failed");
  const double late_took = std::chrono::duration<double>(std::chrono::steady_clock::now() - late_start).count();
  WORKER_EXPECT(late == "the nap did not finish within Nap::timeout (300 ms)", late);
  // Root asked its work to stop at the timeout instead of waiting it out
  // (5 s): half of that leaves room for a loaded host and for this rank
  // having left the previous collective before the others.
  WORKER_EXPECT(late_took < 2.5, "returned after " + std::to_string(late_took) + " s");
  const std::string next = NextCollectivesError(*pg);
  WORKER_EXPECT(next.find("the nap failed within Nap::timeout (300 ms)") != std::string::npos, next);
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, TheOthersWaitForTheRootsLongWorkAndLearnItsOutcome) {
  auto run = RunWorkers("root_works_alone", 3, {}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// The waits' guards abort the group as ProcessGroup's collectives do, and
// no more: a root outside the group, which every rank throws alike as a
// std::invalid_argument, leaves the group usable (the guard used to abort
// it), and so does a throw on one rank once the ranks' last exchange has
// ended, as it builds what it returns, when the caller says that the wait
// is its call's last exchange (nobody waits for it then).
DDP_TEST_WORKER(waits_leave_the_group_usable) {
  auto pg = testing::WorkerGroup();
  using std::chrono::milliseconds;
  auto quick = [](const std::atomic<bool>&) {};
  std::string error = "no error";
  try {
    internal::RunOnRootWhileOthersWait(*pg, 5, quick, milliseconds(20000), milliseconds(1000), "the test's call",
                                       "the nap", "Nap::timeout", "the nap failed");
  } catch (const std::invalid_argument& e) {
    error = e.what();
  }
  WORKER_EXPECT(error.find("root 5") != std::string::npos, "a root outside the group: " + error);
  std::string next = NextCollectivesError(*pg);
  WORKER_EXPECT(next.empty(), "after a root outside the group: " + next);
  if (pg->rank() == 1) {
    internal::SetFaultForTesting(internal::FaultPoint::kAfterTheLastExchange, [] { throw std::bad_alloc(); });
  }
  for (const bool every_rank : {false, true}) {
    const std::string which = every_rank ? "RunOnEveryRankWhileOthersWait" : "RunOnRootWhileOthersWait";
    std::string outcome = "no error";
    try {
      outcome = every_rank ? internal::RunOnEveryRankWhileOthersWait(
                                 *pg, quick, milliseconds(20000), milliseconds(1000), "the test's call", "the read",
                                 "Read::timeout", "the read failed", kMostTimeout,
                                 internal::IfTheGroupFails::kLetTheWorkFinish, internal::AfterTheWait::kTheCallEnds)
                           : internal::RunOnRootWhileOthersWait(
                                 *pg, 0, quick, milliseconds(20000), milliseconds(1000), "the test's call", "the nap",
                                 "Nap::timeout", "the nap failed", kMostTimeout,
                                 internal::IfTheGroupFails::kLetTheWorkFinish, internal::AfterTheWait::kTheCallEnds);
      outcome = outcome.empty() ? "no error" : "the outcome " + outcome;
    } catch (const std::bad_alloc&) {
      outcome = "std::bad_alloc";
    } catch (const std::exception& e) {
      outcome = std::string("another exception: ") + e.what();
    }
    WORKER_EXPECT(outcome == (pg->rank() == 1 ? "std::bad_alloc" : "no error"), which + ": " + outcome);
    next = NextCollectivesError(*pg);
    WORKER_EXPECT(next.empty(), which + ", after a throw past the last exchange: " + next);
  }
  internal::SetFaultForTesting(internal::FaultPoint::kAfterTheLastExchange, {});
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, AnArgumentErrorOrAThrowPastTheLastExchangeLeavesTheGroupUsable) {
  auto run = RunWorkers("waits_leave_the_group_usable", 2, {}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Rank 1 throws (memory running out) once the wait inside LoadCheckpoint
// (DDP_TEST_CASE every_rank) or LoadCheckpointFromRank (from_rank) has
// ended, which is not the call's last exchange: the others go on to the
// agreement on what was read, or to the broadcast of the bytes' length.
// Before, the guard took the wait's last exchange for the call's, rank 1
// left without aborting the group, and rank 0 waited for it there until
// the group's timeout (60 s here) or lost it as a peer. Now rank 1 aborts
// the group, and rank 0 throws at once naming rank 1 and what it threw.
DDP_TEST_WORKER(throw_past_the_wait_inside_a_load) {
  auto pg = testing::WorkerGroup();  // DDP_TEST_TIMEOUT_MS: 60 s
  const std::string which = std::getenv("DDP_TEST_CASE");
  const std::string path = std::string(std::getenv("DDP_TEST_CKPT")) + "/c.safetensors";
  SaveCheckpoint(*pg, path, MakeCheckpoint(*Mlp(1), nullptr));
  if (pg->rank() == 1) {
    internal::SetFaultForTesting(internal::FaultPoint::kAfterTheLastExchange, [] { throw std::bad_alloc(); });
  }
  std::string error = "no error";
  const auto start = std::chrono::steady_clock::now();
  try {
    if (which == "every_rank") {
      LoadCheckpoint(*pg, path);
    } else {
      LoadCheckpointFromRank(*pg, path, 0);
    }
  } catch (const std::bad_alloc&) {
    error = "std::bad_alloc";
  } catch (const std::exception& e) {
    error = e.what();
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  internal::SetFaultForTesting(internal::FaultPoint::kAfterTheLastExchange, {});
  const std::string who = which + ", rank " + std::to_string(pg->rank());
  if (pg->rank() == 1) {
    WORKER_EXPECT(error == "std::bad_alloc", who + " got: " + error);
  } else {
    WORKER_EXPECT(error.find("rank 1 threw while it prepared its part") != std::string::npos &&
                      error.find("std::bad_alloc") != std::string::npos,
                  who + " got: " + error);
    // Well within the group's 60 s, which a rank left waiting would spend.
    WORKER_EXPECT(took < 20, who + ": the failure took " + std::to_string(took) + " s");
  }
  // Rank 1 aborted the group: the next collective fails on every rank.
  const std::string next = NextCollectivesError(*pg);
  WORKER_EXPECT(next.find("rank 1 threw while it prepared its part") != std::string::npos,
                who + ": the next collective: " + next);
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, AThrowPastTheWaitInsideALoadAbortsTheGroupNamingTheRank) {
  for (const char* which : {"every_rank", "from_rank"}) {
    auto run = RunWorkers("throw_past_the_wait_inside_a_load", 2,
                          {{"DDP_TEST_CASE", which}, {"DDP_TEST_CKPT", TempDir()}, {"DDP_TEST_TIMEOUT_MS", "60000"}},
                          180000, /*stop_all_on_failure=*/false);
    EXPECT_TRUE(run.AllSucceeded()) << which << ":\n" << testing::AllOutput(run);
  }
}

// Root throws (memory running out) in its heartbeat loop, as it words
// that its work ran out of time (timeout 200 ms), while the work ignores
// the stop (stop_grace 20 s). Before, the throw unwound root's wait for the
// work (up to the 20 s) before the guard aborted the group, and rank 1
// waited in its status broadcast until the group's timeout (3 s here),
// failing with the broadcast's own reason. Now root aborts the group
// before it waits for the work, and rank 1 throws at once naming rank 0.
// The work ends once the group is aborted (at most 10 s).
DDP_TEST_WORKER(root_throws_while_its_work_goes_on) {
  auto pg = testing::WorkerGroup();  // DDP_TEST_TIMEOUT_MS: 3 s
  using std::chrono::milliseconds;
  auto work = [&pg](const std::atomic<bool>&) {
    for (int i = 0; i < 1000 && pg->aborted_reason().ok(); ++i) std::this_thread::sleep_for(milliseconds(10));
  };
  if (pg->rank() == 0) {
    internal::SetFaultForTesting(internal::FaultPoint::kRootOutOfTime, [] { throw std::bad_alloc(); });
  }
  std::string error = "no error";
  const auto start = std::chrono::steady_clock::now();
  try {
    internal::RunOnRootWhileOthersWait(*pg, 0, work, milliseconds(200), milliseconds(100), "the test's call",
                                       "the nap", "Nap::timeout", "the nap failed", milliseconds(20000));
  } catch (const std::bad_alloc&) {
    error = "std::bad_alloc";
  } catch (const std::exception& e) {
    error = e.what();
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  internal::SetFaultForTesting(internal::FaultPoint::kRootOutOfTime, {});
  const std::string who = "rank " + std::to_string(pg->rank()) + " (after " + std::to_string(took) + " s)";
  if (pg->rank() == 0) {
    WORKER_EXPECT(error == "std::bad_alloc", who + " got: " + error);
  } else {
    WORKER_EXPECT(error.find("the test's call: rank 0 threw while it prepared its part") != std::string::npos &&
                      error.find("std::bad_alloc") != std::string::npos,
                  who + " got: " + error);
  }
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, RootThrowingWhileItsWorkGoesOnAbortsTheGroupBeforeWaitingForTheWork) {
  auto run = RunWorkers("root_throws_while_its_work_goes_on", 2, {{"DDP_TEST_TIMEOUT_MS", "3000"}}, 60000,
                        /*stop_all_on_failure=*/false);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// The group fails while root's work goes on (the work aborts it, as a rank
// failing meanwhile would): root lets the work go on, then throws the
// group's error saying how the work ended, so that a SaveCheckpoint caller
// knows whether the new file is in place. Before, the group's error said
// nothing of it. DDP_TEST_CASE: completed, failed (the work throws after
// the abort) or stopped (it goes on past its timeout).
DDP_TEST_WORKER(group_fails_while_root_works) {
  auto pg = testing::WorkerGroup();
  const std::string which = std::getenv("DDP_TEST_CASE");
  using std::chrono::milliseconds;
  auto work = [&pg, which](const std::atomic<bool>& stop) {
    pg->Abort(transport::FailedPreconditionError("a rank failed meanwhile, on purpose"));
    if (which == "failed") throw std::runtime_error("no luck");
    // Until asked to stop (at most 10 s).
    for (int i = 0; which == "stopped" && i < 1000 && !stop; ++i) {
      std::this_thread::sleep_for(milliseconds(10));
    }
  };
  // A work that goes on until asked to stop holds root for the whole
  // timeout, which nothing has to meet: 300 ms. One that ends must end
  // within it, on a loaded host too: 1 s.
  const milliseconds timeout(which == "stopped" ? 300 : 1000);
  std::string message;
  try {
    internal::RunOnRootWhileOthersWait(*pg, 0, work, timeout, milliseconds(100), "the test's call", "the nap",
                                       "Nap::timeout", "the nap failed");
  } catch (const DistributedError& e) {
    message = e.what();
  }
  WORKER_EXPECT(message.find("on purpose") != std::string::npos, "reported: " + message);
  if (pg->rank() == 0) {
    const std::string ended =
        which == "completed" ? "completed"
        : which == "failed"  ? "failed: no luck"
                             : "did not finish within Nap::timeout (300 ms) and was asked to stop";
    WORKER_EXPECT(message.find("; meanwhile rank 0 went on with the nap, which " + ended) != std::string::npos,
                  "reported: " + message);
  }
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, TheRootSaysHowItsWorkEndedWhenTheGroupFailedMeanwhile) {
  for (const char* which : {"completed", "failed", "stopped"}) {
    auto run = RunWorkers("group_fails_while_root_works", 2, {{"DDP_TEST_CASE", which}}, 60000);
    EXPECT_TRUE(run.AllSucceeded()) << which << ":\n" << testing::AllOutput(run);
  }
}

// The group fails while a read goes on (a read aborts it, root's or rank
// 1's, as a rank failing meanwhile would), a read that ends only when
// asked to stop: what it reads would be thrown away with the group's
// error, so it is stopped at once and the error comes within a heartbeat
// or so. Before, a read was left going until its timeout (20 s here), as a
// write is, and only then did its rank report the failure. DDP_TEST_CASE: root (root 0 reads,
// RunOnRootWhileOthersWait as in LoadCheckpointFromRank) or every_rank
// (both ranks read, RunOnEveryRankWhileOthersWait as in LoadCheckpoint).
DDP_TEST_WORKER(group_fails_while_reading) {
  auto pg = testing::WorkerGroup();
  const std::string which = std::getenv("DDP_TEST_CASE");
  using std::chrono::milliseconds;
  const bool reads = which == "every_rank" || pg->rank() == 0;
  auto read = [&pg, which, reads](const std::atomic<bool>& stop) {
    if (pg->rank() == (which == "root" ? 0 : 1)) {
      pg->Abort(transport::FailedPreconditionError("a rank failed meanwhile, on purpose"));
    }
    // Until asked to stop (at most 30 s, past the timeout).
    for (int i = 0; reads && i < 3000 && !stop; ++i) std::this_thread::sleep_for(milliseconds(10));
  };
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    if (which == "root") {
      internal::RunOnRootWhileOthersWait(*pg, 0, read, milliseconds(20000), milliseconds(100), "the test's call",
                                         "the read", "Read::timeout", "the read failed", kMostTimeout,
                                         internal::IfTheGroupFails::kStopTheWork);
    } else {
      internal::RunOnEveryRankWhileOthersWait(*pg, read, milliseconds(20000), milliseconds(100), "the test's call",
                                              "the read", "Read::timeout", "the read failed", kMostTimeout,
                                              internal::IfTheGroupFails::kStopTheWork);
    }
  } catch (const DistributedError& e) {
    message = e.what();
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string rank = which + ", rank " + std::to_string(pg->rank());
  WORKER_EXPECT(message.find("on purpose") != std::string::npos, rank + " reported: " + message);
  // A few heartbeats on a loaded host; the timeout is 20 s.
  WORKER_EXPECT(took < 5, rank + " reported the failure after " + std::to_string(took) + " s");
  if (which == "root" && pg->rank() == 0) {
    WORKER_EXPECT(message.find("; meanwhile rank 0 went on with the read, which was asked to stop at once: its "
                               "outcome is of no use once the group failed") != std::string::npos,
                  rank + " reported: " + message);
  }
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, AReadIsStoppedAtOnceWhenTheGroupFailsMeanwhile) {
  for (const char* which : {"root", "every_rank"}) {
    auto run = RunWorkers("group_fails_while_reading", 2, {{"DDP_TEST_CASE", which}}, 60000);
    EXPECT_TRUE(run.AllSucceeded()) << which << ":\n" << testing::AllOutput(run);
  }
}

// LoadCheckpoint's reads, one per rank, take as long as each rank's storage
// does (the host that wrote the file has it in memory): the ranks done first
// wait for the last as long as it goes on, past the group's timeout (here
// 1 s, as above); each learns its own outcome; past the reads' own timeout
// every rank fails with it and the group is aborted.
DDP_TEST_WORKER(every_rank_reads) {
  auto pg = GroupWithAShortTimeout(std::chrono::milliseconds(1000));
  using std::chrono::milliseconds;
  const bool slow = pg->rank() == 2;
  // 2 s (twice the group's timeout) on rank 2 unless asked to stop.
  auto read = [slow](const std::atomic<bool>& stop) {
    for (int i = 0; slow && i < 200 && !stop; ++i) std::this_thread::sleep_for(milliseconds(10));
  };
  // 5 s on rank 2 unless asked to stop: long enough that a read that goes
  // on to its end cannot pass for one stopped at the timeout.
  auto long_read = [slow](const std::atomic<bool>& stop) {
    for (int i = 0; slow && i < 500 && !stop; ++i) std::this_thread::sleep_for(milliseconds(10));
  };
  const auto start = std::chrono::steady_clock::now();
  const std::string outcome =
      internal::RunOnEveryRankWhileOthersWait(*pg, read, milliseconds(20000), milliseconds(1000), "the test's call",
                                              "the read", "Read::timeout", "the read failed");
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  WORKER_EXPECT(outcome.empty(), outcome);
  WORKER_EXPECT(took > 1.9, "returned after " + std::to_string(took) + " s, before rank 2's read ended");
  const std::string mine = internal::RunOnEveryRankWhileOthersWait(
      *pg,
      [&](const std::atomic<bool>&) {
        if (pg->rank() == 1) throw std::runtime_error("no luck");
      },
      milliseconds(20000), milliseconds(1000), "the test's call", "the read", "Read::timeout", "the read failed");
  WORKER_EXPECT(mine == (pg->rank() == 1 ? "no luck" : ""), mine);
  std::string late;
  const auto late_start = std::chrono::steady_clock::now();
  try {
    internal::RunOnEveryRankWhileOthersWait(*pg, long_read, milliseconds(300), milliseconds(1000), "the test's call",
                                            "the read", "Read::timeout", "the read failed");
  } catch (const std::runtime_error& e) {
    late = e.what();
  }
  const double late_took = std::chrono::duration<double>(std::chrono::steady_clock::now() - late_start).count();
  WORKER_EXPECT(late == "the read did not finish on every rank within Read::timeout (300 ms)", late);
  // Rank 2 asked its read to stop at the timeout instead of waiting it out
  // (5 s): half of that leaves room for a loaded host.
  WORKER_EXPECT(late_took < 2.5, "returned after " + std::to_string(late_took) + " s");
  const std::string next = NextCollectivesError(*pg);
  WORKER_EXPECT(next.find("the read failed within Read::timeout (300 ms)") != std::string::npos, next);
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, RanksDoneReadingWaitForTheSlowestAndLearnTheirOwnOutcome) {
  auto run = RunWorkers("every_rank_reads", 3, {}, 60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// A group of one waits for nobody, but its work keeps its deadline: it is
// asked to stop, and the group, which nobody else waits on, stays usable.
TEST(DdpCheckpointTest, AloneTheWorkKeepsItsDeadline) {
  using std::chrono::milliseconds;
  auto pg = ProcessGroup::Single();
  auto stoppable_nap = [](const std::atomic<bool>& stop) {
    for (int i = 0; i < 500 && !stop; ++i) std::this_thread::sleep_for(milliseconds(10));
  };
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(internal::RunOnRootWhileOthersWait(*pg, 0, stoppable_nap, milliseconds(200), milliseconds(1000),
                                               "the test's call", "the nap", "Nap::timeout", "the nap failed"),
            "the nap did not finish within Nap::timeout (200 ms)");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 3.0);
  start = std::chrono::steady_clock::now();
  try {
    internal::RunOnEveryRankWhileOthersWait(*pg, stoppable_nap, milliseconds(200), milliseconds(1000),
                                            "the test's call", "the read", "Read::timeout", "the read failed");
    ADD_FAILURE() << "no error past the timeout";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "the read did not finish on every rank within Read::timeout (200 ms)");
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 3.0);
  nn::Tensor t = nn::Ones({1});
  pg->AllReduce(t).Wait();
  EXPECT_EQ(t.Item(), 1.0);
}

// Before, past the deadline root told every rank "did not finish" (the file
// left as it was) and only then asked the write to stop: a write that had
// passed its last check before the rename still replaced the file. Here the
// write waits before its rename (as on a slow filesystem) from before the
// deadline until well after it: root learns, when it stops the write, that
// the rename had begun, and says so.
TEST(DdpCheckpointTest, AWriteAlreadyRenamingAtTheDeadlineIsNotReportedAsLeftAsItWas) {
  using std::chrono::milliseconds;
  auto pg = ProcessGroup::Single();
  const std::string path = TempDir() + "/c.safetensors";
  nn::io::Checkpoint before;
  before.model.emplace_back("w", nn::Ones({1}));
  nn::io::SaveCheckpoint(path, before);
  nn::io::Checkpoint after;
  after.model.emplace_back("w", nn::Zeros({1}));
  nn::io::internal::SetPauseBeforeRenameForTesting(milliseconds(2000));
  const std::string outcome = internal::RunOnRootWhileOthersWait(
      *pg, 0, [&](const std::atomic<bool>& stop) { nn::io::SaveCheckpoint(path, after, &stop); }, milliseconds(300),
      milliseconds(200), "the test's call", "the write", "SaveOptions::timeout", "the write failed");
  nn::io::internal::SetPauseBeforeRenameForTesting(milliseconds(0));
  // The work has ended: the rename went through.
  EXPECT_EQ(nn::io::LoadCheckpoint(path).model.at(0).second.Item(), 0.0);
  EXPECT_EQ(outcome,
            "the write did not finish within SaveOptions::timeout (300 ms); it was renaming the new file into "
            "place, which may have happened or may yet happen");
}

// A write stuck in the filesystem (a write() or fsync on a hung network
// mount never returns, stop flag or not) used to hang SaveCheckpoint for as
// long as the filesystem did: past its deadline rank 0 asked the write to
// stop, then joined its thread with no bound. Now it waits
// SaveOptions::stop_grace, says on stderr that the write of the path did
// not finish, and returns, leaving the thread behind. Here every piece of
// the write waits 3 s before it looks at its stop flag, as a write to a
// hung mount would. When the write returns at last, it sees the flag and
// removes its temporary file: nothing half written is left looking like a
// checkpoint.
TEST(DdpCheckpointTest, AWriteStuckInTheFilesystemIsLeftBehindAfterTheGraceAndSaysSo) {
  using std::chrono::milliseconds;
  auto pg = ProcessGroup::Single();
  const std::string dir = TempDir();
  const std::string path = dir + "/stuck.safetensors";
  nn::io::Checkpoint c;
  c.model.emplace_back("w", nn::Ones({4}));
  nn::io::internal::SetWritePausePerPiece(milliseconds(3000));
  ::testing::internal::CaptureStderr();
  const auto start = std::chrono::steady_clock::now();
  std::string error = "no error";
  try {
    SaveCheckpoint(*pg, path, c, {.timeout = milliseconds(100), .heartbeat = milliseconds(50),
                                  .stop_grace = milliseconds(300)});
  } catch (const std::runtime_error& e) {
    error = e.what();
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string printed = ::testing::internal::GetCapturedStderr();
  nn::io::internal::SetWritePausePerPiece(milliseconds(0));
  EXPECT_LT(took, 2.0) << "SaveCheckpoint waited for the stuck write";
  EXPECT_THAT(error, HasSubstr("rank 0 could not write " + path +
                               ": the write did not finish within SaveOptions::timeout (100 ms)"));
  EXPECT_THAT(printed, AllOf(HasSubstr("SaveCheckpoint: rank 0 could not write " + path +
                                       ": the work did not end within 300 ms of being asked to stop"),
                             HasSubstr("the file at the path stays as it was")));
  // The thread left behind ends when its write returns; then nothing is
  // left in the folder, neither the checkpoint nor its temporary file.
  std::vector<std::string> left = ListDir(dir);
  for (int i = 0; i < 100 && !left.empty(); ++i) {
    std::this_thread::sleep_for(milliseconds(100));
    left = ListDir(dir);
  }
  EXPECT_TRUE(left.empty()) << "left behind: " << left.front();
}

// A work left behind (stuck in the filesystem past its stop grace) whose
// call returns at last while the process exits: before, its thread then
// freed what it owned (the checkpoint's tensors, its streams) while the
// process's static objects were being destroyed under it. Now a thread
// left behind does not free its state once the exit has begun. Here the
// work waits until a static object (ExitMarker) is destroyed by the exit,
// then returns; the marker's destructor then waits up to 2 s for what the
// work owns to be freed, and says whether it was. DDP_TEST_CASE
// made_before: the marker is made before the work is left behind;
// made_later: a first work is left behind and ends (which registered the
// exit's handler once, before), then the marker is made, then the work
// above is left behind: with one registration, at the first thread left
// behind, the exit destroyed the marker before it marked the exit begun.

// What the works and the marker share. Never destroyed (a leaked heap
// object): a work kept off the CPU may touch it at any time of the exit.
struct ExitGate {
  std::mutex mu;
  std::condition_variable cv;
  bool release_first = false;  // the first work (made_later) may return
  bool first_freed = false;    // what the first work owned was freed
  bool exiting = false;        // the marker is being destroyed
  bool returned = false;       // the work stuck until the exit returned
  bool owned_freed = false;    // what that work owned was freed
};

ExitGate& TheExitGate() {
  static auto* gate = new ExitGate;  // never destroyed
  return *gate;
}

// Sets `flag` of the gate when freed.
struct OwnedByTheWork {
  explicit OwnedByTheWork(bool ExitGate::*flag) : flag(flag) {}
  ~OwnedByTheWork() {
    ExitGate& gate = TheExitGate();
    std::lock_guard lock(gate.mu);
    gate.*flag = true;
    gate.cv.notify_all();
  }
  bool ExitGate::*flag;
};

struct ExitMarker {
  ~ExitMarker() {
    ExitGate& gate = TheExitGate();
    std::unique_lock lock(gate.mu);
    gate.exiting = true;
    gate.cv.notify_all();
    // The work returns at once, unless its thread is kept off the CPU.
    const bool returned = gate.cv.wait_for(lock, std::chrono::seconds(30), [&gate] { return gate.returned; });
    const bool freed =
        returned && gate.cv.wait_for(lock, std::chrono::seconds(2), [&gate] { return gate.owned_freed; });
    std::fprintf(stderr, "%s\n",
                 !returned ? "the work did not return during the exit"
                 : freed   ? "what the work owned was freed during the exit"
                           : "what the work owned was kept during the exit");
  }
};

// Makes the marker, a static object, at its first call.
void MakeTheExitMarker() { static ExitMarker marker; }

DDP_TEST_WORKER(left_behind_at_exit) {
  using std::chrono::milliseconds;
  const bool made_later = std::string(std::getenv("DDP_TEST_CASE")) == "made_later";
  auto pg = ProcessGroup::Single();
  ExitGate& gate = TheExitGate();
  auto leave_behind = [&pg](const internal::StoppableWork& work) {
    const std::string outcome =
        internal::RunOnRootWhileOthersWait(*pg, 0, work, milliseconds(100), milliseconds(50), "the test's call",
                                           "the write", "SaveOptions::timeout", "the write failed", milliseconds(100));
    WORKER_EXPECT(outcome == "the write did not finish within SaveOptions::timeout (100 ms)", outcome);
  };
  if (made_later) {
    auto owned = std::make_shared<OwnedByTheWork>(&ExitGate::first_freed);
    internal::StoppableWork first = [owned](const std::atomic<bool>&) {
      ExitGate& gate = TheExitGate();
      std::unique_lock lock(gate.mu);
      gate.cv.wait_for(lock, std::chrono::seconds(30), [&gate] { return gate.release_first; });
    };
    owned.reset();  // the work owns it alone
    leave_behind(first);
    first = nullptr;
    std::unique_lock lock(gate.mu);
    gate.release_first = true;
    gate.cv.notify_all();
    WORKER_EXPECT(gate.cv.wait_for(lock, std::chrono::seconds(30), [&gate] { return gate.first_freed; }),
                  "the first work left behind did not end");
  }
  MakeTheExitMarker();
  auto owned = std::make_shared<OwnedByTheWork>(&ExitGate::owned_freed);
  internal::StoppableWork stuck = [owned](const std::atomic<bool>&) {
    ExitGate& gate = TheExitGate();
    std::unique_lock lock(gate.mu);
    gate.cv.wait_for(lock, std::chrono::seconds(30), [&gate] { return gate.exiting; });
    gate.returned = true;
    gate.cv.notify_all();
  };
  owned.reset();  // the work owns it alone
  leave_behind(stuck);
  stuck = nullptr;
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, AWorkLeftBehindFreesNothingOnceTheProcessExits) {
  for (const char* which : {"made_before", "made_later"}) {
    auto run = RunWorkers("left_behind_at_exit", 1, {{"DDP_TEST_CASE", which}});
    EXPECT_TRUE(run.AllSucceeded()) << which << ":\n" << testing::AllOutput(run);
    EXPECT_THAT(run.Output(0), AllOf(HasSubstr("the work did not end within 100 ms of being asked to stop"),
                                     HasSubstr("what the work owned was kept during the exit")))
        << which;
  }
}

TEST(DdpCheckpointTest, LoadFromRankZeroNeedsTheFileOnlyThere) {
  const std::string dir = TempDir();
  auto run = RunWorkers("from_rank", 2, {{"DDP_TEST_CKPT", dir}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ---------------------------------------------- a thread that will not start ----

// Rank 0's writing thread cannot start (no address space left for its
// stack): the others learn why from rank 0's status record at once, instead
// of waiting out their deadline for a record that never came.
DDP_TEST_WORKER(writer_cannot_start) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return testing::WorkerExit();  // the sanitizers' runtimes map address space of their own
#endif
  auto pg = testing::WorkerGroup();  // timeout DDP_TEST_TIMEOUT_MS (5 s)
  const std::string path = std::string(std::getenv("DDP_TEST_CKPT")) + "/c.safetensors";
  auto model = Mlp(1);
  const nn::io::Checkpoint checkpoint = MakeCheckpoint(*model, nullptr);
  pg->Barrier().Wait();  // the communication thread runs before the limit
  std::optional<testing::AddressSpaceLimit> limit;
  if (pg->rank() == 0) {
    limit.emplace(4 << 20);
    WORKER_EXPECT(limit->ok(), "no VmSize in /proc/self/status");
  }
  const auto start = std::chrono::steady_clock::now();
  std::string error;
  try {
    SaveCheckpoint(*pg, path, checkpoint);
  } catch (const std::exception& e) {
    error = e.what();
  }
  limit.reset();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  WORKER_EXPECT(error.find("SaveCheckpoint: rank 0 could not write " + path +
                           ": could not start the thread for it: ") != std::string::npos,
                "rank " + std::to_string(pg->rank()) + ": " + error);
  WORKER_EXPECT(seconds < 2.5, "failed after " + std::to_string(seconds) + " s");
  pg->Barrier().Wait();  // the group is still usable
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, AWriterThatCannotStartFailsEveryRankAtOnceSayingWhy) {
  auto run = RunWorkers("writer_cannot_start", 2,
                        {{"DDP_TEST_CKPT", TempDir()}, {"DDP_TEST_TIMEOUT_MS", "5000"},
                         {"DDP_COLLECTIVE_THREAD", "comm"}},
                        60000);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ---------------------------------------------------------- world size ----

// SaveCheckpoint records the group's size; a load by a group of another size
// works, with one warning naming both sizes; a checkpoint without the key
// (an older one) loads without one.
TEST(DdpCheckpointTest, TheWorldSizeIsRecordedAndAnotherOneOnLoadIsNamed) {
  auto pg = ProcessGroup::Single();
  const std::string dir = TempDir();
  auto model = Mlp(1);
  const nn::io::Checkpoint made = MakeCheckpoint(*model, nullptr, {{"step", "3"}});
  SaveCheckpoint(*pg, dir + "/mine.safetensors", made);
  EXPECT_EQ(made.metadata.count(kWorldSizeKey), 0u) << "the caller's checkpoint was changed";
  const nn::io::Metadata saved = nn::io::LoadCheckpoint(dir + "/mine.safetensors").metadata;
  EXPECT_EQ(saved.count(kWorldSizeKey) ? saved.at(kWorldSizeKey) : "missing", "1");
  EXPECT_EQ(saved.count("step") ? saved.at("step") : "missing", "3");
  // What a group of 4 saved, and what an older SaveCheckpoint saved.
  nn::io::Checkpoint of_four = made;
  of_four.metadata[kWorldSizeKey] = "4";
  nn::io::SaveCheckpoint(dir + "/four.safetensors", of_four);
  nn::io::SaveCheckpoint(dir + "/old.safetensors", made);
  for (const bool from_rank : {false, true}) {
    // Each call names itself (LoadCheckpointFromRank's warning said
    // "LoadCheckpoint", with the path unquoted).
    const std::string file = dir + "/four.safetensors";
    const std::string warning = (from_rank ? "[ddp] LoadCheckpointFromRank '" + file + "' (read by rank 0)"
                                           : "[ddp] LoadCheckpoint " + file) +
                                ": saved by a group of 4 ranks, loaded by a group of 1; the model and optimizer "
                                "state load as they are";
    auto load = [&](const std::string& name) {
      const std::string path = dir + "/" + name;
      return from_rank ? LoadCheckpointFromRank(*pg, path) : LoadCheckpoint(*pg, path);
    };
    ::testing::internal::CaptureStderr();
    const nn::io::Checkpoint four = load("four.safetensors");
    const nn::io::Checkpoint mine = load("mine.safetensors");
    const nn::io::Checkpoint old = load("old.safetensors");
    const std::string printed = ::testing::internal::GetCapturedStderr();
    EXPECT_THAT(printed, HasSubstr(warning)) << "from_rank " << from_rank;
    // Once: neither the same size nor no size at all is warned about.
    EXPECT_EQ(printed.find("[ddp]"), printed.rfind("[ddp]")) << printed;
    EXPECT_EQ(four.metadata.at(kWorldSizeKey), "4");
    EXPECT_EQ(old.metadata.count(kWorldSizeKey), 0u);
    EXPECT_EQ(old.metadata.at("step"), "3");
    // It loads all the same.
    auto other = Mlp(7);
    RestoreCheckpoint(four, *other, nullptr);
    EXPECT_EQ(testing::HashState(*other), testing::HashState(*model));
  }
}

// On 2 ranks: the size saved is 2, and a checkpoint of another size is
// warned about by rank 0 alone.
DDP_TEST_WORKER(world_size) {
  auto pg = testing::WorkerGroup();
  const std::string dir = std::getenv("DDP_TEST_CKPT");
  auto model = Mlp(1);
  const nn::io::Checkpoint made = MakeCheckpoint(*model, nullptr, {{"step", "3"}});
  SaveCheckpoint(*pg, dir + "/two.safetensors", made);
  const nn::io::Checkpoint two = LoadCheckpoint(*pg, dir + "/two.safetensors");
  WORKER_EXPECT(two.metadata.count(kWorldSizeKey) && two.metadata.at(kWorldSizeKey) == "2",
                "world size of a checkpoint saved by 2 ranks");
  if (pg->rank() == 0) {
    nn::io::Checkpoint of_three = made;
    of_three.metadata[kWorldSizeKey] = "3";
    nn::io::SaveCheckpoint(dir + "/three.safetensors", of_three);
  }
  pg->Barrier().Wait();
  LoadCheckpoint(*pg, dir + "/three.safetensors");
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, AnotherWorldSizeIsNamedOnceByRankZero) {
  const std::string dir = TempDir();
  auto run = RunWorkers("world_size", 2, {{"DDP_TEST_CKPT", dir}});
  const std::string output = testing::AllOutput(run);
  EXPECT_TRUE(run.AllSucceeded()) << output;
  const std::string warning = "/three.safetensors: saved by a group of 3 ranks, loaded by a group of 2";
  const size_t first = output.find(warning);
  EXPECT_NE(first, std::string::npos) << output;
  EXPECT_EQ(first, output.rfind(warning)) << "warned more than once:\n" << output;
  EXPECT_EQ(output.find("saved by a group of 2 ranks"), std::string::npos) << output;
}

// ------------------------------------------------------ all or nothing ----

// One real training step of a plain model, the loss scaled by `scaler`.
void ScaledStep(nn::modules::Module& model, nn::optim::Optimizer& opt, nn::optim::GradScaler& scaler, int step) {
  auto [x, y] = testing::Batch(testing::FashionMnist(), step * kBatch, kBatch);
  opt.ZeroGrad();
  nn::Backward(nn::loss::CrossEntropy(model(x), y) * scaler.scale());
  scaler.Step(opt);
  scaler.Update();
}

std::string RestoreError(const std::function<void()>& restore) {
  try {
    restore();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

// Before, the model's weights were copied first and the optimizer's load
// threw after them: a half-restored model.
TEST(DdpCheckpointTest, MissingOrForeignOptimizerStateThrowsAndLeavesTheModelUnchanged) {
  auto saved = Mlp(1);
  nn::optim::Adam adam(saved->NamedParameters(), {.lr = 1e-3});
  nn::optim::GradScaler unit({.init_scale = 1});
  ScaledStep(*saved, adam, unit, 0);

  auto model = Mlp(99);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  const std::vector<std::string> before = StateBytes(*model);
  ASSERT_TRUE(before != StateBytes(*saved));  // a restore would change them

  // Saved without optimizer state.
  std::string err = RestoreError([&] { RestoreCheckpoint(MakeCheckpoint(*saved, nullptr), *model, &opt); });
  EXPECT_THAT(err, AllOf(HasSubstr("nothing was restored"), HasSubstr("SGD.LoadStateDict"), HasSubstr("missing `lr`")));
  EXPECT_TRUE(StateBytes(*model) == before) << "the model was changed";
  // Another optimizer's state (Adam's slots).
  err = RestoreError([&] { RestoreCheckpoint(MakeCheckpoint(*saved, &adam), *model, &opt); });
  EXPECT_THAT(err, HasSubstr("unexpected `state.1.weight.exp_avg`"));
  EXPECT_TRUE(StateBytes(*model) == before) << "the model was changed";
  EXPECT_EQ(opt.lr(), 0.05);
  EXPECT_EQ(opt.step_count(0), 0);
}

// An optimizer with several param groups saves "param_groups.*" keys
// (Optimizer::StateDict). Before, RestoreCheckpoint took them for keys no
// component takes and refused every such checkpoint, so a run with param
// groups could not resume.
TEST(DdpCheckpointTest, AnOptimizerWithSeveralParamGroupsIsRestored) {
  auto saved = Mlp(1);
  nn::optim::Sgd saved_opt(TwoParamGroups(*saved), {.lr = 0.05, .momentum = 0.9});
  saved_opt.set_lr(1, 0.02);
  nn::optim::GradScaler unit({.init_scale = 1});
  ScaledStep(*saved, saved_opt, unit, 0);

  auto model = Mlp(99);
  nn::optim::Sgd opt(TwoParamGroups(*model), {.lr = 0.1, .momentum = 0.9});
  EXPECT_EQ(RestoreError([&] { RestoreCheckpoint(MakeCheckpoint(*saved, &saved_opt), *model, &opt); }), "");
  EXPECT_TRUE(StateBytes(*model) == StateBytes(*saved)) << "the model was not restored";
  EXPECT_EQ(opt.lr(0), 0.05);
  EXPECT_EQ(opt.lr(1), 0.02);
  EXPECT_EQ(opt.step_count(0), 1);
}

// Before, keys no argument took were dropped: a resumed run's scheduler
// restarted at step 0.
TEST(DdpCheckpointTest, StateThatNoArgumentTakesIsAnErrorNamingTheArgument) {
  auto saved = Mlp(1);
  nn::optim::Sgd saved_opt(saved->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  nn::optim::LrScheduler sched(saved_opt, nn::optim::StepSchedule(1, 0.5));
  nn::optim::GradScaler scaler({.init_scale = 1024});
  for (int s = 0; s < 2; ++s) {
    ScaledStep(*saved, saved_opt, scaler, s);
    sched.Step();
  }
  auto model = Mlp(99);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  const std::vector<std::string> before = StateBytes(*model);

  std::string err =
      RestoreError([&] { RestoreCheckpoint(MakeCheckpoint(*saved, &saved_opt, {}, &sched), *model, &opt); });
  EXPECT_THAT(err, AllOf(HasSubstr("`scheduler.step`"), HasSubstr("`scheduler.base_lr`"),
                         HasSubstr("pass `scheduler`")));
  err = RestoreError(
      [&] { RestoreCheckpoint(MakeCheckpoint(*saved, &saved_opt, {}, nullptr, &scaler), *model, &opt); });
  EXPECT_THAT(err, AllOf(HasSubstr("`scaler.scale`"), HasSubstr("pass `scaler`")));
  err = RestoreError([&] { RestoreCheckpoint(MakeCheckpoint(*saved, &saved_opt), *model, nullptr); });
  EXPECT_THAT(err, AllOf(HasSubstr("optimizer state (`lr`, `group.optimizer`, `group.momentum`"), HasSubstr("more)"),
                         HasSubstr("pass `optimizer`")));
  nn::io::Checkpoint c = MakeCheckpoint(*saved, &saved_opt);
  c.optimizer.emplace_back("ema.decay", nn::Zeros({}));
  err = RestoreError([&] { RestoreCheckpoint(c, *model, &opt); });
  EXPECT_THAT(err, HasSubstr("keys that no component takes (`ema.decay`)"));
  EXPECT_TRUE(StateBytes(*model) == before) << "the model was changed";
  EXPECT_EQ(opt.lr(), 0.05);
  EXPECT_EQ(opt.step_count(0), 0);
}

// A component's check that throws something other than invalid_argument
// (here a LambdaSchedule's function, for the saved step) is one more
// problem in the list, named by the component, and nothing is restored.
// It used to escape alone: the other problems were not reported, and the
// message did not say which component it came from.
TEST(DdpCheckpointTest, ACheckThatThrowsAnotherKindOfErrorIsListedWithTheComponent) {
  const SavedMlp saved(/*trained=*/false);

  auto model = Mlp(99);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1});
  nn::optim::LrScheduler sched(opt, nn::optim::LambdaSchedule(
                                        [](int64_t t) -> double {
                                          if (t > 1) throw std::runtime_error("no factor past step 1");
                                          return 1.0;
                                        },
                                        "decay"));
  const std::vector<std::string> before = StateBytes(*model);
  ASSERT_TRUE(before != StateBytes(*saved.model));  // a restore would change them
  nn::io::Checkpoint c = saved.checkpoint;
  c.optimizer.emplace_back("ema.decay", nn::Zeros({}));
  const std::string err = RestoreError([&] { RestoreCheckpoint(c, *model, &opt, &sched); });
  EXPECT_THAT(err, AllOf(HasSubstr("nothing was restored, 2 problem(s)"),
                         HasSubstr("checking the scheduler's state threw: no factor past step 1"),
                         HasSubstr("keys that no component takes (`ema.decay`)")));
  EXPECT_TRUE(StateBytes(*model) == before) << "the model was changed";
  EXPECT_EQ(opt.lr(), 0.1);
  EXPECT_EQ(sched.step_count(), 0);
}

// ReduceLrOnPlateau's state goes through the checkpoint like the other
// components' (before, its keys were refused as no component's).
TEST(DdpCheckpointTest, PlateauStateIsSavedAndRestored) {
  auto saved = Mlp(1);
  nn::optim::Sgd saved_opt(saved->NamedParameters(), {.lr = 0.1});
  nn::optim::ReduceLrOnPlateau saved_plateau(saved_opt, {.patience = 1});
  for (double metric : {1.0, 2.0, 3.0, 0.5, 0.7}) saved_plateau.Step(metric);
  ASSERT_NEAR(saved_opt.lr(), 0.01, 1e-15);
  auto model = Mlp(99);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1});
  nn::optim::ReduceLrOnPlateau plateau(opt, {.patience = 1});
  const nn::io::Checkpoint c = MakeCheckpoint(*saved, &saved_opt, {}, nullptr, nullptr, nullptr, nullptr, nullptr,
                                              &saved_plateau);
  EXPECT_THAT(RestoreError([&] { RestoreCheckpoint(c, *model, &opt); }),
              AllOf(HasSubstr("`plateau.best`"), HasSubstr("pass `plateau`")));
  RestoreCheckpoint(c, *model, &opt, nullptr, nullptr, nullptr, nullptr, nullptr, &plateau);
  EXPECT_EQ(plateau.best(), 0.5);
  EXPECT_EQ(plateau.num_bad_steps(), saved_plateau.num_bad_steps());
  EXPECT_EQ(plateau.step_count(), 5);
  EXPECT_NEAR(opt.lr(), 0.01, 1e-15);
  // Both go on alike.
  saved_plateau.Step(0.9);
  plateau.Step(0.9);
  EXPECT_EQ(opt.lr(), saved_opt.lr());
}

// Before, the scheduler's state was checked for step >= 0 and a finite
// base_lr only: the rate its schedule gives for that step could still be
// infinite, and the optimizer refused it after the model and the optimizer
// had been replaced.
TEST(DdpCheckpointTest, ScheduleRateTheOptimizerRefusesThrowsAndLeavesModelAndOptimizerUnchanged) {
  auto saved = Mlp(1);
  nn::optim::Sgd saved_opt(saved->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  // gamma 1 keeps the rate; restored with gamma 2 it is 0.05 * 2^2000 = inf.
  nn::optim::LrScheduler saved_sched(saved_opt, nn::optim::StepSchedule(1, 1.0));
  nn::optim::GradScaler unit({.init_scale = 1});
  ScaledStep(*saved, saved_opt, unit, 0);
  for (int s = 0; s < 2000; ++s) saved_sched.Step();

  auto model = Mlp(99);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1, .momentum = 0.9});
  nn::optim::LrScheduler sched(opt, nn::optim::StepSchedule(1, 2.0));
  const std::vector<std::string> before = StateBytes(*model);
  const std::vector<std::string> opt_before = StateBytes(opt.StateDict());
  ASSERT_TRUE(before != StateBytes(*saved));  // a restore would change them
  ASSERT_TRUE(opt_before != StateBytes(saved_opt.StateDict()));

  std::string err = RestoreError(
      [&] { RestoreCheckpoint(MakeCheckpoint(*saved, &saved_opt, {}, &saved_sched), *model, &opt, &sched); });
  EXPECT_THAT(err, AllOf(HasSubstr("nothing was restored"), HasSubstr("learning rate inf"),
                         HasSubstr("scheduler.step 2000"), HasSubstr("scheduler.base_lr 0.05")));
  EXPECT_TRUE(StateBytes(*model) == before) << "the model was changed";
  EXPECT_TRUE(StateBytes(opt.StateDict()) == opt_before) << "the optimizer was changed";
  EXPECT_EQ(opt.lr(), 0.1);
  EXPECT_EQ(sched.step_count(), 0);

  // A base_lr so large that one period's gamma overflows it.
  nn::io::Checkpoint c = MakeCheckpoint(*saved, &saved_opt);
  c.optimizer.emplace_back("scheduler.step", nn::FromVectorOf<int64_t>({1}, {}));
  c.optimizer.emplace_back("scheduler.base_lr", nn::FromVector({1e308}, {}, {.dtype = nn::DType::kFloat64}));
  err = RestoreError([&] { RestoreCheckpoint(c, *model, &opt, &sched); });
  EXPECT_THAT(err, AllOf(HasSubstr("learning rate inf"), HasSubstr("scheduler.step 1 ")));
  EXPECT_TRUE(StateBytes(*model) == before) << "the model was changed";
  EXPECT_TRUE(StateBytes(opt.StateDict()) == opt_before) << "the optimizer was changed";
  EXPECT_EQ(opt.lr(), 0.1);
}

// The same restore on one rank: every check passes, then the scheduler's
// target refuses the saved rate during the load. The load's own error
// comes out, and the model, the optimizer (momentum buffers, steps, rate)
// and the scheduler (step, base rate, the rate set by hand) are bitwise as
// before the call. Before, the model and the optimizer held the
// checkpoint's state and the scheduler its old one.
TEST(DdpCheckpointTest, ALoadThatFailsAfterTheChecksPutsTheObjectsBackBitwise) {
  const SavedMlp saved(/*trained=*/true);
  const nn::io::Checkpoint& c = saved.checkpoint;
  auto model = Mlp(99);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.01, .momentum = 0.9});
  LocalStep(*model, opt, kBatch);
  nn::optim::LrTarget target{[&opt] { return opt.lr(); },
                             [&opt](double lr) {
                               if (lr > 0.02) throw std::runtime_error("the target refuses rates above 0.02");
                               opt.set_lr(lr);
                             }};
  nn::optim::LrScheduler sched(target, nn::optim::LambdaSchedule([](int64_t) { return 1.0; }, "decay"));
  sched.Step();
  opt.set_lr(0.0125);
  const std::vector<std::string> before = StateBytes(*model);
  const std::vector<std::string> opt_before = StateBytes(opt.StateDict());
  ASSERT_TRUE(before != StateBytes(*saved.model));  // a restore would change them
  ASSERT_TRUE(opt_before != StateBytes(saved.opt.StateDict()));
  std::string err = "no error";
  try {
    RestoreCheckpoint(c, *model, &opt, &sched);
  } catch (const std::runtime_error& e) {
    err = e.what();
  }
  EXPECT_EQ(err, "the target refuses rates above 0.02");
  EXPECT_TRUE(StateBytes(*model) == before) << "the model was changed";
  EXPECT_TRUE(StateBytes(opt.StateDict()) == opt_before) << "the optimizer was changed";
  EXPECT_EQ(opt.lr(), 0.0125);
  EXPECT_EQ(sched.step_count(), 1);
  EXPECT_EQ(sched.base_lrs(), std::vector<double>{0.01});
}

// As above, alone, but what the load throws is no std::exception, and the
// target then refuses the rate it had before the call when the scheduler
// is put back: the error names both, and asks for another restore; the
// model and the optimizer are still put back bitwise.
TEST(DdpCheckpointTest, ALoadThatFailsThenAPartThatCannotBePutBackAreBothNamed) {
  const SavedMlp saved(/*trained=*/true);
  auto model = Mlp(99);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.01, .momentum = 0.9});
  LocalStep(*model, opt, kBatch);
  auto armed = std::make_shared<bool>(false);
  nn::optim::LrTarget target{[&opt] { return opt.lr(); },
                             [&opt, armed](double lr) {
                               if (lr > 0.02) throw RateRefused{lr};
                               if (*armed && lr < 0.02) throw std::runtime_error("the target refuses rates below 0.02");
                               opt.set_lr(lr);
                             }};
  nn::optim::LrScheduler sched(target, nn::optim::LambdaSchedule([](int64_t) { return 1.0; }, "decay"));
  *armed = true;
  const std::vector<std::string> before = StateBytes(*model);
  const std::vector<std::string> opt_before = StateBytes(opt.StateDict());
  std::string err = "no error";
  try {
    RestoreCheckpoint(saved.checkpoint, *model, &opt, &sched);
  } catch (const std::runtime_error& e) {
    err = e.what();
  }
  EXPECT_EQ(err, "RestoreCheckpoint: loading the scheduler's state threw: an exception that is not a "
                 "std::exception (the model and the optimizer were loaded before it), then putting the "
                 "scheduler's state back threw: the target refuses rates below 0.02: restore again, or rebuild "
                 "the objects, before training");
  EXPECT_TRUE(StateBytes(*model) == before) << "the model was not put back";
  EXPECT_TRUE(StateBytes(opt.StateDict()) == opt_before) << "the optimizer was not put back";
}

TEST(DdpCheckpointTest, SchedulerAndScalerRoundTripThroughAFile) {
  auto model = Mlp(1);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.1, .momentum = 0.9});
  nn::optim::LrScheduler sched(opt, nn::optim::StepSchedule(2, 0.5));
  nn::optim::GradScaler scaler({.init_scale = 1024, .growth_interval = 2});
  for (int s = 0; s < 3; ++s) {
    ScaledStep(*model, opt, scaler, s);
    sched.Step();
  }
  // Not the defaults: the scale grew once, the lr decayed once.
  ASSERT_EQ(scaler.scale(), 2048.0);
  ASSERT_EQ(scaler.growth_tracker(), 1);
  ASSERT_EQ(sched.step_count(), 3);
  ASSERT_EQ(opt.lr(), 0.05);
  const std::string path = TempDir() + "/c.safetensors";
  nn::io::SaveCheckpoint(path, MakeCheckpoint(*model, &opt, {{"step", "3"}}, &sched, &scaler));

  auto resumed = Mlp(99);
  nn::optim::Sgd resumed_opt(resumed->NamedParameters(), {.lr = 0.1, .momentum = 0.9});
  nn::optim::LrScheduler resumed_sched(resumed_opt, nn::optim::StepSchedule(2, 0.5));
  nn::optim::GradScaler resumed_scaler({.init_scale = 1024, .growth_interval = 2});
  RestoreCheckpoint(nn::io::LoadCheckpoint(path), *resumed, &resumed_opt, &resumed_sched, &resumed_scaler);
  EXPECT_EQ(resumed_sched.step_count(), 3);
  EXPECT_EQ(resumed_sched.base_lr(), 0.1);
  EXPECT_EQ(resumed_opt.lr(), 0.05);
  EXPECT_EQ(resumed_scaler.scale(), 2048.0);
  EXPECT_EQ(resumed_scaler.growth_tracker(), 1);
  EXPECT_TRUE(StateBytes(*resumed) == StateBytes(*model)) << "the models differ";
  EXPECT_TRUE(StateBytes(resumed_opt.StateDict()) == StateBytes(opt.StateDict())) << "the optimizer states differ";
  // Both continue alike: the lr decays at step 4, the scale grows at the
  // second good step.
  for (int s = 3; s < 5; ++s) {
    ScaledStep(*model, opt, scaler, s);
    sched.Step();
    ScaledStep(*resumed, resumed_opt, resumed_scaler, s);
    resumed_sched.Step();
  }
  EXPECT_EQ(resumed_opt.lr(), 0.025);
  EXPECT_EQ(resumed_scaler.scale(), 4096.0);
  EXPECT_TRUE(StateBytes(*resumed) == StateBytes(*model)) << "the models differ";
}

// --------------------------------------------------------- killed rank ----

constexpr int kSurvivorExit = 3;
constexpr int kKillStep = 7;
// The group's timeout in KilledRankFailsTheOthersAndTheLastCheckpointLoads,
// and the bound on how long a survivor takes to find the loss: half of it,
// wide for a loaded machine, and a survivor that waited for the timeout
// instead fails it.
constexpr int kKilledRankTimeoutMs = 20000;
constexpr int kLossFoundWithinMs = kKilledRankTimeoutMs / 2;

DDP_TEST_WORKER(killed_rank) {
  auto pg = testing::WorkerGroup();
  const std::string path = std::string(std::getenv("DDP_TEST_CKPT")) + "/train.safetensors";
  auto model = Mlp(1);
  DistributedDataParallel ddp(model, {.process_group = pg});
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  const auto& data = testing::FashionMnist();
  auto failing_since = std::chrono::steady_clock::now();
  try {
    for (int s = 0; s < 20; ++s) {
      if (s > 0 && s % 2 == 0) {
        SaveCheckpoint(*pg, path, MakeCheckpoint(ddp, &opt, {{"step", std::to_string(s)}}));
      }
      auto [x, y] = testing::Batch(data, (s * pg->size() + pg->rank()) * kBatch, kBatch);
      opt.ZeroGrad();
      Tensor loss = nn::loss::CrossEntropy(ddp(x), y);
      if (s == kKillStep && pg->rank() == pg->size() - 1) raise(SIGKILL);  // between forward and backward
      failing_since = std::chrono::steady_clock::now();
      nn::Backward(loss);
      opt.Step();
    }
  } catch (const DistributedError& e) {
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - failing_since).count();
    std::fprintf(stderr, "survivor: failed after %.0f ms: %s\n", ms, e.what());
    WORKER_EXPECT(ms < kLossFoundWithinMs, "took " + std::to_string(ms) + " ms");
    return testing::WorkerFailures() == 0 ? kSurvivorExit : 1;
  }
  std::fprintf(stderr, "training finished although a rank was killed\n");
  return 1;
}

TEST(DdpCheckpointTest, KilledRankFailsTheOthersAndTheLastCheckpointLoads) {
  const std::string dir = TempDir();
  // How fast the survivors find the loss is checked by each survivor itself
  // (under half the group's timeout, from its last step); the run as a
  // whole (spawn, UCX, data, 7 steps: about 3 s unloaded, several times
  // that under CI's load) is only bounded here, against a hang.
  auto run = RunWorkers("killed_rank", 3,
                        {{"DDP_TEST_CKPT", dir}, {"DDP_TEST_TIMEOUT_MS", std::to_string(kKilledRankTimeoutMs)}}, 60000,
                        /*stop_all_on_failure=*/false);
  const std::string out = testing::AllOutput(run);
  EXPECT_EQ(run.ExitCode(2), 128 + SIGKILL) << out;
  for (int r : {0, 1}) {
    EXPECT_EQ(run.ExitCode(r), kSurvivorExit) << out;
    EXPECT_NE(run.Output(r).find("PEER_LOST"), std::string::npos) << out;
    EXPECT_NE(run.Output(r).find("rank 2"), std::string::npos) << out;
  }
  // The last checkpoint (step 6) is whole and loads into the model; no
  // temporary file was left behind.
  nn::io::Checkpoint c = nn::io::LoadCheckpoint(dir + "/train.safetensors");
  EXPECT_EQ(nn::io::MetadataInt(c.metadata, "step", "checkpoint"), 6);
  auto model = Mlp(5);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  RestoreCheckpoint(c, *model, &opt);
  EXPECT_EQ(ListDir(dir), std::vector<std::string>{"train.safetensors"});
}

// A rank killed while rank 0 writes (DDP_TEST_CASE "root_dies": rank 0
// itself; "peer_dies": rank 2, waiting for the write): the others fail
// well within the group's timeout (20 s) naming the lost rank, instead of
// waiting it out. Rank 0, when it lives, lets its write finish first (a
// group failure does not stop a write) and says so. The file at the path
// holds a whole checkpoint either way: the last one saved when rank 0
// died, the new one when it finished.
DDP_TEST_WORKER(killed_during_save) {
  const std::string which = std::getenv("DDP_TEST_CASE");
  const std::string dir = std::getenv("DDP_TEST_CKPT");
  const std::string path = dir + "/c.safetensors";
  const std::string writing = dir + "/writing";  // rank 0 is inside its write
  auto pg = testing::WorkerGroup();
  nn::io::Checkpoint c;
  for (int i = 0; i < 8; ++i) c.model.emplace_back("w" + std::to_string(i), nn::Ones({1024}));
  c.metadata["step"] = "1";
  SaveCheckpoint(*pg, path, c);
  c.metadata["step"] = "2";
  const int killed = which == "root_dies" ? 0 : 2;
  std::thread watcher;
  if (pg->rank() == 0) {
    // 8 pieces of 400 ms: the write takes at least 3.2 s.
    nn::io::internal::SetWritePausePerPiece(std::chrono::milliseconds(400));
    watcher = std::thread([&] {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (nn::io::internal::PausesBegunForTesting() == 0 && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      if (killed == 0) raise(SIGKILL);
      std::ofstream(writing) << "1";
    });
  } else if (pg->rank() == killed) {
    watcher = std::thread([&] {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (access(writing.c_str(), F_OK) != 0 && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      raise(SIGKILL);
    });
  }
  const Outcome failed = OutcomeOf<DistributedError>([&] { SaveCheckpoint(*pg, path, c); });
  const std::string who = which + ", rank " + std::to_string(pg->rank());
  WORKER_EXPECT(failed.error.find("PEER_LOST") != std::string::npos &&
                    failed.error.find("rank " + std::to_string(killed)) != std::string::npos,
                who + " got: " + failed.error);
  if (pg->rank() == 0) {
    WORKER_EXPECT(failed.error.find("meanwhile rank 0 went on with the write, which completed") !=
                      std::string::npos,
                  who + " got: " + failed.error);
  }
  WORKER_EXPECT(failed.seconds < 10, who + ": the failure took " + std::to_string(failed.seconds) + " s");
  if (watcher.joinable()) watcher.join();
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, ARankKilledDuringASaveFailsTheOthersPromptlyAndLeavesAWholeCheckpoint) {
  for (const char* which : {"root_dies", "peer_dies"}) {
    const std::string dir = TempDir();
    auto run = RunWorkers("killed_during_save", 3,
                          {{"DDP_TEST_CASE", which}, {"DDP_TEST_CKPT", dir}, {"DDP_TEST_TIMEOUT_MS", "20000"}},
                          60000, /*stop_all_on_failure=*/false);
    const std::string out = testing::AllOutput(run);
    const int killed = std::string(which) == "root_dies" ? 0 : 2;
    for (int r = 0; r < 3; ++r) EXPECT_EQ(run.ExitCode(r), r == killed ? 128 + SIGKILL : 0) << which << "\n" << out;
    const nn::io::Checkpoint c = nn::io::LoadCheckpoint(dir + "/c.safetensors");
    EXPECT_EQ(nn::io::MetadataInt(c.metadata, "step", "checkpoint"), killed == 0 ? 1 : 2) << which;
    EXPECT_EQ(c.model.size(), 8u) << which;
  }
}

// A full disk on rank 0 (here the file size limit, EFBIG, which a write
// meets as it would ENOSPC: a short write, then the error): every rank
// throws the same error naming the path and the system's reason, the last
// checkpoint stays whole under the path, no temporary file is left beside
// it, and the group goes on.
DDP_TEST_WORKER(save_disk_full) {
  auto pg = testing::WorkerGroup();
  const std::string dir = std::getenv("DDP_TEST_CKPT");
  const std::string path = dir + "/c.safetensors";
  nn::io::Checkpoint c;
  c.model.emplace_back("w", nn::Ones({16}));
  c.metadata["step"] = "1";
  SaveCheckpoint(*pg, path, c);
  c.model.emplace_back("big", nn::Ones({1 << 16}));  // 256 KiB
  c.metadata["step"] = "2";
  rlimit old_limit{};
  if (pg->rank() == 0) {
    std::signal(SIGXFSZ, SIG_IGN);  // its default ends the process
    WORKER_EXPECT(getrlimit(RLIMIT_FSIZE, &old_limit) == 0, "getrlimit");
    rlimit limit = old_limit;
    limit.rlim_cur = 64 << 10;
    WORKER_EXPECT(setrlimit(RLIMIT_FSIZE, &limit) == 0, std::string("setrlimit: ") + std::strerror(errno));
  }
  const Outcome failed = OutcomeOf<std::runtime_error>([&] { SaveCheckpoint(*pg, path, c); });
  if (pg->rank() == 0) setrlimit(RLIMIT_FSIZE, &old_limit);
  const std::string who = "rank " + std::to_string(pg->rank());
  WORKER_EXPECT(failed.error.find("SaveCheckpoint: rank 0 could not write " + path + ": " + path) !=
                        std::string::npos &&
                    failed.error.find(std::strerror(EFBIG)) != std::string::npos,
                who + " got: " + failed.error);
  pg->Barrier().Wait();  // the group goes on
  if (pg->rank() == 0) {
    WORKER_EXPECT(ListDir(dir) == std::vector<std::string>{"c.safetensors"}, "the folder holds more");
    const nn::io::Checkpoint left = nn::io::LoadCheckpoint(path);
    WORKER_EXPECT(nn::io::MetadataInt(left.metadata, "step", path) == 1 && left.model.size() == 1,
                  "the last checkpoint was changed");
  }
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, AFullDiskOnRankZeroFailsEveryRankNamingThePathAndKeepsTheLastCheckpoint) {
  auto run = RunWorkers("save_disk_full", 2, {{"DDP_TEST_CKPT", TempDir()}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ---------------------------------------------------- sharded optimizer ----

// A ZeroRedundancyOptimizer and a scheduler over its shard, saved and
// resumed as checkpoint.h's top comment says (the consolidated state in
// the optimizer list; on resume, the sharded optimizer loads its keys and
// the collective RestoreCheckpoint the rest): the resumed run equals the
// uninterrupted one bit for bit.
DDP_TEST_WORKER(resume_zero) {
  auto pg = testing::WorkerGroup();
  const std::string path = std::string(std::getenv("DDP_TEST_CKPT")) + "/zero.safetensors";
  auto make = [](nn::optim::NamedParameters params) -> std::unique_ptr<nn::optim::Optimizer> {
    return std::make_unique<nn::optim::Sgd>(std::move(params), nn::optim::SgdOptions{.lr = 0.05, .momentum = 0.9});
  };
  auto decay = [] { return nn::optim::LambdaSchedule([](int64_t s) { return 1.0 / (1.0 + s); }, "decay"); };
  auto step = [&pg](DistributedDataParallel& ddp, ZeroRedundancyOptimizer& zero, nn::optim::LrScheduler& sched,
                    int s) {
    auto [x, y] = testing::Batch(testing::FashionMnist(), (s * pg->size() + pg->rank()) * kBatch, kBatch);
    zero.ZeroGrad();
    nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
    zero.Step();
    sched.Step();
  };
  auto model = Mlp(1);
  DistributedDataParallel ddp(model, {.process_group = pg});
  ZeroRedundancyOptimizer zero(model->NamedParameters(), pg, make);
  nn::optim::LrScheduler sched(zero.local(), decay());
  for (int s = 0; s < 3; ++s) step(ddp, zero, sched, s);
  nn::io::Checkpoint c = MakeCheckpoint(ddp, nullptr, {{"step", "3"}}, &sched);
  const nn::optim::NamedTensors whole = zero.ConsolidatedStateDict(0);
  c.optimizer.insert(c.optimizer.end(), whole.begin(), whole.end());
  SaveCheckpoint(*pg, path, c);
  for (int s = 3; s < 6; ++s) step(ddp, zero, sched, s);
  const uint64_t uninterrupted = testing::HashState(*model);

  auto resumed = Mlp(99);
  DistributedDataParallel ddp2(resumed, {.process_group = pg});
  ZeroRedundancyOptimizer zero2(resumed->NamedParameters(), pg, make);
  nn::optim::LrScheduler sched2(zero2.local(), decay());
  const nn::io::Checkpoint loaded = LoadCheckpoint(*pg, path);
  zero2.LoadStateDict(loaded.optimizer);
  nn::io::Checkpoint rest = loaded;
  rest.optimizer.clear();
  for (const auto& [key, t] : loaded.optimizer) {
    const bool optimizers = key == "lr" || key.rfind("group.", 0) == 0 || key.rfind("param_groups.", 0) == 0 ||
                            key.rfind("state.", 0) == 0;
    if (!optimizers) rest.optimizer.emplace_back(key, t);
  }
  RestoreCheckpoint(*pg, rest, ddp2, nullptr, &sched2);
  for (int s = 3; s < 6; ++s) step(ddp2, zero2, sched2, s);
  WORKER_EXPECT(testing::HashState(*resumed) == uninterrupted, "the resumed run differs");
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, AShardedOptimizerAndItsSchedulerResumeAsTheUninterruptedRun) {
  auto run = RunWorkers("resume_zero", 3, {{"DDP_TEST_CKPT", TempDir()}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// ------------------------------------------- PowerSGD and averaging ----

// Rank 1 from iteration 2, without error feedback: the iteration and Q
// are then the whole state, and they are the same on every rank.
constexpr PowerSgdOptions kPowerSgd{.matrix_approximation_rank = 1, .start_iteration = 2, .use_error_feedback = false};

// Trains steps [from, to) of the MLP with PowerSGD and a step-counting
// averager (every step past warm-up 4; DDP's replicas are identical, so it
// counts without changing them).
void TrainPowerSgd(DistributedDataParallel& ddp, nn::optim::Sgd& opt, PeriodicModelAverager& averager,
                   ProcessGroup& pg, int from, int to) {
  for (int s = from; s < to; ++s) {
    TrainStep(ddp, opt, pg, s);
    averager.AverageParameters(ddp.module()->Parameters());
  }
}

DDP_TEST_WORKER(resume_powersgd) {
  auto pg = testing::WorkerGroup();
  const std::string path = std::getenv("DDP_TEST_CKPT");
  const ModelAveragerOptions averaging{.period = 1, .warmup_steps = 4, .process_group = pg};
  uint64_t uninterrupted = 0;
  std::vector<int64_t> order;
  {
    auto model = Mlp(1);
    DistributedDataParallel ddp(model, {.process_group = pg});
    auto state = std::make_shared<PowerSgdState>(kPowerSgd);
    ddp.RegisterCommHook(hooks::PowerSgdHook(state));
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
    PeriodicModelAverager averager(averaging);
    TrainPowerSgd(ddp, opt, averager, *pg, 0, 3);
    order = ddp.BucketOrder();
    SaveCheckpoint(*pg, path, MakeCheckpoint(ddp, &opt, {{"step", "3"}}, nullptr, nullptr, state.get(), &averager));
    TrainPowerSgd(ddp, opt, averager, *pg, 3, 6);
    uninterrupted = testing::HashState(*model);
  }
  // The restored run, and one whose hook restarts with the warm-up already
  // counted as done (the trainer's way before PowerSGD's state was saved).
  for (bool restore_powersgd : {true, false}) {
    auto model = Mlp(99);
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
    PowerSgdOptions options = kPowerSgd;
    if (!restore_powersgd) options.start_iteration = 0;
    auto state = std::make_shared<PowerSgdState>(options);
    PeriodicModelAverager averager(averaging);
    nn::io::Checkpoint c = LoadCheckpoint(*pg, path);
    if (!restore_powersgd) {
      std::erase_if(c.optimizer, [](const auto& e) { return e.first.rfind("powersgd.", 0) == 0; });
    }
    RestoreCheckpoint(c, *model, &opt, nullptr, nullptr, restore_powersgd ? state.get() : nullptr, &averager);
    WORKER_EXPECT(averager.step() == 3, "the averager resumed at step " + std::to_string(averager.step()));
    DdpOptions o;
    o.process_group = pg;
    o.bucket_order = order;
    DistributedDataParallel ddp(model, o);
    ddp.RegisterCommHook(hooks::PowerSgdHook(state));
    if (restore_powersgd) {
      WORKER_EXPECT(state->iteration() == 3, "PowerSGD resumed at iteration " + std::to_string(state->iteration()));
    }
    TrainPowerSgd(ddp, opt, averager, *pg, 3, 6);
    WORKER_EXPECT(averager.step() == 6, "the averager ended at step " + std::to_string(averager.step()));
    const bool same = testing::HashState(*model) == uninterrupted;
    // Without the saved Q, the first step after the resume starts from a
    // freshly drawn one and the trajectories part.
    WORKER_EXPECT(same == restore_powersgd, std::string("PowerSGD ") + (restore_powersgd ? "restored" : "restarted") +
                                                ": the resumed run " + (same ? "equals" : "differs from") +
                                                " the uninterrupted one");
  }
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, ResumedPowerSgdAndAveragerContinueTheUninterruptedRun) {
  const std::string dir = TempDir();
  auto run = RunWorkers("resume_powersgd", 2, {{"DDP_TEST_CKPT", dir + "/model.safetensors"}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// Rank 1 from iteration 2, with error feedback and warm start: the state
// is the iteration, the Q's and this rank's residuals. (No random state is
// kept: a Q drawn again comes from the seed, the bucket, the tensor and
// the iteration.)
constexpr PowerSgdOptions kPowerSgdWithFeedback{.matrix_approximation_rank = 1, .start_iteration = 2};

// Each entry's bytes by its name: PowerSgdState lists the state it loaded
// and has not yet placed in a bucket after the buckets' own, in an order
// of its own, so only what each name holds is compared.
std::map<std::string, std::string> BytesByName(const nn::optim::NamedTensors& state) {
  std::map<std::string, std::string> out;
  for (const auto& [name, t] : state) {
    const Tensor c = t.Detach().Contiguous();
    out[name] = std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
  }
  return out;
}

// An MLP trained under DDP with PowerSGD (kPowerSgdWithFeedback), SGD
// with momentum and a scheduler driving the rate through a target that,
// when `refuses`, throws for rates above 0.02.
struct PowerSgdTraining {
  PowerSgdTraining(const std::shared_ptr<ProcessGroup>& pg, bool refuses)
      : model(Mlp(1)),
        ddp(model, {.process_group = pg}),
        state(std::make_shared<PowerSgdState>(kPowerSgdWithFeedback)),
        opt(model->NamedParameters(), {.lr = 0.01, .momentum = 0.9}),
        sched(nn::optim::LrTarget{[this] { return opt.lr(); },
                                  [this, refuses](double lr) {
                                    if (refuses && lr > 0.02) {
                                      throw std::runtime_error("rank 1's target refuses rates above 0.02");
                                    }
                                    opt.set_lr(lr);
                                  }},
              nn::optim::LambdaSchedule([](int64_t) { return 1.0; }, "decay")) {
    ddp.RegisterCommHook(hooks::PowerSgdHook(state));
  }
  void Train(ProcessGroup& pg, int from, int to) {
    for (int s = from; s < to; ++s) {
      TrainStep(ddp, opt, pg, s);
      sched.Step();
    }
  }
  std::map<std::string, std::string> PowerSgdBytes() const {
    return BytesByName(state->StateDict(model->NamedParameters(), /*with_residuals=*/true));
  }
  std::shared_ptr<nn::modules::Module> model;
  DistributedDataParallel ddp;
  std::shared_ptr<PowerSgdState> state;
  nn::optim::Sgd opt;
  nn::optim::LrScheduler sched;
};

// A collective restore whose load fails on rank 1 (its target refuses the
// saved rate) after ranks 0 and 2 loaded every part, PowerSGD's included:
// PowerSGD's state is put back through its own StateDict and LoadStateDict
// (with this rank's residuals), which leaves it in a form of its own (the
// buckets emptied, their state waiting for the next backward). Every
// rank's hook then holds bitwise what it held before the call (iteration,
// Q's, residuals), and training goes on exactly as a run that never
// attempted the restore: the same weights and the same PowerSGD state
// after three more steps.
DDP_TEST_WORKER(restore_fails_and_powersgd_is_put_back) {
  auto pg = testing::WorkerGroup();  // DDP_TEST_TIMEOUT_MS: 60 s
  const std::string rank = "rank " + std::to_string(pg->rank());
  // The checkpoint: another model, with its own hook's state.
  auto saved = Mlp(7);
  nn::optim::Sgd saved_opt(saved->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  nn::optim::LrScheduler saved_sched(saved_opt, nn::optim::LambdaSchedule([](int64_t) { return 1.0; }, "decay"));
  auto saved_state = std::make_shared<PowerSgdState>(kPowerSgdWithFeedback);
  {
    DistributedDataParallel ddp(saved, {.process_group = pg});
    ddp.RegisterCommHook(hooks::PowerSgdHook(saved_state));
    for (int s = 10; s < 13; ++s) {
      TrainStep(ddp, saved_opt, *pg, s);
      saved_sched.Step();
    }
  }
  const nn::io::Checkpoint c = MakeCheckpoint(*saved, &saved_opt, {}, &saved_sched, nullptr, saved_state.get());
  // Two identical runs, trained side by side: one attempts the restore.
  PowerSgdTraining attempted(pg, pg->rank() == 1);
  PowerSgdTraining untouched(pg, false);
  attempted.Train(*pg, 0, 4);
  untouched.Train(*pg, 0, 4);
  const std::map<std::string, std::string> powersgd_before = attempted.PowerSgdBytes();
  WORKER_EXPECT(attempted.state->iteration() == 4 && powersgd_before.count("powersgd.q.1.weight") == 1 &&
                    powersgd_before.count("powersgd.residual.1.weight") == 1,
                rank + ": PowerSGD has not compressed yet (iteration " +
                    std::to_string(attempted.state->iteration()) + ")");
  WORKER_EXPECT(powersgd_before == untouched.PowerSgdBytes(), rank + ": the two runs differ before the restore");
  // Not a test if the checkpoint held the run's own Q's.
  const std::map<std::string, std::string> in_checkpoint = BytesByName(c.optimizer);
  WORKER_EXPECT(in_checkpoint.count("powersgd.q.1.weight") == 1 &&
                    in_checkpoint.at("powersgd.q.1.weight") != powersgd_before.at("powersgd.q.1.weight"),
                rank + ": the checkpoint's Q is the run's");
  const std::vector<std::string> model_before = StateBytes(*attempted.model);
  const std::vector<std::string> opt_before = StateBytes(attempted.opt.StateDict());
  std::string error = "no error";
  try {
    RestoreCheckpoint(*pg, c, attempted.ddp, &attempted.opt, &attempted.sched, nullptr, attempted.state.get());
  } catch (const std::runtime_error& e) {
    error = e.what();
  }
  WORKER_EXPECT(error == "RestoreCheckpoint: every rank's checks passed, but loading failed on rank 1: loading "
                         "the scheduler's state threw: rank 1's target refuses rates above 0.02 (the model and "
                         "the optimizer were loaded before it); every rank put its model and components back as "
                         "they were before the call",
                rank + " got: " + error);
  WORKER_EXPECT(attempted.state->iteration() == 4,
                rank + ": PowerSGD's iteration is " + std::to_string(attempted.state->iteration()));
  const std::map<std::string, std::string> powersgd_after = attempted.PowerSgdBytes();
  for (const auto& [name, bytes] : powersgd_before) {
    const auto it = powersgd_after.find(name);
    WORKER_EXPECT(it != powersgd_after.end() && it->second == bytes,
                  rank + ": PowerSGD's `" + name + "` is " + (it == powersgd_after.end() ? "gone" : "not as it was"));
  }
  WORKER_EXPECT(powersgd_after.size() == powersgd_before.size(),
                rank + ": PowerSGD holds " + std::to_string(powersgd_after.size()) + " entries, " +
                    std::to_string(powersgd_before.size()) + " before");
  WORKER_EXPECT(StateBytes(*attempted.model) == model_before && StateBytes(attempted.opt.StateDict()) == opt_before,
                rank + ": the model or the optimizer is not as it was");
  attempted.Train(*pg, 4, 7);
  untouched.Train(*pg, 4, 7);
  WORKER_EXPECT(testing::HashState(*attempted.model) == testing::HashState(*untouched.model),
                rank + ": training after the failed restore differs from the run that never attempted it");
  WORKER_EXPECT(attempted.PowerSgdBytes() == untouched.PowerSgdBytes(),
                rank + ": PowerSGD's state after the failed restore differs from the run that never attempted it");
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, AFailedRestorePutsPowerSgdStateBackBitwiseAndTrainingGoesOnAsIfNeverAttempted) {
  auto run = RunWorkers("restore_fails_and_powersgd_is_put_back", 3, {{"DDP_TEST_TIMEOUT_MS", "60000"}}, 180000,
                        /*stop_all_on_failure=*/false);
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// PowerSGD or averager state with no argument to take it, and PowerSGD
// state for other settings: refused naming the argument or the parameter,
// and nothing restored.
TEST(DdpCheckpointTest, PowerSgdAndAveragerStateIsRefusedWhenNothingTakesItOrItDoesNotFit) {
  auto pg = ProcessGroup::Single();
  auto saved = Mlp(1);
  nn::optim::Sgd saved_opt(saved->NamedParameters(), {.lr = 0.05});
  auto saved_state = std::make_shared<PowerSgdState>(kPowerSgd);
  PeriodicModelAverager saved_averager({.period = 2, .process_group = pg});
  // One process: DDP would not call the hook, so it is called here on a
  // bucket of the first weight alone, past the start.
  const Tensor weight = saved->NamedParameters().at(0).second;
  CommHook hook = hooks::PowerSgdHook(saved_state);
  nn::Generator gen(4);
  for (int s = 0; s < 3; ++s) {
    GradBucket bucket(0, 1, nn::Randn({weight.numel()}, {}, gen), {weight}, {0});
    hook(*pg, bucket).Wait();
    saved_averager.AverageParameters(saved->Parameters());
  }
  const nn::io::Checkpoint c =
      MakeCheckpoint(*saved, &saved_opt, {}, nullptr, nullptr, saved_state.get(), &saved_averager);
  auto model = Mlp(99);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  const std::vector<std::string> before = StateBytes(*model);
  std::string err = RestoreError([&] { RestoreCheckpoint(c, *model, &opt); });
  EXPECT_THAT(err, AllOf(HasSubstr("PowerSGD state (`powersgd.iteration`, `powersgd.q."), HasSubstr("pass `powersgd`"),
                         HasSubstr("PeriodicModelAverager state (`averager.step`)"), HasSubstr("pass `averager`")));
  // Rank 2 needs Q's of two rows.
  PowerSgdOptions rank_two = kPowerSgd;
  rank_two.matrix_approximation_rank = 2;
  PowerSgdState other(rank_two);
  PeriodicModelAverager averager({.period = 2, .process_group = pg});
  err = RestoreError([&] { RestoreCheckpoint(c, *model, &opt, nullptr, nullptr, &other, &averager); });
  EXPECT_THAT(err, AllOf(HasSubstr("PowerSgdState.LoadStateDict"), HasSubstr("parameter `1.weight`"),
                         HasSubstr("matrix_approximation_rank 2")));
  EXPECT_TRUE(StateBytes(*model) == before) << "the model was changed";
  EXPECT_EQ(other.iteration(), 0);
  EXPECT_EQ(averager.step(), 0);
}

// ------------------------------------------------- post-local SGD ----

// Two ranks with the post-local-SGD hook (local from iteration 3, no
// subgroup) save after 3 steps, the last global one; the resumed run takes
// the hook's iteration from the checkpoint, so its first step is local (the
// replicas part, as in the uninterrupted run) and each rank ends where the
// uninterrupted run did, bit for bit.
constexpr int64_t kLocalFrom = 3;

DDP_TEST_WORKER(resume_post_local_sgd) {
  auto pg = testing::WorkerGroup();
  const std::string path = std::getenv("DDP_TEST_CKPT");
  uint64_t uninterrupted = 0;
  {
    auto model = Mlp(2);
    DistributedDataParallel ddp(model, {.process_group = pg});
    auto state = std::make_shared<PostLocalSgdState>(PostLocalSgdOptions{.start_iteration = kLocalFrom});
    ddp.RegisterCommHook(hooks::PostLocalSgdHook(state));
    nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
    for (int s = 0; s < kLocalFrom; ++s) TrainStep(ddp, opt, *pg, s);
    SaveCheckpoint(*pg, path, MakeCheckpoint(ddp, &opt, {{"step", "3"}}, nullptr, nullptr, nullptr, nullptr, state.get()));
    TrainStep(ddp, opt, *pg, kLocalFrom);
    uninterrupted = testing::HashState(*model);
    WORKER_EXPECT(!testing::SameOnAllRanks(*pg, uninterrupted), "the uninterrupted run's local step kept the replicas equal");
  }
  auto model = Mlp(99);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05, .momentum = 0.9});
  auto state = std::make_shared<PostLocalSgdState>(PostLocalSgdOptions{.start_iteration = kLocalFrom});
  RestoreCheckpoint(LoadCheckpoint(*pg, path), *model, &opt, nullptr, nullptr, nullptr, nullptr, state.get());
  WORKER_EXPECT(state->iteration() == kLocalFrom, "the hook resumed at iteration " + std::to_string(state->iteration()));
  DistributedDataParallel ddp(model, {.process_group = pg});
  ddp.RegisterCommHook(hooks::PostLocalSgdHook(state));
  TrainStep(ddp, opt, *pg, kLocalFrom);
  WORKER_EXPECT(testing::HashState(*model) == uninterrupted,
                "the resumed run differs from the uninterrupted one after its first step (iteration now " +
                    std::to_string(state->iteration()) + ")");
  return testing::WorkerExit();
}

TEST(DdpCheckpointTest, ResumedPostLocalSgdHookStaysLocalLikeTheUninterruptedRun) {
  const std::string dir = TempDir();
  auto run = RunWorkers("resume_post_local_sgd", 2, {{"DDP_TEST_CKPT", dir + "/model.safetensors"}});
  EXPECT_TRUE(run.AllSucceeded()) << testing::AllOutput(run);
}

// The hook's state with no argument to take it, or malformed, is refused
// naming the argument or the key; it is checked with everything else, so
// nothing is restored when any part is wrong, the hook's state included.
TEST(DdpCheckpointTest, PostLocalSgdStateIsRefusedWhenNothingTakesItOrItIsMalformed) {
  auto pg = ProcessGroup::Single();
  auto saved = Mlp(1);
  nn::optim::Sgd saved_opt(saved->NamedParameters(), {.lr = 0.05});
  PeriodicModelAverager saved_averager({.period = 2, .process_group = pg});
  saved_averager.AverageParameters(saved->Parameters());
  // One process: DDP would not call the hook, so it is called here on a
  // bucket of the first weight alone.
  auto shared = std::make_shared<PostLocalSgdState>(PostLocalSgdOptions{.start_iteration = 1});
  CommHook hook = hooks::PostLocalSgdHook(shared);
  const Tensor weight = saved->NamedParameters().at(0).second;
  for (int s = 0; s < 2; ++s) {
    GradBucket bucket(0, 1, nn::Zeros({weight.numel()}), {weight}, {0});
    hook(*pg, bucket).Wait();
  }
  ASSERT_EQ(shared->iteration(), 2);
  const nn::io::Checkpoint c =
      MakeCheckpoint(*saved, &saved_opt, {}, nullptr, nullptr, nullptr, &saved_averager, shared.get());

  auto model = Mlp(99);
  nn::optim::Sgd opt(model->NamedParameters(), {.lr = 0.05});
  const std::vector<std::string> before = StateBytes(*model);
  PeriodicModelAverager averager({.period = 2, .process_group = pg});
  PostLocalSgdState state({.start_iteration = 1});
  std::string err = RestoreError([&] { RestoreCheckpoint(c, *model, &opt, nullptr, nullptr, nullptr, &averager); });
  EXPECT_THAT(err, AllOf(HasSubstr("nothing was restored"), HasSubstr("post-local-SGD hook state (`post_local_sgd.iteration`)"),
                         HasSubstr("pass `post_local_sgd`")));
  // Malformed: negative.
  nn::io::Checkpoint negative = c;
  for (auto& [key, t] : negative.optimizer) {
    if (key == "post_local_sgd.iteration") t = nn::FromVectorOf<int64_t>({-1}, {});
  }
  err = RestoreError(
      [&] { RestoreCheckpoint(negative, *model, &opt, nullptr, nullptr, nullptr, &averager, &state); });
  EXPECT_THAT(err, AllOf(HasSubstr("PostLocalSgdState.LoadStateDict"), HasSubstr("`post_local_sgd.iteration` is -1, below 0")));
  // The hook's state is fine and the averager's is missing: the hook's
  // iteration is not restored either.
  nn::io::Checkpoint no_step = c;
  std::erase_if(no_step.optimizer, [](const auto& e) { return e.first == "averager.step"; });
  err = RestoreError([&] { RestoreCheckpoint(no_step, *model, &opt, nullptr, nullptr, nullptr, &averager, &state); });
  EXPECT_THAT(err, HasSubstr("missing i64 scalar `averager.step`"));
  EXPECT_TRUE(StateBytes(*model) == before) << "the model was changed";
  EXPECT_EQ(averager.step(), 0);
  EXPECT_EQ(state.iteration(), 0);
  // The whole checkpoint, with every argument: restored.
  RestoreCheckpoint(c, *model, &opt, nullptr, nullptr, nullptr, &averager, &state);
  EXPECT_EQ(state.iteration(), 2);
  EXPECT_EQ(averager.step(), 1);
  EXPECT_TRUE(StateBytes(*model) == StateBytes(*saved));
}

}  // namespace
}  // namespace ddp::dist
