#include "ddp/sync_batch_norm.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <new>
#include <stdexcept>
#include <unordered_set>
#include <vector>

#include "nn/autograd/function.h"
#include "nn/ops/functional.h"

namespace ddp::dist {
namespace {

using nn::Tensor;

// x [N, C, S] with S the product of the trailing dimensions.
struct Dims {
  int64_t n, c, s;
};

Dims GetDims(const Tensor& x) {
  int64_t s = 1;
  for (int64_t d = 2; d < x.dim(); ++d) s *= x.size(d);
  return {x.size(0), x.size(1), s};
}

// Training needs at least two values per channel in the global batch, or
// none at all: an empty global batch is BatchNorm's empty batch (an empty
// output, the running statistics unchanged, the batch counted). The
// caller's catch prefixes the layer (Fail).
void CheckGlobalCount(double total, const Tensor& x, const ProcessGroup& pg) {
  if (total != 1) return;
  throw std::invalid_argument(
      "expected more than 1 value per channel across all ranks when training, "
      "got " + std::to_string(static_cast<int64_t>(total)) + " (input " +
      nn::ShapeToString(x.shape()) + " on rank " + std::to_string(pg.rank()) + ")");
}

// What a training forward updates once its statistics are in: the count
// (through the layer's host copy of it) and the running statistics, each
// undefined when the layer does not track it.
struct RunningStats {
  Tensor num_batches_tracked, running_mean, running_var;
  nn::modules::TrackedBatchCount* count;  // the layer's; non-null with num_batches_tracked
  int64_t next_count;                     // num_batches_tracked once this batch counts
  double momentum;                        // the factor for this batch
};

// Counts the batch in num_batches_tracked, then running = (1 - momentum) *
// running + momentum * batch statistic, the variance unbiased over `total`
// values, in BatchNorm's order of operations, in f64 and stored in the
// buffers' dtype; nothing for the buffers the module does not track.
// mean_t: the global mean, f64 [C] on any device; var: the biased global
// variance, on the host. The update runs on the buffers' device (on a GPU,
// queued kernels and one host-to-device copy; nothing reads the device
// back). Called once the statistics are in and checked, so that a forward
// that fails changes no buffer. An empty global batch (total 0) only counts.
void UpdateRunningStats(const RunningStats& rs, const Tensor& mean_t, const std::vector<double>& var, double total) {
  nn::NoGradGuard guard;
  Tensor new_mean, new_var;
  if (rs.running_mean.defined() && rs.running_var.defined() && total > 0) {
    const double m = rs.momentum;
    const double unbias = total / (total - 1);
    std::vector<double> var_term(var.size());
    for (size_t c = 0; c < var.size(); ++c) var_term[c] = m * var[c] * unbias;
    const Tensor mean_term = nn::ops::MulScalar(mean_t.To(rs.running_mean.device()), m);
    const Tensor var_term_t = nn::FromVector(var_term, {static_cast<int64_t>(var.size())},
                                             {.dtype = nn::DType::kFloat64, .device = rs.running_var.device()});
    // A product and a sum, not one fused multiply-add: the roundings of
    // BatchNorm's update, and of this layer's former host loop.
    // In the buffers' dtypes here, so that the writes below only copy.
    new_mean = nn::ops::Add(nn::ops::MulScalar(rs.running_mean.To(nn::DType::kFloat64), 1 - m), mean_term)
                   .To(rs.running_mean.dtype());
    new_var = nn::ops::Add(nn::ops::MulScalar(rs.running_var.To(nn::DType::kFloat64), 1 - m), var_term_t)
                  .To(rs.running_var.dtype());
  }
  // Written last: an op that throws above leaves every buffer as it was.
  if (rs.num_batches_tracked.defined()) rs.count->Set(rs.num_batches_tracked, rs.next_count);
  if (new_mean.defined()) {
    rs.running_mean.CopyFrom(new_mean);
    rs.running_var.CopyFrom(new_var);
  }
}

// Backward of both SyncBatchNorm functions, from nn's building blocks on x's
// device. Saved: x, weight, the global mean and invstd (f64 [C] on x's
// device); saved_data: the global count ("total"), the group ("pg", a
// shared_ptr: the group lives until backward even if the module lets go)
// and the layer's Describe() ("layer"), which labels the all-reduce.
std::vector<Tensor> SyncBatchNormBackward(nn::autograd::AutogradContext* ctx, const std::vector<Tensor>& grad) {
  const std::vector<Tensor> saved = ctx->GetSavedTensors();
  const Tensor& x = saved[0];
  const Tensor& weight = saved[1];
  const Tensor& mean_t = saved[2];
  const Tensor& invstd_t = saved[3];
  const Tensor dy = grad[0].Contiguous();
  const double total = std::any_cast<double>(ctx->saved_data["total"]);
  const auto pg = std::any_cast<std::shared_ptr<ProcessGroup>>(ctx->saved_data["pg"]);
  const auto layer = std::any_cast<std::string>(ctx->saved_data["layer"]);
  const Dims d = GetDims(x);
  const nn::Device device = x.device();
  nn::NoGradGuard guard;
  // [sum(dy) per channel, sum(dy * xhat) per channel], f64 on the device.
  Tensor sums;
  try {
    sums = nn::Empty({2 * d.c}, {.dtype = nn::DType::kFloat64, .device = device});
    if (d.n * d.s > 0) {
      const nn::ops::BatchNormSums local = nn::ops::BatchNormBackwardReduce(dy, x, mean_t, invstd_t);
      sums.Narrow(0, 0, d.c).CopyFrom(local.sum);
      sums.Narrow(0, d.c, d.c).CopyFrom(local.sum_sq);
    } else {
      sums.Zero();
    }
  } catch (const std::exception& e) {
    // This rank will not join the all-reduce below, which its peers are
    // in or about to be: stop them now (as a refused forward does) rather
    // than at the group's timeout.
    if (ctx->NeedsInputGrad(0) && pg->size() > 1) {
      pg->Abort(transport::InternalError(layer + " backward on rank " + std::to_string(pg->rank()) +
                                         " failed before its all-reduce: " + e.what()));
    }
    throw;
  }
  Tensor dweight, dbias;
  const nn::DType param_dtype = weight.defined() ? weight.dtype() : x.dtype();
  if (ctx->NeedsInputGrad(1)) dweight = sums.Narrow(0, d.c, d.c).To(param_dtype);
  if (ctx->NeedsInputGrad(2)) dbias = sums.Narrow(0, 0, d.c).To(param_dtype);
  Tensor dx;
  if (ctx->NeedsInputGrad(0)) {
    // The global sums: every rank's x shaped the statistics.
    Tensor global = sums.Clone();
    // Labelled with the layer: DDP_DEBUG=detail then tells apart two
    // layers of one width, and a timeout names the layer.
    pg->AllReduce(global, transport::ReduceOp::kSum, "sync_batch_norm grad of " + layer).Wait();
    // total 0 (an empty global batch): no dx to compute, nothing to divide.
    const Tensor means = nn::ops::MulScalar(global, total > 0 ? 1.0 / total : 0.0);
    dx = x.numel() == 0
             ? nn::Empty(x.shape(), {.dtype = x.dtype(), .device = device})
             : nn::ops::BatchNormBackwardElementwise(dy, x, mean_t, invstd_t, weight,
                                                     means.Narrow(0, 0, d.c), means.Narrow(0, d.c, d.c));
  }
  return {dx, dweight, dbias};
}

// The global count, mean and sum of squared deviations per channel, from
// every rank's row [count, mean per channel, sum of squared deviations per
// channel] (`mine`, f64 in host memory): one all-gather, then Chan et al.'s
// pairwise formula, so that large means do not cancel and counts weight
// each rank (an empty rank adds nothing).
struct GlobalStats {
  std::vector<double> mean, m2;
  double total = 0;
};

std::atomic<bool> fail_next_forward{false};

// FailNextSyncBatchNormForwardForTesting's failure, where a forward's local
// statistics are computed: before this rank joins the gather.
void ThrowIfForwardFailureInjected() {
  if (fail_next_forward.exchange(false)) throw std::bad_alloc();
}

GlobalStats GatherStats(ProcessGroup& pg, const Tensor& mine, int64_t channels, const std::string& layer) {
  const int64_t row = 1 + 2 * channels;
  Tensor all = nn::Empty({row * pg.size()}, {.dtype = nn::DType::kFloat64});
  pg.AllGather(all, mine, "sync_batch_norm stats of " + layer).Wait();
  const double* a = all.data<double>();
  GlobalStats g{std::vector<double>(channels, 0.0), std::vector<double>(channels, 0.0), 0.0};
  for (int r = 0; r < pg.size(); ++r) {
    const double* s = a + r * row;
    const double nr = s[0];
    if (nr == 0) continue;
    const double next = g.total + nr;
    for (int64_t c = 0; c < channels; ++c) {
      const double delta = s[1 + c] - g.mean[c];
      g.mean[c] += delta * nr / next;
      g.m2[c] += s[1 + channels + c] + delta * delta * g.total * nr / next;
    }
    g.total = next;
  }
  return g;
}

// The global-statistics batch norm on the CPU, as an autograd function.
// Inputs: x [N, C, *], weight [C] and bias [C] (both may be undefined). The
// statistics travel as each rank's count, mean and sum of squared
// deviations (two passes in f64), merged with Chan et al.'s formula so that
// large means do not cancel; the elementwise pass and the backward are nn's
// building blocks, as on a device.
struct SyncBatchNormFunction : nn::autograd::Function<SyncBatchNormFunction> {
  static constexpr const char* kName = "SyncBatchNormBackward";

