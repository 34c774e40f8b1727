#include "ddp/overlapped_zero_optimizer.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>

#include "ddp/comm_hooks.h"
#include "ddp/process_group.h"

namespace ddp::dist {

using nn::Tensor;

// Shared by the object and its hook (which the wrapper keeps): the hook's
// tasks run on the communication thread, the rest on the training thread.
// `mu` guards what both touch: the slices (made by the first step of each
// bucket), the rate and the counters.
struct OverlappedZeroOptimizer::State {
  // One piece of a parameter inside this rank's slice of a bucket.
  struct Piece {
    size_t param = 0;    // index into the bucket's parameters
    int64_t begin = 0;   // element range in the bucket
    int64_t length = 0;
  };
  // This rank's slice of one bucket and the optimizer of its pieces.
  struct Slice {
    std::vector<const nn::TensorImpl*> params;  // the bucket's, to notice a change
    std::vector<int64_t> offsets;
    size_t begin = 0, end = 0;
    std::vector<Piece> pieces;
    nn::optim::NamedParameters views;  // the pieces, 1-D views of the parameters
    std::unique_ptr<nn::optim::Optimizer> optimizer;
  };

  Factory make;
  // One rank: DDP has no reducer and runs no hook; Step() runs this, the
  // optimizer of every parameter.
  std::unique_ptr<nn::optim::Optimizer> whole;
  std::unordered_map<const nn::TensorImpl*, std::string> names;
  std::vector<Tensor> params;  // every trained parameter (ZeroGrad)
  int64_t total_elements = 0;

  mutable std::mutex mu;
  std::map<size_t, Slice> slices;  // by bucket index
  double lr = 0;
  bool lr_set = false;  // set_lr before the first step: applied at creation
  int64_t steps = 0;

  // Runs the optimizer on elements [begin, begin + count) of `bucket`
  // (reduced gradients, times `scale`), then writes the updated parameters
  // over them, which the all-gather then sends.
  void StepSlice(size_t index, const Tensor& bucket, const std::vector<Tensor>& bucket_params,
                 const std::vector<int64_t>& offsets, size_t begin, size_t count, double scale) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = slices.find(index);
    if (it == slices.end()) {
      it = slices.emplace(index, MakeSlice(bucket_params, offsets, begin, begin + count)).first;
    }
    Slice& slice = it->second;
    bool same = slice.begin == begin && slice.end == begin + count &&
                slice.offsets == offsets && slice.params.size() == bucket_params.size();
    for (size_t k = 0; same && k < bucket_params.size(); ++k) {
      same = slice.params[k] == bucket_params[k].impl();
    }
    if (!same) {
      throw std::logic_error("bucket " + std::to_string(index) +
                             " is not the set of parameters, or not the slice, its first step had");
    }
    if (slice.optimizer == nullptr) return;  // an empty slice
    for (size_t j = 0; j < slice.pieces.size(); ++j) {
      slice.views[j].second.set_grad(bucket.Narrow(0, slice.pieces[j].begin, slice.pieces[j].length));
    }
    slice.optimizer->set_grad_scale(scale);
    slice.optimizer->Step();
    const size_t elem = nn::ElementSize(bucket.dtype());
    char* out = static_cast<char*>(bucket.data_ptr());
    for (size_t j = 0; j < slice.pieces.size(); ++j) {
      const Tensor& view = slice.views[j].second;
      view.set_grad(Tensor());
      std::memcpy(out + slice.pieces[j].begin * elem, view.data_ptr(),
                  static_cast<size_t>(slice.pieces[j].length) * elem);
    }
  }

  Slice MakeSlice(const std::vector<Tensor>& bucket_params, const std::vector<int64_t>& offsets,
                  size_t begin, size_t end) {
    Slice slice;
    slice.offsets = offsets;
    slice.begin = begin;
    slice.end = end;
    for (size_t k = 0; k < bucket_params.size(); ++k) {
      const Tensor& p = bucket_params[k];
      slice.params.push_back(p.impl());
      const int64_t lo = std::max<int64_t>(offsets[k], static_cast<int64_t>(begin));
      const int64_t hi = std::min<int64_t>(offsets[k] + p.numel(), static_cast<int64_t>(end));
      if (lo >= hi) continue;
      slice.pieces.push_back({k, lo, hi - lo});
      auto name = names.find(p.impl());
      const std::string label = name != names.end() ? name->second : "parameter " + std::to_string(k);
      slice.views.emplace_back(label, p.Detach().View({p.numel()}).Narrow(0, lo - offsets[k], hi - lo));
    }
    if (!slice.views.empty()) {
      slice.optimizer = make(slice.views);
      if (slice.optimizer == nullptr) throw std::invalid_argument("the factory returned null");
      if (lr_set) slice.optimizer->set_lr(lr);
    }
    return slice;
  }
};

namespace {

// Copies every element of `bucket` outside [begin, end) (the other ranks'
// updated parameters) into its parameter.
void CopyOtherSlices(const Tensor& bucket, const std::vector<Tensor>& params,
                     const std::vector<int64_t>& offsets, int64_t begin, int64_t end) {
  const size_t elem = nn::ElementSize(bucket.dtype());
  const char* in = static_cast<const char*>(bucket.data_ptr());
  for (size_t k = 0; k < params.size(); ++k) {
    const int64_t first = offsets[k], last = offsets[k] + params[k].numel();
    char* out = static_cast<char*>(params[k].data_ptr());
    // [first, last) minus [begin, end): up to two runs.
    const std::pair<int64_t, int64_t> runs[] = {{first, std::min(last, begin)},
                                                {std::max(first, end), last}};
    bool copied = false;
    for (const auto& [lo, hi] : runs) {
      if (lo >= hi) continue;
      std::memcpy(out + (lo - first) * elem, in + lo * elem, static_cast<size_t>(hi - lo) * elem);
      copied = true;
    }
    if (copied) params[k].storage()->BumpVersion();
  }
}

}  // namespace

