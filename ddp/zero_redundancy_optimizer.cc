#include "ddp/zero_redundancy_optimizer.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>

#include "ddp/replicas.h"

namespace ddp::dist {
namespace {

using nn::Tensor;
using nn::optim::NamedTensors;

// The parameter a "state.<name>.<slot>" key belongs to: the longest
// parameter name that prefixes it (names may hold dots); -1 for none.
int ParameterOfKey(const std::string& key, const nn::optim::NamedParameters& params) {
  int best = -1;
  size_t best_length = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string prefix = "state." + params[i].first + ".";
    if (key.size() > prefix.size() && key.compare(0, prefix.size(), prefix) == 0 &&
        prefix.size() > best_length) {
      best = static_cast<int>(i);
      best_length = prefix.size();
    }
  }
  return best;
}

// A list of (name, dtype, shape) as text, one tensor per line, and back:
// what a rank sends before the tensors of its shard's state.
std::string DescribeTensors(const NamedTensors& tensors) {
  std::ostringstream out;
  for (const auto& [name, t] : tensors) {
    out << name << '\t' << static_cast<int>(t.dtype());
    for (int64_t d : t.shape()) out << ' ' << d;
    out << '\n';
  }
  return out.str();
}

NamedTensors EmptyTensorsFromDescription(const std::string& text) {
  NamedTensors out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const size_t tab = line.find('\t');
    std::istringstream fields(line.substr(tab + 1));
    int dtype = 0;
    fields >> dtype;
    nn::Shape shape;
    for (int64_t d; fields >> d;) shape.push_back(d);
    out.emplace_back(line.substr(0, tab), nn::Empty(shape, {.dtype = static_cast<nn::DType>(dtype)}));
  }
  return out;
}

// Broadcasts a string from `root` (its length, then its bytes).
std::string BroadcastString(ProcessGroup& pg, const std::string& text, int root, const char* label) {
  Tensor length = nn::FromVectorOf<int64_t>({static_cast<int64_t>(text.size())}, {1});
  pg.Broadcast(length, root, label).Wait();
  const int64_t n = length.data<int64_t>()[0];
  if (n == 0) return "";
  Tensor bytes = nn::Empty({n}, {.dtype = nn::DType::kUInt8});
  if (pg.rank() == root) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  pg.Broadcast(bytes, root, label).Wait();
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(n));
}

}  // namespace

std::vector<int> ZeroRedundancyOptimizer::Partition(const nn::optim::NamedParameters& params,
                                                    int world_size) {
  if (world_size < 1) throw std::invalid_argument("ZeroRedundancyOptimizer: world size must be positive");
  std::vector<size_t> order(params.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return params[a].second.numel() > params[b].second.numel();
  });
  std::vector<int64_t> load(static_cast<size_t>(world_size), 0);
  std::vector<int> owner(params.size(), 0);
  for (size_t i : order) {
    const int rank = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[i] = rank;
    load[static_cast<size_t>(rank)] += params[i].second.numel();
  }
  return owner;
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(nn::optim::NamedParameters params,
                                                 std::shared_ptr<ProcessGroup> pg,
                                                 const Factory& make)
    : params_(std::move(params)), pg_(std::move(pg)) {
  if (pg_ == nullptr) throw std::invalid_argument("ZeroRedundancyOptimizer: the process group is null");
  if (!make) throw std::invalid_argument("ZeroRedundancyOptimizer: the optimizer factory is empty");
  nn::optim::CheckParameters(params_, "ZeroRedundancyOptimizer");
  owner_ = Partition(params_, pg_->size());
  nn::optim::NamedParameters shard;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (owner_[i] == pg_->rank()) shard.push_back(params_[i]);
  }
  local_ = make(std::move(shard));
  if (local_ == nullptr) throw std::invalid_argument("ZeroRedundancyOptimizer: the factory returned null");
}