  static std::vector<Tensor> Forward(nn::autograd::AutogradContext* ctx, const std::vector<Tensor>& in,
                                     const std::shared_ptr<ProcessGroup>& pg, const RunningStats& running,
                                     double eps, const std::string& layer) {
    ThrowIfForwardFailureInjected();
    const Tensor x = in[0].Contiguous();
    const Tensor& weight = in[1];
    const Tensor& bias = in[2];
    const Dims d = GetDims(x);
    const int64_t m = d.n * d.s;  // this rank's values per channel

    // Local count, mean and sum of squared deviations, two passes in f64.
    const int64_t row = 1 + 2 * d.c;
    Tensor mine = nn::Zeros({row}, {.dtype = nn::DType::kFloat64});
    double* st = mine.data<double>();
    st[0] = static_cast<double>(m);
    DDP_DISPATCH_FLOATING(x.dtype(), "SyncBatchNorm", {
      using A = nn::acc_t<scalar_t>;
      const scalar_t* xp = x.data<scalar_t>();
      for (int64_t c = 0; c < d.c; ++c) {
        double sum = 0;
        for (int64_t n = 0; n < d.n; ++n) {
          const scalar_t* r = xp + (n * d.c + c) * d.s;
          for (int64_t i = 0; i < d.s; ++i) sum += static_cast<A>(r[i]);
        }
        const double mean = m > 0 ? sum / m : 0.0;
        double q = 0;
        for (int64_t n = 0; n < d.n; ++n) {
          const scalar_t* r = xp + (n * d.c + c) * d.s;
          for (int64_t i = 0; i < d.s; ++i) {
            const double dv = static_cast<A>(r[i]) - mean;
            q += dv * dv;
          }
        }
        st[1 + c] = mean;
        st[1 + d.c + c] = q;
      }
    });

    const GlobalStats g = GatherStats(*pg, mine, d.c, layer);
    const std::vector<double>& mean = g.mean;
    const std::vector<double>& m2 = g.m2;
    const double total = g.total;
    CheckGlobalCount(total, x, *pg);
    std::vector<double> var(d.c), invstd(d.c);
    for (int64_t c = 0; c < d.c; ++c) {
      var[c] = total > 0 ? m2[c] / total : 0.0;
      invstd[c] = 1.0 / std::sqrt(var[c] + eps);
    }
    const Tensor mean_t = nn::FromVector(mean, {d.c}, {.dtype = nn::DType::kFloat64});
    const Tensor invstd_t = nn::FromVector(invstd, {d.c}, {.dtype = nn::DType::kFloat64});
    Tensor y = x.numel() == 0 ? nn::Empty(x.shape(), {.dtype = x.dtype()})
                              : nn::ops::BatchNormElementwise(x, mean_t, invstd_t, weight, bias);
    ctx->SaveForBackward({x, weight, mean_t, invstd_t});
    ctx->saved_data["total"] = total;
    ctx->saved_data["pg"] = pg;
    ctx->saved_data["layer"] = layer;
    // Last: a forward that fails before here (no memory for the output,
    // say) leaves the running statistics and the count as they were.
    UpdateRunningStats(running, mean_t, var, total);
    return {y};
  }