OverlappedZeroOptimizer::OverlappedZeroOptimizer(DistributedDataParallel& ddp, Factory make)
    : state_(std::make_shared<State>()) {
  if (!make) throw std::invalid_argument("OverlappedZeroOptimizer: null factory");
  if (ddp.options().find_unused_parameters) {
    throw std::invalid_argument(
        "OverlappedZeroOptimizer: DdpOptions::find_unused_parameters is set; a parameter unused on "
        "every rank would still take a step (with a zero gradient) inside the reduction, where the "
        "unsharded optimizer skips it");
  }
  state_->make = std::move(make);
  for (const auto& [name, p] : ddp.module()->NamedParameters()) {
    if (!p.requires_grad()) continue;
    if (!p.device().is_cpu() || !p.is_contiguous()) {
      throw std::invalid_argument("OverlappedZeroOptimizer: parameter `" + name + "` is " +
                                  (p.device().is_cpu() ? "not contiguous" : "on " + p.device().ToString()) +
                                  "; the fused step runs on contiguous CPU parameters");
    }
    state_->names.emplace(p.impl(), name);
    state_->params.push_back(p);
    state_->total_elements += p.numel();
  }
  if (ddp.process_group().size() == 1) {
    nn::optim::NamedParameters all;
    for (const Tensor& p : state_->params) all.emplace_back(state_->names.at(p.impl()), p);
    state_->whole = state_->make(std::move(all));
    if (state_->whole == nullptr) throw std::invalid_argument("OverlappedZeroOptimizer: the factory returned null");
    return;
  }
  std::shared_ptr<State> state = state_;
  const std::chrono::milliseconds timeout = ddp.process_group().options().timeout;
  CommHook hook = CommHook::OnLocalGradients([state, timeout](ProcessGroup& pg, GradBucket& bucket) {
    const Tensor buffer = bucket.buffer();
    // A sum, averaged by the factor the optimizer reads gradients with
    // (the world size, or under Join the ranks still active): no pass of
    // its own.
    const transport::ReduceOp op = transport::ReduceOp::kSum;
    const double scale = 1.0 / bucket.divisor();
    CollectiveDescription d{"zero_step bucket " + std::to_string(bucket.index()), buffer.dtype(),
                            buffer.shape(), -1, op, true};
    return pg.Run(d, [state, buffer, params = bucket.parameters(), offsets = bucket.offsets(),
                      index = bucket.index(), last = bucket.is_last(), op, scale,
                      timeout](transport::Communicator* comm, transport::Deadline) {
      const size_t n = static_cast<size_t>(buffer.numel());
      std::string error;
      size_t begin = 0, end = n;
      const transport::Communicator::SliceFn apply = [&](void*, size_t offset, size_t count) {
        begin = offset;
        end = offset + count;
        try {
          state->StepSlice(index, buffer, params, offsets, offset, count, scale);
        } catch (const std::exception& e) {
          return transport::InternalError(std::string("OverlappedZeroOptimizer: ") + e.what());
        }
        return transport::Status::Ok();
      };
      transport::Status status =
          comm != nullptr ? comm->AllReduceThrough(buffer.data_ptr(), buffer.data_ptr(), n,
                                                   ToTransportType(buffer.dtype()), op, apply,
                                                   {.timeout = timeout})
                          : apply(buffer.data_ptr(), 0, n);
      if (!status.ok()) return status;
      CopyOtherSlices(buffer, params, offsets, static_cast<int64_t>(begin), static_cast<int64_t>(end));
      if (last) {
        std::lock_guard<std::mutex> lock(state->mu);
        ++state->steps;
      }
      return transport::Status::Ok();
    });
  });
  ddp.RegisterCommHook(hook.WithFixedBuckets());
}

OverlappedZeroOptimizer::~OverlappedZeroOptimizer() = default;

void OverlappedZeroOptimizer::Step() {
  if (state_->whole != nullptr) {
    state_->whole->Step();
    std::lock_guard<std::mutex> lock(state_->mu);
    ++state_->steps;
  }
  ZeroGrad();
}

void OverlappedZeroOptimizer::ZeroGrad() {
  for (const Tensor& p : state_->params) p.set_grad(Tensor());
}

double OverlappedZeroOptimizer::lr() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (state_->whole != nullptr) return state_->whole->lr();
  if (state_->lr_set) return state_->lr;
  for (const auto& [index, slice] : state_->slices) {
    if (slice.optimizer != nullptr) return slice.optimizer->lr();
  }
  return state_->lr;
}

void OverlappedZeroOptimizer::set_lr(double lr) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->lr = lr;
  state_->lr_set = true;
  if (state_->whole != nullptr) state_->whole->set_lr(lr);
  for (auto& [index, slice] : state_->slices) {
    if (slice.optimizer != nullptr) slice.optimizer->set_lr(lr);
  }
}

int64_t OverlappedZeroOptimizer::steps() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->steps;
}

int64_t OverlappedZeroOptimizer::owned_elements() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (state_->whole != nullptr) return state_->total_elements;
  int64_t owned = 0;
  for (const auto& [index, slice] : state_->slices) owned += static_cast<int64_t>(slice.end - slice.begin);
  return owned;
}

}  // namespace ddp::dist
