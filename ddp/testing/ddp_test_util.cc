#include "ddp/testing/ddp_test_util.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <tuple>

#include "ddp/distributed_data_parallel.h"
#include "nn/autograd/engine.h"
#include "nn/data/idx.h"
#include "nn/loss/loss.h"
#include "nn/modules/models.h"
#include "nn/optim/adam.h"
#include "nn/ops/functional.h"

namespace ddp::dist::testing {

int& WorkerFailures() {
  static int failures = 0;
  return failures;
}

int WorkerExit() {
  std::fflush(stdout);
  std::fflush(stderr);
  return WorkerFailures() == 0 ? 0 : 1;
}

void ExpectRefused(int rank, const std::function<void()>& f, const std::string& accepted,
                   const std::vector<std::string>& parts) {
  try {
    f();
    WORKER_EXPECT(false, accepted);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    std::fprintf(stderr, "rank %d: %s\n", rank, what.c_str());
    for (const std::string& part : parts) WORKER_EXPECT(what.find(part) != std::string::npos, what);
  }
}

std::shared_ptr<ProcessGroup> WorkerGroup() {
  const char* t = std::getenv("DDP_TEST_TIMEOUT_MS");
  ProcessGroupOptions options;
  options.timeout = std::chrono::milliseconds(t != nullptr ? std::atoi(t) : 20000);
  return ProcessGroup::CreateFromEnvironment(options);
}

namespace {

// The mark file of `rank` in this run of workers.
std::string DoneMarkPath(int rank) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const char* token = std::getenv("DDP_JOB_TOKEN");
  if (dir == nullptr || *dir == '\0') throw std::runtime_error("rank marks need TEST_TMPDIR, which is not set");
  if (token == nullptr || *token == '\0') {
    throw std::runtime_error("rank marks need DDP_JOB_TOKEN, which is not set (not a RunWorkers worker?)");
  }
  return std::string(dir) + "/rank_done_" + token + "_" + std::to_string(rank);
}

}  // namespace

void MarkThisRankDone(int rank) {
  const std::string path = DoneMarkPath(rank);
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  WORKER_EXPECT(fd >= 0, "rank " + std::to_string(rank) + " could not create " + path + ": " + std::strerror(errno));
  if (fd >= 0) close(fd);
}

void MarkThisRankDone(const ProcessGroup& pg) { MarkThisRankDone(pg.rank()); }

void WaitUntilRanksAreDone(const ProcessGroup& pg, const std::vector<int>& ranks, std::chrono::seconds most) {
  WaitUntilRanksAreDone(pg.rank(), ranks, most);
}