  static std::vector<Tensor> Backward(nn::autograd::AutogradContext* ctx, const std::vector<Tensor>& grad) {
    return SyncBatchNormBackward(ctx, grad);
  }
};

// The same layer from nn's batch-norm building blocks: every step runs on
// x's device, and the collectives take device tensors. Inputs: x [N, C, *],
// weight [C], bias [C] (both may be undefined).
struct SyncBatchNormBlocksFunction : nn::autograd::Function<SyncBatchNormBlocksFunction> {
  static constexpr const char* kName = "SyncBatchNormBackward";

  static std::vector<Tensor> Forward(nn::autograd::AutogradContext* ctx, const std::vector<Tensor>& in,
                                     const std::shared_ptr<ProcessGroup>& pg, const RunningStats& running,
                                     double eps, const std::string& layer) {
    ThrowIfForwardFailureInjected();
    const Tensor x = in[0].Contiguous();
    const Tensor& weight = in[1];
    const Tensor& bias = in[2];
    const Dims d = GetDims(x);
    const nn::Device device = x.device();
    // This rank's [count, mean per channel, sum of squared deviations per
    // channel], computed on x's device in two passes: the sums give a mean,
    // and the sums of x less that mean give the deviations (sums of x and
    // x^2 alone lose the variance of a channel whose mean is large against
    // its spread: E[x^2] - E[x]^2 cancels). One small copy to the host,
    // then the rows are gathered and merged there, as on the CPU path.
    const int64_t m = d.n * d.s;
    Tensor mine = nn::Zeros({1 + 2 * d.c}, {.dtype = nn::DType::kFloat64});
    mine.data<double>()[0] = static_cast<double>(m);
    if (m > 0) {
      nn::NoGradGuard guard;
      const Tensor shift = nn::ops::MulScalar(nn::ops::BatchNormStats(x).sum, 1.0 / static_cast<double>(m));
      const Tensor ones = nn::Ones({d.c}, {.dtype = nn::DType::kFloat64, .device = device});
      // x - shift in f32 for 16-bit inputs: in the input's dtype each
      // deviation would be rounded to 8 or 11 bits before it is summed.
      const bool narrow = x.dtype() == nn::DType::kBFloat16 || x.dtype() == nn::DType::kFloat16;
      const Tensor wide = narrow ? x.To(nn::DType::kFloat32) : x;
      const Tensor centered = nn::ops::BatchNormElementwise(wide, shift, ones, Tensor(), Tensor());
      const nn::ops::BatchNormSums c = nn::ops::BatchNormStats(centered);
      // mean = shift + sum(x - shift) / m; M2 = sum((x - shift)^2) - sum(x - shift)^2 / m.
      Tensor row = nn::Empty({2 * d.c}, {.dtype = nn::DType::kFloat64, .device = device});
      row.Narrow(0, 0, d.c).CopyFrom(nn::ops::Add(shift, nn::ops::MulScalar(c.sum, 1.0 / static_cast<double>(m))));
      row.Narrow(0, d.c, d.c)
          .CopyFrom(nn::ops::Sub(c.sum_sq, nn::ops::MulScalar(nn::ops::Square(c.sum), 1.0 / static_cast<double>(m))));
      mine.Narrow(0, 1, 2 * d.c).CopyFrom(row.To(nn::kCPU));
    }
    const GlobalStats g = GatherStats(*pg, mine, d.c, layer);
    const double total = g.total;
    CheckGlobalCount(total, x, *pg);
    const std::vector<double>& mean = g.mean;
    std::vector<double> var(d.c), invstd(d.c);
    for (int64_t c = 0; c < d.c; ++c) {
      var[c] = total > 0 ? std::max(0.0, g.m2[c] / total) : 0.0;
      invstd[c] = 1.0 / std::sqrt(var[c] + eps);
    }
    const Tensor mean_t = nn::FromVector(mean, {d.c}, {.dtype = nn::DType::kFloat64}).To(device);
    const Tensor invstd_t = nn::FromVector(invstd, {d.c}, {.dtype = nn::DType::kFloat64}).To(device);
    // An empty local batch still took part in both collectives above.
    Tensor y = x.numel() == 0 ? nn::Empty(x.shape(), {.dtype = x.dtype(), .device = device})
                              : nn::ops::BatchNormElementwise(x, mean_t, invstd_t, weight, bias);
    ctx->SaveForBackward({x, weight, mean_t, invstd_t});
    ctx->saved_data["total"] = total;
    ctx->saved_data["pg"] = pg;
    ctx->saved_data["layer"] = layer;
    // Last, as on the host path.
    UpdateRunningStats(running, mean_t, var, total);
    return {y};
  }

