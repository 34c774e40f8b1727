#include "examples/trainer/optimizer.h"

#include <stdexcept>
#include <utility>

#include "nn/optim/adadelta.h"
#include "nn/optim/adagrad.h"
#include "nn/optim/adam.h"
#include "nn/optim/rmsprop.h"
#include "nn/optim/sgd.h"

namespace ddp::examples::trainer {

bool IsNormOrBias(const nn::Tensor& param) { return param.dim() <= 1; }

std::vector<nn::optim::ParamGroup> ParamGroupsOf(const TrainConfig& config,
                                                 nn::optim::NamedParameters params) {
  if (config.decay_norm_and_bias) return {nn::optim::ParamGroup{std::move(params), {}}};
  nn::optim::ParamGroup decayed;
  nn::optim::ParamGroup spared;
  spared.options["weight_decay"] = 0.0;
  for (auto& named : params) {
    (IsNormOrBias(named.second) ? spared : decayed).params.push_back(std::move(named));
  }
  return {std::move(decayed), std::move(spared)};
}

namespace {

// The optimizer of --optimizer with `defaults`, over a plain list when the
// groups are one without options, over the groups otherwise.
template <typename Opt, typename Options>
std::unique_ptr<nn::optim::Optimizer> Build(std::vector<nn::optim::ParamGroup> groups,
                                            const Options& defaults) {
  if (groups.size() == 1 && groups.front().options.empty()) {
    return std::make_unique<Opt>(std::move(groups.front().params), defaults);
  }
  return std::make_unique<Opt>(std::move(groups), defaults);
}

}  // namespace

std::unique_ptr<nn::optim::Optimizer> MakeOptimizer(const TrainConfig& c,
                                                    std::vector<nn::optim::ParamGroup> groups) {
  if (c.optimizer == "sgd") {
    return Build<nn::optim::Sgd>(
        std::move(groups),
        nn::optim::SgdOptions{.lr = c.lr, .momentum = c.momentum, .weight_decay = c.weight_decay});
  }
  if (c.optimizer == "adam") {
    nn::optim::AdamOptions o;
    o.lr = c.lr;
    o.weight_decay = c.weight_decay;
    return Build<nn::optim::Adam>(std::move(groups), o);
  }
  if (c.optimizer == "adamw") {
    nn::optim::AdamWOptions o;
    o.lr = c.lr;
    o.weight_decay = c.weight_decay;
    return Build<nn::optim::AdamW>(std::move(groups), o);
  }
  if (c.optimizer == "rmsprop") {
    // PyTorch's other defaults (alpha 0.99, eps 1e-8, not centered).
    nn::optim::RmspropOptions o;
    o.lr = c.lr;
    o.momentum = c.momentum;
    o.weight_decay = c.weight_decay;
    return Build<nn::optim::Rmsprop>(std::move(groups), o);
  }
  if (c.optimizer == "adagrad") {
    // PyTorch's other defaults (no lr_decay, sum starting at 0, eps 1e-10).
    nn::optim::AdagradOptions o;
    o.lr = c.lr;
    o.weight_decay = c.weight_decay;
    return Build<nn::optim::Adagrad>(std::move(groups), o);
  }
  if (c.optimizer == "adadelta") {
    nn::optim::AdadeltaOptions o;
    o.lr = c.lr;
    o.weight_decay = c.weight_decay;
    return Build<nn::optim::Adadelta>(std::move(groups), o);
  }
  // ValidateConfig refuses any other name first; this names it all the same.
  throw std::invalid_argument("MakeOptimizer: unknown --optimizer=" + c.optimizer);
}

nn::optim::LrTarget EveryGroupsRate(nn::optim::Optimizer& optimizer) {
  return {[&optimizer] { return optimizer.lr(); },
          [&optimizer](double lr) {
            // A bad rate is refused by group 0's before any group changes.
            for (size_t k = 0; k < optimizer.num_groups(); ++k) optimizer.set_lr(k, lr);
          }};
}

}  // namespace ddp::examples::trainer