void ZeroRedundancyOptimizer::Step() {
  local_->Step();
  // Each owner's parameters in one broadcast per dtype and device.
  for (int r = 0; r < pg_->size(); ++r) {
    std::vector<Tensor> owned;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (owner_[i] == r) owned.push_back(params_[i].second.Detach());
    }
    internal::BroadcastCoalesced(*pg_, owned, r, "zero: parameters of rank " + std::to_string(r));
  }
}

void ZeroRedundancyOptimizer::ZeroGrad(bool set_to_none) {
  nn::optim::ZeroGrad(params_, set_to_none);
}

NamedTensors ZeroRedundancyOptimizer::ConsolidatedStateDict(int to) {
  if (to < 0 || to >= pg_->size()) {
    throw std::invalid_argument("ZeroRedundancyOptimizer::ConsolidatedStateDict: rank " + std::to_string(to) +
                                " is not in a group of " + std::to_string(pg_->size()));
  }
  NamedTensors mine;
  for (auto& [name, t] : local_->StateDict()) {
    if (name != "lr") mine.emplace_back(name, t.To(nn::kCPU).Contiguous());
  }
  // Each rank in turn describes its shard's state and sends it.
  std::vector<NamedTensors> by_rank(static_cast<size_t>(pg_->size()));
  for (int r = 0; r < pg_->size(); ++r) {
    const std::string text =
        BroadcastString(*pg_, r == pg_->rank() ? DescribeTensors(mine) : std::string(), r, "zero: state list");
    NamedTensors tensors = r == pg_->rank() ? mine : EmptyTensorsFromDescription(text);
    std::vector<Work> works;
    for (const auto& [name, t] : tensors) works.push_back(pg_->Broadcast(t, r, "zero: " + name));
    for (Work& w : works) w.Wait();
    by_rank[static_cast<size_t>(r)] = std::move(tensors);
  }
  if (pg_->rank() != to) return {};
  // The unsharded optimizer's order: "lr", then parameter by parameter.
  NamedTensors out;
  out.emplace_back("lr", nn::FromVector({local_->lr()}, {}, {.dtype = nn::DType::kFloat64}));
  for (size_t i = 0; i < params_.size(); ++i) {
    for (const auto& [name, t] : by_rank[static_cast<size_t>(owner_[i])]) {
      if (ParameterOfKey(name, params_) == static_cast<int>(i)) out.emplace_back(name, t);
    }
  }
  return out;
}

NamedTensors ZeroRedundancyOptimizer::ShardOf(const NamedTensors& state) const {
  NamedTensors shard;
  for (const auto& [key, t] : state) {
    if (key == "lr") {
      shard.emplace_back(key, t);
      continue;
    }
    if (key.rfind("state.", 0) != 0) continue;  // other components' entries
    const int i = ParameterOfKey(key, params_);
    if (i < 0) throw std::invalid_argument("state key `" + key + "` names no parameter of this optimizer");
    if (owner_[static_cast<size_t>(i)] == pg_->rank()) shard.emplace_back(key, t);
  }
  return shard;
}

void ZeroRedundancyOptimizer::LoadStateDict(const NamedTensors& state) {
  std::string error;
  try {
    local_->LoadStateDict(ShardOf(state));
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Which ranks failed, so that every rank throws.
  Tensor failed = nn::FromVectorOf<int32_t>(std::vector<int32_t>(static_cast<size_t>(pg_->size()), 0),
                                            {pg_->size()});
  failed.data<int32_t>()[pg_->rank()] = error.empty() ? 0 : 1;
  pg_->AllReduce(failed, transport::ReduceOp::kSum, "zero: load state").Wait();
  if (!error.empty()) throw std::invalid_argument("ZeroRedundancyOptimizer::LoadStateDict: " + error);
  std::string ranks;
  for (int r = 0; r < pg_->size(); ++r) {
    if (failed.data<int32_t>()[r] != 0) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  }
  if (!ranks.empty()) {
    throw std::invalid_argument("ZeroRedundancyOptimizer::LoadStateDict failed on rank " + ranks);
  }
}

}  // namespace ddp::dist