  static std::vector<Tensor> Backward(nn::autograd::AutogradContext* ctx, const std::vector<Tensor>& grad) {
    return SyncBatchNormBackward(ctx, grad);
  }
};

std::atomic<bool> building_blocks_for_cpu{false};

// As Python prints a float (what BatchNorm's repr shows): nn's
// MomentumRepr prints a present value that way.
std::string PyFloat(double v) { return nn::modules::MomentumRepr(v); }

bool internal_use_blocks() { return building_blocks_for_cpu.load(std::memory_order_relaxed); }

}  // namespace

namespace internal {
void SetSyncBatchNormBuildingBlocks(bool on) {
  building_blocks_for_cpu.store(on, std::memory_order_relaxed);
}
void FailNextSyncBatchNormForwardForTesting() { fail_next_forward.store(true); }
}  // namespace internal

SyncBatchNorm::SyncBatchNorm(int64_t num_features, nn::modules::BatchNormOptions options,
                             std::shared_ptr<ProcessGroup> group)
    : num_features_(num_features), options_(options), group_(std::move(group)) {
  if (num_features < 1) {
    throw std::invalid_argument("SyncBatchNorm: num_features must be positive, got " + std::to_string(num_features));
  }
  nn::modules::CheckBatchNormOptions(options, "SyncBatchNorm");
  if (options.affine) {
    weight_ = RegisterParameter("weight", nn::Ones({num_features}));
    bias_ = RegisterParameter("bias", nn::Zeros({num_features}));
  }
  if (options.track_running_stats) {
    running_mean_ = RegisterBuffer("running_mean", nn::Zeros({num_features}));
    running_var_ = RegisterBuffer("running_var", nn::Ones({num_features}));
    num_batches_tracked_ = RegisterBuffer("num_batches_tracked", nn::Zeros({}, {.dtype = nn::DType::kInt64}));
  }
}

SyncBatchNorm::SyncBatchNorm(Adopt, const nn::modules::BatchNorm& bn, std::shared_ptr<ProcessGroup> group)
    : num_features_(bn.num_features()), options_(bn.options()), group_(std::move(group)) {
  if (bn.weight().defined()) weight_ = RegisterParameter("weight", bn.weight(), bn.weight().requires_grad());
  if (bn.bias().defined()) bias_ = RegisterParameter("bias", bn.bias(), bn.bias().requires_grad());
  if (bn.running_mean().defined()) running_mean_ = RegisterBuffer("running_mean", bn.running_mean());
  if (bn.running_var().defined()) running_var_ = RegisterBuffer("running_var", bn.running_var());
  if (bn.num_batches_tracked().defined()) {
    num_batches_tracked_ = RegisterBuffer("num_batches_tracked", bn.num_batches_tracked());
  }
  Train(bn.is_training());
}

std::shared_ptr<SyncBatchNorm> SyncBatchNorm::FromBatchNorm(const nn::modules::BatchNorm& bn,
                                                            std::shared_ptr<ProcessGroup> group) {
  return std::shared_ptr<SyncBatchNorm>(new SyncBatchNorm(Adopt{}, bn, std::move(group)));
}

bool SyncBatchNorm::MayBeAbsentFromState(const std::string& name) const { return name == "num_batches_tracked"; }

std::string SyncBatchNorm::ExtraRepr() const {
  return std::to_string(num_features_) + ", eps=" + PyFloat(options_.eps) +
         ", momentum=" + nn::modules::MomentumRepr(options_.momentum) +
         ", affine=" + (options_.affine ? "True" : "False") +
         ", track_running_stats=" + (options_.track_running_stats ? "True" : "False");
}

std::string SyncBatchNorm::ShortRepr() const {
  return TypeName() + "(" + std::to_string(num_features_) + ")";
}

void SyncBatchNorm::Refuse(const std::string& message) const {
  if (is_training()) {
    std::shared_ptr<ProcessGroup> pg = group_;
    if (pg == nullptr) {
      try {
        pg = DefaultProcessGroup();
      } catch (const std::logic_error&) {
        // No group: nobody waits for this rank.
      }
    }
    if (pg != nullptr && pg->size() > 1) {
      pg->Abort(transport::FailedPreconditionError(Describe() + " on rank " + std::to_string(pg->rank()) +
                                                   ": " + message));
    }
  }
  Fail(message);
}

nn::Tensor SyncBatchNorm::Forward(const nn::Tensor& x) {
  if (!x.defined()) Refuse("input is undefined");
  if (x.dim() < 2 || x.size(1) != num_features_) {
    Refuse("expected input [N, " + std::to_string(num_features_) + ", ...], got " + nn::ShapeToString(x.shape()));
  }
  if (!nn::IsFloating(x.dtype())) {
    Refuse("expected a floating-point input, got dtype " + std::string(nn::DTypeName(x.dtype())));
  }
  const bool batch_stats = is_training() || !options_.track_running_stats;
  if (!is_training()) {
    // Eval: local and silent.
    try {
      // Eval updates nothing: the factor needs no count (BatchNorm's).
      return nn::ops::BatchNorm(x, running_mean_, running_var_, weight_, bias_, batch_stats,
                                nn::modules::RunningAverageFactor(options_, int64_t{0}), options_.eps);
    } catch (const std::invalid_argument& e) {
      Fail(e.what());
    }
  }
  std::shared_ptr<ProcessGroup> pg = group_;
  if (pg == nullptr) {
    try {
      pg = DefaultProcessGroup();
    } catch (const std::logic_error& e) {
      // No group: nobody waits for this rank, so nothing to abort.
      Fail(std::string("training needs a process group: ") + e.what());
    }
  }
  // The running average's factor counts this batch (BatchNorm's), but the
  // count itself moves only once the batch's statistics are in: a forward
  // that fails (a global batch of one value) leaves every buffer as it was.
  // The count comes from the host copy (no device read unless the buffer
  // changed since this layer last read or wrote it).
  RunningStats running{.count = &tracked_, .next_count = 0, .momentum = 0.0};
  if (options_.track_running_stats) {
    running.num_batches_tracked = num_batches_tracked_;
    running.running_mean = running_mean_;
    running.running_var = running_var_;
    try {
      running.next_count = tracked_.Get(num_batches_tracked_, *this) + 1;
    } catch (const std::exception& e) {
      AbortForLocalFailure(*pg, e);
      throw;
    }
    running.momentum = nn::modules::RunningAverageFactor(options_, running.next_count);
  }
  if (pg->size() == 1) {
    nn::Tensor y;
    try {
      y = nn::ops::BatchNorm(x, running_mean_, running_var_, weight_, bias_, true, running.momentum, options_.eps);
    } catch (const std::invalid_argument& e) {
      Fail(e.what());
    }
    if (running.num_batches_tracked.defined()) tracked_.Set(running.num_batches_tracked, running.next_count);
    return y;
  }
  // "SyncBatchNorm(3) `layer1.0.bn1`": labels this layer's collectives.
  const std::string layer = Describe();
  try {
    if (!x.device().is_cpu() || internal_use_blocks()) {
      return SyncBatchNormBlocksFunction::Apply({x, weight_, bias_}, pg, running, options_.eps, layer)[0];
    }
    return SyncBatchNormFunction::Apply({x, weight_, bias_}, pg, running, options_.eps, layer)[0];
  } catch (const std::invalid_argument& e) {
    Fail(e.what());
  } catch (const DistributedError&) {
    throw;  // the group's own failure: every rank has it
  } catch (const std::exception& e) {
    AbortForLocalFailure(*pg, e);
    throw;
  }
}

void SyncBatchNorm::AbortForLocalFailure(ProcessGroup& pg, const std::exception& e) const {
  // This rank's own failure (device memory ran out, say) before or between
  // the statistics' collectives, which its peers are in or about to be:
  // stop them now, with the cause, rather than at the group's timeout.
  if (pg.size() > 1) {
    pg.Abort(transport::InternalError(Describe() + " forward on rank " + std::to_string(pg.rank()) +
                                      " failed: " + e.what()));
  }
}

std::shared_ptr<nn::modules::Module> ConvertSyncBatchNorm(std::shared_ptr<nn::modules::Module> module,
                                                          std::shared_ptr<ProcessGroup> group) {
  if (module == nullptr) throw std::invalid_argument("ConvertSyncBatchNorm: module is null");
  if (auto* bn = dynamic_cast<nn::modules::BatchNorm*>(module.get())) {
    return SyncBatchNorm::FromBatchNorm(*bn, group);
  }
  if (auto* sync = dynamic_cast<SyncBatchNorm*>(module.get())) {
    sync->group_ = std::move(group);
    return module;
  }
  // Every registry slot that holds a BatchNorm: (parent, child name). A
  // module registered under several parents (or a parent reached by two
  // paths) is visited once, so each slot is counted once.
  struct Slot {
    nn::modules::Module* parent;
    std::string name;
    std::string path;  // one dotted path that reaches the slot, for messages
  };
  struct Found {
    const nn::modules::BatchNorm* bn;
    long registry_refs = 0;   // slots holding it
    long use_count = 0;       // the owning pointer's count, read from a slot
    std::vector<Slot> slots;
  };
  std::vector<Found> found;
  // Layers synchronized already: they take `group` too, once nothing is refused.
  std::vector<SyncBatchNorm*> synced;
  std::unordered_set<const nn::modules::Module*> visited;
  for (const auto& [path, m] : module->NamedModules()) {
    if (!visited.insert(m).second) continue;
    if (auto* sync = dynamic_cast<SyncBatchNorm*>(m)) synced.push_back(sync);
    for (const auto& [name, child] : m->ChildSlots()) {
      auto* bn = dynamic_cast<const nn::modules::BatchNorm*>(child.get());
      if (bn == nullptr) continue;
      auto it = std::find_if(found.begin(), found.end(), [&](const Found& f) { return f.bn == bn; });
      if (it == found.end()) it = found.insert(found.end(), Found{bn});
      ++it->registry_refs;
      it->use_count = child.use_count();
      it->slots.push_back({m, name, path.empty() ? name : path + "." + name});
    }
  }
  // A layer owned outside the registry as well (typically a member the
  // parent kept from RegisterModule and calls in its Forward) would go on
  // running the old, local BatchNorm after its slot is replaced: nothing
  // would synchronize, and nothing would say so. nn's rule is that a
  // module's Forward looks its children up by name (nn/README.md, Modules:
  // ReplaceChild), so such an owner is refused before anything changes.
  std::string held;
  for (const Found& f : found) {
    if (f.use_count <= f.registry_refs) continue;
    held += std::string(held.empty() ? "" : ", ") + "`" + f.slots.front().path + "` (" +
            std::to_string(f.use_count - f.registry_refs) + " other owner" +
            (f.use_count - f.registry_refs == 1 ? "" : "s") + ")";
  }
  if (!held.empty()) {
    throw std::invalid_argument(
        "ConvertSyncBatchNorm: BatchNorm " + held +
        " is also held outside the module registry (a member kept from RegisterModule, or a variable), so "
        "replacing it in the registry would leave that owner running the local BatchNorm with nothing "
        "synchronized. The parent's Forward must look the child up by name (Child(\"...\")), as nn's modules "
        "do, and other references must be dropped before converting; nothing was replaced");
  }
  // One SyncBatchNorm per BatchNorm, placed in each of its slots, so a
  // layer shared between paths stays shared.
  for (const Found& f : found) {
    std::shared_ptr<SyncBatchNorm> sync = SyncBatchNorm::FromBatchNorm(*f.bn, group);
    for (const Slot& slot : f.slots) slot.parent->ReplaceChild(slot.name, sync);
  }
  // In place rather than replaced: whoever else holds the layer follows.
  for (SyncBatchNorm* sync : synced) sync->group_ = group;
  return module;
}

}  // namespace ddp::dist