void WaitUntilRanksAreDone(int rank, const std::vector<int>& ranks, std::chrono::seconds most) {
  const auto deadline = std::chrono::steady_clock::now() + most;
  std::string missing;
  while (true) {
    missing.clear();
    for (const int r : ranks) {
      if (access(DoneMarkPath(r).c_str(), F_OK) != 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    }
    if (missing.empty() || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  WORKER_EXPECT(missing.empty(), "rank " + std::to_string(rank) + " waited " + std::to_string(most.count()) +
                                     " s and rank(s) " + missing + " were still not done");
}

void StayAliveUntilTheOtherRanksAreDone(const ProcessGroup& pg, std::chrono::seconds most) {
  std::vector<int> others;
  for (int r = 0; r < pg.size(); ++r) {
    if (r != pg.rank()) others.push_back(r);
  }
  WaitUntilRanksAreDone(pg, others, most);
}

const Data& FashionMnist(int64_t n) {
  static Data* data = nullptr;
  if (data != nullptr && data->images.size(0) >= n) return *data;
  auto set = nn::data::LoadFashionMnist(nn::data::kFashionMnistDebianDir, nn::data::Split::kTest);
  n = std::min(n, set->Size());
  auto* d = new Data();
  d->images = nn::Empty({n, 1, 28, 28});
  d->labels = nn::Empty({n}, {.dtype = nn::DType::kInt64});
  float* img = d->images.data<float>();
  int64_t* lab = d->labels.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* px = set->Pixels(i);
    for (int64_t k = 0; k < 784; ++k) img[i * 784 + k] = px[k] / 255.0f;
    lab[i] = set->Label(i);
  }
  delete data;
  data = d;
  return *data;
}

std::pair<nn::Tensor, nn::Tensor> Batch(const Data& data, int64_t start, int64_t count) {
  const int64_t n = data.images.size(0);
  nn::Tensor images = nn::Empty({count, 1, 28, 28});
  nn::Tensor labels = nn::Empty({count}, {.dtype = nn::DType::kInt64});
  for (int64_t i = 0; i < count; ++i) {
    const int64_t k = (start + i) % n;
    std::memcpy(images.data<float>() + i * 784, data.images.data<float>() + k * 784, 784 * 4);
    labels.data<int64_t>()[i] = data.labels.data<int64_t>()[k];
  }
  return {images, labels};
}

namespace {

// Over tensor pairs (a[i], b[i]) named by a: the largest per-tensor
// max |a - b| / max |b|, and that tensor's name.
std::pair<double, std::string> MaxRelativeDifferenceOf(const nn::modules::NamedTensors& a,
                                                       const nn::modules::NamedTensors& b) {
  if (a.size() != b.size()) throw std::logic_error("MaxRelativeDifference: different models");
  double worst = 0;
  std::string name;
  for (size_t i = 0; i < a.size(); ++i) {
    const double rel = RelativeDifference(a[i].second, b[i].second);
    if (rel >= worst) {
      worst = rel;
      name = a[i].first;
    }
  }
  return {worst, name};
}

nn::modules::NamedTensors Gradients(const nn::modules::Module& m) {
  nn::modules::NamedTensors grads;
  for (const auto& [name, p] : m.NamedParameters()) {
    if (!p.grad().defined()) throw std::logic_error("MaxRelativeGradDifference: `" + name + "` has no gradient");
    grads.emplace_back(name, p.grad());
  }
  return grads;
}

}  // namespace

double RelativeDifference(const nn::Tensor& a, const nn::Tensor& b) {
  const std::vector<double> x = a.ToVector<double>(), y = b.ToVector<double>();
  double diff = 0, scale = 0;
  for (size_t k = 0; k < x.size(); ++k) {
    diff = std::max(diff, std::abs(x[k] - y[k]));
    scale = std::max(scale, std::abs(y[k]));
  }
  return scale > 0 ? diff / scale : diff;
}

std::pair<double, std::string> MaxRelativeDifference(const nn::modules::Module& a,
                                                     const nn::modules::Module& b) {
  return MaxRelativeDifferenceOf(a.NamedParameters(), b.NamedParameters());
}

std::pair<double, std::string> MaxRelativeGradDifference(const nn::modules::Module& a,
                                                         const nn::modules::Module& b) {
  return MaxRelativeDifferenceOf(Gradients(a), Gradients(b));
}

uint64_t HashState(const nn::modules::Module& m) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& [name, t] : m.GetStateDict()) {
    const nn::Tensor c = t.Detach().Contiguous();
    const unsigned char* p = static_cast<const unsigned char*>(c.data_ptr());
    for (size_t i = 0; i < c.nbytes(); ++i) {
      h ^= p[i];
      h *= 1099511628211ull;
    }
  }
  return h;
}

bool SameOnAllRanks(ProcessGroup& pg, uint64_t value) {
  nn::Tensor mine = nn::FromVectorOf<int64_t>({static_cast<int64_t>(value)}, {1});
  nn::Tensor all = nn::Empty({pg.size()}, {.dtype = nn::DType::kInt64});
  pg.AllGather(all, mine).Wait();
  for (int r = 0; r < pg.size(); ++r) {
    if (all.data<int64_t>()[r] != static_cast<int64_t>(value)) return false;
  }
  return true;
}

namespace {

// How much longer a run may take under a sanitizer: TSAN runs the workers'
// arithmetic several times slower (the CNN's equivalence run passed 60 s
// with other suites running beside it).
#if defined(__SANITIZE_THREAD__)
constexpr int kSanitizerSlowdown = 5;
#elif defined(__SANITIZE_ADDRESS__)
constexpr int kSanitizerSlowdown = 2;
#else
constexpr int kSanitizerSlowdown = 1;
#endif

}  // namespace

transport::launch::testing::TestRunResult RunWorkers(
    const std::string& worker, int world_size, std::vector<std::pair<std::string, std::string>> env,
    int timeout_ms, bool stop_all_on_failure) {
  transport::launch::testing::TestRunOptions options;
  options.world_size = world_size;
  options.timeout = std::chrono::milliseconds(timeout_ms * kSanitizerSlowdown);
  options.env = std::move(env);
  options.stop_all_on_failure = stop_all_on_failure;
  // DDP_TEST_ECHO=1 shows the workers' output while they run.
  options.echo_output = std::getenv("DDP_TEST_ECHO") != nullptr;
  auto run = transport::launch::testing::RunTestWorkers(worker, options);
  if (!run.ok()) throw std::runtime_error("could not start workers: " + run.status().ToString());
  return std::move(*run);
}

std::string AllOutput(const transport::launch::testing::TestRunResult& run) {
  std::string out = run.Summary() + "\n";
  for (size_t r = 0; r < run.group.output.size(); ++r) {
    out += "---- rank " + std::to_string(r) + " ----\n" + run.group.output[r];
  }
  return out;
}

namespace {

// The model of OneBackwardGrads and TwoWrappers.
std::shared_ptr<nn::modules::Module> MlpOfSeven() {
  nn::Generator gen(7);
  return nn::modules::MakeMlp(gen);
}

}  // namespace

std::vector<std::vector<float>> OneBackwardGrads(const std::shared_ptr<ProcessGroup>& pg, CommHook hook) {
  const Data& data = FashionMnist();
  auto model = MlpOfSeven();
  DistributedDataParallel ddp(model, {.process_group = pg});
  if (hook) ddp.RegisterCommHook(std::move(hook));
  auto [x, y] = Batch(data, pg->rank() * 8, 8);
  nn::Backward(nn::loss::CrossEntropy(ddp(x), y));
  std::vector<std::vector<float>> grads;
  for (const auto& [name, p] : model->NamedParameters()) grads.push_back(p.grad().ToVector<float>());
  return grads;
}

TwoWrappers::TwoWrappers(const std::shared_ptr<ProcessGroup>& first_group,
                         const std::shared_ptr<ProcessGroup>& second_group, CommHook first_hook,
                         CommHook second_hook)
    : first_model_(MlpOfSeven()),
      second_model_(MlpOfSeven()),
      first_(first_model_, {.process_group = first_group}),
      second_(second_model_, {.process_group = second_group}) {
  first_.RegisterCommHook(std::move(first_hook));
  second_.RegisterCommHook(std::move(second_hook));
  std::tie(x_, y_) = Batch(FashionMnist(), first_group->rank() * 8, 8);
}

void TwoWrappers::BackwardFirst() { nn::Backward(nn::loss::CrossEntropy(first_(x_), y_)); }

void TwoWrappers::BackwardSecond() { nn::Backward(nn::loss::CrossEntropy(second_(x_), y_)); }

Branchy::Branchy(uint64_t seed, bool use_a) : use_a_(use_a) {
  nn::Generator gen(seed);
  trunk_ = RegisterModule("trunk", std::make_shared<nn::modules::Linear>(784, 32, true, gen));
  a_ = RegisterModule("a", std::make_shared<nn::modules::Linear>(32, 10, true, gen));
  b_ = RegisterModule("b", std::make_shared<nn::modules::Linear>(32, 10, true, gen));
  never_ = RegisterModule("never", std::make_shared<nn::modules::Linear>(32, 10, true, gen));
}

nn::Tensor Branchy::Forward(const nn::Tensor& x) {
  nn::Tensor h = nn::ops::Relu((*trunk_)(nn::ops::Flatten(x, 1)));
  return use_a_ ? (*a_)(h) : (*b_)(h);
}

std::vector<nn::optim::ParamGroup> DecayGroups(const nn::optim::NamedParameters& params, double bias_lr) {
  std::vector<nn::optim::ParamGroup> groups(2);
  groups[0].options = {{"weight_decay", 0.05}};
  groups[1].options = {{"weight_decay", 0.0}, {"lr", bias_lr}};
  for (const auto& entry : params) groups[entry.second.dim() > 1 ? 0 : 1].params.push_back(entry);
  return groups;
}

std::unique_ptr<nn::optim::Optimizer> MakeGroupedOptimizer(std::vector<nn::optim::ParamGroup> groups) {
  return std::make_unique<nn::optim::AdamW>(std::move(groups), nn::optim::AdamWOptions{.lr = 1e-3});
}

AddressSpaceLimit::AddressSpaceLimit(size_t headroom) {
  long vm_kb = 0;
  if (FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[256];
    while (std::fgets(line, sizeof line, f) != nullptr) {
      if (std::sscanf(line, "VmSize: %ld kB", &vm_kb) == 1) break;
    }
    std::fclose(f);
  }
  if (vm_kb <= 0) return;
  rlimit limit{};
  getrlimit(RLIMIT_AS, &limit);
  old_cur_ = limit.rlim_cur;
  limit.rlim_cur = static_cast<rlim_t>(vm_kb) * 1024 + headroom;
  ok_ = setrlimit(RLIMIT_AS, &limit) == 0;
}

AddressSpaceLimit::~AddressSpaceLimit() {
  if (!ok_) return;
  rlimit limit{};
  getrlimit(RLIMIT_AS, &limit);
  limit.rlim_cur = static_cast<rlim_t>(old_cur_);
  setrlimit(RLIMIT_AS, &limit);
}

}  // namespace ddp::dist::testing
